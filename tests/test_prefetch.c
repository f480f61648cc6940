/* Tests of examples/cifar10/prefetch.c: batches prepared in the background
 * are byte for byte the unprefetched sampler's for the same step, whether
 * steps follow each other (served from the background), repeat or jump
 * ahead (made on the spot); the two buffer pairs alternate. */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "data.h"
#include "prefetch.h"

Suite *suite_prefetch(void);

/* A small in-memory set: n records of random pixels and labels. */
static void make_set(cifar_set *s, size_t n, uint64_t seed) {
  s->n = n;
  s->labels = malloc(n);
  s->pixels = malloc(n * CIFAR_IMAGE_BYTES);
  ck_assert_ptr_nonnull(s->labels);
  ck_assert_ptr_nonnull(s->pixels);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n * CIFAR_IMAGE_BYTES; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    s->pixels[i] = (uint8_t)(x >> 32);
  }
  for (size_t i = 0; i < n; i++) s->labels[i] = (uint8_t)(i * 7 % CIFAR_CLASSES);
}

START_TEST(test_same_batches) {
  cifar_set set;
  make_set(&set, 700, 3);
  int W = 3, w = 1, B = 32;
  /* the reference sampler, and the one the prefetcher owns */
  cifar_sampler *ref = cifar_sampler_create(&set, w, W, 9);
  cifar_sampler *sp = cifar_sampler_create(&set, w, W, 9);
  ck_assert_ptr_nonnull(ref);
  ck_assert_ptr_nonnull(sp);
  size_t nimg = (size_t)B * CIFAR_INPUT_FLOATS;
  float *img[2] = {malloc(nimg * sizeof(float)), malloc(nimg * sizeof(float))};
  uint8_t *lab[2] = {malloc(B), malloc(B)};
  float *rimg = malloc(nimg * sizeof(float));
  uint8_t *rlab = malloc(B);
  cifar_prefetch *pf = cifar_prefetch_create(sp, B, img, lab);
  ck_assert_ptr_nonnull(pf);
  /* runs of consecutive steps (epochs roll over at 700 / 96 = 7.3 steps),
   * a repeat, a jump ahead, a step back */
  static const uint64_t steps[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 15, 16, 17, 40, 41, 3, 4};
  size_t ns = sizeof steps / sizeof steps[0];
  uint64_t sequential = 0;
  const float *prev = NULL;
  for (size_t i = 0; i < ns; i++) {
    const float *bi;
    const uint8_t *bl;
    double e = cifar_prefetch_get(pf, steps[i], &bi, &bl);
    double re = cifar_sampler_batch(ref, steps[i], B, rimg, rlab);
    ck_assert_msg(memcmp(bi, rimg, nimg * sizeof(float)) == 0,
                  "step %llu: images differ from the unprefetched batch",
                  (unsigned long long)steps[i]);
    ck_assert_msg(memcmp(bl, rlab, (size_t)B) == 0, "step %llu: labels differ",
                  (unsigned long long)steps[i]);
    ck_assert_double_eq(e, re);
    ck_assert(bi == img[0] || bi == img[1]);
    ck_assert(bi != prev); /* the pair the caller holds is never overwritten */
    prev = bi;
    if (i > 0 && steps[i] == steps[i - 1] + 1) sequential++;
  }
  /* every consecutive step came from the background, nothing else did */
  ck_assert_uint_eq(cifar_prefetch_hits(pf), sequential);
  cifar_prefetch_destroy(pf);
  cifar_prefetch_destroy(NULL);
  cifar_sampler_destroy(sp);
  cifar_sampler_destroy(ref);
  free(img[0]); free(img[1]); free(lab[0]); free(lab[1]); free(rimg); free(rlab);
  cifar_set_free(&set);
}
END_TEST

START_TEST(test_bad_args) {
  float *img[2] = {NULL, NULL};
  uint8_t *lab[2] = {NULL, NULL};
  cifar_set set;
  make_set(&set, 10, 1);
  cifar_sampler *sp = cifar_sampler_create(&set, 0, 1, 1);
  ck_assert_ptr_null(cifar_prefetch_create(sp, 4, img, lab));
  ck_assert_ptr_null(cifar_prefetch_create(NULL, 4, img, lab));
  cifar_sampler_destroy(sp);
  cifar_set_free(&set);
}
END_TEST

Suite *suite_prefetch(void) {
  Suite *s = suite_create("prefetch");
  TCase *tc = tcase_create("prefetch");
  tcase_add_test(tc, test_same_batches);
  tcase_add_test(tc, test_bad_args);
  suite_add_tcase(s, tc);
  return s;
}
