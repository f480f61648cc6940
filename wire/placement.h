/*
 * placement.h - where each slice of a variable lives: the deterministic rule
 * every worker applies alike, and the check a server makes against it.
 * Internal (ps__ names).
 */
#ifndef PS_WIRE_PLACEMENT_H
#define PS_WIRE_PLACEMENT_H

#include <stddef.h>
#include <stdint.h>

/* Where one slice of a variable lives. */
typedef struct ps__slice_place {
  uint32_t ps;      /* ps index */
  uint64_t offset;  /* first element */
  uint64_t length;  /* elements */
} ps__slice_place;

/* Deterministic placement state: every worker feeds it the same variables
 * in the same order and gets the same map without talking to anyone. */
typedef struct ps__placer {
  uint32_t num_ps;          /* ps tasks */
  uint64_t split_threshold; /* bytes above which a variable is split */
  uint64_t max_slice_bytes; /* chunk size for big parts (multiple of 4) */
  uint64_t *load;           /* bytes placed on each ps so far */
} ps__placer;

#define PS__DEFAULT_SPLIT_THRESHOLD ((uint64_t)1 << 20)
#define PS__DEFAULT_MAX_SLICE_BYTES ((uint64_t)4 << 20)

/* 0 or PS_EINVAL/PS_ENOMEM. Zero thresholds take the defaults. */
int ps__placer_init(ps__placer *p, uint32_t num_ps, uint64_t split_threshold,
                    uint64_t max_slice_bytes);
void ps__placer_free(ps__placer *p);

/* Number of slices a variable of numel elements will get (no state change). */
size_t ps__placer_count(const ps__placer *p, uint64_t numel);

/* Places the next variable: fills out[0..count) (cap must be >= count) and
 * updates the loads. Rule: a variable of more than split_threshold bytes is
 * cut into num_ps near-equal contiguous parts, part i on ps i; a smaller one
 * goes whole to the least loaded ps (lowest index on ties). Each part is then
 * chunked into slices of at most max_slice_bytes. Returns the count. */
size_t ps__placer_place(ps__placer *p, uint64_t numel, ps__slice_place *out,
                        size_t cap);

/* Server-side check that [offset, offset+length) of a numel-element
 * variable is a slice the placement rule could give ps_index. Returns 0 or
 * PS_ESHAPE with the reason in err. */
int ps__placement_check(uint32_t num_ps, uint32_t ps_index,
                        uint64_t split_threshold, uint64_t max_slice_bytes,
                        uint64_t numel, uint64_t offset, uint64_t length,
                        char *err, size_t errlen);

/* The 64-bit mix under ps__table_shard (splitmix64's finalizer). Inline,
 * as ps__table_shard: a table step calls them for every key, several
 * times. */
static inline uint64_t ps__mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

/* Sparse tables: the ps that holds `key` of any table (every table the
 * same): splitmix64's finalizer of the key modulo num_ps, so consecutive
 * or patterned ids spread evenly. psd refuses a key that is not its own. */
static inline uint32_t ps__table_shard(uint64_t key, uint32_t num_ps) {
  return num_ps <= 1 ? 0 : (uint32_t)(ps__mix64(key) % num_ps);
}

#endif /* PS_WIRE_PLACEMENT_H */
