#include "testutil.h"
Suite *suite_frame(void) { return suite_create("frame"); }
