/* reply.c - what each reply from a server does: finishes or fails its
 * request, records the server's slice ids, aims a PullReply's data at the
 * variables, and notes the checkpoint/stop flags replies carry. reader.c
 * calls in here with each complete protobuf part; this file only calls
 * down (connections, the request table, the slice map), never the reader
 * or the pump, so handling a reply can not re-enter reading. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

/* Sink size for PullReply data nobody waits for any more. */
#define PS__DISCARD_BYTES 65536u

/* Every id and size a server sends is checked before it indexes or sizes
 * anything here: a broken or hostile server fails its connection
 * (ps__proto_err), it never makes the client allocate or write out of
 * place. */

/* Aims the rest of the frame's data at a discard sink. */
static int plan_discard(ps__conn *k, uint64_t total) {
  if (k->discard_cap < PS__DISCARD_BYTES) {
    free(k->discard);
    k->discard = malloc(PS__DISCARD_BYTES);
    k->discard_cap = k->discard ? PS__DISCARD_BYTES : 0;
    if (!k->discard) return PS_ENOMEM;
  }
  for (uint64_t left = total; left > 0;) {
    size_t n = left > k->discard_cap ? k->discard_cap : (size_t)left;
    if (ps__grow((void **)&k->dst, &k->capdst, k->ndst + 1, sizeof *k->dst)) return PS_ENOMEM;
    k->dst[k->ndst].iov_base = k->discard;
    k->dst[k->ndst].iov_len = n;
    k->ndst++;
    left -= n;
  }
  return 0;
}

/* Checks a PullReply's items against our slices and sums their wire bytes
 * (*total) and those of 16-bit items (*b16). 0 or <0 (k broken). */
static int check_pull_items(ps_client *c, ps__conn *k, const Ps__PullReply *m,
                            uint64_t *total, uint64_t *b16) {
  *total = *b16 = 0;
  for (size_t i = 0; i < m->n_items; i++) {
    const Ps__Item *it = m->items[i];
    ps__slice *s = ps__slice_by_remote(c, k->index, it->slice_id);
    char e[200];
    if (!s || it->count != s->length) {
      snprintf(e, sizeof e, "it sent %llu values for slice id %u, which %s",
               (unsigned long long)it->count, it->slice_id,
               s ? "has another length" : "we never registered with it");
      return ps__proto_err(c, k, e);
    }
    if (!ps__dtype_valid(it->dtype)) {
      snprintf(e, sizeof e, "it sent slice id %u in unknown wire dtype %u", it->slice_id,
               it->dtype);
      return ps__proto_err(c, k, e);
    }
    uint64_t b = it->count * ps__dtype_size(it->dtype); /* count checked: no overflow */
    *total += b;
    if (it->dtype != PS__DT_F32) *b16 += b;
  }
  if (*total != k->hdr.data_len) {
    char e[200];
    snprintf(e, sizeof e, "a pull reply carries %llu data bytes but its items take %llu",
             (unsigned long long)k->hdr.data_len, (unsigned long long)*total);
    return ps__proto_err(c, k, e);
  }
  return 0;
}

/* Sets up where a PullReply's data goes (or a discard sink when r is NULL):
 * float32 items straight into the variables, 16-bit ones into k->wire16,
 * widened into them once the data is in (ps__pull_data_done). */
static int plan_pull_data(ps_client *c, ps__conn *k, const Ps__PullReply *m, ps_req *r) {
  k->ndst = 0;
  k->nwiden = 0;
  uint64_t total, b16;
  int rc = check_pull_items(c, k, m, &total, &b16);
  if (rc) return rc;
  if (ps__grow((void **)&k->dst, &k->capdst, m->n_items + 1, sizeof *k->dst) ||
      (r && b16 && (ps__grow((void **)&k->wire16, &k->wire16_cap, (size_t)b16, 1) ||
                    ps__grow((void **)&k->widen, &k->capwiden, m->n_items, sizeof *k->widen))))
    return PS_ENOMEM;
  uint64_t off = 0;
  for (size_t i = 0; r && i < m->n_items; i++) {
    const Ps__Item *it = m->items[i];
    ps__slice *s = ps__slice_by_remote(c, k->index, it->slice_id);
    float *dst = s->var->data + s->offset;
    if (it->dtype == PS__DT_F32) {
      k->dst[k->ndst].iov_base = dst;
      k->dst[k->ndst].iov_len = s->length * sizeof(float);
    } else {
      k->widen[k->nwiden++] = (ps__widen){dst, off, s->length, it->dtype};
      k->dst[k->ndst].iov_base = k->wire16 + off;
      k->dst[k->ndst].iov_len = s->length * ps__dtype_size(it->dtype);
      off += k->dst[k->ndst].iov_len;
    }
    k->ndst++;
    uint64_t *st = s->var->trainable ? &r->step : &r->step_nt;
    if (it->step < *st) *st = it->step;
  }
  /* Nobody waits for it any more (failed or abandoned): read and drop. */
  if (!r && total && plan_discard(k, total)) return PS_ENOMEM;
  k->dst_i = 0;
  k->dst_got = 0;
  return 0;
}

/* The checkpoint and stop state every Push/PullReply carries, from k. */
static void note_flags(ps_client *c, ps__conn *k, int want_ckpt, int want_stop, int stopped,
                       uint64_t stop_step) {
  if (want_ckpt) c->want_ckpt = 1;
  if (want_stop) c->want_stop = 1;
  if (stopped && !k->stopped) {
    k->stopped = 1;
    c->stop_step = stop_step;
  }
}

/* Each on_* handles one unpacked reply: 0, or <0 when k was broken. */

static int on_error(ps_client *c, ps__conn *k, const Ps__Error *m) {
  char msg[700];
  snprintf(msg, sizeof msg, "ps %d at %s: %s", k->index, k->addr,
           m->message ? m->message : "error");
  ps_req *r = m->request_id ? ps__req_find(c, m->request_id) : NULL;
  int code = m->code < 0 ? m->code : PS_EPROTO;
  /* A non-fatal error for a request we no longer wait for (it failed on
   * another server, or timed out here first) needs no action. */
  if (r) ps__req_fail(c, r, code, msg);
  if (!m->fatal) return 0;
  ps__conn_break(c, k, code, msg);
  snprintf(c->errmsg, sizeof c->errmsg, "%s", msg);
  return code;
}

static int on_ack(ps_client *c, ps__conn *k, const Ps__Ack *m) {
  ps_req *r = ps__req_find(c, m->request_id);
  if (r) ps__req_answered(c, r, k->index, 1);
  return 0;
}

/* The server's ids for the variable's slices on k, in request order. */
static int on_register_reply(ps_client *c, ps__conn *k, const Ps__RegisterReply *m) {
  ps_req *r = ps__req_find(c, m->request_id);
  if (!r) return 0;
  ps_var *v = r->reg_var;
  size_t n = 0;
  for (size_t i = 0; v && i < v->n_slices; i++)
    n += c->slices[v->first_slice + i].ps == (uint32_t)k->index;
  char e[300];
  if (!v) {
    ps__req_fail(c, r, PS_EPROTO, "register reply for no variable");
    return 0;
  }
  if (n != m->n_slices) {
    snprintf(e, sizeof e, "its register reply lists %zu slices, the request %zu", m->n_slices,
             n);
    return ps__proto_err(c, k, e);
  }
  for (size_t j = 0; j < n; j++)
    if (m->slices[j]->slice_id >= PS__MAX_SLICES) {
      /* Ids index the remote-id map: bounded before any use. */
      snprintf(e, sizeof e, "it named slice %zu of '%s' with id %u (ids are below %u)", j,
               v->name, m->slices[j]->slice_id, PS__MAX_SLICES);
      return ps__proto_err(c, k, e);
    }
  size_t j = 0;
  for (size_t i = 0; i < v->n_slices; i++) {
    size_t si = v->first_slice + i;
    ps__slice *s = &c->slices[si];
    if (s->ps != (uint32_t)k->index) continue;
    s->remote_id = m->slices[j]->slice_id;
    s->initialized = m->slices[j]->initialized;
    j++;
    int rc = ps__remote_set(c, k->index, s->remote_id, si);
    if (rc == PS_EPROTO) return ps__proto_err(c, k, "it sent an out-of-range slice id");
    if (rc) {
      ps__conn_break(c, k, rc, "out of memory");
      return rc;
    }
  }
  ps__req_answered(c, r, k->index, 1);
  return 0;
}

static int on_push_reply(ps_client *c, ps__conn *k, const Ps__PushReply *m) {
  note_flags(c, k, m->want_checkpoint, m->want_stop, m->stopped, m->stop_step);
  ps_req *r = ps__req_find(c, m->request_id);
  if (!r) return 0;
  for (size_t i = 0; i < m->n_items; i++) {
    int st = m->items[i]->status;
    if (st == PS_ESTALE) r->stale = 1;
    if (st >= 0 || st == PS_ESTALE || r->status) continue;
    /* psd's own sentence when it sent one (2.1), else the code's name. */
    ps__slice *s = ps__slice_by_remote(c, k->index, m->items[i]->slice_id);
    char why[400];
    if (m->message && m->message[0]) snprintf(why, sizeof why, "%.399s", m->message);
    else snprintf(why, sizeof why, "%s", ps_strerror(st));
    if (st == PS_EDUPLICATE) { /* not an error for a step: see ps_req_wait */
      if (!r->duplicate)
        snprintf(r->msg, sizeof r->msg, "ps %d at %.80s: %.399s", k->index, k->addr, why);
      r->duplicate = 1;
      continue;
    }
    r->status = st;
    snprintf(r->msg, sizeof r->msg, "ps %d at %.80s refused the gradient of '%.64s': %.300s",
             k->index, k->addr, s ? s->var->name : "?", why);
    snprintf(c->errmsg, sizeof c->errmsg, "%s", r->msg);
  }
  ps__req_answered(c, r, k->index, 1);
  return 0;
}

static int on_pull_reply(ps_client *c, ps__conn *k, const Ps__PullReply *m) {
  note_flags(c, k, m->want_checkpoint, m->want_stop, m->stopped, m->stop_step);
  ps_req *r = ps__req_find(c, m->request_id);
  if (r && r->type != PS__REQ_PULL)
    return ps__proto_err(c, k, "it answered a pull we never sent");
  if (r && !r->first_reply_at) r->first_reply_at = ps__now();
  ps__telem_bytes(&c->telem, k->index, 1, k->hdr.data_len);
  k->data_kind = PS__DATA_PULL;
  k->data_own = r && r->average;
  int rc = plan_pull_data(c, k, m, r);
  k->data_req = m->request_id;
  k->data_items = (int)m->n_items;
  if (rc == PS_ENOMEM) /* its data cannot be placed: the stream is lost */
    ps__conn_break(c, k, rc, "out of memory for a pull reply's data");
  if (rc) return rc;
  /* The request's slices count as received once the data is in. */
  k->rstate = PS__RD_DATA;
  return 0;
}

/* A TablePullReply: its rows go into the request's buffer (tablexfer.c),
 * or to the discard sink when nobody waits for them any more. */
static int on_table_pull_reply(ps_client *c, ps__conn *k, const Ps__TablePullReply *m) {
  note_flags(c, k, m->want_checkpoint, m->want_stop, m->stopped, m->stop_step);
  ps_req *r = ps__req_find(c, m->request_id);
  ps__telem_bytes(&c->telem, k->index, 1, k->hdr.data_len);
  k->ndst = 0;
  k->nwiden = 0;
  k->dst_i = 0;
  k->dst_got = 0;
  k->data_req = m->request_id;
  k->data_items = 1;
  k->data_kind = PS__DATA_TABLE;
  k->data_own = 0;
  int rc = r ? ps__table_pull_reply(c, k, r, m) : 0;
  if (rc < 0) return rc;
  if (rc == 1) { /* its rows were taken from the pull ring already */
    k->rstate = PS__RD_DATA;
    return 0;
  }
  if (!k->ndst && k->hdr.data_len && plan_discard(k, k->hdr.data_len)) {
    ps__conn_break(c, k, PS_ENOMEM, "out of memory");
    return PS_ENOMEM;
  }
  k->rstate = PS__RD_DATA;
  return 0;
}

/* A TablePushReply: its flags, then the push's outcome (tablexfer.c). */
static int on_table_push_reply(ps_client *c, ps__conn *k, const Ps__TablePushReply *m) {
  note_flags(c, k, m->want_checkpoint, m->want_stop, m->stopped, m->stop_step);
  return ps__on_table_push_reply(c, k, m);
}

static int on_checkpoint_reply(ps_client *c, ps__conn *k, const Ps__CheckpointReply *m) {
  note_flags(c, k, 0, 0, m->stopped, m->stop_step);
  ps_req *r = ps__req_find(c, m->request_id);
  if (!r) return 0;
  if (m->max_step > r->max_step) r->max_step = m->max_step;
  if (!m->ok && !r->refused) {
    r->refused = 1;
    snprintf(c->errmsg, sizeof c->errmsg, "ps %d at %s refused the checkpoint: %s", k->index,
             k->addr, m->message ? m->message : "?");
  }
  ps__req_answered(c, r, k->index, 1);
  return 0;
}

/* Unpacks one message type, runs its handler, frees it; a message that
 * does not unpack goes to `bad`. */
#define PS__DISPATCH(fn, unpack, free_fn)                  \
  do {                                                     \
    void *m_ = unpack(&pa.a, len, meta);                   \
    if (!m_) goto bad;                                     \
    int rc_ = fn(c, k, m_);                                \
    free_fn(m_, &pa.a);                                    \
    return rc_;                                            \
  } while (0)

int ps__handle_reply(ps_client *c, ps__conn *k, const uint8_t *meta) {
  unsigned t = k->hdr.type;
  size_t len = k->hdr.meta_len;
  ps__pb_alloc pa;
  ps__pb_alloc_init(&pa);
  if (t != PS__MSG_PULL_REPLY && t != PS__MSG_TABLE_PULL_REPLY && k->hdr.data_len)
    return ps__proto_err(c, k, "a reply other than a pull reply carries data");
  switch (t) {
  case PS__MSG_ERROR: PS__DISPATCH(on_error, ps__error__unpack, ps__error__free_unpacked);
  case PS__MSG_ACK: PS__DISPATCH(on_ack, ps__ack__unpack, ps__ack__free_unpacked);
  case PS__MSG_REGISTER_REPLY:
    PS__DISPATCH(on_register_reply, ps__register_reply__unpack,
                 ps__register_reply__free_unpacked);
  case PS__MSG_PUSH_REPLY:
    PS__DISPATCH(on_push_reply, ps__push_reply__unpack, ps__push_reply__free_unpacked);
  case PS__MSG_PULL_REPLY:
    PS__DISPATCH(on_pull_reply, ps__pull_reply__unpack, ps__pull_reply__free_unpacked);
  case PS__MSG_CHECKPOINT_REPLY:
    PS__DISPATCH(on_checkpoint_reply, ps__checkpoint_reply__unpack,
                 ps__checkpoint_reply__free_unpacked);
  case PS__MSG_TABLE_REGISTER_REPLY:
    PS__DISPATCH(ps__on_table_register_reply, ps__table_register_reply__unpack,
                 ps__table_register_reply__free_unpacked);
  case PS__MSG_TABLE_PULL_REPLY:
    PS__DISPATCH(on_table_pull_reply, ps__table_pull_reply__unpack,
                 ps__table_pull_reply__free_unpacked);
  case PS__MSG_TABLE_PUSH_REPLY:
    PS__DISPATCH(on_table_push_reply, ps__table_push_reply__unpack,
                 ps__table_push_reply__free_unpacked);
  default:
    break;
  }
bad:;
  char e[160];
  if (pa.failed) { /* the reply is lost: the request cannot complete */
    snprintf(e, sizeof e, "out of memory unpacking a %s frame", ps__msg_name(t));
    ps__conn_break(c, k, PS_ENOMEM, e);
    return PS_ENOMEM;
  }
  snprintf(e, sizeof e, "malformed or unexpected %s frame", ps__msg_name(t));
  return ps__proto_err(c, k, e);
}

void ps__pull_data_done(ps_client *c, ps__conn *k) {
  k->rstate = PS__RD_HEADER;
  ps_req *r = ps__req_find(c, k->data_req);
  /* 16-bit items into their variables, unless the pull was given up
   * meanwhile (its variables may be gone). */
  for (size_t i = 0; r && i < k->nwiden; i++) {
    const ps__widen *w = &k->widen[i];
    ps__wire_decode(w->dtype, w->dst, k->wire16 + w->off, w->count);
  }
  k->nwiden = 0;
  if (r && k->data_kind == PS__DATA_TABLE) ps__table_pull_done(c, k, r);
  else if (r) ps__req_answered(c, r, k->index, k->data_items);
  k->data_req = 0;
  k->data_items = 0;
  k->data_kind = PS__DATA_PULL;
  k->data_own = 0;
}

void ps__data_abandon(ps_client *c, ps__conn *k) {
  uint64_t left = 0;
  for (size_t i = k->dst_i; i < k->ndst; i++) left += k->dst[i].iov_len;
  left -= k->dst_got;
  k->ndst = 0;
  k->nwiden = 0;
  k->dst_i = 0;
  k->dst_got = 0;
  k->data_own = 0;
  if (left && plan_discard(k, left)) ps__conn_break(c, k, PS_ENOMEM, "out of memory");
}
