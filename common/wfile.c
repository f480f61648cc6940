/* wfile.c - creating output files safely next to other users: planted
 * links and foreign files are refused, never written through (wfile.h). */
#define _GNU_SOURCE
#include "wfile.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

/* Links followed on the way to a directory: Linux's own limit. */
#define WFILE_MAX_LINKS 40
/* Names tried for a temporary before giving up (a clash of 64 random bits
 * means something is wrong, not bad luck). */
#define WFILE_TMP_TRIES 8

/* Only we and root may own what decides where our bytes go. */
static int trusted(uid_t uid) { return uid == geteuid() || uid == 0; }

static void make_label(char *out, size_t len, const char *what, const char *path) {
  snprintf(out, len, "%s%s%s", what && *what ? what : "", what && *what ? " " : "", path);
}

/* A link on the way may be followed only if nobody else can have put it
 * there: ours or root's, one name (not hard-linked in by someone), in a
 * directory of ours or root's. */
static int check_link(const struct stat *st, const struct stat *dir, const char *shown,
                      const char *label, char *err, size_t errlen) {
  if (!trusted(st->st_uid))
    snprintf(err, errlen, "%s: %s is a symbolic link owned by uid %u, not you; refusing to "
             "follow it", label, shown, (unsigned)st->st_uid);
  else if (st->st_nlink > 1)
    snprintf(err, errlen, "%s: %s is a symbolic link with %lu names (hard-linked there by "
             "someone?); refusing to follow it", label, shown, (unsigned long)st->st_nlink);
  else if (!trusted(dir->st_uid))
    snprintf(err, errlen, "%s: %s is a symbolic link in a directory owned by uid %u, not "
             "you; refusing to follow it", label, shown, (unsigned)dir->st_uid);
  else
    return 0;
  return -1;
}

/* The target's directory: its owner could swap our file for a link at
 * will, so ours or root's; writable by everyone only when sticky. */
static int check_dir(int dfd, const char *shown, const char *label, char *err, size_t errlen) {
  struct stat st;
  if (fstat(dfd, &st) != 0)
    snprintf(err, errlen, "%s: cannot stat directory %s: %s", label, shown, strerror(errno));
  else if (!S_ISDIR(st.st_mode))
    snprintf(err, errlen, "%s: %s is not a directory", label, shown);
  else if (!trusted(st.st_uid))
    snprintf(err, errlen, "%s: directory %s is owned by uid %u, not you; refusing (its owner "
             "could swap the file for a link)", label, shown, (unsigned)st.st_uid);
  else if ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX))
    snprintf(err, errlen, "%s: directory %s (mode %04o) is writable by everyone without the "
             "sticky bit; refusing (anyone could swap the file for a link)", label, shown,
             (unsigned)(st.st_mode & 07777));
  else
    return 0;
  return -1;
}

/* Opens directory `dir` (relative to start) as an O_PATH descriptor, one
 * component at a time, following only links check_link allows: the path
 * as the kernel would resolve it, minus the links other users planted.
 * fd, or -1 with err. */
static int walk(int start, const char *dir, int *links, const char *label, char *err,
                size_t errlen) {
  /* On the heap: up to WFILE_MAX_LINKS frames deep, on callers' threads. */
  char *buf = strdup(dir), *target = malloc(2 * PATH_MAX + 16), *save = NULL;
  char *what = target ? target + PATH_MAX : NULL; /* the link, for sentences */
  int cur = !buf || !target ? -1
            : openat(dir[0] == '/' ? AT_FDCWD : start, dir[0] == '/' ? "/" : ".",
                     O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (cur < 0) snprintf(err, errlen, "%s: cannot open %s: %s", label, dir, strerror(errno));
  for (char *c = cur >= 0 ? strtok_r(buf, "/", &save) : NULL; c && cur >= 0;
       c = strtok_r(NULL, "/", &save)) {
    int shown = (int)(c - buf + (ptrdiff_t)strlen(c)); /* dir up to this component */
    struct stat st, dst;
    int fd = openat(cur, c, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    ssize_t n = 0;
    if (fd < 0 || fstat(fd, &st) != 0) {
      snprintf(err, errlen, "%s: cannot open %.*s: %s", label, shown, dir, strerror(errno));
      if (fd >= 0) close(fd);
      fd = -1;
    } else if (S_ISLNK(st.st_mode)) {
      snprintf(what, PATH_MAX + 16, "%.*s", shown, dir);
      if (fstat(cur, &dst) == 0 && check_link(&st, &dst, what, label, err, errlen) == 0) {
        if (++*links > WFILE_MAX_LINKS)
          snprintf(err, errlen, "%s: too many symbolic links at %s", label, what);
        else if ((n = readlinkat(fd, "", target, PATH_MAX - 1)) <= 0)
          snprintf(err, errlen, "%s: cannot read link %s: %s", label, what, strerror(errno));
      }
      close(fd);
      fd = -1;
      if (n > 0) {
        target[n] = '\0';
        fd = walk(cur, target, links, label, err, errlen);
      }
    } else if (!S_ISDIR(st.st_mode)) {
      snprintf(err, errlen, "%s: %.*s is not a directory", label, shown, dir);
      close(fd);
      fd = -1;
    }
    close(cur);
    cur = fd;
  }
  free(buf);
  free(target);
  return cur;
}

/* The target's directory, checked (O_PATH), and its name into name. */
static int open_parent(const char *path, const char *label, char name[256], char *err,
                       size_t errlen) {
  const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
  if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0 || strlen(base) > 255) {
    snprintf(err, errlen, "%s: does not name a file", label);
    return -1;
  }
  snprintf(name, 256, "%s", base);
  char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
  int links = 0, dfd = -1;
  if (!dir) snprintf(err, errlen, "%s: out of memory", label);
  else if ((dfd = walk(AT_FDCWD, dir, &links, label, err, errlen)) >= 0 &&
           check_dir(dfd, dir, label, err, errlen) != 0) {
    close(dfd);
    dfd = -1;
  }
  free(dir);
  return dfd;
}

/* What may be written over: nothing yet, or a regular file of ours with
 * one name. st: lstat (link_text for a link) or fstat of what we opened. */
static int check_target(const struct stat *st, const char *link_text, const char *label,
                        char *err, size_t errlen) {
  if (S_ISLNK(st->st_mode))
    snprintf(err, errlen, "%s: is a symbolic link%s%s; refusing to write through it", label,
             link_text ? " to " : "", link_text ? link_text : "");
  else if (!S_ISREG(st->st_mode))
    snprintf(err, errlen, "%s: exists and is not a regular file; refusing to write to it",
             label);
  else if (st->st_uid != geteuid())
    snprintf(err, errlen, "%s: is owned by uid %u, not you; refusing to replace it", label,
             (unsigned)st->st_uid);
  else if (st->st_nlink > 1)
    snprintf(err, errlen, "%s: has %lu hard links (another name could be someone's file); "
             "refusing to write to it", label, (unsigned long)st->st_nlink);
  else
    return 0;
  return -1;
}

/* check_target on name in dfd as it is now (absent is fine). */
static int check_name(int dfd, const char *name, const char *label, char *err, size_t errlen) {
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return 0;
    snprintf(err, errlen, "%s: cannot stat: %s", label, strerror(errno));
    return -1;
  }
  char link[PATH_MAX] = "";
  ssize_t n = S_ISLNK(st.st_mode) ? readlinkat(dfd, name, link, sizeof link - 1) : -1;
  if (n >= 0) link[n] = '\0';
  return check_target(&st, n > 0 ? link : NULL, label, err, errlen);
}

int ps__wfile_check(const char *path, const char *what, char *err, size_t errlen) {
  char label[1100], name[256];
  make_label(label, sizeof label, what, path);
  int dfd = open_parent(path, label, name, err, errlen);
  if (dfd < 0) return -1;
  int rc = check_name(dfd, name, label, err, errlen);
  close(dfd);
  return rc;
}

int ps__wfile_begin_at(ps__wfile *w, int dfd, const char *name, mode_t mode, const char *label,
                       char *err, size_t errlen) {
  memset(w, 0, sizeof *w);
  w->dfd = -1;
  snprintf(w->label, sizeof w->label, "%s", label);
  snprintf(w->name, sizeof w->name, "%s", name);
  if (check_name(dfd, name, label, err, errlen) != 0) return -1;
  if ((w->dfd = fcntl(dfd, F_DUPFD_CLOEXEC, 0)) < 0) {
    snprintf(err, errlen, "%s: %s", label, strerror(errno));
    return -1;
  }
  /* A random name: another user cannot guess it to plant a link first,
   * and O_EXCL|O_NOFOLLOW refuses whatever is there anyway. */
  int fd = -1;
  for (int i = 0; i < WFILE_TMP_TRIES && fd < 0; i++) {
    unsigned char r[8];
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r) break;
    snprintf(w->tmp, sizeof w->tmp, ".%.200s.%02x%02x%02x%02x%02x%02x%02x%02x", name, r[0],
             r[1], r[2], r[3], r[4], r[5], r[6], r[7]);
    fd = openat(w->dfd, w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  /* fchmod: the mode asked for, not what the umask leaves of it. */
  if (fd < 0 || fchmod(fd, mode) != 0 || !(w->fp = fdopen(fd, "w"))) {
    snprintf(err, errlen, "%s: cannot create a temporary file next to it: %s", label,
             strerror(errno));
    if (fd >= 0) {
      close(fd);
      unlinkat(w->dfd, w->tmp, 0);
    }
    close(w->dfd);
    w->dfd = -1;
    return -1;
  }
  return 0;
}

int ps__wfile_begin(ps__wfile *w, const char *path, mode_t mode, const char *what, char *err,
                    size_t errlen) {
  char label[1100], name[256];
  make_label(label, sizeof label, what, path);
  memset(w, 0, sizeof *w);
  w->dfd = -1;
  int dfd = open_parent(path, label, name, err, errlen);
  if (dfd < 0) return -1;
  int rc = ps__wfile_begin_at(w, dfd, name, mode, label, err, errlen);
  close(dfd);
  return rc;
}

void ps__wfile_abort(ps__wfile *w) {
  if (w->fp) {
    fclose(w->fp);
    w->fp = NULL;
    unlinkat(w->dfd, w->tmp, 0);
  }
  if (w->dfd >= 0) close(w->dfd);
  w->dfd = -1;
}

int ps__wfile_commit(ps__wfile *w, int durable, char *err, size_t errlen) {
  int bad = fflush(w->fp) != 0 || ferror(w->fp) || (durable && fsync(fileno(w->fp)) != 0);
  int e = errno;
  if (fclose(w->fp) != 0 && !bad) {
    bad = 1;
    e = errno;
  }
  w->fp = NULL;
  /* rename replaces whatever is at the name now (a link planted since the
   * check included) instead of following it. */
  if (!bad && renameat(w->dfd, w->tmp, w->dfd, w->name) != 0) {
    bad = 1;
    e = errno;
  }
  if (bad) {
    snprintf(err, errlen, "%s: cannot write: %s", w->label, strerror(e));
    unlinkat(w->dfd, w->tmp, 0);
  } else if (durable) { /* the rename itself survives a crash */
    int d = openat(w->dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d >= 0) {
      fsync(d);
      close(d);
    }
  }
  close(w->dfd);
  w->dfd = -1;
  return bad ? -1 : 0;
}

/* One write of len bytes into a begun file, then commit (durable). */
static int fill(ps__wfile *w, const void *buf, size_t len, char *err, size_t errlen) {
  if (len && fwrite(buf, 1, len, w->fp) != len) {
    snprintf(err, errlen, "%s: cannot write: %s", w->label, strerror(errno));
    ps__wfile_abort(w);
    return -1;
  }
  return ps__wfile_commit(w, 1, err, errlen);
}

int ps__wfile_write(const char *path, const void *buf, size_t len, mode_t mode,
                    const char *what, char *err, size_t errlen) {
  ps__wfile w;
  if (ps__wfile_begin(&w, path, mode, what, err, errlen) != 0) return -1;
  return fill(&w, buf, len, err, errlen);
}

int ps__wfile_write_at(int dfd, const char *name, const void *buf, size_t len, mode_t mode,
                       const char *label, char *err, size_t errlen) {
  ps__wfile w;
  if (ps__wfile_begin_at(&w, dfd, name, mode, label, err, errlen) != 0) return -1;
  return fill(&w, buf, len, err, errlen);
}

FILE *ps__wfile_stream(const char *path, mode_t mode, const char *what, char *err,
                       size_t errlen) {
  char label[1100], name[256];
  make_label(label, sizeof label, what, path);
  int dfd = open_parent(path, label, name, err, errlen);
  if (dfd < 0) return NULL;
  /* Checked by name first for the sentence (a link's target), then what
   * was opened, by fstat: a swap in between cannot slip through. O_NONBLOCK:
   * a planted FIFO must not hang us before fstat refuses it. */
  int fd = check_name(dfd, name, label, err, errlen) != 0 ? -2
           : openat(dfd, name, O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode);
  int e = errno;
  close(dfd);
  struct stat st;
  FILE *f = NULL;
  if (fd == -1)
    snprintf(err, errlen, "%s: cannot open: %s%s", label, strerror(e),
             e == ELOOP ? " (a symbolic link: refusing to write through it)" : "");
  else if (fd >= 0 && fstat(fd, &st) != 0)
    snprintf(err, errlen, "%s: cannot stat: %s", label, strerror(errno));
  else if (fd >= 0 && check_target(&st, NULL, label, err, errlen) == 0) {
    if (ftruncate(fd, 0) != 0 || fchmod(fd, mode) != 0 ||
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0 || !(f = fdopen(fd, "w")))
      snprintf(err, errlen, "%s: cannot write: %s", label, strerror(errno));
  }
  if (!f && fd >= 0) close(fd);
  return f;
}
