/* backoff.c - jittered exponential waits between retries, bounded by a
 * deadline. */
#define _GNU_SOURCE
#include "backoff.h"

#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

void ps__backoff_init(ps__backoff *b, double first_s, double max_s) {
  b->next_s = first_s;
  b->max_s = max_s;
  b->seed = (unsigned)getpid() * 2654435761u ^ (unsigned)(ps__now() * 1e6);
  b->tries = 0;
}

double ps__backoff_next(ps__backoff *b) {
  double jitter = 0.5 + (double)rand_r(&b->seed) / ((double)RAND_MAX + 1.0);
  double w = b->next_s * jitter;
  b->next_s = b->next_s * 2 > b->max_s ? b->max_s : b->next_s * 2;
  b->tries++;
  return w;
}

double ps__backoff_sleep(ps__backoff *b, double deadline) {
  double w = ps__backoff_next(b), left = deadline - ps__now();
  if (left <= 0) return -1;
  /* The last wait ends at the deadline, for one more try there: a caller
   * whose timeout is T tries for T, not for T less a whole wait. */
  if (w > left) w = left;
  struct timespec ts = {(time_t)w, (long)((w - (double)(time_t)w) * 1e9)};
  nanosleep(&ts, NULL); /* a signal cuts it short: the caller's loop looks again */
  return w;
}
