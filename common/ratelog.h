/*
 * ratelog.h - rate-limited log lines for what a peer can trigger (psd: bad
 * frames, failed handshakes, evictions; psrun task 0: silent, shed and
 * refused check-ins): at most `burst` lines per `window_s` per kind, then
 * one "suppressed K similar messages (KIND) in the last S s" line, so a
 * flood of bad peers cannot flood the log (or the disk under it). Time is
 * passed in, so the rule is testable.
 */
#ifndef PS_COMMON_RATELOG_H
#define PS_COMMON_RATELOG_H

#include <stdint.h>

/* Lines of one kind printed per window when a kind sets no burst: enough
 * to see what is going on, few enough that a flood costs a handful of
 * lines a second. */
#define PS__RATELOG_BURST 5u
/* The window, seconds, when a kind sets none. */
#define PS__RATELOG_WINDOW_S 1.0

/* One kind of message. Zero-initialised state is ready to use once
 * `what` is set (burst and window_s 0: the defaults above). */
typedef struct ps__ratelog {
  const char *what;         /* the kind, named in the summary line */
  int level;                /* PS_LOG_* level of its lines */
  unsigned burst;           /* lines printed per window (0: PS__RATELOG_BURST) */
  double window_s;          /* the window (0: PS__RATELOG_WINDOW_S) */
  double window_at;         /* start of the current window */
  unsigned in_window;       /* lines printed in it */
  uint64_t suppressed;      /* lines dropped since the last summary */
  double suppressed_since;  /* when the first of them was dropped */
  uint64_t total;           /* every message of this kind, printed or not */
} ps__ratelog;

/* Logs one message of r's kind at time now, or counts it as suppressed.
 * A pending summary of an earlier window is printed first. Returns 1 if
 * the line was printed. */
int ps__ratelog_say(ps__ratelog *r, double now, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Prints the summary of suppressed messages once their window is over
 * (called from a periodic timer, so the count appears even when the flood
 * stops); with `force`, at once (the flood's source is going away). */
void ps__ratelog_flush(ps__ratelog *r, double now, int force);

#endif
