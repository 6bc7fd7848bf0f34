/* quant.h: q8 / q4 weight quantisation (the rules of internal.h's TL_Q8 / TL_Q4) and the
 * checkpoint converter behind scripts/quantize. */
#ifndef TL_QUANT_H
#define TL_QUANT_H

#include "dtype.h"
#include "internal.h"

/* One matrix row of `cols` floats (a multiple of TL_QGROUP) into q8 bytes [cols] or q4 bytes
   [cols / 2], and f16 scales [cols / TL_QGROUP] (layout: internal.h). */
void tl_quantize_row_q8(const float *x, int cols, int8_t *q, uint16_t *scales);
/* q4 searches each group's f16 scale for the least squared error (quant.c): never more error
   than the Q4_0 rule d = max|x| / -8, nor than any of the candidates it tries. */
void tl_quantize_row_q4(const float *x, int cols, uint8_t *q, uint16_t *scales);
/* The same with an importance per column, imp [cols] (>= 0; NULL = tl_quantize_row_q4): each
   group's scale minimises sum_i imp_i (x_i - d q_i)^2 instead, searched from the unweighted
   winner, so the weighted error is never above that winner's; equal importances within a
   group give exactly the unweighted bytes. */
void tl_quantize_row_q4_weighted(const float *x, const float *imp, int cols, uint8_t *q, uint16_t *scales);

/* Writes out_dir (created if needed) as a copy of the checkpoint in_dir with every matrix
   quantised to `type` (TL_Q8 or TL_Q4): each 2-D "*.weight" tensor whose input dimension
   is a multiple of TL_QGROUP becomes an I8 (q8) or U8 (q4) tensor of the same name plus an
   F16 "<name>_scale" tensor (q4 keeps tok_embed / lm_head at q8); pos_embed.weight, vectors
   and matrices of other widths are copied as they are (tl_quantize_kept counts them; none to
   quantise is refused).
   config.json and tokenizer.json (when present) are copied. */
tl_status tl_quantize_checkpoint(const char *in_dir, const char *out_dir, tl_dtype type);
/* The same, activation-aware (q4 only) when cal is not NULL (calibrate.h): each q4 matrix's
   groups weight their error by the importance of their inputs, and when the calibration has
   Gram matrices, GPTQ's error feedback runs along each row. The calibration must be of this
   checkpoint (tensor names and input widths; otherwise TL_ERR_INVALID_ARGUMENT, nothing
   written). The file format is the same. Rows are quantised on `threads` threads (0: one per
   core; at most 256; tl_quantize_checkpoint uses 0): each row on its own, so the bytes are
   the same at any count. `pure` quantises the embedding and the head to `type` too (q4
   keeps them at q8 otherwise; llama.cpp's --pure); with a calibration, those of them it has
   no statistics for are quantised unweighted. */
/* How many matrices of in_dir's checkpoint the quantisation keeps as they are (their input
   width is not a multiple of TL_QGROUP), the first one's name in first [len] and its width in
   *width; -1 where the weights cannot be read. */
int tl_quantize_kept(const char *in_dir, char *first, size_t len, int64_t *width);
struct tl_calibration;
tl_status tl_quantize_checkpoint_calibrated(const char *in_dir, const char *out_dir, tl_dtype type,
                                            const struct tl_calibration *cal, int threads, bool pure);

#endif
