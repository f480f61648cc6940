/*
 * job.h - admission and the workers' lifecycle, as plain state: which
 * Hello is let in (authentication, the terms every worker must agree on,
 * pinned by the first one), each worker's state (joined, finished, lost),
 * the grace period for lost workers, the startup timeout, the wait for a
 * worker still busy after the others finished, and the decision to exit.
 * Nothing here touches a connection: functions return PS_E* codes or an
 * exit verdict that the caller acts on.
 */
#ifndef PSD_JOB_H
#define PSD_JOB_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "ps/errno.h"
#include "ps/types.h"
#include "ps.pb-c.h"

/* Exit statuses, so a launcher can tell why psd ended. */
enum {
  PSD_EXIT_OK = 0,           /* every worker finished */
  PSD_EXIT_USAGE = 64,       /* bad command line */
  PSD_EXIT_STARTUP = 65,     /* could not listen, write the port file, ... */
  PSD_EXIT_WORKER_LOST = 66, /* a needed worker left and did not come back */
  PSD_EXIT_NO_WORKERS = 67,  /* not every worker joined before the timeout */
  PSD_EXIT_WORKER_SILENT = 68, /* only with --finish-timeout: the others
                                finished and a worker stayed connected but
                                sent nothing for that long (it never called
                                ps_client_finish). Without it psd waits for
                                a connected worker however long it is silent
                                (it may be evaluating or saving) */
  PSD_EXIT_NO_CHECKPOINT = 69, /* stopped (a signal, a worker's request, the
                                chief gone) before this ps's stop checkpoint
                                was on disk, or with no --checkpoint-dir: the
                                job cannot resume from this stop, only from an
                                older checkpoint (EX_UNAVAILABLE). A launcher
                                must not requeue it as if it had been saved. */
  PSD_EXIT_STOPPED = PS_EXIT_STOPPED, /* 75 */     /* stopped on request (SIGTERM/SIGUSR1) after
                                this ps wrote its stop checkpoint (fsynced,
                                renamed): run it again to resume there
                                (EX_TEMPFAIL: "try again later") */
};

/* Verdict of the lifecycle checks: keep running, or the exit status. */
#define PSD_JOB_GO_ON (-1)

typedef struct psd_job_worker {
  int joined;               /* has ever completed a handshake */
  int finished;             /* said it is done */
  int lost;                 /* connection dropped before finishing */
  int connected;            /* has a live connection now */
  char peer[64];            /* address it connected from */
  double active_at;         /* its last message (or join): how long a
                               connected worker has been silent */
  double wait_logged_at;    /* last "waiting for worker W" line about it
                               (0: none): one every PSD_JOB_WAIT_LOG_S */
} psd_job_worker;

/* What one Hello asks for, normalized. */
typedef struct psd_job_terms {
  int admin;                /* an admin tool (psctl): nothing else applies */
  int pin;                  /* the job is not pinned yet: psd_job_pin these */
  uint32_t worker;          /* the worker index it claims */
  uint32_t num_workers;     /* workers in the job */
  uint32_t replicas;        /* gradients averaged per step */
  int async_mode;           /* asynchronous training */
  uint64_t split_threshold; /* placement inputs (normalized) */
  uint64_t max_slice_bytes;
} psd_job_terms;

/* The stop protocol's state that the exit decision depends on. */
typedef struct psd_job_stop {
  int wanted;               /* a signal or a worker asked to stop */
  int stopped;              /* the stop checkpoint is written */
  uint64_t step;            /* ... at this step */
  int stateless;            /* mean variables only: nothing to checkpoint
                               here (psd_persist_stateless) */
} psd_job_stop;

typedef struct psd_job {
  const psd_config *cfg;    /* options (not owned) */
  int pinned;               /* workers/replicas/mode/placement agreed */
  uint32_t num_workers;     /* once pinned */
  uint32_t replicas;        /* once pinned: gradients per step (sync) */
  int async_mode;           /* once pinned */
  uint64_t split_threshold; /* placement inputs, pinned by first worker */
  uint64_t max_slice_bytes; /* ... */
  psd_job_worker *workers;  /* num_workers entries once pinned */
  double started_at;        /* monotonic start time (startup timeout) */
  double lost_since;        /* when too many workers were lost (0: not) */
  double done_at;           /* when a worker had finished and every other
                               one was finished, lost or connected (0: not):
                               a connected worker's silence counts from
                               here (or its last message, if later) */
} psd_job;

void psd_job_init(psd_job *j, const psd_config *cfg, double now);
void psd_job_free(psd_job *j);

/* munge_rc of psd_job_hello when nobody checked a MUNGE credential. */
#define PSD_MUNGE_UNCHECKED 1

/* Checks a Hello: version, credentials (proof by the secret bound to sn,
 * the nonce of our Challenge on that connection; the MUNGE credential's
 * verdict, reached off the loop by mungeq.c: munge_rc 0 or a PS_E* code
 * with munge_err, or PSD_MUNGE_UNCHECKED), the job's terms and the
 * worker's state. Changes nothing. 0 (with *t filled) or a PS_E* code
 * with err. */
int psd_job_hello(const psd_job *j, const Ps__Hello *h, const uint8_t *sn, int munge_rc,
                  const char *munge_err, psd_job_terms *t, char *err, size_t errlen);
/* 1 if h is worth a MUNGE check: this server wants MUNGE and h gets past
 * every cheaper check before it (version, nonce, a credential present). */
int psd_job_wants_munge(const psd_job *j, const Ps__Hello *h);
/* Pins the job to t (the first worker's Hello). 0 or PS_ENOMEM. */
int psd_job_pin(psd_job *j, const psd_job_terms *t);
/* Undoes psd_job_pin (something else failed to follow it). */
void psd_job_unpin(psd_job *j);
/* Worker w connected from peer. Returns 1 if it had been lost (rejoined). */
int psd_job_join(psd_job *j, uint32_t w, const char *peer);
/* Worker w sent a message at now: it is not silent. */
void psd_job_active(psd_job *j, uint32_t w, double now);
/* Worker w said it is done. */
void psd_job_finished(psd_job *j, uint32_t w);
/* Worker w's connection went away, at step; finished: it had said so. */
void psd_job_left(psd_job *j, uint32_t w, int finished, uint64_t step);

/* The exit decision after a worker's state changed: PSD_JOB_GO_ON or an
 * exit status. PSD_EXIT_OK means every worker is done: write the final
 * checkpoint, then psd_job_say_done and exit. */
int psd_job_check(psd_job *j, const psd_job_stop *st);
/* Logs why psd exits with PSD_EXIT_OK. */
void psd_job_say_done(const psd_job *j);
/* Seconds between two "waiting for worker W" lines about one worker. */
#define PSD_JOB_WAIT_LOG_S 300.0

/* Timers: the lost-worker grace period (step: for its log line), the
 * startup timeout, and the wait for workers still connected after the
 * others finished: while each has been silent --stall-timeout, psd names
 * it (then every PSD_JOB_WAIT_LOG_S) and goes on waiting, since it may be
 * evaluating or saving; only with --finish-timeout does that silence end
 * the job with PSD_EXIT_WORKER_SILENT. PSD_JOB_GO_ON or an exit status. */
int psd_job_tick(psd_job *j, double now, uint64_t step);

/* "connected", "finished", "lost" or "absent" (for stats and summaries). */
const char *psd_job_worker_state(const psd_job *j, uint32_t w);
/* Workers connected now. */
uint32_t psd_job_live(const psd_job *j);

#endif
