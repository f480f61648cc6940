/*
 * ctr_model.h - the CTR example's dense part: the F embeddings of a
 * record (F x dim floats, looked up by the caller) concatenated with its D
 * dense features (log(1 + x)), then a two-hidden-layer ReLU MLP and a
 * sigmoid; logistic loss. Forward and backward on the CPU with OpenBLAS
 * SGEMM; the parameters live wherever the caller binds them (psd
 * variables' buffers, or local ones for --local).
 */
#ifndef CTR_MODEL_H
#define CTR_MODEL_H

#include <stddef.h>
#include <stdint.h>

#define CTR_NPARAMS 6 /* W1 b1 W2 b2 W3 b3 */

typedef struct ctr_mlp ctr_mlp;

typedef struct ctr_param_info {
  const char *name;
  int64_t shape[2];
  int ndim;
  int glorot; /* 1: Glorot uniform, 0: zeros */
} ctr_param_info;

/* A model for batches of up to max_batch records; NULL when out of memory.
 * Sets OpenBLAS to `threads` threads. */
ctr_mlp *ctr_mlp_create(int fields, int dim, int dense, int h1, int h2, int max_batch,
                        int threads);
void ctr_mlp_destroy(ctr_mlp *m);
/* Parameter i (0..CTR_NPARAMS-1): name, shape, initializer. */
ctr_param_info ctr_mlp_param(const ctr_mlp *m, int i);
/* Where parameter i's values are read from and its gradient written to. */
void ctr_mlp_bind(ctr_mlp *m, int i, float *data, float *grad);
/* Floats of one record's embeddings (fields x dim). */
size_t ctr_mlp_emb_width(const ctr_mlp *m);

/* Forward over n records: emb (n x fields x dim, record-major), dense
 * (n x D raw counts), labels (n, or NULL). prob (n, may be NULL) gets the
 * predicted click probabilities. Returns the mean logistic loss (0 without
 * labels). */
double ctr_mlp_forward(ctr_mlp *m, size_t n, const float *emb, const float *dense,
                       const float *labels, float *prob);
/* Backward of the last forward (with labels): the mean loss's gradients
 * into the bound gradient buffers (overwritten), and the gradient of each
 * looked-up embedding row, returned (n x fields x dim, record-major, valid
 * until the next call). */
const float *ctr_mlp_backward(ctr_mlp *m, size_t n, const float *labels);

/* Local update of every parameter (--local: no psd): SGD, or Adam when
 * adam is set (TF's epsilon-hat form, as psd's). t is the step, from 0. */
int ctr_mlp_local_update(ctr_mlp *m, int adam, double lr, uint64_t t);

/* Mean logistic loss of probabilities against labels. */
double ctr_logloss(const float *prob, const float *label, size_t n);

#endif /* CTR_MODEL_H */
