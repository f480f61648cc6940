/* Initializers: distributions, Glorot fans, determinism and validation;
 * plus ps_optimizer_default. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "psclient.h"
#include "testutil.h"

#define N_DRAWS 100000

static float *fill_1d(ps_init_kind kind, double a, double b, uint64_t seed,
                      const char *name, size_t n) {
  ps_init in = PS_SIZED(ps_init, kind, a, b, seed);
  int64_t shape[1] = {(int64_t)n};
  float *out = malloc(n * sizeof *out);
  ck_assert_ptr_nonnull(out);
  ck_assert_int_eq(ps_init_fill(&in, name, shape, 1, out, n), 0);
  return out;
}

static void moments(const float *x, size_t n, double *mean, double *sd) {
  double s = 0, s2 = 0;
  for (size_t i = 0; i < n; i++) s += x[i];
  *mean = s / (double)n;
  for (size_t i = 0; i < n; i++) s2 += (x[i] - *mean) * (x[i] - *mean);
  *sd = sqrt(s2 / (double)(n - 1));
}

START_TEST(test_zeros_constant) {
  float buf[12];
  for (size_t i = 0; i < 12; i++) buf[i] = 7.0f;
  ps_init z = PS_SIZED(ps_init, PS_INIT_ZEROS, 3.0, 4.0, 1);
  int64_t shape[2] = {3, 4};
  ck_assert_int_eq(ps_init_fill(&z, "w", shape, 2, buf, 12), 0);
  for (size_t i = 0; i < 12; i++) ck_assert(buf[i] == 0.0f);
  ps_init c = PS_SIZED(ps_init, PS_INIT_CONSTANT, -2.5, 0.0, 1);
  ck_assert_int_eq(ps_init_fill(&c, NULL, shape, 2, buf, 12), 0);
  for (size_t i = 0; i < 12; i++) ck_assert(buf[i] == -2.5f);
  /* A scalar: ndim 0 has one element. */
  float one = 0;
  ck_assert_int_eq(ps_init_fill(&c, "s", NULL, 0, &one, 1), 0);
  ck_assert(one == -2.5f);
}
END_TEST

START_TEST(test_uniform) {
  const double a = -0.5, b = 1.5;
  float *x = fill_1d(PS_INIT_UNIFORM, a, b, 42, "u", N_DRAWS);
  for (size_t i = 0; i < N_DRAWS; i++) {
    ck_assert(x[i] >= a);
    ck_assert(x[i] < b);
  }
  double mean, sd;
  moments(x, N_DRAWS, &mean, &sd);
  ck_assert_double_eq_tol(mean, (a + b) / 2, 0.02);
  ck_assert_double_eq_tol(sd, (b - a) / sqrt(12.0), 0.02);
  free(x);
  /* The upper bound stays excluded even where float rounding would hit it. */
  x = fill_1d(PS_INIT_UNIFORM, 1.0, 2.0, 3, "edge", N_DRAWS);
  for (size_t i = 0; i < N_DRAWS; i++) ck_assert(x[i] >= 1.0f && x[i] < 2.0f);
  free(x);
}
END_TEST

START_TEST(test_normal) {
  float *x = fill_1d(PS_INIT_NORMAL, 3.0, 2.0, 7, "n", N_DRAWS);
  double mean, sd;
  moments(x, N_DRAWS, &mean, &sd);
  ck_assert_double_eq_tol(mean, 3.0, 0.05);
  ck_assert_double_eq_tol(sd, 2.0, 0.05);
  /* Untruncated: some draws lie beyond 2 stddev (~4.6%). */
  size_t beyond = 0;
  for (size_t i = 0; i < N_DRAWS; i++) beyond += fabs(x[i] - 3.0) > 4.0;
  ck_assert_uint_gt(beyond, N_DRAWS / 40);
  ck_assert_uint_lt(beyond, N_DRAWS / 15);
  free(x);
}
END_TEST

START_TEST(test_truncated_normal) {
  const double m = -1.0, s = 0.5;
  float *x = fill_1d(PS_INIT_TRUNCATED_NORMAL, m, s, 9, "t", N_DRAWS);
  for (size_t i = 0; i < N_DRAWS; i++)
    ck_assert_msg(fabs(x[i] - m) <= 2 * s + 1e-6, "draw %zu = %g", i, x[i]);
  double mean, sd;
  moments(x, N_DRAWS, &mean, &sd);
  ck_assert_double_eq_tol(mean, m, 0.02);
  /* N(0,1) truncated at +-2 has stddev ~0.8796. */
  ck_assert_double_eq_tol(sd, s * 0.8796, 0.02);
  free(x);
}
END_TEST

/* Max |x| and the count, for a Glorot fill of shape. */
static void glorot_check(ps_init_kind kind, const int64_t *shape, int ndim,
                         double fan_in, double fan_out) {
  size_t n = 1;
  for (int i = 0; i < ndim; i++) n *= (size_t)shape[i];
  float *x = malloc(n * sizeof *x);
  ck_assert_ptr_nonnull(x);
  ps_init in = PS_SIZED(ps_init, kind, 0, 0, 5);
  ck_assert_int_eq(ps_init_fill(&in, "g", shape, ndim, x, n), 0);
  double maxabs = 0, mean, sd;
  for (size_t i = 0; i < n; i++)
    if (fabs(x[i]) > maxabs) maxabs = fabs(x[i]);
  moments(x, n, &mean, &sd);
  if (kind == PS_INIT_GLOROT_UNIFORM) {
    double limit = sqrt(6.0 / (fan_in + fan_out));
    ck_assert(maxabs <= limit);
    ck_assert(maxabs > 0.99 * limit); /* the range is really used */
    ck_assert_double_eq_tol(sd, limit / sqrt(3.0), 0.03 * limit);
  } else {
    double stddev = sqrt(2.0 / (fan_in + fan_out));
    ck_assert(maxabs <= 2 * stddev * (1 + 1e-6));
    ck_assert_double_eq_tol(sd, stddev * 0.8796, 0.03 * stddev);
  }
  ck_assert_double_eq_tol(mean, 0.0, 0.05 * maxabs);
  free(x);
}

START_TEST(test_glorot) {
  /* conv [5,5,3,64]: receptive 25, fan_in 75, fan_out 1600. */
  const int64_t conv[4] = {5, 5, 3, 64};
  glorot_check(PS_INIT_GLOROT_UNIFORM, conv, 4, 75, 1600);
  glorot_check(PS_INIT_GLOROT_NORMAL, conv, 4, 75, 1600);
  /* matrix [384,192]: fan_in 384, fan_out 192. */
  const int64_t mat[2] = {384, 192};
  glorot_check(PS_INIT_GLOROT_UNIFORM, mat, 2, 384, 192);
  glorot_check(PS_INIT_GLOROT_NORMAL, mat, 2, 384, 192);
  /* vector [1000]: fan_in = fan_out = 1000. */
  const int64_t vec[1] = {1000};
  glorot_check(PS_INIT_GLOROT_UNIFORM, vec, 1, 1000, 1000);
  /* Exact limit for the conv shape: sqrt(6/1675) ~ 0.0598. */
  ck_assert_double_eq_tol(sqrt(6.0 / 1675.0), 0.059851, 1e-5);
}
END_TEST

START_TEST(test_deterministic) {
  const size_t n = 1000;
  float *a = fill_1d(PS_INIT_NORMAL, 0, 1, 123, "layer1/w", n);
  float *b = fill_1d(PS_INIT_NORMAL, 0, 1, 123, "layer1/w", n);
  float *c = fill_1d(PS_INIT_NORMAL, 0, 1, 123, "layer1/b", n);
  float *d = fill_1d(PS_INIT_NORMAL, 0, 1, 124, "layer1/w", n);
  float *e = fill_1d(PS_INIT_NORMAL, 0, 1, 123, NULL, n);
  float *f = fill_1d(PS_INIT_NORMAL, 0, 1, 123, "", n);
  ck_assert_mem_eq(a, b, n * sizeof *a);
  ck_assert(memcmp(a, c, n * sizeof *a) != 0);
  ck_assert(memcmp(a, d, n * sizeof *a) != 0);
  ck_assert(memcmp(a, e, n * sizeof *a) != 0);
  ck_assert_mem_eq(e, f, n * sizeof *e); /* NULL name is the empty name */
  free(a), free(b), free(c), free(d), free(e), free(f);
  /* Uniform too, and a prefix of a longer fill is the shorter fill. */
  float *u1 = fill_1d(PS_INIT_UNIFORM, 0, 1, 9, "x", 10);
  float *u2 = fill_1d(PS_INIT_UNIFORM, 0, 1, 9, "x", 20);
  ck_assert_mem_eq(u1, u2, 10 * sizeof *u1);
  free(u1), free(u2);
}
END_TEST

START_TEST(test_bad_args) {
  float buf[16];
  int64_t shape[2] = {4, 4};
  ps_init ok = PS_SIZED(ps_init, PS_INIT_UNIFORM, 0, 1, 1);
  ck_assert_int_eq(ps_init_fill(&ok, "w", shape, 2, buf, 16), 0);
  /* n does not match the shape. */
  ck_assert_int_eq(ps_init_fill(&ok, "w", shape, 2, buf, 15), PS_EINVAL);
  ck_assert_int_eq(ps_init_fill(&ok, "w", shape, 1, buf, 16), PS_EINVAL);
  /* NULL init / out / shape. */
  ck_assert_int_eq(ps_init_fill(NULL, "w", shape, 2, buf, 16), PS_EINVAL);
  ck_assert_int_eq(ps_init_fill(&ok, "w", shape, 2, NULL, 16), PS_EINVAL);
  ck_assert_int_eq(ps_init_fill(&ok, "w", NULL, 2, buf, 16), PS_EINVAL);
  /* uniform needs a < b. */
  ps_init u = PS_SIZED(ps_init, PS_INIT_UNIFORM, 1, 1, 1);
  ck_assert_int_eq(ps_init_fill(&u, "w", shape, 2, buf, 16), PS_EINVAL);
  u.a = 2;
  ck_assert_int_eq(ps_init_fill(&u, "w", shape, 2, buf, 16), PS_EINVAL);
  u.a = NAN;
  ck_assert_int_eq(ps_init_fill(&u, "w", shape, 2, buf, 16), PS_EINVAL);
  u.a = 0, u.b = INFINITY;
  ck_assert_int_eq(ps_init_fill(&u, "w", shape, 2, buf, 16), PS_EINVAL);
  /* normal and truncated normal need b > 0. */
  ps_init nrm = PS_SIZED(ps_init, PS_INIT_NORMAL, 0, 0, 1);
  ck_assert_int_eq(ps_init_fill(&nrm, "w", shape, 2, buf, 16), PS_EINVAL);
  nrm.b = -1;
  ck_assert_int_eq(ps_init_fill(&nrm, "w", shape, 2, buf, 16), PS_EINVAL);
  nrm.kind = PS_INIT_TRUNCATED_NORMAL;
  ck_assert_int_eq(ps_init_fill(&nrm, "w", shape, 2, buf, 16), PS_EINVAL);
  nrm.b = 0;
  ck_assert_int_eq(ps_init_fill(&nrm, "w", shape, 2, buf, 16), PS_EINVAL);
  nrm.b = NAN;
  ck_assert_int_eq(ps_init_fill(&nrm, "w", shape, 2, buf, 16), PS_EINVAL);
  /* Constant must be finite. */
  ps_init c = PS_SIZED(ps_init, PS_INIT_CONSTANT, INFINITY, 0, 1);
  ck_assert_int_eq(ps_init_fill(&c, "w", shape, 2, buf, 16), PS_EINVAL);
  /* Unknown kind. */
  ps_init k = PS_SIZED(ps_init, (ps_init_kind)99, 0, 1, 1);
  ck_assert_int_eq(ps_init_fill(&k, "w", shape, 2, buf, 16), PS_EINVAL);
  k.kind = (ps_init_kind)-1;
  ck_assert_int_eq(ps_init_fill(&k, "w", shape, 2, buf, 16), PS_EINVAL);
  /* ndim 9 (> PS_MAX_DIMS) and negative; 8 ones is fine. */
  int64_t ones[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  ck_assert_int_eq(ps_init_fill(&ok, "w", ones, 9, buf, 1), PS_EINVAL);
  ck_assert_int_eq(ps_init_fill(&ok, "w", ones, -1, buf, 1), PS_EINVAL);
  ck_assert_int_eq(ps_init_fill(&ok, "w", ones, PS_MAX_DIMS, buf, 1), 0);
  /* Dims must be positive; products must not overflow. */
  int64_t zero[2] = {4, 0};
  ck_assert_int_eq(ps_init_fill(&ok, "w", zero, 2, buf, 0), PS_EINVAL);
  int64_t neg[2] = {-4, -4};
  ck_assert_int_eq(ps_init_fill(&ok, "w", neg, 2, buf, 16), PS_EINVAL);
  int64_t huge[3] = {INT64_MAX, INT64_MAX, 4};
  ck_assert_int_eq(ps_init_fill(&ok, "w", huge, 3, buf, 16), PS_EINVAL);
}
END_TEST

START_TEST(test_optimizer_default) {
  ps_optimizer o;
  memset(&o, 0xAB, sizeof o);
  ps_optimizer_default(&o, 0.05);
  ck_assert_int_eq(o.kind, PS_OPT_SGD);
  ck_assert(o.lr == 0.05);
  ck_assert(o.momentum == 0.9);
  ck_assert_int_eq(o.nesterov, 0);
  ck_assert(o.beta1 == 0.9);
  ck_assert(o.beta2 == 0.999);
  ck_assert(o.epsilon == 1e-8);
  ck_assert_int_eq(o.decay, PS_DECAY_NONE);
  ck_assert(o.decay_rate == 1.0);
  ck_assert_uint_eq(o.decay_steps, 0);
  ck_assert(o.weight_decay == 0.0);
  ps_optimizer_default(NULL, 0.1); /* no-op */
}
END_TEST

/* The sized structs: a struct never initialized (struct_size 0) is refused
 * with a sentence naming the init function; a newer caller's bigger struct
 * is read when its extra fields are untouched and refused when set; the
 * init functions fill the size and the documented defaults. */
START_TEST(test_sized_structs) {
  float v[4];
  int64_t shape[1] = {4};
  ps_init zeroed;
  memset(&zeroed, 0, sizeof zeroed);
  zeroed.kind = PS_INIT_CONSTANT;
  zeroed.a = 1;
  ck_assert_int_eq(ps_init_fill(&zeroed, "w", shape, 1, v, 4), PS_EINVAL);
  ps_init in;
  ps_init_init(&in);
  ck_assert_uint_eq(in.struct_size, sizeof in);
  ck_assert_int_eq(in.kind, PS_INIT_ZEROS);
  ck_assert_int_eq(ps_init_fill(&in, "w", shape, 1, v, 4), 0);
  /* A newer header's struct: our fields, then one we do not know. */
  struct {
    ps_init known;
    double later;
  } newer;
  memset(&newer, 0, sizeof newer);
  newer.known = (ps_init)PS_SIZED(ps_init, .kind = PS_INIT_CONSTANT, .a = 2);
  newer.known.struct_size = sizeof newer;
  ck_assert_int_eq(ps_init_fill(&newer.known, "w", shape, 1, v, 4), 0);
  ck_assert(v[3] == 2.0f);
  newer.later = 1;
  ck_assert_int_eq(ps_init_fill(&newer.known, "w", shape, 1, v, 4), PS_EINVAL);

  ps_config cfg;
  memset(&cfg, 0, sizeof cfg);
  const char *hosts[1] = {"127.0.0.1:1"};
  cfg.hosts = hosts;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  ps_client *c = NULL;
  char err[256];
  ck_assert_int_eq(ps_client_create(&cfg, &c, err, sizeof err), PS_EINVAL);
  ck_assert_ptr_null(c);
  ck_assert_msg(strstr(err, "ps_config_init") != NULL, "%s", err);
  ps_config_init(&cfg);
  ck_assert_uint_eq(cfg.struct_size, sizeof cfg);
  ck_assert_ptr_null(cfg.hosts);

  ps_optimizer o;
  ps_optimizer_init(&o);
  ck_assert_uint_eq(o.struct_size, sizeof o);
  ck_assert(o.kind == PS_OPT_SGD && o.lr == 0.01);
}
END_TEST

Suite *suite_init(void) {
  Suite *s = suite_create("init");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, test_zeros_constant);
  tcase_add_test(tc, test_sized_structs);
  tcase_add_test(tc, test_uniform);
  tcase_add_test(tc, test_normal);
  tcase_add_test(tc, test_truncated_normal);
  tcase_add_test(tc, test_glorot);
  tcase_add_test(tc, test_deterministic);
  tcase_add_test(tc, test_bad_args);
  tcase_add_test(tc, test_optimizer_default);
  suite_add_tcase(s, tc);
  return s;
}
