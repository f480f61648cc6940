/* launch.c - psd's command line and the workers' environment. */
#define _GNU_SOURCE
#include "launch.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

/* Seconds psd has to bind its port and write the port file. */
#define PSR_PSD_START_S 30.0

char *psr_start_psd(psr_procs *p, const psr_task *t, char *err, size_t errlen) {
  const psr_opts *o = t->o;
  char dir[] = "/tmp/psrun.XXXXXX";
  if (!mkdtemp(dir)) {
    snprintf(err, errlen, "cannot create a temporary directory: %s", strerror(errno));
    return NULL;
  }
  char portf[64], idx[16], nps[16], nw[16], label[32], jid[32], sid[32], ce[16], cs[32];
  snprintf(portf, sizeof portf, "%s/port", dir);
  snprintf(idx, sizeof idx, "%d", t->index);
  snprintf(nps, sizeof nps, "%d", t->num_ps);
  snprintf(nw, sizeof nw, "%d", t->num_workers);
  snprintf(label, sizeof label, "ps%d", t->index);
  snprintf(jid, sizeof jid, "%lld", t->job_id);
  snprintf(sid, sizeof sid, "%lld", t->step_id);
  char tele[4100], rep[16];
  snprintf(tele, sizeof tele, "%s.ps%d", o->telemetry, t->index);
  int backups, replicas = psr_replicas(o, t->num_workers, &backups);
  snprintf(rep, sizeof rep, "%d", replicas);
  char *argv[96];
  int a = 0;
  char *fixed[] = {(char *)o->psd, "--host", (char *)t->host, "--port", "0", "--port-file",
                   portf, "--ps-index", idx, "--num-ps", nps, "--name", label};
  for (size_t k = 0; k < sizeof fixed / sizeof fixed[0]; k++) argv[a++] = fixed[k];
  if (t->num_workers > 0) {
    argv[a++] = "--workers";
    argv[a++] = nw;
  }
  if (replicas > 0) { /* psd then refuses a worker that disagrees */
    argv[a++] = "--replicas-to-aggregate";
    argv[a++] = rep;
  }
  if (t->munge) {
    argv[a++] = "--munge";
    argv[a++] = "--job-id";
    argv[a++] = jid;
    argv[a++] = "--step-id";
    argv[a++] = sid;
    if (t->munge_socket && t->munge_socket[0]) {
      argv[a++] = "--munge-socket";
      argv[a++] = (char *)t->munge_socket;
    }
  }
  if (o->ckpt_dir[0]) {
    argv[a++] = "--checkpoint-dir";
    argv[a++] = (char *)o->ckpt_dir;
    snprintf(ce, sizeof ce, "%d", o->ckpt_every);
    snprintf(cs, sizeof cs, "%g", o->ckpt_secs);
    argv[a++] = "--checkpoint-every";
    argv[a++] = ce;
    argv[a++] = "--checkpoint-secs";
    argv[a++] = cs;
  }
  if (o->telemetry[0]) {
    argv[a++] = "--telemetry";
    argv[a++] = tele;
  }
  argv[a++] = "--transport";
  argv[a++] = (char *)(o->transport[0] ? o->transport : "auto");
  if (t->index == 0 && t->summary) { /* one table per job: ps0 has every worker */
    argv[a++] = "--summary";
    argv[a++] = (char *)t->summary;
  }
  for (int k = 0; k < o->psd_args.n && a < 90; k++) argv[a++] = o->psd_args.v[k];
  argv[a] = NULL;
  /* The secret travels in the environment (psd removes it from its own),
   * never on a command line other users can read. */
  char e_secret[300];
  snprintf(e_secret, sizeof e_secret, "PSD_SECRET=%s", t->secret ? t->secret : "");
  char *env[] = {e_secret, NULL};
  int child = psr_spawn(p, label, 1, argv, t->secret && t->secret[0] ? env : NULL, err, errlen);
  char *result = NULL;
  double deadline = ps__now() + PSR_PSD_START_S;
  while (child >= 0 && !result) {
    FILE *f = fopen(portf, "r");
    if (f) {
      char line[128] = "";
      char *ok = fgets(line, sizeof line, f);
      fclose(f);
      if (ok && strchr(line, ':')) {
        line[strcspn(line, "\r\n")] = '\0';
        result = strdup(line);
        break;
      }
    }
    int which;
    if (psr_wait(p, 20, -1, &which) == PSR_EV_EXIT && which == child) {
      char d[64];
      psr_describe(p->kids[which].status, d, sizeof d);
      snprintf(err, errlen, "%s %s before it was ready", label, d);
      break;
    }
    if (ps__now() > deadline) {
      snprintf(err, errlen, "%s did not report its port within %.0f s", label, PSR_PSD_START_S);
      break;
    }
  }
  unlink(portf);
  rmdir(dir);
  return result;
}

/* Binds port 0 of the wildcard address of family (AF_INET6 dual-stack, or
 * AF_INET) and reads the port the kernel chose. 0 or -1 (errno set). */
static int probe_port(int family, int *port) {
  int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_storage ss = {0};
  socklen_t sl;
  if (family == AF_INET6) {
    int off = 0; /* dual-stack: the port must be free for IPv4 too */
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
    ((struct sockaddr_in6 *)&ss)->sin6_family = AF_INET6;
    ((struct sockaddr_in6 *)&ss)->sin6_addr = in6addr_any;
    sl = sizeof(struct sockaddr_in6);
  } else {
    ((struct sockaddr_in *)&ss)->sin_family = AF_INET;
    ((struct sockaddr_in *)&ss)->sin_addr.s_addr = htonl(INADDR_ANY);
    sl = sizeof(struct sockaddr_in);
  }
  int rc = bind(fd, (struct sockaddr *)&ss, sl) == 0 &&
                   getsockname(fd, (struct sockaddr *)&ss, &sl) == 0
               ? 0
               : -1;
  int e = errno;
  if (rc == 0)
    *port = ntohs(family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                     : ((struct sockaddr_in *)&ss)->sin_port);
  close(fd);
  errno = e;
  return rc;
}

/* As torchrun's standalone mode picks its port: bind port 0, read it,
 * close. The wildcard, not MASTER_ADDR alone: worker 0's TCPStore listens
 * on every interface (IPv6 first, then IPv4, as torch does), so the port
 * must be free on all of them. The socket never listened, so closing it
 * leaves no TIME_WAIT behind. A small race remains: another process (a psd
 * starting on the node binds port 0 too) may take the port before worker
 * 0's TCPStore binds it; torchrun accepts the same race. */
int psr_free_port(int *port, char *err, size_t errlen) {
  if (probe_port(AF_INET6, port) == 0 || probe_port(AF_INET, port) == 0) return 0;
  snprintf(err, errlen, "cannot find a free TCP port for MASTER_PORT: %s", strerror(errno));
  return -1;
}

/* The torchrun contract, for torch.distributed's env:// init and the
 * scripts that pick a GPU by LOCAL_RANK: the ranks are the workers (ps
 * tasks are not ranks). They override the user's own values, which would
 * describe another job. vars holds the strings; returns how many. */
typedef struct torch_vars {
  char v[6][96];
} torch_vars;

static int torch_env(const psr_task *t, torch_vars *tv, char **env) {
  snprintf(tv->v[0], sizeof tv->v[0], "RANK=%d", t->index);
  snprintf(tv->v[1], sizeof tv->v[1], "WORLD_SIZE=%d", t->num_workers);
  snprintf(tv->v[2], sizeof tv->v[2], "LOCAL_RANK=%d", t->local_rank);
  snprintf(tv->v[3], sizeof tv->v[3], "LOCAL_WORLD_SIZE=%d", t->node_workers);
  snprintf(tv->v[4], sizeof tv->v[4], "MASTER_ADDR=%s", t->master_addr ? t->master_addr : "");
  snprintf(tv->v[5], sizeof tv->v[5], "MASTER_PORT=%d", t->master_port);
  for (int i = 0; i < 6; i++) env[i] = tv->v[i];
  return 6;
}

/* PYTHONPATH=HOOK[:PACKAGE][:old]: Python workers find the torch.distributed
 * backend "psd" registered with no import of psd (python/hook). A psrun of
 * the build tree adds its checkout's hook and package; an installed one the
 * installed hook, beside it (the package is on the prefix's Python path).
 * Nothing is added when the hook is not there. The caller frees it. */
static char *python_path(void) {
  char self[PATH_MAX], installed[PATH_MAX + 64], hook_dir[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  self[n > 0 ? n : 0] = '\0';
  int build = strncmp(self, PSR_BUILD_DIR "/", strlen(PSR_BUILD_DIR "/")) == 0;
  char *slash = strrchr(self, '/');
  if (slash) *slash = '\0';
  snprintf(installed, sizeof installed, "%s/%s", self, PSR_HOOK_FROM_BIN);
  const char *pkg = build ? ":" PSR_SOURCE_PYTHON : "";
  char probe[PATH_MAX + 32];
  if (!realpath(build ? PSR_SOURCE_PYTHON "/hook" : installed, hook_dir)) return NULL;
  const char *hook = hook_dir;
  snprintf(probe, sizeof probe, "%s/sitecustomize.py", hook);
  if (access(probe, R_OK) != 0) return NULL;
  const char *old = getenv("PYTHONPATH");
  size_t len = strlen(hook) + strlen(pkg) + (old ? strlen(old) : 0) + 16;
  char *s = malloc(len);
  if (s) snprintf(s, len, "PYTHONPATH=%s%s%s%s", hook, pkg, old && *old ? ":" : "",
                  old ? old : "");
  return s;
}

int psr_start_worker(psr_procs *p, const psr_task *t, const char *hosts, char *err,
                     size_t errlen) {
  size_t hl = strlen(hosts) + 16;
  char *e_hosts = malloc(hl);
  if (!e_hosts) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  snprintf(e_hosts, hl, "PS_HOSTS=%s", hosts);
  char e_idx[64], e_nw[64], e_nps[64], e_local[64], e_lw[64], e_secret[300], e_job[64],
      e_step[64], e_sock[1100], e_rep[64], e_restarts[64], label[32];
  snprintf(e_idx, sizeof e_idx, "PS_WORKER_INDEX=%d", t->index);
  snprintf(e_nw, sizeof e_nw, "PS_NUM_WORKERS=%d", t->num_workers);
  snprintf(e_nps, sizeof e_nps, "PS_NUM_PS=%d", t->num_ps);
  snprintf(e_local, sizeof e_local, "PS_LOCAL_RANK=%d", t->local_rank);
  snprintf(e_lw, sizeof e_lw, "PS_LOCAL_WORKERS=%d", t->local_workers);
  snprintf(e_secret, sizeof e_secret, "PS_SECRET=%s", t->secret ? t->secret : "");
  snprintf(e_job, sizeof e_job, "PS_JOB_ID=%lld", t->job_id);
  snprintf(e_step, sizeof e_step, "PS_STEP_ID=%lld", t->step_id);
  snprintf(e_sock, sizeof e_sock, "PS_MUNGE_SOCKET=%s", t->munge_socket ? t->munge_socket : "");
  snprintf(label, sizeof label, "w%d", t->index);
  char e_tele[4200], e_wire[32], e_tr[32], e_ckpt[4200];
  snprintf(e_tele, sizeof e_tele, "PS_TELEMETRY=%s.w%d", t->o->telemetry, t->index);
  snprintf(e_wire, sizeof e_wire, "PS_WIRE_DTYPE=%s", t->o->wire_dtype);
  snprintf(e_tr, sizeof e_tr, "PS_TRANSPORT=%s", t->o->transport[0] ? t->o->transport : "auto");
  char *env[32] = {e_hosts, e_idx, e_nw, e_nps, e_local, "PS_ROLE=worker", e_tr};
  int ne = 7;
  torch_vars tv;
  ne += torch_env(t, &tv, env + ne);
  int backups, replicas = psr_replicas(t->o, t->num_workers, &backups);
  snprintf(e_rep, sizeof e_rep, "PS_REPLICAS_TO_AGGREGATE=%d", replicas);
  if (replicas > 0) env[ne++] = e_rep;
  /* Workers sharing this machine's cores size their thread pools by it. */
  if (t->local_workers > 0) env[ne++] = e_lw;
  /* A restarted worker knows it is one (the torch.distributed backend
   * refuses to start such a rank: docs/python.md). */
  snprintf(e_restarts, sizeof e_restarts, "PS_WORKER_RESTARTS=%d", t->restarts);
  if (t->restarts > 0) env[ne++] = e_restarts;
  if (t->secret && t->secret[0]) env[ne++] = e_secret;
  if (t->o->telemetry[0]) env[ne++] = e_tele;
  if (t->o->wire_dtype[0]) env[ne++] = e_wire;
  /* Where a worker keeps state of its own beside psd's (psd.torch.Checkpoint). */
  snprintf(e_ckpt, sizeof e_ckpt, "PS_CHECKPOINT_DIR=%s", t->o->ckpt_dir);
  if (t->o->ckpt_dir[0]) env[ne++] = e_ckpt;
  char *e_py = python_path();
  if (e_py) env[ne++] = e_py;
  if (t->munge) {
    env[ne++] = "PS_MUNGE=1";
    env[ne++] = e_job;
    env[ne++] = e_step;
    if (t->munge_socket && t->munge_socket[0]) env[ne++] = e_sock;
  }
  env[ne] = NULL;
  int child = psr_spawn(p, label, 0, t->o->cmd, env, err, errlen);
  free(e_hosts);
  free(e_py);
  return child;
}
