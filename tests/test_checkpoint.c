/* psd/persist/checkpoint.c and psd/persist/ckptdir.c: the file format, crash safety,
 * finding and pruning; the MAC and run id; the directory's ownership rules,
 * its lock, and --restore=none moving an earlier run aside. */
#define _GNU_SOURCE
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "persist/checkpoint.h"
#include "mac.h"
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

/* The open directory handle of a test directory (opened once per test
 * process, as ps 0 of job 1: one psd holds one handle for its life). */
static psd_ckptdir *D(const char *dir) {
  static psd_ckptdir open_dirs[8];
  static int n;
  int slot = n;
  for (int i = 0; i < n; i++) {
    if (open_dirs[i].fd >= 0 && strcmp(open_dirs[i].path, dir) == 0) return &open_dirs[i];
    if (open_dirs[i].fd < 0) slot = i; /* closed by the test: reusable */
  }
  ck_assert_int_lt(slot, 8);
  psd_ckptdir_holder h = {1, 0, 1};
  char moved[1200], err[1600];
  ck_assert_msg(psd_ckptdir_open(&open_dirs[slot], dir, &h, 0, moved, sizeof moved, err,
                                 sizeof err) == 0, "%s", err);
  if (slot == n) n++;
  return &open_dirs[slot];
}

/* Writes the file of ps `ps` of `nps` at `step`: two slices, one with
 * Adam state, values derived from (step, ps) so files differ. */
static void write_one(const char *dir, uint32_t ps, uint32_t nps, uint64_t step, int commit) {
  static float p1[6], p2[4], s2[8];
  for (int i = 0; i < 6; i++) p1[i] = (float)step + 0.25f * (float)i + 100.0f * (float)ps;
  for (int i = 0; i < 4; i++) p2[i] = -(float)step - (float)i;
  for (int i = 0; i < 8; i++) s2[i] = 0.5f * (float)i;
  psd_ckpt_meta m = {ps, nps, 2, 2, 0, step, 2, 0};
  psd_ckpt_writer w;
  char err[1200];
  ck_assert_msg(psd_ckpt_begin(&w, D(dir), &m, err, sizeof err) == 0, "%s", err);
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
    close(w.sfd);
  }
}

static void path_of(char *out, size_t n, const char *dir, uint64_t step, int ps, int nps) {
  snprintf(out, n, "%s/step-%012llu/ps-%d-of-%d.ckpt", dir, (unsigned long long)step, ps, nps);
}

START_TEST(crc32c_known_value) {
  /* The standard check value of CRC-32C, and incremental use. */
  ck_assert_uint_eq(psd_ckpt_crc32c(0, "123456789", 9), 0xE3069283u);
  ck_assert_uint_eq(psd_ckpt_crc32c(psd_ckpt_crc32c(0, "1234", 4), "56789", 5), 0xE3069283u);
  ck_assert_uint_eq(psd_ckpt_crc32c(0, "", 0), 0);
}
END_TEST

START_TEST(roundtrip) {
  const char *d = fresh_dir("rt");
  write_one(d, 1, 2, 40, 1);
  char f[1200], err[1600];
  path_of(f, sizeof f, d, 40, 1, 2);
  psd_ckpt_image img;
  ck_assert_msg(psd_ckpt_read(D(d), f, MAXB, &img, err, sizeof err) == 0, "%s", err);
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
    ck_assert_msg(psd_ckpt_read(D(d), g, MAXB, &img, err, sizeof err) == -1, "byte %zu flipped", i);
    ck_assert_msg(strstr(err, g) != NULL, "error names the file: %s", err);
  }
  for (size_t len = 0; len < n; len++) {
    ck_assert_int_eq(truncate(g, 0), 0);
    FILE *o = fopen(g, "wb");
    fwrite(orig, 1, len, o);
    fclose(o);
    ck_assert_msg(psd_ckpt_read(D(d), g, MAXB, &img, err, sizeof err) == -1, "cut at %zu", len);
  }
  ck_assert_msg(psd_ckpt_read(D(d), f, 100, &img, err, sizeof err) == -1, "size limit");
  ck_assert_msg(strstr(err, "more than this server may hold") != NULL, "%s", err);
  free(orig);
}
END_TEST

START_TEST(find_newest_complete) {
  const char *d = fresh_dir("find");
  psd_ckpt_image img;
  char err[1600];
  ck_assert_int_eq(psd_ckpt_find(D(d), 0, 2, 0, MAXB, &img, err, sizeof err), 0); /* empty */
  write_one(d, 0, 2, 10, 1);
  write_one(d, 1, 2, 10, 1);
  write_one(d, 0, 2, 20, 1);
  write_one(d, 1, 2, 20, 1);
  write_one(d, 0, 2, 30, 1); /* ps 1 died before writing step 30 */
  write_one(d, 1, 2, 40, 0); /* and crashed while writing 40 */
  for (uint32_t ps = 0; ps < 2; ps++) {
    ck_assert_msg(psd_ckpt_find(D(d), ps, 2, 0, MAXB, &img, err, sizeof err) == 1, "%s", err);
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
  ck_assert_int_eq(psd_ckpt_find(D(d), 0, 1, 0, MAXB, &img, err, sizeof err), -1);
  ck_assert_msg(strstr(err, f) && strstr(err, "checksum") && strstr(err, "--restore=fallback"),
                "%s", err);
  ck_assert_msg(psd_ckpt_find(D(d), 0, 1, 1, MAXB, &img, err, sizeof err) == 1, "%s", err);
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
  ck_assert_int_eq(psd_ckpt_find(D(d), 0, 3, 0, MAXB, &img, err, sizeof err), -1);
  ck_assert_msg(strstr(err, "2 ps tasks") && strstr(err, "3"), "%s", err);
  /* A file renamed to another ps's name is caught by its header. */
  char a[1200], b[1200];
  path_of(a, sizeof a, d, 8, 1, 2);
  path_of(b, sizeof b, d, 8, 0, 2);
  ck_assert_int_eq(rename(a, b), 0);
  write_one(d, 1, 2, 8, 1);
  ck_assert_int_eq(psd_ckpt_find(D(d), 0, 2, 0, MAXB, &img, err, sizeof err), -1);
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
  ck_assert_int_eq(psd_ckpt_prune(D(d), 0, 1, 2), 4);
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
  ck_assert_int_eq(psd_ckpt_prune(D(d), 0, 2, 1), 0);
  psd_ckpt_image img;
  char err[1600];
  ck_assert_msg(psd_ckpt_find(D(d), 0, 2, 0, MAXB, &img, err, sizeof err) == 1, "%s", err);
  ck_assert_uint_eq(img.meta.step, 10);
  psd_ckpt_image_free(&img);
  /* Once step 20 is complete too, step 10 goes. */
  write_one(d, 1, 2, 20, 1);
  ck_assert_int_eq(psd_ckpt_prune(D(d), 0, 2, 1), 1);
  ck_assert_int_eq(psd_ckpt_prune(D(d), 1, 2, 1), 1);
  ck_assert_int_eq(count_files(d, ".ckpt"), 2);
  /* Only this ps's files and nothing complete: found nothing, but a
   * warning says why (an unshared directory looks like this). */
  const char *e = fresh_dir("alone");
  write_one(e, 0, 2, 5, 1);
  ck_assert_int_eq(psd_ckpt_find(D(e), 0, 2, 0, MAXB, &img, err, sizeof err), 0);
  ck_assert_msg(strstr(err, "do not share"), "%s", err);
}
END_TEST

/* Rewrites the trailer's CRC (and, with a key, its MAC) so damage inside
 * the records gets past them and reaches the record parser's own checks. */
static void refresh_crc(char *buf, size_t n, const psd_ckptdir *d) {
  uint32_t c = psd_ckpt_crc32c(0, buf, n - 36);
  for (int i = 0; i < 4; i++) buf[n - 36 + i] = (char)(c >> (8 * i));
  if (!d) return;
  ps__mac_part part = {buf, n - 32};
  ck_assert_int_eq(ps__hmac(d->key, sizeof d->key, &part, 1, (uint8_t *)buf + n - 32), 0);
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
  /* Offsets in the first record: name length at 84, rank at 95, the
   * element count at 123; the header's slice count at 48. */
  struct { size_t at; uint32_t v; const char *why; } cases[] = {
      {84, 0xFFFFFFF0u, "name length"}, {95, 9, "dimensions"}, {123, 0x7FFFFFFFu, "elements"},
      {48, 3, "slices"}, {48, 1, "stray bytes"}};
  psd_ckpt_image img;
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char *b = malloc(n);
    memcpy(b, orig, n);
    for (int i = 0; i < 4; i++) b[cases[k].at + i] = (char)(cases[k].v >> (8 * i));
    if (cases[k].at == 48)
      for (int i = 0; i < 4; i++) b[n - 40 + i] = (char)(cases[k].v >> (8 * i));
    /* With only the CRC made right, the MAC refuses it (a forger without
     * the key); with the MAC too, the record parser does. */
    for (int with_key = 0; with_key < 2; with_key++) {
      refresh_crc(b, n, with_key ? D(d) : NULL);
      FILE *o = fopen(g, "wb");
      fwrite(b, 1, n, o);
      fclose(o);
      ck_assert_msg(psd_ckpt_read(D(d), g, MAXB, &img, err, sizeof err) == -1, "%s accepted",
                    cases[k].why);
      ck_assert_msg(strstr(err, g) && !strstr(err, "checksum"), "%s: %s", cases[k].why, err);
      ck_assert_msg((strstr(err, "MAC mismatch") == NULL) == with_key, "%s: %s", cases[k].why, err);
    }
    free(b);
  }
  free(orig);
}
END_TEST

START_TEST(writer_counts_records) {
  const char *d = fresh_dir("cnt");
  psd_ckpt_meta m = {0, 1, 1, 1, 0, 3, 1, 0};
  psd_ckpt_writer w;
  char err[1200];
  float x = 1;
  psd_ckpt_rec r = {.name = "x", .ndim = 1, .shape = {1}, .length = 1, .param = &x};
  ck_assert_int_eq(psd_ckpt_begin(&w, D(d), &m, err, sizeof err), 0);
  ck_assert_int_eq(psd_ckpt_commit(&w, err, sizeof err), -1); /* 0 of 1 */
  ck_assert_msg(strstr(err, "0 of 1"), "%s", err);
  ck_assert_int_eq(psd_ckpt_begin(&w, D(d), &m, err, sizeof err), 0);
  ck_assert_int_eq(psd_ckpt_add(&w, &r, err, sizeof err), 0);
  ck_assert_int_eq(psd_ckpt_add(&w, &r, err, sizeof err), -1); /* 2 of 1 */
  psd_ckpt_abort(&w);
  psd_ckpt_abort(&w);
  ck_assert_int_eq(count_files(d, ".tmp"), 0);
  psd_ckptdir nd;
  psd_ckptdir_holder h = {1, 0, 1};
  char moved[100];
  ck_assert_int_eq(psd_ckptdir_open(&nd, "/proc/no/such/dir", &h, 0, moved, sizeof moved, err,
                                    sizeof err), -1);
  ck_assert_msg(strstr(err, "/proc/no/such/dir"), "%s", err);
}
END_TEST

/* nobody's uid and gid, for files "another user" owns: 1, or 0 when this
 * process cannot chown to it (not root), which skips checkpoint_users. */
static int nobody(uid_t *uid, gid_t *gid) {
  struct passwd *pw = getpwnam("nobody");
  if (!pw || geteuid() != 0) return 0;
  *uid = pw->pw_uid;
  *gid = pw->pw_gid;
  return 1;
}

START_TEST(planted_symlink_is_never_followed) {
  /* attack 5: the temporary's name planted as a symlink to a victim file. */
  const char *d = fresh_dir("plant");
  char victim[700], step[1200], tmp[1300], err[1600];
  snprintf(victim, sizeof victim, "%s/victim", tu_tmpdir());
  FILE *v = fopen(victim, "w");
  fputs("precious", v);
  fclose(v);
  snprintf(step, sizeof step, "%s/step-000000000007", d);
  ck_assert_int_eq(mkdir(step, 0700), 0);
  snprintf(tmp, sizeof tmp, "%s/ps-0-of-1.ckpt.tmp", step);
  ck_assert_int_eq(symlink(victim, tmp), 0);
  psd_ckpt_meta m = {0, 1, 1, 1, 0, 7, 0, 0};
  psd_ckpt_writer w;
  /* Our own leftover link is removed, never written through. */
  ck_assert_msg(psd_ckpt_begin(&w, D(d), &m, err, sizeof err) == 0, "%s", err);
  ck_assert_msg(psd_ckpt_commit(&w, err, sizeof err) == 0, "%s", err);
  char *after = tu_read_file(victim);
  ck_assert_str_eq(after, "precious");
  free(after);
  struct stat st;
  ck_assert_int_eq(lstat(tmp, &st), -1);
}
END_TEST

START_TEST(directory_rules) {
  /* attacks 5 and 6: a directory another user owns or can write, or a
   * symlink, is refused with its path, owner and mode named. */
  const char *d = fresh_dir("rules");
  psd_ckptdir x;
  psd_ckptdir_holder h = {3, 0, 1};
  char moved[1200], err[1600];
  ck_assert_int_eq(chmod(d, 0770), 0);
  ck_assert_int_eq(psd_ckptdir_open(&x, d, &h, 0, moved, sizeof moved, err, sizeof err), -1);
  ck_assert_msg(strstr(err, d) && strstr(err, "0770") && strstr(err, "writable by its group"),
                "%s", err);
  ck_assert_int_eq(chmod(d, 0700), 0);
  char link[700];
  snprintf(link, sizeof link, "%s-link", d);
  ck_assert_int_eq(symlink(d, link), 0);
  ck_assert_int_eq(psd_ckptdir_open(&x, link, &h, 0, moved, sizeof moved, err, sizeof err), -1);
  ck_assert_msg(strstr(err, link) && strstr(err, "symlink"), "%s", err);
}
END_TEST

START_TEST(others_symlink_is_refused) {
  /* attack 5: the temporary's name planted as a symlink to a victim file. */
  const char *d = fresh_dir("plant");
  char victim[700], step[1200], tmp[1300], err[1600];
  snprintf(victim, sizeof victim, "%s/victim", tu_tmpdir());
  FILE *v = fopen(victim, "w");
  fputs("precious", v);
  fclose(v);
  snprintf(step, sizeof step, "%s/step-000000000007", d);
  ck_assert_int_eq(mkdir(step, 0700), 0);
  snprintf(tmp, sizeof tmp, "%s/ps-0-of-1.ckpt.tmp", step);
  ck_assert_int_eq(symlink(victim, tmp), 0);
  uid_t uid;
  gid_t gid;
  psd_ckpt_meta m = {0, 1, 1, 1, 0, 7, 0, 0};
  psd_ckpt_writer w;
  ck_assert(nobody(&uid, &gid));
  {
    /* Another user's link: refused and left alone, the victim untouched. */
    ck_assert_int_eq(lchown(tmp, uid, gid), 0);
    ck_assert_int_eq(psd_ckpt_begin(&w, D(d), &m, err, sizeof err), -1);
    ck_assert_msg(strstr(err, tmp) && strstr(err, "symlink") && strstr(err, "nobody"), "%s",
                  err);
    ck_assert_int_eq(lchown(tmp, 0, 0), 0);
  }
  char *after = tu_read_file(victim);
  ck_assert_str_eq(after, "precious");
  free(after);
}
END_TEST

START_TEST(others_directories_are_refused) {
  /* A directory, or a step directory, another user owns is refused. */
  const char *d = fresh_dir("others");
  psd_ckptdir x;
  psd_ckptdir_holder h = {3, 0, 1};
  char moved[1200], err[1600];
  uid_t uid;
  gid_t gid;
  ck_assert(nobody(&uid, &gid));
  ck_assert_int_eq(chown(d, uid, gid), 0);
  ck_assert_int_eq(psd_ckptdir_open(&x, d, &h, 0, moved, sizeof moved, err, sizeof err), -1);
  ck_assert_msg(strstr(err, d) && strstr(err, "owned by nobody"), "%s", err);
  ck_assert_int_eq(chown(d, 0, 0), 0);
  /* A step directory of someone else's is never read from. */
  write_one(d, 0, 1, 4, 1);
  char sd[1200];
  snprintf(sd, sizeof sd, "%s/step-000000000004", d);
  ck_assert_int_eq(chown(sd, uid, gid), 0);
  psd_ckpt_image img;
  ck_assert_int_eq(psd_ckpt_find(D(d), 0, 1, 0, MAXB, &img, err, sizeof err), -1);
  ck_assert_msg(strstr(err, sd) && strstr(err, "owned by nobody"), "%s", err);
}
END_TEST

START_TEST(lock_names_the_holder) {
  const char *d = fresh_dir("lock");
  psd_ckptdir a, b, c;
  psd_ckptdir_holder ha = {41, 0, 2}, ha1 = {41, 1, 2}, hb = {42, 0, 1};
  char moved[1200], err[1600];
  ck_assert_msg(psd_ckptdir_open(&a, d, &ha, 0, moved, sizeof moved, err, sizeof err) == 0,
                "%s", err);
  /* The job's other ps shares the directory (and its key and run id)... */
  ck_assert_msg(psd_ckptdir_open(&c, d, &ha1, 0, moved, sizeof moved, err, sizeof err) == 0,
                "%s", err);
  ck_assert_str_eq(a.run_hex, c.run_hex);
  ck_assert(memcmp(a.key, c.key, sizeof a.key) == 0);
  /* ...another job does not. */
  ck_assert_int_eq(psd_ckptdir_open(&b, d, &hb, 0, moved, sizeof moved, err, sizeof err), -1);
  char pid[32];
  snprintf(pid, sizeof pid, "pid %ld", (long)getpid());
  ck_assert_msg(strstr(err, d) && strstr(err, "job 41, ps 0 of 2") && strstr(err, pid), "%s",
                err);
  psd_ckptdir_close(&a);
  ck_assert_msg(psd_ckptdir_open(&b, d, &hb, 0, moved, sizeof moved, err, sizeof err) == 0,
                "%s", err);
  psd_ckptdir_close(&b);
  psd_ckptdir_close(&c);
}
END_TEST

START_TEST(foreign_or_old_run_files_are_refused) {
  /* attack 6: a file with a valid CRC but another directory's key, and a
   * file of this directory's earlier run, are both refused. */
  const char *d = fresh_dir("mac"), *o = fresh_dir("other");
  write_one(o, 0, 1, 9, 1);
  char from[1200], to[1200], err[1600];
  path_of(from, sizeof from, o, 9, 0, 1);
  path_of(to, sizeof to, d, 9, 0, 1);
  char sd[1200];
  snprintf(sd, sizeof sd, "%s/step-000000000009", d);
  ck_assert_int_eq(mkdir(sd, 0700), 0);
  ck_assert_int_eq(rename(from, to), 0);
  psd_ckpt_image img;
  ck_assert_int_eq(psd_ckpt_find(D(d), 0, 1, 0, MAXB, &img, err, sizeof err), -1);
  ck_assert_msg(strstr(err, to) && strstr(err, "MAC mismatch"), "%s", err);
  ck_assert_int_eq(unlink(to), 0);
  /* This directory's own file, but from an earlier run (after
   * --restore=none moved it aside) and then put back. */
  write_one(d, 0, 1, 9, 1);
  char old_run[40];
  snprintf(old_run, sizeof old_run, "%s", D(d)->run_hex);
  psd_ckptdir_close(D(d));
  psd_ckptdir n;
  psd_ckptdir_holder h = {1, 0, 1};
  char moved[1400];
  ck_assert_msg(psd_ckptdir_open(&n, d, &h, 1, moved, sizeof moved, err, sizeof err) == 0,
                "%s", err);
  ck_assert_msg(strstr(moved, "previous-") && strstr(moved, old_run), "%s", moved);
  ck_assert_str_ne(n.run_hex, old_run);
  char aside[1400];
  snprintf(aside, sizeof aside, "%s/previous-%s/step-000000000009", d, old_run);
  ck_assert_int_eq(psd_ckpt_find(&n, 0, 1, 0, MAXB, &img, err, sizeof err), 0);
  ck_assert_int_eq(rename(aside, sd), 0);
  ck_assert_int_eq(psd_ckpt_find(&n, 0, 1, 0, MAXB, &img, err, sizeof err), -1);
  ck_assert_msg(strstr(err, to) && strstr(err, "belongs to run") && strstr(err, old_run), "%s",
                err);
  psd_ckptdir_close(&n);
}
END_TEST

START_TEST(restore_none_moves_aside_and_keeps_the_run) {
  const char *d = fresh_dir("none");
  write_one(d, 0, 1, 30, 1);
  char run[40];
  snprintf(run, sizeof run, "%s", D(d)->run_hex);
  psd_ckptdir_close(D(d));
  psd_ckptdir n, m;
  psd_ckptdir_holder h = {1, 0, 1};
  char moved[1400], err[1600];
  ck_assert_msg(psd_ckptdir_open(&n, d, &h, 1, moved, sizeof moved, err, sizeof err) == 0,
                "%s", err);
  char kept[1400];
  snprintf(kept, sizeof kept, "%s/previous-%s/step-000000000030/ps-0-of-1.ckpt", d, run);
  ck_assert_msg(access(kept, F_OK) == 0, "%s is not kept (%s)", kept, moved);
  /* A second fresh start of the same (new, still empty) run keeps its id:
   * how the other ps of one job, starting together, agree on it. */
  psd_ckptdir_holder h1 = {1, 1, 2};
  ck_assert_msg(psd_ckptdir_open(&m, d, &h1, 1, moved, sizeof moved, err, sizeof err) == 0,
                "%s", err);
  ck_assert_str_eq(moved, "");
  ck_assert_str_eq(m.run_hex, n.run_hex);
  psd_ckptdir_close(&m);
  psd_ckptdir_close(&n);
}
END_TEST

START_TEST(restore_none_ps_starting_together_agree) {
  /* The ps of one job start at once with --restore none: one moves the old
   * run aside, every one ends on the same new run, none refuses. */
  for (int round = 0; round < 10; round++) {
    const char *d = fresh_dir("together");
    write_one(d, 0, 2, 5, 1);
    write_one(d, 1, 2, 5, 1);
    char old[40];
    snprintf(old, sizeof old, "%s", D(d)->run_hex);
    psd_ckptdir_close(D(d));
    int fds[2][2];
    for (int ps = 0; ps < 2; ps++) {
      ck_assert_int_eq(pipe(fds[ps]), 0);
      if (fork() == 0) {
        psd_ckptdir x;
        psd_ckptdir_holder h = {9, ps, 2};
        char moved[1400], err[1600], out[1700];
        int rc = psd_ckptdir_open(&x, d, &h, 1, moved, sizeof moved, err, sizeof err);
        snprintf(out, sizeof out, "%s", rc == 0 ? x.run_hex : err);
        ssize_t w = write(fds[ps][1], out, strlen(out) + 1);
        _exit(w > 0 && rc == 0 ? 0 : 1);
      }
      close(fds[ps][1]);
    }
    char got[2][1700];
    for (int ps = 0; ps < 2; ps++) {
      ssize_t n = read(fds[ps][0], got[ps], sizeof got[ps] - 1);
      got[ps][n > 0 ? n : 0] = '\0';
      close(fds[ps][0]);
      int st;
      ck_assert_int_gt(wait(&st), 0);
    }
    ck_assert_msg(strlen(got[0]) == 32 && strcmp(got[0], got[1]) == 0 && strcmp(got[0], old),
                  "ps 0: %s; ps 1: %s (old run %s)", got[0], got[1], old);
  }
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
  tcase_add_test(tc, planted_symlink_is_never_followed);
  tcase_add_test(tc, directory_rules);
  tcase_add_test(tc, lock_names_the_holder);
  tcase_add_test(tc, foreign_or_old_run_files_are_refused);
  tcase_add_test(tc, restore_none_moves_aside_and_keeps_the_run);
  tcase_add_test(tc, restore_none_ps_starting_together_agree);
  suite_add_tcase(s, tc);
  return s;
}

/* Files and directories another user owns: needs root (chown). */
Suite *suite_checkpoint_users(void) {
  uid_t uid;
  gid_t gid;
  if (!nobody(&uid, &gid)) {
    printf("SKIP: checkpoint_users: giving files to another user needs root\n");
    return NULL;
  }
  Suite *s = suite_create("checkpoint_users");
  TCase *tc = tcase_create("others");
  tcase_add_test(tc, others_symlink_is_refused);
  tcase_add_test(tc, others_directories_are_refused);
  suite_add_tcase(s, tc);
  return s;
}
