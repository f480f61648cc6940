/* util.c - helpers every psrun module shares: the log identity (lines are
 * written by common/log.c) and the job's random secret. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/random.h>

#include "psrun.h"

void psr_log_ident(int rank) {
  char ident[32];
  if (rank >= 0) snprintf(ident, sizeof ident, "psrun[%d]", rank);
  else snprintf(ident, sizeof ident, "psrun");
  ps__log_init(ident, PS_LOG_INFO, PS_LOG_PLAIN);
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
  case 68: return " (a worker stayed connected but silent after the others finished: it "
                  "never called ps_client_finish; psd's log names it)";
  case 69: return " (stopped without a checkpoint: the job cannot resume from this stop; "
                  "psd's log names the newest complete checkpoint, if any)";
  case 75: return " (stopped on request after its checkpoint)";
  default: return "";
  }
}
