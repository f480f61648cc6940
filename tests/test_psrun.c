/* psrun, run for real: --local success, a failing task, signal forwarding,
 * validation errors, --print-plan over fake Slurm environments, and the
 * Slurm rendezvous under attack by another uid (nobody): forged check-ins,
 * silent connections, a planted rendezvous directory, a stolen port. */
#define _GNU_SOURCE
#include <check.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"
#include "step.h"

Suite *suite_psrun(void);

static char g_bin[1024]; /* directory of the built programs */

static const char *bin(const char *name) {
  static char path[4][1100];
  static int k;
  if (!g_bin[0]) {
    ssize_t n = readlink("/proc/self/exe", g_bin, sizeof g_bin - 1);
    if (n > 0) g_bin[n] = '\0';
    char *slash = strrchr(g_bin, '/');
    if (slash) *slash = '\0';
  }
  k = (k + 1) % 4;
  snprintf(path[k], sizeof path[k], "%s/%s", g_bin, name);
  return path[k];
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Runs argv with env entries added (NULL-terminated), output to a file.
 * Returns the pid; out gets the file's path. */
static pid_t spawn(char *const *argv, char *const *env, char *out, size_t outlen) {
  static int seq;
  snprintf(out, outlen, "%s/psrun.%d.%d.out", tu_tmpdir(), (int)getpid(), ++seq);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    for (int i = 0; env && env[i]; i++) putenv(env[i]);
    execv(argv[0], argv);
    _exit(127);
  }
  return pid;
}

static int wait_for(pid_t pid, double timeout_s, int *status) {
  double end = now_s() + timeout_s;
  while (now_s() < end) {
    if (waitpid(pid, status, WNOHANG) == pid) return 0;
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  kill(pid, SIGKILL);
  waitpid(pid, status, 0);
  return -1;
}

static int count(const char *s, const char *needle) {
  int n = 0;
  for (const char *p = s; (p = strstr(p, needle)); p++) n++;
  return n;
}

START_TEST(test_local_success) {
  char *argv[] = {(char *)bin("psrun"), "--local", "-n", "4", "--ps", "2", "--",
                  (char *)bin("tiny_worker"), "--steps", "60", NULL};
  char out[1200];
  int st;
  pid_t pid = spawn(argv, NULL, out, sizeof out);
  ck_assert_msg(wait_for(pid, 60, &st) == 0, "psrun --local did not finish");
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d; output:\n%s", st, log);
  /* Two workers trained, each printed its summary with a prefix; both ps
   * tasks ran and exited by themselves. */
  ck_assert_int_eq(count(log, "[w0] {\"worker\":0,\"steps\":60"), 1);
  ck_assert_int_eq(count(log, "[w1] {\"worker\":1,\"steps\":60"), 1);
  ck_assert_int_eq(count(log, "[ps0] "), count(log, "[ps0] "));
  ck_assert(strstr(log, "[ps1] ") != NULL);
  ck_assert(strstr(log, "all 2 workers finished") != NULL);
  const char *acc = strstr(log, "\"accuracy\":");
  ck_assert_ptr_nonnull(acc);
  ck_assert_msg(atof(acc + 11) > 0.9, "accuracy %s", acc + 11);
  free(log);
}
END_TEST

START_TEST(test_local_failing_task) {
  char *argv[] = {(char *)bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                  (char *)bin("tiny_worker"), "--steps", "1000", "--sleep-ms", "5",
                  "--fail-at-step", "5", NULL};
  char out[1200];
  int st;
  double t0 = now_s();
  pid_t pid = spawn(argv, NULL, out, sizeof out);
  ck_assert_msg(wait_for(pid, 30, &st) == 0, "psrun hung after a task failed");
  double took = now_s() - t0;
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "status %d; output:\n%s", st, log);
  ck_assert_msg(took < 10, "took %.1f s to stop after the failure", took);
  ck_assert_msg(strstr(log, "exited with status 1; stopping all tasks") != NULL, "%s", log);
  free(log);
  /* Nothing is left behind: no process of ours still runs the worker. */
  ck_assert_int_ne(system("pgrep -f 'tiny_worke[r] --steps 1000 --sleep-ms 5 --fail-at-step 5' "
                          ">/dev/null"), 0);
}
END_TEST

/* Bug: when a ps was killed, psrun could reap the worker its death made
 * fail first (the ps closes its sockets before it becomes a zombie), log
 * only "w1 exited with status 1" and tear the job down without naming the
 * ps, the root cause. Here the worker exits 1 and the ps is SIGKILLed 30 ms
 * later, the same race made wide: psrun must still name the ps. */
START_TEST(test_local_killed_ps_is_named) {
  for (int round = 0; round < 5; round++) {
    char *argv[] = {(char *)bin("psrun"), "--local", "-n", "2", "--ps", "1", "--", "/bin/sh",
                    "-c", "sleep 0.2; (sleep 0.03; pkill -KILL -P $PPID -x psd) & exit 1", NULL};
    char out[1200];
    int st;
    pid_t pid = spawn(argv, NULL, out, sizeof out);
    ck_assert_msg(wait_for(pid, 30, &st) == 0, "psrun hung after its ps was killed");
    char *log = tu_read_file(out);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "status %d; output:\n%s", st, log);
    ck_assert_msg(strstr(log, "ps0 was killed by SIGKILL") != NULL,
                  "round %d: the killed ps is not named:\n%s", round, log);
    free(log);
  }
}
END_TEST

START_TEST(test_local_signal_forwarded) {
  char *argv[] = {(char *)bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                  (char *)bin("tiny_worker"), "--steps", "100000", "--sleep-ms", "10", NULL};
  char out[1200];
  int st;
  pid_t pid = spawn(argv, NULL, out, sizeof out);
  struct timespec ts = {0, 700000000};
  nanosleep(&ts, NULL);
  kill(pid, SIGTERM);
  ck_assert_msg(wait_for(pid, 20, &st) == 0, "psrun ignored SIGTERM");
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGTERM, "status %d\n%s", st, log);
  ck_assert(strstr(log, "received SIGTERM") != NULL);
  ck_assert(strstr(log, "[ps0] ") != NULL && strstr(log, "shutting down") != NULL);
  free(log);
  ck_assert_int_ne(system("pgrep -f 'tiny_worke[r] --steps 100000 --sleep-ms 10' >/dev/null"), 0);
}
END_TEST

START_TEST(test_validation) {
  struct {
    const char *args[8];
    const char *msg;
  } cases[] = {
      {{"--local", "-n", "2", "--ps", "2", "--", "true"}, "must be less than the number of tasks"},
      {{"--local", "-n", "3", "--ps", "1", NULL}, "no worker command given"},
      {{"--ps", "0", "--", "true"}, "--ps must be an integer from 1"},
      {{"--local", "-n", "3", "--psd", "/nonexistent/psd", "--", "true"}, "psd not found"},
      {{"--bogus", "true"}, "unknown option '--bogus'"},
      {{"--ps-placement", "diagonal", "true"}, "pack|spread"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *argv[12] = {(char *)bin("psrun")};
    int a = 1;
    for (int k = 0; k < 8 && cases[i].args[k]; k++) argv[a++] = (char *)cases[i].args[k];
    argv[a] = NULL;
    char out[1200];
    int st;
    pid_t pid = spawn(argv, NULL, out, sizeof out);
    ck_assert(wait_for(pid, 10, &st) == 0);
    char *log = tu_read_file(out);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "case %zu: status %d", i, st);
    ck_assert_msg(strstr(log, cases[i].msg) != NULL, "case %zu: %s", i, log);
    ck_assert_msg(count(log, "\n") == 1, "case %zu: not one line: %s", i, log);
    free(log);
  }
}
END_TEST

/* Runs psrun --local -n 4 --ps 1 OPTS... -- sh -c SCRIPT, tiny_worker in
 * $TW, MARKER set to a fresh path; returns the log (status in *st). */
static char *run_workers(const char *const *opts, const char *script, int *st) {
  static char tw[1200], marker[1200];
  snprintf(tw, sizeof tw, "TW=%s", bin("tiny_worker"));
  snprintf(marker, sizeof marker, "MARKER=%s/marker.%d", tu_tmpdir(), (int)getpid());
  unlink(marker + 7);
  char *argv[24] = {(char *)bin("psrun"), "--local", "-n", "4", "--ps", "1"};
  int a = 6;
  for (int k = 0; opts[k] && a < 16; k++) argv[a++] = (char *)opts[k];
  char *tail[] = {"--", "/bin/sh", "-c", (char *)script, NULL};
  for (int k = 0; k < 5; k++) argv[a++] = tail[k];
  char *env[] = {tw, marker, NULL};
  char out[1200];
  pid_t pid = spawn(argv, env, out, sizeof out);
  ck_assert_msg(wait_for(pid, 100, st) == 0, "psrun did not finish");
  return tu_read_file(out);
}

/* Worker 1 trains 20 steps, then is killed by SIGABRT; the others train 200. */
#define ABORT_W1                                                                                \
  "ulimit -c 0; if [ \"$PS_WORKER_INDEX\" = 1 ]; then \"$TW\" --steps 200 --sleep-ms 5 "       \
  "--fail-at-step 20; kill -ABRT $$; fi; exec \"$TW\" --steps 200 --sleep-ms 5"

/* Bug: psrun stopped the whole job when one worker died, although psd
 * averages fewer gradients than there are workers and trains on. */
START_TEST(test_local_backup_worker_lost) {
  const char *opts[] = {"--backup-workers", "1", NULL};
  int st;
  char *log = run_workers(opts, ABORT_W1, &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "psd averages 2 of 3 workers' gradients per step") &&
                    strstr(log, "psrun: w1 was killed by SIGABRT; going on without it (1 of 1 "
                                "backup worker(s) lost, 0 more may be lost)") &&
                    strstr(log, "[w0] {\"worker\":0,\"steps\":200") &&
                    strstr(log, "[w2] {\"worker\":2,\"steps\":200"),
                "%s", log);
  free(log);
  /* No backups: the same loss stops the job, as before. */
  const char *none[] = {"--backup-workers", "0", NULL};
  log = run_workers(none, ABORT_W1, &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGABRT, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "psrun: w1 was killed by SIGABRT; stopping all tasks"), "%s", log);
  free(log);
}
END_TEST

/* The README's own way, PS_REPLICAS_TO_AGGREGATE=2 for 3 workers, makes
 * psrun tolerate the loss too (psd already did). */
START_TEST(test_local_replicas_env_tolerates_loss) {
  const char *opts[] = {NULL};
  int st;
  setenv("PS_REPLICAS_TO_AGGREGATE", "2", 1);
  char *log = run_workers(opts, ABORT_W1, &st);
  unsetenv("PS_REPLICAS_TO_AGGREGATE");
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "w1 was killed by SIGABRT; going on without it"), "%s", log);
  free(log);
}
END_TEST

/* Worker 1 fails at step 20 the first time only (MARKER); every worker
 * trains to step 200 of the job. */
#define FAIL_W1_ONCE                                                                            \
  "if [ \"$PS_WORKER_INDEX\" = 1 ] && ! [ -e \"$MARKER\" ]; then touch \"$MARKER\"; "          \
  "exec \"$TW\" --steps 200 --sleep-ms 5 --fail-at-step 20; fi; "                              \
  "exec \"$TW\" --steps 200 --sleep-ms 5"

START_TEST(test_local_restart_worker) {
  const char *opts[] = {"--restart-workers", "1", NULL};
  int st;
  char *log = run_workers(opts, FAIL_W1_ONCE, &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "psrun: w1 exited with status 1; restarted it (0 restart(s) left)") &&
                    strstr(log, "worker 1 rejoined") &&
                    strstr(log, "[w1] {\"worker\":1,\"steps\":200") &&
                    strstr(log, "all 3 workers finished"),
                "%s", log);
  free(log);
  /* Restarts used up: the second death stops the job. */
  const char *once[] = {"--restart-workers", "1", NULL};
  log = run_workers(once, "exec \"$TW\" --steps 200 --sleep-ms 5 --fail-at-step 20", &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d\n%s", st, log);
  ck_assert_msg(count(log, "restarted it (0 restart(s) left)") == 1 &&
                    strstr(log, "exited with status 1; stopping all tasks"),
                "%s", log);
  free(log);
}
END_TEST

/* Bug: psrun ended with "ps0 exited with status 68; stopping all tasks",
 * no word of what 68 means. Worker 1 stops (SIGSTOP) mid-run: connected,
 * silent; the others finish (one backup), psd exits 68. */
START_TEST(test_local_status_68_explained) {
  const char *opts[] = {"--psd-arg=--stall-timeout=1", "--psd-arg=--grace-period=1", NULL};
  int st;
  setenv("PS_REPLICAS_TO_AGGREGATE", "2", 1); /* one backup: the others finish */
  char *log = run_workers(opts,
                          "if [ \"$PS_WORKER_INDEX\" = 1 ]; then (sleep 0.5; kill -STOP $$) & fi; "
                          "exec \"$TW\" --steps 300 --sleep-ms 5",
                          &st);
  unsetenv("PS_REPLICAS_TO_AGGREGATE");
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 68, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "ps0 exited with status 68 (a worker stayed connected but silent "
                            "after the others finished: it never called ps_client_finish"),
                "%s", log);
  free(log);
}
END_TEST

/* Bug: "parameter servers did not exit within 30 s after the workers
 * finished" gave no hint. Workers 1 and 2 exit 0 without ps_client_finish
 * (2 losses, 1 backup): psd waits its 60 s grace period, psrun gives up
 * after 30 s and names them. */
START_TEST(test_local_psd_wait_names_workers) {
  const char *opts[] = {NULL};
  int st;
  setenv("PS_REPLICAS_TO_AGGREGATE", "2", 1);
  char *log = run_workers(opts,
                          "case $PS_WORKER_INDEX in 1) \"$TW\" --steps 200 --sleep-ms 5 "
                          "--fail-at-step 20; exit 0;; 2) exec \"$TW\" --steps 200 --sleep-ms 5 "
                          "--skip-finish 1;; esac; exec \"$TW\" --steps 200",
                          &st);
  unsetenv("PS_REPLICAS_TO_AGGREGATE");
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "did not exit within 30 s after the workers finished: psd never saw "
                            "w1,w2 call ps_client_finish"),
                "%s", log);
  free(log);
}
END_TEST

/* --print-plan under a fake Slurm environment: the role table. */
static char *plan(char *const *env, const char *placement, int *status) {
  char *argv[] = {(char *)bin("psrun"), "--print-plan", "--ps", "2", "--ps-placement",
                  (char *)placement, "--", "true", NULL};
  char out[1200];
  pid_t pid = spawn(argv, env, out, sizeof out);
  ck_assert(wait_for(pid, 10, status) == 0);
  return tu_read_file(out);
}

START_TEST(test_print_plan_uneven_block) {
  char *env[] = {"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_JOB_ID=77", "SLURM_STEP_ID=0",
                 "SLURMD_NODENAME=n1", "SLURM_STEP_NODELIST=n[1-4]", "SLURM_STEP_NUM_NODES=4",
                 "SLURM_STEP_TASKS_PER_NODE=4,2,1(x2)", "SLURM_DISTRIBUTION=block", NULL};
  int st;
  char *out = plan(env, "pack", &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s", out);
  ck_assert_int_eq(count(out, "{\"rank\":"), 8);
  ck_assert(strstr(out, "{\"rank\":0,\"role\":\"ps\",\"index\":0,\"node\":\"n1\",\"local_rank\":0}"));
  ck_assert(strstr(out, "{\"rank\":1,\"role\":\"ps\",\"index\":1,\"node\":\"n1\",\"local_rank\":1}"));
  ck_assert(strstr(out, "{\"rank\":2,\"role\":\"worker\",\"index\":0,\"node\":\"n1\",\"local_rank\":2}"));
  ck_assert(strstr(out, "{\"rank\":5,\"role\":\"worker\",\"index\":3,\"node\":\"n2\",\"local_rank\":1}"));
  ck_assert(strstr(out, "{\"rank\":7,\"role\":\"worker\",\"index\":5,\"node\":\"n4\",\"local_rank\":0}"));
  free(out);
  out = plan(env, "spread", &st);
  ck_assert(strstr(out, "{\"rank\":0,\"role\":\"ps\",\"index\":0,\"node\":\"n1\",\"local_rank\":0}"));
  ck_assert(strstr(out, "{\"rank\":4,\"role\":\"ps\",\"index\":1,\"node\":\"n2\",\"local_rank\":0}"));
  ck_assert(strstr(out, "{\"rank\":1,\"role\":\"worker\",\"index\":0,\"node\":\"n1\",\"local_rank\":1}"));
  free(out);
}
END_TEST

START_TEST(test_print_plan_cyclic) {
  char *env[] = {"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_JOB_ID=77", "SLURM_STEP_ID=0",
                 "SLURMD_NODENAME=node01", "SLURM_STEP_NODELIST=node[01-03,7]",
                 "SLURM_STEP_NUM_NODES=4", "SLURM_STEP_TASKS_PER_NODE=2(x4)",
                 "SLURM_DISTRIBUTION=cyclic", NULL};
  int st;
  char *out = plan(env, "pack", &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s", out);
  ck_assert(strstr(out, "{\"rank\":1,\"role\":\"ps\",\"index\":1,\"node\":\"node02\",\"local_rank\":0}"));
  ck_assert(strstr(out, "{\"rank\":3,\"role\":\"worker\",\"index\":1,\"node\":\"node7\",\"local_rank\":0}"));
  ck_assert(strstr(out, "{\"rank\":4,\"role\":\"worker\",\"index\":2,\"node\":\"node01\",\"local_rank\":1}"));
  free(out);
}
END_TEST

START_TEST(test_print_plan_bad_env) {
  char *env[] = {"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_JOB_ID=77", "SLURMD_NODENAME=n1",
                 "SLURM_STEP_NODELIST=bad[1-", "SLURM_STEP_NUM_NODES=2",
                 "SLURM_STEP_TASKS_PER_NODE=4(x2)", NULL};
  int st;
  char *out = plan(env, "pack", &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "%s", out);
  ck_assert_msg(strstr(out, "SLURM_STEP_NODELIST='bad[1-'") != NULL, "%s", out);
  free(out);
}
END_TEST

/* --local --print-plan prints the roles as under Slurm and starts nothing:
 * the worker command would leave a file, and psd would log. */
START_TEST(test_print_plan_local) {
  char marker[1100];
  snprintf(marker, sizeof marker, "%s/plan-ran.%d", tu_tmpdir(), (int)getpid());
  unlink(marker);
  char *argv[] = {(char *)bin("psrun"), "--local", "-n", "4", "--ps", "2", "--print-plan", "--",
                  "/bin/sh", "-c", "touch \"$0\"", marker, NULL};
  char out[1200];
  int st;
  pid_t pid = spawn(argv, NULL, out, sizeof out);
  ck_assert_msg(wait_for(pid, 20, &st) == 0, "psrun --local --print-plan did not finish");
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d: %s", st, log);
  ck_assert_msg(count(log, "{\"rank\":") == 4 && count(log, "\n") == 4, "%s", log);
  ck_assert(strstr(log, "{\"rank\":0,\"role\":\"ps\",\"index\":0,\"node\":\"localhost\",\"local_rank\":0}"));
  ck_assert(strstr(log, "{\"rank\":1,\"role\":\"ps\",\"index\":1,\"node\":\"localhost\",\"local_rank\":1}"));
  ck_assert(strstr(log, "{\"rank\":3,\"role\":\"worker\",\"index\":1,\"node\":\"localhost\",\"local_rank\":3}"));
  ck_assert_msg(access(marker, F_OK) != 0, "the worker command ran: %s", log);
  free(log);
}
END_TEST

/* ---- psctl for a psrun --local job --------------------------------------------- */

/* Starts a long psrun --local job; fills line with its "psctl stats ADDR
 * --secret-file FILE" (from stderr), addr and file. Returns psrun's pid. */
static pid_t local_job_for_psctl(char *out, size_t outlen, char *line, size_t linelen,
                                 char *addr, char *file) {
  char *argv[] = {(char *)bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                  (char *)bin("tiny_worker"), "--steps", "4000", "--sleep-ms", "5", NULL};
  pid_t pid = spawn(argv, NULL, out, outlen);
  for (int i = 0; i < 2000; i++) {
    char *log = tu_read_file(out);
    const char *p = log ? strstr(log, "psctl stats ") : NULL;
    if (p && strchr(p, '\n')) {
      snprintf(line, linelen, "%.*s", (int)(strchr(p, '\n') - p), p);
      free(log);
      ck_assert_msg(sscanf(line, "psctl stats %255s --secret-file %1023s", addr, file) == 2,
                    "%s", line);
      return pid;
    }
    free(log);
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  ck_abort_msg("psrun --local printed no psctl line");
  return -1;
}

/* Runs psctl with args (a shell word list) and returns its exit status;
 * output to out. */
static int run_psctl(const char *args, char *out, size_t outlen) {
  static int seq;
  snprintf(out, outlen, "%s/psctl.%d.%d.out", tu_tmpdir(), (int)getpid(), ++seq);
  char cmd[8000];
  snprintf(cmd, sizeof cmd, "'%s' %s >'%s' 2>&1", bin("psctl"), args, out);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* The line psrun --local prints reaches the job; the credential is 0600 in
 * a 0700 directory, a copy others can read is refused, and the file is
 * gone when the job ends. */
START_TEST(test_local_psctl_line) {
  char out[1200], line[2400], addr[256], file[1024], po[1200];
  pid_t pid = local_job_for_psctl(out, sizeof out, line, sizeof line, addr, file);
  struct stat st, dst;
  ck_assert(lstat(file, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 0777) == 0600);
  char dir[1024];
  snprintf(dir, sizeof dir, "%s", file);
  *strrchr(dir, '/') = '\0';
  ck_assert(lstat(dir, &dst) == 0 && S_ISDIR(dst.st_mode) && (dst.st_mode & 0777) == 0700 &&
            dst.st_uid == getuid());
  /* The workers may not have joined yet (sanitized builds start slowly). */
  int rc = 0;
  char *text = NULL;
  for (int i = 0; i < 100; i++) {
    free(text);
    rc = run_psctl(line + strlen("psctl "), po, sizeof po);
    text = tu_read_file(po);
    if (rc != 0 || strstr(text, "2 workers")) break;
    struct timespec ts = {0, 200000000};
    nanosleep(&ts, NULL);
  }
  ck_assert_msg(rc == 0 && strstr(text, "ps0 at ") && strstr(text, "2 workers"), "rc %d: %s",
                rc, text);
  free(text);
  char copy[1200], args[5000];
  snprintf(copy, sizeof copy, "%s/readable.secret", tu_tmpdir());
  snprintf(args, sizeof args, "cp '%s' '%s' && chmod 644 '%s'", file, copy, copy);
  ck_assert_int_eq(system(args), 0);
  snprintf(args, sizeof args, "stats %s --secret-file '%s'", addr, copy);
  rc = run_psctl(args, po, sizeof po);
  text = tu_read_file(po);
  ck_assert_msg(rc != 0 && strstr(text, "not a private file of yours"), "rc %d: %s", rc, text);
  free(text);
  snprintf(args, sizeof args, "stats %s --job 12 --secret-file '%s'", addr, file);
  rc = run_psctl(args, po, sizeof po);
  text = tu_read_file(po);
  ck_assert_msg(rc == 2 && strstr(text, "expected JOB.STEP"), "rc %d: %s", rc, text);
  free(text);
  kill(pid, SIGTERM);
  int status;
  ck_assert(wait_for(pid, 30, &status) == 0);
  ck_assert_msg(access(file, F_OK) != 0, "%s is left after the job", file);
}
END_TEST

/* ---- the Slurm rendezvous under attack ------------------------------------------ */

#define NOBODY 65534 /* the attacker's uid and gid */

/* A port nothing listens on now. */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t sl = sizeof sa;
  ck_assert(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
  getsockname(fd, (struct sockaddr *)&sa, &sl);
  close(fd);
  return ntohs(sa.sin_port);
}

/* A fake Slurm environment for task `rank` of a 2-task step of job `job`
 * on localhost; a slurm.conf naming a slurmctld that is not there (so
 * libslurm fails at once instead of retrying). */
typedef struct fake_env {
  char v[12][1200]; /* the entries */
  char *env[13];   /* NULL-terminated, for spawn */
} fake_env;

static void fake_slurm(fake_env *f, int rank, int job, int ntasks) {
  static char conf[1100];
  snprintf(conf, sizeof conf, "%s/slurm.conf", tu_tmpdir());
  FILE *c = fopen(conf, "w");
  fprintf(c, "ClusterName=psrtest\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\n"
             "NodeName=localhost\nPartitionName=p Nodes=localhost\nMessageTimeout=1\n");
  fclose(c);
  const char *fmt[] = {"SLURM_CONF=%s", "SLURM_PROCID=%d", "SLURM_LOCALID=%d", "SLURM_JOB_ID=%d",
                       "SLURM_NTASKS=%d", "SLURM_STEP_ID=0", "SLURMD_NODENAME=localhost",
                       "SLURM_STEP_NODELIST=localhost", "SLURM_STEP_NUM_NODES=1",
                       "SLURM_STEP_TASKS_PER_NODE=%d", "SLURM_DISTRIBUTION=block"};
  snprintf(f->v[0], sizeof f->v[0], fmt[0], conf);
  snprintf(f->v[1], sizeof f->v[1], fmt[1], rank);
  snprintf(f->v[2], sizeof f->v[2], fmt[2], rank);
  snprintf(f->v[3], sizeof f->v[3], fmt[3], job);
  for (int i = 4; i < 11; i++) snprintf(f->v[i], sizeof f->v[i], fmt[i], ntasks);
  for (int i = 0; i < 11; i++) f->env[i] = f->v[i];
  f->env[11] = NULL;
}

/* psrun as task `rank` of the fake step of ntasks, meeting on port in dir. */
static pid_t slurm_task_of(fake_env *f, int rank, int ntasks, int job, int port, const char *dir,
                           char *out, size_t outlen) {
  static char portbuf[16];
  snprintf(portbuf, sizeof portbuf, "%d", port);
  fake_slurm(f, rank, job, ntasks);
  char *argv[] = {(char *)bin("psrun"), "--ps", "1", "--rendezvous-port", portbuf,
                  "--rendezvous-auth", "key", "--rendezvous", (char *)dir, "--connect-timeout",
                  "15", "--", (char *)bin("tiny_worker"), "--steps", "20", NULL};
  return spawn(argv, f->env, out, outlen);
}

static pid_t slurm_task(fake_env *f, int rank, int job, int port, const char *dir, char *out,
                        size_t outlen) {
  return slurm_task_of(f, rank, 2, job, port, dir, out, outlen);
}

/* Waits until file holds needle (up to timeout_s). */
static int wait_text(const char *file, const char *needle, double timeout_s) {
  for (double end = now_s() + timeout_s; now_s() < end;) {
    char *t = tu_read_file(file);
    int hit = t && strstr(t, needle);
    free(t);
    if (hit) return 0;
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
  }
  return -1;
}

/* bash as nobody (setpriv), its output to a file. */
static pid_t as_nobody(const char *script, char *out, size_t outlen) {
  char *argv[] = {"/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                  "/bin/bash", "-c", (char *)script, NULL};
  return spawn(argv, NULL, out, outlen);
}

static void need_root(void) {
  if (getuid() != 0 || access("/usr/bin/setpriv", X_OK) != 0) {
    printf("SKIP: acting as another user needs root and setpriv\n");
    exit(77);
  }
}

/* A nobody process opens two silent connections and forges a check-in
 * claiming rank 1 before the real rank 1 arrives: the forgery is refused,
 * the silent connections cost nothing, the real step completes. */
START_TEST(test_slurm_forged_and_silent_checkins) {
  need_root();
  char dir[1100], o0[1200], o1[1200], oa[1200], script[1200];
  snprintf(dir, sizeof dir, "%s/rdv-forge", tu_tmpdir());
  mkdir(dir, 0700);
  int port = free_port(), job = 5000 + (int)(getpid() % 1000);
  fake_env f0, f1;
  pid_t t0 = slurm_task(&f0, 0, job, port, dir, o0, sizeof o0);
  snprintf(script, sizeof script,
           "for i in $(seq 100); do exec 3<>/dev/tcp/127.0.0.1/%d && break; sleep 0.1; done; "
           "exec 4<>/dev/tcp/127.0.0.1/%d 5<>/dev/tcp/127.0.0.1/%d; read -t 5 l <&5; "
           "echo \"greeting: $l\"; echo \"HELLO PSRUN2 %d 0 65534 2 1 localhost 1 %064d %064d\" >&5;"
           " read -t 5 l <&5; echo \"reply: $l\"; sleep 14",
           port, port, port, job, 7, 9);
  pid_t att = as_nobody(script, oa, sizeof oa);
  ck_assert_msg(wait_text(oa, "reply:", 15) == 0, "the forger got no answer");
  char *a = tu_read_file(oa);
  ck_assert_msg(strstr(a, "greeting: RDV PSRUN2 key") && strstr(a, "reply: REJECT"), "%s", a);
  ck_assert_msg(!strstr(a, "ROLE"), "the forger got a role: %s", a);
  free(a);
  double start = now_s();
  pid_t t1 = slurm_task(&f1, 1, job, port, dir, o1, sizeof o1);
  int s0, s1;
  int w1 = wait_for(t1, 30, &s1), w0 = wait_for(t0, 30, &s0);
  double took = now_s() - start;
  kill(att, SIGKILL);
  waitpid(att, NULL, 0);
  char *l0 = tu_read_file(o0), *l1 = tu_read_file(o1);
  ck_assert_msg(w0 == 0 && w1 == 0, "the step did not finish:\n%s\n%s", l0, l1);
  ck_assert_msg(WIFEXITED(s0) && WEXITSTATUS(s0) == 0, "task 0: %s", l0);
  ck_assert_msg(WIFEXITED(s1) && WEXITSTATUS(s1) == 0, "task 1: %s", l1);
  ck_assert_msg(strstr(l0, "refused a check-in from 127.0.0.1:") &&
                    strstr(l0, "claimed rank 1 (uid 65534), but its proof does not match"),
                "%s", l0);
  ck_assert_msg(strstr(l1, "{\"worker\":0,\"steps\":20") != NULL, "%s", l1);
  /* Two silent connections, each allowed 10 s, delayed nothing. */
  ck_assert_msg(took < 8, "the step took %.1f s after rank 1 started", took);
  free(l0);
  free(l1);
}
END_TEST

/* A rendezvous directory planted by nobody is refused, by task 0 and by
 * a --role=worker step, with a sentence naming its owner. */
START_TEST(test_slurm_planted_directory) {
  need_root();
  char dir[1100], planted[1200], out[1200];
  snprintf(dir, sizeof dir, "%s/rdv-planted", tu_tmpdir());
  mkdir(dir, 01777);
  chmod(dir, 01777); /* like /tmp: others may create, the sticky bit protects ours */
  int job = 6000 + (int)(getpid() % 1000);
  snprintf(planted, sizeof planted, "%s/.psrun-%d.0", dir, job);
  ck_assert(mkdir(planted, 0755) == 0 && chown(planted, NOBODY, NOBODY) == 0);
  fake_env f;
  pid_t t0 = slurm_task(&f, 0, job, free_port(), dir, out, sizeof out);
  int st;
  ck_assert(wait_for(t0, 20, &st) == 0);
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "%s", log);
  ck_assert_msg(strstr(log, "belongs to nobody (uid 65534), not to you"), "%s", log);
  free(log);
  char *argv[] = {(char *)bin("psrun"), "--role=worker", "--rendezvous-auth", "key",
                  "--rendezvous", dir, "--connect-timeout", "3", "--", "true", NULL};
  pid_t w = spawn(argv, f.env, out, sizeof out);
  ck_assert(wait_for(w, 20, &st) == 0);
  log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "%s", log);
  ck_assert_msg(strstr(log, "belongs to nobody (uid 65534), not to you"), "%s", log);
  free(log);
}
END_TEST

/* A stranger (nobody) holding the rendezvous port and answering like task
 * 0: task 0 says so and stops; the member refuses the stranger. */
START_TEST(test_slurm_stolen_port) {
  need_root();
  char dir[1100], o0[1200], o1[1200], oa[1200], script[600];
  snprintf(dir, sizeof dir, "%s/rdv-stolen", tu_tmpdir());
  mkdir(dir, 0700);
  int port = free_port(), job = 7000 + (int)(getpid() % 1000);
  /* socat-free listener: python is not assumed; bash cannot listen, so
   * the stranger is a tiny nc-like loop in python only if present. */
  if (access("/usr/bin/python3", X_OK) != 0) {
    printf("SKIP: the stolen-port test needs python3 for the stranger's listener\n");
    exit(77);
  }
  snprintf(script, sizeof script,
           "exec /usr/bin/python3 -c \"import socket,time\ns=socket.socket()\n"
           "s.bind(('127.0.0.1',%d)); s.listen(8); print('listening', flush=True)\n"
           "c,_=s.accept(); c.sendall(b'RDV PSRUN2 key\\n'); print(c.recv(4096), flush=True)\n"
           "c.sendall(b'ROLE worker 0 1 1 ' + b'ab'*32 + b'\\n'); time.sleep(20)\"",
           port);
  pid_t att = as_nobody(script, oa, sizeof oa);
  ck_assert_msg(wait_text(oa, "listening", 10) == 0, "the stranger did not listen");
  fake_env f0, f1;
  pid_t t0 = slurm_task(&f0, 0, job, port, dir, o0, sizeof o0);
  pid_t t1 = slurm_task(&f1, 1, job, port, dir, o1, sizeof o1);
  int s0, s1;
  ck_assert(wait_for(t0, 30, &s0) == 0 && wait_for(t1, 30, &s1) == 0);
  kill(att, SIGKILL);
  waitpid(att, NULL, 0);
  char *l0 = tu_read_file(o0), *l1 = tu_read_file(o1);
  ck_assert_msg(WIFEXITED(s0) && WEXITSTATUS(s0) == 1, "task 0: %s", l0);
  ck_assert_msg(strstr(l0, "Address already in use") && strstr(l0, "another process holds it"),
                "%s", l0);
  ck_assert_msg(WIFEXITED(s1) && WEXITSTATUS(s1) == 1, "task 1: %s", l1);
  ck_assert_msg(strstr(l1, "did not prove itself, so this task does not trust it"), "%s", l1);
  ck_assert_msg(!strstr(l1, "[w0]"), "a worker started: %s", l1);
  free(l0);
  free(l1);
}
END_TEST

/* Two tasks with valid proofs both claim rank 1 (a replay or a second
 * copy): task 0 stops the step, naming both peers. */
/* Another user can neither read the credential nor make psctl use one of
 * theirs (it would have psctl trust their psd). */
START_TEST(test_psctl_credential_others) {
  need_root();
  char out[1200], line[2400], addr[256], file[1024], po[1200], args[5000], planted[1200];
  pid_t pid = local_job_for_psctl(out, sizeof out, line, sizeof line, addr, file);
  snprintf(args, sizeof args, "cat '%s'", file);
  char *argv[] = {"/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                  "/bin/bash", "-c", args, NULL};
  int st;
  pid_t cat = spawn(argv, NULL, po, sizeof po);
  ck_assert(wait_for(cat, 10, &st) == 0);
  char *text = tu_read_file(po);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0 && strstr(text, "Permission denied"),
                "nobody read the credential: %s", text);
  free(text);
  snprintf(planted, sizeof planted, "%s/planted.secret", tu_tmpdir());
  snprintf(args, sizeof args, "cp '%s' '%s' && chown %d:%d '%s' && chmod 600 '%s'", file,
           planted, NOBODY, NOBODY, planted, planted);
  ck_assert_int_eq(system(args), 0);
  snprintf(args, sizeof args, "stats %s --secret-file '%s'", addr, planted);
  int rc = run_psctl(args, po, sizeof po);
  text = tu_read_file(po);
  ck_assert_msg(rc != 0 && strstr(text, "not a private file of yours") &&
                    strstr(text, "uid 65534"), "rc %d: %s", rc, text);
  free(text);
  kill(pid, SIGTERM);
  ck_assert(wait_for(pid, 30, &st) == 0);
}
END_TEST

/* A psrun-UID directory planted by another user is not used: psrun says
 * so, prints no psctl line and runs the job anyway (it costs psctl only). */
START_TEST(test_psctl_planted_directory) {
  need_root();
  char base[1100], planted[1200], env0[1200], out[1200];
  snprintf(base, sizeof base, "%s/xdg-planted", tu_tmpdir());
  mkdir(base, 01777);
  chmod(base, 01777);
  snprintf(planted, sizeof planted, "%s/psrun-%u", base, (unsigned)getuid());
  ck_assert(mkdir(planted, 0777) == 0 && chown(planted, NOBODY, NOBODY) == 0);
  chmod(planted, 0777);
  snprintf(env0, sizeof env0, "XDG_RUNTIME_DIR=%s", base);
  char *env[] = {env0, NULL};
  char *argv[] = {(char *)bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                  (char *)bin("tiny_worker"), "--steps", "20", NULL};
  int st;
  pid_t pid = spawn(argv, env, out, sizeof out);
  ck_assert(wait_for(pid, 60, &st) == 0);
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d: %s", st, log);
  ck_assert_msg(strstr(log, "no credential for psctl") && strstr(log, "belongs to nobody") &&
                    !strstr(log, "psctl stats"), "%s", log);
  free(log);
  char any[1300];
  snprintf(any, sizeof any, "ls -A '%s' | grep -q .", planted);
  ck_assert_msg(system(any) != 0, "psrun wrote into the planted directory");
}
END_TEST

/* The fake Slurm step of 4 tasks (ps0, w0-w2) running script with OPT K;
 * returns task 0's log and w1's, every task's status in st. */
static char *slurm_step_of(const char *opt, const char *k, const char *script, int st[4]) {
  static int seq;
  char dir[1100], out[4][1200], portbuf[16];
  snprintf(dir, sizeof dir, "%s/rdv-backup-%d", tu_tmpdir(), ++seq);
  mkdir(dir, 0700);
  snprintf(portbuf, sizeof portbuf, "%d", free_port());
  int job = 9000 + (int)(getpid() % 500) + seq;
  fake_env f[4];
  pid_t pid[4];
  for (int r = 0; r < 4; r++) {
    fake_slurm(&f[r], r, job, 4);
    snprintf(f[r].v[11], sizeof f[r].v[11], "TW=%s", bin("tiny_worker"));
    f[r].env[11] = f[r].v[11];
    f[r].env[12] = NULL;
    char *argv[] = {(char *)bin("psrun"), "--ps", "1", "--rendezvous-port", portbuf,
                    "--rendezvous-auth", "key", "--rendezvous", dir, "--connect-timeout", "15",
                    (char *)opt, (char *)k, "--", "/bin/sh", "-c", (char *)script, NULL};
    pid[r] = spawn(argv, f[r].env, out[r], sizeof out[r]);
  }
  for (int r = 0; r < 4; r++) ck_assert_msg(wait_for(pid[r], 60, &st[r]) == 0, "task %d hung", r);
  char *log = tu_read_file(out[0]);
  char *w1 = tu_read_file(out[2]);
  size_t n = strlen(log) + strlen(w1) + 16;
  char *both = malloc(n);
  snprintf(both, n, "%s\n--- w1:\n%s", log, w1);
  free(log);
  free(w1);
  return both;
}

/* Under Slurm too: task 0 spares a lost worker while the backups allow,
 * and the lost worker's task exits 0 so that srun's status is the job's. */
START_TEST(test_slurm_backup_worker_lost) {
  int st[4];
  char *log = slurm_step_of("--backup-workers", "1", ABORT_W1, st);
  for (int r = 0; r < 4; r++)
    ck_assert_msg(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "task %d: status %d\n%s", r,
                  st[r], log);
  ck_assert_msg(strstr(log, "task 2 (w1) on localhost exited with status 134; going on without "
                            "it (1 of 1 backup worker(s) lost, 0 more may be lost)") &&
                    strstr(log, "the job goes on without this worker"),
                "%s", log);
  free(log);
  log = slurm_step_of("--backup-workers", "0", ABORT_W1, st);
  ck_assert_msg(WIFEXITED(st[0]) && WEXITSTATUS(st[0]) == 134, "status %d\n%s", st[0], log);
  ck_assert_msg(strstr(log, "task 2 (w1) on localhost exited with status 134; stopping every task"),
                "%s", log);
  free(log);
}
END_TEST

/* Under Slurm, --restart-workers restarts the dead worker in its own task
 * (counted per task there). */
START_TEST(test_slurm_restart_worker) {
  char script[1500];
  snprintf(script, sizeof script, "MARKER=%s/slurm-marker.%d; " FAIL_W1_ONCE, tu_tmpdir(),
           (int)getpid());
  int st[4];
  char *log = slurm_step_of("--restart-workers", "1", script, st);
  for (int r = 0; r < 4; r++)
    ck_assert_msg(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "task %d: status %d\n%s", r,
                  st[r], log);
  ck_assert_msg(strstr(log, "w1 exited with status 1; restarted it (0 restart(s) left)") &&
                    strstr(log, "worker 1 rejoined") && strstr(log, "{\"worker\":1,\"steps\":200"),
                "%s", log);
  free(log);
}
END_TEST

START_TEST(test_slurm_rank_claimed_twice) {
  need_root();
  char dir[1100], o0[1200], o1[1200], o2[1200];
  snprintf(dir, sizeof dir, "%s/rdv-twice", tu_tmpdir());
  mkdir(dir, 0700);
  int port = free_port(), job = 8000 + (int)(getpid() % 1000);
  fake_env f0, f1, f2;
  pid_t t0 = slurm_task_of(&f0, 0, 3, job, port, dir, o0, sizeof o0);
  pid_t a = slurm_task_of(&f1, 1, 3, job, port, dir, o1, sizeof o1);
  pid_t b = slurm_task_of(&f2, 1, 3, job, port, dir, o2, sizeof o2);
  int s0, sa, sb;
  ck_assert(wait_for(t0, 30, &s0) == 0);
  wait_for(a, 30, &sa);
  wait_for(b, 30, &sb);
  char *l0 = tu_read_file(o0);
  ck_assert_msg(WIFEXITED(s0) && WEXITSTATUS(s0) == 1, "%s", l0);
  ck_assert_msg(strstr(l0, "rank 1 was claimed twice, by 127.0.0.1:") &&
                    strstr(l0, ") and by 127.0.0.1:"),
                "%s", l0);
  free(l0);
}
END_TEST

/* The rendezvous' authentication is decided from slurm.conf: when
 * slurmctld cannot be asked (here none runs), "auto" stops the step with a
 * sentence naming the choices; it never falls back to another mode on its
 * own (a task that did would disagree with the others). */
START_TEST(test_slurm_auth_never_downgrades) {
  fake_env f;
  fake_slurm(&f, 0, 5151, 2);
  char out[1200];
  char *argv[] = {(char *)bin("psrun"), "--ps", "1", "--rendezvous", (char *)tu_tmpdir(),
                  "--", (char *)bin("tiny_worker"), "--steps", "2", NULL};
  pid_t pid = spawn(argv, f.env, out, sizeof out);
  int st;
  ck_assert_msg(wait_for(pid, 60, &st) == 0, "psrun did not stop");
  char *text = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "psrun went on: %s", text);
  ck_assert_msg(text && strstr(text, "cannot tell whether this cluster uses MUNGE") &&
                    strstr(text, "--rendezvous-auth"),
                "no sentence naming the choice: %s", text);
  ck_assert_msg(!strstr(text, "parameter servers:"), "the step started anyway: %s", text);
  free(text);
}
END_TEST

/* The derived rendezvous port stays below Linux's default ephemeral range
 * (32768-60999) for any job and step, so an outgoing connection's port
 * never takes it first. */
START_TEST(test_derived_port_below_ephemeral) {
  unsigned seed = tu_seed("derived ports");
  srand(seed);
  psr_env e;
  memset(&e, 0, sizeof e);
  for (int i = 0; i < 100000; i++) {
    e.job_id = i < 1000 ? i : (long long)rand() * rand();
    e.step_id = i % 7 == 0 ? -1 : rand() % 100;
    int p = psr_derived_port(&e);
    ck_assert_msg(p >= 12000 && p < 32768, "job %lld step %lld: port %d", (long long)e.job_id,
                  (long long)e.step_id, p);
  }
}
END_TEST

Suite *suite_psrun(void) {
  Suite *s = suite_create("psrun");
  TCase *tc = tcase_create("psrun");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_local_success);
  tcase_add_test(tc, test_local_failing_task);
  tcase_add_test(tc, test_local_signal_forwarded);
  tcase_add_test(tc, test_local_killed_ps_is_named);
  tcase_add_test(tc, test_validation);
  tcase_add_test(tc, test_local_backup_worker_lost);
  tcase_add_test(tc, test_local_replicas_env_tolerates_loss);
  tcase_add_test(tc, test_local_restart_worker);
  tcase_add_test(tc, test_local_status_68_explained);
  tcase_add_test(tc, test_local_psd_wait_names_workers);
  tcase_add_test(tc, test_print_plan_uneven_block);
  tcase_add_test(tc, test_print_plan_cyclic);
  tcase_add_test(tc, test_print_plan_bad_env);
  tcase_add_test(tc, test_print_plan_local);
  tcase_add_test(tc, test_local_psctl_line);
  tcase_add_test(tc, test_psctl_credential_others);
  tcase_add_test(tc, test_psctl_planted_directory);
  tcase_add_test(tc, test_slurm_forged_and_silent_checkins);
  tcase_add_test(tc, test_slurm_planted_directory);
  tcase_add_test(tc, test_slurm_stolen_port);
  tcase_add_test(tc, test_slurm_rank_claimed_twice);
  tcase_add_test(tc, test_slurm_auth_never_downgrades);
  tcase_add_test(tc, test_derived_port_below_ephemeral);
  tcase_add_test(tc, test_slurm_backup_worker_lost);
  tcase_add_test(tc, test_slurm_restart_worker);
  suite_add_tcase(s, tc);
  return s;
}
