#include <check.h>
Suite *suite_cifar_data(void);
Suite *suite_cifar_data(void) { return suite_create("cifar_data"); }
