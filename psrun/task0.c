/*
 * task0.c - psrun task 0 of a Slurm step, as stages over one struct:
 *   listen     on the rendezvous port (published through PMI-2 if any)
 *   check-in   every task says HELLO; strangers are refused
 *   plan       the layout as the check-ins tell it, the roles, the secret
 *   addresses  each ps task's psd address, then HOSTS to the workers
 *   supervise  its own child and, through their connections, every task
 * task0_free releases whatever the stages opened, on every path.
 */
#define _GNU_SOURCE
#include "task0.h"

#include <errno.h>
#include <poll.h>
#include <slurm/pmi2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

typedef struct peer {
  psr_conn c;              /* control connection (fd -1 for ourselves) */
  psr_hello hello;         /* its check-in (rank, node, localid) */
  int exited;              /* sent EXIT */
  int code;                /* its exit code */
} peer;

typedef struct task0 {
  psr_step *s;
  const psr_opts *o;
  const psr_env *e;
  int n;                   /* tasks in the step */
  peer *peers;             /* by rank; peers[0] is ourselves */
  int failed;              /* a task failed: ABORT sent (its code) */
  int lfd;                 /* rendezvous listener, -1 */
  char **hosts;            /* the step's nodes */
  int nhosts;
  int *node_of;            /* node index of every rank */
  psr_role *roles;         /* role of every rank */
  char **psaddr;           /* psd "host:port" by ps index */
  char *hostlist;          /* the same, comma-separated */
} task0;

static void task0_free(task0 *t) {
  if (t->lfd >= 0) close(t->lfd);
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
    char why[512];
    snprintf(why, sizeof why, "task %d on %s exited with status %d", r, p->hello.node, p->code);
    fail(t, p->code, why);
  }
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
  if (!t->peers || !t->node_of || !t->roles) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  for (int r = 0; r < t->n; r++) t->peers[r].c.fd = -1;
  snprintf(t->peers[0].hello.node, sizeof t->peers[0].hello.node, "%s", t->e->nodename);
  t->peers[0].hello.localid = t->e->localid;
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
  if (e->pmi2) {
    char val[128];
    snprintf(val, sizeof val, "%s:%d", t->s->addr, bound);
    if (PMI2_KVS_Put("psrun_rendezvous", val) != PMI2_SUCCESS ||
        PMI2_KVS_Fence() != PMI2_SUCCESS) {
      snprintf(err, errlen, "PMI-2 could not publish the rendezvous address");
      return -1;
    }
  }
  psr_log("rendezvous on %s:%d (%s)", t->s->addr, bound,
          e->pmi2 ? "PMI-2" : t->o->rdv_port ? "--rendezvous-port"
                  : e->resv_port_lo ? "SLURM_STEP_RESV_PORTS" : "derived from the job id");
  return 0;
}

/* Reads one connection's HELLO: its rank when it is one of ours, else
 * refuses it (REJECT) and returns -1. */
static int check_in(task0 *t, psr_conn *c, psr_hello *h) {
  const psr_env *e = t->e;
  int eof;
  char *line = psr_conn_wait_line(c, ps__now() + 10, &eof);
  psr_msg m;
  int ok = line && psr_msg_decode(line, &m) == 0 && m.type == PSR_MSG_HELLO;
  free(line);
  if (!ok) {
    psr_send_text(c->fd, PSR_MSG_REJECT, "not a psrun check-in");
    return -1;
  }
  *h = m.hello;
  if (h->job_id != e->job_id || h->step_id != e->step_id || h->uid != getuid() ||
      h->ntasks != t->n) {
    psr_send_text(c->fd, PSR_MSG_REJECT,
                  "this is job %lld step %lld (uid %u, %d tasks), not job %lld step "
                  "%lld (uid %u, %d tasks)",
                  e->job_id, e->step_id, (unsigned)getuid(), t->n, h->job_id, h->step_id,
                  h->uid, h->ntasks);
    return -1;
  }
  if (h->rank <= 0 || h->rank >= t->n || t->peers[h->rank].c.fd >= 0) {
    psr_send_text(c->fd, PSR_MSG_REJECT, "rank %d is invalid or already checked in", h->rank);
    return -1;
  }
  return h->rank;
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

/* 2. Every task checks in. */
static int stage_checkin(task0 *t, char *err, size_t errlen) {
  double deadline = ps__now() + t->o->timeout_s;
  for (int joined = 1; joined < t->n;) {
    double left = deadline - ps__now();
    if (left <= 0) {
      missing(t, err, errlen);
      return -1;
    }
    struct pollfd p = {t->lfd, POLLIN, 0};
    if (poll(&p, 1, (int)(left * 1000) + 1) <= 0) continue;
    int fd = accept4(t->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    psr_conn c = {fd, NULL, 0, 0};
    psr_hello h;
    int rank = check_in(t, &c, &h);
    if (rank < 0) {
      psr_conn_close(&c);
      continue;
    }
    t->peers[rank].c = c;
    t->peers[rank].hello = h;
    joined++;
  }
  close(t->lfd);
  t->lfd = -1;
  return 0;
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
  if (psr_new_secret(s->secret) != 0) {
    snprintf(err, errlen, "cannot draw a random secret");
    return -1;
  }
  for (int r = 1; r < t->n; r++) {
    psr_msg m = {.type = PSR_MSG_ROLE};
    m.role = (psr_assign){t->roles[r].is_ps, t->roles[r].index, s->num_ps, s->num_workers, ""};
    memcpy(m.role.secret, s->secret, sizeof m.role.secret);
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

/* 4. psd addresses, in ps order; then the workers start. */
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
    if (!line || psr_msg_decode(line, &m) != 0 || m.type != PSR_MSG_PSADDR) {
      snprintf(err, errlen, "ps task %d on %s did not report its psd address%s", r,
               t->peers[r].hello.node, line ? "" : " in time");
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
  for (int r = 1; r < t->n; r++)
    if (!t->roles[r].is_ps) psr_send_text(t->peers[r].c.fd, PSR_MSG_HOSTS, "%s", t->hostlist);
  if (!s->role.is_ps && psr_step_start_worker(s, t->hostlist, err, errlen) != 0) {
    broadcast_abort(t, "task 0 could not start its worker");
    return -1;
  }
  return 0;
}

/* 5. Supervise ourselves and everyone; the step's exit status. */
static int stage_supervise(task0 *t) {
  psr_step *s = t->s;
  int aborted = 0;
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
    if (!left || ps__now() > deadline) break;
    hub_poll(s, t);
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
  int worst = code;
  for (int r = 1; r < t->n; r++)
    if (t->peers[r].exited && t->peers[r].code > worst) worst = t->peers[r].code;
  if (t->failed && !worst) worst = t->failed;
  return worst;
}

int psr_run_task0(psr_step *s, char *err, size_t errlen) {
  task0 t;
  int rc = stage_init(&t, s, err, errlen);
  if (rc == 0) rc = stage_listen(&t, err, errlen);
  if (rc == 0) rc = stage_checkin(&t, err, errlen);
  if (rc == 0) rc = stage_plan(&t, err, errlen);
  if (rc == 0) rc = stage_addresses(&t, err, errlen);
  if (rc == 0) rc = stage_supervise(&t);
  task0_free(&t);
  return rc;
}
