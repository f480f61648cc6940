/* server.c - listener, workers' lifecycle, timers, exit decisions. */
#define _GNU_SOURCE
#include "server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "conn.h"
#include "log.h"
#include "pace.h"

/* Timer period for deadlines, stall checks and the grace period: fine
 * enough that a 1 s deadline is honoured within 10%. */
#define PSD_TICK_MS 100
/* Seconds allowed for the last replies to drain before exiting. */
#define PSD_DRAIN_MAX_S 5.0
/* Seconds a new connection has to complete its handshake. */
#define PSD_HANDSHAKE_TIMEOUT_S 10.0
/* Workers named in one stall log line before "and N more". */
#define PSD_STALL_NAMES 16

static void set_sockopts(int fd, int sndbuf) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (sndbuf > 0) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
}

void psd_server_finish(psd_server *srv, int code) {
  if (srv->exiting) return;
  srv->exit_code = code;
  srv->exiting = 1;
  srv->exiting_since = ps__now();
  /* Stop accepting; let queued replies (FINISH acks) drain, then leave. */
  if (srv->listen_ev) event_del(srv->listen_ev);
  int pending = 0;
  for (psd_conn *c = srv->conns; c; c = c->next)
    if (psd_conn_pending(c)) pending = 1;
  if (!pending) event_base_loopbreak(srv->base);
}

void psd_server_act(psd_server *srv, unsigned actions) {
  /* Parked pulls would wait for steps that will never come. */
  if (actions & PSD_PERSIST_WAKE_ALL) psd_waiters_wake_all(&srv->waiters);
  if (actions & PSD_PERSIST_EXIT_STOPPED) psd_server_finish(srv, PSD_EXIT_STOPPED);
}

/* ---- workers ------------------------------------------------------------- */




static void detach_slice(void *ctx, psd_slice *sl);

/* Acts on the exit decision after a worker's state changed. */
static void check_done(psd_server *srv) {
  if (srv->exiting) return;
  psd_job_stop st = {srv->persist.stop_wanted, srv->persist.stopped, srv->persist.stop_step};
  int code = psd_job_check(&srv->job, &st);
  if (code == PSD_JOB_GO_ON) return;
  if (code == PSD_EXIT_OK) {
    psd_server_act(srv, psd_persist_final(&srv->persist));
    psd_job_say_done(&srv->job);
  }
  psd_server_finish(srv, code);
}


/* The first worker's Hello pins the job: size everything per worker. */
static int pin(psd_server *srv, const psd_job_terms *t) {
  if (psd_job_pin(&srv->job, t) != 0) return PS_ENOMEM;
  if (psd_telem_pin(&srv->telem, t->num_workers) != 0) {
    psd_job_unpin(&srv->job);
    return PS_ENOMEM;
  }
  psd_shard_init(&srv->shard, t->num_workers, t->replicas, t->async_mode);
  srv->shard.detach = detach_slice;
  srv->shard.detach_ctx = srv;
  return 0;
}

int psd_server_hello(psd_server *srv, psd_conn *c, const Ps__Hello *h, char *err,
                     size_t errlen) {
  psd_job_terms t;
  int rc = psd_job_hello(&srv->job, h, &t, err, errlen);
  if (rc) return rc;
  if (t.admin) {
    c->admin = 1; /* psctl: authenticated, may ask for Stats and nothing else */
    return 0;
  }
  if (t.pin && pin(srv, &t) != 0) {
    snprintf(err, errlen, "out of memory");
    return PS_ENOMEM;
  }
  int rejoin = psd_job_join(&srv->job, t.worker, c->peer);
  c->worker = (int)t.worker;
  snprintf(c->name, sizeof c->name, "w%u", t.worker);
  psd_pace_joined(srv, c);
  psd_info("worker %u %s from %s%s%s", t.worker, rejoin ? "rejoined" : "joined", c->peer,
           h->client_id && h->client_id[0] ? " " : "", h->client_id ? h->client_id : "");
  if (rejoin) check_done(srv);
  return 0;
}

void psd_server_worker_finished(psd_server *srv, psd_conn *c) {
  psd_job_finished(&srv->job, (uint32_t)c->worker);
  check_done(srv);
}

static uint64_t current_step(const psd_server *srv) {
  uint64_t s = UINT64_MAX;
  for (uint32_t i = 0; i < srv->shard.n; i++)
    if (srv->shard.slices[i]->step < s) s = srv->shard.slices[i]->step;
  return s == UINT64_MAX ? 0 : s;
}

void psd_server_conn_closed(psd_server *srv, psd_conn *c) {
  if (c->worker < 0 || !srv->job.pinned || !srv->job.workers[c->worker].connected) return;
  if (c->worker == 0) psd_persist_chief_left(&srv->persist);
  psd_job_left(&srv->job, (uint32_t)c->worker, c->finished, current_step(srv));
  if (!c->finished) check_done(srv);
}

void psd_server_slice_advanced(psd_server *srv, psd_slice *sl) {
  psd_server_act(srv, psd_persist_slice_advanced(&srv->persist, sl));
  psd_waiters_wake(&srv->waiters, sl->id, sl->step);
  if (sl->id == 0 && sl->step > 0 && sl->step % (uint64_t)srv->cfg->log_every == 0 &&
      sl->step != srv->logged_step) {
    srv->logged_step = sl->step;
    uint32_t live = psd_job_live(&srv->job);
    psd_info("step %llu applied (%u of %u workers connected, %llu stale gradients dropped)",
             (unsigned long long)sl->step, live, srv->job.num_workers,
             (unsigned long long)srv->shard.stale_dropped);
  }
}

void psd_server_flush(psd_server *srv) {
  psd_waitset *set;
  while ((set = psd_waiters_next_dirty(&srv->waiters))) {
    psd_conn *c = set->owner;
    psd_conn_flush(c);
    psd_conn_write(c); /* may close c (freed later, by psd_server_reap) */
  }
}

void psd_server_reap(psd_server *srv) {
  while (srv->graveyard) {
    psd_conn *c = srv->graveyard;
    srv->graveyard = c->next;
    psd_conn_free(c);
  }
}

/* Shard hook: queued replies still send sl's parameters in place, and an
 * update is about to change them: give those replies their own copy. */
static void detach_slice(void *ctx, psd_slice *sl) {
  psd_server *srv = ctx;
  for (psd_conn *c = srv->conns; c && sl->readers > 0; c = c->next)
    if (ps__outq_detach(&c->out, sl) < 0)
      psd_conn_error(c, 0, PS_ENOMEM, 1, "out of memory copying a reply");
}

/* ---- timers ------------------------------------------------------------- */

static void check_stalls(psd_server *srv, double now) {
  psd_shard *sh = &srv->shard;
  /* One line per stalled step, naming the missing workers and variables. */
  for (uint32_t i = 0; i < sh->n; i++) {
    psd_slice *sl = sh->slices[i];
    if (sl->count == 0 || now - sl->first_grad_at < srv->cfg->stall_s) continue;
    if (sl->stall_logged_at && now - sl->stall_logged_at < srv->cfg->stall_s) continue;
    uint64_t step = sl->step;
    char vars[512];
    size_t vo = 0, nvars = 0;
    vars[0] = '\0';
    for (uint32_t j = i; j < sh->n; j++) {
      psd_slice *o = sh->slices[j];
      if (o->count == 0 || o->step != step) continue;
      if (o->stall_logged_at && now - o->stall_logged_at < srv->cfg->stall_s) continue;
      o->stall_logged_at = now;
      nvars++;
      if (vo + strlen(o->name) + 8 < sizeof vars &&
          (j == i || strcmp(o->name, sh->slices[j - 1]->name) != 0))
        vo += (size_t)snprintf(vars + vo, sizeof vars - vo, "%s%s", vo ? ", " : "", o->name);
    }
    uint32_t missing[PSD_STALL_NAMES];
    uint32_t nm = psd_slice_missing(sh, sl, missing, PSD_STALL_NAMES);
    char who[256];
    size_t wo = 0;
    who[0] = '\0';
    for (uint32_t k = 0; k < nm; k++) {
      const psd_job_worker *wk = &srv->job.workers[missing[k]];
      wo += (size_t)snprintf(who + wo, sizeof who - wo, "%s%u%s", k ? ", " : "", missing[k],
                             wk->lost         ? " (lost)"
                             : wk->finished   ? " (finished)"
                             : !wk->connected ? " (not connected)"
                                              : "");
      if (wo >= sizeof who) break;
    }
    psd_warn("step %llu stalled for %.1f s: %u of %u gradients in, waiting for worker(s) %s; "
             "variables: %s",
             (unsigned long long)step, now - sl->first_grad_at, sl->count, sh->replicas, who,
             vars);
  }
}

static void tick(psd_server *srv) {
  double now = ps__now();
  if (srv->exiting) {
    int pending = 0;
    for (psd_conn *c = srv->conns; c; c = c->next)
      if (psd_conn_pending(c)) pending = 1;
    if (!pending || now - srv->exiting_since > PSD_DRAIN_MAX_S)
      event_base_loopbreak(srv->base);
    return;
  }
  if (srv->accept_paused && !srv->exiting) {
    srv->accept_paused = 0;
    event_add(srv->listen_ev, NULL);
  }
  for (psd_conn *c = srv->conns, *next; c; c = next) {
    next = c->next;
    if (c->state == PSD_CONN_CLOSING && now - c->closing_since > 2.0) {
      psd_conn_close(c, "error reply not drained in time");
      continue;
    }
    if (!c->handshaken && c->state != PSD_CONN_CLOSING &&
        now - c->opened_at > PSD_HANDSHAKE_TIMEOUT_S) {
      /* Idle unauthenticated peers must not hold descriptors forever. */
      psd_conn_error(c, 0, PS_ETIMEDOUT, 1, "no handshake within %.0f s",
                     PSD_HANDSHAKE_TIMEOUT_S);
      psd_conn_write(c);
      continue;
    }
  }
  psd_waiters_expire(&srv->waiters, now, psd_conn_pull_expired, NULL);
  psd_server_flush(srv);
  for (psd_conn *c = srv->conns, *next; c; c = next) {
    next = c->next;
    if (psd_conn_pending(c)) psd_conn_write(c);
  }
  if (srv->job.pinned && !srv->shard.async_mode) check_stalls(srv, now);
  psd_server_act(srv, psd_persist_tick(&srv->persist, now, srv->job.pinned));
  if (srv->exiting) return;
  int code = psd_job_tick(&srv->job, now, current_step(srv));
  if (code != PSD_JOB_GO_ON) psd_server_finish(srv, code);
}

static void on_tick(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  tick(arg);
  psd_server_reap(arg);
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
  (void)what;
  psd_server *srv = arg;
  int graceful = sig == SIGTERM || sig == SIGUSR1;
  if (graceful && srv->cfg->ckpt_dir[0] && !srv->persist.stop_wanted && srv->job.pinned &&
      srv->shard.n > 0 && srv->job.workers[0].connected && !srv->exiting) {
    /* Preemption or walltime: checkpoint at a step every ps agrees on,
     * let the workers finish, exit with PSD_EXIT_STOPPED. Only the chief
     * can arrange that: without it (a launcher tearing a failed job down)
     * there is nothing to wait for. */
    char who[64];
    snprintf(who, sizeof who, "SIG%s", sigabbrev_np((int)sig));
    psd_persist_stop_wanted(&srv->persist, who);
    return;
  }
  if (graceful && (srv->persist.stop_wanted || srv->persist.stopped)) {
    /* Launchers repeat SIGTERM (srun when the first task exits 75); the
     * stop checkpoint may still be on its way here, and the stop timeout
     * (or the launcher's SIGKILL) bounds the wait anyway. */
    psd_info("received %s again; already stopping (SIGINT stops at once)", strsignal((int)sig));
    return;
  }
  if (sig == SIGUSR1 && !srv->cfg->ckpt_dir[0]) {
    psd_warn("received SIGUSR1 but there is no --checkpoint-dir to save to; going on");
    return;
  }
  if (srv->persist.stop_wanted || (graceful && srv->cfg->ckpt_dir[0])) {
    psd_info("received %s %s; exiting now", strsignal((int)sig),
             srv->persist.stop_wanted ? "while stopping" : "with no chief to arrange a checkpoint");
    psd_server_finish(srv, PSD_EXIT_STOPPED);
  } else {
    psd_info("received %s; shutting down", strsignal((int)sig));
    psd_server_finish(srv, PSD_EXIT_OK);
  }
  event_base_loopbreak(srv->base);
}

static void on_accept(evutil_socket_t lfd, short what, void *arg) {
  (void)what;
  psd_server *srv = arg;
  for (int i = 0; i < 64; i++) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int e = errno;
      if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR) break;
      /* Out of descriptors (or another error): the listener stays readable,
       * so pause accepting until the next tick instead of spinning. */
      double now = ps__now();
      if (now - srv->accept_warned_at >= 1.0) {
        psd_warn("accept failed: %s; pausing new connections briefly", strerror(e));
        srv->accept_warned_at = now;
      }
      event_del(srv->listen_ev);
      srv->accept_paused = 1;
      break;
    }
    set_sockopts(fd, srv->cfg->sock_buf);
    char host[NI_MAXHOST], serv[NI_MAXSERV], peer[NI_MAXHOST + NI_MAXSERV + 2];
    if (getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0)
      snprintf(peer, sizeof peer, "%s:%s", host, serv);
    else
      snprintf(peer, sizeof peer, "?");
    psd_conn_new(srv, fd, peer);
  }
  psd_server_reap(srv);
}

static int write_port_file(const char *path, const char *hostport) {
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) return -1;
  fprintf(f, "%s\n", hostport);
  if (fflush(f) != 0 || fsync(fileno(f)) != 0) {
    fclose(f);
    unlink(tmp);
    return -1;
  }
  fclose(f);
  if (rename(tmp, path) != 0) {
    unlink(tmp);
    return -1;
  }
  return 0;
}

int psd_server_init(psd_server *srv, psd_config *cfg) {
  memset(srv, 0, sizeof *srv);
  srv->cfg = cfg;
  srv->lfd = -1;
  srv->started_at = ps__now();
  psd_job_init(&srv->job, cfg, srv->started_at);
  signal(SIGPIPE, SIG_IGN);
  /* Restore before listening: launchers wait for the port file, so no
   * worker connects to a server that is still reading its checkpoint. */
  if (psd_persist_init(&srv->persist, cfg, &srv->shard) != 0) return -1;
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  char port[16];
  snprintf(port, sizeof port, "%d", cfg->port);
  int gai = getaddrinfo(cfg->host[0] ? cfg->host : NULL, port, &hints, &res);
  if (gai != 0) {
    psd_error("cannot resolve --host %s: %s", cfg->host, gai_strerror(gai));
    return -1;
  }
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (fd < 0 || bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 1024) != 0) {
    psd_error("cannot listen on %s:%d: %s", cfg->host, cfg->port, strerror(errno));
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
    return -1;
  }
  freeaddrinfo(res);
  srv->lfd = fd;
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(fd, (struct sockaddr *)&ss, &sl);
  char host[NI_MAXHOST], serv[NI_MAXSERV], hostport[NI_MAXHOST + NI_MAXSERV + 4];
  getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, serv, sizeof serv,
              NI_NUMERICHOST | NI_NUMERICSERV);
  if (strchr(host, ':')) snprintf(hostport, sizeof hostport, "[%s]:%s", host, serv);
  else snprintf(hostport, sizeof hostport, "%s:%s", host, serv);
  srv->base = event_base_new();
  if (!srv->base) {
    psd_error("cannot create the event loop");
    return -1;
  }
  srv->listen_ev = event_new(srv->base, fd, EV_READ | EV_PERSIST, on_accept, srv);
  srv->tick_ev = event_new(srv->base, -1, EV_PERSIST, on_tick, srv);
  srv->sig_ev[0] = evsignal_new(srv->base, SIGTERM, on_signal, srv);
  srv->sig_ev[1] = evsignal_new(srv->base, SIGINT, on_signal, srv);
  srv->sig_ev[2] = evsignal_new(srv->base, SIGUSR1, on_signal, srv);
  struct timeval tick = {0, PSD_TICK_MS * 1000};
  if (!srv->listen_ev || !srv->tick_ev || !srv->sig_ev[0] || !srv->sig_ev[1] ||
      !srv->sig_ev[2] || event_add(srv->listen_ev, NULL) || event_add(srv->tick_ev, &tick) ||
      event_add(srv->sig_ev[0], NULL) || event_add(srv->sig_ev[1], NULL) ||
      event_add(srv->sig_ev[2], NULL)) {
    psd_error("cannot set up the event loop");
    return -1;
  }
  char terr[1200];
  if (psd_telem_init(&srv->telem, cfg->ps_index, cfg->num_ps, cfg->telemetry, terr,
                     sizeof terr) != 0) {
    psd_error("%s", terr);
    return -1;
  }
  if (cfg->port_file[0] && write_port_file(cfg->port_file, hostport) != 0) {
    psd_error("cannot write --port-file %s: %s", cfg->port_file, strerror(errno));
    return -1;
  }
  psd_info("psd %d.%d.%d listening on %s (ps %d of %d, pid %d)", PS_VERSION_MAJOR,
           PS_VERSION_MINOR, PS_VERSION_PATCH, hostport, cfg->ps_index, cfg->num_ps,
           (int)getpid());
  if (cfg->munge)
    psd_info("peers must present a MUNGE credential for job %.0f%s", cfg->job_id,
             cfg->step_id >= 0 ? "" : " (any step)");
  if (!cfg->secret_len && !cfg->munge)
    psd_warn("no shared secret (--secret-file or PSD_SECRET): anyone who can reach %s can "
             "join this job", hostport);
  return 0;
}

int psd_server_run(psd_server *srv) {
  event_base_dispatch(srv->base);
  const char *sum = srv->cfg->summary;
  if (sum[0]) {
    FILE *f = strcmp(sum, "-") == 0 ? stdout : fopen(sum, "w");
    if (f) psd_telem_print_summary(&srv->telem, srv, f);
    else psd_warn("cannot write --summary %s: %s", sum, strerror(errno));
    if (f && f != stdout) fclose(f);
  }
  return srv->exit_code;
}

void psd_server_free(psd_server *srv) {
  while (srv->conns) {
    psd_conn *c = srv->conns;
    c->worker = -1; /* no lifecycle decisions while tearing down */
    psd_conn_close(c, "server exiting");
  }
  psd_server_reap(srv);
  if (srv->listen_ev) event_free(srv->listen_ev);
  if (srv->tick_ev) event_free(srv->tick_ev);
  for (int i = 0; i < 3; i++)
    if (srv->sig_ev[i]) event_free(srv->sig_ev[i]);
  psd_persist_free(&srv->persist);
  if (srv->base) event_base_free(srv->base);
  if (srv->lfd >= 0) close(srv->lfd);
  psd_shard_free(&srv->shard);
  psd_waiters_free(&srv->waiters);
  psd_telem_free(&srv->telem);
  psd_job_free(&srv->job);
  memset(srv, 0, sizeof *srv);
  srv->lfd = -1;
}
