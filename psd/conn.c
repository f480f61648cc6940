/* conn.c - the per-connection state machine: framing, checks common to
 * every message, handing them to the message layer (its hooks), writing
 * replies, connection timeouts. */
#include "conn.h"

#include <errno.h>
#include <event2/event.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "invariant.h"
#include "psdlog.h"

/* Input buffer of an authenticated connection for headers, protobuf and
 * small tensors; grows to hold a whole protobuf part (<= PS__MAX_META)
 * only when a frame needs it. */
#define PSD_IN_INITIAL (64u * 1024u)
/* Input buffer before the handshake: the largest frame then allowed (a
 * Hello, ps__header_decode's rule), so an unauthenticated peer costs a
 * small fixed amount; everything else is allocated at conn_upgrade. */
#define PSD_IN_PREAUTH (PS__HEADER_SIZE + PS__MAX_PREAUTH_META)
/* Tensor bytes at least this large are read straight into the staging
 * buffer rather than through the input buffer (saves a copy). */
#define PSD_DIRECT_READ_MIN (16u * 1024u)
/* Bytes read per readiness callback before yielding to other connections,
 * so one fast sender cannot starve the rest. */
#define PSD_READ_BUDGET (32u << 20)
/* Tensor bytes of shared-memory frames applied per readiness callback
 * before yielding (the callback is then scheduled again): such a frame is
 * ~40 bytes on the socket but may name up to a whole ring of data, so the
 * read budget alone would let one connection apply gigabytes at once. */
#define PSD_SHM_BUDGET ((uint64_t)32 << 20)
/* A frame's reply of this many bytes is written before the next buffered
 * frame is taken up: a piece of a pull goes out while psd looks up the
 * next (small replies still go out together). */
#define PSD_EAGER_WRITE ((size_t)64 << 10)
/* Protobuf arena's first block: a Push of ~1000 items fits. */
#define PSD_ARENA_INITIAL (64u * 1024u)
/* Bytes of reply a connection may have queued, copied or referenced in
 * place, before psd stops reading its requests. Both count: a referenced
 * slice is copied out (detached) when an update comes while the reply
 * still waits, so a peer that never reads would otherwise make psd hold one
 * copy of the parameters per unread pull. Above the mark no further request
 * is taken, so one connection holds at most this plus one reply of every
 * slice (pulls parked before the check) and a frame. Honest peers read their
 * replies as they come and stay far below. */
#define PSD_OUT_HIGH_WATER ((size_t)64 << 20)
/* Arena bytes kept between frames: a frame that needed more (many unknown
 * fields, a huge item list) gets its memory back at the reset. */
#define PSD_ARENA_KEEP_MAX ((size_t)4 << 20)
/* Seconds a CLOSING connection may take to drain its error reply. */
#define PSD_CLOSING_MAX_S 2.0
/* Seconds a big staging goes without a frame that needs a
 * PSD_STAGE_SLACK-th of it before it is given back: a step slower than
 * this pays its page faults once per step, a small share. */
#define PSD_STAGE_IDLE_S 2.0
#define PSD_STAGE_SLACK 4
/* Seconds a new connection has to complete its handshake. */
#define PSD_HANDSHAKE_TIMEOUT_S 10.0

/* After a frame: the arena keeps what steady traffic needs. An admin
 * connection (an idle psctl between Stats calls) goes back to the initial
 * sizes of its arena and input buffer, so it holds little between
 * requests whatever its last request was. */
static void frame_reset(psd_conn *c) {
  psd_arena_reset(&c->arena, c->admin ? PSD_ARENA_INITIAL : PSD_ARENA_KEEP_MAX);
  if (!c->admin || c->in_cap <= PSD_IN_INITIAL || c->in_len > PSD_IN_INITIAL) return;
  memmove(c->in, c->in + c->in_off, c->in_len);
  c->in_off = 0;
  uint8_t *nb = realloc(c->in, PSD_IN_INITIAL);
  if (!nb) return; /* keep the bigger one */
  c->in = nb;
  c->in_cap = PSD_IN_INITIAL;
}

/* ---- helpers ----------------------------------------------------------- */

static void on_read(evutil_socket_t fd, short what, void *arg);
static void on_write(evutil_socket_t fd, short what, void *arg);
static void resume_paced(psd_conns *cs);
static void slice_hold(void *ctx, void *ref);
static void slice_release(void *ctx, void *ref);

int psd_conn_reserve(psd_conn *c, uint32_t n) {
  /* Per-item arrays of a frame being read or a reply being built, grown
   * together; seen must start zeroed (ps__grow_all zeroes new elements). */
  const ps__array arrays[] = {
      {(void **)&c->reply_items, sizeof *c->reply_items},
      {(void **)&c->reply_ptrs, sizeof *c->reply_ptrs},
      {(void **)&c->status, sizeof *c->status},
      {(void **)&c->reply_data, sizeof *c->reply_data},
      {(void **)&c->reply_count, sizeof *c->reply_count},
      {(void **)&c->reply_refs, sizeof *c->reply_refs},
      {(void **)&c->seen, sizeof *c->seen},
  };
  return ps__grow_all(arrays, sizeof arrays / sizeof arrays[0], &c->reply_cap, n);
}

void psd_conn_error(psd_conn *c, uint64_t request_id, int code, int fatal,
                    const char *fmt, ...) {
  if (fatal && c->state == PSD_CONN_CLOSING) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (fatal)
    ps__ratelog_say(&c->reg->plog[c->handshaken ? PSD_PLOG_PROTOCOL : PSD_PLOG_HANDSHAKE],
                ps__now(), "%s (%s): %s; closing the connection", c->name, c->peer, msg);
  else
    ps__ratelog_say(&c->reg->plog[PSD_PLOG_FAILED], ps__now(),
                    "%s (%s): request %llu failed: %s", c->name, c->peer,
                    (unsigned long long)request_id, msg);
  Ps__Error e = PS__ERROR__INIT;
  e.request_id = request_id;
  e.code = code;
  e.message = msg;
  e.fatal = fatal;
  /* Out of memory for it too: a fatal one still closes c, which the
   * peer sees; a lost non-fatal one would leave it waiting. */
  if (ps__outq_frame(&c->out, PS__MSG_ERROR, &e.base, NULL, NULL, NULL, 0) != 0 && !fatal) {
    psd_conn_error(c, 0, PS_ENOMEM, 1, "out of memory queueing an error reply (%s)", msg);
    return;
  }
  if (fatal && c->state != PSD_CONN_CLOSING) {
    psd_conn_set_state(c, PSD_CONN_CLOSING);
    c->closing_since = ps__now();
    event_del(c->rev);
  }
}

void psd_conn_unpack_failed(psd_conn *c) {
  if (c->arena.failed)
    psd_conn_error(c, 0, PS_ENOMEM, 1, "out of memory unpacking a %s message (%u bytes)",
                   ps__msg_name(c->hdr.type), c->hdr.meta_len);
  else
    psd_conn_error(c, 0, PS_EPROTO, 1, "malformed %s message (%u bytes)",
                   ps__msg_name(c->hdr.type), c->hdr.meta_len);
}

int psd_conn_send(psd_conn *c, unsigned type, const ProtobufCMessage *msg,
                  const float *const *data, const uint64_t *counts, void *const *refs,
                  size_t nseg) {
  int rc = ps__outq_frame(&c->out, type, msg, data, counts, refs, nseg);
  if (rc == PS_ENOMEM)
    psd_conn_error(c, 0, rc, 1, "out of memory queueing a %s frame", ps__msg_name(type));
  return rc ? -1 : 0;
}

/* ---- lifecycle ----------------------------------------------------------- */

void psd_conns_init(psd_conns *cs, struct event_base *base, psd_pace *pace,
                    const psd_conn_hooks *hooks) {
  memset(cs, 0, sizeof *cs);
  cs->base = base;
  cs->pace = pace;
  cs->hooks = *hooks;
  cs->lim = (psd_conn_limits){SIZE_MAX, SIZE_MAX, SIZE_MAX};
  static const char *const what[PSD_PLOG_KINDS_] = {
      "protocol errors", "failed handshakes", "evictions", "refused connections",
      "truncated frames", "failed requests", "refused pushes"};
  for (int k = 0; k < PSD_PLOG_KINDS_; k++) {
    cs->plog[k].what = what[k];
    cs->plog[k].level = k == PSD_PLOG_FAILED ? PSD_LOG_INFO : PSD_LOG_WARN;
  }
}

/* ---- admission: caps and the list of unauthenticated connections ------- */

static void unauth_unlink(psd_conn *c) {
  psd_conns *cs = c->reg;
  if (c->uprev) c->uprev->unext = c->unext;
  else cs->unauth_head = c->unext;
  if (c->unext) c->unext->uprev = c->uprev;
  else cs->unauth_tail = c->uprev;
  c->uprev = c->unext = NULL;
  cs->n_unauth--;
}

int psd_conns_evict_oldest(psd_conns *cs, const char *why) {
  /* A connection whose Hello waits for its MUNGE verdict has done its
   * part: it goes only when every other one is in the same state. */
  psd_conn *c = cs->unauth_head;
  while (c && c->auth_wait && c->unext) c = c->unext;
  if (c && c->auth_wait) c = cs->unauth_head;
  if (!c) return 0;
  cs->n_evicted++;
  ps__ratelog_say(&cs->plog[PSD_PLOG_EVICT], ps__now(),
              "%s (%s): evicted after %.1f s without a handshake: %s", c->name, c->peer,
              ps__now() - c->opened_at, why);
  psd_conn_close(c, "evicted");
  return 1;
}

/* Makes room for one more connection. 0, or -1 if every slot is held by
 * an authenticated connection (the new one is refused). */
static int admit(psd_conns *cs, const char *peer) {
  if (cs->n_unauth >= cs->lim.unauth)
    psd_conns_evict_oldest(cs, "the unauthenticated connections are at --max-unauthenticated");
  if (cs->n_open >= cs->lim.total)
    psd_conns_evict_oldest(cs, "the connections are at --max-connections");
  if (cs->n_open < cs->lim.total) return 0;
  ps__ratelog_say(&cs->plog[PSD_PLOG_REFUSED], ps__now(),
              "refused a connection from %s: %zu connections, all authenticated, are at "
              "--max-connections",
              peer, cs->n_open);
  return -1;
}

/* The handshake is done: c is counted as authenticated and gets the
 * buffers of a working connection. 0, or -1 if c entered CLOSING. */
static int conn_upgrade(psd_conn *c) {
  psd_conns *cs = c->reg;
  c->upgraded = 1;
  unauth_unlink(c);
  if (c->admin) {
    if (cs->n_admin >= cs->lim.admin) {
      psd_conn_error(c, 0, PS_EBUSY, 1, "too many admin connections (--max-admin %zu)",
                     cs->lim.admin);
      c->admin = 0; /* not counted */
      return -1;
    }
    cs->n_admin++;
  }
  if (c->in_cap < PSD_IN_INITIAL &&
      ps__grow((void **)&c->in, &c->in_cap, PSD_IN_INITIAL, 1) != 0) {
    psd_conn_error(c, 0, PS_ENOMEM, 1, "out of memory for a connection's buffers");
    return -1;
  }
  c->arena.buf = malloc(PSD_ARENA_INITIAL);
  if (!c->arena.buf) {
    psd_conn_error(c, 0, PS_ENOMEM, 1, "out of memory for a connection's buffers");
    return -1;
  }
  c->arena.cap = PSD_ARENA_INITIAL;
  return 0;
}

psd_conn *psd_conn_new(psd_conns *cs, int fd, const char *peer) {
  if (admit(cs, peer) != 0) {
    close(fd);
    return NULL;
  }
  psd_conn *c = calloc(1, sizeof *c);
  if (!c) {
    ps__ratelog_say(&cs->plog[PSD_PLOG_REFUSED], ps__now(),
                    "refused a connection from %s: out of memory", peer);
    close(fd);
    return NULL;
  }
  c->reg = cs;
  c->fd = fd;
  c->worker = -1;
  c->waits.owner = c;
  c->seq = ++cs->seq;
  c->opened_at = ps__now();
  snprintf(c->peer, sizeof c->peer, "%s", peer);
  snprintf(c->name, sizeof c->name, "conn#%llu", (unsigned long long)c->seq);
  c->in_cap = PSD_IN_PREAUTH;
  c->in = malloc(c->in_cap);
  c->alloc = psd_arena_allocator(&c->arena);
  c->out.hold = slice_hold;
  c->out.release = slice_release;
  c->out.ctx = NULL;
  c->out.keep_recent = 1; /* a table job's replies reuse their buffer (counted: held_bytes) */
  c->rev = event_new(cs->base, fd, EV_READ | EV_PERSIST, on_read, c);
  c->wev = event_new(cs->base, fd, EV_WRITE | EV_PERSIST, on_write, c);
  c->next = cs->head;
  if (cs->head) cs->head->prev = c;
  cs->head = c;
  cs->n_open++;
  c->uprev = cs->unauth_tail;
  if (cs->unauth_tail) cs->unauth_tail->unext = c;
  else cs->unauth_head = c;
  cs->unauth_tail = c;
  cs->n_unauth++;
  if (!c->in || !c->rev || !c->wev || event_add(c->rev, NULL) != 0) {
    ps__ratelog_say(&cs->plog[PSD_PLOG_REFUSED], ps__now(),
                    "refused a connection from %s: out of memory for its buffers", peer);
    psd_conn_close(c, "out of memory");
    return NULL;
  }
  psd_debug("%s: connection from %s", c->name, c->peer);
  if (cs->hooks.opened && cs->hooks.opened(cs->hooks.ctx, c) != 0) {
    psd_conn_write(c); /* the error goes out; c closes once it drains */
    return NULL;
  }
  return c;
}

void psd_conn_close(psd_conn *c, const char *why) {
  /* Detach from everything now; free the memory later (conn_free from
   * psd_conns_reap), since callers up the stack may still look at c. */
  if (c->dead) return;
  c->dead = 1;
  psd_conns *cs = c->reg;
  if (c->prev) c->prev->next = c->next;
  else if (cs->head == c) cs->head = c->next;
  if (c->next) c->next->prev = c->prev;
  c->prev = NULL;
  cs->n_open--;
  if (!c->upgraded) unauth_unlink(c);
  else if (c->admin) cs->n_admin--;
  c->next = cs->graveyard;
  cs->graveyard = c;
  psd_debug("%s (%s): closed: %s", c->name, c->peer, why);
  cs->hooks.closed(cs->hooks.ctx, c); /* its pulls, pacing and worker go */
  resume_paced(cs); /* nobody waits for c any more */
  if (c->rev) event_del(c->rev);
  if (c->wev) event_del(c->wev);
  ps__outq_free(&c->out); /* releases the slices its replies referenced */
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
}

static void conn_free(psd_conn *c) {
  if (c->rev) event_free(c->rev);
  if (c->wev) event_free(c->wev);
  psd_arena_destroy(&c->arena);
  free(c->in);
  free(c->stage);
  free(c->stage16);
  free(c->status);
  free(c->seen);
  free(c->reply_items);
  free(c->reply_ptrs);
  free(c->reply_data);
  free(c->reply_count);
  free(c->reply_refs);
  free(c->pack);
  ps__shm_unmap(&c->shm);
  free(c);
}

int psd_conn_backlogged(const psd_conn *c) {
  return ps__outq_bytes(&c->out) > PSD_OUT_HIGH_WATER;
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
    if (!c->pace.paused && !c->auth_wait) {
      event_add(c->rev, NULL);
      event_active(c->rev, EV_READ, 0); /* frames may be buffered already */
    }
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
  psd_conns *cs = c->reg;
  psd_conn_write(c);
  psd_conns_reap(cs);
}

void psd_conns_reap(psd_conns *cs) {
  while (cs->graveyard) {
    psd_conn *c = cs->graveyard;
    cs->graveyard = c->next;
    conn_free(c);
  }
}

psd_conn *psd_conns_find(psd_conns *cs, uint64_t seq) {
  for (psd_conn *c = cs->head; c; c = c->next)
    if (c->seq == seq && !c->dead) return c;
  return NULL;
}

void psd_conn_auth_done(psd_conn *c) {
  c->auth_wait = 0;
  if (c->dead) return;
  if (c->handshaken && !c->upgraded && conn_upgrade(c) != 0) return;
  if (psd_conn_write(c) != 0) return;
  if (c->state != PSD_CONN_CLOSING && !c->read_paused && !c->pace.paused) {
    event_add(c->rev, NULL);
    event_active(c->rev, EV_READ, 0); /* frames may be buffered already */
  }
}

/* A staging over PS__MAX_SLICE_BYTES (TABLE_PUSH data; no dense item
 * needs that much) is kept while frames keep using it (fresh pages cost a
 * 1M x 16 push 72 MB of page faults a step), however many small ones come
 * between (a pull in pieces sends several), and goes after
 * PSD_STAGE_IDLE_S unused (psd_conns_tick). Counted (psd_conns_held_bytes). */
static void stage_free(psd_conn *c) {
  free(c->stage);
  c->stage = NULL;
  c->stage_cap = 0;
}

static int stage_big(const psd_conn *c) {
  return c->stage_cap * sizeof(float) > PS__MAX_SLICE_BYTES;
}

static void stage_note(psd_conn *c) {
  if (stage_big(c) && c->blob_len >= c->stage_cap * sizeof(float) / PSD_STAGE_SLACK)
    c->stage_used_at = ps__now();
}

void psd_conns_close_all(psd_conns *cs) {
  while (cs->head) {
    psd_conn *c = cs->head;
    c->worker = -1; /* no lifecycle decisions while tearing down */
    psd_conn_close(c, "server exiting");
  }
  psd_conns_reap(cs);
}

uint64_t psd_conns_held_bytes(const psd_conns *cs) {
  uint64_t b = 0;
  for (const psd_conn *c = cs->head; c; c = c->next)
    b += ps__outq_held(&c->out) + c->stage_cap * sizeof(float) +
         c->stage16_cap * sizeof(uint16_t);
  return b;
}

int psd_conns_pending(const psd_conns *cs) {
  for (const psd_conn *c = cs->head; c; c = c->next)
    if (psd_conn_pending(c)) return 1;
  return 0;
}

void psd_conns_tick(psd_conns *cs, double now) {
  for (int k = 0; k < PSD_PLOG_KINDS_; k++) ps__ratelog_flush(&cs->plog[k], now, 0);
  for (psd_conn *c = cs->head, *next; c; c = next) {
    next = c->next;
    if (c->state == PSD_CONN_CLOSING && now - c->closing_since > PSD_CLOSING_MAX_S) {
      psd_conn_close(c, "error reply not drained in time");
      continue;
    }
    if (!c->handshaken && c->state != PSD_CONN_CLOSING &&
        now - c->opened_at > PSD_HANDSHAKE_TIMEOUT_S) {
      /* Idle unauthenticated peers must not hold descriptors forever. */
      psd_conn_error(c, 0, PS_ETIMEDOUT, 1, "no handshake within %.0f s",
                     PSD_HANDSHAKE_TIMEOUT_S);
      psd_conn_write(c);
    }
    if (stage_big(c) && c->state == PSD_CONN_HEADER && now - c->stage_used_at > PSD_STAGE_IDLE_S)
      stage_free(c);
  }
}

void psd_conns_write_pending(psd_conns *cs) {
  for (psd_conn *c = cs->head, *next; c; c = next) {
    next = c->next;
    if (psd_conn_pending(c)) psd_conn_write(c);
  }
}

/* ---- pacing ------------------------------------------------------------- */

#define CONN_OF_PACE(p) ((psd_conn *)((char *)(p) - offsetof(psd_conn, pace)))

uint64_t psd_conn_pace_progress(const psd_pace_peer *p, uint64_t *step) {
  const psd_conn *c = CONN_OF_PACE(p);
  *step = c->data_step;
  if (c->dead || c->state != PSD_CONN_DATA || c->hdr.type != PS__MSG_PUSH) return UINT64_MAX;
  return c->pace_done + c->item_got;
}

/* Reads again from the connections pacing no longer holds. */
static void resume_paced(psd_conns *cs) {
  for (psd_pace_peer *p = psd_pace_resume(cs->pace); p; p = p->resume_next) {
    psd_conn *c = CONN_OF_PACE(p);
    if (!c->dead && !c->read_paused && !c->auth_wait) event_add(c->rev, NULL);
  }
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

/* ---- dispatch ------------------------------------------------------------ */

/* A whole protobuf part is in; act on it. Returns 0 or -1 (CLOSING). */
static int dispatch(psd_conn *c, const uint8_t *meta) {
  unsigned t = c->hdr.type;
  if (t != PS__MSG_PUSH && t != PS__MSG_INIT && t != PS__MSG_TABLE_PULL &&
      t != PS__MSG_TABLE_PUSH && c->hdr.data_len != 0) {
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
  psd_conn_hooks *k = &c->reg->hooks;
  return k->message(k->ctx, c, meta);
}

/* One Push/Init item has fully arrived: a 16-bit one is widened into
 * c->stage, where the hook finds every item as float32. */
static void item_done(psd_conn *c) {
  psd_conn_hooks *k = &c->reg->hooks;
  if (c->blob_skip) return; /* refused already: its bytes were dropped */
  const Ps__Item *it = c->blob_len ? NULL : c->items[c->item];
  if (it && it->dtype != PS__DT_F32)
    ps__wire_decode(it->dtype, c->stage, c->stage16, it->count);
  k->item(k->ctx, c);
}

void psd_conn_set_state(psd_conn *c, psd_conn_state to) {
  static const unsigned char ok[PSD_CONN_STATE_MAX_][PSD_CONN_STATE_MAX_] = {
      [PSD_CONN_HEADER] = {[PSD_CONN_META] = 1, [PSD_CONN_DATA] = 1, [PSD_CONN_CLOSING] = 1},
      [PSD_CONN_META] = {[PSD_CONN_HEADER] = 1, [PSD_CONN_CLOSING] = 1},
      [PSD_CONN_DATA] = {[PSD_CONN_HEADER] = 1, [PSD_CONN_CLOSING] = 1},
  };
  if (c->state == PSD_CONN_CLOSING) return;
  PS_ASSERT((unsigned)to < PSD_CONN_STATE_MAX_ && ok[c->state][to]);
  c->state = to;
}

/* The last item of a Push/Init is in: reply and go back to HEADER. */
static void frame_done(psd_conn *c) {
  psd_conn_hooks *k = &c->reg->hooks;
  k->frame(k->ctx, c);
  c->items = NULL;
  c->n_items = 0;
  stage_note(c);
  c->blob_len = 0;
  c->blob_skip = 0;
  c->shm_src = NULL;
  psd_conn_set_state(c, PSD_CONN_HEADER);
  frame_reset(c);
}

/* Bytes of the DATA item being read (its dtype's size each, checked by
 * the message layer). */
static uint64_t item_len(const psd_conn *c) {
  if (c->blob_len) return c->blob_len;
  const Ps__Item *it = c->items[c->item];
  return it->count * ps__dtype_size(it->dtype);
}

/* Where the DATA item's bytes land: c->stage, or c->stage16 for 16-bit. */
static char *item_dst(const psd_conn *c) {
  if (!c->blob_len && c->items[c->item]->dtype != PS__DT_F32) return (char *)c->stage16;
  return (char *)c->stage;
}

/* DATA state for one blob of bytes: staged (skip 0) or read and dropped. */
static void start_blob(psd_conn *c, uint64_t bytes, int skip) {
  c->items = NULL;
  c->n_items = 1;
  c->item = 0;
  c->item_got = 0;
  c->blob_len = bytes;
  c->blob_skip = skip;
  psd_conn_set_state(c, PSD_CONN_DATA);
}

int psd_conn_begin_blob(psd_conn *c, uint64_t bytes) {
  uint64_t floats = (bytes + sizeof(float) - 1) / sizeof(float);
  if (floats > c->stage_cap) {
    float *ns = NULL;
    if (posix_memalign((void **)&ns, 64, floats * sizeof(float)) != 0) return PS_ENOMEM;
    free(c->stage);
    c->stage = ns;
    c->stage_cap = floats;
  }
  start_blob(c, bytes, 0);
  return 0;
}

void psd_conn_skip_blob(psd_conn *c, uint64_t bytes) { start_blob(c, bytes, 1); }

void psd_conn_begin_shm_blob(psd_conn *c) { start_blob(c, c->hdr.data_len, 0); }

/* A PS__FLAG_SHM frame's position (desc, after its protobuf part): its
 * data must lie inside the push ring of a segment this connection handed
 * over, else the frame is a fatal protocol error. Sets c->shm_src (NULL
 * for a frame without the flag). 0 or -1 (CLOSING). */
static int shm_locate(psd_conn *c, const uint8_t *desc) {
  c->shm_src = NULL;
  if (!(c->hdr.flags & PS__FLAG_SHM)) return 0;
  if (!c->shm.map) {
    psd_conn_error(c, 0, PS_EPROTO, 1,
                   "%s frame with its data in shared memory, but this connection handed "
                   "over no segment", ps__msg_name(c->hdr.type));
    return -1;
  }
  uint64_t pos = ps__shm_desc_decode(desc);
  const void *p = ps__shm_locate(&c->shm.push, pos, c->hdr.data_len);
  if (!p) {
    psd_conn_error(c, 0, PS_EPROTO, 1,
                   "%s frame's %llu data bytes at ring position %llu are not inside the "
                   "%llu-byte push ring", ps__msg_name(c->hdr.type),
                   (unsigned long long)c->hdr.data_len, (unsigned long long)pos,
                   (unsigned long long)c->shm.push.size);
    return -1;
  }
  c->shm_src = p;
  c->shm_pos = pos;
  return 0;
}

/* A PS__FLAG_SHM Push or Init whose items begin_data checked (or a
 * TablePush, one blob): each item
 * is handed over where it lies in the push ring (no copy), pulls it
 * completes are answered at once, then the ring space is given back and
 * the frame answered. The peer may rewrite the bytes meanwhile: that only
 * changes its own gradient or values, never where psd reads (every
 * offset was checked against the ring). 1, or -1 if c closed. */
static int shm_items(psd_conn *c, uint64_t *shm_budget) {
  const uint8_t *p = c->shm_src;
  psd_conn_hooks *k = &c->reg->hooks;
  if (c->blob_len) { /* a TablePush (2.9): the item hook reads it in place */
    item_done(c);
    if (c->dead || c->state != PSD_CONN_DATA) return -1;
    c->item = c->n_items;
  }
  for (size_t i = 0; i < c->n_items && !c->blob_len; i++) {
    /* 16-bit items travel over TCP only (§1a): handed over in place they
     * would need a second staging copy, which the segment exists to avoid */
    if (c->items[i]->dtype != PS__DT_F32) {
      psd_conn_error(c, c->data_req, PS_EPROTO, 1,
                     "%s frame in shared memory carries a %s item: 16-bit items travel "
                     "over TCP only", ps__msg_name(c->hdr.type),
                     ps__dtype_name(c->items[i]->dtype));
      return -1;
    }
  }
  while (c->item < c->n_items) {
    c->item_data = (const float *)(const void *)p;
    p += c->items[c->item]->count * sizeof(float);
    item_done(c);
    c->item++;
    /* Answer pulls as slices complete; after the last one the read
     * callback's flush sends them with the PushReply, in one write (a
     * flush here cost a small step a write and a wake-up of its own). */
    if (c->item < c->n_items) k->flush(k->ctx);
    if (c->dead || c->state != PSD_CONN_DATA) return -1;
  }
  ps__shm_store(c->shm.push_done, c->shm_pos + c->hdr.data_len);
  *shm_budget = c->hdr.data_len >= *shm_budget ? 0 : *shm_budget - c->hdr.data_len;
  frame_done(c);
  return 1;
}

/* Makes progress on buffered input, charging shared-memory data to
 * *shm_budget. Returns 1 if it did, 0 if it needs more bytes, -1 if the
 * connection entered CLOSING. */
static int step(psd_conn *c, uint64_t *shm_budget) {
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
    psd_conn_set_state(c, PSD_CONN_META);
    return 1;
  }
  case PSD_CONN_META: {
    size_t mb = (size_t)ps__frame_meta_bytes(&c->hdr); /* + a segment position */
    if (c->in_len < mb) {
      if (c->in_off + mb > c->in_cap) {
        /* Make room for the whole protobuf part (bounded by PS__MAX_META). */
        if (c->in_off) {
          memmove(c->in, c->in + c->in_off, c->in_len);
          c->in_off = 0;
        }
        if (mb > c->in_cap && ps__grow((void **)&c->in, &c->in_cap, mb, 1) != 0) {
          psd_conn_error(c, 0, PS_ENOMEM, 1, "out of memory for a %zu-byte message", mb);
          return -1;
        }
      }
      return 0;
    }
    const uint8_t *meta = c->in + c->in_off;
    if (shm_locate(c, meta + c->hdr.meta_len) != 0) return -1;
    c->in_off += mb;
    c->in_len -= mb;
    psd_conn_set_state(c, PSD_CONN_HEADER);
    if (dispatch(c, meta) != 0) return -1;
    if (c->state == PSD_CONN_DATA && c->n_items == 0) frame_done(c);
    else if (c->state == PSD_CONN_DATA && c->shm_src) return shm_items(c, shm_budget);
    else if (c->state == PSD_CONN_HEADER) frame_reset(c);
    if (c->handshaken && !c->upgraded && conn_upgrade(c) != 0) return -1;
    return 1;
  }
  case PSD_CONN_DATA: {
    uint64_t need = item_len(c) - c->item_got;
    uint64_t take = c->in_len < need ? c->in_len : need;
    if (take == 0 && need > 0) return 0;
    if (!c->blob_skip) memcpy(item_dst(c) + c->item_got, c->in + c->in_off, take);
    c->in_off += take;
    c->in_len -= take;
    c->item_got += take;
    if (c->item_got == item_len(c)) {
      c->item_data = c->stage;
      item_done(c);
      c->item++;
      c->item_got = 0;
      if (c->item == c->n_items) frame_done(c);
    }
    return 1;
  }
  case PSD_CONN_CLOSING:
  case PSD_CONN_STATE_MAX_: /* never a state (psd_conn_set_state) */
    return 0;
  }
  return 0;
}

static void on_read(evutil_socket_t fd, short what, void *arg) {
  (void)what;
  psd_conn *c = arg;
  psd_conns *cs = c->reg;
  size_t budget = PSD_READ_BUDGET;
  uint64_t shm_budget = PSD_SHM_BUDGET;
  while (!c->dead && c->state != PSD_CONN_CLOSING) {
    int r = 1;
    /* Buffered frames too wait while the output is over the mark. */
    size_t queued = ps__outq_bytes(&c->out);
    while (!c->auth_wait && queued <= PSD_OUT_HIGH_WATER && shm_budget &&
           (r = step(c, &shm_budget)) > 0 && !c->dead) {
      /* Not while the socket is full (the write event is armed then). */
      if (c->in_len && ps__outq_bytes(&c->out) >= queued + PSD_EAGER_WRITE &&
          !event_pending(c->wev, EV_WRITE, NULL) && psd_conn_write(c) != 0)
        break;
      queued = ps__outq_bytes(&c->out);
    }
    if (r < 0 || c->dead) break;
    if (!shm_budget) {
      /* Other connections first; the frames already buffered are taken
       * up again by this callback, run once more when the loop comes
       * round (no socket readiness would call it). */
      event_active(c->rev, EV_READ, 0);
      break;
    }
    if (c->auth_wait) {
      event_del(c->rev); /* psd_conn_auth_done reads again */
      break;
    }
    if (ps__outq_bytes(&c->out) > PSD_OUT_HIGH_WATER) {
      /* The peer is not reading its replies: stop reading its requests
       * until they drain (bounds the memory one peer can make us use). */
      c->read_paused = 1;
      event_del(c->rev);
      break;
    }
    if (budget == 0) break;
    if (psd_pace_hold(cs->pace, &c->pace)) {
      event_del(c->rev); /* ahead of the slowest worker: let TCP back off */
      break;
    }
    ssize_t n;
    if (c->state == PSD_CONN_DATA && c->in_len == 0 && !c->blob_skip &&
        item_len(c) - c->item_got >= PSD_DIRECT_READ_MIN) {
      /* Big tensor: straight into the staging buffer. */
      uint64_t need = item_len(c) - c->item_got;
      n = read(fd, item_dst(c) + c->item_got, need);
      if (n > 0) {
        c->item_got += (uint64_t)n;
        if (c->item_got == item_len(c)) {
          c->item_data = c->stage;
          item_done(c);
          c->item++;
          c->item_got = 0;
          if (c->item == c->n_items) frame_done(c);
          /* Answer pulls as slices complete, not only at the frame's end. */
          cs->hooks.flush(cs->hooks.ctx);
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
        ps__ratelog_say(&cs->plog[PSD_PLOG_TRUNCATED], ps__now(),
                        "%s (%s): connection closed in the middle of a frame", c->name,
                        c->peer);
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
  cs->hooks.flush(cs->hooks.ctx);
  resume_paced(cs);
  if (!c->dead && (c->state == PSD_CONN_CLOSING || ps__outq_pending(&c->out)))
    psd_conn_write(c);
  psd_conns_reap(cs);
}
