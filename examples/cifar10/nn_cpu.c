/*
 * nn_cpu.c - the CPU backend of the CNN (nn_backend.h).
 *
 * Convolutions: NHWC im2col into a per-thread buffer of a few images (the
 * chunk size measured best: 288 pixels), then one SGEMM per chunk:
 * y[pix][K] = col[pix][R*R*C] *
 * w[R*R*C][K] with TF's HWIO weights used as they are; bias and ReLU are
 * applied to the chunk while it is in cache. The filter gradient is
 * col^T * dy accumulated over chunks (per-thread accumulators, summed at
 * the end); the data gradient is the forward convolution of dy with the
 * spatially flipped, C/K-transposed weights (im2col of dy, then an SGEMM
 * with a deep R*R*K inner dimension, like the forward; no scatter-add
 * col2im).
 * FC layers: SGEMM, rows (or rows of dw) split across threads.
 * Element-wise ops: single passes with the nn_ops.h bodies; LRN sums its
 * window over a zero-padded row of squares (vectorizes over channels).
 *
 * Threads: each op is cut into chunks that the caller and threads-1
 * workers of an nn_pool take one at a time (nn_pool.h: a worker without
 * a CPU does not hold up an op); every chunk runs OpenBLAS single-threaded
 * (openblas_set_num_threads(1)).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "nn_backend.h"
#include "nn_ops.h"
#include "nn_pool.h"

/* Hot loops are compiled three times (AVX-512, AVX2+FMA, baseline x86-64)
 * and picked at load time (GCC ifunc), so the library needs no -march. They
 * are noinline functions called from the chunk callbacks. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(CNN_NO_CLONES)
#define CNN_KERNEL                                                         \
  __attribute__((noinline, target_clones("arch=x86-64-v4", "arch=x86-64-v3", \
                                         "default"))) static
#else
#define CNN_KERNEL __attribute__((noinline)) static
#endif

#define ALIGN 64
#ifndef CONV_CHUNK_PIX
#define CONV_CHUNK_PIX 288  /* output pixels per im2col chunk: 2 images of
                               12x12 (col 1.8 MB), 1 of 24x24 */
#endif
#ifndef CONV_BWDF_PIX
#define CONV_BWDF_PIX 288   /* pixels per chunk of the filter gradient */
#endif
#define LRN_MAX_C 4096      /* channels the LRN row buffers hold */
#define PAR_MIN 32768       /* elements per chunk of element-wise ops, at least */
#define CNN_CPU_MAX_THREADS 64 /* threads beyond this are clamped */

static size_t round_up(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

/* Splits n items into T nearly equal ranges: range t is [*lo, *hi). */
static void split(size_t n, int T, int t, size_t *lo, size_t *hi) {
  *lo = n * (size_t)t / (size_t)T;
  *hi = n * (size_t)(t + 1) / (size_t)T;
}

/* ---------------------------------------------------------------- threads */

static nn_pool *_Atomic pools[CNN_CPU_MAX_THREADS + 1];
static pthread_mutex_t pools_mu = PTHREAD_MUTEX_INITIALIZER;

/* The backend's pool, started on first use (NULL for one thread or if it
 * cannot start: then everything runs in the caller). */
static nn_pool *pool_of(const cnn_backend *be) {
  int t = be->threads;
  if (t <= 1) return NULL;
  nn_pool *p = atomic_load_explicit(&pools[t], memory_order_acquire);
  if (p) return p;
  pthread_mutex_lock(&pools_mu);
  p = atomic_load_explicit(&pools[t], memory_order_relaxed);
  if (!p) {
    p = nn_pool_create(t);
    atomic_store_explicit(&pools[t], p, memory_order_release);
  }
  pthread_mutex_unlock(&pools_mu);
  return p;
}

/* Runs fn(arg, chunk, tid) for chunk in [0, nchunks) on the backend's
 * threads. */
static void par_chunks(const cnn_backend *be, int nchunks, nn_pool_fn fn,
                       void *arg) {
  nn_pool_run(pool_of(be), nchunks, fn, arg);
}

/* Element-wise ops: n items in chunks of >= PAR_MIN work units (work = items
 * * per_item), at most 4 per thread; fn(ctx, lo, hi). */
typedef void (*range_fn)(void *ctx, size_t lo, size_t hi);
typedef struct {
  range_fn fn;
  void *ctx;
  size_t n;
  int nchunks;
} range_job;

static void range_chunk(void *arg, int c, int tid) {
  (void)tid;
  range_job *j = arg;
  size_t lo, hi;
  split(j->n, j->nchunks, c, &lo, &hi);
  if (hi > lo) j->fn(j->ctx, lo, hi);
}

static void par_range(const cnn_backend *be, size_t n, size_t per_item,
                      range_fn fn, void *ctx) {
  size_t work = n * per_item, want = work / PAR_MIN;
  int nchunks = be->threads > 1 ? 4 * be->threads : 1;
  if ((size_t)nchunks > want) nchunks = want ? (int)want : 1;
  if ((size_t)nchunks > n) nchunks = n ? (int)n : 1;
  if (nchunks == 1) {
    if (n) fn(ctx, 0, n);
    return;
  }
  range_job j = {fn, ctx, n, nchunks};
  par_chunks(be, nchunks, range_chunk, &j);
}

/* ---------------------------------------------------------------- memory */

static void *cpu_alloc(const cnn_backend *be, size_t bytes) {
  (void)be;
  size_t n = round_up(bytes ? bytes : 1);
  void *p = aligned_alloc(ALIGN, n);
  if (p) memset(p, 0, n);
  return p;
}

static void cpu_free(const cnn_backend *be, void *p) {
  (void)be;
  free(p);
}

static void cpu_copy(const cnn_backend *be, void *dst, const void *src,
                     size_t bytes) {
  (void)be;
  if (dst != src && bytes) memcpy(dst, src, bytes);
}

/* --------------------------------------------------------------- kernels */

CNN_KERNEL void k_nchw_to_nhwc(size_t b0, size_t b1, int C, int HW,
                               const float *restrict src,
                               float *restrict dst) {
  for (size_t b = b0; b < b1; b++) {
    const float *s = src + b * C * HW;
    float *d = dst + b * C * HW;
    for (int c = 0; c < C; c++)
      for (int p = 0; p < HW; p++) d[(size_t)p * C + c] = s[(size_t)c * HW + p];
  }
}

/* rows of K: row = act(row + bias) (bias may be NULL) */
CNN_KERNEL void k_bias_act(size_t rows, int K, float *restrict y,
                           const float *restrict bias, int relu) {
  if (bias && relu) {
    for (size_t r = 0; r < rows; r++)
      for (int k = 0; k < K; k++)
        y[r * K + k] = cnn_bias_act(y[r * K + k], bias[k], 1);
  } else if (bias) {
    for (size_t r = 0; r < rows; r++)
      for (int k = 0; k < K; k++)
        y[r * K + k] = cnn_bias_act(y[r * K + k], bias[k], 0);
  } else if (relu) {
    for (size_t r = 0; r < rows * K; r++) y[r] = cnn_relu(y[r]);
  }
}

/* acc[k] (+)= sum over rows of dy[r][k] */
CNN_KERNEL void k_colsum(size_t rows, int K, const float *restrict dy,
                         float *restrict acc, int accumulate) {
  if (!accumulate)
    for (int k = 0; k < K; k++) acc[k] = 0.0f;
  for (size_t r = 0; r < rows; r++)
    for (int k = 0; k < K; k++) acc[k] += dy[r * K + k];
}

CNN_KERNEL void k_relu_bwd(size_t lo, size_t hi, const float *restrict y,
                           float *restrict dy) {
  for (size_t i = lo; i < hi; i++) dy[i] = cnn_relu_bwd(y[i], dy[i]);
}

CNN_KERNEL void k_sgd(size_t lo, size_t hi, float lr, const float *restrict g,
                      float *restrict w) {
  for (size_t i = lo; i < hi; i++) w[i] = cnn_sgd_elem(w[i], g[i], lr);
}

CNN_KERNEL double k_l2(size_t lo, size_t hi, float wd, const float *restrict w,
                       float *restrict dw) {
  float part[16] = {0};
  size_t i = lo;
  for (; i + 16 <= hi; i += 16)
    for (int j = 0; j < 16; j++) {
      part[j] += w[i + j] * w[i + j];
      dw[i + j] = cnn_l2_grad(dw[i + j], w[i + j], wd);
    }
  double ss = 0.0;
  for (; i < hi; i++) {
    ss += (double)w[i] * w[i];
    dw[i] = cnn_l2_grad(dw[i], w[i], wd);
  }
  for (int j = 0; j < 16; j++) ss += part[j];
  return ss;
}

/* out[i] = sum over the used accumulators */
CNN_KERNEL void k_sum_acc(size_t lo, size_t hi, int n, const float *const *acc,
                          float *restrict out) {
  for (size_t i = lo; i < hi; i++) out[i] = 0.0f;
  for (int t = 0; t < n; t++) {
    const float *restrict a = acc[t];
    for (size_t i = lo; i < hi; i++) out[i] += a[i];
  }
}

/* max-pool forward of output rows [r0, r1) (row = one (b, oh)) */
CNN_KERNEL void k_maxpool_fwd(const cnn_pool_geom *g, size_t r0, size_t r1,
                              const float *restrict x, float *restrict y,
                              int32_t *restrict arg) {
  int C = g->C, H = g->H, W = g->W;
  for (size_t r = r0; r < r1; r++) {
    int b = (int)(r / g->OH), oh = (int)(r % g->OH);
    int h0 = oh * g->s - g->pad_top;
    int hl = h0 < 0 ? 0 : h0, hh = h0 + g->k < H ? h0 + g->k : H;
    for (int ow = 0; ow < g->OW; ow++) {
      int w0 = ow * g->s - g->pad_left;
      int wl = w0 < 0 ? 0 : w0, wh = w0 + g->k < W ? w0 + g->k : W;
      size_t o = (((size_t)b * g->OH + oh) * g->OW + ow) * C;
      float *restrict m = y + o;
      int32_t *restrict a = arg + o;
      int32_t base0 = (int32_t)((((size_t)b * H + hl) * W + wl) * C);
      for (int c = 0; c < C; c++) {
        m[c] = x[base0 + c];
        a[c] = base0 + c;
      }
      for (int ih = hl; ih < hh; ih++)
        for (int iw = ih == hl ? wl + 1 : wl; iw < wh; iw++) {
          int32_t base = (int32_t)((((size_t)b * H + ih) * W + iw) * C);
          const float *restrict xp = x + base;
          for (int c = 0; c < C; c++) {
            float v = xp[c], mv = m[c];
            int32_t sel = -(int32_t)(v > mv); /* all ones where v wins */
            m[c] = v > mv ? v : mv;
            a[c] = (a[c] & ~sel) | ((base + c) & sel);
          }
        }
    }
  }
}

/* max-pool backward (gather form) of input rows [r0, r1) (row = (b, ih)) */
CNN_KERNEL void k_maxpool_bwd(const cnn_pool_geom *g, size_t r0, size_t r1,
                              const float *restrict dy,
                              const int32_t *restrict arg,
                              const float *restrict relu_x,
                              float *restrict dx) {
  int C = g->C, H = g->H, W = g->W;
  for (size_t r = r0; r < r1; r++) {
    int b = (int)(r / H), ih = (int)(r % H);
    int ohl, ohh;
    cnn_pool_windows(ih, g->k, g->s, g->pad_top, g->OH, &ohl, &ohh);
    for (int iw = 0; iw < W; iw++) {
      int owl, owh;
      cnn_pool_windows(iw, g->k, g->s, g->pad_left, g->OW, &owl, &owh);
      int32_t base = (int32_t)((((size_t)b * H + ih) * W + iw) * C);
      float *restrict d = dx + base;
      for (int c = 0; c < C; c++) d[c] = 0.0f;
      for (int oh = ohl; oh < ohh; oh++)
        for (int ow = owl; ow < owh; ow++) {
          size_t o = (((size_t)b * g->OH + oh) * g->OW + ow) * C;
          const int32_t *restrict a = arg + o;
          const float *restrict dyo = dy + o;
          for (int c = 0; c < C; c++)
            d[c] += cnn_maxpool_bwd_term(a[c], base + c, dyo[c]);
        }
      if (relu_x) {
        const float *restrict xr = relu_x + base;
        for (int c = 0; c < C; c++) d[c] = cnn_relu_bwd(xr[c], d[c]);
      }
    }
  }
}

/* LRN forward of rows [r0, r1): the window sum runs over a zero-padded row
 * of squares, so it vectorizes over channels. */
CNN_KERNEL void k_lrn_fwd(size_t r0, size_t r1, int C,
                          const cnn_lrn_param *p, const float *restrict x,
                          float *restrict y, float *restrict scale) {
  float sq[LRN_MAX_C + 64] __attribute__((aligned(64)));
  float acc[LRN_MAX_C] __attribute__((aligned(64)));
  int r = p->radius;
  float bias = p->bias, alpha = p->alpha, beta = p->beta;
  for (int i = 0; i < r; i++) sq[i] = sq[r + C + i] = 0.0f;
  for (size_t row = r0; row < r1; row++) {
    const float *restrict xr = x + row * C;
    float *restrict yr = y + row * C;
    float *restrict sr = scale + row * C;
    for (int c = 0; c < C; c++) sq[r + c] = xr[c] * xr[c];
    for (int c = 0; c < C; c++) acc[c] = sq[c];
    for (int d = 1; d <= 2 * r; d++)
      for (int c = 0; c < C; c++) acc[c] += sq[c + d];
    if (beta == 0.75f) {
      for (int c = 0; c < C; c++) {
        float s = cnn_lrn_scale(acc[c], bias, alpha);
        sr[c] = s;
        yr[c] = xr[c] * cnn_pow_m075(s);
      }
    } else {
      for (int c = 0; c < C; c++) {
        float s = cnn_lrn_scale(acc[c], bias, alpha);
        sr[c] = s;
        yr[c] = xr[c] * powf(s, -beta);
      }
    }
  }
}

CNN_KERNEL void k_lrn_bwd(size_t r0, size_t r1, int C,
                          const cnn_lrn_param *p, const float *restrict x,
                          const float *restrict scale,
                          const float *restrict dy, int relu_mask,
                          float *restrict dx) {
  float t[LRN_MAX_C + 64] __attribute__((aligned(64)));
  float pw[LRN_MAX_C] __attribute__((aligned(64)));
  float acc[LRN_MAX_C] __attribute__((aligned(64)));
  int r = p->radius;
  float beta = p->beta, tab = 2.0f * p->alpha * p->beta;
  for (int i = 0; i < r; i++) t[i] = t[r + C + i] = 0.0f;
  for (size_t row = r0; row < r1; row++) {
    const float *restrict xr = x + row * C;
    const float *restrict sr = scale + row * C;
    const float *restrict dr = dy + row * C;
    float *restrict o = dx + row * C;
    if (beta == 0.75f)
      for (int c = 0; c < C; c++) pw[c] = cnn_pow_m075(sr[c]);
    else
      for (int c = 0; c < C; c++) pw[c] = powf(sr[c], -beta);
    for (int c = 0; c < C; c++)
      t[r + c] = cnn_lrn_bwd_t(dr[c], xr[c], pw[c], sr[c]);
    for (int c = 0; c < C; c++) acc[c] = t[c];
    for (int d = 1; d <= 2 * r; d++)
      for (int c = 0; c < C; c++) acc[c] += t[c + d];
    if (relu_mask)
      for (int c = 0; c < C; c++)
        o[c] = cnn_relu_bwd(xr[c], cnn_lrn_bwd_dx(dr[c], xr[c], pw[c], acc[c], tab));
    else
      for (int c = 0; c < C; c++)
        o[c] = cnn_lrn_bwd_dx(dr[c], xr[c], pw[c], acc[c], tab);
  }
}

/* ---------------------------------------------------------------- layout */

typedef struct {
  int C, HW;
  const float *src;
  float *dst;
} nhwc_ctx;

static void nhwc_range(void *vc, size_t lo, size_t hi) {
  nhwc_ctx *c = vc;
  k_nchw_to_nhwc(lo, hi, c->C, c->HW, c->src, c->dst);
}

static void cpu_nchw_to_nhwc(const cnn_backend *be, int B, int C, int H,
                             int W, const float *src, float *dst) {
  nhwc_ctx c = {C, H * W, src, dst};
  par_range(be, (size_t)B, (size_t)C * H * W, nhwc_range, &c);
}

/* ----------------------------------------------------------- convolution */

/* Small copies and fills (conv1's segments are 15 floats, too short for a
 * libc call each): 8-float blocks of fixed size, which compile to vector
 * moves, then single floats. */
static inline void copy_f(float *restrict d, const float *restrict s,
                          size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) memcpy(d + i, s + i, 8 * sizeof(float));
  for (; i < n; i++) d[i] = s[i];
}
static inline void zero_f(float *restrict d, size_t n) {
  static const float z[8];
  size_t i = 0;
  for (; i + 8 <= n; i += 8) memcpy(d + i, z, 8 * sizeof(float));
  for (; i < n; i++) d[i] = 0.0f;
}

/* im2col of n NHWC images (H x W x C) for an R x R SAME kernel: one row of
 * R*R*C floats per output pixel, in (kh, kw, c) order, zeros for padding. */
CNN_KERNEL void im2col(const float *x, int n, int H, int W, int C, int R,
                       float *col) {
  int p = (R - 1) / 2;
  size_t rowlen = (size_t)R * R * C, seg = (size_t)R * C;
  for (int i = 0; i < n; i++)
    for (int h = 0; h < H; h++)
      for (int w = 0; w < W; w++) {
        float *dst = col + (((size_t)i * H + h) * W + w) * rowlen;
        int kw0 = p - w > 0 ? p - w : 0;
        int kw1 = W + p - w < R ? W + p - w : R;
        for (int kh = 0; kh < R; kh++, dst += seg) {
          int ih = h + kh - p;
          if (ih < 0 || ih >= H) {
            zero_f(dst, seg);
            continue;
          }
          const float *src =
              x + (((size_t)i * H + ih) * W + (w + kw0 - p)) * C;
          zero_f(dst, (size_t)kw0 * C);
          copy_f(dst + (size_t)kw0 * C, src, (size_t)(kw1 - kw0) * C);
          zero_f(dst + (size_t)kw1 * C, (size_t)(R - kw1) * C);
        }
      }
}

static int chunk_images(const cnn_conv_geom *g, int pix) {
  int n = pix / (g->H * g->W);
  return n < 1 ? 1 : n;
}

/* Workspace: per thread a col buffer (large enough for the forward, the
 * data gradient and the filter gradient chunks) and a filter + bias
 * accumulator; then the flipped weights. Everything is symmetric in C and
 * K: the data gradient reuses it with C and K swapped. */
static size_t col_floats(const cnn_conv_geom *g) {
  int cmax = g->C > g->K ? g->C : g->K;
  int nf = chunk_images(g, CONV_CHUNK_PIX), nb = chunk_images(g, CONV_BWDF_PIX);
  int n = nf > nb ? nf : nb;
  return (size_t)n * g->H * g->W * g->R * g->R * cmax;
}
static size_t acc_floats(const cnn_conv_geom *g) {
  return (size_t)g->R * g->R * g->C * g->K + (g->C > g->K ? g->C : g->K);
}
static size_t ws_per_thread(const cnn_conv_geom *g) {
  return round_up(col_floats(g) * sizeof(float)) +
         round_up(acc_floats(g) * sizeof(float));
}

static size_t cpu_conv_ws_bytes(const cnn_backend *be,
                                const cnn_conv_geom *g) {
  return ws_per_thread(g) * be->threads +
         round_up((size_t)g->R * g->R * g->C * g->K * sizeof(float));
}

static float *ws_col(const cnn_conv_geom *g, void *ws, int t) {
  return (float *)((char *)ws + ws_per_thread(g) * t);
}
static float *ws_acc(const cnn_conv_geom *g, void *ws, int t) {
  return (float *)((char *)ws_col(g, ws, t) +
                   round_up(col_floats(g) * sizeof(float)));
}

typedef struct {
  const cnn_conv_geom *g;
  const float *x, *w, *bias, *dy;
  float *y, *dw, *db;
  void *ws;
  int relu, n, T;
  int used[CNN_CPU_MAX_THREADS];
} conv_job;

/* chunk c: images [c*n, c*n + n) of the forward */
static void conv_fwd_chunk(void *arg, int ch, int tid) {
  conv_job *j = arg;
  const cnn_conv_geom *g = j->g;
  int b0 = ch * j->n, nb = g->B - b0 < j->n ? g->B - b0 : j->n;
  int RRC = g->R * g->R * g->C, K = g->K, M = nb * g->H * g->W;
  float *col = ws_col(g, j->ws, tid);
  float *yc = j->y + (size_t)b0 * g->H * g->W * K;
  im2col(j->x + (size_t)b0 * g->H * g->W * g->C, nb, g->H, g->W, g->C, g->R,
         col);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, RRC, 1.0f,
              col, RRC, j->w, K, 0.0f, yc, K);
  k_bias_act((size_t)M, K, yc, j->bias, j->relu);
}

/* y = conv(x, w) [+ bias, ReLU] for geometry g (x has g->C channels, y
 * g->K). */
static void conv_fwd_impl(const cnn_backend *be, const cnn_conv_geom *g,
                          const float *x, const float *w, const float *bias,
                          int relu, float *y, void *ws) {
  conv_job j = {g, x, w, bias, NULL, y, NULL, NULL, ws, relu,
                chunk_images(g, CONV_CHUNK_PIX), be->threads, {0}};
  par_chunks(be, (g->B + j.n - 1) / j.n, conv_fwd_chunk, &j);
}

static void cpu_conv_fwd(const cnn_backend *be, const cnn_conv_geom *g,
                         const float *x, const float *w, const float *bias,
                         int relu, float *y, void *ws) {
  conv_fwd_impl(be, g, x, w, bias, relu, y, ws);
}

/* chunk c: accumulates col^T dy (and the dy column sums) of its images
 * into dw/db (one thread) or into the thread's accumulator */
static void conv_bwdf_chunk(void *arg, int ch, int tid) {
  conv_job *j = arg;
  const cnn_conv_geom *g = j->g;
  int b0 = ch * j->n, nb = g->B - b0 < j->n ? g->B - b0 : j->n;
  int RRC = g->R * g->R * g->C, K = g->K, M = nb * g->H * g->W;
  size_t nw = (size_t)RRC * K;
  float *col = ws_col(g, j->ws, tid);
  float *accw = j->T == 1 ? j->dw : ws_acc(g, j->ws, tid);
  float *accb = j->T == 1 ? j->db : ws_acc(g, j->ws, tid) + nw;
  const float *dyc = j->dy + (size_t)b0 * g->H * g->W * K;
  im2col(j->x + (size_t)b0 * g->H * g->W * g->C, nb, g->H, g->W, g->C, g->R,
         col);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, RRC, K, M, 1.0f, col,
              RRC, dyc, K, j->used[tid] ? 1.0f : 0.0f, accw, K);
  if (accb) k_colsum((size_t)M, K, dyc, accb, j->used[tid]);
  j->used[tid] = 1;
}

typedef struct {
  const float *acc[CNN_CPU_MAX_THREADS];
  int na;
  float *out;
} sum_ctx;

static void sum_range(void *vc, size_t lo, size_t hi) {
  sum_ctx *c = vc;
  k_sum_acc(lo, hi, c->na, c->acc, c->out);
}

static void cpu_conv_bwd_filter(const cnn_backend *be, const cnn_conv_geom *g,
                                const float *x, const float *dy, float *dw,
                                float *db, void *ws) {
  conv_job j = {g, x, NULL, NULL, dy, NULL, dw, db, ws, 0,
                chunk_images(g, CONV_BWDF_PIX), be->threads, {0}};
  int K = g->K;
  size_t nw = (size_t)g->R * g->R * g->C * K;
  par_chunks(be, (g->B + j.n - 1) / j.n, conv_bwdf_chunk, &j);
  if (j.T == 1) {
    if (!j.used[0]) { /* B == 0 */
      memset(dw, 0, nw * sizeof(float));
      if (db) memset(db, 0, K * sizeof(float));
    }
    return;
  }
  sum_ctx c = {{0}, 0, dw};
  for (int t = 0; t < j.T; t++)
    if (j.used[t]) c.acc[c.na++] = ws_acc(g, ws, t);
  par_range(be, nw, (size_t)(c.na ? c.na : 1), sum_range, &c);
  if (db) {
    for (int i = 0; i < c.na; i++) c.acc[i] += nw;
    c.out = db;
    sum_range(&c, 0, (size_t)K);
  }
}

/* dx = conv(dy, wf) with wf[kh][kw][k][c] = w[R-1-kh][R-1-kw][c][k]. */
static void cpu_conv_bwd_data(const cnn_backend *be, const cnn_conv_geom *g,
                              const float *dy, const float *w, float *dx,
                              void *ws) {
  int R = g->R, C = g->C, K = g->K;
  float *wf = ws_col(g, ws, be->threads); /* after the per-thread parts */
  for (int kh = 0; kh < R; kh++)
    for (int kw = 0; kw < R; kw++) {
      const float *src = w + ((size_t)(R - 1 - kh) * R + (R - 1 - kw)) * C * K;
      float *dst = wf + ((size_t)kh * R + kw) * K * C;
      for (int c = 0; c < C; c++)
        for (int k = 0; k < K; k++) dst[(size_t)k * C + c] = src[(size_t)c * K + k];
    }
  cnn_conv_geom gt = *g;
  gt.C = K;
  gt.K = C;
  /* ws_per_thread(&gt) == ws_per_thread(g): the per-thread parts line up */
  conv_fwd_impl(be, &gt, dy, wf, NULL, 0, dx, ws);
}

/* --------------------------------------------------------------- dense */

typedef struct {
  int M, K, N, relu, T;
  const float *x, *w, *bias, *dy;
  float *y, *dx, *dw;
} dense_job;

/* chunk c: rows part c of y */
static void dense_fwd_chunk(void *arg, int c, int tid) {
  (void)tid;
  dense_job *j = arg;
  size_t lo, hi;
  split((size_t)j->M, j->T, c, &lo, &hi);
  if (hi <= lo) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)(hi - lo), j->N,
              j->K, 1.0f, j->x + lo * j->K, j->K, j->w, j->N, 0.0f,
              j->y + lo * j->N, j->N);
  k_bias_act(hi - lo, j->N, j->y + lo * j->N, j->bias, j->relu);
}

/* chunk c < T: rows part c of dw = x^T dy; c >= T: rows part c - T of
 * dx = dy w^T */
static void dense_bwd_chunk(void *arg, int c, int tid) {
  (void)tid;
  dense_job *j = arg;
  size_t lo, hi;
  if (c < j->T) {
    split((size_t)j->K, j->T, c, &lo, &hi);
    if (hi > lo)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)(hi - lo),
                  j->N, j->M, 1.0f, j->x + lo, j->K, j->dy, j->N, 0.0f,
                  j->dw + lo * j->N, j->N);
  } else {
    split((size_t)j->M, j->T, c - j->T, &lo, &hi);
    if (hi > lo)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)(hi - lo),
                  j->K, j->N, 1.0f, j->dy + lo * j->N, j->N, j->w, j->N, 0.0f,
                  j->dx + lo * j->K, j->K);
  }
}

static int dense_threads(const cnn_backend *be, long work) {
  return work < 200000 ? 1 : be->threads;
}

static void cpu_dense_fwd(const cnn_backend *be, int M, int K, int N,
                          const float *x, const float *w, const float *bias,
                          int relu, float *y) {
  dense_job j = {M, K, N, relu, dense_threads(be, (long)M * K * N),
                 x, w, bias, NULL, y, NULL, NULL};
  par_chunks(be, j.T, dense_fwd_chunk, &j);
}

static void cpu_dense_bwd(const cnn_backend *be, int M, int K, int N,
                          const float *x, const float *w, const float *dy,
                          float *dx, float *dw, float *db) {
  dense_job j = {M, K, N, 0, dense_threads(be, (long)M * K * N),
                 x, w, NULL, dy, NULL, dx, dw};
  par_chunks(be, dx ? 2 * j.T : j.T, dense_bwd_chunk, &j);
  if (db) k_colsum((size_t)M, N, dy, db, 0);
}

/* ---------------------------------------------------------- element-wise */

typedef struct {
  const cnn_pool_geom *g;
  const cnn_lrn_param *p;
  int C, relu;
  float f;
  const float *a, *b, *c;
  const int32_t *ai;
  float *o, *o2;
  int32_t *oi;
  double part[4 * CNN_CPU_MAX_THREADS];
  int nchunks;
} ew_ctx;

static void relu_bwd_range(void *vc, size_t lo, size_t hi) {
  ew_ctx *c = vc;
  k_relu_bwd(lo, hi, c->a, c->o);
}

static void cpu_relu_bwd(const cnn_backend *be, size_t n, const float *y,
                         float *dy) {
  ew_ctx c = {.a = y, .o = dy};
  par_range(be, n, 1, relu_bwd_range, &c);
}

static void pool_fwd_range(void *vc, size_t lo, size_t hi) {
  ew_ctx *c = vc;
  k_maxpool_fwd(c->g, lo, hi, c->a, c->o, c->oi);
}

static void cpu_maxpool_fwd(const cnn_backend *be, const cnn_pool_geom *g,
                            const float *x, float *y, int32_t *arg) {
  ew_ctx c = {.g = g, .a = x, .o = y, .oi = arg};
  par_range(be, (size_t)g->B * g->OH, (size_t)g->OW * g->C * g->k * g->k,
            pool_fwd_range, &c);
}

static void pool_bwd_range(void *vc, size_t lo, size_t hi) {
  ew_ctx *c = vc;
  k_maxpool_bwd(c->g, lo, hi, c->a, c->ai, c->b, c->o);
}

static void cpu_maxpool_bwd(const cnn_backend *be, const cnn_pool_geom *g,
                            const float *dy, const int32_t *arg,
                            const float *relu_x, float *dx) {
  ew_ctx c = {.g = g, .a = dy, .ai = arg, .b = relu_x, .o = dx};
  par_range(be, (size_t)g->B * g->H, (size_t)g->W * g->C * 4, pool_bwd_range,
            &c);
}

static void lrn_check(int C, const cnn_lrn_param *p) {
  if (C < 1 || C > LRN_MAX_C || p->radius < 0 || 2 * p->radius > 64)
    abort(); /* beyond the row buffers: a programming error */
}

static void lrn_fwd_range(void *vc, size_t lo, size_t hi) {
  ew_ctx *c = vc;
  k_lrn_fwd(lo, hi, c->C, c->p, c->a, c->o, c->o2);
}

static void cpu_lrn_fwd(const cnn_backend *be, size_t rows, int C,
                        const cnn_lrn_param *p, const float *x, float *y,
                        float *scale) {
  lrn_check(C, p);
  ew_ctx c = {.p = p, .C = C, .a = x, .o = y, .o2 = scale};
  par_range(be, rows, (size_t)C * 4, lrn_fwd_range, &c);
}

static void lrn_bwd_range(void *vc, size_t lo, size_t hi) {
  ew_ctx *c = vc;
  k_lrn_bwd(lo, hi, c->C, c->p, c->a, c->b, c->c, c->relu, c->o);
}

static void cpu_lrn_bwd(const cnn_backend *be, size_t rows, int C,
                        const cnn_lrn_param *p, const float *x,
                        const float *scale, const float *dy, int relu_mask,
                        float *dx) {
  lrn_check(C, p);
  ew_ctx c = {.p = p, .C = C, .relu = relu_mask, .a = x, .b = scale, .c = dy,
              .o = dx};
  par_range(be, rows, (size_t)C * 4, lrn_bwd_range, &c);
}

static void cpu_softmax_xent(const cnn_backend *be, int B, int N,
                             const float *logits, const uint8_t *labels,
                             float smooth, float grad_scale, float *dlogits,
                             int32_t *pred, float *loss) {
  (void)be;
  double sum = 0.0;
  for (int b = 0; b < B; b++)
    sum += cnn_softmax_xent_row(logits + (size_t)b * N, N,
                                labels ? (int)labels[b] : -1, smooth, grad_scale,
                                dlogits ? dlogits + (size_t)b * N : NULL,
                                pred ? pred + b : NULL);
  if (loss) *loss = (float)sum;
}

/* l2: n items cut into nchunks fixed pieces, a partial sum each */
static void l2_chunk(void *arg, int ch, int tid) {
  (void)tid;
  ew_ctx *c = arg;
  size_t lo, hi;
  split((size_t)c->C, c->nchunks, ch, &lo, &hi);
  c->part[ch] = k_l2(lo, hi, c->f, c->a, c->o);
}

static void cpu_l2_decay(const cnn_backend *be, size_t n, float wd,
                         const float *w, float *dw, float *loss) {
  ew_ctx c = {.f = wd, .a = w, .o = dw};
  if (n > (size_t)1 << 30) abort(); /* C holds n */
  c.C = (int)n;
  c.nchunks = be->threads > 1 && n >= 2 * PAR_MIN ? 2 * be->threads : 1;
  par_chunks(be, c.nchunks, l2_chunk, &c);
  double ss = 0.0;
  for (int i = 0; i < c.nchunks; i++) ss += c.part[i];
  if (loss) *loss = (float)(0.5 * wd * ss);
}

static void sgd_range(void *vc, size_t lo, size_t hi) {
  ew_ctx *c = vc;
  k_sgd(lo, hi, c->f, c->a, c->o);
}

static void cpu_sgd(const cnn_backend *be, size_t n, float lr, const float *g,
                    float *w) {
  ew_ctx c = {.f = lr, .a = g, .o = w};
  par_range(be, n, 1, sgd_range, &c);
}

/* --------------------------------------------------------------- table */

static cnn_backend cpu_backends[CNN_CPU_MAX_THREADS + 1];
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

static void cpu_init(void) {
  for (int t = 1; t <= CNN_CPU_MAX_THREADS; t++) {
    cnn_backend *be = &cpu_backends[t];
    be->name = "cpu";
    be->threads = t;
    be->host_mapped = 1;
    be->alloc = cpu_alloc;
    be->free = cpu_free;
    be->to_device = cpu_copy;
    be->to_host = cpu_copy;
    be->sync = NULL;
    be->nchw_to_nhwc = cpu_nchw_to_nhwc;
    be->conv_ws_bytes = cpu_conv_ws_bytes;
    be->conv_fwd = cpu_conv_fwd;
    be->conv_bwd_filter = cpu_conv_bwd_filter;
    be->conv_bwd_data = cpu_conv_bwd_data;
    be->dense_fwd = cpu_dense_fwd;
    be->dense_bwd = cpu_dense_bwd;
    be->relu_bwd = cpu_relu_bwd;
    be->maxpool_fwd = cpu_maxpool_fwd;
    be->maxpool_bwd = cpu_maxpool_bwd;
    be->lrn_fwd = cpu_lrn_fwd;
    be->lrn_bwd = cpu_lrn_bwd;
    be->softmax_xent = cpu_softmax_xent;
    be->l2_decay = cpu_l2_decay;
    be->sgd = cpu_sgd;
  }
  openblas_set_num_threads(1);
}

const cnn_backend *cnn_backend_cpu(int threads) {
  if (threads < 1) return NULL;
  if (threads > CNN_CPU_MAX_THREADS) threads = CNN_CPU_MAX_THREADS;
  pthread_once(&cpu_once, cpu_init);
  return &cpu_backends[threads];
}
