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

#include <munge.h>

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

/* ---- workers ------------------------------------------------------------- */

static uint32_t count_lost(const psd_server *srv) {
  uint32_t n = 0;
  for (uint32_t w = 0; w < srv->num_workers; w++) n += srv->workers[w].lost;
  return n;
}

/* Losses tolerated: backup workers in sync mode; all but one in async. */
static uint32_t tolerated(const psd_server *srv) {
  if (srv->shard.async_mode) return srv->num_workers - 1;
  return srv->num_workers - srv->shard.replicas;
}

static void format_workers(const psd_server *srv, int lost, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (uint32_t w = 0; w < srv->num_workers && o + 16 < len; w++) {
    const psd_worker *k = &srv->workers[w];
    int pick = lost ? k->lost : !k->joined;
    if (pick) o += (size_t)snprintf(buf + o, len - o, "%s%u", o ? "," : "", w);
  }
}

static void detach_slice(void *ctx, psd_slice *sl);

static void check_done(psd_server *srv) {
  if (!srv->pinned || srv->exiting) return;
  uint32_t done = 0, lost = count_lost(srv);
  for (uint32_t w = 0; w < srv->num_workers; w++)
    done += srv->workers[w].finished || srv->workers[w].lost;
  if (srv->persist.stopped) {
    /* After the stop checkpoint, a worker that vanished (the launcher
     * killed it) is as good as finished: no grace period to wait out. */
    if (done == srv->num_workers) {
      psd_info("all workers done after the stop checkpoint (step %llu); exiting with status "
               "%d so the job can be resumed",
               (unsigned long long)srv->persist.stop_step, PSD_EXIT_STOPPED);
      psd_server_finish(srv, PSD_EXIT_STOPPED);
    }
    return;
  }
  if (srv->persist.stop_wanted && !srv->persist.stopped && !srv->workers[0].conn) {
    /* Only the chief arranges the stop checkpoint: nothing to wait for. */
    psd_warn("the chief (worker 0) left before the stop checkpoint; exiting now");
    psd_server_finish(srv, PSD_EXIT_STOPPED);
    return;
  }
  if (lost > tolerated(srv)) {
    if (srv->lost_since == 0) {
      char names[256];
      format_workers(srv, 1, names, sizeof names);
      srv->lost_since = ps__now();
      psd_warn("worker(s) %s lost and training cannot go on without them "
               "(%u lost, %u tolerated); exiting in %.0f s unless they rejoin",
               names, lost, tolerated(srv), srv->cfg->grace_s);
    }
    return;
  }
  srv->lost_since = 0;
  if (done == srv->num_workers) {
    psd_persist_final(srv);
    if (lost)
      psd_warn("all workers done (%u lost, tolerated as backups); exiting", lost);
    else
      psd_info("all %u workers finished; exiting", srv->num_workers);
    psd_server_finish(srv, PSD_EXIT_OK);
  }
}

/* The Hello's MUNGE credential: decoded by munged (which refuses expired and
 * replayed ones), from our uid, naming our job (and step, if set). */
static int check_munge(psd_server *srv, const Ps__Hello *h, char *err, size_t errlen) {
  const psd_config *cfg = srv->cfg;
  if (!h->munge || h->credential.len == 0 || h->credential.len > PS__MAX_PREAUTH_META) {
    snprintf(err, errlen, "authentication failed: this server requires a MUNGE credential");
    return PS_EAUTH;
  }
  char cred[PS__MAX_PREAUTH_META + 1];
  memcpy(cred, h->credential.data, h->credential.len);
  cred[h->credential.len] = '\0';
  munge_ctx_t ctx = munge_ctx_create();
  if (!ctx) {
    snprintf(err, errlen, "out of memory");
    return PS_ENOMEM;
  }
  if (cfg->munge_socket[0]) munge_ctx_set(ctx, MUNGE_OPT_SOCKET, cfg->munge_socket);
  void *payload = NULL;
  int plen = 0;
  uid_t uid;
  gid_t gid;
  munge_err_t me = munge_decode(cred, ctx, &payload, &plen, &uid, &gid);
  munge_ctx_destroy(ctx);
  int rc = 0;
  char want[128];
  if (cfg->step_id >= 0)
    snprintf(want, sizeof want, "psd1 job=%.0f step=%.0f", cfg->job_id, cfg->step_id);
  else
    snprintf(want, sizeof want, "psd1 job=%.0f step=", cfg->job_id);
  if (me != EMUNGE_SUCCESS) {
    snprintf(err, errlen, "authentication failed: MUNGE credential refused (%s)",
             munge_strerror(me));
    rc = PS_EAUTH;
  } else if (uid != getuid()) {
    snprintf(err, errlen, "authentication failed: credential of uid %u, this job runs as uid %u",
             (unsigned)uid, (unsigned)getuid());
    rc = PS_EAUTH;
  } else if (!payload || plen <= 0 || (size_t)plen < strlen(want) ||
             memcmp(payload, want, strlen(want)) != 0 ||
             (cfg->step_id >= 0 && (size_t)plen != strlen(want))) {
    snprintf(err, errlen, "authentication failed: credential for '%.*s', this is '%s'",
             plen > 0 && plen < 100 ? plen : 0, payload ? (char *)payload : "", want);
    rc = PS_EAUTH;
  }
  free(payload);
  return rc;
}

int psd_server_hello(psd_server *srv, psd_conn *c, const Ps__Hello *h, char *err,
                     size_t errlen) {
  const psd_config *cfg = srv->cfg;
  if (h->protocol_version != PS__PROTOCOL_VERSION) {
    snprintf(err, errlen, "protocol version %u, this server speaks %u", h->protocol_version,
             PS__PROTOCOL_VERSION);
    return PS_EVERSION;
  }
  if (cfg->munge) {
    int rc = check_munge(srv, h, err, errlen);
    if (rc) return rc;
  }
  ProtobufCBinaryData secret = h->munge ? h->secret : h->credential;
  if (cfg->secret_len) {
    /* Constant time: the comparison leaks nothing about the secret. */
    unsigned char diff = secret.len != cfg->secret_len;
    for (size_t i = 0; i < cfg->secret_len; i++)
      diff |= (unsigned char)(cfg->secret[i] ^ (i < secret.len ? secret.data[i] : 0));
    if (diff) {
      snprintf(err, errlen, "authentication failed: %s credential",
               secret.len ? "wrong" : "no");
      return PS_EAUTH;
    }
  }
  if (h->role == PS__ROLE__ROLE_ADMIN) {
    c->admin = 1; /* psctl: authenticated, may ask for Stats and nothing else */
    return 0;
  }
  if (h->role != PS__ROLE__ROLE_WORKER) {
    snprintf(err, errlen, "role %d is not supported (only workers and admin tools)",
             (int)h->role);
    return PS_EUNSUPPORTED;
  }
  if (h->num_ps != (uint32_t)cfg->num_ps || h->ps_index != (uint32_t)cfg->ps_index) {
    snprintf(err, errlen,
             "client expects ps %u of %u, this is ps %d of %d (check the order of PS_HOSTS)",
             h->ps_index, h->num_ps, cfg->ps_index, cfg->num_ps);
    return PS_EMISMATCH;
  }
  if (h->num_workers > PS__MAX_WORKERS) {
    snprintf(err, errlen, "%u workers is more than the limit of %u", h->num_workers,
             PS__MAX_WORKERS);
    return PS_ETOOBIG;
  }
  if (h->num_workers == 0 || h->worker_index >= h->num_workers) {
    snprintf(err, errlen, "worker index %u is not below the number of workers %u",
             h->worker_index, h->num_workers);
    return PS_EINVAL;
  }
  if (cfg->workers && h->num_workers != (uint32_t)cfg->workers) {
    snprintf(err, errlen, "client says %u workers, this server was started with --workers %d",
             h->num_workers, cfg->workers);
    return PS_EMISMATCH;
  }
  uint32_t want_r = h->replicas_to_aggregate ? h->replicas_to_aggregate
                    : cfg->replicas        ? (uint32_t)cfg->replicas
                                           : h->num_workers;
  if (want_r > h->num_workers) {
    snprintf(err, errlen, "replicas_to_aggregate %u exceeds the number of workers %u", want_r,
             h->num_workers);
    return PS_EINVAL;
  }
  if (cfg->replicas && h->replicas_to_aggregate &&
      h->replicas_to_aggregate != (uint32_t)cfg->replicas) {
    snprintf(err, errlen, "client asks replicas_to_aggregate %u, server has %d",
             h->replicas_to_aggregate, cfg->replicas);
    return PS_EMISMATCH;
  }
  if ((cfg->mode == PSD_MODE_SYNC && h->async_mode) ||
      (cfg->mode == PSD_MODE_ASYNC && !h->async_mode)) {
    snprintf(err, errlen, "client asks %s mode, this server runs %s",
             h->async_mode ? "async" : "sync", h->async_mode ? "sync" : "async");
    return PS_EMISMATCH;
  }
  uint64_t split = h->split_threshold ? h->split_threshold : PS__DEFAULT_SPLIT_THRESHOLD;
  /* Normalized as the placer does (whole floats), so equal placements
   * compare equal. */
  uint64_t maxs = h->max_slice_bytes ? h->max_slice_bytes & ~(uint64_t)3
                                     : PS__DEFAULT_MAX_SLICE_BYTES;
  if (maxs > PS__MAX_SLICE_BYTES || maxs < 4) {
    snprintf(err, errlen, "max_slice_bytes %llu is outside [4, %llu]",
             (unsigned long long)maxs, (unsigned long long)PS__MAX_SLICE_BYTES);
    return PS_EINVAL;
  }
  if (!srv->pinned) {
    srv->workers = calloc(h->num_workers, sizeof *srv->workers);
    if (!srv->workers || psd_telem_pin(&srv->telem, h->num_workers) != 0) {
      free(srv->workers);
      srv->workers = NULL;
      snprintf(err, errlen, "out of memory");
      return PS_ENOMEM;
    }
    srv->num_workers = h->num_workers;
    psd_shard_init(&srv->shard, h->num_workers, want_r, h->async_mode);
    srv->shard.detach = detach_slice;
    srv->shard.detach_ctx = srv;
    srv->split_threshold = split;
    srv->max_slice_bytes = maxs;
    srv->pinned = 1;
    psd_info("training with %u workers, %s, placement split at %llu bytes in %llu-byte slices",
             srv->num_workers,
             h->async_mode ? "async" : "sync",
             (unsigned long long)split, (unsigned long long)maxs);
    if (!h->async_mode)
      psd_info("sync: averaging %u gradients per step (%u backup workers)", want_r,
               srv->num_workers - want_r);
  } else {
    if (h->num_workers != srv->num_workers || want_r != srv->shard.replicas ||
        !h->async_mode != !srv->shard.async_mode || split != srv->split_threshold ||
        maxs != srv->max_slice_bytes) {
      snprintf(err, errlen,
               "worker %u disagrees with the job: it says %u workers, replicas %u, %s, "
               "split %llu, slices %llu; the job has %u, %u, %s, %llu, %llu",
               h->worker_index, h->num_workers, want_r, h->async_mode ? "async" : "sync",
               (unsigned long long)split, (unsigned long long)maxs, srv->num_workers,
               srv->shard.replicas, srv->shard.async_mode ? "async" : "sync",
               (unsigned long long)srv->split_threshold,
               (unsigned long long)srv->max_slice_bytes);
      return PS_EMISMATCH;
    }
  }
  psd_worker *wk = &srv->workers[h->worker_index];
  if (wk->conn) {
    snprintf(err, errlen, "worker %u is already connected from %s", h->worker_index,
             wk->peer);
    return PS_EBUSY;
  }
  if (wk->finished) {
    snprintf(err, errlen, "worker %u has already finished", h->worker_index);
    return PS_ESTATE;
  }
  int rejoin = wk->lost;
  wk->conn = c;
  wk->joined = 1;
  wk->lost = 0;
  snprintf(wk->peer, sizeof wk->peer, "%s", c->peer);
  c->worker = (int)h->worker_index;
  snprintf(c->name, sizeof c->name, "w%u", h->worker_index);
  psd_pace_joined(srv, c);
  psd_info("worker %u %s from %s%s%s", h->worker_index, rejoin ? "rejoined" : "joined",
           c->peer, h->client_id && h->client_id[0] ? " " : "",
           h->client_id ? h->client_id : "");
  if (rejoin) check_done(srv);
  return 0;
}

void psd_server_worker_finished(psd_server *srv, psd_conn *c) {
  psd_worker *wk = &srv->workers[c->worker];
  wk->finished = 1;
  psd_info("worker %d finished", c->worker);
  check_done(srv);
}

static uint64_t current_step(const psd_server *srv) {
  uint64_t s = UINT64_MAX;
  for (uint32_t i = 0; i < srv->shard.n; i++)
    if (srv->shard.slices[i]->step < s) s = srv->shard.slices[i]->step;
  return s == UINT64_MAX ? 0 : s;
}

void psd_server_conn_closed(psd_server *srv, psd_conn *c) {
  if (c->worker < 0 || !srv->workers) return;
  psd_worker *wk = &srv->workers[c->worker];
  if (wk->conn != c) return;
  wk->conn = NULL;
  if (c->worker == 0) psd_persist_chief_left(srv);
  if (!c->finished) {
    wk->lost = 1;
    psd_warn("worker %d (%s) left at step %llu without finishing (connection lost)",
             c->worker, c->peer, (unsigned long long)current_step(srv));
    check_done(srv);
  }
}

void psd_server_slice_advanced(psd_server *srv, psd_slice *sl) {
  psd_persist_slice_advanced(srv, sl);
  psd_waiters_wake(&srv->waiters, sl->id, sl->step);
  if (sl->id == 0 && sl->step > 0 && sl->step % (uint64_t)srv->cfg->log_every == 0 &&
      sl->step != srv->logged_step) {
    srv->logged_step = sl->step;
    uint32_t live = 0;
    for (uint32_t w = 0; w < srv->num_workers; w++) live += srv->workers[w].conn != NULL;
    psd_info("step %llu applied (%u of %u workers connected, %llu stale gradients dropped)",
             (unsigned long long)sl->step, live, srv->num_workers,
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
      const psd_worker *wk = &srv->workers[missing[k]];
      wo += (size_t)snprintf(who + wo, sizeof who - wo, "%s%u%s", k ? ", " : "", missing[k],
                             wk->lost        ? " (lost)"
                             : wk->finished  ? " (finished)"
                             : !wk->conn     ? " (not connected)"
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
  if (srv->pinned && !srv->shard.async_mode) check_stalls(srv, now);
  psd_persist_tick(srv, now);
  if (srv->exiting) return;
  if (srv->lost_since && now - srv->lost_since >= srv->cfg->grace_s) {
    char names[256];
    format_workers(srv, 1, names, sizeof names);
    psd_error("worker(s) %s did not come back within the %.0f s grace period; exiting "
              "at step %llu",
              names, srv->cfg->grace_s, (unsigned long long)current_step(srv));
    psd_server_finish(srv, PSD_EXIT_WORKER_LOST);
    return;
  }
  double t = srv->cfg->startup_timeout_s;
  if (t > 0 && now - srv->started_at > t) {
    int all = srv->pinned;
    for (uint32_t w = 0; all && w < srv->num_workers; w++) all = srv->workers[w].joined;
    if (!all) {
      char names[256] = "all";
      if (srv->pinned) format_workers(srv, 0, names, sizeof names);
      psd_error("worker(s) %s never connected within the %.0f s startup timeout; exiting",
                names, t);
      psd_server_finish(srv, PSD_EXIT_NO_WORKERS);
    }
  }
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
  if (graceful && srv->cfg->ckpt_dir[0] && !srv->persist.stop_wanted && srv->pinned &&
      srv->shard.n > 0 && srv->workers[0].conn && !srv->exiting) {
    /* Preemption or walltime: checkpoint at a step every ps agrees on,
     * let the workers finish, exit with PSD_EXIT_STOPPED. Only the chief
     * can arrange that: without it (a launcher tearing a failed job down)
     * there is nothing to wait for. */
    char who[64];
    snprintf(who, sizeof who, "SIG%s", sigabbrev_np((int)sig));
    psd_persist_stop_wanted(srv, who);
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
  signal(SIGPIPE, SIG_IGN);
  /* Restore before listening: launchers wait for the port file, so no
   * worker connects to a server that is still reading its checkpoint. */
  if (psd_persist_init(srv) != 0) return -1;
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
  psd_persist_free(srv);
  if (srv->base) event_base_free(srv->base);
  if (srv->lfd >= 0) close(srv->lfd);
  psd_shard_free(&srv->shard);
  psd_waiters_free(&srv->waiters);
  psd_telem_free(&srv->telem);
  free(srv->workers);
  memset(srv, 0, sizeof *srv);
  srv->lfd = -1;
}
