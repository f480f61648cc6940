/* optimizer_msg.c - the optimizer description both sides share: its
 * defaults (a variable registered without one gets SGD at lr 0.01 on the
 * server, exactly what ps_optimizer_default gives a worker). */
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
