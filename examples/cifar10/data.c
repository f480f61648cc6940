/* data.c - CIFAR-10 binary loader, sampler, augmentation, standardization.
 * See data.h for the contract. No global state: everything lives in the
 * cifar_set / cifar_sampler objects or on the stack. */
#include "data.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PLANE (CIFAR_SIDE * CIFAR_SIDE)   /* 1024 */
#define CROP_PLANE (CIFAR_CROP * CIFAR_CROP) /* 576 */
#define CROP_RANGE (CIFAR_SIDE - CIFAR_CROP + 1) /* 9 offsets: 0..8 */
#define CHUNK_RECORDS 1024 /* records per read() while loading: ~3 MB */

/* ------------------------------------------------------------------------ */
/* Loading */

static void set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t errlen, const char *fmt, ...) {
  if (!err || errlen == 0) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
}

typedef struct {
  char path[4096];
  int fd;
  size_t records;
} src_file;

static int make_path(char *buf, size_t len, const char *dir, const char *name) {
  size_t dl = strlen(dir);
  int n;
  if (dl == 0) n = snprintf(buf, len, "%s", name);
  else if (dir[dl - 1] == '/') n = snprintf(buf, len, "%s%s", dir, name);
  else n = snprintf(buf, len, "%s/%s", dir, name);
  return (n < 0 || (size_t)n >= len) ? -1 : 0;
}

/* fstat checks of an open file: regular, non-empty, whole records. */
static int check_size(src_file *f, char *err, size_t errlen) {
  struct stat st;
  if (fstat(f->fd, &st) != 0) {
    set_err(err, errlen, "%s: cannot stat: %s", f->path, strerror(errno));
    return -1;
  }
  if (!S_ISREG(st.st_mode)) {
    set_err(err, errlen, "%s: not a regular file", f->path);
    return -1;
  }
  if (st.st_size == 0) {
    set_err(err, errlen, "%s: file is empty (0 bytes, expected whole %d-byte records)",
            f->path, CIFAR_RECORD_BYTES);
    return -1;
  }
  if (st.st_size % CIFAR_RECORD_BYTES != 0) {
    set_err(err, errlen, "%s: size %lld is not a whole number of %d-byte records",
            f->path, (long long)st.st_size, CIFAR_RECORD_BYTES);
    return -1;
  }
  f->records = (size_t)(st.st_size / CIFAR_RECORD_BYTES);
  return 0;
}

/* Reads all records of f into labels/pixels (room for f->records). */
static int read_records(const src_file *f, uint8_t *buf, uint8_t *labels,
                        uint8_t *pixels, char *err, size_t errlen) {
  size_t done = 0;
  while (done < f->records) {
    size_t want = f->records - done;
    if (want > CHUNK_RECORDS) want = CHUNK_RECORDS;
    size_t bytes = want * CIFAR_RECORD_BYTES, got = 0;
    while (got < bytes) {
      ssize_t r = read(f->fd, buf + got, bytes - got);
      if (r < 0) {
        if (errno == EINTR) continue;
        set_err(err, errlen, "%s: read error at record %zu: %s", f->path,
                done + got / CIFAR_RECORD_BYTES, strerror(errno));
        return -1;
      }
      if (r == 0) {
        set_err(err, errlen, "%s: file shrank while reading: ended inside record %zu",
                f->path, done + got / CIFAR_RECORD_BYTES);
        return -1;
      }
      got += (size_t)r;
    }
    for (size_t k = 0; k < want; k++) {
      const uint8_t *rec = buf + k * CIFAR_RECORD_BYTES;
      if (rec[0] >= CIFAR_CLASSES) {
        set_err(err, errlen, "%s: record %zu has label %u (expected 0..%d)", f->path,
                done + k, (unsigned)rec[0], CIFAR_CLASSES - 1);
        return -1;
      }
      labels[done + k] = rec[0];
      memcpy(pixels + (done + k) * CIFAR_IMAGE_BYTES, rec + 1, CIFAR_IMAGE_BYTES);
    }
    done += want;
  }
  return 0;
}

/* files[0..nf) are open and size-checked; reads them, concatenated. */
static int load_open_files(src_file *files, int nf, cifar_set *out, char *err,
                           size_t errlen) {
  size_t n = 0;
  for (int i = 0; i < nf; i++) n += files[i].records;
  if (n > SIZE_MAX / CIFAR_IMAGE_BYTES) {
    set_err(err, errlen, "%s: too many records (%zu)", files[0].path, n);
    return -1;
  }
  uint8_t *labels = malloc(n);
  uint8_t *pixels = malloc(n * CIFAR_IMAGE_BYTES);
  uint8_t *buf = malloc((size_t)CHUNK_RECORDS * CIFAR_RECORD_BYTES);
  if (!labels || !pixels || !buf) {
    set_err(err, errlen, "%s: out of memory for %zu records", files[0].path, n);
    free(labels);
    free(pixels);
    free(buf);
    return -1;
  }
  size_t at = 0;
  for (int i = 0; i < nf; i++) {
    if (read_records(&files[i], buf, labels + at, pixels + at * CIFAR_IMAGE_BYTES, err,
                     errlen) != 0) {
      free(labels);
      free(pixels);
      free(buf);
      return -1;
    }
    at += files[i].records;
  }
  free(buf);
  out->labels = labels;
  out->pixels = pixels;
  out->n = n;
  return 0;
}

static void close_files(src_file *files, int nf) {
  for (int i = 0; i < nf; i++)
    if (files[i].fd >= 0) close(files[i].fd);
}

int cifar_load_train(const char *dir, cifar_set *out, char *err, size_t errlen) {
  src_file files[CIFAR_TRAIN_FILES];
  int present[CIFAR_TRAIN_FILES];
  int nf = 0, rc = -1;
  memset(out, 0, sizeof *out);
  for (int i = 0; i < CIFAR_TRAIN_FILES; i++) files[i].fd = -1;
  /* Open every data_batch_k.bin that exists; stop at the first hard error. */
  for (int i = 0; i < CIFAR_TRAIN_FILES; i++) {
    char name[32];
    snprintf(name, sizeof name, "data_batch_%d.bin", i + 1);
    if (make_path(files[i].path, sizeof files[i].path, dir, name) != 0) {
      set_err(err, errlen, "%s/%s: path too long", dir, name);
      goto done;
    }
    files[i].fd = open(files[i].path, O_RDONLY | O_CLOEXEC);
    present[i] = files[i].fd >= 0;
    if (!present[i] && (errno != ENOENT || i == 0)) {
      set_err(err, errlen, "%s: cannot open: %s", files[i].path, strerror(errno));
      goto done;
    }
  }
  /* The files taken are the run 1..nf; a later file after a gap is an error. */
  while (nf < CIFAR_TRAIN_FILES && present[nf]) nf++;
  for (int j = nf + 1; j < CIFAR_TRAIN_FILES; j++) {
    if (present[j]) {
      set_err(err, errlen,
              "%s: missing, but data_batch_%d.bin exists (training files must be "
              "data_batch_1.bin .. data_batch_K.bin without gaps)",
              files[nf].path, j + 1);
      goto done;
    }
  }
  for (int i = 0; i < nf; i++)
    if (check_size(&files[i], err, errlen) != 0) goto done;
  rc = load_open_files(files, nf, out, err, errlen);
done:
  close_files(files, CIFAR_TRAIN_FILES);
  return rc;
}

int cifar_load_test(const char *dir, cifar_set *out, char *err, size_t errlen) {
  src_file f;
  int rc = -1;
  memset(out, 0, sizeof *out);
  f.fd = -1;
  if (make_path(f.path, sizeof f.path, dir, "test_batch.bin") != 0) {
    set_err(err, errlen, "%s/test_batch.bin: path too long", dir);
    return -1;
  }
  f.fd = open(f.path, O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) {
    set_err(err, errlen, "%s: cannot open: %s", f.path, strerror(errno));
    return -1;
  }
  if (check_size(&f, err, errlen) == 0) rc = load_open_files(&f, 1, out, err, errlen);
  close(f.fd);
  return rc;
}

void cifar_set_free(cifar_set *s) {
  if (!s) return;
  free(s->labels);
  free(s->pixels);
  memset(s, 0, sizeof *s);
}

/* ------------------------------------------------------------------------ */
/* Counter-based randomness: every random choice is a hash of its inputs. */

static inline uint64_t mix64(uint64_t z) { /* splitmix64 finalizer */
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

#define TAG_PERM 0x7065726d75746531ULL /* domain separation of the two uses */
#define TAG_AUG 0x6175676d656e7431ULL

static uint64_t hash4(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b) {
  uint64_t h = mix64(seed ^ tag);
  h = mix64(h ^ a);
  return mix64(h ^ b);
}

/* Uniform in [0, bound) from 64 random bits (multiply-shift). */
static inline uint64_t below(uint64_t r, uint64_t bound) {
  return (uint64_t)(((unsigned __int128)r * bound) >> 64);
}

/* ------------------------------------------------------------------------ */
/* Crop, flip and standardize one image. */

/* TensorFlow's random_contrast before the standardization: each channel's
 * deviations from its mean scaled by f (tf.image.adjust_contrast). */
static void contrast_standardize(const uint8_t *restrict tmp, float f, float *restrict dst) {
  double x[CIFAR_INPUT_FLOATS], sum = 0, sumsq = 0;
  for (int c = 0; c < CIFAR_CHANNELS; c++) {
    const uint8_t *p = tmp + c * CROP_PLANE;
    double m = 0;
    for (int k = 0; k < CROP_PLANE; k++) m += p[k];
    m /= CROP_PLANE;
    for (int k = 0; k < CROP_PLANE; k++) {
      double v = (p[k] - m) * f + m;
      x[c * CROP_PLANE + k] = v;
      sum += v;
      sumsq += v * v;
    }
  }
  const double N = CIFAR_INPUT_FLOATS, mean = sum / N;
  double var = sumsq / N - mean * mean;
  double sd = sqrt(var > 0 ? var : 0), min_sd = 1.0 / sqrt(N);
  const double inv = 1.0 / (sd > min_sd ? sd : min_sd);
  for (int k = 0; k < CIFAR_INPUT_FLOATS; k++) dst[k] = (float)((x[k] - mean) * inv);
}

/* src: 3 planes of 32x32; dst: 3 planes of 24x24 floats; contrast 1: none. */
static void prep_image(const uint8_t *restrict src, int dy, int dx, int flip, float contrast,
                       float *restrict dst) {
  uint8_t tmp[CIFAR_INPUT_FLOATS];
  for (int c = 0; c < CIFAR_CHANNELS; c++) {
    const uint8_t *plane = src + c * PLANE + dy * CIFAR_SIDE + dx;
    uint8_t *o = tmp + c * CROP_PLANE;
    if (!flip) {
      for (int y = 0; y < CIFAR_CROP; y++)
        memcpy(o + y * CIFAR_CROP, plane + y * CIFAR_SIDE, CIFAR_CROP);
    } else {
      /* A 24-byte row reversed = its three 8-byte words byte-swapped, in
       * reverse order (independent of the machine's byte order). */
      for (int y = 0; y < CIFAR_CROP; y++) {
        const uint8_t *row = plane + y * CIFAR_SIDE;
        uint8_t *orow = o + y * CIFAR_CROP;
        uint64_t w[3];
        memcpy(w, row, sizeof w);
        for (int k = 0; k < 3; k++) w[k] = __builtin_bswap64(w[k]);
        memcpy(orow, &w[2], 8);
        memcpy(orow + 8, &w[1], 8);
        memcpy(orow + 16, &w[0], 8);
      }
    }
  }
  if (contrast != 1.0f) {
    contrast_standardize(tmp, contrast, dst);
    return;
  }
  /* Exact integer moments: sum <= 1728*255, sum of squares <= 1728*255^2 < 2^32. */
  uint32_t sum = 0, sumsq = 0;
  for (int k = 0; k < CIFAR_INPUT_FLOATS; k++) {
    uint32_t v = tmp[k];
    sum += v;
    sumsq += v * v;
  }
  const double N = CIFAR_INPUT_FLOATS;
  double mean = sum / N;
  /* N*sumsq - sum^2 is an exact integer in double (< 2^53). */
  double var = ((double)sumsq * N - (double)sum * (double)sum) / (N * N);
  if (var < 0) var = 0;
  double sd = sqrt(var), min_sd = 1.0 / sqrt(N);
  float m = (float)mean, inv = (float)(1.0 / (sd > min_sd ? sd : min_sd));
  for (int k = 0; k < CIFAR_INPUT_FLOATS; k++) dst[k] = ((float)tmp[k] - m) * inv;
}

/* ------------------------------------------------------------------------ */
/* Sampler */

struct cifar_sampler {
  const cifar_set *set;
  int worker, num_workers;
  uint64_t seed;
  size_t size;          /* records in the set (one epoch) */
  uint32_t *perm[2];    /* two cached epoch permutations of the set */
  uint64_t epoch[2];
  int valid[2];
  int victim;           /* slot to refill next */
  float contrast_lo, contrast_hi; /* random contrast factors (1, 1: none) */
};

cifar_sampler *cifar_sampler_create(const cifar_set *s, int worker, int num_workers,
                                    uint64_t seed) {
  if (!s || num_workers < 1 || worker < 0 || worker >= num_workers ||
      s->n <= (size_t)worker) {
    errno = EINVAL;
    return NULL;
  }
  size_t size = s->n;
  if (size > UINT32_MAX) {
    errno = EINVAL;
    return NULL;
  }
  cifar_sampler *sp = calloc(1, sizeof *sp);
  if (!sp) return NULL;
  sp->perm[0] = malloc(size * sizeof(uint32_t));
  sp->perm[1] = malloc(size * sizeof(uint32_t));
  if (!sp->perm[0] || !sp->perm[1]) {
    cifar_sampler_destroy(sp);
    errno = ENOMEM;
    return NULL;
  }
  sp->set = s;
  sp->worker = worker;
  sp->num_workers = num_workers;
  sp->seed = seed;
  sp->size = size;
  sp->contrast_lo = sp->contrast_hi = 1.0f;
  return sp;
}

int cifar_sampler_set_contrast(cifar_sampler *sp, double lo, double hi) {
  if (!sp || !(lo > 0 && lo <= hi && hi < 100)) {
    errno = EINVAL;
    return -1;
  }
  sp->contrast_lo = (float)lo;
  sp->contrast_hi = (float)hi;
  return 0;
}

size_t cifar_sampler_size(const cifar_sampler *sp) {
  /* This worker's share of an epoch. */
  return (sp->size - (size_t)sp->worker + (size_t)sp->num_workers - 1) / (size_t)sp->num_workers;
}

void cifar_sampler_destroy(cifar_sampler *sp) {
  if (!sp) return;
  free(sp->perm[0]);
  free(sp->perm[1]);
  free(sp);
}

/* The permutation of epoch e over the whole set: Fisher-Yates driven by a
 * splitmix64 stream seeded with hash(seed, e), the same on every worker.
 * Cached in one of two slots. */
static const uint32_t *epoch_perm(cifar_sampler *sp, uint64_t e) {
  for (int k = 0; k < 2; k++)
    if (sp->valid[k] && sp->epoch[k] == e) {
      sp->victim = 1 - k;
      return sp->perm[k];
    }
  int k = sp->victim;
  uint32_t *p = sp->perm[k];
  size_t S = sp->size;
  for (size_t i = 0; i < S; i++) p[i] = (uint32_t)i;
  uint64_t state = hash4(sp->seed, TAG_PERM, 0, e);
  for (size_t i = S; i > 1; i--) {
    state += 0x9e3779b97f4a7c15ULL;
    size_t j = (size_t)below(mix64(state), i);
    uint32_t t = p[i - 1];
    p[i - 1] = p[j];
    p[j] = t;
  }
  sp->epoch[k] = e;
  sp->valid[k] = 1;
  sp->victim = 1 - k;
  return p;
}

/* Touches the cache lines of a 32x32x3 image ahead of use: the records of
 * a training batch are scattered over the set. */
static inline void prefetch_image(const uint8_t *img) {
  for (int off = 0; off < CIFAR_IMAGE_BYTES; off += 64) __builtin_prefetch(img + off);
}

#define BATCH_CHUNK 64 /* samples whose record and crop are drawn at once */

double cifar_sampler_batch(cifar_sampler *sp, uint64_t step, int B, float *images,
                           uint8_t *labels) {
  const uint64_t S = sp->size;
  /* Worker w's slice of the global batch of this step. */
  const uint64_t gfirst = step * (uint64_t)B * (uint64_t)sp->num_workers;
  const uint64_t first = gfirst + (uint64_t)sp->worker * (uint64_t)B;
  const cifar_set *set = sp->set;
  uint64_t cur_epoch = first / S, pos = first % S;
  const uint32_t *perm = epoch_perm(sp, cur_epoch);
  size_t rec[BATCH_CHUNK];
  uint64_t aug[BATCH_CHUNK];
  for (int base = 0; base < B; base += BATCH_CHUNK) {
    int m = B - base < BATCH_CHUNK ? B - base : BATCH_CHUNK;
    for (int j = 0; j < m; j++) {
      if (pos == S) { /* the batch crosses into the next epoch */
        pos = 0;
        perm = epoch_perm(sp, ++cur_epoch);
      }
      /* Augmentation keyed by the sample's place in the epoch, so any split
       * of a global batch over workers sees the same images. */
      aug[j] = hash4(sp->seed, TAG_AUG, cur_epoch, pos);
      rec[j] = (size_t)perm[pos++];
    }
    for (int j = 0; j < 2 && j < m; j++)
      prefetch_image(set->pixels + rec[j] * CIFAR_IMAGE_BYTES);
    for (int j = 0; j < m; j++) {
      if (j + 2 < m) prefetch_image(set->pixels + rec[j + 2] * CIFAR_IMAGE_BYTES);
      uint64_t h = aug[j];
      int dy = (int)(((h & 0x1fffff) * CROP_RANGE) >> 21);
      int dx = (int)((((h >> 21) & 0x1fffff) * CROP_RANGE) >> 21);
      int flip = (int)(h >> 63);
      /* bits 42..62, unused by the crop and the flip: the contrast factor */
      float u = (float)((h >> 42) & 0x1fffff) * 0x1p-21f;
      float contrast = sp->contrast_lo + (sp->contrast_hi - sp->contrast_lo) * u;
      labels[base + j] = set->labels[rec[j]];
      prep_image(set->pixels + rec[j] * CIFAR_IMAGE_BYTES, dy, dx, flip, contrast,
                 images + (size_t)(base + j) * CIFAR_INPUT_FLOATS);
    }
  }
  return (double)(gfirst / S) + (double)(gfirst % S) / (double)S;
}

void cifar_eval_view(const cifar_set *s, size_t first, int B, int view, float *images,
                     uint8_t *labels) {
  /* The centre and the four corners (AlexNet's ten crops with flips). */
  static const int at[5][2] = {{4, 4}, {0, 0}, {0, 8}, {8, 0}, {8, 8}};
  if (view < 0 || view >= CIFAR_EVAL_VIEWS) view = 0;
  const int dy = at[view % 5][0], dx = at[view % 5][1], flip = view >= 5;
  for (int i = 0; i < B && first + (size_t)i < s->n; i++) {
    size_t rec = first + (size_t)i;
    labels[i] = s->labels[rec];
    prep_image(s->pixels + rec * CIFAR_IMAGE_BYTES, dy, dx, flip, 1.0f,
               images + (size_t)i * CIFAR_INPUT_FLOATS);
  }
}

void cifar_eval_batch(const cifar_set *s, size_t first, int B, float *images,
                      uint8_t *labels) {
  cifar_eval_view(s, first, B, 0, images, labels);
}
