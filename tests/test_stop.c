/* Integration (libpsclient/src/signals.c, psd's stop exit statuses): a
 * stop means a checkpoint. Real psd processes and real worker processes
 * (tests/stop_worker.c, the README's quick-start worker, which installs no
 * signal handler):
 * - SIGTERM to the workers alone stops the job after a checkpoint: every
 *   psd exits 75 with its file of the stop step, the workers get
 *   PS_ESTOPPED, and a rerun continues from that step;
 * - with PS_SIGNALS=0 the SIGTERM kills the worker, and psd exits 69 (not
 *   75) saying nothing was saved;
 * - an application's own SIGTERM handler is kept (SIGUSR1, which it left
 *   at its default, still stops the job);
 * - the handlers come with the first client and go with the last. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

#define NPS 2
#define NW 2

/* A worker process and where its output goes. */
typedef struct worker {
  pid_t pid;        /* 0 once reaped */
  int status;       /* wait status once reaped */
  char out[600];    /* its stdout */
  char err[600];    /* its stderr */
} worker;

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Starts nps psd with --checkpoint-dir dir (and --stop-timeout 30, so a
 * stop that waits for nothing shows as a timeout, not as luck). */
static void start_ps(tu_psd *ps, int nps, const char *dir, char hosts[][64],
                     const char **hp) {
  for (int i = 0; i < nps; i++) {
    char idx[8], np[8];
    snprintf(idx, sizeof idx, "%d", i);
    snprintf(np, sizeof np, "%d", nps);
    const char *args[] = {"--ps-index", idx, "--num-ps", np, "--checkpoint-dir", dir,
                          "--grace-period", "5", "--stop-timeout", "30", NULL};
    ck_assert_msg(tu_psd_start(&ps[i], args) == 0, "psd %d did not start", i);
  }
  tu_hosts(ps, nps, hosts, hp);
}

/* Starts stop_worker `steps` [opt] as worker w of nw, with psrun's
 * environment (extra: one more NAME=VALUE, or NULL). */
static void start_worker(worker *k, const char **hp, int nps, int w, int nw, int steps,
                         const char *opt, const char *extra) {
  static int seq;
  char hosts[256] = "";
  for (int i = 0; i < nps; i++)
    snprintf(hosts + strlen(hosts), sizeof hosts - strlen(hosts), "%s%s", i ? "," : "", hp[i]);
  snprintf(k->out, sizeof k->out, "%s/w%d-%d.out", tu_tmpdir(), w, ++seq);
  snprintf(k->err, sizeof k->err, "%s/w%d-%d.err", tu_tmpdir(), w, seq);
  k->pid = fork();
  ck_assert_int_ge(k->pid, 0);
  if (k->pid == 0) {
    char wi[16], nws[16], st[16];
    snprintf(wi, sizeof wi, "%d", w);
    snprintf(nws, sizeof nws, "%d", nw);
    snprintf(st, sizeof st, "%d", steps);
    setenv("PS_HOSTS", hosts, 1);
    setenv("PS_WORKER_INDEX", wi, 1);
    setenv("PS_NUM_WORKERS", nws, 1);
    /* Small slices: the variable spreads over every ps. */
    setenv("PS_SPLIT_THRESHOLD", "16", 1);
    setenv("PS_MAX_SLICE_BYTES", "16", 1);
    unsetenv("PS_SIGNALS");
    if (extra) putenv((char *)extra);
    signal(SIGTERM, SIG_DFL); /* as a launcher starts it */
    signal(SIGUSR1, SIG_DFL);
    if (!freopen(k->out, "w", stdout) || !freopen(k->err, "w", stderr)) _exit(126);
    execl(STOP_WORKER_BIN, "stop_worker", st, opt, (char *)NULL);
    _exit(127);
  }
}

/* 1 once file holds needle, 0 after timeout_s. */
static int wait_text(const char *file, const char *needle, double timeout_s) {
  for (int i = 0; i < timeout_s * 50; i++) {
    char *s = tu_read_file(file);
    int hit = s && strstr(s, needle);
    free(s);
    if (hit) return 1;
    sleep_ms(20);
  }
  return 0;
}

/* Waits up to timeout_s for the worker to exit: 0, or -1. */
static int wait_worker(worker *k, double timeout_s) {
  for (int i = 0; i < timeout_s * 50; i++) {
    if (waitpid(k->pid, &k->status, WNOHANG) == k->pid) {
      k->pid = 0;
      return 0;
    }
    sleep_ms(20);
  }
  return -1;
}

static void kill_worker(worker *k) {
  if (k->pid <= 0) return;
  kill(k->pid, SIGKILL);
  waitpid(k->pid, &k->status, 0);
  k->pid = 0;
}

/* The number after needle in file (or -1). */
static long number_after(const char *file, const char *needle) {
  char *s = tu_read_file(file);
  char *at = s ? strstr(s, needle) : NULL;
  long v = at ? strtol(at + strlen(needle), NULL, 10) : -1;
  free(s);
  return v;
}

static void expect_exit(tu_psd *p, int i, int code) {
  ck_assert_msg(tu_psd_wait(p, 15) == 0, "psd %d did not exit", i);
  ck_assert_msg(WIFEXITED(p->status) && WEXITSTATUS(p->status) == code,
                "psd %d: wait status 0x%x, want exit %d", i, p->status, code);
}

/* The quick-start worker, unchanged, under two psd: SIGTERM to the workers
 * (not to psd) stops the job after a checkpoint. Before the library
 * handled the signal it killed them, and nothing was saved. */
START_TEST(sigterm_to_a_plain_worker_checkpoints) {
  char dir[600];
  snprintf(dir, sizeof dir, "%s/ck-plain", tu_tmpdir());
  tu_psd ps[NPS];
  char hosts[NPS][64];
  const char *hp[NPS];
  start_ps(ps, NPS, dir, hosts, hp);
  worker w[NW];
  for (int i = 0; i < NW; i++) start_worker(&w[i], hp, NPS, i, NW, 1000000, NULL, NULL);
  for (int i = 0; i < NW; i++)
    ck_assert_msg(wait_text(w[i].out, "first step", 20), "worker %d never stepped", i);
  sleep_ms(300);
  for (int i = 0; i < NW; i++) kill(w[i].pid, SIGTERM);
  for (int i = 0; i < NW; i++) {
    ck_assert_msg(wait_worker(&w[i], 20) == 0, "worker %d still running", i);
    /* The quick start prints ps_client_errmsg and exits 1 on any error:
     * PS_ESTOPPED's sentence shows it came through the stop. */
    ck_assert_msg(WIFEXITED(w[i].status), "worker %d was killed (wait status 0x%x)", i,
                  w[i].status);
    ck_assert_msg(number_after(w[i].err, "the parameter servers checkpointed step ") > 0,
                  "worker %d did not get PS_ESTOPPED", i);
  }
  for (int i = 0; i < NPS; i++) expect_exit(&ps[i], i, 75);
  long s0 = number_after(ps[0].log_path, "stopping on request: checkpoint at step ");
  long s1 = number_after(ps[1].log_path, "stopping on request: checkpoint at step ");
  ck_assert_msg(s0 > 0 && s0 == s1, "ps0 stopped at step %ld, ps1 at %ld", s0, s1);
  ck_assert_int_eq(number_after(w[0].err, "checkpointed step "), s0);
  /* ps_client_stop_step names it in every worker, whichever step its last
   * pull returned. */
  for (int i = 0; i < NW; i++) ck_assert_int_eq(number_after(w[i].err, "stop step "), s0);
  for (int i = 0; i < NPS; i++) {
    char f[800];
    snprintf(f, sizeof f, "%s/step-%012ld/ps-%d-of-%d.ckpt", dir, s0, i, NPS);
    ck_assert_msg(access(f, F_OK) == 0, "%s is missing", f);
  }
  /* The same command again continues from that step. */
  start_ps(ps, NPS, dir, hosts, hp);
  for (int i = 0; i < NW; i++) start_worker(&w[i], hp, NPS, i, NW, 5, NULL, NULL);
  for (int i = 0; i < NW; i++) {
    ck_assert_msg(wait_worker(&w[i], 30) == 0, "resumed worker %d still running", i);
    ck_assert_msg(WIFEXITED(w[i].status) && WEXITSTATUS(w[i].status) == 0,
                  "resumed worker %d: wait status 0x%x", i, w[i].status);
    long first = number_after(w[i].out, "first step ");
    ck_assert_msg(first >= s0 && first <= s0 + 1, "resumed worker %d began at step %ld, not %ld",
                  i, first, s0);
  }
  for (int i = 0; i < NPS; i++) {
    expect_exit(&ps[i], i, 0);
    ck_assert_int_eq(number_after(ps[i].log_path, "restoring step "), s0);
  }
}
END_TEST

/* PS_SIGNALS=0: the library leaves SIGTERM alone, the worker dies of it,
 * and psd says (status 69 and a log line) that this stop saved nothing,
 * instead of claiming 75. */
START_TEST(opted_out_worker_dies_and_psd_says_nothing_was_saved) {
  char dir[600];
  snprintf(dir, sizeof dir, "%s/ck-optout", tu_tmpdir());
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, dir, hosts, hp);
  worker w;
  start_worker(&w, hp, 1, 0, 1, 1000000, NULL, "PS_SIGNALS=0");
  ck_assert_msg(wait_text(w.out, "first step", 20), "worker never stepped");
  sleep_ms(200);
  /* psrun forwards SIGTERM to every task. The worker is held stopped while
   * psd takes its SIGTERM, so it cannot answer the stop with a checkpoint
   * before its own SIGTERM kills it: over shared memory a step is quick
   * enough to do that between two kill() calls. */
  int st;
  kill(w.pid, SIGSTOP);
  ck_assert_msg(waitpid(w.pid, &st, WUNTRACED) == w.pid && WIFSTOPPED(st), "worker not stopped");
  kill(ps[0].pid, SIGTERM);
  sleep_ms(200);
  kill(w.pid, SIGTERM);
  kill(w.pid, SIGCONT);
  ck_assert_msg(wait_worker(&w, 10) == 0, "worker still running");
  ck_assert_msg(WIFSIGNALED(w.status) && WTERMSIG(w.status) == SIGTERM,
                "worker was not killed by SIGTERM (wait status 0x%x)", w.status);
  expect_exit(&ps[0], 0, 69);
  ck_assert(tu_log_contains(&ps[0], "stopped without a checkpoint"));
  ck_assert(tu_log_contains(&ps[0], "cannot resume from this stop"));
  ck_assert_msg(!tu_log_contains(&ps[0], "stopping on request: checkpoint at step"),
                "psd wrote a stop checkpoint after all");
}
END_TEST

/* A SIGTERM handler the application installed before ps_client_create is
 * its own: the library leaves it (the SIGTERM does not stop the job), and
 * takes only SIGUSR1, which the application left at its default. */
START_TEST(own_sigterm_handler_is_kept) {
  char dir[600];
  snprintf(dir, sizeof dir, "%s/ck-own", tu_tmpdir());
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, dir, hosts, hp);
  worker w;
  start_worker(&w, hp, 1, 0, 1, 1000000, "--own-sigterm", NULL);
  ck_assert_msg(wait_text(w.out, "first step", 20), "worker never stepped");
  ck_assert_msg(wait_text(w.out, "SIGTERM handler kept", 1), "the library replaced it");
  kill(w.pid, SIGTERM);
  ck_assert_msg(wait_text(w.out, "own SIGTERM handler ran", 5), "the own handler did not run");
  sleep_ms(300);
  ck_assert_msg(waitpid(w.pid, &w.status, WNOHANG) == 0, "the SIGTERM ended the worker");
  ck_assert_msg(tu_psd_wait(&ps[0], 0.1) == -1, "the SIGTERM stopped the job");
  kill(w.pid, SIGUSR1);
  ck_assert_msg(wait_worker(&w, 20) == 0, "worker still running after SIGUSR1");
  ck_assert_msg(WIFEXITED(w.status), "SIGUSR1 killed the worker (wait status 0x%x)", w.status);
  ck_assert_msg(number_after(w.err, "the parameter servers checkpointed step ") > 0,
                "worker did not get PS_ESTOPPED");
  expect_exit(&ps[0], 0, 75);
  kill_worker(&w);
}
END_TEST

/* In this process: the first client installs the handlers, a second
 * shares them, the last destroy puts SIG_DFL back; no_signal_handlers
 * installs none. */
START_TEST(handlers_come_with_the_first_client_and_go_with_the_last) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  const char *args[] = {NULL};
  ck_assert(tu_psd_start(&ps[0], args) == 0);
  tu_hosts(ps, 1, hosts, hp);
  signal(SIGTERM, SIG_DFL);
  signal(SIGUSR1, SIG_DFL);
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 2;
  char err[256];
  ps_client *a, *b;
  struct sigaction now;
  cfg.no_signal_handlers = 1;
  ck_assert_msg(ps_client_create(&cfg, &a, err, sizeof err) == 0, "%s", err);
  sigaction(SIGTERM, NULL, &now);
  ck_assert_msg(now.sa_handler == SIG_DFL, "no_signal_handlers installed one");
  ps_client_destroy(a);
  cfg.no_signal_handlers = 0;
  ck_assert_msg(ps_client_create(&cfg, &a, err, sizeof err) == 0, "%s", err);
  cfg.worker_index = 1;
  ck_assert_msg(ps_client_create(&cfg, &b, err, sizeof err) == 0, "%s", err);
  for (int s = 0; s < 2; s++) {
    sigaction(s ? SIGUSR1 : SIGTERM, NULL, &now);
    ck_assert_msg(now.sa_handler != SIG_DFL, "no handler for signal %d", s ? SIGUSR1 : SIGTERM);
  }
  ps_client_destroy(a);
  sigaction(SIGTERM, NULL, &now);
  ck_assert_msg(now.sa_handler != SIG_DFL, "the first destroy removed it while b lives");
  ps_client_destroy(b);
  for (int s = 0; s < 2; s++) {
    sigaction(s ? SIGUSR1 : SIGTERM, NULL, &now);
    ck_assert_msg(now.sa_handler == SIG_DFL, "signal %d not restored", s ? SIGUSR1 : SIGTERM);
  }
  tu_psd_kill(&ps[0]);
}
END_TEST

Suite *suite_stop(void) {
  Suite *s = suite_create("stop");
  TCase *tc = tcase_create("stop");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, sigterm_to_a_plain_worker_checkpoints);
  tcase_add_test(tc, opted_out_worker_dies_and_psd_says_nothing_was_saved);
  tcase_add_test(tc, own_sigterm_handler_is_kept);
  tcase_add_test(tc, handlers_come_with_the_first_client_and_go_with_the_last);
  suite_add_tcase(s, tc);
  return s;
}
