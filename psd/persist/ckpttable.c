/* ckpttable.c - a sparse table's checkpoint record: encode, parse,
 * restore (see ckpttable.h; the layout is in docs/checkpoint.md). */
#include "ckpttable.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparse/rowopt.h"
#include "wire.h"

/* Bytes of the spec's fixed fields. */
#define SPEC_BYTES 128
/* Counters stored: every field of psd_table_stats. */
#define NCOUNTERS 9
/* Fixed bytes around the name: magic, record length, name length; spec,
 * step, counters, state floats, aux length, row count. */
#define FIXED_BYTES (4 + 8 + 4 + SPEC_BYTES + 8 + 8 * NCOUNTERS + 4 + 8 + 8)

_Static_assert(PSD_CKPTTABLE_MIN_BYTES == FIXED_BYTES + 1, "a record's fewest bytes");

/* ---- little-endian cursor -------------------------------------------------- */

typedef struct wcur {
  uint8_t *p;
} wcur;

static void put32(wcur *w, uint32_t v) {
  for (int i = 0; i < 4; i++) *w->p++ = (uint8_t)(v >> (8 * i));
}
static void put64(wcur *w, uint64_t v) {
  for (int i = 0; i < 8; i++) *w->p++ = (uint8_t)(v >> (8 * i));
}
static void putd(wcur *w, double d) {
  uint64_t v;
  memcpy(&v, &d, sizeof v);
  put64(w, v);
}
static void putb(wcur *w, const void *b, size_t n) {
  if (n) memcpy(w->p, b, n);
  w->p += n;
}

typedef struct rcur {
  const uint8_t *p;
} rcur;

static uint32_t get32(rcur *r) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)*r->p++ << (8 * i);
  return v;
}
static uint64_t get64(rcur *r) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)*r->p++ << (8 * i);
  return v;
}
static double getd(rcur *r) {
  uint64_t v = get64(r);
  double d;
  memcpy(&d, &v, sizeof d);
  return d;
}

/* Counters in file order. */
static void counters_out(const psd_table_stats *s, uint64_t v[NCOUNTERS]) {
  const uint64_t c[NCOUNTERS] = {s->rows, s->keys_pulled, s->keys_pushed,
                                 s->hits, s->admissions, s->evictions_lru,
                                 s->evictions_ttl, s->dropped, s->stale};
  memcpy(v, c, sizeof c);
}
static void counters_in(const uint64_t v[NCOUNTERS], psd_table_stats *s) {
  *s = (psd_table_stats){v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]};
}

/* ---- writing ---------------------------------------------------------------- */

/* Bytes of one row in the file. */
static uint64_t row_bytes(uint32_t dim, uint32_t state_floats) {
  return 16 + 4 * ((uint64_t)dim + state_floats);
}

/* Bytes of t's record when it holds `rows` rows (0: not a size_t). */
static size_t size_with(const psd_table *t, uint64_t rows) {
  const psd_table_spec *sp = psd_table_spec_of(t);
  size_t aux_len = 0;
  psd_table_aux(t, &aux_len);
  uint64_t body, total;
  if (ps__mul_u64(rows, row_bytes(sp->dim, psd_rowopt_state_floats(sp)), &body) ||
      ps__add_u64(body, (uint64_t)FIXED_BYTES + strlen(sp->name) + aux_len, &total) ||
      total > SIZE_MAX)
    return 0;
  return (size_t)total;
}

size_t psd_ckpttable_size(const psd_table *t) {
  return size_with(t, psd_table_get_stats(t).rows);
}

size_t psd_ckpttable_max_size(const psd_table *t) {
  return size_with(t, psd_table_spec_of(t)->capacity);
}

static void put_spec(wcur *w, const psd_table_spec *s) {
  put32(w, s->dim);
  put64(w, s->capacity);
  put32(w, s->init_kind);
  putd(w, s->init_a);
  putd(w, s->init_b);
  put64(w, s->init_seed);
  put32(w, s->opt);
  putd(w, s->lr);
  putd(w, s->initial_accumulator);
  putd(w, s->beta1);
  putd(w, s->beta2);
  putd(w, s->epsilon);
  putd(w, s->l1);
  putd(w, s->l2);
  putd(w, s->ftrl_beta);
  put32(w, s->admit_count);
  putd(w, s->admit_prob);
  put64(w, s->evict_after_steps);
}

/* psd_table_walk's callback: one row out. */
typedef struct row_out {
  wcur w;
  const uint8_t *end; /* the buffer's end */
  uint32_t dim, state_floats;
  uint64_t rows;      /* written */
  int overflow;       /* more rows than the counters said: not written */
} row_out;

static void put_row(void *ctx, uint64_t key, const float *values, const float *state,
                    uint64_t touched) {
  row_out *o = ctx;
  if ((size_t)(o->end - o->w.p) < row_bytes(o->dim, o->state_floats)) {
    o->overflow = 1;
    return;
  }
  put64(&o->w, key);
  put64(&o->w, touched);
  putb(&o->w, values, (size_t)o->dim * sizeof(float));
  putb(&o->w, state, (size_t)o->state_floats * sizeof(float));
  o->rows++;
}

int psd_ckpttable_encode(const psd_table *t, uint8_t *buf, size_t size) {
  const psd_table_spec *sp = psd_table_spec_of(t);
  psd_table_stats st = psd_table_get_stats(t);
  size_t aux_len = 0, nlen = strlen(sp->name);
  const void *aux = psd_table_aux(t, &aux_len);
  uint64_t c[NCOUNTERS];
  counters_out(&st, c);
  wcur w = {buf};
  putb(&w, PSD_CKPTTABLE_MAGIC, 4);
  put64(&w, size);
  put32(&w, (uint32_t)nlen);
  putb(&w, sp->name, nlen);
  put_spec(&w, sp);
  put64(&w, psd_table_step(t));
  for (int i = 0; i < NCOUNTERS; i++) put64(&w, c[i]);
  put32(&w, psd_rowopt_state_floats(sp));
  put64(&w, aux_len);
  putb(&w, aux, aux_len);
  put64(&w, st.rows);
  row_out o = {w, buf + size, sp->dim, psd_rowopt_state_floats(sp), 0, 0};
  psd_table_walk(t, put_row, &o);
  return o.overflow || o.rows != st.rows || o.w.p != buf + size ? -1 : 0;
}

/* ---- reading ---------------------------------------------------------------- */

__attribute__((format(printf, 3, 4))) static int bad(char *msg, size_t msglen,
                                                     const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, msglen, fmt, ap);
  va_end(ap);
  return -1;
}

static void get_spec(rcur *r, psd_table_spec *s) {
  s->dim = get32(r);
  s->capacity = get64(r);
  s->init_kind = get32(r);
  s->init_a = getd(r);
  s->init_b = getd(r);
  s->init_seed = get64(r);
  s->opt = get32(r);
  s->lr = getd(r);
  s->initial_accumulator = getd(r);
  s->beta1 = getd(r);
  s->beta2 = getd(r);
  s->epsilon = getd(r);
  s->l1 = getd(r);
  s->l2 = getd(r);
  s->ftrl_beta = getd(r);
  s->admit_count = get32(r);
  s->admit_prob = getd(r);
  s->evict_after_steps = get64(r);
}

/* The variable part after the fixed fields: aux and rows, each length
 * checked against what the record says it has left. */
static int parse_tail(rcur *r, const uint8_t *end, psd_ckpttable *t, char *msg,
                      size_t msglen) {
  const char *name = t->spec.name;
  t->aux_len = get64(r);
  if (t->aux_len > (uint64_t)(end - r->p) || (uint64_t)(end - r->p) - t->aux_len < 8)
    return bad(msg, msglen, "table '%s' has %" PRIu64 " bytes of admission state, %zu are left",
               name, t->aux_len, (size_t)(end - r->p));
  t->aux = r->p;
  r->p += t->aux_len;
  t->nrows = get64(r);
  uint64_t per = row_bytes(t->spec.dim, t->state_floats), need;
  if (t->nrows > t->spec.capacity)
    return bad(msg, msglen, "table '%s' has %" PRIu64 " rows, more than its capacity %" PRIu64,
               name, t->nrows, t->spec.capacity);
  if (ps__mul_u64(t->nrows, per, &need) || need != (uint64_t)(end - r->p))
    return bad(msg, msglen, "table '%s': %" PRIu64 " rows of %" PRIu64 " bytes do not fill "
               "the %zu bytes left in its record", name, t->nrows, per, (size_t)(end - r->p));
  t->rows = r->p;
  r->p = end;
  return 0;
}

int psd_ckpttable_parse(const uint8_t *b, size_t avail, psd_ckpttable *t, size_t *used,
                        char *msg, size_t msglen) {
  memset(t, 0, sizeof *t);
  if (avail < FIXED_BYTES + 1 || memcmp(b, PSD_CKPTTABLE_MAGIC, 4) != 0)
    return bad(msg, msglen, "table record is missing or malformed");
  rcur r = {b + 4};
  uint64_t len = get64(&r);
  if (len < FIXED_BYTES + 1 || len > avail)
    return bad(msg, msglen, "table record of %" PRIu64 " bytes, %zu are left", len, avail);
  const uint8_t *end = b + len;
  uint32_t nlen = get32(&r);
  if (nlen == 0 || nlen > PS_MAX_NAME || len < (uint64_t)FIXED_BYTES + nlen)
    return bad(msg, msglen, "table record has a bad name length %u", nlen);
  memcpy(t->spec.name, r.p, nlen);
  t->spec.name[nlen] = '\0';
  r.p += nlen;
  if (strlen(t->spec.name) != nlen)
    return bad(msg, msglen, "table record's name holds a NUL byte");
  get_spec(&r, &t->spec);
  char e[400];
  if (psd_tablespec_check(&t->spec, e, sizeof e) != 0)
    return bad(msg, msglen, "table '%s' has a bad spec: %s", PS__ESC(t->spec.name), e);
  t->step = get64(&r);
  uint64_t c[NCOUNTERS];
  for (int i = 0; i < NCOUNTERS; i++) c[i] = get64(&r);
  counters_in(c, &t->counters);
  t->state_floats = get32(&r);
  if (t->state_floats != psd_rowopt_state_floats(&t->spec))
    return bad(msg, msglen, "table '%s' has %u optimizer state floats per row, its optimizer "
               "%u keeps %u", PS__ESC(t->spec.name), t->state_floats, t->spec.opt,
               psd_rowopt_state_floats(&t->spec));
  if (parse_tail(&r, end, t, msg, msglen) != 0) return -1;
  *used = (size_t)len;
  return 0;
}

/* ---- restoring -------------------------------------------------------------- */

int psd_ckpttable_restore(const psd_ckpttable *rec, psd_table *t, char *err, size_t errlen) {
  const char *name = PS__ESC(rec->spec.name);
  const psd_table_spec *sp = psd_table_spec_of(t);
  if (sp->dim != rec->spec.dim || psd_rowopt_state_floats(sp) != rec->state_floats) {
    snprintf(err, errlen, "table '%s': the checkpoint's rows have %u + %u floats, this table's "
             "%u + %u", name, rec->spec.dim, rec->state_floats, sp->dim,
             psd_rowopt_state_floats(sp));
    return PS_EMISMATCH;
  }
  if (psd_table_restore_aux(t, rec->aux, (size_t)rec->aux_len) != 0) {
    size_t have = 0;
    psd_table_aux(t, &have);
    snprintf(err, errlen, "table '%s': the checkpoint has %" PRIu64 " bytes of admission state, "
             "this table keeps %zu (admit_count or admit_prob changed?)", name, rec->aux_len,
             have);
    return PS_EMISMATCH;
  }
  /* Rows lie unaligned in the file: each goes through an aligned copy. */
  size_t nf = (size_t)rec->spec.dim + rec->state_floats;
  float *row = malloc(nf * sizeof *row);
  if (!row) {
    snprintf(err, errlen, "table '%s': out of memory restoring its rows", name);
    return PS_ENOMEM;
  }
  const uint8_t *p = rec->rows;
  int rc = 0;
  for (uint64_t i = 0; i < rec->nrows && rc == 0; i++) {
    rcur r = {p};
    uint64_t key = get64(&r), touched = get64(&r);
    memcpy(row, r.p, nf * sizeof *row);
    p = r.p + nf * sizeof *row;
    rc = psd_table_restore_row(t, key, row, row + rec->spec.dim, touched);
    if (rc)
      snprintf(err, errlen, "table '%s': row %" PRIu64 " (key %" PRIu64 ") of the checkpoint "
               "cannot be restored: %s", name, i, key,
               rc == PS_ENOMEM ? "out of memory" : "a duplicate key, or more rows than fit");
  }
  free(row);
  if (rc == 0) psd_table_restore_step(t, rec->step, &rec->counters);
  return rc;
}
