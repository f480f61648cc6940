/* proc.c - child supervision for psrun. */
#define _GNU_SOURCE
#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

extern char **environ;

/* Output lines longer than this are printed in pieces. */
#define PSR_LINE_MAX 65536

static int g_sig_wfd = -1; /* write end of the self-pipe */

static void on_signal(int sig) {
  int e = errno;
  unsigned char b = (unsigned char)sig;
  ssize_t w = write(g_sig_wfd, &b, 1);
  (void)w;
  errno = e;
}

int psr_procs_init(psr_procs *p, int prefix) {
  memset(p, 0, sizeof *p);
  p->prefix = prefix;
  if (pipe2(p->sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return -1;
  g_sig_wfd = p->sig_pipe[1];
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  int sigs[] = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP, SIGCHLD};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) sigaction(sigs[i], &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  return 0;
}

int psr_spawn(psr_procs *p, const char *label, int is_ps, char *const *argv,
              char *const *extra_env, char *err, size_t errlen) {
  if (p->n >= PSR_MAX_CHILDREN) {
    snprintf(err, errlen, "too many tasks (at most %d)", PSR_MAX_CHILDREN);
    return -1;
  }
  int out[2] = {-1, -1}, errp[2] = {-1, -1}, note[2] = {-1, -1};
  if ((p->prefix && (pipe2(out, O_CLOEXEC) != 0 || pipe2(errp, O_CLOEXEC) != 0)) ||
      (!is_ps && pipe2(note, O_CLOEXEC | O_NONBLOCK) != 0)) {
    snprintf(err, errlen, "pipe: %s", strerror(errno));
    return -1;
  }
  /* A worker's library writes to it when the job stopped (PS_STOP_NOTE_FD,
   * libpsclient's trainstep.c): psrun then counts its exit as a stop. */
  char e_note[48];
  snprintf(e_note, sizeof e_note, "PS_STOP_NOTE_FD=%d", note[1]);
  /* Build the environment before forking (no allocation in the child). */
  size_t nenv = 0, nextra = 0;
  while (environ[nenv]) nenv++;
  while (extra_env && extra_env[nextra]) nextra++;
  char **env = calloc(nenv + nextra + 2, sizeof *env);
  if (!env) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  size_t k = 0;
  for (size_t i = 0; i < nenv; i++) {
    /* Entries overridden by extra_env are dropped. */
    int dup = 0;
    for (size_t j = 0; j < nextra && !dup; j++) {
      const char *eq = strchr(extra_env[j], '=');
      size_t nl = eq ? (size_t)(eq - extra_env[j]) : strlen(extra_env[j]);
      dup = strncmp(environ[i], extra_env[j], nl) == 0 && environ[i][nl] == '=';
    }
    if (!dup) env[k++] = environ[i];
  }
  for (size_t j = 0; j < nextra; j++) env[k++] = extra_env[j];
  if (note[1] >= 0) env[k++] = e_note;
  env[k] = NULL;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    free(env);
    snprintf(err, errlen, "fork: %s", strerror(errno));
    return -1;
  }
  if (pid == 0) {
    /* Die with psrun: no task outlives its launcher. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    int sigs[] = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP, SIGCHLD, SIGPIPE};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) signal(sigs[i], SIG_DFL);
    if (p->prefix) {
      dup2(out[1], 1);
      dup2(errp[1], 2);
    }
    if (note[1] >= 0) fcntl(note[1], F_SETFD, 0); /* the worker keeps it */
    execvpe(argv[0], argv, env);
    fprintf(stderr, "psrun: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  free(env);
  psr_child *c = &p->kids[p->n];
  memset(c, 0, sizeof *c);
  c->pid = pid;
  c->is_ps = is_ps;
  snprintf(c->label, sizeof c->label, "%s", label);
  c->out_fd = c->err_fd = -1;
  c->note_fd = note[0];
  if (note[1] >= 0) close(note[1]);
  if (p->prefix) {
    close(out[1]);
    close(errp[1]);
    c->out_fd = out[0];
    c->err_fd = errp[0];
  }
  return p->n++;
}

/* Prints complete lines of child c's stream s (0 out, 1 err), prefixed. */
static void emit(psr_child *c, int s, const char *data, size_t len, int final) {
  FILE *f = s == 0 ? stdout : stderr;
  size_t total = c->pend_len[s] + len;
  char *buf = realloc(c->pend[s], total + 1);
  if (!buf) return;
  memcpy(buf + c->pend_len[s], data, len);
  c->pend[s] = buf;
  size_t start = 0;
  for (size_t i = 0; i < total; i++) {
    if (buf[i] == '\n' || i - start >= PSR_LINE_MAX) {
      fprintf(f, "[%s] %.*s\n", c->label, (int)(i - start), buf + start);
      start = i + 1;
    }
  }
  if (final && start < total) {
    fprintf(f, "[%s] %.*s\n", c->label, (int)(total - start), buf + start);
    start = total;
  }
  memmove(buf, buf + start, total - start);
  c->pend_len[s] = total - start;
  fflush(f);
}

static void drain_fd(psr_child *c, int s) {
  int *fd = s == 0 ? &c->out_fd : &c->err_fd;
  char buf[16384];
  ssize_t n = read(*fd, buf, sizeof buf);
  if (n > 0) {
    emit(c, s, buf, (size_t)n, 0);
  } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
    emit(c, s, "", 0, 1);
    close(*fd);
    *fd = -1;
  }
}

static int reap(psr_procs *p, int *which) {
  for (;;) {
    int st;
    pid_t pid = waitpid(-1, &st, WNOHANG);
    if (pid <= 0) return 0;
    for (int i = 0; i < p->n; i++) {
      psr_child *c = &p->kids[i];
      if (c->pid != pid) continue;
      /* Print what it wrote before dying. */
      while (c->out_fd >= 0) drain_fd(c, 0);
      while (c->err_fd >= 0) drain_fd(c, 1);
      if (c->note_fd >= 0) {
        char note[64];
        ssize_t got = read(c->note_fd, note, sizeof note - 1);
        c->stopped = got > 0 && memmem(note, (size_t)got, "stopped", 7) != NULL;
        close(c->note_fd);
        c->note_fd = -1;
      }
      c->status = st;
      c->exited = 1;
      c->pid = 0;
      for (int k = 0; k < 2; k++) {
        free(c->pend[k]);
        c->pend[k] = NULL;
        c->pend_len[k] = 0;
      }
      *which = i;
      return 1;
    }
  }
}

psr_event psr_wait(psr_procs *p, int timeout_ms, int extra_fd, int *which) {
  double deadline = timeout_ms < 0 ? 0 : ps__now() + timeout_ms / 1000.0;
  for (;;) {
    if (reap(p, which)) return PSR_EV_EXIT;
    struct pollfd pfd[2 * PSR_MAX_CHILDREN + 2];
    int map[2 * PSR_MAX_CHILDREN + 2];
    int n = 0;
    pfd[n].fd = p->sig_pipe[0];
    pfd[n].events = POLLIN;
    map[n++] = -1;
    if (extra_fd >= 0) {
      pfd[n].fd = extra_fd;
      pfd[n].events = POLLIN;
      map[n++] = -2;
    }
    for (int i = 0; i < p->n; i++) {
      psr_child *c = &p->kids[i];
      if (c->out_fd >= 0) {
        pfd[n].fd = c->out_fd;
        pfd[n].events = POLLIN;
        map[n++] = 2 * i;
      }
      if (c->err_fd >= 0) {
        pfd[n].fd = c->err_fd;
        pfd[n].events = POLLIN;
        map[n++] = 2 * i + 1;
      }
    }
    int ms = -1;
    if (timeout_ms >= 0) {
      double left = deadline - ps__now();
      if (left <= 0) return PSR_EV_NONE;
      ms = (int)(left * 1000) + 1;
    }
    /* Wake at least every 200 ms: SIGCHLD may race with poll. */
    if (ms < 0 || ms > 200) ms = 200;
    int r = poll(pfd, (nfds_t)n, ms);
    if (r < 0 && errno != EINTR) return PSR_EV_NONE;
    for (int k = 0; r > 0 && k < n; k++) {
      if (!pfd[k].revents) continue;
      if (map[k] == -1) {
        unsigned char b;
        while (read(p->sig_pipe[0], &b, 1) == 1) {
          if (b == SIGCHLD) continue;
          psr_signal_all(p, b);
          *which = b;
          return PSR_EV_SIGNAL;
        }
      } else if (map[k] == -2) {
        return PSR_EV_FD;
      } else {
        drain_fd(&p->kids[map[k] / 2], map[k] % 2);
      }
    }
    if (timeout_ms < 0) continue;
  }
}

void psr_signal_all(psr_procs *p, int sig) {
  for (int i = 0; i < p->n; i++)
    if (p->kids[i].pid > 0) kill(p->kids[i].pid, sig);
}

int psr_alive(const psr_procs *p) {
  int n = 0;
  for (int i = 0; i < p->n; i++) n += p->kids[i].pid > 0;
  return n;
}

void psr_teardown(psr_procs *p, double grace_s) {
  psr_signal_all(p, SIGTERM);
  double deadline = ps__now() + grace_s;
  int killed = 0;
  while (psr_alive(p)) {
    int which;
    double left = deadline - ps__now();
    if (left <= 0 && !killed) {
      psr_signal_all(p, SIGKILL);
      killed = 1;
    }
    psr_wait(p, left > 0 ? (int)(left * 1000) + 1 : 200, -1, &which);
  }
}

int psr_exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void psr_describe(int status, char *buf, size_t len) {
  if (WIFEXITED(status)) snprintf(buf, len, "exited with status %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status))
    snprintf(buf, len, "was killed by SIG%s",
             sigabbrev_np(WTERMSIG(status)) ? sigabbrev_np(WTERMSIG(status)) : "?");
  else snprintf(buf, len, "ended (status 0x%x)", status);
}
