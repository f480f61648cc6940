/* conn.c - the per-connection state machine: framing, dispatch of each
 * message, replies. */
#include "conn.h"

#include <errno.h>
#include <event2/event.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "optimizer.h"
#include "pace.h"
#include "server.h"

/* Input buffer for headers, protobuf and small tensors; grows to hold a
 * whole protobuf part (<= PS__MAX_META) only when a frame needs it. */
#define PSD_IN_INITIAL (64u * 1024u)
/* Tensor bytes at least this large are read straight into the staging
 * buffer rather than through the input buffer (saves a copy). */
#define PSD_DIRECT_READ_MIN (16u * 1024u)
/* Bytes read per readiness callback before yielding to other connections,
 * so one fast sender cannot starve the rest. */
#define PSD_READ_BUDGET (32u << 20)
/* Protobuf arena's first block: a Push of ~1000 items fits. */
#define PSD_ARENA_INITIAL (64u * 1024u)
/* Bytes of copied reply data a connection may have queued before psd stops
 * reading its requests: a peer that never reads cannot grow psd's memory
 * without bound. Parameters are sent in place, so honest peers stay far
 * below this. */
#define PSD_OUT_HIGH_WATER ((size_t)64 << 20)
/* Seconds a CLOSING connection may take to drain its error reply. */
#define PSD_CLOSING_MAX_S 2.0

/* ---- arena ------------------------------------------------------------- */

static void *arena_alloc(void *ud, size_t size) {
  psd_arena *a = ud;
  size = (size + 15) & ~(size_t)15;
  if (a->used + size <= a->cap) {
    void *p = a->buf + a->used;
    a->used += size;
    return p;
  }
  if (a->n_extra == a->cap_extra) {
    size_t nc = a->cap_extra ? a->cap_extra * 2 : 16;
    void **ne = realloc(a->extra, nc * sizeof *ne);
    if (!ne) return NULL;
    a->extra = ne;
    a->cap_extra = nc;
  }
  void *p = malloc(size);
  if (!p) return NULL;
  a->extra[a->n_extra++] = p;
  a->extra_bytes += size;
  return p;
}

static void arena_free(void *ud, void *p) {
  (void)ud;
  (void)p; /* released at reset */
}

static void arena_reset(psd_arena *a) {
  if (a->n_extra) {
    for (size_t i = 0; i < a->n_extra; i++) free(a->extra[i]);
    size_t ncap = (a->cap + a->extra_bytes) * 2;
    char *nb = malloc(ncap);
    if (nb) {
      free(a->buf);
      a->buf = nb;
      a->cap = ncap;
    }
    a->n_extra = 0;
    a->extra_bytes = 0;
  }
  a->used = 0;
}

static void arena_destroy(psd_arena *a) {
  arena_reset(a);
  free(a->buf);
  free(a->extra);
}

/* ---- helpers ----------------------------------------------------------- */

static void on_read(evutil_socket_t fd, short what, void *arg);
static void on_write(evutil_socket_t fd, short what, void *arg);
static void slice_hold(void *ctx, void *ref);
static void slice_release(void *ctx, void *ref);

/* Ensures per-slice tables cover every slice the shard has. */
static int ensure_tables(psd_conn *c) {
  uint32_t n = c->srv->shard.n;
  if (psd_waitset_reserve(&c->srv->waiters, &c->waits, n) != 0) return -1;
  size_t old = c->reply_cap;
  if (n > c->reply_cap) {
    size_t cap = c->reply_cap;
    if (ps__grow((void **)&c->reply_items, &cap, n, sizeof *c->reply_items)) return -1;
    cap = c->reply_cap;
    if (ps__grow((void **)&c->reply_ptrs, &cap, n, sizeof *c->reply_ptrs)) return -1;
    cap = c->reply_cap;
    if (ps__grow((void **)&c->status, &cap, n, sizeof *c->status)) return -1;
    cap = c->reply_cap;
    if (ps__grow((void **)&c->reply_data, &cap, n, sizeof *c->reply_data)) return -1;
    cap = c->reply_cap;
    if (ps__grow((void **)&c->reply_count, &cap, n, sizeof *c->reply_count)) return -1;
    cap = c->reply_cap;
    if (ps__grow((void **)&c->reply_refs, &cap, n, sizeof *c->reply_refs)) return -1;
    cap = c->reply_cap;
    if (ps__grow((void **)&c->seen, &cap, n, sizeof *c->seen)) return -1;
    memset(c->seen + old, 0, (cap - old) * sizeof *c->seen);
    c->reply_cap = cap;
  }
  return 0;
}

/* Starts a duplicate check over the slice ids of one frame. */
static void seen_begin(psd_conn *c) { c->seen_seq++; }
/* 1 if id was already listed in this frame (marks it otherwise). */
static int seen_twice(psd_conn *c, uint32_t id) {
  if (c->seen[id] == c->seen_seq) return 1;
  c->seen[id] = c->seen_seq;
  return 0;
}

/* Queues one frame: header, packed message, then data segments sent from
 * where they are (refs: the slices whose parameters they are, held until
 * written so no update changes bytes in flight). */
static int send_frame(psd_conn *c, unsigned type, const ProtobufCMessage *msg,
                      const float *const *data, const uint64_t *counts, void *const *refs,
                      size_t nseg) {
  return ps__outq_frame(&c->out, type, msg, data, counts, refs, nseg);
}

void psd_conn_error(psd_conn *c, uint64_t request_id, int code, int fatal,
                    const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (fatal)
    psd_warn("%s (%s): %s; closing the connection", c->name, c->peer, msg);
  else
    psd_info("%s (%s): request %llu failed: %s", c->name, c->peer,
             (unsigned long long)request_id, msg);
  Ps__Error e = PS__ERROR__INIT;
  e.request_id = request_id;
  e.code = code;
  e.message = msg;
  e.fatal = fatal;
  send_frame(c, PS__MSG_ERROR, &e.base, NULL, NULL, NULL, 0);
  if (fatal && c->state != PSD_CONN_CLOSING) {
    c->state = PSD_CONN_CLOSING;
    c->closing_since = ps__now();
    event_del(c->rev);
  }
}

/* ---- lifecycle ----------------------------------------------------------- */

psd_conn *psd_conn_new(struct psd_server *srv, int fd, const char *peer) {
  psd_conn *c = calloc(1, sizeof *c);
  if (!c) {
    close(fd);
    return NULL;
  }
  c->srv = srv;
  c->fd = fd;
  c->worker = -1;
  c->waits.owner = c;
  c->seq = ++srv->conn_seq;
  c->opened_at = ps__now();
  snprintf(c->peer, sizeof c->peer, "%s", peer);
  snprintf(c->name, sizeof c->name, "conn#%llu", (unsigned long long)c->seq);
  c->in_cap = PSD_IN_INITIAL;
  c->in = malloc(c->in_cap);
  c->arena.cap = PSD_ARENA_INITIAL;
  c->arena.buf = malloc(c->arena.cap);
  c->alloc.alloc = arena_alloc;
  c->alloc.free = arena_free;
  c->alloc.allocator_data = &c->arena;
  c->out.hold = slice_hold;
  c->out.release = slice_release;
  c->out.ctx = srv;
  c->rev = event_new(srv->base, fd, EV_READ | EV_PERSIST, on_read, c);
  c->wev = event_new(srv->base, fd, EV_WRITE | EV_PERSIST, on_write, c);
  if (!c->in || !c->arena.buf || !c->rev || !c->wev ||
      event_add(c->rev, NULL) != 0) {
    psd_conn_close(c, "out of memory");
    return NULL;
  }
  c->next = srv->conns;
  if (srv->conns) srv->conns->prev = c;
  srv->conns = c;
  psd_debug("%s: connection from %s", c->name, c->peer);
  return c;
}

void psd_conn_close(psd_conn *c, const char *why) {
  /* Detach from everything now; free the memory later (psd_conn_free from
   * psd_server_reap), since callers up the stack may still look at c. */
  if (c->dead) return;
  c->dead = 1;
  psd_server *srv = c->srv;
  if (c->pace_paused) {
    c->pace_paused = 0;
    srv->pace_paused--;
  }
  psd_waitset_free(&srv->waiters, &c->waits);
  if (c->prev) c->prev->next = c->next;
  else if (srv->conns == c) srv->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  c->prev = NULL;
  c->next = srv->graveyard;
  srv->graveyard = c;
  psd_debug("%s (%s): closed: %s", c->name, c->peer, why);
  psd_server_conn_closed(srv, c);
  psd_pace_resume(srv); /* nobody waits for c any more */
  if (c->rev) event_del(c->rev);
  if (c->wev) event_del(c->wev);
  ps__outq_free(&c->out); /* releases the slices its replies referenced */
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
}

void psd_conn_free(psd_conn *c) {
  if (c->rev) event_free(c->rev);
  if (c->wev) event_free(c->wev);
  arena_destroy(&c->arena);
  free(c->in);
  free(c->stage);
  free(c->status);
  free(c->seen);
  free(c->reply_items);
  free(c->reply_ptrs);
  free(c->reply_data);
  free(c->reply_count);
  free(c->reply_refs);
  free(c->pack);
  free(c);
}

int psd_conn_write(psd_conn *c) {
  if (c->dead) return -1;
  if (ps__outq_write(&c->out, c->fd) != 0) {
    psd_conn_close(c, strerror(errno));
    return -1;
  }
  if (ps__outq_pending(&c->out)) {
    event_add(c->wev, NULL);
    return 0;
  }
  event_del(c->wev);
  if (c->read_paused && c->state != PSD_CONN_CLOSING) {
    /* Replies drained: take requests again. */
    c->read_paused = 0;
    if (!c->pace_paused) event_add(c->rev, NULL);
  }
  if (c->state == PSD_CONN_CLOSING) {
    psd_conn_close(c, "closed after error");
    return -1;
  }
  return 0;
}

static void on_write(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  psd_conn *c = arg;
  psd_server *srv = c->srv;
  psd_conn_write(c);
  psd_server_reap(srv);
}

/* outq hooks: a queued reply references a slice's parameters. */
static void slice_hold(void *ctx, void *ref) {
  (void)ctx;
  ((psd_slice *)ref)->readers++;
}

static void slice_release(void *ctx, void *ref) {
  (void)ctx;
  ((psd_slice *)ref)->readers--;
}

/* ---- pulls --------------------------------------------------------------- */

void psd_conn_flush(psd_conn *c) {
  if (c->dead) return;
  psd_shard *sh = &c->srv->shard;
  psd_waiter *w = psd_waitset_take_ready(&c->waits);
  while (w) {
    /* One PullReply per run of waiters of the same request (at most one
     * waiter per slice, so reply_cap entries always suffice), split so no
     * frame carries more than PS__MAX_DATA. */
    uint64_t req = w->request_id;
    size_t n = 0;
    uint64_t bytes = 0;
    while (w && w->request_id == req && n < c->reply_cap && n < PS__MAX_ITEMS_PER_FRAME) {
      psd_slice *sl = sh->slices[w->slice_id];
      if (n && bytes + sl->length * sizeof(float) > PS__MAX_DATA) break; /* next frame */
      bytes += sl->length * sizeof(float);
      Ps__Item *it = &c->reply_items[n];
      ps__item__init(it);
      it->slice_id = sl->id;
      it->count = sl->length;
      it->step = sl->step;
      c->reply_ptrs[n] = it;
      c->reply_data[n] = sl->param;
      c->reply_count[n] = sl->length;
      c->reply_refs[n] = sl;
      n++;
      psd_waiter *next = w->ready_next;
      psd_waiter_answered(w);
      w = next;
    }
    Ps__PullReply r = PS__PULL_REPLY__INIT;
    r.request_id = req;
    r.n_items = n;
    r.items = c->reply_ptrs;
    psd_persist_flags(&c->srv->persist, &r.want_checkpoint, &r.want_stop, &r.stop_step, &r.stopped);
    if (send_frame(c, PS__MSG_PULL_REPLY, &r.base, c->reply_data, c->reply_count,
                   c->reply_refs, n) != 0) {
      psd_conn_error(c, req, PS_ENOMEM, 1, "out of memory building a pull reply");
      return;
    }
    psd_telem_sent(&c->srv->telem, c->worker, bytes);
  }
}

void psd_conn_pull_expired(void *ctx, psd_waitset *set, const psd_waiter *w) {
  (void)ctx;
  psd_conn *c = set->owner;
  const psd_slice *sl = c->srv->shard.slices[w->slice_id];
  psd_conn_error(c, w->request_id, PS_ETIMEDOUT, 0,
                 "pull of '%s' for step >= %llu timed out (the slice is at step %llu)",
                 sl->name, (unsigned long long)w->min_step, (unsigned long long)sl->step);
}

/* ---- dispatch ------------------------------------------------------------ */

#define UNPACK(T, fn)                                                         \
  T *m = fn(&c->alloc, c->hdr.meta_len, meta);                                \
  if (!m) {                                                                   \
    psd_conn_error(c, 0, PS_EPROTO, 1, "malformed %s message (%u bytes)",     \
                   ps__msg_name(c->hdr.type), c->hdr.meta_len);               \
    return -1;                                                                \
  }

static int handle_hello(psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Hello, ps__hello__unpack);
  char err[512];
  int rc = psd_server_hello(c->srv, c, m, err, sizeof err);
  if (rc != 0) {
    psd_conn_error(c, 0, rc, 1, "%s", err);
    return -1;
  }
  c->handshaken = 1;
  psd_server *srv = c->srv;
  Ps__HelloReply r = PS__HELLO_REPLY__INIT;
  r.protocol_version = PS__PROTOCOL_VERSION;
  r.ps_index = (uint32_t)srv->cfg->ps_index;
  r.num_ps = (uint32_t)srv->cfg->num_ps;
  r.num_workers = srv->job.num_workers;
  r.replicas_to_aggregate = srv->shard.replicas;
  r.async_mode = srv->shard.async_mode;
  r.server_id = srv->cfg->name;
  r.checkpoints = srv->cfg->ckpt_dir[0] != '\0';
  send_frame(c, PS__MSG_HELLO_REPLY, &r.base, NULL, NULL, NULL, 0);
  return 0;
}

static void opt_from_msg(const Ps__Optimizer *o, ps_optimizer *out) {
  memset(out, 0, sizeof *out);
  if (!o) {
    ps_optimizer_default(out, 0.01);
    return;
  }
  out->kind = (ps_opt_kind)o->kind;
  out->lr = o->lr;
  out->momentum = o->momentum;
  out->nesterov = o->nesterov;
  out->beta1 = o->beta1;
  out->beta2 = o->beta2;
  out->epsilon = o->epsilon;
  out->decay = (ps_lr_decay)o->decay;
  out->decay_rate = o->decay_rate;
  out->decay_steps = o->decay_steps;
  out->weight_decay = o->weight_decay;
}

static int handle_register(psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Register, ps__register__unpack);
  psd_server *srv = c->srv;
  Ps__SliceState *states = NULL;
  Ps__SliceState **sptrs = NULL;
  if (m->n_slices) {
    states = calloc(m->n_slices, sizeof *states);
    sptrs = calloc(m->n_slices, sizeof *sptrs);
    if (!states || !sptrs) {
      free(states);
      free(sptrs);
      psd_conn_error(c, m->request_id, PS_ENOMEM, 0, "out of memory");
      return 0;
    }
  }
  char err[512];
  int rc = 0;
  for (size_t i = 0; i < m->n_slices && rc == 0; i++) {
    const Ps__SliceSpec *sp = m->slices[i];
    const char *name = sp->name ? sp->name : "";
    uint64_t numel = 1;
    rc = PS_EINVAL;
    if (!name[0] || strlen(name) > PS_MAX_NAME)
      snprintf(err, sizeof err, "variable name must be 1 to %d bytes", PS_MAX_NAME);
    else if (sp->dtype != 1)
      snprintf(err, sizeof err, "variable '%s': dtype %u is not supported (only 1 = float32)",
               name, sp->dtype);
    else if (sp->n_shape < 1 || sp->n_shape > PS_MAX_DIMS)
      snprintf(err, sizeof err, "variable '%s': %zu dimensions (must be 1 to %d)", name,
               sp->n_shape, PS_MAX_DIMS);
    else
      rc = 0;
    for (size_t d = 0; rc == 0 && d < sp->n_shape; d++)
      if (sp->shape[d] == 0 || ps__mul_u64(numel, sp->shape[d], &numel)) {
        snprintf(err, sizeof err, "variable '%s': dimension %zu is zero or the size overflows",
                 name, d);
        rc = PS_ESHAPE;
      }
    if (rc == 0 && sp->length > PS__MAX_SLICE_BYTES / sizeof(float)) {
      snprintf(err, sizeof err,
               "variable '%s': slice of %llu elements exceeds the %llu-byte slice limit", name,
               (unsigned long long)sp->length, (unsigned long long)PS__MAX_SLICE_BYTES);
      rc = PS_ETOOBIG;
    }
    if (rc == 0)
      rc = ps__placement_check((uint32_t)srv->cfg->num_ps, (uint32_t)srv->cfg->ps_index,
                               srv->job.split_threshold, srv->job.max_slice_bytes, numel,
                               sp->offset, sp->length, err, sizeof err);
    ps_optimizer opt;
    opt_from_msg(sp->optimizer, &opt);
    if (rc == 0) {
      char e2[400];
      rc = psd_opt_validate(&opt, e2, sizeof e2);
      if (rc) snprintf(err, sizeof err, "variable '%s': %s", name, e2);
    }
    if (rc == 0) {
      uint64_t need = sp->length * sizeof(float) * (2 + psd_opt_state_per_elem(&opt));
      if ((double)(srv->shard.bytes_alloc + need) > srv->cfg->max_memory) {
        snprintf(err, sizeof err,
                 "variable '%s': %llu more bytes would take this server past --max-memory "
                 "(%.0f bytes)",
                 name, (unsigned long long)need, srv->cfg->max_memory);
        rc = PS_ETOOBIG;
      }
    }
    if (rc == 0 && srv->shard.n >= PS__MAX_SLICES) {
      snprintf(err, sizeof err, "this server already holds %u slices (the limit)",
               PS__MAX_SLICES);
      rc = PS_ETOOBIG;
    }
    psd_slice *sl = NULL;
    if (rc == 0)
      rc = psd_shard_register(&srv->shard, name, (uint32_t)sp->n_shape, sp->shape,
                              sp->offset, sp->length, &opt, &sl, err, sizeof err);
    if (rc == 0) rc = psd_persist_restore_slice(&srv->persist, sl, err, sizeof err);
    if (rc == 0) {
      ps__slice_state__init(&states[i]);
      states[i].slice_id = sl->id;
      states[i].initialized = sl->initialized;
      states[i].step = sl->step;
      sptrs[i] = &states[i];
    }
  }
  if (rc == 0 && ensure_tables(c) != 0) {
    rc = PS_ENOMEM;
    snprintf(err, sizeof err, "out of memory");
  }
  if (rc != 0) {
    psd_conn_error(c, m->request_id, rc, 0, "%s", err);
  } else {
    Ps__RegisterReply r = PS__REGISTER_REPLY__INIT;
    r.request_id = m->request_id;
    r.n_slices = m->n_slices;
    r.slices = sptrs;
    send_frame(c, PS__MSG_REGISTER_REPLY, &r.base, NULL, NULL, NULL, 0);
  }
  free(states);
  free(sptrs);
  return 0;
}

/* Checks the items of a Push/Init against the shard and the data length,
 * then enters DATA. */
static int begin_data(psd_conn *c, uint64_t req, uint64_t step, Ps__Item **items,
                      size_t n) {
  psd_shard *sh = &c->srv->shard;
  uint64_t total = 0, maxlen = 0;
  if (n > sh->n) {
    psd_conn_error(c, req, PS_EPROTO, 1, "%s with %zu items but only %u slices exist",
                   ps__msg_name(c->hdr.type), n, sh->n);
    return -1;
  }
  if (ensure_tables(c) != 0) {
    psd_conn_error(c, req, PS_ENOMEM, 1, "out of memory");
    return -1;
  }
  seen_begin(c);
  for (size_t i = 0; i < n; i++) {
    const Ps__Item *it = items[i];
    if (it->slice_id >= sh->n) {
      psd_conn_error(c, req, PS_ENOTFOUND, 1, "%s names unknown slice id %u",
                     ps__msg_name(c->hdr.type), it->slice_id);
      return -1;
    }
    psd_slice *sl = sh->slices[it->slice_id];
    if (seen_twice(c, it->slice_id)) {
      psd_conn_error(c, req, PS_EPROTO, 1, "%s lists slice %u of '%s' twice",
                     ps__msg_name(c->hdr.type), it->slice_id, sl->name);
      return -1;
    }
    if (it->n_rows || it->row_width) {
      psd_conn_error(c, req, PS_EUNSUPPORTED, 1,
                     "row-sparse update of '%s' is not supported by this server", sl->name);
      return -1;
    }
    if (it->count != sl->length) {
      psd_conn_error(c, req, PS_ESHAPE, 1,
                     "%s of '%s' (slice at %llu) carries %llu values, the slice has %llu",
                     ps__msg_name(c->hdr.type), sl->name, (unsigned long long)sl->offset,
                     (unsigned long long)it->count, (unsigned long long)sl->length);
      return -1;
    }
    total += it->count; /* each <= 16M, n <= 1M: no overflow */
    if (it->count > maxlen) maxlen = it->count;
  }
  if (total * sizeof(float) != c->hdr.data_len) {
    psd_conn_error(c, req, PS_EPROTO, 1,
                   "%s items add up to %llu bytes but the frame carries %llu",
                   ps__msg_name(c->hdr.type), (unsigned long long)(total * sizeof(float)),
                   (unsigned long long)c->hdr.data_len);
    return -1;
  }
  if (maxlen > c->stage_cap) {
    float *ns = NULL;
    if (posix_memalign((void **)&ns, 64, maxlen * sizeof(float)) != 0) {
      psd_conn_error(c, req, PS_ENOMEM, 1, "out of memory for a %llu-value slice",
                     (unsigned long long)maxlen);
      return -1;
    }
    free(c->stage);
    c->stage = ns;
    c->stage_cap = maxlen;
  }
  c->items = items;
  c->n_items = n;
  c->item = 0;
  c->item_got = 0;
  if (step != c->data_step || c->hdr.type != PS__MSG_PUSH) c->pace_done = 0;
  c->data_step = step;
  c->data_req = req;
  c->state = PSD_CONN_DATA;
  return 0;
}

static int handle_push(psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Push, ps__push__unpack);
  if (c->worker < 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1, "PUSH from a connection that is not a worker");
    return -1;
  }
  if (c->finished) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1, "PUSH after FINISH");
    return -1;
  }
  if (ensure_tables(c) != 0) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 1, "out of memory");
    return -1;
  }
  if (m->want_stop && c->srv->cfg->ckpt_dir[0] && c->srv->job.pinned) {
    char who[32];
    snprintf(who, sizeof who, "worker %d", c->worker);
    psd_persist_stop_wanted(&c->srv->persist, who);
  }
  return begin_data(c, m->request_id, m->step, m->items, m->n_items);
}

static int handle_init(psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Init, ps__init__unpack);
  if (c->worker != 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1,
                   "INIT from %s: only the chief (worker 0) initializes variables", c->name);
    return -1;
  }
  return begin_data(c, m->request_id, 0, m->items, m->n_items);
}

static int handle_pull(psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Pull, ps__pull__unpack);
  psd_shard *sh = &c->srv->shard;
  if (c->worker < 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1, "PULL from a connection that is not a worker");
    return -1;
  }
  if (ensure_tables(c) != 0) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 1, "out of memory");
    return -1;
  }
  seen_begin(c);
  for (size_t i = 0; i < m->n_slice_ids; i++) {
    uint32_t id = m->slice_ids[i];
    if (id >= sh->n) {
      psd_conn_error(c, m->request_id, PS_ENOTFOUND, 1, "PULL names unknown slice id %u", id);
      return -1;
    }
    if (seen_twice(c, id)) {
      psd_conn_error(c, m->request_id, PS_EPROTO, 1, "PULL lists slice %u of '%s' twice", id,
                     sh->slices[id]->name);
      return -1;
    }
    if (psd_waitset_busy(&c->waits, id)) {
      psd_conn_error(c, m->request_id, PS_EBUSY, 0,
                     "a pull of '%s' is already being answered on this connection",
                     sh->slices[id]->name);
      return 0;
    }
  }
  double now = ps__now();
  double timeout = m->timeout_ms ? m->timeout_ms / 1000.0 : c->srv->cfg->pull_timeout_s;
  for (size_t i = 0; i < m->n_slice_ids; i++) {
    uint32_t id = m->slice_ids[i];
    psd_slice *sl = sh->slices[id];
    /* Once the job stops, every pull is answered at once (flagged). */
    int now_ok = sl->initialized && (sl->step >= m->min_step || c->srv->persist.stopped);
    if (psd_waiters_pull(&c->srv->waiters, &c->waits, id, m->request_id, m->min_step,
                         now + timeout, now_ok) != 0) {
      psd_conn_error(c, m->request_id, PS_ENOMEM, 1, "out of memory");
      return -1;
    }
  }
  if (m->n_slice_ids == 0) {
    Ps__PullReply r = PS__PULL_REPLY__INIT;
    r.request_id = m->request_id;
    psd_persist_flags(&c->srv->persist, &r.want_checkpoint, &r.want_stop, &r.stop_step, &r.stopped);
    send_frame(c, PS__MSG_PULL_REPLY, &r.base, NULL, NULL, NULL, 0);
  }
  return 0;
}

static int handle_finish(psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Finish, ps__finish__unpack);
  if (c->worker < 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1, "FINISH from a connection that is not a worker");
    return -1;
  }
  Ps__Ack a = PS__ACK__INIT;
  a.request_id = m->request_id;
  send_frame(c, PS__MSG_ACK, &a.base, NULL, NULL, NULL, 0);
  psd_telem_finish(&c->srv->telem, c->worker, m->summary);
  if (!c->finished) {
    c->finished = 1;
    psd_server_worker_finished(c->srv, c);
  }
  return 0;
}

static int handle_checkpoint(psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Checkpoint, ps__checkpoint__unpack);
  if (c->worker != 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 0,
                   "CHECKPOINT from %s: only the chief (worker 0) arranges checkpoints",
                   c->worker < 0 ? "a connection that is not a worker" : c->name);
    return 0;
  }
  char msg[1200];
  Ps__CheckpointReply r = PS__CHECKPOINT_REPLY__INIT;
  r.request_id = m->request_id;
  unsigned acts = psd_persist_request(&c->srv->persist, m->step, m->stop, m->commit, &r.ok,
                                      &r.max_step, msg, sizeof msg);
  psd_server_act(c->srv, acts);
  r.message = msg;
  r.stopped = c->srv->persist.stopped;
  r.stop_step = c->srv->persist.stopped ? c->srv->persist.stop_step : 0;
  send_frame(c, PS__MSG_CHECKPOINT_REPLY, &r.base, NULL, NULL, NULL, 0);
  return 0;
}

/* Counters for psctl (any authenticated peer may ask). */
static int handle_stats(psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Stats, ps__stats__unpack);
  Ps__StatsReply r;
  if (psd_telem_stats(&c->srv->telem, c->srv, &r) != 0) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 0, "out of memory");
    return 0;
  }
  r.request_id = m->request_id;
  if (send_frame(c, PS__MSG_STATS_REPLY, &r.base, NULL, NULL, NULL, 0) != 0)
    psd_conn_error(c, m->request_id, PS_ETOOBIG, 0, "the stats do not fit in one frame");
  psd_telem_stats_free(&r);
  return 0;
}

/* A whole protobuf part is in; act on it. Returns 0 or -1 (CLOSING). */
static int dispatch(psd_conn *c, const uint8_t *meta) {
  unsigned t = c->hdr.type;
  if (t != PS__MSG_PUSH && t != PS__MSG_INIT && c->hdr.data_len != 0) {
    psd_conn_error(c, 0, PS_EPROTO, 1, "%s frame carries %llu data bytes (it takes none)",
                   ps__msg_name(t), (unsigned long long)c->hdr.data_len);
    return -1;
  }
  if (t == PS__MSG_HELLO && c->handshaken) {
    psd_conn_error(c, 0, PS_EPROTO, 1, "second HELLO on one connection");
    return -1;
  }
  if (c->admin && t != PS__MSG_STATS) {
    psd_conn_error(c, 0, PS_ESTATE, 1, "an admin connection may only send STATS, not %s",
                   ps__msg_name(t));
    return -1;
  }
  switch (t) {
  case PS__MSG_HELLO:
    return handle_hello(c, meta);
  case PS__MSG_REGISTER:
    return handle_register(c, meta);
  case PS__MSG_INIT:
    return handle_init(c, meta);
  case PS__MSG_PUSH:
    return handle_push(c, meta);
  case PS__MSG_PULL:
    return handle_pull(c, meta);
  case PS__MSG_FINISH:
    return handle_finish(c, meta);
  case PS__MSG_CHECKPOINT:
    return handle_checkpoint(c, meta);
  case PS__MSG_STATS:
    return handle_stats(c, meta);
  default:
    psd_conn_error(c, 0, PS_EPROTO, 1, "unexpected %s frame from a client", ps__msg_name(t));
    return -1;
  }
}

/* One Push/Init item has fully arrived in c->stage. */
static void item_done(psd_conn *c) {
  psd_server *srv = c->srv;
  const Ps__Item *it = c->items[c->item];
  psd_slice *sl = srv->shard.slices[it->slice_id];
  if (c->hdr.type == PS__MSG_INIT) {
    int was = sl->initialized;
    psd_shard_init_values(&srv->shard, sl, c->stage);
    if (!was) psd_server_slice_advanced(srv, sl);
    return;
  }
  c->pace_done += it->count * sizeof(float);
  double t0 = ps__now();
  int rc = psd_shard_push(&srv->shard, sl, (uint32_t)c->worker, c->data_step, c->stage, t0);
  c->data_at = t0;
  c->agg_s += ps__now() - t0; /* accumulation and, for the last gradient, the optimizer */
  if (rc == 1) psd_server_slice_advanced(srv, sl);
  if (rc == PS_EINVAL)
    psd_warn("%s: gradient of '%s' for step %llu, but the slice is only at step %llu",
             c->name, sl->name, (unsigned long long)c->data_step,
             (unsigned long long)sl->step);
  c->status[c->item] = rc > 0 ? 0 : rc;
}

/* The last item of a Push/Init is in: reply and go back to HEADER. */
static void frame_done(psd_conn *c) {
  if (c->hdr.type == PS__MSG_INIT) {
    Ps__Ack a = PS__ACK__INIT;
    a.request_id = c->data_req;
    send_frame(c, PS__MSG_ACK, &a.base, NULL, NULL, NULL, 0);
  } else {
    uint32_t stale = 0;
    for (size_t i = 0; i < c->n_items; i++) {
      Ps__Item *it = &c->reply_items[i];
      ps__item__init(it);
      it->slice_id = c->items[i]->slice_id;
      it->status = c->status[i];
      c->reply_ptrs[i] = it;
      stale += it->status == PS_ESTALE;
    }
    psd_telem_push(&c->srv->telem, c->worker, c->data_step,
                   c->n_items ? c->data_at : ps__now(), c->hdr.data_len, c->agg_s, stale);
    c->agg_s = 0;
    Ps__PushReply r = PS__PUSH_REPLY__INIT;
    r.request_id = c->data_req;
    r.n_items = c->n_items;
    r.items = c->reply_ptrs;
    psd_persist_flags(&c->srv->persist, &r.want_checkpoint, &r.want_stop, &r.stop_step, &r.stopped);
    send_frame(c, PS__MSG_PUSH_REPLY, &r.base, NULL, NULL, NULL, 0);
  }
  c->items = NULL;
  c->n_items = 0;
  c->state = PSD_CONN_HEADER;
  arena_reset(&c->arena);
}

/* Makes progress on buffered input. Returns 1 if it did, 0 if it needs
 * more bytes, -1 if the connection entered CLOSING. */
static int step(psd_conn *c) {
  switch (c->state) {
  case PSD_CONN_HEADER: {
    if (c->in_len < PS__HEADER_SIZE) return 0;
    char err[256];
    int rc = ps__header_decode(c->in + c->in_off, c->handshaken, &c->hdr, err, sizeof err);
    if (rc != 0) {
      psd_conn_error(c, 0, rc, 1, "%s", err);
      return -1;
    }
    c->in_off += PS__HEADER_SIZE;
    c->in_len -= PS__HEADER_SIZE;
    c->state = PSD_CONN_META;
    return 1;
  }
  case PSD_CONN_META: {
    if (c->in_len < c->hdr.meta_len) {
      if (c->in_off + c->hdr.meta_len > c->in_cap) {
        /* Make room for the whole protobuf part (bounded by PS__MAX_META). */
        if (c->in_off) {
          memmove(c->in, c->in + c->in_off, c->in_len);
          c->in_off = 0;
        }
        if (c->hdr.meta_len > c->in_cap &&
            ps__grow((void **)&c->in, &c->in_cap, c->hdr.meta_len, 1) != 0) {
          psd_conn_error(c, 0, PS_ENOMEM, 1, "out of memory for a %u-byte message",
                         c->hdr.meta_len);
          return -1;
        }
      }
      return 0;
    }
    const uint8_t *meta = c->in + c->in_off;
    c->in_off += c->hdr.meta_len;
    c->in_len -= c->hdr.meta_len;
    c->state = PSD_CONN_HEADER;
    if (dispatch(c, meta) != 0) return -1;
    if (c->state == PSD_CONN_DATA && c->n_items == 0) frame_done(c);
    else if (c->state == PSD_CONN_HEADER) arena_reset(&c->arena);
    return 1;
  }
  case PSD_CONN_DATA: {
    uint64_t need = c->items[c->item]->count * sizeof(float) - c->item_got;
    uint64_t take = c->in_len < need ? c->in_len : need;
    if (take == 0 && need > 0) return 0;
    memcpy((char *)c->stage + c->item_got, c->in + c->in_off, take);
    c->in_off += take;
    c->in_len -= take;
    c->item_got += take;
    if (c->item_got == c->items[c->item]->count * sizeof(float)) {
      item_done(c);
      c->item++;
      c->item_got = 0;
      if (c->item == c->n_items) frame_done(c);
    }
    return 1;
  }
  case PSD_CONN_CLOSING:
    return 0;
  }
  return 0;
}

static void on_read(evutil_socket_t fd, short what, void *arg) {
  (void)what;
  psd_conn *c = arg;
  psd_server *srv = c->srv;
  size_t budget = PSD_READ_BUDGET;
  while (!c->dead && c->state != PSD_CONN_CLOSING) {
    int r;
    while ((r = step(c)) > 0 && !c->dead) {
    }
    if (r < 0 || c->dead) break;
    if (budget == 0) break;
    if (c->out.len > PSD_OUT_HIGH_WATER) {
      /* The peer is not reading its replies: stop reading its requests
       * until they drain (bounds the memory one peer can make us use). */
      c->read_paused = 1;
      event_del(c->rev);
      break;
    }
    if (psd_pace_hold(srv, c)) break;
    ssize_t n;
    if (c->state == PSD_CONN_DATA && c->in_len == 0 &&
        c->items[c->item]->count * sizeof(float) - c->item_got >= PSD_DIRECT_READ_MIN) {
      /* Big tensor: straight into the staging buffer. */
      uint64_t need = c->items[c->item]->count * sizeof(float) - c->item_got;
      n = read(fd, (char *)c->stage + c->item_got, need);
      if (n > 0) {
        c->item_got += (uint64_t)n;
        if (c->item_got == c->items[c->item]->count * sizeof(float)) {
          item_done(c);
          c->item++;
          c->item_got = 0;
          if (c->item == c->n_items) frame_done(c);
          /* Answer pulls as slices complete, not only at the frame's end. */
          psd_server_flush(srv);
        }
      }
    } else {
      if (c->in_len == 0) c->in_off = 0;
      if (c->in_off + c->in_len == c->in_cap) {
        memmove(c->in, c->in + c->in_off, c->in_len);
        c->in_off = 0;
      }
      n = read(fd, c->in + c->in_off + c->in_len, c->in_cap - c->in_off - c->in_len);
      if (n > 0) c->in_len += (size_t)n;
    }
    if (n == 0) {
      if (c->state != PSD_CONN_HEADER || c->in_len)
        psd_warn("%s (%s): connection closed in the middle of a frame", c->name, c->peer);
      psd_conn_close(c, "peer closed the connection");
      break;
    }
    if (n < 0) {
      int e = errno;
      if (e == EAGAIN || e == EWOULDBLOCK) break;
      if (e == EINTR) continue;
      psd_conn_close(c, strerror(e));
      break;
    }
    budget = (size_t)n >= budget ? 0 : budget - (size_t)n;
  }
  psd_server_flush(srv);
  psd_pace_resume(srv);
  if (!c->dead && (c->state == PSD_CONN_CLOSING || ps__outq_pending(&c->out)))
    psd_conn_write(c);
  psd_server_reap(srv);
}
