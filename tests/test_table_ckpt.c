/* Sparse tables in checkpoints (psd/ckpt_table.c, checkpoint.c, persist.c):
 * a table's record through a real file and back (rows bit for bit, LRU
 * order, admission state, step, counters; the restored table then trains
 * exactly like the original), damaged table records refused, version 2
 * files still read. */
#define _GNU_SOURCE
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "ckpt_table.h"
#include "mac.h"
#include "table.h"
#include "testutil.h"
#include "util.h"

#define MAXB (1u << 26)

static char *fresh_dir(const char *name) {
  static char buf[4][600];
  static int k;
  char *d = buf[k++ % 4];
  snprintf(d, 600, "%s/%s-%d", tu_tmpdir(), name, rand());
  ck_assert_int_eq(mkdir(d, 0700), 0);
  return d;
}

/* One open directory per test (a test runs in its own process), opened
 * once: psd holds its directory's lock for its life. */
static psd_ckpt_dir *open_dir(const char *dir) {
  static psd_ckpt_dir d;
  static char opened[600];
  if (strcmp(opened, dir) == 0) return &d;
  snprintf(opened, sizeof opened, "%s", dir);
  psd_ckpt_holder h = {1, 0, 1};
  char moved[1200], err[1600];
  ck_assert_msg(psd_ckpt_dir_open(&d, dir, &h, 0, moved, sizeof moved, err, sizeof err) == 0,
                "%s", err);
  return &d;
}

/* A spec exercising every kind of state: optimizer state per row, the
 * admission sketch (admit_count) or generator (admit_prob), eviction. */
static psd_table_spec spec_of(const char *name, uint32_t opt, uint32_t admit_count,
                              double admit_prob) {
  psd_table_spec s;
  memset(&s, 0, sizeof s);
  snprintf(s.name, sizeof s.name, "%s", name);
  s.dim = 5;
  s.capacity = 24;
  s.init_kind = PS_INIT_UNIFORM;
  s.init_a = -0.5;
  s.init_b = 0.5;
  s.init_seed = 11;
  s.opt = opt;
  s.lr = 0.1;
  s.initial_accumulator = 0.1;
  s.beta1 = 0.9;
  s.beta2 = 0.999;
  s.epsilon = 1e-7;
  s.ftrl_beta = 1;
  s.admit_count = admit_count;
  s.admit_prob = admit_prob;
  s.evict_after_steps = 3;
  return s;
}

static psd_table *make(const psd_table_spec *s) {
  psd_table *t = NULL;
  char err[400];
  ck_assert_msg(psd_table_create(s, 1, 1, 0, &t, err, sizeof err) == 0, "%s", err);
  return t;
}

/* Steps [from, to) of a deterministic workload: each pulls 12 keys of 60
 * (more than the capacity: evictions, repeated sightings) and pushes
 * gradients for them. */
static void train(psd_table *t, uint64_t from, uint64_t to) {
  uint32_t dim = psd_table_spec_of(t)->dim;
  for (uint64_t s = from; s < to; s++) {
    uint64_t keys[12];
    float rows[12 * 8], g[12 * 8];
    for (int i = 0; i < 12; i++) keys[i] = (uint64_t)i * 5 + (s * 7 + (uint64_t)i) % 5;
    ck_assert_int_ge(psd_table_pull(t, keys, 12, 1, rows), 0);
    for (uint32_t i = 0; i < 12 * dim; i++) g[i] = 0.01f * (float)((s + i) % 13) - 0.05f;
    uint64_t dropped;
    ck_assert_int_eq(psd_table_push(t, 0, s, keys, 12, g, &dropped), 1);
  }
}

/* Everything a walk yields, as bytes in walk order. */
typedef struct dump {
  uint8_t *b;
  size_t n, cap;
  uint32_t dim, sf;
} dump;

static void put(dump *d, const void *p, size_t n) {
  if (d->n + n > d->cap) {
    d->cap = 2 * (d->n + n);
    d->b = realloc(d->b, d->cap);
    ck_assert_ptr_nonnull(d->b);
  }
  memcpy(d->b + d->n, p, n);
  d->n += n;
}

static void dump_row(void *ctx, uint64_t key, const float *v, const float *st, uint64_t at) {
  dump *d = ctx;
  put(d, &key, 8);
  put(d, &at, 8);
  put(d, v, d->dim * sizeof(float));
  if (d->sf) put(d, st, d->sf * sizeof(float));
}

/* Walk, aux, step and counters of a: equal to b's, bit for bit. */
static void same_table(const psd_table *a, const psd_table *b) {
  const psd_table_spec *sp = psd_table_spec_of(a);
  dump x = {NULL, 0, 0, sp->dim, psd_table_state_floats(sp)}, y = x;
  psd_table_walk(a, dump_row, &x);
  psd_table_walk(b, dump_row, &y);
  ck_assert_msg(x.n == y.n && x.n > 0, "table '%s': %zu vs %zu bytes of rows", sp->name, x.n,
                y.n);
  ck_assert_msg(memcmp(x.b, y.b, x.n) == 0, "table '%s': rows or LRU order differ", sp->name);
  size_t la, lb;
  const void *aa = psd_table_aux(a, &la), *ab = psd_table_aux(b, &lb);
  ck_assert_msg(la == lb && memcmp(aa, ab, la) == 0, "table '%s': aux differs", sp->name);
  ck_assert_uint_eq(psd_table_step(a), psd_table_step(b));
  psd_table_stats sa = psd_table_get_stats(a), sb = psd_table_get_stats(b);
  ck_assert_msg(memcmp(&sa, &sb, sizeof sa) == 0, "table '%s': counters differ", sp->name);
  free(x.b);
  free(y.b);
}

/* Appends t's record (encoded as psd does on its loop) to w. */
static void add_table(psd_ckpt_writer *w, const psd_table *t) {
  size_t len = psd_ckpt_table_size(t);
  ck_assert_uint_gt(len, PSD_CKPT_TABLE_MIN_BYTES);
  uint8_t *buf = malloc(len);
  psd_ckpt_table_encode(t, buf, len);
  char err[1200];
  ck_assert_msg(psd_ckpt_add_table(w, buf, len, err, sizeof err) == 0, "%s", err);
  free(buf);
}

/* A file of step 6 holding a slice, tables[0], a slice, tables[1]
 * (records interleave as psd captures them); returns its path. */
static const char *write_file(const char *dir, psd_table *const tables[2]) {
  static char path[1200];
  float p[3] = {1, 2, 3};
  psd_ckpt_rec a = {.name = "w", .ndim = 1, .shape = {6}, .length = 3, .step = 6, .param = p};
  psd_ckpt_rec b = a;
  b.offset = 3;
  psd_ckpt_meta m = {0, 1, 1, 1, 0, 6, 2, 2};
  psd_ckpt_writer w;
  char err[1200];
  ck_assert_msg(psd_ckpt_begin(&w, open_dir(dir), &m, err, sizeof err) == 0, "%s", err);
  ck_assert_msg(psd_ckpt_add(&w, &a, err, sizeof err) == 0, "%s", err);
  add_table(&w, tables[0]);
  ck_assert_msg(psd_ckpt_add(&w, &b, err, sizeof err) == 0, "%s", err);
  add_table(&w, tables[1]);
  ck_assert_msg(psd_ckpt_commit(&w, err, sizeof err) == 0, "%s", err);
  snprintf(path, sizeof path, "%s/step-000000000006/ps-0-of-1.ckpt", dir);
  return path;
}

START_TEST(table_roundtrip_through_a_file) {
  psd_table_spec s0 = spec_of("emb/adagrad", PS_TOPT_ADAGRAD, 2, 0);
  psd_table_spec s1 = spec_of("emb/adam", PS_TOPT_ADAM, 0, 0.6);
  psd_table *orig[2] = {make(&s0), make(&s1)};
  train(orig[0], 0, 10);
  train(orig[1], 0, 10);
  ck_assert_uint_gt(psd_table_get_stats(orig[0]).evictions_lru +
                        psd_table_get_stats(orig[0]).evictions_ttl, 0);
  const char *dir = fresh_dir("trt");
  const char *f = write_file(dir, orig);
  psd_ckpt_image img;
  char err[1600];
  ck_assert_msg(psd_ckpt_read(open_dir(dir), f, MAXB, &img, err, sizeof err) == 0, "%s", err);
  ck_assert_uint_eq(img.meta.nslices, 2);
  ck_assert_uint_eq(img.meta.ntables, 2);
  ck_assert_uint_eq(img.recs[1].offset, 3);
  for (int k = 0; k < 2; k++) {
    const psd_ckpt_table *r = &img.tables[k];
    ck_assert_str_eq(r->spec.name, k ? "emb/adam" : "emb/adagrad");
    ck_assert_uint_eq(r->step, 10);
    ck_assert_uint_eq(r->nrows, psd_table_get_stats(orig[k]).rows);
    ck_assert_int_eq(psd_table_diff(&r->spec, "file", psd_table_spec_of(orig[k]), "table", err,
                                    sizeof err), 0);
    psd_table *back = make(psd_table_spec_of(orig[k]));
    ck_assert_msg(psd_ckpt_table_restore(r, back, err, sizeof err) == 0, "%s", err);
    same_table(orig[k], back);
    /* The restored table goes on exactly as the original: same
     * admissions (sketch, generator), evictions (LRU order) and values. */
    train(orig[k], 10, 16);
    train(back, 10, 16);
    same_table(orig[k], back);
    psd_table_destroy(back);
    psd_table_destroy(orig[k]);
  }
  psd_ckpt_image_free(&img);
}
END_TEST

/* Rewrites CRC and MAC after an edit, so only the record parser can
 * refuse it. */
static void resign(uint8_t *b, size_t n, const psd_ckpt_dir *d) {
  uint32_t c = psd_crc32c(0, b, n - 36);
  for (int i = 0; i < 4; i++) b[n - 36 + i] = (uint8_t)(c >> (8 * i));
  ps__mac_part part = {b, n - 32};
  ck_assert_int_eq(ps__hmac(d->key, sizeof d->key, &part, 1, b + n - 32), 0);
}

static uint8_t *slurp(const char *path, size_t *n) {
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  *n = (size_t)st.st_size;
  char *s = tu_read_file(path);
  ck_assert_ptr_nonnull(s);
  return (uint8_t *)s;
}

static int parse_copy(const uint8_t *b, size_t n, const psd_ckpt_dir *d, char *err,
                      size_t errlen) {
  psd_ckpt_image img;
  memset(&img, 0, sizeof img);
  snprintf(img.path, sizeof img.path, "edited.ckpt");
  img.buf = malloc(n);
  memcpy(img.buf, b, n);
  img.len = n;
  int rc = psd_ckpt_parse(&img, d, err, errlen);
  if (rc == 0) psd_ckpt_image_free(&img);
  return rc;
}

START_TEST(damaged_table_records_are_refused) {
  psd_table_spec s0 = spec_of("t0", PS_TOPT_SGD, 0, 0), s1 = spec_of("t1", PS_TOPT_FTRL, 0, 0);
  psd_table *tabs[2] = {make(&s0), make(&s1)};
  train(tabs[0], 0, 3);
  train(tabs[1], 0, 3);
  const char *dir = fresh_dir("tdmg");
  psd_ckpt_dir *d = open_dir(dir);
  size_t n;
  uint8_t *orig = slurp(write_file(dir, tabs), &n);
  char err[1600];
  ck_assert_msg(parse_copy(orig, n, d, err, sizeof err) == 0, "%s", err);
  /* The first table record follows the header (80) and a 3-float slice
   * record (4 + 4 + 1 + 4 + 8 + 32 + 12 = 65): at 145. Its fields: record
   * length at +4, name length at +12, name "t0", spec at +18 (dim first,
   * capacity at +22, opt at +46), step, counters, state floats, aux
   * length, rows. */
  size_t t = 145, aux_len_at = t + 18 + 128 + 8 + 72 + 4;
  uint64_t aux_len = 0;
  for (int i = 0; i < 8; i++) aux_len |= (uint64_t)orig[aux_len_at + i] << (8 * i);
  size_t rows_at = aux_len_at + 8 + aux_len;
  uint64_t nrows = 0;
  for (int i = 0; i < 8; i++) nrows |= (uint64_t)orig[rows_at + i] << (8 * i);
  ck_assert_uint_gt(nrows, 1);
  struct { size_t at; uint64_t v; int bytes; const char *want; } cases[] = {
      {t, 0x4c424154u ^ 1, 4, "not a slice or table"},
      {t + 4, 1u << 30, 8, "bytes, "},
      {t + 4, 20, 8, "bytes, "},
      {t + 12, 0, 4, "bad name length"},
      {t + 12, 300, 4, "bad name length"},
      {t + 18, 0, 4, "bad spec"},
      {t + 18, 6, 4, "do not fill"},
      {t + 22, 1, 8, "more than its capacity"},
      {t + 58, 9, 4, "bad spec"},
      {aux_len_at - 4, 3, 4, "state floats"},
      {aux_len_at, UINT64_MAX - 3, 8, "admission state"},
      {rows_at, nrows - 1, 8, "do not fill"},
      {rows_at, UINT64_MAX / 2, 8, "more than its capacity"},
      {52, 3, 4, "2 of 3 table records"},
      {52, 1, 4, "promised"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    uint8_t *b = malloc(n);
    memcpy(b, orig, n);
    for (int i = 0; i < cases[k].bytes; i++) b[cases[k].at + i] = (uint8_t)(cases[k].v >> (8 * i));
    if (cases[k].at == 52) /* the trailer's count agrees: the records decide */
      for (int i = 0; i < 4; i++) b[n - 40 + i] = (uint8_t)((2 + cases[k].v) >> (8 * i));
    resign(b, n, d);
    ck_assert_msg(parse_copy(b, n, d, err, sizeof err) == -1, "case %zu accepted", k);
    ck_assert_msg(strstr(err, "edited.ckpt") && strstr(err, cases[k].want), "case %zu: %s", k,
                  err);
    free(b);
  }
  free(orig);
  psd_table_destroy(tabs[0]);
  psd_table_destroy(tabs[1]);
}
END_TEST

START_TEST(version_2_files_are_still_read) {
  /* A version-2 file is a version-3 file without tables, with 2 in the
   * version field. */
  const char *dir = fresh_dir("v2");
  psd_ckpt_dir *d = open_dir(dir);
  float p[2] = {4, 5};
  psd_ckpt_rec a = {.name = "v", .ndim = 1, .shape = {2}, .length = 2, .step = 9, .param = p};
  psd_ckpt_meta m = {0, 1, 1, 1, 0, 9, 1, 0};
  psd_ckpt_writer w;
  char err[1600];
  ck_assert_msg(psd_ckpt_begin(&w, d, &m, err, sizeof err) == 0, "%s", err);
  ck_assert_msg(psd_ckpt_add(&w, &a, err, sizeof err) == 0, "%s", err);
  ck_assert_msg(psd_ckpt_commit(&w, err, sizeof err) == 0, "%s", err);
  char f[1200];
  snprintf(f, sizeof f, "%s/step-000000000009/ps-0-of-1.ckpt", dir);
  size_t n;
  uint8_t *b = slurp(f, &n);
  ck_assert_uint_eq(b[8], PSD_CKPT_VERSION);
  b[8] = 2;
  resign(b, n, d);
  ck_assert_msg(parse_copy(b, n, d, err, sizeof err) == 0, "%s", err);
  b[8] = 4;
  resign(b, n, d);
  ck_assert_int_eq(parse_copy(b, n, d, err, sizeof err), -1);
  ck_assert_msg(strstr(err, "format version 4, this psd reads versions 2 and 3"), "%s", err);
  free(b);
}
END_TEST

/* The loop's pause when a big table is captured: encoding a 1M-row dim-16
 * Adagrad table (what persist.c does on the event loop). Prints the time
 * (docs/checkpoint.md quotes it); bounded loosely, for slow and sanitized
 * builds. */
START_TEST(big_table_copy_time) {
  psd_table_spec s = spec_of("big", PS_TOPT_ADAGRAD, 0, 0);
  s.dim = 16;
  s.capacity = 1u << 20;
  s.evict_after_steps = 0;
  psd_table *t = make(&s);
  enum { CHUNK = 8192 };
  uint64_t *keys = malloc(CHUNK * sizeof *keys);
  float *rows = malloc((size_t)CHUNK * 16 * sizeof *rows);
  for (uint64_t k0 = 0; k0 < s.capacity; k0 += CHUNK) {
    for (int i = 0; i < CHUNK; i++) keys[i] = k0 + (uint64_t)i;
    ck_assert_int_eq(psd_table_pull(t, keys, CHUNK, 1, rows), 0);
  }
  ck_assert_uint_eq(psd_table_get_stats(t).rows, s.capacity);
  /* The first checkpoint copies into a fresh buffer (its pages faulted in
   * on the loop); later ones reuse the spare the writer handed back. */
  size_t len = psd_ckpt_table_size(t);
  uint8_t *buf = malloc(len);
  double t0 = ps__now(), fresh, reused = 1e9;
  psd_ckpt_table_encode(t, buf, len);
  fresh = (ps__now() - t0) * 1e3;
  for (int rep = 0; rep < 3; rep++) {
    t0 = ps__now();
    psd_ckpt_table_encode(t, buf, len);
    double ms = (ps__now() - t0) * 1e3;
    if (ms < reused) reused = ms;
  }
  free(buf);
  printf("big_table_copy_time: 1M rows of dim 16 (Adagrad), %.1f MB: %.1f ms into a fresh "
         "buffer, %.1f ms into a reused one\n", len / 1e6, fresh, reused);
  ck_assert_msg(reused < 5000, "%.0f ms", reused);
  free(keys);
  free(rows);
  psd_table_destroy(t);
}
END_TEST

Suite *suite_table_ckpt(void) {
  Suite *s = suite_create("table_ckpt");
  TCase *tc = tcase_create("file");
  tcase_add_test(tc, table_roundtrip_through_a_file);
  tcase_add_test(tc, damaged_table_records_are_refused);
  tcase_add_test(tc, version_2_files_are_still_read);
  suite_add_tcase(s, tc);
  TCase *big = tcase_create("big");
  tcase_set_timeout(big, 300);
  tcase_add_test(big, big_table_copy_time);
  suite_add_tcase(s, big);
  return s;
}
