/*
 * waiters.h - every parked pull ("waiter") psd holds: per slice the pulls
 * waiting for it to reach a step, per connection the pulls answerable now
 * (its ready list), the connections with ready pulls (the dirty list) and
 * the pulls' deadlines, kept in a binary min-heap so expiring one costs
 * O(log n) whatever the number parked.
 *
 * A connection owns a psd_waitset (one waiter per slice it pulls); the
 * module never looks inside connections: the owner pointer is opaque.
 * One wake-up path: psd_waiters_wake (a slice advanced) and
 * psd_waiters_wake_all (the job stopped) both move waiters to their
 * set's ready list through the same function.
 */
#ifndef PSD_WAITERS_H
#define PSD_WAITERS_H

#include <stdint.h>

/* One pull of one slice by one connection. */
typedef struct psd_waiter {
  struct psd_waiter *prev, *next;   /* slice's list of parked pulls */
  struct psd_waiter *ready_next;    /* set's list of answerable pulls */
  struct psd_waitset *set;          /* the connection's set it belongs to */
  uint32_t slice_id;                /* which slice */
  uint32_t heap_at;                 /* index in the deadline heap (parked only) */
  uint64_t request_id;              /* the Pull it answers */
  uint64_t min_step;                /* answer once step >= this */
  uint32_t dtype;                   /* wire dtype of the answer (Pull.dtype, 2.3) */
  uint64_t seq;                     /* park order: ties on deadline expire in it */
  double deadline;                  /* monotonic time to give up */
  int parked;                       /* on the slice's list and in the heap */
  int ready;                        /* on the set's ready list */
} psd_waiter;

/* One connection's pulls. */
typedef struct psd_waitset {
  void *owner;                      /* the connection (opaque here) */
  psd_waiter **by_slice;            /* per slice id: its waiter, or NULL */
  uint32_t cap;                     /* entries of by_slice */
  psd_waiter *ready_head, *ready_tail; /* pulls answerable now, in order */
  struct psd_waitset *dirty_next;   /* psd_waiters' list of sets with ready pulls */
  int in_dirty;                     /* on that list */
  uint64_t expired_req;             /* last request reported expired ... */
  uint64_t expired_gen;             /* ... in this expiry pass (dedupe) */
} psd_waitset;

/* All parked pulls of the daemon. */
typedef struct psd_waiters {
  psd_waiter **parked;              /* per slice id: head of its parked list */
  uint32_t nslices;                 /* entries of parked */
  psd_waiter **heap;                /* parked waiters, min-heap by deadline */
  uint32_t heap_n, heap_cap;        /* entries used / allocated */
  uint64_t seq;                     /* park counter (tie-break) */
  uint64_t gen;                     /* expiry passes so far */
  psd_waitset *dirty;               /* sets with ready pulls to answer */
} psd_waiters;

/* Called once per expired request: w is its first waiter to expire (the
 * request's other parked waiters are dropped silently). */
typedef void psd_waiter_expired_fn(void *ctx, psd_waitset *set, const psd_waiter *w);

void psd_waiters_init(psd_waiters *ws);
void psd_waiters_free(psd_waiters *ws);

/* Makes set able to hold a waiter for slice ids below n. 0 or -1 (memory). */
int psd_waiters_set_reserve(psd_waiters *ws, psd_waitset *set, uint32_t n);
/* 1 if set's pull of slice id is being answered (on the ready list). */
int psd_waiters_set_busy(const psd_waitset *set, uint32_t slice_id);
/* A Pull of slice id (supersedes an earlier parked one): answered at once
 * if now is set, else parked until the slice reaches min_step or deadline.
 * 0 or -1 (memory). The slice id must be below the reserved size. */
int psd_waiters_pull_dtype(psd_waiters *ws, psd_waitset *set, uint32_t slice_id,
                           uint64_t request_id, uint64_t min_step, double deadline, int now,
                           uint32_t dtype);
/* The same, answered in float32. */
static inline int psd_waiters_pull(psd_waiters *ws, psd_waitset *set, uint32_t slice_id,
                                   uint64_t request_id, uint64_t min_step, double deadline,
                                   int now) {
  return psd_waiters_pull_dtype(ws, set, slice_id, request_id, min_step, deadline, now, 0);
}
/* Detaches set's ready list; the caller answers the waiters in order and
 * calls psd_waiters_answered on each. */
psd_waiter *psd_waiters_take_ready(psd_waitset *set);
/* w's reply is built: it may be pulled again. */
void psd_waiters_answered(psd_waiter *w);
/* Removes every waiter of set (its connection closes) and frees them. */
void psd_waiters_set_free(psd_waiters *ws, psd_waitset *set);

/* Slice id reached step: its waiters with min_step <= step become ready. */
void psd_waiters_wake(psd_waiters *ws, uint32_t slice_id, uint64_t step);
/* Every parked waiter becomes ready (the job stopped: no step will come). */
void psd_waiters_wake_all(psd_waiters *ws);
/* Next set with ready pulls (removed from the dirty list), or NULL. */
psd_waitset *psd_waiters_next_dirty(psd_waiters *ws);
/* Drops every parked pull whose deadline is <= now, calling fn once per
 * request. O(log n) per waiter dropped. Returns how many were dropped. */
uint32_t psd_waiters_expire(psd_waiters *ws, double now, psd_waiter_expired_fn *fn, void *ctx);
/* Earliest deadline of a parked pull, or 0 if none. */
double psd_waiters_next_deadline(const psd_waiters *ws);

#endif
