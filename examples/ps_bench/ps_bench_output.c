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
/* Rows of one round */

int g_round;

const char *figure_name(figure f) {
  switch (f) {
  case FIG_PUSHPULL: return "pushpull";
  case FIG_TABLE: return "table";
  case FIG_TCP_STREAM: return "tcp_stream";
  case FIG_TCP_RTT: return "tcp_rtt";
  case FIG_MEMCPY: return "memcpy";
  case FIG_MPI_SHM: return "mpi_allreduce_shm";
  case FIG_MPI_TCP: return "mpi_allreduce_tcp";
  }
  return "?";
}

const char *series_name(const series *s, char *buf, size_t len) {
  if (s->transport) snprintf(buf, len, "%s/%s", figure_name(s->fig), s->transport);
  else snprintf(buf, len, "%s", figure_name(s->fig));
  return buf;
}

/* A table run's label "KxD", else the size's. */
static const char *run_label(uint64_t bytes, uint64_t keys, uint32_t dim, char *buf,
                             size_t len) {
  if (!keys) return size_label(bytes, buf, len);
  snprintf(buf, len, "%" PRIu64 "x%u", keys, dim);
  return buf;
}

/* ,"keys":K,"dim":D,"keys_per_s":X of a table run (step_ms its median or
 * its round's step); nothing for a dense one. */
static void print_json_table(uint64_t keys, uint32_t dim, double step_ms) {
  char a[32];
  if (!keys) return;
  printf(",\"keys\":%" PRIu64 ",\"dim\":%u,\"keys_per_s\":%s", keys, dim,
         jnum((double)keys / (step_ms * 1e-3), a, sizeof a));
}

/* ,"transport":"T" in a JSON line, when t is set. */
static void print_json_transport(const char *key, const char *t) {
  if (t) printf(",\"%s\":\"%s\"", key, t);
}

void print_table_header(void) {
  printf("%5s %-17s %10s %4s %8s %6s %12s %10s %11s\n", "round", "name", "size", "ps",
         "workers", "steps", "step_ms", "gbps", "total_gbps");
}

static void print_pushpull_json(const pp_result *r) {
  char a[32], b[32], c[32];
  const char *name = r->keys ? "table" : "pushpull";
  if (r->ok == 0) {
    printf("{\"name\":\"%s\",\"round\":%d,\"bytes\":%" PRIu64
           ",\"ps\":%d,\"workers\":%d,\"steps\":%d,\"error\":",
           name, g_round, r->bytes, r->ps, r->workers, r->steps);
    print_json_string(r->error);
    print_json_transport("transport", r->transport);
    printf("}\n");
    return;
  }
  printf("{\"name\":\"%s\",\"round\":%d,\"bytes\":%" PRIu64
         ",\"ps\":%d,\"workers\":%d,\"steps\":%d,\"step_ms\":%s,\"gbps\":%s,"
         "\"total_gbps\":%s",
         name, g_round, r->bytes, r->ps, r->workers, r->steps, jnum(r->step_ms, a, sizeof a),
         jnum(r->gbps, b, sizeof b), jnum(r->total_gbps, c, sizeof c));
  printf(",\"max_step_ms\":%s", jnum(r->max_step_ms, a, sizeof a));
  print_json_table(r->keys, r->dim, r->step_ms);
  print_json_transport("transport", r->transport);
  if (r->ok < 0) {
    printf(",\"warning\":");
    print_json_string(r->error);
  }
  printf("}\n");
}

void print_pushpull(const pp_result *r) {
  char label[32], name[32];
  if (opt.json) {
    print_pushpull_json(r);
  } else {
    run_label(r->bytes, r->keys, r->dim, label, sizeof label);
    series_name(&(series){.fig = r->keys ? FIG_TABLE : FIG_PUSHPULL, .transport = r->transport},
                name, sizeof name);
    if (r->ok == 0)
      printf("%5d %-17s %10s %4d %8d %6d  FAILED: %s\n", g_round, name, label, r->ps,
             r->workers, r->steps, r->error);
    else
      printf("%5d %-17s %10s %4d %8d %6d %12.3f %10.4f %11.4f%s", g_round, name, label,
             r->ps, r->workers, r->steps, r->step_ms, r->gbps, r->total_gbps,
             r->ok < 0 ? "  (wrong values)" : "");
    if (r->ok != 0 && r->keys) printf("  %.4g keys/s", (double)r->keys / (r->step_ms * 1e-3));
    if (r->ok != 0) printf("\n");
  }
  fflush(stdout);
}

static void print_baseline_json(const series *s, int r, double max_ms) {
  char a[32], b[32];
  printf("{\"name\":\"%s\",\"round\":%d,\"bytes\":%" PRIu64, figure_name(s->fig), g_round,
         s->bytes);
  if (s->fig == FIG_TCP_RTT)
    printf(",\"rtt_us\":%s", jnum(s->step_ms[r] * 1e3, a, sizeof a));
  if (s->fig == FIG_MEMCPY) printf(",\"threads\":1");
  if (s->fig == FIG_MPI_SHM || s->fig == FIG_MPI_TCP) printf(",\"workers\":%d", s->workers);
  printf(",\"step_ms\":%s", jnum(s->step_ms[r], a, sizeof a));
  if (s->fig != FIG_TCP_RTT) printf(",\"gbps\":%s", jnum(s->gbps[r], b, sizeof b));
  if (isfinite(max_ms)) printf(",\"max_step_ms\":%s", jnum(max_ms, a, sizeof a));
  printf("}\n");
}

void print_baseline(const series *s, double max_ms) {
  int r = g_round - 1;
  char label[32], w[16] = "-", steps[16] = "-";
  if (opt.json) {
    print_baseline_json(s, r, max_ms);
  } else {
    if (s->workers) snprintf(w, sizeof w, "%d", s->workers);
    if (s->fig == FIG_TCP_RTT) snprintf(steps, sizeof steps, "%d", RTT_ITERS);
    if (s->fig == FIG_MEMCPY) snprintf(steps, sizeof steps, "%d", MEMCPY_SAMPLES);
    if (s->fig == FIG_MPI_SHM || s->fig == FIG_MPI_TCP)
      snprintf(steps, sizeof steps, "%d", steps_for(s->bytes));
    printf("%5d %-17s %10s %4s %8s %6s %12.4f", g_round, figure_name(s->fig),
           size_label(s->bytes, label, sizeof label), "-", w, steps, s->step_ms[r]);
    if (isfinite(s->gbps[r])) printf(" %10.4f %11s\n", s->gbps[r], "-");
    else printf(" %10s %11s   (rtt %.2f us)\n", "-", "-", s->step_ms[r] * 1e3);
  }
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

/* ---------------------------------------------------------------------- */
/* After the rounds */

/* Median, min and max of the finite values among v[0..n); their count. */
static int stats(const double *v, int n, double *med, double *lo, double *hi) {
  double f[MAX_ROUNDS] = {0};
  int k = 0;
  for (int i = 0; i < n; i++)
    if (isfinite(v[i])) f[k++] = v[i];
  *med = median(f, (size_t)k);
  *lo = *hi = NAN;
  for (int i = 0; i < k; i++) {
    if (i == 0 || f[i] < *lo) *lo = f[i];
    if (i == 0 || f[i] > *hi) *hi = f[i];
  }
  return k;
}

/* ,"key":[v...],"key_median":m,"key_min":lo,"key_max":hi */
static void print_json_stats(const char *key, const double *v, int n) {
  char a[32];
  double med, lo, hi;
  stats(v, n, &med, &lo, &hi);
  printf(",\"%s\":[", key);
  for (int i = 0; i < n; i++) printf("%s%s", i ? "," : "", jnum(v[i], a, sizeof a));
  printf("],\"%s_median\":%s", key, jnum(med, a, sizeof a));
  printf(",\"%s_min\":%s", key, jnum(lo, a, sizeof a));
  printf(",\"%s_max\":%s", key, jnum(hi, a, sizeof a));
}

void print_summary_header(void) {
  printf("\n%-17s %10s %4s %8s %6s %30s %30s\n", "median of", "size", "ps", "workers",
         "rounds", "step_ms median [min-max]", "gbps median [min-max]");
}

/* "median [min-max]" of the finite values, or "-". */
static const char *range_text(const double *v, int n, char *buf, size_t len) {
  double med, lo, hi;
  if (!stats(v, n, &med, &lo, &hi)) snprintf(buf, len, "-");
  else snprintf(buf, len, "%.4g [%.4g-%.4g]", med, lo, hi);
  return buf;
}

void print_summary(const series *s) {
  int n = opt.rounds;
  double med, lo, hi;
  int ok = stats(s->step_ms, n, &med, &lo, &hi);
  if (opt.json) {
    printf("{\"name\":\"summary\",\"of\":\"%s\",\"bytes\":%" PRIu64
           ",\"ps\":%d,\"workers\":%d,\"rounds\":%d,\"ok_rounds\":%d",
           figure_name(s->fig), s->bytes, s->ps, s->workers, n, ok);
    print_json_transport("transport", s->transport);
    print_json_table(s->keys, s->dim, med);
    print_json_stats("step_ms", s->step_ms, n);
    print_json_stats("gbps", s->gbps, n);
    printf("}\n");
  } else {
    char label[32], ps[16] = "-", w[16] = "-", rounds[24], a[80], b[80], name[32];
    if (s->ps) snprintf(ps, sizeof ps, "%d", s->ps);
    if (s->workers) snprintf(w, sizeof w, "%d", s->workers);
    snprintf(rounds, sizeof rounds, ok == n ? "%d" : "%d of %d", ok, n);
    printf("%-17s %10s %4s %8s %6s %30s %30s", series_name(s, name, sizeof name),
           run_label(s->bytes, s->keys, s->dim, label, sizeof label), ps, w, rounds,
           range_text(s->step_ms, n, a, sizeof a), range_text(s->gbps, n, b, sizeof b));
    if (s->keys && ok) printf("  %.4g keys/s", (double)s->keys / (med * 1e-3));
    printf("\n");
  }
}

void print_ratio(const series *psd, const series *base, int use_gbps) {
  int n = opt.rounds;
  const double *x = use_gbps ? psd->gbps : psd->step_ms;
  const double *y = use_gbps ? base->gbps : base->step_ms;
  const char *metric = use_gbps ? "gbps" : "step_ms";
  double per[MAX_ROUNDS], mx, my, med, lo, hi, ignore;
  for (int r = 0; r < n; r++) per[r] = x[r] / y[r];
  stats(x, n, &mx, &ignore, &ignore);
  stats(y, n, &my, &ignore, &ignore);
  stats(per, n, &med, &lo, &hi);
  double value = mx / my; /* the ratio of the medians */
  char a[32], label[32], xn[32], bn[32];
  if (opt.json) {
    printf("{\"name\":\"ratio\",\"of\":\"%s\",\"bytes\":%" PRIu64
           ",\"ps\":%d,\"workers\":%d,\"vs\":\"%s\",\"value\":%s",
           metric, psd->bytes, psd->ps, psd->workers, figure_name(base->fig),
           jnum(value, a, sizeof a));
    if (psd->keys) printf(",\"table\":true,\"keys\":%" PRIu64 ",\"dim\":%u", psd->keys, psd->dim);
    print_json_transport("transport", psd->transport);
    print_json_transport("vs_transport", base->transport);
    printf(",\"psd_median\":%s", jnum(mx, a, sizeof a));
    printf(",\"vs_median\":%s", jnum(my, a, sizeof a));
    print_json_stats("per_round", per, n);
    printf("}\n");
  } else {
    printf("ratio %s ps=%d workers=%d: %s %s / %s %s = %.4f (medians %.4g / %.4g; "
           "per round %.4g-%.4g)\n",
           run_label(psd->bytes, psd->keys, psd->dim, label, sizeof label), psd->ps, psd->workers,
           series_name(psd, xn, sizeof xn), metric, series_name(base, bn, sizeof bn), metric,
           value, mx, my, lo, hi);
  }
}

/* A line that says something about the run (e.g. a baseline not built). */
void print_note(const char *key, const char *text) {
  if (opt.json) {
    printf("{\"name\":\"note\",\"%s\":", key);
    print_json_string(text);
    printf("}\n");
  } else {
    printf("note: %s: %s\n", key, text);
  }
  fflush(stdout);
}
