/*
 * optimizer.h - the update rules psd applies to a slice once a step's
 * gradients are in. Pure functions over float arrays: no I/O, no state
 * beyond what the caller passes, so they are unit-tested against plain
 * reference implementations.
 */
#ifndef PSD_OPTIMIZER_H
#define PSD_OPTIMIZER_H

#include <stddef.h>
#include <stdint.h>

#include "ps/errno.h"
#include "ps/types.h"

/* Checks an optimizer configuration received from a worker. Returns 0, or
 * PS_EINVAL with a sentence naming the bad field in err. */
int psd_opt_validate(const ps_optimizer *o, char *err, size_t errlen);

/* Floats of optimizer state per parameter element: 0 (SGD), 1 (momentum),
 * 2 (Adam: m then v, each n long), 1 (Adagrad: the accumulator), 1 to 3
 * (RMSProp: the square average, then the momentum buffer if momentum > 0,
 * then the gradient average if centered); plus 1, last, for a moving
 * average (2.7). The average lives in the state so that checkpoints,
 * restores and memory accounting keep it with no code of their own. At
 * most PSD_OPT_MAX_STATE. */
size_t psd_opt_state_per_elem(const ps_optimizer *o);
#define PSD_OPT_MAX_STATE 4

/* The moving average inside state (n floats), or NULL when o keeps none;
 * average.h updates it. */
float *psd_opt_average(const ps_optimizer *o, float *state, size_t n);

/* Sets a new slice's state (psd_opt_state_per_elem(o) * n floats) to
 * where the rule starts: zeros, Adagrad's accumulator at
 * initial_accumulator. */
void psd_opt_state_init(const ps_optimizer *o, float *state, size_t n);

/* Learning rate in effect when applying update number `step` (0-based:
 * the update that moves the parameters from step to step+1), lr_scale
 * included. */
double psd_opt_lr(const ps_optimizer *o, uint64_t step);

/* Applies one update to param[0..n) in place.
 *   g = scale * (grad_a + grad_b) + weight_decay * param
 * (decoupled_weight_decay: param *= 1 - lr_t * weight_decay first, and g
 * has no L2 term). grad_b may be NULL (then g = scale * grad_a + ...).
 * scale is 1/k for the average of k gradients. state has
 * psd_opt_state_per_elem(o) * n floats, set by psd_opt_state_init before
 * the first update. `step` is as for psd_opt_lr (Adam's bias correction
 * uses t = step + 1). One pass over memory. */
void psd_opt_apply(const ps_optimizer *o, uint64_t step, float *param,
                   float *state, const float *grad_a, const float *grad_b,
                   float scale, size_t n);

/* Human-readable one-line description, for logs ("adam lr=0.001 ..."). */
void psd_opt_describe(const ps_optimizer *o, char *buf, size_t len);

#endif /* PSD_OPTIMIZER_H */
