/*
 * fuzz_handshake - the Hello checks and pinning (psd_job_hello) and what
 * an accepted handshake unlocks, against an in-process psd like fuzz_conn's
 * (2 workers; see fuzz_server.h), but one that requires a shared secret and
 * is made afresh for every input.
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
 *                  which select the seed corpus's Hello (worker 0 of 2,
 *                  with a valid proof by the shared secret: this psd
 *                  requires one; its Challenge nonce is fixed, see
 *                  FUZZ_NONCE_BYTE, so the proof is made in advance)
 *   tail, framed   repeated: a byte b < 0xf0 starts a frame: type
 *                  (1 + b % 12), meta_len (u16 LE, clipped), meta bytes,
 *                  data selector: < 0xe0: the data a Push or Init frame
 *                  needs (4 * the sum of its item counts, none for other
 *                  types), else (b & 0x1f) * 4 bytes. A byte b >= 0xf0
 *                  switches to the other of two connections; the frames
 *                  of the two are sent in the order they come here. The
 *                  second connection starts with the first one's Hello as
 *                  another worker (bits 2-3 of b: the other worker, the
 *                  same one, worker 0, worker 1), or with nothing (bit 1).
 *
 * Data bytes are made up by the harness (small finite floats). Every input
 * gets a fresh psd, so the first Hello always pins the job; the second
 * connection meets that pin, and the two workers can complete sync steps,
 * wake each other's parked pulls and update slices the other's replies
 * still reference.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_server.h"
#include "ps.pb-c.h"
#include "wire.h"

/* The shared secret this target's psd requires (fuzz_conn runs without). */
#define FUZZ_SECRET "psd-fuzz-shared-secret-0123"

/* Data bytes the framed tail may add in all (keeps each input fast). */
#define TAIL_DATA_MAX ((uint64_t)4 << 20)

/* The client nonce of every Hello, and whether the input asked for a valid
 * proof (packed_hello computes it). */
static uint8_t g_cnonce[PS__NONCE_BYTES] = {0x11, 0x22, 0x33};
static int g_prove;

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
  s = u8(r); /* proof: by the server's secret over its (fixed) nonce and
                ours, with or without the munge flag (this psd wants no
                MUNGE), or bytes from the input: short, long, or past the
                pre-handshake limit; 0xfe also drops the nonce */
  size_t clen = s < 0xb0 ? s % 16 : s < 0xf0 ? s % 48 : s == 0xff ? 4000 + u16(r) % 200 : u16(r) % 4096;
  if (s < 0xb0) clen = 0;
  for (size_t i = 0; i < clen; i++) cred[i] = u8(r);
  h->proof.data = cred;
  h->proof.len = clen;
  g_prove = s < 0xb0;
  h->munge = s >= 0xa0 && s < 0xb0;
  h->nonce.data = g_cnonce;
  h->nonce.len = s == 0xfe ? 0 : sizeof g_cnonce; /* 0xfe: no nonce at all */
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

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  fuzz_server_configure(FUZZ_SECRET, 1);
  return 0;
}

/* Packs h, with a fresh proof by the secret when the input asked for a
 * valid one (the terms, the worker among them, are part of what it
 * proves). */
static uint8_t *packed_hello(Ps__Hello *h, size_t *len) {
  static uint8_t proof[PS__MAC_BYTES];
  if (g_prove) {
    uint8_t sn[PS__NONCE_BYTES];
    memset(sn, FUZZ_NONCE_BYTE, sizeof sn);
    if (ps__auth_proof(FUZZ_SECRET, strlen(FUZZ_SECRET), PS__AUTH_CLIENT, sn, g_cnonce, h,
                       proof) != 0)
      abort();
    h->proof.data = proof;
    h->proof.len = sizeof proof;
  }
  *len = ps__hello__get_packed_size(h);
  uint8_t *p = malloc(*len ? *len : 1);
  if (!p) abort();
  ps__hello__pack(h, p);
  return p;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  reader r = {data, size, 0};
  int framed = u8(&r) & 1;
  Ps__Hello h = PS__HELLO__INIT;
  static uint8_t cred[4200];
  static char client_id[32];
  hello_from(&r, &h, cred, client_id);

  obuf out[2] = {{0}};
  fuzz_segment segs[256];
  size_t nsegs = 0;
  unsigned cur = 0, nconns = 1;
  size_t hl;
  uint8_t *hm = packed_hello(&h, &hl);
  ob_frame(&out[0], PS__MSG_HELLO, hm, hl, 0);
  free(hm);

  if (!framed) {
    if (left(&r)) memcpy(ob_grow(&out[0], left(&r)), r.p + r.off, left(&r));
  } else {
    uint64_t data_total = 0;
    size_t seg_start = 0; /* out[cur].len when the current segment began */
    while (left(&r) > 0) {
      uint8_t b = u8(&r);
      if (b >= 0xf0) {
        /* Switch connections: what came so far is one segment. */
        if (nsegs + 2 > sizeof segs / sizeof segs[0]) break;
        segs[nsegs++] = (fuzz_segment){cur, out[cur].len - seg_start};
        cur ^= 1;
        seg_start = out[cur].len;
        if (cur == 1 && nconns == 1) {
          nconns = 2;
          if (!(b & 2)) {
            /* The second connection's Hello: the first one's, as another
             * worker (or the same one, or worker 0 or 1). */
            uint32_t w0 = h.worker_index;
            unsigned v = b >> 2 & 3;
            h.worker_index = v == 0 ? w0 ^ 1 : v == 1 ? w0 : v - 2;
            hm = packed_hello(&h, &hl);
            ob_frame(&out[1], PS__MSG_HELLO, hm, hl, 0);
            free(hm);
            h.worker_index = w0;
          }
        }
        continue;
      }
      unsigned type = 1 + b % 12;
      size_t mlen = u16(&r);
      if (mlen > left(&r)) mlen = left(&r);
      const uint8_t *meta = r.p + r.off;
      r.off += mlen;
      uint8_t ds = u8(&r);
      uint64_t dlen = ds < 0xe0 ? needed_data(type, meta, mlen) : (uint64_t)(ds & 0x1f) * 4;
      if (data_total + dlen > TAIL_DATA_MAX) break;
      data_total += dlen;
      ob_frame(&out[cur], type, meta, mlen, dlen);
    }
    segs[nsegs++] = (fuzz_segment){cur, out[cur].len - seg_start};
  }
  const uint8_t *streams[2] = {out[0].p, out[1].p};
  size_t sizes[2] = {out[0].len, out[1].len};
  fuzz_server_run(streams, sizes, nconns, segs, nsegs, 0);
  free(out[0].p);
  free(out[1].p);
  return 0;
}
