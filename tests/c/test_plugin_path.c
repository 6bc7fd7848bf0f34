/* test_plugin_path.c: the CUDA plugin is looked for beside the file that holds the library,
 * by that file's absolute name, never by a name relative to the working directory.
 *
 * Linked with libtinyloop.a and run by a relative name (./test_plugin_path, as a user runs a
 * program), dladdr names the library's file "./test_plugin_path": after a chdir, the plugin
 * looked for beside it was "./libtinyloop-cuda.so" in the new working directory, and a
 * library planted there ran its code in the process on the first model load (the default
 * backend, TL_BACKEND_AUTO, tries the plugin).
 *
 * usage: test_plugin_path MODEL_DIR PLANTED_DIR (absolute: PLANTED_DIR holds a
 * libtinyloop-cuda.so whose constructor sets TL_PLANTED_PLUGIN_RAN) */
#define _POSIX_C_SOURCE 200809L /* chdir, execv */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h> /* mkdir */
#include <unistd.h>

#include "backend_plugin.h"
#include "check.h"
#include "tinyloop.h"

/* The build tree's plugin is looked for only by code that lies in that tree: an installed
   copy of the library looked in the directory it was built in, where a file planted after the
   package was built ran in every process using it. `scratch`: a directory to make links in. */
static void build_tree_rule(const char *scratch) {
    CHECK(tl_plugin_in_build_tree("/src/build/tests/test_cuda", "/src/build"), "a test in the tree");
    CHECK(tl_plugin_in_build_tree("/src/build/libtinyloop.so", "/src/build/"), "the tree's library (a trailing slash)");
    CHECK(!tl_plugin_in_build_tree("/usr/local/lib/libtinyloop.so.0", "/src/build"), "an installed copy");
    CHECK(!tl_plugin_in_build_tree("/src/build-asan/libtinyloop.so", "/src/build"), "another tree whose name begins alike");
    CHECK(!tl_plugin_in_build_tree("/src/build", "/src/build"), "the directory itself is no file in it");
    /* a tree named through a link: the file's name is the real one (/proc/self/maps) */
    char real[4200], link[4200], file[4300];
    snprintf(real, sizeof real, "%s/real-tree", scratch);
    snprintf(link, sizeof link, "%s/linked-tree", scratch);
    snprintf(file, sizeof file, "%s/tests/test_cuda", real);
    unlink(link);
    CHECK((mkdir(real, 0755) == 0 || access(real, F_OK) == 0) && symlink(real, link) == 0, "links in %s", scratch);
    CHECK(tl_plugin_in_build_tree(file, link), "a tree named through a link: %s in %s", file, link);
    unlink(link);
    rmdir(real);
}

int main(int argc, char **argv) {
    if (argc != 3 || argv[1][0] != '/' || argv[2][0] != '/') {
        fprintf(stderr, "usage: test_plugin_path MODEL_DIR PLANTED_DIR (absolute paths)\n");
        return 2;
    }
    const char *slash = strrchr(argv[0], '/');
    if (argv[0][0] == '/' && slash) {
        /* run again by a relative name, from the program's own directory */
        char dir[4096], relative[4200];
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - argv[0]), argv[0]);
        snprintf(relative, sizeof relative, "./%s", slash + 1);
        if (chdir(dir) != 0) return 2;
        char *again[] = {relative, argv[1], argv[2], NULL};
        execv(relative, again);
        perror("execv");
        return 2;
    }
    build_tree_rule(argv[2]);
    CHECK(chdir(argv[2]) == 0, "chdir %s", argv[2]);
    tl_load_options opts;
    tl_load_options_init(&opts);
    opts.backend = TL_BACKEND_AUTO;
    tl_model *m = NULL;
    const tl_status st = tl_model_load(argv[1], &opts, &m);
    CHECK(st == TL_OK, "load: %s", tl_last_error());
    CHECK(getenv("TL_PLANTED_PLUGIN_RAN") == NULL,
          "a libtinyloop-cuda.so in the working directory (%s) was loaded: the plugin was looked for by a relative name", argv[2]);
    tl_model_free(m);
    return check_summary();
}
