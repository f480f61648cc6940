/*
 * fuzz_handshake - the Hello checks and pinning (psd_server_hello) and what
 * an accepted handshake unlocks, against the same in-process psd as
 * fuzz_conn (2 workers; see fuzz_server.h).
 *
 * The input is not sent as is. Its first bytes choose the fields of a
 * Hello, mostly valid values with a way to any other, which the harness
 * packs with ps__hello__pack into a well-formed frame. The rest follows
 * that frame either raw (byte 0 even) or as frames the harness wraps in
 * valid headers (byte 0 odd), so the fuzzer spends its time on the
 * messages rather than on framing:
 *
 *   byte 0         mode (bit 0: framed tail)
 *   Hello fields   one selector byte each, sometimes followed by a raw
 *                  value (see hello_from); exhausted input reads as zeros,
 *                  which select the seed corpus's Hello (worker 0 of 2)
 *   tail, framed   repeated: type (1 + b % 12), meta_len (u16 LE, clipped),
 *                  meta bytes, data selector: < 0xe0: the data a Push or
 *                  Init frame needs (4 * the sum of its item counts, none
 *                  for other types), else (b & 0x1f) * 4 bytes
 *
 * Data bytes are made up by the harness (small finite floats).
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_server.h"
#include "ps.pb-c.h"
#include "ps_internal.h"

/* Data bytes the framed tail may add in all (keeps each input fast). */
#define TAIL_DATA_MAX ((uint64_t)4 << 20)

typedef struct reader {
  const uint8_t *p;
  size_t n, off;
} reader;

static uint8_t u8(reader *r) { return r->off < r->n ? r->p[r->off++] : 0; }
/* Little-endian; the statements fix the order the bytes are taken in. */
static uint32_t u16(reader *r) {
  uint32_t lo = u8(r);
  return lo | (uint32_t)u8(r) << 8;
}
static uint32_t u32(reader *r) {
  uint32_t lo = u16(r);
  return lo | u16(r) << 16;
}
static uint64_t u64(reader *r) {
  uint64_t lo = u32(r);
  return lo | (uint64_t)u32(r) << 32;
}
static size_t left(const reader *r) { return r->n - r->off; }

typedef struct obuf {
  uint8_t *p;
  size_t len, cap;
} obuf;

static uint8_t *ob_grow(obuf *b, size_t n) {
  if (b->len + n > b->cap) {
    size_t nc = b->cap ? b->cap : 4096;
    while (nc < b->len + n) nc *= 2;
    uint8_t *np = realloc(b->p, nc);
    if (!np) abort();
    b->p = np;
    b->cap = nc;
  }
  uint8_t *at = b->p + b->len;
  b->len += n;
  return at;
}

static void ob_frame(obuf *b, unsigned type, const uint8_t *meta, size_t mlen, uint64_t dlen) {
  ps__header_encode(ob_grow(b, PS__HEADER_SIZE), type, (uint32_t)mlen, dlen);
  if (mlen) memcpy(ob_grow(b, mlen), meta, mlen);
  uint8_t *d = ob_grow(b, (size_t)dlen);
  for (uint64_t i = 0; i + 4 <= dlen; i += 4) {
    float f = (float)((int)(i / 4 % 9) - 4) * 0.125f;
    memcpy(d + i, &f, 4);
  }
}

/* Builds the Hello from the selector bytes (sel < 0xf0 is the common case). */
static void hello_from(reader *r, Ps__Hello *h, uint8_t *cred, char *client_id) {
  uint8_t s;
  s = u8(r);
  h->protocol_version = s < 0xf0 ? PS__PROTOCOL_VERSION : s == 0xff ? u32(r) : s & 0xf;
  s = u8(r);
  h->role = s < 0xf0 ? PS__ROLE__ROLE_WORKER : (Ps__Role)(s == 0xff ? u32(r) : s & 0xf);
  s = u8(r);
  h->worker_index = s < 0xf0 ? s & 1 : s == 0xff ? u32(r) : s & 0xf;
  s = u8(r);
  h->num_workers = s < 0xf0 ? FUZZ_WORKERS : s == 0xff ? u32(r) : s & 0xf;
  s = u8(r);
  h->num_ps = s < 0xf0 ? 1 : s == 0xff ? u32(r) : s & 0xf;
  s = u8(r);
  h->ps_index = s < 0xf0 ? 0 : s == 0xff ? u32(r) : s & 0xf;
  s = u8(r);
  h->replicas_to_aggregate = s < 0xc0 ? 0 : s == 0xff ? u32(r) : s & 3;
  s = u8(r);
  h->async_mode = s >= 0xf0;
  s = u8(r); /* credential: short, or up to past the pre-handshake limit */
  size_t clen = s < 0xf0 ? s % 48 : s == 0xff ? 4000 + u16(r) % 200 : u16(r) % 4096;
  for (size_t i = 0; i < clen; i++) cred[i] = u8(r);
  h->credential.data = cred;
  h->credential.len = clen;
  s = u8(r);
  size_t idlen = s % 24;
  for (size_t i = 0; i < idlen; i++) {
    uint8_t ch = u8(r);
    client_id[i] = (char)(ch ? ch : '_');
  }
  client_id[idlen] = '\0';
  h->client_id = client_id;
  s = u8(r);
  h->split_threshold = s < 0xc0 ? 0 : s < 0xe0 ? PS__DEFAULT_SPLIT_THRESHOLD : u64(r);
  s = u8(r);
  h->max_slice_bytes = s < 0xc0 ? 0 : s < 0xe0 ? (uint64_t)4 << (s & 0x1f) : u64(r);
}

/* Data bytes a Push or Init frame with this protobuf part must carry. */
static uint64_t needed_data(unsigned type, const uint8_t *meta, size_t mlen) {
  uint64_t total = 0;
  if (type == PS__MSG_PUSH) {
    Ps__Push *m = ps__push__unpack(NULL, mlen, meta);
    if (!m) return 0;
    for (size_t i = 0; i < m->n_items && total <= TAIL_DATA_MAX; i++) total += m->items[i]->count;
    ps__push__free_unpacked(m, NULL);
  } else if (type == PS__MSG_INIT) {
    Ps__Init *m = ps__init__unpack(NULL, mlen, meta);
    if (!m) return 0;
    for (size_t i = 0; i < m->n_items && total <= TAIL_DATA_MAX; i++) total += m->items[i]->count;
    ps__init__free_unpacked(m, NULL);
  }
  return total > TAIL_DATA_MAX / 4 ? 0 : total * 4;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  reader r = {data, size, 0};
  int framed = u8(&r) & 1;
  Ps__Hello h = PS__HELLO__INIT;
  static uint8_t cred[4200];
  static char client_id[32];
  hello_from(&r, &h, cred, client_id);

  obuf out = {0};
  size_t hl = ps__hello__get_packed_size(&h);
  uint8_t *hm = malloc(hl ? hl : 1);
  if (!hm) abort();
  ps__hello__pack(&h, hm);
  ob_frame(&out, PS__MSG_HELLO, hm, hl, 0);
  free(hm);

  if (!framed) {
    if (left(&r)) memcpy(ob_grow(&out, left(&r)), r.p + r.off, left(&r));
  } else {
    uint64_t data_total = 0;
    while (left(&r) > 0) {
      unsigned type = 1 + u8(&r) % 12;
      size_t mlen = u16(&r);
      if (mlen > left(&r)) mlen = left(&r);
      const uint8_t *meta = r.p + r.off;
      r.off += mlen;
      uint8_t ds = u8(&r);
      uint64_t dlen = ds < 0xe0 ? needed_data(type, meta, mlen) : (uint64_t)(ds & 0x1f) * 4;
      if (data_total + dlen > TAIL_DATA_MAX) break;
      data_total += dlen;
      ob_frame(&out, type, meta, mlen, dlen);
    }
  }
  fuzz_server_feed(out.p, out.len, 0);
  free(out.p);
  return 0;
}
