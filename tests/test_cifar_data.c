/* test_cifar_data.c - examples/cifar10/data.c (loader, sampler,
 * augmentation, standardization, eval batches) and the cifar_synth tool.
 * Every test writes its own small files under a mkdtemp directory. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "data.h"
#include "testutil.h"

#define REC CIFAR_RECORD_BYTES
#define IMG CIFAR_IMAGE_BYTES
#define IN CIFAR_INPUT_FLOATS

/* ---------------------------------------------------------------------- */
/* Helpers */

static char *mk_tmpdir(void) {
  const char *base = getenv("TMPDIR");
  char *d = malloc(512);
  ck_assert_ptr_nonnull(d);
  snprintf(d, 512, "%s/cifar_data.XXXXXX", base && *base ? base : "/tmp");
  ck_assert_msg(mkdtemp(d) != NULL, "mkdtemp: %s", strerror(errno));
  return d;
}

static void rm_rf(const char *path) {
  struct stat st;
  if (lstat(path, &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    DIR *d = opendir(path);
    if (d) {
      struct dirent *e;
      while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        char sub[1024];
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        rm_rf(sub);
      }
      closedir(d);
    }
    rmdir(path);
  } else {
    unlink(path);
  }
}

static void done_tmpdir(char *d) {
  rm_rf(d);
  free(d);
}

/* Label and pixel k of the g-th record of a test data set: a recognizable
 * function of the record, so order and content can be checked exactly. */
static uint8_t exp_label(size_t g) { return (uint8_t)((g * 7 + 3) % 10); }
static uint8_t exp_pixel(size_t g, size_t k) {
  return (uint8_t)(g * 31 + k * 7 + (k >> 10) * 13 + (k * k >> 5));
}

/* Writes records [g0, g0+n) of that data set as dir/name; then `extra`
 * bytes more (negative: cuts that many bytes off the end). */
static void write_set_file(const char *dir, const char *name, size_t g0, size_t n,
                           long extra) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  size_t len = n * REC;
  uint8_t *buf = malloc(len + (extra > 0 ? (size_t)extra : 0) + 1);
  ck_assert_ptr_nonnull(buf);
  for (size_t r = 0; r < n; r++) {
    buf[r * REC] = exp_label(g0 + r);
    for (size_t k = 0; k < IMG; k++) buf[r * REC + 1 + k] = exp_pixel(g0 + r, k);
  }
  if (extra > 0) memset(buf + len, 0, (size_t)extra), len += (size_t)extra;
  if (extra < 0) len -= (size_t)(-extra);
  FILE *f = fopen(path, "wb");
  ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
  ck_assert_uint_eq(fwrite(buf, 1, len, f), len);
  ck_assert_int_eq(fclose(f), 0);
  free(buf);
}

/* Overwrites the label byte of record r of dir/name. */
static void poke_label(const char *dir, const char *name, size_t r, uint8_t label) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  int fd = open(path, O_WRONLY);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(pwrite(fd, &label, 1, (off_t)(r * REC)), 1);
  close(fd);
}

static void check_set_content(const cifar_set *s, size_t n) {
  ck_assert_uint_eq(s->n, n);
  for (size_t g = 0; g < n; g++) {
    ck_assert_uint_eq(s->labels[g], exp_label(g));
    for (size_t k = 0; k < IMG; k++)
      if (s->pixels[g * IMG + k] != exp_pixel(g, k))
        ck_abort_msg("record %zu pixel %zu: %u, want %u", g, k, s->pixels[g * IMG + k],
                     exp_pixel(g, k));
  }
}

static void assert_contains(const char *hay, const char *needle) {
  ck_assert_msg(strstr(hay, needle) != NULL, "'%s' does not contain '%s'", hay, needle);
}

static void assert_empty_set(const cifar_set *s) {
  ck_assert_ptr_null(s->labels);
  ck_assert_ptr_null(s->pixels);
  ck_assert_uint_eq(s->n, 0);
}

/* An in-memory set of n records; image r via fill(r, pixels). */
static cifar_set mem_set(size_t n, void (*fill)(size_t r, uint8_t *px)) {
  cifar_set s;
  s.n = n;
  s.labels = malloc(n);
  s.pixels = malloc(n * IMG);
  ck_assert_ptr_nonnull(s.labels);
  ck_assert_ptr_nonnull(s.pixels);
  for (size_t r = 0; r < n; r++) {
    s.labels[r] = (uint8_t)(r % 10);
    fill(r, s.pixels + r * IMG);
  }
  return s;
}

/* Uniform planes R = r+1, G = 255, B = 0: crops and flips leave them alone
 * and standardization keeps the ratio (R-B)/(G-B) = (r+1)/255, so the record
 * of a standardized image can be read back (r < 254). */
static void fill_id(size_t r, uint8_t *px) {
  memset(px, (int)(r + 1), 1024);
  memset(px + 1024, 255, 1024);
  memset(px + 2048, 0, 1024);
}

static long decode_id(const float *img) {
  double zr = img[0], zg = img[576], zb = img[1152];
  for (int k = 0; k < 576; k++) /* the planes must stay uniform */
    if (img[k] != img[0] || img[576 + k] != img[576] || img[1152 + k] != img[1152])
      return -1;
  return lround(255.0 * (zr - zb) / (zg - zb)) - 1;
}

/* Pseudo-random pixels. */
static void fill_random(size_t r, uint8_t *px) {
  uint64_t s = 0x1234567ULL + r * 0x9e3779b97f4a7c15ULL;
  for (size_t k = 0; k < IMG; k++) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    px[k] = (uint8_t)(s >> 24);
  }
}

/* Reference standardization of a 24x24 crop at (dy, dx), flipped or not,
 * all in double. */
static void ref_crop(const uint8_t *src, int dy, int dx, int flip, double *out) {
  double sum = 0, sq = 0;
  for (int c = 0; c < 3; c++)
    for (int y = 0; y < 24; y++)
      for (int x = 0; x < 24; x++) {
        int sx = flip ? dx + 23 - x : dx + x;
        double v = src[c * 1024 + (dy + y) * 32 + sx];
        out[c * 576 + y * 24 + x] = v;
        sum += v;
        sq += v * v;
      }
  double mean = sum / IN, var = sq / IN - mean * mean;
  double sd = sqrt(var > 0 ? var : 0), adj = fmax(sd, 1.0 / sqrt((double)IN));
  for (int k = 0; k < IN; k++) out[k] = (out[k] - mean) / adj;
}

static int close_img(const float *got, const double *want) {
  for (int k = 0; k < IN; k++)
    if (fabs(got[k] - want[k]) > 1e-4 * fmax(1.0, fabs(want[k]))) return 0;
  return 1;
}

/* ---------------------------------------------------------------------- */
/* Loader */

static const char *const TRAIN[5] = {"data_batch_1.bin", "data_batch_2.bin",
                                     "data_batch_3.bin", "data_batch_4.bin",
                                     "data_batch_5.bin"};

/* Writes the five training files with 3..7 records (25 in all). */
static void write_train(const char *dir) {
  size_t g = 0;
  for (int f = 0; f < 5; f++) {
    write_set_file(dir, TRAIN[f], g, (size_t)(3 + f), 0);
    g += (size_t)(3 + f);
  }
}

START_TEST(test_load_good) {
  char *dir = mk_tmpdir();
  write_train(dir);
  write_set_file(dir, "test_batch.bin", 0, 11, 0);
  cifar_set s;
  char err[512] = "";
  ck_assert_msg(cifar_load_train(dir, &s, err, sizeof err) == 0, "%s", err);
  check_set_content(&s, 25);
  cifar_set_free(&s);
  assert_empty_set(&s);
  cifar_set_free(&s); /* twice is fine */
  cifar_set_free(NULL);

  ck_assert_msg(cifar_load_test(dir, &s, err, sizeof err) == 0, "%s", err);
  check_set_content(&s, 11);
  cifar_set_free(&s);

  char slash[600]; /* a trailing slash on the directory */
  snprintf(slash, sizeof slash, "%s/", dir);
  ck_assert_msg(cifar_load_train(slash, &s, err, sizeof err) == 0, "%s", err);
  ck_assert_uint_eq(s.n, 25);
  cifar_set_free(&s);
  done_tmpdir(dir);
}
END_TEST

START_TEST(test_load_prefix_and_gap) {
  char *dir = mk_tmpdir();
  cifar_set s;
  char err[512] = "";
  /* Only data_batch_1 and _2: both are loaded. */
  write_set_file(dir, TRAIN[0], 0, 4, 0);
  write_set_file(dir, TRAIN[1], 4, 6, 0);
  ck_assert_msg(cifar_load_train(dir, &s, err, sizeof err) == 0, "%s", err);
  check_set_content(&s, 10);
  cifar_set_free(&s);
  /* data_batch_4 without data_batch_3: an error naming the missing file. */
  write_set_file(dir, TRAIN[3], 10, 2, 0);
  ck_assert_int_eq(cifar_load_train(dir, &s, err, sizeof err), -1);
  char want[700];
  snprintf(want, sizeof want, "%s/data_batch_3.bin: missing", dir);
  assert_contains(err, want);
  assert_contains(err, "data_batch_4.bin exists");
  assert_empty_set(&s);
  done_tmpdir(dir);
}
END_TEST

START_TEST(test_load_truncated) {
  char *dir = mk_tmpdir();
  write_train(dir);
  /* data_batch_3 with 10 records less one byte: 30729 bytes. */
  write_set_file(dir, TRAIN[2], 7, 10, -1);
  cifar_set s;
  char err[512] = "";
  ck_assert_int_eq(cifar_load_train(dir, &s, err, sizeof err), -1);
  char want[700];
  snprintf(want, sizeof want,
           "%s/data_batch_3.bin: size 30729 is not a whole number of 3073-byte records",
           dir);
  ck_assert_str_eq(err, want);
  assert_empty_set(&s);
  /* One byte too many in the test file. */
  write_set_file(dir, "test_batch.bin", 0, 2, 1);
  ck_assert_int_eq(cifar_load_test(dir, &s, err, sizeof err), -1);
  snprintf(want, sizeof want,
           "%s/test_batch.bin: size 6147 is not a whole number of 3073-byte records",
           dir);
  ck_assert_str_eq(err, want);
  /* A tiny errlen truncates but still terminates; NULL err is allowed. */
  char small[8];
  ck_assert_int_eq(cifar_load_test(dir, &s, small, sizeof small), -1);
  ck_assert_uint_eq(strlen(small), sizeof small - 1);
  ck_assert_int_eq(cifar_load_test(dir, &s, NULL, 0), -1);
  done_tmpdir(dir);
}
END_TEST

START_TEST(test_load_bad_label) {
  char *dir = mk_tmpdir();
  write_train(dir);
  poke_label(dir, TRAIN[1], 2, 10); /* record 2 of data_batch_2 */
  cifar_set s;
  char err[512] = "";
  ck_assert_int_eq(cifar_load_train(dir, &s, err, sizeof err), -1);
  char want[700];
  snprintf(want, sizeof want, "%s/data_batch_2.bin: record 2 has label 10", dir);
  assert_contains(err, want);
  assert_empty_set(&s);

  write_set_file(dir, "test_batch.bin", 0, 20, 0);
  poke_label(dir, "test_batch.bin", 17, 255);
  ck_assert_int_eq(cifar_load_test(dir, &s, err, sizeof err), -1);
  snprintf(want, sizeof want, "%s/test_batch.bin: record 17 has label 255", dir);
  assert_contains(err, want);
  poke_label(dir, "test_batch.bin", 17, 9); /* 9 is fine */
  ck_assert_msg(cifar_load_test(dir, &s, err, sizeof err) == 0, "%s", err);
  ck_assert_uint_eq(s.labels[17], 9);
  cifar_set_free(&s);
  done_tmpdir(dir);
}
END_TEST

START_TEST(test_load_missing) {
  char *dir = mk_tmpdir();
  cifar_set s;
  char err[512] = "", want[700];
  ck_assert_int_eq(cifar_load_train(dir, &s, err, sizeof err), -1);
  snprintf(want, sizeof want, "%s/data_batch_1.bin: ", dir);
  assert_contains(err, want);
  assert_contains(err, strerror(ENOENT));
  ck_assert_int_eq(cifar_load_test(dir, &s, err, sizeof err), -1);
  snprintf(want, sizeof want, "%s/test_batch.bin: ", dir);
  assert_contains(err, want);
  assert_contains(err, strerror(ENOENT));
  /* data_batch_2..5 without data_batch_1 is still missing data_batch_1. */
  for (int f = 1; f < 5; f++) write_set_file(dir, TRAIN[f], 0, 1, 0);
  ck_assert_int_eq(cifar_load_train(dir, &s, err, sizeof err), -1);
  snprintf(want, sizeof want, "%s/data_batch_1.bin: ", dir);
  assert_contains(err, want);
  /* A directory that does not exist. */
  ck_assert_int_eq(cifar_load_test("/nonexistent/cifar", &s, err, sizeof err), -1);
  assert_contains(err, "/nonexistent/cifar/test_batch.bin");
  assert_empty_set(&s);
  done_tmpdir(dir);
}
END_TEST

START_TEST(test_load_zero_size) {
  char *dir = mk_tmpdir();
  write_train(dir);
  write_set_file(dir, TRAIN[4], 0, 0, 0);
  cifar_set s;
  char err[512] = "", want[700];
  ck_assert_int_eq(cifar_load_train(dir, &s, err, sizeof err), -1);
  snprintf(want, sizeof want, "%s/data_batch_5.bin: file is empty", dir);
  assert_contains(err, want);
  write_set_file(dir, "test_batch.bin", 0, 0, 0);
  ck_assert_int_eq(cifar_load_test(dir, &s, err, sizeof err), -1);
  snprintf(want, sizeof want, "%s/test_batch.bin: file is empty", dir);
  assert_contains(err, want);
  /* A directory where a file is expected. */
  char sub[700];
  snprintf(sub, sizeof sub, "%s/test_batch.bin", dir);
  unlink(sub);
  ck_assert_int_eq(mkdir(sub, 0700), 0);
  ck_assert_int_eq(cifar_load_test(dir, &s, err, sizeof err), -1);
  assert_contains(err, sub);
  done_tmpdir(dir);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Sampler */

START_TEST(test_sampler_args) {
  cifar_set s = mem_set(5, fill_id);
  errno = 0;
  ck_assert_ptr_null(cifar_sampler_create(&s, 0, 0, 1));
  ck_assert_int_eq(errno, EINVAL);
  ck_assert_ptr_null(cifar_sampler_create(&s, -1, 2, 1));
  ck_assert_ptr_null(cifar_sampler_create(&s, 2, 2, 1));
  ck_assert_ptr_null(cifar_sampler_create(&s, 5, 8, 1)); /* empty share */
  cifar_sampler *sp = cifar_sampler_create(&s, 4, 8, 1); /* one record an epoch */
  ck_assert_ptr_nonnull(sp);
  ck_assert_uint_eq(cifar_sampler_size(sp), 1);
  float img[3 * IN];
  uint8_t lab[3];
  ck_assert(cifar_sampler_batch(sp, 0, 3, img, lab) == 0.0);
  for (int i = 0; i < 3; i++) {
    long id = decode_id(img + i * IN);
    ck_assert(id >= 0 && id < 5);
    ck_assert_uint_eq(lab[i], s.labels[id]);
  }
  /* Step 5 of 8 workers x 3 starts at global position 120: epoch 24. */
  ck_assert(cifar_sampler_batch(sp, 5, 3, img, lab) == 24.0);
  cifar_sampler_destroy(sp);
  cifar_sampler_destroy(NULL);
  cifar_set_free(&s);
}
END_TEST

/* Records of worker w's batch at `step` into out[0..B). */
static void batch_ids(const cifar_set *s, int w, int W, uint64_t seed, int B, uint64_t step,
                      long *out, float *img_out) {
  cifar_sampler *sp = cifar_sampler_create(s, w, W, seed);
  ck_assert_ptr_nonnull(sp);
  float *img = img_out ? img_out : malloc(sizeof(float) * IN * (size_t)B);
  uint8_t *lab = malloc((size_t)B);
  double ep = cifar_sampler_batch(sp, step, B, img, lab);
  ck_assert(fabs(ep - (double)(step * (uint64_t)B * (uint64_t)W) / (double)s->n) < 1e-12);
  for (int i = 0; i < B; i++) {
    long id = decode_id(img + (size_t)i * IN);
    ck_assert_int_ge(id, 0);
    ck_assert_int_lt(id, (long)s->n);
    ck_assert_uint_eq(lab[i], s->labels[id]);
    out[i] = id;
  }
  if (!img_out) free(img);
  free(lab);
  cifar_sampler_destroy(sp);
}

/* In every epoch the workers' batches are disjoint and cover the set. */
START_TEST(test_sampler_partition) {
  const size_t n = 112;
  const int W = 4, B = 7, EPOCHS = 3; /* 4 global steps an epoch */
  cifar_set s = mem_set(n, fill_id);
  int seen[112];
  for (int e = 0; e < EPOCHS; e++) {
    memset(seen, 0, sizeof seen);
    for (uint64_t step = (uint64_t)e * 4; step < (uint64_t)e * 4 + 4; step++)
      for (int w = 0; w < W; w++) {
        long ids[7];
        batch_ids(&s, w, W, 77, B, step, ids, NULL);
        for (int i = 0; i < B; i++) {
          ck_assert_msg(seen[ids[i]] == 0, "record %ld twice in epoch %d", ids[i], e);
          seen[ids[i]] = 1;
        }
      }
    for (size_t r = 0; r < n; r++) ck_assert_msg(seen[r], "record %zu not seen in epoch %d", r, e);
  }
  cifar_set_free(&s);
}
END_TEST

/* Orders: reproducible from the seed, different every epoch; and W workers
 * of batch B see exactly the images (augmentation included) that 1 worker
 * of batch W*B sees. */
START_TEST(test_sampler_shuffle) {
  cifar_set s = mem_set(200, fill_id);
  long a[100], b[100], c[100];
  batch_ids(&s, 0, 1, 5, 100, 0, a, NULL);
  batch_ids(&s, 0, 1, 5, 100, 0, b, NULL);
  batch_ids(&s, 0, 1, 6, 100, 0, c, NULL);
  ck_assert(memcmp(a, b, sizeof a) == 0);
  ck_assert(memcmp(a, c, sizeof a) != 0);
  long e0[200], e1[200];
  batch_ids(&s, 0, 1, 5, 200, 0, e0, NULL);
  batch_ids(&s, 0, 1, 5, 200, 1, e1, NULL);
  ck_assert_msg(memcmp(e0, e1, sizeof e0) != 0, "epochs 0 and 1 have the same order");
  int ident = 1;
  for (int k = 0; k < 200; k++) ident &= e0[k] == k;
  ck_assert_msg(!ident, "epoch 0 is not shuffled");
  cifar_set_free(&s);

  cifar_set r = mem_set(200, fill_id);
  float *one = malloc(sizeof(float) * IN * 48), *part = malloc(sizeof(float) * IN * 12);
  long ids1[48], ids2[12];
  for (uint64_t step = 0; step < 9; step += 4) { /* step 4 straddles epochs */
    batch_ids(&r, 0, 1, 9, 48, step, ids1, one);
    for (int w = 0; w < 4; w++) {
      batch_ids(&r, w, 4, 9, 12, step, ids2, part);
      ck_assert(memcmp(ids2, ids1 + w * 12, sizeof ids2) == 0);
      ck_assert_msg(memcmp(part, one + (size_t)w * 12 * IN, sizeof(float) * IN * 12) == 0,
                    "worker %d of 4 sees other pixels than 1 worker at step %llu", w,
                    (unsigned long long)step);
    }
  }
  free(one);
  free(part);
  cifar_set_free(&r);
}
END_TEST

START_TEST(test_sampler_resume) {
  cifar_set s = mem_set(300, fill_random);
  const int B = 32;
  cifar_sampler *sp = cifar_sampler_create(&s, 2, 3, 99);
  cifar_sampler *fresh = cifar_sampler_create(&s, 2, 3, 99);
  float *x = malloc(sizeof(float) * IN * B), *y = malloc(sizeof(float) * IN * B);
  uint8_t lx[32], ly[32];
  /* S = 100: steps 3, 6 and 9 (positions 96..127, 192..223, 288..319)
   * straddle two epochs, 17 (544..575) lies inside epoch 5; ask in an
   * arbitrary order. */
  const uint64_t steps[] = {17, 0, 9, 3, 9, 17, 100000, 6, 8};
  for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
    for (uint64_t t = 0; t < steps[k]; t += 1 + steps[k] / 4) /* disturb the cache */
      cifar_sampler_batch(sp, t, B, x, lx);
    double e1 = cifar_sampler_batch(sp, steps[k], B, x, lx);
    cifar_sampler_destroy(fresh);
    fresh = cifar_sampler_create(&s, 2, 3, 99);
    double e2 = cifar_sampler_batch(fresh, steps[k], B, y, ly);
    ck_assert(e1 == e2);
    ck_assert(memcmp(x, y, sizeof(float) * IN * B) == 0);
    ck_assert(memcmp(lx, ly, sizeof lx) == 0);
  }
  /* A different seed changes the augmentation even of the same records. */
  cifar_sampler *other = cifar_sampler_create(&s, 2, 3, 100);
  cifar_sampler_batch(other, 7, B, y, ly);
  ck_assert(memcmp(x, y, sizeof(float) * IN * B) != 0);
  cifar_sampler_destroy(other);
  cifar_sampler_destroy(sp);
  cifar_sampler_destroy(fresh);
  free(x);
  free(y);
  cifar_set_free(&s);
}
END_TEST

/* Each training image is a standardized 24x24 crop at some offset 0..8,
 * flipped or not, of a record of its label; all offsets and both flips
 * occur. Random pixels make every (record, offset, flip) look different. */
START_TEST(test_sampler_augmentation) {
  cifar_set s = mem_set(20, fill_random);
  const int B = 50, STEPS = 8;
  cifar_sampler *sp = cifar_sampler_create(&s, 0, 1, 3);
  float *img = malloc(sizeof(float) * IN * B);
  uint8_t lab[50];
  double *ref = malloc(sizeof(double) * IN);
  int seen_dy[9] = {0}, seen_dx[9] = {0}, seen_flip[2] = {0};
  for (int st = 0; st < STEPS; st++) {
    cifar_sampler_batch(sp, (uint64_t)st, B, img, lab);
    for (int i = 0; i < B; i++) {
      /* Try every record with that label, every offset and flip. */
      int matches = 0, mdy = -1, mdx = -1, mflip = -1;
      for (size_t r = 0; r < s.n; r++) {
        if (s.labels[r] != lab[i]) continue;
        for (int dy = 0; dy < 9; dy++)
          for (int dx = 0; dx < 9; dx++)
            for (int f = 0; f < 2; f++) {
              ref_crop(s.pixels + r * IMG, dy, dx, f, ref);
              if (close_img(img + (size_t)i * IN, ref)) {
                matches++;
                mdy = dy;
                mdx = dx;
                mflip = f;
              }
            }
      }
      ck_assert_msg(matches == 1, "step %d image %d matches %d crops", st, i, matches);
      seen_dy[mdy] = seen_dx[mdx] = seen_flip[mflip] = 1;
    }
  }
  for (int k = 0; k < 9; k++) {
    ck_assert_msg(seen_dy[k], "vertical offset %d never drawn", k);
    ck_assert_msg(seen_dx[k], "horizontal offset %d never drawn", k);
  }
  ck_assert(seen_flip[0] && seen_flip[1]);
  free(ref);
  free(img);
  cifar_sampler_destroy(sp);
  cifar_set_free(&s);
}
END_TEST

/* The crop (record, offsets, flip) an image without contrast came from. */
static void find_crop(const cifar_set *s, const float *img, uint8_t lab, size_t *rec, int *cdy,
                      int *cdx, int *cflip, double *ref) {
  int matches = 0;
  for (size_t r = 0; r < s->n; r++) {
    if (s->labels[r] != lab) continue;
    for (int dy = 0; dy < 9; dy++)
      for (int dx = 0; dx < 9; dx++)
        for (int f = 0; f < 2; f++) {
          ref_crop(s->pixels + r * IMG, dy, dx, f, ref);
          if (close_img(img, ref)) *rec = r, *cdy = dy, *cdx = dx, *cflip = f, matches++;
        }
  }
  ck_assert_int_eq(matches, 1);
}

/* TF's adjust_contrast by f on a crop, then the standardization, in double. */
static void ref_contrast(const uint8_t *src, int dy, int dx, int flip, double f, double *out) {
  double sum = 0, sq = 0;
  for (int c = 0; c < 3; c++) {
    double m = 0;
    for (int y = 0; y < 24; y++)
      for (int x = 0; x < 24; x++) m += src[c * 1024 + (dy + y) * 32 + (flip ? dx + 23 - x : dx + x)];
    m /= 576;
    for (int y = 0; y < 24; y++)
      for (int x = 0; x < 24; x++) {
        double v = (src[c * 1024 + (dy + y) * 32 + (flip ? dx + 23 - x : dx + x)] - m) * f + m;
        out[c * 576 + y * 24 + x] = v;
        sum += v;
        sq += v * v;
      }
  }
  double mean = sum / IN, var = sq / IN - mean * mean;
  double sd = fmax(sqrt(var > 0 ? var : 0), 1.0 / sqrt((double)IN));
  for (int k = 0; k < IN; k++) out[k] = (out[k] - mean) / sd;
}

/* cifar_sampler_set_contrast: factor 1 is the sampler without it, bit for
 * bit; a fixed factor is TF's adjust_contrast before the standardization,
 * on the same crops; 0.2..1.8 draws factors across that range. */
START_TEST(test_sampler_contrast) {
  cifar_set s = mem_set(20, fill_random);
  enum { B = 40 };
  float *a = malloc(sizeof(float) * IN * B), *b = malloc(sizeof(float) * IN * B);
  uint8_t la[B], lb[B];
  double *ref = malloc(sizeof(double) * IN);
  cifar_sampler *sa = cifar_sampler_create(&s, 0, 1, 9), *sb = cifar_sampler_create(&s, 0, 1, 9);
  ck_assert_int_eq(cifar_sampler_set_contrast(sb, 1, 1), 0);
  cifar_sampler_batch(sa, 3, B, a, la);
  cifar_sampler_batch(sb, 3, B, b, lb);
  ck_assert(memcmp(a, b, sizeof(float) * IN * B) == 0);
  ck_assert_int_eq(cifar_sampler_set_contrast(sb, 0.5, 0.5), 0);
  cifar_sampler_batch(sb, 3, B, b, lb);
  for (int i = 0; i < B; i++) {
    size_t r;
    int dy, dx, flip;
    find_crop(&s, a + (size_t)i * IN, la[i], &r, &dy, &dx, &flip, ref);
    ref_contrast(s.pixels + r * IMG, dy, dx, flip, 0.5, ref);
    ck_assert_msg(close_img(b + (size_t)i * IN, ref), "image %d", i);
  }
  /* 0.2..1.8: the factor of each image, recovered from the slope of its
   * first channel against the image without contrast (see ref_contrast). */
  ck_assert_int_eq(cifar_sampler_set_contrast(sb, 0.2, 1.8), 0);
  cifar_sampler_batch(sb, 3, B, b, lb);
  double lo = 10, hi = 0;
  for (int i = 0; i < B; i++) {
    size_t r;
    int dy, dx, flip;
    find_crop(&s, a + (size_t)i * IN, la[i], &r, &dy, &dx, &flip, ref);
    double best = -1, err = 1e9;
    for (double f = 0.19; f <= 1.81; f += 0.0005) {
      ref_contrast(s.pixels + r * IMG, dy, dx, flip, f, ref);
      double e = 0;
      for (int k = 0; k < IN; k++) e = fmax(e, fabs(b[(size_t)i * IN + k] - ref[k]));
      if (e < err) err = e, best = f;
    }
    ck_assert_msg(err < 2e-3, "image %d fits no factor in [0.2, 1.8] (best %g, error %g)", i,
                  best, err);
    lo = fmin(lo, best), hi = fmax(hi, best);
  }
  ck_assert_msg(lo < 0.6 && hi > 1.4, "factors drawn only in [%g, %g]", lo, hi);
  ck_assert_int_eq(cifar_sampler_set_contrast(sb, 0, 1), -1);
  ck_assert_int_eq(cifar_sampler_set_contrast(sb, 1.5, 1), -1);
  cifar_sampler_destroy(sa);
  cifar_sampler_destroy(sb);
  free(ref);
  free(a);
  free(b);
  cifar_set_free(&s);
}
END_TEST

/* Samplers used from several threads at once (one each) give the same
 * batches as used one after the other: no hidden shared state. */
typedef struct {
  const cifar_set *set;
  int worker;
  float *img; /* 20 steps of B = 16 */
  uint8_t lab[20 * 16];
} thread_job;

static void *thread_run(void *arg) {
  thread_job *j = arg;
  cifar_sampler *sp = cifar_sampler_create(j->set, j->worker, 2, 8);
  for (uint64_t st = 0; st < 20; st++)
    cifar_sampler_batch(sp, st, 16, j->img + st * 16 * IN, j->lab + st * 16);
  cifar_sampler_destroy(sp);
  return NULL;
}

START_TEST(test_sampler_threads) {
  cifar_set s = mem_set(90, fill_random);
  thread_job ser[2], par[2];
  pthread_t th[2];
  for (int w = 0; w < 2; w++) {
    ser[w].set = par[w].set = &s;
    ser[w].worker = par[w].worker = w;
    ser[w].img = malloc(sizeof(float) * IN * 320);
    par[w].img = malloc(sizeof(float) * IN * 320);
    thread_run(&ser[w]);
  }
  for (int w = 0; w < 2; w++)
    ck_assert_int_eq(pthread_create(&th[w], NULL, thread_run, &par[w]), 0);
  for (int w = 0; w < 2; w++) ck_assert_int_eq(pthread_join(th[w], NULL), 0);
  for (int w = 0; w < 2; w++) {
    ck_assert(memcmp(ser[w].img, par[w].img, sizeof(float) * IN * 320) == 0);
    ck_assert(memcmp(ser[w].lab, par[w].lab, sizeof ser[w].lab) == 0);
    free(ser[w].img);
    free(par[w].img);
  }
  cifar_set_free(&s);
}
END_TEST

static void check_moments(const float *img) {
  double sum = 0, sq = 0;
  for (int k = 0; k < IN; k++) sum += img[k];
  double mean = sum / IN;
  for (int k = 0; k < IN; k++) sq += (img[k] - mean) * (img[k] - mean);
  double sd = sqrt(sq / IN);
  ck_assert_msg(fabs(mean) < 1e-5, "mean %g", mean);
  ck_assert_msg(fabs(sd - 1) < 1e-4, "stddev %g", sd);
}

START_TEST(test_standardization) {
  cifar_set s = mem_set(64, fill_random);
  const int B = 64;
  float *img = malloc(sizeof(float) * IN * B);
  uint8_t lab[64];
  cifar_sampler *sp = cifar_sampler_create(&s, 0, 1, 11);
  for (uint64_t st = 0; st < 3; st++) {
    cifar_sampler_batch(sp, st, B, img, lab);
    for (int i = 0; i < B; i++) check_moments(img + (size_t)i * IN);
  }
  cifar_eval_batch(&s, 0, B, img, lab);
  for (int i = 0; i < B; i++) check_moments(img + (size_t)i * IN);
  cifar_sampler_destroy(sp);

  /* A constant image: stddev 0 -> 1/sqrt(1728); every value becomes 0. */
  memset(s.pixels, 77, IMG);
  /* Almost constant: one centre pixel one higher; the stddev is below
   * 1/sqrt(1728), so the adjusted stddev is used: that pixel becomes
   * (1 - 1/1728) * sqrt(1728). */
  memset(s.pixels + IMG, 100, IMG);
  s.pixels[IMG + 1024 + 16 * 32 + 16] = 101; /* green (16,16) */
  cifar_eval_batch(&s, 0, 2, img, lab);
  for (int k = 0; k < IN; k++) ck_assert(img[k] == 0.0f);
  double hi = (1.0 - 1.0 / IN) * sqrt((double)IN), lo = -sqrt((double)IN) / IN;
  for (int k = 0; k < IN; k++) {
    double want = k == 576 + 12 * 24 + 12 ? hi : lo;
    ck_assert_msg(fabs(img[IN + k] - want) < 1e-4, "k %d: %g want %g", k,
                  (double)img[IN + k], want);
  }
  free(img);
  cifar_set_free(&s);
}
END_TEST

START_TEST(test_eval_centre_crop) {
  cifar_set s = mem_set(10, fill_random);
  float *img = malloc(sizeof(float) * IN * 12);
  uint8_t lab[12];
  double *ref = malloc(sizeof(double) * IN);
  /* Records 3..9 of 10, asked for 9: slots 7 and 8 stay untouched. */
  for (int k = 0; k < IN * 12; k++) img[k] = -1234.0f;
  memset(lab, 0xEE, sizeof lab);
  cifar_eval_batch(&s, 3, 9, img, lab);
  for (int i = 0; i < 7; i++) {
    const uint8_t *src = s.pixels + (size_t)(3 + i) * IMG;
    ck_assert_uint_eq(lab[i], s.labels[3 + i]);
    /* Pixel (c, y, x) of the output is pixel (c, y+4, x+4) of the source,
     * standardized with the mean and stddev of the crop. */
    double sum = 0, sq = 0;
    for (int c = 0; c < 3; c++)
      for (int y = 4; y < 28; y++)
        for (int x = 4; x < 28; x++) {
          double v = src[c * 1024 + y * 32 + x];
          sum += v;
          sq += v * v;
        }
    double mean = sum / IN, sd = sqrt(sq / IN - mean * mean);
    for (int c = 0; c < 3; c++)
      for (int y = 0; y < 24; y++)
        for (int x = 0; x < 24; x++) {
          double want = (src[c * 1024 + (y + 4) * 32 + (x + 4)] - mean) / sd;
          float got = img[(size_t)i * IN + c * 576 + y * 24 + x];
          ck_assert_msg(fabs(got - want) < 1e-5 * fmax(1, fabs(want)),
                        "image %d c%d y%d x%d: %g want %g", i, c, y, x, (double)got,
                        want);
        }
    ref_crop(src, 4, 4, 0, ref);
    ck_assert(close_img(img + (size_t)i * IN, ref));
  }
  for (int k = 7 * IN; k < 12 * IN; k++) ck_assert(img[k] == -1234.0f);
  for (int i = 7; i < 12; i++) ck_assert_uint_eq(lab[i], 0xEE);
  free(ref);
  free(img);
  cifar_set_free(&s);
}
END_TEST

/* The ten evaluation views: centre and corners, each mirrored; view 0 is
 * cifar_eval_batch's, an out-of-range view is view 0. */
START_TEST(test_eval_views) {
  static const int at[5][2] = {{4, 4}, {0, 0}, {0, 8}, {8, 0}, {8, 8}};
  cifar_set s = mem_set(4, fill_random);
  float *img = malloc(sizeof(float) * IN * 4), *centre = malloc(sizeof(float) * IN * 4);
  uint8_t lab[4];
  double *ref = malloc(sizeof(double) * IN);
  cifar_eval_batch(&s, 0, 4, centre, lab);
  for (int v = -1; v <= CIFAR_EVAL_VIEWS; v++) {
    int view = v < 0 || v >= CIFAR_EVAL_VIEWS ? 0 : v;
    memset(lab, 0xEE, sizeof lab);
    cifar_eval_view(&s, 0, 4, v, img, lab);
    for (int i = 0; i < 4; i++) {
      ck_assert_uint_eq(lab[i], s.labels[i]);
      ref_crop(s.pixels + (size_t)i * IMG, at[view % 5][0], at[view % 5][1], view >= 5, ref);
      ck_assert_msg(close_img(img + (size_t)i * IN, ref), "view %d image %d", v, i);
    }
    ck_assert_int_eq(view == 0, !memcmp(img, centre, sizeof(float) * IN * 4));
  }
  free(ref);
  free(img);
  free(centre);
  cifar_set_free(&s);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* cifar_synth */

/* build/bin/cifar_synth, next to this test binary. */
static void synth_path(char *buf, size_t len) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  ck_assert_int_gt(n, 0);
  self[n] = '\0';
  char *slash = strrchr(self, '/');
  ck_assert_ptr_nonnull(slash);
  *slash = '\0';
  int w = snprintf(buf, len, "%s/cifar_synth", self);
  ck_assert(w > 0 && (size_t)w < len);
  ck_assert_msg(access(buf, X_OK) == 0, "%s: %s (build the cifar_synth target)", buf,
                strerror(errno));
}

/* Runs cifar_synth with args (NULL-terminated); its stdout+stderr go to
 * log (malloc'd, NUL-terminated). Returns the exit status (-1 if killed). */
static int run_synth(const char *tmp, const char *const *args, char **log) {
  char bin[PATH_MAX], logpath[1024];
  synth_path(bin, sizeof bin);
  snprintf(logpath, sizeof logpath, "%s/synth.log", tmp);
  const char *argv[16];
  int n = 0;
  argv[n++] = bin;
  for (int i = 0; args[i] && n < 15; i++) argv[n++] = args[i];
  argv[n] = NULL;
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execv(bin, (char *const *)argv);
    _exit(127);
  }
  int st;
  while (waitpid(pid, &st, 0) < 0) ck_assert_int_eq(errno, EINTR);
  *log = tu_read_file(logpath);
  ck_assert_ptr_nonnull(*log);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static long file_size(const char *dir, const char *name) {
  char path[1024];
  struct stat st;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

START_TEST(test_synth_files) {
  char *tmp = mk_tmpdir();
  char out[700], out2[700], out3[700];
  snprintf(out, sizeof out, "%s/a/b", tmp); /* parents are created */
  snprintf(out2, sizeof out2, "%s/same", tmp);
  snprintf(out3, sizeof out3, "%s/other", tmp);
  char *log;
  const char *args[] = {"--out", out, "--train", "53", "--test", "17", "--seed", "5",
                        NULL};
  int rc = run_synth(tmp, args, &log);
  ck_assert_msg(rc == 0, "cifar_synth exit %d: %s", rc, log);
  free(log);
  /* 53 records over 5 files: 11 11 11 10 10. */
  const long counts[5] = {11, 11, 11, 10, 10};
  for (int f = 0; f < 5; f++) ck_assert_int_eq(file_size(out, TRAIN[f]), counts[f] * REC);
  ck_assert_int_eq(file_size(out, "test_batch.bin"), 17 * REC);

  cifar_set tr, te;
  char err[512] = "";
  ck_assert_msg(cifar_load_train(out, &tr, err, sizeof err) == 0, "%s", err);
  ck_assert_msg(cifar_load_test(out, &te, err, sizeof err) == 0, "%s", err);
  ck_assert_uint_eq(tr.n, 53);
  ck_assert_uint_eq(te.n, 17);
  int cnt[10] = {0};
  for (size_t i = 0; i < tr.n; i++) {
    ck_assert_uint_le(tr.labels[i], 9);
    cnt[tr.labels[i]]++;
  }
  for (int c = 0; c < 10; c++) /* balanced */
    ck_assert_msg(cnt[c] == 5 || cnt[c] == 6, "class %d: %d", c, cnt[c]);
  for (size_t i = 0; i < te.n; i++) ck_assert_uint_le(te.labels[i], 9);

  char path[800];
  snprintf(path, sizeof path, "%s/batches.meta.txt", out);
  char *meta = tu_read_file(path);
  ck_assert_ptr_nonnull(meta);
  int lines = 0;
  for (char *p = meta; *p; p++) lines += *p == '\n';
  ck_assert_int_eq(lines, 10);
  free(meta);

  /* Same seed: same bytes; other seed: other bytes. */
  const char *args2[] = {"--out", out2, "--train=53", "--test=17", "--seed=5", NULL};
  ck_assert_int_eq(run_synth(tmp, args2, &log), 0);
  free(log);
  const char *args3[] = {"--out", out3, "--train", "53", "--test", "17", "--seed", "6",
                         NULL};
  ck_assert_int_eq(run_synth(tmp, args3, &log), 0);
  free(log);
  cifar_set tr2, tr3;
  ck_assert_int_eq(cifar_load_train(out2, &tr2, err, sizeof err), 0);
  ck_assert_int_eq(cifar_load_train(out3, &tr3, err, sizeof err), 0);
  ck_assert(memcmp(tr.pixels, tr2.pixels, 53 * IMG) == 0);
  ck_assert(memcmp(tr.labels, tr2.labels, 53) == 0);
  ck_assert(memcmp(tr.pixels, tr3.pixels, 53 * IMG) != 0);
  cifar_set_free(&tr);
  cifar_set_free(&te);
  cifar_set_free(&tr2);
  cifar_set_free(&tr3);
  done_tmpdir(tmp);
}
END_TEST

/* The classes are learnable: even a nearest-centroid classifier on the
 * standardized centre crops is far above chance (10%). */
START_TEST(test_synth_learnable) {
  char *tmp = mk_tmpdir();
  char *log;
  const char *args[] = {"--out", tmp, "--train", "500", "--test", "200", NULL};
  int rc = run_synth(tmp, args, &log);
  ck_assert_msg(rc == 0, "cifar_synth exit %d: %s", rc, log);
  free(log);
  cifar_set tr, te;
  char err[512] = "";
  ck_assert_msg(cifar_load_train(tmp, &tr, err, sizeof err) == 0, "%s", err);
  ck_assert_msg(cifar_load_test(tmp, &te, err, sizeof err) == 0, "%s", err);
  ck_assert_uint_eq(tr.n, 500);
  ck_assert_uint_eq(te.n, 200);
  float *img = malloc(sizeof(float) * IN * 500);
  uint8_t *lab = malloc(500);
  double *cen = calloc(10 * IN, sizeof(double));
  int cnt[10] = {0};
  cifar_eval_batch(&tr, 0, 500, img, lab);
  for (int i = 0; i < 500; i++) {
    cnt[lab[i]]++;
    for (int k = 0; k < IN; k++) cen[lab[i] * IN + k] += img[(size_t)i * IN + k];
  }
  for (int c = 0; c < 10; c++) {
    ck_assert_int_eq(cnt[c], 50);
    for (int k = 0; k < IN; k++) cen[c * IN + k] /= cnt[c];
  }
  cifar_eval_batch(&te, 0, 200, img, lab);
  int right = 0;
  for (int i = 0; i < 200; i++) {
    int best = -1;
    double bd = INFINITY;
    for (int c = 0; c < 10; c++) {
      double d = 0;
      for (int k = 0; k < IN; k++) {
        double e = img[(size_t)i * IN + k] - cen[c * IN + k];
        d += e * e;
      }
      if (d < bd) bd = d, best = c;
    }
    right += best == lab[i];
  }
  ck_assert_msg(right >= 100, "nearest centroid: %d/200 right", right);
  free(cen);
  free(img);
  free(lab);
  cifar_set_free(&tr);
  cifar_set_free(&te);
  done_tmpdir(tmp);
}
END_TEST

START_TEST(test_synth_errors) {
  char *tmp = mk_tmpdir();
  char out[700], file[700];
  snprintf(out, sizeof out, "%s/o", tmp);
  snprintf(file, sizeof file, "%s/plain", tmp);
  FILE *f = fopen(file, "w");
  ck_assert_ptr_nonnull(f);
  fclose(f);
  char under[800];
  snprintf(under, sizeof under, "%s/sub", file); /* a directory under a file */
  char *log;
  struct {
    const char *args[8];
    int rc;
    const char *msg;
  } cases[] = {
      {{"--train", "10", NULL}, 2, "--out DIR is required"},
      {{"--out", out, "--train", "abc", NULL}, 2, "'abc' is not"},
      {{"--out", out, "--train", "-5", NULL}, 2, "'-5' is not"},
      {{"--out", out, "--test", "12x", NULL}, 2, "'12x' is not"},
      {{"--out", out, "--seed", "99999999999999999999999", NULL}, 2, "is too large"},
      {{"--out", out, "--train", "4", NULL}, 2, "--train 4 out of range"},
      {{"--out", out, "--test", "0", NULL}, 2, "--test 0 out of range"},
      {{"--out", out, "--bogus", NULL}, 2, "unknown argument '--bogus'"},
      {{"--out", out, "--train", NULL}, 2, "--train needs a value"},
      {{"--out", under, NULL}, 1, "cannot create directory"},
      {{"--out", file, NULL}, 1, "cannot create directory"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    int rc = run_synth(tmp, cases[k].args, &log);
    ck_assert_msg(rc == cases[k].rc, "case %zu: exit %d, want %d: %s", k, rc, cases[k].rc,
                  log);
    assert_contains(log, cases[k].msg);
    if (cases[k].rc == 1) assert_contains(log, cases[k].args[1]);
    free(log);
  }
  ck_assert_int_eq(access(out, F_OK), -1); /* nothing was written */
  done_tmpdir(tmp);
}
END_TEST

Suite *suite_cifar_data(void) {
  Suite *s = suite_create("cifar_data");
  TCase *tl = tcase_create("loader");
  tcase_set_timeout(tl, 30);
  tcase_add_test(tl, test_load_good);
  tcase_add_test(tl, test_load_prefix_and_gap);
  tcase_add_test(tl, test_load_truncated);
  tcase_add_test(tl, test_load_bad_label);
  tcase_add_test(tl, test_load_missing);
  tcase_add_test(tl, test_load_zero_size);
  suite_add_tcase(s, tl);

  TCase *ts = tcase_create("sampler");
  tcase_set_timeout(ts, 60);
  tcase_add_test(ts, test_sampler_args);
  tcase_add_test(ts, test_sampler_partition);
  tcase_add_test(ts, test_sampler_shuffle);
  tcase_add_test(ts, test_sampler_resume);
  tcase_add_test(ts, test_sampler_augmentation);
  tcase_add_test(ts, test_sampler_contrast);
  tcase_add_test(ts, test_sampler_threads);
  tcase_add_test(ts, test_standardization);
  tcase_add_test(ts, test_eval_centre_crop);
  tcase_add_test(ts, test_eval_views);
  suite_add_tcase(s, ts);

  TCase *tc = tcase_create("synth");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_synth_files);
  tcase_add_test(tc, test_synth_learnable);
  tcase_add_test(tc, test_synth_errors);
  suite_add_tcase(s, tc);
  return s;
}
