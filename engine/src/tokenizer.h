/* Byte-level BPE tokenizer (Hugging Face tokenizer.json, GPT-2 style).
 *
 * Internal to the engine: the public API wraps these calls and turns the
 * messages written to `err` into tl_last_error().
 *
 * Conventions
 * - Every fallible function returns 0 on success and a nonzero TLZ_E* code on
 *   failure, with a one-line message in err[0..errlen) (err may be NULL).
 *   Nothing here aborts, exits or asserts: a bad tokenizer.json or a bad id is
 *   an ordinary error an embedded server must survive.
 * - A loaded tokenizer is immutable: any number of threads may encode and
 *   decode with it concurrently. A tl_tlz_stream belongs to one thread at a time.
 * - Text is bytes, not strings: encode accepts any byte sequence (NUL and
 *   invalid UTF-8 included) and decode returns raw bytes, so that
 *   decode(encode(x)) == x for every x when the vocabulary covers all 256
 *   bytes (GPT-2's does), add_prefix_space is off and no Split step removes
 *   text (behaviour Removed).
 *
 * Pre-tokenizers: Split (regex or literal, every behaviour, invert), Digits and
 * ByteLevel, nested in Sequences, with ByteLevel last (pretokenizer.h); the
 * normalizer must be null. This covers GPT-2, Ouro's (SmolLM2's) and
 * Huginn-0125's tokenizer.json.
 *
 * Pre-tokenisation of input that is not valid UTF-8: the input is cut into
 * maximal valid UTF-8 runs and single invalid bytes. Each run goes through the
 * pre-tokenizer pipeline as usual; each invalid byte is a pre-token of its own
 * (so it becomes its single-byte token). A valid run is therefore tokenised
 * exactly as Hugging Face tokenizers would tokenise that string alone.
 */
#ifndef TINYLOOP_TOKENIZER_H
#define TINYLOOP_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct tl_tlz_tokenizer tl_tlz_tokenizer;
typedef struct tl_tlz_stream tl_tlz_stream;

enum {
    TLZ_OK = 0,
    TLZ_EIO = 1,        /* file missing or unreadable */
    TLZ_EFORMAT = 2,    /* tokenizer.json is malformed or unsupported */
    TLZ_ENOMEM = 3,
    TLZ_EINVAL = 4,     /* bad argument (NULL pointer, ...) */
    TLZ_EID = 5,        /* token id out of range or unused */
    TLZ_EENCODE = 6     /* a byte of the input has no token and there is no unk_token */
};

/* Flags for tl_tlz_encode_ex. */
enum {
    /* Treat special token text (e.g. "<|endoftext|>") as plain text; added tokens that are
       not special are still recognised (HF's split_special_tokens, llama.cpp's
       parse_special false). For untrusted input that must not inject control tokens. */
    TLZ_ENCODE_NO_SPECIAL = 1u << 0
};

/* Loads a tokenizer.json. On failure *out is NULL. */
int tl_tlz_tokenizer_load(const char *path, tl_tlz_tokenizer **out, char *err, size_t errlen);
/* Same, from a JSON document in memory (json need not be NUL-terminated). */
int tl_tlz_tokenizer_load_json(const char *json, size_t len, tl_tlz_tokenizer **out,
                            char *err, size_t errlen);
void tl_tlz_tokenizer_free(tl_tlz_tokenizer *tok); /* NULL is a no-op */

/* Number of ids: 1 + the largest id in the vocab or added tokens. Ids inside
   [0, vocab_size) that no token uses are invalid for decode. */
int32_t tl_tlz_vocab_size(const tl_tlz_tokenizer *tok);

/* Id of a token given its tokenizer.json string: added tokens first (e.g.
   "<|endoftext|>"), then model vocab entries in their byte-level spelling
   ("Ġthe"). -1 if absent. */
int32_t tl_tlz_token_id(const tl_tlz_tokenizer *tok, const char *str);
/* A number this loaded tokenizer alone has in the process (never reused after it is freed):
   a key for what is derived from its contents once, as grammars' vocabulary fingerprints. */
uint64_t tl_tlz_serial(const tl_tlz_tokenizer *tok);
/* 1 if id is an added token marked "special": true, else 0. */
int tl_tlz_is_special(const tl_tlz_tokenizer *tok, int32_t id);
/* Raw bytes of one token (byte-level alphabet decoded), not NUL-terminated;
   the pointer lives as long as the tokenizer. */
int tl_tlz_token_bytes(const tl_tlz_tokenizer *tok, int32_t id, const char **bytes, size_t *len);

/* Encodes text[0..len). *ids is malloc'ed (free() it; it may be NULL when
   *n == 0). Added tokens are matched literally (leftmost-longest) before
   pre-tokenisation. */
int tl_tlz_encode(const tl_tlz_tokenizer *tok, const char *text, size_t len,
               int32_t **ids, size_t *n, char *err, size_t errlen);
int tl_tlz_encode_ex(const tl_tlz_tokenizer *tok, const char *text, size_t len, unsigned flags,
                  int32_t **ids, size_t *n, char *err, size_t errlen);

/* Concatenated raw bytes of the tokens. *text is malloc'ed (free() it) and
   NUL-terminated for convenience; *len excludes the terminator. */
int tl_tlz_decode(const tl_tlz_tokenizer *tok, const int32_t *ids, size_t n,
               char **text, size_t *len, char *err, size_t errlen);

/* Streaming detokenizer: feed ids one at a time, get back the bytes that are
   safe to show now. It never cuts a UTF-8 sequence: the bytes of a code point
   that is still incomplete are held back until a later token completes it.
   Bytes that can never become valid UTF-8 are passed through as they are, as
   soon as that is certain. The returned pointer is valid until the next call
   on the same stream. */
int tl_tlz_stream_new(const tl_tlz_tokenizer *tok, tl_tlz_stream **out, char *err, size_t errlen);
int tl_tlz_stream_push(tl_tlz_stream *s, int32_t id, const char **out, size_t *len,
                    char *err, size_t errlen);
/* Emits whatever is held back (an unfinished sequence, as raw bytes) and
   leaves the stream empty, ready for reuse. */
void tl_tlz_stream_flush(tl_tlz_stream *s, const char **out, size_t *len);
void tl_tlz_stream_reset(tl_tlz_stream *s); /* drops held-back bytes */
void tl_tlz_stream_free(tl_tlz_stream *s);  /* NULL is a no-op */

/* UTF-8 helper shared by the encoder and the stream: classifies the sequence
   starting at p[0] (n >= 1 bytes available). Returns its length (1..4) when
   complete and valid (strict: no overlongs, surrogates or > U+10FFFF), 0 when
   p[0..n) is a valid but unfinished prefix, -1 when p[0] starts no valid
   sequence. */
int tl_tlz_utf8_seq(const unsigned char *p, size_t n);
/* The code point of the len-byte sequence at p that tl_tlz_utf8_seq accepted. */
uint32_t tl_tlz_utf8_value(const unsigned char *p, int len);

/* The one UTF-8 hold-back rule (the stream and tl_session_text): how many bytes at the end of
   p[0..n) form a valid but unfinished sequence, which a later byte may complete (0..3).
   Invalid bytes are never held: no later byte can make them valid. */
size_t tl_tlz_utf8_unfinished_tail(const unsigned char *p, size_t n);

/* The module's one error rule (tokenizer.c, pretokenizer.c): writes the message to
   err[0..errlen) when err is not NULL and returns code. */
int tl_tlz_fail(char *err, size_t errlen, int code, const char *fmt, ...);
/* s[0..n) for a message: control bytes, ' and backslashes escaped as \xNN, cut with "..."
   to fit cap. Returns buf. */
const char *tl_tlz_quote(const char *s, size_t n, char *buf, size_t cap);
/* tl_tlz_quote for text a message puts between `quote` characters (tl_tlz_quote's: '). */
const char *tl_tlz_quote_in(const char *s, size_t n, char quote, char *buf, size_t cap);

#endif
