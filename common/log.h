/*
 * log.h - the one log writer of psd and psrun: one write(2) per line on
 * stderr, so lines of processes sharing a terminal never interleave. Two
 * styles of line:
 *   PS_LOG_STAMPED  "2026-11-23T06:40:00.123Z INFO [ps0] text"   (psd)
 *   PS_LOG_PLAIN    "psrun[3]: text"                             (psrun)
 */
#ifndef PS_COMMON_LOG_H
#define PS_COMMON_LOG_H

#include <stdarg.h>

enum { PS_LOG_ERROR = 0, PS_LOG_WARN = 1, PS_LOG_INFO = 2, PS_LOG_DEBUG = 3 };
typedef enum ps__log_style { PS_LOG_STAMPED = 0, PS_LOG_PLAIN = 1 } ps__log_style;

/* Sets the identity printed on every line (copied), the most verbose level
 * printed and the style. Before any call: "psd", info, stamped. */
void ps__log_init(const char *ident, int level, ps__log_style style);
/* Parses "error|warn|info|debug"; -1 if unknown. */
int ps__log_level_parse(const char *s);
void ps__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ps__vlog(int level, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

#endif
