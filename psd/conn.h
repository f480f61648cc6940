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

#include "ps.pb-c.h"
#include "ps_internal.h"
#include "shard.h"
#include "waiters.h"

struct psd_server;
struct event;

typedef enum psd_conn_state {
  PSD_CONN_HEADER,  /* waiting for a frame header */
  PSD_CONN_META,    /* waiting for the protobuf part */
  PSD_CONN_DATA,    /* streaming the tensor items of a Push or Init */
  PSD_CONN_CLOSING  /* an error was sent; close once it is written */
} psd_conn_state;

/* Bump allocator for protobuf-c unpacking, reset after every frame, so a
 * steady stream of frames allocates nothing. */
typedef struct psd_arena {
  char *buf;          /* main block */
  size_t cap, used;   /* its size and bytes handed out */
  void **extra;       /* overflow blocks until the next reset */
  size_t n_extra, cap_extra, extra_bytes;
} psd_arena;

typedef struct psd_conn {
  struct psd_server *srv;     /* owner */
  struct psd_conn *prev, *next;  /* server's list of connections */
  int fd;                     /* socket */
  struct event *rev, *wev;    /* read / write readiness */
  ps__outq out;               /* replies not yet written (params in place) */
  psd_conn_state state;       /* where the input parser is */
  int handshaken;             /* a HELLO was accepted */
  int worker;                 /* worker index, or -1 */
  int admin;                  /* an admin tool (psctl): Stats only */
  int finished;               /* the worker sent FINISH */
  int dead;                   /* closed; memory freed at the next reap */
  int read_paused;            /* requests not read until replies drain */
  int pace_paused;            /* Push not read: ahead of the slowest (pace.c) */
  int pace_exempt;            /* over loopback: shares no link, never paced */
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
  float *stage;               /* where item data lands before use */
  uint64_t stage_cap;         /* floats in stage */
  int32_t *status;            /* per item result of the current Push */
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

/* Takes ownership of an accepted socket. NULL on failure (fd closed). */
psd_conn *psd_conn_new(struct psd_server *srv, int fd, const char *peer);
/* Closes c: removes its waiters, tells the server, drops its replies. The
 * memory stays valid (c->dead set) until psd_server_reap frees it, so any
 * caller up the stack may still test c->dead. Idempotent. */
void psd_conn_close(psd_conn *c, const char *why);
/* Frees a closed connection's memory (psd_server_reap only). */
void psd_conn_free(psd_conn *c);
/* Queues an Error reply; fatal ones put c in CLOSING. */
void psd_conn_error(psd_conn *c, uint64_t request_id, int code, int fatal,
                    const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Builds PullReply frames for c's ready waiters and writes what it can. */
void psd_conn_flush(psd_conn *c);
/* psd_waiters_expire callback (ctx unused): tells the owner of set that
 * w's request timed out. */
void psd_conn_pull_expired(void *ctx, psd_waitset *set, const psd_waiter *w);
/* 1 if replies are waiting to be written. */
static inline int psd_conn_pending(const psd_conn *c) { return ps__outq_pending(&c->out); }
/* Writes pending output; closes a CLOSING connection once drained. Returns
 * -1 if c is (now) closed. */
int psd_conn_write(psd_conn *c);

#endif
