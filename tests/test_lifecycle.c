#include "testutil.h"
Suite *suite_lifecycle(void) { return suite_create("lifecycle"); }
