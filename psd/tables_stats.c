/* tables_stats.c - what psctl sees of this server's tables (tables.h):
 * each table's counters, step and bytes, as TableStats. */
#include "tables.h"

#include <stdlib.h>

int psd_tables_stats(const psd_tables *ts, Ps__TableStats ***out, size_t *n_out) {
  *out = NULL;
  *n_out = 0;
  if (!ts->n) return 0;
  Ps__TableStats **v = calloc(ts->n, sizeof *v);
  if (!v) return PS_ENOMEM;
  for (uint32_t i = 0; i < ts->n; i++) {
    const psd_table *t = ts->v[i].t;
    const psd_table_spec *sp = psd_table_spec_of(t);
    psd_table_stats st = psd_table_get_stats(t);
    Ps__TableStats *s = malloc(sizeof *s);
    if (!s) {
      psd_tables_stats_free(v, i);
      return PS_ENOMEM;
    }
    ps__table_stats__init(s);
    s->name = (char *)sp->name;
    s->dim = sp->dim;
    s->step = psd_table_step(t);
    s->rows = st.rows;
    s->capacity = sp->capacity;
    s->keys_pulled = st.keys_pulled;
    s->keys_pushed = st.keys_pushed;
    s->hits = st.hits;
    s->admissions = st.admissions;
    s->evictions_lru = st.evictions_lru;
    s->evictions_ttl = st.evictions_ttl;
    s->dropped = st.dropped;
    s->bytes = psd_table_bytes_now(t);
    s->touches_skipped = psd_table_touch_skips(t);
    v[i] = s;
  }
  *out = v;
  *n_out = ts->n;
  return 0;
}

void psd_tables_stats_free(Ps__TableStats **v, size_t n) {
  for (size_t i = 0; i < n; i++) free(v[i]);
  free(v);
}
