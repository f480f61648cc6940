/* Sparse tables from the client's side, misused: sizes that overflow,
 * NULL pointers, keys and rows in the same memory, configurations whose
 * fields are valid doubles but not usable floats, requests past psd's
 * --max-memory. Each must be refused
 * (or answered right) with a sentence naming the problem, and leave the
 * client working. And psd's log under a worker that sends refused
 * requests as fast as it can. (test_tables.c covers the tables'
 * semantics.) */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ratelog.h"
#include "testutil.h"
#include "util.h"

static ps_client *th_connect_via(const char *addr, ps_transport transport) {
  const char *hp[1] = {addr};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.transport = transport;
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.worker_index = 0;
  cfg.num_workers = 1;
  cfg.request_timeout_ms = 5000;
  cfg.telemetry = "off";
  cfg.no_signal_handlers = 1;
  ps_client *c = NULL;
  char err[512];
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "client: %s", err);
  return c;
}

static ps_client *th_connect(const char *addr) {
  return th_connect_via(addr, PS_TRANSPORT_DEFAULT);
}

static void th_start(tu_psd *p) {
  const char *args[] = {"--num-ps", "1", "--ps-index", "0", NULL};
  ck_assert_msg(tu_psd_start(p, args) == 0, "psd did not start");
}

static ps_table_config th_cfg(uint32_t dim) {
  ps_table_config g;
  ps_table_config_init(&g);
  g.dim = dim;
  g.capacity = 1000;
  g.init.kind = PS_INIT_NORMAL;
  g.init.a = 0;
  g.init.b = 1;
  return g;
}

/* rc is PS_EINVAL (or want) and the client's sentence holds word. */
static void expect_refused(ps_client *c, int rc, int want, const char *word, const char *what) {
  ck_assert_msg(rc == want && strstr(ps_client_errmsg(c), word),
                "%s: expected %s naming '%s', got %s: %s", what, ps_strerror(want), word,
                ps_strerror(rc), ps_client_errmsg(c));
}

/* lr and epsilon are used as floats: a positive double below FLT_MIN is 0
 * (or a denormal) there, and epsilon 0 makes Adagrad's and Adam's rows
 * NaN on a zero gradient. Refused before anything is sent. */
START_TEST(float_zero_config_refused) {
  tu_psd p;
  th_start(&p);
  ps_client *c = th_connect(p.addr);
  ps_table *t = NULL;
  ps_table_config g = th_cfg(4);
  g.opt = PS_TOPT_ADAGRAD;
  g.initial_accumulator = 0;
  g.epsilon = 1e-50;
  expect_refused(c, ps_client_table_create(c, "ada", &g, &t), PS_EINVAL, "epsilon",
                 "adagrad epsilon 1e-50");
  g = th_cfg(4);
  g.opt = PS_TOPT_ADAM;
  g.epsilon = 1e-40; /* a float denormal */
  expect_refused(c, ps_client_table_create(c, "adam", &g, &t), PS_EINVAL, "epsilon",
                 "adam epsilon 1e-40");
  g = th_cfg(4);
  g.lr = 1e-300;
  expect_refused(c, ps_client_table_create(c, "sgd", &g, &t), PS_EINVAL, "lr", "lr 1e-300");
  g.lr = 1e300;
  expect_refused(c, ps_client_table_create(c, "sgd", &g, &t), PS_EINVAL, "lr", "lr 1e300");
  g.lr = 0.1;
  ck_assert_int_eq(ps_client_table_create(c, "sgd", &g, &t), 0);
  ps_client_destroy(c);
  tu_psd_kill(&p);
}
END_TEST

/* n = SIZE_MAX and other sizes whose bytes overflow, NULL pointers: each
 * refused naming the problem, nothing sent, the client still works. */
START_TEST(bad_sizes_and_pointers_refused) {
  tu_psd p;
  th_start(&p);
  ps_client *c = th_connect(p.addr);
  ps_table *t = NULL;
  ps_table_config g = th_cfg(8);
  ck_assert_int_eq(ps_client_table_create(c, "t", &g, &t), 0);
  uint64_t k[2] = {1, 2};
  float out[16], gr[16] = {0};
  ps_req *r = NULL;
  expect_refused(c, ps_table_pull(t, 0, k, SIZE_MAX, out, 0, NULL), PS_EINVAL, "overflows",
                 "pull of SIZE_MAX keys");
  expect_refused(c, ps_table_pull(t, 0, k, SIZE_MAX / 8, out, 0, NULL), PS_EINVAL,
                 "overflows", "pull of SIZE_MAX/8 keys of 8 floats");
  expect_refused(c, ps_table_pull(t, 0, NULL, 2, out, 0, NULL), PS_EINVAL, "NULL",
                 "pull with keys NULL");
  expect_refused(c, ps_table_pull(t, 0, k, 2, NULL, 0, NULL), PS_EINVAL, "NULL",
                 "pull with out NULL");
  expect_refused(c, ps_table_pull(t, 0, k, 2, out, 0x80, NULL), PS_EINVAL, "flags",
                 "pull with unknown flags");
  expect_refused(c, ps_table_pull_async(t, 0, k, 2, out, 0, NULL), PS_EINVAL, "req",
                 "pull_async with req NULL");
  expect_refused(c, ps_table_push_async(t, 0, k, SIZE_MAX, gr, &r), PS_EINVAL, "overflows",
                 "push of SIZE_MAX keys");
  expect_refused(c, ps_table_push_async(t, 0, k, 2, NULL, &r), PS_EINVAL, "NULL",
                 "push with grads NULL");
  expect_refused(c, ps_table_add_grad(t, k, SIZE_MAX, gr), PS_EINVAL, "overflows",
                 "add_grad of SIZE_MAX keys");
  ck_assert_int_eq(ps_table_add_grad(t, k, 1, gr), 0);
  expect_refused(c, ps_table_add_grad(t, k, SIZE_MAX / 8 - 1, gr), PS_EINVAL, "overflow",
                 "add_grad whose staged total overflows");
  ck_assert_int_eq(ps_table_pull(NULL, 0, k, 2, out, 0, NULL), PS_EINVAL);
  ck_assert_int_eq(ps_table_add_grad(NULL, k, 2, gr), PS_EINVAL);
  ck_assert_int_eq(ps_table_push_async(NULL, 0, k, 2, gr, &r), PS_EINVAL);
  ck_assert(ps_table_name(NULL) == NULL && ps_table_dim(NULL) == 0);
  ck_assert(ps_client_table_find(c, NULL) == NULL);
  /* Still working. */
  uint64_t step = 99;
  int rc = ps_table_pull(t, 0, k, 2, out, 0, &step);
  ck_assert_msg(rc == 0 && step == 0, "pull after the refusals: %s", ps_client_errmsg(c));
  ps_client_destroy(c);
  tu_psd_kill(&p);
}
END_TEST

/* keys and out in the same memory (n keys of 8 bytes, n rows of 2 floats):
 * the rows are those of the keys as they were when the call began. */
START_TEST(keys_and_out_aliased) {
  tu_psd p;
  th_start(&p);
  ps_client *c = th_connect(p.addr);
  ps_table *t = NULL;
  ps_table_config g = th_cfg(2);
  ck_assert_int_eq(ps_client_table_create(c, "t", &g, &t), 0);
  enum { N = 100 };
  uint64_t keys[N], buf[N];
  float want[N * 2];
  for (int i = 0; i < N; i++) keys[i] = buf[i] = (uint64_t)(N - i) * 7919u % 53u;
  ck_assert_int_eq(ps_table_pull(t, 0, keys, N, want, PS_TABLE_READ_ONLY, NULL), 0);
  int rc = ps_table_pull(t, 0, buf, N, (float *)buf, PS_TABLE_READ_ONLY, NULL);
  ck_assert_msg(rc == 0, "aliased pull: %s", ps_client_errmsg(c));
  ck_assert_msg(memcmp(buf, want, sizeof want) == 0, "aliased keys/out: other rows");
  ps_client_destroy(c);
  tu_psd_kill(&p);
}
END_TEST

/* psd under --max-memory 64 MiB, a client, its table "emb" (dim 4096, 16
 * rows), keys 1..4096 and room for their rows: a pull of them asks for a
 * 64 MiB reply, a push of them sends 64 MiB + 32 KiB, both past the limit. */
enum { MEM_DIM = 4096, MEM_KEYS = 4096 };
typedef struct mem_job {
  tu_psd p;
  ps_client *c;
  ps_table *t;
  uint64_t *keys;
  float *rows;
} mem_job;

static void mem_start(mem_job *m) {
  const char *args[] = {"--num-ps", "1", "--ps-index", "0", "--max-memory", "67108864", NULL};
  ck_assert_msg(tu_psd_start(&m->p, args) == 0, "psd did not start");
  /* Over TCP: psd stages a push's data, which is what the limit refuses
   * (through a ring it reads the data where it lies and holds none). */
  m->c = th_connect_via(m->p.addr, PS_TRANSPORT_TCP);
  ps_table_config g = th_cfg(MEM_DIM);
  g.capacity = 16;
  ck_assert_int_eq(ps_client_table_create(m->c, "emb", &g, &m->t), 0);
  m->keys = malloc(MEM_KEYS * sizeof *m->keys);
  m->rows = calloc((size_t)MEM_KEYS * MEM_DIM, sizeof *m->rows);
  ck_assert(m->keys && m->rows);
  for (int i = 0; i < MEM_KEYS; i++) m->keys[i] = (uint64_t)i + 1;
}

static void mem_stop(mem_job *m) {
  free(m->keys);
  free(m->rows);
  ps_client_destroy(m->c);
  tu_psd_kill(&m->p);
}

/* Table requests past psd's --max-memory through the API: a pull whose
 * reply and a push whose data would pass it fail with PS_ENOMEM and psd's
 * sentence (the table, the bytes, the limit) in ps_client_errmsg; the
 * connection goes on and small requests of the same table work. */
START_TEST(memory_refusals_reach_the_caller) {
  mem_job m;
  mem_start(&m);
  ps_client *c = m.c;
  /* A read-only pull's rows are not kept for a push (none follows it):
   * the refusal counts none. */
  ck_assert_int_eq(ps_table_pull(m.t, 0, m.keys, 4, m.rows, PS_TABLE_READ_ONLY, NULL), 0);
  int rc = ps_table_pull(m.t, 0, m.keys, MEM_KEYS, m.rows, PS_TABLE_READ_ONLY, NULL);
  ck_assert_msg(rc == PS_ENOMEM && strstr(ps_client_errmsg(c), "table 'emb'") &&
                    strstr(ps_client_errmsg(c), "67108864") &&
                    strstr(ps_client_errmsg(c), "--max-memory") &&
                    strstr(ps_client_errmsg(c), " 0 of pulls' rows kept for their pushes"),
                "a 64 MiB reply under --max-memory 64 MiB: %s: %s", ps_strerror(rc),
                ps_client_errmsg(c));
  ck_assert_int_eq(ps_table_pull(m.t, 0, m.keys, 4, m.rows, 0, NULL), 0);
  ps_req *r = NULL;
  ck_assert_int_eq(ps_table_push_async(m.t, 0, m.keys, MEM_KEYS, m.rows, &r), 0);
  rc = ps_req_wait(r, 10000, NULL);
  ps_req_destroy(r);
  ck_assert_msg(rc == PS_ENOMEM && strstr(ps_client_errmsg(c), "table 'emb'") &&
                    strstr(ps_client_errmsg(c), "67141632") &&
                    strstr(ps_client_errmsg(c), "--max-memory") &&
                    strstr(ps_client_errmsg(c), " of pulls' rows kept for their pushes") &&
                    !strstr(ps_client_errmsg(c), " 0 of pulls' rows kept"),
                "a 64 MiB push under --max-memory 64 MiB: %s: %s", ps_strerror(rc),
                ps_client_errmsg(c));
  ck_assert_int_eq(ps_table_push_async(m.t, 0, m.keys, 4, m.rows, &r), 0);
  rc = ps_req_wait(r, 10000, NULL);
  ps_req_destroy(r);
  ck_assert_msg(rc == 0, "a small push after the refusal: %s: %s", ps_strerror(rc),
                ps_client_errmsg(c));
  mem_stop(&m);
}
END_TEST

/* ---- psd's log under a misbehaving worker ---------------------------------- */

/* One refused push (PS_EINVAL: a step the table has not reached), one
 * refused pull (PS_ENOMEM: its 64 MiB reply) and one refused TableRegister
 * (PS_ENOMEM: a table past --max-memory); each checked. */
static void refuse_three(mem_job *m) {
  ps_req *r = NULL;
  ck_assert_int_eq(ps_table_push_async(m->t, 5, m->keys, 1, m->rows, &r), 0);
  int rc = ps_req_wait(r, 10000, NULL);
  ps_req_destroy(r);
  ck_assert_msg(rc == PS_EINVAL, "push of a future step: %s", ps_client_errmsg(m->c));
  rc = ps_table_pull(m->t, 0, m->keys, MEM_KEYS, m->rows, PS_TABLE_READ_ONLY, NULL);
  ck_assert_msg(rc == PS_ENOMEM, "pull past --max-memory: %s", ps_client_errmsg(m->c));
  ps_table_config big = th_cfg(64);
  big.capacity = 1u << 20; /* 256 MiB of rows */
  ps_table *t2 = NULL;
  rc = ps_client_table_create(m->c, "huge", &big, &t2);
  ck_assert_msg(rc == PS_ENOMEM, "table past --max-memory: %s", ps_client_errmsg(m->c));
}

/* A worker (it has the job's secret) refusing to behave, as fast as it
 * can: psd logs at most PS__RATELOG_BURST lines a second of each kind
 * (refused pushes; failed requests: refused pulls and registrations), then
 * "suppressed K similar messages (KIND)" (was: one line per request, 3,000
 * here). */
START_TEST(refused_requests_leave_a_short_log) {
  enum { N = 1000 };
  mem_job m;
  mem_start(&m);
  int before = tu_log_count(&m.p, "\n");
  double t0 = ps__now();
  for (int i = 0; i < N; i++) refuse_three(&m);
  double took = ps__now() - t0;
  usleep(1300000); /* the last window ends: its summaries are written */
  int lines = tu_log_count(&m.p, "\n") - before;
  /* Two kinds, each its burst per window and a summary, over the windows
   * the flood took (and the one after it). */
  int most = 2 * ((int)took + 3) * (int)(PS__RATELOG_BURST + 1);
  printf("tables_hostile: %d refused requests in %.1f s -> %d log lines (at most %d)\n", 3 * N,
         took, lines, most);
  ck_assert_msg(lines <= most && most < N, "%d log lines for %d refused requests in %.1f s "
                "(log %s)", lines, 3 * N, took, m.p.log_path);
  ck_assert_msg(tu_log_contains(&m.p, "similar messages (refused pushes)") &&
                    tu_log_contains(&m.p, "similar messages (failed requests)"),
                "no summary of the suppressed lines (log %s)", m.p.log_path);
  mem_stop(&m);
}
END_TEST

/* Table names come from clients and may hold any byte but NUL (psd checks
 * their length only): psd's log lines and the sentences it sends back
 * print them escaped, so a name cannot end a log line and forge the next,
 * send a terminal an escape sequence, or carry bytes that are not UTF-8
 * (was: printed as they came). */
START_TEST(table_names_printed_escaped) {
  static const char name[] = "e\n2026-01-01T00:00:00.000Z ERROR [ps0] forged\x1b[2J\xff'";
  static const char shown[] = "table 'e\\n2026-01-01T00:00:00.000Z ERROR [ps0] forged"
                              "\\x1b[2J\\xff\\''";
  tu_psd p;
  th_start(&p);
  ps_client *c = th_connect(p.addr);
  ps_table *t = NULL;
  ps_table_config g = th_cfg(4);
  ck_assert_int_eq(ps_client_table_create(c, name, &g, &t), 0);
  uint64_t k = 1;
  float gr[4] = {0};
  ps_req *r = NULL;
  ck_assert_int_eq(ps_table_push_async(t, 5, &k, 1, gr, &r), 0);
  int rc = ps_req_wait(r, 10000, NULL);
  ps_req_destroy(r);
  ck_assert_msg(rc == PS_EINVAL && strstr(ps_client_errmsg(c), shown),
                "push of a future step: %s: %s", ps_strerror(rc), ps_client_errmsg(c));
  char created[200];
  snprintf(created, sizeof created, "%s created", shown);
  ck_assert_msg(tu_log_contains(&p, created), "no escaped 'created' line (log %s)", p.log_path);
  ck_assert_msg(tu_log_count(&p, shown) == 2, "not 2 escaped lines (log %s)", p.log_path);
  ck_assert_msg(!tu_log_contains(&p, "\n2026-01-01T00:00:00.000Z ERROR [ps0] forged") &&
                    !tu_log_contains(&p, "\x1b") && !tu_log_contains(&p, "\xff"),
                "the name reached the log raw (log %s)", p.log_path);
  ps_client_destroy(c);
  tu_psd_kill(&p);
}
END_TEST

Suite *suite_tables_hostile(void) {
  Suite *s = suite_create("tables_hostile");
  TCase *tc = tcase_create("tables_hostile");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, float_zero_config_refused);
  tcase_add_test(tc, bad_sizes_and_pointers_refused);
  tcase_add_test(tc, keys_and_out_aliased);
  tcase_add_test(tc, memory_refusals_reach_the_caller);
  tcase_add_test(tc, refused_requests_leave_a_short_log);
  tcase_add_test(tc, table_names_printed_escaped);
  suite_add_tcase(s, tc);
  return s;
}
