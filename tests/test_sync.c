#include "testutil.h"
Suite *suite_sync(void) { return suite_create("sync"); }
