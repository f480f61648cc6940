/*
 * optimizer_msg.h - the optimizer description both sides share: its
 * defaults and its codec between the public struct (ps_optimizer) and the
 * wire message (Ps__Optimizer, proto/ps.proto). Internal (ps__ names).
 */
#ifndef PS_WIRE_OPTIMIZER_MSG_H
#define PS_WIRE_OPTIMIZER_MSG_H

#include "ps.pb-c.h"
#include "psclient.h"

/* Fills m (initialized here) from o; m points into nothing of o's. */
void ps__opt_to_msg(const ps_optimizer *o, Ps__Optimizer *m);
/* Fills o (a full, sized struct) from m; a Register without an optimizer
 * (m NULL) gets the defaults: SGD at lr 0.01, as ps_optimizer_default. */
void ps__opt_from_msg(const Ps__Optimizer *m, ps_optimizer *o);

#endif /* PS_WIRE_OPTIMIZER_MSG_H */
