/* test_average.c - psd/average.c (moving averages of parameters, 2.7)
 * against a double-precision reference, by hand, and where the average
 * lives in a slice's state; their validation and descriptions
 * (optimizer.c). */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "average.h"
#include "optimizer.h"
#include "psclient.h"
#include "testutil.h"

#define N 37      /* odd: the vector loop's tail runs too */
#define STEPS 300
#define CANARY 12345.0f

static uint64_t next_u(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ULL;
}

/* Uniform in [-1, 1). */
static double rnd(uint64_t *s) { return (double)(next_u(s) >> 11) / 4503599627370496.0 - 1.0; }

static ps_optimizer with_average(int average, double decay) {
  ps_optimizer o;
  ps_optimizer_default(&o, 0.1);
  o.average = average;
  o.average_decay = decay;
  return o;
}

/* The reference, written from the definitions rather than the update
 * form: EMA a = d*a + (1-d)*w with d as TF computes it; Polyak the plain
 * mean of w_1..w_t. */
static void ref_step(int average, double decay, uint64_t t, double *a, const double *w,
                     double *sum, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (average == PS_AVERAGE_POLYAK) {
      sum[i] += w[i];
      a[i] = sum[i] / (double)t;
      continue;
    }
    double d = decay;
    if (average == PS_AVERAGE_EMA_NUM_UPDATES) {
      double warm = (1.0 + (double)t) / (10.0 + (double)t);
      if (warm < d) d = warm;
    }
    a[i] = d * a[i] + (1.0 - d) * w[i];
  }
}

/* Each form over STEPS updates of drifting parameters: the float average
 * stays within 1e-5 (relative to the parameters' scale) of the double
 * reference, and nothing past the slice is written. */
START_TEST(average_matches_reference) {
  static const int forms[] = {PS_AVERAGE_EMA, PS_AVERAGE_EMA_NUM_UPDATES, PS_AVERAGE_POLYAK};
  static const double decays[] = {0.99, 0.999, 0.0};
  const int average = forms[_i];
  ps_optimizer o = with_average(average, decays[_i]);
  o.kind = PS_OPT_ADAM; /* two rule floats first: the average is the third */
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 3);
  float state[3 * N + 4], w[N];
  double a[N], wd[N], sum[N] = {0};
  for (size_t i = 0; i < sizeof state / sizeof *state; i++) state[i] = CANARY;
  uint64_t seed = 0x9e3779b97f4a7c15ULL + (uint64_t)_i;
  for (size_t i = 0; i < N; i++) {
    w[i] = (float)rnd(&seed);
    a[i] = w[i];
  }
  psd_avg_start(&o, state, w, N);
  float *avg = psd_opt_average(&o, state, N);
  ck_assert_ptr_eq(avg, state + 2 * N);
  ck_assert(state[0] == CANARY && avg[0] == w[0] && avg[N - 1] == w[N - 1]);
  for (uint64_t t = 1; t <= STEPS; t++) {
    for (size_t i = 0; i < N; i++) {
      w[i] = (float)(w[i] + 0.05 * rnd(&seed) + 0.01); /* a drift the average lags */
      wd[i] = w[i];
    }
    psd_avg_update(&o, t, state, w, N);
    ref_step(average, decays[_i], t, a, wd, sum, N);
  }
  double worst = 0.0;
  for (size_t i = 0; i < N; i++) {
    double err = fabs(avg[i] - a[i]) / (1.0 + fabs(a[i]));
    if (err > worst) worst = err;
  }
  ck_assert_msg(worst < 1e-5, "form %d: worst relative error %g", average, worst);
  for (int k = 0; k < 4; k++) ck_assert(state[3 * N + k] == CANARY);
  /* The average lags a rising parameter: it is not just the parameter. */
  ck_assert(fabs(avg[0] - w[0]) > 1e-3);
}
END_TEST

/* Values worked by hand. */
START_TEST(average_hand_values) {
  float st[2], w = 3.0f;
  ps_optimizer o = with_average(PS_AVERAGE_EMA, 0.5);
  st[0] = 1.0f;
  psd_avg_update(&o, 1, st, &w, 1);
  ck_assert(st[0] == 2.0f); /* 0.5 * 1 + 0.5 * 3 */
  /* num_updates at t = 1: d = min(0.999, 2/11), the new weight 9/11. */
  o = with_average(PS_AVERAGE_EMA_NUM_UPDATES, 0.999);
  ck_assert(fabs(psd_avg_rate(&o, 1) - 9.0 / 11.0) < 1e-15);
  ck_assert(fabs(psd_avg_rate(&o, 100000) - 0.001) < 1e-12); /* decay caps it */
  /* Polyak: the first update gives the parameters exactly, then means. */
  o = with_average(PS_AVERAGE_POLYAK, 0.0);
  st[0] = 100.0f;
  psd_avg_update(&o, 1, st, &w, 1);
  ck_assert(st[0] == 3.0f);
  w = 5.0f;
  psd_avg_update(&o, 2, st, &w, 1);
  ck_assert(st[0] == 4.0f);
  /* No average: nothing to locate, nothing written. */
  o = with_average(PS_AVERAGE_NONE, 0.9);
  st[0] = 7.0f;
  psd_avg_start(&o, st, &w, 1);
  psd_avg_update(&o, 1, st, &w, 1);
  ck_assert(st[0] == 7.0f);
  ck_assert_ptr_null(psd_opt_average(&o, st, 1));
  ck_assert(psd_avg_rate(&o, 1) == 0.0);
}
END_TEST

/* The average is one more state float, last, for every kind; RMSProp
 * with momentum, centered and an average takes PSD_OPT_MAX_STATE. */
START_TEST(average_state_layout) {
  static const struct {
    ps_opt_kind kind;
    size_t rule;
  } kinds[] = {{PS_OPT_SGD, 0}, {PS_OPT_MOMENTUM, 1}, {PS_OPT_ADAM, 2},
               {PS_OPT_NONE, 0}, {PS_OPT_MEAN, 0}, {PS_OPT_ADAGRAD, 1}};
  float st[8];
  for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
    ps_optimizer o = with_average(PS_AVERAGE_POLYAK, 0.0);
    o.kind = kinds[k].kind;
    ck_assert_uint_eq(psd_opt_state_per_elem(&o), kinds[k].rule + 1);
    ck_assert_ptr_eq(psd_opt_average(&o, st, 2), st + 2 * kinds[k].rule);
  }
  ps_optimizer o = with_average(PS_AVERAGE_EMA, 0.9);
  o.kind = PS_OPT_RMSPROP;
  o.momentum = 0.5;
  o.centered = 1;
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), PSD_OPT_MAX_STATE);
  ck_assert_ptr_eq(psd_opt_average(&o, st, 2), st + 6);
}
END_TEST

/* Validation names the field, for every kind (none and mean too). */
START_TEST(average_validation) {
  char err[256];
  ps_optimizer o = with_average(7, 0.9);
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "optimizer average must be 0 (none), 1 (ema), 2 (ema_num_updates) "
                            "or 3 (polyak), got 7"), "%s", err);
  static const double bad[] = {1.0, -0.1, NAN};
  static const char *const got[] = {"got 1", "got -0.1", "got nan"};
  for (int i = 0; i < 3; i++) {
    o = with_average(i == 2 ? PS_AVERAGE_EMA_NUM_UPDATES : PS_AVERAGE_EMA, bad[i]);
    o.kind = i == 1 ? PS_OPT_NONE : PS_OPT_SGD;
    ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), PS_EINVAL);
    ck_assert_msg(strstr(err, "optimizer average_decay must be in [0, 1) with average ema") &&
                      strstr(err, got[i]), "%s", err);
  }
  o = with_average(PS_AVERAGE_POLYAK, 5.0); /* Polyak reads no decay */
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  o = with_average(PS_AVERAGE_EMA, 0.0);
  o.kind = PS_OPT_MEAN;
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  char buf[256];
  o = with_average(PS_AVERAGE_EMA_NUM_UPDATES, 0.9999);
  psd_opt_describe(&o, buf, sizeof buf);
  ck_assert_msg(strstr(buf, "sgd lr=0.1") && strstr(buf, " average=ema_num_updates decay=0.9999"),
                "%s", buf);
  o = with_average(PS_AVERAGE_POLYAK, 0.0);
  o.kind = PS_OPT_NONE;
  psd_opt_describe(&o, buf, sizeof buf);
  ck_assert_str_eq(buf, "none (not trainable) average=polyak");
}
END_TEST

Suite *suite_average(void) {
  Suite *s = suite_create("average");
  TCase *tc = tcase_create("average");
  tcase_add_loop_test(tc, average_matches_reference, 0, 3);
  tcase_add_test(tc, average_hand_values);
  tcase_add_test(tc, average_state_layout);
  tcase_add_test(tc, average_validation);
  suite_add_tcase(s, tc);
  return s;
}
