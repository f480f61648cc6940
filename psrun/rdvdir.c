/*
 * rdvdir.c - separate ps and worker steps of one job (`psrun --role=ps`,
 * `psrun --role=worker`), meeting through files in a rendezvous directory
 * (--rendezvous DIR, else the submit directory) instead of task 0.
 */
#define _GNU_SOURCE
#include "rdvdir.h"

#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "util.h"
#include "wfile.h"

/* The name of uid, for sentences. */
static const char *user_name(uid_t uid, char *buf, size_t len) {
  struct passwd *pw = getpwuid(uid);
  snprintf(buf, len, "%s (uid %u)", pw ? pw->pw_name : "?", (unsigned)uid);
  return buf;
}

/* The base directory: any owner, but if others can write it, only with the
 * sticky bit (like /tmp: they cannot remove or rename what we create). */
static int check_base(const char *base, char *err, size_t errlen) {
  struct stat st;
  if (stat(base, &st) != 0 || !S_ISDIR(st.st_mode)) {
    snprintf(err, errlen, "rendezvous base %s is not a directory%s%s", base,
             errno ? ": " : "", errno ? strerror(errno) : "");
    return -1;
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX) && st.st_uid != 0) {
    snprintf(err, errlen, "rendezvous base %s is writable by other users (mode 0%o, no sticky "
                          "bit): they could plant the job's files; pass --rendezvous with a "
                          "directory only you can write",
             base, (unsigned)(st.st_mode & 07777));
    return -1;
  }
  return 0;
}

/* fd (an open directory) is ours and nobody else can write it. */
static int check_own_dir(int fd, const char *path, const char *what, const char *fix, char *err,
                         size_t errlen) {
  struct stat st;
  char who[128];
  if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode)) {
    snprintf(err, errlen, "%s %s is not a directory", what, path);
    return -1;
  }
  if (st.st_uid != getuid()) {
    snprintf(err, errlen, "%s %s belongs to %s, not to you: someone else created it, and its "
                          "files cannot be trusted; %s", what, path,
             user_name(st.st_uid, who, sizeof who), fix);
    return -1;
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    snprintf(err, errlen, "%s %s is writable by other users (mode 0%o); chmod 700 it or remove "
                          "it", what, path, (unsigned)(st.st_mode & 07777));
    return -1;
  }
  return 0;
}

/* Directory where the tasks of a job meet (--rendezvous, else the submit
 * directory, shared by the job's nodes on any real cluster):
 * BASE/.psrun-JOB.RESTART, created 0700 by us, or refused. */
int psr_rdv_dir(const psr_opts *o, const psr_env *e, char *out, size_t len, char *err,
                size_t errlen) {
  const char *base = o->rendezvous[0] ? o->rendezvous : getenv("SLURM_SUBMIT_DIR");
  if (!base || !*base) {
    snprintf(err, errlen, "no rendezvous directory: pass --rendezvous DIR (a directory every "
                          "node of the job sees)");
    return -1;
  }
  errno = 0;
  if (check_base(base, err, errlen) != 0) return -1;
  const char *restart = getenv("SLURM_RESTART_COUNT");
  snprintf(out, len, "%s/.psrun-%lld.%s", base, e->job_id, restart && *restart ? restart : "0");
  if (mkdir(out, 0700) != 0 && errno != EEXIST) {
    snprintf(err, errlen, "cannot create rendezvous directory %s: %s", out, strerror(errno));
    return -1;
  }
  int fd = open(out, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    snprintf(err, errlen, "cannot open rendezvous directory %s: %s%s", out, strerror(errno),
             errno == ELOOP || errno == ENOTDIR ? " (a symbolic link or a file: planted?)" : "");
    return -1;
  }
  int rc = check_own_dir(fd, out, "rendezvous directory", "remove it or pass another --rendezvous",
                         err, errlen);
  close(fd);
  return rc;
}

/* Writes text and a newline to path, mode 0600 (the info and key files
 * hold secrets), through the one safe writer: a random O_EXCL temporary
 * renamed into place (common/wfile.h). 0 or -1 with err. */
static int write_atomic(const char *path, const char *text, char *err, size_t errlen) {
  char line[1024];
  int len = snprintf(line, sizeof line, "%s\n", text);
  if (len < 0 || (size_t)len >= sizeof line) {
    snprintf(err, errlen, "%s: the line is too long", path);
    return -1;
  }
  return ps__wfile_write(path, line, (size_t)len, 0600, "", err, errlen);
}

/* The first line of path, if it is a plain file of ours that nobody else
 * can read or write (never through a symbolic link). */
/* psrun --local's admin credential: BASE/psrun-UID (BASE: $XDG_RUNTIME_DIR,
 * else /tmp), created 0700 and checked like a rendezvous directory, so no
 * other user can plant, swap or read what is in it; the file is 0600 and
 * written like the key files. */
int psr_admin_cred_write(const char *secret, char *path, size_t len, char *err, size_t errlen) {
  const char *base = getenv("XDG_RUNTIME_DIR");
  if (!base || !*base || access(base, W_OK) != 0) base = "/tmp";
  errno = 0;
  if (check_base(base, err, errlen) != 0) return -1;
  char dir[4200];
  snprintf(dir, sizeof dir, "%s/psrun-%u", base, (unsigned)getuid());
  if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
    snprintf(err, errlen, "cannot create %s: %s", dir, strerror(errno));
    return -1;
  }
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    snprintf(err, errlen, "cannot open %s: %s%s", dir, strerror(errno),
             errno == ELOOP || errno == ENOTDIR ? " (a symbolic link or a file: planted?)" : "");
    return -1;
  }
  int rc = check_own_dir(fd, dir, "psctl's credential directory",
                         "remove it, or set XDG_RUNTIME_DIR to a directory of yours", err, errlen);
  close(fd);
  if (rc) return -1;
  snprintf(path, len, "%s/job-%d.secret", dir, (int)getpid());
  return write_atomic(path, secret, err, errlen);
}

static char *slurp_line(const char *path) {
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (fd < 0) return NULL;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid() ||
      (st.st_mode & 077)) {
    psr_log("ignoring %s: not a private file of yours (owner uid %u, mode 0%o)", path,
            (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
    close(fd);
    return NULL;
  }
  FILE *f = fdopen(fd, "r");
  if (!f) {
    close(fd);
    return NULL;
  }
  char buf[512];
  char *r = fgets(buf, sizeof buf, f) ? strdup(buf) : NULL;
  fclose(f);
  if (r) r[strcspn(r, "\r\n")] = '\0';
  return r;
}

/* ---- the key of the key mode (rdvauth.h) ------------------------------------------ */

int psr_rdv_key_write(const char *dir, long long step, const uint8_t key[PSR_KEY_BYTES],
                      char *err, size_t errlen) {
  char path[4300], hex[PSR_HEX_LEN + 1];
  snprintf(path, sizeof path, "%s/key.%lld", dir, step);
  psr_auth_key_hex(key, hex);
  return write_atomic(path, hex, err, errlen);
}

int psr_rdv_key_read(const char *dir, long long step, uint8_t key[PSR_KEY_BYTES],
                     double deadline, char *err, size_t errlen) {
  char path[4300];
  snprintf(path, sizeof path, "%s/key.%lld", dir, step);
  for (;;) {
    char *line = slurp_line(path);
    int ok = line && psr_auth_key_unhex(line, key) == 0;
    free(line);
    if (ok) return 0;
    if (ps__now() > deadline) {
      snprintf(err, errlen, "task 0's key %s did not appear (is the rendezvous directory on a "
                            "file system every node sees? pass --rendezvous DIR)", path);
      return -1;
    }
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
  }
}

void psr_rdv_key_remove(const char *dir, long long step) {
  char path[4300];
  snprintf(path, sizeof path, "%s/key.%lld", dir, step);
  unlink(path);
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
  if (psr_rdv_dir(s->o, &s->env, dir, sizeof dir, err, errlen)) return -1;
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
    if (write_atomic(path, text, err, errlen) != 0) return -1;
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
  if (write_atomic(path, text, err, errlen) != 0) {
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

/* A worker step's MASTER_ADDR and MASTER_PORT: its task 0 (worker 0)
 * picks them and publishes "addr:port" in DIR/master.STEP; the other tasks
 * wait for that file. It stays there (a slow task may read it late; the
 * step id keeps other steps' apart). */
static int worker_step_master(psr_step *s, const char *dir, char *err, size_t errlen) {
  char path[4300];
  snprintf(path, sizeof path, "%s/master.%lld", dir, s->env.step_id);
  if (s->env.procid == 0) {
    char hp[96];
    if (psr_step_pick_master(s, err, errlen) != 0) return -1;
    snprintf(hp, sizeof hp, "%s:%d", s->master_addr, s->master_port);
    return write_atomic(path, hp, err, errlen);
  }
  for (double end = ps__now() + s->o->timeout_s;;) {
    char *line = slurp_line(path);
    int ok = line && psr_step_set_master(s, line) == 0;
    free(line);
    if (ok) return 0;
    if (ps__now() > end) {
      snprintf(err, errlen, "worker task 0 did not publish MASTER_ADDR:MASTER_PORT in %s within "
                            "%.0f s", path, s->o->timeout_s);
      return -1;
    }
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
  }
}

/* A worker step's LOCAL_RANK and LOCAL_WORLD_SIZE: every task of the step
 * is a worker, so Slurm's local id and this node's task count. */
static int worker_step_local(psr_step *s, char *err, size_t errlen) {
  const psr_env *e = &s->env;
  int *counts = NULL, n = 0;
  if (psr_parse_tasks_per_node("SLURM_STEP_TASKS_PER_NODE", e->tasks_per_node, &counts, &n, err,
                               errlen) != 0)
    return -1;
  int ok = e->nodeid < n;
  if (ok) s->node_workers = counts[e->nodeid];
  else
    snprintf(err, errlen, "SLURM_NODEID=%d is not below the %d node(s) of "
                          "SLURM_STEP_TASKS_PER_NODE='%s'", e->nodeid, n, e->tasks_per_node);
  free(counts);
  s->local_rank = e->localid;
  return ok ? 0 : -1;
}

/* `srun -n W psrun --role=worker CMD`: every task is a worker of a ps step
 * started earlier in the job. */
int psr_run_worker_step(psr_step *s, char *err, size_t errlen) {
  char dir[4200], path[4300];
  if (psr_rdv_dir(s->o, &s->env, dir, sizeof dir, err, errlen)) return -1;
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
  int rc = worker_step_local(s, err, errlen) != 0 || worker_step_master(s, dir, err, errlen) != 0
               ? -1
               : psr_step_start_worker(s, hosts, err, errlen);
  free(hosts);
  if (rc) return -1;
  int aborted = 0;
  return psr_supervise(s, NULL, NULL, NULL, &aborted);
}
