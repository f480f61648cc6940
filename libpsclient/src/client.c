/* client.c - libpsclient: connections to every ps task, variables, and
 * asynchronous push/pull driven by the caller's thread (no hidden threads:
 * ps_req_wait polls every connection, writing queued frames and reading
 * replies straight into the variables' buffers). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "ps.pb-c.h"
#include "wire.h"
#include "psclient.h"
#include "ps_telemetry.h"

/* Input buffer for reply headers and protobuf; big tensors bypass it. */
#define PS__IN_INITIAL (64u * 1024u)
/* Tensor bytes at least this large are read straight into variables. */
#define PS__DIRECT_READ_MIN (16u * 1024u)
/* Socket buffers: large enough that a 4 MiB slice is in flight at once. */
#define PS__SOCK_BUF (4 << 20)
/* iovecs per writev call (Linux IOV_MAX is 1024). */
/* Default waits. */
#define PS__DEFAULT_CONNECT_MS 60000
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

enum { REQ_PUSH = 1, REQ_PULL, REQ_REGISTER, REQ_INIT, REQ_FINISH, REQ_HELLO, REQ_CHECKPOINT };

typedef struct ps__slice {
  uint32_t ps;          /* which server */
  uint32_t remote_id;   /* the server's slice id */
  uint64_t offset;      /* first element within the variable */
  uint64_t length;      /* elements */
  ps_var *var;          /* owner */
  int initialized;      /* as the server reported at registration */
} ps__slice;

struct ps_var {
  ps_client *c;                  /* owner */
  char *name;                    /* variable name */
  int ndim;                      /* rank */
  int64_t shape[PS_MAX_DIMS];    /* dims */
  size_t numel;                  /* elements */
  float *data;                   /* parameters */
  float *grad;                   /* gradient to push */
  size_t first_slice, n_slices;  /* range in c->slices */
  int mark;                      /* scratch: duplicate detection */
};

struct ps_req {
  ps_client *c;          /* owner */
  int type;              /* REQ_* */
  uint64_t id;           /* request id on the wire (0: not in flight) */
  int pending;           /* sub-replies still expected */
  int *pend_ps;          /* ... from each ps (num_ps entries): a server
                            closing after its last answer fails only the
                            requests still waiting for it */
  int status;            /* first error, or 0 */
  int stale;             /* some push item was stale */
  int done;              /* no more replies expected */
  uint64_t step;         /* pull: smallest step received */
  int refused;           /* checkpoint: some server said no */
  uint64_t max_step;     /* checkpoint: most advanced server's step */
  double first_reply_at; /* pull: when its first PullReply came (telemetry) */
  ps__slice *reg;        /* register: slices to fill, in request order */
  size_t reg_n;
  struct ps_req *next;   /* in-flight list or free list */
};

typedef struct ps__conn {
  int index;                   /* ps index */
  char addr[300];              /* "host:port" as configured */
  int fd;                      /* socket, -1 when broken */
  ps__outq out;                /* queued frames (gradients referenced) */
  uint8_t *in;                 /* input buffer */
  size_t in_cap, in_off, in_len;
  int rstate;                  /* 0 header, 1 meta, 2 data */
  ps__frame_header hdr;        /* frame being read */
  struct iovec *dst;           /* data destinations of the frame */
  size_t ndst, capdst, dst_i;  /* count, capacity, current */
  uint64_t dst_got;            /* bytes of dst[dst_i] received */
  uint64_t data_req;           /* PullReply being received: request id */
  int data_items;              /* ... and the slices it completes */
  int stopped;                 /* this server wrote the stop checkpoint */
  uint8_t *discard;            /* sink for data nobody wants */
  size_t discard_cap;
} ps__conn;

struct ps_client {
  int num_ps, worker_index, num_workers, replicas, async_mode;
  int connect_timeout_ms, request_timeout_ms;
  ps__conn *conns;            /* num_ps entries */
  ps__placer placer;          /* deterministic placement */
  ps_var **vars;              /* in creation order */
  size_t nvars, capvars;
  ps__slice *slices;          /* every slice of every variable */
  size_t nslices, capslices;
  ps__slice ***by_remote;     /* per ps: remote id -> slice */
  size_t *by_remote_cap;
  uint64_t next_id;           /* request ids */
  ps_req *inflight;           /* requests awaiting replies */
  ps_req *freelist;           /* reusable request objects */
  uint8_t *pack;              /* scratch for packing messages */
  size_t pack_cap;
  uint32_t *ids;              /* scratch for slice id lists */
  size_t ids_cap;
  Ps__Item *items;            /* scratch for push items */
  Ps__Item **itemp;
  const float **segdata;      /* scratch: data segments of a push */
  uint64_t *segcount;         /* ... and their lengths */
  size_t items_cap;
  uint8_t *cred;              /* credential bytes */
  size_t cred_len;
  int munge;                  /* MUNGE credentials, one per connection */
  char *munge_socket;         /* munged socket, or NULL */
  long long job_id, step_id;  /* what the MUNGE payload names */
  int checkpoints;            /* some server writes checkpoints */
  int want_ckpt;              /* a server asked the chief for a checkpoint */
  int want_stop;              /* ... and to stop after it */
  uint64_t stop_step;         /* step of the stop checkpoint (servers say) */
  int stop_agreed;            /* chief: every server committed to a stop */
  volatile sig_atomic_t stop_requested; /* ps_client_request_stop was called */
  ps__telem telem;            /* per-step records (telemetry.c) */
  char errmsg[1024];          /* last error */
};

static int seterr(ps_client *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int seterr(ps_client *c, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->errmsg, sizeof c->errmsg, fmt, ap);
  va_end(ap);
  return code;
}

static double now_s(void) { return ps__now(); }

/* ---- connections ---------------------------------------------------------- */

static void conn_break(ps_client *c, ps__conn *k, int code, const char *why);

/* Queues a frame on k: header + message, then optional data segments
 * (sent from where they are: the caller keeps them stable until sent). */
static int queue_frame(ps_client *c, ps__conn *k, unsigned type, const ProtobufCMessage *m,
                       const float *const *data, const uint64_t *counts, size_t nseg) {
  int rc = ps__outq_frame(&k->out, type, m, data, counts, NULL, nseg);
  if (rc == PS_ETOOBIG)
    return seterr(c, rc, "a %s message exceeds the frame limits", ps__msg_name(type));
  if (rc) return seterr(c, rc, "out of memory queueing a message");
  return 0;
}

/* Writes as much queued output as the socket takes. 0, or <0 (broken). */
static int conn_flush(ps_client *c, ps__conn *k) {
  if (k->fd < 0) return PS_ECLOSED;
  if (ps__outq_write(&k->out, k->fd) != 0) {
    conn_break(c, k, PS_ECLOSED, strerror(errno));
    return PS_ECLOSED;
  }
  return 0;
}

static void req_finish(ps_client *c, ps_req *r);

/* r expects n more replies from ps p. */
static void expect(ps_req *r, int p, int n) {
  r->pending += n;
  r->pend_ps[p] += n;
}

/* n replies for r arrived from ps p; finishes r when none is left. */
static void answered(ps_client *c, ps_req *r, int p, int n) {
  r->pending -= n;
  r->pend_ps[p] -= n;
  if (r->pending <= 0) req_finish(c, r);
}

static ps_req *find_req(ps_client *c, uint64_t id) {
  for (ps_req *r = c->inflight; r; r = r->next)
    if (r->id == id) return r;
  return NULL;
}

static void req_finish(ps_client *c, ps_req *r) {
  r->done = 1;
  for (ps_req **pp = &c->inflight; *pp; pp = &(*pp)->next)
    if (*pp == r) {
      *pp = r->next;
      break;
    }
  r->next = NULL;
}

static void req_fail(ps_client *c, ps_req *r, int code, const char *msg) {
  if (!r->status) {
    r->status = code;
    snprintf(c->errmsg, sizeof c->errmsg, "%s", msg);
  }
  req_finish(c, r);
}

static void conn_break(ps_client *c, ps__conn *k, int code, const char *why) {
  if (k->fd < 0) return;
  close(k->fd);
  k->fd = -1;
  char msg[600];
  snprintf(msg, sizeof msg, "connection to ps %d at %s lost: %s", k->index, k->addr, why);
  /* Fail the requests still waiting for this server. */
  for (ps_req *r = c->inflight, *next; r; r = next) {
    next = r->next;
    if (r->pend_ps[k->index] > 0) req_fail(c, r, code, msg);
  }
  snprintf(c->errmsg, sizeof c->errmsg, "%s", msg);
}

/* Sets up where a PullReply's data goes (or a discard sink). */
static int plan_pull_data(ps_client *c, ps__conn *k, const Ps__PullReply *m, ps_req *r) {
  k->ndst = 0;
  uint64_t total = 0;
  if (ps__grow((void **)&k->dst, &k->capdst, m->n_items + 1, sizeof *k->dst)) return PS_ENOMEM;
  for (size_t i = 0; i < m->n_items; i++) {
    const Ps__Item *it = m->items[i];
    uint32_t id = it->slice_id;
    ps__slice *s = id < c->by_remote_cap[k->index] ? c->by_remote[k->index][id] : NULL;
    if (!s || it->count != s->length) {
      char e[512];
      snprintf(e, sizeof e, "ps %d at %s sent %llu values for unknown or different slice %u",
               k->index, k->addr, (unsigned long long)it->count, id);
      conn_break(c, k, PS_EPROTO, e);
      return PS_EPROTO;
    }
    total += it->count * sizeof(float);
    if (r) {
      k->dst[k->ndst].iov_base = s->var->data + s->offset;
      k->dst[k->ndst].iov_len = s->length * sizeof(float);
      k->ndst++;
      if (it->step < r->step) r->step = it->step;
    }
  }
  if (total != k->hdr.data_len) {
    conn_break(c, k, PS_EPROTO, "pull reply data length does not match its items");
    return PS_EPROTO;
  }
  if (!r && total) {
    /* Nobody waits for it any more (failed or abandoned): read and drop. */
    if (k->discard_cap < 65536) {
      free(k->discard);
      k->discard = malloc(65536);
      k->discard_cap = k->discard ? 65536 : 0;
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
  }
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

/* Every server has written its stop checkpoint: only then may the worker
 * leave (with backup workers a server can still need its gradients to
 * reach the step). */
static int all_stopped(const ps_client *c) {
  for (int i = 0; i < c->num_ps; i++)
    if (!c->conns[i].stopped) return 0;
  return c->num_ps > 0;
}

/* A complete protobuf part arrived on k. Returns 0 or <0 (conn broken). */
static int handle_reply(ps_client *c, ps__conn *k, const uint8_t *meta) {
  unsigned t = k->hdr.type;
  size_t len = k->hdr.meta_len;
  if (t != PS__MSG_PULL_REPLY && k->hdr.data_len) {
    conn_break(c, k, PS_EPROTO, "unexpected data in a reply");
    return PS_EPROTO;
  }
  switch (t) {
  case PS__MSG_ERROR: {
    Ps__Error *m = ps__error__unpack(NULL, len, meta);
    if (!m) break;
    char msg[700];
    snprintf(msg, sizeof msg, "ps %d at %s: %s", k->index, k->addr,
             m->message ? m->message : "error");
    ps_req *r = m->request_id ? find_req(c, m->request_id) : NULL;
    int code = m->code < 0 ? m->code : PS_EPROTO;
    /* A non-fatal error for a request we no longer wait for (it failed on
     * another server, or timed out here first) needs no action. */
    int fatal = m->fatal;
    if (r) req_fail(c, r, code, msg);
    ps__error__free_unpacked(m, NULL);
    if (fatal) {
      conn_break(c, k, code, msg);
      snprintf(c->errmsg, sizeof c->errmsg, "%s", msg);
      return code;
    }
    return 0;
  }
  case PS__MSG_ACK: {
    Ps__Ack *m = ps__ack__unpack(NULL, len, meta);
    if (!m) break;
    ps_req *r = find_req(c, m->request_id);
    if (r) answered(c, r, k->index, 1);
    ps__ack__free_unpacked(m, NULL);
    return 0;
  }
  case PS__MSG_HELLO_REPLY: {
    Ps__HelloReply *m = ps__hello_reply__unpack(NULL, len, meta);
    if (!m) break;
    ps_req *r = NULL;
    for (ps_req *q = c->inflight; q; q = q->next)
      if (q->type == REQ_HELLO && q->step == (uint64_t)k->index) r = q;
    if (m->checkpoints) c->checkpoints = 1;
    if (r) req_finish(c, r);
    ps__hello_reply__free_unpacked(m, NULL);
    return 0;
  }
  case PS__MSG_REGISTER_REPLY: {
    Ps__RegisterReply *m = ps__register_reply__unpack(NULL, len, meta);
    if (!m) break;
    ps_req *r = find_req(c, m->request_id);
    if (r && r->reg && m->n_slices == r->reg_n) {
      for (size_t i = 0; i < m->n_slices; i++) {
        ps__slice *s = &r->reg[i];
        uint32_t id = m->slices[i]->slice_id;
        s->remote_id = id;
        s->initialized = m->slices[i]->initialized;
        size_t cap = c->by_remote_cap[k->index];
        if (id >= cap) {
          size_t nc = cap ? cap : 64;
          while (nc <= id) nc *= 2;
          ps__slice **nb = realloc(c->by_remote[k->index], nc * sizeof *nb);
          if (!nb) {
            ps__register_reply__free_unpacked(m, NULL);
            conn_break(c, k, PS_ENOMEM, "out of memory");
            return PS_ENOMEM;
          }
          memset(nb + cap, 0, (nc - cap) * sizeof *nb);
          c->by_remote[k->index] = nb;
          c->by_remote_cap[k->index] = nc;
        }
        /* Pointer fixed up by the caller once slices stop moving. */
        c->by_remote[k->index][id] = s;
      }
      req_finish(c, r);
    } else if (r) {
      req_fail(c, r, PS_EPROTO, "register reply does not match the request");
    }
    ps__register_reply__free_unpacked(m, NULL);
    return 0;
  }
  case PS__MSG_PUSH_REPLY: {
    Ps__PushReply *m = ps__push_reply__unpack(NULL, len, meta);
    if (!m) break;
    note_flags(c, k, m->want_checkpoint, m->want_stop, m->stopped, m->stop_step);
    ps_req *r = find_req(c, m->request_id);
    if (r) {
      for (size_t i = 0; i < m->n_items; i++) {
        int st = m->items[i]->status;
        if (st == PS_ESTALE) r->stale = 1;
        else if (st < 0 && !r->status) {
          uint32_t id = m->items[i]->slice_id;
          ps__slice *s = id < c->by_remote_cap[k->index] ? c->by_remote[k->index][id] : NULL;
          r->status = st;
          snprintf(c->errmsg, sizeof c->errmsg, "ps %d at %s rejected the gradient of '%s': %s",
                   k->index, k->addr, s ? s->var->name : "?", ps_strerror(st));
        }
      }
      answered(c, r, k->index, 1);
    }
    ps__push_reply__free_unpacked(m, NULL);
    return 0;
  }
  case PS__MSG_PULL_REPLY: {
    Ps__PullReply *m = ps__pull_reply__unpack(NULL, len, meta);
    if (!m) break;
    note_flags(c, k, m->want_checkpoint, m->want_stop, m->stopped, m->stop_step);
    ps_req *r = find_req(c, m->request_id);
    if (r && !r->first_reply_at) r->first_reply_at = now_s();
    ps__telem_bytes(&c->telem, k->index, 1, k->hdr.data_len);
    int rc = plan_pull_data(c, k, m, r);
    k->data_req = m->request_id;
    k->data_items = (int)m->n_items;
    ps__pull_reply__free_unpacked(m, NULL);
    if (rc) return rc;
    /* The request's slices count as received once the data is in. */
    k->rstate = 2;
    return 0;
  }
  case PS__MSG_CHECKPOINT_REPLY: {
    Ps__CheckpointReply *m = ps__checkpoint_reply__unpack(NULL, len, meta);
    if (!m) break;
    note_flags(c, k, 0, 0, m->stopped, m->stop_step);
    ps_req *r = find_req(c, m->request_id);
    if (r) {
      if (m->max_step > r->max_step) r->max_step = m->max_step;
      if (!m->ok && !r->refused) {
        r->refused = 1;
        snprintf(c->errmsg, sizeof c->errmsg, "ps %d at %s refused the checkpoint: %s",
                 k->index, k->addr, m->message ? m->message : "?");
      }
      answered(c, r, k->index, 1);
    }
    ps__checkpoint_reply__free_unpacked(m, NULL);
    return 0;
  }
  default:
    break;
  }
  char e[160];
  snprintf(e, sizeof e, "malformed or unexpected %s frame", ps__msg_name(t));
  conn_break(c, k, PS_EPROTO, e);
  return PS_EPROTO;
}

/* The data of a PullReply is all in: its slices are received. */
static void pull_data_done(ps_client *c, ps__conn *k) {
  k->rstate = 0;
  ps_req *r = find_req(c, k->data_req);
  if (r) answered(c, r, k->index, k->data_items);
  k->data_req = 0;
  k->data_items = 0;
}

/* Processes buffered input and reads more; 0 or <0 (broken). */
static int conn_read(ps_client *c, ps__conn *k) {
  for (;;) {
    /* Parse what is buffered. */
    for (;;) {
      if (k->rstate == 0) {
        if (k->in_len < PS__HEADER_SIZE) break;
        char err[256];
        int rc = ps__header_decode(k->in + k->in_off, 1, &k->hdr, err, sizeof err);
        if (rc) {
          conn_break(c, k, rc, err);
          return rc;
        }
        k->in_off += PS__HEADER_SIZE;
        k->in_len -= PS__HEADER_SIZE;
        k->rstate = 1;
      }
      if (k->rstate == 1) {
        if (k->in_len < k->hdr.meta_len) {
          if (k->in_off + k->hdr.meta_len > k->in_cap) {
            memmove(k->in, k->in + k->in_off, k->in_len);
            k->in_off = 0;
            if (ps__grow((void **)&k->in, &k->in_cap, k->hdr.meta_len, 1)) {
              conn_break(c, k, PS_ENOMEM, "out of memory");
              return PS_ENOMEM;
            }
          }
          break;
        }
        const uint8_t *meta = k->in + k->in_off;
        k->in_off += k->hdr.meta_len;
        k->in_len -= k->hdr.meta_len;
        k->rstate = 0;
        uint64_t dlen = k->hdr.data_len;
        int rc = handle_reply(c, k, meta);
        if (rc < 0) return rc;
        if (k->rstate == 2 && dlen == 0) pull_data_done(c, k);
      }
      if (k->rstate == 2) {
        while (k->dst_i < k->ndst && k->in_len) {
          struct iovec *d = &k->dst[k->dst_i];
          size_t need = d->iov_len - k->dst_got;
          size_t take = k->in_len < need ? k->in_len : need;
          memcpy((char *)d->iov_base + k->dst_got, k->in + k->in_off, take);
          k->in_off += take;
          k->in_len -= take;
          k->dst_got += take;
          if (k->dst_got == d->iov_len) {
            k->dst_i++;
            k->dst_got = 0;
          }
        }
        if (k->dst_i < k->ndst) break;
        pull_data_done(c, k);
      }
    }
    /* Read more. */
    ssize_t n;
    if (k->rstate == 2 && k->in_len == 0 &&
        k->dst[k->dst_i].iov_len - k->dst_got >= PS__DIRECT_READ_MIN) {
      struct iovec iov[64];
      int ni = 0;
      for (size_t i = k->dst_i; i < k->ndst && ni < 64; i++, ni++) {
        size_t skip = i == k->dst_i ? k->dst_got : 0;
        iov[ni].iov_base = (char *)k->dst[i].iov_base + skip;
        iov[ni].iov_len = k->dst[i].iov_len - skip;
      }
      n = readv(k->fd, iov, ni);
      if (n > 0) {
        size_t left = (size_t)n;
        while (left) {
          size_t rem = k->dst[k->dst_i].iov_len - k->dst_got;
          if (left >= rem) {
            left -= rem;
            k->dst_i++;
            k->dst_got = 0;
          } else {
            k->dst_got += left;
            left = 0;
          }
        }
        if (k->dst_i == k->ndst) pull_data_done(c, k);
        continue;
      }
    } else {
      if (k->in_len == 0) k->in_off = 0;
      if (k->in_off + k->in_len == k->in_cap) {
        memmove(k->in, k->in + k->in_off, k->in_len);
        k->in_off = 0;
      }
      n = read(k->fd, k->in + k->in_off + k->in_len, k->in_cap - k->in_off - k->in_len);
      if (n > 0) {
        k->in_len += (size_t)n;
        continue;
      }
    }
    if (n == 0) {
      conn_break(c, k, PS_ECLOSED, "the server closed the connection");
      return PS_ECLOSED;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    conn_break(c, k, PS_ECLOSED, strerror(errno));
    return PS_ECLOSED;
  }
}

/* Drives every connection until r is done or the deadline passes. */
static int pump(ps_client *c, ps_req *r, double deadline) {
  struct pollfd pfd[64];
  struct pollfd *p = c->num_ps <= 64 ? pfd : calloc((size_t)c->num_ps, sizeof *p);
  if (!p) return seterr(c, PS_ENOMEM, "out of memory");
  int rc = 0;
  while (!r->done) {
    for (int i = 0; i < c->num_ps; i++) {
      ps__conn *k = &c->conns[i];
      if (ps__outq_pending(&k->out)) conn_flush(c, k);
      p[i].fd = k->fd;
      p[i].events = (short)(POLLIN | (ps__outq_pending(&k->out) ? POLLOUT : 0));
      p[i].revents = 0;
    }
    if (r->done) break;
    double left = deadline - now_s();
    if (left <= 0) {
      rc = seterr(c, PS_ETIMEDOUT, "timed out waiting for the parameter servers");
      break;
    }
    int ms = left > 1e6 ? 1000000000 : (int)(left * 1000) + 1;
    int n = poll(p, (nfds_t)c->num_ps, ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      rc = seterr(c, PS_EIO, "poll failed: %s", strerror(errno));
      break;
    }
    for (int i = 0; i < c->num_ps; i++) {
      ps__conn *k = &c->conns[i];
      if (k->fd < 0) continue;
      if (p[i].revents & (POLLIN | POLLHUP | POLLERR)) conn_read(c, k);
      if (k->fd >= 0 && (p[i].revents & POLLOUT)) conn_flush(c, k);
    }
  }
  if (p != pfd) free(p);
  return rc;
}

static ps_req *req_new(ps_client *c, int type) {
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
  r->id = ++c->next_id;
  r->step = UINT64_MAX;
  r->next = c->inflight;
  c->inflight = r;
  return r;
}

static void req_release(ps_client *c, ps_req *r) {
  if (!r->done) req_finish(c, r);
  r->next = c->freelist;
  c->freelist = r;
}

int ps_req_wait(ps_req *r, int timeout_ms, uint64_t *step_out) {
  if (!r) return PS_EINVAL;
  ps_client *c = r->c;
  double deadline = now_s() + (timeout_ms < 0 ? c->request_timeout_ms : timeout_ms) / 1000.0;
  if (!r->done) {
    int rc = pump(c, r, deadline);
    if (rc) return rc;
  }
  if (step_out) *step_out = r->step == UINT64_MAX ? 0 : r->step;
  if (r->status) return r->status;
  if (r->stale) {
    snprintf(c->errmsg, sizeof c->errmsg, "gradient was stale: the servers had moved on");
    return PS_ESTALE;
  }
  return 0;
}

void ps_req_destroy(ps_req *r) {
  if (!r) return;
  ps_client *c = r->c;
  if (!r->done) {
    /* Buffers may still be in use: let it finish (bounded). */
    pump(c, r, now_s() + c->request_timeout_ms / 1000.0);
  }
  req_release(c, r);
}

/* ---- create / destroy ------------------------------------------------------ */

static int connect_one(ps_client *c, ps__conn *k, double deadline) {
  char host[256];
  int port;
  if (ps__parse_hostport(k->addr, host, sizeof host, &port))
    return seterr(c, PS_EINVAL, "ps %d address '%s' is not host:port", k->index, k->addr);
  char ports[16];
  snprintf(ports, sizeof ports, "%d", port);
  double backoff = 0.05;
  const char *last = "no attempt";
  char lastbuf[256];
  for (;;) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int g = getaddrinfo(host, ports, &hints, &res);
    if (g == 0) {
      for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        int one = 1, buf = PS__SOCK_BUF;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
        int idle = PS__KEEPIDLE_S, intvl = PS__KEEPINTVL_S, cnt = PS__KEEPCNT;
        unsigned uto = PS__USER_TIMEOUT_MS;
        setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
        setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &uto, sizeof uto);
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
          k->fd = fd;
          freeaddrinfo(res);
          return 0;
        }
        snprintf(lastbuf, sizeof lastbuf, "%s", strerror(errno));
        last = lastbuf;
        close(fd);
      }
      freeaddrinfo(res);
    } else {
      snprintf(lastbuf, sizeof lastbuf, "%s", gai_strerror(g));
      last = lastbuf;
    }
    if (now_s() + backoff > deadline)
      return seterr(c, PS_ECONNECT, "could not connect to ps %d at %s within %.0f s: %s",
                    k->index, k->addr, c->connect_timeout_ms / 1000.0, last);
    struct timespec ts = {(time_t)backoff, (long)((backoff - (time_t)backoff) * 1e9)};
    nanosleep(&ts, NULL);
    backoff = backoff * 2 > 1.0 ? 1.0 : backoff * 2;
  }
}

static int hello_one(ps_client *c, ps__conn *k, double deadline,
                     const ps_config *cfg) {
  Ps__Hello h = PS__HELLO__INIT;
  char cid[128], hn[64] = "";
  gethostname(hn, sizeof hn - 1);
  snprintf(cid, sizeof cid, "(%s pid %d)", hn, (int)getpid());
  h.protocol_version = PS__PROTOCOL_VERSION;
  h.role = PS__ROLE__ROLE_WORKER;
  h.worker_index = (uint32_t)c->worker_index;
  h.num_workers = (uint32_t)c->num_workers;
  h.num_ps = (uint32_t)c->num_ps;
  h.ps_index = (uint32_t)k->index;
  h.replicas_to_aggregate = (uint32_t)c->replicas;
  h.async_mode = c->async_mode;
  char *mcred = NULL;
  ps__auth au = {c->cred, c->cred_len, c->munge, c->munge_socket, c->job_id, c->step_id};
  char aerr[512];
  int arc = ps__hello_auth(&h, &au, &mcred, aerr, sizeof aerr);
  if (arc) return seterr(c, arc, "%s", aerr);
  h.client_id = cid;
  h.split_threshold = c->placer.split_threshold;
  h.max_slice_bytes = c->placer.max_slice_bytes;
  (void)cfg;
  ps_req *r = req_new(c, REQ_HELLO);
  if (!r) return seterr(c, PS_ENOMEM, "out of memory");
  r->step = (uint64_t)k->index; /* HELLO_REPLY carries no id: match by ps */
  r->pend_ps[k->index] = 1;
  int rc = queue_frame(c, k, PS__MSG_HELLO, &h.base, NULL, NULL, 0);
  free(mcred); /* packed into the frame */
  if (rc == 0) rc = pump(c, r, deadline);
  if (rc == 0) rc = r->status;
  if (rc == PS_ETIMEDOUT)
    seterr(c, rc, "ps %d at %s accepted the connection but did not answer the handshake",
           k->index, k->addr);
  req_release(c, r);
  return rc;
}

static int getenv_int(const char *name, int required, int def, int lo, int hi, int *out,
                      char *err, size_t errlen) {
  const char *v = getenv(name);
  if (!v || !*v) {
    if (required) {
      snprintf(err, errlen, "environment variable %s is not set (psrun sets it)", name);
      return PS_EINVAL;
    }
    *out = def;
    return 0;
  }
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || *end || end == v || x < lo || x > hi) {
    snprintf(err, errlen, "environment variable %s='%s' is not an integer from %d to %d", name,
             v, lo, hi);
    return PS_EINVAL;
  }
  *out = (int)x;
  return 0;
}

int ps_client_create_from_env(ps_client **out, char *errmsg, size_t errlen) {
  char e[512];
  *out = NULL;
  ps_config cfg;
  memset(&cfg, 0, sizeof cfg);
  const char *hosts = getenv("PS_HOSTS");
  if (!hosts || !*hosts) {
    if (errmsg) snprintf(errmsg, errlen, "environment variable PS_HOSTS is not set (psrun sets it)");
    return PS_EINVAL;
  }
  int rc = getenv_int("PS_WORKER_INDEX", 1, 0, 0, 1 << 20, &cfg.worker_index, e, sizeof e);
  if (!rc) rc = getenv_int("PS_NUM_WORKERS", 1, 0, 1, 1 << 20, &cfg.num_workers, e, sizeof e);
  if (!rc)
    rc = getenv_int("PS_REPLICAS_TO_AGGREGATE", 0, 0, 0, 1 << 20, &cfg.replicas_to_aggregate,
                    e, sizeof e);
  if (!rc) rc = getenv_int("PS_ASYNC", 0, 0, 0, 1, &cfg.async_mode, e, sizeof e);
  if (!rc)
    rc = getenv_int("PS_CONNECT_TIMEOUT_MS", 0, 0, 0, 1 << 30, &cfg.connect_timeout_ms, e,
                    sizeof e);
  if (!rc)
    rc = getenv_int("PS_REQUEST_TIMEOUT_MS", 0, 0, 0, 1 << 30, &cfg.request_timeout_ms, e,
                    sizeof e);
  /* Placement inputs: every worker of a job must give the same values. */
  int slice = 0, split = 0;
  if (!rc)
    rc = getenv_int("PS_MAX_SLICE_BYTES", 0, 0, 0, (int)PS__MAX_SLICE_BYTES, &slice, e, sizeof e);
  if (!rc) rc = getenv_int("PS_SPLIT_THRESHOLD", 0, 0, 0, 1 << 30, &split, e, sizeof e);
  cfg.max_slice_bytes = (uint64_t)slice;
  cfg.split_threshold = (uint64_t)split;
  if (rc) {
    if (errmsg) snprintf(errmsg, errlen, "%s", e);
    return rc;
  }
  cfg.telemetry = getenv("PS_TELEMETRY"); /* psrun --telemetry */
  const char *secret = getenv("PS_SECRET"); /* psrun's per-run secret */
  if (secret && *secret) {
    cfg.credential = secret;
    cfg.credential_len = strlen(secret);
  }
  int munge = 0;
  rc = getenv_int("PS_MUNGE", 0, 0, 0, 1, &munge, e, sizeof e);
  if (!rc && munge) {
    const char *j = getenv("PS_JOB_ID"), *st = getenv("PS_STEP_ID");
    char *end;
    cfg.munge = 1;
    cfg.munge_socket = getenv("PS_MUNGE_SOCKET");
    if (!j || !*j || (cfg.job_id = strtoll(j, &end, 10), *end)) {
      snprintf(e, sizeof e, "PS_MUNGE=1 needs PS_JOB_ID (got '%s')", j ? j : "");
      rc = PS_EINVAL;
    }
    cfg.step_id = st && *st ? strtoll(st, &end, 10) : -1;
  }
  if (rc) {
    if (errmsg) snprintf(errmsg, errlen, "%s", e);
    return rc;
  }
  char *copy = strdup(hosts);
  const char *list[4096];
  int n = 0;
  for (char *save = NULL, *tok = copy ? strtok_r(copy, ",", &save) : NULL; tok;
       tok = strtok_r(NULL, ",", &save)) {
    if (n == 4096) break;
    list[n++] = tok;
  }
  if (n == 0) {
    free(copy);
    if (errmsg) snprintf(errmsg, errlen, "PS_HOSTS='%s' lists no host:port", hosts);
    return PS_EINVAL;
  }
  cfg.hosts = list;
  cfg.num_ps = n;
  rc = ps_client_create(&cfg, out, errmsg, errlen);
  free(copy);
  return rc;
}

int ps_client_create(const ps_config *cfg, ps_client **out, char *errmsg, size_t errlen) {
  *out = NULL;
#define FAIL(code, ...)                                  \
  do {                                                   \
    if (errmsg) snprintf(errmsg, errlen, __VA_ARGS__);   \
    return code;                                         \
  } while (0)
  if (!cfg || !cfg->hosts || cfg->num_ps < 1) FAIL(PS_EINVAL, "config needs at least one ps host");
  if (cfg->num_workers < 1 || cfg->worker_index < 0 || cfg->worker_index >= cfg->num_workers)
    FAIL(PS_EINVAL, "worker index %d must be in [0, num_workers %d)", cfg->worker_index,
         cfg->num_workers);
  if (cfg->replicas_to_aggregate < 0 || cfg->replicas_to_aggregate > cfg->num_workers)
    FAIL(PS_EINVAL, "replicas_to_aggregate %d must be in [0, num_workers %d]",
         cfg->replicas_to_aggregate, cfg->num_workers);
  if (cfg->max_slice_bytes > PS__MAX_SLICE_BYTES)
    FAIL(PS_EINVAL, "max_slice_bytes %llu exceeds the server limit %llu",
         (unsigned long long)cfg->max_slice_bytes, (unsigned long long)PS__MAX_SLICE_BYTES);
  for (int i = 0; i < cfg->num_ps; i++) {
    char h[256];
    int p;
    if (!cfg->hosts[i] || ps__parse_hostport(cfg->hosts[i], h, sizeof h, &p))
      FAIL(PS_EINVAL, "ps %d address '%s' is not host:port", i,
           cfg->hosts[i] ? cfg->hosts[i] : "(null)");
  }
#undef FAIL
  signal(SIGPIPE, SIG_IGN);
  ps_client *c = calloc(1, sizeof *c);
  if (!c) return PS_ENOMEM;
  c->num_ps = cfg->num_ps;
  c->worker_index = cfg->worker_index;
  c->num_workers = cfg->num_workers;
  c->replicas = cfg->replicas_to_aggregate;
  c->async_mode = cfg->async_mode != 0;
  c->connect_timeout_ms = cfg->connect_timeout_ms > 0 ? cfg->connect_timeout_ms : PS__DEFAULT_CONNECT_MS;
  c->request_timeout_ms = cfg->request_timeout_ms > 0 ? cfg->request_timeout_ms : PS__DEFAULT_REQUEST_MS;
  int rc = PS_ENOMEM;
  c->conns = calloc((size_t)c->num_ps, sizeof *c->conns);
  c->by_remote = calloc((size_t)c->num_ps, sizeof *c->by_remote);
  c->by_remote_cap = calloc((size_t)c->num_ps, sizeof *c->by_remote_cap);
  if (!c->conns || !c->by_remote || !c->by_remote_cap) goto fail;
  if (cfg->credential_len) {
    c->cred = malloc(cfg->credential_len);
    if (!c->cred) goto fail;
    memcpy(c->cred, cfg->credential, cfg->credential_len);
    c->cred_len = cfg->credential_len;
  }
  c->munge = cfg->munge != 0;
  c->job_id = cfg->job_id;
  c->step_id = cfg->step_id;
  if (cfg->munge_socket && !(c->munge_socket = strdup(cfg->munge_socket))) goto fail;
  rc = ps__placer_init(&c->placer, (uint32_t)c->num_ps, cfg->split_threshold,
                       cfg->max_slice_bytes);
  if (rc) {
    seterr(c, rc, "bad placement thresholds");
    goto fail;
  }
  rc = ps__telem_init(&c->telem, cfg->telemetry, c->worker_index, c->num_ps, c->errmsg,
                      sizeof c->errmsg);
  if (rc) goto fail;
  for (int i = 0; i < c->num_ps; i++) {
    ps__conn *k = &c->conns[i];
    k->index = i;
    k->fd = -1;
    snprintf(k->addr, sizeof k->addr, "%s", cfg->hosts[i]);
    k->in_cap = PS__IN_INITIAL;
    k->in = malloc(k->in_cap);
    if (!k->in) {
      rc = seterr(c, PS_ENOMEM, "out of memory");
      goto fail;
    }
  }
  double deadline = now_s() + c->connect_timeout_ms / 1000.0;
  for (int i = 0; i < c->num_ps; i++) {
    rc = connect_one(c, &c->conns[i], deadline);
    if (rc) goto fail;
  }
  for (int i = 0; i < c->num_ps; i++) {
    rc = hello_one(c, &c->conns[i], deadline + 10.0, cfg);
    if (rc) goto fail;
  }
  ps__telem_idle(&c->telem, now_s());
  *out = c;
  return 0;
fail:
  if (errmsg) snprintf(errmsg, errlen, "%s", c->errmsg[0] ? c->errmsg : ps_strerror(rc));
  ps_client_destroy(c);
  return rc;
}

void ps_client_destroy(ps_client *c) {
  if (!c) return;
  for (int i = 0; c->conns && i < c->num_ps; i++) {
    ps__conn *k = &c->conns[i];
    if (k->fd >= 0) close(k->fd);
    ps__outq_free(&k->out);
    free(k->in);
    free(k->dst);
    free(k->discard);
  }
  free(c->conns);
  for (size_t i = 0; i < c->nvars; i++) {
    free(c->vars[i]->name);
    free(c->vars[i]->data);
    free(c->vars[i]->grad);
    free(c->vars[i]);
  }
  free(c->vars);
  free(c->slices);
  for (int i = 0; c->by_remote && i < c->num_ps; i++) free(c->by_remote[i]);
  free(c->by_remote);
  free(c->by_remote_cap);
  while (c->inflight) {
    ps_req *r = c->inflight;
    c->inflight = r->next;
    free(r->pend_ps);
    free(r);
  }
  while (c->freelist) {
    ps_req *r = c->freelist;
    c->freelist = r->next;
    free(r->pend_ps);
    free(r);
  }
  ps__placer_free(&c->placer);
  free(c->pack);
  free(c->ids);
  free(c->items);
  free(c->itemp);
  free(c->segdata);
  free(c->segcount);
  free(c->cred);
  free(c->munge_socket);
  ps__telem_free(&c->telem);
  free(c);
}

const char *ps_client_errmsg(const ps_client *c) { return c ? c->errmsg : "no client"; }
int ps_client_worker_index(const ps_client *c) { return c->worker_index; }
int ps_client_num_workers(const ps_client *c) { return c->num_workers; }
int ps_client_num_ps(const ps_client *c) { return c->num_ps; }

float *ps_var_data(ps_var *v) { return v->data; }
float *ps_var_grad(ps_var *v) { return v->grad; }
size_t ps_var_numel(const ps_var *v) { return v->numel; }
const char *ps_var_name(const ps_var *v) { return v->name; }
int ps_var_ndim(const ps_var *v) { return v->ndim; }
const int64_t *ps_var_shape(const ps_var *v) { return v->shape; }

/* ---- variables ----------------------------------------------------------- */

static void fill_opt(Ps__Optimizer *m, const ps_optimizer *o) {
  ps__optimizer__init(m);
  m->kind = (Ps__OptKind)o->kind;
  m->lr = o->lr;
  m->momentum = o->momentum;
  m->nesterov = o->nesterov != 0;
  m->beta1 = o->beta1;
  m->beta2 = o->beta2;
  m->epsilon = o->epsilon;
  m->decay = (Ps__LrDecay)o->decay;
  m->decay_rate = o->decay_rate;
  m->decay_steps = o->decay_steps;
  m->weight_decay = o->weight_decay;
}

/* Re-points by_remote entries after c->slices moved (realloc). */
static void reindex(ps_client *c) {
  for (size_t i = 0; i < c->nslices; i++) {
    ps__slice *s = &c->slices[i];
    if (s->remote_id < c->by_remote_cap[s->ps]) c->by_remote[s->ps][s->remote_id] = s;
  }
}

static int wait_done(ps_client *c, ps_req *r) {
  int rc = ps_req_wait(r, -1, NULL);
  req_release(c, r);
  return rc;
}

int ps_client_var_create(ps_client *c, const char *name, const int64_t *shape, int ndim,
                         const ps_init *init, const ps_optimizer *opt, ps_var **out) {
  if (!c || !out) return PS_EINVAL;
  *out = NULL;
  if (!name || !*name || strlen(name) > PS_MAX_NAME)
    return seterr(c, PS_EINVAL, "variable name must be 1 to %d bytes", PS_MAX_NAME);
  if (ndim < 1 || ndim > PS_MAX_DIMS || !shape)
    return seterr(c, PS_EINVAL, "variable '%s': rank %d must be 1 to %d", name, ndim, PS_MAX_DIMS);
  uint64_t numel = 1;
  for (int d = 0; d < ndim; d++)
    if (shape[d] <= 0 || ps__mul_u64(numel, (uint64_t)shape[d], &numel) ||
        numel > (SIZE_MAX / sizeof(float)))
      return seterr(c, PS_EINVAL, "variable '%s': dimension %d (%lld) is not positive or the size overflows",
                    name, d, (long long)shape[d]);
  for (size_t i = 0; i < c->nvars; i++)
    if (strcmp(c->vars[i]->name, name) == 0)
      return seterr(c, PS_EINVAL, "variable '%s' was already created by this client", name);
  ps_optimizer dopt;
  if (!opt) {
    ps_optimizer_default(&dopt, 0.01);
    opt = &dopt;
  }
  ps_init zinit = {PS_INIT_ZEROS, 0, 0, 0};
  if (!init) init = &zinit;

  ps_var *v = calloc(1, sizeof *v);
  if (!v) return seterr(c, PS_ENOMEM, "out of memory");
  v->c = c;
  v->name = strdup(name);
  v->ndim = ndim;
  memcpy(v->shape, shape, (size_t)ndim * sizeof *shape);
  v->numel = (size_t)numel;
  v->data = calloc(v->numel, sizeof(float));
  v->grad = calloc(v->numel, sizeof(float));
  size_t ns = ps__placer_count(&c->placer, numel);
  if (!v->name || !v->data || !v->grad || ns == 0 ||
      ps__grow((void **)&c->slices, &c->capslices, c->nslices + ns, sizeof *c->slices) ||
      ps__grow((void **)&c->vars, &c->capvars, c->nvars + 1, sizeof *c->vars)) {
    free(v->name);
    free(v->data);
    free(v->grad);
    free(v);
    return seterr(c, PS_ENOMEM, "out of memory creating '%s'", name);
  }
  reindex(c);
  ps__slice_place *pl = calloc(ns, sizeof *pl);
  if (!pl) {
    free(v->name);
    free(v->data);
    free(v->grad);
    free(v);
    return seterr(c, PS_ENOMEM, "out of memory");
  }
  /* Placement must stay identical on every worker: if this creation
   * fails, the loads are restored as if it never happened. */
  uint64_t *saved_load = malloc((size_t)c->num_ps * sizeof *saved_load);
  if (!saved_load) {
    free(pl);
    free(v->name);
    free(v->data);
    free(v->grad);
    free(v);
    return seterr(c, PS_ENOMEM, "out of memory");
  }
  memcpy(saved_load, c->placer.load, (size_t)c->num_ps * sizeof *saved_load);
  ps__placer_place(&c->placer, numel, pl, ns);
  v->first_slice = c->nslices;
  v->n_slices = ns;
  for (size_t i = 0; i < ns; i++) {
    ps__slice *s = &c->slices[c->nslices + i];
    memset(s, 0, sizeof *s);
    s->ps = pl[i].ps;
    s->offset = pl[i].offset;
    s->length = pl[i].length;
    s->var = v;
    s->remote_id = UINT32_MAX;
  }
  free(pl);
  c->nslices += ns;
  c->vars[c->nvars++] = v;

  /* Register on each ps that holds part of it (slices of one ps are
   * contiguous in the list only per part, so gather per ps). */
  int rc = 0;
  Ps__Optimizer mo;
  fill_opt(&mo, opt);
  uint64_t ushape[PS_MAX_DIMS];
  for (int d = 0; d < ndim; d++) ushape[d] = (uint64_t)shape[d];
  for (int p = 0; p < c->num_ps && rc == 0; p++) {
    size_t cnt = 0;
    for (size_t i = 0; i < ns; i++) cnt += c->slices[v->first_slice + i].ps == (uint32_t)p;
    if (!cnt) continue;
    Ps__SliceSpec *specs = calloc(cnt, sizeof *specs);
    Ps__SliceSpec **sp = calloc(cnt, sizeof *sp);
    ps__slice *regs = calloc(cnt, sizeof *regs);
    if (!specs || !sp || !regs) {
      free(specs);
      free(sp);
      free(regs);
      rc = seterr(c, PS_ENOMEM, "out of memory");
      break;
    }
    size_t j = 0;
    for (size_t i = 0; i < ns; i++) {
      ps__slice *s = &c->slices[v->first_slice + i];
      if (s->ps != (uint32_t)p) continue;
      ps__slice_spec__init(&specs[j]);
      specs[j].name = v->name;
      specs[j].n_shape = (size_t)ndim;
      specs[j].shape = ushape;
      specs[j].dtype = 1;
      specs[j].offset = s->offset;
      specs[j].length = s->length;
      specs[j].optimizer = &mo;
      sp[j] = &specs[j];
      regs[j] = *s;
      j++;
    }
    Ps__Register reg = PS__REGISTER__INIT;
    ps_req *r = req_new(c, REQ_REGISTER);
    if (!r) rc = seterr(c, PS_ENOMEM, "out of memory");
    if (r) {
      r->pend_ps[p] = 1; /* its one reply comes from ps p */
      reg.request_id = r->id;
      reg.n_slices = cnt;
      reg.slices = sp;
      r->reg = regs;
      r->reg_n = cnt;
      rc = queue_frame(c, &c->conns[p], PS__MSG_REGISTER, &reg.base, NULL, NULL, 0);
      if (rc == 0) rc = wait_done(c, r);
      else req_release(c, r);
    }
    if (rc == 0) {
      /* Copy the server's ids back into the real slices. */
      j = 0;
      for (size_t i = 0; i < ns; i++) {
        ps__slice *s = &c->slices[v->first_slice + i];
        if (s->ps != (uint32_t)p) continue;
        s->remote_id = regs[j].remote_id;
        s->initialized = regs[j].initialized;
        j++;
      }
    }
    free(specs);
    free(sp);
    free(regs);
  }
  if (rc == 0) reindex(c);

  /* The chief initializes what is not yet initialized. */
  if (rc == 0 && c->worker_index == 0) {
    int any = 0;
    for (size_t i = 0; i < ns; i++) any |= !c->slices[v->first_slice + i].initialized;
    if (any) {
      rc = ps_init_fill(init, v->name, v->shape, ndim, v->data, v->numel);
      if (rc) seterr(c, rc, "variable '%s': bad initializer", name);
    }
    /* One Init frame per uninitialized slice (each at most
     * PS__MAX_SLICE_BYTES), all in flight at once; then wait for the acks. */
    ps_req *r = any && rc == 0 ? req_new(c, REQ_INIT) : NULL;
    if (any && rc == 0 && !r) rc = seterr(c, PS_ENOMEM, "out of memory");
    for (size_t i = 0; r && rc == 0 && i < ns; i++) {
      ps__slice *s = &c->slices[v->first_slice + i];
      if (s->initialized) continue;
      Ps__Item item = PS__ITEM__INIT, *ip = &item;
      item.slice_id = s->remote_id;
      item.count = s->length;
      const float *dp = v->data + s->offset;
      uint64_t dc = s->length;
      Ps__Init in = PS__INIT__INIT;
      in.request_id = r->id;
      in.n_items = 1;
      in.items = &ip;
      rc = queue_frame(c, &c->conns[s->ps], PS__MSG_INIT, &in.base, &dp, &dc, 1);
      if (rc == 0) expect(r, (int)s->ps, 1);
    }
    if (r && rc == 0) rc = wait_done(c, r);
    else if (r) req_release(c, r);
  }
  /* Everyone (the chief too, in case a restore initialized some slices)
   * pulls the values at the current step. */
  if (rc == 0) {
    ps_req *r = NULL;
    ps_var *vv = v;
    rc = ps_client_pull_async(c, 0, &vv, 1, &r);
    if (rc == 0) rc = wait_done(c, r);
  }
  if (rc) {
    /* Undo: forget the variable, its slices and its placement. */
    memcpy(c->placer.load, saved_load, (size_t)c->num_ps * sizeof *saved_load);
    for (size_t i = v->first_slice; i < c->nslices; i++) {
      ps__slice *s = &c->slices[i];
      if (s->remote_id != UINT32_MAX && s->remote_id < c->by_remote_cap[s->ps] &&
          c->by_remote[s->ps][s->remote_id] == s)
        c->by_remote[s->ps][s->remote_id] = NULL;
    }
    c->nslices = v->first_slice;
    c->nvars--;
    free(v->name);
    free(v->data);
    free(v->grad);
    free(v);
    free(saved_load);
    return rc;
  }
  free(saved_load);
  *out = v;
  return 0;
}

/* ---- push / pull ------------------------------------------------------------ */

static int scratch_items(ps_client *c, size_t n) {
  size_t cap = c->items_cap;
  if (ps__grow((void **)&c->items, &cap, n, sizeof *c->items)) return -1;
  cap = c->items_cap;
  if (ps__grow((void **)&c->itemp, &cap, n, sizeof *c->itemp)) return -1;
  cap = c->items_cap;
  if (ps__grow((void **)&c->segdata, &cap, n, sizeof *c->segdata)) return -1;
  cap = c->items_cap;
  if (ps__grow((void **)&c->segcount, &cap, n, sizeof *c->segcount)) return -1;
  c->items_cap = cap;
  cap = c->ids_cap;
  if (ps__grow((void **)&c->ids, &cap, n, sizeof *c->ids)) return -1;
  c->ids_cap = cap;
  return 0;
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

static int check_vars(ps_client *c, ps_var *const *vars, size_t n) {
  int rc = 0;
  for (size_t i = 0; vars && i < n && !rc; i++) {
    if (!vars[i] || vars[i]->c != c)
      rc = seterr(c, PS_EINVAL, "variable %zu does not belong to this client", i);
    else if (vars[i]->mark)
      rc = seterr(c, PS_EINVAL, "variable '%s' is listed twice", vars[i]->name);
    else
      vars[i]->mark = 1;
  }
  for (size_t i = 0; vars && i < n; i++)
    if (vars[i] && vars[i]->c == c) vars[i]->mark = 0;
  if (rc) return rc;
  for (int p = 0; p < c->num_ps; p++)
    if (c->conns[p].fd < 0)
      return seterr(c, PS_ECLOSED, "connection to ps %d at %s is lost", p, c->conns[p].addr);
  return 0;
}

/* Queues one Push of the first k scratch items to ps p (released on error). */
static int push_frame(ps_client *c, ps_req *r, int p, uint64_t step, size_t k,
                      uint64_t bytes) {
  Ps__Push m = PS__PUSH__INIT;
  m.request_id = r->id;
  m.step = step;
  m.n_items = k;
  m.items = c->itemp;
  m.want_stop = c->stop_requested != 0;
  int rc = queue_frame(c, &c->conns[p], PS__MSG_PUSH, &m.base, c->segdata, c->segcount, k);
  if (rc) {
    req_release(c, r);
    return rc;
  }
  expect(r, p, 1);
  ps__telem_bytes(&c->telem, p, 0, bytes);
  return 0;
}

int ps_client_push_async(ps_client *c, uint64_t step, ps_var *const *vars, size_t n,
                         ps_req **out) {
  if (!c || !out) return PS_EINVAL;
  *out = NULL;
  int rc = check_vars(c, vars, n);
  if (rc) return rc;
  if (scratch_items(c, c->nslices)) return seterr(c, PS_ENOMEM, "out of memory");
  ps_req *r = req_new(c, REQ_PUSH);
  if (!r) return seterr(c, PS_ENOMEM, "out of memory");
  const float **dp = c->segdata;
  uint64_t *dc = c->segcount;
  for (int p = 0; p < c->num_ps; p++) {
    size_t k = 0;
    uint64_t bytes = 0;
    /* Slices of this ps, packed into frames of at most PS__MAX_DATA. */
    FOR_SLICES(c, vars, n, p, s, {
      if (k && (bytes + s->length * sizeof(float) > PS__MAX_DATA ||
                k == PS__MAX_ITEMS_PER_FRAME)) {
        if ((rc = push_frame(c, r, p, step, k, bytes)) != 0) return rc;
        k = 0;
        bytes = 0;
      }
      ps__item__init(&c->items[k]);
      c->items[k].slice_id = s->remote_id;
      c->items[k].count = s->length;
      c->itemp[k] = &c->items[k];
      dp[k] = s->var->grad + s->offset;
      dc[k] = s->length;
      bytes += s->length * sizeof(float);
      k++;
    });
    if (k && (rc = push_frame(c, r, p, step, k, bytes)) != 0) return rc;
    conn_flush(c, &c->conns[p]);
  }
  if (r->pending == 0) req_finish(c, r);
  *out = r;
  return 0;
}

/* Queues one Pull of the first k scratch ids to ps p (released on error). */
static int pull_frame(ps_client *c, ps_req *r, int p, uint64_t min_step, size_t k) {
  Ps__Pull m = PS__PULL__INIT;
  m.request_id = r->id;
  m.min_step = min_step;
  m.n_slice_ids = k;
  m.slice_ids = c->ids;
  m.timeout_ms = (uint32_t)c->request_timeout_ms;
  int rc = queue_frame(c, &c->conns[p], PS__MSG_PULL, &m.base, NULL, NULL, 0);
  if (rc) {
    req_release(c, r);
    return rc;
  }
  expect(r, p, (int)k);
  return 0;
}

int ps_client_pull_async(ps_client *c, uint64_t min_step, ps_var *const *vars, size_t n,
                         ps_req **out) {
  if (!c || !out) return PS_EINVAL;
  *out = NULL;
  int rc = check_vars(c, vars, n);
  if (rc) return rc;
  if (scratch_items(c, c->nslices)) return seterr(c, PS_ENOMEM, "out of memory");
  ps_req *r = req_new(c, REQ_PULL);
  if (!r) return seterr(c, PS_ENOMEM, "out of memory");
  for (int p = 0; p < c->num_ps; p++) {
    size_t k = 0;
    FOR_SLICES(c, vars, n, p, s, {
      c->ids[k++] = s->remote_id;
      if (k == PS__MAX_ITEMS_PER_FRAME) {
        if ((rc = pull_frame(c, r, p, min_step, k)) != 0) return rc;
        k = 0;
      }
    });
    if (k && (rc = pull_frame(c, r, p, min_step, k)) != 0) return rc;
    conn_flush(c, &c->conns[p]);
  }
  if (r->pending == 0) req_finish(c, r);
  *out = r;
  return 0;
}

int ps_client_pull(ps_client *c, uint64_t min_step, uint64_t *step_out) {
  ps_req *r;
  int rc = ps_client_pull_async(c, min_step, NULL, 0, &r);
  if (rc) return rc;
  rc = ps_req_wait(r, -1, step_out);
  req_release(c, r);
  ps__telem_idle(&c->telem, now_s());
  return rc;
}

static int stopped_err(ps_client *c) {
  return seterr(c, PS_ESTOPPED,
                "the job stops on request: the parameter servers checkpointed step %llu; "
                "run it again to resume there",
                (unsigned long long)c->stop_step);
}

/* Sends Checkpoint{step, stop, commit} to every server and waits. 0 (see
 * r->refused and r->max_step in *out, released by the caller) or <0. */
static int checkpoint_round(ps_client *c, uint64_t step, int stop, int commit, ps_req **out) {
  ps_req *r = req_new(c, REQ_CHECKPOINT);
  if (!r) return seterr(c, PS_ENOMEM, "out of memory");
  int rc = 0;
  for (int p = 0; p < c->num_ps && rc == 0; p++) {
    Ps__Checkpoint m = PS__CHECKPOINT__INIT;
    m.request_id = r->id;
    m.step = step;
    m.stop = stop;
    m.commit = commit;
    rc = queue_frame(c, &c->conns[p], PS__MSG_CHECKPOINT, &m.base, NULL, NULL, 0);
    if (rc == 0) {
      expect(r, p, 1);
      conn_flush(c, &c->conns[p]);
    }
  }
  if (rc == 0) rc = ps_req_wait(r, -1, NULL);
  if (rc) {
    req_release(c, r);
    return rc;
  }
  *out = r;
  return 0;
}

/* The chief: every server checkpoints at one step. Prepare at `step` (the
 * step whose parameters we just received, so in sync training no server
 * can be past it); a server already past it refuses and says how far it
 * is, and the next round tries that step. */
static int agree_checkpoint(ps_client *c, uint64_t step, int stop) {
  for (int round = 0; round < PS__CKPT_ROUNDS; round++) {
    ps_req *r;
    int rc = checkpoint_round(c, step, stop, 0, &r);
    if (rc) return rc;
    int refused = r->refused;
    uint64_t max = r->max_step;
    req_release(c, r);
    if (!refused) {
      if ((rc = checkpoint_round(c, step, stop, 1, &r)) != 0) return rc;
      refused = r->refused;
      req_release(c, r);
      if (refused) return PS_ESTATE; /* errmsg names the server */
      return 0;
    }
    if (max <= step) return PS_ESTATE; /* refused for another reason: errmsg */
    step = max + 1; /* margin: backup workers may move it on meanwhile */
  }
  return seterr(c, PS_ESTATE, "the servers did not agree on a checkpoint step in %d rounds",
                PS__CKPT_ROUNDS);
}

/* Between steps: arranges checkpoints and stops the servers asked for.
 * A failed timed checkpoint does not end training (the servers log it);
 * a failed stop does. */
static int after_step(ps_client *c, uint64_t step) {
  int stop = (c->want_stop || c->stop_requested) && !c->stop_agreed;
  if (!stop && !c->want_ckpt) return 0;
  if (!c->checkpoints) {
    if (c->stop_requested)
      return seterr(c, PS_ESHUTDOWN,
                    "stop requested, and the parameter servers keep no checkpoints "
                    "(no --checkpoint-dir): nothing was saved");
    return 0;
  }
  if (c->worker_index != 0) return 0; /* the chief arranges it; replies tell us */
  c->want_ckpt = 0;
  c->want_stop = 0;
  int rc = agree_checkpoint(c, step, stop);
  if (rc) return stop ? rc : 0;
  if (stop) c->stop_agreed = 1; /* keep stepping until every server stopped */
  return all_stopped(c) ? stopped_err(c) : 0;
}

void ps_client_request_stop(ps_client *c) {
  if (c) c->stop_requested = 1;
}

int ps_client_step(ps_client *c, uint64_t *step, int *stale_out) {
  if (!c || !step) return PS_EINVAL;
  if (stale_out) *stale_out = 0;
  /* The pull goes first, so the servers answer each slice the moment its
   * update is applied, while the rest of the push is still arriving. */
  ps_req *pull = NULL, *push = NULL;
  uint64_t from = *step;
  ps__telem_step_begin(&c->telem, now_s());
  uint64_t want = c->async_mode ? 0 : *step + 1;
  int rc = ps_client_pull_async(c, want, NULL, 0, &pull);
  if (rc) return rc;
  rc = ps_client_push_async(c, *step, NULL, 0, &push);
  if (rc) {
    req_release(c, pull); /* its answers, if any, are dropped on arrival */
    return rc;
  }
  int prc = ps_req_wait(push, -1, NULL);
  double push_done = now_s();
  char pmsg[sizeof c->errmsg];
  if (prc && prc != PS_ESTALE) snprintf(pmsg, sizeof pmsg, "%s", c->errmsg);
  uint64_t got = 0;
  int lrc = ps_req_wait(pull, -1, &got);
  ps__telem_step_end(&c->telem, from, push_done, pull->first_reply_at, prc == PS_ESTALE,
                     now_s());
  req_release(c, push);
  req_release(c, pull);
  if (prc && prc != PS_ESTALE) {
    snprintf(c->errmsg, sizeof c->errmsg, "%s", pmsg);
    return prc;
  }
  if (lrc) return lrc;
  if (prc == PS_ESTALE && stale_out) *stale_out = 1;
  if (all_stopped(c)) return stopped_err(c);
  *step = c->async_mode ? *step + 1 : got;
  return after_step(c, *step);
}

int ps_client_finish(ps_client *c) {
  if (!c) return PS_EINVAL;
  Ps__WorkerSummary summary;
  int have_summary = c->telem.on && ps__telem_summary(&c->telem, &summary) == 0;
  ps_req *r = req_new(c, REQ_FINISH);
  if (!r) return seterr(c, PS_ENOMEM, "out of memory");
  int rc = 0;
  for (int p = 0; p < c->num_ps && rc == 0; p++) {
    if (c->conns[p].fd < 0) {
      rc = seterr(c, PS_ECLOSED, "connection to ps %d at %s is lost", p, c->conns[p].addr);
      break;
    }
    Ps__Finish m = PS__FINISH__INIT;
    m.request_id = r->id;
    m.summary = have_summary ? &summary : NULL; /* for ps0's end-of-run table */
    rc = queue_frame(c, &c->conns[p], PS__MSG_FINISH, &m.base, NULL, NULL, 0);
    if (rc == 0) expect(r, p, 1);
  }
  if (rc) {
    req_release(c, r);
    return rc;
  }
  return wait_done(c, r);
}
