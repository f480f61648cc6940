/* fuzz_server.c - see fuzz_server.h. */
#include "fuzz_server.h"

#include <errno.h>
#include <event2/event.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "conn.h"
#include "psdlog.h"
#include "ps.pb-c.h"
#include "wire.h"
#include "server.h"

/* Seconds psd may go without reading or closing before the harness calls
 * it a hang (libFuzzer's -timeout would catch it later anyway). */
#define FUZZ_STALL_S 5.0
/* Slices / parameter bytes a server may hold before it is replaced, so
 * memory and per-connection table sizes stay bounded over a long run. */
#define FUZZ_MAX_SLICES 4096u
#define FUZZ_MAX_HELD ((uint64_t)32 << 20)
/* Inputs one server sees at most. State carried over is what lets two
 * inputs (worker 0's, then worker 1's) complete a sync step together, but
 * it also shifts slice ids: an input that registers other variables first
 * changes what the seeds' ids mean. A fresh server now and then bounds
 * that drift, and how far back a crash's history can reach. */
#define FUZZ_INPUTS_PER_SERVER 64u

static psd_config g_cfg;
static psd_server g_srv;
static int g_configured;   /* g_cfg is filled in */
static int g_up;           /* g_srv is initialized */
static int g_fresh;        /* FUZZ_FRESH=1: a new server for every input */
static uint64_t g_servers; /* servers made so far (stats) */
static uint32_t g_inputs;  /* inputs the current server has seen */
static uint64_t g_waits;   /* times the harness had to wait for psd (stats) */
static const char *g_secret; /* fuzz_server_configure */
static int g_fresh_always;    /* fuzz_server_configure */
/* Small writes per input before the rest goes in one piece, so inputs with
 * large tensors stay fast. */
#define FUZZ_MAX_SMALL_WRITES 512

/* libsodium's random bytes, made constant: psd's Challenge nonce is then
 * FUZZ_NONCE_BYTE repeated, so a harness can prove the secret over it in
 * advance and every input runs the same way. */
static uint32_t fixed_random(void) { return FUZZ_NONCE_BYTE * 0x01010101u; }
static void fixed_buf(void *buf, size_t n) { memset(buf, FUZZ_NONCE_BYTE, n); }
static const char *fixed_name(void) { return "psd-fuzz-fixed"; }
static randombytes_implementation g_fixed = {
    .implementation_name = fixed_name, .random = fixed_random, .buf = fixed_buf};

void fuzz_server_configure(const char *secret, int fresh) {
  g_secret = secret;
  g_fresh_always = fresh;
  randombytes_set_implementation(&g_fixed); /* before libsodium starts */
}

/* ---- the server ---------------------------------------------------------- */

static void server_start(void) {
  if (!g_configured) {
    g_configured = 1;
    const char *lvl = getenv("FUZZ_LOG_LEVEL"); /* error (default) .. debug */
    char *argv[] = {"psd-fuzz", "--host", "127.0.0.1", "--port", "0",
                    "--workers", "2", "--log-level", (char *)(lvl && *lvl ? lvl : "error"),
                    "--stall-timeout", "1000", "--grace-period", "1000000",
                    "--startup-timeout", "0", "--name", "fuzz", NULL};
    int argc = (int)(sizeof argv / sizeof argv[0]) - 1;
    char err[512];
    if (psd_config_parse(&g_cfg, argc, argv, err, sizeof err) != 0) {
      fprintf(stderr, "fuzz: psd_config_parse: %s\n", err);
      abort();
    }
    /* The secret comes from the environment, as for psd (psd/psd.c). */
    if (g_secret) setenv("PSD_SECRET", g_secret, 1);
    else unsetenv("PSD_SECRET");
    if (psd_config_load_secret(&g_cfg, err, sizeof err) != 0) {
      fprintf(stderr, "fuzz: psd_config_load_secret: %s\n", err);
      abort();
    }
    psd_log_init(g_cfg.name, g_cfg.log_level);
    const char *f = getenv("FUZZ_FRESH");
    g_fresh = g_fresh_always || (f && *f && strcmp(f, "0") != 0);
  }
  if (psd_server_init(&g_srv, &g_cfg) != 0) {
    fprintf(stderr, "fuzz: psd_server_init failed\n");
    abort();
  }
  g_up = 1;
  g_servers++;
  g_inputs = 0;
}

static void server_stop(void) {
  if (!g_up) return;
  psd_server_free(&g_srv);
  g_up = 0;
}

/* 1 if the state this input left would make later inputs meaningless: the
 * server is exiting (every worker done), a worker finished (it can never
 * say Hello again), the job was pinned to values other than the seed
 * corpus's, or it holds too much; and after FUZZ_INPUTS_PER_SERVER. */
static int server_spent(void) {
  const psd_server *s = &g_srv;
  if (g_fresh || s->exiting || g_inputs >= FUZZ_INPUTS_PER_SERVER) return 1;
  if (s->shard.n > FUZZ_MAX_SLICES || s->shard.bytes_held > FUZZ_MAX_HELD) return 1;
  if (!s->job.pinned) return 0;
  if (s->job.num_workers != FUZZ_WORKERS || s->shard.replicas != FUZZ_WORKERS ||
      s->shard.async_mode || s->job.split_threshold != PS__DEFAULT_SPLIT_THRESHOLD ||
      s->job.max_slice_bytes != PS__DEFAULT_MAX_SLICE_BYTES)
    return 1;
  for (uint32_t w = 0; w < s->job.num_workers; w++)
    if (s->job.workers[w].finished) return 1;
  return 0;
}

static void at_exit(void) {
  if (getenv("FUZZ_STATS"))
    fprintf(stderr, "fuzz: %llu psd servers made, %llu waits for psd\n",
            (unsigned long long)g_servers, (unsigned long long)g_waits);
  server_stop();
}

/* ---- input shaping --------------------------------------------------------- */

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static uint64_t fnv1a(const uint8_t *d, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) h = (h ^ d[i]) * 1099511628211ULL;
  return h;
}

static uint64_t sat_add(uint64_t a, uint64_t b) { return a + b < a ? UINT64_MAX : a + b; }
static uint64_t sat_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

/* How many leading bytes to send: frames are scanned as psd would read
 * them, and the input is cut before the Register that would take the
 * allocations past FUZZ_REGISTER_BUDGET. */
static size_t budget_prefix(const uint8_t *d, size_t n, uint64_t *spent_all) {
  size_t off = 0;
  uint64_t spent = *spent_all;
  while (n - off >= PS__HEADER_SIZE) {
    ps__frame_header h;
    char err[256];
    if (ps__header_decode(d + off, 1, &h, err, sizeof err) != 0) break;
    size_t start = off;
    off += PS__HEADER_SIZE;
    if (n - off < h.meta_len) break;
    if (h.type == PS__MSG_REGISTER) {
      Ps__Register *r = ps__register__unpack(NULL, h.meta_len, d + off);
      if (r) {
        for (size_t i = 0; i < r->n_slices; i++) {
          const Ps__SliceSpec *sp = r->slices[i];
          if (sp->length > PS__MAX_SLICE_BYTES / sizeof(float)) continue; /* refused */
          uint64_t per = 2; /* parameters and accumulator */
          if (sp->optimizer && sp->optimizer->kind == PS__OPT_KIND__OPT_MOMENTUM) per = 3;
          if (sp->optimizer && sp->optimizer->kind == PS__OPT_KIND__OPT_ADAM) per = 4;
          spent = sat_add(spent, sat_mul(sat_mul(sp->length, sizeof(float)), per));
        }
        ps__register__free_unpacked(r, NULL);
        if (spent > FUZZ_REGISTER_BUDGET) return start;
        *spent_all = spent;
      }
    }
    off += h.meta_len;
    if (n - off < h.data_len) break;
    off += (size_t)h.data_len;
  }
  return n;
}

/* ---- what psd sends back must be well-formed ----------------------------- */

typedef struct reply_parser {
  uint8_t *buf;
  size_t len, cap;
  uint64_t skip;  /* data bytes of the current frame still to come */
  uint64_t frames;
} reply_parser;

static void bad_reply(const char *what, const uint8_t *hdr) {
  fprintf(stderr, "fuzz: psd sent a malformed frame: %s; header:", what);
  for (int i = 0; i < (int)PS__HEADER_SIZE; i++) fprintf(stderr, " %02x", hdr[i]);
  fprintf(stderr, "\n");
  abort();
}

/* Checks one complete header + protobuf; returns the data bytes that follow. */
static uint64_t check_reply(const ps__frame_header *h, const uint8_t *hdr, const uint8_t *meta) {
  ProtobufCMessage *m = NULL;
  uint64_t want_data = 0;
  switch (h->type) {
  case PS__MSG_HELLO_REPLY:
    m = (ProtobufCMessage *)ps__hello_reply__unpack(NULL, h->meta_len, meta);
    break;
  case PS__MSG_CHALLENGE:
    m = (ProtobufCMessage *)ps__challenge__unpack(NULL, h->meta_len, meta);
    break;
  case PS__MSG_ERROR: {
    Ps__Error *e = ps__error__unpack(NULL, h->meta_len, meta);
    if (e && e->code >= 0) bad_reply("Error with a non-negative code", hdr);
    m = (ProtobufCMessage *)e;
    break;
  }
  case PS__MSG_ACK:
    m = (ProtobufCMessage *)ps__ack__unpack(NULL, h->meta_len, meta);
    break;
  case PS__MSG_REGISTER_REPLY:
    m = (ProtobufCMessage *)ps__register_reply__unpack(NULL, h->meta_len, meta);
    break;
  case PS__MSG_PUSH_REPLY:
    m = (ProtobufCMessage *)ps__push_reply__unpack(NULL, h->meta_len, meta);
    break;
  case PS__MSG_PULL_REPLY: {
    Ps__PullReply *r = ps__pull_reply__unpack(NULL, h->meta_len, meta);
    if (r) /* each item in its own wire dtype: 16-bit pulls are 2 bytes a value (2.3) */
      for (size_t i = 0; i < r->n_items; i++)
        want_data = sat_add(want_data, sat_mul(r->items[i]->count,
                                               ps__dtype_size(r->items[i]->dtype)));
    m = (ProtobufCMessage *)r;
    break;
  }
  case PS__MSG_CHECKPOINT_REPLY:
    m = (ProtobufCMessage *)ps__checkpoint_reply__unpack(NULL, h->meta_len, meta);
    break;
  case PS__MSG_STATS_REPLY:
    m = (ProtobufCMessage *)ps__stats_reply__unpack(NULL, h->meta_len, meta);
    break;
  case PS__MSG_TABLE_REGISTER_REPLY:
    m = (ProtobufCMessage *)ps__table_register_reply__unpack(NULL, h->meta_len, meta);
    break;
  case PS__MSG_TABLE_PUSH_REPLY:
    m = (ProtobufCMessage *)ps__table_push_reply__unpack(NULL, h->meta_len, meta);
    break;
  case PS__MSG_TABLE_PULL_REPLY: {
    /* count rows of a dim this checker does not know: whole rows of
     * whole floats, none for none. */
    Ps__TablePullReply *r = ps__table_pull_reply__unpack(NULL, h->meta_len, meta);
    want_data = h->data_len;
    if (r && (r->count ? h->data_len % sat_mul(r->count, sizeof(float)) != 0 || !h->data_len
                       : h->data_len != 0))
      bad_reply("TABLE_PULL_REPLY data is not count whole rows", hdr);
    m = (ProtobufCMessage *)r;
    break;
  }
  default:
    bad_reply("a message type the server never sends", hdr);
  }
  if (!m) bad_reply("its protobuf does not unpack", hdr);
  protobuf_c_message_free_unpacked(m, NULL);
  if (h->data_len != want_data) bad_reply("data length does not match its items", hdr);
  return h->data_len;
}

static void reply_bytes(reply_parser *p, const uint8_t *d, size_t n) {
  while (n > 0) {
    if (p->skip) {
      size_t k = p->skip < n ? (size_t)p->skip : n;
      p->skip -= k;
      d += k;
      n -= k;
      continue;
    }
    size_t take = n;
    if (p->len + take > p->cap) {
      size_t nc = p->cap ? p->cap : 4096;
      while (nc < p->len + take) nc *= 2;
      uint8_t *nb = realloc(p->buf, nc);
      if (!nb) abort();
      p->buf = nb;
      p->cap = nc;
    }
    memcpy(p->buf + p->len, d, take);
    p->len += take;
    n = 0;
    /* Consume every complete frame now buffered. */
    size_t off = 0;
    while (p->len - off >= PS__HEADER_SIZE) {
      ps__frame_header h;
      char err[256];
      if (ps__header_decode(p->buf + off, 1, &h, err, sizeof err) != 0)
        bad_reply(err, p->buf + off);
      if (p->len - off - PS__HEADER_SIZE < h.meta_len) break;
      uint64_t data = check_reply(&h, p->buf + off, p->buf + off + PS__HEADER_SIZE);
      p->frames++;
      off += PS__HEADER_SIZE + h.meta_len;
      uint64_t here = p->len - off < data ? p->len - off : data;
      off += (size_t)here;
      p->skip = data - here;
      if (p->skip) break;
    }
    memmove(p->buf, p->buf + off, p->len - off);
    p->len -= off;
  }
}

/* ---- the pin an input's Hello expects ------------------------------------- */

/* 1 if stream d starts with a Hello that the carried-over pin would refuse
 * (check 11 of docs/protocol.md §5) while a fresh server would pin it: such
 * an input gets a fresh server, so inputs that pin async mode, replicas 1
 * or other placement inputs run the same way every time. */
static int hello_conflicts_with_pin(const uint8_t *d, size_t n) {
  const psd_server *s = &g_srv;
  if (!g_up || !s->job.pinned || n < PS__HEADER_SIZE) return 0;
  ps__frame_header h;
  char err[256];
  if (ps__header_decode(d, 0, &h, err, sizeof err) != 0 || h.type != PS__MSG_HELLO ||
      n - PS__HEADER_SIZE < h.meta_len)
    return 0;
  Ps__Hello *m = ps__hello__unpack(NULL, h.meta_len, d + PS__HEADER_SIZE);
  if (!m) return 0;
  uint32_t r = m->replicas_to_aggregate ? m->replicas_to_aggregate
               : g_cfg.replicas       ? (uint32_t)g_cfg.replicas
                                      : m->num_workers;
  uint64_t split = m->split_threshold ? m->split_threshold : PS__DEFAULT_SPLIT_THRESHOLD;
  uint64_t maxs = m->max_slice_bytes ? m->max_slice_bytes & ~(uint64_t)3
                                     : PS__DEFAULT_MAX_SLICE_BYTES;
  int differs = m->num_workers != s->job.num_workers || r != s->shard.replicas ||
                !m->async_mode != !s->shard.async_mode || split != s->job.split_threshold ||
                maxs != s->job.max_slice_bytes;
  ps__hello__free_unpacked(m, NULL);
  return differs;
}

/* ---- connections ------------------------------------------------------------ */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct fconn {
  int fd;            /* the client's end; psd owns the other */
  const uint8_t *data;
  size_t size, off;  /* stream, its length after the budget, bytes written */
  int dead;          /* psd stopped taking bytes (EPIPE/ECONNRESET) */
  int shut, eof;     /* write side shut; psd closed its end */
  reply_parser rp;
} fconn;

static fconn g_conns[FUZZ_MAX_CONNS];
static unsigned g_nconns;
static uint64_t g_rng;
static int g_write_style, g_lazy;
static double g_last;
static size_t g_writes;

/* Reads what psd sent on every connection; 1 if anything came. */
static int drain(int force) {
  static uint8_t rbuf[1 << 16];
  int got = 0;
  for (unsigned i = 0; i < g_nconns; i++) {
    fconn *k = &g_conns[i];
    if (k->eof) continue;
    if (!force && g_lazy && (splitmix(&g_rng) & 7) != 0) continue;
    for (;;) {
      ssize_t n = read(k->fd, rbuf, sizeof rbuf);
      if (n > 0) {
        reply_bytes(&k->rp, rbuf, (size_t)n);
        got = 1;
        continue;
      }
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        k->eof = 1;
        got = 1;
      }
      break;
    }
  }
  return got;
}

/* One turn: psd's loop, the replies; waits for psd if nothing moved, and
 * calls it a hang after FUZZ_STALL_S without progress. */
static void turn(int progress, const char *doing) {
  event_base_loop(g_srv.base, EVLOOP_NONBLOCK);
  if (drain(!progress)) progress = 1;
  double t = now_s();
  if (progress) {
    g_last = t;
    return;
  }
  if (t - g_last > FUZZ_STALL_S) {
    fprintf(stderr, "fuzz: psd neither read, wrote nor closed for %.0f s while %s\n",
            FUZZ_STALL_S, doing);
    for (unsigned i = 0; i < g_nconns; i++)
      fprintf(stderr, "fuzz:   connection %u: %zu of %zu bytes sent%s%s%s\n", i,
              g_conns[i].off, g_conns[i].size, g_conns[i].dead ? ", refused" : "",
              g_conns[i].shut ? ", write side shut" : "", g_conns[i].eof ? ", closed" : "");
    abort();
  }
  /* Nothing moved: wait for psd's next event (its 100 ms tick at most). */
  g_waits++;
  event_base_loop(g_srv.base, EVLOOP_ONCE);
}

/* Writes the next len bytes of connection c's stream, in pieces. */
static void send_bytes(fconn *k, size_t len) {
  size_t end = k->off + len > k->size ? k->size : k->off + len;
  while (k->off < end && !k->dead && !k->eof) {
    size_t left = end - k->off, n = left;
    uint64_t r = splitmix(&g_rng);
    int st = g_write_style == 3 ? (int)(r >> 60) % 3 : g_write_style;
    if (++g_writes > FUZZ_MAX_SMALL_WRITES) st = 0;
    if (st == 1) n = 1 + (size_t)(r % 8);
    else if (st == 2) n = 1 + (size_t)(r % 512);
    if (n > left) n = left;
    ssize_t w = write(k->fd, k->data + k->off, n);
    int progress = 0;
    if (w > 0) {
      k->off += (size_t)w;
      progress = 1;
    } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      k->dead = 1; /* psd closed the connection: the rest is not sent */
      progress = 1;
    }
    turn(progress, "sending");
  }
}

void fuzz_server_run(const uint8_t *const *streams, const size_t *sizes, unsigned nconns,
                     const fuzz_segment *segs, size_t nsegs, uint64_t shape) {
  if (nconns == 0 || nconns > FUZZ_MAX_CONNS) abort();
  if (g_up && !g_fresh && hello_conflicts_with_pin(streams[0], sizes[0])) server_stop();
  if (!g_up) {
    server_start();
    static int registered;
    if (!registered++) atexit(at_exit);
  }
  g_inputs++;

  uint64_t spent = 0, h = 1469598103934665603ULL;
  g_nconns = nconns;
  for (unsigned i = 0; i < nconns; i++) {
    fconn *k = &g_conns[i];
    memset(k, 0, sizeof *k);
    k->data = streams[i];
    k->size = budget_prefix(streams[i], sizes[i], &spent);
    h ^= fnv1a(k->data, k->size) + i;
  }
  g_rng = shape ? shape : h;
  uint64_t style = splitmix(&g_rng);
  g_write_style = (int)(style & 3);       /* 0: all at once, 1: tiny, 2: small, 3: mixed */
  g_lazy = (style >> 2 & 3) == 0;         /* let replies pile up in psd */
  int small_sndbuf = (style >> 4 & 3) == 0; /* psd's writes come out in pieces */
  g_writes = 0;
  g_last = now_s();

  for (unsigned i = 0; i < nconns; i++) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) {
      perror("fuzz: socketpair");
      abort();
    }
    if (small_sndbuf) {
      int b = 4096;
      setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
    }
    char peer[32];
    snprintf(peer, sizeof peer, "fuzz:%u", i);
    if (!psd_conn_new(&g_srv.conns, sv[0], peer)) {
      fprintf(stderr, "fuzz: psd_conn_new failed\n");
      abort();
    }
    g_conns[i].fd = sv[1];
  }

  /* The segments in order, then whatever they left of each stream. */
  for (size_t s = 0; s < nsegs; s++)
    if (segs[s].conn < nconns) send_bytes(&g_conns[segs[s].conn], segs[s].len);
  for (unsigned i = 0; i < nconns; i++) send_bytes(&g_conns[i], SIZE_MAX);
  /* End of input: shut every write side, run until psd closed them all. */
  for (;;) {
    int progress = 0, open = 0;
    for (unsigned i = 0; i < nconns; i++) {
      fconn *k = &g_conns[i];
      if (!k->shut) {
        shutdown(k->fd, SHUT_WR);
        k->shut = 1;
        progress = 1;
      }
      open += !k->eof;
    }
    if (!open) break;
    turn(progress, "waiting for psd to close");
  }
  for (unsigned i = 0; i < nconns; i++) {
    close(g_conns[i].fd);
    free(g_conns[i].rp.buf);
  }
  /* psd closed its ends, so its connections are gone (reaped by now). */
  if (server_spent()) server_stop();
}

void fuzz_server_feed(const uint8_t *data, size_t size, uint64_t shape) {
  fuzz_server_run(&data, &size, 1, NULL, 0, shape);
}
