/* ps_bench_store.c - --table-store: psd's table store alone (psd/sparse/table.c,
 * linked in), on one core, no network: for each --table K:D,
 *
 *   insert   psd_table_pull of K new keys into an empty table of capacity
 *            K (find-or-insert: every key admitted, its row initialized);
 *   find     the same pull again (every key found, its row copied out);
 *   update   per rule (sgd, adagrad, adam, ftrl): psd_table_push of K
 *            gradient rows onto the K stored rows (find, the rule, LRU);
 *   rule     the rule alone (psd_rowopt_apply) on those K rows where they
 *            lie, a gradient row each: the per-row update without the find
 *            that "find" times;
 *   copy     memcpy of the rows' bytes (K x stride floats: values and the
 *            rule's state), the memory-bound bound an update is held to.
 *
 * The keys reach the store as psd gets them: ascending, in calls of
 * STORE_CHUNK keys. Each round takes every figure once (a fresh table per
 * round), then medians and ranges over the rounds, and each rule's rows/s
 * over the copy's rows/s of the same round.
 *
 *   name "table_store": round keys dim insert_keys_per_s find_keys_per_s
 *   name "table_update": round keys dim rule rows_per_s rule_rows_per_s
 *                         copy_rows_per_s ratio rule_ratio
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "psclient.h"
#include "sparse/rowopt.h"
#include "sparse/table.h"
/* After psclient.h: its parameters named opt would shadow our options. */
#include "ps_bench_internal.h"

/* Keys per psd_table_pull / psd_table_push call: what one frame of a
 * 64k-id batch brings (the out buffer stays a few MB, as a reply's). */
#define STORE_CHUNK ((size_t)1 << 16)
#define STORE_RULES 4
#define STORE_KEY_MUL 2654435761ULL /* as --table's ids */

static const char *const rule_names[STORE_RULES] = {"sgd", "adagrad", "adam", "ftrl"};
static const int rule_opt[STORE_RULES] = {PS_TOPT_SGD, PS_TOPT_ADAGRAD, PS_TOPT_ADAM,
                                          PS_TOPT_FTRL};

/* One shape's figures, per round. */
typedef struct store_series {
  table_shape shape;
  double insert[MAX_ROUNDS], find[MAX_ROUNDS];   /* keys/s */
  double update[STORE_RULES][MAX_ROUNDS];        /* rows/s, a push */
  double rule[STORE_RULES][MAX_ROUNDS];          /* rows/s, the rule alone */
  double copy[STORE_RULES][MAX_ROUNDS];          /* rows/s of the rule's stride */
} store_series;

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void spec_for(psd_table_spec *sp, table_shape sh, int rule) {
  memset(sp, 0, sizeof *sp);
  snprintf(sp->name, sizeof sp->name, "ps_bench/store");
  sp->dim = sh.dim;
  sp->capacity = sh.keys;
  sp->init_kind = PS_INIT_ZEROS;
  sp->opt = (uint32_t)rule_opt[rule];
  sp->lr = LEARNING_RATE;
  sp->initial_accumulator = 0.1;
  sp->beta1 = 0.9;
  sp->beta2 = 0.999;
  sp->epsilon = 1e-8;
  sp->ftrl_beta = 1.0;
  sp->admit_count = 1;
}

/* Pulls every key in chunks (create): seconds, NAN on failure. */
static double store_pull(psd_table *t, const uint64_t *keys, size_t n, float *out) {
  double t0 = now_s();
  for (size_t i = 0; i < n; i += STORE_CHUNK) {
    size_t k = n - i < STORE_CHUNK ? n - i : STORE_CHUNK;
    if (psd_table_pull(t, keys + i, k, 1, out) != 0) return NAN;
  }
  return now_s() - t0;
}

/* Pushes a gradient for every key in chunks (each a step of the one
 * worker): seconds, NAN on failure. */
static double store_push(psd_table *t, const uint64_t *keys, size_t n, const float *g) {
  double t0 = now_s();
  for (size_t i = 0; i < n; i += STORE_CHUNK) {
    size_t k = n - i < STORE_CHUNK ? n - i : STORE_CHUNK;
    uint64_t dropped = 0;
    if (psd_table_push(t, 0, psd_table_step(t), keys + i, k, g, &dropped) != 1 || dropped)
      return NAN;
  }
  return now_s() - t0;
}

/* The stored rows, for the rule alone: psd_table_walk lends them const
 * (a checkpoint only reads them); the bench owns the table and updates
 * them as psd_table_push would, minus the find. */
typedef struct row_list {
  float **rows;
  size_t n, cap;
} row_list;

static void collect_row(void *ctx, uint64_t key, const float *values, const float *state,
                        uint64_t touched) {
  (void)key, (void)state, (void)touched;
  row_list *l = ctx;
  if (l->n < l->cap) l->rows[l->n++] = (float *)(uintptr_t)values;
}

/* The rule of sp on every stored row of t, gradient rows g cycling over a
 * chunk's: seconds, NAN without memory or with a row missing. */
static double store_rule_alone(const psd_table *t, const psd_table_spec *sp, size_t n,
                               const float *g, size_t chunk) {
  psd_rowopt *o = malloc(sizeof *o);
  row_list l = {malloc(n * sizeof(float *)), 0, n};
  double s = NAN;
  if (o && l.rows) {
    psd_rowopt_init(o, sp);
    psd_table_walk(t, collect_row, &l);
    const size_t d = sp->dim;
    double t0 = now_s();
    for (size_t i = 0, j = 0; i < l.n; i++, j = j + 1 == chunk ? 0 : j + 1)
      psd_rowopt_apply(o, l.rows[i], l.rows[i] + d, g + j * d, 1.0f);
    if (l.n == n) s = now_s() - t0;
  }
  free(l.rows);
  free(o);
  return s;
}

/* Copies of the rows' bytes timed, the fastest kept: one copy alone is
 * at the mercy of a neighbour's burst on this shared machine. */
#define STORE_COPIES 3

/* Through a volatile pointer: the copies' destination is never read. */
static void *(*volatile g_copy)(void *, const void *, size_t) = memcpy;

/* Copy of the rows' bytes (pre-faulted): seconds, NAN without memory. */
static double store_copy(size_t bytes) {
  char *a = malloc(bytes), *b = malloc(bytes);
  double s = NAN;
  if (a && b) {
    memset(a, 1, bytes);
    memset(b, 0, bytes);
    for (int i = 0; i < STORE_COPIES; i++) {
      double t0 = now_s();
      g_copy(b, a, bytes);
      double t = now_s() - t0;
      if (!(t >= s)) s = t; /* NAN at first */
    }
    if (b[bytes - 1] != 1) s = NAN;
  }
  free(a);
  free(b);
  return s;
}

/* Rule `rule` of round r: a table filled with the keys, one timed push
 * of them all, and the copy of as many rows of its stride. */
static int store_rule(store_series *x, int r, int rule, const uint64_t *keys, float *out,
                      const float *g) {
  psd_table_spec sp;
  spec_for(&sp, x->shape, rule);
  psd_table *t = NULL;
  char err[256];
  size_t n = (size_t)x->shape.keys;
  if (psd_table_create(&sp, 1, 1, 0, &t, err, sizeof err) != 0) {
    progress("table-store: %s", err);
    return 1;
  }
  size_t chunk = n < STORE_CHUNK ? n : STORE_CHUNK;
  double fill = store_pull(t, keys, n, out), upd = store_push(t, keys, n, g);
  double alone = store_rule_alone(t, &sp, n, g, chunk);
  psd_table_destroy(t);
  double cp = store_copy(n * psd_rowopt_stride(&sp) * sizeof(float));
  x->update[rule][r] = n / upd;
  x->rule[rule][r] = n / alone;
  x->copy[rule][r] = n / cp;
  return !isfinite(fill) || !isfinite(upd) || !isfinite(alone) || !isfinite(cp);
}

/* Insert and find of round r on a fresh SGD table. */
static int store_find(store_series *x, int r, const uint64_t *keys, float *out) {
  psd_table_spec sp;
  spec_for(&sp, x->shape, 0);
  psd_table *t = NULL;
  char err[256];
  size_t n = (size_t)x->shape.keys;
  if (psd_table_create(&sp, 1, 1, 0, &t, err, sizeof err) != 0) {
    progress("table-store: %s", err);
    return 1;
  }
  double ins = store_pull(t, keys, n, out), fnd = store_pull(t, keys, n, out);
  psd_table_destroy(t);
  x->insert[r] = n / ins;
  x->find[r] = n / fnd;
  return !isfinite(ins) || !isfinite(fnd);
}

static void print_round(const store_series *x, int r) {
  char a[32], b[32], c[32];
  unsigned long long k = x->shape.keys;
  if (opt.json)
    printf("{\"name\":\"table_store\",\"round\":%d,\"keys\":%llu,\"dim\":%u,"
           "\"insert_keys_per_s\":%s,\"find_keys_per_s\":%s}\n", r + 1, k, x->shape.dim,
           jnum(x->insert[r], a, sizeof a), jnum(x->find[r], b, sizeof b));
  else
    printf("%5d table_store %10llux%-5u insert %8.2f M keys/s  find %8.2f M keys/s\n", r + 1,
           k, x->shape.dim, x->insert[r] / 1e6, x->find[r] / 1e6);
  for (int u = 0; u < STORE_RULES; u++) {
    double ratio = x->update[u][r] / x->copy[u][r], rratio = x->rule[u][r] / x->copy[u][r];
    char e[32], f[32];
    if (opt.json)
      printf("{\"name\":\"table_update\",\"round\":%d,\"keys\":%llu,\"dim\":%u,\"rule\":\"%s\","
             "\"rows_per_s\":%s,\"rule_rows_per_s\":%s,\"copy_rows_per_s\":%s,\"ratio\":%s,"
             "\"rule_ratio\":%s}\n", r + 1, k, x->shape.dim, rule_names[u],
             jnum(x->update[u][r], a, sizeof a), jnum(x->rule[u][r], e, sizeof e),
             jnum(x->copy[u][r], b, sizeof b), jnum(ratio, c, sizeof c),
             jnum(rratio, f, sizeof f));
    else
      printf("%5d table_update %-8s %10llux%-5u push %8.2f M rows/s %.3fx  rule alone %8.2f M "
             "rows/s %.3fx  of copy %8.2f M rows/s\n", r + 1, rule_names[u], k, x->shape.dim,
             x->update[u][r] / 1e6, ratio, x->rule[u][r] / 1e6, rratio, x->copy[u][r] / 1e6);
  }
  fflush(stdout);
}

/* "name": median [min-max] of v over the rounds (per-round ratios a/b
 * when b is given). */
static void print_stat(const store_series *x, const char *rule, const char *what,
                       const double *v, const double *b) {
  double q[MAX_ROUNDS], lo = NAN, hi = NAN;
  int n = 0;
  for (int r = 0; r < opt.rounds; r++) {
    double y = b ? v[r] / b[r] : v[r];
    if (!isfinite(y)) continue;
    q[n++] = y;
    if (n == 1 || y < lo) lo = y;
    if (n == 1 || y > hi) hi = y;
  }
  double med = median(q, (size_t)n);
  char a[32], c[32], d[32];
  unsigned long long k = x->shape.keys;
  if (opt.json)
    printf("{\"name\":\"summary\",\"of\":\"%s\",\"keys\":%llu,\"dim\":%u%s%s%s,"
           "\"rounds\":%d,\"ok_rounds\":%d,\"median\":%s,\"min\":%s,\"max\":%s}\n", what, k,
           x->shape.dim, rule ? ",\"rule\":\"" : "", rule ? rule : "", rule ? "\"" : "",
           opt.rounds, n, jnum(med, a, sizeof a), jnum(lo, c, sizeof c), jnum(hi, d, sizeof d));
  else
    printf("%-22s %-8s %10llux%-5u %.4g [%.4g-%.4g]\n", what, rule ? rule : "", k,
           x->shape.dim, med, lo, hi);
}

static void print_summaries(const store_series *x) {
  if (!opt.json) printf("\nmedian [min-max] of %d rounds\n", opt.rounds);
  print_stat(x, NULL, "insert_keys_per_s", x->insert, NULL);
  print_stat(x, NULL, "find_keys_per_s", x->find, NULL);
  for (int u = 0; u < STORE_RULES; u++) {
    print_stat(x, rule_names[u], "update_rows_per_s", x->update[u], NULL);
    print_stat(x, rule_names[u], "copy_rows_per_s", x->copy[u], NULL);
    print_stat(x, rule_names[u], "update_over_copy", x->update[u], x->copy[u]);
    print_stat(x, rule_names[u], "rule_rows_per_s", x->rule[u], NULL);
    print_stat(x, rule_names[u], "rule_over_copy", x->rule[u], x->copy[u]);
  }
}

/* Every round of one shape: 0, or the failures. */
static int store_shape(store_series *x) {
  size_t n = (size_t)x->shape.keys, d = x->shape.dim;
  size_t chunk = n < STORE_CHUNK ? n : STORE_CHUNK;
  uint64_t *keys = malloc(n * sizeof *keys);
  float *out = malloc(chunk * d * sizeof *out), *g = malloc(chunk * d * sizeof *g);
  int failures = 0;
  if (!keys || !out || !g) {
    progress("table-store: out of memory for %zu keys", n);
    failures = 1;
  }
  for (size_t i = 0; !failures && i < n; i++) keys[i] = (uint64_t)i * STORE_KEY_MUL + 7;
  if (!failures) qsort(keys, n, sizeof *keys, cmp_u64); /* as psd gets them */
  for (size_t i = 0; !failures && i < chunk * d; i++) g[i] = GRAD_VALUE;
  pin_cpu(0);
  for (int r = 0; !failures && r < opt.rounds && !g_interrupted; r++) {
    progress("table-store %zux%zu round %d of %d", n, d, r + 1, opt.rounds);
    failures += store_find(x, r, keys, out);
    for (int u = 0; u < STORE_RULES; u++) failures += store_rule(x, r, u, keys, out, g);
    print_round(x, r);
  }
  unpin_cpu();
  if (!failures && !g_interrupted) print_summaries(x);
  free(keys);
  free(out);
  free(g);
  return failures;
}

int run_table_store(void) {
  int failures = 0;
  for (int i = 0; i < opt.n_tables && !g_interrupted; i++) {
    store_series *x = calloc(1, sizeof *x);
    if (!x) return failures + 1;
    x->shape = opt.tables[i];
    failures += store_shape(x);
    free(x);
  }
  fflush(stdout);
  return failures;
}
