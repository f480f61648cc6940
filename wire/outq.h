/*
 * outq.h - the output queue both sides write frames through: headers and
 * packed protobuf copied, tensor data referenced in place. Internal.
 */
#ifndef PS_WIRE_OUTQ_H
#define PS_WIRE_OUTQ_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

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
  size_t ext_len;                /* bytes of queued segments referencing
                                    caller memory (not yet fully sent) */
  void (*hold)(void *ctx, void *ref);    /* a segment now references ref */
  void (*release)(void *ctx, void *ref); /* ... and no longer does */
  void *ctx;                     /* for the hooks */
  int keep_recent;               /* a drained queue keeps a buffer over
                                    PS__OUTQ_KEEP while one of the last
                                    PS__OUTQ_KEEP_DRAINS drains used at
                                    least a PS__OUTQ_SLACK-th of it (steady
                                    table pushes and replies, with small
                                    frames between them: no fresh pages a
                                    step); 0: gives it back at once */
  unsigned small_drains;         /* drains in a row that used less */
  size_t kept;                   /* bytes the last big drain used: what a
                                    kept buffer holds in touched pages
                                    (its capacity may be up to twice) */
} ps__outq;

/* Bytes q holds as memory accounting sees them: what is queued, or what
 * a kept buffer last used, whichever is more. */
static inline size_t ps__outq_held(const ps__outq *q) { return q->len > q->kept ? q->len : q->kept; }

/* Queues header + packed m + data segments (refs may be NULL). 0,
 * PS_ETOOBIG or PS_ENOMEM. */
int ps__outq_frame(ps__outq *q, unsigned type, const ProtobufCMessage *m,
                   const float *const *data, const uint64_t *counts, void *const *refs,
                   size_t nseg);
/* Queues header + packed m + data_len bytes of data in the queue's own
 * buffer, and returns where those data bytes go: the caller fills them
 * before the next call on q (gathered rows, keys and gradients: one write,
 * no copy of a scattered source); they start 16-byte aligned. NULL: too
 * big or out of memory (nothing queued). */
void *ps__outq_frame_inline(ps__outq *q, unsigned type, const ProtobufCMessage *m,
                            uint64_t data_len);
/* Queues a frame whose data_len bytes of data are in the shared-memory
 * segment at position pos (PS__FLAG_SHM): header, packed m, the 8-byte
 * position. 0, PS_ETOOBIG or PS_ENOMEM (nothing queued). */
int ps__outq_frame_shm(ps__outq *q, unsigned type, const ProtobufCMessage *m,
                       uint64_t data_len, uint64_t pos);
/* Writes what the socket takes: 0 (done or would block) or PS_ECLOSED
 * (errno tells why). */
int ps__outq_write(ps__outq *q, int fd);
static inline int ps__outq_pending(const ps__outq *q) { return q->first < q->n; }
/* Bytes the queue holds or pins: its own buffer (copied headers, protobuf,
 * detached data) plus the caller memory its segments reference. */
static inline size_t ps__outq_bytes(const ps__outq *q) { return q->len + q->ext_len; }
/* Copies the data of every queued segment holding ref into the queue's own
 * buffer and releases it: the referenced memory may then change. Returns
 * the number of segments detached, or PS_ENOMEM. */
int ps__outq_detach(ps__outq *q, void *ref);
/* Drops everything (releasing references) and frees the queue. */
void ps__outq_free(ps__outq *q);

#endif /* PS_WIRE_OUTQ_H */
