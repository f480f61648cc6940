/* errmsg.c - the client's last error: the one place that formats it and
 * the public accessor. It sits at the bottom of the client's files so that
 * every other file can record an error without calling back up. */
#include <stdarg.h>
#include <stdio.h>

#include "client_internal.h"

int ps__seterr(ps_client *c, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->errmsg, sizeof c->errmsg, fmt, ap);
  va_end(ap);
  return code;
}

const char *ps_client_errmsg(const ps_client *c) { return c ? c->errmsg : "no client"; }
