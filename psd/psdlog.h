/* psdlog.h - psd's log lines: "2026-11-23T06:40:00.123Z INFO [ps0] text",
 * thin names over the shared writer (common/log.c, the stamped style). */
#ifndef PSD_LOG_H
#define PSD_LOG_H

#include "../common/log.h"

enum { PSD_LOG_ERROR = PS_LOG_ERROR, PSD_LOG_WARN = PS_LOG_WARN, PSD_LOG_INFO = PS_LOG_INFO,
       PSD_LOG_DEBUG = PS_LOG_DEBUG };

/* Sets the task identity printed on every line and the most verbose level
 * printed. ident is copied. */
#define psd_log_init(ident, level) ps__log_init((ident), (level), PS_LOG_STAMPED)
/* Parses "error|warn|info|debug"; -1 if unknown. */
#define psd_log_level_parse(s) ps__log_level_parse(s)
#define psd_log(...) ps__log(__VA_ARGS__)

#define psd_error(...) ps__log(PS_LOG_ERROR, __VA_ARGS__)
#define psd_warn(...) ps__log(PS_LOG_WARN, __VA_ARGS__)
#define psd_info(...) ps__log(PS_LOG_INFO, __VA_ARGS__)
#define psd_debug(...) ps__log(PS_LOG_DEBUG, __VA_ARGS__)

#endif
