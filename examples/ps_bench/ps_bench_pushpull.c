/* ps_bench_pushpull.c - one "pushpull" measurement: nps psd processes and
 * nw forked workers, each a ps_client with one float32 variable that times
 * ps_client_step and sends its step times to the parent through a pipe.
 *
 * The parent's side is a sequence of stages over one pp_run (start the
 * servers, start the workers, collect the reports, check them, wait for the
 * workers and then the servers to exit); the first stage that fails stops
 * the sequence, and pp_teardown, the one way out, kills what is left and
 * says what failed. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "psclient.h"
#include "ps_bench_internal.h"

/* ---------------------------------------------------------------------- */
/* Worker process (a forked child) */

/* What a worker sends back, followed by nsteps doubles (seconds). */
typedef struct worker_report {
  uint32_t magic;
  int32_t worker;
  int32_t rc;          /* 0, or the failing ps_* code */
  int32_t nsteps;      /* timed steps that follow */
  int32_t stale;       /* steps that came back stale */
  int32_t bad_steps;   /* checks (after the warm-up, after the last step)
                          that found some parameter wrong */
  double expect, got;  /* first wrong element: expected and actual */
  uint64_t first_step, last_step;
  char msg[512];
} worker_report;
#define REPORT_MAGIC 0x50534243u

typedef struct worker {
  worker_report rep;
  double *times;      /* rep.nsteps timed steps, seconds */
  ps_client *c;
  ps_var *v;
  const char *phase;  /* the call that failed, for rep.msg */
  int widx, steps;
  size_t numel;
  uint64_t step;
} worker;

/* Says in rep.msg which call failed; returns rc. */
static int worker_fail(worker *wk, int rc) {
  snprintf(wk->rep.msg, sizeof wk->rep.msg, "%s: %s: %s", wk->phase, ps_strerror(rc),
           ps_client_errmsg(wk->c));
  return rc;
}

/* Creates the client and the variable and pulls: 0 or a ps_* code. */
static int worker_connect(worker *wk, const char *const *hosts, int nps, int nw) {
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hosts;
  cfg.num_ps = nps;
  cfg.worker_index = wk->widx;
  cfg.num_workers = nw;
  cfg.connect_timeout_ms = 20000;
  cfg.request_timeout_ms = 300000;
  cfg.telemetry = g_telem_off ? "off" : NULL; /* NULL: on, in memory */
  char err[400] = "";
  wk->phase = "ps_client_create";
  int rc = ps_client_create(&cfg, &wk->c, err, sizeof err);
  if (rc) {
    snprintf(wk->rep.msg, sizeof wk->rep.msg, "%s: %s (%s)", wk->phase, ps_strerror(rc), err);
    return rc;
  }
  if (g_table.keys) return 0; /* table steps: table_worker_steps creates it */
  int64_t shape[1] = {(int64_t)wk->numel};
  ps_init init = PS_SIZED(ps_init, PS_INIT_ZEROS, 0, 0, 1);
  ps_optimizer o;
  ps_optimizer_default(&o, LEARNING_RATE);
  wk->phase = "ps_client_var_create";
  rc = ps_client_var_create(wk->c, "ps_bench/var", shape, 1, &init, &o, &wk->v);
  if (rc) return worker_fail(wk, rc);
  wk->phase = "ps_client_pull";
  rc = ps_client_pull(wk->c, 0, &wk->step);
  if (rc) return worker_fail(wk, rc);
  wk->rep.first_step = wk->step;
  return 0;
}

/* Checks the parameters after the steps before->wk->step (untimed). Every
 * worker pushes the same gradient, so whatever the averaging, each applied
 * step moves every element by -lr * g from the zeros. */
static void worker_check(worker *wk, uint64_t before) {
  const float *data = ps_var_data(wk->v);
  size_t numel = wk->numel;
  double applied = (double)(wk->step - wk->rep.first_step);
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
  if (!bad) return;
  if (!wk->rep.bad_steps) {
    size_t last_bad = first_bad;
    for (size_t i = first_bad; i < numel; i++)
      if (!isfinite(data[i]) || fabs(data[i] - expect) > tol) last_bad = i;
    wk->rep.expect = expect;
    wk->rep.got = data[first_bad];
    snprintf(wk->rep.msg, sizeof wk->rep.msg,
             "after ps_client_step %" PRIu64 "->%" PRIu64 ": %zu of %zu elements wrong "
             "(first [%zu] = %.9g, last [%zu] = %.9g; expected %.9g)",
             before, wk->step, bad, numel, first_bad, (double)data[first_bad], last_bad,
             (double)data[last_bad], expect);
    fprintf(stderr, "worker %d: %s\n", wk->widx, wk->rep.msg);
  }
  wk->rep.bad_steps++;
}

/* The warm-up and the timed steps: 0 or a ps_* code. As the MPI
 * baseline's ranks, the workers do nothing between steps: the gradient is
 * written once (the library does not change it), and the parameters are
 * checked after the warm-up and after the last step (each applied step
 * moves them by the same amount, so a lost or doubled update anywhere
 * shows there). Checking every step cost each worker two passes over the
 * model between steps, taken from the others' timed steps whenever the
 * processes outnumber the CPUs. */
static int worker_steps(worker *wk) {
  if (g_table.keys) {
    wk->phase = "table steps";
    int rc = table_worker_steps(wk->c, wk->steps, wk->times, wk->rep.msg, sizeof wk->rep.msg);
    if (rc >= 0) wk->rep.nsteps = wk->steps;
    if (rc == 1) wk->rep.bad_steps = 1; /* measured, but the rows are wrong */
    return rc == 1 ? 0 : rc;
  }
  float *grad = ps_var_grad(wk->v);
  for (size_t i = 0; i < wk->numel; i++) grad[i] = GRAD_VALUE;
  wk->phase = "ps_client_step";
  uint64_t before = wk->step;
  for (int s = 0; s < WARMUP_STEPS + wk->steps; s++) {
    int stale = 0;
    double t0 = now_s();
    int rc = ps_client_step(wk->c, &wk->step, &stale);
    double t1 = now_s();
    if (rc) return worker_fail(wk, rc);
    wk->rep.stale += stale;
    if (s >= WARMUP_STEPS) wk->times[wk->rep.nsteps++] = t1 - t0;
    if (s == WARMUP_STEPS - 1 || s == WARMUP_STEPS + wk->steps - 1) {
      worker_check(wk, before);
      before = wk->step;
    }
  }
  wk->rep.last_step = wk->step;
  return 0;
}

/* Sends the report (rc: the run's outcome), finishes the client when all
 * went well, frees; the process's exit status. */
static int worker_report_and_exit_status(worker *wk, int fd, int rc) {
  wk->rep.rc = rc;
  fprintf(stderr, "worker %d: %s%s\n", wk->widx, rc ? "failed: " : "done ",
          rc ? wk->rep.msg : "");
  if (write_all(fd, &wk->rep, sizeof wk->rep) != 0 ||
      (wk->rep.nsteps &&
       write_all(fd, wk->times, (size_t)wk->rep.nsteps * sizeof *wk->times) != 0)) {
    fprintf(stderr, "worker %d: cannot report to the parent: %s\n", wk->widx, strerror(errno));
    rc = rc ? rc : PS_EIO;
  }
  close(fd);
  if (wk->c && rc == 0) {
    int frc = ps_client_finish(wk->c);
    if (frc) {
      fprintf(stderr, "worker %d: ps_client_finish: %s: %s\n", wk->widx, ps_strerror(frc),
              ps_client_errmsg(wk->c));
      rc = frc;
    }
  }
  ps_client_destroy(wk->c);
  free(wk->times);
  return rc ? 1 : 0;
}

static int worker_main(int fd, const char *const *hosts, int nps, int widx, int nw,
                       size_t numel, int steps) {
  worker wk;
  memset(&wk, 0, sizeof wk);
  wk.rep.magic = REPORT_MAGIC;
  wk.rep.worker = widx;
  wk.widx = widx;
  wk.numel = numel;
  wk.steps = steps;
  wk.phase = "setup";
  wk.times = calloc((size_t)steps, sizeof *wk.times);
  int rc;
  if (!wk.times) {
    rc = PS_ENOMEM;
    snprintf(wk.rep.msg, sizeof wk.rep.msg, "out of memory");
  } else {
    rc = worker_connect(&wk, hosts, nps, nw);
    if (!rc) rc = worker_steps(&wk);
  }
  return worker_report_and_exit_status(&wk, fd, rc);
}

/* ---------------------------------------------------------------------- */
/* The parent's side of one measurement */

typedef struct pp_run {
  int run;                 /* sequence number, in the log names */
  int nps, nw, steps;
  size_t numel;
  uint64_t bytes;
  pp_result *res;
  proc ps[MAX_PS], wk[MAX_WORKERS];
  char addrs[MAX_PS][64];
  const char *hosts[MAX_PS];
  int fds[MAX_WORKERS];    /* read ends of the report pipes; -1: closed */
  int open_fds;
  worker_report reps[MAX_WORKERS];
  double *times[MAX_WORKERS];
  size_t got[MAX_WORKERS], need[MAX_WORKERS]; /* bytes of report + times */
  int failed, show_logs;
  char err[600];
} pp_run;

static int g_run_seq;

static int pp_failed(pp_run *r) {
  r->failed = 1;
  return -1;
}

static void pp_init(pp_run *r, int nps, int nw, uint64_t req_bytes, int steps, pp_result *res) {
  memset(r, 0, sizeof *r);
  r->run = ++g_run_seq;
  r->numel = req_bytes / 4 ? (size_t)(req_bytes / 4) : 1;
  r->bytes = (uint64_t)r->numel * 4;
  r->nps = nps;
  r->nw = nw;
  r->steps = steps;
  r->res = res;
  r->show_logs = 1;
  for (int w = 0; w < MAX_WORKERS; w++) r->fds[w] = -1;
  for (int w = 0; w < nw; w++) r->need[w] = sizeof(worker_report);
  memset(res, 0, sizeof *res);
  res->bytes = r->bytes;
  res->keys = g_table.keys;
  res->dim = g_table.dim;
  res->ps = nps;
  res->workers = nw;
  res->steps = steps;
  res->step_ms = res->gbps = res->total_gbps = res->max_step_ms = NAN;
}

static int pp_start_servers(pp_run *r) {
  for (int i = 0; i < r->nps; i++) {
    if (start_psd(&r->ps[i], r->run, i, r->nps, r->nw, r->addrs[i], sizeof r->addrs[i], r->err,
                  sizeof r->err))
      return pp_failed(r);
    r->hosts[i] = r->addrs[i];
  }
  return 0;
}

/* In the forked worker w: its log, its CPU, then worker_main. */
__attribute__((noreturn)) static void pp_worker_child(pp_run *r, int w, int fd) {
  for (int k = 0; k < w; k++)
    if (r->fds[k] >= 0) close(r->fds[k]);
  int lfd = open(r->wk[w].log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (lfd >= 0) {
    dup2(lfd, 1);
    dup2(lfd, 2);
    close(lfd);
  }
  pin_cpu(w);
  _exit(worker_main(fd, r->hosts, r->nps, w, r->nw, r->numel, r->steps));
}

static int pp_start_worker(pp_run *r, int w) {
  int pfd[2];
  if (pipe2(pfd, O_CLOEXEC) != 0) {
    snprintf(r->err, sizeof r->err, "pipe: %s", strerror(errno));
    return pp_failed(r);
  }
  snprintf(r->wk[w].log, sizeof r->wk[w].log, "%s/run%d.worker%d.log", g_tmpdir, r->run, w);
  pid_t pid = fork_child();
  if (pid < 0) {
    snprintf(r->err, sizeof r->err, "fork: %s", strerror(errno));
    close(pfd[0]);
    close(pfd[1]);
    return pp_failed(r);
  }
  if (pid == 0) {
    close(pfd[0]);
    pp_worker_child(r, w, pfd[1]);
  }
  r->wk[w].pid = pid;
  close(pfd[1]);
  r->fds[w] = pfd[0];
  return 0;
}

static int pp_start_workers(pp_run *r) {
  for (int w = 0; w < r->nw; w++)
    if (pp_start_worker(r, w) != 0) return -1;
  return 0;
}

/* Worker w's pipe is readable: reads into its report, then its times.
 * -1 when the report is malformed or there is no memory (stop reading);
 * a worker that closed its pipe early or failed marks the run failed. */
static int pp_read_report(pp_run *r, int w) {
  char *dst;
  size_t room;
  if (r->got[w] < sizeof(worker_report)) {
    dst = (char *)&r->reps[w] + r->got[w];
    room = sizeof(worker_report) - r->got[w];
  } else {
    dst = (char *)r->times[w] + (r->got[w] - sizeof(worker_report));
    room = r->need[w] - r->got[w];
  }
  ssize_t n = room ? read(r->fds[w], dst, room) : 0;
  if (n < 0 && errno == EINTR) return 0;
  if (n > 0) {
    r->got[w] += (size_t)n;
    if (r->got[w] != sizeof(worker_report)) return 0;
    const worker_report *rep = &r->reps[w];
    if (rep->magic != REPORT_MAGIC || rep->nsteps < 0 || rep->nsteps > r->steps) {
      snprintf(r->err, sizeof r->err, "worker %d sent a malformed report", w);
      return pp_failed(r);
    }
    r->need[w] = sizeof(worker_report) + (size_t)rep->nsteps * sizeof(double);
    r->times[w] = calloc((size_t)rep->nsteps + 1, sizeof(double));
    if (!r->times[w]) {
      snprintf(r->err, sizeof r->err, "out of memory");
      return pp_failed(r);
    }
    return 0;
  }
  /* EOF, full report or error. */
  close(r->fds[w]);
  r->fds[w] = -1;
  r->open_fds--;
  if (r->failed) return 0;
  if (r->got[w] < r->need[w] || r->got[w] < sizeof(worker_report)) {
    snprintf(r->err, sizeof r->err, "worker %d exited without a complete report", w);
    r->failed = 1;
  } else if (r->reps[w].rc != 0) {
    snprintf(r->err, sizeof r->err, "worker %d: %.500s", w, r->reps[w].msg);
    r->failed = 1;
  }
  return 0;
}

/* One poll of the open pipes, for at most `left` seconds. */
static int pp_poll_reports(pp_run *r, double left) {
  struct pollfd pf[MAX_WORKERS];
  int map[MAX_WORKERS], n = 0;
  for (int w = 0; w < r->nw; w++)
    if (r->fds[w] >= 0) {
      pf[n].fd = r->fds[w];
      pf[n].events = POLLIN;
      pf[n].revents = 0;
      map[n++] = w;
    }
  int pr = poll(pf, (nfds_t)n, left > 1.0 ? 1000 : (int)(left * 1000) + 1);
  if (pr < 0) {
    if (errno == EINTR) return 0;
    snprintf(r->err, sizeof r->err, "poll: %s", strerror(errno));
    return pp_failed(r);
  }
  for (int k = 0; k < n; k++)
    if (pf[k].revents && pp_read_report(r, map[k]) != 0) break;
  return r->failed ? -1 : 0;
}

/* Reads every worker's report; stops at the first failure, as the other
 * workers would hang. */
static int pp_collect_reports(pp_run *r) {
  /* Generous: assume at least 20 MB/s per step, plus start-up. */
  double budget =
      60.0 + (double)r->bytes * 2.0 * r->nw * (r->steps + WARMUP_STEPS + 2) / 20e6;
  double deadline = now_s() + budget;
  r->open_fds = r->nw;
  while (r->open_fds > 0) {
    if (g_interrupted) {
      snprintf(r->err, sizeof r->err, "interrupted");
      r->show_logs = 0;
      return pp_failed(r);
    }
    double left = deadline - now_s();
    if (left <= 0) {
      snprintf(r->err, sizeof r->err, "workers did not finish within %.0f s", budget);
      return pp_failed(r);
    }
    if (pp_poll_reports(r, left) != 0) return -1;
  }
  return 0;
}

/* The median over worker 0's timed steps gives the result. */
static void pp_measure(pp_run *r) {
  pp_result *res = r->res;
  double med = median(r->times[0], (size_t)r->reps[0].nsteps);
  res->step_ms = med * 1e3;
  res->max_step_ms = 0;
  for (int i = 0; i < r->reps[0].nsteps; i++)
    if (r->times[0][i] * 1e3 > res->max_step_ms) res->max_step_ms = r->times[0][i] * 1e3;
  res->gbps = med > 0 ? 2.0 * (double)r->bytes / med / 1e9 : NAN;
  res->total_gbps = res->gbps * r->nw;
  if (r->nw > 1) {
    /* The other workers' medians, for the record. */
    double lo = med, hi = med;
    for (int w = 1; w < r->nw; w++) {
      double m = median(r->times[w], (size_t)r->reps[w].nsteps);
      if (m < lo) lo = m;
      if (m > hi) hi = m;
    }
    progress("  median step over workers: %.3f..%.3f ms", lo * 1e3, hi * 1e3);
  }
}

/* Step counts, stale steps and wrong values in the reports; then the
 * result. Wrong values keep the measurement (res->ok = -1). */
static int pp_check_reports(pp_run *r) {
  pp_result *res = r->res;
  int total = r->steps + WARMUP_STEPS;
  for (int w = 0; w < r->nw; w++) {
    const worker_report *rep = &r->reps[w];
    if (rep->nsteps != r->steps) {
      snprintf(r->err, sizeof r->err, "worker %d reported %d steps, expected %d", w,
               rep->nsteps, r->steps);
      r->failed = 1;
    }
    if (rep->stale) progress("warning: worker %d had %d stale step(s)", w, rep->stale);
    if (rep->bad_steps) {
      progress("warning: worker %d: wrong parameter values at %d of 2 checks (after the "
               "warm-up, after step %d); first: %s",
               w, rep->bad_steps, total, rep->msg);
      if (res->ok == 0)
        snprintf(res->error, sizeof res->error,
                 "worker %d: wrong parameter values at %d of 2 checks (after the warm-up, "
                 "after step %d); first: %.400s", w, rep->bad_steps, total, rep->msg);
      res->ok = -1; /* measured, but the values are wrong */
    }
  }
  if (r->failed) return -1;
  pp_measure(r);
  return 0;
}

/* Polls p until it exits, the deadline passes or a signal came. */
static int wait_exit(proc *p, double deadline) {
  while (!proc_reap(p, 0)) {
    if (g_interrupted || now_s() > deadline) break;
    sleep_ms(5);
  }
  return p->reaped;
}

/* Workers: all should exit 0 shortly after ps_client_finish. */
static int pp_wait_workers(pp_run *r) {
  double deadline = now_s() + 30.0;
  for (int w = 0; w < r->nw; w++) {
    if (!wait_exit(&r->wk[w], deadline)) {
      snprintf(r->err, sizeof r->err, "worker %d did not exit within 30 s after its report", w);
      return pp_failed(r);
    }
    int st = r->wk[w].status;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      char s[96];
      describe_status(st, s, sizeof s);
      snprintf(r->err, sizeof r->err, "worker %d: %s", w, s);
      return pp_failed(r);
    }
  }
  return 0;
}

/* psd: exits 0 once every worker has finished. */
static int pp_wait_servers(pp_run *r) {
  double deadline = now_s() + opt.psd_exit_s;
  for (int i = 0; i < r->nps; i++) {
    if (!wait_exit(&r->ps[i], deadline)) {
      snprintf(r->err, sizeof r->err,
               "psd %d did not exit within %d s after all workers finished (killed; see "
               "--psd-exit-wait)", i, opt.psd_exit_s);
      return pp_failed(r);
    }
    int st = r->ps[i].status;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      char s[96];
      describe_status(st, s, sizeof s);
      snprintf(r->err, sizeof r->err, "psd %d: %s after all workers finished", i, s);
      return pp_failed(r);
    }
  }
  return 0;
}

/* The one way out: closes the pipes, kills what still runs, frees, and on
 * failure fills res->error and shows the logs. 0 when the values were right. */
static int pp_teardown(pp_run *r) {
  pp_result *res = r->res;
  if (g_interrupted && !r->failed) {
    snprintf(r->err, sizeof r->err, "interrupted");
    r->failed = 1;
    r->show_logs = 0;
  }
  for (int w = 0; w < r->nw; w++) {
    if (r->fds[w] >= 0) close(r->fds[w]);
    proc_kill(&r->wk[w]);
    free(r->times[w]);
  }
  for (int i = 0; i < r->nps; i++) proc_kill(&r->ps[i]);
  if (r->failed) {
    char label[32];
    snprintf(res->error, sizeof res->error, "%s", r->err);
    res->ok = 0;
    progress("pushpull %s ps=%d workers=%d failed: %s",
             size_label(r->bytes, label, sizeof label), r->nps, r->nw, r->err);
    if (r->show_logs) print_logs(r->ps, r->nps, r->wk, r->nw);
    return -1;
  }
  if (res->ok == 0) res->ok = 1;
  return res->ok == 1 ? 0 : -1;
}

const char *g_transport;
int g_run_procs;

int run_pushpull(int nps, int nw, uint64_t req_bytes, int steps, const char *transport,
                 pp_result *res) {
  pp_run r;
  pp_init(&r, nps, nw, req_bytes, steps, res);
  res->transport = transport;
  g_transport = transport;
  g_run_procs = nps + nw;
  if (transport) setenv("PS_TRANSPORT", transport, 1); /* the forked workers' */
  char label[32];
  if (g_table.keys)
    snprintf(label, sizeof label, "%llux%u", (unsigned long long)g_table.keys, g_table.dim);
  else
    size_label(r.bytes, label, sizeof label);
  progress("%s %s ps=%d workers=%d steps=%d%s%s", g_table.keys ? "table" : "pushpull",
           label, nps, nw, steps,
           transport ? " transport=" : "", transport ? transport : "");
  if (pp_start_servers(&r) == 0 && pp_start_workers(&r) == 0 && pp_collect_reports(&r) == 0 &&
      pp_check_reports(&r) == 0 && pp_wait_workers(&r) == 0)
    pp_wait_servers(&r);
  g_run_procs = 0;
  return pp_teardown(&r);
}
