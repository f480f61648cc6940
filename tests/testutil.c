#define _GNU_SOURCE
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

const char *tu_tmpdir(void) {
  static char dir[256];
  if (!dir[0]) {
    const char *base = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/ps_tests.XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(dir)) {
      perror("mkdtemp");
      abort();
    }
  }
  return dir;
}

char *tu_read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 4096, len = 0;
  char *buf = malloc(cap);
  size_t n;
  while (buf && (n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
    len += n;
    if (cap - len < 2) {
      char *nb = realloc(buf, cap * 2);
      if (!nb) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = nb;
      cap *= 2;
    }
  }
  fclose(f);
  if (buf) buf[len] = '\0';
  return buf;
}

int tu_psd_start(tu_psd *p, const char *const *args) {
  static int seq;
  const char *bin = getenv("PSD_BIN");
  if (!bin) bin = "psd";
  memset(p, 0, sizeof *p);
  seq++;
  snprintf(p->log_path, sizeof p->log_path, "%s/psd.%d.%d.log", tu_tmpdir(),
           (int)getpid(), seq);
  snprintf(p->port_file, sizeof p->port_file, "%s/psd.%d.%d.port", tu_tmpdir(),
           (int)getpid(), seq);
  const char *argv[64];
  int n = 0;
  argv[n++] = bin;
  argv[n++] = "--host";
  argv[n++] = "127.0.0.1";
  argv[n++] = "--port";
  argv[n++] = "0";
  argv[n++] = "--port-file";
  argv[n++] = p->port_file;
  for (int i = 0; args && args[i] && n < 62; i++) argv[n++] = args[i];
  argv[n] = NULL;
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    int fd = open(p->log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execv(bin, (char *const *)argv);
    perror("execv psd");
    _exit(127);
  }
  p->pid = pid;
  for (int i = 0; i < 1000; i++) {
    char *s = tu_read_file(p->port_file);
    if (s && strchr(s, ':')) {
      s[strcspn(s, "\r\n")] = '\0';
      snprintf(p->addr, sizeof p->addr, "%s", s);
      free(s);
      return 0;
    }
    free(s);
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      p->pid = 0;
      p->status = st;
      return -1;
    }
    sleep_ms(10);
  }
  tu_psd_kill(p);
  return -1;
}

int tu_psd_wait(tu_psd *p, double timeout_s) {
  if (p->pid == 0) return 0;
  for (double t = 0; t < timeout_s; t += 0.01) {
    int st;
    pid_t r = waitpid(p->pid, &st, WNOHANG);
    if (r == p->pid) {
      p->status = st;
      p->pid = 0;
      return 0;
    }
    sleep_ms(10);
  }
  return -1;
}

void tu_psd_kill(tu_psd *p) {
  if (p->pid > 0) {
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &p->status, 0);
    p->pid = 0;
  }
}

int tu_log_contains(const tu_psd *p, const char *needle) {
  char *s = tu_read_file(p->log_path);
  int found = s && strstr(s, needle) != NULL;
  free(s);
  return found;
}

void tu_hosts(const tu_psd *ps, int n, char hosts[][64], const char **ptrs) {
  for (int i = 0; i < n; i++) {
    snprintf(hosts[i], 64, "%s", ps[i].addr);
    ptrs[i] = hosts[i];
  }
}
