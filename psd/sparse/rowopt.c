/* rowopt.c - per-row update rules of sparse tables (rowopt.h). */
#include "rowopt.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "wire.h"

/* As in optimizer.c: with -fmath-errno gcc will not vectorize a loop that
 * calls sqrtf/sqrt, which may set errno only for arguments below -0. Every
 * call here takes a sum of squares (>= 0, or NaN, which sets nothing), so
 * declaring them const is true for this file and lets gcc emit sqrtps/pd. */
#if defined(__GNUC__)
float sqrtf(float x) __attribute__((const, nothrow));
double sqrt(double x) __attribute__((const, nothrow));
#endif

/* Adam's state: m (dim), v (dim), then t as the uint32 bits of one float. */
#define ADAM_STATE(dim) (2ull * (dim) + 1ull)

uint32_t psd_rowopt_state_floats(const psd_table_spec *spec) {
  uint64_t d = spec->dim, s;
  switch (spec->opt) {
    case PS_TOPT_ADAGRAD: s = d; break;
    case PS_TOPT_ADAM: s = ADAM_STATE(d); break;
    case PS_TOPT_FTRL: s = 2 * d; break;
    default: s = 0; break;
  }
  return s > UINT32_MAX ? UINT32_MAX : (uint32_t)s;
}

uint64_t psd_rowopt_stride(const psd_table_spec *spec) {
  uint64_t s = (uint64_t)spec->dim + psd_rowopt_state_floats(spec); /* < 2^34 */
  return (s + PSD_ROW_ALIGN_FLOATS - 1) / PSD_ROW_ALIGN_FLOATS * PSD_ROW_ALIGN_FLOATS;
}

/* Adam's bias corrections at a row's step t: sqrt(1 - beta2^t) and
 * 1 - beta1^t (tabled at init for the first steps, the same values). */
static void adam_corrections(const psd_rowopt *o, uint32_t t, double *sqrt_c2, double *c1) {
  *sqrt_c2 = sqrt(1.0 - pow(o->beta2, (double)t));
  *c1 = 1.0 - pow(o->beta1, (double)t);
}

void psd_rowopt_init(psd_rowopt *o, const psd_table_spec *spec) {
  memset(o, 0, sizeof *o);
  o->kind = spec->opt;
  o->dim = spec->dim;
  o->lr = (float)spec->lr;
  o->lr_d = spec->lr;
  o->inv_lr = (float)(1.0 / spec->lr);
  o->eps = (float)spec->epsilon;
  o->init_acc = (float)spec->initial_accumulator;
  o->beta1 = spec->beta1;
  o->beta2 = spec->beta2;
  o->b1 = (float)spec->beta1;
  o->c1 = (float)(1.0 - spec->beta1);
  o->b2 = (float)spec->beta2;
  o->c2 = (float)(1.0 - spec->beta2);
  o->l1 = spec->l1;
  o->l2 = spec->l2;
  o->ftrl_beta = spec->ftrl_beta;
  if (o->kind == PS_TOPT_ADAM)
    for (uint32_t t = 1; t <= PSD_ROWOPT_ADAM_STEPS; t++)
      adam_corrections(o, t, &o->adam_sqrt_c2[t - 1], &o->adam_c1[t - 1]);
}

void psd_rowopt_set_lr(psd_rowopt *o, double lr) {
  o->lr = (float)lr;
  o->lr_d = lr;
  o->inv_lr = (float)(1.0 / lr);
}

void psd_rowopt_new_state(const psd_rowopt *o, float *state) {
  const uint32_t d = o->dim;
  switch (o->kind) {
    case PS_TOPT_ADAGRAD:
      for (uint32_t i = 0; i < d; i++) state[i] = o->init_acc;
      break;
    case PS_TOPT_ADAM: /* m = v = 0 and t = 0 (all-zero bits) */
      memset(state, 0, ADAM_STATE(d) * sizeof(float));
      break;
    case PS_TOPT_FTRL:
      memset(state, 0, 2ull * d * sizeof(float));
      break;
    default:
      break;
  }
}

/* w -= lr * g. */
PS__VECTOR_CLONES
static void sgd_row(float *restrict w, const float *restrict g, float s, float lr,
                    uint32_t d) {
  for (uint32_t i = 0; i < d; i++) w[i] = w[i] - lr * (s * g[i]);
}

/* Rows read or updated this many ahead are prefetched (as table.c's). */
#define ROWOPT_AHEAD 4u

/* sgd_row on rows[0..m) of vals (psd_rowopt_apply_rows). */
PS__VECTOR_CLONES
static void sgd_rows(float *vals, uint64_t stride, const uint32_t *rows, size_t m,
                     const float *restrict g, float s, float lr, uint32_t d) {
  for (size_t j = 0; j < m; j++) {
    if (j + ROWOPT_AHEAD < m && rows[j + ROWOPT_AHEAD] != PSD_ROWOPT_NO_ROW)
      __builtin_prefetch(vals + rows[j + ROWOPT_AHEAD] * stride, 1);
    if (rows[j] == PSD_ROWOPT_NO_ROW) continue;
    float *restrict w = vals + rows[j] * stride;
    const float *restrict gj = g + j * d;
    for (uint32_t i = 0; i < d; i++) w[i] = w[i] - lr * (s * gj[i]);
  }
}

/* a += g*g; w -= lr * g / (sqrt(a) + eps). */
PS__VECTOR_CLONES
static void adagrad_row(float *restrict w, float *restrict a, const float *restrict g,
                        float s, float lr, float eps, uint32_t d) {
  for (uint32_t i = 0; i < d; i++) {
    float gi = s * g[i];
    float ai = a[i] + gi * gi;
    a[i] = ai;
    w[i] = w[i] - lr * gi / (sqrtf(ai) + eps);
  }
}

/* m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; w -= lr_hat m / (sqrt(v) + eps). */
PS__VECTOR_CLONES
static void adam_row(float *restrict w, float *restrict m, float *restrict v,
                     const float *restrict g, float s, const psd_rowopt *o, float lr_hat,
                     uint32_t d) {
  const float b1 = o->b1, c1 = o->c1, b2 = o->b2, c2 = o->c2, eps = o->eps;
  for (uint32_t i = 0; i < d; i++) {
    float gi = s * g[i];
    float mi = b1 * m[i] + c1 * gi;
    float vi = b2 * v[i] + c2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    w[i] = w[i] - lr_hat * mi / (sqrtf(vi) + eps);
  }
}

/* Lazy Adam: the row's own t advances (saturating: 2^32 updates of one row
 * leave the correction at 1 long before), then TF's epsilon-hat form with
 * lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t) computed in double. */
static void adam_apply(const psd_rowopt *o, float *w, float *state, const float *g,
                       float s) {
  const uint32_t d = o->dim;
  uint32_t t;
  memcpy(&t, state + 2ull * d, sizeof t);
  if (t < UINT32_MAX) t++;
  memcpy(state + 2ull * d, &t, sizeof t);
  double sqrt_c2, c1;
  if (t <= PSD_ROWOPT_ADAM_STEPS) {
    sqrt_c2 = o->adam_sqrt_c2[t - 1];
    c1 = o->adam_c1[t - 1];
  } else {
    adam_corrections(o, t, &sqrt_c2, &c1);
  }
  const float lr_hat = (float)(o->lr_d * sqrt_c2 / c1);
  adam_row(w, state, state + d, g, s, o, lr_hat, d);
}

/* FTRL-proximal per element, as psclient.h states it:
 * n += g^2; z += g - (sqrt(n) - sqrt(n_old)) / lr * w;
 * w = |z| <= l1 ? 0 : -(z - sign(z) l1) / ((beta + sqrt(n)) / lr + l2).
 * sqrt(n) - sqrt(n_old) is computed as g^2 / (sqrt(n) + sqrt(n_old)), the
 * same value without the cancellation that would lose it in float, so the
 * rule runs in float: 8 lanes, not 2 doubles. Branch-free so it
 * vectorizes: z - sign(z) l1 is copysign(max(|z| - l1, 0), z) when
 * |z| > l1, and that max is 0 exactly when |z| <= l1 (+0.0 turns the -0
 * of a negative z into 0). The
 * denominator is 0 only with beta = l2 = 0 and n = 0, where z is 0 too:
 * dividing that 0 by 1 instead keeps w at 0, not NaN. */
PS__VECTOR_CLONES
static void ftrl_row(float *restrict w, float *restrict z, float *restrict n,
                     const float *restrict g, float s, const psd_rowopt *o, uint32_t d) {
  const float inv_lr = o->inv_lr, l1 = (float)o->l1, l2 = (float)o->l2,
              beta = (float)o->ftrl_beta;
  for (uint32_t i = 0; i < d; i++) {
    float gi = s * g[i], g2 = gi * gi;
    float n0 = n[i], n1 = n0 + g2;
    float sq0 = sqrtf(n0), sq1 = sqrtf(n1), sum = sq0 + sq1;
    /* The divisor is chosen, not the division (gcc will not vectorize a
     * division it must skip): sum is 0 or at least the root of the least
     * subnormal, far above FLT_MIN, and with sum 0 so is g2. */
    sum = sum > FLT_MIN ? sum : FLT_MIN;
    float sigma = g2 / sum * inv_lr;
    float zi = z[i] + gi - sigma * w[i];
    float over = fabsf(zi) - l1;
    float shrunk = over > 0.0f ? over : 0.0f;
    float den = (beta + sq1) * inv_lr + l2;
    den = den > 0.0f ? den : 1.0f;
    z[i] = zi;
    n[i] = n1;
    w[i] = -copysignf(shrunk, zi) / den + 0.0f;
  }
}

void psd_rowopt_apply(const psd_rowopt *o, float *w, float *state, const float *g,
                      float scale) {
  switch (o->kind) {
    case PS_TOPT_SGD: sgd_row(w, g, scale, o->lr, o->dim); break;
    case PS_TOPT_ADAGRAD: adagrad_row(w, state, g, scale, o->lr, o->eps, o->dim); break;
    case PS_TOPT_ADAM: adam_apply(o, w, state, g, scale); break;
    case PS_TOPT_FTRL: ftrl_row(w, state, state + o->dim, g, scale, o, o->dim); break;
    default: break; /* refused by psd_tablespec_check */
  }
}

void psd_rowopt_apply_rows(const psd_rowopt *o, float *vals, uint64_t stride,
                           const uint32_t *rows, size_t m, const float *g, float scale) {
  const uint32_t d = o->dim;
  if (o->kind == PS_TOPT_SGD) {
    sgd_rows(vals, stride, rows, m, g, scale, o->lr, d);
    return;
  }
  for (size_t j = 0; j < m; j++) { /* heavier rules: the call is a small part */
    if (j + ROWOPT_AHEAD < m && rows[j + ROWOPT_AHEAD] != PSD_ROWOPT_NO_ROW)
      __builtin_prefetch(vals + rows[j + ROWOPT_AHEAD] * stride, 1);
    if (rows[j] == PSD_ROWOPT_NO_ROW) continue;
    float *w = vals + rows[j] * stride;
    psd_rowopt_apply(o, w, w + d, g + j * d, scale);
  }
}
