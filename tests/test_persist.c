/* Integration (psd/persist/persist.c): checkpoints with real psd processes —
 * a resumed run reproduces the uninterrupted one bit for bit, a signal to
 * one ps stops every ps at one step, timed checkpoints stay consistent,
 * a killed ps is noticed fast, and damaged or mismatched checkpoints are
 * refused with the file named; the trust rules of docs/checkpoint.md with
 * another user (nobody, via setpriv) planting files, a second job on the
 * same directory, and --restore=none moving the earlier run aside. */
#include <dirent.h>
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
#include "util.h"

#define MAXPS 2
#define MAXW 3

typedef struct job {
  int nps, nw;
  tu_psd ps[MAXPS];
  char hosts[MAXPS][64];
  const char *hp[MAXPS];
  tu_train t[MAXW];
  pthread_t th[MAXW];
} job;

static const char *ckdir(const char *name) {
  static char buf[4][600];
  static int k;
  char *d = buf[k++ % 4];
  snprintf(d, 600, "%s/ck-%s-%d", tu_tmpdir(), name, rand());
  return d;
}

/* Starts nps psd with --checkpoint-dir dir plus extra args (NULL-ended). */
static void job_start_ps(job *j, int nps, const char *dir, const char *const *extra) {
  j->nps = nps;
  for (int i = 0; i < nps; i++) {
    char idx[8], np[8];
    snprintf(idx, sizeof idx, "%d", i);
    snprintf(np, sizeof np, "%d", nps);
    const char *args[32] = {"--ps-index", idx, "--num-ps", np, "--checkpoint-dir", dir,
                            "--grace-period", "5"};
    int a = 8;
    for (int k = 0; extra && extra[k] && a < 30; k++) args[a++] = extra[k];
    args[a] = NULL;
    ck_assert_msg(tu_psd_start(&j->ps[i], args) == 0, "psd %d did not start", i);
  }
  tu_hosts(j->ps, nps, j->hosts, j->hp);
}

/* replicas_to_aggregate for the next job_start_workers (0: all). */
static int g_replicas;
/* The rules of W and b for the next job_start_workers (NULL: the model's). */
static const ps_optimizer *g_opt_w, *g_opt_b;

static void job_start_workers(job *j, int nw, uint64_t until, int delay_us) {
  j->nw = nw;
  for (int i = 0; i < nw; i++) {
    tu_train *t = &j->t[i];
    memset(t, 0, sizeof *t);
    t->hosts = j->hp;
    t->num_ps = j->nps;
    t->num_workers = nw;
    t->worker = i;
    t->batch = 8;
    t->until = until;
    t->delay_us = delay_us + 4000 * i * (g_replicas > 0); /* backups lag */
    t->replicas = g_replicas;
    t->opt_w = g_opt_w;
    t->opt_b = g_opt_b;
    /* Small slices: every variable spreads over both servers. */
    t->split_threshold = 16;
    t->max_slice_bytes = 16;
    pthread_create(&j->th[i], NULL, tu_train_worker, t);
  }
}

static void job_join(job *j) {
  for (int i = 0; i < j->nw; i++) pthread_join(j->th[i], NULL);
}

/* Workers joined; checks they all succeeded and every psd exited `code`. */
static void job_expect(job *j, int code) {
  for (int i = 0; i < j->nw; i++)
    ck_assert_msg(j->t[i].rc == 0, "worker %d: %s", i, j->t[i].err);
  for (int i = 0; i < j->nps; i++) {
    ck_assert_msg(tu_psd_wait(&j->ps[i], 10) == 0, "psd %d did not exit", i);
    ck_assert_msg(WIFEXITED(j->ps[i].status) && WEXITSTATUS(j->ps[i].status) == code,
                  "psd %d: status 0x%x, want exit %d", i, j->ps[i].status, code);
  }
}

/* Runs a whole job until `until` and returns worker 0's final state. */
static tu_train run_job(const char *dir, uint64_t until, const char *const *extra) {
  job j;
  job_start_ps(&j, 2, dir, extra);
  job_start_workers(&j, 2, until, 0);
  job_join(&j);
  job_expect(&j, 0);
  ck_assert_msg(tu_params_equal(&j.t[0], &j.t[1]), "workers disagree");
  return j.t[0];
}

/* The step N in the first "needle N" of a psd log (or -1). */
static long log_number(const tu_psd *p, const char *needle) {
  char *s = tu_read_file(p->log_path);
  long v = -1;
  char *at = s ? strstr(s, needle) : NULL;
  if (at) v = strtol(at + strlen(needle), NULL, 10);
  free(s);
  return v;
}

/* Servers restoring from d refuse the variable `name` of that shape and
 * optimizer, with a message naming the checkpoint and `needle`. */
static void restore_refuses(const char *d, const char *name, const int64_t *shape, int ndim,
                            const ps_optimizer *opt, const char *needle) {
  job j;
  job_start_ps(&j, 2, d, NULL);
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = j.hp;
  cfg.num_ps = 2;
  cfg.num_workers = 1;
  cfg.split_threshold = 16;
  cfg.max_slice_bytes = 16;
  ps_client *c;
  char err[512];
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "%s", err);
  ps_var *v;
  ps_init zero = PS_SIZED(ps_init, PS_INIT_ZEROS, 0, 0, 0);
  int rc = ps_client_var_create(c, name, shape, ndim, &zero, opt, &v);
  ck_assert_int_ne(rc, 0);
  const char *m = ps_client_errmsg(c);
  ck_assert_msg(strstr(m, "checkpoint") && strstr(m, d) && strstr(m, needle), "%s", m);
  ps_client_destroy(c);
  for (int i = 0; i < 2; i++) tu_psd_kill(&j.ps[i]);
}

/* 12 steps, or 6, a restart on the same directory and 6 more: the same
 * parameters, bit for bit (the optimizer state was restored exactly).
 * Returns the directory of the resumed run. */
static const char *resume_matches_uninterrupted(void) {
  tu_train full = run_job(ckdir("full"), 12, NULL);
  ck_assert_uint_eq(full.final_step, 12);
  const char *d = ckdir("resume");
  const char *every[] = {"--checkpoint-every", "4", NULL};
  tu_train first = run_job(d, 6, every);
  ck_assert_uint_eq(first.final_step, 6);
  ck_assert_msg(!tu_params_equal(&first, &full), "6 steps must differ from 12");
  /* A new job on the same directory: every ps restores step 6 (the final
   * checkpoint written when the workers finished), the workers resume. */
  job j;
  job_start_ps(&j, 2, d, every);
  job_start_workers(&j, 2, 12, 0);
  job_join(&j);
  job_expect(&j, 0);
  for (int i = 0; i < 2; i++)
    ck_assert_msg(log_number(&j.ps[i], "restoring step ") == 6, "ps %d did not restore 6", i);
  ck_assert_msg(tu_params_equal(&j.t[0], &full),
                "resumed parameters differ from the uninterrupted run's (W[0] %.9g vs %.9g)",
                j.t[0].W[0], full.W[0]);
  /* The moving averages too (zeros when the rules keep none). */
  ck_assert_msg(memcmp(j.t[0].avg_W, full.avg_W, sizeof full.avg_W) == 0 &&
                    memcmp(j.t[0].avg_b, full.avg_b, sizeof full.avg_b) == 0,
                "resumed averages differ (W[0] %.9g vs %.9g)", j.t[0].avg_W[0], full.avg_W[0]);
  return d;
}

/* The model's rules: plain SGD and momentum. */
START_TEST(resume_reproduces_uninterrupted) { resume_matches_uninterrupted(); }
END_TEST

/* The 2.6 rules keep their state in checkpoints: W with Adagrad (its
 * accumulator, started at 0.1), b with centered RMSProp with momentum
 * (three state floats per element). */
START_TEST(resume_keeps_adagrad_and_rmsprop_state) {
  ps_optimizer ow, ob;
  ps_optimizer_default(&ow, 0.1);
  ow.kind = PS_OPT_ADAGRAD;
  ow.initial_accumulator = 0.1;
  ow.epsilon = 1e-10;
  ps_optimizer_default(&ob, 0.01);
  ob.kind = PS_OPT_RMSPROP;
  ob.alpha = 0.9;
  ob.momentum = 0.9;
  ob.centered = 1;
  ob.weight_decay = 0.01;
  ob.decoupled_weight_decay = 1;
  g_opt_w = &ow;
  g_opt_b = &ob;
  const char *d = resume_matches_uninterrupted();
  g_opt_w = g_opt_b = NULL;
  /* The same rule with other state (not centered: 2 floats) is refused. */
  ob.centered = 0;
  int64_t shape[1] = {TU_C};
  restore_refuses(d, "b", shape, 1, &ob, "rmsprop keeping 3 state floats per element");
}
END_TEST

/* Moving averages (2.7) are state floats too: W's EMA with num_updates
 * over Adam, b's Polyak mean over momentum resume bit-identical (and are
 * averages: not the parameters); an average dropped on resume is refused. */
START_TEST(resume_keeps_average) {
  ps_optimizer ow, ob;
  ps_optimizer_default(&ow, 0.01);
  ow.kind = PS_OPT_ADAM;
  ow.average = PS_AVERAGE_EMA_NUM_UPDATES;
  ow.average_decay = 0.999;
  ps_optimizer_default(&ob, 0.1);
  ob.kind = PS_OPT_MOMENTUM;
  ob.average = PS_AVERAGE_POLYAK;
  g_opt_w = &ow;
  g_opt_b = &ob;
  tu_train last = run_job(ckdir("avg"), 3, NULL);
  ck_assert_msg(memcmp(last.avg_W, last.W, sizeof last.W) != 0, "W's average is W");
  const char *d = resume_matches_uninterrupted();
  g_opt_w = g_opt_b = NULL;
  ob.average = PS_AVERAGE_NONE;
  int64_t shape[1] = {TU_C};
  restore_refuses(d, "b", shape, 1, &ob, "momentum keeping 2 state floats per element");
}
END_TEST

/* Trains nw workers (replicas: 0 all) over 2 ps in dir, sends sig to ps
 * `target` mid-run, and checks that every worker got PS_ESTOPPED, every psd
 * exited 75, and both wrote their file of one step, which it returns. */
static long stop_job(const char *dir, int nw, int replicas, int target, int sig) {
  job j;
  job_start_ps(&j, 2, dir, NULL);
  g_replicas = replicas;
  job_start_workers(&j, nw, 1000000, 10000);
  g_replicas = 0;
  struct timespec ts = {0, 400 * 1000000};
  nanosleep(&ts, NULL);
  kill(j.ps[target].pid, sig);
  job_join(&j);
  for (int i = 0; i < nw; i++) ck_assert_msg(j.t[i].stopped, "worker %d was not stopped", i);
  job_expect(&j, 75);
  long s0 = log_number(&j.ps[0], "stopping on request: checkpoint at step ");
  long s1 = log_number(&j.ps[1], "stopping on request: checkpoint at step ");
  ck_assert_msg(s0 > 0 && s0 == s1, "ps0 stopped at step %ld, ps1 at %ld", s0, s1);
  char f[800];
  for (int i = 0; i < 2; i++) {
    snprintf(f, sizeof f, "%s/step-%012ld/ps-%d-of-2.ckpt", dir, s0, i);
    ck_assert_msg(access(f, F_OK) == 0, "%s is missing", f);
  }
  return s0;
}

START_TEST(signal_to_one_ps_stops_all_at_one_step) {
  const char *d = ckdir("sig");
  long s0 = stop_job(d, 2, 0, 0, SIGUSR1);
  /* Resuming continues from exactly there. */
  job r;
  job_start_ps(&r, 2, d, NULL);
  job_start_workers(&r, 2, (uint64_t)s0 + 3, 0);
  job_join(&r);
  job_expect(&r, 0);
  ck_assert_int_eq(log_number(&r.ps[1], "restoring step "), s0);
  ck_assert_uint_eq(r.t[0].final_step, (uint64_t)s0 + 3);
  /* ... exactly: a checkpoint captured mid-run, slice by slice, resumes to
   * the parameters of a run that was never stopped. */
  tu_train full = run_job(ckdir("sigref"), (uint64_t)s0 + 3, NULL);
  ck_assert_msg(tu_params_equal(&r.t[0], &full), "resumed parameters differ");
}
END_TEST

/* With a backup worker the servers can be a step apart and the slowest
 * worker's gradients are not needed: the stop must still land every ps on
 * one complete step, and every worker must get PS_ESTOPPED. */
START_TEST(stop_with_backup_workers) {
  stop_job(ckdir("backup"), 3, 2, 1, SIGTERM);
}
END_TEST

/* Every step directory holds both servers' files: never a mixed step. */
static int complete_steps(const char *dir, int nps) {
  int n = 0;
  for (long s = 0; s < 2000; s++) {
    char sd[700], f[800];
    snprintf(sd, sizeof sd, "%s/step-%012ld", dir, s);
    struct stat st;
    if (stat(sd, &st) != 0) continue;
    int have = 0;
    for (int i = 0; i < nps; i++) {
      snprintf(f, sizeof f, "%s/ps-%d-of-%d.ckpt", sd, i, nps);
      have += stat(f, &st) == 0;
    }
    ck_assert_msg(have == nps, "step %ld has %d of %d files", s, have, nps);
    n++;
  }
  return n;
}

START_TEST(timed_checkpoints_agree) {
  const char *d = ckdir("timed");
  const char *extra[] = {"--checkpoint-secs", "0.3", "--checkpoint-keep", "1000", NULL};
  job j;
  job_start_ps(&j, 2, d, extra);
  job_start_workers(&j, 2, 100, 15000); /* ~1.5 s */
  job_join(&j);
  job_expect(&j, 0);
  int n = complete_steps(d, 2);
  ck_assert_msg(n >= 3, "only %d checkpoints in ~1.5 s at one per 0.3 s", n);
}
END_TEST

START_TEST(killed_ps_is_noticed_fast) {
  job j;
  job_start_ps(&j, 2, ckdir("kill"), NULL);
  job_start_workers(&j, 2, 1000000, 10000);
  struct timespec ts = {0, 300 * 1000000};
  nanosleep(&ts, NULL);
  double t0 = (double)time(NULL);
  char addr[64];
  snprintf(addr, sizeof addr, "ps 1 at %.50s", j.ps[1].addr);
  tu_psd_kill(&j.ps[1]);
  job_join(&j);
  ck_assert_msg((double)time(NULL) - t0 <= 5, "workers took more than 5 s to notice");
  for (int i = 0; i < 2; i++) {
    ck_assert_msg(j.t[i].rc != 0, "worker %d went on without ps 1", i);
    ck_assert_msg(strstr(j.t[i].err, addr), "worker %d: '%s' does not name %s", i, j.t[i].err,
                  addr);
  }
  /* ps 0 loses its workers and exits after the grace period, non-zero. */
  ck_assert_msg(tu_psd_wait(&j.ps[0], 15) == 0, "ps 0 still running");
  ck_assert(WIFEXITED(j.ps[0].status) && WEXITSTATUS(j.ps[0].status) == 66);
}
END_TEST

START_TEST(damaged_checkpoint_is_refused) {
  const char *d = ckdir("dmg");
  const char *every[] = {"--checkpoint-every", "2", NULL};
  run_job(d, 5, every); /* checkpoints 2, 4, and the final 5 */
  char f[800];
  snprintf(f, sizeof f, "%s/step-%012d/ps-1-of-2.ckpt", d, 5);
  FILE *fp = fopen(f, "r+b");
  ck_assert_ptr_nonnull(fp);
  fseek(fp, 90, SEEK_SET);
  fputc('!', fp);
  fclose(fp);
  tu_psd bad;
  const char *args[] = {"--ps-index", "1", "--num-ps", "2", "--checkpoint-dir", d, NULL};
  ck_assert_int_eq(tu_psd_start(&bad, args), -1);
  ck_assert(WIFEXITED(bad.status) && WEXITSTATUS(bad.status) == 65);
  ck_assert_msg(tu_log_contains(&bad, f) && tu_log_contains(&bad, "checksum"),
                "the log does not name %s and the problem", f);
  const char *fb[] = {"--ps-index", "1", "--num-ps", "2", "--checkpoint-dir", d,
                      "--restore", "fallback", NULL};
  ck_assert_int_eq(tu_psd_start(&bad, fb), 0);
  tu_psd_kill(&bad);
  ck_assert_int_eq(log_number(&bad, "restoring step "), 4);
}
END_TEST

START_TEST(other_model_is_refused) {
  const char *d = ckdir("model");
  run_job(d, 3, NULL);
  int64_t shape[2] = {TU_D + 1, TU_C};
  restore_refuses(d, "W", shape, 2, NULL, "elements");
}
END_TEST

/* A chief that created its variables and then hangs (SIGSTOP). */
static pid_t hung_chief(job *j) {
  pid_t pid = fork();
  if (pid == 0) {
    ps_config cfg;
    ps_config_init(&cfg);
    cfg.hosts = j->hp;
    cfg.num_ps = j->nps;
    cfg.num_workers = 1;
    ps_client *c;
    char err[256];
    ps_var *v;
    int64_t shape[1] = {4};
    ps_init zero = PS_SIZED(ps_init, PS_INIT_ZEROS, 0, 0, 0);
    if (ps_client_create(&cfg, &c, err, sizeof err) ||
        ps_client_var_create(c, "x", shape, 1, &zero, NULL, &v))
      _exit(3);
    raise(SIGSTOP);
    _exit(0);
  }
  int st;
  ck_assert_int_eq(waitpid(pid, &st, WUNTRACED), pid);
  ck_assert_msg(WIFSTOPPED(st), "chief exited early (status %d)", st);
  return pid;
}

START_TEST(stop_is_bounded_without_a_chief) {
  job j;
  const char *extra[] = {"--stop-timeout", "1", NULL};
  job_start_ps(&j, 1, ckdir("hung"), extra);
  pid_t chief = hung_chief(&j);
  kill(j.ps[0].pid, SIGTERM);
  ck_assert_msg(tu_psd_wait(&j.ps[0], 5) == 0, "psd waits forever for a hung chief");
  /* Nothing was saved: not 75, which would tell a launcher to requeue. */
  ck_assert(WIFEXITED(j.ps[0].status) && WEXITSTATUS(j.ps[0].status) == 69);
  ck_assert(tu_log_contains(&j.ps[0], "no stop checkpoint within 1 s"));
  ck_assert(tu_log_contains(&j.ps[0], "stopped without a checkpoint (the stop timeout passed)"));
  /* A repeated SIGTERM keeps waiting (the checkpoint may be on its way);
   * SIGINT does not wait at all. */
  job k;
  job_start_ps(&k, 1, ckdir("twice"), NULL);
  kill(chief, SIGKILL);
  waitpid(chief, NULL, 0);
  chief = hung_chief(&k);
  kill(k.ps[0].pid, SIGTERM);
  struct timespec ts = {0, 100 * 1000000};
  nanosleep(&ts, NULL);
  kill(k.ps[0].pid, SIGTERM);
  ck_assert_msg(tu_psd_wait(&k.ps[0], 0.5) == -1, "a repeated SIGTERM ended the stop");
  ck_assert(tu_log_contains(&k.ps[0], "already stopping"));
  kill(k.ps[0].pid, SIGINT);
  ck_assert_msg(tu_psd_wait(&k.ps[0], 2) == 0, "SIGINT did not exit at once");
  ck_assert(WIFEXITED(k.ps[0].status) && WEXITSTATUS(k.ps[0].status) == 69);
  ck_assert(tu_log_contains(&k.ps[0], "while stopping"));
  ck_assert(tu_log_contains(&k.ps[0], "this ps has no checkpoint in"));
  kill(chief, SIGKILL);
  waitpid(chief, NULL, 0);
}
END_TEST

/* 1 when this process can run commands as nobody (root, setpriv
 * installed); persist_users is skipped otherwise. */
static int can_be_nobody(void) {
  return geteuid() == 0 && system("command -v setpriv >/dev/null") == 0;
}
static void as_nobody(const char *cmd) {
  char line[4096];
  snprintf(line, sizeof line,
           "setpriv --reuid=nobody --regid=nogroup --clear-groups sh -c '%s'", cmd);
  ck_assert_msg(system(line) == 0, "as nobody: %s failed", cmd);
}

/* A world-writable sticky directory like /tmp, made under /tmp (nobody
 * cannot reach the private tu_tmpdir()); the test removes it. */
static const char *sticky_parent(void) {
  static char buf[64];
  snprintf(buf, sizeof buf, "/tmp/psd-sticky-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(buf));
  ck_assert_int_eq(chmod(buf, 01777), 0);
  return buf;
}

START_TEST(planted_symlink_in_shared_parent_is_refused) {
  /* attack 5: in a world-writable parent, another user pre-creates the
   * checkpoint directory with the temporary's name as a symlink. */
  const char *par = sticky_parent();
  char cmd[2048], dir[200], victim[200];
  snprintf(victim, sizeof victim, "%s/victim", par);
  FILE *v = fopen(victim, "w");
  fputs("precious", v);
  fclose(v);
  snprintf(dir, sizeof dir, "%s/ck", par);
  snprintf(cmd, sizeof cmd, "mkdir -m 777 %s && mkdir -m 777 %s/step-000000000002 && "
           "ln -s %s %s/step-000000000002/ps-0-of-1.ckpt.tmp", dir, dir, victim, dir);
  as_nobody(cmd);
  tu_psd bad;
  const char *args[] = {"--checkpoint-dir", dir, "--checkpoint-every", "2", NULL};
  ck_assert_int_eq(tu_psd_start(&bad, args), -1);
  ck_assert(WIFEXITED(bad.status) && WEXITSTATUS(bad.status) == 65);
  ck_assert_msg(tu_log_contains(&bad, dir) && tu_log_contains(&bad, "owned by nobody") &&
                tu_log_contains(&bad, "0777"), "the log does not name %s, owner and mode", dir);
  char *after = tu_read_file(victim);
  ck_assert_str_eq(after, "precious");
  free(after);
  /* A directory psd creates itself in the same parent is fine (0700). */
  char mine[200];
  snprintf(mine, sizeof mine, "%s/mine", par);
  const char *ok[] = {"--checkpoint-dir", mine, NULL};
  ck_assert_int_eq(tu_psd_start(&bad, ok), 0);
  tu_psd_kill(&bad);
  struct stat st;
  ck_assert_int_eq(lstat(mine, &st), 0);
  ck_assert_uint_eq(st.st_mode & 07777, 0700);
  snprintf(cmd, sizeof cmd, "rm -rf %s", par);
  ck_assert_int_eq(system(cmd), 0);
}
END_TEST

START_TEST(planted_checkpoint_is_refused) {
  /* attack 6: another user writes a checkpoint into a step directory it
   * can write; psd restores nothing from it. */
  const char *par = sticky_parent();
  char d[200], sd[300], f[400], cmd[2048];
  snprintf(d, sizeof d, "%s/ck", par);
  run_job(d, 3, NULL); /* the final checkpoint: step 3 */
  snprintf(sd, sizeof sd, "%s/step-000000000003", d);
  snprintf(f, sizeof f, "%s/ps-0-of-2.ckpt", sd);
  ck_assert_int_eq(chmod(d, 0711), 0); /* ours, nobody else writes: accepted */
  ck_assert_int_eq(chmod(sd, 0777), 0);
  snprintf(cmd, sizeof cmd, "rm -f %s && head -c 4096 /dev/zero > %s", f, f);
  as_nobody(cmd);
  tu_psd bad;
  const char *args[] = {"--ps-index", "0", "--num-ps", "2", "--checkpoint-dir", d, NULL};
  ck_assert_int_eq(tu_psd_start(&bad, args), -1);
  ck_assert(WIFEXITED(bad.status) && WEXITSTATUS(bad.status) == 65);
  ck_assert_msg(tu_log_contains(&bad, sd) && tu_log_contains(&bad, "writable by its group"),
                "the log does not name %s", sd);
  /* Even once the directory is tightened, the file itself is refused. */
  ck_assert_int_eq(chmod(sd, 0700), 0);
  ck_assert_int_eq(tu_psd_start(&bad, args), -1);
  ck_assert_msg(tu_log_contains(&bad, f) && tu_log_contains(&bad, "planted"),
                "the log does not name %s", f);
  snprintf(cmd, sizeof cmd, "rm -rf %s", par);
  ck_assert_int_eq(system(cmd), 0);
}
END_TEST

START_TEST(second_job_on_a_directory_is_refused) {
  const char *d = ckdir("shared");
  tu_psd a, b;
  const char *args_a[] = {"--checkpoint-dir", d, "--job-id", "7", NULL};
  const char *args_b[] = {"--checkpoint-dir", d, "--job-id", "8", NULL};
  ck_assert_int_eq(tu_psd_start(&a, args_a), 0);
  ck_assert_int_eq(tu_psd_start(&b, args_b), -1);
  ck_assert(WIFEXITED(b.status) && WEXITSTATUS(b.status) == 65);
  char holder[64];
  snprintf(holder, sizeof holder, "pid %ld", (long)a.pid);
  ck_assert_msg(tu_log_contains(&b, "in use by another psd (job 7, ps 0 of 1") &&
                tu_log_contains(&b, holder), "the log does not name the holder");
  tu_psd_kill(&a);
  ck_assert_int_eq(tu_psd_start(&b, args_b), 0); /* the lock died with it */
  tu_psd_kill(&b);
}
END_TEST

/* 1 if DIR has a previous-<run>/step-N directory. */
static int kept_aside(const char *dir, long step) {
  DIR *d = opendir(dir);
  struct dirent *e;
  int found = 0;
  while (d && !found && (e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, "previous-", 9) != 0) continue;
    char p[1200];
    snprintf(p, sizeof p, "%s/%s/step-%012ld", dir, e->d_name, step);
    found = access(p, F_OK) == 0;
  }
  if (d) closedir(d);
  return found;
}

START_TEST(restore_none_moves_the_old_run_aside) {
  /* attack 6: --restore=none into a used directory kept the old run's
   * newer steps, and the next default start resumed the old run. */
  const char *d = ckdir("none");
  const char *every[] = {"--checkpoint-every", "4", NULL};
  run_job(d, 6, every); /* steps 4 and 6 */
  job j;
  const char *none[] = {"--checkpoint-every", "4", "--restore", "none", NULL};
  job_start_ps(&j, 2, d, none);
  job_start_workers(&j, 2, 2, 0);
  job_join(&j);
  job_expect(&j, 0); /* the final checkpoint: step 2 */
  for (int i = 0; i < 2; i++)
    ck_assert_msg(tu_log_contains(&j.ps[i], "not restoring"), "ps %d restored", i);
  ck_assert_msg(tu_log_contains(&j.ps[0], "moved 2 checkpoint step(s)") ||
                    tu_log_contains(&j.ps[1], "moved 2 checkpoint step(s)"),
                "no log line says where the old run went");
  ck_assert_msg(kept_aside(d, 6) && kept_aside(d, 4), "the old run's steps are not kept");
  job k;
  job_start_ps(&k, 2, d, every);
  job_start_workers(&k, 2, 3, 0);
  job_join(&k);
  job_expect(&k, 0);
  for (int i = 0; i < 2; i++)
    ck_assert_msg(log_number(&k.ps[i], "restoring step ") == 2,
                  "ps %d did not continue the new run (step 2)", i);
}
END_TEST

#ifdef PS_SLOWDOWN_SO
/* A disk that takes 250 ms per write or fsync of a checkpoint file. The
 * checkpoint at step 10 then needs seconds; with writes on psd's event loop
 * the workers would wait for all of it. Off the loop they finish the 20
 * steps at once, while every slice of step 10 changes before the writer
 * gets to it (each record is kept as it was at step 10); a job resumed
 * from that checkpoint must end bit-identical to an uninterrupted one. */
START_TEST(slow_disk_never_stalls_training) {
  tu_train full = run_job(ckdir("slowfull"), 20, NULL);
  const char *d = ckdir("slow");
  const char *every[] = {"--checkpoint-every", "10", NULL};
  setenv("PS_SLOW_DISK_MS", "250", 1);
  tu_psd_set_preload(PS_SLOWDOWN_SO);
  job j;
  job_start_ps(&j, 2, d, every);
  tu_psd_set_preload(NULL);
  double t0 = ps__now();
  job_start_workers(&j, 2, 20, 0);
  job_join(&j);
  double train_s = ps__now() - t0;
  job_expect(&j, 0); /* psd exits once both files reached the disk */
  double total_s = ps__now() - t0;
  printf("slow disk: 20 steps in %.3f s; psd done after %.3f s\n", train_s, total_s);
  /* Step 10's file alone is >= 6 slow calls (header, records, trailer,
   * fsyncs): 1.5 s that the workers must not have waited for. */
  ck_assert_msg(total_s >= 1.5, "the shim did not slow the disk (%.3f s)", total_s);
  ck_assert_msg(train_s < tu_time_limit(1.0), "training waited for the disk: %.3f s for 20 steps", train_s);
  for (int i = 0; i < 2; i++)
    ck_assert_msg(tu_log_contains(&j.ps[i], "checkpoint at step 10 written"), "ps %d", i);
  /* Resume from step 10 (drop the final checkpoint) without the shim. */
  char cmd[1400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s/step-000000000020'", d);
  ck_assert_int_eq(system(cmd), 0);
  job r;
  job_start_ps(&r, 2, d, every);
  job_start_workers(&r, 2, 20, 0);
  job_join(&r);
  job_expect(&r, 0);
  for (int i = 0; i < 2; i++)
    ck_assert_msg(log_number(&r.ps[i], "restoring step ") == 10, "ps %d did not restore 10", i);
  ck_assert_msg(tu_params_equal(&r.t[0], &full),
                "resumed from the slow checkpoint, parameters differ (W[0] %.9g vs %.9g)",
                r.t[0].W[0], full.W[0]);
}
END_TEST
#endif

Suite *suite_persist(void) {
  Suite *s = suite_create("persist");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, resume_reproduces_uninterrupted);
  tcase_add_test(tc, resume_keeps_adagrad_and_rmsprop_state);
  tcase_add_test(tc, resume_keeps_average);
  tcase_add_test(tc, signal_to_one_ps_stops_all_at_one_step);
  tcase_add_test(tc, stop_with_backup_workers);
  tcase_add_test(tc, timed_checkpoints_agree);
  tcase_add_test(tc, killed_ps_is_noticed_fast);
  tcase_add_test(tc, damaged_checkpoint_is_refused);
  tcase_add_test(tc, other_model_is_refused);
  tcase_add_test(tc, stop_is_bounded_without_a_chief);
  tcase_add_test(tc, second_job_on_a_directory_is_refused);
  tcase_add_test(tc, restore_none_moves_the_old_run_aside);
#ifdef PS_SLOWDOWN_SO
  tcase_add_test(tc, slow_disk_never_stalls_training);
#endif
  suite_add_tcase(s, tc);
  return s;
}

/* Attacks by another user (nobody, through setpriv): needs root. */
Suite *suite_persist_users(void) {
  if (!can_be_nobody()) {
    printf("SKIP: persist_users: acting as another user needs root and setpriv\n");
    return NULL;
  }
  Suite *s = suite_create("persist_users");
  TCase *tc = tcase_create("nobody");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, planted_symlink_in_shared_parent_is_refused);
  tcase_add_test(tc, planted_checkpoint_is_refused);
  suite_add_tcase(s, tc);
  return s;
}
