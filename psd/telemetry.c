/* telemetry.c - psd's per-step records, the summary table and Stats. */
#define _GNU_SOURCE
#include "telemetry.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "wfile.h"
#include "wire.h"

int psd_telem_init(psd_telem *t, int ps_index, int num_ps, const char *path, char *err,
                   size_t errlen) {
  memset(t, 0, sizeof *t);
  t->ps_index = ps_index;
  t->num_ps = (uint32_t)num_ps;
  t->mono0 = ps__now();
  t->unix0 = ps__unix_now();
  t->off = path && strcmp(path, "off") == 0;
  /* A stream written as steps go (not renamed at the end): opened by the
   * one safe path, 0600 (docs/security.md, "Output files"). */
  if (path && *path && !t->off &&
      !(t->file = ps__wfile_stream(path, 0600, "--telemetry", err, errlen)))
    return -1;
  return 0;
}

static void slot_reset(psd_telem *t, psd_telem_slot *s) {
  s->used = 0;
  for (uint32_t w = 0; w < t->num_workers; w++) s->arrive[w] = -1;
}

int psd_telem_pin(psd_telem *t, uint32_t num_workers) {
  if (t->off) return 0; /* num_workers stays 0: every hook returns at once */
  uint32_t n = PSD_TELEM_CELLS / (num_workers ? num_workers : 1);
  if (n > PSD_TELEM_SLOTS) n = PSD_TELEM_SLOTS;
  if (n < 2) n = 2;
  t->slots = calloc(n, sizeof *t->slots);
  t->cells = malloc((size_t)n * num_workers * sizeof *t->cells);
  t->workers = calloc(num_workers, sizeof *t->workers);
  t->agg_hist = calloc(PSD_TELEM_HIST, sizeof *t->agg_hist);
  if (!t->slots || !t->cells || !t->workers || !t->agg_hist) {
    free(t->slots);
    free(t->cells);
    free(t->workers);
    free(t->agg_hist);
    t->slots = NULL;
    t->cells = NULL;
    t->workers = NULL;
    t->agg_hist = NULL;
    return PS_ENOMEM;
  }
  t->nslots = n;
  t->num_workers = num_workers;
  for (uint32_t i = 0; i < n; i++) {
    t->slots[i].arrive = t->cells + (size_t)i * num_workers;
    slot_reset(t, &t->slots[i]);
  }
  return 0;
}

/* A step's arrivals are complete: account it, write it, free the slot. */
static void close_slot(psd_telem *t, psd_telem_slot *s) {
  if (!s->used) return;
  if (s->arrivals >= 2) {
    psd_telem_worker *lw = &t->workers[s->last_worker];
    lw->last_count++;
    lw->waited_for += s->last - s->second;
  }
  t->agg_hist[t->closed % PSD_TELEM_HIST] = s->agg;
  t->closed++;
  t->stale += s->stale;
  FILE *f = t->file;
  if (f)
    fprintf(f,
            "{\"type\":\"ps\",\"ps\":%d,\"step\":%llu,\"time\":%.6f,\"arrivals\":%u,"
            "\"last\":%d,\"waited_for_last_ms\":%.4f,\"agg_ms\":%.4f,\"stale\":%u,"
            "\"arrive_ms\":[",
            t->ps_index, (unsigned long long)s->step, t->unix0 + (s->first - t->mono0),
            s->arrivals, s->arrivals ? s->last_worker : -1,
            s->arrivals >= 2 ? (s->last - s->second) * 1e3 : 0.0, s->agg * 1e3, s->stale);
  for (uint32_t w = 0; w < t->num_workers; w++) {
    double a = s->arrive[w];
    if (a >= 0) {
      t->workers[w].lag_sum += a - s->first;
      t->workers[w].lag_n++;
    }
    if (!f) continue;
    if (a >= 0) fprintf(f, "%s%.4f", w ? "," : "", (a - s->first) * 1e3);
    else fprintf(f, "%snull", w ? "," : "");
  }
  if (f) fputs("]}\n", f);
  slot_reset(t, s);
}

void psd_telem_push(psd_telem *t, int w, uint64_t step, double at, uint64_t bytes,
                    double agg, uint32_t stale) {
  if (w < 0 || (uint32_t)w >= t->num_workers) return;
  psd_telem_worker *wk = &t->workers[w];
  wk->pushes++;
  wk->bytes_in += bytes;
  psd_telem_slot *s = &t->slots[step % t->nslots];
  if (s->used && s->step != step) {
    if (step < s->step) return; /* older than every open step: counted above */
    close_slot(t, s);
  }
  if (!s->used) {
    s->used = 1;
    s->step = step;
    s->arrivals = 0;
    s->stale = 0;
    s->agg = 0;
    s->first = at;
    s->last = s->second = at;
    s->last_worker = w;
  }
  s->agg += agg;
  s->stale += stale;
  if (s->arrive[w] < 0) {
    s->arrivals++;
    wk->steps++;
  }
  if (at > s->arrive[w]) s->arrive[w] = at; /* a worker's last frame of the step */
  if (at < s->first) s->first = at;
  if (w == s->last_worker) {
    if (at > s->last) s->last = at;
    if (s->arrivals == 1) s->second = s->last;
  } else if (at >= s->last) {
    s->second = s->last;
    s->last = at;
    s->last_worker = w;
  } else if (at > s->second || s->arrivals == 2) {
    s->second = at;
  }
}

void psd_telem_finish(psd_telem *t, int w, const Ps__WorkerSummary *s) {
  if (!s || w < 0 || (uint32_t)w >= t->num_workers) return;
  psd_telem_worker *wk = &t->workers[w];
  if (!wk->summary) {
    wk->summary = calloc(1, sizeof *wk->summary);
    uint64_t *b = calloc((size_t)t->num_ps * 2 + 1, sizeof *b);
    if (!wk->summary || !b) {
      free(wk->summary);
      free(b);
      wk->summary = NULL;
      return; /* the table shows this worker without its own view */
    }
    ps__worker_summary__init(wk->summary);
    wk->summary->push_bytes = b;
    wk->summary->pull_bytes = b + t->num_ps;
  }
  /* Copy the scalars and at most num_ps byte counts: the arrays come from
   * the network and are only as trustworthy as their length. */
  Ps__WorkerSummary *d = wk->summary;
  uint64_t *pb = d->push_bytes, *qb = d->pull_bytes;
  *d = *s;
  d->base = wk->summary->base;
  d->push_bytes = pb;
  d->pull_bytes = qb;
  d->n_push_bytes = s->n_push_bytes < t->num_ps ? s->n_push_bytes : t->num_ps;
  d->n_pull_bytes = s->n_pull_bytes < t->num_ps ? s->n_pull_bytes : t->num_ps;
  memcpy(pb, s->push_bytes, d->n_push_bytes * sizeof *pb);
  memcpy(qb, s->pull_bytes, d->n_pull_bytes * sizeof *qb);
}

void psd_telem_close_all(psd_telem *t) {
  /* Oldest first, so the file stays in step order. */
  for (;;) {
    psd_telem_slot *min = NULL;
    for (uint32_t i = 0; i < t->nslots; i++)
      if (t->slots[i].used && (!min || t->slots[i].step < min->step)) min = &t->slots[i];
    if (!min) break;
    close_slot(t, min);
  }
  if (t->file) fflush(t->file);
}

void psd_telem_free(psd_telem *t) {
  psd_telem_close_all(t);
  if (t->file) fclose(t->file);
  for (uint32_t w = 0; t->workers && w < t->num_workers; w++)
    if (t->workers[w].summary) {
      free(t->workers[w].summary->push_bytes);
      free(t->workers[w].summary);
    }
  free(t->slots);
  free(t->cells);
  free(t->workers);
  free(t->agg_hist);
  memset(t, 0, sizeof *t);
}

/* Aggregation time percentile over the kept history, ms. */
static double agg_percentile(const psd_telem *t, double p) {
  size_t n = t->closed < PSD_TELEM_HIST ? (size_t)t->closed : PSD_TELEM_HIST;
  if (!n) return 0;
  double *v = malloc(n * sizeof *v);
  if (!v) return NAN;
  memcpy(v, t->agg_hist, n * sizeof *v);
  double r = ps__percentile(v, n, p) * 1e3;
  free(v);
  return r;
}

/* The worker most often last, or -1. */
static int straggler(const psd_telem *t) {
  int best = -1;
  for (uint32_t w = 0; w < t->num_workers; w++)
    if (t->workers[w].last_count &&
        (best < 0 || t->workers[w].last_count > t->workers[best].last_count))
      best = (int)w;
  return best;
}

static void human_bytes(uint64_t b, char *buf, size_t len) {
  if (b >= (1ull << 30)) snprintf(buf, len, "%.2f GiB", b / 1073741824.0);
  else if (b >= (1ull << 20)) snprintf(buf, len, "%.2f MiB", b / 1048576.0);
  else if (b >= 1024) snprintf(buf, len, "%.1f KiB", b / 1024.0);
  else snprintf(buf, len, "%llu B", (unsigned long long)b);
}

void psd_telem_print_summary(psd_telem *t, const psd_telem_view *v, FILE *f) {
  psd_telem_close_all(t);
  fprintf(f, "== psd telemetry summary: ps%d of %d, %u workers, %llu steps ==\n",
          t->ps_index, (int)t->num_ps, t->num_workers, (unsigned long long)t->closed);
  if (!t->num_workers) {
    fprintf(f, "no worker joined\n");
    fflush(f);
    return;
  }
  /* In async mode nobody waits for anybody: "last" means nothing. */
  int async = v->shard && v->shard->async_mode;
  int sg = async ? -1 : straggler(t);
  fprintf(f, "%-6s %7s %9s %9s | %9s %9s %9s %9s | %6s %6s %9s %9s\n", "rank", "steps",
          "step p50", "step p95", "compute", "push", "wait", "pull", "stale", "last%",
          "lag ms", "state");
  fprintf(f, "%-6s %7s %9s %9s | %9s %9s %9s %9s | %6s %6s %9s %9s\n", "", "", "ms", "ms",
          "p50 ms", "p50 ms", "p50 ms", "p50 ms", "steps", "", "mean", "");
  for (uint32_t w = 0; w < t->num_workers; w++) {
    const psd_telem_worker *wk = &t->workers[w];
    const Ps__WorkerSummary *s = wk->summary;
    char rank[16];
    snprintf(rank, sizeof rank, "w%u%s", w, (int)w == sg ? "*" : "");
    double lastp = t->closed ? 100.0 * (double)wk->last_count / (double)t->closed : 0;
    double lag = wk->lag_n ? wk->lag_sum / (double)wk->lag_n * 1e3 : 0;
    if (s)
      fprintf(f, "%-6s %7llu %9.3f %9.3f | %9.3f %9.3f %9.3f %9.3f | %6llu %6.1f %9.3f %9s\n",
              rank, (unsigned long long)s->steps, s->step_p50_ms, s->step_p95_ms,
              s->compute_p50_ms, s->push_p50_ms, s->wait_p50_ms, s->pull_p50_ms,
              (unsigned long long)s->stale_steps, lastp, lag,
              psd_job_worker_state(v->job, w));
    else
      fprintf(f, "%-6s %7llu %9s %9s | %9s %9s %9s %9s | %6s %6.1f %9.3f %9s\n", rank,
              (unsigned long long)wk->steps, "-", "-", "-", "-", "-", "-", "-", lastp, lag,
              psd_job_worker_state(v->job, w));
  }
  /* Bytes per ps shard, as the workers counted them (every ps). */
  uint64_t *in = calloc((size_t)t->num_ps * 2 + 1, sizeof *in);
  int any = 0;
  for (uint32_t w = 0; in && w < t->num_workers; w++) {
    const Ps__WorkerSummary *s = t->workers[w].summary;
    if (!s) continue;
    any = 1;
    for (size_t p = 0; p < s->n_push_bytes; p++) in[p] += s->push_bytes[p];
    for (size_t p = 0; p < s->n_pull_bytes; p++) in[t->num_ps + p] += s->pull_bytes[p];
  }
  if (any) {
    fprintf(f, "bytes per ps shard (all workers, whole run):\n");
    for (uint32_t p = 0; p < t->num_ps; p++) {
      char a[32], b[32];
      human_bytes(in[p], a, sizeof a);
      human_bytes(in[t->num_ps + p], b, sizeof b);
      fprintf(f, "  ps%-4u gradients in %12s   parameters out %12s\n", p, a, b);
    }
  } else {
    uint64_t bi = 0, bo = 0;
    for (uint32_t w = 0; w < t->num_workers; w++) {
      bi += t->workers[w].bytes_in;
      bo += t->workers[w].bytes_out;
    }
    char a[32], b[32];
    human_bytes(bi, a, sizeof a);
    human_bytes(bo, b, sizeof b);
    fprintf(f, "bytes at ps%d: gradients in %s, parameters out %s\n", t->ps_index, a, b);
  }
  free(in);
  if (sg >= 0) {
    const psd_telem_worker *s = &t->workers[sg];
    fprintf(f,
            "straggler: w%d arrived last in %llu of %llu steps (%.0f%%); the others waited "
            "%.3f ms per such step for it (%.3f s in all)\n",
            sg, (unsigned long long)s->last_count, (unsigned long long)t->closed,
            t->closed ? 100.0 * (double)s->last_count / (double)t->closed : 0,
            s->waited_for / (double)s->last_count * 1e3, s->waited_for);
  } else if (async) {
    fprintf(f, "straggler: none (async mode: every gradient is applied on arrival, no worker "
               "waits for another)\n");
  } else {
    fprintf(f, "straggler: none (no step had two arrivals)\n");
  }
  fprintf(f, "stale gradients dropped: %llu (at ps%d)\n",
          (unsigned long long)v->shard->stale_dropped, t->ps_index);
  fprintf(f, "aggregation + optimizer per step at ps%d: p50 %.3f ms, p95 %.3f ms\n",
          t->ps_index, agg_percentile(t, 50), agg_percentile(t, 95));
  fflush(f);
}

/* Stats must be live, but a step's record closes only when its slot is
 * reused (64 steps later) or at exit: until then the counters would read 0.
 * An open step counts once it is over for sure: every worker has arrived,
 * or a later step has begun. Tallied into copies; the slot stays open for
 * a late backup worker. */
static int slot_over(const psd_telem *t, const psd_telem_slot *s, uint64_t newest) {
  return s->used && (s->arrivals >= t->num_workers || s->step < newest);
}

static void tally_open_slots(const psd_telem *t, Ps__WorkerStats *ws, uint64_t *lag_n,
                             double *agg, size_t *nagg, uint64_t *steps) {
  uint64_t newest = 0;
  for (uint32_t i = 0; i < t->nslots; i++)
    if (t->slots[i].used && t->slots[i].step > newest) newest = t->slots[i].step;
  for (uint32_t i = 0; i < t->nslots; i++) {
    const psd_telem_slot *s = &t->slots[i];
    if (!slot_over(t, s, newest)) continue;
    (*steps)++;
    agg[(*nagg)++] = s->agg;
    if (s->arrivals >= 2) {
      ws[s->last_worker].last_count++;
      ws[s->last_worker].waited_for_ms += (s->last - s->second) * 1e3;
    }
    for (uint32_t w = 0; w < t->num_workers; w++) {
      if (s->arrive[w] < 0) continue;
      /* arrive_mean_ms holds the sum here; divided by lag_n afterwards */
      ws[w].arrive_mean_ms += (s->arrive[w] - s->first) * 1e3;
      lag_n[w]++;
    }
  }
}

int psd_telem_stats(psd_telem *t, const psd_telem_view *v, Ps__StatsReply *r) {
  ps__stats_reply__init(r);
  const psd_shard *sh = v->shard;
  r->ps_index = (uint32_t)t->ps_index;
  r->num_ps = t->num_ps;
  r->num_workers = v->job->num_workers;
  r->replicas_to_aggregate = v->job->pinned ? sh->replicas : 0;
  r->async_mode = v->job->pinned && sh->async_mode;
  r->server_id = (char *)v->server_id;
  r->uptime_s = v->uptime_s;
  uint64_t lo = UINT64_MAX, hi = 0;
  for (uint32_t i = 0; i < sh->n; i++) {
    uint64_t s = sh->slices[i]->step;
    if (s < lo) lo = s;
    if (s > hi) hi = s;
  }
  r->step = sh->n ? lo : 0;
  r->max_step = hi;
  r->slices = sh->n;
  r->bytes_held = sh->bytes_held;
  r->stale_dropped = sh->stale_dropped;
  r->steps_recorded = t->closed;
  r->agg_ms_p50 = agg_percentile(t, 50);
  if (!t->num_workers) return 0;
  size_t hist = t->closed < PSD_TELEM_HIST ? (size_t)t->closed : PSD_TELEM_HIST, nagg = hist;
  Ps__WorkerStats *ws = calloc(t->num_workers, sizeof *ws);
  Ps__WorkerStats **wp = calloc(t->num_workers, sizeof *wp);
  uint64_t *lag_n = calloc(t->num_workers, sizeof *lag_n);
  double *agg = malloc((hist + t->nslots + 1) * sizeof *agg);
  if (!ws || !wp || !lag_n || !agg) {
    free(ws);
    free(wp);
    free(lag_n);
    free(agg);
    return PS_ENOMEM;
  }
  for (uint32_t w = 0; w < t->num_workers; w++) {
    const psd_telem_worker *k = &t->workers[w];
    ps__worker_stats__init(&ws[w]);
    ws[w].worker = w;
    ws[w].state = (char *)psd_job_worker_state(v->job, w);
    ws[w].pushes = k->pushes;
    ws[w].last_count = k->last_count;
    ws[w].waited_for_ms = k->waited_for * 1e3;
    ws[w].bytes_in = k->bytes_in;
    ws[w].bytes_out = k->bytes_out;
    ws[w].shm_tcp_frames = k->shm_tcp_frames;
    ws[w].arrive_mean_ms = k->lag_sum * 1e3;
    lag_n[w] = k->lag_n;
    wp[w] = &ws[w];
  }
  memcpy(agg, t->agg_hist, hist * sizeof *agg);
  tally_open_slots(t, ws, lag_n, agg, &nagg, &r->steps_recorded);
  for (uint32_t w = 0; w < t->num_workers; w++)
    ws[w].arrive_mean_ms = lag_n[w] ? ws[w].arrive_mean_ms / (double)lag_n[w] : 0;
  if (nagg) r->agg_ms_p50 = ps__percentile(agg, nagg, 50) * 1e3;
  free(lag_n);
  free(agg);
  r->n_workers = t->num_workers;
  r->workers = wp;
  return 0;
}

void psd_telem_stats_free(Ps__StatsReply *r) {
  if (r->workers) free(r->workers[0]);
  free(r->workers);
  r->workers = NULL;
  r->n_workers = 0;
}
