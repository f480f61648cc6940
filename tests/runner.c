/* ps_tests: the one Check runner. `ps_tests SUITE...` runs the named suites
 * (all when none is named). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

typedef struct {
  const char *name;       /* suite name, as on the command line */
  Suite *(*make)(void);   /* constructor in test_<name>.c */
} suite_entry;

static const suite_entry SUITES[] = {
    {"frame", suite_frame},         {"placement", suite_placement},
    {"init", suite_init},           {"optimizer", suite_optimizer},
    {"config", suite_config},       {"sync", suite_sync},
    {"lifecycle", suite_lifecycle}, {"hostile", suite_hostile},
    {"layout", suite_layout},       {"psrun", suite_psrun},
    {"cnn", suite_cnn},             {"cifar_data", suite_cifar_data},
    {"cifar", suite_cifar},         {"churn", suite_churn},
    {"auth", suite_auth},           {"checkpoint", suite_checkpoint},
    {"persist", suite_persist},     {"soak", suite_soak},
    {"telemetry", suite_telemetry}, {"cuda_ops", suite_cuda_ops},
    {"prefetch", suite_prefetch},    {"pace", suite_pace},
    {"waiters", suite_waiters},
};

int main(int argc, char **argv) {
  SRunner *sr = NULL;
  size_t nsuites = sizeof SUITES / sizeof SUITES[0];
  for (size_t i = 0; i < nsuites; i++) {
    int wanted = argc < 2;
    for (int a = 1; a < argc; a++)
      if (strcmp(argv[a], SUITES[i].name) == 0) wanted = 1;
    if (!wanted) continue;
    Suite *s = SUITES[i].make();
    if (!sr) sr = srunner_create(s);
    else srunner_add_suite(sr, s);
  }
  if (!sr) {
    fprintf(stderr, "ps_tests: no suite named %s\n", argc > 1 ? argv[1] : "");
    return 2;
  }
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
