/* Integration: real psd processes on 127.0.0.1 and real clients (threads
 * of this process), checking the SyncReplicas semantics end to end. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

#define MAXW 8

/* Starts nps psd processes with extra args; fills hosts. */
static void start_ps(tu_psd *ps, int nps, char hosts[][64], const char **hp,
                     const char *const *extra) {
  for (int i = 0; i < nps; i++) {
    char idx[16], n[16];
    snprintf(idx, sizeof idx, "%d", i);
    snprintf(n, sizeof n, "%d", nps);
    const char *args[32] = {"--ps-index", idx, "--num-ps", n};
    int k = 4;
    for (int j = 0; extra && extra[j] && k < 30; j++) args[k++] = extra[j];
    args[k] = NULL;
    ck_assert_msg(tu_psd_start(&ps[i], args) == 0, "psd %d did not start", i);
  }
  tu_hosts(ps, nps, hosts, hp);
}

static void run_workers(tu_train *t, int n) {
  pthread_t th[MAXW];
  for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, tu_train_worker, &t[i]);
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < n; i++)
    ck_assert_msg(t[i].rc == 0, "worker %d failed: %s (%s)", i, ps_strerror(t[i].rc),
                  t[i].err);
}

/* Starts one psd with extra args and connects a job's only worker to it. */
static ps_client *solo_client(tu_psd *ps, const char *const *extra) {
  static char hosts[1][64];
  static const char *hp[1];
  start_ps(ps, 1, hosts, hp, extra);
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  ps_client *c = NULL;
  char err[256];
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "%s", err);
  return c;
}

static void expect_clean_exit(tu_psd *ps, int nps) {
  for (int i = 0; i < nps; i++) {
    ck_assert_msg(tu_psd_wait(&ps[i], 10) == 0, "psd %d did not exit after all workers finished", i);
    ck_assert_msg(WIFEXITED(ps[i].status) && WEXITSTATUS(ps[i].status) == 0,
                  "psd %d exit status %d", i, WEXITSTATUS(ps[i].status));
  }
}

/* (a) 4 workers x batch b over 2 ps == 1 worker over the 4 batches
 * concatenated, after 20 steps (|diff| <= 1e-5). W is split across both ps
 * and chunked, so slicing is exercised too. */
START_TEST(test_equivalence) {
  enum { NW = 4, NPS = 2, STEPS = 20, B = 16 };
  tu_psd ps[NPS];
  char hosts[NPS][64];
  const char *hp[NPS];
  start_ps(ps, NPS, hosts, hp, NULL);
  tu_train t[NW];
  memset(t, 0, sizeof t);
  for (int i = 0; i < NW; i++) {
    t[i].hosts = hp;
    t[i].num_ps = NPS;
    t[i].num_workers = NW;
    t[i].worker = i;
    t[i].steps = STEPS;
    t[i].batch = B;
    t[i].split_threshold = 32;  /* W (96 bytes) is split over both ps */
    t[i].max_slice_bytes = 20;  /* ... in 5-element chunks */
  }
  run_workers(t, NW);
  expect_clean_exit(ps, NPS);

  /* Reference: one worker, global batch, same optimizers applied locally. */
  float W[TU_D * TU_C], b[TU_C], gW[TU_D * TU_C], gb[TU_C], vb[TU_C] = {0};
  tu_model_init(W, b);
  ps_optimizer ow, ob;
  tu_model_opts(&ow, &ob);
  float loss0 = 0, loss = 0;
  for (int s = 0; s < STEPS; s++) {
    loss = tu_grad(W, b, (uint64_t)s * NW * B, NW * B, gW, gb);
    if (s == 0) loss0 = loss;
    for (int i = 0; i < TU_D * TU_C; i++) W[i] -= (float)ow.lr * gW[i];
    for (int k = 0; k < TU_C; k++) {
      vb[k] = (float)ob.momentum * vb[k] + gb[k];
      b[k] -= (float)ob.lr * vb[k];
    }
  }
  ck_assert_msg(loss < loss0 * 0.8f, "reference did not learn (%g -> %g)", loss0, loss);
  for (int w = 0; w < NW; w++) {
    ck_assert_uint_eq(t[w].final_step, STEPS);
    for (int i = 0; i < TU_D * TU_C; i++)
      ck_assert_msg(fabsf(t[w].W[i] - W[i]) <= 1e-5f, "worker %d W[%d] %g vs %g", w, i,
                    t[w].W[i], W[i]);
    for (int k = 0; k < TU_C; k++)
      ck_assert_msg(fabsf(t[w].b[k] - b[k]) <= 1e-5f, "worker %d b[%d] %g vs %g", w, k,
                    t[w].b[k], b[k]);
  }
}
END_TEST

/* (b) With 3 workers and replicas_to_aggregate 2, a worker whose gradient
 * arrives after the step completed is told it is stale, and training goes
 * on to the end. */
START_TEST(test_backup_stale) {
  enum { NW = 3, STEPS = 10, B = 8 };
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  tu_train t[NW];
  memset(t, 0, sizeof t);
  for (int i = 0; i < NW; i++) {
    t[i].hosts = hp;
    t[i].num_ps = 1;
    t[i].num_workers = NW;
    t[i].worker = i;
    t[i].replicas = 2;
    t[i].steps = STEPS;
    t[i].batch = B;
  }
  t[2].slow = 1;
  static volatile int gate;
  gate = 0;
  for (int i = 0; i < NW; i++) t[i].gate = &gate; /* the slow one joins before training */
  run_workers(t, NW);
  ck_assert_int_ge(t[2].pushes, 1);
  ck_assert_int_eq(t[2].stale, t[2].pushes); /* every late gradient dropped */
  ck_assert_int_eq(t[0].stale, 0);
  ck_assert_uint_eq(t[0].final_step, STEPS);
  expect_clean_exit(ps, 1);
  ck_assert_msg(tu_log_contains(&ps[0], "1 backup workers"), "log does not mention the backup");
}
END_TEST

/* (e) Async mode: every push applied at once; two workers still learn. */
START_TEST(test_async_converges) {
  enum { NW = 2, STEPS = 150, B = 32 };
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  const char *extra[] = {"--mode", "async", NULL};
  start_ps(ps, 1, hosts, hp, extra);
  tu_train t[NW];
  memset(t, 0, sizeof t);
  for (int i = 0; i < NW; i++) {
    t[i].hosts = hp;
    t[i].num_ps = 1;
    t[i].num_workers = NW;
    t[i].worker = i;
    t[i].async_mode = 1;
    t[i].steps = STEPS;
    t[i].batch = B;
  }
  float W0[TU_D * TU_C], b0[TU_C];
  tu_model_init(W0, b0);
  float acc0 = tu_accuracy(W0, b0, 1000000, 5000);
  run_workers(t, NW);
  expect_clean_exit(ps, 1);
  float acc = tu_accuracy(t[0].W, t[0].b, 1000000, 5000);
  ck_assert_msg(acc > 0.9f && acc > acc0 + 0.2f, "async accuracy %.3f (initial %.3f)", acc,
                acc0);
}
END_TEST

/* Every worker may create the same variable; a conflicting shape is an
 * error that names the variable. */
START_TEST(test_conflicting_shape) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c[2];
  for (int i = 0; i < 2; i++) {
    ps_config cfg;
    ps_config_init(&cfg);
    cfg.hosts = hp;
    cfg.num_ps = 1;
    cfg.worker_index = i;
    cfg.num_workers = 2;
    char err[256];
    ck_assert_msg(ps_client_create(&cfg, &c[i], err, sizeof err) == 0, "%s", err);
  }
  int64_t good[2] = {4, 5}, bad[2] = {5, 4};
  ps_init init = PS_SIZED(ps_init, PS_INIT_UNIFORM, -1, 1, 3);
  ps_var *v0, *v1 = NULL;
  ck_assert_int_eq(ps_client_var_create(c[0], "emb", good, 2, &init, NULL, &v0), 0);
  ck_assert_int_eq(ps_client_var_create(c[1], "emb", bad, 2, &init, NULL, &v1), PS_ESHAPE);
  ck_assert_ptr_null(v1);
  ck_assert_msg(strstr(ps_client_errmsg(c[1]), "'emb'") != NULL, "message: %s",
                ps_client_errmsg(c[1]));
  /* The same shape attaches and receives the chief's values. */
  ck_assert_int_eq(ps_client_var_create(c[1], "emb", good, 2, &init, NULL, &v1), 0);
  ck_assert_mem_eq(ps_var_data(v1), ps_var_data(v0), 20 * sizeof(float));
  ps_client_destroy(c[0]);
  ps_client_destroy(c[1]);
  tu_psd_kill(&ps[0]);
}
END_TEST

/* A variable split over two servers that registers on ps 0 and then
 * conflicts on ps 1 is undone without touching freed memory (the slice map
 * once pointed into a freed array here; ASan builds check it), and the
 * client stays usable: the right shape then attaches and gets the values. */
START_TEST(test_conflict_on_later_ps) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  ps_client *c[2];
  for (int i = 0; i < 2; i++) {
    ps_config cfg;
    ps_config_init(&cfg);
    cfg.hosts = hp;
    cfg.num_ps = 2;
    cfg.worker_index = i;
    cfg.num_workers = 2;
    cfg.split_threshold = 64; /* bytes: 16 floats and more are split */
    char err[256];
    ck_assert_msg(ps_client_create(&cfg, &c[i], err, sizeof err) == 0, "%s", err);
  }
  /* The chief puts "pad" on ps 0 and a small "emb" on ps 1. */
  int64_t small[1] = {4}, big[1] = {64};
  ps_init init = PS_SIZED(ps_init, PS_INIT_UNIFORM, -1, 1, 3);
  ps_var *pad0, *emb0, *v = NULL;
  ck_assert_int_eq(ps_client_var_create(c[0], "pad", small, 1, &init, NULL, &pad0), 0);
  ck_assert_int_eq(ps_client_var_create(c[0], "emb", small, 1, &init, NULL, &emb0), 0);
  /* Worker 1 asks for a big "emb": ps 0 accepts its half, ps 1 refuses. */
  for (int attempt = 0; attempt < 2; attempt++) {
    ck_assert_int_eq(ps_client_var_create(c[1], "emb", big, 1, &init, NULL, &v), PS_ESHAPE);
    ck_assert_ptr_null(v);
    ck_assert_msg(strstr(ps_client_errmsg(c[1]), "'emb'") != NULL, "message: %s",
                  ps_client_errmsg(c[1]));
  }
  /* Its placement was restored: the chief's variables attach where they are. */
  ps_var *pad1, *emb1;
  ck_assert_int_eq(ps_client_var_create(c[1], "pad", small, 1, &init, NULL, &pad1), 0);
  ck_assert_int_eq(ps_client_var_create(c[1], "emb", small, 1, &init, NULL, &emb1), 0);
  uint64_t step = 99;
  ck_assert_int_eq(ps_client_pull(c[1], 0, &step), 0);
  ck_assert_mem_eq(ps_var_data(pad1), ps_var_data(pad0), 4 * sizeof(float));
  ck_assert_mem_eq(ps_var_data(emb1), ps_var_data(emb0), 4 * sizeof(float));
  ps_client_destroy(c[0]);
  ps_client_destroy(c[1]);
  tu_psd_kill(&ps[0]);
  tu_psd_kill(&ps[1]);
}
END_TEST

/* --max-memory bounds what registrations may allocate: a variable past it
 * is refused with a sentence, the server stays up, smaller ones still fit. */
START_TEST(test_max_memory) {
  tu_psd ps[1];
  const char *extra[] = {"--max-memory", "2000000", NULL};
  ps_client *c = solo_client(ps, extra);
  int64_t big[1] = {1 << 20}, small[1] = {1000};
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "big", big, 1, NULL, NULL, &v), PS_ETOOBIG);
  ck_assert_msg(strstr(ps_client_errmsg(c), "--max-memory") != NULL, "%s", ps_client_errmsg(c));
  ck_assert_int_eq(ps_client_var_create(c, "small", small, 1, NULL, NULL, &v), 0);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  expect_clean_exit(ps, 1);
}
END_TEST

/* Configuration from the environment psrun sets; a bad variable is named. */
START_TEST(test_client_from_env) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  char err[256];
  ps_client *c = NULL;
  unsetenv("PS_HOSTS");
  ck_assert_int_eq(ps_client_create_from_env(&c, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "PS_HOSTS") != NULL, "%s", err);
  setenv("PS_HOSTS", hp[0], 1);
  setenv("PS_WORKER_INDEX", "x1", 1);
  setenv("PS_NUM_WORKERS", "1", 1);
  ck_assert_int_eq(ps_client_create_from_env(&c, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "PS_WORKER_INDEX='x1'") != NULL, "%s", err);
  setenv("PS_WORKER_INDEX", "0", 1);
  ck_assert_msg(ps_client_create_from_env(&c, err, sizeof err) == 0, "%s", err);
  ck_assert_int_eq(ps_client_num_workers(c), 1);
  ck_assert_int_eq(ps_client_num_ps(c), 1);
  int64_t shape[1] = {3};
  ps_init one = PS_SIZED(ps_init, PS_INIT_CONSTANT, 1.5, 0, 0);
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "v", shape, 1, &one, NULL, &v), 0);
  ck_assert(ps_var_data(v)[2] == 1.5f);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  expect_clean_exit(ps, 1);
}
END_TEST

/* ---- mean variables (PS_OPT_MEAN) ---------------------------------------- */

#define MEAN_N 40 /* split over both ps in 5-element chunks */

typedef struct mean_worker {
  const char **hp;
  int w, nw, replicas, steps;
  volatile int *hold; /* worker 2 with backups: pushes only once released */
  int bind;           /* 1: its own buffer for both data and grad (aliased),
                         2: separate own buffers (ps_var_bind_buffers) */
  int rc, stale;
  char err[256];
  float got[8][MEAN_N]; /* the value pulled after each step */
  uint64_t after[8];    /* the step each ps_client_step returned */
} mean_worker;

/* Worker w's gradient at step s: distinct per worker, step and element. */
static float mean_grad(int w, int s, int i) { return (float)(w * 100 + s) + 0.25f * (float)i; }

static void *mean_run(void *arg) {
  mean_worker *m = arg;
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = m->hp;
  cfg.num_ps = 2;
  cfg.worker_index = m->w;
  cfg.num_workers = m->nw;
  cfg.replicas_to_aggregate = m->replicas;
  cfg.split_threshold = 32;
  cfg.max_slice_bytes = 20;
  ps_client *c = NULL;
  if ((m->rc = ps_client_create(&cfg, &c, m->err, sizeof m->err)) != 0) return NULL;
  int64_t shape[1] = {MEAN_N};
  ps_optimizer o = PS_SIZED(ps_optimizer, .kind = PS_OPT_MEAN);
  ps_var *v;
  if ((m->rc = ps_client_var_create(c, "mean", shape, 1, NULL, &o, &v)) != 0) goto out;
  float own[2][MEAN_N];
  if (m->bind) ps_var_bind_buffers(v, own[0], own[m->bind - 1]);
  uint64_t step = 0;
  for (int s = 0; s < m->steps; s++) {
    while (m->hold && *m->hold) usleep(1000);
    for (int i = 0; i < MEAN_N; i++) ps_var_grad(v)[i] = mean_grad(m->w, (int)step, i);
    ck_assert(!m->bind || ps_var_grad(v) == own[m->bind - 1]);
    int stale = 0;
    if ((m->rc = ps_client_step(c, &step, &stale)) != 0) goto out;
    m->stale += stale;
    m->after[s] = step;
    memcpy(m->got[s], ps_var_data(v), sizeof m->got[s]);
  }
  m->rc = ps_client_finish(c);
out:
  if (m->rc) snprintf(m->err, sizeof m->err, "%s", ps_client_errmsg(c));
  ps_client_destroy(c);
  return NULL;
}

/* 3 workers over 2 ps: after each step every worker holds exactly the mean
 * of the three gradients (no update rule, no learning rate), in the
 * library's buffers (worker 0), in one buffer of the caller's for both
 * gradient and mean (worker 1) and in two of the caller's (worker 2:
 * ps_var_bind_buffers). With backups
 * (replicas 2 of 3) a worker held back until the others finished gets
 * PS_ESTALE, skips ahead, and the value is the mean of the two that came. */
START_TEST(test_mean_variable) {
  enum { STEPS = 5 };
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  mean_worker m[3];
  memset(m, 0, sizeof m);
  pthread_t th[3];
  for (int w = 0; w < 3; w++) {
    m[w] = (mean_worker){.hp = hp, .w = w, .nw = 3, .replicas = 3, .steps = STEPS, .bind = w};
    pthread_create(&th[w], NULL, mean_run, &m[w]);
  }
  for (int w = 0; w < 3; w++) pthread_join(th[w], NULL);
  for (int w = 0; w < 3; w++) {
    ck_assert_msg(m[w].rc == 0, "worker %d: %s", w, m[w].err);
    for (int s = 0; s < STEPS; s++) {
      ck_assert_uint_eq(m[w].after[s], (uint64_t)s + 1);
      for (int i = 0; i < MEAN_N; i++) {
        float want = (mean_grad(0, s, i) + mean_grad(1, s, i) + mean_grad(2, s, i)) / 3.0f;
        ck_assert_msg(fabsf(m[w].got[s][i] - want) <= 1e-5f * fabsf(want),
                      "worker %d step %d [%d]: %g, want the mean %g", w, s, i,
                      m[w].got[s][i], want);
      }
    }
  }
  expect_clean_exit(ps, 2);
}
END_TEST

START_TEST(test_mean_variable_backups) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  static volatile int hold;
  hold = 1;
  mean_worker m[3];
  memset(m, 0, sizeof m);
  pthread_t th[3];
  for (int w = 0; w < 3; w++) {
    m[w] = (mean_worker){.hp = hp, .w = w, .nw = 3, .replicas = 2, .steps = 1};
    if (w == 2) m[w].hold = &hold;
  }
  m[0].steps = m[1].steps = 2;
  for (int w = 0; w < 3; w++) pthread_create(&th[w], NULL, mean_run, &m[w]);
  pthread_join(th[0], NULL);
  pthread_join(th[1], NULL);
  hold = 0; /* worker 2 pushes step 0 after steps 0 and 1 completed */
  pthread_join(th[2], NULL);
  for (int w = 0; w < 3; w++) ck_assert_msg(m[w].rc == 0, "worker %d: %s", w, m[w].err);
  ck_assert_int_eq(m[2].stale, 1);
  ck_assert_uint_eq(m[2].after[0], 2);
  for (int i = 0; i < MEAN_N; i++) {
    float want = (mean_grad(0, 1, i) + mean_grad(1, 1, i)) / 2.0f;
    ck_assert_msg(m[2].got[0][i] == want && m[0].got[1][i] == want,
                  "[%d]: %g and %g, want the mean of workers 0 and 1 at step 1, %g", i,
                  m[2].got[0][i], m[0].got[1][i], want);
  }
  expect_clean_exit(ps, 2);
}
END_TEST

/* A psd that announces protocol 2.4 refuses a mean variable at once,
 * naming the kind and the protocol it needs. */
START_TEST(test_mean_needs_2_5) {
  tu_psd ps[1];
  const char *extra[] = {"--protocol-minor", "4", NULL};
  ps_client *c = solo_client(ps, extra);
  int64_t shape[1] = {4};
  ps_optimizer o = PS_SIZED(ps_optimizer, .kind = PS_OPT_MEAN);
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "m", shape, 1, NULL, &o, &v), PS_EUNSUPPORTED);
  ck_assert_msg(strstr(ps_client_errmsg(c), "optimizer kind mean needs protocol 2.5"),
                "%s", ps_client_errmsg(c));
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  expect_clean_exit(ps, 1);
}
END_TEST

/* A psd that announces protocol 2.5 is never sent what 2.6 added: each of
 * Adagrad, RMSProp, decoupled weight decay, Adam's torch_epsilon and an
 * lr_scale other than 1 fails the creation with PS_EUNSUPPORTED naming the
 * rule or field, the protocol and the server; lr_scale 1, what a 2.5
 * server does anyway, is sent. */
START_TEST(test_new_rules_need_2_6) {
  tu_psd ps[1];
  const char *extra[] = {"--protocol-minor", "5", NULL};
  ps_client *c = solo_client(ps, extra);
  int64_t shape[1] = {4};
  static const char *const what[] = {"optimizer adagrad", "optimizer rmsprop",
                                     "decoupled weight decay", "adam's torch_epsilon",
                                     "lr_scale"};
  for (int i = 0; i < 5; i++) {
    ps_optimizer o;
    ps_optimizer_default(&o, 0.1);
    if (i == 0) o.kind = PS_OPT_ADAGRAD;
    if (i == 1) o.kind = PS_OPT_RMSPROP;
    if (i == 2) o.decoupled_weight_decay = 1;
    if (i == 3) o.kind = PS_OPT_ADAM, o.torch_epsilon = 1;
    if (i == 4) o.lr_scale = 2.0;
    ps_var *v;
    char name[16];
    snprintf(name, sizeof name, "v%d", i);
    ck_assert_int_eq(ps_client_var_create(c, name, shape, 1, NULL, &o, &v), PS_EUNSUPPORTED);
    const char *m = ps_client_errmsg(c);
    char want[96];
    snprintf(want, sizeof want, "variable '%s': %s needs protocol 2.6", name, what[i]);
    ck_assert_msg(strstr(m, want) && strstr(m, "speaks only 2.5") && strstr(m, "ps 0 at"),
                  "%s", m);
  }
  ps_optimizer o;
  ps_optimizer_default(&o, 0.1);
  o.lr_scale = 1.0;
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "one", shape, 1, NULL, &o, &v), 0);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  expect_clean_exit(ps, 1);
}
END_TEST

/* ---- a reply never observes a half-applied update --------------------- */

#define BIG_N (8u << 20) /* 32 MiB: far more than the socket buffers hold */
#define BIG_LR 0.001f

/* Parameter value after s SGD steps of gradient 1 from 0, in the server's
 * float arithmetic. */
/* Moving averages (2.7): the reference of one variable, in double, from
 * the parameters pulled after each step (TF's form: d = min(decay, (1 +
 * t) / (10 + t)) for num_updates; Polyak the mean of w_1..w_t). */
static void avg_ref(int average, double decay, uint64_t t, double *a, const float *w,
                    double *sum, size_t n) {
  for (size_t i = 0; i < n; i++) {
    sum[i] += w[i];
    if (average == PS_AVERAGE_POLYAK) {
      a[i] = sum[i] / (double)t;
      continue;
    }
    double warm = (1.0 + (double)t) / (10.0 + (double)t), d = decay < warm ? decay : warm;
    a[i] = d * a[i] + (1.0 - d) * w[i];
  }
}

/* Each line of a worker's telemetry file carries "pull_bytes":[want]:
 * a training step's PullReplies carry the parameters alone. */
static void expect_pull_bytes(const char *path, uint64_t want, int steps) {
  FILE *f = fopen(path, "r");
  ck_assert_msg(f != NULL, "%s", path);
  char line[1024], key[64];
  snprintf(key, sizeof key, "\"pull_bytes\":[%llu]", (unsigned long long)want);
  int n = 0;
  while (fgets(line, sizeof line, f)) {
    ck_assert_msg(strstr(line, key), "want %s in %s", key, line);
    n++;
  }
  fclose(f);
  ck_assert_int_eq(n, steps);
}

/* A job whose variables keep averages: the averages pulled equal a double
 * reference computed from the parameters pulled after each step (EMA with
 * num_updates, Polyak), start at the initial values, leave ps_var_data and
 * the client's step alone; training steps pull no extra byte; a variable
 * without an average, or a pull while another is in flight, is refused. */
START_TEST(test_average_pull) {
  enum { NE = 300, NP = 7, NN = 5, STEPS = 12 };
  tu_psd ps[1];
  char hosts[1][64], tele[600];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  snprintf(tele, sizeof tele, "%s/avg_tele.jsonl", tu_tmpdir());
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.telemetry = tele;
  ps_client *c = NULL;
  char err[256];
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "%s", err);
  ps_init init = PS_SIZED(ps_init, .kind = PS_INIT_UNIFORM, .a = -1, .b = 1, .seed = 5);
  ps_optimizer oe, op, on;
  ps_optimizer_default(&oe, 0.1);
  oe.average = PS_AVERAGE_EMA_NUM_UPDATES;
  oe.average_decay = 0.99;
  ps_optimizer_default(&op, 0.05);
  op.kind = PS_OPT_MOMENTUM;
  op.average = PS_AVERAGE_POLYAK;
  ps_optimizer_default(&on, 0.1);
  int64_t se[1] = {NE}, sp[1] = {NP}, sn[1] = {NN};
  ps_var *ve, *vp, *vn;
  ck_assert_int_eq(ps_client_var_create(c, "e", se, 1, &init, &oe, &ve), 0);
  ck_assert_int_eq(ps_client_var_create(c, "p", sp, 1, &init, &op, &vp), 0);
  ck_assert_int_eq(ps_client_var_create(c, "n", sn, 1, &init, &on, &vn), 0);
  uint64_t step = 0, got = 99;
  ck_assert_int_eq(ps_client_pull(c, 0, &step), 0);
  static double ae[NE], ap[NP], sume[NE], sump[NP];
  static float oute[NE], outp[NP], keep[NE];
  for (int i = 0; i < NE; i++) ae[i] = ps_var_data(ve)[i];
  for (int i = 0; i < NP; i++) ap[i] = ps_var_data(vp)[i];
  ps_var *both[2] = {ve, vp};
  float *out[2] = {oute, outp};
  /* Before any update the average is the initial values, bit for bit. */
  ck_assert_int_eq(ps_client_pull_average(c, both, 2, out, &got), 0);
  ck_assert_uint_eq(got, 0);
  ck_assert(memcmp(oute, ps_var_data(ve), sizeof oute) == 0);
  for (int s = 0; s < STEPS; s++) {
    for (int i = 0; i < NE; i++) ps_var_grad(ve)[i] = (float)(0.3 + 0.01 * ((i + s) % 7));
    for (int i = 0; i < NP; i++) ps_var_grad(vp)[i] = (float)(i - 3) * 0.2f;
    for (int i = 0; i < NN; i++) ps_var_grad(vn)[i] = 1.0f;
    int stale = 0;
    ck_assert_int_eq(ps_client_step(c, &step, &stale), 0);
    ck_assert_uint_eq(step, (uint64_t)s + 1);
    avg_ref(PS_AVERAGE_EMA_NUM_UPDATES, 0.99, step, ae, ps_var_data(ve), sume, NE);
    avg_ref(PS_AVERAGE_POLYAK, 0, step, ap, ps_var_data(vp), sump, NP);
  }
  memcpy(keep, ps_var_data(ve), sizeof keep);
  ck_assert_int_eq(ps_client_pull_average(c, both, 2, out, &got), 0);
  ck_assert_uint_eq(got, STEPS);
  ck_assert_uint_eq(ps_client_step_current(c), STEPS);
  ck_assert(memcmp(keep, ps_var_data(ve), sizeof keep) == 0); /* parameters untouched */
  for (int i = 0; i < NE; i++)
    ck_assert_msg(fabs(oute[i] - ae[i]) <= 1e-5 * (1.0 + fabs(ae[i])), "e[%d] %.9g vs %.9g", i,
                  oute[i], ae[i]);
  for (int i = 0; i < NP; i++)
    ck_assert_msg(fabs(outp[i] - ap[i]) <= 1e-5 * (1.0 + fabs(ap[i])), "p[%d] %.9g vs %.9g", i,
                  outp[i], ap[i]);
  ck_assert(fabs(oute[0] - keep[0]) > 1e-3); /* an average, not the parameters */
  /* Refusals: no average; another request in flight. */
  float outn[NN];
  float *on1[1] = {outn};
  ck_assert_int_eq(ps_client_pull_average(c, &vn, 1, on1, NULL), PS_EINVAL);
  ck_assert_msg(strstr(ps_client_errmsg(c), "variable 'n' keeps no moving average"), "%s",
                ps_client_errmsg(c));
  ps_req *r;
  ck_assert_int_eq(ps_client_pull_async(c, 0, NULL, 0, &r), 0);
  ck_assert_int_eq(ps_client_pull_average(c, both, 2, out, NULL), PS_ESTATE);
  ck_assert_int_eq(ps_req_wait(r, -1, NULL), 0);
  ps_req_destroy(r);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  expect_clean_exit(ps, 1);
  expect_pull_bytes(tele, (NE + NP + NN) * sizeof(float), STEPS);
}
END_TEST

/* A 2.6 psd (--protocol-minor 6) keeps no averages: a variable asking
 * for one is refused with PS_EUNSUPPORTED naming it, the protocol and the
 * server. */
START_TEST(test_average_needs_2_7) {
  tu_psd ps[1];
  const char *extra[] = {"--protocol-minor", "6", NULL};
  ps_client *c = solo_client(ps, extra);
  int64_t shape[1] = {4};
  ps_optimizer o;
  ps_optimizer_default(&o, 0.1);
  o.average = PS_AVERAGE_EMA;
  o.average_decay = 0.9;
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "avg", shape, 1, NULL, &o, &v), PS_EUNSUPPORTED);
  const char *m = ps_client_errmsg(c);
  ck_assert_msg(strstr(m, "variable 'avg': a moving average (optimizer average) needs protocol "
                          "2.7") && strstr(m, "speaks only 2.6") && strstr(m, "ps 0 at"),
                "%s", m);
  o.average = PS_AVERAGE_NONE;
  ck_assert_int_eq(ps_client_var_create(c, "plain", shape, 1, NULL, &o, &v), 0);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  expect_clean_exit(ps, 1);
}
END_TEST

/* A variable with its own aggregation rule (2.8) is refused by a 2.7 psd,
 * which would aggregate it by the job's rule unseen. */
START_TEST(test_aggregate_needs_2_8) {
  tu_psd ps[1];
  const char *extra[] = {"--protocol-minor", "7", NULL};
  ps_client *c = solo_client(ps, extra);
  int64_t shape[1] = {4};
  ps_optimizer o;
  ps_optimizer_default(&o, 0.1);
  o.kind = PS_OPT_MEAN;
  o.aggregate = PS_AGGREGATE_ALL;
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "all", shape, 1, NULL, &o, &v), PS_EUNSUPPORTED);
  const char *m = ps_client_errmsg(c);
  ck_assert_msg(strstr(m, "variable 'all': an aggregation rule of its own (optimizer aggregate) "
                          "needs protocol 2.8") && strstr(m, "speaks only 2.7"),
                "%s", m);
  o.aggregate = PS_AGGREGATE_JOB;
  ck_assert_int_eq(ps_client_var_create(c, "job", shape, 1, NULL, &o, &v), 0);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  expect_clean_exit(ps, 1);
}
END_TEST

static float big_value(uint64_t s) {
  float v = 0;
  for (uint64_t i = 0; i < s; i++) v -= BIG_LR * 1.0f;
  return v;
}

static ps_client *big_client(const char **hp, int w, ps_var **v) {
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.worker_index = w;
  cfg.num_workers = 3;
  cfg.replicas_to_aggregate = 2;
  ps_client *c;
  char err[256];
  if (ps_client_create(&cfg, &c, err, sizeof err)) return NULL;
  int64_t shape[1] = {BIG_N};
  ps_optimizer o;
  ps_optimizer_default(&o, BIG_LR);
  if (ps_client_var_create(c, "big", shape, 1, NULL, &o, v)) {
    ps_client_destroy(c);
    return NULL;
  }
  return c;
}

static volatile int g_reader_stopped;

static void *big_fast_worker(void *arg) {
  const char **hp = ((const char ***)arg)[0];
  int w = (int)(intptr_t)((void **)arg)[1];
  ps_var *v;
  ps_client *c = big_client(hp, w, &v);
  if (!c) return (void *)1;
  for (size_t i = 0; i < BIG_N; i++) ps_var_grad(v)[i] = 1.0f;
  uint64_t step = 0;
  intptr_t bad = 0;
  for (int i = 0; i < 6 && !bad; i++) {
    while (i == 1 && !g_reader_stopped) {
      struct timespec ts = {0, 5000000};
      nanosleep(&ts, NULL);
    }
    bad = ps_client_step(c, &step, NULL) != 0;
  }
  bad |= ps_client_finish(c) != 0;
  ps_client_destroy(c);
  return (void *)bad;
}

/* A slow reader's pull reply (parameters sent in place) stays a consistent
 * snapshot while the other workers keep updating the slice: the update
 * copies the bytes still queued instead of changing them under the reply,
 * and does not wait for the slow reader either. */
START_TEST(test_consistent_reply_under_updates) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  g_reader_stopped = 0;
  pid_t reader = fork();
  if (reader == 0) {
    ps_var *v;
    ps_client *c = big_client(hp, 2, &v);
    if (!c) _exit(10);
    ps_req *r;
    if (ps_client_pull_async(c, 1, NULL, 0, &r)) _exit(11);
    raise(SIGSTOP); /* not reading: the reply queues up in psd */
    uint64_t step = 0;
    if (ps_req_wait(r, -1, &step)) _exit(12);
    ps_req_destroy(r);
    float want = big_value(step);
    for (size_t i = 0; i < BIG_N; i++)
      if (ps_var_data(v)[i] != want) _exit(13);
    if (ps_client_finish(c)) _exit(14);
    ps_client_destroy(c);
    _exit(0);
  }
  void *args[2][2] = {{hp, (void *)0}, {hp, (void *)1}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, big_fast_worker, args[i]);
  int st;
  ck_assert_int_eq(waitpid(reader, &st, WUNTRACED), reader);
  ck_assert_msg(WIFSTOPPED(st), "reader exited early (status %d)", st);
  struct timespec ts = {0, 200000000}; /* let psd queue the reply */
  nanosleep(&ts, NULL);
  g_reader_stopped = 1;
  for (int i = 0; i < 2; i++) {
    void *bad;
    pthread_join(th[i], &bad);
    ck_assert_msg(bad == NULL, "fast worker %d failed", i);
  }
  kill(reader, SIGCONT);
  ck_assert_int_eq(waitpid(reader, &st, 0), reader);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "reader saw an inconsistent reply (exit %d)", WEXITSTATUS(st));
  expect_clean_exit(ps, 1);
}
END_TEST

#ifdef PS_MALLOC_COUNT_SO
/* Allocations psd made over a whole run of `steps` steps (2 workers, 2 ps:
 * the count of ps 0). */
static long allocs_for(int steps) {
  tu_psd_preload = PS_MALLOC_COUNT_SO;
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  tu_psd_preload = NULL;
  tu_train t[2];
  memset(t, 0, sizeof t);
  for (int i = 0; i < 2; i++) {
    t[i].hosts = hp;
    t[i].num_ps = 2;
    t[i].num_workers = 2;
    t[i].worker = i;
    t[i].steps = steps;
    t[i].batch = 4;
    t[i].split_threshold = 32;
    t[i].max_slice_bytes = 20;
  }
  run_workers(t, 2);
  expect_clean_exit(ps, 2);
  char *log = tu_read_file(ps[0].log_path);
  ck_assert_ptr_nonnull(log);
  char *at = strstr(log, "ALLOCS ");
  ck_assert_msg(at != NULL, "no allocation count in the psd log");
  long n = atol(at + 7);
  free(log);
  return n;
}

/* psd's hot path allocates nothing per step: a run of 200 steps makes no
 * more allocation calls than a run of 5 (small slack for buffers that grow
 * to their high-water mark at different moments). */
START_TEST(test_no_allocation_per_step) {
  long few = allocs_for(5);
  long many = allocs_for(200);
  ck_assert_msg(few > 0, "counting shim not active");
  ck_assert_msg(many <= few + 4, "psd allocated %ld times in 200 steps vs %ld in 5", many,
                few);
}
END_TEST
#endif

Suite *suite_sync(void) {
  Suite *s = suite_create("sync");
  TCase *tc = tcase_create("sync");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_equivalence);
  tcase_add_test(tc, test_backup_stale);
  tcase_add_test(tc, test_async_converges);
  tcase_add_test(tc, test_conflicting_shape);
  tcase_add_test(tc, test_conflict_on_later_ps);
  tcase_add_test(tc, test_client_from_env);
  tcase_add_test(tc, test_mean_variable);
  tcase_add_test(tc, test_mean_variable_backups);
  tcase_add_test(tc, test_mean_needs_2_5);
  tcase_add_test(tc, test_new_rules_need_2_6);
  tcase_add_test(tc, test_average_pull);
  tcase_add_test(tc, test_average_needs_2_7);
  tcase_add_test(tc, test_aggregate_needs_2_8);
  tcase_add_test(tc, test_max_memory);
  tcase_add_test(tc, test_consistent_reply_under_updates);
#ifdef PS_MALLOC_COUNT_SO
  tcase_add_test(tc, test_no_allocation_per_step);
#endif
  suite_add_tcase(s, tc);
  return s;
}
