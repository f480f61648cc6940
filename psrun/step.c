/* step.c - what every task of a Slurm step does alike: find addresses,
 * start its psd or worker, supervise it (see step.h). */
#define _GNU_SOURCE
#include "step.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <slurm/slurm.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "launch.h"
#include "util.h"


/* IPv4 address of a host name (or dotted address) into out. */
static int resolve(const char *name, char *out, size_t len) {
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(name, NULL, &hints, &res) != 0 || !res) return -1;
  inet_ntop(AF_INET, &((struct sockaddr_in *)res->ai_addr)->sin_addr, out, (socklen_t)len);
  freeaddrinfo(res);
  return 0;
}

/* Address of a Slurm node: its NodeAddr from slurmctld when it has one,
 * else its name resolved. */
int psr_node_address(const char *node, char *out, size_t len, char *err, size_t errlen) {
  node_info_msg_t *info = NULL;
  if (slurm_load_node_single(&info, (char *)node, 0) == 0 && info && info->record_count > 0 &&
      info->node_array[0].node_addr && info->node_array[0].node_addr[0]) {
    int rc = resolve(info->node_array[0].node_addr, out, len);
    slurm_free_node_info_msg(info);
    if (rc == 0) return 0;
  } else if (info) {
    slurm_free_node_info_msg(info);
  }
  if (resolve(node, out, len) == 0) return 0;
  snprintf(err, errlen, "cannot find an address for node %s (neither slurmctld nor the resolver "
                        "knows it); use --iface or --addr", node);
  return -1;
}

/* This task's address: --iface NAME, --addr CIDR, or its node's address. */
int psr_own_address(const psr_opts *o, const psr_env *e, char *out, size_t len, char *err,
                    size_t errlen) {
  if (!o->iface[0] && !o->addr[0]) return psr_node_address(e->nodename, out, len, err, errlen);
  struct in_addr net = {0};
  int bits = 32;
  if (o->addr[0]) {
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%s", o->addr);
    char *slash = strchr(tmp, '/');
    if (slash) {
      *slash = '\0';
      bits = atoi(slash + 1);
    }
    if (inet_pton(AF_INET, tmp, &net) != 1 || bits < 0 || bits > 32) {
      snprintf(err, errlen, "--addr '%s' is not an IPv4 CIDR like 10.0.0.0/8", o->addr);
      return -1;
    }
  }
  uint32_t mask = bits ? htonl(0xffffffffu << (32 - bits)) : 0;
  struct ifaddrs *ifs = NULL, *i;
  if (getifaddrs(&ifs) != 0) {
    snprintf(err, errlen, "getifaddrs: %s", strerror(errno));
    return -1;
  }
  int found = 0;
  for (i = ifs; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    struct in_addr a = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
    if (o->iface[0] && strcmp(i->ifa_name, o->iface) != 0) continue;
    if (o->addr[0] && (a.s_addr & mask) != (net.s_addr & mask)) continue;
    inet_ntop(AF_INET, &a, out, (socklen_t)len);
    found = 1;
  }
  freeifaddrs(ifs);
  if (!found) {
    snprintf(err, errlen, "no IPv4 address on this node matches %s%s%s", o->iface[0] ? "--iface " : "--addr ",
             o->iface[0] ? o->iface : o->addr, "");
    return -1;
  }
  return 0;
}

/* Rendezvous port when nothing publishes one: derived from job and step. */
int psr_derived_port(const psr_env *e) {
  unsigned long long h = (unsigned long long)e->job_id * 1000003ULL +
                         (unsigned long long)e->step_id * 7919ULL;
  return PSR_PORT_BASE + (int)(h % PSR_PORT_SPAN);
}

int psr_port_ephemeral(int port) {
  FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  int lo = 0, hi = -1;
  if (f) {
    if (fscanf(f, "%d %d", &lo, &hi) != 2) hi = -1;
    fclose(f);
  }
  return port >= lo && port <= hi;
}

/* This task as launch.c sees it. */
static psr_task task_of(psr_step *s) {
  psr_task t;
  memset(&t, 0, sizeof t);
  t.o = s->o;
  t.host = s->addr;
  t.index = s->role.index;
  t.num_ps = s->num_ps;
  t.num_workers = s->num_workers;
  t.local_rank = s->local_rank;
  t.node_workers = s->node_workers;
  t.master_addr = s->master_addr;
  t.master_port = s->master_port;
  t.secret = s->secret;
  t.munge = s->munge;
  t.munge_socket = s->munge_socket;
  t.job_id = s->env.job_id;
  /* psd of a ps step of its own serves worker steps with other step ids. */
  t.step_id = s->role.is_ps && strcmp(s->o->role, "ps") == 0 ? -1 : s->env.step_id;
  t.summary = "-"; /* ps0 prints the telemetry table into the job's output */
  t.restarts = s->restarts;
  return t;
}

int psr_step_pick_master(psr_step *s, char *err, size_t errlen) {
  snprintf(s->master_addr, sizeof s->master_addr, "%s", s->addr);
  return psr_free_port(&s->master_port, err, errlen);
}

int psr_step_set_master(psr_step *s, const char *hostport) {
  return ps__parse_hostport(hostport, s->master_addr, sizeof s->master_addr, &s->master_port);
}

/* Starts psd for this ps task and returns its "host:port" (malloc'd). */
char *psr_step_start_psd(psr_step *s, char *err, size_t errlen) {
  psr_task t = task_of(s);
  char *hp = psr_start_psd(&s->procs, &t, err, errlen);
  s->child = hp ? s->procs.n - 1 : -1;
  return hp;
}

int psr_step_start_worker(psr_step *s, const char *hosts, char *err, size_t errlen) {
  psr_task t = task_of(s);
  if (hosts != s->hosts) {
    free(s->hosts);
    s->hosts = strdup(hosts);
  }
  s->child = psr_start_worker(&s->procs, &t, hosts, err, errlen);
  return s->child < 0 ? -1 : 0;
}

/* Our worker died (code): starts it again in place while --restart-workers
 * allows (counted per task: each task's psrun knows only its own worker).
 * 1 when restarted. */
static int restart_worker(psr_step *s, int code) {
  char err[512];
  if (s->role.is_ps || !s->hosts || code == 0 || code == PSR_EXIT_STOPPED ||
      s->restarts >= s->o->restart_workers)
    return 0;
  s->restarts++;
  if (psr_step_start_worker(s, s->hosts, err, sizeof err) != 0) {
    psr_log("cannot restart w%d: %s", s->role.index, err);
    return 0;
  }
  psr_log("w%d exited with status %d; restarted it (%d restart(s) left)", s->role.index, code,
          s->o->restart_workers - s->restarts);
  return 1;
}

/* Stops everything: *aborted set, children torn down; returns code. */
static int stop_all(psr_step *s, int *aborted, int code) {
  *aborted = 1;
  psr_teardown(&s->procs, s->o->grace_s);
  return code;
}

/* Reads what task 0 sent: 1 to stop (ABORT or the connection lost). */
static int control_says_stop(psr_conn *ctl) {
  int eof;
  char *line;
  while ((line = psr_conn_read_line(ctl, 0, &eof)) != NULL) {
    psr_msg m;
    int abort = psr_msg_decode(line, &m) == 0 && m.type == PSR_MSG_ABORT;
    if (abort) psr_log("stopping: %s", m.text[0] ? m.text : "task 0 asked");
    free(line);
    if (abort) return 1;
  }
  if (eof) psr_log("lost the control connection to psrun task 0; stopping");
  return eof;
}

int psr_supervise(psr_step *s, psr_conn *ctl, psr_peer_cb poll_peers, void *ctx, int *aborted) {
  for (;;) {
    int which = -1;
    if (s->child >= 0 && s->procs.kids[s->child].exited) {
      int code = psr_child_code(&s->procs.kids[s->child]);
      if (!restart_worker(s, code)) return code;
    }
    psr_event ev = psr_wait(&s->procs, poll_peers ? 100 : -1, ctl ? ctl->fd : -1, &which);
    if (ev == PSR_EV_EXIT) continue;
    if (ev == PSR_EV_SIGNAL) continue; /* forwarded; the child decides */
    if (ev == PSR_EV_FD && ctl && control_says_stop(ctl)) return stop_all(s, aborted, 1);
    if (poll_peers) {
      int rc = poll_peers(s, ctx);
      if (rc > 0) return stop_all(s, aborted, rc);
    }
  }
}
