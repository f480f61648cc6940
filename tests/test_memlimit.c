/* Unit: psd/memlimit.c reads the cgroup memory limit from fake
 * /proc/self/cgroup and /sys/fs/cgroup trees: v2 memory.max (and its
 * ancestors'), v1 memory.limit_in_bytes, "max" and v1's "unlimited"
 * (about 2^63) meaning none, and no files at all. */
#define _GNU_SOURCE
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "memlimit.h"
#include "testutil.h"

/* Writes text to root/rel, creating the directories on the way. */
static void put(const char *root, const char *rel, const char *text) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", root, rel);
  for (char *q = path + strlen(root) + 1; (q = strchr(q, '/')); q++) {
    *q = '\0';
    ck_assert_msg(mkdir(path, 0700) == 0 || errno == EEXIST, "mkdir %s", path);
    *q = '/';
  }
  FILE *f = fopen(path, "w");
  ck_assert_msg(f != NULL, "cannot write %s", path);
  fputs(text, f);
  fclose(f);
}

/* A fresh fake root per case. */
static const char *root(const char *name) {
  static char r[512];
  snprintf(r, sizeof r, "%s/cg-%s", tu_tmpdir(), name);
  mkdir(r, 0700);
  return r;
}

START_TEST(test_v2_limit_and_ancestors) {
  const char *r = root("v2");
  put(r, "proc/self/cgroup", "0::/job_7/step_0\n");
  put(r, "sys/fs/cgroup/job_7/step_0/memory.max", "max\n");
  put(r, "sys/fs/cgroup/job_7/memory.max", "2147483648\n");
  put(r, "sys/fs/cgroup/memory.max", "max\n");
  char where[1024];
  ck_assert_uint_eq(psd_memlimit_cgroup(r, where, sizeof where), 2147483648u);
  ck_assert_msg(strstr(where, "job_7/memory.max"), "%s", where);
  /* The tighter one wins, wherever it is. */
  put(r, "sys/fs/cgroup/job_7/step_0/memory.max", "1073741824\n");
  ck_assert_uint_eq(psd_memlimit_cgroup(r, where, sizeof where), 1073741824u);
  ck_assert_msg(strstr(where, "step_0/memory.max"), "%s", where);
}
END_TEST

START_TEST(test_v2_max_is_none) {
  const char *r = root("v2max");
  put(r, "proc/self/cgroup", "0::/\n");
  put(r, "sys/fs/cgroup/memory.max", "max\n");
  ck_assert_uint_eq(psd_memlimit_cgroup(r, NULL, 0), UINT64_MAX);
}
END_TEST

START_TEST(test_v1_limit) {
  const char *r = root("v1");
  put(r, "proc/self/cgroup",
      "9:name=systemd:/\n5:cpu,cpuacct:/slurm/uid_0/job_3\n4:memory:/slurm/uid_0/job_3\n0::/\n");
  put(r, "sys/fs/cgroup/memory/slurm/uid_0/job_3/memory.limit_in_bytes", "536870912\n");
  put(r, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  char where[1024];
  ck_assert_uint_eq(psd_memlimit_cgroup(r, where, sizeof where), 536870912u);
  ck_assert_msg(strstr(where, "job_3/memory.limit_in_bytes"), "%s", where);
}
END_TEST

START_TEST(test_v1_unlimited_and_garbage) {
  const char *r = root("v1none");
  put(r, "proc/self/cgroup", "4:memory:/x\n");
  put(r, "sys/fs/cgroup/memory/x/memory.limit_in_bytes", "9223372036854771712\n");
  put(r, "sys/fs/cgroup/memory/memory.limit_in_bytes", "12abc\n");
  ck_assert_uint_eq(psd_memlimit_cgroup(r, NULL, 0), UINT64_MAX);
}
END_TEST

START_TEST(test_no_files) {
  const char *r = root("empty");
  char where[64] = "x";
  ck_assert_uint_eq(psd_memlimit_cgroup(r, where, sizeof where), UINT64_MAX);
  ck_assert_str_eq(where, "");
  ck_assert(psd_memlimit_phys() > 0);
}
END_TEST

Suite *suite_memlimit(void) {
  Suite *s = suite_create("memlimit");
  TCase *tc = tcase_create("memlimit");
  tcase_add_test(tc, test_v2_limit_and_ancestors);
  tcase_add_test(tc, test_v2_max_is_none);
  tcase_add_test(tc, test_v1_limit);
  tcase_add_test(tc, test_v1_unlimited_and_garbage);
  tcase_add_test(tc, test_no_files);
  suite_add_tcase(s, tc);
  return s;
}
