/* Output files (common/wfile.c and every program that writes through it):
 * a symbolic link planted where psd, psrun's tasks, the library or psctl
 * write is refused with a sentence naming the path, and the file it points
 * to is untouched; another user's directory, link or file is refused;
 * what is written is mode 0600 and replaces the old file whole. The
 * helper is tested directly, then each output option end to end with real
 * processes: psd --summary, --port-file, --telemetry; a worker's telemetry
 * file (PS_TELEMETRY, as psrun --telemetry sets it); psrun --local
 * --telemetry; psctl save (psplot's pictures: tests/plot_test.sh). The
 * cases with another user's files need root (chown to nobody). */
#define _GNU_SOURCE
#include <check.h>
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "wfile.h"

#define VICTIM_TEXT "victim: must stay as it is\n"

/* A fresh directory of ours for one test (mode 0700). */
static const char *fresh_dir(char *buf, size_t len) {
  static int seq;
  snprintf(buf, len, "%s/wfile.%d.%d", tu_tmpdir(), (int)getpid(), ++seq);
  ck_assert_msg(mkdir(buf, 0700) == 0, "mkdir %s", buf);
  return buf;
}

static void put(const char *path, const char *text, mode_t mode) {
  FILE *f = fopen(path, "w");
  ck_assert_msg(f != NULL, "cannot create %s", path);
  fputs(text, f);
  fclose(f);
  ck_assert_int_eq(chmod(path, mode), 0);
}

/* DIR/victim with VICTIM_TEXT and DIR/NAME -> it; the victim's path to
 * victim, the link's to link. */
static void plant(const char *dir, const char *name, char *victim, char *link, size_t len) {
  snprintf(victim, len, "%s/victim", dir);
  snprintf(link, len, "%s/%s", dir, name);
  put(victim, VICTIM_TEXT, 0600);
  ck_assert_int_eq(symlink(victim, link), 0);
}

static void assert_text(const char *path, const char *text) {
  char *t = tu_read_file(path);
  ck_assert_msg(t && strcmp(t, text) == 0, "%s holds '%s', expected '%s'", path, t ? t : "(gone)",
                text);
  free(t);
}

/* The victim holds what it did and the link is still there. */
static void assert_untouched(const char *victim, const char *link) {
  assert_text(victim, VICTIM_TEXT);
  struct stat st;
  ck_assert_msg(lstat(link, &st) == 0 && S_ISLNK(st.st_mode), "the link %s was removed", link);
}

static mode_t mode_of(const char *path) {
  struct stat st;
  ck_assert_msg(lstat(path, &st) == 0, "%s is missing", path);
  ck_assert_msg(S_ISREG(st.st_mode), "%s is not a regular file", path);
  return st.st_mode & 07777;
}

/* Entries of dir, less . and .. (leftover temporaries show up here). */
static int entries(const char *dir) {
  DIR *d = opendir(dir);
  ck_assert_ptr_nonnull(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d));) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
  closedir(d);
  return n;
}

#define ASSERT_SAID(err, needle) \
  ck_assert_msg(strstr((err), (needle)) != NULL, "expected '%s' in: %s", (needle), (err))

/* ---- the helper ---------------------------------------------------------- */

/* An existing file of ours is replaced whole by a 0600 one, whatever the
 * umask; no temporary is left; a stream truncates and tightens the mode. */
START_TEST(test_replaces_whole_and_0600) {
  char dir[512], path[600], err[1200];
  fresh_dir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/out", dir);
  put(path, "old contents, longer than the new\n", 0644);
  mode_t old = umask(0);
  ck_assert_msg(ps__wfile_write(path, "new\n", 4, 0600, "--x", err, sizeof err) == 0, "%s", err);
  umask(old);
  assert_text(path, "new\n");
  ck_assert_uint_eq(mode_of(path), 0600);
  ck_assert_int_eq(entries(dir), 1);
  ck_assert_int_eq(chmod(path, 0644), 0);
  FILE *f = ps__wfile_stream(path, 0600, "--x", err, sizeof err);
  ck_assert_msg(f != NULL, "%s", err);
  fputs("s\n", f);
  fclose(f);
  assert_text(path, "s\n");
  ck_assert_uint_eq(mode_of(path), 0600);
  /* A relative path works from the current directory. */
  char cwd[1024];
  ck_assert_ptr_nonnull(getcwd(cwd, sizeof cwd));
  ck_assert_int_eq(chdir(dir), 0);
  ck_assert_msg(ps__wfile_write("rel", "r\n", 2, 0600, "", err, sizeof err) == 0, "%s", err);
  ck_assert_int_eq(chdir(cwd), 0);
  ck_assert_uint_eq(mode_of(path), 0600);
}
END_TEST

/* A link at the target, dangling or not, is refused by every way of
 * writing, with the path and the link's target in the sentence. */
START_TEST(test_planted_link_refused) {
  char dir[512], victim[600], link[600], err[1200], want[4096];
  fresh_dir(dir, sizeof dir);
  plant(dir, "out", victim, link, sizeof victim);
  snprintf(want, sizeof want, "--x %s: is a symbolic link to %s; refusing to write through it",
           link, victim);
  ck_assert_int_eq(ps__wfile_write(link, "x\n", 2, 0600, "--x", err, sizeof err), -1);
  ASSERT_SAID(err, want);
  err[0] = '\0';
  ck_assert_ptr_null(ps__wfile_stream(link, 0600, "--x", err, sizeof err));
  ASSERT_SAID(err, want);
  err[0] = '\0';
  ck_assert_int_eq(ps__wfile_check(link, "--x", err, sizeof err), -1);
  ASSERT_SAID(err, want);
  assert_untouched(victim, link);
  ck_assert_int_eq(entries(dir), 2); /* no temporary left */
  /* Dangling: the file it names must not be created. */
  char ghost[600], dangling[600];
  snprintf(ghost, sizeof ghost, "%s/ghost", dir);
  snprintf(dangling, sizeof dangling, "%s/dangling", dir);
  ck_assert_int_eq(symlink(ghost, dangling), 0);
  ck_assert_ptr_null(ps__wfile_stream(dangling, 0600, "", err, sizeof err));
  ASSERT_SAID(err, "is a symbolic link");
  ck_assert_int_eq(ps__wfile_write(dangling, "x", 1, 0600, "", err, sizeof err), -1);
  ck_assert_int_eq(access(ghost, F_OK), -1);
}
END_TEST

/* A second name of a victim (a hard link) and a FIFO are refused, the
 * FIFO without hanging on it. */
START_TEST(test_hard_link_and_fifo_refused) {
  char dir[512], victim[600], path[600], err[1200];
  fresh_dir(dir, sizeof dir);
  snprintf(victim, sizeof victim, "%s/victim", dir);
  snprintf(path, sizeof path, "%s/out", dir);
  put(victim, VICTIM_TEXT, 0600);
  ck_assert_int_eq(link(victim, path), 0);
  ck_assert_ptr_null(ps__wfile_stream(path, 0600, "--x", err, sizeof err));
  ASSERT_SAID(err, path);
  ASSERT_SAID(err, "has 2 hard links");
  assert_text(victim, VICTIM_TEXT);
  snprintf(path, sizeof path, "%s/fifo", dir);
  ck_assert_int_eq(mkfifo(path, 0600), 0);
  ck_assert_ptr_null(ps__wfile_stream(path, 0600, "--x", err, sizeof err));
  ASSERT_SAID(err, "is not a regular file");
  ck_assert_int_eq(ps__wfile_write(path, "x", 1, 0600, "--x", err, sizeof err), -1);
  ASSERT_SAID(err, "is not a regular file");
}
END_TEST

/* Temporaries have unguessable names (no pid), differ each time, and go
 * when a write is abandoned. */
START_TEST(test_temporaries_random_and_removed) {
  char dir[512], path[600], err[1200], pid[32];
  fresh_dir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/out", dir);
  snprintf(pid, sizeof pid, "%d", (int)getpid());
  ps__wfile a, b;
  ck_assert_msg(ps__wfile_begin(&a, path, 0600, "", err, sizeof err) == 0, "%s", err);
  ck_assert_msg(ps__wfile_begin(&b, path, 0600, "", err, sizeof err) == 0, "%s", err);
  ck_assert_str_ne(a.tmp, b.tmp);
  ck_assert_ptr_null(strstr(a.tmp, pid));
  ck_assert_uint_ge(strlen(a.tmp), strlen(".out.") + 16);
  ck_assert_int_eq(entries(dir), 2);
  ps__wfile_abort(&a);
  ps__wfile_abort(&b);
  ck_assert_int_eq(entries(dir), 0);
}
END_TEST

/* ---- another user's directories, links and files (root) ------------------ */

/* A directory of another user is refused, naming it and its owner; a
 * world-writable one only with the sticky bit (like /tmp). */
START_TEST(test_foreign_directory_refused) {
  char dir[512], sub[600], path[700], err[1200], want[4096];
  fresh_dir(dir, sizeof dir);
  ck_assert_int_eq(chmod(dir, 0755), 0);
  snprintf(sub, sizeof sub, "%s/theirs", dir);
  ck_assert_int_eq(mkdir(sub, 0755), 0);
  ck_assert_int_eq(chown(sub, TU_NOBODY, TU_NOBODY), 0);
  snprintf(path, sizeof path, "%s/out", sub);
  ck_assert_int_eq(ps__wfile_write(path, "x", 1, 0600, "--x", err, sizeof err), -1);
  snprintf(want, sizeof want, "--x %s: directory %s is owned by uid %d, not you; refusing", path,
           sub, TU_NOBODY);
  ASSERT_SAID(err, want);
  ck_assert_ptr_null(ps__wfile_stream(path, 0600, "--x", err, sizeof err));
  ASSERT_SAID(err, want);
  ck_assert_int_eq(access(path, F_OK), -1);
  /* Ours but writable by everyone: only with the sticky bit. */
  ck_assert_int_eq(chown(sub, 0, 0), 0);
  ck_assert_int_eq(chmod(sub, 0777), 0);
  ck_assert_int_eq(ps__wfile_write(path, "x", 1, 0600, "--x", err, sizeof err), -1);
  ASSERT_SAID(err, "is writable by everyone without the sticky bit");
  ck_assert_int_eq(chmod(sub, 01777), 0);
  ck_assert_msg(ps__wfile_write(path, "x", 1, 0600, "--x", err, sizeof err) == 0, "%s", err);
}
END_TEST

/* On the way to the directory: another user's link is not followed, nor
 * a link of ours in another user's directory, nor a hard-linked one. */
START_TEST(test_foreign_link_on_the_way_refused) {
  char dir[512], real[600], ln[600], path[700], err[1200], want[4096];
  fresh_dir(dir, sizeof dir);
  ck_assert_int_eq(chmod(dir, 0755), 0);
  snprintf(real, sizeof real, "%s/real", dir);
  ck_assert_int_eq(mkdir(real, 0700), 0);
  snprintf(ln, sizeof ln, "%s/via", dir);
  ck_assert_int_eq(symlink(real, ln), 0);
  snprintf(path, sizeof path, "%s/out", ln);
  /* Ours: followed. */
  ck_assert_msg(ps__wfile_write(path, "x", 1, 0600, "--x", err, sizeof err) == 0, "%s", err);
  ck_assert_int_eq(unlink(path), 0);
  ck_assert_int_eq(lchown(ln, TU_NOBODY, TU_NOBODY), 0);
  ck_assert_int_eq(ps__wfile_write(path, "x", 1, 0600, "--x", err, sizeof err), -1);
  snprintf(want, sizeof want, "%s is a symbolic link owned by uid %d, not you; refusing to "
           "follow it", ln, TU_NOBODY);
  ASSERT_SAID(err, want);
  ck_assert_int_eq(lchown(ln, 0, 0), 0);
  /* A hard link of our link, made by someone (protected_hardlinks=0). */
  char ln2[600];
  snprintf(ln2, sizeof ln2, "%s/via2", dir);
  ck_assert_int_eq(link(ln, ln2), 0);
  snprintf(path, sizeof path, "%s/out", ln2);
  ck_assert_int_eq(ps__wfile_write(path, "x", 1, 0600, "--x", err, sizeof err), -1);
  ASSERT_SAID(err, "is a symbolic link with 2 names");
  ck_assert_int_eq(unlink(ln2), 0);
  /* Our link inside their directory. */
  ck_assert_int_eq(chown(dir, TU_NOBODY, TU_NOBODY), 0);
  snprintf(path, sizeof path, "%s/out", ln);
  ck_assert_int_eq(ps__wfile_write(path, "x", 1, 0600, "--x", err, sizeof err), -1);
  ASSERT_SAID(err, "is a symbolic link in a directory owned by uid 65534");
  ck_assert_int_eq(chown(dir, 0, 0), 0);
  ck_assert_int_eq(access(path, F_OK), -1);
}
END_TEST

/* Another user's file at the target is neither replaced nor truncated. */
START_TEST(test_foreign_file_refused) {
  char dir[512], path[600], err[1200], want[4096];
  fresh_dir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/out", dir);
  put(path, VICTIM_TEXT, 0644);
  ck_assert_int_eq(chown(path, TU_NOBODY, TU_NOBODY), 0);
  snprintf(want, sizeof want, "--x %s: is owned by uid %d, not you; refusing to replace it", path,
           TU_NOBODY);
  ck_assert_int_eq(ps__wfile_write(path, "x", 1, 0600, "--x", err, sizeof err), -1);
  ASSERT_SAID(err, want);
  ck_assert_ptr_null(ps__wfile_stream(path, 0600, "--x", err, sizeof err));
  ASSERT_SAID(err, want);
  assert_text(path, VICTIM_TEXT);
}
END_TEST

/* ---- the programs ---------------------------------------------------------- */

static const char *psd_bin(void) {
  const char *b = getenv("PSD_BIN");
  return b && *b ? b : tu_bin("psd");
}

/* psd --host 127.0.0.1 --port 0 OPT PATH, run to its exit: the exit
 * status (-1 when it did not exit within 10 s, or by a signal). */
static int run_psd(const char *opt, const char *path, char *out, size_t outlen) {
  char *argv[] = {(char *)psd_bin(), "--host", "127.0.0.1", "--port", "0", (char *)opt,
                  (char *)path, NULL};
  int st;
  pid_t pid = tu_spawn(argv, NULL, out, outlen);
  if (tu_wait_pid(pid, 10, &st) != 0 || !WIFEXITED(st)) return -1;
  return WEXITSTATUS(st);
}

/* Each of psd's output options with a planted link: psd stops at start-up
 * with status 65, its log names the option, the path and the link. */
START_TEST(test_psd_options_refuse_planted_links) {
  static const char *const opts[] = {"--summary", "--port-file", "--telemetry"};
  for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) {
    char dir[512], victim[600], link[600], out[600], want[4096];
    fresh_dir(dir, sizeof dir);
    plant(dir, "out", victim, link, sizeof victim);
    int rc = run_psd(opts[i], link, out, sizeof out);
    char *log = tu_read_file(out);
    snprintf(want, sizeof want, "%s %s: is a symbolic link to %s; refusing to write through it",
             opts[i], link, victim);
    ck_assert_msg(rc == 65, "psd %s on a link exited %d: %s", opts[i], rc, log ? log : "");
    ck_assert_msg(log && strstr(log, want), "psd %s: no '%s' in: %s", opts[i], want,
                  log ? log : "");
    free(log);
    assert_untouched(victim, link);
  }
}
END_TEST

/* A psd that started fine writes its port file and telemetry 0600; a link
 * planted at --summary while it ran is refused at exit, named in the log,
 * and the victim is untouched. */
START_TEST(test_psd_outputs_0600_and_late_link) {
  char dir[512], tel[600], sum[600], victim[600];
  fresh_dir(dir, sizeof dir);
  snprintf(tel, sizeof tel, "%s/tel.ps0", dir);
  snprintf(sum, sizeof sum, "%s/summary", dir);
  snprintf(victim, sizeof victim, "%s/victim", dir);
  put(victim, VICTIM_TEXT, 0600);
  const char *args[] = {"--telemetry", tel, "--summary", sum, NULL};
  tu_psd ps;
  mode_t old = umask(0);
  int rc = tu_psd_start(&ps, args);
  umask(old);
  ck_assert_msg(rc == 0, "psd did not start");
  ck_assert_uint_eq(mode_of(ps.port_file), 0600);
  ck_assert_uint_eq(mode_of(tel), 0600);
  ck_assert_int_eq(symlink(victim, sum), 0);
  kill(ps.pid, SIGTERM);
  ck_assert_int_eq(tu_psd_wait(&ps, 10), 0);
  char want[4096];
  snprintf(want, sizeof want, "--summary %s: is a symbolic link to %s", sum, victim);
  ck_assert_msg(tu_log_contains(&ps, want), "no '%s' in psd's log", want);
  assert_untouched(victim, sum);
}
END_TEST

/* The worker's telemetry file (ps_config.telemetry, PS_TELEMETRY under
 * psrun): a link is refused by ps_client_create naming it; a fresh file is
 * 0600 under umask 022 (it was 0644). */
START_TEST(test_worker_telemetry) {
  char dir[512], victim[600], link[600], fine[600];
  fresh_dir(dir, sizeof dir);
  plant(dir, "tel.w0", victim, link, sizeof victim);
  snprintf(fine, sizeof fine, "%s/tel.w1", dir);
  tu_psd ps;
  ck_assert_msg(tu_psd_start(&ps, NULL) == 0, "psd did not start");
  const char *hosts[] = {ps.addr};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hosts;
  cfg.num_ps = 1;
  cfg.num_workers = 2;
  cfg.telemetry = link;
  ps_client *c = NULL;
  char err[1500], want[4096];
  ck_assert_int_ne(ps_client_create(&cfg, &c, err, sizeof err), 0);
  snprintf(want, sizeof want, "telemetry file %s: is a symbolic link to %s; refusing to write "
           "through it", link, victim);
  ASSERT_SAID(err, want);
  assert_untouched(victim, link);
  cfg.telemetry = fine;
  cfg.worker_index = 1;
  mode_t old = umask(022);
  int rc = ps_client_create(&cfg, &c, err, sizeof err);
  umask(old);
  ck_assert_msg(rc == 0, "%s", err);
  ck_assert_uint_eq(mode_of(fine), 0600);
  ps_client_destroy(c);
  tu_psd_kill(&ps);
}
END_TEST

/* psrun --local --telemetry F: a link at F.ps0 stops psd (and psrun,
 * non-zero) naming it; a link at F.w0 stops worker 0 naming it. */
START_TEST(test_psrun_telemetry) {
  if (access(tu_bin("psrun"), X_OK) != 0 || access(tu_bin("tiny_worker"), X_OK) != 0) {
    printf("wfile: psrun or tiny_worker not built (PS_BUILD_PSRUN, PS_BUILD_EXAMPLES): "
           "test_psrun_telemetry checks nothing\n");
    return;
  }
  static const char *const names[] = {"tel.ps0", "tel.w0"};
  static const char *const whats[] = {"--telemetry", "telemetry file"};
  for (int i = 0; i < 2; i++) {
    char dir[512], victim[600], link[600], prefix[600], out[600], want[4096];
    fresh_dir(dir, sizeof dir);
    plant(dir, names[i], victim, link, sizeof victim);
    snprintf(prefix, sizeof prefix, "%s/tel", dir);
    char *argv[] = {(char *)tu_bin("psrun"), "--local", "-n", "2", "--ps", "1",
                    "--telemetry", prefix, "--", (char *)tu_bin("tiny_worker"), "--steps",
                    "3", NULL};
    int st;
    pid_t pid = tu_spawn(argv, NULL, out, sizeof out);
    ck_assert_int_eq(tu_wait_pid(pid, 60, &st), 0);
    char *log = tu_read_file(out);
    snprintf(want, sizeof want, "%s %s: is a symbolic link to %s; refusing to write through it",
             whats[i], link, victim);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "psrun with %s planted: status %d: %s",
                  names[i], st, log ? log : "");
    ck_assert_msg(log && strstr(log, want), "no '%s' in psrun's output: %s", want,
                  log ? log : "");
    free(log);
    assert_untouched(victim, link);
  }
}
END_TEST

/* psctl save FILE (psplot's writer): a link refused, exit 1, named; a
 * fresh file 0600 with stdin's bytes. */
START_TEST(test_psctl_save) {
  if (access(tu_bin("psctl"), X_OK) != 0) {
    printf("wfile: psctl not built (PS_BUILD_PSRUN): test_psctl_save checks nothing\n");
    return;
  }
  char dir[512], victim[600], link[600], fine[600], out[700], cmd[4000], want[4096];
  fresh_dir(dir, sizeof dir);
  plant(dir, "pic.png", victim, link, sizeof victim);
  snprintf(out, sizeof out, "%s/psctl.out", dir);
  snprintf(cmd, sizeof cmd, "echo picture | '%s' save '%s' >'%s' 2>&1", tu_bin("psctl"), link,
           out);
  int st = system(cmd);
  char *log = tu_read_file(out);
  snprintf(want, sizeof want, "psctl: %s: is a symbolic link to %s; refusing to write through "
           "it", link, victim);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "psctl save: status %d: %s", st,
                log ? log : "");
  ck_assert_msg(log && strstr(log, want), "no '%s' in: %s", want, log ? log : "");
  free(log);
  assert_untouched(victim, link);
  snprintf(fine, sizeof fine, "%s/fine.png", dir);
  snprintf(cmd, sizeof cmd, "echo picture | '%s' save '%s'", tu_bin("psctl"), fine);
  ck_assert_int_eq(system(cmd), 0);
  assert_text(fine, "picture\n");
  ck_assert_uint_eq(mode_of(fine), 0600);
}
END_TEST

Suite *suite_wfile(void) {
  Suite *s = suite_create("wfile");
  TCase *tc = tcase_create("helper");
  tcase_add_test(tc, test_replaces_whole_and_0600);
  tcase_add_test(tc, test_planted_link_refused);
  tcase_add_test(tc, test_hard_link_and_fifo_refused);
  tcase_add_test(tc, test_temporaries_random_and_removed);
  suite_add_tcase(s, tc);
  if (geteuid() == 0) {
    TCase *tu = tcase_create("users");
    tcase_add_test(tu, test_foreign_directory_refused);
    tcase_add_test(tu, test_foreign_link_on_the_way_refused);
    tcase_add_test(tu, test_foreign_file_refused);
    suite_add_tcase(s, tu);
  } else {
    tu_skip_tests("wfile", "the cases with another user's files", "they need root (chown to nobody)");
  }
  TCase *tp = tcase_create("programs");
  tcase_set_timeout(tp, 120);
  tcase_add_test(tp, test_psd_options_refuse_planted_links);
  tcase_add_test(tp, test_psd_outputs_0600_and_late_link);
  tcase_add_test(tp, test_worker_telemetry);
  tcase_add_test(tp, test_psrun_telemetry);
  tcase_add_test(tp, test_psctl_save);
  suite_add_tcase(s, tp);
  return s;
}
