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

struct psd_server;
struct psd_conn;

/* A worker's connection was bound to its index: bounds its receive buffer
 * to --recv-buffer if pushes are paced. */
void psd_pace_joined(struct psd_server *srv, struct psd_conn *c);
/* 1 if c should not be read for now; it is then paused (its read event
 * removed) until psd_pace_resume finds it may go on. */
int psd_pace_hold(struct psd_server *srv, struct psd_conn *c);
/* Resumes the paused connections that are no longer ahead. Called after
 * any push progress, and when a connection closes. */
void psd_pace_resume(struct psd_server *srv);

#endif
