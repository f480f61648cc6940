/* transfer.c - push and pull: gradients go out straight from the
 * variables' buffers (or rounded to a 16-bit wire dtype into the output
 * queue), in frames of at most PS__MAX_DATA bytes and
 * PS__MAX_ITEMS_PER_FRAME slices per server; parameters come back into
 * ps_var_data() as reader.c reads them (reply.c aims them). Nothing here
 * waits: callers wait through pump.c. */
#include <stdlib.h>

#include "client_internal.h"

static int scratch_items(ps_client *c, size_t n) {
  /* Per-slice scratch of one Push or Pull, grown together. */
  const ps__array arrays[] = {
      {(void **)&c->items, sizeof *c->items},
      {(void **)&c->itemp, sizeof *c->itemp},
      {(void **)&c->segdata, sizeof *c->segdata},
      {(void **)&c->segcount, sizeof *c->segcount},
      {(void **)&c->ids, sizeof *c->ids},
  };
  return ps__grow_all(arrays, sizeof arrays / sizeof arrays[0], &c->items_cap, n);
}

/* Slices of the chosen variables on ps p, in order: calls fn for each. */
#define FOR_SLICES(c, vars, n, p, s, body)                                 \
  do {                                                                     \
    size_t nv_ = (vars) ? (n) : (c)->nvars;                                \
    for (size_t vi_ = 0; vi_ < nv_; vi_++) {                               \
      ps_var *v_ = (vars) ? (vars)[vi_] : (c)->vars[vi_];                  \
      for (size_t si_ = 0; si_ < v_->n_slices; si_++) {                    \
        ps__slice *s = &(c)->slices[v_->first_slice + si_];                \
        if (s->ps != (uint32_t)(p)) continue;                              \
        body;                                                              \
      }                                                                    \
    }                                                                      \
  } while (0)

int ps__check_vars(ps_client *c, ps_var *const *vars, size_t n, int push) {
  int rc = 0;
  for (size_t i = 0; vars && i < n && !rc; i++) {
    if (!vars[i] || vars[i]->c != c)
      rc = ps__seterr(c, PS_EINVAL, "variable %zu does not belong to this client", i);
    else if (push && !vars[i]->trainable)
      rc = ps__seterr(c, PS_EINVAL,
                      "variable '%s' is not trainable (PS_OPT_NONE): it takes no gradients; "
                      "the chief sets its values with ps_client_var_assign", vars[i]->name);
    else if (vars[i]->mark)
      rc = ps__seterr(c, PS_EINVAL, "variable '%s' is listed twice", vars[i]->name);
    else
      vars[i]->mark = 1;
  }
  for (size_t i = 0; vars && i < n; i++)
    if (vars[i] && vars[i]->c == c) vars[i]->mark = 0;
  if (rc) return rc;
  for (int p = 0; p < c->num_ps; p++)
    if (c->conns[p].fd < 0)
      return ps__seterr(c, PS_ECLOSED, "connection to ps %d at %s is lost", p, c->conns[p].addr);
  return 0;
}

/* The wire dtype of v's push (push 1) or pull on ps p: the variable's,
 * else the client's; float32 for a server before 2.3, and with a ps whose
 * shared-memory segment this client uses (16-bit items travel over TCP
 * only, docs/protocol.md §1a: in memory, rounding costs what the copy it
 * halves does). */
static uint32_t wire_dtype(const ps_client *c, const ps_var *v, int p, int push) {
  if (c->conns[p].minor < 3 || c->conns[p].shm.map) return PS__DT_F32;
  int dv = push ? v->push_dtype : v->pull_dtype;
  return dv >= 0 ? (uint32_t)dv : push ? c->push_dtype : c->pull_dtype;
}

/* Queues a Push of the first k scratch items on ps p: float32 items are
 * sent from the gradients in place; if any item is 16-bit, the frame's
 * data (bytes) is encoded into the output queue's own buffer instead (the
 * gradients may change as soon as this returns). */
static int queue_push(ps_client *c, int p, const Ps__Push *m, size_t k, uint64_t bytes) {
  int any16 = 0;
  for (size_t i = 0; i < k; i++) any16 |= c->items[i].dtype != PS__DT_F32;
  if (!any16)
    return ps__queue_frame(c, &c->conns[p], PS__MSG_PUSH, &m->base, c->segdata, c->segcount, k);
  uint8_t *d = ps__outq_frame_inline(&c->conns[p].out, PS__MSG_PUSH, &m->base, bytes);
  if (!d) return ps__seterr(c, PS_ENOMEM, "out of memory queueing a %llu-byte push",
                            (unsigned long long)bytes);
  for (size_t i = 0; i < k; i++) {
    ps__wire_encode(c->items[i].dtype, d, c->segdata[i], c->segcount[i]);
    d += c->segcount[i] * ps__dtype_size(c->items[i].dtype);
  }
  return 0;
}

/* Queues one Push of the first k scratch items to ps p (released on error);
 * bytes: their wire bytes. */
static int push_frame(ps_client *c, ps_req *r, int p, uint64_t step, size_t k,
                      uint64_t bytes) {
  Ps__Push m = PS__PUSH__INIT;
  m.request_id = r->id;
  m.step = step;
  m.n_items = k;
  m.items = c->itemp;
  m.want_stop = c->stop_requested != 0;
  int rc = queue_push(c, p, &m, k, bytes);
  if (rc) {
    ps__req_release(c, r);
    return rc;
  }
  ps__req_expect(r, p, 1);
  ps__telem_bytes(&c->telem, p, 0, bytes);
  return 0;
}

int ps_client_push_async(ps_client *c, uint64_t step, ps_var *const *vars, size_t n,
                         ps_req **out) {
  if (!c) return PS_EINVAL;
  if (!out) return ps__seterr(c, PS_EINVAL, "ps_client_push_async: out is NULL");
  int rc = ps__check_vars(c, vars, n, 1);
  if (rc) return rc;
  if (scratch_items(c, c->nslices)) return ps__seterr(c, PS_ENOMEM, "out of memory");
  ps_req *r = ps__req_new(c, PS__REQ_PUSH);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  const float **dp = c->segdata;
  uint64_t *dc = c->segcount;
  for (int p = 0; p < c->num_ps; p++) {
    size_t k = 0;
    uint64_t bytes = 0;
    /* Slices of this ps, packed into frames of at most PS__MAX_DATA. */
    FOR_SLICES(c, vars, n, p, s, {
      if (!s->var->trainable) continue; /* all variables: the trainable ones */
      uint32_t dt = wire_dtype(c, s->var, p, 1);
      uint64_t wire = s->length * ps__dtype_size(dt);
      if (k && (bytes + wire > PS__MAX_DATA || k == PS__MAX_ITEMS_PER_FRAME ||
                (c->conns[p].shm.map && bytes >= PS__SHM_FRAME_BYTES))) {
        if ((rc = push_frame(c, r, p, step, k, bytes)) != 0) return rc;
        k = 0;
        bytes = 0;
      }
      ps__item__init(&c->items[k]);
      c->items[k].slice_id = s->remote_id;
      c->items[k].count = s->length;
      c->items[k].dtype = dt;
      c->itemp[k] = &c->items[k];
      dp[k] = s->var->grad + s->offset;
      dc[k] = s->length;
      bytes += wire;
      k++;
    });
    if (k && (rc = push_frame(c, r, p, step, k, bytes)) != 0) return rc;
    ps__conn_flush(c, &c->conns[p]);
  }
  if (r->pending == 0) ps__req_finish(c, r);
  *out = r;
  return 0;
}

/* Queues one Pull of the first k scratch ids to ps p, answered in dtype,
 * of the moving averages when r->average (released on error). */
static int pull_frame(ps_client *c, ps_req *r, int p, uint64_t min_step, size_t k,
                      uint32_t dtype) {
  Ps__Pull m = PS__PULL__INIT;
  m.request_id = r->id;
  m.average = r->average != 0;
  m.min_step = min_step;
  m.dtype = dtype;
  m.n_slice_ids = k;
  m.slice_ids = c->ids;
  m.timeout_ms = (uint32_t)c->request_timeout_ms;
  int rc = ps__queue_frame(c, &c->conns[p], PS__MSG_PULL, &m.base, NULL, NULL, 0);
  if (rc) {
    ps__req_release(c, r);
    return rc;
  }
  ps__req_expect(r, p, (int)k);
  return 0;
}

int ps_client_pull_async(ps_client *c, uint64_t min_step, ps_var *const *vars, size_t n,
                         ps_req **out) {
  if (!c) return PS_EINVAL;
  if (!out) return ps__seterr(c, PS_EINVAL, "ps_client_pull_async: out is NULL");
  int rc = ps__check_vars(c, vars, n, 0);
  if (rc) return rc;
  if (scratch_items(c, c->nslices)) return ps__seterr(c, PS_ENOMEM, "out of memory");
  ps_req *r = ps__req_new(c, PS__REQ_PULL);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  for (int p = 0; p < c->num_ps; p++) {
    /* All variables (vars NULL): the trainable ones at min_step, then the
     * others at 0, their latest values (their step counts assigns, not
     * training steps). Listed variables: all at min_step. A Pull names
     * one wire dtype: a pass per dtype the variables use. */
    for (int pass = 0; pass < 2 * PS__DT_COUNT_; pass++) {
      uint64_t ms = pass < PS__DT_COUNT_ ? min_step : 0;
      uint32_t dt = (uint32_t)(pass % PS__DT_COUNT_);
      size_t k = 0;
      FOR_SLICES(c, vars, n, p, s, {
        int first = pass < PS__DT_COUNT_;
        if (vars ? !first : first != (s->var->trainable != 0)) continue;
        if (wire_dtype(c, s->var, p, 0) != dt) continue;
        c->ids[k++] = s->remote_id;
        if (k == PS__MAX_ITEMS_PER_FRAME) {
          if ((rc = pull_frame(c, r, p, ms, k, dt)) != 0) return rc;
          k = 0;
        }
      });
      if (k && (rc = pull_frame(c, r, p, ms, k, dt)) != 0) return rc;
    }
    ps__conn_flush(c, &c->conns[p]);
  }
  if (r->pending == 0) ps__req_finish(c, r);
  *out = r;
  return 0;
}


int ps__pull_average_send(ps_client *c, ps_req *r, ps_var *const *vars, size_t n) {
  int rc;
  if (scratch_items(c, c->nslices)) {
    ps__req_release(c, r);
    return ps__seterr(c, PS_ENOMEM, "out of memory");
  }
  for (int p = 0; p < c->num_ps; p++) {
    size_t k = 0;
    FOR_SLICES(c, vars, n, p, s, {
      c->ids[k++] = s->remote_id;
      if (k == PS__MAX_ITEMS_PER_FRAME) {
        if ((rc = pull_frame(c, r, p, 0, k, PS__DT_F32)) != 0) return rc;
        k = 0;
      }
    });
    if (k && (rc = pull_frame(c, r, p, 0, k, PS__DT_F32)) != 0) return rc;
    ps__conn_flush(c, &c->conns[p]);
  }
  return 0;
}
