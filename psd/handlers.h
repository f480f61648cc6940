/*
 * handlers.h - what psd does with each message: the handshake (admission
 * by job.c, then binding the connection), Register, Init and Push (into
 * the shard), Pull (parked in waiters.c, answered by replies.c),
 * Finish, Checkpoint (persist.c) and Stats (telemetry.c). conn.c calls in
 * through psd_conn_hooks; the event loop (server.c) is reached only
 * through the finish hook, so nothing here depends on server.c.
 */
#ifndef PSD_HANDLERS_H
#define PSD_HANDLERS_H

#include <stdint.h>

#include "config.h"
#include "conn.h"
#include "job.h"
#include "mungeq.h"
#include "pace.h"
#include "persist/persist.h"
#include "shard.h"
#include "shmgate.h"
#include "tables.h"
#include "telemetry.h"
#include "waiters.h"

/* The pieces the message layer works on (owned by the server). */
typedef struct psd_handlers {
  const psd_config *cfg;    /* options */
  psd_shard *shard;         /* variables held here */
  psd_tables *tables;       /* sparse tables held here (TABLE_* frames) */
  psd_job *job;             /* admission and workers' states */
  psd_persist *persist;     /* checkpoints, restore, stop protocol */
  psd_waiters *waiters;     /* parked pulls */
  psd_telem *telem;         /* per-step telemetry */
  psd_pace *pace;           /* ingress pacing */
  psd_conns *conns;         /* every connection */
  psd_mungeq *mungeq;       /* MUNGE checks off the loop (NULL without --munge) */
  psd_shmgate *shmgate;     /* shared-memory handovers (off: TCP only) */
  /* Ends the loop with this exit status once queued replies drain. */
  void (*finish)(void *loop, int code);
  void *loop;               /* passed to finish */
  int exiting;              /* set by the loop once it is exiting: no more
                               lifecycle decisions */
  uint64_t logged_step;     /* last step written to the log */
} psd_handlers;

/* The hooks conn.c calls, with h as their context. */
void psd_handlers_hooks(psd_handlers *h, psd_conn_hooks *hooks);
/* MUNGE answers came back (psd_mungeq_fd readable): each waiting Hello is
 * admitted or refused now. */
void psd_handlers_munge_done(psd_handlers *h);
/* Does what persistence asked for (PSD_PERSIST_* flags). */
void psd_handlers_act(psd_handlers *h, unsigned actions);
/* Lowest step of any slice or table (for logs). */
uint64_t psd_handlers_step(const psd_handlers *h);

#endif
