/*
 * server.h - psd's event loop: the listener, the workers' lifecycle
 * (joined, finished, lost), timers (stalls, pull deadlines, grace period)
 * and the decision to exit.
 */
#ifndef PSD_SERVER_H
#define PSD_SERVER_H

#include <stdint.h>

#include "config.h"
#include "job.h"
#include "persist.h"
#include "ps.pb-c.h"
#include "shard.h"
#include "telemetry.h"
#include "waiters.h"

struct event_base;
struct event;
struct psd_conn;


typedef struct psd_server {
  psd_config *cfg;             /* options (not owned) */
  struct event_base *base;     /* libevent loop */
  int lfd;                     /* listening socket */
  struct event *listen_ev;     /* accept readiness */
  struct event *tick_ev;       /* periodic timer for deadlines and stalls */
  struct event *sig_ev[3];     /* SIGTERM, SIGINT, SIGUSR1 */
  psd_shard shard;             /* variables held here */
  psd_telem telem;             /* per-step telemetry (telemetry.c) */
  psd_job job;                 /* admission, workers' states, exit decision */
  struct psd_conn *conns;      /* every open connection */
  psd_waiters waiters;         /* parked pulls, deadlines, ready lists */
  struct psd_conn *graveyard;  /* closed connections awaiting psd_server_reap */
  double started_at;           /* monotonic start time */
  int exit_code;               /* set when the loop should end */
  int exiting;                 /* draining replies before exit */
  double exiting_since;        /* when draining began */
  uint64_t logged_step;        /* last step written to the log */
  uint64_t conn_seq;           /* connection counter, for log names */
  int accept_paused;           /* listener off until the next tick (EMFILE) */
  double accept_warned_at;     /* last "accept failed" log line */
  psd_persist persist;         /* checkpoints, restore, stop on request */
  int pace_paused;             /* connections held by ingress pacing (pace.c) */
} psd_server;

/* Opens the listener (and port file) and sets up the loop. 0 or -1 (logged). */
int psd_server_init(psd_server *srv, psd_config *cfg);
/* Runs until every worker is done, a fatal condition, or a signal.
 * Returns the process exit status. */
int psd_server_run(psd_server *srv);
void psd_server_free(psd_server *srv);

/* --- used by conn.c ---------------------------------------------------- */

/* Validates a Hello and binds conn to its worker; 0 or a PS_E* code with err. */
int psd_server_hello(psd_server *srv, struct psd_conn *c, const Ps__Hello *h, char *err, size_t errlen);
/* A worker said it is done. */
void psd_server_worker_finished(psd_server *srv, struct psd_conn *c);
/* A connection is going away (after its waiters were removed). */
void psd_server_conn_closed(psd_server *srv, struct psd_conn *c);
/* A slice advanced: wakes its satisfied waiters, logs every Nth step. */
void psd_server_slice_advanced(psd_server *srv, psd_slice *sl);
/* Builds and sends replies for every connection with ready pulls. */
void psd_server_flush(psd_server *srv);
/* Frees closed connections; called at the end of every event callback,
 * when nothing up the stack still refers to them. */
void psd_server_reap(psd_server *srv);
/* Does what persistence asked for (PSD_PERSIST_* flags). */
void psd_server_act(psd_server *srv, unsigned actions);
/* Ends the loop with this exit status once queued replies drain. */
void psd_server_finish(psd_server *srv, int code);

#endif
