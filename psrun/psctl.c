/* psctl.c - `psctl stats HOST:PORT [--json]`: asks a running psd for its
 * counters and current step over the normal protocol, authenticated like
 * any peer (ROLE_ADMIN Hello with the job's shared secret, and a MUNGE
 * credential under Slurm), and prints them as text or one JSON object.
 * Under Slurm the job and step come from the environment or --job.
 * `psctl save FILE`: standard input into FILE by psd's rules for output
 * files (common/wfile.h), for scripts such as psplot. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps.pb-c.h"
#include "admin.h"
#include "opt.h"
#include "wfile.h"

/* Longest secret read from --secret-file (psd's own limit is 255 bytes). */
#define PSCTL_MAX_SECRET 255

typedef struct psctl_opts {
  int json;               /* --json: one JSON object */
  char secret_file[1024]; /* --secret-file: the job's shared secret */
  int munge;              /* --munge: present a MUNGE credential */
  char munge_socket[1024];/* --munge-socket */
  int64_t job_id;         /* --job-id the credential names */
  int64_t step_id;        /* --step-id */
  char job[64];           /* --job JOB.STEP: both at once, and --munge */
  double timeout_s;       /* --timeout: for the whole exchange */
  const char *secret_src; /* where the secret came from, for sentences (NULL: none) */
} psctl_opts;

#define F(f) PS_OPT_FIELD(psctl_opts, f)
static const ps__opt OPTS[] = {
    {"json", 0, PS_OPT_FLAG, F(json), "0", 0, 0, NULL, "print one JSON object instead of text"},
    {"secret-file", 0, PS_OPT_STR, F(secret_file), "", 0, 0, NULL,
     "file with the job's shared secret (else $PSD_SECRET, else $PS_SECRET)"},
    {"munge", 0, PS_OPT_FLAG, F(munge), "0", 0, 0, NULL,
     "also present a MUNGE credential (psd --munge); without it psctl does so when "
     "$PS_MUNGE=1 (a psrun worker's environment) or, with no secret, $SLURM_JOB_ID is set"},
    {"munge-socket", 0, PS_OPT_STR, F(munge_socket), "", 0, 0, NULL,
     "munged socket (default: MUNGE's)"},
    {"job-id", 0, PS_OPT_INT64, F(job_id), "-1", -1, 9.2e18, NULL,
     "Slurm job the MUNGE credential names (default $SLURM_JOB_ID)"},
    {"step-id", 0, PS_OPT_INT64, F(step_id), "-1", -1, 9.2e18, NULL,
     "Slurm step it names (default $SLURM_STEP_ID)"},
    {"job", 0, PS_OPT_STR, F(job), "", 0, 0, NULL,
     "JOB.STEP of the psrun step (implies --munge; default $SLURM_JOB_ID.$SLURM_STEP_ID); "
     "needed where $SLURM_STEP_ID is not that step's (a batch script, another step)"},
    {"timeout", 0, PS_OPT_DOUBLE, F(timeout_s), "10", 0.1, 3600, NULL,
     "seconds for the whole exchange"},
};

static const ps__opt_parser PARSER = {
    OPTS, sizeof OPTS / sizeof OPTS[0],
    "usage: psctl stats HOST:PORT [OPTIONS]\n"
    "       psctl save FILE < DATA\n"
    "Asks a running psd for its counters, current step and per-worker\n"
    "telemetry, authenticated like a worker: with the job's secret\n"
    "(--secret-file, else $PSD_SECRET, else $PS_SECRET) and a MUNGE\n"
    "credential when --munge or --job JOB.STEP say so, or a psrun worker's\n"
    "environment does ($PS_MUNGE=1, $PS_JOB_ID, $PS_STEP_ID), or, with no\n"
    "secret under Slurm, for job $SLURM_JOB_ID step $SLURM_STEP_ID.\n"
    "psrun prints the exact line for its job on stderr.\n"
    "save copies standard input into FILE as psd writes its files: mode\n"
    "0600, replaced whole, a symbolic link or another user's file or\n"
    "directory refused (psplot writes its pictures so).\n\n",
    NULL, PS_OPT_POS_COLLECT, 2, 24};

/* Reads the secret: --secret-file, else $PSD_SECRET, else $PS_SECRET
 * (o->secret_src says which, NULL when none has one). */
static int load_secret(psctl_opts *o, char *buf, size_t cap, size_t *len, char *err,
                       size_t errlen) {
  *len = 0;
  o->secret_src = NULL;
  if (o->secret_file[0]) {
    int fd = open(o->secret_file, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      snprintf(err, errlen, "cannot read --secret-file %s: %s", o->secret_file, strerror(errno));
      return -1;
    }
    /* Someone else's file, or one others can read, is no secret of ours:
     * a planted one would have us trust an impostor's psd. */
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid() ||
        (st.st_mode & 077)) {
      snprintf(err, errlen,
               "--secret-file %s is not a private file of yours (owner uid %u, mode 0%o): it "
               "must belong to you and be readable by you alone",
               o->secret_file, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
      close(fd);
      return -1;
    }
    ssize_t n = read(fd, buf, cap);
    close(fd);
    if (n <= 0 || (size_t)n >= cap) {
      snprintf(err, errlen, "--secret-file %s must hold 1 to %zu bytes", o->secret_file,
               cap - 1);
      return -1;
    }
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) n--; /* as psd reads it */
    *len = (size_t)n;
    o->secret_src = "--secret-file";
    return 0;
  }
  const char *s = getenv("PSD_SECRET"), *src = "$PSD_SECRET";
  if (!s || !*s) s = getenv("PS_SECRET"), src = "$PS_SECRET";
  if (s && *s) {
    *len = strlen(s) < cap ? strlen(s) : cap - 1;
    memcpy(buf, s, *len);
    o->secret_src = src;
  }
  return 0;
}

/* s as a JSON string. Names come from workers and may hold any byte but
 * NUL: every control character (C0, DEL and the C1 controls) is written
 * \u00XX and every byte that is not part of valid UTF-8 \ufffd (the
 * replacement character, as a UTF-8 decoder reads it), so the output stays
 * valid JSON and sends a terminal no escape. */
static void json_str(const char *s) {
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p;) {
    size_t n = 1;
    if (*p == '"' || *p == '\\') printf("\\%c", *p);
    else if (*p >= 0x20 && *p < 0x7f) putchar(*p);
    else if ((n = ps__utf8_len(p)) > 0) fwrite(p, 1, n, stdout);
    else if (p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f) printf("\\u%04x", p[1]), n = 2;
    else if (*p < 0x80) printf("\\u%04x", *p), n = 1;
    else printf("\\ufffd"), n = 1;
    p += n;
  }
  putchar('"');
}

/* Hit rate of a table's pulls, in percent (0 before any pull). */
static double hit_pct(const Ps__TableStats *t) {
  return t->keys_pulled ? 100.0 * (double)t->hits / (double)t->keys_pulled : 0.0;
}

static void print_tables_json(const Ps__StatsReply *r) {
  printf(",\"tables\":[");
  for (size_t i = 0; i < r->n_tables; i++) {
    const Ps__TableStats *t = r->tables[i];
    printf("%s{\"name\":", i ? "," : "");
    json_str(t->name);
    printf(",\"dim\":%u,\"step\":%llu,\"rows\":%llu,\"capacity\":%llu,\"keys_pulled\":%llu,"
           "\"keys_pushed\":%llu,\"hits\":%llu,\"hit_rate\":%.4f,\"admissions\":%llu,"
           "\"evictions_lru\":%llu,\"evictions_ttl\":%llu,\"dropped\":%llu,\"bytes\":%llu,"
           "\"touches_skipped\":%llu}",
           t->dim, (unsigned long long)t->step, (unsigned long long)t->rows,
           (unsigned long long)t->capacity, (unsigned long long)t->keys_pulled,
           (unsigned long long)t->keys_pushed, (unsigned long long)t->hits, hit_pct(t) / 100.0,
           (unsigned long long)t->admissions, (unsigned long long)t->evictions_lru,
           (unsigned long long)t->evictions_ttl, (unsigned long long)t->dropped,
           (unsigned long long)t->bytes, (unsigned long long)t->touches_skipped);
  }
  printf("]");
}

static void print_tables_text(const Ps__StatsReply *r) {
  if (!r->n_tables) return;
  printf("%-16s %5s %8s %10s %10s %12s %12s %6s %10s %10s %10s %10s\n", "table", "dim",
         "step", "rows", "capacity", "pulled/step", "pushed/step", "hit%", "admitted",
         "evict lru", "evict ttl", "dropped");
  for (size_t i = 0; i < r->n_tables; i++) {
    const Ps__TableStats *t = r->tables[i];
    double steps = t->step ? (double)t->step : 1.0; /* keys per step, on average */
    printf("%-16s %5u %8llu %10llu %10llu %12.1f %12.1f %6.1f %10llu %10llu %10llu %10llu\n",
           PS__ESC(t->name ? t->name : "?"), t->dim, (unsigned long long)t->step,
           (unsigned long long)t->rows, (unsigned long long)t->capacity,
           (double)t->keys_pulled / steps, (double)t->keys_pushed / steps, hit_pct(t),
           (unsigned long long)t->admissions, (unsigned long long)t->evictions_lru,
           (unsigned long long)t->evictions_ttl, (unsigned long long)t->dropped);
  }
}

static void print_json(const char *addr, const Ps__StatsReply *r) {
  printf("{\"addr\":");
  json_str(addr);
  printf(",\"server_id\":");
  json_str(r->server_id);
  printf(",\"ps_index\":%u,\"num_ps\":%u,\"num_workers\":%u,\"replicas_to_aggregate\":%u,"
         "\"async\":%s,\"uptime_s\":%.3f,\"step\":%llu,\"max_step\":%llu,\"slices\":%u,"
         "\"bytes_held\":%llu,\"stale_dropped\":%llu,\"steps_recorded\":%llu,"
         "\"agg_ms_p50\":%.4f,\"workers\":[",
         r->ps_index, r->num_ps, r->num_workers, r->replicas_to_aggregate,
         r->async_mode ? "true" : "false", r->uptime_s, (unsigned long long)r->step,
         (unsigned long long)r->max_step, r->slices, (unsigned long long)r->bytes_held,
         (unsigned long long)r->stale_dropped, (unsigned long long)r->steps_recorded,
         r->agg_ms_p50);
  for (size_t i = 0; i < r->n_workers; i++) {
    const Ps__WorkerStats *w = r->workers[i];
    printf("%s{\"worker\":%u,\"state\":", i ? "," : "", w->worker);
    json_str(w->state);
    printf(",\"pushes\":%llu,\"last_count\":%llu,\"waited_for_ms\":%.4f,\"bytes_in\":%llu,"
           "\"bytes_out\":%llu,\"arrive_mean_ms\":%.4f,\"transport\":",
           (unsigned long long)w->pushes, (unsigned long long)w->last_count, w->waited_for_ms,
           (unsigned long long)w->bytes_in, (unsigned long long)w->bytes_out,
           w->arrive_mean_ms);
    if (w->transport && w->transport[0]) json_str(w->transport);
    else printf("null");
    printf(",\"shm_tcp_frames\":%llu}", (unsigned long long)w->shm_tcp_frames);
  }
  printf("]");
  print_tables_json(r);
  printf("}\n");
}

static void print_text(const char *addr, const Ps__StatsReply *r) {
  printf("%s at %s: ps %u of %u, up %.1f s\n",
         PS__ESC(r->server_id && r->server_id[0] ? r->server_id : "psd"), addr,
         r->ps_index, r->num_ps, r->uptime_s);
  printf("step %llu (slices between %llu and %llu), %u slices, %.2f MiB of parameters\n",
         (unsigned long long)r->step, (unsigned long long)r->step,
         (unsigned long long)r->max_step, r->slices, r->bytes_held / 1048576.0);
  if (!r->num_workers) {
    printf("no worker has joined yet\n");
    return;
  }
  print_tables_text(r);
  printf("%u workers, %s", r->num_workers, r->async_mode ? "async" : "sync");
  if (!r->async_mode) printf(" averaging %u per step", r->replicas_to_aggregate);
  printf("; %llu stale gradients dropped; %llu steps recorded, aggregation p50 %.3f ms\n",
         (unsigned long long)r->stale_dropped, (unsigned long long)r->steps_recorded,
         r->agg_ms_p50);
  printf("%-7s %-10s %9s %8s %13s %10s %12s %12s %4s\n", "worker", "state", "pushes", "last",
         "waited-for ms", "lag ms", "data in", "data out", "via");
  int fell_back = 0;
  for (size_t i = 0; i < r->n_workers; i++) {
    const Ps__WorkerStats *w = r->workers[i];
    printf("w%-6u %-10s %9llu %8llu %13.3f %10.3f %12llu %12llu %4s%s\n", w->worker,
           PS__ESC(w->state ? w->state : "?"), (unsigned long long)w->pushes,
           (unsigned long long)w->last_count, w->waited_for_ms, w->arrive_mean_ms,
           (unsigned long long)w->bytes_in, (unsigned long long)w->bytes_out,
           PS__ESC(w->transport && w->transport[0] ? w->transport : "-"),
           w->shm_tcp_frames ? "*" : "");
    fell_back |= w->shm_tcp_frames != 0;
  }
  for (size_t i = 0; fell_back && i < r->n_workers; i++)
    if (r->workers[i]->shm_tcp_frames)
      printf("* w%u: %llu frames of tensor data went over TCP: no room in its shared-memory "
             "ring (a model bigger than the ring, or a peer that does not keep up)\n",
             r->workers[i]->worker, (unsigned long long)r->workers[i]->shm_tcp_frames);
}

/* --job JOB.STEP: both ids, and MUNGE. 0, or -1 with err. */
static int parse_job(psctl_opts *o, char *err, size_t errlen) {
  long long j, st;
  char tail;
  if (sscanf(o->job, "%lld.%lld%c", &j, &st, &tail) != 2 || j < 0 || st < 0) {
    snprintf(err, errlen, "--job '%s': expected JOB.STEP, e.g. 1234.0", o->job);
    return -1;
  }
  o->job_id = j;
  o->step_id = st;
  o->munge = 1;
  return 0;
}

/* Whose word psctl presents MUNGE on: the options', psrun's (a worker's
 * environment) or Slurm's. */
typedef enum { MUNGE_OPTS, MUNGE_PSRUN, MUNGE_SLURM } munge_from;
static const char *const MUNGE_VARS[] = {"", " (from $PS_JOB_ID and $PS_STEP_ID)",
                                         " (from $SLURM_JOB_ID and $SLURM_STEP_ID)"};

/* Sets o->munge, its job, step and socket where the options left them, and
 * says whose word that is: --munge or --job; else psrun's worker
 * environment (PS_MUNGE=1, as libpsclient reads it); else, with no secret,
 * Slurm's ($SLURM_JOB_ID), whose step must then be known: a psrun psd
 * takes credentials for its own step only. 0, or -1 with err. */
static int choose_munge(psctl_opts *o, int have_secret, munge_from *from, char *err,
                        size_t errlen) {
  const char *pm = getenv("PS_MUNGE");
  const char *j = getenv("SLURM_JOB_ID"), *st = getenv("SLURM_STEP_ID");
  *from = MUNGE_OPTS;
  if (!o->munge && pm && strcmp(pm, "1") == 0) {
    *from = MUNGE_PSRUN;
    j = getenv("PS_JOB_ID"), st = getenv("PS_STEP_ID");
    const char *sock = getenv("PS_MUNGE_SOCKET");
    if (!o->munge_socket[0] && sock) snprintf(o->munge_socket, sizeof o->munge_socket, "%s", sock);
  } else if (!o->munge && !have_secret && j && *j) {
    *from = MUNGE_SLURM;
  } else if (!o->munge) {
    return 0;
  }
  o->munge = 1;
  if (o->job_id < 0 && j && *j) o->job_id = atoll(j);
  if (o->step_id < 0 && st && *st) o->step_id = atoll(st);
  if (o->job_id < 0) {
    snprintf(err, errlen, "--munge needs --job-id (or $SLURM_JOB_ID)");
    return -1;
  }
  if (*from == MUNGE_SLURM && o->step_id < 0) {
    snprintf(err, errlen,
             "no secret (--secret-file, $PSD_SECRET, $PS_SECRET) and $SLURM_STEP_ID is not set "
             "(a batch script or salloc shell), so psctl cannot tell which step of job %lld the "
             "psd serves: pass --job JOB.STEP, as in the line psrun printed",
             (long long)o->job_id);
    return -1;
  }
  return 0;
}

/* What psctl presented, for the sentence when psd refuses it. */
static void tried(const psctl_opts *o, munge_from from, char *buf, size_t len) {
  int n = o->secret_src ? snprintf(buf, len, "the secret from %s", o->secret_src)
                        : snprintf(buf, len, "no secret (none in --secret-file, $PSD_SECRET or "
                                             "$PS_SECRET)");
  if (n < 0 || (size_t)n >= len) return;
  if (o->munge)
    snprintf(buf + n, len - (size_t)n, " and a MUNGE credential for job %lld step %lld%s",
             (long long)o->job_id, (long long)o->step_id, MUNGE_VARS[from]);
  else
    snprintf(buf + n, len - (size_t)n, " and no MUNGE credential%s",
             getenv("SLURM_JOB_ID") ? " (with a secret, psctl takes --munge or --job JOB.STEP "
                                      "to present one)"
                                    : " ($SLURM_JOB_ID is not set)");
}

/* Asks addr for Stats with the credentials the options and the environment
 * give. 0, 2 (a usage error) or 1, each failure said in one sentence. */
static int stats(psctl_opts *o, const char *addr, const char *secret, size_t slen,
                 Ps__StatsReply **r) {
  char err[1200], what[400];
  munge_from from;
  if (choose_munge(o, slen > 0, &from, err, sizeof err) != 0) {
    fprintf(stderr, "psctl: %s\n", err);
    return 2;
  }
  ps__auth au = {slen ? secret : NULL, slen, o->munge,
                 o->munge_socket[0] ? o->munge_socket : NULL, o->job_id, o->step_id};
  int rc = ps__admin_stats(addr, &au, (int)(o->timeout_s * 1000), r, err, sizeof err);
  if (!rc) return 0;
  tried(o, from, what, sizeof what);
  if (rc == PS_EAUTH)
    fprintf(stderr, "psctl: %s (%s); psctl presented %s\n", err, ps_err_name(rc), what);
  else fprintf(stderr, "psctl: %s (%s)\n", err, ps_err_name(rc));
  return 1;
}

/* `psctl save FILE`: standard input, whole, into FILE through the one safe
 * writer, so a script gets psd's rules (a planted link refused, 0600)
 * without writing them again in shell. 0, or 1 with a sentence. */
static int save(const char *path) {
  ps__wfile w;
  char err[1200], buf[65536];
  if (ps__wfile_begin(&w, path, 0600, "", err, sizeof err) != 0) {
    fprintf(stderr, "psctl: %s\n", err);
    return 1;
  }
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, stdin)) > 0 && fwrite(buf, 1, n, w.fp) == n) {
  }
  if (ferror(stdin) || ferror(w.fp)) {
    fprintf(stderr, "psctl: %s: cannot copy standard input into it: %s\n", path,
            strerror(errno));
    ps__wfile_abort(&w);
    return 1;
  }
  if (ps__wfile_commit(&w, 0, err, sizeof err) == 0) return 0;
  fprintf(stderr, "psctl: %s\n", err);
  return 1;
}

int main(int argc, char **argv) {
  psctl_opts o;
  char err[1200];
  memset(&o, 0, sizeof o);
  ps__opt_args rest;
  int prc = ps__opt_parse(&PARSER, &o, argc, argv, &rest, err, sizeof err);
  if (prc == 1) return 0;
  if (prc < 0) {
    fprintf(stderr, "psctl: %s\n", err);
    return 2;
  }
  int npos = rest.npos;
  const char *const *pos = rest.pos;
  if (npos == 2 && strcmp(pos[0], "save") == 0) return save(pos[1]);
  if (npos != 2 || strcmp(pos[0], "stats") != 0) {
    fprintf(stderr, "psctl: expected 'psctl stats HOST:PORT' or 'psctl save FILE' (see "
                    "--help)\n");
    return 2;
  }
  char secret[PSCTL_MAX_SECRET + 2];
  size_t slen;
  if (load_secret(&o, secret, sizeof secret, &slen, err, sizeof err) != 0 ||
      (o.job[0] && parse_job(&o, err, sizeof err) != 0)) {
    fprintf(stderr, "psctl: %s\n", err);
    return 2;
  }
  Ps__StatsReply *r = NULL;
  int rc = stats(&o, pos[1], secret, slen, &r);
  if (rc) return rc;
  if (o.json) print_json(pos[1], r);
  else print_text(pos[1], r);
  ps__stats_reply__free_unpacked(r, NULL);
  return 0;
}
