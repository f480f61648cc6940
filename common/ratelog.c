/* ratelog.c - at most `burst` lines per window per kind, then a count of
 * what was left out. */
#include "ratelog.h"

#include <stdarg.h>

#include "log.h"

static double window_of(const ps__ratelog *r) {
  return r->window_s > 0 ? r->window_s : PS__RATELOG_WINDOW_S;
}

static void summary(ps__ratelog *r, double now) {
  if (!r->suppressed) return;
  ps__log(r->level, "suppressed %llu similar messages (%s) in the last %.1f s",
          (unsigned long long)r->suppressed, r->what, now - r->suppressed_since);
  r->suppressed = 0;
}

void ps__ratelog_flush(ps__ratelog *r, double now, int force) {
  if (r->suppressed && (force || now - r->window_at >= window_of(r))) summary(r, now);
}

int ps__ratelog_say(ps__ratelog *r, double now, const char *fmt, ...) {
  r->total++;
  if (now - r->window_at >= window_of(r) || now < r->window_at) {
    summary(r, now);
    r->window_at = now;
    r->in_window = 0;
  }
  if (r->in_window >= (r->burst ? r->burst : PS__RATELOG_BURST)) {
    if (!r->suppressed) r->suppressed_since = now;
    r->suppressed++;
    return 0;
  }
  r->in_window++;
  va_list ap;
  va_start(ap, fmt);
  ps__vlog(r->level, fmt, ap);
  va_end(ap);
  return 1;
}
