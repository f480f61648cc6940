/* Authentication of peers, both ways (docs/protocol.md, "Handshake"): proofs
 * by the shared secret that never travel it, a psd that cannot prove the
 * secret refused by the worker, recorded proofs refused on a new
 * connection; MUNGE credentials (a private munged started by the test)
 * bound to the job, step and the peer's nonce, refused when replayed,
 * expired, of another job, or missing, and psd's own credential checked by
 * the worker. Without munged on the machine the MUNGE cases are skipped
 * (deploy/deps.sh installs it); a munged that is installed but does not
 * start is a failure. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <pthread.h>
#include <check.h>
#include <munge.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ps.pb-c.h"
#include "wire.h"
#include "testutil.h"
#include "util.h"

Suite *suite_auth(void);

static char g_sock[600]; /* our munged's socket, "" if none */

static int munged_installed(void) {
  return system("command -v munged >/dev/null 2>&1") == 0;
}

/* Starts a private munged (tu_munged_start). 0, or -1 with the reason in
 * why (the suite is skipped before this when munged is missing, so any
 * failure here is a broken installation). */
static int start_munged(char *why, size_t whylen) {
  const char *sock = tu_munged_start(why, whylen);
  if (!sock) return -1;
  snprintf(g_sock, sizeof g_sock, "%s", sock);
  return 0;
}

static void stop_munged(void) {
  tu_munged_stop();
  g_sock[0] = '\0';
}

/* Every test needs our munged; failing to start it fails the test. */
#define START_MUNGED()                                                           \
  do {                                                                           \
    char why_[4096];                                                             \
    ck_assert_msg(start_munged(why_, sizeof why_) == 0, "%s", why_);            \
  } while (0)

static ps_client *munge_client(const char **hp, long long job, long long step, int *rc,
                               char *err, size_t errlen) {
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.connect_timeout_ms = 3000;
  cfg.munge = 1;
  cfg.munge_socket = g_sock;
  cfg.job_id = job;
  cfg.step_id = step;
  ps_client *c = NULL;
  *rc = ps_client_create(&cfg, &c, err, errlen);
  return c;
}

static void start_psd_munge(tu_psd *ps, const char *step, char hosts[][64], const char **hp) {
  const char *args[] = {"--munge", "--munge-socket", g_sock, "--job-id", "42", "--step-id",
                        step, NULL};
  ck_assert_int_eq(tu_psd_start(ps, args), 0);
  tu_hosts(ps, 1, hosts, hp);
}

/* The job's own credential is accepted; another job's, another step's, or
 * none at all are refused with a sentence that says why. */
START_TEST(test_munge_job_and_step) {
  START_MUNGED();
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start_psd_munge(&ps, "3", hosts, hp);
  char err[512];
  int rc;
  ps_client *c = munge_client(hp, 42, 3, &rc, err, sizeof err);
  ck_assert_msg(rc == 0, "own job refused: %s", err);
  ps_client_destroy(c);
  c = munge_client(hp, 43, 3, &rc, err, sizeof err);
  ck_assert_int_eq(rc, PS_EAUTH);
  ck_assert_msg(strstr(err, "credential for 'psd2 client job=43 step=3 nonce=") != NULL, "%s",
                err);
  c = munge_client(hp, 42, 4, &rc, err, sizeof err);
  ck_assert_int_eq(rc, PS_EAUTH);
  /* No credential at all (a plain client). */
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.connect_timeout_ms = 3000;
  rc = ps_client_create(&cfg, &c, err, sizeof err);
  ck_assert_int_eq(rc, PS_EAUTH);
  ck_assert_msg(strstr(err, "requires a MUNGE credential") != NULL, "%s", err);
  tu_psd_kill(&ps);
}
END_TEST

/* --step-id -1 (a ps step serving later worker steps): any step of the job. */
START_TEST(test_munge_any_step) {
  START_MUNGED();
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start_psd_munge(&ps, "-1", hosts, hp);
  char err[512];
  int rc;
  ps_client *c = munge_client(hp, 42, 7, &rc, err, sizeof err);
  ck_assert_msg(rc == 0, "%s", err);
  ps_client_destroy(c);
  c = munge_client(hp, 420, 7, &rc, err, sizeof err);
  ck_assert_int_eq(rc, PS_EAUTH);
  tu_psd_kill(&ps);
}
END_TEST

/* Exactly n bytes from fd within timeout_s: 0, or -1. */
static int recv_exact(int fd, void *buf, size_t n, double timeout_s) {
  double end = ps__now() + timeout_s;
  for (size_t got = 0; got < n;) {
    struct pollfd p = {fd, POLLIN, 0};
    double left = end - ps__now();
    if (left <= 0 || poll(&p, 1, (int)(left * 1000) + 1) <= 0) return -1;
    ssize_t r = recv(fd, (char *)buf + got, n - got, 0);
    if (r <= 0) return -1;
    got += (size_t)r;
  }
  return 0;
}

/* A raw connection to psd on 127.0.0.1:port; psd's Challenge nonce into sn. */
static int raw_open(int port, uint8_t sn[PS__NONCE_BYTES]) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  uint8_t buf[PS__HEADER_SIZE + PS__MAX_PREAUTH_META];
  ps__frame_header fh;
  char e[160];
  ck_assert_int_eq(recv_exact(fd, buf, PS__HEADER_SIZE, 3.0), 0);
  ck_assert_int_eq(ps__header_decode(buf, 0, &fh, e, sizeof e), 0);
  ck_assert_uint_eq(fh.type, PS__MSG_CHALLENGE);
  ck_assert_int_eq(recv_exact(fd, buf, fh.meta_len, 3.0), 0);
  Ps__Challenge *ch = ps__challenge__unpack(NULL, fh.meta_len, buf);
  ck_assert_ptr_nonnull(ch);
  ck_assert_uint_eq(ch->nonce.len, PS__NONCE_BYTES);
  memcpy(sn, ch->nonce.data, PS__NONCE_BYTES);
  ps__challenge__free_unpacked(ch, NULL);
  return fd;
}

/* A Hello frame (1 worker) with cred, a MUNGE credential (or NULL), and
 * a proof by secret (or none) over psd's nonce sn into buf; its length. */
static size_t hello_bytes(uint8_t *buf, const char *cred, const uint8_t *cn,
                          const char *secret, const uint8_t *sn) {
  Ps__Hello h = PS__HELLO__INIT;
  h.protocol_version = PS__PROTOCOL_VERSION;
  h.role = PS__ROLE__ROLE_WORKER;
  h.num_workers = 1;
  h.num_ps = 1;
  h.nonce.data = (uint8_t *)cn;
  h.nonce.len = PS__NONCE_BYTES;
  if (cred) {
    h.munge = 1;
    h.credential.data = (uint8_t *)cred;
    h.credential.len = strlen(cred);
  }
  uint8_t proof[PS__MAC_BYTES];
  if (secret) {
    ck_assert_int_eq(
        ps__auth_proof(secret, strlen(secret), PS__AUTH_CLIENT, sn, cn, &h, proof), 0);
    h.proof.data = proof;
    h.proof.len = PS__MAC_BYTES;
  }
  size_t n = ps__hello__pack(&h, buf + PS__HEADER_SIZE);
  ps__header_encode(buf, PS__MSG_HELLO, (uint32_t)n, 0);
  return PS__HEADER_SIZE + n;
}

/* Sends the n bytes of a Hello on fd (closed after); 1 if the reply is a
 * HELLO_REPLY, 0 if an ERROR (message into msg). */
static int raw_send_hello(int fd, const uint8_t *hello, size_t n, char *msg, size_t msglen) {
  ck_assert_int_eq(tu_send_all(fd, hello, n), 0);
  uint8_t buf[PS__MAX_PREAUTH_META];
  ps__frame_header fh;
  char e[160];
  ck_assert_int_eq(recv_exact(fd, buf, PS__HEADER_SIZE, 3.0), 0);
  ck_assert_int_eq(ps__header_decode(buf, 0, &fh, e, sizeof e), 0);
  ck_assert_int_eq(recv_exact(fd, buf, fh.meta_len, 3.0), 0);
  close(fd);
  if (fh.type == PS__MSG_HELLO_REPLY) return 1;
  ck_assert_uint_eq(fh.type, PS__MSG_ERROR);
  Ps__Error *em = ps__error__unpack(NULL, fh.meta_len, buf);
  ck_assert_ptr_nonnull(em);
  snprintf(msg, msglen, "%s", em->message ? em->message : "");
  ps__error__free_unpacked(em, NULL);
  return 0;
}

/* A fresh client credential for job 42 step 3 bound to nonce. */
static char *mint(const uint8_t nonce[PS__NONCE_BYTES], long long job) {
  char *cred = NULL, e[300];
  ck_assert_msg(ps__munge_mint(g_sock, PS__AUTH_CLIENT, job, 3, nonce, &cred, e, sizeof e) == 0,
                "%s", e);
  return cred;
}

/* A credential used once is refused the second time (munged's replay
 * detection), so a captured handshake cannot be reused. */
START_TEST(test_munge_replay) {
  START_MUNGED();
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start_psd_munge(&ps, "3", hosts, hp);
  int port = atoi(strrchr(hp[0], ':') + 1);
  uint8_t sn1[PS__NONCE_BYTES], sn2[PS__NONCE_BYTES], cn[PS__NONCE_BYTES] = {1};
  uint8_t hb[PS__HEADER_SIZE + PS__MAX_PREAUTH_META];
  char msg[512] = "";
  int fd1 = raw_open(port, sn1);
  char *cred = mint(sn1, 42);
  size_t n = hello_bytes(hb, cred, cn, NULL, NULL);
  ck_assert_msg(raw_send_hello(fd1, hb, n, msg, sizeof msg) == 1, "first use refused: %s", msg);
  /* The same Hello replayed on another connection. */
  int fd2 = raw_open(port, sn2);
  ck_assert_int_eq(raw_send_hello(fd2, hb, n, msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "Replayed credential") || strstr(msg, "nonce"), "%s", msg);
  free(cred);
  /* A fresh credential (munged has not seen it) bound to another
   * connection's nonce: the binding alone refuses it. */
  fd1 = raw_open(port, sn1);
  fd2 = raw_open(port, sn2);
  cred = mint(sn1, 42);
  n = hello_bytes(hb, cred, cn, NULL, NULL);
  ck_assert_int_eq(raw_send_hello(fd2, hb, n, msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "credential for 'psd2 client job=42 step=3 nonce="), "%s", msg);
  close(fd1);
  free(cred);
  /* Another job's credential, bound to the right nonce. */
  fd1 = raw_open(port, sn1);
  cred = mint(sn1, 41);
  n = hello_bytes(hb, cred, cn, NULL, NULL);
  ck_assert_int_eq(raw_send_hello(fd1, hb, n, msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "job=41"), "%s", msg);
  free(cred);
  /* Garbage instead of a credential. */
  fd1 = raw_open(port, sn1);
  n = hello_bytes(hb, "MUNGE:not-a-credential:", cn, NULL, NULL);
  ck_assert_int_eq(raw_send_hello(fd1, hb, n, msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "MUNGE credential refused") != NULL, "%s", msg);
  tu_psd_kill(&ps);
}
END_TEST

/* An expired credential (TTL 1 s, used 3 s later) is refused. */
START_TEST(test_munge_expired) {
  START_MUNGED();
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start_psd_munge(&ps, "3", hosts, hp);
  int port = atoi(strrchr(hp[0], ':') + 1);
  uint8_t sn[PS__NONCE_BYTES], cn[PS__NONCE_BYTES] = {2};
  int fd = raw_open(port, sn);
  munge_ctx_t ctx = munge_ctx_create();
  munge_ctx_set(ctx, MUNGE_OPT_SOCKET, g_sock);
  munge_ctx_set(ctx, MUNGE_OPT_TTL, 1);
  char *cred = NULL, payload[200], hex[2 * PS__NONCE_BYTES + 1];
  for (size_t i = 0; i < PS__NONCE_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", sn[i]);
  snprintf(payload, sizeof payload, "psd2 client job=42 step=3 nonce=%s", hex);
  ck_assert_int_eq(munge_encode(&cred, ctx, payload, (int)strlen(payload)), EMUNGE_SUCCESS);
  munge_ctx_destroy(ctx);
  sleep(3);
  char msg[512] = "";
  uint8_t hb[PS__HEADER_SIZE + PS__MAX_PREAUTH_META];
  size_t n = hello_bytes(hb, cred, cn, NULL, NULL);
  ck_assert_int_eq(raw_send_hello(fd, hb, n, msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "Expired credential") != NULL, "%s", msg);
  free(cred);
  tu_psd_kill(&ps);
}
END_TEST

/* ---- a psd impostor -------------------------------------------------------- */

/* What the impostor answers a Hello with. */
enum {
  FAKE_NO_PROOF,       /* a HelloReply without a proof */
  FAKE_RANDOM_PROOF,   /* a proof it made up */
  FAKE_REFLECT,        /* the client's own proof sent back */
  FAKE_MUNGE_JOB_43,   /* a MUNGE credential of another job */
  FAKE_MUNGE_OTHER,    /* a MUNGE credential bound to another nonce */
};

/* A listening socket that plays psd for one connection: Challenge, then
 * the Hello recorded, then a HelloReply per mode. */
typedef struct fake {
  int lfd;            /* listening socket */
  int port;           /* its port */
  int mode;           /* FAKE_* */
  uint8_t got[8192];  /* every byte the client sent */
  size_t n;           /* how many */
} fake;

static void fake_listen(fake *f, int mode) {
  memset(f, 0, sizeof *f);
  f->mode = mode;
  f->lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  ck_assert_int_eq(bind(f->lfd, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(f->lfd, 4), 0);
  socklen_t sl = sizeof sa;
  getsockname(f->lfd, (struct sockaddr *)&sa, &sl);
  f->port = ntohs(sa.sin_port);
}

static void fake_send(int fd, unsigned type, const ProtobufCMessage *m) {
  uint8_t buf[PS__HEADER_SIZE + PS__MAX_PREAUTH_META];
  size_t n = protobuf_c_message_pack(m, buf + PS__HEADER_SIZE);
  ps__header_encode(buf, type, (uint32_t)n, 0);
  tu_send_all(fd, buf, PS__HEADER_SIZE + n);
}

/* The impostor's HelloReply to h, per mode. */
static void fake_reply(fake *f, int fd, const Ps__Hello *h) {
  Ps__HelloReply r = PS__HELLO_REPLY__INIT;
  r.protocol_version = PS__PROTOCOL_VERSION;
  r.num_ps = 1;
  r.num_workers = 1;
  uint8_t proof[PS__MAC_BYTES], other[PS__NONCE_BYTES];
  char *cred = NULL, e[300];
  ps__random(proof, sizeof proof);
  ps__random(other, sizeof other);
  if (f->mode == FAKE_RANDOM_PROOF || (f->mode == FAKE_REFLECT && h->proof.len)) {
    if (f->mode == FAKE_REFLECT) memcpy(proof, h->proof.data, sizeof proof);
    r.proof.data = proof;
    r.proof.len = sizeof proof;
  }
  if (f->mode == FAKE_MUNGE_JOB_43 || f->mode == FAKE_MUNGE_OTHER) {
    int job = f->mode == FAKE_MUNGE_JOB_43 ? 43 : 42;
    const uint8_t *bound = f->mode == FAKE_MUNGE_OTHER ? other : h->nonce.data;
    if (h->nonce.len == PS__NONCE_BYTES &&
        ps__munge_mint(g_sock, PS__AUTH_SERVER, job, 3, bound, &cred, e, sizeof e) == 0) {
      r.credential.data = (uint8_t *)cred;
      r.credential.len = strlen(cred);
    }
  }
  fake_send(fd, PS__MSG_HELLO_REPLY, &r.base);
  free(cred);
}

static void *fake_main(void *arg) {
  fake *f = arg;
  int fd = accept(f->lfd, NULL, NULL);
  if (fd < 0) return NULL;
  Ps__Challenge ch = PS__CHALLENGE__INIT;
  uint8_t sn[PS__NONCE_BYTES];
  ps__random(sn, sizeof sn);
  ch.protocol_version = PS__PROTOCOL_VERSION;
  ch.nonce.data = sn;
  ch.nonce.len = sizeof sn;
  ch.secret = 1;
  fake_send(fd, PS__MSG_CHALLENGE, &ch.base);
  ps__frame_header fh;
  char e[160];
  if (recv_exact(fd, f->got, PS__HEADER_SIZE, 5.0) == 0 &&
      ps__header_decode(f->got, 0, &fh, e, sizeof e) == 0 &&
      recv_exact(fd, f->got + PS__HEADER_SIZE, fh.meta_len, 5.0) == 0) {
    f->n = PS__HEADER_SIZE + fh.meta_len;
    Ps__Hello *h = ps__hello__unpack(NULL, fh.meta_len, f->got + PS__HEADER_SIZE);
    if (h) {
      fake_reply(f, fd, h);
      ps__hello__free_unpacked(h, NULL);
    }
  }
  size_t more = 0;
  tu_read_until_eof(fd, f->got + f->n, sizeof f->got - f->n, 5.0, &more);
  f->n += more;
  close(fd);
  return NULL;
}

/* A client of one ps at addr with secret (or none) and MUNGE (or not). */
static int client_to(const char *addr, const char *secret, int munge, char *err,
                     size_t errlen) {
  const char *hp[1] = {addr};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.connect_timeout_ms = 3000;
  if (secret) {
    cfg.credential = secret;
    cfg.credential_len = strlen(secret);
  }
  cfg.munge = munge;
  cfg.munge_socket = g_sock;
  cfg.job_id = 42;
  cfg.step_id = 3;
  ps_client *c = NULL;
  int rc = ps_client_create(&cfg, &c, err, errlen);
  ps_client_destroy(c);
  return rc;
}

/* Runs a client against an impostor in mode; returns its code, err set,
 * and what it sent in f. */
static int against_fake(fake *f, int mode, const char *secret, int munge, char *err,
                        size_t errlen) {
  fake_listen(f, mode);
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, fake_main, f), 0);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", f->port);
  int rc = client_to(addr, secret, munge, err, errlen);
  pthread_join(t, NULL);
  close(f->lfd);
  return rc;
}

#define SECRET_A "correct horse battery staple 0123456789"

/* An impostor that cannot prove the secret is refused, naming it; what the
 * client sent it holds a proof but never the secret's bytes. */
START_TEST(test_impostor_refused) {
  static fake f;
  const int modes[] = {FAKE_NO_PROOF, FAKE_RANDOM_PROOF, FAKE_REFLECT};
  for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
    char err[700] = "", who[64];
    int rc = against_fake(&f, modes[i], SECRET_A, 0, err, sizeof err);
    snprintf(who, sizeof who, "ps 0 at 127.0.0.1:%d", f.port);
    ck_assert_msg(rc == PS_EAUTH, "mode %d: rc %d (%s)", modes[i], rc, err);
    ck_assert_msg(strstr(err, who) && strstr(err, "did not prove"), "mode %d: %s", modes[i],
                  err);
    ck_assert_msg(f.n > PS__HEADER_SIZE, "mode %d: the client sent nothing", modes[i]);
    ck_assert_msg(!memmem(f.got, f.n, SECRET_A, strlen(SECRET_A)) &&
                      !memmem(f.got, f.n, "correct horse", 13),
                  "mode %d: the secret went over the wire", modes[i]);
    Ps__Hello *h = ps__hello__unpack(NULL, f.n - PS__HEADER_SIZE, f.got + PS__HEADER_SIZE);
    ck_assert_ptr_nonnull(h);
    ck_assert_uint_eq(h->proof.len, PS__MAC_BYTES);
    ck_assert_uint_eq(h->nonce.len, PS__NONCE_BYTES);
    ck_assert_uint_eq(h->credential.len, 0);
    ps__hello__free_unpacked(h, NULL);
  }
}
END_TEST

/* Real psds that do not know our secret: one without any (it accepts us
 * but cannot prove it; we refuse it) and one with another secret (it
 * refuses us). The right secret works both ways. */
START_TEST(test_real_psd_secrets) {
  tu_psd ps;
  char err[700];
  ck_assert_int_eq(tu_psd_start(&ps, NULL), 0);
  int rc = client_to(ps.addr, SECRET_A, 0, err, sizeof err);
  ck_assert_msg(rc == PS_EAUTH && strstr(err, ps.addr) && strstr(err, "did not prove"), "%d %s",
                rc, err);
  tu_psd_kill(&ps);
  tu_psd_secret = "another secret, not ours, 0123456789";
  rc = tu_psd_start(&ps, NULL);
  tu_psd_secret = NULL;
  ck_assert_int_eq(rc, 0);
  rc = client_to(ps.addr, SECRET_A, 0, err, sizeof err);
  ck_assert_msg(rc == PS_EAUTH && strstr(err, "wrong credential"), "%d %s", rc, err);
  tu_psd_kill(&ps);
  tu_psd_secret = SECRET_A;
  rc = tu_psd_start(&ps, NULL);
  tu_psd_secret = NULL;
  ck_assert_int_eq(rc, 0);
  rc = client_to(ps.addr, SECRET_A, 0, err, sizeof err);
  ck_assert_msg(rc == 0, "%s", err);
  ck_assert(!tu_log_contains(&ps, "authentication failed"));
  tu_psd_kill(&ps);
}
END_TEST

/* A proof recorded on one connection is refused on the next (psd's nonce
 * differs), and a proof made for the wrong psd nonce too. */
START_TEST(test_proof_replay) {
  tu_psd_secret = SECRET_A;
  tu_psd ps;
  int rc = tu_psd_start(&ps, NULL);
  tu_psd_secret = NULL;
  ck_assert_int_eq(rc, 0);
  int port = atoi(strrchr(ps.addr, ':') + 1);
  uint8_t sn1[PS__NONCE_BYTES], sn2[PS__NONCE_BYTES], cn[PS__NONCE_BYTES] = {3};
  uint8_t hb[PS__HEADER_SIZE + PS__MAX_PREAUTH_META];
  char msg[512] = "";
  int fd1 = raw_open(port, sn1);
  size_t n = hello_bytes(hb, NULL, cn, SECRET_A, sn1);
  ck_assert_msg(raw_send_hello(fd1, hb, n, msg, sizeof msg) == 1, "refused: %s", msg);
  int fd2 = raw_open(port, sn2);
  ck_assert(memcmp(sn1, sn2, sizeof sn1) != 0);
  ck_assert_int_eq(raw_send_hello(fd2, hb, n, msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "authentication failed: wrong credential"), "%s", msg);
  /* No proof at all. */
  fd2 = raw_open(port, sn2);
  n = hello_bytes(hb, NULL, cn, NULL, NULL);
  ck_assert_int_eq(raw_send_hello(fd2, hb, n, msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "authentication failed: no credential"), "%s", msg);
  ck_assert(tu_log_contains(&ps, "wrong credential"));
  tu_psd_kill(&ps);
}
END_TEST

/* The worker checks psd's MUNGE credential: one of another job, or bound
 * to another connection's nonce, or none, is refused. */
START_TEST(test_munge_server_checked) {
  START_MUNGED();
  static fake f;
  const int modes[] = {FAKE_MUNGE_JOB_43, FAKE_MUNGE_OTHER, FAKE_NO_PROOF};
  const char *words[] = {"job=43", "nonce", "presented no MUNGE credential"};
  for (size_t i = 0; i < 3; i++) {
    char err[700] = "";
    int rc = against_fake(&f, modes[i], NULL, 1, err, sizeof err);
    ck_assert_msg(rc == PS_EAUTH, "mode %d: rc %d (%s)", modes[i], rc, err);
    ck_assert_msg(strstr(err, "is not this job's psd") && strstr(err, words[i]), "mode %d: %s",
                  modes[i], err);
  }
}
END_TEST

#ifdef PS_SLOWDOWN_SO
/* A stranger's Hellos that each take munged 400 ms to decode. */
typedef struct flood {
  int port;      /* psd's port */
  int n;         /* Hellos to send, each on its own connection */
  int refused;   /* out: refusals that name the credential */
} flood;

static void *flood_main(void *arg) {
  flood *f = arg;
  int fds[8];
  for (int i = 0; i < f->n; i++) {
    uint8_t sn[PS__NONCE_BYTES], cn[PS__NONCE_BYTES] = {7}, buf[PS__MAX_PREAUTH_META];
    fds[i] = raw_open(f->port, sn);
    size_t n = hello_bytes(buf, "MUNGE:not-a-credential:", cn, NULL, sn);
    if (tu_send_all(fds[i], buf, n) != 0) fds[i] = -1;
  }
  for (int i = 0; i < f->n; i++) {
    uint8_t buf[PS__MAX_PREAUTH_META];
    ps__frame_header fh;
    char e[160];
    if (fds[i] < 0 || recv_exact(fds[i], buf, PS__HEADER_SIZE, 10.0) != 0 ||
        ps__header_decode(buf, 0, &fh, e, sizeof e) != 0 ||
        recv_exact(fds[i], buf, fh.meta_len, 3.0) != 0 || fh.type != PS__MSG_ERROR)
      continue;
    Ps__Error *em = ps__error__unpack(NULL, fh.meta_len, buf);
    if (em && em->code == PS_EAUTH) f->refused++;
    if (em) ps__error__free_unpacked(em, NULL);
    close(fds[i]);
  }
  return NULL;
}

/* munged answers slowly (400 ms per decode, through the slowdown shim).
 * A stranger's 5 Hellos with bad credentials then keep MUNGE busy for 2 s;
 * with the decoding on psd's event loop the job's worker would stall for
 * all of it, off the loop its steps go on. The stranger is refused. */
START_TEST(test_slow_munged_never_stalls_serving) {
  START_MUNGED();
  setenv("PS_SLOW_MUNGE_MS", "400", 1);
  tu_psd_set_preload(PS_SLOWDOWN_SO);
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start_psd_munge(&ps, "3", hosts, hp);
  tu_psd_set_preload(NULL);
  unsetenv("PS_SLOW_MUNGE_MS");
  char err[512];
  int rc;
  ps_client *c = munge_client(hp, 42, 3, &rc, err, sizeof err);
  ck_assert_msg(rc == 0, "worker refused: %s", err);
  int64_t shape[1] = {256};
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "w", shape, 1, NULL, NULL, &v), 0);
  flood f = {atoi(strrchr(hp[0], ':') + 1), 5, 0};
  pthread_t th;
  pthread_create(&th, NULL, flood_main, &f);
  uint64_t step = 0;
  double t0 = ps__now(), worst = 0;
  int steps = 0;
  while (ps__now() - t0 < 2.5) {
    double s0 = ps__now();
    ck_assert_int_eq(ps_client_step(c, &step, NULL), 0);
    double d = ps__now() - s0;
    if (d > worst) worst = d;
    steps++;
    struct timespec ts = {0, 5 * 1000000};
    nanosleep(&ts, NULL);
  }
  pthread_join(th, NULL);
  printf("slow munged: %d steps in 2.5 s, slowest %.3f s; %d of 5 strangers refused\n", steps,
         worst, f.refused);
  ck_assert_msg(f.refused == 5, "%d of 5 bad credentials refused", f.refused);
  ck_assert_msg(worst < tu_time_limit(0.3), "a step waited %.3f s for munged", worst);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  ck_assert_int_eq(tu_psd_wait(&ps, 10), 0);
}
END_TEST
#endif

static void teardown(void) { stop_munged(); }

Suite *suite_auth(void) {
  Suite *s = suite_create("auth");
  TCase *tc = tcase_create("secret");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_impostor_refused);
  tcase_add_test(tc, test_real_psd_secrets);
  tcase_add_test(tc, test_proof_replay);
  suite_add_tcase(s, tc);
  if (!munged_installed()) {
    tu_skip_tests("auth", "the MUNGE cases", "munged is not installed: apt-get install munge");
    return s;
  }
  tc = tcase_create("munge");
  tcase_set_timeout(tc, 60);
  tcase_add_checked_fixture(tc, NULL, teardown);
  tcase_add_test(tc, test_munge_job_and_step);
  tcase_add_test(tc, test_munge_any_step);
  tcase_add_test(tc, test_munge_replay);
  tcase_add_test(tc, test_munge_expired);
  tcase_add_test(tc, test_munge_server_checked);
#ifdef PS_SLOWDOWN_SO
  tcase_add_test(tc, test_slow_munged_never_stalls_serving);
#endif
  suite_add_tcase(s, tc);
  return s;
}
