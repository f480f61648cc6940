/* The CIFAR-10 example end to end, on synthetic data made by cifar_synth:
 * psrun --local with 1 ps and 2 workers learns far above chance, and 2
 * workers of batch b reach the parameters of 1 worker of batch 2b. */
#define _GNU_SOURCE
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <time.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

static const char *bin(const char *name) {
  static char dir[1024], path[16][1200];
  static int k;
  if (!dir[0]) {
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (n > 0) dir[n] = '\0';
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
  }
  k = (k + 1) % 16; /* several live at once in one argv */
  snprintf(path[k], sizeof path[k], "%s/%s", dir, name);
  return path[k];
}

/* Starts argv with its output going to path (a hang is killed by the
 * alarm: it fails the test, it never blocks CI). */
static pid_t spawn(char *const *argv, char *path, size_t pathlen, int timeout_s) {
  static int seq;
  snprintf(path, pathlen, "%s/cifar.%d.%d.out", tu_tmpdir(), (int)getpid(), ++seq);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    alarm((unsigned)timeout_s);
    execv(argv[0], argv);
    _exit(127);
  }
  return pid;
}

/* Waits for a spawned command; its output into *out (malloc'd). */
static int reap(pid_t pid, const char *path, char **out) {
  int st;
  waitpid(pid, &st, 0);
  *out = tu_read_file(path);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Runs argv to completion (bounded), output into *out (malloc'd). */
static int run(char *const *argv, char **out, int timeout_s) {
  char path[512];
  pid_t pid = spawn(argv, path, sizeof path, timeout_s);
  return reap(pid, path, out);
}

/* The last part of a long output, for assertion messages (Check refuses
 * messages of more than a few KiB). */
static const char *tail_of(const char *out) {
  size_t n = out ? strlen(out) : 0;
  return n > 3000 ? out + n - 3000 : out ? out : "";
}

static const char *synth_dir(void) {
  static char dir[512];
  if (!dir[0]) {
    snprintf(dir, sizeof dir, "%s/synth", tu_tmpdir());
    char *argv[] = {(char *)bin("cifar_synth"), "--out", dir, "--train", "2560", "--test",
                    "500", "--seed", "3", NULL};
    char *out;
    int rc = run(argv, &out, 60);
    ck_assert_msg(rc == 0, "cifar_synth failed: %s", tail_of(out));
    free(out);
  }
  return dir;
}

START_TEST(test_learns_far_above_chance) {
  char *argv[] = {(char *)bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                  (char *)bin("cifar_worker"), "--data", (char *)synth_dir(), "--steps", "40",
                  "--batch", "32", "--lr", "0.05", "--threads", "1", "--no-lrn", NULL};
  char *out;
  int rc = run(argv, &out, 240);
  ck_assert_msg(rc == 0, "psrun exited %d:\n%s", rc, tail_of(out));
  const char *acc = strstr(out, "[w0] {\"test_accuracy\":");
  ck_assert_msg(acc != NULL, "no summary from the chief:\n%s", tail_of(out));
  double a = atof(acc + strlen("[w0] {\"test_accuracy\":"));
  /* 10 classes: chance is 0.10. */
  ck_assert_msg(a > 0.5, "test accuracy %.3f after 40 steps", a);
  ck_assert(strstr(out, "[w1] {\"test_accuracy\":null") != NULL);
  free(out);
}
END_TEST

static float *read_floats(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  ck_assert_ptr_nonnull(f);
  fseek(f, 0, SEEK_END);
  long bytes = ftell(f);
  fseek(f, 0, SEEK_SET);
  float *v = malloc((size_t)bytes);
  ck_assert(fread(v, 1, (size_t)bytes, f) == (size_t)bytes);
  fclose(f);
  *n = (size_t)bytes / sizeof(float);
  return v;
}

/* Runs 30 steps (1 worker) with extra options; the chief's test accuracy,
 * its parameters dumped to dump. */
static double run_recipe(const char *const *extra, const char *dump) {
  char *argv[40] = {(char *)bin("psrun"), "--local", "-n", "2", "--ps", "1", "--",
                    (char *)bin("cifar_worker"), "--data", (char *)synth_dir(), "--steps", "30",
                    "--batch", "32", "--lr", "0.02", "--threads", "1", "--no-lrn",
                    "--dump-params", (char *)dump};
  int a = 21;
  for (int k = 0; extra[k]; k++) argv[a++] = (char *)extra[k];
  argv[a] = NULL;
  char *out;
  int rc = run(argv, &out, 240);
  ck_assert_msg(rc == 0, "psrun exited %d:\n%s", rc, tail_of(out));
  const char *acc = strstr(out, "[w0] {\"test_accuracy\":");
  ck_assert_msg(acc != NULL, "no summary from the chief:\n%s", tail_of(out));
  double v = atof(acc + strlen("[w0] {\"test_accuracy\":"));
  free(out);
  return v;
}

/* The long-run recipe's options (momentum, warm-up, cosine) reach the
 * server's update rule: the run learns, and its parameters differ from
 * plain SGD's on the same data and seed. Contradictory or impossible
 * schedules are refused with a sentence. */
START_TEST(test_recipe_options) {
  char plain[600], recipe[600];
  snprintf(plain, sizeof plain, "%s/plain.f32", tu_tmpdir());
  snprintf(recipe, sizeof recipe, "%s/recipe.f32", tu_tmpdir());
  const char *none[] = {NULL};
  const char *opts[] = {"--momentum", "0.9", "--warmup-epochs", "0.05", "--cosine", NULL};
  run_recipe(none, plain);
  double a = run_recipe(opts, recipe);
  ck_assert_msg(a > 0.4, "test accuracy %.3f after 30 steps with the recipe", a);
  size_t n1, n2;
  float *p1 = read_floats(plain, &n1), *p2 = read_floats(recipe, &n2);
  ck_assert_uint_eq(n1, n2);
  size_t differ = 0;
  for (size_t i = 0; i < n1; i++) differ += p1[i] != p2[i];
  ck_assert_msg(differ > n1 / 2, "only %zu of %zu parameters differ from plain SGD", differ, n1);
  free(p1);
  free(p2);
  /* --cosine-floor: the same cosine ends early, at 0.3 x the rate, which
   * then holds: other parameters again (its server logs the schedule). */
  char floored[600];
  snprintf(floored, sizeof floored, "%s/floored.f32", tu_tmpdir());
  const char *fl[] = {"--momentum", "0.9", "--warmup-epochs", "0.05", "--cosine-floor",
                      "0.2:0.3", NULL};
  double b = run_recipe(fl, floored);
  ck_assert_msg(b > 0.4, "test accuracy %.3f after 30 steps with a floored cosine", b);
  float *p3 = read_floats(floored, &n1);
  p2 = read_floats(recipe, &n2);
  ck_assert_uint_eq(n1, n2);
  differ = 0;
  for (size_t i = 0; i < n1; i++) differ += p3[i] != p2[i];
  ck_assert_msg(differ > n1 / 2, "only %zu of %zu parameters differ from --cosine's", differ, n1);
  free(p2);
  free(p3);
  /* Options after --data D, then the sentence that refuses them. */
  const char *bad[][5] = {{"--cosine", "--lr-decay", "0.1:1", NULL, "choose one schedule"},
                          {"--cosine-floor", "0.2:0.3", "--lr-decay", "0.1:1",
                           "choose one schedule"},
                          {"--cosine-floor", "75", NULL, NULL, "must be EPOCH:FACTOR"},
                          {"--cosine-floor", "75:1.5", NULL, NULL, "--cosine-floor FACTOR"}};
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    char *argv[8] = {(char *)bin("cifar_worker"), "--data", (char *)synth_dir()};
    for (int j = 0; j < 4 && bad[k][j]; j++) argv[3 + j] = (char *)bad[k][j];
    char *out;
    ck_assert_int_ne(run(argv, &out, 30), 0);
    ck_assert_msg(out && strstr(out, bad[k][4]), "%s: %s", bad[k][0], tail_of(out));
    free(out);
  }
}
END_TEST

static double json_num(const char *s, const char *key) {
  char k[64];
  snprintf(k, sizeof k, "\"%s\":", key);
  const char *p = strstr(s, k);
  ck_assert_msg(p != NULL, "no %s in %s", key, s);
  return atof(p + strlen(k));
}

/* --average: the servers keep a moving average that the chief evaluates
 * beside the parameters; --eval-views 10 predicts from ten views. Both
 * land in the chief's summary, each a trained network's accuracy (chance
 * is 0.1); bad values are refused with a sentence. */
START_TEST(test_average_and_eval_views) {
  char *argv[] = {(char *)bin("psrun"), "--local", "-n", "2", "--ps", "1", "--",
                  (char *)bin("cifar_worker"), "--data", (char *)synth_dir(), "--steps", "30",
                  "--batch", "32", "--lr", "0.02", "--momentum", "0.9", "--threads", "1",
                  "--no-lrn", "--average", "0.9", "--eval-views", "10", NULL};
  char *out;
  int rc = run(argv, &out, 240);
  ck_assert_msg(rc == 0, "psrun exited %d:\n%s", rc, tail_of(out));
  const char *sum = strstr(out, "[w0] {\"test_accuracy\":");
  ck_assert_msg(sum != NULL, "no summary from the chief:\n%s", tail_of(out));
  ck_assert_int_eq((int)json_num(sum, "eval_views"), 10);
  const char *keys[] = {"test_accuracy", "test_accuracy_average", "test_accuracy_views",
                        "test_accuracy_average_views"};
  for (int k = 0; k < 4; k++) {
    double a = json_num(sum, keys[k]);
    ck_assert_msg(a > 0.4 && a <= 1, "%s %.3f after 30 steps", keys[k], a);
  }
  free(out);
  const char *bad[][2] = {{"--eval-views", "3"}, {"--average", "1"}};
  const char *want[] = {"--eval-views must be 1, 2 or 10", "--average must be a number"};
  for (int k = 0; k < 2; k++) {
    char *b[] = {(char *)bin("cifar_worker"), "--data", (char *)synth_dir(), (char *)bad[k][0],
                 (char *)bad[k][1], NULL};
    ck_assert_int_ne(run(b, &out, 30), 0);
    ck_assert_msg(out && strstr(out, want[k]), "%s", tail_of(out));
    free(out);
  }
}
END_TEST

/* --metrics and --dump-params are created as psd's outputs are
 * (common/wfile.c): a link planted at the name is refused with a sentence
 * naming it, and the file it points to is left as it was. */
START_TEST(test_outputs_refuse_planted_links) {
  char victim[600], link[600];
  snprintf(victim, sizeof victim, "%s/victim", tu_tmpdir());
  snprintf(link, sizeof link, "%s/planted", tu_tmpdir());
  FILE *f = fopen(victim, "w");
  ck_assert_ptr_nonnull(f);
  fputs("precious\n", f);
  fclose(f);
  ck_assert_int_eq(symlink(victim, link), 0);
  const char *opt[] = {"--metrics", "--dump-params"};
  for (int k = 0; k < 2; k++) {
    char *argv[] = {(char *)bin("psrun"), "--local", "-n", "2", "--ps", "1", "--",
                    (char *)bin("cifar_worker"), "--data", (char *)synth_dir(), "--steps", "2",
                    "--batch", "8", "--threads", "1", "--no-lrn", (char *)opt[k], link, NULL};
    char *out;
    ck_assert_int_ne(run(argv, &out, 120), 0);
    char want[800];
    snprintf(want, sizeof want, "%s %s: is a symbolic link", opt[k], link);
    ck_assert_msg(out && strstr(out, want), "no '%s' in:\n%s", want, tail_of(out));
    free(out);
    char buf[64] = {0};
    f = fopen(victim, "r");
    ck_assert_ptr_nonnull(f);
    ck_assert_ptr_nonnull(fgets(buf, sizeof buf, f));
    fclose(f);
    ck_assert_str_eq(buf, "precious\n");
  }
}
END_TEST

/* 2 workers x batch 16 and 1 worker x batch 32 see the same images each
 * step (the sampler deals each global batch out in slices), and the server
 * averages the two workers' mean gradients, which is the mean over 32: the
 * parameters after 4 steps must agree up to float summation order. Each
 * gradient differs by a few ulps (~1e-7 relative); at lr 0.05 over 4 steps
 * that moves parameters by far less than 1e-5, so 1e-4 absolute is a
 * tolerance a real bug (a missing average, a wrong image, an extra step)
 * cannot hide in: those change parameters by 1e-3 or more. */
START_TEST(test_two_workers_equal_one_with_double_batch) {
  char d1[600], d2[600];
  snprintf(d1, sizeof d1, "%s/params.1x32", tu_tmpdir());
  snprintf(d2, sizeof d2, "%s/params.2x16", tu_tmpdir());
  char *one[] = {(char *)bin("psrun"), "--local", "-n", "2", "--ps", "1", "--",
                 (char *)bin("cifar_worker"), "--data", (char *)synth_dir(), "--steps", "4",
                 "--batch", "32", "--lr", "0.05", "--threads", "1", "--dump-params", d1, NULL};
  char *two[] = {(char *)bin("psrun"), "--local", "-n", "3", "--ps", "1", "--",
                 (char *)bin("cifar_worker"), "--data", (char *)synth_dir(), "--steps", "4",
                 "--batch", "16", "--lr", "0.05", "--threads", "1", "--dump-params", d2, NULL};
  char *out;
  int rc = run(one, &out, 240);
  ck_assert_msg(rc == 0, "1 worker: %s", tail_of(out));
  free(out);
  rc = run(two, &out, 240);
  ck_assert_msg(rc == 0, "2 workers: %s", tail_of(out));
  free(out);
  size_t n1, n2;
  float *a = read_floats(d1, &n1), *b = read_floats(d2, &n2);
  ck_assert_uint_eq(n1, n2);
  ck_assert_uint_gt(n1, 1000000); /* the whole model: ~1.07M parameters */
  double worst = 0, moved = 0;
  for (size_t i = 0; i < n1; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (d > worst) worst = d;
  }
  /* Sanity: training moved the parameters far more than the tolerance
   * (compare with a 0-step run would need a third run; the biases start
   * at exact constants, so look at how far one moved). */
  for (size_t i = 0; i < n1; i++) moved = fmax(moved, fabs((double)a[i]));
  ck_assert_msg(worst <= 1e-4, "parameters differ by up to %g", worst);
  ck_assert(moved > 1e-2);
  free(a);
  free(b);
}
END_TEST

/* ---- preemption and a killed ps: resume reproduces the full run ------ */

/* Pids of processes (other than us) whose command line contains needle
 * and also needle2 (if not NULL); fills pids (up to cap), returns how many. */
static int procs_with2(const char *needle, const char *needle2, pid_t *pids, int cap) {
  int n = 0;
  char cmd[8192];
  DIR *d = opendir("/proc");
  struct dirent *e;
  while (d && (e = readdir(d)) != NULL && n < cap) {
    pid_t p = (pid_t)atoi(e->d_name);
    if (p <= 1 || p == getpid()) continue;
    char f[300];
    snprintf(f, sizeof f, "/proc/%d/cmdline", (int)p);
    int fd = open(f, O_RDONLY);
    if (fd < 0) continue;
    ssize_t len = read(fd, cmd, sizeof cmd - 1);
    close(fd);
    if (len <= 0) continue;
    for (ssize_t i = 0; i < len; i++)
      if (!cmd[i]) cmd[i] = ' ';
    cmd[len] = '\0';
    if (strstr(cmd, needle) && (!needle2 || strstr(cmd, needle2))) pids[n++] = p;
  }
  if (d) closedir(d);
  return n;
}

static int procs_with(const char *needle, pid_t *pids, int cap) {
  return procs_with2(needle, NULL, pids, cap);
}

/* 2 ps, 2 workers, 100 steps, deterministic (1 thread, 2 workers: the
 * average of two gradients does not depend on their order). */
static void job_argv(char **argv, const char *ckdir, const char *dump) {
  char *a[] = {(char *)bin("psrun"), "--local", "-n", "4", "--ps", "2", "--checkpoint-dir",
               (char *)ckdir, "--checkpoint-every", "5", "--",
               (char *)bin("cifar_worker"), "--data", (char *)synth_dir(), "--steps", "100",
               "--batch", "16", "--lr", "0.05", "--threads", "1", "--dump-params",
               (char *)dump, NULL};
  memcpy(argv, a, sizeof a);
}

static void wait_for(const char *path, double timeout_s) {
  for (double t = 0; t < timeout_s; t += 0.01) {
    if (access(path, F_OK) == 0) return;
    usleep(10000);
  }
  ck_abort_msg("%s did not appear within %.0f s", path, timeout_s);
}

static void params_equal(const char *p1, const char *p2) {
  size_t n1, n2;
  float *a = read_floats(p1, &n1), *b = read_floats(p2, &n2);
  ck_assert_uint_eq(n1, n2);
  size_t diff = 0;
  for (size_t i = 0; i < n1; i++) diff += memcmp(&a[i], &b[i], sizeof(float)) != 0;
  ck_assert_msg(diff == 0, "%zu of %zu parameters differ from the uninterrupted run", diff, n1);
  free(a);
  free(b);
}

/* Runs the job to the end in a fresh directory: the reference. */
static const char *reference_params(void) {
  static char dump[600];
  if (!dump[0]) {
    char dir[600], *argv[32], *out;
    snprintf(dir, sizeof dir, "%s/ck-ref", tu_tmpdir());
    snprintf(dump, sizeof dump, "%s/params.ref", tu_tmpdir());
    job_argv(argv, dir, dump);
    int rc = run(argv, &out, 240);
    ck_assert_msg(rc == 0, "reference run exited %d:\n%s", rc, tail_of(out));
    free(out);
  }
  return dump;
}

/* Resumes the interrupted job in dir: it must say where it resumed and end
 * with the reference parameters, bit for bit. */
static void resume_and_compare(const char *dir, const char *dump) {
  char *argv[32], *out;
  job_argv(argv, dir, dump);
  int rc = run(argv, &out, 240);
  ck_assert_msg(rc == 0, "resumed run exited %d:\n%s", rc, tail_of(out));
  const char *at = strstr(out, "resuming at step ");
  ck_assert_msg(at && atoi(at + 17) > 0, "the run did not resume:\n%s", tail_of(out));
  free(out);
  params_equal(reference_params(), dump);
}

/* Starts the job in a fresh dir (and dump file) named after `name`, and
 * returns once its checkpoint of `step` exists: training is under way. */
static pid_t start_job(const char *name, int step, char *dir, char *dump, char *path) {
  reference_params();
  char first[700], *argv[32];
  snprintf(dir, 600, "%s/ck-%s", tu_tmpdir(), name);
  snprintf(dump, 600, "%s/params.%s", tu_tmpdir(), name);
  snprintf(first, sizeof first, "%s/step-%012d", dir, step);
  job_argv(argv, dir, dump);
  pid_t pid = spawn(argv, path, 512, 240);
  wait_for(first, 60);
  return pid;
}

START_TEST(test_preempted_job_resumes_exactly) {
  char dir[600], dump[600], path[512], *out;
  pid_t pid = start_job("preempt", 5, dir, dump, path);
  kill(pid, SIGTERM); /* what srun and scancel send */
  int rc = reap(pid, path, &out);
  ck_assert_msg(rc == 75, "a stopped job exits 75, got %d:\n%s", rc, tail_of(out));
  ck_assert_msg(strstr(out, "stopping on request") && strstr(out, "run it again to resume"),
                "%s", tail_of(out));
  free(out);
  pid_t left[4];
  ck_assert_int_eq(procs_with(dir, left, 4), 0);
  resume_and_compare(dir, dump);
}
END_TEST

START_TEST(test_killed_ps_fails_fast_and_relaunch_resumes) {
  char dir[600], dump[600], path[512], *out;
  pid_t pid = start_job("kill9", 10, dir, dump, path);
  pid_t ps1[2];
  ck_assert_msg(procs_with2("--name ps1 ", dir, ps1, 2) == 1, "cannot find ps1");
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  kill(ps1[0], SIGKILL);
  int rc = reap(pid, path, &out);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
  ck_assert_msg(rc != 0 && rc != 75, "psrun exited %d after a ps was killed:\n%s", rc, tail_of(out));
  ck_assert_msg(secs < tu_time_limit(5), "the job took %.1f s to end after ps1 died", secs);
  ck_assert_msg(strstr(out, "ps1 was killed by SIGKILL") && strstr(out, "ps 1 at 127.0.0.1:"),
                "no message names the dead ps and its address:\n%s", tail_of(out));
  free(out);
  pid_t left[4];
  ck_assert_int_eq(procs_with(dir, left, 4), 0);
  ck_assert_int_eq(procs_with(dump, left, 4), 0);
  resume_and_compare(dir, dump);
}
END_TEST

/* --device gpu either trains on a GPU or, where there is none at all (no
 * driver, no device, a build without CUDA: cnn_cuda_absent), stops at once
 * with exit 69 (CNN_EXIT_NO_GPU) and "no GPU: <why>": never a crash, never
 * a silent fall back to the CPU. Exit 1 (a GPU present but unusable) is a
 * failure here, whichever machine runs the test. --device auto runs. */
START_TEST(test_device_gpu_or_clear_error) {
  char *gpu[] = {(char *)bin("cifar_worker"), "--bench", "--bench-steps", "1", "--batch", "4",
                 "--threads", "1", "--device", "gpu", NULL};
  char *out;
  int rc = run(gpu, &out, 120);
  if (rc == 0) {
    ck_assert_msg(strstr(out, "device gpu") && strstr(out, "\"device\":\"cuda\""),
                  "--device gpu ran, but not on a GPU:\n%s", tail_of(out));
  } else {
    ck_assert_msg(rc == 69, "--device gpu: exit %d (want 0 on a GPU, 69 without one):\n%s", rc,
                  tail_of(out));
    ck_assert_msg(strstr(out, "cifar_worker: --device gpu: no GPU: ") != NULL,
                  "no 'no GPU' sentence:\n%s", tail_of(out));
  }
  free(out);
  char *autod[] = {(char *)bin("cifar_worker"), "--bench", "--bench-steps", "1", "--batch", "4",
                   "--threads", "1", "--device", "auto", NULL};
  rc = run(autod, &out, 120);
  ck_assert_msg(rc == 0 && strstr(out, "images_per_sec"), "--device auto: exit %d:\n%s", rc,
                out);
  free(out);
  char *bad[] = {(char *)bin("cifar_worker"), "--bench", "--device", "tpu", NULL};
  rc = run(bad, &out, 60);
  ck_assert_msg(rc == 1 && strstr(out, "--device must be cpu, gpu or auto, got 'tpu'"),
                "bad --device: exit %d:\n%s", rc, tail_of(out));
  free(out);
}
END_TEST

Suite *suite_cifar(void) {
  Suite *s = suite_create("cifar");
  TCase *tc = tcase_create("cifar");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_learns_far_above_chance);
  tcase_add_test(tc, test_two_workers_equal_one_with_double_batch);
  tcase_add_test(tc, test_recipe_options);
  tcase_add_test(tc, test_average_and_eval_views);
  tcase_add_test(tc, test_outputs_refuse_planted_links);
  tcase_add_test(tc, test_preempted_job_resumes_exactly);
  tcase_add_test(tc, test_killed_ps_fails_fast_and_relaunch_resumes);
  tcase_add_test(tc, test_device_gpu_or_clear_error);
  suite_add_tcase(s, tc);
  return s;
}
