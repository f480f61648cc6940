/* outq.c - output queue shared by psd and libpsclient: frames are packed
 * into one owned byte buffer, tensor data is referenced where it lives
 * (never copied), and writev sends it all. Grow-only, so a steady stream of
 * steps allocates nothing. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include "wire.h"

/* iovecs per writev call (Linux IOV_MAX is 1024). */
#define PS__IOV_BATCH 256
/* Bytes of own buffer and segment table an empty queue keeps: a burst
 * (detached parameters, a big Stats reply) gives its memory back once
 * written; steady traffic (headers and protobuf) stays below and so
 * allocates nothing. */
#define PS__OUTQ_KEEP ((size_t)1 << 20)
/* keep_recent: a buffer more than this many times the bytes drained is
 * given back after PS__OUTQ_KEEP_DRAINS such drains in a row (a one-off
 * burst does not pin its size; a table step's pull keys between two big
 * pushes, or a push reply between two big pull replies, do not drop it). */
#define PS__OUTQ_SLACK 4
#define PS__OUTQ_KEEP_DRAINS 8
/* Alignment of the data of frames written in place (ps__outq_frame_inline):
 * malloc's, so floats and uint64 keys are aligned however long the
 * protobuf part before them is. */
#define PS__OUTQ_DATA_ALIGN 16u

int ps__outq_frame(ps__outq *q, unsigned type, const ProtobufCMessage *m,
                   const float *const *data, const uint64_t *counts, void *const *refs,
                   size_t nseg) {
  size_t mlen = protobuf_c_message_get_packed_size(m);
  uint64_t dlen = 0;
  for (size_t i = 0; i < nseg; i++) dlen += counts[i] * sizeof(float);
  if (mlen > PS__MAX_META || dlen > PS__MAX_DATA) return PS_ETOOBIG;
  if (ps__grow((void **)&q->buf, &q->bufcap, q->len + PS__HEADER_SIZE + mlen, 1) ||
      ps__grow((void **)&q->segs, &q->cap, q->n + 1 + nseg, sizeof *q->segs))
    return PS_ENOMEM;
  size_t off = q->len;
  ps__header_encode(q->buf + off, type, (uint32_t)mlen, dlen);
  protobuf_c_message_pack(m, q->buf + off + PS__HEADER_SIZE);
  q->len += PS__HEADER_SIZE + mlen;
  ps__outseg *last = q->n > q->first ? &q->segs[q->n - 1] : NULL;
  if (last && !last->ext && last->off + last->len == off)
    last->len += PS__HEADER_SIZE + mlen; /* coalesce with the previous frame */
  else
    q->segs[q->n++] = (ps__outseg){NULL, off, PS__HEADER_SIZE + mlen, NULL};
  for (size_t i = 0; i < nseg; i++) {
    if (!counts[i]) continue;
    void *ref = refs ? refs[i] : NULL;
    q->segs[q->n++] = (ps__outseg){data[i], 0, counts[i] * sizeof(float), ref};
    q->ext_len += counts[i] * sizeof(float);
    if (ref && q->hold) q->hold(q->ctx, ref);
  }
  return 0;
}

void *ps__outq_frame_inline(ps__outq *q, unsigned type, const ProtobufCMessage *m,
                            uint64_t data_len) {
  size_t mlen = protobuf_c_message_get_packed_size(m);
  if (mlen > PS__MAX_META || data_len > PS__MAX_DATA) return NULL;
  size_t head = PS__HEADER_SIZE + mlen, total = head + (size_t)data_len;
  /* Start the frame so that its data lands PS__OUTQ_DATA_ALIGN-aligned in
   * the buffer (floats and keys are written there in place); the gap
   * before it is never sent (the frame gets a segment of its own). */
  size_t off = (q->len + head + PS__OUTQ_DATA_ALIGN - 1) / PS__OUTQ_DATA_ALIGN *
                   PS__OUTQ_DATA_ALIGN - head;
  if (ps__grow((void **)&q->buf, &q->bufcap, off + total, 1) ||
      ps__grow((void **)&q->segs, &q->cap, q->n + 1, sizeof *q->segs))
    return NULL;
  ps__header_encode(q->buf + off, type, (uint32_t)mlen, data_len);
  protobuf_c_message_pack(m, q->buf + off + PS__HEADER_SIZE);
  q->len = off + total;
  ps__outseg *last = q->n > q->first ? &q->segs[q->n - 1] : NULL;
  if (last && !last->ext && last->off + last->len == off)
    last->len += total; /* coalesce with the previous frame */
  else
    q->segs[q->n++] = (ps__outseg){NULL, off, total, NULL};
  return q->buf + off + PS__HEADER_SIZE + mlen;
}

int ps__outq_frame_shm(ps__outq *q, unsigned type, const ProtobufCMessage *m,
                       uint64_t data_len, uint64_t pos) {
  size_t mlen = protobuf_c_message_get_packed_size(m);
  if (mlen > PS__MAX_META || data_len > PS__MAX_DATA) return PS_ETOOBIG;
  size_t total = PS__HEADER_SIZE + mlen + PS__SHM_DESC_BYTES;
  if (ps__grow((void **)&q->buf, &q->bufcap, q->len + total, 1) ||
      ps__grow((void **)&q->segs, &q->cap, q->n + 1, sizeof *q->segs))
    return PS_ENOMEM;
  size_t off = q->len;
  uint8_t *p = q->buf + off;
  ps__header_encode_flags(p, type, (uint32_t)mlen, data_len, PS__FLAG_SHM);
  protobuf_c_message_pack(m, p + PS__HEADER_SIZE);
  for (unsigned i = 0; i < PS__SHM_DESC_BYTES; i++)
    p[PS__HEADER_SIZE + mlen + i] = (uint8_t)(pos >> (8 * i));
  q->len += total;
  ps__outseg *last = q->n > q->first ? &q->segs[q->n - 1] : NULL;
  if (last && !last->ext && last->off + last->len == off)
    last->len += total; /* coalesce with the previous frame */
  else
    q->segs[q->n++] = (ps__outseg){NULL, off, total, NULL};
  return 0;
}

/* Drops the first segment (sent or abandoned). */
static void pop_first(ps__outq *q) {
  ps__outseg *s = &q->segs[q->first++];
  q->first_done = 0;
  if (s->ext) q->ext_len -= s->len;
  if (s->ref && q->release) q->release(q->ctx, s->ref);
}

int ps__outq_write(ps__outq *q, int fd) {
  while (q->first < q->n) {
    struct iovec iov[PS__IOV_BATCH];
    int n = 0;
    for (size_t i = q->first; i < q->n && n < PS__IOV_BATCH; i++, n++) {
      const ps__outseg *s = &q->segs[i];
      const char *base = s->ext ? (const char *)s->ext : (const char *)q->buf + s->off;
      size_t skip = i == q->first ? q->first_done : 0;
      iov[n].iov_base = (void *)(base + skip);
      iov[n].iov_len = s->len - skip;
    }
    ssize_t w = writev(fd, iov, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      return PS_ECLOSED;
    }
    size_t left = (size_t)w;
    while (left > 0 && q->first < q->n) {
      size_t rem = q->segs[q->first].len - q->first_done;
      if (left >= rem) {
        left -= rem;
        pop_first(q);
      } else {
        q->first_done += left;
        left = 0;
      }
    }
  }
  const size_t used = q->len;
  q->first = q->n = q->first_done = 0;
  q->len = q->ext_len = 0;
  if (q->bufcap / PS__OUTQ_SLACK <= used) {
    q->small_drains = 0;
    if (q->bufcap > PS__OUTQ_KEEP) q->kept = used;
  } else if (q->small_drains < PS__OUTQ_KEEP_DRAINS) {
    q->small_drains++;
  }
  if (q->bufcap > PS__OUTQ_KEEP &&
      !(q->keep_recent && q->small_drains < PS__OUTQ_KEEP_DRAINS)) {
    free(q->buf);
    q->buf = NULL;
    q->bufcap = 0;
  }
  if (!q->buf) q->kept = 0;
  if (q->cap * sizeof *q->segs > PS__OUTQ_KEEP) {
    free(q->segs);
    q->segs = NULL;
    q->cap = 0;
  }
  return 0;
}

int ps__outq_detach(ps__outq *q, void *ref) {
  int n = 0;
  for (size_t i = q->first; i < q->n; i++) {
    ps__outseg *sg = &q->segs[i];
    if (sg->ref != ref || !sg->ext) continue;
    if (ps__grow((void **)&q->buf, &q->bufcap, q->len + sg->len, 1)) return PS_ENOMEM;
    memcpy(q->buf + q->len, sg->ext, sg->len);
    sg->ext = NULL;
    q->ext_len -= sg->len;
    sg->off = q->len;
    q->len += sg->len;
    sg->ref = NULL;
    if (q->release) q->release(q->ctx, ref);
    n++;
  }
  return n;
}

void ps__outq_free(ps__outq *q) {
  while (q->first < q->n) pop_first(q);
  free(q->segs);
  free(q->buf);
  const int keep = q->keep_recent; /* a setting of the queue, not its contents */
  memset(q, 0, sizeof *q);
  q->keep_recent = keep;
}
