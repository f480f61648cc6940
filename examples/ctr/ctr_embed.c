/* ctr_embed.c - the CTR example's embedding rows as a psd table, a dense
 * psd variable, or a local hash table (ctr_embed.h). */
#include "ctr_embed.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ADAGRAD_INIT 0.1 /* initial accumulator, as psd's default */
#define ADAGRAD_EPS 1e-7

struct ctr_emb {
  ctr_emb_opts o;
  ps_client *c;
  ps_table *t;     /* table */
  ps_var *v;       /* dense */
  uint64_t *touched; /* dense: gradient rows set since the last step */
  size_t ntouched, cap_touched;
  /* local: open addressing, linear probing; slot -> row + 1 (0: empty) */
  uint64_t *slot_key;
  uint32_t *slot_row;
  size_t slots, nrows, cap_rows;
  float *w, *acc, *grad;
  uint32_t *lt;    /* local: rows with a gradient this step */
  size_t nlt;
  unsigned char *has_grad;
};

static uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static int create_table(ctr_emb *e, char *err, size_t errlen) {
  ps_table_config cfg;
  ps_table_config_init(&cfg);
  cfg.dim = e->o.dim;
  cfg.capacity = e->o.capacity;
  ps_init init = PS_SIZED(ps_init, PS_INIT_UNIFORM, -e->o.init_scale, e->o.init_scale, e->o.seed);
  cfg.init = init;
  cfg.opt = e->o.opt;
  cfg.lr = e->o.lr;
  if (e->o.opt == PS_TOPT_FTRL) {
    /* FTRL starts every row from its own solution: zeros, as usual. */
    ps_init zeros = PS_SIZED(ps_init, PS_INIT_ZEROS, 0, 0, e->o.seed);
    cfg.init = zeros;
    cfg.l1 = e->o.l1;
    cfg.l2 = e->o.l2;
  }
  if (ps_client_table_create(e->c, "embedding", &cfg, &e->t) != 0) {
    snprintf(err, errlen, "creating the embedding table: %s", ps_client_errmsg(e->c));
    return -1;
  }
  return 0;
}

static int create_dense(ctr_emb *e, char *err, size_t errlen) {
  if (e->o.opt != PS_TOPT_SGD && e->o.opt != PS_TOPT_ADAM) {
    snprintf(err, errlen, "--embed dense takes --opt sgd or adam (psd's dense rules)");
    return -1;
  }
  int64_t shape[2] = {(int64_t)e->o.rows, (int64_t)e->o.dim};
  ps_init init = PS_SIZED(ps_init, PS_INIT_UNIFORM, -e->o.init_scale, e->o.init_scale, e->o.seed);
  ps_optimizer opt;
  ps_optimizer_default(&opt, e->o.lr);
  if (e->o.opt == PS_TOPT_ADAM) opt.kind = PS_OPT_ADAM;
  if (ps_client_var_create(e->c, "embedding", shape, 2, &init, &opt, &e->v) != 0) {
    snprintf(err, errlen, "creating the dense embedding (%llu x %u): %s",
             (unsigned long long)e->o.rows, e->o.dim, ps_client_errmsg(e->c));
    return -1;
  }
  return 0;
}

int ctr_emb_create(ps_client *c, const ctr_emb_opts *o, ctr_emb **out, char *err,
                   size_t errlen) {
  ctr_emb *e = calloc(1, sizeof *e);
  if (!e) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  e->o = *o;
  e->c = c;
  int rc = 0;
  if (o->kind == CTR_EMB_TABLE) rc = create_table(e, err, errlen);
  else if (o->kind == CTR_EMB_DENSE) rc = create_dense(e, err, errlen);
  else if (o->opt != PS_TOPT_SGD && o->opt != PS_TOPT_ADAGRAD) {
    snprintf(err, errlen, "--local takes --opt sgd or adagrad");
    rc = -1;
  }
  if (rc != 0) {
    free(e);
    return -1;
  }
  *out = e;
  return 0;
}

void ctr_emb_destroy(ctr_emb *e) {
  if (!e) return;
  free(e->touched);
  free(e->slot_key);
  free(e->slot_row);
  free(e->w);
  free(e->acc);
  free(e->grad);
  free(e->lt);
  free(e->has_grad);
  free(e);
}

/* ---- local: a hash table of rows ------------------------------------------ */

/* A new row's values: uniform in [-scale, scale) from (seed, key). */
static void local_init_row(const ctr_emb *e, uint64_t key, float *row) {
  uint64_t s = mix(e->o.seed ^ mix(key));
  for (uint32_t j = 0; j < e->o.dim; j++) {
    s = mix(s + 0x9e3779b97f4a7c15ULL);
    double u = (double)(s >> 11) * 0x1p-53;
    row[j] = (float)((2 * u - 1) * e->o.init_scale);
  }
}

static size_t local_find(const ctr_emb *e, uint64_t key) {
  size_t mask = e->slots - 1, i = mix(key) & mask;
  while (e->slot_row[i] && e->slot_key[i] != key) i = (i + 1) & mask;
  return i;
}

static int local_grow(ctr_emb *e) {
  size_t ns = e->slots ? e->slots * 2 : 1 << 16, nr = ns / 2, dim = e->o.dim;
  uint64_t *ok = e->slot_key;
  uint32_t *orow = e->slot_row;
  size_t oslots = e->slots;
  e->slot_key = calloc(ns, sizeof *e->slot_key);
  e->slot_row = calloc(ns, sizeof *e->slot_row);
  float *w = realloc(e->w, nr * dim * sizeof(float));
  if (w) e->w = w;
  float *acc = w ? realloc(e->acc, nr * dim * sizeof(float)) : NULL;
  if (acc) e->acc = acc;
  float *grad = acc ? realloc(e->grad, nr * dim * sizeof(float)) : NULL;
  if (grad) e->grad = grad;
  uint32_t *lt = grad ? realloc(e->lt, nr * sizeof *lt) : NULL;
  if (lt) e->lt = lt;
  unsigned char *hg = lt ? realloc(e->has_grad, nr) : NULL;
  if (hg) e->has_grad = hg;
  if (!e->slot_key || !e->slot_row || !hg) return -1;
  e->slots = ns;
  e->cap_rows = nr;
  for (size_t i = 0; i < oslots; i++)
    if (orow[i]) {
      size_t j = local_find(e, ok[i]);
      e->slot_key[j] = ok[i];
      e->slot_row[j] = orow[i];
    }
  free(ok);
  free(orow);
  return 0;
}

/* The row of key, created if create (else -1 when absent). */
static long local_row(ctr_emb *e, uint64_t key, int create) {
  if (!e->slots && (!create || local_grow(e) != 0)) return -1;
  size_t i = local_find(e, key);
  if (e->slot_row[i]) return (long)e->slot_row[i] - 1;
  if (!create) return -1;
  if (e->nrows + 1 > e->cap_rows) {
    if (local_grow(e) != 0) return -1;
    i = local_find(e, key);
  }
  size_t r = e->nrows++, dim = e->o.dim;
  e->slot_key[i] = key;
  e->slot_row[i] = (uint32_t)(r + 1);
  local_init_row(e, key, e->w + r * dim);
  for (size_t j = 0; j < dim; j++) {
    e->acc[r * dim + j] = (float)ADAGRAD_INIT;
    e->grad[r * dim + j] = 0;
  }
  e->has_grad[r] = 0;
  return (long)r;
}

void ctr_emb_local_step(ctr_emb *e) {
  size_t dim = e->o.dim;
  float lr = (float)e->o.lr;
  for (size_t k = 0; k < e->nlt; k++) {
    size_t r = e->lt[k];
    float *w = e->w + r * dim, *a = e->acc + r * dim, *g = e->grad + r * dim;
    for (size_t j = 0; j < dim; j++) {
      if (e->o.opt == PS_TOPT_ADAGRAD) {
        a[j] += g[j] * g[j];
        w[j] -= lr * g[j] / (sqrtf(a[j]) + (float)ADAGRAD_EPS);
      } else {
        w[j] -= lr * g[j];
      }
      g[j] = 0;
    }
    e->has_grad[r] = 0;
  }
  e->nlt = 0;
}

uint64_t ctr_emb_local_rows(const ctr_emb *e) { return e->nrows; }

/* ---- the interface ---------------------------------------------------------- */

int ctr_emb_pull(ctr_emb *e, uint64_t step, const uint64_t *keys, size_t n, float *out,
                 int read_only) {
  size_t dim = e->o.dim;
  if (e->t) return ps_table_pull(e->t, step, keys, n, out, read_only ? PS_TABLE_READ_ONLY : 0,
                                 NULL);
  if (e->v) {
    const float *data = ps_var_data(e->v);
    for (size_t i = 0; i < n; i++) memcpy(out + i * dim, data + keys[i] * dim, dim * sizeof(float));
    return 0;
  }
  for (size_t i = 0; i < n; i++) {
    long r = local_row(e, keys[i], !read_only);
    if (r >= 0) memcpy(out + i * dim, e->w + (size_t)r * dim, dim * sizeof(float));
    else if (read_only) local_init_row(e, keys[i], out + i * dim);
    else return PS_ENOMEM;
  }
  return 0;
}

int ctr_emb_add_grad(ctr_emb *e, const uint64_t *keys, size_t n, const float *grads) {
  size_t dim = e->o.dim;
  if (e->t) return ps_table_add_grad(e->t, keys, n, grads);
  if (e->v) {
    if (e->ntouched + n > e->cap_touched) {
      size_t cap = (e->ntouched + n) * 2;
      uint64_t *t = realloc(e->touched, cap * sizeof *t);
      if (!t) return PS_ENOMEM;
      e->touched = t;
      e->cap_touched = cap;
    }
    float *g = ps_var_grad(e->v);
    for (size_t i = 0; i < n; i++) {
      for (size_t j = 0; j < dim; j++) g[keys[i] * dim + j] += grads[i * dim + j];
      e->touched[e->ntouched++] = keys[i];
    }
    return 0;
  }
  for (size_t i = 0; i < n; i++) {
    long r = local_row(e, keys[i], 0);
    if (r < 0) continue; /* never pulled: nothing to update */
    for (size_t j = 0; j < dim; j++) e->grad[(size_t)r * dim + j] += grads[i * dim + j];
    if (!e->has_grad[r]) {
      e->has_grad[r] = 1;
      e->lt[e->nlt++] = (uint32_t)r;
    }
  }
  return 0;
}

void ctr_emb_after_step(ctr_emb *e) {
  if (!e->v) return;
  float *g = ps_var_grad(e->v);
  size_t dim = e->o.dim;
  for (size_t i = 0; i < e->ntouched; i++) memset(g + e->touched[i] * dim, 0, dim * sizeof(float));
  e->ntouched = 0;
}
