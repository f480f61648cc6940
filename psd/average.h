/*
 * average.h - the moving averages of parameters psd keeps beside them
 * (ps_optimizer.average, protocol 2.7): TensorFlow's
 * ExponentialMovingAverage (with or without its num_updates warm-up) and a
 * running Polyak mean. The average is the last float of the slice's
 * optimizer state (psd_opt_average), so checkpoints keep it unasked;
 * shard.c starts it at the initial values and updates it each time the
 * slice's step advances. Pure functions over float arrays, unit-tested
 * against a double reference (test_average.c).
 */
#ifndef PSD_AVERAGE_H
#define PSD_AVERAGE_H

#include <stddef.h>
#include <stdint.h>

#include "ps/errno.h"
#include "ps/types.h"

/* Starts o's average inside state at the initial values (TF's
 * ExponentialMovingAverage does too): param is n floats. No-op without an
 * average. */
void psd_avg_start(const ps_optimizer *o, float *state, const float *param, size_t n);

/* The average's weight of the new parameters at update t (the number of
 * updates applied, this one included, >= 1): 1 - average_decay (EMA), 1 -
 * min(average_decay, (1 + t) / (10 + t)) (num_updates form), 1 / t
 * (Polyak); 0 without an average (or t 0). In double; the pass uses it as
 * a float. */
double psd_avg_rate(const ps_optimizer *o, uint64_t t);

/* Folds the parameters after update t (param, n floats) into o's average
 * inside state: a -= rate * (a - w), one pass. No-op without an average. */
void psd_avg_update(const ps_optimizer *o, uint64_t t, float *state, const float *param,
                    size_t n);

#endif /* PSD_AVERAGE_H */
