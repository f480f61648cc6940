/* ckptdir.c - the checkpoint directory: ownership checks, the job's lock,
 * the MAC key, the run id and moving an earlier run aside. */
#define _GNU_SOURCE
#include "ckptdir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "mac.h"
#include "wfile.h"

/* Names inside the directory. Dot files so a listing shows the steps. */
static const char KEY_FILE[] = ".psd-key";
static const char RUN_FILE[] = "run-id";
/* Lock file content: one line naming the holder. */
#define HOLDER_MAX 200
/* The setup flock is held for milliseconds by each ps of a job: waiting
 * longer than this means something is wrong. */
#define DIR_LOCK_WAIT_S 10
/* previous-<run>-<k>: the most suffixes tried when one already exists. */
#define ASIDE_TRIES 100

static void owner_name(uid_t uid, char *out, size_t len) {
  struct passwd pw, *res = NULL;
  char buf[1024];
  if (getpwuid_r(uid, &pw, buf, sizeof buf, &res) == 0 && res)
    snprintf(out, len, "%s (uid %u)", res->pw_name, (unsigned)uid);
  else
    snprintf(out, len, "uid %u", (unsigned)uid);
}

/* The checks shared by directories and files: ours, nobody else writes. */
static int check_owned(const struct stat *st, const char *what, const char *path, char *err,
                       size_t errlen) {
  char who[300];
  owner_name(st->st_uid, who, sizeof who);
  if (st->st_uid != geteuid()) {
    snprintf(err, errlen, "%s %s is owned by %s with mode %04o, not by this user (uid %u): "
             "refusing it (another user could plant or replace checkpoints there)",
             what, path, who, (unsigned)(st->st_mode & 07777), (unsigned)geteuid());
    return -1;
  }
  if (st->st_mode & (S_IWGRP | S_IWOTH)) {
    snprintf(err, errlen, "%s %s (owner %s, mode %04o) is writable by its group or others: "
             "refusing it (chmod go-w it)",
             what, path, who, (unsigned)(st->st_mode & 07777));
    return -1;
  }
  return 0;
}

int psd_ckptdir_check(const struct stat *st, const char *what, const char *path, char *err,
                      size_t errlen) {
  if (!S_ISDIR(st->st_mode)) {
    snprintf(err, errlen, "%s %s is not a directory", what, path);
    return -1;
  }
  return check_owned(st, what, path, err, errlen);
}

int psd_ckptdir_unlink_own(int dfd, const char *name, const char *label, char *err,
                           size_t errlen) {
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return 0;
  if (S_ISDIR(st.st_mode) || st.st_uid != geteuid()) {
    char who[300];
    owner_name(st.st_uid, who, sizeof who);
    snprintf(err, errlen, "%s already exists and is %s owned by %s: refusing to use or "
             "remove it (planted by another user?)",
             label, S_ISDIR(st.st_mode) ? "a directory" : S_ISLNK(st.st_mode) ? "a symlink"
                                                                                : "a file",
             who);
    return -1;
  }
  /* Ours (a symlink included: unlinkat removes the link, not its target). */
  if (unlinkat(dfd, name, 0) != 0 && errno != ENOENT) {
    snprintf(err, errlen, "cannot remove the leftover %s: %s", label, strerror(errno));
    return -1;
  }
  return 0;
}

int psd_ckptdir_subdir(const psd_ckptdir *d, const char *name, int create, char *err,
                       size_t errlen) {
  char label[PSD_CKPT_PATH_MAX + 64];
  snprintf(label, sizeof label, "%s/%s", d->path, name);
  if (create && mkdirat(d->fd, name, 0700) != 0 && errno != EEXIST) {
    snprintf(err, errlen, "cannot create checkpoint directory %s: %s", label, strerror(errno));
    return -1;
  }
  int fd = openat(d->fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT && !create) return -2;
    snprintf(err, errlen, "cannot open checkpoint directory %s: %s%s", label, strerror(errno),
             errno == ELOOP || errno == ENOTDIR ? " (a symlink or a file: refusing it)" : "");
    return -1;
  }
  struct stat st;
  err[0] = '\0';
  if (fstat(fd, &st) != 0 || psd_ckptdir_check(&st, "checkpoint directory", label, err,
                                               errlen) != 0) {
    if (!err[0]) snprintf(err, errlen, "cannot stat %s: %s", label, strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

/* Opens the top directory, creating it 0700 when missing. fd or -1. */
static int open_top(const char *path, char *err, size_t errlen) {
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) {
    if (mkdir(path, 0700) != 0 && errno != EEXIST) {
      snprintf(err, errlen, "--checkpoint-dir %s cannot be created: %s", path, strerror(errno));
      return -1;
    }
    fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  }
  if (fd < 0) {
    snprintf(err, errlen, "cannot open --checkpoint-dir %s: %s%s", path, strerror(errno),
             errno == ELOOP || errno == ENOTDIR ? " (a symlink or a file: refusing it)" : "");
    return -1;
  }
  struct stat st;
  err[0] = '\0';
  if (fstat(fd, &st) != 0 || psd_ckptdir_check(&st, "--checkpoint-dir", path, err, errlen)) {
    if (!err[0]) snprintf(err, errlen, "cannot stat %s: %s", path, strerror(errno));
    close(fd);
    return -1;
  }
  if (faccessat(fd, ".", W_OK | X_OK, AT_EACCESS) != 0) {
    snprintf(err, errlen, "--checkpoint-dir %s is not a directory this user can write", path);
    close(fd);
    return -1;
  }
  return fd;
}

/* Takes .lock-ps-<i> (flock, held while the fd is open) and writes the
 * holder into it. 0, or -1 with err naming the current holder. */
static int take_lock(psd_ckptdir *d, const psd_ckptdir_holder *h, char *err, size_t errlen) {
  char name[64], label[PSD_CKPT_PATH_MAX + 80];
  snprintf(name, sizeof name, ".lock-ps-%d", h->ps_index);
  snprintf(label, sizeof label, "%s/%s", d->path, name);
  int fd = openat(d->fd, name, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  struct stat st;
  err[0] = '\0';
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      check_owned(&st, "lock file", label, err, errlen) != 0) {
    if (!err[0]) snprintf(err, errlen, "cannot open lock file %s: %s", label, strerror(errno));
    if (fd >= 0) close(fd);
    return -1;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char holder[HOLDER_MAX + 1] = "";
    ssize_t n = pread(fd, holder, HOLDER_MAX, 0);
    holder[n > 0 ? n : 0] = '\0';
    holder[strcspn(holder, "\n")] = '\0';
    snprintf(err, errlen, "--checkpoint-dir %s is in use by another psd (%s): two jobs must "
             "not share a checkpoint directory", d->path, holder[0] ? holder : "holder unknown");
    close(fd);
    return -1;
  }
  char host[256] = "?", line[HOLDER_MAX + 64];
  gethostname(host, sizeof host - 1);
  int len = snprintf(line, sizeof line, "job %lld, ps %d of %d, host %s, pid %ld\n", h->job_id,
                     h->ps_index, h->num_ps, host, (long)getpid());
  if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)len, 0) != len) {
    snprintf(err, errlen, "cannot write lock file %s: %s", label, strerror(errno));
    close(fd);
    return -1;
  }
  d->lock_fd = fd;
  return 0;
}

/* Reads a small file of ours (mode 0600) into buf. 1, 0 when missing, -1
 * with err (a symlink, another owner, a loose mode, the wrong size). */
static int read_small(const psd_ckptdir *d, const char *name, void *buf, size_t want,
                      char *err, size_t errlen) {
  char label[PSD_CKPT_PATH_MAX + 64];
  snprintf(label, sizeof label, "%s/%s", d->path, name);
  int fd = openat(d->fd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) return 0;
  struct stat st;
  err[0] = '\0';
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      check_owned(&st, "file", label, err, errlen) != 0 || (st.st_mode & 077) ||
      (size_t)st.st_size != want || pread(fd, buf, want, 0) != (ssize_t)want) {
    if (!err[0])
      snprintf(err, errlen, "%s is not a %zu-byte file of mode 0600 (%s): move it away",
               label, want, fd < 0 ? strerror(errno) : "wrong size, type or mode");
    if (fd >= 0) close(fd);
    return -1;
  }
  close(fd);
  return 1;
}

/* Writes buf as DIR/name (mode 0600) atomically, through the one safe
 * writer (common/wfile.h): a random O_EXCL|O_NOFOLLOW temporary, fsync,
 * renameat. 0 or -1 with err. */
static int write_small(const psd_ckptdir *d, const char *name, const void *buf, size_t len,
                       char *err, size_t errlen) {
  char label[PSD_CKPT_PATH_MAX + 64];
  snprintf(label, sizeof label, "%s/%s", d->path, name);
  return ps__wfile_write_at(d->fd, name, buf, len, 0600, label, err, errlen);
}

static void to_hex(const uint8_t *b, size_t n, char *out) {
  static const char digits[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = digits[b[i] >> 4];
    out[2 * i + 1] = digits[b[i] & 15];
  }
  out[2 * n] = '\0';
}

/* Loads DIR/.psd-key, or creates it with fresh random bytes. */
static int load_key(psd_ckptdir *d, char *err, size_t errlen) {
  int rc = read_small(d, KEY_FILE, d->key, sizeof d->key, err, errlen);
  if (rc != 0) return rc > 0 ? 0 : -1;
  if (ps__random(d->key, sizeof d->key) != 0) {
    snprintf(err, errlen, "cannot draw a random checkpoint key");
    return -1;
  }
  return write_small(d, KEY_FILE, d->key, sizeof d->key, err, errlen);
}

/* Draws a new run id and records it in DIR/run-id. */
static int new_run(psd_ckptdir *d, char *err, size_t errlen) {
  if (ps__random(d->run_id, sizeof d->run_id) != 0) {
    snprintf(err, errlen, "cannot draw a random run id");
    return -1;
  }
  to_hex(d->run_id, sizeof d->run_id, d->run_hex);
  return write_small(d, RUN_FILE, d->run_id, sizeof d->run_id, err, errlen);
}

/* 1 if the directory holds step-* entries (checkpoints of the current run). */
static int has_steps(const psd_ckptdir *d) {
  int fd = openat(d->fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
  if (!dir) {
    if (fd >= 0) close(fd);
    return 0;
  }
  struct dirent *e;
  int found = 0;
  while (!found && (e = readdir(dir)) != NULL) found = strncmp(e->d_name, "step-", 5) == 0;
  closedir(dir);
  return found;
}

/* --restore=none on a directory with checkpoints: no other live psd may be
 * using them (our own job's other ps cannot have written any yet: training
 * needs every ps up). 0, or -1 naming the holder. */
static int others_idle(const psd_ckptdir *d, int self, char *err, size_t errlen) {
  int fd = openat(d->fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
  if (!dir) {
    if (fd >= 0) close(fd);
    return 0;
  }
  struct dirent *e;
  int rc = 0;
  while (rc == 0 && (e = readdir(dir)) != NULL) {
    int i;
    if (sscanf(e->d_name, ".lock-ps-%d", &i) != 1 || i == self) continue;
    int lf = openat(d->fd, e->d_name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (lf < 0) continue;
    if (flock(lf, LOCK_SH | LOCK_NB) != 0) {
      char holder[HOLDER_MAX + 1] = "";
      ssize_t n = pread(lf, holder, HOLDER_MAX, 0);
      holder[n > 0 ? n : 0] = '\0';
      holder[strcspn(holder, "\n")] = '\0';
      snprintf(err, errlen, "--checkpoint-dir %s holds checkpoints of a psd that is still "
               "running (%s): --restore=none will not move them aside under it", d->path,
               holder);
      rc = -1;
    }
    close(lf);
  }
  closedir(dir);
  return rc;
}

/* Moves every step-* entry and run-id into a new previous-<run>/ (0700),
 * describing it in `moved`. 0 or -1 with err. */
static int move_aside(psd_ckptdir *d, int have_run, char *moved, size_t movedlen, char *err,
                      size_t errlen) {
  char aside[96] = "";
  for (int k = 0; k < ASIDE_TRIES; k++) {
    snprintf(aside, sizeof aside, "previous-%s%s%.0d", have_run ? d->run_hex : "unknown-run",
             k ? "-" : "", k);
    if (mkdirat(d->fd, aside, 0700) == 0) break;
    if (errno != EEXIST || k == ASIDE_TRIES - 1) {
      snprintf(err, errlen, "cannot create %s/%s: %s", d->path, aside, strerror(errno));
      return -1;
    }
  }
  int fd = openat(d->fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
  int afd = openat(d->fd, aside, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (!dir || afd < 0) {
    snprintf(err, errlen, "cannot open %s/%s: %s", d->path, aside, strerror(errno));
    if (dir) closedir(dir);
    else if (fd >= 0) close(fd);
    if (afd >= 0) close(afd);
    return -1;
  }
  int n = 0, rc = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(dir)) != NULL) {
    if (strncmp(e->d_name, "step-", 5) != 0 && strcmp(e->d_name, RUN_FILE) != 0) continue;
    if (renameat(d->fd, e->d_name, afd, e->d_name) != 0) {
      snprintf(err, errlen, "cannot move %s/%s into %s: %s", d->path, e->d_name, aside,
               strerror(errno));
      rc = -1;
    }
    n += e->d_name[0] == 's';
  }
  closedir(dir);
  fsync(afd);
  close(afd);
  fsync(d->fd);
  if (rc == 0)
    snprintf(moved, movedlen, "--restore=none: moved %d checkpoint step(s) of the previous run "
             "aside to %s/%s (nothing was deleted; remove it when no longer needed)",
             n, d->path, aside);
  return rc;
}

/* The run id: kept, or (fresh, with checkpoints present) a new one after
 * moving the earlier run aside. Called with the directory flock held. */
static int settle_run(psd_ckptdir *d, int self, int fresh, char *moved, size_t movedlen,
                      char *err, size_t errlen) {
  int have = read_small(d, RUN_FILE, d->run_id, sizeof d->run_id, err, errlen);
  if (have < 0) return -1;
  if (have) to_hex(d->run_id, sizeof d->run_id, d->run_hex);
  if (fresh && has_steps(d)) {
    if (others_idle(d, self, err, errlen) != 0 ||
        move_aside(d, have, moved, movedlen, err, errlen) != 0)
      return -1;
    have = 0;
  }
  return have ? 0 : new_run(d, err, errlen);
}

/* Takes the directory's short setup flock, waiting at most
 * DIR_LOCK_WAIT_S (a process that holds it longer is stuck or hostile:
 * better an error than a psd that never starts). 0 or -1 with err. */
static int lock_dir(psd_ckptdir *d, char *err, size_t errlen) {
  for (int waited_ms = 0;; waited_ms += 10) {
    if (flock(d->fd, LOCK_EX | LOCK_NB) == 0) return 0;
    if (errno != EWOULDBLOCK || waited_ms >= DIR_LOCK_WAIT_S * 1000) break;
    struct timespec ts = {0, 10 * 1000000};
    nanosleep(&ts, NULL);
  }
  snprintf(err, errlen, "cannot lock --checkpoint-dir %s for setup: %s", d->path,
           errno == EWOULDBLOCK ? "another process held it for too long" : strerror(errno));
  return -1;
}

void psd_ckptdir_init(psd_ckptdir *d) {
  memset(d, 0, sizeof *d);
  d->fd = -1;
  d->lock_fd = -1;
}

void psd_ckptdir_close(psd_ckptdir *d) {
  if (d->lock_fd >= 0) close(d->lock_fd); /* releases the flock */
  if (d->fd >= 0) close(d->fd);
  d->lock_fd = -1;
  d->fd = -1;
}

int psd_ckptdir_open(psd_ckptdir *d, const char *path, const psd_ckptdir_holder *h, int fresh,
                     char *moved, size_t movedlen, char *err, size_t errlen) {
  psd_ckptdir_init(d);
  if (movedlen) moved[0] = '\0';
  if (strlen(path) > PSD_CKPT_PATH_MAX) {
    snprintf(err, errlen, "--checkpoint-dir %.60s... is longer than %d bytes", path,
             PSD_CKPT_PATH_MAX);
    return -1;
  }
  snprintf(d->path, sizeof d->path, "%s", path);
  d->fd = open_top(path, err, errlen);
  if (d->fd < 0) return -1;
  /* The ps of one job start together: the lock, key and run id are
   * settled by one at a time (a short flock on the directory itself).
   * Taking this ps's lock inside it means a lock seen held by
   * others_idle belongs to a psd that finished starting, never to one of
   * our own job still on its way. */
  int rc = lock_dir(d, err, errlen);
  if (rc == 0) {
    rc = take_lock(d, h, err, errlen);
    if (rc == 0) rc = load_key(d, err, errlen);
    if (rc == 0) rc = settle_run(d, h->ps_index, fresh, moved, movedlen, err, errlen);
    flock(d->fd, LOCK_UN);
  }
  if (rc != 0) psd_ckptdir_close(d);
  return rc;
}
