/*
 * backoff.h - the wait between retries of a connection or a handshake
 * (psrun members checking in, workers and psctl reaching psd): exponential
 * from a first wait to a cap, each wait jittered to 50-150% so peers that
 * were turned away together do not come back together, and never past the
 * caller's deadline. Internal (ps__ names); compiled into libpsclient, psd
 * and the tools alike.
 */
#ifndef PS_BACKOFF_H
#define PS_BACKOFF_H

typedef struct ps__backoff {
  double next_s;  /* the next wait, before jitter */
  double max_s;   /* the longest wait, before jitter */
  unsigned seed;  /* the jitter's state (rand_r), drawn from pid and clock */
  int tries;      /* waits taken so far */
} ps__backoff;

/* Starts at first_s, doubling up to max_s. */
void ps__backoff_init(ps__backoff *b, double first_s, double max_s);
/* The next wait, jittered (the state advances). */
double ps__backoff_next(ps__backoff *b);
/* Sleeps the next wait, cut short to end at deadline (ps__now() seconds)
 * so that the caller tries once more there: the seconds slept, or -1 once
 * the deadline has passed (nothing slept: give up). */
double ps__backoff_sleep(ps__backoff *b, double deadline);

#endif /* PS_BACKOFF_H */
