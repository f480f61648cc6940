/* server.c - the event loop: listener, signals, timers, and exiting. */
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
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ps/version.h"
#include "psdlog.h"
#include "replies.h"
#include "wfile.h"

/* Timer period for deadlines, stall checks and the grace period: fine
 * enough that a 1 s deadline is honoured within 10%. */
#define PSD_TICK_MS 100
/* Seconds allowed for the last replies to drain before exiting. */
#define PSD_DRAIN_MAX_S 5.0
/* Workers named in one stall log line before "and N more". */
#define PSD_STALL_NAMES 16

/* Descriptors kept out of --max-connections: the listener, the event
 * loop's own, stdio, checkpoint and telemetry files, a MUNGE socket, and
 * the shared-memory handover socket with its PSD_SHM_MAX_PENDING peers. */
#define PSD_FD_RESERVE (32 + 1 + PSD_SHM_MAX_PENDING)
/* Unanswered keepalive probes before a peer is dropped. */
#define PSD_KEEPCNT 3
/* Connections accepted per wake-up of the listener at most; fewer when the
 * caps are small: at most 1/PSD_ACCEPT_TURNOVER of the unauthenticated
 * slots turn over per pass of the event loop, so under a flood a peer that
 * answers its Challenge at once is read within that many passes, before
 * newer connections could evict it (a flood of 64 accepts at a 64-slot
 * cap evicted every connection of the batch before reading any). */
#define PSD_ACCEPT_BATCH 64
#define PSD_ACCEPT_TURNOVER 8

/* TCP_NODELAY, the send buffer, and keepalive: a silent peer whose host
 * died (no FIN, no RST) is dropped about keepalive_s seconds later: probes
 * start after half of it, PSD_KEEPCNT go unanswered over the other half;
 * TCP_USER_TIMEOUT drops it as fast when our replies go unacknowledged. */
static void set_sockopts(int fd, int sndbuf, int keepalive_s) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (sndbuf > 0) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  if (keepalive_s <= 0) return;
  int idle = keepalive_s / 2, cnt = PSD_KEEPCNT;
  int intvl = (keepalive_s - idle) / cnt > 0 ? (keepalive_s - idle) / cnt : 1;
  unsigned uto = (unsigned)keepalive_s * 1000u;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &uto, sizeof uto);
}

/* The connection caps of the options, --max-connections lowered to what
 * the descriptor limit allows (so evicting, not EMFILE, is what happens
 * when a flood fills it). */
static void set_limits(psd_server *srv) {
  const psd_config *cfg = srv->cfg;
  size_t total = (size_t)cfg->max_conns;
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    size_t fit = rl.rlim_cur > 2 * PSD_FD_RESERVE ? (size_t)rl.rlim_cur - PSD_FD_RESERVE
                                                   : (size_t)rl.rlim_cur / 2;
    if (fit < total) {
      psd_info("at most %zu connections (--max-connections %d, but the descriptor limit is "
               "%llu)",
               fit, cfg->max_conns, (unsigned long long)rl.rlim_cur);
      total = fit;
    }
  }
  srv->conns.lim = (psd_conn_limits){total, (size_t)cfg->max_unauth, (size_t)cfg->max_admin};
}

void psd_server_finish(psd_server *srv, int code) {
  if (srv->exiting) return;
  srv->exit_code = code;
  srv->exiting = 1;
  srv->h.exiting = 1;
  srv->exiting_since = ps__now();
  /* Stop accepting; let queued replies (FINISH acks) drain, then leave. */
  if (srv->listen_ev) event_del(srv->listen_ev);
  if (!psd_conns_pending(&srv->conns)) event_base_loopbreak(srv->base);
}

/* psd_handlers' finish hook. */
static void finish_hook(void *loop, int code) { psd_server_finish(loop, code); }

/* ---- timers ------------------------------------------------------------- */

static void check_stalls(psd_server *srv, double now) {
  psd_shard *sh = &srv->shard;
  /* One line per stalled step, naming the missing workers and variables. */
  for (uint32_t i = 0; i < sh->n; i++) {
    psd_slice *sl = sh->slices[i];
    if (sl->count == 0 || now - sl->first_grad_at < srv->cfg->stall_s) continue;
    if (sl->stall_logged_at && now - sl->stall_logged_at < srv->cfg->stall_s) continue;
    uint64_t step = sl->step;
    char vars[PS__ESC_BYTES + 8]; /* the longest escaped name fits */
    size_t vo = 0, nvars = 0;
    vars[0] = '\0';
    for (uint32_t j = i; j < sh->n; j++) {
      psd_slice *o = sh->slices[j];
      if (o->count == 0 || o->step != step) continue;
      if (o->stall_logged_at && now - o->stall_logged_at < srv->cfg->stall_s) continue;
      o->stall_logged_at = now;
      nvars++;
      if (j != i && strcmp(o->name, sh->slices[j - 1]->name) == 0) continue;
      /* Escaped (a worker chose the name); one that no longer fits whole
       * is left out rather than cut. */
      const char *shown = PS__ESC(o->name);
      if (vo + strlen(shown) + 8 < sizeof vars)
        vo += (size_t)snprintf(vars + vo, sizeof vars - vo, "%s%s", vo ? ", " : "", shown);
    }
    uint32_t missing[PSD_STALL_NAMES];
    uint32_t nm = psd_shard_slice_missing(sh, sl, missing, PSD_STALL_NAMES);
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
             (unsigned long long)step, now - sl->first_grad_at, sl->count,
             psd_shard_slice_replicas(sh, sl), who, vars);
  }
}

static void tick(psd_server *srv) {
  double now = ps__now();
  if (srv->exiting) {
    if (!psd_conns_pending(&srv->conns) || now - srv->exiting_since > PSD_DRAIN_MAX_S)
      event_base_loopbreak(srv->base);
    return;
  }
  if (srv->accept_paused && !srv->exiting) {
    srv->accept_paused = 0;
    event_add(srv->listen_ev, NULL);
  }
  psd_conns_tick(&srv->conns, now);
  psd_shmgate_tick(&srv->shmgate, now);
  psd_waiters_expire(&srv->waiters, now, psd_replies_pull_expired, &srv->h);
  psd_tables_expire(&srv->tables, now);
  psd_replies_flush(&srv->h);
  psd_conns_write_pending(&srv->conns);
  if (srv->job.pinned && !srv->shard.async_mode) check_stalls(srv, now);
  psd_handlers_act(&srv->h, psd_persist_tick(&srv->persist, now, srv->job.pinned));
  if (srv->exiting) return;
  int code = psd_job_tick(&srv->job, now, psd_handlers_step(&srv->h));
  if (code != PSD_JOB_GO_ON) psd_server_finish(srv, code);
}

static void on_tick(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  tick(arg);
  psd_conns_reap(&((psd_server *)arg)->conns);
}

static void on_munge(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  psd_handlers_munge_done(&((psd_server *)arg)->h);
}

static void on_ckpt(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  psd_server *srv = arg;
  psd_handlers_act(&srv->h, psd_persist_poll(&srv->persist));
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
  (void)what;
  psd_server *srv = arg;
  int graceful = sig == SIGTERM || sig == SIGUSR1;
  if (graceful && srv->cfg->ckpt_dir[0] && !srv->persist.stop_wanted && srv->job.pinned &&
      (srv->shard.n > 0 || srv->tables.n > 0) && srv->job.workers[0].connected &&
      !srv->exiting) {
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
  /* Whatever ended the job here, 75 only if this ps's stop checkpoint is
   * on disk: a launcher requeues on 75 trusting the job can resume. */
  if (!srv->cfg->ckpt_dir[0])
    psd_info("received %s; shutting down", strsignal((int)sig));
  else
    psd_info("received %s%s; exiting now", strsignal((int)sig),
             srv->persist.stop_wanted ? " while stopping"
             : graceful               ? " with no chief to arrange a checkpoint"
                                      : "");
  char why[64];
  snprintf(why, sizeof why, "SIG%s", sigabbrev_np((int)sig));
  psd_server_finish(srv, psd_persist_stop_status(&srv->persist, why));
  event_base_loopbreak(srv->base);
}

static void on_accept(evutil_socket_t lfd, short what, void *arg) {
  (void)what;
  psd_server *srv = arg;
  const psd_conn_limits *lim = &srv->conns.lim;
  size_t slots = lim->unauth < lim->total ? lim->unauth : lim->total;
  size_t batch = slots / PSD_ACCEPT_TURNOVER;
  if (batch > PSD_ACCEPT_BATCH) batch = PSD_ACCEPT_BATCH;
  for (size_t i = 0; i < (batch ? batch : 1); i++) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int e = errno;
      if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR) break;
      /* Out of descriptors: an unauthenticated connection gives its own
       * up, so the one waiting (maybe a worker) gets in now. */
      if ((e == EMFILE || e == ENFILE) &&
          psd_conns_evict_oldest(&srv->conns, "out of descriptors"))
        continue;
      /* Nothing to evict (or another error): the listener stays readable,
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
    set_sockopts(fd, srv->cfg->sock_buf, srv->cfg->keepalive_s);
    char host[NI_MAXHOST], serv[NI_MAXSERV], peer[NI_MAXHOST + NI_MAXSERV + 2];
    if (getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0)
      snprintf(peer, sizeof peer, "%s:%s", host, serv);
    else
      snprintf(peer, sizeof peer, "?");
    psd_conn_new(&srv->conns, fd, peer);
  }
  psd_conns_reap(&srv->conns);
}

/* The output files, all through common/wfile.h (0600, planted links and
 * other users' files refused, named in the log): --telemetry opened as a
 * stream, --summary checked now though written at exit (a planted link
 * stops psd at start-up, not after the run), the port file written whole
 * (renamed into place: a reader never sees half an address). 0 or -1. */
static int open_outputs(psd_server *srv, const char *hostport) {
  const psd_config *cfg = srv->cfg;
  char err[1200], line[NI_MAXHOST + NI_MAXSERV + 8];
  int len = snprintf(line, sizeof line, "%s\n", hostport);
  if (psd_telem_init(&srv->telem, cfg->ps_index, cfg->num_ps, cfg->telemetry, err,
                     sizeof err) != 0 ||
      (cfg->summary[0] && strcmp(cfg->summary, "-") != 0 &&
       ps__wfile_check(cfg->summary, "--summary", err, sizeof err) != 0) ||
      (cfg->port_file[0] && ps__wfile_write(cfg->port_file, line, (size_t)len, 0600,
                                            "--port-file", err, sizeof err) != 0)) {
    psd_error("%s", err);
    return -1;
  }
  return 0;
}

/* The loop's events: the listener (fd), the tick, signals, and the
 * background threads' answers. 0 or -1 (logged). */
static int add_events(psd_server *srv, int fd) {
  srv->listen_ev = event_new(srv->base, fd, EV_READ | EV_PERSIST, on_accept, srv);
  srv->tick_ev = event_new(srv->base, -1, EV_PERSIST, on_tick, srv);
  srv->sig_ev[0] = evsignal_new(srv->base, SIGTERM, on_signal, srv);
  srv->sig_ev[1] = evsignal_new(srv->base, SIGINT, on_signal, srv);
  srv->sig_ev[2] = evsignal_new(srv->base, SIGUSR1, on_signal, srv);
  if (srv->mungeq &&
      (!(srv->munge_ev = event_new(srv->base, psd_mungeq_fd(srv->mungeq), EV_READ | EV_PERSIST,
                                   on_munge, srv)) ||
       event_add(srv->munge_ev, NULL))) {
    psd_error("cannot watch the MUNGE thread");
    return -1;
  }
  int cfd = psd_persist_fd(&srv->persist);
  if (cfd >= 0 && (!(srv->ckpt_ev = event_new(srv->base, cfd, EV_READ | EV_PERSIST, on_ckpt,
                                               srv)) ||
                   event_add(srv->ckpt_ev, NULL))) {
    psd_error("cannot watch the checkpoint writer");
    return -1;
  }
  struct timeval tick = {0, PSD_TICK_MS * 1000};
  if (!srv->listen_ev || !srv->tick_ev || !srv->sig_ev[0] || !srv->sig_ev[1] ||
      !srv->sig_ev[2] || event_add(srv->listen_ev, NULL) || event_add(srv->tick_ev, &tick) ||
      event_add(srv->sig_ev[0], NULL) || event_add(srv->sig_ev[1], NULL) ||
      event_add(srv->sig_ev[2], NULL)) {
    psd_error("cannot set up the event loop");
    return -1;
  }
  return 0;
}

int psd_server_init(psd_server *srv, psd_config *cfg) {
  memset(srv, 0, sizeof *srv);
  srv->cfg = cfg;
  srv->lfd = -1;
  psd_shmgate_off(&srv->shmgate); /* before any failure: psd_server_free closes it */
  psd_job_init(&srv->job, cfg, ps__now());
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
  char merr[300];
  if (cfg->munge && psd_mungeq_create(&srv->mungeq, cfg, merr, sizeof merr) != 0) {
    psd_error("%s", merr);
    return -1;
  }
  psd_pace_init(&srv->pace, cfg->pace_ahead, cfg->pace_loopback, cfg->recv_buf,
                psd_conn_pace_progress);
  psd_tables_init(&srv->tables, cfg, &srv->job, &srv->shard, &srv->persist, &srv->telem);
  /* Helper threads only speed big table requests up: fewer than asked
   * (a process or memory limit) is a warning, not a reason not to run. */
  int perr = psd_par_create((unsigned)cfg->table_threads, &srv->par);
  if (perr)
    psd_warn("--table-threads %d: only %u could run (%s); big table requests use those",
             cfg->table_threads, psd_par_threads(srv->par), strerror(perr));
  srv->tables.par = srv->par;
  srv->h = (psd_handlers){.cfg = cfg, .shard = &srv->shard, .tables = &srv->tables,
                          .job = &srv->job,
                          .persist = &srv->persist, .waiters = &srv->waiters,
                          .telem = &srv->telem, .pace = &srv->pace, .conns = &srv->conns,
                          .mungeq = srv->mungeq,
                          .finish = finish_hook, .loop = srv};
  psd_conn_hooks hooks;
  psd_handlers_hooks(&srv->h, &hooks);
  psd_conns_init(&srv->conns, srv->base, &srv->pace, &hooks);
  srv->h.shmgate = &srv->shmgate;
  if (cfg->transport != PSD_TRANSPORT_TCP) {
    char serr[400];
    if (psd_shmgate_open(&srv->shmgate, srv->base, &srv->conns, serr, sizeof serr) != 0) {
      if (cfg->transport == PSD_TRANSPORT_SHM) {
        psd_error("--transport shm: %s", serr);
        return -1;
      }
      psd_warn("no shared-memory transport (workers use TCP): %s", serr);
    }
  }
  set_limits(srv);
  if (add_events(srv, fd) != 0) return -1;
  if (open_outputs(srv, hostport) != 0) return -1;
  psd_info("psd %d.%d.%d listening on %s (ps %d of %d, pid %d)", PS_VERSION_MAJOR,
           PS_VERSION_MINOR, PS_VERSION_PATCH, hostport, cfg->ps_index, cfg->num_ps,
           (int)getpid());
  if (cfg->munge)
    psd_info("peers must present a MUNGE credential for job %lld%s", (long long)cfg->job_id,
             cfg->step_id >= 0 ? "" : " (any step)");
  if (psd_shmgate_on(&srv->shmgate))
    psd_info("workers on this node may hand over shared memory at @%s (--transport %s)",
             srv->shmgate.name, cfg->transport == PSD_TRANSPORT_SHM ? "shm" : "auto");
  if (!cfg->secret_len && !cfg->munge)
    psd_warn("no shared secret (--secret-file or PSD_SECRET): anyone who can reach %s can "
             "join this job", hostport);
  return 0;
}

int psd_server_run(psd_server *srv) {
  event_base_dispatch(srv->base);
  const char *sum = srv->cfg->summary;
  psd_telem_view v = {srv->cfg->name, ps__now() - srv->job.started_at, &srv->job, &srv->shard};
  if (strcmp(sum, "-") == 0) {
    /* "-" is stderr, with the log: stdout is the job's output (psrun
     * passes "-" under Slurm, where the workers' results go there too). */
    psd_telem_print_summary(&srv->telem, &v, stderr);
    fflush(stderr);
  } else if (sum[0]) {
    /* Written whole, then renamed over the name: a reader never sees half
     * a table, and a link planted since start-up is replaced, not followed. */
    ps__wfile w;
    char err[1200];
    if (ps__wfile_begin(&w, sum, 0600, "--summary", err, sizeof err) == 0) {
      psd_telem_print_summary(&srv->telem, &v, w.fp);
      if (ps__wfile_commit(&w, 0, err, sizeof err) == 0) return srv->exit_code;
    }
    psd_warn("%s", err);
  }
  return srv->exit_code;
}

void psd_server_free(psd_server *srv) {
  psd_conns_close_all(&srv->conns);
  psd_shmgate_close(&srv->shmgate);
  if (srv->listen_ev) event_free(srv->listen_ev);
  if (srv->tick_ev) event_free(srv->tick_ev);
  for (int i = 0; i < 3; i++)
    if (srv->sig_ev[i]) event_free(srv->sig_ev[i]);
  if (srv->ckpt_ev) event_free(srv->ckpt_ev);
  if (srv->munge_ev) event_free(srv->munge_ev);
  psd_mungeq_destroy(srv->mungeq);
  psd_persist_free(&srv->persist);
  if (srv->base) event_base_free(srv->base);
  if (srv->lfd >= 0) close(srv->lfd);
  psd_shard_free(&srv->shard);
  psd_tables_free(&srv->tables);
  psd_par_destroy(srv->par);
  psd_waiters_free(&srv->waiters);
  psd_telem_free(&srv->telem);
  psd_job_free(&srv->job);
  memset(srv, 0, sizeof *srv);
  srv->lfd = -1;
}
