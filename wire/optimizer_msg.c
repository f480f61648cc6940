/* optimizer_msg.c - the optimizer description both sides share: its
 * defaults (a variable registered without one gets SGD at lr 0.01 on the
 * server, exactly what ps_optimizer_default gives a worker) and its codec
 * to and from the wire message. */
#include <stdio.h>
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
  opt->warmup_steps = 0;
  opt->total_steps = 0;
  opt->min_lr_factor = 0.0;
  opt->mean_scale = 0.0;
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
  m->warmup_steps = o->warmup_steps;
  m->total_steps = o->total_steps;
  m->min_lr_factor = o->min_lr_factor;
  m->mean_scale = o->mean_scale;
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
  o->warmup_steps = m->warmup_steps;
  o->total_steps = m->total_steps;
  o->min_lr_factor = m->min_lr_factor;
  o->mean_scale = m->mean_scale;
}

int ps__opt_needs_2_1(const ps_optimizer *o) {
  return o->kind == PS_OPT_NONE || o->decay == PS_DECAY_COSINE || o->warmup_steps != 0;
}

int ps__opt_min_minor(const ps_optimizer *o) {
  if (o->kind == PS_OPT_MEAN) return 5;
  return ps__opt_needs_2_1(o) ? 1 : 0;
}

int ps__opt_has_rule(int kind) { return kind != PS_OPT_NONE && kind != PS_OPT_MEAN; }

const char *ps__opt_kind_name(int kind) {
  switch (kind) {
    case PS_OPT_SGD: return "sgd";
    case PS_OPT_MOMENTUM: return "momentum";
    case PS_OPT_ADAM: return "adam";
    case PS_OPT_NONE: return "none";
    case PS_OPT_MEAN: return "mean";
    default: return NULL;
  }
}

const char *ps__opt_decay_name(int decay) {
  switch (decay) {
    case PS_DECAY_NONE: return "none";
    case PS_DECAY_EXPONENTIAL: return "exponential";
    case PS_DECAY_STEP: return "step";
    case PS_DECAY_COSINE: return "cosine";
    default: return NULL;
  }
}

/* Field comparisons of ps__opt_diff: a differing field writes its name and
 * both values and makes the caller return 1. */
#define DIFF_D(field)                                                              \
  if (a->field != b->field) {                                                      \
    diff_double(buf, len, #field, a->field, al, b->field, bl);                     \
    return 1;                                                                      \
  }
#define DIFF_U(field)                                                              \
  if (a->field != b->field) {                                                      \
    snprintf(buf, len, #field " %llu (%s) vs %llu (%s)", (unsigned long long)a->field, \
             al, (unsigned long long)b->field, bl);                                \
    return 1;                                                                      \
  }

/* "name A vs B", short when %g tells the values apart, else with every
 * digit (0.1 vs 0.10000000000000002 must not read "0.1 vs 0.1"). */
static void diff_double(char *buf, size_t len, const char *name, double a, const char *al,
                        double b, const char *bl) {
  char x[32], y[32];
  snprintf(x, sizeof x, "%g", a);
  snprintf(y, sizeof y, "%g", b);
  if (strcmp(x, y) == 0) {
    snprintf(x, sizeof x, "%.17g", a);
    snprintf(y, sizeof y, "%.17g", b);
  }
  snprintf(buf, len, "%s %s (%s) vs %s (%s)", name, x, al, y, bl);
}

/* Names a kind or decay for ps__opt_diff: its name, or "unknown". */
static const char *or_unknown(const char *name) { return name ? name : "unknown"; }

int ps__opt_diff(const ps_optimizer *a, const char *al, const ps_optimizer *b, const char *bl,
                 char *buf, size_t len) {
  if (len) buf[0] = '\0';
  if (a->kind != b->kind) {
    snprintf(buf, len, "kind %s=%d (%s) vs %s=%d (%s)",
             or_unknown(ps__opt_kind_name((int)a->kind)), (int)a->kind, al,
             or_unknown(ps__opt_kind_name((int)b->kind)), (int)b->kind, bl);
    return 1;
  }
  if (a->kind == PS_OPT_MEAN) {
    DIFF_D(mean_scale)
    return 0;
  }
  if (!ps__opt_has_rule((int)a->kind)) return 0; /* no update rule: nothing else is used */
  DIFF_D(lr)
  DIFF_D(weight_decay)
  if (a->decay != b->decay) {
    snprintf(buf, len, "decay %s (%s) vs %s (%s)", or_unknown(ps__opt_decay_name((int)a->decay)),
             al, or_unknown(ps__opt_decay_name((int)b->decay)), bl);
    return 1;
  }
  if (a->decay == PS_DECAY_EXPONENTIAL || a->decay == PS_DECAY_STEP) {
    DIFF_D(decay_rate)
    DIFF_U(decay_steps)
  }
  if (a->decay == PS_DECAY_COSINE) {
    DIFF_U(total_steps)
    DIFF_D(min_lr_factor)
  }
  DIFF_U(warmup_steps)
  if (a->kind == PS_OPT_MOMENTUM) {
    DIFF_D(momentum)
    if (!a->nesterov != !b->nesterov) {
      snprintf(buf, len, "nesterov %s (%s) vs %s (%s)", a->nesterov ? "yes" : "no", al,
               b->nesterov ? "yes" : "no", bl);
      return 1;
    }
  }
  if (a->kind == PS_OPT_ADAM) {
    DIFF_D(beta1)
    DIFF_D(beta2)
    DIFF_D(epsilon)
  }
  return 0;
}
