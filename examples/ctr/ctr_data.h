/*
 * ctr_data.h - the CTR example's data: a Criteo-like synthetic set made
 * deterministically from a seed, its binary file format, and the reader.
 *
 * File format (DIR/train.bin and DIR/test.bin; every number little endian):
 *
 *   header, 64 + 4 * F bytes:
 *     char     magic[8]      "PSDCTR01"
 *     uint32   version       1
 *     uint32   fields        F, categorical fields per record (1..64)
 *     uint32   dense         D, dense features per record (0..64)
 *     uint32   record_bytes  8 * F + 4 * D + 4
 *     uint64   records       N
 *     uint64   seed          the generator's seed
 *     uint64   first         index of the first record in the whole stream
 *                            (train: 0, test: the train count)
 *     uint32   zipf_milli    the Zipf exponent times 1000
 *     uint32   reserved[3]   0
 *     uint32   vocab[F]      ids per field
 *   N records, record_bytes each:
 *     uint64   keys[F]       ctr_key(f, id): a hash of the field and the id
 *     float32  dense[D]      non-negative counts (the model takes log(1 + x))
 *     float32  label         0 or 1
 *
 * The generator: record i (of the whole stream, train then test) is drawn
 * from a counter-based generator seeded by (seed, i), so any record can be
 * made alone and the bytes depend on nothing but the arguments. Field f
 * has vocab[f] ids, log-spaced from 10 (f = 0) to max_vocab (f = F - 1);
 * the id is Zipf-distributed (rank r has probability ~ r^-s): a heavy
 * head and a long tail. The label is Bernoulli(sigmoid(z)) with the hidden
 * logit
 *
 *   z = bias + sum_f w(f, id_f) + sum_{f<g} <v(f, id_f), v(g, id_g)>
 *            + sum_j c_j (log(1 + x_j) - m_j)
 *
 * where w and v (4 floats) are Gaussian draws from a hash of (seed, f, id):
 * a hidden embedding per id plus pairwise interactions, so an embedding
 * model can learn it. ctr_synth reports the AUC of z itself on the test
 * split (the best any model can do, about 0.79 with the defaults).
 */
#ifndef CTR_DATA_H
#define CTR_DATA_H

#include <stddef.h>
#include <stdint.h>

#define CTR_MAGIC "PSDCTR01"
#define CTR_VERSION 1
#define CTR_MAX_FIELDS 64
#define CTR_MAX_DENSE 64
#define CTR_HEADER_FIXED 64

typedef struct ctr_gen {
  uint64_t seed;
  int fields;          /* F, default 26 */
  int dense;           /* D, default 13 */
  uint64_t max_vocab;  /* ids of the largest field, default 2000000 */
  double zipf;         /* exponent s, default 1.1 */
} ctr_gen;

/* The defaults above. */
void ctr_gen_defaults(ctr_gen *g);
/* Ids of field f (log-spaced from 10 to max_vocab). */
uint32_t ctr_vocab(const ctr_gen *g, int f);
/* The key of id in field f: a 64-bit hash of both. */
uint64_t ctr_key(int f, uint64_t id);
/* Record i of the stream: keys[F], dense[D], the label; returns the hidden
 * logit z. */
double ctr_gen_record(const ctr_gen *g, uint64_t i, uint64_t *keys, float *dense,
                      float *label);

/* Writes records [first, first + n) of the stream to path. 0, or -1 with
 * a sentence in err. *auc (may be NULL) gets the AUC of the hidden logit
 * on these records, *pos the fraction of positives. */
int ctr_write_file(const ctr_gen *g, const char *path, uint64_t first, uint64_t n, double *auc,
                   double *pos, char *err, size_t errlen);

/* A data file, mapped read-only. */
typedef struct ctr_set {
  int fields, dense;
  uint64_t n, seed, first;
  uint32_t vocab[CTR_MAX_FIELDS];
  size_t record_bytes;
  const unsigned char *records; /* n records */
  void *map;
  size_t map_len;
} ctr_set;

/* Maps path and checks its header against the file's size. 0, or -1 with
 * a sentence naming the file in err. */
int ctr_open(const char *path, ctr_set *s, char *err, size_t errlen);
void ctr_close(ctr_set *s);
/* Record i's keys (F, unaligned-safe copies), dense features and label. */
void ctr_record(const ctr_set *s, uint64_t i, uint64_t *keys, float *dense, float *label);

/* AUC of scores against labels (0/1), ties counted half; n up to 2^31. */
double ctr_auc(const float *score, const float *label, size_t n);

#endif /* CTR_DATA_H */
