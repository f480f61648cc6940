/*
 * slurm.c - psrun under srun: the entry point of Slurm mode, and every
 * task but task 0.
 *
 * Every task reads its Slurm environment. Task 0 (task0.c) listens on a
 * rendezvous port (published through PMI-2 with --mpi=pmi2, else the first
 * of SLURM_STEP_RESV_PORTS, else --rendezvous-port, else a port derived
 * from the job and step ids); every other task connects to it and checks
 * in with its job, step, uid, rank and node, proven by MUNGE or the job's
 * key (rdvauth.h), and trusts task 0 only once its answer proves it too, so
 * a stranger's listener is refused, never used. Task 0 learns the real layout from the check-ins
 * (nothing is guessed), assigns the roles, collects the ps tasks' psd
 * addresses and hands them to the workers. The connections stay open as
 * the step's control channel (rendezvous.h has its messages): a task whose
 * child fails reports it, task 0 tells every task to stop, and a task that
 * loses task 0 stops its child, so the step ends promptly and leaves no
 * process behind. Separate ps and worker steps (--role) meet through a
 * directory instead (rdvdir.c).
 */
#define _GNU_SOURCE
#include <poll.h>
#include <slurm/pmi2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "backoff.h"
#include "log.h"
#include "mac.h"
#include "ratelog.h"
#include "rdvauth.h"
#include "rdvdir.h"
#include "util.h"
#include "step.h"
#include "task0.h"

/* How long one check-in attempt waits for task 0's greeting (RDV), which
 * task 0 sends as it accepts: a longer silence means our connection waits
 * behind a flood or was lost, and a fresh one is tried. */
#define PSR_GREETING_S 5.0
/* Lines about check-ins tried again: the first, then one summary per
 * window (a long flood must not fill the task's log). */
#define PSR_RETRY_LOG_WINDOW_S 10.0

static const char *env_get(const char *name) { return getenv(name); }

/* ---- every task but task 0 ------------------------------------------------------- */

/* Task 0's rendezvous address from PMI-2. */
static int locate_pmi2(char *addr, size_t alen, int *port, char *err, size_t errlen) {
  char val[128];
  int vlen = 0;
  char jobid[256];
  if (PMI2_KVS_Fence() != PMI2_SUCCESS || PMI2_Job_GetId(jobid, sizeof jobid) != PMI2_SUCCESS ||
      PMI2_KVS_Get(jobid, PMI2_ID_NULL, "psrun_rendezvous", val, sizeof val, &vlen) !=
          PMI2_SUCCESS) {
    snprintf(err, errlen, "PMI-2 did not deliver task 0's rendezvous address");
    return -1;
  }
  char *colon = strrchr(val, ':');
  if (!colon) {
    snprintf(err, errlen, "PMI-2 rendezvous value '%s' is not host:port", val);
    return -1;
  }
  *colon = '\0';
  snprintf(addr, alen, "%s", val);
  *port = atoi(colon + 1);
  return 0;
}

/* Where task 0 listens: from PMI-2, else the first node and the port task 0
 * chose the same way. */
static int locate_task0(psr_step *s, char *addr, size_t alen, int *port, char *err,
                        size_t errlen) {
  const psr_opts *o = s->o;
  psr_env *e = &s->env;
  if (e->pmi2) return locate_pmi2(addr, alen, port, err, errlen);
  /* Task 0 runs on the first node of block and cyclic layouts. */
  if (e->dist != PSR_DIST_BLOCK && e->dist != PSR_DIST_CYCLIC && e->dist != PSR_DIST_PLANE) {
    snprintf(err, errlen,
             "SLURM_DISTRIBUTION=%s: cannot tell where task 0 runs; start the step with "
             "--mpi=pmi2",
             e->dist_raw ? e->dist_raw : "?");
    return -1;
  }
  char **hosts = NULL;
  int nh = 0;
  if (psr_expand_nodelist(e->nodelist_var, e->nodelist, e->num_nodes, &hosts, &nh, err,
                          errlen) != 0)
    return -1;
  int rc = psr_node_address(hosts[0], addr, alen, err, errlen);
  psr_hosts_free(hosts, nh);
  if (rc) return -1;
  *port = o->rdv_port ? o->rdv_port : e->resv_port_lo ? e->resv_port_lo : psr_derived_port(e);
  return 0;
}

/* The key mode's key: from the PMI-2 KVS, else task 0's private file. */
static int member_key(psr_step *s, psr_auth *a, double deadline, char *err, size_t errlen) {
  if (s->env.pmi2) {
    char jobid[256], val[128];
    int vlen = 0;
    if (PMI2_Job_GetId(jobid, sizeof jobid) == PMI2_SUCCESS &&
        PMI2_KVS_Get(jobid, PMI2_ID_NULL, "psrun_key", val, sizeof val, &vlen) == PMI2_SUCCESS &&
        psr_auth_key_unhex(val, a->key) == 0)
      return 0;
    snprintf(err, errlen, "PMI-2 did not deliver task 0's key");
    return -1;
  }
  char dir[4200];
  if (psr_rdv_dir(s->o, &s->env, dir, sizeof dir, err, errlen) != 0) return -1;
  return psr_rdv_key_read(dir, s->env.step_id, a->key, deadline, err, errlen);
}

/* What one check-in attempt came to. */
enum { CHECKIN_OK = 0, CHECKIN_FAILED = -1, CHECKIN_AGAIN = 1 };

/* Our side of the proofs, in the mode task 0 announced (RDV). MUNGE's
 * socket: Slurm's AuthInfo when slurm.conf can be read, else MUNGE's
 * default (the decision itself is task 0's). CHECKIN_AGAIN when no
 * greeting came (*greeted stays 0). */
static int member_auth(psr_step *s, psr_conn *ctl, psr_auth *a, double deadline, int *greeted,
                       char *err, size_t errlen) {
  int eof;
  psr_msg m;
  double until = ps__now() + PSR_GREETING_S;
  char *line = psr_conn_wait_line(ctl, until < deadline ? until : deadline, &eof);
  if (!line) {
    snprintf(err, errlen, eof ? "it closed our connection before greeting it (a flood of "
                                "connections may have pushed ours out)"
                              : "it did not greet our connection within %.0f s",
             PSR_GREETING_S);
    return CHECKIN_AGAIN;
  }
  int mode = psr_msg_decode(line, &m) == 0 && m.type == PSR_MSG_RDV ? psr_auth_mode_parse(m.text)
                                                                    : -1;
  free(line);
  if (mode < 0) {
    snprintf(err, errlen, "it did not greet with " PSR_HELLO_MAGIC);
    return CHECKIN_FAILED;
  }
  *greeted = 1;
  memset(a, 0, sizeof *a);
  a->mode = (psr_auth_mode)mode;
  a->job_id = s->env.job_id;
  a->step_id = s->env.step_id;
  a->munge_socket = s->munge_socket;
  if (mode == PSR_AUTH_MUNGE) {
    psr_opts o = *s->o;
    psr_step probe = *s;
    snprintf(o.rdv_auth, sizeof o.rdv_auth, "munge");
    probe.o = &o;
    psr_auth_mode dummy;
    if (psr_auth_decide(&probe, &dummy, err, errlen) != 0) return CHECKIN_FAILED;
    memcpy(s->munge_socket, probe.munge_socket, sizeof s->munge_socket);
    return CHECKIN_OK;
  }
  return member_key(s, a, deadline, err, errlen) == 0 ? CHECKIN_OK : CHECKIN_FAILED;
}

/* Sends our check-in (a fresh nonce each time) and verifies task 0's
 * answer: our role and the step's secret. CHECKIN_OK, CHECKIN_AGAIN (task
 * 0 closed the connection before judging our line: it was shed), or
 * CHECKIN_FAILED, with the reason in err (not yet a sentence). */
static int trade_proofs(psr_step *s, psr_conn *ctl, psr_hello *me, double deadline, int *greeted,
                        char *err, size_t errlen) {
  psr_env *e = &s->env;
  psr_auth a;
  int rc = member_auth(s, ctl, &a, deadline, greeted, err, errlen);
  if (rc != CHECKIN_OK) return rc;
  psr_msg m = {.type = PSR_MSG_HELLO};
  m.hello = (psr_hello){e->job_id, e->step_id, (unsigned)getuid(), e->ntasks, e->procid, "",
                        e->localid, "", ""};
  snprintf(m.hello.node, sizeof m.hello.node, "%s", e->nodename);
  if (psr_auth_nonce(m.hello.nonce) != 0 || psr_auth_hello_proof(&a, &m.hello, err, errlen) != 0)
    return CHECKIN_FAILED;
  *me = m.hello;
  psr_msg_send(ctl->fd, &m);
  int eof;
  char *line = psr_conn_wait_line(ctl, deadline, &eof);
  if (!line && eof) {
    snprintf(err, errlen, "it closed our connection before answering our check-in");
    return CHECKIN_AGAIN;
  }
  int ok = line && psr_msg_decode(line, &m) == 0;
  if (!ok || m.type != PSR_MSG_ROLE) {
    snprintf(err, errlen, "%s%s", !line ? "it assigned no role in time" : "it answered: ",
             !line ? "" : ok && m.type == PSR_MSG_REJECT ? m.text : line);
    free(line);
    return CHECKIN_FAILED;
  }
  free(line);
  char sock[sizeof s->munge_socket];
  if (psr_auth_check_role(&a, me, &m.role, s->secret, sock, sizeof sock, err, errlen) != 0)
    return CHECKIN_FAILED;
  s->munge = a.mode == PSR_AUTH_MUNGE;
  if (s->munge) memcpy(s->munge_socket, sock, sizeof sock);
  s->role.is_ps = m.role.is_ps;
  s->role.index = m.role.index;
  s->num_ps = m.role.num_ps;
  s->num_workers = m.role.num_workers;
  s->role.rank = e->procid;
  return CHECKIN_OK;
}

/* Connects to task 0, checks in and takes the role it assigns, once task 0
 * has proven itself. A connection task 0 closed before judging our line
 * (a flood shed it), or one it never greeted, is tried again with backoff
 * until --connect-timeout; its lines are rate-limited. */
static int check_in(psr_step *s, psr_conn *ctl, psr_hello *me, char *err, size_t errlen) {
  char addr[160], why[4096];
  int port = 0, greeted = 0;
  if (locate_task0(s, addr, sizeof addr, &port, err, errlen) != 0) return -1;
  double deadline = ps__now() + s->o->timeout_s;
  ps__backoff b;
  ps__backoff_init(&b, PSR_CONNECT_RETRY_FIRST_S, PSR_CONNECT_RETRY_MAX_S);
  ps__ratelog said = {.what = "check-ins tried again", .level = PS_LOG_INFO, .burst = 1,
                      .window_s = PSR_RETRY_LOG_WINDOW_S};
  int rc = CHECKIN_AGAIN;
  while (rc == CHECKIN_AGAIN) {
    ctl->fd = psr_tcp_connect(addr, port, deadline, !greeted, err, errlen);
    if (ctl->fd < 0) break;
    rc = trade_proofs(s, ctl, me, deadline, &greeted, why, sizeof why);
    if (rc == CHECKIN_FAILED)
      snprintf(err, errlen, "task 0 at %s:%d did not prove itself, so this task does not "
                            "trust it: %s", addr, port, why);
    if (rc != CHECKIN_AGAIN) break;
    psr_conn_close(ctl);
    ps__ratelog_say(&said, ps__now(), "task 0 at %s:%d: %s; checking in again (attempt %d, "
                    "until the %.0f s --connect-timeout)", addr, port, why, b.tries + 2,
                    s->o->timeout_s);
    if (ps__backoff_sleep(&b, deadline) < 0) {
      snprintf(err, errlen, "could not check in with task 0 at %s:%d within the %.0f s "
                            "--connect-timeout (%d attempts): %s", addr, port, s->o->timeout_s,
               b.tries, why);
      break;
    }
  }
  ps__ratelog_flush(&said, ps__now(), 1);
  return rc == CHECKIN_OK ? 0 : -1;
}

/* Worker 0's task: picks MASTER_ADDR and MASTER_PORT on this node and
 * reports them to task 0 (MASTER), which hands them to every worker. */
static int report_master(psr_step *s, psr_conn *ctl, const psr_hello *me, char *err,
                         size_t errlen) {
  if (psr_step_pick_master(s, err, errlen) != 0) return -1;
  char hp[96];
  snprintf(hp, sizeof hp, "%s:%d", s->master_addr, s->master_port);
  psr_msg m = {.type = PSR_MSG_MASTER, .text = hp};
  if (psr_auth_text_mac(s->secret, "MASTER", me->rank, me->nonce, hp, m.mac) != 0 ||
      psr_msg_send(ctl->fd, &m) != 0) {
    snprintf(err, errlen, "cannot report worker 0's address %s to task 0", hp);
    return -1;
  }
  return 0;
}

/* Task 0's next line, which must be a `want` message (HOSTS or WORLD)
 * with a valid MAC: the line (m's text points into it), or NULL with err
 * saying it did not send `what`. */
static char *expect_line(psr_step *s, psr_conn *ctl, const psr_hello *me, psr_msg_type want,
                         const char *what, psr_msg *m, char *err, size_t errlen) {
  int eof;
  char *line = psr_conn_wait_line(ctl, ps__now() + s->o->timeout_s, &eof);
  char world[256];
  int ok = line && psr_msg_decode(line, m) == 0 && m->type == want;
  if (ok && want == PSR_MSG_WORLD) psr_world_text(m, world, sizeof world);
  if (ok && psr_auth_text_ok(s->secret, psr_msg_name(want), me->rank, me->nonce,
                             want == PSR_MSG_WORLD ? world : m->text, m->mac))
    return line;
  snprintf(err, errlen, "task 0 did not send %s%s%s", what, line ? " with a valid MAC: " : "",
           line ? line : "");
  free(line);
  return NULL;
}

/* Our worker, once task 0 sent the psd addresses (HOSTS) and torchrun's
 * variables (WORLD); worker 0's task reports MASTER first. */
static int start_worker(psr_step *s, psr_conn *ctl, const psr_hello *me, char *err,
                        size_t errlen) {
  psr_msg m, w;
  if (s->role.index == 0 && report_master(s, ctl, me, err, errlen) != 0) {
    psr_send_exit(ctl->fd, 1);
    return -1;
  }
  char *hosts = expect_line(s, ctl, me, PSR_MSG_HOSTS, "the parameter servers' addresses", &m,
                            err, errlen);
  char *world = hosts ? expect_line(s, ctl, me, PSR_MSG_WORLD,
                                    "worker 0's address (MASTER_ADDR)", &w, err, errlen)
                      : NULL;
  int rc = -1;
  if (world && psr_step_set_master(s, w.text) != 0)
    snprintf(err, errlen, "task 0 sent a MASTER_ADDR:MASTER_PORT that is not host:port: %s",
             w.text);
  else if (world) {
    s->local_rank = w.local_rank;
    s->node_workers = w.local_workers;
    rc = psr_step_start_worker(s, m.text, err, errlen);
    if (rc) psr_send_exit(ctl->fd, 127);
  }
  free(hosts);
  free(world);
  return rc;
}

/* Starts our psd (reporting PSADDR) or our worker (after HOSTS and WORLD). */
static int start_child(psr_step *s, psr_conn *ctl, const psr_hello *me, char *err,
                       size_t errlen) {
  if (!s->role.is_ps) return start_worker(s, ctl, me, err, errlen);
  char *hp = psr_step_start_psd(s, err, errlen);
  if (!hp) {
    psr_send_exit(ctl->fd, 1);
    return -1;
  }
  psr_msg m = {.type = PSR_MSG_PSADDR, .text = hp};
  psr_auth_text_mac(s->secret, "PSADDR", me->rank, me->nonce, hp, m.mac);
  psr_msg_send(ctl->fd, &m);
  free(hp);
  return 0;
}

static int run_member(psr_step *s, char *err, size_t errlen) {
  psr_conn ctl = {-1, NULL, 0, 0};
  psr_hello me;
  if (check_in(s, &ctl, &me, err, errlen) != 0 || start_child(s, &ctl, &me, err, errlen) != 0) {
    psr_conn_close(&ctl);
    return -1;
  }
  int aborted = 0;
  int code = psr_supervise(s, &ctl, NULL, NULL, &aborted);
  if (!aborted) psr_send_exit(ctl.fd, code);
  else if (!code) code = 1;
  /* Give task 0 a moment to read our report before the socket closes; it
   * answers EXIT 0 when the job goes on without this worker (a backup),
   * whose task then exits 0 too: srun's status is the job's, not the loss. */
  shutdown(ctl.fd, SHUT_WR);
  struct pollfd p = {ctl.fd, POLLIN, 0};
  int eof = 0;
  char *line = poll(&p, 1, 2000) > 0 ? psr_conn_read_line(&ctl, 0, &eof) : NULL;
  psr_msg m;
  if (code && !aborted && line && psr_msg_decode(line, &m) == 0 && m.type == PSR_MSG_EXIT &&
      m.code == 0) {
    psr_log("the job goes on without this worker (a backup worker); exiting 0");
    code = 0;
  }
  free(line);
  psr_conn_close(&ctl);
  return code;
}

/* ---- --print-plan -------------------------------------------------------------- */

static int print_plan(psr_step *s, char *err, size_t errlen) {
  psr_env *e = &s->env;
  char **hosts = NULL;
  int nh = 0;
  if (psr_expand_nodelist(e->nodelist_var, e->nodelist, e->num_nodes, &hosts, &nh, err,
                          errlen) != 0)
    return -1;
  int *counts = NULL, ncounts = 0;
  if (psr_parse_tasks_per_node(e->tasks_per_node == NULL ? "SLURM_STEP_TASKS_PER_NODE"
                                                         : "SLURM_STEP_TASKS_PER_NODE",
                               e->tasks_per_node, &counts, &ncounts, err, errlen) != 0)
    return -1;
  if (ncounts != nh) {
    snprintf(err, errlen, "SLURM_STEP_TASKS_PER_NODE='%s' describes %d nodes but %s='%s' has %d",
             e->tasks_per_node, ncounts, e->nodelist_var, e->nodelist, nh);
    return -1;
  }
  int N = e->ntasks;
  int *node_of = calloc((size_t)N, sizeof *node_of);
  psr_role *roles = calloc((size_t)N, sizeof *roles);
  if (!node_of || !roles) return -1;
  if (psr_layout(e->dist, e->plane_size, counts, ncounts, N, node_of, err, errlen) != 0)
    return -1;
  psr_placement place =
      strcmp(s->o->placement, "spread") == 0 ? PSR_PLACE_SPREAD : PSR_PLACE_PACK;
  if (psr_plan(N, s->o->ps, place, node_of, roles, err, errlen) != 0) return -1;
  if (e->procid == 0)
    for (int r = 0; r < N; r++) psr_print_role(&roles[r], hosts[roles[r].node]);
  fflush(stdout);
  free(counts);
  free(node_of);
  free(roles);
  psr_hosts_free(hosts, nh);
  return 0;
}

int psr_run_slurm(const psr_opts *o) {
  psr_step s;
  memset(&s, 0, sizeof s);
  s.o = o;
  s.child = -1;
  char err[8192];
  if (psr_env_read(&s.env, env_get, err, sizeof err) != 0) {
    fprintf(stderr, "psrun: %s\n", err);
    return 2;
  }
  psr_log_ident(s.env.procid);
  int rc;
  if (o->print_plan) {
    rc = print_plan(&s, err, sizeof err);
    if (rc) fprintf(stderr, "psrun: %s\n", err);
    psr_env_free(&s.env);
    return rc ? 2 : 0;
  }
  int split = strcmp(o->role, "auto") != 0;
  if (!split && (o->ps < 1 || o->ps >= s.env.ntasks)) {
    fprintf(stderr, "psrun: --ps=%d must be at least 1 and less than the number of tasks (%d)\n",
            o->ps, s.env.ntasks);
    psr_env_free(&s.env);
    return 2;
  }
  if (psr_procs_init(&s.procs, 0) != 0) {
    fprintf(stderr, "psrun: cannot set up signal handling\n");
    return 1;
  }
  if (s.env.pmi2 && !split) {
    int spawned = 0, size = 0, rank = 0, appnum = 0;
    if (PMI2_Init(&spawned, &size, &rank, &appnum) != PMI2_SUCCESS) {
      fprintf(stderr, "psrun: PMI_FD is set but PMI2_Init failed\n");
      return 1;
    }
  }
  psr_auth_mode mode; /* separate steps decide alike; task 0 decides for its step */
  if (split && psr_auth_decide(&s, &mode, err, sizeof err) != 0) {
    psr_log("%s", err);
    return 1;
  }
  if (psr_own_address(o, &s.env, s.addr, sizeof s.addr, err, sizeof err) != 0) {
    psr_log("%s", err);
    return 1;
  }
  if (strcmp(o->role, "ps") == 0) rc = psr_run_ps_step(&s, err, sizeof err);
  else if (strcmp(o->role, "worker") == 0) rc = psr_run_worker_step(&s, err, sizeof err);
  else rc = s.env.procid == 0 ? psr_run_task0(&s, err, sizeof err) : run_member(&s, err, sizeof err);
  if (rc < 0) {
    psr_log("%s", err);
    psr_teardown(&s.procs, o->grace_s);
    rc = 1;
  }
  if (s.env.pmi2 && !split) PMI2_Finalize();
  psr_env_free(&s.env);
  free(s.hosts); /* kept for --restart-workers */
  return rc;
}
