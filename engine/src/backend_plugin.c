/* backend_plugin.c: finds and loads the CUDA backend plugin (backend_plugin.h), once per
 * process. Where it looks, in order: $TINYLOOP_CUDA_PLUGIN (a file), the directory of the
 * library or program holding this code (an install puts the plugin beside libtinyloop.so),
 * the build tree this code was built in where that file lies in it (tests and tools linked
 * with the static library), then the dynamic linker's own search (LD_LIBRARY_PATH,
 * ld.so.conf). */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <inttypes.h>
#include <limits.h> /* PATH_MAX */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* access */

#include "backend_plugin.h"

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static const tl_backend *cuda_backend;
static char cuda_why[768];

/* dlopen of one candidate. A file that is there but does not load (a CUDA runtime missing,
   a plugin of another ABI) is the cause worth telling: the first such error is kept in
   `tried`, which the later candidates' "no such file" must not overwrite. */
static void *open_candidate(const char *path, char *opened, size_t opened_len, char *tried, size_t tried_len) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h) snprintf(opened, opened_len, "%s", path);
    else if (!tried[0] && access(path, F_OK) == 0) snprintf(tried, tried_len, "%s: %s", path, dlerror());
    return h;
}

/* The absolute name of the file the code at `address` was mapped from: the kernel's, from
   /proc/self/maps, else dladdr's where that is absolute. dladdr gives the name the loader was
   handed, argv[0] for a program linked with libtinyloop.a or a relative LD_LIBRARY_PATH's
   entry for the library: read after a chdir, that named a directory of the caller's working
   directory, and a libtinyloop-cuda.so planted there ran its code in the process. */
static bool file_holding(const void *address, char *out, size_t out_len) {
    const uintptr_t at = (uintptr_t)address;
    FILE *maps = fopen("/proc/self/maps", "re");
    if (maps) {
        char line[4400];
        bool found = false;
        while (fgets(line, sizeof line, maps)) {
            uintptr_t low, high;
            int name_at = 0;
            if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %*s %*s %*s %*s %n", &low, &high, &name_at) != 2 || !name_at ||
                at < low || at >= high)
                continue;
            line[strcspn(line, "\n")] = '\0';
            found = line[name_at] == '/' && (size_t)snprintf(out, out_len, "%s", line + name_at) < out_len;
            break; /* the one mapping holding it: a name or none */
        }
        fclose(maps);
        if (found) return true;
    }
    Dl_info info; /* (resolved as the kernel's name is: tl_plugin_in_build_tree compares real names) */
    char real[PATH_MAX];
    return dladdr(address, &info) && info.dli_fname && info.dli_fname[0] == '/' && realpath(info.dli_fname, real) &&
           (size_t)snprintf(out, out_len, "%s", real) < out_len;
}

bool tl_plugin_in_build_tree(const char *self, const char *build_dir) {
    char real[PATH_MAX];
    const char *dir = realpath(build_dir, real) ? real : build_dir; /* (self is a real path) */
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    return n > 0 && strncmp(self, dir, n) == 0 && self[n] == '/';
}

/* The plugin's handle, the file it came from in `opened`; or NULL with why in `tried`. */
static void *open_plugin(char *opened, size_t opened_len, char *tried, size_t tried_len) {
    const char *env = getenv("TINYLOOP_CUDA_PLUGIN");
    if (env && *env) {
        void *h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (h) snprintf(opened, opened_len, "%s", env);
        else snprintf(tried, tried_len, "TINYLOOP_CUDA_PLUGIN=%s: %s", env, dlerror());
        return h;
    }
    char path[4200], self[4096];
    const char *slash;
    const bool have_self = file_holding((const void *)open_plugin, self, sizeof self);
    if (have_self && (slash = strrchr(self, '/'))) {
        snprintf(path, sizeof path, "%.*s/%s", (int)(slash - self), self, TL_CUDA_PLUGIN_FILE);
        void *h = open_candidate(path, opened, opened_len, tried, tried_len);
        if (h) return h;
    }
#ifdef TL_PLUGIN_BUILD_DIR
    /* (the tree by its real name, checked and opened alike: a link swapped in between could
       have passed the check and named another directory at the open) */
    char tree[PATH_MAX];
    if (have_self && realpath(TL_PLUGIN_BUILD_DIR, tree) && tl_plugin_in_build_tree(self, tree)) {
        snprintf(path, sizeof path, "%s/%s", tree, TL_CUDA_PLUGIN_FILE);
        void *h = open_candidate(path, opened, opened_len, tried, tried_len);
        if (h) return h;
    }
#endif
    void *found = dlopen(TL_CUDA_PLUGIN_FILE, RTLD_NOW | RTLD_LOCAL);
    if (found) snprintf(opened, opened_len, "%s", TL_CUDA_PLUGIN_FILE);
    else if (!tried[0]) snprintf(tried, tried_len, "%s", dlerror());
    return found;
}

static void load_cuda(void) {
    char tried[512] = "", opened[4200] = "";
    void *h = open_plugin(opened, sizeof opened, tried, sizeof tried);
    if (!h) {
        snprintf(cuda_why, sizeof cuda_why,
                 "the CUDA plugin %s could not be loaded (built when CMake finds nvcc, "
                 "-DTINYLOOP_CUDA=AUTO|ON): %s", TL_CUDA_PLUGIN_FILE, tried);
        return;
    }
    tl_backend_plugin_entry entry;
    *(void **)&entry = dlsym(h, TL_CUDA_PLUGIN_ENTRY);
    if (!entry) {
        snprintf(cuda_why, sizeof cuda_why, "%.600s has no entry point %s", opened, TL_CUDA_PLUGIN_ENTRY);
        return;
    }
    const tl_backend_host host = {TL_BACKEND_PLUGIN_ABI, sizeof(tl_model), sizeof(tl_config), sizeof(tl_kv_cache),
                                  sizeof(tl_backend), tl_fail, tl_kv_writable};
    char why[512] = "";
    cuda_backend = entry(&host, why, sizeof why);
    if (!cuda_backend) snprintf(cuda_why, sizeof cuda_why, "%s", why[0] ? why : "the CUDA plugin refused to start");
    /* The handle stays open for the process: the backend's code lives in it. */
}

const tl_backend *tl_backend_cuda(const char **why) {
    pthread_once(&load_once, load_cuda);
    *why = cuda_why;
    return cuda_backend;
}
