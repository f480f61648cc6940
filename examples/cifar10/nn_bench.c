/*
 * cnn_bench: training throughput of the CIFAR-10 CNN (nn.h) with
 * synthetic data and local SGD (no parameter server), on the CPU backend
 * or (--device gpu) the CUDA one.
 *
 *   cnn_bench [--device cpu|gpu] [--gpu N] [--threads T] [--batch B]
 *             [--steps N] [--warmup W] [--no-lrn] [--no-graphs] [--profile]
 *             [--sgemm]
 *
 * Prints one JSON line: {"images_per_sec":..,"threads":T,"batch":B,
 * "lrn":1,"gflops":..,"ms_per_step":..,"loss":..} and what the timed steps
 * really did (cnn_get_run_info): "graphs" 1 only if every timed step
 * replayed a recorded CUDA graph (the flag asked for is
 * "graphs_requested"), "graph_replays" and "eager_steps" among the timed
 * steps, "graph_recordings" and "graph_failures" over the whole run,
 * "pinned" (1 page-locked, 0 not tried, -1 failed), and the reasons
 * "eager_why", "graph_error", "pin_error" ("" when none). --profile adds a
 * per-op breakdown on stderr (and makes every step eager). --sgemm instead
 * measures a 1024^3 SGEMM on one OpenBLAS thread: {"sgemm_gflops":..}.
 *
 * Exit status: 0, 2 for bad arguments, 69 (CNN_EXIT_NO_GPU) when --device
 * gpu finds no GPU at all, 1 for anything else (a GPU that is there but
 * cannot be used included).
 *
 * On the GPU the line also says where a step's time goes: "ms_eager" (the
 * same steps with every op launched, no graph: minus ms_per_step, the
 * launch cost graphs save), "ms_copies" (the step's transfers alone,
 * unoverlapped: parameters and images up, gradients down, through
 * page-locked memory) and "ms_ops_synced" (the per-op profile: each op
 * followed by a wait, i.e. its GPU time plus one launch and one wait).
 * The step itself overlaps the copies with compute (nn_model.c). The
 * parameter values stay on the GPU (cnn_values_on_device), as in a PyTorch
 * loop: a step uploads the images and downloads the gradients.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "nn.h"
#include "nn_backend.h"
#include "psclient.h"

#define USAGE                                                              \
  "usage: cnn_bench [--device cpu|gpu] [--gpu N] [--threads T] [--batch B] " \
  "[--steps N] [--warmup W] [--no-lrn] [--no-graphs] [--profile] [--sgemm]\n"

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return ((double)(rng >> 11) + 0.5) / 9007199254740992.0;
}
static float nrand(void) {
  return (float)(sqrt(-2.0 * log(urand())) * cos(6.283185307179586 * urand()));
}

static int bench_sgemm(void) {
  const int n = 1024;
  float *a = malloc(sizeof(float) * n * n), *b = malloc(sizeof(float) * n * n),
        *c = malloc(sizeof(float) * n * n);
  if (!a || !b || !c) return 1;
  for (int i = 0; i < n * n; i++) {
    a[i] = nrand();
    b[i] = nrand();
  }
  openblas_set_num_threads(1);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n,
              b, n, 0.0f, c, n);
  double best = 0.0;
  for (int rep = 0; rep < 5; rep++) {
    int it = 0;
    double t0 = now_s(), t;
    do {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a,
                  n, b, n, 0.0f, c, n);
      it++;
      t = now_s() - t0;
    } while (t < 0.3);
    double g = 2.0 * n * n * n * it / t * 1e-9;
    if (g > best) best = g;
  }
  printf("{\"sgemm_gflops\":%.1f,\"n\":%d,\"threads\":1}\n", best, n);
  free(a);
  free(b);
  free(c);
  return 0;
}

/* s as a JSON string (quotes, backslashes and control bytes escaped). */
static void json_str(const char *s) {
  putchar('"');
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') printf("\\%c", c);
    else if (c < 0x20) printf("\\u%04x", c);
    else putchar(c);
  }
  putchar('"');
}

/* The run-info fields of the JSON line (see the top): a = before the timed
 * steps, b = after them. */
static void print_run_info(const cnn_run_info *a, const cnn_run_info *b, int steps,
                           int requested) {
  long replays = b->graph_replays - a->graph_replays, eager = b->eager_steps - a->eager_steps;
  printf(",\"graphs\":%d,\"graphs_requested\":%d,\"graph_replays\":%ld,\"eager_steps\":%ld,"
         "\"graph_recordings\":%ld,\"graph_failures\":%ld,\"pinned\":%d,\"eager_why\":",
         replays == steps ? 1 : 0, requested, replays, eager, b->graph_recordings,
         b->graph_failures, b->pinned);
  json_str(eager ? b->eager_why : "");
  printf(",\"graph_error\":");
  json_str(b->graph_error);
  printf(",\"pin_error\":");
  json_str(b->pin_error);
}

/* ms per step of `steps` steps (train + local SGD). */
static double time_steps(cnn *m, const float *img, const uint8_t *lab, int batch,
                         int steps) {
  double t0 = now_s();
  for (int s = 0; s < steps; s++) {
    cnn_train_step(m, img, lab, batch);
    cnn_sgd_local(m, 0.01f);
  }
  return 1e3 * (now_s() - t0) / steps;
}

/* Appends to the JSON line where a GPU step's time goes (see the top). */
static void gpu_breakdown(cnn *m, const cnn_backend *be, const float *img,
                          const uint8_t *lab, int batch, int steps) {
  cnn_use_graphs(m, 0);
  time_steps(m, img, lab, batch, 2);
  double eager = time_steps(m, img, lab, batch, steps);
  cnn_use_graphs(m, 1);
  /* transfers of one step, alone: parameters + images up, gradients down */
  size_t pbytes = 0;
  for (int i = 0; i < cnn_num_params(); i++) pbytes += cnn_param_numel(i) * sizeof(float);
  size_t ibytes = (size_t)batch * CNN_IMAGE_FLOATS * sizeof(float) + (size_t)batch;
  void *h = cnn_host_alloc(be, pbytes + ibytes), *d = be->alloc(be, pbytes + ibytes);
  double copies = -1;
  if (h && d) {
    be->to_device(be, d, h, pbytes + ibytes);
    double t0 = now_s();
    for (int r = 0; r < 10; r++) {
      be->to_device(be, d, h, pbytes + ibytes);
      be->to_host(be, h, d, pbytes);
    }
    copies = 1e3 * (now_s() - t0) / 10;
  }
  cnn_host_free(be, h);
  be->free(be, d);
  cnn_profile(m, 1);
  time_steps(m, img, lab, batch, steps);
  double synced = cnn_profile_ms(m);
  cnn_profile_print(m, stderr);
  cnn_profile(m, 0);
  printf(",\"ms_eager\":%.3f,\"ms_copies\":%.3f,\"ms_ops_synced\":%.3f", eager, copies,
         synced);
}

int main(int argc, char **argv) {
  int threads = 1, batch = 128, steps = 20, warmup = 3, lrn = 1, prof = 0;
  int gpu = 0, gpu_index = 0, graphs = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
    else if (!strcmp(a, "--batch") && i + 1 < argc) batch = atoi(argv[++i]);
    else if (!strcmp(a, "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    else if (!strcmp(a, "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
    else if (!strcmp(a, "--no-lrn")) lrn = 0;
    else if (!strcmp(a, "--profile")) prof = 1;
    else if (!strcmp(a, "--no-graphs")) graphs = 0;
    else if (!strcmp(a, "--gpu") && i + 1 < argc) gpu_index = atoi(argv[++i]);
    else if (!strcmp(a, "--device") && i + 1 < argc) {
      const char *d = argv[++i];
      if (strcmp(d, "cpu") && strcmp(d, "gpu")) {
        fprintf(stderr, "cnn_bench: --device must be cpu or gpu, got '%s'\n", d);
        return 2;
      }
      gpu = !strcmp(d, "gpu");
    }
    else if (!strcmp(a, "--sgemm")) return bench_sgemm();
    else {
      fprintf(stderr, USAGE);
      return 2;
    }
  }
  if (threads < 1 || batch < 1 || steps < 1 || warmup < 0) {
    fprintf(stderr, "cnn_bench: bad arguments\n");
    return 2;
  }
  const cnn_backend *be = cnn_backend_cpu(threads);
  char err[512], name[256] = "";
  if (gpu) {
    if (cnn_cuda_absent(err, sizeof err)) {
      fprintf(stderr, "cnn_bench: --device gpu: no GPU: %s\n", err);
      return CNN_EXIT_NO_GPU;
    }
    if (!(be = cnn_backend_cuda(gpu_index, err, sizeof err))) {
      fprintf(stderr, "cnn_bench: --device gpu: a GPU is present but cannot be used: %s\n",
              err);
      return 1;
    }
    cnn_cuda_device_name(gpu_index, name, sizeof name);
    threads = 1;
  }
  cnn *m = NULL;
  if (!be || cnn_create(be, batch, lrn, &m) != 0) {
    fprintf(stderr, "cnn_bench: cnn_create failed\n");
    return 1;
  }
  float *val[CNN_NUM_PARAMS], *grad[CNN_NUM_PARAMS];
  for (int i = 0; i < cnn_num_params(); i++) {
    const cnn_param *p = cnn_param_info(i);
    size_t n = cnn_param_numel(i);
    val[i] = calloc(n, sizeof(float));
    grad[i] = calloc(n, sizeof(float));
    ps_init init = PS_SIZED(ps_init, (ps_init_kind)p->init_kind, p->init_a, p->init_b, 1);
    if (!val[i] || !grad[i] ||
        ps_init_fill(&init, p->name, p->shape, p->ndim, val[i], n) != 0) {
      fprintf(stderr, "cnn_bench: init of %s failed\n", p->name);
      return 1;
    }
    cnn_bind(m, i, val[i], grad[i]);
  }
  cnn_use_graphs(m, graphs);
  cnn_values_on_device(m, 1); /* local SGD: the values stay on a GPU */
  float *img = cnn_host_alloc(be, sizeof(float) * (size_t)batch * CNN_IMAGE_FLOATS);
  uint8_t *lab = cnn_host_alloc(be, (size_t)batch);
  if (!img || !lab) return 1;
  for (size_t i = 0; i < (size_t)batch * CNN_IMAGE_FLOATS; i++) img[i] = nrand();
  for (int b = 0; b < batch; b++) lab[b] = (uint8_t)(urand() * 10.0);

  float loss = 0.0f;
  for (int s = 0; s < warmup; s++) {
    loss = cnn_train_step(m, img, lab, batch);
    cnn_sgd_local(m, 0.01f);
  }
  if (prof) cnn_profile(m, 1);
  cnn_run_info before, after;
  cnn_get_run_info(m, &before);
  double t0 = now_s();
  for (int s = 0; s < steps; s++) {
    loss = cnn_train_step(m, img, lab, batch);
    cnn_sgd_local(m, 0.01f);
  }
  double dt = now_s() - t0;
  cnn_get_run_info(m, &after);
  if (prof) cnn_profile_print(m, stderr);
  if (cnn_error(m)) {
    fprintf(stderr, "cnn_bench: %s\n", cnn_error(m));
    return 1;
  }
  double ips = (double)batch * steps / dt;
  printf("{\"images_per_sec\":%.1f,\"threads\":%d,\"batch\":%d,\"lrn\":%d,"
         "\"gflops\":%.1f,\"ms_per_step\":%.3f,\"loss\":%.4f,\"impl\":\"c-%s\"",
         ips, threads, batch, lrn,
         cnn_train_flops(m, batch) * steps / dt * 1e-9, 1e3 * dt / steps,
         loss, cnn_backend_name(be));
  print_run_info(&before, &after, steps, graphs);
  if (gpu) {
    gpu_breakdown(m, be, img, lab, batch, steps);
    printf(",\"device_name\":");
    json_str(name);
  }
  printf("}\n");
  cnn_destroy(m);
  for (int i = 0; i < cnn_num_params(); i++) {
    free(val[i]);
    free(grad[i]);
  }
  cnn_host_free(be, img);
  cnn_host_free(be, lab);
  return isfinite(loss) ? 0 : 1;
}
