/* testrand.h - the random inputs of the CNN backend tests (test_cuda_ops.c,
 * test_cuda_gpu.c): one xorshift stream per test binary, seeded per test,
 * so every run sees the same numbers. */
#ifndef PS_TESTRAND_H
#define PS_TESTRAND_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t tr_state;

static inline void seed(uint64_t s) { tr_state = s * 0x9e3779b97f4a7c15ull + 1; }

/* uniform in (0, 1) */
static inline double ur(void) {
  tr_state ^= tr_state << 13;
  tr_state ^= tr_state >> 7;
  tr_state ^= tr_state << 17;
  return ((double)(tr_state >> 11) + 0.5) / 9007199254740992.0;
}

/* n floats ~ N(0, sd^2) (malloc'd; aborts when out of memory) */
static inline float *randn(size_t n, float sd) {
  float *a = malloc((n ? n : 1) * sizeof(float));
  if (!a) abort();
  for (size_t i = 0; i < n; i++)
    a[i] = sd * (float)(sqrt(-2.0 * log(ur())) * cos(6.283185307179586 * ur()));
  return a;
}

static inline float *zeros(size_t n) {
  float *a = calloc(n ? n : 1, sizeof(float));
  if (!a) abort();
  return a;
}

/* largest |a[i]| */
static inline double maxabs(const float *a, size_t n) {
  double m = 0.0;
  for (size_t i = 0; i < n; i++) m = fmax(m, fabs(a[i]));
  return m;
}

#endif
