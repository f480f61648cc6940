/*
 * telemetry.h - psd's per-step telemetry: for every step (the step a Push
 * names) when each worker's gradient arrived, how long aggregation and the
 * optimizer took, and stale gradients; per worker how often it was the last
 * to arrive and how long the others waited for it. A sparse table's push
 * is an arrival like a Push (a job of tables alone has steps too). Always
 * on: fixed arrays sized when the job's worker count is pinned, nothing
 * allocated per step.
 * Feeds `--telemetry FILE` (JSON lines, docs/telemetry.md), the end-of-run
 * summary table (`--summary`) and psctl's Stats.
 */
#ifndef PSD_TELEMETRY_H
#define PSD_TELEMETRY_H

#include <stdint.h>
#include <stdio.h>

#include "job.h"
#include "ps.pb-c.h"
#include "shard.h"

/* Steps whose arrivals are still being collected: a step is closed (and
 * written) once a step this many ahead begins, so workers up to 63 steps
 * apart (backup workers) are still attributed to the right step. */
#define PSD_TELEM_SLOTS 64u
/* Most arrival cells (slots x workers) held: 8 MiB of doubles. Jobs with
 * more than 16k workers get fewer slots, never more memory. */
#define PSD_TELEM_CELLS (1u << 20)
/* Closed steps whose aggregation time is kept for the percentiles. */
#define PSD_TELEM_HIST 4096u

/* One step still collecting arrivals. */
typedef struct psd_telem_slot {
  uint64_t step;       /* the step the pushes named */
  int used;            /* holds a step */
  uint32_t arrivals;   /* workers that pushed for it */
  uint32_t stale;      /* gradients (items) dropped as stale */
  double first;        /* earliest arrival (monotonic s) */
  double last, second; /* latest and second latest arrival */
  int last_worker;     /* who arrived last */
  double agg;          /* aggregation + optimizer seconds */
  double *arrive;      /* per worker arrival (monotonic s), < 0: none */
} psd_telem_slot;

/* One worker as this psd saw it over the run. */
typedef struct psd_telem_worker {
  uint64_t pushes;     /* Push and TablePush frames received */
  uint64_t steps;      /* steps it pushed for (one per step, however many
                          frames: the summary's view without its own) */
  uint64_t bytes_in;   /* gradient bytes received */
  uint64_t bytes_out;  /* parameter bytes sent */
  uint64_t shm_tcp_frames; /* its frames of tensor data, either way, that
                              went over TCP although it has a shared-memory
                              segment (no room in a ring) */
  uint64_t last_count; /* closed steps it arrived last in (of >= 2 arrivals) */
  double waited_for;   /* sum over those of (its arrival - the previous one) */
  double lag_sum;      /* sum of its arrival - the step's first arrival */
  uint64_t lag_n;      /* arrivals summed there */
  Ps__WorkerSummary *summary; /* what it reported with Finish, or NULL */
} psd_telem_worker;

typedef struct psd_telem {
  int off;                   /* --telemetry off: record nothing (to measure the cost) */
  int ps_index;              /* for the records */
  FILE *file;                /* --telemetry: JSON lines, or NULL */
  uint32_t num_workers;      /* 0 until pinned: nothing recorded before */
  uint32_t num_ps;           /* servers in the job: bytes per ps */
  psd_telem_slot *slots;     /* nslots open steps, by step % nslots */
  uint32_t nslots;           /* PSD_TELEM_SLOTS or fewer (many workers) */
  double *cells;             /* nslots x num_workers arrival times */
  psd_telem_worker *workers; /* num_workers entries */
  double *agg_hist;          /* PSD_TELEM_HIST closed steps' agg seconds */
  uint64_t closed;           /* steps closed so far */
  uint64_t stale;            /* stale gradients seen in closed steps */
  double mono0, unix0;       /* both clocks at init, to date records */
} psd_telem;

/* path: --telemetry file, "" (none) or "off" (disabled). The file is opened
 * through common/wfile.h (0600, links refused). 0, or -1 with err. */
int psd_telem_init(psd_telem *t, int ps_index, int num_ps, const char *path, char *err,
                   size_t errlen);
/* The job's worker count is known: size the arrays. 0 or PS_ENOMEM. */
int psd_telem_pin(psd_telem *t, uint32_t num_workers);
/* Closes the open steps, writes them, frees everything. */
void psd_telem_free(psd_telem *t);

/* Worker w's Push or TablePush for `step` was read completely: its data
 * had arrived at `at`, it carried `bytes`, aggregation/optimizer took agg
 * seconds, and `stale` of its gradients (slices, or the table push) were
 * dropped. */
void psd_telem_push(psd_telem *t, int w, uint64_t step, double at, uint64_t bytes,
                    double agg, uint32_t stale);
/* A frame of worker w's tensor data went over TCP although it has a
 * shared-memory segment. */
static inline void psd_telem_shm_tcp(psd_telem *t, int w) {
  if (w >= 0 && (uint32_t)w < t->num_workers) t->workers[w].shm_tcp_frames++;
}
/* bytes of parameters were queued to worker w. */
static inline void psd_telem_sent(psd_telem *t, int w, uint64_t bytes) {
  if (w >= 0 && (uint32_t)w < t->num_workers) t->workers[w].bytes_out += bytes;
}
/* Worker w finished and sent its own summary (may be NULL). */
void psd_telem_finish(psd_telem *t, int w, const Ps__WorkerSummary *s);
/* Closes every open step (end of the run). */
void psd_telem_close_all(psd_telem *t);

/* What the summary and Stats report besides telemetry's own numbers. */
typedef struct psd_telem_view {
  const char *server_id;    /* --name */
  double uptime_s;          /* seconds since psd started */
  const psd_job *job;       /* workers and their states */
  const psd_shard *shard;   /* steps, slices, bytes held, stale gradients */
} psd_telem_view;

/* The end-of-run table (text), to f. */
void psd_telem_print_summary(psd_telem *t, const psd_telem_view *v, FILE *f);
/* Fills r (whose workers array is allocated here: free it with
 * psd_telem_stats_free) with the counters. 0 or PS_ENOMEM. */
int psd_telem_stats(psd_telem *t, const psd_telem_view *v, Ps__StatsReply *r);
void psd_telem_stats_free(Ps__StatsReply *r);

#endif
