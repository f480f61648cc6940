/*
 * persist.h - when psd checkpoints, how every ps lands on the same step,
 * restoring at start, and stopping on request (SIGTERM/SIGUSR1).
 *
 * A checkpoint at step T captures each slice the moment it holds step T
 * (at once if it already does, else right after the update that brings it
 * there) and queues it for the checkpoint writer thread (ckptq.h), which
 * reads it in place: no copy of the model is kept unless a slice changes
 * before its turn, a slice never waits, and no disk write, fsync or rename
 * runs on the event loop. A sparse table is captured at the same moments,
 * but copied at once (ckpttable.h): its rows change on pulls too, so the
 * writer could not read them later; the copy goes to the writer, which
 * keeps its buffer for the table's next copy once written. As a table
 * grows, the writer prepares (maps and faults in) a buffer big enough for
 * its next copy, so even the first copy takes the loop no page faults.
 * T is agreed either locally
 * (--checkpoint-every N: every multiple of N, the same on every ps) or by the
 * chief worker in two phases (prepare/commit, see proto/ps.proto
 * Checkpoint), which is how timed checkpoints and stops pick a step no ps
 * has passed.
 */
#ifndef PSD_PERSIST_H
#define PSD_PERSIST_H

#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "checkpoint.h"
#include "ckptq.h"
#include "config.h"
#include "shard.h"
#include "sparse/table.h"

/* --checkpoint-every files that may be on their way to the disk at once;
 * one more is skipped with a warning (see psd_persist_slice_advanced). */
#define PSD_PERSIST_MAX_WRITING 4

/* A sparse table as persistence sees it (tables.c owns the table; ids are
 * tables.c's table ids, in creation order, never removed). */
typedef struct psd_persist_tab {
  psd_table *t;             /* the table */
  uint64_t ck_gen;          /* == psd_persist.gen: in the current file */
  uint64_t read_at;         /* 1 + the table's step when it last served a
                               pull of keys (0: never): its rows are then
                               no longer exactly that step's */
} psd_persist_tab;

/* What the caller must do after a call (flags, 0: nothing). Persistence
 * never reaches into connections or the loop itself. */
enum {
  PSD_PERSIST_WAKE_ALL = 1,     /* the job stopped: answer every parked pull now */
  PSD_PERSIST_EXIT_UNSAVED = 2, /* no stop checkpoint in time: exit
                                   PSD_EXIT_NO_CHECKPOINT */
};

typedef struct psd_persist {
  const psd_config *cfg;    /* options (not owned) */
  psd_shard *shard;         /* the slices to write and restore (not owned) */
  unsigned actions;         /* PSD_PERSIST_* gathered for the current call */
  psd_ckptdir dir;          /* the verified, locked --checkpoint-dir */
  psd_ckptq *q;             /* the writer thread (NULL without a directory) */
  psd_ckptq_file *cur;      /* the file slices are being captured into, or NULL */
  uint64_t cur_step;        /* its step */
  uint32_t cur_nslices;     /* slices it promises */
  uint32_t cur_ntables;     /* tables it promises */
  uint32_t cur_written;     /* slices and tables captured into it so far */
  psd_persist_tab *tabs;    /* the tables, by id */
  uint32_t ntabs, tabs_cap; /* how many, allocated */
  uint32_t writing;         /* files handed to the writer, not yet on disk */
  uint64_t writing_step;    /* the newest of those's step */
  uint64_t gen;             /* attempt counter: a slice with ck_gen == gen
                               is in the file */
  int negotiated;           /* the chief asked for it (needs a commit) */
  int committed;            /* ... and every ps accepted */
  int stop_after;           /* the job stops once it is written */
  int stop_ready;           /* ... and the chief committed that step */
  uint64_t last_step;       /* step of the newest checkpoint written */
  int have_last;            /* last_step is valid */
  double last_at;           /* when it was written (or psd started) */
  int want_ckpt;            /* --checkpoint-secs elapsed: ask the chief */
  int stop_wanted;          /* a signal or a worker asked to stop */
  double stop_wanted_at;    /* when */
  int stopped;              /* the stop checkpoint is written: answer every
                               pull at once and let the workers finish */
  uint64_t stop_step;       /* its step */
  psd_ckpt_image restore;   /* the checkpoint restored at start */
  int restoring;            /* restore holds one */
  uint32_t claimed;         /* restore's records given to slices and tables */
} psd_persist;

/* At start: opens, verifies and locks the checkpoint directory (moving an
 * earlier run aside with --restore=none), cleans leftover temporary files
 * and loads the checkpoint to restore, if any. 0, or -1 (logged: an unsafe
 * or busy directory, a damaged, planted or mismatched checkpoint). */
int psd_persist_init(psd_persist *p, const psd_config *cfg, psd_shard *shard);
void psd_persist_free(psd_persist *p);

/* A slice was just created by a registration: fills it from the restored
 * checkpoint. 0, or a PS_E* code with err (the variable is not in the
 * checkpoint, or differs from it). */
int psd_persist_restore_slice(psd_persist *p, psd_slice *sl, char *err, size_t errlen);

/* A table was just created by a TableRegister (t: psd_table_spec_of(t) is
 * the spec the worker `who` sent, "worker 3"): fills it from the restored
 * checkpoint (rows, admission state, step, counters). 0 (also when nothing
 * is restored), or a PS_E* code with err: the table is not in the
 * checkpoint or its spec differs (PS_EMISMATCH naming the field), or the
 * record cannot be restored; the caller then destroys the table. */
int psd_persist_restore_table(psd_persist *p, psd_table *t, const char *who, char *err,
                              size_t errlen);
/* The table with the next id exists now (after restoring): checkpoints
 * include it from the next one on. 0 or PS_ENOMEM. */
int psd_persist_table_added(psd_persist *p, psd_table *t);
/* Table id is about to answer a pull of keys (its rows may change: new
 * rows, LRU order, admission counts). */
void psd_persist_table_read(psd_persist *p, uint32_t id);
/* Table id reached a new step (its push completed it): captures it if a
 * checkpoint wants that step (before any pull changes it again), and
 * starts a --checkpoint-every one. Returns PSD_PERSIST_* actions. */
unsigned psd_persist_table_advanced(psd_persist *p, uint32_t id);

/* Memory checkpoints hold beyond the model: the buffers of table copies on
 * their way to the disk, and the spare each table keeps (or is having
 * prepared) for its next copy. Counted
 * against --max-memory with the slices and the tables' reservations. */
uint64_t psd_persist_held_bytes(const psd_persist *p);

/* A slice reached a new step: captures it if a checkpoint wants that step,
 * and starts a --checkpoint-every one. Returns PSD_PERSIST_* actions. */
unsigned psd_persist_slice_advanced(psd_persist *p, psd_slice *sl);

/* The chief's Checkpoint request; fills the reply fields. Returns
 * PSD_PERSIST_* actions. */
unsigned psd_persist_request(psd_persist *p, uint64_t step, int stop, int commit,
                             protobuf_c_boolean *ok, uint64_t *max_step, char *msg,
                             size_t msglen);

/* The writer finished files (psd_persist_fd became readable): logs them,
 * and stops the job if a stop checkpoint is now on disk. Returns
 * PSD_PERSIST_* actions. */
unsigned psd_persist_poll(psd_persist *p);
/* Readable while the writer has results (-1: no checkpoint directory). */
int psd_persist_fd(const psd_persist *p);
/* sl is about to change: a record of it still waiting for the writer takes
 * its own copy of the unwritten part. */
void psd_persist_release(psd_persist *p, psd_slice *sl);

/* The chief's connection closed: drops a checkpoint it prepared but never
 * committed, so later ones are not blocked by it. */
void psd_persist_chief_left(psd_persist *p);

/* A signal (SIGTERM/SIGUSR1) or a worker (who: "worker 3") asks to stop. */
void psd_persist_stop_wanted(psd_persist *p, const char *who);

/* Whether this ps holds only mean variables (PS_OPT_MEAN) and no table:
 * each step's mean starts afresh, so a stop has nothing to save here and
 * the job's state is the workers' own (the torch.distributed backend). */
int psd_persist_stateless(const psd_persist *p);

/* The status psd exits with when a stop ends it (why: what ended it, for
 * the log): PSD_EXIT_STOPPED only once this ps's stop checkpoint is on
 * disk (p->stopped); else PSD_EXIT_NO_CHECKPOINT, logging that the job
 * cannot resume from this stop and naming the newest checkpoint this ps
 * has (written or restored), or that there is none. */
int psd_persist_stop_status(const psd_persist *p, const char *why);

/* Timers: --checkpoint-secs (once the job is pinned) and the stop
 * timeout. Returns PSD_PERSIST_* actions. */
unsigned psd_persist_tick(psd_persist *p, double now, int pinned);

/* Every worker is done: writes a final checkpoint if the last one is older.
 * Returns PSD_PERSIST_* actions. */
unsigned psd_persist_final(psd_persist *p);

/* The state every PushReply/PullReply carries. */
void psd_persist_flags(const psd_persist *p, protobuf_c_boolean *want_ckpt,
                       protobuf_c_boolean *want_stop, uint64_t *stop_step,
                       protobuf_c_boolean *stopped);

#endif
