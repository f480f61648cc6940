/*
 * optimizer.c - SGD, momentum (plain and Nesterov), Adam (TensorFlow's or
 * PyTorch's epsilon), Adagrad and RMSProp update rules, decoupled weight
 * decay, the mean of a mean variable, learning-rate schedules, and
 * validation of configurations sent by workers.
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
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Adam, Adagrad and RMSProp need sqrtf in their inner loops. With the
 * default -fmath-errno, gcc treats sqrtf as a function that may write errno
 * and will not vectorize a loop calling it (and per-function
 * optimize("no-math-errno") does not change that). sqrtf only sets errno
 * for arguments below -0, and every argument here is a sum of squares or
 * a decayed average of them (>= 0, or NaN, which sets nothing; centered
 * RMSProp's difference is clamped at 0), so declaring it const here is
 * true for every call this file makes and lets gcc emit sqrtps. */
#if defined(__GNUC__)
float sqrtf(float x) __attribute__((const, nothrow));
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

/* ---------------------------------------------------------------------- */
/* Validation and description */

/* Names come from the wire layer, which the client shares. */
#define kind_name ps__opt_kind_name
#define decay_name ps__opt_decay_name

/* x in [0, 1); false for NaN. */
static int in_unit_halfopen(double x) { return x >= 0.0 && x < 1.0; }

/* A positive normal float: the kernels add epsilon in float, where a
 * smaller double is 0 (or a denormal, 0 under flush-to-zero) and 0 / (0 +
 * 0) would make NaN parameters. */
static int float_positive(double x) { return isfinite(x) && x >= FLT_MIN && x <= FLT_MAX; }

static int bad_epsilon(const ps_optimizer *o, char *err, size_t errlen) {
  return ps__errf(PS_EINVAL, err, errlen,
                  "%s epsilon must be a positive finite number (a normal float: >= %g), got %g",
                  kind_name((int)o->kind), (double)FLT_MIN, o->epsilon);
}

/* 0 if x is in [0, 1), else PS_EINVAL with "<who> <field> must be ...". */
static int need_unit(const char *who, const char *field, double x, char *err, size_t errlen) {
  if (in_unit_halfopen(x)) return 0;
  return ps__errf(PS_EINVAL, err, errlen, "%s %s must be in [0, 1), got %g", who, field, x);
}

/* The fields of the rule o->kind reads (a known kind with a rule). Adagrad
 * and RMSProp (2.6) name the rule in their messages. */
static int validate_rule(const ps_optimizer *o, char *err, size_t errlen) {
  int rc = 0;
  switch (o->kind) {
    case PS_OPT_MOMENTUM:
      return need_unit("optimizer", "momentum", o->momentum, err, errlen);
    case PS_OPT_ADAM:
      if ((rc = need_unit("optimizer", "beta1", o->beta1, err, errlen)) != 0 ||
          (rc = need_unit("optimizer", "beta2", o->beta2, err, errlen)) != 0)
        return rc;
      if (!(isfinite(o->epsilon) && o->epsilon > 0.0))
        return ps__errf(PS_EINVAL, err, errlen,
                        "optimizer epsilon must be a positive finite number, got %g", o->epsilon);
      return 0;
    case PS_OPT_ADAGRAD:
      if (!(isfinite(o->initial_accumulator) && o->initial_accumulator >= 0.0))
        return ps__errf(PS_EINVAL, err, errlen,
                        "adagrad initial_accumulator must be a finite number >= 0, got %g",
                        o->initial_accumulator);
      return float_positive(o->epsilon) ? 0 : bad_epsilon(o, err, errlen);
    case PS_OPT_RMSPROP:
      if ((rc = need_unit("rmsprop", "alpha", o->alpha, err, errlen)) != 0 ||
          (rc = need_unit("rmsprop", "momentum", o->momentum, err, errlen)) != 0)
        return rc;
      return float_positive(o->epsilon) ? 0 : bad_epsilon(o, err, errlen);
    default:
      return 0;
  }
}

/* The moving average's fields (2.7), which every kind may set. */
static int validate_average(const ps_optimizer *o, char *err, size_t errlen) {
  if (!ps__opt_average_name(o->average))
    return ps__errf(PS_EINVAL, err, errlen,
                    "optimizer average must be %d (none), %d (ema), %d (ema_num_updates) or "
                    "%d (polyak), got %d",
                    PS_AVERAGE_NONE, PS_AVERAGE_EMA, PS_AVERAGE_EMA_NUM_UPDATES,
                    PS_AVERAGE_POLYAK, o->average);
  if ((o->average == PS_AVERAGE_EMA || o->average == PS_AVERAGE_EMA_NUM_UPDATES) &&
      !in_unit_halfopen(o->average_decay))
    return ps__errf(PS_EINVAL, err, errlen,
                    "optimizer average_decay must be in [0, 1) with average %s, got %g",
                    ps__opt_average_name(o->average), o->average_decay);
  return 0;
}

/* The aggregation rule (2.8): a known one, and only where gradients come. */
static int validate_aggregate(const ps_optimizer *o, char *err, size_t errlen) {
  if (!ps__opt_aggregate_name(o->aggregate))
    return ps__errf(PS_EINVAL, err, errlen,
                    "optimizer aggregate must be %d (job), %d (all) or %d (first), got %d",
                    PS_AGGREGATE_JOB, PS_AGGREGATE_ALL, PS_AGGREGATE_FIRST, o->aggregate);
  if (o->kind == PS_OPT_NONE && o->aggregate != PS_AGGREGATE_JOB)
    return ps__errf(PS_EINVAL, err, errlen,
                    "optimizer aggregate %s on a variable that is not trained (kind none): it "
                    "takes no gradients",
                    ps__opt_aggregate_name(o->aggregate));
  return 0;
}

int psd_opt_validate(const ps_optimizer *o, char *err, size_t errlen) {
  if (err && errlen > 0) err[0] = '\0';
  if (!o) return ps__errf(PS_EINVAL, err, errlen, "optimizer configuration is missing");
  int arc = validate_average(o, err, errlen);
  if (!arc) arc = validate_aggregate(o, err, errlen);
  if (arc) return arc;
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
                "(none: not trainable), %d (mean: gradients averaged), %d (adagrad) or %d "
                "(rmsprop), got %d",
                PS_OPT_SGD, PS_OPT_MOMENTUM, PS_OPT_ADAM, PS_OPT_NONE, PS_OPT_MEAN,
                PS_OPT_ADAGRAD, PS_OPT_RMSPROP, (int)o->kind);
  /* Fields of the other rules are ignored, so a config zeroed apart from
   * kind and lr is valid SGD. */
  int rc = validate_rule(o, err, errlen);
  if (rc) return rc;
  if (!(isfinite(o->lr_scale) && o->lr_scale >= 0.0))
    return ps__errf(PS_EINVAL, err, errlen,
                    "%s lr_scale must be a finite number > 0 (or 0: 1), got %g",
                    kind_name((int)o->kind), o->lr_scale);
  rc = ps__opt_check_schedule(o, "optimizer", err, errlen);
  if (rc) return rc;
  if (!(isfinite(o->weight_decay) && o->weight_decay >= 0.0))
    return ps__errf(PS_EINVAL, err, errlen,
                "optimizer weight_decay must be a finite number >= 0, got %g",
                o->weight_decay);
  return 0;
}

/* The rule's own state floats per element (the average comes after). */
static size_t rule_state_per_elem(const ps_optimizer *o) {
  switch (o->kind) {
    case PS_OPT_MOMENTUM: return 1;
    case PS_OPT_ADAM: return 2;
    case PS_OPT_ADAGRAD: return 1;
    case PS_OPT_RMSPROP: return 1 + (o->momentum > 0.0) + (o->centered != 0);
    default: return 0;
  }
}

size_t psd_opt_state_per_elem(const ps_optimizer *o) {
  if (!o) return 0;
  return rule_state_per_elem(o) + (o->average != PS_AVERAGE_NONE);
}

float *psd_opt_average(const ps_optimizer *o, float *state, size_t n) {
  if (!o || !state || o->average == PS_AVERAGE_NONE) return NULL;
  return state + rule_state_per_elem(o) * n;
}

void psd_opt_state_init(const ps_optimizer *o, float *state, size_t n) {
  if (!o || !state) return;
  const size_t per = psd_opt_state_per_elem(o);
  memset(state, 0, per * n * sizeof *state);
  if (o->kind == PS_OPT_ADAGRAD) {
    const float a0 = (float)o->initial_accumulator;
    for (size_t i = 0; i < n; i++) state[i] = a0;
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
  /* The variable's multiplier scales the scheduled rate: with no schedule
   * lr * lr_scale, the very double a torch param group of lr base * scale
   * holds. */
  if (o->lr_scale > 0.0) lr *= o->lr_scale;
  return lr;
}

static void describe_rule(const ps_optimizer *o, char *buf, size_t len);

void psd_opt_describe(const ps_optimizer *o, char *buf, size_t len) {
  if (!buf || len == 0) return;
  if (!o) {
    snprintf(buf, len, "(no optimizer)");
    return;
  }
  describe_rule(o, buf, len);
  if (o->average == PS_AVERAGE_NONE) return;
  size_t bl = strlen(buf);
  if (o->average == PS_AVERAGE_POLYAK)
    snprintf(buf + bl, len - bl, " average=polyak");
  else
    snprintf(buf + bl, len - bl, " average=%s decay=%.9g",
             ps__opt_average_name(o->average) ? ps__opt_average_name(o->average) : "unknown",
             o->average_decay);
}

static void describe_rule(const ps_optimizer *o, char *buf, size_t len) {
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
    snprintf(head, sizeof head, "adam lr=%.9g beta1=%.9g beta2=%.9g eps=%.9g%s",
             o->lr, o->beta1, o->beta2, o->epsilon, o->torch_epsilon ? " (torch)" : "");
  else if (o->kind == PS_OPT_ADAGRAD)
    snprintf(head, sizeof head, "adagrad lr=%.9g initial_accumulator=%.9g eps=%.9g", o->lr,
             o->initial_accumulator, o->epsilon);
  else if (o->kind == PS_OPT_RMSPROP)
    snprintf(head, sizeof head, "rmsprop lr=%.9g alpha=%.9g eps=%.9g momentum=%.9g centered=%s",
             o->lr, o->alpha, o->epsilon, o->momentum, o->centered ? "yes" : "no");
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
  if (o->lr_scale > 0.0 && o->lr_scale != 1.0) {
    size_t tl = strlen(tail);
    snprintf(tail + tl, sizeof tail - tl, " lr_scale=%.9g", o->lr_scale);
  }
  snprintf(buf, len, "%s wd=%.9g%s %s", head, o->weight_decay,
           o->decoupled_weight_decay ? " (decoupled)" : "", tail);
}

/* ---------------------------------------------------------------------- */
/* Update kernels. Each rule is one always-inlined loop body that
 * psd_opt_apply instantiates twice, with has_b a constant 0 or 1 (grad_b
 * NULL or not), so every copy is a branch-free loop gcc vectorizes; each
 * reads and writes every array exactly once per element. Pointers are
 * restrict: param, state and the gradients never overlap (grad_a and
 * grad_b may, being read-only). */

/* The per-step scalars every rule reads, in float for the loops. */
typedef struct {
  float s;    /* 1/k: the mean of k gradients */
  float wd;   /* L2: weight_decay added to the gradient (0 when decoupled) */
  float keep; /* decoupled: 1 - lr_t * weight_decay, w's factor before the
                 rule (torch.optim.AdamW's param.mul_); else exactly 1 */
  float lr;   /* lr_t */
} step_k;

/* Element i's gradient: the mean of the step's gradients plus L2. */
INLINE float grad_i(const float *restrict a, const float *restrict b, int has_b, size_t i,
                    step_k k, float w0) {
  return (has_b ? k.s * (a[i] + b[i]) : k.s * a[i]) + k.wd * w0;
}

INLINE void sgd(float *restrict w, const float *restrict a, const float *restrict b,
                int has_b, step_k k, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float w0 = w[i];
    float g = grad_i(a, b, has_b, i, k, w0);
    w[i] = k.keep * w0 - k.lr * g;
  }
}

/* TF MomentumOptimizer: v = mu*v + g; w -= lr*v. Nesterov (TF
 * use_nesterov): w -= lr*(g + mu*v). */
INLINE void momentum(float *restrict w, float *restrict v, const float *restrict a,
                     const float *restrict b, int has_b, int nesterov, float mu, step_k k,
                     size_t n) {
  for (size_t i = 0; i < n; i++) {
    float w0 = w[i];
    float g = grad_i(a, b, has_b, i, k, w0);
    float vi = mu * v[i] + g;
    v[i] = vi;
    w[i] = k.keep * w0 - k.lr * (nesterov ? g + mu * vi : vi);
  }
}

/* Adam's per-step scalars, in float for the loop. */
typedef struct {
  float lr_hat; /* TF: lr_t * sqrt(1 - beta2^t) / (1 - beta1^t); torch:
                   -lr_t / (1 - beta1^t) */
  float b1, c1; /* beta1, 1 - beta1 */
  float b2, c2; /* beta2, 1 - beta2 */
  float eps;
  float corr2;  /* torch: sqrt(1 - beta2^t) */
} adam_k;

/* m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2. TF AdamOptimizer: w -=
 * lr_hat * m / (sqrt(v) + eps). torch.optim.Adam: w += (-lr/(1-b1^t) * m) /
 * (sqrt(v) / sqrt(1-b2^t) + eps), its order of operations (v's (c2*g)*g
 * too), so only torch's fused multiply-adds round differently. */
INLINE void adam(float *restrict w, float *restrict m, float *restrict v,
                 const float *restrict a, const float *restrict b, int has_b, int torch,
                 adam_k q, step_k k, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float w0 = w[i];
    float g = grad_i(a, b, has_b, i, k, w0);
    float mi = q.b1 * m[i] + q.c1 * g;
    float vi = q.b2 * v[i] + (torch ? (q.c2 * g) * g : q.c2 * (g * g));
    m[i] = mi;
    v[i] = vi;
    w[i] = torch ? k.keep * w0 + (q.lr_hat * mi) / (sqrtf(vi) / q.corr2 + q.eps)
                 : k.keep * w0 - q.lr_hat * mi / (sqrtf(vi) + q.eps);
  }
}

/* torch.optim.Adagrad: acc += g*g; w += (-lr * g) / (sqrt(acc) + eps). */
INLINE void adagrad(float *restrict w, float *restrict acc, const float *restrict a,
                    const float *restrict b, int has_b, float eps, step_k k, size_t n) {
  const float nlr = -k.lr;
  for (size_t i = 0; i < n; i++) {
    float w0 = w[i];
    float g = grad_i(a, b, has_b, i, k, w0);
    float ai = acc[i] + g * g;
    acc[i] = ai;
    w[i] = k.keep * w0 + (nlr * g) / (sqrtf(ai) + eps);
  }
}

/* RMSProp's per-step scalars and state (each n long, the ones its
 * configuration uses, in this order). */
typedef struct {
  float alpha, c, eps, mu; /* alpha, 1 - alpha, epsilon, momentum */
  float *restrict sq;      /* the square average */
  float *restrict buf;     /* momentum > 0: the momentum buffer */
  float *restrict gavg;    /* centered: the gradient average */
} rms_k;

/* torch.optim.RMSprop: sq = alpha*sq + ((1-alpha)*g)*g; centered: gavg =
 * alpha*gavg + (1-alpha)*g, d = sqrt(sq - gavg^2) + eps, else sqrt(sq) +
 * eps; with momentum buf = mu*buf + g/d, w -= lr*buf, else w += (-lr*g)/d.
 * sq - gavg^2 is >= 0 in exact arithmetic; a rounding below 0 counts as 0
 * instead of a NaN parameter. */
INLINE void rmsprop(float *restrict w, const float *restrict a, const float *restrict b,
                    int has_b, int centered, int mom, rms_k r, step_k k, size_t n) {
  const float nlr = -k.lr;
  for (size_t i = 0; i < n; i++) {
    float w0 = w[i];
    float g = grad_i(a, b, has_b, i, k, w0);
    float sq = r.alpha * r.sq[i] + (r.c * g) * g;
    r.sq[i] = sq;
    if (centered) {
      float ga = r.alpha * r.gavg[i] + r.c * g;
      r.gavg[i] = ga;
      sq = sq - ga * ga;
      sq = sq < 0.0f ? 0.0f : sq;
    }
    float d = sqrtf(sq) + r.eps;
    if (mom) {
      float bi = r.mu * r.buf[i] + g / d;
      r.buf[i] = bi;
      w[i] = k.keep * w0 + nlr * bi;
    } else {
      w[i] = k.keep * w0 + (nlr * g) / d;
    }
  }
}

/* A mean variable: the value becomes s times the step's gradient sum. */
INLINE void mean(float *restrict w, const float *restrict a, const float *restrict b,
                 int has_b, float s, size_t n) {
  for (size_t i = 0; i < n; i++) w[i] = has_b ? s * (a[i] + b[i]) : s * a[i];
}

/* Runs call_b when there is a second gradient, else call_a: the same
 * kernel with grad_b and has_b 1, or NULL and 0. */
#define WITH_B(call_b, call_a) \
  do {                         \
    if (grad_b)                \
      call_b;                  \
    else                       \
      call_a;                  \
  } while (0)

static void apply_adam(const ps_optimizer *o, uint64_t step, double lr_t, float *param,
                       float *state, const float *grad_a, const float *grad_b, step_k k,
                       size_t n) {
  /* t = step + 1; computed in double so late steps keep precision. */
  const double t = (double)step + 1.0;
  const double corr1 = 1.0 - pow(o->beta1, t);
  const double corr2 = 1.0 - pow(o->beta2, t);
  const int torch = o->torch_epsilon != 0;
  adam_k q;
  q.lr_hat = torch ? (float)-(lr_t / corr1) : (float)(lr_t * sqrt(corr2) / corr1);
  q.corr2 = (float)sqrt(corr2);
  q.b1 = (float)o->beta1;
  q.c1 = (float)(1.0 - o->beta1);
  q.b2 = (float)o->beta2;
  q.c2 = (float)(1.0 - o->beta2);
  q.eps = (float)o->epsilon;
  float *m = state, *v = state + n;
  if (torch)
    WITH_B(adam(param, m, v, grad_a, grad_b, 1, 1, q, k, n),
           adam(param, m, v, grad_a, NULL, 0, 1, q, k, n));
  else
    WITH_B(adam(param, m, v, grad_a, grad_b, 1, 0, q, k, n),
           adam(param, m, v, grad_a, NULL, 0, 0, q, k, n));
}

static void apply_rmsprop(const ps_optimizer *o, float *param, float *state,
                          const float *grad_a, const float *grad_b, step_k k, size_t n) {
  const int mom = o->momentum > 0.0, centered = o->centered != 0;
  rms_k r;
  r.alpha = (float)o->alpha;
  r.c = (float)(1.0 - o->alpha);
  r.eps = (float)o->epsilon;
  r.mu = (float)o->momentum;
  r.sq = state;
  r.buf = mom ? state + n : NULL;
  r.gavg = centered ? state + n * (size_t)(1 + mom) : NULL;
  if (mom && centered)
    WITH_B(rmsprop(param, grad_a, grad_b, 1, 1, 1, r, k, n),
           rmsprop(param, grad_a, NULL, 0, 1, 1, r, k, n));
  else if (mom)
    WITH_B(rmsprop(param, grad_a, grad_b, 1, 0, 1, r, k, n),
           rmsprop(param, grad_a, NULL, 0, 0, 1, r, k, n));
  else if (centered)
    WITH_B(rmsprop(param, grad_a, grad_b, 1, 1, 0, r, k, n),
           rmsprop(param, grad_a, NULL, 0, 1, 0, r, k, n));
  else
    WITH_B(rmsprop(param, grad_a, grad_b, 1, 0, 0, r, k, n),
           rmsprop(param, grad_a, NULL, 0, 0, 0, r, k, n));
}

void psd_opt_apply(const ps_optimizer *o, uint64_t step, float *param,
                   float *state, const float *grad_a, const float *grad_b,
                   float scale, size_t n) {
  if (!o || n == 0) return;
  const double lr_t = psd_opt_lr(o, step);
  step_k k;
  k.s = scale;
  k.lr = (float)lr_t;
  k.wd = o->decoupled_weight_decay ? 0.0f : (float)o->weight_decay;
  k.keep = o->decoupled_weight_decay ? (float)(1.0 - lr_t * o->weight_decay) : 1.0f;

  switch (o->kind) {
    case PS_OPT_MEAN: {
      /* scale is 1/count; times mean_scale in double, so 2 workers' sum
       * (mean_scale 2) or 3's (3) scale by exactly 1. */
      const float s = o->mean_scale > 0.0 ? (float)(o->mean_scale * (double)scale) : scale;
      WITH_B(mean(param, grad_a, grad_b, 1, s, n), mean(param, grad_a, NULL, 0, s, n));
      break;
    }
    case PS_OPT_SGD:
      WITH_B(sgd(param, grad_a, grad_b, 1, k, n), sgd(param, grad_a, NULL, 0, k, n));
      break;
    case PS_OPT_MOMENTUM: {
      const float mu = (float)o->momentum;
      if (o->nesterov)
        WITH_B(momentum(param, state, grad_a, grad_b, 1, 1, mu, k, n),
               momentum(param, state, grad_a, NULL, 0, 1, mu, k, n));
      else
        WITH_B(momentum(param, state, grad_a, grad_b, 1, 0, mu, k, n),
               momentum(param, state, grad_a, NULL, 0, 0, mu, k, n));
      break;
    }
    case PS_OPT_ADAM:
      apply_adam(o, step, lr_t, param, state, grad_a, grad_b, k, n);
      break;
    case PS_OPT_ADAGRAD: {
      const float eps = (float)o->epsilon;
      WITH_B(adagrad(param, state, grad_a, grad_b, 1, eps, k, n),
             adagrad(param, state, grad_a, NULL, 0, eps, k, n));
      break;
    }
    case PS_OPT_RMSPROP:
      apply_rmsprop(o, param, state, grad_a, grad_b, k, n);
      break;
    default:
      break; /* rejected by psd_opt_validate */
  }
}
