/* ps_bench.c - push/pull throughput and latency of psd, with baselines to
 * compare against (raw TCP, memcpy, MPI_Allreduce) taken in the same run.
 *
 * For every combination of --ps, --workers and --sizes, ps_bench starts the
 * psd processes (found next to this executable, or --psd PATH) on 127.0.0.1
 * with --port 0 --port-file, forks the workers (each one a ps_client with a
 * single float32 variable of the requested size) and times ps_client_step,
 * which pushes a gradient and pulls the parameters of the next step. Each
 * worker sends its per-step times to the parent through a pipe; the parent
 * reports the median over worker 0's timed steps.
 *
 *   name "pushpull": round bytes ps workers steps step_ms gbps total_gbps
 *                    max_step_ms
 *     gbps       = 2 * bytes / median step seconds / 1e9 (push + pull bytes
 *                  one worker moves per step)
 *     total_gbps = gbps * workers
 *     max_step_ms = worker 0's slowest timed step (a stall shows here)
 *
 * All of it runs --rounds times, interleaved: each round takes every
 * baseline asked for and then every psd configuration (ps_bench_rounds.c).
 * --tcp-baseline adds "tcp_stream" (one TCP connection over loopback) and
 * "tcp_rtt" (median round trip of 4-byte messages), --memcpy-baseline
 * "memcpy" (one thread), --mpi-baseline "mpi_allreduce_shm" and
 * "mpi_allreduce_tcp" (Open MPI, as many ranks as workers). After the
 * rounds: a "summary" per figure (the per-round values, their median and
 * range) and "ratio" lines (psd against each baseline: the ratio of the
 * medians, and the range of the per-round ratios).
 *
 * --table K:D[,K:D...] times sparse-table steps instead ("table", with
 * keys, dim and keys_per_s; ps_bench_table.c), each run followed by a
 * dense pushpull of the same row bytes and a "ratio" of their step times;
 * --table-store times psd's table store alone (ps_bench_store.c).
 *
 * Logs of psd and of the workers go to a temporary directory that is
 * removed when everything succeeded and kept (and named) otherwise.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_bench_internal.h"

#define PS_BENCH_STR_(x) #x
#define PS_BENCH_STR(x) PS_BENCH_STR_(x)

/* The files: see ps_bench_internal.h. */

options opt;
int g_telem_off;

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
          "  --rounds N             interleaved rounds: each takes every baseline,\n"
          "                         then every psd run; medians, ranges and\n"
          "                         ratios of medians follow [%d]\n"
          "  --tcp-baseline         also measure a raw TCP stream and 4-byte TCP\n"
          "                         round trips, and print ratios against them\n"
          "  --memcpy-baseline      also time memcpy of each size (one thread)\n"
          "  --mpi-baseline         also time MPI_Allreduce (Open MPI, as many\n"
          "                         ranks as --workers) over shared memory and\n"
          "                         over TCP; \"MPI baseline: not built\" when\n"
          "                         ps_bench was built without Open MPI\n"
          "  --table K:D[,K:D...]   sparse-table steps instead: each worker pulls K\n"
          "                         rows of D floats, adds K gradient rows and\n"
          "                         steps (K with suffixes k, M); every table run\n"
          "                         is followed by a dense push+pull of the same\n"
          "                         row bytes, and table / dense is a ratio (no\n"
          "                         --sizes runs unless --sizes is given)\n"
          "  --table-store          with --table: time psd's table store alone on\n"
          "                         one core, no network (find-or-insert of K keys\n"
          "                         into a table of capacity K, each rule's update\n"
          "                         of the K rows, and a memcpy of their bytes)\n"
          "  --json                 one JSON object per line on stdout\n"
          "  --telemetry-cost       time 4-byte steps (1 ps, 1 worker) with the\n"
          "                         per-step telemetry off and on, alternating\n"
          "                         %d times, and print the ratio of the medians\n"
          "  --transport T[,T...]   auto, tcp or shm: psd's --transport and the\n"
          "                         workers' PS_TRANSPORT [auto: shared memory];\n"
          "                         with several, every psd run is taken over\n"
          "                         each in the same round, and shm against tcp\n"
          "                         is a ratio\n"
          "  --psd-arg ARG          pass ARG to every psd (repeat for several,\n"
          "                         e.g. --psd-arg=--checkpoint-every --psd-arg=4)\n"
          "  --mpi-arg ARG          pass ARG to every mpirun of --mpi-baseline\n"
          "                         (repeat for several, e.g. --mpi-arg=--mca\n"
          "                         --mpi-arg=coll_tuned_use_dynamic_rules\n"
          "                         --mpi-arg=1 to pick an allreduce algorithm)\n"
          "  --psd-exit-wait S      seconds psd may take to exit after the workers\n"
          "                         finished (it writes accepted checkpoints) [15]\n"
          "  --no-pin               do not pin servers to the last CPUs and\n"
          "                         workers to the first ones (pinning makes the\n"
          "                         latency baseline comparable; a run with more\n"
          "                         processes than CPUs is never pinned)\n"
          "  --psd PATH             psd binary [next to this executable]\n"
          "  --help                 print this and exit\n", DEFAULT_ROUNDS, TELEM_ROUNDS);
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

/* --sizes: a comma-separated list of sizes. */
static void parse_size_list(const char *flag, const char *val) {
  const char *what = "expected sizes from 1 to 16G, suffixes K/M/G, comma-separated";
  if (!*val || val[strlen(val) - 1] == ',' || val[0] == ',' || strstr(val, ",,"))
    bad_value(flag, val, what);
  char *copy = strdup(val);
  if (!copy) exit(1);
  opt.n_sizes = 0;
  char *save = NULL;
  for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    uint64_t b;
    if (parse_size(tok, &b) != 0) bad_value(flag, val, what);
    if (opt.n_sizes >= MAX_LIST) bad_value(flag, val, "too many entries");
    opt.sizes[opt.n_sizes++] = b;
  }
  free(copy);
}

/* --transport T[,T...]: each of auto, tcp, shm at most once. Each run
 * passes its entry to psd (--transport) and the workers (PS_TRANSPORT). */
static void parse_transports(const char *flag, const char *val) {
  static const char *const known[MAX_TRANSPORTS] = {"auto", "tcp", "shm"};
  opt.n_transports = 0;
  const char *p = val;
  for (;;) {
    size_t l = strcspn(p, ",");
    int k = -1;
    for (int i = 0; i < MAX_TRANSPORTS; i++)
      if (strlen(known[i]) == l && !strncmp(p, known[i], l)) k = i;
    if (k < 0) bad_value(flag, val, "expected a list of auto, tcp and shm");
    for (int i = 0; i < opt.n_transports; i++)
      if (opt.transports[i] == known[k]) bad_value(flag, val, "a transport given twice");
    opt.transports[opt.n_transports++] = known[k];
    if (!p[l]) break;
    p += l + 1;
  }
}

/* Options with a value: "--flag VALUE" or "--flag=VALUE". Returns the
 * index of the last argument used. */
static int parse_value_option(int argc, char **argv, int a) {
  const char *arg = argv[a];
  static const char *const with_value[] = {"--ps", "--workers", "--sizes", "--steps",
                                           "--psd", "--psd-arg", "--psd-exit-wait",
                                           "--mpi-arg",
                                           "--rounds", "--transport", "--table"};
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
    parse_size_list(fbuf, val);
    opt.sizes_given = 1;
  } else if (!strcmp(flag, "--table")) {
    parse_table_list(fbuf, val);
  } else if (!strcmp(flag, "--psd")) {
    if (!*val || strlen(val) >= sizeof opt.psd) bad_value(fbuf, val, "expected a path");
    snprintf(opt.psd, sizeof opt.psd, "%s", val);
  } else if (!strcmp(flag, "--psd-exit-wait")) {
    long v;
    if (parse_int(val, 1, 100000, &v) != 0)
      bad_value(fbuf, val, "expected seconds from 1 to 100000");
    opt.psd_exit_s = (int)v;
  } else if (!strcmp(flag, "--rounds")) {
    long v;
    if (parse_int(val, 1, MAX_ROUNDS, &v) != 0)
      bad_value(fbuf, val, "expected an integer from 1 to " PS_BENCH_STR(MAX_ROUNDS));
    opt.rounds = (int)v;
  } else if (!strcmp(flag, "--transport")) {
    parse_transports(fbuf, val);
  } else if (!strcmp(flag, "--psd-arg")) {
    if (opt.n_psd_args >= MAX_PSD_ARGS) bad_value(fbuf, val, "given too many times");
    opt.psd_args[opt.n_psd_args++] = val;
  } else if (!strcmp(flag, "--mpi-arg")) {
    if (opt.n_mpi_args >= MAX_PSD_ARGS) bad_value(fbuf, val, "given too many times");
    opt.mpi_args[opt.n_mpi_args++] = val;
  }
  return a;
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
  opt.psd_exit_s = 15;
  opt.rounds = DEFAULT_ROUNDS;
  for (int a = 1; a < argc; a++) {
    const char *arg = argv[a];
    if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
      usage(stdout);
      exit(0);
    }
    if (!strcmp(arg, "--tcp-baseline")) opt.tcp_baseline = 1;
    else if (!strcmp(arg, "--json")) opt.json = 1;
    else if (!strcmp(arg, "--telemetry-cost")) opt.telemetry_cost = 1;
    else if (!strcmp(arg, "--no-pin")) opt.pin = 0;
    else if (!strcmp(arg, "--memcpy-baseline")) opt.memcpy_baseline = 1;
    else if (!strcmp(arg, "--mpi-baseline")) opt.mpi_baseline = 1;
    else if (!strcmp(arg, "--table-store")) opt.table_store = 1;
    else a = parse_value_option(argc, argv, a);
  }
  if (opt.table_store && !opt.n_tables) {
    fprintf(stderr, "ps_bench: --table-store needs --table K:D (the tables to time)\n");
    exit(2);
  }
  if (opt.n_tables && !opt.sizes_given) opt.n_sizes = 0; /* the tables' runs only */
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
/* The measurements */

/* --telemetry-cost: the same configuration, telemetry off then on, several
 * times over; 0, or 1 when a run failed. */
static int run_telemetry_cost(void) {
  double on[TELEM_ROUNDS], offv[TELEM_ROUNDS];
  int ok = 1;
  for (int r = 0; r < TELEM_ROUNDS && ok && !g_interrupted; r++)
    for (int off = 1; off >= 0 && ok; off--) {
      pp_result pr;
      g_telem_off = off;
      if (run_pushpull(1, 1, 4, opt.steps, opt.n_transports ? opt.transports[0] : NULL,
                       &pr) != 0)
        ok = 0;
      (off ? offv : on)[r] = pr.step_ms;
    }
  g_telem_off = 0;
  if (!ok) return 1;
  print_telemetry_cost(median(on, TELEM_ROUNDS), median(offv, TELEM_ROUNDS));
  return 0;
}

int steps_for(uint64_t bytes) {
  if (bytes >= BIG_SIZE && !opt.steps_given && opt.steps > BIG_STEPS) return BIG_STEPS;
  return opt.steps;
}

/* Kills what is left; the exit status, and the logs kept or removed. */
static int finish(int failures) {
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

int main(int argc, char **argv) {
  parse_args(argc, argv);
  if (find_psd() != 0) return 2;
  install_signals();
  if (make_tmpdir() != 0) return 1;

  int failures = 0;
  if (opt.table_store) return finish(run_table_store());
  if (opt.telemetry_cost && !g_interrupted) failures += run_telemetry_cost();
  if (!g_interrupted) failures += run_rounds();
  return finish(failures);
}
