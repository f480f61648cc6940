/*
 * rdvdir.c - separate ps and worker steps of one job (`psrun --role=ps`,
 * `psrun --role=worker`), meeting through files in a rendezvous directory
 * (--rendezvous DIR, else the submit directory) instead of task 0.
 */
#define _GNU_SOURCE
#include "rdvdir.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

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
int psr_run_ps_step(psr_step *s, char *err, size_t errlen) {
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
  char *hp = psr_step_start_psd(s, err, errlen);
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
  int code = psr_supervise(s, NULL, NULL, NULL, &aborted);
  unlink(path);
  return code;
}

/* `srun -n W psrun --role=worker CMD`: every task is a worker of a ps step
 * started earlier in the job. */
int psr_run_worker_step(psr_step *s, char *err, size_t errlen) {
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
  int rc = psr_step_start_worker(s, hosts, err, errlen);
  free(hosts);
  if (rc) return -1;
  int aborted = 0;
  return psr_supervise(s, NULL, NULL, NULL, &aborted);
}
