/*
 * ps/version.h - the version of the headers (PS_VERSION_*) and of the
 * library actually loaded (ps_version). docs/abi.md says what each means.
 */
#ifndef PS_VERSION_H
#define PS_VERSION_H

#include "ps/export.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PS_VERSION_MAJOR 0
#define PS_VERSION_MINOR 2
#define PS_VERSION_PATCH 8

/* "MAJOR.MINOR.PATCH" of the library actually loaded, which may be newer
 * than the PS_VERSION_* a program was built with. Added in 0.2.6. */
PS_EXTERN const char *ps_version(void);

#ifdef __cplusplus
}
#endif

#endif /* PS_VERSION_H */
