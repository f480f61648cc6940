#include "testutil.h"
Suite *suite_hostile(void) { return suite_create("hostile"); }
