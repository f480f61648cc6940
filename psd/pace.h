/*
 * pace.h - ingress pacing of synchronous pushes.
 *
 * In a synchronous step every slice waits for the gradient of every worker,
 * so the slowest worker's TCP flow decides when each slice can be applied
 * and its parameters sent back. TCP does not share a ps's link evenly
 * between W flows: some workers deliver their whole push early while one
 * starves, and psd then has nothing to send back until the laggard catches
 * up (docs/scaling.md). Pacing stops reading a worker's Push once it is more
 * than --pace-ahead bytes ahead of the slowest worker still pushing the same
 * step; its receive window closes, TCP backs that flow off and the link
 * goes to the flows psd is waiting for. Reading resumes as soon as the
 * laggard catches up, finishes its push or goes away.
 *
 * Workers connected over loopback are neither paced nor waited for: they
 * share no network link with the others (--pace-loopback overrides, for
 * tests). Pacing is on only in synchronous mode with every worker aggregated
 * (backup workers exist precisely so that nobody waits for the slowest) and
 * with --pace-ahead > 0. It needs a bounded receive buffer: bytes the
 * kernel has already accepted are not paced, so workers' connections get
 * --recv-buffer (SO_RCVBUF) when pacing is on; otherwise the kernel's
 * autotuning grows the buffer as one fast flow needs.
 */
#ifndef PSD_PACE_H
#define PSD_PACE_H

#include <stdint.h>

/* A worker's connection as pacing sees it (embedded in the connection). */
typedef struct psd_pace_peer {
  struct psd_pace_peer *prev, *next; /* pace's list of joined workers */
  struct psd_pace_peer *resume_next; /* psd_pace_resume's result list */
  int joined;                        /* on that list */
  int exempt;                        /* over loopback: never paced nor waited for */
  int paused;                        /* not read: ahead of the slowest */
} psd_pace_peer;

/* The connection's accessor: bytes of the current step's Push that p has
 * delivered and that step, or UINT64_MAX if p is not in a Push. */
typedef uint64_t psd_pace_progress_fn(const psd_pace_peer *p, uint64_t *step);

typedef struct psd_pace {
  uint64_t ahead;                 /* --pace-ahead bytes (0: off) */
  int loopback;                   /* --pace-loopback: pace loopback peers too */
  int recv_buf;                   /* --recv-buffer for paced connections */
  int on;                         /* the job is one pacing applies to */
  uint32_t paused;                /* peers held now */
  psd_pace_peer *peers;           /* joined workers */
  psd_pace_progress_fn *progress; /* how far a peer's Push is */
} psd_pace;

void psd_pace_init(psd_pace *pc, int ahead, int loopback, int recv_buf,
                   psd_pace_progress_fn *progress);
/* The job is pinned: pacing applies in sync mode with every worker
 * aggregated and more than one worker. */
void psd_pace_pin(psd_pace *pc, int async_mode, uint32_t replicas, uint32_t num_workers);
/* A worker's connection (socket fd, name for logs) was bound to its index:
 * bounds its receive buffer to --recv-buffer if pushes are paced. */
void psd_pace_joined(psd_pace *pc, psd_pace_peer *p, int fd, const char *name);
/* p's connection closes: it is neither paced nor waited for any more. */
void psd_pace_left(psd_pace *pc, psd_pace_peer *p);
/* 1 if p should not be read for now; it is then paused (the caller removes
 * its read event) until psd_pace_resume hands it back. */
int psd_pace_hold(psd_pace *pc, psd_pace_peer *p);
/* Unpauses the paused peers that are no longer ahead and returns them
 * (linked by resume_next) for the caller to read again. Called after any
 * push progress, and when a connection closes. */
psd_pace_peer *psd_pace_resume(psd_pace *pc);

#endif
