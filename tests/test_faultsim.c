/* Allocation-failure injection (SQLite's faultsim is the model), with the
 * faultsim.so shim (tests/faultsim.c) and the scenario of
 * tests/faultsim_client.c, against real psd processes:
 *  - client: for N = 1, 2, ... up to the allocations the client scenario
 *    makes, the scenario runs with its N-th allocation failing (then again
 *    with every allocation from the N-th on failing): every call returns
 *    0 or a PS_E* code (PS_ENOMEM from the call whose allocation failed),
 *    nothing crashes or hangs, nothing it allocated is live after
 *    ps_client_destroy;
 *  - psd: allocations of a psd fail while it serves one client (the N-th
 *    from that client's connection, or all from the N-th on, until the
 *    next connection): psd neither crashes nor blocks, it says "out of
 *    memory" in its log, the client connected before it is still served,
 *    the next client succeeds, and nothing allocated meanwhile is live
 *    when psd exits.
 * The sweeps' strides (every N by default for the client's single
 * failures) come from PS_FAULTSIM_STRIDE; the offsets from the seed
 * (printed; PS_TEST_SEED replays it). */
#define _GNU_SOURCE
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

/* Failures "from N on until the next connection": all of them. */
#define ALL_AFTER "1000000000"

/* The stride of a sweep: $PS_FAULTSIM_STRIDE, else dflt. */
static unsigned long stride_or(unsigned long dflt) {
  const char *s = getenv("PS_FAULTSIM_STRIDE");
  unsigned long v = s && *s ? strtoul(s, NULL, 10) : dflt;
  return v ? v : 1;
}

/* Runs argv (env added), waits up to limit_s; its output (malloc'd) and
 * exit status. */
static char *run_prog(char *const *argv, char *const *env, double limit_s, int *st) {
  char out[512];
  pid_t pid = tu_spawn(argv, env, out, sizeof out);
  ck_assert_int_gt(pid, 0);
  int timed_out = tu_wait_pid(pid, tu_time_limit(limit_s), st) != 0;
  char *text = tu_read_file(out);
  unlink(out);
  ck_assert_msg(!timed_out, "%s %s did not finish within %.0f s:\n%s", argv[0], argv[1],
                tu_time_limit(limit_s), text ? text : "");
  return text ? text : strdup("");
}

/* One pass of the client sweep (count: allocations failed from N on). */
static void client_pass(unsigned long first, unsigned long stride, const char *count) {
  char f[32], s[32], preload[600];
  snprintf(f, sizeof f, "%lu", first);
  snprintf(s, sizeof s, "%lu", stride);
  snprintf(preload, sizeof preload, "LD_PRELOAD=%s", FAULTSIM_SO);
  const char *psd = getenv("PSD_BIN");
  char *argv[] = {(char *)FAULTSIM_CLIENT_BIN, "sweep", (char *)(psd ? psd : tu_bin("psd")),
                  f, s, (char *)count, NULL};
  char *env[] = {preload, NULL};
  int st;
  char *text = run_prog(argv, env, 240, &st);
  fprintf(stderr, "client sweep from N=%s by %s, failing %s at a time:\n%s", f, s,
          strcmp(count, "1") ? "all" : "one", text);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the client sweep found problems "
                "(status 0x%x; FAULTSIM_TRACE=1 shows where an allocation failed):\n%s",
                st, text);
  ck_assert_msg(strstr(text, " runs, 0 not clean"), "no sweep ran:\n%s", text);
  free(text);
}

START_TEST(client_sweep) {
  unsigned seed = tu_seed("faultsim client_sweep");
  /* The sanitized build: the shim may come before ASan's runtime in the
   * sweep too (ASAN_OPTIONS, which the sweep inherits). */
  tu_psd_set_preload(FAULTSIM_SO);
  tu_psd_set_preload(NULL);
  unsigned long all = stride_or(3);
  client_pass(1, stride_or(1), "1");
  client_pass(1 + seed % all, all, ALL_AFTER);
}
END_TEST

/* ---- psd ------------------------------------------------------------------ */

/* A client of the psd sweep's job (3 workers, replicas 1) that only uses a
 * table: worker `index`. */
static ps_client *table_client(const char *addr, int index, ps_table **t) {
  const char *hosts[1] = {addr};
  ps_client *c = tu_client(hosts, 1, index, 3, 1, 20000);
  ps_table_config tc;
  ps_table_config_init(&tc);
  tc.dim = 2;
  tc.capacity = 16;
  tc.lr = 0.1;
  int rc = ps_client_table_create(c, "watch", &tc, t);
  ck_assert_msg(rc == 0, "%s", ps_client_errmsg(c));
  return c;
}

/* The watcher's rows of keys 1..4: 0 or the error (message in c). */
static int watch_pull(ps_table *t) {
  uint64_t keys[4] = {1, 2, 3, 4};
  float rows[8];
  return ps_table_pull(t, 0, keys, 4, rows, 0, NULL);
}

/* What psd's shim says at exit: armed allocations, failed, live. */
static void shim_report(const tu_psd *p, unsigned long *armed, unsigned long *failed,
                        long *live) {
  char *log = tu_read_file(p->log_path);
  const char *at = log ? strstr(log, "faultsim: armed ") : NULL;
  ck_assert_msg(at && sscanf(at, "faultsim: armed %lu allocations, failed %lu, live %ld",
                             armed, failed, live) == 3,
                "no faultsim report in psd's log %s:\n%s", p->log_path, log ? log : "");
  free(log);
}

/* One psd run: allocations n .. n + count - 1 of those psd makes from the
 * victim's connection on fail (n 0: none). The allocations armed. */
static unsigned long psd_run(unsigned long n, const char *count) {
  char fail[32];
  snprintf(fail, sizeof fail, "%lu", n);
  /* Armed at psd's 2nd TCP connection (the victim's), disarmed at the 3rd. */
  setenv("FAULTSIM_ARM", "accept:2", 1);
  setenv("FAULTSIM_FAIL", fail, 1);
  setenv("FAULTSIM_COUNT", count, 1);
  tu_psd_set_preload(FAULTSIM_SO);
  tu_psd ps;
  ck_assert_msg(tu_psd_start(&ps, NULL) == 0, "psd did not start (N=%lu)", n);
  tu_psd_set_preload(NULL);
  ps_table *wt = NULL;
  ps_client *watcher = table_client(ps.addr, 2, &wt);
  ck_assert_msg(watch_pull(wt) == 0, "%s", ps_client_errmsg(watcher));
  char *victim[] = {(char *)FAULTSIM_CLIENT_BIN, "run", ps.addr, "victim", "0", "3", "chief",
                    NULL};
  char *after[] = {(char *)FAULTSIM_CLIENT_BIN, "run", ps.addr, "after", "1", "3", "tables",
                   NULL};
  int st;
  char *vout = run_prog(victim, NULL, 60, &st);
  ck_assert_msg(WIFEXITED(st) && !strstr(vout, "BAD") && !strstr(vout, "PS_ETIMEDOUT"),
                "N=%lu: the victim (status 0x%x) did not end in a clean error:\n%s", n, st, vout);
  char *aout = run_prog(after, NULL, 60, &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "N=%lu: the client after the failures did not succeed:\n%s", n, aout);
  int rc = watch_pull(wt);
  ck_assert_msg(rc == 0, "N=%lu: the client connected before the failures is no longer "
                "served: %s", n, ps_client_errmsg(watcher));
  ck_assert_int_eq(ps_client_finish(watcher), 0);
  ps_client_destroy(watcher);
  /* Every worker finished (psd exits) or the victim was lost: SIGTERM. */
  if (tu_psd_wait(&ps, 1) != 0) kill(ps.pid, SIGTERM);
  ck_assert_msg(tu_psd_wait(&ps, tu_time_limit(20)) == 0, "N=%lu: psd did not exit", n);
  ck_assert_msg(WIFEXITED(ps.status), "N=%lu: psd died of signal %d (log %s)", n,
                WTERMSIG(ps.status), ps.log_path);
  unsigned long armed, failed;
  long live;
  shim_report(&ps, &armed, &failed, &live);
  ck_assert_msg(live == 0, "N=%lu: psd leaked %ld allocations made while serving the victim "
                "(log %s)", n, live, ps.log_path);
  /* A failure that cost the victim a call or its connection (its retry
   * may have succeeded) is named in psd's log. */
  if (failed && (!strstr(vout, "every call succeeded") || strstr(vout, "closed the connection")))
    ck_assert_msg(tu_log_contains(&ps, "out of memory"),
                  "N=%lu: the victim failed (%s) but psd's log %s does not say out of memory", n,
                  vout, ps.log_path);
  free(vout);
  free(aout);
  unlink(ps.log_path);
  unlink(ps.port_file);
  return armed;
}

START_TEST(psd_sweep) {
  unsigned seed = tu_seed("faultsim psd_sweep");
  unsigned long total = psd_run(0, "0");
  ck_assert_msg(total > 0, "the shim numbered no allocation of psd's");
  unsigned long stride = stride_or(2), runs = 0;
  for (unsigned long n = 1 + seed % stride; n <= total; n += stride, runs++)
    psd_run(n, (runs + seed) % 2 ? ALL_AFTER : "1");
  fprintf(stderr, "psd sweep: %lu allocations while serving the victim; %lu runs from N=%lu by "
          "%lu, one failure and all from N on in turn\n",
          total, runs, 1 + seed % stride, stride);
}
END_TEST

Suite *suite_faultsim(void) {
  Suite *s = suite_create("faultsim");
  TCase *tc = tcase_create("faultsim");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, client_sweep);
  tcase_add_test(tc, psd_sweep);
  suite_add_tcase(s, tc);
  return s;
}
