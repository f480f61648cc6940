/* var.c - variables: deterministic placement into slices, registration on
 * the servers that hold them (all at once), the chief's initialization,
 * and the one undo path when a creation fails. The servers' slice ids are
 * recorded in slicemap.c (by reply.c, as RegisterReplies arrive). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

static void var_free(ps_var *v) {
  if (!v) return;
  free(v->name);
  free(v->own_data);
  free(v->own_grad);
  free(v);
}

void ps__vars_free(ps_client *c) {
  for (size_t i = 0; i < c->nvars; i++) var_free(c->vars[i]);
  free(c->vars);
  free(c->slices);
}

int ps_var_bind_buffers(ps_var *v, float *data, float *grad) {
  if (!v) return PS_EINVAL;
  v->data = data ? data : v->own_data;
  v->grad = grad ? grad : v->own_grad;
  return 0;
}

float *ps_var_data(ps_var *v) { return v->data; }
float *ps_var_grad(ps_var *v) { return v->grad; }
size_t ps_var_numel(const ps_var *v) { return v->numel; }
const char *ps_var_name(const ps_var *v) { return v->name; }
int ps_var_ndim(const ps_var *v) { return v->ndim; }
const int64_t *ps_var_shape(const ps_var *v) { return v->shape; }

int ps_var_set_wire_dtype(ps_var *v, int push_dtype, int pull_dtype) {
  if (!v) return PS_EINVAL;
  if ((push_dtype != -1 && !ps__dtype_valid((uint32_t)push_dtype)) ||
      (pull_dtype != -1 && !ps__dtype_valid((uint32_t)pull_dtype)))
    return ps__seterr(v->c, PS_EINVAL,
                      "variable '%s': wire dtypes push %d, pull %d: each must be -1, "
                      "PS_WIRE_F32, PS_WIRE_BF16 or PS_WIRE_FP16", v->name, push_dtype,
                      pull_dtype);
  v->push_dtype = push_dtype;
  v->pull_dtype = pull_dtype;
  return 0;
}

int ps__need_minor(ps_client *c, uint32_t minor, const char *what) {
  for (int p = 0; p < c->num_ps; p++)
    if (c->conns[p].minor < minor)
      return ps__seterr(c, PS_EUNSUPPORTED,
                        "%s needs protocol 2.%u, and ps %d at %s speaks only 2.%u: upgrade psd",
                        what, (unsigned)minor, p, c->conns[p].addr,
                        (unsigned)c->conns[p].minor);
  return 0;
}

/* Seconds a worker waits for the chief's values of a variable before it
 * says so on stderr, then between such lines: a variable only some
 * workers create (a typo in a name) would otherwise wait silently for the
 * whole request timeout. */
#define PS__CHIEF_WAIT_NOTE_S 2.0
#define PS__CHIEF_WAIT_EVERY_S 10.0

/* Waits for (then releases) the pull of a new variable's values: the
 * chief's initialization, for the other workers. Bounded by the request
 * timeout; while it waits, a line on stderr names the variable. */
static int wait_for_values(ps_client *c, ps_req *r, const char *name) {
  const double start = ps__now(), limit = c->request_timeout_ms / 1000.0;
  double next = PS__CHIEF_WAIT_NOTE_S;
  int rc;
  for (;;) {
    double waited = ps__now() - start;
    double chunk = (next < limit ? next : limit) - waited;
    rc = ps_req_wait(r, chunk > 0 ? (int)(chunk * 1000) + 1 : 0, NULL);
    waited = ps__now() - start;
    if (rc != PS_ETIMEDOUT || waited >= limit) break;
    if (waited >= next && c->worker_index != 0) {
      fprintf(stderr,
              "psclient: worker %d: still waiting after %.0f s for the chief (worker 0) to "
              "create variable '%s': a worker gets what the chief creates, by the same name "
              "and shape (a typo, or a variable only some workers create?); giving up after "
              "the %.0f s request timeout\n",
              c->worker_index, waited, name, limit);
      next = waited + PS__CHIEF_WAIT_EVERY_S;
    }
  }
  ps__req_release(c, r);
  if (rc == PS_ETIMEDOUT && c->worker_index != 0)
    return ps__seterr(c, rc, "variable '%s': the chief (worker 0) did not create it within the "
                      "%.0f s request timeout: every worker must create the same variables, "
                      "by the same names", name, limit);
  return rc;
}

/* Name, rank and shape are acceptable; *numel gets the element count. */
static int check_args(ps_client *c, const char *name, const int64_t *shape, int ndim,
                      uint64_t *numel) {
  if (!name || !*name || strlen(name) > PS_MAX_NAME)
    return ps__seterr(c, PS_EINVAL, "variable name must be 1 to %d bytes", PS_MAX_NAME);
  if (ndim < 1 || ndim > PS_MAX_DIMS || !shape)
    return ps__seterr(c, PS_EINVAL, "variable '%s': rank %d must be 1 to %d", name, ndim,
                      PS_MAX_DIMS);
  *numel = 1;
  for (int d = 0; d < ndim; d++)
    if (shape[d] <= 0 || ps__mul_u64(*numel, (uint64_t)shape[d], numel) ||
        *numel > (SIZE_MAX / sizeof(float)))
      return ps__seterr(c, PS_EINVAL,
                        "variable '%s': dimension %d (%lld) is not positive or the size overflows",
                        name, d, (long long)shape[d]);
  return 0;
}

/* c's variable called name, or NULL. */
static ps_var *find_var(const ps_client *c, const char *name) {
  for (size_t i = 0; i < c->nvars; i++)
    if (strcmp(c->vars[i]->name, name) == 0) return c->vars[i];
  return NULL;
}

ps_var *ps_client_var_find(ps_client *c, const char *name) {
  if (!c) return NULL;
  ps_var *v = name ? find_var(c, name) : NULL;
  if (!v) ps__seterr(c, PS_ENOTFOUND, "this client has no variable '%s'", name ? name : "(null)");
  return v;
}

/* "[3, 4]" into buf (PS_MAX_DIMS dims fit in 200 bytes). */
static void fmt_shape(char *buf, size_t len, const int64_t *shape, int ndim) {
  size_t o = 0;
  buf[0] = '\0';
  for (int d = 0; d < ndim && o < len; d++) {
    int k = snprintf(buf + o, len - o, "%s%lld", d ? ", " : "[", (long long)shape[d]);
    if (k < 0) return;
    o += (size_t)k;
  }
  if (o < len) snprintf(buf + o, len - o, "]");
}

/* Whether two initializers draw the same values: 0, or 1 with the first
 * differing parameter and both values in buf (a first). Only what the
 * kind uses is compared. */
static int init_diff(const ps_init *a, const ps_init *b, char *buf, size_t len) {
  if (a->kind != b->kind && (a->kind == PS__INIT_VALUES || b->kind == PS__INIT_VALUES)) {
    snprintf(buf, len, "initialization: %s (the first create) vs %s (this call)",
             a->kind == PS__INIT_VALUES ? "the caller's values" : "an initializer",
             b->kind == PS__INIT_VALUES ? "the caller's values" : "an initializer");
    return 1;
  }
  if (a->kind != b->kind) {
    snprintf(buf, len, "initializer kind %d (the first create) vs %d (this call)", (int)a->kind,
             (int)b->kind);
    return 1;
  }
  int uses_ab = a->kind == PS_INIT_UNIFORM || a->kind == PS_INIT_NORMAL ||
                a->kind == PS_INIT_TRUNCATED_NORMAL;
  int seeded = uses_ab || a->kind == PS_INIT_GLOROT_UNIFORM || a->kind == PS_INIT_GLOROT_NORMAL;
  if ((uses_ab || a->kind == PS_INIT_CONSTANT) && a->a != b->a)
    snprintf(buf, len, "initializer a %.17g (the first create) vs %.17g (this call)", a->a, b->a);
  else if (uses_ab && a->b != b->b)
    snprintf(buf, len, "initializer b %.17g (the first create) vs %.17g (this call)", a->b, b->b);
  else if (seeded && a->seed != b->seed)
    snprintf(buf, len, "initializer seed %llu (the first create) vs %llu (this call)",
             (unsigned long long)a->seed, (unsigned long long)b->seed);
  else
    return 0;
  return 1;
}

/* A second create of v's name: v itself when shape, optimizer and
 * initializer agree, else an error naming the property and both values. */
static int recreate(ps_client *c, ps_var *v, const int64_t *shape, int ndim,
                    const ps_optimizer *o, const ps_init *in, ps_var **out) {
  int same = v->ndim == ndim;
  for (int d = 0; same && d < ndim; d++) same = v->shape[d] == shape[d];
  char a[200], b[200], diff[400];
  if (!same) {
    fmt_shape(a, sizeof a, v->shape, v->ndim);
    fmt_shape(b, sizeof b, shape, ndim);
    return ps__seterr(c, PS_ESHAPE,
                      "variable '%s' was already created by this client with shape %s; this "
                      "call asks for %s", v->name, a, b);
  }
  if (ps__opt_diff(&v->opt, "the first create", o, "this call", diff, sizeof diff))
    return ps__seterr(c, PS_EMISMATCH,
                      "variable '%s' was already created by this client with another "
                      "optimizer: %s", v->name, diff);
  if (init_diff(&v->init, in, diff, sizeof diff))
    return ps__seterr(c, PS_EMISMATCH,
                      "variable '%s' was already created by this client with another %s",
                      v->name, diff);
  *out = v;
  return 0;
}

/* A variable object with zeroed data and gradient, not yet placed. */
static ps_var *var_alloc(ps_client *c, const char *name, const int64_t *shape, int ndim,
                         uint64_t numel) {
  ps_var *v = calloc(1, sizeof *v);
  if (!v) return NULL;
  v->c = c;
  v->name = strdup(name);
  v->ndim = ndim;
  memcpy(v->shape, shape, (size_t)ndim * sizeof *shape);
  v->numel = (size_t)numel;
  v->push_dtype = v->pull_dtype = -1; /* the client's */
  v->data = v->own_data = calloc(v->numel, sizeof(float));
  v->grad = v->own_grad = calloc(v->numel, sizeof(float));
  if (v->name && v->data && v->grad) return v;
  var_free(v);
  return NULL;
}

/* Places v (updating the placer's loads) and appends its slices and v
 * itself to the client's lists. 0 or PS_ENOMEM (nothing changed). */
static int var_place(ps_client *c, ps_var *v) {
  size_t ns = ps__placer_count(&c->placer, v->numel);
  if (ns == 0 || c->nslices + ns >= PS__NO_SLICE ||
      ps__grow((void **)&c->slices, &c->capslices, c->nslices + ns, sizeof *c->slices) ||
      ps__grow((void **)&c->vars, &c->capvars, c->nvars + 1, sizeof *c->vars))
    return PS_ENOMEM;
  ps__slice_place *pl = calloc(ns, sizeof *pl);
  if (!pl) return PS_ENOMEM;
  ps__placer_place(&c->placer, v->numel, pl, ns);
  v->first_slice = c->nslices;
  v->n_slices = ns;
  for (size_t i = 0; i < ns; i++) {
    ps__slice *s = &c->slices[c->nslices + i];
    memset(s, 0, sizeof *s);
    s->ps = pl[i].ps;
    s->offset = pl[i].offset;
    s->length = pl[i].length;
    s->var = v;
    s->remote_id = PS__NO_SLICE;
  }
  free(pl);
  c->nslices += ns;
  c->vars[c->nvars++] = v;
  return 0;
}

/* Forgets v (the last variable placed): its slices, its map entries. */
static void var_unplace(ps_client *c, ps_var *v) {
  for (size_t i = v->first_slice; i < c->nslices; i++) {
    const ps__slice *s = &c->slices[i];
    ps__remote_forget(c, (int)s->ps, s->remote_id, i);
  }
  c->nslices = v->first_slice;
  c->nvars--;
}

/* Queues v's Register on ps p (its slices there, in order) for r. */
static int register_on(ps_client *c, ps_var *v, int p, const Ps__Optimizer *mo, ps_req *r) {
  size_t cnt = 0;
  for (size_t i = 0; i < v->n_slices; i++) cnt += c->slices[v->first_slice + i].ps == (uint32_t)p;
  if (!cnt) return 0;
  Ps__SliceSpec *specs = calloc(cnt, sizeof *specs);
  Ps__SliceSpec **sp = calloc(cnt, sizeof *sp);
  int rc = specs && sp ? 0 : ps__seterr(c, PS_ENOMEM, "out of memory");
  uint64_t ushape[PS_MAX_DIMS];
  for (int d = 0; d < v->ndim; d++) ushape[d] = (uint64_t)v->shape[d];
  for (size_t i = 0, j = 0; rc == 0 && i < v->n_slices; i++) {
    const ps__slice *s = &c->slices[v->first_slice + i];
    if (s->ps != (uint32_t)p) continue;
    ps__slice_spec__init(&specs[j]);
    specs[j].name = v->name;
    specs[j].n_shape = (size_t)v->ndim;
    specs[j].shape = ushape;
    specs[j].dtype = 1;
    specs[j].offset = s->offset;
    specs[j].length = s->length;
    specs[j].optimizer = (Ps__Optimizer *)mo;
    sp[j] = &specs[j];
    j++;
  }
  if (rc == 0) {
    Ps__Register reg = PS__REGISTER__INIT;
    reg.request_id = r->id;
    reg.n_slices = cnt;
    reg.slices = sp;
    rc = ps__queue_frame(c, &c->conns[p], PS__MSG_REGISTER, &reg.base, NULL, NULL, 0);
  }
  if (rc == 0) {
    ps__req_expect(r, p, 1); /* one RegisterReply from ps p */
    ps__conn_flush(c, &c->conns[p]);
  }
  free(specs);
  free(sp);
  return rc;
}

/* Registers v on every server holding part of it: all Registers go out
 * first, then one wait for every reply. */
static int var_register(ps_client *c, ps_var *v, const ps_optimizer *opt) {
  Ps__Optimizer mo;
  ps__opt_to_msg(opt, &mo);
  ps_req *r = ps__req_new(c, PS__REQ_REGISTER);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  r->reg_var = v;
  int rc = 0;
  for (int p = 0; p < c->num_ps && rc == 0; p++) rc = register_on(c, v, p, &mo, r);
  if (rc == 0 && r->pending == 0) ps__req_finish(c, r);
  if (rc) {
    ps__req_release(c, r);
    return rc;
  }
  return ps__req_wait_release(c, r);
}

/* Queues one Init frame per slice of v with v's data for r: the chief's
 * initial values (assign 0: slices already initialized are skipped) or an
 * assign for step. 0 or <0 (message set; r is the caller's to release). */
static int queue_inits(ps_client *c, ps_var *v, ps_req *r, int assign, uint64_t step) {
  for (size_t i = 0; i < v->n_slices; i++) {
    const ps__slice *s = &c->slices[v->first_slice + i];
    if (!assign && s->initialized) continue;
    Ps__Item item = PS__ITEM__INIT, *ip = &item;
    item.slice_id = s->remote_id;
    item.count = s->length;
    const float *dp = v->data + s->offset;
    uint64_t dc = s->length;
    Ps__Init in = PS__INIT__INIT;
    in.request_id = r->id;
    in.n_items = 1;
    in.items = &ip;
    in.assign = assign;
    in.step = step;
    int rc = ps__queue_frame(c, &c->conns[s->ps], PS__MSG_INIT, &in.base, &dp, &dc, 1);
    if (rc) return rc;
    ps__req_expect(r, (int)s->ps, 1);
  }
  return 0;
}

/* The chief fills the slices no server had initialized: one Init frame per
 * slice (each at most PS__MAX_SLICE_BYTES), all in flight at once. */
static int var_initialize(ps_client *c, ps_var *v, const ps_init *init, const float *values) {
  int any = 0;
  for (size_t i = 0; i < v->n_slices; i++) any |= !c->slices[v->first_slice + i].initialized;
  if (!any) return 0;
  int rc = 0;
  if (values)
    memcpy(v->data, values, v->numel * sizeof *values);
  else
    rc = ps_init_fill(init, v->name, v->shape, v->ndim, v->data, v->numel);
  if (rc) return ps__seterr(c, rc, "variable '%s': bad initializer", v->name);
  ps_req *r = ps__req_new(c, PS__REQ_INIT);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  rc = queue_inits(c, v, r, 0, 0);
  if (rc) {
    ps__req_release(c, r);
    return rc;
  }
  return ps__req_wait_release(c, r);
}

/* The first value of values[0..n) that is NaN or infinite, or n. */
static size_t first_nonfinite(const float *values, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!isfinite(values[i])) return i;
  return n;
}

/* ps_client_var_create, with the chief's initial values taken from
 * `values` when it is not NULL (in->kind PS__INIT_VALUES). */
static int var_create(ps_client *c, const char *name, const int64_t *shape, int ndim,
                      const ps_init *init, const float *values, const ps_optimizer *opt,
                      ps_var **out) {
  if (!c) return PS_EINVAL;
  if (!out) return ps__seterr(c, PS_EINVAL, "ps_client_var_create: out is NULL");
  uint64_t numel = 0;
  int rc = check_args(c, name, shape, ndim, &numel);
  if (rc) return rc;
  size_t bad = values ? first_nonfinite(values, numel) : numel;
  if (bad < numel)
    return ps__seterr(c, PS_EINVAL, "variable '%s': initial value %zu is %g (values must be "
                      "finite)", name, bad, (double)values[bad]);
  /* The library's layouts, defaulted past the caller's struct_size (and
   * wholly when NULL: SGD lr 0.01, zeros). */
  ps_optimizer o;
  ps_init in;
  char e[300];
  ps_optimizer_init(&o);
  ps_init_init(&in);
  if (opt && (rc = ps__sized_read(&o, sizeof o, opt, PS__OPTIMIZER_V1_SIZE, "ps_optimizer", e,
                                  sizeof e)) != 0)
    return ps__seterr(c, rc, "variable '%s': %s", name, e);
  if (init && (rc = ps__sized_read(&in, sizeof in, init, PS__INIT_V1_SIZE, "ps_init", e,
                                   sizeof e)) != 0)
    return ps__seterr(c, rc, "variable '%s': %s", name, e);
  if (values) in.kind = PS__INIT_VALUES;
  ps_var *had = find_var(c, name);
  if (had) return recreate(c, had, shape, ndim, &o, &in, out);
  int minor = ps__opt_min_minor(&o);
  if (minor > 0) {
    snprintf(e, sizeof e, "variable '%s': %s", name, ps__opt_min_minor_what(&o));
    if ((rc = ps__need_minor(c, (uint32_t)minor, e)) != 0) return rc;
  }
  /* Placement must stay identical on every worker: if this creation
   * fails, the loads are restored as if it never happened. */
  uint64_t *saved_load = malloc((size_t)c->num_ps * sizeof *saved_load);
  ps_var *v = var_alloc(c, name, shape, ndim, numel);
  int placed = 0;
  if (!saved_load || !v) {
    rc = ps__seterr(c, PS_ENOMEM, "out of memory creating '%s'", name);
    goto fail;
  }
  memcpy(saved_load, c->placer.load, (size_t)c->num_ps * sizeof *saved_load);
  v->opt = o;
  v->init = in;
  v->trainable = o.kind != PS_OPT_NONE;
  if ((rc = var_place(c, v)) != 0) {
    ps__seterr(c, rc, "out of memory creating '%s'", name);
    goto fail;
  }
  placed = 1;
  if ((rc = var_register(c, v, &o)) != 0) goto fail;
  /* The chief initializes what is not yet initialized. */
  if (c->worker_index == 0 && (rc = var_initialize(c, v, &in, values)) != 0) goto fail;
  /* Everyone (the chief too, in case a restore initialized some slices)
   * pulls the values at the current step. */
  ps_req *r = NULL;
  if ((rc = ps_client_pull_async(c, 0, &v, 1, &r)) != 0) goto fail;
  if ((rc = wait_for_values(c, r, name)) != 0) goto fail;
  free(saved_load);
  *out = v;
  return 0;
fail:
  /* Undo: forget the variable, its slices and its placement. */
  if (placed) {
    var_unplace(c, v);
    memcpy(c->placer.load, saved_load, (size_t)c->num_ps * sizeof *saved_load);
  }
  var_free(v);
  free(saved_load);
  return rc;
}

int ps_client_var_create(ps_client *c, const char *name, const int64_t *shape, int ndim,
                         const ps_init *init, const ps_optimizer *opt, ps_var **out) {
  return var_create(c, name, shape, ndim, init, NULL, opt, out);
}

int ps_client_var_create_values(ps_client *c, const char *name, const int64_t *shape, int ndim,
                                const float *values, const ps_optimizer *opt, ps_var **out) {
  if (c && !values && c->worker_index == 0)
    return ps__seterr(c, PS_EINVAL, "variable '%s': the chief must give its initial values",
                      name ? name : "(null)");
  static const ps_init marker = {sizeof(ps_init), PS__INIT_VALUES, 0, 0, 0};
  return var_create(c, name, shape, ndim, values ? NULL : &marker, values, opt, out);
}

/* Queues one assign Init frame per slice of v (data from ps_var_data) for
 * r. 0 or <0 (message set; r is the caller's to release). */
static int assign_var(ps_client *c, ps_var *v, uint64_t step, ps_req *r) {
  return queue_inits(c, v, r, 1, step);
}

int ps_client_var_assign(ps_client *c, ps_var *const *vars, size_t n, uint64_t step) {
  if (!c) return PS_EINVAL;
  if (c->worker_index != 0)
    return ps__seterr(c, PS_ESTATE,
                      "ps_client_var_assign: only the chief (worker 0) assigns variables; "
                      "this is worker %d", c->worker_index);
  int rc = ps__need_minor(c, 1, "ps_client_var_assign");
  if (!rc) rc = ps__check_vars(c, vars, n, 0);
  if (rc) return rc;
  ps_req *r = ps__req_new(c, PS__REQ_INIT);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  size_t nv = vars ? n : c->nvars;
  for (size_t i = 0; i < nv && rc == 0; i++)
    rc = assign_var(c, vars ? vars[i] : c->vars[i], step, r);
  if (rc) {
    ps__req_release(c, r);
    return rc;
  }
  for (int p = 0; p < c->num_ps; p++) ps__conn_flush(c, &c->conns[p]);
  if (r->pending == 0) ps__req_finish(c, r);
  return ps__req_wait_release(c, r);
}
