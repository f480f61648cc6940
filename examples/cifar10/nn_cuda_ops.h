/*
 * nn_cuda_ops.h - the per-element bodies of the CUDA backend's kernels
 * (nn_cuda.cu). Every element-wise and reduction kernel there is a
 * grid-stride loop over an index space that calls one of these functions
 * for each index; nothing else in a kernel computes. The header is plain
 * C as well (CNN_HD is `static inline` outside nvcc), so
 * tests/test_cuda_ops.c runs the very same bodies over the same index
 * spaces on the CPU, in every build, and compares them with the CPU
 * backend (nn_cpu.c), forward and backward: the GPU arithmetic is checked
 * where there is no GPU.
 *
 * Indices are int: the model keeps every buffer under 2^31 elements (its
 * max-pool argmax is int32 anyway) and the backend refuses larger ones.
 * Layouts are those of nn_backend.h (NHWC activations, row-major).
 */
#ifndef CIFAR_NN_CUDA_OPS_H
#define CIFAR_NN_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "nn_backend.h"
#include "nn_ops.h"

/* ---- reductions ----
 * A sum over n rows (of K columns) runs in levels: each level sums slices
 * of at most CNN_RED_PER_THREAD rows per output (one thread each, so a
 * level is one launch with J*K threads) into J partial rows, until one row
 * is left. Slices are interleaved (slice j: rows j, j+J, j+2J, ...), so
 * the threads of a warp read neighbouring addresses. Short per-thread sums
 * keep every thread's chain of dependent loads short: a GPU hides latency
 * with many threads, not with long loops. */
#define CNN_RED_PER_THREAD 32 /* rows one thread sums per level */
#define CNN_RED_FINAL 128     /* n <= this: one level finishes the sum */

/* Number of slices J of the next level for n rows of K columns, at most
 * cap / K of them (the partials must fit the scratch buffer). */
CNN_HD int cnn_red_slices(int n, int K, int cap) {
  if (n <= CNN_RED_FINAL) return 1;
  int J = (n + CNN_RED_PER_THREAD - 1) / CNN_RED_PER_THREAD;
  int most = cap / (K > 0 ? K : 1);
  if (J > most) J = most;
  return J < 1 ? 1 : J;
}

/* Sum of x[t * stride] over t = j, j + J, j + 2J, ... < n. */
CNN_HD float cnn_e_slice_sum(const float *x, int n, int stride, int j,
                             int J) {
  float s = 0.0f;
  for (int t = j; t < n; t += J) s += x[(size_t)t * stride];
  return s;
}

/* One level of the column sums of x [n][K]: element i = j * K + k of the
 * partials [J][K] is slice j of column k. */
CNN_HD float cnn_e_colsum(int i, const float *x, int n, int K, int J) {
  int k = i % K, j = i / K;
  return cnn_e_slice_sum(x + k, n, K, j, J);
}

/* Slice j of J of the weight decay: dw[t] += wd * w[t] for its t, and its
 * part of sum(w^2) (the first level of that reduction). */
CNN_HD float cnn_e_l2(int j, int J, int n, float wd, const float *w,
                      float *dw) {
  float s = 0.0f;
  for (int t = j; t < n; t += J) {
    float v = w[t];
    s += v * v;
    dw[t] = cnn_l2_grad(dw[t], v, wd);
  }
  return s;
}

/* Row b of the softmax cross-entropy (nn_ops.h); returns its loss (the
 * first level of the batch sum). */
CNN_HD float cnn_e_xent(int b, int N, const float *logits,
                        const uint8_t *labels, float smooth, float scale,
                        float *dlogits, int32_t *pred) {
  return cnn_softmax_xent_row(logits + (size_t)b * N, N,
                              labels ? (int)labels[b] : -1, smooth, scale,
                              dlogits ? dlogits + (size_t)b * N : NULL,
                              pred ? pred + b : NULL);
}

/* ---- layout, bias, convolution helpers ---- */

/* Element i of dst[b][h][w][c] = src[b][c][h][w]. */
CNN_HD float cnn_e_nhwc(int i, int C, int H, int W, const float *src) {
  int c = i % C, p = i / C;
  int w = p % W;
  p /= W;
  int h = p % H, b = p / H;
  return src[(((size_t)b * C + c) * H + h) * W + w];
}

/* Element i of y [rows][K] after y = act(y + bias) (bias may be NULL). */
CNN_HD float cnn_e_bias_act(int i, int K, const float *y, const float *bias,
                            int relu) {
  if (bias) return cnn_bias_act(y[i], bias[i % K], relu);
  return relu ? cnn_relu(y[i]) : y[i];
}

/* ---- im2col ----
 * The col matrix of n NHWC images H x W x C for an R x R SAME kernel has
 * one row per output pixel: R*R*C columns in (kh, kw, c) order (the HWIO
 * weights' row order, 0 where the window leaves the image), then a column
 * of ones (the filter-gradient GEMM against it gives the bias gradient),
 * then zeros up to cnn_col_ld columns, a multiple of 4 so that every row
 * starts on a 16-byte boundary. Each (pixel, kh, kw) names C channels
 * that are contiguous in the image and in the row: the kernels move them
 * as float4 when C % 4 == 0 (cnn_e_im2col4, one vector per thread,
 * neighbouring threads on neighbouring vectors), else one float per
 * thread (cnn_e_im2col1). nn_cuda.cu instantiates both with the model's
 * geometries as constants, so the index divisions below compile to
 * multiplies and shifts; other geometries take them at run time. */
#ifdef __CUDACC__
typedef float4 cnn_f4;
#else
typedef struct {
  float x, y, z, w;
} cnn_f4; /* float4's layout: what a thread moves at once */
#endif

/* Floats per col row: R*R*C, the ones column, padding to a multiple of 4. */
CNN_HD int cnn_col_ld(int R, int C) { return (R * R * C + 4) / 4 * 4; }

/* Offset in x (NHWC, image n) of pixel (ih, iw), or -1 outside the image,
 * for column block (kh, kw) of col row `row`. */
CNN_HD int cnn_im2col_src(int row, int kh, int kw, int H, int W, int R) {
  int t = row / W, w = row - t * W;
  int n = t / H, h = t - n * H;
  int p = (R - 1) / 2, ih = h + kh - p, iw = w + kw - p;
  if (ih < 0 || ih >= H || iw < 0 || iw >= W) return -1;
  return (n * H + ih) * W + iw;
}

/* Vector v of the col matrix seen as float4 (C % 4 == 0: rows of
 * cnn_col_ld / 4 vectors, x seen as float4 too). */
CNN_HD cnn_f4 cnn_e_im2col4(int v, int H, int W, int C, int R,
                            const cnn_f4 *x) {
  cnn_f4 z = {0.0f, 0.0f, 0.0f, 0.0f};
  int C4 = C / 4, L4 = cnn_col_ld(R, C) / 4;
  int row = v / L4, e = v - row * L4;
  if (e >= R * R * C4) { /* the ones column and its padding */
    if (e == R * R * C4) z.x = 1.0f;
    return z;
  }
  int seg = e / C4, c4 = e - seg * C4, kh = seg / R, kw = seg - kh * R;
  int pix = cnn_im2col_src(row, kh, kw, H, W, R);
  return pix < 0 ? z : x[(size_t)pix * C4 + c4];
}

/* Element i of the col matrix, one float at a time (any C). */
CNN_HD float cnn_e_im2col1(int i, int H, int W, int C, int R,
                           const float *x) {
  int ld = cnn_col_ld(R, C), RC = R * C, RRC = R * RC;
  int row = i / ld, e = i - row * ld;
  if (e >= RRC) return e == RRC ? 1.0f : 0.0f;
  int kh = e / RC, r = e - kh * RC, kw = r / C, c = r - kw * C;
  int pix = cnn_im2col_src(row, kh, kw, H, W, R);
  return pix < 0 ? 0.0f : x[(size_t)pix * C + c];
}

/* ---- fused epilogues ---- */

/* Vector v of y [rows][K] (K % 4 == 0, seen as float4) after
 * y = act(y + bias) (bias may be NULL): the forward epilogue of a conv or
 * FC layer, four channels per thread. */
CNN_HD cnn_f4 cnn_e_bias_act4(int v, int K, const cnn_f4 *y,
                              const cnn_f4 *bias, int relu) {
  cnn_f4 a = y[v];
  if (bias) {
    int K4 = K / 4;
    cnn_f4 b = bias[v - v / K4 * K4];
    a.x = cnn_bias_act(a.x, b.x, relu);
    a.y = cnn_bias_act(a.y, b.y, relu);
    a.z = cnn_bias_act(a.z, b.z, relu);
    a.w = cnn_bias_act(a.w, b.w, relu);
  } else if (relu) {
    a.x = cnn_relu(a.x);
    a.y = cnn_relu(a.y);
    a.z = cnn_relu(a.z);
    a.w = cnn_relu(a.w);
  }
  return a;
}

/* The first level of the bias gradient with the ReLU backward fused
 * (element i = j * K + k of the partials [J][K], as cnn_e_colsum): masks
 * dy [n][K] where the ReLU output y is not positive, in place, for the
 * rows of slice j of column k (each element belongs to exactly one
 * slice), and returns their sum. One pass over dy instead of two. */
CNN_HD float cnn_e_colsum_relu(int i, const float *y, float *dy, int n,
                               int K, int J) {
  int k = i % K, j = i / K;
  float s = 0.0f;
  for (int t = j; t < n; t += J) {
    size_t o = (size_t)t * K + k;
    float d = cnn_relu_bwd(y[o], dy[o]);
    dy[o] = d;
    s += d;
  }
  return s;
}

/* Element i of the data-gradient weights wf[kh][kw][k][c] =
 * w[R-1-kh][R-1-kw][c][k] (the data gradient is the convolution of dy
 * with them: see nn_cpu.c). */
CNN_HD float cnn_e_flip(int i, int R, int C, int K, const float *w) {
  int c = i % C, k = (i / C) % K, t = i / (C * K);
  int kw = t % R, kh = t / R;
  return w[((((size_t)(R - 1 - kh) * R) + (R - 1 - kw)) * C + c) * K + k];
}

/* ---- max-pool (TF SAME geometry, nn_backend.h) ---- */

/* Output element o (NHWC over B x OH x OW x C): y[o] and arg[o] (flat
 * index of the winner). Scans the window row by row and keeps the first
 * of equal maxima, as the CPU backend does. */
CNN_HD void cnn_e_maxpool_fwd(int o, const cnn_pool_geom *g, const float *x,
                              float *y, int32_t *arg) {
  int C = g->C, H = g->H, W = g->W;
  int c = o % C, r = o / C;
  int ow = r % g->OW;
  r /= g->OW;
  int oh = r % g->OH, b = r / g->OH;
  int h0 = oh * g->s - g->pad_top, w0 = ow * g->s - g->pad_left;
  int hl = h0 < 0 ? 0 : h0, hh = h0 + g->k < H ? h0 + g->k : H;
  int wl = w0 < 0 ? 0 : w0, wh = w0 + g->k < W ? w0 + g->k : W;
  int32_t best = (int32_t)((((size_t)b * H + hl) * W + wl) * C + c);
  float m = x[best];
  for (int ih = hl; ih < hh; ih++)
    for (int iw = ih == hl ? wl + 1 : wl; iw < wh; iw++) {
      int32_t idx = (int32_t)((((size_t)b * H + ih) * W + iw) * C + c);
      float v = x[idx];
      if (v > m) {
        m = v;
        best = idx;
      }
    }
  y[o] = m;
  arg[o] = best;
}

/* Input element i (NHWC over B x H x W x C) of the max-pool gradient: the
 * sum of dy over the windows i won, masked by relu_x > 0 if relu_x is not
 * NULL (the fused ReLU backward of the layer below). */
CNN_HD float cnn_e_maxpool_bwd(int i, const cnn_pool_geom *g,
                               const float *dy, const int32_t *arg,
                               const float *relu_x) {
  int C = g->C, H = g->H, W = g->W;
  int c = i % C, r = i / C;
  int iw = r % W;
  r /= W;
  int ih = r % H, b = r / H;
  int ohl, ohh, owl, owh;
  cnn_pool_windows(ih, g->k, g->s, g->pad_top, g->OH, &ohl, &ohh);
  cnn_pool_windows(iw, g->k, g->s, g->pad_left, g->OW, &owl, &owh);
  float d = 0.0f;
  for (int oh = ohl; oh < ohh; oh++)
    for (int ow = owl; ow < owh; ow++) {
      size_t o = (((size_t)b * g->OH + oh) * g->OW + ow) * C + c;
      d += cnn_maxpool_bwd_term(arg[o], (int32_t)i, dy[o]);
    }
  return relu_x ? cnn_relu_bwd(relu_x[i], d) : d;
}

/* ---- LRN across channels (rows of C) ---- */

/* Element i: scale[i] = bias + alpha * (window sum of squares) and y[i]. */
CNN_HD void cnn_e_lrn_fwd(int i, int C, const cnn_lrn_param *p,
                          const float *x, float *y, float *scale) {
  int c = i % C;
  const float *xr = x + (i - c);
  float acc = 0.0f;
  for (int d = 0; d <= 2 * p->radius; d++) {
    int j = c - p->radius + d;
    float v = j >= 0 && j < C ? xr[j] : 0.0f;
    acc += v * v;
  }
  float s = cnn_lrn_scale(acc, p->bias, p->alpha);
  scale[i] = s;
  y[i] = x[i] * cnn_lrn_pow(s, p->beta);
}

/* Element i of dx from dy, x and scale of the forward (nn_ops.h's
 * formula; each thread recomputes its window's terms), zeroed where
 * x <= 0 if relu_mask. */
CNN_HD float cnn_e_lrn_bwd(int i, int C, const cnn_lrn_param *p,
                           const float *x, const float *scale,
                           const float *dy, int relu_mask) {
  int c = i % C, row = i - c;
  float acc = 0.0f;
  for (int d = 0; d <= 2 * p->radius; d++) {
    int j = c - p->radius + d;
    if (j < 0 || j >= C) continue;
    float s = scale[row + j];
    acc += cnn_lrn_bwd_t(dy[row + j], x[row + j], cnn_lrn_pow(s, p->beta), s);
  }
  float dx = cnn_lrn_bwd_dx(dy[i], x[i], cnn_lrn_pow(scale[i], p->beta), acc,
                            2.0f * p->alpha * p->beta);
  return relu_mask ? cnn_relu_bwd(x[i], dx) : dx;
}

#endif
