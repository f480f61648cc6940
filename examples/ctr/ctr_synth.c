/*
 * ctr_synth - writes a Criteo-like synthetic click-through data set
 * (ctr_data.h: the generator and the file format) for ctr_worker:
 *
 *   ctr_synth --out DIR [--train N] [--test N] [--seed S] ...
 *
 * makes DIR/train.bin (records 0..N-1 of the seed's stream) and
 * DIR/test.bin (the next --test records), and prints one JSON line: the
 * counts, the shape, the positive rate and the AUC of the hidden logit on
 * the test split (the best any model can reach). The same arguments give
 * the same bytes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ctr_data.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: ctr_synth --out DIR [--train N] [--test N] [--seed S] [--fields F]\n"
          "                 [--dense D] [--max-vocab V] [--zipf S]\n"
          "Writes a synthetic click-through data set: DIR/train.bin, DIR/test.bin.\n"
          "  --out DIR        directory to write (created if missing)\n"
          "  --train N        training records [200000]\n"
          "  --test N         held-out records, the next N of the stream [20000]\n"
          "  --seed S         generator seed; same arguments, same bytes [1]\n"
          "  --fields F       categorical fields per record, 1..%d [26]\n"
          "  --dense D        dense features per record, 0..%d [13]\n"
          "  --max-vocab V    ids of the largest field; field f has\n"
          "                   10^(1 + f/(F-1) * (log10(V) - 1)) ids [2000000]\n"
          "  --zipf S         Zipf exponent of the ids of every field [1.1]\n",
          CTR_MAX_FIELDS, CTR_MAX_DENSE);
}

static double num(const char *flag, const char *v, double lo, double hi) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || end == v || *end || !isfinite(x) || x < lo || x > hi) {
    fprintf(stderr, "ctr_synth: %s must be a number from %g to %g, got '%s'\n", flag, lo, hi, v);
    exit(64);
  }
  return x;
}

int main(int argc, char **argv) {
  ctr_gen g;
  ctr_gen_defaults(&g);
  const char *out = NULL;
  uint64_t ntrain = 200000, ntest = 20000;
  for (int a = 1; a < argc; a++) {
    const char *f = argv[a];
    if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
      usage(stdout);
      return 0;
    }
    if (a + 1 >= argc) {
      fprintf(stderr, "ctr_synth: option %s needs a value (see --help)\n", f);
      return 64;
    }
    const char *v = argv[++a];
    if (!strcmp(f, "--out")) out = v;
    else if (!strcmp(f, "--train")) ntrain = (uint64_t)num(f, v, 1, 1e10);
    else if (!strcmp(f, "--test")) ntest = (uint64_t)num(f, v, 1, 1e10);
    else if (!strcmp(f, "--seed")) g.seed = (uint64_t)num(f, v, 0, 1e15);
    else if (!strcmp(f, "--fields")) g.fields = (int)num(f, v, 1, CTR_MAX_FIELDS);
    else if (!strcmp(f, "--dense")) g.dense = (int)num(f, v, 0, CTR_MAX_DENSE);
    else if (!strcmp(f, "--max-vocab")) g.max_vocab = (uint64_t)num(f, v, 10, 4e9);
    else if (!strcmp(f, "--zipf")) g.zipf = num(f, v, 0.5, 3);
    else {
      fprintf(stderr, "ctr_synth: unknown option '%s' (see --help)\n", f);
      return 64;
    }
  }
  if (!out) {
    fprintf(stderr, "ctr_synth: --out DIR is required (see --help)\n");
    return 64;
  }
  if (mkdir(out, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "ctr_synth: cannot create %s: %s\n", out, strerror(errno));
    return 1;
  }
  char path[4200], err[4400];
  double auc, pos, pos_train;
  snprintf(path, sizeof path, "%s/train.bin", out);
  if (ctr_write_file(&g, path, 0, ntrain, NULL, &pos_train, err, sizeof err) != 0) {
    fprintf(stderr, "ctr_synth: %s\n", err);
    return 1;
  }
  snprintf(path, sizeof path, "%s/test.bin", out);
  if (ctr_write_file(&g, path, ntrain, ntest, &auc, &pos, err, sizeof err) != 0) {
    fprintf(stderr, "ctr_synth: %s\n", err);
    return 1;
  }
  printf("{\"train\":%llu,\"test\":%llu,\"fields\":%d,\"dense\":%d,\"seed\":%llu,"
         "\"max_vocab\":%llu,\"zipf\":%.3f,\"positive_rate\":%.4f,\"bayes_auc\":%.4f}\n",
         (unsigned long long)ntrain, (unsigned long long)ntest, g.fields, g.dense,
         (unsigned long long)g.seed, (unsigned long long)g.max_vocab, g.zipf,
         (pos_train * (double)ntrain + pos * (double)ntest) / (double)(ntrain + ntest), auc);
  return 0;
}
