/* Integration: hostile input against a live psd. Garbage, oversized,
 * truncated, out-of-order and semantically wrong frames sent over raw TCP
 * must get a fatal ERROR naming the problem (when psd can answer), be
 * logged, close that one connection, and leave psd serving everyone else:
 * a training run under a barrage of such connections ends with parameters
 * bit-for-bit equal to a clean run's. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <math.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ps.pb-c.h"
#include "wire.h"
#include "testutil.h"

/* ---- raw sockets ---------------------------------------------------------- */

/* Exactly n bytes before the deadline; 0 or -1 (EOF, error, timeout). */
static int recv_exact(int fd, void *buf, size_t n, double deadline) {
  uint8_t *p = buf;
  while (n > 0) {
    double left = deadline - ps__now();
    if (left <= 0) return -1;
    struct pollfd pf = {fd, POLLIN, 0};
    int pr = poll(&pf, 1, (int)(left * 1000) + 1);
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return -1;
    ssize_t r = recv(fd, p, n, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

/* One reply frame: header and protobuf (data is read and dropped). */
typedef struct rframe {
  ps__frame_header h;
  uint8_t meta[65536];
} rframe;

/* psd's Challenge (the first frame on every connection) is skipped: these
 * tests run without a secret, so the Hello needs no proof. */
static int read_frame(int fd, rframe *f, double timeout_s) {
  double end = ps__now() + timeout_s;
  uint8_t hb[PS__HEADER_SIZE];
  char err[256];
again:
  if (recv_exact(fd, hb, sizeof hb, end) != 0) return -1;
  if (ps__header_decode(hb, 1, &f->h, err, sizeof err) != 0) return -1;
  if (f->h.meta_len > sizeof f->meta) return -1;
  if (recv_exact(fd, f->meta, f->h.meta_len, end) != 0) return -1;
  for (uint64_t left = f->h.data_len; left > 0;) {
    uint8_t junk[4096];
    size_t k = left < sizeof junk ? (size_t)left : sizeof junk;
    if (recv_exact(fd, junk, k, end) != 0) return -1;
    left -= k;
  }
  if (f->h.type == PS__MSG_CHALLENGE) goto again;
  return 0;
}

/* What a server sent back, parsed. */
typedef struct herr {
  int found;          /* an ERROR frame was among the frames */
  int code, fatal;
  uint64_t request_id;
  char msg[1024];
  int frames;         /* whole frames parsed */
  int bad;            /* bytes that are not whole valid frames */
} herr;

static void copy_error(const uint8_t *meta, size_t len, herr *e) {
  Ps__Error *m = ps__error__unpack(NULL, len, meta);
  if (!m) {
    e->bad = 1;
    return;
  }
  e->found = 1;
  e->code = m->code;
  e->fatal = m->fatal;
  e->request_id = m->request_id;
  snprintf(e->msg, sizeof e->msg, "%s", m->message ? m->message : "");
  ps__error__free_unpacked(m, NULL);
}

static void parse_reply(const uint8_t *b, size_t n, herr *e) {
  memset(e, 0, sizeof *e);
  size_t off = 0;
  while (off < n) {
    ps__frame_header h;
    char err[256];
    if (n - off < PS__HEADER_SIZE || ps__header_decode(b + off, 1, &h, err, sizeof err) != 0 ||
        n - off - PS__HEADER_SIZE < (uint64_t)h.meta_len + h.data_len) {
      e->bad = 1;
      return;
    }
    if (h.type == PS__MSG_ERROR && !e->found)
      copy_error(b + off + PS__HEADER_SIZE, h.meta_len, e);
    e->frames++;
    off += PS__HEADER_SIZE + h.meta_len + (size_t)h.data_len;
  }
}

/* ---- frames --------------------------------------------------------------- */

typedef struct hbuf {
  uint8_t b[16384];
  size_t n;
} hbuf;

static int hb_put(hbuf *h, const void *p, size_t n) {
  if (n > sizeof h->b - h->n) return -1;
  if (n) memcpy(h->b + h->n, p, n);
  h->n += n;
  return 0;
}

static void put_le(uint8_t *p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* A header with every field chosen by the caller. */
static void put_raw_header(hbuf *h, uint32_t magic, uint16_t version, uint16_t type,
                           uint32_t meta, uint32_t flags, uint64_t data) {
  uint8_t o[PS__HEADER_SIZE];
  put_le(o, magic, 4);
  put_le(o + 4, version, 2);
  put_le(o + 6, type, 2);
  put_le(o + 8, meta, 4);
  put_le(o + 12, flags, 4);
  put_le(o + 16, data, 8);
  hb_put(h, o, sizeof o);
}

/* A well-formed frame: header, packed msg (may be NULL), dlen data bytes
 * (from data, or 0.25f values when data is NULL). */
static void put_msg(hbuf *h, unsigned type, const ProtobufCMessage *msg, const void *data,
                    size_t dlen) {
  size_t ml = msg ? protobuf_c_message_get_packed_size(msg) : 0;
  uint8_t hdr[PS__HEADER_SIZE];
  ps__header_encode(hdr, type, (uint32_t)ml, dlen);
  if (sizeof h->b - h->n < PS__HEADER_SIZE + ml + dlen) {
    h->n = sizeof h->b + 1; /* poisoned: checked by the callers */
    return;
  }
  hb_put(h, hdr, sizeof hdr);
  if (msg) protobuf_c_message_pack(msg, h->b + h->n);
  h->n += ml;
  for (size_t i = 0; i < dlen; i += 4) {
    float v = 0.25f;
    if (data) hb_put(h, (const uint8_t *)data + i, dlen - i < 4 ? dlen - i : 4);
    else hb_put(h, &v, dlen - i < 4 ? dlen - i : 4);
  }
}

typedef struct hello_args {
  uint32_t version, role, worker, nworkers, num_ps, ps_index;
  uint64_t max_slice_bytes;
  const char *client_id; /* NULL: "test_hostile" */
} hello_args;

static hello_args hello_default(uint32_t worker, uint32_t nworkers) {
  hello_args a = {PS__PROTOCOL_VERSION, PS__ROLE__ROLE_WORKER, worker, nworkers, 1, 0, 0, NULL};
  return a;
}

static void put_hello(hbuf *h, hello_args a) {
  Ps__Hello m = PS__HELLO__INIT;
  m.protocol_version = a.version;
  m.role = (Ps__Role)a.role;
  m.worker_index = a.worker;
  m.num_workers = a.nworkers;
  m.num_ps = a.num_ps;
  m.ps_index = a.ps_index;
  m.max_slice_bytes = a.max_slice_bytes;
  m.client_id = (char *)(a.client_id ? a.client_id : "test_hostile");
  put_msg(h, PS__MSG_HELLO, &m.base, NULL, 0);
}

/* REGISTER of one slice [0, length) of name with the given shape. */
static void put_register_opt(hbuf *h, uint64_t req, const char *name, const uint64_t *shape,
                             size_t nd, uint32_t dtype, uint64_t length, size_t dlen,
                             Ps__Optimizer *opt) {
  Ps__SliceSpec sp = PS__SLICE_SPEC__INIT;
  sp.optimizer = opt;
  sp.name = (char *)name;
  sp.shape = (uint64_t *)shape;
  sp.n_shape = nd;
  sp.dtype = dtype;
  sp.offset = 0;
  sp.length = length;
  Ps__SliceSpec *sps[1] = {&sp};
  Ps__Register m = PS__REGISTER__INIT;
  m.request_id = req;
  m.n_slices = 1;
  m.slices = sps;
  put_msg(h, PS__MSG_REGISTER, &m.base, NULL, dlen);
}

static void put_register(hbuf *h, uint64_t req, const char *name, const uint64_t *shape,
                         size_t nd, uint32_t dtype, uint64_t length, size_t dlen) {
  put_register_opt(h, req, name, shape, nd, dtype, length, dlen, NULL);
}

/* PUSH (or INIT) of one item. */
static void put_push(hbuf *h, unsigned type, uint64_t req, uint64_t step, uint32_t slice,
                     uint64_t count, int sparse, const float *data, size_t dlen) {
  Ps__Item it = PS__ITEM__INIT;
  it.slice_id = slice;
  it.count = count;
  uint64_t rows[1] = {0};
  if (sparse) {
    it.rows = rows;
    it.n_rows = 1;
    it.row_width = count;
  }
  Ps__Item *its[1] = {&it};
  if (type == PS__MSG_INIT) {
    Ps__Init m = PS__INIT__INIT;
    m.request_id = req;
    m.n_items = 1;
    m.items = its;
    put_msg(h, type, &m.base, data, dlen);
  } else {
    Ps__Push m = PS__PUSH__INIT;
    m.request_id = req;
    m.step = step;
    m.n_items = 1;
    m.items = its;
    put_msg(h, type, &m.base, data, dlen);
  }
}

/* PUSH (or INIT) of one item of the given wire dtype (2.3) with dlen
 * bytes of data, whatever the count says. */
static void put_push_dt(hbuf *h, unsigned type, uint64_t req, uint32_t slice, uint64_t count,
                        uint32_t dtype, size_t dlen) {
  Ps__Item it = PS__ITEM__INIT;
  it.slice_id = slice;
  it.count = count;
  it.dtype = dtype;
  Ps__Item *its[1] = {&it};
  Ps__Push m = PS__PUSH__INIT;
  Ps__Init mi = PS__INIT__INIT;
  m.request_id = mi.request_id = req;
  m.n_items = mi.n_items = 1;
  m.items = mi.items = its;
  put_msg(h, type, type == PS__MSG_INIT ? &mi.base : &m.base, NULL, dlen);
}

/* An Init with assign (protocol 2.1): values for slice at the chief's step. */
static void put_assign(hbuf *h, uint64_t req, uint64_t step, uint32_t slice, uint64_t count,
                       const float *data, size_t dlen) {
  Ps__Item it = PS__ITEM__INIT;
  it.slice_id = slice;
  it.count = count;
  Ps__Item *its[1] = {&it};
  Ps__Init m = PS__INIT__INIT;
  m.request_id = req;
  m.n_items = 1;
  m.items = its;
  m.assign = 1;
  m.step = step;
  put_msg(h, PS__MSG_INIT, &m.base, data, dlen);
}

static void put_pull(hbuf *h, uint64_t req, uint64_t min_step, const uint32_t *ids, size_t n) {
  Ps__Pull m = PS__PULL__INIT;
  m.request_id = req;
  m.min_step = min_step;
  m.slice_ids = (uint32_t *)ids;
  m.n_slice_ids = n;
  put_msg(h, PS__MSG_PULL, &m.base, NULL, 0);
}

static void put_finish(hbuf *h, uint64_t req) {
  Ps__Finish m = PS__FINISH__INIT;
  m.request_id = req;
  put_msg(h, PS__MSG_FINISH, &m.base, NULL, 0);
}

/* ---- the hostile cases ---------------------------------------------------- */

enum { SETUP_NONE, SETUP_HELLO, SETUP_VAR, SETUP_INIT };
enum { X_FATAL, X_NONFATAL, X_SILENT };

typedef struct hcase {
  const char *name;
  int setup;         /* done (and checked) before the hostile bytes */
  int worker;        /* worker index of that handshake (of 2) */
  int expect;        /* X_FATAL: fatal ERROR then close; X_NONFATAL: ERROR
                        with fatal 0, connection stays; X_SILENT: nothing back,
                        just a close (we closed mid-frame) */
  int code;          /* expected PS_E* code */
  const char *word;  /* the error message (and log) must contain it */
  int alt_code;      /* another acceptable code (0: none) */
} hcase;

static const hcase CASES[] = {
    {"garbage", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "magic", 0},
    {"http_get", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "magic", 0},
    {"bad_magic", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "magic", 0},
    {"bad_version", SETUP_NONE, 0, X_FATAL, PS_EVERSION, "version", 0},
    {"unknown_type", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "unknown message type", 0},
    {"type_zero", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "unknown message type", 0},
    {"nonzero_flags", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "flags", 0},
    {"push_before_hello", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "before the handshake", 0},
    /* TABLE_* before the handshake: refused by the header alone (a 256 MiB
     * data_len allocates nothing) */
    {"table_register_before_hello", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "before the handshake", 0},
    {"table_push_before_hello", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "before the handshake", 0},
    /* framing of TABLE_* after it: fatal, naming the numbers */
    {"table_pull_count_2p22_plus1", SETUP_HELLO, 0, X_FATAL, PS_ETOOBIG, "TABLE_PULL of", 0},
    {"table_pull_data_mismatch", SETUP_HELLO, 0, X_FATAL, PS_EPROTO, "data bytes", 0},
    {"table_push_count_overflow", SETUP_HELLO, 0, X_FATAL, PS_EPROTO, "data bytes", 0},
    {"hello_meta_4097", SETUP_NONE, 0, X_FATAL, PS_ETOOBIG, "too large", 0},
    {"hello_data_1g", SETUP_NONE, 0, X_FATAL, PS_ETOOBIG, "too large", 0},
    {"hello_reply_from_client", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "unexpected", 0},
    {"malformed_hello", SETUP_NONE, 0, X_FATAL, PS_EPROTO, "malformed", 0},
    {"truncated_header", SETUP_NONE, 0, X_SILENT, 0, NULL, 0},
    {"truncated_meta", SETUP_NONE, 0, X_SILENT, 0, NULL, 0},
    {"hello_version_2", SETUP_NONE, 0, X_FATAL, PS_EVERSION, "version", 0},
    {"hello_ps_index_3", SETUP_NONE, 0, X_FATAL, PS_EMISMATCH, "expects ps 3", 0},
    {"hello_worker_out_of_range", SETUP_NONE, 0, X_FATAL, PS_EINVAL,
     "not below the number of workers", 0},
    {"hello_wrong_num_workers", SETUP_NONE, 0, X_FATAL, PS_EMISMATCH, "--workers 2", 0},
    {"hello_unknown_role", SETUP_NONE, 0, X_FATAL, PS_EUNSUPPORTED, "role", 0},
    {"admin_sends_register", SETUP_NONE, 0, X_FATAL, PS_ESTATE, "may only send STATS", 0},
    {"hello_bad_max_slice", SETUP_NONE, 0, X_FATAL, PS_EINVAL, "max_slice_bytes", 0},
    {"second_hello", SETUP_HELLO, 0, X_FATAL, PS_EPROTO, "second HELLO", 0},
    {"meta_over_1mib", SETUP_HELLO, 0, X_FATAL, PS_ETOOBIG, "exceeds the limit", 0},
    {"data_over_1gib", SETUP_HELLO, 0, X_FATAL, PS_ETOOBIG, "exceeds the limit", 0},
    {"data_not_floats", SETUP_VAR, 0, X_FATAL, PS_EPROTO, "16-bit", 0},
    {"register_with_data", SETUP_HELLO, 0, X_FATAL, PS_EPROTO, "takes none", 0},
    {"register_dtype_2", SETUP_HELLO, 0, X_NONFATAL, PS_EINVAL, "dtype 2", 0},
    {"register_9_dims", SETUP_HELLO, 0, X_NONFATAL, PS_EINVAL, "9 dimensions", 0},
    {"register_zero_dim", SETUP_HELLO, 0, X_NONFATAL, PS_ESHAPE, "zero", 0},
    {"register_size_overflow", SETUP_HELLO, 0, X_NONFATAL, PS_ESHAPE, "overflow", 0},
    {"register_other_shape", SETUP_VAR, 0, X_NONFATAL, PS_ESHAPE, "asks for shape [5]", 0},
    /* 2^62 elements: length * 4 wraps to 0, so only the placement check
     * stops it; either way nothing may be allocated */
    {"register_huge_slice", SETUP_HELLO, 0, X_NONFATAL, PS_ETOOBIG, "slice", PS_ESHAPE},
    {"register_bad_optimizer", SETUP_HELLO, 0, X_NONFATAL, PS_EINVAL, "decay_steps", 0},
    {"register_nameless", SETUP_HELLO, 0, X_NONFATAL, PS_EINVAL, "name", 0},
    {"push_unknown_slice", SETUP_VAR, 0, X_FATAL, PS_ENOTFOUND, "unknown slice id 12345", 0},
    {"push_data_len_mismatch", SETUP_VAR, 0, X_FATAL, PS_EPROTO, "add up to 16 bytes", 0},
    {"push_wrong_count", SETUP_VAR, 0, X_FATAL, PS_ESHAPE, "the slice has 4", 0},
    {"push_row_sparse", SETUP_VAR, 0, X_FATAL, PS_EUNSUPPORTED, "not supported", 0},
    {"pull_unknown_slice", SETUP_VAR, 0, X_FATAL, PS_ENOTFOUND, "unknown slice id 12345", 0},
    {"init_not_chief", SETUP_VAR, 1, X_FATAL, PS_ESTATE, "chief", 0},
    {"push_after_finish", SETUP_INIT, 0, X_FATAL, PS_ESTATE, "after FINISH", 0},
    {"malformed_push", SETUP_VAR, 0, X_FATAL, PS_EPROTO, "malformed PUSH", 0},
    {"error_from_client", SETUP_HELLO, 0, X_FATAL, PS_EPROTO, "unexpected ERROR", 0},
    /* Protocol 2.1's assign (an Init with assign set). Listed last: the
     * barrage below draws only from the cases before them, so its fixed
     * pseudo-random sequence (and which rate-limited log lines come first,
     * which it checks) stays what it was. */
    {"assign_not_chief", SETUP_VAR, 1, X_FATAL, PS_ESTATE, "only the chief (worker 0) assigns", 0},
    {"assign_wrong_count", SETUP_INIT, 0, X_FATAL, PS_ESHAPE, "the slice has 4", 0},
    {"assign_data_len_mismatch", SETUP_INIT, 0, X_FATAL, PS_EPROTO, "add up to 16 bytes", 0},
    {"assign_unknown_slice", SETUP_INIT, 0, X_FATAL, PS_ENOTFOUND, "unknown slice id 12345", 0},
    {"assign_future_step", SETUP_INIT, 0, X_NONFATAL, PS_EINVAL, "only at step 0", 0},
    /* 16-bit wire dtypes (2.3): the data length follows the item's dtype */
    {"push_bf16_float32_length", SETUP_VAR, 0, X_FATAL, PS_EPROTO, "add up to 8 bytes", 0},
    {"push_fp16_short", SETUP_INIT, 0, X_FATAL, PS_EPROTO, "add up to 8 bytes", 0},
    {"init_bf16_float32_length", SETUP_VAR, 0, X_FATAL, PS_EPROTO, "add up to 8 bytes", 0},
    {"push_unknown_dtype", SETUP_VAR, 0, X_FATAL, PS_EPROTO, "wire dtype 3", 0},
    {"pull_unknown_dtype", SETUP_VAR, 0, X_FATAL, PS_EPROTO, "wire dtype 7", 0},
    /* 2.7: a pull of the moving average of a variable that keeps none (the
     * reference client refuses it before sending) */
    {"pull_average_without_one", SETUP_INIT, 0, X_NONFATAL, PS_EINVAL,
     "variable 'x' keeps no moving average", 0},
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))
/* The cases the barrage draws from: those before the first 2.1 case. */
static int barrage_cases(void) {
  for (int i = 0; i < NCASES; i++)
    if (!strcmp(CASES[i].name, "assign_not_chief")) return i;
  return NCASES;
}

/* The hostile bytes of case i, sent after its setup. slice is the id the
 * setup's REGISTER got. */
static void build_case(int i, hbuf *h, uint32_t slice) {
  const char *n = CASES[i].name;
  static const uint64_t s4[1] = {4};
  float four[4] = {0.5f, -0.5f, 0.25f, 1.0f};
  if (!strcmp(n, "garbage")) {
    uint64_t x = 0x5eed1234abcdULL; /* fixed seed: the same bytes every run */
    for (int k = 0; k < 512; k++) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      uint8_t byte = (uint8_t)(x >> 56);
      hb_put(h, &byte, 1);
    }
    if (h->b[0] == 'P') h->b[0] = 'X'; /* never the magic by accident */
  } else if (!strcmp(n, "http_get")) {
    const char *req = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: test\r\n\r\n";
    hb_put(h, req, strlen(req));
  } else if (!strcmp(n, "bad_magic")) {
    put_raw_header(h, 0xDEADBEEFu, 1, PS__MSG_HELLO, 0, 0, 0);
  } else if (!strcmp(n, "bad_version")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION + 1, PS__MSG_HELLO, 0, 0, 0);
  } else if (!strcmp(n, "unknown_type")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, 99, 0, 0, 0);
  } else if (!strcmp(n, "type_zero")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, 0, 0, 0, 0);
  } else if (!strcmp(n, "nonzero_flags")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_HELLO, 0, 1, 0);
  } else if (!strcmp(n, "push_before_hello")) {
    put_push(h, PS__MSG_PUSH, 1, 0, 0, 4, 0, four, 16);
  } else if (!strcmp(n, "table_register_before_hello")) {
    Ps__TableSpec sp = PS__TABLE_SPEC__INIT;
    sp.name = (char *)"t";
    sp.dim = 4;
    sp.capacity = 16;
    sp.lr = 0.1;
    Ps__TableRegister m = PS__TABLE_REGISTER__INIT;
    m.request_id = 1;
    m.spec = &sp;
    put_msg(h, PS__MSG_TABLE_REGISTER, &m.base, NULL, 0);
  } else if (!strcmp(n, "table_push_before_hello")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_TABLE_PUSH, 0, 0,
                   PS__MAX_TABLE_PUSH_BYTES);
  } else if (!strcmp(n, "table_pull_count_2p22_plus1") ||
             !strcmp(n, "table_pull_data_mismatch")) {
    Ps__TablePull m = PS__TABLE_PULL__INIT;
    m.request_id = 1;
    m.count = strstr(n, "count") ? (uint64_t)PS__MAX_TABLE_KEYS + 1 : 2;
    put_msg(h, PS__MSG_TABLE_PULL, &m.base, NULL, m.count == 2 ? 8 : 0);
  } else if (!strcmp(n, "table_push_count_overflow")) {
    /* count * (8 + 4 dim) wraps for an unknown table's 16 bytes */
    Ps__TablePush m = PS__TABLE_PUSH__INIT;
    m.request_id = 1;
    m.table_id = 0;
    m.count = UINT64_MAX / 3;
    put_msg(h, PS__MSG_TABLE_PUSH, &m.base, NULL, 16);
  } else if (!strcmp(n, "hello_meta_4097")) {
    /* header only: psd must refuse it without waiting for the 4097 bytes */
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_HELLO, PS__MAX_PREAUTH_META + 1, 0, 0);
  } else if (!strcmp(n, "hello_data_1g")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_HELLO, 0, 0, (uint64_t)1 << 30);
  } else if (!strcmp(n, "hello_reply_from_client")) {
    Ps__HelloReply m = PS__HELLO_REPLY__INIT;
    m.protocol_version = PS__PROTOCOL_VERSION;
    put_msg(h, PS__MSG_HELLO_REPLY, &m.base, NULL, 0);
  } else if (!strcmp(n, "malformed_hello") || !strcmp(n, "malformed_push")) {
    /* field 1 with the invalid wire type 7, then an endless varint */
    static const uint8_t junk[16] = {0x0f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                     0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION,
                   !strcmp(n, "malformed_hello") ? PS__MSG_HELLO : PS__MSG_PUSH, sizeof junk,
                   0, 0);
    hb_put(h, junk, sizeof junk);
  } else if (!strcmp(n, "truncated_header")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_HELLO, 40, 0, 0);
    h->n = PS__HEADER_SIZE / 2;
  } else if (!strcmp(n, "truncated_meta")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_HELLO, 100, 0, 0);
    static const uint8_t ten[10] = {0x08, 0x01, 0x10, 0x01, 0x18, 0x00, 0x20, 0x02, 0x28, 0x01};
    hb_put(h, ten, sizeof ten);
  } else if (!strcmp(n, "hello_version_2")) {
    hello_args a = hello_default(0, 2);
    a.version = PS__PROTOCOL_VERSION + 1;
    put_hello(h, a);
  } else if (!strcmp(n, "hello_ps_index_3")) {
    hello_args a = hello_default(0, 2);
    a.ps_index = 3;
    put_hello(h, a);
  } else if (!strcmp(n, "hello_worker_out_of_range")) {
    put_hello(h, hello_default(5, 2));
  } else if (!strcmp(n, "hello_wrong_num_workers")) {
    put_hello(h, hello_default(0, 3));
  } else if (!strcmp(n, "hello_unknown_role")) {
    hello_args a = hello_default(0, 2);
    a.role = (Ps__Role)3;
    put_hello(h, a);
  } else if (!strcmp(n, "admin_sends_register")) {
    hello_args a = hello_default(0, 2);
    a.role = PS__ROLE__ROLE_ADMIN; /* accepted (psctl), but Stats only */
    put_hello(h, a);
    put_register(h, 77, "y", s4, 1, 1, 4, 0);
  } else if (!strcmp(n, "hello_bad_max_slice")) {
    hello_args a = hello_default(0, 2);
    a.max_slice_bytes = 2;
    put_hello(h, a);
  } else if (!strcmp(n, "second_hello")) {
    put_hello(h, hello_default(1, 2));
  } else if (!strcmp(n, "meta_over_1mib")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_REGISTER, PS__MAX_META + 1, 0, 0);
  } else if (!strcmp(n, "data_over_1gib")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_PUSH, 0, 0, PS__MAX_DATA + 4);
  } else if (!strcmp(n, "data_not_floats")) {
    put_raw_header(h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_PUSH, 0, 0, 5);
    hb_put(h, "\0\0\0\0\0", 5);
  } else if (!strcmp(n, "push_bf16_float32_length")) {
    put_push_dt(h, PS__MSG_PUSH, 5, slice, 4, 1, 16); /* 4 bf16 values are 8 bytes */
  } else if (!strcmp(n, "push_fp16_short")) {
    put_push_dt(h, PS__MSG_PUSH, 5, slice, 4, 2, 4);
  } else if (!strcmp(n, "init_bf16_float32_length")) {
    put_push_dt(h, PS__MSG_INIT, 5, slice, 4, 1, 16);
  } else if (!strcmp(n, "push_unknown_dtype")) {
    put_push_dt(h, PS__MSG_PUSH, 5, slice, 4, 3, 8);
  } else if (!strcmp(n, "pull_unknown_dtype")) {
    Ps__Pull m = PS__PULL__INIT;
    uint32_t ids[1] = {slice};
    m.request_id = 5;
    m.slice_ids = ids;
    m.n_slice_ids = 1;
    m.dtype = 7;
    put_msg(h, PS__MSG_PULL, &m.base, NULL, 0);
  } else if (!strcmp(n, "pull_average_without_one")) {
    Ps__Pull m = PS__PULL__INIT;
    uint32_t ids[1] = {slice};
    m.request_id = 77;
    m.slice_ids = ids;
    m.n_slice_ids = 1;
    m.average = 1;
    put_msg(h, PS__MSG_PULL, &m.base, NULL, 0);
  } else if (!strcmp(n, "register_with_data")) {
    put_register(h, 77, "y", s4, 1, 1, 4, 8);
  } else if (!strcmp(n, "register_dtype_2")) {
    put_register(h, 77, "y", s4, 1, 2, 4, 0);
  } else if (!strcmp(n, "register_9_dims")) {
    static const uint64_t s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    put_register(h, 77, "y", s9, 9, 1, 1, 0);
  } else if (!strcmp(n, "register_zero_dim")) {
    static const uint64_t s40[2] = {4, 0};
    put_register(h, 77, "y", s40, 2, 1, 4, 0);
  } else if (!strcmp(n, "register_size_overflow")) {
    static const uint64_t big[2] = {(uint64_t)1 << 32, (uint64_t)1 << 32};
    put_register(h, 77, "y", big, 2, 1, 4, 0);
  } else if (!strcmp(n, "register_other_shape")) {
    static const uint64_t s5[1] = {5};
    put_register(h, 77, "x", s5, 1, 1, 5, 0);
  } else if (!strcmp(n, "register_huge_slice")) {
    static const uint64_t huge[1] = {(uint64_t)1 << 62};
    put_register(h, 77, "y", huge, 1, 1, (uint64_t)1 << 62, 0);
  } else if (!strcmp(n, "register_bad_optimizer")) {
    Ps__Optimizer o = PS__OPTIMIZER__INIT;
    o.lr = 0.1;
    o.decay = PS__LR_DECAY__DECAY_STEP;
    o.decay_rate = 0.5;
    o.decay_steps = 0; /* would divide by zero */
    put_register_opt(h, 77, "y", s4, 1, 1, 4, 0, &o);
  } else if (!strcmp(n, "register_nameless")) {
    put_register(h, 77, "", s4, 1, 1, 4, 0);
  } else if (!strcmp(n, "push_unknown_slice")) {
    put_push(h, PS__MSG_PUSH, 5, 0, 12345, 4, 0, four, 16);
  } else if (!strcmp(n, "push_data_len_mismatch")) {
    put_push(h, PS__MSG_PUSH, 5, 0, slice, 4, 0, four, 8);
  } else if (!strcmp(n, "push_wrong_count")) {
    put_push(h, PS__MSG_PUSH, 5, 0, slice, 3, 0, four, 12);
  } else if (!strcmp(n, "push_row_sparse")) {
    put_push(h, PS__MSG_PUSH, 5, 0, slice, 4, 1, four, 16);
  } else if (!strcmp(n, "pull_unknown_slice")) {
    uint32_t ids[1] = {12345};
    put_pull(h, 5, 0, ids, 1);
  } else if (!strcmp(n, "init_not_chief")) {
    put_push(h, PS__MSG_INIT, 5, 0, slice, 4, 0, four, 16);
  } else if (!strcmp(n, "assign_not_chief")) {
    put_assign(h, 5, 0, slice, 4, four, 16);
  } else if (!strcmp(n, "assign_wrong_count")) {
    put_assign(h, 5, 0, slice, 3, four, 12);
  } else if (!strcmp(n, "assign_data_len_mismatch")) {
    put_assign(h, 5, 0, slice, 4, four, 8);
  } else if (!strcmp(n, "assign_unknown_slice")) {
    put_assign(h, 5, 0, 12345, 4, four, 16);
  } else if (!strcmp(n, "assign_future_step")) {
    put_assign(h, 77, 7, slice, 4, four, 16);
  } else if (!strcmp(n, "push_after_finish")) {
    put_finish(h, 4);
    put_push(h, PS__MSG_PUSH, 5, 0, slice, 4, 0, four, 16);
  } else if (!strcmp(n, "error_from_client")) {
    Ps__Error m = PS__ERROR__INIT;
    m.message = (char *)"hello from a client";
    put_msg(h, PS__MSG_ERROR, &m.base, NULL, 0);
  }
}

/* ---- psd helpers ---------------------------------------------------------- */

/* workers NULL: as the first worker says. */
static void start_psd(tu_psd *p, const char *workers) {
  /* Short timeouts so that a psd left behind by a failed test goes away. */
  const char *args[] = {"--num-ps", "1", "--ps-index", "0", "--startup-timeout", "30",
                        "--grace-period", "5", workers ? "--workers" : NULL, workers, NULL};
  ck_assert_msg(tu_psd_start(p, args) == 0, "psd did not start (log %s)", p->log_path);
}

/* "" while p runs; otherwise how it ended (and p is reaped). */
static const char *psd_gone(tu_psd *p) {
  static char why[128];
  if (p->pid == 0) return "already reaped";
  int st;
  if (waitpid(p->pid, &st, WNOHANG) != p->pid) return "";
  p->pid = 0;
  p->status = st;
  if (WIFSIGNALED(st)) snprintf(why, sizeof why, "killed by signal %d (%s)", WTERMSIG(st),
                                strsignal(WTERMSIG(st)));
  else snprintf(why, sizeof why, "exited with status %d", WEXITSTATUS(st));
  return why;
}

/* psd is alive and its event loop answers a new connection at once: a
 * HELLO for the wrong ps gets a fatal ERROR within 2 s. */
static void expect_serving(tu_psd *p, const char *after) {
  const char *gone = psd_gone(p);
  ck_assert_msg(gone[0] == '\0', "psd died after %s: %s (log %s)", after, gone, p->log_path);
  int fd = tu_connect(p->addr);
  ck_assert_msg(fd >= 0, "psd no longer accepts connections after %s", after);
  hbuf h = {{0}, 0};
  hello_args a = hello_default(0, 2);
  a.ps_index = 9;
  put_hello(&h, a);
  tu_send_all(fd, h.b, h.n);
  uint8_t rb[4096];
  size_t n;
  int eof = tu_read_until_eof(fd, rb, sizeof rb, 2.0, &n);
  close(fd);
  herr e;
  parse_reply(rb, n, &e);
  gone = psd_gone(p);
  ck_assert_msg(gone[0] == '\0', "psd died after %s: %s (log %s)", after, gone, p->log_path);
  int ok = eof && e.found && e.fatal && strstr(e.msg, "expects ps 9");
  if (!ok) tu_psd_kill(p); /* a hung psd runs no timers: never leave it behind */
  ck_assert_msg(ok,
                "psd stopped serving after %s: a probe HELLO got %s%zu bytes%s%s "
                "(hung event loop?) (log %s)",
                after, eof ? "" : "no close and ", n, e.found ? ", error: " : "", e.msg,
                p->log_path);
}

/* Handshake (and REGISTER x[4], and INIT) as worker w of 2 on fd, checking
 * every reply. Returns the slice id of x. */
static uint32_t do_setup(int fd, int setup, int w, const char *name) {
  static rframe f;
  hbuf h = {{0}, 0};
  put_hello(&h, hello_default((uint32_t)w, 2));
  ck_assert_int_eq(tu_send_all(fd, h.b, h.n), 0);
  ck_assert_msg(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_HELLO_REPLY,
                "%s: the handshake as worker %d failed (reply type %u)", name, w, f.h.type);
  if (setup < SETUP_VAR) return 0;
  static const uint64_t s4[1] = {4};
  h.n = 0;
  put_register(&h, 2, "x", s4, 1, 1, 4, 0);
  ck_assert_int_eq(tu_send_all(fd, h.b, h.n), 0);
  ck_assert_msg(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_REGISTER_REPLY,
                "%s: REGISTER x[4] failed (reply type %u)", name, f.h.type);
  Ps__RegisterReply *r = ps__register_reply__unpack(NULL, f.h.meta_len, f.meta);
  ck_assert_msg(r && r->n_slices == 1, "%s: bad REGISTER_REPLY", name);
  uint32_t slice = r->slices[0]->slice_id;
  ps__register_reply__free_unpacked(r, NULL);
  if (setup < SETUP_INIT) return slice;
  float v[4] = {1, 2, 3, 4};
  h.n = 0;
  put_push(&h, PS__MSG_INIT, 3, 0, slice, 4, 0, v, sizeof v);
  ck_assert_int_eq(tu_send_all(fd, h.b, h.n), 0);
  ck_assert_msg(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_ACK,
                "%s: INIT failed (reply type %u)", name, f.h.type);
  return slice;
}

/* ---- 1: every case against its own live psd ------------------------------ */

START_TEST(test_case) {
  const hcase *hc = &CASES[_i];
  tu_psd p;
  start_psd(&p, "2");
  int fd = tu_connect(p.addr);
  ck_assert_msg(fd >= 0, "%s: cannot connect to psd", hc->name);
  uint32_t slice = hc->setup != SETUP_NONE ? do_setup(fd, hc->setup, hc->worker, hc->name) : 0;
  hbuf h = {{0}, 0};
  build_case(_i, &h, slice);
  ck_assert_msg(h.n > 0 && h.n <= sizeof h.b, "%s: bad test frame", hc->name);

  double t0 = ps__now();
  tu_send_all(fd, h.b, h.n); /* psd may close before taking it all */
  if (hc->expect == X_SILENT) shutdown(fd, SHUT_WR); /* we hang up mid-frame */

  if (hc->expect == X_NONFATAL) {
    static rframe f;
    ck_assert_msg(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_ERROR,
                  "%s: no ERROR reply within 3 s (type %u)", hc->name, f.h.type);
    herr e;
    memset(&e, 0, sizeof e);
    copy_error(f.meta, f.h.meta_len, &e);
    ck_assert_msg(e.found, "%s: ERROR reply does not parse", hc->name);
    ck_assert_msg(!e.fatal, "%s: error should not be fatal: %s", hc->name, e.msg);
    ck_assert_msg(e.code == hc->code || (hc->alt_code && e.code == hc->alt_code),
                  "%s: code %s, expected %s (%s)", hc->name, ps_err_name(e.code),
                  ps_err_name(hc->code), e.msg);
    ck_assert_msg(strstr(e.msg, hc->word), "%s: error '%s' does not mention '%s'", hc->name,
                  e.msg, hc->word);
    ck_assert_uint_eq(e.request_id, 77);
    /* The connection is still usable. */
    hbuf h2 = {{0}, 0};
    put_pull(&h2, 78, 0, NULL, 0);
    ck_assert_int_eq(tu_send_all(fd, h2.b, h2.n), 0);
    ck_assert_msg(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_PULL_REPLY,
                  "%s: connection unusable after a non-fatal error (type %u)", hc->name,
                  f.h.type);
    Ps__PullReply *r = ps__pull_reply__unpack(NULL, f.h.meta_len, f.meta);
    ck_assert_msg(r && r->request_id == 78, "%s: bad PULL_REPLY", hc->name);
    ps__pull_reply__free_unpacked(r, NULL);
    close(fd);
    expect_serving(&p, hc->name);
    ck_assert_msg(tu_log_contains(&p, "request 77 failed") && tu_log_contains(&p, hc->word),
                  "%s: psd did not log the failed request (log %s)", hc->name, p.log_path);
    tu_psd_kill(&p);
    return;
  }

  uint8_t rb[65536];
  size_t n;
  int eof = tu_read_until_eof(fd, rb, sizeof rb, 3.0, &n);
  double dt = ps__now() - t0;
  close(fd);
  ck_assert_msg(eof, "%s: psd did not close the connection within 3 s (%zu bytes back)",
                hc->name, n);
  ck_assert_msg(dt < tu_time_limit(1.0), "%s: psd took %.2f s to close the connection", hc->name, dt);
  herr e;
  parse_reply(rb, n, &e);
  if (hc->expect == X_SILENT) {
    ck_assert_msg(n == 0, "%s: psd answered a truncated frame with %zu bytes", hc->name, n);
    expect_serving(&p, hc->name);
    ck_assert_msg(tu_log_contains(&p, "in the middle of a frame"),
                  "%s: psd did not log the truncated frame (log %s)", hc->name, p.log_path);
  } else {
    ck_assert_msg(!e.bad, "%s: psd sent back %zu bytes that are not whole frames", hc->name,
                  n);
    ck_assert_msg(e.found, "%s: no ERROR frame in the %zu bytes psd sent back", hc->name, n);
    ck_assert_msg(e.fatal, "%s: the error should be fatal: %s", hc->name, e.msg);
    ck_assert_msg(e.code == hc->code || (hc->alt_code && e.code == hc->alt_code),
                  "%s: code %s, expected %s (%s)", hc->name, ps_err_name(e.code),
                  ps_err_name(hc->code), e.msg);
    ck_assert_msg(strstr(e.msg, hc->word), "%s: error '%s' does not mention '%s'", hc->name,
                  e.msg, hc->word);
    expect_serving(&p, hc->name);
    ck_assert_msg(tu_log_contains(&p, "closing the connection") && tu_log_contains(&p, hc->word),
                  "%s: psd did not log the rejected connection (log %s)", hc->name,
                  p.log_path);
  }
  tu_psd_kill(&p);
}
END_TEST

/* A psd announcing protocol 2.2 (--protocol-minor 2) says so in its
 * HelloReply and refuses 16-bit data as that release would not know it:
 * fatal, naming the dtype and the minor, and keeps serving. */
START_TEST(test_minor_2_refuses_16bit) {
  tu_psd p;
  const char *args[] = {"--num-ps", "1", "--ps-index", "0", "--workers", "2",
                        "--protocol-minor", "2", "--startup-timeout", "30", NULL};
  ck_assert_msg(tu_psd_start(&p, args) == 0, "psd did not start (log %s)", p.log_path);
  const char *what[] = {"push", "pull"};
  for (int k = 0; k < 2; k++) {
    int fd = tu_connect(p.addr);
    ck_assert_msg(fd >= 0, "cannot connect to psd");
    static rframe f;
    hbuf h = {{0}, 0};
    put_hello(&h, hello_default((uint32_t)k, 2));
    ck_assert_int_eq(tu_send_all(fd, h.b, h.n), 0);
    ck_assert(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_HELLO_REPLY);
    Ps__HelloReply *hr = ps__hello_reply__unpack(NULL, f.h.meta_len, f.meta);
    ck_assert_ptr_nonnull(hr);
    ck_assert_uint_eq(hr->protocol_minor, 2);
    ps__hello_reply__free_unpacked(hr, NULL);
    static const uint64_t s4[1] = {4};
    h.n = 0;
    put_register(&h, 2, "x", s4, 1, 1, 4, 0);
    ck_assert_int_eq(tu_send_all(fd, h.b, h.n), 0);
    ck_assert(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_REGISTER_REPLY);
    h.n = 0;
    if (k == 0) {
      put_push_dt(&h, PS__MSG_PUSH, 5, 0, 4, 1, 8); /* well formed: 4 bf16 values */
    } else {
      Ps__Pull m = PS__PULL__INIT;
      uint32_t ids[1] = {0};
      m.request_id = 5;
      m.slice_ids = ids;
      m.n_slice_ids = 1;
      m.dtype = 2;
      put_msg(&h, PS__MSG_PULL, &m.base, NULL, 0);
    }
    tu_send_all(fd, h.b, h.n);
    uint8_t rb[4096];
    size_t n;
    ck_assert_msg(tu_read_until_eof(fd, rb, sizeof rb, 3.0, &n), "%s: psd kept the connection",
                  what[k]);
    close(fd);
    herr e;
    parse_reply(rb, n, &e);
    ck_assert_msg(e.found && e.fatal && e.code == PS_EUNSUPPORTED, "%s: %s %s", what[k],
                  ps_err_name(e.code), e.msg);
    ck_assert_msg(strstr(e.msg, k ? "fp16" : "bfloat16") && strstr(e.msg, "announced 2.2"),
                  "%s: error '%s' names neither the dtype nor the minor", what[k], e.msg);
  }
  expect_serving(&p, "16-bit data to a 2.2 psd");
  tu_psd_kill(&p);
}
END_TEST

/* ---- 2: a barrage during a real training run ------------------------------ */

#define HOLD 6 /* connections each barrage thread keeps half-sent */

typedef struct barrage {
  tu_psd *psd;
  int id;
  int *stop;                 /* set (atomically) once training is over */
  int *training;             /* 1 while the real workers run */
  /* results */
  int conns, errors, silent, during, already, tolerated;
  int failures;
  char first_failure[512];
} barrage;

typedef struct held {
  int fd, ci;
  hbuf h;
  size_t sent;
} held;

static int both_joined(barrage *b, int *cache) {
  if (!*cache)
    *cache = tu_log_contains(b->psd, "worker 0 joined") && tu_log_contains(b->psd, "worker 1 joined");
  return *cache;
}

static void bfail(barrage *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bfail(barrage *b, const char *fmt, ...) {
  /* psd exiting at the end of training closes whatever is open: fine. */
  if (tu_log_contains(b->psd, "finished; exiting")) {
    __atomic_fetch_add(&b->tolerated, 1, __ATOMIC_SEQ_CST);
    return;
  }
  if (b->failures++ == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->first_failure, sizeof b->first_failure, fmt, ap);
    va_end(ap);
  }
}

/* Sends the rest of a held connection's bytes and checks psd's answer. */
static void finish_held(barrage *b, held *x) {
  const hcase *hc = &CASES[x->ci];
  int during = __atomic_load_n(b->training, __ATOMIC_SEQ_CST);
  tu_send_all(x->fd, x->h.b + x->sent, x->h.n - x->sent);
  int silent = hc->expect == X_SILENT && hc->setup == SETUP_NONE;
  if (silent) shutdown(x->fd, SHUT_WR);
  uint8_t rb[8192];
  size_t n;
  int eof = tu_read_until_eof(x->fd, rb, sizeof rb, 3.0, &n);
  close(x->fd);
  x->fd = -1;
  herr e;
  parse_reply(rb, n, &e);
  if (!eof) {
    bfail(b, "%s: psd did not close the connection within 3 s", hc->name);
    return;
  }
  if (silent) {
    if (n != 0) bfail(b, "%s: %zu bytes back for a truncated frame", hc->name, n);
    else __atomic_fetch_add(&b->silent, 1, __ATOMIC_SEQ_CST);
  } else if (e.bad || !e.found || !e.fatal) {
    bfail(b, "%s: expected a fatal ERROR, got %zu bytes (%s)", hc->name, n, e.msg);
    return;
  } else if (hc->setup == SETUP_NONE && e.code != hc->code && e.code != hc->alt_code) {
    bfail(b, "%s: code %s, expected %s (%s)", hc->name, ps_err_name(e.code),
         ps_err_name(hc->code), e.msg);
    return;
  } else {
    __atomic_fetch_add(&b->errors, 1, __ATOMIC_SEQ_CST);
    if (strstr(e.msg, "already connected") || strstr(e.msg, "already finished")) b->already++;
  }
  b->during += during;
}

static void *barrage_main(void *arg) {
  barrage *b = arg;
  held ring[HOLD];
  int joined = 0;
  uint64_t x = 0x9e3779b97f4a7c15ULL * (uint64_t)(b->id + 1);
  for (int k = 0; k < HOLD; k++) ring[k].fd = -1;
  for (int i = 0;; i++) {
    /* Until told to stop, or psd has gone (after the real run ended). */
    if (__atomic_load_n(b->stop, __ATOMIC_SEQ_CST) || b->tolerated) break;
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    int ci = (int)((x >> 33) % (uint64_t)barrage_cases());
    const hcase *hc = &CASES[ci];
    held *slot = &ring[i % HOLD];
    if (slot->fd >= 0) finish_held(b, slot);
    slot->ci = ci;
    slot->h.n = 0;
    if (hc->setup != SETUP_NONE) {
      /* A HELLO psd must refuse: once the real workers are in, as one of
       * them ("already connected"); before, for a job of 3 workers. It must
       * neither be accepted nor displace (or pin) the real run. */
      if (both_joined(b, &joined) && (x >> 20) % 2 == 0)
        put_hello(&slot->h, hello_default((uint32_t)(x >> 40) % 2, 2));
      else
        put_hello(&slot->h, hello_default((uint32_t)(x >> 40) % 3, 3));
    }
    build_case(ci, &slot->h, 0);
    if (slot->h.n == 0 || slot->h.n > sizeof slot->h.b) continue;
    slot->fd = tu_connect(b->psd->addr);
    __atomic_fetch_add(&b->conns, 1, __ATOMIC_SEQ_CST);
    if (slot->fd < 0) {
      bfail(b, "%s: cannot connect to psd", hc->name);
      continue;
    }
    /* Send part now, the rest when the slot comes round again. */
    slot->sent = slot->h.n > 1 ? (size_t)((x >> 8) % slot->h.n) : 0;
    if (tu_send_all(slot->fd, slot->h.b, slot->sent) != 0) slot->sent = slot->h.n;
  }
  for (int k = 0; k < HOLD; k++)
    if (ring[k].fd >= 0) finish_held(b, &ring[k]);
  return NULL;
}

enum { NW = 2, STEPS = 100, BATCH = 16, NBARRAGE = 2, PRE_ANSWERED = 150 };

/* Hostile connections psd has answered so far (all barrage threads). */
static int answered(barrage *b) {
  int n = 0;
  for (int i = 0; i < NBARRAGE; i++)
    n += __atomic_load_n(&b[i].errors, __ATOMIC_SEQ_CST) +
         __atomic_load_n(&b[i].silent, __ATOMIC_SEQ_CST);
  return n;
}

static void train(const char *addr, tu_train t[NW]) {
  static char hosts[1][64];
  static const char *hp[1];
  snprintf(hosts[0], sizeof hosts[0], "%s", addr);
  hp[0] = hosts[0];
  pthread_t th[NW];
  memset(t, 0, sizeof(tu_train) * NW);
  for (int i = 0; i < NW; i++) {
    t[i].hosts = hp;
    t[i].num_ps = 1;
    t[i].num_workers = NW;
    t[i].worker = i;
    t[i].steps = STEPS;
    t[i].batch = BATCH;
    pthread_create(&th[i], NULL, tu_train_worker, &t[i]);
  }
  for (int i = 0; i < NW; i++) pthread_join(th[i], NULL);
}

static void expect_trained(tu_train t[NW], tu_psd *p, const char *run) {
  for (int i = 0; i < NW; i++) {
    ck_assert_msg(t[i].rc == 0, "%s: worker %d failed: %s (%s)", run, i, ps_strerror(t[i].rc),
                  t[i].err);
    ck_assert_msg(t[i].final_step == STEPS, "%s: worker %d ended at step %llu", run, i,
                  (unsigned long long)t[i].final_step);
  }
  ck_assert_msg(tu_psd_wait(p, 10) == 0, "%s: psd did not exit after training", run);
  ck_assert_msg(WIFEXITED(p->status) && WEXITSTATUS(p->status) == 0,
                "%s: psd exit status %d (signal %d) (log %s)", run,
                WIFEXITED(p->status) ? WEXITSTATUS(p->status) : -1,
                WIFSIGNALED(p->status) ? WTERMSIG(p->status) : 0, p->log_path);
}

START_TEST(test_training_under_barrage) {
  /* Clean run. */
  tu_psd clean;
  start_psd(&clean, "2");
  tu_train ct[NW];
  train(clean.addr, ct);
  expect_trained(ct, &clean, "clean run");
  ck_assert_msg(memcmp(ct[0].W, ct[1].W, sizeof ct[0].W) == 0 &&
                    memcmp(ct[0].b, ct[1].b, sizeof ct[0].b) == 0,
                "clean run: the two workers ended with different parameters");

  /* Same run on a fresh psd, with hostile connections before, during and
   * after the real workers' handshakes. */
  tu_psd p;
  start_psd(&p, "2");
  int stop = 0, training = 0;
  barrage b[NBARRAGE];
  pthread_t bt[NBARRAGE];
  memset(b, 0, sizeof b);
  for (int i = 0; i < NBARRAGE; i++) {
    b[i].psd = &p;
    b[i].id = i;
    b[i].stop = &stop;
    b[i].training = &training;
    pthread_create(&bt[i], NULL, barrage_main, &b[i]);
  }
  /* Plenty of hostile traffic (HELLOs included) reaches psd before any real
   * worker has pinned the job; more comes during the run. */
  for (int k = 0; k < 2500 && answered(b) < PRE_ANSWERED; k++) usleep(2000);
  __atomic_store_n(&training, 1, __ATOMIC_SEQ_CST);
  tu_train ht[NW];
  train(p.addr, ht);
  __atomic_store_n(&training, 0, __ATOMIC_SEQ_CST);
  __atomic_store_n(&stop, 1, __ATOMIC_SEQ_CST);
  for (int i = 0; i < NBARRAGE; i++) pthread_join(bt[i], NULL);

  int conns = 0, errors = 0, silent = 0, during = 0, already = 0, tolerated = 0;
  for (int i = 0; i < NBARRAGE; i++) {
    ck_assert_msg(b[i].failures == 0, "barrage: %d failures; first: %s (log %s)",
                  b[i].failures, b[i].first_failure, p.log_path);
    conns += b[i].conns;
    errors += b[i].errors;
    silent += b[i].silent;
    during += b[i].during;
    already += b[i].already;
    tolerated += b[i].tolerated;
  }
  expect_trained(ht, &p, "run under the barrage");
  ck_assert_msg(memcmp(ht[0].W, ct[0].W, sizeof ct[0].W) == 0 &&
                    memcmp(ht[0].b, ct[0].b, sizeof ct[0].b) == 0 &&
                    memcmp(ht[1].W, ct[0].W, sizeof ct[0].W) == 0 &&
                    memcmp(ht[1].b, ct[0].b, sizeof ct[0].b) == 0,
                "final parameters differ from the clean run's (W[0] %.9g vs %.9g)", ht[0].W[0],
                ct[0].W[0]);
  ck_assert_msg(conns >= 200 && errors + silent >= 200 && during >= 10 && already >= 1,
                "too little hostile traffic: %d connections, %d fatal errors (%d as a "
                "connected or finished worker), %d silent closes, %d during the run, %d cut "
                "by psd's exit",
                conns, errors, already, silent, during, tolerated);
  ck_assert_msg(tu_log_contains(&p, "closing the connection"),
                "psd did not log the rejected connections (log %s)", p.log_path);
  ck_assert_msg(tu_log_contains(&p, "in the middle of a frame"),
                "psd did not log the truncated frames (log %s)", p.log_path);
}
END_TEST

/* ---- 3: the pre-handshake limit bounds memory ------------------------------ */

START_TEST(test_preauth_limit_bounds_memory) {
  tu_psd p;
  start_psd(&p, "1");
  long peak0 = tu_vm_kib(p.pid, "VmPeak:");
  int fd = tu_connect(p.addr);
  ck_assert(fd >= 0);
  hbuf h = {{0}, 0};
  put_raw_header(&h, PS__MAGIC, PS__PROTOCOL_VERSION, PS__MSG_HELLO, 0xFFFFFFFFu, 0, (uint64_t)1 << 60);
  double t0 = ps__now();
  ck_assert_int_eq(tu_send_all(fd, h.b, h.n), 0);
  uint8_t rb[4096];
  size_t n;
  int eof = tu_read_until_eof(fd, rb, sizeof rb, 3.0, &n);
  double dt = ps__now() - t0;
  close(fd);
  ck_assert_msg(eof && dt < tu_time_limit(1.0), "psd did not close at once (%.2f s, eof %d)", dt, eof);
  herr e;
  parse_reply(rb, n, &e);
  ck_assert_msg(e.found && e.fatal && e.code == PS_ETOOBIG && strstr(e.msg, "too large"),
                "expected a fatal 'too large' error, got '%s'", e.msg);
  expect_serving(&p, "a 4 GiB + 2^60-byte HELLO header");
  long peak1 = tu_vm_kib(p.pid, "VmPeak:");
  ck_assert_msg(peak0 > 0 && peak1 > 0 && peak1 - peak0 < 64 * 1024,
                "psd's peak virtual memory grew from %ld to %ld KiB", peak0, peak1);

  /* A real client is served normally afterwards. */
  char hosts[1][64];
  const char *hp[1];
  tu_hosts(&p, 1, hosts, hp);
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.worker_index = 0;
  cfg.num_workers = 1;
  cfg.connect_timeout_ms = 5000;
  cfg.request_timeout_ms = 5000;
  ps_client *c = NULL;
  char err[512];
  int rc = ps_client_create(&cfg, &c, err, sizeof err);
  ck_assert_msg(rc == 0, "client after the hostile header: %s", err);
  int64_t shape[1] = {16};
  ps_init zero = PS_SIZED(ps_init, PS_INIT_ZEROS, 0, 0, 0);
  ps_var *v = NULL;
  rc = ps_client_var_create(c, "v", shape, 1, &zero, NULL, &v);
  ck_assert_msg(rc == 0, "var create: %s", ps_client_errmsg(c));
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  ck_assert_msg(tu_psd_wait(&p, 10) == 0 && WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0,
                "psd did not exit 0 after its one worker finished (log %s)", p.log_path);
}
END_TEST

/* ---- 4: valid frames in hostile orders ------------------------------------ */

/* A PULL naming the same slice twice, parked until a step that is not yet
 * reached, then a PUSH that advances the slice: psd must either refuse the
 * PULL or answer it, and go on serving. */
START_TEST(test_pull_duplicate_slice_ids) {
  tu_psd p;
  start_psd(&p, "1");
  int fd = tu_connect(p.addr);
  ck_assert(fd >= 0);
  hbuf h = {{0}, 0};
  put_hello(&h, hello_default(0, 1));
  tu_send_all(fd, h.b, h.n);
  static rframe f;
  ck_assert(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_HELLO_REPLY);
  static const uint64_t s4[1] = {4};
  h.n = 0;
  put_register(&h, 2, "x", s4, 1, 1, 4, 0);
  tu_send_all(fd, h.b, h.n);
  ck_assert(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_REGISTER_REPLY);
  float v[4] = {1, 2, 3, 4};
  h.n = 0;
  put_push(&h, PS__MSG_INIT, 3, 0, 0, 4, 0, v, sizeof v);
  tu_send_all(fd, h.b, h.n);
  ck_assert(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_ACK);

  uint32_t ids[2] = {0, 0};
  h.n = 0;
  put_pull(&h, 10, 2, ids, 2);         /* parked: the slice is at step 0 */
  put_push(&h, PS__MSG_PUSH, 11, 0, 0, 4, 0, v, sizeof v); /* -> step 1 */
  tu_send_all(fd, h.b, h.n);
  /* Refused (a fatal error naming the duplicate) or taken (the PUSH is
   * answered); either way psd goes on serving. */
  int got = read_frame(fd, &f, 2.0);
  herr e;
  memset(&e, 0, sizeof e);
  if (got == 0 && f.h.type == PS__MSG_ERROR) copy_error(f.meta, f.h.meta_len, &e);
  close(fd);
  expect_serving(&p, "a PULL naming slice 0 twice, then a PUSH");
  tu_psd_kill(&p);
  ck_assert_msg(got == 0, "no reply to a PULL naming slice 0 twice and a PUSH");
  ck_assert_msg(f.h.type == PS__MSG_PUSH_REPLY || (e.found && e.fatal && strstr(e.msg, "twice")),
                "expected a PUSH_REPLY or a fatal error naming the duplicate, got type %u (%s)",
                f.h.type, e.msg);
}
END_TEST

/* A worker with an answerable PULL whose next bytes are garbage, all in
 * one segment: the fatal error and the pull reply are queued in the same
 * read callback. psd must close that connection and stay up. */
START_TEST(test_pull_then_garbage_same_segment) {
  tu_psd p;
  start_psd(&p, "1");
  int fd = tu_connect(p.addr);
  ck_assert(fd >= 0);
  hbuf h = {{0}, 0};
  put_hello(&h, hello_default(0, 1));
  tu_send_all(fd, h.b, h.n);
  static rframe f;
  ck_assert(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_HELLO_REPLY);
  static const uint64_t s4[1] = {4};
  h.n = 0;
  put_register(&h, 2, "x", s4, 1, 1, 4, 0);
  tu_send_all(fd, h.b, h.n);
  ck_assert(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_REGISTER_REPLY);
  float v[4] = {1, 2, 3, 4};
  h.n = 0;
  put_push(&h, PS__MSG_INIT, 3, 0, 0, 4, 0, v, sizeof v);
  tu_send_all(fd, h.b, h.n);
  ck_assert(read_frame(fd, &f, 3.0) == 0 && f.h.type == PS__MSG_ACK);

  uint32_t ids[1] = {0};
  h.n = 0;
  put_pull(&h, 10, 0, ids, 1); /* answerable at once */
  put_raw_header(&h, 0xDEADBEEFu, 1, PS__MSG_PULL, 0, 0, 0);
  tu_send_all(fd, h.b, h.n);
  uint8_t rb[8192];
  size_t n;
  int eof = tu_read_until_eof(fd, rb, sizeof rb, 3.0, &n);
  close(fd);
  herr e;
  parse_reply(rb, n, &e);
  expect_serving(&p, "an answerable PULL followed by a bad header in one segment");
  ck_assert_msg(eof, "psd did not close the connection");
  ck_assert_msg(e.found && e.fatal && strstr(e.msg, "magic"), "expected a fatal error, got '%s'",
                e.msg);
  tu_psd_kill(&p);
}
END_TEST

/* In auto mode (no --workers) the first HELLO sets the number of workers.
 * A 30-byte HELLO claiming 50 million (--workers itself stops at 1000000)
 * must not make psd reserve gigabytes. */
START_TEST(test_hello_num_workers_bounded) {
  tu_psd p;
  start_psd(&p, NULL);
  long peak0 = tu_vm_kib(p.pid, "VmPeak:");
  int fd = tu_connect(p.addr);
  ck_assert(fd >= 0);
  hbuf h = {{0}, 0};
  put_hello(&h, hello_default(0, 50000000));
  tu_send_all(fd, h.b, h.n);
  static rframe f;
  int got = read_frame(fd, &f, 3.0);
  long peak1 = tu_vm_kib(p.pid, "VmPeak:");
  close(fd);
  expect_serving(&p, "a HELLO claiming 50000000 workers");
  tu_psd_kill(&p);
  ck_assert_msg(got == 0, "no reply to a HELLO claiming 50000000 workers");
  ck_assert_msg(peak0 > 0 && peak1 > 0 && peak1 - peak0 < 256 * 1024,
                "a 30-byte HELLO claiming 50000000 workers grew psd's virtual memory from "
                "%ld to %ld KiB (reply: %s)",
                peak0, peak1, f.h.type == PS__MSG_ERROR ? "ERROR" : "accepted");
}
END_TEST

static double cpu_s(pid_t pid) {
  long long ut = tu_proc_stat(pid, 14), st = tu_proc_stat(pid, 15);
  return ut < 0 || st < 0 ? -1 : (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* Connections that never say HELLO, more than psd has descriptors for: psd
 * must neither spin nor flood its log while it cannot accept, and must
 * serve again once they are gone. */
START_TEST(test_descriptor_exhaustion) {
  enum { LIMIT = 40, IDLE = 60 };
  struct rlimit old, low;
  ck_assert(getrlimit(RLIMIT_NOFILE, &old) == 0);
  ck_assert(old.rlim_cur > IDLE + 64);
  low = old;
  low.rlim_cur = LIMIT;
  ck_assert(setrlimit(RLIMIT_NOFILE, &low) == 0); /* psd inherits it */
  tu_psd p;
  int started = tu_psd_start(&p, (const char *const[]){"--workers", "1", "--startup-timeout",
                                                        "30", NULL});
  setrlimit(RLIMIT_NOFILE, &old);
  ck_assert_msg(started == 0, "psd did not start");
  int fds[IDLE];
  for (int i = 0; i < IDLE; i++) fds[i] = tu_connect(p.addr);
  usleep(200000);
  double c0 = cpu_s(p.pid);
  usleep(1000000);
  double c1 = cpu_s(p.pid);
  int warnings = tu_log_count(&p, "accept failed");
  for (int i = 0; i < IDLE; i++)
    if (fds[i] >= 0) close(fds[i]);
  if (c1 - c0 > 0.5 || warnings > 100) tu_psd_kill(&p);
  ck_assert_msg(c0 >= 0 && c1 - c0 <= 0.5,
                "psd used %.2f s of CPU in 1 s while out of descriptors (busy accept loop); "
                "%d 'accept failed' log lines",
                c1 - c0, warnings);
  ck_assert_msg(warnings <= 100, "%d 'accept failed' log lines in about 1 s", warnings);
  usleep(200000);
  expect_serving(&p, "running out of descriptors");
  tu_psd_kill(&p);
}
END_TEST

/* ---- 5: TABLE_* frames from an authenticated worker ------------------------ */

/* A TableSpec for the tests: SGD, zeros, the rest at 0 unless set after. */
static Ps__TableSpec tspec(const char *name, uint32_t dim, uint64_t capacity) {
  Ps__TableSpec s = PS__TABLE_SPEC__INIT;
  s.name = (char *)name;
  s.dim = dim;
  s.capacity = capacity;
  s.opt = PS__TABLE_OPT_KIND__TOPT_SGD;
  s.lr = 0.5;
  return s;
}

/* TABLE_REGISTER of spec; its reply: the table id, or -(error code). */
static long table_register(int fd, Ps__TableSpec *spec, herr *e) {
  static rframe f;
  hbuf h = {{0}, 0};
  Ps__TableRegister m = PS__TABLE_REGISTER__INIT;
  m.request_id = 77;
  m.spec = spec;
  put_msg(&h, PS__MSG_TABLE_REGISTER, &m.base, NULL, 0);
  ck_assert_int_eq(tu_send_all(fd, h.b, h.n), 0);
  memset(e, 0, sizeof *e);
  ck_assert_msg(read_frame(fd, &f, 5.0) == 0, "no reply to TABLE_REGISTER");
  if (f.h.type == PS__MSG_ERROR) {
    copy_error(f.meta, f.h.meta_len, e);
    return e->code < 0 ? e->code : -1;
  }
  ck_assert_int_eq(f.h.type, PS__MSG_TABLE_REGISTER_REPLY);
  Ps__TableRegisterReply *r = ps__table_register_reply__unpack(NULL, f.h.meta_len, f.meta);
  ck_assert(r);
  long id = r->table_id;
  ps__table_register_reply__free_unpacked(r, NULL);
  return id;
}

/* Header and protobuf of a TABLE_PUSH whose data (data_len bytes) the
 * caller sends itself; pull_id not 0: it names that pull for its keys
 * (2.10). */
static void send_table_push_named(int fd, uint64_t req, uint32_t table, uint64_t step,
                                  uint64_t count, uint64_t data_len, uint64_t pull_id) {
  Ps__TablePush m = PS__TABLE_PUSH__INIT;
  m.request_id = req;
  m.table_id = table;
  m.step = step;
  m.count = count;
  m.pull_id = pull_id;
  uint8_t b[256];
  size_t ml = protobuf_c_message_get_packed_size(&m.base);
  ps__header_encode(b, PS__MSG_TABLE_PUSH, (uint32_t)ml, data_len);
  protobuf_c_message_pack(&m.base, b + PS__HEADER_SIZE);
  ck_assert_int_eq(tu_send_all(fd, b, PS__HEADER_SIZE + ml), 0);
}

static void send_table_push_head(int fd, uint64_t req, uint32_t table, uint64_t step,
                                 uint64_t count, uint64_t data_len) {
  send_table_push_named(fd, req, table, step, count, data_len, 0);
}

static void send_table_pull_head(int fd, uint64_t req, uint32_t table, uint64_t min_step,
                                 uint64_t count, uint64_t data_len, int read_only) {
  Ps__TablePull m = PS__TABLE_PULL__INIT;
  m.request_id = req;
  m.table_id = table;
  m.min_step = min_step;
  m.count = count;
  m.read_only = read_only;
  uint8_t b[256];
  size_t ml = protobuf_c_message_get_packed_size(&m.base);
  ps__header_encode(b, PS__MSG_TABLE_PULL, (uint32_t)ml, data_len);
  protobuf_c_message_pack(&m.base, b + PS__HEADER_SIZE);
  ck_assert_int_eq(tu_send_all(fd, b, PS__HEADER_SIZE + ml), 0);
}

/* The next frame's type (its data dropped; an ERROR is copied into e), or
 * -1 on timeout or close. */
static int table_reply(int fd, rframe *f, herr *e, double timeout_s) {
  memset(e, 0, sizeof *e);
  if (read_frame(fd, f, timeout_s) != 0) return -1;
  if (f->h.type == PS__MSG_ERROR) copy_error(f->meta, f->h.meta_len, e);
  return f->h.type;
}

/* A TABLE_PUSH naming a table id no table had when its frame began, with
 * data_len sized for that (no table to size it by): the table is
 * registered (by another worker) while psd still reads the data. psd must
 * size the push by the data it read, not by the table that now exists:
 * it used to read count * dim gradients from a keys-only buffer. */
START_TEST(test_table_push_table_registered_midframe) {
  tu_psd p;
  start_psd(&p, "2");
  int a = tu_connect(p.addr), b = tu_connect(p.addr);
  ck_assert(a >= 0 && b >= 0);
  do_setup(a, SETUP_HELLO, 0, "midframe");
  do_setup(b, SETUP_HELLO, 1, "midframe");
  herr e;
  Ps__TableSpec s0 = tspec("t0", 4, 16);
  ck_assert_int_eq(table_register(a, &s0, &e), 0);
  /* Table 1 does not exist yet: keys only, 2^20 of them (8 MiB). */
  const uint64_t n = 1u << 20;
  uint64_t *keys = malloc(n * sizeof *keys);
  ck_assert(keys);
  for (uint64_t i = 0; i < n; i++) keys[i] = i + 1;
  send_table_push_head(a, 50, 1, 0, n, n * sizeof *keys);
  ck_assert_int_eq(tu_send_all(a, keys, n * sizeof *keys / 2), 0);
  usleep(200000);
  /* Worker 1 creates table 1 (dim 64) and a row for the last key. */
  Ps__TableSpec s1 = tspec("t1", 64, 16);
  ck_assert_int_eq(table_register(b, &s1, &e), 1);
  send_table_pull_head(b, 51, 1, 0, 1, sizeof(uint64_t), 0);
  ck_assert_int_eq(tu_send_all(b, &keys[n - 1], sizeof(uint64_t)), 0);
  static rframe f;
  ck_assert_int_eq(table_reply(b, &f, &e, 5.0), PS__MSG_TABLE_PULL_REPLY);
  /* The rest of the keys: psd now sees table 1 (dim 64). */
  ck_assert_int_eq(tu_send_all(a, (uint8_t *)keys + n * sizeof *keys / 2,
                               n * sizeof *keys / 2), 0);
  free(keys);
  int t = table_reply(a, &f, &e, 10.0);
  Ps__TablePushReply *r = t == PS__MSG_TABLE_PUSH_REPLY
                              ? ps__table_push_reply__unpack(NULL, f.h.meta_len, f.meta)
                              : NULL;
  int status = r ? r->status : 0;
  char msg[1100];
  snprintf(msg, sizeof msg, "%s", r && r->message ? r->message : e.msg);
  if (r) ps__table_push_reply__free_unpacked(r, NULL);
  close(a);
  close(b);
  expect_serving(&p, "a TABLE_PUSH whose table was registered while its data arrived");
  tu_psd_kill(&p);
  ck_assert_msg(t == PS__MSG_TABLE_PUSH_REPLY && status == PS_ENOTFOUND &&
                    strstr(msg, "table id 1"),
                "expected a TablePushReply PS_ENOTFOUND naming table id 1, got frame %d "
                "status %d: %s", t, status, msg);
}
END_TEST

/* The status and message of the next frame, a TablePushReply (-1000:
 * another frame; msg then says which). */
static int push_status(int fd, char *msg, size_t len) {
  static rframe f;
  herr e;
  int t = table_reply(fd, &f, &e, 5.0);
  Ps__TablePushReply *r = t == PS__MSG_TABLE_PUSH_REPLY
                              ? ps__table_push_reply__unpack(NULL, f.h.meta_len, f.meta)
                              : NULL;
  if (!r) {
    snprintf(msg, len, "frame %d: %s", t, e.msg);
    return -1000;
  }
  int st = r->status;
  snprintf(msg, len, "%s", r->message ? r->message : "");
  ps__table_push_reply__free_unpacked(r, NULL);
  return st;
}

/* 2.10: a TablePush that names a pull for its keys (gradients alone) gets
 * that connection's pull's keys, only while psd holds them: a pull never
 * made, another connection's, or one its push used already is refused
 * (non-fatal PS_ENOTFOUND, "send the keys"); the pull's replies say
 * remembered; data sized as if it carried its keys is a framing error. */
START_TEST(test_table_push_naming_its_pull) {
  tu_psd p;
  start_psd(&p, "2");
  int a = tu_connect(p.addr), b = tu_connect(p.addr);
  ck_assert(a >= 0 && b >= 0);
  do_setup(a, SETUP_HELLO, 0, "named");
  do_setup(b, SETUP_HELLO, 1, "named");
  herr e;
  Ps__TableSpec s0 = tspec("t0", 4, 16);
  ck_assert_int_eq(table_register(a, &s0, &e), 0);
  const uint64_t keys[2] = {3, 9};
  const float g[8] = {1, 1, 1, 1, 2, 2, 2, 2};
  char msg[1100];
  send_table_push_named(a, 60, 0, 0, 2, sizeof g, 99); /* no pull 99 */
  ck_assert_int_eq(tu_send_all(a, g, sizeof g), 0);
  int st = push_status(a, msg, sizeof msg);
  ck_assert_msg(st == PS_ENOTFOUND && strstr(msg, "send the keys"), "%d: %s", st, msg);
  send_table_pull_head(a, 61, 0, 0, 2, sizeof keys, 0);
  ck_assert_int_eq(tu_send_all(a, keys, sizeof keys), 0);
  static rframe f;
  ck_assert_int_eq(table_reply(a, &f, &e, 5.0), PS__MSG_TABLE_PULL_REPLY);
  Ps__TablePullReply *pr = ps__table_pull_reply__unpack(NULL, f.h.meta_len, f.meta);
  ck_assert(pr && pr->remembered);
  ps__table_pull_reply__free_unpacked(pr, NULL);
  send_table_push_named(b, 62, 0, 0, 2, sizeof g, 61); /* b never pulled */
  ck_assert_int_eq(tu_send_all(b, g, sizeof g), 0);
  st = push_status(b, msg, sizeof msg);
  ck_assert_msg(st == PS_ENOTFOUND, "another connection's pull: %d: %s", st, msg);
  send_table_push_named(a, 63, 0, 0, 2, sizeof g, 61);
  ck_assert_int_eq(tu_send_all(a, g, sizeof g), 0);
  st = push_status(a, msg, sizeof msg);
  ck_assert_msg(st == 0, "the push of the keys it pulled: %d: %s", st, msg);
  send_table_push_named(a, 64, 0, 0, 2, sizeof g, 61); /* used by 63 */
  ck_assert_int_eq(tu_send_all(a, g, sizeof g), 0);
  st = push_status(a, msg, sizeof msg);
  ck_assert_msg(st == PS_ENOTFOUND, "a pull its push used: %d: %s", st, msg);
  /* Keys and gradients, as before 2.10, while naming a pull: fatal. */
  send_table_push_named(b, 65, 0, 0, 2, sizeof keys + sizeof g, 61);
  ck_assert_int_eq(table_reply(b, &f, &e, 5.0), PS__MSG_ERROR); /* at its header */
  ck_assert_int_eq(e.code, PS_EPROTO);
  close(a);
  close(b);
  expect_serving(&p, "TABLE_PUSHes naming pulls psd does not hold");
  tu_psd_kill(&p);
}
END_TEST

/* A push of BIG_PUSH_KEYS keys (ascending from 1) whose only non-finite
 * gradient is the last element: psd's scan runs in chunks on its helper
 * threads (--table-threads 2), and the last chunk's find must name it. */
#define BIG_PUSH_KEYS 40000u
static void big_push_last_inf(int fd, uint64_t req) {
  const size_t dim = 4, bytes = BIG_PUSH_KEYS * (8 + dim * 4);
  uint8_t *d = malloc(bytes);
  ck_assert_ptr_nonnull(d);
  for (uint64_t i = 0; i < BIG_PUSH_KEYS; i++) {
    uint64_t k = i + 1;
    memcpy(d + i * 8, &k, 8);
  }
  float *g = (float *)(void *)(d + BIG_PUSH_KEYS * 8);
  for (size_t i = 0; i < BIG_PUSH_KEYS * dim; i++) g[i] = 0.5f;
  g[BIG_PUSH_KEYS * dim - 1] = INFINITY;
  send_table_push_head(fd, req, 0, 0, BIG_PUSH_KEYS, bytes);
  ck_assert_int_eq(tu_send_all(fd, d, bytes), 0);
  free(d);
}

/* A TABLE_PUSH whose gradients hold NaN and Inf: refused whole, naming the
 * key, and the row keeps its values (a NaN summed into a sync step's
 * accumulator would make the row NaN for every worker, for good). So is a
 * big push whose one infinity is its last element. */
START_TEST(test_table_push_nonfinite_refused) {
  tu_psd p;
  const char *args[] = {"--num-ps", "1", "--ps-index", "0", "--startup-timeout", "30",
                        "--grace-period", "5", "--workers", "2", "--table-threads", "2",
                        NULL};
  ck_assert_msg(tu_psd_start(&p, args) == 0, "psd did not start (log %s)", p.log_path);
  int a = tu_connect(p.addr);
  ck_assert(a >= 0);
  do_setup(a, SETUP_HELLO, 0, "nonfinite");
  herr e;
  Ps__TableSpec s0 = tspec("t0", 4, 16);
  long id = table_register(a, &s0, &e);
  ck_assert_msg(id == 0, "register: %ld %s", id, e.msg);
  static rframe f;
  uint64_t key = 12345;
  send_table_pull_head(a, 60, 0, 0, 1, sizeof key, 0); /* creates the row (zeros) */
  ck_assert_int_eq(tu_send_all(a, &key, sizeof key), 0);
  ck_assert_int_eq(table_reply(a, &f, &e, 5.0), PS__MSG_TABLE_PULL_REPLY);
  uint8_t d[8 + 16];
  float g[4] = {NAN, 1.0f, INFINITY, 0.0f};
  memcpy(d, &key, 8);
  memcpy(d + 8, g, sizeof g);
  send_table_push_head(a, 61, 0, 0, 1, sizeof d);
  ck_assert_int_eq(tu_send_all(a, d, sizeof d), 0);
  int t = table_reply(a, &f, &e, 5.0);
  ck_assert_int_eq(t, PS__MSG_TABLE_PUSH_REPLY);
  Ps__TablePushReply *r = ps__table_push_reply__unpack(NULL, f.h.meta_len, f.meta);
  ck_assert(r);
  int status = r->status;
  uint64_t step = r->step;
  char msg[512];
  snprintf(msg, sizeof msg, "%s", r->message ? r->message : "");
  ps__table_push_reply__free_unpacked(r, NULL);
  big_push_last_inf(a, 63);
  ck_assert_int_eq(table_reply(a, &f, &e, 10.0), PS__MSG_TABLE_PUSH_REPLY);
  r = ps__table_push_reply__unpack(NULL, f.h.meta_len, f.meta);
  ck_assert(r);
  int big_status = r->status;
  char big_msg[512], want[64];
  snprintf(big_msg, sizeof big_msg, "%s", r->message ? r->message : "");
  ps__table_push_reply__free_unpacked(r, NULL);
  snprintf(want, sizeof want, "key %u (position %u), element 3, is +Inf", BIG_PUSH_KEYS,
           BIG_PUSH_KEYS - 1);
  /* The row as it is now (read_only, at the current step). */
  send_table_pull_head(a, 62, 0, 0, 1, sizeof key, 1);
  ck_assert_int_eq(tu_send_all(a, &key, sizeof key), 0);
  uint8_t hb[PS__HEADER_SIZE];
  ps__frame_header h;
  char herrs[256];
  float row[4] = {0};
  int got = recv_exact(a, hb, sizeof hb, ps__now() + 5) == 0 &&
            ps__header_decode(hb, 1, &h, herrs, sizeof herrs) == 0 &&
            h.type == PS__MSG_TABLE_PULL_REPLY && h.data_len == sizeof row &&
            recv_exact(a, f.meta, h.meta_len, ps__now() + 5) == 0 &&
            recv_exact(a, row, sizeof row, ps__now() + 5) == 0;
  close(a);
  expect_serving(&p, "a TABLE_PUSH of NaN and Inf gradients");
  tu_psd_kill(&p);
  ck_assert_msg(status == PS_EINVAL && strstr(msg, "12345") && strstr(msg, "NaN"),
                "expected PS_EINVAL naming key 12345 and NaN, got status %d (step %llu): %s",
                status, (unsigned long long)step, msg);
  ck_assert_msg(big_status == PS_EINVAL && strstr(big_msg, want),
                "expected PS_EINVAL with \"%s\", got status %d: %s", want, big_status, big_msg);
  ck_assert_msg(got, "no TablePullReply with the row after the refused push");
  for (int i = 0; i < 4; i++)
    ck_assert_msg(row[i] == 0.0f, "row[%d] is %g after a refused push", i, row[i]);
}
END_TEST

/* Specs whose lr or epsilon is a positive double that is 0 as a float (the
 * kernels compute in float): Adagrad's and Adam's w -= lr g / (sqrt(a) + eps)
 * is then 0/0 = NaN for every zero gradient element, and SGD never moves.
 * Refused with PS_EINVAL naming the field. */
START_TEST(test_table_register_float_zero_refused) {
  tu_psd p;
  start_psd(&p, "2");
  int a = tu_connect(p.addr);
  ck_assert(a >= 0);
  do_setup(a, SETUP_HELLO, 0, "float zero");
  herr e;
  Ps__TableSpec s = tspec("ada", 4, 16);
  s.opt = PS__TABLE_OPT_KIND__TOPT_ADAGRAD;
  s.initial_accumulator = 0;
  s.epsilon = 1e-50;
  long id = table_register(a, &s, &e);
  Ps__TableSpec s2 = tspec("adam", 4, 16);
  s2.opt = PS__TABLE_OPT_KIND__TOPT_ADAM;
  s2.beta1 = 0.9;
  s2.beta2 = 0.999;
  s2.epsilon = 1e-46;
  herr e2;
  long id2 = table_register(a, &s2, &e2);
  Ps__TableSpec s3 = tspec("sgd", 4, 16);
  s3.lr = 1e-300;
  herr e3;
  long id3 = table_register(a, &s3, &e3);
  close(a);
  expect_serving(&p, "TABLE_REGISTERs with float-zero lr and epsilon");
  tu_psd_kill(&p);
  ck_assert_msg(id == PS_EINVAL && strstr(e.msg, "epsilon") && !e.fatal,
                "adagrad epsilon 1e-50: got %ld (%s)", id, e.msg);
  ck_assert_msg(id2 == PS_EINVAL && strstr(e2.msg, "epsilon"), "adam epsilon 1e-46: got %ld (%s)",
                id2, e2.msg);
  ck_assert_msg(id3 == PS_EINVAL && strstr(e3.msg, "lr"), "sgd lr 1e-300: got %ld (%s)", id3,
                e3.msg);
}
END_TEST

/* Reads and drops whole frames from fd until `want` TablePullReplies came
 * (or timeout); returns how many did. */
static int drain_pull_replies(int fd, int want, double timeout_s) {
  static rframe f;
  int got = 0;
  double end = ps__now() + timeout_s;
  while (got < want && ps__now() < end)
    if (read_frame(fd, &f, end - ps__now()) == 0) got += f.h.type == PS__MSG_TABLE_PULL_REPLY;
    else break;
  return got;
}

/* A worker that parks a big pull on each of 8 tables and stops reading:
 * when the other worker's pushes move the tables, psd must not queue all
 * 8 replies (64 MiB each) for it; the reading stops at the 64 MiB mark
 * for its requests, and answers to its parked pulls wait too (and come
 * once it reads again). Used to grow psd by the sum of every reply. */
START_TEST(test_table_parked_pulls_of_slow_reader_bounded) {
  enum { K = 8, DIM = 4096, NK = 4096 }; /* a reply: 4096 x 4096 floats, 64 MiB */
  tu_psd p;
  start_psd(&p, "2");
  int a = tu_connect(p.addr), b = tu_connect(p.addr);
  ck_assert(a >= 0 && b >= 0);
  do_setup(a, SETUP_HELLO, 0, "slow reader");
  do_setup(b, SETUP_HELLO, 1, "slow reader");
  herr e;
  static rframe f;
  char name[K][8];
  for (int i = 0; i < K; i++) {
    snprintf(name[i], sizeof name[i], "t%d", i);
    Ps__TableSpec s = tspec(name[i], DIM, 16);
    ck_assert_int_eq(table_register(a, &s, &e), i);
    send_table_push_head(a, 100 + (uint64_t)i, (uint32_t)i, 0, 0, 0); /* a's step 0 */
    ck_assert_int_eq(table_reply(a, &f, &e, 5.0), PS__MSG_TABLE_PUSH_REPLY);
  }
  uint64_t *keys = malloc(NK * sizeof *keys);
  ck_assert(keys);
  for (int i = 0; i < NK; i++) keys[i] = (uint64_t)i + 1;
  for (int i = 0; i < K; i++) { /* parked until step 1; read_only: no rows */
    send_table_pull_head(a, 200 + (uint64_t)i, (uint32_t)i, 1, NK, NK * sizeof *keys, 1);
    ck_assert_int_eq(tu_send_all(a, keys, NK * sizeof *keys), 0);
  }
  free(keys);
  usleep(300000);
  long before = tu_vm_kib(p.pid, "VmRSS:");
  /* b completes step 0 of every table: a's 8 pulls are due; a reads nothing. */
  for (int i = 0; i < K; i++) {
    send_table_push_head(b, 300 + (uint64_t)i, (uint32_t)i, 0, 0, 0);
    ck_assert_int_eq(table_reply(b, &f, &e, 10.0), PS__MSG_TABLE_PUSH_REPLY);
  }
  usleep(500000);
  long after = tu_vm_kib(p.pid, "VmRSS:");
  /* a reads again: every reply comes, late. */
  int got = drain_pull_replies(a, K, 30.0);
  close(a);
  close(b);
  expect_serving(&p, "parked pulls of a worker that reads nothing");
  tu_psd_kill(&p);
  long grew = (after - before) / 1024;
  ck_assert_msg(grew < 200, "psd grew by %ld MiB queueing due pulls for a connection that "
                "reads nothing (8 x 64 MiB replies; at most the 64 MiB mark and one reply "
                "expected)", grew);
  ck_assert_msg(got == K, "only %d of %d pull replies came once the worker read again", got,
                K);
}
END_TEST

/* ---- 6: what table requests hold counts against --max-memory ------------- */

/* The limit these tests run psd under, as in the review that found the
 * holes: 512 MiB. */
#define TM_LIMIT ((uint64_t)512 << 20)
#define TM_LIMIT_ARG "536870912"
/* psd's own RSS before any table (code, libraries, fixed buffers) is not
 * what --max-memory counts; each test measures it and allows this much
 * on top of the limit for allocator slack and page tables. */
#define TM_SLACK_KIB (48L << 10)

static void start_psd_mem(tu_psd *p, const char *workers) {
  const char *args[] = {"--num-ps", "1", "--ps-index", "0", "--startup-timeout", "30",
                        "--grace-period", "5", "--workers", workers, "--max-memory",
                        TM_LIMIT_ARG, NULL};
  ck_assert_msg(tu_psd_start(p, args) == 0, "psd did not start (log %s)", p->log_path);
}

/* A connection that completed its handshake as worker w of nw. */
static int tm_worker(tu_psd *p, uint32_t w, uint32_t nw) {
  static rframe f;
  int fd = tu_connect(p->addr);
  ck_assert(fd >= 0);
  hbuf h = {{0}, 0};
  put_hello(&h, hello_default(w, nw));
  ck_assert_int_eq(tu_send_all(fd, h.b, h.n), 0);
  ck_assert_msg(read_frame(fd, &f, 5.0) == 0 && f.h.type == PS__MSG_HELLO_REPLY,
                "the handshake as worker %u failed (reply type %u)", w, f.h.type);
  return fd;
}

/* A normal table step from worker fd while the others hold what they can:
 * a pull of 4 keys of table id (dim floats a row) answered with the rows,
 * and the push of their gradients accepted. */
static void tm_legit_step(int fd, uint32_t id, uint32_t dim, const char *during) {
  static rframe f;
  herr e;
  uint64_t keys[4] = {11, 12, 13, 14};
  send_table_pull_head(fd, 900, id, 0, 4, sizeof keys, 0);
  ck_assert_int_eq(tu_send_all(fd, keys, sizeof keys), 0);
  int t = table_reply(fd, &f, &e, 10.0);
  ck_assert_msg(t == PS__MSG_TABLE_PULL_REPLY && f.h.data_len == 4ull * dim * sizeof(float),
                "%s: a legitimate pull of 4 keys got frame %d (%llu data bytes): %s", during,
                t, (unsigned long long)f.h.data_len, e.msg);
  size_t n = sizeof keys + 4ull * dim * sizeof(float);
  uint8_t *d = calloc(1, n);
  ck_assert(d);
  memcpy(d, keys, sizeof keys);
  send_table_push_head(fd, 901, id, 0, 4, n);
  ck_assert_int_eq(tu_send_all(fd, d, n), 0);
  free(d);
  t = table_reply(fd, &f, &e, 10.0);
  Ps__TablePushReply *r = t == PS__MSG_TABLE_PUSH_REPLY
                              ? ps__table_push_reply__unpack(NULL, f.h.meta_len, f.meta)
                              : NULL;
  int status = r ? r->status : -1;
  char msg[1100];
  snprintf(msg, sizeof msg, "%s", r && r->message ? r->message : e.msg);
  if (r) ps__table_push_reply__free_unpacked(r, NULL);
  ck_assert_msg(status == 0, "%s: a legitimate push of 4 keys got frame %d status %d: %s",
                during, t, status, msg);
}

/* The refusal's sentence names the table, the bytes and the limit. */
static void tm_expect_sentence(const char *msg, const char *table, const char *bytes,
                               const char *what) {
  ck_assert_msg(strstr(msg, table) && strstr(msg, bytes) && strstr(msg, "--max-memory") &&
                    strstr(msg, TM_LIMIT_ARG),
                "%s: the refusal should name %s, %s bytes and --max-memory " TM_LIMIT_ARG
                ": %s", what, table, bytes, msg);
}

/* Reads frames of fd until an Error (copied into e) or a TablePushReply
 * (its status and message into e) that is not a success; 1 if one came. */
static int tm_next_refusal(int fd, herr *e, double timeout_s) {
  static rframe f;
  double end = ps__now() + timeout_s;
  while (ps__now() < end) {
    int t = table_reply(fd, &f, e, end - ps__now());
    if (t < 0) return 0;
    if (t == PS__MSG_ERROR) return 1;
    if (t != PS__MSG_TABLE_PUSH_REPLY) continue;
    Ps__TablePushReply *r = ps__table_push_reply__unpack(NULL, f.h.meta_len, f.meta);
    ck_assert(r);
    e->found = 1;
    e->code = r->status;
    snprintf(e->msg, sizeof e->msg, "%s", r->message ? r->message : "");
    ps__table_push_reply__free_unpacked(r, NULL);
    if (e->code) return 1;
  }
  return 0;
}

/* The reviewer's first case: a TABLE_PULL of 32 KiB of keys (4,096 keys of
 * a dim-65536 table) asks for a 1 GiB reply, and two connections that never
 * read took psd to 2,051 MiB under --max-memory 512M. Now a reply is
 * counted while it waits to be read: the 1 GiB ones are refused with
 * PS_ENOMEM and a sentence, a 256 MiB one is built for the first
 * connection and refused to the second (together they would pass the
 * limit), psd's peak RSS stays under the limit, and a third worker's step
 * goes through meanwhile. */
START_TEST(test_table_mem_unread_replies) {
  enum { DIM = 65536 };
  tu_psd p;
  start_psd_mem(&p, "3");
  int a = tm_worker(&p, 0, 3), b = tm_worker(&p, 1, 3), c = tm_worker(&p, 2, 3);
  herr e;
  Ps__TableSpec big = tspec("big", DIM, 64), small = tspec("small", 8, 1024);
  ck_assert_int_eq(table_register(a, &big, &e), 0);
  ck_assert_int_eq(table_register(c, &small, &e), 1);
  usleep(100000);
  long base = tu_vm_kib(p.pid, "VmRSS:");
  uint64_t *keys = malloc(4096 * sizeof *keys);
  ck_assert(keys);
  for (int i = 0; i < 4096; i++) keys[i] = (uint64_t)i + 1;
  int fds[2] = {a, b};
  for (int i = 0; i < 2; i++) { /* 1 GiB each, read_only (no rows needed) */
    send_table_pull_head(fds[i], 10, 0, 0, 4096, 4096 * sizeof *keys, 1);
    ck_assert_int_eq(tu_send_all(fds[i], keys, 4096 * sizeof *keys), 0);
  }
  for (int i = 0; i < 2; i++) { /* 256 MiB each: the first fits, not both */
    send_table_pull_head(fds[i], 11, 0, 0, 1024, 1024 * sizeof *keys, 1);
    ck_assert_int_eq(tu_send_all(fds[i], keys, 1024 * sizeof *keys), 0);
    usleep(300000);
  }
  free(keys);
  tm_legit_step(c, 1, 8, "two connections holding unread pulls of 'big'");
  long hwm = tu_vm_kib(p.pid, "VmHWM:");
  fprintf(stderr, "table memory: unread replies: psd VmRSS %ld KiB before, peak %ld KiB "
          "(limit %llu KiB)\n", base, hwm, (unsigned long long)(TM_LIMIT >> 10));
  /* Now read: the refusals, then a's reply. */
  herr ea1, eb1, eb2;
  int ra1 = tm_next_refusal(a, &ea1, 10.0);
  int got_a = drain_pull_replies(a, 1, 30.0);
  int rb1 = tm_next_refusal(b, &eb1, 10.0), rb2 = tm_next_refusal(b, &eb2, 10.0);
  close(a);
  close(b);
  close(c);
  expect_serving(&p, "huge pulls from connections that never read");
  tu_psd_kill(&p);
  ck_assert_msg(hwm - base < (long)(TM_LIMIT >> 10) + TM_SLACK_KIB,
                "psd peaked at %ld KiB (%ld at start) under --max-memory 512M", hwm, base);
  ck_assert_msg(ra1 && ea1.code == PS_ENOMEM && rb1 && eb1.code == PS_ENOMEM,
                "the 1 GiB pulls should be refused with PS_ENOMEM: %d %d (%s | %s)",
                ea1.code, eb1.code, ea1.msg, eb1.msg);
  tm_expect_sentence(ea1.msg, "table 'big'", "1073741824", "1 GiB pull");
  ck_assert_msg(got_a == 1, "the first connection's 256 MiB reply did not come");
  ck_assert_msg(rb2 && eb2.code == PS_ENOMEM, "the second 256 MiB reply should be refused: "
                "%d (%s)", eb2.code, eb2.msg);
  tm_expect_sentence(eb2.msg, "table 'big'", "268435456", "second 256 MiB pull");
}
END_TEST

/* The second case: TABLE_PUSH staging, 3 connections each sending a push
 * of 256 MiB and holding back its last byte (771 MiB before). The first
 * is staged (counted); the others are refused at their header with a
 * TablePushReply PS_ENOMEM and a sentence, their bytes read and dropped
 * on a connection that stays usable. */
START_TEST(test_table_mem_staged_pushes) {
  enum { DIM = 65536, NK = 1023 };
  const uint64_t len = (uint64_t)NK * (sizeof(uint64_t) + DIM * sizeof(float));
  tu_psd p;
  start_psd_mem(&p, "4");
  int w[3], c = tm_worker(&p, 3, 4);
  for (int i = 0; i < 3; i++) w[i] = tm_worker(&p, (uint32_t)i, 4);
  herr e;
  Ps__TableSpec big = tspec("big", DIM, 64), small = tspec("small", 8, 1024);
  ck_assert_int_eq(table_register(w[0], &big, &e), 0);
  ck_assert_int_eq(table_register(c, &small, &e), 1);
  usleep(100000);
  long base = tu_vm_kib(p.pid, "VmRSS:");
  uint8_t *d = calloc(1, len);
  ck_assert(d);
  for (uint64_t i = 0; i < NK; i++) { /* ascending keys; zero gradients */
    uint64_t k = i + 1;
    memcpy(d + i * sizeof k, &k, sizeof k);
  }
  for (int i = 0; i < 3; i++) {
    send_table_push_head(w[i], 20, 0, 0, NK, len);
    ck_assert_int_eq(tu_send_all(w[i], d, len - 1), 0);
    usleep(200000);
  }
  tm_legit_step(c, 1, 8, "three connections staging 256 MiB pushes");
  long hwm = tu_vm_kib(p.pid, "VmHWM:");
  fprintf(stderr, "table memory: staged pushes: psd VmRSS %ld KiB before, peak %ld KiB "
          "(limit %llu KiB)\n", base, hwm, (unsigned long long)(TM_LIMIT >> 10));
  herr e1, e2;
  int r1 = tm_next_refusal(w[1], &e1, 10.0), r2 = tm_next_refusal(w[2], &e2, 10.0);
  /* The first push completes: staged and applied (its keys have no rows). */
  ck_assert_int_eq(tu_send_all(w[0], d + len - 1, 1), 0);
  static rframe f;
  herr e0;
  int t0 = table_reply(w[0], &f, &e0, 10.0);
  /* A refused connection is still in step: the rest of its push is
   * dropped, its next frame is read. */
  ck_assert_int_eq(tu_send_all(w[1], d + len - 1, 1), 0);
  send_table_push_head(w[1], 21, 1, 0, 0, 0);
  int t1 = table_reply(w[1], &f, &e, 10.0);
  free(d);
  for (int i = 0; i < 3; i++) close(w[i]);
  close(c);
  expect_serving(&p, "staged pushes of several connections");
  tu_psd_kill(&p);
  ck_assert_msg(hwm - base < (long)(TM_LIMIT >> 10) + TM_SLACK_KIB,
                "psd peaked at %ld KiB (%ld at start) under --max-memory 512M", hwm, base);
  ck_assert_msg(r1 && e1.code == PS_ENOMEM && r2 && e2.code == PS_ENOMEM,
                "the second and third staged pushes should be refused with PS_ENOMEM: %d %d "
                "(%s | %s)", e1.code, e2.code, e1.msg, e2.msg);
  char bytes[32];
  snprintf(bytes, sizeof bytes, "%llu", (unsigned long long)len);
  tm_expect_sentence(e1.msg, "table 'big'", bytes, "staged push");
  ck_assert_msg(t0 == PS__MSG_TABLE_PUSH_REPLY, "the staged push got no reply (%d)", t0);
  ck_assert_msg(t1 == PS__MSG_TABLE_PUSH_REPLY, "a refused push's connection no longer "
                "answers (%d: %s)", t1, e.msg);
}
END_TEST

/* The third case: parked pulls. Four connections park a pull of 2^22 keys
 * (32 MiB) on each of 8 tables for a step that never comes (1 GiB of keys;
 * 1,027 MiB before, capped only by a fixed 1 GiB). Now parked keys count:
 * the pulls that would pass the limit are refused with PS_ENOMEM, and
 * psd's peak stays under it. */
START_TEST(test_table_mem_parked_pulls) {
  enum { K = 8, NA = 4 };
  const uint64_t nk = PS__MAX_TABLE_KEYS;
  tu_psd p;
  start_psd_mem(&p, "5");
  int w[NA], c = tm_worker(&p, NA, NA + 1);
  for (int i = 0; i < NA; i++) w[i] = tm_worker(&p, (uint32_t)i, NA + 1);
  herr e;
  char name[K][8];
  for (int i = 0; i < K; i++) {
    snprintf(name[i], sizeof name[i], "p%d", i);
    Ps__TableSpec s = tspec(name[i], 1, 1024);
    ck_assert_int_eq(table_register(w[0], &s, &e), i);
  }
  Ps__TableSpec small = tspec("small", 8, 1024);
  ck_assert_int_eq(table_register(c, &small, &e), K);
  usleep(100000);
  long base = tu_vm_kib(p.pid, "VmRSS:");
  uint64_t *keys = malloc(nk * sizeof *keys);
  ck_assert(keys);
  for (uint64_t i = 0; i < nk; i++) keys[i] = i + 1;
  for (int i = 0; i < NA; i++)
    for (int t = 0; t < K; t++) { /* for step 1: parked (nobody pushes) */
      send_table_pull_head(w[i], 30 + (uint64_t)t, (uint32_t)t, 1, nk, nk * sizeof *keys, 1);
      ck_assert_int_eq(tu_send_all(w[i], keys, nk * sizeof *keys), 0);
    }
  free(keys);
  usleep(200000);
  tm_legit_step(c, K, 8, "32 parked pulls of 32 MiB of keys");
  long hwm = tu_vm_kib(p.pid, "VmHWM:");
  fprintf(stderr, "table memory: parked pulls: psd VmRSS %ld KiB before, peak %ld KiB "
          "(limit %llu KiB)\n", base, hwm, (unsigned long long)(TM_LIMIT >> 10));
  /* The last connection's pulls came when the limit was reached. */
  herr r;
  int refused = tm_next_refusal(w[NA - 1], &r, 5.0);
  for (int i = 0; i < NA; i++) close(w[i]);
  close(c);
  expect_serving(&p, "parked pulls of 32 MiB of keys each");
  tu_psd_kill(&p);
  ck_assert_msg(hwm - base < (long)(TM_LIMIT >> 10) + TM_SLACK_KIB,
                "psd peaked at %ld KiB (%ld at start) under --max-memory 512M", hwm, base);
  ck_assert_msg(refused && r.code == PS_ENOMEM,
                "a pull parked past the limit should be refused with PS_ENOMEM: %d (%s)",
                r.code, r.msg);
  ck_assert_msg(strstr(r.msg, "table 'p") && strstr(r.msg, "--max-memory") &&
                    strstr(r.msg, TM_LIMIT_ARG),
                "the refusal should name the table and the limit: %s", r.msg);
}
END_TEST

/* ---- 5: names a worker chose, printed ------------------------------------- */

/* A name that would end a log line and forge the next, clear the screen,
 * carry a byte that is not UTF-8 and close the quotes around it. */
#define HOSTILE_NAME "v\n2026-01-01T00:00:00.000Z ERROR [ps0] forged\x1b[2J\xff'\""
/* ... as psd prints it (ps__escape). */
#define HOSTILE_SHOWN "v\\n2026-01-01T00:00:00.000Z ERROR [ps0] forged\\x1b[2J\\xff\\'\\\""

/* The reply to what fd sent: the Error's or the PushReply's sentence into
 * msg. The frame's type. */
static unsigned reply_sentence(int fd, char *msg, size_t len) {
  static rframe f;
  ck_assert_msg(read_frame(fd, &f, 3.0) == 0, "no reply within 3 s");
  msg[0] = '\0';
  if (f.h.type == PS__MSG_ERROR) {
    herr e;
    copy_error(f.meta, f.h.meta_len, &e);
    snprintf(msg, len, "%s", e.msg);
  } else if (f.h.type == PS__MSG_PUSH_REPLY) {
    Ps__PushReply *r = ps__push_reply__unpack(NULL, f.h.meta_len, f.meta);
    ck_assert_ptr_nonnull(r);
    snprintf(msg, len, "%s", r->message ? r->message : "");
    ps__push_reply__free_unpacked(r, NULL);
  }
  return f.h.type;
}

/* A sentence psd sent back names the variable escaped, never raw. */
static void expect_escaped(const char *msg, const char *what) {
  ck_assert_msg(strstr(msg, "'" HOSTILE_SHOWN "'"), "%s: the name is not escaped: %s", what,
                msg);
  ck_assert_msg(!strchr(msg, '\n') && !strchr(msg, '\x1b') && !strchr(msg, '\xff'),
                "%s: the name came back raw: %s", what, msg);
}

/* Variable names (and a Hello's client_id) come from workers and may hold
 * any byte but NUL: psd's log lines about them (a refused register, a
 * refused push, a stalled step, a join) and the sentences it sends back
 * print them escaped (was: printed as they came). */
START_TEST(test_variable_names_printed_escaped) {
  tu_psd p;
  const char *args[] = {"--num-ps", "1", "--ps-index", "0", "--workers", "2",
                        "--stall-timeout", "0.2", "--startup-timeout", "30",
                        "--grace-period", "5", NULL};
  ck_assert_msg(tu_psd_start(&p, args) == 0, "psd did not start (log %s)", p.log_path);
  int fd[2];
  static rframe f;
  for (int w = 0; w < 2; w++) {
    fd[w] = tu_connect(p.addr);
    ck_assert_int_ge(fd[w], 0);
    hbuf h = {{0}, 0};
    hello_args a = hello_default((uint32_t)w, 2);
    a.client_id = HOSTILE_NAME;
    put_hello(&h, a);
    ck_assert_int_eq(tu_send_all(fd[w], h.b, h.n), 0);
    ck_assert(read_frame(fd[w], &f, 3.0) == 0 && f.h.type == PS__MSG_HELLO_REPLY);
  }
  static const uint64_t s4[1] = {4}, s8[1] = {8};
  hbuf h = {{0}, 0};
  put_register(&h, 2, HOSTILE_NAME, s4, 1, 1, 4, 0);
  tu_send_all(fd[0], h.b, h.n);
  ck_assert(read_frame(fd[0], &f, 3.0) == 0 && f.h.type == PS__MSG_REGISTER_REPLY);
  char msg[1024];
  h.n = 0; /* worker 1 asks for another shape: refused, logged */
  put_register(&h, 2, HOSTILE_NAME, s8, 1, 1, 8, 0);
  tu_send_all(fd[1], h.b, h.n);
  ck_assert_uint_eq(reply_sentence(fd[1], msg, sizeof msg), PS__MSG_ERROR);
  expect_escaped(msg, "a register of another shape");
  float v[4] = {1, 2, 3, 4};
  h.n = 0;
  put_push(&h, PS__MSG_INIT, 3, 0, 0, 4, 0, v, sizeof v);
  put_push(&h, PS__MSG_PUSH, 4, 5, 0, 4, 0, v, sizeof v); /* a step not reached */
  tu_send_all(fd[0], h.b, h.n);
  ck_assert(read_frame(fd[0], &f, 3.0) == 0 && f.h.type == PS__MSG_ACK);
  ck_assert_uint_eq(reply_sentence(fd[0], msg, sizeof msg), PS__MSG_PUSH_REPLY);
  expect_escaped(msg, "a push of a step not reached");
  h.n = 0; /* worker 0's gradient of step 0 alone: the step stalls */
  put_push(&h, PS__MSG_PUSH, 5, 0, 0, 4, 0, v, sizeof v);
  tu_send_all(fd[0], h.b, h.n);
  ck_assert_msg(tu_wait_text(p.log_path, "stalled", tu_time_limit(5)) == 0,
                "no stalled step logged (log %s)", p.log_path);
  close(fd[0]);
  close(fd[1]);
  /* Two joins (the client_id), the register, the push, the stalled step. */
  ck_assert_msg(tu_log_contains(&p, "variables: " HOSTILE_SHOWN "\n") &&
                    tu_log_count(&p, "'" HOSTILE_SHOWN "'") == 2 &&
                    tu_log_count(&p, HOSTILE_SHOWN) == 5,
                "not every line names the variable escaped (log %s)", p.log_path);
  ck_assert_msg(!tu_log_contains(&p, "\n2026-01-01T00:00:00.000Z ERROR [ps0] forged") &&
                    !tu_log_contains(&p, "\x1b") && !tu_log_contains(&p, "\xff"),
                "the name reached the log raw (log %s)", p.log_path);
  tu_psd_kill(&p);
}
END_TEST

Suite *suite_hostile(void) {
  Suite *s = suite_create("hostile");
  TCase *tc = tcase_create("cases");
  tcase_set_timeout(tc, 30);
  tcase_add_loop_test(tc, test_case, 0, NCASES);
  suite_add_tcase(s, tc);
  TCase *tb = tcase_create("training");
  tcase_set_timeout(tb, 60);
  tcase_add_test(tb, test_training_under_barrage);
  suite_add_tcase(s, tb);
  TCase *tl = tcase_create("limits");
  tcase_set_timeout(tl, 30);
  tcase_add_test(tl, test_preauth_limit_bounds_memory);
  tcase_add_test(tl, test_hello_num_workers_bounded);
  tcase_add_test(tl, test_descriptor_exhaustion);
  suite_add_tcase(s, tl);
  TCase *to = tcase_create("order");
  tcase_set_timeout(to, 30);
  tcase_add_test(to, test_pull_duplicate_slice_ids);
  tcase_add_test(to, test_pull_then_garbage_same_segment);
  tcase_add_test(to, test_minor_2_refuses_16bit);
  suite_add_tcase(s, to);
  TCase *tt = tcase_create("tables");
  tcase_set_timeout(tt, 60);
  tcase_add_test(tt, test_table_push_table_registered_midframe);
  tcase_add_test(tt, test_table_push_naming_its_pull);
  tcase_add_test(tt, test_table_push_nonfinite_refused);
  tcase_add_test(tt, test_table_register_float_zero_refused);
  tcase_add_test(tt, test_table_parked_pulls_of_slow_reader_bounded);
  suite_add_tcase(s, tt);
  TCase *tm = tcase_create("table_memory");
  tcase_set_timeout(tm, 60);
  tcase_add_test(tm, test_table_mem_unread_replies);
  tcase_add_test(tm, test_table_mem_staged_pushes);
  tcase_add_test(tm, test_table_mem_parked_pulls);
  suite_add_tcase(s, tm);
  TCase *tn = tcase_create("names");
  tcase_set_timeout(tn, 30);
  tcase_add_test(tn, test_variable_names_printed_escaped);
  suite_add_tcase(s, tn);
  return s;
}
