/*
 * nn_backend.h - the backend vtable the CNN model (nn_model.c) calls for
 * every allocation, copy and layer op. The CPU backend is nn_cpu.c; a CUDA
 * backend implements the same struct (its element-wise bodies can reuse the
 * per-element helpers of nn_ops.h).
 *
 * Conventions:
 *  - "Device" pointers come from be->alloc (for the CPU backend, plain host
 *    memory; host_mapped = 1 says device pointers ARE host pointers, so the
 *    model binds host buffers directly and skips copies).
 *  - Ops run in call order (a CUDA backend: one stream). to_host waits for
 *    everything queued before it; sync (NULL when ops are synchronous, as
 *    on the CPU) waits too. No op returns a value to the host: the loss
 *    terms land in device floats, so a whole step can be queued (and
 *    recorded as a CUDA graph) without waiting in the middle.
 *  - Activations are NHWC float32. Row-major matrices. Nothing is
 *    accumulated unless said so: outputs are overwritten.
 *  - The optional members (host memory, side-stream copies, graphs,
 *    smaller workspaces, fused ops) are NULL on the CPU backend; the
 *    model then does without them.
 */
#ifndef CIFAR_NN_BACKEND_H
#define CIFAR_NN_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Stride-1 SAME convolution of B images H x W x C (NHWC) with an R x R
 * kernel (R odd, padding (R-1)/2 on every side) into H x W x K. Weights
 * [R][R][C][K] (TF HWIO). */
typedef struct cnn_conv_geom {
  int B, H, W, C, K, R;
} cnn_conv_geom;

/* TF SAME max-pool, k x k window, stride s: OH = ceil(H/s); the padding
 * pad_total = max((OH-1)*s + k - H, 0) is split pad_before = pad_total/2
 * (top/left) and the rest after; padded positions never win. */
typedef struct cnn_pool_geom {
  int B, H, W, C, k, s;
  int OH, OW, pad_top, pad_left; /* derived: cnn_pool_geom_init */
} cnn_pool_geom;

/* Fills g (all fields) for the given input and window. */
void cnn_pool_geom_init(cnn_pool_geom *g, int B, int H, int W, int C, int k,
                        int s);

/* Local response normalization across channels (TF semantics). */
typedef struct cnn_lrn_param {
  int radius;  /* depth_radius: window c-radius..c+radius */
  float bias;  /* k */
  float alpha; /* per element (TF's alpha) */
  float beta;
} cnn_lrn_param;

struct cnn_backend {
  const char *name;
  int threads;     /* worker threads the ops use */
  int host_mapped; /* 1: device memory is host memory */

  /* ---- memory ---- */
  void *(*alloc)(const cnn_backend *be, size_t bytes); /* zero-filled; NULL on failure */
  void (*free)(const cnn_backend *be, void *p);        /* NULL ok */
  void (*to_device)(const cnn_backend *be, void *dst, const void *src,
                    size_t bytes);
  void (*to_host)(const cnn_backend *be, void *dst, const void *src,
                  size_t bytes);
  void (*sync)(const cnn_backend *be); /* may be NULL */

  /* ---- layout ---- */
  /* dst[b][h][w][c] = src[b][c][h][w] */
  void (*nchw_to_nhwc)(const cnn_backend *be, int B, int C, int H, int W,
                       const float *src, float *dst);

  /* ---- convolution (stride 1, SAME) ---- */
  /* Bytes of workspace the three conv ops need for geometry g (B = the
   * largest batch that will be used). Give each layer its own workspace:
   * conv_bwd_filter(g, x, ...) may reuse what conv_fwd(g, x, ...) left in
   * it (the CUDA backend's im2col of x), so between the two calls of a
   * step no other op may get that workspace, nor may x change. */
  size_t (*conv_ws_bytes)(const cnn_backend *be, const cnn_conv_geom *g);
  /* y = conv(x, w) + bias (bias may be NULL), then ReLU if relu. */
  void (*conv_fwd)(const cnn_backend *be, const cnn_conv_geom *g,
                   const float *x, const float *w, const float *bias,
                   int relu, float *y, void *ws);
  /* dw = dL/dw given dy = dL/dy (of the pre-bias/ReLU output);
   * db = sum of dy over B, H, W (db may be NULL). x: the input of the
   * forward (see conv_ws_bytes). */
  void (*conv_bwd_filter)(const cnn_backend *be, const cnn_conv_geom *g,
                          const float *x, const float *dy, float *dw,
                          float *db, void *ws);
  /* dx = dL/dx given dy. */
  void (*conv_bwd_data)(const cnn_backend *be, const cnn_conv_geom *g,
                        const float *dy, const float *w, float *dx, void *ws);

  /* ---- fully connected: x [M][K], w [K][N], y [M][N] ---- */
  /* y = x w + bias (bias may be NULL), then ReLU if relu. */
  void (*dense_fwd)(const cnn_backend *be, int M, int K, int N,
                    const float *x, const float *w, const float *bias,
                    int relu, float *y);
  /* dw = x^T dy, db = column sums of dy (may be NULL), dx = dy w^T (dx may
   * be NULL: not computed). */
  void (*dense_bwd)(const cnn_backend *be, int M, int K, int N,
                    const float *x, const float *w, const float *dy,
                    float *dx, float *dw, float *db);

  /* ---- element-wise ---- */
  /* dy[i] = y[i] > 0 ? dy[i] : 0  (y = ReLU output), in place. */
  void (*relu_bwd)(const cnn_backend *be, size_t n, const float *y,
                   float *dy);
  /* y = maxpool(x); arg[o] = index in x (flat, whole batch) of the winner. */
  void (*maxpool_fwd)(const cnn_backend *be, const cnn_pool_geom *g,
                      const float *x, float *y, int32_t *arg);
  /* dx = gradient w.r.t. x (overwritten, whole of x). If relu_x is not
   * NULL (the pool input, a ReLU output), dx is also masked by relu_x > 0:
   * the ReLU backward of the layer below, fused. */
  void (*maxpool_bwd)(const cnn_backend *be, const cnn_pool_geom *g,
                      const float *dy, const int32_t *arg,
                      const float *relu_x, float *dx);
  /* rows pixels of C channels: y = lrn(x); scale[i] = bias + alpha * window
   * sum of squares (kept for the backward). */
  void (*lrn_fwd)(const cnn_backend *be, size_t rows, int C,
                  const cnn_lrn_param *p, const float *x, float *y,
                  float *scale);
  /* dx from dy, x and scale of the forward; if relu_mask, dx is also
   * zeroed where x <= 0 (x a ReLU output: its backward, fused). */
  void (*lrn_bwd)(const cnn_backend *be, size_t rows, int C,
                  const cnn_lrn_param *p, const float *x, const float *scale,
                  const float *dy, int relu_mask, float *dx);
  /* Softmax cross-entropy of logits [B][N] against labels (device uint8).
   * The target of row b is q = (1 - smooth) onehot(labels[b]) + smooth / N
   * (label smoothing; 0: one-hot). Writes to *loss (a device float; NULL:
   * not computed) the SUM over the batch of -sum_j q_j log p_j. If dlogits
   * is not NULL: dlogits = (softmax - q) * grad_scale. If pred is not NULL:
   * pred[b] = argmax (device int32). labels may be NULL when dlogits is
   * NULL: the loss is then 0. */
  void (*softmax_xent)(const cnn_backend *be, int B, int N,
                       const float *logits, const uint8_t *labels,
                       float smooth, float grad_scale, float *dlogits,
                       int32_t *pred, float *loss);
  /* L2 weight decay: dw += wd * w; *loss = wd * sum(w^2) / 2 (a device
   * float; NULL: not computed). */
  void (*l2_decay)(const cnn_backend *be, size_t n, float wd, const float *w,
                   float *dw, float *loss);
  /* w -= lr * g */
  void (*sgd)(const cnn_backend *be, size_t n, float lr, const float *g,
              float *w);

  /* ---- optional: host memory, overlapped copies, graphs ---- */
  /* Page-locked host memory (copies from it overlap the ops and may be
   * recorded in graphs), zero-filled; NULL on failure. */
  void *(*host_alloc)(const cnn_backend *be, size_t bytes);
  void (*host_free)(const cnn_backend *be, void *p); /* NULL ok */
  /* Page-locks caller-owned host memory in place (whole pages); 0 or -1
   * (soft_error says why). Ranges must not share a page with a range
   * already registered (nn_pin.c shares them between models). */
  int (*host_register)(const cnn_backend *be, void *p, size_t bytes);
  void (*host_unregister)(const cnn_backend *be, void *p);
  /* 1 if p is page-locked host memory (host_alloc'd or registered). */
  int (*host_pinned)(const cnn_backend *be, const void *p);
  /* Copies on a second stream, overlapping the ops. upload_async starts a
   * host->device copy and tags it `slot` (0..CNN_BE_SLOTS-1); upload_wait
   * makes the ops queued after it wait for that copy. download_async
   * copies device->host what the ops queued so far have written, while the
   * ops queued after it run. sync waits for all of them. */
  void (*upload_async)(const cnn_backend *be, int slot, void *dst,
                       const void *src, size_t bytes);
  void (*upload_wait)(const cnn_backend *be, int slot);
  void (*download_async)(const cnn_backend *be, void *dst, const void *src,
                         size_t bytes);
  /* Graphs: between graph_begin (0, or -1: not now) and graph_end the ops
   * and copies are recorded, not run; graph_end returns a replayable graph
   * (NULL if recording failed: nothing ran, queue the ops again).
   * graph_launch queues one replay (0), or -1: nothing was queued and the
   * backend is as before the call, so queuing the ops works;
   * graph_free releases (NULL ok). */
  int (*graph_begin)(const cnn_backend *be);
  void *(*graph_end)(const cnn_backend *be);
  int (*graph_launch)(const cnn_backend *be, void *graph);
  void (*graph_free)(const cnn_backend *be, void *graph);
  /* Why the last graph_begin, graph_end, graph_launch or host_register
   * failed (a sentence naming the call), or NULL. Those failures are not
   * errors of the ops: they leave error() alone, and the model runs the
   * step op by op (and copies through the driver's staging). NULL member:
   * no reasons kept. */
  const char *(*soft_error)(const cnn_backend *be);
  /* The first error an op or copy ran into since the backend started (a
   * sentence), or NULL. Ops after an error do nothing. */
  const char *(*error)(const cnn_backend *be);

  /* ---- optional: smaller workspaces, fused ops (NULL: without) ---- */
  /* Bytes of workspace for conv_fwd and conv_bwd_filter only, for a layer
   * whose data gradient is never computed (its input is the data); NULL:
   * conv_ws_bytes. conv_bwd_data must not get such a workspace. */
  size_t (*conv_ws_fwd_bytes)(const cnn_backend *be, const cnn_conv_geom *g);
  /* The ReLU backward and the bias gradient of an FC layer in one pass:
   * dy[r][k] = y[r][k] > 0 ? dy[r][k] : 0 in place (y the ReLU output,
   * [rows][K]) and db[k] = sum over the rows of the masked dy. Same result
   * as relu_bwd, then dense_bwd's db. */
  void (*relu_bwd_bias)(const cnn_backend *be, int rows, int K,
                        const float *y, float *dy, float *db);
};

/* Copy tags of upload_async: one per parameter, the images, the labels. */
#define CNN_BE_SLOTS 16

#ifdef __cplusplus
}
#endif
#endif
