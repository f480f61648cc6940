/*
 * nn.h - the CIFAR-10 tutorial CNN (TensorFlow's classic cifar10 model),
 * forward and backward in C, behind a backend vtable (nn_backend.h).
 *
 * Network (input 3x24x24 float, NCHW, batch B):
 *   conv1 5x5x3->64 SAME +bias ReLU -> maxpool 3x3/2 SAME (24->12) -> LRN
 *   -> conv2 5x5x64->64 SAME +bias ReLU -> LRN -> maxpool 3x3/2 SAME (12->6)
 *   -> local3 2304->384 ReLU -> local4 384->192 ReLU -> softmax_linear 192->10
 *   -> softmax cross-entropy, mean over the batch,
 *   + 0.004 * sum(w^2)/2 for local3/weights and local4/weights.
 * LRN: depth radius 4, bias 1, alpha 0.001/9, beta 0.75 (TF semantics:
 * out_c = in_c / (1 + alpha * sum_{c'=c-4..c+4} in_c'^2)^0.75).
 * Built with lrn = 0, both LRN layers are left out (--no-lrn).
 *
 * Parameter layouts (row-major float32, the same as TensorFlow's, so the
 * values are interchangeable with a TF checkpoint):
 *   conv weights  [kh][kw][cin][cout]   (TF HWIO: conv1 [5,5,3,64])
 *   FC weights    [in][out]             (y = x W + b)
 *   local3 input  pool2 output flattened in (h, w, c) order: index
 *                 (h * 6 + w) * 64 + c, as TF's reshape of an NHWC tensor.
 * Inside, activations are NHWC; the images given to the model are NCHW.
 *
 * The model owns no parameter memory: the caller binds, for each parameter,
 * a host value buffer and a host gradient buffer (libpsclient ps_var
 * buffers). All functions of one cnn must be called from one thread at a
 * time; the backend runs its own worker threads inside each call.
 */
#ifndef CIFAR_NN_H
#define CIFAR_NN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "psclient.h" /* PS_INIT_* */

#ifdef __cplusplus
extern "C" {
#endif

/* Compute backend: allocation, host<->device copies and every layer op
 * (struct in nn_backend.h). */
typedef struct cnn_backend cnn_backend;

/* The CPU backend: OpenBLAS SGEMM for convolutions (im2col, NHWC) and FC
 * layers, hand-written loops for the rest. Each op is split into chunks
 * (groups of images, rows) run by the calling thread and threads-1 worker
 * threads of the backend's own (started on first use, kept for the
 * process); OpenBLAS itself is set to one thread (openblas_set_num_threads(1),
 * process-wide) and runs inside the chunks: on these small matrices
 * OpenBLAS's own threading measured slower. threads is clamped to 64. The
 * backend may be shared by several models; calls from different threads
 * are serialized op by op. Returns a
 * static object (never freed); NULL if threads < 1. */
const cnn_backend *cnn_backend_cpu(int threads);

/* The CUDA backend (nn_cuda.cu): every layer op as CUDA kernels, the
 * GEMMs (convolutions as im2col + GEMM, FC layers) through cuBLAS in
 * float32, all on one stream of GPU `device` (an index among the visible
 * devices), plus a copy stream for the parameter and gradient transfers.
 * Created on first use and kept for the process. Returns NULL with a
 * sentence in err (when err and errlen > 0) if there is no such device, no
 * usable driver, or the program was built without CUDA. Its ops must be
 * called from one thread at a time. */
const cnn_backend *cnn_backend_cuda(int device, char *err, size_t errlen);
/* CUDA devices visible to this process (CUDA_VISIBLE_DEVICES applies); 0
 * without a driver, without a device or built without CUDA. */
int cnn_cuda_device_count(void);
/* 1 if this process genuinely has no GPU: a build without CUDA, no driver
 * (libcuda.so.1 cannot be loaded, or it is the toolkit's stub), or the
 * driver reports no device (CUDA_VISIBLE_DEVICES applies). 0 when a driver
 * is loaded and reports a device, or fails in any other way (too old for
 * this runtime, a device that will not initialize): then a backend that
 * cannot start is an error to report, never "no GPU". why (may be NULL)
 * gets a sentence either way. */
int cnn_cuda_absent(char *why, size_t len);
/* Exit status of the example programs (cifar_worker, cnn_bench) when
 * --device gpu finds no GPU at all (cnn_cuda_absent): EX_UNAVAILABLE of
 * sysexits.h. A GPU that is there but cannot be used exits 1. */
#define CNN_EXIT_NO_GPU 69
/* Writes a device's name and memory ("NVIDIA H100 80GB HBM3, 79.1 GiB")
 * to buf; -1 if there is no such device. */
int cnn_cuda_device_name(int device, char *buf, size_t len);
/* The backend's name: "cpu" or "cuda". */
const char *cnn_backend_name(const cnn_backend *be);
/* 1 if this program was built with the CUDA backend. */
int cnn_cuda_built(void);

/* The GPU a worker uses among `count` visible ones: the only one if there
 * is one (Slurm's --gpus-per-task gives each task its own through
 * CUDA_VISIBLE_DEVICES), else the local rank (PS_LOCAL_RANK from psrun,
 * else SLURM_LOCALID, else 0) modulo count. *why (may be NULL) gets a
 * static phrase saying which rule chose. -1 if count < 1. */
int cnn_cuda_pick_device(int count, const char **why);

typedef struct cnn cnn;

/* One parameter tensor: name and shape as in the TF tutorial, initializer
 * as libpsclient's ps_init (init_kind is a ps_init_kind value; init_a =
 * constant / mean, init_b = stddev), and the L2 weight decay coefficient
 * the model applies to it (0 or 0.004). */
typedef struct cnn_param {
  const char *name;
  int ndim;
  int64_t shape[4];
  int init_kind;
  double init_a, init_b;
  double weight_decay;
} cnn_param;

#define CNN_NUM_PARAMS 10
#define CNN_IMAGE_SIZE 24     /* input images are 3 x 24 x 24 */
#define CNN_IMAGE_FLOATS (3 * 24 * 24)
#define CNN_NUM_CLASSES 10
#define CNN_MAX_BATCH 16384   /* largest max_batch cnn_create accepts */

/* Number of parameter tensors: 10, in this order: conv1/weights,
 * conv1/biases, conv2/weights, conv2/biases, local3/weights, local3/biases,
 * local4/weights, local4/biases, softmax_linear/weights,
 * softmax_linear/biases. */
int cnn_num_params(void);
/* Static description of parameter i (NULL if out of range). */
const cnn_param *cnn_param_info(int i);
/* Number of floats of parameter i (product of its shape); 0 if out of range. */
size_t cnn_param_numel(int i);

/* Creates a model on `be` with activations for up to max_batch images
 * (1..CNN_MAX_BATCH; allocated once, here: ~0.74 MB per image with LRN,
 * plus the backend's conv workspace). lrn: 1 = with the two LRN layers,
 * 0 = without. Returns 0 and *out, or -1 (bad arguments, out of memory). */
int cnn_create(const cnn_backend *be, int max_batch, int lrn, cnn **out);
void cnn_destroy(cnn *m); /* NULL ok */

/* Binds parameter i to caller-owned host buffers of cnn_param_numel(i)
 * floats: `value` (read by every step) and `grad` (written by
 * cnn_train_step). Every parameter must be bound before a step. */
void cnn_bind(cnn *m, int i, float *value, float *grad);

/* Forward + backward on B (1..max_batch) images (host float, B*3*24*24,
 * NCHW) with labels 0..9. Writes into the bound grad buffers the gradient
 * of the returned loss: mean cross-entropy over the batch plus the L2 terms
 * (weight decay gradients included). Returns NaN on bad arguments (B out
 * of range, a label > 9, NULL pointers, a parameter not bound), touching
 * nothing, and after a device error (cnn_error says which). On a device
 * backend the call returns when the gradients are in the bound buffers. */
float cnn_train_step(cnn *m, const float *images, const uint8_t *labels,
                     int B);

/* Forward only: writes the predicted classes (argmax of the logits) to
 * pred[0..B) (may be NULL) and returns the mean cross-entropy (no L2).
 * labels may be NULL (then returns 0). NaN on bad arguments. Does not
 * touch the gradients. */
float cnn_eval(cnn *m, const float *images, const uint8_t *labels, int B,
               int *pred);

/* Forward only: writes the logits, B rows of CNN_NUM_CLASSES floats, to
 * logits (host memory). For evaluation that combines several views of an
 * image. 0, or -1 on bad arguments or a device error (cnn_error). */
int cnn_eval_logits(cnn *m, const float *images, int B, float *logits);

/* Plain SGD on every bound parameter: value -= lr * grad (grad from the
 * last cnn_train_step). For running without a parameter server. On a
 * device backend it updates the device copy and copies it into the bound
 * value buffers, waiting for that, unless the values are kept on the
 * device (cnn_values_on_device): then it only queues the update. */
void cnn_sgd_local(cnn *m, float lr);

/* Device backends (no effect on the CPU): on = 1 copies the bound value
 * buffers to the device once; from then on the device copy is the
 * parameters: steps upload no values, cnn_sgd_local updates them there
 * with no copy and no wait (4.3 MB each way less per step), and the bound
 * value buffers are neither read nor written (cnn_bind of a new buffer
 * takes its values). on = 0 copies the device values back into the bound
 * buffers (waiting) and returns to uploading them every step. For local
 * training and benchmarks; a parameter-server worker, whose values change
 * in its buffers, leaves it off (the default). */
void cnn_values_on_device(cnn *m, int on);

/* Host memory for the inputs of cnn_train_step / cnn_eval: page-locked on
 * a device backend (the images are then copied by DMA straight from it,
 * overlapping other work), plain on the CPU; zero-filled; NULL on failure.
 * Free with cnn_host_free (NULL ok). */
void *cnn_host_alloc(const cnn_backend *be, size_t bytes);
void cnn_host_free(const cnn_backend *be, void *p);

/* Device backends record a training step as a graph (per batch size and
 * input buffers, after one step run op by op as a warm-up) and replay it
 * (default on); off: every op is launched each step. For measuring what
 * the graphs save. A recording or replay that fails is not an error: the
 * step runs op by op, graphs stay off for the model's life, the reason is
 * kept (cnn_get_run_info) and logged once on stderr. */
void cnn_use_graphs(cnn *m, int on);

/* Label smoothing of the training loss (Szegedy et al. 2016, as
 * torch.nn.CrossEntropyLoss(label_smoothing=)): each step's target is
 * (1 - smooth) onehot(label) + smooth / 10, and the loss it returns is
 * against that target. 0 (the default) is the plain one-hot loss;
 * cnn_eval always uses 0. Returns 0, or -1 when smooth is not in [0, 1). */
int cnn_set_label_smoothing(cnn *m, float smooth);

#define CNN_INFO_TEXT 256 /* room for a reason in cnn_run_info */

/* What the model's training steps really did (cnn_get_run_info). */
typedef struct cnn_run_info {
  long steps;            /* cnn_train_step calls that returned a loss */
  long eager_steps;      /* ... of which ran op by op */
  long graph_replays;    /* ... of which replayed a recorded graph */
  long graph_recordings; /* graphs recorded (one per batch and inputs) */
  long graph_failures;   /* recordings or replays that failed (each step
                            then ran op by op) */
  int graphs_broken;     /* 1: a failure turned graphs off for good */
  int pinned;            /* parameter and gradient buffers page-locked:
                            1 yes, 0 not (yet) tried or no device
                            backend, -1 page-locking failed */
  long pinned_ranges;    /* page ranges this model registered itself */
  long pinned_shared;    /* ranges it uses that another model registered */
  long pinned_staged;    /* buffers lying across two ranges (pages shared
                            with another model), copied through a
                            page-locked stand-in of the model's */
  char eager_why[CNN_INFO_TEXT]; /* why the last eager step was not a graph
                                    replay ("" if none was eager) */
  char graph_error[CNN_INFO_TEXT]; /* the backend's reason for the first
                                      failed recording or replay, "" */
  char pin_error[CNN_INFO_TEXT];   /* why page-locking failed, "" */
} cnn_run_info;

/* Fills *out with the model's counts and reasons so far (zeros for NULL m). */
void cnn_get_run_info(const cnn *m, cnn_run_info *out);

/* The backend's error (a sentence) after a step or evaluation returned
 * NaN for it, or NULL. */
const char *cnn_error(const cnn *m);

/* Floating-point operations (multiply-add = 2) of one training step on B
 * images counting the convolutions and FC layers only (for GFLOP/s). */
double cnn_train_flops(const cnn *m, int B);

/* Per-op timing of cnn_train_step / cnn_sgd_local: cnn_profile(m, 1)
 * resets and starts it (0 stops), cnn_profile_print writes ms per step and
 * share of each op. Costs a clock read per op (and a sync on devices). */
void cnn_profile(cnn *m, int on);
void cnn_profile_print(const cnn *m, FILE *f);
/* The profile's total: ms per step (0 before a profiled step). */
double cnn_profile_ms(const cnn *m);

#ifdef __cplusplus
}
#endif
#endif
