/* log.c - timestamped or plain log lines on stderr, one write per line. */
#include "log.h"

#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static char g_ident[64] = "psd";          /* "ps0", "psrun[3]" */
static int g_level = PS_LOG_INFO;         /* most verbose level printed */
static ps__log_style g_style = PS_LOG_STAMPED;

void ps__log_init(const char *ident, int level, ps__log_style style) {
  snprintf(g_ident, sizeof g_ident, "%s", ident ? ident : "psd");
  g_level = level;
  g_style = style;
}

int ps__log_level_parse(const char *s) {
  static const char *const names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++)
    if (strcmp(s, names[i]) == 0) return i;
  return -1;
}

/* The line's prefix into line; its length. */
static int prefix(char *line, size_t cap, int level) {
  static const char *const lv[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  if (g_style == PS_LOG_PLAIN) return snprintf(line, cap, "%s: ", g_ident);
  struct timeval tv;
  gettimeofday(&tv, NULL);
  struct tm tm;
  gmtime_r(&tv.tv_sec, &tm);
  return snprintf(line, cap, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ %s [%s] ", tm.tm_year + 1900,
                  tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                  (int)(tv.tv_usec / 1000), lv[level < 0 ? 0 : level > 3 ? 3 : level], g_ident);
}

void ps__vlog(int level, const char *fmt, va_list ap) {
  if (level > g_level) return;
  char line[2048];
  int n = prefix(line, sizeof line, level);
  if (n > 0 && (size_t)n < sizeof line) n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof line - 1) n = (int)sizeof line - 2;
  line[n++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, (size_t)n);
  (void)w;
}

void ps__log(int level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  ps__vlog(level, fmt, ap);
  va_end(ap);
}
