/* slowdown.c - an LD_PRELOAD shim that makes what psd waits for slow:
 * - the checkpoint disk: every write() or fsync() of a checkpoint's
 *   temporary file (*.ckpt.tmp) or of a step directory first sleeps
 *   $PS_SLOW_DISK_MS milliseconds (default 100);
 * - munged: every munge_decode() first sleeps $PS_SLOW_MUNGE_MS (only
 *   when set).
 * The persist and auth suites preload it into psd to show that neither
 * stalls psd's event loop. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* 1 if fd is a checkpoint temporary file or a step directory. */
static int slow_fd(int fd) {
  char link[64], path[4096];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, path, sizeof path - 1);
  if (n <= 0) return 0;
  path[n] = '\0';
  return strstr(path, ".ckpt.tmp") != NULL || strstr(path, "/step-") != NULL;
}

static void nap_for(const char *var, long dflt) {
  const char *s = getenv(var);
  long ms = s ? strtol(s, NULL, 10) : dflt;
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

ssize_t write(int fd, const void *buf, size_t n) {
  static ssize_t (*real)(int, const void *, size_t);
  if (!real) real = (ssize_t(*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
  if (slow_fd(fd)) nap_for("PS_SLOW_DISK_MS", 100);
  return real(fd, buf, n);
}

int fsync(int fd) {
  static int (*real)(int);
  if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
  if (slow_fd(fd)) nap_for("PS_SLOW_DISK_MS", 100);
  return real(fd);
}

/* libmunge's munge_decode (munge.h), without including it: the shim must
 * not depend on libmunge, and psd resolves the symbol here first. */
int munge_decode(const char *cred, void *ctx, void **buf, int *len, unsigned *uid,
                 unsigned *gid);
int munge_decode(const char *cred, void *ctx, void **buf, int *len, unsigned *uid,
                 unsigned *gid) {
  static int (*real)(const char *, void *, void **, int *, unsigned *, unsigned *);
  if (!real)
    real = (int (*)(const char *, void *, void **, int *, unsigned *, unsigned *))dlsym(
        RTLD_NEXT, "munge_decode");
  if (getenv("PS_SLOW_MUNGE_MS")) nap_for("PS_SLOW_MUNGE_MS", 0);
  return real(cred, ctx, buf, len, uid, gid);
}
