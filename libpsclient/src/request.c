/* request.c - the table of in-flight requests, nothing more. Replies name
 * their request by id; the table finds it in one probe (slot = id &
 * (cap - 1)) instead of walking a list, which matters when a step has a
 * frame per slice in flight. Waiting for a request drives the connections,
 * so it lives above them, in pump.c; this file calls no other. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

/* Doubles the table (or makes the first one). Ids distinct modulo the old
 * capacity stay distinct modulo the new one, so rehashing never collides. */
static int table_grow(ps__req_table *t) {
  size_t nc = t->cap ? t->cap * 2 : 64;
  ps_req **ns = calloc(nc, sizeof *ns);
  if (!ns) return -1;
  for (size_t i = 0; i < t->cap; i++)
    if (t->slot[i]) ns[t->slot[i]->id & (nc - 1)] = t->slot[i];
  free(t->slot);
  t->slot = ns;
  t->cap = nc;
  return 0;
}

ps_req *ps__req_find(ps_client *c, uint64_t id) {
  ps__req_table *t = &c->reqs;
  if (!t->cap || !id) return NULL;
  ps_req *r = t->slot[id & (t->cap - 1)];
  return r && r->id == id ? r : NULL; /* the id is the generation check */
}

void ps__req_each(ps_client *c, void (*fn)(ps_client *, ps_req *, void *), void *arg) {
  for (size_t i = 0; i < c->reqs.cap; i++)
    if (c->reqs.slot[i]) fn(c, c->reqs.slot[i], arg);
}

ps_req *ps__req_new(ps_client *c, int type) {
  ps__req_table *t = &c->reqs;
  /* At most half full, so a free slot is always near. */
  if ((t->n + 1) * 2 > t->cap && table_grow(t)) return NULL;
  ps_req *r = c->freelist;
  if (r) c->freelist = r->next;
  else r = calloc(1, sizeof *r);
  if (!r) return NULL;
  int *pend = r->pend_ps;
  if (!pend) pend = malloc((size_t)c->num_ps * sizeof *pend);
  if (!pend) {
    free(r);
    return NULL;
  }
  memset(pend, 0, (size_t)c->num_ps * sizeof *pend);
  memset(r, 0, sizeof *r);
  r->pend_ps = pend;
  r->c = c;
  r->type = type;
  /* Skip ids whose slot a longer-lived request still holds (0 is "none"). */
  do r->id = ++c->next_id;
  while (!r->id || t->slot[r->id & (t->cap - 1)]);
  r->step = UINT64_MAX;
  r->step_nt = UINT64_MAX;
  t->slot[r->id & (t->cap - 1)] = r;
  t->n++;
  return r;
}

void ps__req_finish(ps_client *c, ps_req *r) {
  ps__req_table *t = &c->reqs;
  r->done = 1;
  if (t->cap && t->slot[r->id & (t->cap - 1)] == r) {
    t->slot[r->id & (t->cap - 1)] = NULL;
    t->n--;
  }
}

void ps__req_fail(ps_client *c, ps_req *r, int code, const char *msg) {
  if (!r->status) {
    r->status = code;
    snprintf(c->errmsg, sizeof c->errmsg, "%s", msg);
    snprintf(r->msg, sizeof r->msg, "%s", msg);
  }
  ps__req_finish(c, r);
}

void ps__req_release(ps_client *c, ps_req *r) {
  if (!r->done) ps__req_finish(c, r);
  /* A table pull's rows: a connection still reading into them notices the
   * request is gone and discards the rest (reader.c) at its next read, so
   * the block is free to keep: the next pull reuses it rather than fault
   * in fresh pages (one block: the newest; tablexfer.c drops it when far
   * bigger than a pull needs). */
  if (r->tp) {
    free(c->tp_keep);
    c->tp_keep = r->tp;
  }
  r->tp = NULL;
  r->next = c->freelist;
  c->freelist = r;
}

void ps__req_expect(ps_req *r, int p, int n) {
  r->pending += n;
  r->pend_ps[p] += n;
}

void ps__req_answered(ps_client *c, ps_req *r, int p, int n) {
  r->pending -= n;
  r->pend_ps[p] -= n;
  if (r->pending <= 0) ps__req_finish(c, r);
}

void ps__req_free_all(ps_client *c) {
  for (size_t i = 0; i < c->reqs.cap; i++) {
    ps_req *r = c->reqs.slot[i];
    if (!r) continue;
    free(r->tp);
    free(r->pend_ps);
    free(r);
  }
  free(c->reqs.slot);
  free(c->tp_keep);
  c->tp_keep = NULL;
  c->reqs.slot = NULL;
  c->reqs.cap = c->reqs.n = 0;
  while (c->freelist) {
    ps_req *r = c->freelist;
    c->freelist = r->next;
    free(r->pend_ps);
    free(r);
  }
}
