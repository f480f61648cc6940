/* The shared helpers (common/util.c): overflow-checked growth of one array
 * and of parallel arrays, percentiles, the clocks, host:port parsing; and
 * the rate limit of peer-triggered log lines (common/ratelog.c). */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backoff.h"
#include "invariant.h"
#include "log.h"
#include "ratelog.h"
#include "util.h"
#include "wire.h"
#include "testutil.h"

/* ---- growth ------------------------------------------------------------ */

START_TEST(test_grow_doubles) {
  int *a = NULL;
  size_t cap = 0;
  ck_assert_int_eq(ps__grow((void **)&a, &cap, 1, sizeof *a), 0);
  ck_assert_uint_eq(cap, 16);
  for (int i = 0; i < 16; i++) a[i] = i;
  ck_assert_int_eq(ps__grow((void **)&a, &cap, 17, sizeof *a), 0);
  ck_assert_uint_eq(cap, 32);
  for (int i = 0; i < 16; i++) ck_assert_int_eq(a[i], i);
  ck_assert_int_eq(ps__grow((void **)&a, &cap, 20, sizeof *a), 0); /* fits: no change */
  ck_assert_uint_eq(cap, 32);
  free(a);
}
END_TEST

START_TEST(test_grow_overflow_refused) {
  char *a = NULL;
  size_t cap = 0;
  ck_assert_int_eq(ps__grow((void **)&a, &cap, 4, 1), 0);
  char *before = a;
  size_t cap_before = cap;
  /* need * elem overflows size_t: refused, nothing changed. */
  ck_assert_int_eq(ps__grow((void **)&a, &cap, SIZE_MAX / 8 + 2, 16), -1);
  ck_assert_ptr_eq(a, before);
  ck_assert_uint_eq(cap, cap_before);
  /* The doubling itself would overflow. */
  ck_assert_int_eq(ps__grow((void **)&a, &cap, SIZE_MAX, 1), -1);
  ck_assert_uint_eq(cap, cap_before);
  free(a);
}
END_TEST

START_TEST(test_grow_all_parallel) {
  uint64_t *x = NULL;
  uint8_t *y = NULL;
  size_t cap = 0;
  const ps__array arrays[] = {{(void **)&x, sizeof *x}, {(void **)&y, sizeof *y}};
  ck_assert_int_eq(ps__grow_all(arrays, 2, &cap, 3), 0);
  ck_assert_uint_eq(cap, 16);
  for (size_t i = 0; i < cap; i++) {
    ck_assert_uint_eq(x[i], 0); /* new elements are zeroed */
    ck_assert_uint_eq(y[i], 0);
    x[i] = i + 1;
    y[i] = (uint8_t)(i + 1);
  }
  ck_assert_int_eq(ps__grow_all(arrays, 2, &cap, 100), 0);
  ck_assert_uint_eq(cap, 128);
  for (size_t i = 0; i < cap; i++) {
    ck_assert_uint_eq(x[i], i < 16 ? i + 1 : 0);
    ck_assert_uint_eq(y[i], i < 16 ? (uint8_t)(i + 1) : 0);
  }
  ck_assert_int_eq(ps__grow_all(arrays, 2, &cap, SIZE_MAX / 4), -1);
  ck_assert_uint_eq(cap, 128);
  free(x);
  free(y);
}
END_TEST

/* ---- percentiles and clocks -------------------------------------------- */

START_TEST(test_percentile) {
  ck_assert(ps__percentile(NULL, 0, 50) == 0);
  double v[] = {5, 1, 4, 2, 3};
  ck_assert(ps__percentile(v, 5, 50) == 3);
  ck_assert(ps__percentile(v, 5, 0) == 1);
  ck_assert(ps__percentile(v, 5, 100) == 5);
  double w[] = {7};
  ck_assert(ps__percentile(w, 1, 95) == 7);
}
END_TEST

START_TEST(test_clocks) {
  double a = ps__now(), b = ps__now();
  ck_assert(b >= a);
  double u = ps__unix_now();
  ck_assert(u > 1.6e9); /* after 2020: the wall clock, not the monotonic one */
}
END_TEST

/* ---- host:port --------------------------------------------------------- */

static int hp(const char *s, char *host, size_t cap, int *port) {
  memset(host, 'Z', cap);
  *port = -7;
  return ps__parse_hostport(s, host, cap, port);
}

START_TEST(test_hostport_ok) {
  char host[256];
  int port;
  ck_assert_int_eq(hp("127.0.0.1:80", host, sizeof host, &port), 0);
  ck_assert_str_eq(host, "127.0.0.1");
  ck_assert_int_eq(port, 80);
  ck_assert_int_eq(hp("host:65535", host, sizeof host, &port), 0);
  ck_assert_str_eq(host, "host");
  ck_assert_int_eq(port, 65535);
  ck_assert_int_eq(hp("[::1]:7000", host, sizeof host, &port), 0);
  ck_assert_str_eq(host, "::1");
  ck_assert_int_eq(port, 7000);
  ck_assert_int_eq(hp("h:1", host, sizeof host, &port), 0);
  ck_assert_str_eq(host, "h");
  ck_assert_int_eq(port, 1);
  ck_assert_int_eq(hp("[fe80::1:2]:443", host, sizeof host, &port), 0);
  ck_assert_str_eq(host, "fe80::1:2");
  ck_assert_int_eq(port, 443);
  /* A host of exactly hostcap-1 bytes fits. */
  char s[64], want[16];
  memset(want, 'a', 15);
  want[15] = '\0';
  snprintf(s, sizeof s, "%s:9", want);
  char small[16];
  ck_assert_int_eq(hp(s, small, sizeof small, &port), 0);
  ck_assert_str_eq(small, want);
  ck_assert_int_eq(port, 9);
}
END_TEST

START_TEST(test_hostport_bad) {
  const char *bad[] = {"",          "host",        "host:",      ":80",
                       "host:0",    "host:65536",  "host:12x",   "[::1]7000",
                       "host:-1",   "host:99999999999999999999", "[::1]",
                       "[]:80",     "[::1:80",     "host:x",     ":"};
  char host[256];
  int port;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = hp(bad[i], host, sizeof host, &port);
    ck_assert_msg(rc == PS_EINVAL, "'%s' gave %d, port %d", bad[i], rc, port);
    ck_assert_msg(port == -7, "'%s' changed the port on failure", bad[i]);
  }
  ck_assert_int_eq(ps__parse_hostport(NULL, host, sizeof host, &port),
                   PS_EINVAL);
  /* Over-long hosts: one byte too many for the buffer, and far too many. */
  char s[600], small[16];
  memset(s, 'a', 16);
  strcpy(s + 16, ":80");
  ck_assert_int_eq(hp(s, small, sizeof small, &port), PS_EINVAL);
  memset(s, 'b', 300);
  strcpy(s + 300, ":80");
  ck_assert_int_eq(hp(s, host, sizeof host, &port), PS_EINVAL);
  memset(s, 'c', 300);
  s[0] = '[';
  strcpy(s + 300, "]:80");
  ck_assert_int_eq(hp(s, host, sizeof host, &port), PS_EINVAL);
}
END_TEST

/* PS_ASSERT is on in every build (this one defines NDEBUG): a broken
 * invariant names itself and its line on stderr and aborts. */
START_TEST(test_assert_always_on) {
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 2);
    volatile int slots = 4;
    PS_ASSERT(slots < 4);
    _exit(0);
  }
  close(fds[1]);
  char buf[512] = "";
  ssize_t n = read(fds[0], buf, sizeof buf - 1);
  close(fds[0]);
  buf[n > 0 ? n : 0] = '\0';
  int st;
  waitpid(pid, &st, 0);
  ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "status 0x%x", st);
  ck_assert_msg(strstr(buf, "test_util.c:") && strstr(buf, "invariant broken: slots < 4"),
                "%s", buf);
}
END_TEST

/* ---- ratelog: the rule ------------------------------------------------- */

START_TEST(test_ratelog_rule) {
  ps__ratelog r = {.what = "test lines", .level = PS_LOG_DEBUG};
  int printed = 0;
  for (int i = 0; i < 100; i++) printed += ps__ratelog_say(&r, 10.0 + i * 0.001, "line %d", i);
  ck_assert_int_eq(printed, (int)PS__RATELOG_BURST);
  ck_assert_uint_eq(r.suppressed, 100 - PS__RATELOG_BURST);
  ps__ratelog_flush(&r, 10.5, 0); /* window not over: the count waits */
  ck_assert_uint_eq(r.suppressed, 100 - PS__RATELOG_BURST);
  ps__ratelog_flush(&r, 11.0, 0);
  ck_assert_uint_eq(r.suppressed, 0);
  ck_assert_int_eq(ps__ratelog_say(&r, 11.2, "a new window"), 1);
  ck_assert_uint_eq(r.total, 101);
}
END_TEST

/* A kind with its own burst and window (psrun task 0's: one line per 5 s),
 * and a forced summary before the window ends. */
START_TEST(test_ratelog_own_window) {
  ps__ratelog r = {.what = "slow lines", .level = PS_LOG_DEBUG, .burst = 1, .window_s = 5.0};
  ck_assert_int_eq(ps__ratelog_say(&r, 20.0, "first"), 1);
  for (int i = 0; i < 50; i++) ck_assert_int_eq(ps__ratelog_say(&r, 20.1 + i * 0.05, "more"), 0);
  ps__ratelog_flush(&r, 24.0, 0);
  ck_assert_uint_eq(r.suppressed, 50);
  ps__ratelog_flush(&r, 24.0, 1);
  ck_assert_uint_eq(r.suppressed, 0);
  ck_assert_int_eq(ps__ratelog_say(&r, 25.0, "next window"), 1);
  ck_assert_uint_eq(r.total, 52);
}
END_TEST

/* ---- escaped names ------------------------------------------------------ */

/* What a peer chose, printed: line breaks, terminal escapes, quotes and
 * bytes that are not UTF-8 come out as backslash sequences (printable
 * ASCII and UTF-8 as they are), and the output is cut, never overrun. */
START_TEST(test_escape_names) {
  static const struct { const char *in, *out; } cases[] = {
      {"emb", "emb"},
      {"emb.v2-\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", "emb.v2-\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"},
      {"a\nINFO [ps0] forged", "a\\nINFO [ps0] forged"},
      {"\x1b[2J\x1b]0;t\x07", "\\x1b[2J\\x1b]0;t\\x07"},
      {"it's \"q\" \\ \r\t\x7f", "it\\'s \\\"q\\\" \\\\ \\r\\t\\x7f"},
      {"\xff\xc3(\xc0\xaf\xed\xa0\x80\xf4\x90\x80\x80\xc3",
       "\\xff\\xc3(\\xc0\\xaf\\xed\\xa0\\x80\\xf4\\x90\\x80\\x80\\xc3"},
      {"c1 \xc2\x9b" "31m \xc2\x85", "c1 \\xc2\\x9b31m \\xc2\\x85"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    ck_assert_str_eq(PS__ESC(cases[i].in), cases[i].out);
  char all[256], big[PS__ESC_BYTES], small[5];
  memset(all, 0x9b, 255);
  all[255] = '\0';
  ck_assert_uint_eq(strlen(ps__escape(all, big, sizeof big)), 4 * 255);
  ck_assert_str_eq(ps__escape("ab\ncd", small, sizeof small), "ab\\n"); /* cut at an edge */
  ck_assert_str_eq(ps__escape("ab\x1b", small, sizeof small), "ab");
  ck_assert_str_eq(ps__escape(NULL, small, sizeof small), "");
}
END_TEST

/* The last wait is cut to end at the deadline, for one more try there;
 * after it the caller gives up (waits had ended early: a 5-s connect
 * timeout gave up after 3.9 s). */
START_TEST(test_backoff_tries_until_the_deadline) {
  ps__backoff b;
  ps__backoff_init(&b, 10.0, 10.0);
  double start = ps__now(), deadline = start + 0.2;
  double slept = ps__backoff_sleep(&b, deadline);
  ck_assert_msg(slept > 0.1 && slept <= 0.2, "slept %.3f s", slept);
  ck_assert_msg(ps__now() >= deadline - 0.01, "woke %.3f s early", deadline - ps__now());
  ck_assert(ps__backoff_sleep(&b, deadline) < 0);
}
END_TEST

Suite *suite_util(void) {
  Suite *s = suite_create("util");
  TCase *tc = tcase_create("grow");
  tcase_add_test(tc, test_grow_doubles);
  tcase_add_test(tc, test_grow_overflow_refused);
  tcase_add_test(tc, test_grow_all_parallel);
  suite_add_tcase(s, tc);
  TCase *tm = tcase_create("misc");
  tcase_add_test(tm, test_percentile);
  tcase_add_test(tm, test_clocks);
  tcase_add_test(tm, test_assert_always_on);
  tcase_add_test(tm, test_backoff_tries_until_the_deadline);
  suite_add_tcase(s, tm);
  TCase *th = tcase_create("hostport");
  tcase_add_test(th, test_hostport_ok);
  tcase_add_test(th, test_hostport_bad);
  tcase_add_test(th, test_escape_names);
  suite_add_tcase(s, th);
  TCase *tr = tcase_create("ratelog");
  tcase_add_test(tr, test_ratelog_rule);
  tcase_add_test(tr, test_ratelog_own_window);
  suite_add_tcase(s, tr);
  return s;
}
