/* average.c - moving averages of parameters (see average.h). */
#include "average.h"

#include <string.h>

#include "optimizer.h"

void psd_avg_start(const ps_optimizer *o, float *state, const float *param, size_t n) {
  float *a = psd_opt_average(o, state, n);
  if (a && n) memcpy(a, param, n * sizeof *a);
}

double psd_avg_rate(const ps_optimizer *o, uint64_t t) {
  if (!o || t == 0) return 0.0;
  switch (o->average) {
    case PS_AVERAGE_EMA:
      return 1.0 - o->average_decay;
    case PS_AVERAGE_EMA_NUM_UPDATES: {
      /* TF's ExponentialMovingAverage(decay, num_updates): early updates
       * weigh more, so the initial values fade within tens of steps rather
       * than thousands. */
      const double tt = (double)t, warm = (1.0 + tt) / (10.0 + tt);
      return 1.0 - (o->average_decay < warm ? o->average_decay : warm);
    }
    case PS_AVERAGE_POLYAK:
      return 1.0 / (double)t;
    default:
      return 0.0;
  }
}

/* TF's shadow update, a -= (1 - d) * (a - w), in float as its assign_sub
 * is; a rate of 1 (Polyak's first update) gives exactly w. */
static void average_pass(float *restrict a, const float *restrict w, float r, size_t n) {
  for (size_t i = 0; i < n; i++) a[i] -= r * (a[i] - w[i]);
}

void psd_avg_update(const ps_optimizer *o, uint64_t t, float *state, const float *param,
                    size_t n) {
  float *a = psd_opt_average(o, state, n);
  if (!a || n == 0) return;
  average_pass(a, param, (float)psd_avg_rate(o, t), n);
}
