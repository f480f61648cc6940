/* config.c - the option table, and the one parser that applies both the
 * defaults and the command line through it. */
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "wire.h"

typedef enum { OPT_INT, OPT_DOUBLE, OPT_STRING, OPT_MODE, OPT_LEVEL, OPT_FLAG, OPT_RESTORE } opt_type;

typedef struct psd_option {
  const char *name;   /* long option, without "--" */
  opt_type type;      /* how the value is parsed */
  size_t offset;      /* field in psd_config */
  size_t size;        /* field size (strings) */
  const char *def;    /* default, parsed like a command-line value */
  double min, max;    /* inclusive range for numbers */
  const char *help;   /* one line for --help */
} psd_option;

#define F(field) offsetof(psd_config, field), sizeof(((psd_config *)0)->field)

static const psd_option OPTIONS[] = {
    {"host", OPT_STRING, F(host), "127.0.0.1", 0, 0, "address to listen on"},
    {"port", OPT_INT, F(port), "0", 0, 65535, "TCP port (0: any free port)"},
    {"port-file", OPT_STRING, F(port_file), "", 0, 0,
     "write the bound host:port to this file (atomically)"},
    {"ps-index", OPT_INT, F(ps_index), "0", 0, 65535, "index of this ps task"},
    {"num-ps", OPT_INT, F(num_ps), "1", 1, 65536, "number of ps tasks in the job"},
    {"workers", OPT_INT, F(workers), "0", 0, PS__MAX_WORKERS,
     "number of workers (0: as the workers say)"},
    {"replicas-to-aggregate", OPT_INT, F(replicas), "0", 0, 1000000,
     "gradients averaged per step (0: all workers; fewer makes backups)"},
    {"mode", OPT_MODE, F(mode), "auto", 0, 0,
     "sync, async, or auto (as the workers say)"},
    {"grace-period", OPT_DOUBLE, F(grace_s), "60", 0, 1e9,
     "seconds a lost worker has to rejoin before psd exits non-zero"},
    {"stall-timeout", OPT_DOUBLE, F(stall_s), "30", 0.01, 1e9,
     "log a step that has waited this many seconds for gradients"},
    {"startup-timeout", OPT_DOUBLE, F(startup_timeout_s), "900", 0, 1e9,
     "exit non-zero if not every worker has joined by then (0: wait forever)"},
    {"pull-timeout", OPT_DOUBLE, F(pull_timeout_s), "600", 0.01, 1e9,
     "default deadline of a parked pull, seconds"},
    {"log-every", OPT_INT, F(log_every), "100", 1, INT_MAX,
     "log every Nth applied step"},
    {"log-level", OPT_LEVEL, F(log_level), "info", 0, 0,
     "error, warn, info or debug"},
    {"name", OPT_STRING, F(name), "", 0, 0,
     "identity in log lines (default ps<index>)"},
    {"socket-buffer", OPT_INT, F(sock_buf), "4194304", 0, 1 << 30,
     "SO_SNDBUF bytes per connection (0: the kernel's autotuning)"},
    {"recv-buffer", OPT_INT, F(recv_buf), "131072", 0, 1 << 30,
     "SO_RCVBUF bytes of a worker's connection while pushes are paced: what a worker can "
     "send that --pace-ahead cannot hold back (0, or no pacing: the kernel autotunes)"},
    {"pace-loopback", OPT_FLAG, F(pace_loopback), "0", 0, 0,
     "pace workers connected over loopback too (they share no network link with the others; "
     "for tests)"},
    {"pace-ahead", OPT_INT, F(pace_ahead), "65536", 0, 1 << 30,
     "in sync mode, stop reading a worker's push while it is this many bytes ahead of the "
     "slowest worker pushing the same step, so TCP gives the link to the laggard (0: off)"},
    {"max-memory", OPT_DOUBLE, F(max_memory), "0", 0, 1e18,
     "bytes the variables may take (parameters, gradients, optimizer state); 0: 90% of RAM"},
    {"secret-file", OPT_STRING, F(secret_file), "", 0, 0,
     "file (mode 0600) with the secret workers must present (else $PSD_SECRET)"},
    {"munge", OPT_FLAG, F(munge), "0", 0, 0,
     "require a MUNGE credential of the same uid naming --job-id (and --step-id)"},
    {"munge-socket", OPT_STRING, F(munge_socket), "", 0, 0,
     "munged socket (default: MUNGE's; Slurm's AuthInfo socket= under psrun)"},
    {"job-id", OPT_DOUBLE, F(job_id), "-1", -1, 9.2e18, "Slurm job id credentials must name"},
    {"step-id", OPT_DOUBLE, F(step_id), "-1", -1, 9.2e18,
     "Slurm step id credentials must name (-1: any step of the job)"},
    {"checkpoint-dir", OPT_STRING, F(ckpt_dir), "", 0, 0,
     "write checkpoints here and restore the newest complete one at start"},
    {"checkpoint-every", OPT_INT, F(ckpt_every), "0", 0, INT_MAX,
     "checkpoint every N steps (0: not by steps)"},
    {"checkpoint-secs", OPT_DOUBLE, F(ckpt_secs), "0", 0, 1e9,
     "checkpoint every S seconds, at a step all ps agree on (0: not by time)"},
    {"checkpoint-keep", OPT_INT, F(ckpt_keep), "3", 1, 1000000,
     "complete checkpoints to keep"},
    {"restore", OPT_RESTORE, F(restore), "latest", 0, 0,
     "latest (newest complete checkpoint; an error if it is damaged), fallback "
     "(newest usable one) or none"},
    {"stop-timeout", OPT_DOUBLE, F(stop_timeout_s), "60", 0.1, 1e9,
     "after SIGTERM/SIGUSR1, seconds to wait for the stop checkpoint"},
    {"telemetry", OPT_STRING, F(telemetry), "", 0, 0,
     "write per-step telemetry (gradient arrivals, aggregation time) to this file as JSON "
     "lines ('off': record nothing)"},
    {"summary", OPT_STRING, F(summary), "", 0, 0,
     "at exit, write the run's telemetry summary table to this file ('-': stdout)"},
};
#define NOPTIONS (sizeof OPTIONS / sizeof OPTIONS[0])

static int set_option(psd_config *cfg, const psd_option *o, const char *val,
                      char *err, size_t errlen) {
  char *field = (char *)cfg + o->offset;
  char *end;
  switch (o->type) {
  case OPT_INT: {
    errno = 0;
    long v = strtol(val, &end, 10);
    if (errno || end == val || *end || v < o->min || v > o->max) {
      snprintf(err, errlen, "--%s must be an integer from %.0f to %.0f, got '%s'",
               o->name, o->min, o->max, val);
      return -1;
    }
    *(int *)field = (int)v;
    return 0;
  }
  case OPT_DOUBLE: {
    errno = 0;
    double v = strtod(val, &end);
    if (errno || end == val || *end || !isfinite(v) || v < o->min || v > o->max) {
      snprintf(err, errlen, "--%s must be a number from %g to %g, got '%s'",
               o->name, o->min, o->max, val);
      return -1;
    }
    *(double *)field = v;
    return 0;
  }
  case OPT_STRING:
    if (strlen(val) >= o->size) {
      snprintf(err, errlen, "--%s is too long (%zu bytes; at most %zu)", o->name,
               strlen(val), o->size - 1);
      return -1;
    }
    memcpy(field, val, strlen(val) + 1);
    return 0;
  case OPT_MODE:
    if (strcmp(val, "auto") == 0) *(int *)field = PSD_MODE_AUTO;
    else if (strcmp(val, "sync") == 0) *(int *)field = PSD_MODE_SYNC;
    else if (strcmp(val, "async") == 0) *(int *)field = PSD_MODE_ASYNC;
    else {
      snprintf(err, errlen, "--%s must be sync, async or auto, got '%s'", o->name, val);
      return -1;
    }
    return 0;
  case OPT_FLAG:
    *(int *)field = strcmp(val, "0") != 0;
    return 0;
  case OPT_RESTORE:
    if (strcmp(val, "latest") == 0) *(int *)field = PSD_RESTORE_LATEST;
    else if (strcmp(val, "fallback") == 0) *(int *)field = PSD_RESTORE_FALLBACK;
    else if (strcmp(val, "none") == 0) *(int *)field = PSD_RESTORE_NONE;
    else {
      snprintf(err, errlen, "--%s must be latest, fallback or none, got '%s'", o->name, val);
      return -1;
    }
    return 0;
  case OPT_LEVEL: {
    int l = psd_log_level_parse(val);
    if (l < 0) {
      snprintf(err, errlen, "--%s must be error, warn, info or debug, got '%s'",
               o->name, val);
      return -1;
    }
    *(int *)field = l;
    return 0;
  }
  }
  return -1;
}

void psd_config_usage(FILE *f) {
  fprintf(f,
          "usage: psd [OPTIONS]\n"
          "psd holds a shard of a model's variables, averages the workers'\n"
          "gradients for each step and serves the parameters.\n\n");
  for (size_t i = 0; i < NOPTIONS; i++) {
    const psd_option *o = &OPTIONS[i];
    char left[64];
    snprintf(left, sizeof left, o->type == OPT_FLAG ? "--%s" : "--%s VALUE", o->name);
    fprintf(f, "  %-30s %s", left, o->help);
    if (o->def[0]) fprintf(f, " [%s]", o->def);
    fputc('\n', f);
  }
  fprintf(f, "  %-30s %s\n  %-30s %s\n", "--help", "print this and exit",
          "--version", "print the version and exit");
}

int psd_config_parse(psd_config *cfg, int argc, char **argv, char *err,
                     size_t errlen) {
  memset(cfg, 0, sizeof *cfg);
  for (size_t i = 0; i < NOPTIONS; i++)
    if (set_option(cfg, &OPTIONS[i], OPTIONS[i].def, err, errlen) != 0) return -1;
  for (int a = 1; a < argc; a++) {
    const char *arg = argv[a];
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      psd_config_usage(stdout);
      return 1;
    }
    if (strcmp(arg, "--version") == 0) {
      printf("psd %d.%d.%d\n", PS_VERSION_MAJOR, PS_VERSION_MINOR, PS_VERSION_PATCH);
      return 1;
    }
    if (strncmp(arg, "--", 2) != 0) {
      snprintf(err, errlen, "unexpected argument '%s' (options start with --; see --help)", arg);
      return -1;
    }
    const char *name = arg + 2;
    const char *eq = strchr(name, '=');
    size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
    const psd_option *o = NULL;
    for (size_t i = 0; i < NOPTIONS; i++)
      if (strlen(OPTIONS[i].name) == nlen && strncmp(OPTIONS[i].name, name, nlen) == 0)
        o = &OPTIONS[i];
    if (!o) {
      snprintf(err, errlen, "unknown option '--%.*s' (see --help)", (int)nlen, name);
      return -1;
    }
    const char *val;
    if (o->type == OPT_FLAG) {
      if (eq) {
        snprintf(err, errlen, "option --%s takes no value", o->name);
        return -1;
      }
      val = "1";
    } else if (eq) val = eq + 1;
    else if (a + 1 < argc) val = argv[++a];
    else {
      snprintf(err, errlen, "option --%s needs a value", o->name);
      return -1;
    }
    if (set_option(cfg, o, val, err, errlen) != 0) return -1;
  }
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
  if (cfg->ckpt_dir[0]) {
    struct stat st;
    if (stat(cfg->ckpt_dir, &st) != 0 && mkdir(cfg->ckpt_dir, 0700) != 0 && errno != EEXIST) {
      snprintf(err, errlen, "--checkpoint-dir %s cannot be created: %s", cfg->ckpt_dir,
               strerror(errno));
      return -1;
    }
    if (stat(cfg->ckpt_dir, &st) != 0 || !S_ISDIR(st.st_mode) ||
        access(cfg->ckpt_dir, W_OK | X_OK) != 0) {
      snprintf(err, errlen, "--checkpoint-dir %s is not a directory this user can write",
               cfg->ckpt_dir);
      return -1;
    }
  }
  if (cfg->max_memory == 0) {
    /* A registration past this fails cleanly instead of the OOM killer
     * taking the whole job (and one peer cannot exhaust the node). */
    long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    cfg->max_memory = pages > 0 && psize > 0 ? 0.9 * (double)pages * (double)psize : 1e18;
  }
  if (!cfg->name[0]) snprintf(cfg->name, sizeof cfg->name, "ps%d", cfg->ps_index);
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
