/* log.c - timestamped, leveled log lines on stderr, one write per line so
 * lines from several processes sharing a terminal never interleave. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static char g_ident[64] = "psd";  /* task identity, e.g. "ps0" */
static int g_level = PSD_LOG_INFO; /* most verbose level printed */

void psd_log_init(const char *ident, int level) {
  snprintf(g_ident, sizeof g_ident, "%s", ident ? ident : "psd");
  g_level = level;
}

int psd_log_level_parse(const char *s) {
  static const char *const names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++)
    if (strcmp(s, names[i]) == 0) return i;
  return -1;
}

void psd_log(int level, const char *fmt, ...) {
  static const char *const lv[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  if (level > g_level) return;
  char line[2048];
  struct timeval tv;
  gettimeofday(&tv, NULL);
  struct tm tm;
  gmtime_r(&tv.tv_sec, &tm);
  int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ %s [%s] ",
                   tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                   tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000),
                   lv[level < 0 ? 0 : level > 3 ? 3 : level], g_ident);
  va_list ap;
  va_start(ap, fmt);
  if (n > 0 && (size_t)n < sizeof line)
    n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof line - 1) n = (int)sizeof line - 2;
  line[n++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, (size_t)n);
  (void)w;
}
