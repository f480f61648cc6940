/* test_par.c - psd/par.c: a range is cut into chunks that cover it once,
 * helpers take chunks while the caller is busy, the caller takes them all
 * when no helper comes, small ranges and a NULL pool run inline, many
 * rounds in a row neither lose nor repeat a chunk, and the finite scan
 * sees every chunk. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "par.h"
#include "testutil.h"

typedef struct cover {
  unsigned char *seen; /* per item: how many chunks covered it */
  unsigned chunks;     /* chunks run (atomically counted) */
  pthread_t caller;
  int wait_for_helper; /* the caller's first chunk waits for a helper's */
  unsigned by_helpers; /* chunks run by other threads than the caller */
} cover;

static void mark(void *arg, size_t lo, size_t hi) {
  cover *c = arg;
  for (size_t i = lo; i < hi; i++) c->seen[i]++;
  __atomic_fetch_add(&c->chunks, 1, __ATOMIC_RELAXED);
  if (!pthread_equal(pthread_self(), c->caller)) {
    __atomic_fetch_add(&c->by_helpers, 1, __ATOMIC_RELEASE);
    return;
  }
  /* Blocks the caller (10 s at most) until a helper ran a chunk: they do
   * run, not only the caller. */
  for (int i = 0; c->wait_for_helper && i < 10000; i++) {
    if (__atomic_load_n(&c->by_helpers, __ATOMIC_ACQUIRE)) break;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  c->wait_for_helper = 0;
}

/* Runs mark over [0, n) on p; checks every item once; returns the chunks. */
static unsigned run_cover(psd_par *p, size_t n, int wait_for_helper, unsigned *by_helpers) {
  cover c;
  memset(&c, 0, sizeof c);
  c.seen = calloc(n ? n : 1, 1);
  c.caller = pthread_self();
  c.wait_for_helper = wait_for_helper;
  ck_assert_ptr_nonnull(c.seen);
  psd_par_run(p, n, mark, &c);
  size_t bad = n; /* the first item not covered exactly once (an assertion per item is slow) */
  for (size_t i = 0; i < n && bad == n; i++)
    if (c.seen[i] != 1) bad = i;
  ck_assert_msg(bad == n, "item %zu of %zu covered %u times", bad, n, bad < n ? c.seen[bad] : 1);
  free(c.seen);
  if (by_helpers) *by_helpers = c.by_helpers;
  return c.chunks;
}

START_TEST(chunks_cover_the_range_once) {
  static const unsigned threads[] = {1, 2, 3, 8};
  static const size_t sizes[] = {0, 1, 2 * PSD_PAR_MIN_PART - 1, 2 * PSD_PAR_MIN_PART,
                                 3 * PSD_PAR_MIN_PART + 7, 40 * PSD_PAR_MIN_PART + 3};
  for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
    psd_par *p = NULL;
    ck_assert_int_eq(psd_par_create(threads[t], &p), 0);
    ck_assert_uint_eq(psd_par_threads(p), threads[t]);
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
      size_t n = sizes[s], want = psd_par_chunks(p, n);
      ck_assert_msg(want == (n == 0 ? 0 : threads[t] == 1 || n < 2 * PSD_PAR_MIN_PART ? 1
                             : n / PSD_PAR_MIN_PART < 4 * threads[t] ? n / PSD_PAR_MIN_PART
                                                                      : 4 * threads[t]),
                    "%u threads, %zu items: %zu chunks", threads[t], n, want);
      unsigned by = 0;
      ck_assert_uint_eq(run_cover(p, n, want > 1, &by), want);
      if (want > 1) ck_assert_msg(by > 0, "%u threads, %zu items: no helper ran a chunk",
                                  threads[t], n);
    }
    psd_par_destroy(p);
  }
}
END_TEST

START_TEST(inline_without_a_pool) {
  psd_par_destroy(NULL); /* a no-op */
  ck_assert_uint_eq(psd_par_threads(NULL), 1);
  ck_assert_uint_eq(run_cover(NULL, 5 * PSD_PAR_MIN_PART, 0, NULL), 1);
  psd_par *p = NULL;
  ck_assert_int_eq(psd_par_create(0, &p), 0); /* 0 means 1: no helper */
  ck_assert_uint_eq(psd_par_threads(p), 1);
  ck_assert_uint_eq(run_cover(p, 5 * PSD_PAR_MIN_PART, 0, NULL), 1);
  psd_par_destroy(p);
}
END_TEST

/* Back-to-back rounds: a helper that woke for one round late, or claimed
 * a chunk twice, would leave an item uncovered or covered twice. */
START_TEST(rounds_back_to_back) {
  psd_par *p = NULL;
  ck_assert_int_eq(psd_par_create(3, &p), 0);
  for (int r = 0; r < 2000; r++) {
    size_t n = (size_t)(2 + r % 5) * PSD_PAR_MIN_PART + (size_t)r;
    ck_assert_uint_eq(run_cover(p, n, 0, NULL), psd_par_chunks(p, n));
  }
  psd_par_destroy(p);
}
END_TEST

/* The scan finds a NaN or an infinity in any chunk, the last element's
 * too, and passes finite values (the largest, the smallest denormal). */
START_TEST(all_finite_sees_every_chunk) {
  psd_par *p = NULL;
  ck_assert_int_eq(psd_par_create(3, &p), 0);
  const size_t rows = 9 * PSD_PAR_MIN_PART + 5, dim = 3, all = rows * dim;
  float *v = malloc(all * sizeof *v);
  ck_assert_ptr_nonnull(v);
  for (size_t i = 0; i < all; i++) v[i] = i % 2 ? FLT_MAX : -FLT_TRUE_MIN;
  ck_assert_int_eq(psd_par_all_finite(p, v, rows, dim), 1);
  ck_assert_int_eq(psd_par_all_finite(NULL, v, rows, dim), 1);
  const size_t at[] = {0, all / 2, all - 1};
  const float bad[] = {NAN, INFINITY, -INFINITY};
  for (size_t a = 0; a < 3; a++)
    for (size_t b = 0; b < 3; b++) {
      float keep = v[at[a]];
      v[at[a]] = bad[b];
      ck_assert_msg(psd_par_all_finite(p, v, rows, dim) == 0, "%g at %zu not seen", bad[b],
                    at[a]);
      v[at[a]] = keep;
    }
  ck_assert_int_eq(psd_par_all_finite(p, NULL, 0, dim), 1);
  free(v);
  psd_par_destroy(p);
}
END_TEST

Suite *suite_par(void) {
  Suite *s = suite_create("par");
  TCase *tc = tcase_create("par");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, chunks_cover_the_range_once);
  tcase_add_test(tc, inline_without_a_pool);
  tcase_add_test(tc, rounds_back_to_back);
  tcase_add_test(tc, all_finite_sees_every_chunk);
  suite_add_tcase(s, tc);
  return s;
}
