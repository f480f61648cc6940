/* cnn_dev: the CNN model's device path (nn_model.c with host_mapped 0)
 * on the host, which otherwise runs only on a GPU: parameter and input
 * copies, page-locking shared between two models (nn_pin.c), graph
 * recording and replay, the eager warm-up, the fall back to op by op when
 * a recording or a replay fails, and the counts and reasons of
 * cnn_get_run_info.
 *
 * The backend is "sim": a device backend whose memory is separate host
 * memory (calloc), whose ops are the CPU backend's, whose copies are
 * memcpy, and whose graphs are real recordings: between graph_begin and
 * graph_end every op and copy is appended to a tape instead of run, and
 * graph_launch runs the tape. Its page-locking keeps the driver's rule (a
 * page is locked once; a range must not share a page with a locked one),
 * and a recording that copies from memory that is not page-locked fails,
 * as the model must never record one. Its copies keep the driver's other
 * rule: a host range that touches a locked range without lying wholly
 * inside one (partly locked, or across two ranges) is refused, as CUDA
 * refuses it (cudaErrorInvalidValue), and the refusal is the backend's
 * sticky error, as on the CUDA backend. Failures can be asked for
 * (graph_begin, graph_end, graph_launch). The model on sim must give
 * bit for bit the CPU model's losses and parameters: the same CPU ops run
 * in the same order, whichever way the step is queued.
 *
 * Seed: CNN_DEV_SEED (default 7), printed. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn.h"
#include "nn_backend.h"
#include "nn_pin.h"
#include "testrand.h"
#include "testutil.h"


#define SIM_TAPE 512   /* ops of one recorded step (a step queues ~70) */
#define SIM_RANGES 256 /* locked ranges at once (2 models: < 60) */
#define PAGE ((uintptr_t)CNN_PIN_PAGE)
#define SIM_REFUSED "sim: %s of %zu bytes at %p refused: partly page-locked"

enum { T_NHWC, T_CONV_F, T_CONV_BF, T_CONV_BD, T_DENSE_F, T_DENSE_B, T_RELU_B,
       T_POOL_F, T_POOL_B, T_LRN_F, T_LRN_B, T_XENT, T_L2, T_SGD, T_COPY };

/* One queued op: its kind and arguments. */
typedef struct sim_op {
  int kind;
  cnn_conv_geom cg; /* convolutions */
  cnn_pool_geom pg; /* pooling */
  cnn_lrn_param lp; /* LRN */
  int a, b, c, d;   /* ints: B C H W, M K N relu, ... */
  size_t n;         /* element or byte counts */
  float f;          /* lr, wd, grad_scale */
  float f2;         /* label smoothing */
  const void *in[4];
  void *out[5];
} sim_op;

typedef struct sim_range {
  uintptr_t start, end; /* page-aligned; end 0: slot free */
  int alloc;            /* 1: from host_alloc (freed by host_free) */
} sim_range;

typedef struct sim {
  cnn_backend be;         /* first: ops cast back */
  const cnn_backend *cpu; /* runs every op */
  int fail_begin, fail_end, fail_launch; /* fail these on purpose */
  sim_op *rec;            /* the tape being recorded, NULL when not */
  int nrec;               /* ops on it */
  int rec_bad;            /* the recording copied unlocked memory */
  sim_range ranges[SIM_RANGES];
  long launches, recordings, bad_unregisters;
  char soft[256], err[256];
} sim;

typedef struct tape {
  int n;
  sim_op ops[];
} tape;

static sim *S(const cnn_backend *be) { return (sim *)be; }

static int range_of(const sim *s, uintptr_t a) {
  for (int i = 0; i < SIM_RANGES; i++)
    if (s->ranges[i].end && s->ranges[i].start <= a && a < s->ranges[i].end) return i;
  return -1;
}

/* 1 if [p, p + bytes) is inside one locked range: one DMA. */
static int locked(const sim *s, const void *p, size_t bytes) {
  int i = range_of(s, (uintptr_t)p);
  return i >= 0 && (uintptr_t)p + bytes <= s->ranges[i].end;
}

/* 1 if the driver refuses a copy between the host range [p, p + bytes)
 * and the device: the range touches a locked range without lying wholly
 * inside one (CUDA: "memory regions must be either entirely registered or
 * not registered at all"). A range that touches none is plain memory,
 * copied through the driver's own staging. */
static int refused(const sim *s, const void *p, size_t bytes) {
  uintptr_t a = (uintptr_t)p, e = a + bytes;
  int touches = 0;
  for (int i = 0; i < SIM_RANGES; i++) {
    const sim_range *r = &s->ranges[i];
    if (!r->end || e <= r->start || r->end <= a) continue;
    if (r->start <= a && e <= r->end) return 0;
    touches = 1;
  }
  return touches;
}

static void run_op(const cnn_backend *cpu, const sim_op *o) {
  switch (o->kind) {
  case T_NHWC: cpu->nchw_to_nhwc(cpu, o->a, o->b, o->c, o->d, o->in[0], o->out[0]); break;
  case T_CONV_F:
    cpu->conv_fwd(cpu, &o->cg, o->in[0], o->in[1], o->in[2], o->a, o->out[0], o->out[1]);
    break;
  case T_CONV_BF:
    cpu->conv_bwd_filter(cpu, &o->cg, o->in[0], o->in[1], o->out[0], o->out[1], o->out[2]);
    break;
  case T_CONV_BD:
    cpu->conv_bwd_data(cpu, &o->cg, o->in[0], o->in[1], o->out[0], o->out[1]);
    break;
  case T_DENSE_F:
    cpu->dense_fwd(cpu, o->a, o->b, o->c, o->in[0], o->in[1], o->in[2], o->d, o->out[0]);
    break;
  case T_DENSE_B:
    cpu->dense_bwd(cpu, o->a, o->b, o->c, o->in[0], o->in[1], o->in[2], o->out[0], o->out[1],
                   o->out[2]);
    break;
  case T_RELU_B: cpu->relu_bwd(cpu, o->n, o->in[0], o->out[0]); break;
  case T_POOL_F: cpu->maxpool_fwd(cpu, &o->pg, o->in[0], o->out[0], o->out[1]); break;
  case T_POOL_B:
    cpu->maxpool_bwd(cpu, &o->pg, o->in[0], o->in[1], o->in[2], o->out[0]);
    break;
  case T_LRN_F: cpu->lrn_fwd(cpu, o->n, o->a, &o->lp, o->in[0], o->out[0], o->out[1]); break;
  case T_LRN_B:
    cpu->lrn_bwd(cpu, o->n, o->a, &o->lp, o->in[0], o->in[1], o->in[2], o->b, o->out[0]);
    break;
  case T_XENT:
    cpu->softmax_xent(cpu, o->a, o->b, o->in[0], o->in[1], o->f2, o->f, o->out[0],
                      o->out[1], o->out[2]);
    break;
  case T_L2: cpu->l2_decay(cpu, o->n, o->f, o->in[0], o->out[0], o->out[1]); break;
  case T_SGD: cpu->sgd(cpu, o->n, o->f, o->in[0], o->out[0]); break;
  case T_COPY: memcpy(o->out[0], o->in[0], o->n); break;
  }
}

/* Records o when a recording is on, else runs it now. */
static void queue(const cnn_backend *be, const sim_op *o) {
  sim *s = S(be);
  if (!s->rec) {
    run_op(s->cpu, o);
    return;
  }
  if (s->nrec >= SIM_TAPE) {
    s->rec_bad = 1;
    snprintf(s->soft, sizeof s->soft, "sim: more than %d ops recorded", SIM_TAPE);
    return;
  }
  s->rec[s->nrec++] = *o;
}

static void s_nhwc(const cnn_backend *be, int B, int C, int H, int W, const float *src,
                   float *dst) {
  queue(be, &(sim_op){.kind = T_NHWC, .a = B, .b = C, .c = H, .d = W, .in = {src},
                      .out = {dst}});
}
static void s_conv_fwd(const cnn_backend *be, const cnn_conv_geom *g, const float *x,
                       const float *w, const float *bias, int relu, float *y, void *ws) {
  queue(be, &(sim_op){.kind = T_CONV_F, .cg = *g, .a = relu, .in = {x, w, bias},
                      .out = {y, ws}});
}
static void s_conv_bf(const cnn_backend *be, const cnn_conv_geom *g, const float *x,
                      const float *dy, float *dw, float *db, void *ws) {
  queue(be, &(sim_op){.kind = T_CONV_BF, .cg = *g, .in = {x, dy}, .out = {dw, db, ws}});
}
static void s_conv_bd(const cnn_backend *be, const cnn_conv_geom *g, const float *dy,
                      const float *w, float *dx, void *ws) {
  queue(be, &(sim_op){.kind = T_CONV_BD, .cg = *g, .in = {dy, w}, .out = {dx, ws}});
}
static void s_dense_f(const cnn_backend *be, int M, int K, int N, const float *x,
                      const float *w, const float *bias, int relu, float *y) {
  queue(be, &(sim_op){.kind = T_DENSE_F, .a = M, .b = K, .c = N, .d = relu,
                      .in = {x, w, bias}, .out = {y}});
}
static void s_dense_b(const cnn_backend *be, int M, int K, int N, const float *x,
                      const float *w, const float *dy, float *dx, float *dw, float *db) {
  queue(be, &(sim_op){.kind = T_DENSE_B, .a = M, .b = K, .c = N, .in = {x, w, dy},
                      .out = {dx, dw, db}});
}
static void s_relu_b(const cnn_backend *be, size_t n, const float *y, float *dy) {
  queue(be, &(sim_op){.kind = T_RELU_B, .n = n, .in = {y}, .out = {dy}});
}
static void s_pool_f(const cnn_backend *be, const cnn_pool_geom *g, const float *x, float *y,
                     int32_t *arg) {
  queue(be, &(sim_op){.kind = T_POOL_F, .pg = *g, .in = {x}, .out = {y, arg}});
}
static void s_pool_b(const cnn_backend *be, const cnn_pool_geom *g, const float *dy,
                     const int32_t *arg, const float *relu_x, float *dx) {
  queue(be, &(sim_op){.kind = T_POOL_B, .pg = *g, .in = {dy, arg, relu_x}, .out = {dx}});
}
static void s_lrn_f(const cnn_backend *be, size_t rows, int C, const cnn_lrn_param *p,
                    const float *x, float *y, float *scale) {
  queue(be, &(sim_op){.kind = T_LRN_F, .n = rows, .a = C, .lp = *p, .in = {x},
                      .out = {y, scale}});
}
static void s_lrn_b(const cnn_backend *be, size_t rows, int C, const cnn_lrn_param *p,
                    const float *x, const float *scale, const float *dy, int relu_mask,
                    float *dx) {
  queue(be, &(sim_op){.kind = T_LRN_B, .n = rows, .a = C, .b = relu_mask, .lp = *p,
                      .in = {x, scale, dy}, .out = {dx}});
}
static void s_xent(const cnn_backend *be, int B, int N, const float *logits,
                   const uint8_t *labels, float smooth, float grad_scale, float *dlogits,
                   int32_t *pred, float *loss) {
  queue(be, &(sim_op){.kind = T_XENT, .a = B, .b = N, .f = grad_scale, .f2 = smooth,
                      .in = {logits, labels}, .out = {dlogits, pred, loss}});
}
static void s_l2(const cnn_backend *be, size_t n, float wd, const float *w, float *dw,
                 float *loss) {
  queue(be, &(sim_op){.kind = T_L2, .n = n, .f = wd, .in = {w}, .out = {dw, loss}});
}
static void s_sgd(const cnn_backend *be, size_t n, float lr, const float *g, float *w) {
  queue(be, &(sim_op){.kind = T_SGD, .n = n, .f = lr, .in = {g}, .out = {w}});
}

/* ---- memory and copies ---- */

/* Device memory: only the host side of a copy is checked (refused), so
 * where a device buffer lies does not matter. */
static void *s_alloc(const cnn_backend *be, size_t bytes) {
  (void)be;
  return calloc(1, bytes ? bytes : 1);
}
static void s_free(const cnn_backend *be, void *p) {
  (void)be;
  free(p);
}

/* A copy the driver refuses (refused), kept as the CUDA backend keeps a
 * failed call: while recording it spoils the recording, else the first
 * one is the sticky error that the model reports from then on. */
static void refuse(sim *s, const char *what, const void *host, size_t bytes) {
  if (s->rec) {
    s->rec_bad = 1;
    snprintf(s->soft, sizeof s->soft, SIM_REFUSED, what, bytes, host);
  } else if (!s->err[0]) {
    snprintf(s->err, sizeof s->err, SIM_REFUSED, what, bytes, host);
  }
}

/* A synchronous copy; host is its host side. Synchronous copies and waits
 * are not allowed while recording. */
static void sync_copy(const cnn_backend *be, void *dst, const void *src, size_t bytes,
                      const void *host) {
  sim *s = S(be);
  if (s->rec) snprintf(s->err, sizeof s->err, "sim: synchronous copy while recording");
  else if (refused(s, host, bytes)) refuse(s, "synchronous copy", host, bytes);
  else memcpy(dst, src, bytes);
}
static void s_to_device(const cnn_backend *be, void *dst, const void *src, size_t bytes) {
  sync_copy(be, dst, src, bytes, src);
}
static void s_to_host(const cnn_backend *be, void *dst, const void *src, size_t bytes) {
  sync_copy(be, dst, src, bytes, dst);
}
static void s_sync(const cnn_backend *be) {
  sim *s = S(be);
  if (s->rec) snprintf(s->err, sizeof s->err, "sim: sync while recording");
}
/* An overlapped copy; host is its host side, which a recording needs
 * page-locked. */
static void async_copy(const cnn_backend *be, void *dst, const void *src, size_t bytes,
                       const void *host) {
  sim *s = S(be);
  if (refused(s, host, bytes)) {
    refuse(s, "overlapped copy", host, bytes);
    return;
  }
  if (s->rec && !locked(s, host, bytes)) {
    s->rec_bad = 1;
    snprintf(s->soft, sizeof s->soft, "sim: recorded a copy of %zu bytes at %p, not page-locked",
             bytes, host);
  }
  queue(be, &(sim_op){.kind = T_COPY, .n = bytes, .in = {src}, .out = {dst}});
}
static void s_upload(const cnn_backend *be, int slot, void *dst, const void *src,
                     size_t bytes) {
  (void)slot;
  async_copy(be, dst, src, bytes, src);
}
static void s_upload_wait(const cnn_backend *be, int slot) {
  (void)be;
  (void)slot; /* copies run in queue order */
}
static void s_download(const cnn_backend *be, void *dst, const void *src, size_t bytes) {
  async_copy(be, dst, src, bytes, dst);
}

/* Adds [start, end) unless it shares a page with a locked range. */
static int add_range(sim *s, uintptr_t start, uintptr_t end, int alloc) {
  for (int i = 0; i < SIM_RANGES; i++)
    if (s->ranges[i].end && start < s->ranges[i].end && s->ranges[i].start < end) {
      snprintf(s->soft, sizeof s->soft, "sim: host_register: pages already locked");
      return -1;
    }
  for (int i = 0; i < SIM_RANGES; i++)
    if (!s->ranges[i].end) {
      s->ranges[i] = (sim_range){start, end, alloc};
      return 0;
    }
  snprintf(s->soft, sizeof s->soft, "sim: host_register: more than %d ranges", SIM_RANGES);
  return -1;
}
/* Whole pages, as cudaHostAlloc's: else a neighbour in its last page looks partly locked. */
static void *s_host_alloc(const cnn_backend *be, size_t bytes) {
  size_t round = (bytes + PAGE - 1) / PAGE * PAGE;
  void *p = aligned_alloc(PAGE, round ? round : PAGE);
  if (!p) return NULL;
  memset(p, 0, round ? round : PAGE);
  if (add_range(S(be), (uintptr_t)p, (uintptr_t)p + (round ? round : PAGE), 1) != 0) {
    free(p);
    return NULL;
  }
  return p;
}
static void s_host_free(const cnn_backend *be, void *p) {
  sim *s = S(be);
  int i = p ? range_of(s, (uintptr_t)p) : -1;
  if (i >= 0 && s->ranges[i].alloc) s->ranges[i] = (sim_range){0, 0, 0};
  free(p);
}
static int s_host_register(const cnn_backend *be, void *p, size_t bytes) {
  uintptr_t a = (uintptr_t)p / PAGE * PAGE, e = ((uintptr_t)p + bytes + PAGE - 1) / PAGE * PAGE;
  return add_range(S(be), a, e, 0);
}
static void s_host_unregister(const cnn_backend *be, void *p) {
  sim *s = S(be);
  int i = range_of(s, (uintptr_t)p);
  if (i < 0 || s->ranges[i].alloc || s->ranges[i].start != (uintptr_t)p) s->bad_unregisters++;
  else s->ranges[i] = (sim_range){0, 0, 0};
}
static int s_host_pinned(const cnn_backend *be, const void *p) {
  return range_of(S(be), (uintptr_t)p) >= 0;
}

/* ---- graphs ---- */

static int s_graph_begin(const cnn_backend *be) {
  sim *s = S(be);
  if (s->fail_begin) {
    snprintf(s->soft, sizeof s->soft, "sim: graph_begin fails on purpose");
    return -1;
  }
  s->rec = calloc(SIM_TAPE, sizeof(sim_op));
  s->nrec = 0;
  s->rec_bad = 0;
  return s->rec ? 0 : -1;
}
static void *s_graph_end(const cnn_backend *be) {
  sim *s = S(be);
  sim_op *ops = s->rec;
  s->rec = NULL;
  if (s->fail_end) snprintf(s->soft, sizeof s->soft, "sim: graph_end fails on purpose");
  tape *t = s->fail_end || s->rec_bad ? NULL : malloc(sizeof *t + (size_t)s->nrec * sizeof(sim_op));
  if (t) {
    t->n = s->nrec;
    memcpy(t->ops, ops, (size_t)s->nrec * sizeof(sim_op));
    s->recordings++;
  }
  free(ops);
  return t;
}
static int s_graph_launch(const cnn_backend *be, void *graph) {
  sim *s = S(be);
  if (s->fail_launch) {
    snprintf(s->soft, sizeof s->soft, "sim: graph_launch fails on purpose");
    return -1;
  }
  const tape *t = graph;
  for (int i = 0; i < t->n; i++) run_op(s->cpu, &t->ops[i]);
  s->launches++;
  return 0;
}
static void s_graph_free(const cnn_backend *be, void *graph) {
  (void)be;
  free(graph);
}
static const char *s_soft_error(const cnn_backend *be) {
  return S(be)->soft[0] ? S(be)->soft : NULL;
}
static const char *s_error(const cnn_backend *be) { return S(be)->err[0] ? S(be)->err : NULL; }

/* A sim backend over the one-thread CPU backend (every member the CPU
 * backend has, then the device ones). */
static sim *sim_new(void) {
  sim *s = calloc(1, sizeof *s);
  ck_assert_ptr_nonnull(s);
  s->cpu = cnn_backend_cpu(1);
  s->be = *s->cpu;
  cnn_backend *b = &s->be;
  b->name = "sim";
  b->host_mapped = 0;
  b->alloc = s_alloc;
  b->free = s_free;
  b->to_device = s_to_device;
  b->to_host = s_to_host;
  b->sync = s_sync;
  b->nchw_to_nhwc = s_nhwc;
  b->conv_fwd = s_conv_fwd;
  b->conv_bwd_filter = s_conv_bf;
  b->conv_bwd_data = s_conv_bd;
  b->dense_fwd = s_dense_f;
  b->dense_bwd = s_dense_b;
  b->relu_bwd = s_relu_b;
  b->maxpool_fwd = s_pool_f;
  b->maxpool_bwd = s_pool_b;
  b->lrn_fwd = s_lrn_f;
  b->lrn_bwd = s_lrn_b;
  b->softmax_xent = s_xent;
  b->l2_decay = s_l2;
  b->sgd = s_sgd;
  b->host_alloc = s_host_alloc;
  b->host_free = s_host_free;
  b->host_register = s_host_register;
  b->host_unregister = s_host_unregister;
  b->host_pinned = s_host_pinned;
  b->upload_async = s_upload;
  b->upload_wait = s_upload_wait;
  b->download_async = s_download;
  b->graph_begin = s_graph_begin;
  b->graph_end = s_graph_end;
  b->graph_launch = s_graph_launch;
  b->graph_free = s_graph_free;
  b->soft_error = s_soft_error;
  b->error = s_error;
  return s;
}

static int sim_live_ranges(const sim *s, int alloc) {
  int n = 0;
  for (int i = 0; i < SIM_RANGES; i++) n += s->ranges[i].end && s->ranges[i].alloc == alloc;
  return n;
}

/* ------------------------------------------------------------ the tests */

#define B_ 8 /* batch: small, the CPU runs every step */

/* A model on be whose parameter buffers are at val[i] / grad[i] (the
 * caller's), initialized as cifar_worker does. */
static cnn *model_on(const cnn_backend *be, int lrn, float **val, float **grad) {
  cnn *m = NULL;
  ck_assert_int_eq(cnn_create(be, B_, lrn, &m), 0);
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    const cnn_param *p = cnn_param_info(i);
    size_t n = cnn_param_numel(i);
    ps_init init = PS_SIZED(ps_init, (ps_init_kind)p->init_kind, p->init_a, p->init_b, 3);
    ck_assert_int_eq(ps_init_fill(&init, p->name, p->shape, p->ndim, val[i], n), 0);
    cnn_bind(m, i, val[i], grad[i]);
  }
  return m;
}

/* Parameter buffers calloc'd one by one (as libpsclient's ps_var's). */
static void bufs_new(float **val, float **grad) {
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    val[i] = zeros(cnn_param_numel(i));
    grad[i] = zeros(cnn_param_numel(i));
  }
}
static void bufs_free(float **val, float **grad) {
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    free(val[i]);
    free(grad[i]);
  }
}

static uint64_t test_seed(void) {
  const char *e = getenv("CNN_DEV_SEED");
  uint64_t sd = e && *e ? strtoull(e, NULL, 10) : 7;
  printf("cnn_dev: seed %llu (CNN_DEV_SEED to change)\n", (unsigned long long)sd);
  return sd;
}

/* Two input batches in buffers of be (page-locked on sim). */
static void inputs_new(const cnn_backend *be, float *img[2], uint8_t *lab[2]) {
  for (int k = 0; k < 2; k++) {
    img[k] = cnn_host_alloc(be, (size_t)B_ * CNN_IMAGE_FLOATS * sizeof(float));
    lab[k] = cnn_host_alloc(be, B_);
    ck_assert(img[k] && lab[k]);
    float *r = randn((size_t)B_ * CNN_IMAGE_FLOATS, 1.0f);
    memcpy(img[k], r, (size_t)B_ * CNN_IMAGE_FLOATS * sizeof(float));
    free(r);
    for (int b = 0; b < B_; b++) lab[k][b] = (uint8_t)(ur() * 10);
  }
}

/* steps on the CPU model and the sim model (inputs alternating), each
 * followed by local SGD: the losses bit for bit equal and finite. */
static void run_both(cnn *c, cnn *d, float *img[2], uint8_t *lab[2], int steps) {
  for (int s = 0; s < steps; s++) {
    float lc = cnn_train_step(c, img[s % 2], lab[s % 2], B_);
    float ld = cnn_train_step(d, img[s % 2], lab[s % 2], B_);
    ck_assert_msg(isfinite(ld) && ld == lc, "step %d: loss cpu %.9g, sim %.9g (%s)", s,
                  (double)lc, (double)ld, cnn_error(d) ? cnn_error(d) : "no error");
    cnn_sgd_local(c, 0.05f);
    cnn_sgd_local(d, 0.05f);
  }
}

static void same_params(float **a, float **b) {
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    ck_assert_msg(!memcmp(a[i], b[i], cnn_param_numel(i) * sizeof(float)),
                  "%s differs from the CPU model's", cnn_param_info(i)->name);
}

/* Graphs on: the first step runs op by op (the warm-up), then each input
 * buffer pair gets one recording and every later step replays; the
 * losses and final parameters are the CPU model's, bit for bit. */
START_TEST(test_graphs_replay_as_cpu) {
  seed(test_seed());
  sim *s = sim_new();
  const cnn_backend *cpu = cnn_backend_cpu(1);
  float *cv[CNN_NUM_PARAMS], *cg[CNN_NUM_PARAMS], *dv[CNN_NUM_PARAMS], *dg[CNN_NUM_PARAMS];
  bufs_new(cv, cg);
  bufs_new(dv, dg);
  for (int lrn = 0; lrn < 2; lrn++) {
    cnn *c = model_on(cpu, lrn, cv, cg), *d = model_on(&s->be, lrn, dv, dg);
    float *img[2];
    uint8_t *lab[2];
    inputs_new(&s->be, img, lab);
    run_both(c, d, img, lab, 1);
    cnn_run_info ri;
    cnn_get_run_info(d, &ri);
    ck_assert_msg(ri.eager_steps == 1 && ri.graph_recordings == 0 &&
                      strstr(ri.eager_why, "warm-up"),
                  "first step: %ld eager, %ld recorded, why '%s'", ri.eager_steps,
                  ri.graph_recordings, ri.eager_why);
    run_both(c, d, img, lab, 6);
    same_params(cv, dv);
    cnn_get_run_info(d, &ri);
    ck_assert_int_eq(ri.steps, 7);
    ck_assert_int_eq(ri.eager_steps, 1);
    ck_assert_int_eq(ri.graph_replays, 6);
    ck_assert_int_eq(ri.graph_recordings, 2); /* one per input buffer pair */
    ck_assert_int_eq(ri.graph_failures, 0);
    ck_assert_int_eq(ri.pinned, 1);
    ck_assert_int_eq(s->launches, 6);
    ck_assert_str_eq(ri.graph_error, "");
    cnn_get_run_info(c, &ri);
    ck_assert_int_eq(ri.graph_replays, 0);
    ck_assert_int_eq(ri.eager_steps, 7);
    ck_assert_ptr_nonnull(strstr(ri.eager_why, "host memory"));
    cnn_destroy(c);
    cnn_destroy(d);
    for (int k = 0; k < 2; k++) {
      cnn_host_free(&s->be, img[k]);
      cnn_host_free(&s->be, lab[k]);
    }
    s->launches = 0;
  }
  ck_assert_int_eq(sim_live_ranges(s, 0), 0); /* every range unlocked */
  ck_assert_int_eq(s->bad_unregisters, 0);
  bufs_free(cv, cg);
  bufs_free(dv, dg);
  free(s);
}
END_TEST

/* A recording that cannot begin, a recording that fails, and a replay
 * that fails: each step still returns the CPU's loss (never NaN), the
 * backend's error stays clear, graphs stay off for the model, and the
 * reason names the call and the backend's sentence. */
START_TEST(test_graph_failures_fall_back) {
  seed(test_seed());
  static const char *const calls[] = {"graph_begin", "graph_end", "graph_launch"};
  const cnn_backend *cpu = cnn_backend_cpu(1);
  for (int f = 0; f < 3; f++) {
    sim *s = sim_new();
    s->fail_begin = f == 0;
    s->fail_end = f == 1;
    s->fail_launch = f == 2;
    float *cv[CNN_NUM_PARAMS], *cg[CNN_NUM_PARAMS], *dv[CNN_NUM_PARAMS], *dg[CNN_NUM_PARAMS];
    bufs_new(cv, cg);
    bufs_new(dv, dg);
    cnn *c = model_on(cpu, 1, cv, cg), *d = model_on(&s->be, 1, dv, dg);
    float *img[2];
    uint8_t *lab[2];
    inputs_new(&s->be, img, lab);
    run_both(c, d, img, lab, 5);
    same_params(cv, dv);
    cnn_run_info ri;
    cnn_get_run_info(d, &ri);
    ck_assert_ptr_null(cnn_error(d));
    ck_assert_int_eq(ri.steps, 5);
    ck_assert_int_eq(ri.eager_steps, 5);
    ck_assert_int_eq(ri.graph_replays, 0);
    ck_assert_int_eq(ri.graph_failures, 1); /* tried once, then off */
    ck_assert_int_eq(ri.graphs_broken, 1);
    ck_assert_int_eq(ri.graph_recordings, f == 2 ? 1 : 0);
    char want[128];
    snprintf(want, sizeof want, "%s failed: sim: %s fails on purpose", calls[f], calls[f]);
    ck_assert_str_eq(ri.graph_error, want);
    ck_assert_ptr_nonnull(strstr(ri.eager_why, "graphs off after a failure"));
    ck_assert_int_eq(s->launches, 0);
    cnn_destroy(c);
    cnn_destroy(d);
    for (int k = 0; k < 2; k++) {
      cnn_host_free(&s->be, img[k]);
      cnn_host_free(&s->be, lab[k]);
    }
    bufs_free(cv, cg);
    bufs_free(dv, dg);
    free(s);
  }
}
END_TEST

/* Graphs asked off, and inputs in plain memory: the reasons say so. */
START_TEST(test_eager_reasons) {
  seed(test_seed());
  sim *s = sim_new();
  float *dv[CNN_NUM_PARAMS], *dg[CNN_NUM_PARAMS];
  bufs_new(dv, dg);
  cnn *d = model_on(&s->be, 0, dv, dg);
  cnn_use_graphs(d, 0);
  float *img = randn((size_t)B_ * CNN_IMAGE_FLOATS, 1.0f);
  uint8_t lab[B_] = {1, 2, 3, 4, 5, 6, 7, 8};
  for (int k = 0; k < 3; k++) ck_assert(isfinite(cnn_train_step(d, img, lab, B_)));
  cnn_run_info ri;
  cnn_get_run_info(d, &ri);
  ck_assert_int_eq(ri.eager_steps, 3);
  ck_assert_str_eq(ri.eager_why, "graphs off (cnn_use_graphs)");
  /* on again: plain inputs go through the model's page-locked staging,
   * so graphs record and replay from there */
  cnn_use_graphs(d, 1);
  for (int k = 0; k < 3; k++) ck_assert(isfinite(cnn_train_step(d, img, lab, B_)));
  cnn_get_run_info(d, &ri);
  ck_assert_int_eq(ri.graph_recordings, 1);
  ck_assert_int_eq(ri.graph_replays, 3);
  cnn_profile(d, 1);
  ck_assert(isfinite(cnn_train_step(d, img, lab, B_)));
  cnn_get_run_info(d, &ri);
  ck_assert_str_eq(ri.eager_why, "profiling (every op timed)");
  cnn_destroy(d);
  bufs_free(dv, dg);
  free(img);
  free(s);
}
END_TEST

/* Parameter buffers of two models interleaved in one arena, so their
 * pages are shared: both models page-lock (the second shares the first's
 * ranges, locks only the gaps, and copies the buffers that lie across two
 * ranges through stand-ins), both record and replay graphs with the CPU's
 * results, and after the first model is gone the second still runs; when
 * both are gone nothing is left locked. Without the sharing, the second
 * model's page-locking failed. */
START_TEST(test_two_models_share_pages) {
  seed(test_seed());
  sim *s = sim_new();
  const cnn_backend *cpu = cnn_backend_cpu(1);
  size_t total = 0;
  for (int i = 0; i < CNN_NUM_PARAMS; i++) total += 4 * (cnn_param_numel(i) * 4 + 64);
  char *arena = aligned_alloc(PAGE, (total + PAGE) / PAGE * PAGE);
  ck_assert_ptr_nonnull(arena);
  memset(arena, 0, (total + PAGE) / PAGE * PAGE);
  float *av[CNN_NUM_PARAMS], *ag[CNN_NUM_PARAMS], *bv[CNN_NUM_PARAMS], *bg[CNN_NUM_PARAMS];
  float *cv[CNN_NUM_PARAMS], *cg[CNN_NUM_PARAMS];
  size_t off = 0;
  for (int i = 0; i < CNN_NUM_PARAMS; i++) { /* a's, b's, a's, b's: 64-byte steps */
    float **slot[4] = {&av[i], &bv[i], &ag[i], &bg[i]};
    for (int k = 0; k < 4; k++) {
      *slot[k] = (float *)(arena + off);
      off += (cnn_param_numel(i) * 4 + 63) / 64 * 64;
    }
  }
  bufs_new(cv, cg);
  cnn *c = model_on(cpu, 1, cv, cg), *a = model_on(&s->be, 1, av, ag);
  cnn *b = model_on(&s->be, 1, bv, bg);
  float *img[2];
  uint8_t *lab[2];
  inputs_new(&s->be, img, lab);
  for (int st = 0; st < 4; st++) {
    float lc = cnn_train_step(c, img[st % 2], lab[st % 2], B_);
    float la = cnn_train_step(a, img[st % 2], lab[st % 2], B_);
    float lb = cnn_train_step(b, img[st % 2], lab[st % 2], B_);
    ck_assert_msg(la == lc && lb == lc, "step %d: cpu %.9g, a %.9g, b %.9g", st, (double)lc,
                  (double)la, (double)lb);
    cnn_sgd_local(c, 0.05f);
    cnn_sgd_local(a, 0.05f);
    cnn_sgd_local(b, 0.05f);
  }
  same_params(cv, av);
  same_params(cv, bv);
  cnn_run_info ra, rb;
  cnn_get_run_info(a, &ra);
  cnn_get_run_info(b, &rb);
  ck_assert_msg(ra.pinned == 1 && rb.pinned == 1, "pinned a %d (%s), b %d (%s)", ra.pinned,
                ra.pin_error, rb.pinned, rb.pin_error);
  ck_assert_int_eq(ra.pinned_shared, 0);
  ck_assert_int_gt(rb.pinned_shared, 0);
  ck_assert_int_gt(rb.pinned_staged, 0);
  ck_assert_int_eq(ra.graph_replays, 3);
  ck_assert_int_eq(rb.graph_replays, 3);
  int both = cnn_pin_live(&s->be);
  ck_assert_int_eq(both, (int)(ra.pinned_ranges + rb.pinned_ranges));
  cnn_destroy(a); /* b keeps the ranges it shares */
  /* a's ranges that b shares stay locked, the rest are unlocked */
  int left = cnn_pin_live(&s->be);
  ck_assert_msg(left < both && left > rb.pinned_ranges, "%d of %d ranges left, b owns %ld", left,
                both, rb.pinned_ranges);
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    ck_assert(s_host_pinned(&s->be, bv[i]) && s_host_pinned(&s->be, bg[i]));
  float lc = cnn_train_step(c, img[0], lab[0], B_), lb = cnn_train_step(b, img[0], lab[0], B_);
  ck_assert_msg(lb == lc, "after a is gone: cpu %.9g, b %.9g", (double)lc, (double)lb);
  cnn_destroy(b);
  ck_assert_int_eq(cnn_pin_live(&s->be), 0);
  ck_assert_int_eq(sim_live_ranges(s, 0), 0);
  ck_assert_int_eq(s->bad_unregisters, 0);
  cnn_destroy(c);
  for (int k = 0; k < 2; k++) {
    cnn_host_free(&s->be, img[k]);
    cnn_host_free(&s->be, lab[k]);
  }
  bufs_free(cv, cg);
  free(arena);
  free(s);
}
END_TEST

#define ARENA_STEP 64 /* buffers packed in an arena on cache-line (64-byte) steps */

/* Bytes parameter i's value (or gradient) buffer takes in an arena. */
static size_t arena_bytes(int i) {
  return (cnn_param_numel(i) * sizeof(float) + ARENA_STEP - 1) / ARENA_STEP * ARENA_STEP;
}

/* An input batch right after the model's parameter buffers in one arena
 * (a caller packing its buffers), so that it begins in the last page of
 * the parameters' locked range and runs on into pages nobody locked. The
 * driver refuses a copy from such a range, so the model must stage the
 * batch rather than upload it from where it lies: the steps and the
 * evaluation then give the CPU model's losses, parameters and predictions,
 * and graphs still record and replay (from the staging). Before 4b648a8
 * the model uploaded any batch whose first byte was page-locked: the sim
 * refuses that upload, and the first step returns NaN with the error. */
START_TEST(test_inputs_straddling_locked_pages_are_staged) {
  seed(test_seed());
  sim *s = sim_new();
  const cnn_backend *cpu = cnn_backend_cpu(1);
  const size_t nimg = (size_t)B_ * CNN_IMAGE_FLOATS, ibytes = nimg * sizeof(float);
  size_t params = 0;
  for (int i = 0; i < CNN_NUM_PARAMS; i++) params += 2 * arena_bytes(i);
  /* the parameters end inside a page, which their locked range takes in */
  size_t off = params % PAGE ? 0 : ARENA_STEP;
  size_t total = (off + params + ibytes + PAGE - 1) / PAGE * PAGE;
  char *arena = aligned_alloc(PAGE, total);
  ck_assert_ptr_nonnull(arena);
  memset(arena, 0, total);
  float *av[CNN_NUM_PARAMS], *ag[CNN_NUM_PARAMS], *cv[CNN_NUM_PARAMS], *cg[CNN_NUM_PARAMS];
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    av[i] = (float *)(arena + off);
    ag[i] = (float *)(arena + off + arena_bytes(i));
    off += 2 * arena_bytes(i);
  }
  float *img = (float *)(arena + off), *r = randn(nimg, 1.0f);
  memcpy(img, r, ibytes);
  free(r);
  uint8_t lab[B_];
  for (int b = 0; b < B_; b++) lab[b] = (uint8_t)(ur() * 10);
  bufs_new(cv, cg);
  cnn *c = model_on(cpu, 1, cv, cg), *a = model_on(&s->be, 1, av, ag);
  float *imgs[2] = {img, img};
  uint8_t *labs[2] = {lab, lab};
  run_both(c, a, imgs, labs, 3); /* the warm-up, a recording, a replay */
  /* what this test is about: the batch starts locked, but is not in one range */
  ck_assert(s_host_pinned(&s->be, img) && !locked(s, img, ibytes));
  same_params(cv, av);
  int pc[B_], pa[B_];
  float ec = cnn_eval(c, img, lab, B_, pc), ea = cnn_eval(a, img, lab, B_, pa);
  ck_assert_msg(ea == ec, "evaluation: cpu %.9g, sim %.9g (%s)", (double)ec, (double)ea,
                cnn_error(a) ? cnn_error(a) : "no error");
  ck_assert(!memcmp(pc, pa, sizeof pc));
  cnn_run_info ri;
  cnn_get_run_info(a, &ri);
  ck_assert_int_eq(ri.pinned, 1);
  ck_assert_int_eq(ri.graph_replays, 2);
  ck_assert_ptr_null(cnn_error(a));
  cnn_destroy(a);
  cnn_destroy(c);
  bufs_free(cv, cg);
  free(arena);
  free(s);
}
END_TEST

Suite *suite_cnn_dev(void) {
  Suite *s = suite_create("cnn_dev");
  TCase *tc = tcase_create("cnn_dev");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_graphs_replay_as_cpu);
  tcase_add_test(tc, test_graph_failures_fall_back);
  tcase_add_test(tc, test_eager_reasons);
  tcase_add_test(tc, test_two_models_share_pages);
  tcase_add_test(tc, test_inputs_straddling_locked_pages_are_staged);
  suite_add_tcase(s, tc);
  return s;
}
