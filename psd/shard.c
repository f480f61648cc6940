/* shard.c - slices, their registration and the SyncReplicas rule. */
#include "shard.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "invariant.h"
#include "average.h"
#include "optimizer.h"
#include "wire.h"

/* Alignment of tensor buffers: whole cache lines, full-width vectors. */
#define PSD_TENSOR_ALIGN 64

static float *alloc_floats(uint64_t n) {
  void *p = NULL;
  size_t bytes = (size_t)(n ? n : 1) * sizeof(float);
  bytes = (bytes + PSD_TENSOR_ALIGN - 1) / PSD_TENSOR_ALIGN * PSD_TENSOR_ALIGN;
  if (posix_memalign(&p, PSD_TENSOR_ALIGN, bytes) != 0) return NULL;
  memset(p, 0, bytes);
  return p;
}

static uint32_t hash_key(const char *name, uint64_t offset) {
  uint64_t h = 1469598103934665603ULL;
  for (const unsigned char *p = (const unsigned char *)name; *p; p++)
    h = (h ^ *p) * 1099511628211ULL;
  h ^= offset * 0x9e3779b97f4a7c15ULL;
  return (uint32_t)(h ^ (h >> 32));
}

void psd_shard_init(psd_shard *s, uint32_t num_workers, uint32_t replicas,
                    int async_mode) {
  memset(s, 0, sizeof *s);
  s->num_workers = num_workers;
  s->replicas = replicas;
  s->async_mode = async_mode;
}

static void slice_free(psd_slice *sl) {
  if (!sl) return;
  free(sl->name);
  free(sl->param);
  free(sl->acc);
  free(sl->state);
  free(sl->pushed);
  free(sl);
}

void psd_shard_free(psd_shard *s) {
  for (uint32_t i = 0; i < s->n; i++) slice_free(s->slices[i]);
  free(s->slices);
  free(s->htab);
  memset(s, 0, sizeof *s);
}

static int rehash(psd_shard *s, uint32_t ncap) {
  psd_slice **nt = calloc(ncap, sizeof *nt);
  if (!nt) return PS_ENOMEM;
  for (uint32_t i = 0; i < s->n; i++) {
    psd_slice *sl = s->slices[i];
    uint32_t b = hash_key(sl->name, sl->offset) & (ncap - 1);
    sl->hnext = nt[b];
    nt[b] = sl;
  }
  free(s->htab);
  s->htab = nt;
  s->hcap = ncap;
  return 0;
}

/* "[3, 4]": a shape for conflict messages. */
static void fmt_shape(char *buf, size_t len, uint32_t ndim, const uint64_t *shape) {
  size_t o = 0;
  buf[0] = '\0';
  for (uint32_t d = 0; d < ndim && o < len; d++) {
    int n = snprintf(buf + o, len - o, "%s%llu", d ? ", " : "[", (unsigned long long)shape[d]);
    if (n < 0) return;
    o += (size_t)n;
  }
  if (o < len) snprintf(buf + o, len - o, "]");
}

/* PS_ESHAPE: name exists here as sl, with another shape than the one
 * `worker` asks for; err shows both and who registered it first. */
static int shape_conflict(const psd_slice *sl, const char *name, uint32_t ndim,
                          const uint64_t *shape, uint64_t offset, uint64_t length, int worker,
                          char *err, size_t errlen) {
  char have[200], want[200];
  fmt_shape(have, sizeof have, sl->ndim, sl->shape);
  fmt_shape(want, sizeof want, ndim, shape);
  snprintf(err, errlen,
           "variable '%s' has shape %s here (slice at %llu of %llu elements), registered "
           "first by worker %d; worker %d asks for shape %s (slice at %llu of %llu elements)",
           PS__ESC(name), have, (unsigned long long)sl->offset, (unsigned long long)sl->length,
           (int)sl->created_by, worker, want, (unsigned long long)offset,
           (unsigned long long)length);
  return PS_ESHAPE;
}

int psd_shard_register(psd_shard *s, const char *name, uint32_t ndim,
                       const uint64_t *shape, uint64_t offset, uint64_t length,
                       const ps_optimizer *opt, int worker, psd_slice **out, char *err,
                       size_t errlen) {
  if (s->hcap) {
    uint32_t b = hash_key(name, offset) & (s->hcap - 1);
    for (psd_slice *sl = s->htab[b]; sl; sl = sl->hnext) {
      if (sl->offset != offset || strcmp(sl->name, name) != 0) continue;
      int same_shape = sl->ndim == ndim && sl->length == length;
      for (uint32_t d = 0; same_shape && d < ndim; d++)
        same_shape = sl->shape[d] == shape[d];
      if (!same_shape)
        return shape_conflict(sl, name, ndim, shape, offset, length, worker, err, errlen);
      char diff[300], la[48], lb[48];
      snprintf(la, sizeof la, "worker %d, who registered it first", (int)sl->created_by);
      snprintf(lb, sizeof lb, "worker %d", worker);
      if (ps__opt_diff(&sl->opt, la, opt, lb, diff, sizeof diff)) {
        snprintf(err, errlen, "variable '%s' has another optimizer here: %s", PS__ESC(name),
                 diff);
        return PS_EMISMATCH;
      }
      *out = sl;
      return 0;
    }
  }
  for (uint32_t i = 0; i < s->n; i++) {
    /* A different slicing of a known variable would double-count
     * elements: the same name must always come with the same numel. */
    psd_slice *o = s->slices[i];
    if (strcmp(o->name, name) != 0) continue;
    int same_shape = o->ndim == ndim;
    for (uint32_t d = 0; same_shape && d < ndim; d++) same_shape = o->shape[d] == shape[d];
    if (!same_shape)
      return shape_conflict(o, name, ndim, shape, offset, length, worker, err, errlen);
    if (offset < o->offset + o->length && o->offset < offset + length) {
      snprintf(err, errlen,
               "slice [%llu, %llu) of variable '%s' overlaps the registered slice [%llu, %llu)",
               (unsigned long long)offset, (unsigned long long)(offset + length), PS__ESC(name),
               (unsigned long long)o->offset, (unsigned long long)(o->offset + o->length));
      return PS_ESHAPE;
    }
    break; /* shapes agree; overlap is checked against one slice only */
  }
  if (s->n >= 0x7fffffffu) {
    snprintf(err, errlen, "too many slices");
    return PS_ETOOBIG;
  }
  psd_slice *sl = calloc(1, sizeof *sl);
  if (!sl) goto nomem;
  sl->name = strdup(name);
  sl->ndim = ndim;
  sl->numel = 1;
  for (uint32_t d = 0; d < ndim; d++) {
    sl->shape[d] = shape[d];
    sl->numel *= shape[d]; /* caller checked for overflow */
  }
  sl->offset = offset;
  sl->length = length;
  sl->opt = *opt;
  sl->created_by = worker;
  sl->param = alloc_floats(length);
  sl->acc = alloc_floats(length);
  size_t per = psd_opt_state_per_elem(opt);
  sl->state = per ? alloc_floats(length * per) : NULL;
  sl->pushed = calloc(s->num_workers ? s->num_workers : 1, sizeof *sl->pushed);
  if (!sl->name || !sl->param || !sl->acc || (per && !sl->state) || !sl->pushed)
    goto nomem;
  psd_opt_state_init(opt, sl->state, length);
  if (s->n == s->cap) {
    uint32_t ncap = s->cap ? s->cap * 2 : 64;
    psd_slice **ns = realloc(s->slices, ncap * sizeof *ns);
    if (!ns) goto nomem;
    s->slices = ns;
    s->cap = ncap;
  }
  sl->id = s->n;
  s->slices[s->n++] = sl;
  if (s->n * 2 > s->hcap) {
    if (rehash(s, s->hcap ? s->hcap * 2 : 128) != 0) {
      s->n--;
      goto nomem;
    }
  } else {
    uint32_t b = hash_key(name, offset) & (s->hcap - 1);
    sl->hnext = s->htab[b];
    s->htab[b] = sl;
  }
  s->bytes_held += length * sizeof(float);
  s->bytes_alloc += length * sizeof(float) * (2 + per);
  *out = sl;
  return 0;
nomem:
  slice_free(sl);
  snprintf(err, errlen, "out of memory registering variable '%s' (%llu elements)",
           PS__ESC(name), (unsigned long long)length);
  return PS_ENOMEM;
}

int psd_shard_init_values(psd_shard *s, psd_slice *sl, const float *values) {
  (void)s;
  if (sl->initialized) return 0;
  memcpy(sl->param, values, sl->length * sizeof(float));
  psd_avg_start(&sl->opt, sl->state, sl->param, sl->length);
  sl->initialized = 1;
  sl->step = 0;
  return 0;
}

/* acc += g over n floats (auto-vectorized). */
static void add_into(float *restrict acc, const float *restrict g, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) acc[i] += g[i];
}

/* The slice's step advanced to sl->step with new parameters: its moving
 * average (if any) takes them in. Called on every path that advances the
 * step (an applied update, a chief's assign that replaces one), never on
 * a training step's wire path. */
static void after_step(psd_slice *sl) {
  psd_avg_update(&sl->opt, sl->step, sl->state, sl->param, sl->length);
}

/* Makes sure no queued reply or checkpoint record still reads sl's
 * parameters in place. */
static void before_update(psd_shard *s, psd_slice *sl) {
  if ((sl->readers > 0 || sl->ck_hold) && s->detach) s->detach(s->detach_ctx, sl);
}

int psd_shard_assign(psd_shard *s, psd_slice *sl, uint64_t step, const float *values,
                     char *err, size_t errlen) {
  unsigned long long at = (unsigned long long)sl->step, want = (unsigned long long)step;
  if (!sl->initialized) {
    snprintf(err, errlen, "cannot assign '%s': it is not initialized yet", PS__ESC(sl->name));
    return PS_ESTATE;
  }
  if (sl->opt.kind == PS_OPT_NONE || s->async_mode) {
    /* Nothing else changes these parameters at a step: replace them now. */
    if (!s->async_mode && sl->step > step + 1) {
      snprintf(err, errlen,
               "cannot assign '%s' for step %llu: the chief already assigned it for step %llu",
               PS__ESC(sl->name), want, at - 1);
      return PS_ESTALE;
    }
    before_update(s, sl);
    memcpy(sl->param, values, sl->length * sizeof(float));
    if (s->async_mode || sl->step == step + 1) return 0;
    sl->step = step + 1;
    after_step(sl);
    return 1;
  }
  if (sl->step != step) {
    snprintf(err, errlen,
             sl->step > step
                 ? "cannot assign '%s' (slice at %llu) for step %llu: it is at step %llu "
                   "already (backup workers completed the step without the chief)"
                 : "cannot assign '%s' (slice at %llu) for step %llu: it is only at step %llu",
             PS__ESC(sl->name), (unsigned long long)sl->offset, want, at);
    return sl->step > step ? PS_ESTALE : PS_EINVAL;
  }
  /* This step's gradients would only be overwritten: acc now holds the
   * values, and the step's last gradient installs them. */
  memcpy(sl->acc, values, sl->length * sizeof(float));
  sl->assign_pending = 1;
  return 0;
}

uint32_t psd_shard_slice_replicas(const psd_shard *s, const psd_slice *sl) {
  switch (sl->opt.aggregate) {
    case PS_AGGREGATE_ALL: return s->num_workers;
    case PS_AGGREGATE_FIRST: return 1;
    default: return s->replicas;
  }
}

int psd_shard_push(psd_shard *s, psd_slice *sl, uint32_t worker, uint64_t step,
                   const float *grad, double now) {
  if (sl->opt.kind == PS_OPT_NONE) return PS_EUNSUPPORTED;
  if (!sl->initialized) return PS_ESTATE;
  if (s->async_mode) {
    before_update(s, sl);
    psd_opt_apply(&sl->opt, sl->step, sl->param, sl->state, grad, NULL, 1.0f,
                  sl->length);
    sl->step++;
    after_step(sl);
    return 1;
  }
  if (step < sl->step) {
    s->stale_dropped++;
    return PS_ESTALE;
  }
  if (step > sl->step) return PS_EINVAL;
  const uint32_t replicas = psd_shard_slice_replicas(s, sl);
  PS_ASSERT(worker < s->num_workers && sl->count < replicas);
  if (sl->pushed[worker] == step + 1) return PS_EDUPLICATE;
  sl->pushed[worker] = step + 1;
  if (sl->count + 1 >= replicas) {
    /* Last gradient of the step: average and apply in one fused pass. */
    before_update(s, sl);
    if (sl->assign_pending) {
      /* The chief's values are the parameters of step + 1. */
      memcpy(sl->param, sl->acc, sl->length * sizeof(float));
      sl->assign_pending = 0;
    } else {
      float scale = 1.0f / (float)(sl->count + 1);
      psd_opt_apply(&sl->opt, sl->step, sl->param, sl->state, grad,
                    sl->count ? sl->acc : NULL, scale, sl->length);
    }
    sl->count = 0;
    sl->step++;
    after_step(sl);
    sl->stall_logged_at = 0;
    return 1;
  }
  if (sl->count == 0) sl->first_grad_at = now;
  if (sl->assign_pending)
    ; /* acc holds the assigned values: this step's gradients are dropped */
  else if (sl->count == 0)
    memcpy(sl->acc, grad, sl->length * sizeof(float));
  else
    add_into(sl->acc, grad, sl->length);
  sl->count++;
  return 0;
}

uint32_t psd_shard_slice_missing(const psd_shard *s, const psd_slice *sl,
                                 uint32_t *missing, uint32_t cap) {
  uint32_t n = 0;
  for (uint32_t w = 0; w < s->num_workers && n < cap; w++)
    if (sl->pushed[w] != sl->step + 1) missing[n++] = w;
  return n;
}
