/* keyindex.c - linear probing with backward-shift deletion and O(1)
 * clearing by generations (keyindex.h). */
#include "keyindex.h"

#include <stdlib.h>
#include <string.h>

#include "invariant.h"

#include "wire.h"

/* MurmurHash3's 64-bit finalizer of key ^ the index's salt: full
 * avalanche, and other constants and shifts than splitmix64's
 * (ps__mix64), whose low bits choose the ps. */
static inline uint64_t kindex_hash(const psd_kindex *x, uint64_t key) {
  key ^= x->salt;
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  key ^= key >> 33;
  return key;
}

uint64_t psd_kindex_slots_for(uint64_t entries) {
  uint64_t s = PSD_KINDEX_MIN_SLOTS;
  /* entries <= s * NUM / DEN, without overflow: entries*DEN vs s*NUM. */
  uint64_t need;
  if (ps__mul_u64(entries, PSD_KINDEX_LOAD_DEN, &need) != 0) return 0;
  for (;;) {
    uint64_t room;
    if (ps__mul_u64(s, PSD_KINDEX_LOAD_NUM, &room) != 0) return 0;
    if (need <= room) return s;
    if (s > UINT64_MAX / 2) return 0;
    s *= 2;
  }
}

/* log2 of a power of two. */
static unsigned log2_u64(uint64_t v) { return (unsigned)__builtin_ctzll(v); }

/* A zeroed array of n slots (every generation 0: empty), or NULL. */
static psd_kslot *slots_alloc(uint64_t n) {
  if (n > SIZE_MAX / sizeof(psd_kslot)) return NULL;
  psd_kslot *s = calloc((size_t)n, sizeof(psd_kslot));
  ps__advise_huge(s, (size_t)n * sizeof(psd_kslot)); /* probed at random */
  return s;
}

int psd_kindex_init(psd_kindex *x) {
  memset(x, 0, sizeof *x);
  x->slots = slots_alloc(PSD_KINDEX_MIN_SLOTS);
  if (!x->slots) return PS_ENOMEM;
  x->nslots = PSD_KINDEX_MIN_SLOTS;
  x->shift = 64 - log2_u64(PSD_KINDEX_MIN_SLOTS);
  x->gen = 1;
  /* Unpredictable (libsodium); without it, at least not a constant. */
  if (ps__random(&x->salt, sizeof x->salt) != 0)
    x->salt = ps__mix64((uint64_t)(uintptr_t)x ^ (uint64_t)(ps__now() * 1e9));
  x->salt |= 1; /* never 0: a key 0 does not hash to 0 */
  return 0;
}

void psd_kindex_free(psd_kindex *x) {
  free(x->slots);
  memset(x, 0, sizeof *x);
}

uint64_t psd_kindex_bytes(const psd_kindex *x) { return x->nslots * sizeof(psd_kslot); }

uint64_t psd_kindex_home(const psd_kindex *x, uint64_t key) {
  return kindex_hash(x, key) >> x->shift;
}

uint32_t psd_kindex_find(const psd_kindex *x, uint64_t key) {
  const uint64_t mask = x->nslots - 1;
  const uint32_t gen = x->gen;
  const psd_kslot *s = x->slots;
  /* The load factor keeps an empty slot in every probe sequence. */
  for (uint64_t i = kindex_hash(x, key) >> x->shift;; i = (i + 1) & mask) {
    if (s[i].gen != gen) return PSD_KINDEX_NONE;
    if (s[i].key == key) return s[i].val;
  }
}

/* Home slots prefetched ahead of the probe: enough misses in flight to
 * cover a memory latency, not so many that the prefetches wait for line
 * buffers (measured: 8-64 perform alike on 10M keys). */
#define KINDEX_AHEAD 16
void psd_kindex_find_batch(const psd_kindex *x, const uint64_t *keys, size_t n, size_t more,
                           uint32_t *vals) {
  const uint64_t mask = x->nslots - 1;
  const uint32_t gen = x->gen;
  const psd_kslot *s = x->slots;
  uint64_t home[PSD_KINDEX_BATCH];
  PS_ASSERT(n <= PSD_KINDEX_BATCH);
  for (size_t j = 0; j < n; j++) home[j] = kindex_hash(x, keys[j]) >> x->shift;
  for (size_t j = 0; j < n && j < KINDEX_AHEAD; j++) __builtin_prefetch(&s[home[j]]);
  for (size_t j = 0; j < n; j++) {
    if (j + KINDEX_AHEAD < n) __builtin_prefetch(&s[home[j + KINDEX_AHEAD]]);
    else if (j + KINDEX_AHEAD < more) /* the next batch's first keys */
      __builtin_prefetch(&s[kindex_hash(x, keys[j + KINDEX_AHEAD]) >> x->shift]);
    uint32_t v = PSD_KINDEX_NONE;
    for (uint64_t i = home[j]; s[i].gen == gen; i = (i + 1) & mask)
      if (s[i].key == keys[j]) {
        v = s[i].val;
        break;
      }
    vals[j] = v;
  }
}

/* The first free slot of key's probe sequence (key absent). */
static uint64_t free_slot(const psd_kindex *x, uint64_t key) {
  const uint64_t mask = x->nslots - 1;
  uint64_t i = kindex_hash(x, key) >> x->shift;
  while (x->slots[i].gen == x->gen) i = (i + 1) & mask;
  return i;
}

int psd_kindex_reserve(psd_kindex *x, uint64_t entries) {
  /* Room already (every insert asks): no search for the size. nslots <
   * 2^60 here (it was allocated), so neither product overflows but a
   * huge `entries`, which the search below refuses. */
  if (entries <= UINT64_MAX / PSD_KINDEX_LOAD_DEN &&
      entries * PSD_KINDEX_LOAD_DEN <= x->nslots * PSD_KINDEX_LOAD_NUM)
    return 0;
  uint64_t want = psd_kindex_slots_for(entries);
  if (want == 0) return PS_ENOMEM;
  if (want <= x->nslots) return 0;
  psd_kslot *ns = slots_alloc(want);
  if (!ns) return PS_ENOMEM;
  psd_kindex old = *x;
  x->slots = ns;
  x->nslots = want;
  x->shift = 64 - log2_u64(want);
  x->gen = 1;
  for (uint64_t i = 0; i < old.nslots; i++) {
    if (old.slots[i].gen != old.gen) continue;
    uint64_t j = free_slot(x, old.slots[i].key);
    x->slots[j] = old.slots[i];
    x->slots[j].gen = 1;
  }
  free(old.slots);
  return 0;
}

void psd_kindex_insert(psd_kindex *x, uint64_t key, uint32_t val) {
  /* The load factor (psd_kindex_reserve) keeps an empty slot in every probe
   * sequence: without one, find and free_slot would never end. */
  PS_ASSERT(x->n + 1 < x->nslots);
  uint64_t i = free_slot(x, key);
  x->slots[i].key = key;
  x->slots[i].val = val;
  x->slots[i].gen = x->gen;
  x->n++;
}

uint32_t psd_kindex_upsert(psd_kindex *x, uint64_t key, uint32_t val_if_new, int *added) {
  const uint64_t mask = x->nslots - 1;
  psd_kslot *s = x->slots;
  uint64_t i = kindex_hash(x, key) >> x->shift;
  for (; s[i].gen == x->gen; i = (i + 1) & mask)
    if (s[i].key == key) {
      *added = 0;
      return s[i].val;
    }
  s[i].key = key;
  s[i].val = val_if_new;
  s[i].gen = x->gen;
  x->n++;
  *added = 1;
  return val_if_new;
}

void psd_kindex_set(psd_kindex *x, uint64_t key, uint32_t val) {
  const uint64_t mask = x->nslots - 1;
  for (uint64_t i = kindex_hash(x, key) >> x->shift; x->slots[i].gen == x->gen; i = (i + 1) & mask)
    if (x->slots[i].key == key) {
      x->slots[i].val = val;
      return;
    }
}

int psd_kindex_remove(psd_kindex *x, uint64_t key) {
  const uint64_t mask = x->nslots - 1;
  psd_kslot *s = x->slots;
  uint64_t i = kindex_hash(x, key) >> x->shift;
  for (;; i = (i + 1) & mask) {
    if (s[i].gen != x->gen) return 0;
    if (s[i].key == key) break;
  }
  /* Backward shift: walk the rest of the cluster; an entry whose home is
   * not cyclically inside (i, j] can move into the hole at i, which then
   * moves to j. The cluster ends at the first empty slot. */
  for (uint64_t j = (i + 1) & mask; s[j].gen == x->gen; j = (j + 1) & mask) {
    uint64_t home = kindex_hash(x, s[j].key) >> x->shift;
    if (((j - home) & mask) >= ((j - i) & mask)) {
      s[i] = s[j];
      i = j;
    }
  }
  s[i].gen = 0;
  x->n--;
  return 1;
}

void psd_kindex_clear(psd_kindex *x) {
  x->n = 0;
  if (++x->gen == 0) {
    /* 2^32 clears: old stamps could look current again; start over. */
    memset(x->slots, 0, (size_t)x->nslots * sizeof(psd_kslot));
    x->gen = 1;
  }
}

uint64_t psd_kindex_check(const psd_kindex *x) {
  const uint64_t mask = x->nslots - 1;
  uint64_t n = 0;
  for (uint64_t i = 0; i < x->nslots; i++) {
    if (x->slots[i].gen != x->gen) continue;
    n++;
    for (uint64_t j = psd_kindex_home(x, x->slots[i].key); j != i; j = (j + 1) & mask)
      if (x->slots[j].gen != x->gen) return i + 1;
    if (psd_kindex_find(x, x->slots[i].key) != x->slots[i].val) return i + 1;
  }
  return n == x->n ? 0 : x->nslots + 1;
}
