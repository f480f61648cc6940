/* Placement: greedy balancing of small variables, splitting of big ones,
 * chunking, and the server-side check that accepts exactly those slices. */
#include <check.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"
#include "testutil.h"

/* Places numel on p into a fresh array; *n gets the count, which must equal
 * ps__placer_count() taken before. */
static ps__slice_place *place(ps__placer *p, uint64_t numel, size_t *n) {
  size_t want = ps__placer_count(p, numel);
  ck_assert_uint_gt(want, 0);
  ps__slice_place *s = calloc(want, sizeof *s);
  ck_assert_ptr_nonnull(s);
  *n = ps__placer_place(p, numel, s, want);
  ck_assert_uint_eq(*n, want);
  return s;
}

/* Every slice passes the check for its own ps, and shifted or
 * resized ones fail; a split variable's slices fail on other ps. */
static void check_all(const ps__placer *p, uint64_t numel,
                      const ps__slice_place *s, size_t n, int split) {
  char err[256];
  for (size_t i = 0; i < n; i++) {
    int rc = ps__placement_check(p->num_ps, s[i].ps, p->split_threshold,
                                 p->max_slice_bytes, numel, s[i].offset,
                                 s[i].length, err, sizeof err);
    ck_assert_msg(rc == 0, "slice %zu rejected: %s", i, err);
    /* Shifted by one element. */
    if (s[i].offset + s[i].length < numel) {
      rc = ps__placement_check(p->num_ps, s[i].ps, p->split_threshold,
                               p->max_slice_bytes, numel, s[i].offset + 1,
                               s[i].length, err, sizeof err);
      ck_assert_int_eq(rc, PS_ESHAPE);
      ck_assert(strlen(err) > 0);
    }
    /* One element shorter (when it can be). */
    if (s[i].length > 1) {
      rc = ps__placement_check(p->num_ps, s[i].ps, p->split_threshold,
                               p->max_slice_bytes, numel, s[i].offset,
                               s[i].length - 1, err, sizeof err);
      ck_assert_int_eq(rc, PS_ESHAPE);
    }
    /* Another ps: only a split variable's slices are tied to their ps. */
    if (p->num_ps > 1) {
      uint32_t other = (s[i].ps + 1) % p->num_ps;
      rc = ps__placement_check(p->num_ps, other, p->split_threshold,
                               p->max_slice_bytes, numel, s[i].offset,
                               s[i].length, err, sizeof err);
      ck_assert_int_eq(rc, split ? PS_ESHAPE : 0);
    }
  }
}

/* Slices cover [0, numel) exactly once, in order, each at most c long. */
static void check_cover(const ps__slice_place *s, size_t n, uint64_t numel,
                        uint64_t c) {
  uint64_t next = 0;
  for (size_t i = 0; i < n; i++) {
    ck_assert_uint_eq(s[i].offset, next);
    ck_assert_uint_gt(s[i].length, 0);
    ck_assert_uint_le(s[i].length, c);
    next += s[i].length;
  }
  ck_assert_uint_eq(next, numel);
}

START_TEST(test_init_defaults) {
  ps__placer p;
  ck_assert_int_eq(ps__placer_init(&p, 0, 0, 0), PS_EINVAL);
  ck_assert_int_eq(ps__placer_init(NULL, 1, 0, 0), PS_EINVAL);
  ck_assert_int_eq(ps__placer_init(&p, 2, 0, 0), 0);
  ck_assert_uint_eq(p.num_ps, 2);
  ck_assert_uint_eq(p.split_threshold, PS__DEFAULT_SPLIT_THRESHOLD);
  ck_assert_uint_eq(p.max_slice_bytes, PS__DEFAULT_MAX_SLICE_BYTES);
  ck_assert_uint_eq(p.load[0], 0);
  ck_assert_uint_eq(p.load[1], 0);
  ps__placer_free(&p);
  ps__placer_free(&p); /* idempotent */
  ps__placer_free(NULL);
  /* Rounded down to whole floats, at least one float. */
  ck_assert_int_eq(ps__placer_init(&p, 1, 100, 4099), 0);
  ck_assert_uint_eq(p.max_slice_bytes, 4096);
  ps__placer_free(&p);
  ck_assert_int_eq(ps__placer_init(&p, 1, 100, 3), 0);
  ck_assert_uint_eq(p.max_slice_bytes, 4);
  ck_assert_uint_eq(ps__placer_count(&p, 7), 7);
  ps__placer_free(&p);
}
END_TEST

START_TEST(test_small_balanced_two) {
  ps__placer p;
  ck_assert_int_eq(ps__placer_init(&p, 2, 0, 0), 0);
  /* element counts and the expected ps (greedy by bytes, ties low). */
  const uint64_t numel[] = {100, 50, 50, 10, 200, 1, 39};
  const uint32_t want[] = {0, 1, 1, 0, 1, 0, 0};
  for (size_t v = 0; v < sizeof numel / sizeof numel[0]; v++) {
    size_t n;
    ps__slice_place *s = place(&p, numel[v], &n);
    ck_assert_uint_eq(n, 1);
    ck_assert_uint_eq(s[0].ps, want[v]);
    ck_assert_uint_eq(s[0].offset, 0);
    ck_assert_uint_eq(s[0].length, numel[v]);
    check_all(&p, numel[v], s, n, 0);
    free(s);
  }
  ck_assert_uint_eq(p.load[0], 4 * (100 + 10 + 1 + 39));
  ck_assert_uint_eq(p.load[1], 4 * (50 + 50 + 200));
  ps__placer_free(&p);
}
END_TEST

START_TEST(test_small_balanced_three) {
  ps__placer p;
  ck_assert_int_eq(ps__placer_init(&p, 3, 0, 0), 0);
  const uint64_t numel[] = {10, 10, 10, 5, 30, 3, 3, 20};
  /* loads (elements): 10|0|0 10|10|0 10|10|10 15|10|10 15|40|10 15|40|13
   * 15|40|16 35|40|16 */
  const uint32_t want[] = {0, 1, 2, 0, 1, 2, 2, 0};
  for (size_t v = 0; v < sizeof numel / sizeof numel[0]; v++) {
    size_t n;
    ps__slice_place *s = place(&p, numel[v], &n);
    ck_assert_uint_eq(n, 1);
    ck_assert_uint_eq(s[0].ps, want[v]);
    free(s);
  }
  ck_assert_uint_eq(p.load[0], 4 * 35);
  ck_assert_uint_eq(p.load[1], 4 * 40);
  ck_assert_uint_eq(p.load[2], 4 * 16);

  /* Same sequence, same map: deterministic. */
  ps__placer q;
  ck_assert_int_eq(ps__placer_init(&q, 3, 0, 0), 0);
  for (size_t v = 0; v < sizeof numel / sizeof numel[0]; v++) {
    ps__slice_place s;
    ck_assert_uint_eq(ps__placer_place(&q, numel[v], &s, 1), 1);
    ck_assert_uint_eq(s.ps, want[v]);
  }
  ck_assert_mem_eq(p.load, q.load, 3 * sizeof(uint64_t));
  ps__placer_free(&q);
  ps__placer_free(&p);
}
END_TEST

START_TEST(test_split_big) {
  /* 1000 elements = 4000 bytes > 1000-byte threshold: split over 3 ps. */
  ps__placer p;
  ck_assert_int_eq(ps__placer_init(&p, 3, 1000, 1 << 20), 0);
  ps__slice_place warm;
  /* Make ps 0 busy first: a split ignores loads. */
  ck_assert_uint_eq(ps__placer_place(&p, 10, &warm, 1), 1);
  ck_assert_uint_eq(warm.ps, 0);
  size_t n;
  ps__slice_place *s = place(&p, 1000, &n);
  ck_assert_uint_eq(n, 3);
  const uint64_t bounds[] = {0, 333, 666, 1000};
  for (uint32_t i = 0; i < 3; i++) {
    ck_assert_uint_eq(s[i].ps, i);
    ck_assert_uint_eq(s[i].offset, bounds[i]);
    ck_assert_uint_eq(s[i].length, bounds[i + 1] - bounds[i]);
  }
  check_cover(s, n, 1000, 1000);
  check_all(&p, 1000, s, n, 1);
  ck_assert_uint_eq(p.load[0], 4 * (10 + 333));
  ck_assert_uint_eq(p.load[1], 4 * 333);
  ck_assert_uint_eq(p.load[2], 4 * 334);
  free(s);

  /* Exactly at the threshold: not split (strictly more than). */
  ck_assert_uint_eq(ps__placer_count(&p, 250), 1);
  ck_assert_uint_eq(ps__placer_count(&p, 251), 3);
  ps__placer_free(&p);
}
END_TEST

START_TEST(test_split_not_divisible) {
  /* 7 ps, 10 elements over a 4-byte threshold: parts floor(i*10/7). */
  ps__placer p;
  ck_assert_int_eq(ps__placer_init(&p, 7, 4, 0), 0);
  size_t n;
  ps__slice_place *s = place(&p, 10, &n);
  ck_assert_uint_eq(n, 7);
  for (size_t i = 0; i < n; i++) {
    ck_assert_uint_eq(s[i].ps, i);
    ck_assert_uint_eq(s[i].offset, i * 10 / 7);
    ck_assert_uint_eq(s[i].length, (i + 1) * 10 / 7 - i * 10 / 7);
  }
  check_cover(s, n, 10, 2);
  check_all(&p, 10, s, n, 1);
  free(s);

  /* 3 elements over 7 ps: empty parts produce no slice. */
  s = place(&p, 3, &n);
  ck_assert_uint_eq(n, 3);
  ck_assert_uint_eq(s[0].ps, 2); /* floor(3*3/7)=1 .. */
  ck_assert_uint_eq(s[1].ps, 4);
  ck_assert_uint_eq(s[2].ps, 6);
  check_cover(s, n, 3, 1);
  check_all(&p, 3, s, n, 1);
  char err[256];
  ck_assert_int_eq(ps__placement_check(7, 0, 4, 0, 3, 0, 1, err, sizeof err),
                   PS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err, "ps 0"));
  free(s);
  ps__placer_free(&p);
}
END_TEST

START_TEST(test_chunking) {
  /* 100-byte chunks = 25 elements; threshold 400 bytes; 2 ps. */
  ps__placer p;
  ck_assert_int_eq(ps__placer_init(&p, 2, 400, 100), 0);
  /* 60 elements (240 bytes): whole on ps 0, chunks 25, 25, 10. */
  size_t n;
  ps__slice_place *s = place(&p, 60, &n);
  ck_assert_uint_eq(n, 3);
  for (size_t i = 0; i < n; i++) ck_assert_uint_eq(s[i].ps, 0);
  ck_assert_uint_eq(s[0].length, 25);
  ck_assert_uint_eq(s[1].offset, 25);
  ck_assert_uint_eq(s[2].offset, 50);
  ck_assert_uint_eq(s[2].length, 10);
  check_cover(s, n, 60, 25);
  check_all(&p, 60, s, n, 0);
  free(s);

  /* 131 elements (524 bytes): split [0,65) [65,131), each chunked at 25. */
  s = place(&p, 131, &n);
  ck_assert_uint_eq(n, 3 + 3);
  const uint32_t ps[] = {0, 0, 0, 1, 1, 1};
  const uint64_t off[] = {0, 25, 50, 65, 90, 115};
  const uint64_t len[] = {25, 25, 15, 25, 25, 16};
  for (size_t i = 0; i < n; i++) {
    ck_assert_uint_eq(s[i].ps, ps[i]);
    ck_assert_uint_eq(s[i].offset, off[i]);
    ck_assert_uint_eq(s[i].length, len[i]);
  }
  check_cover(s, n, 131, 25);
  check_all(&p, 131, s, n, 1);
  free(s);

  /* Check of a non-split variable: only exact chunks of the whole. */
  char err[256];
  ck_assert_int_eq(ps__placement_check(2, 1, 400, 100, 60, 50, 10, err,
                                       sizeof err), 0);
  ck_assert_int_eq(ps__placement_check(2, 1, 400, 100, 60, 0, 50, err,
                                       sizeof err), PS_ESHAPE);
  ck_assert_int_eq(ps__placement_check(2, 1, 400, 100, 60, 50, 11, err,
                                       sizeof err), PS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err, "past the end"));
  /* Too small a buffer: nothing placed, loads untouched. */
  uint64_t l0 = p.load[0], l1 = p.load[1];
  ps__slice_place one;
  ck_assert_uint_eq(ps__placer_place(&p, 60, &one, 1), 0);
  ck_assert_uint_eq(p.load[0], l0);
  ck_assert_uint_eq(p.load[1], l1);
  ps__placer_free(&p);
}
END_TEST

START_TEST(test_check_messages) {
  char err[256];
  /* Default thresholds: 1000 elements is small, so not split. 1 MiB+ is. */
  ck_assert_int_eq(ps__placement_check(2, 1, 0, 0, 1000, 0, 1000, err,
                                       sizeof err), 0);
  uint64_t big = (PS__DEFAULT_SPLIT_THRESHOLD / 4) * 2; /* 2 MiB: split */
  ck_assert_int_eq(ps__placement_check(2, 1, 0, 0, big, 0, big / 2, err,
                                       sizeof err), PS_ESHAPE);
  ck_assert_int_eq(ps__placement_check(2, 1, 0, 0, big, big / 2, big / 2, err,
                                       sizeof err), 0);
  ck_assert_int_eq(ps__placement_check(2, 0, 0, 0, big, 0, big / 2, err,
                                       sizeof err), 0);

  ck_assert_int_eq(ps__placement_check(2, 1, 1000, 0, 1000, 0, 100, err,
                                       sizeof err), PS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err, "slice [0, 100) of a 1000-element variable"));
  ck_assert_ptr_nonnull(strstr(err, "ps 1"));
  ck_assert_ptr_nonnull(strstr(err, "[500, 1000)"));
  /* Empty, overflowing, out of range, bad ps index. */
  ck_assert_int_eq(ps__placement_check(2, 0, 0, 0, 10, 0, 0, err, sizeof err),
                   PS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err, "empty"));
  ck_assert_int_eq(ps__placement_check(2, 0, 0, 0, 10, UINT64_MAX, 2, err,
                                       sizeof err), PS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err, "overflow"));
  ck_assert_int_eq(ps__placement_check(2, 0, 0, 0, 10, 5, 6, err, sizeof err),
                   PS_ESHAPE);
  ck_assert_int_eq(ps__placement_check(2, 2, 0, 0, 10, 0, 10, err, sizeof err),
                   PS_ESHAPE);
  ck_assert_int_eq(ps__placement_check(0, 0, 0, 0, 10, 0, 10, err, sizeof err),
                   PS_ESHAPE);
  ck_assert_int_eq(ps__placement_check(1, 0, 0, 0, 0, 0, 1, err, sizeof err),
                   PS_ESHAPE);
  /* NULL or tiny err buffers are fine. */
  ck_assert_int_eq(ps__placement_check(2, 0, 0, 0, 10, 0, 0, NULL, 0),
                   PS_ESHAPE);
  char tiny[4];
  ck_assert_int_eq(ps__placement_check(2, 0, 0, 0, 10, 0, 0, tiny, sizeof tiny),
                   PS_ESHAPE);
  ck_assert_uint_eq(strlen(tiny), 3);
}
END_TEST

START_TEST(test_single_ps) {
  /* One ps: never split, however big; just chunked. */
  ps__placer p;
  ck_assert_int_eq(ps__placer_init(&p, 1, 16, 40), 0);
  size_t n;
  ps__slice_place *s = place(&p, 95, &n);
  ck_assert_uint_eq(n, 10);
  for (size_t i = 0; i < n; i++) ck_assert_uint_eq(s[i].ps, 0);
  check_cover(s, n, 95, 10);
  check_all(&p, 95, s, n, 0);
  ck_assert_uint_eq(p.load[0], 95 * 4);
  free(s);
  ck_assert_uint_eq(ps__placer_count(&p, 0), 0);
  ck_assert_uint_eq(ps__placer_count(&p, (uint64_t)1 << 40),
                    ((uint64_t)1 << 40) / 10 + 1);
  ps__placer_free(&p);
}
END_TEST

/* floor(i*n/k) computed the careful way, independently of the library. */
static uint64_t ref_bound(uint64_t n, uint64_t k, uint64_t i) {
  return i * (n / k) + (i * (n % k)) / k;
}

START_TEST(test_huge) {
  const uint64_t slice = PS__MAX_SLICE_BYTES; /* 64 MiB = 2^24 elements */
  const uint64_t c = slice / 4;
  ps__placer p;
  ck_assert_int_eq(ps__placer_init(&p, 3, 0, slice), 0);

  /* 2^40 elements (4 TiB): i*numel fits, but check the sums anyway. */
  uint64_t numel = (uint64_t)1 << 40;
  uint64_t want = 0;
  for (uint64_t i = 0; i < 3; i++) {
    uint64_t len = ref_bound(numel, 3, i + 1) - ref_bound(numel, 3, i);
    want += len / c + (len % c != 0);
  }
  ck_assert_uint_eq(want, 65538);
  ck_assert_uint_eq(ps__placer_count(&p, numel), want);
  /* The part bounds, checked through the server-side check. */
  char err[256];
  for (uint32_t i = 0; i < 3; i++) {
    uint64_t lo = ref_bound(numel, 3, i), hi = ref_bound(numel, 3, i + 1);
    ck_assert_int_eq(ps__placement_check(3, i, 0, slice, numel, lo, c, err,
                                         sizeof err), 0);
    uint64_t last = lo + ((hi - lo - 1) / c) * c;
    ck_assert_int_eq(ps__placement_check(3, i, 0, slice, numel, last,
                                         hi - last, err, sizeof err), 0);
    ck_assert_int_eq(ps__placement_check(3, (i + 1) % 3, 0, slice, numel, lo,
                                         c, err, sizeof err), PS_ESHAPE);
  }

  /* 2^62 elements over 7 ps: i*numel overflows 64 bits. */
  ps__placer q;
  ck_assert_int_eq(ps__placer_init(&q, 7, 0, slice), 0);
  numel = (uint64_t)1 << 62;
  want = 0;
  for (uint64_t i = 0; i < 7; i++) {
    uint64_t len = ref_bound(numel, 7, i + 1) - ref_bound(numel, 7, i);
    want += len / c + (len % c != 0);
  }
  ck_assert_uint_eq(ps__placer_count(&q, numel), want);
  for (uint32_t i = 0; i < 7; i++) {
    uint64_t lo = ref_bound(numel, 7, i), hi = ref_bound(numel, 7, i + 1);
    ck_assert_int_eq(ps__placement_check(7, i, 0, slice, numel, lo, c, err,
                                         sizeof err), 0);
    uint64_t last = lo + ((hi - lo - 1) / c) * c;
    ck_assert_int_eq(ps__placement_check(7, i, 0, slice, numel, last,
                                         hi - last, err, sizeof err), 0);
  }
  /* numel*4 overflows 64 bits: still split, last chunk still checkable. */
  numel = UINT64_MAX;
  uint64_t lo6 = (uint64_t)(((unsigned __int128)6 * numel) / 7);
  uint64_t last6 = lo6 + ((numel - lo6 - 1) / c) * c;
  ck_assert_int_eq(ps__placement_check(7, 6, 0, slice, numel, last6,
                                       numel - last6, err, sizeof err), 0);
  ck_assert_uint_gt(ps__placer_count(&q, numel), 0);
  ps__placer_free(&q);

  /* Place a 2^30-element variable (4 GiB) for real: 64 slices over 3 ps,
   * covering everything once and each accepted by the check. */
  size_t n;
  numel = (uint64_t)1 << 30;
  ps__slice_place *s = place(&p, numel, &n);
  ck_assert_uint_eq(n, 3 * 22);
  check_cover(s, n, numel, c);
  check_all(&p, numel, s, n, 1);
  free(s);
  ps__placer_free(&p);
}
END_TEST

Suite *suite_placement(void) {
  Suite *s = suite_create("placement");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, test_init_defaults);
  tcase_add_test(tc, test_small_balanced_two);
  tcase_add_test(tc, test_small_balanced_three);
  tcase_add_test(tc, test_split_big);
  tcase_add_test(tc, test_split_not_divisible);
  tcase_add_test(tc, test_chunking);
  tcase_add_test(tc, test_check_messages);
  tcase_add_test(tc, test_single_ps);
  tcase_add_test(tc, test_huge);
  suite_add_tcase(s, tc);
  return s;
}
