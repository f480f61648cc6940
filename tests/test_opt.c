/* The shared option-table parser (common/opt.c): every type, defaults then
 * argv, both value forms and aliases, ranges, choices, lists, positional
 * arguments, --help, and one-sentence errors naming option and value. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "opt.h"
#include "testutil.h"

typedef struct demo {
  int n;
  int64_t job;
  double secs;
  char name[8];
  int verbose;
  int mode;
  char role[8];
  ps__opt_list extra;
} demo;

#define F(f) PS_OPT_FIELD(demo, f)
static const ps__opt OPTS[] = {
    {"count", 'n', PS_OPT_INT, F(n), "3", 0, 100, NULL, "how many"},
    {"job-id", 0, PS_OPT_INT64, F(job), "-1", -1, 9.2e18, NULL, "a Slurm job id"},
    {"secs", 0, PS_OPT_DOUBLE, F(secs), "1.5", 0.01, 60, NULL, "seconds"},
    {"name", 0, PS_OPT_STR, F(name), "abc", 0, 0, NULL, "a name"},
    {"verbose", 'v', PS_OPT_FLAG, F(verbose), "0", 0, 0, NULL, "say more"},
    {"mode", 0, PS_OPT_CHOICE, F(mode), "auto", 0, 0, "auto|sync|async", "a mode"},
    {"role", 0, PS_OPT_CHOICE_STR, F(role), "any", 0, 0, "any|ps|worker", "a role"},
    {"extra", 0, PS_OPT_LIST, F(extra), NULL, 0, 0, NULL, "repeatable"},
};

static ps__opt_parser parser(ps__opt_pos pos, int max_pos) {
  ps__opt_parser p = {OPTS, sizeof OPTS / sizeof OPTS[0], "usage: demo\n", "demo 1.0",
                      pos, max_pos, 20};
  return p;
}

/* Parses "demo" + args (NULL-terminated) with positional policy pos. */
static int run(demo *d, ps__opt_pos pos, ps__opt_args *rest, char *err, size_t errlen,
               const char *const *args) {
  char *argv[32] = {"demo"};
  int argc = 1;
  for (; args[argc - 1]; argc++) argv[argc] = (char *)args[argc - 1];
  memset(d, 0, sizeof *d);
  err[0] = '\0';
  ps__opt_parser p = parser(pos, 2);
  return ps__opt_parse(&p, d, argc, argv, rest, err, errlen);
}

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

/* The parse fails with a message naming both needles, on one line. */
static void expect_fail(const char *n1, const char *n2, const char *const *args) {
  demo d;
  char err[256];
  int rc = run(&d, PS_OPT_POS_ERROR, NULL, err, sizeof err, args);
  ck_assert_msg(rc == -1, "accepted (%d): %s", rc, args[0]);
  ck_assert_msg(strstr(err, n1) && strstr(err, n2), "'%s' lacks '%s' or '%s'", err, n1, n2);
  ck_assert_msg(!strchr(err, '\n'), "'%s' is not one sentence", err);
}

START_TEST(test_defaults) {
  demo d;
  char err[256];
  memset(&d, 0x5A, sizeof d);
  ck_assert_int_eq(run(&d, PS_OPT_POS_ERROR, NULL, err, sizeof err, ARGS(NULL)), 0);
  ck_assert_int_eq(d.n, 3);
  ck_assert(d.job == -1);
  ck_assert_double_eq(d.secs, 1.5);
  ck_assert_str_eq(d.name, "abc");
  ck_assert_int_eq(d.verbose, 0);
  ck_assert_int_eq(d.mode, 0);
  ck_assert_str_eq(d.role, "any");
  ck_assert_int_eq(d.extra.n, 0);
}
END_TEST

START_TEST(test_forms) {
  demo d;
  char err[256];
  ck_assert_int_eq(run(&d, PS_OPT_POS_ERROR, NULL, err, sizeof err,
                       ARGS("--count", "7", "--job-id=8589934593", "--secs", "2.25",
                            "--name=x=y", "-v", "--mode", "async", "--role=ps", "--extra",
                            "a", "--extra=--b")),
                   0);
  ck_assert_int_eq(d.n, 7);
  ck_assert(d.job == 8589934593LL); /* beyond 32 bits, exact */
  ck_assert_double_eq(d.secs, 2.25);
  ck_assert_str_eq(d.name, "x=y");
  ck_assert_int_eq(d.verbose, 1);
  ck_assert_int_eq(d.mode, 2);
  ck_assert_str_eq(d.role, "ps");
  ck_assert_int_eq(d.extra.n, 2);
  ck_assert_str_eq(d.extra.v[0], "a");
  ck_assert_str_eq(d.extra.v[1], "--b");
  ck_assert_ptr_null(d.extra.v[2]);
  /* Short forms, and the last of a repeated option wins. */
  ck_assert_int_eq(run(&d, PS_OPT_POS_ERROR, NULL, err, sizeof err,
                       ARGS("-n", "4", "-n5", "--verbose")), 0);
  ck_assert_int_eq(d.n, 5);
  ck_assert_int_eq(d.verbose, 1);
  /* Largest int64 the range allows; a value may start with "--". */
  ck_assert_int_eq(run(&d, PS_OPT_POS_ERROR, NULL, err, sizeof err,
                       ARGS("--job-id", "9199999999999999999", "--name", "--x")), 0);
  ck_assert(d.job == 9199999999999999999LL);
  ck_assert_str_eq(d.name, "--x");
}
END_TEST

START_TEST(test_errors) {
  expect_fail("--count", "'abc'", ARGS("--count", "abc"));
  expect_fail("--count", "'101'", ARGS("--count=101"));
  expect_fail("--count", "'-1'", ARGS("-n", "-1"));
  expect_fail("--count", "''", ARGS("--count="));
  expect_fail("--count", "'1.5'", ARGS("-n1.5"));
  expect_fail("--job-id", "'-2'", ARGS("--job-id", "-2"));
  expect_fail("--job-id", "'99999999999999999999'", ARGS("--job-id", "99999999999999999999"));
  expect_fail("--job-id", "'12x'", ARGS("--job-id", "12x"));
  expect_fail("--secs", "'nan'", ARGS("--secs", "nan"));
  expect_fail("--secs", "'0'", ARGS("--secs", "0"));
  expect_fail("--secs", "'61'", ARGS("--secs=61"));
  expect_fail("--name", "long", ARGS("--name", "12345678"));
  expect_fail("--mode", "'SYNC'", ARGS("--mode", "SYNC"));
  expect_fail("--mode", "auto|sync|async", ARGS("--mode", "syn"));
  expect_fail("--role", "'boss'", ARGS("--role=boss"));
  expect_fail("--verbose", "no value", ARGS("--verbose=1"));
  expect_fail("--count", "needs a value", ARGS("--count"));
  expect_fail("'--bogus'", "unknown", ARGS("--bogus", "1"));
  expect_fail("'--cou'", "unknown", ARGS("--cou", "1")); /* no prefixes */
  expect_fail("'-x'", "unknown", ARGS("-x"));
  expect_fail("'stray'", "unexpected argument", ARGS("stray"));
  /* The first error wins. */
  expect_fail("'--nope'", "unknown", ARGS("--nope", "--count", "x"));
  /* A list holds PS_OPT_LIST_MAX - 1 values. */
  const char *many[2 * PS_OPT_LIST_MAX + 1];
  for (int i = 0; i < PS_OPT_LIST_MAX; i++) {
    many[2 * i] = "--extra";
    many[2 * i + 1] = "v";
  }
  many[2 * PS_OPT_LIST_MAX] = NULL;
  char *argv[2 * PS_OPT_LIST_MAX + 2] = {"demo"};
  for (int i = 0; i < 2 * PS_OPT_LIST_MAX; i++) argv[i + 1] = (char *)many[i];
  demo d;
  char err[256];
  memset(&d, 0, sizeof d);
  ps__opt_parser p = parser(PS_OPT_POS_ERROR, 0);
  ck_assert_int_eq(ps__opt_parse(&p, &d, 2 * PS_OPT_LIST_MAX - 1, argv, NULL, err, sizeof err), 0);
  ck_assert_int_eq(d.extra.n, PS_OPT_LIST_MAX - 1);
  memset(&d, 0, sizeof d);
  ck_assert_int_eq(ps__opt_parse(&p, &d, 2 * PS_OPT_LIST_MAX + 1, argv, NULL, err, sizeof err), -1);
  ck_assert_ptr_nonnull(strstr(err, "--extra"));
}
END_TEST

START_TEST(test_positionals) {
  demo d;
  char err[256];
  ps__opt_args rest;
  /* Stop: the command starts at the first non-option, or after "--". */
  ck_assert_int_eq(run(&d, PS_OPT_POS_STOP, &rest, err, sizeof err,
                       ARGS("-n", "2", "./cmd", "--count", "9")), 0);
  ck_assert_int_eq(rest.first, 3);
  ck_assert_int_eq(d.n, 2);
  ck_assert_int_eq(run(&d, PS_OPT_POS_STOP, &rest, err, sizeof err,
                       ARGS("-v", "--", "--count", "9")), 0);
  ck_assert_int_eq(rest.first, 3);
  ck_assert_int_eq(d.n, 3);
  ck_assert_int_eq(run(&d, PS_OPT_POS_STOP, &rest, err, sizeof err, ARGS("-v")), 0);
  ck_assert_int_eq(rest.first, 2);
  /* Collect: up to max_pos, anywhere among the options. */
  ck_assert_int_eq(run(&d, PS_OPT_POS_COLLECT, &rest, err, sizeof err,
                       ARGS("stats", "--count", "1", "h:1")), 0);
  ck_assert_int_eq(rest.npos, 2);
  ck_assert_str_eq(rest.pos[0], "stats");
  ck_assert_str_eq(rest.pos[1], "h:1");
  ck_assert_int_eq(run(&d, PS_OPT_POS_COLLECT, &rest, err, sizeof err, ARGS("a", "b", "c")), -1);
  ck_assert_ptr_nonnull(strstr(err, "'c'"));
}
END_TEST

/* Runs a parse with stdout in a temporary file; returns what it printed. */
static char *captured(int *rc, const char *const *args) {
  FILE *tmp = tmpfile();
  ck_assert_ptr_nonnull(tmp);
  fflush(stdout);
  int saved = dup(STDOUT_FILENO);
  dup2(fileno(tmp), STDOUT_FILENO);
  demo d;
  char err[256];
  *rc = run(&d, PS_OPT_POS_ERROR, NULL, err, sizeof err, args);
  fflush(stdout);
  dup2(saved, STDOUT_FILENO);
  close(saved);
  long len = ftell(tmp);
  rewind(tmp);
  char *buf = calloc(1, (size_t)len + 1);
  ck_assert_int_eq(fread(buf, 1, (size_t)len, tmp), (size_t)len);
  fclose(tmp);
  return buf;
}

START_TEST(test_help) {
  int rc;
  char *out = captured(&rc, ARGS("--count", "1", "--help", "--count", "x"));
  ck_assert_int_eq(rc, 1);
  ck_assert_ptr_nonnull(strstr(out, "usage: demo\n"));
  ck_assert_ptr_nonnull(strstr(out, "  -n, --count VALUE    how many [3]\n"));
  ck_assert_ptr_nonnull(strstr(out, "  -v, --verbose        say more\n")); /* no [0] */
  ck_assert_ptr_nonnull(strstr(out, "--mode auto|sync|async"));
  ck_assert_ptr_nonnull(strstr(out, "--extra VALUE"));
  ck_assert_ptr_nonnull(strstr(out, "--help"));
  ck_assert_ptr_nonnull(strstr(out, "--version"));
  free(out);
  out = captured(&rc, ARGS("-h"));
  ck_assert_int_eq(rc, 1);
  free(out);
  out = captured(&rc, ARGS("--version"));
  ck_assert_int_eq(rc, 1);
  ck_assert_str_eq(out, "demo 1.0\n");
  free(out);
  /* An earlier error is reported, not help. */
  out = captured(&rc, ARGS("--count", "x", "--help"));
  ck_assert_int_eq(rc, -1);
  ck_assert_str_eq(out, "");
  free(out);
}
END_TEST

Suite *suite_opt(void) {
  Suite *s = suite_create("opt");
  TCase *tc = tcase_create("parse");
  tcase_add_test(tc, test_defaults);
  tcase_add_test(tc, test_forms);
  tcase_add_test(tc, test_errors);
  tcase_add_test(tc, test_positionals);
  tcase_add_test(tc, test_help);
  suite_add_tcase(s, tc);
  return s;
}
