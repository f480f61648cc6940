/* config.c - psd's option table (parsed by the shared common/opt.c), the
 * rules between options, and the shared secret. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "memlimit.h"
#include "opt.h"
#include "par.h"
#include "ps/version.h"
#include "psdlog.h"
#include "wire.h"

#define F(field) PS_OPT_FIELD(psd_config, field)

static const ps__opt OPTIONS[] = {
    {"host", 0, PS_OPT_STR, F(host), "127.0.0.1", 0, 0, NULL, "address to listen on"},
    {"port", 0, PS_OPT_INT, F(port), "0", 0, 65535, NULL, "TCP port (0: any free port)"},
    {"port-file", 0, PS_OPT_STR, F(port_file), "", 0, 0, NULL,
     "write the bound host:port to this file (atomically, mode 0600; a symbolic link there "
     "is refused)"},
    {"ps-index", 0, PS_OPT_INT, F(ps_index), "0", 0, 65535, NULL, "index of this ps task"},
    {"num-ps", 0, PS_OPT_INT, F(num_ps), "1", 1, 65536, NULL, "number of ps tasks in the job"},
    {"workers", 0, PS_OPT_INT, F(workers), "0", 0, PS__MAX_WORKERS, NULL,
     "number of workers (0: as the workers say)"},
    {"replicas-to-aggregate", 0, PS_OPT_INT, F(replicas), "0", 0, 1000000, NULL,
     "gradients averaged per step (0: all workers; fewer makes backups)"},
    {"mode", 0, PS_OPT_CHOICE, F(mode), "auto", 0, 0, "auto|sync|async",
     "sync, async, or auto (as the workers say)"},
    {"grace-period", 0, PS_OPT_DOUBLE, F(grace_s), "60", 0, 1e9, NULL,
     "seconds a lost worker (its connection dropped) has to rejoin before psd exits 66"},
    {"finish-timeout", 0, PS_OPT_DOUBLE, F(finish_timeout_s), "0", 0, 1e9, NULL,
     "once the others finished, exit 68 if a worker still connected sends nothing for this "
     "many seconds (0: wait as long as it stays connected: it may be evaluating or saving)"},
    {"stall-timeout", 0, PS_OPT_DOUBLE, F(stall_s), "30", 0.01, 1e9, NULL,
     "log a step that has waited this many seconds for gradients; also name a worker still "
     "connected but silent this long after the others finished (again every 5 minutes)"},
    {"startup-timeout", 0, PS_OPT_DOUBLE, F(startup_timeout_s), "900", 0, 1e9, NULL,
     "exit non-zero if not every worker has joined by then (0: wait forever)"},
    {"pull-timeout", 0, PS_OPT_DOUBLE, F(pull_timeout_s), "600", 0.01, 1e9, NULL,
     "default deadline of a parked pull, seconds"},
    {"log-every", 0, PS_OPT_INT, F(log_every), "100", 1, INT_MAX, NULL,
     "log every Nth applied step"},
    {"log-level", 0, PS_OPT_CHOICE, F(log_level), "info", 0, 0, "error|warn|info|debug",
     "error, warn, info or debug"},
    {"name", 0, PS_OPT_STR, F(name), "", 0, 0, NULL,
     "identity in log lines (default ps<index>)"},
    {"socket-buffer", 0, PS_OPT_INT, F(sock_buf), "4194304", 0, 1 << 30, NULL,
     "SO_SNDBUF bytes per connection (0: the kernel's autotuning)"},
    {"recv-buffer", 0, PS_OPT_INT, F(recv_buf), "131072", 0, 1 << 30, NULL,
     "SO_RCVBUF bytes of a worker's connection while pushes are paced: what a worker can "
     "send that --pace-ahead cannot hold back (0, or no pacing: the kernel autotunes)"},
    {"pace-loopback", 0, PS_OPT_FLAG, F(pace_loopback), "0", 0, 0, NULL,
     "pace workers connected over loopback too (they share no network link with the others; "
     "for tests)"},
    {"pace-ahead", 0, PS_OPT_INT, F(pace_ahead), "65536", 0, 1 << 30, NULL,
     "in sync mode, stop reading a worker's push while it is this many bytes ahead of the "
     "slowest worker pushing the same step, so TCP gives the link to the laggard (0: off)"},
    {"max-memory", 0, PS_OPT_DOUBLE, F(max_memory), "0", 0, 1e18, NULL,
     "bytes the slices may take (parameters, gradients, optimizer state, and per-slice tables of "
     "the shard and of every connection); 0: 90% of the smaller of RAM and the cgroup's memory "
     "limit (Slurm --mem)"},
    {"secret-file", 0, PS_OPT_STR, F(secret_file), "", 0, 0, NULL,
     "file (mode 0600) with the secret workers must present (else $PSD_SECRET)"},
    {"munge", 0, PS_OPT_FLAG, F(munge), "0", 0, 0, NULL,
     "require a MUNGE credential of the same uid naming --job-id (and --step-id)"},
    {"munge-socket", 0, PS_OPT_STR, F(munge_socket), "", 0, 0, NULL,
     "munged socket (default: MUNGE's; Slurm's AuthInfo socket= under psrun)"},
    {"job-id", 0, PS_OPT_INT64, F(job_id), "-1", -1, 9.2e18, NULL,
     "Slurm job id credentials must name"},
    {"step-id", 0, PS_OPT_INT64, F(step_id), "-1", -1, 9.2e18, NULL,
     "Slurm step id credentials must name (-1: any step of the job)"},
    {"checkpoint-dir", 0, PS_OPT_STR, F(ckpt_dir), "", 0, 0, NULL,
     "write checkpoints here and restore the newest complete one at start (a directory "
     "of yours that no one else can write; locked by the job)"},
    {"checkpoint-every", 0, PS_OPT_INT, F(ckpt_every), "0", 0, INT_MAX, NULL,
     "checkpoint every N steps (0: not by steps)"},
    {"checkpoint-secs", 0, PS_OPT_DOUBLE, F(ckpt_secs), "0", 0, 1e9, NULL,
     "checkpoint every S seconds, at a step all ps agree on (0: not by time)"},
    {"checkpoint-keep", 0, PS_OPT_INT, F(ckpt_keep), "3", 1, 1000000, NULL,
     "complete checkpoints to keep"},
    {"restore", 0, PS_OPT_CHOICE, F(restore), "latest", 0, 0, "latest|fallback|none",
     "latest (newest complete checkpoint; an error if it is damaged), fallback "
     "(newest usable one) or none (move earlier checkpoints into previous-<run id>/ and "
     "start a new run)"},
    {"stop-timeout", 0, PS_OPT_DOUBLE, F(stop_timeout_s), "60", 0.1, 1e9, NULL,
     "after SIGTERM/SIGUSR1, seconds to wait for the stop checkpoint"},
    {"telemetry", 0, PS_OPT_STR, F(telemetry), "", 0, 0, NULL,
     "write per-step telemetry (gradient arrivals, aggregation time) to this file as JSON "
     "lines ('off': record nothing; mode 0600, a symbolic link there is refused)"},
    {"summary", 0, PS_OPT_STR, F(summary), "", 0, 0, NULL,
     "at exit, write the run's telemetry summary table to this file ('-': stderr, so it "
     "never mixes with the workers' output on stdout; mode 0600, a symbolic link there is "
     "refused at start)"},
    {"max-connections", 0, PS_OPT_INT, F(max_conns), "65536", 1, 1 << 24, NULL,
     "open connections at most (never more than the descriptor limit minus 32); when full, "
     "a new connection evicts the oldest unauthenticated one"},
    {"max-unauthenticated", 0, PS_OPT_INT, F(max_unauth), "1024", 1, 1 << 24, NULL,
     "connections before their handshake at most; a new one evicts the oldest (each costs "
     "about 5 KiB until its Hello is accepted)"},
    {"max-admin", 0, PS_OPT_INT, F(max_admin), "16", 0, 1 << 24, NULL,
     "authenticated admin connections (psctl) at once; more are refused"},
    {"protocol-minor", 0, PS_OPT_INT, F(protocol_minor), "-1", -1, PS__PROTOCOL_MINOR, NULL,
     "protocol 2.x minor to announce to clients (-1: this psd's own, the most); an older "
     "one makes psd behave as that release for 16-bit wire dtypes (2.3): for testing clients' "
     "fallback"},
    {"transport", 0, PS_OPT_CHOICE, F(transport), "auto", 0, 0, "auto|tcp|shm",
     "how workers on this node may send tensors: auto and shm offer a shared-memory "
     "segment (a worker of psd's uid hands over a sealed memfd; frames stay on TCP), shm "
     "fails at start if it cannot be offered, tcp offers none"},
    {"table-threads", 0, PS_OPT_INT, F(table_threads), "0", 0, PSD_PAR_MAX_THREADS, NULL,
     "threads that share a table pull or push of 32768 keys or more (psd's own included; "
     "0: as many CPUs as psd may run on, at most 8; 1: the event loop alone)"},
    {"keepalive", 0, PS_OPT_INT, F(keepalive_s), "20", 0, 86400, NULL,
     "seconds after which a peer whose host died is dropped (TCP keepalive and "
     "TCP_USER_TIMEOUT; 0: off, else at least 2)"},
};

/* --table-threads 0: the CPUs psd may run on (a Slurm step's cpuset,
 * taskset), at most PSD_PAR_MAX_THREADS. */
static int auto_threads(void) {
  cpu_set_t set;
  int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  if (n < 1) n = 1;
  return n > (int)PSD_PAR_MAX_THREADS ? (int)PSD_PAR_MAX_THREADS : n;
}

/* Share of the memory limit --max-memory defaults to: the rest is for
 * psd's own code, buffers and connections, and the kernel's page cache. */
#define PSD_MEM_SHARE 0.9

static char g_version[32];

/* --max-memory 0: PSD_MEM_SHARE of the smaller of RAM and the cgroup's
 * limit, so a registration past it fails cleanly instead of the OOM killer
 * taking the whole job (and one peer cannot exhaust the node).
 * $PSD_CGROUP_ROOT (tests) is where /proc/self/cgroup and /sys/fs/cgroup
 * are read from. */
static void default_max_memory(psd_config *cfg) {
  char where[600];
  uint64_t phys = psd_memlimit_phys();
  uint64_t cg = psd_memlimit_cgroup(getenv("PSD_CGROUP_ROOT"), where, sizeof where);
  uint64_t lim = cg < phys ? cg : phys;
  cfg->max_memory = lim == UINT64_MAX ? 1e18 : PSD_MEM_SHARE * (double)lim;
  if (cg < phys)
    snprintf(cfg->max_memory_from, sizeof cfg->max_memory_from, "90%% of the cgroup limit %s",
             where);
  else
    snprintf(cfg->max_memory_from, sizeof cfg->max_memory_from, "90%% of physical RAM");
}

static const ps__opt_parser PARSER = {
    OPTIONS, sizeof OPTIONS / sizeof OPTIONS[0],
    "usage: psd [OPTIONS]\n"
    "psd holds a shard of a model's variables, averages the workers'\n"
    "gradients for each step and serves the parameters.\n\n",
    g_version, PS_OPT_POS_ERROR, 0, 30};

void psd_config_usage(FILE *f) { ps__opt_usage(&PARSER, f); }

int psd_config_parse(psd_config *cfg, int argc, char **argv, char *err,
                     size_t errlen) {
  memset(cfg, 0, sizeof *cfg);
  snprintf(g_version, sizeof g_version, "psd %d.%d.%d", PS_VERSION_MAJOR, PS_VERSION_MINOR,
           PS_VERSION_PATCH);
  int rc = ps__opt_parse(&PARSER, cfg, argc, argv, NULL, err, errlen);
  if (rc != 0) return rc;
  if (cfg->ps_index >= cfg->num_ps) {
    snprintf(err, errlen, "--ps-index %d must be less than --num-ps %d", cfg->ps_index,
             cfg->num_ps);
    return -1;
  }
  if (cfg->workers > 0 && cfg->replicas > cfg->workers) {
    snprintf(err, errlen, "--replicas-to-aggregate %d exceeds --workers %d",
             cfg->replicas, cfg->workers);
    return -1;
  }
  if (cfg->munge && cfg->job_id < 0) {
    snprintf(err, errlen, "--munge needs --job-id (the Slurm job the credentials must name)");
    return -1;
  }
  if ((cfg->ckpt_every || cfg->ckpt_secs > 0) && !cfg->ckpt_dir[0]) {
    snprintf(err, errlen, "--checkpoint-every and --checkpoint-secs need --checkpoint-dir");
    return -1;
  }
  if (cfg->keepalive_s == 1) {
    snprintf(err, errlen, "--keepalive 1 is too short (0 turns it off; else at least 2 s)");
    return -1;
  }
  /* --checkpoint-dir itself is opened, checked (ours, nobody else can
   * write it) and locked at start by psd/persist/ckptdir.c: exit 65, not 64. */
  if (cfg->max_memory == 0) default_max_memory(cfg);
  else snprintf(cfg->max_memory_from, sizeof cfg->max_memory_from, "--max-memory");
  if (!cfg->name[0]) snprintf(cfg->name, sizeof cfg->name, "ps%d", cfg->ps_index);
  if (cfg->protocol_minor < 0) cfg->protocol_minor = (int)PS__PROTOCOL_MINOR;
  if (cfg->table_threads == 0) cfg->table_threads = auto_threads();
  return 0;
}

int psd_config_load_secret(psd_config *cfg, char *err, size_t errlen) {
  const char *env = getenv("PSD_SECRET");
  if (cfg->secret_file[0]) {
    struct stat st;
    FILE *f = fopen(cfg->secret_file, "r");
    if (!f || fstat(fileno(f), &st) != 0) {
      snprintf(err, errlen, "cannot read --secret-file %s", cfg->secret_file);
      if (f) fclose(f);
      return -1;
    }
    if (!S_ISREG(st.st_mode) || (st.st_mode & 077) || st.st_uid != getuid()) {
      snprintf(err, errlen,
               "--secret-file %s must be a regular file owned by you with mode 0600 (it has "
               "mode %03o)",
               cfg->secret_file, (unsigned)(st.st_mode & 0777));
      fclose(f);
      return -1;
    }
    size_t n = fread(cfg->secret, 1, sizeof cfg->secret - 1, f);
    fclose(f);
    while (n && (cfg->secret[n - 1] == '\n' || cfg->secret[n - 1] == '\r')) n--;
    cfg->secret[n] = '\0';
    cfg->secret_len = n;
  } else if (env && *env) {
    snprintf(cfg->secret, sizeof cfg->secret, "%s", env);
    cfg->secret_len = strlen(cfg->secret);
  }
  unsetenv("PSD_SECRET"); /* not inherited, not in /proc/PID/environ of children */
  if ((cfg->secret_file[0] || (env && *env)) && cfg->secret_len < 16) {
    snprintf(err, errlen, "the shared secret must be at least 16 bytes (it has %zu)",
             cfg->secret_len);
    return -1;
  }
  return 0;
}
