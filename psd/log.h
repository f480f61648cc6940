/* log.h - psd's log lines: "2026-11-23T06:40:00.123Z INFO [ps0] text". */
#ifndef PSD_LOG_H
#define PSD_LOG_H

enum { PSD_LOG_ERROR = 0, PSD_LOG_WARN = 1, PSD_LOG_INFO = 2, PSD_LOG_DEBUG = 3 };

/* Sets the task identity printed on every line and the most verbose level
 * printed. ident is copied. */
void psd_log_init(const char *ident, int level);
/* Parses "error|warn|info|debug"; -1 if unknown. */
int psd_log_level_parse(const char *s);
void psd_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define psd_error(...) psd_log(PSD_LOG_ERROR, __VA_ARGS__)
#define psd_warn(...) psd_log(PSD_LOG_WARN, __VA_ARGS__)
#define psd_info(...) psd_log(PSD_LOG_INFO, __VA_ARGS__)
#define psd_debug(...) psd_log(PSD_LOG_DEBUG, __VA_ARGS__)

#endif
