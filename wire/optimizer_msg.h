/*
 * optimizer_msg.h - the optimizer description both sides share: its
 * defaults and its codec between the public struct (ps_optimizer) and the
 * wire message (Ps__Optimizer, proto/ps.proto). Internal (ps__ names).
 */
#ifndef PS_WIRE_OPTIMIZER_MSG_H
#define PS_WIRE_OPTIMIZER_MSG_H

#include "ps.pb-c.h"
#include "ps/errno.h"
#include "ps/types.h"

/* Fills m (initialized here) from o; m points into nothing of o's. */
void ps__opt_to_msg(const ps_optimizer *o, Ps__Optimizer *m);
/* Fills o (a full, sized struct) from m; a Register without an optimizer
 * (m NULL) gets the defaults: SGD at lr 0.01, as ps_optimizer_default. */
void ps__opt_from_msg(const Ps__Optimizer *m, ps_optimizer *o);
/* 1 if o uses what protocol 2.0 lacks (PS_OPT_NONE, cosine decay,
 * warm-up): a 2.0 server would refuse or, worse, ignore it. */
int ps__opt_needs_2_1(const ps_optimizer *o);
/* The protocol minor a server needs to run o: 0, 1 (2.1's additions), 5
 * (PS_OPT_MEAN), 6 (Adagrad, RMSProp, lr_scale, decoupled weight decay,
 * Adam's torch_epsilon), 7 (a moving average) or 8 (an aggregation rule). */
int ps__opt_min_minor(const ps_optimizer *o);
/* What in o needs that minor, for a message ("optimizer adagrad",
 * "decoupled weight decay"): "<it> needs protocol 2.6". */
const char *ps__opt_min_minor_what(const ps_optimizer *o);
/* Whether kind has an update rule that reads lr and the other fields
 * (not PS_OPT_NONE nor PS_OPT_MEAN). */
int ps__opt_has_rule(int kind);
/* "sgd", "momentum", "adam", "none", "mean", "adagrad", "rmsprop", or NULL
 * for an unknown kind. */
const char *ps__opt_kind_name(int kind);
/* "none", "ema", "ema_num_updates", "polyak", or NULL for an unknown
 * ps_average. */
const char *ps__opt_average_name(int average);
/* The learning-rate schedule's fields of o (decay, decay_rate,
 * decay_steps, warmup_steps, total_steps, min_lr_factor), for a variable
 * and for a table alike: 0, or PS_EINVAL with "WHAT FIELD must be ..." in
 * err. */
int ps__opt_check_schedule(const ps_optimizer *o, const char *what, char *err, size_t errlen);
/* "job", "all", "first", or NULL for an unknown ps_aggregate. */
const char *ps__opt_aggregate_name(int aggregate);
/* "none", "exponential", "step", "cosine", or NULL for an unknown decay. */
const char *ps__opt_decay_name(int decay);
/* Whether a and b are the same update rule, comparing exactly (==) only
 * the fields the rule uses (docs/protocol.md, section 7): 0 if they are,
 * else 1 with the first differing field and both values, each followed by
 * its label, in buf ("lr 0.1 (worker 1) vs 0.2 (worker 0)"). Shared so
 * that psd and the client name a conflict the same way. */
int ps__opt_diff(const ps_optimizer *a, const char *al, const ps_optimizer *b, const char *bl,
                 char *buf, size_t len);

#endif /* PS_WIRE_OPTIMIZER_MSG_H */
