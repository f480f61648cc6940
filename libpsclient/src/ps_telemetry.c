/* ps_telemetry.c - the worker's per-step records, their file and summary. */
#define _GNU_SOURCE
#include "ps_telemetry.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "wfile.h"
#include "wire.h"

int ps__telem_init(ps__telem *t, const char *spec, int rank, int num_ps, char *err,
                   size_t errlen) {
  memset(t, 0, sizeof *t);
  t->rank = rank;
  t->num_ps = num_ps;
  if (spec && strcmp(spec, "off") == 0) return 0;
  size_t nb = (size_t)num_ps * 2;
  t->ring = calloc(PS__TELEM_RING, sizeof *t->ring);
  t->ring_bytes = calloc(PS__TELEM_RING * nb, sizeof *t->ring_bytes);
  t->tot = calloc(nb, sizeof *t->tot);
  t->mark = calloc(nb, sizeof *t->mark);
  t->shm = calloc((size_t)num_ps, 1);
  if (!t->ring || !t->ring_bytes || !t->tot || !t->mark || !t->shm) {
    ps__telem_free(t);
    snprintf(err, errlen, "out of memory for the telemetry ring");
    return PS_ENOMEM;
  }
  if (spec && *spec) {
    snprintf(t->path, sizeof t->path, "%s", spec);
    /* A stream written as steps go: opened by the one safe path, 0600
     * (docs/security.md, "Output files"). */
    t->file = ps__wfile_stream(spec, 0600, "telemetry file", err, errlen);
    if (!t->file) {
      ps__telem_free(t);
      return PS_EINVAL;
    }
  }
  t->mono0 = ps__now();
  t->unix0 = ps__unix_now();
  t->last_exit = t->mono0;
  t->on = 1;
  return 0;
}

static void write_bytes(FILE *f, const uint64_t *b, int num_ps, int dir) {
  for (int p = 0; p < num_ps; p++)
    fprintf(f, "%s%llu", p ? "," : "", (unsigned long long)b[2 * p + dir]);
}

/* Writes the records not yet in the file (at most a ring's worth). */
static void flush_file(ps__telem *t) {
  if (!t->file) return;
  if (t->n - t->written > PS__TELEM_RING) t->written = t->n - PS__TELEM_RING;
  for (; t->written < t->n; t->written++) {
    size_t i = (size_t)(t->written % PS__TELEM_RING);
    const ps__telem_rec *r = &t->ring[i];
    const uint64_t *b = t->ring_bytes + i * (size_t)t->num_ps * 2;
    fprintf(t->file,
            "{\"type\":\"worker\",\"rank\":%d,\"step\":%llu,\"time\":%.6f,\"step_ms\":%.4f,"
            "\"compute_ms\":%.4f,\"push_ms\":%.4f,\"wait_ms\":%.4f,\"pull_ms\":%.4f,"
            "\"stale\":%d,\"push_bytes\":[",
            t->rank, (unsigned long long)r->step, r->start,
            (r->push + r->wait + r->pull) * 1e3, r->compute * 1e3, r->push * 1e3,
            r->wait * 1e3, r->pull * 1e3, r->stale);
    write_bytes(t->file, b, t->num_ps, 0);
    fputs("],\"pull_bytes\":[", t->file);
    write_bytes(t->file, b, t->num_ps, 1);
    fputs("],\"transport\":[", t->file);
    for (int p = 0; p < t->num_ps; p++)
      fprintf(t->file, "%s\"%s\"", p ? "," : "", t->shm[p] ? "shm" : "tcp");
    fputs("]}\n", t->file);
  }
  fflush(t->file);
}

void ps__telem_free(ps__telem *t) {
  if (t->file) {
    flush_file(t);
    fclose(t->file);
  }
  free(t->ring);
  free(t->ring_bytes);
  free(t->tot);
  free(t->mark);
  free(t->shm);
  memset(t, 0, sizeof *t);
}

void ps__telem_step_begin(ps__telem *t, double now) {
  if (!t->on) return;
  t->enter = now;
  memcpy(t->mark, t->tot, (size_t)t->num_ps * 2 * sizeof *t->mark);
}

void ps__telem_step_end(ps__telem *t, uint64_t step, double push_done, double first_pull,
                        int stale, double now) {
  if (!t->on) return;
  size_t i = (size_t)(t->n % PS__TELEM_RING);
  ps__telem_rec *r = &t->ring[i];
  r->step = step;
  r->start = t->unix0 + (t->enter - t->mono0);
  r->compute = t->enter - t->last_exit;
  r->push = push_done - t->enter;
  /* The aggregate may come before the PushReply (another worker's push
   * completed the step first): then there was no wait. */
  double pull_from = first_pull > push_done ? first_pull : push_done;
  r->wait = pull_from - push_done;
  r->pull = now - pull_from;
  r->stale = stale;
  uint64_t *b = t->ring_bytes + i * (size_t)t->num_ps * 2;
  for (int k = 0; k < t->num_ps * 2; k++) b[k] = t->tot[k] - t->mark[k];
  t->stale_steps += stale != 0;
  t->n++;
  t->last_exit = now;
  if (t->file && t->n - t->written >= PS__TELEM_BATCH) flush_file(t);
}

int ps__telem_summary(ps__telem *t, Ps__WorkerSummary *out) {
  ps__worker_summary__init(out);
  if (!t->on) return 0;
  size_t n = t->n < PS__TELEM_RING ? (size_t)t->n : PS__TELEM_RING;
  double *v = malloc((n ? n : 1) * sizeof *v);
  if (!v) return PS_ENOMEM;
  /* Which part of a record each percentile reads. */
  enum { F_STEP, F_COMPUTE, F_PUSH, F_WAIT, F_PULL, F_N };
  double res[F_N][2];
  for (int f = 0; f < F_N; f++) {
    for (size_t i = 0; i < n; i++) {
      const ps__telem_rec *r = &t->ring[i];
      v[i] = f == F_STEP      ? r->push + r->wait + r->pull
             : f == F_COMPUTE ? r->compute
             : f == F_PUSH    ? r->push
             : f == F_WAIT    ? r->wait
                              : r->pull;
    }
    res[f][0] = ps__percentile(v, n, 50) * 1e3;
    res[f][1] = ps__percentile(v, n, 95) * 1e3;
  }
  free(v);
  out->steps = t->n;
  out->stale_steps = t->stale_steps;
  out->step_p50_ms = res[F_STEP][0];
  out->step_p95_ms = res[F_STEP][1];
  out->compute_p50_ms = res[F_COMPUTE][0];
  out->push_p50_ms = res[F_PUSH][0];
  out->wait_p50_ms = res[F_WAIT][0];
  out->pull_p50_ms = res[F_PULL][0];
  /* Per ps, from the run's counters: mark is free between steps. */
  for (int p = 0; p < t->num_ps; p++) {
    t->mark[p] = t->tot[2 * p];
    t->mark[t->num_ps + p] = t->tot[2 * p + 1];
  }
  out->n_push_bytes = out->n_pull_bytes = (size_t)t->num_ps;
  out->push_bytes = t->mark;
  out->pull_bytes = t->mark + t->num_ps;
  return 0;
}
