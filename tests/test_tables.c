/* Sparse embedding tables end to end (protocol 2.2, docs/protocol.md
 * 13c): libpsclient's table calls against real psd processes on
 * 127.0.0.1. Sync equivalence (2 workers x b == 1 worker x 2b, bit for
 * bit, over 1 to 3 ps), keys in any order with duplicates, the
 * initializer's values for keys never stored, read-only pulls, the step
 * with tables (alone and with variables) waiting for them, stale,
 * duplicate and refused pushes (and the step after a refused one), a
 * parked pull replaced by a later one, each update rule against a double
 * reference, configuration errors and mismatches, pulls split into
 * several frames, and a pull abandoned in the middle of its rows. */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h" /* one test looks at a connection's reader */
#include "testutil.h"
#include "tu_stats.h"

/* ---- helpers -------------------------------------------------------------- */

/* Starts n psd tasks of one job plus extra arguments (NULL-terminated). */
static void start_ps(tu_psd *ps, int n, char hosts[][64], const char **hp,
                     const char *const *extra) {
  for (int i = 0; i < n; i++) {
    char idx[16], num[16];
    snprintf(idx, sizeof idx, "%d", i);
    snprintf(num, sizeof num, "%d", n);
    const char *args[16] = {"--ps-index", idx, "--num-ps", num};
    int k = 4;
    for (int j = 0; extra && extra[j] && k < 15; j++) args[k++] = extra[j];
    args[k] = NULL;
    ck_assert_msg(tu_psd_start(&ps[i], args) == 0, "psd %d did not start", i);
  }
  tu_hosts(ps, n, hosts, hp);
}

static void stop_ps(tu_psd *ps, int n) {
  for (int i = 0; i < n; i++) tu_psd_kill(&ps[i]);
}

/* A table config: dim, rule, lr, a large capacity, zeros. */
static ps_table_config tcfg(uint32_t dim, ps_table_opt opt, double lr) {
  ps_table_config g;
  ps_table_config_init(&g);
  g.dim = dim;
  g.capacity = 100000;
  g.opt = opt;
  g.lr = lr;
  return g;
}

static ps_table *create_ok(ps_client *c, const char *name, const ps_table_config *g) {
  ps_table *t = NULL;
  int rc = ps_client_table_create(c, name, g, &t);
  ck_assert_msg(rc == 0, "create '%s': %s (%s)", name, ps_strerror(rc), ps_client_errmsg(c));
  return t;
}

/* Stored rows, admissions and dropped keys of table `name` summed over
 * every ps (psctl's Stats). */
typedef struct tstats {
  uint64_t rows, admissions, dropped, keys_pulled, touches_skipped;
} tstats;

static tstats stats_of(tu_psd *ps, int n, const char *name) {
  tstats s = {0, 0, 0, 0, 0};
  for (int i = 0; i < n; i++) {
    Ps__StatsReply *r = tu_stats(&ps[i]);
    for (size_t j = 0; j < r->n_tables; j++) {
      if (strcmp(r->tables[j]->name, name) != 0) continue;
      s.rows += r->tables[j]->rows;
      s.admissions += r->tables[j]->admissions;
      s.dropped += r->tables[j]->dropped;
      s.keys_pulled += r->tables[j]->keys_pulled;
      s.touches_skipped += r->tables[j]->touches_skipped;
    }
    ps__stats_reply__free_unpacked(r, NULL);
  }
  return s;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- (1) 2 workers x b == 1 worker x 2b, bit for bit ------------------------ */

#define EQ_B 12
#define EQ_STEPS 5
#define EQ_DIM 3
#define EQ_POOL 16
#define EQ_LR 0.25

static const uint64_t eq_pool[EQ_POOL] = {
    1, 2, 3, 5, 8, 13, 21, 34, 55, 89, UINT64_MAX, 1ull << 63, 12345678901234ull, 42, 7, 99};

/* Worker w's i-th key of step s: from a small pool, so duplicates within
 * a worker and across workers are common. */
static int eq_pick(int s, int w, int i) {
  uint64_t x = ps__mix64((uint64_t)s * 1000003u + (uint64_t)w * 7919u + (uint64_t)i + 1);
  return (int)(x % EQ_POOL);
}

/* A gradient that depends on the row pulled, in multiples of 1/64 well
 * below 2^11: every sum of a few of them is exact in float32, whatever the
 * order (so 2 x b and 1 x 2b can agree bit for bit). */
static float eq_grad(uint64_t key, int s, int e, float row) {
  float q = floorf(row * 4.0f) / 64.0f;
  return (float)((int)(key % 7) - 3) / 16.0f + (float)((s + e) % 3) / 32.0f + q;
}

typedef struct eqw {
  const char **hp;
  int nps, nw, worker;
  float final[EQ_POOL * EQ_DIM]; /* every pool key at the end (read-only) */
  float ref[EQ_POOL * EQ_DIM];   /* 1 worker: a local float reference */
  int rc;
  char err[600];
} eqw;

static int eq_fail(eqw *w, ps_client *c, int rc, const char *what) {
  w->rc = rc;
  snprintf(w->err, sizeof w->err, "%s: %s", what, c ? ps_client_errmsg(c) : "no client");
  return rc;
}

/* One step of eq_worker: pull the step's keys, check them against the
 * reference (1 worker), stage the gradients, step. */
static int eq_step(eqw *w, ps_client *c, ps_table *t, int s, uint64_t *step, int *seen) {
  int n = w->nw == 2 ? EQ_B : 2 * EQ_B;
  int idx[2 * EQ_B];
  uint64_t keys[2 * EQ_B];
  float rows[2 * EQ_B * EQ_DIM], grads[2 * EQ_B * EQ_DIM], gsum[EQ_POOL * EQ_DIM];
  for (int i = 0; i < n; i++) {
    idx[i] = w->nw == 2 ? eq_pick(s, w->worker, i) : eq_pick(s, i / EQ_B, i % EQ_B);
    keys[i] = eq_pool[idx[i]];
  }
  uint64_t got = 0;
  int rc = ps_table_pull(t, *step, keys, (size_t)n, rows, 0, &got);
  if (rc) return eq_fail(w, c, rc, "pull");
  if (got != *step) return eq_fail(w, c, PS_EINTERNAL, "pull step");
  memset(gsum, 0, sizeof gsum);
  float scale = w->nw == 2 ? 1.0f : 0.5f; /* one worker's share of the mean */
  for (int i = 0; i < n; i++)
    for (int e = 0; e < EQ_DIM; e++) {
      float *ref = &w->ref[idx[i] * EQ_DIM + e];
      if (!seen[idx[i]]) *ref = rows[i * EQ_DIM + e];
      if (w->nw == 1 && fabsf(*ref - rows[i * EQ_DIM + e]) > 1e-5f) {
        snprintf(w->err, sizeof w->err, "step %d key %llu: row %g, reference %g", s,
                 (unsigned long long)keys[i], rows[i * EQ_DIM + e], *ref);
        return w->rc = PS_EINTERNAL;
      }
      grads[i * EQ_DIM + e] = eq_grad(keys[i], s, e, rows[i * EQ_DIM + e]) * scale;
      gsum[idx[i] * EQ_DIM + e] += grads[i * EQ_DIM + e];
    }
  for (int i = 0; i < n; i++) seen[idx[i]] = 1;
  if ((rc = ps_table_add_grad(t, keys, (size_t)n, grads)) != 0) return eq_fail(w, c, rc, "add");
  if ((rc = ps_client_step(c, step, NULL)) != 0) return eq_fail(w, c, rc, "step");
  for (int j = 0; j < EQ_POOL * EQ_DIM; j++) w->ref[j] -= (float)EQ_LR * gsum[j];
  return 0;
}

static void *eq_worker(void *arg) {
  eqw *w = arg;
  char err[512];
  ps_client *c = tu_client_try(w->hp, w->nps, w->worker, w->nw, 0, 60000, err, sizeof err);
  if (!c) {
    w->rc = PS_ECONNECT;
    snprintf(w->err, sizeof w->err, "%s", err);
    return NULL;
  }
  ps_table_config g = tcfg(EQ_DIM, PS_TOPT_SGD, EQ_LR);
  g.init = (ps_init)PS_SIZED(ps_init, .kind = PS_INIT_UNIFORM, .a = -1, .b = 1, .seed = 7);
  ps_table *t = NULL;
  int rc = ps_client_table_create(c, "emb", &g, &t);
  if (rc) eq_fail(w, c, rc, "create");
  uint64_t step = 0;
  int seen[EQ_POOL] = {0};
  for (int s = 0; !rc && s < EQ_STEPS; s++) {
    rc = eq_step(w, c, t, s, &step, seen);
    if (!rc && step != (uint64_t)s + 1) rc = eq_fail(w, c, PS_EINTERNAL, "step count");
  }
  if (!rc && (rc = ps_table_pull(t, step, eq_pool, EQ_POOL, w->final, PS_TABLE_READ_ONLY,
                                 NULL)) != 0)
    eq_fail(w, c, rc, "final pull");
  ps_client_finish(c);
  ps_client_destroy(c);
  return NULL;
}

/* Runs nw workers (threads) on nps fresh psd processes. */
static void eq_run(int nps, int nw, eqw *w) {
  tu_psd ps[3];
  char hosts[3][64];
  const char *hp[3];
  start_ps(ps, nps, hosts, hp, NULL);
  pthread_t th[2];
  for (int i = 0; i < nw; i++) {
    memset(&w[i], 0, sizeof w[i]);
    w[i] = (eqw){.hp = hp, .nps = nps, .nw = nw, .worker = i};
    pthread_create(&th[i], NULL, eq_worker, &w[i]);
  }
  for (int i = 0; i < nw; i++) pthread_join(th[i], NULL);
  stop_ps(ps, nps);
  for (int i = 0; i < nw; i++)
    ck_assert_msg(w[i].rc == 0, "%d ps, worker %d of %d: %s (%s)", nps, i, nw,
                  ps_strerror(w[i].rc), w[i].err);
}

START_TEST(two_workers_equal_one_worker_bitwise) {
  int nps = 1 + _i; /* 1, 2 and 3 ps */
  eqw two[2], one[1];
  eq_run(nps, 2, two);
  eq_run(nps, 1, one);
  /* The one worker trained as its local reference says (the updates did
   * happen), and the two workers ended with exactly its rows. */
  int moved = 0;
  for (int j = 0; j < EQ_POOL * EQ_DIM; j++) {
    ck_assert_msg(fabsf(one[0].final[j] - one[0].ref[j]) <= 1e-5f, "%d ps: row %d.%d %g vs "
                  "reference %g", nps, j / EQ_DIM, j % EQ_DIM, one[0].final[j], one[0].ref[j]);
    moved += one[0].final[j] != 0;
  }
  ck_assert_int_gt(moved, EQ_POOL);
  ck_assert_msg(memcmp(two[0].final, one[0].final, sizeof one[0].final) == 0,
                "%d ps: 2 workers x b differ from 1 worker x 2b", nps);
  ck_assert(memcmp(two[1].final, one[0].final, sizeof one[0].final) == 0);
}
END_TEST

/* ---- (2) caller's order, duplicates, the initializer ---------------------- */

START_TEST(pull_order_duplicates_and_initializer) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  ps_client *w0 = tu_client(hp, 2, 0, 2, 0, 0), *w1 = tu_client(hp, 2, 1, 2, 0, 0);
  ps_table_config gu = tcfg(5, PS_TOPT_SGD, 0.1), gk = tcfg(2, PS_TOPT_SGD, 0.1);
  gu.init = (ps_init)PS_SIZED(ps_init, .kind = PS_INIT_UNIFORM, .a = -2, .b = 3, .seed = 11);
  gk.init = (ps_init)PS_SIZED(ps_init, .kind = PS_INIT_CONSTANT, .a = 0.75);
  ps_table *u0 = create_ok(w0, "u", &gu), *u1 = create_ok(w1, "u", &gu);
  ps_table *k0 = create_ok(w0, "k", &gk);
  const uint64_t A = 10, B = 1ull << 63, C = 77, D = 5;
  /* Worker 1 sees A first (stored), worker 0 sees B and C first (stored);
   * D is only ever read read-only. */
  uint64_t ka1[] = {A, A}, ka0[] = {C, B, A, A, B}, kb[] = {B, D, C};
  float r1[2 * 5], r0[5 * 5], again[3 * 5], d1[5], d0[5];
  ck_assert_int_eq(ps_table_pull(u1, 0, ka1, 2, r1, 0, NULL), 0);
  ck_assert_int_eq(ps_table_pull(u1, 0, &D, 1, d1, PS_TABLE_READ_ONLY, NULL), 0);
  ck_assert_int_eq(ps_table_pull(u0, 0, ka0, 5, r0, 0, NULL), 0);
  ck_assert_int_eq(ps_table_pull(u0, 0, &D, 1, d0, PS_TABLE_READ_ONLY, NULL), 0);
  ck_assert_int_eq(ps_table_pull(u1, 0, kb, 3, again, PS_TABLE_READ_ONLY, NULL), 0);
  /* Duplicates are one row, in the caller's order. */
  ck_assert(memcmp(r1, r1 + 5, 5 * sizeof(float)) == 0);          /* A, A */
  ck_assert(memcmp(r0 + 10, r0 + 15, 5 * sizeof(float)) == 0);    /* A, A */
  ck_assert(memcmp(r0 + 5, r0 + 20, 5 * sizeof(float)) == 0);     /* B, B */
  /* The same values from either worker, whoever saw the key first, stored
   * or not. */
  ck_assert(memcmp(r1, r0 + 10, 5 * sizeof(float)) == 0);         /* A */
  ck_assert(memcmp(d1, d0, 5 * sizeof(float)) == 0);              /* D */
  ck_assert(memcmp(again, r0 + 5, 5 * sizeof(float)) == 0);       /* B */
  ck_assert(memcmp(again + 5, d1, 5 * sizeof(float)) == 0);       /* D */
  ck_assert(memcmp(again + 10, r0, 5 * sizeof(float)) == 0);      /* C */
  ck_assert_uint_eq(stats_of(ps, 2, "u").rows, 3);                /* A, B, C */
  /* Uniform in [-2, 3), and different keys draw different rows. */
  for (int i = 0; i < 25; i++) ck_assert(r0[i] >= -2.0f && r0[i] < 3.0f);
  ck_assert(memcmp(r0, r0 + 5, 5 * sizeof(float)) != 0);
  ck_assert(memcmp(r0 + 5, r0 + 10, 5 * sizeof(float)) != 0);
  float c2[4 * 2];
  uint64_t kc[] = {D, 0, D, UINT64_MAX};
  ck_assert_int_eq(ps_table_pull(k0, 0, kc, 4, c2, 0, NULL), 0);
  for (int i = 0; i < 8; i++) ck_assert(c2[i] == 0.75f);
  /* n == 0: the table's step only. */
  uint64_t st = 99;
  ck_assert_int_eq(ps_table_pull(u0, 0, NULL, 0, NULL, 0, &st), 0);
  ck_assert_uint_eq(st, 0);
  ps_client_destroy(w0);
  ps_client_destroy(w1);
  stop_ps(ps, 2);
}
END_TEST

/* Gradients of duplicate keys are summed (one worker: the mean over one
 * push is the sum), whatever the order and over 2 ps. */
START_TEST(duplicate_gradients_summed) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 2, 0, 1, 0, 0);
  ps_table_config g = tcfg(2, PS_TOPT_SGD, 1.0);
  ps_table *t = create_ok(c, "s", &g);
  uint64_t big = 0xfedcba9876543210ull;
  uint64_t pk[] = {7, 3, big};
  float rows[3 * 2];
  ck_assert_int_eq(ps_table_pull(t, 0, pk, 3, rows, 0, NULL), 0); /* stores them */
  uint64_t keys[] = {7, 3, 7, big, 7};
  float grads[] = {1, 2, 0.5f, 4, 8, 16, 32, 64, 0.25f, 0.125f};
  ps_req *r = NULL;
  ck_assert_int_eq(ps_table_push_async(t, 0, keys, 5, grads, &r), 0);
  int rc = ps_req_wait(r, -1, NULL);
  ck_assert_msg(rc == 0, "%s", ps_client_errmsg(c));
  ps_req_destroy(r);
  uint64_t q[] = {big, 7, 3, 7};
  float out[4 * 2];
  uint64_t st = 0;
  ck_assert_int_eq(ps_table_pull(t, 1, q, 4, out, 0, &st), 0);
  ck_assert_uint_eq(st, 1);
  ck_assert(out[0] == -32.0f && out[1] == -64.0f);                   /* big */
  ck_assert(out[2] == -(1 + 8 + 0.25f) && out[3] == -(2 + 16 + 0.125f)); /* 7 */
  ck_assert(out[4] == -0.5f && out[5] == -4.0f);                     /* 3 */
  ck_assert(memcmp(out + 2, out + 6, 2 * sizeof(float)) == 0);
  /* Many keys (the radix sort's path), 3000 of 500 distinct ones spread
   * over both ps, through ps_client_step's staging in two calls. */
  enum { N = 3000, U = 500 };
  uint64_t *mk = malloc(N * sizeof *mk), uk[U];
  float *mg = malloc(N * 2 * sizeof *mg), want[U * 2] = {0}, *mo = malloc(U * 2 * sizeof *mo);
  ck_assert(mk && mg && mo);
  for (int u = 0; u < U; u++) uk[u] = ps__mix64((uint64_t)u) ^ ((uint64_t)u << 40);
  for (int i = 0; i < N; i++) {
    int u = (int)(ps__mix64((uint64_t)i + 77) % U);
    mk[i] = uk[u];
    mg[2 * i] = (float)(i % 13) / 8.0f;
    mg[2 * i + 1] = -(float)(i % 5) / 4.0f;
    want[2 * u] -= mg[2 * i];
    want[2 * u + 1] -= mg[2 * i + 1];
  }
  ps_table *m = create_ok(c, "many", &g);
  ck_assert_int_eq(ps_table_pull(m, 0, uk, U, mo, 0, NULL), 0); /* stores them */
  ck_assert_int_eq(ps_table_add_grad(m, mk, N / 3, mg), 0);
  ck_assert_int_eq(ps_table_add_grad(m, mk + N / 3, N - N / 3, mg + 2 * (N / 3)), 0);
  uint64_t step = 1; /* table "s" is at 1; "many" at 0: the step pushes 1 */
  ps_req *pr = NULL;
  ck_assert_int_eq(ps_table_push_async(m, 0, NULL, 0, NULL, &pr), 0); /* "many" to 1 */
  ck_assert_int_eq(ps_req_wait(pr, -1, NULL), 0);
  ps_req_destroy(pr);
  int rc2 = ps_client_step(c, &step, NULL);
  ck_assert_msg(rc2 == 0, "%s", ps_client_errmsg(c));
  ck_assert_uint_eq(step, 2);
  ck_assert_int_eq(ps_table_pull(m, 2, uk, U, mo, PS_TABLE_READ_ONLY, NULL), 0);
  ck_assert(memcmp(mo, want, sizeof want) == 0); /* sums of eighths: exact */
  /* The same rows in one call: written as the push frames' data at once
   * (ps__tpush_prepare), duplicates summed across both ps alike. */
  ck_assert_int_eq(ps_table_add_grad(m, mk, N, mg), 0);
  rc2 = ps_client_step(c, &step, NULL);
  ck_assert_msg(rc2 == 0, "%s", ps_client_errmsg(c));
  ck_assert_uint_eq(step, 3);
  ck_assert_int_eq(ps_table_pull(m, 3, uk, U, mo, PS_TABLE_READ_ONLY, NULL), 0);
  for (int i = 0; i < U * 2; i++)
    ck_assert_msg(mo[i] == 2 * want[i], "row %d element %d: %g, want %g", i / 2, i % 2,
                  (double)mo[i], (double)(2 * want[i]));
  /* Ascending runs (their rows copied as blocks), broken by a repeated
   * key, a descent and the other ps's keys: each row still its own sum. */
  enum { R = 64, RN = R + 3 };
  uint64_t rk[RN], ru[R];
  float rg[RN * 2], rwant[R * 2] = {0}, ro[R * 2];
  for (int u = 0; u < R; u++) ru[u] = 1000 + (uint64_t)u;
  for (int i = 0; i < RN; i++) {
    /* 16 twice (it ends a run of ascending keys on its ps); 41..49 down,
     * then 47..63 up (47, 48, 49 twice); 40 never */
    int u = i < 40 ? i : i == 40 ? 16 : i < 50 ? 90 - i : i - 3;
    rk[i] = ru[u];
    rg[2 * i] = (float)(i + 1);
    rg[2 * i + 1] = -(float)(i % 7);
    rwant[2 * u] -= rg[2 * i];
    rwant[2 * u + 1] -= rg[2 * i + 1];
  }
  ps_table *rt = create_ok(c, "runs", &g);
  ck_assert_int_eq(ps_table_pull(rt, 0, ru, R, ro, 0, NULL), 0); /* stores them */
  ck_assert_int_eq(ps_table_push_async(rt, 0, rk, RN, rg, &pr), 0);
  ck_assert_msg(ps_req_wait(pr, -1, NULL) == 0, "%s", ps_client_errmsg(c));
  ps_req_destroy(pr);
  ck_assert_int_eq(ps_table_pull(rt, 1, ru, R, ro, PS_TABLE_READ_ONLY, NULL), 0);
  for (int i = 0; i < R * 2; i++)
    ck_assert_msg(ro[i] == rwant[i], "run row %d element %d: %g, want %g", i / 2, i % 2,
                  (double)ro[i], (double)rwant[i]);
  free(mk);
  free(mg);
  free(mo);
  ps_client_destroy(c);
  stop_ps(ps, 2);
}
END_TEST

/* ---- (3) read-only pulls store nothing ------------------------------------- */

START_TEST(read_only_pull_creates_no_rows) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 2, 0, 1, 0, 0);
  ps_table_config g = tcfg(1, PS_TOPT_SGD, 1.0);
  ps_table *t = create_ok(c, "ro", &g);
  uint64_t a = 1001, b = 2002;
  float v;
  ck_assert_int_eq(ps_table_pull(t, 0, &a, 1, &v, 0, NULL), 0);
  for (int i = 0; i < 3; i++)
    ck_assert_int_eq(ps_table_pull(t, 0, &b, 1, &v, PS_TABLE_READ_ONLY, NULL), 0);
  tstats s = stats_of(ps, 2, "ro");
  ck_assert_uint_eq(s.rows, 1);
  ck_assert_uint_eq(s.admissions, 1);
  uint64_t keys[] = {a, b};
  float grads[] = {1, 1};
  ps_req *r = NULL;
  ck_assert_int_eq(ps_table_push_async(t, 0, keys, 2, grads, &r), 0);
  ck_assert_int_eq(ps_req_wait(r, -1, NULL), 0);
  ps_req_destroy(r);
  s = stats_of(ps, 2, "ro");
  ck_assert_uint_eq(s.dropped, 1); /* b's gradient: no row */
  ck_assert_uint_eq(s.rows, 1);
  float out[2];
  ck_assert_int_eq(ps_table_pull(t, 1, keys, 2, out, PS_TABLE_READ_ONLY, NULL), 0);
  ck_assert(out[0] == -1.0f); /* a was stored and updated */
  ck_assert(out[1] == 0.0f);  /* b still reads as the initializer */
  ps_client_destroy(c);
  stop_ps(ps, 2);
}
END_TEST

/* ---- (4) ps_client_step with tables ------------------------------------------ */

typedef struct stw {
  const char **hp;
  int nps, worker, steps, delay_ms, dense;
  double first_begin, first_end; /* when the first ps_client_step began, ended */
  float after_first[2]; /* rows of K and L right after it (no wait) */
  float dense_after[4]; /* the variable after the last step */
  uint64_t final_step, pulled_step;
  int rc;
  char err[600];
} stw;

#define ST_K 31337u
#define ST_L 4242u

static void *st_worker(void *arg) {
  stw *w = arg;
  char err[512];
  ps_client *c = tu_client_try(w->hp, w->nps, w->worker, 2, 0, 60000, err, sizeof err);
  if (!c) {
    w->rc = PS_ECONNECT;
    snprintf(w->err, sizeof w->err, "%s", err);
    return NULL;
  }
  ps_table_config g = tcfg(1, PS_TOPT_SGD, 1.0);
  ps_table *t = NULL;
  ps_var *v = NULL;
  int rc = ps_client_table_create(c, "st", &g, &t);
  int64_t shape[1] = {4};
  ps_optimizer o;
  ps_optimizer_default(&o, 0.5);
  if (!rc && w->dense) rc = ps_client_var_create(c, "w", shape, 1, NULL, &o, &v);
  uint64_t step = 0, keys[2] = {ST_K, ST_L};
  for (int s = 0; !rc && s < w->steps; s++) {
    float rows[2], grads[2] = {(float)(w->worker + 1), 1.0f};
    if (s == 0 && w->delay_ms) usleep((useconds_t)w->delay_ms * 1000);
    rc = ps_table_pull(t, step, keys, 2, rows, 0, NULL);
    if (!rc) rc = ps_table_add_grad(t, keys, 1 + (w->worker == 0), grads);
    for (int e = 0; v && e < 4; e++) ps_var_grad(v)[e] = 1.0f;
    if (s == 0) w->first_begin = now_s();
    if (!rc) rc = ps_client_step(c, &step, NULL);
    if (s == 0) w->first_end = now_s();
    if (!rc && s == 0) rc = ps_table_pull(t, 0, keys, 2, w->after_first, 0, NULL);
  }
  if (!rc) rc = ps_client_pull(c, 0, &w->pulled_step);
  if (v) memcpy(w->dense_after, ps_var_data(v), sizeof w->dense_after);
  if (rc) {
    w->rc = rc;
    snprintf(w->err, sizeof w->err, "%s", ps_client_errmsg(c));
  }
  w->final_step = step;
  ps_client_finish(c);
  ps_client_destroy(c);
  return NULL;
}

/* Two workers over 2 ps; worker 1 starts its first step 400 ms late:
 * worker 0's step waits for the table (its rows read right after it,
 * without waiting, hold both gradients). */
static void step_run(int dense, stw *w) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    w[i] = (stw){.hp = hp, .nps = 2, .worker = i, .steps = 4, .dense = dense,
                 .delay_ms = i == 1 ? 400 : 0};
    pthread_create(&th[i], NULL, st_worker, &w[i]);
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++)
    ck_assert_msg(w[i].rc == 0, "worker %d: %s (%s)", i, ps_strerror(w[i].rc), w[i].err);
  for (int i = 0; i < 2; i++) ck_assert_int_eq(tu_psd_wait(&ps[i], 10), 0);
  /* K: mean of 1 and 2 per step; L: only worker 0's 1, over 2 pushes. */
  ck_assert_msg(w[0].first_end >= w[1].first_begin, "worker 0's step ended %.3f s before "
                "worker 1's began: it did not wait for the table",
                w[1].first_begin - w[0].first_end);
  ck_assert_msg(w[0].after_first[0] == -1.5f && w[0].after_first[1] == -0.5f,
                "after step 1: K %g, L %g", w[0].after_first[0], w[0].after_first[1]);
  for (int i = 0; i < 2; i++) {
    ck_assert_uint_eq(w[i].final_step, 4);
    ck_assert_uint_eq(w[i].pulled_step, 4);
  }
}

START_TEST(step_with_tables_only_waits_for_them) {
  stw w[2];
  step_run(0, w);
}
END_TEST

START_TEST(step_with_tables_and_variables) {
  stw w[2];
  step_run(1, w);
  for (int i = 0; i < 2; i++)
    for (int e = 0; e < 4; e++) ck_assert(w[i].dense_after[e] == -2.0f); /* 4 x 0.5 x 1 */
}
END_TEST

/* One psd in async mode (every push applied at once) and its only worker. */
static ps_client *async_solo(tu_psd *ps, char hosts[][64], const char **hp) {
  const char *extra[] = {"--mode", "async", NULL};
  start_ps(ps, 1, hosts, hp, extra);
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.async_mode = 1;
  cfg.telemetry = "off";
  cfg.no_signal_handlers = 1;
  ps_client *c = NULL;
  char err[512];
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "%s", err);
  return c;
}

/* Async mode: each push applied at once, the step is the worker's own. */
START_TEST(step_async_tables) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  ps_client *c = async_solo(ps, hosts, hp);
  ps_table_config g = tcfg(1, PS_TOPT_SGD, 0.5);
  ps_table *t = create_ok(c, "a", &g);
  uint64_t k = 9, step = 0;
  float v, one = 1;
  ck_assert_int_eq(ps_table_pull(t, 0, &k, 1, &v, 0, NULL), 0);
  for (int s = 0; s < 3; s++) {
    ck_assert_int_eq(ps_table_add_grad(t, &k, 1, &one), 0);
    ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "%s", ps_client_errmsg(c));
  }
  ck_assert_uint_eq(step, 3);
  uint64_t got = 0;
  ck_assert_int_eq(ps_table_pull(t, 0, &k, 1, &v, 0, &got), 0);
  ck_assert(v == -1.5f);
  ck_assert_uint_eq(got, 3); /* the table's own count of updates */
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* ---- (5) refused, duplicate and stale pushes --------------------------------- */

START_TEST(refused_push_fails_at_once) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 1, 0, 1, 0, 60000);
  ps_table_config g = tcfg(2, PS_TOPT_SGD, 1.0);
  ps_table *t = create_ok(c, "r", &g);
  uint64_t k = 1;
  float gr[2] = {1, 1};
  ps_req *r = NULL;
  double t0 = now_s();
  ck_assert_int_eq(ps_table_push_async(t, 5, &k, 1, gr, &r), 0);
  int rc = ps_req_wait(r, -1, NULL);
  ps_req_destroy(r);
  const char *m = ps_client_errmsg(c);
  ck_assert_msg(rc == PS_EINVAL, "rc %d: %s", rc, m);
  ck_assert_msg(strstr(m, "for step 5, but the table is only at step 0"), "%s", m);
  ck_assert_msg(strstr(m, "ps 0 at "), "names the server: %s", m);
  /* Through ps_client_step: at once, with the sentence, *step untouched. */
  uint64_t step = 7;
  ck_assert_int_eq(ps_table_add_grad(t, &k, 1, gr), 0);
  rc = ps_client_step(c, &step, NULL);
  m = ps_client_errmsg(c);
  ck_assert_msg(rc == PS_EINVAL && strstr(m, "for step 7, but the table is only at step 0"),
                "rc %d: %s", rc, m);
  ck_assert_uint_eq(step, 7);
  ck_assert_msg(now_s() - t0 < tu_time_limit(5.0), "the refusals took %.1f s", now_s() - t0);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* A step's add_grad writes the table's push straight into the push ring
 * and holds it there until the step sends it: meanwhile other pushes go
 * over TCP, so more than a ring of them (160 MB against 128 MiB: the
 * ring would have wrapped over the held bytes) leaves the table's
 * gradient intact. Over TCP the same steps check nothing more than the
 * sums. Async mode: every push is applied at once. */
START_TEST(held_table_push_survives_other_pushes) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  ps_client *c = async_solo(ps, hosts, hp);
  ps_table_config g = tcfg(4, PS_TOPT_SGD, 1.0);
  ps_table *t = create_ok(c, "held", &g);
  enum { FLOATS = 1 << 20, PUSHES = 40 }; /* 4 MiB a push */
  int64_t shape[1] = {FLOATS};
  ps_optimizer o;
  ps_optimizer_default(&o, 1e-6);
  ps_var *v = NULL;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 1, NULL, &o, &v), 0);
  uint64_t keys[3] = {5, 6, 7}, step = 0;
  float rows[12], g1[12];
  ck_assert_int_eq(ps_table_pull(t, 0, keys, 3, rows, 0, NULL), 0);
  for (int i = 0; i < 12; i++) g1[i] = (float)(i + 1) / 4.0f;
  ck_assert_int_eq(ps_table_add_grad(t, keys, 3, g1), 0);
  for (size_t e = 0; e < FLOATS; e++) ps_var_grad(v)[e] = 0.5f;
  for (int s = 0; s < PUSHES; s++) {
    ps_req *r = NULL;
    ck_assert_int_eq(ps_client_push_async(c, step, NULL, 0, &r), 0);
    ck_assert_msg(ps_req_wait(r, -1, NULL) == 0, "%s", ps_client_errmsg(c));
    ps_req_destroy(r);
  }
  ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "%s", ps_client_errmsg(c));
  ck_assert_int_eq(ps_table_pull(t, 0, keys, 3, rows, 0, NULL), 0);
  for (int i = 0; i < 12; i++)
    ck_assert_msg(rows[i] == -g1[i], "element %d of the rows is %g, want %g", i,
                  (double)rows[i], (double)-g1[i]);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* One psd, its only worker (*c, a 60 s request timeout) and table `name`
 * of dim 1, SGD with lr 1: a row moves by minus each gradient. */
static ps_table *solo_table(tu_psd *ps, char hosts[][64], const char **hp, ps_client **c,
                            const char *name) {
  start_ps(ps, 1, hosts, hp, NULL);
  *c = tu_client(hp, 1, 0, 1, 0, 60000);
  ps_table_config g = tcfg(1, PS_TOPT_SGD, 1.0);
  return create_ok(*c, name, &g);
}

/* An early push of variables (ps_client_step_push, as psd.torch's
 * overlap sends finished buckets) after a table's add_grad moves the
 * table's gradients out of the push ring, which the variables' push then
 * takes: the step applies both, each once. */
START_TEST(step_push_after_add_grad) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  ps_client *c;
  ps_table *t = solo_table(ps, hosts, hp, &c, "e");
  int64_t shape[1] = {4};
  ps_optimizer o;
  ps_optimizer_default(&o, 1.0);
  ps_var *v = NULL;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 1, NULL, &o, &v), 0);
  uint64_t keys[3] = {40, 41, 42}, step = 0;
  float rows[3], g[3] = {0.5f, 0.25f, 2.0f};
  for (int s = 0; s < 2; s++) {
    ck_assert_int_eq(ps_table_pull(t, step, keys, 3, rows, 0, NULL), 0);
    ck_assert_int_eq(ps_table_add_grad(t, keys, 3, g), 0);
    for (int e = 0; e < 4; e++) ps_var_grad(v)[e] = (float)e;
    ck_assert_msg(ps_client_step_push(c, step, &v, 1) == 0, "%s", ps_client_errmsg(c));
    ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "%s", ps_client_errmsg(c));
  }
  ck_assert_int_eq(ps_table_pull(t, step, keys, 3, rows, 0, NULL), 0);
  for (int i = 0; i < 3; i++)
    ck_assert_msg(rows[i] == -2 * g[i], "row %d is %g, want %g", i, (double)rows[i],
                  (double)(-2 * g[i]));
  for (int e = 0; e < 4; e++) ck_assert(ps_var_data(v)[e] == -2.0f * (float)e);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* A step whose push is refused (a NaN gradient) leaves its zero-key pull
 * parked on psd for a step that comes only with the next push: the next
 * step's own pull replaces it (not PS_EBUSY), and that step completes at
 * once with the good gradient applied, the refused one nowhere. */
START_TEST(step_after_refused_push_goes_on) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  ps_client *c;
  ps_table *t = solo_table(ps, hosts, hp, &c, "f");
  uint64_t k = 11, step = 0;
  float v, nan = NAN, one = 1;
  double t0 = now_s();
  ck_assert_int_eq(ps_table_pull(t, 0, &k, 1, &v, 0, NULL), 0); /* stores its row */
  ck_assert_int_eq(ps_table_add_grad(t, &k, 1, &nan), 0);
  int rc = ps_client_step(c, &step, NULL);
  ck_assert_msg(rc == PS_EINVAL && strstr(ps_client_errmsg(c), "NaN"), "rc %d: %s", rc,
                ps_client_errmsg(c));
  ck_assert_uint_eq(step, 0);
  for (int s = 0; s < 2; s++) {
    ck_assert_int_eq(ps_table_add_grad(t, &k, 1, &one), 0);
    rc = ps_client_step(c, &step, NULL);
    ck_assert_msg(rc == 0, "step %d after the refused one: %s (%s)", s, ps_strerror(rc),
                  ps_client_errmsg(c));
  }
  ck_assert_uint_eq(step, 2);
  ck_assert_msg(now_s() - t0 < 5.0, "the steps took %.1f s", now_s() - t0);
  ck_assert_int_eq(ps_table_pull(t, 0, &k, 1, &v, 0, NULL), 0);
  ck_assert_msg(v == -2.0f, "the row is %g: two good gradients of 1 make -2", v);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* One parked pull per table and connection: a later one replaces it, and
 * the earlier one fails at once with PS_EBUSY naming the later request
 * (no request waits for an answer that will not come). */
START_TEST(later_parked_pull_replaces_earlier) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  ps_client *c;
  ps_table *t = solo_table(ps, hosts, hp, &c, "p");
  uint64_t k = 5, got = 0;
  float v = 7, one = 1;
  ps_req *first = NULL, *later = NULL, *push = NULL;
  double t0 = now_s();
  ck_assert_int_eq(ps_table_pull_async(t, 1, &k, 1, &v, 0, &first), 0);
  ck_assert_int_eq(ps_table_pull_async(t, 1, NULL, 0, NULL, 0, &later), 0);
  int rc = ps_req_wait(first, 5000, NULL);
  const char *m = ps_client_errmsg(c);
  ck_assert_msg(rc == PS_EBUSY && strstr(m, "replaced by a later pull"), "rc %d: %s", rc, m);
  ck_assert(v == 7.0f); /* out untouched */
  ck_assert_int_eq(ps_table_push_async(t, 0, &k, 1, &one, &push), 0);
  ck_assert_int_eq(ps_req_wait(push, -1, NULL), 0);
  rc = ps_req_wait(later, 5000, &got);
  ck_assert_msg(rc == 0, "the later pull: %s (%s)", ps_strerror(rc), ps_client_errmsg(c));
  ck_assert_uint_eq(got, 1);
  ck_assert_msg(now_s() - t0 < 5.0, "took %.1f s", now_s() - t0);
  ps_req_destroy(first);
  ps_req_destroy(later);
  ps_req_destroy(push);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

typedef struct dupw {
  const char **hp;
  int nw, replicas, worker, delay_ms;
  uint64_t step;
  int rc;
  char err[600];
} dupw;

/* A worker that takes one plain step on table "d" (after a delay). */
static void *one_step_worker(void *arg) {
  dupw *w = arg;
  char err[512];
  ps_client *c = tu_client_try(w->hp, 1, w->worker, w->nw, w->replicas, 60000, err, sizeof err);
  if (!c) {
    w->rc = PS_ECONNECT;
    snprintf(w->err, sizeof w->err, "%s", err);
    return NULL;
  }
  ps_table_config g = tcfg(1, PS_TOPT_SGD, 1.0);
  ps_table *t = NULL;
  uint64_t k = 3;
  float one = 1;
  int rc = ps_client_table_create(c, "d", &g, &t);
  usleep((useconds_t)w->delay_ms * 1000);
  if (!rc) rc = ps_table_add_grad(t, &k, 1, &one);
  if (!rc) rc = ps_client_step(c, &w->step, NULL);
  if (rc) snprintf(w->err, sizeof w->err, "%s", ps_client_errmsg(c));
  w->rc = rc;
  ps_client_destroy(c);
  return NULL;
}

START_TEST(duplicate_push_is_applied) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 1, 0, 2, 0, 60000);
  ps_table_config g = tcfg(1, PS_TOPT_SGD, 1.0);
  ps_table *t = create_ok(c, "d", &g);
  uint64_t k = 3;
  float one = 1;
  ps_req *r = NULL;
  ck_assert_int_eq(ps_table_push_async(t, 0, &k, 1, &one, &r), 0);
  ck_assert_int_eq(ps_req_wait(r, -1, NULL), 0);
  ps_req_destroy(r);
  ck_assert_int_eq(ps_table_push_async(t, 0, &k, 1, &one, &r), 0);
  int rc = ps_req_wait(r, -1, NULL);
  ps_req_destroy(r);
  ck_assert_msg(rc == PS_EDUPLICATE && strstr(ps_client_errmsg(c), "already pushed"),
                "rc %d: %s", rc, ps_client_errmsg(c));
  /* The step pushes step 0 a third time: a duplicate, counted as applied;
   * it completes when worker 1 (300 ms later) pushes. */
  dupw w1 = {.hp = hp, .nw = 2, .worker = 1, .delay_ms = 300};
  pthread_t th;
  pthread_create(&th, NULL, one_step_worker, &w1);
  uint64_t step = 0;
  int stale = -1;
  ck_assert_int_eq(ps_table_add_grad(t, &k, 1, &one), 0);
  rc = ps_client_step(c, &step, &stale);
  pthread_join(th, NULL);
  ck_assert_msg(rc == 0, "%s", ps_client_errmsg(c));
  ck_assert_msg(w1.rc == 0, "worker 1: %s", w1.err);
  ck_assert_uint_eq(step, 1);
  ck_assert_int_eq(stale, 0);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* 3 workers, 2 replicas: the third's push of step 0 comes after the
 * others completed it. */
START_TEST(stale_push_after_backups_skips_ahead) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 1, 2, 3, 2, 60000);
  ps_table_config g = tcfg(1, PS_TOPT_SGD, 1.0);
  ps_table *t = create_ok(c, "d", &g);
  dupw w[2];
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    w[i] = (dupw){.hp = hp, .nw = 3, .replicas = 2, .worker = i};
    pthread_create(&th[i], NULL, one_step_worker, &w[i]);
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) ck_assert_msg(w[i].rc == 0, "worker %d: %s", i, w[i].err);
  uint64_t k = 3;
  float one = 1;
  ps_req *r = NULL;
  ck_assert_int_eq(ps_table_push_async(t, 0, &k, 1, &one, &r), 0);
  ck_assert_int_eq(ps_req_wait(r, -1, NULL), PS_ESTALE);
  ps_req_destroy(r);
  uint64_t step = 0;
  int stale = 0;
  ck_assert_int_eq(ps_table_add_grad(t, &k, 1, &one), 0);
  int rc = ps_client_step(c, &step, &stale);
  ck_assert_msg(rc == 0, "%s", ps_client_errmsg(c));
  ck_assert_int_eq(stale, 1);
  ck_assert_uint_eq(step, 1);
  float v;
  ck_assert_int_eq(ps_table_pull(t, 1, &k, 1, &v, 0, NULL), 0);
  ck_assert(v == 0.0f); /* never stored: every gradient for it was dropped */
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* ---- (6) the update rules reach the server ----------------------------------- */

/* Two updates of one row with gradients g1, g2 (per element), by the
 * formulas of ps_table_opt in double, from init value w0. */
static void reference(const ps_table_config *g, double w0, const double *gs, int n,
                      double *w) {
  double a = g->initial_accumulator, m = 0, v = 0, z = 0, nn = 0;
  *w = w0;
  for (int t = 1; t <= n; t++) {
    double gr = gs[t - 1];
    if (g->opt == PS_TOPT_ADAGRAD) {
      a += gr * gr;
      *w -= g->lr * gr / (sqrt(a) + g->epsilon);
    } else if (g->opt == PS_TOPT_ADAM) {
      m = g->beta1 * m + (1 - g->beta1) * gr;
      v = g->beta2 * v + (1 - g->beta2) * gr * gr;
      double lr = g->lr * sqrt(1 - pow(g->beta2, t)) / (1 - pow(g->beta1, t));
      *w -= lr * m / (sqrt(v) + g->epsilon);
    } else if (g->opt == PS_TOPT_FTRL) {
      double n_old = nn;
      nn += gr * gr;
      z += gr - (sqrt(nn) - sqrt(n_old)) / g->lr * *w;
      *w = fabs(z) <= g->l1 ? 0
                            : -(z - (z > 0 ? 1 : -1) * g->l1) /
                                  ((g->ftrl_beta + sqrt(nn)) / g->lr + g->l2);
    } else {
      *w -= g->lr * gr;
    }
  }
}

START_TEST(update_rules_match_reference) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 1, 0, 1, 0, 0);
  const ps_table_opt rules[] = {PS_TOPT_ADAGRAD, PS_TOPT_ADAM, PS_TOPT_FTRL};
  const char *names[] = {"adagrad", "adam", "ftrl"};
  const double gs[2][3] = {{0.5, -1.25, 2.0}, {0.75, 0.5, -3.0}}; /* step, element */
  for (int ri = 0; ri < 3; ri++) {
    ps_table_config g = tcfg(3, rules[ri], 0.1);
    if (rules[ri] == PS_TOPT_FTRL) {
      g.l1 = 0.01;
      g.l2 = 0.1;
    } else {
      g.init = (ps_init)PS_SIZED(ps_init, .kind = PS_INIT_CONSTANT, .a = 0.5);
    }
    ps_table *t = create_ok(c, names[ri], &g);
    g.epsilon = rules[ri] == PS_TOPT_ADAGRAD ? 1e-7 : 1e-8; /* the defaults */
    uint64_t k = 123456789;
    float row[3];
    ck_assert_int_eq(ps_table_pull(t, 0, &k, 1, row, 0, NULL), 0);
    for (int s = 0; s < 2; s++) {
      float gr[3] = {(float)gs[s][0], (float)gs[s][1], (float)gs[s][2]};
      ps_req *r = NULL;
      ck_assert_int_eq(ps_table_push_async(t, (uint64_t)s, &k, 1, gr, &r), 0);
      int rc = ps_req_wait(r, -1, NULL);
      ck_assert_msg(rc == 0, "%s: %s", names[ri], ps_client_errmsg(c));
      ps_req_destroy(r);
    }
    ck_assert_int_eq(ps_table_pull(t, 2, &k, 1, row, 0, NULL), 0);
    for (int e = 0; e < 3; e++) {
      double want, g2[2] = {gs[0][e], gs[1][e]};
      reference(&g, rules[ri] == PS_TOPT_FTRL ? 0.0 : 0.5, g2, 2, &want);
      ck_assert_msg(fabs(row[e] - want) <= 1e-5 * (1 + fabs(want)),
                    "%s element %d: server %.9g, reference %.9g", names[ri], e, row[e], want);
    }
  }
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* ---- (7) configuration errors and mismatches --------------------------------- */

/* Creating with cfg fails with code and a message holding `needle`. */
static void expect_bad(ps_client *c, const ps_table_config *g, int code, const char *needle) {
  ps_table *t = (ps_table *)&t, *before = t;
  int rc = ps_client_table_create(c, "bad", g, &t);
  const char *m = ps_client_errmsg(c);
  ck_assert_msg(rc == code, "want %s, got %s: %s", ps_err_name(code), ps_err_name(rc), m);
  ck_assert_msg(strstr(m, needle), "message lacks '%s': %s", needle, m);
  ck_assert_ptr_eq(t, before);
}

START_TEST(bad_configs_are_named) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 1, 0, 1, 0, 0);
  ps_table_config g = tcfg(4, PS_TOPT_SGD, 0.1);
  g.dim = 0;
  expect_bad(c, &g, PS_EINVAL, "dim 0 must be 1 to 65536");
  g.dim = 65537;
  expect_bad(c, &g, PS_EINVAL, "dim 65537");
  g = tcfg(4, PS_TOPT_SGD, 0.1);
  g.capacity = 0;
  expect_bad(c, &g, PS_EINVAL, "capacity");
  g = tcfg(4, PS_TOPT_SGD, 0);
  expect_bad(c, &g, PS_EINVAL, "lr 0");
  g = tcfg(4, PS_TOPT_SGD, INFINITY);
  expect_bad(c, &g, PS_EINVAL, "lr inf");
  g = tcfg(4, PS_TOPT_SGD, 0.1);
  g.init.kind = PS_INIT_GLOROT_UNIFORM;
  expect_bad(c, &g, PS_EINVAL, "Glorot");
  g = tcfg(4, PS_TOPT_SGD, 0.1);
  g.admit_prob = 1.5;
  expect_bad(c, &g, PS_EINVAL, "admit_prob 1.5");
  g = tcfg(4, PS_TOPT_SGD, 0.1);
  g.admit_count = 256;
  expect_bad(c, &g, PS_EINVAL, "admit_count 256");
  g = tcfg(4, PS_TOPT_SGD, 0.1);
  g.beta1 = NAN; /* unused by SGD, but NaN anywhere is refused */
  expect_bad(c, &g, PS_EINVAL, "beta1 is NaN");
  g = tcfg(4, PS_TOPT_ADAM, 0.1);
  g.beta2 = 1.0;
  expect_bad(c, &g, PS_EINVAL, "beta2 1");
  g = tcfg(4, PS_TOPT_SGD, 0.1);
  g.init = (ps_init){.kind = PS_INIT_CONSTANT, .a = 1};
  expect_bad(c, &g, PS_EINVAL, "init.struct_size");
  ps_table_config z;
  memset(&z, 0, sizeof z);
  expect_bad(c, &z, PS_EINVAL, "ps_table_config_init");
  ck_assert_ptr_null(ps_client_table_find(c, "bad"));
  ck_assert_msg(strstr(ps_client_errmsg(c), "no table 'bad'"), "%s", ps_client_errmsg(c));
  /* Nothing reached the server. */
  Ps__StatsReply *r = tu_stats(&ps[0]);
  ck_assert_uint_eq(r->n_tables, 0);
  ps__stats_reply__free_unpacked(r, NULL);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* A table's learning-rate schedule (0.2.8) runs over its step as a
 * variable's: SGD with gradient 1 moves a row by -lr_s at each step s.
 * Step decay (x0.5 every 2 steps), warm-up (over 2 steps) and cosine
 * (to 0 at step 4) against the closed forms; FTRL and bad fields are
 * refused naming them; another schedule is a mismatch; a 2.7 psd refuses
 * a table with one. */
START_TEST(lr_schedule_over_the_table_step) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 1, 0, 1, 0, 0);
  const double pi = 3.14159265358979323846;
  const double want[3][4] = {{0.5, 0.5, 0.25, 0.25},
                             {0.25, 0.5, 0.5, 0.5},
                             {0.5, 0.5 * (1 + cos(pi / 4)) / 2, 0.25, 0.5 * (1 + cos(3 * pi / 4)) / 2}};
  for (int k = 0; k < 3; k++) {
    ps_table_config g = tcfg(2, PS_TOPT_SGD, 0.5);
    if (k == 0) g.decay = PS_DECAY_STEP, g.decay_rate = 0.5, g.decay_steps = 2;
    if (k == 1) g.warmup_steps = 2;
    if (k == 2) g.decay = PS_DECAY_COSINE, g.total_steps = 4;
    char name[16];
    snprintf(name, sizeof name, "sched%d", k);
    ps_table *t = create_ok(c, name, &g);
    uint64_t key = 77;
    float row[2], ones[2] = {1, 1};
    double w = 0;
    ck_assert_int_eq(ps_table_pull(t, 0, &key, 1, row, 0, NULL), 0);
    for (int s = 0; s < 4; s++) {
      ps_req *r = NULL;
      ck_assert_int_eq(ps_table_push_async(t, (uint64_t)s, &key, 1, ones, &r), 0);
      ck_assert_int_eq(ps_req_wait(r, -1, NULL), 0);
      ps_req_destroy(r);
      ck_assert_int_eq(ps_table_pull(t, (uint64_t)s + 1, &key, 1, row, 0, NULL), 0);
      w -= want[k][s];
      ck_assert_msg(fabs(row[0] - w) < 1e-6, "schedule %d step %d: row %.9g, want %.9g", k, s,
                    row[0], w);
    }
    g.decay = PS_DECAY_EXPONENTIAL; /* attach with another schedule */
    g.decay_rate = 0.25, g.decay_steps = 2;
    ps_table *t2;
    ck_assert_int_eq(ps_client_table_create(c, name, &g, &t2), PS_EMISMATCH);
    ck_assert_msg(strstr(ps_client_errmsg(c), "decay"), "%s", ps_client_errmsg(c));
  }
  ps_table_config g = tcfg(2, PS_TOPT_FTRL, 0.5);
  g.warmup_steps = 3;
  expect_bad(c, &g, PS_EINVAL, "FTRL takes no learning-rate schedule");
  g = tcfg(2, PS_TOPT_SGD, 0.5);
  g.decay = PS_DECAY_STEP, g.decay_rate = 1.5, g.decay_steps = 2;
  expect_bad(c, &g, PS_EINVAL, "table 'bad': decay_rate must be in (0, 1] with step decay");
  g = tcfg(2, PS_TOPT_SGD, 0.5);
  g.decay = PS_DECAY_COSINE, g.total_steps = 2, g.warmup_steps = 2;
  expect_bad(c, &g, PS_EINVAL, "total_steps must be > warmup_steps");
  ps_client_destroy(c);
  stop_ps(ps, 1);
  const char *old[] = {"--protocol-minor", "7", NULL};
  start_ps(ps, 1, hosts, hp, old);
  c = tu_client(hp, 1, 0, 1, 0, 0);
  g = tcfg(2, PS_TOPT_SGD, 0.5);
  g.warmup_steps = 2;
  expect_bad(c, &g, PS_EUNSUPPORTED, "a learning-rate schedule needs protocol 2.8");
  g.warmup_steps = 0;
  create_ok(c, "constant", &g);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

START_TEST(create_idempotent_and_mismatch) {
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  ps_client *w0 = tu_client(hp, 2, 0, 2, 0, 0), *w1 = tu_client(hp, 2, 1, 2, 0, 0);
  ps_table_config g = tcfg(4, PS_TOPT_ADAGRAD, 0.1);
  ps_table *t = create_ok(w0, "t", &g), *again = NULL;
  ck_assert_int_eq(ps_client_table_create(w0, "t", &g, &again), 0);
  ck_assert_ptr_eq(again, t);
  ck_assert_ptr_eq(ps_client_table_find(w0, "t"), t);
  ck_assert_str_eq(ps_table_name(t), "t");
  ck_assert_uint_eq(ps_table_dim(t), 4);
  /* This client's own record: the field and both values. */
  ps_table_config g2 = g;
  g2.lr = 0.2;
  ck_assert_int_eq(ps_client_table_create(w0, "t", &g2, &again), PS_EMISMATCH);
  ck_assert_msg(strstr(ps_client_errmsg(w0), "lr 0.1 (the first create) vs 0.2 (this call)"),
                "%s", ps_client_errmsg(w0));
  g2 = g;
  g2.beta1 = 0.5; /* Adagrad does not use it */
  ck_assert_int_eq(ps_client_table_create(w0, "t", &g2, &again), 0);
  /* Another worker: the servers compare, naming the field and both. */
  g2 = g;
  g2.dim = 8;
  int rc = ps_client_table_create(w1, "t", &g2, &again);
  const char *m = ps_client_errmsg(w1);
  ck_assert_msg(rc == PS_EMISMATCH, "rc %d: %s", rc, m);
  ck_assert_msg(strstr(m, "dim is 4 for this server's table, 8 for worker 1"), "%s", m);
  g2 = g;
  g2.lr = 0.2;
  rc = ps_client_table_create(w1, "t", &g2, &again);
  m = ps_client_errmsg(w1);
  ck_assert_msg(rc == PS_EMISMATCH &&
                    strstr(m, "lr is 0.1 for this server's table, 0.2 for worker 1"),
                "rc %d: %s", rc, m);
  ck_assert_ptr_null(ps_client_table_find(w1, "t"));
  ps_table *t1 = create_ok(w1, "t", &g); /* the same: attaches */
  ck_assert_ptr_nonnull(t1);
  /* Names share no space with variables. */
  int64_t shape[1] = {2};
  ps_var *v = NULL;
  ck_assert_int_eq(ps_client_var_create(w0, "t", shape, 1, NULL, NULL, &v), 0);
  ps_client_destroy(w0);
  ps_client_destroy(w1);
  stop_ps(ps, 2);
}
END_TEST

/* ---- (8) big pulls: several frames per ps, and a pull abandoned ------------- */

/* More distinct keys than one TablePull carries (2^22) on one ps: the
 * pull goes out as two frames, the second after the first's rows. */
START_TEST(pull_split_into_frames) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 1, 0, 1, 0, 0);
  ps_table_config g = tcfg(1, PS_TOPT_SGD, 0.1);
  g.init = (ps_init)PS_SIZED(ps_init, .kind = PS_INIT_NORMAL, .a = 0, .b = 1, .seed = 3);
  ps_table *t = create_ok(c, "big", &g);
  size_t n = (1u << 22) + 4321;
  uint64_t *keys = malloc(n * sizeof *keys), *rev = malloc(n * sizeof *rev);
  float *out = malloc(n * sizeof *out), *out2 = malloc(n * sizeof *out2);
  ck_assert(keys && rev && out && out2);
  for (size_t i = 0; i < n; i++) keys[i] = ps__mix64(i % (n - 1000)); /* 1000 repeats */
  for (size_t i = 0; i < n; i++) rev[i] = keys[n - 1 - i];
  ck_assert_msg(ps_table_pull(t, 0, keys, n, out, PS_TABLE_READ_ONLY, NULL) == 0, "%s",
                ps_client_errmsg(c));
  ck_assert_msg(ps_table_pull(t, 0, rev, n, out2, PS_TABLE_READ_ONLY, NULL) == 0, "%s",
                ps_client_errmsg(c));
  /* (Counted, then one assertion: each ck_assert is a message to Check.) */
  size_t bad = 0, bad_dup = 0;
  for (size_t i = 0; i < n; i++) bad += out[i] != out2[n - 1 - i];
  for (size_t i = n - 1000; i < n; i++) bad_dup += out[i] != out[i - (n - 1000)];
  ck_assert_msg(bad == 0, "%zu rows differ between the two orders", bad);
  ck_assert_msg(bad_dup == 0, "%zu repeated keys read other rows", bad_dup);
  int differ = 0;
  for (size_t i = 1; i < 100; i++) differ += out[i] != out[0];
  ck_assert_int_gt(differ, 90);
  /* Ascending distinct keys are read straight into out (no scatter):
   * the same rows as their reverse, which is scattered. */
  for (size_t i = 0; i < n; i++) keys[i] = 1000 + 7 * (uint64_t)i;
  for (size_t i = 0; i < n; i++) rev[i] = keys[n - 1 - i];
  ck_assert(ps_table_pull(t, 0, keys, n, out, PS_TABLE_READ_ONLY, NULL) == 0);
  ck_assert(ps_table_pull(t, 0, rev, n, out2, PS_TABLE_READ_ONLY, NULL) == 0);
  bad = 0;
  for (size_t i = 0; i < n; i++) bad += out[i] != out2[n - 1 - i];
  ck_assert_msg(bad == 0, "%zu rows of ascending keys differ from their reverse's", bad);
  free(keys);
  free(rev);
  free(out);
  free(out2);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* TablePull frames of table pull r in flight to ps p (tablexfer.c). */
static size_t frames_in_flight(const ps_req *r, int p) {
  const ps__tpull *tp = r->tp;
  return (tp->sent[p] - tp->done[p] + tp->per_frame - 1) / tp->per_frame;
}

/* A key and its index in a test's universe, ordered by key for qsort. */
typedef struct key_u {
  uint64_t key;
  uint32_t u;
} key_u;

static int key_u_cmp(const void *a, const void *b) {
  uint64_t x = ((const key_u *)a)->key, y = ((const key_u *)b)->key;
  return x < y ? -1 : x > y;
}

/* A pull of more keys per ps than PS__TPULL_MIN_FRAME goes out in
 * pieces, several in flight once the first is answered (tablexfer.c):
 * here 2 ps, the first piece of each parked for step 1 until the push
 * completes it, then the rest pipelined; a pull for a step already named
 * sends its pieces together; keys grouped as the servers hold them are
 * read straight into out, from both. Every row lands at its caller's
 * positions, repeated keys too, exactly (SGD from zeros: -lr * the summed
 * gradient, each a small integer). Over TCP and (2 ps) shared memory. */
START_TEST(pull_in_pieces_parked_then_pipelined) {
  enum { N = 320000, U = 300000, D = 4 }; /* 20000 keys twice; ~150000 per ps: 4 pieces each */
  tu_psd ps[2];
  char hosts[2][64];
  const char *hp[2];
  start_ps(ps, 2, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 2, 0, 1, 0, 0);
  ps_table_config g = tcfg(D, PS_TOPT_SGD, 0.5);
  g.capacity = 2 * U; /* every key keeps its row, on either ps */
  ps_table *t = create_ok(c, "pieces", &g);
  uint64_t *keys = malloc(N * sizeof *keys);
  float *grads = malloc((size_t)N * D * sizeof *grads), *out = malloc((size_t)N * D * sizeof *out);
  ck_assert(keys && grads && out);
  for (size_t i = 0; i < N; i++) {
    keys[i] = ps__mix64(i % U);
    for (int j = 0; j < D; j++) grads[i * D + j] = (float)(keys[i] % 7 + (uint64_t)j);
  }
  ck_assert_msg(ps_table_pull(t, 0, keys, N, out, 0, NULL) == 0, "%s", ps_client_errmsg(c));
  ps_req *pull = NULL, *push = NULL;
  ck_assert_int_eq(ps_table_pull_async(t, 1, keys, N, out, 0, &pull), 0);
  /* It may park (step 1 is not reached): one piece a server goes first. */
  ck_assert_uint_eq(frames_in_flight(pull, 0), 1);
  ck_assert_uint_eq(frames_in_flight(pull, 1), 1);
  ck_assert_int_eq(ps_table_push_async(t, 0, keys, N, grads, &push), 0);
  ck_assert_msg(ps_req_wait(push, -1, NULL) == 0, "push: %s", ps_client_errmsg(c));
  uint64_t got = 0;
  int rc = ps_req_wait(pull, 30000, &got);
  ck_assert_msg(rc == 0, "pull: %s (%s)", ps_strerror(rc), ps_client_errmsg(c));
  ck_assert_uint_eq(got, 1);
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < N; i++)
    for (int j = 0; j < D; j++) {
      float times = i % U < N - U ? 2.0f : 1.0f; /* a repeated key's gradients are summed */
      float want = 0.0f - 0.5f * (times * (float)(keys[i] % 7 + (uint64_t)j));
      if (out[i * D + j] != want && !bad++) first_bad = i;
    }
  ck_assert_msg(bad == 0, "%zu values wrong, the first at key position %zu: %g", bad,
                first_bad, out[first_bad * D]);
  /* Step 1 is named now: a pull for it cannot park, and its pieces go
   * out together (up to the window), not one after another's reply. */
  ps_req *again = NULL;
  ck_assert_int_eq(ps_table_pull_async(t, 1, keys, N, out, 0, &again), 0);
  ck_assert_uint_gt(frames_in_flight(again, 0), 1);
  ck_assert_uint_gt(frames_in_flight(again, 1), 1);
  ck_assert_msg(ps_req_wait(again, 30000, NULL) == 0, "%s", ps_client_errmsg(c));
  ps_req_destroy(again);
  /* The distinct keys grouped as the servers hold them (each server's
   * ascending): their own order on both servers, so each connection reads
   * its rows straight into its part of out. */
  key_u *gk = malloc(U * sizeof *gk);
  uint64_t *gkeys = malloc(U * sizeof *gkeys);
  ck_assert(gk && gkeys);
  size_t m = 0, m0 = 0; /* m0: server 0's */
  for (uint32_t s = 0; s < 2; s++) {
    for (uint32_t u = 0; u < U; u++)
      if (ps__table_shard(ps__mix64(u), 2) == s) gk[m++] = (key_u){ps__mix64(u), u};
    if (s == 0) m0 = m;
  }
  qsort(gk, m0, sizeof *gk, key_u_cmp);
  qsort(gk + m0, U - m0, sizeof *gk, key_u_cmp);
  for (size_t i = 0; i < U; i++) gkeys[i] = gk[i].key;
  ck_assert_int_eq(ps_table_pull_async(t, 1, gkeys, U, out, PS_TABLE_READ_ONLY, &again), 0);
  ck_assert_msg(again->tp->in_order, "keys in the servers' order not read straight into out");
  ck_assert_msg(ps_req_wait(again, 30000, NULL) == 0, "%s", ps_client_errmsg(c));
  ps_req_destroy(again);
  for (size_t i = 0; i < U; i++)
    for (int j = 0; j < D; j++) {
      float times = gk[i].u < N - U ? 2.0f : 1.0f;
      float want = 0.0f - 0.5f * (times * (float)(gk[i].key % 7 + (uint64_t)j));
      if (out[i * D + j] != want && !bad++) first_bad = i;
    }
  ck_assert_msg(bad == 0, "grouped keys: %zu values wrong, the first at %zu", bad, first_bad);
  free(gk);
  free(gkeys);
  ps_req_destroy(pull);
  ps_req_destroy(push);
  free(keys);
  free(grads);
  free(out);
  ps_client_destroy(c);
  stop_ps(ps, 2);
}
END_TEST

/* Gradient bytes psd took from worker 0 (its Stats), summed over ps. */
static uint64_t worker_bytes_in(tu_psd *ps, int n) {
  uint64_t in, out;
  tu_worker_bytes(ps, n, 0, &in, &out);
  return in;
}

/* 2.10: a step's push of the keys it pulled names the pull and carries
 * its gradients alone, over TCP or through the push ring (psd's bytes in
 * say so); a push with no pull since, or after a read-only pull, carries
 * its keys; against a psd announcing 2.9 they always do. Every row is right in each case (SGD from zeros,
 * repeated keys summed). And psd's Stats count the pushes that skipped
 * their LRU touches (table.h): those right after their pull. */
START_TEST(push_names_its_pull) {
  enum { N = 1000, U = 700, D = 4, STEPS = 6 };
  uint64_t keys[N];
  static float grads[N * D], out[N * D];
  for (int i = 0; i < N; i++) {
    keys[i] = ps__mix64((uint64_t)(i % U));
    for (int j = 0; j < D; j++) grads[i * D + j] = (float)(keys[i] % 5 + (uint64_t)j);
  }
  for (int old = 0; old < 2; old++) {
    tu_psd ps[2];
    char hosts[2][64];
    const char *hp[2];
    const char *older[] = {"--protocol-minor", "9", NULL};
    start_ps(ps, 2, hosts, hp, old ? older : NULL);
    ps_client *c = tu_client(hp, 2, 0, 1, 0, 0);
    const int tcp = strcmp(ps_client_transport(c, 0), "tcp") == 0;
    ps_table_config g = tcfg(D, PS_TOPT_SGD, 0.5);
    ps_table *t = create_ok(c, "named", &g);
    uint64_t step = 0, bytes[STEPS], skipped[STEPS];
    for (int s = 0; s < STEPS; s++) {
      uint64_t before = worker_bytes_in(ps, 2), skips = stats_of(ps, 2, "named").touches_skipped;
      /* steps 0 and 1 pull, step 2 does not, step 3 pulls read-only,
       * steps 4 and 5 add their gradients before they pull (at step 5
       * the keys are step 4's pull's, but step 5's pull replaces it in
       * psd: the push carries its keys) */
      if (s >= 4)
        ck_assert_msg(ps_table_add_grad(t, keys, N, grads) == 0, "%s", ps_client_errmsg(c));
      if (s != 2)
        ck_assert_msg(ps_table_pull(t, step, keys, N, out, s == 3 ? PS_TABLE_READ_ONLY : 0,
                                    NULL) == 0, "%s", ps_client_errmsg(c));
      if (s < 4)
        ck_assert_msg(ps_table_add_grad(t, keys, N, grads) == 0, "%s", ps_client_errmsg(c));
      ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "%s", ps_client_errmsg(c));
      bytes[s] = worker_bytes_in(ps, 2) - before;
      skipped[s] = stats_of(ps, 2, "named").touches_skipped - skips;
    }
    /* Step 1's push finds the rows its pull just touched, on both ps
     * (step 0's pull stored them: a pull that admits moves the LRU more);
     * steps 2 and 3 have no pull remembered. */
    ck_assert_msg(skipped[0] == 0 && skipped[1] == 2 && skipped[2] == 0 && skipped[3] == 0,
                  "pushes that skipped their touches: %llu, %llu, %llu, %llu",
                  (unsigned long long)skipped[0], (unsigned long long)skipped[1],
                  (unsigned long long)skipped[2], (unsigned long long)skipped[3]);
    const uint64_t with_keys = U * (8 + D * 4), alone = U * D * 4;
    const uint64_t named = !old ? alone : with_keys;
    ck_assert_msg(bytes[0] == named && bytes[1] == named && bytes[2] == with_keys &&
                      bytes[3] == with_keys && bytes[4] == with_keys && bytes[5] == with_keys,
                  "%s, protocol %s: %llu, %llu, %llu, %llu, %llu, %llu bytes in (gradients "
                  "alone %llu, with keys %llu)", tcp ? "tcp" : "shm", old ? "2.9" : "2.10",
                  (unsigned long long)bytes[0], (unsigned long long)bytes[1],
                  (unsigned long long)bytes[2], (unsigned long long)bytes[3],
                  (unsigned long long)bytes[4], (unsigned long long)bytes[5],
                  (unsigned long long)alone, (unsigned long long)with_keys);
    ck_assert_msg(ps_table_pull(t, step, keys, N, out, PS_TABLE_READ_ONLY, NULL) == 0, "%s",
                  ps_client_errmsg(c));
    for (int i = 0; i < N; i++) {
      float times = (i % U) < N - U ? 2.0f : 1.0f;
      for (int j = 0; j < D; j++)
        ck_assert_msg(out[i * D + j] == -0.5f * STEPS * times * grads[i * D + j],
                      "key position %d, %d: %g", i, j, out[i * D + j]);
    }
    ps_client_destroy(c);
    stop_ps(ps, 2);
  }
}
END_TEST

/* A push names a pull only while psd still holds its keys there, by the
 * frames sent since (a review's sequences, each refused with
 * PS_ENOTFOUND before): a pull answered before the step's push, which
 * used and cleared it, then completed (a prefetching loop); a pull whose
 * keys an async push of the same keys used; a pull whose last pieces
 * went out after another pull's (5 pieces, 4 in flight). Each step must
 * succeed. */
START_TEST(push_names_only_a_pull_psd_holds) {
  enum { N = 200000, SMALL = 100, D = 2 };
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 1, 0, 1, 0, 0);
  ps_table_config g = tcfg(D, PS_TOPT_SGD, 0.5);
  g.capacity = 2 * N;
  ps_table *t = create_ok(c, "holds", &g);
  uint64_t *keys = malloc(N * sizeof *keys), step = 0;
  float *grads = calloc((size_t)N * D, sizeof *grads), *out = malloc((size_t)N * D * 4);
  float *out2 = malloc((size_t)N * D * 4);
  ck_assert(keys && grads && out && out2);
  for (size_t i = 0; i < N; i++) keys[i] = ps__mix64(i);
  ps_req *r = NULL, *r2 = NULL;
  /* (1) prefetching: the next step's pull goes out before this step's
   * gradients, is answered before the push, and completes after it */
  ck_assert_int_eq(ps_table_pull_async(t, 0, keys, SMALL, out, 0, &r), 0);
  for (int s = 0; s < 3; s++) {
    ck_assert_msg(ps_req_wait(r, -1, NULL) == 0, "%s", ps_client_errmsg(c));
    ps_req_destroy(r);
    r = NULL;
    if (s < 2) ck_assert_int_eq(ps_table_pull_async(t, 0, keys, SMALL, out, 0, &r), 0);
    ck_assert_msg(ps_table_add_grad(t, keys, SMALL, grads) == 0, "%s", ps_client_errmsg(c));
    ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "prefetching, step %d: %s", s,
                  ps_client_errmsg(c));
  }
  /* (2) an async push of the pulled keys, then the step's */
  ck_assert_msg(ps_table_pull(t, step, keys, SMALL, out, 0, NULL) == 0, "%s",
                ps_client_errmsg(c));
  ck_assert_int_eq(ps_table_push_async(t, step, keys, SMALL, grads, &r), 0);
  ck_assert_msg(ps_req_wait(r, -1, NULL) == 0, "%s", ps_client_errmsg(c));
  ps_req_destroy(r);
  ck_assert_msg(ps_table_add_grad(t, keys, SMALL, grads) == 0, "%s", ps_client_errmsg(c));
  ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "after an async push: %s",
                ps_client_errmsg(c));
  /* (3) two pulls at once: the big one's last piece after the small one */
  ck_assert_int_eq(ps_table_pull_async(t, step, keys, N, out, 0, &r), 0);
  ck_assert_int_eq(ps_table_pull_async(t, step, keys + N - SMALL, SMALL, out2, 0, &r2), 0);
  ck_assert_msg(ps_req_wait(r2, -1, NULL) == 0, "%s", ps_client_errmsg(c));
  ck_assert_msg(ps_req_wait(r, -1, NULL) == 0, "%s", ps_client_errmsg(c));
  ps_req_destroy(r);
  ps_req_destroy(r2);
  ck_assert_msg(ps_table_add_grad(t, keys + N - SMALL, SMALL, grads) == 0, "%s",
                ps_client_errmsg(c));
  ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "after overlapping pulls: %s",
                ps_client_errmsg(c));
  free(keys), free(grads), free(out), free(out2);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* A client whose waits are 40 ms gives up on a pull of 128 MiB of rows
 * while they arrive: the rest is read and dropped (not written into the
 * freed request), and its next pulls get the right rows. */
START_TEST(abandoned_pull_is_discarded) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  start_ps(ps, 1, hosts, hp, NULL);
  ps_client *c = tu_client(hp, 1, 0, 1, 0, 40);
  ps_table_config g = tcfg(16, PS_TOPT_SGD, 0.1);
  g.init = (ps_init)PS_SIZED(ps_init, .kind = PS_INIT_UNIFORM, .a = 0, .b = 1, .seed = 5);
  ps_table *t = NULL;
  int rc = PS_ETIMEDOUT;
  for (int i = 0; i < 100 && rc == PS_ETIMEDOUT; i++) rc = ps_client_table_create(c, "ab", &g, &t);
  ck_assert_msg(rc == 0, "%s", ps_client_errmsg(c));
  uint64_t small[3] = {1, 2, 3};
  float base[3 * 16], again[3 * 16];
  rc = PS_ETIMEDOUT;
  for (int i = 0; i < 100 && rc == PS_ETIMEDOUT; i++)
    rc = ps_table_pull(t, 0, small, 3, base, PS_TABLE_READ_ONLY, NULL);
  ck_assert_int_eq(rc, 0);
  size_t n = 2u << 20;
  uint64_t *keys = malloc(n * sizeof *keys);
  float *out = malloc(n * 16 * sizeof *out);
  ck_assert(keys && out);
  for (size_t i = 0; i < n; i++) keys[i] = i + 1000;
  rc = ps_table_pull(t, 0, keys, n, out, PS_TABLE_READ_ONLY, NULL);
  ck_assert_msg(rc == 0 || rc == PS_ETIMEDOUT, "%s", ps_client_errmsg(c));
  free(out); /* released: whatever still arrives must not land here */
  free(keys);
  rc = PS_ETIMEDOUT;
  for (int i = 0; i < 500 && rc == PS_ETIMEDOUT; i++)
    rc = ps_table_pull(t, 0, small, 3, again, PS_TABLE_READ_ONLY, NULL);
  ck_assert_msg(rc == 0, "%s", ps_client_errmsg(c));
  ck_assert(memcmp(base, again, sizeof base) == 0);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

/* The same, caught in the middle of the rows (the test watches the
 * connection's reader): the request is released, and so is the caller's
 * buffer; the reader discards the rest (ASan would see a write into
 * either). */
START_TEST(pull_released_mid_frame) {
  tu_psd ps[1];
  char hosts[1][64];
  const char *hp[1];
  /* Small send buffers: the rows trickle, so the reader stops mid-frame.
   * Over TCP: through shared memory (2.9) the rows arrive whole. */
  const char *extra[] = {"--socket-buffer", "16384", NULL};
  setenv("PS_TRANSPORT", "tcp", 1); /* this test's own process (CK_FORK) */
  start_ps(ps, 1, hosts, hp, extra);
  ps_client *c = tu_client(hp, 1, 0, 1, 0, 0);
  ps_table_config g = tcfg(16, PS_TOPT_SGD, 0.1);
  g.init = (ps_init)PS_SIZED(ps_init, .kind = PS_INIT_UNIFORM, .a = 0, .b = 1, .seed = 5);
  ps_table *t = create_ok(c, "mid", &g);
  uint64_t small[3] = {1, 2, 3};
  float base[3 * 16], again[3 * 16];
  ck_assert_int_eq(ps_table_pull(t, 0, small, 3, base, PS_TABLE_READ_ONLY, NULL), 0);
  size_t n = 1u << 18; /* 16 MiB of rows */
  uint64_t *keys = malloc(n * sizeof *keys);
  float *out = malloc(n * 16 * sizeof *out);
  ck_assert(keys && out);
  for (size_t i = 0; i < n; i++) keys[i] = i + 1000;
  ps_req *r = NULL;
  ck_assert_int_eq(ps_table_pull_async(t, 0, keys, n, out, PS_TABLE_READ_ONLY, &r), 0);
  free(keys);
  const ps__conn *k = &c->conns[0];
  int mid = 0, rc = PS_ETIMEDOUT;
  for (double t0 = now_s(); !mid && rc == PS_ETIMEDOUT && now_s() - t0 < 60;) {
    rc = ps_req_wait(r, 1, NULL);
    mid = k->rstate == PS__RD_DATA && k->data_own && k->dst_got > 0;
  }
  ck_assert_msg(mid, "never saw the reply in the middle of its rows (rc %d)", rc);
  /* Ascending distinct keys: the rows are read straight into out. */
  const float *into = k->dst[0].iov_base;
  ck_assert_msg(into >= out && into < out + n * 16,
                "rows of ascending keys read into %p, not out (%p)", (const void *)into,
                (void *)out);
  ps__req_release(c, r); /* what a timed-out ps_table_pull does */
  free(out);
  ck_assert_int_eq(ps_table_pull(t, 0, small, 3, again, PS_TABLE_READ_ONLY, NULL), 0);
  ck_assert(memcmp(base, again, sizeof base) == 0);
  ps_client_destroy(c);
  stop_ps(ps, 1);
}
END_TEST

Suite *suite_tables(void) {
  Suite *s = suite_create("tables");
  TCase *tc = tcase_create("tables");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, two_workers_equal_one_worker_bitwise, 0, 3);
  tcase_add_test(tc, pull_order_duplicates_and_initializer);
  tcase_add_test(tc, duplicate_gradients_summed);
  tcase_add_test(tc, read_only_pull_creates_no_rows);
  tcase_add_test(tc, step_with_tables_only_waits_for_them);
  tcase_add_test(tc, step_with_tables_and_variables);
  tcase_add_test(tc, step_async_tables);
  tcase_add_test(tc, held_table_push_survives_other_pushes);
  tcase_add_test(tc, step_push_after_add_grad);
  tcase_add_test(tc, refused_push_fails_at_once);
  tcase_add_test(tc, step_after_refused_push_goes_on);
  tcase_add_test(tc, later_parked_pull_replaces_earlier);
  tcase_add_test(tc, duplicate_push_is_applied);
  tcase_add_test(tc, stale_push_after_backups_skips_ahead);
  tcase_add_test(tc, update_rules_match_reference);
  tcase_add_test(tc, lr_schedule_over_the_table_step);
  tcase_add_test(tc, bad_configs_are_named);
  tcase_add_test(tc, create_idempotent_and_mismatch);
  tcase_add_test(tc, pull_split_into_frames);
  tcase_add_test(tc, pull_in_pieces_parked_then_pipelined);
  tcase_add_test(tc, push_names_its_pull);
  tcase_add_test(tc, push_names_only_a_pull_psd_holds);
  tcase_add_test(tc, abandoned_pull_is_discarded);
  tcase_add_test(tc, pull_released_mid_frame);
  suite_add_tcase(s, tc);
  return s;
}
