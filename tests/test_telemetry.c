/* Integration: per-step telemetry (libpsclient/src/ps_telemetry.c and
 * psd/telemetry.c) with real psd processes, the end-of-run summary, and
 * psctl's Stats exchange (psrun/admin.c, psrun/psctl.c). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ps.pb-c.h"
#include "wire.h"
#include "admin.h"
#include "testutil.h"

#define SECRET "telemetry-test-secret-0123456789"

/* A worker that sleeps sleep_ms before every step (its "compute"). */
typedef struct slow_worker {
  const char *host;      /* the one ps */
  int worker, nw, steps; /* who, of how many, how long */
  int sleep_ms;          /* compute time per step */
  const char *telemetry; /* ps_config.telemetry */
  int rc;                /* first error */
  char err[300];
  int async_mode;        /* ps_config.async_mode */
  int transport;         /* ps_config.transport (0: the default) */
  const int *hold;       /* NULL, or: after its steps, waits while *hold */
  int tables;            /* 2 sparse tables instead of the variable */
} slow_worker;

#define TW_TABLES 2

/* Tables "a" and "b" (dim 2) in t. 0 or the error. */
static int tw_create(ps_client *c, ps_table **t) {
  ps_table_config tc;
  ps_table_config_init(&tc);
  tc.dim = 2;
  tc.capacity = 100;
  const char *names[TW_TABLES] = {"a", "b"};
  int rc = 0;
  for (int i = 0; i < TW_TABLES && !rc; i++) rc = ps_client_table_create(c, names[i], &tc, &t[i]);
  return rc;
}

/* One step's work on the tables: pull two keys' rows, add their gradients. */
static int tw_step(ps_table **t, int worker, uint64_t step) {
  uint64_t keys[2] = {1 + (uint64_t)worker, 100};
  float rows[4], g[4] = {0.1f, 0.1f, 0.1f, 0.1f};
  int rc = 0;
  for (int i = 0; i < TW_TABLES && !rc; i++) {
    rc = ps_table_pull(t[i], step, keys, 2, rows, 0, NULL);
    if (!rc) rc = ps_table_add_grad(t[i], keys, 2, g);
  }
  return rc;
}

static void *slow_main(void *arg) {
  slow_worker *s = arg;
  const char *hosts[1] = {s->host};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hosts;
  cfg.num_ps = 1;
  cfg.worker_index = s->worker;
  cfg.num_workers = s->nw;
  cfg.credential = SECRET;
  cfg.credential_len = strlen(SECRET);
  cfg.telemetry = s->telemetry;
  cfg.async_mode = s->async_mode;
  cfg.transport = s->transport;
  ps_client *c = NULL;
  s->rc = ps_client_create(&cfg, &c, s->err, sizeof s->err);
  if (s->rc) return NULL;
  int64_t shape[1] = {16};
  ps_var *v;
  ps_table *t[TW_TABLES];
  if (s->tables) s->rc = tw_create(c, t);
  else s->rc = ps_client_var_create(c, "v", shape, 1, NULL, NULL, &v);
  uint64_t step = 0;
  if (!s->rc) s->rc = ps_client_pull(c, 0, &step);
  for (int i = 0; i < s->steps && !s->rc; i++) {
    struct timespec ts = {0, s->sleep_ms * 1000000L};
    nanosleep(&ts, NULL);
    if (s->tables) s->rc = tw_step(t, s->worker, step);
    if (!s->rc) s->rc = ps_client_step(c, &step, NULL);
  }
  while (!s->rc && s->hold && __atomic_load_n(s->hold, __ATOMIC_ACQUIRE)) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  if (!s->rc) s->rc = ps_client_finish(c);
  if (s->rc) snprintf(s->err, sizeof s->err, "%s", ps_client_errmsg(c));
  ps_client_destroy(c);
  return NULL;
}

/* Joins n workers; each must have succeeded. */
static void join_ok(pthread_t *th, slow_worker *w, int n) {
  for (int i = 0; i < n; i++) {
    pthread_join(th[i], NULL);
    ck_assert_msg(w[i].rc == 0, "worker %d: %s (%s)", i, ps_strerror(w[i].rc), w[i].err);
  }
}

/* psd for 2 workers writing its summary to sum and its records to pst
 * (files `tag`.txt and `tag`.ps0 in the test's directory). */
static void start_recording(tu_psd *ps, char *sum, char *pst, size_t len, const char *tag) {
  snprintf(sum, len, "%s/%s.txt", tu_tmpdir(), tag);
  snprintf(pst, len, "%s/%s.ps0", tu_tmpdir(), tag);
  tu_psd_secret = SECRET;
  const char *args[] = {"--workers", "2", "--summary", sum, "--telemetry", pst, NULL};
  ck_assert_int_eq(tu_psd_start(ps, args), 0);
  tu_psd_secret = NULL;
}

/* Median of the numbers after `key` on every line of a JSON-lines file
 * that contains `filter`; *lines gets how many matched. */
static double median_field(const char *path, const char *filter, const char *key, int *lines) {
  char *text = tu_read_file(path);
  ck_assert_msg(text != NULL, "cannot read %s", path);
  double v[4096];
  int n = 0;
  *lines = 0;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    if (!strstr(line, filter)) continue;
    (*lines)++;
    char *p = strstr(line, key);
    ck_assert_msg(p != NULL, "line without %s: %s", key, line);
    if (n < 4096) v[n++] = strtod(p + strlen(key), NULL);
  }
  free(text);
  return ps__percentile(v, (size_t)n, 50);
}

/* Two workers, one 6 ms slower per step: psd's summary names it the
 * straggler, the other's records show it waiting for the aggregate, and
 * both files hold one record per step. */
/* The same two workers in async mode: nobody waits, so the summary names
 * no straggler (it did, from arrival order alone). */
START_TEST(test_async_has_no_straggler) {
  enum { STEPS = 30 };
  char sum[600];
  snprintf(sum, sizeof sum, "%s/summary-async.txt", tu_tmpdir());
  tu_psd_secret = SECRET;
  tu_psd ps;
  const char *args[] = {"--workers", "2", "--summary", sum, NULL};
  ck_assert_int_eq(tu_psd_start(&ps, args), 0);
  tu_psd_secret = NULL;
  slow_worker w[2];
  pthread_t th[2];
  memset(w, 0, sizeof w);
  for (int i = 0; i < 2; i++) {
    w[i] = (slow_worker){.host = ps.addr, .worker = i, .nw = 2, .steps = STEPS,
                         .sleep_ms = i == 1 ? 8 : 2, .async_mode = 1};
    pthread_create(&th[i], NULL, slow_main, &w[i]);
  }
  join_ok(th, w, 2);
  ck_assert_int_eq(tu_psd_wait(&ps, 10), 0);
  char *s = tu_read_file(sum);
  ck_assert_msg(s != NULL, "no summary at %s", sum);
  ck_assert_msg(strstr(s, "straggler: none (async mode"), "async summary:\n%s", s);
  ck_assert_msg(!strstr(s, "w1*") && !strstr(s, "w0*"), "a straggler is marked:\n%s", s);
  free(s);
}
END_TEST

START_TEST(test_straggler_summary) {
  enum { STEPS = 40 };
  char sum[600], pst[600], wt[2][600];
  tu_psd ps;
  start_recording(&ps, sum, pst, sizeof sum, "straggler");
  slow_worker w[2];
  pthread_t th[2];
  memset(w, 0, sizeof w);
  for (int i = 0; i < 2; i++) {
    snprintf(wt[i], sizeof wt[i], "%s/tel.w%d", tu_tmpdir(), i);
    w[i] = (slow_worker){.host = ps.addr, .worker = i, .nw = 2, .steps = STEPS,
                         .sleep_ms = i == 1 ? 8 : 2, .telemetry = wt[i]};
    pthread_create(&th[i], NULL, slow_main, &w[i]);
  }
  join_ok(th, w, 2);
  ck_assert_int_eq(tu_psd_wait(&ps, 10), 0);
  ck_assert(WIFEXITED(ps.status) && WEXITSTATUS(ps.status) == 0);

  char *s = tu_read_file(sum);
  ck_assert_msg(s != NULL, "no summary at %s", sum);
  ck_assert_msg(strstr(s, "straggler: w1 arrived last"), "summary without w1 as straggler:\n%s",
                s);
  ck_assert_msg(strstr(s, "w1*"), "straggler not marked:\n%s", s);
  ck_assert_msg(strstr(s, "stale gradients dropped: 0"), "%s", s);
  ck_assert_msg(strstr(s, "gradients in"), "no bytes per shard:\n%s", s);
  free(s);

  int n0, n1, np;
  double wait0 = median_field(wt[0], "\"rank\":0", "\"wait_ms\":", &n0);
  double comp1 = median_field(wt[1], "\"rank\":1", "\"compute_ms\":", &n1);
  double wait1 = median_field(wt[1], "\"rank\":1", "\"wait_ms\":", &n1);
  ck_assert_int_eq(n0, STEPS);
  ck_assert_int_eq(n1, STEPS);
  /* w0 computes 2 ms, w1 8 ms: w0 waits about 6 ms for the aggregate. */
  ck_assert_msg(wait0 > 3.0 && wait0 < 60.0, "w0 median wait %.3f ms", wait0);
  ck_assert_msg(wait1 < wait0, "the straggler waited %.3f ms, the other %.3f ms", wait1, wait0);
  ck_assert_msg(comp1 >= 7.5, "w1 median compute %.3f ms (sleeps 8)", comp1);
  double lag = median_field(pst, "\"type\":\"ps\"", "\"waited_for_last_ms\":", &np);
  ck_assert_int_eq(np, STEPS);
  ck_assert_msg(lag > 3.0, "psd saw the others wait %.3f ms for the last", lag);
  int last1;
  median_field(pst, "\"last\":1,", "\"step\":", &last1);
  ck_assert_msg(last1 >= STEPS * 3 / 4, "w1 last in only %d of %d steps", last1, STEPS);
}
END_TEST

/* psctl's exchange: the right secret gets the counters, a wrong one is
 * refused by name, and the binary prints text and JSON. */
START_TEST(test_stats) {
  tu_psd_secret = SECRET;
  tu_psd ps;
  const char *args[] = {"--workers", "3", NULL};
  ck_assert_int_eq(tu_psd_start(&ps, args), 0);
  tu_psd_secret = NULL;
  ps__auth au = {SECRET, strlen(SECRET), 0, NULL, 0, 0};
  Ps__StatsReply *r = NULL;
  char err[600];
  int rc = ps__admin_stats(ps.addr, &au, 5000, &r, err, sizeof err);
  ck_assert_msg(rc == 0, "stats: %s (%s)", ps_strerror(rc), err);
  ck_assert_uint_eq(r->num_workers, 0);
  ck_assert_uint_eq(r->num_ps, 1);
  ck_assert_str_eq(r->server_id, "ps0");
  ps__stats_reply__free_unpacked(r, NULL);

  ps__auth bad = {"wrong-secret-wrong-secret", 25, 0, NULL, 0, 0};
  rc = ps__admin_stats(ps.addr, &bad, 5000, &r, err, sizeof err);
  ck_assert_int_eq(rc, PS_EAUTH);
  ck_assert_msg(strstr(err, "authentication failed"), "%s", err);
  ck_assert_ptr_null(r);

  /* The binary, next to psd. */
  const char *psd = getenv("PSD_BIN");
  ck_assert_ptr_nonnull(psd);
  char cmd[2048], out[600];
  snprintf(out, sizeof out, "%s/psctl.out", tu_tmpdir());
  snprintf(cmd, sizeof cmd,
           "d=$(dirname '%s'); PSD_SECRET=%s \"$d/psctl\" stats %s --json > %s && "
           "PSD_SECRET=%s \"$d/psctl\" stats %s >> %s",
           psd, SECRET, ps.addr, out, SECRET, ps.addr, out);
  ck_assert_int_eq(system(cmd), 0);
  char *text = tu_read_file(out);
  ck_assert_ptr_nonnull(text);
  ck_assert_msg(strstr(text, "{\"addr\":") && strstr(text, "\"num_workers\":0"), "%s", text);
  ck_assert_msg(strstr(text, "no worker has joined yet"), "%s", text);
  free(text);
  snprintf(cmd, sizeof cmd, "d=$(dirname '%s'); \"$d/psctl\" stats nonsense 2>/dev/null", psd);
  int st = system(cmd);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "psctl accepted a bad address");

  /* An admin connection may ask for Stats only: anything else closes it. */
  int fd = tu_connect(ps.addr);
  ck_assert_int_ge(fd, 0);
  Ps__Hello h = PS__HELLO__INIT;
  h.protocol_version = PS__PROTOCOL_VERSION;
  h.role = PS__ROLE__ROLE_ADMIN;
  ps__auth sa = {SECRET, strlen(SECRET), 0, NULL, 0, -1};
  Ps__HelloReply *hr = NULL;
  char herr[512];
  ck_assert_msg(ps__handshake(fd, &sa, &h, ps.addr, ps__now() + 5.0, &hr, herr, sizeof herr) ==
                    0, "%s", herr);
  ps__hello_reply__free_unpacked(hr, NULL);
  uint8_t buf[512];
  Ps__Finish fin = PS__FINISH__INIT;
  fin.request_id = 1;
  size_t fl = ps__finish__get_packed_size(&fin);
  ps__header_encode(buf, PS__MSG_FINISH, (uint32_t)fl, 0);
  ps__finish__pack(&fin, buf + PS__HEADER_SIZE);
  ck_assert_int_eq(tu_send_all(fd, buf, PS__HEADER_SIZE + fl), 0);
  uint8_t in[4096];
  size_t n = 0;
  ck_assert_int_eq(tu_read_until_eof(fd, in, sizeof in, 5.0, &n), 1);
  close(fd);
  ck_assert_msg(memmem(in, n, "may only send STATS", 19), "no refusal in %zu bytes", n);
  ck_assert(tu_log_contains(&ps, "may only send STATS"));
  tu_psd_kill(&ps);
}
END_TEST

/* psctl's counters are live from the first steps: a step whose record is
 * still open (closed 64 steps later, or at exit) counts already once every
 * worker has arrived or a later step has begun. */
START_TEST(test_stats_live_from_step_one) {
  enum { STEPS = 30 };
  tu_psd_secret = SECRET;
  tu_psd ps;
  const char *args[] = {"--workers", "2", NULL};
  ck_assert_int_eq(tu_psd_start(&ps, args), 0);
  tu_psd_secret = NULL;
  slow_worker w[2];
  pthread_t th[2];
  memset(w, 0, sizeof w);
  for (int i = 0; i < 2; i++) {
    w[i] = (slow_worker){.host = ps.addr, .worker = i, .nw = 2, .steps = STEPS,
                         .sleep_ms = i == 1 ? 30 : 1};
    pthread_create(&th[i], NULL, slow_main, &w[i]);
  }
  ps__auth au = {SECRET, strlen(SECRET), 0, NULL, 0, 0};
  Ps__StatsReply *r = NULL;
  char err[600];
  uint64_t recorded = 0, last1 = 0, pushes1 = 0;
  double lag1 = 0;
  for (int k = 0; k < 500 && recorded < 5; k++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
    int rc = ps__admin_stats(ps.addr, &au, 5000, &r, err, sizeof err);
    ck_assert_msg(rc == 0, "stats: %s (%s)", ps_strerror(rc), err);
    if (r->n_workers == 2 && r->step < 10) {
      recorded = r->steps_recorded;
      last1 = r->workers[1]->last_count;
      lag1 = r->workers[1]->arrive_mean_ms;
      pushes1 = r->workers[1]->pushes;
    } else if (r->step >= 10) {
      k = 500; /* past step 10 and still nothing: fail below */
    }
    ps__stats_reply__free_unpacked(r, NULL);
  }
  ck_assert_msg(recorded >= 5, "steps_recorded %llu before step 10 (w1 pushed %llu)",
                (unsigned long long)recorded, (unsigned long long)pushes1);
  ck_assert_msg(last1 >= recorded / 2, "w1 (30 ms a step) last in %llu of %llu steps",
                (unsigned long long)last1, (unsigned long long)recorded);
  ck_assert_msg(lag1 > 5.0, "w1's mean lag %.3f ms", lag1);
  join_ok(th, w, 2);
  ck_assert_int_eq(tu_psd_wait(&ps, 10), 0);
}
END_TEST

/* How each worker's tensors travel is reported: psctl (text column
 * "via", JSON "transport") from psd's side and every record of the
 * worker's telemetry file from the worker's. w0 forces shared memory, w1
 * TCP, against one psd. */
START_TEST(test_transport_reported) {
  tu_psd_secret = SECRET;
  tu_psd ps;
  const char *args[] = {"--workers", "2", "--transport", "auto", NULL};
  ck_assert_int_eq(tu_psd_start(&ps, args), 0);
  tu_psd_secret = NULL;
  slow_worker w[2];
  pthread_t th[2];
  char tel[2][600];
  int hold = 1; /* both stay connected until psctl has looked */
  memset(w, 0, sizeof w);
  for (int i = 0; i < 2; i++) {
    snprintf(tel[i], sizeof tel[i], "%s/tr.w%d", tu_tmpdir(), i);
    w[i] = (slow_worker){.host = ps.addr, .worker = i, .nw = 2, .steps = 200,
                         .telemetry = tel[i], .hold = &hold,
                         .transport = i == 0 ? PS_TRANSPORT_SHM : PS_TRANSPORT_TCP};
    pthread_create(&th[i], NULL, slow_main, &w[i]);
  }
  /* psctl while both are connected (they hold after 200 steps). */
  ps__auth au = {SECRET, strlen(SECRET), 0, NULL, 0, 0};
  int both = 0;
  for (int k = 0; k < 500 && !both; k++) {
    Ps__StatsReply *r = NULL;
    char err[600];
    int rc = ps__admin_stats(ps.addr, &au, 5000, &r, err, sizeof err);
    ck_assert_msg(rc == 0, "stats: %s (%s)", ps_strerror(rc), err);
    both = r->n_workers == 2 && r->workers[0]->transport && r->workers[1]->transport &&
           r->step > 0;
    ps__stats_reply__free_unpacked(r, NULL);
    struct timespec ts = {0, 10000000};
    if (!both) nanosleep(&ts, NULL);
  }
  ck_assert_msg(both, "psd never reported both workers' transports");
  const char *psd = getenv("PSD_BIN");
  ck_assert_ptr_nonnull(psd);
  char cmd[2048], out[600];
  snprintf(out, sizeof out, "%s/psctl_tr.out", tu_tmpdir());
  snprintf(cmd, sizeof cmd,
           "d=$(dirname '%s'); PSD_SECRET=%s \"$d/psctl\" stats %s --json > %s && "
           "PSD_SECRET=%s \"$d/psctl\" stats %s >> %s",
           psd, SECRET, ps.addr, out, SECRET, ps.addr, out);
  ck_assert_int_eq(system(cmd), 0);
  char *text = tu_read_file(out);
  ck_assert_ptr_nonnull(text);
  const char *w0 = strstr(text, "{\"worker\":0,"), *w1 = strstr(text, "{\"worker\":1,");
  ck_assert_msg(w0 && w1, "%s", text);
  const char *e0 = strchr(w0, '}'), *e1 = strchr(w1, '}');
  const char *t0 = strstr(w0, "\"transport\":\"shm\""), *t1 = strstr(w1, "\"transport\":\"tcp\"");
  ck_assert_msg(t0 && t0 < e0 && t1 && t1 < e1, "%s", text);
  const char *f0 = strstr(w0, "\"shm_tcp_frames\":0}");
  ck_assert_msg(f0 && f0 < e0 + 1, "w0's frames over TCP: %s", text);
  ck_assert_msg(strstr(text, " via\n"), "no via column: %s", text);
  free(text);
  __atomic_store_n(&hold, 0, __ATOMIC_RELEASE);
  join_ok(th, w, 2);
  ck_assert_int_eq(tu_psd_wait(&ps, 10), 0);
  /* Every record of each file names its transport. */
  for (int i = 0; i < 2; i++) {
    int lines = 0;
    median_field(tel[i], "\"type\":\"worker\"", "\"step_ms\":", &lines);
    int named = 0;
    median_field(tel[i], i == 0 ? "\"transport\":[\"shm\"]" : "\"transport\":[\"tcp\"]",
                 "\"step_ms\":", &named);
    ck_assert_msg(lines == 200 && named == lines, "w%d: %d records, %d naming its transport",
                  i, lines, named);
  }
}
END_TEST

/* A psd with the secret for one worker, and that worker (c) with a table
 * called name (dim 2, capacity 100, lr lr) in *t. */
static ps_client *table_worker(tu_psd *ps, const char *name, double lr, ps_table **t) {
  tu_psd_secret = SECRET;
  const char *args[] = {"--workers", "1", NULL};
  ck_assert_int_eq(tu_psd_start(ps, args), 0);
  tu_psd_secret = NULL;
  const char *hosts[1] = {ps->addr};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hosts;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.credential = SECRET;
  cfg.credential_len = strlen(SECRET);
  ps_client *c = NULL;
  char err[600];
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "%s", err);
  ps_table_config tc;
  ps_table_config_init(&tc);
  tc.dim = 2;
  tc.capacity = 100;
  if (lr > 0) tc.lr = lr;
  ck_assert_int_eq(ps_client_table_create(c, name, &tc, t), 0);
  return c;
}

/* psctl's per-table counters (StatsReply.tables): rows, admissions,
 * keys pulled and pushed, hits and dropped gradients, as one worker's
 * pulls and step made them. */
START_TEST(test_stats_tables) {
  tu_psd ps;
  ps_table *t;
  ps_client *c = table_worker(&ps, "emb", 0.1, &t);
  char err[600];
  uint64_t keys[3] = {1, 2, 3}, ro[1] = {4}, pk[2] = {1, 5}, step = 0;
  float rows[6], g[4] = {1, 1, 1, 1};
  ck_assert_int_eq(ps_table_pull(t, 0, keys, 3, rows, 0, NULL), 0);
  ck_assert_int_eq(ps_table_pull(t, 0, ro, 1, rows, PS_TABLE_READ_ONLY, NULL), 0);
  ck_assert_int_eq(ps_table_pull(t, 0, keys, 2, rows, 0, NULL), 0);
  ck_assert_int_eq(ps_table_add_grad(t, pk, 2, g), 0);
  ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "%s", ps_client_errmsg(c));
  ps__auth au = {SECRET, strlen(SECRET), 0, NULL, 0, 0};
  Ps__StatsReply *r = NULL;
  int rc = ps__admin_stats(ps.addr, &au, 5000, &r, err, sizeof err);
  ck_assert_msg(rc == 0, "stats: %s (%s)", ps_strerror(rc), err);
  ck_assert_uint_eq(r->n_tables, 1);
  const Ps__TableStats *ts = r->tables[0];
  ck_assert_str_eq(ts->name, "emb");
  ck_assert_uint_eq(ts->dim, 2);
  ck_assert_uint_eq(ts->step, 1);
  ck_assert_uint_eq(ts->rows, 3);        /* 1, 2, 3: 4 was read only */
  ck_assert_uint_eq(ts->capacity, 100);
  ck_assert_uint_eq(ts->admissions, 3);
  ck_assert_uint_eq(ts->keys_pulled, 6); /* 3 + 1 + 2 */
  ck_assert_uint_eq(ts->hits, 2);        /* the second pull of 1 and 2 */
  ck_assert_uint_eq(ts->keys_pushed, 2);
  ck_assert_uint_eq(ts->dropped, 1);     /* 5 has no row */
  ck_assert_uint_eq(ts->evictions_lru + ts->evictions_ttl, 0);
  ck_assert(ts->bytes > 0);
  ps__stats_reply__free_unpacked(r, NULL);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  ck_assert_int_eq(tu_psd_wait(&ps, 10), 0);
}
END_TEST

/* A job of sparse tables alone (2 tables, no variable): its steps count.
 * Stats records them live, with the TablePush frames and the bytes of
 * gradients in and rows out; the summary's header and each worker's row
 * (its own view off: psd's, one step however many tables) say STEPS, and
 * the records hold one line per step with both workers' arrivals. */
START_TEST(test_tables_only_steps) {
  enum { STEPS = 6 };
  char sum[600], pst[600];
  tu_psd ps;
  start_recording(&ps, sum, pst, sizeof sum, "tables");
  int hold = 1;
  slow_worker w[2];
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    w[i] = (slow_worker){.host = ps.addr, .worker = i, .nw = 2, .steps = STEPS,
                         .telemetry = "off", .hold = &hold, .tables = 1};
    pthread_create(&th[i], NULL, slow_main, &w[i]);
  }
  ps__auth au = {SECRET, strlen(SECRET), 0, NULL, 0, 0};
  Ps__StatsReply *r = NULL;
  char err[600];
  uint64_t recorded = 0;
  for (int k = 0; k < 1000 && recorded < STEPS; k++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
    if (r) ps__stats_reply__free_unpacked(r, NULL);
    int rc = ps__admin_stats(ps.addr, &au, 5000, &r, err, sizeof err);
    ck_assert_msg(rc == 0, "stats: %s (%s)", ps_strerror(rc), err);
    recorded = r->steps_recorded;
  }
  ck_assert_msg(recorded == STEPS, "steps_recorded %llu of %d", (unsigned long long)recorded,
                STEPS);
  ck_assert_uint_eq(r->n_workers, 2);
  for (int i = 0; i < 2; i++) {
    const Ps__WorkerStats *ws = r->workers[i];
    ck_assert_msg(ws->pushes == STEPS * TW_TABLES && ws->bytes_in > 0 && ws->bytes_out > 0,
                  "w%d: %llu pushes, %llu bytes in, %llu out", i,
                  (unsigned long long)ws->pushes, (unsigned long long)ws->bytes_in,
                  (unsigned long long)ws->bytes_out);
  }
  ps__stats_reply__free_unpacked(r, NULL);
  __atomic_store_n(&hold, 0, __ATOMIC_RELEASE);
  join_ok(th, w, 2);
  ck_assert_int_eq(tu_psd_wait(&ps, 10), 0);
  char *s = tu_read_file(sum);
  ck_assert_msg(s != NULL, "no summary at %s", sum);
  char head[64];
  snprintf(head, sizeof head, "2 workers, %d steps ==", STEPS);
  ck_assert_msg(strstr(s, head), "summary without '%s':\n%s", head, s);
  for (int i = 0; i < 2; i++) {
    char row[16];
    snprintf(row, sizeof row, "\nw%d", i);
    const char *p = strstr(s, row);
    unsigned long long steps = 0;
    ck_assert_msg(p && sscanf(p + 1, "%*s %llu", &steps) == 1 && steps == STEPS,
                  "w%d's row does not say %d steps:\n%s", i, STEPS, s);
  }
  ck_assert_msg(!strstr(s, "gradients in 0 B") && !strstr(s, "parameters out 0 B"),
                "no bytes counted:\n%s", s);
  free(s);
  int records, both;
  median_field(pst, "\"type\":\"ps\"", "\"step\":", &records);
  median_field(pst, "\"arrivals\":2,", "\"step\":", &both);
  ck_assert_msg(records == STEPS && both == STEPS, "%d records, %d with both arrivals", records,
                both);
}
END_TEST

/* psctl authenticates psd as a worker does: a psd that cannot prove our
 * secret (it has none) is refused, named, before any Stats go out. */
START_TEST(test_stats_impostor) {
  tu_psd ps;
  ck_assert_int_eq(tu_psd_start(&ps, NULL), 0);
  ps__auth au = {SECRET, strlen(SECRET), 0, NULL, 0, -1};
  Ps__StatsReply *r = NULL;
  char err[600];
  int rc = ps__admin_stats(ps.addr, &au, 5000, &r, err, sizeof err);
  ck_assert_int_eq(rc, PS_EAUTH);
  ck_assert_msg(strstr(err, ps.addr) && strstr(err, "did not prove"), "%s", err);
  ck_assert_ptr_null(r);
  ck_assert(!tu_log_contains(&ps, "STATS"));
  tu_psd_kill(&ps);
}
END_TEST

/* A table name a worker chose reaches the admin's terminal through psctl
 * stats: its text prints it escaped (ps__escape), its JSON with control
 * characters as \u escapes and bytes that are not UTF-8 as \ufffd, so
 * neither output holds a control byte (but its line ends) or invalid UTF-8
 * (was: the text printed the name raw, the JSON its DEL, C1 and non-UTF-8
 * bytes). */
START_TEST(test_stats_names_escaped) {
  static const char name[] = "t\n2026-01-01T00:00:00.000Z ERROR [ps0] forged\x1b[2J\xff"
                             "\xc2\x9b\x7f\xc3\xa9'\"";
  static const char text_shown[] = "t\\n2026-01-01T00:00:00.000Z ERROR [ps0] forged\\x1b[2J"
                                   "\\xff\\xc2\\x9b\\x7f\xc3\xa9\\'\\\"";
  static const char json_shown[] = "\"name\":\"t\\u000a2026-01-01T00:00:00.000Z ERROR [ps0] "
                                   "forged\\u001b[2J\\ufffd\\u009b\\u007f\xc3\xa9'\\\"\"";
  tu_psd ps;
  ps_table *t;
  ps_client *c = table_worker(&ps, name, 0, &t);
  char cmd[2048], out[2][600];
  for (int json = 0; json < 2; json++) {
    snprintf(out[json], sizeof out[json], "%s/psctl_names.%d.out", tu_tmpdir(), json);
    snprintf(cmd, sizeof cmd, "PSD_SECRET=%s '%s' stats %s%s > '%s'", SECRET, tu_bin("psctl"),
             ps.addr, json ? " --json" : "", out[json]);
    ck_assert_int_eq(system(cmd), 0);
  }
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  ck_assert_int_eq(tu_psd_wait(&ps, 10), 0);
  for (int json = 0; json < 2; json++) {
    char *o = tu_read_file(out[json]);
    ck_assert_ptr_nonnull(o);
    ck_assert_msg(strstr(o, json ? json_shown : text_shown), "the name is not escaped in:\n%s",
                  o);
    for (const unsigned char *p = (const unsigned char *)o; *p; p++)
      ck_assert_msg((*p >= 0x20 && *p != 0x7f && *p != 0xff && *p != 0xc2) || *p == '\n',
                    "psctl%s printed byte 0x%02x raw at %zu:\n%s", json ? " --json" : "", *p,
                    (size_t)((const char *)p - o), o);
    ck_assert_msg(!strstr(o, "\n2026-01-01"), "a forged line in:\n%s", o);
    free(o);
  }
}
END_TEST

Suite *suite_telemetry(void) {
  Suite *s = suite_create("telemetry");
  TCase *tc = tcase_create("telemetry");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_straggler_summary);
  tcase_add_test(tc, test_async_has_no_straggler);
  tcase_add_test(tc, test_stats);
  tcase_add_test(tc, test_stats_impostor);
  tcase_add_test(tc, test_stats_live_from_step_one);
  tcase_add_test(tc, test_transport_reported);
  tcase_add_test(tc, test_stats_tables);
  tcase_add_test(tc, test_tables_only_steps);
  tcase_add_test(tc, test_stats_names_escaped);
  suite_add_tcase(s, tc);
  return s;
}
