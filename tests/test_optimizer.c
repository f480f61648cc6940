/* test_optimizer.c - psd/optimizer.c against a plain double-precision
 * reference, hand-computed values, schedules, validation and descriptions. */
#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optimizer.h"
#include "psclient.h"
#include "testutil.h"

#define PAD 8                /* canary floats after every array */
#define CANARY 12345.0f
#define RTOL 1e-5            /* relative tolerance against the reference */

/* ---------------------------------------------------------------------- */
/* Helpers */

/* xorshift64*: deterministic inputs, uniform in [0, 1). */
static double rnd(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return (double)((*s * 2685821657736338717ULL) >> 11) / 9007199254740992.0;
}

static ps_optimizer opt_base(ps_opt_kind kind, double lr) {
  ps_optimizer o;
  memset(&o, 0, sizeof o);
  o.kind = kind;
  o.lr = lr;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.epsilon = 1e-8;
  o.decay = PS_DECAY_NONE;
  return o;
}

static int close_to(double got, double want) {
  return fabs(got - want) <= RTOL * fabs(want) + 1e-12;
}

/* Reference schedule, written independently of psd_opt_lr. */
static double ref_lr(const ps_optimizer *o, uint64_t step) {
  switch (o->decay) {
    case PS_DECAY_EXPONENTIAL:
      return o->lr * pow(o->decay_rate, (double)step / (double)o->decay_steps);
    case PS_DECAY_STEP: {
      double k = floor((double)step / (double)o->decay_steps);
      return o->lr * pow(o->decay_rate, k);
    }
    default:
      return o->lr;
  }
}

/* Reference RMSProp (torch.optim.RMSprop's formulas) of one element: s
 * holds its state slots in psd's order (square average, momentum buffer
 * if momentum > 0, gradient average if centered). */
static void ref_rmsprop(const ps_optimizer *o, double lr, double *w, double g, double *s) {
  int mom = o->momentum > 0.0;
  s[0] = o->alpha * s[0] + (1.0 - o->alpha) * g * g;
  double var = s[0];
  if (o->centered) {
    double *ga = &s[1 + mom];
    *ga = o->alpha * *ga + (1.0 - o->alpha) * g;
    var -= *ga * *ga;
  }
  double d = sqrt(var) + o->epsilon;
  if (mom) {
    s[1] = o->momentum * s[1] + g / d;
    *w -= lr * s[1];
  } else {
    *w -= lr * g / d;
  }
}

/* Reference update: one element at a time, everything in double. st[k]
 * is state slot k (n long): the momentum accumulator, Adam's m then v,
 * Adagrad's accumulator, RMSProp's slots. */
static void ref_apply(const ps_optimizer *o, uint64_t step, double *w, double *const *st,
                      const float *a, const float *b, double scale, size_t n) {
  double lr = ref_lr(o, step) * (o->lr_scale > 0.0 ? o->lr_scale : 1.0);
  double l2 = o->decoupled_weight_decay ? 0.0 : o->weight_decay;
  double t = (double)step + 1.0;
  double c1 = 1.0 - pow(o->beta1, t), c2 = 1.0 - pow(o->beta2, t);
  for (size_t i = 0; i < n; i++) {
    double sum = (double)a[i] + (b ? (double)b[i] : 0.0);
    double g = scale * sum + l2 * w[i];
    if (o->decoupled_weight_decay) w[i] *= 1.0 - lr * o->weight_decay;
    double *s0 = &st[0][i], *s1 = &st[1][i];
    if (o->kind == PS_OPT_SGD) {
      w[i] -= lr * g;
    } else if (o->kind == PS_OPT_MOMENTUM) {
      *s0 = o->momentum * *s0 + g;
      if (o->nesterov) w[i] -= lr * (g + o->momentum * *s0);
      else w[i] -= lr * *s0;
    } else if (o->kind == PS_OPT_ADAM) {
      *s0 = o->beta1 * *s0 + (1.0 - o->beta1) * g;
      *s1 = o->beta2 * *s1 + (1.0 - o->beta2) * g * g;
      if (o->torch_epsilon) /* torch.optim.Adam */
        w[i] -= lr / c1 * *s0 / (sqrt(*s1) / sqrt(c2) + o->epsilon);
      else /* TF's epsilon-hat */
        w[i] -= lr * sqrt(c2) / c1 * *s0 / (sqrt(*s1) + o->epsilon);
    } else if (o->kind == PS_OPT_ADAGRAD) {
      *s0 += g * g;
      w[i] -= lr * g / (sqrt(*s0) + o->epsilon);
    } else {
      double s[3] = {*s0, *s1, st[2][i]};
      ref_rmsprop(o, lr, &w[i], g, s);
      *s0 = s[0], *s1 = s[1], st[2][i] = s[2];
    }
  }
}

/* First index where got[] and want[] differ beyond tolerance, or n. */
static size_t first_mismatch(const float *got, const double *want, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!close_to(got[i], want[i])) return i;
  return n;
}

/* Runs nsteps updates from start_step through psd_opt_apply and the
 * reference side by side, comparing parameters and state after each, and
 * checking nothing past n is written. Gradient signs are fixed per element
 * (magnitudes change every step) and weight decay stays below the smallest
 * gradient, so no sum cancels and a relative tolerance is meaningful. */
static void run_case(const ps_optimizer *o, uint64_t start_step, int nsteps,
                     int with_b, float scale, size_t n, uint64_t seed) {
  size_t spe = psd_opt_state_per_elem(o);
  ck_assert_uint_le(spe, PSD_OPT_MAX_STATE);
  float *w = malloc((n + PAD) * sizeof *w);
  float *st = calloc(spe * n + PAD, sizeof *st);
  float *a = malloc((n + PAD) * sizeof *a);
  float *b = malloc((n + PAD) * sizeof *b);
  double *rw = malloc(n * sizeof *rw);
  double *r[3];
  for (int k = 0; k < 3; k++) r[k] = calloc(n, sizeof *r[k]);
  float *sign = malloc(n * sizeof *sign);
  ck_assert(w && st && a && b && rw && r[0] && r[1] && r[2] && sign);
  psd_opt_state_init(o, st, n);
  for (size_t i = 0; i < n && o->kind == PS_OPT_ADAGRAD; i++) r[0][i] = o->initial_accumulator;

  char desc[256];
  psd_opt_describe(o, desc, sizeof desc);
  uint64_t s = seed | 1;
  for (size_t i = 0; i < n; i++) {
    double ws = rnd(&s) < 0.5 ? -1.0 : 1.0;
    w[i] = (float)(ws * (1.0 + rnd(&s)));
    rw[i] = w[i];
    sign[i] = rnd(&s) < 0.5 ? -1.0f : 1.0f;
  }
  for (size_t i = 0; i < PAD; i++) {
    w[n + i] = CANARY;
    st[spe * n + i] = CANARY;
  }

  for (int k = 0; k < nsteps; k++) {
    uint64_t step = start_step + (uint64_t)k;
    for (size_t i = 0; i < n; i++) {
      a[i] = sign[i] * (float)(0.5 + rnd(&s));
      b[i] = sign[i] * (float)(0.5 + rnd(&s));
    }
    const float *gb = with_b ? b : NULL;
    psd_opt_apply(o, step, w, spe ? st : NULL, a, gb, scale, n);
    ref_apply(o, step, rw, r, a, gb, (double)scale, n);

    size_t bad = first_mismatch(w, rw, n);
    ck_assert_msg(bad == n,
                  "[%s] grad_b=%d scale=%g n=%zu step=%" PRIu64
                  ": param[%zu] = %.9g, reference %.9g",
                  desc, with_b, (double)scale, n, step, bad,
                  bad < n ? (double)w[bad] : 0.0, bad < n ? rw[bad] : 0.0);
    for (size_t j = 0; j < spe; j++) {
      bad = first_mismatch(st + j * n, r[j], n);
      ck_assert_msg(bad == n,
                    "[%s] grad_b=%d scale=%g n=%zu step=%" PRIu64
                    ": state slot %zu [%zu] = %.9g, reference %.9g",
                    desc, with_b, (double)scale, n, step, j, bad,
                    bad < n ? (double)st[j * n + bad] : 0.0, bad < n ? r[j][bad] : 0.0);
    }
    for (size_t i = 0; i < PAD; i++) {
      ck_assert_msg(w[n + i] == CANARY, "[%s] n=%zu: param[n+%zu] written",
                    desc, n, i);
      ck_assert_msg(st[spe * n + i] == CANARY,
                    "[%s] n=%zu: state[%zu] written past its end", desc, n,
                    spe * n + i);
    }
  }
  free(w), free(st), free(a), free(b), free(rw), free(r[0]), free(r[1]), free(r[2]);
  free(sign);
}

#define NUM_RULES 13

/* rule()'s 2.6 rules, r 5 to 12. */
static ps_optimizer rule_2_6(int r, int with_wd) {
  static const ps_opt_kind kinds[] = {PS_OPT_ADAM,    PS_OPT_ADAM,    PS_OPT_ADAGRAD,
                                       PS_OPT_RMSPROP, PS_OPT_RMSPROP, PS_OPT_RMSPROP,
                                       PS_OPT_RMSPROP, PS_OPT_SGD};
  ps_optimizer o = opt_base(kinds[r - 5], 0.01);
  o.torch_epsilon = r == 5 || r == 6;
  o.epsilon = r == 5 ? 1e-3 : r == 7 ? 1e-10 : 1e-8;
  o.decoupled_weight_decay = r == 6 || r == 12;
  o.initial_accumulator = 0.1;
  o.alpha = r == 8 ? 0.99 : 0.9;
  o.momentum = r == 9 || r == 10 ? 0.9 : 0.0;
  o.centered = r == 10 || r == 11;
  o.lr_scale = r == 11 ? 0.5 : r == 12 ? 2.0 : 0.0;
  o.weight_decay = with_wd ? 0.05 : 0.0;
  return o;
}

/* The rules under test: SGD, momentum, Nesterov, Adam with a large epsilon
 * (so where epsilon goes matters: TF's epsilon-hat form) and Adam with
 * other betas and the usual epsilon; then (2.6) Adam with PyTorch's
 * epsilon, AdamW (decoupled), Adagrad, the four RMSProp variants (one with
 * lr_scale), and SGD with decoupled decay and lr_scale. */
static ps_optimizer rule(int r, int with_wd) {
  ps_optimizer o;
  if (r >= 5) return rule_2_6(r, with_wd);
  switch (r) {
    case 0:
      o = opt_base(PS_OPT_SGD, 0.01);
      break;
    case 1:
      o = opt_base(PS_OPT_MOMENTUM, 0.01);
      o.momentum = 0.9;
      break;
    case 2:
      o = opt_base(PS_OPT_MOMENTUM, 0.01);
      o.momentum = 0.9;
      o.nesterov = 1;
      break;
    case 3:
      o = opt_base(PS_OPT_ADAM, 0.01);
      o.epsilon = 1e-3;
      break;
    default:
      o = opt_base(PS_OPT_ADAM, 0.02);
      o.beta1 = 0.5;
      o.beta2 = 0.9;
      break;
  }
  o.weight_decay = with_wd ? 0.05 : 0.0;
  return o;
}

/* ---------------------------------------------------------------------- */
/* Updates against the reference */

/* _i encodes rule (NUM_RULES), weight decay, grad_b and scale. */
START_TEST(apply_matches_reference) {
  int r = _i / 8, with_wd = (_i >> 2) & 1, with_b = (_i >> 1) & 1;
  float scale = (_i & 1) ? 1.0f / 3.0f : 1.0f;
  ps_optimizer o = rule(r, with_wd);
  static const size_t sizes[] = {37, 1, 3, 8, 1029};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
    run_case(&o, 0, 5, with_b, scale, sizes[k], 0x9e3779b97f4a7c15ULL + (uint64_t)_i);
}
END_TEST

/* Schedules inside apply, and steps far from 0 (Adam's bias correction). */
START_TEST(apply_with_decay_and_late_steps) {
  static const ps_lr_decay decays[] = {PS_DECAY_EXPONENTIAL, PS_DECAY_STEP,
                                       PS_DECAY_NONE};
  static const uint64_t starts[] = {0, 30, 5000};
  for (int r = 0; r < NUM_RULES; r++)
    for (size_t d = 0; d < 3; d++)
      for (size_t s = 0; s < 3; s++) {
        ps_optimizer o = rule(r, 1);
        o.decay = decays[d];
        o.decay_rate = 0.9;
        o.decay_steps = 3;
        if (starts[s] == 5000 && o.decay != PS_DECAY_NONE) o.decay_steps = 1000;
        run_case(&o, starts[s], 7, 1, 0.5f, 37, 77 + (uint64_t)(r * 9 + d * 3 + s));
      }
}
END_TEST

/* A few updates worked out by hand, independent of the reference. */
START_TEST(apply_hand_values) {
  /* SGD: g = 0.5*(0.5 + 0.25) + 0.1*1 = 0.475; w = 1 - 0.1*0.475. */
  ps_optimizer o = opt_base(PS_OPT_SGD, 0.1);
  o.weight_decay = 0.1;
  float w = 1.0f, a = 0.5f, b = 0.25f;
  psd_opt_apply(&o, 0, &w, NULL, &a, &b, 0.5f, 1);
  ck_assert_float_eq_tol(w, 0.9525f, 1e-6f);

  /* Momentum 0.9, lr 0.1, g = 1: v = 1, w = 0.9; v = 1.9, w = 0.71. */
  o = opt_base(PS_OPT_MOMENTUM, 0.1);
  o.momentum = 0.9;
  float v = 0.0f;
  w = 1.0f, a = 1.0f;
  psd_opt_apply(&o, 0, &w, &v, &a, NULL, 1.0f, 1);
  ck_assert_float_eq_tol(v, 1.0f, 1e-6f);
  ck_assert_float_eq_tol(w, 0.9f, 1e-6f);
  psd_opt_apply(&o, 1, &w, &v, &a, NULL, 1.0f, 1);
  ck_assert_float_eq_tol(v, 1.9f, 1e-6f);
  ck_assert_float_eq_tol(w, 0.71f, 1e-6f);

  /* Nesterov: w = 1 - 0.1*(1 + 0.9) = 0.81; then 0.81 - 0.1*(1 + 1.71). */
  o.nesterov = 1;
  v = 0.0f, w = 1.0f;
  psd_opt_apply(&o, 0, &w, &v, &a, NULL, 1.0f, 1);
  ck_assert_float_eq_tol(w, 0.81f, 1e-6f);
  psd_opt_apply(&o, 1, &w, &v, &a, NULL, 1.0f, 1);
  ck_assert_float_eq_tol(v, 1.9f, 1e-6f);
  ck_assert_float_eq_tol(w, 0.539f, 1e-6f);

  /* Adam with a constant gradient moves by lr per step (bias-corrected
   * m/sqrt(v) = sign(g)); m and v after one step are (1-b)*g, (1-b2)*g^2. */
  o = opt_base(PS_OPT_ADAM, 0.01);
  float mv[2] = {0.0f, 0.0f};
  w = 1.0f, a = 0.5f;
  psd_opt_apply(&o, 0, &w, mv, &a, NULL, 1.0f, 1);
  ck_assert_float_eq_tol(mv[0], 0.05f, 1e-7f);
  ck_assert_float_eq_tol(mv[1], 0.00025f, 1e-9f);
  ck_assert_float_eq_tol(w, 0.99f, 1e-6f);
  psd_opt_apply(&o, 1, &w, mv, &a, NULL, 1.0f, 1);
  ck_assert_float_eq_tol(mv[0], 0.095f, 1e-7f);
  ck_assert_float_eq_tol(mv[1], 0.00049975f, 1e-9f);
  ck_assert_float_eq_tol(w, 0.98f, 1e-6f);
}
END_TEST

/* One update of a single element w with gradient g (state st). */
static float one_step(const ps_optimizer *o, uint64_t step, float w, float *st, float g) {
  psd_opt_apply(o, step, &w, st, &g, NULL, 1.0f, 1);
  return w;
}

/* 2.6 by hand: decoupled decay and lr_scale, Adagrad, RMSProp plain and
 * centered, and where Adam's epsilon goes (torch's vs TF's, epsilon 1). */
START_TEST(apply_hand_values_2_6) {
  /* SGD, decoupled: w = 1 * (1 - 0.1*0.5) - 0.1*0.5; lr_scale 2 of lr 0.05
   * moves as lr 0.1: 1 - 0.1*0.5. */
  ps_optimizer o = opt_base(PS_OPT_SGD, 0.1);
  o.weight_decay = 0.5;
  o.decoupled_weight_decay = 1;
  ck_assert_float_eq_tol(one_step(&o, 0, 1.0f, NULL, 0.5f), 0.9f, 1e-6f);
  o = opt_base(PS_OPT_SGD, 0.05);
  o.lr_scale = 2.0;
  ck_assert_float_eq_tol(one_step(&o, 0, 1.0f, NULL, 0.5f), 0.95f, 1e-6f);
  ck_assert_double_eq(psd_opt_lr(&o, 0), 0.1);

  /* Adagrad lr 0.1, g 0.5: acc 0.25, w 0.9; acc 0.5, w 0.9 - 0.05/sqrt(0.5). */
  o = opt_base(PS_OPT_ADAGRAD, 0.1);
  o.epsilon = 1e-10;
  float st[2] = {0.0f, 0.0f};
  float w = one_step(&o, 0, 1.0f, st, 0.5f);
  ck_assert_float_eq_tol(w, 0.9f, 1e-6f);
  ck_assert_float_eq_tol(one_step(&o, 1, w, st, 0.5f), 0.82928932f, 1e-6f);
  ck_assert_float_eq_tol(st[0], 0.5f, 1e-7f);

  /* RMSProp alpha 0.9, lr 0.01, g 1: sq 0.1, w 1 - 0.01/sqrt(0.1);
   * centered: gavg 0.1, w 1 - 0.01/sqrt(0.1 - 0.01). */
  o = opt_base(PS_OPT_RMSPROP, 0.01);
  o.alpha = 0.9;
  st[0] = 0.0f;
  ck_assert_float_eq_tol(one_step(&o, 0, 1.0f, st, 1.0f), 0.96837722f, 1e-6f);
  o.centered = 1;
  st[0] = st[1] = 0.0f;
  ck_assert_float_eq_tol(one_step(&o, 0, 1.0f, st, 1.0f), 0.96666667f, 1e-6f);
  ck_assert_float_eq_tol(st[1], 0.1f, 1e-7f);

  /* Adam, epsilon 1, g 0.5, lr 0.03: torch's w -= 0.03/0.1 * 0.05 /
   * (sqrt(0.00025)/sqrt(0.001) + 1) = 0.01; TF's epsilon-hat moves less. */
  o = opt_base(PS_OPT_ADAM, 0.03);
  o.epsilon = 1.0;
  o.torch_epsilon = 1;
  st[0] = st[1] = 0.0f;
  ck_assert_float_eq_tol(one_step(&o, 0, 1.0f, st, 0.5f), 0.99f, 1e-6f);
  o.torch_epsilon = 0;
  st[0] = st[1] = 0.0f;
  ck_assert_float_eq_tol(one_step(&o, 0, 1.0f, st, 0.5f), 0.99953304f, 1e-6f);
}
END_TEST

START_TEST(apply_empty) {
  ps_optimizer o = opt_base(PS_OPT_ADAM, 0.1);
  float w = 3.0f;
  psd_opt_apply(&o, 0, &w, NULL, NULL, NULL, 1.0f, 0);
  ck_assert_float_eq(w, 3.0f);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Schedules */

START_TEST(lr_schedules) {
  ps_optimizer o = opt_base(PS_OPT_SGD, 0.1);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 0), 0.1, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 123456), 0.1, 1e-15);

  o.decay = PS_DECAY_EXPONENTIAL;
  o.decay_rate = 0.5;
  o.decay_steps = 10;
  ck_assert_double_eq_tol(psd_opt_lr(&o, 0), 0.1, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 5), 0.07071067811865477, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 10), 0.05, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 25), 0.01767766952966369, 1e-15);

  o.decay = PS_DECAY_STEP;
  ck_assert_double_eq_tol(psd_opt_lr(&o, 0), 0.1, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 9), 0.1, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 10), 0.05, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 19), 0.05, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 20), 0.025, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 35), 0.0125, 1e-15);

  o = opt_base(PS_OPT_ADAM, 1.0);
  o.decay = PS_DECAY_EXPONENTIAL;
  o.decay_rate = 0.96;
  o.decay_steps = 1000;
  ck_assert_double_eq_tol(psd_opt_lr(&o, 500), 0.9797958971132712, 1e-14);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 100000), 0.016870319358849587,
                          1e-15);
  o.decay = PS_DECAY_STEP;
  ck_assert_double_eq_tol(psd_opt_lr(&o, 999), 1.0, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 1999), 0.96, 1e-15);
  /* decay_rate 1 is constant. */
  o.decay_rate = 1.0;
  ck_assert_double_eq_tol(psd_opt_lr(&o, 1u << 30), 1.0, 1e-15);
}
END_TEST

/* Warm-up and cosine decay against values computed by hand in double
 * precision: lr 0.1, warm-up 5 steps, cosine to 0.1 x lr at step 25, so
 * lr(s) = 0.1 (s+1)/5 for s < 5, then 0.1 (0.1 + 0.9 (1 + cos(pi p)) / 2)
 * with p = (s - 5) / 20, and 0.01 from step 25 on. */
START_TEST(lr_warmup_cosine) {
  ps_optimizer o = opt_base(PS_OPT_SGD, 0.1);
  o.decay = PS_DECAY_COSINE;
  o.warmup_steps = 5;
  o.total_steps = 25;
  o.min_lr_factor = 0.1;
  char err[256];
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 0), 0.02, 1e-15);          /* 0.1 * 1/5 */
  ck_assert_double_eq_tol(psd_opt_lr(&o, 2), 0.06, 1e-15);          /* 0.1 * 3/5 */
  ck_assert_double_eq_tol(psd_opt_lr(&o, 4), 0.1, 1e-15);           /* warm-up done */
  ck_assert_double_eq_tol(psd_opt_lr(&o, 5), 0.1, 1e-15);           /* p = 0 */
  /* p = 1/4: cos(pi/4) = 0.70710678118654752 */
  ck_assert_double_eq_tol(psd_opt_lr(&o, 10), 0.08681980515339464, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 15), 0.055, 1e-15);        /* p = 1/2 */
  ck_assert_double_eq_tol(psd_opt_lr(&o, 20), 0.02318019484660537, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 25), 0.01, 1e-15);         /* the floor */
  ck_assert_double_eq_tol(psd_opt_lr(&o, 1000000), 0.01, 1e-15);
  /* Cosine without warm-up, down to 0: lr/2 half way, 0 at the end. */
  o.warmup_steps = 0;
  o.min_lr_factor = 0.0;
  ck_assert_double_eq_tol(psd_opt_lr(&o, 0), 0.1, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 12), 0.05 * (1 + cos(M_PI * 12 / 25.0)), 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 25), 0.0, 1e-15);
  /* Warm-up scales the other schedules too: exponential, lr 1, rate 0.5
   * per 10 steps, 4 warm-up steps: 0.5^0.1 * 2/4 at step 1. */
  o = opt_base(PS_OPT_SGD, 1.0);
  o.decay = PS_DECAY_EXPONENTIAL;
  o.decay_rate = 0.5;
  o.decay_steps = 10;
  o.warmup_steps = 4;
  ck_assert_double_eq_tol(psd_opt_lr(&o, 1), 0.4665164957684037, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 3), 0.8122523963562356, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 4), 0.757858283255199, 1e-15);
  /* Warm-up alone: linear to lr, then constant. */
  o.decay = PS_DECAY_NONE;
  ck_assert_double_eq_tol(psd_opt_lr(&o, 0), 0.25, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 3), 1.0, 1e-15);
  ck_assert_double_eq_tol(psd_opt_lr(&o, 99), 1.0, 1e-15);
}
END_TEST

/* The update uses the scheduled lr: SGD on w = 1 with g = 1 moves w by
 * exactly lr(s) (float), at a warm-up step and a cosine step. */
START_TEST(apply_uses_warmup_cosine) {
  ps_optimizer o = opt_base(PS_OPT_SGD, 0.1);
  o.decay = PS_DECAY_COSINE;
  o.warmup_steps = 5;
  o.total_steps = 25;
  o.min_lr_factor = 0.1;
  const float g = 1.0f;
  float w = 1.0f;
  psd_opt_apply(&o, 0, &w, NULL, &g, NULL, 1.0f, 1);
  ck_assert_float_eq_tol(w, 0.98f, 1e-7f);
  w = 1.0f;
  psd_opt_apply(&o, 15, &w, NULL, &g, NULL, 1.0f, 1);
  ck_assert_float_eq_tol(w, 0.945f, 1e-7f);
  char buf[256];
  psd_opt_describe(&o, buf, sizeof buf);
  ck_assert_str_eq(buf, "sgd lr=0.1 wd=0 decay=cosine total=25 min_factor=0.1 warmup=5");
}
END_TEST

/* PS_OPT_NONE: valid with any lr (0 included), no state, no update. */
START_TEST(not_trainable_rule) {
  ps_optimizer o = opt_base(PS_OPT_NONE, 0.0);
  char err[256];
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 0);
  float w = 2.0f;
  const float g = 1.0f;
  psd_opt_apply(&o, 3, &w, NULL, &g, NULL, 1.0f, 1);
  ck_assert_float_eq(w, 2.0f);
  psd_opt_describe(&o, err, sizeof err);
  ck_assert_str_eq(err, "none (not trainable)");
}
END_TEST

/* PS_OPT_MEAN: valid with any lr, no state; the value becomes the scaled
 * sum of the gradients (the step's mean), whatever it was. */
START_TEST(mean_rule) {
  ps_optimizer o = opt_base(PS_OPT_MEAN, 0.0);
  char err[256];
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 0);
  enum { N = 37 }; /* not a multiple of any vector width */
  float w[N], a[N], b[N];
  for (int i = 0; i < N; i++) {
    w[i] = 100.0f + (float)i;
    a[i] = (float)i - 3.0f;
    b[i] = 0.25f * (float)i;
  }
  psd_opt_apply(&o, 7, w, NULL, a, b, 0.5f, N);
  for (int i = 0; i < N; i++) ck_assert_float_eq(w[i], 0.5f * (a[i] + b[i]));
  psd_opt_apply(&o, 8, w, NULL, a, NULL, 1.0f, N);
  for (int i = 0; i < N; i++) ck_assert_float_eq(w[i], a[i]);
  psd_opt_describe(&o, err, sizeof err);
  ck_assert_str_eq(err, "mean (the value is each step's mean gradient)");
  /* mean_scale 3 over 3 gradients: their sum, exactly (1/3 in float times
   * 3 must not leave 1 + 2^-24). */
  o.mean_scale = 3.0;
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  for (int i = 0; i < N; i++) {
    a[i] = 16777215.0f - (float)i; /* 2^24 - 1 - i: any error shows */
    b[i] = 1.0f;
  }
  psd_opt_apply(&o, 9, w, NULL, a, b, 1.0f / 3.0f, N);
  for (int i = 0; i < N; i++) ck_assert_float_eq(w[i], a[i] + b[i]);
  o.mean_scale = -1.0;
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), PS_EINVAL);
  ck_assert(strstr(err, "mean_scale") != NULL);
  /* The aggregation rule (2.8): job, all or first; none on a variable
   * that takes no gradients. */
  o.mean_scale = 0.0;
  for (int g = PS_AGGREGATE_JOB; g <= PS_AGGREGATE_FIRST; g++) {
    o.aggregate = g;
    ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  }
  o.aggregate = 3;
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "aggregate must be 0 (job), 1 (all) or 2 (first), got 3"), "%s", err);
  o.kind = PS_OPT_NONE;
  o.aggregate = PS_AGGREGATE_FIRST;
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "aggregate first on a variable that is not trained"), "%s", err);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Validation */

START_TEST(validate_accepts_good_configs) {
  char err[256];
  for (int r = 0; r < NUM_RULES; r++)
    for (int wd = 0; wd < 2; wd++)
      for (int d = 0; d < 3; d++) {
        ps_optimizer o = rule(r, wd);
        o.decay = (ps_lr_decay)d;
        if (d != PS_DECAY_NONE) {
          o.decay_rate = d == PS_DECAY_STEP ? 1.0 : 0.5;
          o.decay_steps = 1;
        }
        int rc = psd_opt_validate(&o, err, sizeof err);
        ck_assert_msg(rc == 0, "rule %d wd %d decay %d rejected: %s", r, wd,
                      d, err);
      }
  /* Edges: momentum 0, betas 0, lr tiny, weight decay large. */
  ps_optimizer o = opt_base(PS_OPT_MOMENTUM, 1e-30);
  o.momentum = 0.0;
  o.weight_decay = 10.0;
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  o = opt_base(PS_OPT_ADAM, 0.1);
  o.beta1 = 0.0;
  o.beta2 = 0.0;
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  /* Only kind and lr set: plain SGD; other rules' fields are not looked at,
   * nor decay_rate/decay_steps without a decay. */
  memset(&o, 0, sizeof o);
  o.kind = PS_OPT_SGD;
  o.lr = 0.5;
  ck_assert_int_eq(psd_opt_validate(&o, err, sizeof err), 0);
  o.momentum = 7.0;
  o.beta1 = -3.0;
  o.decay_rate = 99.0;
  ck_assert_int_eq(psd_opt_validate(&o, NULL, 0), 0);
}
END_TEST

#define NUM_BAD 36 /* bad_config's cases */

/* Bad config number i: *field is the field the message must name, *got
 * what it must say the value was. Returns 0 past the end of the table. */
static int bad_config(int i, ps_optimizer *o, const char **field,
                      const char **got) {
  *o = opt_base(PS_OPT_SGD, 0.1);
  switch (i) {
    case 0: o->lr = -1.0; *field = "lr"; *got = "got -1"; break;
    case 1: o->lr = 0.0; *field = "lr"; *got = "got 0"; break;
    case 2: o->lr = NAN; *field = "lr"; *got = "got nan"; break;
    case 3: o->lr = INFINITY; *field = "lr"; *got = "got inf"; break;
    case 4: o->kind = (ps_opt_kind)7; *field = "kind"; *got = "got 7"; break;
    case 5: o->kind = (ps_opt_kind)-1; *field = "kind"; *got = "got -1"; break;
    case 6:
      o->kind = PS_OPT_MOMENTUM; o->momentum = 1.0;
      *field = "momentum"; *got = "got 1"; break;
    case 7:
      o->kind = PS_OPT_MOMENTUM; o->momentum = -0.5;
      *field = "momentum"; *got = "got -0.5"; break;
    case 8:
      o->kind = PS_OPT_MOMENTUM; o->momentum = NAN; o->nesterov = 1;
      *field = "momentum"; *got = "got nan"; break;
    case 9:
      o->kind = PS_OPT_ADAM; o->beta1 = 1.0;
      *field = "beta1"; *got = "got 1"; break;
    case 10:
      o->kind = PS_OPT_ADAM; o->beta1 = -0.25;
      *field = "beta1"; *got = "got -0.25"; break;
    case 11:
      o->kind = PS_OPT_ADAM; o->beta2 = 1.5;
      *field = "beta2"; *got = "got 1.5"; break;
    case 12:
      o->kind = PS_OPT_ADAM; o->beta2 = NAN;
      *field = "beta2"; *got = "got nan"; break;
    case 13:
      o->kind = PS_OPT_ADAM; o->epsilon = 0.0;
      *field = "epsilon"; *got = "got 0"; break;
    case 14:
      o->kind = PS_OPT_ADAM; o->epsilon = -1e-8;
      *field = "epsilon"; *got = "got -1e-08"; break;
    case 15:
      o->kind = PS_OPT_ADAM; o->epsilon = NAN;
      *field = "epsilon"; *got = "got nan"; break;
    case 16:
      o->decay = (ps_lr_decay)9; *field = "decay"; *got = "got 9"; break;
    case 17:
      o->decay = PS_DECAY_EXPONENTIAL; o->decay_rate = 0.0;
      o->decay_steps = 10; *field = "decay_rate"; *got = "got 0"; break;
    case 18:
      o->decay = PS_DECAY_STEP; o->decay_rate = 1.5; o->decay_steps = 10;
      *field = "decay_rate"; *got = "got 1.5"; break;
    case 19:
      o->decay = PS_DECAY_EXPONENTIAL; o->decay_rate = NAN;
      o->decay_steps = 10; *field = "decay_rate"; *got = "got nan"; break;
    case 20:
      o->decay = PS_DECAY_EXPONENTIAL; o->decay_rate = 0.5;
      o->decay_steps = 0; *field = "decay_steps"; *got = "got 0"; break;
    case 21:
      o->decay = PS_DECAY_STEP; o->decay_rate = 0.5; o->decay_steps = 0;
      *field = "decay_steps"; *got = "got 0"; break;
    case 22: o->weight_decay = -0.1; *field = "weight_decay"; *got = "got -0.1"; break;
    case 23: o->weight_decay = NAN; *field = "weight_decay"; *got = "got nan"; break;
    case 24:
      o->weight_decay = INFINITY; *field = "weight_decay"; *got = "got inf";
      break;
    case 25:
      o->decay = PS_DECAY_COSINE; o->warmup_steps = 10; o->total_steps = 10;
      *field = "total_steps"; *got = "got 10"; break;
    case 26:
      o->decay = PS_DECAY_COSINE; o->total_steps = 0;
      *field = "total_steps"; *got = "got 0"; break;
    case 27:
      o->decay = PS_DECAY_COSINE; o->total_steps = 100; o->min_lr_factor = 1.5;
      *field = "min_lr_factor"; *got = "got 1.5"; break;
    case 28:
      o->decay = PS_DECAY_COSINE; o->total_steps = 100; o->min_lr_factor = NAN;
      *field = "min_lr_factor"; *got = "got nan"; break;
    /* 2.6: the message names the rule, not "optimizer". */
    case 29:
      o->kind = PS_OPT_ADAGRAD; o->initial_accumulator = -1.0;
      *field = "adagrad initial_accumulator"; *got = "got -1"; break;
    case 30:
      o->kind = PS_OPT_ADAGRAD; o->epsilon = 1e-50; /* 0 in float */
      *field = "adagrad epsilon"; *got = "got 1e-50"; break;
    case 31:
      o->kind = PS_OPT_RMSPROP; o->alpha = 1.0;
      *field = "rmsprop alpha"; *got = "got 1"; break;
    case 32:
      o->kind = PS_OPT_RMSPROP; o->alpha = 0.9; o->momentum = -0.1;
      *field = "rmsprop momentum"; *got = "got -0.1"; break;
    case 33:
      o->kind = PS_OPT_RMSPROP; o->alpha = 0.9; o->epsilon = 0.0;
      *field = "rmsprop epsilon"; *got = "got 0"; break;
    case 34: o->lr_scale = -1.0; *field = "sgd lr_scale"; *got = "got -1"; break;
    case 35:
      o->kind = PS_OPT_ADAGRAD; o->lr_scale = NAN;
      *field = "adagrad lr_scale"; *got = "got nan"; break;
    default: return 0;
  }
  return 1;
}

START_TEST(validate_rejects_bad_fields) {
  ps_optimizer o;
  const char *field = NULL, *got = NULL;
  ck_assert(bad_config(_i, &o, &field, &got));
  char err[256];
  memset(err, 'x', sizeof err);
  int rc = psd_opt_validate(&o, err, sizeof err);
  ck_assert_msg(rc == PS_EINVAL, "case %d (%s): rc %d", _i, field, rc);
  ck_assert_msg(memchr(err, '\0', sizeof err) != NULL, "case %d: no NUL", _i);
  char want[64];
  snprintf(want, sizeof want, strchr(field, ' ') ? "%s must" : "optimizer %s must", field);
  ck_assert_msg(strstr(err, want) != NULL, "case %d: \"%s\" lacks \"%s\"", _i,
                err, want);
  ck_assert_msg(strstr(err, got) != NULL, "case %d: \"%s\" lacks \"%s\"", _i,
                err, got);
  /* No buffer, or a tiny one: same code, nothing written out of bounds. */
  ck_assert_int_eq(psd_opt_validate(&o, NULL, 0), PS_EINVAL);
  char small[12];
  memset(small, 'x', sizeof small);
  ck_assert_int_eq(psd_opt_validate(&o, small, 8), PS_EINVAL);
  ck_assert_uint_eq(strlen(small), 7);
  ck_assert_int_eq(small[8], 'x');
}
END_TEST

START_TEST(validate_table_is_complete) {
  ps_optimizer o;
  const char *field, *got;
  ck_assert(!bad_config(NUM_BAD, &o, &field, &got));
}
END_TEST

/* ---------------------------------------------------------------------- */
/* State size and descriptions */

START_TEST(state_per_elem) {
  ps_optimizer o = opt_base(PS_OPT_SGD, 0.1);
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 0);
  o.kind = PS_OPT_MOMENTUM;
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 1);
  o.nesterov = 1;
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 1);
  o.kind = PS_OPT_ADAM;
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 2);
  /* Adagrad: the accumulator, starting at initial_accumulator; RMSProp:
   * the square average, plus a slot each for momentum and centered. */
  o.kind = PS_OPT_ADAGRAD;
  o.initial_accumulator = 0.1;
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 1);
  float st[4] = {7, 7, 7, 7};
  psd_opt_state_init(&o, st, 3);
  ck_assert(st[0] == 0.1f && st[2] == 0.1f && st[3] == 7.0f);
  o.kind = PS_OPT_RMSPROP;
  o.momentum = 0.0;
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 1);
  o.centered = 1;
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 2);
  o.momentum = 0.5;
  ck_assert_uint_eq(psd_opt_state_per_elem(&o), 3); /* + a moving average: test_average.c */
  psd_opt_state_init(&o, st, 1);
  ck_assert(st[0] == 0.0f && st[2] == 0.0f && st[3] == 7.0f);
}
END_TEST

START_TEST(describe) {
  char buf[256];
  ps_optimizer o = opt_base(PS_OPT_ADAM, 0.001);
  psd_opt_describe(&o, buf, sizeof buf);
  ck_assert_str_eq(buf,
                   "adam lr=0.001 beta1=0.9 beta2=0.999 eps=1e-08 wd=0 "
                   "decay=none");

  o = opt_base(PS_OPT_SGD, 0.1);
  o.weight_decay = 0.0001;
  o.decay = PS_DECAY_EXPONENTIAL;
  o.decay_rate = 0.96;
  o.decay_steps = 1000;
  psd_opt_describe(&o, buf, sizeof buf);
  ck_assert_str_eq(buf,
                   "sgd lr=0.1 wd=0.0001 decay=exponential rate=0.96 "
                   "steps=1000");

  o = opt_base(PS_OPT_MOMENTUM, 0.05);
  o.momentum = 0.9;
  o.nesterov = 1;
  o.decay = PS_DECAY_STEP;
  o.decay_rate = 0.5;
  o.decay_steps = 10;
  psd_opt_describe(&o, buf, sizeof buf);
  ck_assert_str_eq(buf,
                   "momentum lr=0.05 momentum=0.9 nesterov=yes wd=0 "
                   "decay=step rate=0.5 steps=10");

  /* 2.6: the new rules by name, and what changes any rule. */
  o = opt_base(PS_OPT_ADAM, 0.001);
  o.torch_epsilon = 1;
  o.decoupled_weight_decay = 1;
  o.weight_decay = 0.01;
  o.lr_scale = 0.5;
  psd_opt_describe(&o, buf, sizeof buf);
  ck_assert_str_eq(buf,
                   "adam lr=0.001 beta1=0.9 beta2=0.999 eps=1e-08 (torch) wd=0.01 (decoupled) "
                   "decay=none lr_scale=0.5");
  o = opt_base(PS_OPT_ADAGRAD, 0.01);
  o.initial_accumulator = 0.1;
  o.epsilon = 1e-10;
  psd_opt_describe(&o, buf, sizeof buf);
  ck_assert_str_eq(buf, "adagrad lr=0.01 initial_accumulator=0.1 eps=1e-10 wd=0 decay=none");
  o = opt_base(PS_OPT_RMSPROP, 0.01);
  o.alpha = 0.99;
  o.momentum = 0.9;
  o.centered = 1;
  psd_opt_describe(&o, buf, sizeof buf);
  ck_assert_str_eq(buf, "rmsprop lr=0.01 alpha=0.99 eps=1e-08 momentum=0.9 centered=yes wd=0 "
                        "decay=none");

  char small[16];
  memset(small, 'x', sizeof small);
  o = opt_base(PS_OPT_MOMENTUM, 0.05);
  psd_opt_describe(&o, small, 8);
  ck_assert_str_eq(small, "momentu");
  ck_assert_int_eq(small[8], 'x');
}
END_TEST

Suite *suite_optimizer(void) {
  Suite *s = suite_create("optimizer");

  TCase *tc = tcase_create("apply");
  tcase_add_loop_test(tc, apply_matches_reference, 0, NUM_RULES * 8);
  tcase_add_test(tc, apply_with_decay_and_late_steps);
  tcase_add_test(tc, apply_hand_values);
  tcase_add_test(tc, apply_hand_values_2_6);
  tcase_add_test(tc, apply_empty);
  suite_add_tcase(s, tc);

  tc = tcase_create("schedule");
  tcase_add_test(tc, lr_schedules);
  tcase_add_test(tc, lr_warmup_cosine);
  tcase_add_test(tc, apply_uses_warmup_cosine);
  tcase_add_test(tc, not_trainable_rule);
  tcase_add_test(tc, mean_rule);
  suite_add_tcase(s, tc);

  tc = tcase_create("validate");
  tcase_add_test(tc, validate_accepts_good_configs);
  tcase_add_loop_test(tc, validate_rejects_bad_fields, 0, NUM_BAD);
  tcase_add_test(tc, validate_table_is_complete);
  suite_add_tcase(s, tc);

  tc = tcase_create("misc");
  tcase_add_test(tc, state_per_elem);
  tcase_add_test(tc, describe);
  suite_add_tcase(s, tc);
  return s;
}
