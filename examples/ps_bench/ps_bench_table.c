/* ps_bench_table.c - --table K:D: each worker's step is the sparse-table
 * step of an embedding model (ps_table_pull of K rows of D floats,
 * ps_table_add_grad of K gradient rows, ps_client_step), timed from the
 * pull to the step's return. The rounds (ps_bench_rounds.c) take every
 * table run back to back with a dense push+pull of the same row bytes
 * (K x D x 4), so "table / dense" is a same-machine-state ratio.
 *
 * The keys are K distinct 64-bit ids spread by a multiplicative hash
 * (i * 2654435761 + 7: unsorted, as a batch's ids are), the same on every
 * worker and every step; the table is SGD from zeros, so after s applied
 * steps every element is -s * lr * GRAD_VALUE, which the last pull checks.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "psclient.h"
#include "ps_bench_internal.h"

/* The ids: a multiplicative (Knuth) hash of 0..K-1, offset so no id is 0. */
#define TABLE_KEY_MUL 2654435761ULL
#define TABLE_KEY_ADD 7ULL
/* Largest K and D of --table: K rows of D floats must fit one worker's
 * memory three times over (keys, rows, gradients), and D a table's dim. */
#define TABLE_MAX_KEYS (64ULL << 20)
#define TABLE_MAX_DIM 65536u

table_shape g_table;

/* ---------------------------------------------------------------------- */
/* --table K:D[,K:D...] */

/* A count with an optional k (1e3) or M (1e6) suffix; 0 or -1. */
static int parse_count(const char *s, const char *end, uint64_t max, uint64_t *out) {
  if (s == end || *s < '0' || *s > '9') return -1;
  uint64_t v = 0, mul = 1;
  for (; s < end && *s >= '0' && *s <= '9'; s++) {
    if (v > (UINT64_MAX - 9) / 10) return -1;
    v = v * 10 + (uint64_t)(*s - '0');
  }
  if (s < end && (*s == 'k' || *s == 'K')) mul = 1000, s++;
  else if (s < end && *s == 'M') mul = 1000000, s++;
  if (s != end || v == 0 || v > max / mul) return -1;
  *out = v * mul;
  return 0;
}

void parse_table_list(const char *flag, const char *val) {
  const char *what = "expected K:D[,K:D...]: keys (suffixes k, M) x floats per row, e.g. "
                     "100k:16,1M:16";
  opt.n_tables = 0;
  for (const char *p = val;;) {
    size_t l = strcspn(p, ",");
    const char *colon = memchr(p, ':', l);
    uint64_t k, d;
    if (!colon || parse_count(p, colon, TABLE_MAX_KEYS, &k) != 0 ||
        parse_count(colon + 1, p + l, TABLE_MAX_DIM, &d) != 0) {
      fprintf(stderr, "ps_bench: %s: invalid value '%s' (%s)\n", flag, val, what);
      exit(2);
    }
    if (opt.n_tables >= MAX_LIST) {
      fprintf(stderr, "ps_bench: %s: too many entries\n", flag);
      exit(2);
    }
    opt.tables[opt.n_tables++] = (table_shape){k, (uint32_t)d};
    if (!p[l]) break;
    p += l + 1;
  }
}

/* ---------------------------------------------------------------------- */
/* The worker's side */

typedef struct tworker {
  ps_client *c;
  ps_table *t;
  uint64_t *keys;
  float *rows, *grads;
  uint64_t step, first_step;
} tworker;

static int tw_fail(tworker *w, const char *what, int rc, char *msg, size_t len) {
  snprintf(msg, len, "%s: %s: %s", what, ps_strerror(rc), ps_client_errmsg(w->c));
  return rc;
}

/* The rows of the last pull: every element -applied * lr * g (SGD from
 * zeros, each worker the same gradient). 0, or 1 with msg. */
static int tw_check(const tworker *w, uint64_t pulled_at, char *msg, size_t len) {
  size_t n = (size_t)g_table.keys * g_table.dim;
  double applied = (double)(pulled_at - w->first_step);
  double expect = -applied * LEARNING_RATE * GRAD_VALUE;
  double tol = (1e-3 + applied * 6e-8) * fabs(expect) + 1e-12;
  for (size_t i = 0; i < n; i++)
    if (!isfinite(w->rows[i]) || fabs(w->rows[i] - expect) > tol) {
      snprintf(msg, len, "table row of key %llu, element %zu, pulled at step %llu: %.9g, "
               "expected %.9g", (unsigned long long)w->keys[i / g_table.dim],
               i % g_table.dim, (unsigned long long)pulled_at, (double)w->rows[i], expect);
      return 1;
    }
  return 0;
}

static int tw_setup(tworker *w, char *msg, size_t len) {
  size_t k = (size_t)g_table.keys, d = g_table.dim;
  w->keys = malloc(k * sizeof *w->keys);
  w->rows = malloc(k * d * sizeof *w->rows);
  w->grads = malloc(k * d * sizeof *w->grads);
  if (!w->keys || !w->rows || !w->grads) {
    snprintf(msg, len, "out of memory for %zu keys of %zu floats", k, d);
    return PS_ENOMEM;
  }
  for (size_t i = 0; i < k; i++) w->keys[i] = (uint64_t)i * TABLE_KEY_MUL + TABLE_KEY_ADD;
  for (size_t i = 0; i < k * d; i++) w->grads[i] = GRAD_VALUE;
  memset(w->rows, 0, k * d * sizeof *w->rows); /* faulted in before the clock runs */
  ps_table_config tc;
  ps_table_config_init(&tc);
  tc.dim = (uint32_t)d;
  tc.capacity = (uint64_t)k * 2; /* room: no eviction in the measurement */
  tc.opt = PS_TOPT_SGD;
  tc.lr = LEARNING_RATE;
  int rc = ps_client_table_create(w->c, "ps_bench/table", &tc, &w->t);
  if (rc) return tw_fail(w, "ps_client_table_create", rc, msg, len);
  /* The table's step: a pull of no keys. */
  rc = ps_table_pull(w->t, 0, NULL, 0, NULL, 0, &w->step);
  if (rc) return tw_fail(w, "ps_table_pull", rc, msg, len);
  w->first_step = w->step;
  return 0;
}

/* One step: 0 or a ps_* code; *pulled_at gets the step of the rows. */
static int tw_step(tworker *w, uint64_t *pulled_at, char *msg, size_t len) {
  int rc = ps_table_pull(w->t, w->step, w->keys, (size_t)g_table.keys, w->rows, 0, pulled_at);
  if (rc) return tw_fail(w, "ps_table_pull", rc, msg, len);
  rc = ps_table_add_grad(w->t, w->keys, (size_t)g_table.keys, w->grads);
  if (rc) return tw_fail(w, "ps_table_add_grad", rc, msg, len);
  int stale = 0;
  rc = ps_client_step(w->c, &w->step, &stale);
  if (rc) return tw_fail(w, "ps_client_step", rc, msg, len);
  return 0;
}

int table_worker_steps(ps_client *c, int steps, double *times, char *msg, size_t len) {
  tworker w = {.c = c};
  int rc = tw_setup(&w, msg, len);
  uint64_t pulled_at = 0;
  for (int s = 0; !rc && s < WARMUP_STEPS + steps; s++) {
    double t0 = now_s();
    rc = tw_step(&w, &pulled_at, msg, len);
    if (s >= WARMUP_STEPS) times[s - WARMUP_STEPS] = now_s() - t0;
  }
  if (!rc) rc = tw_check(&w, pulled_at, msg, len);
  free(w.keys);
  free(w.rows);
  free(w.grads);
  return rc;
}

/* ---------------------------------------------------------------------- */
/* The parent's side */

int run_table(int nps, int nw, table_shape shape, int steps, const char *transport,
              pp_result *res) {
  g_table = shape;
  int rc = run_pushpull(nps, nw, shape.keys * shape.dim * sizeof(float), steps, transport, res);
  g_table = (table_shape){0, 0};
  return rc;
}
