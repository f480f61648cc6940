/* admit.h - which keys of a table get a row: admission by probability
 * (a generator) or by count (a count-min sketch of sightings whose
 * counts halve with time, TinyLFU's way). Its state is one block of
 * bytes, saved and restored whole with the table (checkpoints). */
#ifndef PSD_SPARSE_ADMIT_H
#define PSD_SPARSE_ADMIT_H

#include <stddef.h>
#include <stdint.h>

#include "tablespec.h"

typedef struct psd_admit {
  double prob;           /* admit with this probability (> 0), or */
  uint32_t count;        /* at this many sightings (> 1 with a sketch) */
  uint8_t *state;        /* the generator, then the keys pulled since the
                            counts last halved and the sketch */
  size_t len;            /* bytes of state */
  uint8_t *sketch;       /* rows of width counters, or NULL (no counting) */
  uint64_t mask;         /* the sketch's width - 1 (a power of two) */
} psd_admit;

/* Bytes of a spec's admission state (saturates at UINT64_MAX). */
uint64_t psd_admit_bytes(const psd_table_spec *s);
/* The state of a new table, its generator seeded from salt. 0 or
 * PS_ENOMEM; psd_admit_free frees it either way. */
int psd_admit_init(psd_admit *a, const psd_table_spec *s, uint64_t salt);
void psd_admit_free(psd_admit *a);
/* A sighting of a key with no row: whether to store it now. */
int psd_admit_key(psd_admit *a, uint64_t key);
/* n more keys pulled (every sighting ages the sketch). */
void psd_admit_age(psd_admit *a, size_t n);
/* The state to checkpoint: len bytes. */
const void *psd_admit_state(const psd_admit *a, size_t *len);
/* Restores a checkpoint's state (this version's or 0.2.7's, which kept
 * no count of keys since the halving). 0, or PS_EINVAL (another size). */
int psd_admit_restore(psd_admit *a, const void *state, size_t len);

#endif
