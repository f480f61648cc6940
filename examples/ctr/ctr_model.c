/* ctr_model.c - the CTR MLP (ctr_model.h): forward and backward over a
 * batch with OpenBLAS SGEMM, and a local SGD/Adam for --local. */
#include "ctr_model.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct ctr_mlp {
  int fields, dim, dense, h1, h2, max_batch;
  size_t emb, in; /* emb = fields * dim; in = emb + dense */
  float *p[CTR_NPARAMS], *g[CTR_NPARAMS];
  size_t numel[CTR_NPARAMS];
  float *x;       /* max_batch x in: embeddings, then log(1 + dense) */
  float *a1, *a2; /* activations after ReLU: max_batch x h1, x h2 */
  float *z, *prob, *dz;
  float *d1, *d2; /* gradients at the hidden layers */
  float *demb;    /* max_batch x emb: the gradient of each looked-up row */
  float *adam_m[CTR_NPARAMS], *adam_v[CTR_NPARAMS];
};

ctr_param_info ctr_mlp_param(const ctr_mlp *m, int i) {
  ctr_param_info p = {0};
  int64_t rows[CTR_NPARAMS] = {(int64_t)m->in, m->h1, m->h1, m->h2, m->h2, 1};
  int64_t cols[CTR_NPARAMS] = {m->h1, 0, m->h2, 0, 1, 0};
  static const char *names[CTR_NPARAMS] = {"W1", "b1", "W2", "b2", "W3", "b3"};
  p.name = names[i];
  p.shape[0] = rows[i];
  p.shape[1] = cols[i];
  p.ndim = cols[i] ? 2 : 1;
  p.glorot = i % 2 == 0;
  return p;
}

ctr_mlp *ctr_mlp_create(int fields, int dim, int dense, int h1, int h2, int max_batch,
                        int threads) {
  ctr_mlp *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  m->fields = fields;
  m->dim = dim;
  m->dense = dense;
  m->h1 = h1;
  m->h2 = h2;
  m->max_batch = max_batch;
  m->emb = (size_t)fields * (size_t)dim;
  m->in = m->emb + (size_t)dense;
  size_t B = (size_t)max_batch;
  for (int i = 0; i < CTR_NPARAMS; i++) {
    ctr_param_info p = ctr_mlp_param(m, i);
    m->numel[i] = (size_t)p.shape[0] * (size_t)(p.ndim == 2 ? p.shape[1] : 1);
  }
  m->x = malloc(B * m->in * sizeof(float));
  m->a1 = malloc(B * (size_t)h1 * sizeof(float));
  m->a2 = malloc(B * (size_t)h2 * sizeof(float));
  m->d1 = malloc(B * (size_t)h1 * sizeof(float));
  m->d2 = malloc(B * (size_t)h2 * sizeof(float));
  m->z = malloc(B * sizeof(float));
  m->prob = malloc(B * sizeof(float));
  m->dz = malloc(B * sizeof(float));
  m->demb = malloc(B * m->emb * sizeof(float));
  if (!m->x || !m->a1 || !m->a2 || !m->d1 || !m->d2 || !m->z || !m->prob || !m->dz ||
      !m->demb) {
    ctr_mlp_destroy(m);
    return NULL;
  }
  openblas_set_num_threads(threads);
  return m;
}

void ctr_mlp_destroy(ctr_mlp *m) {
  if (!m) return;
  float *bufs[] = {m->x, m->a1, m->a2, m->d1, m->d2, m->z, m->prob, m->dz, m->demb};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
  for (int i = 0; i < CTR_NPARAMS; i++) {
    free(m->adam_m[i]);
    free(m->adam_v[i]);
  }
  free(m);
}

void ctr_mlp_bind(ctr_mlp *m, int i, float *data, float *grad) {
  m->p[i] = data;
  m->g[i] = grad;
}

size_t ctr_mlp_emb_width(const ctr_mlp *m) { return m->emb; }

/* out (n x cols) = in (n x k) W (k x cols) + b, then ReLU when relu. */
static void dense_layer(size_t n, size_t k, size_t cols, const float *in, const float *W,
                        const float *b, float *out, int relu) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)cols, (int)k, 1.0f, in,
              (int)k, W, (int)cols, 0.0f, out, (int)cols);
  for (size_t i = 0; i < n; i++) {
    float *o = out + i * cols;
    for (size_t j = 0; j < cols; j++) {
      float v = o[j] + b[j];
      o[j] = relu && v < 0 ? 0 : v;
    }
  }
}

/* log(1 + exp(z)) - y z, without overflow. */
static double logistic_loss(double z, double y) {
  return (z > 0 ? z : 0) - z * y + log1p(exp(-fabs(z)));
}

double ctr_mlp_forward(ctr_mlp *m, size_t n, const float *emb, const float *dense,
                       const float *labels, float *prob) {
  size_t in = m->in, E = m->emb, D = (size_t)m->dense;
  for (size_t i = 0; i < n; i++) {
    float *x = m->x + i * in;
    memcpy(x, emb + i * E, E * sizeof(float));
    for (size_t j = 0; j < D; j++) x[E + j] = log1pf(fmaxf(dense[i * D + j], 0.0f));
  }
  dense_layer(n, in, (size_t)m->h1, m->x, m->p[0], m->p[1], m->a1, 1);
  dense_layer(n, (size_t)m->h1, (size_t)m->h2, m->a1, m->p[2], m->p[3], m->a2, 1);
  dense_layer(n, (size_t)m->h2, 1, m->a2, m->p[4], m->p[5], m->z, 0);
  double loss = 0;
  for (size_t i = 0; i < n; i++) {
    double z = m->z[i];
    m->prob[i] = (float)(1.0 / (1.0 + exp(-z)));
    if (labels) loss += logistic_loss(z, labels[i]);
  }
  if (prob) memcpy(prob, m->prob, n * sizeof(float));
  return labels && n ? loss / (double)n : 0;
}

/* g (cols) = column sums of d (n x cols). */
static void col_sums(size_t n, size_t cols, const float *d, float *g) {
  memset(g, 0, cols * sizeof(float));
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < cols; j++) g[j] += d[i * cols + j];
}

const float *ctr_mlp_backward(ctr_mlp *m, size_t n, const float *labels) {
  int N = (int)n, in = (int)m->in, h1 = m->h1, h2 = m->h2, E = (int)m->emb;
  float inv = n ? 1.0f / (float)n : 0;
  for (size_t i = 0; i < n; i++) m->dz[i] = (m->prob[i] - labels[i]) * inv;
  /* Output layer: gW3 = a2^T dz, gb3 = sum dz; d2 = dz W3^T through ReLU. */
  cblas_sgemv(CblasRowMajor, CblasTrans, N, h2, 1.0f, m->a2, h2, m->dz, 1, 0.0f, m->g[4], 1);
  col_sums(n, 1, m->dz, m->g[5]);
  for (size_t i = 0; i < n; i++)
    for (int j = 0; j < h2; j++) {
      size_t k = i * (size_t)h2 + (size_t)j;
      m->d2[k] = m->a2[k] > 0 ? m->dz[i] * m->p[4][j] : 0;
    }
  /* Second layer: gW2 = a1^T d2; d1 = d2 W2^T through ReLU. */
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, h1, h2, N, 1.0f, m->a1, h1, m->d2, h2,
              0.0f, m->g[2], h2);
  col_sums(n, (size_t)h2, m->d2, m->g[3]);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, h1, h2, 1.0f, m->d2, h2, m->p[2], h2,
              0.0f, m->d1, h1);
  for (size_t k = 0; k < n * (size_t)h1; k++)
    if (m->a1[k] <= 0) m->d1[k] = 0;
  /* First layer: gW1 = x^T d1; the embeddings' gradient d1 W1[0:E]^T. */
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, h1, N, 1.0f, m->x, in, m->d1, h1,
              0.0f, m->g[0], h1);
  col_sums(n, (size_t)h1, m->d1, m->g[1]);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, E, h1, 1.0f, m->d1, h1, m->p[0], h1,
              0.0f, m->demb, E);
  return m->demb;
}

int ctr_mlp_local_update(ctr_mlp *m, int adam, double lr, uint64_t t) {
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  double lr_t = adam ? lr * sqrt(1 - pow(b2, (double)t + 1)) / (1 - pow(b1, (double)t + 1)) : lr;
  for (int i = 0; i < CTR_NPARAMS; i++) {
    float *w = m->p[i], *g = m->g[i];
    size_t n = m->numel[i];
    if (!adam) {
      for (size_t k = 0; k < n; k++) w[k] -= (float)lr * g[k];
      continue;
    }
    if (!m->adam_m[i]) {
      m->adam_m[i] = calloc(n, sizeof(float));
      m->adam_v[i] = calloc(n, sizeof(float));
      if (!m->adam_m[i] || !m->adam_v[i]) return -1;
    }
    float *mm = m->adam_m[i], *vv = m->adam_v[i];
    for (size_t k = 0; k < n; k++) {
      mm[k] = (float)(b1 * mm[k] + (1 - b1) * g[k]);
      vv[k] = (float)(b2 * vv[k] + (1 - b2) * g[k] * g[k]);
      w[k] -= (float)(lr_t * mm[k] / (sqrt(vv[k]) + eps));
    }
  }
  return 0;
}

double ctr_logloss(const float *prob, const float *label, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++) {
    double p = fmin(fmax(prob[i], 1e-7), 1 - 1e-7);
    s -= label[i] > 0.5f ? log(p) : log(1 - p);
  }
  return n ? s / (double)n : 0;
}
