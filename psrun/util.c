/* util.c - helpers every psrun module shares: the log identity (lines are
 * written by common/log.c) and the job's random secret. */
#define _GNU_SOURCE
#include <stdio.h>
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
