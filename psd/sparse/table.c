/*
 * table.c - one sparse embedding table on this ps (table.h): row storage
 * with its LRU list, the key index, admission, eviction, the per-step
 * accumulator and the SyncReplicas rule for row gradients.
 *
 * Rows live in one 64-byte aligned array of `stride` floats each (values,
 * then the rule's state); keys and a 16-byte record of last touch and
 * LRU links are parallel arrays indexed by the same uint32 row number
 * (a touch misses once, in the record). Rows freed by
 * eviction go on a free list threaded through the LRU `newer` links. The
 * storage doubles from TABLE_FIRST_ROWS up to the capacity and never
 * beyond, so psd_table_bytes bounds every allocation.
 */
#include "table.h"

#include <stdlib.h>
#include <string.h>

#include "admit.h"
#include "keyindex.h"
#include "par.h"
#include "rowinit.h"
#include "optimizer.h"
#include "rowopt.h"
#include "wire.h"

/* No row: the end of the LRU list and of the free list. Row numbers stay
 * below it (capacity <= PSD_TABLE_MAX_ROWS < UINT32_MAX). */
#define NIL UINT32_MAX
_Static_assert(NIL == PSD_KINDEX_NONE && NIL == PSD_ROWOPT_NO_ROW,
               "the index, the lists and the rules share the no-row value");
/* Alignment of the row and accumulator storage: whole cache lines. */
#define TABLE_ALIGN 64u
/* Rows (and accumulator slots) of the first block: a table that holds a
 * few rows stays small, and doubling from here to 2^31 rows is 25 copies. */
#define TABLE_FIRST_ROWS 64u
/* Per-row bytes besides the values and state: key, touched, two links. */
#define ROW_META_BYTES (sizeof(uint64_t) + sizeof(row_meta))
/* Rows a batch looks up before it works on them: the index probes of a
 * batch run back to back with their slots prefetched, then the rows are
 * read or updated with their memory prefetched ROW_AHEAD rows ahead. On
 * the stack: 1 KiB of row numbers. */
#define LOOKUP_BATCH PSD_KINDEX_BATCH
#define ROW_AHEAD 4u

/* What a touch reads and writes of a row besides its values, in one
 * 16-byte record (a quarter of a cache line): a pull or an update of a
 * row stored anywhere misses once here, not once per array. */
typedef struct row_meta {
  uint64_t touched; /* step of its last pull or update */
  uint32_t older;   /* next row toward lru_old, or NIL */
  uint32_t newer;   /* next row toward lru_new (free rows: the next free
                       row), or NIL */
} row_meta;

struct psd_table {
  psd_table_spec spec;  /* what defines it (checked) */
  psd_rowopt opt;       /* the rule's constants for the kernels */
  ps_optimizer sched;   /* the learning-rate schedule (psd_tablespec_schedule) */
  int scheduled;        /* it has one: opt's lr is set for each step */
  uint64_t init_salt;   /* the initializer's seed mixed with the name */
  uint32_t num_workers; /* entries of pushed */
  uint32_t replicas;    /* pushes per step (sync) */
  int async_mode;       /* apply every push at once */
  uint64_t step;        /* sync: steps completed; async: pushes applied */
  uint64_t epoch;       /* evictions ever: row numbers handed out while it
                           stays the same still hold their keys */
  uint64_t clock;       /* the LRU clock (psd_table_lru_clock) */
  uint64_t touch_skips; /* pushes that skipped their touches */
  uint32_t count;       /* pushes accumulated for `step` (sync) */
  uint64_t *pushed;     /* per worker: step+1 of its last accepted push */
  psd_table_stats st;   /* counters; st.rows is the stored rows */

  uint32_t dim;          /* spec.dim */
  uint32_t nstate;       /* state floats per row */
  uint64_t stride;       /* floats per stored row (values, state, padding) */
  uint32_t max_rows;     /* spec.capacity */
  uint32_t rows_cap;     /* rows the arrays below hold */
  uint32_t rows_hwm;     /* rows ever handed out: each is stored or free */
  uint32_t free_head;    /* first free row (linked through newer), or NIL */
  uint32_t lru_old;      /* least recently touched row, or NIL */
  uint32_t lru_new;      /* most recently touched row, or NIL */
  float *vals;           /* rows_cap * stride floats, TABLE_ALIGN aligned */
  uint64_t *keys;        /* per row: its key */
  row_meta *meta;        /* per row: last touch and LRU links */
  psd_kindex index;      /* key -> row */
  psd_par *par;          /* helper threads for big requests, or NULL */

  psd_kindex acc_index;  /* key -> accumulator slot, this step's keys */
  float *acc;            /* acc_cap * dim floats: sums of this step */
  uint32_t *acc_rows;    /* per slot: the row it updates */
  uint32_t acc_n;        /* slots in use this step */
  uint32_t acc_cap;      /* slots allocated (<= max_rows) */

  psd_admit admit;       /* who gets a row (its state is checkpointed) */
};

/* ---------------------------------------------------------------------- */
/* Sizes */

static uint64_t sat_add(uint64_t a, uint64_t b) {
  uint64_t r;
  return ps__add_u64(a, b, &r) ? UINT64_MAX : r;
}

static uint64_t sat_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  return ps__mul_u64(a, b, &r) ? UINT64_MAX : r;
}

/* Bytes of an aligned block of n floats (what alloc_floats takes). */
static uint64_t aligned_bytes(uint64_t n) {
  uint64_t b = sat_mul(n, sizeof(float));
  return b > UINT64_MAX - TABLE_ALIGN ? UINT64_MAX
                                      : (b + TABLE_ALIGN - 1) / TABLE_ALIGN * TABLE_ALIGN;
}

uint64_t psd_table_bytes(const psd_table_spec *s) {
  const uint64_t c = s->capacity;
  const uint64_t slots = psd_kindex_slots_for(c);
  uint64_t b = sizeof(psd_table);
  b = sat_add(b, aligned_bytes(sat_mul(c, psd_rowopt_stride(s)))); /* values, state */
  b = sat_add(b, sat_mul(c, ROW_META_BYTES));                       /* keys, links */
  b = sat_add(b, sat_mul(2, slots ? sat_mul(slots, sizeof(psd_kslot)) : UINT64_MAX));
  b = sat_add(b, aligned_bytes(sat_mul(c, s->dim))); /* accumulator */
  b = sat_add(b, sat_mul(c, sizeof(uint32_t)));      /* its rows */
  return sat_add(b, psd_admit_bytes(s));
}

uint64_t psd_table_bytes_now(const psd_table *t) {
  uint64_t b = sizeof *t;
  b += aligned_bytes((uint64_t)t->rows_cap * t->stride) * (t->rows_cap > 0);
  b += (uint64_t)t->rows_cap * ROW_META_BYTES;
  b += psd_kindex_bytes(&t->index) + psd_kindex_bytes(&t->acc_index);
  b += aligned_bytes((uint64_t)t->acc_cap * t->dim) * (t->acc_cap > 0);
  b += (uint64_t)t->acc_cap * sizeof(uint32_t);
  return b + t->admit.len;
}

/* n floats, TABLE_ALIGN aligned, uninitialized; NULL when out of memory. */
static float *alloc_floats(uint64_t n) {
  uint64_t bytes = aligned_bytes(n);
  void *p = NULL;
  if (bytes == 0 || bytes > SIZE_MAX || posix_memalign(&p, TABLE_ALIGN, (size_t)bytes) != 0)
    return NULL;
  return p;
}

/* malloc of n elements of elem bytes, overflow-checked. */
static void *alloc_array(uint64_t n, size_t elem) {
  uint64_t bytes;
  if (ps__mul_u64(n, elem, &bytes) != 0 || bytes > SIZE_MAX) return NULL;
  return malloc(bytes ? (size_t)bytes : 1);
}

/* ---------------------------------------------------------------------- */
/* Create, destroy, accessors */

void psd_table_destroy(psd_table *t) {
  if (!t) return;
  free(t->pushed);
  free(t->vals);
  free(t->keys);
  free(t->meta);
  psd_kindex_free(&t->index);
  psd_kindex_free(&t->acc_index);
  free(t->acc);
  free(t->acc_rows);
  psd_admit_free(&t->admit);
  free(t);
}

/* Everything but the rows and accumulator storage, which come on demand. */
static int table_alloc(psd_table *t) {
  t->pushed = calloc(t->num_workers ? t->num_workers : 1, sizeof *t->pushed);
  if (!t->pushed || psd_admit_init(&t->admit, &t->spec, t->init_salt) != 0) return PS_ENOMEM;
  if (psd_kindex_init(&t->index) != 0 || psd_kindex_init(&t->acc_index) != 0)
    return PS_ENOMEM;
  return 0;
}

int psd_table_create(const psd_table_spec *spec, uint32_t num_workers, uint32_t replicas,
                     int async_mode, psd_table **out, char *err, size_t errlen) {
  *out = NULL;
  int rc = psd_tablespec_check(spec, err, errlen);
  if (rc != 0) return rc;
  psd_table *t = calloc(1, sizeof *t);
  if (!t)
    return ps__errf(PS_ENOMEM, err, errlen, "out of memory creating table '%s'",
                    PS__ESC(spec->name));
  t->spec = *spec;
  psd_rowopt_init(&t->opt, spec);
  psd_tablespec_schedule(spec, &t->sched);
  t->scheduled = psd_tablespec_has_schedule(spec);
  t->init_salt = psd_rowinit_salt(spec);
  t->num_workers = num_workers;
  t->replicas = replicas;
  t->async_mode = async_mode;
  t->dim = spec->dim;
  t->nstate = psd_rowopt_state_floats(spec);
  t->stride = psd_rowopt_stride(spec);
  t->max_rows = (uint32_t)spec->capacity;
  t->free_head = t->lru_old = t->lru_new = NIL;
  t->clock = 1; /* 0 is no clock's (psd_table_push_rows) */
  if (table_alloc(t) != 0) {
    psd_table_destroy(t);
    return ps__errf(PS_ENOMEM, err, errlen, "out of memory creating table '%s'",
                    PS__ESC(spec->name));
  }
  *out = t;
  return 0;
}

const psd_table_spec *psd_table_spec_of(const psd_table *t) { return &t->spec; }
uint64_t psd_table_step(const psd_table *t) { return t->step; }
psd_table_stats psd_table_get_stats(const psd_table *t) { return t->st; }

uint32_t psd_table_missing(const psd_table *t, uint32_t *missing, uint32_t cap) {
  uint32_t n = 0;
  for (uint32_t w = 0; w < t->num_workers && n < cap; w++)
    if (t->pushed[w] != t->step + 1) missing[n++] = w;
  return n;
}

const void *psd_table_aux(const psd_table *t, size_t *len) {
  return psd_admit_state(&t->admit, len);
}

/* ---------------------------------------------------------------------- */
/* Rows: storage, LRU list, eviction */

static float *row_at(const psd_table *t, uint32_t r) { return t->vals + (size_t)r * t->stride; }

/* Doubles the row storage (up to max_rows), all arrays or none. */
static int grow_rows(psd_table *t) {
  uint64_t ncap = t->rows_cap ? (uint64_t)t->rows_cap * 2 : TABLE_FIRST_ROWS;
  if (ncap > t->max_rows) ncap = t->max_rows;
  float *v = alloc_floats(ncap * t->stride);
  uint64_t *k = alloc_array(ncap, sizeof *k);
  row_meta *m = alloc_array(ncap, sizeof *m);
  if (!v || !k || !m) {
    free(v), free(k), free(m);
    return PS_ENOMEM;
  }
  const size_t h = t->rows_hwm;
  if (h) {
    memcpy(v, t->vals, h * t->stride * sizeof *v);
    memcpy(k, t->keys, h * sizeof *k);
    memcpy(m, t->meta, h * sizeof *m);
  }
  free(t->vals), free(t->keys), free(t->meta);
  t->vals = v, t->keys = k, t->meta = m;
  t->rows_cap = (uint32_t)ncap;
  return 0;
}

static void lru_unlink(psd_table *t, uint32_t r) {
  const uint32_t o = t->meta[r].older, n = t->meta[r].newer;
  if (o != NIL) t->meta[o].newer = n;
  else t->lru_old = n;
  if (n != NIL) t->meta[n].older = o;
  else t->lru_new = o;
}

static void lru_push_new(psd_table *t, uint32_t r) {
  t->meta[r].older = t->lru_new;
  t->meta[r].newer = NIL;
  if (t->lru_new != NIL) t->meta[t->lru_new].newer = r;
  else t->lru_old = r;
  t->lru_new = r;
}

/* A pull or an update of row r at the current step. */
static void touch(psd_table *t, uint32_t r) {
  t->clock++;
  t->meta[r].touched = t->step;
  if (t->lru_new != r) {
    lru_unlink(t, r);
    lru_push_new(t, r);
  }
}

/* Row r, evicted mid-step, had gradients summed this step: they are
 * dropped (counted), and the last slot moves into the hole, so the
 * accumulator only ever holds keys with stored rows (<= capacity). */
static void acc_forget(psd_table *t, uint64_t key, uint32_t e) {
  psd_kindex_remove(&t->acc_index, key);
  const uint32_t last = --t->acc_n;
  if (e != last) {
    const uint32_t moved = t->acc_rows[last];
    memcpy(t->acc + (size_t)e * t->dim, t->acc + (size_t)last * t->dim,
           (size_t)t->dim * sizeof(float));
    t->acc_rows[e] = moved;
    psd_kindex_set(&t->acc_index, t->keys[moved], e);
  }
  t->st.dropped++;
}

/* Forgets row r: out of the index, the accumulator and the LRU list, onto
 * the free list. */
static void evict(psd_table *t, uint32_t r) {
  psd_kindex_remove(&t->index, t->keys[r]);
  if (t->acc_n > 0) {
    const uint32_t e = psd_kindex_find(&t->acc_index, t->keys[r]);
    if (e != NIL) acc_forget(t, t->keys[r], e);
  }
  lru_unlink(t, r);
  t->clock++;
  t->meta[r].newer = t->free_head;
  t->free_head = r;
  t->st.rows--;
  t->epoch++; /* r may now be handed to another key */
}

/* A row for a new key: the LRU row evicted when full, else a free row,
 * else a fresh one (growing the storage). NIL when out of memory. */
static uint32_t take_row(psd_table *t) {
  if (t->st.rows >= t->max_rows) {
    evict(t, t->lru_old);
    t->st.evictions_lru++;
  }
  if (t->free_head != NIL) {
    uint32_t r = t->free_head;
    t->free_head = t->meta[r].newer;
    return r;
  }
  if (t->rows_hwm == t->rows_cap && grow_rows(t) != 0) return NIL;
  return t->rows_hwm++;
}

/* Stores key as the most recently touched row (values left to the
 * caller). The row, or NIL when out of memory (nothing changed then). */
static uint32_t store_row(psd_table *t, uint64_t key) {
  uint64_t need = t->st.rows < t->max_rows ? t->st.rows + 1 : t->max_rows;
  if (psd_kindex_reserve(&t->index, need) != 0) return NIL;
  uint32_t r = take_row(t);
  if (r == NIL) return NIL;
  psd_kindex_insert(&t->index, key, r);
  t->keys[r] = key;
  t->meta[r].touched = t->step;
  lru_push_new(t, r);
  t->clock++;
  t->st.rows++;
  return r;
}

/* The step moved: rows touched at s are evicted once step > s + N
 * (N = evict_after_steps), oldest first. The LRU list is ordered by touch
 * step, so this stops at the first row young enough. */
static void evict_expired(psd_table *t) {
  const uint64_t ttl = t->spec.evict_after_steps;
  if (ttl == 0) return;
  while (t->lru_old != NIL) {
    const uint64_t at = t->meta[t->lru_old].touched;
    if (at >= t->step || t->step - at <= ttl) break;
    evict(t, t->lru_old);
    t->st.evictions_ttl++;
  }
}

/* ---------------------------------------------------------------------- */
/* Batched lookups */

/* The memory a touch and a read or update of row r will use. */
static void prefetch_row(const psd_table *t, uint32_t r) {
  if (r == NIL) return;
  const char *v = (const char *)(t->vals + (size_t)r * t->stride);
  __builtin_prefetch(v, 1);
  __builtin_prefetch(v + 63, 1); /* a row may straddle two lines */
  __builtin_prefetch(&t->meta[r], 1);
}

/* Whether a request of n keys is worth the helper threads. */
static int use_par(const psd_table *t, size_t n) {
  return psd_par_threads(t->par) > 1 && n >= 2 * PSD_PAR_MIN_PART;
}

/* ---------------------------------------------------------------------- */
/* Admission and pulls */

/* Key i of a pull (rows[j]: its row as a batch's lookup found it, valid
 * while *stored is 0: a new row may evict one a later key of the batch
 * found, so after one the keys are looked up again). *used gets the row
 * read (NIL: none). 0 or PS_ENOMEM. */
static int pull_one(psd_table *t, uint64_t key, uint32_t r, int create, int rc, int *stored,
                    float *o, uint32_t *used) {
  const size_t dim = t->dim;
  if (*stored) r = psd_kindex_find(&t->index, key);
  if (r != NIL) {
    t->st.hits++;
  } else if (create && rc == 0 && psd_admit_key(&t->admit, key)) {
    r = store_row(t, key);
    *stored = 1;
    if (r == NIL) {
      rc = PS_ENOMEM; /* no further admissions in this pull */
    } else {
      float *row = row_at(t, r);
      psd_rowinit_fill(&t->spec, t->init_salt, key, row);
      psd_rowopt_new_state(&t->opt, row + dim);
      t->st.admissions++;
    }
  }
  *used = r;
  if (r == NIL) {
    psd_rowinit_fill(&t->spec, t->init_salt, key, o);
    return rc;
  }
  ps__copy_row(o, row_at(t, r), dim);
  touch(t, r);
  return rc;
}

/* The pull of keys[0..n) one key after another (rows_out: as for
 * psd_table_pull_rows, or NULL); rc: the pull's code so far. */
static int pull_serial(psd_table *t, const uint64_t *keys, size_t n, int create, float *out,
                       uint32_t *rows_out, int rc) {
  const size_t dim = t->dim;
  uint32_t rows[LOOKUP_BATCH], used[LOOKUP_BATCH];
  for (size_t b = 0; b < n; b += LOOKUP_BATCH) {
    const size_t m = n - b < LOOKUP_BATCH ? n - b : LOOKUP_BATCH;
    int stored = 0;
    psd_kindex_find_batch(&t->index, keys + b, m, n - b, rows);
    uint32_t *u = rows_out ? rows_out + b : used;
    for (size_t j = 0; j < m; j++) {
      if (j + ROW_AHEAD < m && !stored) prefetch_row(t, rows[j + ROW_AHEAD]);
      rc = pull_one(t, keys[b + j], rows[j], create, rc, &stored, out + (b + j) * dim, u + j);
    }
  }
  return rc;
}

typedef struct pull_part_ctx {
  const psd_table *t;
  const uint64_t *keys;
  float *out;
  uint32_t *rows;
} pull_part_ctx;

/* A part of a pull on a helper thread: keys [lo, hi) looked up, the rows
 * found copied out (rows[i]: the row, or NIL). Reads the table only. */
static void pull_part(void *arg, size_t lo, size_t hi) {
  const pull_part_ctx *a = arg;
  const psd_table *t = a->t;
  const size_t dim = t->dim;
  for (size_t b = lo; b < hi; b += LOOKUP_BATCH) {
    const size_t m = hi - b < LOOKUP_BATCH ? hi - b : LOOKUP_BATCH;
    uint32_t *rows = a->rows + b;
    psd_kindex_find_batch(&t->index, a->keys + b, m, hi - b, rows);
    for (size_t j = 0; j < m; j++) {
      if (j + ROW_AHEAD < m && rows[j + ROW_AHEAD] != NIL)
        __builtin_prefetch(row_at(t, rows[j + ROW_AHEAD]));
      if (rows[j] != NIL) ps__copy_row(a->out + (b + j) * dim, row_at(t, rows[j]), dim);
    }
  }
}

/* After pull_part: the rows found are touched and the keys without one
 * admitted, in key order, as pull_serial would. An eviction (a row
 * handed to another key) ends it: the rest goes through pull_serial. */
static int pull_settle(psd_table *t, const uint64_t *keys, size_t n, int create, float *out,
                       uint32_t *rows) {
  const uint64_t epoch = t->epoch;
  int rc = 0, stored = 0; /* after a store a key with no row is looked up again */
  size_t i = 0;
  for (; i < n && t->epoch == epoch; i++) {
    if (i + 2 * ROW_AHEAD < n && rows[i + 2 * ROW_AHEAD] != NIL)
      __builtin_prefetch(&t->meta[rows[i + 2 * ROW_AHEAD]], 1);
    if (rows[i] != NIL) {
      t->st.hits++;
      touch(t, rows[i]);
    } else {
      rc = pull_one(t, keys[i], NIL, create, rc, &stored, out + i * t->dim, rows + i);
    }
  }
  if (i < n) rc = pull_serial(t, keys + i, n - i, create, out + i * t->dim, rows + i, rc);
  return rc;
}

int psd_table_pull_rows(psd_table *t, const uint64_t *keys, size_t n, int create, float *out,
                        uint32_t *rows_out) {
  int rc;
  t->st.keys_pulled += n;
  if (rows_out && use_par(t, n)) {
    pull_part_ctx a = {t, keys, out, rows_out};
    psd_par_run(t->par, n, pull_part, &a);
    rc = pull_settle(t, keys, n, create, out, rows_out);
  } else {
    rc = pull_serial(t, keys, n, create, out, rows_out, 0);
  }
  if (create) psd_admit_age(&t->admit, n);
  return rc;
}

int psd_table_pull(psd_table *t, const uint64_t *keys, size_t n, int create, float *out) {
  return psd_table_pull_rows(t, keys, n, create, out, NULL);
}

uint64_t psd_table_epoch(const psd_table *t) { return t->epoch; }

uint64_t psd_table_lru_clock(const psd_table *t) { return t->clock; }

uint64_t psd_table_touch_skips(const psd_table *t) { return t->touch_skips; }

void psd_table_set_par(psd_table *t, psd_par *par) { t->par = par; }

/* Rows of keys[0..m) into rows: hint's (rows a pull read while the epoch
 * stayed as it is now), or the index's without a hint or when the hint
 * has none for a key (another pull may have stored one since; the batch
 * is looked up whole then, prefetched, as unadmitted keys come in
 * numbers). more: keys from keys[0] on, for find_batch's prefetch. */
static void lookup(const psd_table *t, const uint64_t *keys, size_t m, size_t more,
                   const uint32_t *hint, uint32_t *rows) {
  for (size_t j = 0; hint && j < m; j++)
    if (hint[j] == NIL) hint = NULL;
  if (!hint) {
    psd_kindex_find_batch(&t->index, keys, m, more, rows);
    return;
  }
  memcpy(rows, hint, m * sizeof *rows);
}

/* ---------------------------------------------------------------------- */
/* Pushes: the accumulator and the SyncReplicas rule */

/* acc += g over n floats (auto-vectorized). */
static void add_into(float *restrict acc, const float *restrict g, size_t n) {
  for (size_t i = 0; i < n; i++) acc[i] += g[i];
}

/* Room in the accumulator for `more` new keys (at most max_rows in all),
 * so accumulating a push never fails halfway. 0 or PS_ENOMEM. */
static int acc_reserve(psd_table *t, size_t more) {
  uint64_t need = (uint64_t)t->acc_n + more;
  if (need > t->max_rows) need = t->max_rows;
  if (psd_kindex_reserve(&t->acc_index, need) != 0) return PS_ENOMEM;
  if (need <= t->acc_cap) return 0;
  uint64_t ncap = t->acc_cap ? t->acc_cap : TABLE_FIRST_ROWS;
  while (ncap < need) ncap *= 2;
  if (ncap > t->max_rows) ncap = t->max_rows;
  float *a = alloc_floats(ncap * t->dim);
  uint32_t *r = alloc_array(ncap, sizeof *r);
  if (!a || !r) {
    free(a), free(r);
    return PS_ENOMEM;
  }
  if (t->acc_n) {
    memcpy(a, t->acc, (size_t)t->acc_n * t->dim * sizeof *a);
    memcpy(r, t->acc_rows, (size_t)t->acc_n * sizeof *r);
  }
  free(t->acc), free(t->acc_rows);
  t->acc = a, t->acc_rows = r;
  t->acc_cap = (uint32_t)ncap;
  return 0;
}

/* Sums a batch of a push (rows: their lookups) into the accumulator;
 * returns the keys with no stored row (dropped). */
static uint64_t accumulate_batch(psd_table *t, const uint64_t *keys, size_t m,
                                 const float *grads, const uint32_t *rows) {
  const size_t dim = t->dim;
  uint64_t drops = 0;
  for (size_t i = 0; i < m; i++) {
    const float *g = grads + i * dim;
    const uint32_t r = rows[i];
    if (r == NIL) {
      drops++;
      continue;
    }
    int added;
    const uint32_t e = psd_kindex_upsert(&t->acc_index, keys[i], t->acc_n, &added);
    float *a = t->acc + (size_t)e * dim;
    if (added) {
      t->acc_rows[t->acc_n++] = r;
      memcpy(a, g, dim * sizeof *a);
    } else {
      add_into(a, g, dim);
    }
  }
  return drops;
}

/* Sums a push into the accumulator (room reserved). Keys with no stored
 * row are dropped; returns how many. hint: as for lookup (NULL: none). */
static uint64_t accumulate(psd_table *t, const uint64_t *keys, size_t n, const float *grads,
                           const uint32_t *hint) {
  const size_t dim = t->dim;
  uint64_t drops = 0;
  uint32_t rows[LOOKUP_BATCH];
  for (size_t b = 0; b < n; b += LOOKUP_BATCH) {
    const size_t m = n - b < LOOKUP_BATCH ? n - b : LOOKUP_BATCH;
    lookup(t, keys + b, m, n - b, hint ? hint + b : NULL, rows);
    drops += accumulate_batch(t, keys + b, m, grads + b * dim, rows);
  }
  return drops;
}

typedef struct rule_part_ctx {
  const psd_table *t;
  const uint64_t *keys; /* looked up with hint (lookup), or NULL: hint are the rows */
  const uint32_t *hint;
  const float *grads;   /* a row of dim floats per key */
  float scale;
} rule_part_ctx;

/* A part of an update on a helper thread: the rule applied to the rows of
 * [lo, hi), each row its own (a push's keys are distinct, and so are an
 * accumulator's slots). Writes those rows only; touches nothing. */
static void rule_part(void *arg, size_t lo, size_t hi) {
  const rule_part_ctx *a = arg;
  const psd_table *t = a->t;
  const size_t dim = t->dim;
  uint32_t found[LOOKUP_BATCH];
  for (size_t b = lo; b < hi; b += LOOKUP_BATCH) {
    const size_t m = hi - b < LOOKUP_BATCH ? hi - b : LOOKUP_BATCH;
    const uint32_t *rows = a->hint + b;
    if (a->keys) {
      lookup(t, a->keys + b, m, hi - b, a->hint + b, found);
      rows = found;
    }
    psd_rowopt_apply_rows(&t->opt, t->vals, t->stride, rows, m, a->grads + b * dim, a->scale);
  }
}

/* rows[0..m) touched in order (LRU); returns those that are NIL. */
static uint64_t touch_rows(psd_table *t, const uint32_t *rows, size_t m) {
  uint64_t nil = 0;
  for (size_t j = 0; j < m; j++) {
    if (j + 2 * ROW_AHEAD < m && rows[j + 2 * ROW_AHEAD] != NIL)
      __builtin_prefetch(&t->meta[rows[j + 2 * ROW_AHEAD]], 1);
    if (rows[j] == NIL) nil++;
    else touch(t, rows[j]);
  }
  return nil;
}

/* After rule_part over a push: its rows touched in key order, as a touch
 * after each row's rule would have; returns the keys with no row
 * (dropped). */
static uint64_t touch_pushed(psd_table *t, const uint64_t *keys, size_t n, const uint32_t *hint) {
  uint64_t drops = 0;
  uint32_t rows[LOOKUP_BATCH];
  for (size_t b = 0; b < n; b += LOOKUP_BATCH) {
    const size_t m = n - b < LOOKUP_BATCH ? n - b : LOOKUP_BATCH;
    lookup(t, keys + b, m, n - b, hint + b, rows);
    drops += touch_rows(t, rows, m);
  }
  return drops;
}

/* Applies a push's gradients directly (async, or a step of one push),
 * a batch of lookups at a time (rows do not move: a push creates and
 * evicts none until the step advances). Returns the keys dropped. With
 * the pull's rows (hint) a big push's rules run on the helper threads. */
static uint64_t apply_push(psd_table *t, const uint64_t *keys, size_t n, const float *grads,
                           const uint32_t *hint, int touched) {
  if (touched || (hint && use_par(t, n))) {
    rule_part_ctx a = {t, keys, hint, grads, 1.0f};
    if (use_par(t, n)) psd_par_run(t->par, n, rule_part, &a);
    else rule_part(&a, 0, n);
    if (!touched) return touch_pushed(t, keys, n, hint);
    t->touch_skips++;
    return 0;
  }
  uint64_t drops = 0;
  uint32_t rows[LOOKUP_BATCH];
  for (size_t b = 0; b < n; b += LOOKUP_BATCH) {
    const size_t m = n - b < LOOKUP_BATCH ? n - b : LOOKUP_BATCH;
    lookup(t, keys + b, m, n - b, hint ? hint + b : NULL, rows);
    /* The batch's rules, then its touches in key order: the same rows and
     * LRU order as a touch after each rule (a rule moves no row). */
    psd_rowopt_apply_rows(&t->opt, t->vals, t->stride, rows, m, grads + b * t->dim, 1.0f);
    drops += touch_rows(t, rows, m);
  }
  return drops;
}

/* Applies the step's sums, scaled, slot by slot, and empties the
 * accumulator. */
static void apply_acc(psd_table *t, float scale) {
  rule_part_ctx a = {t, NULL, t->acc_rows, t->acc, scale};
  if (use_par(t, t->acc_n)) psd_par_run(t->par, t->acc_n, rule_part, &a);
  else rule_part(&a, 0, t->acc_n);
  (void)touch_rows(t, t->acc_rows, t->acc_n); /* every slot has its row */
  t->acc_n = 0;
  psd_kindex_clear(&t->acc_index);
}

/* The table moves to the next step; rows too old go. */
static void advance(psd_table *t) {
  t->step++;
  t->clock++; /* a touch now stamps another step */
  evict_expired(t);
}

/* Sync mode: the step rule of psd_shard_push, per table. */
static int push_sync(psd_table *t, uint32_t worker, uint64_t step, const uint64_t *keys,
                     size_t n, const float *grads, const uint32_t *hint, int touched,
                     uint64_t *drops) {
  if (step < t->step) {
    t->st.stale++;
    return PS_ESTALE;
  }
  if (step > t->step) return PS_EINVAL;
  if (t->pushed[worker] == step + 1) return PS_EDUPLICATE;
  const int last = t->count + 1 >= t->replicas;
  if (last && t->count == 0) {
    *drops = apply_push(t, keys, n, grads, hint, touched); /* nothing to sum it with */
  } else {
    if (acc_reserve(t, n) != 0) return PS_ENOMEM;
    *drops = accumulate(t, keys, n, grads, hint);
    if (last) apply_acc(t, 1.0f / (float)(t->count + 1));
  }
  t->pushed[worker] = step + 1;
  if (!last) {
    t->count++;
    return 0;
  }
  t->count = 0;
  advance(t);
  return 1;
}

/* Whether a push with the rows its pull read may skip its touches: that
 * pull moved the LRU clock by exactly its key count (the caller's word
 * for clock), so with a row for every key it touched exactly these rows,
 * in this order; and nothing has moved the clock since (no touch, store,
 * eviction or step). Touching them again would change nothing. */
static int touches_done(const psd_table *t, const uint32_t *rows, size_t n, uint64_t clock) {
  if (!rows || !clock || clock != t->clock) return 0;
  for (size_t i = 0; i < n; i++)
    if (rows[i] == NIL) return 0;
  return 1;
}

int psd_table_push_rows(psd_table *t, uint32_t worker, uint64_t step, const uint64_t *keys,
                        size_t n, const float *grads, const uint32_t *rows, uint64_t rows_epoch,
                        uint64_t rows_clock, uint64_t *dropped) {
  uint64_t drops = 0;
  if (rows && rows_epoch != t->epoch) rows = NULL; /* a row may have changed hands */
  const int touched = touches_done(t, rows, n, rows_clock);
  if (dropped) *dropped = 0;
  if (worker >= t->num_workers) return PS_EINVAL;
  /* The update that completes step s (or, async, is applied at s) runs
   * at the schedule's lr_s, as a dense variable's. */
  if (t->scheduled) psd_rowopt_set_lr(&t->opt, psd_opt_lr(&t->sched, t->step));
  int rc;
  if (t->async_mode) {
    drops = apply_push(t, keys, n, grads, rows, touched);
    advance(t);
    rc = 1;
  } else {
    rc = push_sync(t, worker, step, keys, n, grads, rows, touched, &drops);
    if (rc < 0) return rc;
  }
  t->st.keys_pushed += n;
  t->st.dropped += drops;
  if (dropped) *dropped = drops;
  return rc;
}

int psd_table_push(psd_table *t, uint32_t worker, uint64_t step, const uint64_t *keys,
                   size_t n, const float *grads, uint64_t *dropped) {
  return psd_table_push_rows(t, worker, step, keys, n, grads, NULL, 0, 0, dropped);
}

/* ---------------------------------------------------------------------- */
/* Checkpoints */

void psd_table_walk(const psd_table *t, psd_table_row_fn fn, void *ctx) {
  for (uint32_t r = t->lru_old; r != NIL; r = t->meta[r].newer) {
    const float *row = row_at(t, r);
    fn(ctx, t->keys[r], row, row + t->dim, t->meta[r].touched);
  }
}

int psd_table_restore_aux(psd_table *t, const void *aux, size_t len) {
  return psd_admit_restore(&t->admit, aux, len);
}

int psd_table_restore_row(psd_table *t, uint64_t key, const float *values,
                          const float *state, uint64_t touched) {
  if (psd_kindex_find(&t->index, key) != NIL || t->st.rows >= t->max_rows) return PS_EINVAL;
  uint32_t r = store_row(t, key);
  if (r == NIL) return PS_ENOMEM;
  float *row = row_at(t, r);
  memcpy(row, values, (size_t)t->dim * sizeof *row);
  if (t->nstate) memcpy(row + t->dim, state, (size_t)t->nstate * sizeof *row);
  t->meta[r].touched = touched;
  t->clock++;
  return 0;
}

void psd_table_restore_step(psd_table *t, uint64_t step, const psd_table_stats *counters) {
  const uint64_t rows = t->st.rows;
  t->step = step;
  t->clock++;
  t->st = *counters;
  t->st.rows = rows; /* what is stored, whatever the file says */
  t->count = 0;
}
