/* pace.c - ingress pacing of synchronous pushes (see pace.h). */
#include "pace.h"

#include <errno.h>
#include <event2/event.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "conn.h"
#include "log.h"
#include "server.h"

/* Bytes of the current step's Push that c has delivered, or UINT64_MAX if c
 * is not in the middle of a Push. */
static uint64_t progress(const psd_conn *c) {
  if (c->dead || c->pace_exempt || c->state != PSD_CONN_DATA || c->hdr.type != PS__MSG_PUSH)
    return UINT64_MAX;
  return c->pace_done + c->item_got;
}

static int enabled(const psd_server *srv) {
  return srv->cfg->pace_ahead > 0 && srv->job.pinned && !srv->shard.async_mode &&
         srv->shard.replicas == srv->job.num_workers && srv->job.num_workers > 1;
}

/* Progress of the slowest worker pushing `step` (UINT64_MAX: none). */
static uint64_t slowest(const psd_server *srv, uint64_t step) {
  uint64_t min = UINT64_MAX;
  for (const psd_conn *o = srv->conns; o; o = o->next) {
    uint64_t p = o->worker >= 0 && o->data_step == step ? progress(o) : UINT64_MAX;
    if (p < min) min = p;
  }
  return min;
}

/* 1 if c, with progress mine, is more than pace_ahead bytes ahead of min,
 * the slowest progress on its step (c's own included: it is never ahead of
 * itself, so this is the same as comparing with the others). */
static int ahead_of(const psd_server *srv, uint64_t mine, uint64_t min) {
  return mine != UINT64_MAX && mine - min > (uint64_t)srv->cfg->pace_ahead;
}

/* 1 if fd's peer is on this host (127.0.0.0/8, ::1, or v4-mapped 127/8). */
static int loopback_peer(int fd) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getpeername(fd, (struct sockaddr *)&ss, &len) != 0) return 0;
  if (ss.ss_family == AF_INET)
    return (ntohl(((struct sockaddr_in *)&ss)->sin_addr.s_addr) >> 24) == 127;
  if (ss.ss_family == AF_INET6) {
    const struct in6_addr *a = &((struct sockaddr_in6 *)&ss)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
  }
  return 0;
}

void psd_pace_joined(psd_server *srv, psd_conn *c) {
  c->pace_exempt = !srv->cfg->pace_loopback && loopback_peer(c->fd);
  if (c->pace_exempt) return; /* autotuned buffer: loopback is CPU, not a link */
  int b = srv->cfg->recv_buf;
  if (enabled(srv) && b > 0 && setsockopt(c->fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b) != 0)
    psd_warn("%s: cannot set the receive buffer to %d bytes: %s", c->name, b, strerror(errno));
}

int psd_pace_hold(psd_server *srv, psd_conn *c) {
  if (c->pace_paused) return 1;
  if (!enabled(srv)) return 0;
  uint64_t mine = progress(c);
  if (mine == UINT64_MAX || !ahead_of(srv, mine, slowest(srv, c->data_step))) return 0;
  c->pace_paused = 1;
  srv->pace_paused++;
  event_del(c->rev);
  return 1;
}

void psd_pace_resume(psd_server *srv) {
  if (srv->pace_paused == 0) return;
  int on = enabled(srv);
  /* Paused connections are almost always on one step: one scan for its
   * slowest, not one per connection (W^2 with many workers). */
  uint64_t step = 0, min = 0;
  int have = 0;
  for (psd_conn *c = srv->conns; c; c = c->next) {
    if (!c->pace_paused) continue;
    if (!have || c->data_step != step) {
      step = c->data_step;
      min = slowest(srv, step);
      have = 1;
    }
    if (!c->dead && on && ahead_of(srv, progress(c), min)) continue;
    c->pace_paused = 0;
    srv->pace_paused--;
    if (!c->dead && !c->read_paused) event_add(c->rev, NULL);
  }
}
