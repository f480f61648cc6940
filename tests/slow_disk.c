/* slow_disk.c - an LD_PRELOAD shim that makes psd's checkpoint disk slow:
 * every write() or fsync() of a checkpoint's temporary file (*.ckpt.tmp)
 * or of a step directory first sleeps $PS_SLOW_DISK_MS milliseconds. The
 * persist suite preloads it to show that checkpoint writes never stall
 * psd's event loop, and that slices updated while their record waits for
 * the disk are still written as they were at the checkpoint's step. */
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

static void nap(void) {
  const char *s = getenv("PS_SLOW_DISK_MS");
  long ms = s ? strtol(s, NULL, 10) : 100;
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

ssize_t write(int fd, const void *buf, size_t n) {
  static ssize_t (*real)(int, const void *, size_t);
  if (!real) real = (ssize_t(*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
  if (slow_fd(fd)) nap();
  return real(fd, buf, n);
}

int fsync(int fd) {
  static int (*real)(int);
  if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
  if (slow_fd(fd)) nap();
  return real(fd);
}
