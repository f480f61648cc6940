/* Authentication of peers: MUNGE credentials (a private munged started by
 * the test) bound to the job and step, refused when replayed, expired, of
 * another job, or missing. Without munged on the machine the suite is
 * skipped (exit 77; deploy/deps.sh installs it); a munged that is installed
 * but does not start is a failure. */
#define _GNU_SOURCE
#include <arpa/inet.h>
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

Suite *suite_auth(void);

static char g_sock[600]; /* our munged's socket, "" if none */
static pid_t g_munged;

static int munged_installed(void) {
  return system("command -v munged >/dev/null 2>&1") == 0;
}

/* Starts a private munged (own key, socket, pid file). 0, or -1 with the
 * reason in why (the suite is skipped before this when munged is missing,
 * so any failure here is a broken installation). */
static int start_munged(char *why, size_t whylen) {
  if (g_sock[0]) return 0;
  char dir[512], cmd[8192];
  snprintf(dir, sizeof dir, "%s/munge", tu_tmpdir());
  mkdir(dir, 0700);
  snprintf(cmd, sizeof cmd,
           "dd if=/dev/urandom of=%s/key bs=1024 count=1 2>/dev/null && chmod 0400 %s/key && "
           "chmod 0711 %s && munged %s --socket=%s/sock --key-file=%s/key --pid-file=%s/pid "
           "--log-file=%s/log --seed-file=%s/seed >%s/out 2>&1",
           dir, dir, dir, getuid() == 0 ? "--force" : "", dir, dir, dir, dir, dir, dir);
  if (system(cmd) != 0) {
    char outf[600];
    snprintf(outf, sizeof outf, "%s/out", dir);
    char *out = tu_read_file(outf);
    snprintf(why, whylen, "munged did not start: %s", out ? out : "(no output)");
    free(out);
    return -1;
  }
  char pidf[600];
  snprintf(pidf, sizeof pidf, "%s/pid", dir);
  for (int i = 0; i < 100; i++) {
    char *p = tu_read_file(pidf);
    if (p && atoi(p) > 0) {
      g_munged = atoi(p);
      free(p);
      snprintf(g_sock, sizeof g_sock, "%s/sock", dir);
      return 0;
    }
    free(p);
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
  snprintf(why, whylen, "munged wrote no pid file %s within 2 s", pidf);
  return -1;
}

static void stop_munged(void) {
  if (g_munged > 0) kill(g_munged, SIGTERM);
  g_munged = 0;
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
  ck_assert_msg(strstr(err, "credential for 'psd1 job=43 step=3'") != NULL, "%s", err);
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

/* Sends a Hello carrying cred on a raw connection; returns 1 if the reply
 * is a HELLO_REPLY, 0 if an ERROR (message into msg). */
static int raw_hello(int port, const char *cred, char *msg, size_t msglen) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  Ps__Hello h = PS__HELLO__INIT;
  h.protocol_version = PS__PROTOCOL_VERSION;
  h.role = PS__ROLE__ROLE_WORKER;
  h.num_workers = 1;
  h.num_ps = 1;
  h.munge = 1;
  h.credential.data = (uint8_t *)cred;
  h.credential.len = strlen(cred);
  uint8_t buf[8192];
  size_t n = ps__hello__pack(&h, buf + PS__HEADER_SIZE);
  ps__header_encode(buf, PS__MSG_HELLO, (uint32_t)n, 0);
  ck_assert(write(fd, buf, PS__HEADER_SIZE + n) == (ssize_t)(PS__HEADER_SIZE + n));
  size_t got = 0;
  struct pollfd p = {fd, POLLIN, 0};
  while (got < sizeof buf && poll(&p, 1, 3000) > 0) {
    ssize_t r = read(fd, buf + got, sizeof buf - got);
    if (r <= 0) break;
    got += (size_t)r;
    if (got >= PS__HEADER_SIZE) {
      ps__frame_header fh;
      char e[128];
      if (ps__header_decode(buf, 1, &fh, e, sizeof e) == 0 && got >= PS__HEADER_SIZE + fh.meta_len)
        break;
    }
  }
  close(fd);
  ck_assert_uint_ge(got, PS__HEADER_SIZE);
  ps__frame_header fh;
  char e[128];
  ck_assert_int_eq(ps__header_decode(buf, 1, &fh, e, sizeof e), 0);
  if (fh.type == PS__MSG_HELLO_REPLY) return 1;
  ck_assert_uint_eq(fh.type, PS__MSG_ERROR);
  Ps__Error *em = ps__error__unpack(NULL, fh.meta_len, buf + PS__HEADER_SIZE);
  ck_assert_ptr_nonnull(em);
  snprintf(msg, msglen, "%s", em->message ? em->message : "");
  ps__error__free_unpacked(em, NULL);
  return 0;
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
  munge_ctx_t ctx = munge_ctx_create();
  munge_ctx_set(ctx, MUNGE_OPT_SOCKET, g_sock);
  char *cred = NULL;
  const char *payload = "psd1 job=42 step=3";
  ck_assert_int_eq(munge_encode(&cred, ctx, payload, (int)strlen(payload)), EMUNGE_SUCCESS);
  munge_ctx_destroy(ctx);
  char msg[512] = "";
  ck_assert_msg(raw_hello(port, cred, msg, sizeof msg) == 1, "first use refused: %s", msg);
  ck_assert_int_eq(raw_hello(port, cred, msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "Replayed credential") != NULL, "%s", msg);
  /* Garbage instead of a credential. */
  ck_assert_int_eq(raw_hello(port, "MUNGE:not-a-credential:", msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "MUNGE credential refused") != NULL, "%s", msg);
  free(cred);
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
  munge_ctx_t ctx = munge_ctx_create();
  munge_ctx_set(ctx, MUNGE_OPT_SOCKET, g_sock);
  munge_ctx_set(ctx, MUNGE_OPT_TTL, 1);
  char *cred = NULL;
  const char *payload = "psd1 job=42 step=3";
  ck_assert_int_eq(munge_encode(&cred, ctx, payload, (int)strlen(payload)), EMUNGE_SUCCESS);
  munge_ctx_destroy(ctx);
  sleep(3);
  char msg[512] = "";
  ck_assert_int_eq(raw_hello(port, cred, msg, sizeof msg), 0);
  ck_assert_msg(strstr(msg, "Expired credential") != NULL, "%s", msg);
  free(cred);
  tu_psd_kill(&ps);
}
END_TEST

static void teardown(void) { stop_munged(); }

Suite *suite_auth(void) {
  if (!munged_installed()) {
    printf("SKIP: auth: munged is not installed (apt-get install munge)\n");
    return NULL;
  }
  Suite *s = suite_create("auth");
  TCase *tc = tcase_create("munge");
  tcase_set_timeout(tc, 60);
  tcase_add_checked_fixture(tc, NULL, teardown);
  tcase_add_test(tc, test_munge_job_and_step);
  tcase_add_test(tc, test_munge_any_step);
  tcase_add_test(tc, test_munge_replay);
  tcase_add_test(tc, test_munge_expired);
  suite_add_tcase(s, tc);
  return s;
}
