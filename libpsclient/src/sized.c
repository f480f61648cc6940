/* sized.c - the public configuration structs carry their size (first
 * field), so fields can be added at the end without breaking programs
 * built against an older psclient.h: the library reads what the caller's
 * size covers and defaults the rest. */
#include <stdio.h>
#include <string.h>

#include "client_internal.h"

int ps__sized_read(void *dst, size_t lib_size, const void *src, size_t v1_size,
                   const char *type, char *err, size_t errlen) {
  size_t size;
  memcpy(&size, src, sizeof size);
  if (size == 0) {
    snprintf(err, errlen,
             "%s.struct_size is 0: initialize it with %s_init() (or PS_SIZED) before "
             "setting its fields", type, type);
    return PS_EINVAL;
  }
  if (size < v1_size) {
    snprintf(err, errlen,
             "%s.struct_size %zu is smaller than any %s layout (%zu bytes): initialize it "
             "with %s_init()", type, size, type, v1_size, type);
    return PS_EINVAL;
  }
  /* A newer caller: fine as long as it left the fields we lack at their
   * zero defaults (its init function zeroed them). */
  const unsigned char *b = src;
  for (size_t i = lib_size; i < size; i++)
    if (b[i]) {
      snprintf(err, errlen,
               "%s sets fields this libpsclient %d.%d.%d does not know (the program was "
               "built against a newer psclient.h)", type, PS_VERSION_MAJOR, PS_VERSION_MINOR,
               PS_VERSION_PATCH);
      return PS_EUNSUPPORTED;
    }
  memcpy(dst, src, size < lib_size ? size : lib_size);
  memcpy(dst, &lib_size, sizeof lib_size); /* dst is the library's layout */
  return 0;
}

#define PS__STR(x) #x
#define PS__XSTR(x) PS__STR(x)
const char *ps_version(void) {
  return PS__XSTR(PS_VERSION_MAJOR) "." PS__XSTR(PS_VERSION_MINOR) "." PS__XSTR(PS_VERSION_PATCH);
}

void ps_config_init_sized(ps_config *cfg, size_t size) {
  if (!cfg || size < sizeof cfg->struct_size) return;
  memset(cfg, 0, size); /* every field's default is 0 / NULL */
  cfg->struct_size = size;
}
