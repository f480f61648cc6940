/* ps_bench_memcpy.c - the memcpy baseline of --memcpy-baseline: one thread
 * copies `bytes` from one buffer to another, on the CPU where worker 0
 * runs. It is the bound of a shared-memory transport: a push that is one
 * copy into shared memory plus a pull that is one copy out moves 2 x bytes
 * in the time of two copies, so push+pull gbps (2 x bytes / step) against
 * memcpy gbps (bytes / copy) is 1.0 at that bound. */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ps_bench_internal.h"

/* Through a volatile pointer, so that the compiler cannot drop or merge
 * copies whose destination nobody reads. */
static void *(*volatile g_copy)(void *, const void *, size_t) = memcpy;

/* Seconds per copy over one sample of `copies` copies. */
static double memcpy_sample(char *dst, const char *src, size_t n, uint64_t copies) {
  double t0 = now_s();
  for (uint64_t i = 0; i < copies; i++) g_copy(dst, src, n);
  return (now_s() - t0) / (double)copies;
}

double memcpy_round(uint64_t bytes, double *gbps) {
  char label[32];
  size_label(bytes, label, sizeof label);
  *gbps = NAN;
  size_t n = (size_t)bytes;
  char *src = malloc(n), *dst = malloc(n);
  if (!src || !dst) {
    progress("memcpy %s: out of memory", label);
    free(src);
    free(dst);
    return NAN;
  }
  /* Fault both buffers in: the copies time memory, not page faults. */
  memset(src, 0x5a, n);
  memset(dst, 0, n);
  uint64_t copies = (MEMCPY_SAMPLE_BYTES + bytes - 1) / bytes;
  progress("memcpy %s, %d samples of %llu copies", label,
           MEMCPY_SAMPLES, (unsigned long long)copies);
  pin_cpu(0); /* where worker 0 runs */
  g_copy(dst, src, n); /* warm-up */
  double t[MEMCPY_SAMPLES];
  for (int i = 0; i < MEMCPY_SAMPLES; i++) t[i] = memcpy_sample(dst, src, n, copies);
  unpin_cpu();
  int ok = dst[n - 1] == 0x5a && dst[0] == 0x5a;
  free(src);
  free(dst);
  if (!ok) {
    progress("memcpy %s: the copy is wrong", label);
    return NAN;
  }
  double sec = median(t, MEMCPY_SAMPLES);
  if (!(sec > 0)) return NAN;
  *gbps = (double)bytes / sec / 1e9;
  return sec * 1e3;
}
