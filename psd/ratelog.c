/* ratelog.c - at most PSD_RATELOG_BURST lines per window per kind, then a
 * count of what was left out. */
#include "ratelog.h"

#include <stdarg.h>

#include "log.h"

static void summary(psd_ratelog *r, double now) {
  if (!r->suppressed) return;
  psd_log(r->level, "suppressed %llu similar messages (%s) in the last %.1f s",
          (unsigned long long)r->suppressed, r->what, now - r->suppressed_since);
  r->suppressed = 0;
}

void psd_ratelog_flush(psd_ratelog *r, double now) {
  if (r->suppressed && now - r->window_at >= PSD_RATELOG_WINDOW_S) summary(r, now);
}

int psd_ratelog_say(psd_ratelog *r, double now, const char *fmt, ...) {
  r->total++;
  if (now - r->window_at >= PSD_RATELOG_WINDOW_S || now < r->window_at) {
    summary(r, now);
    r->window_at = now;
    r->in_window = 0;
  }
  if (r->in_window >= PSD_RATELOG_BURST) {
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
