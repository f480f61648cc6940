#include <check.h>
Suite *suite_cnn(void);
Suite *suite_cnn(void) { return suite_create("cnn"); }
