/*
 * ps_telemetry.h - the worker's per-step telemetry: where each ps_client_step's
 * time went (compute outside the library, push, waiting for the aggregate,
 * pull) and the bytes moved to and from each ps. Always on: a fixed ring of
 * records allocated with the client, a few clock reads per step, nothing
 * allocated per step. Optionally the records go to a file as JSON lines
 * (docs/telemetry.md), written in batches. Not part of the public API.
 */
#ifndef PS_TELEMETRY_H
#define PS_TELEMETRY_H

#include <stdint.h>
#include <stdio.h>

#include "ps.pb-c.h"

/* Step records kept in memory: the summary's percentiles cover the last
 * this many steps. 4096 x (48 + 16 x num_ps) bytes is small next to any
 * model, and covers several minutes of even a 4-byte model's steps. */
#define PS__TELEM_RING 4096u
/* Records written to the telemetry file at once: one buffered write every
 * 256 steps keeps the file's cost off the steps in between. */
#define PS__TELEM_BATCH 256u

/* One ps_client_step. Times in seconds (monotonic, relative to the step). */
typedef struct ps__telem_rec {
  uint64_t step;    /* step of the parameters the gradients came from */
  double start;     /* unix time the step was entered */
  double compute;   /* since the previous step (or pull) returned */
  double push;      /* entry until every PushReply is in */
  double wait;      /* then until the first PullReply (the aggregate) */
  double pull;      /* then until the pull is complete */
  int stale;        /* the push came back stale */
} ps__telem_rec;

typedef struct ps__telem {
  int on;              /* 0: disabled ("off"), nothing recorded */
  int rank;            /* worker index, for the records */
  int num_ps;          /* servers: bytes are counted per ps */
  FILE *file;          /* JSON lines destination, or NULL */
  char path[512];      /* its name, for errors */
  ps__telem_rec *ring; /* PS__TELEM_RING records */
  uint64_t *ring_bytes;/* per record: num_ps x (push, pull) bytes */
  uint64_t n;          /* records ever made (ring index = n % RING) */
  uint64_t written;    /* records already in the file */
  uint64_t *tot;       /* num_ps x (push, pull): bytes over the run */
  uint64_t *mark;      /* the same at the current step's start */
  uint8_t *shm;        /* num_ps: 1 when tensors to that ps go through
                          shared memory (fixed at connect, so the records
                          need no per-step copy) */
  uint64_t stale_steps;/* steps whose push was stale */
  double last_exit;    /* monotonic time the library last returned */
  double enter;        /* monotonic time the current step began */
  double mono0, unix0; /* the two clocks at init, to date records */
} ps__telem;

/* spec: NULL or "" records in memory only; "off" disables; anything else
 * is a file to write JSON lines to. 0, or PS_ENOMEM / PS_EINVAL (the file
 * cannot be written) with a sentence in err. */
int ps__telem_init(ps__telem *t, const char *spec, int rank, int num_ps, char *err,
                   size_t errlen);
/* Writes what is pending and frees everything. Safe on a zeroed struct. */
void ps__telem_free(ps__telem *t);

/* n bytes went to (dir 0) or came from (dir 1) ps p. */
static inline void ps__telem_bytes(ps__telem *t, int p, int dir, uint64_t n) {
  if (t->on) t->tot[2 * p + dir] += n;
}
/* Tensors to and from ps p go through shared memory (shm 1) or TCP. */
static inline void ps__telem_transport(ps__telem *t, int p, int shm) {
  if (t->on) t->shm[p] = (uint8_t)(shm != 0);
}
/* The library is returning to the caller after a step or a pull. */
static inline void ps__telem_idle(ps__telem *t, double now) { t->last_exit = now; }
/* A step starts now. */
void ps__telem_step_begin(ps__telem *t, double now);
/* The step of `step` ends now: its push was answered at push_done, its
 * first PullReply came at first_pull (0: none). */
void ps__telem_step_end(ps__telem *t, uint64_t step, double push_done, double first_pull,
                        int stale, double now);

/* Fills the summary Finish carries (percentiles over the ring). The
 * repeated fields point into t (valid until the next call). 0 or
 * PS_ENOMEM. */
int ps__telem_summary(ps__telem *t, Ps__WorkerSummary *out);

#endif /* PS_TELEMETRY_H */
