/* frame.c - the error table and the frame header codec, shared by
 * libpsclient and psd. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "wire.h"

const char *ps_strerror(int code) {
  switch (code) {
  case PS_OK:
    return "success";
#define PS__ERR_STR(name, val, msg) \
  case PS_##name:                   \
    return msg;
    PS_ERRNO_MAP(PS__ERR_STR)
#undef PS__ERR_STR
  default:
    return "unknown error";
  }
}

const char *ps_err_name(int code) {
  switch (code) {
  case PS_OK:
    return "PS_OK";
#define PS__ERR_NAME(name, val, msg) \
  case PS_##name:                    \
    return "PS_" #name;
    PS_ERRNO_MAP(PS__ERR_NAME)
#undef PS__ERR_NAME
  default:
    return "PS_UNKNOWN";
  }
}

static void put_u16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get_u16(const uint8_t *p) {
  return (uint16_t)(p[0] | (p[1] << 8));
}
static uint32_t get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

void ps__header_encode_flags(uint8_t out[PS__HEADER_SIZE], unsigned type,
                             uint32_t meta_len, uint64_t data_len, uint32_t flags) {
  put_u32(out, PS__MAGIC);
  put_u16(out + 4, (uint16_t)PS__PROTOCOL_VERSION);
  put_u16(out + 6, (uint16_t)type);
  put_u32(out + 8, meta_len);
  put_u32(out + 12, flags);
  put_u64(out + 16, data_len);
}

void ps__header_encode(uint8_t out[PS__HEADER_SIZE], unsigned type,
                       uint32_t meta_len, uint64_t data_len) {
  ps__header_encode_flags(out, type, meta_len, data_len, 0);
}

int ps__header_decode(const uint8_t in[PS__HEADER_SIZE], int handshaken,
                      ps__frame_header *h, char *err, size_t errlen) {
  uint32_t magic = get_u32(in);
  uint16_t version = get_u16(in + 4);
  uint16_t type = get_u16(in + 6);
  uint32_t meta = get_u32(in + 8);
  uint32_t flags = get_u32(in + 12);
  uint64_t data = get_u64(in + 16);
  if (magic != PS__MAGIC) {
    snprintf(err, errlen, "bad frame magic 0x%08x (expected 0x%08x): not a psd peer",
             magic, PS__MAGIC);
    return PS_EPROTO;
  }
  if (version != PS__PROTOCOL_VERSION) {
    snprintf(err, errlen, "frame protocol version %u, this side speaks %u",
             version, PS__PROTOCOL_VERSION);
    return PS_EVERSION;
  }
  if (type == 0 || type >= PS__MSG_MAX_) {
    snprintf(err, errlen, "unknown message type %u", type);
    return PS_EPROTO;
  }
  /* PS__FLAG_SHM (2.4): only on the frames whose data may move through
   * the shared-memory segment, only after the handshake, only with data. */
  int shm_ok = handshaken && data != 0 &&
               (type == PS__MSG_PUSH || type == PS__MSG_INIT || type == PS__MSG_PULL_REPLY ||
                type == PS__MSG_TABLE_PUSH || type == PS__MSG_TABLE_PULL_REPLY); /* 2.9 */
  if (flags != 0 && (flags != PS__FLAG_SHM || !shm_ok)) {
    snprintf(err, errlen, "frame flags 0x%x not allowed on a %s frame%s", flags,
             ps__msg_name(type), data == 0 ? " without data" : "");
    return PS_EPROTO;
  }
  if (!handshaken) {
    if (type != PS__MSG_HELLO && type != PS__MSG_HELLO_REPLY &&
        type != PS__MSG_ERROR && type != PS__MSG_CHALLENGE) {
      snprintf(err, errlen, "%s frame before the handshake (expected HELLO)",
               ps__msg_name(type));
      return PS_EPROTO;
    }
    if (meta > PS__MAX_PREAUTH_META || data != 0) {
      snprintf(err, errlen,
               "handshake frame too large (%u meta + %llu data bytes; limit %u + 0)",
               meta, (unsigned long long)data, PS__MAX_PREAUTH_META);
      return PS_ETOOBIG;
    }
  }
  if (meta > PS__MAX_META) {
    snprintf(err, errlen, "frame metadata of %u bytes exceeds the limit of %u",
             meta, PS__MAX_META);
    return PS_ETOOBIG;
  }
  if (data > PS__MAX_DATA) {
    snprintf(err, errlen, "frame data of %llu bytes exceeds the limit of %llu",
             (unsigned long long)data, (unsigned long long)PS__MAX_DATA);
    return PS_ETOOBIG;
  }
  /* The smallest value on the wire is 16 bits (2.3); each message's
   * handler checks its exact length (items x their dtype's size). */
  if (data % 2 != 0) {
    snprintf(err, errlen, "frame data of %llu bytes is not whole 16-bit values",
             (unsigned long long)data);
    return PS_EPROTO;
  }
  h->type = type;
  h->meta_len = meta;
  h->flags = flags;
  h->data_len = data;
  return 0;
}

const char *ps__msg_name(unsigned type) {
  static const char *const names[PS__MSG_MAX_] = {
      [PS__MSG_HELLO] = "HELLO",         [PS__MSG_HELLO_REPLY] = "HELLO_REPLY",
      [PS__MSG_ERROR] = "ERROR",         [PS__MSG_ACK] = "ACK",
      [PS__MSG_REGISTER] = "REGISTER",   [PS__MSG_REGISTER_REPLY] = "REGISTER_REPLY",
      [PS__MSG_INIT] = "INIT",           [PS__MSG_PUSH] = "PUSH",
      [PS__MSG_PUSH_REPLY] = "PUSH_REPLY", [PS__MSG_PULL] = "PULL",
      [PS__MSG_PULL_REPLY] = "PULL_REPLY", [PS__MSG_FINISH] = "FINISH",
      [PS__MSG_CHECKPOINT] = "CHECKPOINT", [PS__MSG_CHECKPOINT_REPLY] = "CHECKPOINT_REPLY",
      [PS__MSG_STATS] = "STATS",         [PS__MSG_STATS_REPLY] = "STATS_REPLY",
      [PS__MSG_CHALLENGE] = "CHALLENGE",
      [PS__MSG_TABLE_REGISTER] = "TABLE_REGISTER",
      [PS__MSG_TABLE_REGISTER_REPLY] = "TABLE_REGISTER_REPLY",
      [PS__MSG_TABLE_PULL] = "TABLE_PULL", [PS__MSG_TABLE_PULL_REPLY] = "TABLE_PULL_REPLY",
      [PS__MSG_TABLE_PUSH] = "TABLE_PUSH", [PS__MSG_TABLE_PUSH_REPLY] = "TABLE_PUSH_REPLY"};
  if (type >= PS__MSG_MAX_ || !names[type]) return "UNKNOWN";
  return names[type];
}

static void *pb_alloc(void *ud, size_t size) {
  void *p = malloc(size);
  if (!p) ((ps__pb_alloc *)ud)->failed = 1;
  return p;
}

static void pb_free(void *ud, void *p) {
  (void)ud;
  free(p);
}

void ps__pb_alloc_init(ps__pb_alloc *pa) {
  pa->a.alloc = pb_alloc;
  pa->a.free = pb_free;
  pa->a.allocator_data = pa;
  pa->failed = 0;
}
