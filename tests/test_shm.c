/* test_shm.c - the shared-memory transport (docs/protocol.md §1a).
 *
 * shm: the segment module (wire/shm.c) on its own: ring arithmetic under
 * random producer/consumer interleavings, bounds of positions, sealing
 * and what psd's check refuses, the handover message, the header flag.
 * shm_hostile: a real psd and raw peers that hand over bad segments,
 * reuse tokens, send positions outside the ring, truncate and scribble
 * over their segment while an honest worker trains beside them.
 * shm_users: a peer of another uid (nobody) is refused (needs root). */
#define _GNU_SOURCE
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "admin.h"
#include "ps.pb-c.h"
#include "testutil.h"
#include "wire.h"

/* ---- units ------------------------------------------------------------- */

/* Random producer/consumer runs over a small ring: every reservation lies
 * inside the ring and never overlaps a frame the consumer has not
 * finished; a full ring refuses instead. */
START_TEST(test_ring_random) {
  unsigned seed = tu_seed("shm ring");
  srand(seed);
  enum { SIZE = 64 << 10, MAXQ = 512 };
  static uint8_t buf[SIZE];
  ps__shm_ring r = {buf, SIZE, 0, 0};
  uint64_t qpos[MAXQ], qlen[MAXQ], done = 0;
  int qn = 0, qh = 0, placed = 0, refused = 0;
  for (int it = 0; it < 50000; it++) {
    if (qn && rand() % 3 == 0) { /* the consumer finishes the oldest frame */
      done = qpos[qh] + qlen[qh];
      qh = (qh + 1) % MAXQ;
      qn--;
      continue;
    }
    if (qn == MAXQ) continue;
    uint64_t len = 4 * (1 + (uint64_t)rand() % (rand() % 4 ? 512 : SIZE / 4));
    uint64_t pos;
    uint8_t *p = ps__shm_reserve(&r, done, len, &pos);
    if (!p) {
      refused++;
      continue;
    }
    placed++;
    /* Plain tests in the loop (Check's asserts are slow per call). */
    if (p < buf || p + len > buf + SIZE || ps__shm_locate(&r, pos, len) != p)
      ck_abort_msg("seed %u: reservation outside the ring or not where pos says", seed);
    uint64_t off = (uint64_t)(p - buf);
    for (int j = 0; j < qn; j++) {
      int i = (qh + j) % MAXQ;
      uint64_t o = qpos[i] % SIZE;
      if (!(off + len <= o || o + qlen[i] <= off))
        ck_abort_msg("seed %u: frame [%llu,+%llu) overwrites unfinished [%llu,+%llu)", seed,
                     (unsigned long long)off, (unsigned long long)len, (unsigned long long)o,
                     (unsigned long long)qlen[i]);
    }
    int t = (qh + qn) % MAXQ;
    qpos[t] = pos;
    qlen[t] = len;
    qn++;
  }
  ck_assert_msg(placed > 1000 && refused > 100, "seed %u: placed %d refused %d", seed, placed,
                refused);
}
END_TEST

/* An empty ring starts again at its first byte when the frame would not
 * fit before the lap's end; garbage done words (past the head) count as a
 * full ring, and one below the last restart as that restart. */
START_TEST(test_ring_edges) {
  static uint8_t buf[65536];
  ps__shm_ring r = {buf, sizeof buf, 0, 0};
  uint64_t pos;
  ck_assert_ptr_eq(ps__shm_reserve(&r, 0, 1000, &pos), buf);
  ck_assert_ptr_eq(ps__shm_reserve(&r, 0, 1000, &pos), buf + 1024); /* 64-aligned */
  ck_assert_ptr_null(ps__shm_reserve(&r, 0, 65536, &pos));   /* not empty: no room */
  ck_assert_ptr_eq(ps__shm_reserve(&r, pos + 1000, 65536, &pos), buf); /* empty: from 0 */
  ck_assert_uint_eq(pos % sizeof buf, 0);
  uint64_t head = r.head;
  ck_assert_ptr_null(ps__shm_reserve(&r, head + 64, 4, &pos));          /* past the head */
  ck_assert_ptr_null(ps__shm_reserve(&r, UINT64_MAX, 4, &pos));
  ck_assert_ptr_null(ps__shm_reserve(&r, 0, 65536 + 4, &pos));          /* bigger than it */
  ck_assert_ptr_null(ps__shm_reserve(&r, head, 0, &pos));               /* nothing */
  ck_assert_uint_eq(r.head, head); /* refusals change nothing */
  /* Consumer side: positions and lengths from a peer are bounded. */
  ck_assert_ptr_null(ps__shm_locate(&r, 65536 - 4, 8));
  ck_assert_ptr_null(ps__shm_locate(&r, UINT64_MAX, 4));
  ck_assert_ptr_null(ps__shm_locate(&r, 0, 65540));
  ck_assert_ptr_null(ps__shm_locate(&r, 0, UINT64_MAX));
  ck_assert_ptr_eq(ps__shm_locate(&r, 65536 * 7 + 8, 65528), buf + 8);
}
END_TEST

/* A ring with room never refuses: frames of an eighth of the ring, at
 * most two unfinished at once, the consumer finishing all of them, some
 * or none before each reservation (at random; the ring is sometimes empty
 * and sometimes not): every reservation succeeds and none overlaps an
 * unfinished frame. (The ring once restarted at a lap's first byte when
 * empty but then judged the room from the consumer's done word, a lap
 * short: the next frame reserved before the consumer finished the first
 * was refused, and from then on most of every step went over TCP.) */
START_TEST(test_ring_keeps_up) {
  unsigned seed = tu_seed("shm ring keeps up");
  srand(seed);
  /* Frames of PS__SHM_RESTART_BYTES: an empty ring restarts after each. */
  enum { SIZE = 8 << 20, LEN = SIZE / 8 };
  ck_assert_uint_eq(LEN, PS__SHM_RESTART_BYTES);
  static uint8_t buf[SIZE];
  ps__shm_ring r = {buf, SIZE, 0, 0};
  uint64_t q[2] = {0, 0}, done = 0;
  int qn = 0, restarts = 0;
  for (int i = 0; i < 5000; i++) {
    int finish = qn == 2 ? 1 + rand() % 2 : rand() % (qn + 1);
    for (int k = 0; k < finish; k++) { /* the consumer finishes the oldest */
      done = q[0] + LEN;
      q[0] = q[1];
      qn--;
    }
    uint64_t pos;
    uint8_t *p = ps__shm_reserve(&r, done, LEN, &pos);
    if (!p)
      ck_abort_msg("seed %u: frame %d refused with %d unfinished (head %llu, done %llu)", seed,
                   i, qn, (unsigned long long)r.head, (unsigned long long)done);
    for (int j = 0; j < qn; j++)
      if (!(pos % SIZE + LEN <= q[j] % SIZE || q[j] % SIZE + LEN <= pos % SIZE))
        ck_abort_msg("seed %u: frame %d overlaps an unfinished one", seed, i);
    restarts += pos % SIZE == 0;
    q[qn++] = pos;
  }
  ck_assert_msg(restarts > 100, "seed %u: only %d restarts at the ring's start", seed,
                restarts);
}
END_TEST

/* The handover exchange (ps__shm_handover) against a peer that answers
 * (0), one that never does (1: the message went out, so PS_ETIMEDOUT: psd
 * may hold the segment), one that closed unanswered (2: PS_EIO, nothing
 * was taken) and one that answered and closed before our message went
 * (3: psd's refusal at accept, whose answer still counts). */
START_TEST(test_handover_answers) {
  uint8_t msg[PS__SHM_HELLO_BYTES] = {0}, out[PS__SHM_REPLY_MAX];
  char why[PS__SHM_REPLY_MAX];
  for (int mode = 0; mode < 4; mode++) {
    int sv[2];
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    struct timeval tv = {0, 200000};
    setsockopt(sv[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    size_t len = ps__shm_reply_encode(out, PS_EAUTH, "not you");
    if (mode == 0 || mode == 3) ck_assert_int_eq(send(sv[1], out, len, 0), (ssize_t)len);
    if (mode >= 2) close(sv[1]);
    int st = ps__shm_handover(sv[0], msg, sizeof msg, NULL, 0, why, sizeof why);
    if (mode == 0 || mode == 3) {
      ck_assert_msg(st == PS_EAUTH && !strcmp(why, "not you"), "mode %d: %d %s", mode, st, why);
    } else if (mode == 1) {
      ck_assert_msg(st == PS_ETIMEDOUT && strstr(why, "no answer"), "%d %s", st, why);
    } else {
      ck_assert_msg(st == PS_EIO, "%d %s", st, why);
    }
    close(sv[0]);
    if (mode < 2) close(sv[1]);
  }
}
END_TEST

/* A created segment is sealed: its owner cannot shrink or grow it, psd's
 * check accepts it, and both mappings see the same bytes. */
START_TEST(test_create_attach) {
  char err[400];
  ps__shm w, d;
  uint64_t ring = PS__SHM_RING_MIN;
  int fd = ps__shm_create(&w, ring, 2 * ring, err, sizeof err);
  ck_assert_msg(fd >= 0, "%s", err);
  ck_assert_int_eq(ftruncate(fd, 4096), -1);
  ck_assert_int_eq(errno, EPERM);
  ck_assert_int_eq(ftruncate(fd, 1 << 30), -1);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1); /* F_SEAL_SEAL */
  ck_assert_int_eq(ps__shm_attach(&d, fd, ring, 2 * ring, err, sizeof err), 0);
  w.push.base[5] = 42;
  ck_assert_int_eq(d.push.base[5], 42);
  ps__shm_store(d.push_done, 777);
  ck_assert_uint_eq(ps__shm_load(w.push_done), 777);
  ck_assert_ptr_eq(d.pull.base, d.map + 4096 + ring);
  ck_assert_uint_eq(d.map_len, 4096 + 3 * ring);
  /* Asking for more than the memfd holds is refused. */
  ps__shm x;
  ck_assert_int_eq(ps__shm_attach(&x, fd, ring, 4 * ring, err, sizeof err), PS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err, "bytes"));
  ps__shm_unmap(&d);
  ps__shm_unmap(&w);
  close(fd);
}
END_TEST

/* What psd's check refuses, each with a sentence. */
START_TEST(test_attach_refuses) {
  char err[400];
  ps__shm s;
  uint64_t ring = PS__SHM_RING_MIN, total = 4096 + 2 * ring;
  /* Unsealed: its owner could truncate it under psd (SIGBUS). */
  int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_eq(ftruncate(fd, (off_t)total), 0);
  ck_assert_int_eq(ps__shm_attach(&s, fd, ring, ring, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "sealed") != NULL, "%s", err);
  /* Sealed against writing: psd could not write its pull ring. */
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW |
                                              F_SEAL_SEAL), 0);
  ck_assert_int_eq(ps__shm_attach(&s, fd, ring, ring, err, sizeof err), PS_EINVAL);
  close(fd);
  /* Sealed but without F_SEAL_SEAL: a write seal could come later. */
  fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_eq(ftruncate(fd, (off_t)total), 0);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  ck_assert_int_eq(ps__shm_attach(&s, fd, ring, ring, err, sizeof err), PS_EINVAL);
  close(fd);
  /* Not a memfd: a pipe, a file of the test's directory. */
  int pp[2];
  ck_assert_int_eq(pipe(pp), 0);
  ck_assert_int_eq(ps__shm_attach(&s, pp[0], ring, ring, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "memfd") != NULL, "%s", err);
  close(pp[0]);
  close(pp[1]);
  char path[600];
  snprintf(path, sizeof path, "%s/plain", tu_tmpdir());
  fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ck_assert_int_eq(ftruncate(fd, (off_t)total), 0);
  ck_assert_int_eq(ps__shm_attach(&s, fd, ring, ring, err, sizeof err), PS_EINVAL);
  close(fd);
  /* Ring sizes out of range or not whole pages. */
  ck_assert_int_eq(ps__shm_check_sizes(ring, ring + 1, err, sizeof err), PS_EINVAL);
  ck_assert_int_eq(ps__shm_check_sizes(PS__SHM_RING_MAX + 4096, ring, err, sizeof err),
                   PS_EINVAL);
  ck_assert_int_eq(ps__shm_check_sizes(0, ring, err, sizeof err), PS_EINVAL);
  ck_assert_ptr_null(s.map);
}
END_TEST

START_TEST(test_hello_and_header) {
  uint8_t tok[PS__SHM_TOKEN_BYTES], tok2[PS__SHM_TOKEN_BYTES], msg[PS__SHM_HELLO_BYTES];
  for (unsigned i = 0; i < sizeof tok; i++) tok[i] = (uint8_t)(i * 7);
  ps__shm_hello_encode(msg, tok, 1 << 20, 2 << 20);
  uint64_t a, b;
  char err[300];
  ck_assert_int_eq(ps__shm_hello_decode(msg, sizeof msg, tok2, &a, &b, err, sizeof err), 0);
  ck_assert_mem_eq(tok, tok2, sizeof tok);
  ck_assert_uint_eq(a, 1 << 20);
  ck_assert_uint_eq(b, 2 << 20);
  ck_assert_int_eq(ps__shm_hello_decode(msg, sizeof msg - 1, tok2, &a, &b, err, sizeof err),
                   PS_EPROTO);
  msg[0] ^= 1;
  ck_assert_int_eq(ps__shm_hello_decode(msg, sizeof msg, tok2, &a, &b, err, sizeof err),
                   PS_EPROTO);
  /* The header flag: only PUSH, INIT, PULL_REPLY, TABLE_PUSH and
   * TABLE_PULL_REPLY (2.9) with data, after the handshake; no other bit. */
  uint8_t h[PS__HEADER_SIZE];
  ps__frame_header fh;
  ps__header_encode_flags(h, PS__MSG_PUSH, 10, 64, PS__FLAG_SHM);
  ck_assert_int_eq(ps__header_decode(h, 1, &fh, err, sizeof err), 0);
  ck_assert_uint_eq(fh.flags, PS__FLAG_SHM);
  ck_assert_uint_eq(ps__frame_meta_bytes(&fh), 10 + PS__SHM_DESC_BYTES);
  ck_assert_int_eq(ps__header_decode(h, 0, &fh, err, sizeof err), PS_EPROTO);
  ps__header_encode_flags(h, PS__MSG_PULL, 10, 0, PS__FLAG_SHM);
  ck_assert_int_eq(ps__header_decode(h, 1, &fh, err, sizeof err), PS_EPROTO);
  ps__header_encode_flags(h, PS__MSG_TABLE_PUSH, 10, 64, PS__FLAG_SHM);
  ck_assert_int_eq(ps__header_decode(h, 1, &fh, err, sizeof err), 0);
  ps__header_encode_flags(h, PS__MSG_TABLE_PULL_REPLY, 10, 64, PS__FLAG_SHM);
  ck_assert_int_eq(ps__header_decode(h, 1, &fh, err, sizeof err), 0);
  ps__header_encode_flags(h, PS__MSG_TABLE_PULL, 10, 64, PS__FLAG_SHM);
  ck_assert_int_eq(ps__header_decode(h, 1, &fh, err, sizeof err), PS_EPROTO);
  ps__header_encode_flags(h, PS__MSG_TABLE_PUSH, 10, 0, PS__FLAG_SHM);
  ck_assert_int_eq(ps__header_decode(h, 1, &fh, err, sizeof err), PS_EPROTO);
  ps__header_encode_flags(h, PS__MSG_PUSH, 10, 0, PS__FLAG_SHM);
  ck_assert_int_eq(ps__header_decode(h, 1, &fh, err, sizeof err), PS_EPROTO);
  ps__header_encode_flags(h, PS__MSG_PULL_REPLY, 10, 64, 0x2);
  ck_assert_int_eq(ps__header_decode(h, 1, &fh, err, sizeof err), PS_EPROTO);
}
END_TEST

Suite *suite_shm(void) {
  Suite *s = suite_create("shm");
  TCase *tc = tcase_create("segment");
  tcase_add_test(tc, test_ring_random);
  tcase_add_test(tc, test_ring_edges);
  tcase_add_test(tc, test_ring_keeps_up);
  tcase_add_test(tc, test_handover_answers);
  tcase_add_test(tc, test_create_attach);
  tcase_add_test(tc, test_attach_refuses);
  tcase_add_test(tc, test_hello_and_header);
  suite_add_tcase(s, tc);
  return s;
}

/* ---- a real psd and raw peers ------------------------------------------ */

enum { NV = 4096 }; /* floats of the test variable */

/* A raw worker connection: handshake done, the HelloReply kept. */
typedef struct raw {
  int fd;
  Ps__HelloReply *hr;
  ps__shm shm;
} raw;

static void raw_open(raw *r, const char *addr, uint32_t worker) {
  memset(r, 0, sizeof *r);
  r->fd = tu_connect(addr);
  ck_assert_int_ge(r->fd, 0);
  Ps__Hello h = PS__HELLO__INIT;
  h.protocol_version = PS__PROTOCOL_VERSION;
  h.role = PS__ROLE__ROLE_WORKER;
  h.worker_index = worker;
  h.num_workers = 2;
  h.num_ps = 1;
  h.async_mode = 1;
  h.split_threshold = 1 << 20;
  h.max_slice_bytes = 4 << 20;
  ps__auth au = {NULL, 0, 0, NULL, -1, -1};
  char err[600];
  int rc = ps__handshake(r->fd, &au, &h, "psd", ps__now() + 10, &r->hr, err, sizeof err);
  ck_assert_msg(rc == 0, "handshake: %s", err);
  ck_assert_msg(r->hr->shm_socket && r->hr->shm_socket[0], "psd offers no shared memory");
  ck_assert_uint_eq(r->hr->shm_token.len, PS__SHM_TOKEN_BYTES);
}

static void raw_close(raw *r) {
  if (r->fd >= 0) close(r->fd);
  if (r->hr) ps__hello_reply__free_unpacked(r->hr, NULL);
  ps__shm_unmap(&r->shm);
  r->fd = -1;
  r->hr = NULL;
}

/* Sends a handover of fds[0..nfds) with token to psd's socket `name`;
 * returns psd's status and its sentence in why. */
/* A connection to psd's handover socket `name` whose reads wait at most
 * timeout_s; -1 if connect fails. */
static int gate_open(const char *name, int timeout_s) {
  int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  memcpy(a.sun_path + 1, name, strlen(name));
  struct timeval tv = {timeout_s, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(s, (struct sockaddr *)&a,
              (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name))) != 0) {
    close(s);
    return -1;
  }
  return s;
}

/* Sends a handover of fds[0..nfds) with token on the gate connection s
 * (closed after); returns psd's status and its sentence in why. */
static int handover_on(int s, const uint8_t *token, uint64_t push, uint64_t pull,
                       const int *fds, int nfds, char *why, size_t whylen) {
  uint8_t msg[PS__SHM_HELLO_BYTES];
  ps__shm_hello_encode(msg, token, push, pull);
  int st = ps__shm_handover(s, msg, sizeof msg, fds, nfds, why, whylen);
  close(s);
  ck_assert_msg(st != PS_EIO, "no answer from psd's handover socket: %s", why);
  return st;
}

/* The same on a new connection to psd's socket `name`. */
static int handover(const char *name, const uint8_t *token, uint64_t push, uint64_t pull,
                    const int *fds, int nfds, char *why, size_t whylen) {
  int s = gate_open(name, 5);
  ck_assert_int_ge(s, 0);
  return handover_on(s, token, push, pull, fds, nfds, why, whylen);
}

/* Hands r's psd a proper segment (64 KiB rings): 0 or psd's status. */
static int raw_attach(raw *r, char *why, size_t whylen) {
  int fd = ps__shm_create(&r->shm, PS__SHM_RING_MIN, PS__SHM_RING_MIN, why, whylen);
  ck_assert_int_ge(fd, 0);
  int rc = handover(r->hr->shm_socket, r->hr->shm_token.data, PS__SHM_RING_MIN,
                    PS__SHM_RING_MIN, &fd, 1, why, whylen);
  close(fd);
  return rc;
}

/* Reads frames until an Error arrives (its code; message into msg) or
 * the peer closes (0). Data parts on the socket are skipped. With count,
 * frames of count_type are counted there, and it returns 0 once want of
 * them came. */
static int raw_read(raw *r, unsigned count_type, int want, int *count, char *msg,
                    size_t msglen, double timeout_s) {
  double end = ps__now() + timeout_s;
  uint8_t hb[PS__HEADER_SIZE];
  static uint8_t body[1 << 20];
  while (ps__now() < end) {
    size_t got = 0;
    while (got < sizeof hb) {
      ssize_t n = recv(r->fd, hb + got, sizeof hb - got, 0);
      if (n <= 0) return 0;
      got += (size_t)n;
    }
    ps__frame_header fh;
    char err[300];
    if (ps__header_decode(hb, 1, &fh, err, sizeof err) != 0) return 0;
    uint64_t left = ps__frame_meta_bytes(&fh) + ((fh.flags & PS__FLAG_SHM) ? 0 : fh.data_len);
    while (left) {
      size_t chunk = left < sizeof body ? (size_t)left : sizeof body;
      ssize_t n = recv(r->fd, body, chunk, 0);
      if (n <= 0) return 0;
      left -= (uint64_t)n;
    }
    if (count && fh.type == count_type && ++*count == want) return 0;
    if (fh.type == PS__MSG_ERROR) {
      Ps__Error *e = ps__error__unpack(NULL, fh.meta_len, body);
      ck_assert_ptr_nonnull(e);
      snprintf(msg, msglen, "%s", e->message ? e->message : "");
      int code = e->code;
      ps__error__free_unpacked(e, NULL);
      return code;
    }
  }
  return 0;
}

static int raw_error(raw *r, char *msg, size_t msglen, double timeout_s) {
  return raw_read(r, 0, 0, NULL, msg, msglen, timeout_s);
}

static void raw_send(raw *r, ps__outq *q) {
  ck_assert_int_eq(ps__outq_write(q, r->fd), 0);
  ck_assert(!ps__outq_pending(q));
}

/* A worker through libpsclient with the transport given. */
static ps_client *client(const char *addr, int worker, int transport, char *err, size_t len,
                         int *rc) {
  const char *hosts[1] = {addr};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hosts;
  cfg.num_ps = 1;
  cfg.worker_index = worker;
  cfg.num_workers = 2;
  cfg.async_mode = 1;
  cfg.connect_timeout_ms = 5000;
  cfg.request_timeout_ms = 10000;
  cfg.transport = transport;
  ps_client *c = NULL;
  *rc = ps_client_create(&cfg, &c, err, len);
  return c;
}

static void start_psd(tu_psd *p, const char *transport) {
  const char *args[] = {"--workers", "2", "--mode", "async", "--transport", transport,
                        "--grace-period", "60", NULL};
  ck_assert_int_eq(tu_psd_start(p, args), 0);
}

/* Forced shm fails clearly against a psd that offers none; auto takes TCP
 * and says so; against a psd that offers it both use the segment. */
START_TEST(test_forced_and_auto) {
  char err[600];
  int rc;
  tu_psd p;
  start_psd(&p, "tcp");
  ps_client *c = client(p.addr, 0, PS_TRANSPORT_SHM, err, sizeof err, &rc);
  ck_assert_ptr_null(c);
  ck_assert_int_eq(rc, PS_EUNSUPPORTED);
  ck_assert_msg(strstr(err, "offers no shared memory") && strstr(err, p.addr), "%s", err);
  c = client(p.addr, 0, PS_TRANSPORT_AUTO, err, sizeof err, &rc);
  ck_assert_msg(c, "%s", err);
  ck_assert_str_eq(ps_client_transport(c, 0), "tcp");
  ps_client_destroy(c);
  tu_psd_kill(&p);
  start_psd(&p, "shm");
  c = client(p.addr, 0, PS_TRANSPORT_SHM, err, sizeof err, &rc);
  ck_assert_msg(c, "%s", err);
  ck_assert_str_eq(ps_client_transport(c, 0), "shm");
  ck_assert_ptr_null(ps_client_transport(c, 1));
  ck_assert(tu_log_contains(&p, "tensors go through shared memory"));
  ps_client_destroy(c);
  c = client(p.addr, 1, PS_TRANSPORT_TCP, err, sizeof err, &rc);
  ck_assert_msg(c, "%s", err);
  ck_assert_str_eq(ps_client_transport(c, 0), "tcp");
  ps_client_destroy(c);
  tu_psd_kill(&p);
}
END_TEST

/* Bad handovers are refused with a reason, and psd goes on serving. */
START_TEST(test_handover_refused) {
  tu_psd p;
  start_psd(&p, "auto");
  char why[600];
  raw r;
  raw_open(&r, p.addr, 1);
  /* An unsealed memfd: refused, and the token is spent. */
  int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_eq(ftruncate(fd, 4096 + 2 * PS__SHM_RING_MIN), 0);
  int st = handover(r.hr->shm_socket, r.hr->shm_token.data, PS__SHM_RING_MIN,
                    PS__SHM_RING_MIN, &fd, 1, why, sizeof why);
  ck_assert_int_eq(st, PS_EINVAL);
  ck_assert_msg(strstr(why, "sealed"), "%s", why);
  st = raw_attach(&r, why, sizeof why);
  ck_assert_int_eq(st, PS_EAUTH);
  ck_assert_msg(strstr(why, "token"), "%s", why);
  raw_close(&r);
  /* No descriptor, or two; a made-up token; bad ring sizes. */
  raw_open(&r, p.addr, 1);
  st = handover(r.hr->shm_socket, r.hr->shm_token.data, PS__SHM_RING_MIN, PS__SHM_RING_MIN,
                NULL, 0, why, sizeof why);
  ck_assert_int_eq(st, PS_EINVAL);
  raw_close(&r);
  raw_open(&r, p.addr, 1);
  int two[2] = {fd, fd};
  st = handover(r.hr->shm_socket, r.hr->shm_token.data, PS__SHM_RING_MIN, PS__SHM_RING_MIN,
                two, 2, why, sizeof why);
  ck_assert_int_eq(st, PS_EINVAL);
  raw_close(&r);
  raw_open(&r, p.addr, 1);
  uint8_t fake[PS__SHM_TOKEN_BYTES] = {1, 2, 3};
  st = handover(r.hr->shm_socket, fake, PS__SHM_RING_MIN, PS__SHM_RING_MIN, &fd, 1, why,
                sizeof why);
  ck_assert_int_eq(st, PS_EAUTH);
  int sfd = ps__shm_create(&r.shm, PS__SHM_RING_MIN, PS__SHM_RING_MIN, why, sizeof why);
  st = handover(r.hr->shm_socket, r.hr->shm_token.data, PS__SHM_RING_MIN, 12345, &sfd, 1, why,
                sizeof why);
  ck_assert_int_eq(st, PS_EINVAL);
  ck_assert_msg(strstr(why, "pull ring"), "%s", why);
  close(sfd);
  raw_close(&r);
  close(fd);
  /* A frame flagged for shared memory on a connection without a segment. */
  raw_open(&r, p.addr, 1);
  ps__outq q = {0};
  Ps__Push m = PS__PUSH__INIT;
  m.request_id = 1;
  ck_assert_int_eq(ps__outq_frame_shm(&q, PS__MSG_PUSH, &m.base, 16, 0), 0);
  raw_send(&r, &q);
  st = raw_error(&r, why, sizeof why, 5);
  ck_assert_int_eq(st, PS_EPROTO);
  ck_assert_msg(strstr(why, "no segment"), "%s", why);
  ps__outq_free(&q);
  raw_close(&r);
  /* The same for a TablePush (2.9): refused before any table is looked at. */
  raw_open(&r, p.addr, 1);
  Ps__TablePush tm = PS__TABLE_PUSH__INIT;
  tm.request_id = 2;
  tm.count = 1;
  ck_assert_int_eq(ps__outq_frame_shm(&q, PS__MSG_TABLE_PUSH, &tm.base, 12, 0), 0);
  raw_send(&r, &q);
  st = raw_error(&r, why, sizeof why, 5);
  ck_assert_int_eq(st, PS_EPROTO);
  ck_assert_msg(strstr(why, "no segment") && strstr(why, "TABLE_PUSH"), "%s", why);
  ps__outq_free(&q);
  raw_close(&r);
  /* With a segment: a TablePush to an unknown table whose count claims
   * 2^22 keys in 16 bytes of ring is refused, nothing read past them
   * (was: psd copied 32 MiB of "keys" from past its mapping). */
  raw_open(&r, p.addr, 1);
  ck_assert_int_eq(raw_attach(&r, why, sizeof why), 0);
  tm.table_id = 77;
  tm.count = PS__MAX_TABLE_KEYS;
  ck_assert_int_eq(ps__outq_frame_shm(&q, PS__MSG_TABLE_PUSH, &tm.base, 16, 0), 0);
  raw_send(&r, &q);
  ps__outq_free(&q);
  usleep(300000);
  int wst;
  ck_assert_msg(waitpid(p.pid, &wst, WNOHANG) == 0, "psd died of an unknown table's shm push");
  raw_close(&r);
  /* Still serving: an honest worker gets its segment. */
  int rc;
  ps_client *c = client(p.addr, 0, PS_TRANSPORT_SHM, why, sizeof why, &rc);
  ck_assert_msg(c, "%s", why);
  ps_client_destroy(c);
  ck_assert_int_eq(kill(p.pid, 0), 0);
  tu_psd_kill(&p);
}
END_TEST

/* The hostile worker of test_hostile_beside_honest. */
typedef struct hostile {
  raw r;
  volatile int stop;   /* the honest worker is done */
  int pulls;           /* Pulls it sent */
} hostile;

static void *hostile_main(void *arg) {
  hostile *h = arg;
  unsigned x = 12345;
  ps__outq q = {0};
  uint32_t id = 0;
  while (!h->stop) {
    /* Garbage over the whole segment: header words and both rings. */
    for (size_t i = 0; i < h->r.shm.map_len; i += 64) {
      x = x * 1103515245u + 12345u;
      memset(h->r.shm.map + i, (int)(x >> 16), 64);
    }
    Ps__Pull m = PS__PULL__INIT;
    m.request_id = (uint64_t)++h->pulls;
    m.n_slice_ids = 1;
    m.slice_ids = &id;
    if (ps__outq_frame(&q, PS__MSG_PULL, &m.base, NULL, NULL, NULL, 0) != 0) break;
    if (ps__outq_write(&q, h->r.fd) != 0) break;
    char sink[65536];
    while (recv(h->r.fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {
    }
    usleep(1000);
  }
  ps__outq_free(&q);
  return NULL;
}

/* A psd (async, 2 workers, auto) and its worker 0 over shared memory with
 * a variable "v" of NV zeros trained by SGD at lr 0.5. */
static ps_client *honest_worker(tu_psd *p, ps_var **v) {
  start_psd(p, "auto");
  char err[600];
  int rc;
  ps_client *c = client(p->addr, 0, PS_TRANSPORT_SHM, err, sizeof err, &rc);
  ck_assert_msg(c, "%s", err);
  int64_t shape[1] = {NV};
  ps_init init = PS_SIZED(ps_init, .kind = PS_INIT_ZEROS);
  ps_optimizer opt;
  ps_optimizer_default(&opt, 0.5); /* SGD */
  ck_assert_int_eq(ps_client_var_create(c, "v", shape, 1, &init, &opt, v), 0);
  return c;
}

/* A worker that scribbles over its segment (header words included) and
 * cannot truncate it, beside an honest worker: the honest worker's values
 * stay exact, psd stays up, and a position outside the ring closes only
 * the hostile connection. */
START_TEST(test_hostile_beside_honest) {
  tu_psd p;
  ps_var *v;
  ps_client *c = honest_worker(&p, &v);
  char err[600];
  int rc;
  hostile h;
  memset(&h, 0, sizeof h);
  raw_open(&h.r, p.addr, 1);
  ck_assert_int_eq(raw_attach(&h.r, err, sizeof err), 0);
  /* The seals hold: the segment cannot shrink under psd. */
  int fd = ps__shm_create(&(ps__shm){0}, PS__SHM_RING_MIN, PS__SHM_RING_MIN, err, sizeof err);
  ck_assert_int_eq(ftruncate(fd, 0), -1);
  close(fd);
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, hostile_main, &h), 0);
  float *g = ps_var_grad(v);
  for (int step = 1; step <= 60; step++) {
    for (int i = 0; i < NV; i++) g[i] = 1.0f;
    ps_req *req;
    ck_assert_int_eq(ps_client_push_async(c, 0, NULL, 0, &req), 0);
    ck_assert_int_eq(ps_req_wait(req, -1, NULL), 0);
    ps_req_destroy(req);
    uint64_t s;
    ck_assert_msg(ps_client_pull(c, 0, &s) == 0, "%s", ps_client_errmsg(c));
    const float *w = ps_var_data(v);
    for (int i = 0; i < NV; i++)
      ck_assert_msg(w[i] == -0.5f * (float)step, "step %d: w[%d] = %g", step, i, w[i]);
  }
  h.stop = 1;
  pthread_join(th, NULL);
  ck_assert_int_gt(h.pulls, 5);
  /* A position outside its ring: fatal for that connection only. */
  ps__outq q = {0};
  Ps__Push m = PS__PUSH__INIT;
  Ps__Item it = PS__ITEM__INIT, *itp = &it;
  it.slice_id = 0;
  it.count = NV;
  m.request_id = 99;
  m.n_items = 1;
  m.items = &itp;
  ck_assert_int_eq(ps__outq_frame_shm(&q, PS__MSG_PUSH, &m.base, NV * 4,
                                      PS__SHM_RING_MIN - 8), 0);
  raw_send(&h.r, &q);
  ps__outq_free(&q);
  rc = raw_error(&h.r, err, sizeof err, 10);
  ck_assert_int_eq(rc, PS_EPROTO);
  ck_assert_msg(strstr(err, "not inside"), "%s", err);
  raw_close(&h.r);
  uint64_t s;
  ck_assert_msg(ps_client_pull(c, 0, &s) == 0, "%s", ps_client_errmsg(c));
  ck_assert(ps_var_data(v)[7] == -30.0f);
  ck_assert_int_eq(kill(p.pid, 0), 0);
  ps_client_destroy(c);
  tu_psd_kill(&p);
}
END_TEST

/* One sync worker of a pipelined run: `steps` ps_client_steps of one
 * variable of numel floats, every value checked at the end. */
typedef struct pipe_worker {
  const char *addr;  /* the one psd */
  int w, nw, steps;  /* who, of how many, how long */
  size_t numel;      /* the variable's floats */
  int *ready;        /* incremented once its steps are done */
  const int *hold;   /* then it waits while *hold before finishing */
  int rc;            /* first error */
  char err[600];     /* ... and what it was */
} pipe_worker;

#define PIPE_SECRET "shm-pipeline-test-secret"

static void *pipe_main(void *arg) {
  pipe_worker *pw = arg;
  const char *hosts[1] = {pw->addr};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hosts;
  cfg.num_ps = 1;
  cfg.worker_index = pw->w;
  cfg.num_workers = pw->nw;
  cfg.credential = PIPE_SECRET;
  cfg.credential_len = strlen(PIPE_SECRET);
  cfg.transport = PS_TRANSPORT_SHM;
  cfg.request_timeout_ms = 60000;
  ps_client *c = NULL;
  pw->rc = ps_client_create(&cfg, &c, pw->err, sizeof pw->err);
  if (pw->rc) {
    __atomic_add_fetch(pw->ready, 1, __ATOMIC_RELEASE); /* nothing to hold */
    return NULL;
  }
  int64_t shape[1] = {(int64_t)pw->numel};
  ps_init init = PS_SIZED(ps_init, .kind = PS_INIT_ZEROS);
  ps_optimizer opt;
  ps_optimizer_default(&opt, 0.5); /* SGD */
  ps_var *v;
  uint64_t step = 0;
  pw->rc = ps_client_var_create(c, "big", shape, 1, &init, &opt, &v);
  if (!pw->rc) pw->rc = ps_client_pull(c, 0, &step);
  float *g = pw->rc ? NULL : ps_var_grad(v);
  for (size_t i = 0; g && i < pw->numel; i++) g[i] = 1.0f;
  for (int k = 0; k < pw->steps && !pw->rc; k++) pw->rc = ps_client_step(c, &step, NULL);
  if (!pw->rc) {
    const float *x = ps_var_data(v);
    for (size_t i = 0; i < pw->numel; i++)
      if (x[i] != -0.5f * (float)step) {
        pw->rc = PS_EINVAL;
        snprintf(pw->err, sizeof pw->err, "after step %llu: x[%zu] = %g",
                 (unsigned long long)step, i, x[i]);
        break;
      }
  } else {
    snprintf(pw->err, sizeof pw->err, "%s", ps_client_errmsg(c));
  }
  __atomic_add_fetch(pw->ready, 1, __ATOMIC_RELEASE);
  while (__atomic_load_n(pw->hold, __ATOMIC_ACQUIRE)) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  if (!pw->rc) pw->rc = ps_client_finish(c);
  ps_client_destroy(c);
  return NULL;
}

/* Runs nw pipe workers of numel floats for steps sync steps against a
 * fresh psd; returns what Stats says of the frames that went over TCP
 * (all workers), asked once every worker has done its steps and before
 * any finishes (psd exits when all have). */
static uint64_t pipe_run(int nw, size_t numel, int steps) {
  tu_psd_secret = PIPE_SECRET;
  tu_psd p;
  char nws[8];
  snprintf(nws, sizeof nws, "%d", nw);
  const char *args[] = {"--workers", nws, "--transport", "shm", NULL};
  ck_assert_int_eq(tu_psd_start(&p, args), 0);
  tu_psd_secret = NULL;
  pipe_worker pw[2];
  pthread_t th[2];
  int ready = 0, hold = 1;
  for (int i = 0; i < nw; i++) {
    pw[i] = (pipe_worker){.addr = p.addr, .w = i, .nw = nw, .steps = steps, .numel = numel,
                          .ready = &ready, .hold = &hold};
    ck_assert_int_eq(pthread_create(&th[i], NULL, pipe_main, &pw[i]), 0);
  }
  while (__atomic_load_n(&ready, __ATOMIC_ACQUIRE) < nw) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  ps__auth au = {PIPE_SECRET, strlen(PIPE_SECRET), 0, NULL, 0, 0};
  Ps__StatsReply *r = NULL;
  char err[600];
  int rc = ps__admin_stats(p.addr, &au, 5000, &r, err, sizeof err);
  ck_assert_msg(rc == 0, "stats: %s (%s)", ps_strerror(rc), err);
  uint64_t n = 0;
  for (size_t i = 0; i < r->n_workers; i++) n += r->workers[i]->shm_tcp_frames;
  ck_assert_uint_eq(r->n_workers, (unsigned)nw);
  ps__stats_reply__free_unpacked(r, NULL);
  __atomic_store_n(&hold, 0, __ATOMIC_RELEASE);
  for (int i = 0; i < nw; i++) {
    pthread_join(th[i], NULL);
    ck_assert_msg(pw[i].rc == 0, "worker %d: %s (%s)", i, ps_strerror(pw[i].rc), pw[i].err);
  }
  tu_psd_kill(&p);
  return n;
}

/* The rings keep up with a pipelined run: 2 sync workers x 16 MiB (4 MiB
 * frames, each sent as soon as it is in the ring, the pull answered slice
 * by slice) find room for every frame, so Stats counts none over TCP (the
 * ring's restart arithmetic once sent most of every such step over TCP,
 * unseen). A variable bigger than a ring (8 MiB more than the reference
 * client's rings) goes partly over TCP, and Stats counts those frames. */
START_TEST(test_rings_keep_up) {
  uint64_t n = pipe_run(2, (size_t)4 << 20, 12);
  ck_assert_msg(n == 0, "%llu frames over TCP", (unsigned long long)n);
  /* The first pull's reply (all of it at once) cannot fit; later ones,
   * slice by slice, may, depending on how far psd runs ahead. */
  n = pipe_run(1, (size_t)((PS__SHM_RING_DEFAULT + (8 << 20)) / sizeof(float)), 3);
  ck_assert_msg(n >= 1, "%llu frames over TCP for a variable bigger than the ring",
                (unsigned long long)n);
}
END_TEST

/* A burst of shared-memory frames naming more data than psd applies per
 * turn of a connection (PSD_SHM_BUDGET, 32 MiB): 2600 pushes of 16 KiB
 * sent at once, all buffered in psd's input. psd yields after the budget
 * and comes back by itself (no socket readiness would call it again):
 * every push is answered, and the honest worker's pull in between is too. */
START_TEST(test_shm_burst_yields_and_resumes) {
  enum { BURST = 2600 };
  tu_psd p;
  ps_var *v;
  ps_client *c = honest_worker(&p, &v);
  char err[600];
  int rc;
  raw r;
  raw_open(&r, p.addr, 1);
  ck_assert_int_eq(raw_attach(&r, err, sizeof err), 0);
  /* Every frame names the same 16 KiB at the start of the push ring. */
  float *g = (float *)(void *)r.shm.push.base;
  for (int i = 0; i < NV; i++) g[i] = 1.0f / 1024;
  ps__outq q = {0};
  Ps__Push m = PS__PUSH__INIT;
  Ps__Item it = PS__ITEM__INIT, *itp = &it;
  it.count = NV;
  m.n_items = 1;
  m.items = &itp;
  for (int k = 0; k < BURST; k++) {
    m.request_id = (uint64_t)k + 1;
    ck_assert_int_eq(ps__outq_frame_shm(&q, PS__MSG_PUSH, &m.base, NV * 4, 0), 0);
  }
  raw_send(&r, &q);
  ps__outq_free(&q);
  uint64_t s;
  ck_assert_msg(ps_client_pull(c, 0, &s) == 0, "%s", ps_client_errmsg(c));
  int replies = 0;
  rc = raw_read(&r, PS__MSG_PUSH_REPLY, BURST, &replies, err, sizeof err, 60);
  ck_assert_msg(rc == 0 && replies == BURST, "%d of %d pushes answered (%d: %s)", replies,
                BURST, rc, err);
  ck_assert_msg(ps_client_pull(c, 0, &s) == 0, "%s", ps_client_errmsg(c));
  ck_assert_msg(ps_var_data(v)[0] == -0.5f * BURST / 1024, "%g", ps_var_data(v)[0]);
  raw_close(&r);
  ps_client_destroy(c);
  tu_psd_kill(&p);
}
END_TEST

Suite *suite_shm_hostile(void) {
  Suite *s = suite_create("shm_hostile");
  TCase *tc = tcase_create("psd");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_forced_and_auto);
  tcase_add_test(tc, test_handover_refused);
  tcase_add_test(tc, test_hostile_beside_honest);
  tcase_add_test(tc, test_rings_keep_up);
  tcase_add_test(tc, test_shm_burst_yields_and_resumes);
  suite_add_tcase(s, tc);
  return s;
}

/* Another uid (nobody) holding a real token is refused by SO_PEERCRED. */
START_TEST(test_other_uid_refused) {
  tu_psd p;
  start_psd(&p, "auto");
  raw r;
  raw_open(&r, p.addr, 1);
  char why[600];
  int fd = ps__shm_create(&r.shm, PS__SHM_RING_MIN, PS__SHM_RING_MIN, why, sizeof why);
  ck_assert_int_ge(fd, 0);
  int pfd[2];
  ck_assert_int_eq(pipe(pfd), 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(pfd[0]);
    if (setgid(TU_NOBODY) != 0 || setuid(TU_NOBODY) != 0) _exit(3);
    int st = handover(r.hr->shm_socket, r.hr->shm_token.data, PS__SHM_RING_MIN,
                      PS__SHM_RING_MIN, &fd, 1, why, sizeof why);
    if (write(pfd[1], &st, sizeof st) != sizeof st) _exit(4);
    if (write(pfd[1], why, strlen(why) + 1) < 0) _exit(4);
    _exit(0);
  }
  close(pfd[1]);
  int st = 0;
  ck_assert_int_eq(read(pfd[0], &st, sizeof st), (ssize_t)sizeof st);
  ssize_t n = read(pfd[0], why, sizeof why - 1);
  why[n > 0 ? n : 0] = '\0';
  close(pfd[0]);
  int ws;
  waitpid(pid, &ws, 0);
  ck_assert_int_eq(st, PS_EAUTH);
  ck_assert_msg(strstr(why, "uid"), "%s", why);
  /* The token was not spent by the refused stranger: our own handover works. */
  char why2[600];
  int st2 = handover(r.hr->shm_socket, r.hr->shm_token.data, PS__SHM_RING_MIN,
                     PS__SHM_RING_MIN, &fd, 1, why2, sizeof why2);
  ck_assert_msg(st2 == 0, "%s", why2);
  close(fd);
  raw_close(&r);
  tu_psd_kill(&p);
}
END_TEST

/* Another uid cannot take the handover slots: its connections are
 * answered and closed at accept, so a worker's handover that connected
 * before a stranger's flood of GATE_FLOOD connections still
 * succeeds (before the check at accept, the flood evicted it). */
#define GATE_FLOOD 64 /* twice psd's PSD_SHM_MAX_PENDING handover slots */
START_TEST(test_other_uid_cannot_fill_slots) {
  tu_psd p;
  start_psd(&p, "auto");
  raw r;
  raw_open(&r, p.addr, 1);
  char why[600];
  int fd = ps__shm_create(&r.shm, PS__SHM_RING_MIN, PS__SHM_RING_MIN, why, sizeof why);
  ck_assert_int_ge(fd, 0);
  int mine = gate_open(r.hr->shm_socket, 5);
  ck_assert_int_ge(mine, 0);
  int pfd[2];
  ck_assert_int_eq(pipe(pfd), 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(pfd[0]);
    if (setgid(TU_NOBODY) != 0 || setuid(TU_NOBODY) != 0) _exit(3);
    /* Each connection held open; each must get psd's refusal unasked. */
    int refused = 0, held[GATE_FLOOD];
    for (int i = 0; i < GATE_FLOOD; i++) {
      held[i] = gate_open(r.hr->shm_socket, 5);
      uint8_t ans[PS__SHM_REPLY_MAX];
      ssize_t n = held[i] >= 0 ? recv(held[i], ans, sizeof ans, 0) : -1;
      char w[PS__SHM_REPLY_MAX];
      if (n > 0 && ps__shm_reply_decode(ans, (size_t)n, w, sizeof w) == PS_EAUTH &&
          strstr(w, "uid"))
        refused++;
    }
    if (write(pfd[1], &refused, sizeof refused) != sizeof refused) _exit(4);
    _exit(0);
  }
  close(pfd[1]);
  int refused = -1;
  ck_assert_int_eq(read(pfd[0], &refused, sizeof refused), (ssize_t)sizeof refused);
  close(pfd[0]);
  int ws;
  waitpid(pid, &ws, 0);
  ck_assert_int_eq(refused, GATE_FLOOD);
  int st = handover_on(mine, r.hr->shm_token.data, PS__SHM_RING_MIN, PS__SHM_RING_MIN, &fd, 1,
                       why, sizeof why);
  ck_assert_msg(st == 0, "%s", why);
  close(fd);
  raw_close(&r);
  tu_psd_kill(&p);
}
END_TEST

Suite *suite_shm_users(void) {
  if (geteuid() != 0) {
    printf("SKIP: shm_users: acting as another user (nobody) needs root\n");
    return NULL;
  }
  Suite *s = suite_create("shm_users");
  TCase *tc = tcase_create("uid");
  tcase_add_test(tc, test_other_uid_refused);
  tcase_add_test(tc, test_other_uid_cannot_fill_slots);
  suite_add_tcase(s, tc);
  return s;
}
