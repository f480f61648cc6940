/* Tests of the CUDA backend's arithmetic without a GPU: the per-element
 * bodies of examples/cifar10/nn_cuda_ops.h, run here on the CPU over the
 * index spaces nn_cuda.cu's kernels give them (every index of the output,
 * reductions in the same levels of slices), against the CPU backend's
 * forward and backward ops on the same inputs. The GEMMs (cuBLAS on the
 * GPU) are plain loops here: what is checked is everything around them.
 * Also: the model's device path (host_mapped 0: staging, tagged uploads,
 * gradient downloads, loss slots, page-locking of the bound buffers) on a
 * backend whose "device" is separate host memory.
 *
 * Tolerances: bodies whose arithmetic is the CPU backend's in the same
 * order are compared exactly (max-pool, ReLU, SGD, softmax gradient); the
 * rest within a relative 1e-5 (LRN: a compiler may fuse a multiply-add
 * where the other does not), 1e-4 of the output scale (convolution and
 * dense: float SGEMM against loops in double) or 1e-5 of the summed
 * magnitude (reductions, whose order differs). */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn.h"
#include "nn_backend.h"
#include "testrand.h"
#include "nn_cuda_ops.h"

Suite *suite_cuda_ops(void);

/* Only calls Check on failure (element loops). */
#define CHECK(cond, ...)                    \
  do {                                      \
    if (!(cond)) ck_abort_msg(__VA_ARGS__); \
  } while (0)

static float *copy(const float *a, size_t n) {
  float *b = malloc((n ? n : 1) * sizeof(float));
  ck_assert_ptr_nonnull(b);
  memcpy(b, a, n * sizeof(float));
  return b;
}

/* |a - b| <= rtol * (scale + |b|) element by element (rtol 0: equal). */
static void near(const char *what, const float *a, const float *b, size_t n,
                 double rtol, double scale) {
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - b[i]);
    CHECK(rtol == 0.0 ? a[i] == b[i] || (isnan(a[i]) && isnan(b[i]))
                      : d <= rtol * (scale + fabs(b[i])),
          "%s[%zu]: %.9g, CPU backend %.9g", what, i, (double)a[i],
          (double)b[i]);
  }
}

/* ------------------------------------ the kernels, index by index (CPU) */

/* Partial-sum capacity of the emulated scratch (RED_REGION in nn_cuda.cu;
 * smaller here so that the cap on slices is exercised too). */
#define CAP (1 << 14)

/* nn_cuda.cu colsum_masked(): out[k] = scale * column sums of x [n][K],
 * in levels of k_colsum over J*K indices; if relu_y is not NULL the first
 * level is k_colsum_relu (masks x in place). */
static void g_colsum_masked(float *x, const float *relu_y, int n, int K,
                            float scale, float *out) {
  float *reg[2] = {zeros(CAP), zeros(CAP)};
  const float *src = x;
  for (int level = 0;; level++) {
    int J = cnn_red_slices(n, K, CAP);
    float *dst = J == 1 ? out : reg[level % 2];
    float sc = J == 1 ? scale : 1.0f;
    for (int i = 0; i < J * K; i++)
      dst[i] = sc * (level == 0 && relu_y ? cnn_e_colsum_relu(i, relu_y, x, n, K, J)
                                          : cnn_e_colsum(i, src, n, K, J));
    if (J == 1) break;
    src = dst;
    n = J;
  }
  free(reg[0]);
  free(reg[1]);
}

static void g_colsum(const float *x, int n, int K, float scale, float *out) {
  g_colsum_masked((float *)x, NULL, n, K, scale, out);
}

static void g_relu_bwd_bias(const float *y, float *dy, int n, int K, float *db) {
  g_colsum_masked(dy, y, n, K, 1.0f, db);
}

/* C[M][N] = A[M][K] B[K][N] with op transposes, in double: what cuBLAS
 * computes (to float rounding). */
static void mm(int ta, int tb, int M, int N, int K, const float *A,
               const float *B, float beta, float *C) {
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      double s = beta != 0.0f ? (double)beta * C[(size_t)i * N + j] : 0.0;
      for (int k = 0; k < K; k++)
        s += (double)(ta ? A[(size_t)k * M + i] : A[(size_t)i * K + k]) *
             (tb ? B[(size_t)j * K + k] : B[(size_t)k * N + j]);
      C[(size_t)i * N + j] = (float)s;
    }
}

/* nn_cuda.cu im2col(): the col matrix of images [b0, b0 + nb) as its
 * kernels write it, cnn_e_im2col4 per float4 where C % 4 == 0 (vector
 * path), cnn_e_im2col1 per float otherwise (or when vec is 0). */
static void g_im2col(const cnn_conv_geom *g, int nb, const float *x, int vec,
                     float *col) {
  size_t n = (size_t)nb * g->H * g->W * cnn_col_ld(g->R, g->C);
  if (vec && g->C % 4 == 0) {
    for (size_t v = 0; v < n / 4; v++)
      ((cnn_f4 *)col)[v] = cnn_e_im2col4((int)v, g->H, g->W, g->C, g->R,
                                         (const cnn_f4 *)x);
  } else {
    for (size_t i = 0; i < n; i++)
      col[i] = cnn_e_im2col1((int)i, g->H, g->W, g->C, g->R, x);
  }
}

/* The col matrix from its definition (nn_cuda_ops.h), loop by loop. */
static void ref_im2col(const cnn_conv_geom *g, int nb, const float *x,
                       float *col) {
  int H = g->H, W = g->W, C = g->C, R = g->R, p = (R - 1) / 2;
  int ld = cnn_col_ld(R, C), RRC = R * R * C;
  ck_assert_int_eq(ld % 4, 0);
  ck_assert(ld > RRC && ld <= RRC + 4);
  for (int n = 0; n < nb; n++)
    for (int h = 0; h < H; h++)
      for (int w = 0; w < W; w++) {
        float *row = col + (((size_t)n * H + h) * W + w) * ld;
        for (int kh = 0; kh < R; kh++)
          for (int kw = 0; kw < R; kw++)
            for (int c = 0; c < C; c++) {
              int ih = h + kh - p, iw = w + kw - p;
              int in = ih >= 0 && ih < H && iw >= 0 && iw < W;
              row[(kh * R + kw) * C + c] =
                  in ? x[(((size_t)n * H + ih) * W + iw) * C + c] : 0.0f;
            }
        for (int e = RRC; e < ld; e++) row[e] = e == RRC ? 1.0f : 0.0f;
      }
}

/* nn_cuda.cu conv_fwd_impl: im2col (chunks of `chunk` images) + GEMM over
 * the first R*R*C columns, then the epilogue (bias_act: float4 bodies
 * where K % 4 == 0). col is left holding the last chunk, as on the GPU. */
static void g_conv_fwd(const cnn_conv_geom *g, int chunk, const float *x,
                       const float *w, const float *bias, int relu, float *y,
                       float *col) {
  int RRC = g->R * g->R * g->C, ld = cnn_col_ld(g->R, g->C), K = g->K,
      HW = g->H * g->W;
  float *a = zeros((size_t)RRC);
  for (int b0 = 0; b0 < g->B; b0 += chunk) {
    int nb = g->B - b0 < chunk ? g->B - b0 : chunk, rows = nb * HW;
    g_im2col(g, nb, x + (size_t)b0 * HW * g->C, 1, col);
    for (int r = 0; r < rows; r++) { /* A = col[:, :RRC] (lda = ld) */
      memcpy(a, col + (size_t)r * ld, RRC * sizeof(float));
      mm(0, 0, 1, K, RRC, a, w, 0.0f, y + ((size_t)b0 * HW + r) * K);
    }
  }
  size_t n = (size_t)g->B * HW * K;
  if ((bias || relu) && K % 4 == 0) {
    for (size_t v = 0; v < n / 4; v++)
      ((cnn_f4 *)y)[v] = cnn_e_bias_act4((int)v, K, (const cnn_f4 *)y,
                                         (const cnn_f4 *)bias, relu);
  } else if (bias || relu) {
    for (size_t i = 0; i < n; i++) y[i] = cnn_e_bias_act((int)i, K, y, bias, relu);
  }
  free(a);
}

/* nn_cuda.cu cu_conv_bwd_filter: chunks last first, the last one reusing
 * the forward's col; the GEMM over R*R*C + 1 columns of col gives dw and,
 * from the ones column, db. */
static void g_conv_bwd_filter(const cnn_conv_geom *g, int chunk,
                              const float *x, const float *dy, float *col,
                              float *dw, float *db) {
  int RRC = g->R * g->R * g->C, ld = cnn_col_ld(g->R, g->C), K = g->K,
      HW = g->H * g->W;
  float *dwx = zeros((size_t)(RRC + 1) * K), *a = zeros((size_t)HW * chunk * (RRC + 1));
  for (int b0 = (g->B - 1) / chunk * chunk, first = 1; b0 >= 0; b0 -= chunk, first = 0) {
    int nb = g->B - b0 < chunk ? g->B - b0 : chunk, rows = nb * HW;
    if (!first) g_im2col(g, nb, x + (size_t)b0 * HW * g->C, 1, col);
    for (int r = 0; r < rows; r++)
      memcpy(a + (size_t)r * (RRC + 1), col + (size_t)r * ld, (RRC + 1) * sizeof(float));
    mm(1, 0, RRC + 1, K, rows, a, dy + (size_t)b0 * HW * K, first ? 0.0f : 1.0f, dwx);
  }
  memcpy(dw, dwx, (size_t)RRC * K * sizeof(float));
  memcpy(db, dwx + (size_t)RRC * K, K * sizeof(float));
  free(dwx);
  free(a);
}

START_TEST(test_im2col) {
  /* B H W C R: the model's layers (conv2's data gradient is conv2's
   * geometry), C % 4 == 0 off the model, C % 4 != 0 (1, 2, 5, 6), the
   * kernel wider than the image, R 1 and 3 */
  static const int cases[][5] = {{2, 24, 24, 3, 5}, {2, 12, 12, 64, 5}, {2, 5, 7, 8, 3},
                                 {3, 4, 3, 2, 5},   {1, 6, 5, 5, 3},    {2, 3, 3, 12, 1},
                                 {2, 7, 4, 6, 5},   {1, 9, 9, 1, 7}};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const int *c = cases[ci];
    cnn_conv_geom g = {c[0], c[1], c[2], c[3], 1, c[4]};
    seed(10 + ci);
    size_t nx = (size_t)g.B * g.H * g.W * g.C;
    size_t ncol = (size_t)g.B * g.H * g.W * cnn_col_ld(g.R, g.C);
    float *x = randn(nx, 1.0f), *ref = zeros(ncol), *c1 = zeros(ncol), *c4 = zeros(ncol);
    ref_im2col(&g, g.B, x, ref);
    g_im2col(&g, g.B, x, 0, c1);
    g_im2col(&g, g.B, x, 1, c4);
    for (size_t i = 0; i < ncol; i++) {
      CHECK(c1[i] == ref[i], "im2col1 %dx%dx%d R%d [%zu]: %g, want %g", g.H, g.W, g.C, g.R,
            i, (double)c1[i], (double)ref[i]);
      CHECK(c4[i] == ref[i], "im2col4 %dx%dx%d R%d [%zu]: %g, want %g", g.H, g.W, g.C, g.R,
            i, (double)c4[i], (double)ref[i]);
    }
    free(x); free(ref); free(c1); free(c4);
  }
}
END_TEST

START_TEST(test_conv) {
  const cnn_backend *be = cnn_backend_cpu(1);
  /* the model's two layers at batch 3 (chunks of 2 images: a partial last
   * chunk), odd shapes with the kernel wider than the image, C % 4 != 0
   * and K % 4 != 0, C % 4 == 0 off the model's geometry */
  static const int cases[][6] = {{3, 24, 24, 3, 64, 5}, {3, 12, 12, 64, 64, 5},
                                 {2, 4, 3, 2, 5, 5},    {3, 6, 5, 8, 12, 3},
                                 {3, 5, 6, 5, 6, 3}};
  seed(1);
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const int *c = cases[ci];
    cnn_conv_geom g = {c[0], c[1], c[2], c[3], c[4], c[5]};
    size_t nx = (size_t)g.B * g.H * g.W * g.C, ny = (size_t)g.B * g.H * g.W * g.K,
           nw = (size_t)g.R * g.R * g.C * g.K;
    int HW = g.H * g.W, ldmax = cnn_col_ld(g.R, g.C > g.K ? g.C : g.K);
    float *x = randn(nx, 1.0f), *w = randn(nw, 0.2f), *b = randn(g.K, 1.0f),
          *dy = randn(ny, 1.0f);
    float *y = zeros(ny), *yr = zeros(ny), *col = zeros((size_t)2 * HW * ldmax);
    void *ws = be->alloc(be, be->conv_ws_bytes(be, &g));
    ck_assert_ptr_nonnull(ws);
    for (int v = 0; v < 3; v++) { /* no bias, bias, bias + ReLU */
      const float *bias = v ? b : NULL;
      g_conv_fwd(&g, 2, x, w, bias, v == 2, y, col);
      be->conv_fwd(be, &g, x, w, bias, v == 2, yr, ws);
      near("conv fwd", y, yr, ny, 1e-4, maxabs(yr, ny));
    }
    /* filter and bias gradients from the forward's col (left by the last
     * g_conv_fwd) and the ones column */
    float *dw = zeros(nw), *dwr = zeros(nw), *db = zeros(g.K), *dbr = zeros(g.K);
    g_conv_bwd_filter(&g, 2, x, dy, col, dw, db);
    be->conv_bwd_filter(be, &g, x, dy, dwr, dbr, ws);
    near("conv dw", dw, dwr, nw, 1e-4, maxabs(dwr, nw));
    near("conv db", db, dbr, (size_t)g.K, 1e-5, maxabs(dbr, g.K) * 10);
    /* data gradient: k_flip, then the forward with C and K swapped */
    float *wf = zeros(nw), *dx = zeros(nx), *dxr = zeros(nx);
    for (int i = 0; i < (int)nw; i++) wf[i] = cnn_e_flip(i, g.R, g.C, g.K, w);
    cnn_conv_geom gt = g;
    gt.C = g.K;
    gt.K = g.C;
    g_conv_fwd(&gt, 2, dy, wf, NULL, 0, dx, col);
    be->conv_bwd_data(be, &g, dy, w, dxr, ws);
    near("conv dx", dx, dxr, nx, 1e-4, maxabs(dxr, nx));
    be->free(be, ws);
    free(x); free(w); free(b); free(dy); free(y); free(yr); free(dw); free(dwr);
    free(db); free(dbr); free(col); free(wf); free(dx); free(dxr);
  }
}
END_TEST

/* The fused epilogues against the unfused sequence: bias_act4 against
 * the scalar bias_act (equal: the same arithmetic per element), the
 * ReLU backward + bias gradient against relu_bwd then dense_bwd's db on
 * the CPU backend (masked dy equal; db within 1e-5 of the summed
 * magnitudes: the order of the sums differs). */
START_TEST(test_epilogues) {
  const cnn_backend *be = cnn_backend_cpu(1);
  static const int cases[][2] = {{3, 64}, {128, 384}, {200, 192}, {5000, 64}, {7, 12}};
  seed(8);
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    int rows = cases[ci][0], K = cases[ci][1];
    size_t n = (size_t)rows * K;
    float *y0 = randn(n, 1.0f), *b = randn(K, 1.0f);
    for (int v = 0; v < 3; v++) {
      float *y4 = copy(y0, n), *y1 = copy(y0, n);
      const float *bias = v ? b : NULL;
      for (size_t i = 0; i < n / 4; i++)
        ((cnn_f4 *)y4)[i] = cnn_e_bias_act4((int)i, K, (const cnn_f4 *)y4,
                                            (const cnn_f4 *)bias, v == 2);
      for (size_t i = 0; i < n; i++) y1[i] = cnn_e_bias_act((int)i, K, y1, bias, v == 2);
      near("bias_act4", y4, y1, n, 0.0, 0.0);
      free(y4);
      free(y1);
    }
    float *y = copy(y0, n), *dy0 = randn(n, 1.0f);
    for (size_t i = 0; i < n; i++) y[i] = cnn_relu(y[i]);
    float *dy = copy(dy0, n), *dyr = copy(dy0, n), *db = zeros(K), *dbr = zeros(K);
    g_relu_bwd_bias(y, dy, rows, K, db);
    be->relu_bwd(be, n, y, dyr);
    float *x = randn((size_t)rows * 3, 1.0f), *w = randn((size_t)3 * K, 1.0f),
          *dw = zeros((size_t)3 * K);
    be->dense_bwd(be, rows, 3, K, x, w, dyr, NULL, dw, dbr);
    near("relu_bwd_bias dy", dy, dyr, n, 0.0, 0.0);
    for (int k = 0; k < K; k++) {
      double mag = 0;
      for (int r = 0; r < rows; r++) mag += fabs(dyr[(size_t)r * K + k]);
      CHECK(fabs(db[k] - dbr[k]) <= 1e-5 * mag + 1e-30, "relu_bwd_bias db[%d]: %.9g, cpu %.9g",
            k, (double)db[k], (double)dbr[k]);
    }
    free(y0); free(b); free(y); free(dy0); free(dy); free(dyr); free(db); free(dbr);
    free(x); free(w); free(dw);
  }
}
END_TEST

START_TEST(test_dense) {
  const cnn_backend *be = cnn_backend_cpu(1);
  static const int cases[][3] = {{3, 7, 5}, {128, 192, 10}, {200, 40, 384}};
  seed(2);
  for (size_t ci = 0; ci < 3; ci++) {
    int M = cases[ci][0], K = cases[ci][1], N = cases[ci][2];
    float *x = randn((size_t)M * K, 1.0f), *w = randn((size_t)K * N, 0.3f),
          *b = randn(N, 1.0f), *dy = randn((size_t)M * N, 1.0f);
    float *y = zeros((size_t)M * N), *yr = zeros((size_t)M * N);
    for (int relu = 0; relu < 2; relu++) {
      mm(0, 0, M, N, K, x, w, 0.0f, y);
      for (int i = 0; i < M * N; i++) y[i] = cnn_e_bias_act(i, N, y, b, relu);
      be->dense_fwd(be, M, K, N, x, w, b, relu, yr);
      near("dense fwd", y, yr, (size_t)M * N, 1e-4, maxabs(yr, (size_t)M * N));
    }
    float *dx = zeros((size_t)M * K), *dxr = zeros((size_t)M * K),
          *dw = zeros((size_t)K * N), *dwr = zeros((size_t)K * N), *db = zeros(N),
          *dbr = zeros(N);
    mm(1, 0, K, N, M, x, dy, 0.0f, dw);
    mm(0, 1, M, K, N, dy, w, 0.0f, dx);
    g_colsum(dy, M, N, 1.0f, db);
    be->dense_bwd(be, M, K, N, x, w, dy, dxr, dwr, dbr);
    near("dense dw", dw, dwr, (size_t)K * N, 1e-4, maxabs(dwr, (size_t)K * N));
    near("dense dx", dx, dxr, (size_t)M * K, 1e-4, maxabs(dxr, (size_t)M * K));
    near("dense db", db, dbr, (size_t)N, 1e-5, maxabs(dbr, N) * 10);
    free(x); free(w); free(b); free(dy); free(y); free(yr); free(dx); free(dxr);
    free(dw); free(dwr); free(db); free(dbr);
  }
}
END_TEST

/* -------------------------------------------------- reductions, by size */

START_TEST(test_reductions) {
  /* 1 level (n <= CNN_RED_FINAL), 2, 3, and slices capped by CAP / K */
  static const int cases[][2] = {{1, 1}, {128, 3}, {129, 10}, {5000, 3},
                                 {73728, 1}, {20000, 64}};
  seed(3);
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    int n = cases[ci][0], K = cases[ci][1];
    float *x = randn((size_t)n * K, 1.0f), *out = zeros(K);
    g_colsum(x, n, K, 0.5f, out);
    for (int k = 0; k < K; k++) {
      double s = 0, mag = 0;
      for (int r = 0; r < n; r++) {
        s += x[(size_t)r * K + k];
        mag += fabs(x[(size_t)r * K + k]);
      }
      CHECK(fabs(out[k] - 0.5 * s) <= 1e-5 * mag, "colsum n=%d K=%d [%d]: %.9g, want %.9g",
            n, K, k, (double)out[k], 0.5 * s);
    }
    free(x);
    free(out);
  }
  /* every row is counted exactly once whatever the levels */
  for (int n = 1; n < 3000; n += 37) {
    float *ones = malloc((size_t)n * 2 * sizeof(float)), out[2];
    for (int i = 0; i < 2 * n; i++) ones[i] = 1.0f;
    g_colsum(ones, n, 2, 1.0f, out);
    CHECK(out[0] == (float)n && out[1] == (float)n, "colsum of %d ones: %g", n, (double)out[0]);
    free(ones);
  }
}
END_TEST

/* ------------------------------------------------- element-wise, pooling */

START_TEST(test_elementwise) {
  const cnn_backend *be = cnn_backend_cpu(2);
  seed(4);
  /* NCHW -> NHWC */
  int B = 3, C = 3, H = 24, W = 24, n = B * C * H * W;
  float *src = randn(n, 1.0f), *d = zeros(n), *dr = zeros(n);
  for (int i = 0; i < n; i++) d[i] = cnn_e_nhwc(i, C, H, W, src);
  be->nchw_to_nhwc(be, B, C, H, W, src, dr);
  near("nhwc", d, dr, n, 0.0, 0.0);
  /* ReLU backward, SGD */
  float *y = randn(n, 1.0f), *g = randn(n, 1.0f);
  for (int i = 0; i < n; i++) y[i] = cnn_relu(y[i]);
  float *dy = copy(g, n), *dyr = copy(g, n);
  for (int i = 0; i < n; i++) dy[i] = cnn_relu_bwd(y[i], dy[i]);
  be->relu_bwd(be, (size_t)n, y, dyr);
  near("relu_bwd", dy, dyr, n, 0.0, 0.0);
  float *w = copy(src, n), *wr = copy(src, n);
  for (int i = 0; i < n; i++) w[i] = cnn_sgd_elem(w[i], g[i], 0.1f);
  be->sgd(be, (size_t)n, 0.1f, g, wr);
  near("sgd", w, wr, n, 1e-6, 1.0);
  free(src); free(d); free(dr); free(y); free(g); free(dy); free(dyr); free(w); free(wr);

  /* weight decay: k_l2's slices, then colsum levels of the partials */
  size_t nl = 884736; /* local3 */
  float *wl = randn(nl, 0.04f), *gl = randn(nl, 0.01f);
  float *dwl = copy(gl, nl), *dwlr = copy(gl, nl);
  int J = cnn_red_slices((int)nl, 1, CAP);
  float *part = zeros(J), loss = 0.0f, lossr = 0.0f;
  for (int j = 0; j < J; j++) part[j] = cnn_e_l2(j, J, (int)nl, 0.004f, wl, dwl);
  g_colsum(part, J, 1, 0.5f * 0.004f, &loss);
  be->l2_decay(be, nl, 0.004f, wl, dwlr, &lossr);
  near("l2 dw", dwl, dwlr, nl, 1e-6, 1e-3);
  CHECK(fabs(loss - lossr) <= 1e-5 * lossr, "l2 loss %.9g, cpu %.9g", (double)loss,
        (double)lossr);
  free(wl); free(gl); free(dwl); free(dwlr); free(part);

  /* softmax cross-entropy: k_xent rows, colsum of the row losses */
  int Bx = 300, N = 10;
  float *z = randn((size_t)Bx * N, 3.0f), *dz = zeros((size_t)Bx * N),
        *dzr = zeros((size_t)Bx * N), *rowloss = zeros(Bx), xl = 0, xlr = 0;
  uint8_t *lab = malloc(Bx);
  int32_t *pred = malloc(Bx * sizeof(int32_t)), *predr = malloc(Bx * sizeof(int32_t));
  for (int b = 0; b < Bx; b++) lab[b] = (uint8_t)(ur() * 10);
  for (int b = 0; b < Bx; b++) rowloss[b] = cnn_e_xent(b, N, z, lab, 0.1f, 1.0f / Bx, dz, pred);
  g_colsum(rowloss, Bx, 1, 1.0f, &xl);
  be->softmax_xent(be, Bx, N, z, lab, 0.1f, 1.0f / Bx, dzr, predr, &xlr);
  near("xent dlogits", dz, dzr, (size_t)Bx * N, 0.0, 0.0);
  ck_assert_mem_eq(pred, predr, Bx * sizeof(int32_t));
  CHECK(fabs(xl - xlr) <= 1e-5 * xlr, "xent loss %.9g, cpu %.9g", (double)xl, (double)xlr);
  free(z); free(dz); free(dzr); free(rowloss); free(lab); free(pred); free(predr);
}
END_TEST

START_TEST(test_maxpool) {
  const cnn_backend *be = cnn_backend_cpu(2);
  /* B H W C k s: the model's pools, padding before (7 -> 4), k = s */
  static const int cases[][6] = {{3, 24, 24, 64, 3, 2}, {3, 12, 12, 64, 3, 2},
                                 {2, 7, 5, 3, 3, 2}, {2, 5, 6, 2, 2, 2}};
  seed(5);
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const int *c = cases[ci];
    cnn_pool_geom g;
    cnn_pool_geom_init(&g, c[0], c[1], c[2], c[3], c[4], c[5]);
    int nx = g.B * g.H * g.W * g.C, ny = g.B * g.OH * g.OW * g.C;
    float *x = randn(nx, 1.0f);
    for (int i = 0; i < nx; i += 7) x[i] = x[(i + 3) % nx]; /* ties */
    float *y = zeros(ny), *yr = zeros(ny);
    int32_t *arg = malloc(ny * sizeof(int32_t)), *argr = malloc(ny * sizeof(int32_t));
    for (int o = 0; o < ny; o++) cnn_e_maxpool_fwd(o, &g, x, y, arg);
    be->maxpool_fwd(be, &g, x, yr, argr);
    near("maxpool y", y, yr, ny, 0.0, 0.0);
    ck_assert_mem_eq(arg, argr, ny * sizeof(int32_t));
    float *dy = randn(ny, 1.0f), *relu_x = randn(nx, 1.0f);
    for (int i = 0; i < nx; i++) relu_x[i] = cnn_relu(relu_x[i]);
    float *dx = zeros(nx), *dxr = zeros(nx);
    for (int m = 0; m < 2; m++) {
      const float *rx = m ? relu_x : NULL;
      for (int i = 0; i < nx; i++) dx[i] = cnn_e_maxpool_bwd(i, &g, dy, arg, rx);
      be->maxpool_bwd(be, &g, dy, argr, rx, dxr);
      near(m ? "maxpool+relu dx" : "maxpool dx", dx, dxr, nx, 0.0, 0.0);
    }
    free(x); free(y); free(yr); free(arg); free(argr); free(dy); free(relu_x);
    free(dx); free(dxr);
  }
}
END_TEST

START_TEST(test_lrn) {
  const cnn_backend *be = cnn_backend_cpu(2);
  static const struct {
    int rows, C;
    cnn_lrn_param p;
  } cases[] = {{3 * 144, 64, {4, 1.0f, 0.001f / 9.0f, 0.75f}}, /* the model's */
               {50, 64, {4, 1.0f, 0.05f, 0.75f}},
               {40, 7, {2, 2.0f, 0.3f, 0.5f}}, /* powf path */
               {30, 5, {4, 1.0f, 0.2f, 0.75f}}}; /* window wider than C */
  seed(6);
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    int n = cases[ci].rows * cases[ci].C, C = cases[ci].C;
    const cnn_lrn_param *p = &cases[ci].p;
    float *x = randn(n, 2.0f), *dy = randn(n, 1.0f);
    float *y = zeros(n), *yr = zeros(n), *s = zeros(n), *sr = zeros(n);
    for (int i = 0; i < n; i++) cnn_e_lrn_fwd(i, C, p, x, y, s);
    be->lrn_fwd(be, (size_t)cases[ci].rows, C, p, x, yr, sr);
    near("lrn scale", s, sr, n, 1e-5, 0.0);
    near("lrn y", y, yr, n, 1e-5, 1e-3);
    float *dx = zeros(n), *dxr = zeros(n);
    for (int m = 0; m < 2; m++) {
      for (int i = 0; i < n; i++) dx[i] = cnn_e_lrn_bwd(i, C, p, x, sr, dy, m);
      be->lrn_bwd(be, (size_t)cases[ci].rows, C, p, x, sr, dy, m, dxr);
      near(m ? "lrn+relu dx" : "lrn dx", dx, dxr, n, 1e-5, 1e-3);
    }
    free(x); free(dy); free(y); free(yr); free(s); free(sr); free(dx); free(dxr);
  }
}
END_TEST

/* --------------------------------- the model's device path, without GPU */

/* A backend whose "device" memory is separate host memory: the CPU ops,
 * host_mapped 0, synchronous tagged copies that check their order, and a
 * host_register that refuses a page registered twice (as the driver
 * does). The model must stage, upload, wait, download and page-lock as it
 * would on a GPU. */
#define FAKE_RANGES 64
static struct {
  cnn_backend be;              /* the vtable */
  uintptr_t lo[FAKE_RANGES], hi[FAKE_RANGES]; /* registered page ranges */
  int nreg;                    /* entries */
  int uploaded[CNN_BE_SLOTS];  /* slot copied since the step began */
  int bad_wait;                /* an op waited for a slot never uploaded */
  long downloads;              /* download_async calls */
  long param_uploads;          /* upload_async calls of parameter slots */
  long fused;                  /* relu_bwd_bias calls */
  long ws_fwd;                 /* conv_ws_fwd_bytes calls */
} fake;

static int fake_register(const cnn_backend *be, void *p, size_t bytes) {
  (void)be;
  uintptr_t a = (uintptr_t)p, b = a + bytes;
  if (a % 4096 || bytes % 4096 || fake.nreg == FAKE_RANGES) return -1;
  for (int i = 0; i < fake.nreg; i++)
    if (a < fake.hi[i] && fake.lo[i] < b) return -1; /* a page twice */
  fake.lo[fake.nreg] = a;
  fake.hi[fake.nreg++] = b;
  return 0;
}
static void fake_unregister(const cnn_backend *be, void *p) {
  (void)be;
  for (int i = 0; i < fake.nreg; i++)
    if (fake.lo[i] == (uintptr_t)p) {
      fake.lo[i] = fake.lo[--fake.nreg];
      fake.hi[i] = fake.hi[fake.nreg];
      return;
    }
  ck_abort_msg("unregistering %p, never registered", p);
}
static void fake_upload(const cnn_backend *be, int slot, void *dst,
                        const void *src, size_t bytes) {
  (void)be;
  ck_assert(slot >= 0 && slot < CNN_BE_SLOTS);
  memcpy(dst, src, bytes);
  fake.uploaded[slot] = 1;
  if (slot < CNN_NUM_PARAMS) fake.param_uploads++;
}
static void fake_wait(const cnn_backend *be, int slot) {
  (void)be;
  if (!fake.uploaded[slot]) fake.bad_wait = 1;
}
static void fake_download(const cnn_backend *be, void *dst, const void *src,
                          size_t bytes) {
  (void)be;
  memcpy(dst, src, bytes);
  fake.downloads++;
}
static void fake_sync(const cnn_backend *be) {
  (void)be;
  memset(fake.uploaded, 0, sizeof fake.uploaded); /* a new step begins */
}
/* the CUDA backend's fused ReLU backward + bias gradient, index by index */
static void fake_relu_bwd_bias(const cnn_backend *be, int rows, int K, const float *y,
                               float *dy, float *db) {
  (void)be;
  fake.fused++;
  g_relu_bwd_bias(y, dy, rows, K, db);
}
static size_t fake_ws_fwd_bytes(const cnn_backend *be, const cnn_conv_geom *g) {
  fake.ws_fwd++;
  return cnn_backend_cpu(1)->conv_ws_bytes(be, g);
}

typedef struct {
  cnn *m;
  float *val[CNN_NUM_PARAMS], *grad[CNN_NUM_PARAMS];
} bound;

static void bind_all(bound *b, const cnn_backend *be, int B) {
  ck_assert_int_eq(cnn_create(be, B, 1, &b->m), 0);
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    const cnn_param *p = cnn_param_info(i);
    size_t n = cnn_param_numel(i);
    b->val[i] = zeros(n);
    b->grad[i] = zeros(n);
    ps_init init = PS_SIZED(ps_init, (ps_init_kind)p->init_kind, p->init_a, p->init_b, 5);
    ck_assert_int_eq(ps_init_fill(&init, p->name, p->shape, p->ndim, b->val[i], n), 0);
    cnn_bind(b->m, i, b->val[i], b->grad[i]);
  }
}

static void unbind_all(bound *b) {
  cnn_destroy(b->m);
  for (int i = 0; i < CNN_NUM_PARAMS; i++) {
    free(b->val[i]);
    free(b->grad[i]);
  }
}

static void fake_init(void) {
  memset(&fake, 0, sizeof fake);
  fake.be = *cnn_backend_cpu(1);
  fake.be.name = "fake-device";
  fake.be.host_mapped = 0;
  fake.be.sync = fake_sync;
  fake.be.host_register = fake_register;
  fake.be.host_unregister = fake_unregister;
  fake.be.upload_async = fake_upload;
  fake.be.upload_wait = fake_wait;
  fake.be.download_async = fake_download;
  fake.be.relu_bwd_bias = fake_relu_bwd_bias;
  fake.be.conv_ws_fwd_bytes = fake_ws_fwd_bytes;
}

START_TEST(test_model_device_path) {
  fake_init();
  seed(7);
  int B = 4;
  bound c, d;
  bind_all(&c, cnn_backend_cpu(1), B);
  bind_all(&d, &fake.be, B);
  float *img = randn((size_t)B * CNN_IMAGE_FLOATS, 1.0f);
  uint8_t lab[4] = {1, 7, 3, 9};
  for (int step = 0; step < 3; step++) {
    float lc = cnn_train_step(c.m, img, lab, B);
    float ld = cnn_train_step(d.m, img, lab, B);
    ck_assert(isfinite(lc));
    CHECK(fabsf(lc - ld) <= 1e-6f * fabsf(lc), "step %d loss: cpu %g, device path %g",
          step, (double)lc, (double)ld);
    for (int i = 0; i < CNN_NUM_PARAMS; i++)
      near(cnn_param_info(i)->name, d.grad[i], c.grad[i], cnn_param_numel(i), 1e-6,
           maxabs(c.grad[i], cnn_param_numel(i)));
    cnn_sgd_local(c.m, 0.1f);
    cnn_sgd_local(d.m, 0.1f);
    for (int i = 0; i < CNN_NUM_PARAMS; i++)
      near("value after sgd", d.val[i], c.val[i], cnn_param_numel(i), 1e-6, 1e-3);
  }
  ck_assert_msg(!fake.bad_wait, "an op waited for an upload that was not queued");
  ck_assert_int_eq(fake.fused, 3 * 2); /* local4 and local3, each step */
  ck_assert_int_eq(fake.ws_fwd, 1);    /* conv1's workspace */
  ck_assert_msg(fake.nreg > 0, "the bound buffers were not page-locked");
  ck_assert(fake.downloads >= 3 * (CNN_NUM_PARAMS + 1));
  /* every bound byte is inside a registered range */
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    for (int k = 0; k < 2; k++) {
      uintptr_t a = (uintptr_t)(k ? d.grad[i] : d.val[i]);
      uintptr_t e = a + cnn_param_numel(i) * sizeof(float);
      int in = 0;
      for (int r = 0; r < fake.nreg; r++) in |= fake.lo[r] <= a && e <= fake.hi[r];
      ck_assert_msg(in, "%s %s not page-locked", cnn_param_info(i)->name, k ? "grad" : "value");
    }
  /* evaluation agrees too */
  int pc[4], pd[4];
  float ec = cnn_eval(c.m, img, lab, B, pc), ed = cnn_eval(d.m, img, lab, B, pd);
  CHECK(fabsf(ec - ed) <= 1e-6f * fabsf(ec), "eval %g vs %g", (double)ec, (double)ed);
  ck_assert_mem_eq(pc, pd, sizeof pc);
  unbind_all(&c);
  unbind_all(&d);
  ck_assert_int_eq(fake.nreg, 0); /* destroy unregistered everything */
  free(img);
}
END_TEST

/* Local SGD with the values kept on the device (cnn_values_on_device):
 * the same losses and, once copied back, the same values as the CPU
 * backend, with no parameter upload per step and the bound value buffers
 * not read meanwhile (they hold NaN then). */
START_TEST(test_values_on_device) {
  fake_init();
  seed(9);
  int B = 4;
  bound c, d;
  bind_all(&c, cnn_backend_cpu(1), B);
  bind_all(&d, &fake.be, B);
  float *img = randn((size_t)B * CNN_IMAGE_FLOATS, 1.0f);
  uint8_t lab[4] = {2, 0, 5, 9};
  cnn_values_on_device(d.m, 1);
  cnn_values_on_device(c.m, 1); /* no effect on the CPU */
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    for (size_t j = 0; j < cnn_param_numel(i); j++) d.val[i][j] = NAN;
  long ups = fake.param_uploads;
  for (int step = 0; step < 3; step++) {
    float lc = cnn_train_step(c.m, img, lab, B);
    float ld = cnn_train_step(d.m, img, lab, B);
    ck_assert(isfinite(lc));
    CHECK(fabsf(lc - ld) <= 1e-6f * fabsf(lc), "step %d loss: cpu %g, device values %g",
          step, (double)lc, (double)ld);
    cnn_sgd_local(c.m, 0.1f);
    cnn_sgd_local(d.m, 0.1f);
  }
  ck_assert_int_eq(fake.param_uploads, ups);
  ck_assert_msg(!fake.bad_wait, "an op waited for an upload that was not queued");
  cnn_values_on_device(d.m, 0); /* copies them back */
  for (int i = 0; i < CNN_NUM_PARAMS; i++)
    near("value after device sgd", d.val[i], c.val[i], cnn_param_numel(i), 1e-6, 1e-3);
  /* and uploads again from then on */
  ck_assert(isfinite(cnn_train_step(d.m, img, lab, B)));
  ck_assert_int_eq(fake.param_uploads, ups + CNN_NUM_PARAMS);
  unbind_all(&c);
  unbind_all(&d);
  free(img);
}
END_TEST

/* which GPU a worker takes */
START_TEST(test_pick_device) {
  const char *why = NULL;
  unsetenv("PS_LOCAL_RANK");
  unsetenv("SLURM_LOCALID");
  ck_assert_int_eq(cnn_cuda_pick_device(0, &why), -1);
  ck_assert_int_eq(cnn_cuda_pick_device(1, &why), 0);
  ck_assert_int_eq(cnn_cuda_pick_device(4, &why), 0);
  setenv("SLURM_LOCALID", "6", 1);
  ck_assert_int_eq(cnn_cuda_pick_device(4, &why), 2);
  setenv("PS_LOCAL_RANK", "3", 1); /* psrun's wins */
  ck_assert_int_eq(cnn_cuda_pick_device(4, &why), 3);
  ck_assert_int_eq(cnn_cuda_pick_device(1, &why), 0);
  ck_assert_ptr_nonnull(strstr(why, "only"));
  setenv("PS_LOCAL_RANK", "x", 1); /* not a number: the next rule */
  ck_assert_int_eq(cnn_cuda_pick_device(4, &why), 2);
  unsetenv("PS_LOCAL_RANK");
  unsetenv("SLURM_LOCALID");
}
END_TEST

Suite *suite_cuda_ops(void) {
  Suite *s = suite_create("cuda_ops");
  TCase *tc = tcase_create("bodies");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_im2col);
  tcase_add_test(tc, test_conv);
  tcase_add_test(tc, test_epilogues);
  tcase_add_test(tc, test_dense);
  tcase_add_test(tc, test_reductions);
  tcase_add_test(tc, test_elementwise);
  tcase_add_test(tc, test_maxpool);
  tcase_add_test(tc, test_lrn);
  tcase_add_test(tc, test_model_device_path);
  tcase_add_test(tc, test_values_on_device);
  tcase_add_test(tc, test_pick_device);
  suite_add_tcase(s, tc);
  return s;
}
