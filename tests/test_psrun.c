/* psrun, run for real: --local success, a failing task, signal forwarding,
 * validation errors, and --print-plan over fake Slurm environments. */
#define _GNU_SOURCE
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

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

Suite *suite_psrun(void) {
  Suite *s = suite_create("psrun");
  TCase *tc = tcase_create("psrun");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_local_success);
  tcase_add_test(tc, test_local_failing_task);
  tcase_add_test(tc, test_local_signal_forwarded);
  tcase_add_test(tc, test_local_killed_ps_is_named);
  tcase_add_test(tc, test_validation);
  tcase_add_test(tc, test_print_plan_uneven_block);
  tcase_add_test(tc, test_print_plan_cyclic);
  tcase_add_test(tc, test_print_plan_bad_env);
  suite_add_tcase(s, tc);
  return s;
}
