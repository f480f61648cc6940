/*
 * make_corpus - writes the seed corpus of the fuzz targets:
 *
 *   make_corpus DIR   ->  DIR/fuzz_frame/, DIR/fuzz_conn/, DIR/fuzz_handshake/
 *
 * The committed tests/fuzz/corpus was made with it (`make_corpus
 * tests/fuzz/corpus`); rerun it after a protocol change. Every seed is a
 * small, mostly valid input: single frames of each type, the streams of a
 * 1-worker and 2-worker job (Hello, Register, Init, Pull, Push, Finish),
 * async and backup-worker jobs, and the usual mistakes (truncated and bad
 * headers, frames before the handshake, duplicate or unknown slice ids).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ps.pb-c.h"
#include "wire.h"

typedef struct buf {
  uint8_t *p;
  size_t len, cap;
} buf;

static const char *g_dir;

static void put(buf *b, const void *d, size_t n) {
  if (b->len + n > b->cap) {
    size_t nc = b->cap ? b->cap : 256;
    while (nc < b->len + n) nc *= 2;
    b->p = realloc(b->p, nc);
    if (!b->p) abort();
    b->cap = nc;
  }
  if (n) memcpy(b->p + b->len, d, n);
  b->len += n;
}
static void put_u8(buf *b, unsigned v) {
  uint8_t c = (uint8_t)v;
  put(b, &c, 1);
}
static void put_u16(buf *b, unsigned v) {
  put_u8(b, v & 0xff);
  put_u8(b, v >> 8 & 0xff);
}

static void packed(const ProtobufCMessage *m, buf *out) {
  size_t n = protobuf_c_message_get_packed_size(m);
  uint8_t *p = malloc(n ? n : 1);
  if (!p) abort();
  protobuf_c_message_pack(m, p);
  out->len = 0;
  put(out, p, n);
  free(p);
}

/* header + packed m + nfloats float32 values; data_len may be overridden
 * (dlen_override != UINT64_MAX) to make a mismatching frame. */
static void frame_x(buf *b, unsigned type, const ProtobufCMessage *m, uint64_t nfloats,
                    uint64_t dlen_override) {
  buf meta = {0};
  if (m) packed(m, &meta);
  uint8_t hdr[PS__HEADER_SIZE];
  uint64_t dlen = dlen_override != UINT64_MAX ? dlen_override : nfloats * 4;
  ps__header_encode(hdr, type, (uint32_t)meta.len, dlen);
  put(b, hdr, sizeof hdr);
  put(b, meta.p, meta.len);
  for (uint64_t i = 0; i < nfloats; i++) {
    float f = 0.25f * (float)((int)(i % 5) - 2);
    put(b, &f, 4);
  }
  free(meta.p);
}
static void frame(buf *b, unsigned type, const ProtobufCMessage *m, uint64_t nfloats) {
  frame_x(b, type, m, nfloats, UINT64_MAX);
}

static void save(const char *target, const char *name, const buf *b) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", g_dir, target);
  if (mkdir(path, 0755) != 0 && errno != EEXIST) {
    perror(path);
    exit(1);
  }
  snprintf(path, sizeof path, "%s/%s/%s", g_dir, target, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(b->p ? b->p : (uint8_t *)"", 1, b->len, f) != b->len || fclose(f) != 0) {
    perror(path);
    exit(1);
  }
  if (b->len > 4096) fprintf(stderr, "make_corpus: warning: %s is %zu bytes\n", path, b->len);
}

/* ---- messages ------------------------------------------------------------- */

static void hello(buf *b, uint32_t worker, uint32_t replicas, int async) {
  Ps__Hello h = PS__HELLO__INIT;
  h.protocol_version = PS__PROTOCOL_VERSION;
  h.role = PS__ROLE__ROLE_WORKER;
  h.worker_index = worker;
  h.num_workers = 2;
  h.num_ps = 1;
  h.ps_index = 0;
  h.replicas_to_aggregate = replicas;
  h.async_mode = async;
  h.client_id = (char *)"seed";
  h.split_threshold = PS__DEFAULT_SPLIT_THRESHOLD;
  h.max_slice_bytes = PS__DEFAULT_MAX_SLICE_BYTES;
  frame(b, PS__MSG_HELLO, &h.base, 0);
}

/* Registers "w" [2,3] (SGD) and "b" [3] (Adam): slice ids 0 and 1 on a
 * fresh server. */
static void reg(buf *b, uint64_t req) {
  static uint64_t wshape[] = {2, 3}, bshape[] = {3};
  Ps__Optimizer sgd = PS__OPTIMIZER__INIT, adam = PS__OPTIMIZER__INIT;
  sgd.kind = PS__OPT_KIND__OPT_SGD;
  sgd.lr = 0.1;
  adam.kind = PS__OPT_KIND__OPT_ADAM;
  adam.lr = 0.01;
  adam.beta1 = 0.9;
  adam.beta2 = 0.999;
  adam.epsilon = 1e-7;
  Ps__SliceSpec w = PS__SLICE_SPEC__INIT, bb = PS__SLICE_SPEC__INIT;
  w.name = (char *)"w";
  w.n_shape = 2;
  w.shape = wshape;
  w.dtype = 1;
  w.length = 6;
  w.optimizer = &sgd;
  bb.name = (char *)"b";
  bb.n_shape = 1;
  bb.shape = bshape;
  bb.dtype = 1;
  bb.length = 3;
  bb.optimizer = &adam;
  Ps__SliceSpec *specs[] = {&w, &bb};
  Ps__Register r = PS__REGISTER__INIT;
  r.request_id = req;
  r.n_slices = 2;
  r.slices = specs;
  frame(b, PS__MSG_REGISTER, &r.base, 0);
}

/* One Register of a single spec, for the invalid cases. */
static void reg_one(buf *b, uint64_t req, const char *name, uint32_t dtype, size_t ndim,
                    uint64_t *shape, uint64_t offset, uint64_t length, double lr) {
  Ps__Optimizer o = PS__OPTIMIZER__INIT;
  o.lr = lr;
  Ps__SliceSpec s = PS__SLICE_SPEC__INIT;
  s.name = (char *)name;
  s.n_shape = ndim;
  s.shape = shape;
  s.dtype = dtype;
  s.offset = offset;
  s.length = length;
  s.optimizer = &o;
  Ps__SliceSpec *specs[] = {&s};
  Ps__Register r = PS__REGISTER__INIT;
  r.request_id = req;
  r.n_slices = 1;
  r.slices = specs;
  frame(b, PS__MSG_REGISTER, &r.base, 0);
}

/* Push (type PUSH) or Init (type INIT) of slices 0 (6 floats) and 1 (3). */
static void items_frame(buf *b, unsigned type, uint64_t req, uint64_t step, int dup,
                        int rows, uint64_t dlen_override) {
  Ps__Item i0 = PS__ITEM__INIT, i1 = PS__ITEM__INIT;
  static uint64_t rowids[] = {0};
  i0.slice_id = 0;
  i0.count = 6;
  i1.slice_id = dup ? 0 : 1;
  i1.count = dup ? 6 : 3;
  if (rows) {
    i1.n_rows = 1;
    i1.rows = rowids;
    i1.row_width = 3;
  }
  Ps__Item *items[] = {&i0, &i1};
  uint64_t n = 6 + i1.count;
  if (type == PS__MSG_PUSH) {
    Ps__Push p = PS__PUSH__INIT;
    p.request_id = req;
    p.step = step;
    p.n_items = 2;
    p.items = items;
    frame_x(b, type, &p.base, n, dlen_override);
  } else {
    Ps__Init p = PS__INIT__INIT;
    p.request_id = req;
    p.n_items = 2;
    p.items = items;
    frame_x(b, type, &p.base, n, dlen_override);
  }
}
static void push(buf *b, uint64_t req, uint64_t step) {
  items_frame(b, PS__MSG_PUSH, req, step, 0, 0, UINT64_MAX);
}
static void init(buf *b, uint64_t req) { items_frame(b, PS__MSG_INIT, req, 0, 0, 0, UINT64_MAX); }

static void pull(buf *b, uint64_t req, uint64_t min_step, size_t n, uint32_t timeout_ms) {
  static uint32_t ids[] = {0, 1};
  Ps__Pull p = PS__PULL__INIT;
  p.request_id = req;
  p.min_step = min_step;
  p.n_slice_ids = n;
  p.slice_ids = ids;
  p.timeout_ms = timeout_ms;
  frame(b, PS__MSG_PULL, &p.base, 0);
}

static void finish(buf *b, uint64_t req) {
  Ps__Finish f = PS__FINISH__INIT;
  f.request_id = req;
  frame(b, PS__MSG_FINISH, &f.base, 0);
}

/* The 1-worker-of-2 session: Hello, Register, Init, Pull, Push, Pull. */
static void session(buf *b, uint32_t worker, uint32_t replicas, int async) {
  hello(b, worker, replicas, async);
  reg(b, 1);
  if (worker == 0) init(b, 2);
  pull(b, 3, 0, 2, 0);
  push(b, 4, 0);
  pull(b, 5, 1, 2, 0);
}

/* ---- sparse tables (protocol 2.2) ---------------------------------------- */

static void table_reg(buf *b, uint64_t req, const char *name, uint32_t dim, uint32_t opt) {
  Ps__TableSpec sp = PS__TABLE_SPEC__INIT;
  sp.name = (char *)name;
  sp.dim = dim;
  sp.capacity = 64;
  sp.init_kind = 2; /* uniform */
  sp.init_a = -0.1;
  sp.init_b = 0.1;
  sp.opt = opt;
  sp.lr = 0.1;
  sp.initial_accumulator = 0.1;
  sp.beta1 = 0.9;
  sp.beta2 = 0.999;
  sp.epsilon = 1e-7;
  sp.ftrl_beta = 1.0;
  sp.admit_count = 2;
  sp.evict_after_steps = 3;
  Ps__TableRegister r = PS__TABLE_REGISTER__INIT;
  r.request_id = req;
  r.spec = &sp;
  frame(b, PS__MSG_TABLE_REGISTER, &r.base, 0);
}

/* A TablePull of n keys (k0, k0+step, ...): data_len from the keys unless
 * dlen != UINT64_MAX. */
static void table_pull(buf *b, uint64_t req, uint64_t min_step, uint64_t k0, int64_t kstep,
                       size_t n, int ro, uint64_t dlen) {
  Ps__TablePull p = PS__TABLE_PULL__INIT;
  p.request_id = req;
  p.min_step = min_step;
  p.count = n;
  p.read_only = ro;
  p.timeout_ms = 50;
  buf meta = {0};
  packed(&p.base, &meta);
  uint8_t hdr[PS__HEADER_SIZE];
  ps__header_encode(hdr, PS__MSG_TABLE_PULL, (uint32_t)meta.len,
                    dlen != UINT64_MAX ? dlen : n * 8);
  put(b, hdr, sizeof hdr);
  put(b, meta.p, meta.len);
  for (size_t i = 0; i < n; i++) {
    uint64_t k = k0 + (uint64_t)((int64_t)i * kstep);
    put(b, &k, 8);
  }
  free(meta.p);
}

/* A TablePush of n keys k0.. (kstep apart) with dim-float gradients. */
static void table_push(buf *b, uint64_t req, uint64_t step, uint64_t k0, int64_t kstep,
                       size_t n, uint32_t dim) {
  Ps__TablePush p = PS__TABLE_PUSH__INIT;
  p.request_id = req;
  p.step = step;
  p.count = n;
  buf meta = {0};
  packed(&p.base, &meta);
  uint8_t hdr[PS__HEADER_SIZE];
  ps__header_encode(hdr, PS__MSG_TABLE_PUSH, (uint32_t)meta.len, n * (8 + 4 * (uint64_t)dim));
  put(b, hdr, sizeof hdr);
  put(b, meta.p, meta.len);
  for (size_t i = 0; i < n; i++) {
    uint64_t k = k0 + (uint64_t)((int64_t)i * kstep);
    put(b, &k, 8);
  }
  for (size_t i = 0; i < n * dim; i++) {
    float f = 0.5f - 0.125f * (float)(i % 8);
    put(b, &f, 4);
  }
  free(meta.p);
}

static void table_seeds(const char *T) {
  buf b = {0};
  hello(&b, 0, 0, 0);
  table_reg(&b, 1, "emb", 4, 1);
  table_pull(&b, 2, 0, 10, 3, 5, 0, UINT64_MAX);  /* sightings */
  table_pull(&b, 3, 0, 10, 3, 5, 0, UINT64_MAX);  /* admitted */
  table_push(&b, 4, 0, 10, 3, 5, 4);
  table_pull(&b, 5, 1, 10, 3, 5, 1, UINT64_MAX);  /* parked for step 1 */
  table_push(&b, 6, 0, 0, 1, 0, 4);               /* duplicate, empty */
  save(T, "table_session", &b);
  b.len = 0;
  hello(&b, 0, 1, 0); /* replicas 1: each push completes a step */
  for (uint32_t o = 0; o < 4; o++) table_reg(&b, 10 + o, o == 0 ? "s" : o == 1 ? "a" : o == 2 ? "m" : "f", 3, o);
  for (uint64_t s = 0; s < 4; s++) {
    table_pull(&b, 20 + s, s, 1, 1, 4, 0, UINT64_MAX);
    table_push(&b, 30 + s, s, 1, 1, 4, 3);
  }
  save(T, "table_steps_opts", &b);
  b.len = 0;
  hello(&b, 0, 0, 0);
  table_reg(&b, 1, "bad", 0, 0);                  /* dim 0 */
  table_reg(&b, 2, "e", 4, 0);
  table_reg(&b, 3, "e", 5, 0);                    /* mismatch */
  table_pull(&b, 4, 0, 9, -1, 4, 0, UINT64_MAX);  /* descending keys */
  table_pull(&b, 5, 0, 9, 0, 3, 0, UINT64_MAX);   /* duplicate keys */
  table_push(&b, 6, 7, 1, 1, 2, 4);               /* a step not reached */
  table_pull(&b, 7, 0, 1, 1, 2, 0, 12);           /* data length wrong */
  save(T, "table_refusals", &b);
  free(b.p);
}

/* ---- fuzz_frame: single frames -------------------------------------------- */

static void frame_seeds(void) {
  const char *T = "fuzz_frame";
  buf b = {0};
  hello(&b, 0, 0, 0);
  save(T, "hello", &b);
  b.len = 0;
  reg(&b, 1);
  save(T, "register", &b);
  b.len = 0;
  init(&b, 2);
  save(T, "init", &b);
  b.len = 0;
  push(&b, 4, 0);
  save(T, "push", &b);
  b.len = 0;
  pull(&b, 3, 0, 2, 100);
  save(T, "pull", &b);
  b.len = 0;
  finish(&b, 9);
  save(T, "finish", &b);

  Ps__HelloReply hr = PS__HELLO_REPLY__INIT;
  hr.protocol_version = PS__PROTOCOL_VERSION;
  hr.num_ps = 1;
  hr.num_workers = 2;
  hr.replicas_to_aggregate = 2;
  hr.server_id = (char *)"ps0";
  b.len = 0;
  frame(&b, PS__MSG_HELLO_REPLY, &hr.base, 0);
  save(T, "hello_reply", &b);

  Ps__Challenge ch = PS__CHALLENGE__INIT;
  uint8_t nonce[PS__NONCE_BYTES];
  memset(nonce, 0x5a, sizeof nonce);
  ch.protocol_version = PS__PROTOCOL_VERSION;
  ch.nonce.data = nonce;
  ch.nonce.len = sizeof nonce;
  ch.secret = 1;
  b.len = 0;
  frame(&b, PS__MSG_CHALLENGE, &ch.base, 0);
  save(T, "challenge", &b);

  Ps__Error e = PS__ERROR__INIT;
  e.request_id = 0;
  e.code = PS_EPROTO;
  e.message = (char *)"bad frame magic";
  e.fatal = 1;
  b.len = 0;
  frame(&b, PS__MSG_ERROR, &e.base, 0);
  save(T, "error", &b);

  Ps__Ack a = PS__ACK__INIT;
  a.request_id = 7;
  b.len = 0;
  frame(&b, PS__MSG_ACK, &a.base, 0);
  save(T, "ack", &b);

  Ps__SliceState s0 = PS__SLICE_STATE__INIT, s1 = PS__SLICE_STATE__INIT;
  s1.slice_id = 1;
  s1.initialized = 1;
  s1.step = 3;
  Ps__SliceState *ss[] = {&s0, &s1};
  Ps__RegisterReply rr = PS__REGISTER_REPLY__INIT;
  rr.request_id = 1;
  rr.n_slices = 2;
  rr.slices = ss;
  b.len = 0;
  frame(&b, PS__MSG_REGISTER_REPLY, &rr.base, 0);
  save(T, "register_reply", &b);

  Ps__Item it0 = PS__ITEM__INIT, it1 = PS__ITEM__INIT;
  it0.slice_id = 0;
  it0.count = 6;
  it0.step = 1;
  it1.slice_id = 1;
  it1.status = PS_ESTALE;
  Ps__Item *its[] = {&it0, &it1};
  Ps__PushReply pr = PS__PUSH_REPLY__INIT;
  pr.request_id = 4;
  pr.n_items = 2;
  pr.items = its;
  b.len = 0;
  frame(&b, PS__MSG_PUSH_REPLY, &pr.base, 0);
  save(T, "push_reply", &b);
  Ps__PullReply pl = PS__PULL_REPLY__INIT;
  pl.request_id = 5;
  pl.n_items = 1;
  pl.items = its;
  b.len = 0;
  frame(&b, PS__MSG_PULL_REPLY, &pl.base, 6);
  save(T, "pull_reply", &b);

  b.len = 0;
  items_frame(&b, PS__MSG_PUSH, 4, 0, 0, 1, UINT64_MAX);
  save(T, "push_rows", &b);

  /* Headers only, truncated, and over the limits. */
  uint8_t h[PS__HEADER_SIZE];
  ps__header_encode(h, PS__MSG_HELLO, 5000, 0);
  b.len = 0;
  put(&b, h, sizeof h);
  save(T, "hello_too_big", &b);
  ps__header_encode(h, PS__MSG_PUSH, 12, 36);
  b.len = 0;
  put(&b, h, sizeof h);
  save(T, "push_header_only", &b);
  ps__header_encode(h, PS__MSG_PULL, PS__MAX_META + 1, 6);
  b.len = 0;
  put(&b, h, sizeof h);
  save(T, "pull_over_limits", &b);
  b.len = 0;
  put(&b, h, 10);
  save(T, "truncated_header", &b);
  free(b.p);
}

/* ---- fuzz_conn: streams on one connection ---------------------------------- */

static void conn_seeds(void) {
  const char *T = "fuzz_conn";
  buf b = {0};
  uint8_t h[PS__HEADER_SIZE];

  hello(&b, 0, 0, 0);
  save(T, "hello_w0", &b);
  b.len = 0;
  hello(&b, 1, 0, 0);
  save(T, "hello_w1", &b);

  b.len = 0;
  session(&b, 0, 0, 0);
  save(T, "session_w0", &b);
  finish(&b, 6);
  save(T, "session_w0_finish", &b);
  b.len = 0;
  session(&b, 1, 0, 0);
  finish(&b, 6);
  save(T, "session_w1_finish", &b);
  b.len = 0;
  session(&b, 0, 0, 1);
  push(&b, 6, 1);
  pull(&b, 7, 2, 2, 0);
  finish(&b, 8);
  save(T, "session_async", &b);
  b.len = 0;
  session(&b, 0, 1, 0); /* replicas 1: every push completes a step */
  push(&b, 6, 0);       /* stale now */
  push(&b, 7, 5);       /* a step not reached */
  save(T, "session_backup", &b);
  table_seeds(T);

  /* Protocol mistakes. */
  Ps__Error e = PS__ERROR__INIT;
  e.code = PS_EPROTO;
  e.message = (char *)"x";
  b.len = 0;
  frame(&b, PS__MSG_ERROR, &e.base, 0);
  save(T, "error_before_hello", &b);
  b.len = 0;
  reg(&b, 1);
  save(T, "register_before_hello", &b);
  ps__header_encode(h, PS__MSG_HELLO, 21, 0);
  b.len = 0;
  put(&b, h, 10);
  save(T, "truncated_header", &b);
  b.len = 0;
  put(&b, h, sizeof h);
  put(&b, "\x08\x01\x10", 3);
  save(T, "truncated_hello", &b);
  b.len = 0;
  put(&b, "GET / HTTP/1.1\r\nHost: psd\r\n\r\n", 29);
  save(T, "http", &b);
  ps__header_encode(h, PS__MSG_HELLO, 5000, 0);
  b.len = 0;
  put(&b, h, sizeof h);
  save(T, "hello_too_big", &b);
  b.len = 0;
  hello(&b, 0, 0, 0);
  hello(&b, 0, 0, 0);
  save(T, "second_hello", &b);
  b.len = 0;
  hello(&b, 0, 0, 0);
  static uint64_t s23[] = {2, 3}, s0[] = {2, 0}, s9[] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  reg_one(&b, 1, "", 1, 2, s23, 0, 6, 0.1);       /* empty name */
  reg_one(&b, 2, "d", 2, 2, s23, 0, 6, 0.1);      /* dtype 2 */
  reg_one(&b, 3, "z", 1, 2, s0, 0, 0, 0.1);       /* zero dimension */
  reg_one(&b, 4, "r", 1, 9, s9, 0, 1, 0.1);       /* rank 9 */
  reg_one(&b, 5, "p", 1, 2, s23, 1, 5, 0.1);      /* not a placement slice */
  reg_one(&b, 6, "o", 1, 2, s23, 0, 6, -1.0);     /* bad learning rate */
  reg(&b, 7);
  pull(&b, 8, 0, 0, 0);                           /* empty pull */
  pull(&b, 9, 3, 2, 1);                           /* parked, 1 ms deadline */
  pull(&b, 10, 0, 2, 0);                          /* replaces it */
  save(T, "register_errors", &b);
  b.len = 0;
  hello(&b, 0, 0, 0);
  reg(&b, 1);
  items_frame(&b, PS__MSG_INIT, 2, 0, 1, 0, UINT64_MAX);
  save(T, "init_duplicate_slice", &b);
  b.len = 0;
  hello(&b, 0, 0, 0);
  reg(&b, 1);
  init(&b, 2);
  items_frame(&b, PS__MSG_PUSH, 3, 0, 0, 1, UINT64_MAX);
  save(T, "push_row_sparse", &b);
  b.len = 0;
  hello(&b, 0, 0, 0);
  reg(&b, 1);
  items_frame(&b, PS__MSG_PUSH, 3, 0, 0, 0, 32);
  save(T, "push_data_mismatch", &b);
  b.len = 0;
  hello(&b, 1, 0, 0);
  reg(&b, 1);
  init(&b, 2);
  save(T, "init_not_chief", &b);
  b.len = 0;
  hello(&b, 0, 0, 0);
  finish(&b, 1);
  push(&b, 2, 0);
  save(T, "push_after_finish", &b);
  b.len = 0;
  hello(&b, 0, 0, 0);
  reg(&b, 1);
  pull(&b, 2, 0, 2, 0);
  {
    /* The Pull again, with 4 data bytes it must not carry. */
    buf meta = {0};
    static uint32_t ids[] = {7};
    Ps__Pull p = PS__PULL__INIT;
    p.request_id = 3;
    p.n_slice_ids = 1;
    p.slice_ids = ids;
    packed(&p.base, &meta);
    ps__header_encode(h, PS__MSG_PULL, (uint32_t)meta.len, 4);
    put(&b, h, sizeof h);
    put(&b, meta.p, meta.len);
    put(&b, "\0\0\0\0", 4);
    free(meta.p);
  }
  save(T, "pull_with_data", &b);
  b.len = 0;
  hello(&b, 0, 0, 0);
  reg(&b, 1);
  pull(&b, 2, 0, 2, 0);
  pull(&b, 3, 0, 2, 0); /* the first is ready but not answered yet: EBUSY */
  save(T, "pull_busy", &b);
  free(b.p);
}

/* ---- fuzz_handshake: Hello selectors + tail ---------------------------------- */

/* The selector bytes of fuzz_handshake.c's hello_from: zeros select the
 * seed Hello; the fields of s replace some of them. */
typedef struct hs_sel {
  uint8_t worker, replicas, async, version, workers, maxs, cred;
} hs_sel;

static void hs_head(buf *b, int framed, hs_sel s) {
  put_u8(b, framed);
  put_u8(b, s.version);  /* protocol_version */
  put_u8(b, 0);          /* role */
  put_u8(b, s.worker);   /* worker_index */
  put_u8(b, s.workers);  /* num_workers */
  put_u8(b, 0);          /* num_ps */
  put_u8(b, 0);          /* ps_index */
  put_u8(b, s.replicas); /* replicas_to_aggregate */
  put_u8(b, s.async);    /* async_mode */
  put_u8(b, s.cred);     /* proof: below 0xb0 a valid one (0xa0..: munge flag) */
  size_t clen = s.cred < 0xb0 ? 0 : s.cred % 48;
  for (size_t i = 0; i < clen; i++) put_u8(b, 'a' + (unsigned)i % 26);
  put_u8(b, 2);          /* client_id: 2 bytes */
  put(b, "w0", 2);
  put_u8(b, 0);          /* split_threshold: default */
  put_u8(b, s.maxs);     /* max_slice_bytes */
}

/* One framed-tail entry: the frame's meta is taken from a built frame. */
static void hs_entry(buf *b, const buf *one_frame) {
  uint8_t type = one_frame->p[6];
  uint32_t mlen = (uint32_t)one_frame->p[8] | (uint32_t)one_frame->p[9] << 8;
  put_u8(b, (unsigned)type - 1);
  put_u16(b, mlen);
  put(b, one_frame->p + PS__HEADER_SIZE, mlen);
  put_u8(b, 0); /* data: what a Push/Init needs */
}

/* A framed-tail switch to the other connection (flags: bits 1-3 of the
 * switch byte, see fuzz_handshake.c). */
static void hs_switch(buf *b, unsigned flags) { put_u8(b, 0xf0 | (flags & 0xe)); }

static void handshake_seeds(void) {
  const char *T = "fuzz_handshake";
  buf b = {0}, f = {0};
  hs_sel z = {0};
  put_u8(&b, 0);
  save(T, "hello_w0", &b);
  b.len = 0;
  hs_sel w1 = z;
  w1.worker = 1;
  hs_head(&b, 0, w1);
  save(T, "hello_w1", &b);
  b.len = 0;
  hs_sel as = z;
  as.async = 0xf0;
  hs_head(&b, 0, as);
  save(T, "hello_async", &b);
  b.len = 0;
  hs_sel r1 = z;
  r1.replicas = 0xc1;
  hs_head(&b, 0, r1);
  save(T, "hello_replicas1", &b);
  b.len = 0;
  hs_sel v2 = z;
  v2.version = 0xf2;
  hs_head(&b, 0, v2);
  save(T, "hello_version2", &b);
  b.len = 0;
  hs_sel nw = z;
  nw.workers = 0xf3;
  hs_head(&b, 0, nw);
  save(T, "hello_3_workers", &b);
  b.len = 0;
  hs_sel ws = z;
  ws.cred = 0xb0 + 32; /* a wrong proof of the right size (32 bytes) */
  hs_head(&b, 0, ws);
  save(T, "hello_wrong_secret", &b);
  b.len = 0;
  hs_sel ms = z;
  ms.cred = 0xa0 + 4; /* munge flag with a valid proof (this psd wants no MUNGE) */
  hs_head(&b, 0, ms);
  save(T, "hello_munge_flag", &b);
  b.len = 0;
  put_u8(&b, 0);
  for (int i = 0; i < 8; i++) put_u8(&b, 0);
  put_u8(&b, 0xff); /* proof of 4000 + 199 bytes: past the limit */
  put_u16(&b, 199);
  save(T, "hello_credential_too_big", &b);

  /* Framed sessions. */
  for (int v = 0; v < 3; v++) {
    hs_sel s = z;
    if (v == 1) s.async = 0xf0;
    if (v == 2) s.maxs = 0xc0 + 2; /* 16-byte slices: "w" becomes 2 slices */
    b.len = 0;
    hs_head(&b, 1, s);
    f.len = 0, reg(&f, 1), hs_entry(&b, &f);
    if (v != 2) f.len = 0, init(&f, 2), hs_entry(&b, &f);
    f.len = 0, pull(&f, 3, 0, 2, 0), hs_entry(&b, &f);
    f.len = 0, push(&f, 4, 0), hs_entry(&b, &f);
    f.len = 0, pull(&f, 5, 1, 2, 0), hs_entry(&b, &f);
    f.len = 0, finish(&f, 6), hs_entry(&b, &f);
    save(T, v == 0 ? "framed_session" : v == 1 ? "framed_async" : "framed_small_slices", &b);
  }
  /* Two workers on two connections: worker 0 registers, initializes and
   * parks a pull for step 1; worker 1 registers, pulls and pushes step 0;
   * worker 0's push completes the step, which answers both pulls; both
   * finish. */
  b.len = 0;
  hs_head(&b, 1, z);
  f.len = 0, reg(&f, 1), hs_entry(&b, &f);
  f.len = 0, init(&f, 2), hs_entry(&b, &f);
  f.len = 0, pull(&f, 3, 1, 2, 0), hs_entry(&b, &f);
  hs_switch(&b, 0);
  f.len = 0, reg(&f, 1), hs_entry(&b, &f);
  f.len = 0, pull(&f, 2, 1, 2, 0), hs_entry(&b, &f);
  f.len = 0, push(&f, 3, 0), hs_entry(&b, &f);
  hs_switch(&b, 0);
  f.len = 0, push(&f, 4, 0), hs_entry(&b, &f);
  f.len = 0, push(&f, 5, 1), hs_entry(&b, &f);
  f.len = 0, finish(&f, 6), hs_entry(&b, &f);
  hs_switch(&b, 0);
  f.len = 0, push(&f, 4, 1), hs_entry(&b, &f);
  f.len = 0, finish(&f, 5), hs_entry(&b, &f);
  save(T, "framed_two_workers", &b);
  /* The same worker twice: the second Hello gets PS_EBUSY. */
  b.len = 0;
  hs_head(&b, 1, z);
  hs_switch(&b, 1 << 2);
  save(T, "framed_same_worker_twice", &b);
  /* Raw tail: the session's frames as they are. */
  b.len = 0;
  hs_head(&b, 0, z);
  reg(&b, 1);
  init(&b, 2);
  pull(&b, 3, 0, 2, 0);
  push(&b, 4, 0);
  save(T, "raw_session", &b);
  /* A 40000-float variable: its Init and Push data (160 kB, made by the
   * harness) are read straight into the staging buffer. */
  b.len = 0;
  hs_head(&b, 1, z);
  static uint64_t big[] = {200, 200};
  f.len = 0, reg_one(&f, 1, "big", 1, 2, big, 0, 40000, 0.5), hs_entry(&b, &f);
  {
    Ps__Item it = PS__ITEM__INIT;
    it.count = 40000;
    Ps__Item *its[] = {&it};
    Ps__Init in = PS__INIT__INIT;
    in.request_id = 2;
    in.n_items = 1;
    in.items = its;
    f.len = 0, frame(&f, PS__MSG_INIT, &in.base, 0), hs_entry(&b, &f);
    Ps__Push p = PS__PUSH__INIT;
    p.request_id = 3;
    p.n_items = 1;
    p.items = its;
    f.len = 0, frame(&f, PS__MSG_PUSH, &p.base, 0), hs_entry(&b, &f);
  }
  f.len = 0, pull(&f, 4, 0, 1, 0), hs_entry(&b, &f);
  save(T, "framed_big_variable", &b);
  free(b.p);
  free(f.p);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: make_corpus DIR (writes DIR/fuzz_*/)\n");
    return 2;
  }
  g_dir = argv[1];
  if (mkdir(g_dir, 0755) != 0 && errno != EEXIST) {
    perror(g_dir);
    return 1;
  }
  frame_seeds();
  conn_seeds();
  handshake_seeds();
  return 0;
}
