/*
 * placement.c - deterministic placement of variables on ps tasks.
 *
 * Every worker runs the same placer over the same variables in the same
 * order, so all of them agree on where each slice lives without talking to
 * anyone. Servers use ps__placement_check() to refuse slices the rule could
 * never have given them.
 *
 * Elements are float32 (4 bytes). A variable of more than split_threshold
 * bytes (with more than one ps) is cut into num_ps parts,
 *   part i = [floor(i*numel/num_ps), floor((i+1)*numel/num_ps)),
 * part i on ps i; any other variable goes whole to the least loaded ps
 * (lowest index on ties). Each part is then chunked into slices of
 * C = max_slice_bytes/4 elements (the last one shorter).
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "wire.h"

#define ELEM_BYTES 4u

/* Zero means the default; otherwise rounded down to a multiple of 4, at
 * least 4. */
static uint64_t norm_threshold(uint64_t t) {
  return t ? t : PS__DEFAULT_SPLIT_THRESHOLD;
}
static uint64_t norm_slice_bytes(uint64_t s) {
  if (s == 0) s = PS__DEFAULT_MAX_SLICE_BYTES;
  s -= s % ELEM_BYTES;
  return s < ELEM_BYTES ? ELEM_BYTES : s;
}

/* Elements per chunk for a (raw or normalized) max_slice_bytes. */
static uint64_t chunk_elems(uint64_t max_slice_bytes) {
  return norm_slice_bytes(max_slice_bytes) / ELEM_BYTES;
}

/* 1 if a numel-element variable is cut over the ps tasks. A byte size that
 * overflows 64 bits is certainly above any threshold. */
static int is_split(uint32_t num_ps, uint64_t threshold, uint64_t numel) {
  uint64_t bytes;
  if (num_ps <= 1) return 0;
  if (ps__mul_u64(numel, ELEM_BYTES, &bytes) != 0) return 1;
  return bytes > norm_threshold(threshold);
}

/* floor(i * numel / num_ps) without overflow (i <= num_ps). */
static uint64_t part_bound(uint64_t numel, uint32_t num_ps, uint64_t i) {
  return (uint64_t)(((unsigned __int128)i * numel) / num_ps);
}

static uint64_t ceil_div(uint64_t a, uint64_t b) {
  return a / b + (a % b != 0);
}

static uint64_t sat_add(uint64_t a, uint64_t b) {
  uint64_t r;
  return ps__add_u64(a, b, &r) != 0 ? UINT64_MAX : r;
}

/* Bytes of len elements, saturating. */
static uint64_t sat_bytes(uint64_t len) {
  uint64_t r;
  return ps__mul_u64(len, ELEM_BYTES, &r) != 0 ? UINT64_MAX : r;
}

int ps__placer_init(ps__placer *p, uint32_t num_ps, uint64_t split_threshold,
                    uint64_t max_slice_bytes) {
  if (!p) return PS_EINVAL;
  p->num_ps = 0;
  p->load = NULL;
  if (num_ps == 0) return PS_EINVAL;
  uint64_t *load = calloc(num_ps, sizeof *load);
  if (!load) return PS_ENOMEM;
  p->num_ps = num_ps;
  p->split_threshold = norm_threshold(split_threshold);
  p->max_slice_bytes = norm_slice_bytes(max_slice_bytes);
  p->load = load;
  return 0;
}

void ps__placer_free(ps__placer *p) {
  if (!p) return;
  free(p->load);
  p->load = NULL;
  p->num_ps = 0;
}

size_t ps__placer_count(const ps__placer *p, uint64_t numel) {
  if (!p || p->num_ps == 0 || numel == 0) return 0;
  uint64_t c = chunk_elems(p->max_slice_bytes);
  uint64_t total;
  if (is_split(p->num_ps, p->split_threshold, numel)) {
    total = 0;
    for (uint32_t i = 0; i < p->num_ps; i++) {
      uint64_t lo = part_bound(numel, p->num_ps, i);
      uint64_t hi = part_bound(numel, p->num_ps, (uint64_t)i + 1);
      total = sat_add(total, ceil_div(hi - lo, c));
    }
  } else {
    total = ceil_div(numel, c);
  }
  return total > SIZE_MAX ? SIZE_MAX : (size_t)total;
}

/* Appends the chunks of [lo, hi) on ps to out from *n on. */
static void emit_chunks(uint32_t ps, uint64_t lo, uint64_t hi, uint64_t c,
                        ps__slice_place *out, size_t *n) {
  uint64_t off = lo;
  while (off < hi) {
    uint64_t len = hi - off < c ? hi - off : c;
    out[*n].ps = ps;
    out[*n].offset = off;
    out[*n].length = len;
    (*n)++;
    off += len;
  }
}

size_t ps__placer_place(ps__placer *p, uint64_t numel, ps__slice_place *out,
                        size_t cap) {
  if (!p || !p->load || p->num_ps == 0) return 0;
  size_t count = ps__placer_count(p, numel);
  /* Too small a buffer: place nothing and change nothing. */
  if (count == 0 || !out || cap < count) return 0;
  uint64_t c = chunk_elems(p->max_slice_bytes);
  size_t n = 0;
  if (is_split(p->num_ps, p->split_threshold, numel)) {
    for (uint32_t i = 0; i < p->num_ps; i++) {
      uint64_t lo = part_bound(numel, p->num_ps, i);
      uint64_t hi = part_bound(numel, p->num_ps, (uint64_t)i + 1);
      emit_chunks(i, lo, hi, c, out, &n);
      p->load[i] = sat_add(p->load[i], sat_bytes(hi - lo));
    }
  } else {
    uint32_t best = 0;
    for (uint32_t i = 1; i < p->num_ps; i++)
      if (p->load[i] < p->load[best]) best = i;
    emit_chunks(best, 0, numel, c, out, &n);
    p->load[best] = sat_add(p->load[best], sat_bytes(numel));
  }
  return n;
}

int ps__placement_check(uint32_t num_ps, uint32_t ps_index,
                        uint64_t split_threshold, uint64_t max_slice_bytes,
                        uint64_t numel, uint64_t offset, uint64_t length,
                        char *err, size_t errlen) {
  if (err && errlen > 0) err[0] = '\0';
  if (num_ps == 0 || ps_index >= num_ps)
    return ps__errf(PS_ESHAPE, err, errlen, "ps index %" PRIu32 " is outside 0..%" PRIu32,
                ps_index, num_ps ? num_ps - 1 : 0);
  if (numel == 0)
    return ps__errf(PS_ESHAPE, err, errlen, "a variable of 0 elements has no slices");
  if (length == 0)
    return ps__errf(PS_ESHAPE, err, errlen,
                "slice at offset %" PRIu64 " of a %" PRIu64
                "-element variable is empty",
                offset, numel);
  uint64_t end;
  if (ps__add_u64(offset, length, &end) != 0)
    return ps__errf(PS_ESHAPE, err, errlen,
                "slice at offset %" PRIu64 " with length %" PRIu64
                " overflows",
                offset, length);
  if (end > numel)
    return ps__errf(PS_ESHAPE, err, errlen,
                "slice [%" PRIu64 ", %" PRIu64 ") runs past the end of a %" PRIu64
                "-element variable",
                offset, end, numel);

  uint64_t lo = 0, hi = numel;
  if (is_split(num_ps, split_threshold, numel)) {
    lo = part_bound(numel, num_ps, ps_index);
    hi = part_bound(numel, num_ps, (uint64_t)ps_index + 1);
    if (lo == hi)
      return ps__errf(PS_ESHAPE, err, errlen,
                  "slice [%" PRIu64 ", %" PRIu64 ") of a %" PRIu64
                  "-element variable is not a slice ps %" PRIu32
                  " holds (its part is empty)",
                  offset, end, numel, ps_index);
  }
  uint64_t c = chunk_elems(max_slice_bytes);
  if (offset < lo || end > hi || (offset - lo) % c != 0 ||
      length != (hi - offset < c ? hi - offset : c))
    return ps__errf(PS_ESHAPE, err, errlen,
                "slice [%" PRIu64 ", %" PRIu64 ") of a %" PRIu64
                "-element variable is not a slice ps %" PRIu32
                " holds (expected chunks of %" PRIu64 " elements of [%" PRIu64
                ", %" PRIu64 "))",
                offset, end, numel, ps_index, c, lo, hi);
  return 0;
}

