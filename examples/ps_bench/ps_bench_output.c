/* ps_bench_output.c - what ps_bench prints: progress lines on stderr, and
 * on stdout either a table (one row per measurement) or, with --json, one
 * JSON object per line; plus the numbers and labels they use. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_bench_internal.h"

/* ---------------------------------------------------------------------- */
/* Numbers and labels */

void progress(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("ps_bench: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

double median(const double *v, size_t n) {
  if (n == 0) return NAN;
  double *c = malloc(n * sizeof *c);
  if (!c) return NAN;
  memcpy(c, v, n * sizeof *c);
  qsort(c, n, sizeof *c, cmp_double);
  double m = n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
  free(c);
  return m;
}

const char *size_label(uint64_t b, char *buf, size_t len) {
  if (b >= (1ULL << 30) && b % (1ULL << 30) == 0)
    snprintf(buf, len, "%" PRIu64 " GiB", b >> 30);
  else if (b >= (1ULL << 20) && b % (1ULL << 20) == 0)
    snprintf(buf, len, "%" PRIu64 " MiB", b >> 20);
  else if (b >= (1ULL << 10) && b % (1ULL << 10) == 0)
    snprintf(buf, len, "%" PRIu64 " KiB", b >> 10);
  else
    snprintf(buf, len, "%" PRIu64 " B", b);
  return buf;
}

const char *jnum(double v, char *buf, size_t len) {
  if (!isfinite(v)) snprintf(buf, len, "null");
  else snprintf(buf, len, "%.6g", v);
  return buf;
}

static void print_json_string(const char *s) {
  putchar('"');
  for (const char *p = s; *p; p++) {
    if (*p == '"' || *p == '\\') printf("\\%c", *p);
    else if ((unsigned char)*p < 0x20) printf("\\u%04x", (unsigned char)*p);
    else putchar(*p);
  }
  putchar('"');
}

/* ---------------------------------------------------------------------- */
/* Rows */

void print_table_header(void) {
  printf("%-11s %10s %4s %8s %6s %12s %10s %11s\n", "name", "size", "ps", "workers", "steps",
         "step_ms", "gbps", "total_gbps");
}

static void print_pushpull_json(const pp_result *r) {
  char a[32], b[32], c[32];
  if (r->ok == 0) {
    printf("{\"name\":\"pushpull\",\"bytes\":%" PRIu64
           ",\"ps\":%d,\"workers\":%d,\"steps\":%d,\"error\":",
           r->bytes, r->ps, r->workers, r->steps);
    print_json_string(r->error);
    printf("}\n");
    return;
  }
  printf("{\"name\":\"pushpull\",\"bytes\":%" PRIu64
         ",\"ps\":%d,\"workers\":%d,\"steps\":%d,\"step_ms\":%s,\"gbps\":%s,"
         "\"total_gbps\":%s",
         r->bytes, r->ps, r->workers, r->steps, jnum(r->step_ms, a, sizeof a),
         jnum(r->gbps, b, sizeof b), jnum(r->total_gbps, c, sizeof c));
  printf(",\"max_step_ms\":%s", jnum(r->max_step_ms, a, sizeof a));
  if (r->ok < 0) {
    printf(",\"warning\":");
    print_json_string(r->error);
  }
  printf("}\n");
}

void print_pushpull(const pp_result *r) {
  char label[32];
  if (opt.json) {
    print_pushpull_json(r);
  } else {
    size_label(r->bytes, label, sizeof label);
    if (r->ok == 0)
      printf("%-11s %10s %4d %8d %6d  FAILED: %s\n", "pushpull", label, r->ps, r->workers,
             r->steps, r->error);
    else
      printf("%-11s %10s %4d %8d %6d %12.3f %10.4f %11.4f%s\n", "pushpull", label, r->ps,
             r->workers, r->steps, r->step_ms, r->gbps, r->total_gbps,
             r->ok < 0 ? "  (wrong values)" : "");
  }
  fflush(stdout);
}

/* Best of 3 streams of `total` bytes: best_s seconds, gbps. */
void print_tcp_stream(uint64_t total, double best_s, double gbps) {
  char a[32], label[32];
  if (opt.json)
    printf("{\"name\":\"tcp_stream\",\"bytes\":%" PRIu64 ",\"gbps\":%s}\n", total,
           jnum(gbps, a, sizeof a));
  else
    printf("%-11s %10s %4s %8s %6s %12.3f %10.4f %11s\n", "tcp_stream",
           size_label(total, label, sizeof label), "-", "-", "3", best_s * 1e3, gbps, "-");
  fflush(stdout);
}

/* Median round trip of 4-byte messages, in seconds. */
void print_tcp_rtt(double rtt_s) {
  char a[32], b[32];
  double rtt_us = rtt_s * 1e6;
  if (opt.json)
    printf("{\"name\":\"tcp_rtt\",\"bytes\":4,\"rtt_us\":%s,\"step_ms\":%s}\n",
           jnum(rtt_us, a, sizeof a), jnum(rtt_s * 1e3, b, sizeof b));
  else
    printf("%-11s %10s %4s %8s %6d %12.4f %10s %11s   (rtt %.2f us)\n", "tcp_rtt", "4 B", "-",
           "-", RTT_ITERS, rtt_s * 1e3, "-", "-", rtt_us);
  fflush(stdout);
}

/* Medians of the step time with telemetry on and off, in ms. */
void print_telemetry_cost(double m_on, double m_off) {
  char a[32], b[32], c[32];
  if (opt.json)
    printf("{\"name\":\"telemetry_cost\",\"bytes\":4,\"ps\":1,\"workers\":1,"
           "\"rounds\":%d,\"step_ms_off\":%s,\"step_ms_on\":%s,\"ratio\":%s}\n",
           TELEM_ROUNDS, jnum(m_off, a, sizeof a), jnum(m_on, b, sizeof b),
           jnum(m_on / m_off, c, sizeof c));
  else
    printf("%-15s %10s  step with telemetry / without = %.4f (%.4f vs %.4f ms, median of "
           "%d runs each)\n",
           "telemetry_cost", "4 B", m_on / m_off, m_on, m_off, TELEM_ROUNDS);
  fflush(stdout);
}

/* One ps=1 workers=1 result against a baseline (vs: "tcp_stream" or
 * "tcp_rtt"). The caller flushes. */
void print_ratio(const pp_result *r, const char *vs, double value) {
  char a[32], label[32];
  if (opt.json)
    printf("{\"name\":\"ratio\",\"bytes\":%" PRIu64
           ",\"ps\":1,\"workers\":1,\"vs\":\"%s\",\"value\":%s}\n",
           r->bytes, vs, jnum(value, a, sizeof a));
  else if (!strcmp(vs, "tcp_stream"))
    printf("%-15s %10s  pushpull gbps / tcp_stream gbps = %.4f\n", "ratio_vs_stream",
           size_label(r->bytes, label, sizeof label), value);
  else
    printf("%-15s %10s  pushpull step / tcp round trip  = %.2f\n", "ratio_vs_rtt",
           size_label(r->bytes, label, sizeof label), value);
}
