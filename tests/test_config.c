/* psd's command line (psd/config.c): defaults, both option forms, range
 * checks with messages naming the option and value, cross-option rules. */
#include <check.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "psclient.h"
#include "psdlog.h"
#include "testutil.h"

#define MAXARGS 32

/* Parses "psd" followed by the NULL-terminated args. */
static int parse_argv(psd_config *cfg, char *err, size_t errlen,
                      const char *const *args) {
  const char *argv[MAXARGS + 2];
  int argc = 0;
  argv[argc++] = "psd";
  for (; args[argc - 1]; argc++) {
    ck_assert_int_lt(argc, MAXARGS);
    argv[argc] = args[argc - 1];
  }
  argv[argc] = NULL;
  memset(err, 0, errlen);
  return psd_config_parse(cfg, argc, (char **)argv, err, errlen);
}

static int parse(psd_config *cfg, char *err, size_t errlen, ...) {
  const char *args[MAXARGS + 1];
  va_list ap;
  va_start(ap, errlen);
  int n = 0;
  const char *a;
  while ((a = va_arg(ap, const char *)) != NULL) {
    ck_assert_int_lt(n, MAXARGS);
    args[n++] = a;
  }
  va_end(ap);
  args[n] = NULL;
  return parse_argv(cfg, err, errlen, args);
}

/* The parse must fail, with a message containing each of the needles. */
#define EXPECT_FAIL(needle1, needle2, ...)                                     \
  do {                                                                         \
    psd_config c_;                                                             \
    char e_[512];                                                              \
    int rc_ = parse(&c_, e_, sizeof e_, __VA_ARGS__, (const char *)NULL);      \
    ck_assert_msg(rc_ == -1, "expected failure, got %d", rc_);                 \
    ck_assert_msg(strlen(e_) > 0, "failure without a message");                \
    ck_assert_msg(strstr(e_, (needle1)) != NULL,                               \
                  "message '%s' does not mention '%s'", e_, (needle1));        \
    ck_assert_msg(strstr(e_, (needle2)) != NULL,                               \
                  "message '%s' does not mention '%s'", e_, (needle2));        \
  } while (0)

#define EXPECT_OK(cfg, ...)                                                    \
  do {                                                                         \
    char e_[512];                                                              \
    int rc_ = parse((cfg), e_, sizeof e_, __VA_ARGS__, (const char *)NULL);    \
    ck_assert_msg(rc_ == 0, "rejected (%d): %s", rc_, e_);                     \
  } while (0)

/* ---- defaults and forms ------------------------------------------------ */

START_TEST(test_defaults) {
  psd_config c;
  char err[256];
  memset(&c, 0x5A, sizeof c); /* the parser must reset everything */
  const char *none[] = {NULL};
  ck_assert_int_eq(parse_argv(&c, err, sizeof err, none), 0);
  ck_assert_str_eq(c.host, "127.0.0.1");
  ck_assert_int_eq(c.port, 0);
  ck_assert_str_eq(c.port_file, "");
  ck_assert_int_eq(c.ps_index, 0);
  ck_assert_int_eq(c.num_ps, 1);
  ck_assert_int_eq(c.workers, 0);
  ck_assert_int_eq(c.replicas, 0);
  ck_assert_int_eq(c.mode, PSD_MODE_AUTO);
  ck_assert_double_eq(c.grace_s, 60.0);
  ck_assert_double_eq(c.stall_s, 30.0);
  ck_assert_double_gt(c.startup_timeout_s, 0.0);
  ck_assert_double_gt(c.pull_timeout_s, 0.0);
  ck_assert_int_ge(c.log_every, 1);
  ck_assert_int_eq(c.log_level, PSD_LOG_INFO);
  ck_assert_str_eq(c.name, "ps0");
  ck_assert_int_gt(c.sock_buf, 0);
}
END_TEST

START_TEST(test_both_forms) {
  psd_config a, b;
  EXPECT_OK(&a, "--port", "5000");
  ck_assert_int_eq(a.port, 5000);
  EXPECT_OK(&b, "--port=5000");
  ck_assert_int_eq(b.port, 5000);

  EXPECT_OK(&a, "--host", "0.0.0.0", "--num-ps", "4", "--ps-index", "3",
            "--workers", "8", "--replicas-to-aggregate", "6", "--mode", "sync",
            "--grace-period", "2.5", "--stall-timeout", "0.5",
            "--startup-timeout", "0", "--pull-timeout", "12", "--log-every",
            "7", "--log-level", "debug", "--name", "shard",
            "--socket-buffer", "65536", "--port-file", "/tmp/x.port");
  EXPECT_OK(&b, "--host=0.0.0.0", "--num-ps=4", "--ps-index=3", "--workers=8",
            "--replicas-to-aggregate=6", "--mode=sync", "--grace-period=2.5",
            "--stall-timeout=0.5", "--startup-timeout=0", "--pull-timeout=12",
            "--log-every=7", "--log-level=debug", "--name=shard",
            "--socket-buffer=65536", "--port-file=/tmp/x.port");
  const psd_config *cs[] = {&a, &b};
  for (int i = 0; i < 2; i++) {
    const psd_config *c = cs[i];
    ck_assert_str_eq(c->host, "0.0.0.0");
    ck_assert_int_eq(c->num_ps, 4);
    ck_assert_int_eq(c->ps_index, 3);
    ck_assert_int_eq(c->workers, 8);
    ck_assert_int_eq(c->replicas, 6);
    ck_assert_int_eq(c->mode, PSD_MODE_SYNC);
    ck_assert_double_eq(c->grace_s, 2.5);
    ck_assert_double_eq(c->stall_s, 0.5);
    ck_assert_double_eq(c->startup_timeout_s, 0.0);
    ck_assert_double_eq(c->pull_timeout_s, 12.0);
    ck_assert_int_eq(c->log_every, 7);
    ck_assert_int_eq(c->log_level, PSD_LOG_DEBUG);
    ck_assert_str_eq(c->name, "shard");
    ck_assert_int_eq(c->sock_buf, 65536);
    ck_assert_str_eq(c->port_file, "/tmp/x.port");
  }
  /* A value containing '=' after the first one is kept whole, and the last
   * of a repeated option wins. */
  EXPECT_OK(&a, "--name=a=b", "--port", "1", "--port=2");
  ck_assert_str_eq(a.name, "a=b");
  ck_assert_int_eq(a.port, 2);
  /* A separate value may itself start with "--" (it is a value). */
  EXPECT_OK(&a, "--name", "--x");
  ck_assert_str_eq(a.name, "--x");
}
END_TEST

START_TEST(test_boundaries_accepted) {
  psd_config c;
  EXPECT_OK(&c, "--port", "0");
  ck_assert_int_eq(c.port, 0);
  EXPECT_OK(&c, "--port", "65535");
  ck_assert_int_eq(c.port, 65535);
  EXPECT_OK(&c, "--num-ps", "65536", "--ps-index", "65535");
  ck_assert_int_eq(c.num_ps, 65536);
  ck_assert_int_eq(c.ps_index, 65535);
  EXPECT_OK(&c, "--workers", "1000000", "--replicas-to-aggregate", "1000000");
  ck_assert_int_eq(c.workers, 1000000);
  ck_assert_int_eq(c.replicas, 1000000);
  EXPECT_OK(&c, "--log-every", "2147483647");
  ck_assert_int_eq(c.log_every, 2147483647);
  EXPECT_OK(&c, "--log-every", "1");
  ck_assert_int_eq(c.log_every, 1);
  EXPECT_OK(&c, "--socket-buffer", "1073741824");
  ck_assert_int_eq(c.sock_buf, 1 << 30);
  EXPECT_OK(&c, "--socket-buffer", "0");
  ck_assert_int_eq(c.sock_buf, 0);
  EXPECT_OK(&c, "--grace-period", "0", "--startup-timeout", "1e9");
  ck_assert_double_eq(c.grace_s, 0.0);
  ck_assert_double_eq(c.startup_timeout_s, 1e9);
  EXPECT_OK(&c, "--stall-timeout", "0.01", "--pull-timeout", "0.01");
  ck_assert_double_eq(c.stall_s, 0.01);
  ck_assert_double_eq(c.pull_timeout_s, 0.01);
}
END_TEST

/* ---- bad numbers ------------------------------------------------------- */

typedef struct {
  const char *opt;      /* "--port" */
  const char *bad[10];  /* NULL-terminated */
} bad_case;

static const bad_case BAD_NUMBERS[] = {
    {"--port", {"abc", "-1", "65536", "5000x", "50 00", "1.5", "0x10",
                "99999999999999999999", " ", NULL}},
    {"--ps-index", {"zero", "-1", "65536", "1x", "1.0", NULL}},
    {"--num-ps", {"one", "0", "-3", "65537", "2abc", "2e1", NULL}},
    {"--workers", {"many", "-1", "1000001", "4 ", "4,5", NULL}},
    {"--replicas-to-aggregate", {"all", "-1", "1000001", "3q", NULL}},
    {"--log-every", {"often", "0", "-5", "2147483648", "10s", NULL}},
    {"--socket-buffer", {"big", "-1", "1073741825", "4M", "4096k", NULL}},
    {"--grace-period", {"long", "-1", "-0.001", "1e10", "nan", "inf", "60s",
                        "1,5", NULL}},
    {"--stall-timeout", {"x", "0", "0.001", "-1", "1e10", "infinity", "30sec",
                         NULL}},
    {"--startup-timeout", {"never", "-1", "1e10", "NaN", "900 ", NULL}},
    {"--pull-timeout", {"soon", "0", "0.009", "2e9", "600ms", NULL}},
};

START_TEST(test_bad_numbers) {
  for (size_t i = 0; i < sizeof BAD_NUMBERS / sizeof BAD_NUMBERS[0]; i++) {
    const bad_case *bc = &BAD_NUMBERS[i];
    for (int j = 0; bc->bad[j]; j++) {
      const char *v = bc->bad[j];
      /* Separate-value form. */
      {
        psd_config c;
        char err[512];
        int rc = parse(&c, err, sizeof err, bc->opt, v, (const char *)NULL);
        ck_assert_msg(rc == -1, "%s '%s' accepted (rc %d)", bc->opt, v, rc);
        ck_assert_msg(strstr(err, bc->opt) != NULL,
                      "%s '%s': message '%s' does not name the option",
                      bc->opt, v, err);
        ck_assert_msg(strstr(err, v) != NULL,
                      "%s '%s': message '%s' does not name the value", bc->opt,
                      v, err);
      }
      /* --opt=value form. */
      {
        char arg[128];
        snprintf(arg, sizeof arg, "%s=%s", bc->opt, v);
        psd_config c;
        char err[512];
        int rc = parse(&c, err, sizeof err, arg, (const char *)NULL);
        ck_assert_msg(rc == -1, "'%s' accepted (rc %d)", arg, rc);
        ck_assert_msg(strstr(err, bc->opt) != NULL && strstr(err, v) != NULL,
                      "'%s': message '%s' names neither option nor value", arg,
                      err);
      }
    }
    /* An empty value is no number either. */
    char arg[128];
    snprintf(arg, sizeof arg, "%s=", bc->opt);
    EXPECT_FAIL(bc->opt, "''", arg);
    EXPECT_FAIL(bc->opt, "''", bc->opt, "");
  }
}
END_TEST

START_TEST(test_bad_words) {
  EXPECT_FAIL("--mode", "'synchronous'", "--mode", "synchronous");
  EXPECT_FAIL("--mode", "'SYNC'", "--mode", "SYNC");
  EXPECT_FAIL("--mode", "'1'", "--mode=1");
  EXPECT_FAIL("--mode", "''", "--mode=");
  EXPECT_FAIL("--log-level", "'verbose'", "--log-level", "verbose");
  EXPECT_FAIL("--log-level", "'INFO'", "--log-level", "INFO");
  EXPECT_FAIL("--log-level", "'warning'", "--log-level=warning");
  EXPECT_FAIL("--log-level", "'3'", "--log-level", "3");

  psd_config c;
  EXPECT_OK(&c, "--mode", "async");
  ck_assert_int_eq(c.mode, PSD_MODE_ASYNC);
  EXPECT_OK(&c, "--mode", "sync");
  ck_assert_int_eq(c.mode, PSD_MODE_SYNC);
  EXPECT_OK(&c, "--mode=auto");
  ck_assert_int_eq(c.mode, PSD_MODE_AUTO);
  const char *levels[] = {"error", "warn", "info", "debug"};
  const int want[] = {PSD_LOG_ERROR, PSD_LOG_WARN, PSD_LOG_INFO, PSD_LOG_DEBUG};
  for (int i = 0; i < 4; i++) {
    EXPECT_OK(&c, "--log-level", levels[i]);
    ck_assert_int_eq(c.log_level, want[i]);
  }
}
END_TEST

/* ---- malformed command lines ------------------------------------------- */

START_TEST(test_unknown_and_missing) {
  EXPECT_FAIL("--bogus", "unknown", "--bogus", "1");
  EXPECT_FAIL("--bogus", "unknown", "--bogus=1");
  EXPECT_FAIL("--portx", "unknown", "--portx", "1");
  EXPECT_FAIL("--por'", "unknown", "--por", "1"); /* no prefix matching */
  EXPECT_FAIL("--'", "unknown", "--");
  /* A known option with no value left. */
  EXPECT_FAIL("--port", "value", "--port");
  EXPECT_FAIL("--log-level", "value", "--port", "1", "--log-level");
  EXPECT_FAIL("--name", "value", "--name");
  /* Positional arguments and single-dash options. */
  EXPECT_FAIL("'extra'", "argument", "extra");
  EXPECT_FAIL("'5000'", "argument", "--port", "1", "5000");
  EXPECT_FAIL("'-p'", "argument", "-p", "5000");
  EXPECT_FAIL("'-'", "argument", "-");
  /* The first error wins: an unknown option before a bad value. */
  EXPECT_FAIL("--nope", "unknown", "--nope", "--port", "x");
}
END_TEST

START_TEST(test_cross_checks) {
  EXPECT_FAIL("--ps-index", "--num-ps", "--ps-index", "1");
  EXPECT_FAIL("--ps-index", "--num-ps", "--ps-index", "3", "--num-ps", "3");
  EXPECT_FAIL("--ps-index", "--num-ps", "--num-ps", "2", "--ps-index", "5");
  psd_config c;
  EXPECT_OK(&c, "--ps-index", "2", "--num-ps", "3");
  ck_assert_int_eq(c.ps_index, 2);

  EXPECT_FAIL("--replicas-to-aggregate", "--workers", "--workers", "2",
              "--replicas-to-aggregate", "3");
  EXPECT_FAIL("--replicas-to-aggregate", "--workers",
              "--replicas-to-aggregate=9", "--workers=1");
  EXPECT_OK(&c, "--workers", "3", "--replicas-to-aggregate", "3");
  ck_assert_int_eq(c.replicas, 3);
  EXPECT_OK(&c, "--workers", "3", "--replicas-to-aggregate", "2");
  ck_assert_int_eq(c.replicas, 2);
  /* Unknown worker count: any replica count is allowed for now. */
  EXPECT_OK(&c, "--replicas-to-aggregate", "5");
  ck_assert_int_eq(c.workers, 0);
  ck_assert_int_eq(c.replicas, 5);
}
END_TEST

START_TEST(test_name_default) {
  psd_config c;
  EXPECT_OK(&c, "--ps-index", "2", "--num-ps", "3");
  ck_assert_str_eq(c.name, "ps2");
  EXPECT_OK(&c, "--num-ps=100", "--ps-index=42");
  ck_assert_str_eq(c.name, "ps42");
  EXPECT_OK(&c, "--ps-index", "2", "--num-ps", "3", "--name", "west");
  ck_assert_str_eq(c.name, "west");
  EXPECT_OK(&c, "--name", "west", "--name=", "--num-ps", "3", "--ps-index",
            "1");
  ck_assert_str_eq(c.name, "ps1");
}
END_TEST

/* prefix followed by n 'a's (malloc'd). */
static char *repeat(size_t n, const char *prefix) {
  size_t p = strlen(prefix);
  char *s = malloc(p + n + 1);
  ck_assert_ptr_nonnull(s);
  memcpy(s, prefix, p);
  memset(s + p, 'a', n);
  s[p + n] = '\0';
  return s;
}

START_TEST(test_long_strings) {
  psd_config c;
  psd_config *cp = &c;
  const struct {
    const char *opt;
    size_t cap;
  } strs[] = {{"--port-file", sizeof c.port_file},
              {"--host", sizeof c.host},
              {"--name", sizeof c.name}};
  for (size_t i = 0; i < 3; i++) {
    /* cap-1 bytes fit exactly. */
    char *fits = repeat(strs[i].cap - 1, "");
    EXPECT_OK(cp, strs[i].opt, fits);
    const char *got = strcmp(strs[i].opt, "--port-file") == 0 ? c.port_file
                      : strcmp(strs[i].opt, "--host") == 0    ? c.host
                                                              : c.name;
    ck_assert_str_eq(got, fits);
    free(fits);
    /* One more, or far more, does not. */
    char *over = repeat(strs[i].cap, "");
    EXPECT_FAIL(strs[i].opt, "long", strs[i].opt, over);
    free(over);
    over = repeat(4 * strs[i].cap, "");
    EXPECT_FAIL(strs[i].opt, "long", strs[i].opt, over);
    free(over);
    char opteq[32];
    snprintf(opteq, sizeof opteq, "%s=", strs[i].opt);
    over = repeat(strs[i].cap, opteq);
    EXPECT_FAIL(strs[i].opt, "long", over);
    free(over);
  }
}
END_TEST

/* ---- --help / --version ------------------------------------------------ */

/* Runs the parse with stdout sent to a temporary file; returns the rc and
 * what was printed (malloc'd) in *out. */
static int parse_quiet(char **out, const char *const *args) {
  FILE *tmp = tmpfile();
  ck_assert_ptr_nonnull(tmp);
  fflush(stdout);
  int saved = dup(STDOUT_FILENO);
  ck_assert_int_ge(saved, 0);
  ck_assert_int_ge(dup2(fileno(tmp), STDOUT_FILENO), 0);
  psd_config c;
  char err[256];
  int rc = parse_argv(&c, err, sizeof err, args);
  fflush(stdout);
  ck_assert_int_ge(dup2(saved, STDOUT_FILENO), 0);
  close(saved);
  fseek(tmp, 0, SEEK_END);
  long len = ftell(tmp);
  ck_assert_int_ge(len, 0);
  rewind(tmp);
  char *buf = malloc((size_t)len + 1);
  ck_assert_ptr_nonnull(buf);
  size_t got = fread(buf, 1, (size_t)len, tmp);
  buf[got] = '\0';
  fclose(tmp);
  *out = buf;
  return rc;
}

START_TEST(test_help_version) {
  char *out;
  const char *help[] = {"--help", NULL};
  ck_assert_int_eq(parse_quiet(&out, help), 1);
  ck_assert_ptr_nonnull(strstr(out, "usage"));
  /* Every option is listed. */
  const char *opts[] = {"--host",         "--port",          "--port-file",
                        "--ps-index",     "--num-ps",        "--workers",
                        "--replicas-to-aggregate",           "--mode",
                        "--grace-period", "--stall-timeout",
                        "--startup-timeout",
                        "--pull-timeout", "--log-every",     "--log-level",
                        "--name",         "--socket-buffer", "--version"};
  for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++)
    ck_assert_msg(strstr(out, opts[i]) != NULL, "--help omits %s", opts[i]);
  free(out);

  const char *h[] = {"-h", NULL};
  ck_assert_int_eq(parse_quiet(&out, h), 1);
  ck_assert_ptr_nonnull(strstr(out, "usage"));
  free(out);

  /* --help wins over later bad options. */
  const char *help_bad[] = {"--port", "1", "--help", "--port", "x", NULL};
  ck_assert_int_eq(parse_quiet(&out, help_bad), 1);
  free(out);

  const char *version[] = {"--version", NULL};
  ck_assert_int_eq(parse_quiet(&out, version), 1);
  char want[64];
  snprintf(want, sizeof want, "psd %d.%d.%d", PS_VERSION_MAJOR,
           PS_VERSION_MINOR, PS_VERSION_PATCH);
  ck_assert_msg(strstr(out, want) != NULL, "--version printed '%s'", out);
  free(out);

  /* An earlier error is reported, not help. */
  psd_config c;
  char err[256];
  const char *bad_help[] = {"--port", "x", "--help", NULL};
  ck_assert_int_eq(parse_argv(&c, err, sizeof err, bad_help), -1);
  ck_assert_ptr_nonnull(strstr(err, "--port"));

  /* stdout works again afterwards. */
  ck_assert_int_ge(fflush(stdout), 0);
}
END_TEST

Suite *suite_config(void) {
  Suite *s = suite_create("config");
  TCase *tc = tcase_create("parse");
  tcase_add_test(tc, test_defaults);
  tcase_add_test(tc, test_both_forms);
  tcase_add_test(tc, test_boundaries_accepted);
  tcase_add_test(tc, test_bad_numbers);
  tcase_add_test(tc, test_bad_words);
  tcase_add_test(tc, test_unknown_and_missing);
  tcase_add_test(tc, test_cross_checks);
  tcase_add_test(tc, test_name_default);
  tcase_add_test(tc, test_long_strings);
  tcase_add_test(tc, test_help_version);
  suite_add_tcase(s, tc);
  return s;
}
