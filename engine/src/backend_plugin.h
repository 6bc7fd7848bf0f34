/* backend_plugin.h: backends built as separate shared libraries (libtinyloop-cuda.so), so
 * that libtinyloop itself links no device library and loads on machines without one.
 *
 * The engine dlopens the plugin and calls its entry point with the host services a backend
 * needs from the engine (whose own symbols are hidden): the error reporter and the KV
 * cache's copy-on-write. The plugin is built from the same tree, so it shares the engine's
 * struct layouts; the sizes in tl_backend_host catch a plugin from another build. */
#ifndef TL_BACKEND_PLUGIN_H
#define TL_BACKEND_PLUGIN_H

#include <stdbool.h>
#include <stddef.h>

#include "backend.h"

/* Raised whenever a struct the two sides share changes in a way the sizes below miss
   (2: tl_attention_args.row). */
#define TL_BACKEND_PLUGIN_ABI 2
#define TL_CUDA_PLUGIN_FILE "libtinyloop-cuda.so"
#define TL_CUDA_PLUGIN_ENTRY "tl_cuda_backend_plugin"

typedef struct tl_backend_host {
    int abi; /* TL_BACKEND_PLUGIN_ABI */
    size_t sizeof_model, sizeof_config, sizeof_kv_cache, sizeof_backend;
    tl_status (*fail)(tl_status status, const char *fmt, ...);
    bool (*kv_writable)(tl_kv_cache *c, int slot, int logical, void **k, void **v);
} tl_backend_host;

/* The entry point: the backend when the plugin can serve (a device is present), else NULL
   with the reason in why[why_len] ("no CUDA device: ..."). */
typedef const tl_backend *(*tl_backend_plugin_entry)(const tl_backend_host *host, char *why, size_t why_len);

/* The engine side (backend_plugin.c): the CUDA backend, loaded once per process, or NULL
   with *why naming the cause (no plugin in this build or install, no device, a plugin from
   another build). Sets no error: under AUTO a missing GPU is not one. */
const tl_backend *tl_backend_cuda(const char **why);

/* Whether `self`, the absolute real name of the file holding the library's code, lies in the
   build tree `build_dir`: only then is the tree's plugin looked for (the tests and tools, linked
   with the static library). An installed copy looked there too, and a file planted after the
   package was built (a build directory in /tmp, removed and made again by anyone) ran its code
   in every process using the library. */
bool tl_plugin_in_build_tree(const char *self, const char *build_dir);

#endif
