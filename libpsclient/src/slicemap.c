/* slicemap.c - per server, the map from that server's slice ids to our
 * slices. Replies name slices by the server's ids; reply.c looks them up
 * here and var.c records and forgets them, so the map is its own file below
 * both (reply.c must not call up into var.c). The map stores indices into
 * c->slices, which stay valid when that array is reallocated. */
#include <stdlib.h>

#include "client_internal.h"

ps__slice *ps__slice_by_remote(ps_client *c, int p, uint32_t id) {
  const ps__remote_map *m = &c->by_remote[p];
  if (id >= m->cap || m->idx[id] == PS__NO_SLICE || m->idx[id] >= c->nslices) return NULL;
  return &c->slices[m->idx[id]];
}

int ps__remote_set(ps_client *c, int p, uint32_t id, size_t si) {
  ps__remote_map *m = &c->by_remote[p];
  /* A server holds fewer than PS__MAX_SLICES slices: a bigger id would
   * size the map from what the server says, not from what we registered. */
  if (id >= PS__MAX_SLICES || si >= PS__NO_SLICE) return PS_EPROTO;
  if (id >= m->cap) {
    size_t old = m->cap;
    if (ps__grow((void **)&m->idx, &m->cap, (size_t)id + 1, sizeof *m->idx)) return PS_ENOMEM;
    for (size_t i = old; i < m->cap; i++) m->idx[i] = PS__NO_SLICE;
  }
  m->idx[id] = (uint32_t)si;
  return 0;
}

void ps__remote_forget(ps_client *c, int p, uint32_t id, size_t si) {
  ps__remote_map *m = &c->by_remote[p];
  /* Only while it names si: an id the slice never received (PS__NO_SLICE
   * lies beyond any cap) or one now naming another slice stays as it is. */
  if (id < m->cap && m->idx[id] == si) m->idx[id] = PS__NO_SLICE;
}

void ps__remote_free(ps_client *c) {
  for (int i = 0; c->by_remote && i < c->num_ps; i++) free(c->by_remote[i].idx);
  free(c->by_remote);
  c->by_remote = NULL;
}
