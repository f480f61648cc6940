/* test_waiters.c - psd/waiters.c: parked pulls expire in deadline order,
 * once per request, in O(log n) each (no scan of every waiter); waking,
 * superseding and closing take waiters out of the deadline heap. */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "testutil.h"
#include "waiters.h"

#define NSETS 100    /* connections */
#define NSLICES 300  /* slices each pulls: 30k parked pulls in all */

typedef struct {
  double last;       /* deadline of the previous report */
  uint32_t reports;  /* callbacks so far */
  int out_of_order;  /* a report came before an earlier deadline's */
  double now;        /* the expiry pass's time */
  int too_early;     /* a report of a deadline after now */
} expiry_log;

static void on_expired(void *ctx, psd_waitset *set, const psd_waiter *w) {
  expiry_log *l = ctx;
  (void)set;
  if (w->deadline < l->last) l->out_of_order = 1;
  if (w->deadline > l->now) l->too_early = 1;
  l->last = w->deadline;
  l->reports++;
}

static double mono(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* 30k parked pulls with distinct random deadlines, expired a few at a time
 * (each pass takes those due): every one is reported, in deadline order,
 * never before its deadline, and each pass costs O(log n) per expiry. */
START_TEST(expire_in_deadline_order) {
  psd_waiters ws;
  psd_waiters_init(&ws);
  psd_waitset *sets = calloc(NSETS, sizeof *sets);
  ck_assert_ptr_nonnull(sets);
  uint64_t seed = 0x9e3779b97f4a7c15ULL ^ tu_seed("waiters"), req = 0;
  for (int s = 0; s < NSETS; s++) {
    ck_assert_int_eq(psd_waiters_set_reserve(&ws, &sets[s], NSLICES), 0);
    for (uint32_t i = 0; i < NSLICES; i++) {
      double deadline = 1.0 + (double)(rng(&seed) % 1000000) / 1000.0; /* 1..1001 s */
      ck_assert_int_eq(psd_waiters_pull(&ws, &sets[s], i, ++req, 5, deadline, 0), 0);
    }
  }
  ck_assert_uint_eq(ws.heap_n, NSETS * NSLICES);
  expiry_log l = {0};
  uint32_t total = 0, passes = 0;
  double t0 = mono();
  /* 30k passes of about one expiry each: a scan of all waiters per pass
   * would be ~10^9 steps (seconds); the heap makes it milliseconds. */
  for (double now = 1.0; now <= 1002.0; now += 1.0 / 30.0) {
    l.now = now;
    uint32_t n = psd_waiters_expire(&ws, now, on_expired, &l);
    total += n;
    passes++;
    ck_assert_uint_eq(ws.heap_n, NSETS * NSLICES - total);
    if (ws.heap_n) ck_assert(psd_waiters_next_deadline(&ws) > now);
  }
  double took = mono() - t0;
  ck_assert_uint_eq(total, NSETS * NSLICES);
  ck_assert_uint_eq(l.reports, NSETS * NSLICES); /* one request per waiter */
  ck_assert_int_eq(l.out_of_order, 0);
  ck_assert_int_eq(l.too_early, 0);
  ck_assert_msg(took < tu_time_limit(2.0), "%u expiry passes took %.3f s", passes, took);
  for (int s = 0; s < NSETS; s++) psd_waiters_set_free(&ws, &sets[s]);
  free(sets);
  psd_waiters_free(&ws);
}
END_TEST

/* A request's waiters are reported once; a woken, superseded or closed
 * waiter never expires. */
START_TEST(expire_once_per_request) {
  psd_waiters ws;
  psd_waiters_init(&ws);
  psd_waitset a = {0}, b = {0};
  ck_assert_int_eq(psd_waiters_set_reserve(&ws, &a, 8), 0);
  ck_assert_int_eq(psd_waiters_set_reserve(&ws, &b, 8), 0);
  for (uint32_t i = 0; i < 8; i++) ck_assert_int_eq(psd_waiters_pull(&ws, &a, i, 1, 3, 10.0, 0), 0);
  for (uint32_t i = 0; i < 4; i++) ck_assert_int_eq(psd_waiters_pull(&ws, &b, i, 7, 3, 5.0, 0), 0);
  /* Slice 0 reaches step 3: a's and b's waiters of it are ready. */
  psd_waiters_wake(&ws, 0, 3);
  ck_assert(psd_waiters_set_busy(&a, 0));
  ck_assert(psd_waiters_set_busy(&b, 0));
  ck_assert_uint_eq(ws.heap_n, 10);
  /* b pulls slice 1 again (request 8, later deadline): supersedes 7's. */
  ck_assert_int_eq(psd_waiters_pull(&ws, &b, 1, 8, 3, 20.0, 0), 0);
  expiry_log l = {0};
  l.now = 6.0;
  ck_assert_uint_eq(psd_waiters_expire(&ws, 6.0, on_expired, &l), 2); /* b: slices 2, 3 */
  ck_assert_uint_eq(l.reports, 1);
  l.now = 10.0;
  ck_assert_uint_eq(psd_waiters_expire(&ws, 10.0, on_expired, &l), 7); /* a: 1..7 */
  ck_assert_uint_eq(l.reports, 2);
  ck_assert_uint_eq(ws.heap_n, 1);
  /* b closes: its last parked pull leaves the heap. */
  psd_waiters_set_free(&ws, &b);
  ck_assert_uint_eq(ws.heap_n, 0);
  ck_assert_uint_eq(psd_waiters_expire(&ws, 100.0, on_expired, &l), 0);
  /* Dirty list: only a is left with a ready pull. */
  ck_assert_ptr_eq(psd_waiters_next_dirty(&ws), &a);
  ck_assert_ptr_null(psd_waiters_next_dirty(&ws));
  psd_waiter *w = psd_waiters_take_ready(&a);
  ck_assert_ptr_nonnull(w);
  ck_assert_uint_eq(w->slice_id, 0);
  ck_assert_ptr_null(w->ready_next);
  psd_waiters_answered(w);
  ck_assert(!psd_waiters_set_busy(&a, 0));
  psd_waiters_set_free(&ws, &a);
  psd_waiters_free(&ws);
}
END_TEST

/* wake_all (the job stopped) readies every parked pull, in one pass. */
START_TEST(wake_all_empties_heap) {
  psd_waiters ws;
  psd_waiters_init(&ws);
  psd_waitset a = {0};
  ck_assert_int_eq(psd_waiters_set_reserve(&ws, &a, 64), 0);
  for (uint32_t i = 0; i < 64; i++)
    ck_assert_int_eq(psd_waiters_pull(&ws, &a, i, i + 1, 9, 50.0 - i, 0), 0);
  psd_waiters_wake_all(&ws);
  ck_assert_uint_eq(ws.heap_n, 0);
  uint32_t n = 0;
  for (psd_waiter *w = psd_waiters_take_ready(&a); w; w = w->ready_next) n++;
  ck_assert_uint_eq(n, 64);
  psd_waiters_set_free(&ws, &a);
  psd_waiters_free(&ws);
}
END_TEST

Suite *suite_waiters(void) {
  Suite *s = suite_create("waiters");
  TCase *tc = tcase_create("heap");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, expire_in_deadline_order);
  tcase_add_test(tc, expire_once_per_request);
  tcase_add_test(tc, wake_all_empties_heap);
  suite_add_tcase(s, tc);
  return s;
}
