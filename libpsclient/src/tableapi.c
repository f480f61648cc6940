/* tableapi.c - sparse embedding tables (protocol 2.2): the configuration
 * (a sized struct, checked here so a bad field is named before anything is
 * sent), creation on every ps at once, lookups, the gradients staged for
 * ps_client_step, and the public pull and push calls. The frames and their
 * replies are tablexfer.c's. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

/* The first layout of ps_table_config ends with evict_after_steps. */
#define PS__TABLE_CONFIG_V1_SIZE (offsetof(ps_table_config, evict_after_steps) + sizeof(uint64_t))
/* Rule defaults of epsilon, which ps_table_config_init leaves at 0. */
#define PS__TABLE_ADAM_EPSILON 1e-8
#define PS__TABLE_ADAGRAD_EPSILON 1e-7

void ps_table_config_init_sized(ps_table_config *cfg, size_t size) {
  if (!cfg || size < sizeof cfg->struct_size) return;
  ps_table_config d;
  memset(&d, 0, sizeof d);
  ps_init_init(&d.init); /* zeros, seed 0 */
  d.opt = PS_TOPT_SGD;
  d.lr = 0.01;
  d.initial_accumulator = 0.1;
  d.beta1 = 0.9;
  d.beta2 = 0.999;
  d.epsilon = 0; /* the rule's default (1e-8 Adam, 1e-7 Adagrad) */
  d.ftrl_beta = 1.0;
  memset(cfg, 0, size);
  memcpy(cfg, &d, size < sizeof d ? size : sizeof d);
  cfg->struct_size = size;
}

void ps__tables_free(ps_client *c) {
  for (size_t i = 0; i < c->ntables; i++) {
    ps_table *t = c->tables[i];
    free(t->name);
    free(t->ids);
    free(t->seen_step);
    free(t->kept);
    free(t->memo_req);
    free(t->skeys);
    free(t->sgrads);
    free(t->kp);
    free(t->pbuf);
    free(t->pfirst);
    free(t->pheld);
    free(t);
  }
  free(c->tables);
  free(c->kp_tmp);
  free(c->kgrp);
}

/* c's table called name, or NULL. */
static ps_table *find_table(const ps_client *c, const char *name) {
  for (size_t i = 0; i < c->ntables; i++)
    if (strcmp(c->tables[i]->name, name) == 0) return c->tables[i];
  return NULL;
}

ps_table *ps_client_table_find(ps_client *c, const char *name) {
  if (!c) return NULL;
  ps_table *t = name ? find_table(c, name) : NULL;
  if (!t) ps__seterr(c, PS_ENOTFOUND, "this client has no table '%s'", name ? name : "(null)");
  return t;
}

const char *ps_table_name(const ps_table *t) { return t ? t->name : NULL; }
uint32_t ps_table_dim(const ps_table *t) { return t ? t->cfg.dim : 0; }

/* ---- the configuration --------------------------------------------------- */

/* The initializer's fields: a row has no fans, so no Glorot. */
static int check_init(ps_client *c, const char *name, const ps_init *in) {
  double a = in->a, b = in->b;
  switch (in->kind) {
  case PS_INIT_ZEROS: return 0;
  case PS_INIT_CONSTANT:
    if (isfinite(a)) return 0;
    return ps__seterr(c, PS_EINVAL, "table '%s': init.a %g must be finite", name, a);
  case PS_INIT_UNIFORM:
    if (isfinite(a) && isfinite(b) && a < b) return 0;
    return ps__seterr(c, PS_EINVAL, "table '%s': a uniform init needs finite init.a < init.b "
                      "(got %g, %g)", name, a, b);
  case PS_INIT_NORMAL:
  case PS_INIT_TRUNCATED_NORMAL:
    if (isfinite(a) && isfinite(b) && b > 0) return 0;
    return ps__seterr(c, PS_EINVAL, "table '%s': a normal init needs a finite init.a and a "
                      "stddev init.b > 0 (got %g, %g)", name, a, b);
  case PS_INIT_GLOROT_UNIFORM:
  case PS_INIT_GLOROT_NORMAL:
    return ps__seterr(c, PS_EINVAL, "table '%s': init.kind %d is a Glorot initializer, but a "
                      "row has no fan-in or fan-out: use ZEROS, CONSTANT, UNIFORM, NORMAL or "
                      "TRUNCATED_NORMAL", name, (int)in->kind);
  default:
    return ps__seterr(c, PS_EINVAL, "table '%s': init.kind %d is not a ps_init_kind", name,
                      (int)in->kind);
  }
}

/* One double field: not NaN, and when the rule uses it, finite and in
 * [lo, hi] (hi_open: below hi; lo_open: above lo). */
static int check_num(ps_client *c, const char *name, const char *field, double v, int used,
                     double lo, int lo_open, double hi, int hi_open) {
  if (isnan(v))
    return ps__seterr(c, PS_EINVAL, "table '%s': %s is NaN", name, field);
  if (!used) return 0;
  if (isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi)) return 0;
  return ps__seterr(c, PS_EINVAL, "table '%s': %s %g must be in %c%g, %g%c", name, field, v,
                    lo_open ? '(' : '[', lo, hi, hi_open ? ')' : ']');
}

/* Whether g sets a learning-rate schedule (0.2.8). */
static int has_schedule(const ps_table_config *g) {
  return g->decay != PS_DECAY_NONE || g->warmup_steps != 0;
}

/* g's schedule as the ps_optimizer fields it shares them with. */
static void schedule_of(const ps_table_config *g, ps_optimizer *o) {
  ps_optimizer_default(o, g->lr);
  o->decay = g->decay;
  o->decay_rate = g->decay_rate;
  o->decay_steps = g->decay_steps;
  o->warmup_steps = g->warmup_steps;
  o->total_steps = g->total_steps;
  o->min_lr_factor = g->min_lr_factor;
}

/* The learning-rate schedule (0.2.8), checked as a variable's is. */
static int check_schedule(ps_client *c, const char *name, const ps_table_config *g) {
  if (!has_schedule(g)) return 0;
  if (g->opt == PS_TOPT_FTRL)
    return ps__seterr(c, PS_EINVAL, "table '%s': FTRL takes no learning-rate schedule (its "
                      "rate is per element): leave decay and warmup_steps at 0", name);
  ps_optimizer o;
  schedule_of(g, &o);
  char e[300];
  int rc = ps__opt_check_schedule(&o, "", e, sizeof e);
  return rc ? ps__seterr(c, rc, "table '%s':%s", name, e) : 0;
}

/* The spec the servers would accept: a sentence naming the field if not. */
static int check_config(ps_client *c, const char *name, const ps_table_config *g) {
  if (g->dim < 1 || g->dim > PS__MAX_TABLE_DIM)
    return ps__seterr(c, PS_EINVAL, "table '%s': dim %u must be 1 to %u", name, g->dim,
                      PS__MAX_TABLE_DIM);
  if (g->capacity == 0)
    return ps__seterr(c, PS_EINVAL, "table '%s': capacity must be > 0 (rows of the whole "
                      "table)", name);
  if ((unsigned)g->opt > PS_TOPT_FTRL)
    return ps__seterr(c, PS_EINVAL, "table '%s': opt %d is not a ps_table_opt", name,
                      (int)g->opt);
  int rc = check_init(c, name, &g->init);
  int ada = g->opt == PS_TOPT_ADAGRAD, adam = g->opt == PS_TOPT_ADAM,
      ftrl = g->opt == PS_TOPT_FTRL;
  const double inf = INFINITY;
  /* lr and epsilon are used as floats: positive normal floats only (a
   * smaller double is 0 there, and epsilon 0 makes 0/0 rows). */
  if (!rc) rc = check_num(c, name, "lr", g->lr, 1, FLT_MIN, 0, FLT_MAX, 0);
  if (!rc) rc = check_num(c, name, "initial_accumulator", g->initial_accumulator, ada, 0, 0, inf, 1);
  if (!rc) rc = check_num(c, name, "beta1", g->beta1, adam, 0, 0, 1, 1);
  if (!rc) rc = check_num(c, name, "beta2", g->beta2, adam, 0, 0, 1, 1);
  if (!rc) rc = check_num(c, name, "epsilon", g->epsilon, ada || adam, FLT_MIN, 0, FLT_MAX, 0);
  if (!rc) rc = check_num(c, name, "l1", g->l1, ftrl, 0, 0, inf, 1);
  if (!rc) rc = check_num(c, name, "l2", g->l2, ftrl, 0, 0, inf, 1);
  if (!rc) rc = check_num(c, name, "ftrl_beta", g->ftrl_beta, ftrl, 0, 0, inf, 1);
  if (!rc) rc = check_num(c, name, "admit_prob", g->admit_prob, 1, 0, 0, 1, 0);
  if (!rc && g->admit_count > PS_TABLE_MAX_ADMIT_COUNT)
    rc = ps__seterr(c, PS_EINVAL, "table '%s': admit_count %u must be at most %u (the "
                    "servers count sightings in 8 bits)", name, g->admit_count,
                    PS_TABLE_MAX_ADMIT_COUNT);
  if (!rc) rc = check_schedule(c, name, g);
  return rc;
}

/* The caller's config in the library's layout, defaults resolved and
 * checked into *g. */
static int read_config(ps_client *c, const char *name, const ps_table_config *user,
                       ps_table_config *g) {
  char e[300];
  ps_table_config_init(g);
  int rc = ps__sized_read(g, sizeof *g, user, PS__TABLE_CONFIG_V1_SIZE, "ps_table_config", e,
                          sizeof e);
  if (rc) return ps__seterr(c, rc, "table '%s': %s", name, e);
  /* The initializer is embedded: its size is part of this struct's layout. */
  if (g->init.struct_size != sizeof(ps_init))
    return ps__seterr(c, PS_EINVAL,
                      "table '%s': init.struct_size is %zu, not sizeof(ps_init) %zu: set "
                      "init with ps_init_init() or PS_SIZED(ps_init, ...) (ps_table_config_"
                      "init does)", name, g->init.struct_size, sizeof(ps_init));
  if (g->epsilon == 0)
    g->epsilon = g->opt == PS_TOPT_ADAGRAD ? PS__TABLE_ADAGRAD_EPSILON : PS__TABLE_ADAM_EPSILON;
  if (g->admit_count == 0) g->admit_count = 1; /* 0 and 1: at the first sighting */
  return check_config(c, name, g);
}

/* "FIELD A (the first create) vs B (this call)": %g, or all 17 digits
 * when %g shows the two alike. */
static void diff_double(char *buf, size_t len, const char *field, double a, double b) {
  char sa[40], sb[40];
  snprintf(sa, sizeof sa, "%g", a);
  snprintf(sb, sizeof sb, "%g", b);
  if (strcmp(sa, sb) == 0) {
    snprintf(sa, sizeof sa, "%.17g", a);
    snprintf(sb, sizeof sb, "%.17g", b);
  }
  snprintf(buf, len, "%s %s (the first create) vs %s (this call)", field, sa, sb);
}

/* The first field two configs differ in, as the servers compare them
 * (only what the rule and the initializer use): 0, or 1 with "FIELD A
 * (the first create) vs B (this call)" in buf. */
static int config_diff(const ps_table_config *a, const ps_table_config *b, char *buf,
                       size_t len) {
#define DIFF_U(f, cond)                                                                   \
  if ((cond) && a->f != b->f) {                                                           \
    snprintf(buf, len, #f " %llu (the first create) vs %llu (this call)",                 \
             (unsigned long long)a->f, (unsigned long long)b->f);                         \
    return 1;                                                                             \
  }
#define DIFF_D(f, cond)                                                                   \
  if ((cond) && a->f != b->f) {                                                           \
    diff_double(buf, len, #f, a->f, b->f);                                                \
    return 1;                                                                             \
  }
  int k = a->init.kind, ab = k == PS_INIT_UNIFORM || k == PS_INIT_NORMAL ||
                            k == PS_INIT_TRUNCATED_NORMAL;
  int o = a->opt;
  DIFF_U(dim, 1)
  DIFF_U(capacity, 1)
  DIFF_U(init.kind, 1)
  DIFF_D(init.a, ab || k == PS_INIT_CONSTANT)
  DIFF_D(init.b, ab)
  DIFF_U(init.seed, ab)
  DIFF_U(opt, 1)
  DIFF_D(lr, 1)
  DIFF_D(initial_accumulator, o == PS_TOPT_ADAGRAD)
  DIFF_D(beta1, o == PS_TOPT_ADAM)
  DIFF_D(beta2, o == PS_TOPT_ADAM)
  DIFF_D(epsilon, o == PS_TOPT_ADAM || o == PS_TOPT_ADAGRAD)
  DIFF_D(l1, o == PS_TOPT_FTRL)
  DIFF_D(l2, o == PS_TOPT_FTRL)
  DIFF_D(ftrl_beta, o == PS_TOPT_FTRL)
  DIFF_U(admit_count, 1)
  DIFF_D(admit_prob, 1)
  DIFF_U(evict_after_steps, 1)
  DIFF_U(decay, 1)
  DIFF_D(decay_rate, a->decay == PS_DECAY_EXPONENTIAL || a->decay == PS_DECAY_STEP)
  DIFF_U(decay_steps, a->decay == PS_DECAY_EXPONENTIAL || a->decay == PS_DECAY_STEP)
  DIFF_U(total_steps, a->decay == PS_DECAY_COSINE)
  DIFF_D(min_lr_factor, a->decay == PS_DECAY_COSINE)
  DIFF_U(warmup_steps, 1)
#undef DIFF_U
#undef DIFF_D
  return 0;
}

/* 0 if every server speaks protocol 2.2, else PS_EUNSUPPORTED naming the
 * first that does not. */
static int need_tables(ps_client *c, const char *name, const ps_table_config *g) {
  unsigned want = has_schedule(g) ? 8 : 2;
  for (int p = 0; p < c->num_ps; p++)
    if (c->conns[p].minor < want)
      return ps__seterr(c, PS_EUNSUPPORTED,
                        "table '%s': %s need%s protocol 2.%u, and ps %d at %s speaks only 2.%u: "
                        "upgrade psd", name,
                        want == 8 ? "a learning-rate schedule" : "sparse tables",
                        want == 8 ? "s" : "", want, p, c->conns[p].addr, c->conns[p].minor);
  return 0;
}

static void table_free(ps_table *t) {
  if (!t) return;
  free(t->name);
  free(t->ids);
  free(t->seen_step);
  free(t->kept);
  free(t->memo_req);
  free(t);
}

/* TableRegister to every ps at once, then one wait for every reply. */
static int table_register(ps_client *c, ps_table *t) {
  ps_req *r = ps__req_new(c, PS__REQ_TREGISTER);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  int rc = ps__treg_queue(c, t, r);
  if (rc) {
    ps__req_release(c, r);
    return rc;
  }
  return ps__req_wait_release(c, r);
}

int ps_client_table_create(ps_client *c, const char *name, const ps_table_config *cfg,
                           ps_table **out) {
  if (!c) return PS_EINVAL;
  if (!out) return ps__seterr(c, PS_EINVAL, "ps_client_table_create: out is NULL");
  if (!name || !*name || strlen(name) > PS_MAX_NAME)
    return ps__seterr(c, PS_EINVAL, "table name must be 1 to %d bytes", PS_MAX_NAME);
  if (!cfg)
    return ps__seterr(c, PS_EINVAL, "table '%s': cfg is NULL (ps_table_config_init, then set "
                      "dim and capacity)", name);
  ps_table_config g;
  int rc = read_config(c, name, cfg, &g);
  if (rc) return rc;
  ps_table *had = find_table(c, name);
  if (had) {
    char diff[400];
    if (config_diff(&had->cfg, &g, diff, sizeof diff))
      return ps__seterr(c, PS_EMISMATCH, "table '%s' was already created by this client with "
                        "another configuration: %s", name, diff);
    *out = had;
    return 0;
  }
  if ((rc = need_tables(c, name, &g)) != 0 || (rc = ps__check_vars(c, NULL, 0, 0)) != 0) return rc;
  ps_table *t = calloc(1, sizeof *t);
  if (t) {
    t->c = c;
    t->cfg = g;
    t->name = strdup(name);
    t->ids = calloc((size_t)c->num_ps, sizeof *t->ids);
    t->seen_step = calloc((size_t)c->num_ps, sizeof *t->seen_step);
    t->kept = calloc((size_t)c->num_ps, sizeof *t->kept);
    t->memo_req = calloc((size_t)c->num_ps, sizeof *t->memo_req);
  }
  if (!t || !t->name || !t->ids || !t->seen_step || !t->kept || !t->memo_req ||
      ps__grow((void **)&c->tables, &c->captables, c->ntables + 1, sizeof *c->tables)) {
    table_free(t);
    return ps__seterr(c, PS_ENOMEM, "out of memory creating table '%s'", name);
  }
  if ((rc = table_register(c, t)) != 0) {
    table_free(t);
    return rc;
  }
  c->tables[c->ntables++] = t;
  *out = t;
  return 0;
}

/* ---- pulls and pushes ---------------------------------------------------- */

/* n rows of t fit in memory (n * dim floats); 0 or PS_EINVAL. */
static int check_rows(ps_table *t, size_t n, const char *what) {
  uint64_t floats;
  if (ps__mul_u64(n, t->cfg.dim, &floats) || floats > SIZE_MAX / sizeof(float))
    return ps__seterr(t->c, PS_EINVAL, "table '%s': %s of %zu keys of %u floats overflows",
                      t->name, what, n, t->cfg.dim);
  return 0;
}

int ps_table_pull_async(ps_table *t, uint64_t min_step, const uint64_t *keys, size_t n,
                        float *out, unsigned flags, ps_req **req) {
  if (!t) return PS_EINVAL;
  ps_client *c = t->c;
  if (!req) return ps__seterr(c, PS_EINVAL, "ps_table_pull_async: req is NULL");
  if (n && (!keys || !out))
    return ps__seterr(c, PS_EINVAL, "table '%s': pull of %zu keys with keys or out NULL",
                      t->name, n);
  if (flags & ~PS_TABLE_READ_ONLY)
    return ps__seterr(c, PS_EINVAL, "table '%s': unknown pull flags 0x%x", t->name,
                      flags & ~PS_TABLE_READ_ONLY);
  int rc = check_rows(t, n, "a pull");
  if (!rc) rc = ps__check_vars(c, NULL, 0, 0);
  if (rc) return rc;
  /* No keys: every ps's step of the table only. */
  if (n == 0) return ps__tstep_start(c, &t, 1, min_step, req);
  return ps__tpull_start(t, min_step, keys, n, out, (flags & PS_TABLE_READ_ONLY) != 0, req);
}

int ps_table_pull(ps_table *t, uint64_t min_step, const uint64_t *keys, size_t n, float *out,
                  unsigned flags, uint64_t *step_out) {
  if (!t) return PS_EINVAL;
  ps_req *r;
  int rc = ps_table_pull_async(t, min_step, keys, n, out, flags, &r);
  if (rc) return rc;
  uint64_t got = 0;
  rc = ps_req_wait(r, -1, &got);
  /* Released even when unfinished (a timeout): late rows are discarded. */
  ps__req_release(t->c, r);
  if (rc) return rc;
  if (step_out) *step_out = got;
  return 0;
}

/* keys and grads of n rows are usable; 0 or PS_EINVAL. */
static int check_grads(ps_table *t, const uint64_t *keys, size_t n, const float *grads,
                       const char *what) {
  if (n && (!keys || !grads))
    return ps__seterr(t->c, PS_EINVAL, "table '%s': %s of %zu keys with keys or grads NULL",
                      t->name, what, n);
  return check_rows(t, n, what);
}

int ps_table_push_async(ps_table *t, uint64_t step, const uint64_t *keys, size_t n,
                        const float *grads, ps_req **req) {
  if (!t) return PS_EINVAL;
  ps_client *c = t->c;
  if (!req) return ps__seterr(c, PS_EINVAL, "ps_table_push_async: req is NULL");
  int rc = check_grads(t, keys, n, grads, "a push");
  if (!rc) rc = ps__check_vars(c, NULL, 0, 0);
  if (!rc) rc = ps__tpush_check(t, keys, n);
  if (rc) return rc;
  ps_req *r = ps__req_new(c, PS__REQ_TPUSH);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  if ((rc = ps__tpush_queue(t, r, step, keys, n, grads)) != 0) {
    ps__req_release(c, r);
    return rc;
  }
  *req = r;
  return 0;
}

int ps_table_add_grad(ps_table *t, const uint64_t *keys, size_t n, const float *grads) {
  if (!t) return PS_EINVAL;
  int rc = check_grads(t, keys, n, grads, "add_grad");
  if (rc || n == 0) return rc;
  /* The step's first: written as the push frames' data at once (no
   * staging copy); a second one stages both. */
  if (t->sn == 0 && !t->prepared && (rc = ps__tpush_prepare(t, keys, n, grads)) <= 0) return rc;
  if ((rc = ps__tpush_unprepare(t)) != 0) return rc;
  size_t dim = t->cfg.dim;
  uint64_t total, floats;
  if (ps__add_u64(t->sn, n, &total) || ps__mul_u64(total, dim, &floats) ||
      floats > SIZE_MAX / sizeof(float))
    return ps__seterr(t->c, PS_EINVAL, "table '%s': %zu staged keys plus %zu overflow",
                      t->name, t->sn, n);
  if (ps__grow((void **)&t->skeys, &t->skcap, (size_t)total, sizeof *t->skeys) ||
      ps__grow((void **)&t->sgrads, &t->sgcap, (size_t)floats, sizeof *t->sgrads))
    return ps__seterr(t->c, PS_ENOMEM, "table '%s': out of memory staging %zu gradients",
                      t->name, n);
  memcpy(t->skeys + t->sn, keys, n * sizeof *keys);
  memcpy(t->sgrads + t->sn * dim, grads, n * dim * sizeof *grads);
  t->sn = (size_t)total;
  return 0;
}

/* ---- ps_client_step's table requests -------------------------------------- */

int ps__tables_step_check(ps_client *c) {
  for (size_t i = 0; i < c->ntables; i++) {
    ps_table *t = c->tables[i];
    if (t->prepared) continue; /* checked when prepared */
    int rc = ps__tpush_check(t, t->skeys, t->sn);
    if (rc) return rc;
  }
  return 0;
}

int ps__tables_step_pull(ps_client *c, uint64_t min_step, ps_req **out) {
  return ps__tstep_start(c, c->tables, c->ntables, min_step, out);
}

void ps__tables_unhold(ps_client *c) {
  for (size_t i = 0; i < c->ntables; i++) (void)ps__tpush_unhold(c->tables[i]);
}

int ps__tables_step_push(ps_client *c, uint64_t step, ps_req **out) {
  ps_req *r = ps__req_new(c, PS__REQ_TPUSH);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  /* Prepared tables first: their data may be held in the push rings,
   * which take no other frame until it is queued (a frame behind a hold
   * goes over TCP). */
  int rc = 0;
  for (size_t i = 0; i < c->ntables; i++) {
    ps_table *t = c->tables[i];
    t->sent = 0;
    if (rc || !t->prepared) continue;
    rc = ps__tpush_queue_prepared(t, r, step);
    t->sent = rc == 0;
  }
  for (size_t i = 0; i < c->ntables && !rc; i++) {
    ps_table *t = c->tables[i];
    if (!t->sent) rc = ps__tpush_queue(t, r, step, t->skeys, t->sn, t->sgrads);
    if (!rc) t->sn = 0; /* sent: the next step starts empty */
  }
  if (rc) {
    ps__req_release(c, r);
    return rc;
  }
  if (r->pending == 0) ps__req_finish(c, r);
  *out = r;
  return 0;
}
