/* test_table.c - psd/sparse/table.c and its parts: the key index against a
 * reference (with clusters wrapping around the slot array), the table
 * against a plain LRU model under random pulls and pushes, each row rule
 * against a double-precision reference, the SyncReplicas rule for rows,
 * admission, eviction, the initializer, checkpoints (walk and restore),
 * and the checks of keys and specs. Random tests print their seed;
 * PS_TEST_SEED=N replays one. */
#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "par.h"
#include "sparse/keyindex.h"
#include "psclient.h"
#include "sparse/rowinit.h"
#include "sparse/rowopt.h"
#include "sparse/table.h"
#include "testutil.h"
#include "wire.h"

#define RTOL 1e-5 /* relative tolerance of float rules against double references */

/* ---------------------------------------------------------------------- */
/* Helpers */

/* splitmix64: the tests' own stream, seeded per test. */
static uint64_t rnd64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
static double rndu(uint64_t *s) { return (double)(rnd64(s) >> 11) * 0x1p-53; }
static uint32_t rndn(uint64_t *s, uint32_t n) { return (uint32_t)(rnd64(s) % n); }

/* A valid spec: zeros init, SGD at lr 0.5, first-sighting admission. */
static psd_table_spec spec_base(const char *name, uint32_t dim, uint64_t capacity) {
  psd_table_spec s;
  memset(&s, 0, sizeof s);
  snprintf(s.name, sizeof s.name, "%s", name);
  s.dim = dim;
  s.capacity = capacity;
  s.init_kind = PS_INIT_ZEROS;
  s.opt = PS_TOPT_SGD;
  s.lr = 0.5;
  s.initial_accumulator = 0.1;
  s.beta1 = 0.9;
  s.beta2 = 0.999;
  s.epsilon = 1e-8;
  s.ftrl_beta = 1.0;
  return s;
}

static psd_table *mk(const psd_table_spec *s, uint32_t workers, uint32_t replicas, int async) {
  psd_table *t = NULL;
  char err[512];
  int rc = psd_table_create(s, workers, replicas, async, &t, err, sizeof err);
  ck_assert_msg(rc == 0, "create: %d %s", rc, err);
  return t;
}

/* The stored row of key (values and state) via the walk. */
typedef struct {
  uint64_t key;     /* wanted */
  int found;        /* seen in the walk */
  float v[64];      /* its values (dim <= 64 here) */
  float st[160];    /* its state */
  uint64_t touched; /* its last touch */
} find_ctx;
static uint32_t g_dim, g_nstate; /* of the table being walked */
static void find_fn(void *ctx, uint64_t key, const float *v, const float *st, uint64_t touched) {
  find_ctx *f = ctx;
  if (key != f->key) return;
  f->found = 1;
  memcpy(f->v, v, g_dim * sizeof *v);
  memcpy(f->st, st, g_nstate * sizeof *st);
  f->touched = touched;
}
static int find_row(psd_table *t, uint64_t key, find_ctx *f) {
  memset(f, 0, sizeof *f);
  f->key = key;
  g_dim = psd_table_spec_of(t)->dim;
  g_nstate = psd_rowopt_state_floats(psd_table_spec_of(t));
  psd_table_walk(t, find_fn, f);
  return f->found;
}

/* A whole walk: keys (LRU order, oldest first), values, state, touched. */
typedef struct {
  uint32_t n, cap, dim, nstate; /* rows seen, rows room, per-row floats */
  uint64_t *keys, *touched;     /* per row */
  float *v, *st;                /* per row: dim values, nstate state */
} dump;
static void dump_fn(void *ctx, uint64_t key, const float *v, const float *st, uint64_t touched) {
  dump *d = ctx;
  ck_assert_uint_lt(d->n, d->cap);
  d->keys[d->n] = key;
  d->touched[d->n] = touched;
  memcpy(d->v + (size_t)d->n * d->dim, v, d->dim * sizeof *v);
  if (d->nstate) memcpy(d->st + (size_t)d->n * d->nstate, st, d->nstate * sizeof *st);
  d->n++;
}
static dump dump_of(const psd_table *t) {
  const psd_table_spec *s = psd_table_spec_of(t);
  dump d = {0, (uint32_t)s->capacity + 1, s->dim, psd_rowopt_state_floats(s), NULL, NULL, NULL,
            NULL};
  d.keys = calloc(d.cap, sizeof *d.keys);
  d.touched = calloc(d.cap, sizeof *d.touched);
  d.v = calloc((size_t)d.cap * d.dim, sizeof *d.v);
  d.st = calloc((size_t)d.cap * (d.nstate + 1), sizeof *d.st);
  ck_assert(d.keys && d.touched && d.v && d.st);
  psd_table_walk(t, dump_fn, &d);
  return d;
}
static void dump_free(dump *d) {
  free(d->keys), free(d->touched), free(d->v), free(d->st);
}
static void dump_eq(const dump *a, const dump *b, const char *what) {
  ck_assert_msg(a->n == b->n, "%s: %u rows vs %u", what, a->n, b->n);
  for (uint32_t i = 0; i < a->n; i++) {
    ck_assert_msg(a->keys[i] == b->keys[i], "%s: LRU position %u: key %" PRIu64 " vs %" PRIu64,
                  what, i, a->keys[i], b->keys[i]);
    ck_assert_msg(a->touched[i] == b->touched[i], "%s: key %" PRIu64 " touched %" PRIu64
                  " vs %" PRIu64, what, a->keys[i], a->touched[i], b->touched[i]);
  }
  ck_assert_msg(memcmp(a->v, b->v, (size_t)a->n * a->dim * sizeof(float)) == 0,
                "%s: row values differ", what);
  ck_assert_msg(memcmp(a->st, b->st, (size_t)a->n * a->nstate * sizeof(float)) == 0,
                "%s: optimizer state differs", what);
}

static void stats_eq(psd_table_stats a, psd_table_stats b, const char *what) {
#define SEQ(f) ck_assert_msg(a.f == b.f, "%s: " #f " %" PRIu64 " vs %" PRIu64, what, a.f, b.f)
  SEQ(rows);
  SEQ(keys_pulled);
  SEQ(keys_pushed);
  SEQ(hits);
  SEQ(admissions);
  SEQ(evictions_lru);
  SEQ(evictions_ttl);
  SEQ(dropped);
  SEQ(stale);
#undef SEQ
}

/* n distinct ascending keys drawn from universe[0..u) into out. */
static size_t pick_keys(uint64_t *rs, const uint64_t *universe, uint32_t u, size_t n,
                        uint64_t *out) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t key = universe[rndn(rs, u)];
    size_t j = 0;
    while (j < k && out[j] < key) j++;
    if (j < k && out[j] == key) continue;
    memmove(out + j + 1, out + j, (k - j) * sizeof *out);
    out[j] = key;
    k++;
  }
  return k;
}

/* ---------------------------------------------------------------------- */
/* Key index */

/* psd_kindex_find_batch over keys[0..n) in batches of `batch` (the last
 * shorter) finds what the reference says, keys present and absent. */
static void check_batches(const psd_kindex *x, const uint64_t *keys, const uint32_t *ref,
                          uint32_t n, uint32_t batch) {
  uint32_t vals[PSD_KINDEX_BATCH];
  for (uint32_t b = 0; b < n; b += batch) {
    uint32_t m = n - b < batch ? n - b : batch;
    psd_kindex_find_batch(x, keys + b, m, n - b, vals);
    for (uint32_t j = 0; j < m; j++)
      ck_assert_msg(vals[j] == ref[b + j], "batch of %u at %u: key %u found %u, not %u", batch,
                    b, j, vals[j], ref[b + j]);
  }
}
/* Random inserts, removals, lookups and clears against a plain array. */
START_TEST(index_vs_reference) {
  uint64_t rs = tu_seed("index_vs_reference");
  enum { U = 3000, OPS = 60000 };
  uint64_t *keys = malloc(U * sizeof *keys);
  uint32_t *ref = malloc(U * sizeof *ref); /* value, or NONE */
  ck_assert(keys && ref);
  for (uint32_t i = 0; i < U; i++) {
    /* a few keys close together (0, 1, 2...) and the rest anywhere */
    keys[i] = i < 64 ? i : rnd64(&rs);
    for (uint32_t j = 0; j < i; j++)
      if (keys[j] == keys[i]) keys[i] = rnd64(&rs), j = (uint32_t)-1;
    ref[i] = PSD_KINDEX_NONE;
  }
  psd_kindex x;
  ck_assert_int_eq(psd_kindex_init(&x), 0);
  uint64_t n = 0;
  for (uint32_t op = 0; op < OPS; op++) {
    uint32_t i = rndn(&rs, op < OPS / 2 ? U : U / 10); /* dense, then churn */
    double c = rndu(&rs);
    if (c < 0.45) {
      if (ref[i] == PSD_KINDEX_NONE) {
        ck_assert_int_eq(psd_kindex_reserve(&x, n + 1), 0);
        psd_kindex_insert(&x, keys[i], op);
        ref[i] = op;
        n++;
      }
    } else if (c < 0.85) {
      int had = ref[i] != PSD_KINDEX_NONE;
      ck_assert_int_eq(psd_kindex_remove(&x, keys[i]), had);
      if (had) n--;
      ref[i] = PSD_KINDEX_NONE;
    } else if (c < 0.9999) {
      ck_assert_uint_eq(psd_kindex_find(&x, keys[i]), ref[i]);
    } else {
      psd_kindex_clear(&x);
      for (uint32_t j = 0; j < U; j++) ref[j] = PSD_KINDEX_NONE;
      n = 0;
    }
    ck_assert_uint_eq(x.n, n);
    /* the load factor holds after every reserve */
    ck_assert_uint_le(x.n * PSD_KINDEX_LOAD_DEN, x.nslots * PSD_KINDEX_LOAD_NUM);
    if (op % 997 == 0) {
      ck_assert_uint_eq(psd_kindex_check(&x), 0);
      for (uint32_t j = 0; j < U; j++) ck_assert_uint_eq(psd_kindex_find(&x, keys[j]), ref[j]);
      check_batches(&x, keys, ref, U, 1 + op % PSD_KINDEX_BATCH);
    }
  }
  ck_assert_uint_eq(psd_kindex_check(&x), 0);
  for (uint32_t j = 0; j < U; j++) ck_assert_uint_eq(psd_kindex_find(&x, keys[j]), ref[j]);
  check_batches(&x, keys, ref, U, PSD_KINDEX_BATCH);
  psd_kindex_free(&x);
  free(keys);
  free(ref);
}
END_TEST

/* Keys whose home slots are 14, 15, 15, 15, 0, 1, 1 of a 16-slot index:
 * one cluster from slot 14 around the end to slot 4. Every order of
 * deleting all seven must leave the rest findable and the index valid
 * (an entry never moves before its home, across the wrap too). */
START_TEST(index_backward_shift_wraps) {
  psd_kindex x;
  ck_assert_int_eq(psd_kindex_init(&x), 0);
  ck_assert_uint_eq(x.nslots, 16);
  const uint64_t homes[7] = {14, 15, 15, 15, 0, 1, 1};
  uint64_t keys[7];
  int used = 0;
  uint64_t cand = 1000;
  for (int i = 0; i < 7; i++) {
    while (psd_kindex_home(&x, cand) != homes[i]) cand++;
    keys[i] = cand++;
    used++;
  }
  ck_assert_int_eq(used, 7);
  int perm[7] = {0, 1, 2, 3, 4, 5, 6};
  long orders = 0;
  for (;;) {
    /* build: the cluster 14..4 in insertion order */
    ck_assert_int_eq(psd_kindex_reserve(&x, 7), 0);
    for (int i = 0; i < 7; i++) psd_kindex_insert(&x, keys[i], (uint32_t)i);
    ck_assert_uint_eq(x.nslots, 16);
    ck_assert_uint_eq(psd_kindex_check(&x), 0);
    for (int d = 0; d < 7; d++) {
      ck_assert_int_eq(psd_kindex_remove(&x, keys[perm[d]]), 1);
      ck_assert_int_eq(psd_kindex_remove(&x, keys[perm[d]]), 0);
      ck_assert_msg(psd_kindex_check(&x) == 0, "order %ld, after deleting %d", orders, d);
      for (int e = d + 1; e < 7; e++)
        ck_assert_uint_eq(psd_kindex_find(&x, keys[perm[e]]), (uint32_t)perm[e]);
      for (int e = 0; e <= d; e++)
        ck_assert_uint_eq(psd_kindex_find(&x, keys[perm[e]]), PSD_KINDEX_NONE);
      uint32_t ref[7]; /* the batch probes across the wrap too */
      for (int e = 0; e < 7; e++) ref[perm[e]] = e > d ? (uint32_t)perm[e] : PSD_KINDEX_NONE;
      check_batches(&x, keys, ref, 7, 1 + (uint32_t)(orders % 7));
    }
    ck_assert_uint_eq(x.n, 0);
    orders++;
    /* next permutation */
    int i = 5;
    while (i >= 0 && perm[i] > perm[i + 1]) i--;
    if (i < 0) break;
    int j = 6;
    while (perm[j] < perm[i]) j--;
    int tmp = perm[i];
    perm[i] = perm[j], perm[j] = tmp;
    for (int a = i + 1, b = 6; a < b; a++, b--) tmp = perm[a], perm[a] = perm[b], perm[b] = tmp;
  }
  ck_assert_int_eq(orders, 5040);
  /* generations: a clear empties it; the old entries stay gone */
  ck_assert_int_eq(psd_kindex_reserve(&x, 3), 0);
  for (int i = 0; i < 3; i++) psd_kindex_insert(&x, keys[i], (uint32_t)i);
  psd_kindex_clear(&x);
  for (int i = 0; i < 7; i++) ck_assert_uint_eq(psd_kindex_find(&x, keys[i]), PSD_KINDEX_NONE);
  int added = 0;
  ck_assert_uint_eq(psd_kindex_upsert(&x, keys[2], 9, &added), 9);
  ck_assert_int_eq(added, 1);
  ck_assert_uint_eq(psd_kindex_upsert(&x, keys[2], 10, &added), 9);
  ck_assert_int_eq(added, 0);
  ck_assert_uint_eq(psd_kindex_check(&x), 0);
  psd_kindex_free(&x);
}
END_TEST

/* The table's slot hash is not the ps-choosing one: keys that all share
 * ps__table_shard(key, 8) == 3 still spread over the index's slots. */
START_TEST(index_hash_independent_of_shard) {
  psd_kindex x;
  ck_assert_int_eq(psd_kindex_init(&x), 0);
  ck_assert_int_eq(psd_kindex_reserve(&x, 5000), 0); /* 8192 slots */
  ck_assert_uint_eq(x.nslots, 8192);
  static uint32_t hits[8192];
  memset(hits, 0, sizeof hits);
  uint32_t n = 0;
  for (uint64_t k = 0; n < 40000; k++) {
    if (ps__table_shard(k, 8) != 3) continue;
    hits[psd_kindex_home(&x, k)]++;
    n++;
  }
  /* ~4.9 per slot: an unrelated hash leaves ~0.7% of slots empty; one
   * correlated with the shard's low 3 bits would leave far more */
  uint32_t empty = 0;
  for (uint32_t i = 0; i < 8192; i++) empty += hits[i] == 0;
  ck_assert_msg(empty < 200, "%u of 8192 slots never a home", empty);
  psd_kindex_free(&x);
}
END_TEST

/* Keys chosen to share their home under a hash known in advance (the
 * index's hash before it was salted, computed from the source as an
 * attacker holding the job's secret would) would put a whole pull's new
 * keys in one cluster of linear probing: each insert walking all of it
 * (a 1M-key pull took psd over 15 s). Each index draws its own salt: the
 * chosen keys spread over its slots like any others. */
static uint64_t unsalted_hash(uint64_t key) {
  key ^= 0x9e3779b97f4a7c15ULL;
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  return key ^ (key >> 33);
}
START_TEST(index_salted_against_flooding) {
  enum { N = 20000 };
  static uint64_t keys[N];
  uint32_t n = 0;
  for (uint64_t k = 1; n < N; k++) /* top 10 bits zero: ~1 key in 1024 */
    if (unsalted_hash(k) >> 54 == 0) keys[n++] = k;
  psd_kindex x, y;
  ck_assert_int_eq(psd_kindex_init(&x), 0);
  ck_assert_int_eq(psd_kindex_init(&y), 0);
  ck_assert_uint_ne(x.salt, y.salt);
  ck_assert_int_eq(psd_kindex_reserve(&x, N), 0); /* 32768 slots */
  static uint8_t home_used[32768];
  memset(home_used, 0, sizeof home_used);
  uint32_t homes = 0;
  for (uint32_t i = 0; i < N; i++) {
    uint64_t h = psd_kindex_home(&x, keys[i]);
    ck_assert_uint_lt(h, sizeof home_used);
    homes += !home_used[h];
    home_used[h] = 1;
  }
  /* unsalted, all N share the first 32 homes; spread evenly, ~14,000 */
  ck_assert_msg(homes > 12000, "%u distinct homes of %u chosen keys", homes, N);
  for (uint32_t i = 0; i < N; i++) psd_kindex_insert(&x, keys[i], i);
  ck_assert_uint_eq(psd_kindex_check(&x), 0);
  psd_kindex_free(&x);
  psd_kindex_free(&y);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* The table against a plain model: an array in LRU order */

#define RDIM 3   /* floats per row in the model test */
#define RCAP 40  /* its capacity */
#define RTTL 6   /* its evict_after_steps */

typedef struct {
  uint64_t key;     /* row's key */
  float v[RDIM];    /* its values */
  uint64_t touched; /* its last touch */
} ref_row;

typedef struct {
  ref_row rows[RCAP];    /* oldest first */
  uint32_t n;            /* rows stored */
  uint64_t step;         /* the table's step */
  psd_table_stats st;    /* the counters the table should show */
  psd_table_spec spec;   /* for the initializer */
} ref_table;

static int ref_find(const ref_table *m, uint64_t key) {
  for (uint32_t i = 0; i < m->n; i++)
    if (m->rows[i].key == key) return (int)i;
  return -1;
}
static void ref_remove(ref_table *m, uint32_t i) {
  memmove(m->rows + i, m->rows + i + 1, (m->n - i - 1) * sizeof *m->rows);
  m->n--;
}
/* Touch row i: it moves to the newest end; returns its new position. */
static uint32_t ref_touch(ref_table *m, uint32_t i) {
  ref_row r = m->rows[i];
  ref_remove(m, i);
  r.touched = m->step;
  m->rows[m->n++] = r;
  return m->n - 1;
}
static void ref_pull(ref_table *m, const uint64_t *keys, size_t n, int create, float *out) {
  m->st.keys_pulled += n;
  for (size_t k = 0; k < n; k++) {
    int i = ref_find(m, keys[k]);
    if (i >= 0) {
      m->st.hits++;
    } else if (create) {
      if (m->n == RCAP) {
        ref_remove(m, 0);
        m->st.evictions_lru++;
      }
      ref_row r = {keys[k], {0}, m->step};
      psd_rowinit_row(&m->spec, keys[k], r.v);
      m->rows[m->n++] = r;
      m->st.admissions++;
      i = (int)m->n - 1;
    }
    if (i < 0) {
      psd_rowinit_row(&m->spec, keys[k], out + k * RDIM);
      continue;
    }
    i = (int)ref_touch(m, (uint32_t)i);
    memcpy(out + k * RDIM, m->rows[i].v, sizeof m->rows[i].v);
  }
  m->st.rows = m->n;
}
/* One worker, replicas 1: every push is a step, SGD applied at once. */
static void ref_push(ref_table *m, const uint64_t *keys, size_t n, const float *g) {
  const float lr = (float)m->spec.lr, s = 1.0f;
  m->st.keys_pushed += n;
  for (size_t k = 0; k < n; k++) {
    int i = ref_find(m, keys[k]);
    if (i < 0) {
      m->st.dropped++;
      continue;
    }
    for (int j = 0; j < RDIM; j++) {
      float w = m->rows[i].v[j];
      m->rows[i].v[j] = w - lr * (s * g[k * RDIM + j]);
    }
    ref_touch(m, (uint32_t)i);
  }
  m->step++;
  while (m->n > 0 && m->step - m->rows[0].touched > RTTL) {
    ref_remove(m, 0);
    m->st.evictions_ttl++;
  }
  m->st.rows = m->n;
}

static void ref_compare_walk(const ref_table *m, psd_table *t, uint32_t op) {
  dump d = dump_of(t);
  ck_assert_msg(d.n == m->n, "op %u: %u rows, model %u", op, d.n, m->n);
  for (uint32_t i = 0; i < m->n; i++) {
    ck_assert_msg(d.keys[i] == m->rows[i].key, "op %u: LRU position %u differs", op, i);
    ck_assert_uint_eq(d.touched[i], m->rows[i].touched);
    ck_assert(memcmp(d.v + (size_t)i * RDIM, m->rows[i].v, sizeof m->rows[i].v) == 0);
  }
  dump_free(&d);
}

/* Thousands of random pulls (creating or read-only) and pushes over a
 * universe of keys 4x the capacity: the index under create/evict churn,
 * LRU and TTL evictions, and SGD, bit for bit against the model. */
START_TEST(table_vs_model) {
  uint64_t rs = tu_seed("table_vs_model");
  enum { U = 4 * RCAP, OPS = 6000, MAXK = 16 };
  uint64_t universe[U];
  for (uint32_t i = 0; i < U; i++) universe[i] = i < U / 2 ? i * 7 : rnd64(&rs); /* distinct enough */
  static ref_table m;
  memset(&m, 0, sizeof m);
  m.spec = spec_base("model", RDIM, RCAP);
  m.spec.init_kind = PS_INIT_NORMAL;
  m.spec.init_a = 0.0;
  m.spec.init_b = 1.0;
  m.spec.init_seed = 7;
  m.spec.evict_after_steps = RTTL;
  psd_table *t = mk(&m.spec, 1, 1, 0);
  uint64_t keys[MAXK];
  float out[MAXK * RDIM], want[MAXK * RDIM], g[MAXK * RDIM];
  for (uint32_t op = 0; op < OPS; op++) {
    size_t n = pick_keys(&rs, universe, U, 1 + rndn(&rs, MAXK), keys);
    if (rndu(&rs) < 0.6) {
      int create = rndu(&rs) < 0.85;
      ck_assert_int_eq(psd_table_pull(t, keys, n, create, out), 0);
      ref_pull(&m, keys, n, create, want);
      ck_assert_msg(memcmp(out, want, n * RDIM * sizeof(float)) == 0, "op %u: pull differs", op);
    } else {
      for (size_t i = 0; i < n * RDIM; i++) g[i] = (float)(rndu(&rs) - 0.5);
      uint64_t dropped = 0, before = m.st.dropped;
      ck_assert_int_eq(psd_table_push(t, 0, m.step, keys, n, g, &dropped), 1);
      ref_push(&m, keys, n, g);
      ck_assert_uint_eq(dropped, m.st.dropped - before);
    }
    ck_assert_uint_eq(psd_table_step(t), m.step);
    stats_eq(psd_table_get_stats(t), m.st, "table_vs_model");
    ck_assert_uint_le(psd_table_get_stats(t).rows, RCAP);
    if (op % 50 == 0) ref_compare_walk(&m, t, op);
  }
  ck_assert_uint_gt(m.st.evictions_lru, 0); /* the run did reach both kinds */
  ck_assert_uint_gt(m.st.evictions_ttl, 0);
  psd_table_destroy(t);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Row rules against double-precision references */

#define ODIM 5 /* odd: the kernels' vector tails run too */

static int close_to(double got, double want) {
  return fabs(got - want) <= RTOL * fabs(want) + 1e-6;
}

/* The gradient of key at step s, element j (deterministic, mixed signs). */
static float grad_at(uint64_t key, uint64_t s, int j) {
  return (float)(0.3 * sin(1.7 * (double)(s + 1) + 0.9 * j + (double)key) + 0.05 * j);
}

/* Pulls keys 1 and 2 (creating them) and returns the stored initial row of
 * key 1 in w0; a table of one worker, one replica. */
static psd_table *rule_table(const psd_table_spec *s, double w0[ODIM]) {
  psd_table *t = mk(s, 1, 1, 0);
  const uint64_t keys[2] = {1, 2};
  float out[2 * ODIM];
  ck_assert_int_eq(psd_table_pull(t, keys, 2, 1, out), 0);
  for (int j = 0; j < ODIM; j++) w0[j] = out[j];
  return t;
}

/* One step: key 2 always gets a gradient, key 1 only when with1. */
static void rule_step(psd_table *t, int with1) {
  const uint64_t s = psd_table_step(t);
  uint64_t keys[2];
  float g[2 * ODIM];
  size_t n = 0;
  if (with1) {
    keys[n] = 1;
    for (int j = 0; j < ODIM; j++) g[n * ODIM + j] = grad_at(1, s, j);
    n++;
  }
  keys[n] = 2;
  for (int j = 0; j < ODIM; j++) g[n * ODIM + j] = grad_at(2, s, j);
  n++;
  ck_assert_int_eq(psd_table_push(t, 0, s, keys, n, g, NULL), 1);
}

static void row_close(psd_table *t, const double *want, const char *what) {
  find_ctx f;
  ck_assert(find_row(t, 1, &f));
  for (int j = 0; j < ODIM; j++)
    ck_assert_msg(close_to(f.v[j], want[j]), "%s: element %d is %.9g, reference %.9g", what, j,
                  f.v[j], want[j]);
}

START_TEST(rule_sgd) {
  psd_table_spec s = spec_base("sgd", ODIM, 8);
  s.init_kind = PS_INIT_UNIFORM, s.init_a = -1, s.init_b = 1;
  s.lr = 0.25;
  double w[ODIM];
  psd_table *t = rule_table(&s, w);
  for (uint64_t step = 0; step < 6; step++) {
    rule_step(t, 1);
    for (int j = 0; j < ODIM; j++) w[j] -= s.lr * grad_at(1, step, j);
    row_close(t, w, "sgd");
  }
  psd_table_destroy(t);
}
END_TEST

START_TEST(rule_adagrad) {
  psd_table_spec s = spec_base("adagrad", ODIM, 8);
  s.init_kind = PS_INIT_NORMAL, s.init_a = 0, s.init_b = 0.5;
  s.opt = PS_TOPT_ADAGRAD;
  s.lr = 0.1, s.initial_accumulator = 0.1, s.epsilon = 1e-7;
  double w[ODIM], a[ODIM];
  psd_table *t = rule_table(&s, w);
  for (int j = 0; j < ODIM; j++) a[j] = s.initial_accumulator;
  for (uint64_t step = 0; step < 8; step++) {
    int with1 = step % 3 != 1;
    rule_step(t, with1);
    for (int j = 0; with1 && j < ODIM; j++) {
      double g = grad_at(1, step, j);
      a[j] += g * g;
      w[j] -= s.lr * g / (sqrt(a[j]) + s.epsilon);
    }
    row_close(t, w, "adagrad");
  }
  find_ctx f;
  ck_assert(find_row(t, 1, &f));
  for (int j = 0; j < ODIM; j++) ck_assert(close_to(f.st[j], a[j]));
  psd_table_destroy(t);
}
END_TEST

/* Adam's bias correction at a row's step t, from the table computed at
 * init (t <= PSD_ROWOPT_ADAM_STEPS) and beyond it: each update of a fresh
 * m = v = 0 matches TF's form at exactly that t (t - 1 or t + 1 would be
 * ~3e-4 off, relatively, at t = 1024). */
START_TEST(rule_adam_correction_steps) {
  psd_table_spec s = spec_base("adam-t", ODIM, 8);
  s.opt = PS_TOPT_ADAM;
  s.lr = 0.01, s.beta1 = 0.9, s.beta2 = 0.999, s.epsilon = 1e-8;
  psd_rowopt o;
  psd_rowopt_init(&o, &s);
  const uint32_t ts[] = {1, 2, PSD_ROWOPT_ADAM_STEPS - 1, PSD_ROWOPT_ADAM_STEPS,
                         PSD_ROWOPT_ADAM_STEPS + 1, 5000};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) {
    float row[ODIM], st[2 * ODIM + 1] = {0}, g[ODIM];
    uint32_t before = ts[k] - 1, after;
    memcpy(&st[2 * ODIM], &before, sizeof before);
    for (int j = 0; j < ODIM; j++) row[j] = 0.0f, g[j] = 0.5f + 0.25f * (float)j;
    psd_rowopt_apply(&o, row, st, g, 1.0f);
    memcpy(&after, &st[2 * ODIM], sizeof after);
    ck_assert_uint_eq(after, ts[k]);
    double lr_t = s.lr * sqrt(1 - pow(s.beta2, ts[k])) / (1 - pow(s.beta1, ts[k]));
    for (int j = 0; j < ODIM; j++) {
      double m = (1 - s.beta1) * g[j], v = (1 - s.beta2) * g[j] * g[j];
      double want = -lr_t * m / (sqrt(v) + s.epsilon); /* float steps: ~1e-7 */
      ck_assert_msg(fabs(row[j] - want) <= 2e-6 * fabs(want),
                    "t %u, element %d: %.9g, want %.9g", ts[k], j, row[j], want);
    }
  }
}
END_TEST

/* Lazy Adam: key 1 gets gradients at steps 0 and 5 only, so its bias
 * correction uses t = 1, then t = 2 (not the table's step 6). */
START_TEST(rule_adam_lazy) {
  psd_table_spec s = spec_base("adam", ODIM, 8);
  s.init_kind = PS_INIT_NORMAL, s.init_a = 0, s.init_b = 0.5;
  s.opt = PS_TOPT_ADAM;
  s.lr = 0.01, s.beta1 = 0.9, s.beta2 = 0.999, s.epsilon = 1e-8;
  double w[ODIM], m[ODIM] = {0}, v[ODIM] = {0}, eager[ODIM];
  psd_table *t = rule_table(&s, w);
  uint32_t rt = 0;
  for (uint64_t step = 0; step < 6; step++) {
    int with1 = step == 0 || step == 5;
    rule_step(t, with1);
    if (!with1) continue;
    rt++;
    double lr_t = s.lr * sqrt(1 - pow(s.beta2, rt)) / (1 - pow(s.beta1, rt));
    double lr_eager = s.lr * sqrt(1 - pow(s.beta2, (double)step + 1)) /
                      (1 - pow(s.beta1, (double)step + 1));
    for (int j = 0; j < ODIM; j++) {
      double g = grad_at(1, step, j);
      m[j] = s.beta1 * m[j] + (1 - s.beta1) * g;
      v[j] = s.beta2 * v[j] + (1 - s.beta2) * g * g;
      eager[j] = w[j] - lr_eager * m[j] / (sqrt(v[j]) + s.epsilon);
      w[j] -= lr_t * m[j] / (sqrt(v[j]) + s.epsilon);
    }
    row_close(t, w, "adam");
  }
  find_ctx f;
  ck_assert(find_row(t, 1, &f));
  uint32_t t_bits;
  memcpy(&t_bits, &f.st[2 * ODIM], sizeof t_bits);
  ck_assert_uint_eq(t_bits, 2);
  for (int j = 0; j < ODIM; j++) {
    ck_assert(close_to(f.st[j], m[j]));
    ck_assert(close_to(f.st[ODIM + j], v[j]));
    /* the table's step in the correction would be far off */
    ck_assert_msg(!close_to(f.v[j], eager[j]), "element %d matches the non-lazy update", j);
  }
  ck_assert_uint_eq(psd_rowopt_state_floats(&s), 2 * ODIM + 1);
  psd_table_destroy(t);
}
END_TEST

/* FTRL-proximal as psclient.h states it, all in double. */
static void ftrl_ref(const psd_table_spec *s, double *w, double *z, double *n, double g) {
  double n1 = *n + g * g;
  *z += g - (sqrt(n1) - sqrt(*n)) / s->lr * *w;
  *n = n1;
  *w = fabs(*z) <= s->l1 ? 0.0
                         : -(*z - copysign(s->l1, *z)) / ((s->ftrl_beta + sqrt(*n)) / s->lr + s->l2);
}

START_TEST(rule_ftrl) {
  psd_table_spec s = spec_base("ftrl", ODIM, 8);
  s.init_kind = PS_INIT_NORMAL, s.init_a = 0, s.init_b = 0.5; /* replaced at once */
  s.opt = PS_TOPT_FTRL;
  s.lr = 0.5, s.l1 = 0.01, s.l2 = 0.1, s.ftrl_beta = 1.0;
  double w[ODIM], z[ODIM] = {0}, n[ODIM] = {0};
  psd_table *t = rule_table(&s, w);
  for (uint64_t step = 0; step < 8; step++) {
    int with1 = step != 3;
    rule_step(t, with1);
    for (int j = 0; with1 && j < ODIM; j++) ftrl_ref(&s, &w[j], &z[j], &n[j], grad_at(1, step, j));
    row_close(t, w, "ftrl");
  }
  find_ctx f;
  ck_assert(find_row(t, 1, &f));
  for (int j = 0; j < ODIM; j++) {
    ck_assert(close_to(f.st[j], z[j]));
    ck_assert(close_to(f.st[ODIM + j], n[j]));
  }
  psd_table_destroy(t);

  /* A strong l1 holds every weight at exactly +0 (no -0, no tiny value),
   * whatever the initializer gave the row. */
  s.l1 = 5.0;
  t = rule_table(&s, w);
  for (uint64_t step = 0; step < 4; step++) rule_step(t, 1);
  ck_assert(find_row(t, 1, &f));
  for (int j = 0; j < ODIM; j++) {
    uint32_t bits;
    memcpy(&bits, &f.v[j], sizeof bits);
    ck_assert_msg(bits == 0, "element %d is %g (bits %08x), not +0", j, f.v[j], bits);
  }
  psd_table_destroy(t);

  /* beta 0 and l2 0 with a zero gradient (n stays 0): 0, not NaN */
  s.l1 = 0.0, s.l2 = 0.0, s.ftrl_beta = 0.0;
  t = rule_table(&s, w);
  const uint64_t k1 = 1;
  const float zero[ODIM] = {0};
  ck_assert_int_eq(psd_table_push(t, 0, 0, &k1, 1, zero, NULL), 1);
  ck_assert(find_row(t, 1, &f));
  for (int j = 0; j < ODIM; j++) ck_assert_msg(f.v[j] == 0.0f, "element %d is %g", j, f.v[j]);
  psd_table_destroy(t);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* The SyncReplicas rule for rows */

#define SDIM 6
#define SKEYS 200

/* A table holding rows for keys 0..SKEYS-1 (normal init). */
static psd_table *sync_table(uint32_t workers, uint32_t replicas, int async) {
  psd_table_spec s = spec_base("sync", SDIM, 4 * SKEYS);
  s.init_kind = PS_INIT_NORMAL, s.init_b = 1.0, s.init_seed = 3;
  s.lr = 0.3;
  psd_table *t = mk(&s, workers, replicas, async);
  uint64_t keys[SKEYS];
  static float out[SKEYS * SDIM];
  for (uint64_t k = 0; k < SKEYS; k++) keys[k] = k;
  ck_assert_int_eq(psd_table_pull(t, keys, SKEYS, 1, out), 0);
  return t;
}

/* 2 workers pushing b keys each (overlapping) give, bit for bit, what 1
 * worker gets pushing the union with the summed gradients divided by the
 * 2 pushes aggregated (SGD), step after step. */
START_TEST(sync_two_workers_equal_union) {
  uint64_t rs = tu_seed("sync_two_workers_equal_union");
  psd_table *two = sync_table(2, 2, 0), *one = sync_table(1, 1, 0);
  enum { B = 60 };
  uint64_t ka[B], kb[B], ku[2 * B];
  static float ga[B * SDIM], gb[B * SDIM], gu[2 * B * SDIM];
  uint64_t universe[SKEYS + 20];
  for (uint32_t i = 0; i < SKEYS + 20; i++) universe[i] = i; /* 20 keys with no row */
  for (uint64_t step = 0; step < 25; step++) {
    size_t na = pick_keys(&rs, universe, SKEYS + 20, B, ka);
    size_t nb = pick_keys(&rs, universe, SKEYS + 20, B, kb);
    for (size_t i = 0; i < na * SDIM; i++) ga[i] = (float)(rndu(&rs) - 0.5);
    for (size_t i = 0; i < nb * SDIM; i++) gb[i] = (float)(rndu(&rs) - 0.5);
    /* the union, gradients summed in push order, then halved */
    size_t i = 0, j = 0, nu = 0;
    while (i < na || j < nb) {
      int take_a = j == nb || (i < na && ka[i] <= kb[j]);
      int take_b = i == na || (j < nb && kb[j] <= ka[i]);
      ku[nu] = take_a ? ka[i] : kb[j];
      for (int e = 0; e < SDIM; e++) {
        float v = take_a ? ga[i * SDIM + e] : 0.0f;
        v = take_a && take_b ? v + gb[j * SDIM + e] : take_b ? gb[j * SDIM + e] : v;
        gu[nu * SDIM + e] = v * 0.5f;
      }
      i += take_a, j += take_b, nu++;
    }
    uint64_t d0, d1, du, no_row = 0;
    for (size_t k = 0; k < nu; k++) no_row += ku[k] >= SKEYS;
    ck_assert_int_eq(psd_table_push(two, 1, step, kb, nb, gb, &d1), 0); /* either order */
    ck_assert_int_eq(psd_table_push(two, 0, step, ka, na, ga, &d0), 1);
    ck_assert_int_eq(psd_table_push(one, 0, step, ku, nu, gu, &du), 1);
    ck_assert_uint_eq(psd_table_step(two), step + 1);
    ck_assert_uint_eq(du, no_row);
  }
  /* every row, read in the same order from both */
  uint64_t all[SKEYS];
  static float ra[SKEYS * SDIM], rb[SKEYS * SDIM];
  for (uint64_t k = 0; k < SKEYS; k++) all[k] = k;
  ck_assert_int_eq(psd_table_pull(two, all, SKEYS, 0, ra), 0);
  ck_assert_int_eq(psd_table_pull(one, all, SKEYS, 0, rb), 0);
  for (size_t e = 0; e < SKEYS * SDIM; e++)
    ck_assert_msg(memcmp(&ra[e], &rb[e], sizeof(float)) == 0, "key %zu element %zu: %.9g vs %.9g",
                  e / SDIM, e % SDIM, ra[e], rb[e]);
  /* the 20 keys with no row were dropped, never stored */
  psd_table_stats sa = psd_table_get_stats(two), sb = psd_table_get_stats(one);
  ck_assert_uint_gt(sa.dropped, 0);
  ck_assert_uint_gt(sb.dropped, 0);
  ck_assert_uint_eq(sa.rows, SKEYS);
  ck_assert_uint_eq(sb.rows, SKEYS);
  psd_table_destroy(two);
  psd_table_destroy(one);
}
END_TEST

/* Duplicates, stale and future pushes, missing workers, a bad worker. */
START_TEST(sync_refusals) {
  psd_table *t = sync_table(3, 2, 0); /* one backup worker */
  const uint64_t k[2] = {4, 9};
  float g[2 * SDIM];
  for (int i = 0; i < 2 * SDIM; i++) g[i] = 1.0f;
  uint32_t miss[4];
  ck_assert_uint_eq(psd_table_missing(t, miss, 4), 3);
  ck_assert_int_eq(psd_table_push(t, 1, 0, k, 2, g, NULL), 0);
  ck_assert_int_eq(psd_table_push(t, 1, 0, k, 2, g, NULL), PS_EDUPLICATE);
  ck_assert_int_eq(psd_table_push(t, 0, 1, k, 2, g, NULL), PS_EINVAL); /* not reached */
  ck_assert_int_eq(psd_table_push(t, 3, 0, k, 2, g, NULL), PS_EINVAL); /* no such worker */
  ck_assert_uint_eq(psd_table_missing(t, miss, 4), 2);
  ck_assert_uint_eq(miss[0], 0);
  ck_assert_uint_eq(miss[1], 2);
  ck_assert_uint_eq(psd_table_missing(t, miss, 1), 1); /* cap respected */
  ck_assert_int_eq(psd_table_push(t, 0, 0, k, 2, g, NULL), 1); /* completes step 0 */
  ck_assert_uint_eq(psd_table_step(t), 1);
  ck_assert_int_eq(psd_table_push(t, 2, 0, k, 2, g, NULL), PS_ESTALE); /* the backup, late */
  ck_assert_int_eq(psd_table_push(t, 1, 0, k, 2, g, NULL), PS_ESTALE);
  psd_table_stats st = psd_table_get_stats(t);
  ck_assert_uint_eq(st.stale, 2);
  ck_assert_uint_eq(st.keys_pushed, 4); /* refused pushes do not count */
  /* an empty push counts toward the step */
  ck_assert_int_eq(psd_table_push(t, 2, 1, NULL, 0, NULL, NULL), 0);
  ck_assert_int_eq(psd_table_push(t, 0, 1, NULL, 0, NULL, NULL), 1);
  ck_assert_uint_eq(psd_table_step(t), 2);
  /* the step's rows: one update with the mean of the 2 gradients (1) */
  float out[SDIM], init[SDIM];
  ck_assert_int_eq(psd_table_pull(t, k, 1, 0, out), 0);
  psd_rowinit_row(psd_table_spec_of(t), 4, init);
  ck_assert_float_eq(out[0], init[0] - 0.3f * (0.5f * 2.0f));
  psd_table_destroy(t);
}
END_TEST

/* Async: every push is applied at once, undivided, whatever its step. */
START_TEST(async_applies_each_push) {
  psd_table *t = sync_table(2, 2, 1);
  const uint64_t k = 7;
  float g[SDIM], init[SDIM], out[SDIM];
  for (int i = 0; i < SDIM; i++) g[i] = 1.0f;
  psd_rowinit_row(psd_table_spec_of(t), k, init);
  ck_assert_int_eq(psd_table_push(t, 0, 0, &k, 1, g, NULL), 1);
  ck_assert_uint_eq(psd_table_step(t), 1);
  ck_assert_int_eq(psd_table_push(t, 0, 0, &k, 1, g, NULL), 1); /* same worker, same step */
  ck_assert_int_eq(psd_table_push(t, 1, 9, &k, 1, g, NULL), 1); /* any step */
  ck_assert_uint_eq(psd_table_step(t), 3);
  ck_assert_int_eq(psd_table_pull(t, &k, 1, 0, out), 0);
  float w = init[0];
  for (int i = 0; i < 3; i++) w = w - 0.3f * (1.0f * 1.0f);
  ck_assert_float_eq(out[0], w);
  psd_table_destroy(t);
}
END_TEST

/* Keys without rows are dropped and counted, per push and in the stats;
 * so is a key whose row is evicted before its step completes. */
START_TEST(sync_dropped_keys) {
  psd_table_spec s = spec_base("drop", 2, 2);
  psd_table *t = mk(&s, 2, 2, 0);
  const uint64_t ab[2] = {10, 20}, cd[2] = {30, 40}, abx[3] = {10, 20, 99};
  float out[6], g[6] = {1, 1, 1, 1, 1, 1};
  ck_assert_int_eq(psd_table_pull(t, ab, 2, 1, out), 0); /* rows 10, 20 */
  uint64_t dropped = 0;
  ck_assert_int_eq(psd_table_push(t, 0, 0, abx, 3, g, &dropped), 0);
  ck_assert_uint_eq(dropped, 1); /* 99 */
  /* another worker's pull evicts both rows mid-step (capacity 2) */
  ck_assert_int_eq(psd_table_pull(t, cd, 2, 1, out), 0);
  ck_assert_uint_eq(psd_table_get_stats(t).evictions_lru, 2);
  ck_assert_int_eq(psd_table_push(t, 1, 0, cd, 2, g, &dropped), 1);
  ck_assert_uint_eq(dropped, 0);
  psd_table_stats st = psd_table_get_stats(t);
  ck_assert_uint_eq(st.dropped, 3); /* 99, then 10 and 20 at the step's end */
  ck_assert_uint_eq(st.keys_pushed, 5);
  ck_assert_int_eq(psd_table_pull(t, cd, 2, 0, out), 0);
  ck_assert_float_eq(out[0], 0.0f - 0.5f * (0.5f * 1.0f)); /* 30: mean over 2 pushes */
  ck_assert_uint_eq(psd_table_get_stats(t).rows, 2);
  psd_table_destroy(t);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Admission, eviction, capacity */

/* admit_count 3: a key becomes a row at exactly its 3rd sighting (a few
 * keys in a 1024-wide sketch do not collide in all 4 rows); read-only
 * pulls are no sightings; until admitted, pulls read the initializer. */
/* The sketch's counts halve once 10 x its width (1024 here) keys have been
 * pulled since they last did: a key sighted once long ago needs two fresh
 * sightings again, one sighted within the sample is admitted at its
 * second. A checkpoint's aux from 0.2.7 (no count) restores. */
START_TEST(admit_counts_decay) {
  psd_table_spec s = spec_base("decay", 4, 100);
  s.admit_count = 2;
  psd_table *t = mk(&s, 1, 1, 0);
  float out[4];
  const uint64_t a = 7, b = 9, c = 11;
  ck_assert_int_eq(psd_table_pull(t, &a, 1, 1, out), 0);       /* a: 1 sighting */
  for (int i = 0; i < 10000; i++) ck_assert_int_eq(psd_table_pull(t, &b, 1, 1, out), 0);
  ck_assert_int_eq(psd_table_pull(t, &a, 1, 1, out), 0);       /* within the sample */
  ck_assert_uint_eq(psd_table_get_stats(t).rows, 2);           /* b and a */
  ck_assert_int_eq(psd_table_pull(t, &c, 1, 1, out), 0);       /* c: 1 sighting */
  for (int i = 0; i < 10240; i++) ck_assert_int_eq(psd_table_pull(t, &b, 1, 1, out), 0);
  /* read-only pulls count nothing: they would not age it either */
  for (int i = 0; i < 20000; i++) ck_assert_int_eq(psd_table_pull(t, &b, 1, 0, out), 0);
  ck_assert_int_eq(psd_table_pull(t, &c, 1, 1, out), 0);       /* c's count halved to 0 */
  ck_assert_uint_eq(psd_table_get_stats(t).rows, 2);
  /* An aux without the count (0.2.7's layout) restores the generator and
   * the counters: c, at 1 again, is admitted at its next sighting. */
  size_t len;
  const uint8_t *aux = psd_table_aux(t, &len);
  uint8_t *old = malloc(len - 8);
  memcpy(old, aux, 8);
  memcpy(old + 8, aux + 16, len - 16);
  psd_table *r = mk(&s, 1, 1, 0);
  ck_assert_int_eq(psd_table_restore_aux(r, old, len - 8), 0);
  ck_assert_int_eq(psd_table_restore_aux(r, old, len - 9), PS_EINVAL);
  ck_assert_int_eq(psd_table_pull(r, &c, 1, 1, out), 0);
  ck_assert_uint_eq(psd_table_get_stats(r).rows, 1);
  free(old);
  psd_table_destroy(r);
  psd_table_destroy(t);
}
END_TEST

START_TEST(admit_by_count) {
  psd_table_spec s = spec_base("count", 4, 100);
  s.init_kind = PS_INIT_UNIFORM, s.init_a = -1, s.init_b = 1;
  s.admit_count = 3;
  psd_table *t = mk(&s, 1, 1, 0);
  enum { K = 12 };
  uint64_t keys[K];
  float out[K * 4], init[4];
  for (int i = 0; i < K; i++) keys[i] = 1000 + 17 * (uint64_t)i;
  for (int r = 0; r < 5; r++) ck_assert_int_eq(psd_table_pull(t, keys, K, 0, out), 0);
  ck_assert_uint_eq(psd_table_get_stats(t).rows, 0);
  for (int sighting = 1; sighting <= 3; sighting++) {
    ck_assert_int_eq(psd_table_pull(t, keys, K, 1, out), 0);
    psd_table_stats st = psd_table_get_stats(t);
    ck_assert_uint_eq(st.rows, sighting < 3 ? 0 : K);
    ck_assert_uint_eq(st.admissions, sighting < 3 ? 0 : K);
    ck_assert_uint_eq(st.hits, 0);
    for (int i = 0; i < K; i++) {
      psd_rowinit_row(&s, keys[i], init);
      ck_assert(memcmp(out + i * 4, init, sizeof init) == 0);
    }
  }
  ck_assert_int_eq(psd_table_pull(t, keys, K, 0, out), 0);
  ck_assert_uint_eq(psd_table_get_stats(t).hits, K);
  size_t len;
  psd_table_aux(t, &len);
  ck_assert_uint_eq(len, 16 + 4 * 1024); /* generator, keys since the counts halved, then
                                            4 x 1024 counters */
  psd_table_destroy(t);

  /* admit_count 0 and 1: the first sighting */
  for (uint32_t c = 0; c <= 1; c++) {
    s.admit_count = c;
    t = mk(&s, 1, 1, 0);
    ck_assert_int_eq(psd_table_pull(t, keys, K, 1, out), 0);
    ck_assert_uint_eq(psd_table_get_stats(t).rows, K);
    psd_table_aux(t, &len);
    ck_assert_uint_eq(len, 8); /* no sketch */
    psd_table_destroy(t);
  }
}
END_TEST

/* admit_prob 0.25 over 40000 keys, fixed seed: within 4 sigma of 0.25;
 * admit_prob 1 stores every key. */
START_TEST(admit_by_probability) {
  psd_table_spec s = spec_base("prob", 1, 100000);
  s.admit_prob = 0.25;
  s.init_seed = 42;
  psd_table *t = mk(&s, 1, 1, 0);
  enum { N = 40000 };
  uint64_t *keys = malloc(N * sizeof *keys);
  float *out = malloc(N * sizeof *out);
  ck_assert(keys && out);
  for (uint64_t i = 0; i < N; i++) keys[i] = i * 3 + 1;
  ck_assert_int_eq(psd_table_pull(t, keys, N, 1, out), 0);
  double frac = (double)psd_table_get_stats(t).admissions / N;
  double sigma = sqrt(0.25 * 0.75 / N);
  ck_assert_msg(fabs(frac - 0.25) < 4 * sigma, "admitted %.4f of keys", frac);
  /* the same seed draws the same admissions */
  psd_table *u = mk(&s, 1, 1, 0);
  ck_assert_int_eq(psd_table_pull(u, keys, N, 1, out), 0);
  dump a = dump_of(t), b = dump_of(u);
  dump_eq(&a, &b, "same seed");
  dump_free(&a), dump_free(&b);
  psd_table_destroy(t);
  psd_table_destroy(u);
  s.admit_prob = 1.0;
  t = mk(&s, 1, 1, 0);
  ck_assert_int_eq(psd_table_pull(t, keys, 1000, 1, out), 0);
  ck_assert_uint_eq(psd_table_get_stats(t).rows, 1000);
  psd_table_destroy(t);
  free(keys);
  free(out);
}
END_TEST

static void walk_keys(psd_table *t, const uint64_t *want, uint32_t n) {
  dump d = dump_of(t);
  ck_assert_uint_eq(d.n, n);
  for (uint32_t i = 0; i < n; i++)
    ck_assert_msg(d.keys[i] == want[i], "LRU position %u: %" PRIu64 ", want %" PRIu64, i,
                  d.keys[i], want[i]);
  dump_free(&d);
}

/* Full at 3 rows: a new key evicts the least recently touched row; pulls
 * (read-only too) and updates touch. */
START_TEST(evict_lru_order) {
  psd_table_spec s = spec_base("lru", 2, 3);
  psd_table *t = mk(&s, 1, 1, 0);
  float out[8], g[4] = {1, 1, 1, 1};
  const uint64_t abc[3] = {1, 2, 3}, a = 1, b = 2, c = 3, d = 4, e = 5;
  ck_assert_int_eq(psd_table_pull(t, abc, 3, 1, out), 0);
  walk_keys(t, abc, 3);
  ck_assert_int_eq(psd_table_pull(t, &a, 1, 0, out), 0); /* read-only touches */
  ck_assert_int_eq(psd_table_pull(t, &d, 1, 1, out), 0); /* evicts 2 */
  walk_keys(t, (const uint64_t[]){3, 1, 4}, 3);
  ck_assert_int_eq(psd_table_push(t, 0, 0, &c, 1, g, NULL), 1); /* an update touches */
  ck_assert_int_eq(psd_table_pull(t, &e, 1, 1, out), 0);          /* evicts 1 */
  walk_keys(t, (const uint64_t[]){4, 3, 5}, 3);
  ck_assert_int_eq(psd_table_pull(t, &b, 1, 0, out), 0); /* read-only: no row made */
  walk_keys(t, (const uint64_t[]){4, 3, 5}, 3);
  psd_table_stats st = psd_table_get_stats(t);
  ck_assert_uint_eq(st.evictions_lru, 2);
  ck_assert_uint_eq(st.rows, 3);
  psd_table_destroy(t);
}
END_TEST

/* evict_after_steps 2: a row last touched at step s goes when the table
 * reaches s + 3, not a step earlier. */
START_TEST(evict_ttl_boundary) {
  psd_table_spec s = spec_base("ttl", 2, 10);
  s.evict_after_steps = 2;
  psd_table *t = mk(&s, 1, 1, 0);
  float out[4], g[2] = {1, 1};
  const uint64_t a = 1, b = 2;
  ck_assert_int_eq(psd_table_pull(t, &a, 1, 1, out), 0); /* a touched at 0 */
  ck_assert_int_eq(psd_table_push(t, 0, 0, NULL, 0, NULL, NULL), 1);
  ck_assert_int_eq(psd_table_pull(t, &b, 1, 1, out), 0); /* b touched at 1 */
  ck_assert_int_eq(psd_table_push(t, 0, 1, &b, 1, g, NULL), 1); /* b updated at 1 */
  ck_assert_uint_eq(psd_table_step(t), 2);
  ck_assert_uint_eq(psd_table_get_stats(t).rows, 2); /* a: 2 steps old, stays */
  ck_assert_int_eq(psd_table_push(t, 0, 2, NULL, 0, NULL, NULL), 1);
  ck_assert_uint_eq(psd_table_step(t), 3);
  walk_keys(t, &b, 1); /* a went at 0 + 2 + 1 */
  ck_assert_uint_eq(psd_table_get_stats(t).evictions_ttl, 1);
  ck_assert_int_eq(psd_table_push(t, 0, 3, NULL, 0, NULL, NULL), 1);
  ck_assert_uint_eq(psd_table_get_stats(t).rows, 0); /* b (touched at 1) goes at 4 */
  ck_assert_uint_eq(psd_table_get_stats(t).evictions_ttl, 2);
  psd_table_destroy(t);

  /* 0: never */
  s.evict_after_steps = 0;
  t = mk(&s, 1, 1, 0);
  ck_assert_int_eq(psd_table_pull(t, &a, 1, 1, out), 0);
  for (uint64_t st = 0; st < 50; st++)
    ck_assert_int_eq(psd_table_push(t, 0, st, NULL, 0, NULL, NULL), 1);
  ck_assert_uint_eq(psd_table_get_stats(t).rows, 1);
  psd_table_destroy(t);
}
END_TEST

/* Random churn with two workers: rows never exceed the capacity, and the
 * bytes allocated never exceed psd_table_bytes, with the accumulator full
 * too. */
START_TEST(capacity_and_bytes_bound) {
  uint64_t rs = tu_seed("capacity_and_bytes_bound");
  const uint64_t cap = 300;
  for (uint32_t opt = PS_TOPT_SGD; opt <= PS_TOPT_FTRL; opt++) {
    psd_table_spec s = spec_base("bytes", 33, cap);
    s.opt = opt;
    s.admit_count = opt == PS_TOPT_ADAM ? 2 : 1;
    s.evict_after_steps = opt == PS_TOPT_FTRL ? 4 : 0;
    const uint64_t bound = psd_table_bytes(&s);
    psd_table *t = mk(&s, 2, 2, 0);
    enum { U = 1000, MAXK = 400 };
    uint64_t universe[U], keys[MAXK];
    static float out[MAXK * 33], g[MAXK * 33];
    for (uint32_t i = 0; i < U; i++) universe[i] = rnd64(&rs);
    for (size_t i = 0; i < MAXK * 33; i++) g[i] = 0.01f;
    for (int op = 0; op < 300; op++) {
      size_t n = pick_keys(&rs, universe, U, 1 + rndn(&rs, MAXK), keys);
      if (op % 3 != 2) {
        ck_assert_int_eq(psd_table_pull(t, keys, n, 1, out), 0);
      } else {
        uint64_t st = psd_table_step(t);
        ck_assert_int_eq(psd_table_push(t, 0, st, keys, n, g, NULL), 0);
        ck_assert_int_eq(psd_table_push(t, 1, st, NULL, 0, NULL, NULL), 1);
      }
      ck_assert_uint_le(psd_table_get_stats(t).rows, cap);
      ck_assert_msg(psd_table_bytes_now(t) <= bound, "opt %u: %" PRIu64 " bytes now, bound %"
                    PRIu64, opt, psd_table_bytes_now(t), bound);
    }
    if (s.evict_after_steps == 0) ck_assert_uint_eq(psd_table_get_stats(t).rows, cap);
    /* every row accumulated at once, from a sorted list of all of them */
    uint64_t all[300];
    dump d = dump_of(t);
    const uint32_t nall = d.n;
    memcpy(all, d.keys, nall * sizeof *all);
    dump_free(&d);
    for (uint32_t i = 1; i < nall; i++) /* insertion sort */
      for (uint32_t j = i; j > 0 && all[j - 1] > all[j]; j--) {
        uint64_t x = all[j];
        all[j] = all[j - 1], all[j - 1] = x;
      }
    uint64_t st = psd_table_step(t);
    ck_assert_int_eq(psd_table_push(t, 0, st, all, nall, g, NULL), 0);
    ck_assert_msg(psd_table_bytes_now(t) <= bound, "full accumulator: %" PRIu64 " > %" PRIu64,
                  psd_table_bytes_now(t), bound);
    ck_assert_int_eq(psd_table_push(t, 1, st, NULL, 0, NULL, NULL), 1);
    psd_table_destroy(t);
  }
  /* an absurd capacity saturates instead of wrapping */
  psd_table_spec s = spec_base("huge", PS__MAX_TABLE_DIM, UINT64_MAX);
  ck_assert_uint_eq(psd_table_bytes(&s), UINT64_MAX);
  s.capacity = PSD_TABLE_MAX_ROWS;
  ck_assert_uint_gt(psd_table_bytes(&s), PSD_TABLE_MAX_ROWS * (uint64_t)PS__MAX_TABLE_DIM * 4);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Initializer */

/* A key's row is the same whatever order or batch it is pulled in, and on
 * whichever table (every ps, every worker); keys, names, seeds differ. */
START_TEST(init_deterministic) {
  psd_table_spec s = spec_base("emb", 16, 1000);
  s.init_kind = PS_INIT_TRUNCATED_NORMAL, s.init_a = 0.0, s.init_b = 0.05, s.init_seed = 11;
  psd_table *a = mk(&s, 1, 1, 0), *b = mk(&s, 1, 1, 0);
  enum { K = 200 };
  uint64_t keys[K];
  static float ra[K * 16], rb[16], ref[16];
  for (int i = 0; i < K; i++) keys[i] = (uint64_t)i * 0x10001 + 5;
  ck_assert_int_eq(psd_table_pull(a, keys, K, 1, ra), 0);
  for (int i = K - 1; i >= 0; i--) { /* one at a time, backwards */
    ck_assert_int_eq(psd_table_pull(b, &keys[i], 1, 1, rb), 0);
    ck_assert(memcmp(rb, ra + i * 16, sizeof rb) == 0);
    psd_rowinit_row(&s, keys[i], ref);
    ck_assert(memcmp(ref, rb, sizeof ref) == 0);
  }
  psd_table_destroy(a);
  psd_table_destroy(b);
  float base[16], other[16];
  psd_rowinit_row(&s, 5, base);
  psd_rowinit_row(&s, 6, other);
  ck_assert(memcmp(base, other, sizeof base) != 0);
  psd_table_spec s2 = s;
  snprintf(s2.name, sizeof s2.name, "emc");
  psd_rowinit_row(&s2, 5, other);
  ck_assert(memcmp(base, other, sizeof base) != 0);
  s2 = s;
  s2.init_seed = 12;
  psd_rowinit_row(&s2, 5, other);
  ck_assert(memcmp(base, other, sizeof base) != 0);
  /* the elements of one row differ from one another */
  int same = 0;
  for (int j = 1; j < 16; j++) same += base[j] == base[0];
  ck_assert_int_eq(same, 0);
}
END_TEST

/* Mean and stddev of 64 x 4000 values of each kind. */
static void moments(const psd_table_spec *s, double *mean, double *sd, double *lo, double *hi) {
  double sum = 0, sq = 0;
  *lo = INFINITY, *hi = -INFINITY;
  float row[64];
  const int n = 4000;
  for (int k = 0; k < n; k++) {
    psd_rowinit_row(s, (uint64_t)k * 2654435761u, row);
    for (int j = 0; j < 64; j++) {
      sum += row[j], sq += (double)row[j] * row[j];
      *lo = fmin(*lo, row[j]), *hi = fmax(*hi, row[j]);
    }
  }
  const double cnt = 64.0 * n;
  *mean = sum / cnt;
  *sd = sqrt(sq / cnt - *mean * *mean);
}

START_TEST(init_moments) {
  psd_table_spec s = spec_base("m", 64, 10);
  double mean, sd, lo, hi;
  s.init_kind = PS_INIT_NORMAL, s.init_a = 0.5, s.init_b = 2.0;
  moments(&s, &mean, &sd, &lo, &hi);
  ck_assert_msg(fabs(mean - 0.5) < 0.03 && fabs(sd - 2.0) < 0.03, "normal: %g %g", mean, sd);
  s.init_kind = PS_INIT_TRUNCATED_NORMAL;
  moments(&s, &mean, &sd, &lo, &hi);
  /* N(0,1) cut at +-2 has stddev 0.8796 */
  ck_assert_msg(fabs(mean - 0.5) < 0.03 && fabs(sd - 2.0 * 0.8796) < 0.03,
                "truncated: %g %g", mean, sd);
  ck_assert(lo >= 0.5 - 4.0 && hi <= 0.5 + 4.0);
  s.init_kind = PS_INIT_UNIFORM, s.init_a = -3.0, s.init_b = 1.0;
  moments(&s, &mean, &sd, &lo, &hi);
  ck_assert_msg(fabs(mean + 1.0) < 0.02 && fabs(sd - 4.0 / sqrt(12.0)) < 0.02, "uniform: %g %g",
                mean, sd);
  ck_assert(lo >= -3.0 && hi < 1.0);
  s.init_kind = PS_INIT_CONSTANT, s.init_a = 0.25;
  moments(&s, &mean, &sd, &lo, &hi);
  ck_assert(lo == 0.25 && hi == 0.25);
  s.init_kind = PS_INIT_ZEROS;
  moments(&s, &mean, &sd, &lo, &hi);
  ck_assert(lo == 0.0 && hi == 0.0);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Checkpoints: walk, restore */

typedef struct {
  psd_table *to; /* table being restored */
  int rc;        /* first failure */
} restore_ctx;
static void restore_fn(void *ctx, uint64_t key, const float *v, const float *st,
                       uint64_t touched) {
  restore_ctx *r = ctx;
  int rc = psd_table_restore_row(r->to, key, v, st, touched);
  if (rc && !r->rc) r->rc = rc;
}

/* A checkpoint of t restored into a new table of the same spec. */
static psd_table *restored(psd_table *t, uint32_t workers, uint32_t replicas) {
  psd_table *u = mk(psd_table_spec_of(t), workers, replicas, 0);
  size_t len;
  const void *aux = psd_table_aux(t, &len);
  ck_assert_int_eq(psd_table_restore_aux(u, aux, len - 1), PS_EINVAL);
  ck_assert_int_eq(psd_table_restore_aux(u, aux, len), 0);
  restore_ctx r = {u, 0};
  psd_table_walk(t, restore_fn, &r);
  ck_assert_int_eq(r.rc, 0);
  psd_table_stats st = psd_table_get_stats(t);
  psd_table_restore_step(u, psd_table_step(t), &st);
  return u;
}

/* Random pulls and pushes on a table (2 workers, whole steps). */
static void churn(psd_table *t, uint64_t *rs, int ops, float *out, float *g) {
  enum { U = 500, MAXK = 64 };
  uint64_t keys[MAXK];
  static uint64_t universe[U];
  for (uint32_t i = 0; i < U; i++) universe[i] = i * 1000003ULL;
  for (int op = 0; op < ops; op++) {
    size_t n = pick_keys(rs, universe, U, 1 + rndn(rs, MAXK), keys);
    if (rndu(rs) < 0.5) {
      ck_assert_int_eq(psd_table_pull(t, keys, n, rndu(rs) < 0.9, out), 0);
    } else {
      for (size_t i = 0; i < n * 8; i++) g[i] = (float)(rndu(rs) - 0.5);
      uint64_t st = psd_table_step(t);
      ck_assert_int_eq(psd_table_push(t, 1, st, keys, n / 2, g, NULL), 0);
      ck_assert_int_eq(psd_table_push(t, 0, st, keys + n / 2, n - n / 2, g, NULL), 1);
    }
  }
}

/* Restoring a walk rebuilds the same rows, state, LRU order, step,
 * counters and admission state; then the same operations on both give
 * bit-identical rows and the same evictions. Both admission kinds. */
START_TEST(checkpoint_round_trip) {
  uint64_t seed = tu_seed("checkpoint_round_trip");
  for (int kind = 0; kind < 2; kind++) {
    psd_table_spec s = spec_base("ck", 8, 150);
    s.init_kind = PS_INIT_NORMAL, s.init_b = 0.1, s.init_seed = 5;
    s.opt = PS_TOPT_ADAM;
    s.evict_after_steps = 12;
    if (kind == 0) s.admit_count = 2;
    else s.admit_prob = 0.5;
    psd_table *t = mk(&s, 2, 2, 0);
    static float out[64 * 8], g[64 * 8], out2[64 * 8];
    uint64_t rs = seed + (uint64_t)kind;
    churn(t, &rs, 400, out, g);
    psd_table *u = restored(t, 2, 2);
    dump a = dump_of(t), b = dump_of(u);
    ck_assert_uint_gt(a.n, 30); /* a walk that left rows to restore (seed 1572178939 leaves 77) */
    dump_eq(&a, &b, "restored");
    dump_free(&a), dump_free(&b);
    size_t la, lb;
    const void *xa = psd_table_aux(t, &la), *xb = psd_table_aux(u, &lb);
    ck_assert_uint_eq(la, lb);
    ck_assert(memcmp(xa, xb, la) == 0);
    ck_assert_uint_eq(psd_table_step(u), psd_table_step(t));
    stats_eq(psd_table_get_stats(u), psd_table_get_stats(t), "restored counters");
    /* the same future on both */
    uint64_t r1 = rs, r2 = rs;
    churn(t, &r1, 300, out, g);
    churn(u, &r2, 300, out2, g);
    a = dump_of(t), b = dump_of(u);
    dump_eq(&a, &b, "after the same operations");
    dump_free(&a), dump_free(&b);
    stats_eq(psd_table_get_stats(u), psd_table_get_stats(t), "counters after");
    ck_assert_uint_gt(psd_table_get_stats(t).evictions_lru, 0);
    /* restore refuses a key twice and a row past capacity */
    const float *zero = out;
    memset(out, 0, sizeof out);
    dump d = dump_of(u);
    ck_assert_int_eq(psd_table_restore_row(u, d.keys[0], zero, zero, 0), PS_EINVAL);
    dump_free(&d);
    psd_table_destroy(t);
    psd_table_destroy(u);
  }
  psd_table_spec s = spec_base("full", 1, 1);
  psd_table *t = mk(&s, 1, 1, 0);
  const float v = 1.0f;
  ck_assert_int_eq(psd_table_restore_row(t, 1, &v, NULL, 0), 0);
  ck_assert_int_eq(psd_table_restore_row(t, 2, &v, NULL, 0), PS_EINVAL);
  psd_table_destroy(t);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Checks: keys, specs, differences */

START_TEST(keys_check) {
  char err[256];
  const uint64_t ok[4] = {0, 5, 6, UINT64_MAX};
  ck_assert_int_eq(psd_tablespec_keys_check(ok, 4, err, sizeof err), 0);
  ck_assert_int_eq(psd_tablespec_keys_check(NULL, 0, err, sizeof err), 0);
  ck_assert_int_eq(psd_tablespec_keys_check(ok, 1, err, sizeof err), 0);
  const uint64_t dup[4] = {1, 2, 2, 3};
  ck_assert_int_eq(psd_tablespec_keys_check(dup, 4, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "key 2 (2)") && strstr(err, "key 1 (2)"), "%s", err);
  const uint64_t down[3] = {1, 9, 4};
  ck_assert_int_eq(psd_tablespec_keys_check(down, 3, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "key 2 (4)"), "%s", err);
}
END_TEST

/* spec_check refuses s with a sentence containing `what`; create too. */
static void refused(const psd_table_spec *s, const char *what) {
  char err[512];
  ck_assert_int_eq(psd_tablespec_check(s, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, what), "'%s' does not mention '%s'", err, what);
  psd_table *t = (psd_table *)1;
  ck_assert_int_eq(psd_table_create(s, 1, 1, 0, &t, err, sizeof err), PS_EINVAL);
  ck_assert_ptr_null(t);
}

START_TEST(spec_check) {
  char err[512];
  psd_table_spec ok = spec_base("t", 8, 100), s;
  for (uint32_t opt = PS_TOPT_SGD; opt <= PS_TOPT_FTRL; opt++) {
    s = ok, s.opt = opt;
    ck_assert_msg(psd_tablespec_check(&s, err, sizeof err) == 0, "%s", err);
  }
  s = ok, s.dim = PS__MAX_TABLE_DIM, s.capacity = PSD_TABLE_MAX_ROWS, s.admit_prob = 1.0;
  ck_assert_msg(psd_tablespec_check(&s, err, sizeof err) == 0, "%s", err);
  s = ok, s.dim = 0, refused(&s, "dim");
  s = ok, s.dim = PS__MAX_TABLE_DIM + 1, refused(&s, "dim");
  s = ok, s.capacity = 0, refused(&s, "capacity");
  s = ok, s.capacity = PSD_TABLE_MAX_ROWS + 1, refused(&s, "capacity");
  s = ok, s.lr = 0, refused(&s, "lr");
  s = ok, s.lr = -0.1, refused(&s, "lr");
  s = ok, s.lr = NAN, refused(&s, "lr");
  s = ok, s.lr = INFINITY, refused(&s, "lr");
  s = ok, s.opt = 4, refused(&s, "opt");
  s = ok, s.opt = PS_TOPT_ADAM, s.beta1 = 1.0, refused(&s, "beta1");
  s = ok, s.opt = PS_TOPT_ADAM, s.beta2 = NAN, refused(&s, "beta2");
  s = ok, s.opt = PS_TOPT_ADAM, s.epsilon = 0, refused(&s, "epsilon");
  s = ok, s.opt = PS_TOPT_ADAGRAD, s.epsilon = NAN, refused(&s, "epsilon");
  s = ok, s.opt = PS_TOPT_ADAGRAD, s.initial_accumulator = -1, refused(&s, "initial_accumulator");
  s = ok, s.opt = PS_TOPT_FTRL, s.l1 = -1, refused(&s, "l1");
  s = ok, s.opt = PS_TOPT_FTRL, s.l2 = NAN, refused(&s, "l2");
  s = ok, s.opt = PS_TOPT_FTRL, s.ftrl_beta = -0.5, refused(&s, "ftrl_beta");
  s = ok, s.init_kind = PS_INIT_GLOROT_UNIFORM, refused(&s, "fan");
  s = ok, s.init_kind = PS_INIT_GLOROT_NORMAL, refused(&s, "glorot_normal");
  s = ok, s.init_kind = 99, refused(&s, "init.kind");
  s = ok, s.init_kind = PS_INIT_UNIFORM, s.init_a = 1, s.init_b = 1, refused(&s, "uniform");
  s = ok, s.init_kind = PS_INIT_NORMAL, s.init_b = 0, refused(&s, "stddev");
  s = ok, s.init_kind = PS_INIT_CONSTANT, s.init_a = 1e39, refused(&s, "init.a");
  s = ok, s.admit_prob = -0.1, refused(&s, "admit_prob");
  s = ok, s.admit_prob = 1.5, refused(&s, "admit_prob");
  s = ok, s.admit_prob = NAN, refused(&s, "admit_prob");
  s = ok, s.admit_count = PS_TABLE_MAX_ADMIT_COUNT + 1, refused(&s, "admit_count");
  s = ok, memset(s.name, 'x', sizeof s.name), refused(&s, "name");
  /* fields of other rules are not read */
  s = ok, s.beta1 = NAN, s.l1 = -5, s.epsilon = 0;
  ck_assert_int_eq(psd_tablespec_check(&s, err, sizeof err), 0);
  s = ok, s.dim = 0;
  ck_assert_int_eq(psd_tablespec_check(&s, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "'t'"), "names the table: %s", err);
}
END_TEST

START_TEST(spec_diff) {
  char err[512];
  psd_table_spec a = spec_base("t", 8, 100), b = a;
  ck_assert_int_eq(psd_tablespec_diff(&a, "worker 0", &b, "worker 1", err, sizeof err), 0);
  b.lr = 0.25;
  ck_assert_int_eq(psd_tablespec_diff(&a, "worker 0", &b, "worker 1", err, sizeof err), 1);
  ck_assert_str_eq(err, "lr is 0.5 for worker 0, 0.25 for worker 1");
  b = a, b.dim = 9;
  ck_assert_int_eq(psd_tablespec_diff(&a, "A", &b, "B", err, sizeof err), 1);
  ck_assert_str_eq(err, "dim is 8 for A, 9 for B");
  b = a, b.lr = 0.5000000000000001;
  ck_assert_int_eq(psd_tablespec_diff(&a, "A", &b, "B", err, sizeof err), 1);
  ck_assert_msg(strstr(err, "0.50000000000000011"), "%s", err);
  b = a, b.opt = PS_TOPT_FTRL;
  ck_assert_int_eq(psd_tablespec_diff(&a, "A", &b, "B", err, sizeof err), 1);
  ck_assert_str_eq(err, "opt is sgd (0) for A, ftrl (3) for B");
  /* fields the rule or initializer does not use do not count */
  b = a, b.beta1 = 0.5, b.l1 = 3, b.init_seed = 9, b.init_a = 4, b.admit_count = 1;
  ck_assert_int_eq(psd_tablespec_diff(&a, "A", &b, "B", err, sizeof err), 0);
  /* ... until they do */
  a.opt = b.opt = PS_TOPT_ADAM;
  ck_assert_int_eq(psd_tablespec_diff(&a, "A", &b, "B", err, sizeof err), 1);
  ck_assert_str_eq(err, "beta1 is 0.9 for A, 0.5 for B");
  a = spec_base("t", 8, 100), a.init_kind = PS_INIT_NORMAL, a.init_b = 1, b = a, b.init_seed = 2;
  ck_assert_int_eq(psd_tablespec_diff(&a, "A", &b, "B", err, sizeof err), 1);
  ck_assert_str_eq(err, "init.seed is 0 for A, 2 for B");
  a = spec_base("t", 8, 100), b = a, b.admit_count = 3;
  ck_assert_int_eq(psd_tablespec_diff(&a, "A", &b, "B", err, sizeof err), 1);
  ck_assert_str_eq(err, "admit_count is 0 for A, 3 for B");
  b = a, b.evict_after_steps = 10, b.capacity = 100;
  ck_assert_int_eq(psd_tablespec_diff(&a, "A", &b, "B", err, sizeof err), 1);
  ck_assert_str_eq(err, "evict_after_steps is 0 for A, 10 for B");
  b = a, b.init_kind = PS_INIT_UNIFORM;
  ck_assert_int_eq(psd_tablespec_diff(&a, "A", &b, "B", err, sizeof err), 1);
  ck_assert_str_eq(err, "init.kind is zeros (0) for A, uniform (2) for B");
}
END_TEST

/* A push with the rows its pull read (psd_table_push_rows) updates those
 * rows while no row changed hands; after an eviction gave one of them to
 * another key, the rows are not trusted (the gradient of a key evicted
 * meanwhile is dropped, not written into its row's new key); a key the
 * pull found no row for is looked up again. */
START_TEST(push_rows_trusted_only_while_epoch_holds) {
  psd_table_spec s = spec_base("rows", 2, 2); /* SGD lr 0.5, zeros, 2 rows */
  psd_table *t = mk(&s, 1, 1, 0);
  const uint64_t k12[2] = {1, 2}, k3 = 3;
  uint32_t rows[2];
  float out[4], g[4] = {1, 1, 1, 1};
  ck_assert_int_eq(psd_table_pull_rows(t, k12, 2, 1, out, rows), 0);
  uint64_t ep = psd_table_epoch(t);
  ck_assert_uint_ne(rows[0], PSD_TABLE_NO_ROW);
  ck_assert_int_eq(psd_table_push_rows(t, 0, 0, k12, 2, g, rows, ep, 0, NULL), 1);
  find_ctx f;
  ck_assert(find_row(t, 1, &f));
  ck_assert_float_eq(f.v[0], -0.5f);
  /* step 1: pull 1 and 2 again, then key 3 evicts the LRU row (1) */
  ck_assert_int_eq(psd_table_pull_rows(t, k12, 2, 1, out, rows), 0);
  ep = psd_table_epoch(t);
  float o3[2];
  ck_assert_int_eq(psd_table_pull(t, &k3, 1, 1, o3), 0);
  ck_assert_uint_ne(psd_table_epoch(t), ep);
  uint64_t dropped = 0;
  ck_assert_int_eq(psd_table_push_rows(t, 0, 1, k12, 2, g, rows, ep, 0, &dropped), 1);
  ck_assert_uint_eq(dropped, 1); /* key 1 is gone */
  ck_assert(find_row(t, 3, &f));
  ck_assert_float_eq(f.v[0], 0.0f); /* not key 1's gradient */
  ck_assert(find_row(t, 2, &f));
  ck_assert_float_eq(f.v[0], -1.0f);
  psd_table_destroy(t);

  /* a key read with no row (read-only), stored by a pull since: found */
  t = mk(&s, 1, 1, 0);
  ck_assert_int_eq(psd_table_pull_rows(t, &k3, 1, 0, o3, rows), 0);
  ck_assert_uint_eq(rows[0], PSD_TABLE_NO_ROW);
  ep = psd_table_epoch(t);
  ck_assert_int_eq(psd_table_pull(t, &k3, 1, 1, o3), 0);
  ck_assert_int_eq(psd_table_push_rows(t, 0, 0, &k3, 1, g, rows, ep, 0, &dropped), 1);
  ck_assert_uint_eq(dropped, 0);
  ck_assert(find_row(t, 3, &f));
  ck_assert_float_eq(f.v[0], -0.5f);
  psd_table_destroy(t);
}
END_TEST


/* ---------------------------------------------------------------------- */
/* Helper threads (psd/par.c) */

typedef struct snap {
  uint64_t *keys, *touched;
  float *vals; /* per row: dim values, then nstate state floats */
  size_t n, cap, width;
} snap;
static void snap_fn(void *ctx, uint64_t key, const float *v, const float *st, uint64_t touched) {
  snap *x = ctx;
  ck_assert_uint_lt(x->n, x->cap);
  x->keys[x->n] = key;
  x->touched[x->n] = touched;
  memcpy(x->vals + x->n * x->width, v, g_dim * sizeof *v);
  memcpy(x->vals + x->n * x->width + g_dim, st, g_nstate * sizeof *st);
  x->n++;
}

/* a and b hold the same rows, in the same walk order, bit for bit, and
 * the same counters. */
static void same_tables(psd_table *a, psd_table *b, size_t cap, const char *when) {
  snap x[2];
  psd_table *t[2] = {a, b};
  g_dim = psd_table_spec_of(a)->dim;
  g_nstate = psd_rowopt_state_floats(psd_table_spec_of(a));
  for (int i = 0; i < 2; i++) {
    x[i] = (snap){malloc(cap * 8), malloc(cap * 8), malloc(cap * (g_dim + g_nstate) * 4), 0,
                  cap, g_dim + g_nstate};
    ck_assert(x[i].keys && x[i].touched && x[i].vals);
    psd_table_walk(t[i], snap_fn, &x[i]);
  }
  ck_assert_msg(x[0].n == x[1].n, "%s: %zu rows vs %zu", when, x[0].n, x[1].n);
  ck_assert_msg(memcmp(x[0].keys, x[1].keys, x[0].n * 8) == 0, "%s: rows differ", when);
  ck_assert_msg(memcmp(x[0].touched, x[1].touched, x[0].n * 8) == 0, "%s: touches", when);
  ck_assert_msg(memcmp(x[0].vals, x[1].vals, x[0].n * x[0].width * 4) == 0, "%s: values", when);
  psd_table_stats sa = psd_table_get_stats(a), sb = psd_table_get_stats(b);
  ck_assert_msg(memcmp(&sa, &sb, sizeof sa) == 0, "%s: counters differ", when);
  for (int i = 0; i < 2; i++) free(x[i].keys), free(x[i].touched), free(x[i].vals);
}

/* The same pulls and pushes on a table served by the loop alone and on
 * one whose big requests run on helper threads: the same replies, rows,
 * LRU order and counters, through admission by count, pulls that evict
 * mid-way (the helpers' reads are redone from there), pushes that use
 * the pull's rows (other rows touched in between, or not: the push's
 * touches are skipped) and two workers' sums. */
START_TEST(threads_change_nothing) {
  uint64_t rs = tu_seed("threads_change_nothing");
  psd_par *par = NULL;
  ck_assert_int_eq(psd_par_create(3, &par), 0);
  const size_t n = 3 * PSD_PAR_MIN_PART + 1000, universe = 3 * n, cap = n + n / 4;
  const size_t other = n / 8; /* read-only pulls between a pull and its push */
  uint64_t *keys = malloc(n * 8), *pool = malloc(universe * 8);
  uint32_t *rows[2] = {malloc(n * 4), malloc(n * 4)};
  float *out[2] = {malloc(n * 4 * 4), malloc(n * 4 * 4)}, *g = malloc(n * 4 * 4);
  ck_assert(keys && pool && rows[0] && rows[1] && out[0] && out[1] && g);
  for (size_t i = 0; i < universe; i++) pool[i] = rnd64(&rs);
  for (uint32_t workers = 1; workers <= 2; workers++) {
    psd_table_spec sp = spec_base("par", 4, cap);
    sp.opt = PS_TOPT_ADAM;
    sp.init_kind = PS_INIT_UNIFORM, sp.init_a = -1, sp.init_b = 1;
    sp.admit_count = 2;
    psd_table *t[2] = {mk(&sp, workers, workers, 0), mk(&sp, workers, workers, 0)};
    psd_table_set_par(t[1], par);
    for (uint64_t step = 0; step < 9; step++) {
      /* n distinct keys of the pool (as psd checks they are) every third
       * step, pulled again in the next two: seen, admitted, every row
       * found */
      if (step % 3 == 0)
        for (size_t i = 0; i < n; i++) {
          size_t j = i + rndn(&rs, (uint32_t)(universe - i));
          uint64_t k = pool[j];
          pool[j] = pool[i], pool[i] = k, keys[i] = k;
        }
      for (uint32_t w = 0; w < workers; w++) {
        uint64_t ep[2], drop[2], clock[2] = {0, 0};
        int rc[2];
        for (int i = 0; i < 2; i++) {
          ep[i] = psd_table_epoch(t[i]);
          uint64_t c0 = psd_table_lru_clock(t[i]);
          rc[i] = psd_table_pull_rows(t[i], keys + w, n - w, 1, out[i], rows[i]);
          /* t[1] passes the clock on as psd's memo would (tmemo.h) */
          if (i == 1 && psd_table_lru_clock(t[1]) - c0 == n - w) clock[1] = c0 + n - w;
        }
        ck_assert_int_eq(rc[0], rc[1]);
        ck_assert_msg(memcmp(out[0], out[1], (n - w) * 4 * 4) == 0, "step %llu: replies differ",
                      (unsigned long long)step);
        ck_assert(memcmp(rows[0], rows[1], (n - w) * 4) == 0);
        for (size_t i = 0; i < (n - w) * 4; i++) g[i] = (float)(rndu(&rs) - 0.5);
        /* Rows of other keys (the last steps') touched in between, in
         * the even steps: the push's own touches then move its rows back
         * to the front. At step 5, every row found and nothing between,
         * t[1]'s push skips them (t[0] never does). */
        for (int i = 0; i < 2 && step % 2 == 0; i++)
          ck_assert_int_eq(psd_table_pull(t[i], pool + n, other, 0, out[i]), 0);
        ck_assert(step % 2 || memcmp(out[0], out[1], other * 4 * 4) == 0);
        for (int i = 0; i < 2; i++)
          rc[i] = psd_table_push_rows(t[i], w, step, keys + w, n - w, g, rows[i], ep[i],
                                      clock[i], &drop[i]);
        ck_assert_int_eq(rc[0], rc[1]);
        ck_assert_uint_eq(drop[0], drop[1]);
      }
      char when[64];
      snprintf(when, sizeof when, "%u workers, step %llu", workers, (unsigned long long)step);
      same_tables(t[0], t[1], cap, when);
    }
    psd_table_stats st = psd_table_get_stats(t[1]);
    ck_assert_uint_gt(st.evictions_lru, 0); /* pulls evicted: the hand-over ran */
    /* steps 2 (the read-only pull between found none of its keys stored
     * yet: it touched nothing) and 5; two workers' pushes are summed,
     * touched as the sum is applied */
    ck_assert_uint_eq(psd_table_touch_skips(t[1]), workers == 1 ? 2 : 0);
    ck_assert_uint_eq(psd_table_touch_skips(t[0]), 0);
    psd_table_destroy(t[0]);
    psd_table_destroy(t[1]);
  }
  psd_par_destroy(par);
  free(keys), free(pool), free(rows[0]), free(rows[1]), free(out[0]), free(out[1]), free(g);
}
END_TEST

/* A push whose pull touched exactly its rows, with nothing since, skips
 * its touches (they would change nothing); anything that moved the LRU
 * clock between them (another pull's touch, a store, a step) makes it
 * touch them. Each case against a table told no clock: the same rows,
 * LRU order and counters. Small pushes: the loop's own path. */
START_TEST(push_skips_touches_its_pull_made) {
  psd_table_spec sp = spec_base("skip", 2, 8); /* SGD lr 0.5 */
  psd_table *t[2] = {mk(&sp, 1, 1, 0), mk(&sp, 1, 1, 0)};
  const uint64_t k[3] = {1, 2, 3}, k1 = 1, k9 = 9;
  uint32_t rows[3];
  float out[6], g[6] = {1, 2, 3, 4, 5, 6};
  /* what comes between each step's pull and push: nothing (the skip),
   * a pull of key 1, a pull storing key 9 */
  enum { NOTHING, TOUCH, STORE, NCASES };
  uint64_t step = 0, skips = 0;
  for (int round = 0; round < 2; round++) {
    for (int between = 0; between < NCASES; between++, step++) {
      uint64_t clock[2] = {0, 0};
      for (int i = 0; i < 2; i++) {
        uint64_t ep = psd_table_epoch(t[i]), c0 = psd_table_lru_clock(t[i]);
        ck_assert_int_eq(psd_table_pull_rows(t[i], k, 3, 1, out, rows), 0);
        if (i == 1 && psd_table_lru_clock(t[1]) - c0 == 3) clock[1] = c0 + 3;
        float o[2];
        if (between == TOUCH) ck_assert_int_eq(psd_table_pull(t[i], &k1, 1, 0, o), 0);
        if (between == STORE) ck_assert_int_eq(psd_table_pull(t[i], &k9, 1, 1, o), 0);
        ck_assert_int_eq(psd_table_push_rows(t[i], 0, step, k, 3, g, rows, ep, clock[i], NULL),
                         1);
      }
      /* the first pull stored its keys (the clock moved by more than 3) */
      skips += step > 0 && between == NOTHING;
      ck_assert_uint_eq(psd_table_touch_skips(t[1]), skips);
      char when[48];
      snprintf(when, sizeof when, "step %llu", (unsigned long long)step);
      same_tables(t[0], t[1], 8, when);
    }
  }
  ck_assert_uint_eq(skips, 1);
  find_ctx f;
  ck_assert(find_row(t[1], 3, &f));
  ck_assert_float_eq(f.v[0], -0.5f * 5 * (float)step); /* every push applied */
  psd_table_destroy(t[0]);
  psd_table_destroy(t[1]);
}
END_TEST

Suite *suite_table(void) {
  Suite *s = suite_create("table");
  TCase *tc = tcase_create("index");
  tcase_add_test(tc, index_vs_reference);
  tcase_add_test(tc, index_backward_shift_wraps);
  tcase_add_test(tc, index_hash_independent_of_shard);
  tcase_add_test(tc, index_salted_against_flooding);
  tcase_add_test(tc, table_vs_model);
  suite_add_tcase(s, tc);
  tc = tcase_create("rules");
  tcase_add_test(tc, rule_sgd);
  tcase_add_test(tc, rule_adagrad);
  tcase_add_test(tc, rule_adam_lazy);
  tcase_add_test(tc, rule_adam_correction_steps);
  tcase_add_test(tc, rule_ftrl);
  suite_add_tcase(s, tc);
  tc = tcase_create("sync");
  tcase_add_test(tc, sync_two_workers_equal_union);
  tcase_add_test(tc, sync_refusals);
  tcase_add_test(tc, async_applies_each_push);
  tcase_add_test(tc, sync_dropped_keys);
  tcase_add_test(tc, push_rows_trusted_only_while_epoch_holds);
  tcase_add_test(tc, push_skips_touches_its_pull_made);
  tcase_add_test(tc, threads_change_nothing);
  suite_add_tcase(s, tc);
  tc = tcase_create("admission");
  tcase_add_test(tc, admit_by_count);
  tcase_add_test(tc, admit_counts_decay);
  tcase_add_test(tc, admit_by_probability);
  tcase_add_test(tc, evict_lru_order);
  tcase_add_test(tc, evict_ttl_boundary);
  tcase_add_test(tc, capacity_and_bytes_bound);
  suite_add_tcase(s, tc);
  tc = tcase_create("init");
  tcase_add_test(tc, init_deterministic);
  tcase_add_test(tc, init_moments);
  suite_add_tcase(s, tc);
  tc = tcase_create("checkpoint");
  tcase_add_test(tc, checkpoint_round_trip);
  suite_add_tcase(s, tc);
  tc = tcase_create("checks");
  tcase_add_test(tc, keys_check);
  tcase_add_test(tc, spec_check);
  tcase_add_test(tc, spec_diff);
  suite_add_tcase(s, tc);
  return s;
}
