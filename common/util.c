/* util.c - one clock, overflow-checked growth, percentiles, host:port. */
#include "util.h"

#include <unistd.h>

#include "invariant.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int ps__grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t nc = *cap ? *cap : 16;
  while (nc < need) {
    if (nc > SIZE_MAX / 2) return -1;
    nc *= 2;
  }
  size_t bytes;
  if (elem == 0 || __builtin_mul_overflow(nc, elem, &bytes)) return -1;
  void *np = realloc(*p, bytes);
  if (!np) return -1;
  *p = np;
  *cap = nc;
  return 0;
}

int ps__grow_all(const ps__array *a, size_t n, size_t *cap, size_t need) {
  if (need <= *cap) return 0;
  size_t nc = *cap ? *cap : 16;
  while (nc < need) {
    if (nc > SIZE_MAX / 2) return -1;
    nc *= 2;
  }
  for (size_t i = 0; i < n; i++) {
    size_t bytes;
    if (a[i].elem == 0 || __builtin_mul_overflow(nc, a[i].elem, &bytes)) return -1;
    char *np = realloc(*a[i].p, bytes);
    if (!np) return -1;
    memset(np + *cap * a[i].elem, 0, (nc - *cap) * a[i].elem);
    *a[i].p = np;
  }
  *cap = nc;
  return 0;
}

int ps__errf(int code, char *err, size_t errlen, const char *fmt, ...) {
  if (err && errlen > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return code;
}

static double clock_s(clockid_t id) {
  struct timespec ts;
  clock_gettime(id, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double ps__now(void) { return clock_s(CLOCK_MONOTONIC); }
double ps__unix_now(void) { return clock_s(CLOCK_REALTIME); }

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double ps__percentile(double *v, size_t n, double p) {
  if (n == 0) return 0;
  qsort(v, n, sizeof *v, cmp_double);
  size_t k = (size_t)(p / 100.0 * (double)(n - 1) + 0.5);
  return v[k < n ? k : n - 1];
}

int ps__parse_hostport(const char *s, char *host, size_t hostcap, int *port) {
  if (!s || !*s) return -1;
  const char *colon;
  const char *hstart = s;
  size_t hlen;
  if (s[0] == '[') {
    const char *close = strchr(s, ']');
    if (!close || close[1] != ':') return -1;
    hstart = s + 1;
    hlen = (size_t)(close - hstart);
    colon = close + 1;
  } else {
    colon = strrchr(s, ':');
    if (!colon) return -1;
    hlen = (size_t)(colon - s);
  }
  if (hlen == 0 || hlen >= hostcap) return -1;
  char *end;
  long p = strtol(colon + 1, &end, 10);
  if (end == colon + 1 || *end != '\0' || p < 1 || p > 65535) return -1;
  memcpy(host, hstart, hlen);
  host[hlen] = '\0';
  *port = (int)p;
  return 0;
}

void ps__assert_fail(const char *cond, const char *file, int line) {
  char buf[512];
  int n = snprintf(buf, sizeof buf, "%s:%d: invariant broken: %s\n", file, line, cond);
  if (n > 0) {
    ssize_t w = write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
    (void)w;
  }
  abort();
}
