/*
 * shard.h - the slices this ps holds and their SyncReplicas state.
 *
 * A slice is a contiguous range of one variable with its own parameters,
 * optimizer state and step counter. Parameters are at step s (the number of
 * updates applied). A gradient computed at step t < s is stale; at t == s it
 * is accumulated, once per worker; when replicas_to_aggregate gradients are
 * in (or the variable's own rule's count, ps_optimizer.aggregate: every
 * worker's, or the first alone), their average is applied and the slice
 * moves to s+1. In async mode
 * every gradient is applied at once. Everything here runs on the event-loop
 * thread, so an update is never observed half-applied.
 */
#ifndef PSD_SHARD_H
#define PSD_SHARD_H

#include <stdint.h>

#include "ps/errno.h"
#include "ps/types.h"


struct psd_ckptq_rec;

typedef struct psd_slice {
  uint32_t id;             /* index in the shard, used on the wire */
  char *name;              /* variable name */
  uint32_t ndim;           /* variable's rank */
  uint64_t shape[PS_MAX_DIMS]; /* variable's shape */
  uint64_t numel;          /* elements in the whole variable */
  uint64_t offset;         /* first element of this slice */
  uint64_t length;         /* elements in this slice */
  ps_optimizer opt;        /* update rule, agreed by all workers */
  int32_t created_by;      /* worker whose Register created it (named in
                              conflicts: "registered first by worker N") */
  float *param;            /* parameters, length floats */
  float *acc;              /* sum of this step's gradients so far */
  float *state;            /* optimizer state, the moving average last (0-4
                              x length floats, psd_opt_state_per_elem) */
  int initialized;         /* the chief has sent initial values */
  int assign_pending;      /* sync: acc holds the values the chief assigned at
                              `step`; they replace this step's update */
  uint64_t step;           /* updates applied so far */
  uint32_t count;          /* gradients accumulated for `step` */
  uint64_t *pushed;        /* per worker: step+1 of its last accepted push */
  double first_grad_at;    /* when this step's first gradient came */
  double stall_logged_at;  /* last stall log line for this step */
  uint32_t readers;        /* queued replies sending param in place */
  uint64_t ck_gen;         /* checkpoint attempt that holds it (persist.c) */
  struct psd_ckptq_rec *ck_hold; /* its record the checkpoint writer has yet to
                                    read in place (ckptq.h), or NULL */
  struct psd_slice *hnext; /* hash chain by (name, offset) */
} psd_slice;

typedef struct psd_shard {
  psd_slice **slices;      /* by id */
  uint32_t n;              /* slices in use */
  uint32_t cap;            /* allocated entries of slices */
  psd_slice **htab;        /* hash of (name, offset) -> slice */
  uint32_t hcap;           /* buckets, power of two */
  uint32_t num_workers;    /* sizes the per-worker arrays */
  uint32_t replicas;       /* gradients per step (sync) */
  int async_mode;          /* apply every gradient at once */
  uint64_t stale_dropped;  /* gradients that came too late */
  uint64_t bytes_held;     /* parameter bytes in this shard */
  uint64_t bytes_alloc;    /* all tensor bytes: params, sums, optimizer state */
  /* Called before an update of a slice whose parameters queued replies
   * (readers > 0) or the checkpoint writer (ck_hold) still reference: the
   * owner copies those bytes out so the replies and the file stay
   * consistent and the update never waits for a slow reader or disk. */
  void (*detach)(void *ctx, psd_slice *sl);
  void *detach_ctx;
} psd_shard;

void psd_shard_init(psd_shard *s, uint32_t num_workers, uint32_t replicas,
                    int async_mode);
void psd_shard_free(psd_shard *s);

/* Looks up or creates the slice [offset, offset+length) of variable name
 * for `worker`. An existing one must agree on shape and optimizer (else
 * PS_ESHAPE or PS_EMISMATCH, with err naming the variable, both shapes or
 * the differing optimizer field with both values, and the worker that
 * registered it first). Returns 0 and *out. */
int psd_shard_register(psd_shard *s, const char *name, uint32_t ndim,
                       const uint64_t *shape, uint64_t offset, uint64_t length,
                       const ps_optimizer *opt, int worker, psd_slice **out, char *err,
                       size_t errlen);

/* Sets initial values (length floats) of an uninitialized slice; a slice
 * already initialized keeps its values (returns 0: the chief may restart). */
int psd_shard_init_values(psd_shard *s, psd_slice *sl, const float *values);

/* The chief's assign of values (length floats) at the boundary of its step
 * (docs/protocol.md, "Assign"). Sync mode, trainable slice: the slice must
 * be at `step`; the values become its parameters at step + 1, replacing
 * that step's update (its gradients still count to complete it). Not
 * trainable: the values replace the parameters now and the step becomes
 * step + 1. Async mode: the values replace the parameters now. Returns 1
 * if the slice's step changed (wake its pulls), 0, or PS_ESTATE (not
 * initialized), PS_ESTALE (the slice is past the step), PS_EINVAL (a step
 * the slice has not reached), with a sentence in err. */
int psd_shard_assign(psd_shard *s, psd_slice *sl, uint64_t step, const float *values,
                     char *err, size_t errlen);

/* Offers worker's gradient (length floats) computed at step. Returns 1 if
 * the slice advanced, 0 if accumulated, or PS_ESTALE (too late: dropped),
 * PS_EDUPLICATE (worker already pushed this step), PS_ESTATE (slice not
 * initialized), PS_EINVAL (a step the slice has not reached),
 * PS_EUNSUPPORTED (the variable is not trainable). */
int psd_shard_push(psd_shard *s, psd_slice *sl, uint32_t worker, uint64_t step,
                   const float *grad, double now);

/* Gradients that complete a step of sl: the job's replicas, or its
 * variable's own rule (ps_optimizer.aggregate). */
uint32_t psd_shard_slice_replicas(const psd_shard *s, const psd_slice *sl);

/* Workers that have not pushed to sl for its current step: fills
 * missing[0..n) and returns n. */
uint32_t psd_shard_slice_missing(const psd_shard *s, const psd_slice *sl,
                                 uint32_t *missing, uint32_t cap);

#endif
