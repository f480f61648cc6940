/*
 * client_internal.h - the pieces of libpsclient's client shared by its
 * files (names ps__): the client, connection, variable and request structs
 * and the functions one concept offers the others. Not installed.
 *
 * The files form layers: each calls only files below it, so no file calls
 * back into one that calls it (tests/structure_test.py checks it).
 *
 *   client.c    create (connect, handshake), destroy, configuration, accessors
 *   trainstep.c ps_client_step / pull / finish, the chief's checkpoints, stop
 *   var.c       variables: placement, registration, initialization, undo
 *   tableapi.c  sparse tables: config, create, find, add_grad, the public
 *               pull and push calls, the step's table requests
 *   transfer.c  Push and Pull frames (never waits)
 *   pump.c      the poll loop, and every wait: ps_req_wait / destroy
 *   reader.c    a connection's frame reader (enum states, direct reads)
 *   reply.c     what each reply type does to requests and variables
 *   tablexfer.c TABLE_* frames out (keys sorted, split by ps) and their
 *               replies (rows read into the request, scattered at the end)
 *   keysort.c   radix sort of (key, position) pairs, grouping by ps
 *   slicemap.c  per server: its slice id -> our slice
 *   shmsetup.c  the shared-memory segment handed to a ps of this node
 *   srvconn.c   sockets, connecting, queueing and flushing frames, breaking
 *   request.c   in-flight requests, looked up by id in a table
 *   errmsg.c    the last error's text
 *   init.c, sized.c, ps_telemetry.c, signals.c: helpers the files above
 *               use, calling none of them (initializers, the public structs
 *               that carry their size, per-step records, the SIGTERM and
 *               SIGUSR1 handlers that start a stop)
 */
#ifndef PS_CLIENT_INTERNAL_H
#define PS_CLIENT_INTERNAL_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "ps.pb-c.h"
#include "backoff.h"
#include "wire.h"
#include "ps_telemetry.h"
#include "psclient.h"

/* Input buffer for reply headers and protobuf; big tensors bypass it. */
#define PS__IN_INITIAL (64u * 1024u)
/* Tensor bytes at least this large are read straight into variables. */
#define PS__DIRECT_READ_MIN (16u * 1024u)
/* Push data per frame through shared memory: psd applies one frame's
 * slices while the worker copies the next frame's into the ring. */
#define PS__SHM_FRAME_BYTES ((uint64_t)4 << 20)
/* Longest wait for psd's answer to a segment handover (bounded further by
 * the connect deadline). */
#define PS__SHM_HANDOVER_MS 10000
/* Socket buffers: large enough that a 4 MiB slice is in flight at once. */
#define PS__SOCK_BUF (4 << 20)
/* Default waits. */
#define PS__DEFAULT_CONNECT_MS 60000
/* While a ps cannot be reached, a line on stderr this often (seconds)
 * names it: a wrong PS_HOSTS is not silent for the whole connect timeout. */
#define PS__CONNECT_LOG_S 3.0
/* The handshake may take this long past the connect deadline (a connection
 * made at the deadline still completes it). */
#define PS__HANDSHAKE_S 10.0
/* Waits before a handshake psd closed is tried again (it shed us for a
 * newer connection under a flood): from 20 ms, doubling to 0.5 s,
 * jittered, so a restarted worker gets back within a second of a flood's
 * end. */
#define PS__HANDSHAKE_RETRY_FIRST_S 0.02
#define PS__HANDSHAKE_RETRY_MAX_S 0.5
/* Waits between attempts to connect to a ps that does not listen yet: from
 * 50 ms, doubling to 1 s, jittered. */
#define PS__CONNECT_RETRY_FIRST_S 0.05
#define PS__CONNECT_RETRY_MAX_S 1.0
#define PS__DEFAULT_REQUEST_MS 600000
/* A ps on a node that died sends no FIN: TCP keepalive probes after 5 s of
 * silence, every 2 s, 3 times, and unacknowledged data gives up after 15 s,
 * so a worker notices a dead server within seconds, not at its request
 * timeout (a healthy but slow step keeps the connection acknowledged). */
#define PS__KEEPIDLE_S 5
#define PS__KEEPINTVL_S 2
#define PS__KEEPCNT 3
#define PS__USER_TIMEOUT_MS 15000
/* Rounds the chief tries to agree on a checkpoint step with the servers
 * before giving up (each round moves to the most advanced server's step;
 * in sync training the first round almost always succeeds). */
#define PS__CKPT_ROUNDS 8

/* What a request is for (ps_req.type). */
enum { PS__REQ_PUSH = 1, PS__REQ_PULL, PS__REQ_REGISTER, PS__REQ_INIT, PS__REQ_FINISH,
       PS__REQ_CHECKPOINT,
       PS__REQ_TREGISTER, /* TableRegister to every ps (reg_table) */
       PS__REQ_TPULL,     /* TablePull of keys (tp: the rows come into it) */
       PS__REQ_TSTEP,     /* zero-key TablePulls: only waits for tables' steps */
       PS__REQ_TPUSH };   /* TablePush frames (one or more tables) */

/* What the data of the frame being read is (ps__conn.data_kind). */
enum { PS__DATA_PULL = 0, PS__DATA_TABLE = 1 };

/* A PullReply item read as 16-bit values into the connection's staging:
 * widened into the variable once the frame's data is in. */
typedef struct ps__widen {
  float *dst;         /* the slice in ps_var_data() */
  uint64_t off;       /* its first byte in ps__conn.wire16 */
  uint64_t count;     /* values */
  uint32_t dtype;     /* PS__DT_BF16 or PS__DT_FP16 */
} ps__widen;

/* Where the frame reader of a connection is. */
typedef enum ps__rd_state {
  PS__RD_HEADER = 0, /* waiting for the 24-byte header */
  PS__RD_META,       /* waiting for the protobuf part */
  PS__RD_DATA        /* streaming a PullReply's tensor data to its slices */
} ps__rd_state;

/* No slice: a free by_remote entry, or a slice not yet registered. */
#define PS__NO_SLICE UINT32_MAX

typedef struct ps__slice {
  uint32_t ps;          /* which server */
  uint32_t remote_id;   /* the server's slice id (PS__NO_SLICE: none yet) */
  uint64_t offset;      /* first element within the variable */
  uint64_t length;      /* elements */
  ps_var *var;          /* owner (heap object, never moves) */
  int initialized;      /* as the server reported at registration */
} ps__slice;

/* ps_var.init.kind of a variable made by ps_client_var_create_values: the
 * chief's own values, no initializer (never a public ps_init_kind). */
#define PS__INIT_VALUES ((ps_init_kind)1000)

struct ps_var {
  ps_client *c;                  /* owner */
  char *name;                    /* variable name */
  int ndim;                      /* rank */
  int64_t shape[PS_MAX_DIMS];    /* dims */
  size_t numel;                  /* elements */
  float *data;                   /* parameters: where pulls land (own_data,
                                    or the caller's: ps_var_bind_buffers) */
  float *grad;                   /* gradient to push (own_grad, or the caller's) */
  float *own_data, *own_grad;    /* the library's buffers, freed with it */
  size_t first_slice;            /* its slices are c->slices[first_slice..] */
  size_t n_slices;               /* ... this many */
  int mark;                      /* scratch: duplicate detection */
  int trainable;                 /* opt.kind != PS_OPT_NONE: ps_client_step pushes it */
  int early;                     /* pushed by ps_client_step_push for the coming
                                    step: ps_client_step leaves it out */
  ps_optimizer opt;              /* as created (library layout): a second create
                                    of the name must agree with it */
  ps_init init;                  /* ... and with this initializer */
  int push_dtype;                /* wire dtype of its gradients (-1: the client's) */
  int pull_dtype;                /* ... of its parameters (-1: the client's) */
};

struct ps_req {
  ps_client *c;          /* owner */
  int type;              /* PS__REQ_* */
  uint64_t id;           /* request id on the wire (0: not in flight) */
  int pending;           /* sub-replies still expected */
  int *pend_ps;          /* ... from each ps (num_ps entries): a server
                            closing after its last answer fails only the
                            requests still waiting for it */
  int status;            /* first error, or 0 */
  char msg[512];         /* status's message: ps_req_wait restores it, so a
                            later error elsewhere cannot stand in for it */
  int stale;             /* some push item was stale */
  int duplicate;         /* some push item was a duplicate: the server already
                            had this worker's gradient for that step (msg
                            says which, unless status is set) */
  int done;              /* no more replies expected */
  uint64_t step;         /* pull: smallest step received among trainable
                            variables' slices (UINT64_MAX: none yet) */
  uint64_t step_nt;      /* ... and among the others' (their step is one past
                            their last assign): the pull's step when it
                            named no trainable variable */
  int refused;           /* checkpoint: some server said no */
  uint64_t max_step;     /* checkpoint: most advanced server's step */
  double first_reply_at; /* pull: when its first PullReply came (telemetry) */
  int average;           /* pull of moving averages (2.7): its data lands in
                            the caller's buffers, so a frame still arriving
                            once it is released goes to the discard sink */
  ps_var *reg_var;       /* register: the variable whose slices it names */
  ps_table *reg_table;   /* table register: the table whose ids it collects */
  struct ps__tpull *tp;  /* table pull of keys: one malloc'd block (keys,
                            inverse map, rows), freed with the request */
  uint64_t dropped;      /* table push: keys the servers had no row for */
  struct ps_req *next;   /* free list link */
};

/* A (key, position) pair: what a table's keys are sorted as (keysort.c). */
typedef struct ps__kp {
  uint64_t key;  /* the key */
  uint64_t pos;  /* its position in the caller's list */
} ps__kp;

/* A table pull of keys in flight (PS__REQ_TPULL): the caller's keys sorted
 * and de-duplicated, grouped by ps (each ps's keys ascending), the rows
 * read straight into `rows`, scattered into `out` when the last arrives
 * (rows is out itself when that is their order: in_order).
 * One allocation: the struct, then its arrays. */
typedef struct ps__tpull {
  size_t bytes;       /* of the whole block (kept for the next pull when
                         released: request.c, c->tp_keep) */
  ps_table *t;        /* the table */
  float *out;         /* the caller's n * dim floats */
  size_t n;           /* the caller's keys */
  size_t nu;          /* distinct keys */
  uint32_t dim;       /* floats per row */
  uint64_t min_step;  /* sent in every frame */
  int read_only;      /* PS_TABLE_READ_ONLY */
  size_t per_frame;   /* most keys in one TablePull (keys and rows limits) */
  uint64_t *keys;     /* nu distinct keys, ps 0's first */
  size_t *inv;        /* n: caller position -> index in keys (and rows) */
  float *rows;        /* nu * dim: the rows as they arrive */
  size_t *first;      /* num_ps + 1: ps p's keys are keys[first[p]..first[p+1]) */
  size_t *sent;       /* num_ps: keys of ps p sent so far (frames in
                         flight included) */
  size_t *done;       /* num_ps: keys of ps p answered (frames are
                         answered in order, each per_frame keys but a
                         ps's last) */
  int direct;         /* the rows went straight from the pull ring into
                         out: nothing to scatter */
  int in_order;       /* distinct keys laid out in the caller's order
                         (inv[i] == i): rows == out, read straight
                         there, nothing to scatter */
  uint64_t kp_gen;    /* the table's kp_gen when it was sorted */
  size_t *kept;       /* num_ps: every reply of it said remembered */
} ps__tpull;

/* A sparse table (tableapi.c). */
struct ps_table {
  ps_client *c;           /* owner */
  char *name;             /* table name */
  ps_table_config cfg;    /* as created (library layout, defaults resolved):
                             a second create of the name must agree */
  uint32_t *ids;          /* num_ps: each server's id for it */
  uint64_t *seen_step;    /* num_ps: the table's step each server's last
                             pull reply named (steps only grow: a pull for
                             that step or before is answered at once) */
  uint64_t *skeys;        /* ps_table_add_grad's keys for the next step */
  float *sgrads;          /* ... and their gradients (sn * dim floats) */
  size_t sn;              /* keys staged */
  size_t skcap, sgcap;    /* entries allocated in skeys, sgrads */
  ps__kp *kp;             /* the last sort's pairs (keysort.c): a push of the
                             keys the step pulled reuses the pull's sort */
  size_t kp_n;            /* pairs in kp (0: none valid) */
  int kp_ascending;       /* kp's keys came strictly ascending: each pair
                             is (keys[i], i), every key distinct */
  uint64_t kp_gen;        /* sorts kp has held (a pull in flight notes it) */
  uint64_t kp_pull;       /* 2.10: the pull (request id) whose keys kp holds,
                             done, its keys held by the servers of kept;
                             0: none (a push then carries its keys) */
  uint8_t *kept;          /* num_ps: kp_pull's replies from it all said
                             remembered */
  uint64_t *memo_req;     /* num_ps: the pull whose keys that server holds
                             for a push, as the frames sent say (its pieces
                             in a run, no push since); 0: none */
  uint64_t p_pull;        /* the prepared push's: it may name this pull */
  size_t kp_cap;          /* entries allocated */
  uint8_t *pbuf;          /* a step's one add_grad, prepared (tablexfer.c):
                             each ps's TablePush data (keys, then summed
                             gradients) back to back, sent from here */
  size_t pcap;            /* bytes allocated in pbuf */
  size_t *pfirst;         /* 2 num_ps + 1: each ps's first key in pbuf,
                             then the layout's scratch */
  int prepared;           /* pbuf holds this step's rows (not skeys) */
  uint8_t *pheld;         /* num_ps: where each ps's prepared data is
                             (PS__HELD_*, tablexfer.c) */
  int sent;               /* ps__tables_step_push: queued in its first pass */
};

/* In-flight requests by id: slot id & (cap - 1). Ids are handed out so
 * that no two in-flight requests share a slot; a slot's request is the one
 * asked for only if its id matches (a late reply for a finished request
 * finds nothing). */
typedef struct ps__req_table {
  ps_req **slot;  /* cap entries, NULL when free */
  size_t cap;     /* power of two (0 before the first request) */
  size_t n;       /* requests in flight */
} ps__req_table;

/* Push-ring bytes written ahead of their frame (a step's table gradients,
 * gathered there by ps_table_add_grad and sent by the step: one copy, not
 * two). While a hold is on, no other frame takes push-ring room (they go
 * over TCP), so the ring's frames still go out in the order of their
 * positions, and nothing is written over the held bytes. The segment
 * stays mapped until ps__conn_free, a broken connection's too, so the
 * bytes stay readable for as long as the hold. */
typedef struct ps__push_hold {
  uint64_t pos, len;           /* ring position and bytes; len 0: no hold */
} ps__push_hold;

typedef struct ps__conn {
  int index;                   /* ps index */
  char addr[300];              /* "host:port" as configured */
  int fd;                      /* socket, -1 when broken */
  ps__outq out;                /* queued frames (gradients referenced) */
  uint8_t *in;                 /* input buffer */
  size_t in_cap;               /* its size */
  size_t in_off;               /* first unparsed byte */
  size_t in_len;               /* unparsed bytes */
  ps__rd_state rstate;         /* frame reader position */
  ps__frame_header hdr;        /* frame being read */
  struct iovec *dst;           /* data destinations of the frame */
  size_t ndst;                 /* entries used */
  size_t capdst;               /* entries allocated */
  const uint8_t *shm_src;      /* the frame's data in our pull ring, while
                                  its reply is handled (else NULL) */
  size_t dst_i;                /* entry being filled */
  uint64_t dst_got;            /* bytes of dst[dst_i] received */
  uint64_t data_req;           /* PullReply being received: request id */
  int data_items;              /* ... and the slices it completes */
  int data_kind;               /* PS__DATA_PULL or PS__DATA_TABLE */
  int data_own;                /* dst points into a table pull's rows (the
                                  request's memory, or its caller's out): if
                                  the request goes away mid-frame, the rest
                                  is discarded */
  int stopped;                 /* this server wrote the stop checkpoint */
  uint32_t minor;              /* its HelloReply.protocol_minor: what of 2.x it
                                 knows (3: 16-bit wire dtypes) */
  uint8_t *wire16;             /* staging of a PullReply's 16-bit data (2.3) */
  size_t wire16_cap;           /* its bytes */
  struct ps__widen *widen;     /* ... and where each item goes once in */
  size_t nwiden, capwiden;     /* entries used, allocated */
  uint8_t *discard;            /* sink for data nobody wants */
  size_t discard_cap;          /* its size */
  ps__shm shm;                 /* the segment handed to this ps (2.4; shm.map
                                  NULL: tensors go over TCP) */
  ps__push_hold hold;          /* push-ring bytes written before their frame */
} ps__conn;

/* Remote slice id -> index in c->slices, for one server. */
typedef struct ps__remote_map {
  uint32_t *idx;  /* cap entries, PS__NO_SLICE when unknown */
  size_t cap;     /* entries allocated */
} ps__remote_map;

struct ps_client {
  int num_ps;                 /* servers */
  int wake_fd;                /* eventfd written by ps_client_wake (-1: none) */
  int worker_index;           /* this worker; 0 is the chief */
  int num_workers;            /* workers in the job */
  int replicas;               /* replicas_to_aggregate */
  int async_mode;             /* pushes applied at once */
  uint32_t push_dtype;        /* wire dtype of gradients (PS__DT_*), for
                                 servers of minor >= 3 */
  uint32_t pull_dtype;        /* ... and of parameters */
  int transport;              /* PS_TRANSPORT_AUTO, _TCP or _SHM (resolved) */
  int connect_timeout_ms;     /* connect retries give up after this */
  int request_timeout_ms;     /* default bound on a wait */
  ps__conn *conns;            /* num_ps entries */
  ps__placer placer;          /* deterministic placement */
  ps_var **vars;              /* in creation order */
  size_t nvars;               /* entries used */
  size_t capvars;             /* entries allocated */
  ps__slice *slices;          /* every slice of every variable */
  size_t nslices;             /* entries used */
  size_t capslices;           /* entries allocated */
  ps__remote_map *by_remote;  /* per ps: remote id -> slice index */
  uint64_t next_id;           /* last request id handed out */
  ps__req_table reqs;         /* requests awaiting replies */
  ps_req *freelist;           /* reusable request objects */
  uint32_t *ids;              /* scratch for slice id lists */
  Ps__Item *items;            /* scratch for push items */
  Ps__Item **itemp;           /* ... pointers to them */
  const float **segdata;      /* scratch: data segments of a push */
  uint64_t *segcount;         /* ... and their lengths */
  size_t items_cap;           /* entries of the five scratch arrays above */
  uint8_t *cred;              /* credential bytes */
  size_t cred_len;            /* their count */
  int munge;                  /* MUNGE credentials, one per connection */
  char *munge_socket;         /* munged socket, or NULL */
  long long job_id;           /* what the MUNGE payload names: job */
  long long step_id;          /* ... and step */
  int checkpoints;            /* some server writes checkpoints */
  int want_ckpt;              /* a server asked the chief for a checkpoint */
  int want_stop;              /* ... and to stop after it */
  uint64_t stop_step;         /* step of the stop checkpoint (servers say) */
  int note_fd;                /* psrun's stop note pipe (PS_STOP_NOTE_FD), or -1 */
  int noted;                  /* the stop was written to it */
  int stop_agreed;            /* chief: every server committed to a stop */
  volatile sig_atomic_t stop_requested; /* ps_client_request_stop was called */
  int signals;                /* holds the library's SIGTERM/SIGUSR1 handlers
                                 (signals.c): a stop signal requests a stop */
  ps__telem telem;            /* per-step records (ps_telemetry.c) */
  uint64_t cur_step;          /* the step last returned by ps_client_step or
                                 ps_client_pull (ps_client_step_current) */
  ps_table **tables;          /* sparse tables, in creation order */
  size_t ntables;             /* entries used */
  size_t captables;           /* entries allocated */
  ps__kp *kp_tmp;             /* scratch: the radix sort's second buffer */
  size_t kp_cap;              /* its entries */
  struct ps__tpull *tp_keep;  /* a released table pull's block, kept for
                                 the next pull (tablexfer.c trims it) */
  size_t *kgrp;               /* scratch: a push's distinct keys' first pairs */
  size_t kgrp_cap;            /* its entries */
  ps_req **early;             /* the coming step's pushes already sent by
                                 ps_client_step_push (ps_client_step waits) */
  size_t nearly;              /* entries used */
  size_t capearly;            /* entries allocated */
  uint64_t early_step;        /* the step they were computed at */
  ps_var **rest;              /* scratch: the trainable variables not pushed early */
  size_t caprest;             /* its entries */
  char errmsg[1024];          /* last error */
};

/* ---- signals.c: SIGTERM/SIGUSR1 start the stop protocol ------------------ */

/* A client that wants the handlers (ps_config.no_signal_handlers 0): the
 * first such client installs them for each of SIGTERM and SIGUSR1 still at
 * its default action (the application's own handler is left alone). */
void ps__signals_hold(void);
/* The client is destroyed: the last one puts the previous actions back. */
void ps__signals_release(void);
/* 1 once a stop signal arrived through the handlers. */
int ps__signals_stop(void);

/* ---- sized.c: the public structs that carry their size ------------------- */

/* The first layout of each sized struct ends with these fields: a caller's
 * struct_size below that is no layout this library ever had. */
#define PS__CONFIG_V1_SIZE (offsetof(ps_config, telemetry) + sizeof(const char *))
#define PS__OPTIMIZER_V1_SIZE (offsetof(ps_optimizer, weight_decay) + sizeof(double))
#define PS__INIT_V1_SIZE (offsetof(ps_init, seed) + sizeof(uint64_t))

/* Reads a caller's sized struct src (its struct_size bytes) into dst, a
 * struct of this library's size lib_size already holding the defaults: the
 * fields the caller's size covers are copied, the rest keep the defaults.
 * 0, PS_EINVAL (size 0 or below v1_size: never initialized) or
 * PS_EUNSUPPORTED (a newer caller set fields unknown here), with a sentence
 * naming `type` in err. */
int ps__sized_read(void *dst, size_t lib_size, const void *src, size_t v1_size,
                   const char *type, char *err, size_t errlen);

/* ---- errmsg.c ------------------------------------------------------------ */

/* Sets c's error message; returns code. */
int ps__seterr(ps_client *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- request.c (calls no other file) ------------------------------------- */

/* A new in-flight request (NULL: out of memory). */
ps_req *ps__req_new(ps_client *c, int type);
/* The in-flight request with this id, or NULL. */
ps_req *ps__req_find(ps_client *c, uint64_t id);
/* Calls fn for every in-flight request (fn may finish it). */
void ps__req_each(ps_client *c, void (*fn)(ps_client *, ps_req *, void *), void *arg);
/* No more replies expected: leaves the table. */
void ps__req_finish(ps_client *c, ps_req *r);
/* Finishes r with code (the first error wins the message). */
void ps__req_fail(ps_client *c, ps_req *r, int code, const char *msg);
/* Returns r to the free list (finishing it if still in flight). */
void ps__req_release(ps_client *c, ps_req *r);
/* r expects n more replies from ps p. */
void ps__req_expect(ps_req *r, int p, int n);
/* n replies for r arrived from ps p; finishes r when none is left. */
void ps__req_answered(ps_client *c, ps_req *r, int p, int n);
/* Frees every request object and the table. */
void ps__req_free_all(ps_client *c);

/* ---- srvconn.c (calls request.c, errmsg.c) ------------------------------- */

/* Connects k, retrying until deadline (the handshake is client.c's). */
int ps__conn_connect(ps_client *c, ps__conn *k, double deadline);
/* Queues a frame on k: header + message, then optional data segments
 * (sent from where they are: the caller keeps them stable until sent). */
int ps__queue_frame(ps_client *c, ps__conn *k, unsigned type, const ProtobufCMessage *m,
                    const float *const *data, const uint64_t *counts, size_t nseg);
/* Writes as much queued output as the socket takes. 0, or <0 (broken). */
int ps__conn_flush(ps_client *c, ps__conn *k);
/* Room for len bytes of a frame's data in k's push ring, its position in
 * *pos; NULL: over TCP (no segment, a hold on, or no room now). */
uint8_t *ps__push_reserve(ps__conn *k, uint64_t len, uint64_t *pos);
/* Reserves len bytes of k's push ring and holds them (ps__push_hold):
 * where to write them, or NULL (no segment, a hold on already, no room). */
uint8_t *ps__push_hold_take(ps__conn *k, uint64_t len);
/* The held bytes, in the ring. */
uint8_t *ps__push_held(const ps__conn *k);
/* Queues the frame (type, m) whose data are the held bytes but the first
 * skip (left as a gap the server steps over) and ends the hold: 0, or
 * PS_ENOMEM / PS_ETOOBIG (the hold stays). */
int ps__push_hold_queue(ps__conn *k, unsigned type, const ProtobufCMessage *m, uint64_t skip);
/* Ends a hold without a frame (its bytes were copied elsewhere). */
void ps__push_hold_drop(ps__conn *k);
/* Closes k and fails the requests still waiting for it. */
void ps__conn_break(ps_client *c, ps__conn *k, int code, const char *why);
/* Frees k's buffers and closes its socket. */
void ps__conn_free(ps__conn *k);
/* Breaks k for a protocol violation described by msg ("ps P at ADDR broke
 * the protocol: msg"); returns PS_EPROTO. */
int ps__proto_err(ps_client *c, ps__conn *k, const char *msg);

/* ---- keysort.c (calls no other file) ------------------------------------- */

/* Fills pairs[i] = (keys[i], i) and sorts them by key, equal keys in
 * position order (a stable LSD radix sort, passes over bytes all keys
 * share skipped; tmp: n entries of scratch). Returns 1 when the keys came
 * strictly ascending (distinct, and the pairs in place), else 0. */
int ps__keysort(const uint64_t *keys, size_t n, ps__kp *pairs, ps__kp *tmp);
/* Counts the distinct keys of sorted pairs[0..n) per ps (ps__table_shard)
 * into first[0..nps] as offsets: ps p's are [first[p], first[p+1]) in the
 * grouped order below. Returns the number of distinct keys. */
size_t ps__key_split(const ps__kp *pairs, size_t n, uint32_t nps, size_t *first);
/* Lays the distinct keys out grouped by ps (each ps's ascending), g being
 * a key's index there: keys_out[g] = key, inv[pos] = g for every pair,
 * grp[g] = index in pairs of its first pair (each may be NULL). next:
 * nps entries of scratch. */
void ps__key_layout(const ps__kp *pairs, size_t n, uint32_t nps, const size_t *first,
                    size_t *next, uint64_t *keys_out, size_t *inv, size_t *grp);

/* ---- slicemap.c (calls no other file) ------------------------------------ */

/* The slice server p calls id, or NULL. */
ps__slice *ps__slice_by_remote(ps_client *c, int p, uint32_t id);
/* Records that server p calls slice index si id. 0, PS_EPROTO or PS_ENOMEM. */
int ps__remote_set(ps_client *c, int p, uint32_t id, size_t si);
/* Forgets server p's id for slice index si (if the map still says so). */
void ps__remote_forget(ps_client *c, int p, uint32_t id, size_t si);
/* Frees every server's map. */
void ps__remote_free(ps_client *c);

/* ---- reply.c (calls slicemap.c, srvconn.c, request.c) -------------------- */

/* A complete protobuf part arrived on k. 0, or <0 (connection broken).
 * A PullReply with data moves k's reader to PS__RD_DATA. */
int ps__handle_reply(ps_client *c, ps__conn *k, const uint8_t *meta);
/* The data of k's PullReply is all in: its slices are received. */
void ps__pull_data_done(ps_client *c, ps__conn *k);

/* The request of k's frame data went away mid-frame (a table pull's rows
 * point into its memory): the rest of the data goes to the discard sink. */
void ps__data_abandon(ps_client *c, ps__conn *k);

/* ---- tablexfer.c (calls keysort.c, srvconn.c, request.c) ----------------- */

/* Queues t's TableRegister on every ps for r (r->reg_table = t). */
int ps__treg_queue(ps_client *c, ps_table *t, ps_req *r);
/* A TablePull request of keys[0..n) (n >= 1) of t into out (see
 * ps_table_pull_async): sorted, de-duplicated, the first frame of each ps
 * queued. 0 or <0 (message set, nothing in flight). */
int ps__tpull_start(ps_table *t, uint64_t min_step, const uint64_t *keys, size_t n,
                    float *out, int read_only, ps_req **out_req);
/* Zero-key TablePulls of tables[0..n) to every ps at min_step: a request
 * whose step is the smallest table step received. */
int ps__tstep_start(ps_client *c, ps_table *const *tables, size_t n, uint64_t min_step,
                    ps_req **out_req);
/* The distinct keys of keys[0..n) that each ps gets fit in one TablePush:
 * 0 or PS_ETOOBIG (message set). */
int ps__tpush_check(ps_table *t, const uint64_t *keys, size_t n);
/* A step's first ps_table_add_grad, written straight into t->pbuf as the
 * TablePush frames' data (sorted, split by ps, duplicates summed), so that
 * the step sends it without another copy. 0 (prepared), 1 (not possible
 * now: the caller stages the rows), or PS_ENOMEM. */
int ps__tpush_prepare(ps_table *t, const uint64_t *keys, size_t n, const float *grads);
/* Moves t's prepared rows into its staging (a second add_grad of the
 * step). 0 or PS_ENOMEM (nothing changed). */
int ps__tpush_unprepare(ps_table *t);
/* Moves t's prepared data held in push rings into pbuf (a copy) and ends
 * those holds, so the rings take other frames again: 0, or PS_ENOMEM
 * (nothing changed). */
int ps__tpush_unhold(ps_table *t);
/* Queues t's prepared TablePush frames of step for r, by reference. */
int ps__tpush_queue_prepared(ps_table *t, ps_req *r, uint64_t step);
/* Queues t's TablePush for step on every ps (each its distinct keys,
 * ascending, duplicates' gradients summed; possibly none) for r. 0 or <0
 * (message set; frames queued before the error stay queued). */
int ps__tpush_queue(ps_table *t, ps_req *r, uint64_t step, const uint64_t *keys, size_t n,
                    const float *grads);
/* Replies (0, or <0 when k was broken). */
int ps__on_table_register_reply(ps_client *c, ps__conn *k, const Ps__TableRegisterReply *m);
int ps__on_table_push_reply(ps_client *c, ps__conn *k, const Ps__TablePushReply *m);
/* A TablePullReply for r (in flight): checks it and aims k's dst at r's
 * rows (k->data_own set); nothing for a step pull. 1 when it took the
 * rows from the pull ring itself (k->shm_src: a whole pull in one frame),
 * straight into the caller's order. */
int ps__table_pull_reply(ps_client *c, ps__conn *k, ps_req *r, const Ps__TablePullReply *m);
/* Its data is in: the next frame of that ps goes out, and the request,
 * if complete, scatters its rows into the caller's buffer. */
void ps__table_pull_done(ps_client *c, ps__conn *k, ps_req *r);

/* ---- shmsetup.c (calls errmsg.c) ----------------------------------------- */

/* After k's handshake: hands k's server a shared-memory segment when the
 * transport and the HelloReply r allow (same node, offered). 0 (attached,
 * or TCP chosen under auto), or with PS_TRANSPORT_SHM a PS_E* code and a
 * message naming the server and why. */
int ps__shm_setup(ps_client *c, ps__conn *k, const Ps__HelloReply *r, double deadline);

/* ---- reader.c (calls reply.c, srvconn.c) --------------------------------- */

/* Processes k's buffered input and reads more until the socket is drained;
 * 0 or <0 (k broken). */
int ps__conn_read(ps_client *c, ps__conn *k);

/* ---- pump.c (calls reader.c, srvconn.c, request.c) ----------------------- */

/* Drives every connection until r is done or the deadline passes (or,
 * wakeable, ps_client_wake is called: PS_ETIMEDOUT either way). */
int ps__pump(ps_client *c, ps_req *r, double deadline, int wakeable);
/* Waits for r, then releases it. */
int ps__req_wait_release(ps_client *c, ps_req *r);

/* ---- transfer.c (calls srvconn.c, request.c) ----------------------------- */

/* The listed variables (none when vars is NULL) are c's, each listed once,
 * and, for a push, trainable; every connection is up. 0 or PS_EINVAL /
 * PS_ECLOSED with the message set. */
int ps__check_vars(ps_client *c, ps_var *const *vars, size_t n, int push);
/* Queues r's Pulls of the moving averages of vars (2.7) on every ps,
 * float32 whatever the variables' wire dtype (an average is read for
 * evaluation, rarely): the replies land in each variable's data pointer.
 * 0, or an error with r released. */
int ps__pull_average_send(ps_client *c, ps_req *r, ps_var *const *vars, size_t n);

/* ---- var.c --------------------------------------------------------------- */

/* 0 if every server speaks protocol 2.minor or later, else
 * PS_EUNSUPPORTED with a message naming the first that does not and
 * `what` (the feature the caller wanted). */
int ps__need_minor(ps_client *c, uint32_t minor, const char *what);

/* Frees every variable and the slice list (not the slice maps). */
void ps__vars_free(ps_client *c);

/* ---- tableapi.c ---------------------------------------------------------- */

/* Frees every table. */
void ps__tables_free(ps_client *c);
/* ps_client_step: every table's staged gradients fit in one push per ps
 * (0, or PS_ETOOBIG before anything is sent). */
int ps__tables_step_check(ps_client *c);
/* ps_client_step: zero-key pulls of every table at min_step. */
int ps__tables_step_pull(ps_client *c, uint64_t min_step, ps_req **out);
/* ps_client_step: every table's staged gradients pushed for step (to
 * every ps), the staging cleared once sent. */
int ps__tables_step_push(ps_client *c, uint64_t step, ps_req **out);
/* ps_client_step_push: every table's gradients held in a push ring are
 * moved out of it (ps__tpush_unhold), so the variables' early push goes
 * through the ring; a table that cannot (out of memory) keeps its hold
 * and that push goes over TCP. */
void ps__tables_unhold(ps_client *c);

#endif /* PS_CLIENT_INTERNAL_H */
