/*
 * nn_cuda.cu - the CUDA backend of the CNN (nn_backend.h, nn.h:
 * cnn_backend_cuda).
 *
 * Convolutions: im2col of a chunk of up to 128 images into the layer's
 * workspace, then one cuBLAS SGEMM per chunk: y[pix][K] = col[pix][R*R*C]
 * * w[R*R*C][K] with TF's HWIO weights as they are. The im2col kernels
 * move the C contiguous channels of each (pixel, kh, kw) as float4 where
 * C % 4 == 0 (neighbouring threads on neighbouring 16-byte vectors, so
 * reads and writes coalesce), one float per thread otherwise (conv1's
 * C = 3), and are instantiated with the model's geometries as
 * compile-time constants (no run-time integer division per element; any
 * other geometry takes the generic instantiation). Each col row ends in a
 * column of ones (padded to a multiple of 4 floats): the filter-gradient
 * GEMM col^T * dy then yields the bias gradient as an extra row, with no
 * pass of its own over dy. The filter gradient walks the chunks last
 * first and reuses the col the forward left in the workspace (the whole
 * col for a batch of 128 or fewer: conv2's forward im2col is not redone),
 * which is why each layer has its own workspace (what a workspace holds
 * is tracked on the host as the ops are queued, so a recorded graph
 * replays the same choice). The data gradient is the
 * forward convolution of dy with the flipped, C/K-transposed weights (as
 * in nn_cpu.c); conv1 gets none, and its workspace no room for one (22 MB
 * at 128 images). Bias and ReLU are one float4 epilogue kernel after the
 * GEMM (cuBLAS itself has no epilogue; cublasLt's would save that pass
 * too); an FC layer's ReLU backward is fused with its bias gradient
 * (relu_bwd_bias). cuBLAS runs in float32 (its default math mode: no
 * TF32).
 *
 * Element-wise and reduction kernels are grid-stride loops around the
 * per-element bodies of nn_cuda_ops.h (which tests/test_cuda_ops.c also
 * runs on the CPU). Reductions (bias gradients, the L2 term, the
 * cross-entropy sum) run in levels of short per-thread sums through a
 * scratch buffer, with a fixed order: results are the same every run.
 *
 * Streams: every op is queued on one stream; host<->device copies that the
 * model overlaps (upload_async, download_async) run on a second one,
 * ordered by events. A step can be recorded as a CUDA graph (stream
 * capture of both streams) and replayed. Device memory is allocated when
 * the model is created, never per step; cuBLAS gets a fixed workspace so
 * it allocates nothing while a graph is recorded.
 *
 * Errors: the first failing CUDA or cuBLAS call is kept as a sentence
 * (be->error); later ops do nothing, and the model's step returns NaN.
 * Sticky on purpose, and for the whole backend: there is one per device,
 * shared by every model of the process and queueing on one stream, so a
 * failed call leaves every model's queued step half done, and a device
 * fault (an illegal address) leaves the CUDA context itself unusable.
 * Allocation then fails too (cnn_create returns -1); the program reports
 * be->error and exits rather than compute on.
 * A failed graph recording or replay and a failed cudaHostRegister are
 * not such errors: their reason goes to be->soft_error, the ops go on
 * and the model runs the step op by op.
 *
 * cuBLAS is opened with dlopen when the first GPU backend is created, not
 * linked: libcublasLt alone is 540 MB, and mapping it made every start of
 * a CPU-only run (and of each test worker) 0.3 s slower, 5 s from a cold
 * page cache. A missing library is then an error sentence, not a loader
 * failure. The CUDA runtime is linked statically.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn.h"
#include "nn_backend.h"
#include "nn_cuda_ops.h"

#define CUDA_MAX_DEVICES 64    /* backends kept, one per device index */
#define THREADS 256            /* threads per block of every kernel */
#define BLOCKS_PER_SM 16       /* grid-stride grids: enough to fill an SM */
#define MAX_ELEMS (1 << 30)    /* int indices (nn_cuda_ops.h) with room for
                                  the grid stride */
#define CONV_CHUNK_IMAGES 128  /* images per im2col + GEMM: bounds the
                                  workspace whatever the batch (conv2's col
                                  is 118 MB per 128 images) while keeping
                                  GEMMs of 18432+ rows, enough to fill a GPU */
#define RED_REGION (1 << 20)   /* floats per scratch region of reductions:
                                  partials of 73728 rows x 64 columns fit */
#define BLAS_WS_BYTES (32u << 20) /* cuBLAS workspace, fixed so that graph
                                     recording allocates nothing */
#define ERR_LEN 320            /* room for the error sentence */

typedef struct cuda_be {
  cnn_backend be;              /* the vtable; first, so ops cast back */
  int dev;                     /* device index */
  int sms;                     /* multiprocessors (grid sizes) */
  cudaStream_t s;              /* every op */
  cudaStream_t side;           /* overlapped copies */
  cublasHandle_t blas;         /* bound to s */
  void *blas_ws;               /* cuBLAS workspace */
  float *scratch;              /* 3 regions of RED_REGION floats */
  const float *kept_col;       /* col buffer (in a conv workspace) that */
  const float *kept_x;         /* ... holds the im2col of this input */
  cnn_conv_geom kept_g;        /* ... for this geometry */
  int kept_b0;                 /* ... from this image on (one chunk) */
  cudaEvent_t up[CNN_BE_SLOTS]; /* end of each tagged upload */
  cudaEvent_t fork;            /* main stream position the side one waits for */
  cudaEvent_t join;            /* end of the side stream's work (capture) */
  int capturing;               /* between graph_begin and graph_end */
  int side_captured;           /* the side stream joined this capture */
  int capture_failed;          /* a call failed while recording */
  char soft[ERR_LEN];          /* soft_error: why the last graph call or
                                  host_register failed, "" if none */
  char err[ERR_LEN];           /* first error, "" if none */
} cuda_be;

/* ------------------------------------------------------ cuBLAS (dlopen) */

#define STR_(x) #x
#define STR(x) STR_(x)
#define CUBLAS_SONAME "libcublas.so." STR(CUBLAS_VER_MAJOR)
#ifndef CNN_CUBLAS_DIR
#define CNN_CUBLAS_DIR "/usr/local/cuda/lib64" /* the toolkit's, when not set */
#endif

/* The cuBLAS entry points the backend uses. */
static struct {
  void *lib;                                    /* dlopen handle */
  decltype(&cublasCreate_v2) create;            /* cublasCreate */
  decltype(&cublasDestroy_v2) destroy;          /* cublasDestroy */
  decltype(&cublasSetStream_v2) set_stream;     /* cublasSetStream */
  decltype(&cublasSetWorkspace_v2) set_workspace; /* cublasSetWorkspace */
  decltype(&cublasSetMathMode) set_math_mode;   /* cublasSetMathMode */
  decltype(&cublasSgemm_v2) sgemm;              /* cublasSgemm */
  decltype(&cublasGetStatusString) status_string; /* cublasGetStatusString */
} blas;

/* Opens cuBLAS once (the caller holds backends_mu); 0 or -1 with err. */
static int blas_load(char *err, size_t errlen) {
  if (blas.lib) return 0;
  void *lib = dlopen(CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (!lib) lib = dlopen(CNN_CUBLAS_DIR "/" CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    if (err && errlen)
      snprintf(err, errlen, "cannot load %s (searched the library path and %s): %s",
               CUBLAS_SONAME, CNN_CUBLAS_DIR, dlerror());
    return -1;
  }
#define SYM(field, name)                                                  \
  if (!(*(void **)&blas.field = dlsym(lib, name))) {                      \
    if (err && errlen)                                                    \
      snprintf(err, errlen, "%s has no %s: %s", CUBLAS_SONAME, name, dlerror()); \
    dlclose(lib);                                                         \
    return -1;                                                            \
  }
  SYM(create, "cublasCreate_v2")
  SYM(destroy, "cublasDestroy_v2")
  SYM(set_stream, "cublasSetStream_v2")
  SYM(set_workspace, "cublasSetWorkspace_v2")
  SYM(set_math_mode, "cublasSetMathMode")
  SYM(sgemm, "cublasSgemm_v2")
  SYM(status_string, "cublasGetStatusString")
#undef SYM
  blas.lib = lib;
  return 0;
}

static cuda_be *backends[CUDA_MAX_DEVICES];
static pthread_mutex_t backends_mu = PTHREAD_MUTEX_INITIALIZER;

static cuda_be *CB(const cnn_backend *be) { return (cuda_be *)be; }

/* A failure that is not an error of the ops (a graph call, page-locking):
 * kept for soft_error, be->error untouched. */
static void soft(cuda_be *cb, const char *what, const char *why) {
  snprintf(cb->soft, sizeof cb->soft, "CUDA device %d: %s failed: %s", cb->dev,
           what, why);
}

/* Records a failed call: while recording a graph it only spoils the
 * recording (the step then runs eagerly; the first such call is the
 * recording's soft_error); otherwise it is kept. */
static int fail(cuda_be *cb, const char *what, const char *why) {
  if (cb->capturing) {
    if (!cb->capture_failed) soft(cb, what, why);
    cb->capture_failed = 1;
    return -1;
  }
  if (!cb->err[0])
    snprintf(cb->err, sizeof cb->err, "CUDA device %d: %s failed: %s", cb->dev,
             what, why);
  return -1;
}

static int ck(cuda_be *cb, cudaError_t e, const char *what) {
  if (e == cudaSuccess) return 0;
  cudaGetLastError(); /* clear it, so later launches are not blamed */
  return fail(cb, what, cudaGetErrorString(e));
}

static int ckb(cuda_be *cb, cublasStatus_t st, const char *what) {
  if (st == CUBLAS_STATUS_SUCCESS) return 0;
  return fail(cb, what, blas.status_string(st));
}

/* Op entry: 0 to go on, -1 after an error (the op does nothing). */
static int enter(cuda_be *cb) {
  if (cb->err[0]) return -1;
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess || cur != cb->dev)
    return ck(cb, cudaSetDevice(cb->dev), "cudaSetDevice");
  return 0;
}

static int blocks_for(const cuda_be *cb, long n) {
  long b = (n + THREADS - 1) / THREADS, cap = (long)cb->sms * BLOCKS_PER_SM;
  if (b > cap) b = cap;
  return b < 1 ? 1 : (int)b;
}

static int too_big(cuda_be *cb, size_t n, const char *what) {
  if (n < (size_t)MAX_ELEMS) return 0;
  return fail(cb, what, "more than 2^30 elements");
}

/* Launches kernel over n indices on the op stream. */
#define LAUNCH(cb, n, kernel, ...)                                        \
  do {                                                                    \
    size_t n_ = (n);                                                      \
    if (n_ > 0 && !too_big(cb, n_, #kernel)) {                            \
      kernel<<<blocks_for(cb, (long)n_), THREADS, 0, (cb)->s>>>((int)n_,  \
                                                                __VA_ARGS__); \
      ck(cb, cudaGetLastError(), #kernel);                                \
    }                                                                     \
  } while (0)

#define GRID_LOOP(i, n) \
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += blockDim.x * gridDim.x)

/* ---------------------------------------------------------------- kernels */

__global__ void k_nhwc(int n, int C, int H, int W, const float *src,
                       float *dst) {
  GRID_LOOP(i, n) dst[i] = cnn_e_nhwc(i, C, H, W, src);
}

__global__ void k_bias_act(int n, int K, float *y, const float *bias,
                           int relu) {
  GRID_LOOP(i, n) y[i] = cnn_e_bias_act(i, K, y, bias, relu);
}

/* The forward epilogue four channels per thread (K % 4 == 0); K_ > 0: K
 * is that constant (the conv layers' 64), so v % (K / 4) is a mask. */
template <int K_>
__global__ void k_bias_act4(int n, int K, float4 *y, const float4 *bias,
                            int relu) {
  if (K_) K = K_;
  GRID_LOOP(v, n) y[v] = cnn_e_bias_act4(v, K, y, bias, relu);
}

/* im2col (nn_cuda_ops.h). H_ > 0: the geometry is those constants (the
 * model's layers), so the body's index divisions become multiplies; 0:
 * the run-time arguments (any other geometry). */
template <int H_, int W_, int C_, int R_>
__global__ void k_im2col4(int n, int H, int W, int C, int R, const float4 *x,
                          float4 *col) {
  if (H_) {
    H = H_;
    W = W_;
    C = C_;
    R = R_;
  }
  GRID_LOOP(v, n) col[v] = cnn_e_im2col4(v, H, W, C, R, x);
}

template <int H_, int W_, int C_, int R_>
__global__ void k_im2col1(int n, int H, int W, int C, int R, const float *x,
                          float *col) {
  if (H_) {
    H = H_;
    W = W_;
    C = C_;
    R = R_;
  }
  GRID_LOOP(i, n) col[i] = cnn_e_im2col1(i, H, W, C, R, x);
}

/* The specializations launched (LAUNCH is a macro: no commas in names). */
#define k_im2col4_conv2 k_im2col4<12, 12, 64, 5> /* conv2, its data gradient */
#define k_im2col4_any k_im2col4<0, 0, 0, 0>
#define k_im2col1_conv1 k_im2col1<24, 24, 3, 5>
#define k_im2col1_any k_im2col1<0, 0, 0, 0>
#define k_bias_act4_64 k_bias_act4<64>
#define k_bias_act4_any k_bias_act4<0>

__global__ void k_flip(int n, int R, int C, int K, const float *w,
                       float *wf) {
  GRID_LOOP(i, n) wf[i] = cnn_e_flip(i, R, C, K, w);
}

__global__ void k_relu_bwd(int n, const float *y, float *dy) {
  GRID_LOOP(i, n) dy[i] = cnn_relu_bwd(y[i], dy[i]);
}

__global__ void k_maxpool_fwd(int n, cnn_pool_geom g, const float *x,
                              float *y, int32_t *arg) {
  GRID_LOOP(o, n) cnn_e_maxpool_fwd(o, &g, x, y, arg);
}

__global__ void k_maxpool_bwd(int n, cnn_pool_geom g, const float *dy,
                              const int32_t *arg, const float *relu_x,
                              float *dx) {
  GRID_LOOP(i, n) dx[i] = cnn_e_maxpool_bwd(i, &g, dy, arg, relu_x);
}

__global__ void k_lrn_fwd(int n, int C, cnn_lrn_param p, const float *x,
                          float *y, float *scale) {
  GRID_LOOP(i, n) cnn_e_lrn_fwd(i, C, &p, x, y, scale);
}

__global__ void k_lrn_bwd(int n, int C, cnn_lrn_param p, const float *x,
                          const float *scale, const float *dy, int relu,
                          float *dx) {
  GRID_LOOP(i, n) dx[i] = cnn_e_lrn_bwd(i, C, &p, x, scale, dy, relu);
}

__global__ void k_colsum(int n, const float *x, int rows, int K, int J,
                         float scale, float *out) {
  GRID_LOOP(i, n) out[i] = scale * cnn_e_colsum(i, x, rows, K, J);
}

__global__ void k_colsum_relu(int n, const float *y, float *dy, int rows,
                              int K, int J, float scale, float *out) {
  GRID_LOOP(i, n) out[i] = scale * cnn_e_colsum_relu(i, y, dy, rows, K, J);
}

__global__ void k_l2(int n, int len, float wd, const float *w, float *dw,
                     float *part) {
  GRID_LOOP(j, n) part[j] = cnn_e_l2(j, n, len, wd, w, dw);
}

__global__ void k_xent(int n, int N, const float *logits,
                       const uint8_t *labels, float smooth, float scale,
                       float *dlogits, int32_t *pred, float *rowloss) {
  GRID_LOOP(b, n) rowloss[b] = cnn_e_xent(b, N, logits, labels, smooth,
                                          scale, dlogits, pred);
}

__global__ void k_sgd(int n, float lr, const float *g, float *w) {
  GRID_LOOP(i, n) w[i] = cnn_sgd_elem(w[i], g[i], lr);
}

/* ------------------------------------------------------------ reductions */

static float *region(cuda_be *cb, int r) { return cb->scratch + (size_t)r * RED_REGION; }

/* out[k] = scale * sum over the n rows of x [n][K], in levels
 * (nn_cuda_ops.h); x may be scratch region 0. If relu_y is not NULL, the
 * first level also masks x in place where relu_y <= 0 (the ReLU backward,
 * fused: cnn_e_colsum_relu). */
static void colsum_masked(cuda_be *cb, float *x, const float *relu_y, int n,
                          int K, float scale, float *out) {
  if (K > RED_REGION) {
    fail(cb, "colsum", "too many columns for the reduction scratch");
    return;
  }
  const float *src = x;
  for (int level = 0;; level++) {
    int J = cnn_red_slices(n, K, RED_REGION);
    float *dst = J == 1 ? out : region(cb, 1 + level % 2);
    float sc = J == 1 ? scale : 1.0f;
    if (level == 0 && relu_y)
      LAUNCH(cb, (size_t)J * K, k_colsum_relu, relu_y, x, n, K, J, sc, dst);
    else
      LAUNCH(cb, (size_t)J * K, k_colsum, src, n, K, J, sc, dst);
    if (J == 1) return;
    src = dst;
    n = J;
  }
}

static void colsum(cuda_be *cb, const float *x, int n, int K, float scale,
                   float *out) {
  colsum_masked(cb, (float *)x, NULL, n, K, scale, out); /* x not written */
}

/* ------------------------------------------------------------- memory */

static void *cu_alloc(const cnn_backend *be, size_t bytes) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return NULL;
  void *p = NULL;
  if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
    cudaGetLastError(); /* out of memory: the caller says so */
    return NULL;
  }
  if (ck(cb, cudaMemsetAsync(p, 0, bytes, cb->s), "cudaMemsetAsync") ||
      ck(cb, cudaStreamSynchronize(cb->s), "cudaStreamSynchronize")) {
    cudaFree(p);
    return NULL;
  }
  return p;
}

static void cu_free(const cnn_backend *be, void *p) {
  if (!p) return;
  CB(be)->kept_col = NULL; /* a new buffer may get a kept input's address */
  cudaSetDevice(CB(be)->dev);
  cudaFree(p);
}

static void cu_to_device(const cnn_backend *be, void *dst, const void *src,
                         size_t bytes) {
  cuda_be *cb = CB(be);
  if (enter(cb) || !bytes) return;
  if (!ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cb->s),
          "cudaMemcpyAsync (to the device)"))
    ck(cb, cudaStreamSynchronize(cb->s), "cudaStreamSynchronize");
}

static void cu_to_host(const cnn_backend *be, void *dst, const void *src,
                       size_t bytes) {
  cuda_be *cb = CB(be);
  if (enter(cb) || !bytes) return;
  if (!ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->s),
          "cudaMemcpyAsync (to the host)"))
    ck(cb, cudaStreamSynchronize(cb->s), "cudaStreamSynchronize");
}

static void cu_sync(const cnn_backend *be) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  ck(cb, cudaStreamSynchronize(cb->side), "cudaStreamSynchronize (copies)");
  ck(cb, cudaStreamSynchronize(cb->s), "cudaStreamSynchronize");
}

/* ------------------------------------------------------------ layout */

static void cu_nchw_to_nhwc(const cnn_backend *be, int B, int C, int H, int W,
                            const float *src, float *dst) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  LAUNCH(cb, (size_t)B * C * H * W, k_nhwc, C, H, W, src, dst);
}

/* --------------------------------------------------------------- GEMM */

/* Row-major C[M][N] = op(A) op(B) + beta C, as the column-major product
 * C^T = op(B)^T op(A)^T that cuBLAS computes. */
static void gemm(cuda_be *cb, int ta, int tb, int M, int N, int K,
                 const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
  const float one = 1.0f;
  ckb(cb,
      blas.sgemm(cb->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                  ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &one, B, ldb, A,
                  lda, &beta, C, ldc),
      "cublasSgemm");
}

/* ---------------------------------------------------------- convolution */

static int chunk_images(const cnn_conv_geom *g) {
  return g->B < CONV_CHUNK_IMAGES ? (g->B > 0 ? g->B : 1) : CONV_CHUNK_IMAGES;
}

static size_t align256(size_t b) { return (b + 255) / 256 * 256; }

/* Workspace of one layer: the filter-gradient GEMM's output [R*R*C+1][K]
 * (the weights' rows, then the bias row: see the ones column of
 * nn_cuda_ops.h), the col buffer of a chunk, then, only where the data
 * gradient is computed, the flipped weights. The col buffer holds the
 * forward's rows (cnn_col_ld(R, C) floats each) and the data gradient's
 * (cnn_col_ld(R, K)), room for the larger only where both are needed:
 * conv1 (C 3, no data gradient) at 128 images takes 22.4 MB, not the
 * 472 MB a K-wide col would. */
static size_t dwx_bytes(const cnn_conv_geom *g) {
  return align256(((size_t)g->R * g->R * g->C + 1) * g->K * sizeof(float));
}

static size_t col_bytes(const cnn_conv_geom *g, int dgrad) {
  size_t ld = (size_t)cnn_col_ld(g->R, g->C), ldk = (size_t)cnn_col_ld(g->R, g->K);
  if (dgrad && ldk > ld) ld = ldk;
  return align256((size_t)chunk_images(g) * g->H * g->W * ld * sizeof(float));
}

static size_t ws_bytes(const cnn_conv_geom *g, int dgrad) {
  size_t flip = (size_t)g->R * g->R * g->C * g->K * sizeof(float);
  return dwx_bytes(g) + col_bytes(g, dgrad) + (dgrad ? align256(flip) : 0);
}

static size_t cu_conv_ws_bytes(const cnn_backend *be, const cnn_conv_geom *g) {
  (void)be;
  return ws_bytes(g, 1);
}

static size_t cu_conv_ws_fwd_bytes(const cnn_backend *be,
                                   const cnn_conv_geom *g) {
  (void)be;
  return ws_bytes(g, 0);
}

static float *ws_dwx(void *ws) { return (float *)ws; }
static float *ws_col(const cnn_conv_geom *g, void *ws) {
  return (float *)((char *)ws + dwx_bytes(g));
}
static float *ws_flip(const cnn_conv_geom *g, void *ws) {
  return (float *)((char *)ws_col(g, ws) + col_bytes(g, 1));
}

/* 1 if col holds the im2col of images [b0, ...) of x for g (left there by
 * a forward): the filter gradient then skips its own. */
static int col_kept(const cuda_be *cb, const float *col, const float *x,
                    const cnn_conv_geom *g, int b0) {
  return cb->kept_col == col && cb->kept_x == x && cb->kept_b0 == b0 &&
         memcmp(&cb->kept_g, g, sizeof *g) == 0;
}

/* col = im2col of images [b0, b0 + nb) of x (nn_cuda_ops.h): float4 moves
 * where C % 4 == 0, the model's geometries as compile-time constants. */
static void im2col(cuda_be *cb, const cnn_conv_geom *g, int b0, int nb,
                   const float *x, float *col) {
  int H = g->H, W = g->W, C = g->C, R = g->R;
  const float *xs = x + (size_t)b0 * H * W * C;
  size_t n = (size_t)nb * H * W * cnn_col_ld(R, C);
  if (C % 4 == 0 && (uintptr_t)xs % 16 == 0 && (uintptr_t)col % 16 == 0) {
    const float4 *x4 = (const float4 *)xs;
    float4 *c4 = (float4 *)col;
    if (H == 12 && W == 12 && C == 64 && R == 5)
      LAUNCH(cb, n / 4, k_im2col4_conv2, H, W, C, R, x4, c4);
    else
      LAUNCH(cb, n / 4, k_im2col4_any, H, W, C, R, x4, c4);
  } else if (H == 24 && W == 24 && C == 3 && R == 5) {
    LAUNCH(cb, n, k_im2col1_conv1, H, W, C, R, xs, col);
  } else {
    LAUNCH(cb, n, k_im2col1_any, H, W, C, R, xs, col);
  }
  cb->kept_col = col;
  cb->kept_x = x;
  cb->kept_g = *g;
  cb->kept_b0 = b0;
}

/* The forward epilogue y [rows][K] = act(y + bias): four channels per
 * thread where the buffers allow. */
static void bias_act(cuda_be *cb, size_t rows, int K, float *y,
                     const float *bias, int relu) {
  if (!bias && !relu) return;
  size_t n = rows * K;
  if (K % 4 == 0 && (uintptr_t)y % 16 == 0 && (uintptr_t)bias % 16 == 0) {
    float4 *y4 = (float4 *)y;
    const float4 *b4 = (const float4 *)bias;
    if (K == 64)
      LAUNCH(cb, n / 4, k_bias_act4_64, K, y4, b4, relu);
    else
      LAUNCH(cb, n / 4, k_bias_act4_any, K, y4, b4, relu);
  } else {
    LAUNCH(cb, n, k_bias_act, K, y, bias, relu);
  }
}

/* y = conv(x, w) [+ bias, ReLU] chunk by chunk through col. */
static void conv_fwd_impl(cuda_be *cb, const cnn_conv_geom *g, const float *x,
                          const float *w, const float *bias, int relu,
                          float *y, float *col) {
  int RRC = g->R * g->R * g->C, ld = cnn_col_ld(g->R, g->C), K = g->K,
      HW = g->H * g->W;
  int n = chunk_images(g);
  for (int b0 = 0; b0 < g->B; b0 += n) {
    int nb = g->B - b0 < n ? g->B - b0 : n, rows = nb * HW;
    im2col(cb, g, b0, nb, x, col);
    gemm(cb, 0, 0, rows, K, RRC, col, ld, w, K, 0.0f,
         y + (size_t)b0 * HW * K, K);
  }
  bias_act(cb, (size_t)g->B * HW, K, y, bias, relu);
}

static void cu_conv_fwd(const cnn_backend *be, const cnn_conv_geom *g,
                        const float *x, const float *w, const float *bias,
                        int relu, float *y, void *ws) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  conv_fwd_impl(cb, g, x, w, bias, relu, y, ws_col(g, ws));
}

/* dw = col^T dy over the chunks, last chunk first: that one is still in
 * col from the forward (col_kept), so a batch of one chunk (128 images or
 * fewer) needs no im2col here. With db, col's ones column makes the same
 * GEMM produce the bias gradient as an extra row (into the workspace,
 * then copied out): no separate pass over dy. */
static void cu_conv_bwd_filter(const cnn_backend *be, const cnn_conv_geom *g,
                               const float *x, const float *dy, float *dw,
                               float *db, void *ws) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  int RRC = g->R * g->R * g->C, ld = cnn_col_ld(g->R, g->C), K = g->K,
      HW = g->H * g->W;
  int n = chunk_images(g);
  float *col = ws_col(g, ws), *out = db ? ws_dwx(ws) : dw;
  if (g->B < 1) {
    ck(cb, cudaMemsetAsync(dw, 0, (size_t)RRC * K * sizeof(float), cb->s),
       "cudaMemsetAsync");
    if (db) ck(cb, cudaMemsetAsync(db, 0, K * sizeof(float), cb->s), "cudaMemsetAsync");
    return;
  }
  for (int b0 = (g->B - 1) / n * n, first = 1; b0 >= 0; b0 -= n, first = 0) {
    int nb = g->B - b0 < n ? g->B - b0 : n, rows = nb * HW;
    if (!col_kept(cb, col, x, g, b0)) im2col(cb, g, b0, nb, x, col);
    gemm(cb, 1, 0, db ? RRC + 1 : RRC, K, rows, col, ld,
         dy + (size_t)b0 * HW * K, K, first ? 0.0f : 1.0f, out, K);
  }
  if (db &&
      !ck(cb, cudaMemcpyAsync(dw, out, (size_t)RRC * K * sizeof(float),
                              cudaMemcpyDeviceToDevice, cb->s),
          "cudaMemcpyAsync (filter gradient)"))
    ck(cb, cudaMemcpyAsync(db, out + (size_t)RRC * K, K * sizeof(float),
                           cudaMemcpyDeviceToDevice, cb->s),
       "cudaMemcpyAsync (bias gradient)");
}

static void cu_conv_bwd_data(const cnn_backend *be, const cnn_conv_geom *g,
                             const float *dy, const float *w, float *dx,
                             void *ws) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  float *wf = ws_flip(g, ws);
  LAUNCH(cb, (size_t)g->R * g->R * g->C * g->K, k_flip, g->R, g->C, g->K, w,
         wf);
  cnn_conv_geom gt = *g;
  gt.C = g->K;
  gt.K = g->C;
  /* col_bytes(g, 1) has room for dy's rows too */
  conv_fwd_impl(cb, &gt, dy, wf, NULL, 0, dx, ws_col(g, ws));
}

/* -------------------------------------------------------------- dense */

static void cu_dense_fwd(const cnn_backend *be, int M, int K, int N,
                         const float *x, const float *w, const float *bias,
                         int relu, float *y) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  gemm(cb, 0, 0, M, N, K, x, K, w, N, 0.0f, y, N);
  bias_act(cb, (size_t)M, N, y, bias, relu);
}

static void cu_dense_bwd(const cnn_backend *be, int M, int K, int N,
                         const float *x, const float *w, const float *dy,
                         float *dx, float *dw, float *db) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  gemm(cb, 1, 0, K, N, M, x, K, dy, N, 0.0f, dw, N);
  if (dx) gemm(cb, 0, 1, M, K, N, dy, N, w, N, 0.0f, dx, K);
  if (db) colsum(cb, dy, M, N, 1.0f, db);
}

/* ReLU backward + bias gradient: the first level of db's sum masks dy. */
static void cu_relu_bwd_bias(const cnn_backend *be, int rows, int K,
                             const float *y, float *dy, float *db) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  if (db) colsum_masked(cb, dy, y, rows, K, 1.0f, db);
  else LAUNCH(cb, (size_t)rows * K, k_relu_bwd, y, dy);
}

/* --------------------------------------------------------- element-wise */

static void cu_relu_bwd(const cnn_backend *be, size_t n, const float *y,
                        float *dy) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  LAUNCH(cb, n, k_relu_bwd, y, dy);
}

static void cu_maxpool_fwd(const cnn_backend *be, const cnn_pool_geom *g,
                           const float *x, float *y, int32_t *arg) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  LAUNCH(cb, (size_t)g->B * g->OH * g->OW * g->C, k_maxpool_fwd, *g, x, y, arg);
}

static void cu_maxpool_bwd(const cnn_backend *be, const cnn_pool_geom *g,
                           const float *dy, const int32_t *arg,
                           const float *relu_x, float *dx) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  LAUNCH(cb, (size_t)g->B * g->H * g->W * g->C, k_maxpool_bwd, *g, dy, arg,
         relu_x, dx);
}

static void cu_lrn_fwd(const cnn_backend *be, size_t rows, int C,
                       const cnn_lrn_param *p, const float *x, float *y,
                       float *scale) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  LAUNCH(cb, rows * C, k_lrn_fwd, C, *p, x, y, scale);
}

static void cu_lrn_bwd(const cnn_backend *be, size_t rows, int C,
                       const cnn_lrn_param *p, const float *x,
                       const float *scale, const float *dy, int relu_mask,
                       float *dx) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  LAUNCH(cb, rows * C, k_lrn_bwd, C, *p, x, scale, dy, relu_mask, dx);
}

static void cu_softmax_xent(const cnn_backend *be, int B, int N,
                            const float *logits, const uint8_t *labels,
                            float smooth, float grad_scale, float *dlogits,
                            int32_t *pred, float *loss) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  if (B > RED_REGION) {
    fail(cb, "softmax_xent", "batch larger than the reduction scratch");
    return;
  }
  float *rowloss = region(cb, 0);
  LAUNCH(cb, (size_t)B, k_xent, N, logits, labels, smooth, grad_scale, dlogits,
         pred, rowloss);
  if (loss) colsum(cb, rowloss, B, 1, 1.0f, loss);
}

static void cu_l2_decay(const cnn_backend *be, size_t n, float wd,
                        const float *w, float *dw, float *loss) {
  cuda_be *cb = CB(be);
  if (enter(cb) || too_big(cb, n, "l2_decay")) return;
  /* the first level updates dw as it reads w */
  int J = cnn_red_slices((int)n, 1, RED_REGION);
  float *part = region(cb, 0);
  LAUNCH(cb, (size_t)J, k_l2, (int)n, wd, w, dw, part);
  if (loss) colsum(cb, part, J, 1, 0.5f * wd, loss);
}

static void cu_sgd(const cnn_backend *be, size_t n, float lr, const float *g,
                   float *w) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return;
  LAUNCH(cb, n, k_sgd, lr, g, w);
}

/* ------------------------------------------------- host memory, copies */

static void *cu_host_alloc(const cnn_backend *be, size_t bytes) {
  cuda_be *cb = CB(be);
  if (enter(cb)) return NULL;
  void *p = NULL;
  if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) !=
      cudaSuccess) {
    cudaGetLastError();
    return NULL;
  }
  memset(p, 0, bytes);
  return p;
}

static void cu_host_free(const cnn_backend *be, void *p) {
  (void)be;
  if (p) cudaFreeHost(p);
}

static int cu_host_register(const cnn_backend *be, void *p, size_t bytes) {
  cuda_be *cb = CB(be);
  if (enter(cb)) {
    soft(cb, "cudaHostRegister", "the backend stopped after an error");
    return -1;
  }
  cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
  if (e != cudaSuccess) {
    cudaGetLastError(); /* not fatal: copies then stage through the driver */
    soft(cb, "cudaHostRegister", cudaGetErrorString(e));
    return -1;
  }
  return 0;
}

static void cu_host_unregister(const cnn_backend *be, void *p) {
  (void)be;
  if (p && cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

static int cu_host_pinned(const cnn_backend *be, const void *p) {
  (void)be;
  cudaPointerAttributes a;
  if (!p) return 0;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return a.type == cudaMemoryTypeHost;
}

/* The side stream starts after what the op stream has queued so far (and,
 * while recording, so joins the recording). */
static int fork_side(cuda_be *cb) {
  if (ck(cb, cudaEventRecord(cb->fork, cb->s), "cudaEventRecord") ||
      ck(cb, cudaStreamWaitEvent(cb->side, cb->fork, 0), "cudaStreamWaitEvent"))
    return -1;
  if (cb->capturing) cb->side_captured = 1;
  return 0;
}

static void cu_upload_async(const cnn_backend *be, int slot, void *dst,
                            const void *src, size_t bytes) {
  cuda_be *cb = CB(be);
  if (enter(cb) || slot < 0 || slot >= CNN_BE_SLOTS || fork_side(cb)) return;
  if (!ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cb->side),
          "cudaMemcpyAsync (upload)"))
    ck(cb, cudaEventRecord(cb->up[slot], cb->side), "cudaEventRecord");
}

static void cu_upload_wait(const cnn_backend *be, int slot) {
  cuda_be *cb = CB(be);
  if (enter(cb) || slot < 0 || slot >= CNN_BE_SLOTS) return;
  ck(cb, cudaStreamWaitEvent(cb->s, cb->up[slot], 0), "cudaStreamWaitEvent");
}

static void cu_download_async(const cnn_backend *be, void *dst,
                              const void *src, size_t bytes) {
  cuda_be *cb = CB(be);
  if (enter(cb) || fork_side(cb)) return;
  ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->side),
     "cudaMemcpyAsync (download)");
}

/* ---------------------------------------------------------------- graphs */

static int cu_graph_begin(const cnn_backend *be) {
  cuda_be *cb = CB(be);
  if (enter(cb) || cb->capturing) {
    soft(cb, "cudaStreamBeginCapture",
         cb->capturing ? "already recording" : "the backend stopped after an error");
    return -1;
  }
  cudaError_t e = cudaStreamBeginCapture(cb->s, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    cudaGetLastError();
    soft(cb, "cudaStreamBeginCapture", cudaGetErrorString(e));
    return -1;
  }
  cb->capturing = 1;
  cb->side_captured = 0;
  cb->capture_failed = 0;
  return 0;
}

static void *cu_graph_end(const cnn_backend *be) {
  cuda_be *cb = CB(be);
  if (!cb->capturing) {
    soft(cb, "cudaStreamEndCapture", "not recording");
    return NULL;
  }
  /* the recording must end where both streams' work has */
  cudaError_t e = cudaSuccess;
  if (cb->side_captured &&
      ((e = cudaEventRecord(cb->join, cb->side)) != cudaSuccess ||
       (e = cudaStreamWaitEvent(cb->s, cb->join, 0)) != cudaSuccess))
    fail(cb, "joining the copy stream into the recording", cudaGetErrorString(e));
  cudaGraph_t graph = NULL;
  e = cudaStreamEndCapture(cb->s, &graph);
  cb->capturing = 0;
  cudaGraphExec_t exec = NULL;
  if (e != cudaSuccess) {
    if (!cb->capture_failed) soft(cb, "cudaStreamEndCapture", cudaGetErrorString(e));
  } else if (!graph) {
    if (!cb->capture_failed) soft(cb, "cudaStreamEndCapture", "no graph returned");
  } else if (!cb->capture_failed &&
             (e = cudaGraphInstantiate(&exec, graph, 0)) != cudaSuccess) {
    soft(cb, "cudaGraphInstantiate", cudaGetErrorString(e));
    exec = NULL;
  }
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError(); /* a failed recording is not an error of the ops */
  return exec;
}

/* A replay that cannot be queued leaves the error state alone (the model
 * runs the ops instead); an error the device hit before it is sticky and
 * the ops that follow report it. */
static int cu_graph_launch(const cnn_backend *be, void *graph) {
  cuda_be *cb = CB(be);
  if (enter(cb)) {
    soft(cb, "cudaGraphLaunch", "the backend stopped after an error");
    return -1;
  }
  cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)graph, cb->s);
  if (e == cudaSuccess) return 0;
  cudaGetLastError();
  soft(cb, "cudaGraphLaunch", cudaGetErrorString(e));
  return -1;
}

static void cu_graph_free(const cnn_backend *be, void *graph) {
  (void)be;
  if (graph) cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

static const char *cu_error(const cnn_backend *be) {
  const cuda_be *cb = CB(be);
  return cb->err[0] ? cb->err : NULL;
}

static const char *cu_soft_error(const cnn_backend *be) {
  const cuda_be *cb = CB(be);
  return cb->soft[0] ? cb->soft : NULL;
}

/* ---------------------------------------------------------------- setup */

int cnn_cuda_built(void) { return 1; }

int cnn_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

int cnn_cuda_absent(char *why, size_t len) {
  char scratch[8];
  if (!why || !len) {
    why = scratch;
    len = sizeof scratch;
  }
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!drv) {
    const char *e = dlerror();
    snprintf(why, len, "no CUDA driver: libcuda.so.1 cannot be loaded (%s)",
             e ? e : "not found");
    return 1;
  }
  dlclose(drv);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  cudaGetLastError();
  if (e == cudaErrorNoDevice || e == cudaErrorStubLibrary ||
      (e == cudaSuccess && n == 0)) {
    snprintf(why, len, "no CUDA device: %s (CUDA_VISIBLE_DEVICES=%s)",
             e == cudaSuccess ? "the driver reports 0 devices" : cudaGetErrorString(e),
             vis ? vis : "unset");
    return 1;
  }
  if (e != cudaSuccess)
    snprintf(why, len,
             "a CUDA driver is installed but cudaGetDeviceCount failed: %s "
             "(CUDA_VISIBLE_DEVICES=%s)",
             cudaGetErrorString(e), vis ? vis : "unset");
  else
    snprintf(why, len, "%d CUDA device%s visible (CUDA_VISIBLE_DEVICES=%s)", n,
             n == 1 ? "" : "s", vis ? vis : "unset");
  return 0;
}

int cnn_cuda_device_name(int device, char *buf, size_t len) {
  cudaDeviceProp p;
  if (device < 0 || cudaGetDeviceProperties(&p, device) != cudaSuccess) {
    cudaGetLastError();
    if (buf && len) buf[0] = '\0';
    return -1;
  }
  if (buf && len)
    snprintf(buf, len, "%s, %.1f GiB, sm_%d%d", p.name,
             (double)p.totalGlobalMem / (1u << 30), p.major, p.minor);
  return 0;
}

static void destroy_backend(cuda_be *cb) {
  if (!cb) return;
  for (int i = 0; i < CNN_BE_SLOTS; i++)
    if (cb->up[i]) cudaEventDestroy(cb->up[i]);
  if (cb->fork) cudaEventDestroy(cb->fork);
  if (cb->join) cudaEventDestroy(cb->join);
  if (cb->blas) blas.destroy(cb->blas);
  if (cb->blas_ws) cudaFree(cb->blas_ws);
  if (cb->scratch) cudaFree(cb->scratch);
  if (cb->s) cudaStreamDestroy(cb->s);
  if (cb->side) cudaStreamDestroy(cb->side);
  free(cb);
}

static void fill_vtable(cnn_backend *be) {
  be->name = "cuda";
  be->threads = 1;
  be->host_mapped = 0;
  be->alloc = cu_alloc;
  be->free = cu_free;
  be->to_device = cu_to_device;
  be->to_host = cu_to_host;
  be->sync = cu_sync;
  be->nchw_to_nhwc = cu_nchw_to_nhwc;
  be->conv_ws_bytes = cu_conv_ws_bytes;
  be->conv_ws_fwd_bytes = cu_conv_ws_fwd_bytes;
  be->relu_bwd_bias = cu_relu_bwd_bias;
  be->conv_fwd = cu_conv_fwd;
  be->conv_bwd_filter = cu_conv_bwd_filter;
  be->conv_bwd_data = cu_conv_bwd_data;
  be->dense_fwd = cu_dense_fwd;
  be->dense_bwd = cu_dense_bwd;
  be->relu_bwd = cu_relu_bwd;
  be->maxpool_fwd = cu_maxpool_fwd;
  be->maxpool_bwd = cu_maxpool_bwd;
  be->lrn_fwd = cu_lrn_fwd;
  be->lrn_bwd = cu_lrn_bwd;
  be->softmax_xent = cu_softmax_xent;
  be->l2_decay = cu_l2_decay;
  be->sgd = cu_sgd;
  be->host_alloc = cu_host_alloc;
  be->host_free = cu_host_free;
  be->host_register = cu_host_register;
  be->host_unregister = cu_host_unregister;
  be->host_pinned = cu_host_pinned;
  be->upload_async = cu_upload_async;
  be->upload_wait = cu_upload_wait;
  be->download_async = cu_download_async;
  be->graph_begin = cu_graph_begin;
  be->graph_end = cu_graph_end;
  be->graph_launch = cu_graph_launch;
  be->graph_free = cu_graph_free;
  be->soft_error = cu_soft_error;
  be->error = cu_error;
}

/* A new backend on device dev, or NULL with err set. */
static cuda_be *create_backend(int dev, char *err, size_t errlen) {
  cuda_be *cb = (cuda_be *)calloc(1, sizeof *cb);
  if (!cb) {
    if (err && errlen) snprintf(err, errlen, "out of memory (CUDA device %d)", dev);
    return NULL;
  }
  cb->dev = dev;
  fill_vtable(&cb->be);
  const char *what = NULL;
  cudaError_t e = cudaSetDevice(dev);
  if (e != cudaSuccess) what = "cudaSetDevice";
  if (!what && (e = cudaDeviceGetAttribute(&cb->sms, cudaDevAttrMultiProcessorCount,
                                           dev)) != cudaSuccess)
    what = "cudaDeviceGetAttribute";
  if (!what && (e = cudaStreamCreateWithFlags(&cb->s, cudaStreamNonBlocking)) !=
                   cudaSuccess)
    what = "cudaStreamCreate";
  if (!what && (e = cudaStreamCreateWithFlags(&cb->side, cudaStreamNonBlocking)) !=
                   cudaSuccess)
    what = "cudaStreamCreate";
  for (int i = 0; !what && i < CNN_BE_SLOTS; i++)
    if ((e = cudaEventCreateWithFlags(&cb->up[i], cudaEventDisableTiming)) !=
        cudaSuccess)
      what = "cudaEventCreate";
  if (!what && ((e = cudaEventCreateWithFlags(&cb->fork, cudaEventDisableTiming)) !=
                    cudaSuccess ||
                (e = cudaEventCreateWithFlags(&cb->join, cudaEventDisableTiming)) !=
                    cudaSuccess))
    what = "cudaEventCreate";
  if (!what && (e = cudaMalloc((void **)&cb->scratch,
                               3 * (size_t)RED_REGION * sizeof(float))) != cudaSuccess)
    what = "cudaMalloc (reduction scratch)";
  if (!what && (e = cudaMalloc(&cb->blas_ws, BLAS_WS_BYTES)) != cudaSuccess)
    what = "cudaMalloc (cuBLAS workspace)";
  if (what) {
    cudaGetLastError();
    if (err && errlen)
      snprintf(err, errlen, "CUDA device %d: %s failed: %s", dev, what,
               cudaGetErrorString(e));
    destroy_backend(cb);
    return NULL;
  }
  const char *call = "cublasCreate";
  cublasStatus_t st = blas.create(&cb->blas);
  if (st == CUBLAS_STATUS_SUCCESS) {
    call = "cublasSetStream";
    st = blas.set_stream(cb->blas, cb->s);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    call = "cublasSetWorkspace";
    st = blas.set_workspace(cb->blas, cb->blas_ws, BLAS_WS_BYTES);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    call = "cublasSetMathMode";
    st = blas.set_math_mode(cb->blas, CUBLAS_DEFAULT_MATH); /* float32, no TF32 */
  }
  if (st != CUBLAS_STATUS_SUCCESS) {
    if (err && errlen)
      snprintf(err, errlen, "CUDA device %d: cuBLAS setup failed: %s (%s) returned %s",
               dev, call, CUBLAS_SONAME, blas.status_string(st));
    destroy_backend(cb);
    return NULL;
  }
  return cb;
}

const cnn_backend *cnn_backend_cuda(int device, char *err, size_t errlen) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (err && errlen)
      snprintf(err, errlen, "no usable CUDA device: %s (CUDA_VISIBLE_DEVICES=%s)",
               cudaGetErrorString(e), vis ? vis : "unset");
    return NULL;
  }
  if (device < 0 || device >= n || device >= CUDA_MAX_DEVICES) {
    if (err && errlen)
      snprintf(err, errlen, "no CUDA device %d: %d visible", device, n);
    return NULL;
  }
  pthread_mutex_lock(&backends_mu);
  if (!backends[device] && blas_load(err, errlen) == 0)
    backends[device] = create_backend(device, err, errlen);
  cuda_be *cb = backends[device];
  pthread_mutex_unlock(&backends_mu);
  return cb ? &cb->be : NULL;
}
