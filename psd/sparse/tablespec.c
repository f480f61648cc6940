/* tablespec.c - what a sparse table spec may hold (psd_tablespec_check),
 * how two specs differ (psd_tablespec_diff), and the key-order check of pulls
 * and pushes (tablespec.h). */
#include "tablespec.h"

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "wire.h"

/* A double that converts to a finite float (the kernels compute in float). */
static int float_finite(double v) { return isfinite(v) && fabs(v) <= FLT_MAX; }

/* A double that is a positive normal float: the kernels divide by
 * epsilon and multiply by lr in float, where a smaller positive double is
 * 0 (or a denormal, 0 under flush-to-zero): epsilon 1e-50 made Adagrad's
 * and Adam's 0 / (sqrt(0) + 0) a NaN row, lr 1e-50 an SGD that never moves. */
static int float_positive(double v) { return float_finite(v) && v >= FLT_MIN; }

/* x in [0, 1); false for NaN. */
static int in_unit_halfopen(double x) { return x >= 0.0 && x < 1.0; }

static const char *init_name(uint32_t k) {
  switch (k) {
    case PS_INIT_ZEROS: return "zeros";
    case PS_INIT_CONSTANT: return "constant";
    case PS_INIT_UNIFORM: return "uniform";
    case PS_INIT_NORMAL: return "normal";
    case PS_INIT_TRUNCATED_NORMAL: return "truncated_normal";
    case PS_INIT_GLOROT_UNIFORM: return "glorot_uniform";
    case PS_INIT_GLOROT_NORMAL: return "glorot_normal";
    default: return "unknown";
  }
}

static const char *opt_name(uint32_t k) {
  switch (k) {
    case PS_TOPT_SGD: return "sgd";
    case PS_TOPT_ADAGRAD: return "adagrad";
    case PS_TOPT_ADAM: return "adam";
    case PS_TOPT_FTRL: return "ftrl";
    default: return "unknown";
  }
}

/* The initializer: a kind a row can use, with parameters it can draw from. */
static int check_init(const psd_table_spec *s, char *err, size_t errlen) {
  const double a = s->init_a, b = s->init_b;
  switch (s->init_kind) {
    case PS_INIT_ZEROS:
      return 0;
    case PS_INIT_CONSTANT:
      if (float_finite(a)) return 0;
      return ps__errf(PS_EINVAL, err, errlen,
                      "table '%s': init.a must be a finite float for constant init, got %g",
                      PS__ESC(s->name), a);
    case PS_INIT_UNIFORM:
      if (float_finite(a) && float_finite(b) && a < b) return 0;
      return ps__errf(PS_EINVAL, err, errlen,
                      "table '%s': init must have finite a < b for uniform init, got a %g, b %g",
                      PS__ESC(s->name), a, b);
    case PS_INIT_NORMAL:
    case PS_INIT_TRUNCATED_NORMAL:
      if (float_finite(a) && float_finite(b) && b > 0.0) return 0;
      return ps__errf(PS_EINVAL, err, errlen,
                      "table '%s': init must have a finite mean a and stddev b > 0 for %s "
                      "init, got a %g, b %g",
                      PS__ESC(s->name), init_name(s->init_kind), a, b);
    case PS_INIT_GLOROT_UNIFORM:
    case PS_INIT_GLOROT_NORMAL:
      return ps__errf(PS_EINVAL, err, errlen,
                      "table '%s': init.kind %s (%u) needs fan_in and fan_out, which a "
                      "table row does not have: use uniform, normal or truncated_normal",
                      PS__ESC(s->name), init_name(s->init_kind), s->init_kind);
    default:
      return ps__errf(PS_EINVAL, err, errlen,
                      "table '%s': init.kind must be %d..%d (zeros, constant, uniform, "
                      "normal, truncated_normal), got %u",
                      PS__ESC(s->name), PS_INIT_ZEROS, PS_INIT_TRUNCATED_NORMAL, s->init_kind);
  }
}

/* "FIELD must be ..., got V" for the rule's field `v` unless ok. */
static int field_bad(const psd_table_spec *s, int ok, const char *field, const char *want,
                     double v, char *err, size_t errlen) {
  if (ok) return 0;
  return ps__errf(PS_EINVAL, err, errlen, "table '%s': %s must be %s, got %g",
                  PS__ESC(s->name), field, want, v);
}

/* The update rule and the fields it reads (the others are ignored). */
static int check_opt(const psd_table_spec *s, char *err, size_t errlen) {
  if (field_bad(s, float_positive(s->lr), "lr",
                "a finite number >= 1.17549e-38 (FLT_MIN: a positive float)", s->lr, err,
                errlen))
    return PS_EINVAL;
  switch (s->opt) {
    case PS_TOPT_SGD:
      return 0;
    case PS_TOPT_ADAGRAD:
      if (field_bad(s, float_finite(s->initial_accumulator) && s->initial_accumulator >= 0.0,
                    "initial_accumulator", "a finite number >= 0 for adagrad",
                    s->initial_accumulator, err, errlen))
        return PS_EINVAL;
      break;
    case PS_TOPT_ADAM:
      if (field_bad(s, in_unit_halfopen(s->beta1), "beta1", "in [0, 1) for adam", s->beta1, err,
                    errlen) ||
          field_bad(s, in_unit_halfopen(s->beta2), "beta2", "in [0, 1) for adam", s->beta2, err,
                    errlen))
        return PS_EINVAL;
      break;
    case PS_TOPT_FTRL:
      if (field_bad(s, isfinite(s->l1) && s->l1 >= 0.0, "l1", "a finite number >= 0 for ftrl",
                    s->l1, err, errlen) ||
          field_bad(s, isfinite(s->l2) && s->l2 >= 0.0, "l2", "a finite number >= 0 for ftrl",
                    s->l2, err, errlen) ||
          field_bad(s, isfinite(s->ftrl_beta) && s->ftrl_beta >= 0.0, "ftrl_beta",
                    "a finite number >= 0 for ftrl", s->ftrl_beta, err, errlen))
        return PS_EINVAL;
      return 0;
    default:
      return ps__errf(PS_EINVAL, err, errlen,
                      "table '%s': opt must be %d (sgd), %d (adagrad), %d (adam) or %d "
                      "(ftrl), got %u",
                      PS__ESC(s->name), PS_TOPT_SGD, PS_TOPT_ADAGRAD, PS_TOPT_ADAM, PS_TOPT_FTRL,
                      s->opt);
  }
  /* adagrad and adam divide by sqrt(...) + epsilon */
  if (field_bad(s, float_positive(s->epsilon), "epsilon",
                "a finite number >= 1.17549e-38 (FLT_MIN: a positive float)", s->epsilon, err,
                errlen))
    return PS_EINVAL;
  return 0;
}

int psd_tablespec_has_schedule(const psd_table_spec *s) {
  return s->decay != PS_DECAY_NONE || s->warmup_steps != 0;
}

void psd_tablespec_schedule(const psd_table_spec *s, ps_optimizer *o) {
  ps_optimizer_default(o, s->lr);
  o->decay = (ps_lr_decay)s->decay;
  o->decay_rate = s->decay_rate;
  o->decay_steps = s->decay_steps;
  o->warmup_steps = s->warmup_steps;
  o->total_steps = s->total_steps;
  o->min_lr_factor = s->min_lr_factor;
}

void psd_tablespec_take_schedule(psd_table_spec *dst, const psd_table_spec *src) {
  dst->decay = src->decay;
  dst->decay_rate = src->decay_rate;
  dst->decay_steps = src->decay_steps;
  dst->warmup_steps = src->warmup_steps;
  dst->total_steps = src->total_steps;
  dst->min_lr_factor = src->min_lr_factor;
}

/* The schedule (2.8), checked as a variable's; FTRL's rate is per element. */
static int check_schedule(const psd_table_spec *s, char *err, size_t errlen) {
  if (!psd_tablespec_has_schedule(s)) return 0;
  if (s->opt == PS_TOPT_FTRL)
    return ps__errf(PS_EINVAL, err, errlen,
                    "table '%s': FTRL takes no learning-rate schedule (its rate is per "
                    "element): leave decay and warmup_steps at 0", PS__ESC(s->name));
  ps_optimizer o;
  psd_tablespec_schedule(s, &o);
  char e[300];
  int rc = ps__opt_check_schedule(&o, "", e, sizeof e);
  return rc ? ps__errf(rc, err, errlen, "table '%s':%s", PS__ESC(s->name), e) : 0;
}

int psd_tablespec_check(const psd_table_spec *s, char *err, size_t errlen) {
  if (err && errlen > 0) err[0] = '\0';
  if (!s) return ps__errf(PS_EINVAL, err, errlen, "table spec is missing");
  if (!memchr(s->name, '\0', sizeof s->name))
    return ps__errf(PS_EINVAL, err, errlen, "table name must be shorter than %zu bytes",
                    sizeof s->name);
  if (s->dim == 0 || s->dim > PS__MAX_TABLE_DIM)
    return ps__errf(PS_EINVAL, err, errlen, "table '%s': dim must be in 1..%u, got %u",
                    PS__ESC(s->name), PS__MAX_TABLE_DIM, s->dim);
  if (s->capacity == 0 || s->capacity > PSD_TABLE_MAX_ROWS)
    return ps__errf(PS_EINVAL, err, errlen,
                    "table '%s': capacity must be in 1..%" PRIu64 " rows per ps, got %" PRIu64,
                    PS__ESC(s->name), (uint64_t)PSD_TABLE_MAX_ROWS, s->capacity);
  int rc = check_init(s, err, errlen);
  if (rc == 0) rc = check_opt(s, err, errlen);
  if (rc == 0 && s->admit_count > PS_TABLE_MAX_ADMIT_COUNT)
    rc = ps__errf(PS_EINVAL, err, errlen,
                  "table '%s': admit_count must be at most %u (8-bit sketch counters), "
                  "got %u",
                  PS__ESC(s->name), PS_TABLE_MAX_ADMIT_COUNT, s->admit_count);
  if (rc == 0 && !(s->admit_prob >= 0.0 && s->admit_prob <= 1.0))
    rc = ps__errf(PS_EINVAL, err, errlen, "table '%s': admit_prob must be in [0, 1], got %g",
                  PS__ESC(s->name), s->admit_prob);
  if (rc == 0) rc = check_schedule(s, err, errlen);
  return rc;
}

/* "FIELD is X for who_a, Y for who_b" for doubles: short when %g tells
 * them apart, else every digit (0.1 vs 0.10000000000000002). */
static int diff_double(const char *field, double a, const char *wa, double b, const char *wb,
                       char *err, size_t errlen) {
  char x[32], y[32];
  snprintf(x, sizeof x, "%g", a);
  snprintf(y, sizeof y, "%g", b);
  if (strcmp(x, y) == 0) {
    snprintf(x, sizeof x, "%.17g", a);
    snprintf(y, sizeof y, "%.17g", b);
  }
  snprintf(err, errlen, "%s is %s for %s, %s for %s", field, x, wa, y, wb);
  return 1;
}

static int diff_u64(const char *field, uint64_t a, const char *wa, uint64_t b, const char *wb,
                    char *err, size_t errlen) {
  snprintf(err, errlen, "%s is %" PRIu64 " for %s, %" PRIu64 " for %s", field, a, wa, b, wb);
  return 1;
}

static int diff_named(const char *field, const char *na, uint32_t a, const char *wa,
                      const char *nb, uint32_t b, const char *wb, char *err, size_t errlen) {
  snprintf(err, errlen, "%s is %s (%u) for %s, %s (%u) for %s", field, na, a, wa, nb, b, wb);
  return 1;
}

#define D_DOUBLE(field, name) \
  if (a->field != b->field) return diff_double(name, a->field, wa, b->field, wb, err, errlen)
#define D_U64(field, name) \
  if (a->field != b->field) return diff_u64(name, a->field, wa, b->field, wb, err, errlen)

/* The initializer's fields, and the seed when a draw uses it. */
static int diff_init(const psd_table_spec *a, const char *wa, const psd_table_spec *b,
                     const char *wb, char *err, size_t errlen) {
  if (a->init_kind != b->init_kind)
    return diff_named("init.kind", init_name(a->init_kind), a->init_kind, wa,
                      init_name(b->init_kind), b->init_kind, wb, err, errlen);
  const uint32_t k = a->init_kind;
  const int random = k == PS_INIT_UNIFORM || k == PS_INIT_NORMAL ||
                     k == PS_INIT_TRUNCATED_NORMAL;
  if (random || k == PS_INIT_CONSTANT) D_DOUBLE(init_a, "init.a");
  if (random) D_DOUBLE(init_b, "init.b");
  /* the seed also seeds admission by probability */
  if (random || a->admit_prob > 0.0) D_U64(init_seed, "init.seed");
  return 0;
}

/* The rule's fields. */
static int diff_opt(const psd_table_spec *a, const char *wa, const psd_table_spec *b,
                    const char *wb, char *err, size_t errlen) {
  if (a->opt != b->opt)
    return diff_named("opt", opt_name(a->opt), a->opt, wa, opt_name(b->opt), b->opt, wb, err,
                      errlen);
  D_DOUBLE(lr, "lr");
  if (a->opt == PS_TOPT_ADAGRAD) {
    D_DOUBLE(initial_accumulator, "initial_accumulator");
    D_DOUBLE(epsilon, "epsilon");
  } else if (a->opt == PS_TOPT_ADAM) {
    D_DOUBLE(beta1, "beta1");
    D_DOUBLE(beta2, "beta2");
    D_DOUBLE(epsilon, "epsilon");
  } else if (a->opt == PS_TOPT_FTRL) {
    D_DOUBLE(l1, "l1");
    D_DOUBLE(l2, "l2");
    D_DOUBLE(ftrl_beta, "ftrl_beta");
  }
  return 0;
}

int psd_tablespec_diff(const psd_table_spec *a, const char *wa, const psd_table_spec *b,
                       const char *wb, char *err, size_t errlen) {
  if (err && errlen > 0) err[0] = '\0';
  if (a->dim != b->dim) return diff_u64("dim", a->dim, wa, b->dim, wb, err, errlen);
  D_U64(capacity, "capacity");
  if (diff_init(a, wa, b, wb, err, errlen) || diff_opt(a, wa, b, wb, err, errlen)) return 1;
  D_DOUBLE(admit_prob, "admit_prob");
  /* 0 and 1 both admit at the first sighting; by probability the count is
   * not used */
  uint32_t ca = a->admit_count > 1 ? a->admit_count : 1;
  uint32_t cb = b->admit_count > 1 ? b->admit_count : 1;
  if (a->admit_prob == 0.0 && ca != cb)
    return diff_u64("admit_count", a->admit_count, wa, b->admit_count, wb, err, errlen);
  D_U64(evict_after_steps, "evict_after_steps");
  if (a->decay != b->decay)
    return diff_u64("decay", a->decay, wa, b->decay, wb, err, errlen);
  if (a->decay == PS_DECAY_EXPONENTIAL || a->decay == PS_DECAY_STEP) {
    D_DOUBLE(decay_rate, "decay_rate");
    D_U64(decay_steps, "decay_steps");
  }
  if (a->decay == PS_DECAY_COSINE) {
    D_U64(total_steps, "total_steps");
    D_DOUBLE(min_lr_factor, "min_lr_factor");
  }
  D_U64(warmup_steps, "warmup_steps");
  return 0;
}

int psd_tablespec_keys_check(const uint64_t *keys, size_t n, char *err, size_t errlen) {
  if (err && errlen > 0) err[0] = '\0';
  for (size_t i = 1; i < n; i++)
    if (keys[i] <= keys[i - 1])
      return ps__errf(PS_EINVAL, err, errlen,
                      "keys must be strictly ascending: key %zu (%" PRIu64
                      ") is not above key %zu (%" PRIu64 ")",
                      i, keys[i], i - 1, keys[i - 1]);
  return 0;
}
