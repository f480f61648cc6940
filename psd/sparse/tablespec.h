/*
 * tablespec.h - what defines a sparse table (the spec every worker must
 * send alike), what a spec may hold (psd_tablespec_check), how two specs
 * differ (psd_tablespec_diff), its learning-rate schedule as a
 * ps_optimizer's, and the key-order check of pulls and pushes. Below
 * table.h, rowopt.h and rowinit.h, which all take a spec.
 */
#ifndef PSD_TABLESPEC_H
#define PSD_TABLESPEC_H

#include <stddef.h>
#include <stdint.h>

#include "ps/errno.h"
#include "ps/types.h"

/* What defines a table; every worker must send the same (psd_tablespec_diff). */
typedef struct psd_table_spec {
  char name[256];             /* table name (PS_MAX_NAME bytes + NUL) */
  uint32_t dim;               /* floats per row, 1..PS__MAX_TABLE_DIM */
  uint64_t capacity;          /* most rows on THIS ps, 1..PSD_TABLE_MAX_ROWS */
  uint32_t init_kind;         /* ps_init_kind: ZEROS, CONSTANT, UNIFORM,
                                 NORMAL, TRUNCATED_NORMAL */
  double init_a, init_b;      /* the distribution's parameters (ps_init) */
  uint64_t init_seed;         /* with name and key, seeds a row's values */
  uint32_t opt;               /* ps_table_opt */
  double lr;                  /* learning rate, > 0 */
  double initial_accumulator; /* ADAGRAD: accumulator of a new row, >= 0 */
  double beta1, beta2;        /* ADAM: moment decays in [0, 1) */
  double epsilon;             /* ADAM, ADAGRAD: > 0 */
  double l1, l2;              /* FTRL: regularization, >= 0 */
  double ftrl_beta;           /* FTRL: beta, >= 0 */
  uint32_t admit_count;       /* sightings before a key is stored (<= 1: first),
                                 at most PS_TABLE_MAX_ADMIT_COUNT */
  double admit_prob;          /* or probability per sighting, in [0, 1] (0: off) */
  uint64_t evict_after_steps; /* evict rows untouched this many steps (0: never) */
  /* The learning-rate schedule (2.8): ps_optimizer's fields, over the
   * table's step (not with FTRL). Not kept in checkpoints: a resumed job
   * runs the schedule its workers give, as for dense variables. */
  uint32_t decay;             /* ps_lr_decay */
  double decay_rate;
  uint64_t decay_steps, warmup_steps, total_steps;
  double min_lr_factor;
} psd_table_spec;

/* Most rows one ps holds of one table: row numbers are uint32 with
 * UINT32_MAX as "no row", and 2^31 rows (32 GiB at dim 1 and up) is far
 * beyond one server's memory at any useful dim. */
#define PSD_TABLE_MAX_ROWS ((uint64_t)1 << 31)

/* The schedule fields of s as a ps_optimizer's (lr and kind SGD too), for
 * psd_opt_validate and psd_opt_lr. */
void psd_tablespec_schedule(const psd_table_spec *s, ps_optimizer *o);
/* Whether s has a schedule (a decay or a warm-up). */
int psd_tablespec_has_schedule(const psd_table_spec *s);
/* Copies src's schedule into dst (a checkpoint's spec, which keeps none). */
void psd_tablespec_take_schedule(psd_table_spec *dst, const psd_table_spec *src);

/* Checks a spec (ranges above); 0 or PS_EINVAL with a sentence naming the
 * field and its value in err. */
int psd_tablespec_check(const psd_table_spec *spec, char *err, size_t errlen);

/* Nonzero when a and b differ in a field that matters for their rule or
 * initializer (as ps__opt_diff for variables): err gets "FIELD is X for
 * who_a, Y for who_b". */
int psd_tablespec_diff(const psd_table_spec *a, const char *who_a, const psd_table_spec *b,
                       const char *who_b, char *err, size_t errlen);

/* Checks that keys[0..n) are strictly ascending; 0 or PS_EINVAL with the
 * first offending position in err. (The ps-ownership check is the
 * caller's: it knows num_ps and its index.) */
int psd_tablespec_keys_check(const uint64_t *keys, size_t n, char *err, size_t errlen);

#endif
