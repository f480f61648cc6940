/*
 * server.h - psd's event loop: the listener, signals, the periodic timer
 * (connection timeouts, pull deadlines, stalls, checkpoint timers, the
 * grace period) and exiting.
 *
 * Layering of psd's files (a file includes and calls only files below it;
 * upward calls go through hooks: psd_conn_hooks, psd_handlers.finish, the
 * shard's detach hook, pace's progress accessor; docs/architecture.md):
 *
 *   psd.c
 *   server      loop, listener, signals, timers
 *   handlers    what each message does (admission via job, pulls via
 *   replies     waiters and replies, checkpoints via persist/, stats via
 *               telemetry); replies builds the PullReplies
 *   tables      TABLE_* frames: sparse tables (sparse/), parked table pulls
 *   persist/    checkpoints: persist, ckptq, checkpoint, ckpttable, ckptdir
 *   shmgate     shared-memory handovers (a unix socket; attaches segments to conns)
 *   conn        framing, the HEADER/META/DATA/CLOSING machine, replies out
 *   telemetry  job  mungeq  shard
 *   sparse/     the table store: table, rowopt, rowinit, keyindex, tablespec
 *   config  average  pace  waiters  bg  optimizer  memlimit  psdlog
 *               (and the wire layer)
 */
#ifndef PSD_SERVER_H
#define PSD_SERVER_H

#include <stdint.h>

#include "config.h"
#include "conn.h"
#include "handlers.h"
#include "tables.h"
#include "job.h"
#include "pace.h"
#include "par.h"
#include "persist/persist.h"
#include "shmgate.h"
#include "shard.h"
#include "telemetry.h"
#include "waiters.h"

struct event_base;
struct event;

typedef struct psd_server {
  psd_config *cfg;             /* options (not owned) */
  struct event_base *base;     /* libevent loop */
  int lfd;                     /* listening socket */
  struct event *listen_ev;     /* accept readiness */
  struct event *tick_ev;       /* periodic timer for deadlines and stalls */
  struct event *sig_ev[3];     /* SIGTERM, SIGINT, SIGUSR1 */
  struct event *ckpt_ev;       /* the checkpoint writer has results */
  psd_mungeq *mungeq;          /* MUNGE checks off the loop (--munge) */
  struct event *munge_ev;      /* ... which have answers */
  psd_shard shard;             /* variables held here */
  psd_tables tables;           /* sparse tables held here */
  psd_par *par;                /* helper threads for big table requests */
  psd_telem telem;             /* per-step telemetry (telemetry.c) */
  psd_job job;                 /* admission, workers' states, exit decision */
  psd_waiters waiters;         /* parked pulls, deadlines, ready lists */
  psd_persist persist;         /* checkpoints, restore, stop on request */
  psd_pace pace;               /* ingress pacing (pace.c) */
  psd_conns conns;             /* every open connection (conn.c) */
  psd_shmgate shmgate;         /* shared-memory handovers (--transport) */
  psd_handlers h;              /* the message layer's view of the above */
  int exit_code;               /* set when the loop should end */
  int exiting;                 /* draining replies before exit */
  double exiting_since;        /* when draining began */
  int accept_paused;           /* listener off until the next tick (EMFILE) */
  double accept_warned_at;     /* last "accept failed" log line */
} psd_server;

/* Opens the listener (and port file) and sets up the loop. 0 or -1 (logged). */
int psd_server_init(psd_server *srv, psd_config *cfg);
/* Runs until every worker is done, a fatal condition, or a signal.
 * Returns the process exit status. */
int psd_server_run(psd_server *srv);
void psd_server_free(psd_server *srv);
/* Ends the loop with this exit status once queued replies drain. */
void psd_server_finish(psd_server *srv, int code);

#endif
