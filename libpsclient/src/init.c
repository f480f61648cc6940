/*
 * init.c - optimizer defaults and seeded variable initializers.
 *
 * The generator is our own (splitmix64 seeding xoshiro256**), seeded from
 * init->seed mixed with an FNV-1a hash of the variable name, so the draws
 * depend only on (seed, name, shape, kind, parameters): any worker on any
 * machine would compute the same values. Uniform floats use the top 24 bits
 * of a draw; normals use Box-Muller in double precision.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "client_internal.h"
#include "dist.h"

void ps_init_init_sized(ps_init *init, size_t size) {
  if (!init || size < sizeof init->struct_size) return;
  memset(init, 0, size); /* PS_INIT_ZEROS, seed 0 */
  init->struct_size = size;
}

/* ---- generator -------------------------------------------------------- */

typedef struct rng {
  uint64_t s[4];    /* xoshiro256** state */
  double spare;     /* second Box-Muller output */
  int has_spare;
} rng;

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void rng_seed(rng *r, uint64_t seed, const char *name) {
  uint64_t x = seed;
  x = splitmix64(&x) ^ ps__fnv1a(name ? name : "", SIZE_MAX);
  for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
  r->has_spare = 0;
  r->spare = 0.0;
}

static uint64_t rotl(uint64_t v, int k) { return (v << k) | (v >> (64 - k)); }

static uint64_t rng_next(rng *r) {
  uint64_t *s = r->s;
  uint64_t out = rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return out;
}

/* Standard normal (dist.h's Box-Muller); the second value of each pair
 * is kept. */
static double rng_normal(rng *r) {
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
static double rng_trunc_normal(rng *r) {
  for (;;) {
    double z = rng_normal(r);
    if (fabs(z) <= 2.0) return z;
  }
}

/* a + u*(b-a), a float below b (dist.h). */
static float uniform_value(rng *r, double a, double b) {
  return ps__uniform_float(rng_next(r), a, b);
}

/* ---- fill ------------------------------------------------------------- */

static int float_finite(double v) { return isfinite(v) && fabs(v) <= FLT_MAX; }

/* TensorFlow's fans: for [..., in, out] the leading dims form the receptive
 * field, fan_in = receptive*in and fan_out = receptive*out. */
static void compute_fans(const int64_t *shape, int ndim, double *fan_in,
                         double *fan_out) {
  if (ndim == 0) {
    *fan_in = *fan_out = 1.0;
  } else if (ndim == 1) {
    *fan_in = *fan_out = (double)shape[0];
  } else {
    double receptive = 1.0;
    for (int i = 0; i < ndim - 2; i++) receptive *= (double)shape[i];
    *fan_in = receptive * (double)shape[ndim - 2];
    *fan_out = receptive * (double)shape[ndim - 1];
  }
}

int ps_init_fill(const ps_init *user, const char *name, const int64_t *shape,
                 int ndim, float *out, size_t n) {
  if (!user) return PS_EINVAL;
  ps_init in, *init = &in;
  char err[256];
  ps_init_init(&in);
  if (ps__sized_read(&in, sizeof in, user, PS__INIT_V1_SIZE, "ps_init", err, sizeof err))
    return PS_EINVAL;
  if (n > 0 && !out) return PS_EINVAL;
  if (ndim < 0 || ndim > PS_MAX_DIMS) return PS_EINVAL;
  if (ndim > 0 && !shape) return PS_EINVAL;
  uint64_t numel = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] <= 0) return PS_EINVAL;
    if (__builtin_mul_overflow(numel, (uint64_t)shape[i], &numel))
      return PS_EINVAL;
  }
  if (numel != (uint64_t)n) return PS_EINVAL;

  double a = init->a, b = init->b;
  switch (init->kind) {
  case PS_INIT_ZEROS:
  case PS_INIT_GLOROT_UNIFORM:
  case PS_INIT_GLOROT_NORMAL:
    break;
  case PS_INIT_CONSTANT:
    if (!float_finite(a)) return PS_EINVAL;
    break;
  case PS_INIT_UNIFORM:
    if (!float_finite(a) || !float_finite(b) || !(a < b)) return PS_EINVAL;
    break;
  case PS_INIT_NORMAL:
  case PS_INIT_TRUNCATED_NORMAL:
    if (!float_finite(a) || !float_finite(b) || !(b > 0)) return PS_EINVAL;
    break;
  default:
    return PS_EINVAL;
  }

  rng r;
  rng_seed(&r, init->seed, name);
  double fan_in, fan_out;
  compute_fans(shape, ndim, &fan_in, &fan_out);

  switch (init->kind) {
  case PS_INIT_ZEROS:
    for (size_t i = 0; i < n; i++) out[i] = 0.0f;
    break;
  case PS_INIT_CONSTANT:
    for (size_t i = 0; i < n; i++) out[i] = (float)a;
    break;
  case PS_INIT_UNIFORM:
    for (size_t i = 0; i < n; i++) out[i] = uniform_value(&r, a, b);
    break;
  case PS_INIT_NORMAL:
    for (size_t i = 0; i < n; i++) out[i] = (float)(a + b * rng_normal(&r));
    break;
  case PS_INIT_TRUNCATED_NORMAL:
    for (size_t i = 0; i < n; i++)
      out[i] = (float)(a + b * rng_trunc_normal(&r));
    break;
  case PS_INIT_GLOROT_UNIFORM: {
    double limit = sqrt(6.0 / (fan_in + fan_out));
    for (size_t i = 0; i < n; i++) out[i] = uniform_value(&r, -limit, limit);
    break;
  }
  case PS_INIT_GLOROT_NORMAL: {
    double sd = sqrt(2.0 / (fan_in + fan_out));
    for (size_t i = 0; i < n; i++) out[i] = (float)(sd * rng_trunc_normal(&r));
    break;
  }
  }
  return 0;
}
