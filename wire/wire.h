/*
 * wire.h - the wire layer under both libpsclient and psd: the frame header,
 * the protocol's limits and message types. It includes the rest of the layer
 * (output queue, placement, Hello credentials) and the shared helpers, so a
 * file of either side includes this one header. Not part of the public API
 * (names are ps__); see docs/protocol.md for the contract.
 */
#ifndef PS_WIRE_H
#define PS_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "ps/errno.h"
#include "ps/types.h"
#include "util.h"
#include "outq.h"
#include "placement.h"
#include "auth.h"
#include "mac.h"
#include "optimizer_msg.h"
#include "half.h"
#include "shm.h"

#define PS__MAGIC 0x31445350u        /* "PSD1" as little-endian bytes */
#define PS__PROTOCOL_VERSION 2u      /* bump on any incompatible change (2: Challenge, MACs) */
/* Additions a peer of the same version may lack, announced in
 * HelloReply.protocol_minor (1: Init.assign, OPT_NONE, warm-up and cosine
 * schedules). A client uses them only with servers that announce them. */
#define PS__PROTOCOL_MINOR 10u /* 2: sparse tables (TABLE_* frames); 3: 16-bit
                                 wire dtypes (Item.dtype, Pull.dtype); 4: the
                                 shared-memory transport (PS__FLAG_SHM); 5:
                                 mean variables (OPT_MEAN); 6: Adagrad,
                                 RMSProp, lr_scale, decoupled weight decay,
                                 Adam's torch_epsilon (Optimizer 16-21); 7:
                                 moving averages (Optimizer 22-23,
                                 Pull.average); 8: a variable's own
                                 aggregation rule (Optimizer 24); 9:
                                 table rows through the segment
                                 (TablePull.shm_reply, PS__FLAG_SHM on
                                 TablePush and TablePullReply); 10: a
                                 TablePush of the keys its connection
                                 pulled names the pull instead of
                                 carrying them (TablePush.pull_id,
                                 TablePullReply.remembered) */
#define PS__HEADER_SIZE 24u          /* magic4 ver2 type2 meta4 flags4 data8 */

/* Largest protobuf part of a frame. A Register of ~20k slices or a Pull of
 * 250k slice ids fits; anything bigger is a bug or an attack. */
#define PS__MAX_META (1u << 20)
/* Largest tensor part of one frame: every slice a frame carries is at most
 * PS__MAX_SLICE_BYTES, and clients batch only small slices, so 1 GiB is far
 * above any honest frame while still bounding what one peer can make us
 * read. Data is never buffered whole (it streams slice by slice). */
#define PS__MAX_DATA ((uint64_t)1 << 30)
/* Largest slice a server accepts: the unit it buffers, accumulates and
 * applies at once. Clients chunk bigger variables (default 4 MiB chunks). */
#define PS__MAX_SLICE_BYTES ((uint64_t)64 << 20)
/* Before the handshake only a Hello may come, and it is tiny: credentials
 * (a MUNGE token is < 1 KiB) plus a few integers. */
#define PS__MAX_PREAUTH_META 4096u
/* Items (slice ids) per frame, so a frame's protobuf part stays far below
 * PS__MAX_META (an item packs to at most ~40 bytes). */
#define PS__MAX_ITEMS_PER_FRAME 16384u
/* Most workers in a job: bounds the per-worker arrays a HELLO makes a
 * server allocate (far above any real cluster, far below an attack). */
#define PS__MAX_WORKERS 1000000u
/* Most slices one server holds; bounds per-connection tables. */
#define PS__MAX_SLICES (1u << 20)

/* Sparse tables (2.2). Floats per row: far above any embedding (1024 is
 * already large), and it bounds one row's optimizer work. */
#define PS__MAX_TABLE_DIM 65536u
/* Keys in one TablePull or TablePush frame: a batch touches thousands to
 * a few hundred thousand distinct keys; clients split bigger pulls (a push
 * of more is refused by the client with PS_ETOOBIG). */
#define PS__MAX_TABLE_KEYS (1u << 22)
/* Bytes of one TablePush frame's data (keys and gradients): what one
 * connection can make psd stage at once. */
#define PS__MAX_TABLE_PUSH_BYTES ((uint64_t)256 << 20)
/* Tables one server holds. */
#define PS__MAX_TABLES 4096u

typedef enum ps__msg_type {
  PS__MSG_HELLO = 1,
  PS__MSG_HELLO_REPLY = 2,
  PS__MSG_ERROR = 3,
  PS__MSG_ACK = 4,
  PS__MSG_REGISTER = 5,
  PS__MSG_REGISTER_REPLY = 6,
  PS__MSG_INIT = 7,
  PS__MSG_PUSH = 8,
  PS__MSG_PUSH_REPLY = 9,
  PS__MSG_PULL = 10,
  PS__MSG_PULL_REPLY = 11,
  PS__MSG_FINISH = 12,
  PS__MSG_CHECKPOINT = 13,       /* chief: checkpoint at a step (prepare/commit) */
  PS__MSG_CHECKPOINT_REPLY = 14, /* accepted or not, and how far the server is */
  PS__MSG_STATS = 15,        /* admin: counters please */
  PS__MSG_STATS_REPLY = 16,  /* the counters */
  PS__MSG_CHALLENGE = 17,    /* psd's nonce, first frame on every connection */
  PS__MSG_TABLE_REGISTER = 18,       /* create or attach to a sparse table (2.2) */
  PS__MSG_TABLE_REGISTER_REPLY = 19, /* its id on this server */
  PS__MSG_TABLE_PULL = 20,           /* rows by key (data: keys) */
  PS__MSG_TABLE_PULL_REPLY = 21,     /* the rows (data: floats) */
  PS__MSG_TABLE_PUSH = 22,           /* row gradients (data: keys, floats) */
  PS__MSG_TABLE_PUSH_REPLY = 23,     /* accepted, stale, duplicate or refused */
  PS__MSG_MAX_ = 24 /* one past the last valid type */
} ps__msg_type;

typedef struct ps__frame_header {
  uint16_t type;      /* ps__msg_type */
  uint32_t meta_len;  /* bytes of protobuf after the header */
  uint32_t flags;     /* 0, or PS__FLAG_SHM: the data is in the segment,
                         an 8-byte position follows the protobuf (2.4) */
  uint64_t data_len;  /* bytes of tensor data after the protobuf (even) */
} ps__frame_header;

/* Writes the 24-byte header for the given type and lengths. */
void ps__header_encode(uint8_t out[PS__HEADER_SIZE], unsigned type,
                       uint32_t meta_len, uint64_t data_len);
/* The same with header flags (PS__FLAG_SHM). */
void ps__header_encode_flags(uint8_t out[PS__HEADER_SIZE], unsigned type,
                             uint32_t meta_len, uint64_t data_len, uint32_t flags);
/* Bytes on the socket between the header and the next frame's header
 * that are not tensor data: the protobuf part and, for PS__FLAG_SHM, the
 * segment position. */
static inline uint64_t ps__frame_meta_bytes(const ps__frame_header *h) {
  return (uint64_t)h->meta_len + ((h->flags & PS__FLAG_SHM) ? PS__SHM_DESC_BYTES : 0);
}

/* Parses and checks a header. `handshaken` is 0 before the handshake, when
 * only a small Hello (no data) is allowed. Returns 0, or a negative PS_E*
 * code with a sentence naming the problem in err. */
int ps__header_decode(const uint8_t in[PS__HEADER_SIZE], int handshaken,
                      ps__frame_header *h, char *err, size_t errlen);

/* Name of a message type for logs ("PUSH"), "UNKNOWN" if invalid. */
const char *ps__msg_name(unsigned type);

/* protobuf-c's allocator over malloc that notes a failed allocation, so
 * that a message that does not unpack is told apart: out of memory
 * (failed set: PS_ENOMEM) or malformed (PS_EPROTO). Pass &pa->a to the
 * unpack and to its free_unpacked. */
typedef struct ps__pb_alloc {
  ProtobufCAllocator a;
  int failed;
} ps__pb_alloc;
void ps__pb_alloc_init(ps__pb_alloc *pa);

#endif /* PS_WIRE_H */
