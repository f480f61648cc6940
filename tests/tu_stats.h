/* tu_stats.h - psd's Stats (psctl's exchange) for the client suites that
 * check psd's own counters; linked with psrun/admin.c (client_tests). */
#ifndef PS_TU_STATS_H
#define PS_TU_STATS_H

#include <stdint.h>

#include "admin.h"
#include "testutil.h"

/* psd p's Stats, asked with no secret (a test's psd has none); fails the
 * test when p does not answer. Free with ps__stats_reply__free_unpacked. */
Ps__StatsReply *tu_stats(const tu_psd *p);

/* Bytes psd took from worker w (*in) and sent it (*out), summed over
 * ps[0..n) (psd counts a frame's data: gradients, rows, keys). */
void tu_worker_bytes(const tu_psd *ps, int n, int w, uint64_t *in, uint64_t *out);

#endif
