/* ps_bench_mpi.c - the MPI baseline of --mpi-baseline: once a round, for
 * each worker count and each of two Open MPI transports (the shared-memory
 * BTL, "vader" or "sm" as mpi_allreduce_bench --shm-btl says, and TCP over
 * loopback), one
 *
 *   mpirun --oversubscribe -np W --bind-to core|none --mca btl self,BTL
 *          [--mca btl_tcp_if_include lo] mpi_allreduce_bench --sizes ...
 *
 * whose stdout (a JSON line per size, from rank 0) comes back through a
 * pipe and whose stderr goes to a log in the log directory. As root,
 * mpirun needs --allow-run-as-root and the OMPI_ALLOW_RUN_AS_ROOT*
 * variables. The baseline exists only when CMake found Open MPI
 * (PS_BENCH_MPIRUN names its mpirun); otherwise ps_bench says
 * "MPI baseline: not built". */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ps_bench_internal.h"

/* Bytes of mpi_allreduce_bench's output kept (a line per size). */
#define MPI_OUT_MAX (MAX_LIST * 512)
/* Seconds mpirun may take to start and to exit, beyond the transfers. */
#define MPI_SLACK_S 60.0
/* Seconds mpirun gets to stop its ranks after SIGTERM before SIGKILL. */
#define MPI_TERM_S 5.0

#ifdef PS_BENCH_MPIRUN
#define MPIRUN PS_BENCH_MPIRUN
#else
#define MPIRUN "mpirun" /* never run: mpi_built says "not built" first */
#endif

static char g_mpi_bench[PATH_MAX]; /* mpi_allreduce_bench, next to ps_bench */
static char g_shm_btl[16];         /* "vader" or "sm" */

#ifdef PS_BENCH_MPIRUN
/* Runs `mpi_allreduce_bench --shm-btl` (no MPI_Init) into g_shm_btl. */
static int query_shm_btl(char *why, size_t len) {
  char cmd[PATH_MAX + 32];
  snprintf(cmd, sizeof cmd, "'%s' --shm-btl", g_mpi_bench);
  FILE *f = popen(cmd, "r");
  char line[64] = "";
  if (!f || !fgets(line, sizeof line, f)) {
    if (f) pclose(f);
    snprintf(why, len, "%s --shm-btl printed nothing", g_mpi_bench);
    return -1;
  }
  pclose(f);
  line[strcspn(line, "\r\n")] = '\0';
  if (strcmp(line, "vader") != 0 && strcmp(line, "sm") != 0) {
    snprintf(why, len, "%s --shm-btl printed '%s'", g_mpi_bench, line);
    return -1;
  }
  snprintf(g_shm_btl, sizeof g_shm_btl, "%s", line);
  return 0;
}
#endif

int mpi_built(char *why, size_t len) {
#ifndef PS_BENCH_MPIRUN
  snprintf(why, len, "MPI baseline: not built (CMake found no Open MPI; install "
           "openmpi-bin libopenmpi-dev and reconfigure)");
  return 0;
#else
  if (g_shm_btl[0]) return 1;
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) {
    snprintf(why, len, "cannot read /proc/self/exe: %s", strerror(errno));
    return -1;
  }
  self[n] = '\0';
  char *slash = strrchr(self, '/');
  if (slash) *slash = '\0';
  if (snprintf(g_mpi_bench, sizeof g_mpi_bench, "%s/mpi_allreduce_bench", self) >=
      (int)sizeof g_mpi_bench) {
    snprintf(why, len, "path too long: %s", self);
    return -1;
  }
  if (access(g_mpi_bench, X_OK) != 0) {
    snprintf(why, len, "MPI baseline built but %s is missing: %s", g_mpi_bench,
             strerror(errno));
    return -1;
  }
  if (access(PS_BENCH_MPIRUN, X_OK) != 0) {
    snprintf(why, len, "MPI baseline built but %s is missing: %s", PS_BENCH_MPIRUN,
             strerror(errno));
    return -1;
  }
  return query_shm_btl(why, len) == 0 ? 1 : -1;
#endif
}

/* The state of one mpirun. */
typedef struct mpi_run {
  proc p;                 /* mpirun; its own process group */
  int fd;                 /* read end of its stdout; -1: closed */
  char out[MPI_OUT_MAX];  /* its stdout so far */
  size_t got;
  char err[512];
} mpi_run;

/* In the forked child: own process group (so that a timeout can stop the
 * ranks too), stdout to the pipe, stderr to the log, then mpirun. */
__attribute__((noreturn)) static void exec_mpirun(const mpi_run *m, int wfd,
                                                  char *const *argv) {
  setpgid(0, 0);
  int lfd = open(m->p.log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (lfd >= 0) {
    dup2(lfd, 2);
    close(lfd);
  }
  dup2(wfd, 1);
  close(wfd);
  int nul = open("/dev/null", O_RDONLY);
  if (nul >= 0) {
    dup2(nul, 0);
    close(nul);
  }
  if (geteuid() == 0) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  }
  execv(argv[0], argv);
  fprintf(stderr, "execv %s: %s\n", argv[0], strerror(errno));
  _exit(127);
}

/* Seconds one mpirun may take: MPI_SLACK_S, plus every size's transfers
 * at a pessimistic 20 MB/s (as pushpull's budget). */
static double mpi_budget_s(int ranks) {
  double b = MPI_SLACK_S;
  for (int s = 0; s < opt.n_sizes; s++)
    b += (double)opt.sizes[s] * 2.0 * ranks * (steps_for(opt.sizes[s]) + 2) / 20e6;
  return b;
}

/* Reads mpirun's stdout until EOF or the deadline; 0 at EOF. */
static int mpi_read(mpi_run *m, double deadline) {
  while (!g_interrupted) {
    double left = deadline - now_s();
    if (left <= 0) return -1;
    struct pollfd pf = {m->fd, POLLIN, 0};
    int pr = poll(&pf, 1, left > 1.0 ? 1000 : (int)(left * 1000) + 1);
    if (pr <= 0) continue;
    char buf[4096];
    ssize_t n = read(m->fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return 0;
    size_t room = sizeof m->out - 1 - m->got;
    size_t k = (size_t)n < room ? (size_t)n : room;
    memcpy(m->out + m->got, buf, k);
    m->got += k;
    m->out[m->got] = '\0';
  }
  return -1;
}

/* Stops the whole process group: SIGTERM (mpirun stops its ranks), then
 * SIGKILL after MPI_TERM_S. */
static void mpi_stop(mpi_run *m) {
  if (m->p.pid <= 0 || m->p.reaped) return;
  kill(-m->p.pid, SIGTERM);
  double deadline = now_s() + MPI_TERM_S;
  while (!proc_reap(&m->p, 0) && now_s() < deadline) sleep_ms(10);
  if (!m->p.reaped) {
    kill(-m->p.pid, SIGKILL);
    proc_reap(&m->p, 1);
  }
}

/* A number after "key": in one line of mpi_allreduce_bench; NAN if none. */
static double json_field(const char *line, const char *key) {
  char k[40];
  snprintf(k, sizeof k, "\"%s\":", key);
  const char *p = strstr(line, k);
  if (!p) return NAN;
  char *end;
  double v = strtod(p + strlen(k), &end);
  return end == p + strlen(k) ? NAN : v;
}

/* Picks each size's line out of m->out; -1 when one is missing. */
static int mpi_parse(mpi_run *m, int ranks, double *step_ms, double *max_ms) {
  int missing = 0;
  for (int s = 0; s < opt.n_sizes; s++) {
    step_ms[s] = max_ms[s] = NAN;
    uint64_t want = opt.sizes[s] / 4 ? opt.sizes[s] / 4 * 4 : 4;
    for (const char *line = m->out; line && *line;) {
      const char *nl = strchr(line, '\n');
      if (!strncmp(line, "{\"name\":\"mpi_allreduce\"", 23) &&
          json_field(line, "bytes") == (double)want && json_field(line, "ranks") == ranks) {
        step_ms[s] = json_field(line, "step_ms");
        max_ms[s] = json_field(line, "max_step_ms");
      }
      line = nl ? nl + 1 : NULL;
    }
    if (!isfinite(step_ms[s])) missing++;
  }
  if (missing)
    snprintf(m->err, sizeof m->err, "%d size(s) without a result line", missing);
  return missing ? -1 : 0;
}

/* argv of one mpirun, in `store` (strings that outlive the call). */
static void mpi_argv(const char **argv, char store[4][64], char *sizes, size_t slen,
                     int ranks, int tcp) {
  int a = 0, big = 0;
  argv[a++] = MPIRUN;
  if (geteuid() == 0) argv[a++] = "--allow-run-as-root";
  argv[a++] = "--oversubscribe";
  snprintf(store[0], 64, "%d", ranks);
  argv[a++] = "-np";
  argv[a++] = store[0];
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  argv[a++] = "--bind-to";
  argv[a++] = opt.pin && ranks <= ncpu ? "core" : "none";
  snprintf(store[1], 64, "self,%s", tcp ? "tcp" : g_shm_btl);
  argv[a++] = "--mca";
  argv[a++] = "btl";
  argv[a++] = store[1];
  if (tcp) { /* loopback, as psd here: Open MPI leaves lo out by default */
    argv[a++] = "--mca";
    argv[a++] = "btl_tcp_if_include";
    argv[a++] = "lo";
  }
  for (int i = 0; i < opt.n_mpi_args; i++) argv[a++] = opt.mpi_args[i];
  argv[a++] = g_mpi_bench;
  size_t k = 0;
  sizes[0] = '\0';
  for (int s = 0; s < opt.n_sizes; s++) {
    k += (size_t)snprintf(sizes + k, slen - k, "%s%" PRIu64, s ? "," : "", opt.sizes[s]);
    if (steps_for(opt.sizes[s]) != opt.steps) big = 1;
  }
  argv[a++] = "--sizes";
  argv[a++] = sizes;
  snprintf(store[2], 64, "%d", opt.steps);
  argv[a++] = "--iters";
  argv[a++] = store[2];
  if (big) { /* sizes from BIG_SIZE on run BIG_STEPS, as in ps_bench */
    snprintf(store[3], 64, "%d:%llu", BIG_STEPS, (unsigned long long)BIG_SIZE);
    argv[a++] = "--big-iters";
    argv[a++] = store[3];
  }
  argv[a] = NULL;
}

int mpi_round(int ranks, int tcp, double *step_ms, double *max_ms) {
  static int seq;
  mpi_run m;
  memset(&m, 0, sizeof m);
  m.fd = -1;
  for (int s = 0; s < opt.n_sizes; s++) step_ms[s] = max_ms[s] = NAN;
  const char *argv[32 + MAX_PSD_ARGS];
  char store[4][64], sizes[MAX_LIST * 24];
  mpi_argv(argv, store, sizes, sizeof sizes, ranks, tcp);
  snprintf(m.p.log, sizeof m.p.log, "%s/mpi%d.np%d.%s.log", g_tmpdir, ++seq, ranks,
           tcp ? "tcp" : "shm");
  progress("mpi_allreduce %s ranks=%d (%s)", tcp ? "tcp" : "shm", ranks, store[1]);
  int pfd[2];
  if (pipe2(pfd, O_CLOEXEC) != 0) {
    progress("mpi_allreduce: pipe: %s", strerror(errno));
    return -1;
  }
  pid_t pid = fork_child();
  if (pid < 0) {
    progress("mpi_allreduce: fork: %s", strerror(errno));
    close(pfd[0]);
    close(pfd[1]);
    return -1;
  }
  if (pid == 0) {
    close(pfd[0]);
    exec_mpirun(&m, pfd[1], (char *const *)argv);
  }
  m.p.pid = pid;
  close(pfd[1]);
  m.fd = pfd[0];
  double budget = mpi_budget_s(ranks);
  int rc = mpi_read(&m, now_s() + budget);
  close(m.fd);
  if (rc != 0) snprintf(m.err, sizeof m.err, "%s", g_interrupted ? "interrupted" :
                        "mpirun gave no end of output within the time budget");
  if (rc == 0) { /* its output ended: it exits now */
    double deadline = now_s() + MPI_SLACK_S;
    while (!proc_reap(&m.p, 0) && now_s() < deadline && !g_interrupted) sleep_ms(10);
    if (!m.p.reaped) {
      snprintf(m.err, sizeof m.err, "mpirun did not exit within %.0f s", MPI_SLACK_S);
      rc = -1;
    } else if (!WIFEXITED(m.p.status) || WEXITSTATUS(m.p.status) != 0) {
      char st[96];
      describe_status(m.p.status, st, sizeof st);
      snprintf(m.err, sizeof m.err, "mpirun: %s", st);
      rc = -1;
    }
  }
  mpi_stop(&m);
  if (rc == 0) rc = mpi_parse(&m, ranks, step_ms, max_ms);
  if (rc != 0) {
    progress("mpi_allreduce %s ranks=%d failed: %s (log: %s)", tcp ? "tcp" : "shm", ranks,
             m.err, m.p.log);
    print_logs(&m.p, 1, NULL, 0);
  }
  return rc;
}
