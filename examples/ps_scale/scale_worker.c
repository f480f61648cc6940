/* scale_worker.c - a synthetic worker for the scaling emulation
 * (deploy/scale/ps_scale.sh): the variables of a real model (the CIFAR-10
 * CNN's, or ResNet-50's, optionally scaled down), a fixed "compute" time
 * per step spent sleeping, and ps_client_step. Configured from the
 * environment like any worker (psrun or the emulation sets PS_HOSTS etc.).
 *
 *   scale_worker --model cifar|resnet50 [--scale K] [--compute-ms MS]
 *                [--steps N] [--warmup N]
 *
 * Prints one JSON line: {"worker":i,"model":...,"bytes":B,"steps":N,
 * "step_ms":median compute+step,"comm_ms":median ps_client_step}.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nn.h"
#include "psclient.h"

/* Most variables a model here has (ResNet-50 has 108). */
#define SW_MAX_VARS 512
/* Most timed steps (the medians need them all). */
#define SW_MAX_STEPS 100000

typedef struct sw_var {
  char name[64];   /* variable name */
  int64_t numel;   /* elements (after scaling) */
} sw_var;

static sw_var g_vars[SW_MAX_VARS];
static int g_nvars;

static void add_var(const char *name, int64_t numel, int scale) {
  if (g_nvars == SW_MAX_VARS) return;
  int64_t n = numel / scale;
  snprintf(g_vars[g_nvars].name, sizeof g_vars[g_nvars].name, "%s", name);
  g_vars[g_nvars++].numel = n > 0 ? n : 1;
}

/* The CIFAR-10 CNN's parameters, as the example creates them. */
static void model_cifar(int scale) {
  for (int i = 0; i < cnn_num_params(); i++)
    add_var(cnn_param_info(i)->name, (int64_t)cnn_param_numel(i), scale);
}

/* ResNet-50 (v1.5, ImageNet): conv1, four stages of bottleneck blocks
 * (3, 4, 6, 3) with a projection in each stage's first block, batch-norm
 * scale and offset per convolution, and the 1000-way classifier: 25.6M
 * parameters in 108 tensors (53 convolutions with their batch norms, and
 * the classifier), in the order a framework creates them. */
static void model_resnet50(int scale) {
  char n[64];
  int in = 64, conv = 0;
#define CONV(k, ci, co)                                                   \
  do {                                                                    \
    snprintf(n, sizeof n, "conv%d/w", conv);                              \
    add_var(n, (int64_t)(k) * (k) * (ci) * (co), scale);                  \
    snprintf(n, sizeof n, "conv%d/bn", conv++);                           \
    add_var(n, 2 * (int64_t)(co), scale);                                 \
  } while (0)
  CONV(7, 3, 64);
  const int blocks[4] = {3, 4, 6, 3}, width[4] = {64, 128, 256, 512};
  for (int s = 0; s < 4; s++)
    for (int b = 0; b < blocks[s]; b++) {
      int w = width[s];
      CONV(1, in, w);
      CONV(3, w, w);
      CONV(1, w, 4 * w);
      if (b == 0) CONV(1, in, 4 * w); /* projection shortcut */
      in = 4 * w;
    }
#undef CONV
  add_var("fc/w", 2048 * 1000, scale);
  add_var("fc/b", 1000, scale);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp);
  return n ? v[n / 2] : 0;
}

static long arg_num(const char *flag, const char *v, long lo, long hi) {
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi) {
    fprintf(stderr, "scale_worker: %s must be an integer from %ld to %ld, got '%s'\n", flag,
            lo, hi, v);
    exit(2);
  }
  return x;
}

int main(int argc, char **argv) {
  const char *model = "cifar";
  int scale = 1, steps = 20, warmup = 3;
  double compute_ms = 0;
  for (int a = 1; a < argc; a++) {
    const char *f = argv[a], *v = a + 1 < argc ? argv[a + 1] : NULL;
    if (!strcmp(f, "--help")) {
      printf("usage: scale_worker --model cifar|resnet50 [--scale K] [--compute-ms MS] "
             "[--steps N] [--warmup N]\n");
      return 0;
    }
    if (!v) {
      fprintf(stderr, "scale_worker: %s needs a value (or is unknown; see --help)\n", f);
      return 2;
    }
    a++;
    if (!strcmp(f, "--model")) model = v;
    else if (!strcmp(f, "--scale")) scale = (int)arg_num(f, v, 1, 1 << 20);
    else if (!strcmp(f, "--compute-ms")) compute_ms = (double)arg_num(f, v, 0, 600000);
    else if (!strcmp(f, "--steps")) steps = (int)arg_num(f, v, 1, SW_MAX_STEPS);
    else if (!strcmp(f, "--warmup")) warmup = (int)arg_num(f, v, 0, 1000);
    else {
      fprintf(stderr, "scale_worker: unknown option %s (see --help)\n", f);
      return 2;
    }
  }
  if (!strcmp(model, "cifar")) model_cifar(scale);
  else if (!strcmp(model, "resnet50")) model_resnet50(scale);
  else {
    fprintf(stderr, "scale_worker: --model must be cifar or resnet50, got '%s'\n", model);
    return 2;
  }
  char err[600];
  ps_client *c;
  if (ps_client_create_from_env(&c, err, sizeof err) != 0) {
    fprintf(stderr, "scale_worker: %s\n", err);
    return 1;
  }
  int64_t bytes = 0;
  ps_optimizer opt;
  ps_optimizer_default(&opt, 0.01);
  for (int i = 0; i < g_nvars; i++) {
    ps_var *v;
    int64_t shape[1] = {g_vars[i].numel};
    if (ps_client_var_create(c, g_vars[i].name, shape, 1, NULL, &opt, &v) != 0) {
      fprintf(stderr, "scale_worker: creating %s: %s\n", g_vars[i].name, ps_client_errmsg(c));
      return 1;
    }
    bytes += g_vars[i].numel * 4;
  }
  uint64_t step = 0;
  if (ps_client_pull(c, 0, &step) != 0) {
    fprintf(stderr, "scale_worker: pull: %s\n", ps_client_errmsg(c));
    return 1;
  }
  double *total = malloc(sizeof(double) * (size_t)steps);
  double *comm = malloc(sizeof(double) * (size_t)steps);
  if (!total || !comm) return 1;
  struct timespec nap = {(time_t)(compute_ms / 1000),
                         (long)(fmod(compute_ms, 1000.0) * 1e6)};
  double t_first = 0;
  for (int s = 0; s < warmup + steps; s++) {
    double t0 = now_s();
    if (s == warmup) t_first = t0;
    if (compute_ms > 0) nanosleep(&nap, NULL); /* the "forward and backward pass" */
    double t1 = now_s();
    if (ps_client_step(c, &step, NULL) != 0) {
      fprintf(stderr, "scale_worker: step: %s\n", ps_client_errmsg(c));
      return 1;
    }
    double t2 = now_s();
    if (s >= warmup) {
      total[s - warmup] = t2 - t0;
      comm[s - warmup] = t2 - t1;
    }
  }
  double wall = now_s() - t_first;
  if (ps_client_finish(c) != 0) {
    fprintf(stderr, "scale_worker: finish: %s\n", ps_client_errmsg(c));
    return 1;
  }
  printf("{\"worker\":%d,\"model\":\"%s\",\"scale\":%d,\"vars\":%d,\"bytes\":%lld,"
         "\"compute_ms\":%.1f,\"steps\":%d,\"step_ms\":%.3f,\"comm_ms\":%.3f,"
         "\"mean_step_ms\":%.3f}\n",
         ps_client_worker_index(c), model, scale, g_nvars, (long long)bytes, compute_ms, steps,
         median(total, steps) * 1e3, median(comm, steps) * 1e3, wall / steps * 1e3);
  ps_client_destroy(c);
  free(total);
  free(comm);
  return 0;
}
