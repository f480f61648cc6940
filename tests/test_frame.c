/* Frame header codec and error table (wire/frame.c). */
#include <check.h>
#include <fcntl.h>
#include <unistd.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ps.pb-c.h"
#include "wire.h"
#include "testutil.h"

/* ---- helpers ----------------------------------------------------------- */

/* A header with every field chosen freely (little-endian, as on the wire). */
static void raw_header(uint8_t out[PS__HEADER_SIZE], uint32_t magic,
                       uint16_t version, uint16_t type, uint32_t meta,
                       uint32_t flags, uint64_t data) {
  for (int i = 0; i < 4; i++) out[i] = (uint8_t)(magic >> (8 * i));
  out[4] = (uint8_t)version;
  out[5] = (uint8_t)(version >> 8);
  out[6] = (uint8_t)type;
  out[7] = (uint8_t)(type >> 8);
  for (int i = 0; i < 4; i++) out[8 + i] = (uint8_t)(meta >> (8 * i));
  for (int i = 0; i < 4; i++) out[12 + i] = (uint8_t)(flags >> (8 * i));
  for (int i = 0; i < 8; i++) out[16 + i] = (uint8_t)(data >> (8 * i));
}

/* Decodes a valid-magic/version header with the given fields; err gets the
 * message (poisoned first so a missing message shows). */
static int decode_fields(uint16_t type, uint32_t meta, uint32_t flags,
                         uint64_t data, int handshaken, ps__frame_header *h,
                         char *err, size_t errlen) {
  uint8_t buf[PS__HEADER_SIZE];
  raw_header(buf, PS__MAGIC, (uint16_t)PS__PROTOCOL_VERSION, type, meta, flags,
             data);
  memset(err, 0, errlen);
  return ps__header_decode(buf, handshaken, h, err, errlen);
}

/* Asserts that decoding fails with want and a message containing needle. */
#define EXPECT_REJECT(want, needle, ty, me, fl, da, hs)                        \
  do {                                                                         \
    char e_[256];                                                              \
    ps__frame_header h_;                                                       \
    int rc_ = decode_fields((ty), (me), (fl), (da), (hs), &h_, e_,             \
                            sizeof e_);                                        \
    ck_assert_msg(rc_ == (want),                                               \
                  "type %u meta %u flags %u data %llu hs %d: rc %d (%s), "     \
                  "want %d",                                                   \
                  (unsigned)(ty), (unsigned)(me), (unsigned)(fl),              \
                  (unsigned long long)(da), (hs), rc_, ps_err_name(rc_),       \
                  (want));                                                     \
    ck_assert_msg(strlen(e_) > 0, "no error message");                         \
    ck_assert_msg(strstr(e_, (needle)) != NULL,                                \
                  "message '%s' does not mention '%s'", e_, (needle));         \
  } while (0)

/* Asserts that decoding succeeds and gives the same fields back. */
#define EXPECT_ACCEPT(ty, me, da, hs)                                          \
  do {                                                                         \
    char e_[256];                                                              \
    ps__frame_header h_;                                                       \
    memset(&h_, 0xAB, sizeof h_);                                              \
    int rc_ = decode_fields((ty), (me), 0, (da), (hs), &h_, e_,                \
                            sizeof e_);                                        \
    ck_assert_msg(rc_ == 0, "type %u meta %u data %llu hs %d rejected: %s",    \
                  (unsigned)(ty), (unsigned)(me),                              \
                  (unsigned long long)(da), (hs), e_);                         \
    ck_assert_uint_eq(h_.type, (ty));                                          \
    ck_assert_uint_eq(h_.meta_len, (me));                                      \
    ck_assert_uint_eq(h_.data_len, (da));                                      \
  } while (0)

/* ---- encode / decode round trip ---------------------------------------- */

START_TEST(test_encode_layout) {
  uint8_t buf[PS__HEADER_SIZE];
  memset(buf, 0xEE, sizeof buf);
  ps__header_encode(buf, PS__MSG_PUSH, 0x01020304u, 0x1122334455667788ull);
  /* "PSD1" magic, then little-endian fields, zero flags. */
  ck_assert_int_eq(memcmp(buf, "PSD1", 4), 0);
  ck_assert_uint_eq(buf[4], PS__PROTOCOL_VERSION);
  ck_assert_uint_eq(buf[5], 0);
  ck_assert_uint_eq(buf[6], PS__MSG_PUSH);
  ck_assert_uint_eq(buf[7], 0);
  const uint8_t meta[4] = {0x04, 0x03, 0x02, 0x01};
  ck_assert_int_eq(memcmp(buf + 8, meta, 4), 0);
  const uint8_t zero[4] = {0, 0, 0, 0};
  ck_assert_int_eq(memcmp(buf + 12, zero, 4), 0);
  const uint8_t data[8] = {0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11};
  ck_assert_int_eq(memcmp(buf + 16, data, 8), 0);
}
END_TEST

START_TEST(test_roundtrip_all_types) {
  const uint32_t metas[] = {0, 1, 17, 4096, 65537, PS__MAX_META};
  const uint64_t datas[] = {0, 4, 1024, 16384, PS__MAX_DATA - 4,
                            PS__MAX_DATA};
  for (unsigned t = 1; t < PS__MSG_MAX_; t++) {
    for (size_t m = 0; m < sizeof metas / sizeof metas[0]; m++) {
      for (size_t d = 0; d < sizeof datas / sizeof datas[0]; d++) {
        uint8_t buf[PS__HEADER_SIZE];
        ps__header_encode(buf, t, metas[m], datas[d]);
        ps__frame_header h;
        memset(&h, 0xAB, sizeof h);
        char err[256] = "";
        int rc = ps__header_decode(buf, 1, &h, err, sizeof err);
        ck_assert_msg(rc == 0, "type %u (%s) meta %u data %llu: %s", t,
                      ps__msg_name(t), metas[m], (unsigned long long)datas[d],
                      err);
        ck_assert_uint_eq(h.type, t);
        ck_assert_uint_eq(h.meta_len, metas[m]);
        ck_assert_uint_eq(h.data_len, datas[d]);
      }
    }
  }
  /* Handshake types also round-trip before the handshake. */
  const unsigned pre[] = {PS__MSG_HELLO, PS__MSG_HELLO_REPLY, PS__MSG_ERROR};
  for (size_t i = 0; i < 3; i++) {
    uint8_t buf[PS__HEADER_SIZE];
    ps__header_encode(buf, pre[i], 123, 0);
    ps__frame_header h;
    char err[256] = "";
    ck_assert_msg(ps__header_decode(buf, 0, &h, err, sizeof err) == 0,
                  "%s rejected before handshake: %s", ps__msg_name(pre[i]),
                  err);
    ck_assert_uint_eq(h.type, pre[i]);
    ck_assert_uint_eq(h.meta_len, 123);
    ck_assert_uint_eq(h.data_len, 0);
  }
}
END_TEST

START_TEST(test_msg_names) {
  for (unsigned t = 1; t < PS__MSG_MAX_; t++) {
    const char *n = ps__msg_name(t);
    ck_assert_ptr_nonnull(n);
    ck_assert_uint_gt(strlen(n), 0);
    ck_assert_str_ne(n, "UNKNOWN");
    for (unsigned u = 1; u < t; u++) ck_assert_str_ne(n, ps__msg_name(u));
  }
  ck_assert_str_eq(ps__msg_name(PS__MSG_PUSH), "PUSH");
  ck_assert_str_eq(ps__msg_name(PS__MSG_HELLO), "HELLO");
  ck_assert_str_eq(ps__msg_name(0), "UNKNOWN");
  ck_assert_str_eq(ps__msg_name(PS__MSG_MAX_), "UNKNOWN");
  ck_assert_str_eq(ps__msg_name(65535), "UNKNOWN");
}
END_TEST

/* ---- rejections -------------------------------------------------------- */

START_TEST(test_bad_magic) {
  const uint32_t magics[] = {0, 0x31445351u, 0x32445350u, 0x50534431u,
                             0xFFFFFFFFu};
  for (size_t i = 0; i < sizeof magics / sizeof magics[0]; i++) {
    for (int hs = 0; hs < 2; hs++) {
      uint8_t buf[PS__HEADER_SIZE];
      raw_header(buf, magics[i], (uint16_t)PS__PROTOCOL_VERSION,
                 PS__MSG_HELLO, 10, 0, 0);
      ps__frame_header h;
      char err[256] = "";
      int rc = ps__header_decode(buf, hs, &h, err, sizeof err);
      ck_assert_msg(rc == PS_EPROTO, "magic 0x%08x: rc %d", magics[i], rc);
      ck_assert_ptr_nonnull(strstr(err, "magic"));
    }
  }
  /* An HTTP request is not a psd peer. */
  uint8_t http[PS__HEADER_SIZE];
  memcpy(http, "GET / HTTP/1.1\r\nHost: x\r\n", PS__HEADER_SIZE);
  ps__frame_header h;
  char err[256] = "";
  ck_assert_int_eq(ps__header_decode(http, 0, &h, err, sizeof err), PS_EPROTO);
  ck_assert_ptr_nonnull(strstr(err, "magic"));
}
END_TEST

START_TEST(test_bad_version) {
  const uint16_t versions[] = {0, 1, PS__PROTOCOL_VERSION + 1, 0x100, 0xFFFF};
  for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
    for (int hs = 0; hs < 2; hs++) {
      uint8_t buf[PS__HEADER_SIZE];
      raw_header(buf, PS__MAGIC, versions[i], PS__MSG_HELLO, 10, 0, 0);
      ps__frame_header h;
      char err[256] = "";
      int rc = ps__header_decode(buf, hs, &h, err, sizeof err);
      ck_assert_msg(rc == PS_EVERSION, "version %u: rc %d", versions[i], rc);
      ck_assert_ptr_nonnull(strstr(err, "version"));
    }
  }
}
END_TEST

START_TEST(test_bad_type) {
  const uint16_t types[] = {0, PS__MSG_MAX_, PS__MSG_MAX_ + 1, 0x100, 0xFFFF};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
    for (int hs = 0; hs < 2; hs++)
      EXPECT_REJECT(PS_EPROTO, "type", types[i], 0, 0, 0, hs);
  /* The last valid type is fine. */
  EXPECT_ACCEPT(PS__MSG_MAX_ - 1, 0, 0, 1);
}
END_TEST

START_TEST(test_bad_flags) {
  const uint32_t flags[] = {1, 2, 0x80000000u, 0xFFFFFFFFu};
  for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
    if (flags[i] != PS__FLAG_SHM) /* 2.4: the shared-memory flag (test_shm) */
      EXPECT_REJECT(PS_EPROTO, "flags", PS__MSG_PUSH, 8, flags[i], 16, 1);
    EXPECT_REJECT(PS_EPROTO, "flags", PS__MSG_PULL, 8, flags[i], 16, 1);
    EXPECT_REJECT(PS_EPROTO, "flags", PS__MSG_HELLO, 8, flags[i], 0, 0);
  }
}
END_TEST

START_TEST(test_too_big) {
  /* Metadata: exactly the limit passes, one more does not. */
  EXPECT_ACCEPT(PS__MSG_REGISTER, PS__MAX_META, 0, 1);
  EXPECT_REJECT(PS_ETOOBIG, "metadata", PS__MSG_REGISTER, PS__MAX_META + 1, 0,
                0, 1);
  EXPECT_REJECT(PS_ETOOBIG, "metadata", PS__MSG_PULL, 0xFFFFFFFFu, 0, 0, 1);
  /* Data: likewise, in whole 16-bit values and not. */
  EXPECT_ACCEPT(PS__MSG_PUSH, 0, PS__MAX_DATA, 1);
  EXPECT_REJECT(PS_ETOOBIG, "data", PS__MSG_PUSH, 0, 0, PS__MAX_DATA + 4, 1);
  EXPECT_REJECT(PS_ETOOBIG, "data", PS__MSG_PUSH, 0, 0, PS__MAX_DATA + 2, 1);
  EXPECT_REJECT(PS_ETOOBIG, "data", PS__MSG_PUSH, 0, 0, PS__MAX_DATA + 1, 1);
  EXPECT_REJECT(PS_ETOOBIG, "data", PS__MSG_PULL_REPLY, 0, 0, UINT64_MAX, 1);
  EXPECT_REJECT(PS_ETOOBIG, "data", PS__MSG_PULL_REPLY, 0, 0,
                (uint64_t)1 << 63, 1);
  /* Both at their limits at once. */
  EXPECT_ACCEPT(PS__MSG_PULL_REPLY, PS__MAX_META, PS__MAX_DATA, 1);
}
END_TEST

/* Data is whole 16-bit values (2.3: an item may be bfloat16 or fp16; its
 * exact length is the message handler's check, tests/test_hostile.c). */
START_TEST(test_data_not_floats) {
  const uint64_t bad[] = {1, 3, 5, 1023, PS__MAX_DATA - 1, PS__MAX_DATA - 3};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    EXPECT_REJECT(PS_EPROTO, "16-bit", PS__MSG_PUSH, 16, 0, bad[i], 1);
  EXPECT_ACCEPT(PS__MSG_PUSH, 16, 2, 1);
  EXPECT_ACCEPT(PS__MSG_PUSH, 16, 4, 1);
  EXPECT_ACCEPT(PS__MSG_PUSH, 16, 6, 1);
  EXPECT_ACCEPT(PS__MSG_PUSH, 16, PS__MAX_DATA - 2, 1);
}
END_TEST

START_TEST(test_preauth) {
  /* Only the handshake types, small and without data. */
  const unsigned ok[] = {PS__MSG_HELLO, PS__MSG_HELLO_REPLY, PS__MSG_ERROR,
                         PS__MSG_CHALLENGE};
  for (size_t i = 0; i < 4; i++) {
    EXPECT_ACCEPT(ok[i], 0, 0, 0);
    EXPECT_ACCEPT(ok[i], PS__MAX_PREAUTH_META, 0, 0);
    EXPECT_REJECT(PS_ETOOBIG, "handshake", ok[i], PS__MAX_PREAUTH_META + 1, 0,
                  0, 0);
    EXPECT_REJECT(PS_ETOOBIG, "handshake", ok[i], 16, 0, 4, 0);
    EXPECT_REJECT(PS_ETOOBIG, "handshake", ok[i], 0, 0, PS__MAX_DATA, 0);
    EXPECT_REJECT(PS_ETOOBIG, "handshake", ok[i], PS__MAX_META, 0, 0, 0);
    /* After the handshake the same frames are fine. */
    EXPECT_ACCEPT(ok[i], PS__MAX_PREAUTH_META + 1, 0, 1);
    EXPECT_ACCEPT(ok[i], 16, 4, 1);
  }
  /* Every other type is refused before the handshake, named in the
   * message, even when tiny. */
  for (unsigned t = 1; t < PS__MSG_MAX_; t++) {
    if (t == PS__MSG_HELLO || t == PS__MSG_HELLO_REPLY || t == PS__MSG_ERROR ||
        t == PS__MSG_CHALLENGE)
      continue;
    EXPECT_REJECT(PS_EPROTO, ps__msg_name(t), t, 0, 0, 0, 0);
    EXPECT_REJECT(PS_EPROTO, "handshake", t, 8, 0, 4, 0);
    EXPECT_ACCEPT(t, 8, 4, 1);
  }
  /* The 4097-byte Hello from the brief. */
  char err[256] = "";
  ps__frame_header h;
  int rc = decode_fields(PS__MSG_HELLO, 4097, 0, 0, 0, &h, err, sizeof err);
  ck_assert_int_ne(rc, 0);
  ck_assert_int_eq(rc, PS_ETOOBIG);
}
END_TEST

START_TEST(test_error_truncated) {
  /* A short error buffer still gets a NUL-terminated prefix. */
  uint8_t buf[PS__HEADER_SIZE];
  raw_header(buf, 0xDEADBEEFu, 1, 1, 0, 0, 0);
  ps__frame_header h;
  char err[8];
  memset(err, 'X', sizeof err);
  ck_assert_int_eq(ps__header_decode(buf, 1, &h, err, 4), PS_EPROTO);
  ck_assert_uint_eq(strlen(err), 3);
  ck_assert_int_eq(err[4], 'X'); /* nothing written past errlen */
}
END_TEST

/* ---- random headers ---------------------------------------------------- */

/* xorshift64*: fixed seed, the same buffers every run. */
static uint64_t rng_next(uint64_t *s) {
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545F4914F6CDD1Dull;
}

/* An independent statement of the decoding rules. */
static int reference_decode(const uint8_t *b, int hs) {
  uint32_t magic = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                   (uint32_t)b[3] << 24;
  unsigned version = b[4] | (unsigned)b[5] << 8;
  unsigned type = b[6] | (unsigned)b[7] << 8;
  uint32_t meta = (uint32_t)b[8] | (uint32_t)b[9] << 8 | (uint32_t)b[10] << 16 |
                  (uint32_t)b[11] << 24;
  uint32_t flags = (uint32_t)b[12] | (uint32_t)b[13] << 8 |
                   (uint32_t)b[14] << 16 | (uint32_t)b[15] << 24;
  uint64_t data = 0;
  for (int i = 7; i >= 0; i--) data = data << 8 | b[16 + i];
  if (magic != PS__MAGIC) return PS_EPROTO;
  if (version != PS__PROTOCOL_VERSION) return PS_EVERSION;
  if (type == 0 || type >= PS__MSG_MAX_) return PS_EPROTO;
  if (flags) return PS_EPROTO;
  if (!hs) {
    if (type != PS__MSG_HELLO && type != PS__MSG_HELLO_REPLY &&
        type != PS__MSG_ERROR && type != PS__MSG_CHALLENGE)
      return PS_EPROTO;
    if (meta > PS__MAX_PREAUTH_META || data) return PS_ETOOBIG;
  }
  if (meta > PS__MAX_META || data > PS__MAX_DATA) return PS_ETOOBIG;
  if (data % 2) return PS_EPROTO;
  return 0;
}

START_TEST(test_random_headers) {
  uint64_t seed = 0x9E3779B97F4A7C15ull ^ tu_seed("frame: random headers");
  int accepted = 0, deep = 0;
  for (int i = 0; i < 10000; i++) {
    uint8_t buf[PS__HEADER_SIZE];
    for (int j = 0; j < (int)PS__HEADER_SIZE; j += 8) {
      uint64_t r = rng_next(&seed);
      for (int k = 0; k < 8; k++) buf[j + k] = (uint8_t)(r >> (8 * k));
    }
    /* Most buffers get the right magic and version (and often small, sane
     * fields) so that the checks past them are reached too. */
    unsigned mode = (unsigned)(rng_next(&seed) % 8);
    if (mode >= 2) {
      memcpy(buf, "PSD1", 4);
      buf[4] = (uint8_t)PS__PROTOCOL_VERSION;
      buf[5] = 0;
    }
    if (mode >= 4) {
      buf[6] = (uint8_t)(buf[6] % (PS__MSG_MAX_ + 1));
      buf[7] = 0;
      memset(buf + 12, 0, 4);                     /* flags */
      buf[10] = (uint8_t)(buf[10] & 0x1F);        /* meta up to ~2 MiB */
      buf[11] = 0;
      if (mode >= 6) buf[9] &= 0x1F;              /* meta < 8 KiB */
      memset(buf + 20, 0, 4);                     /* data < 4 GiB */
      if (mode == 7) {
        buf[16] &= 0xFE;                          /* whole 16-bit values */
        buf[19] &= 0x3F;                          /* and < 1 GiB */
      }
    }
    int hs = (int)(rng_next(&seed) & 1);
    ps__frame_header h;
    memset(&h, 0, sizeof h);
    char err[256];
    memset(err, 0, sizeof err);
    int rc = ps__header_decode(buf, hs, &h, err, sizeof err);
    int want = reference_decode(buf, hs);
    ck_assert_msg(rc == want, "buffer %d (hs %d): rc %d, expected %d (%s)", i,
                  hs, rc, want, err);
    int fits = memcmp(buf, "PSD1", 4) == 0 &&
               buf[4] == PS__PROTOCOL_VERSION && buf[5] == 0;
    if (rc == 0) {
      ck_assert_msg(fits, "buffer %d accepted with bad magic/version", i);
      ck_assert_uint_eq(h.type, buf[6] | (unsigned)buf[7] << 8);
      accepted++;
    } else {
      ck_assert_msg(rc < 0, "buffer %d: positive rc %d", i, rc);
      ck_assert_msg(strlen(err) > 0, "buffer %d: rc %d without a message", i,
                    rc);
      if (fits) deep++;
    }
  }
  /* The generator must have exercised both outcomes. */
  ck_assert_int_gt(accepted, 100);
  ck_assert_int_gt(deep, 1000);
}
END_TEST

/* ---- error table ------------------------------------------------------- */

typedef struct {
  int code;
  const char *name;
  const char *msg;
} err_entry;

static const err_entry ERRS[] = {
#define PS__T_ENTRY(name, val, msg) {PS_##name, "PS_" #name, msg},
    PS_ERRNO_MAP(PS__T_ENTRY)
#undef PS__T_ENTRY
};
#define NERRS (sizeof ERRS / sizeof ERRS[0])

START_TEST(test_error_table) {
  ck_assert_uint_ge(NERRS, 20);
  for (size_t i = 0; i < NERRS; i++) {
    const char *s = ps_strerror(ERRS[i].code);
    const char *n = ps_err_name(ERRS[i].code);
    ck_assert_ptr_nonnull(s);
    ck_assert_ptr_nonnull(n);
    ck_assert_int_lt(ERRS[i].code, 0);
    ck_assert_uint_gt(strlen(s), 0);
    ck_assert_uint_gt(strlen(n), 0);
    ck_assert_str_eq(s, ERRS[i].msg);
    ck_assert_str_eq(n, ERRS[i].name);
    ck_assert_str_ne(s, "unknown error");
    ck_assert_str_ne(n, "PS_UNKNOWN");
    ck_assert_str_ne(s, ps_strerror(PS_OK));
    for (size_t j = 0; j < i; j++) {
      ck_assert_int_ne(ERRS[i].code, ERRS[j].code);
      ck_assert_str_ne(s, ps_strerror(ERRS[j].code));
      ck_assert_str_ne(n, ps_err_name(ERRS[j].code));
    }
  }
  ck_assert_str_eq(ps_err_name(PS_OK), "PS_OK");
  ck_assert_uint_gt(strlen(ps_strerror(PS_OK)), 0);
  ck_assert_str_eq(ps_err_name(PS_ETOOBIG), "PS_ETOOBIG");
}
END_TEST

START_TEST(test_error_unknown) {
  const int unknown[] = {1, 2, 100, -22, -100, -1000, INT_MIN, INT_MAX};
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
    ck_assert_str_eq(ps_strerror(unknown[i]), "unknown error");
    ck_assert_str_eq(ps_err_name(unknown[i]), "PS_UNKNOWN");
  }
}
END_TEST

/* One frame of `data` bytes queued in place and written to /dev/null. */
static void drain_one(ps__outq *q, int fd, size_t data) {
  Ps__TablePullReply m = PS__TABLE_PULL_REPLY__INIT;
  uint8_t *d = ps__outq_frame_inline(q, PS__MSG_TABLE_PULL_REPLY, &m.base, data);
  ck_assert_ptr_nonnull(d);
  memset(d, 0x5a, data);
  ck_assert_int_eq(ps__outq_write(q, fd), 0);
  ck_assert(!ps__outq_pending(q));
}

/* keep_recent: a big buffer survives the small drains between steady
 * bursts (a table step's pull keys between pushes, a push reply between
 * pull replies: no fresh pages a step) and goes after 8 small drains in a
 * row; without keep_recent it goes at once. Was: the first small drain
 * dropped it, so every table step faulted its frame's pages in anew. */
START_TEST(test_outq_keeps_steady_bursts) {
  int fd = open("/dev/null", O_WRONLY);
  ck_assert_int_ge(fd, 0);
  const size_t big = (size_t)4 << 20, small = 100;
  ps__outq q = {0};
  q.keep_recent = 1;
  for (int round = 0; round < 3; round++) {
    drain_one(&q, fd, big);
    size_t cap = q.bufcap;
    ck_assert_uint_ge(cap, big);
    /* counted as what it last held, not its capacity (up to twice) */
    ck_assert_uint_ge(ps__outq_held(&q), big);
    ck_assert_uint_lt(ps__outq_held(&q), big + 4096);
    for (int i = 0; i < 7; i++) {
      drain_one(&q, fd, small);
      ck_assert_msg(q.bufcap == cap, "round %d: the buffer went after %d small drains", round,
                    i + 1);
    }
  }
  drain_one(&q, fd, small);
  ck_assert_msg(q.bufcap < big, "8 small drains in a row kept a %zu-byte buffer", q.bufcap);
  ck_assert_uint_eq(ps__outq_held(&q), 0);
  ps__outq_free(&q);
  ck_assert_int_eq(q.keep_recent, 1);
  ps__outq o = {0};
  drain_one(&o, fd, big);
  ck_assert_msg(o.bufcap == 0, "without keep_recent a %zu-byte buffer stayed", o.bufcap);
  ps__outq_free(&o);
  close(fd);
}
END_TEST

Suite *suite_frame(void) {
  Suite *s = suite_create("frame");
  TCase *tc = tcase_create("header");
  tcase_add_test(tc, test_encode_layout);
  tcase_add_test(tc, test_roundtrip_all_types);
  tcase_add_test(tc, test_msg_names);
  tcase_add_test(tc, test_bad_magic);
  tcase_add_test(tc, test_bad_version);
  tcase_add_test(tc, test_bad_type);
  tcase_add_test(tc, test_bad_flags);
  tcase_add_test(tc, test_too_big);
  tcase_add_test(tc, test_data_not_floats);
  tcase_add_test(tc, test_preauth);
  tcase_add_test(tc, test_error_truncated);
  tcase_add_test(tc, test_random_headers);
  tcase_add_test(tc, test_outq_keeps_steady_bursts);
  suite_add_tcase(s, tc);
  TCase *te = tcase_create("errors");
  tcase_add_test(te, test_error_table);
  tcase_add_test(te, test_error_unknown);
  suite_add_tcase(s, te);
  return s;
}
