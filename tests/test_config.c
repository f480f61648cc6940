#include "testutil.h"
Suite *suite_config(void) { return suite_create("config"); }
