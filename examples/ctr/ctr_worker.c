/*
 * ctr_worker - a click-through-rate model trained through psd: one
 * embedding row per categorical id (a psd sparse table: each step pulls
 * and pushes only the rows its batch touches), the F embeddings of a
 * record concatenated with its dense features, a two-hidden-layer ReLU MLP
 * (psd variables) and a sigmoid, logistic loss. Data: ctr_synth's format
 * (ctr_data.h). Run it under psrun:
 *
 *   ctr_synth --out DIR
 *   psrun --local -n 3 --ps 1 -- ctr_worker --data DIR --epochs 1
 *
 * Each step: the batch's keys (batch x fields), ps_table_pull at the
 * current step, forward and backward on the CPU, ps_table_add_grad with
 * each key's gradient, ps_client_step (pushes the MLP's and the table's
 * gradients, pulls the MLP for the next step). The chief evaluates
 * logloss and AUC on the test split with read-only pulls.
 * `--embed dense` keeps the embedding as one dense variable instead (the
 * benchmark's baseline), `--local` trains without psd.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <linux/tcp.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ctr_data.h"
#include "ctr_embed.h"
#include "ctr_model.h"
#include "psclient.h"
#include "wfile.h" /* common/: output files created safely */

/* Exit status of a worker stopped on request after a checkpoint (as
 * cifar_worker and psd: EX_TEMPFAIL, so scripts can requeue). */
#define EXIT_STOPPED 75

typedef struct opts {
  char data[4096];
  double epochs;
  long steps;
  int batch, dim, h1, h2, threads, warmup;
  ps_table_opt opt;
  double lr, l1, l2, init_scale, mlp_lr;
  int mlp_adam;
  uint64_t capacity, hash_rows, seed;
  ctr_emb_kind embed;
  int local, no_eval, opt_given;
  long eval_every, eval_max, eval_batch;
  char metrics[4096], trace[4096];
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
  fprintf(stderr, "ctr_worker: ");
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

static void usage(FILE *f) {
  fprintf(f,
    "usage: ctr_worker --data DIR [--epochs E | --steps S] [--batch B] [options]\n"
    "Trains a CTR model (embeddings -> MLP -> sigmoid) through psd; run it under psrun:\n"
    "  psrun --local -n 3 --ps 1 -- ctr_worker --data DIR\n"
    "Data (ctr_synth makes it):\n"
    "  --data DIR         DIR/train.bin and DIR/test.bin\n"
    "  --epochs E         epochs over the training set [1]\n"
    "  --steps S          steps instead of epochs\n"
    "  --batch B          records per worker per step; global batch = workers x B [256]\n"
    "Embeddings:\n"
    "  --dim N            floats per embedding row [8]\n"
    "  --opt R            the rows' update rule on psd: sgd, adagrad, adam, ftrl\n"
    "                     [adagrad; sgd with --embed dense, which takes sgd or adam]\n"
    "  --lr X             its learning rate [sgd 0.5, adagrad 0.1, adam 0.002, ftrl 0.05]\n"
    "  --l1 X, --l2 X     ftrl's regularization [0, 0]\n"
    "  --init-scale X     rows start uniform in [-X, X) (ftrl: zeros) [0.05]\n"
    "  --capacity N       rows the table may hold (each ps ceil(N / ps)); past it the\n"
    "                     least recently used row is evicted [2097152]\n"
    "  --hash-rows R      map every key to one of R rows (key hash mod R) [0: keys as they are]\n"
    "  --embed K          table (psd sparse table) or dense (one R x dim variable pushed\n"
    "                     and pulled whole every step; needs --hash-rows) [table]\n"
    "MLP:\n"
    "  --hidden H1,H2     hidden layer widths [128,64]\n"
    "  --mlp-opt O        sgd or adam, run by psd [adam]\n"
    "  --mlp-lr X         its learning rate [adam 0.003, sgd 0.1]\n"
    "Evaluation and output:\n"
    "  --eval-every N     the chief evaluates logloss and AUC every N steps [0: at the end]\n"
    "  --eval-max N       records of the test split to evaluate [all]\n"
    "  --eval-batch N     records per evaluation batch (read-only pulls) [4096]\n"
    "  --no-eval          no evaluation at all (benchmarks)\n"
    "  --metrics FILE     JSON lines: progress and evaluations (worker i>0: FILE.w<i>)\n"
    "  --trace FILE       one line per step: step and this worker's batch loss (%%.9g)\n"
    "                     (worker i>0: FILE.w<i>)\n"
    "  --warmup N         steps left out of the timing figures [5]\n"
    "Other:\n"
    "  --threads T        OpenBLAS threads [1]\n"
    "  --seed N           initial values [1]\n"
    "  --local            train in this process alone, no psd (embeddings in a local hash\n"
    "                     table; --opt sgd or adagrad): the compute alone, a reference\n"
    "Exit status: 0 done, 1 an error (a sentence on stderr), 75 the job stopped on\n"
    "request after a checkpoint (run it again to resume).\n"
    "stdout: one JSON line at the end (auc, logloss, steps, samples_per_sec, step_ms,\n"
    "bytes_sent_per_step, ...; auc null for workers other than the chief).\n");
}

static double num(const char *flag, const char *v, double lo, double hi) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || end == v || *end || !isfinite(x) || x < lo || x > hi)
    die("%s must be a number from %g to %g, got '%s'", flag, lo, hi, v);
  return x;
}

static int choice(const char *flag, const char *v, const char *const *names, int n) {
  for (int i = 0; i < n; i++)
    if (!strcmp(v, names[i])) return i;
  die("%s: unknown value '%s' (see --help)", flag, v);
}

static void defaults(opts *o) {
  memset(o, 0, sizeof *o);
  o->epochs = 1;
  o->batch = 256;
  o->dim = 8;
  o->h1 = 128;
  o->h2 = 64;
  o->threads = 1;
  o->warmup = 5;
  o->opt = PS_TOPT_ADAGRAD;
  o->init_scale = 0.05;
  o->mlp_adam = 1;
  o->capacity = 1 << 21;
  o->seed = 1;
  o->embed = CTR_EMB_TABLE;
  o->eval_batch = 4096;
}

/* Options with a value; 0, or -1 for a flag this does not know. */
static int parse_value(opts *o, const char *f, const char *v) {
  static const char *const rules[] = {"sgd", "adagrad", "adam", "ftrl"};
  static const char *const mlp[] = {"sgd", "adam"};
  static const char *const embeds[] = {"table", "dense"};
  if (!strcmp(f, "--data")) snprintf(o->data, sizeof o->data, "%s", v);
  else if (!strcmp(f, "--epochs")) o->epochs = num(f, v, 1e-6, 1e6);
  else if (!strcmp(f, "--steps")) o->steps = (long)num(f, v, 1, 1e12);
  else if (!strcmp(f, "--batch")) o->batch = (int)num(f, v, 1, 65536);
  else if (!strcmp(f, "--dim")) o->dim = (int)num(f, v, 1, 1024);
  else if (!strcmp(f, "--opt")) {
    o->opt = (ps_table_opt)choice(f, v, rules, 4);
    o->opt_given = 1;
  }
  else if (!strcmp(f, "--lr")) o->lr = num(f, v, 1e-12, 1e3);
  else if (!strcmp(f, "--l1")) o->l1 = num(f, v, 0, 1e6);
  else if (!strcmp(f, "--l2")) o->l2 = num(f, v, 0, 1e6);
  else if (!strcmp(f, "--init-scale")) o->init_scale = num(f, v, 1e-9, 10);
  else if (!strcmp(f, "--capacity")) o->capacity = (uint64_t)num(f, v, 1, 1e12);
  else if (!strcmp(f, "--hash-rows")) o->hash_rows = (uint64_t)num(f, v, 1, 1e12);
  else if (!strcmp(f, "--embed")) o->embed = (ctr_emb_kind)choice(f, v, embeds, 2);
  else if (!strcmp(f, "--mlp-opt")) o->mlp_adam = choice(f, v, mlp, 2);
  else if (!strcmp(f, "--mlp-lr")) o->mlp_lr = num(f, v, 1e-12, 1e3);
  else if (!strcmp(f, "--eval-every")) o->eval_every = (long)num(f, v, 0, 1e12);
  else if (!strcmp(f, "--eval-max")) o->eval_max = (long)num(f, v, 1, 1e12);
  else if (!strcmp(f, "--eval-batch")) o->eval_batch = (long)num(f, v, 1, 1 << 20);
  else if (!strcmp(f, "--metrics")) snprintf(o->metrics, sizeof o->metrics, "%s", v);
  else if (!strcmp(f, "--trace")) snprintf(o->trace, sizeof o->trace, "%s", v);
  else if (!strcmp(f, "--warmup")) o->warmup = (int)num(f, v, 0, 1e6);
  else if (!strcmp(f, "--threads")) o->threads = (int)num(f, v, 1, 256);
  else if (!strcmp(f, "--seed")) o->seed = (uint64_t)num(f, v, 0, 1e15);
  else if (!strcmp(f, "--hidden")) {
    if (sscanf(v, "%d,%d", &o->h1, &o->h2) != 2 || o->h1 < 1 || o->h2 < 1 || o->h1 > 65536 ||
        o->h2 > 65536)
      die("--hidden must be H1,H2 (two widths, e.g. 128,64), got '%s'", v);
  } else return -1;
  return 0;
}

static void parse(opts *o, int argc, char **argv) {
  defaults(o);
  for (int a = 1; a < argc; a++) {
    const char *f = argv[a];
    if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
      usage(stdout);
      exit(0);
    }
    if (!strcmp(f, "--local")) o->local = 1;
    else if (!strcmp(f, "--no-eval")) o->no_eval = 1;
    else if (a + 1 >= argc) die("option %s needs a value (see --help)", f);
    else if (parse_value(o, f, argv[++a]) != 0) die("unknown option '%s' (see --help)", f);
  }
  if (!o->data[0]) die("--data DIR is required (see --help; ctr_synth makes a data set)");
  if (o->embed == CTR_EMB_DENSE && !o->opt_given) o->opt = PS_TOPT_SGD;
  if (o->embed == CTR_EMB_DENSE && o->opt != PS_TOPT_SGD && o->opt != PS_TOPT_ADAM)
    die("--embed dense takes --opt sgd or adam (psd's rules for variables) [sgd]");
  static const double lr_of[] = {0.5, 0.1, 0.002, 0.05};
  if (o->lr == 0) o->lr = lr_of[o->opt];
  if (o->mlp_lr == 0) o->mlp_lr = o->mlp_adam ? 0.003 : 0.1;
  if (o->embed == CTR_EMB_DENSE && !o->hash_rows)
    die("--embed dense needs --hash-rows R (the variable's rows)");
  if (o->embed == CTR_EMB_DENSE && o->local) die("--local keeps its own table: no --embed dense");
  if (o->local && o->opt != PS_TOPT_SGD && o->opt != PS_TOPT_ADAGRAD)
    die("--local implements --opt sgd and adagrad only");
}

/* Bytes this process's TCP connections (the ones to psd) have sent (and
 * had acknowledged) and received so far, from the kernel's TCP_INFO. */
static void tcp_bytes(uint64_t *sent, uint64_t *recv) {
  *sent = *recv = 0;
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  while (d && (e = readdir(d)) != NULL) {
    int fd = atoi(e->d_name);
    if (e->d_name[0] == '.' || fd == dirfd(d)) continue;
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) continue;
    if (len < offsetof(struct tcp_info, tcpi_bytes_received) + sizeof ti.tcpi_bytes_received)
      continue;
    *sent += ti.tcpi_bytes_acked;
    *recv += ti.tcpi_bytes_received;
  }
  if (d) closedir(d);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v); 0 when empty. */
static double median(double *v, size_t n) {
  if (!n) return 0;
  qsort(v, n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* SIGTERM/SIGUSR1 (preemption, walltime): ask the job to stop after a
 * checkpoint; the training loop passes the flag on. */
static volatile sig_atomic_t g_stop;
static void on_stop_signal(int sig) {
  (void)sig;
  g_stop = 1;
}

/* One worker's training run. */
typedef struct trainer {
  opts o;
  ctr_set train, test;
  ps_client *c;       /* NULL with --local */
  int w, nw, chief, F, D;
  long total;
  uint64_t step, first_step, usable; /* usable: records the batches cycle over */
  ctr_mlp *m;
  ctr_emb *emb;
  ps_var *vars[CTR_NPARAMS];
  float *local_params[2 * CTR_NPARAMS];
  /* one batch */
  uint64_t *keys, *sorted;
  float *rows, *dense, *labels;
  /* evaluation */
  float *eprob, *elabel;
  double auc, logloss;
  FILE *metrics, *trace;
  /* timing (steps after the warm-up) */
  double *t_pull, *t_compute, *t_push, *t_step;
  size_t ntimed;
  uint64_t sent0, recv0, sent1, recv1;
  double unique_sum;
  long unique_n;
  double t0, wall, last_report, loss_sum, loss;
  long loss_n;
  uint64_t report_step;
  int stopped;
} trainer;

/* Signals, the data, the client (from psrun's environment) and the number
 * of steps. */
static void trainer_setup(trainer *t) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGUSR1, &sa, NULL);
  const opts *o = &t->o;
  char path[4200], err[8500];
  snprintf(path, sizeof path, "%s/train.bin", o->data);
  if (ctr_open(path, &t->train, err, sizeof err) != 0) die("%s", err);
  t->F = t->train.fields;
  t->D = t->train.dense;
  t->nw = 1;
  if (!o->local) {
    if (ps_client_create_from_env(&t->c, err, sizeof err) != 0)
      die("%s (run ctr_worker under psrun, or with --local)", err);
    t->w = ps_client_worker_index(t->c);
    t->nw = ps_client_num_workers(t->c);
  }
  t->chief = t->w == 0;
  if (t->chief && !o->no_eval) {
    snprintf(path, sizeof path, "%s/test.bin", o->data);
    if (ctr_open(path, &t->test, err, sizeof err) != 0) die("%s", err);
    if (t->test.fields != t->F || t->test.dense != t->D)
      die("%s has %d fields and %d dense features, train.bin %d and %d", path, t->test.fields,
          t->test.dense, t->F, t->D);
  }
  /* Step s's global batch is records [s G, s G + G) modulo the largest
   * multiple of G in the file (G = workers x batch), worker w taking the
   * w-th slice of B: 1 worker x 2B and 2 workers x B see the same records. */
  uint64_t G = (uint64_t)t->nw * (uint64_t)o->batch;
  if (t->train.n < G)
    die("%s holds %llu records, fewer than one global batch (%d workers x %d)", path,
        (unsigned long long)t->train.n, t->nw, o->batch);
  t->usable = t->train.n / G * G;
  t->total = o->steps ? o->steps : (long)ceil(o->epochs * (double)t->train.n / (double)G);
}

/* Parameters of --local: initialized as the chief would. */
static void bind_local(trainer *t, int i, const ctr_param_info *p) {
  size_t n = (size_t)p->shape[0] * (size_t)(p->ndim == 2 ? p->shape[1] : 1);
  float *data = malloc(n * sizeof(float)), *grad = calloc(n, sizeof(float));
  if (!data || !grad) die("out of memory");
  ps_init init = PS_SIZED(ps_init, p->glorot ? PS_INIT_GLOROT_UNIFORM : PS_INIT_ZEROS, 0, 0,
                          t->o.seed);
  ps_init_fill(&init, p->name, p->shape, p->ndim, data, n);
  t->local_params[2 * i] = data;
  t->local_params[2 * i + 1] = grad;
  ctr_mlp_bind(t->m, i, data, grad);
}

/* The model: the MLP's variables (the chief initializes them), the
 * embedding, and the first pull, which says where the run resumes. */
static void trainer_connect(trainer *t) {
  const opts *o = &t->o;
  int maxb = o->batch > o->eval_batch ? o->batch : (int)o->eval_batch;
  t->m = ctr_mlp_create(t->F, o->dim, t->D, o->h1, o->h2, maxb, o->threads);
  if (!t->m) die("cannot create the model (out of memory?)");
  ps_optimizer opt;
  ps_optimizer_default(&opt, o->mlp_lr);
  if (o->mlp_adam) opt.kind = PS_OPT_ADAM;
  for (int i = 0; i < CTR_NPARAMS; i++) {
    ctr_param_info p = ctr_mlp_param(t->m, i);
    if (o->local) {
      bind_local(t, i, &p);
      continue;
    }
    ps_init init = PS_SIZED(ps_init, p.glorot ? PS_INIT_GLOROT_UNIFORM : PS_INIT_ZEROS, 0, 0,
                            o->seed);
    if (ps_client_var_create(t->c, p.name, p.shape, p.ndim, &init, &opt, &t->vars[i]) != 0)
      die("creating %s: %s", p.name, ps_client_errmsg(t->c));
    ctr_mlp_bind(t->m, i, ps_var_data(t->vars[i]), ps_var_grad(t->vars[i]));
  }
  ctr_emb_opts eo = {.kind = o->local ? CTR_EMB_LOCAL : o->embed, .dim = (uint32_t)o->dim,
                     .capacity = o->capacity, .rows = o->hash_rows, .opt = o->opt,
                     .lr = o->lr, .init_scale = o->init_scale, .l1 = o->l1, .l2 = o->l2,
                     .seed = o->seed};
  char err[1024];
  if (ctr_emb_create(t->c, &eo, &t->emb, err, sizeof err) != 0) die("%s", err);
  if (t->c && ps_client_pull(t->c, 0, &t->step) != 0) die("pull: %s", ps_client_errmsg(t->c));
  if (t->step > 0)
    fprintf(stderr, "ctr_worker %d: resuming at step %llu\n", t->w, (unsigned long long)t->step);
  static const char *const rules[] = {"sgd", "adagrad", "adam", "ftrl"};
  fprintf(stderr,
          "ctr_worker %d/%d: %llu training records, %d fields x dim %d + %d dense, batch %d "
          "(global %d), %ld steps, embedding: %s (%s, lr %g), MLP %d-%d-1 (%s, lr %g)\n",
          t->w, t->nw, (unsigned long long)t->train.n, t->F, o->dim, t->D, o->batch,
          o->batch * t->nw, t->total,
          o->local ? "local" : o->embed == CTR_EMB_TABLE ? "psd table" : "dense variable",
          rules[o->opt], o->lr, o->h1, o->h2, o->mlp_adam ? "adam" : "sgd", o->mlp_lr);
}

/* Opens FILE for worker 0, FILE.w<i> for worker i (one writer per file). */
static FILE *open_per_worker(const char *name, int w, const char *what) {
  char path[4200];
  if (w == 0) snprintf(path, sizeof path, "%s", name);
  else snprintf(path, sizeof path, "%s.w%d", name, w);
  /* Created as psd's own outputs are (common/wfile.c): never through a
   * link or into a file another user planted, mode 0600. */
  char err[1200];
  FILE *f = ps__wfile_stream(path, 0600, what, err, sizeof err);
  if (!f) die("%s", err);
  return f;
}

/* Batch and evaluation buffers, timing arrays, the output files. */
static void trainer_buffers(trainer *t) {
  const opts *o = &t->o;
  size_t B = (size_t)(o->batch > o->eval_batch ? o->batch : o->eval_batch), F = (size_t)t->F;
  t->keys = malloc(B * F * sizeof *t->keys);
  t->sorted = malloc(B * F * sizeof *t->sorted);
  t->rows = malloc(B * F * (size_t)o->dim * sizeof(float));
  t->dense = malloc(B * ((size_t)t->D + 1) * sizeof(float));
  t->labels = malloc(B * sizeof(float));
  size_t T = (size_t)t->total + 1;
  t->t_pull = malloc(T * sizeof(double));
  t->t_compute = malloc(T * sizeof(double));
  t->t_push = malloc(T * sizeof(double));
  t->t_step = malloc(T * sizeof(double));
  if (!t->keys || !t->sorted || !t->rows || !t->dense || !t->labels || !t->t_pull ||
      !t->t_compute || !t->t_push || !t->t_step)
    die("out of memory");
  if (t->chief && !o->no_eval) {
    size_t n = t->test.n;
    if (o->eval_max && (uint64_t)o->eval_max < n) n = (size_t)o->eval_max;
    t->eprob = malloc(n * sizeof(float) + 1);
    t->elabel = malloc(n * sizeof(float) + 1);
    if (!t->eprob || !t->elabel) die("out of memory");
  }
  if (o->metrics[0]) t->metrics = open_per_worker(o->metrics, t->w, "--metrics");
  if (o->trace[0]) t->trace = open_per_worker(o->trace, t->w, "--trace");
}

/* The key psd sees for a data key: the key itself, or its row with
 * --hash-rows. */
static uint64_t map_key(const opts *o, uint64_t k) {
  if (!o->hash_rows) return k;
  k ^= 0x2545f4914f6cdd1dULL;
  k = (k ^ (k >> 32)) * 0xd6e8feb86659fd93ULL;
  k = (k ^ (k >> 32)) * 0xd6e8feb86659fd93ULL;
  return (k ^ (k >> 32)) % o->hash_rows;
}

/* This worker's records of step s: keys (batch x F), dense, labels. */
static void fill_batch(trainer *t, uint64_t s) {
  const opts *o = &t->o;
  uint64_t G = (uint64_t)t->nw * (uint64_t)o->batch;
  uint64_t base = (s % (t->usable / G)) * G + (uint64_t)t->w * (uint64_t)o->batch;
  for (int i = 0; i < o->batch; i++) {
    uint64_t *k = t->keys + (size_t)i * (size_t)t->F;
    ctr_record(&t->train, base + (uint64_t)i, k, t->dense + (size_t)i * (size_t)t->D,
               &t->labels[i]);
    for (int f = 0; f < t->F; f++) k[f] = map_key(o, k[f]);
  }
}

/* Distinct keys among this batch's n. */
static size_t count_unique(trainer *t, size_t n) {
  memcpy(t->sorted, t->keys, n * sizeof *t->sorted);
  qsort(t->sorted, n, sizeof *t->sorted, cmp_u64);
  size_t u = n ? 1 : 0;
  for (size_t i = 1; i < n; i++) u += t->sorted[i] != t->sorted[i - 1];
  return u;
}

/* Logloss and AUC of the current model on the test split (the chief):
 * read-only pulls, so evaluation creates no rows. Its bytes are left out
 * of the per-step figures. */
static void evaluate(trainer *t) {
  const opts *o = &t->o;
  uint64_t s0, r0, s1, r1;
  if (t->c) tcp_bytes(&s0, &r0);
  size_t n = t->test.n, EB = (size_t)o->eval_batch, F = (size_t)t->F;
  if (o->eval_max && (uint64_t)o->eval_max < n) n = (size_t)o->eval_max;
  for (size_t first = 0; first < n; first += EB) {
    size_t m = n - first < EB ? n - first : EB;
    for (size_t i = 0; i < m; i++) {
      uint64_t *k = t->keys + i * F;
      ctr_record(&t->test, first + i, k, t->dense + i * (size_t)t->D, &t->elabel[first + i]);
      for (size_t f = 0; f < F; f++) k[f] = map_key(o, k[f]);
    }
    if (ctr_emb_pull(t->emb, t->step, t->keys, m * F, t->rows, 1) != 0)
      die("evaluation pull: %s", ps_client_errmsg(t->c));
    ctr_mlp_forward(t->m, m, t->rows, t->dense, NULL, t->eprob + first);
  }
  t->auc = ctr_auc(t->eprob, t->elabel, n);
  t->logloss = ctr_logloss(t->eprob, t->elabel, n);
  if (t->c) {
    tcp_bytes(&s1, &r1);
    t->sent0 += s1 - s0; /* as if the evaluation had moved nothing */
    t->recv0 += r1 - r0;
  }
}

/* One step: the batch's rows, forward and backward, gradients out, and
 * ps_client_step (or the local update). 0, or 1 when the job stops. */
static int trainer_step(trainer *t) {
  const opts *o = &t->o;
  size_t n = (size_t)o->batch * (size_t)t->F;
  uint64_t s = t->step;
  int timed = s >= t->first_step + (uint64_t)o->warmup;
  /* The bytes of the timed steps: from the first one's pull on. */
  if (timed && !t->ntimed && t->c) tcp_bytes(&t->sent0, &t->recv0);
  double a = now_s();
  fill_batch(t, t->step);
  double b = now_s();
  if (ctr_emb_pull(t->emb, t->step, t->keys, n, t->rows, 0) != 0)
    die("pulling the rows of step %llu: %s", (unsigned long long)t->step,
        t->c ? ps_client_errmsg(t->c) : "out of memory");
  double c = now_s();
  t->loss = ctr_mlp_forward(t->m, (size_t)o->batch, t->rows, t->dense, t->labels, NULL);
  const float *demb = ctr_mlp_backward(t->m, (size_t)o->batch, t->labels);
  if (ctr_emb_add_grad(t->emb, t->keys, n, demb) != 0)
    die("adding the rows' gradients: %s", t->c ? ps_client_errmsg(t->c) : "out of memory");
  double d = now_s();
  if (!t->c) {
    if (ctr_mlp_local_update(t->m, o->mlp_adam, o->mlp_lr, t->step) != 0) die("out of memory");
    ctr_emb_local_step(t->emb);
    t->step++;
  } else {
    if (g_stop) ps_client_request_stop(t->c);
    int rc = ps_client_step(t->c, &t->step, NULL);
    if (rc == PS_ESTOPPED) {
      fprintf(stderr, "ctr_worker %d: %s\n", t->w, ps_client_errmsg(t->c));
      return 1;
    }
    if (rc != 0) die("step %llu: %s", (unsigned long long)s, ps_client_errmsg(t->c));
    ctr_emb_after_step(t->emb);
  }
  double e = now_s();
  if (timed) {
    t->t_pull[t->ntimed] = (c - b) * 1e3;
    t->t_compute[t->ntimed] = ((b - a) + (d - c)) * 1e3;
    t->t_push[t->ntimed] = (e - d) * 1e3;
    t->t_step[t->ntimed] = (e - a) * 1e3;
    t->ntimed++;
  }
  if (t->trace) fprintf(t->trace, "%llu %.9g\n", (unsigned long long)s, t->loss);
  if (s % 8 == 0) { /* sampled: sorting the keys every step would cost time */
    t->unique_sum += (double)count_unique(t, n);
    t->unique_n++;
  }
  t->loss_sum += t->loss;
  t->loss_n++;
  return 0;
}

/* A progress line on stderr and in --metrics (with the evaluation when
 * the chief has just made one). */
static void trainer_report(trainer *t, double now, int evaluated) {
  const opts *o = &t->o;
  double dt = now - t->last_report, steps = (double)(t->step - t->report_step);
  double sps = dt > 0 ? steps * o->batch * t->nw / dt : 0;
  double uniq = t->unique_n ? t->unique_sum / (double)t->unique_n : 0;
  double loss = t->loss_n ? t->loss_sum / (double)t->loss_n : NAN;
  fprintf(stderr, "w%d step %llu loss %.4f samples/s %.0f%s", t->w,
          (unsigned long long)t->step, loss, sps, evaluated ? "" : "\n");
  if (evaluated) fprintf(stderr, " test logloss %.4f auc %.4f\n", t->logloss, t->auc);
  if (t->metrics) {
    fprintf(t->metrics,
            "{\"worker\":%d,\"wall_s\":%.3f,\"step\":%llu,\"loss\":%.5f,\"samples_per_sec\":%.1f,"
            "\"keys_per_step\":%d,\"unique_keys_per_step\":%.0f,\"rows_per_sec\":%.0f",
            t->w, now - t->t0, (unsigned long long)t->step, loss, sps, o->batch * t->F, uniq,
            dt > 0 ? uniq * steps / dt : 0);
    if (evaluated) fprintf(t->metrics, ",\"auc\":%.5f,\"logloss\":%.5f", t->auc, t->logloss);
    fprintf(t->metrics, "}\n");
    fflush(t->metrics);
  }
  t->last_report = now;
  t->report_step = t->step;
  t->loss_sum = 0;
  t->loss_n = 0;
}

/* Steps until the total (or a stop), reporting about once a second and
 * whenever the chief evaluates (--eval-every). */
static void trainer_train(trainer *t) {
  const opts *o = &t->o;
  t->t0 = t->last_report = now_s();
  t->auc = t->logloss = NAN;
  t->first_step = t->report_step = t->step;
  while ((long)t->step < t->total) {
    if (trainer_step(t) != 0) {
      t->stopped = 1;
      break;
    }
    int eval = t->chief && !o->no_eval && o->eval_every > 0 &&
               t->step % (uint64_t)o->eval_every == 0 && (long)t->step < t->total;
    if (eval) evaluate(t);
    double now = now_s();
    if (now - t->last_report >= 1.0 || eval) trainer_report(t, now, eval);
  }
  t->wall = now_s() - t->t0;
  if (t->c && t->ntimed) tcp_bytes(&t->sent1, &t->recv1);
}

/* The JSON line on stdout (and the last --metrics line): the evaluation
 * (the chief's), throughput, and the timing and bytes of the steps after
 * the warm-up (medians, with the range of the step time). */
static void trainer_summary(trainer *t) {
  const opts *o = &t->o;
  size_t n = t->ntimed;
  double lo = 0, hi = 0;
  for (size_t i = 0; i < n; i++) {
    lo = i == 0 || t->t_step[i] < lo ? t->t_step[i] : lo;
    hi = t->t_step[i] > hi ? t->t_step[i] : hi;
  }
  double step_ms = median(t->t_step, n), pull_ms = median(t->t_pull, n);
  double compute_ms = median(t->t_compute, n), push_ms = median(t->t_push, n);
  double steps = (double)(t->step - t->first_step);
  double sps = t->wall > 0 ? steps * o->batch * t->nw / t->wall : 0;
  double uniq = t->unique_n ? t->unique_sum / (double)t->unique_n : 0;
  double sent = n ? (double)(t->sent1 - t->sent0) / (double)n : 0;
  double recv = n ? (double)(t->recv1 - t->recv0) / (double)n : 0;
  char evalbuf[160] = "\"auc\":null,\"logloss\":null";
  if (t->chief && !o->no_eval && !t->stopped)
    snprintf(evalbuf, sizeof evalbuf, "\"auc\":%.5f,\"logloss\":%.5f", t->auc, t->logloss);
  static const char *const kinds[] = {"table", "dense", "local"};
  char line[2048];
  snprintf(line, sizeof line,
           "{%s,\"worker\":%d,\"workers\":%d,\"steps\":%llu,\"batch\":%d,\"loss\":%.5f,"
           "\"embed\":\"%s\",\"wall_s\":%.3f,\"samples_per_sec\":%.1f,\"step_ms\":%.3f,"
           "\"step_ms_min\":%.3f,\"step_ms_max\":%.3f,\"pull_ms\":%.3f,\"compute_ms\":%.3f,"
           "\"push_ms\":%.3f,\"timed_steps\":%zu,\"bytes_sent_per_step\":%.0f,"
           "\"bytes_recv_per_step\":%.0f,\"keys_per_step\":%d,\"unique_keys_per_step\":%.0f,"
           "\"rows_per_sec\":%.0f}",
           evalbuf, t->w, t->nw, (unsigned long long)t->step, o->batch, t->loss,
           kinds[o->local ? CTR_EMB_LOCAL : o->embed], t->wall, sps, step_ms, lo, hi, pull_ms,
           compute_ms, push_ms, n, sent, recv, o->batch * t->F, uniq,
           step_ms > 0 ? uniq * 1e3 / step_ms : 0);
  if (!t->stopped) printf("%s\n", line);
  if (t->metrics && !t->stopped) fprintf(t->metrics, "%s\n", line);
}

/* After the loop: the chief's final evaluation, finish, the summary. */
static void trainer_end(trainer *t) {
  if (t->chief && !t->o.no_eval && !t->stopped) {
    evaluate(t);
    fprintf(stderr, "w0 step %llu test logloss %.4f auc %.4f\n", (unsigned long long)t->step,
            t->logloss, t->auc);
  }
  if (t->c && ps_client_finish(t->c) != 0) die("finish: %s", ps_client_errmsg(t->c));
  trainer_summary(t);
}

/* The one cleanup path (errors before it exit through die). */
static void trainer_free(trainer *t) {
  if (t->metrics) fclose(t->metrics);
  if (t->trace && fclose(t->trace) != 0) die("writing --trace failed");
  ctr_emb_destroy(t->emb);
  ctr_mlp_destroy(t->m);
  ps_client_destroy(t->c);
  for (int i = 0; i < 2 * CTR_NPARAMS; i++) free(t->local_params[i]);
  void *bufs[] = {t->keys, t->sorted, t->rows, t->dense, t->labels, t->eprob, t->elabel,
                  t->t_pull, t->t_compute, t->t_push, t->t_step};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
  ctr_close(&t->train);
  ctr_close(&t->test);
}

int main(int argc, char **argv) {
  static trainer t; /* zeroed; large (the option paths) */
  parse(&t.o, argc, argv);
  setvbuf(stdout, NULL, _IOLBF, 0);
  trainer_setup(&t);
  trainer_connect(&t);
  trainer_buffers(&t);
  trainer_train(&t);
  trainer_end(&t);
  trainer_free(&t);
  return t.stopped ? EXIT_STOPPED : 0;
}
