/* optimizer_msg.c - the optimizer description both sides share: its
 * defaults (a variable registered without one gets SGD at lr 0.01 on the
 * server, exactly what ps_optimizer_default gives a worker) and its codec
 * to and from the wire message. */
#include <string.h>

#include "wire.h"

/* Defaults for the fields this library knows; a caller's struct of
 * another size gets zeros beyond them and its own struct_size. */
void ps_optimizer_default_sized(ps_optimizer *opt, size_t size, double lr) {
  if (!opt || size < sizeof opt->struct_size) return;
  memset(opt, 0, size);
  opt->struct_size = size;
  if (size < sizeof *opt) {
    /* An older caller: fill a full struct, hand back its prefix. */
    ps_optimizer full;
    ps_optimizer_default_sized(&full, sizeof full, lr);
    memcpy(opt, &full, size);
    opt->struct_size = size;
    return;
  }
  opt->kind = PS_OPT_SGD;
  opt->lr = lr;
  opt->momentum = 0.9;
  opt->nesterov = 0;
  opt->beta1 = 0.9;
  opt->beta2 = 0.999;
  opt->epsilon = 1e-8;
  opt->decay = PS_DECAY_NONE;
  opt->decay_rate = 1.0;
  opt->decay_steps = 0;
  opt->weight_decay = 0.0;
}

void ps__opt_to_msg(const ps_optimizer *o, Ps__Optimizer *m) {
  ps__optimizer__init(m);
  m->kind = (Ps__OptKind)o->kind;
  m->lr = o->lr;
  m->momentum = o->momentum;
  m->nesterov = o->nesterov != 0;
  m->beta1 = o->beta1;
  m->beta2 = o->beta2;
  m->epsilon = o->epsilon;
  m->decay = (Ps__LrDecay)o->decay;
  m->decay_rate = o->decay_rate;
  m->decay_steps = o->decay_steps;
  m->weight_decay = o->weight_decay;
}

void ps__opt_from_msg(const Ps__Optimizer *m, ps_optimizer *o) {
  ps_optimizer_default(o, 0.01);
  if (!m) return;
  o->kind = (ps_opt_kind)m->kind;
  o->lr = m->lr;
  o->momentum = m->momentum;
  o->nesterov = m->nesterov;
  o->beta1 = m->beta1;
  o->beta2 = m->beta2;
  o->epsilon = m->epsilon;
  o->decay = (ps_lr_decay)m->decay;
  o->decay_rate = m->decay_rate;
  o->decay_steps = m->decay_steps;
  o->weight_decay = m->weight_decay;
}
