/*
 * nn_model.c - the CIFAR-10 tutorial CNN (nn.h) on a backend (nn_backend.h):
 * parameter table, activation buffers, forward, backward, local SGD.
 * Every computation goes through the vtable.
 *
 * On a device backend (host_mapped 0) a step is queued without a wait in
 * the middle: parameters go up on the backend's copy stream, each layer
 * waits only for its own parameters, each gradient goes down as soon as it
 * is complete (while the layers below still compute), the loss terms stay
 * in device floats until the end. The caller's parameter and gradient
 * buffers are page-locked in place (host_register) so those copies really
 * overlap, and the whole step is recorded once per (batch, input buffers)
 * as a graph and replayed (graph_*), which turns ~60 launches into one.
 * The first step runs op by op (a warm-up: the driver loads kernels and
 * cuBLAS picks its algorithms outside the recording). A recording or
 * replay that fails turns graphs off for the model (the step runs op by
 * op; the backend's error state is untouched by such failures); every
 * step counts what it did and why in m->info (cnn_get_run_info).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nn.h"
#include "nn_backend.h"
#include "nn_pin.h"

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

/* Loss terms, each in its own device float: the summed cross-entropy, then
 * one L2 term per parameter (used for those with weight decay). */
#define LOSS_XENT 0
#define LOSS_SLOTS (1 + CNN_NUM_PARAMS)
/* Upload tags beyond the parameters' (0..CNN_NUM_PARAMS-1). */
#define SLOT_IMG CNN_NUM_PARAMS
#define SLOT_LAB (CNN_NUM_PARAMS + 1)
/* Recorded step graphs kept: one per (batch size, image buffer, label
 * buffer); a worker double-buffering its input uses two. */
#define MAX_GRAPHS 4
/* Buffers page-locked: every bound value and gradient buffer. */
#define MAX_PINNED (2 * CNN_NUM_PARAMS)

typedef struct step_graph {
  int B;                 /* batch size it was recorded for */
  const void *img, *lab; /* host input buffers its copies read */
  void *g;               /* the backend's graph; NULL: slot free */
} step_graph;

struct cnn {
  const cnn_backend *be;  /* ops, memory */
  int max_batch, lrn;     /* largest batch; LRN layers on */
  float smooth;           /* label smoothing of the training loss */
  float *hval[CNN_NUM_PARAMS], *hgrad[CNN_NUM_PARAMS]; /* caller's */
  float *val[CNN_NUM_PARAMS], *grad[CNN_NUM_PARAMS];   /* device */
  int owns_dev[CNN_NUM_PARAMS]; /* val/grad allocated here (not host_mapped) */
  float *img;     /* device NCHW staging (not host_mapped) */
  uint8_t *lab;   /* device labels (not host_mapped) */
  int32_t *pred;  /* device predictions */
  int32_t *hpred; /* host staging for predictions */
  float *dloss;   /* LOSS_SLOTS device floats */
  float *hloss;   /* their host copy (== dloss when host_mapped) */
  float *himg;    /* page-locked host staging of the images (not host_mapped) */
  uint8_t *hlab;  /* ... and of the labels */
  /* activations (NHWC) */
  float *x0, *c1, *p1, *n1, *s1, *c2, *n2, *s2, *p2, *f3, *f4, *lg;
  int32_t *a1, *a2;
  /* gradients */
  float *dc1, *dp1, *dc2, *dn2, *dp2, *df3, *df4, *dlg, *dn1;
  void *ws1, *ws2; /* convolution workspaces, one per layer (conv2's
                     backward reuses what its forward left in ws2) */
  cnn_lrn_param lp; /* the LRN layers' parameters */
  int prof;       /* profiling on (no graphs then: every op is timed) */
  double pt[P_N]; /* profile: seconds per slot */
  long psteps;    /* profile: steps timed */
  int pin_dirty;  /* bindings changed since the buffers were page-locked */
  int pinned;     /* every bound buffer is page-locked */
  cnn_pinset pins; /* the page-locked ranges this model holds (nn_pin.c) */
  /* Page-locked stand-ins for bound buffers that lie across two locked
   * ranges (part of their pages locked by another model): the step's
   * copies use these, the host copies them to / from the caller's. NULL:
   * the buffer is used directly. */
  float *sval[CNN_NUM_PARAMS], *sgrad[CNN_NUM_PARAMS];
  int graphs_on;  /* cnn_use_graphs (default 1) */
  int graphs_broken; /* a recording or replay failed: stay eager */
  int warm;       /* a step ran op by op: graphs may be recorded */
  int logged;     /* the graph failure was said on stderr */
  step_graph graphs[MAX_GRAPHS]; /* recorded steps */
  int graph_next; /* slot the next recording replaces */
  int dev_vals;   /* cnn_values_on_device: the device values are the
                     parameters; steps upload none, SGD stays there */
  cnn_run_info info; /* what the steps did (cnn_get_run_info) */
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

const char *cnn_backend_name(const cnn_backend *be) { return be ? be->name : "none"; }

void *cnn_host_alloc(const cnn_backend *be, size_t bytes) {
  if (!be) return NULL;
  if (be->host_alloc) return be->host_alloc(be, bytes);
  return calloc(1, bytes ? bytes : 1);
}

void cnn_host_free(const cnn_backend *be, void *p) {
  if (!be || !p) return;
  if (be->host_free) be->host_free(be, p);
  else free(p);
}

/* A synchronous copy between a caller's host buffer and the device
 * (to_dev: host -> device). The driver refuses a host range that is only
 * partly page-locked, or that lies across two locked ranges (CUDA:
 * cudaErrorInvalidValue): a buffer sharing pages with another model's
 * locked buffers can be such a range (nn_pin.h: cnn_pin_direct). It then
 * goes through a page-locked bounce buffer. */
static void host_copy(cnn *m, int to_dev, void *dev, void *host,
                      size_t bytes) {
  const cnn_backend *be = m->be;
  void *tmp = NULL;
  if (be->host_register && !cnn_pin_direct(be, host, bytes))
    tmp = cnn_host_alloc(be, bytes);
  if (to_dev) {
    if (tmp) memcpy(tmp, host, bytes);
    be->to_device(be, dev, tmp ? tmp : host, bytes);
  } else {
    be->to_host(be, tmp ? tmp : host, dev, bytes);
    if (tmp && !(be->error && be->error(be))) memcpy(host, tmp, bytes);
  }
  cnn_host_free(be, tmp);
}

static void graphs_drop(cnn *m) {
  for (int i = 0; i < MAX_GRAPHS; i++) {
    if (m->graphs[i].g) m->be->graph_free(m->be, m->graphs[i].g);
    m->graphs[i] = (step_graph){0, NULL, NULL, NULL};
  }
}

static void unpin(cnn *m) {
  cnn_pin_release(m->be, &m->pins);
  m->pinned = 0;
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    cnn_host_free(m->be, m->sval[i]);
    cnn_host_free(m->be, m->sgrad[i]);
    m->sval[i] = m->sgrad[i] = NULL;
  }
}

void cnn_destroy(cnn *m) {
  if (!m) return;
  const cnn_backend *be = m->be;
  if (be->sync) be->sync(be); /* no copy may still use a buffer */
  graphs_drop(m);
  unpin(m);
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    if (m->owns_dev[i]) {
      be->free(be, m->val[i]);
      be->free(be, m->grad[i]);
    }
  void *bufs[] = {m->img, m->lab, m->pred, m->x0, m->c1, m->p1, m->s1,
                  m->c2, m->s2, m->p2, m->f3, m->f4, m->lg, m->a1, m->a2,
                  m->dc1, m->dp1, m->dc2, m->dp2, m->df3, m->df4, m->dlg,
                  m->ws1, m->ws2, m->dloss};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    be->free(be, bufs[i]);
  if (m->lrn) {
    be->free(be, m->n1);
    be->free(be, m->n2);
    be->free(be, m->dn1);
    be->free(be, m->dn2);
  }
  if (!be->host_mapped) {
    cnn_host_free(be, m->hloss);
    cnn_host_free(be, m->himg);
    cnn_host_free(be, m->hlab);
  }
  cnn_host_free(be, m->hpred);
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
  m->graphs_on = 1;
  size_t B = (size_t)max_batch, F = sizeof(float);
  size_t a24 = B * 24 * 24 * 64, a12 = B * 12 * 12 * 64, a6 = B * 6 * 6 * 64;
  int ok = 1;
#define ALLOC(field, bytes) \
  ok = ok && (m->field = be->alloc(be, (bytes))) != NULL
#define HALLOC(field, bytes) \
  ok = ok && (m->field = cnn_host_alloc(be, (bytes))) != NULL
  if (!be->host_mapped) {
    ALLOC(img, B * CNN_IMAGE_FLOATS * F);
    ALLOC(lab, B);
    HALLOC(himg, B * CNN_IMAGE_FLOATS * F);
    HALLOC(hlab, B);
    HALLOC(hloss, LOSS_SLOTS * F);
  }
  ALLOC(dloss, LOSS_SLOTS * F);
  if (be->host_mapped) m->hloss = m->dloss;
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
  /* conv1's data gradient is never computed (its input is the images) */
  ALLOC(ws1, be->conv_ws_fwd_bytes ? be->conv_ws_fwd_bytes(be, &g1)
                                   : be->conv_ws_bytes(be, &g1));
  ALLOC(ws2, be->conv_ws_bytes(be, &g2));
  /* page-locked where the backend has it: a small malloc'd buffer may
   * share a page with locked parameter buffers (cnn_pin_direct) */
  HALLOC(hpred, B * sizeof(int32_t));
#undef ALLOC
#undef HALLOC
  if (!ok) {
    cnn_destroy(m);
    return -1;
  }
  *out = m;
  return 0;
}

void cnn_bind(cnn *m, int i, float *value, float *grad) {
  if (!m || i < 0 || i >= CNN_NUM_PARAMS) return;
  const cnn_backend *be = m->be;
  int new_val = m->hval[i] != value;
  if (new_val || m->hgrad[i] != grad) {
    if (be->sync) be->sync(be); /* copies may still read the old buffers */
    m->pin_dirty = 1;
    graphs_drop(m); /* they copy from and to the old buffers */
  }
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
  /* the device values are the parameters: take a new buffer's now */
  if (m->dev_vals && new_val && m->owns_dev[i] && value)
    host_copy(m, 1, m->val[i], value, cnn_param_numel(i) * sizeof(float));
}

void cnn_values_on_device(cnn *m, int on) {
  if (!m || m->be->host_mapped || (on ? 1 : 0) == m->dev_vals) return;
  const cnn_backend *be = m->be;
  if (be->sync) be->sync(be); /* a local SGD may still be queued */
  graphs_drop(m); /* they upload (or not) the values */
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    if (!m->owns_dev[i] || !m->hval[i]) continue;
    size_t bytes = cnn_param_numel(i) * sizeof(float);
    host_copy(m, on, m->val[i], m->hval[i], bytes);
  }
  m->dev_vals = on ? 1 : 0;
}

void cnn_use_graphs(cnn *m, int on) {
  if (!m) return;
  m->graphs_on = on ? 1 : 0;
}

int cnn_set_label_smoothing(cnn *m, float smooth) {
  if (!m || !(smooth >= 0.0f && smooth < 1.0f)) return -1;
  m->smooth = smooth;
  graphs_drop(m); /* recorded with the old value */
  return 0;
}

/* Page-locking failed: no graphs (their copies need locked memory);
 * the copies then go through the driver's staging. Said once. */
static void pin_failed(cnn *m, const char *why) {
  unpin(m);
  m->info.pinned = -1;
  snprintf(m->info.pin_error, sizeof m->info.pin_error, "%s", why);
  if (!m->logged)
    fprintf(stderr, "cnn: parameter buffers not page-locked, no graphs: %s\n", why);
  m->logged = 1;
}

/* Page-locks the caller's parameter and gradient buffers in place, so the
 * copies to and from them overlap the ops. Separate small buffers often
 * share a page and the driver refuses to lock a page twice, so the
 * buffers' page ranges are merged first, and ranges another model has
 * locked are shared with it (nn_pin.c). Failure is not an error (see
 * pin_failed). */
static void pin_params(cnn *m) {
  const cnn_backend *be = m->be;
  if (!m->pin_dirty) return;
  m->pin_dirty = 0;
  unpin(m);
  if (!be->host_register) {
    m->info.pinned = 0;
    return;
  }
  cnn_pin_range r[MAX_PINNED];
  int n = 0;
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    float *bufs[2] = {m->hval[i], m->hgrad[i]};
    for (int k = 0; k < 2; k++, n++) /* start and bytes: cnn_pin_merge */
      r[n] = (cnn_pin_range){(uintptr_t)bufs[k], cnn_param_numel(i) * sizeof(float)};
  }
  n = cnn_pin_merge(r, n);
  char err[CNN_INFO_TEXT];
  if (cnn_pin_acquire(be, r, n, &m->pins, err, sizeof err) != 0) {
    pin_failed(m, err);
    return;
  }
  /* a buffer partly in another model's range and partly in a gap is
   * locked, but in two registrations: not one DMA, not for a graph. It
   * gets a page-locked stand-in (these are small: only buffers that share
   * a page with another model's lie across a range's end). */
  long staged = 0;
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    for (int k = 0; k < 2; k++) {
      size_t bytes = cnn_param_numel(i) * sizeof(float);
      float **st = k ? &m->sgrad[i] : &m->sval[i];
      if (cnn_pin_within_one(be, k ? m->hgrad[i] : m->hval[i], bytes)) continue;
      if (!(*st = cnn_host_alloc(be, bytes))) {
        snprintf(err, sizeof err, "no page-locked stand-in for %s (%zu bytes)",
                 PARAMS[i].name, bytes);
        pin_failed(m, err);
        return;
      }
      staged++;
    }
  m->info.pinned_staged = staged;
  m->pinned = 1;
  m->info.pinned = 1;
  m->info.pin_error[0] = '\0';
  m->info.pinned_ranges = m->pins.own;
  m->info.pinned_shared = m->pins.shared;
}

static int ready(const cnn *m, const float *images, const uint8_t *labels,
                 int B) {
  if (!m || !images || B < 1 || B > m->max_batch) return 0;
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    if (!m->val[i] || !m->grad[i]) return 0;
  if (labels)
    for (int b = 0; b < B; b++)
      if (labels[b] >= CNN_NUM_CLASSES) return 0;
  if (m->be->error && m->be->error(m->be)) return 0;
  return 1;
}

/* 1 if the caller's input buffer [p, p+bytes) can be copied from
 * directly: it is page-locked, all of it in one locked range. A buffer
 * that only starts in a locked page (a small malloc'd buffer sharing a
 * page with locked parameter buffers: an evaluation batch) is refused by
 * the driver (cnn_pin_direct): it is staged. */
static int input_direct(const cnn_backend *be, const void *p, size_t bytes) {
  return be->host_pinned && be->host_pinned(be, p) && cnn_pin_direct(be, p, bytes);
}

/* The host input buffers the step's copies read: the caller's if they are
 * page-locked (input_direct), else the model's page-locked staging,
 * filled here. */
static void stage_inputs(cnn *m, const float *images, const uint8_t *labels,
                         int B, const float **himg, const uint8_t **hlab) {
  const cnn_backend *be = m->be;
  size_t ibytes = (size_t)B * CNN_IMAGE_FLOATS * sizeof(float);
  *himg = images;
  *hlab = labels;
  if (be->host_mapped) return;
  if (!input_direct(be, images, ibytes)) {
    memcpy(m->himg, images, ibytes);
    *himg = m->himg;
  }
  if (labels && !input_direct(be, labels, (size_t)B)) {
    memcpy(m->hlab, labels, (size_t)B);
    *hlab = m->hlab;
  }
}

/* Stand-ins (m->sval, m->sgrad): in = 1 before the step's copies read the
 * values, in = 0 after its gradients have arrived. */
static void stand_ins(cnn *m, int in) {
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    size_t bytes = cnn_param_numel(i) * sizeof(float);
    if (in && m->sval[i]) memcpy(m->sval[i], m->hval[i], bytes);
    if (!in && m->sgrad[i]) memcpy(m->hgrad[i], m->sgrad[i], bytes);
  }
}

/* 1 if a bound buffer of a model that is not page-locked (pin_failed; no
 * stand-ins then, no graphs) is a range the driver refuses to copy
 * (host_copy): it must go through a bounce buffer. A page-locked model
 * has a stand-in for every such buffer (pin_params). */
static int unlocked_split(const cnn *m, const void *host, size_t bytes) {
  const cnn_backend *be = m->be;
  return !m->pinned && be->host_register && !cnn_pin_direct(be, host, bytes);
}

static void up(cnn *m, int slot, void *dst, const void *src, size_t bytes) {
  const cnn_backend *be = m->be;
  if (be->upload_async) be->upload_async(be, slot, dst, src, bytes);
  else be->to_device(be, dst, src, bytes);
}

static void down(cnn *m, void *dst, const void *src, size_t bytes) {
  const cnn_backend *be = m->be;
  if (be->download_async) be->download_async(be, dst, src, bytes);
  else be->to_host(be, dst, src, bytes);
}

/* The ops queued after this wait for the upload tagged slot (none for
 * the parameters while their device values are kept). */
static void need(cnn *m, int slot) {
  const cnn_backend *be = m->be;
  if (m->dev_vals && slot < CNN_NUM_PARAMS) return;
  if (!be->host_mapped && be->upload_wait) be->upload_wait(be, slot);
}

/* Queues the parameter and input uploads; the device inputs to read. */
static void upload(cnn *m, const float *himg, const uint8_t *hlab, int B,
                   const float **dimg, const uint8_t **dlab) {
  const cnn_backend *be = m->be;
  if (be->host_mapped) {
    *dimg = himg;
    *dlab = hlab;
    return;
  }
  up(m, SLOT_IMG, m->img, himg, (size_t)B * CNN_IMAGE_FLOATS * sizeof(float));
  if (hlab) up(m, SLOT_LAB, m->lab, hlab, (size_t)B);
  /* in the order the forward uses them */
  for (int i = 0; i < CNN_NUM_PARAMS && !m->dev_vals; i++) {
    size_t bytes = cnn_param_numel(i) * sizeof(float);
    if (m->sval[i]) up(m, i, m->val[i], m->sval[i], bytes);
    else if (!unlocked_split(m, m->hval[i], bytes)) up(m, i, m->val[i], m->hval[i], bytes);
    else host_copy(m, 1, m->val[i], m->hval[i], bytes); /* no graph then */
  }
  *dimg = m->img;
  *dlab = hlab ? m->lab : NULL;
}

/* Forward through the logits (m->lg). */
static void forward(cnn *m, const float *dimg, int B, double *t0) {
  const cnn_backend *be = m->be;
  cnn_conv_geom g1, g2;
  cnn_pool_geom q1, q2;
  geoms(B, &g1, &g2, &q1, &q2);
  need(m, SLOT_IMG);
  be->nchw_to_nhwc(be, B, 3, 24, 24, dimg, m->x0);
  tick(m, P_INPUT, t0);
  need(m, W1);
  need(m, B1);
  be->conv_fwd(be, &g1, m->x0, m->val[W1], m->val[B1], 1, m->c1, m->ws1);
  tick(m, P_CONV1, t0);
  be->maxpool_fwd(be, &q1, m->c1, m->p1, m->a1);
  tick(m, P_POOL1, t0);
  if (m->lrn) {
    be->lrn_fwd(be, (size_t)B * 144, 64, &m->lp, m->p1, m->n1, m->s1);
    tick(m, P_LRN1, t0);
  }
  need(m, W2);
  need(m, B2);
  be->conv_fwd(be, &g2, m->n1, m->val[W2], m->val[B2], 1, m->c2, m->ws2);
  tick(m, P_CONV2, t0);
  if (m->lrn) {
    be->lrn_fwd(be, (size_t)B * 144, 64, &m->lp, m->c2, m->n2, m->s2);
    tick(m, P_LRN2, t0);
  }
  be->maxpool_fwd(be, &q2, m->n2, m->p2, m->a2);
  tick(m, P_POOL2, t0);
  for (int i = W3; i <= B5; i++) need(m, i);
  be->dense_fwd(be, B, 2304, 384, m->p2, m->val[W3], m->val[B3], 1, m->f3);
  tick(m, P_LOCAL3, t0);
  be->dense_fwd(be, B, 384, 192, m->f3, m->val[W4], m->val[B4], 1, m->f4);
  tick(m, P_LOCAL4, t0);
  be->dense_fwd(be, B, 192, 10, m->f4, m->val[W5], m->val[B5], 0, m->lg);
  tick(m, P_LOGITS, t0);
}

/* Gradient i is complete but for its weight decay: adds that (its loss
 * term to its slot) and sends the gradient down to the caller's buffer
 * while the layers below still compute. */
static void grad_done(cnn *m, int i, double *t0) {
  const cnn_backend *be = m->be;
  if (PARAMS[i].weight_decay > 0.0) {
    be->l2_decay(be, cnn_param_numel(i), (float)PARAMS[i].weight_decay,
                 m->val[i], m->grad[i], m->dloss + 1 + i);
    tick(m, P_DECAY, t0);
  }
  if (!be->host_mapped) {
    size_t bytes = cnn_param_numel(i) * sizeof(float);
    if (m->sgrad[i]) down(m, m->sgrad[i], m->grad[i], bytes);
    else if (!unlocked_split(m, m->hgrad[i], bytes)) down(m, m->hgrad[i], m->grad[i], bytes);
    else host_copy(m, 0, m->grad[i], m->hgrad[i], bytes); /* no graph then */
    tick(m, P_COPY, t0);
  }
}

/* Backward of an FC layer with ReLU (weights w, bias w + 1, input x,
 * output y, dy the gradient of y after the ReLU): the ReLU backward, then
 * the layer's; fused where the backend offers it. */
static void relu_dense_bwd(cnn *m, int B, int K, int N, const float *x, int w,
                           const float *y, float *dy, float *dx) {
  const cnn_backend *be = m->be;
  if (be->relu_bwd_bias) {
    be->relu_bwd_bias(be, B, N, y, dy, m->grad[w + 1]);
    be->dense_bwd(be, B, K, N, x, m->val[w], dy, dx, m->grad[w], NULL);
  } else {
    be->relu_bwd(be, (size_t)B * N, y, dy);
    be->dense_bwd(be, B, K, N, x, m->val[w], dy, dx, m->grad[w],
                  m->grad[w + 1]);
  }
}

/* Queues a whole training step: uploads, forward, backward, the gradient
 * and loss downloads. Waits for nothing (but when profiling). */
static void train_ops(cnn *m, const float *himg, const uint8_t *hlab, int B,
                      double *t0) {
  const cnn_backend *be = m->be;
  const float *dimg;
  const uint8_t *dlab;
  upload(m, himg, hlab, B, &dimg, &dlab);
  tick(m, P_COPY, t0);
  forward(m, dimg, B, t0);
  need(m, SLOT_LAB);
  be->softmax_xent(be, B, 10, m->lg, dlab, m->smooth, 1.0f / (float)B, m->dlg, NULL,
                   m->dloss + LOSS_XENT);
  tick(m, P_XENT, t0);

  cnn_conv_geom g1, g2;
  cnn_pool_geom q1, q2;
  geoms(B, &g1, &g2, &q1, &q2);
  be->dense_bwd(be, B, 192, 10, m->f4, m->val[W5], m->dlg, m->df4,
                m->grad[W5], m->grad[B5]);
  tick(m, P_LOGITS_B, t0);
  grad_done(m, W5, t0);
  grad_done(m, B5, t0);
  relu_dense_bwd(m, B, 384, 192, m->f3, W4, m->f4, m->df4, m->df3);
  tick(m, P_LOCAL4_B, t0);
  grad_done(m, W4, t0);
  grad_done(m, B4, t0);
  relu_dense_bwd(m, B, 2304, 384, m->p2, W3, m->f3, m->df3, m->dp2);
  tick(m, P_LOCAL3_B, t0);
  grad_done(m, W3, t0);
  grad_done(m, B3, t0);
  /* pool2 backward; without LRN its input is the ReLU output of conv2 */
  be->maxpool_bwd(be, &q2, m->dp2, m->a2, m->lrn ? NULL : m->c2, m->dn2);
  tick(m, P_POOL2_B, t0);
  if (m->lrn) {
    be->lrn_bwd(be, (size_t)B * 144, 64, &m->lp, m->c2, m->s2, m->dn2, 1,
                m->dc2);
    tick(m, P_LRN2_B, t0);
  }
  be->conv_bwd_filter(be, &g2, m->n1, m->dc2, m->grad[W2], m->grad[B2],
                      m->ws2);
  tick(m, P_CONV2_BF, t0);
  grad_done(m, W2, t0);
  grad_done(m, B2, t0);
  be->conv_bwd_data(be, &g2, m->dc2, m->val[W2], m->dn1, m->ws2);
  tick(m, P_CONV2_BD, t0);
  if (m->lrn) {
    be->lrn_bwd(be, (size_t)B * 144, 64, &m->lp, m->p1, m->s1, m->dn1, 0,
                m->dp1);
    tick(m, P_LRN1_B, t0);
  }
  be->maxpool_bwd(be, &q1, m->dp1, m->a1, m->c1, m->dc1);
  tick(m, P_POOL1_B, t0);
  be->conv_bwd_filter(be, &g1, m->x0, m->dc1, m->grad[W1], m->grad[B1],
                      m->ws1);
  tick(m, P_CONV1_BF, t0);
  grad_done(m, W1, t0);
  grad_done(m, B1, t0);
  if (!be->host_mapped) down(m, m->hloss, m->dloss, LOSS_SLOTS * sizeof(float));
}

/* A graph call failed: graphs off for this model (the step runs op by
 * op), the reason kept and said once. The backend's error state is not
 * touched by such a failure (nn_backend.h), so the ops that follow run. */
static void graph_failed(cnn *m, const char *call) {
  const cnn_backend *be = m->be;
  const char *why = be->soft_error ? be->soft_error(be) : NULL;
  m->info.graph_failures++;
  m->graphs_broken = 1;
  m->info.graphs_broken = 1;
  graphs_drop(m);
  if (!m->info.graph_error[0])
    snprintf(m->info.graph_error, sizeof m->info.graph_error, "%s failed: %s",
             call, why ? why : "no reason given");
  if (!m->logged)
    fprintf(stderr, "cnn: graphs off for this model, steps run op by op: %s\n",
            m->info.graph_error);
  m->logged = 1;
}

/* Why this step is not a graph replay; NULL: it may be one. */
static const char *eager_reason(const cnn *m, const float *himg,
                                const uint8_t *hlab) {
  const cnn_backend *be = m->be;
  if (!be->graph_begin || !be->host_pinned) return "the backend has no graphs";
  if (!m->graphs_on) return "graphs off (cnn_use_graphs)";
  if (m->graphs_broken) return "graphs off after a failure (see graph_error)";
  if (m->prof) return "profiling (every op timed)";
  if (!m->pinned) return "parameter buffers not page-locked (see pin_error)";
  if (!be->host_pinned(be, himg) || !be->host_pinned(be, hlab))
    return "input buffers not page-locked";
  if (!m->warm) return "warm-up (the first step runs op by op)";
  return NULL;
}

/* The recorded step for this batch and these input buffers, recording it
 * if there is none; NULL: run the ops eagerly (*why says why). */
static void *step_graph_for(cnn *m, const float *himg, const uint8_t *hlab,
                            int B, const char **why) {
  const cnn_backend *be = m->be;
  if ((*why = eager_reason(m, himg, hlab)) != NULL) return NULL;
  for (int i = 0; i < MAX_GRAPHS; i++)
    if (m->graphs[i].g && m->graphs[i].B == B && m->graphs[i].img == himg &&
        m->graphs[i].lab == hlab)
      return m->graphs[i].g;
  *why = "graph recording failed (see graph_error)";
  if (be->graph_begin(be) != 0) {
    graph_failed(m, "graph_begin");
    return NULL;
  }
  double t0 = 0.0;
  train_ops(m, himg, hlab, B, &t0);
  void *g = be->graph_end(be);
  if (!g) {
    graph_failed(m, "graph_end");
    return NULL;
  }
  m->info.graph_recordings++;
  step_graph *s = &m->graphs[m->graph_next];
  m->graph_next = (m->graph_next + 1) % MAX_GRAPHS;
  if (s->g) be->graph_free(be, s->g);
  *s = (step_graph){B, himg, hlab, g};
  *why = NULL;
  return g;
}

/* Counts a step that returned a loss: replayed or op by op, and why. */
static void count_step(cnn *m, int replayed, const char *why) {
  m->info.steps++;
  m->warm = 1;
  if (replayed) {
    m->info.graph_replays++;
    return;
  }
  m->info.eager_steps++;
  snprintf(m->info.eager_why, sizeof m->info.eager_why, "%s", why ? why : "");
}

float cnn_train_step(cnn *m, const float *images, const uint8_t *labels,
                     int B) {
  if (!labels || !ready(m, images, labels, B)) return NAN;
  const cnn_backend *be = m->be;
  double t0 = m->prof ? now_s() : 0.0;
  const float *himg;
  const uint8_t *hlab;
  if (!be->host_mapped) pin_params(m);
  stage_inputs(m, images, labels, B, &himg, &hlab);
  const char *why = NULL;
  void *g = be->host_mapped ? NULL : step_graph_for(m, himg, hlab, B, &why);
  if (be->host_mapped) why = "the backend computes in host memory: no graphs";
  stand_ins(m, 1);
  int replayed = 0;
  if (g) {
    replayed = be->graph_launch(be, g) == 0;
    if (!replayed) {
      graph_failed(m, "graph_launch");
      why = "graph replay failed (see graph_error)";
    }
  }
  if (!replayed) train_ops(m, himg, hlab, B, &t0);
  if (be->sync) be->sync(be);
  stand_ins(m, 0);
  if (!be->host_mapped) tick(m, P_COPY, &t0); /* the downloads' tail */
  if (be->error && be->error(be)) return NAN;
  m->psteps++;
  count_step(m, replayed, why);
  double loss = (double)m->hloss[LOSS_XENT] / B;
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    if (PARAMS[i].weight_decay > 0.0) loss += m->hloss[1 + i];
  return (float)loss;
}

/* The forward pass of an evaluation (cnn_eval, cnn_eval_logits): the
 * inputs staged and uploaded, the logits in m->lg; *dlab the labels on the
 * device (NULL without labels). */
static void eval_forward(cnn *m, const float *images, const uint8_t *labels, int B,
                         const uint8_t **dlab) {
  const cnn_backend *be = m->be;
  double t0 = 0.0;
  const float *himg, *dimg;
  const uint8_t *hlab;
  int prof = m->prof;
  m->prof = 0; /* the profile is of training steps */
  if (!be->host_mapped) pin_params(m);
  stage_inputs(m, images, labels, B, &himg, &hlab);
  stand_ins(m, 1);
  upload(m, himg, hlab, B, &dimg, dlab);
  forward(m, dimg, B, &t0);
  if (hlab) need(m, SLOT_LAB);
  m->prof = prof;
}

float cnn_eval(cnn *m, const float *images, const uint8_t *labels, int B,
               int *pred) {
  if (!ready(m, images, labels, B)) return NAN;
  const cnn_backend *be = m->be;
  const uint8_t *dlab;
  eval_forward(m, images, labels, B, &dlab);
  be->softmax_xent(be, B, 10, m->lg, dlab, 0.0f, 0.0f, NULL, pred ? m->pred : NULL,
                   m->dloss + LOSS_XENT);
  if (!be->host_mapped)
    be->to_host(be, m->hloss, m->dloss, LOSS_SLOTS * sizeof(float));
  if (pred) be->to_host(be, m->hpred, m->pred, (size_t)B * sizeof(int32_t));
  if (be->sync) be->sync(be);
  if (be->error && be->error(be)) return NAN;
  if (pred)
    for (int b = 0; b < B; b++) pred[b] = m->hpred[b];
  return labels ? m->hloss[LOSS_XENT] / (float)B : 0.0f;
}

int cnn_eval_logits(cnn *m, const float *images, int B, float *logits) {
  if (!logits || !ready(m, images, NULL, B)) return -1;
  const cnn_backend *be = m->be;
  const uint8_t *dlab;
  eval_forward(m, images, NULL, B, &dlab);
  be->to_host(be, logits, m->lg, (size_t)B * CNN_NUM_CLASSES * sizeof(float));
  if (be->sync) be->sync(be);
  return be->error && be->error(be) ? -1 : 0;
}

void cnn_sgd_local(cnn *m, float lr) {
  if (!m) return;
  const cnn_backend *be = m->be;
  double t0 = m->prof ? now_s() : 0.0;
  int back = !be->host_mapped && !m->dev_vals; /* values copied back */
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    if (!m->val[i] || !m->grad[i]) continue;
    size_t n = cnn_param_numel(i), bytes = n * sizeof(float);
    be->sgd(be, n, lr, m->grad[i], m->val[i]);
    if (!back || !m->hval[i]) continue;
    /* A value buffer that lies across two page-locked ranges (it shares
     * pages with another model's buffers) cannot be copied into directly:
     * the driver refuses such a range (CUDA: invalid argument). It goes
     * through its stand-in, as the step's upload does, or, when the
     * bindings changed since the buffers were locked, a bounce buffer. */
    float *st = m->pin_dirty ? NULL : m->sval[i];
    if (st) down(m, st, m->val[i], bytes);
    else if (!be->host_register || cnn_pin_direct(be, m->hval[i], bytes))
      down(m, m->hval[i], m->val[i], bytes);
    else host_copy(m, 0, m->val[i], m->hval[i], bytes); /* after the sgd */
  }
  /* kept on the device: the next step's ops queue behind the update */
  if (be->sync && !m->dev_vals) be->sync(be);
  if (back && !m->pin_dirty && !(be->error && be->error(be)))
    for (int i = 0; i < CNN_NUM_PARAMS; i++)
      if (m->sval[i] && m->hval[i])
        memcpy(m->hval[i], m->sval[i], cnn_param_numel(i) * sizeof(float));
  tick(m, P_SGD, &t0);
}

void cnn_get_run_info(const cnn *m, cnn_run_info *out) {
  if (!out) return;
  if (!m) {
    memset(out, 0, sizeof *out);
    return;
  }
  *out = m->info;
}

const char *cnn_error(const cnn *m) {
  if (!m || !m->be->error) return NULL;
  return m->be->error(m->be);
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

double cnn_profile_ms(const cnn *m) {
  if (!m || m->psteps == 0) return 0.0;
  double tot = 0.0;
  for (int i = 0; i < P_N; i++) tot += m->pt[i];
  return 1e3 * tot / (double)m->psteps;
}

void cnn_profile_print(const cnn *m, FILE *f) {
  if (!m || !f || m->psteps == 0) return;
  double tot = 0.0;
  for (int i = 0; i < P_N; i++) tot += m->pt[i];
  fprintf(f, "per-step time by op (%ld steps, %.2f ms/step):\n", m->psteps,
          cnn_profile_ms(m));
  for (int i = 0; i < P_N; i++)
    if (m->pt[i] > 0.0)
      fprintf(f, "  %-26s %8.3f ms  %5.1f%%\n", PNAMES[i],
              1e3 * m->pt[i] / (double)m->psteps, 100.0 * m->pt[i] / tot);
}
