/* hf_config.c: reading the config.json of a published family (loader.h), with the same
 * rules as config.c: a field of the wrong type or out of range is an error naming the
 * field and the value; absent (or null) optional fields keep the default in *out. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "loader.h"

static void shown(const cJSON *item, char *buf, size_t len) {
    char *text = cJSON_PrintUnformatted(item);
    snprintf(buf, len, "%s", text ? text : "?");
    if (strlen(buf) > 60) strcpy(buf + 57, "...");
    cJSON_free(text);
}

tl_status tl_hf_int(const cJSON *root, const char *name, bool required, int lo, int hi, int *out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, name);
    char buf[64];
    if (!item || cJSON_IsNull(item)) {
        if (required) return tl_fail(TL_ERR_FORMAT, "config.json: missing required field \"%s\"", name);
        return TL_OK;
    }
    shown(item, buf, sizeof buf);
    if (!cJSON_IsNumber(item) || item->valuedouble != floor(item->valuedouble))
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" must be an integer, got %s", name, buf);
    if (item->valuedouble < lo || item->valuedouble > hi)
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" = %s is out of range [%d, %d]", name, buf, lo, hi);
    *out = (int)item->valuedouble;
    return TL_OK;
}

tl_status tl_hf_float(const cJSON *root, const char *name, double lo, double hi, float *out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, name);
    char buf[64];
    if (!item || cJSON_IsNull(item)) return TL_OK;
    shown(item, buf, sizeof buf);
    if (!cJSON_IsNumber(item) || !isfinite(item->valuedouble))
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" must be a number, got %s", name, buf);
    return tl_config_float_in_range(name, buf, item->valuedouble, lo, hi, true, out);
}

tl_status tl_hf_bool(const cJSON *root, const char *name, bool *out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, name);
    char buf[64];
    if (!item || cJSON_IsNull(item)) return TL_OK;
    if (!cJSON_IsBool(item)) {
        shown(item, buf, sizeof buf);
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" must be true or false, got %s", name, buf);
    }
    *out = cJSON_IsTrue(item);
    return TL_OK;
}

tl_status tl_hf_string(const cJSON *root, const char *name, const char **out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, name);
    char buf[64];
    *out = NULL;
    if (!item || cJSON_IsNull(item)) return TL_OK;
    if (!cJSON_IsString(item)) {
        shown(item, buf, sizeof buf);
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" must be a string, got %s", name, buf);
    }
    *out = item->valuestring;
    return TL_OK;
}
