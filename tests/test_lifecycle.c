/* Integration: when psd exits and what it says — all workers finished, a
 * worker killed mid-step, a stalled step, a lost backup worker, a chief
 * still busy after the others finished (waited for; exit 68 only under
 * --finish-timeout), startup timeout, SIGTERM, where the summary goes. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

static void start1(tu_psd *ps, char hosts[][64], const char **hp, const char *const *extra) {
  ck_assert_msg(tu_psd_start(ps, extra) == 0, "psd did not start");
  tu_hosts(ps, 1, hosts, hp);
}

static void init_train(tu_train *t, const char **hp, int nw, int i, int steps) {
  memset(t, 0, sizeof *t);
  t->hosts = hp;
  t->num_ps = 1;
  t->num_workers = nw;
  t->worker = i;
  t->steps = steps;
  t->batch = 8;
}

/* A worker process that connects, then stops (SIGSTOP to itself) until the
 * test kills it: a worker that never delivers its gradient, or dies in the
 * middle of a step. (It cannot create variables: non-chief workers wait
 * for the chief's values.) Returns its pid. */
static pid_t doomed_worker(const char **hp, int nw, int index) {
  pid_t pid = fork();
  if (pid == 0) {
    tu_train t;
    init_train(&t, hp, nw, index, 0);
    ps_config cfg;
    ps_config_init(&cfg);
    cfg.hosts = t.hosts;
    cfg.num_ps = 1;
    cfg.worker_index = index;
    cfg.num_workers = nw;
    cfg.replicas_to_aggregate = t.replicas;
    ps_client *c;
    char err[256];
    if (ps_client_create(&cfg, &c, err, sizeof err)) _exit(3);
    raise(SIGSTOP);
    _exit(0);
  }
  /* Wait until it has stopped (it has joined). */
  int st;
  ck_assert_int_eq(waitpid(pid, &st, WUNTRACED), pid);
  ck_assert_msg(WIFSTOPPED(st), "doomed worker exited early (status %d)", st);
  return pid;
}

/* A client for worker `index` of `nw` on one ps, with one variable "a"
 * (the chief's values: call it for worker 0 first). */
static ps_client *connect_worker(const char **hp, int index, int nw) {
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.worker_index = index;
  cfg.num_workers = nw;
  cfg.telemetry = "off";
  char err[512];
  ps_client *c = NULL;
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "worker %d: %s", index, err);
  int64_t shape[1] = {4};
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "a", shape, 1, NULL, NULL, &v), 0);
  return c;
}

static int count_of(const char *s, const char *needle) {
  int n = 0;
  for (const char *p = s; p && (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
  return n;
}

/* (c) Every worker finishes: psd exits 0 by itself, and says so. */
START_TEST(test_exit_when_all_finish) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start1(&ps, hosts, hp, NULL);
  tu_train t[2];
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    init_train(&t[i], hp, 2, i, 3);
    pthread_create(&th[i], NULL, tu_train_worker, &t[i]);
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) ck_assert_msg(t[i].rc == 0, "worker %d: %s", i, t[i].err);
  ck_assert_msg(tu_psd_wait(&ps, 5) == 0, "psd still running after all workers finished");
  ck_assert(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 0);
  ck_assert(tu_log_contains(&ps, "all 2 workers finished"));
  ck_assert(tu_log_contains(&ps, "worker 1 joined"));
}
END_TEST

/* (d) A worker killed mid-step, no backups: psd exits non-zero within the
 * grace period and names the worker; the surviving worker gets an error
 * naming the ps instead of hanging. */
START_TEST(test_killed_worker) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  const char *extra[] = {"--grace-period", "1", NULL};
  start1(&ps, hosts, hp, extra);
  pid_t doomed = doomed_worker(hp, 2, 1);
  tu_train t;
  init_train(&t, hp, 2, 0, 5);
  pthread_t th;
  pthread_create(&th, NULL, tu_train_worker, &t);
  struct timespec ts = {0, 300 * 1000000L};
  nanosleep(&ts, NULL); /* worker 0 has pushed step 0 and waits for worker 1 */
  double t0 = 0;
  {
    struct timespec n;
    clock_gettime(CLOCK_MONOTONIC, &n);
    t0 = (double)n.tv_sec + n.tv_nsec * 1e-9;
  }
  kill(doomed, SIGKILL);
  waitpid(doomed, NULL, 0);
  ck_assert_msg(tu_psd_wait(&ps, 5) == 0, "psd did not exit after losing a worker");
  struct timespec n;
  clock_gettime(CLOCK_MONOTONIC, &n);
  double took = (double)n.tv_sec + n.tv_nsec * 1e-9 - t0;
  ck_assert_msg(took < tu_time_limit(3.0), "psd took %.1f s to give up (grace 1 s)", took);
  ck_assert_msg(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 66, "psd status %d",
                ps.status);
  ck_assert(tu_log_contains(&ps, "worker 1 ("));
  ck_assert(tu_log_contains(&ps, "left at step 0 without finishing"));
  ck_assert(tu_log_contains(&ps, "worker(s) 1 did not come back"));
  pthread_join(th, NULL);
  ck_assert_int_ne(t.rc, 0);
  ck_assert_msg(strstr(t.err, "ps 0 at 127.0.0.1:") != NULL, "worker error: %s", t.err);
}
END_TEST

/* A lost backup worker is tolerated: training goes on and psd exits 0. */
START_TEST(test_lost_backup_worker) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  const char *extra[] = {"--grace-period", "1", NULL};
  start1(&ps, hosts, hp, extra);
  tu_train t[2];
  for (int i = 0; i < 2; i++) {
    init_train(&t[i], hp, 3, i, 10);
    t[i].replicas = 2;
  }
  /* The doomed one must agree on replicas too. */
  pid_t pid = fork();
  if (pid == 0) {
    ps_config cfg;
    ps_config_init(&cfg);
    cfg.hosts = hp;
    cfg.num_ps = 1;
    cfg.worker_index = 2;
    cfg.num_workers = 3;
    cfg.replicas_to_aggregate = 2;
    ps_client *c;
    char err[256];
    if (ps_client_create(&cfg, &c, err, sizeof err)) _exit(3);
    raise(SIGSTOP);
    _exit(0);
  }
  int st;
  waitpid(pid, &st, WUNTRACED);
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, tu_train_worker, &t[i]);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) ck_assert_msg(t[i].rc == 0, "worker %d: %s", i, t[i].err);
  ck_assert_uint_eq(t[0].final_step, 10);
  ck_assert_msg(tu_psd_wait(&ps, 5) == 0, "psd did not exit");
  ck_assert_msg(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 0, "status %d", ps.status);
  ck_assert(tu_log_contains(&ps, "worker 2 ("));
  ck_assert(tu_log_contains(&ps, "tolerated as backups"));
}
END_TEST

/* (g) A step waiting longer than --stall-timeout is logged with the missing
 * worker; it completes once the worker comes. */
START_TEST(test_stall_logged) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  const char *extra[] = {"--stall-timeout", "0.3", NULL};
  start1(&ps, hosts, hp, extra);
  pid_t slow = doomed_worker(hp, 2, 1); /* stopped: registered, not pushing */
  tu_train t;
  init_train(&t, hp, 2, 0, 1);
  pthread_t th;
  pthread_create(&th, NULL, tu_train_worker, &t);
  int seen = 0;
  for (int i = 0; i < 50 && !seen; i++) {
    struct timespec ts = {0, 100 * 1000000L};
    nanosleep(&ts, NULL);
    seen = tu_log_contains(&ps, "step 0 stalled");
  }
  ck_assert_msg(seen, "no stall line in the log");
  ck_assert(tu_log_contains(&ps, "waiting for worker(s) 1"));
  ck_assert(tu_log_contains(&ps, "variables: W, b"));
  kill(slow, SIGKILL);
  waitpid(slow, NULL, 0);
  tu_psd_kill(&ps); /* worker 0 then fails fast instead of waiting */
  pthread_join(th, NULL);
  ck_assert_int_ne(t.rc, 0);
}
END_TEST

/* Bug: a chief evaluating or saving for more than 90 s after its last step
 * was killed (psd exited 68 after --stall-timeout + --grace-period). Worker
 * 1 finishes; worker 0 stays connected and silent 4 s, well past that old
 * bound (0.5 + 1 s here). psd names it once (rate-limited), says this is
 * normal, goes on waiting, and exits 0 when it finishes. */
START_TEST(test_busy_chief_is_waited_for) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  const char *extra[] = {"--stall-timeout", "0.5", "--grace-period", "1", NULL};
  start1(&ps, hosts, hp, extra);
  ps_client *w0 = connect_worker(hp, 0, 2);
  ps_client *w1 = connect_worker(hp, 1, 2);
  ck_assert_int_eq(ps_client_finish(w1), 0);
  ps_client_destroy(w1);
  int gone = tu_psd_wait(&ps, 4) == 0; /* the chief "evaluates" meanwhile */
  char *log = tu_read_file(ps.log_path);
  ck_assert_msg(!gone, "psd exited (status %d) while the chief was still connected; log:\n%s",
                WEXITSTATUS(ps.status), log);
  ck_assert_msg(strstr(log, "waiting for worker 0 (from 127.0.0.1:") &&
                    strstr(log, "it is still connected and has been silent for") &&
                    strstr(log, "this is normal while it evaluates or saves after training") &&
                    strstr(log, "the job ends when it calls ps_client_finish (Python: "
                                "client.finish() or leaving the `with` block) or exits"),
                "psd explains the wait, naming worker 0:\n%s", log);
  ck_assert_msg(count_of(log, "waiting for worker") == 1, "not rate-limited:\n%s", log);
  ck_assert_msg(!strstr(log, "status 68"), "a threat of exit 68:\n%s", log);
  free(log);
  ck_assert_int_eq(ps_client_finish(w0), 0);
  ps_client_destroy(w0);
  ck_assert_msg(tu_psd_wait(&ps, 5) == 0, "psd still running after the chief finished");
  ck_assert_msg(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 0, "status %d", ps.status);
  ck_assert(tu_log_contains(&ps, "all 2 workers finished"));
}
END_TEST

/* Opt-in bound: with --finish-timeout 2, the same silent chief ends the
 * job with 68 about 2 s after the others finished, and psd says why. */
START_TEST(test_finish_timeout_exits_68) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  const char *extra[] = {"--stall-timeout", "0.5", "--finish-timeout", "2", NULL};
  start1(&ps, hosts, hp, extra);
  ps_client *w0 = connect_worker(hp, 0, 2);
  ps_client *w1 = connect_worker(hp, 1, 2);
  ck_assert_int_eq(ps_client_finish(w1), 0);
  ps_client_destroy(w1);
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  int rc = tu_psd_wait(&ps, 15);
  clock_gettime(CLOCK_MONOTONIC, &b);
  double took = (double)(b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9;
  ps_client_destroy(w0);
  char *log = tu_read_file(ps.log_path);
  ck_assert_msg(rc == 0, "psd still runs 15 s after the others finished; log:\n%s", log);
  ck_assert_msg(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 68,
                "exit status %d (want 68); log:\n%s", WEXITSTATUS(ps.status), log);
  ck_assert_msg(took >= 1.8 && took < tu_time_limit(6), "exited %.1f s after the others finished", took);
  ck_assert_msg(strstr(log, "waiting for worker 0 (from 127.0.0.1:") &&
                    strstr(log, "under --finish-timeout 2 s, when psd exits 68 after"),
                "named first, with the bound:\n%s", log);
  ck_assert_msg(strstr(log, "worker 0 (from 127.0.0.1:") &&
                    strstr(log, "past --finish-timeout 2 s; exiting with status 68"),
                "exited saying why:\n%s", log);
  free(log);
}
END_TEST

/* Bug: "the telemetry table goes to stdout with the workers' output".
 * --summary - writes it to stderr (psd's log); stdout stays empty. psd's
 * stdout is sent apart through a wrapper named by $PSD_BIN. */
START_TEST(test_summary_dash_goes_to_stderr) {
  char out[600], wrap[600];
  snprintf(out, sizeof out, "%s/psd-stdout.txt", tu_tmpdir());
  snprintf(wrap, sizeof wrap, "%s/psd-stdout-apart.sh", tu_tmpdir());
  const char *real = getenv("PSD_BIN") ? getenv("PSD_BIN") : tu_bin("psd");
  FILE *f = fopen(wrap, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "#!/bin/sh\nexec '%s' \"$@\" >'%s'\n", real, out);
  fclose(f);
  ck_assert_int_eq(chmod(wrap, 0700), 0);
  char *saved = getenv("PSD_BIN") ? strdup(getenv("PSD_BIN")) : NULL;
  setenv("PSD_BIN", wrap, 1);
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  const char *extra[] = {"--summary", "-", NULL};
  start1(&ps, hosts, hp, extra);
  if (saved) setenv("PSD_BIN", saved, 1);
  else unsetenv("PSD_BIN");
  free(saved);
  ps_client *w0 = connect_worker(hp, 0, 1);
  ck_assert_int_eq(ps_client_finish(w0), 0);
  ps_client_destroy(w0);
  ck_assert_msg(tu_psd_wait(&ps, 5) == 0, "psd did not exit");
  ck_assert_msg(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 0, "status %d", ps.status);
  char *log = tu_read_file(ps.log_path), *stdout_text = tu_read_file(out);
  ck_assert_msg(stdout_text && stdout_text[0] == '\0', "psd wrote to stdout:\n%s",
                stdout_text ? stdout_text : "(no file)");
  ck_assert_msg(log && strstr(log, "== psd telemetry summary: ps0 of 1, 1 workers"),
                "no summary on stderr:\n%s", log ? log : "(no log)");
  free(log);
  free(stdout_text);
}
END_TEST

/* Nobody comes: psd gives up after --startup-timeout instead of burning
 * the job's walltime. */
START_TEST(test_startup_timeout) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  const char *extra[] = {"--startup-timeout", "0.5", NULL};
  start1(&ps, hosts, hp, extra);
  ck_assert_msg(tu_psd_wait(&ps, 5) == 0, "psd did not give up");
  ck_assert(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 67);
  ck_assert(tu_log_contains(&ps, "never connected"));
}
END_TEST

/* SIGTERM without --checkpoint-dir shuts psd down at once, and its status
 * says the job did not finish and nothing was saved (69, logged): 0 is
 * only for a job whose workers finished. */
START_TEST(test_sigterm) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start1(&ps, hosts, hp, NULL);
  kill(ps.pid, SIGTERM);
  ck_assert_msg(tu_psd_wait(&ps, 5) == 0, "psd ignored SIGTERM");
  ck_assert(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 69);
  ck_assert(tu_log_contains(&ps, "shutting down"));
  ck_assert(tu_log_contains(&ps, "there is no --checkpoint-dir, so nothing was saved"));
}
END_TEST

/* A client with nothing to connect to fails with the address it tried. */
START_TEST(test_connect_failure_names_host) {
  const char *hp[1] = {"127.0.0.1:1"};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.connect_timeout_ms = 300;
  ps_client *c = (ps_client *)1;
  char err[512];
  int rc = ps_client_create(&cfg, &c, err, sizeof err);
  ck_assert_int_eq(rc, PS_ECONNECT);
  ck_assert_ptr_null(c);
  ck_assert_msg(strstr(err, "127.0.0.1:1") != NULL, "message: %s", err);
}
END_TEST

/* With a shared secret, psd accepts only workers that present it; the
 * error names the problem, and a right one trains normally. */
START_TEST(test_shared_secret) {
  tu_psd_secret = "0123456789abcdef0123456789abcdef";
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start1(&ps, hosts, hp, NULL);
  tu_psd_secret = NULL;
  const char *creds[] = {NULL, "0123456789abcdef0123456789abcdeX", "0123456789abcdef",
                         "0123456789abcdef0123456789abcdef"};
  for (int k = 0; k < 4; k++) {
    ps_config cfg;
    ps_config_init(&cfg);
    cfg.hosts = hp;
    cfg.num_ps = 1;
    cfg.num_workers = 1;
    cfg.connect_timeout_ms = 2000;
    if (creds[k]) {
      cfg.credential = creds[k];
      cfg.credential_len = strlen(creds[k]);
    }
    ps_client *c = NULL;
    char err[256];
    int rc = ps_client_create(&cfg, &c, err, sizeof err);
    if (k < 3) {
      ck_assert_msg(rc == PS_EAUTH, "credential %d: %d (%s)", k, rc, err);
      ck_assert_msg(strstr(err, "authentication failed") != NULL, "%s", err);
      continue;
    }
    ck_assert_msg(rc == 0, "right secret refused: %s", err);
    ps_client_destroy(c);
  }
  ck_assert(tu_log_contains(&ps, "authentication failed: no credential"));
  ck_assert(tu_log_contains(&ps, "authentication failed: wrong credential"));
  ck_assert(!tu_log_contains(&ps, "no shared secret"));
  tu_psd_kill(&ps);
}
END_TEST

/* A secret file anyone else can read is refused, naming the file. */
START_TEST(test_secret_file_mode) {
  char path[600];
  snprintf(path, sizeof path, "%s/secret", tu_tmpdir());
  FILE *f = fopen(path, "w");
  fputs("0123456789abcdef0123456789abcdef\n", f);
  fclose(f);
  chmod(path, 0644);
  tu_psd ps;
  const char *args[] = {"--secret-file", path, NULL};
  ck_assert_int_ne(tu_psd_start(&ps, args), 0); /* exits before listening */
  ck_assert(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 64);
  ck_assert(tu_log_contains(&ps, "mode 0600"));
  chmod(path, 0600);
  ck_assert_int_eq(tu_psd_start(&ps, args), 0);
  tu_psd_kill(&ps);
}
END_TEST

Suite *suite_lifecycle(void) {
  Suite *s = suite_create("lifecycle");
  TCase *tc = tcase_create("lifecycle");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_exit_when_all_finish);
  tcase_add_test(tc, test_killed_worker);
  tcase_add_test(tc, test_lost_backup_worker);
  tcase_add_test(tc, test_stall_logged);
  tcase_add_test(tc, test_busy_chief_is_waited_for);
  tcase_add_test(tc, test_finish_timeout_exits_68);
  tcase_add_test(tc, test_summary_dash_goes_to_stderr);
  tcase_add_test(tc, test_startup_timeout);
  tcase_add_test(tc, test_sigterm);
  tcase_add_test(tc, test_connect_failure_names_host);
  tcase_add_test(tc, test_shared_secret);
  tcase_add_test(tc, test_secret_file_mode);
  suite_add_tcase(s, tc);
  return s;
}
