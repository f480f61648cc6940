/* psrun_util.c - helpers every psrun module shares: the log identity (lines are
 * written by common/log.c), --print-plan's line, the job's random secret, backup workers, what
 * psd's exit statuses mean, and which workers psd never saw finish. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include <sys/wait.h>

#include "ps.pb-c.h"
#include "admin.h"
#include "proc.h"
#include "psrun.h"

/* How long one psd has to answer psrun's Stats request (psr_unfinished). */
#define PSR_STATS_MS 3000

void psr_log_ident(int rank) {
  char ident[32];
  if (rank >= 0) snprintf(ident, sizeof ident, "psrun[%d]", rank);
  else snprintf(ident, sizeof ident, "psrun");
  ps__log_init(ident, PS_LOG_INFO, PS_LOG_PLAIN);
}

void psr_print_role(const psr_role *r, const char *node) {
  printf("{\"rank\":%d,\"role\":\"%s\",\"index\":%d,\"node\":\"%s\",\"local_rank\":%d",
         r->rank, r->is_ps ? "ps" : "worker", r->index, node, r->local_rank);
  if (!r->is_ps) printf(",\"worker_local_rank\":%d", r->worker_local_rank);
  printf("}\n");
}

int psr_new_secret(char out[65]) {
  unsigned char b[32];
  if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) return -1;
  for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
  return 0;
}

int psr_replicas(const psr_opts *o, int num_workers, int *backups) {
  *backups = 0;
  if (num_workers <= 0) return 0;
  if (o->backup_workers > 0) {
    *backups = o->backup_workers < num_workers ? o->backup_workers : num_workers - 1;
    return num_workers - *backups;
  }
  /* The variable alone already made psd tolerate losses; psrun agrees
   * rather than stopping the job on the first one. */
  const char *env = getenv("PS_REPLICAS_TO_AGGREGATE");
  char *end;
  long r = env && *env ? strtol(env, &end, 10) : 0;
  if (r <= 0 || r >= num_workers || *end) return 0;
  *backups = num_workers - (int)r;
  return (int)r;
}

const char *psr_psd_status_says(int code) {
  switch (code) {
  case 64: return " (psd's command line was refused)";
  case 65: return " (psd could not start; its log says why)";
  case 66: return " (a worker the job needs was lost: more than the backup workers; psd's "
                  "log names it)";
  case 67: return " (workers never came: none connected within psd's timeout)";
  case 68: return " (a worker stayed connected but silent past psd's --finish-timeout after "
                  "the others finished: it never called ps_client_finish; psd's log names it)";
  case 69: return " (stopped without a checkpoint: the job cannot resume from this stop; "
                  "psd's log names the newest complete checkpoint, if any)";
  case 75: return " (stopped on request after its checkpoint)";
  default: return "";
  }
}

/* Worker states psr_unfinished names; index 0: finished, or not reported. */
static const char *const UNFINISHED[] = {NULL, "connected", "lost", "absent"};

/* Notes in st[] (an UNFINISHED index per worker) every worker r lists as
 * not finished, keeping what an earlier psd said. A psd that no worker
 * ever joined lists none: to it they are all absent. */
static void note_states(const Ps__StatsReply *r, int num_workers, unsigned char *st) {
  if (!r->num_workers)
    for (int w = 0; w < num_workers; w++)
      if (!st[w]) st[w] = 3;
  for (size_t i = 0; i < r->n_workers; i++) {
    const Ps__WorkerStats *k = r->workers[i];
    if (k->worker >= (uint32_t)num_workers || st[k->worker] || !k->state) continue;
    for (unsigned char j = 1; j < 4; j++)
      if (strcmp(k->state, UNFINISHED[j]) == 0) st[k->worker] = j;
  }
}

/* Asks psd's own view rather than reading its log: Stats names each
 * worker's state ("lost": it left without ps_client_finish; "absent": it
 * never joined; "connected"), and only the psrun that started a psd sees its
 * log (under Slurm task 0 sees none); one way for --local and Slurm. */
void psr_unfinished(const char *hosts, const int *running, int num_workers,
                    const struct ps__auth *auth, char *buf, size_t len) {
  buf[0] = '\0';
  unsigned char *st = calloc(num_workers > 0 ? (size_t)num_workers : 1, 1);
  char failed[600] = "";
  size_t fl = 0;
  int i = 0;
  for (const char *h = hosts; st && h && *h; i++) {
    size_t n = strcspn(h, ",");
    char addr[256], err[400];
    snprintf(addr, sizeof addr, "%.*s", (int)(n < 255 ? n : 255), h);
    h += n + (h[n] == ',');
    Ps__StatsReply *r = NULL;
    if (!running[i]) continue;
    if (ps__admin_stats(addr, auth, PSR_STATS_MS, &r, err, sizeof err) != 0) {
      if (fl + 8 < sizeof failed)
        fl += (size_t)snprintf(failed + fl, sizeof failed - fl, "; psrun could not ask ps%d: %s",
                               i, err);
      continue;
    }
    note_states(r, num_workers, st);
    ps__stats_reply__free_unpacked(r, NULL);
  }
  char names[400] = "";
  size_t o = 0;
  for (int w = 0; st && w < num_workers; w++) {
    if (!st[w]) continue;
    if (o + 40 >= sizeof names) {
      o += (size_t)snprintf(names + o, sizeof names - o, ", ...");
      break;
    }
    o += (size_t)snprintf(names + o, sizeof names - o, "%sw%d (%s)", o ? ", " : "", w,
                          UNFINISHED[st[w]]);
  }
  free(st);
  if (o)
    snprintf(buf, len,
             ": psd never saw %s call ps_client_finish (a worker that exits without it counts "
             "as lost, and psd waits its --grace-period for it to rejoin, then exits 66)%s",
             names, failed);
  else if (failed[0]) snprintf(buf, len, ": %s", failed + 2);
}

int psr_child_code(psr_child *c) {
  int code = psr_exit_code(c->status);
  if (!c->stopped || code == 0 || code == PSR_EXIT_STOPPED || !WIFEXITED(c->status))
    return code;
  psr_log("%s exited with status %d after the job stopped at its checkpoint: counted as "
          "stopped (%d)", c->label, code, PSR_EXIT_STOPPED);
  /* From here on it is a stop for everyone who reads the status. */
  c->stopped = 0;
  c->status = PSR_EXIT_STOPPED << 8;
  return PSR_EXIT_STOPPED;
}
