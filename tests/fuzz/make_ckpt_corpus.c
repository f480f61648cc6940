/*
 * make_ckpt_corpus - writes the seed corpus of fuzz_ckpt with psd's own
 * checkpoint writer (psd/persist/checkpoint.c), so the seeds follow the format:
 *
 *   make_ckpt_corpus DIR   ->  DIR/fuzz_ckpt/valid_two_slices, truncated,
 *                              valid_slice_and_table, fix_one_table
 *
 * The files are signed with fuzz_ckpt's fixed key (bytes 0x5a) and run id
 * (bytes 0x11). The FIX* seeds are record bodies only and need no
 * rewriting when the header or trailer changes (fix_one_table: "FIX", the
 * count byte 0x10 for one table, then a table record of a small trained
 * Adagrad table with an admission sketch). Rerun after a format change.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "persist/checkpoint.h"
#include "persist/ckpttable.h"
#include "sparse/table.h"

static int copy_out(const char *from, const char *to, size_t max) {
  FILE *i = fopen(from, "rb"), *o = fopen(to, "wb");
  if (!i || !o) {
    perror(i ? to : from);
    return 1;
  }
  char buf[4096];
  size_t n, total = 0;
  while ((n = fread(buf, 1, sizeof buf, i)) > 0 && total < max) {
    if (n > max - total) n = max - total;
    fwrite(buf, 1, n, o);
    total += n;
  }
  fclose(i);
  return fclose(o) != 0;
}

/* A small trained table: rows, Adagrad state, a sketch (admit_count 2). */
static psd_table *small_table(void) {
  psd_table_spec s;
  memset(&s, 0, sizeof s);
  snprintf(s.name, sizeof s.name, "emb");
  s.dim = 2;
  s.capacity = 4;
  s.init_kind = PS_INIT_UNIFORM;
  s.init_a = -1;
  s.init_b = 1;
  s.opt = PS_TOPT_ADAGRAD;
  s.lr = 0.1;
  s.initial_accumulator = 0.1;
  s.epsilon = 1e-7;
  s.admit_count = 2;
  char err[400];
  psd_table *t = NULL;
  if (psd_table_create(&s, 1, 1, 0, &t, err, sizeof err) != 0) {
    fprintf(stderr, "%s\n", err);
    exit(1);
  }
  uint64_t keys[3] = {1, 5, 9};
  float rows[6], g[6] = {0.5f, -0.5f, 1, 1, -2, 0.25f};
  for (uint64_t step = 0; step < 3; step++) {
    psd_table_pull(t, keys, 3, 1, rows);
    psd_table_push(t, 0, step, keys, 3, g, NULL);
  }
  return t;
}

/* psd's own record of the table t, as fuzz_ckpt's FIX input. */
static int write_fix_table(const char *path, const psd_table *t) {
  size_t len = psd_ckpttable_size(t);
  uint8_t *b = malloc(len);
  FILE *o = fopen(path, "wb");
  if (!b || !o) {
    perror(path);
    return 1;
  }
  if (psd_ckpttable_encode(t, b, len) != 0) {
    fprintf(stderr, "table encoding failed\n");
    return 1;
  }
  fwrite("FIX\x10", 1, 4, o);
  fwrite(b, 1, len, o);
  free(b);
  return fclose(o) != 0;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: make_ckpt_corpus DIR (writes DIR/fuzz_ckpt/)\n");
    return 2;
  }
  char out[1024], work[] = "/tmp/make_ckpt_corpus-XXXXXX", err[1600], moved[1200];
  snprintf(out, sizeof out, "%s/fuzz_ckpt", argv[1]);
  if ((mkdir(out, 0755) != 0 && errno != EEXIST) || !mkdtemp(work)) {
    perror(out);
    return 1;
  }
  psd_ckptdir d;
  psd_ckptdir_holder h = {-1, 0, 1};
  if (psd_ckptdir_open(&d, work, &h, 0, moved, sizeof moved, err, sizeof err) != 0) {
    fprintf(stderr, "%s\n", err);
    return 1;
  }
  memset(d.key, 0x5a, sizeof d.key);
  memset(d.run_id, 0x11, sizeof d.run_id);
  float p1[6] = {1, 2, 3, 4, 5, 6}, p2[4] = {-1, -2, -3, -4}, s2[8] = {0};
  psd_ckpt_meta m = {0, 1, 2, 2, 0, 7, 2, 0};
  psd_ckpt_rec a = {.name = "conv1/w", .ndim = 2, .shape = {2, 3}, .length = 6,
                    .opt_kind = PS_OPT_SGD, .step = 7, .param = p1};
  psd_ckpt_rec b = {.name = "fc/b", .ndim = 1, .shape = {10}, .offset = 6, .length = 4,
                    .opt_kind = PS_OPT_ADAM, .state_per = 2, .step = 7, .param = p2,
                    .state = s2};
  psd_ckpt_writer w;
  if (psd_ckpt_begin(&w, &d, &m, err, sizeof err) || psd_ckpt_add(&w, &a, err, sizeof err) ||
      psd_ckpt_add(&w, &b, err, sizeof err) || psd_ckpt_commit(&w, err, sizeof err)) {
    fprintf(stderr, "%s\n", err);
    return 1;
  }
  char src[1400], dst[1200];
  snprintf(src, sizeof src, "%s/step-000000000007/ps-0-of-1.ckpt", work);
  snprintf(dst, sizeof dst, "%s/valid_two_slices", out);
  int rc = copy_out(src, dst, (size_t)-1);
  snprintf(dst, sizeof dst, "%s/truncated", out);
  rc |= copy_out(src, dst, 100);
  /* A slice and a table in one file (step 8), and the table alone. */
  psd_table *t = small_table();
  size_t tlen = psd_ckpttable_size(t);
  uint8_t *tb = malloc(tlen);
  psd_ckpt_meta m2 = {0, 1, 2, 2, 0, 8, 1, 1};
  a.step = 8;
  snprintf(err, sizeof err, "out of memory, or table encoding failed");
  if (!tb || psd_ckpttable_encode(t, tb, tlen) != 0 ||
      psd_ckpt_begin(&w, &d, &m2, err, sizeof err) ||
      psd_ckpt_add(&w, &a, err, sizeof err) || psd_ckpt_add_table(&w, tb, tlen, err, sizeof err) ||
      psd_ckpt_commit(&w, err, sizeof err)) {
    fprintf(stderr, "%s\n", err);
    return 1;
  }
  free(tb);
  snprintf(src, sizeof src, "%s/step-000000000008/ps-0-of-1.ckpt", work);
  snprintf(dst, sizeof dst, "%s/valid_slice_and_table", out);
  rc |= copy_out(src, dst, (size_t)-1);
  snprintf(dst, sizeof dst, "%s/fix_one_table", out);
  rc |= write_fix_table(dst, t);
  psd_table_destroy(t);
  psd_ckptdir_close(&d);
  char cmd[200];
  snprintf(cmd, sizeof cmd, "rm -rf %s", work);
  return rc | (system(cmd) != 0);
}
