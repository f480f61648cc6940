/* admit.c - admission by probability or by count (admit.h). */
#include "admit.h"

#include <stdlib.h>
#include <string.h>

#include "wire.h"

/* Count-min sketch: rows of counters (4: the estimate's error bound holds
 * with probability 1 - e^-4), each at least this wide (a small table still
 * gets a sketch whose collisions are rare). */
#define SKETCH_ROWS 4u
#define SKETCH_MIN_WIDTH 1024u
/* The sketch's counts halve after this many keys pulled (sightings of
 * stored keys too) per counter of a row: TinyLFU's sample of 10 x its
 * width. So a key sighted a few times long ago is not admitted by one
 * stray sighting, and the counters never stay saturated. */
#define SKETCH_SAMPLE_PER_WIDTH 10u
/* The generator's state at the front of the state bytes, then (with a
 * sketch) the keys pulled since its counts last halved, then the sketch.
 * Checkpoints before the count (0.2.7) hold the generator and the sketch. */
#define RNG_BYTES sizeof(uint64_t)
#define SINCE_BYTES sizeof(uint64_t)
/* Salts that make the generator and the sketch's two hashes streams of
 * their own (not the initializer's, not ps__table_shard's). */
#define ADMIT_RNG_SALT 0x6a09e667f3bcc909ULL
#define SKETCH_SALT_A 0xbb67ae8584caa73bULL
#define SKETCH_SALT_B 0x3c6ef372fe94f82bULL

/* Sightings are counted only to admit at the N-th, N > 1. */
static int counts_sightings(const psd_table_spec *s) {
  return s->admit_prob == 0.0 && s->admit_count > 1;
}

/* The sketch's width: a power of two >= capacity, >= SKETCH_MIN_WIDTH. */
static uint64_t sketch_width(const psd_table_spec *s) {
  uint64_t w = SKETCH_MIN_WIDTH;
  while (w < s->capacity && w <= UINT64_MAX / 2) w *= 2;
  return w;
}

uint64_t psd_admit_bytes(const psd_table_spec *s) {
  if (!counts_sightings(s)) return RNG_BYTES;
  const uint64_t w = sketch_width(s);
  if (w > (UINT64_MAX - RNG_BYTES - SINCE_BYTES) / SKETCH_ROWS) return UINT64_MAX;
  return RNG_BYTES + SINCE_BYTES + SKETCH_ROWS * w;
}

int psd_admit_init(psd_admit *a, const psd_table_spec *s, uint64_t salt) {
  *a = (psd_admit){.prob = s->admit_prob, .count = s->admit_count};
  const uint64_t len = psd_admit_bytes(s);
  if (len > SIZE_MAX || !(a->state = calloc(1, (size_t)len))) return PS_ENOMEM;
  a->len = (size_t)len;
  if (counts_sightings(s)) {
    a->sketch = a->state + RNG_BYTES + SINCE_BYTES;
    a->mask = sketch_width(s) - 1;
  }
  const uint64_t seed = ps__mix64(salt ^ ADMIT_RNG_SALT);
  memcpy(a->state, &seed, sizeof seed);
  return 0;
}

void psd_admit_free(psd_admit *a) {
  free(a->state);
  *a = (psd_admit){0};
}

/* The generator: splitmix64 over the state's first bytes. */
static uint64_t rng_next(psd_admit *a) {
  uint64_t x;
  memcpy(&x, a->state, sizeof x);
  x += 0x9e3779b97f4a7c15ULL;
  memcpy(a->state, &x, sizeof x);
  return ps__mix64(x);
}

/* Counts a sighting of key (conservative update: only the counters at the
 * minimum grow, so a key's estimate stays >= its true count and collisions
 * inflate it less) and returns its estimated sightings, saturating. */
static uint32_t sketch_sight(psd_admit *a, uint64_t key) {
  /* Double hashing gives SKETCH_ROWS independent-enough positions. */
  const uint64_t h1 = ps__mix64(key ^ SKETCH_SALT_A);
  const uint64_t h2 = ps__mix64(key ^ SKETCH_SALT_B) | 1;
  const uint64_t w = a->mask + 1;
  uint8_t *c[SKETCH_ROWS];
  uint8_t min = UINT8_MAX;
  for (uint32_t r = 0; r < SKETCH_ROWS; r++) {
    c[r] = a->sketch + r * w + ((h1 + r * h2) & a->mask);
    if (*c[r] < min) min = *c[r];
  }
  if (min == UINT8_MAX) return UINT8_MAX;
  for (uint32_t r = 0; r < SKETCH_ROWS; r++)
    if (*c[r] == min) (*c[r])++;
  return (uint32_t)min + 1;
}

int psd_admit_key(psd_admit *a, uint64_t key) {
  if (a->prob > 0.0) return (double)(rng_next(a) >> 11) * 0x1p-53 < a->prob;
  if (!a->sketch) return 1;
  return sketch_sight(a, key) >= a->count;
}

/* Past the sample (SKETCH_SAMPLE_PER_WIDTH x width since the last time),
 * every counter halves. Called at the end of a pull, so the halving
 * falls between pulls, the same on a resumed run. */
void psd_admit_age(psd_admit *a, size_t n) {
  if (!a->sketch) return;
  uint64_t since;
  memcpy(&since, a->state + RNG_BYTES, sizeof since);
  const uint64_t w = a->mask + 1;
  since += n;
  if (since >= SKETCH_SAMPLE_PER_WIDTH * w) {
    for (uint64_t i = 0; i < SKETCH_ROWS * w; i++) a->sketch[i] >>= 1;
    since = 0;
  }
  memcpy(a->state + RNG_BYTES, &since, sizeof since);
}

const void *psd_admit_state(const psd_admit *a, size_t *len) {
  *len = a->len;
  return a->state;
}

int psd_admit_restore(psd_admit *a, const void *state, size_t len) {
  if (a->sketch && len == a->len - SINCE_BYTES) {
    /* A checkpoint from before the sketch aged (0.2.7): no count kept. */
    memcpy(a->state, state, RNG_BYTES);
    memset(a->state + RNG_BYTES, 0, SINCE_BYTES);
    memcpy(a->sketch, (const uint8_t *)state + RNG_BYTES, len - RNG_BYTES);
    return 0;
  }
  if (len != a->len) return PS_EINVAL;
  memcpy(a->state, state, len);
  return 0;
}
