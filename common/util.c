/* util.c - one clock, overflow-checked growth, percentiles, host:port,
 * escaped names. */
#include "util.h"

#include <sys/mman.h>
#include <unistd.h>

#include "invariant.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Transparent huge pages are this size on x86-64 and most arm64 kernels. */
#define HUGE_PAGE ((uintptr_t)2 << 20)

void ps__advise_huge(void *p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  if (!p || bytes < PS__HUGE_MIN) return;
  uintptr_t lo = ((uintptr_t)p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
  uintptr_t hi = ((uintptr_t)p + bytes) & ~(HUGE_PAGE - 1);
  if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE); /* advice: errors ignored */
#else
  (void)p, (void)bytes;
#endif
}

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

size_t ps__utf8_len(const unsigned char *s) {
  const unsigned char c = s[0];
  const size_t n = c < 0xc2 ? 0 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : c < 0xf5 ? 4 : 0;
  unsigned char lo = 0x80, hi = 0xbf; /* the second byte's range */
  if (c == 0xc2) lo = 0xa0;
  else if (c == 0xe0) lo = 0xa0;
  else if (c == 0xed) hi = 0x9f;
  else if (c == 0xf0) lo = 0x90;
  else if (c == 0xf4) hi = 0x8f;
  if (n == 0 || s[1] < lo || s[1] > hi) return 0;
  for (size_t i = 2; i < n; i++)
    if ((s[i] & 0xc0) != 0x80) return 0;
  return n;
}

const char *ps__escape(const char *s, char *out, size_t outlen) {
  if (!outlen) return out;
  size_t o = 0;
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p;) {
    char e[8];
    size_t n = 1, k; /* bytes of s taken, of out written */
    if (*p == '\\' || *p == '\'' || *p == '"') k = (size_t)snprintf(e, sizeof e, "\\%c", *p);
    else if (*p == '\n') k = (size_t)snprintf(e, sizeof e, "\\n");
    else if (*p == '\r') k = (size_t)snprintf(e, sizeof e, "\\r");
    else if (*p == '\t') k = (size_t)snprintf(e, sizeof e, "\\t");
    else if (*p >= 0x20 && *p < 0x7f) k = 1, e[0] = (char)*p;
    else if ((n = ps__utf8_len(p)) > 0) k = n, memcpy(e, p, n);
    else n = 1, k = (size_t)snprintf(e, sizeof e, "\\x%02x", *p);
    if (o + k >= outlen) break;
    memcpy(out + o, e, k);
    o += k;
    p += n;
  }
  out[o] = '\0';
  return out;
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
