/* conn.c - connections to the servers: connecting with backoff, the
 * handshake, the frame reader (header, protobuf part, then tensor data
 * streamed straight into the variables) and the poll loop that drives every
 * connection from the caller's thread (no hidden threads). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"

int ps__queue_frame(ps_client *c, ps__conn *k, unsigned type, const ProtobufCMessage *m,
                    const float *const *data, const uint64_t *counts, size_t nseg) {
  int rc = ps__outq_frame(&k->out, type, m, data, counts, NULL, nseg);
  if (rc == PS_ETOOBIG)
    return ps__seterr(c, rc, "a %s message exceeds the frame limits", ps__msg_name(type));
  if (rc) return ps__seterr(c, rc, "out of memory queueing a message");
  return 0;
}

int ps__conn_flush(ps_client *c, ps__conn *k) {
  if (k->fd < 0) return PS_ECLOSED;
  if (ps__outq_write(&k->out, k->fd) != 0) {
    ps__conn_break(c, k, PS_ECLOSED, strerror(errno));
    return PS_ECLOSED;
  }
  return 0;
}

/* What a broken connection does to one in-flight request. */
typedef struct break_ctx {
  int ps;          /* the lost server */
  int code;        /* the error the requests get */
  const char *msg; /* ... and its message */
} break_ctx;

static void fail_if_waiting(ps_client *c, ps_req *r, void *arg) {
  const break_ctx *b = arg;
  if (r->pend_ps[b->ps] > 0) ps__req_fail(c, r, b->code, b->msg);
}

void ps__conn_break(ps_client *c, ps__conn *k, int code, const char *why) {
  if (k->fd < 0) return;
  close(k->fd);
  k->fd = -1;
  char msg[600];
  snprintf(msg, sizeof msg, "connection to ps %d at %s lost: %s", k->index, k->addr, why);
  /* Fail the requests still waiting for this server. */
  break_ctx b = {k->index, code, msg};
  ps__req_each(c, fail_if_waiting, &b);
  snprintf(c->errmsg, sizeof c->errmsg, "%s", msg);
}

void ps__conn_free(ps__conn *k) {
  if (k->fd >= 0) close(k->fd);
  k->fd = -1;
  ps__outq_free(&k->out);
  free(k->in);
  free(k->dst);
  free(k->discard);
}

/* ---- the frame reader ------------------------------------------------------ */

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
  if (k->in_len < k->hdr.meta_len) {
    if (k->in_off + k->hdr.meta_len > k->in_cap) {
      memmove(k->in, k->in + k->in_off, k->in_len);
      k->in_off = 0;
      if (ps__grow((void **)&k->in, &k->in_cap, k->hdr.meta_len, 1)) {
        ps__conn_break(c, k, PS_ENOMEM, "out of memory");
        return PS_ENOMEM;
      }
    }
    return 0;
  }
  const uint8_t *meta = k->in + k->in_off;
  k->in_off += k->hdr.meta_len;
  k->in_len -= k->hdr.meta_len;
  k->rstate = PS__RD_HEADER;
  uint64_t dlen = k->hdr.data_len;
  int rc = ps__handle_reply(c, k, meta);
  if (rc < 0) return rc;
  if (k->rstate == PS__RD_DATA && dlen == 0) ps__pull_data_done(c, k);
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

/* Processes buffered input and reads more until the socket is drained;
 * 0 or <0 (broken). */
static int conn_read(ps_client *c, ps__conn *k) {
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

int ps__pump(ps_client *c, ps_req *r, double deadline) {
  struct pollfd pfd[64];
  struct pollfd *p = c->num_ps <= 64 ? pfd : calloc((size_t)c->num_ps, sizeof *p);
  if (!p) return ps__seterr(c, PS_ENOMEM, "out of memory");
  int rc = 0;
  while (!r->done) {
    for (int i = 0; i < c->num_ps; i++) {
      ps__conn *k = &c->conns[i];
      if (ps__outq_pending(&k->out)) ps__conn_flush(c, k);
      p[i].fd = k->fd;
      p[i].events = (short)(POLLIN | (ps__outq_pending(&k->out) ? POLLOUT : 0));
      p[i].revents = 0;
    }
    if (r->done) break;
    double left = deadline - ps__now();
    if (left <= 0) {
      rc = ps__seterr(c, PS_ETIMEDOUT, "timed out waiting for the parameter servers");
      break;
    }
    int ms = left > 1e6 ? 1000000000 : (int)(left * 1000) + 1;
    int n = poll(p, (nfds_t)c->num_ps, ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      rc = ps__seterr(c, PS_EIO, "poll failed: %s", strerror(errno));
      break;
    }
    for (int i = 0; i < c->num_ps; i++) {
      ps__conn *k = &c->conns[i];
      if (k->fd < 0) continue;
      if (p[i].revents & (POLLIN | POLLHUP | POLLERR)) conn_read(c, k);
      if (k->fd >= 0 && (p[i].revents & POLLOUT)) ps__conn_flush(c, k);
    }
  }
  if (p != pfd) free(p);
  return rc;
}

/* ---- connecting ------------------------------------------------------------ */

/* A socket tuned for bulk transfer that notices a dead peer quickly. */
static int tuned_socket(int family) {
  int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return fd;
  int one = 1, buf = PS__SOCK_BUF;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  int idle = PS__KEEPIDLE_S, intvl = PS__KEEPINTVL_S, cnt = PS__KEEPCNT;
  unsigned uto = PS__USER_TIMEOUT_MS;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &uto, sizeof uto);
  return fd;
}

/* One pass over host's addresses: 0 (k->fd set) or -1 with why in last. */
static int try_connect(ps__conn *k, const char *host, const char *port, char *last,
                       size_t lastlen) {
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int g = getaddrinfo(host, port, &hints, &res);
  if (g != 0) {
    snprintf(last, lastlen, "%s", gai_strerror(g));
    return -1;
  }
  for (struct addrinfo *a = res; a; a = a->ai_next) {
    int fd = tuned_socket(a->ai_family);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
      k->fd = fd;
      freeaddrinfo(res);
      return 0;
    }
    snprintf(last, lastlen, "%s", strerror(errno));
    close(fd);
  }
  freeaddrinfo(res);
  return -1;
}

int ps__conn_connect(ps_client *c, ps__conn *k, double deadline) {
  char host[256];
  int port;
  if (ps__parse_hostport(k->addr, host, sizeof host, &port))
    return ps__seterr(c, PS_EINVAL, "ps %d address '%s' is not host:port", k->index, k->addr);
  char ports[16];
  snprintf(ports, sizeof ports, "%d", port);
  double backoff = 0.05;
  char last[256] = "no attempt";
  for (;;) {
    if (try_connect(k, host, ports, last, sizeof last) == 0) return 0;
    if (ps__now() + backoff > deadline)
      return ps__seterr(c, PS_ECONNECT, "could not connect to ps %d at %s within %.0f s: %s",
                        k->index, k->addr, c->connect_timeout_ms / 1000.0, last);
    struct timespec ts = {(time_t)backoff, (long)((backoff - (time_t)backoff) * 1e9)};
    nanosleep(&ts, NULL);
    backoff = backoff * 2 > 1.0 ? 1.0 : backoff * 2;
  }
}

int ps__conn_hello(ps_client *c, ps__conn *k, double deadline) {
  Ps__Hello h = PS__HELLO__INIT;
  char cid[128], hn[64] = "";
  gethostname(hn, sizeof hn - 1);
  snprintf(cid, sizeof cid, "(%s pid %d)", hn, (int)getpid());
  h.protocol_version = PS__PROTOCOL_VERSION;
  h.role = PS__ROLE__ROLE_WORKER;
  h.worker_index = (uint32_t)c->worker_index;
  h.num_workers = (uint32_t)c->num_workers;
  h.num_ps = (uint32_t)c->num_ps;
  h.ps_index = (uint32_t)k->index;
  h.replicas_to_aggregate = (uint32_t)c->replicas;
  h.async_mode = c->async_mode;
  char *mcred = NULL;
  ps__auth au = {c->cred, c->cred_len, c->munge, c->munge_socket, c->job_id, c->step_id};
  char aerr[512];
  int arc = ps__hello_auth(&h, &au, &mcred, aerr, sizeof aerr);
  if (arc) return ps__seterr(c, arc, "%s", aerr);
  h.client_id = cid;
  h.split_threshold = c->placer.split_threshold;
  h.max_slice_bytes = c->placer.max_slice_bytes;
  ps_req *r = ps__req_new(c, PS__REQ_HELLO);
  if (!r) {
    free(mcred);
    return ps__seterr(c, PS_ENOMEM, "out of memory");
  }
  r->step = (uint64_t)k->index; /* HELLO_REPLY carries no id: match by ps */
  r->pend_ps[k->index] = 1;
  int rc = ps__queue_frame(c, k, PS__MSG_HELLO, &h.base, NULL, NULL, 0);
  free(mcred); /* packed into the frame */
  if (rc == 0) rc = ps__pump(c, r, deadline);
  if (rc == 0) rc = r->status;
  if (rc == PS_ETIMEDOUT)
    ps__seterr(c, rc, "ps %d at %s accepted the connection but did not answer the handshake",
               k->index, k->addr);
  ps__req_release(c, r);
  return rc;
}
