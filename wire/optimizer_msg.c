/* optimizer_msg.c - the optimizer description both sides share: its
 * defaults (a variable registered without one gets SGD at lr 0.01 on the
 * server, exactly what ps_optimizer_default gives a worker) and its codec
 * to and from the wire message. */
#include <inttypes.h>
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
  opt->lr_scale = 0.0;
  opt->initial_accumulator = 0.0;
  opt->alpha = 0.99;
  opt->centered = 0;
  opt->decoupled_weight_decay = 0;
  opt->torch_epsilon = 0;
  opt->average = PS_AVERAGE_NONE;
  opt->average_decay = 0.0;
  opt->aggregate = PS_AGGREGATE_JOB;
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
  m->lr_scale = o->lr_scale;
  m->initial_accumulator = o->initial_accumulator;
  m->alpha = o->alpha;
  m->centered = o->centered != 0;
  m->decoupled_weight_decay = o->decoupled_weight_decay != 0;
  m->torch_epsilon = o->torch_epsilon != 0;
  m->average = (Ps__Average)o->average;
  m->average_decay = o->average_decay;
  m->aggregate = (Ps__Aggregate)o->aggregate;
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
  o->lr_scale = m->lr_scale;
  o->initial_accumulator = m->initial_accumulator;
  o->alpha = m->alpha;
  o->centered = m->centered;
  o->decoupled_weight_decay = m->decoupled_weight_decay;
  o->torch_epsilon = m->torch_epsilon;
  o->average = (int)m->average;
  o->average_decay = m->average_decay;
  o->aggregate = (int)m->aggregate;
}

int ps__opt_needs_2_1(const ps_optimizer *o) {
  return o->kind == PS_OPT_NONE || o->decay == PS_DECAY_COSINE || o->warmup_steps != 0;
}

/* A 2.5 server would ignore these fields (protobuf skips unknown ones)
 * and train with another rule than the one asked for, or refuse the
 * kind with a number for a name. lr_scale 1 is what it would do anyway. */
static int needs_2_6(const ps_optimizer *o) {
  return o->kind == PS_OPT_ADAGRAD || o->kind == PS_OPT_RMSPROP ||
         (o->lr_scale != 0.0 && o->lr_scale != 1.0) || o->decoupled_weight_decay ||
         (o->kind == PS_OPT_ADAM && o->torch_epsilon);
}

int ps__opt_min_minor(const ps_optimizer *o) {
  /* A 2.7 server would aggregate by the job's rule unseen. */
  if (o->aggregate != PS_AGGREGATE_JOB) return 8;
  /* A 2.6 server would drop the average unseen and refuse its pulls. */
  if (o->average != PS_AVERAGE_NONE) return 7;
  if (needs_2_6(o)) return 6;
  if (o->kind == PS_OPT_MEAN) return 5;
  return ps__opt_needs_2_1(o) ? 1 : 0;
}

const char *ps__opt_min_minor_what(const ps_optimizer *o) {
  switch (ps__opt_min_minor(o)) {
    case 8: return "an aggregation rule of its own (optimizer aggregate)";
    case 7: return "a moving average (optimizer average)";
    case 6:
      if (o->kind == PS_OPT_ADAGRAD) return "optimizer adagrad";
      if (o->kind == PS_OPT_RMSPROP) return "optimizer rmsprop";
      if (o->decoupled_weight_decay) return "decoupled weight decay";
      if (o->kind == PS_OPT_ADAM && o->torch_epsilon) return "adam's torch_epsilon";
      return "lr_scale";
    case 5: return "optimizer kind mean";
    case 1: return "optimizer kind none, cosine decay or warm-up";
    default: return "this optimizer";
  }
}

int ps__opt_has_rule(int kind) { return kind != PS_OPT_NONE && kind != PS_OPT_MEAN; }

const char *ps__opt_kind_name(int kind) {
  switch (kind) {
    case PS_OPT_SGD: return "sgd";
    case PS_OPT_MOMENTUM: return "momentum";
    case PS_OPT_ADAM: return "adam";
    case PS_OPT_NONE: return "none";
    case PS_OPT_MEAN: return "mean";
    case PS_OPT_ADAGRAD: return "adagrad";
    case PS_OPT_RMSPROP: return "rmsprop";
    default: return NULL;
  }
}

const char *ps__opt_average_name(int average) {
  switch (average) {
    case PS_AVERAGE_NONE: return "none";
    case PS_AVERAGE_EMA: return "ema";
    case PS_AVERAGE_EMA_NUM_UPDATES: return "ema_num_updates";
    case PS_AVERAGE_POLYAK: return "polyak";
    default: return NULL;
  }
}

int ps__opt_check_schedule(const ps_optimizer *o, const char *what, char *err, size_t errlen) {
  const char *dn = ps__opt_decay_name((int)o->decay);
  if (!dn)
    return ps__errf(PS_EINVAL, err, errlen,
                    "%s decay must be %d (none), %d (exponential), %d (step) or %d (cosine), "
                    "got %d",
                    what, PS_DECAY_NONE, PS_DECAY_EXPONENTIAL, PS_DECAY_STEP, PS_DECAY_COSINE,
                    (int)o->decay);
  if (o->decay == PS_DECAY_COSINE) {
    if (o->total_steps <= o->warmup_steps)
      return ps__errf(PS_EINVAL, err, errlen,
                      "%s total_steps must be > warmup_steps (%" PRIu64
                      ") with cosine decay, got %" PRIu64,
                      what, o->warmup_steps, o->total_steps);
    if (!(o->min_lr_factor >= 0.0 && o->min_lr_factor <= 1.0))
      return ps__errf(PS_EINVAL, err, errlen,
                      "%s min_lr_factor must be in [0, 1] with cosine decay, got %g", what,
                      o->min_lr_factor);
  } else if (o->decay != PS_DECAY_NONE) {
    if (!(o->decay_rate > 0.0 && o->decay_rate <= 1.0))
      return ps__errf(PS_EINVAL, err, errlen,
                      "%s decay_rate must be in (0, 1] with %s decay, got %g", what, dn,
                      o->decay_rate);
    if (o->decay_steps == 0)
      return ps__errf(PS_EINVAL, err, errlen,
                      "%s decay_steps must be > 0 with %s decay, got 0", what, dn);
  }
  return 0;
}

const char *ps__opt_aggregate_name(int aggregate) {
  switch (aggregate) {
    case PS_AGGREGATE_JOB: return "job";
    case PS_AGGREGATE_ALL: return "all";
    case PS_AGGREGATE_FIRST: return "first";
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

#define DIFF_FLAG(field)                                                           \
  if (!a->field != !b->field) {                                                    \
    snprintf(buf, len, #field " %s (%s) vs %s (%s)", a->field ? "yes" : "no", al,   \
             b->field ? "yes" : "no", bl);                                         \
    return 1;                                                                      \
  }

/* lr_scale as it applies: 0 means 1. */
static double lr_scale_of(const ps_optimizer *o) { return o->lr_scale == 0.0 ? 1.0 : o->lr_scale; }

/* ps__opt_diff's fields of Adagrad and RMSProp (2.6). */
static int rule_diff(const ps_optimizer *a, const char *al, const ps_optimizer *b,
                     const char *bl, char *buf, size_t len) {
  if (a->kind == PS_OPT_ADAGRAD) {
    DIFF_D(initial_accumulator)
    DIFF_D(epsilon)
  }
  if (a->kind == PS_OPT_RMSPROP) {
    DIFF_D(alpha)
    DIFF_D(epsilon)
    DIFF_D(momentum)
    DIFF_FLAG(centered)
  }
  return 0;
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
  /* The rule that completes a step (2.8): workers that disagree would
   * wait for different sets of gradients. */
  if (a->aggregate != b->aggregate) {
    snprintf(buf, len, "aggregate %s (%s) vs %s (%s)",
             or_unknown(ps__opt_aggregate_name(a->aggregate)), al,
             or_unknown(ps__opt_aggregate_name(b->aggregate)), bl);
    return 1;
  }
  if (a->kind == PS_OPT_MEAN) {
    DIFF_D(mean_scale)
    return 0;
  }
  /* The average (2.7) applies to every kind: a second worker must not
   * silently read another average than the one it asked for. */
  if (a->average != b->average) {
    snprintf(buf, len, "average %s (%s) vs %s (%s)", or_unknown(ps__opt_average_name(a->average)),
             al, or_unknown(ps__opt_average_name(b->average)), bl);
    return 1;
  }
  if (a->average == PS_AVERAGE_EMA || a->average == PS_AVERAGE_EMA_NUM_UPDATES) {
    DIFF_D(average_decay)
  }
  if (!ps__opt_has_rule((int)a->kind)) return 0; /* no update rule: nothing else is used */
  DIFF_D(lr)
  DIFF_D(weight_decay)
  DIFF_FLAG(decoupled_weight_decay)
  if (lr_scale_of(a) != lr_scale_of(b)) {
    diff_double(buf, len, "lr_scale", lr_scale_of(a), al, lr_scale_of(b), bl);
    return 1;
  }
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
    DIFF_FLAG(nesterov)
  }
  if (a->kind == PS_OPT_ADAM) {
    DIFF_D(beta1)
    DIFF_D(beta2)
    DIFF_D(epsilon)
    DIFF_FLAG(torch_epsilon)
  }
  return rule_diff(a, al, b, bl, buf, len);
}
