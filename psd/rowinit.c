/* rowinit.c - a sparse table's initializer (rowinit.h). */
#include "rowinit.h"

#include <math.h>
#include <string.h>

#include "wire.h"

/* One row's generator: a splitmix64 counter and Box-Muller's second value. */
typedef struct row_rng {
  uint64_t x;    /* splitmix64 state (any value is valid) */
  double spare;  /* the pair's second normal, when has_spare */
  int has_spare; /* spare holds an unused value */
} row_rng;

/* splitmix64: the Weyl step, then the finalizer. */
static uint64_t rng_next(row_rng *r) {
  r->x += 0x9e3779b97f4a7c15ULL;
  return ps__mix64(r->x);
}

/* Uniform in [0, 1) with 24 bits (exactly a float). */
static double rng_u24(row_rng *r) { return (double)(rng_next(r) >> 40) * 0x1p-24; }

/* Uniform in [0, 1) with 53 bits. */
static double rng_u53(row_rng *r) { return (double)(rng_next(r) >> 11) * 0x1p-53; }

/* Standard normal by Box-Muller; the second value of each pair is kept. */
static double rng_normal(row_rng *r) {
  if (r->has_spare) {
    r->has_spare = 0;
    return r->spare;
  }
  double u1 = 1.0 - rng_u53(r); /* (0, 1]: log is finite */
  double u2 = rng_u53(r);
  double rad = sqrt(-2.0 * log(u1));
  double th = 6.283185307179586476925286766559 * u2; /* 2*pi*u2 */
  r->spare = rad * sin(th);
  r->has_spare = 1;
  return rad * cos(th);
}

/* Standard normal redrawn until |z| <= 2. */
static double rng_trunc_normal(row_rng *r) {
  for (;;) {
    double z = rng_normal(r);
    if (fabs(z) <= 2.0) return z;
  }
}

/* a + u*(b-a) as a float strictly below b when possible (as init.c). */
static float uniform_value(row_rng *r, double a, double b) {
  float f = (float)(a + rng_u24(r) * (b - a));
  if ((double)f >= b) {
    float g = nextafterf(f, -INFINITY);
    if ((double)g >= a) f = g;
  }
  return f;
}

/* FNV-1a over the NUL-terminated name (at most the spec's array). */
static uint64_t fnv1a(const char *s, size_t max) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < max && s[i]; i++) {
    h ^= (unsigned char)s[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t psd_rowinit_salt(const psd_table_spec *spec) {
  return ps__mix64(spec->init_seed ^ fnv1a(spec->name, sizeof spec->name));
}

void psd_rowinit_fill(const psd_table_spec *spec, uint64_t salt, uint64_t key, float *out) {
  const uint32_t dim = spec->dim;
  const double a = spec->init_a, b = spec->init_b;
  row_rng r = {salt ^ ps__mix64(key), 0.0, 0};
  switch (spec->init_kind) {
    case PS_INIT_CONSTANT:
      for (uint32_t i = 0; i < dim; i++) out[i] = (float)a;
      break;
    case PS_INIT_UNIFORM:
      for (uint32_t i = 0; i < dim; i++) out[i] = uniform_value(&r, a, b);
      break;
    case PS_INIT_NORMAL:
      for (uint32_t i = 0; i < dim; i++) out[i] = (float)(a + b * rng_normal(&r));
      break;
    case PS_INIT_TRUNCATED_NORMAL:
      for (uint32_t i = 0; i < dim; i++) out[i] = (float)(a + b * rng_trunc_normal(&r));
      break;
    default: /* PS_INIT_ZEROS; the spec check refuses the others */
      memset(out, 0, (size_t)dim * sizeof(float));
      break;
  }
}

void psd_table_init_row(const psd_table_spec *spec, uint64_t key, float *out) {
  psd_rowinit_fill(spec, psd_rowinit_salt(spec), key, out);
}
