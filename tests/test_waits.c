/* Every wait bounded and explained, against real psd processes: a push psd
 * refuses fails the call at once with psd's sentence; a restarted worker's
 * duplicate push counts as applied; a client that cannot connect says
 * which host it is still trying. (psd's wait for a worker still connected
 * after the others finished: the lifecycle suite.) */
#include <arpa/inet.h>
#include <check.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* A client for worker `index` of `nw` on one ps; request_ms 0: default. */
static ps_client *connect_worker(const char **hp, int index, int nw, int request_ms) {
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.worker_index = index;
  cfg.num_workers = nw;
  cfg.request_timeout_ms = request_ms;
  cfg.telemetry = "off";
  char err[512];
  ps_client *c = NULL;
  /* A restarted worker may reach psd before psd has seen its predecessor's
   * connection close ("already connected"): try again briefly. */
  int rc = PS_EBUSY;
  for (int i = 0; i < 50 && rc == PS_EBUSY; i++) {
    rc = ps_client_create(&cfg, &c, err, sizeof err);
    if (rc == PS_EBUSY) usleep(100 * 1000);
  }
  ck_assert_msg(rc == 0, "worker %d: %s", index, err);
  return c;
}

static void start_one(tu_psd *ps, char hosts[][64], const char **hp, const char *const *extra) {
  const char *args[16] = {"--ps-index", "0", "--num-ps", "1"};
  int k = 4;
  for (int j = 0; extra && extra[j] && k < 15; j++) args[k++] = extra[j];
  args[k] = NULL;
  ck_assert_msg(tu_psd_start(ps, args) == 0, "psd did not start");
  tu_hosts(ps, 1, hosts, hp);
}

/* Two small variables: the second is refused too, the first named. */
static void make_vars(ps_client *c) {
  int64_t shape[1] = {4};
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create(c, "a", shape, 1, NULL, NULL, &v), 0);
  ck_assert_int_eq(ps_client_var_create(c, "b", shape, 1, NULL, NULL, &v), 0);
}

/* A push for a step the servers have not reached is refused by psd at
 * once; the call returns at once too (not after the request timeout),
 * with psd's sentence naming the server, and leaves *step alone. */
START_TEST(refused_push_fails_at_once) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start_one(&ps, hosts, hp, NULL);
  ps_client *c = connect_worker(hp, 0, 1, 20000);
  make_vars(c);
  uint64_t step = 3;
  double t0 = now_s();
  int rc = ps_client_step(c, &step, NULL);
  double took = now_s() - t0;
  const char *m = ps_client_errmsg(c);
  ck_assert_msg(rc == PS_EINVAL, "rc %d (%s): %s", rc, ps_strerror(rc), m);
  ck_assert_msg(took < tu_time_limit(1.5), "the refused step took %.1f s", took);
  ck_assert_msg(strstr(m, "ps 0 at ") && strstr(m, hosts[0]), "names the server: %s", m);
  ck_assert_msg(strstr(m, "for step 3, but the slice is only at step 0"), "psd's why: %s", m);
  ck_assert_int_eq(step, 3);
  /* The same client goes on from the step it really is at. */
  step = 0;
  ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "%s", ps_client_errmsg(c));
  ck_assert_int_eq(step, 1);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  ck_assert_msg(tu_psd_wait(&ps, 10) == 0, "psd did not exit");
}
END_TEST

/* One worker's step on its own thread (the other must push too). */
typedef struct stepper {
  ps_client *c;    /* the worker */
  uint64_t step;   /* in: its step; out: the new one */
  int rc;          /* ps_client_step's result */
  char err[512];   /* ... and its message */
} stepper;

static void *step_thread(void *arg) {
  stepper *s = arg;
  usleep(200 * 1000); /* the restarted worker's push comes first */
  s->rc = ps_client_step(s->c, &s->step, NULL);
  snprintf(s->err, sizeof s->err, "%s", ps_client_errmsg(s->c));
  return NULL;
}

/* Worker 0 pushes step 0 and dies; its replacement pushes step 0 again:
 * psd already has that gradient (PS_EDUPLICATE), which ps_client_step
 * takes as applied: the pull still happens and the step advances. */
START_TEST(restarted_worker_duplicate_is_applied) {
  tu_psd ps;
  char hosts[1][64];
  const char *hp[1];
  start_one(&ps, hosts, hp, NULL);
  ps_client *w0 = connect_worker(hp, 0, 2, 20000);
  ps_client *w1 = connect_worker(hp, 1, 2, 20000);
  make_vars(w0);
  make_vars(w1);
  ps_req *r = NULL;
  ck_assert_int_eq(ps_client_push_async(w0, 0, NULL, 0, &r), 0);
  ck_assert_msg(ps_req_wait(r, -1, NULL) == 0, "%s", ps_client_errmsg(w0));
  ps_req_destroy(r);
  ps_client_destroy(w0);
  w0 = connect_worker(hp, 0, 2, 20000);
  make_vars(w0);
  uint64_t step = 0;
  ck_assert_msg(ps_client_pull(w0, 0, &step) == 0, "%s", ps_client_errmsg(w0));
  ck_assert_int_eq(step, 0);
  for (int round = 0; round < 2; round++) {
    stepper other = {w1, step, 0, ""};
    pthread_t th;
    pthread_create(&th, NULL, step_thread, &other);
    int rc = ps_client_step(w0, &step, NULL);
    pthread_join(th, NULL);
    ck_assert_msg(rc == 0, "round %d: restarted worker: rc %d: %s", round, rc,
                  ps_client_errmsg(w0));
    ck_assert_msg(other.rc == 0, "round %d: worker 1: %s", round, other.err);
    ck_assert_int_eq(step, (uint64_t)round + 1);
    ck_assert_int_eq(other.step, (uint64_t)round + 1);
  }
  /* The request-level answer stays PS_EDUPLICATE, with psd's sentence. */
  ck_assert_int_eq(ps_client_push_async(w0, step, NULL, 0, &r), 0);
  ck_assert_msg(ps_req_wait(r, -1, NULL) == 0, "%s", ps_client_errmsg(w0));
  ps_req_destroy(r);
  ck_assert_int_eq(ps_client_push_async(w0, step, NULL, 0, &r), 0);
  ck_assert_int_eq(ps_req_wait(r, -1, NULL), PS_EDUPLICATE);
  ck_assert_msg(strstr(ps_client_errmsg(w0), "already pushed its gradient of 'a' for step 2"),
                "%s", ps_client_errmsg(w0));
  ps_req_destroy(r);
  ps_client_destroy(w0);
  ps_client_destroy(w1);
  tu_psd_kill(&ps);
}
END_TEST

/* A client pointed at a port nobody listens on (5 s connect timeout)
 * says on stderr, while it retries, which host it is still trying and for
 * how long; the final error names it too. */
START_TEST(connect_progress_names_the_host) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  ck_assert(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
  ck_assert(getsockname(fd, (struct sockaddr *)&a, &len) == 0);
  close(fd); /* nothing listens there now: connects are refused */
  char host[64], path[600];
  snprintf(host, sizeof host, "127.0.0.1:%u", ntohs(a.sin_port));
  snprintf(path, sizeof path, "%s/connect_stderr.txt", tu_tmpdir());
  const char *hp[1] = {host};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.connect_timeout_ms = 5000;
  cfg.telemetry = "off";
  fflush(stderr);
  int saved = dup(2), out = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ck_assert(saved >= 0 && out >= 0);
  dup2(out, 2);
  close(out);
  ps_client *c = NULL;
  char err[512] = "";
  double t0 = now_s();
  int rc = ps_client_create(&cfg, &c, err, sizeof err);
  double took = now_s() - t0;
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  char *said = tu_read_file(path);
  ck_assert_msg(rc == PS_ECONNECT, "rc %d: %s", rc, err);
  ck_assert_msg(took >= 4 && took < tu_time_limit(8), "gave up after %.1f s", took);
  ck_assert_msg(strstr(err, host), "the error names the host: %s", err);
  char want[200];
  snprintf(want, sizeof want, "still trying to reach ps 0 at %s after ", host);
  ck_assert_msg(said && strstr(said, want) && strstr(said, "of the 5 s connect timeout"),
                "a progress line names the host; stderr was:\n%s", said ? said : "(none)");
  free(said);
}
END_TEST

Suite *suite_waits(void) {
  Suite *s = suite_create("waits");
  TCase *tc = tcase_create("waits");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, refused_push_fails_at_once);
  tcase_add_test(tc, restarted_worker_duplicate_is_applied);
  tcase_add_test(tc, connect_progress_names_the_host);
  suite_add_tcase(s, tc);
  return s;
}
