/* Byte-level BPE tokenizer: tokenizer.json loading, encoding and decoding.
 *
 * The goal is token-for-token agreement with Hugging Face `tokenizers` on
 * byte-level BPE models (GPT-2, Huginn-0125, Ouro; the pre-tokenizer pipeline
 * is pretokenizer.c), so every place where we follow one of its quirks says so.
 * See tokenizer.h for the contract.
 */
#include "tokenizer.h"
#include "internal.h"
#include "pretokenizer.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <stdatomic.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Ids index per-id arrays, so a hostile file with id 2^31 would make us
   allocate gigabytes; real vocabularies stay far below this (~260k). */
#define TLZ_MAX_ID (1 << 24)

enum { TOKF_USED = 1, TOKF_SPECIAL = 2, TOKF_VOCAB = 4, TOKF_ADDED = 8 };

typedef struct {
    uint64_t key;   /* (left id << 32) | right id */
    int32_t rank;   /* -1: empty slot */
    int32_t id;     /* id of the merged token */
} merge_slot;

typedef struct {
    char *p;
    size_t n, cap;
} bytebuf;

typedef struct {
    char *text;     /* literal content, matched byte for byte */
    size_t len;
    int32_t id;
    bool lstrip, rstrip; /* the match takes the whitespace before (after) it too, as HF's */
    bool normalized;     /* matched in HF's second pass, in what the first left */
    int32_t same_text;   /* the next added token of the same text (t->added's order), or -1 */
} added_token;

/* The added tokens' texts as a byte trie, so that matching at a position walks the text once
   instead of comparing every added token (a checkpoint may have thousands, most of them
   starting with the same "<|"). Node 0 is the root; a node's child by a byte is found in an
   open-addressing table keyed (node, byte); a node's `token` is the first added token (in
   t->added's order) whose text ends there, the others of that text chained by same_text. */
typedef struct {
    uint64_t *keys;      /* (node << 8 | byte) + 1; 0 = empty */
    int32_t *child;      /* the child node of each key */
    uint32_t mask;       /* table size - 1 (a power of two) */
    int32_t *token;      /* [n_nodes] index into t->added, or -1 */
    int32_t n_nodes;
} added_trie;

struct tl_tlz_tokenizer {
    int32_t n_ids;
    uint8_t *flags;          /* TOKF_* per id */
    uint32_t *raw_off;       /* raw bytes of id i: raw + raw_off[i], raw_len[i] */
    uint32_t *raw_len;
    bytebuf raw;
    uint32_t *str_off;       /* byte-level vocab spelling of id i (TOKF_VOCAB only) */
    uint32_t *str_len;
    bytebuf str;

    int32_t *vocab_slots;    /* open addressing: vocab spelling -> id, -1 empty */
    uint32_t vocab_mask;
    merge_slot *merge_slots; /* (left, right) -> rank, merged id */
    uint32_t merge_mask;

    int32_t byte_id[256];    /* token of each single byte, -1 if the vocab lacks it */
    int32_t unk_id;          /* -1 when the model has no unk_token */
    bool fuse_unk;           /* model.fuse_unk: a run of bytes without a token is one unk_token */

    added_token *added;      /* sorted by decreasing length, then id */
    size_t n_added;
    uint8_t added_first[256];/* 1 if some added token starts with this byte */
    added_trie trie;         /* the added tokens' texts */

    tl_tlz_pretok *pre;         /* the pre_tokenizer pipeline (pretokenizer.c) */
    uint64_t serial;         /* tl_tlz_serial */
};

uint64_t tl_tlz_serial(const tl_tlz_tokenizer *tok) { return tok ? tok->serial : 0; }

/* ---------------------------------------------------------------- helpers */

int tl_tlz_fail(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* Token strings go into messages; escape them so that a control byte or a
   huge token cannot garble the log line, nor the quote character the message
   puts around them end the quoted text early. */
const char *tl_tlz_quote_in(const char *s, size_t n, char quote, char *buf, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n && o + 8 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f || c == (unsigned char)quote || c == '\\')
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", c);
        else
            buf[o++] = (char)c;
        if (i + 1 < n && o + 8 >= cap) {
            memcpy(buf + o, "...", 3);
            o += 3;
            break;
        }
    }
    buf[o] = '\0';
    return buf;
}

const char *tl_tlz_quote(const char *s, size_t n, char *buf, size_t cap)
{
    return tl_tlz_quote_in(s, n, '\'', buf, cap);
}

int tl_tlz_utf8_seq(const unsigned char *p, size_t n)
{
    unsigned c = p[0];
    if (c < 0x80) return 1;
    int len;
    unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;      /* overlong */
        else if (c == 0xED) hi = 0x9F; /* surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;      /* overlong */
        else if (c == 0xF4) hi = 0x8F; /* > U+10FFFF */
    } else {
        return -1;
    }
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n) return 0;
        unsigned b = p[i];
        if (b < lo || b > hi) return -1;
        lo = 0x80;
        hi = 0xBF;
    }
    return len;
}

uint32_t tl_tlz_utf8_value(const unsigned char *p, int len)
{
    uint32_t v = len == 1 ? p[0] : p[0] & (0xFFu >> (len + 1));
    for (int i = 1; i < len; i++) v = (v << 6) | (p[i] & 0x3Fu);
    return v;
}

size_t tl_tlz_utf8_unfinished_tail(const unsigned char *p, size_t n)
{
    /* The last lead byte within reach decides: a sequence is at most 4 bytes long. */
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        if ((p[n - back] & 0xC0) != 0x80)
            return tl_tlz_utf8_seq(p + n - back, back) == 0 ? back : 0;
    }
    return 0;
}

static size_t utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2; /* the byte-level alphabet stays below U+0800 */
}

static uint32_t utf8_get(const unsigned char *p, int len)
{
    if (len == 1) return p[0];
    uint32_t cp = p[0] & (0x7F >> len);
    for (int i = 1; i < len; i++) cp = (cp << 6) | (p[i] & 0x3F);
    return cp;
}

/* GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves,
   the other 68 bytes are moved to U+0100.. so that every byte has a visible,
   non-space character. cp_to_byte is its inverse over U+0000..U+0143. */
enum { BYTE_CP_LIMIT = 0x144 };
static void byte_level_tables(uint32_t byte_to_cp[256], int16_t cp_to_byte[BYTE_CP_LIMIT])
{
    uint32_t n = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        byte_to_cp[b] = printable ? (uint32_t)b : 256 + n++;
    }
    for (int i = 0; i < BYTE_CP_LIMIT; i++) cp_to_byte[i] = -1;
    for (int b = 0; b < 256; b++) cp_to_byte[byte_to_cp[b]] = (int16_t)b;
}

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_pair(uint64_t k)
{
    k ^= k >> 33; /* murmur3 finaliser: ids are small and dense */
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

static uint32_t table_size(size_t n)
{
    uint32_t cap = 16;
    while (cap < 2 * n) cap <<= 1; /* load factor <= 1/2 keeps probes short */
    return cap;
}

static int32_t vocab_find(const tl_tlz_tokenizer *t, const char *s, size_t n)
{
    if (!t->vocab_slots) return -1;
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->vocab_mask;
    for (;;) {
        int32_t id = t->vocab_slots[i];
        if (id < 0) return -1;
        if (t->str_len[id] == n && memcmp(t->str.p + t->str_off[id], s, n) == 0) return id;
        i = (i + 1) & t->vocab_mask;
    }
}

static const merge_slot *merge_find(const tl_tlz_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t i = (uint32_t)hash_pair(key) & t->merge_mask;
    for (;;) {
        const merge_slot *s = &t->merge_slots[i];
        if (s->rank < 0) return NULL;
        if (s->key == key) return s;
        i = (i + 1) & t->merge_mask;
    }
}

/* ------------------------------------------------------------------ load */

/* Through the loader's one rule for checkpoint files (internal.h: regular files only, never
   blocking on a FIFO, a size cap); its message becomes this module's err. */
static int read_file(const char *path, char **data, size_t *len, char *err, size_t errlen)
{
    tl_status st = tl_read_regular(path, TL_MAX_TOKENIZER_BYTES, data, len);
    if (st == TL_OK) return TLZ_OK;
    return tl_tlz_fail(err, errlen, st == TL_ERR_NO_MEMORY ? TLZ_ENOMEM : st == TL_ERR_FORMAT ? TLZ_EFORMAT : TLZ_EIO,
                    "%s", tl_last_error());
}

int tl_tlz_tokenizer_load(const char *path, tl_tlz_tokenizer **out, char *err, size_t errlen)
{
    if (out) *out = NULL;
    if (!path || !out) return tl_tlz_fail(err, errlen, TLZ_EINVAL, "tl_tlz_tokenizer_load: NULL argument");
    char *data = NULL;
    size_t len = 0;
    int rc = read_file(path, &data, &len, err, errlen);
    if (rc) return rc;
    rc = tl_tlz_tokenizer_load_json(data, len, out, err, errlen);
    free(data);
    if (rc && err && errlen) {
        /* Name the file: the caller often loads several. */
        size_t used = strlen(err);
        if (used + 8 < errlen) snprintf(err + used, errlen - used, " (in '%s')", path);
    }
    return rc;
}

/* A JSON number that is an id: integral, in range. */
static int json_id(const cJSON *v, int32_t *id)
{
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0 && d < TLZ_MAX_ID) || floor(d) != d) return 0;
    *id = (int32_t)d;
    return 1;
}

static int json_bool(const cJSON *obj, const char *key, int dflt, int *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) { *out = dflt; return 1; }
    if (!cJSON_IsBool(v)) return 0;
    *out = cJSON_IsTrue(v) ? 1 : 0;
    return 1;
}

/* Rejects model options that would change tokenisation in ways we do not
   implement; silently ignoring them would give wrong ids, not an error. */
static int check_model_options(const cJSON *model, char *err, size_t errlen)
{
    int on;
    if (!json_bool(model, "byte_fallback", 0, &on) || on)
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.byte_fallback is not supported (byte-level BPE only)");
    if (!json_bool(model, "ignore_merges", 0, &on) || on)
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.ignore_merges is not supported");
    /* (HF skips each merge with this probability: other ids at random) */
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (dropout && !cJSON_IsNull(dropout) && !(cJSON_IsNumber(dropout) && dropout->valuedouble == 0))
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.dropout is not supported (BPE dropout skips merges at random): "
                        "it must be null or 0");
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    if (unk && !cJSON_IsNull(unk) && !cJSON_IsString(unk))
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.unk_token must be a string or null");
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < 2; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(model, affixes[i]);
        if (v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && v->valuestring[0] == '\0'))
            return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.%s is not supported (must be empty or null)", affixes[i]);
    }
    return TLZ_OK;
}

/* The decoder turns ids back into text: byte-level BPE's is ByteLevel (what tl_tlz_decode does);
   another (WordPiece's "##" joins, Metaspace, Strip...) would give other text. null is taken
   as ByteLevel. */
static int check_decoder(const cJSON *root, char *err, size_t errlen)
{
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(root, "decoder");
    if (!d || cJSON_IsNull(d)) return TLZ_OK;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(d, "type");
    const char *name = cJSON_IsString(type) ? type->valuestring : "?";
    if (strcmp(name, "ByteLevel") == 0) return TLZ_OK;
    if (strcmp(name, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(d, "decoders");
        /* (ByteLevel ones only, one at least: an empty list maps no bytes in HF, and was read
           as ByteLevel) */
        bool byte_level = cJSON_IsArray(list) && list->child;
        for (const cJSON *e = byte_level ? list->child : NULL; e && byte_level; e = e->next) {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(e, "type");
            byte_level = cJSON_IsString(t) && strcmp(t->valuestring, "ByteLevel") == 0;
        }
        if (byte_level) return TLZ_OK;
    }
    return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "decoder '%s' is not supported (only ByteLevel, or null)", name);
}

static int check_normalizer(const cJSON *root, char *err, size_t errlen)
{
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    if (!n || cJSON_IsNull(n)) return TLZ_OK;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(n, "type");
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "normalizers");
    if (cJSON_IsString(type) && strcmp(type->valuestring, "Sequence") == 0 &&
        cJSON_IsArray(list) && cJSON_GetArraySize(list) == 0)
        return TLZ_OK; /* an empty sequence changes nothing */
    return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "normalizer '%s' is not supported (only null)",
                    cJSON_IsString(type) ? type->valuestring : "?");
}

/* Decodes a byte-level vocab spelling into raw bytes. Like the HF ByteLevel
   decoder, a token with a character outside the byte alphabet is taken as
   its own UTF-8 bytes. Returns the length written to out (cap >= n). */
static size_t spelling_to_raw(const char *s, size_t n, const int16_t cp_to_byte[BYTE_CP_LIMIT], char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        int k = tl_tlz_utf8_seq((const unsigned char *)s + i, n - i);
        if (k <= 0) goto verbatim;
        uint32_t cp = utf8_get((const unsigned char *)s + i, k);
        if (cp >= BYTE_CP_LIMIT || cp_to_byte[cp] < 0) goto verbatim;
        out[o++] = (char)cp_to_byte[cp];
        i += (size_t)k;
    }
    return o;
verbatim:
    memcpy(out, s, n);
    return n;
}

static int buf_put(bytebuf *b, const char *s, size_t n, uint32_t *off)
{
    if (b->n + n > UINT32_MAX) return 0;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) return 0;
        b->p = np;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    *off = (uint32_t)b->n;
    b->n += n;
    return 1;
}

static int added_cmp(const void *a, const void *b)
{
    const added_token *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The table slot of trie node `node`'s child by byte `b`: its own, or the empty one where it
   would go (the table is never full). */
static uint32_t trie_slot(const added_trie *tr, int32_t node, unsigned char b)
{
    const uint64_t key = ((uint64_t)node << 8 | b) + 1;
    uint32_t i = (uint32_t)hash_pair(key) & tr->mask;
    while (tr->keys[i] && tr->keys[i] != key) i = (i + 1) & tr->mask;
    return i;
}

/* The child of trie node `node` by byte `b`, or -1. */
static int32_t trie_child(const added_trie *tr, int32_t node, unsigned char b)
{
    const uint32_t i = trie_slot(tr, node, b);
    return tr->keys[i] ? tr->child[i] : -1;
}

/* t->trie from t->added (sorted: a text's tokens are chained in that order). 0 out of memory. */
static int build_added_trie(tl_tlz_tokenizer *t)
{
    added_trie *tr = &t->trie;
    size_t bytes = 0;
    for (size_t i = 0; i < t->n_added; i++) bytes += t->added[i].len;
    if (bytes > (size_t)INT32_MAX / 4) return 0;
    uint32_t cap = 16;
    while (cap < 2 * (bytes + 1)) cap *= 2;
    tr->keys = calloc(cap, sizeof *tr->keys);
    tr->child = malloc(cap * sizeof *tr->child);
    tr->token = malloc((bytes + 1) * sizeof *tr->token);
    if (!tr->keys || !tr->child || !tr->token) return 0;
    tr->mask = cap - 1;
    tr->token[0] = -1;
    tr->n_nodes = 1;
    for (size_t i = 0; i < t->n_added; i++) {
        added_token *a = &t->added[i];
        a->same_text = -1;
        int32_t node = 0;
        for (size_t k = 0; k < a->len; k++) {
            const unsigned char b = (unsigned char)a->text[k];
            const uint32_t slot = trie_slot(tr, node, b);
            if (!tr->keys[slot]) { /* a new node: the table has room for every byte of every text */
                tr->keys[slot] = ((uint64_t)node << 8 | b) + 1;
                tr->child[slot] = tr->n_nodes;
                tr->token[tr->n_nodes++] = -1;
            }
            node = tr->child[slot];
        }
        if (tr->token[node] < 0) {
            tr->token[node] = (int32_t)i;
        } else {
            int32_t last = tr->token[node];
            while (t->added[last].same_text >= 0) last = t->added[last].same_text;
            t->added[last].same_text = (int32_t)i;
        }
    }
    return 1;
}

static int load_vocab(tl_tlz_tokenizer *t, const cJSON *vocab, const cJSON *added_json,
                      const int16_t cp_to_byte[BYTE_CP_LIMIT], char *err, size_t errlen)
{
    char q1[64], q2[64];
    /* Pass 1: ids must be known before the per-id arrays are sized. */
    int32_t max_id = -1;
    size_t n_vocab = 0;
    for (const cJSON *e = vocab->child; e; e = e->next) {
        int32_t id;
        if (!json_id(e, &id))
            return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.vocab entry '%s': id must be an integer in [0, %d)",
                            tl_tlz_quote(e->string, strlen(e->string), q1, sizeof q1), TLZ_MAX_ID);
        if (e->string[0] == '\0')
            return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.vocab has an empty token string (id %d)", (int)id);
        if (id > max_id) max_id = id;
        n_vocab++;
    }
    if (n_vocab == 0) return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.vocab is empty");
    if (added_json) {
        int i = 0;
        for (const cJSON *e = added_json->child; e; e = e->next, i++) {
            int32_t id;
            const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
            if (!json_id(cJSON_GetObjectItemCaseSensitive(e, "id"), &id))
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens[%d]: \"id\" must be an integer in [0, %d)", i, TLZ_MAX_ID);
            if (!cJSON_IsString(content) || content->valuestring[0] == '\0')
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens[%d]: \"content\" must be a non-empty string", i);
            if (id > max_id) max_id = id;
        }
    }
    t->n_ids = max_id + 1;
    size_t n = (size_t)t->n_ids;
    t->flags = calloc(n, 1);
    t->raw_off = calloc(n, sizeof *t->raw_off);
    t->raw_len = calloc(n, sizeof *t->raw_len);
    t->str_off = calloc(n, sizeof *t->str_off);
    t->str_len = calloc(n, sizeof *t->str_len);
    uint32_t vcap = table_size(n_vocab);
    t->vocab_slots = malloc(vcap * sizeof *t->vocab_slots);
    char *tmp = NULL;
    size_t tmp_cap = 0;
    if (!t->flags || !t->raw_off || !t->raw_len || !t->str_off || !t->str_len || !t->vocab_slots)
        return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading the vocab");
    memset(t->vocab_slots, 0xff, vcap * sizeof *t->vocab_slots);
    t->vocab_mask = vcap - 1;

    /* Pass 2: fill. */
    for (const cJSON *e = vocab->child; e; e = e->next) {
        int32_t id = (int32_t)e->valuedouble;
        size_t len = strlen(e->string);
        if (t->flags[id] & TOKF_VOCAB) {
            free(tmp);
            return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.vocab: id %d is used by both '%s' and '%s'", (int)id,
                            tl_tlz_quote(t->str.p + t->str_off[id], t->str_len[id], q1, sizeof q1),
                            tl_tlz_quote(e->string, len, q2, sizeof q2));
        }
        if (len > tmp_cap) {
            char *nt = realloc(tmp, len * 2);
            if (!nt) { free(tmp); return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading the vocab"); }
            tmp = nt;
            tmp_cap = len * 2;
        }
        size_t rlen = spelling_to_raw(e->string, len, cp_to_byte, tmp);
        if (!buf_put(&t->str, e->string, len, &t->str_off[id]) || !buf_put(&t->raw, tmp, rlen, &t->raw_off[id])) {
            free(tmp);
            return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading the vocab");
        }
        t->str_len[id] = (uint32_t)len;
        t->raw_len[id] = (uint32_t)rlen;
        t->flags[id] |= TOKF_USED | TOKF_VOCAB;
        uint32_t i = (uint32_t)hash_bytes(e->string, len) & t->vocab_mask;
        while (t->vocab_slots[i] >= 0) i = (i + 1) & t->vocab_mask;
        t->vocab_slots[i] = id;
    }
    free(tmp);

    /* Added tokens: their literal content is both what encode matches and
       what decode prints (HF looks ids up in the added vocabulary first). */
    if (added_json) {
        size_t na = (size_t)cJSON_GetArraySize(added_json);
        t->added = calloc(na ? na : 1, sizeof *t->added);
        if (!t->added) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading added_tokens");
        for (const cJSON *e = added_json->child; e; e = e->next) {
            int32_t id = (int32_t)cJSON_GetObjectItemCaseSensitive(e, "id")->valuedouble;
            const char *s = cJSON_GetObjectItemCaseSensitive(e, "content")->valuestring;
            int special, lstrip, rstrip, single_word;
            if (!json_bool(e, "special", 0, &special))
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens: \"special\" of '%s' must be a boolean",
                                tl_tlz_quote(s, strlen(s), q1, sizeof q1));
            if (!json_bool(e, "lstrip", 0, &lstrip) || !json_bool(e, "rstrip", 0, &rstrip) ||
                !json_bool(e, "single_word", 0, &single_word))
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens: \"lstrip\", \"rstrip\" and \"single_word\" of '%s' "
                                "must be booleans", tl_tlz_quote(s, strlen(s), q1, sizeof q1));
            /* (HF matches such a token only between non-word characters; not implemented:
               refused, not ignored, which would give other ids) */
            if (single_word)
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens: \"single_word\": true (of '%s') is not supported",
                                tl_tlz_quote(s, strlen(s), q1, sizeof q1));
            size_t len = strlen(s);
            /* One id, one token: an added token names a vocabulary entry only as itself (GPT-2's
               <|endoftext|> is both). HF gives an added token its content's id, whatever the
               file says; a file whose ids disagree with that would decode a vocabulary id as
               the added text (or two added texts as one id): refused, not guessed. */
            const int32_t in_vocab = vocab_find(t, s, len);
            if (in_vocab >= 0 && in_vocab != id)
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens: '%s' has id %d, but the vocabulary has it as id %d",
                                tl_tlz_quote(s, len, q1, sizeof q1), (int)id, (int)in_vocab);
            if ((t->flags[id] & TOKF_VOCAB) && in_vocab != id)
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens: '%s' has id %d, which is the vocabulary's '%s'",
                                tl_tlz_quote(s, len, q1, sizeof q1), (int)id,
                                tl_tlz_quote(t->str.p + t->str_off[id], t->str_len[id], q2, sizeof q2));
            if (t->flags[id] & TOKF_ADDED)
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens: '%s' has id %d, which another added token has",
                                tl_tlz_quote(s, len, q1, sizeof q1), (int)id);
            added_token *a = &t->added[t->n_added++];
            a->text = malloc(len + 1);
            if (!a->text) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading added_tokens");
            memcpy(a->text, s, len + 1);
            a->len = len;
            a->id = id;
            a->lstrip = lstrip;
            a->rstrip = rstrip;
            int normalized;
            if (!json_bool(e, "normalized", !special, &normalized))
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens: \"normalized\" of '%s' must be a boolean",
                                tl_tlz_quote(s, strlen(s), q1, sizeof q1));
            a->normalized = normalized;
            if (!buf_put(&t->raw, s, len, &t->raw_off[id]))
                return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading added_tokens");
            t->raw_len[id] = (uint32_t)len;
            t->flags[id] |= TOKF_USED | TOKF_ADDED | (special ? TOKF_SPECIAL : 0);
            t->added_first[(unsigned char)s[0]] = 1;
        }
        qsort(t->added, t->n_added, sizeof *t->added, added_cmp);
        if (!build_added_trie(t)) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading added_tokens");
    }
    return TLZ_OK;
}

/* One merge entry: "left right" (classic) or ["left", "right"] (newer
   tokenizers). Splits into the two spellings without copying. */
static int merge_parts(const cJSON *m, const char **a, size_t *na, const char **b, size_t *nb)
{
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring, *sp = strchr(s, ' ');
        /* HF requires exactly one space: tokens never contain a raw space. */
        if (!sp || sp == s || sp[1] == '\0' || strchr(sp + 1, ' ')) return 0;
        *a = s;
        *na = (size_t)(sp - s);
        *b = sp + 1;
        *nb = strlen(sp + 1);
        return 1;
    }
    if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2) {
        const cJSON *x = m->child, *y = x->next;
        if (!cJSON_IsString(x) || !cJSON_IsString(y) || !x->valuestring[0] || !y->valuestring[0]) return 0;
        *a = x->valuestring;
        *na = strlen(*a);
        *b = y->valuestring;
        *nb = strlen(*b);
        return 1;
    }
    return 0;
}

static int load_merges(tl_tlz_tokenizer *t, const cJSON *merges, char *err, size_t errlen)
{
    char q1[64], q2[64];
    size_t count = (size_t)cJSON_GetArraySize(merges);
    uint32_t cap = table_size(count);
    t->merge_slots = malloc(cap * sizeof *t->merge_slots);
    if (!t->merge_slots) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading merges");
    for (uint32_t i = 0; i < cap; i++) t->merge_slots[i].rank = -1;
    t->merge_mask = cap - 1;

    char *cat = NULL;
    size_t cat_cap = 0;
    int32_t rank = 0;
    for (const cJSON *m = merges->child; m; m = m->next, rank++) {
        const char *a, *b;
        size_t na, nb;
        if (!merge_parts(m, &a, &na, &b, &nb)) {
            char *txt = cJSON_PrintUnformatted(m);
            tl_tlz_fail(err, errlen, TLZ_EFORMAT,
                     "model.merges[%d] is malformed: %s (expected \"left right\" or [\"left\", \"right\"])",
                     (int)rank, txt ? tl_tlz_quote(txt, strlen(txt), q1, sizeof q1) : "?");
            cJSON_free(txt);
            free(cat);
            return TLZ_EFORMAT;
        }
        int32_t ia = vocab_find(t, a, na), ib = vocab_find(t, b, nb);
        if (ia < 0 || ib < 0) {
            free(cat);
            return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.merges[%d]: token '%s' is not in the vocab", (int)rank,
                            ia < 0 ? tl_tlz_quote(a, na, q1, sizeof q1) : tl_tlz_quote(b, nb, q1, sizeof q1));
        }
        if (na + nb > cat_cap) {
            char *nc = realloc(cat, 2 * (na + nb));
            if (!nc) { free(cat); return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading merges"); }
            cat = nc;
            cat_cap = 2 * (na + nb);
        }
        memcpy(cat, a, na);
        memcpy(cat + na, b, nb);
        int32_t merged = vocab_find(t, cat, na + nb);
        if (merged < 0) {
            tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.merges[%d] ('%s' + '%s'): merged token is not in the vocab",
                     (int)rank, tl_tlz_quote(a, na, q1, sizeof q1), tl_tlz_quote(b, nb, q2, sizeof q2));
            free(cat);
            return TLZ_EFORMAT;
        }
        uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
        uint32_t i = (uint32_t)hash_pair(key) & t->merge_mask;
        while (t->merge_slots[i].rank >= 0 && t->merge_slots[i].key != key) i = (i + 1) & t->merge_mask;
        /* A repeated pair overwrites the earlier one: HF builds its merge map
           with a HashMap collect, where the last entry wins. */
        t->merge_slots[i].key = key;
        t->merge_slots[i].rank = rank;
        t->merge_slots[i].id = merged;
    }
    free(cat);
    return TLZ_OK;
}

/* Where the JSON text escapes U+0000 in a string (\u0000), or -1. cJSON's strings end at a
   NUL: a token "<tok\u0000>" was read as "<tok", another token, silently. */
static long nul_escape_at(const char *json, size_t len)
{
    for (size_t i = 0; i + 1 < len; i++) {
        if (json[i] != '\\') continue;
        if (json[i + 1] == 'u' && i + 5 < len && memcmp(json + i + 2, "0000", 4) == 0) return (long)i;
        i++; /* the escaped character (an escaped backslash escapes nothing after it) */
    }
    return -1;
}

int tl_tlz_tokenizer_load_json(const char *json, size_t len, tl_tlz_tokenizer **out, char *err, size_t errlen)
{
    if (out) *out = NULL;
    if (!json || !out) return tl_tlz_fail(err, errlen, TLZ_EINVAL, "tl_tlz_tokenizer_load_json: NULL argument");

    cJSON *root = NULL;
    tl_tlz_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading the tokenizer");
    static atomic_uint_fast64_t serials;
    t->serial = atomic_fetch_add(&serials, 1) + 1;
    int rc;
    char why[200];
    const long nul = nul_escape_at(json, len);
    if (nul >= 0) {
        rc = tl_tlz_fail(err, errlen, TLZ_EFORMAT, "tokenizer.json: a string holds U+0000 (\\u0000 at byte %ld), which no "
                      "token may (C strings end at it)", nul);
        goto done;
    }
    const int read = tl_json_read_strict(json, len, &root, why, sizeof why);
    if (read != 0) {
        rc = tl_tlz_fail(err, errlen, read == -2 ? TLZ_ENOMEM : TLZ_EFORMAT, "tokenizer.json: %s", why);
        goto done;
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model)) {
        rc = tl_tlz_fail(err, errlen, TLZ_EFORMAT, "tokenizer.json has no \"model\" object");
        goto done;
    }
    /* Old files omit "type"; HF then infers BPE from vocab + merges. */
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (type && !(cJSON_IsString(type) && strcmp(type->valuestring, "BPE") == 0)) {
        rc = tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model type '%s' is not supported (only BPE)",
                      cJSON_IsString(type) ? type->valuestring : "(not a string)");
        goto done;
    }
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!cJSON_IsObject(vocab)) {
        rc = tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.vocab is missing or not an object");
        goto done;
    }
    if (!cJSON_IsArray(merges)) {
        rc = tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.merges is missing or not an array");
        goto done;
    }
    if (added && cJSON_IsNull(added)) added = NULL;
    if (added && !cJSON_IsArray(added)) {
        rc = tl_tlz_fail(err, errlen, TLZ_EFORMAT, "added_tokens must be an array");
        goto done;
    }
    if ((rc = check_model_options(model, err, errlen)) || (rc = check_normalizer(root, err, errlen)) ||
        (rc = check_decoder(root, err, errlen)) ||
        (rc = tl_tlz_pretok_parse(root, &t->pre, err, errlen)))
        goto done;

    uint32_t byte_to_cp[256];
    int16_t cp_to_byte[BYTE_CP_LIMIT];
    byte_level_tables(byte_to_cp, cp_to_byte);
    if ((rc = load_vocab(t, vocab, added, cp_to_byte, err, errlen)) ||
        (rc = load_merges(t, merges, err, errlen)))
        goto done;

    for (int b = 0; b < 256; b++) {
        char s[2];
        t->byte_id[b] = vocab_find(t, s, utf8_put(byte_to_cp[b], s));
    }
    t->unk_id = -1;
    int fuse_unk;
    if (!json_bool(model, "fuse_unk", 0, &fuse_unk)) {
        rc = tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.fuse_unk must be a boolean");
        goto done;
    }
    t->fuse_unk = fuse_unk;
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    if (cJSON_IsString(unk)) {
        t->unk_id = tl_tlz_token_id(t, unk->valuestring);
        if (t->unk_id < 0) {
            char q[64];
            rc = tl_tlz_fail(err, errlen, TLZ_EFORMAT, "model.unk_token '%s' is not in the vocab",
                          tl_tlz_quote(unk->valuestring, strlen(unk->valuestring), q, sizeof q));
            goto done;
        }
    }
    *out = t;
    t = NULL;
    rc = TLZ_OK;
done:
    cJSON_Delete(root);
    tl_tlz_tokenizer_free(t); /* NULL on success; else partly built */
    return rc;
}

void tl_tlz_tokenizer_free(tl_tlz_tokenizer *t)
{
    if (!t) return;
    free(t->flags);
    free(t->raw_off);
    free(t->raw_len);
    free(t->raw.p);
    free(t->str_off);
    free(t->str_len);
    free(t->str.p);
    free(t->vocab_slots);
    free(t->merge_slots);
    for (size_t i = 0; i < t->n_added; i++) free(t->added[i].text);
    free(t->added);
    free(t->trie.keys);
    free(t->trie.child);
    free(t->trie.token);
    tl_tlz_pretok_free(t->pre);
    free(t);
}

/* --------------------------------------------------------------- queries */

int32_t tl_tlz_vocab_size(const tl_tlz_tokenizer *t) { return t ? t->n_ids : 0; }

int32_t tl_tlz_token_id(const tl_tlz_tokenizer *t, const char *s)
{
    if (!t || !s) return -1;
    size_t n = strlen(s);
    if (t->n_added > 0) {
        int32_t node = 0;
        for (size_t k = 0; k < n && node >= 0; k++) node = trie_child(&t->trie, node, (unsigned char)s[k]);
        if (node > 0 && t->trie.token[node] >= 0) return t->added[t->trie.token[node]].id;
    }
    return vocab_find(t, s, n);
}

int tl_tlz_is_special(const tl_tlz_tokenizer *t, int32_t id)
{
    return t && id >= 0 && id < t->n_ids && (t->flags[id] & TOKF_SPECIAL);
}

int tl_tlz_token_bytes(const tl_tlz_tokenizer *t, int32_t id, const char **bytes, size_t *len)
{
    if (!t || !bytes || !len) return TLZ_EINVAL;
    if (id < 0 || id >= t->n_ids || !(t->flags[id] & TOKF_USED)) return TLZ_EID;
    *bytes = t->raw.p + t->raw_off[id];
    *len = t->raw_len[id];
    return TLZ_OK;
}

/* ---------------------------------------------------------------- encode */

typedef struct {
    int32_t rank, pos, id;
} heap_item;

/* Per-call scratch: a tokenizer is shared between threads, so nothing that
   an encode writes may live in it. */
typedef struct {
    const tl_tlz_tokenizer *t;
    int32_t *ids;
    size_t n, cap;
    int32_t *sym, *prev, *next; /* BPE symbols of the current word, a linked list */
    heap_item *heap;
    size_t sym_cap, heap_cap, heap_n;
    tl_tlz_pretok_scratch *pre;
    char *err;
    size_t errlen;
} enc_ctx;

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 1;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *np = realloc(*p, c * elem);
    if (!np) return 0;
    *p = np;
    *cap = c;
    return 1;
}

static int emit(enc_ctx *e, int32_t id)
{
    if (e->n == e->cap && !grow((void **)&e->ids, &e->cap, e->n + 1, sizeof *e->ids))
        return tl_tlz_fail(e->err, e->errlen, TLZ_ENOMEM, "out of memory encoding");
    e->ids[e->n++] = id;
    return TLZ_OK;
}

static int heap_less(const heap_item *a, const heap_item *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static int heap_push(enc_ctx *e, heap_item it)
{
    /* Grown on demand: most byte pairs of real text have no merge, and the
       peak is at most 2n (each merge pops one entry and pushes two). */
    if (e->heap_n == e->heap_cap && !grow((void **)&e->heap, &e->heap_cap, e->heap_n + 1, sizeof *e->heap))
        return tl_tlz_fail(e->err, e->errlen, TLZ_ENOMEM, "out of memory encoding");
    size_t i = e->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&it, &e->heap[p])) break;
        e->heap[i] = e->heap[p];
        i = p;
    }
    e->heap[i] = it;
    return TLZ_OK;
}

static heap_item heap_pop(enc_ctx *e)
{
    heap_item top = e->heap[0], last = e->heap[--e->heap_n];
    size_t i = 0, n = e->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_less(&e->heap[c + 1], &e->heap[c])) c++;
        if (!heap_less(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n) e->heap[i] = last;
    return top;
}

static int push_pair(enc_ctx *e, int32_t pos)
{
    int32_t nx = e->next[pos];
    if (nx < 0) return TLZ_OK;
    const merge_slot *m = merge_find(e->t, e->sym[pos], e->sym[nx]);
    return m ? heap_push(e, (heap_item){m->rank, pos, m->id}) : TLZ_OK;
}

static int byte_token(enc_ctx *e, unsigned char b, int32_t *id)
{
    *id = e->t->byte_id[b] >= 0 ? e->t->byte_id[b] : e->t->unk_id;
    if (*id < 0)
        return tl_tlz_fail(e->err, e->errlen, TLZ_EENCODE,
                        "cannot encode byte 0x%02x: the vocab has no token for it and no unk_token", b);
    return TLZ_OK;
}

/* BPE over one pre-token. Merges are applied lowest rank first, ties broken
   leftmost, with a heap of candidate pairs validated lazily when popped:
   the same order as HF's Word::merge_all, in O(n log n) for a word of n
   bytes (a pre-token can be a whole text without spaces). */
static int bpe_word(enc_ctx *e, const unsigned char *w, size_t n)
{
    int rc;
    if (n == 1) {
        int32_t id;
        if ((rc = byte_token(e, w[0], &id))) return rc;
        return emit(e, id);
    }
    if (n > INT32_MAX / 2) return tl_tlz_fail(e->err, e->errlen, TLZ_EINVAL, "pre-token too long");
    if (n > e->sym_cap) {
        /* sym, prev and next always share one capacity. */
        size_t c = e->sym_cap ? e->sym_cap : 64;
        while (c < n) c *= 2;
        int32_t *a = realloc(e->sym, c * sizeof *a);
        if (a) e->sym = a;
        int32_t *b = a ? realloc(e->prev, c * sizeof *b) : NULL;
        if (b) e->prev = b;
        int32_t *d = b ? realloc(e->next, c * sizeof *d) : NULL;
        if (!d) return tl_tlz_fail(e->err, e->errlen, TLZ_ENOMEM, "out of memory encoding");
        e->next = d;
        e->sym_cap = c;
    }
    /* the word's symbols: one a byte, except that with fuse_unk a run of bytes the vocab lacks
       is one unk_token (HF's BPE fuses the unknown characters of a word) */
    size_t n_sym = 0;
    bool after_unk = false;
    for (size_t i = 0; i < n; i++) {
        const bool unknown = e->t->byte_id[w[i]] < 0;
        if (unknown && after_unk && e->t->fuse_unk) continue;
        after_unk = unknown;
        if ((rc = byte_token(e, w[i], &e->sym[n_sym]))) return rc;
        n_sym++;
    }
    for (size_t i = 0; i < n_sym; i++) {
        e->prev[i] = (int32_t)i - 1;
        e->next[i] = i + 1 < n_sym ? (int32_t)i + 1 : -1;
    }
    e->heap_n = 0;
    for (size_t i = 0; i + 1 < n_sym; i++)
        if ((rc = push_pair(e, (int32_t)i))) return rc;
    while (e->heap_n) {
        heap_item top = heap_pop(e);
        int32_t pos = top.pos, right = e->next[pos];
        if (e->sym[pos] < 0 || right < 0) continue; /* merged away, or now last */
        /* Stale entries are detected as HF does: the pair now at pos must
           still merge into the same token. */
        const merge_slot *m = merge_find(e->t, e->sym[pos], e->sym[right]);
        if (!m || m->id != top.id) continue;
        e->sym[pos] = top.id;
        e->sym[right] = -1;
        e->next[pos] = e->next[right];
        if (e->next[pos] >= 0) e->prev[e->next[pos]] = pos;
        if ((e->prev[pos] >= 0 && (rc = push_pair(e, e->prev[pos]))) || (rc = push_pair(e, pos))) return rc;
    }
    for (int32_t i = 0; i >= 0; i = e->next[i])
        if ((rc = emit(e, e->sym[i]))) return rc;
    return TLZ_OK;
}

static int bpe_piece(void *ctx, const unsigned char *w, size_t n) { return bpe_word(ctx, w, n); }

/* A stretch of input between added tokens: valid UTF-8 runs go through the
   pre-tokenizer pipeline, each invalid byte is a pre-token by itself. */
static int encode_plain(enc_ctx *e, const char *s, size_t n)
{
    int rc;
    char *prefixed = NULL;
    if (tl_tlz_pretok_prefix_stretch(e->t->pre) && n > 0 && s[0] != ' ') {
        /* HF's lone ByteLevel adds the space to every stretch it sees. */
        prefixed = malloc(n + 1);
        if (!prefixed) return tl_tlz_fail(e->err, e->errlen, TLZ_ENOMEM, "out of memory encoding");
        prefixed[0] = ' ';
        memcpy(prefixed + 1, s, n);
        s = prefixed;
        n++;
    }
    rc = TLZ_OK;
    for (size_t i = 0; i < n && !rc;) {
        size_t j = i;
        while (j < n) {
            int k = tl_tlz_utf8_seq((const unsigned char *)s + j, n - j);
            if (k <= 0) break;
            j += (size_t)k;
        }
        if (j > i) rc = tl_tlz_pretok_run(e->t->pre, e->pre, s + i, j - i, bpe_piece, e, e->err, e->errlen);
        if (!rc && j < n) rc = bpe_word(e, (const unsigned char *)s + j, 1), j++;
        i = j;
    }
    free(prefixed);
    return rc;
}

/* The length of the whitespace character at s[0..n) (Unicode's White_Space, Rust's
   char::is_whitespace, which HF's lstrip and rstrip trim), else 0. */
static int whitespace_at(const unsigned char *s, size_t n)
{
    const int k = tl_tlz_utf8_seq(s, n);
    if (k <= 0) return 0;
    const uint32_t c = utf8_get(s, k);
    const bool ws = (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
                    (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
    return ws ? k : 0;
}

/* The length of the whitespace character that ends s[0..n), else 0. */
static int whitespace_before(const unsigned char *s, size_t n)
{
    size_t back = 1;
    while (back < 4 && back < n && (s[n - back] & 0xC0) == 0x80) back++;
    const int k = whitespace_at(s + n - back, back);
    return k == (int)back ? k : 0;
}

/* The longest added token at s of the pass (normalized ones in the second), specials
   included: where specials are read as text, the caller leaves a special's span as text, as
   HF's split_special_tokens does (it matches over all added tokens, then drops a special
   match; a shorter token inside its span was taken: "<a>" of "<a>b"). */
static const added_token *match_added(const tl_tlz_tokenizer *t, const char *s, size_t n, bool normalized)
{
    const added_token *longest = NULL;
    int32_t node = 0;
    for (size_t k = 0; k < n && (node = trie_child(&t->trie, node, (unsigned char)s[k])) >= 0; k++)
        for (int32_t i = t->trie.token[node]; i >= 0; i = t->added[i].same_text) {
            const added_token *a = &t->added[i];
            if (a->normalized != normalized) continue;
            longest = a; /* the first of its text that this pass takes; a longer one may follow */
            break;
        }
    return longest;
}

/* text[0..len) split at its added tokens as HF's added vocabulary splits it: the tokens not
   normalized first (leftmost-longest, like its literal match), then the normalized ones in
   what is left (pass `normalized`), the rest encoded by the pre-tokenizer and BPE. */
static int split_added(enc_ctx *e, const char *text, size_t len, int skip_special, bool normalized)
{
    const tl_tlz_tokenizer *t = e->t;
    int rc = TLZ_OK;
    size_t start = 0;
    for (size_t i = 0; i < len && !rc && t->n_added > 0; i++) {
        if (!t->added_first[(unsigned char)text[i]]) continue;
        const added_token *a = match_added(t, text + i, len - i, normalized);
        if (!a) continue;
        if (skip_special && (t->flags[a->id] & TOKF_SPECIAL)) { /* its span stays text, not searched again */
            i += a->len - 1;
            continue;
        }
        size_t from = i, to = i + a->len; /* the text the token stands for */
        int k;
        if (a->lstrip)
            while (from > start && (k = whitespace_before((const unsigned char *)text + start, from - start)) > 0) from -= (size_t)k;
        if (a->rstrip)
            while (to < len && (k = whitespace_at((const unsigned char *)text + to, len - to)) > 0) to += (size_t)k;
        if (from > start)
            rc = normalized ? encode_plain(e, text + start, from - start)
                            : split_added(e, text + start, from - start, skip_special, true);
        if (!rc) rc = emit(e, a->id);
        /* The search goes on after the token itself: HF finds the matches on the text first,
           then widens each for lstrip and rstrip, so a match inside the blanks this one took
           is a token all the same, and the text resumes at its end (start_offset). */
        start = to;
        i += a->len - 1;
    }
    if (!rc && start < len)
        rc = normalized ? encode_plain(e, text + start, len - start) : split_added(e, text + start, len - start, skip_special, true);
    return rc;
}

int tl_tlz_encode_ex(const tl_tlz_tokenizer *t, const char *text, size_t len, unsigned flags,
                  int32_t **ids, size_t *n, char *err, size_t errlen)
{
    if (ids) *ids = NULL;
    if (n) *n = 0;
    if (!t || !ids || !n || (!text && len))
        return tl_tlz_fail(err, errlen, TLZ_EINVAL, "tl_tlz_encode: NULL argument");
    enc_ctx e = {.t = t, .err = err, .errlen = errlen};
    int rc = TLZ_OK;
    if (!(e.pre = tl_tlz_pretok_scratch_new(t->pre)))
        return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory encoding");

    rc = split_added(&e, text, len, (flags & TLZ_ENCODE_NO_SPECIAL) != 0, false);

    free(e.sym);
    free(e.prev);
    free(e.next);
    free(e.heap);
    tl_tlz_pretok_scratch_free(e.pre);
    if (rc) {
        free(e.ids);
        return rc;
    }
    *ids = e.ids;
    *n = e.n;
    return TLZ_OK;
}

int tl_tlz_encode(const tl_tlz_tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n,
               char *err, size_t errlen)
{
    return tl_tlz_encode_ex(t, text, len, 0, ids, n, err, errlen);
}

/* ---------------------------------------------------------------- decode */

int tl_tlz_decode(const tl_tlz_tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len,
               char *err, size_t errlen)
{
    if (text) *text = NULL;
    if (len) *len = 0;
    if (!t || !text || !len || (!ids && n)) return tl_tlz_fail(err, errlen, TLZ_EINVAL, "tl_tlz_decode: NULL argument");
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || !(t->flags[id] & TOKF_USED))
            return tl_tlz_fail(err, errlen, TLZ_EID, "cannot decode token id %ld at position %zu: not in the vocab (size %ld)",
                            (long)id, i, (long)t->n_ids);
        total += t->raw_len[id];
    }
    char *out = malloc(total + 1);
    if (!out) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory decoding");
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(out + o, t->raw.p + t->raw_off[ids[i]], t->raw_len[ids[i]]);
        o += t->raw_len[ids[i]];
    }
    out[o] = '\0';
    *text = out;
    *len = o;
    return TLZ_OK;
}
