/* The API a first user reaches for beyond the quick start, against real psd
 * processes: precise mismatch messages, idempotent create and lookup by
 * name, the current-step getter, failed calls that leave outputs and the
 * previous error's text alone, non-trainable variables and the chief's
 * assign, early pushes of part of a step, and the chief's own initial
 * values. */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

/* A client for worker `index` of `nw` over ps[0..nps); request_ms 0: default. */
static ps_client *connect_worker(const char **hp, int nps, int index, int nw, int request_ms) {
  return tu_client(hp, nps, index, nw, 0, request_ms);
}

/* Starts n psd tasks of one job (--num-ps n) plus extra arguments. */
static void start_ps(tu_psd *ps, int n, char hosts[][64], const char **hp, const char *extra) {
  for (int i = 0; i < n; i++) {
    char idx[16], num[16];
    snprintf(idx, sizeof idx, "%d", i);
    snprintf(num, sizeof num, "%d", n);
    const char *args[] = {"--ps-index", idx, "--num-ps", num, extra, NULL};
    ck_assert_msg(tu_psd_start(&ps[i], args) == 0, "psd %d did not start", i);
  }
  tu_hosts(ps, n, hosts, hp);
}

static void stop_ps(tu_psd *ps, int n) {
  for (int i = 0; i < n; i++) tu_psd_kill(&ps[i]);
}

/* The message names both shapes and the worker that registered first,
 * even when that is not the chief. */
START_TEST(shape_conflict_names_both_and_first) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  /* Worker 1 registers first; its wait for the chief's values times out. */
  ps_client *w1 = connect_worker(hp, 1, 1, 2, 500);
  ps_client *w0 = connect_worker(hp, 1, 0, 2, 0);
  int64_t s34[2] = {3, 4}, s44[2] = {4, 4};
  ps_var *v = NULL;
  ck_assert_int_eq(ps_client_var_create(w1, "w", s34, 2, NULL, NULL, &v), PS_ETIMEDOUT);
  int rc = ps_client_var_create(w0, "w", s44, 2, NULL, NULL, &v);
  const char *m = ps_client_errmsg(w0);
  ck_assert_msg(rc == PS_ESHAPE, "rc %d: %s", rc, m);
  ck_assert_msg(strstr(m, "[3, 4]") && strstr(m, "[4, 4]"), "both shapes: %s", m);
  ck_assert_msg(strstr(m, "registered first by worker 1"), "who was first: %s", m);
  ck_assert_msg(strstr(m, "worker 0 asks"), "who asks: %s", m);
  /* The optimizer: which field, both values, who was first. */
  ps_optimizer o1, o0;
  ps_optimizer_default(&o1, 0.1);
  ps_optimizer_default(&o0, 0.2);
  ck_assert_int_eq(ps_client_var_create(w1, "b", s34, 2, NULL, &o1, &v), PS_ETIMEDOUT);
  rc = ps_client_var_create(w0, "b", s34, 2, NULL, &o0, &v);
  m = ps_client_errmsg(w0);
  ck_assert_msg(rc == PS_EMISMATCH, "rc %d: %s", rc, m);
  ck_assert_msg(strstr(m, "lr 0.1 (worker 1, who registered it first) vs 0.2 (worker 0)"),
                "field and values: %s", m);
  o0 = o1;
  o0.kind = PS_OPT_MOMENTUM;
  rc = ps_client_var_create(w0, "b", s34, 2, NULL, &o0, &v);
  ck_assert_msg(rc == PS_EMISMATCH && strstr(ps_client_errmsg(w0), "kind sgd=0"), "%s",
                ps_client_errmsg(w0));
  ps_client_destroy(w0);
  ps_client_destroy(w1);
  stop_ps(ps, 1);
}
END_TEST

/* A second create of a name returns the same handle when everything
 * agrees, and names the differing property otherwise; find looks up. */
START_TEST(create_idempotent_and_find) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = connect_worker(hp, 1, 0, 1, 0);
  int64_t shape[2] = {3, 4}, other[2] = {4, 3};
  ps_init init = PS_SIZED(ps_init, .kind = PS_INIT_UNIFORM, .a = -1, .b = 1, .seed = 7);
  ps_optimizer opt;
  ps_optimizer_default(&opt, 0.1);
  ps_var *v = NULL, *again = NULL;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 2, &init, &opt, &v), 0);
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 2, &init, &opt, &again), 0);
  ck_assert_ptr_eq(again, v);
  ck_assert_ptr_eq(ps_client_var_find(c, "w"), v);
  ck_assert_ptr_null(ps_client_var_find(c, "nope"));
  ck_assert_msg(strstr(ps_client_errmsg(c), "no variable 'nope'"), "%s", ps_client_errmsg(c));
  /* Each differing property is named, with both values; *out untouched. */
  ps_var *sentinel = (ps_var *)&again;
  again = sentinel;
  ck_assert_int_eq(ps_client_var_create(c, "w", other, 2, &init, &opt, &again), PS_ESHAPE);
  ck_assert_msg(strstr(ps_client_errmsg(c), "shape [3, 4]; this call asks for [4, 3]"), "%s",
                ps_client_errmsg(c));
  ck_assert_ptr_eq(again, sentinel);
  ps_optimizer o2 = opt;
  o2.weight_decay = 0.5;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 2, &init, &o2, &again), PS_EMISMATCH);
  ck_assert_msg(strstr(ps_client_errmsg(c), "weight_decay 0 (the first create) vs 0.5 (this call)"),
                "%s", ps_client_errmsg(c));
  ps_init i2 = init;
  i2.seed = 8;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 2, &i2, &opt, &again), PS_EMISMATCH);
  ck_assert_msg(strstr(ps_client_errmsg(c), "initializer seed 7 (the first create) vs 8"), "%s",
                ps_client_errmsg(c));
  ck_assert_ptr_eq(again, sentinel);
  /* 2.6's fields that apply to every rule are compared too; lr_scale 0
   * means 1. */
  o2 = opt;
  o2.decoupled_weight_decay = 1;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 2, &init, &o2, &again), PS_EMISMATCH);
  ck_assert_msg(strstr(ps_client_errmsg(c),
                       "decoupled_weight_decay no (the first create) vs yes (this call)"),
                "%s", ps_client_errmsg(c));
  o2 = opt;
  o2.lr_scale = 1.0;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 2, &init, &o2, &again), 0);
  o2.lr_scale = 0.5;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 2, &init, &o2, &again), PS_EMISMATCH);
  ck_assert_msg(strstr(ps_client_errmsg(c), "lr_scale 1 (the first create) vs 0.5 (this call)"),
                "%s", ps_client_errmsg(c));
  /* 2.7's average too, on every kind, and its decay where it is read. */
  o2 = opt;
  o2.average = PS_AVERAGE_EMA;
  o2.average_decay = 0.9;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 2, &init, &o2, &again), PS_EMISMATCH);
  ck_assert_msg(strstr(ps_client_errmsg(c), "average none (the first create) vs ema (this call)"),
                "%s", ps_client_errmsg(c));
  /* Fields the rule does not use may differ (momentum for SGD). */
  o2 = opt;
  o2.momentum = 0.5;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 2, &init, &o2, &again), 0);
  ck_assert_ptr_eq(again, v);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* The current step follows ps_client_step and ps_client_pull. A failing
 * ps_client_step leaves *step and *stale_out alone. */
START_TEST(step_getter_and_untouched_outputs) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = connect_worker(hp, 1, 0, 1, 0);
  int64_t shape[1] = {4};
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 1, NULL, NULL, &v), 0);
  ck_assert_uint_eq(ps_client_step_current(c), 0);
  uint64_t step = 0;
  int stale = 5;
  for (int i = 0; i < 3; i++) ck_assert_int_eq(ps_client_step(c, &step, &stale), 0);
  ck_assert_uint_eq(step, 3);
  ck_assert_int_eq(stale, 0);
  ck_assert_uint_eq(ps_client_step_current(c), 3);
  uint64_t got = 99;
  ck_assert_int_eq(ps_client_pull(c, 0, &got), 0);
  ck_assert_uint_eq(got, 3);
  /* No --checkpoint-dir: a requested stop fails the step (PS_ESHUTDOWN)
   * after the servers moved on; the caller's outputs stay as they were. */
  ps_client_request_stop(c);
  stale = 7;
  int rc = ps_client_step(c, &step, &stale);
  ck_assert_msg(rc == PS_ESHUTDOWN, "rc %d: %s", rc, ps_client_errmsg(c));
  ck_assert_uint_eq(step, 3);
  ck_assert_int_eq(stale, 7);
  ck_assert_uint_eq(ps_client_step_current(c), 3);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* ps_client_step_push sends part of a step's gradients early; the step
 * pushes the rest and applies both, as one ps_client_step would. A
 * variable pushed twice, one not trainable, or a step other than the
 * early pushes' is refused with a sentence, and the client goes on. */
START_TEST(step_push_early_then_rest) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  ps_client *c = connect_worker(hp, 2, 0, 1, 0);
  int64_t shape[1] = {5};
  ps_init one = PS_SIZED(ps_init, .kind = PS_INIT_CONSTANT, .a = 1);
  ps_optimizer sgd, none;
  ps_optimizer_default(&sgd, 0.5);
  ps_optimizer_default(&none, 0.5);
  none.kind = PS_OPT_NONE;
  ps_var *a, *b, *n;
  ck_assert_int_eq(ps_client_var_create(c, "a", shape, 1, &one, &sgd, &a), 0);
  ck_assert_int_eq(ps_client_var_create(c, "b", shape, 1, &one, &sgd, &b), 0);
  ck_assert_int_eq(ps_client_var_create(c, "n", shape, 1, &one, &none, &n), 0);
  for (int i = 0; i < 5; i++) {
    ps_var_grad(a)[i] = 1;
    ps_var_grad(b)[i] = 2;
  }
  uint64_t step = 0;
  ck_assert_int_eq(ps_client_step_push(c, 0, &a, 1), 0);
  int rc = ps_client_step_push(c, 0, &a, 1);
  ck_assert_msg(rc == PS_EINVAL && strstr(ps_client_errmsg(c), "'a' was already pushed"), "%s",
                ps_client_errmsg(c));
  rc = ps_client_step_push(c, 0, &n, 1);
  ck_assert_msg(rc == PS_EINVAL && strstr(ps_client_errmsg(c), "not trainable"), "%s",
                ps_client_errmsg(c));
  rc = ps_client_step_push(c, 1, &b, 1);
  ck_assert_msg(rc == PS_EINVAL && strstr(ps_client_errmsg(c), "computed at step 0"), "%s",
                ps_client_errmsg(c));
  ck_assert_int_eq(ps_client_step(c, &step, NULL), 0);
  ck_assert_uint_eq(step, 1);
  for (int i = 0; i < 5; i++) {
    ck_assert_float_eq(ps_var_data(a)[i], 0.5f); /* pushed early, once */
    ck_assert_float_eq(ps_var_data(b)[i], 0.0f); /* pushed by the step */
  }
  /* A step other than the early pushes' fails; the next one works. */
  ck_assert_int_eq(ps_client_step_push(c, 1, &b, 1), 0);
  uint64_t wrong = 7;
  rc = ps_client_step(c, &wrong, NULL);
  ck_assert_msg(rc == PS_EINVAL && strstr(ps_client_errmsg(c), "computed at step 1"), "%s",
                ps_client_errmsg(c));
  ck_assert_uint_eq(wrong, 7);
  ck_assert_int_eq(ps_client_step_push(c, 1, &a, 1), 0);
  ck_assert_int_eq(ps_client_step(c, &step, NULL), 0);
  ck_assert_uint_eq(step, 2);
  for (int i = 0; i < 5; i++) ck_assert_float_eq(ps_var_data(a)[i], 0.0f);
  ps_client_destroy(c);
  stop_ps(ps, 2);
}
END_TEST

/* ps_client_var_create_values: the chief's own values reach every worker;
 * a non-finite value or a chief without values is refused naming it, and
 * creating the name again with an initializer is a mismatch. */
START_TEST(create_with_values) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  ps_client *w0 = connect_worker(hp, 2, 0, 2, 0);
  ps_client *w1 = connect_worker(hp, 2, 1, 2, 0);
  int64_t shape[2] = {3, 700}; /* 8400 bytes: split over both ps */
  enum { N = 3 * 700 };
  static float vals[N];
  for (int i = 0; i < N; i++) vals[i] = (float)i * 0.25f;
  ps_var *v0, *v1, *again;
  vals[5] = NAN;
  int rc = ps_client_var_create_values(w0, "w", shape, 2, vals, NULL, &v0);
  ck_assert_msg(rc == PS_EINVAL && strstr(ps_client_errmsg(w0), "initial value 5 is nan"), "%s",
                ps_client_errmsg(w0));
  vals[5] = 1.25f;
  rc = ps_client_var_create_values(w0, "w", shape, 2, NULL, NULL, &v0);
  ck_assert_msg(rc == PS_EINVAL && strstr(ps_client_errmsg(w0), "chief must give"), "%s",
                ps_client_errmsg(w0));
  ck_assert_int_eq(ps_client_var_create_values(w0, "w", shape, 2, vals, NULL, &v0), 0);
  ck_assert_int_eq(ps_client_var_create_values(w1, "w", shape, 2, NULL, NULL, &v1), 0);
  ck_assert_int_eq(memcmp(ps_var_data(v0), vals, sizeof vals), 0);
  ck_assert_int_eq(memcmp(ps_var_data(v1), vals, sizeof vals), 0);
  ck_assert_int_eq(ps_client_var_create_values(w1, "w", shape, 2, NULL, NULL, &again), 0);
  ck_assert_ptr_eq(again, v1);
  rc = ps_client_var_create(w0, "w", shape, 2, NULL, NULL, &again);
  ck_assert_msg(rc == PS_EMISMATCH && strstr(ps_client_errmsg(w0), "the caller's values"), "%s",
                ps_client_errmsg(w0));
  ps_client_destroy(w0);
  ps_client_destroy(w1);
  stop_ps(ps, 2);
}
END_TEST

/* ps_client_close: the connections close at once (psd sees the worker
 * leave), the buffers stay readable, later calls fail with PS_ECLOSED. */
START_TEST(close_keeps_buffers) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, "--grace-period=1");
  ps_client *c = connect_worker(hp, 1, 0, 1, 0);
  int64_t shape[1] = {4};
  ps_init two = PS_SIZED(ps_init, .kind = PS_INIT_CONSTANT, .a = 2);
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 1, &two, NULL, &v), 0);
  ps_client_close(c);
  ps_client_close(c); /* twice is harmless */
  ck_assert_float_eq(ps_var_data(v)[3], 2.0f);
  uint64_t step = 0;
  int rc = ps_client_step(c, &step, NULL);
  ck_assert_msg(rc == PS_ECLOSED, "rc %d: %s", rc, ps_client_errmsg(c));
  /* The worker left without finishing: psd gives up after the grace period. */
  ck_assert_msg(tu_psd_wait(&ps[0], 20) == 0, "psd did not notice the closed connection");
  ck_assert_int_ne(WEXITSTATUS(ps[0].status), 0);
  ps_client_close(NULL);
  ps_client_destroy(c);
}
END_TEST

/* Every failing call sets its own message, never showing the previous
 * error's text. */
START_TEST(each_error_has_its_own_message) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = connect_worker(hp, 1, 0, 1, 0);
  int64_t shape[1] = {4};
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "", shape, 1, NULL, NULL, &v), PS_EINVAL);
  ck_assert_msg(strstr(ps_client_errmsg(c), "name"), "%s", ps_client_errmsg(c));
  ck_assert_int_eq(ps_client_step(c, NULL, NULL), PS_EINVAL);
  ck_assert_msg(strstr(ps_client_errmsg(c), "step is NULL"), "%s", ps_client_errmsg(c));
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 1, NULL, NULL, NULL), PS_EINVAL);
  ck_assert_msg(strstr(ps_client_errmsg(c), "out is NULL"), "%s", ps_client_errmsg(c));
  ck_assert_int_eq(ps_client_pull_async(c, 0, NULL, 0, NULL), PS_EINVAL);
  ck_assert_msg(strstr(ps_client_errmsg(c), "pull_async"), "%s", ps_client_errmsg(c));
  ck_assert_int_eq(ps_client_push_async(c, 0, NULL, 0, NULL), PS_EINVAL);
  ck_assert_msg(strstr(ps_client_errmsg(c), "push_async"), "%s", ps_client_errmsg(c));
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST


/* ---- assign and variables that are not trained -------------------------- */

enum { AW_N = 64 }; /* floats of "w": 4 slices of 16 over 2 ps */

typedef struct aworker {
  const char **hp;     /* the 2 ps */
  int index;           /* 0: the chief */
  int rc;              /* first failure (0: none) */
  char err[512];       /* ... its message */
  float w3[AW_N], w4[AW_N]; /* w as pulled at steps 3 and 4 */
  float bn3[4];        /* bn pulled with min_step 3 */
  uint64_t bn_step;    /* the step that pull returned */
  int push_bn_rc;      /* pushing bn's gradient */
  int assign_rc;       /* worker 1 trying to assign */
  char assign_err[512];
} aworker;

#define AFAIL(a, c, what)                                                          \
  do {                                                                             \
    snprintf((a)->err, sizeof (a)->err, "%s: %s", what, ps_client_errmsg(c));      \
    (a)->rc = -1;                                                                  \
    goto out;                                                                      \
  } while (0)

/* Two workers train "w" (trainable, SGD lr 0.1, gradient 1) and carry "bn"
 * (not trainable); the chief assigns both at step 2. */
static void *assign_worker(void *arg) {
  aworker *a = arg;
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = a->hp;
  cfg.num_ps = 2;
  cfg.worker_index = a->index;
  cfg.num_workers = 2;
  cfg.split_threshold = 64; /* split w over both ps ... */
  cfg.max_slice_bytes = 64; /* ... in 16-float slices */
  cfg.telemetry = "off";
  ps_client *c = NULL;
  if (ps_client_create(&cfg, &c, a->err, sizeof a->err)) {
    a->rc = -1;
    return NULL;
  }
  int64_t wn[1] = {AW_N}, bnn[1] = {4};
  ps_init one = PS_SIZED(ps_init, .kind = PS_INIT_CONSTANT, .a = 1);
  ps_init five = PS_SIZED(ps_init, .kind = PS_INIT_CONSTANT, .a = 5);
  ps_optimizer sgd, none;
  ps_optimizer_default(&sgd, 0.1);
  ps_optimizer_default(&none, 0.0); /* lr 0 is fine for a variable not trained */
  none.kind = PS_OPT_NONE;
  ps_var *w, *bn;
  if (ps_client_var_create(c, "w", wn, 1, &one, &sgd, &w)) AFAIL(a, c, "create w");
  if (ps_client_var_create(c, "bn", bnn, 1, &five, &none, &bn)) AFAIL(a, c, "create bn");
  ps_req *r = NULL;
  a->push_bn_rc = ps_client_push_async(c, 0, &bn, 1, &r);
  uint64_t step = 0;
  for (int i = 0; i < 4; i++) {
    for (int j = 0; j < AW_N; j++) ps_var_grad(w)[j] = 1.0f;
    if (step == 2 && a->index == 0) {
      /* The chief loads values: w from step 3 on, bn at once (step 3). */
      for (int j = 0; j < AW_N; j++) ps_var_data(w)[j] = 100.0f + (float)j;
      for (int j = 0; j < 4; j++) ps_var_data(bn)[j] = (float)(j + 1);
      ps_var *both[2] = {w, bn};
      if (ps_client_var_assign(c, both, 2, ps_client_step_current(c))) AFAIL(a, c, "assign");
    }
    if (step == 2 && a->index == 1) {
      a->assign_rc = ps_client_var_assign(c, &w, 1, step);
      snprintf(a->assign_err, sizeof a->assign_err, "%s", ps_client_errmsg(c));
    }
    if (ps_client_step(c, &step, NULL)) AFAIL(a, c, "step");
    if (step == 3) {
      memcpy(a->w3, ps_var_data(w), sizeof a->w3);
      if (ps_client_pull_async(c, 3, &bn, 1, &r) || ps_req_wait(r, -1, &a->bn_step))
        AFAIL(a, c, "pull bn at 3");
      ps_req_destroy(r);
      memcpy(a->bn3, ps_var_data(bn), sizeof a->bn3);
    }
    if (step == 4) memcpy(a->w4, ps_var_data(w), sizeof a->w4);
  }
  if (ps_client_finish(c)) AFAIL(a, c, "finish");
out:
  ps_client_destroy(c);
  return NULL;
}

/* Every slice on both ps holds the chief's values from the same step on,
 * for every worker; the step's gradients are replaced, later ones apply;
 * a variable that is not trained takes no gradient and is assigned at
 * once; only the chief may assign. */
START_TEST(assign_sync_two_ps) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  aworker a[2];
  pthread_t th[2];
  memset(a, 0, sizeof a);
  for (int i = 0; i < 2; i++) {
    a[i].hp = hp;
    a[i].index = i;
    pthread_create(&th[i], NULL, assign_worker, &a[i]);
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) {
    ck_assert_msg(a[i].rc == 0, "worker %d: %s", i, a[i].err);
    for (int j = 0; j < AW_N; j++) {
      ck_assert_msg(a[i].w3[j] == 100.0f + (float)j, "worker %d w[%d] at step 3: %g", i, j,
                    a[i].w3[j]);
      float want = (100.0f + (float)j) - 0.1f * 1.0f; /* psd's float update */
      ck_assert_msg(a[i].w4[j] == want, "worker %d w[%d] at step 4: %.9g, want %.9g", i, j,
                    a[i].w4[j], want);
    }
    ck_assert_uint_eq(a[i].bn_step, 3);
    for (int j = 0; j < 4; j++) ck_assert_float_eq(a[i].bn3[j], (float)(j + 1));
    ck_assert_int_eq(a[i].push_bn_rc, PS_EINVAL);
  }
  ck_assert_int_eq(a[1].assign_rc, PS_ESTATE);
  ck_assert_msg(strstr(a[1].assign_err, "only the chief (worker 0) assigns"), "%s",
                a[1].assign_err);
  stop_ps(ps, 2);
}
END_TEST

/* An assign for a step the slices are not at changes nothing and says
 * why; async mode applies an assign at once. */
START_TEST(assign_refused_and_async) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = connect_worker(hp, 1, 0, 1, 0);
  int64_t shape[1] = {4};
  ps_var *w;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 1, NULL, NULL, &w), 0);
  uint64_t step = 0;
  for (int i = 0; i < 2; i++) ck_assert_int_eq(ps_client_step(c, &step, NULL), 0);
  float before[4];
  memcpy(before, ps_var_data(w), sizeof before);
  for (int j = 0; j < 4; j++) ps_var_data(w)[j] = 9.0f;
  int rc = ps_client_var_assign(c, &w, 1, 5);
  ck_assert_msg(rc == PS_EINVAL && strstr(ps_client_errmsg(c), "only at step 2"), "%d: %s", rc,
                ps_client_errmsg(c));
  rc = ps_client_var_assign(c, NULL, 0, 1);
  ck_assert_msg(rc == PS_ESTALE && strstr(ps_client_errmsg(c), "at step 2 already"), "%d: %s",
                rc, ps_client_errmsg(c));
  ck_assert_int_eq(ps_client_pull(c, 0, &step), 0);
  ck_assert_uint_eq(step, 2);
  ck_assert_mem_eq(ps_var_data(w), before, sizeof before);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  stop_ps(ps, 1);

  /* Async: the values replace the parameters at once. */
  start_ps(ps, 1, hosts, hp, NULL); /* mode auto: the worker says async */
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.async_mode = 1;
  cfg.telemetry = "off";
  char err[512];
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "%s", err);
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 1, NULL, NULL, &w), 0);
  step = 0;
  ck_assert_int_eq(ps_client_step(c, &step, NULL), 0);
  for (int j = 0; j < 4; j++) ps_var_data(w)[j] = 7.0f;
  ck_assert_int_eq(ps_client_var_assign(c, &w, 1, 12345), 0);
  memset(ps_var_data(w), 0, 4 * sizeof(float));
  ck_assert_int_eq(ps_client_pull(c, 0, NULL), 0);
  for (int j = 0; j < 4; j++) ck_assert_float_eq(ps_var_data(w)[j], 7.0f);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

Suite *suite_api(void) {
  Suite *s = suite_create("api");
  TCase *tc = tcase_create("api");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, shape_conflict_names_both_and_first);
  tcase_add_test(tc, create_idempotent_and_find);
  tcase_add_test(tc, step_getter_and_untouched_outputs);
  tcase_add_test(tc, step_push_early_then_rest);
  tcase_add_test(tc, create_with_values);
  tcase_add_test(tc, close_keeps_buffers);
  tcase_add_test(tc, each_error_has_its_own_message);
  tcase_add_test(tc, assign_sync_two_ps);
  tcase_add_test(tc, assign_refused_and_async);
  suite_add_tcase(s, tc);
  return s;
}
