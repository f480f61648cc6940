/* ps_bench.c - push/pull throughput and latency of psd, with raw TCP
 * baselines to compare against.
 *
 * For every combination of --ps, --workers and --sizes, ps_bench starts the
 * psd processes (found next to this executable, or --psd PATH) on 127.0.0.1
 * with --port 0 --port-file, forks the workers (each one a ps_client with a
 * single float32 variable of the requested size) and times ps_client_step,
 * which pushes a gradient and pulls the parameters of the next step. Each
 * worker sends its per-step times to the parent through a pipe; the parent
 * reports the median over worker 0's timed steps.
 *
 *   name "pushpull": bytes ps workers steps step_ms gbps total_gbps
 *     gbps       = 2 * bytes / median step seconds / 1e9 (push + pull bytes
 *                  one worker moves per step)
 *     total_gbps = gbps * workers
 *
 * --tcp-baseline adds "tcp_stream" (one TCP connection over loopback, best
 * of 3 runs) and "tcp_rtt" (median round trip of 4-byte messages), then
 * "ratio" lines for the ps=1 workers=1 results.
 *
 * Logs of psd and of the workers go to a temporary directory that is
 * removed when everything succeeded and kept (and named) otherwise.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "psclient.h"

#define MAX_LIST 32          /* entries in one --ps/--workers/--sizes list */
#define MAX_PS 64            /* --ps bound */
#define MAX_WORKERS 64       /* --workers bound */
#define MAX_BYTES (16ULL << 30) /* --sizes bound: 16 GiB */
#define WARMUP_STEPS 2
#define BIG_SIZE (64ULL << 20)  /* sizes from here on run at most BIG_STEPS */
#define BIG_STEPS 10
#define STREAM_CHUNK (4u << 20)
#define STREAM_SOCKBUF (4 << 20)
#define RTT_WARMUP 1000
#define RTT_ITERS 20000
#define GRAD_VALUE 1e-6f
/* --telemetry-cost: off/on pairs; alternating cancels drift of the machine. */
#define TELEM_ROUNDS 5
#define LEARNING_RATE 0.01

/* ---------------------------------------------------------------------- */
/* Options */

typedef struct options {
  int ps[MAX_LIST], n_ps;
  int workers[MAX_LIST], n_workers;
  uint64_t sizes[MAX_LIST];
  int n_sizes;
  int steps;
  int steps_given;
  int tcp_baseline;
  int json;
  int pin;   /* servers on the last CPUs, clients on the first ones */
  int telemetry_cost; /* --telemetry-cost: 4-byte steps, telemetry off vs on */
  char psd[PATH_MAX];
} options;

static options opt;
/* The run being measured has telemetry switched off (psd and client). */
static int g_telem_off;

/* ---------------------------------------------------------------------- */
/* Children: every process we start is registered so that an error path or a
 * signal can kill it. */

#define MAX_CHILDREN (MAX_PS + MAX_WORKERS + 8)
static volatile pid_t g_children[MAX_CHILDREN];
static volatile sig_atomic_t g_interrupted;
static char g_tmpdir[1024]; /* shorter than PATH_MAX: log names fit after it */

static void child_add(pid_t pid) {
  for (int i = 0; i < MAX_CHILDREN; i++)
    if (g_children[i] == 0) {
      g_children[i] = pid;
      return;
    }
}

static void child_remove(pid_t pid) {
  for (int i = 0; i < MAX_CHILDREN; i++)
    if (g_children[i] == pid) g_children[i] = 0;
}

static void kill_all_children(void) {
  for (int i = 0; i < MAX_CHILDREN; i++) {
    pid_t p = g_children[i];
    if (p > 0) kill(p, SIGKILL);
  }
}

/* Kills and reaps every registered child. */
static void reap_all_children(void) {
  kill_all_children();
  for (int i = 0; i < MAX_CHILDREN; i++) {
    pid_t p = g_children[i];
    if (p > 0) {
      while (waitpid(p, NULL, 0) < 0 && errno == EINTR) {
      }
      g_children[i] = 0;
    }
  }
}

static void on_signal(int sig) {
  (void)sig;
  g_interrupted = 1;
  kill_all_children();
}

static void install_signals(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0; /* no SA_RESTART: waits return EINTR */
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
}

/* In a freshly forked child: default signals, and die with the parent. */
static void child_setup(pid_t parent) {
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGHUP, SIG_DFL);
  signal(SIGPIPE, SIG_DFL);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
}

static pid_t fork_child(void) {
  fflush(stdout);
  fflush(stderr);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) {
    for (int i = 0; i < MAX_CHILDREN; i++) g_children[i] = 0;
    child_setup(parent);
  } else if (pid > 0) {
    child_add(pid);
  }
  return pid;
}

/* ---------------------------------------------------------------------- */
/* Small helpers */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Pins the calling process to one CPU (index modulo the CPUs available),
 * so that latency baselines and the runs they are compared with place
 * client and server alike: on a 2-core machine a ping-pong between two
 * cores and one within a core differ several-fold. No-op with --no-pin. */
static void pin_cpu(int index) {
  if (!opt.pin) return;
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (n < 2) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET((int)(((index % n) + n) % n), &set);
  sched_setaffinity(0, sizeof set, &set);
}

/* Undoes pin_cpu for the parent after a measurement. */
static void unpin_cpu(void) {
  cpu_set_t set;
  CPU_ZERO(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  for (long i = 0; i < n && i < CPU_SETSIZE; i++) CPU_SET((int)i, &set);
  sched_setaffinity(0, sizeof set, &set);
}

static void progress(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("ps_bench: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(const double *v, size_t n) {
  if (n == 0) return NAN;
  double *c = malloc(n * sizeof *c);
  if (!c) return NAN;
  memcpy(c, v, n * sizeof *c);
  qsort(c, n, sizeof *c, cmp_double);
  double m = n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
  free(c);
  return m;
}

static const char *size_label(uint64_t b, char *buf, size_t len) {
  if (b >= (1ULL << 30) && b % (1ULL << 30) == 0)
    snprintf(buf, len, "%" PRIu64 " GiB", b >> 30);
  else if (b >= (1ULL << 20) && b % (1ULL << 20) == 0)
    snprintf(buf, len, "%" PRIu64 " MiB", b >> 20);
  else if (b >= (1ULL << 10) && b % (1ULL << 10) == 0)
    snprintf(buf, len, "%" PRIu64 " KiB", b >> 10);
  else
    snprintf(buf, len, "%" PRIu64 " B", b);
  return buf;
}

/* A JSON number, or null where the value is not finite. */
static const char *jnum(double v, char *buf, size_t len) {
  if (!isfinite(v)) snprintf(buf, len, "null");
  else snprintf(buf, len, "%.6g", v);
  return buf;
}

/* Prints the last `max` bytes of a log file to stderr. */
static void print_log_tail(const char *path, size_t max) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "  (no log at %s)\n", path);
    return;
  }
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  long from = size > (long)max ? size - (long)max : 0;
  fseek(f, from, SEEK_SET);
  fprintf(stderr, "  --- tail of %s%s ---\n", path, from ? " (truncated)" : "");
  char buf[4096];
  size_t n;
  int last = '\n';
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
    fwrite(buf, 1, n, stderr);
    last = buf[n - 1];
  }
  if (size == 0) fputs("  (empty)\n", stderr);
  else if (last != '\n') fputc('\n', stderr);
  fprintf(stderr, "  --- end of %s ---\n", path);
  fclose(f);
}

static int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t n = write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* Reads exactly len bytes; 0, or -1 on error or EOF. */
static int read_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len) {
    ssize_t n = read(fd, p, len);
    if (n < 0) {
      if (errno == EINTR && !g_interrupted) continue;
      return -1;
    }
    if (n == 0) return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static void remove_tmpdir(void) {
  if (!g_tmpdir[0]) return;
  DIR *d = opendir(g_tmpdir);
  if (d) {
    struct dirent *e;
    while ((e = readdir(d))) {
      if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
      char p[PATH_MAX + 256];
      snprintf(p, sizeof p, "%s/%s", g_tmpdir, e->d_name);
      unlink(p);
    }
    closedir(d);
  }
  rmdir(g_tmpdir);
}

/* ---------------------------------------------------------------------- */
/* Command line */

static void usage(FILE *f) {
  fprintf(f,
          "usage: ps_bench [OPTIONS]\n"
          "Times ps_client_step (push a gradient + pull the parameters) against\n"
          "psd processes on 127.0.0.1, for every combination of the lists given.\n\n"
          "  --ps N[,N...]          parameter servers [1]\n"
          "  --workers N[,N...]     worker processes [1]\n"
          "  --sizes S[,S...]       variable bytes, suffixes K, M, G (binary)\n"
          "                         [4,1M,64M]\n"
          "  --steps N              timed steps per run [20; sizes >= 64M run at\n"
          "                         most 10 unless --steps is given]\n"
          "  --tcp-baseline         also measure a raw TCP stream and 4-byte TCP\n"
          "                         round trips, and print ratios against them\n"
          "  --json                 one JSON object per line on stdout\n"
          "  --telemetry-cost       time 4-byte steps (1 ps, 1 worker) with the\n"
          "                         per-step telemetry off and on, alternating\n"
          "                         %d times, and print the ratio of the medians\n"
          "  --no-pin               do not pin servers to the last CPUs and\n"
          "                         workers to the first ones (pinning makes the\n"
          "                         latency baseline comparable)\n"
          "  --psd PATH             psd binary [next to this executable]\n"
          "  --help                 print this and exit\n", TELEM_ROUNDS);
}

static void bad_value(const char *flag, const char *val, const char *what) {
  fprintf(stderr, "ps_bench: %s: invalid value '%s' (%s)\n", flag, val, what);
  exit(2);
}

static int parse_int(const char *s, long lo, long hi, long *out) {
  if (!*s || !isdigit((unsigned char)*s)) return -1;
  errno = 0;
  char *end;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

static int parse_size(const char *s, uint64_t *out) {
  if (!*s || !isdigit((unsigned char)*s)) return -1;
  errno = 0;
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno) return -1;
  unsigned shift = 0;
  if (*end) {
    switch (*end) {
    case 'k': case 'K': shift = 10; break;
    case 'm': case 'M': shift = 20; break;
    case 'g': case 'G': shift = 30; break;
    default: return -1;
    }
    end++;
    if (*end) return -1;
  }
  if (v == 0 || v > (MAX_BYTES >> shift)) return -1;
  *out = (uint64_t)v << shift;
  return 0;
}

/* Splits a comma-separated list; each item goes through `one`. */
static void parse_int_list(const char *flag, const char *val, long lo, long hi,
                           int *out, int *n) {
  char what[96];
  snprintf(what, sizeof what, "expected integers from %ld to %ld, comma-separated", lo, hi);
  char *copy = strdup(val);
  if (!copy) exit(1);
  *n = 0;
  char *save = NULL, *tok;
  if (!*val || val[strlen(val) - 1] == ',' || val[0] == ',' || strstr(val, ",,"))
    bad_value(flag, val, what);
  for (tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    long v;
    if (parse_int(tok, lo, hi, &v) != 0) bad_value(flag, val, what);
    if (*n >= MAX_LIST) bad_value(flag, val, "too many entries");
    out[(*n)++] = (int)v;
  }
  free(copy);
}

static void parse_args(int argc, char **argv) {
  memset(&opt, 0, sizeof opt);
  opt.ps[0] = 1;
  opt.n_ps = 1;
  opt.workers[0] = 1;
  opt.n_workers = 1;
  opt.sizes[0] = 4;
  opt.sizes[1] = 1ULL << 20;
  opt.sizes[2] = 64ULL << 20;
  opt.n_sizes = 3;
  opt.steps = 20;
  opt.pin = 1;
  for (int a = 1; a < argc; a++) {
    const char *arg = argv[a];
    if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
      usage(stdout);
      exit(0);
    }
    if (!strcmp(arg, "--tcp-baseline")) {
      opt.tcp_baseline = 1;
      continue;
    }
    if (!strcmp(arg, "--json")) {
      opt.json = 1;
      continue;
    }
    if (!strcmp(arg, "--telemetry-cost")) {
      opt.telemetry_cost = 1;
      continue;
    }
    if (!strcmp(arg, "--no-pin")) {
      opt.pin = 0;
      continue;
    }
    /* Options with a value: "--flag VALUE" or "--flag=VALUE". */
    static const char *const with_value[] = {"--ps", "--workers", "--sizes", "--steps",
                                             "--psd"};
    const char *flag = NULL, *val = NULL;
    char fbuf[32];
    for (size_t i = 0; i < sizeof with_value / sizeof *with_value; i++) {
      size_t l = strlen(with_value[i]);
      if (!strcmp(arg, with_value[i])) {
        flag = with_value[i];
        if (a + 1 >= argc) {
          fprintf(stderr, "ps_bench: %s: needs a value\n", flag);
          exit(2);
        }
        val = argv[++a];
      } else if (!strncmp(arg, with_value[i], l) && arg[l] == '=') {
        flag = with_value[i];
        val = arg + l + 1;
      }
      if (flag) break;
    }
    if (!flag) {
      fprintf(stderr, "ps_bench: %s: unknown option (see --help)\n", arg);
      exit(2);
    }
    snprintf(fbuf, sizeof fbuf, "%s", flag);
    if (!strcmp(flag, "--ps")) {
      parse_int_list(fbuf, val, 1, MAX_PS, opt.ps, &opt.n_ps);
    } else if (!strcmp(flag, "--workers")) {
      parse_int_list(fbuf, val, 1, MAX_WORKERS, opt.workers, &opt.n_workers);
    } else if (!strcmp(flag, "--steps")) {
      long v;
      if (parse_int(val, 1, 1000000, &v) != 0)
        bad_value(fbuf, val, "expected an integer from 1 to 1000000");
      opt.steps = (int)v;
      opt.steps_given = 1;
    } else if (!strcmp(flag, "--sizes")) {
      const char *what = "expected sizes from 1 to 16G, suffixes K/M/G, comma-separated";
      if (!*val || val[strlen(val) - 1] == ',' || val[0] == ',' || strstr(val, ",,"))
        bad_value(fbuf, val, what);
      char *copy = strdup(val);
      if (!copy) exit(1);
      opt.n_sizes = 0;
      char *save = NULL;
      for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        uint64_t b;
        if (parse_size(tok, &b) != 0) bad_value(fbuf, val, what);
        if (opt.n_sizes >= MAX_LIST) bad_value(fbuf, val, "too many entries");
        opt.sizes[opt.n_sizes++] = b;
      }
      free(copy);
    } else if (!strcmp(flag, "--psd")) {
      if (!*val || strlen(val) >= sizeof opt.psd) bad_value(fbuf, val, "expected a path");
      snprintf(opt.psd, sizeof opt.psd, "%s", val);
    }
  }
}

static int find_psd(void) {
  if (!opt.psd[0]) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
      fprintf(stderr, "ps_bench: cannot read /proc/self/exe: %s (use --psd PATH)\n",
              strerror(errno));
      return -1;
    }
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash) *slash = '\0';
    if (strlen(self) + 5 >= sizeof opt.psd) {
      fprintf(stderr, "ps_bench: path too long: %s\n", self);
      return -1;
    }
    memcpy(opt.psd, self, strlen(self));
    memcpy(opt.psd + strlen(self), "/psd", 5);
  }
  if (access(opt.psd, X_OK) != 0) {
    fprintf(stderr, "ps_bench: --psd: cannot execute '%s': %s\n", opt.psd, strerror(errno));
    return -1;
  }
  return 0;
}

/* ---------------------------------------------------------------------- */
/* Worker process (a forked child) */

/* What a worker sends back, followed by nsteps doubles (seconds). */
typedef struct worker_report {
  uint32_t magic;
  int32_t worker;
  int32_t rc;          /* 0, or the failing ps_* code */
  int32_t nsteps;      /* timed steps that follow */
  int32_t stale;       /* steps that came back stale */
  int32_t bad_steps;   /* steps after which some parameter was wrong */
  double expect, got;  /* first wrong element: expected and actual */
  uint64_t first_step, last_step;
  char msg[512];
} worker_report;
#define REPORT_MAGIC 0x50534243u

static int worker_main(int fd, const char *const *hosts, int nps, int widx, int nw,
                       size_t numel, int steps) {
  worker_report rep;
  memset(&rep, 0, sizeof rep);
  rep.magic = REPORT_MAGIC;
  rep.worker = widx;
  double *times = calloc((size_t)steps, sizeof *times);
  ps_client *c = NULL;
  ps_var *v = NULL;
  const char *phase = "setup";
  int rc = 0;
  if (!times) {
    rc = PS_ENOMEM;
    snprintf(rep.msg, sizeof rep.msg, "out of memory");
    goto report;
  }

  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hosts;
  cfg.num_ps = nps;
  cfg.worker_index = widx;
  cfg.num_workers = nw;
  cfg.connect_timeout_ms = 20000;
  cfg.request_timeout_ms = 300000;
  cfg.telemetry = g_telem_off ? "off" : NULL; /* NULL: on, in memory */
  char err[400] = "";
  phase = "ps_client_create";
  rc = ps_client_create(&cfg, &c, err, sizeof err);
  if (rc) {
    snprintf(rep.msg, sizeof rep.msg, "%s: %s (%s)", phase, ps_strerror(rc), err);
    goto report;
  }

  int64_t shape[1] = {(int64_t)numel};
  ps_init init = PS_SIZED(ps_init, PS_INIT_ZEROS, 0, 0, 1);
  ps_optimizer o;
  ps_optimizer_default(&o, LEARNING_RATE);
  phase = "ps_client_var_create";
  rc = ps_client_var_create(c, "ps_bench/var", shape, 1, &init, &o, &v);
  if (rc) goto fail;

  uint64_t step = 0;
  phase = "ps_client_pull";
  rc = ps_client_pull(c, 0, &step);
  if (rc) goto fail;
  rep.first_step = step;

  float *grad = ps_var_grad(v);
  const float *data = ps_var_data(v);
  phase = "ps_client_step";
  for (int s = 0; s < WARMUP_STEPS + steps; s++) {
    for (size_t i = 0; i < numel; i++) grad[i] = GRAD_VALUE;
    int stale = 0;
    uint64_t before = step;
    double t0 = now_s();
    rc = ps_client_step(c, &step, &stale);
    double t1 = now_s();
    if (rc) goto fail;
    rep.stale += stale;
    if (s >= WARMUP_STEPS) times[rep.nsteps++] = t1 - t0;
    /* Check the parameters (untimed). Every worker pushes the same
     * gradient, so whatever the averaging, each applied step moves every
     * element by -lr * g from the zeros. */
    double applied = (double)(step - rep.first_step);
    double expect = -applied * LEARNING_RATE * GRAD_VALUE;
    /* float32 rounding: at most half an ulp of |w| per applied update. */
    double tol = (1e-3 + applied * 6e-8) * fabs(expect) + 1e-12;
    size_t bad = 0, first_bad = 0;
    for (size_t i = 0; i < numel; i++) {
      double d = data[i];
      if (!isfinite(d) || fabs(d - expect) > tol) {
        if (!bad) first_bad = i;
        bad++;
      }
    }
    if (bad) {
      if (!rep.bad_steps) {
        size_t last_bad = first_bad;
        for (size_t i = first_bad; i < numel; i++)
          if (!isfinite(data[i]) || fabs(data[i] - expect) > tol) last_bad = i;
        rep.expect = expect;
        rep.got = data[first_bad];
        snprintf(rep.msg, sizeof rep.msg,
                 "after ps_client_step %" PRIu64 "->%" PRIu64 ": %zu of %zu elements wrong "
                 "(first [%zu] = %.9g, last [%zu] = %.9g; expected %.9g)",
                 before, step, bad, numel, first_bad, (double)data[first_bad], last_bad,
                 (double)data[last_bad], expect);
        fprintf(stderr, "worker %d: %s\n", widx, rep.msg);
      }
      rep.bad_steps++;
    }
  }
  rep.last_step = step;
  goto report;

fail:
  snprintf(rep.msg, sizeof rep.msg, "%s: %s: %s", phase, ps_strerror(rc), ps_client_errmsg(c));
report:
  rep.rc = rc;
  fprintf(stderr, "worker %d: %s%s\n", widx, rc ? "failed: " : "done ",
          rc ? rep.msg : "");
  if (write_all(fd, &rep, sizeof rep) != 0 ||
      (rep.nsteps && write_all(fd, times, (size_t)rep.nsteps * sizeof *times) != 0)) {
    fprintf(stderr, "worker %d: cannot report to the parent: %s\n", widx, strerror(errno));
    rc = rc ? rc : PS_EIO;
  }
  close(fd);
  if (c && rc == 0) {
    int frc = ps_client_finish(c);
    if (frc) {
      fprintf(stderr, "worker %d: ps_client_finish: %s: %s\n", widx, ps_strerror(frc),
              ps_client_errmsg(c));
      rc = frc;
    }
  }
  ps_client_destroy(c);
  free(times);
  return rc ? 1 : 0;
}

/* ---------------------------------------------------------------------- */
/* One pushpull measurement */

typedef struct proc {
  pid_t pid;
  int status;
  int reaped;
  char log[PATH_MAX];
} proc;

typedef struct pp_result {
  uint64_t bytes;
  int ps, workers, steps;
  double step_ms, gbps, total_gbps;
  int ok;
  char error[600];
} pp_result;

static int g_run_seq;

static int proc_reap(proc *p, int block) {
  if (p->reaped || p->pid <= 0) return 1;
  int st;
  pid_t r;
  do r = waitpid(p->pid, &st, block ? 0 : WNOHANG);
  while (r < 0 && errno == EINTR && block);
  if (r == p->pid) {
    p->status = st;
    p->reaped = 1;
    child_remove(p->pid);
    return 1;
  }
  return 0;
}

static void proc_kill(proc *p) {
  if (p->pid > 0 && !p->reaped) {
    kill(p->pid, SIGKILL);
    proc_reap(p, 1);
  }
}

static void describe_status(int st, char *buf, size_t len) {
  if (WIFEXITED(st)) snprintf(buf, len, "exit status %d", WEXITSTATUS(st));
  else if (WIFSIGNALED(st)) snprintf(buf, len, "killed by signal %d (%s)", WTERMSIG(st),
                                     strsignal(WTERMSIG(st)));
  else snprintf(buf, len, "status 0x%x", st);
}

static char *read_small_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *buf = calloc(1, 256);
  if (buf && fread(buf, 1, 255, f) == 0) buf[0] = '\0';
  fclose(f);
  return buf;
}

static int start_psd(proc *p, int run, int index, int nps, int nw, char *addr, size_t addrlen,
                     char *err, size_t errlen) {
  char portf[PATH_MAX], idx[16], nps_s[16], nw_s[16];
  snprintf(p->log, sizeof p->log, "%s/run%d.psd%d.log", g_tmpdir, run, index);
  snprintf(portf, sizeof portf, "%s/run%d.psd%d.port", g_tmpdir, run, index);
  snprintf(idx, sizeof idx, "%d", index);
  snprintf(nps_s, sizeof nps_s, "%d", nps);
  snprintf(nw_s, sizeof nw_s, "%d", nw);
  const char *argv[] = {opt.psd, "--host", "127.0.0.1", "--port", "0", "--port-file", portf,
                        "--ps-index", idx, "--num-ps", nps_s, "--workers", nw_s,
                        "--log-level", "warn", g_telem_off ? "--telemetry" : NULL, "off",
                        NULL};
  pid_t pid = fork_child();
  if (pid < 0) {
    snprintf(err, errlen, "fork: %s", strerror(errno));
    return -1;
  }
  if (pid == 0) {
    pin_cpu(-1 - index);
    int fd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    int nul = open("/dev/null", O_RDONLY);
    if (nul >= 0) {
      dup2(nul, 0);
      close(nul);
    }
    execv(opt.psd, (char *const *)argv);
    fprintf(stderr, "execv %s: %s\n", opt.psd, strerror(errno));
    _exit(127);
  }
  p->pid = pid;
  p->reaped = 0;
  double deadline = now_s() + 15.0;
  while (!g_interrupted) {
    char *s = read_small_file(portf);
    if (s && strchr(s, ':')) {
      s[strcspn(s, "\r\n")] = '\0';
      snprintf(addr, addrlen, "%s", s);
      free(s);
      return 0;
    }
    free(s);
    if (proc_reap(p, 0)) {
      char st[96];
      describe_status(p->status, st, sizeof st);
      snprintf(err, errlen, "psd %d exited before writing its port file (%s)", index, st);
      return -1;
    }
    if (now_s() > deadline) {
      snprintf(err, errlen, "psd %d wrote no port file within 15 s", index);
      return -1;
    }
    sleep_ms(5);
  }
  snprintf(err, errlen, "interrupted");
  return -1;
}

static void print_logs(proc *ps, int nps, proc *wk, int nw) {
  for (int i = 0; i < nw; i++)
    if (wk[i].log[0]) print_log_tail(wk[i].log, 2048);
  for (int i = 0; i < nps; i++)
    if (ps[i].log[0]) print_log_tail(ps[i].log, 2048);
}

static int run_pushpull(int nps, int nw, uint64_t req_bytes, int steps, pp_result *res) {
  int run = ++g_run_seq;
  size_t numel = req_bytes / 4 ? (size_t)(req_bytes / 4) : 1;
  uint64_t bytes = (uint64_t)numel * 4;
  memset(res, 0, sizeof *res);
  res->bytes = bytes;
  res->ps = nps;
  res->workers = nw;
  res->steps = steps;
  res->step_ms = res->gbps = res->total_gbps = NAN;

  proc ps[MAX_PS], wk[MAX_WORKERS];
  memset(ps, 0, sizeof ps);
  memset(wk, 0, sizeof wk);
  char addrs[MAX_PS][64];
  const char *hosts[MAX_PS];
  int fds[MAX_WORKERS];
  for (int w = 0; w < MAX_WORKERS; w++) fds[w] = -1;
  char err[600] = "";
  int failed = 0, show_logs = 1;
  char label[32];
  progress("pushpull %s ps=%d workers=%d steps=%d", size_label(bytes, label, sizeof label),
           nps, nw, steps);

  for (int i = 0; i < nps; i++) {
    if (start_psd(&ps[i], run, i, nps, nw, addrs[i], sizeof addrs[i], err, sizeof err)) {
      failed = 1;
      goto done;
    }
    hosts[i] = addrs[i];
  }

  for (int w = 0; w < nw; w++) {
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) != 0) {
      snprintf(err, sizeof err, "pipe: %s", strerror(errno));
      failed = 1;
      goto done;
    }
    snprintf(wk[w].log, sizeof wk[w].log, "%s/run%d.worker%d.log", g_tmpdir, run, w);
    pid_t pid = fork_child();
    if (pid < 0) {
      snprintf(err, sizeof err, "fork: %s", strerror(errno));
      close(pfd[0]);
      close(pfd[1]);
      failed = 1;
      goto done;
    }
    if (pid == 0) {
      close(pfd[0]);
      for (int k = 0; k < w; k++)
        if (fds[k] >= 0) close(fds[k]);
      int fd = open(wk[w].log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
      pin_cpu(w);
      _exit(worker_main(pfd[1], hosts, nps, w, nw, numel, steps));
    }
    wk[w].pid = pid;
    close(pfd[1]);
    fds[w] = pfd[0];
  }

  /* Collect every worker's report. */
  {
    worker_report reps[MAX_WORKERS];
    double *times[MAX_WORKERS];
    size_t got[MAX_WORKERS], need[MAX_WORKERS];
    memset(reps, 0, sizeof reps);
    for (int w = 0; w < nw; w++) {
      times[w] = NULL;
      got[w] = 0;
      need[w] = sizeof(worker_report);
    }
    /* Generous: assume at least 20 MB/s per step, plus start-up. */
    double budget = 60.0 + (double)bytes * 2.0 * nw * (steps + WARMUP_STEPS + 2) / 20e6;
    double deadline = now_s() + budget;
    int open_fds = nw;
    while (open_fds > 0) {
      if (g_interrupted) {
        snprintf(err, sizeof err, "interrupted");
        failed = 1;
        show_logs = 0;
        break;
      }
      double left = deadline - now_s();
      if (left <= 0) {
        snprintf(err, sizeof err, "workers did not finish within %.0f s", budget);
        failed = 1;
        break;
      }
      struct pollfd pf[MAX_WORKERS];
      int map[MAX_WORKERS], n = 0;
      for (int w = 0; w < nw; w++)
        if (fds[w] >= 0) {
          pf[n].fd = fds[w];
          pf[n].events = POLLIN;
          pf[n].revents = 0;
          map[n++] = w;
        }
      int pr = poll(pf, (nfds_t)n, left > 1.0 ? 1000 : (int)(left * 1000) + 1);
      if (pr < 0) {
        if (errno == EINTR) continue;
        snprintf(err, sizeof err, "poll: %s", strerror(errno));
        failed = 1;
        break;
      }
      for (int k = 0; k < n; k++) {
        if (!pf[k].revents) continue;
        int w = map[k];
        char *dst;
        size_t room;
        if (got[w] < sizeof(worker_report)) {
          dst = (char *)&reps[w] + got[w];
          room = sizeof(worker_report) - got[w];
        } else {
          size_t off = got[w] - sizeof(worker_report);
          dst = (char *)times[w] + off;
          room = need[w] - got[w];
        }
        ssize_t r = room ? read(fds[w], dst, room) : 0;
        if (r < 0 && errno == EINTR) continue;
        if (r > 0) {
          got[w] += (size_t)r;
          if (got[w] == sizeof(worker_report)) {
            if (reps[w].magic != REPORT_MAGIC || reps[w].nsteps < 0 || reps[w].nsteps > steps) {
              snprintf(err, sizeof err, "worker %d sent a malformed report", w);
              failed = 1;
              break;
            }
            need[w] = sizeof(worker_report) + (size_t)reps[w].nsteps * sizeof(double);
            times[w] = calloc((size_t)reps[w].nsteps + 1, sizeof(double));
            if (!times[w]) {
              snprintf(err, sizeof err, "out of memory");
              failed = 1;
              break;
            }
          }
          continue;
        }
        /* EOF, full report or error. */
        close(fds[w]);
        fds[w] = -1;
        open_fds--;
        if (got[w] < need[w] || got[w] < sizeof(worker_report)) {
          if (!failed) {
            snprintf(err, sizeof err, "worker %d exited without a complete report", w);
            failed = 1;
          }
        } else if (reps[w].rc != 0) {
          if (!failed) {
            snprintf(err, sizeof err, "worker %d: %.500s", w, reps[w].msg);
            failed = 1;
          }
        }
      }
      if (failed) break; /* one worker failed: the others would hang */
    }

    if (!failed) {
      for (int w = 0; w < nw; w++) {
        if (reps[w].nsteps != steps) {
          snprintf(err, sizeof err, "worker %d reported %d steps, expected %d", w,
                   reps[w].nsteps, steps);
          failed = 1;
        }
        if (reps[w].stale)
          progress("warning: worker %d had %d stale step(s)", w, reps[w].stale);
        if (reps[w].bad_steps) {
          progress("warning: worker %d: wrong parameter values after %d of %d steps; "
                   "first: %s",
                   w, reps[w].bad_steps, steps + WARMUP_STEPS, reps[w].msg);
          if (res->ok == 0)
            snprintf(res->error, sizeof res->error,
                     "worker %d: wrong parameter values after %d of %d steps; first: %.400s", w,
                     reps[w].bad_steps, steps + WARMUP_STEPS, reps[w].msg);
          res->ok = -1; /* measured, but the values are wrong */
        }
      }
    }
    if (!failed) {
      double med = median(times[0], (size_t)reps[0].nsteps);
      res->step_ms = med * 1e3;
      res->gbps = med > 0 ? 2.0 * (double)bytes / med / 1e9 : NAN;
      res->total_gbps = res->gbps * nw;
      if (nw > 1) {
        /* The other workers' medians, for the record. */
        double lo = med, hi = med;
        for (int w = 1; w < nw; w++) {
          double m = median(times[w], (size_t)reps[w].nsteps);
          if (m < lo) lo = m;
          if (m > hi) hi = m;
        }
        progress("  median step over workers: %.3f..%.3f ms", lo * 1e3, hi * 1e3);
      }
    }
    for (int w = 0; w < nw; w++) free(times[w]);
  }
  if (failed) goto done;

  /* Workers: all should exit 0 shortly after ps_client_finish. */
  {
    double deadline = now_s() + 30.0;
    for (int w = 0; w < nw; w++) {
      while (!proc_reap(&wk[w], 0)) {
        if (g_interrupted || now_s() > deadline) break;
        sleep_ms(5);
      }
      if (!wk[w].reaped) {
        snprintf(err, sizeof err, "worker %d did not exit within 30 s after its report", w);
        failed = 1;
        goto done;
      }
      if (!WIFEXITED(wk[w].status) || WEXITSTATUS(wk[w].status) != 0) {
        char st[96];
        describe_status(wk[w].status, st, sizeof st);
        snprintf(err, sizeof err, "worker %d: %s", w, st);
        failed = 1;
        goto done;
      }
    }
  }
  /* psd: exits 0 once every worker has finished. */
  {
    double deadline = now_s() + 15.0;
    for (int i = 0; i < nps; i++) {
      while (!proc_reap(&ps[i], 0)) {
        if (g_interrupted || now_s() > deadline) break;
        sleep_ms(5);
      }
      if (!ps[i].reaped) {
        snprintf(err, sizeof err,
                 "psd %d did not exit within 15 s after all workers finished (killed)", i);
        failed = 1;
        goto done;
      }
      if (!WIFEXITED(ps[i].status) || WEXITSTATUS(ps[i].status) != 0) {
        char st[96];
        describe_status(ps[i].status, st, sizeof st);
        snprintf(err, sizeof err, "psd %d: %s after all workers finished", i, st);
        failed = 1;
        goto done;
      }
    }
  }

done:
  if (g_interrupted && !failed) {
    snprintf(err, sizeof err, "interrupted");
    failed = 1;
    show_logs = 0;
  }
  for (int w = 0; w < nw; w++) {
    if (fds[w] >= 0) close(fds[w]);
    proc_kill(&wk[w]);
  }
  for (int i = 0; i < nps; i++) proc_kill(&ps[i]);
  if (failed) {
    snprintf(res->error, sizeof res->error, "%s", err);
    res->ok = 0;
    progress("pushpull %s ps=%d workers=%d failed: %s", size_label(bytes, label, sizeof label),
             nps, nw, err);
    if (show_logs) print_logs(ps, nps, wk, nw);
    return -1;
  }
  if (res->ok == 0) res->ok = 1;
  return res->ok == 1 ? 0 : -1;
}

/* ---------------------------------------------------------------------- */
/* TCP baselines */

static void set_sock_opts(int fd, int bufsize) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (bufsize > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufsize, sizeof bufsize);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufsize, sizeof bufsize);
  }
}

/* A listening socket on 127.0.0.1, any port. */
static int tcp_listen(int bufsize, struct sockaddr_in *addr, char *err, size_t errlen) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(err, errlen, "socket: %s", strerror(errno));
    return -1;
  }
  set_sock_opts(fd, bufsize); /* inherited by the accepted socket */
  memset(addr, 0, sizeof *addr);
  addr->sin_family = AF_INET;
  addr->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof *addr;
  if (bind(fd, (struct sockaddr *)addr, sizeof *addr) != 0 || listen(fd, 4) != 0 ||
      getsockname(fd, (struct sockaddr *)addr, &len) != 0) {
    snprintf(err, errlen, "bind/listen on 127.0.0.1: %s", strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

static int tcp_connect(const struct sockaddr_in *addr, int bufsize, char *err, size_t errlen) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(err, errlen, "socket: %s", strerror(errno));
    return -1;
  }
  set_sock_opts(fd, bufsize);
  while (connect(fd, (const struct sockaddr *)addr, sizeof *addr) != 0) {
    if (errno == EINTR && !g_interrupted) continue;
    snprintf(err, errlen, "connect to 127.0.0.1:%d: %s", ntohs(addr->sin_port),
             strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

/* Child side: accept one connection and read `total` bytes, then ack. */
static int stream_receiver(int lfd, uint64_t total) {
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd < 0) return 1;
  close(lfd);
  set_sock_opts(fd, STREAM_SOCKBUF);
  char *buf = malloc(STREAM_CHUNK);
  if (!buf) return 1;
  uint64_t got = 0;
  while (got < total) {
    ssize_t n = read(fd, buf, STREAM_CHUNK);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return 1;
    got += (uint64_t)n;
  }
  char ack = 'A';
  if (write_all(fd, &ack, 1) != 0) return 1;
  close(fd);
  free(buf);
  return 0;
}

/* One timed stream of `total` bytes; seconds, or < 0 on error. */
static double stream_once(uint64_t total, char *err, size_t errlen) {
  struct sockaddr_in addr;
  int lfd = tcp_listen(STREAM_SOCKBUF, &addr, err, errlen);
  if (lfd < 0) return -1;
  proc rx;
  memset(&rx, 0, sizeof rx);
  pid_t pid = fork_child();
  if (pid < 0) {
    snprintf(err, errlen, "fork: %s", strerror(errno));
    close(lfd);
    return -1;
  }
  if (pid == 0) _exit(stream_receiver(lfd, total));
  rx.pid = pid;
  close(lfd);
  double secs = -1;
  char *buf = NULL;
  int fd = tcp_connect(&addr, STREAM_SOCKBUF, err, errlen);
  if (fd < 0) goto out;
  buf = malloc(STREAM_CHUNK);
  if (!buf) {
    snprintf(err, errlen, "out of memory");
    goto out;
  }
  memset(buf, 0x5a, STREAM_CHUNK);
  double t0 = now_s();
  for (uint64_t sent = 0; sent < total;) {
    size_t n = total - sent < STREAM_CHUNK ? (size_t)(total - sent) : STREAM_CHUNK;
    if (write_all(fd, buf, n) != 0 || g_interrupted) {
      snprintf(err, errlen, "%s", g_interrupted ? "interrupted" : strerror(errno));
      goto out;
    }
    sent += n;
  }
  char ack;
  if (read_all(fd, &ack, 1) != 0) {
    snprintf(err, errlen, "the receiver sent no ack");
    goto out;
  }
  secs = now_s() - t0;
out:
  free(buf);
  if (fd >= 0) close(fd);
  if (secs < 0) proc_kill(&rx);
  else {
    proc_reap(&rx, 1);
    if (!WIFEXITED(rx.status) || WEXITSTATUS(rx.status) != 0) {
      snprintf(err, errlen, "the receiver failed");
      secs = -1;
    }
  }
  return secs;
}

static int echo_server(int lfd) {
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd < 0) return 1;
  close(lfd);
  set_sock_opts(fd, 0);
  char m[4];
  for (;;) {
    ssize_t n = 0;
    size_t got = 0;
    while (got < sizeof m) {
      n = read(fd, m + got, sizeof m - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += (size_t)n;
    }
    if (got == 0 && n == 0) return 0; /* clean close */
    if (got < sizeof m) return 1;
    if (write_all(fd, m, sizeof m) != 0) return 1;
  }
}

/* Median round trip in seconds, or < 0 on error. */
static double rtt_measure(char *err, size_t errlen) {
  struct sockaddr_in addr;
  int lfd = tcp_listen(0, &addr, err, errlen);
  if (lfd < 0) return -1;
  proc srv;
  memset(&srv, 0, sizeof srv);
  pid_t pid = fork_child();
  if (pid < 0) {
    snprintf(err, errlen, "fork: %s", strerror(errno));
    close(lfd);
    return -1;
  }
  if (pid == 0) {
    pin_cpu(-1); /* where psd 0 runs */
    _exit(echo_server(lfd));
  }
  pin_cpu(0); /* where worker 0 runs */
  srv.pid = pid;
  close(lfd);
  double result = -1;
  double *t = malloc(RTT_ITERS * sizeof *t);
  int fd = tcp_connect(&addr, 0, err, errlen);
  if (fd < 0 || !t) {
    if (!t) snprintf(err, errlen, "out of memory");
    goto out;
  }
  uint32_t msg = 0, back;
  for (int i = 0; i < RTT_WARMUP + RTT_ITERS; i++) {
    msg++;
    double t0 = now_s();
    if (write_all(fd, &msg, sizeof msg) != 0 || read_all(fd, &back, sizeof back) != 0) {
      snprintf(err, errlen, "%s", g_interrupted ? "interrupted" : "echo connection lost");
      goto out;
    }
    double t1 = now_s();
    if (back != msg) {
      snprintf(err, errlen, "echo returned the wrong message");
      goto out;
    }
    if (i >= RTT_WARMUP) t[i - RTT_WARMUP] = t1 - t0;
  }
  result = median(t, RTT_ITERS);
out:
  unpin_cpu();
  free(t);
  if (fd >= 0) close(fd);
  if (result < 0) proc_kill(&srv);
  else proc_reap(&srv, 1);
  return result;
}

/* ---------------------------------------------------------------------- */
/* Output */

static void print_table_header(void) {
  printf("%-11s %10s %4s %8s %6s %12s %10s %11s\n", "name", "size", "ps", "workers", "steps",
         "step_ms", "gbps", "total_gbps");
}

static void print_json_string(const char *s) {
  putchar('"');
  for (const char *p = s; *p; p++) {
    if (*p == '"' || *p == '\\') printf("\\%c", *p);
    else if ((unsigned char)*p < 0x20) printf("\\u%04x", (unsigned char)*p);
    else putchar(*p);
  }
  putchar('"');
}

static void print_pushpull(const pp_result *r) {
  char a[32], b[32], c[32], label[32];
  if (opt.json) {
    if (r->ok == 0) {
      printf("{\"name\":\"pushpull\",\"bytes\":%" PRIu64
             ",\"ps\":%d,\"workers\":%d,\"steps\":%d,\"error\":",
             r->bytes, r->ps, r->workers, r->steps);
      print_json_string(r->error);
      printf("}\n");
    } else {
      printf("{\"name\":\"pushpull\",\"bytes\":%" PRIu64
             ",\"ps\":%d,\"workers\":%d,\"steps\":%d,\"step_ms\":%s,\"gbps\":%s,"
             "\"total_gbps\":%s",
             r->bytes, r->ps, r->workers, r->steps, jnum(r->step_ms, a, sizeof a),
             jnum(r->gbps, b, sizeof b), jnum(r->total_gbps, c, sizeof c));
      if (r->ok < 0) {
        printf(",\"warning\":");
        print_json_string(r->error);
      }
      printf("}\n");
    }
  } else {
    size_label(r->bytes, label, sizeof label);
    if (r->ok == 0)
      printf("%-11s %10s %4d %8d %6d  FAILED: %s\n", "pushpull", label, r->ps, r->workers,
             r->steps, r->error);
    else
      printf("%-11s %10s %4d %8d %6d %12.3f %10.4f %11.4f%s\n", "pushpull", label, r->ps,
             r->workers, r->steps, r->step_ms, r->gbps, r->total_gbps,
             r->ok < 0 ? "  (wrong values)" : "");
  }
  fflush(stdout);
}

/* ---------------------------------------------------------------------- */

int main(int argc, char **argv) {
  parse_args(argc, argv);
  if (find_psd() != 0) return 2;
  install_signals();

  const char *base = getenv("TMPDIR");
  if (base && strlen(base) > 900) base = NULL;
  snprintf(g_tmpdir, sizeof g_tmpdir, "%s/ps_bench.XXXXXX", base && *base ? base : "/tmp");
  if (!mkdtemp(g_tmpdir)) {
    fprintf(stderr, "ps_bench: mkdtemp %s: %s\n", g_tmpdir, strerror(errno));
    return 1;
  }

  int failures = 0;
  double stream_gbps = NAN, rtt_us = NAN;
  char err[512];
  char a[32], b[32], label[32];

  if (!opt.json) print_table_header();

  if (opt.tcp_baseline && !g_interrupted) {
    uint64_t largest = 0;
    for (int i = 0; i < opt.n_sizes; i++)
      if (opt.sizes[i] > largest) largest = opt.sizes[i];
    uint64_t total = 256ULL << 20;
    if (largest * 4 > total) total = largest * 4;
    if (total > (1ULL << 30)) total = 1ULL << 30;
    progress("tcp_stream %s x3", size_label(total, label, sizeof label));
    double best = -1;
    for (int r = 0; r < 3 && !g_interrupted; r++) {
      double s = stream_once(total, err, sizeof err);
      if (s < 0) {
        progress("tcp_stream failed: %s", err);
        best = -1;
        break;
      }
      if (best < 0 || s < best) best = s;
    }
    if (best > 0) {
      stream_gbps = (double)total / best / 1e9;
      if (opt.json)
        printf("{\"name\":\"tcp_stream\",\"bytes\":%" PRIu64 ",\"gbps\":%s}\n", total,
               jnum(stream_gbps, a, sizeof a));
      else
        printf("%-11s %10s %4s %8s %6s %12.3f %10.4f %11s\n", "tcp_stream",
               size_label(total, label, sizeof label), "-", "-", "3", best * 1e3, stream_gbps,
               "-");
      fflush(stdout);
    } else {
      failures++;
    }

    if (!g_interrupted) {
      progress("tcp_rtt %d round trips", RTT_ITERS);
      double rtt = rtt_measure(err, sizeof err);
      if (rtt > 0) {
        rtt_us = rtt * 1e6;
        if (opt.json)
          printf("{\"name\":\"tcp_rtt\",\"bytes\":4,\"rtt_us\":%s,\"step_ms\":%s}\n",
                 jnum(rtt_us, a, sizeof a), jnum(rtt * 1e3, b, sizeof b));
        else
          printf("%-11s %10s %4s %8s %6d %12.4f %10s %11s   (rtt %.2f us)\n", "tcp_rtt", "4 B",
                 "-", "-", RTT_ITERS, rtt * 1e3, "-", "-", rtt_us);
        fflush(stdout);
      } else {
        progress("tcp_rtt failed: %s", err);
        failures++;
      }
    }
  }

  if (opt.telemetry_cost && !g_interrupted) {
    /* Same configuration, telemetry off then on, several times over. */
    double on[TELEM_ROUNDS], offv[TELEM_ROUNDS];
    int ok = 1;
    for (int r = 0; r < TELEM_ROUNDS && ok && !g_interrupted; r++)
      for (int off = 1; off >= 0 && ok; off--) {
        pp_result pr;
        g_telem_off = off;
        if (run_pushpull(1, 1, 4, opt.steps, &pr) != 0) ok = 0;
        (off ? offv : on)[r] = pr.step_ms;
      }
    g_telem_off = 0;
    if (ok) {
      double m_on = median(on, TELEM_ROUNDS), m_off = median(offv, TELEM_ROUNDS);
      if (opt.json)
        printf("{\"name\":\"telemetry_cost\",\"bytes\":4,\"ps\":1,\"workers\":1,"
               "\"rounds\":%d,\"step_ms_off\":%s,\"step_ms_on\":%s,\"ratio\":%s}\n",
               TELEM_ROUNDS, jnum(m_off, a, sizeof a), jnum(m_on, b, sizeof b),
               jnum(m_on / m_off, label, sizeof label));
      else
        printf("%-15s %10s  step with telemetry / without = %.4f (%.4f vs %.4f ms, median of "
               "%d runs each)\n",
               "telemetry_cost", "4 B", m_on / m_off, m_on, m_off, TELEM_ROUNDS);
      fflush(stdout);
    } else {
      failures++;
    }
  }

  int nres = opt.n_ps * opt.n_workers * opt.n_sizes;
  pp_result *res = calloc((size_t)nres, sizeof *res);
  if (!res) {
    fprintf(stderr, "ps_bench: out of memory\n");
    remove_tmpdir();
    return 1;
  }
  int k = 0;
  for (int i = 0; i < opt.n_ps && !g_interrupted; i++)
    for (int j = 0; j < opt.n_workers && !g_interrupted; j++)
      for (int s = 0; s < opt.n_sizes && !g_interrupted; s++) {
        uint64_t bytes = opt.sizes[s];
        int steps = opt.steps;
        if (bytes >= BIG_SIZE && !opt.steps_given && steps > BIG_STEPS) steps = BIG_STEPS;
        if (run_pushpull(opt.ps[i], opt.workers[j], bytes, steps, &res[k]) != 0) failures++;
        if (g_interrupted) break;
        print_pushpull(&res[k]);
        k++;
      }

  if (opt.tcp_baseline && !g_interrupted) {
    for (int i = 0; i < k; i++) {
      const pp_result *r = &res[i];
      if (r->ok == 0 || r->ps != 1 || r->workers != 1) continue;
      const char *vs = NULL;
      double value = NAN;
      if (r->bytes >= (1ULL << 20) && isfinite(stream_gbps)) {
        vs = "tcp_stream";
        value = r->gbps / stream_gbps;
      } else if (r->bytes == 4 && isfinite(rtt_us)) {
        vs = "tcp_rtt";
        value = r->step_ms * 1000.0 / rtt_us;
      }
      if (!vs) continue;
      if (opt.json)
        printf("{\"name\":\"ratio\",\"bytes\":%" PRIu64
               ",\"ps\":1,\"workers\":1,\"vs\":\"%s\",\"value\":%s}\n",
               r->bytes, vs, jnum(value, a, sizeof a));
      else if (!strcmp(vs, "tcp_stream"))
        printf("%-15s %10s  pushpull gbps / tcp_stream gbps = %.4f\n", "ratio_vs_stream",
               size_label(r->bytes, label, sizeof label), value);
      else
        printf("%-15s %10s  pushpull step / tcp round trip  = %.2f\n", "ratio_vs_rtt",
               size_label(r->bytes, label, sizeof label), value);
    }
    fflush(stdout);
  }
  free(res);

  reap_all_children();
  if (g_interrupted) {
    progress("interrupted; logs kept in %s", g_tmpdir);
    return 130;
  }
  if (failures) {
    progress("%d measurement(s) failed or gave wrong values; logs kept in %s", failures, g_tmpdir);
    return 1;
  }
  remove_tmpdir();
  return 0;
}
