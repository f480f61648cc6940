/* shmsetup.c - the worker's side of the shared-memory transport (protocol 2.4,
 * docs/protocol.md §1a): after the handshake with a ps of this node that
 * offers it, a sealed memfd goes to psd over its abstract unix socket with
 * the token from the HelloReply; from then on Push and Init data are
 * written into the segment's push ring and PullReply data read from its
 * pull ring (srvconn.c, reader.c), while every frame still travels over TCP.
 * Under PS_TRANSPORT_SHM any failure here fails ps_client_create; under
 * auto the connection stays on TCP. */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "client_internal.h"

/* Connects to psd's abstract handover socket `name` with send and receive
 * timeouts of ms; the socket, or -1 with err. */
static int gate_connect(const char *name, int ms, char *err, size_t errlen) {
  struct sockaddr_un a;
  size_t n = strlen(name);
  if (n + 1 >= sizeof a.sun_path) {
    snprintf(err, errlen, "its handover socket name is too long (%zu bytes)", n);
    return -1;
  }
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  memcpy(a.sun_path + 1, name, n);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(err, errlen, "unix socket: %s", strerror(errno));
    return -1;
  }
  struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, (struct sockaddr *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) +
                                                      1 + n)) != 0) {
    snprintf(err, errlen, "cannot reach its handover socket @%s: %s (another network "
             "namespace?)", name, strerror(errno));
    close(fd);
    return -1;
  }
  /* The socket's owner gets our segment: it must be our own uid (a socket
   * of another user cannot be psd's, whose name came over the
   * authenticated connection). */
  struct ucred cr;
  socklen_t crl = sizeof cr;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &crl) != 0 || cr.uid != geteuid()) {
    snprintf(err, errlen, "its handover socket @%s belongs to uid %u, not ours (%u)", name,
             (unsigned)cr.uid, (unsigned)geteuid());
    close(fd);
    return -1;
  }
  return fd;
}

/* Sends the handover (token, ring sizes, the memfd) and reads psd's
 * answer. 0, or a PS_E* code with err. */
static int handover(int s, int memfd, const Ps__HelloReply *r, uint64_t push, uint64_t pull,
                    char *err, size_t errlen) {
  uint8_t msg[PS__SHM_HELLO_BYTES];
  ps__shm_hello_encode(msg, r->shm_token.data, push, pull);
  char why[PS__SHM_REPLY_MAX];
  int st = ps__shm_handover(s, msg, sizeof msg, &memfd, 1, why, sizeof why);
  if (st == PS_EIO || st == PS_ETIMEDOUT) snprintf(err, errlen, "%s", why);
  else if (st != 0) snprintf(err, errlen, "psd refused the segment: %.400s", why);
  return st <= 0 ? st : PS_EPROTO;
}

/* Creates the segment and hands it over; 0, or a PS_E* code with err
 * (nothing left mapped). */
static int attach(ps__conn *k, const Ps__HelloReply *r, double deadline, char *err,
                  size_t errlen) {
  uint64_t push = PS__SHM_RING_DEFAULT, pull = PS__SHM_RING_DEFAULT;
  int memfd = ps__shm_create(&k->shm, push, pull, err, errlen);
  if (memfd < 0) return memfd;
  ps__backoff b;
  ps__backoff_init(&b, PS__HANDSHAKE_RETRY_FIRST_S, PS__HANDSHAKE_RETRY_MAX_S);
  int rc;
  do { /* PS_EBUSY: psd was at its descriptor limit and made room */
    double left = deadline - ps__now();
    int ms = left * 1000 < PS__SHM_HANDOVER_MS ? (int)(left * 1000) : PS__SHM_HANDOVER_MS;
    int s = gate_connect(r->shm_socket, ms > 1 ? ms : 1, err, errlen);
    rc = s < 0 ? PS_ECONNECT : handover(s, memfd, r, push, pull, err, errlen);
    if (s >= 0) close(s);
  } while (rc == PS_EBUSY && ps__backoff_sleep(&b, deadline) >= 0);
  close(memfd); /* psd has its own mapping; ours stays */
  if (rc) ps__shm_unmap(&k->shm);
  return rc;
}

int ps__shm_setup(ps_client *c, ps__conn *k, const Ps__HelloReply *r, double deadline) {
  if (c->transport == PS_TRANSPORT_TCP) return 0;
  char why[600], mine[PS__SHM_HOST_ID_MAX];
  int same_node = 0, rc = 0;
  ps__shm_host_id(mine, sizeof mine);
  if (!r->shm_socket || !r->shm_socket[0] || r->shm_token.len != PS__SHM_TOKEN_BYTES)
    snprintf(why, sizeof why, "it offers no shared memory (psd --transport tcp, or older "
             "than protocol 2.4)");
  else if (!r->host_id || strcmp(r->host_id, mine) != 0)
    snprintf(why, sizeof why, "it runs on another node (boot id %.64s, ours %.64s)",
             r->host_id ? r->host_id : "?", mine);
  else if ((same_node = 1, (rc = attach(k, r, deadline, why, sizeof why)) == 0))
    return 0;
  if (rc == PS_ETIMEDOUT)
    /* psd may be using the segment for this connection's replies: TCP
     * alone would then read data it was never sent. */
    return ps__seterr(c, PS_ETIMEDOUT,
                      "ps %d at %s: %s, and it may have taken the segment, so this "
                      "connection cannot fall back to TCP", k->index, k->addr, why);
  if (c->transport == PS_TRANSPORT_SHM && rc == PS_ENOMEM) /* here or at psd */
    return ps__seterr(c, PS_ENOMEM, "ps %d at %s: out of memory setting up shared memory: %s",
                      k->index, k->addr, why);
  if (c->transport == PS_TRANSPORT_SHM)
    return ps__seterr(c, PS_EUNSUPPORTED,
                      "ps %d at %s: the shared-memory transport was asked for "
                      "(PS_TRANSPORT=shm / --transport shm) but %s", k->index, k->addr, why);
  /* auto: TCP. Unremarkable for a ps elsewhere; said for one on this node. */
  if (same_node)
    fprintf(stderr, "psclient: worker %d: ps %d at %s: shared memory failed, using TCP: %s\n",
            c->worker_index, k->index, k->addr, why);
  return 0;
}
