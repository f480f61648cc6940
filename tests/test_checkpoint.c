/* psd/checkpoint.c: the file format, crash safety, finding and pruning. */
#define _GNU_SOURCE
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "testutil.h"

/* Big enough for any file these tests write. */
#define MAXB (1u << 26)

static char *fresh_dir(const char *name) {
  static char buf[4][600];
  static int k;
  char *d = buf[k++ % 4];
  snprintf(d, 600, "%s/%s-%d", tu_tmpdir(), name, rand());
  ck_assert_int_eq(mkdir(d, 0700), 0);
  return d;
}

/* Writes the file of ps `ps` of `nps` at `step`: two slices, one with
 * Adam state, values derived from (step, ps) so files differ. */
static void write_one(const char *dir, uint32_t ps, uint32_t nps, uint64_t step, int commit) {
  static float p1[6], p2[4], s2[8];
  for (int i = 0; i < 6; i++) p1[i] = (float)step + 0.25f * (float)i + 100.0f * (float)ps;
  for (int i = 0; i < 4; i++) p2[i] = -(float)step - (float)i;
  for (int i = 0; i < 8; i++) s2[i] = 0.5f * (float)i;
  psd_ckpt_meta m = {ps, nps, 2, 2, 0, step, 2};
  psd_ckpt_writer w;
  char err[1200];
  ck_assert_msg(psd_ckpt_begin(&w, dir, &m, err, sizeof err) == 0, "%s", err);
  psd_ckpt_rec a = {.name = "conv1/w", .ndim = 2, .shape = {2, 3}, .offset = 0, .length = 6,
                    .opt_kind = PS_OPT_SGD, .state_per = 0, .step = step, .param = p1};
  psd_ckpt_rec b = {.name = "fc/b", .ndim = 1, .shape = {10}, .offset = 6, .length = 4,
                    .opt_kind = PS_OPT_ADAM, .state_per = 2, .step = step, .param = p2,
                    .state = s2};
  ck_assert_msg(psd_ckpt_add(&w, &a, err, sizeof err) == 0, "%s", err);
  ck_assert_msg(psd_ckpt_add(&w, &b, err, sizeof err) == 0, "%s", err);
  if (commit) {
    ck_assert_msg(psd_ckpt_commit(&w, err, sizeof err) == 0, "%s", err);
  } else {
    close(w.fd); /* a crash: the temporary file stays behind */
  }
}

static void path_of(char *out, size_t n, const char *dir, uint64_t step, int ps, int nps) {
  snprintf(out, n, "%s/step-%012llu/ps-%d-of-%d.ckpt", dir, (unsigned long long)step, ps, nps);
}

START_TEST(crc32c_known_value) {
  /* The standard check value of CRC-32C, and incremental use. */
  ck_assert_uint_eq(psd_crc32c(0, "123456789", 9), 0xE3069283u);
  ck_assert_uint_eq(psd_crc32c(psd_crc32c(0, "1234", 4), "56789", 5), 0xE3069283u);
  ck_assert_uint_eq(psd_crc32c(0, "", 0), 0);
}
END_TEST

START_TEST(roundtrip) {
  const char *d = fresh_dir("rt");
  write_one(d, 1, 2, 40, 1);
  char f[1200], err[1600];
  path_of(f, sizeof f, d, 40, 1, 2);
  psd_ckpt_image img;
  ck_assert_msg(psd_ckpt_read(f, MAXB, &img, err, sizeof err) == 0, "%s", err);
  ck_assert_uint_eq(img.meta.ps_index, 1);
  ck_assert_uint_eq(img.meta.num_ps, 2);
  ck_assert_uint_eq(img.meta.step, 40);
  ck_assert_uint_eq(img.meta.nslices, 2);
  ck_assert_str_eq(img.recs[0].name, "conv1/w");
  ck_assert_str_eq(img.recs[1].name, "fc/b");
  ck_assert_uint_eq(img.recs[0].shape[1], 3);
  ck_assert_uint_eq(img.recs[1].offset, 6);
  ck_assert_uint_eq(img.recs[1].state_per, 2);
  float v[8];
  memcpy(v, img.recs[0].param, 6 * sizeof(float));
  ck_assert(v[5] == 40.0f + 1.25f + 100.0f);
  memcpy(v, img.recs[1].state, 8 * sizeof(float));
  ck_assert(v[7] == 3.5f);
  ck_assert_ptr_null(img.recs[0].state);
  psd_ckpt_image_free(&img);
  psd_ckpt_image_free(&img); /* twice is harmless */
}
END_TEST

START_TEST(every_damage_is_detected) {
  /* Flip each byte, and cut the file at each length: every variant is
   * refused with a sentence naming the file, and nothing crashes. */
  const char *d = fresh_dir("dmg");
  write_one(d, 0, 1, 7, 1);
  char f[1200], g[1300], err[1600];
  path_of(f, sizeof f, d, 7, 0, 1);
  char *orig = tu_read_file(f);
  struct stat st;
  ck_assert_int_eq(stat(f, &st), 0);
  size_t n = (size_t)st.st_size;
  snprintf(g, sizeof g, "%s.bad", f);
  psd_ckpt_image img;
  for (size_t i = 0; i < n; i++) {
    orig[i] ^= 0x40;
    FILE *o = fopen(g, "wb");
    fwrite(orig, 1, n, o);
    fclose(o);
    orig[i] ^= 0x40;
    ck_assert_msg(psd_ckpt_read(g, MAXB, &img, err, sizeof err) == -1, "byte %zu flipped", i);
    ck_assert_msg(strstr(err, g) != NULL, "error names the file: %s", err);
  }
  for (size_t len = 0; len < n; len++) {
    ck_assert_int_eq(truncate(g, 0), 0);
    FILE *o = fopen(g, "wb");
    fwrite(orig, 1, len, o);
    fclose(o);
    ck_assert_msg(psd_ckpt_read(g, MAXB, &img, err, sizeof err) == -1, "cut at %zu", len);
  }
  ck_assert_msg(psd_ckpt_read(f, 100, &img, err, sizeof err) == -1, "size limit");
  ck_assert_msg(strstr(err, "more than this server may hold") != NULL, "%s", err);
  free(orig);
}
END_TEST

START_TEST(find_newest_complete) {
  const char *d = fresh_dir("find");
  psd_ckpt_image img;
  char err[1600];
  ck_assert_int_eq(psd_ckpt_find(d, 0, 2, 0, MAXB, &img, err, sizeof err), 0); /* empty */
  write_one(d, 0, 2, 10, 1);
  write_one(d, 1, 2, 10, 1);
  write_one(d, 0, 2, 20, 1);
  write_one(d, 1, 2, 20, 1);
  write_one(d, 0, 2, 30, 1); /* ps 1 died before writing step 30 */
  write_one(d, 1, 2, 40, 0); /* and crashed while writing 40 */
  for (uint32_t ps = 0; ps < 2; ps++) {
    ck_assert_msg(psd_ckpt_find(d, ps, 2, 0, MAXB, &img, err, sizeof err) == 1, "%s", err);
    ck_assert_uint_eq(img.meta.step, 20);
    ck_assert_uint_eq(img.meta.ps_index, ps);
    psd_ckpt_image_free(&img);
  }
}
END_TEST

START_TEST(damaged_newest_is_an_error_unless_fallback) {
  const char *d = fresh_dir("fb");
  write_one(d, 0, 1, 5, 1);
  write_one(d, 0, 1, 9, 1);
  char f[1200], err[1600];
  path_of(f, sizeof f, d, 9, 0, 1);
  int fd = open(f, O_WRONLY);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(pwrite(fd, "X", 1, 100), 1);
  close(fd);
  psd_ckpt_image img;
  ck_assert_int_eq(psd_ckpt_find(d, 0, 1, 0, MAXB, &img, err, sizeof err), -1);
  ck_assert_msg(strstr(err, f) && strstr(err, "checksum") && strstr(err, "--restore=fallback"),
                "%s", err);
  ck_assert_msg(psd_ckpt_find(d, 0, 1, 1, MAXB, &img, err, sizeof err) == 1, "%s", err);
  ck_assert_uint_eq(img.meta.step, 5);
  psd_ckpt_image_free(&img);
}
END_TEST

START_TEST(wrong_ps_count_is_named) {
  const char *d = fresh_dir("count");
  write_one(d, 0, 2, 8, 1);
  write_one(d, 1, 2, 8, 1);
  psd_ckpt_image img;
  char err[1600];
  ck_assert_int_eq(psd_ckpt_find(d, 0, 3, 0, MAXB, &img, err, sizeof err), -1);
  ck_assert_msg(strstr(err, "2 ps tasks") && strstr(err, "3"), "%s", err);
  /* A file renamed to another ps's name is caught by its header. */
  char a[1200], b[1200];
  path_of(a, sizeof a, d, 8, 1, 2);
  path_of(b, sizeof b, d, 8, 0, 2);
  ck_assert_int_eq(rename(a, b), 0);
  write_one(d, 1, 2, 8, 1);
  ck_assert_int_eq(psd_ckpt_find(d, 0, 2, 0, MAXB, &img, err, sizeof err), -1);
  ck_assert_msg(strstr(err, "written by ps 1 of 2, this is ps 0 of 2"), "%s", err);
}
END_TEST

static int count_files(const char *dir, const char *suffix) {
  int n = 0;
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d && (e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char sub[1200];
    snprintf(sub, sizeof sub, "%s/%s", dir, e->d_name);
    DIR *s = opendir(sub);
    struct dirent *f;
    while (s && (f = readdir(s)) != NULL) {
      size_t l = strlen(f->d_name), k = strlen(suffix);
      n += l > k && strcmp(f->d_name + l - k, suffix) == 0;
    }
    if (s) closedir(s);
  }
  if (d) closedir(d);
  return n;
}

START_TEST(prune_keeps_newest) {
  const char *d = fresh_dir("prune");
  for (uint64_t s = 1; s <= 5; s++) write_one(d, 0, 1, s * 10, 1);
  write_one(d, 0, 1, 60, 0); /* leftover of a crash */
  ck_assert_int_eq(count_files(d, ".ckpt"), 5);
  ck_assert_int_eq(count_files(d, ".tmp"), 1);
  ck_assert_int_eq(psd_ckpt_prune(d, 0, 1, 2), 4);
  ck_assert_int_eq(count_files(d, ".ckpt"), 2);
  ck_assert_int_eq(count_files(d, ".tmp"), 0);
  char f[1200];
  path_of(f, sizeof f, d, 50, 0, 1);
  ck_assert_int_eq(access(f, F_OK), 0);
  path_of(f, sizeof f, d, 30, 0, 1);
  ck_assert_int_ne(access(f, F_OK), 0);
  snprintf(f, sizeof f, "%s/step-000000000010", d);
  ck_assert_msg(access(f, F_OK) != 0, "empty step directories are removed");
}
END_TEST

START_TEST(prune_never_breaks_the_newest_complete) {
  /* ps0 wrote steps 10 and 20, ps1 died before writing 20: with keep 1, ps0
   * must keep its part of step 10, the newest complete checkpoint. */
  const char *d = fresh_dir("prune2");
  write_one(d, 0, 2, 10, 1);
  write_one(d, 1, 2, 10, 1);
  write_one(d, 0, 2, 20, 1);
  ck_assert_int_eq(psd_ckpt_prune(d, 0, 2, 1), 0);
  psd_ckpt_image img;
  char err[1600];
  ck_assert_msg(psd_ckpt_find(d, 0, 2, 0, MAXB, &img, err, sizeof err) == 1, "%s", err);
  ck_assert_uint_eq(img.meta.step, 10);
  psd_ckpt_image_free(&img);
  /* Once step 20 is complete too, step 10 goes. */
  write_one(d, 1, 2, 20, 1);
  ck_assert_int_eq(psd_ckpt_prune(d, 0, 2, 1), 1);
  ck_assert_int_eq(psd_ckpt_prune(d, 1, 2, 1), 1);
  ck_assert_int_eq(count_files(d, ".ckpt"), 2);
  /* Only this ps's files and nothing complete: found nothing, but a
   * warning says why (an unshared directory looks like this). */
  const char *e = fresh_dir("alone");
  write_one(e, 0, 2, 5, 1);
  ck_assert_int_eq(psd_ckpt_find(e, 0, 2, 0, MAXB, &img, err, sizeof err), 0);
  ck_assert_msg(strstr(err, "do not share"), "%s", err);
}
END_TEST

/* Rewrites the trailer's CRC so damage inside the records gets past the
 * checksum and reaches the record parser's own bounds checks. */
static void refresh_crc(char *buf, size_t n) {
  uint32_t c = psd_crc32c(0, buf, n - 4);
  for (int i = 0; i < 4; i++) buf[n - 4 + i] = (char)(c >> (8 * i));
}

START_TEST(record_bounds_past_the_checksum) {
  const char *d = fresh_dir("bounds");
  write_one(d, 0, 1, 3, 1);
  char f[1200], g[1300], err[1600];
  path_of(f, sizeof f, d, 3, 0, 1);
  snprintf(g, sizeof g, "%s.x", f);
  char *orig = tu_read_file(f);
  struct stat st;
  ck_assert_int_eq(stat(f, &st), 0);
  size_t n = (size_t)st.st_size;
  /* Offsets in the first record: name length at 68, rank at 79, the
   * element count at 107; the header's slice count at 48. */
  struct { size_t at; uint32_t v; const char *why; } cases[] = {
      {68, 0xFFFFFFF0u, "name length"}, {79, 9, "dimensions"}, {107, 0x7FFFFFFFu, "elements"},
      {48, 3, "slices"}, {48, 1, "stray bytes"}};
  psd_ckpt_image img;
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char *b = malloc(n);
    memcpy(b, orig, n);
    for (int i = 0; i < 4; i++) b[cases[k].at + i] = (char)(cases[k].v >> (8 * i));
    if (cases[k].at == 48)
      for (int i = 0; i < 4; i++) b[n - 8 + i] = (char)(cases[k].v >> (8 * i));
    refresh_crc(b, n);
    FILE *o = fopen(g, "wb");
    fwrite(b, 1, n, o);
    fclose(o);
    free(b);
    ck_assert_msg(psd_ckpt_read(g, MAXB, &img, err, sizeof err) == -1, "%s accepted",
                  cases[k].why);
    ck_assert_msg(strstr(err, g) && !strstr(err, "checksum"), "%s: %s", cases[k].why, err);
  }
  free(orig);
}
END_TEST

START_TEST(writer_counts_records) {
  const char *d = fresh_dir("cnt");
  psd_ckpt_meta m = {0, 1, 1, 1, 0, 3, 1};
  psd_ckpt_writer w;
  char err[1200];
  float x = 1;
  psd_ckpt_rec r = {.name = "x", .ndim = 1, .shape = {1}, .length = 1, .param = &x};
  ck_assert_int_eq(psd_ckpt_begin(&w, d, &m, err, sizeof err), 0);
  ck_assert_int_eq(psd_ckpt_commit(&w, err, sizeof err), -1); /* 0 of 1 */
  ck_assert_msg(strstr(err, "0 of 1"), "%s", err);
  ck_assert_int_eq(psd_ckpt_begin(&w, d, &m, err, sizeof err), 0);
  ck_assert_int_eq(psd_ckpt_add(&w, &r, err, sizeof err), 0);
  ck_assert_int_eq(psd_ckpt_add(&w, &r, err, sizeof err), -1); /* 2 of 1 */
  psd_ckpt_abort(&w);
  psd_ckpt_abort(&w);
  ck_assert_int_eq(count_files(d, ".tmp"), 0);
  ck_assert_int_eq(psd_ckpt_begin(&w, "/proc/no/such/dir", &m, err, sizeof err), -1);
  ck_assert_msg(strstr(err, "/proc/no/such/dir"), "%s", err);
}
END_TEST

Suite *suite_checkpoint(void) {
  Suite *s = suite_create("checkpoint");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, crc32c_known_value);
  tcase_add_test(tc, roundtrip);
  tcase_add_test(tc, every_damage_is_detected);
  tcase_add_test(tc, find_newest_complete);
  tcase_add_test(tc, damaged_newest_is_an_error_unless_fallback);
  tcase_add_test(tc, wrong_ps_count_is_named);
  tcase_add_test(tc, prune_keeps_newest);
  tcase_add_test(tc, writer_counts_records);
  tcase_add_test(tc, prune_never_breaks_the_newest_complete);
  tcase_add_test(tc, record_bounds_past_the_checksum);
  suite_add_tcase(s, tc);
  return s;
}
