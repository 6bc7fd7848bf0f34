/* safetensors_sharded.c: the weight files of a checkpoint directory, one file or the
 * shards of a Hugging Face index:
 *   model.safetensors.index.json = {"metadata": {...}, "weight_map": {"tensor": "shard file"}}
 * The index is the authority: each shard it names must exist, hold every tensor the index
 * maps to it, and hold no tensor the index does not map to it. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "safetensors.h"

#define INDEX_NAME "model.safetensors.index.json"
#define MAX_INDEX_BYTES (64L << 20)

void tl_st_set_close(tl_st_set *set) {
    if (!set) return;
    for (int i = 0; i < set->n_files; i++) {
        tl_st_close(&set->files[i]);
        free(set->paths[i]);
    }
    free(set->files);
    free(set->paths);
    free(set->described_as);
    memset(set, 0, sizeof *set);
}

tl_st_tensor *tl_st_set_find(tl_st_set *set, const char *name, const char **path) {
    for (int i = 0; i < set->n_files; i++) {
        tl_st_tensor *t = tl_st_find(&set->files[i], name);
        if (t) {
            if (path) *path = set->paths[i];
            return t;
        }
    }
    return NULL;
}

static tl_status add_file(tl_st_set *set, const char *path) {
    tl_st_file *files = realloc(set->files, (size_t)(set->n_files + 1) * sizeof *files);
    if (files) set->files = files;
    char **paths = realloc(set->paths, (size_t)(set->n_files + 1) * sizeof *paths);
    if (paths) set->paths = paths;
    char *copy = strdup(path);
    if (!files || !paths || !copy) {
        free(copy);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory opening %s", path);
    }
    tl_status st = tl_st_open(path, &set->files[set->n_files]);
    if (st != TL_OK) { free(copy); return st; }
    set->paths[set->n_files++] = copy;
    return TL_OK;
}

static tl_status read_index(const char *path, cJSON **out) {
    *out = NULL;
    char *text = NULL;
    size_t len = 0;
    tl_status st = tl_read_regular(path, (size_t)MAX_INDEX_BYTES, &text, &len); /* (a FIFO is refused, not waited on) */
    if (st != TL_OK) return st;
    char why[200];
    const int rc = tl_json_read_strict(text, len, out, why, sizeof why);
    free(text);
    return rc == 0 ? TL_OK : tl_fail(rc == -2 ? TL_ERR_NO_MEMORY : TL_ERR_FORMAT, "%s: %s", path, why);
}

/* The shard file names the index uses, each once, checked to be plain .safetensors names
   in the checkpoint directory (an index must not reach outside it). */
static tl_status open_shards(const char *dir, const char *index_path, const cJSON *map, tl_st_set *set) {
    char path[4096];
    for (const cJSON *e = map->child; e; e = e->next) {
        if (!cJSON_IsString(e))
            return tl_fail(TL_ERR_FORMAT, "%s: weight_map entry \"%s\" is not a file name", index_path, e->string);
        const char *shard = e->valuestring;
        size_t n = strlen(shard);
        if (n < 12 || strcmp(shard + n - 12, ".safetensors") != 0 || strchr(shard, '/') || shard[0] == '.')
            return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" maps to \"%s\", not a .safetensors file in the "
                           "checkpoint directory", index_path, e->string, shard);
        snprintf(path, sizeof path, "%s/%s", dir, shard);
        bool seen = false;
        for (int i = 0; i < set->n_files && !seen; i++) seen = strcmp(set->paths[i], path) == 0;
        if (seen) continue;
        struct stat sb;
        if (stat(path, &sb) != 0)
            return tl_fail(TL_ERR_IO, "%s: shard \"%s\" (holding tensor \"%s\") is missing: %s", index_path,
                           shard, e->string, strerror(errno));
        tl_status st = add_file(set, path);
        if (st != TL_OK) return st;
    }
    return TL_OK;
}

/* Map entries by their keys (qsort's and bsearch's comparison). */
static int by_key(const void *a, const void *b) {
    return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

/* The map's entry for tensor `name` among its n entries sorted by key. */
static const cJSON *map_entry(const cJSON **sorted, int n, const char *name) {
    const cJSON key = {.string = (char *)name}, *key_ptr = &key;
    const cJSON **found = n > 0 ? bsearch(&key_ptr, sorted, (size_t)n, sizeof *sorted, by_key) : NULL;
    return found ? *found : NULL;
}

/* Every tensor where the index says, and nothing the index does not list (a tensor the map
   names twice was refused as a duplicate key, read_index). Each shard's tensors are checked
   first, so that a tensor two shards hold is named as such, not as missing from the one the
   map names. Lookups are binary searches on both sides: a checkpoint of tens of thousands of
   tensors loads in O(n log n), not O(n^2). */
static tl_status check_against_index(const char *index_path, const cJSON *map, tl_st_set *set) {
    int n_entries = 0;
    for (const cJSON *e = map->child; e; e = e->next) n_entries++;
    const cJSON **sorted = malloc(((size_t)n_entries + 1) * sizeof *sorted);
    if (!sorted) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    int k = 0;
    for (const cJSON *e = map->child; e; e = e->next) sorted[k++] = e;
    qsort(sorted, (size_t)n_entries, sizeof *sorted, by_key);
    tl_status st = TL_OK;
    for (int i = 0; i < set->n_files && st == TL_OK; i++)
        for (int t = 0; t < set->files[i].n_tensors && st == TL_OK; t++) {
            const char *name = set->files[i].tensors[t].name;
            const cJSON *entry = map_entry(sorted, n_entries, name);
            const char *base = strrchr(set->paths[i], '/');
            base = base ? base + 1 : set->paths[i];
            if (!entry)
                st = tl_fail(TL_ERR_FORMAT, "%s: holds tensor \"%s\", which %s does not list", set->paths[i], name, index_path);
            else if (strcmp(entry->valuestring, base) != 0)
                st = tl_fail(TL_ERR_FORMAT, "%s: holds tensor \"%s\", which %s maps to shard \"%s\"", set->paths[i], name,
                             index_path, entry->valuestring);
        }
    const char *dir_end;
    for (const cJSON *e = map->child; e && st == TL_OK; e = e->next) {
        const char *found_in = NULL;
        if (!tl_st_set_find(set, e->string, &found_in) ||
            strcmp((dir_end = strrchr(found_in, '/')) ? dir_end + 1 : found_in, e->valuestring) != 0)
            st = tl_fail(TL_ERR_FORMAT, "%s: names tensor \"%s\" in shard \"%s\", which does not hold it",
                         index_path, e->string, e->valuestring);
    }
    free(sorted);
    return st;
}

bool tl_st_is_sharded(const char *dir) {
    char path[4096];
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", dir, INDEX_NAME);
    return lstat(path, &sb) == 0;
}

tl_status tl_st_set_open(const char *dir, tl_st_set *out) {
    memset(out, 0, sizeof *out);
    char path[4096];
    tl_status st;
    if (!tl_st_is_sharded(dir)) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if (!(out->described_as = strdup(path))) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        st = add_file(out, path);
    } else {
        snprintf(path, sizeof path, "%s/%s", dir, INDEX_NAME);
        if (!(out->described_as = strdup(path))) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        cJSON *index = NULL;
        st = read_index(path, &index);
        const cJSON *map = st == TL_OK ? cJSON_GetObjectItemCaseSensitive(index, "weight_map") : NULL;
        if (st == TL_OK && (!cJSON_IsObject(map) || !map->child))
            st = tl_fail(TL_ERR_FORMAT, "%s: no \"weight_map\" object naming the shards", path);
        if (st == TL_OK) st = open_shards(dir, path, map, out);
        if (st == TL_OK) st = check_against_index(path, map, out);
        cJSON_Delete(index);
    }
    if (st != TL_OK) tl_st_set_close(out);
    return st;
}
