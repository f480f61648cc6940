/*
 * ps/types.h - what a worker and a server agree on about a variable or a
 * table: the limits on names and shapes, the wire dtypes, the update rules
 * the servers run (ps_optimizer, with its schedules, averages and
 * aggregation), the initializers and the table rules. Shared by
 * libpsclient, the wire layer and psd.
 */
#ifndef PS_TYPES_H
#define PS_TYPES_H

#include <stddef.h>
#include <stdint.h>

#include "ps/export.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PS_MAX_DIMS 8     /* enough for any conv/attention weight */
#define PS_MAX_NAME 255   /* variable names are at most this many bytes */

/* How tensors travel (ps_config.push_dtype / pull_dtype,
 * ps_var_set_wire_dtype). Servers always keep float32 values and optimizer
 * state; a 16-bit dtype halves the bytes of a push (the gradient is rounded
 * before it is sent) or a pull (the server rounds the parameters it sends;
 * ps_var_data() then holds the rounded values, widened back to float32).
 * Rounding is to nearest even; NaN stays NaN; fp16 overflows to infinity
 * beyond 65504 and keeps subnormals down to 2^-24. Used only with servers
 * of protocol 2.3 or later: with an older server the same calls send and
 * receive float32. Sparse tables (ps_table_*) always use float32. Added in
 * 0.2.4. */
typedef enum ps_wire_dtype {
  PS_WIRE_F32 = 0,  /* float32, 4 bytes a value (the default) */
  PS_WIRE_BF16 = 1, /* bfloat16: float32's range, 8 significant bits */
  PS_WIRE_FP16 = 2  /* IEEE half: 11 significant bits, |x| <= 65504 */
} ps_wire_dtype;

/* ---------------------------------------------------------------------- */
/* Optimizers: run on the servers, configured per variable by the workers. */

typedef enum ps_opt_kind {
  PS_OPT_SGD = 0,      /* w -= lr * g */
  PS_OPT_MOMENTUM = 1, /* v = m*v + g; w -= lr*v (Nesterov: w -= lr*(g + m*v)) */
  PS_OPT_ADAM = 2,     /* Kingma & Ba, bias-corrected, TF's epsilon-hat form */
  PS_OPT_NONE = 3,     /* not trainable: no gradients, no learning rate; the
                          values change only by ps_client_var_assign (batch-norm
                          statistics, counters). Needs a psd of protocol 2.1. */
  PS_OPT_MEAN = 4,     /* no update rule: each step's gradients are averaged
                          with the sync semantics of any variable (replicas
                          to aggregate, backups, stale and duplicate pushes)
                          and the mean becomes the value the next pull
                          returns: for optimizers that run on the workers
                          (the torch.distributed backend). Only mean_scale
                          is used. Needs a psd of protocol 2.5;
                          added in 0.2.5. */
  PS_OPT_ADAGRAD = 5,  /* torch.optim.Adagrad: a += g^2 (a starts at
                          initial_accumulator); w -= lr * g / (sqrt(a) + eps).
                          Needs a psd of protocol 2.6; added in 0.2.6. */
  PS_OPT_RMSPROP = 6   /* torch.optim.RMSprop: s = alpha*s + (1-alpha)*g^2;
                          centered: c = alpha*c + (1-alpha)*g, s - c^2 for s;
                          d = sqrt(s) + eps; momentum > 0: b = momentum*b +
                          g/d, w -= lr*b; else w -= lr*g/d. It reads
                          `momentum`, which ps_optimizer_default sets to 0.9
                          for PS_OPT_MOMENTUM: set 0 for torch's default.
                          Needs a psd of protocol 2.6; added in 0.2.6. */
} ps_opt_kind;

typedef enum ps_lr_decay {
  PS_DECAY_NONE = 0,
  PS_DECAY_EXPONENTIAL = 1, /* lr * rate^(step / decay_steps) */
  PS_DECAY_STEP = 2,        /* lr * rate^floor(step / decay_steps) */
  PS_DECAY_COSINE = 3       /* lr * (f + (1 - f) * (1 + cos(pi * p)) / 2) with
                               p = (step - warmup_steps) / (total_steps - warmup_steps)
                               clamped to [0, 1] and f = min_lr_factor: from lr
                               at the end of the warm-up down to lr * f at
                               total_steps, constant after. Needs protocol 2.1. */
} ps_lr_decay;

/* A moving average of a variable's parameters that the servers keep beside
 * them (ps_optimizer.average; protocol 2.7, added in 0.2.7). It starts equal
 * to the initial values, is updated on the servers each time the
 * variable's step advances (an applied update, or the chief's assign that
 * replaces one), is kept in checkpoints, and travels only when asked for
 * (ps_client_pull_average): training steps send nothing more. With t the
 * number of updates applied, this one included, and w the new parameters: */
typedef enum ps_average {
  PS_AVERAGE_NONE = 0,            /* no average (the default) */
  PS_AVERAGE_EMA = 1,             /* a -= (1 - d) * (a - w), d = average_decay
                                     (TensorFlow's ExponentialMovingAverage) */
  PS_AVERAGE_EMA_NUM_UPDATES = 2, /* the same with d = min(average_decay,
                                     (1 + t) / (10 + t)): TF's num_updates form,
                                     given the global step after the update */
  PS_AVERAGE_POLYAK = 3           /* a += (w - a) / t: the mean of the
                                     parameters after each update so far
                                     (average_decay unused) */
} ps_average;

/* Which gradients complete a step of a variable (ps_optimizer.aggregate;
 * protocol 2.8, added in 0.2.8). Sync mode only: in async mode every
 * gradient is applied at once. */
typedef enum ps_aggregate {
  PS_AGGREGATE_JOB = 0,   /* the job's replicas_to_aggregate (the default):
                             with backup workers, the first N - K */
  PS_AGGREGATE_ALL = 1,   /* every worker's, backups or not: for values
                             that need each worker's part (an exact
                             all-gather); a lost worker stalls the variable
                             until its waiters' deadlines */
  PS_AGGREGATE_FIRST = 2  /* the first gradient of each step alone (a
                             broadcast: one worker pushes, the others pull
                             the step after it); later pushes for that step
                             are stale */
} ps_aggregate;

typedef struct ps_optimizer {
  size_t struct_size;   /* sizeof(ps_optimizer) as compiled by the caller:
                           set by ps_optimizer_init/ps_optimizer_default */
  ps_opt_kind kind;     /* which update rule */
  double lr;            /* base learning rate, > 0 */
  double momentum;      /* PS_OPT_MOMENTUM: coefficient in [0, 1) */
  int nesterov;         /* PS_OPT_MOMENTUM: nonzero for Nesterov momentum */
  double beta1;         /* PS_OPT_ADAM: first moment decay, default 0.9 */
  double beta2;         /* PS_OPT_ADAM: second moment decay, default 0.999 */
  double epsilon;       /* PS_OPT_ADAM, PS_OPT_ADAGRAD, PS_OPT_RMSPROP: default
                           1e-8 (torch's Adagrad uses 1e-10) */
  ps_lr_decay decay;    /* learning rate schedule */
  double decay_rate;    /* factor per decay_steps, in (0, 1] */
  uint64_t decay_steps; /* > 0 when decay != PS_DECAY_NONE */
  double weight_decay;  /* L2: the gradient gets weight_decay * w added
                           (decoupled_weight_decay: w shrinks instead) */
  /* Fields below were added in 0.2.1 (protocol 2.1); a server that speaks
   * only 2.0 refuses a variable that sets them (PS_EUNSUPPORTED). */
  uint64_t warmup_steps; /* linear warm-up: while step < warmup_steps the
                            scheduled lr is scaled by (step + 1) / warmup_steps
                            (any decay); 0: none */
  uint64_t total_steps;  /* PS_DECAY_COSINE: the step at which the lr reaches
                            lr * min_lr_factor; > warmup_steps */
  double min_lr_factor;  /* PS_DECAY_COSINE: the final lr as a fraction of lr,
                            in [0, 1]; default 0 */
  /* Added in 0.2.5 (protocol 2.5; a program built before it gets 0). */
  double mean_scale;     /* PS_OPT_MEAN: the value becomes mean_scale times
                            the step's mean gradient, in one pass on the
                            servers (the number of workers gives the sum);
                            0 (the default) means 1; finite and > 0 else */
  /* Added in 0.2.6 (protocol 2.6; a program built before it gets 0). A
   * server older than 2.6 refuses a variable that sets any of them, or
   * uses PS_OPT_ADAGRAD or PS_OPT_RMSPROP (PS_EUNSUPPORTED naming it). */
  double lr_scale;       /* every rule: the variable's learning rate is lr_t *
                            lr_scale (schedules and warm-up included), e.g. a
                            layer trained slower; 0 (the default) means 1;
                            finite and > 0 else */
  double initial_accumulator; /* PS_OPT_ADAGRAD: where the accumulator starts
                                 (torch's initial_accumulator_value), >= 0;
                                 default 0 */
  double alpha;          /* PS_OPT_RMSPROP: the square average's decay
                            (torch's alpha), in [0, 1); default 0.99 */
  int centered;          /* PS_OPT_RMSPROP: nonzero divides by the variance
                            estimate (the square average minus the mean
                            gradient's square) instead */
  /* Decoupled weight decay is a flag on weight_decay rather than a kind
   * (an "AdamW"): it composes with every rule alike (AdamW, SGDW, Adagrad
   * or RMSProp with it), keeps the rule's state layout, and a variable's
   * decay stays one number, set per variable (0 for biases and norms). */
  int decoupled_weight_decay; /* nonzero: w -= lr_t * weight_decay * w before
                                 the rule, which sees the gradient alone
                                 (torch.optim.AdamW, Loshchilov & Hutter);
                                 0: L2 added to the gradient */
  int torch_epsilon;     /* PS_OPT_ADAM: nonzero puts epsilon where
                            torch.optim.Adam does, w -= lr_t/(1-b1^t) * m /
                            (sqrt(v)/sqrt(1-b2^t) + eps); 0 (the default):
                            TensorFlow's epsilon-hat, w -= lr_t*sqrt(1-b2^t)/
                            (1-b1^t) * m / (sqrt(v) + eps) */
  /* Added in 0.2.7 (protocol 2.7; a program built before it gets 0: no
   * average). A server older than 2.7 refuses a variable with an average
   * (PS_EUNSUPPORTED naming it). Any kind may have one. */
  ps_average average;    /* the moving average the servers keep */
  double average_decay;  /* PS_AVERAGE_EMA and _EMA_NUM_UPDATES: the decay, in
                            [0, 1), e.g. 0.999 (TF's CIFAR-10 uses 0.9999);
                            default 0 */
  /* Added in 0.2.8 (protocol 2.8; a program built before it gets 0: the
   * job's rule). A server older than 2.8 refuses a variable that sets it
   * (PS_EUNSUPPORTED naming it). Any trainable kind, PS_OPT_MEAN included. */
  ps_aggregate aggregate; /* which gradients complete a step */
} ps_optimizer;

/* Fills *opt (size bytes, struct_size included) with plain SGD at
 * learning rate lr and Adam's usual betas. Call it through
 * ps_optimizer_default or ps_optimizer_init, which pass the size. */
PS_EXTERN void ps_optimizer_default_sized(ps_optimizer *opt, size_t size, double lr);
/* SGD at learning rate lr (other fields: Adam's usual betas, no decay). */
static inline void ps_optimizer_default(ps_optimizer *opt, double lr) {
  ps_optimizer_default_sized(opt, sizeof *opt, lr);
}
/* The defaults a NULL optimizer gets: SGD at lr 0.01. */
static inline void ps_optimizer_init(ps_optimizer *opt) {
  ps_optimizer_default_sized(opt, sizeof *opt, 0.01);
}

/* ---------------------------------------------------------------------- */
/* Initializers: only the chief (worker 0) runs them; the others wait for
 * the chief's values. Seeded, so any worker would compute the same ones. */

typedef enum ps_init_kind {
  PS_INIT_ZEROS = 0,
  PS_INIT_CONSTANT = 1,         /* every element = a */
  PS_INIT_UNIFORM = 2,          /* U[a, b) */
  PS_INIT_NORMAL = 3,           /* N(mean a, stddev b) */
  PS_INIT_TRUNCATED_NORMAL = 4, /* N(a, b) redrawn beyond 2 stddev */
  PS_INIT_GLOROT_UNIFORM = 5,   /* U(+-sqrt(6/(fan_in+fan_out))) */
  PS_INIT_GLOROT_NORMAL = 6     /* truncated N(0, sqrt(2/(fan_in+fan_out))) */
} ps_init_kind;

typedef struct ps_init {
  size_t struct_size; /* sizeof(ps_init) as compiled by the caller (ps_init_init) */
  ps_init_kind kind;  /* distribution */
  double a;          /* constant value, uniform low bound or normal mean */
  double b;          /* uniform high bound or normal stddev */
  uint64_t seed;     /* combined with the variable name: names differ, draws differ */
} ps_init;

/* The largest ps_table_config.admit_count: the servers count sightings in
 * 8-bit counters, which saturate. */
#define PS_TABLE_MAX_ADMIT_COUNT 255u

typedef enum ps_table_opt {
  PS_TOPT_SGD = 0,     /* w -= lr * g */
  PS_TOPT_ADAGRAD = 1, /* a += g*g; w -= lr * g / (sqrt(a) + epsilon); a
                          starts at initial_accumulator */
  PS_TOPT_ADAM = 2,    /* lazy Adam: m, v and the step t per row, advanced
                          only when the row gets a gradient; bias-corrected,
                          TF's epsilon-hat form as PS_OPT_ADAM */
  PS_TOPT_FTRL = 3     /* FTRL-proximal (McMahan et al. 2013) per element:
                          n += g*g, z += g - (sqrt(n) - sqrt(n_old)) / lr * w,
                          w = |z| <= l1 ? 0 : -(z - sign(z) l1) /
                          ((ftrl_beta + sqrt(n)) / lr + l2). Rows start from
                          the initializer; the first update replaces them
                          by the FTRL solution (use zeros, as usual) */
} ps_table_opt;

#ifdef __cplusplus
}
#endif

#endif /* PS_TYPES_H */
