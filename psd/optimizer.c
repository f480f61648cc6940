/*
 * optimizer.c - SGD, momentum (plain and Nesterov) and Adam update rules,
 * the mean of a mean variable, learning-rate schedules, and validation of
 * configurations sent by workers.
 *
 * psd_opt_apply is the server's hot path (slices of up to 16M floats). Each
 * rule is one fused pass over memory in float: the per-step scalars (decayed
 * learning rate, Adam's bias correction) are computed once in double, and
 * every (rule, grad_b present or not) pair has its own branch-free loop over
 * restrict-qualified pointers so gcc -O3 vectorizes all of them.
 */
#include "optimizer.h"

#include "util.h"
#include "wire.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Adam needs sqrtf in its inner loop. With the default -fmath-errno, gcc
 * treats sqrtf as a function that may write errno and will not vectorize a
 * loop calling it (and per-function optimize("no-math-errno") does not
 * change that). sqrtf only sets errno for arguments below -0, and Adam's
 * second moment is a sum of squares (>= 0, or NaN, which sets nothing), so
 * declaring it const here is true for every call this file makes and lets
 * gcc emit sqrtps. */
#if defined(__GNUC__)
float sqrtf(float x) __attribute__((const, nothrow));
#endif

/* ---------------------------------------------------------------------- */
/* Validation and description */

/* Names come from the wire layer, which the client shares. */
#define kind_name ps__opt_kind_name
#define decay_name ps__opt_decay_name

/* x in [0, 1); false for NaN. */
static int in_unit_halfopen(double x) { return x >= 0.0 && x < 1.0; }

int psd_opt_validate(const ps_optimizer *o, char *err, size_t errlen) {
  if (err && errlen > 0) err[0] = '\0';
  if (!o) return ps__errf(PS_EINVAL, err, errlen, "optimizer configuration is missing");
  /* A variable that is not trained, or only averaged, has no rule:
   * nothing else is read (but a mean's scale). */
  if (o->kind == PS_OPT_NONE) return 0;
  if (o->kind == PS_OPT_MEAN) {
    if (!(isfinite(o->mean_scale) && o->mean_scale >= 0.0))
      return ps__errf(PS_EINVAL, err, errlen,
                      "optimizer mean_scale must be a finite number > 0 (or 0: 1), got %g",
                      o->mean_scale);
    return 0;
  }
  if (!(isfinite(o->lr) && o->lr > 0.0))
    return ps__errf(PS_EINVAL, err, errlen,
                "optimizer lr must be a positive finite number, got %g", o->lr);
  if (!kind_name((int)o->kind))
    return ps__errf(PS_EINVAL, err, errlen,
                "optimizer kind must be %d (sgd), %d (momentum), %d (adam), %d "
                "(none: not trainable) or %d (mean: gradients averaged), got %d",
                PS_OPT_SGD, PS_OPT_MOMENTUM, PS_OPT_ADAM, PS_OPT_NONE, PS_OPT_MEAN,
                (int)o->kind);
  /* Fields of the other rules are ignored, so a config zeroed apart from
   * kind and lr is valid SGD. */
  if (o->kind == PS_OPT_MOMENTUM && !in_unit_halfopen(o->momentum))
    return ps__errf(PS_EINVAL, err, errlen, "optimizer momentum must be in [0, 1), got %g",
                o->momentum);
  if (o->kind == PS_OPT_ADAM) {
    if (!in_unit_halfopen(o->beta1))
      return ps__errf(PS_EINVAL, err, errlen, "optimizer beta1 must be in [0, 1), got %g",
                  o->beta1);
    if (!in_unit_halfopen(o->beta2))
      return ps__errf(PS_EINVAL, err, errlen, "optimizer beta2 must be in [0, 1), got %g",
                  o->beta2);
    if (!(isfinite(o->epsilon) && o->epsilon > 0.0))
      return ps__errf(PS_EINVAL, err, errlen,
                  "optimizer epsilon must be a positive finite number, got %g",
                  o->epsilon);
  }
  if (!decay_name((int)o->decay))
    return ps__errf(PS_EINVAL, err, errlen,
                "optimizer decay must be %d (none), %d (exponential), %d "
                "(step) or %d (cosine), got %d",
                PS_DECAY_NONE, PS_DECAY_EXPONENTIAL, PS_DECAY_STEP,
                PS_DECAY_COSINE, (int)o->decay);
  if (o->decay == PS_DECAY_COSINE) {
    if (o->total_steps <= o->warmup_steps)
      return ps__errf(PS_EINVAL, err, errlen,
                      "optimizer total_steps must be > warmup_steps (%" PRIu64
                      ") with cosine decay, got %" PRIu64,
                      o->warmup_steps, o->total_steps);
    if (!(o->min_lr_factor >= 0.0 && o->min_lr_factor <= 1.0))
      return ps__errf(PS_EINVAL, err, errlen,
                      "optimizer min_lr_factor must be in [0, 1] with cosine decay, got %g",
                      o->min_lr_factor);
  } else if (o->decay != PS_DECAY_NONE) {
    if (!(o->decay_rate > 0.0 && o->decay_rate <= 1.0))
      return ps__errf(PS_EINVAL, err, errlen,
                  "optimizer decay_rate must be in (0, 1] with %s decay, "
                  "got %g",
                  decay_name((int)o->decay), o->decay_rate);
    if (o->decay_steps == 0)
      return ps__errf(PS_EINVAL, err, errlen,
                  "optimizer decay_steps must be > 0 with %s decay, got 0",
                  decay_name((int)o->decay));
  }
  if (!(isfinite(o->weight_decay) && o->weight_decay >= 0.0))
    return ps__errf(PS_EINVAL, err, errlen,
                "optimizer weight_decay must be a finite number >= 0, got %g",
                o->weight_decay);
  return 0;
}

size_t psd_opt_state_per_elem(const ps_optimizer *o) {
  if (!o) return 0;
  switch (o->kind) {
    case PS_OPT_MOMENTUM: return 1;
    case PS_OPT_ADAM: return 2;
    default: return 0;
  }
}

/* The cosine factor at step: 1 until the warm-up ends, then down to
 * min_lr_factor at total_steps, which it keeps. */
static double cosine_factor(const ps_optimizer *o, uint64_t step) {
  if (o->total_steps <= o->warmup_steps) return 1.0; /* invalid; be safe */
  double p = step <= o->warmup_steps ? 0.0
                                     : (double)(step - o->warmup_steps) /
                                           (double)(o->total_steps - o->warmup_steps);
  if (p > 1.0) p = 1.0;
  const double f = o->min_lr_factor;
  return f + (1.0 - f) * 0.5 * (1.0 + cos(M_PI * p));
}

double psd_opt_lr(const ps_optimizer *o, uint64_t step) {
  double lr = o->lr;
  switch (o->decay) {
    case PS_DECAY_EXPONENTIAL:
      if (o->decay_steps) lr *= pow(o->decay_rate, (double)step / (double)o->decay_steps);
      break;
    case PS_DECAY_STEP:
      if (o->decay_steps) lr *= pow(o->decay_rate, (double)(step / o->decay_steps));
      break;
    case PS_DECAY_COSINE:
      lr *= cosine_factor(o, step);
      break;
    default:
      break;
  }
  /* Warm-up scales whatever the schedule gives, reaching it at the end. */
  if (step < o->warmup_steps) lr *= (double)(step + 1) / (double)o->warmup_steps;
  return lr;
}

void psd_opt_describe(const ps_optimizer *o, char *buf, size_t len) {
  if (!buf || len == 0) return;
  if (!o) {
    snprintf(buf, len, "(no optimizer)");
    return;
  }
  const char *kn = kind_name((int)o->kind);
  const char *dn = decay_name((int)o->decay);
  char head[160], tail[160];
  if (o->kind == PS_OPT_NONE) {
    snprintf(buf, len, "none (not trainable)");
    return;
  }
  if (o->kind == PS_OPT_MEAN) {
    if (o->mean_scale == 0.0 || o->mean_scale == 1.0)
      snprintf(buf, len, "mean (the value is each step's mean gradient)");
    else
      snprintf(buf, len, "mean x %.9g (the value is each step's mean gradient times %.9g)",
               o->mean_scale, o->mean_scale);
    return;
  }
  if (!kn)
    snprintf(head, sizeof head, "unknown-kind(%d) lr=%.9g", (int)o->kind,
             o->lr);
  else if (o->kind == PS_OPT_MOMENTUM)
    snprintf(head, sizeof head, "momentum lr=%.9g momentum=%.9g nesterov=%s",
             o->lr, o->momentum, o->nesterov ? "yes" : "no");
  else if (o->kind == PS_OPT_ADAM)
    snprintf(head, sizeof head, "adam lr=%.9g beta1=%.9g beta2=%.9g eps=%.9g",
             o->lr, o->beta1, o->beta2, o->epsilon);
  else
    snprintf(head, sizeof head, "sgd lr=%.9g", o->lr);
  if (!dn)
    snprintf(tail, sizeof tail, "decay=unknown(%d)", (int)o->decay);
  else if (o->decay == PS_DECAY_NONE)
    snprintf(tail, sizeof tail, "decay=none");
  else if (o->decay == PS_DECAY_COSINE)
    snprintf(tail, sizeof tail, "decay=cosine total=%" PRIu64 " min_factor=%.9g",
             o->total_steps, o->min_lr_factor);
  else
    snprintf(tail, sizeof tail, "decay=%s rate=%.9g steps=%" PRIu64, dn,
             o->decay_rate, o->decay_steps);
  if (o->warmup_steps) {
    size_t tl = strlen(tail);
    snprintf(tail + tl, sizeof tail - tl, " warmup=%" PRIu64, o->warmup_steps);
  }
  snprintf(buf, len, "%s wd=%.9g %s", head, o->weight_decay, tail);
}

/* ---------------------------------------------------------------------- */
/* Update kernels. One loop per (rule, grad_b NULL or not); each reads and
 * writes every array exactly once per element, with no branches inside.
 * Pointers are restrict: param, state and the gradients never overlap
 * (grad_a and grad_b may, being read-only). */

static void sgd_a(float *restrict w, const float *restrict a, float s,
                  float wd, float lr, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float wi = w[i];
    float g = s * a[i] + wd * wi;
    w[i] = wi - lr * g;
  }
}

static void sgd_ab(float *restrict w, const float *restrict a,
                   const float *restrict b, float s, float wd, float lr,
                   size_t n) {
  for (size_t i = 0; i < n; i++) {
    float wi = w[i];
    float g = s * (a[i] + b[i]) + wd * wi;
    w[i] = wi - lr * g;
  }
}

/* TF MomentumOptimizer: v = mu*v + g; w -= lr*v. */
static void mom_a(float *restrict w, float *restrict v,
                  const float *restrict a, float s, float wd, float lr,
                  float mu, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float wi = w[i];
    float g = s * a[i] + wd * wi;
    float vi = mu * v[i] + g;
    v[i] = vi;
    w[i] = wi - lr * vi;
  }
}

static void mom_ab(float *restrict w, float *restrict v,
                   const float *restrict a, const float *restrict b, float s,
                   float wd, float lr, float mu, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float wi = w[i];
    float g = s * (a[i] + b[i]) + wd * wi;
    float vi = mu * v[i] + g;
    v[i] = vi;
    w[i] = wi - lr * vi;
  }
}

/* Nesterov (TF use_nesterov): v = mu*v + g; w -= lr*(g + mu*v). */
static void nag_a(float *restrict w, float *restrict v,
                  const float *restrict a, float s, float wd, float lr,
                  float mu, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float wi = w[i];
    float g = s * a[i] + wd * wi;
    float vi = mu * v[i] + g;
    v[i] = vi;
    w[i] = wi - lr * (g + mu * vi);
  }
}

static void nag_ab(float *restrict w, float *restrict v,
                   const float *restrict a, const float *restrict b, float s,
                   float wd, float lr, float mu, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float wi = w[i];
    float g = s * (a[i] + b[i]) + wd * wi;
    float vi = mu * v[i] + g;
    v[i] = vi;
    w[i] = wi - lr * (g + mu * vi);
  }
}

/* Adam's per-step scalars, in float for the loop. */
typedef struct {
  float lr_hat; /* lr_t * sqrt(1 - beta2^t) / (1 - beta1^t) */
  float b1, c1; /* beta1, 1 - beta1 */
  float b2, c2; /* beta2, 1 - beta2 */
  float eps;
} adam_k;

/* TF AdamOptimizer: m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
 * w -= lr_hat * m / (sqrt(v) + eps). */
static void adam_a(float *restrict w, float *restrict m, float *restrict v,
                   const float *restrict a, float s, float wd, adam_k k,
                   size_t n) {
  const float lr_hat = k.lr_hat, b1 = k.b1, c1 = k.c1, b2 = k.b2, c2 = k.c2,
              eps = k.eps;
  for (size_t i = 0; i < n; i++) {
    float wi = w[i];
    float g = s * a[i] + wd * wi;
    float mi = b1 * m[i] + c1 * g;
    float vi = b2 * v[i] + c2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    w[i] = wi - lr_hat * mi / (sqrtf(vi) + eps);
  }
}

static void adam_ab(float *restrict w, float *restrict m, float *restrict v,
                    const float *restrict a, const float *restrict b, float s,
                    float wd, adam_k k, size_t n) {
  const float lr_hat = k.lr_hat, b1 = k.b1, c1 = k.c1, b2 = k.b2, c2 = k.c2,
              eps = k.eps;
  for (size_t i = 0; i < n; i++) {
    float wi = w[i];
    float g = s * (a[i] + b[i]) + wd * wi;
    float mi = b1 * m[i] + c1 * g;
    float vi = b2 * v[i] + c2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    w[i] = wi - lr_hat * mi / (sqrtf(vi) + eps);
  }
}

/* A mean variable: the value becomes the step's mean gradient. */
static void mean_a(float *restrict w, const float *restrict a, float s, size_t n) {
  for (size_t i = 0; i < n; i++) w[i] = s * a[i];
}

static void mean_ab(float *restrict w, const float *restrict a, const float *restrict b,
                    float s, size_t n) {
  for (size_t i = 0; i < n; i++) w[i] = s * (a[i] + b[i]);
}

void psd_opt_apply(const ps_optimizer *o, uint64_t step, float *param,
                   float *state, const float *grad_a, const float *grad_b,
                   float scale, size_t n) {
  if (!o || n == 0) return;
  const double lr_t = psd_opt_lr(o, step);
  const float lr = (float)lr_t;
  const float wd = (float)o->weight_decay;

  switch (o->kind) {
    case PS_OPT_MEAN: {
      /* scale is 1/count; times mean_scale in double, so 2 workers' sum
       * (mean_scale 2) or 3's (3) scale by exactly 1. */
      const float s = o->mean_scale > 0.0 ? (float)(o->mean_scale * (double)scale) : scale;
      if (grad_b) mean_ab(param, grad_a, grad_b, s, n);
      else mean_a(param, grad_a, s, n);
      break;
    }
    case PS_OPT_SGD:
      if (grad_b) sgd_ab(param, grad_a, grad_b, scale, wd, lr, n);
      else sgd_a(param, grad_a, scale, wd, lr, n);
      break;
    case PS_OPT_MOMENTUM: {
      const float mu = (float)o->momentum;
      if (o->nesterov) {
        if (grad_b) nag_ab(param, state, grad_a, grad_b, scale, wd, lr, mu, n);
        else nag_a(param, state, grad_a, scale, wd, lr, mu, n);
      } else {
        if (grad_b) mom_ab(param, state, grad_a, grad_b, scale, wd, lr, mu, n);
        else mom_a(param, state, grad_a, scale, wd, lr, mu, n);
      }
      break;
    }
    case PS_OPT_ADAM: {
      /* t = step + 1; computed in double so late steps keep precision. */
      const double t = (double)step + 1.0;
      const double corr1 = 1.0 - pow(o->beta1, t);
      const double corr2 = 1.0 - pow(o->beta2, t);
      adam_k k;
      k.lr_hat = (float)(lr_t * sqrt(corr2) / corr1);
      k.b1 = (float)o->beta1;
      k.c1 = (float)(1.0 - o->beta1);
      k.b2 = (float)o->beta2;
      k.c2 = (float)(1.0 - o->beta2);
      k.eps = (float)o->epsilon;
      if (grad_b)
        adam_ab(param, state, state + n, grad_a, grad_b, scale, wd, k, n);
      else
        adam_a(param, state, state + n, grad_a, scale, wd, k, n);
      break;
    }
    default:
      break; /* rejected by psd_opt_validate */
  }
}
