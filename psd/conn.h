/*
 * conn.h - one client connection as an explicit state machine:
 *
 *   HEADER --24 bytes--> META --meta_len bytes--> dispatch
 *      ^                                             |
 *      +------ frame done <-- DATA (Push/Init items streamed slice by
 *                                   slice into a staging buffer)
 *   any state --bad frame--> CLOSING (error reply queued, input ignored,
 *                                     closed once the reply is written)
 *
 * Before the handshake only a small HELLO is accepted. Lengths are checked
 * (ps__header_decode) before anything is allocated, protobuf is unpacked
 * only from complete frames, and a bad frame closes this connection only.
 */
#ifndef PSD_CONN_H
#define PSD_CONN_H

#include <stddef.h>
#include <stdint.h>

#include "arena.h"
#include "pace.h"
#include "ps.pb-c.h"
#include "ratelog.h"
#include "wire.h"
#include "shard.h"
#include "waiters.h"

struct event;
struct event_base;
struct psd_conn;

typedef enum psd_conn_state {
  PSD_CONN_HEADER,  /* waiting for a frame header */
  PSD_CONN_META,    /* waiting for the protobuf part */
  PSD_CONN_DATA,    /* streaming the tensor items of a Push or Init */
  PSD_CONN_CLOSING, /* an error was sent; close once it is written (final) */
  PSD_CONN_STATE_MAX_
} psd_conn_state;

/* What the layer above does with a connection's traffic; conn.c only
 * frames, checks and hands over. */
typedef struct psd_conn_hooks {
  /* A complete protobuf part of c->hdr.type arrived: act on it (may enter
   * DATA). 0, or -1 if c entered CLOSING. */
  int (*message)(void *ctx, struct psd_conn *c, const uint8_t *meta);
  /* DATA: item c->item is complete in c->stage (as float32: conn.c widens
   * a 16-bit item's data first). */
  void (*item)(void *ctx, struct psd_conn *c);
  /* DATA: the frame's last item is in: reply to it. */
  void (*frame)(void *ctx, struct psd_conn *c);
  /* c is closing (already off the list): forget it. */
  void (*closed)(void *ctx, struct psd_conn *c);
  /* c was just accepted: greet it (the handshake's Challenge). 0, or -1
   * if c entered CLOSING. */
  int (*opened)(void *ctx, struct psd_conn *c);
  /* Answer the pulls that became ready (after input was processed). */
  void (*flush)(void *ctx);
  void *ctx;                  /* passed to every hook */
} psd_conn_hooks;

/* Caps on connections (psd --max-connections, --max-unauthenticated,
 * --max-admin), so neither descriptors nor memory run out for the
 * workers. */
typedef struct psd_conn_limits {
  size_t total;               /* open connections of every kind */
  size_t unauth;              /* connections that have not completed a Hello */
  size_t admin;               /* authenticated admin tools (psctl) */
} psd_conn_limits;

/* What a peer can make psd log, each rate-limited (ratelog.h). */
enum {
  PSD_PLOG_PROTOCOL,  /* an authenticated peer's fatal error */
  PSD_PLOG_HANDSHAKE, /* a fatal error before the handshake completed */
  PSD_PLOG_EVICT,     /* unauthenticated connections evicted for new ones */
  PSD_PLOG_REFUSED,   /* connections refused (every slot authenticated) */
  PSD_PLOG_TRUNCATED, /* peers that closed in the middle of a frame: a kind
                         of its own, so a flood of other failures cannot
                         hide them */
  PSD_PLOG_FAILED,    /* requests answered with a non-fatal Error
                         (psd_conn_error): refused registrations of tables
                         and variables, refused pulls (info lines) */
  PSD_PLOG_PUSH,      /* pushes (and assigns) refused for their data: a step
                         not reached, bad keys, a NaN or infinite gradient */
  PSD_PLOG_KINDS_
};

/* Every connection of the daemon. */
typedef struct psd_conns {
  struct event_base *base;    /* libevent loop the connections use */
  struct psd_conn *head;      /* open connections */
  struct psd_conn *graveyard; /* closed ones awaiting psd_conns_reap */
  uint64_t seq;               /* connection counter, for log names */
  psd_pace *pace;             /* ingress pacing of workers' pushes */
  psd_conn_hooks hooks;       /* the message layer */
  psd_conn_limits lim;        /* caps (psd_conns_init sets unlimited) */
  size_t n_open;              /* connections on the list */
  size_t n_unauth;            /* ... of them not yet authenticated */
  size_t n_admin;             /* ... of them admin tools */
  uint64_t n_evicted;         /* unauthenticated connections evicted */
  struct psd_conn *unauth_head, *unauth_tail; /* unauthenticated, oldest first */
  ps__ratelog plog[PSD_PLOG_KINDS_]; /* rate-limited peer-triggered lines */
} psd_conns;

typedef struct psd_conn {
  psd_conns *reg;             /* registry it belongs to */
  struct psd_conn *prev, *next;  /* registry's list of connections */
  int fd;                     /* socket */
  struct event *rev, *wev;    /* read / write readiness */
  ps__outq out;               /* replies not yet written (params in place) */
  psd_conn_state state;       /* where the input parser is */
  int handshaken;             /* a HELLO was accepted */
  int upgraded;               /* authenticated buffers allocated, counted as
                                 authenticated (conn_upgrade) */
  struct psd_conn *uprev, *unext; /* list of unauthenticated ones */
  uint8_t nonce[PS__NONCE_BYTES]; /* our Challenge's nonce: proofs are bound to it */
  int worker;                 /* worker index, or -1 */
  int admin;                  /* an admin tool (psctl): Stats only */
  int finished;               /* the worker sent FINISH */
  int dead;                   /* closed; memory freed at the next reap */
  int read_paused;            /* requests not read until replies drain */
  int auth_wait;              /* a Hello waits for its MUNGE verdict: nothing
                                 more is read until psd_conn_auth_done */
  psd_pace_peer pace;         /* ingress pacing state (pace.c) */
  uint64_t pace_done;         /* DATA: bytes of this step's Push items done */
  uint64_t seq;               /* connection number, for logs */
  char peer[64];              /* remote address */
  char name[32];              /* "w3" or "conn#7", for logs */
  uint8_t *in;                /* input buffer (headers, protobuf, small data) */
  size_t in_cap, in_off, in_len; /* capacity, start and length of unread bytes */
  ps__frame_header hdr;       /* header of the frame being read */
  psd_arena arena;            /* protobuf unpack memory of this frame */
  ProtobufCAllocator alloc;   /* protobuf-c view of arena */
  Ps__Item **items;           /* DATA: items of the current Push/Init */
  size_t n_items;             /* DATA: how many */
  size_t item;                /* DATA: current item index */
  uint64_t item_got;          /* DATA: bytes of it received */
  uint64_t data_step;         /* DATA: the Push's step */
  uint64_t data_req;          /* DATA: the request id */
  double data_at;             /* DATA: when the last item's bytes were in */
  double agg_s;               /* DATA: seconds spent aggregating its items */
  float *stage;               /* where item data lands before use (a 16-bit
                                 item's values once widened) */
  uint16_t *stage16;          /* where a 16-bit item's data lands (2.3) */
  uint64_t stage16_cap;       /* values in stage16 */
  const float *item_data;     /* DATA: the complete item the item hook gets:
                                 in stage, or in place in the segment */
  ps__shm shm;                /* the worker's shared-memory segment (2.4;
                                 shm.map NULL: none, tensors go over TCP) */
  uint8_t shm_token[PS__SHM_TOKEN_BYTES]; /* announced in its HelloReply: the
                                 handover must present it (shmgate.c) */
  int shm_offered;            /* a token was announced and not used yet */
  const uint8_t *shm_src;     /* DATA of a PS__FLAG_SHM frame: its data in
                                 the push ring (bounds checked) */
  uint64_t shm_pos;           /* ... and its ring position */
  uint64_t blob_len;          /* DATA of a TABLE_* frame: its whole data part
                                 is one item of this many bytes (0: items) */
  int blob_skip;              /* ... read and dropped: the request was refused
                                 before its data came (psd_conn_skip_blob) */
  const void *blob_msg;       /* ... and its unpacked message (in arena) */
  uint64_t stage_cap;         /* floats in stage */
  double stage_used_at;       /* a stage over PS__MAX_SLICE_BYTES: when a
                                 frame last needed a PSD_STAGE_SLACK-th of it */
  int32_t *status;            /* per item result of the current Push */
  int data_assign;            /* DATA: the Init is an assign (Init.assign) */
  int data_rc;                /* DATA: the first refused item of this Push or
                                 assign (0: none; a stale Push item is no refusal) */
  char data_err[256];         /* DATA: ... and its sentence, for the Error or
                                 PushReply.message, so the worker sees psd's why */
  uint64_t *seen;             /* per slice id: last frame that listed it */
  uint64_t seen_seq;          /* frames checked for duplicate slice ids */
  Ps__Item *reply_items;      /* reply building (one per slice, grow-only) */
  Ps__Item **reply_ptrs;
  const float **reply_data;   /* PullReply data segments */
  uint64_t *reply_count;      /* ... their lengths */
  void **reply_refs;          /* ... and the slices they reference */
  size_t reply_cap;
  uint8_t *pack;              /* packed outgoing protobuf */
  size_t pack_cap;
  psd_waitset waits;          /* this connection's pulls (waiters.c) */
  double closing_since;       /* when CLOSING began */
  double opened_at;           /* when accepted (handshake deadline) */
} psd_conn;

/* Sets up an empty registry on base; pace paces its workers. */
void psd_conns_init(psd_conns *cs, struct event_base *base, psd_pace *pace,
                    const psd_conn_hooks *hooks);
/* Takes ownership of an accepted socket. Before that, if the caps on
 * unauthenticated or on all connections are reached, the oldest
 * unauthenticated connection is evicted; if every slot is authenticated,
 * the new one is refused. NULL on failure or refusal (fd closed). Until
 * its handshake, a connection holds only an input buffer for one Hello. */
psd_conn *psd_conn_new(psd_conns *cs, int fd, const char *peer);
/* Closes the oldest unauthenticated connection (logged, rate-limited), to
 * free a descriptor or a slot; one whose Hello waits for its MUNGE verdict
 * only when all do. 1 if there was one, else 0. */
int psd_conns_evict_oldest(psd_conns *cs, const char *why);
/* Closes c: tells the message layer, drops its replies. The memory stays
 * valid (c->dead set) until psd_conns_reap frees it, so any caller up the
 * stack may still test c->dead. Idempotent. */
void psd_conn_close(psd_conn *c, const char *why);
/* Frees closed connections; called at the end of every event callback,
 * when nothing up the stack still refers to them. */
void psd_conns_reap(psd_conns *cs);
/* The open connection numbered seq, or NULL. */
psd_conn *psd_conns_find(psd_conns *cs, uint64_t seq);
/* c's Hello was answered after waiting for its MUNGE verdict: sends the
 * answer and reads again (frames already buffered included). */
void psd_conn_auth_done(psd_conn *c);
/* Closes every connection (psd exits). */
void psd_conns_close_all(psd_conns *cs);
/* 1 if any connection has replies waiting to be written. */
int psd_conns_pending(const psd_conns *cs);
/* Timers: closes connections whose error reply did not drain, refuses
 * those that never completed a handshake, prints the counts of
 * suppressed log lines. */
void psd_conns_tick(psd_conns *cs, double now);
/* Writes what every connection has pending (a write may close one). */
void psd_conns_write_pending(psd_conns *cs);
/* psd_pace_progress_fn of connections: how far p's connection is into
 * the current step's Push (pace.c never reads the parser itself). */
uint64_t psd_conn_pace_progress(const psd_pace_peer *p, uint64_t *step);
/* Makes the per-slice tables of c (reply building, duplicate checks) cover
 * n slices. 0 or -1 (memory). */
int psd_conn_reserve(psd_conn *c, uint32_t n);
/* Starts a duplicate check over the slice ids of one frame. */
static inline void psd_conn_seen_begin(psd_conn *c) { c->seen_seq++; }
/* 1 if id was already listed in this frame (marks it otherwise). */
static inline int psd_conn_seen_twice(psd_conn *c, uint32_t id) {
  if (c->seen[id] == c->seen_seq) return 1;
  c->seen[id] = c->seen_seq;
  return 0;
}
/* Queues one frame: header, packed message, then data segments sent from
 * where they are (refs: the slices whose parameters they are, held until
 * written so no update changes bytes in flight). 0, or -1: too big for a
 * frame (nothing queued), or out of memory, when c also gets a fatal
 * Error (logged): its peer would otherwise wait for the lost frame. */
int psd_conn_send(psd_conn *c, unsigned type, const ProtobufCMessage *msg,
                  const float *const *data, const uint64_t *counts, void *const *refs,
                  size_t nseg);
/* Enters DATA for a frame whose whole data part (bytes > 0) is read as
 * one item into c->stage (TABLE_* frames): the item hook gets it, then the
 * frame hook. 0 or PS_ENOMEM (nothing changed). */
int psd_conn_begin_blob(psd_conn *c, uint64_t bytes);
/* Enters DATA for a TABLE_* frame refused before its data (bytes > 0)
 * came: the bytes are read and dropped (nothing is staged, no hook is
 * called), then the next frame is read. The caller has queued the
 * refusal. */
void psd_conn_skip_blob(psd_conn *c, uint64_t bytes);
/* DATA state for a blob that lies in the push ring (c->shm_src, 2.9): the
 * item hook reads it there, nothing is staged. */
void psd_conn_begin_shm_blob(psd_conn *c);
/* Bytes every open connection holds in memory now beyond its fixed
 * buffers: replies queued and not yet written (copied into the output
 * queue: table rows, detached parameters, headers), or what an output
 * buffer kept between table steps last held (ps__outq_held), and request data
 * staged (a TABLE_PUSH's keys and gradients, a Push item). Counted
 * against --max-memory by the tables (tables.c). */
uint64_t psd_conns_held_bytes(const psd_conns *cs);
/* Queues an Error reply; fatal ones put c in CLOSING. Logged, rate-limited
 * (PSD_PLOG_PROTOCOL or _HANDSHAKE if fatal, else PSD_PLOG_FAILED). A
 * fatal one for a c already CLOSING does nothing: its peer has been told. */
void psd_conn_error(psd_conn *c, uint64_t request_id, int code, int fatal,
                    const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* The frame's protobuf part did not unpack: a fatal Error naming the
 * message, out of memory (the arena could not grow) or malformed. */
void psd_conn_unpack_failed(psd_conn *c);
/* 1 if replies are waiting to be written. */
static inline int psd_conn_pending(const psd_conn *c) { return ps__outq_pending(&c->out); }
/* 1 if c's queued output is above the mark where psd stops reading its
 * requests (the peer does not read its replies): answers due to c that
 * were not asked for just now (parked TablePulls) wait while it is. */
int psd_conn_backlogged(const psd_conn *c);
/* Writes pending output; closes a CLOSING connection once drained. Returns
 * -1 if c is (now) closed. */
int psd_conn_write(psd_conn *c);

/* The one way the input parser's state changes: HEADER -> META -> HEADER
 * for each frame, HEADER -> DATA (a handler starts a Push's items) ->
 * HEADER, and any -> CLOSING, which is final (moving a closing connection
 * is a no-op: a frame's reply hook may have sent the fatal error that
 * closes it). Any other move is a bug: PS_ASSERT. */
void psd_conn_set_state(struct psd_conn *c, psd_conn_state to);

#endif
