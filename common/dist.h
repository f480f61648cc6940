/*
 * dist.h - the distributions both initializers draw from (libpsclient's
 * dense init.c and psd's sparse rowinit.c), over any 64-bit generator: a
 * generator supplies words, these turn them into values, so the two sides
 * draw bit-identical values from identical words. Header only (static
 * inline): the initializers' loops stay free of calls.
 */
#ifndef PS_COMMON_DIST_H
#define PS_COMMON_DIST_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* Uniform in [0, 1) with 24 bits of w (exactly a float). */
static inline double ps__u24(uint64_t w) { return (double)(w >> 40) * 0x1p-24; }

/* Uniform in [0, 1) with 53 bits of w. */
static inline double ps__u53(uint64_t w) { return (double)(w >> 11) * 0x1p-53; }

/* Box-Muller: two standard normals from two words (*c, then *s). */
static inline void ps__box_muller(uint64_t w1, uint64_t w2, double *c, double *s) {
  double u1 = 1.0 - ps__u53(w1); /* (0, 1]: log is finite */
  double u2 = ps__u53(w2);
  double rad = sqrt(-2.0 * log(u1));
  double th = 6.283185307179586476925286766559 * u2; /* 2*pi*u2 */
  *s = rad * sin(th);
  *c = rad * cos(th);
}

/* a + u*(b-a) for u = ps__u24(w), as a float strictly below b when
 * possible (rounding to float can land on b). */
static inline float ps__uniform_float(uint64_t w, double a, double b) {
  float f = (float)(a + ps__u24(w) * (b - a));
  if ((double)f >= b) {
    float g = nextafterf(f, -INFINITY);
    if ((double)g >= a) f = g;
  }
  return f;
}

/* FNV-1a of the NUL-terminated s, at most max bytes: salts a seed with a
 * variable's or a table's name. */
static inline uint64_t ps__fnv1a(const char *s, size_t max) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < max && s[i]; i++) {
    h ^= (unsigned char)s[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

#endif
