/* shmgate.c - the shared-memory handover socket (see shmgate.h). */
#define _GNU_SOURCE
#include "shmgate.h"

#include <errno.h>
#include <event2/event.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "psdlog.h"

static void peer_close(psd_shmgate_peer *p) {
  if (p->fd < 0) return;
  if (p->ev) event_free(p->ev);
  p->ev = NULL;
  close(p->fd);
  p->fd = -1;
}

/* The worker connection that announced token and has not used it. */
static psd_conn *find_token(psd_shmgate *g, const uint8_t *token) {
  for (psd_conn *c = g->conns->head; c; c = c->next)
    if (!c->dead && c->shm_offered && ps__mac_equal(c->shm_token, token, PS__SHM_TOKEN_BYTES))
      return c;
  return NULL;
}

/* 0 when the peer on fd runs as psd's uid, else PS_EAUTH with a sentence
 * in err. Checked at accept, so that another user's connections never
 * take one of the PSD_SHM_MAX_PENDING slots. */
static int peer_uid_ok(int fd, char *err, size_t errlen) {
  struct ucred cr;
  socklen_t crl = sizeof cr;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &crl) != 0) {
    snprintf(err, errlen, "cannot tell the peer's uid: %s", strerror(errno));
    return PS_EAUTH;
  }
  if (cr.uid != geteuid()) {
    snprintf(err, errlen, "uid %u may not hand psd (uid %u) shared memory", (unsigned)cr.uid,
             (unsigned)geteuid());
    return PS_EAUTH;
  }
  return 0;
}

/* Answers the peer on fd (status and sentence); a peer that does not
 * read its answer loses it. */
static void answer(int fd, int status, const char *why) {
  uint8_t out[PS__SHM_REPLY_MAX];
  size_t len = ps__shm_reply_encode(out, status, why);
  ssize_t w = send(fd, out, len, MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)w;
}

/* Checks one handover message and attaches its segment: 0 or a PS_E*
 * code with a sentence in err. */
static int handover(psd_shmgate *g, const uint8_t *buf, ssize_t n, int ctrunc,
                    const int *fds, int nfds, char *err, size_t errlen) {
  uint8_t token[PS__SHM_TOKEN_BYTES];
  uint64_t push, pull;
  int rc = ps__shm_hello_decode(buf, (size_t)n, token, &push, &pull, err, errlen);
  if (rc) return rc;
  if (ctrunc && nfds == 0) {
    /* The kernel dropped the descriptor: psd is at its descriptor limit
     * (a flood of connections). Make room and let the worker try again;
     * its token stays good. */
    psd_conns_evict_oldest(g->conns, "out of descriptors for a shared-memory handover");
    snprintf(err, errlen, "psd had no free descriptor for the segment (at its descriptor "
             "limit); try again");
    return PS_EBUSY;
  }
  if (ctrunc || nfds != 1) {
    snprintf(err, errlen, "a handover carries exactly one descriptor (this one %s%d)",
             ctrunc ? "more than " : "", nfds);
    return PS_EINVAL;
  }
  psd_conn *c = find_token(g, token);
  if (!c) {
    snprintf(err, errlen, "no connection announced this token (used already, or closed)");
    return PS_EAUTH;
  }
  c->shm_offered = 0; /* one try per announced token */
  memset(c->shm_token, 0, sizeof c->shm_token);
  rc = ps__shm_attach(&c->shm, fds[0], push, pull, err, errlen);
  if (rc) {
    psd_warn("%s (%s): shared-memory segment refused: %s", c->name, c->peer, err);
    return rc;
  }
  psd_info("%s: tensors go through shared memory (push ring %llu KiB, pull ring %llu KiB)",
           c->name, (unsigned long long)(push >> 10), (unsigned long long)(pull >> 10));
  return 0;
}

static void on_peer(evutil_socket_t fd, short what, void *arg) {
  (void)what;
  psd_shmgate_peer *p = arg;
  psd_shmgate *g = p->g;
  uint8_t buf[PS__SHM_HELLO_BYTES + 1];
  int fds[PS__SHM_MAX_FDS], nfds = 0, ctrunc = 0;
  ssize_t n = ps__shm_recv_fds(fd, buf, sizeof buf, fds, PS__SHM_MAX_FDS, &nfds, &ctrunc);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n > 0) {
    char err[PS__SHM_REPLY_MAX - 4];
    err[0] = '\0';
    int rc = handover(g, buf, n, ctrunc, fds, nfds, err, sizeof err);
    if (rc) g->refused++;
    else g->attached++;
    answer(fd, rc, err);
  }
  for (int i = 0; i < nfds; i++) close(fds[i]); /* mapped, or refused */
  peer_close(p);
}

static void on_accept(evutil_socket_t lfd, short what, void *arg) {
  (void)what;
  psd_shmgate *g = arg;
  for (int k = 0; k < PSD_SHM_MAX_PENDING; k++) {
    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE) &&
        psd_conns_evict_oldest(g->conns, "out of descriptors for a shared-memory handover"))
      continue; /* as psd's own accept: an unauthenticated connection makes room */
    if (fd < 0) return; /* EAGAIN, or out of descriptors: the tick frees some */
    char err[200];
    if (peer_uid_ok(fd, err, sizeof err) != 0) {
      g->refused++;
      answer(fd, PS_EAUTH, err);
      close(fd);
      continue;
    }
    psd_shmgate_peer *slot = NULL, *oldest = NULL;
    for (int i = 0; i < PSD_SHM_MAX_PENDING && !slot; i++) {
      psd_shmgate_peer *p = &g->peers[i];
      if (p->fd < 0) slot = p;
      else if (!oldest || p->since < oldest->since) oldest = p;
    }
    if (!slot) { /* full: the oldest waiting handover goes */
      peer_close(oldest);
      slot = oldest;
    }
    slot->fd = fd;
    slot->since = ps__now();
    slot->g = g;
    slot->ev = event_new(g->base, fd, EV_READ | EV_PERSIST, on_peer, slot);
    if (!slot->ev || event_add(slot->ev, NULL) != 0) {
      /* The worker hears why (it fails with PS_ENOMEM, or takes TCP). */
      g->refused++;
      psd_warn("out of memory for a shared-memory handover; refusing it");
      answer(fd, PS_ENOMEM, "psd is out of memory for a shared-memory handover");
      peer_close(slot);
    }
  }
}

void psd_shmgate_off(psd_shmgate *g) {
  memset(g, 0, sizeof *g);
  g->lfd = -1;
  for (int i = 0; i < PSD_SHM_MAX_PENDING; i++) g->peers[i].fd = -1;
}

int psd_shmgate_open(psd_shmgate *g, struct event_base *base, psd_conns *conns, char *err,
                     size_t errlen) {
  psd_shmgate_off(g);
  g->base = base;
  g->conns = conns;
  ps__shm_host_id(g->host_id, sizeof g->host_id);
  uint8_t rnd[8];
  if (ps__random(rnd, sizeof rnd) != 0) {
    snprintf(err, errlen, "no random bytes for the socket's name");
    return -1;
  }
  /* Abstract: no file to clean up, gone with psd; random, so it cannot be
   * taken in advance; per network namespace, so a worker that reaches it
   * shares psd's node and namespace. */
  int len = snprintf(g->name, sizeof g->name, "psd-shm-%d-", (int)getpid());
  for (int i = 0; i < 8; i++) len += snprintf(g->name + len, sizeof g->name - (size_t)len,
                                              "%02x", rnd[i]);
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  memcpy(a.sun_path + 1, g->name, (size_t)len);
  socklen_t alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)len);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, alen) != 0 ||
      listen(fd, PSD_SHM_MAX_PENDING) != 0) {
    snprintf(err, errlen, "cannot listen on the unix socket @%s: %s", g->name, strerror(errno));
    if (fd >= 0) close(fd);
    g->name[0] = '\0';
    return -1;
  }
  g->lev = event_new(base, fd, EV_READ | EV_PERSIST, on_accept, g);
  if (!g->lev || event_add(g->lev, NULL) != 0) {
    snprintf(err, errlen, "out of memory");
    if (g->lev) event_free(g->lev);
    g->lev = NULL;
    close(fd);
    return -1;
  }
  g->lfd = fd;
  return 0;
}

void psd_shmgate_tick(psd_shmgate *g, double now) {
  for (int i = 0; i < PSD_SHM_MAX_PENDING; i++)
    if (g->peers[i].fd >= 0 && now - g->peers[i].since > PSD_SHM_HANDOVER_S)
      peer_close(&g->peers[i]);
}

void psd_shmgate_close(psd_shmgate *g) {
  for (int i = 0; i < PSD_SHM_MAX_PENDING; i++) peer_close(&g->peers[i]);
  if (g->lev) event_free(g->lev);
  g->lev = NULL;
  if (g->lfd >= 0) close(g->lfd);
  g->lfd = -1;
}
