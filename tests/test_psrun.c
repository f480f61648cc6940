/* psrun, run for real: --local success, the workers' environment
 * (torchrun's variables), a failing task, signal forwarding,
 * validation errors, backup workers and restarts, psd's exit statuses
 * explained, --print-plan (over fake Slurm environments too), and psctl's
 * line for a --local job, against another uid (nobody) too. psrun in Slurm
 * steps: test_psrun_slurm.c. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
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
#include "util.h"

Suite *suite_psrun(void);

static int count(const char *s, const char *needle) {
  int n = 0;
  for (const char *p = s; (p = strstr(p, needle)); p++) n++;
  return n;
}

START_TEST(test_local_success) {
  char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "4", "--ps", "2", "--",
                  (char *)tu_bin("tiny_worker"), "--steps", "60", NULL};
  char out[1200];
  int st;
  pid_t pid = tu_spawn(argv, NULL, out, sizeof out);
  ck_assert_msg(tu_wait_pid(pid, 60, &st) == 0, "psrun --local did not finish");
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
  char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                  (char *)tu_bin("tiny_worker"), "--steps", "1000", "--sleep-ms", "5",
                  "--fail-at-step", "5", NULL};
  char out[1200];
  int st;
  double t0 = ps__now();
  pid_t pid = tu_spawn(argv, NULL, out, sizeof out);
  ck_assert_msg(tu_wait_pid(pid, 30, &st) == 0, "psrun hung after a task failed");
  double took = ps__now() - t0;
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "status %d; output:\n%s", st, log);
  ck_assert_msg(took < tu_time_limit(10), "took %.1f s to stop after the failure", took);
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
    char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "2", "--ps", "1", "--", "/bin/sh",
                    "-c", "sleep 0.2; (sleep 0.03; pkill -KILL -P $PPID -x psd) & exit 1", NULL};
    char out[1200];
    int st;
    pid_t pid = tu_spawn(argv, NULL, out, sizeof out);
    ck_assert_msg(tu_wait_pid(pid, 30, &st) == 0, "psrun hung after its ps was killed");
    char *log = tu_read_file(out);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "status %d; output:\n%s", st, log);
    ck_assert_msg(strstr(log, "ps0 was killed by SIGKILL") != NULL,
                  "round %d: the killed ps is not named:\n%s", round, log);
    free(log);
  }
}
END_TEST

START_TEST(test_local_signal_forwarded) {
  char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                  (char *)tu_bin("tiny_worker"), "--steps", "100000", "--sleep-ms", "10", NULL};
  char out[1200];
  int st;
  pid_t pid = tu_spawn(argv, NULL, out, sizeof out);
  struct timespec ts = {0, 700000000};
  nanosleep(&ts, NULL);
  kill(pid, SIGTERM);
  ck_assert_msg(tu_wait_pid(pid, 20, &st) == 0, "psrun ignored SIGTERM");
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGTERM, "status %d\n%s", st, log);
  ck_assert(strstr(log, "received SIGTERM") != NULL);
  ck_assert(strstr(log, "[ps0] ") != NULL && strstr(log, "shutting down") != NULL);
  free(log);
  ck_assert_int_ne(system("pgrep -f 'tiny_worke[r] --steps 100000 --sleep-ms 10' >/dev/null"), 0);
}
END_TEST

/* The quick start exits 1 on any error, PS_ESTOPPED included: the job
 * still stopped at its checkpoint, and psrun's status is 75, which a
 * launcher requeues (the library tells psrun through PS_STOP_NOTE_FD). */
START_TEST(test_local_stop_is_75_whatever_the_workers_exit) {
  char dir[600], out[1200];
  snprintf(dir, sizeof dir, "%s/ck-note", tu_tmpdir());
  char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "3", "--ps", "1",
                  "--checkpoint-dir", dir, "--", (char *)tu_bin("stop_worker"), "1000000",
                  NULL};
  int st;
  pid_t pid = tu_spawn(argv, NULL, out, sizeof out);
  ck_assert_msg(tu_wait_text(out, "first step", 30) == 0, "the workers never stepped");
  kill(pid, SIGTERM);
  ck_assert_msg(tu_wait_pid(pid, 60, &st) == 0, "psrun did not stop");
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 75, "status %d\n%s", st, log);
  ck_assert_msg(count(log, "exited with status 1 after the job stopped at its checkpoint: "
                           "counted as stopped (75)") == 2,
                "%s", log);
  free(log);
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
    char *argv[12] = {(char *)tu_bin("psrun")};
    int a = 1;
    for (int k = 0; k < 8 && cases[i].args[k]; k++) argv[a++] = (char *)cases[i].args[k];
    argv[a] = NULL;
    char out[1200];
    int st;
    pid_t pid = tu_spawn(argv, NULL, out, sizeof out);
    ck_assert(tu_wait_pid(pid, 10, &st) == 0);
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
  snprintf(tw, sizeof tw, "TW=%s", tu_bin("tiny_worker"));
  snprintf(marker, sizeof marker, "MARKER=%s/marker.%d", tu_tmpdir(), (int)getpid());
  unlink(marker + 7);
  char *argv[24] = {(char *)tu_bin("psrun"), "--local", "-n", "4", "--ps", "1"};
  int a = 6;
  for (int k = 0; opts[k] && a < 16; k++) argv[a++] = (char *)opts[k];
  char *tail[] = {"--", "/bin/sh", "-c", (char *)script, NULL};
  for (int k = 0; k < 5; k++) argv[a++] = tail[k];
  char *env[] = {tw, marker, NULL};
  char out[1200];
  pid_t pid = tu_spawn(argv, env, out, sizeof out);
  ck_assert_msg(tu_wait_pid(pid, 100, st) == 0, "psrun did not finish");
  return tu_read_file(out);
}

/* Bug: psrun stopped the whole job when one worker died, although psd
 * averages fewer gradients than there are workers and trains on. */
START_TEST(test_local_backup_worker_lost) {
  const char *opts[] = {"--backup-workers", "1", NULL};
  int st;
  char *log = run_workers(opts, TU_ABORT_W1, &st);
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
  log = run_workers(none, TU_ABORT_W1, &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGABRT, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "psrun: w1 was killed by SIGABRT; stopping all tasks"), "%s", log);
  free(log);
}
END_TEST

/* docs/psrun.md's own way, PS_REPLICAS_TO_AGGREGATE=2 for 3 workers, makes
 * psrun tolerate the loss too (psd already did). */
START_TEST(test_local_replicas_env_tolerates_loss) {
  const char *opts[] = {NULL};
  int st;
  setenv("PS_REPLICAS_TO_AGGREGATE", "2", 1);
  char *log = run_workers(opts, TU_ABORT_W1, &st);
  unsetenv("PS_REPLICAS_TO_AGGREGATE");
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "w1 was killed by SIGABRT; going on without it"), "%s", log);
  free(log);
}
END_TEST

START_TEST(test_local_restart_worker) {
  const char *opts[] = {"--restart-workers", "1", NULL};
  int st;
  char *log = run_workers(opts, TU_FAIL_W1_ONCE, &st);
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

/* --grace G: when the job stops, a task that ignores SIGTERM is killed G s
 * after it, not sooner. Worker 0 exits 3 at once; the others ignore
 * SIGTERM: psrun exits 3 after G s, whatever G is. */
START_TEST(test_local_grace) {
  const char *script = "[ \"$PS_WORKER_INDEX\" = 0 ] && exit 3; trap '' TERM; exec sleep 60";
  const char *g[] = {"1", "8"};
  double took[2];
  for (int i = 0; i < 2; i++) {
    const char *opts[] = {"--grace", g[i], NULL};
    int st;
    double t0 = ps__now();
    char *log = run_workers(opts, script, &st);
    took[i] = ps__now() - t0;
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 3 &&
                      strstr(log, "w0 exited with status 3; stopping all tasks"),
                  "status %d\n%s", st, log);
    free(log);
  }
  ck_assert_msg(took[0] >= 1 && took[0] < tu_time_limit(6) && took[1] >= 8, "--grace 1: %.1f s, --grace 8: %.1f s",
                took[0], took[1]);
}
END_TEST

/* Bug: psrun ended with "ps0 exited with status 68; stopping all tasks",
 * no word of what 68 means. Worker 1 stops (SIGSTOP) mid-run: connected,
 * silent; the others finish (one backup), psd exits 68 (which it does only
 * under --finish-timeout: otherwise it waits for a connected worker). */
START_TEST(test_local_status_68_explained) {
  const char *opts[] = {"--psd-arg=--stall-timeout=1", "--psd-arg=--finish-timeout=1", NULL};
  int st;
  setenv("PS_REPLICAS_TO_AGGREGATE", "2", 1); /* one backup: the others finish */
  char *log = run_workers(opts,
                          "if [ \"$PS_WORKER_INDEX\" = 1 ]; then (sleep 0.5; kill -STOP $$) & fi; "
                          "exec \"$TW\" --steps 300 --sleep-ms 5",
                          &st);
  unsetenv("PS_REPLICAS_TO_AGGREGATE");
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 68, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "ps0 exited with status 68 (a worker stayed connected but silent "
                            "past psd's --finish-timeout after the others finished: it never "
                            "called ps_client_finish"),
                "%s", log);
  free(log);
}
END_TEST

/* Bug: "parameter servers did not exit within 30 s after the workers
 * finished" gave no hint. Workers 1 and 2 exit 0 without ps_client_finish
 * (2 losses, 1 backup): psd waits its 60 s grace period, psrun gives up
 * after 30 s and names them with the state psd reports. */
START_TEST(test_local_psd_wait_names_workers) {
  const char *opts[] = {NULL};
  int st;
  setenv("PS_REPLICAS_TO_AGGREGATE", "2", 1);
  char *log = run_workers(opts, TU_TWO_SKIP_FINISH, &st);
  unsetenv("PS_REPLICAS_TO_AGGREGATE");
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d\n%s", st, log);
  ck_assert_msg(strstr(log, "did not exit within 30 s after the workers finished: psd never saw "
                            "w1 (lost), w2 (lost) call ps_client_finish"),
                "%s", log);
  free(log);
}
END_TEST

/* Asserts that variable name of worker w's dump is want. */
static void env_is(const char *dump, int w, const char *name, const char *want) {
  char v[256];
  ck_assert_msg(strcmp(tu_env_of(dump, name, v, sizeof v), want) == 0, "w%d: %s='%s', not '%s'", w,
                name, v, want);
}

/* torchrun's contract under --local (1 ps, 3 workers): RANK and
 * WORLD_SIZE count the workers, LOCAL_RANK and PS_LOCAL_RANK too (they
 * counted the ps before), MASTER_ADDR is loopback and MASTER_PORT one port,
 * the same for every worker, that is free while the job runs (the test
 * binds it while worker 0 waits, as its TCPStore would). psrun's values
 * replace stale ones in the user's environment. */
START_TEST(test_local_torch_env) {
  char pre[1100], tw[1200], dump[1200], go[1200];
  snprintf(pre, sizeof pre, "%s/torchenv.%d", tu_tmpdir(), (int)getpid());
  snprintf(go, sizeof go, "%s.go", pre);
  unlink(go);
  snprintf(tw, sizeof tw, "TW=%s", tu_bin("tiny_worker"));
  snprintf(dump, sizeof dump, "PRE=%s", pre);
  char *env[] = {tw, dump, "RANK=7", "WORLD_SIZE=9", "LOCAL_RANK=5", "LOCAL_WORLD_SIZE=9",
                 "MASTER_ADDR=10.9.9.9", "MASTER_PORT=1", "PS_LOCAL_RANK=8", NULL};
  const char *script =
      "{ echo; env; } >\"$PRE.w$PS_WORKER_INDEX.tmp\" && mv \"$PRE.w$PS_WORKER_INDEX.tmp\" "
      "\"$PRE.w$PS_WORKER_INDEX\"; if [ \"$PS_WORKER_INDEX\" = 0 ]; then i=0; "
      "while [ ! -e \"$PRE.go\" ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; fi; "
      "exec \"$TW\" --steps 5";
  char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "4", "--ps", "1", "--", "/bin/sh",
                  "-c", (char *)script, NULL};
  char out[1200];
  pid_t pid = tu_spawn(argv, env, out, sizeof out);
  char *dumps[3] = {NULL, NULL, NULL};
  for (int w = 0; w < 3; w++) {
    char path[1200];
    snprintf(path, sizeof path, "%s.w%d", pre, w);
    for (int i = 0; i < 3000 && access(path, F_OK) != 0; i++) {
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
    }
    dumps[w] = tu_read_file(path);
    ck_assert_msg(dumps[w] != NULL, "w%d wrote no environment:\n%s", w, tu_read_file(out));
    unlink(path);
  }
  char port[3][64], want[32];
  for (int w = 0; w < 3; w++) {
    snprintf(want, sizeof want, "%d", w);
    env_is(dumps[w], w, "RANK", want);
    env_is(dumps[w], w, "PS_WORKER_INDEX", want);
    env_is(dumps[w], w, "LOCAL_RANK", want);
    env_is(dumps[w], w, "PS_LOCAL_RANK", want);
    env_is(dumps[w], w, "WORLD_SIZE", "3");
    env_is(dumps[w], w, "LOCAL_WORLD_SIZE", "3");
    env_is(dumps[w], w, "MASTER_ADDR", "127.0.0.1");
    tu_env_of(dumps[w], "MASTER_PORT", port[w], sizeof port[w]);
    ck_assert_msg(atoi(port[w]) > 1 && atoi(port[w]) < 65536 && strcmp(port[w], port[0]) == 0,
                  "w%d: MASTER_PORT='%s', w0's '%s'", w, port[w], port[0]);
  }
  /* Worker 0 is still waiting: the port must be free, on every address. */
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port[0]))};
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  int bound = bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(fd, 1) == 0;
  ck_assert_msg(bound, "MASTER_PORT %s cannot be bound: %s", port[0], strerror(errno));
  close(fd);
  FILE *f = fopen(go, "w");
  ck_assert_ptr_nonnull(f);
  fclose(f);
  int st;
  ck_assert_msg(tu_wait_pid(pid, 60, &st) == 0, "psrun did not finish");
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d: %s", st, log);
  free(log);
  for (int w = 0; w < 3; w++) free(dumps[w]);
  unlink(go);
}
END_TEST

/* --print-plan under a fake Slurm environment: the role table. */
static char *plan(char *const *env, const char *placement, int *status) {
  char *argv[] = {(char *)tu_bin("psrun"), "--print-plan", "--ps", "2", "--ps-placement",
                  (char *)placement, "--", "true", NULL};
  char out[1200];
  pid_t pid = tu_spawn(argv, env, out, sizeof out);
  ck_assert(tu_wait_pid(pid, 10, status) == 0);
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
  ck_assert(strstr(out, "{\"rank\":2,\"role\":\"worker\",\"index\":0,\"node\":\"n1\",\"local_rank\":2,"
                   "\"worker_local_rank\":0}"));
  ck_assert(strstr(out, "{\"rank\":5,\"role\":\"worker\",\"index\":3,\"node\":\"n2\",\"local_rank\":1,"
                   "\"worker_local_rank\":1}"));
  ck_assert(strstr(out, "{\"rank\":7,\"role\":\"worker\",\"index\":5,\"node\":\"n4\",\"local_rank\":0,"
                   "\"worker_local_rank\":0}"));
  free(out);
  out = plan(env, "spread", &st);
  ck_assert(strstr(out, "{\"rank\":0,\"role\":\"ps\",\"index\":0,\"node\":\"n1\",\"local_rank\":0}"));
  ck_assert(strstr(out, "{\"rank\":4,\"role\":\"ps\",\"index\":1,\"node\":\"n2\",\"local_rank\":0}"));
  ck_assert(strstr(out, "{\"rank\":1,\"role\":\"worker\",\"index\":0,\"node\":\"n1\",\"local_rank\":1,"
                   "\"worker_local_rank\":0}"));
  /* n2's first task is ps1: its worker is the node's first worker. */
  ck_assert(strstr(out, "{\"rank\":5,\"role\":\"worker\",\"index\":3,\"node\":\"n2\",\"local_rank\":1,"
                   "\"worker_local_rank\":0}"));
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
  ck_assert(strstr(out, "{\"rank\":3,\"role\":\"worker\",\"index\":1,\"node\":\"node7\",\"local_rank\":0,"
                   "\"worker_local_rank\":0}"));
  ck_assert(strstr(out, "{\"rank\":4,\"role\":\"worker\",\"index\":2,\"node\":\"node01\",\"local_rank\":1,"
                   "\"worker_local_rank\":0}"));
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
  char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "4", "--ps", "2", "--print-plan", "--",
                  "/bin/sh", "-c", "touch \"$0\"", marker, NULL};
  char out[1200];
  int st;
  pid_t pid = tu_spawn(argv, NULL, out, sizeof out);
  ck_assert_msg(tu_wait_pid(pid, 20, &st) == 0, "psrun --local --print-plan did not finish");
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d: %s", st, log);
  ck_assert_msg(count(log, "{\"rank\":") == 4 && count(log, "\n") == 4, "%s", log);
  ck_assert(strstr(log, "{\"rank\":0,\"role\":\"ps\",\"index\":0,\"node\":\"localhost\",\"local_rank\":0}"));
  ck_assert(strstr(log, "{\"rank\":1,\"role\":\"ps\",\"index\":1,\"node\":\"localhost\",\"local_rank\":1}"));
  ck_assert(strstr(log, "{\"rank\":3,\"role\":\"worker\",\"index\":1,\"node\":\"localhost\",\"local_rank\":3,"
                   "\"worker_local_rank\":1}"));
  ck_assert_msg(access(marker, F_OK) != 0, "the worker command ran: %s", log);
  free(log);
}
END_TEST

/* ---- psctl for a psrun --local job --------------------------------------------- */

/* Starts a long psrun --local job; fills line with its "psctl stats ADDR
 * --secret-file FILE" (from stderr), addr and file. Returns psrun's pid. */
static pid_t local_job_for_psctl(char *out, size_t outlen, char *line, size_t linelen,
                                 char *addr, char *file) {
  char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                  (char *)tu_bin("tiny_worker"), "--steps", "4000", "--sleep-ms", "5", NULL};
  pid_t pid = tu_spawn(argv, NULL, out, outlen);
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
  snprintf(cmd, sizeof cmd, "'%s' %s >'%s' 2>&1", tu_bin("psctl"), args, out);
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
  ck_assert(tu_wait_pid(pid, 30, &status) == 0);
  ck_assert_msg(access(file, F_OK) != 0, "%s is left after the job", file);
}
END_TEST

/* Another user can neither read the credential nor make psctl use one of
 * theirs (it would have psctl trust their psd). */
START_TEST(test_psctl_credential_others) {
  char out[1200], line[2400], addr[256], file[1024], po[1200], args[5000], planted[1200];
  pid_t pid = local_job_for_psctl(out, sizeof out, line, sizeof line, addr, file);
  snprintf(args, sizeof args, "cat '%s'", file);
  char *argv[] = {"/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                  "/bin/bash", "-c", args, NULL};
  int st;
  pid_t cat = tu_spawn(argv, NULL, po, sizeof po);
  ck_assert(tu_wait_pid(cat, 10, &st) == 0);
  char *text = tu_read_file(po);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0 && strstr(text, "Permission denied"),
                "nobody read the credential: %s", text);
  free(text);
  snprintf(planted, sizeof planted, "%s/planted.secret", tu_tmpdir());
  snprintf(args, sizeof args, "cp '%s' '%s' && chown %d:%d '%s' && chmod 600 '%s'", file,
           planted, TU_NOBODY, TU_NOBODY, planted, planted);
  ck_assert_int_eq(system(args), 0);
  snprintf(args, sizeof args, "stats %s --secret-file '%s'", addr, planted);
  int rc = run_psctl(args, po, sizeof po);
  text = tu_read_file(po);
  ck_assert_msg(rc != 0 && strstr(text, "not a private file of yours") &&
                    strstr(text, "uid 65534"), "rc %d: %s", rc, text);
  free(text);
  kill(pid, SIGTERM);
  ck_assert(tu_wait_pid(pid, 30, &st) == 0);
}
END_TEST

/* A psrun-UID directory planted by another user is not used: psrun says
 * so, prints no psctl line and runs the job anyway (it costs psctl only). */
START_TEST(test_psctl_planted_directory) {
  char base[1100], planted[1200], env0[1200], out[1200];
  snprintf(base, sizeof base, "%s/xdg-planted", tu_tmpdir());
  mkdir(base, 01777);
  chmod(base, 01777);
  snprintf(planted, sizeof planted, "%s/psrun-%u", base, (unsigned)getuid());
  ck_assert(mkdir(planted, 0777) == 0 && chown(planted, TU_NOBODY, TU_NOBODY) == 0);
  chmod(planted, 0777);
  snprintf(env0, sizeof env0, "XDG_RUNTIME_DIR=%s", base);
  char *env[] = {env0, NULL};
  char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                  (char *)tu_bin("tiny_worker"), "--steps", "20", NULL};
  int st;
  pid_t pid = tu_spawn(argv, env, out, sizeof out);
  ck_assert(tu_wait_pid(pid, 60, &st) == 0);
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

Suite *suite_psrun(void) {
  Suite *s = suite_create("psrun");
  TCase *tc = tcase_create("psrun");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_local_success);
  tcase_add_test(tc, test_local_torch_env);
  tcase_add_test(tc, test_local_failing_task);
  tcase_add_test(tc, test_local_signal_forwarded);
  tcase_add_test(tc, test_local_stop_is_75_whatever_the_workers_exit);
  tcase_add_test(tc, test_local_killed_ps_is_named);
  tcase_add_test(tc, test_validation);
  tcase_add_test(tc, test_local_backup_worker_lost);
  tcase_add_test(tc, test_local_replicas_env_tolerates_loss);
  tcase_add_test(tc, test_local_restart_worker);
  tcase_add_test(tc, test_local_grace);
  tcase_add_test(tc, test_local_status_68_explained);
  tcase_add_test(tc, test_local_psd_wait_names_workers);
  tcase_add_test(tc, test_print_plan_uneven_block);
  tcase_add_test(tc, test_print_plan_cyclic);
  tcase_add_test(tc, test_print_plan_bad_env);
  tcase_add_test(tc, test_print_plan_local);
  tcase_add_test(tc, test_local_psctl_line);
  if (tu_can_be_another_user()) {
    tcase_add_test(tc, test_psctl_credential_others);
    tcase_add_test(tc, test_psctl_planted_directory);
  } else {
    tu_skip_tests("psrun", "test_psctl_credential_others, test_psctl_planted_directory",
                  "acting as another user (nobody) needs root and setpriv");
  }
  suite_add_tcase(s, tc);
  return s;
}
