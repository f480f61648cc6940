/* reader.c - the frame reader of a connection: an enum-state machine
 * (PS__RD_HEADER, PS__RD_META, PS__RD_DATA) over the input buffer, with
 * big tensor data read straight into the variables (no copy through the
 * buffer). Each complete protobuf part goes to reply.c, which decides what
 * it means and where its data goes; the reader only moves bytes. */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "client_internal.h"

/* PS__RD_HEADER: decodes a buffered header. 1 (advanced), 0 (need more
 * input) or <0 (broken). */
static int rd_header(ps_client *c, ps__conn *k) {
  if (k->in_len < PS__HEADER_SIZE) return 0;
  char err[256];
  int rc = ps__header_decode(k->in + k->in_off, 1, &k->hdr, err, sizeof err);
  if (rc) {
    ps__conn_break(c, k, rc, err);
    return rc;
  }
  k->in_off += PS__HEADER_SIZE;
  k->in_len -= PS__HEADER_SIZE;
  k->rstate = PS__RD_META;
  return 1;
}

/* PS__RD_META: hands a complete protobuf part to reply.c (making room for
 * a big one first). 1, 0 or <0 as rd_header. */
static int rd_meta(ps_client *c, ps__conn *k) {
  size_t mb = (size_t)ps__frame_meta_bytes(&k->hdr); /* + a segment position */
  if (k->in_len < mb) {
    if (k->in_off + mb > k->in_cap) {
      memmove(k->in, k->in + k->in_off, k->in_len);
      k->in_off = 0;
      if (ps__grow((void **)&k->in, &k->in_cap, mb, 1)) {
        ps__conn_break(c, k, PS_ENOMEM, "out of memory");
        return PS_ENOMEM;
      }
    }
    return 0;
  }
  const uint8_t *meta = k->in + k->in_off;
  uint64_t dlen = k->hdr.data_len, pos = 0;
  const uint8_t *src = NULL;
  if (k->hdr.flags & PS__FLAG_SHM) { /* the data is in our pull ring */
    pos = ps__shm_desc_decode(meta + k->hdr.meta_len);
    src = ps__shm_locate(&k->shm.pull, pos, dlen);
    if (!src)
      return ps__proto_err(c, k, k->shm.map ? "its pull reply's data lies outside our pull ring"
                                            : "it sent data in shared memory we never gave it");
  }
  k->in_off += mb;
  k->in_len -= mb;
  k->rstate = PS__RD_HEADER;
  k->shm_src = src;
  int rc = ps__handle_reply(c, k, meta);
  k->shm_src = NULL;
  if (rc < 0) return rc;
  if (k->rstate == PS__RD_DATA && src) {
    /* The one copy of a pull: out of the ring into the variables, then the
     * ring space goes back to psd. */
    for (size_t i = 0; i < k->ndst; i++) {
      memcpy(k->dst[i].iov_base, src, k->dst[i].iov_len);
      src += k->dst[i].iov_len;
    }
    ps__shm_store(k->shm.pull_done, pos + dlen);
    ps__pull_data_done(c, k);
  } else if (k->rstate == PS__RD_DATA && dlen == 0) {
    ps__pull_data_done(c, k);
  }
  return 1;
}

/* PS__RD_DATA: copies buffered tensor bytes to their destinations. 1 when
 * the frame's data is complete, 0 when more is needed. */
static int rd_data(ps_client *c, ps__conn *k) {
  while (k->dst_i < k->ndst && k->in_len) {
    struct iovec *d = &k->dst[k->dst_i];
    size_t need = d->iov_len - k->dst_got;
    size_t take = k->in_len < need ? k->in_len : need;
    memcpy((char *)d->iov_base + k->dst_got, k->in + k->in_off, take);
    k->in_off += take;
    k->in_len -= take;
    k->dst_got += take;
    if (k->dst_got == d->iov_len) {
      k->dst_i++;
      k->dst_got = 0;
    }
  }
  if (k->dst_i < k->ndst) return 0;
  ps__pull_data_done(c, k);
  return 1;
}

/* Parses everything buffered. 0 (needs input) or <0 (broken). */
static int parse_buffered(ps_client *c, ps__conn *k) {
  for (;;) {
    int rc;
    switch (k->rstate) {
    case PS__RD_HEADER: rc = rd_header(c, k); break;
    case PS__RD_META: rc = rd_meta(c, k); break;
    case PS__RD_DATA: rc = rd_data(c, k); break;
    default: rc = PS_EINTERNAL; break;
    }
    if (rc <= 0) return rc;
  }
}

/* Big tensor data with nothing buffered: read it straight into the
 * variables (no copy through the input buffer). */
static ssize_t read_direct(ps_client *c, ps__conn *k) {
  struct iovec iov[64];
  int ni = 0;
  for (size_t i = k->dst_i; i < k->ndst && ni < 64; i++, ni++) {
    size_t skip = i == k->dst_i ? k->dst_got : 0;
    iov[ni].iov_base = (char *)k->dst[i].iov_base + skip;
    iov[ni].iov_len = k->dst[i].iov_len - skip;
  }
  ssize_t n = readv(k->fd, iov, ni);
  if (n <= 0) return n;
  for (size_t left = (size_t)n; left;) {
    size_t rem = k->dst[k->dst_i].iov_len - k->dst_got;
    if (left >= rem) {
      left -= rem;
      k->dst_i++;
      k->dst_got = 0;
    } else {
      k->dst_got += left;
      left = 0;
    }
  }
  if (k->dst_i == k->ndst) ps__pull_data_done(c, k);
  return n;
}

/* Reads into the input buffer (compacting it when the end is reached). */
static ssize_t read_buffered(ps__conn *k) {
  if (k->in_len == 0) k->in_off = 0;
  if (k->in_off + k->in_len == k->in_cap) {
    memmove(k->in, k->in + k->in_off, k->in_len);
    k->in_off = 0;
  }
  ssize_t n = read(k->fd, k->in + k->in_off + k->in_len, k->in_cap - k->in_off - k->in_len);
  if (n > 0) k->in_len += (size_t)n;
  return n;
}

int ps__conn_read(ps_client *c, ps__conn *k) {
  /* A table pull's rows are read into its request's memory or its
   * caller's out: released (or failed) since the frame began (only the
   * caller releases, between pumps), the rest goes to the discard sink. */
  if (k->rstate == PS__RD_DATA && k->data_own && !ps__req_find(c, k->data_req)) {
    ps__data_abandon(c, k);
    if (k->fd < 0) return PS_ENOMEM;
  }
  for (;;) {
    int rc = parse_buffered(c, k);
    if (rc < 0) return rc;
    ssize_t n;
    if (k->rstate == PS__RD_DATA && k->in_len == 0 &&
        k->dst[k->dst_i].iov_len - k->dst_got >= PS__DIRECT_READ_MIN)
      n = read_direct(c, k);
    else
      n = read_buffered(k);
    if (n > 0) continue;
    if (n == 0) {
      ps__conn_break(c, k, PS_ECLOSED, "the server closed the connection");
      return PS_ECLOSED;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    ps__conn_break(c, k, PS_ECLOSED, strerror(errno));
    return PS_ECLOSED;
  }
}
