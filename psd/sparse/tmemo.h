/* tmemo.h - what one connection's last pull of a table read: its keys and
 * the row each came from, so that the push of the same keys (a training
 * step pulls its batch's rows, then pushes their gradients) finds its rows
 * without searching the key index again: one random probe per key a step
 * instead of two. Pure bookkeeping; table.c decides whether the rows still
 * hold (psd_table_epoch), tables.c what the memory may be (--max-memory). */
#ifndef PSD_SPARSE_TMEMO_H
#define PSD_SPARSE_TMEMO_H

#include <stddef.h>
#include <stdint.h>

#include "wire.h"

/* A memo never holds more keys than one TablePush carries: a pull of more
 * could never be pushed back whole, so it is not remembered. */
#define PSD_TMEMO_MAX_KEYS PS__MAX_TABLE_KEYS
/* Bytes a key takes in a memo: its key and its row. */
#define PSD_TMEMO_KEY_BYTES (sizeof(uint64_t) + sizeof(uint32_t))

typedef struct psd_tmemo {
  const void *owner;      /* the connection (compared, never followed) */
  uint64_t req;           /* the pull request the keys came in */
  uint64_t epoch;         /* psd_table_epoch before its first keys were read */
  int bad;                /* this request cannot be remembered */
  size_t n, cap;          /* keys remembered, room */
  uint64_t *keys;         /* strictly ascending across the request's pieces */
  uint32_t *rows;         /* the row each was read from */
  uint64_t clock;         /* the table's LRU clock after the request's
                             last piece, while its pieces moved it by
                             exactly their keys, one after the other
                             (psd_table_lru_clock); else 0 */
  struct psd_tmemo *next; /* the table's other connections' memos */
} psd_tmemo;

/* owner's memo in *list; if it has none, NULL, or with create a new empty
 * one (NULL when out of memory; *held grows by its size). */
psd_tmemo *psd_tmemo_get(psd_tmemo **list, const void *owner, int create, uint64_t *held);

/* Bytes psd_tmemo_add would allocate to take n keys of request req. */
uint64_t psd_tmemo_growth(const psd_tmemo *m, uint64_t req, size_t n);

/* Takes keys[0..n) (n > 0) of pull request req, read from the table at
 * epoch (a new request starts the memo over): returns where their n rows
 * go, or NULL when this request cannot be remembered (its keys do not
 * follow the last piece's, too many keys, out of memory; the memo is then
 * empty until the next request). *held follows the allocations. */
uint32_t *psd_tmemo_add(psd_tmemo *m, uint64_t req, uint64_t epoch, const uint64_t *keys,
                        size_t n, uint64_t *held);

/* The keys psd_tmemo_add took last (n of them) moved the table's LRU
 * clock from `before` to `after` as they were read. */
void psd_tmemo_touched(psd_tmemo *m, uint64_t before, uint64_t after, size_t n);

/* Request req is not remembered (psd --max-memory has no room for it):
 * m's buffers are given back too (*held shrinks), not kept for a later
 * step as after a push. */
void psd_tmemo_skip(psd_tmemo *m, uint64_t req, uint64_t *held);

/* The rows of keys[0..n) if they are exactly the keys remembered (same
 * count, same order), else NULL. *epoch gets the epoch they were read at. */
const uint32_t *psd_tmemo_match(const psd_tmemo *m, const uint64_t *keys, size_t n,
                                uint64_t *epoch);

/* The rows of request req's keys if m holds them all and n of them (a
 * push that names its pull instead of carrying its keys: they are
 * m->keys), else NULL. *epoch as psd_tmemo_match. */
const uint32_t *psd_tmemo_of_pull(const psd_tmemo *m, uint64_t req, size_t n, uint64_t *epoch);

/* Empties m after the push it served (or failed to): a step pulls anew.
 * Its buffers are kept for the next step unless far bigger than this one
 * used. */
void psd_tmemo_clear(psd_tmemo *m, uint64_t *held);

/* Frees owner's memo in *list (NULL owner: every memo). */
void psd_tmemo_forget(psd_tmemo **list, const void *owner, uint64_t *held);

#endif
