/*
 * util.h - the few helpers every layer shares: one clock, overflow-checked
 * arithmetic and growth, percentiles, "host:port" parsing, names a peer
 * chose escaped for printing. Internal (ps__ names); compiled into
 * libpsclient, psd and the tools alike, never exported.
 */
#ifndef PS_UTIL_H
#define PS_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* a*b into *out unless it overflows (returns -1 then). */
static inline int ps__mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
  return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}
/* a+b into *out unless it overflows (returns -1 then). */
static inline int ps__add_u64(uint64_t a, uint64_t b, uint64_t *out) {
  return __builtin_add_overflow(a, b, out) ? -1 : 0;
}

/* Grows *p (an array of *cap elements of elem bytes) to hold at least need
 * elements, doubling. 0, or -1 when out of memory or when the new size in
 * bytes would overflow (*p and *cap unchanged then). */
int ps__grow(void **p, size_t *cap, size_t need, size_t elem);

/* A hot loop compiled for AVX2 and for baseline x86-64 and picked at load
 * time (GCC ifunc): wider vectors with no -march. Not x86-64-v3, whose FMA
 * would fuse a*b+c and change results between machines. Off under ASan
 * and TSan (their resolvers run before the sanitizer is set up) and
 * elsewhere. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define PS__VECTOR_CLONES __attribute__((noinline, target_clones("avx2", "default")))
#else
#define PS__VECTOR_CLONES __attribute__((noinline))
#endif

/* Asks the kernel to back the 2 MiB-aligned interior of a fresh block of
 * `bytes` (at least PS__HUGE_MIN) with transparent huge pages before its
 * pages are first touched: an array probed at random (a sparse table's
 * key index) then misses the TLB once per 2 MiB, not once per 4 KiB page,
 * which under a virtual machine's nested paging is most of a probe's
 * cost. Advice only: nothing changes where huge pages are off. */
void ps__advise_huge(void *p, size_t bytes);
/* Smaller blocks are left alone: a huge page would mostly lie outside them. */
#define PS__HUGE_MIN ((size_t)8 << 20)

/* One of several parallel arrays that share a capacity. */
typedef struct ps__array {
  void **p;    /* the array's pointer (updated when it moves) */
  size_t elem; /* bytes per element */
} ps__array;

/* Grows the n parallel arrays a[0..n), all of capacity *cap, to hold at
 * least need elements each (doubling), zeroing the new elements. 0, or -1
 * when out of memory or on overflow: *cap is then unchanged (arrays already
 * moved stay valid, only larger). */
int ps__grow_all(const ps__array *a, size_t n, size_t *cap, size_t need);

/* Copies a short row of n floats (src and dst do not overlap; either may
 * be unaligned: a frame's data). The common widths are constant-size
 * copies the compiler writes inline: a call to memcpy costs as much as
 * copying a 16-float row, once per key. */
static inline void ps__copy_row(void *restrict dst, const void *restrict src, size_t n) {
  switch (n) {
    case 1: __builtin_memcpy(dst, src, 1 * sizeof(float)); return;
    case 2: __builtin_memcpy(dst, src, 2 * sizeof(float)); return;
    case 4: __builtin_memcpy(dst, src, 4 * sizeof(float)); return;
    case 8: __builtin_memcpy(dst, src, 8 * sizeof(float)); return;
    case 16: __builtin_memcpy(dst, src, 16 * sizeof(float)); return;
    case 32: __builtin_memcpy(dst, src, 32 * sizeof(float)); return;
    case 64: __builtin_memcpy(dst, src, 64 * sizeof(float)); return;
    default: __builtin_memcpy(dst, src, n * sizeof(float)); return;
  }
}

/* Writes a sentence into err (errlen bytes; nothing when err is NULL or
 * errlen 0) and returns code: `return ps__errf(PS_EINVAL, err, errlen,
 * "...", ...)` is how a check reports what it refused. */
int ps__errf(int code, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Text a peer chose (a table's or a variable's name), made safe to print
 * between single quotes in a log line or an error message: a backslash
 * and both quotes get a backslash, \n \r \t are written so, and every other
 * control byte (C0, DEL, the C1 controls U+0080..U+009F) and every byte
 * that is not part of valid UTF-8 is written \xHH; printable UTF-8 stays as
 * it is. So a name cannot end a log line and forge the next, send the
 * terminal an escape sequence, or close the quotes around it. Writes into
 * out (outlen bytes, NUL-terminated; cut at an escape's edge if it does not
 * fit) and returns out, a printf argument: PS__ESC is the usual form. */
const char *ps__escape(const char *s, char *out, size_t outlen);
/* Bytes that hold the escaped form of any name of up to 255 bytes
 * (PS_MAX_NAME; 4 per byte at most, and the NUL). */
#define PS__ESC_BYTES 1024
/* ps__escape(s) into a buffer that lives to the end of the enclosing
 * block: psd_info("table '%s' created", PS__ESC(name)). */
#define PS__ESC(s) ps__escape((s), (char[PS__ESC_BYTES]){0}, PS__ESC_BYTES)
/* Bytes of the valid UTF-8 sequence of a printable character at s (2..4),
 * or 0: an ASCII byte, a stray continuation byte, an overlong form, a
 * surrogate, past U+10FFFF, cut short (a NUL is not a continuation byte,
 * so nothing past the end is read), or a C1 control (U+0080..U+009F: 0xC2
 * 0x9B is CSI to some terminals). ps__escape's test, and psctl's for JSON. */
size_t ps__utf8_len(const unsigned char *s);

/* Monotonic clock in seconds: every deadline and duration. */
double ps__now(void);
/* Wall clock (Unix time) in seconds: only to date records for people. */
double ps__unix_now(void);

/* p-th percentile (0..100) of v[0..n), sorting v in place; 0 if n == 0. */
double ps__percentile(double *v, size_t n, double p);

/* Parses "host:port" ("[v6]:port" too) into host (hostcap bytes) and port
 * (1..65535). 0, or PS_EINVAL (-1) when malformed. */
int ps__parse_hostport(const char *s, char *host, size_t hostcap, int *port);

#endif /* PS_UTIL_H */
