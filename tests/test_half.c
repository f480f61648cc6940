/* The 16-bit wire encodings (wire/half.c): every one of the 65536 patterns
 * of each format round-trips, float32 -> 16 bits rounds to nearest even
 * against an independent reference (long double arithmetic on the value,
 * not bit tricks) on edge cases and random values, and every code path
 * this CPU has (the portable one forced too) gives the same bits. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "wire.h"

static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Value of a 16-bit pattern by its definition (not by the code under test):
 * bf16 is float32's upper half; fp16 is (-1)^s * 2^(e-15) * 1.m, or
 * 2^-14 * 0.m for e == 0. NaN and infinities as such. */
static long double ref_value(uint32_t dt, uint16_t h) {
  if (dt == PS__DT_BF16) return float_of((uint32_t)h << 16);
  int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  long double v;
  if (e == 31) v = m ? NAN : INFINITY;
  else if (e == 0) v = ldexpl(m, -24);
  else v = ldexpl(1024 + m, e - 25);
  return s ? -v : v;
}

/* float32 -> 16 bits by search: of all finite patterns with x's sign, the
 * nearest (ties: the even mantissa); past the largest finite one by at
 * least half its ulp, infinity. NaN is handled by the caller. */
static uint16_t ref_round(uint32_t dt, float x) {
  uint16_t sign = signbit(x) ? 0x8000 : 0;
  long double ax = fabsl((long double)x);
  uint16_t maxfin = dt == PS__DT_BF16 ? 0x7f7f : 0x7bff;
  uint16_t inf = dt == PS__DT_BF16 ? 0x7f80 : 0x7c00;
  long double top = ref_value(dt, maxfin);
  long double ulp = top - ref_value(dt, (uint16_t)(maxfin - 1));
  if (isinf(x) || ax >= top + ulp / 2) return sign | inf;
  /* Binary search over the ordered positive patterns 0..maxfin. */
  uint16_t lo = 0, hi = maxfin;
  while (hi - lo > 1) {
    uint16_t mid = (uint16_t)((lo + hi) / 2);
    if (ref_value(dt, mid) <= ax) lo = mid;
    else hi = mid;
  }
  long double dl = ax - ref_value(dt, lo), dh = ref_value(dt, hi) - ax;
  uint16_t r = dl < dh ? lo : dh < dl ? hi : (lo & 1) ? hi : lo;
  if (ax >= ref_value(dt, hi)) r = hi;
  return sign | r;
}

static int is_nan16(uint32_t dt, uint16_t h) {
  return dt == PS__DT_BF16 ? (h & 0x7f80) == 0x7f80 && (h & 0x7f)
                           : (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
}

/* Each code path available here, checked with fn. */
static void each_path(void (*fn)(int path)) {
  int before = ps__half_path(), ran = 0;
  for (int p = 0; p < PS__HALF_PATHS_; p++) {
    if (ps__half_force_path(p) != 0) {
      printf("half: path %s not available on this CPU\n", ps__half_path_name(p));
      continue;
    }
    fn(p);
    ran++;
  }
  ck_assert_int_eq(ps__half_force_path(before), 0);
  ck_assert_int_ge(ran, 1);
}

/* All 65536 patterns: 16 -> 32 -> 16 gives the pattern back (a NaN comes
 * back quiet: same sign and payload with the quiet bit set); 16 -> 32 is
 * the reference value. Bulk calls over odd lengths exercise the tails. */
static void roundtrip_path(int path) {
  static uint16_t in[65536], back[65536];
  static float mid[65536];
  for (uint32_t dt = PS__DT_BF16; dt <= PS__DT_FP16; dt++) {
    for (uint32_t i = 0; i < 65536; i++) in[i] = (uint16_t)i;
    /* Uneven pieces: vector bodies and every tail length. */
    for (size_t off = 0, k = 1; off < 65536; off += k, k = k % 37 + 1) {
      size_t n = off + k > 65536 ? 65536 - off : k;
      ps__wire_decode(dt, mid + off, in + off, n);
      ps__wire_encode(dt, back + off, mid + off, n);
    }
    uint16_t quiet = dt == PS__DT_BF16 ? 0x40 : 0x200;
    for (uint32_t i = 0; i < 65536; i++) {
      long double want = ref_value(dt, (uint16_t)i);
      if (is_nan16(dt, (uint16_t)i)) {
        ck_assert_msg(isnan(mid[i]) && back[i] == (uint16_t)(i | quiet),
                      "%s %s: NaN 0x%04x came back as 0x%04x", ps__half_path_name(path),
                      ps__dtype_name(dt), i, back[i]);
        continue;
      }
      ck_assert_msg((long double)mid[i] == want && !signbit(mid[i]) == !signbit(want),
                    "%s %s: 0x%04x decodes to %a, expected %La", ps__half_path_name(path),
                    ps__dtype_name(dt), i, (double)mid[i], want);
      ck_assert_msg(back[i] == i, "%s %s: 0x%04x round-trips to 0x%04x",
                    ps__half_path_name(path), ps__dtype_name(dt), i, back[i]);
    }
  }
}

START_TEST(every_pattern_round_trips) { each_path(roundtrip_path); }
END_TEST

/* Edge cases: ties both ways, NaNs (quiet and signalling, both signs),
 * infinities, overflow at the rounding boundary, subnormals of both
 * formats, float32 subnormals, zeros; then random bit patterns. */
static const uint32_t edges[] = {
    0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001,
    0xff800001, 0x7fa12345, 0x7fffffff, 0x3f800000, 0x3f808000, 0x3f818000, 0x3f80ffff,
    0x3f807fff, 0x3f800001, 0x7f7fffff, 0x7f7f8000, 0x7f7f7fff, 0xff7f8000, 0x477fe000,
    0x477fefff, 0x477ff000, 0x477ff001, 0x47800000, 0xc77ff000, 0x38800000, 0x387fffff,
    0x387fe000, 0x387ff000, 0x33800000, 0x33000000, 0x33000001, 0x32ffffff, 0x33c00000,
    0x33a00000, 0x34200000, 0x00000001, 0x807fffff, 0x00400000, 0x3a801000, 0x3a803000,
    0x3a802000, 0x3a806000, 0x4b800000, 0x3effffff, 0x00800000, 0x01000000,
};

static void check_encode(int path, uint32_t dt, const float *x, size_t n) {
  uint16_t *got = malloc(n * sizeof *got);
  ck_assert_ptr_nonnull(got);
  ps__wire_encode(dt, got, x, n);
  for (size_t i = 0; i < n; i++) {
    uint16_t one = dt == PS__DT_BF16 ? ps__f32_to_bf16(x[i]) : ps__f32_to_fp16(x[i]);
    ck_assert_msg(got[i] == one, "%s %s: bulk 0x%04x vs scalar 0x%04x for 0x%08x",
                  ps__half_path_name(path), ps__dtype_name(dt), got[i], one, bits_of(x[i]));
    uint16_t want;
    if (isnan(x[i])) {
      /* Quiet NaN, same sign, the payload's top bits. */
      uint32_t b = bits_of(x[i]);
      want = dt == PS__DT_BF16 ? (uint16_t)((b >> 16) | 0x40)
                               : (uint16_t)(((b >> 16) & 0x8000) | 0x7e00 | ((b >> 13) & 0x3ff));
    } else {
      want = ref_round(dt, x[i]);
    }
    ck_assert_msg(got[i] == want, "%s %s: 0x%08x (%a) encodes to 0x%04x, expected 0x%04x",
                  ps__half_path_name(path), ps__dtype_name(dt), bits_of(x[i]), (double)x[i],
                  got[i], want);
  }
  free(got);
}

static void edges_path(int path) {
  enum { N = sizeof edges / sizeof edges[0] };
  /* Each edge at every position of a 16-wide vector (and in the tail). */
  float x[N * 17];
  for (size_t i = 0; i < N * 17; i++) x[i] = float_of(edges[(i * 7 + i / N) % N]);
  for (uint32_t dt = PS__DT_BF16; dt <= PS__DT_FP16; dt++) check_encode(path, dt, x, N * 17);
}

START_TEST(rounding_edges_match_reference) { each_path(edges_path); }
END_TEST

static unsigned seed;

/* splitmix64: the random test's stream, from its printed seed. */
static uint64_t next64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void random_path(int path) {
  enum { N = 20000 };
  static float x[N];
  uint64_t s = seed;
  for (size_t i = 0; i < N; i++) {
    uint32_t b = (uint32_t)next64(&s);
    /* Half the values near fp16's range, so its subnormals and rounding
     * boundary get as many samples as the rest. */
    if (i & 1) b = (b & 0x807fffff) | ((uint32_t)(96 + (b >> 23) % 48) << 23);
    x[i] = float_of(b);
  }
  for (uint32_t dt = PS__DT_BF16; dt <= PS__DT_FP16; dt++) check_encode(path, dt, x, N);
}

START_TEST(random_values_match_reference) {
  seed = tu_seed("half");
  each_path(random_path);
}
END_TEST

START_TEST(float32_is_a_copy) {
  float x[5] = {1.5f, -0.0f, NAN, 3e38f, 1e-45f}, y[5];
  uint8_t w[20];
  ps__wire_encode(PS__DT_F32, w, x, 5);
  ps__wire_decode(PS__DT_F32, y, w, 5);
  ck_assert_int_eq(memcmp(x, y, sizeof x), 0);
  ck_assert_int_eq(ps__dtype_size(PS__DT_F32), 4);
  ck_assert_int_eq(ps__dtype_size(PS__DT_BF16), 2);
  ck_assert_int_eq(ps__dtype_size(PS__DT_FP16), 2);
  ck_assert(!ps__dtype_valid(3));
  ck_assert_int_eq(ps__half_force_path(PS__HALF_PATHS_), -1);
  printf("half: paths in use by default: %s\n", ps__half_path_name(ps__half_path()));
}
END_TEST

Suite *suite_half(void) {
  Suite *s = suite_create("half");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, every_pattern_round_trips);
  tcase_add_test(tc, rounding_edges_match_reference);
  tcase_add_test(tc, random_values_match_reference);
  tcase_add_test(tc, float32_is_a_copy);
  suite_add_tcase(s, tc);
  return s;
}
