/*
 * ps_internal.h - pieces shared by libpsclient and psd: the frame header,
 * protocol limits and the deterministic placement of variables. Not part of
 * the public API (names are ps__).
 */
#ifndef PS_INTERNAL_H
#define PS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "psclient.h"

/* ---- frame header ----------------------------------------------------- */

#define PS__MAGIC 0x31445350u        /* "PSD1" as little-endian bytes */
#define PS__PROTOCOL_VERSION 1u      /* bump on any incompatible change */
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
  PS__MSG_MAX_ = 17 /* one past the last valid type */
} ps__msg_type;

typedef struct ps__frame_header {
  uint16_t type;      /* ps__msg_type */
  uint32_t meta_len;  /* bytes of protobuf after the header */
  uint64_t data_len;  /* bytes of float32 tensor data after the protobuf */
} ps__frame_header;

/* Writes the 24-byte header for the given type and lengths. */
void ps__header_encode(uint8_t out[PS__HEADER_SIZE], unsigned type,
                       uint32_t meta_len, uint64_t data_len);

/* Parses and checks a header. `handshaken` is 0 before the handshake, when
 * only a small Hello (no data) is allowed. Returns 0, or a negative PS_E*
 * code with a sentence naming the problem in err. */
int ps__header_decode(const uint8_t in[PS__HEADER_SIZE], int handshaken,
                      ps__frame_header *h, char *err, size_t errlen);

/* Name of a message type for logs ("PUSH"), "UNKNOWN" if invalid. */
const char *ps__msg_name(unsigned type);

/* ---- placement -------------------------------------------------------- */

/* Where one slice of a variable lives. */
typedef struct ps__slice_place {
  uint32_t ps;      /* ps index */
  uint64_t offset;  /* first element */
  uint64_t length;  /* elements */
} ps__slice_place;

/* Deterministic placement state: every worker feeds it the same variables
 * in the same order and gets the same map without talking to anyone. */
typedef struct ps__placer {
  uint32_t num_ps;          /* ps tasks */
  uint64_t split_threshold; /* bytes above which a variable is split */
  uint64_t max_slice_bytes; /* chunk size for big parts (multiple of 4) */
  uint64_t *load;           /* bytes placed on each ps so far */
} ps__placer;

#define PS__DEFAULT_SPLIT_THRESHOLD ((uint64_t)1 << 20)
#define PS__DEFAULT_MAX_SLICE_BYTES ((uint64_t)4 << 20)

/* 0 or PS_EINVAL/PS_ENOMEM. Zero thresholds take the defaults. */
int ps__placer_init(ps__placer *p, uint32_t num_ps, uint64_t split_threshold,
                    uint64_t max_slice_bytes);
void ps__placer_free(ps__placer *p);

/* Number of slices a variable of numel elements will get (no state change). */
size_t ps__placer_count(const ps__placer *p, uint64_t numel);

/* Places the next variable: fills out[0..count) (cap must be >= count) and
 * updates the loads. Rule: a variable of more than split_threshold bytes is
 * cut into num_ps near-equal contiguous parts, part i on ps i; a smaller one
 * goes whole to the least loaded ps (lowest index on ties). Each part is then
 * chunked into slices of at most max_slice_bytes. Returns the count. */
size_t ps__placer_place(ps__placer *p, uint64_t numel, ps__slice_place *out,
                        size_t cap);

/* Server-side check that [offset, offset+length) of a numel-element
 * variable is a slice the placement rule could give ps_index. Returns 0 or
 * PS_ESHAPE with the reason in err. */
int ps__placement_check(uint32_t num_ps, uint32_t ps_index,
                        uint64_t split_threshold, uint64_t max_slice_bytes,
                        uint64_t numel, uint64_t offset, uint64_t length,
                        char *err, size_t errlen);

/* ---- output queue ----------------------------------------------------- */

/* One piece of queued output: bytes of the queue's own buffer (ext NULL,
 * at off) or caller memory (ext), optionally holding a reference. */
typedef struct ps__outseg {
  const void *ext;  /* caller memory, or NULL for the own buffer */
  size_t off, len;  /* offset in the own buffer; bytes */
  void *ref;        /* passed to release() once sent or dropped */
} ps__outseg;

/* Frames waiting to be written. Tensor data is referenced, not copied; the
 * hold/release hooks let the owner keep that memory stable meanwhile. */
typedef struct ps__outq {
  ps__outseg *segs;              /* queued segments */
  size_t n, cap;                 /* used, allocated */
  size_t first, first_done;      /* first unsent segment; bytes of it sent */
  uint8_t *buf;                  /* headers and packed protobuf */
  size_t len, bufcap;            /* used, allocated */
  void (*hold)(void *ctx, void *ref);    /* a segment now references ref */
  void (*release)(void *ctx, void *ref); /* ... and no longer does */
  void *ctx;                     /* for the hooks */
} ps__outq;

/* Queues header + packed m + data segments (refs may be NULL). 0,
 * PS_ETOOBIG or PS_ENOMEM. */
int ps__outq_frame(ps__outq *q, unsigned type, const ProtobufCMessage *m,
                   const float *const *data, const uint64_t *counts, void *const *refs,
                   size_t nseg);
/* Writes what the socket takes: 0 (done or would block) or PS_ECLOSED
 * (errno tells why). */
int ps__outq_write(ps__outq *q, int fd);
static inline int ps__outq_pending(const ps__outq *q) { return q->first < q->n; }
/* Copies the data of every queued segment holding ref into the queue's own
 * buffer and releases it: the referenced memory may then change. Returns
 * the number of segments detached, or PS_ENOMEM. */
int ps__outq_detach(ps__outq *q, void *ref);
/* Drops everything (releasing references) and frees the queue. */
void ps__outq_free(ps__outq *q);

/* ---- authentication (auth.c) ------------------------------------------ */

/* How a peer proves it belongs to the job. */
typedef struct ps__auth {
  const void *secret;       /* shared secret (may be NULL) */
  size_t secret_len;        /* its bytes */
  int munge;                /* also present a fresh MUNGE credential */
  const char *munge_socket; /* munged socket, NULL: MUNGE's default */
  long long job_id;         /* what the MUNGE payload names */
  long long step_id;
} ps__auth;

struct Ps__Hello;
/* Fills the credential fields of h. *mcred gets a MUNGE credential the
 * caller frees once h is packed. 0, PS_ENOMEM or PS_EAUTH with err. */
int ps__hello_auth(struct Ps__Hello *h, const ps__auth *a, char **mcred, char *err,
                   size_t errlen);

struct Ps__StatsReply;
/* Admin exchange (admin.c): connects to the psd at addr as ROLE_ADMIN,
 * authenticated with auth, and asks for its counters. *out is freed with
 * ps__stats_reply__free_unpacked. 0 or a PS_E* code with err. */
int ps__admin_stats(const char *addr, const ps__auth *auth, int timeout_ms,
                    struct Ps__StatsReply **out, char *err, size_t errlen);

/* ---- small helpers ---------------------------------------------------- */

/* a*b into *out unless it overflows (returns -1 then). */
static inline int ps__mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
  return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}
static inline int ps__add_u64(uint64_t a, uint64_t b, uint64_t *out) {
  return __builtin_add_overflow(a, b, out) ? -1 : 0;
}

/* Grows *p (an array of *cap elements of elem bytes) to hold at least
 * need elements, doubling. 0, or -1 (out of memory; *p unchanged). */
int ps__grow(void **p, size_t *cap, size_t need, size_t elem);

/* p-th percentile (0..100) of v[0..n), sorting v in place; 0 if n == 0
 * (telemetry.c; psd's summary uses it too). */
double ps__percentile(double *v, size_t n, double p);

/* Monotonic clock in seconds. */
double ps__now(void);

/* Parses "host:port" ("[v6]:port" too) into host (hostcap bytes) and port. */
int ps__parse_hostport(const char *s, char *host, size_t hostcap, int *port);

#endif /* PS_INTERNAL_H */
