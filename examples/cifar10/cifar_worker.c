/*
 * cifar_worker - the TensorFlow CIFAR-10 tutorial network, trained
 * between-graph-replicated through psd: every worker builds the same model,
 * registers its variables with libpsclient (the chief initializes them),
 * and each step computes gradients on its own batch, pushes them and pulls
 * the averaged update. Run it under psrun:
 *
 *   psrun --local -n 3 --ps 1 -- cifar_worker --data DIR --epochs 1
 *   srun --ntasks=N psrun --ps=1 cifar_worker --data DIR --epochs 10
 *
 * `cifar_worker --bench` measures the training compute alone (no psd).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "data.h"
#include "nn.h"
#include "prefetch.h"
#include "psclient.h"
#include "wfile.h" /* common/: output files created safely */

#define IMG_FLOATS (3 * 24 * 24)

typedef struct opts {
  char data[4096];     /* --data: directory of the binary files */
  double epochs;       /* --epochs (used when --steps is 0) */
  long steps;          /* --steps: total steps (global) */
  int batch;           /* --batch: images per worker per step */
  double lr;           /* --lr: learning rate for the global batch */
  double decay_rate;   /* --lr-decay RATE:EPOCHS (staircase) */
  double decay_epochs;
  double momentum;     /* --momentum (0: plain SGD) */
  double warmup_epochs; /* --warmup-epochs: linear warm-up of the lr */
  int cosine;          /* --cosine: lr follows a cosine to 0 at the last step */
  double floor_epoch;  /* --cosine-floor E:F: the cosine ends at epoch E ... */
  double floor_factor; /* ... at lr * F, and stays there (0, 0: as --cosine) */
  int threads;         /* --threads (0: SLURM_CPUS_PER_TASK or cores) */
  uint64_t seed;       /* --seed */
  char metrics[4096];  /* --metrics: JSON lines file */
  long eval_every;     /* --eval-every N steps (0: only at the end) */
  int lrn;             /* --no-lrn clears it */
  int bench;           /* --bench */
  int bench_steps;     /* --bench-steps */
  char dump[4096];     /* --dump-params: chief writes the final parameters */
  char device[8];      /* --device: cpu, gpu or auto */
  int eval_views;      /* --eval-views: 1 (centre crop), 2 (and its mirror) or 10 */
  double average;      /* --average DECAY: the servers keep an EMA (0: none) */
  double contrast_lo, contrast_hi; /* --contrast LO:HI (1:1: none) */
  double smooth;       /* --label-smoothing (0: one-hot targets) */
  double conv_decay;   /* --conv-decay: L2 on the convolutions' weights (0: none) */
} opts;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "cifar_worker: ");
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: cifar_worker --data DIR [--epochs E | --steps S] [--batch B] [--lr X]\n"
          "                    [--lr-decay RATE:EPOCHS | --cosine | --cosine-floor E:F]\n"
          "                    [--momentum M] [--warmup-epochs W] [--threads T] [--seed N]\n"
          "                    [--metrics FILE] [--eval-every N] [--no-lrn]\n"
          "                    [--average DECAY] [--eval-views N] [--contrast LO:HI]\n"
          "                    [--label-smoothing E] [--conv-decay W]\n"
          "                    [--device cpu|gpu|auto]\n"
          "       cifar_worker --bench [--batch B] [--threads T] [--bench-steps N] [--no-lrn]\n"
          "Trains the TensorFlow CIFAR-10 tutorial CNN through psd (run it under psrun).\n"
          "  --data DIR        CIFAR-10 binary files (data_batch_*.bin, test_batch.bin)\n"
          "  --epochs E        epochs over the training set [1]\n"
          "  --steps S         steps instead of epochs\n"
          "  --batch B         images per worker per step; global batch = workers x B [128]\n"
          "  --lr X            learning rate (for the global batch) [0.1]\n"
          "  --lr-decay R:E    multiply the learning rate by R every E epochs [none]\n"
          "  --momentum M      SGD with momentum M (server side) [0: plain SGD]\n"
          "  --warmup-epochs W raise the learning rate linearly over W epochs [0]\n"
          "  --cosine          cosine decay of the learning rate to 0 at the last step\n"
          "  --cosine-floor E:F cosine decay to F x the learning rate at epoch E, then\n"
          "                    that rate to the end (a flat tail for --average to\n"
          "                    average, as stochastic weight averaging does)\n"
          "  --threads T       compute threads [SLURM_CPUS_PER_TASK, else cores/local workers]\n"
          "  --seed N          data order and augmentation [1]\n"
          "  --metrics FILE    one JSON line per progress report (worker i>0: FILE.w<i>)\n"
          "  --eval-every N    chief evaluates test accuracy every N steps [0: at the end]\n"
          "  --no-lrn          drop both LRN layers\n"
          "  --dump-params F   chief writes the final parameters (float32, in order) to F\n"
          "  --average DECAY   the servers keep an exponential moving average of the\n"
          "                    parameters (TensorFlow's, with its num_updates warm-up);\n"
          "                    the chief also evaluates it (test_accuracy_average)\n"
          "  --contrast LO:HI  TensorFlow's random contrast: each training image's\n"
          "                    channels scaled about their means by a factor in\n"
          "                    [LO, HI] before the standardization (its recipe: 0.2:1.8)\n"
          "  --label-smoothing E train against (1 - E) x the one-hot label + E / 10,\n"
          "                    as torch's CrossEntropyLoss(label_smoothing=E); the\n"
          "                    loss reported is against that target [0]\n"
          "  --conv-decay W    L2 weight decay W on the two convolutions' weights, on\n"
          "                    the servers (the recipe decays only the fully connected\n"
          "                    layers, by 0.004, in the model's loss) [0]\n"
          "  --eval-views N    predict from the mean softmax over N views of each test\n"
          "                    image: 1 centre crop, 2 and its mirror, 10 centre and\n"
          "                    corners, each mirrored [1]\n"
          "  --device D        cpu, gpu (CUDA; the GPU Slurm gives the task, else local\n"
          "                    rank modulo the visible GPUs) or auto (gpu if one is visible) [cpu];\n"
          "                    gpu with no GPU at all exits 69, a GPU that cannot be used exits 1\n"
          "  --bench           time the training compute alone (no psd), synthetic data\n");
}

static double num(const char *flag, const char *v, double lo, double hi) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || end == v || *end || !isfinite(x) || x < lo || x > hi)
    die("%s must be a number from %g to %g, got '%s'", flag, lo, hi, v);
  return x;
}

static void parse(opts *o, int argc, char **argv) {
  memset(o, 0, sizeof *o);
  o->epochs = 1;
  o->batch = 128;
  o->lr = 0.1;
  o->seed = 1;
  o->lrn = 1;
  o->bench_steps = 10;
  o->eval_views = 1;
  o->contrast_lo = o->contrast_hi = 1;
  snprintf(o->device, sizeof o->device, "cpu");
  for (int a = 1; a < argc; a++) {
    const char *f = argv[a];
    if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
      usage(stdout);
      exit(0);
    }
    if (!strcmp(f, "--no-lrn")) {
      o->lrn = 0;
      continue;
    }
    if (!strcmp(f, "--bench")) {
      o->bench = 1;
      continue;
    }
    if (!strcmp(f, "--cosine")) {
      o->cosine = 1;
      continue;
    }
    if (a + 1 >= argc) die("option %s needs a value (see --help)", f);
    const char *v = argv[++a];
    if (!strcmp(f, "--data")) snprintf(o->data, sizeof o->data, "%s", v);
    else if (!strcmp(f, "--epochs")) o->epochs = num(f, v, 1e-6, 1e6);
    else if (!strcmp(f, "--steps")) o->steps = (long)num(f, v, 1, 1e12);
    else if (!strcmp(f, "--batch")) o->batch = (int)num(f, v, 1, 4096);
    else if (!strcmp(f, "--lr")) o->lr = num(f, v, 1e-12, 1e3);
    else if (!strcmp(f, "--threads")) o->threads = (int)num(f, v, 1, 1024);
    else if (!strcmp(f, "--seed")) o->seed = (uint64_t)num(f, v, 0, 1e15);
    else if (!strcmp(f, "--metrics")) snprintf(o->metrics, sizeof o->metrics, "%s", v);
    else if (!strcmp(f, "--eval-every")) o->eval_every = (long)num(f, v, 0, 1e12);
    else if (!strcmp(f, "--bench-steps")) o->bench_steps = (int)num(f, v, 1, 1e6);
    else if (!strcmp(f, "--momentum")) o->momentum = num(f, v, 0, 0.999);
    else if (!strcmp(f, "--warmup-epochs")) o->warmup_epochs = num(f, v, 0, 1e6);
    else if (!strcmp(f, "--dump-params")) snprintf(o->dump, sizeof o->dump, "%s", v);
    else if (!strcmp(f, "--average")) o->average = num(f, v, 0.5, 0.999999);
    else if (!strcmp(f, "--label-smoothing")) o->smooth = num(f, v, 0, 0.99);
    else if (!strcmp(f, "--conv-decay")) o->conv_decay = num(f, v, 0, 1);
    else if (!strcmp(f, "--contrast")) {
      char lo[64];
      const char *colon = strchr(v, ':');
      if (!colon) die("--contrast must be LO:HI (TensorFlow's recipe: 0.2:1.8), got '%s'", v);
      snprintf(lo, sizeof lo, "%.*s", (int)(colon - v), v);
      o->contrast_lo = num("--contrast LO", lo, 0.01, 10);
      o->contrast_hi = num("--contrast HI", colon + 1, o->contrast_lo, 10);
    }
    else if (!strcmp(f, "--eval-views")) {
      o->eval_views = (int)num(f, v, 1, CIFAR_EVAL_VIEWS);
      if (o->eval_views != 1 && o->eval_views != 2 && o->eval_views != CIFAR_EVAL_VIEWS)
        die("--eval-views must be 1, 2 or %d, got '%s'", CIFAR_EVAL_VIEWS, v);
    }
    else if (!strcmp(f, "--device")) {
      if (strcmp(v, "cpu") && strcmp(v, "gpu") && strcmp(v, "auto"))
        die("--device must be cpu, gpu or auto, got '%s'", v);
      snprintf(o->device, sizeof o->device, "%s", v);
    }
    else if (!strcmp(f, "--cosine-floor")) {
      const char *colon = strchr(v, ':');
      if (!colon) die("--cosine-floor must be EPOCH:FACTOR (e.g. 75:0.2), got '%s'", v);
      char ep[64];
      snprintf(ep, sizeof ep, "%.*s", (int)(colon - v), v);
      o->cosine = 1;
      o->floor_epoch = num("--cosine-floor EPOCH", ep, 1e-6, 1e6);
      o->floor_factor = num("--cosine-floor FACTOR", colon + 1, 0, 1);
    }
    else if (!strcmp(f, "--lr-decay")) {
      char *colon = strchr(v, ':');
      if (!colon) die("--lr-decay must be RATE:EPOCHS (e.g. 0.1:350), got '%s'", v);
      char rate[64];
      snprintf(rate, sizeof rate, "%.*s", (int)(colon - v), v);
      o->decay_rate = num("--lr-decay RATE", rate, 1e-9, 1);
      o->decay_epochs = num("--lr-decay EPOCHS", colon + 1, 1e-6, 1e9);
    } else die("unknown option '%s' (see --help)", f);
  }
  if (o->decay_rate > 0 && o->cosine)
    die("--lr-decay and --cosine%s: choose one schedule", o->floor_epoch > 0 ? "-floor" : "");
}

static int default_threads(void) {
  const char *v = getenv("SLURM_CPUS_PER_TASK");
  if (v && atoi(v) > 0) return atoi(v);
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const char *local = getenv("PS_LOCAL_WORKERS"); /* psrun --local: share the cores */
  int share = local && atoi(local) > 0 ? atoi(local) : 1;
  long t = cores / share;
  return t < 1 ? 1 : (int)t;
}

/* The compute backend --device asks for; says which on stderr (w: the
 * worker index, -1 for --bench). gpu: Slurm's CUDA_VISIBLE_DEVICES leaves
 * one visible GPU per task; else local rank modulo the visible ones.
 * gpu with no GPU at all exits CNN_EXIT_NO_GPU; gpu or auto with a GPU
 * that is there but cannot be used exits 1 (die), never falls back. */
static const cnn_backend *pick_backend(const opts *o, int w, int threads) {
  int want_gpu = !strcmp(o->device, "gpu"), maybe = !strcmp(o->device, "auto");
  char err[512] = "no CUDA device visible", label[32] = "cifar_worker";
  if (w >= 0) snprintf(label, sizeof label, "cifar_worker %d", w);
  if (want_gpu || maybe) {
    int absent = cnn_cuda_absent(err, sizeof err);
    int count = absent ? 0 : cnn_cuda_device_count();
    const char *why = "";
    int dev = cnn_cuda_pick_device(count, &why);
    const cnn_backend *be = NULL;
    if (!absent) be = cnn_backend_cuda(dev >= 0 ? dev : 0, err, sizeof err);
    if (!absent && !be)
      die("--device %s: a GPU is present but cannot be used: %s", o->device, err);
    if (be) {
      char name[256];
      const char *vis = getenv("CUDA_VISIBLE_DEVICES");
      cnn_cuda_device_name(dev, name, sizeof name);
      fprintf(stderr, "%s: device gpu %d of %d (%s; %s; CUDA_VISIBLE_DEVICES=%s)\n", label, dev,
              count, name, why, vis ? vis : "unset");
      return be;
    }
    if (want_gpu) {
      fprintf(stderr, "%s: --device gpu: no GPU: %s\n", label, err);
      exit(CNN_EXIT_NO_GPU);
    }
    fprintf(stderr, "%s: --device auto: no GPU (%s), using the CPU\n", label, err);
  }
  fprintf(stderr, "%s: device cpu (%d threads)\n", label, threads);
  return cnn_backend_cpu(threads);
}

/* Values of the parameters for --bench (no parameter server). */
static void bench(const opts *o) {
  int threads = o->threads ? o->threads : default_threads();
  const cnn_backend *be = pick_backend(o, -1, threads);
  cnn *m;
  if (cnn_create(be, o->batch, o->lrn, &m) != 0)
    die("cannot create the model (out of memory?)");
  float *bufs[64];
  for (int i = 0; i < cnn_num_params(); i++) {
    const cnn_param *p = cnn_param_info(i);
    size_t n = 1;
    for (int d = 0; d < p->ndim; d++) n *= (size_t)p->shape[d];
    bufs[2 * i] = malloc(n * sizeof(float));
    bufs[2 * i + 1] = calloc(n, sizeof(float));
    if (!bufs[2 * i] || !bufs[2 * i + 1]) die("out of memory");
    ps_init init = PS_SIZED(ps_init, (ps_init_kind)p->init_kind, p->init_a, p->init_b, o->seed);
    ps_init_fill(&init, p->name, p->shape, p->ndim, bufs[2 * i], n);
    cnn_bind(m, i, bufs[2 * i], bufs[2 * i + 1]);
  }
  cnn_values_on_device(m, 1); /* local SGD: the values stay on a GPU */
  float *img = cnn_host_alloc(be, (size_t)o->batch * IMG_FLOATS * sizeof(float));
  uint8_t *lab = cnn_host_alloc(be, (size_t)o->batch);
  if (!img || !lab) die("out of memory");
  uint64_t x = o->seed * 0x9e3779b97f4a7c15ULL + 1;
  for (size_t i = 0; i < (size_t)o->batch * IMG_FLOATS; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    img[i] = (float)((x >> 40) * (1.0 / 16777216.0)) * 2 - 1;
  }
  for (int i = 0; i < o->batch; i++) lab[i] = (uint8_t)(i % 10);
  for (int i = 0; i < 3; i++) {
    cnn_train_step(m, img, lab, o->batch);
    cnn_sgd_local(m, 0.01f);
  }
  double t0 = now_s();
  for (int i = 0; i < o->bench_steps; i++) {
    cnn_train_step(m, img, lab, o->batch);
    cnn_sgd_local(m, 0.01f);
  }
  double dt = now_s() - t0;
  double ips = (double)o->batch * o->bench_steps / dt;
  if (cnn_error(m)) die("training step failed: %s", cnn_error(m));
  printf("{\"images_per_sec\":%.2f,\"threads\":%d,\"batch\":%d,\"lrn\":%s,\"gflops\":%.2f,"
         "\"device\":\"%s\"}\n",
         ips, threads, o->batch, o->lrn ? "true" : "false",
         cnn_train_flops(m, o->batch) * o->bench_steps / dt / 1e9, cnn_backend_name(be));
  cnn_destroy(m);
  cnn_host_free(be, img);
  cnn_host_free(be, lab);
  for (int i = 0; i < 2 * cnn_num_params(); i++) free(bufs[i]);
}

/* Test accuracy of the current parameters over the whole test set, each
 * image predicted from the mean softmax of `views` views (1: the centre
 * crop). A failed evaluation is fatal: its predictions were never written,
 * and counting them gave a plausible-looking accuracy (0.1 from zeroed
 * memory) instead of the error. */
typedef struct evalbuf {
  float *img, *logits, *prob; /* batch x 1728, batch x 10, batch x 10 */
  uint8_t *lab;
} evalbuf;

static double evaluate(cnn *m, const cifar_set *test, int B, int views, const evalbuf *e) {
  size_t right = 0;
  enum { K = CNN_NUM_CLASSES };
  for (size_t first = 0; first < test->n; first += (size_t)B) {
    int n = test->n - first < (size_t)B ? (int)(test->n - first) : B;
    memset(e->prob, 0, (size_t)n * K * sizeof(float));
    for (int v = 0; v < views; v++) {
      /* 2 views: the centre crop (0) and its mirror (5) */
      cifar_eval_view(test, first, n, views == 2 ? v * 5 : v, e->img, e->lab);
      if (cnn_eval_logits(m, e->img, n, e->logits) != 0)
        die("evaluation failed: %s", cnn_error(m) ? cnn_error(m) : "bad arguments");
      for (int i = 0; i < n; i++) {
        const float *z = e->logits + (size_t)i * K;
        float mx = z[0], sum = 0, p[K];
        for (int k = 1; k < K; k++) mx = z[k] > mx ? z[k] : mx;
        for (int k = 0; k < K; k++) sum += p[k] = expf(z[k] - mx);
        for (int k = 0; k < K; k++) e->prob[(size_t)i * K + k] += p[k] / sum;
      }
    }
    for (int i = 0; i < n; i++) {
      int best = 0;
      for (int k = 1; k < K; k++)
        if (e->prob[(size_t)i * K + k] > e->prob[(size_t)i * K + best]) best = k;
      right += best == e->lab[i];
    }
  }
  return test->n ? (double)right / (double)test->n : 0;
}

/* Exit status of a worker stopped on request after a checkpoint (preempted,
 * walltime): EX_TEMPFAIL, as psd uses, so scripts can requeue. */
#define EXIT_STOPPED PS_EXIT_STOPPED

/* SIGTERM/SIGUSR1 from Slurm (preemption, --signal, walltime): ask the job
 * to checkpoint and stop instead of dying mid-step. The handler only sets
 * a flag (the client may not exist yet, or be gone); the training loop
 * passes it on with ps_client_request_stop. */
static volatile sig_atomic_t g_stop;
static void on_stop_signal(int sig) {
  (void)sig;
  g_stop = 1;
}

/* One worker's training run: what the stages of main share. */
typedef struct trainer {
  opts o;
  cifar_set train, test;     /* test: the chief's only */
  ps_client *c;
  int w, nw, chief, threads;
  cifar_sampler *sp;
  double steps_per_epoch;
  long total;                /* steps of the whole run (global) */
  const cnn_backend *be;
  cnn *m;
  ps_var *vars[64];
  uint64_t step, first_step;
  FILE *metrics;
  evalbuf ev;                /* evaluation batch */
  float *avg[64];            /* --average: the servers' moving averages */
  float *pimg[2];            /* prefetch buffers (page-locked on a GPU) */
  uint8_t *plab[2];
  cifar_prefetch *pf;
  /* The training loop: progress since the last report. */
  double t0, last_report, epoch, wall;
  double acc[2], acc_views[2]; /* test accuracy (centre crop; --eval-views):
                                  the parameters, their moving average */
  uint64_t report_step;
  double loss_sum;
  int loss_n;
  float loss;                /* of the last step */
  int stopped;               /* PS_ESTOPPED: the job stops after a checkpoint */
} trainer;

/* Signals, the training set, the client (from psrun's environment), the
 * chief's test set, the worker's shard and the number of steps. */
static void trainer_setup(trainer *t) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGUSR1, &sa, NULL);
  const opts *o = &t->o;
  if (!o->data[0]) die("--data DIR is required (see --help; cifar_synth makes a small data set)");
  char err[1024];
  if (cifar_load_train(o->data, &t->train, err, sizeof err) != 0) die("%s", err);
  if (ps_client_create_from_env(&t->c, err, sizeof err) != 0)
    die("%s (run cifar_worker under psrun)", err);
  t->w = ps_client_worker_index(t->c);
  t->nw = ps_client_num_workers(t->c);
  t->chief = t->w == 0;
  if (t->chief && cifar_load_test(o->data, &t->test, err, sizeof err) != 0) die("%s", err);
  t->threads = o->threads ? o->threads : default_threads();
  t->sp = cifar_sampler_create(&t->train, t->w, t->nw, o->seed);
  if (!t->sp) die("training set too small for %d workers", t->nw);
  if (cifar_sampler_set_contrast(t->sp, o->contrast_lo, o->contrast_hi) != 0)
    die("--contrast %g:%g refused", o->contrast_lo, o->contrast_hi);
  /* Steps: every worker sees its shard once per epoch. */
  t->steps_per_epoch = (double)t->train.n / ((double)t->nw * o->batch);
  t->total = o->steps ? o->steps : (long)ceil(o->epochs * t->steps_per_epoch);
}

/* The model, its parameters as psd variables (the chief initializes
 * them) and the first pull, which says where the run resumes. */
static void trainer_connect(trainer *t) {
  const opts *o = &t->o;
  t->be = pick_backend(o, t->w, t->threads);
  if (cnn_create(t->be, o->batch, o->lrn, &t->m) != 0)
    die("cannot create the model (out of memory?)");
  if (cnn_set_label_smoothing(t->m, (float)o->smooth) != 0)
    die("--label-smoothing %g refused", o->smooth);
  ps_optimizer opt;
  ps_optimizer_default(&opt, o->lr);
  if (o->momentum > 0) {
    opt.kind = PS_OPT_MOMENTUM;
    opt.momentum = o->momentum;
  }
  if (o->decay_rate > 0) {
    opt.decay = PS_DECAY_STEP;
    opt.decay_rate = o->decay_rate;
    opt.decay_steps = (uint64_t)fmax(1, round(o->decay_epochs * t->steps_per_epoch));
  }
  opt.warmup_steps = (uint64_t)round(o->warmup_epochs * t->steps_per_epoch);
  if (o->average > 0) {
    opt.average = PS_AVERAGE_EMA_NUM_UPDATES;
    opt.average_decay = o->average;
  }
  if (o->cosine) {
    opt.decay = PS_DECAY_COSINE;
    opt.total_steps = (uint64_t)t->total;
    if (o->floor_epoch > 0) {
      opt.total_steps = (uint64_t)fmax(1, round(o->floor_epoch * t->steps_per_epoch));
      opt.min_lr_factor = o->floor_factor;
    }
    if (opt.total_steps <= opt.warmup_steps) die("--cosine needs more steps than the warm-up");
  }
  for (int i = 0; i < cnn_num_params(); i++) {
    const cnn_param *p = cnn_param_info(i);
    ps_init init = PS_SIZED(ps_init, (ps_init_kind)p->init_kind, p->init_a, p->init_b, o->seed);
    ps_var *v;
    /* The recipe's weight decay is part of the model's gradient (the L2
     * loss term); --conv-decay's is the servers' per-variable L2. */
    ps_optimizer vopt = opt;
    if (!strncmp(p->name, "conv", 4) && strstr(p->name, "/weights")) vopt.weight_decay = o->conv_decay;
    if (ps_client_var_create(t->c, p->name, p->shape, p->ndim, &init, &vopt, &v) != 0)
      die("creating %s: %s", p->name, ps_client_errmsg(t->c));
    cnn_bind(t->m, i, ps_var_data(v), ps_var_grad(v));
    t->vars[i] = v;
  }
  if (ps_client_pull(t->c, 0, &t->step) != 0) die("pull: %s", ps_client_errmsg(t->c));
  if (t->step > 0)
    fprintf(stderr, "cifar_worker %d: resuming at step %llu\n", t->w,
            (unsigned long long)t->step);
  fprintf(stderr,
          "cifar_worker %d/%d: %zu training images (shard %zu), batch %d (global %d), %ld steps, "
          "%d threads, lrn %s\n",
          t->w, t->nw, t->train.n, cifar_sampler_size(t->sp), o->batch, o->batch * t->nw,
          t->total, t->threads, o->lrn ? "on" : "off");
}

/* The --metrics file, the evaluation batch and the prefetch thread. */
static void trainer_buffers(trainer *t) {
  const opts *o = &t->o;
  if (o->metrics[0]) {
    /* Workers of one job share the option: the chief writes FILE, worker
     * i FILE.w<i>, so no two processes write one file. */
    char path[4200];
    if (t->w == 0) snprintf(path, sizeof path, "%s", o->metrics);
    else snprintf(path, sizeof path, "%s.w%d", o->metrics, t->w);
    /* Created as psd's own outputs are (common/wfile.c): never through a
     * link or into a file another user planted, mode 0600. */
    char err[1200];
    if (!(t->metrics = ps__wfile_stream(path, 0600, "--metrics", err, sizeof err)))
      die("%s", err);
  }
  t->ev.img = malloc((size_t)o->batch * IMG_FLOATS * sizeof(float));
  t->ev.lab = malloc((size_t)o->batch);
  t->ev.logits = malloc((size_t)o->batch * CNN_NUM_CLASSES * sizeof(float));
  t->ev.prob = malloc((size_t)o->batch * CNN_NUM_CLASSES * sizeof(float));
  if (!t->ev.img || !t->ev.lab || !t->ev.logits || !t->ev.prob) die("out of memory");
  for (int i = 0; o->average > 0 && t->chief && i < cnn_num_params(); i++)
    if (!(t->avg[i] = malloc(ps_var_numel(t->vars[i]) * sizeof(float)))) die("out of memory");
  /* The next batch is made in the background while a step trains, into
   * page-locked buffers on a GPU (copied by DMA straight from there). */
  for (int i = 0; i < 2; i++) {
    t->pimg[i] = cnn_host_alloc(t->be, (size_t)o->batch * IMG_FLOATS * sizeof(float));
    t->plab[i] = cnn_host_alloc(t->be, (size_t)o->batch);
    if (!t->pimg[i] || !t->plab[i]) die("out of memory");
  }
  t->pf = cifar_prefetch_create(t->sp, o->batch, t->pimg, t->plab);
  if (!t->pf) die("cannot start the prefetch thread: %s", strerror(errno));
}

/* A progress line on stderr (and in --metrics) at time `now`, with the
 * test accuracy when the chief has just evaluated. */
static void trainer_report(trainer *t, double now, int do_eval) {
  int w = t->w, B = t->o.batch;
  unsigned long long step = (unsigned long long)t->step;
  double ips = (double)(t->step - t->report_step) * B * t->nw / (now - t->last_report);
  double eta = ips > 0 ? (double)(t->total - (long)t->step) * B * t->nw / ips : 0;
  double loss = t->loss_sum / t->loss_n;
  fprintf(stderr, "w%d step %llu epoch %.2f loss %.4f images/s %.1f eta %.0fs%s\n", w, step,
          t->epoch, loss, ips, eta, do_eval ? "" : "");
  if (do_eval && t->o.average > 0)
    fprintf(stderr, "w%d step %llu test accuracy %.4f (moving average %.4f)\n", w, step, t->acc[0],
            t->acc[1]);
  else if (do_eval)
    fprintf(stderr, "w%d step %llu test accuracy %.4f\n", w, step, t->acc[0]);
  if (t->metrics) {
    fprintf(t->metrics,
            "{\"worker\":%d,\"wall_s\":%.3f,\"step\":%llu,\"epoch\":%.4f,\"loss\":%.5f,"
            "\"images_per_sec\":%.2f",
            w, now - t->t0, step, t->epoch, loss, ips);
    if (do_eval) fprintf(t->metrics, ",\"test_accuracy\":%.5f", t->acc[0]);
    if (do_eval && t->o.average > 0)
      fprintf(t->metrics, ",\"test_accuracy_average\":%.5f", t->acc[1]);
    fprintf(t->metrics, "}\n");
    fflush(t->metrics);
  }
  t->last_report = now;
  t->report_step = t->step;
  t->loss_sum = 0;
  t->loss_n = 0;
}

/* One step: gradients on the next batch, push and pull. 0, or 1 when the
 * job stops (after a checkpoint). */
static int trainer_step(trainer *t) {
  const float *bimg;
  const uint8_t *blab;
  t->epoch = cifar_prefetch_get(t->pf, t->step, &bimg, &blab);
  t->loss = cnn_train_step(t->m, bimg, blab, t->o.batch);
  if (isnan(t->loss) && cnn_error(t->m)) die("training step failed: %s", cnn_error(t->m));
  t->loss_sum += t->loss;
  t->loss_n++;
  int stale = 0;
  if (g_stop) ps_client_request_stop(t->c);
  int rc = ps_client_step(t->c, &t->step, &stale);
  if (rc == PS_ESTOPPED) {
    fprintf(stderr, "cifar_worker %d: %s\n", t->w, ps_client_errmsg(t->c));
    return 1;
  }
  if (rc != 0) die("step: %s", ps_client_errmsg(t->c));
  return 0;
}

/* The chief's evaluation with `views` views: acc[0] of the parameters,
 * and with --average acc[1] of the servers' moving averages (bound in
 * their place for the evaluation, then the variables' own buffers again). */
static void trainer_evaluate(trainer *t, int views, double acc[2]) {
  const opts *o = &t->o;
  int n = cnn_num_params();
  acc[0] = evaluate(t->m, &t->test, o->batch, views, &t->ev);
  if (o->average <= 0) return;
  if (ps_client_pull_average(t->c, t->vars, (size_t)n, t->avg, NULL) != 0)
    die("pulling the moving averages: %s", ps_client_errmsg(t->c));
  for (int i = 0; i < n; i++) cnn_bind(t->m, i, t->avg[i], ps_var_grad(t->vars[i]));
  acc[1] = evaluate(t->m, &t->test, o->batch, views, &t->ev);
  for (int i = 0; i < n; i++) cnn_bind(t->m, i, ps_var_data(t->vars[i]), ps_var_grad(t->vars[i]));
}

/* Steps until the total (or a stop), reporting about once a second and
 * when the chief evaluates (--eval-every). */
static void trainer_train(trainer *t) {
  const opts *o = &t->o;
  t->t0 = now_s();
  t->last_report = t->t0;
  t->acc[0] = t->acc[1] = NAN;
  t->first_step = t->report_step = t->step;
  while ((long)t->step < t->total) {
    if (trainer_step(t) != 0) {
      t->stopped = 1;
      break;
    }
    double now = now_s();
    int do_eval = t->chief && o->eval_every > 0 && t->step % (uint64_t)o->eval_every == 0 &&
                  (long)t->step < t->total;
    if (do_eval) trainer_evaluate(t, 1, t->acc); /* the curve: centre crops */
    if (now - t->last_report >= 1.0 || do_eval) trainer_report(t, now, do_eval);
  }
  t->wall = now_s() - t->t0;
}

/* The chief's final accuracies as JSON fields: test_accuracy (centre
 * crops), with --average test_accuracy_average, with --eval-views N > 1
 * the same two predicted from N views ("..._views", and "eval_views"). */
static void acc_fields(const trainer *t, char *buf, size_t len) {
  const opts *o = &t->o;
  int k = snprintf(buf, len, "\"test_accuracy\":%.5f", t->acc[0]);
  if (o->average > 0) k += snprintf(buf + k, len - k, ",\"test_accuracy_average\":%.5f", t->acc[1]);
  if (o->eval_views > 1)
    k += snprintf(buf + k, len - k, ",\"eval_views\":%d,\"test_accuracy_views\":%.5f", o->eval_views,
                  t->acc_views[0]);
  if (o->eval_views > 1 && o->average > 0)
    snprintf(buf + k, len - k, ",\"test_accuracy_average_views\":%.5f", t->acc_views[1]);
}

/* After the loop: the chief's final accuracy and --dump-params, the
 * client's finish, the last --metrics line and the JSON line on stdout
 * (none when the job stopped: the run goes on when it is run again). */
static void trainer_end(trainer *t) {
  const opts *o = &t->o;
  int w = t->w, nw = t->nw, chief = t->chief, stopped = t->stopped;
  if (chief && !stopped) trainer_evaluate(t, 1, t->acc);
  if (chief && !stopped && o->eval_views > 1) trainer_evaluate(t, o->eval_views, t->acc_views);
  if (chief && o->dump[0] && !stopped) {
    ps__wfile wf;
    char err[1200];
    if (ps__wfile_begin(&wf, o->dump, 0600, "--dump-params", err, sizeof err) != 0) die("%s", err);
    for (int i = 0; i < cnn_num_params(); i++)
      fwrite(ps_var_data(t->vars[i]), sizeof(float), ps_var_numel(t->vars[i]), wf.fp);
    if (ps__wfile_commit(&wf, 0, err, sizeof err) != 0) die("%s", err);
  }
  if (ps_client_finish(t->c) != 0) die("finish: %s", ps_client_errmsg(t->c));
  unsigned long long step = (unsigned long long)t->step;
  double wall = t->wall, epochs = (double)t->step / t->steps_per_epoch;
  double ips = wall > 0 ? (double)(t->step - t->first_step) * o->batch * nw / wall : 0;
  char accs[256];
  acc_fields(t, accs, sizeof accs);
  if (t->metrics && !stopped) {
    fprintf(t->metrics,
            "{\"worker\":%d,\"wall_s\":%.3f,\"step\":%llu,\"epoch\":%.4f,\"loss\":%.5f,"
            "\"images_per_sec\":%.2f%s",
            w, wall, step, epochs, t->loss, ips, chief ? "" : "}\n");
    if (chief) fprintf(t->metrics, ",%s}\n", accs);
  }
  if (t->metrics) fclose(t->metrics);
  t->metrics = NULL;
  if (stopped)
    ; /* the run goes on when the job is run again */
  else if (chief) {
    printf("{%s,\"images_per_sec\":%.1f,\"steps\":%llu,\"epochs\":%.3f,"
           "\"wall_s\":%.2f,\"workers\":%d,\"batch\":%d,\"loss\":%.4f}\n",
           accs, ips, step, epochs, wall, nw, o->batch, t->loss);
  }
  else
    printf("{\"test_accuracy\":null,\"images_per_sec\":%.1f,\"steps\":%llu,\"epochs\":%.3f,"
           "\"wall_s\":%.2f,\"worker\":%d,\"loss\":%.4f}\n",
           ips, step, epochs, wall, w, t->loss);
}

/* The one cleanup path (errors before it exit through die). */
static void trainer_free(trainer *t) {
  if (t->metrics) fclose(t->metrics);
  cifar_prefetch_destroy(t->pf);
  cnn_destroy(t->m);
  for (int i = 0; i < 2; i++) {
    cnn_host_free(t->be, t->pimg[i]);
    cnn_host_free(t->be, t->plab[i]);
  }
  cifar_sampler_destroy(t->sp);
  cifar_set_free(&t->train);
  cifar_set_free(&t->test);
  ps_client_destroy(t->c);
  free(t->ev.img);
  free(t->ev.lab);
  free(t->ev.logits);
  free(t->ev.prob);
  for (int i = 0; i < 64; i++) free(t->avg[i]);
}

int main(int argc, char **argv) {
  static trainer t; /* zeroed; large (the option paths) */
  parse(&t.o, argc, argv);
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (t.o.bench) {
    bench(&t.o);
    return 0;
  }
  trainer_setup(&t);
  trainer_connect(&t);
  trainer_buffers(&t);
  trainer_train(&t);
  trainer_end(&t);
  trainer_free(&t);
  return t.stopped ? EXIT_STOPPED : 0;
}
