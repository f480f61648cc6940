/*
 * ratelog.h - rate-limited log lines for what a peer can trigger (bad
 * frames, failed handshakes, evictions): at most PSD_RATELOG_BURST lines
 * per PSD_RATELOG_WINDOW_S per kind, then one "suppressed K similar
 * messages" line, so a flood of bad peers cannot flood the log (or the
 * disk under it). Time is passed in, so the rule is testable.
 */
#ifndef PSD_RATELOG_H
#define PSD_RATELOG_H

#include <stdint.h>

/* Lines of one kind printed per window: enough to see what is going on,
 * few enough that a flood costs a handful of lines a second. */
#define PSD_RATELOG_BURST 5u
/* The window, seconds. */
#define PSD_RATELOG_WINDOW_S 1.0

/* One kind of message. Zero-initialised state is ready to use once
 * `what` is set. */
typedef struct psd_ratelog {
  const char *what;         /* the kind, named in the summary line */
  int level;                /* PSD_LOG_* level of its lines */
  double window_at;         /* start of the current window */
  unsigned in_window;       /* lines printed in it */
  uint64_t suppressed;      /* lines dropped since the last summary */
  double suppressed_since;  /* when the first of them was dropped */
  uint64_t total;           /* every message of this kind, printed or not */
} psd_ratelog;

/* Logs one message of r's kind at time now, or counts it as suppressed.
 * A pending summary of an earlier window is printed first. Returns 1 if
 * the line was printed. */
int psd_ratelog_say(psd_ratelog *r, double now, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Prints the summary of suppressed messages once their window is over
 * (called from the periodic timer, so the count appears even when the
 * flood stops). */
void psd_ratelog_flush(psd_ratelog *r, double now);

#endif
