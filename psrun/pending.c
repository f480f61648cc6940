/* pending.c - task 0's connections awaiting their check-in line: accepted
 * in batches, greeted, polled together, dropped at their deadline, the
 * oldest shed for a newer one when the set is full (see pending.h). */
#define _GNU_SOURCE
#include "pending.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"
#include "util.h"

int psr_pending_init(psr_pending *p) {
  memset(p, 0, sizeof *p);
  p->v = calloc(PSR_PENDING_MAX, sizeof *p->v);
  p->pf = calloc(PSR_PENDING_MAX + 1, sizeof *p->pf);
  static const char *const what[PSR_PLOG_KINDS_] = {
      "silent connections dropped", "silent connections shed for newer ones",
      "check-ins refused"};
  for (int k = 0; k < PSR_PLOG_KINDS_; k++)
    p->log[k] = (ps__ratelog){.what = what[k], .level = PS_LOG_INFO, .burst = PSR_PLOG_BURST,
                              .window_s = PSR_PLOG_WINDOW_S};
  return p->v && p->pf ? 0 : -1;
}

void psr_pending_free(psr_pending *p) {
  for (int i = 0; i < p->n; i++) psr_conn_close(&p->v[i].c);
  double now = ps__now();
  for (int k = 0; k < PSR_PLOG_KINDS_; k++) ps__ratelog_flush(&p->log[k], now, 1);
  free(p->v);
  free(p->pf);
  memset(p, 0, sizeof *p);
}

int psr_pending_poll(psr_pending *p, int lfd, double until) {
  double now = ps__now(), wake = now + PSR_PLOG_WINDOW_S; /* summaries come on time */
  if (until < wake) wake = until;
  p->pf[0] = (struct pollfd){lfd, POLLIN, 0};
  for (int i = 0; i < p->n; i++) {
    p->pf[i + 1] = (struct pollfd){p->v[i].c.fd, POLLIN, 0};
    if (p->v[i].deadline < wake) wake = p->v[i].deadline;
  }
  int ms = wake > now ? (int)((wake - now) * 1000) + 1 : 0;
  if (poll(p->pf, (nfds_t)p->n + 1, ms) < 0) memset(p->pf, 0, (size_t)(p->n + 1) * sizeof *p->pf);
  for (int i = 0; i < p->n; i++) p->v[i].ready = p->pf[i + 1].revents;
  now = ps__now();
  for (int k = 0; k < PSR_PLOG_KINDS_; k++) ps__ratelog_flush(&p->log[k], now, 0);
  return (p->pf[0].revents & POLLIN) != 0;
}

int psr_pending_due(const psr_pending *p, int i, double now) {
  return p->v[i].ready || now >= p->v[i].deadline;
}

void psr_pending_drop(psr_pending *p, int i) {
  psr_conn_close(&p->v[i].c);
  p->v[i] = p->v[--p->n];
}

/* Makes room for one more: the oldest pending connection goes. */
static void shed_oldest(psr_pending *p, double now) {
  int o = 0;
  for (int i = 1; i < p->n; i++)
    if (p->v[i].seq < p->v[o].seq) o = i;
  ps__ratelog_say(&p->log[PSR_PLOG_SHED], now,
                  "closed a silent connection from %s after %.1f s for a newer one: %d "
                  "connections wait for their check-in (at most %d)",
                  p->v[o].addr, now - p->v[o].opened, p->n,
                  PSR_PENDING_MAX);
  psr_pending_drop(p, o);
}

void psr_pending_accept(psr_pending *p, int lfd, const psr_msg *greeting) {
  for (int k = 0; k < PSR_ACCEPT_BATCH; k++) {
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) return; /* drained (EAGAIN), or out of descriptors: the next pass retries */
    double now = ps__now();
    if (p->n >= PSR_PENDING_MAX) shed_oldest(p, now);
    psr_pending_conn *q = &p->v[p->n++];
    memset(q, 0, sizeof *q);
    q->c = (psr_conn){fd, NULL, 0, 0};
    q->seq = ++p->seq;
    q->opened = now;
    q->deadline = now + PSR_CHECKIN_LINE_S;
    psr_peer_name(fd, q->addr, sizeof q->addr);
    psr_msg_send(fd, greeting);
  }
}

char *psr_pending_line(psr_pending *p, int i, int *eof) {
  return psr_conn_read_line(&p->v[i].c, 0, eof);
}

void psr_pending_silent(psr_pending *p, int i, double now) {
  ps__ratelog_say(&p->log[PSR_PLOG_SILENT], now, "dropped a silent connection from %s after %.0f s",
                  p->v[i].addr, PSR_CHECKIN_LINE_S);
}

void psr_pending_refuse(psr_pending *p, int i, const char *why) {
  ps__ratelog_say(&p->log[PSR_PLOG_REFUSED], ps__now(), "refused a check-in from %s: %s",
                  p->v[i].addr, why);
  psr_send_text(p->v[i].c.fd, PSR_MSG_REJECT, "%s", why);
}
