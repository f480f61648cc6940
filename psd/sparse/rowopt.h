/*
 * rowopt.h - the per-row update rules of sparse tables (ps_table_opt):
 * SGD, Adagrad, lazy Adam and FTRL-proximal, applied to one stored row
 * (its dim values followed by the rule's state floats, psd_rowopt_state_floats)
 * with one gradient row. The constants of a table's rule are converted once
 * (psd_rowopt_init); each kernel is one pass over the row with restrict
 * pointers so gcc vectorizes it (compiled for AVX2 too: PS__VECTOR_CLONES).
 * Adam's bias correction uses the row's own step t (lazy Adam: a row's
 * moments and t advance only when it gets a gradient) and is computed in
 * double; FTRL's sqrt(n) - sqrt(n_old) is computed without cancellation,
 * so it too runs in float.
 */
#ifndef PSD_ROWOPT_H
#define PSD_ROWOPT_H

#include <stdint.h>

#include "tablespec.h"

/* Rows start on a multiple of this many floats (16 bytes) from the 64-byte
 * aligned storage: aligned SSE loads for every row without padding small
 * rows to a whole cache line (a dim-8 SGD row stays 32 bytes). */
#define PSD_ROW_ALIGN_FLOATS 4u

/* Row steps t whose Adam bias corrections are computed once, at init:
 * two pow() calls cost more than the rest of a dim-16 row's update. */
#define PSD_ROWOPT_ADAM_STEPS 1024u

/* A table's rule, converted once for the kernels. */
typedef struct psd_rowopt {
  uint32_t kind;            /* ps_table_opt */
  uint32_t dim;             /* values per row */
  float lr;                 /* learning rate in float (SGD, ADAGRAD loops) */
  double lr_d;              /* learning rate in double (ADAM's scalar) */
  float eps;                /* ADAGRAD, ADAM: epsilon */
  float init_acc;           /* ADAGRAD: a new row's accumulator */
  double beta1, beta2;      /* ADAM: decays, for the bias correction */
  float b1, c1, b2, c2;     /* ADAM: beta1, 1 - beta1, beta2, 1 - beta2 */
  double l1, l2, ftrl_beta; /* FTRL: regularization and rate beta */
  float inv_lr;             /* FTRL: 1 / lr */
  /* ADAM: sqrt(1 - beta2^t) and 1 - beta1^t for t = 1..PSD_ROWOPT_ADAM_STEPS
   * ([t - 1]); later steps compute them (the same values either way). */
  double adam_sqrt_c2[PSD_ROWOPT_ADAM_STEPS], adam_c1[PSD_ROWOPT_ADAM_STEPS];
} psd_rowopt;

/* Floats of optimizer state per row: 0 SGD, dim ADAGRAD, 2 dim + 1 ADAM
 * (m, v, then the row's step t as the uint32 bits of one float slot),
 * 2 dim FTRL (z, n). */
uint32_t psd_rowopt_state_floats(const psd_table_spec *spec);

/* Floats per stored row: dim values, then the state, rounded up to
 * PSD_ROW_ALIGN_FLOATS. Saturates at UINT64_MAX for an unchecked spec. */
uint64_t psd_rowopt_stride(const psd_table_spec *spec);

/* The rule of a checked spec. */
void psd_rowopt_init(psd_rowopt *o, const psd_table_spec *spec);

/* The learning rate of the next updates (a table's schedule at its step). */
void psd_rowopt_set_lr(psd_rowopt *o, double lr);

/* A new row's state (psd_rowopt_state_floats floats): zeros, Adagrad's
 * accumulators at initial_accumulator, Adam's t at 0. */
void psd_rowopt_new_state(const psd_rowopt *o, float *state);

/* One update of row w (dim values) and its state with the gradient
 * scale * g[0..dim). g does not overlap the row. */
void psd_rowopt_apply(const psd_rowopt *o, float *w, float *state, const float *g,
                      float scale);

/* psd_rowopt_apply on rows[0..m) of vals (row r at vals + r * stride, its
 * state after its dim values), gradient row j at g + j * dim; rows that
 * are PSD_ROWOPT_NO_ROW are skipped. One call per batch: at small dims a
 * call per row costs more than the update (100k x 1 rows of SGD: 6 ns a
 * row through calls). The same arithmetic as psd_rowopt_apply, bit for
 * bit. */
#define PSD_ROWOPT_NO_ROW UINT32_MAX
void psd_rowopt_apply_rows(const psd_rowopt *o, float *vals, uint64_t stride,
                           const uint32_t *rows, size_t m, const float *g, float scale);

#endif
