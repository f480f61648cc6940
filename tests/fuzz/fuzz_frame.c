/*
 * fuzz_frame - the frame header codec and the protobuf part of a frame:
 * ps__header_decode (wire/frame.c) on the first 24 bytes, both
 * before and after the handshake, then every message type's protobuf-c
 * unpack function (proto/ps.proto, generated ps.pb-c.c) on the bytes that
 * follow, as psd and the client do once a whole frame has arrived.
 *
 * Checked beyond "no crash": an accepted header obeys the documented
 * limits and re-encodes to the same 24 bytes; a rejected one gets one of
 * the documented codes and a message; whatever the handshake accepts is
 * also accepted after it; a message that unpacks packs to the size it
 * announces, and a re-unpacked packing packs to the same bytes again.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_server.h" /* LLVMFuzzerTestOneInput prototype */
#include "ps.pb-c.h"
#include "wire.h"

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "fuzz_frame: check failed: %s: ", #cond); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      abort();                                             \
    }                                                      \
  } while (0)

/* pack(m) writes the size it announced, and if those bytes unpack again,
 * packing that gives the same bytes. (They need not unpack: protobuf-c
 * 1.4.1 keeps an over-long encoded tag of field 0, "80 00", as an unknown
 * field but refuses the "00" it packs it back to. psd never re-packs what
 * it receives, so that quirk is harmless here.) */
static void roundtrip(const ProtobufCMessage *m) {
  const ProtobufCMessageDescriptor *d = m->descriptor;
  size_t n = protobuf_c_message_get_packed_size(m);
  uint8_t *a = malloc(n ? n : 1);
  CHECK(a, "out of memory");
  CHECK(protobuf_c_message_pack(m, a) == n, "%s: packed size", d->name);
  ProtobufCMessage *m2 = protobuf_c_message_unpack(d, NULL, n, a);
  if (!m2) {
    free(a);
    return;
  }
  size_t n2 = protobuf_c_message_get_packed_size(m2);
  CHECK(n2 == n, "%s: repacked size %zu != %zu", d->name, n2, n);
  uint8_t *b = malloc(n2 ? n2 : 1);
  CHECK(b, "out of memory");
  CHECK(protobuf_c_message_pack(m2, b) == n2, "%s: packed size", d->name);
  CHECK(memcmp(a, b, n) == 0, "%s: pack/unpack/pack is not stable", d->name);
  free(a);
  free(b);
  protobuf_c_message_free_unpacked(m2, NULL);
}

#define TRY(fn_unpack, fn_free)                           \
  do {                                                    \
    void *m = fn_unpack(NULL, len, meta);                 \
    if (m) {                                              \
      roundtrip((const ProtobufCMessage *)m);             \
      fn_free(m, NULL);                                   \
      ok++;                                               \
    }                                                     \
  } while (0)

/* Every message type's unpack, as psd or the client would call it on a
 * frame of that type. Returns how many accepted the bytes. */
static int unpack_all(const uint8_t *meta, size_t len) {
  int ok = 0;
  TRY(ps__hello__unpack, ps__hello__free_unpacked);
  TRY(ps__hello_reply__unpack, ps__hello_reply__free_unpacked);
  TRY(ps__challenge__unpack, ps__challenge__free_unpacked);
  TRY(ps__error__unpack, ps__error__free_unpacked);
  TRY(ps__ack__unpack, ps__ack__free_unpacked);
  TRY(ps__register__unpack, ps__register__free_unpacked);
  TRY(ps__register_reply__unpack, ps__register_reply__free_unpacked);
  TRY(ps__init__unpack, ps__init__free_unpacked);
  TRY(ps__push__unpack, ps__push__free_unpacked);
  TRY(ps__push_reply__unpack, ps__push_reply__free_unpacked);
  TRY(ps__pull__unpack, ps__pull__free_unpacked);
  TRY(ps__pull_reply__unpack, ps__pull_reply__free_unpacked);
  TRY(ps__finish__unpack, ps__finish__free_unpacked);
  return ok;
}

static int decode(const uint8_t *in, int handshaken, ps__frame_header *h) {
  char err[256];
  err[0] = '\0';
  memset(h, 0xa5, sizeof *h);
  int rc = ps__header_decode(in, handshaken, h, err, sizeof err);
  if (rc != 0) {
    CHECK(rc == PS_EPROTO || rc == PS_EVERSION || rc == PS_ETOOBIG, "code %d", rc);
    CHECK(err[0] != '\0', "rejected (%d) without a message", rc);
    return rc;
  }
  CHECK(h->type >= 1 && h->type < PS__MSG_MAX_, "type %u", h->type);
  CHECK(strcmp(ps__msg_name(h->type), "UNKNOWN") != 0, "type %u has no name", h->type);
  CHECK(h->meta_len <= PS__MAX_META, "meta %u", h->meta_len);
  CHECK(h->data_len <= PS__MAX_DATA && h->data_len % 2 == 0, "data %llu",
        (unsigned long long)h->data_len);
  if (!handshaken) {
    CHECK(h->type == PS__MSG_HELLO || h->type == PS__MSG_HELLO_REPLY ||
              h->type == PS__MSG_ERROR || h->type == PS__MSG_CHALLENGE,
          "type %u before the handshake", h->type);
    CHECK(h->meta_len <= PS__MAX_PREAUTH_META && h->data_len == 0,
          "pre-handshake frame of %u + %llu bytes", h->meta_len,
          (unsigned long long)h->data_len);
  }
  /* The one flag (2.4): data in the shared-memory segment, on the frame
   * types that carry tensors (2.9: and table rows), after the handshake. */
  CHECK(h->flags == 0 ||
            (h->flags == PS__FLAG_SHM && handshaken && h->data_len != 0 &&
             (h->type == PS__MSG_PUSH || h->type == PS__MSG_INIT ||
              h->type == PS__MSG_PULL_REPLY || h->type == PS__MSG_TABLE_PUSH ||
              h->type == PS__MSG_TABLE_PULL_REPLY)),
        "flags 0x%x on %s", h->flags, ps__msg_name(h->type));
  uint8_t re[PS__HEADER_SIZE];
  ps__header_encode_flags(re, h->type, h->meta_len, h->data_len, h->flags);
  CHECK(memcmp(re, in, PS__HEADER_SIZE) == 0, "accepted header does not re-encode to itself");
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < PS__HEADER_SIZE) return 0; /* psd waits for more bytes */
  ps__frame_header h0, h1;
  int rc0 = decode(data, 0, &h0);
  int rc1 = decode(data, 1, &h1);
  if (rc0 == 0)
    CHECK(rc1 == 0 && h0.type == h1.type && h0.meta_len == h1.meta_len &&
              h0.data_len == h1.data_len,
          "the handshake accepts a header (%d) that is refused after it (%d)", rc0, rc1);
  if (rc1 != 0) return 0;
  size_t rest = size - PS__HEADER_SIZE;
  if (rest < h1.meta_len) return 0; /* psd waits for the whole protobuf part */
  /* An exact-size copy, so reads past the protobuf part are caught. */
  uint8_t *meta = malloc(h1.meta_len ? h1.meta_len : 1);
  if (!meta) return 0;
  memcpy(meta, data + PS__HEADER_SIZE, h1.meta_len);
  unpack_all(meta, h1.meta_len);
  free(meta);
  return 0;
}
