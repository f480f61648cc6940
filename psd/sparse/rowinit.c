/* rowinit.c - a sparse table's initializer (rowinit.h). */
#include "rowinit.h"

#include <math.h>
#include <string.h>

#include "dist.h"
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

/* Standard normal (dist.h's Box-Muller); the second value of each pair
 * is kept. */
static double rng_normal(row_rng *r) {
  if (r->has_spare) {
    r->has_spare = 0;
    return r->spare;
  }
  uint64_t w1 = rng_next(r), w2 = rng_next(r);
  double z;
  ps__box_muller(w1, w2, &z, &r->spare);
  r->has_spare = 1;
  return z;
}

/* Standard normal redrawn until |z| <= 2. */
static double rng_trunc_normal(row_rng *r) {
  for (;;) {
    double z = rng_normal(r);
    if (fabs(z) <= 2.0) return z;
  }
}

/* a + u*(b-a), a float below b (dist.h, as the dense init.c). */
static float uniform_value(row_rng *r, double a, double b) {
  return ps__uniform_float(rng_next(r), a, b);
}


uint64_t psd_rowinit_salt(const psd_table_spec *spec) {
  return ps__mix64(spec->init_seed ^ ps__fnv1a(spec->name, sizeof spec->name));
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

void psd_rowinit_row(const psd_table_spec *spec, uint64_t key, float *out) {
  psd_rowinit_fill(spec, psd_rowinit_salt(spec), key, out);
}
