/* data.h - CIFAR-10 binary loader, per-worker sampler with augmentation,
 * and evaluation batches for the CIFAR-10 example.
 *
 * File format (the official "CIFAR-10 binary version"): data_batch_1.bin ..
 * data_batch_5.bin (training) and test_batch.bin; each is a sequence of
 * 3073-byte records: 1 label byte (0..9), then 3072 pixel bytes: the 1024
 * red, 1024 green and 1024 blue values of a 32x32 image, row-major.
 *
 * Thread safety: there is no global state. Different samplers may be used
 * from different threads at once; one sampler must be used by one thread at
 * a time. A cifar_set is read-only after loading and may be shared by any
 * number of samplers and threads. */
#ifndef CIFAR_DATA_H
#define CIFAR_DATA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CIFAR_SIDE 32                              /* stored image side */
#define CIFAR_CHANNELS 3
#define CIFAR_IMAGE_BYTES (CIFAR_CHANNELS * CIFAR_SIDE * CIFAR_SIDE) /* 3072 */
#define CIFAR_RECORD_BYTES (1 + CIFAR_IMAGE_BYTES)                   /* 3073 */
#define CIFAR_CLASSES 10
#define CIFAR_TRAIN_FILES 5
#define CIFAR_CROP 24                              /* network input side */
#define CIFAR_INPUT_FLOATS (CIFAR_CHANNELS * CIFAR_CROP * CIFAR_CROP) /* 1728 */

typedef struct cifar_set {
  uint8_t *labels; /* n labels, each 0..9 */
  uint8_t *pixels; /* n * 3072 bytes, each record's pixels as in the file */
  size_t n;
} cifar_set;

/* Training set: data_batch_1.bin, data_batch_2.bin, ... read in that order
 * and concatenated. data_batch_1.bin must exist; the files taken are the
 * consecutive run data_batch_1..data_batch_K (K <= 5) that exist, so a
 * smaller data set may ship only the first few files. A gap (a missing
 * data_batch_k.bin while a later data_batch_j.bin, j > k, exists) is an
 * error, so a lost file is never silently skipped.
 * Test set: test_batch.bin.
 * Every file is checked: it must open, its size must be a non-zero multiple
 * of 3073 bytes and every label must be 0..9. On error, returns -1 with a
 * message naming the file and the problem in err (when err and errlen > 0),
 * e.g. "/x/data_batch_3.bin: size 30729 is not a whole number of 3073-byte
 * records" or "/x/test_batch.bin: record 17 has label 12 (expected 0..9)"
 * (records are numbered from 0 within the file) and *out left empty.
 * Returns 0 on success; free with cifar_set_free. */
int cifar_load_train(const char *dir, cifar_set *out, char *err, size_t errlen);
int cifar_load_test(const char *dir, cifar_set *out, char *err, size_t errlen);
/* Frees the arrays and zeroes *s. NULL and an already freed set are fine. */
void cifar_set_free(cifar_set *s);

/* ---- training sampler ---------------------------------------------------
 * Every epoch is a permutation perm_e of the whole set, a pure function of
 * (seed, e) and the same on every worker. Global step s with W workers of
 * batch B covers the positions s*W*B .. s*W*B + W*B - 1 of the endless
 * sequence perm_0, perm_1, ... (position p is record perm_{p/n}[p % n]);
 * worker w takes the B positions starting at s*W*B + w*B. So in every
 * epoch the workers' shards are disjoint and cover the set, each shard is
 * drawn afresh every epoch, and W workers of batch B see exactly the
 * images 1 worker of batch W*B sees (the equivalence the tests check).
 *
 * Augmentation of the sample at position q of epoch e: a 24x24 crop at
 * offset (dy, dx) in 0..8 x 0..8 and a horizontal flip with probability
 * 1/2, drawn from a hash of (seed, e, q): it depends on the sample, not on
 * which worker trains on it. A batch depends only on (set, W, worker,
 * seed, step, B): a resumed run that restarts at step k gets exactly the
 * batches the original run got.
 *
 * Standardization (as TensorFlow's per_image_standardization, on the pixel
 * values 0..255 of the 24x24x3 crop): (x - mean) / max(stddev,
 * 1/sqrt(1728)), with the population stddev over the 1728 values. */
typedef struct cifar_sampler cifar_sampler;

/* The set must outlive the sampler (it is not copied). Returns NULL (errno
 * EINVAL) if num_workers < 1, worker is not in 0..num_workers-1 or the
 * shard would be empty (s->n <= worker); NULL (errno ENOMEM) if out of
 * memory. */
cifar_sampler *cifar_sampler_create(const cifar_set *s, int worker, int num_workers,
                                    uint64_t seed);
/* This worker's share of an epoch (records). */
size_t cifar_sampler_size(const cifar_sampler *sp);
/* Fills images (B * 3 * 24 * 24 floats, NCHW: per image the 24x24 red plane,
 * then green, then blue) and labels (B bytes) with the batch of global step
 * `step`. Returns the fractional epoch of the global batch's first
 * position, step*W*B / n (0.0 for the first step, 1.0 when the second epoch
 * starts).
 * B must be >= 1. */
double cifar_sampler_batch(cifar_sampler *sp, uint64_t step, int B, float *images,
                           uint8_t *labels);
void cifar_sampler_destroy(cifar_sampler *sp);

/* TensorFlow's random_contrast for the training batches: each image's
 * channels get their deviations from the channel's mean scaled by a factor
 * uniform in [lo, hi] (drawn from the image's augmentation hash, so any
 * split of a global batch sees the same images), before the
 * standardization. TF's CIFAR-10 recipe uses 0.2 and 1.8; its
 * random_brightness is left out: the standardization subtracts any
 * brightness shift exactly. Default 1, 1: none (bit-identical to no
 * contrast). 0, or -1 with errno EINVAL unless 0 < lo <= hi < 100. */
int cifar_sampler_set_contrast(cifar_sampler *sp, double lo, double hi);

/* ---- evaluation ----------------------------------------------------------
 * Records first .. first+B-1 of s, centre crop (offset 4,4; no flip), then
 * the same standardization, into images (B*1728 floats, NCHW) and labels.
 * Only records that exist are written: if first+B > s->n, the slots past
 * the end of the set are left untouched, so pass B = min(B, n - first) for
 * the last partial batch. */
void cifar_eval_batch(const cifar_set *s, size_t first, int B, float *images,
                      uint8_t *labels);

/* The same for one of CIFAR_EVAL_VIEWS views of each image, for evaluation
 * that averages the network's predictions over several views (AlexNet's
 * ten crops): view % 5 picks the centre crop (0) or a corner (1 top left,
 * 2 top right, 3 bottom left, 4 bottom right), view >= 5 flips it
 * horizontally. View 0 is cifar_eval_batch's; a view out of range is 0. */
#define CIFAR_EVAL_VIEWS 10
void cifar_eval_view(const cifar_set *s, size_t first, int B, int view, float *images,
                     uint8_t *labels);

#ifdef __cplusplus
}
#endif

#endif
