/* planted_plugin.c: a libtinyloop-cuda.so that is not TinyLoop's, for test_plugin_path: it
 * says, by an environment variable, that a process loaded it. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdlib.h>

__attribute__((constructor)) static void planted_plugin_ran(void) { setenv("TL_PLANTED_PLUGIN_RAN", "1", 1); }
