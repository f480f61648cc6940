/* pump.c - the poll loop that drives every connection from the caller's
 * thread (no hidden threads), and the waits built on it: ps_req_wait,
 * ps_req_destroy and the internal wait-then-release. Everything that must
 * block until replies arrive comes here; the files below it (reader,
 * replies, connections, the request table) never wait. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client_internal.h"

int ps__pump(ps_client *c, ps_req *r, double deadline, int wakeable) {
  struct pollfd pfd[64];
  const int nfd = c->num_ps + 1; /* and the wake eventfd, last */
  struct pollfd *p = nfd <= 64 ? pfd : calloc((size_t)nfd, sizeof *p);
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
    p[c->num_ps].fd = wakeable ? c->wake_fd : -1; /* poll skips a negative fd */
    p[c->num_ps].events = POLLIN;
    p[c->num_ps].revents = 0;
    if (r->done) break;
    /* Past the deadline it still polls once without blocking, so that a
     * wait of 0 ms takes what has already arrived. */
    double left = deadline - ps__now();
    int ms = left <= 0 ? 0 : left > 1e6 ? 1000000000 : (int)(left * 1000) + 1;
    int n = poll(p, (nfds_t)nfd, ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      rc = ps__seterr(c, PS_EIO, "poll failed: %s", strerror(errno));
      break;
    }
    for (int i = 0; i < c->num_ps; i++) {
      ps__conn *k = &c->conns[i];
      if (k->fd < 0) continue;
      if (p[i].revents & (POLLIN | POLLHUP | POLLERR)) ps__conn_read(c, k);
      if (k->fd >= 0 && (p[i].revents & POLLOUT)) ps__conn_flush(c, k);
    }
    if (!r->done && (p[c->num_ps].revents & POLLIN)) {
      uint64_t wakes;
      ssize_t got = read(c->wake_fd, &wakes, sizeof wakes); /* drained: one return */
      (void)got;
      rc = ps__seterr(c, PS_ETIMEDOUT, "woken by ps_client_wake before the request completed");
      break;
    }
    if (!r->done && left <= 0) {
      rc = ps__seterr(c, PS_ETIMEDOUT, "timed out waiting for the parameter servers");
      break;
    }
  }
  if (p != pfd) free(p);
  return rc;
}

int ps__req_wait_release(ps_client *c, ps_req *r) {
  int rc = ps_req_wait(r, -1, NULL);
  ps__req_release(c, r);
  return rc;
}

int ps_req_wait(ps_req *r, int timeout_ms, uint64_t *step_out) {
  if (!r) return PS_EINVAL;
  ps_client *c = r->c;
  double deadline = ps__now() + (timeout_ms < 0 ? c->request_timeout_ms : timeout_ms) / 1000.0;
  if (!r->done) {
    /* A bounded wait is a poll a thread may want to end early. */
    int rc = ps__pump(c, r, deadline, timeout_ms >= 0);
    if (rc) return rc;
  }
  if (r->status) {
    /* Its own message: another request may have failed since. */
    if (r->msg[0]) snprintf(c->errmsg, sizeof c->errmsg, "%s", r->msg);
    return r->status;
  }
  if (r->duplicate) { /* before stale, as when it was an error status */
    snprintf(c->errmsg, sizeof c->errmsg, "%s", r->msg);
    return PS_EDUPLICATE;
  }
  if (r->stale) {
    snprintf(c->errmsg, sizeof c->errmsg, "gradient was stale: the servers had moved on");
    return PS_ESTALE;
  }
  /* A pull's step is its trainable slices' (the training step), or the
   * others' when it named only variables that are not trained. */
  uint64_t st = r->step != UINT64_MAX ? r->step : r->step_nt;
  if (step_out) *step_out = st == UINT64_MAX ? 0 : st;
  return 0;
}

void ps_req_destroy(ps_req *r) {
  if (!r) return;
  ps_client *c = r->c;
  if (!r->done) {
    /* Buffers may still be in use: let it finish (bounded). */
    ps__pump(c, r, ps__now() + c->request_timeout_ms / 1000.0, 0);
  }
  ps__req_release(c, r);
}
