/* pace.c - ingress pacing of synchronous pushes (see pace.h). */
#include "pace.h"

#include <errno.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "psdlog.h"

void psd_pace_init(psd_pace *pc, int ahead, int loopback, int recv_buf,
                   psd_pace_progress_fn *progress) {
  memset(pc, 0, sizeof *pc);
  pc->ahead = ahead > 0 ? (uint64_t)ahead : 0;
  pc->loopback = loopback;
  pc->recv_buf = recv_buf;
  pc->progress = progress;
}

void psd_pace_pin(psd_pace *pc, int async_mode, uint32_t replicas, uint32_t num_workers) {
  pc->on = !async_mode && replicas == num_workers && num_workers > 1;
}

static int enabled(const psd_pace *pc) { return pc->ahead > 0 && pc->on; }

/* Bytes of the current step's Push that p has delivered (UINT64_MAX: not
 * in a Push, or never paced). */
static uint64_t progress(const psd_pace *pc, const psd_pace_peer *p, uint64_t *step) {
  *step = 0;
  uint64_t v = pc->progress(p, step);
  return p->exempt ? UINT64_MAX : v;
}

/* Progress of the slowest worker pushing `step` (UINT64_MAX: none). */
static uint64_t slowest(const psd_pace *pc, uint64_t step) {
  uint64_t min = UINT64_MAX;
  for (const psd_pace_peer *o = pc->peers; o; o = o->next) {
    uint64_t s, p = progress(pc, o, &s);
    if (s == step && p < min) min = p;
  }
  return min;
}

/* 1 if a peer with progress mine is more than ahead bytes ahead of min,
 * the slowest progress on its step (its own included: it is never ahead of
 * itself, so this is the same as comparing with the others). */
static int ahead_of(const psd_pace *pc, uint64_t mine, uint64_t min) {
  return mine != UINT64_MAX && mine - min > pc->ahead;
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

void psd_pace_joined(psd_pace *pc, psd_pace_peer *p, int fd, const char *name) {
  if (!p->joined) {
    p->joined = 1;
    p->prev = NULL;
    p->next = pc->peers;
    if (pc->peers) pc->peers->prev = p;
    pc->peers = p;
  }
  p->exempt = !pc->loopback && loopback_peer(fd);
  if (p->exempt) return; /* autotuned buffer: loopback is CPU, not a link */
  int b = pc->recv_buf;
  if (enabled(pc) && b > 0 && setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b) != 0)
    psd_warn("%s: cannot set the receive buffer to %d bytes: %s", name, b, strerror(errno));
}

void psd_pace_left(psd_pace *pc, psd_pace_peer *p) {
  if (p->paused) {
    p->paused = 0;
    pc->paused--;
  }
  if (!p->joined) return;
  if (p->prev) p->prev->next = p->next;
  else pc->peers = p->next;
  if (p->next) p->next->prev = p->prev;
  p->prev = p->next = NULL;
  p->joined = 0;
}

int psd_pace_hold(psd_pace *pc, psd_pace_peer *p) {
  if (p->paused) return 1;
  if (!enabled(pc)) return 0;
  uint64_t step, mine = progress(pc, p, &step);
  if (mine == UINT64_MAX || !ahead_of(pc, mine, slowest(pc, step))) return 0;
  p->paused = 1;
  pc->paused++;
  return 1;
}

psd_pace_peer *psd_pace_resume(psd_pace *pc) {
  psd_pace_peer *out = NULL;
  if (pc->paused == 0) return NULL;
  int on = enabled(pc);
  /* Paused peers are almost always on one step: one scan for its slowest,
   * not one per peer (W^2 with many workers). */
  uint64_t step = 0, min = 0;
  int have = 0;
  for (psd_pace_peer *p = pc->peers; p; p = p->next) {
    if (!p->paused) continue;
    uint64_t s, mine = progress(pc, p, &s);
    if (!have || s != step) {
      step = s;
      min = slowest(pc, step);
      have = 1;
    }
    if (on && ahead_of(pc, mine, min)) continue;
    p->paused = 0;
    pc->paused--;
    p->resume_next = out;
    out = p;
  }
  return out;
}
