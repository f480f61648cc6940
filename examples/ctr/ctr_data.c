/* ctr_data.c - the synthetic CTR generator, its file format and the
 * reader (ctr_data.h describes all three). */
#define _GNU_SOURCE
#include "ctr_data.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define INTER_K 4          /* floats of a hidden interaction vector */
#define SIGMA_W 0.18       /* stddev of a hidden per-id weight */
#define SIGMA_V 0.14       /* stddev of each hidden interaction element */
#define BIAS (-1.45)       /* sets the positive rate near 0.25 */

void ctr_gen_defaults(ctr_gen *g) {
  memset(g, 0, sizeof *g);
  g->seed = 1;
  g->fields = 26;
  g->dense = 13;
  g->max_vocab = 2000000;
  g->zipf = 1.1;
}

uint32_t ctr_vocab(const ctr_gen *g, int f) {
  if (g->fields <= 1) return (uint32_t)g->max_vocab;
  double lo = 1.0, hi = log10((double)g->max_vocab);
  double v = pow(10.0, lo + (hi - lo) * f / (g->fields - 1));
  return v < 10 ? 10 : (uint32_t)llround(v);
}

/* MurmurHash3's 64-bit finalizer: keys (and psd shards keys with another
 * mixer, splitmix64's, so the two do not line up). */
static uint64_t fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

uint64_t ctr_key(int f, uint64_t id) { return fmix64(((uint64_t)(f + 1) << 40) ^ id); }

/* A counter-based stream: splitmix64 from a state made of a hash. */
typedef struct rng {
  uint64_t s;
} rng;

static uint64_t rng_next(rng *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/* Uniform in (0, 1): never 0, so log() is safe. */
static double rng_unit(rng *r) { return ((double)(rng_next(r) >> 11) + 0.5) * 0x1p-53; }

/* Two standard normal draws (Box-Muller). */
static void rng_normal2(rng *r, double *a, double *b) {
  double u = rng_unit(r), v = rng_unit(r);
  double m = sqrt(-2.0 * log(u));
  *a = m * cos(2 * M_PI * v);
  *b = m * sin(2 * M_PI * v);
}

/* A Zipf-like rank in [0, V): the continuous power law x^-s on [1, V + 1),
 * inverted, floored. */
static uint64_t zipf_rank(rng *r, uint64_t V, double s) {
  double u = rng_unit(r), top = (double)V + 1, x;
  if (fabs(s - 1.0) < 1e-9) x = pow(top, u);
  else x = pow(1.0 + u * (pow(top, 1.0 - s) - 1.0), 1.0 / (1.0 - s));
  uint64_t k = (uint64_t)x;
  if (k < 1) k = 1;
  if (k > V) k = V;
  return k - 1;
}

/* The hidden weight and interaction vector of id in field f. */
static double hidden(const ctr_gen *g, int f, uint64_t id, double v[INTER_K]) {
  rng r = {fmix64(g->seed ^ 0x5bd1e995ULL) ^ fmix64(((uint64_t)(f + 1) << 40) ^ id)};
  double w, extra;
  rng_normal2(&r, &w, &extra);
  for (int k = 0; k < INTER_K; k += 2) rng_normal2(&r, &v[k], &v[k + 1]);
  for (int k = 0; k < INTER_K; k++) v[k] *= SIGMA_V;
  return w * SIGMA_W;
}

/* The hidden coefficient and offset of dense feature j. */
static void dense_coef(const ctr_gen *g, int j, double *c, double *a) {
  rng r = {fmix64(g->seed ^ 0x27d4eb2fULL) ^ fmix64((uint64_t)j + 1)};
  double n1, n2;
  rng_normal2(&r, &n1, &n2);
  *c = 0.2 * n1;
  *a = 0.5 + 3.0 * rng_unit(&r); /* log of the typical count */
}

double ctr_gen_record(const ctr_gen *g, uint64_t i, uint64_t *keys, float *dense,
                      float *label) {
  rng r = {fmix64(g->seed) ^ fmix64(i * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL)};
  double z = BIAS, sum[INTER_K] = {0}, sq = 0;
  for (int f = 0; f < g->fields; f++) {
    uint64_t id = zipf_rank(&r, ctr_vocab(g, f), g->zipf);
    double v[INTER_K];
    z += hidden(g, f, id, v);
    for (int k = 0; k < INTER_K; k++) {
      sum[k] += v[k];
      sq += v[k] * v[k];
    }
    keys[f] = ctr_key(f, id);
  }
  double inter = -sq;
  for (int k = 0; k < INTER_K; k++) inter += sum[k] * sum[k];
  z += 0.5 * inter;
  for (int j = 0; j < g->dense; j += 2) {
    double t[2];
    rng_normal2(&r, &t[0], &t[1]);
    for (int h = 0; h < 2 && j + h < g->dense; h++) {
      double c, a;
      dense_coef(g, j + h, &c, &a);
      dense[j + h] = (float)floor(exp(a + t[h]) - 0.5 > 0 ? exp(a + t[h]) - 0.5 : 0);
      z += c * t[h];
    }
  }
  double p = 1.0 / (1.0 + exp(-z));
  *label = rng_unit(&r) < p ? 1.0f : 0.0f;
  return z;
}

static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

static size_t header_bytes(int fields) { return CTR_HEADER_FIXED + 4 * (size_t)fields; }
static size_t record_bytes(int fields, int dense) {
  return 8 * (size_t)fields + 4 * (size_t)dense + 4;
}

static void encode_header(const ctr_gen *g, uint64_t first, uint64_t n, unsigned char *h) {
  memset(h, 0, header_bytes(g->fields));
  memcpy(h, CTR_MAGIC, 8);
  put32(h + 8, CTR_VERSION);
  put32(h + 12, (uint32_t)g->fields);
  put32(h + 16, (uint32_t)g->dense);
  put32(h + 20, (uint32_t)record_bytes(g->fields, g->dense));
  put64(h + 24, n);
  put64(h + 32, g->seed);
  put64(h + 40, first);
  put32(h + 48, (uint32_t)llround(g->zipf * 1000));
  for (int f = 0; f < g->fields; f++) put32(h + CTR_HEADER_FIXED + 4 * f, ctr_vocab(g, f));
}

int ctr_write_file(const ctr_gen *g, const char *path, uint64_t first, uint64_t n, double *auc,
                   double *pos, char *err, size_t errlen) {
  if (g->fields < 1 || g->fields > CTR_MAX_FIELDS || g->dense < 0 || g->dense > CTR_MAX_DENSE) {
    snprintf(err, errlen, "fields must be 1..%d and dense 0..%d", CTR_MAX_FIELDS, CTR_MAX_DENSE);
    return -1;
  }
  FILE *f = fopen(path, "wb");
  if (!f) {
    snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
    return -1;
  }
  unsigned char hdr[CTR_HEADER_FIXED + 4 * CTR_MAX_FIELDS], rec[8 * CTR_MAX_FIELDS + 4 * CTR_MAX_DENSE + 4];
  encode_header(g, first, n, hdr);
  fwrite(hdr, 1, header_bytes(g->fields), f);
  float *z = auc ? malloc((size_t)n * sizeof *z) : NULL, *y = auc ? malloc((size_t)n * sizeof *y) : NULL;
  uint64_t keys[CTR_MAX_FIELDS], positives = 0;
  float dense[CTR_MAX_DENSE], label;
  size_t rb = record_bytes(g->fields, g->dense);
  for (uint64_t i = 0; i < n; i++) {
    double logit = ctr_gen_record(g, first + i, keys, dense, &label);
    memcpy(rec, keys, 8 * (size_t)g->fields);
    memcpy(rec + 8 * g->fields, dense, 4 * (size_t)g->dense);
    memcpy(rec + 8 * g->fields + 4 * g->dense, &label, 4);
    fwrite(rec, 1, rb, f);
    positives += label > 0.5f;
    if (z && y) {
      z[i] = (float)logit;
      y[i] = label;
    }
  }
  int bad = ferror(f);
  if (fclose(f) != 0 || bad) {
    snprintf(err, errlen, "writing %s failed: %s", path, strerror(errno));
    free(z);
    free(y);
    return -1;
  }
  if (auc) *auc = z && y ? ctr_auc(z, y, (size_t)n) : NAN;
  if (pos) *pos = n ? (double)positives / (double)n : 0;
  free(z);
  free(y);
  return 0;
}

static uint32_t get32(const unsigned char *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
static uint64_t get64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

/* The header's fields into s, checked against the file's length. */
static int parse_header(const char *path, const unsigned char *h, size_t len, ctr_set *s,
                        char *err, size_t errlen) {
  if (len < CTR_HEADER_FIXED || memcmp(h, CTR_MAGIC, 8) != 0) {
    snprintf(err, errlen, "%s is not a CTR data file (no %s header; make one with ctr_synth)",
             path, CTR_MAGIC);
    return -1;
  }
  uint32_t version = get32(h + 8), F = get32(h + 12), D = get32(h + 16), rb = get32(h + 20);
  if (version != CTR_VERSION || F < 1 || F > CTR_MAX_FIELDS || D > CTR_MAX_DENSE ||
      rb != record_bytes((int)F, (int)D) || len < header_bytes((int)F)) {
    snprintf(err, errlen, "%s: bad header (version %u, %u fields, %u dense, %u-byte records)",
             path, version, F, D, rb);
    return -1;
  }
  s->fields = (int)F;
  s->dense = (int)D;
  s->record_bytes = rb;
  s->n = get64(h + 24);
  s->seed = get64(h + 32);
  s->first = get64(h + 40);
  for (uint32_t f = 0; f < F; f++) s->vocab[f] = get32(h + CTR_HEADER_FIXED + 4 * f);
  size_t body = len - header_bytes((int)F);
  if (s->n > body / rb || body != s->n * rb) {
    snprintf(err, errlen, "%s: the header says %llu records of %u bytes, the file holds %zu "
             "bytes of records (truncated?)", path, (unsigned long long)s->n, rb, body);
    return -1;
  }
  s->records = h + header_bytes((int)F);
  return 0;
}

int ctr_open(const char *path, ctr_set *s, char *err, size_t errlen) {
  memset(s, 0, sizeof *s);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
    if (fd >= 0) close(fd);
    return -1;
  }
  size_t len = (size_t)st.st_size;
  void *m = len ? mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
  close(fd);
  if (m == MAP_FAILED) {
    snprintf(err, errlen, "cannot map %s: %s", path, len ? strerror(errno) : "empty file");
    return -1;
  }
  s->map = m;
  s->map_len = len;
  if (parse_header(path, m, len, s, err, errlen) != 0) {
    ctr_close(s);
    return -1;
  }
  return 0;
}

void ctr_close(ctr_set *s) {
  if (s->map) munmap(s->map, s->map_len);
  memset(s, 0, sizeof *s);
}

void ctr_record(const ctr_set *s, uint64_t i, uint64_t *keys, float *dense, float *label) {
  const unsigned char *r = s->records + (size_t)i * s->record_bytes;
  memcpy(keys, r, 8 * (size_t)s->fields);
  if (dense) memcpy(dense, r + 8 * s->fields, 4 * (size_t)s->dense);
  memcpy(label, r + 8 * s->fields + 4 * s->dense, 4);
}

typedef struct scored {
  float s, y;
} scored;

static int by_score(const void *a, const void *b) {
  float x = ((const scored *)a)->s, y = ((const scored *)b)->s;
  return (x > y) - (x < y);
}

double ctr_auc(const float *score, const float *label, size_t n) {
  scored *v = malloc(n * sizeof *v + 1);
  if (!v) return NAN;
  for (size_t i = 0; i < n; i++) v[i] = (scored){score[i], label[i]};
  qsort(v, n, sizeof *v, by_score);
  /* Mann-Whitney: sum of the positives' ranks, ties sharing their mean rank. */
  double rank_sum = 0, npos = 0;
  for (size_t i = 0; i < n;) {
    size_t j = i;
    double pos = 0;
    while (j < n && v[j].s == v[i].s) pos += v[j++].y > 0.5f;
    rank_sum += pos * ((double)(i + 1) + (double)j) / 2.0;
    npos += pos;
    i = j;
  }
  free(v);
  double nneg = (double)n - npos;
  if (npos == 0 || nneg == 0) return NAN;
  return (rank_sum - npos * (npos + 1) / 2.0) / (npos * nneg);
}
