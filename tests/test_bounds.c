/* Integration: what authenticated but hostile or broken peers can make
 * either side hold. A worker that never reads its replies while pulling a
 * 64 MiB slice over and over, and admin peers sending Stats requests full
 * of unknown fields, must leave psd's resident memory within a documented
 * bound; a fake psd that answers a Register with a slice id near 2^32 must
 * make the client fail that connection with PS_EPROTO, without allocating
 * for the id. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ps.pb-c.h"
#include "wire.h"
#include "testutil.h"

/* Elements of the slice the slow reader pulls: 64 MiB of floats, the
 * largest slice there is (PS__MAX_SLICE_BYTES). */
#define BIG_N ((uint64_t)16 << 20)
#define MIB (1024L * 1024L)
/* psd's PSD_OUT_HIGH_WATER (psd/conn.c), in MiB. */
#define OUT_HIGH_WATER_MIB 64L
/* Allowance over the documented bound for what the measurement cannot
 * separate: socket buffers, allocator slack, the log. */
#define SLACK_MIB 32L

/* ---- frames over raw sockets --------------------------------------------- */

/* Starts a psd whose RSS is measured. Under AddressSanitizer freed blocks
 * sit in a quarantine of up to 256 MiB, so RSS would climb without any
 * retention: such a psd gets a small quarantine (without ASan the option
 * is ignored). */
static int start_measured(tu_psd *p, const char *const *args) {
  const char *old = getenv("ASAN_OPTIONS");
  char *saved = old ? strdup(old) : NULL;
  static char opts[4096];
  snprintf(opts, sizeof opts, "%s%squarantine_size_mb=1", old ? old : "",
           old && old[0] ? ":" : "");
  setenv("ASAN_OPTIONS", opts, 1);
  int rc = tu_psd_start(p, args);
  if (saved) setenv("ASAN_OPTIONS", saved, 1);
  else unsetenv("ASAN_OPTIONS");
  free(saved);
  return rc;
}

/* Header + packed msg (+ extra raw protobuf bytes), then dlen data bytes
 * from data (zeros when NULL). 0 or -1. */
static int send_frame(int fd, unsigned type, const ProtobufCMessage *msg, const void *extra,
                      size_t nextra, const void *data, uint64_t dlen) {
  size_t ml = protobuf_c_message_get_packed_size(msg);
  uint8_t *b = malloc(PS__HEADER_SIZE + ml + nextra);
  if (!b) return -1;
  ps__header_encode(b, type, (uint32_t)(ml + nextra), dlen);
  protobuf_c_message_pack(msg, b + PS__HEADER_SIZE);
  if (nextra) memcpy(b + PS__HEADER_SIZE + ml, extra, nextra);
  int rc = tu_send_all(fd, b, PS__HEADER_SIZE + ml + nextra);
  free(b);
  static const uint8_t zeros[1 << 16];
  for (uint64_t left = dlen; rc == 0 && left > 0;) {
    size_t k = left < sizeof zeros ? (size_t)left : sizeof zeros;
    rc = tu_send_all(fd, data ? (const uint8_t *)data + (dlen - left) : zeros, k);
    left -= k;
  }
  return rc;
}

/* Exactly n bytes within timeout_s (NULL buf: read and drop). 0 or -1. */
static int recv_n(int fd, void *buf, uint64_t n, double timeout_s) {
  double end = ps__now() + timeout_s;
  static uint8_t junk[1 << 16];
  while (n > 0) {
    struct pollfd pf = {fd, POLLIN, 0};
    int ms = (int)((end - ps__now()) * 1000);
    if (ms <= 0 || poll(&pf, 1, ms) <= 0) return -1;
    size_t want = buf ? (size_t)n : (n < sizeof junk ? (size_t)n : sizeof junk);
    ssize_t r = recv(fd, buf ? buf : junk, want, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r <= 0) return -1;
    if (buf) buf = (uint8_t *)buf + r;
    n -= (uint64_t)r;
  }
  return 0;
}

/* Reads frames (dropping their data) until one of type `want` arrives;
 * its protobuf part lands in meta. Its meta length, or -1 (an Error, EOF
 * or timeout). */
static long recv_until(int fd, unsigned want, uint8_t *meta, size_t cap) {
  for (;;) {
    uint8_t hb[PS__HEADER_SIZE];
    ps__frame_header h;
    char err[256];
    if (recv_n(fd, hb, sizeof hb, 20) != 0) return -1;
    if (ps__header_decode(hb, 1, &h, err, sizeof err) != 0 || h.meta_len > cap) return -1;
    if (recv_n(fd, meta, h.meta_len, 20) != 0 || recv_n(fd, NULL, h.data_len, 60) != 0)
      return -1;
    if (h.type == want) return (long)h.meta_len;
    if (h.type == PS__MSG_ERROR) {
      Ps__Error *e = ps__error__unpack(NULL, h.meta_len, meta);
      fprintf(stderr, "bounds: psd error: %s\n", e && e->message ? e->message : "?");
      if (e) ps__error__free_unpacked(e, NULL);
      return -1;
    }
  }
}

/* Connects and says Hello as worker w of nw (or as an admin tool). */
static int hello(const char *addr, int role, uint32_t w, uint32_t nw, int small_rcvbuf) {
  int fd = tu_connect(addr);
  if (fd < 0) return -1;
  if (small_rcvbuf) {
    int v = 65536;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof v);
  }
  Ps__Hello m = PS__HELLO__INIT;
  m.protocol_version = PS__PROTOCOL_VERSION;
  m.role = (Ps__Role)role;
  m.worker_index = w;
  m.num_workers = nw;
  m.num_ps = 1;
  m.max_slice_bytes = PS__MAX_SLICE_BYTES;
  m.client_id = (char *)"test_bounds";
  uint8_t meta[4096];
  if (send_frame(fd, PS__MSG_HELLO, &m.base, NULL, 0, NULL, 0) != 0 ||
      recv_until(fd, PS__MSG_HELLO_REPLY, meta, sizeof meta) < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Registers the BIG_N-element variable "big"; its slice id, or -1. */
static long register_big(int fd, uint64_t req) {
  uint64_t shape[1] = {BIG_N};
  Ps__SliceSpec sp = PS__SLICE_SPEC__INIT;
  sp.name = (char *)"big";
  sp.shape = shape;
  sp.n_shape = 1;
  sp.dtype = 1;
  sp.length = BIG_N;
  Ps__SliceSpec *sps[1] = {&sp};
  Ps__Register m = PS__REGISTER__INIT;
  m.request_id = req;
  m.n_slices = 1;
  m.slices = sps;
  uint8_t meta[4096];
  long n;
  if (send_frame(fd, PS__MSG_REGISTER, &m.base, NULL, 0, NULL, 0) != 0 ||
      (n = recv_until(fd, PS__MSG_REGISTER_REPLY, meta, sizeof meta)) < 0)
    return -1;
  Ps__RegisterReply *r = ps__register_reply__unpack(NULL, (size_t)n, meta);
  long id = r && r->n_slices == 1 ? (long)r->slices[0]->slice_id : -1;
  if (r) ps__register_reply__free_unpacked(r, NULL);
  return id;
}

/* Init (type PS__MSG_INIT) or Push of the whole slice; the data is zeros
 * (a zero gradient still makes a step). */
static int send_items(int fd, unsigned type, uint64_t req, uint64_t step, uint32_t id) {
  Ps__Item it = PS__ITEM__INIT;
  it.slice_id = id;
  it.count = BIG_N;
  Ps__Item *its[1] = {&it};
  if (type == PS__MSG_INIT) {
    Ps__Init m = PS__INIT__INIT;
    m.request_id = req;
    m.n_items = 1;
    m.items = its;
    return send_frame(fd, type, &m.base, NULL, 0, NULL, BIG_N * sizeof(float));
  }
  Ps__Push m = PS__PUSH__INIT;
  m.request_id = req;
  m.step = step;
  m.n_items = 1;
  m.items = its;
  return send_frame(fd, type, &m.base, NULL, 0, NULL, BIG_N * sizeof(float));
}

/* ---- 1: a worker that never reads its replies ---------------------------- */

/* Worker 0 pulls the 64 MiB slice ten times and never reads; worker 1's
 * pushes then update the slice, which copies out every queued reply that
 * still references it. psd's RSS may grow by at most PSD_OUT_HIGH_WATER
 * plus one reply of the slice (the one that crossed the mark), not one
 * copy per unread pull (that was 10 x 64 MiB). */
START_TEST(test_slow_reader_bounded) {
  tu_psd p;
  const char *args[] = {"--workers", "2", "--replicas-to-aggregate", "1", NULL};
  ck_assert_int_eq(start_measured(&p, args), 0);
  int slow = hello(p.addr, PS__ROLE__ROLE_WORKER, 0, 2, 1);
  int good = hello(p.addr, PS__ROLE__ROLE_WORKER, 1, 2, 0);
  ck_assert_msg(slow >= 0 && good >= 0, "handshake failed (log %s)", p.log_path);
  long id = register_big(slow, 1);
  ck_assert_msg(id >= 0 && register_big(good, 1) == id, "register failed (log %s)",
                p.log_path);
  uint8_t meta[65536];
  ck_assert_int_eq(send_items(slow, PS__MSG_INIT, 2, 0, (uint32_t)id), 0);
  ck_assert_msg(recv_until(slow, PS__MSG_ACK, meta, sizeof meta) >= 0, "init: no ack");
  /* One push first, so psd's staging buffer is part of the baseline. */
  ck_assert_int_eq(send_items(good, PS__MSG_PUSH, 2, 0, (uint32_t)id), 0);
  ck_assert(recv_until(good, PS__MSG_PUSH_REPLY, meta, sizeof meta) >= 0);
  long rss0 = tu_vm_kib(p.pid, "VmRSS:");
  for (int i = 0; i < 10; i++) {
    uint32_t ids[1] = {(uint32_t)id};
    Ps__Pull m = PS__PULL__INIT;
    m.request_id = 10 + (uint64_t)i;
    m.slice_ids = ids;
    m.n_slice_ids = 1;
    ck_assert_int_eq(send_frame(slow, PS__MSG_PULL, &m.base, NULL, 0, NULL, 0), 0);
    usleep(30 * 1000); /* separate reads: each pull is answered before the next */
  }
  for (uint64_t s = 1; s <= 5; s++) {
    ck_assert_int_eq(send_items(good, PS__MSG_PUSH, 2 + s, s, (uint32_t)id), 0);
    ck_assert_msg(recv_until(good, PS__MSG_PUSH_REPLY, meta, sizeof meta) >= 0,
                  "push %llu not answered (log %s)", (unsigned long long)s, p.log_path);
  }
  usleep(200 * 1000);
  long rss1 = tu_vm_kib(p.pid, "VmRSS:");
  long bound = (OUT_HIGH_WATER_MIB + (long)(BIG_N * sizeof(float) / MIB) + SLACK_MIB) * 1024;
  fprintf(stderr, "bounds: slow reader: psd VmRSS %ld -> %ld KiB (bound +%ld KiB)\n", rss0,
          rss1, bound);
  ck_assert_msg(rss0 > 0 && rss1 - rss0 <= bound,
                "psd grew from %ld to %ld KiB with one peer not reading (bound +%ld KiB)",
                rss0, rss1, bound);
  /* The slow peer's replies are all still deliverable once it reads. */
  /* Once it reads, every pull is answered (a reply, or a non-fatal busy
   * error): the requests left buffered while psd paused are taken up. */
  int answers = 0;
  while (answers < 10) {
    uint8_t hb[PS__HEADER_SIZE];
    ps__frame_header h;
    char err[256];
    if (recv_n(slow, hb, sizeof hb, 20) != 0 ||
        ps__header_decode(hb, 1, &h, err, sizeof err) != 0 || h.meta_len > sizeof meta ||
        recv_n(slow, meta, h.meta_len, 20) != 0 || recv_n(slow, NULL, h.data_len, 60) != 0)
      break;
    answers += h.type == PS__MSG_PULL_REPLY || h.type == PS__MSG_ERROR;
  }
  ck_assert_msg(answers == 10, "the slow reader got %d of 10 answers (log %s)", answers,
                p.log_path);
  close(slow);
  close(good);
  ck_assert_msg(tu_vm_kib(p.pid, "VmRSS:") > 0, "psd died (log %s)", p.log_path);
  tu_psd_kill(&p);
}
END_TEST

/* ---- 2: admin peers' Stats requests -------------------------------------- */

/* Admin connections held open send Stats requests padded with ~1 MiB of
 * one-byte unknown fields (each a separate protobuf-c allocation). What
 * a connection keeps between requests goes back to its initial buffers, so
 * psd's RSS grows by about one request's peak, not by one per connection. */
START_TEST(test_admin_stats_bounded) {
  enum { NCONN = 8, ROUNDS = 3 };
  tu_psd p;
  const char *args[] = {"--workers", "1", NULL};
  ck_assert_int_eq(start_measured(&p, args), 0);
  /* Field 100, varint 1: three bytes each, up to just under PS__MAX_META. */
  size_t npad = (PS__MAX_META - 64) / 3;
  uint8_t *pad = malloc(npad * 3);
  ck_assert(pad != NULL);
  for (size_t i = 0; i < npad; i++) {
    pad[3 * i] = 0xA0;
    pad[3 * i + 1] = 0x06;
    pad[3 * i + 2] = 0x01;
  }
  int fds[NCONN];
  for (int i = 0; i < NCONN; i++) {
    fds[i] = hello(p.addr, PS__ROLE__ROLE_ADMIN, 0, 0, 0);
    ck_assert_msg(fds[i] >= 0, "admin handshake failed (log %s)", p.log_path);
  }
  long rss0 = tu_vm_kib(p.pid, "VmRSS:");
  static uint8_t meta[PS__MAX_META];
  for (int r = 0; r < ROUNDS; r++)
    for (int i = 0; i < NCONN; i++) {
      Ps__Stats m = PS__STATS__INIT;
      m.request_id = 1 + (uint64_t)r;
      ck_assert_int_eq(send_frame(fds[i], PS__MSG_STATS, &m.base, pad, npad * 3, NULL, 0), 0);
      ck_assert_msg(recv_until(fds[i], PS__MSG_STATS_REPLY, meta, sizeof meta) >= 0,
                    "stats not answered (log %s)", p.log_path);
    }
  long rss1 = tu_vm_kib(p.pid, "VmRSS:");
  free(pad);
  /* One request's peak (~45 MiB of unknown-field records) plus slack;
   * before, each connection kept its own (8 x 45 MiB). */
  long bound = 96 * 1024;
  fprintf(stderr, "bounds: %d admin peers: psd VmRSS %ld -> %ld KiB (bound +%ld KiB)\n",
          NCONN, rss0, rss1, bound);
  ck_assert_msg(rss0 > 0 && rss1 - rss0 <= bound,
                "psd grew from %ld to %ld KiB serving %d admin peers (bound +%ld KiB)", rss0,
                rss1, NCONN, bound);
  for (int i = 0; i < NCONN; i++) close(fds[i]);
  tu_psd_kill(&p);
}
END_TEST

/* ---- --max-memory: per-slice tables and the cgroup default ---------------- */

/* Makes a 1-worker client of p over the given transport. */
static ps_client *client_via(tu_psd *p, ps_transport transport) {
  static char hosts[1][64];
  static const char *hp[1];
  tu_hosts(p, 1, hosts, hp);
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.transport = transport;
  ps_client *c = NULL;
  char err[512];
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "%s", err);
  return c;
}

/* One-element variables cost 8 tensor bytes but hundreds in tables: the
 * limit counts the tables, so it is reached after a few hundred, not
 * 25,000. */
START_TEST(test_max_memory_counts_tables) {
  tu_psd p;
  const char *args[] = {"--workers", "1", "--max-memory", "200000", NULL};
  ck_assert_int_eq(tu_psd_start(&p, args), 0);
  ps_client *c = client_via(&p, PS_TRANSPORT_DEFAULT);
  int64_t shape[1] = {1};
  int i, rc = 0;
  for (i = 0; i < 5000 && rc == 0; i++) {
    char name[32];
    snprintf(name, sizeof name, "v%d", i);
    ps_var *v;
    rc = ps_client_var_create(c, name, shape, 1, NULL, NULL, &v);
  }
  fprintf(stderr, "bounds: tiny variables: %d fit, then: %s\n", i - 1, ps_client_errmsg(c));
  ck_assert_msg(rc == PS_ETOOBIG && i < 2000, "variable %d gave %d: %s", i, rc,
                ps_client_errmsg(c));
  ck_assert_msg(strstr(ps_client_errmsg(c), "per-slice tables"), "%s", ps_client_errmsg(c));
  ps_client_destroy(c);
  tu_psd_kill(&p);
}
END_TEST

/* ---- a table job's staging ------------------------------------------------- */

/* A table push over PS__MAX_SLICE_BYTES (1,100 keys of 16,384 floats:
 * 72 MB, over TCP) is staged in a buffer psd keeps between the steps
 * that use it, with ten small pulls between them (as a pull in pieces
 * sends): the next step faults in no fresh 72 MB (it did, some 18,000
 * pages a step, while each such frame gave its staging back, and again
 * while eight small frames in a row did), and psd gives it back once the
 * connection has not used it for 2 s (PSD_STAGE_IDLE_S). */
START_TEST(test_table_push_staging_kept) {
  enum { N = 1100, DIM = 16384 };
  tu_psd p;
  const char *args[] = {"--workers", "1", NULL};
  ck_assert_int_eq(start_measured(&p, args), 0);
  /* Over TCP whatever the run forces: psd stages what comes over TCP
   * (through a ring it reads a push where it lies). */
  ps_client *c = client_via(&p, PS_TRANSPORT_TCP);
  ps_table_config g;
  ps_table_config_init(&g);
  g.dim = DIM;
  g.capacity = 2 * N;
  g.opt = PS_TOPT_SGD;
  g.lr = 0.1;
  ps_table *t = NULL;
  ck_assert_msg(ps_client_table_create(c, "wide", &g, &t) == 0, "%s", ps_client_errmsg(c));
  uint64_t *keys = malloc(N * sizeof *keys);
  float *grads = calloc((size_t)N * DIM, sizeof *grads);
  ck_assert(keys && grads);
  for (int i = 0; i < N; i++) keys[i] = (uint64_t)i + 1;
  long faults[3];
  uint64_t step = 0;
  for (int s = 0; s < 3; s++) {
    faults[s] = (long)tu_proc_stat(p.pid, 10);
    int stale = 0, rc = 0;
    for (int i = 0; i < 10 && !rc; i++)
      rc = ps_table_pull(t, 0, keys + 4 * i, 4, grads, PS_TABLE_READ_ONLY, NULL);
    if (!rc) rc = ps_table_add_grad(t, keys, N, grads);
    if (!rc) rc = ps_client_step(c, &step, &stale);
    ck_assert_msg(rc == 0, "step %d: %s", s, ps_client_errmsg(c));
  }
  long after = (long)tu_proc_stat(p.pid, 10), rss1 = tu_vm_kib(p.pid, "VmRSS:");
  const long pages = (long)((uint64_t)N * (DIM * sizeof(float) + sizeof(uint64_t)) / 4096);
  sleep(4); /* PSD_STAGE_IDLE_S, and psd's once-a-second tick */
  long rss2 = tu_vm_kib(p.pid, "VmRSS:");
  fprintf(stderr, "bounds: 72 MB table pushes: psd minor faults per step %ld, %ld, %ld "
          "(%ld pages a push); VmRSS %ld KiB, %ld after 4 s idle\n", faults[1] - faults[0],
          faults[2] - faults[1], after - faults[2], pages, rss1, rss2);
  free(keys);
  free(grads);
  ps_client_destroy(c);
  tu_psd_kill(&p);
  ck_assert_msg(faults[0] >= 0 && after - faults[2] < pages / 4 &&
                    faults[2] - faults[1] < pages / 4,
                "psd faulted in %ld and %ld pages for the second and third 72 MB pushes "
                "(%ld pages each): their staging was not kept", faults[2] - faults[1],
                after - faults[2], pages);
  ck_assert_msg(rss1 - rss2 > pages * 4 / 2,
                "psd's VmRSS went from %ld to %ld KiB in 4 s idle: the 72 MB staging was "
                "not given back", rss1, rss2);
}
END_TEST

/* With no --max-memory, a cgroup limit below RAM sets the default (here a
 * fake v2 tree of 100 MB): psd says so, and refuses a variable past 90%. */
START_TEST(test_max_memory_from_cgroup) {
  char root[600], path[700];
  snprintf(root, sizeof root, "%s/fake-cgroup", tu_tmpdir());
  const char *dirs[] = {"", "/proc", "/proc/self", "/sys", "/sys/fs", "/sys/fs/cgroup"};
  for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
    snprintf(path, sizeof path, "%s%s", root, dirs[i]);
    mkdir(path, 0700);
  }
  const char *files[][2] = {{"/proc/self/cgroup", "0::/\n"},
                            {"/sys/fs/cgroup/memory.max", "100000000\n"}};
  for (int i = 0; i < 2; i++) {
    snprintf(path, sizeof path, "%s%s", root, files[i][0]);
    FILE *f = fopen(path, "w");
    ck_assert(f != NULL);
    fputs(files[i][1], f);
    fclose(f);
  }
  setenv("PSD_CGROUP_ROOT", root, 1);
  tu_psd p;
  const char *args[] = {"--workers", "1", NULL};
  int rc = tu_psd_start(&p, args);
  unsetenv("PSD_CGROUP_ROOT");
  ck_assert_int_eq(rc, 0);
  ps_client *c = client_via(&p, PS_TRANSPORT_DEFAULT);
  ck_assert_msg(tu_log_contains(&p, "slices may take 90000000 bytes (90% of the cgroup limit"),
                "no cgroup line in %s", p.log_path);
  int64_t big[1] = {12 << 20}, small[1] = {1000}; /* 96 MiB of params + sums */
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "big", big, 1, NULL, NULL, &v), PS_ETOOBIG);
  ck_assert_int_eq(ps_client_var_create(c, "small", small, 1, NULL, NULL, &v), 0);
  ps_client_destroy(c);
  tu_psd_kill(&p);
}
END_TEST

/* ---- 3: a fake psd hands the client a huge slice id ----------------------- */

typedef struct fake_psd {
  int lfd;            /* listening socket */
  uint32_t bad_id;    /* slice id its RegisterReply names */
} fake_psd;

/* Accepts one client, challenges it and answers its Hello, then answers its Register with
 * bad_id for every slice; keeps the connection until the client closes. */
static void *fake_main(void *arg) {
  fake_psd *f = arg;
  int fd = accept(f->lfd, NULL, NULL);
  if (fd < 0) return NULL;
  static uint8_t meta[PS__MAX_META];
  /* Every psd opens with a Challenge (no secret, no MUNGE here). */
  uint8_t nonce[PS__NONCE_BYTES] = {0};
  Ps__Challenge ch = PS__CHALLENGE__INIT;
  ch.protocol_version = PS__PROTOCOL_VERSION;
  ch.nonce.data = nonce;
  ch.nonce.len = sizeof nonce;
  send_frame(fd, PS__MSG_CHALLENGE, &ch.base, NULL, 0, NULL, 0);
  long n = recv_until(fd, PS__MSG_HELLO, meta, sizeof meta);
  Ps__HelloReply hr = PS__HELLO_REPLY__INIT;
  hr.num_ps = 1;
  hr.num_workers = 1;
  if (n >= 0) send_frame(fd, PS__MSG_HELLO_REPLY, &hr.base, NULL, 0, NULL, 0);
  n = n < 0 ? -1 : recv_until(fd, PS__MSG_REGISTER, meta, sizeof meta);
  Ps__Register *rg = n < 0 ? NULL : ps__register__unpack(NULL, (size_t)n, meta);
  if (rg) {
    Ps__SliceState st = PS__SLICE_STATE__INIT;
    st.slice_id = f->bad_id;
    Ps__SliceState *sps[1] = {&st};
    Ps__RegisterReply rr = PS__REGISTER_REPLY__INIT;
    rr.request_id = rg->request_id;
    rr.n_slices = 1;
    rr.slices = sps;
    send_frame(fd, PS__MSG_REGISTER_REPLY, &rr.base, NULL, 0, NULL, 0);
    ps__register__free_unpacked(rg, NULL);
  }
  uint8_t junk[4096];
  while (recv(fd, junk, sizeof junk, 0) > 0) {
  }
  close(fd);
  return NULL;
}

START_TEST(test_client_rejects_huge_slice_id) {
  fake_psd f = {socket(AF_INET, SOCK_STREAM, 0), 0xFFFFFFF0u};
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t sl = sizeof sa;
  ck_assert(f.lfd >= 0 && bind(f.lfd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
            listen(f.lfd, 4) == 0 && getsockname(f.lfd, (struct sockaddr *)&sa, &sl) == 0);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(sa.sin_port));
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, fake_main, &f), 0);
  long rss0 = tu_vm_kib(getpid(), "VmRSS:");
  const char *hp[1] = {addr};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.connect_timeout_ms = 5000;
  cfg.request_timeout_ms = 5000;
  cfg.transport = PS_TRANSPORT_TCP; /* the fake server offers no shared memory */
  ps_client *c = NULL;
  char err[512];
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "%s", err);
  int64_t shape[1] = {16};
  ps_var *v = NULL;
  int rc = ps_client_var_create(c, "v", shape, 1, NULL, NULL, &v);
  long rss1 = tu_vm_kib(getpid(), "VmRSS:");
  fprintf(stderr, "bounds: client: %s\n", ps_client_errmsg(c));
  ck_assert_msg(rc == PS_EPROTO, "var create gave %d (%s)", rc, ps_client_errmsg(c));
  ck_assert_msg(strstr(ps_client_errmsg(c), addr) && strstr(ps_client_errmsg(c), "4294967280"),
                "the message names neither the server nor the id: %s", ps_client_errmsg(c));
  /* The id would have sized a 16 GiB map. */
  ck_assert_msg(rss1 - rss0 < 64 * 1024, "client RSS grew from %ld to %ld KiB", rss0, rss1);
  ps_client_destroy(c);
  pthread_join(th, NULL);
  close(f.lfd);
}
END_TEST

Suite *suite_bounds(void) {
  Suite *s = suite_create("bounds");
  TCase *tc = tcase_create("bounds");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_slow_reader_bounded);
  tcase_add_test(tc, test_admin_stats_bounded);
  tcase_add_test(tc, test_client_rejects_huge_slice_id);
  tcase_add_test(tc, test_max_memory_counts_tables);
  tcase_add_test(tc, test_max_memory_from_cgroup);
  tcase_add_test(tc, test_table_push_staging_kept);
  suite_add_tcase(s, tc);
  return s;
}
