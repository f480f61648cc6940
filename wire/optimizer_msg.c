/* optimizer_msg.c - the optimizer description both sides share: its
 * defaults (a variable registered without one gets SGD at lr 0.01 on the
 * server, exactly what ps_optimizer_default gives a worker). */
#include <string.h>

#include "wire.h"

void ps_optimizer_default(ps_optimizer *opt, double lr) {
  if (!opt) return;
  memset(opt, 0, sizeof *opt);
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
