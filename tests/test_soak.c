/* Soak: a sync run with backup workers in which random workers are killed
 * with SIGKILL at random steps and restarted (they rejoin at the current
 * step). It must finish, every wait is bounded, and no process is left.
 * The schedule (who, at which step) comes from the seed (PS_TEST_SEED
 * replays it); the moment within that step is the machine's. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

#define SOAK_WORKERS 4
#define SOAK_REPLICAS 2    /* two backups: losing two at once is tolerated */
#define SOAK_STEPS 1500    /* global steps to reach (~4 s) */
#define SOAK_KILLS 20      /* SIGKILLs before the workers may finish */
#define SOAK_LIMIT_S 90.0  /* the whole run, generously (sanitizers are slow) */
/* Exit status of a restarted worker whose killed predecessor had already
 * told the servers it finished (killed between Finish and exit): psd
 * rightly refuses it, and there is nothing left for it to do. */
#define EXIT_ALREADY_FINISHED 4

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static volatile uint64_t *g_progress; /* per worker: its step (shared memory) */

static pid_t start_worker(const char **hp, int i) {
  pid_t pid = fork();
  if (pid == 0) {
    tu_train t;
    memset(&t, 0, sizeof t);
    t.hosts = hp;
    t.num_ps = 2;
    t.num_workers = SOAK_WORKERS;
    t.worker = i;
    t.replicas = SOAK_REPLICAS;
    t.batch = 4;
    t.until = SOAK_STEPS;
    t.delay_us = 2000 + 1000 * i; /* uneven speeds: stale gradients happen */
    t.progress = &g_progress[i];
    t.split_threshold = 16;
    t.max_slice_bytes = 16;
    tu_train_worker(&t);
    if (t.rc && strstr(t.err, "already finished")) _exit(EXIT_ALREADY_FINISHED);
    if (t.rc) fprintf(stderr, "soak worker %d: %s\n", i, t.err);
    _exit(t.rc ? 1 : 0);
  }
  ck_assert_int_gt(pid, 0);
  return pid;
}

/* The kill schedule, drawn from the seed before the run so that the seed
 * replays it: kill k hits worker who[k] once the job reaches step at[k]
 * (spread over the first 80% of the run, increasing). */
static void draw_kills(int at[SOAK_KILLS], int who[SOAK_KILLS]) {
  srand(tu_seed("soak"));
  for (int k = 0; k < SOAK_KILLS; k++) {
    at[k] = (k + 1) * (SOAK_STEPS * 8 / 10) / (SOAK_KILLS + 1) +
            rand() % (SOAK_STEPS / (2 * SOAK_KILLS + 2));
    who[k] = rand() % SOAK_WORKERS;
  }
}

/* The furthest step any worker has reported. */
static uint64_t job_step(void) {
  uint64_t m = 0;
  for (int i = 0; i < SOAK_WORKERS; i++)
    if (g_progress[i] > m) m = g_progress[i];
  return m;
}

START_TEST(random_kills_with_backups) {
  int at[SOAK_KILLS], who[SOAK_KILLS];
  draw_kills(at, who);
  g_progress = mmap(NULL, SOAK_WORKERS * sizeof *g_progress, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert(g_progress != MAP_FAILED);
  tu_psd ps[2];
  /* Checkpoints keep being written while workers die and come back. */
  char ckdir[600];
  snprintf(ckdir, sizeof ckdir, "%s/soak-ck", tu_tmpdir());
  for (int i = 0; i < 2; i++) {
    char idx[4];
    snprintf(idx, sizeof idx, "%d", i);
    const char *args[] = {"--ps-index", idx, "--num-ps", "2", "--grace-period", "20",
                          "--replicas-to-aggregate", "2", "--checkpoint-dir", ckdir,
                          "--checkpoint-every", "100", "--checkpoint-keep", "100", NULL};
    ck_assert(tu_psd_start(&ps[i], args) == 0);
  }
  char hosts[2][64];
  const char *hp[2];
  tu_hosts(ps, 2, hosts, hp);
  pid_t pid[SOAK_WORKERS];
  int killed_once[SOAK_WORKERS] = {0};
  for (int i = 0; i < SOAK_WORKERS; i++) pid[i] = start_worker(hp, i);
  int kills = 0, done = 0;
  double t0 = now_s();
  while (done < SOAK_WORKERS) {
    ck_assert_msg(now_s() - t0 < tu_time_limit(SOAK_LIMIT_S),
                  "soak did not finish in %.0f s (%d kills)", tu_time_limit(SOAK_LIMIT_S), kills);
    /* Reap whoever exited. */
    for (int i = 0; i < SOAK_WORKERS; i++) {
      if (!pid[i]) continue;
      int st;
      if (waitpid(pid[i], &st, WNOHANG) != pid[i]) continue;
      pid[i] = 0;
      int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      ck_assert_msg(code == 0 || (code == EXIT_ALREADY_FINISHED && killed_once[i]),
                    "worker %d failed (status 0x%x) after %d kills", i, st, kills);
      done++;
    }
    if (kills < SOAK_KILLS && job_step() >= (uint64_t)at[kills]) {
      int i = who[kills];
      ck_assert_msg(pid[i] != 0, "worker %d finished before its kill at step %d", i, at[kills]);
      kill(pid[i], SIGKILL);
      ck_assert_int_eq(waitpid(pid[i], NULL, 0), pid[i]);
      killed_once[i] = 1;
      kills++;
      pid[i] = start_worker(hp, i);
    }
    struct timespec ts = {0, 5 * 1000000};
    nanosleep(&ts, NULL);
  }
  ck_assert_msg(kills == SOAK_KILLS, "the run ended after only %d kills", kills);
  for (int i = 0; i < 2; i++) {
    ck_assert_msg(tu_psd_wait(&ps[i], 10) == 0, "psd %d did not exit", i);
    ck_assert_msg(WIFEXITED(ps[i].status) && WEXITSTATUS(ps[i].status) == 0,
                  "psd %d status 0x%x", i, ps[i].status);
    ck_assert(tu_log_contains(&ps[i], "rejoined"));
  }
  /* Every checkpoint is complete: both files of each step. */
  int complete = 0;
  for (int st = 100; st <= SOAK_STEPS + 100; st += 100) {
    char f[800];
    int have = 0;
    for (int i = 0; i < 2; i++) {
      snprintf(f, sizeof f, "%s/step-%012d/ps-%d-of-2.ckpt", ckdir, st, i);
      have += access(f, F_OK) == 0;
    }
    ck_assert_msg(have != 1, "step %d has one of 2 checkpoint files", st);
    complete += have == 2;
  }
  ck_assert_msg(complete >= 10, "only %d complete checkpoints", complete);
  /* Nothing left behind: every child of this test is reaped. */
  ck_assert_int_eq(waitpid(-1, NULL, WNOHANG), -1);
  ck_assert_int_eq(errno, ECHILD);
  fprintf(stderr, "soak: %d kills, %.1f s\n", kills, now_s() - t0);
  munmap((void *)g_progress, SOAK_WORKERS * sizeof *g_progress);
}
END_TEST

Suite *suite_soak(void) {
  Suite *s = suite_create("soak");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 150);
  tcase_add_test(tc, random_kills_with_backups);
  suite_add_tcase(s, tc);
  return s;
}
