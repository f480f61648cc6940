/* keysort.c - a table call's keys as the wire wants them: sorted (a stable
 * LSD radix sort of (key, position) pairs, O(n) per byte that differs),
 * de-duplicated, and grouped by the ps each belongs to. Pure functions:
 * this file calls no other of the client's. */
#include <string.h>

#include "client_internal.h"

/* Below this many keys an insertion sort beats the radix passes. */
#define PS__KEYSORT_SMALL 48

static void insertion_sort(ps__kp *a, size_t n) {
  for (size_t i = 1; i < n; i++) {
    ps__kp x = a[i];
    size_t j = i;
    for (; j > 0 && a[j - 1].key > x.key; j--) a[j] = a[j - 1];
    a[j] = x;
  }
}

int ps__keysort(const uint64_t *keys, size_t n, ps__kp *pairs, ps__kp *tmp) {
  /* Keys that come sorted (torch.unique's output, ids of a sorted batch)
   * need no pass: noticed while the pairs are written. */
  size_t descents = 0, ties = 0;
  for (size_t i = 0; i < n; i++) {
    pairs[i] = (ps__kp){keys[i], i};
    descents += i && keys[i] < keys[i - 1];
    ties += i && keys[i] == keys[i - 1];
  }
  if (descents == 0) return ties == 0;
  if (n < PS__KEYSORT_SMALL) {
    insertion_sort(pairs, n); /* stable: equal keys keep their order */
    return 0;
  }
  /* One pass counts every byte position; a byte all keys share needs no
   * pass (small or patterned ids skip most of the eight). */
  static const int B = 8;
  size_t cnt[8][256];
  memset(cnt, 0, sizeof cnt);
  for (size_t i = 0; i < n; i++)
    for (int b = 0; b < B; b++) cnt[b][(keys[i] >> (8 * b)) & 0xff]++;
  ps__kp *src = pairs, *dst = tmp;
  for (int b = 0; b < B; b++) {
    if (cnt[b][(keys[0] >> (8 * b)) & 0xff] == n) continue;
    size_t off = 0;
    for (int v = 0; v < 256; v++) {
      size_t k = cnt[b][v];
      cnt[b][v] = off;
      off += k;
    }
    for (size_t i = 0; i < n; i++) dst[cnt[b][(src[i].key >> (8 * b)) & 0xff]++] = src[i];
    ps__kp *t = src;
    src = dst;
    dst = t;
  }
  if (src != pairs) memcpy(pairs, src, n * sizeof *pairs);
  return 0;
}

size_t ps__key_split(const ps__kp *pairs, size_t n, uint32_t nps, size_t *first) {
  memset(first, 0, ((size_t)nps + 1) * sizeof *first);
  size_t nu = 0;
  for (size_t i = 0; i < n; i++) {
    if (i && pairs[i].key == pairs[i - 1].key) continue;
    first[ps__table_shard(pairs[i].key, nps) + 1]++;
    nu++;
  }
  for (uint32_t p = 0; p < nps; p++) first[p + 1] += first[p];
  return nu;
}

void ps__key_layout(const ps__kp *pairs, size_t n, uint32_t nps, const size_t *first,
                    size_t *next, uint64_t *keys_out, size_t *inv, size_t *grp) {
  memcpy(next, first, (size_t)nps * sizeof *next);
  size_t g = 0;
  for (size_t i = 0; i < n; i++) {
    if (i == 0 || pairs[i].key != pairs[i - 1].key) {
      g = next[ps__table_shard(pairs[i].key, nps)]++;
      if (keys_out) keys_out[g] = pairs[i].key;
      if (grp) grp[g] = i;
    }
    if (inv) inv[pairs[i].pos] = g;
  }
}
