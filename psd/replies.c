/* replies.c - answering parked pulls (see replies.h). */
#include "replies.h"

#include <stdio.h>
#include <string.h>

#include "optimizer.h"

/* A PullReply of n items (bytes of parameters, in c->reply_data) through
 * c's pull ring, when c has a segment with room: the parameters are
 * copied into the ring now (so no update waits for them) and the frame
 * carries their position. 1 (queued), 0 (no segment or no room: send it
 * over TCP) or -1 (out of memory). The worker's done word decides the
 * room; a worker that lies there can only get its own replies
 * overwritten, and psd never writes outside the ring. */
static int send_pull_shm(psd_conn *c, const Ps__PullReply *r, size_t n, uint64_t bytes) {
  if (!c->shm.map || bytes == 0) return 0;
  uint64_t pos;
  uint8_t *dst = ps__shm_reserve(&c->shm.pull, ps__shm_load(c->shm.pull_done), bytes, &pos);
  if (!dst) return 0;
  for (size_t i = 0; i < n; i++) {
    size_t len = (size_t)c->reply_count[i] * sizeof(float);
    memcpy(dst, c->reply_data[i], len);
    dst += len;
  }
  return ps__outq_frame_shm(&c->out, PS__MSG_PULL_REPLY, &r->base, bytes, pos) == 0 ? 1 : -1;
}

/* Sets c's reply item n: slice sl, its `data` (parameters or average)
 * in dtype. */
static void reply_item(psd_conn *c, size_t n, const psd_slice *sl, const float *data,
                       uint32_t dtype) {
  Ps__Item *it = &c->reply_items[n];
  ps__item__init(it);
  it->slice_id = sl->id;
  it->count = sl->length;
  it->step = sl->step;
  it->dtype = dtype;
  c->reply_ptrs[n] = it;
  c->reply_data[n] = data;
  c->reply_count[n] = sl->length;
}

/* A PullReply of c's first n reply items, with the persist flags. */
static Ps__PullReply reply_head(psd_handlers *h, psd_conn *c, uint64_t req, size_t n) {
  Ps__PullReply r = PS__PULL_REPLY__INIT;
  r.request_id = req;
  r.n_items = n;
  r.items = c->reply_ptrs;
  psd_persist_flags(h->persist, &r.want_checkpoint, &r.want_stop, &r.stop_step, &r.stopped);
  return r;
}

/* Queues r with its n items' data (bytes in dtype) encoded into c's
 * output queue: a copy, which no later update can change. 0 or -1. */
static int send_inline(psd_conn *c, const Ps__PullReply *r, size_t n, uint32_t dtype,
                       uint64_t bytes) {
  uint8_t *d = ps__outq_frame_inline(&c->out, PS__MSG_PULL_REPLY, &r->base, bytes);
  if (!d) return -1;
  for (size_t i = 0; i < n; i++) {
    ps__wire_encode(dtype, d, c->reply_data[i], c->reply_count[i]);
    d += c->reply_count[i] * ps__dtype_size(dtype);
  }
  return 0;
}

/* Queues a PullReply of c's first n reply items (bytes of data in dtype):
 * float32 through c's pull ring if it has room, else from the slices in
 * place; 16-bit (TCP only, §1a) encoded into the output queue. 0 or -1. */
static int send_pull_reply(psd_handlers *h, psd_conn *c, uint64_t req, size_t n,
                           uint32_t dtype, uint64_t bytes) {
  Ps__PullReply r = reply_head(h, c, req, n);
  if (dtype == PS__DT_F32) {
    int sent = send_pull_shm(c, &r, n, bytes);
    if (sent != 0) return sent > 0 ? 0 : -1;
    if (c->shm.map && bytes) psd_telem_shm_tcp(h->telem, c->worker); /* pull ring full */
    return psd_conn_send(c, PS__MSG_PULL_REPLY, &r.base, c->reply_data, c->reply_count,
                         c->reply_refs, n);
  }
  return send_inline(c, &r, n, dtype, bytes);
}

static void flush_conn(psd_handlers *h, psd_conn *c) {
  if (c->dead) return;
  psd_shard *sh = h->shard;
  psd_waiter *w = psd_waiters_take_ready(&c->waits);
  while (w) {
    /* One PullReply per run of waiters of the same request and dtype (at
     * most one waiter per slice, so reply_cap entries always suffice),
     * split so no frame carries more than PS__MAX_DATA. */
    uint64_t req = w->request_id;
    uint32_t dtype = w->dtype;
    uint64_t esize = ps__dtype_size(dtype);
    size_t n = 0;
    uint64_t bytes = 0;
    while (w && w->request_id == req && w->dtype == dtype && n < c->reply_cap &&
           n < PS__MAX_ITEMS_PER_FRAME) {
      psd_slice *sl = sh->slices[w->slice_id];
      if (n && bytes + sl->length * esize > PS__MAX_DATA) break; /* next frame */
      bytes += sl->length * esize;
      reply_item(c, n, sl, sl->param, dtype);
      c->reply_refs[n] = sl;
      n++;
      psd_waiter *next = w->ready_next;
      psd_waiters_answered(w);
      w = next;
    }
    if (send_pull_reply(h, c, req, n, dtype, bytes) != 0) {
      psd_conn_error(c, req, PS_ENOMEM, 1, "out of memory building a pull reply");
      return;
    }
    psd_telem_sent(h->telem, c->worker, bytes);
  }
}

/* An average pull's refusal: 0 and a non-fatal Error if every slice of
 * m keeps an initialized average, else -1 (the Error is queued). */
static int check_average_pull(psd_handlers *h, psd_conn *c, const Ps__Pull *m) {
  if (h->cfg->protocol_minor < 7) {
    /* --protocol-minor below 7 acts as a 2.6 psd that knew no such flag
     * would have to; the client checks the minor first and never sends it. */
    psd_conn_error(c, m->request_id, PS_EUNSUPPORTED, 0,
                   "a pull of moving averages needs protocol 2.7; this psd speaks 2.%d",
                   h->cfg->protocol_minor);
    return -1;
  }
  for (size_t i = 0; i < m->n_slice_ids; i++) {
    const psd_slice *sl = h->shard->slices[m->slice_ids[i]];
    if (sl->opt.average == PS_AVERAGE_NONE) {
      psd_conn_error(c, m->request_id, PS_EINVAL, 0,
                     "variable '%s' keeps no moving average (its optimizer's average is none): "
                     "create it with one to pull an average, or pull its parameters",
                     PS__ESC(sl->name));
      return -1;
    }
    if (!sl->initialized) {
      psd_conn_error(c, m->request_id, PS_ESTATE, 0,
                     "variable '%s' has no average yet: it is not initialized",
                     PS__ESC(sl->name));
      return -1;
    }
  }
  return 0;
}

int psd_replies_pull_average(psd_handlers *h, psd_conn *c, const Ps__Pull *m) {
  if (check_average_pull(h, c, m) != 0) return 0;
  const uint32_t dtype = m->dtype;
  const uint64_t esize = ps__dtype_size(dtype);
  /* Answered at once, copied into the output queue: evaluation reads the
   * average now, and no update has to detach it from a slow reader. */
  for (size_t i = 0; i < m->n_slice_ids;) {
    size_t n = 0;
    uint64_t bytes = 0;
    while (i + n < m->n_slice_ids && n < c->reply_cap && n < PS__MAX_ITEMS_PER_FRAME) {
      psd_slice *sl = h->shard->slices[m->slice_ids[i + n]];
      if (n && bytes + sl->length * esize > PS__MAX_DATA) break; /* next frame */
      bytes += sl->length * esize;
      reply_item(c, n, sl, psd_opt_average(&sl->opt, sl->state, sl->length), dtype);
      n++;
    }
    Ps__PullReply r = reply_head(h, c, m->request_id, n);
    if (send_inline(c, &r, n, dtype, bytes) != 0) {
      psd_conn_error(c, m->request_id, PS_ENOMEM, 1, "out of memory building a pull reply");
      return -1;
    }
    psd_telem_sent(h->telem, c->worker, bytes);
    i += n;
  }
  return 0;
}

void psd_replies_pull_expired(void *ctx, psd_waitset *set, const psd_waiter *w) {
  psd_handlers *h = ctx;
  psd_conn *c = set->owner;
  const psd_slice *sl = h->shard->slices[w->slice_id];
  psd_conn_error(c, w->request_id, PS_ETIMEDOUT, 0,
                 "pull of '%s' for step >= %llu timed out (the slice is at step %llu)",
                 PS__ESC(sl->name), (unsigned long long)w->min_step,
                 (unsigned long long)sl->step);
}

void psd_replies_flush(psd_handlers *h) {
  psd_waitset *set;
  while ((set = psd_waiters_next_dirty(h->waiters))) {
    psd_conn *c = set->owner;
    flush_conn(h, c);
    psd_conn_write(c); /* may close c (freed later, by psd_conns_reap) */
  }
}
