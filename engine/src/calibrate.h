/* calibrate.h: activation statistics for activation-aware quantisation (quant.c). The model
 * runs its real forward pass (forward.c, at its default depth) over calibration text; the
 * forward's observe hook hands this file the input of every layer matrix, and per input
 * column j it accumulates sum x_j^2 (the importance, mean x_j^2, as llama.cpp's imatrix) and,
 * on request, the Gram matrix sum x x^T (GPTQ's Hessian). The loop block runs several times
 * per token: every application adds to the same statistics, as every application reads the
 * same quantised weights. Data flows one way: the forward never reads anything back. */
#ifndef TL_CALIBRATE_H
#define TL_CALIBRATE_H

#include "internal.h"

typedef struct tl_calibration tl_calibration;

/* Statistics of `model` (a CPU-backend model, ideally the unquantised one) over ids [n]:
   windows of min(256, max_seq_len) tokens spread evenly over the ids, each scored from an
   empty cache as tl_score does, at most max_tokens tokens in all (at least one window).
   gram: also the Gram matrices (cols^2 doubles per input; for GPTQ). */
tl_status tl_calibrate(const tl_model *model, const int32_t *ids, int n, int max_tokens, bool gram,
                       tl_calibration **out);
/* The same from a checkpoint directory and a text file: loads model_dir, reads and encodes
   text_path with its tokenizer. A missing, unreadable or empty text is an error, as is a
   text of fewer than 2 tokens. */
tl_status tl_calibrate_text(const char *model_dir, const char *text_path, int max_tokens, bool gram,
                            int n_threads, tl_calibration **out);
void tl_calibration_free(tl_calibration *cal);

/* The checkpoint tensors the statistics are for, by name ("block.0.attn.q.weight", the
   generic loader's names), i in [0, tl_calibration_count). */
int tl_calibration_count(const tl_calibration *cal);
const char *tl_calibration_name(const tl_calibration *cal, int i);
/* Of tensor `name` (NULL when the calibration has none): the importance, mean x_j^2 [cols]
   over every row its input had; and, when collected, the mean Gram matrix
   (1/rows) sum x x^T [cols][cols] (full, symmetric). */
const float *tl_calibration_importance(const tl_calibration *cal, const char *name, int *cols);
const double *tl_calibration_gram(const tl_calibration *cal, const char *name);
/* The rows tensor `name`'s input had: tokens for a prelude / coda layer, tokens x loops for a
   block layer (every application counts); 0 when the calibration has no such tensor. */
long tl_calibration_rows(const tl_calibration *cal, const char *name);
/* Where the statistics came from, for messages: the model directory (or "(model)") and the
   tokens run through it. */
const char *tl_calibration_source(const tl_calibration *cal);
/* The calibration text's path when made by tl_calibrate_text, else "". */
const char *tl_calibration_text(const tl_calibration *cal);
long tl_calibration_tokens(const tl_calibration *cal);

#endif
