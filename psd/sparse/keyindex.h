/*
 * keyindex.h - an open-addressing map from uint64 keys to uint32 values:
 * a sparse table's key -> row index and its per-step key -> accumulator
 * slot index (table.c).
 *
 * Linear probing over a power-of-two array of (key, value, generation)
 * slots; a slot is occupied when its generation is the index's. Deletion
 * shifts the rest of the cluster back (no tombstones), so lookups never
 * slow down under churn; psd_kindex_clear empties the whole index in O(1)
 * by moving to the next generation. The home slot comes from the top bits
 * of a mix of the key that is NOT the splitmix64 finalizer ps__table_shard
 * uses: every key on one ps shares ps__mix64(key) % num_ps, and a related
 * hash would crowd them into related slots. The key is XORed with a salt
 * each index draws at random first: keys chosen to share a home under a
 * hash known in advance (the source is public) would make one cluster of
 * linear probing, every insert and lookup walking all of it.
 *
 * Callers reserve room (psd_kindex_reserve) before inserting, so an insert
 * never allocates and never fails: a table checks for memory before it
 * changes anything.
 */
#ifndef PSD_KEYINDEX_H
#define PSD_KEYINDEX_H

#include <stddef.h>
#include <stdint.h>

/* "No value": what find returns for a key that is not there (values are
 * row or slot indices, always below it). */
#define PSD_KINDEX_NONE UINT32_MAX
/* Slots of a new index: one cache line's worth of small tables, and the
 * smallest array the top-bits home computation handles (shift < 64). */
#define PSD_KINDEX_MIN_SLOTS 16u
/* Most entries per slot, as a fraction PSD_KINDEX_LOAD_NUM / _DEN (0.7):
 * linear probing's expected probe length stays under ~2 for hits and ~6
 * for misses, while the array stays below 3 slots per entry. */
#define PSD_KINDEX_LOAD_NUM 7u
#define PSD_KINDEX_LOAD_DEN 10u

typedef struct psd_kslot {
  uint64_t key; /* the key (meaningful only while gen is the index's) */
  uint32_t val; /* its value */
  uint32_t gen; /* the index's generation when written; 0: never/deleted */
} psd_kslot;

typedef struct psd_kindex {
  psd_kslot *slots; /* nslots slots */
  uint64_t nslots;  /* a power of two >= PSD_KINDEX_MIN_SLOTS */
  uint64_t n;       /* occupied slots */
  unsigned shift;   /* 64 - log2(nslots): a key's home is hash >> shift */
  uint64_t salt;    /* drawn at init: the hash mixes key ^ salt */
  uint32_t gen;     /* current generation (>= 1): other slots are empty */
} psd_kindex;

/* Slots that hold `entries` within the load factor (at least
 * PSD_KINDEX_MIN_SLOTS), or 0 when that would overflow. */
uint64_t psd_kindex_slots_for(uint64_t entries);

/* An empty index of PSD_KINDEX_MIN_SLOTS slots. 0 or PS_ENOMEM. */
int psd_kindex_init(psd_kindex *x);
void psd_kindex_free(psd_kindex *x);

/* Bytes its slot array takes. */
uint64_t psd_kindex_bytes(const psd_kindex *x);

/* The key's home slot (tests build clusters that wrap around the end). */
uint64_t psd_kindex_home(const psd_kindex *x, uint64_t key);

/* The value of key, or PSD_KINDEX_NONE. */
uint32_t psd_kindex_find(const psd_kindex *x, uint64_t key);

/* Most keys of one psd_kindex_find_batch: its home slots live on the
 * stack (2 KiB). */
#define PSD_KINDEX_BATCH 256u

/* vals[j] = psd_kindex_find(x, keys[j]) for j < n <= PSD_KINDEX_BATCH,
 * the home slots hashed once and prefetched a few keys ahead of their
 * probe, so the misses overlap (keys[n..more) follow the batch: the
 * next batch's first ones are prefetched too). */
void psd_kindex_find_batch(const psd_kindex *x, const uint64_t *keys, size_t n, size_t more,
                           uint32_t *vals);

/* Makes room for `entries` entries in all (growing by doubling, entries
 * rehashed). 0, or PS_ENOMEM (the index is unchanged). */
int psd_kindex_reserve(psd_kindex *x, uint64_t entries);

/* Inserts key (not present) with val; room must have been reserved. */
void psd_kindex_insert(psd_kindex *x, uint64_t key, uint32_t val);

/* The value of key; when absent, inserts it with val_if_new (room must have
 * been reserved for one more) and sets *added. */
uint32_t psd_kindex_upsert(psd_kindex *x, uint64_t key, uint32_t val_if_new, int *added);

/* Sets the value of key, which is present. */
void psd_kindex_set(psd_kindex *x, uint64_t key, uint32_t val);

/* Removes key by backward shift. 1 if it was there, else 0. */
int psd_kindex_remove(psd_kindex *x, uint64_t key);

/* Empties the index in O(1) (keeps its slots). */
void psd_kindex_clear(psd_kindex *x);

/* Tests: 0 when every occupied slot is reachable from its home (no empty
 * slot between them) and n matches; else the first bad slot + 1. */
uint64_t psd_kindex_check(const psd_kindex *x);

#endif
