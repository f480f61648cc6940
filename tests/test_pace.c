/* Integration: psd/pace.c, ingress pacing of synchronous pushes.
 *
 * Worker 1 reaches psd through a relay in this process that forwards its
 * bytes only up to a limit the test sets, so its push can be held half way
 * like a flow starved on a shared link. Worker 0 connects directly and
 * pushes a 16 MB gradient. With pacing, psd must stop reading worker 0's
 * push near worker 1's progress (so its PushReply cannot come while worker 1
 * is held), and let it go the moment worker 1 catches up or goes away.
 * Without pacing (--pace-ahead 0), or with backup workers, worker 0's push
 * completes at once: that is the control showing the test can fail. The
 * relay is on 127.0.0.1, so psd runs with --pace-loopback (loopback peers
 * are exempt by default, also tested). Every
 * run ends with parameters equal to the average of both gradients. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

enum {
  N = 4 << 20,                /* floats in the variable: a 16 MB push */
  HELD_AT = 1 << 20,          /* worker 1's push bytes let through while held */
  SLICE = 1 << 20,            /* 4 MiB slices */
};
#define LR 0.5
#define HOLD_MS 700           /* how long worker 0's push must stay unanswered */
#define DONE_S 20.0           /* bound on everything that must complete */

/* ---- relay: worker 1 <-> psd, the worker's direction limited ------------- */

typedef struct relay {
  int lfd;                    /* listening socket for worker 1 */
  char addr[64];              /* its "127.0.0.1:PORT" */
  char target[64];            /* psd's address */
  _Atomic unsigned long long limit;     /* worker->psd bytes allowed in all */
  _Atomic unsigned long long forwarded; /* worker->psd bytes forwarded so far */
  atomic_int cut;             /* 1: reset both connections and stop */
  atomic_int stop;            /* 1: stop (at the end of the test) */
  pthread_t th;
} relay;

static void *relay_main(void *arg) {
  relay *r = arg;
  int c = accept(r->lfd, NULL, NULL);
  int u = c >= 0 ? tu_connect(r->target) : -1;
  static char buf[1 << 16];
  while (c >= 0 && u >= 0 && !atomic_load(&r->stop)) {
    if (atomic_load(&r->cut)) {
      struct linger lg = {1, 0}; /* RST, as a dying host's kernel would not */
      setsockopt(c, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
      setsockopt(u, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
      break;
    }
    unsigned long long room = atomic_load(&r->limit) - atomic_load(&r->forwarded);
    struct pollfd p[2] = {{c, room ? POLLIN : 0, 0}, {u, POLLIN, 0}};
    if (poll(p, 2, 10) < 0 && errno != EINTR) break;
    if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      size_t want = room < sizeof buf ? (size_t)room : sizeof buf;
      ssize_t n = read(c, buf, want);
      if (n <= 0 || tu_send_all(u, buf, (size_t)n) != 0) break;
      atomic_fetch_add(&r->forwarded, (unsigned long long)n);
    }
    if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t n = read(u, buf, sizeof buf);
      if (n <= 0 || tu_send_all(c, buf, (size_t)n) != 0) break;
    }
  }
  if (c >= 0) close(c);
  if (u >= 0) close(u);
  return NULL;
}

static void relay_start(relay *r, const char *target) {
  memset(r, 0, sizeof *r);
  atomic_store(&r->limit, ~0ULL);
  snprintf(r->target, sizeof r->target, "%s", target);
  r->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  ck_assert(r->lfd >= 0 && bind(r->lfd, (struct sockaddr *)&a, sizeof a) == 0 &&
            listen(r->lfd, 1) == 0 && getsockname(r->lfd, (struct sockaddr *)&a, &len) == 0);
  snprintf(r->addr, sizeof r->addr, "127.0.0.1:%d", ntohs(a.sin_port));
  ck_assert(pthread_create(&r->th, NULL, relay_main, r) == 0);
}

static void relay_stop(relay *r) {
  atomic_store(&r->stop, 1);
  shutdown(r->lfd, SHUT_RDWR); /* wakes an accept that never got a peer */
  pthread_join(r->th, NULL);
  close(r->lfd);
}

/* ---- workers ------------------------------------------------------------ */

static float grad_of(int worker, size_t i) { return (float)(worker + 1) * (float)(i % 7); }

typedef struct wk {
  int index;                  /* worker index */
  const char *addr;           /* where it connects */
  int replicas;               /* replicas_to_aggregate */
  ps_client *c;
  ps_var *v;
  int rc;                     /* first error */
  char err[256];
  uint64_t step;              /* after its step */
} wk;

static void wk_open(wk *w) {
  const char *hosts[1] = {w->addr};
  ps_config cfg = PS_SIZED(ps_config, .hosts = hosts, .num_ps = 1, .worker_index = w->index, .num_workers = 2,
                   .replicas_to_aggregate = w->replicas, .connect_timeout_ms = 10000,
                   .request_timeout_ms = (int)(DONE_S * 1000), .max_slice_bytes = SLICE,
                   .transport = PS_TRANSPORT_TCP); /* as its psd: pacing is TCP's */
  w->rc = ps_client_create(&cfg, &w->c, w->err, sizeof w->err);
  if (w->rc) return;
  int64_t shape[1] = {N};
  ps_init init = PS_SIZED(ps_init, .kind = PS_INIT_CONSTANT, .a = 1.0);
  ps_optimizer opt = PS_SIZED(ps_optimizer, .kind = PS_OPT_SGD, .lr = LR);
  w->rc = ps_client_var_create(w->c, "big", shape, 1, &init, &opt, &w->v);
  if (w->rc) {
    snprintf(w->err, sizeof w->err, "%s", ps_client_errmsg(w->c));
    return;
  }
  float *g = ps_var_grad(w->v);
  for (size_t i = 0; i < N; i++) g[i] = grad_of(w->index, i);
}

static void *wk_open_thread(void *arg) {
  wk_open(arg);
  return NULL;
}

/* Worker 1's whole step, in its own thread while the test holds it. */
static void *wk_step_thread(void *arg) {
  wk *w = arg;
  uint64_t step = 0;
  w->rc = ps_client_step(w->c, &step, NULL);
  if (w->rc) snprintf(w->err, sizeof w->err, "%s", ps_client_errmsg(w->c));
  w->step = step;
  return NULL;
}

/* The parameters after one step that averaged both workers' gradients. */
static void check_params(wk *w) {
  const float *d = ps_var_data(w->v);
  for (size_t i = 0; i < N; i += 997) {
    float want = 1.0f - (float)LR * (grad_of(0, i) + grad_of(1, i)) / 2.0f;
    ck_assert_msg(fabsf(d[i] - want) <= 1e-5f, "worker %d param[%zu] %g, want %g", w->index,
                  i, d[i], want);
  }
}

enum { HOLD_EXPECTED, NO_HOLD_EXPECTED };
enum { LAGGARD_CATCHES_UP, LAGGARD_DIES, LAGGARD_STALE };

/* One scenario: psd with extra args; worker 1 held at HELD_AT bytes of its
 * push; worker 0's push must (not) stay unanswered for HOLD_MS; then worker
 * 1 is released, cut off or (with a backup) left stale, and worker 0's push must complete. */
static void scenario(const char *const *extra, int replicas, int expect, int ending) {
  tu_psd ps;
  const char *args[16] = {"--workers", "2", "--recv-buffer", "65536", "--grace-period", "30"};
  int k = 6;
  for (int j = 0; extra[j]; j++) args[k++] = extra[j];
  args[k] = NULL;
  ck_assert_msg(tu_psd_start(&ps, args) == 0, "psd did not start");
  relay r;
  relay_start(&r, ps.addr);

  wk w0 = {.index = 0, .addr = ps.addr, .replicas = replicas};
  wk w1 = {.index = 1, .addr = r.addr, .replicas = replicas};
  pthread_t th;
  ck_assert(pthread_create(&th, NULL, wk_open_thread, &w1) == 0);
  wk_open(&w0);
  pthread_join(th, NULL);
  ck_assert_msg(w0.rc == 0, "worker 0: %s (%s)", ps_strerror(w0.rc), w0.err);
  ck_assert_msg(w1.rc == 0, "worker 1: %s (%s)", ps_strerror(w1.rc), w1.err);

  /* Hold worker 1 a little way into its push, then let both push. */
  atomic_store(&r.limit, atomic_load(&r.forwarded) + HELD_AT);
  ck_assert(pthread_create(&th, NULL, wk_step_thread, &w1) == 0);
  while (atomic_load(&r.forwarded) < atomic_load(&r.limit)) usleep(1000);
  ps_req *push = NULL;
  ck_assert_int_eq(ps_client_push_async(w0.c, 0, NULL, 0, &push), 0);
  int rc = ps_req_wait(push, HOLD_MS, NULL);
  if (expect == HOLD_EXPECTED)
    ck_assert_msg(rc == PS_ETIMEDOUT,
                  "worker 0's 16 MB push was answered (%s) while worker 1 was held at %d bytes:"
                  " psd did not pace it",
                  ps_strerror(rc), HELD_AT);
  else
    ck_assert_msg(rc == 0, "worker 0's push was not answered while worker 1 was held: %s",
                  ps_strerror(rc));

  if (ending == LAGGARD_CATCHES_UP) {
    atomic_store(&r.limit, ~0ULL);
    ck_assert_msg(ps_req_wait(push, (int)(DONE_S * 1000), NULL) == 0, "worker 0's push: %s",
                  ps_client_errmsg(w0.c));
    ps_req_destroy(push);
    ps_req *pull = NULL;
    uint64_t step = 0;
    ck_assert_int_eq(ps_client_pull_async(w0.c, 1, NULL, 0, &pull), 0);
    ck_assert_msg(ps_req_wait(pull, (int)(DONE_S * 1000), &step) == 0, "worker 0's pull: %s",
                  ps_client_errmsg(w0.c));
    ps_req_destroy(pull);
    ck_assert_uint_eq(step, 1);
    pthread_join(th, NULL);
    ck_assert_msg(w1.rc == 0, "worker 1's step: %s (%s)", ps_strerror(w1.rc), w1.err);
    ck_assert_uint_eq(w1.step, 1);
    check_params(&w0);
    check_params(&w1);
    ck_assert_int_eq(ps_client_finish(w0.c), 0);
    ck_assert_int_eq(ps_client_finish(w1.c), 0);
    ck_assert_msg(tu_psd_wait(&ps, DONE_S) == 0 && WIFEXITED(ps.status) &&
                      WEXITSTATUS(ps.status) == 0,
                  "psd did not exit cleanly after both workers finished");
  } else if (ending == LAGGARD_STALE) {
    /* Step 0 completed without worker 1: its gradient is stale now and its
     * step() skips ahead. */
    ps_req_destroy(push);
    atomic_store(&r.limit, ~0ULL);
    pthread_join(th, NULL);
    ck_assert_msg(w1.rc == 0, "worker 1's step: %s (%s)", ps_strerror(w1.rc), w1.err);
  } else {
    /* Worker 1's host dies half way through its push: worker 0 must not
     * stay held by a connection that is gone. */
    atomic_store(&r.cut, 1);
    ck_assert_msg(ps_req_wait(push, (int)(DONE_S * 1000), NULL) == 0,
                  "worker 0's push after worker 1 was cut off: %s", ps_client_errmsg(w0.c));
    ps_req_destroy(push);
    pthread_join(th, NULL);
    ck_assert_msg(w1.rc != 0, "worker 1's step succeeded through a cut connection");
    ck_assert(tu_log_contains(&ps, "worker 1") && tu_log_contains(&ps, "connection lost"));
    tu_psd_kill(&ps);
  }
  ps_client_destroy(w0.c);
  ps_client_destroy(w1.c);
  relay_stop(&r);
  tu_psd_kill(&ps);
}

/* Every psd here runs --transport tcp: pacing holds back TCP (the relay
 * stands for a shared link), and shared memory never crosses a link. */
START_TEST(test_leader_held_until_laggard_catches_up) {
  const char *extra[] = {"--transport", "tcp", "--pace-ahead", "262144", "--pace-loopback", NULL};
  scenario(extra, 0, HOLD_EXPECTED, LAGGARD_CATCHES_UP);
}
END_TEST

START_TEST(test_without_pacing_leader_runs_ahead) {
  const char *extra[] = {"--transport", "tcp", "--pace-ahead", "0", NULL};
  scenario(extra, 0, NO_HOLD_EXPECTED, LAGGARD_CATCHES_UP);
}
END_TEST

/* Workers on this host reach psd over loopback, which shares no network
 * link: by default they are not paced (the cost would be CPU for nothing). */
START_TEST(test_loopback_not_paced_by_default) {
  const char *extra[] = {"--transport", "tcp", "--pace-ahead", "262144", NULL};
  scenario(extra, 0, NO_HOLD_EXPECTED, LAGGARD_CATCHES_UP);
}
END_TEST

START_TEST(test_backup_workers_not_paced) {
  /* replicas_to_aggregate 1 of 2: nobody waits for the slowest, so pacing
   * must not make them. Worker 0's push then completes step 0 alone. */
  const char *extra[] = {"--transport", "tcp", "--replicas-to-aggregate", "1", "--pace-ahead", "262144",
                         "--pace-loopback", NULL};
  scenario(extra, 1, NO_HOLD_EXPECTED, LAGGARD_STALE);
}
END_TEST

START_TEST(test_laggard_dies_leader_released) {
  const char *extra[] = {"--transport", "tcp", "--pace-ahead", "262144", "--pace-loopback", NULL};
  scenario(extra, 0, HOLD_EXPECTED, LAGGARD_DIES);
}
END_TEST

Suite *suite_pace(void) {
  Suite *s = suite_create("pace");
  TCase *t = tcase_create("pace");
  tcase_set_timeout(t, 120);
  tcase_add_test(t, test_leader_held_until_laggard_catches_up);
  tcase_add_test(t, test_without_pacing_leader_runs_ahead);
  tcase_add_test(t, test_backup_workers_not_paced);
  tcase_add_test(t, test_loopback_not_paced_by_default);
  tcase_add_test(t, test_laggard_dies_leader_released);
  suite_add_tcase(s, t);
  return s;
}
