/* The Check runner of one test executable (wire_tests, psd_tests, ...):
 * `NAME_tests SUITE...` runs the named suites (all when none is named). The
 * suites an executable holds come from its generated list PS_SUITES_INC
 * (tests/CMakeLists.txt), one PS_SUITE(name) line each. Exit status: 0 all
 * passed, 1 a test failed, 2 usage, 77 skipped: every requested suite was
 * (its constructor returned NULL: a dependency is not installed), or the
 * rest passed but a suite left tests out (tu_skip_tests): a run that did
 * not run everything is never reported as a pass. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* ctest's SKIP_RETURN_CODE for these executables. */
#define TU_EXIT_SKIPPED 77

typedef struct {
  const char *name;       /* suite name, as on the command line */
  Suite *(*make)(void);   /* constructor in test_<name>.c */
} suite_entry;

static const suite_entry SUITES[] = {
#define PS_SUITE(n) {#n, suite_##n},
#include PS_SUITES_INC
#undef PS_SUITE
};

int main(int argc, char **argv) {
  SRunner *sr = NULL;
  size_t nsuites = sizeof SUITES / sizeof SUITES[0];
  int known = 0, skipped = 0;
  for (int a = 1; a < argc; a++) {
    int found = 0;
    for (size_t i = 0; i < nsuites; i++) found |= strcmp(argv[a], SUITES[i].name) == 0;
    if (!found) {
      fprintf(stderr, "%s: no suite named %s (this executable has:", argv[0], argv[a]);
      for (size_t i = 0; i < nsuites; i++) fprintf(stderr, " %s", SUITES[i].name);
      fprintf(stderr, ")\n");
      return 2;
    }
  }
  for (size_t i = 0; i < nsuites; i++) {
    int wanted = argc < 2;
    for (int a = 1; a < argc; a++)
      if (strcmp(argv[a], SUITES[i].name) == 0) wanted = 1;
    if (!wanted) continue;
    known++;
    Suite *s = SUITES[i].make();
    if (!s) {
      skipped++;
      continue;
    }
    if (!sr) sr = srunner_create(s);
    else srunner_add_suite(sr, s);
  }
  if (!sr) return known && skipped == known ? TU_EXIT_SKIPPED : 2;
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  if (failed) return EXIT_FAILURE;
  if (skipped || tu_skipped()) {
    printf("SKIP: the rest passed, but %d suite(s) and %d group(s) of tests were left out "
           "(the SKIP lines above say why)\n", skipped, tu_skipped());
    return TU_EXIT_SKIPPED;
  }
  return EXIT_SUCCESS;
}
