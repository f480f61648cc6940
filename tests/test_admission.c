/* Integration: psd's connection caps and what an unauthenticated flood
 * costs (psd/conn.c, psd/server.c), rate-limited peer log lines
 * (common/ratelog.c's rule: the util suite), keepalive on accepted sockets. 1000 held
 * unauthenticated connections must not keep workers or psctl out, nor
 * grow psd past PSD_TEST_RSS_PER_CONN each. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "log.h"
#include "ratelog.h"
#include "testutil.h"
#include "wire.h"

/* Unauthenticated connections held during the training run. */
#define HELD 1000
/* Descriptors the test process and psd need besides HELD. */
#define FD_SLACK 200
/* Bound on psd's resident growth per held unauthenticated connection that
 * has sent the most a peer may before its Hello is accepted (measured: about
 * 5.2 KiB; docs/psd.md, "Who may connect", documents 8 KiB). A psd built with
 * AddressSanitizer pays its redzones and allocator metadata on top (about
 * 8.3 KiB measured), so the sanitizer build checks twice the bound. */
#ifdef PS_TEST_SANITIZED
#define PSD_TEST_RSS_PER_CONN 16384L
#else
#define PSD_TEST_RSS_PER_CONN 8192L
#endif
#define NW 2     /* workers of the training runs */
#define STEPS 30 /* their steps */

/* Descriptors psd has open. */
static int fd_count(pid_t pid) {
  char cmd[96];
  snprintf(cmd, sizeof cmd, "ls /proc/%d/fd 2>/dev/null | wc -l", (int)pid);
  FILE *f = popen(cmd, "r");
  int n = -1;
  if (f && fscanf(f, "%d", &n) != 1) n = -1;
  if (f) pclose(f);
  return n;
}

/* Waits until psd holds at least n descriptors (it accepted them). */
static void wait_fds(pid_t pid, int n) {
  for (int i = 0; i < 100 && fd_count(pid) < n; i++) usleep(50000);
}

/* psd's descriptors once the count has held still for 200 ms (at most
 * 3 s): a connection that just ended (psctl's) or a descriptor of its
 * start-up may still be open when a test starts counting. */
static int fd_count_settled(pid_t pid) {
  int n = fd_count(pid), same = 0;
  for (int i = 0; i < 60 && same < 4; i++) {
    usleep(50000);
    int m = fd_count(pid);
    same = m == n ? same + 1 : 0;
    n = m;
  }
  return n;
}

/* The most a peer may send before its Hello is accepted: a header
 * announcing the largest Hello and most of its bytes. */
static void send_partial_hello(int fd) {
  uint8_t b[PS__HEADER_SIZE + PS__MAX_PREAUTH_META - 96];
  memset(b, 0x0a, sizeof b);
  ps__header_encode(b, PS__MSG_HELLO, PS__MAX_PREAUTH_META, 0);
  tu_send_all(fd, b, sizeof b);
}

/* 1 if the peer closed fd (EOF or reset) within timeout_s. */
static int closed_within(int fd, double timeout_s) {
  uint8_t b[512];
  size_t n;
  return tu_read_until_eof(fd, b, sizeof b, timeout_s, &n);
}

/* 1 if fd is still open: whatever psd sent (its Challenge) is read and
 * dropped, then no EOF or reset is pending. */
static int still_open(int fd) {
  uint8_t b[512];
  for (;;) {
    ssize_t n = recv(fd, b, sizeof b, MSG_DONTWAIT);
    if (n > 0) continue;
    if (n == 0) return 0;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

/* psctl next to psd, or NULL if it was not built. */
static const char *psctl_path(void) {
  static char path[1100];
  const char *bin = getenv("PSD_BIN");
  if (bin) {
    snprintf(path, sizeof path, "%s", bin);
  } else { /* as tu_psd_start: next to this test runner */
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 8);
    if (n <= 0) return NULL;
    path[n] = '\0';
  }
  char *slash = strrchr(path, '/');
  if (!slash) return NULL;
  strcpy(slash + 1, "psctl");
  return access(path, X_OK) == 0 ? path : NULL;
}

/* Runs psctl stats against p; its exit status, and the seconds it took. */
/* psctl stats against p: its exit status, and in *secs the seconds it
 * took beyond what it took against the same psd when idle (*idle, taken at
 * the first call with *idle < 0). What is asserted is psd's part: getting
 * in within a second, not psctl's own start-up (an ASan build loading
 * libslurm on a busy 2-core machine takes most of a second). */
static int psctl_stats_vs(const tu_psd *p, double *idle, double *secs);

static int psctl_stats(const tu_psd *p, double *secs) {
  char cmd[1400];
  snprintf(cmd, sizeof cmd, "'%s' stats %s >/dev/null 2>&1", psctl_path(), p->addr);
  double t0 = ps__now();
  int st = system(cmd);
  *secs = ps__now() - t0;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int psctl_stats_vs(const tu_psd *p, double *idle, double *secs) {
  if (*idle < 0) {
    int rc = psctl_stats(p, idle);
    ck_assert_msg(rc == 0, "psctl stats against an idle psd: exit %d", rc);
    *secs = 0;
    return rc;
  }
  int rc = psctl_stats(p, secs);
  *secs -= *idle;
  return rc;
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
    t[i].batch = 16;
    pthread_create(&th[i], NULL, tu_train_worker, &t[i]);
  }
  for (int i = 0; i < NW; i++) pthread_join(th[i], NULL);
}

static void expect_trained(tu_train t[NW], const char *run) {
  for (int i = 0; i < NW; i++) {
    ck_assert_msg(t[i].rc == 0, "%s: worker %d failed: %s (%s)", run, i, ps_strerror(t[i].rc),
                  t[i].err);
    ck_assert_msg(t[i].final_step == STEPS, "%s: worker %d ended at step %llu", run, i,
                  (unsigned long long)t[i].final_step);
  }
  ck_assert_msg(tu_params_equal(&t[0], &t[1]), "%s: workers ended with different parameters",
                run);
  ck_assert_msg(tu_accuracy(t[0].W, t[0].b, 0, 512) > 0.5f, "%s: the model did not learn", run);
}

/* ---- 1000 held unauthenticated connections ------------------------------- */

START_TEST(test_held_unauthenticated) {
  tu_psd p;
  ck_assert(tu_psd_start(&p, (const char *const[]){"--workers", "2", "--log-level", "warn",
                                                   NULL}) == 0);
  usleep(200000);
  double idle = -1, s;
  if (psctl_path()) psctl_stats_vs(&p, &idle, &s);
  long rss0 = tu_vm_kib(p.pid, "VmRSS:");
  int fd0 = fd_count(p.pid);
  static int held[HELD];
  for (int i = 0; i < HELD; i++) {
    held[i] = tu_connect(p.addr);
    ck_assert_msg(held[i] >= 0, "connection %d: %s", i, strerror(errno));
    send_partial_hello(held[i]);
  }
  wait_fds(p.pid, fd0 + HELD);
  usleep(300000);
  long rss1 = tu_vm_kib(p.pid, "VmRSS:");
  ck_assert_msg(rss0 > 0 && rss1 > 0 && (rss1 - rss0) * 1024 < HELD * PSD_TEST_RSS_PER_CONN,
                "psd's RSS grew from %ld to %ld KiB for %d unauthenticated connections "
                "(bound %ld bytes each)",
                rss0, rss1, HELD, PSD_TEST_RSS_PER_CONN);
  printf("admission: %d held unauthenticated connections: psd RSS %ld -> %ld KiB (%ld B each)\n",
         HELD, rss0, rss1, (rss1 - rss0) * 1024 / HELD);
  if (psctl_path()) {
    int rc = psctl_stats_vs(&p, &idle, &s);
    ck_assert_msg(rc == 0 && s < tu_time_limit(1.0), "psctl stats: exit %d, %.2f s slower than when psd was "
                  "idle (%.2f s)", rc, s, idle);
  }
  double t0 = ps__now();
  tu_train t[NW];
  train(p.addr, t);
  double dt = ps__now() - t0;
  expect_trained(t, "under 1000 held connections");
  ck_assert_msg(dt < tu_time_limit(5.0), "training took %.2f s with held connections", dt);
  for (int i = 0; i < HELD; i++) close(held[i]);
  ck_assert_msg(tu_psd_wait(&p, 10) == 0 && WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0,
                "psd did not exit 0 after training (log %s)", p.log_path);
}
END_TEST

/* Starts psd with args under a descriptor limit of `limit`: lowered here
 * around the fork, so psd inherits it and this process keeps its own. */
static void start_at_limit(tu_psd *p, rlim_t limit, const char *const *args) {
  struct rlimit old, low;
  ck_assert(getrlimit(RLIMIT_NOFILE, &old) == 0);
  low = old;
  low.rlim_cur = limit;
  ck_assert(setrlimit(RLIMIT_NOFILE, &low) == 0);
  int started = tu_psd_start(p, args);
  setrlimit(RLIMIT_NOFILE, &old);
  ck_assert_msg(started == 0, "psd did not start under ulimit -n %llu (log %s)",
                (unsigned long long)limit, p->log_path);
}

/* Out of descriptors (the attack on an `ulimit -n 128` psd): the cap
 * follows the limit and new connections evict old unauthenticated ones. */
START_TEST(test_descriptor_limit) {
  enum { LIMIT = 128, IDLE = 400 };
  tu_psd p;
  start_at_limit(&p, LIMIT, (const char *const[]){"--workers", "2", NULL});
  double idle_s = -1, s;
  if (psctl_path()) psctl_stats_vs(&p, &idle_s, &s);
  static int idle[IDLE];
  for (int i = 0; i < IDLE; i++) idle[i] = tu_connect(p.addr);
  usleep(300000);
  if (psctl_path()) {
    int rc = psctl_stats_vs(&p, &idle_s, &s);
    ck_assert_msg(rc == 0 && s < tu_time_limit(1.0), "at the descriptor limit: psctl stats: exit %d, %.2f s "
                  "slower than when psd was idle (%.2f s)", rc, s, idle_s);
  }
  double t0 = ps__now();
  tu_train t[NW];
  train(p.addr, t);
  double dt = ps__now() - t0;
  expect_trained(t, "at the descriptor limit");
  ck_assert_msg(dt < tu_time_limit(5.0), "training took %.2f s at the descriptor limit", dt);
  ck_assert_msg(tu_log_contains(&p, "evicted"), "no eviction logged (log %s)", p.log_path);
  for (int i = 0; i < IDLE; i++)
    if (idle[i] >= 0) close(idle[i]);
  ck_assert_msg(tu_psd_wait(&p, 10) == 0 && WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0,
                "psd did not exit 0 (log %s)", p.log_path);
}
END_TEST

/* ---- churn at the descriptor limit: handshakes shed are tried again ------- */

enum {
  CHURN_WINDOW = 700, /* the flood's connections open at once (psd holds 8 or 64) */
  PSCTL_TRIES = 20,   /* psctl stats runs under the flood */
  REJOIN_AT = 10,     /* worker 1 leaves at this step and a new client rejoins */
};
/* The descriptor limits the test runs at: the smallest `ulimit -n` under
 * which a restarted worker rejoins and psctl gets in while the flood runs
 * (16: psd holds 8 connections; at 12 it has no descriptor left for a
 * worker's shared-memory handover; docs/security.md), and the 128
 * (64 connections). PS_TEST_NOFILE runs one limit of one's choosing. */
static const rlim_t CHURN_NOFILE[] = {16, 128};
/* The flood's pace, connections per second: 0, as fast as one thread can
 * open them (PS_TEST_CHURN_RATE sets a pace). */
#define CHURN_RATE 0.0

typedef struct churner {
  int port;          /* psd's */
  double rate;       /* connections opened per second (0: unpaced) */
  int stop;          /* set to end the flood */
  long opened;       /* connections opened so far */
} churner;

/* The flood: silent connections to psd opened as fast as one thread can
 * (or at ch->rate), each closed CHURN_WINDOW connections later. psd, holding far fewer, sheds
 * its oldest unauthenticated one for every new one. */
static void *churn_conns(void *arg) {
  churner *ch = arg;
  int *ring = malloc(CHURN_WINDOW * sizeof *ring);
  ck_assert(ring != NULL);
  for (int i = 0; i < CHURN_WINDOW; i++) ring[i] = -1;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)ch->port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  double t0 = ps__now();
  for (long n = 0; !__atomic_load_n(&ch->stop, __ATOMIC_ACQUIRE); n++) {
    while (ch->rate > 0 && n > (ps__now() - t0) * ch->rate) usleep(200); /* paced */
    int *fd = &ring[n % CHURN_WINDOW];
    if (*fd >= 0) close(*fd);
    *fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (*fd >= 0 && connect(*fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno != EINPROGRESS) {
      close(*fd);
      *fd = -1;
    }
    if (*fd >= 0) __atomic_add_fetch(&ch->opened, 1, __ATOMIC_RELAXED);
  }
  for (int i = 0; i < CHURN_WINDOW; i++)
    if (ring[i] >= 0) close(ring[i]);
  free(ring);
  return NULL;
}

/* Worker 1 as --restart-workers runs it: a client that leaves at step
 * REJOIN_AT without finishing (killed), then a new one of the same index
 * that rejoins and trains to the end. */
static void *leave_and_rejoin(void *arg) {
  tu_train *t = arg;
  t->until = REJOIN_AT;
  t->skip_finish = 1;
  tu_train_worker(t);
  if (t->rc) return NULL;
  t->until = STEPS;
  t->skip_finish = 0;
  return tu_train_worker(t);
}

/* psd under each `ulimit -n` of CHURN_NOFILE while a flood keeps
 * CHURN_WINDOW connections churning: psctl stats gets in at least 95% of
 * PSCTL_TRIES times, and a worker that leaves and comes back (a restart)
 * rejoins; both train to the end. Was: handshakes psd shed were not tried
 * again (psctl got in 7 of 18 times; restarted workers were closed during
 * the handshake and the job was killed). */
START_TEST(test_churn_at_descriptor_limit) {
  const char *env = getenv("PS_TEST_NOFILE");
  rlim_t limit = env && *env ? (rlim_t)strtoul(env, NULL, 10) : CHURN_NOFILE[_i];
  tu_psd p;
  start_at_limit(&p, limit, (const char *const[]){"--workers", "2", "--grace-period", "30",
                                                  NULL});
  const char *renv = getenv("PS_TEST_CHURN_RATE");
  churner ch = {.port = atoi(strrchr(p.addr, ':') + 1),
                .rate = renv && *renv ? atof(renv) : CHURN_RATE};
  pthread_t th;
  pthread_create(&th, NULL, churn_conns, &ch);
  while (__atomic_load_n(&ch.opened, __ATOMIC_RELAXED) < 2 * CHURN_WINDOW) usleep(1000);
  int in = 0;
  double s, slowest = 0;
  for (int i = 0; psctl_path() && i < PSCTL_TRIES; i++) {
    in += psctl_stats(&p, &s) == 0;
    if (s > slowest) slowest = s;
  }
  static char hosts[1][64];
  static const char *hp[1];
  tu_hosts(&p, 1, hosts, hp);
  tu_train t[NW];
  memset(t, 0, sizeof t);
  pthread_t w[NW];
  for (int i = 0; i < NW; i++) {
    t[i] = (tu_train){.hosts = hp, .num_ps = 1, .num_workers = NW, .worker = i, .steps = STEPS,
                      .batch = 16};
    pthread_create(&w[i], NULL, i ? leave_and_rejoin : tu_train_worker, &t[i]);
  }
  for (int i = 0; i < NW; i++) pthread_join(w[i], NULL);
  __atomic_store_n(&ch.stop, 1, __ATOMIC_RELEASE);
  pthread_join(th, NULL);
  printf("admission: ulimit -n %llu, %ld connections churned: psctl stats got in %d of %d "
         "times (slowest %.2f s); worker 1 %s\n", (unsigned long long)limit, ch.opened, in,
         PSCTL_TRIES, slowest, t[1].rc ? "did not rejoin" : "rejoined");
  if (psctl_path())
    ck_assert_msg(in * 100 >= PSCTL_TRIES * 95, "psctl stats got in %d of %d times under the "
                  "flood (log %s)", in, PSCTL_TRIES, p.log_path);
  expect_trained(t, "restarted under churn");
  ck_assert_msg(tu_log_contains(&p, "worker 1 rejoined") && tu_log_contains(&p, "evicted"),
                "no rejoin or no eviction logged (log %s)", p.log_path);
  ck_assert_msg(tu_psd_wait(&p, 10) == 0 && WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0,
                "psd did not exit 0 (log %s)", p.log_path);
}
END_TEST

/* ---- the oldest unauthenticated connection goes first ---------------------- */

static const char *const CAP_OPTS[][2] = {{"--max-unauthenticated", "8"},
                                          {"--max-connections", "8"}};

START_TEST(test_evicts_oldest) {
  tu_psd p;
  ck_assert(tu_psd_start(&p, (const char *const[]){"--workers", "2", CAP_OPTS[_i][0],
                                                   CAP_OPTS[_i][1], NULL}) == 0);
  double idle = -1, s;
  if (psctl_path()) psctl_stats_vs(&p, &idle, &s);
  /* psctl has exited, but psd may not have seen it yet: its connection
   * would still count toward the cap and take a[0]'s eviction. */
  int fd0 = fd_count_settled(p.pid);
  int a[8];
  for (int i = 0; i < 8; i++) {
    a[i] = tu_connect(p.addr);
    ck_assert(a[i] >= 0);
    /* Accepted in this order (the listen queue is first in, first out);
     * the wait only paces the connections. Bounded well inside psd's
     * 10-s handshake limit, which would close a[0] on its own: a wrong
     * count once cost 5 s a connection and failed the test. */
    for (int k = 0; k < 10 && fd_count(p.pid) < fd0 + i + 1; k++) usleep(50000);
  }
  wait_fds(p.pid, fd0 + 8);
  ck_assert_msg(fd_count(p.pid) >= fd0 + 8, "psd holds %d descriptors, %d + 8 expected (log %s)",
                fd_count(p.pid), fd0, p.log_path);
  int b = tu_connect(p.addr);
  ck_assert(b >= 0);
  ck_assert_msg(closed_within(a[0], 2.0), "%s 8: the oldest connection was not evicted",
                CAP_OPTS[_i][0]);
  for (int i = 1; i < 8; i++)
    ck_assert_msg(still_open(a[i]), "%s 8: connection %d (not the oldest) was closed (log %s)",
                  CAP_OPTS[_i][0], i, p.log_path);
  ck_assert_msg(tu_log_contains(&p, "evicted after"), "no eviction logged (log %s)",
                p.log_path);
  if (psctl_path()) {
    int rc = psctl_stats_vs(&p, &idle, &s);
    ck_assert_msg(rc == 0 && s < tu_time_limit(1.0), "%s 8 full: psctl stats: exit %d, %.2f s slower than "
                  "when psd was idle (%.2f s)", CAP_OPTS[_i][0], rc, s, idle);
  }
  /* Both caps full of unauthenticated peers: workers still get in. */
  tu_train t[NW];
  train(p.addr, t);
  expect_trained(t, CAP_OPTS[_i][0]);
  for (int i = 0; i < 8; i++) close(a[i]);
  close(b);
  ck_assert(tu_psd_wait(&p, 10) == 0);
}
END_TEST

START_TEST(test_admin_cap) {
  tu_psd p;
  ck_assert(tu_psd_start(&p, (const char *const[]){"--workers", "1", "--max-admin", "0",
                                                   NULL}) == 0);
  double s;
  int rc = psctl_stats(&p, &s);
  ck_assert_msg(rc != 0, "psctl got in past --max-admin 0");
  usleep(200000);
  ck_assert_msg(tu_log_contains(&p, "too many admin connections"),
                "the refusal is not logged (log %s)", p.log_path);
  tu_psd_kill(&p);
  ck_assert(tu_psd_start(&p, (const char *const[]){"--workers", "1", "--max-admin", "1",
                                                   NULL}) == 0);
  for (int i = 0; i < 3; i++) { /* one at a time: each frees its slot */
    usleep(100000);
    rc = psctl_stats(&p, &s);
    ck_assert_msg(rc == 0, "psctl %d with --max-admin 1: exit %d (log %s)", i, rc, p.log_path);
  }
  tu_psd_kill(&p);
}
END_TEST

/* ---- a flood of bad frames: a short log ----------------------------------- */

START_TEST(test_bad_frame_flood) {
  tu_psd p;
  ck_assert(tu_psd_start(&p, (const char *const[]){"--workers", "1", NULL}) == 0);
  usleep(100000);
  int before = tu_log_count(&p, "\n");
  static const uint8_t junk[PS__HEADER_SIZE] = "this is not a psd frame";
  int sent = 0;
  double t0 = ps__now();
  while (ps__now() - t0 < 3.0) {
    int fd = tu_connect(p.addr);
    if (fd < 0) continue;
    tu_send_all(fd, junk, sizeof junk);
    close(fd);
    sent++;
  }
  usleep(1500000); /* the last window's summary */
  int lines = tu_log_count(&p, "\n") - before;
  /* Per kind: PS__RATELOG_BURST a second over ~4 windows, plus summaries. */
  ck_assert_msg(sent > 200, "only %d bad frames sent", sent);
  ck_assert_msg(lines <= 2 * 4 * (int)(PS__RATELOG_BURST + 1),
                "%d log lines for %d bad frames (log %s)", lines, sent, p.log_path);
  ck_assert_msg(tu_log_count(&p, "suppressed") >= 1, "no 'suppressed' summary (log %s)",
                p.log_path);
  printf("admission: %d bad frames in 3 s -> %d log lines\n", sent, lines);
  tu_psd_kill(&p);
}
END_TEST

/* ---- keepalive ------------------------------------------------------------- */

/* The keepalive timer of psd's side of the connection whose peer is our
 * local port: seconds until it fires, -1 if no keepalive timer runs, -2
 * if the socket is not found. From /proc/net/tcp ("tr:tm->when"). */
static double keepalive_timer(int psd_port, int our_port) {
  FILE *f = fopen("/proc/net/tcp", "r");
  if (!f) return -2;
  char line[512];
  double r = -2;
  while (fgets(line, sizeof line, f)) {
    unsigned lport, rport, st, tr;
    unsigned long when;
    if (sscanf(line, " %*d: %*x:%x %*x:%x %x %*x:%*x %x:%lx", &lport, &rport, &st, &tr,
               &when) != 5)
      continue;
    if ((int)lport != psd_port || (int)rport != our_port || st != 1) continue;
    r = tr == 2 ? (double)when / (double)sysconf(_SC_CLK_TCK) : -1;
  }
  fclose(f);
  return r;
}

static double probe_keepalive(const char *seconds) {
  tu_psd p;
  ck_assert(tu_psd_start(&p, (const char *const[]){"--workers", "1", "--keepalive", seconds,
                                                   NULL}) == 0);
  int fd = tu_connect(p.addr);
  ck_assert(fd >= 0);
  usleep(200000);
  struct sockaddr_in me;
  socklen_t ml = sizeof me;
  getsockname(fd, (struct sockaddr *)&me, &ml);
  int port = atoi(strrchr(p.addr, ':') + 1);
  double r = keepalive_timer(port, ntohs(me.sin_port));
  close(fd);
  tu_psd_kill(&p);
  ck_assert_msg(r > -2, "psd's socket not found in /proc/net/tcp");
  return r;
}

START_TEST(test_keepalive) {
  double on = probe_keepalive("4"), off = probe_keepalive("0");
  ck_assert_msg(on >= 0 && on <= 2.0 + 0.05,
                "--keepalive 4: keepalive timer %.2f s (want one within TCP_KEEPIDLE 2 s)", on);
  ck_assert_msg(off == -1, "--keepalive 0: a keepalive timer runs (%.2f s)", off);
  on = probe_keepalive("20"); /* the default's TCP_KEEPIDLE: 10 s */
  ck_assert_msg(on > 5.0 && on <= 10.05, "--keepalive 20: keepalive timer %.2f s", on);
}
END_TEST

Suite *suite_admission(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 ||
      (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < HELD + FD_SLACK)) {
    printf("SKIP: admission: the descriptor limit's hard maximum is below %d\n",
           HELD + FD_SLACK);
    return NULL;
  }
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < HELD + FD_SLACK) {
    rl.rlim_cur = HELD + FD_SLACK; /* for us and the psd processes we start */
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  Suite *s = suite_create("admission");
  TCase *tc = tcase_create("caps");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_held_unauthenticated);
  tcase_add_test(tc, test_descriptor_limit);
  tcase_add_loop_test(tc, test_churn_at_descriptor_limit, 0,
                      (int)(sizeof CHURN_NOFILE / sizeof CHURN_NOFILE[0]));
  tcase_add_loop_test(tc, test_evicts_oldest, 0, 2);
  if (psctl_path()) tcase_add_test(tc, test_admin_cap);
  else tu_skip_tests("admission", "test_admin_cap", "psctl is not built");
  tcase_add_test(tc, test_bad_frame_flood);
  tcase_add_test(tc, test_keepalive);
  suite_add_tcase(s, tc);
  return s;
}
