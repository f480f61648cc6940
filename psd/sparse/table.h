/*
 * table.h - this ps's part of one sparse embedding table: rows by uint64
 * key, their per-row optimizer state, admission, eviction and the
 * SyncReplicas rule for row gradients.
 *
 * Storage: an open-addressing (linear probing, backward-shift deletion)
 * index of (key, row) pairs over contiguous, 64-byte aligned row storage:
 * each row is `dim` values followed by the optimizer's state floats, with
 * its key and (one record) its last-touch step and LRU links in parallel
 * arrays. No per-row malloc; storage grows by doubling up to `capacity`
 * rows, which is reserved (psd_table_bytes) against psd --max-memory when
 * the table is created.
 *
 * Steps: like a slice (shard.h), the table is at step s (updates applied).
 * A worker's push computed at step t < s is stale; at t == s it is summed
 * into this step's accumulator (a second index over the keys pushed this
 * step, with its own contiguous storage), once per worker; when
 * `replicas` pushes are in, every accumulated key's gradient is divided by
 * the number of pushes aggregated and applied to its row, and the table
 * moves to s+1. Async mode applies each push at once (no division) and
 * advances the step per push. A pushed key with no stored row is dropped
 * (counted): rows are created only by pulls (admission decides). So is
 * the sum of a key whose row is evicted before its step completes (at the
 * eviction): the accumulator holds only keys with stored rows, never more
 * than capacity.
 *
 * Admission: a key pulled without read_only that has no row is a
 * sighting; it becomes a row when its sightings (a count-min sketch of
 * 4 x w saturating 8-bit counters, w a power of two >= capacity, min 1024)
 * reach admit_count, or with probability admit_prob per sighting (a
 * splitmix64 generator seeded from init_seed and the name). Until then its
 * pull reads the initializer's values. Eviction: a row created when the
 * table is full evicts the least recently touched row (a pull or an update
 * touches); when the step advances, rows untouched for evict_after_steps
 * steps are evicted (oldest first, from the LRU tail). Precisely: a pull
 * touches a row at the table's current step s, an update at the step it
 * completes (sync: s, the step its gradients were computed at; async: the
 * step before the push advanced it), and a row last touched at s is
 * evicted when the table's step becomes s + evict_after_steps + 1 (it sat
 * through steps s+1 .. s+evict_after_steps untouched). With
 * evict_after_steps 1, a row pulled and updated at step 5 survives step 6
 * and goes when the table reaches 7 unless step 6 touched it.
 *
 * Initializer: row values for key k are a pure function of (init kind, a,
 * b, seed, table name, k, element index): splitmix64 counters, so every ps
 * and every worker computes the same values, and a read-only pull of an
 * unknown key needs no storage.
 *
 * Everything runs on psd's event-loop thread.
 */
#ifndef PSD_TABLE_H
#define PSD_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "ps/errno.h"
#include "ps/types.h"
#include "tablespec.h"

/* Counters (psctl, telemetry). */
typedef struct psd_table_stats {
  uint64_t rows;          /* stored rows now */
  uint64_t keys_pulled;   /* keys in pulls, all time */
  uint64_t keys_pushed;   /* keys in accepted pushes, all time */
  uint64_t hits;          /* pulled keys that had a stored row */
  uint64_t admissions;    /* rows created */
  uint64_t evictions_lru; /* rows evicted to make room */
  uint64_t evictions_ttl; /* rows evicted for age */
  uint64_t dropped;       /* pushed keys with no stored row */
  uint64_t stale;         /* pushes dropped as stale */
} psd_table_stats;

typedef struct psd_table psd_table; /* opaque: table.c */

/* Bytes a table of this spec may take at capacity (rows, state, index,
 * accumulator bound, sketch): what psd reserves against --max-memory.
 * Saturates at UINT64_MAX on overflow. */
uint64_t psd_table_bytes(const psd_table_spec *spec);

/* Creates an empty table at step 0 (nothing allocated beyond the indexes'
 * first small blocks, the per-worker record and the aux bytes: the
 * sketch, zeroed by calloc, whose pages the kernel maps only as sightings
 * touch them). num_workers sizes the per-worker push record;
 * replicas is the pushes per step (sync). Returns 0, PS_EINVAL (bad spec,
 * err says why) or PS_ENOMEM. */
int psd_table_create(const psd_table_spec *spec, uint32_t num_workers, uint32_t replicas,
                     int async_mode, psd_table **out, char *err, size_t errlen);
/* NULL is a no-op. */
void psd_table_destroy(psd_table *t);
/* Helper threads for big pulls and pushes (par.h; NULL: none, the
 * default). The results are the same either way. Not owned. */
struct psd_par;
void psd_table_set_par(psd_table *t, struct psd_par *par);

const psd_table_spec *psd_table_spec_of(const psd_table *t);
uint64_t psd_table_step(const psd_table *t);
psd_table_stats psd_table_get_stats(const psd_table *t);
/* Bytes allocated now (rows, state, index, accumulator, sketch); always
 * <= psd_table_bytes. The per-worker record (8 bytes a worker) is the
 * job's, not counted in either. */
uint64_t psd_table_bytes_now(const psd_table *t);

/* Rows of keys[0..n) (strictly ascending) into out[n * dim]. create: a key
 * with no row is a sighting and may be admitted (a new row gets the
 * initializer's values, evicting the LRU row if full); read_only (create
 * 0): nothing changes but the counters. Every stored row read is touched
 * at the current step. Returns 0 or PS_ENOMEM (growing the storage failed:
 * out holds initializer values for the rows that could not be stored). */
int psd_table_pull(psd_table *t, const uint64_t *keys, size_t n, int create, float *out);
/* As psd_table_pull, and rows_out[0..n) (NULL: not wanted) gets the row
 * each key was read from (PSD_TABLE_NO_ROW: none), for a push of the same
 * keys while psd_table_epoch stays what it was before the pull. */
int psd_table_pull_rows(psd_table *t, const uint64_t *keys, size_t n, int create, float *out,
                        uint32_t *rows_out);
#define PSD_TABLE_NO_ROW UINT32_MAX
/* Changes whenever a row may pass to another key (an eviction): rows a
 * pull read under one epoch still hold their keys while it lasts. */
uint64_t psd_table_epoch(const psd_table *t);
/* The LRU clock: it moves by one at every touch of a row, every row
 * stored or evicted and every step. A pull of n keys that all had rows
 * moves it by exactly n; if it has not moved since, touching the same
 * rows again in the same order changes nothing (psd_table_push_rows). */
uint64_t psd_table_lru_clock(const psd_table *t);
/* Pushes whose touches were skipped that way (for tests). */
uint64_t psd_table_touch_skips(const psd_table *t);

/* Worker's gradients (grads[n * dim], row i for keys[i], keys strictly
 * ascending) computed at step. Returns 1 if the table advanced (sync: this
 * push completed the step; async: always), 0 if accumulated, or PS_ESTALE
 * (step < table step: dropped), PS_EDUPLICATE (worker already pushed this
 * step), PS_EINVAL (a step the table has not reached, or worker >=
 * num_workers), PS_ENOMEM (nothing changed). Async mode, as for slices,
 * applies every push whatever its step. *dropped (may be NULL) gets the
 * keys that had no stored row. */
int psd_table_push(psd_table *t, uint32_t worker, uint64_t step, const uint64_t *keys,
                   size_t n, const float *grads, uint64_t *dropped);
/* As psd_table_push, with rows[i] the row psd_table_pull_rows read keys[i]
 * from at rows_epoch: the index is not searched again for them (a key
 * with none is). rows NULL, or an epoch that is no longer the table's:
 * every key is looked up. rows_clock: the LRU clock right after the pull
 * touched rows, which moved it by exactly n (0: unknown); while it still
 * reads so and every key has a row, the push's touches are skipped (they
 * would change nothing). */
int psd_table_push_rows(psd_table *t, uint32_t worker, uint64_t step, const uint64_t *keys,
                        size_t n, const float *grads, const uint32_t *rows, uint64_t rows_epoch,
                        uint64_t rows_clock, uint64_t *dropped);

/* Workers that have not pushed for the current step (sync): fills
 * missing[0..) up to cap and returns how many. */
uint32_t psd_table_missing(const psd_table *t, uint32_t *missing, uint32_t cap);

/* Checkpoints: calls fn for every stored row, least recently touched
 * first, with its key, values (dim floats), optimizer state
 * (psd_rowopt_state_floats floats, rowopt.h) and last-touch step. Restoring the rows
 * in that order (psd_table_restore_row) rebuilds the same LRU order, so a
 * resumed job evicts exactly what the original would have. Rows must not
 * change during the walk. */
typedef void (*psd_table_row_fn)(void *ctx, uint64_t key, const float *values,
                                 const float *state, uint64_t touched);
void psd_table_walk(const psd_table *t, psd_table_row_fn fn, void *ctx);
/* Admission state that is not rows (the sketch's counters and the
 * generator's state), for checkpoints: *len gets its byte size and the
 * return points at it (valid until the table changes). */
const void *psd_table_aux(const psd_table *t, size_t *len);
/* Restore, on a table just created (step 0, empty): the aux bytes (len
 * must match), then each row (key not present, table not full), then the
 * step and counters. 0, PS_EINVAL (wrong length, duplicate key, full) or
 * PS_ENOMEM. */
int psd_table_restore_aux(psd_table *t, const void *aux, size_t len);
int psd_table_restore_row(psd_table *t, uint64_t key, const float *values,
                          const float *state, uint64_t touched);
void psd_table_restore_step(psd_table *t, uint64_t step, const psd_table_stats *counters);

#endif
