/* tu_stats.c - psd's Stats for the client suites (tu_stats.h). */
#include "tu_stats.h"

#include <check.h>

Ps__StatsReply *tu_stats(const tu_psd *p) {
  ps__auth au = {NULL, 0, 0, NULL, 0, 0};
  Ps__StatsReply *r = NULL;
  char err[600];
  int rc = ps__admin_stats(p->addr, &au, 5000, &r, err, sizeof err);
  ck_assert_msg(rc == 0, "stats of psd at %s: %s", p->addr, err);
  return r;
}

void tu_worker_bytes(const tu_psd *ps, int n, int w, uint64_t *in, uint64_t *out) {
  *in = *out = 0;
  for (int i = 0; i < n; i++) {
    Ps__StatsReply *r = tu_stats(&ps[i]);
    for (size_t j = 0; j < r->n_workers; j++) {
      if (r->workers[j]->worker != (uint32_t)w) continue;
      *in += r->workers[j]->bytes_in;
      *out += r->workers[j]->bytes_out;
    }
    ps__stats_reply__free_unpacked(r, NULL);
  }
}
