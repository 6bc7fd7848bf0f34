/* Pre-tokenizer pipeline of a Hugging Face tokenizer.json (internal to tokenizer.c).
 *
 * A pipeline is the flattened list of steps of the file's "pre_tokenizer": Split (a regex or
 * a literal string, any behaviour, invert), Digits, and a ByteLevel step, which must be the
 * last one (it is where HF maps bytes to the byte-level alphabet, and our BPE works on raw
 * bytes, so nothing may run after it). Sequence nests freely and is flattened at load.
 *
 * Conventions as in tokenizer.h: 0 or a TLZ_E* code with a one-line message, never an abort.
 * A loaded pipeline is immutable and shared between threads; all mutable state of a run is
 * in a tl_tlz_pretok_scratch owned by one encode call.
 */
#ifndef TINYLOOP_PRETOKENIZER_H
#define TINYLOOP_PRETOKENIZER_H

#include <stddef.h>

typedef struct cJSON cJSON;
typedef struct tl_tlz_pretok tl_tlz_pretok;
typedef struct tl_tlz_pretok_scratch tl_tlz_pretok_scratch;

/* Parses root's "pre_tokenizer" member. Errors name the JSON path of the bad field. */
int tl_tlz_pretok_parse(const cJSON *root, tl_tlz_pretok **out, char *err, size_t errlen);
void tl_tlz_pretok_free(tl_tlz_pretok *p);

/* 1 when a space is to be added before each stretch of input (text between added tokens),
   before it is cut into valid UTF-8 runs: the lone-ByteLevel case, kept as the GPT-2 path
   always did it. In a longer pipeline the ByteLevel step adds the space to each piece that
   reaches it, as HF does, and this returns 0. */
int tl_tlz_pretok_prefix_stretch(const tl_tlz_pretok *p);

tl_tlz_pretok_scratch *tl_tlz_pretok_scratch_new(const tl_tlz_pretok *p);
void tl_tlz_pretok_scratch_free(tl_tlz_pretok_scratch *s);

/* Runs the pipeline over s[0..n), which must be valid UTF-8, and calls emit once per final
   piece, in order (pieces are never empty). emit's nonzero return stops the run and is
   returned. */
typedef int (*tl_tlz_piece_fn)(void *ctx, const unsigned char *piece, size_t n);
int tl_tlz_pretok_run(const tl_tlz_pretok *p, tl_tlz_pretok_scratch *s, const char *text, size_t n,
                   tl_tlz_piece_fn emit, void *ctx, char *err, size_t errlen);

#endif
