/* srvconn.c - connections to the servers: connecting with backoff, queueing
 * frames and flushing them, and breaking a connection (which fails the
 * requests still waiting for that server). Reading is reader.c's and the
 * poll loop pump.c's: both sit above this file, so a connection never
 * calls back into what drives it. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"

/* A Push or Init through k's push ring: the data copied into the ring
 * (the one copy of a push), the frame carrying its position. 1 (queued),
 * 0 (no segment, or no room: the caller sends it over TCP), or <0. */
static int queue_shm(ps__conn *k, unsigned type, const ProtobufCMessage *m,
                     const float *const *data, const uint64_t *counts, size_t nseg) {
  if (!k->shm.map || (type != PS__MSG_PUSH && type != PS__MSG_INIT)) return 0;
  uint64_t dlen = 0;
  for (size_t i = 0; i < nseg; i++) dlen += counts[i] * sizeof(float);
  uint64_t pos;
  uint8_t *dst = ps__push_reserve(k, dlen, &pos);
  if (!dst) return 0;
  for (size_t i = 0; i < nseg; i++) {
    memcpy(dst, data[i], counts[i] * sizeof(float));
    dst += counts[i] * sizeof(float);
  }
  int rc = ps__outq_frame_shm(&k->out, type, m, dlen, pos);
  return rc ? rc : 1;
}

int ps__queue_frame(ps_client *c, ps__conn *k, unsigned type, const ProtobufCMessage *m,
                    const float *const *data, const uint64_t *counts, size_t nseg) {
  int rc = queue_shm(k, type, m, data, counts, nseg);
  /* Sent at once, not with the request's last frame: psd applies this
   * frame's data while we copy the next one into the ring. */
  if (rc == 1) return ps__conn_flush(c, k);
  if (rc == 0) rc = ps__outq_frame(&k->out, type, m, data, counts, NULL, nseg);
  if (rc == PS_ETOOBIG)
    return ps__seterr(c, rc, "a %s message exceeds the frame limits", ps__msg_name(type));
  if (rc) return ps__seterr(c, rc, "out of memory queueing a message");
  return 0;
}

uint8_t *ps__push_reserve(ps__conn *k, uint64_t len, uint64_t *pos) {
  if (!k->shm.map || k->hold.len || !len) return NULL;
  return ps__shm_reserve(&k->shm.push, ps__shm_load(k->shm.push_done), len, pos);
}

uint8_t *ps__push_hold_take(ps__conn *k, uint64_t len) {
  uint64_t pos;
  uint8_t *d = ps__push_reserve(k, len, &pos);
  if (d) k->hold = (ps__push_hold){pos, len};
  return d;
}

uint8_t *ps__push_held(const ps__conn *k) {
  return k->shm.push.base + k->hold.pos % k->shm.push.size; /* reserved: never wraps */
}

void ps__push_hold_drop(ps__conn *k) { k->hold = (ps__push_hold){0, 0}; }

int ps__push_hold_queue(ps__conn *k, unsigned type, const ProtobufCMessage *m, uint64_t skip) {
  int rc = ps__outq_frame_shm(&k->out, type, m, k->hold.len - skip, k->hold.pos + skip);
  if (rc == 0) ps__push_hold_drop(k);
  return rc;
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
  snprintf(msg, sizeof msg, "connection to ps %d at %.200s lost: %.300s", k->index, k->addr,
           why);
  /* Fail the requests still waiting for this server. */
  break_ctx b = {k->index, code, msg};
  ps__req_each(c, fail_if_waiting, &b);
  snprintf(c->errmsg, sizeof c->errmsg, "%s", msg);
}

int ps__proto_err(ps_client *c, ps__conn *k, const char *msg) {
  char e[700];
  snprintf(e, sizeof e, "ps %d at %s broke the protocol: %s", k->index, k->addr, msg);
  ps__conn_break(c, k, PS_EPROTO, e);
  return PS_EPROTO;
}

void ps__conn_free(ps__conn *k) {
  if (k->fd >= 0) close(k->fd);
  k->fd = -1;
  ps__outq_free(&k->out);
  free(k->in);
  free(k->dst);
  free(k->discard);
  free(k->wire16);
  free(k->widen);
  ps__push_hold_drop(k);
  ps__shm_unmap(&k->shm);
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

/* One pass over host's addresses: 0 (k->fd set), -1 with why in last, or
 * PS_ENOMEM when the resolver ran out of memory (not worth retrying). */
static int try_connect(ps__conn *k, const char *host, const char *port, char *last,
                       size_t lastlen) {
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int g = getaddrinfo(host, port, &hints, &res);
  if (g != 0) {
    snprintf(last, lastlen, "%s", gai_strerror(g));
    return g == EAI_MEMORY ? PS_ENOMEM : -1;
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
  double start = ps__now(), logged = start;
  char last[256] = "no attempt";
  ps__backoff b;
  ps__backoff_init(&b, PS__CONNECT_RETRY_FIRST_S, PS__CONNECT_RETRY_MAX_S);
  for (;;) {
    int rc = try_connect(k, host, ports, last, sizeof last);
    if (rc == 0) return 0;
    if (rc == PS_ENOMEM)
      return ps__seterr(c, rc, "cannot resolve ps %d at %s: %s", k->index, k->addr, last);
    double now = ps__now();
    if (now - logged >= PS__CONNECT_LOG_S) {
      /* The library has no logger: stderr is where a worker's launcher
       * (psrun, Slurm) shows it, prefixed like the worker's own lines. */
      fprintf(stderr, "psclient: worker %d: still trying to reach ps %d at %s after %.0f s "
              "of the %.0f s connect timeout: %s\n", c->worker_index, k->index, k->addr,
              now - start, c->connect_timeout_ms / 1000.0, last);
      logged = now;
    }
    if (ps__backoff_sleep(&b, deadline) < 0)
      return ps__seterr(c, PS_ECONNECT, "could not connect to ps %d at %s within %.0f s: %s",
                        k->index, k->addr, c->connect_timeout_ms / 1000.0, last);
  }
}
