/*
 * admin.h - the admin side of the protocol: one authenticated Stats
 * exchange with a running psd, for psctl and for psrun (which workers psd
 * never saw finish). Lives with them, not in the workers' library: no
 * worker ever asks a server for its counters.
 */
#ifndef PSR_ADMIN_H
#define PSR_ADMIN_H

#include <stddef.h>

#include "wire.h"

struct Ps__StatsReply;
/* Connects to the psd at addr as ROLE_ADMIN, authenticated with auth, and
 * asks for its counters. *out is freed with ps__stats_reply__free_unpacked.
 * 0 or a PS_E* code with err. */
int ps__admin_stats(const char *addr, const ps__auth *auth, int timeout_ms,
                    struct Ps__StatsReply **out, char *err, size_t errlen);

#endif /* PSR_ADMIN_H */
