/*
 * task0.c - psrun task 0 of a Slurm step, as stages over one struct:
 *   listen     on the rendezvous port (published through PMI-2 if any)
 *   check-in   every task says HELLO; strangers are refused, silent
 *              connections dropped or shed (pending.h)
 *   plan       the layout as the check-ins tell it, the roles, the secret
 *   addresses  each ps task's psd address
 *   world      worker 0's MASTER address; HOSTS and WORLD to the workers
 *   supervise  its own child and, through their connections, every task
 * task0_free releases whatever the stages opened, on every path.
 */
#define _GNU_SOURCE
#include "task0.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <slurm/pmi2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "pending.h"
#include "rdvauth.h"
#include "rdvdir.h"
#include "mac.h"
#include "util.h"
#include "wire.h"

typedef struct peer {
  psr_conn c;              /* control connection (fd -1 for ourselves) */
  psr_hello hello;         /* its check-in (rank, node, localid, nonce) */
  char addr[64];           /* its address "ip:port", for sentences */
  long long uid;           /* its uid as MUNGE vouched for it, -1 unknown */
  int exited;              /* sent EXIT */
  int code;                /* its exit code */
  int spared;              /* a worker the job went on without (--backup-workers) */
} peer;

typedef struct task0 {
  psr_step *s;
  const psr_opts *o;
  const psr_env *e;
  int n;                   /* tasks in the step */
  peer *peers;             /* by rank; peers[0] is ourselves */
  int failed;              /* a task failed: ABORT sent (its code) */
  int backups;             /* worker losses the job survives */
  int lost;                /* workers lost so far */
  int lfd;                 /* rendezvous listener, -1 */
  char **hosts;            /* the step's nodes */
  int nhosts;
  int *node_of;            /* node index of every rank */
  psr_role *roles;         /* role of every rank */
  char **psaddr;           /* psd "host:port" by ps index */
  char *hostlist;          /* the same, comma-separated */
  psr_auth auth;           /* how check-ins and roles are proven */
  char rdvdir[4200];       /* key mode without PMI-2: where the key file is, else "" */
  psr_pending pend;        /* accepted connections awaiting their check-in */
  double ps_deadline;      /* every worker's task exited: ps tasks exit by then, 0 */
} task0;

static void task0_free(task0 *t) {
  if (t->lfd >= 0) close(t->lfd);
  if (t->rdvdir[0]) psr_rdv_key_remove(t->rdvdir, t->e->step_id);
  if (t->pend.v) psr_pending_free(&t->pend);
  for (int r = 0; t->peers && r < t->n; r++) psr_conn_close(&t->peers[r].c);
  free(t->peers);
  if (t->hosts) psr_hosts_free(t->hosts, t->nhosts);
  for (int i = 0; t->psaddr && i < t->s->num_ps; i++) free(t->psaddr[i]);
  free(t->psaddr);
  free(t->hostlist);
  free(t->node_of);
  free(t->roles);
  memset(t, 0, sizeof *t);
  t->lfd = -1;
}

/* Sends ABORT why to every connected task. */
static void broadcast_abort(task0 *t, const char *why) {
  for (int r = 1; r < t->n; r++)
    if (t->peers[r].c.fd >= 0) psr_send_text(t->peers[r].c.fd, PSR_MSG_ABORT, "%s", why);
}

/* The first failure: logged, remembered, every task told to stop. */
static void fail(task0 *t, int code, const char *why) {
  psr_log("%s; stopping every task", why);
  t->failed = code;
  broadcast_abort(t, why);
}

/* One message from peer r while supervising. */
static void peer_said(task0 *t, int r, const char *line) {
  peer *p = &t->peers[r];
  psr_msg m;
  if (psr_msg_decode(line, &m) != 0 || m.type != PSR_MSG_EXIT) return;
  p->exited = 1;
  p->code = m.code;
  if (p->code != 0 && p->code != PSR_EXIT_STOPPED && !t->failed) {
    const psr_role *role = &t->roles[r];
    if (!role->is_ps && t->lost < t->backups) {
      /* psd averages fewer gradients than there are workers: it trains on. */
      p->spared = 1;
      t->lost++;
      psr_log("task %d (w%d) on %s exited with status %d; going on without it (%d of %d backup "
              "worker(s) lost, %d more may be lost)",
              r, role->index, p->hello.node, p->code, t->lost, t->backups, t->backups - t->lost);
      psr_send_exit(p->c.fd, 0); /* its psrun then exits 0: srun's status is the job's */
      return;
    }
    char why[512];
    snprintf(why, sizeof why, "task %d (%s%d) on %s exited with status %d%s", r,
             role->is_ps ? "ps" : "w", role->index, p->hello.node, p->code,
             role->is_ps ? psr_psd_status_says(p->code) : "");
    fail(t, p->code, why);
  }
}

/* 1 while task r's child runs: ours as our procs tell, a peer's until it
 * reports its exit (or goes away, which fails the step). */
static int task_running(const task0 *t, int r) {
  const psr_step *s = t->s;
  if (r == 0) return s->child >= 0 && !s->procs.kids[s->child].exited;
  return !t->peers[r].exited && t->peers[r].c.fd >= 0;
}

/* psd outliving the workers, as psrun --local handles it: once every
 * worker's task has exited while a ps task runs, the ps tasks have
 * PSR_PSD_EXIT_S; then the step stops, naming the workers the running psds
 * never saw finish. Task 0 asks them itself (it has the step's secret,
 * MUNGE identity and every psd's address): no ps task sees the workers'
 * exits, and no new control message is needed. */
static void psd_outlived(task0 *t) {
  psr_step *s = t->s;
  int workers_left = 0, ps_left = 0;
  for (int r = 0; r < t->n; r++) {
    if (t->roles[r].is_ps) ps_left += task_running(t, r);
    else workers_left += task_running(t, r);
  }
  if (t->failed || workers_left || !ps_left || !t->hostlist) {
    t->ps_deadline = 0; /* a restarted worker runs again */
    return;
  }
  if (!t->ps_deadline) t->ps_deadline = ps__now() + PSR_PSD_EXIT_S;
  if (ps__now() <= t->ps_deadline) return;
  int *running = calloc((size_t)s->num_ps, sizeof *running);
  char names[1200] = "", why[1400];
  for (int r = 0; running && r < t->n; r++)
    if (t->roles[r].is_ps) running[t->roles[r].index] = task_running(t, r);
  ps__auth auth = {s->secret, strlen(s->secret), s->munge,
                   s->munge_socket[0] ? s->munge_socket : NULL, s->env.job_id, s->env.step_id};
  if (running) psr_unfinished(t->hostlist, running, s->num_workers, &auth, names, sizeof names);
  free(running);
  snprintf(why, sizeof why,
           "parameter servers did not exit within %.0f s after the workers finished%s",
           PSR_PSD_EXIT_S, names);
  fail(t, 1, why);
}

/* Task 0's poll over every peer's control connection (psr_peer_cb). */
static int hub_poll(psr_step *s, void *ctx) {
  task0 *t = ctx;
  (void)s;
  for (int r = 1; r < t->n; r++) {
    peer *p = &t->peers[r];
    if (p->c.fd < 0) continue;
    int eof;
    char *line;
    while ((line = psr_conn_read_line(&p->c, 0, &eof)) != NULL) {
      peer_said(t, r, line);
      free(line);
    }
    if (eof) {
      close(p->c.fd);
      p->c.fd = -1;
      if (!p->exited && !t->failed) {
        char why[512];
        snprintf(why, sizeof why, "task %d on %s went away without reporting its exit", r,
                 p->hello.node);
        fail(t, 1, why);
      }
    }
  }
  if (!t->failed) psd_outlived(t);
  return t->failed ? t->failed : 0;
}

static int stage_init(task0 *t, psr_step *s, char *err, size_t errlen) {
  memset(t, 0, sizeof *t);
  t->lfd = -1;
  t->s = s;
  t->o = s->o;
  t->e = &s->env;
  t->n = s->env.ntasks;
  t->peers = calloc((size_t)t->n, sizeof *t->peers);
  t->node_of = calloc((size_t)t->n, sizeof *t->node_of);
  t->roles = calloc((size_t)t->n, sizeof *t->roles);
  if (!t->peers || !t->node_of || !t->roles || psr_pending_init(&t->pend) != 0) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  for (int r = 0; r < t->n; r++) t->peers[r].c.fd = -1;
  snprintf(t->peers[0].hello.node, sizeof t->peers[0].hello.node, "%s", t->e->nodename);
  t->peers[0].hello.localid = t->e->localid;
  t->auth.job_id = t->e->job_id;
  t->auth.step_id = t->e->step_id;
  t->auth.munge_socket = s->munge_socket;
  if (psr_auth_decide(s, &t->auth.mode, err, errlen) != 0) return -1;
  if (t->auth.mode == PSR_AUTH_KEY) {
    if (ps__random(t->auth.key, sizeof t->auth.key) != 0) {
      snprintf(err, errlen, "cannot draw a random key");
      return -1;
    }
    if (!t->e->pmi2 &&
        (psr_rdv_dir(t->o, t->e, t->rdvdir, sizeof t->rdvdir, err, errlen) != 0 ||
         psr_rdv_key_write(t->rdvdir, t->e->step_id, t->auth.key, err, errlen) != 0)) {
      t->rdvdir[0] = '\0';
      return -1;
    }
  }
  return 0;
}

/* 1. Listen where the others will look. */
static int stage_listen(task0 *t, char *err, size_t errlen) {
  const psr_env *e = t->e;
  int port = t->o->rdv_port;
  if (!port && !e->pmi2 && e->resv_port_lo) port = e->resv_port_lo;
  if (!port && !e->pmi2) port = psr_derived_port(e);
  int bound = 0;
  t->lfd = psr_tcp_listen(t->s->addr, port, &bound, err, errlen);
  if (t->lfd < 0) return -1;
  fcntl(t->lfd, F_SETFL, fcntl(t->lfd, F_GETFL) | O_NONBLOCK); /* accepts drain the backlog */
  if (e->pmi2) {
    char val[128];
    snprintf(val, sizeof val, "%s:%d", t->s->addr, bound);
    char key[PSR_HEX_LEN + 1] = "-";
    if (t->auth.mode == PSR_AUTH_KEY) psr_auth_key_hex(t->auth.key, key);
    /* The KVS is readable by the step's tasks only (slurmstepd serves it
     * over their PMI_FD): the key mode's shared key travels there. */
    if (PMI2_KVS_Put("psrun_rendezvous", val) != PMI2_SUCCESS ||
        PMI2_KVS_Put("psrun_key", key) != PMI2_SUCCESS || PMI2_KVS_Fence() != PMI2_SUCCESS) {
      snprintf(err, errlen, "PMI-2 could not publish the rendezvous address");
      return -1;
    }
  }
  psr_log("rendezvous on %s:%d (%s), authenticated by %s", t->s->addr, bound,
          e->pmi2 ? "PMI-2" : t->o->rdv_port ? "--rendezvous-port"
                  : e->resv_port_lo ? "SLURM_STEP_RESV_PORTS" : "derived from the job id",
          t->auth.mode == PSR_AUTH_MUNGE ? "MUNGE"
          : e->pmi2                      ? "a key in the PMI-2 KVS"
                                         : "a key in a private file");
  if (!e->pmi2 && !t->o->rdv_port && !e->resv_port_lo && psr_port_ephemeral(bound))
    psr_log("warning: port %d lies in this node's ephemeral range (ip_local_port_range); "
            "an outgoing connection may hold it: pass --rendezvous-port", bound);
  return 0;
}

/* A verified claim of rank r that is already taken: a replay or a second
 * task with our identity. The step stops, naming both (the second is told
 * so too: it must not check in again). */
static int double_claim(task0 *t, int i, long long uid, int r, char *err, size_t errlen) {
  const peer *o = &t->peers[r];
  psr_pending_conn *p = &t->pend.v[i];
  snprintf(err, errlen, "rank %d was claimed twice, by %s (uid %lld) and by %s (uid %lld), "
                        "both with valid proofs: a replayed check-in or a second copy of the "
                        "task; stopping", r, o->addr, o->uid, p->addr, uid);
  psr_send_text(p->c.fd, PSR_MSG_REJECT, "%s", err);
  return -1;
}

/* Judges pending connection i's check-in line: 1 when it is one of ours
 * (moved into t->peers), 0 when refused, -1 (err) when the step must stop. */
static int check_in(task0 *t, int i, const char *line, char *err, size_t errlen) {
  const psr_env *e = t->e;
  psr_pending_conn *p = &t->pend.v[i];
  long long uid = -1;
  psr_msg m;
  char why[600];
  if (psr_msg_decode(line, &m) != 0 || m.type != PSR_MSG_HELLO) {
    psr_pending_refuse(&t->pend, i, "not a psrun check-in (" PSR_HELLO_MAGIC ")");
    return 0;
  }
  psr_hello *h = &m.hello;
  if (h->job_id != e->job_id || h->step_id != e->step_id || h->ntasks != t->n ||
      h->rank <= 0 || h->rank >= t->n) {
    snprintf(why, sizeof why, "this is job %lld step %lld with %d tasks, not job %lld step %lld "
             "with %d tasks and rank %d", e->job_id, e->step_id, t->n, h->job_id, h->step_id,
             h->ntasks, h->rank);
    psr_pending_refuse(&t->pend, i, why);
    return 0;
  }
  char aerr[400];
  if (psr_auth_check_hello(&t->auth, h, &uid, aerr, sizeof aerr) != 0) {
    snprintf(why, sizeof why, "claimed rank %d (uid %u), but %s", h->rank, h->uid, aerr);
    psr_pending_refuse(&t->pend, i, why);
    return 0;
  }
  for (int r = 1; r < t->n; r++)
    if (t->peers[r].c.fd >= 0 && strcmp(t->peers[r].hello.nonce, h->nonce) == 0) {
      snprintf(why, sizeof why, "claimed rank %d with a check-in already seen (a replay)",
               h->rank);
      psr_pending_refuse(&t->pend, i, why);
      return 0;
    }
  if (t->peers[h->rank].c.fd >= 0) return double_claim(t, i, uid, h->rank, err, errlen);
  peer *q = &t->peers[h->rank];
  q->c = p->c;
  q->hello = *h;
  q->uid = uid;
  snprintf(q->addr, sizeof q->addr, "%s", p->addr);
  p->c = (psr_conn){-1, NULL, 0, 0};
  return 1;
}

/* Reads what pending connection i sent: its check-in, judged. 1 joined,
 * 0 nothing decided or refused, -1 the step must stop. */
static int serve_pending(task0 *t, int i, double now, char *err, size_t errlen) {
  int eof;
  char *line = psr_pending_line(&t->pend, i, &eof);
  if (!line && !eof && now < t->pend.v[i].deadline) return 0;
  int rc = 0;
  if (line) rc = check_in(t, i, line, err, errlen);
  else if (!eof) psr_pending_silent(&t->pend, i, now);
  free(line);
  psr_pending_drop(&t->pend, i);
  return rc;
}

/* The ranks that have not checked in, "1,5,7", into err. */
static void missing(task0 *t, char *err, size_t errlen) {
  char list[512] = "";
  size_t m = 0;
  for (int r = 1; r < t->n && m + 16 < sizeof list; r++)
    if (t->peers[r].c.fd < 0)
      m += (size_t)snprintf(list + m, sizeof list - m, "%s%d", m ? "," : "", r);
  snprintf(err, errlen, "tasks %s did not check in within %.0f s", list, t->o->timeout_s);
}

/* 2. Every task checks in; all connections are served at once, each with
 * its own deadline; a flood of silent ones sheds its oldest (pending.h). */
static int stage_checkin(task0 *t, char *err, size_t errlen) {
  double deadline = ps__now() + t->o->timeout_s;
  psr_msg rdv = {.type = PSR_MSG_RDV, .text = psr_auth_mode_name(t->auth.mode)};
  int rc = 0;
  for (int joined = 1; joined < t->n && rc == 0;) {
    if (ps__now() >= deadline) {
      missing(t, err, errlen);
      rc = -1;
      break;
    }
    int incoming = psr_pending_poll(&t->pend, t->lfd, deadline);
    double now = ps__now();
    for (int i = t->pend.n - 1; i >= 0 && rc == 0; i--) { /* from the end: drops move the last */
      if (!psr_pending_due(&t->pend, i, now)) continue;
      int r = serve_pending(t, i, now, err, errlen);
      if (r < 0) rc = -1;
      joined += r > 0;
    }
    if (rc == 0 && incoming) psr_pending_accept(&t->pend, t->lfd, &rdv);
  }
  psr_pending_free(&t->pend); /* strangers still waiting are closed; their summaries logged */
  close(t->lfd);
  t->lfd = -1;
  if (rc != 0) broadcast_abort(t, err);
  return rc;
}

/* Logs where the ps tasks run. */
static void log_plan(task0 *t) {
  psr_log("%d tasks on %d nodes: %d ps (%s), %d workers", t->n, t->nhosts, t->s->num_ps,
          t->o->placement, t->s->num_workers);
  char where[1024];
  size_t wl = 0;
  where[0] = '\0';
  for (int r = 0; r < t->n && wl + 64 < sizeof where; r++)
    if (t->roles[r].is_ps)
      wl += (size_t)snprintf(where + wl, sizeof where - wl, "%sps%d=rank %d on %s",
                             wl ? ", " : "", t->roles[r].index, r, t->peers[r].hello.node);
  psr_log("ps tasks: %s", where);
}

/* 3. The layout as it really is, then the roles. */
static int stage_plan(task0 *t, char *err, size_t errlen) {
  const psr_env *e = t->e;
  psr_step *s = t->s;
  if (psr_expand_nodelist(e->nodelist_var, e->nodelist, e->num_nodes, &t->hosts, &t->nhosts,
                          err, errlen) != 0)
    return -1;
  for (int r = 0; r < t->n; r++) {
    t->node_of[r] = -1;
    for (int k = 0; k < t->nhosts; k++)
      if (strcmp(t->hosts[k], t->peers[r].hello.node) == 0) t->node_of[r] = k;
    if (t->node_of[r] < 0) {
      snprintf(err, errlen, "task %d runs on %s, which is not in %s='%s'", r,
               t->peers[r].hello.node, e->nodelist_var, e->nodelist);
      return -1;
    }
  }
  psr_placement place =
      strcmp(t->o->placement, "spread") == 0 ? PSR_PLACE_SPREAD : PSR_PLACE_PACK;
  if (psr_plan(t->n, t->o->ps, place, t->node_of, t->roles, err, errlen) != 0) {
    for (int r = 1; r < t->n; r++) psr_send_text(t->peers[r].c.fd, PSR_MSG_REJECT, "%s", err);
    return -1;
  }
  s->num_ps = t->o->ps;
  s->num_workers = t->n - t->o->ps;
  s->role = t->roles[0];
  s->local_rank = t->roles[0].worker_local_rank;
  s->node_workers = t->roles[0].node_workers;
  /* MUNGE: a fresh secret, sent inside each member's credential; key
   * mode: derived from the key by every task, never sent. */
  if ((t->auth.mode == PSR_AUTH_MUNGE ? psr_new_secret(s->secret)
                                      : psr_auth_key_secret(&t->auth, s->secret)) != 0) {
    snprintf(err, errlen, "cannot draw a random secret");
    return -1;
  }
  for (int r = 1; r < t->n; r++) {
    psr_msg m = {.type = PSR_MSG_ROLE};
    m.role = (psr_assign){t->roles[r].is_ps, t->roles[r].index, s->num_ps, s->num_workers, ""};
    if (psr_auth_role_proof(&t->auth, &t->peers[r].hello, &m.role, s->secret, err, errlen) != 0) {
      broadcast_abort(t, "task 0 cannot prove itself");
      return -1;
    }
    psr_msg_send(t->peers[r].c.fd, &m);
  }
  log_plan(t);
  return 0;
}

/* The psd addresses, comma-separated in ps order, into t->hostlist. */
static int join_hostlist(task0 *t) {
  size_t hl = 0, hcap = 64;
  for (int i = 0; i < t->s->num_ps; i++) hcap += strlen(t->psaddr[i]) + 1;
  t->hostlist = malloc(hcap);
  if (!t->hostlist) return -1;
  t->hostlist[0] = '\0';
  for (int i = 0; i < t->s->num_ps; i++)
    hl += (size_t)snprintf(t->hostlist + hl, hcap - hl, "%s%s", i ? "," : "", t->psaddr[i]);
  return 0;
}

/* 4. psd addresses, in ps order. */
static int stage_addresses(task0 *t, char *err, size_t errlen) {
  psr_step *s = t->s;
  t->psaddr = calloc((size_t)s->num_ps, sizeof *t->psaddr);
  if (!t->psaddr) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  if (s->role.is_ps) {
    t->psaddr[s->role.index] = psr_step_start_psd(s, err, errlen);
    if (!t->psaddr[s->role.index]) {
      broadcast_abort(t, "task 0 could not start psd");
      return -1;
    }
  }
  double deadline = ps__now() + t->o->timeout_s;
  for (int r = 1; r < t->n; r++) {
    if (!t->roles[r].is_ps) continue;
    int eof;
    char *line = psr_conn_wait_line(&t->peers[r].c, deadline, &eof);
    psr_msg m;
    const psr_hello *h = &t->peers[r].hello;
    if (!line || psr_msg_decode(line, &m) != 0 || m.type != PSR_MSG_PSADDR ||
        !psr_auth_text_ok(s->secret, "PSADDR", r, h->nonce, m.text, m.mac)) {
      snprintf(err, errlen, "ps task %d on %s did not report its psd address%s", r, h->node,
               line ? " with a valid MAC" : " in time");
      free(line);
      broadcast_abort(t, err);
      return -1;
    }
    t->psaddr[t->roles[r].index] = strdup(m.text);
    free(line);
  }
  if (join_hostlist(t) != 0) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  psr_log("parameter servers: %s", t->hostlist);
  return 0;
}

/* Worker 0's MASTER_ADDR and MASTER_PORT: picked here when our child is
 * worker 0, else as worker 0's task reports them (MASTER). */
static int learn_master(task0 *t, char *err, size_t errlen) {
  psr_step *s = t->s;
  int w0 = 0;
  while (w0 < t->n && (t->roles[w0].is_ps || t->roles[w0].index != 0)) w0++;
  if (w0 == 0) return psr_step_pick_master(s, err, errlen);
  if (w0 == t->n) { /* psr_plan leaves at least one worker: not reached */
    snprintf(err, errlen, "the plan has no worker 0");
    return -1;
  }
  const psr_hello *h = &t->peers[w0].hello;
  int eof;
  psr_msg m;
  char *line = psr_conn_wait_line(&t->peers[w0].c, ps__now() + t->o->timeout_s, &eof);
  int ok = line && psr_msg_decode(line, &m) == 0 && m.type == PSR_MSG_MASTER &&
           psr_auth_text_ok(s->secret, "MASTER", w0, h->nonce, m.text, m.mac) &&
           psr_step_set_master(s, m.text) == 0;
  const char *why = " with a valid MAC";
  if (!line) why = " in time";
  else if (strncmp(line, "EXIT ", 5) == 0) why = ": it failed first (its log says why)";
  if (!ok)
    snprintf(err, errlen, "task %d (w0) on %s did not report its address for MASTER_ADDR%s", w0,
             h->node, why);
  free(line);
  return ok ? 0 : -1;
}

/* 5. Every worker gets the psd addresses (HOSTS), then worker 0's address
 * and its own place on its node (WORLD: torchrun's variables); then our
 * own worker starts, if we have one. */
static int stage_world(task0 *t, char *err, size_t errlen) {
  psr_step *s = t->s;
  if (learn_master(t, err, errlen) != 0) {
    broadcast_abort(t, err);
    return -1;
  }
  char master[96];
  snprintf(master, sizeof master, "%s:%d", s->master_addr, s->master_port);
  psr_log("worker 0 (MASTER_ADDR:MASTER_PORT): %s", master);
  for (int r = 1; r < t->n; r++) {
    if (t->roles[r].is_ps) continue;
    const char *nonce = t->peers[r].hello.nonce;
    psr_msg m = {.type = PSR_MSG_HOSTS, .text = t->hostlist};
    psr_auth_text_mac(s->secret, "HOSTS", r, nonce, t->hostlist, m.mac);
    psr_msg_send(t->peers[r].c.fd, &m);
    char text[256];
    psr_msg w = {.type = PSR_MSG_WORLD, .text = master};
    w.local_rank = t->roles[r].worker_local_rank;
    w.local_workers = t->roles[r].node_workers;
    psr_world_text(&w, text, sizeof text);
    psr_auth_text_mac(s->secret, "WORLD", r, nonce, text, w.mac);
    psr_msg_send(t->peers[r].c.fd, &w);
  }
  if (!s->role.is_ps && psr_step_start_worker(s, t->hostlist, err, errlen) != 0) {
    broadcast_abort(t, "task 0 could not start its worker");
    return -1;
  }
  return 0;
}

/* 6. Supervise ourselves and everyone; the step's exit status. */
static int stage_supervise(task0 *t) {
  psr_step *s = t->s;
  int aborted = 0;
  if (psr_replicas(t->o, s->num_workers, &t->backups) > 0)
    psr_log("psd averages %d of %d workers' gradients per step: the job goes on after losing "
            "up to %d worker(s)",
            s->num_workers - t->backups, s->num_workers, t->backups);
  int code = psr_supervise(s, NULL, hub_poll, t, &aborted);
  if (code != 0 && code != PSR_EXIT_STOPPED && !t->failed && !aborted) {
    char why[128];
    snprintf(why, sizeof why, "task 0 (%s%d) exited with status %d", s->role.is_ps ? "ps" : "w",
             s->role.index, code);
    psr_log("%s; stopping every task", why);
    broadcast_abort(t, why);
  }
  /* Wait for the others to report (bounded), so the step's status is right. */
  double deadline = ps__now() + t->o->grace_s + 30;
  for (;;) {
    int left = 0;
    for (int r = 1; r < t->n; r++) left += t->peers[r].c.fd >= 0 && !t->peers[r].exited;
    /* A psd outliving the workers is given its PSR_PSD_EXIT_S (hub_poll). */
    double until = t->ps_deadline + 2 > deadline ? t->ps_deadline + 2 : deadline;
    if (!left || ps__now() > until) break;
    hub_poll(s, t);
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
  int worst = code;
  for (int r = 1; r < t->n; r++) /* a spared worker's death is not the job's status */
    if (t->peers[r].exited && !t->peers[r].spared && t->peers[r].code > worst)
      worst = t->peers[r].code;
  if (t->failed && !worst) worst = t->failed;
  return worst;
}

/* psctl can reach the step: the secret in a private file on task 0's node
 * (psr_admin_cred_write), and the exact line to use, on stderr. A
 * credential that cannot be written costs psctl, not the step. */
static void admin_line(task0 *t, char *cred, size_t len) {
  psr_step *s = t->s;
  char err[512];
  if (psr_admin_cred_write(s->secret, cred, len, err, sizeof err) != 0) {
    psr_log("no credential for psctl: %s", err);
    cred[0] = '\0';
    return;
  }
  char job[200] = ""; /* psd wants a MUNGE credential for this step only under MUNGE */
  if (s->munge)
    snprintf(job, sizeof job, " --job %lld.%lld%s%.150s", s->env.job_id, s->env.step_id,
             s->munge_socket[0] ? " --munge-socket " : "", s->munge_socket);
  for (int i = 0; i < s->num_ps; i++)
    psr_log("ps%d's counters, on %s: psctl stats %s%s --secret-file %s", i, s->env.nodename,
            t->psaddr[i], job, cred);
}

int psr_run_task0(psr_step *s, char *err, size_t errlen) {
  task0 t;
  char cred[4300] = "";
  int rc = stage_init(&t, s, err, errlen);
  if (rc == 0) rc = stage_listen(&t, err, errlen);
  if (rc == 0) rc = stage_checkin(&t, err, errlen);
  if (rc == 0) rc = stage_plan(&t, err, errlen);
  if (rc == 0) rc = stage_addresses(&t, err, errlen);
  if (rc == 0) rc = stage_world(&t, err, errlen);
  if (rc == 0) admin_line(&t, cred, sizeof cred);
  if (rc == 0) rc = stage_supervise(&t);
  if (cred[0]) unlink(cred);
  task0_free(&t);
  return rc;
}
