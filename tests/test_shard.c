/* psd's shard rules for protocol 2.1, on the shard itself: the chief's
 * assign at a step boundary (sync, trainable), at once (not trainable,
 * async), the steps it refuses, and gradients refused for a variable that
 * is not trained; and (2.7) when the moving average takes a step in. */
#include <check.h>
#include <string.h>

#include "shard.h"
#include "testutil.h"

/* One slice of 4 floats, initialized to 1, in a shard of 2 workers; with
 * a Polyak mean when `average` (2.7). */
static psd_slice *avg_slice(psd_shard *s, int async_mode, ps_opt_kind kind, int average) {
  psd_shard_init(s, 2, 2, async_mode);
  ps_optimizer o;
  ps_optimizer_default(&o, 0.5);
  o.kind = kind;
  o.average = average ? PS_AVERAGE_POLYAK : PS_AVERAGE_NONE;
  const uint64_t shape[1] = {4};
  psd_slice *sl = NULL;
  char err[256];
  ck_assert_int_eq(psd_shard_register(s, "v", 1, shape, 0, 4, &o, 0, &sl, err, sizeof err), 0);
  const float ones[4] = {1, 1, 1, 1};
  psd_shard_init_values(s, sl, ones);
  return sl;
}

static psd_slice *one_slice(psd_shard *s, int async_mode, ps_opt_kind kind) {
  return avg_slice(s, async_mode, kind, 0);
}

/* The moving average (a Polyak mean, element 0: the last state slot)
 * starts at the initial values and takes in the parameters each time the
 * step advances: a sync step's update, a chief's assign that replaces
 * one, an async push, a not-trained variable's assign; never a gradient
 * that only accumulates. */
START_TEST(average_follows_every_step) {
  psd_shard s;
  const float g[4] = {1, 1, 1, 1}, vals[4] = {7, 8, 9, 10};
  char err[256];
  psd_slice *sl = avg_slice(&s, 0, PS_OPT_MOMENTUM, 1);
  float *avg = sl->state + 4; /* after momentum's buffer */
  ck_assert_float_eq(avg[0], 1.0f);
  ck_assert_int_eq(psd_shard_push(&s, sl, 0, 0, g, 0), 0);
  ck_assert_float_eq(avg[0], 1.0f); /* accumulated only */
  ck_assert_int_eq(psd_shard_push(&s, sl, 1, 0, g, 0), 1);
  ck_assert_float_eq(sl->param[0], 0.5f);
  ck_assert_float_eq(avg[0], 0.5f); /* mean of w_1 */
  ck_assert_int_eq(psd_shard_assign(&s, sl, 1, vals, err, sizeof err), 0);
  ck_assert_int_eq(psd_shard_push(&s, sl, 0, 1, g, 0), 0);
  ck_assert_int_eq(psd_shard_push(&s, sl, 1, 1, g, 0), 1);
  ck_assert_float_eq(avg[0], (0.5f + 7.0f) / 2); /* the assigned values are w_2 */
  psd_shard_free(&s);

  sl = avg_slice(&s, 1, PS_OPT_SGD, 1);
  ck_assert_int_eq(psd_shard_push(&s, sl, 0, 0, g, 0), 1);
  ck_assert_int_eq(psd_shard_push(&s, sl, 1, 0, g, 0), 1);
  ck_assert_float_eq(sl->param[0], 0.0f);
  ck_assert_float_eq(sl->state[0], 0.25f); /* (0.5 + 0) / 2 */
  ck_assert_int_eq(psd_shard_assign(&s, sl, 2, vals, err, sizeof err), 0);
  ck_assert_float_eq(sl->state[0], 0.25f); /* async: no step, no average */
  psd_shard_free(&s);

  sl = avg_slice(&s, 0, PS_OPT_NONE, 1);
  ck_assert_int_eq(psd_shard_assign(&s, sl, 0, vals, err, sizeof err), 1);
  ck_assert_float_eq(sl->state[0], 7.0f); /* t = 1: the values */
  psd_shard_free(&s);
}
END_TEST

/* A variable's own aggregation rule (2.8) in a job of 3 workers with one
 * backup (replicas 2): the job's rule completes a step with the first two
 * gradients, ALL waits for the third, FIRST completes it with the first
 * alone and finds the others' pushes for that step stale. */
START_TEST(aggregate_rules) {
  const int rules[3] = {PS_AGGREGATE_JOB, PS_AGGREGATE_ALL, PS_AGGREGATE_FIRST};
  const uint32_t want[3] = {2, 3, 1};
  const float g[4] = {3, 3, 3, 3};
  for (int r = 0; r < 3; r++) {
    psd_shard s;
    psd_shard_init(&s, 3, 2, 0);
    ps_optimizer o;
    ps_optimizer_default(&o, 1.0);
    o.kind = PS_OPT_MEAN;
    o.aggregate = rules[r];
    const uint64_t shape[1] = {4};
    psd_slice *sl = NULL;
    char err[256];
    ck_assert_int_eq(psd_shard_register(&s, "m", 1, shape, 0, 4, &o, 0, &sl, err, sizeof err), 0);
    const float zeros[4] = {0};
    psd_shard_init_values(&s, sl, zeros);
    ck_assert_uint_eq(psd_shard_slice_replicas(&s, sl), want[r]);
    for (uint32_t w = 0; w < 3; w++) {
      int rc = psd_shard_push(&s, sl, 2 - w, 0, g, 0);
      int expect = w + 1 < want[r] ? 0 : w + 1 == want[r] ? 1 : PS_ESTALE;
      ck_assert_msg(rc == expect, "rule %d, push %u: %d, want %d", rules[r], w, rc, expect);
    }
    ck_assert_uint_eq(sl->step, 1);
    ck_assert_float_eq(sl->param[0], 3.0f); /* the mean of equal gradients */
    /* A second worker that asks for another rule is refused by name. */
    ps_optimizer other = o;
    other.aggregate = rules[(r + 1) % 3];
    psd_slice *sl2 = NULL;
    ck_assert_int_eq(psd_shard_register(&s, "m", 1, shape, 0, 4, &other, 1, &sl2, err, sizeof err),
                     PS_EMISMATCH);
    ck_assert_msg(strstr(err, "aggregate"), "%s", err);
    psd_shard_free(&s);
  }
}
END_TEST

START_TEST(assign_sync_trainable) {
  psd_shard s;
  psd_slice *sl = one_slice(&s, 0, PS_OPT_SGD);
  const float g[4] = {1, 1, 1, 1}, vals[4] = {7, 8, 9, 10};
  char err[256];
  /* Worker 1's gradient of step 0 is in; the chief assigns at step 0. */
  ck_assert_int_eq(psd_shard_push(&s, sl, 1, 0, g, 0), 0);
  ck_assert_int_eq(psd_shard_assign(&s, sl, 0, vals, err, sizeof err), 0);
  ck_assert_float_eq(sl->param[0], 1.0f); /* not before the step completes */
  ck_assert_int_eq(psd_shard_push(&s, sl, 0, 0, g, 0), 1);
  ck_assert_uint_eq(sl->step, 1);
  ck_assert_mem_eq(sl->param, vals, sizeof vals); /* the step's update replaced */
  /* The next step trains normally from the assigned values. */
  ck_assert_int_eq(psd_shard_push(&s, sl, 0, 1, g, 0), 0);
  ck_assert_int_eq(psd_shard_push(&s, sl, 1, 1, g, 0), 1);
  ck_assert_float_eq(sl->param[0], 7.0f - 0.5f);
  /* A step behind or ahead is refused, naming both steps. */
  ck_assert_int_eq(psd_shard_assign(&s, sl, 1, vals, err, sizeof err), PS_ESTALE);
  ck_assert_msg(strstr(err, "at step 2 already"), "%s", err);
  ck_assert_int_eq(psd_shard_assign(&s, sl, 3, vals, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "only at step 2"), "%s", err);
  ck_assert_float_eq(sl->param[0], 6.5f);
  psd_shard_free(&s);
}
END_TEST

START_TEST(assign_not_trainable_and_async) {
  psd_shard s;
  psd_slice *sl = one_slice(&s, 0, PS_OPT_NONE);
  const float g[4] = {1, 1, 1, 1}, vals[4] = {7, 8, 9, 10};
  char err[256];
  ck_assert_int_eq(psd_shard_push(&s, sl, 0, 0, g, 0), PS_EUNSUPPORTED);
  ck_assert_int_eq(psd_shard_assign(&s, sl, 4, vals, err, sizeof err), 1); /* step moved */
  ck_assert_uint_eq(sl->step, 5);
  ck_assert_mem_eq(sl->param, vals, sizeof vals);
  ck_assert_int_eq(psd_shard_assign(&s, sl, 4, g, err, sizeof err), 0); /* again at 4 */
  ck_assert_float_eq(sl->param[0], 1.0f);
  ck_assert_int_eq(psd_shard_assign(&s, sl, 2, vals, err, sizeof err), PS_ESTALE);
  psd_shard_free(&s);

  sl = one_slice(&s, 1, PS_OPT_SGD); /* async: at once, step unchanged */
  ck_assert_int_eq(psd_shard_assign(&s, sl, 99, vals, err, sizeof err), 0);
  ck_assert_uint_eq(sl->step, 0);
  ck_assert_mem_eq(sl->param, vals, sizeof vals);
  psd_shard_free(&s);

  /* An uninitialized slice cannot be assigned. */
  psd_shard_init(&s, 2, 2, 0);
  ps_optimizer o;
  ps_optimizer_default(&o, 0.5);
  const uint64_t shape[1] = {4};
  ck_assert_int_eq(psd_shard_register(&s, "u", 1, shape, 0, 4, &o, 1, &sl, err, sizeof err), 0);
  ck_assert_int_eq(psd_shard_assign(&s, sl, 0, vals, err, sizeof err), PS_ESTATE);
  psd_shard_free(&s);
}
END_TEST

Suite *suite_shard(void) {
  Suite *s = suite_create("shard");
  TCase *tc = tcase_create("assign");
  tcase_add_test(tc, assign_sync_trainable);
  tcase_add_test(tc, assign_not_trainable_and_async);
  tcase_add_test(tc, average_follows_every_step);
  tcase_add_test(tc, aggregate_rules);
  suite_add_tcase(s, tc);
  return s;
}
