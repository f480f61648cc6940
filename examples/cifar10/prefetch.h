/* prefetch.h - the next training batch prepared in a background thread
 * (sampling, crop/flip augmentation, standardization: data.h) while the
 * current step trains, so that data loading never holds up the device.
 *
 * A batch is a pure function of the step (data.h), so the prefetcher
 * simply guesses that step s is followed by step s+1; when a step is
 * skipped (a stale worker jumps ahead), the guess is dropped and the asked
 * batch is made on the spot. Either way the batch is byte for byte what
 * cifar_sampler_batch gives for that step. */
#ifndef CIFAR_PREFETCH_H
#define CIFAR_PREFETCH_H

#include <stdint.h>

#include "data.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cifar_prefetch cifar_prefetch;

/* Starts the thread. images[0..1] (B * 1728 floats each) and labels[0..1]
 * (B bytes each) are the caller's buffers (page-locked ones let a GPU copy
 * straight from them), used in turn; they and the sampler must outlive the
 * prefetcher, and from now on only the prefetcher uses the sampler.
 * NULL (errno set) on bad arguments or if the thread cannot start. */
cifar_prefetch *cifar_prefetch_create(cifar_sampler *sp, int B, float *images[2],
                                      uint8_t *labels[2]);
/* The batch of global step `step`: *images and *labels point into one of
 * the two buffer pairs and stay valid until the next call. Starts
 * preparing step+1 in the other pair before returning. Returns the epoch,
 * as cifar_sampler_batch. One thread at a time. */
double cifar_prefetch_get(cifar_prefetch *pf, uint64_t step, const float **images,
                          const uint8_t **labels);
/* Batches served from the background (the guess was right). */
uint64_t cifar_prefetch_hits(const cifar_prefetch *pf);
/* Stops the thread (after the batch it is on). NULL ok. */
void cifar_prefetch_destroy(cifar_prefetch *pf);

#ifdef __cplusplus
}
#endif
#endif
