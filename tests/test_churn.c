#include <check.h>
Suite *suite_churn(void);
Suite *suite_churn(void) { return suite_create("churn"); }
