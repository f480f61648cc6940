/*
 * nn_ops.h - per-element (and per-row) bodies of the CNN's element-wise
 * ops: plain static inline functions with no library calls but sqrtf /
 * powf / expf / logf, so a CUDA backend can compile them as
 * __host__ __device__ (CNN_HD) and share the arithmetic with the CPU one.
 * The CPU backend (nn_cpu.c) calls them from its loops, which the compiler
 * vectorizes.
 */
#ifndef CIFAR_NN_OPS_H
#define CIFAR_NN_OPS_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define CNN_HD __host__ __device__ __forceinline__
#else
#define CNN_HD static inline
#endif

/* ---- bias, ReLU ---- */
CNN_HD float cnn_relu(float v) { return v > 0.0f ? v : 0.0f; }

/* v + b, then ReLU if relu */
CNN_HD float cnn_bias_act(float v, float b, int relu) {
  float t = v + b;
  return relu ? cnn_relu(t) : t;
}

/* ReLU backward from its output y */
CNN_HD float cnn_relu_bwd(float y, float dy) { return y > 0.0f ? dy : 0.0f; }

/* ---- LRN ---- */
/* s^-0.75 without pow: 1 / (sqrt(s) * sqrt(sqrt(s))) (s >= bias > 0) */
CNN_HD float cnn_pow_m075(float s) {
  float r = sqrtf(s);
  return 1.0f / (r * sqrtf(r));
}

/* s^-beta, with the beta = 0.75 fast path. */
CNN_HD float cnn_lrn_pow(float s, float beta) {
  return beta == 0.75f ? cnn_pow_m075(s) : powf(s, -beta);
}

/* scale from the window sum of squares */
CNN_HD float cnn_lrn_scale(float sqr_sum, float bias, float alpha) {
  return bias + alpha * sqr_sum;
}

/* Backward: with pw = s^-beta of each channel, the window sum over
 * i in [c-r, c+r] of t_i = dy_i * x_i * pw_i / s_i gives
 * dx_c = dy_c * pw_c - 2 * alpha * beta * x_c * sum. */
CNN_HD float cnn_lrn_bwd_t(float dy, float x, float pw, float s) {
  return dy * x * pw / s;
}
CNN_HD float cnn_lrn_bwd_dx(float dy, float x, float pw, float tsum,
                            float two_alpha_beta) {
  return dy * pw - two_alpha_beta * x * tsum;
}

/* ---- max-pool (TF SAME geometry) ---- */
/* Output windows along one axis that contain input position i (window o
 * covers [o*s - pad, o*s - pad + k)): [*lo, *hi). */
CNN_HD void cnn_pool_windows(int i, int k, int s, int pad, int out,
                             int *lo, int *hi) {
  int a = i + pad - k + 1; /* o*s >= a */
  int l = a <= 0 ? 0 : (a + s - 1) / s;
  int h = (i + pad) / s + 1;
  *lo = l;
  *hi = h < out ? h : out;
}

/* Gather form of the max-pool backward for one input element with flat
 * index idx: sum of dy over the windows whose winner it is. */
CNN_HD float cnn_maxpool_bwd_term(int32_t arg, int32_t idx, float dy) {
  return arg == idx ? dy : 0.0f;
}

/* ---- softmax cross-entropy, one row of n logits ---- */
/* Against the target q = (1 - smooth) onehot(label) + smooth / n (label
 * smoothing; smooth 0: the one-hot label): returns -sum_j q_j log
 * softmax(z)_j (0 if label < 0); writes dz = (softmax - q) * scale if dz,
 * argmax to *pred if pred. */
CNN_HD float cnn_softmax_xent_row(const float *z, int n, int label, float smooth,
                                  float scale, float *dz, int32_t *pred) {
  float mx = z[0];
  int am = 0;
  for (int j = 1; j < n; j++)
    if (z[j] > mx) {
      mx = z[j];
      am = j;
    }
  float sum = 0.0f;
  for (int j = 0; j < n; j++) sum += expf(z[j] - mx);
  float lse = logf(sum);
  const float off = smooth / (float)n, on = 1.0f - smooth + off;
  if (dz) {
    float inv = 1.0f / sum;
    for (int j = 0; j < n; j++)
      dz[j] = (expf(z[j] - mx) * inv - (j == label ? on : off)) * scale;
  }
  if (pred) *pred = am;
  if (label < 0) return 0.0f;
  float zsum = 0.0f; /* sum_j (z_j - mx): the uniform part of q */
  if (smooth != 0.0f)
    for (int j = 0; j < n; j++) zsum += z[j] - mx;
  return lse - (1.0f - smooth) * (z[label] - mx) - off * zsum;
}

/* ---- optimizer, decay ---- */
CNN_HD float cnn_sgd_elem(float w, float g, float lr) { return w - lr * g; }
CNN_HD float cnn_l2_grad(float dw, float w, float wd) { return dw + wd * w; }

#endif
