/* admin.c - one blocking request/reply exchange with a psd as an admin
 * peer (ROLE_ADMIN): connect, authenticate like a worker, send one
 * message, read its answer. Used by psctl, and by psrun when psd outlives
 * the workers; nothing here is on the training path. */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ps.pb-c.h"
#include "admin.h"
#include "backoff.h"

/* Largest reply an admin tool reads: Stats of 1M workers is ~60 MB of
 * protobuf, more than any frame may carry anyway. */
#define PS__ADMIN_MAX_REPLY PS__MAX_META
/* Waits before a handshake psd closed is tried again (it shed us under a
 * flood): from 20 ms, doubling to 0.5 s, jittered, within the exchange's
 * timeout. */
#define PS__ADMIN_RETRY_FIRST_S 0.02
#define PS__ADMIN_RETRY_MAX_S 0.5

static int wait_fd(int fd, short ev, double deadline) {
  for (;;) {
    double left = deadline - ps__now();
    if (left <= 0) return PS_ETIMEDOUT;
    struct pollfd p = {fd, ev, 0};
    int n = poll(&p, 1, (int)(left * 1000) + 1);
    if (n > 0) return 0;
    if (n < 0 && errno != EINTR) return PS_EIO;
  }
}

static int io_all(int fd, void *buf, size_t len, int wr, double deadline) {
  size_t done = 0;
  while (done < len) {
    int rc = wait_fd(fd, wr ? POLLOUT : POLLIN, deadline);
    if (rc) return rc;
    ssize_t n = wr ? send(fd, (char *)buf + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                   : recv(fd, (char *)buf + done, len - done, MSG_DONTWAIT);
    if (n > 0) done += (size_t)n;
    else if (n == 0) return PS_ECLOSED;
    else if (errno != EAGAIN && errno != EINTR) return PS_ECLOSED;
  }
  return 0;
}

static int send_msg(int fd, unsigned type, const ProtobufCMessage *m, double deadline) {
  size_t len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(PS__HEADER_SIZE + len);
  if (!buf) return PS_ENOMEM;
  ps__header_encode(buf, type, (uint32_t)len, 0);
  protobuf_c_message_pack(m, buf + PS__HEADER_SIZE);
  int rc = io_all(fd, buf, PS__HEADER_SIZE + len, 1, deadline);
  free(buf);
  return rc;
}

/* Reads one frame's header and protobuf part (no data expected). */
static int recv_msg(int fd, int handshaken, ps__frame_header *h, uint8_t **meta,
                    double deadline, char *err, size_t errlen) {
  uint8_t hb[PS__HEADER_SIZE];
  int rc = io_all(fd, hb, sizeof hb, 0, deadline);
  if (rc) return rc;
  rc = ps__header_decode(hb, handshaken, h, err, errlen);
  if (rc) return rc;
  if (h->data_len || h->meta_len > PS__ADMIN_MAX_REPLY) {
    snprintf(err, errlen, "unexpected %s frame with %llu data bytes", ps__msg_name(h->type),
             (unsigned long long)h->data_len);
    return PS_EPROTO;
  }
  *meta = malloc(h->meta_len ? h->meta_len : 1);
  if (!*meta) return PS_ENOMEM;
  rc = io_all(fd, *meta, h->meta_len, 0, deadline);
  if (rc) {
    free(*meta);
    *meta = NULL;
  }
  return rc;
}

/* An Error frame's sentence into err; returns its code. */
static int error_reply(const uint8_t *meta, size_t len, const char *addr, char *err,
                       size_t errlen) {
  Ps__Error *e = ps__error__unpack(NULL, len, meta);
  if (!e) {
    snprintf(err, errlen, "%s sent a malformed error", addr);
    return PS_EPROTO;
  }
  int code = e->code < 0 ? e->code : PS_EPROTO;
  snprintf(err, errlen, "%s: %s", addr, e->message ? e->message : ps_strerror(code));
  ps__error__free_unpacked(e, NULL);
  return code;
}

static int connect_to(const char *addr, double deadline, int *fd_out, char *err,
                      size_t errlen) {
  char host[256], port[16];
  int p;
  if (ps__parse_hostport(addr, host, sizeof host, &p)) {
    snprintf(err, errlen, "'%s' is not HOST:PORT", addr);
    return PS_EINVAL;
  }
  snprintf(port, sizeof port, "%d", p);
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int g = getaddrinfo(host, port, &hints, &res);
  if (g) {
    snprintf(err, errlen, "cannot resolve %s: %s", host, gai_strerror(g));
    return PS_ECONNECT;
  }
  int rc = PS_ECONNECT;
  snprintf(err, errlen, "cannot connect to %s", addr);
  for (struct addrinfo *a = res; a && rc; a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      snprintf(err, errlen, "cannot connect to %s: %s", addr, strerror(errno));
      close(fd);
      continue;
    }
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    if (wait_fd(fd, POLLOUT, deadline) != 0 ||
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0 || soerr) {
      snprintf(err, errlen, "cannot connect to %s: %s", addr,
               soerr ? strerror(soerr) : "timed out");
      close(fd);
      continue;
    }
    *fd_out = fd;
    rc = 0;
  }
  freeaddrinfo(res);
  return rc;
}

/* Connects to addr and completes the admin handshake (the same mutual
 * handshake as a worker's, wire/handshake.c: psd must prove the secret
 * before we show it anything). A handshake psd closed without an Error
 * (it shed our connection for a newer one at its caps under a flood) is
 * tried again on a fresh connection, with backoff, until deadline. fd, or
 * -1 with *rc and err. */
static int admin_open(const char *addr, const ps__auth *auth, double deadline, int *rc,
                      char *err, size_t errlen) {
  ps__backoff b;
  ps__backoff_init(&b, PS__ADMIN_RETRY_FIRST_S, PS__ADMIN_RETRY_MAX_S);
  for (;;) {
    int fd = -1;
    if ((*rc = connect_to(addr, deadline, &fd, err, errlen)) != 0) return -1;
    Ps__Hello h = PS__HELLO__INIT;
    h.protocol_version = PS__PROTOCOL_VERSION;
    h.role = PS__ROLE__ROLE_ADMIN;
    h.client_id = "psctl";
    Ps__HelloReply *hr = NULL;
    *rc = ps__handshake(fd, auth, &h, addr, deadline, &hr, err, errlen);
    if (hr) ps__hello_reply__free_unpacked(hr, NULL);
    if (*rc == 0) return fd;
    close(fd);
    if (*rc != PS_ECLOSED || ps__backoff_sleep(&b, deadline) < 0) return -1;
  }
}

int ps__admin_stats(const char *addr, const ps__auth *auth, int timeout_ms,
                    Ps__StatsReply **out, char *err, size_t errlen) {
  *out = NULL;
  double deadline = ps__now() + timeout_ms / 1000.0;
  int rc;
  int fd = admin_open(addr, auth, deadline, &rc, err, errlen);
  if (fd < 0) return rc;
  uint8_t *meta = NULL;
  ps__frame_header fh;
  char derr[256] = "";
  Ps__Stats st = PS__STATS__INIT;
  st.request_id = 1;
  if (!rc) rc = send_msg(fd, PS__MSG_STATS, &st.base, deadline);
  if (!rc) rc = recv_msg(fd, 1, &fh, &meta, deadline, derr, sizeof derr);
  if (!rc && fh.type == PS__MSG_ERROR) rc = error_reply(meta, fh.meta_len, addr, err, errlen);
  else if (!rc && fh.type != PS__MSG_STATS_REPLY) {
    snprintf(err, errlen, "%s answered STATS with %s (an older psd?)", addr,
             ps__msg_name(fh.type));
    rc = PS_EPROTO;
  } else if (!rc && !(*out = ps__stats_reply__unpack(NULL, fh.meta_len, meta))) {
    snprintf(err, errlen, "%s sent a malformed STATS_REPLY", addr);
    rc = PS_EPROTO;
  }
  if (rc && derr[0]) snprintf(err, errlen, "%s: %s", addr, derr);
  else if (rc == PS_ETIMEDOUT) snprintf(err, errlen, "%s did not answer within %d ms", addr, timeout_ms);
  else if (rc == PS_ECLOSED)
    snprintf(err, errlen, "%s closed the connection (not a psd, or it refused us)", addr);
  free(meta);
  close(fd);
  return rc;
}
