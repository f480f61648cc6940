/*
 * tables.h - the sparse tables this ps holds, and what psd does with the
 * TABLE_* frames (docs/protocol.md 13c): registration with the memory
 * reservation, pulls (answered at once or parked until the table's step),
 * pushes (into table.c's SyncReplicas rule), parked pulls' deadlines, and
 * per-table counters for psctl. handlers.c hands TABLE_* frames here;
 * this file never calls back into handlers.c. Checkpoints (persist.c):
 * a table registered while a checkpoint is being restored gets its rows
 * from it before the reply; a table reaching a new step is offered for
 * capture before any parked pull is answered. Memory: what table requests
 * make psd hold (a pull's reply until its connection reads it, a push's
 * staged data, parked pulls' keys, every connection's unread replies and
 * staging: psd_conns_held_bytes) counts against --max-memory with the
 * variables and the tables' reservations; a request that would pass it is
 * refused with a non-fatal PS_ENOMEM naming the table, bytes and limit.
 */
#ifndef PSD_TABLES_H
#define PSD_TABLES_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "conn.h"
#include "job.h"
#include "persist/persist.h"
#include "ps.pb-c.h"
#include "shard.h"
#include "sparse/table.h"
#include "sparse/tmemo.h"
#include "telemetry.h"

/* Keys all parked TablePulls of this psd may hold: each parked pull keeps
 * its keys (up to PS__MAX_TABLE_KEYS x 8 bytes) until its step comes, one
 * per table and connection; beyond this a pull for a future step is
 * refused (PS_EBUSY), so waiting pulls cannot grow psd without bound (and
 * their keys count against --max-memory too). A sync job parks at most one
 * pull per worker and table. */
#define PSD_TABLES_MAX_PARKED_BYTES ((uint64_t)1 << 30)

/* A TablePull waiting for its table to reach min_step. */
typedef struct psd_tpull {
  psd_conn *conn;          /* who asked */
  uint64_t req;            /* its request id */
  uint64_t min_step;       /* answered once the table is there */
  double deadline;         /* PS_ETIMEDOUT after this (ps__now clock) */
  int read_only;           /* TablePull.read_only */
  uint64_t *keys;          /* its keys (owned copy; checked already) */
  size_t n;                /* how many */
  struct psd_tpull *next;  /* the table's list of parked pulls */
  int shm;                 /* TablePull.shm_reply */
} psd_tpull;

/* One table here. */
typedef struct psd_tentry {
  psd_table *t;            /* rows, state, step (table.c) */
  psd_tpull *parked;       /* pulls waiting for a later step */
  psd_tmemo *memos;        /* per connection: its last pull's rows */
  uint64_t reserved;       /* bytes reserved against --max-memory */
} psd_tentry;

typedef struct psd_tables {
  psd_tentry *v;           /* by table id */
  uint32_t n, cap;         /* used, allocated */
  uint64_t reserved;       /* sum of the entries' reservations */
  uint64_t parked_bytes;   /* keys held by parked pulls */
  uint64_t memo_bytes;     /* what the tables' memos hold (tmemo.h) */
  uint64_t *kcopy;         /* a TablePush's keys out of the push ring */
  size_t kcopy_cap;        /* entries (at most PS__MAX_TABLE_KEYS) */
  struct psd_par *par;     /* helper threads every table uses (not owned) */
  const psd_config *cfg;   /* options (--max-memory, --pull-timeout, ps index) */
  psd_job *job;            /* workers, replicas and mode once pinned */
  const psd_shard *shard;  /* the variables' bytes, for --max-memory */
  psd_persist *persist;    /* checkpoints: restore at registration, capture
                              when a table reaches a checkpoint's step */
  psd_telem *telem;        /* per-step telemetry: pushes are a step's
                              arrivals (a job of tables alone has steps) */
  unsigned actions;        /* PSD_PERSIST_* gathered since the last take */
} psd_tables;

void psd_tables_init(psd_tables *ts, const psd_config *cfg, psd_job *job,
                     const psd_shard *shard, psd_persist *persist, psd_telem *telem);
void psd_tables_free(psd_tables *ts);

/* 1 if type is a TABLE_* request this file handles. */
int psd_tables_is_table_msg(unsigned type);
/* A TABLE_* frame's protobuf part arrived on worker connection c: act on
 * it, or enter DATA for its keys (psd_conn_begin_blob). 0, or -1 if c
 * entered CLOSING. */
int psd_tables_message(psd_tables *ts, psd_conn *c, const uint8_t *meta);
/* The data part of c's TABLE_PULL/TABLE_PUSH is in c->stage: reply. */
void psd_tables_data(psd_tables *ts, psd_conn *c);
/* The job stopped (PSD_PERSIST_WAKE_ALL): answers every parked pull now,
 * at its table's step. */
void psd_tables_wake_all(psd_tables *ts);
/* c is closing: drop its parked pulls. */
void psd_tables_closed(psd_tables *ts, psd_conn *c);
/* Fails the parked pulls whose deadline passed. */
void psd_tables_expire(psd_tables *ts, double now);
/* What persistence asked for during the last calls (PSD_PERSIST_* flags,
 * for psd_handlers_act); clears them. */
unsigned psd_tables_take_actions(psd_tables *ts);
/* Bytes reserved by the tables (for the variables' --max-memory check). */
static inline uint64_t psd_tables_reserved(const psd_tables *ts) { return ts->reserved; }
/* Lowest step of any table here (UINT64_MAX with no table). */
static inline uint64_t psd_tables_min_step(const psd_tables *ts) {
  uint64_t s = UINT64_MAX;
  for (uint32_t i = 0; i < ts->n; i++)
    if (psd_table_step(ts->v[i].t) < s) s = psd_table_step(ts->v[i].t);
  return s;
}
/* StatsReply.tables: fills *out (n_out entries, malloc'd array of
 * malloc'd TableStats; psd_tables_stats_free) for psctl. 0 or PS_ENOMEM. */
int psd_tables_stats(const psd_tables *ts, Ps__TableStats ***out, size_t *n_out);
void psd_tables_stats_free(Ps__TableStats **v, size_t n);

#endif
