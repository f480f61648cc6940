/*
 * nn_model.c - the CIFAR-10 tutorial CNN (nn.h) on a backend (nn_backend.h):
 * parameter table, activation buffers, forward, backward, local SGD.
 * Every computation goes through the vtable.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nn.h"
#include "nn_backend.h"

/* ------------------------------------------------------------ parameters */

enum { W1, B1, W2, B2, W3, B3, W4, B4, W5, B5 };

static const cnn_param PARAMS[CNN_NUM_PARAMS] = {
    {"conv1/weights", 4, {5, 5, 3, 64}, PS_INIT_TRUNCATED_NORMAL, 0.0, 5e-2, 0.0},
    {"conv1/biases", 1, {64}, PS_INIT_ZEROS, 0.0, 0.0, 0.0},
    {"conv2/weights", 4, {5, 5, 64, 64}, PS_INIT_TRUNCATED_NORMAL, 0.0, 5e-2, 0.0},
    {"conv2/biases", 1, {64}, PS_INIT_CONSTANT, 0.1, 0.0, 0.0},
    {"local3/weights", 2, {2304, 384}, PS_INIT_TRUNCATED_NORMAL, 0.0, 0.04, 0.004},
    {"local3/biases", 1, {384}, PS_INIT_CONSTANT, 0.1, 0.0, 0.0},
    {"local4/weights", 2, {384, 192}, PS_INIT_TRUNCATED_NORMAL, 0.0, 0.04, 0.004},
    {"local4/biases", 1, {192}, PS_INIT_CONSTANT, 0.1, 0.0, 0.0},
    {"softmax_linear/weights", 2, {192, 10}, PS_INIT_TRUNCATED_NORMAL, 0.0, 1.0 / 192.0, 0.0},
    {"softmax_linear/biases", 1, {10}, PS_INIT_ZEROS, 0.0, 0.0, 0.0},
};

int cnn_num_params(void) { return CNN_NUM_PARAMS; }

const cnn_param *cnn_param_info(int i) {
  return i >= 0 && i < CNN_NUM_PARAMS ? &PARAMS[i] : NULL;
}

size_t cnn_param_numel(int i) {
  const cnn_param *p = cnn_param_info(i);
  if (!p) return 0;
  size_t n = 1;
  for (int d = 0; d < p->ndim; d++) n *= (size_t)p->shape[d];
  return n;
}

void cnn_pool_geom_init(cnn_pool_geom *g, int B, int H, int W, int C, int k,
                        int s) {
  g->B = B;
  g->H = H;
  g->W = W;
  g->C = C;
  g->k = k;
  g->s = s;
  g->OH = (H + s - 1) / s;
  g->OW = (W + s - 1) / s;
  int ph = (g->OH - 1) * s + k - H, pw = (g->OW - 1) * s + k - W;
  g->pad_top = ph > 0 ? ph / 2 : 0;
  g->pad_left = pw > 0 ? pw / 2 : 0;
}

/* ------------------------------------------------------------ the model */

/* profile slots */
enum {
  P_INPUT, P_CONV1, P_POOL1, P_LRN1, P_CONV2, P_LRN2, P_POOL2, P_LOCAL3,
  P_LOCAL4, P_LOGITS, P_XENT, P_LOGITS_B, P_LOCAL4_B, P_LOCAL3_B, P_DECAY,
  P_POOL2_B, P_LRN2_B, P_CONV2_BF, P_CONV2_BD, P_LRN1_B, P_POOL1_B,
  P_CONV1_BF, P_SGD, P_COPY, P_N
};
static const char *const PNAMES[P_N] = {
    "input nchw->nhwc", "conv1 fwd (+bias,relu)", "pool1 fwd", "lrn1 fwd",
    "conv2 fwd (+bias,relu)", "lrn2 fwd", "pool2 fwd", "local3 fwd",
    "local4 fwd", "softmax_linear fwd", "softmax xent",
    "softmax_linear bwd", "local4 bwd (+relu)", "local3 bwd (+relu)",
    "weight decay", "pool2 bwd", "lrn2 bwd (+relu)", "conv2 bwd filter+bias",
    "conv2 bwd data", "lrn1 bwd", "pool1 bwd (+relu)",
    "conv1 bwd filter+bias", "sgd", "param/grad copies"};

struct cnn {
  const cnn_backend *be;
  int max_batch, lrn;
  float *hval[CNN_NUM_PARAMS], *hgrad[CNN_NUM_PARAMS]; /* caller's */
  float *val[CNN_NUM_PARAMS], *grad[CNN_NUM_PARAMS];   /* device */
  int owns_dev[CNN_NUM_PARAMS];
  float *img;     /* device NCHW staging (not host_mapped) */
  uint8_t *lab;   /* device labels (not host_mapped) */
  int32_t *pred;  /* device predictions */
  int32_t *hpred; /* host staging for predictions */
  /* activations (NHWC) */
  float *x0, *c1, *p1, *n1, *s1, *c2, *n2, *s2, *p2, *f3, *f4, *lg;
  int32_t *a1, *a2;
  /* gradients */
  float *dc1, *dp1, *dn1, *dc2, *dn2, *dp2, *df3, *df4, *dlg;
  void *ws;
  cnn_lrn_param lp;
  int prof;
  double pt[P_N];
  long psteps;
};

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* profile: time since *t0 goes to slot */
static void tick(cnn *m, int slot, double *t0) {
  if (!m->prof) return;
  if (m->be->sync) m->be->sync(m->be);
  double t = now_s();
  m->pt[slot] += t - *t0;
  *t0 = t;
}

static void geoms(int B, cnn_conv_geom *g1, cnn_conv_geom *g2,
                  cnn_pool_geom *q1, cnn_pool_geom *q2) {
  *g1 = (cnn_conv_geom){B, 24, 24, 3, 64, 5};
  *g2 = (cnn_conv_geom){B, 12, 12, 64, 64, 5};
  cnn_pool_geom_init(q1, B, 24, 24, 64, 3, 2);
  cnn_pool_geom_init(q2, B, 12, 12, 64, 3, 2);
}

void cnn_destroy(cnn *m) {
  if (!m) return;
  const cnn_backend *be = m->be;
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    if (m->owns_dev[i]) {
      be->free(be, m->val[i]);
      be->free(be, m->grad[i]);
    }
  void *bufs[] = {m->img, m->lab, m->pred, m->x0, m->c1, m->p1, m->s1,
                  m->c2, m->s2, m->p2, m->f3, m->f4, m->lg, m->a1, m->a2,
                  m->dc1, m->dp1, m->dc2, m->dp2, m->df3, m->df4, m->dlg,
                  m->ws};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    be->free(be, bufs[i]);
  if (m->lrn) {
    be->free(be, m->n1);
    be->free(be, m->n2);
    be->free(be, m->dn1);
    be->free(be, m->dn2);
  }
  free(m->hpred);
  free(m);
}

int cnn_create(const cnn_backend *be, int max_batch, int lrn, cnn **out) {
  if (!out) return -1;
  *out = NULL;
  if (!be || max_batch < 1 || max_batch > CNN_MAX_BATCH) return -1;
  cnn *m = calloc(1, sizeof *m);
  if (!m) return -1;
  m->be = be;
  m->max_batch = max_batch;
  m->lrn = lrn ? 1 : 0;
  m->lp = (cnn_lrn_param){4, 1.0f, 0.001f / 9.0f, 0.75f};
  size_t B = (size_t)max_batch, F = sizeof(float);
  size_t a24 = B * 24 * 24 * 64, a12 = B * 12 * 12 * 64, a6 = B * 6 * 6 * 64;
  int ok = 1;
#define ALLOC(field, bytes) \
  ok = ok && (m->field = be->alloc(be, (bytes))) != NULL
  if (!be->host_mapped) {
    ALLOC(img, B * CNN_IMAGE_FLOATS * F);
    ALLOC(lab, B);
  }
  ALLOC(pred, B * sizeof(int32_t));
  ALLOC(x0, B * CNN_IMAGE_FLOATS * F);
  ALLOC(c1, a24 * F);
  ALLOC(p1, a12 * F);
  ALLOC(a1, a12 * sizeof(int32_t));
  ALLOC(c2, a12 * F);
  ALLOC(p2, a6 * F);
  ALLOC(a2, a6 * sizeof(int32_t));
  ALLOC(f3, B * 384 * F);
  ALLOC(f4, B * 192 * F);
  ALLOC(lg, B * 10 * F);
  ALLOC(dc1, a24 * F);
  ALLOC(dp1, a12 * F);
  ALLOC(dc2, a12 * F);
  ALLOC(dp2, a6 * F);
  ALLOC(df3, B * 384 * F);
  ALLOC(df4, B * 192 * F);
  ALLOC(dlg, B * 10 * F);
  if (m->lrn) {
    ALLOC(n1, a12 * F);
    ALLOC(s1, a12 * F);
    ALLOC(n2, a12 * F);
    ALLOC(s2, a12 * F);
    ALLOC(dn1, a12 * F);
    ALLOC(dn2, a12 * F);
  } else {
    m->n1 = m->p1; /* conv2 reads the pool1 output */
    m->n2 = m->c2; /* pool2 reads the conv2 output */
    m->dn1 = m->dp1;
    m->dn2 = m->dc2;
  }
  cnn_conv_geom g1, g2;
  cnn_pool_geom q1, q2;
  geoms(max_batch, &g1, &g2, &q1, &q2);
  size_t w1 = be->conv_ws_bytes(be, &g1), w2 = be->conv_ws_bytes(be, &g2);
  ALLOC(ws, w1 > w2 ? w1 : w2);
#undef ALLOC
  m->hpred = malloc(B * sizeof(int32_t));
  if (!ok || !m->hpred) {
    cnn_destroy(m);
    return -1;
  }
  *out = m;
  return 0;
}

void cnn_bind(cnn *m, int i, float *value, float *grad) {
  if (!m || i < 0 || i >= CNN_NUM_PARAMS) return;
  const cnn_backend *be = m->be;
  m->hval[i] = value;
  m->hgrad[i] = grad;
  if (be->host_mapped) {
    m->val[i] = value;
    m->grad[i] = grad;
    return;
  }
  if (!m->owns_dev[i]) {
    size_t bytes = cnn_param_numel(i) * sizeof(float);
    m->val[i] = be->alloc(be, bytes);
    m->grad[i] = be->alloc(be, bytes);
    m->owns_dev[i] = m->val[i] && m->grad[i];
  }
}

static int ready(const cnn *m, const float *images, const uint8_t *labels,
                 int B) {
  if (!m || !images || B < 1 || B > m->max_batch) return 0;
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    if (!m->val[i] || !m->grad[i]) return 0;
  if (labels)
    for (int b = 0; b < B; b++)
      if (labels[b] >= CNN_NUM_CLASSES) return 0;
  return 1;
}

static void upload(cnn *m, const float *images, const uint8_t *labels, int B,
                   const float **dimg, const uint8_t **dlab) {
  const cnn_backend *be = m->be;
  if (be->host_mapped) {
    *dimg = images;
    *dlab = labels;
    return;
  }
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    be->to_device(be, m->val[i], m->hval[i],
                  cnn_param_numel(i) * sizeof(float));
  be->to_device(be, m->img, images, (size_t)B * CNN_IMAGE_FLOATS * sizeof(float));
  *dimg = m->img;
  *dlab = NULL;
  if (labels) {
    be->to_device(be, m->lab, labels, (size_t)B);
    *dlab = m->lab;
  }
}

/* Forward through the logits (m->lg). */
static void forward(cnn *m, const float *dimg, int B, double *t0) {
  const cnn_backend *be = m->be;
  cnn_conv_geom g1, g2;
  cnn_pool_geom q1, q2;
  geoms(B, &g1, &g2, &q1, &q2);
  be->nchw_to_nhwc(be, B, 3, 24, 24, dimg, m->x0);
  tick(m, P_INPUT, t0);
  be->conv_fwd(be, &g1, m->x0, m->val[W1], m->val[B1], 1, m->c1, m->ws);
  tick(m, P_CONV1, t0);
  be->maxpool_fwd(be, &q1, m->c1, m->p1, m->a1);
  tick(m, P_POOL1, t0);
  if (m->lrn) {
    be->lrn_fwd(be, (size_t)B * 144, 64, &m->lp, m->p1, m->n1, m->s1);
    tick(m, P_LRN1, t0);
  }
  be->conv_fwd(be, &g2, m->n1, m->val[W2], m->val[B2], 1, m->c2, m->ws);
  tick(m, P_CONV2, t0);
  if (m->lrn) {
    be->lrn_fwd(be, (size_t)B * 144, 64, &m->lp, m->c2, m->n2, m->s2);
    tick(m, P_LRN2, t0);
  }
  be->maxpool_fwd(be, &q2, m->n2, m->p2, m->a2);
  tick(m, P_POOL2, t0);
  be->dense_fwd(be, B, 2304, 384, m->p2, m->val[W3], m->val[B3], 1, m->f3);
  tick(m, P_LOCAL3, t0);
  be->dense_fwd(be, B, 384, 192, m->f3, m->val[W4], m->val[B4], 1, m->f4);
  tick(m, P_LOCAL4, t0);
  be->dense_fwd(be, B, 192, 10, m->f4, m->val[W5], m->val[B5], 0, m->lg);
  tick(m, P_LOGITS, t0);
}

float cnn_train_step(cnn *m, const float *images, const uint8_t *labels,
                     int B) {
  if (!labels || !ready(m, images, labels, B)) return NAN;
  const cnn_backend *be = m->be;
  double t0 = m->prof ? now_s() : 0.0;
  const float *dimg;
  const uint8_t *dlab;
  upload(m, images, labels, B, &dimg, &dlab);
  tick(m, P_COPY, &t0);
  forward(m, dimg, B, &t0);
  float loss = be->softmax_xent(be, B, 10, m->lg, dlab, 1.0f / (float)B,
                                m->dlg, NULL) / (float)B;
  tick(m, P_XENT, &t0);

  cnn_conv_geom g1, g2;
  cnn_pool_geom q1, q2;
  geoms(B, &g1, &g2, &q1, &q2);
  be->dense_bwd(be, B, 192, 10, m->f4, m->val[W5], m->dlg, m->df4,
                m->grad[W5], m->grad[B5]);
  tick(m, P_LOGITS_B, &t0);
  be->relu_bwd(be, (size_t)B * 192, m->f4, m->df4);
  be->dense_bwd(be, B, 384, 192, m->f3, m->val[W4], m->df4, m->df3,
                m->grad[W4], m->grad[B4]);
  tick(m, P_LOCAL4_B, &t0);
  be->relu_bwd(be, (size_t)B * 384, m->f3, m->df3);
  be->dense_bwd(be, B, 2304, 384, m->p2, m->val[W3], m->df3, m->dp2,
                m->grad[W3], m->grad[B3]);
  tick(m, P_LOCAL3_B, &t0);
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    if (PARAMS[i].weight_decay > 0.0)
      loss += be->l2_decay(be, cnn_param_numel(i),
                           (float)PARAMS[i].weight_decay, m->val[i],
                           m->grad[i]);
  tick(m, P_DECAY, &t0);
  /* pool2 backward; without LRN its input is the ReLU output of conv2 */
  be->maxpool_bwd(be, &q2, m->dp2, m->a2, m->lrn ? NULL : m->c2, m->dn2);
  tick(m, P_POOL2_B, &t0);
  if (m->lrn) {
    be->lrn_bwd(be, (size_t)B * 144, 64, &m->lp, m->c2, m->s2, m->dn2, 1,
                m->dc2);
    tick(m, P_LRN2_B, &t0);
  }
  be->conv_bwd_filter(be, &g2, m->n1, m->dc2, m->grad[W2], m->grad[B2],
                      m->ws);
  tick(m, P_CONV2_BF, &t0);
  be->conv_bwd_data(be, &g2, m->dc2, m->val[W2], m->dn1, m->ws);
  tick(m, P_CONV2_BD, &t0);
  if (m->lrn) {
    be->lrn_bwd(be, (size_t)B * 144, 64, &m->lp, m->p1, m->s1, m->dn1, 0,
                m->dp1);
    tick(m, P_LRN1_B, &t0);
  }
  be->maxpool_bwd(be, &q1, m->dp1, m->a1, m->c1, m->dc1);
  tick(m, P_POOL1_B, &t0);
  be->conv_bwd_filter(be, &g1, m->x0, m->dc1, m->grad[W1], m->grad[B1],
                      m->ws);
  tick(m, P_CONV1_BF, &t0);
  if (!be->host_mapped)
    for (int i = 0; i < CNN_NUM_PARAMS; i++)
      be->to_host(be, m->hgrad[i], m->grad[i],
                  cnn_param_numel(i) * sizeof(float));
  tick(m, P_COPY, &t0);
  m->psteps++;
  return loss;
}

float cnn_eval(cnn *m, const float *images, const uint8_t *labels, int B,
               int *pred) {
  if (!ready(m, images, labels, B)) return NAN;
  const cnn_backend *be = m->be;
  double t0 = 0.0;
  const float *dimg;
  const uint8_t *dlab;
  int prof = m->prof;
  m->prof = 0; /* the profile is of training steps */
  upload(m, images, labels, B, &dimg, &dlab);
  forward(m, dimg, B, &t0);
  float sum = be->softmax_xent(be, B, 10, m->lg, dlab, 0.0f, NULL,
                               pred ? m->pred : NULL);
  m->prof = prof;
  if (pred) {
    be->to_host(be, m->hpred, m->pred, (size_t)B * sizeof(int32_t));
    for (int b = 0; b < B; b++) pred[b] = m->hpred[b];
  }
  return labels ? sum / (float)B : 0.0f;
}

void cnn_sgd_local(cnn *m, float lr) {
  if (!m) return;
  const cnn_backend *be = m->be;
  double t0 = m->prof ? now_s() : 0.0;
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    if (!m->val[i] || !m->grad[i]) continue;
    size_t n = cnn_param_numel(i);
    be->sgd(be, n, lr, m->grad[i], m->val[i]);
    if (!be->host_mapped)
      be->to_host(be, m->hval[i], m->val[i], n * sizeof(float));
  }
  tick(m, P_SGD, &t0);
}

double cnn_train_flops(const cnn *m, int B) {
  (void)m;
  double conv1 = 2.0 * 24 * 24 * 64 * 5 * 5 * 3;  /* per image, one pass */
  double conv2 = 2.0 * 12 * 12 * 64 * 5 * 5 * 64;
  double fc = 2.0 * (2304.0 * 384 + 384.0 * 192 + 192.0 * 10);
  /* conv1: forward + filter gradient; conv2 and FC: forward, filter and
   * data gradients */
  return (double)B * (2.0 * conv1 + 3.0 * conv2 + 3.0 * fc);
}

void cnn_profile(cnn *m, int on) {
  if (!m) return;
  m->prof = on ? 1 : 0;
  memset(m->pt, 0, sizeof m->pt);
  m->psteps = 0;
}

void cnn_profile_print(const cnn *m, FILE *f) {
  if (!m || !f || m->psteps == 0) return;
  double tot = 0.0;
  for (int i = 0; i < P_N; i++) tot += m->pt[i];
  fprintf(f, "per-step time by op (%ld steps, %.2f ms/step):\n", m->psteps,
          1e3 * tot / (double)m->psteps);
  for (int i = 0; i < P_N; i++)
    if (m->pt[i] > 0.0)
      fprintf(f, "  %-26s %8.3f ms  %5.1f%%\n", PNAMES[i],
              1e3 * m->pt[i] / (double)m->psteps, 100.0 * m->pt[i] / tot);
}
