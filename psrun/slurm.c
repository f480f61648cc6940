/*
 * slurm.c - psrun under srun.
 *
 * Every task reads its Slurm environment. Task 0 listens on a rendezvous
 * port (published through PMI-2 with --mpi=pmi2, else the first of
 * SLURM_STEP_RESV_PORTS, else --rendezvous-port, else a port derived from
 * the job and step ids); every other task connects to it and checks in with
 * its job, step, uid, rank and node, so a stranger's listener is refused,
 * never used. Task 0 learns the real layout from the check-ins (nothing is
 * guessed), assigns the roles, collects the ps tasks' psd addresses and
 * hands them to the workers. The connections stay open as the step's
 * control channel: a task whose child fails reports it, task 0 tells every
 * task to stop, and a task that loses task 0 stops its child, so the step
 * ends promptly and leaves no process behind.
 *
 * Wire format of the control channel: one line per message, words
 * separated by spaces:
 *   HELLO PSRUN1 <job> <step> <uid> <ntasks> <rank> <node> <localid>   (task -> 0)
 *   ROLE ps|worker <index> <num_ps> <num_workers> <secret>             (0 -> task)
 *   REJECT <reason...>                                                 (0 -> task)
 *   PSADDR <host:port>                                                 (ps task -> 0)
 *   HOSTS <h1:p1,h2:p2,...>                                            (0 -> worker)
 *   EXIT <code>                                                        (task -> 0)
 *   ABORT <reason...>                                                  (0 -> task)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <slurm/pmi2.h>
#include <slurm/slurm.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "launch.h"
#include "proc.h"
#include "psrun.h"
#include "ps_internal.h"

/* Control lines are short; a longer one is a protocol error. HOSTS for
 * 4096 ps tasks of ~40 bytes fits. */
#define PSR_LINE_MAX_BYTES (256u * 1024u)
/* Range of ports derived from the job and step ids (above the usual
 * ephemeral range's start, below its end: collisions are detected). */
#define PSR_PORT_BASE 20000
#define PSR_PORT_SPAN 30000

static const char *env_get(const char *name) { return getenv(name); }

/* ---- line I/O ---------------------------------------------------------------- */

typedef struct lconn {
  int fd;               /* socket, -1 when closed */
  char *buf;            /* unread input */
  size_t len, cap;
} lconn;

static int send_line(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int send_line(int fd, const char *fmt, ...) {
  char line[PSR_LINE_MAX_BYTES];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, ap);
  va_end(ap);
  if (n < 0 || (size_t)n >= sizeof line - 1) return -1;
  line[n++] = '\n';
  for (int off = 0; off < n;) {
    ssize_t w = send(fd, line + off, (size_t)(n - off), MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    off += (int)w;
  }
  return 0;
}

/* Returns a malloc'd line (without '\n') if one is buffered or readable
 * now; NULL with *eof set on EOF/error or an oversized line. Non-blocking
 * when `block` is 0. */
static char *read_line(lconn *c, int block, int *eof) {
  *eof = 0;
  for (;;) {
    char *nl = c->len ? memchr(c->buf, '\n', c->len) : NULL;
    if (nl) {
      size_t l = (size_t)(nl - c->buf);
      char *line = malloc(l + 1);
      if (!line) return NULL;
      memcpy(line, c->buf, l);
      line[l] = '\0';
      memmove(c->buf, nl + 1, c->len - l - 1);
      c->len -= l + 1;
      return line;
    }
    if (c->len >= PSR_LINE_MAX_BYTES || c->fd < 0) {
      *eof = 1;
      return NULL;
    }
    if (c->cap - c->len < 4096) {
      size_t nc = c->cap ? c->cap * 2 : 8192;
      char *nb = realloc(c->buf, nc);
      if (!nb) {
        *eof = 1;
        return NULL;
      }
      c->buf = nb;
      c->cap = nc;
    }
    ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, block ? 0 : MSG_DONTWAIT);
    if (r > 0) {
      c->len += (size_t)r;
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return NULL;
    *eof = 1;
    return NULL;
  }
}

/* Waits (up to deadline) for one line on c. */
static char *wait_line(lconn *c, double deadline, int *eof) {
  for (;;) {
    char *l = read_line(c, 0, eof);
    if (l || *eof) return l;
    double left = deadline - ps__now();
    if (left <= 0) return NULL;
    struct pollfd p = {c->fd, POLLIN, 0};
    poll(&p, 1, (int)(left * 1000) + 1);
  }
}

/* ---- addresses ---------------------------------------------------------------- */

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
static int node_address(const char *node, char *out, size_t len, char *err, size_t errlen) {
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
static int own_address(const psr_opts *o, const psr_env *e, char *out, size_t len, char *err,
                       size_t errlen) {
  if (!o->iface[0] && !o->addr[0]) return node_address(e->nodename, out, len, err, errlen);
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

static int tcp_listen_on(const char *addr, int port, int *bound, char *err, size_t errlen) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, addr, &sa.sin_addr);
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 4096) != 0) {
    snprintf(err, errlen, "cannot listen on %s:%d: %s%s", addr, port, strerror(errno),
             errno == EADDRINUSE ? " (another job on this node? pass --rendezvous-port, or run "
                                   "srun with --resv-ports or --mpi=pmi2)"
                                 : "");
    if (fd >= 0) close(fd);
    return -1;
  }
  socklen_t sl = sizeof sa;
  getsockname(fd, (struct sockaddr *)&sa, &sl);
  *bound = ntohs(sa.sin_port);
  return fd;
}

static int tcp_connect_to(const char *addr, int port, double deadline, char *err,
                          size_t errlen) {
  double backoff = 0.05;
  for (;;) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    inet_pton(AF_INET, addr, &sa.sin_addr);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    int e = errno;
    if (fd >= 0) close(fd);
    if (ps__now() + backoff > deadline) {
      snprintf(err, errlen, "cannot reach psrun task 0 at %s:%d: %s", addr, port, strerror(e));
      return -1;
    }
    struct timespec ts = {(time_t)backoff, (long)((backoff - (time_t)backoff) * 1e9)};
    nanosleep(&ts, NULL);
    backoff = backoff * 2 > 0.5 ? 0.5 : backoff * 2;
  }
}

/* Rendezvous port when nothing publishes one: derived from job and step. */
static int derived_port(const psr_env *e) {
  unsigned long long h = (unsigned long long)e->job_id * 1000003ULL +
                         (unsigned long long)e->step_id * 7919ULL;
  return PSR_PORT_BASE + (int)(h % PSR_PORT_SPAN);
}

/* ---- the step ------------------------------------------------------------------- */

typedef struct peer {
  lconn c;              /* control connection (task 0 side) */
  int rank;             /* its rank */
  int localid;          /* SLURM_LOCALID */
  char node[PSR_MAX_HOST]; /* SLURMD_NODENAME */
  int exited;           /* sent EXIT */
  int code;             /* its exit code */
} peer;

typedef struct step {
  const psr_opts *o;
  psr_env env;
  psr_procs procs;
  char addr[64];         /* this task's address */
  psr_role role;         /* this task's role */
  int num_ps, num_workers;
  int child;             /* index of our child in procs, -1 */
  char secret[65];       /* shared secret of this step's psd and workers */
  int munge;             /* the cluster authenticates with MUNGE: so do we */
  char munge_socket[1024]; /* munged socket from Slurm's AuthInfo, or "" */
} step;

/* Does the cluster use MUNGE, and on which socket (AuthInfo=socket=...)? */
static void find_munge(step *s) {
  slurm_conf_t *conf = NULL;
  if (slurm_load_ctl_conf((time_t)0, &conf) != 0 || !conf) return;
  if (conf->authtype && strstr(conf->authtype, "munge")) {
    s->munge = 1;
    const char *sock = conf->authinfo ? strstr(conf->authinfo, "socket=") : NULL;
    if (sock) {
      sock += 7;
      size_t n = strcspn(sock, ",");
      snprintf(s->munge_socket, sizeof s->munge_socket, "%.*s", (int)n, sock);
    }
  }
  slurm_free_ctl_conf(conf);
}

/* This task as launch.c sees it. */
static psr_task task_of(step *s) {
  psr_task t;
  memset(&t, 0, sizeof t);
  t.o = s->o;
  t.host = s->addr;
  t.index = s->role.index;
  t.num_ps = s->num_ps;
  t.num_workers = s->num_workers;
  t.local_rank = s->env.localid;
  t.secret = s->secret;
  t.munge = s->munge;
  t.munge_socket = s->munge_socket;
  t.job_id = s->env.job_id;
  /* psd of a ps step of its own serves worker steps with other step ids. */
  t.step_id = s->role.is_ps && strcmp(s->o->role, "ps") == 0 ? -1 : s->env.step_id;
  t.summary = "-"; /* ps0 prints the telemetry table into the job's output */
  return t;
}

/* Starts psd for this ps task and returns its "host:port" (malloc'd). */
static char *start_psd(step *s, char *err, size_t errlen) {
  psr_task t = task_of(s);
  char *hp = psr_start_psd(&s->procs, &t, err, errlen);
  s->child = hp ? s->procs.n - 1 : -1;
  return hp;
}

static int start_worker(step *s, const char *hosts, char *err, size_t errlen) {
  psr_task t = task_of(s);
  s->child = psr_start_worker(&s->procs, &t, hosts, err, errlen);
  return s->child < 0 ? -1 : 0;
}

/* Supervises our child until it exits, watching the control fd (or, on
 * task 0, every peer via on_peer). Returns the child's exit code, or a
 * non-zero code when told to stop or when the control channel is lost. */
typedef int (*peer_cb)(step *s, void *ctx); /* >0: stop with that code */

static int supervise(step *s, int ctl_fd, lconn *ctl, peer_cb poll_peers, void *ctx,
                     int *aborted) {
  for (;;) {
    int which = -1;
    if (s->child >= 0 && s->procs.kids[s->child].exited) {
      return psr_exit_code(s->procs.kids[s->child].status);
    }
    psr_event ev = psr_wait(&s->procs, poll_peers ? 100 : -1, ctl_fd, &which);
    if (ev == PSR_EV_EXIT) continue;
    if (ev == PSR_EV_SIGNAL) continue; /* forwarded; the child decides */
    if (ev == PSR_EV_FD && ctl) {
      int eof;
      char *line;
      while ((line = read_line(ctl, 0, &eof)) != NULL) {
        if (strncmp(line, "ABORT", 5) == 0) {
          psr_log("stopping: %s", line[5] ? line + 6 : "task 0 asked");
          free(line);
          *aborted = 1;
          psr_teardown(&s->procs, s->o->grace_s);
          return 1;
        }
        free(line);
      }
      if (eof) {
        psr_log("lost the control connection to psrun task 0; stopping");
        *aborted = 1;
        psr_teardown(&s->procs, s->o->grace_s);
        return 1;
      }
    }
    if (poll_peers) {
      int rc = poll_peers(s, ctx);
      if (rc > 0) {
        *aborted = 1;
        psr_teardown(&s->procs, s->o->grace_s);
        return rc;
      }
    }
  }
}

/* ---- task 0 --------------------------------------------------------------------- */

typedef struct hub {
  peer *peers;         /* by rank; peers[0] is ourselves (no connection) */
  int n;
  int failed;          /* a task failed: ABORT sent */
} hub;

static void broadcast(hub *h, const char *fmt, const char *arg) {
  for (int r = 1; r < h->n; r++)
    if (h->peers[r].c.fd >= 0) send_line(h->peers[r].c.fd, fmt, arg);
}

/* Task 0's poll over every peer's control connection. */
static int hub_poll(step *s, void *ctx) {
  hub *h = ctx;
  for (int r = 1; r < h->n; r++) {
    peer *p = &h->peers[r];
    if (p->c.fd < 0) continue;
    int eof;
    char *line;
    while ((line = read_line(&p->c, 0, &eof)) != NULL) {
      if (strncmp(line, "EXIT ", 5) == 0) {
        p->exited = 1;
        p->code = atoi(line + 5);
        if (p->code != 0 && p->code != PSR_EXIT_STOPPED && !h->failed) {
          char why[512];
          snprintf(why, sizeof why, "task %d on %s exited with status %d", r, p->node, p->code);
          psr_log("%s; stopping every task", why);
          h->failed = p->code;
          broadcast(h, "ABORT %s", why);
        }
      }
      free(line);
    }
    if (eof) {
      close(p->c.fd);
      p->c.fd = -1;
      if (!p->exited && !h->failed) {
        char why[512];
        snprintf(why, sizeof why, "task %d on %s went away without reporting its exit", r,
                 p->node);
        psr_log("%s; stopping every task", why);
        h->failed = 1;
        broadcast(h, "ABORT %s", why);
      }
    }
  }
  (void)s;
  return h->failed ? h->failed : 0;
}

static int run_task0(step *s, char *err, size_t errlen) {
  const psr_opts *o = s->o;
  psr_env *e = &s->env;
  int N = e->ntasks;
  hub h = {calloc((size_t)N, sizeof(peer)), N, 0};
  if (!h.peers) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  for (int r = 0; r < N; r++) h.peers[r].c.fd = -1;
  snprintf(h.peers[0].node, sizeof h.peers[0].node, "%s", e->nodename);
  h.peers[0].localid = e->localid;

  /* 1. Listen where the others will look. */
  int port = o->rdv_port;
  if (!port && !e->pmi2 && e->resv_port_lo) port = e->resv_port_lo;
  if (!port && !e->pmi2) port = derived_port(e);
  int bound = 0;
  int lfd = tcp_listen_on(s->addr, port, &bound, err, errlen);
  if (lfd < 0) return -1;
  if (e->pmi2) {
    char val[128];
    snprintf(val, sizeof val, "%s:%d", s->addr, bound);
    if (PMI2_KVS_Put("psrun_rendezvous", val) != PMI2_SUCCESS ||
        PMI2_KVS_Fence() != PMI2_SUCCESS) {
      snprintf(err, errlen, "PMI-2 could not publish the rendezvous address");
      return -1;
    }
  }
  psr_log("rendezvous on %s:%d (%s)", s->addr, bound,
          e->pmi2 ? "PMI-2" : o->rdv_port ? "--rendezvous-port"
                  : e->resv_port_lo ? "SLURM_STEP_RESV_PORTS" : "derived from the job id");

  /* 2. Every task checks in. */
  double deadline = ps__now() + o->timeout_s;
  int joined = 1;
  while (joined < N) {
    double left = deadline - ps__now();
    if (left <= 0) {
      char missing[512] = "";
      size_t m = 0;
      for (int r = 1; r < N && m + 16 < sizeof missing; r++)
        if (h.peers[r].c.fd < 0) m += (size_t)snprintf(missing + m, sizeof missing - m, "%s%d", m ? "," : "", r);
      snprintf(err, errlen, "tasks %s did not check in within %.0f s", missing, o->timeout_s);
      return -1;
    }
    struct pollfd p = {lfd, POLLIN, 0};
    if (poll(&p, 1, (int)(left * 1000) + 1) <= 0) continue;
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    lconn tmp = {fd, NULL, 0, 0};
    int eof;
    char *line = wait_line(&tmp, ps__now() + 10, &eof);
    char tag[16], magic[16], node[PSR_MAX_HOST];
    long long job, stp;
    unsigned uid;
    int nt, rank, lid;
    int ok = line && sscanf(line, "%15s %15s %lld %lld %u %d %d %255s %d", tag, magic, &job,
                            &stp, &uid, &nt, &rank, node, &lid) == 9 &&
             !strcmp(tag, "HELLO") && !strcmp(magic, "PSRUN1");
    if (!ok) {
      send_line(fd, "REJECT not a psrun check-in");
    } else if (job != e->job_id || stp != e->step_id || uid != getuid() || nt != N) {
      send_line(fd, "REJECT this is job %lld step %lld (uid %u, %d tasks), not job %lld step "
                    "%lld (uid %u, %d tasks)",
                e->job_id, e->step_id, (unsigned)getuid(), N, job, stp, uid, nt);
      ok = 0;
    } else if (rank <= 0 || rank >= N || h.peers[rank].c.fd >= 0) {
      send_line(fd, "REJECT rank %d is invalid or already checked in", rank);
      ok = 0;
    }
    free(line);
    if (!ok) {
      free(tmp.buf);
      close(fd);
      continue;
    }
    peer *pr = &h.peers[rank];
    pr->c = tmp;
    pr->rank = rank;
    pr->localid = lid;
    snprintf(pr->node, sizeof pr->node, "%s", node);
    joined++;
  }
  close(lfd);

  /* 3. The layout as it really is, then the roles. */
  char **hosts = NULL;
  int nhosts = 0;
  if (psr_expand_nodelist(e->nodelist_var, e->nodelist, e->num_nodes, &hosts, &nhosts, err,
                          errlen) != 0)
    return -1;
  int *node_of = calloc((size_t)N, sizeof *node_of);
  psr_role *roles = calloc((size_t)N, sizeof *roles);
  if (!node_of || !roles) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  for (int r = 0; r < N; r++) {
    node_of[r] = -1;
    for (int k = 0; k < nhosts; k++)
      if (strcmp(hosts[k], h.peers[r].node) == 0) node_of[r] = k;
    if (node_of[r] < 0) {
      snprintf(err, errlen, "task %d runs on %s, which is not in %s='%s'", r, h.peers[r].node,
               e->nodelist_var, e->nodelist);
      return -1;
    }
  }
  psr_placement place = strcmp(o->placement, "spread") == 0 ? PSR_PLACE_SPREAD : PSR_PLACE_PACK;
  if (psr_plan(N, o->ps, place, node_of, roles, err, errlen) != 0) {
    for (int r = 1; r < N; r++) send_line(h.peers[r].c.fd, "REJECT %s", err);
    return -1;
  }
  s->num_ps = o->ps;
  s->num_workers = N - o->ps;
  s->role = roles[0];
  if (psr_new_secret(s->secret) != 0) {
    snprintf(err, errlen, "cannot draw a random secret");
    return -1;
  }
  for (int r = 1; r < N; r++)
    send_line(h.peers[r].c.fd, "ROLE %s %d %d %d %s", roles[r].is_ps ? "ps" : "worker",
              roles[r].index, s->num_ps, s->num_workers, s->secret);
  psr_log("%d tasks on %d nodes: %d ps (%s), %d workers", N, nhosts, s->num_ps, o->placement,
          s->num_workers);
  {
    char where[1024];
    size_t wl = 0;
    where[0] = '\0';
    for (int r = 0; r < N && wl + 64 < sizeof where; r++)
      if (roles[r].is_ps)
        wl += (size_t)snprintf(where + wl, sizeof where - wl, "%sps%d=rank %d on %s",
                               wl ? ", " : "", roles[r].index, r, h.peers[r].node);
    psr_log("ps tasks: %s", where);
  }

  /* 4. psd addresses, in ps order. */
  char **psaddr = calloc((size_t)s->num_ps, sizeof *psaddr);
  if (!psaddr) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  if (s->role.is_ps) {
    psaddr[s->role.index] = start_psd(s, err, errlen);
    if (!psaddr[s->role.index]) {
      broadcast(&h, "ABORT %s", "task 0 could not start psd");
      return -1;
    }
  }
  deadline = ps__now() + o->timeout_s;
  for (int r = 1; r < N; r++) {
    if (!roles[r].is_ps) continue;
    int eof;
    char *line = wait_line(&h.peers[r].c, deadline, &eof);
    if (!line || strncmp(line, "PSADDR ", 7) != 0) {
      snprintf(err, errlen, "ps task %d on %s did not report its psd address%s", r,
               h.peers[r].node, line ? "" : " in time");
      free(line);
      broadcast(&h, "ABORT %s", err);
      return -1;
    }
    psaddr[roles[r].index] = strdup(line + 7);
    free(line);
  }
  size_t hl = 0, hcap = 64;
  for (int i = 0; i < s->num_ps; i++) hcap += strlen(psaddr[i]) + 1;
  char *hostlist = malloc(hcap);
  if (!hostlist) return -1;
  hostlist[0] = '\0';
  for (int i = 0; i < s->num_ps; i++)
    hl += (size_t)snprintf(hostlist + hl, hcap - hl, "%s%s", i ? "," : "", psaddr[i]);
  psr_log("parameter servers: %s", hostlist);
  for (int r = 1; r < N; r++)
    if (!roles[r].is_ps) send_line(h.peers[r].c.fd, "HOSTS %s", hostlist);
  if (!s->role.is_ps && start_worker(s, hostlist, err, errlen) != 0) {
    broadcast(&h, "ABORT %s", "task 0 could not start its worker");
    return -1;
  }

  /* 5. Supervise ourselves and everyone. */
  int aborted = 0;
  int code = supervise(s, -1, NULL, hub_poll, &h, &aborted);
  if (code != 0 && code != PSR_EXIT_STOPPED && !h.failed && !aborted) {
    char why[128];
    snprintf(why, sizeof why, "task 0 (%s%d) exited with status %d", s->role.is_ps ? "ps" : "w",
             s->role.index, code);
    psr_log("%s; stopping every task", why);
    broadcast(&h, "ABORT %s", why);
  }
  /* Wait for the others to report (bounded), so the step's status is right. */
  deadline = ps__now() + o->grace_s + 30;
  for (;;) {
    int left = 0;
    for (int r = 1; r < N; r++) left += h.peers[r].c.fd >= 0 && !h.peers[r].exited;
    if (!left || ps__now() > deadline) break;
    hub_poll(s, &h);
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
  int worst = code;
  for (int r = 1; r < N; r++)
    if (h.peers[r].exited && h.peers[r].code > worst) worst = h.peers[r].code;
  if (h.failed && !worst) worst = h.failed;
  psr_hosts_free(hosts, nhosts);
  for (int r = 0; r < N; r++) {
    if (h.peers[r].c.fd >= 0) close(h.peers[r].c.fd);
    free(h.peers[r].c.buf);
  }
  for (int i = 0; i < s->num_ps; i++) free(psaddr[i]);
  free(psaddr);
  free(hostlist);
  free(node_of);
  free(roles);
  free(h.peers);
  return worst;
}

/* ---- every other task ------------------------------------------------------------ */

static int run_member(step *s, char *err, size_t errlen) {
  const psr_opts *o = s->o;
  psr_env *e = &s->env;
  double deadline = ps__now() + o->timeout_s;
  char rdv_addr[160];
  int rdv_port = 0;
  if (e->pmi2) {
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
    snprintf(rdv_addr, sizeof rdv_addr, "%s", val);
    rdv_port = atoi(colon + 1);
  } else {
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
    int rc = o->iface[0] || o->addr[0] ? -1 : 0;
    if (rc == 0) rc = node_address(hosts[0], rdv_addr, sizeof rdv_addr, err, errlen);
    else if (node_address(hosts[0], rdv_addr, sizeof rdv_addr, err, errlen) != 0) rc = -1;
    else rc = 0;
    psr_hosts_free(hosts, nh);
    if (rc) return -1;
    rdv_port = o->rdv_port ? o->rdv_port : e->resv_port_lo ? e->resv_port_lo : derived_port(e);
  }
  int fd = tcp_connect_to(rdv_addr, rdv_port, deadline, err, errlen);
  if (fd < 0) return -1;
  lconn ctl = {fd, NULL, 0, 0};
  send_line(fd, "HELLO PSRUN1 %lld %lld %u %d %d %s %d", e->job_id, e->step_id,
            (unsigned)getuid(), e->ntasks, e->procid, e->nodename, e->localid);
  int eof;
  char *line = wait_line(&ctl, deadline, &eof);
  char kind[16];
  if (!line || strncmp(line, "ROLE ", 5) != 0 ||
      sscanf(line + 5, "%15s %d %d %d %64s", kind, &s->role.index, &s->num_ps, &s->num_workers,
             s->secret) != 5) {
    snprintf(err, errlen, "task 0 at %s:%d %s%s", rdv_addr, rdv_port,
             line ? "refused: " : "did not assign a role in time",
             line ? (strncmp(line, "REJECT ", 7) == 0 ? line + 7 : line) : "");
    free(line);
    return -1;
  }
  free(line);
  s->role.is_ps = strcmp(kind, "ps") == 0;
  s->role.rank = e->procid;
  if (s->role.is_ps) {
    char *hp = start_psd(s, err, errlen);
    if (!hp) {
      send_line(fd, "EXIT 1");
      return -1;
    }
    send_line(fd, "PSADDR %s", hp);
    free(hp);
  } else {
    line = wait_line(&ctl, ps__now() + o->timeout_s, &eof);
    if (!line || strncmp(line, "HOSTS ", 6) != 0) {
      snprintf(err, errlen, "task 0 did not send the parameter servers' addresses%s%s",
               line ? ": " : "", line ? line : "");
      free(line);
      return -1;
    }
    int rc = start_worker(s, line + 6, err, errlen);
    free(line);
    if (rc) {
      send_line(fd, "EXIT 127");
      return -1;
    }
  }
  int aborted = 0;
  int code = supervise(s, fd, &ctl, NULL, NULL, &aborted);
  if (!aborted) send_line(fd, "EXIT %d", code);
  else if (!code) code = 1;
  /* Give task 0 a moment to read our report before the socket closes. */
  shutdown(fd, SHUT_WR);
  struct pollfd p = {fd, POLLIN, 0};
  poll(&p, 1, 2000);
  close(fd);
  free(ctl.buf);
  return code;
}

/* ---- separate ps and worker steps ---------------------------------------------- */

/* Directory where a ps step publishes its addresses for the worker steps
 * of the same job (and the same requeue): --rendezvous, else the submit
 * directory (shared by the job's nodes on any real cluster). */
static int rdv_dir(const psr_opts *o, const psr_env *e, char *out, size_t len, char *err,
                   size_t errlen) {
  const char *base = o->rendezvous[0] ? o->rendezvous : getenv("SLURM_SUBMIT_DIR");
  if (!base || !*base) {
    snprintf(err, errlen, "--role needs --rendezvous DIR (a directory every node of the job sees)");
    return -1;
  }
  const char *restart = getenv("SLURM_RESTART_COUNT");
  snprintf(out, len, "%s/.psrun-%lld.%s", base, e->job_id, restart && *restart ? restart : "0");
  if (mkdir(out, 0700) != 0 && errno != EEXIST) {
    snprintf(err, errlen, "cannot create rendezvous directory %s: %s", out, strerror(errno));
    return -1;
  }
  return 0;
}

/* Writes text to path through a temporary file and a rename; mode 0600
 * (the info file holds the secret). */
static int write_atomic(const char *path, const char *text) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
  if (!f) {
    if (fd >= 0) close(fd);
    return -1;
  }
  fprintf(f, "%s\n", text);
  if (fflush(f) || fsync(fileno(f))) {
    fclose(f);
    return -1;
  }
  fclose(f);
  return rename(tmp, path);
}

static char *slurp_line(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  char buf[512];
  char *r = fgets(buf, sizeof buf, f) ? strdup(buf) : NULL;
  fclose(f);
  if (r) r[strcspn(r, "\r\n")] = '\0';
  return r;
}

/* Files in the rendezvous directory (all written atomically):
 *   info   "<ps step id> <num_ps> <secret>"   by ps task 0, mode 0600
 *   ps<i>  "<ps step id> <host:port>"         by ps task i
 * The step id tag makes leftovers of an earlier ps step (a requeue, a
 * previous run in the same directory) harmless: they are never read as
 * current. */

/* Parses info: 0 if it names step `want` (any step when want < 0). */
static int read_info(const char *dir, long long want, long long *stp, int *nps, char *secret) {
  char path[4300];
  snprintf(path, sizeof path, "%s/info", dir);
  char *line = slurp_line(path);
  if (!line) return -1;
  char sec[80];
  int ok = sscanf(line, "%lld %d %70s", stp, nps, sec) == 3 && *nps > 0 && strlen(sec) == 64 &&
           (want < 0 || *stp == want);
  free(line);
  if (ok) memcpy(secret, sec, 65);
  return ok ? 0 : -1;
}

/* `srun -n P psrun --role=ps`: every task is a ps; addresses go to files. */
static int run_ps_step(step *s, char *err, size_t errlen) {
  char dir[4200], path[4300];
  if (rdv_dir(s->o, &s->env, dir, sizeof dir, err, errlen)) return -1;
  s->role.is_ps = 1;
  s->role.index = s->env.procid;
  s->num_ps = s->env.ntasks;
  s->num_workers = 0; /* learned from the workers */
  if (s->env.procid == 0) {
    /* Forget any earlier ps step's addresses, then publish ours. */
    for (int i = 0; i < 65536; i++) {
      snprintf(path, sizeof path, "%s/ps%d", dir, i);
      if (unlink(path) != 0 && errno == ENOENT && i > s->num_ps) break;
    }
    char sec[65], text[128];
    if (psr_new_secret(sec) != 0) {
      snprintf(err, errlen, "cannot draw a random secret");
      return -1;
    }
    snprintf(text, sizeof text, "%lld %d %s", s->env.step_id, s->num_ps, sec);
    snprintf(path, sizeof path, "%s/info", dir);
    if (write_atomic(path, text) != 0) {
      snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
      return -1;
    }
  }
  long long st;
  int nps;
  for (double end = ps__now() + s->o->timeout_s;
       read_info(dir, s->env.step_id, &st, &nps, s->secret) != 0;) {
    if (ps__now() > end) {
      snprintf(err, errlen, "ps task 0 did not publish %s/info", dir);
      return -1;
    }
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
  }
  char *hp = start_psd(s, err, errlen);
  if (!hp) return -1;
  char text[400];
  snprintf(text, sizeof text, "%lld %s", s->env.step_id, hp);
  snprintf(path, sizeof path, "%s/ps%d", dir, s->role.index);
  if (write_atomic(path, text) != 0) {
    snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
    free(hp);
    return -1;
  }
  psr_log("ps%d serving at %s (published in %s)", s->role.index, hp, dir);
  free(hp);
  int aborted = 0;
  int code = supervise(s, -1, NULL, NULL, NULL, &aborted);
  unlink(path);
  return code;
}

/* `srun -n W psrun --role=worker CMD`: every task is a worker of a ps step
 * started earlier in the job. */
static int run_worker_step(step *s, char *err, size_t errlen) {
  char dir[4200], path[4300];
  if (rdv_dir(s->o, &s->env, dir, sizeof dir, err, errlen)) return -1;
  double deadline = ps__now() + s->o->timeout_s;
  char *hosts = NULL;
  for (;;) {
    long long ps_step;
    int nps;
    if (read_info(dir, -1, &ps_step, &nps, s->secret) == 0) {
      size_t cap = (size_t)nps * 300 + 16, len = 0;
      hosts = calloc(1, cap);
      int i;
      for (i = 0; hosts && i < nps; i++) {
        snprintf(path, sizeof path, "%s/ps%d", dir, i);
        char *line = slurp_line(path);
        long long tag;
        char hp[300];
        int ok = line && sscanf(line, "%lld %299s", &tag, hp) == 2 && tag == ps_step;
        free(line);
        if (!ok) break;
        len += (size_t)snprintf(hosts + len, cap - len, "%s%s", i ? "," : "", hp);
      }
      if (hosts && i == nps) {
        s->num_ps = nps;
        break;
      }
      free(hosts);
      hosts = NULL;
    }
    if (ps__now() > deadline) {
      snprintf(err, errlen, "no ps step published its addresses in %s within %.0f s (start "
                            "`srun psrun --role=ps` first, with the same --rendezvous)",
               dir, s->o->timeout_s);
      return -1;
    }
    struct timespec ts = {0, 100000000};
    nanosleep(&ts, NULL);
  }
  s->role.is_ps = 0;
  s->role.index = s->env.procid;
  s->num_workers = s->env.ntasks;
  int rc = start_worker(s, hosts, err, errlen);
  free(hosts);
  if (rc) return -1;
  int aborted = 0;
  return supervise(s, -1, NULL, NULL, NULL, &aborted);
}

/* ---- --print-plan -------------------------------------------------------------- */

static int print_plan(step *s, char *err, size_t errlen) {
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
    for (int r = 0; r < N; r++)
      printf("{\"rank\":%d,\"role\":\"%s\",\"index\":%d,\"node\":\"%s\",\"local_rank\":%d}\n",
             r, roles[r].is_ps ? "ps" : "worker", roles[r].index, hosts[roles[r].node],
             roles[r].local_rank);
  fflush(stdout);
  free(counts);
  free(node_of);
  free(roles);
  psr_hosts_free(hosts, nh);
  return 0;
}

int psr_run_slurm(const psr_opts *o) {
  step s;
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
  find_munge(&s);
  if (own_address(o, &s.env, s.addr, sizeof s.addr, err, sizeof err) != 0) {
    psr_log("%s", err);
    return 1;
  }
  if (strcmp(o->role, "ps") == 0) rc = run_ps_step(&s, err, sizeof err);
  else if (strcmp(o->role, "worker") == 0) rc = run_worker_step(&s, err, sizeof err);
  else rc = s.env.procid == 0 ? run_task0(&s, err, sizeof err) : run_member(&s, err, sizeof err);
  if (rc < 0) {
    psr_log("%s", err);
    psr_teardown(&s.procs, o->grace_s);
    rc = 1;
  }
  if (s.env.pmi2 && !split) PMI2_Finalize();
  psr_env_free(&s.env);
  return rc;
}
