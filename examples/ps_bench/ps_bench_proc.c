/* ps_bench_proc.c - the child processes of ps_bench: the registry that an
 * error path or a signal uses to kill them all, forking, CPU pinning,
 * reaping, starting psd and waiting for its port file, the log directory
 * and the tails of its logs; plus the clock and whole-buffer I/O. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ps_bench_internal.h"

#define MAX_CHILDREN (MAX_PS + MAX_WORKERS + 8)
static volatile pid_t g_children[MAX_CHILDREN];
volatile sig_atomic_t g_interrupted;
char g_tmpdir[1024];

/* ---------------------------------------------------------------------- */
/* Registry and signals */

static void child_add(pid_t pid) {
  for (int i = 0; i < MAX_CHILDREN; i++)
    if (g_children[i] == 0) {
      g_children[i] = pid;
      return;
    }
}

static void child_remove(pid_t pid) {
  for (int i = 0; i < MAX_CHILDREN; i++)
    if (g_children[i] == pid) g_children[i] = 0;
}

static void kill_all_children(void) {
  for (int i = 0; i < MAX_CHILDREN; i++) {
    pid_t p = g_children[i];
    if (p > 0) kill(p, SIGKILL);
  }
}

/* Kills and reaps every registered child. */
void reap_all_children(void) {
  kill_all_children();
  for (int i = 0; i < MAX_CHILDREN; i++) {
    pid_t p = g_children[i];
    if (p > 0) {
      while (waitpid(p, NULL, 0) < 0 && errno == EINTR) {
      }
      g_children[i] = 0;
    }
  }
}

static void on_signal(int sig) {
  (void)sig;
  g_interrupted = 1;
  kill_all_children();
}

void install_signals(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0; /* no SA_RESTART: waits return EINTR */
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
}

/* In a freshly forked child: default signals, and die with the parent. */
static void child_setup(pid_t parent) {
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGHUP, SIG_DFL);
  signal(SIGPIPE, SIG_DFL);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
}

pid_t fork_child(void) {
  fflush(stdout);
  fflush(stderr);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) {
    for (int i = 0; i < MAX_CHILDREN; i++) g_children[i] = 0;
    child_setup(parent);
  } else if (pid > 0) {
    child_add(pid);
  }
  return pid;
}

/* ---------------------------------------------------------------------- */
/* Clock, pinning, I/O */

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Pins the calling process to one CPU (index modulo the CPUs available),
 * so that latency baselines and the runs they are compared with place
 * client and server alike: on a 2-core machine a ping-pong between two
 * cores and one within a core differ several-fold. No-op with --no-pin. */
void pin_cpu(int index) {
  if (!opt.pin) return;
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  /* More processes than CPUs: any pinning pairs some of them on one CPU
   * for good, where the scheduler would move them (as mpirun, which binds
   * oversubscribed ranks to nothing). */
  if (n < 2 || g_run_procs > n) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET((int)(((index % n) + n) % n), &set);
  sched_setaffinity(0, sizeof set, &set);
}

/* Undoes pin_cpu for the parent after a measurement. */
void unpin_cpu(void) {
  cpu_set_t set;
  CPU_ZERO(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  for (long i = 0; i < n && i < CPU_SETSIZE; i++) CPU_SET((int)i, &set);
  sched_setaffinity(0, sizeof set, &set);
}

int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t n = write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

int read_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len) {
    ssize_t n = read(fd, p, len);
    if (n < 0) {
      if (errno == EINTR && !g_interrupted) continue;
      return -1;
    }
    if (n == 0) return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* ---------------------------------------------------------------------- */
/* One child */

int proc_reap(proc *p, int block) {
  if (p->reaped || p->pid <= 0) return 1;
  int st;
  pid_t r;
  do r = waitpid(p->pid, &st, block ? 0 : WNOHANG);
  while (r < 0 && errno == EINTR && block);
  if (r == p->pid) {
    p->status = st;
    p->reaped = 1;
    child_remove(p->pid);
    return 1;
  }
  return 0;
}

void proc_kill(proc *p) {
  if (p->pid > 0 && !p->reaped) {
    kill(p->pid, SIGKILL);
    proc_reap(p, 1);
  }
}

void describe_status(int st, char *buf, size_t len) {
  if (WIFEXITED(st)) snprintf(buf, len, "exit status %d", WEXITSTATUS(st));
  else if (WIFSIGNALED(st)) snprintf(buf, len, "killed by signal %d (%s)", WTERMSIG(st),
                                     strsignal(WTERMSIG(st)));
  else snprintf(buf, len, "status 0x%x", st);
}

static char *read_small_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *buf = calloc(1, 256);
  if (buf && fread(buf, 1, 255, f) == 0) buf[0] = '\0';
  fclose(f);
  return buf;
}

/* In the forked child: logs to `log`, stdin from /dev/null, exec psd. */
__attribute__((noreturn)) static void exec_psd(const proc *p, int index,
                                               const char *const *argv) {
  pin_cpu(-1 - index);
  int fd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
  }
  int nul = open("/dev/null", O_RDONLY);
  if (nul >= 0) {
    dup2(nul, 0);
    close(nul);
  }
  execv(opt.psd, (char *const *)argv);
  fprintf(stderr, "execv %s: %s\n", opt.psd, strerror(errno));
  _exit(127);
}

/* Waits for psd `index` to write "host:port" to portf. */
static int wait_port_file(proc *p, int index, const char *portf, char *addr, size_t addrlen,
                          char *err, size_t errlen) {
  double deadline = now_s() + 15.0;
  while (!g_interrupted) {
    char *s = read_small_file(portf);
    if (s && strchr(s, ':')) {
      s[strcspn(s, "\r\n")] = '\0';
      snprintf(addr, addrlen, "%s", s);
      free(s);
      return 0;
    }
    free(s);
    if (proc_reap(p, 0)) {
      char st[96];
      describe_status(p->status, st, sizeof st);
      snprintf(err, errlen, "psd %d exited before writing its port file (%s)", index, st);
      return -1;
    }
    if (now_s() > deadline) {
      snprintf(err, errlen, "psd %d wrote no port file within 15 s", index);
      return -1;
    }
    sleep_ms(5);
  }
  snprintf(err, errlen, "interrupted");
  return -1;
}

int start_psd(proc *p, int run, int index, int nps, int nw, char *addr, size_t addrlen,
              char *err, size_t errlen) {
  char portf[PATH_MAX], idx[16], nps_s[16], nw_s[16];
  snprintf(p->log, sizeof p->log, "%s/run%d.psd%d.log", g_tmpdir, run, index);
  snprintf(portf, sizeof portf, "%s/run%d.psd%d.port", g_tmpdir, run, index);
  snprintf(idx, sizeof idx, "%d", index);
  snprintf(nps_s, sizeof nps_s, "%d", nps);
  snprintf(nw_s, sizeof nw_s, "%d", nw);
  const char *argv[20 + MAX_PSD_ARGS] = {
      opt.psd, "--host", "127.0.0.1", "--port", "0", "--port-file", portf, "--ps-index", idx,
      "--num-ps", nps_s, "--workers", nw_s, "--log-level", "warn"};
  int a = 15;
  for (int i = 0; i < opt.n_psd_args; i++) argv[a++] = opt.psd_args[i];
  if (g_transport) {
    argv[a++] = "--transport";
    argv[a++] = g_transport;
  }
  if (g_telem_off) {
    argv[a++] = "--telemetry";
    argv[a++] = "off";
  }
  argv[a] = NULL;
  pid_t pid = fork_child();
  if (pid < 0) {
    snprintf(err, errlen, "fork: %s", strerror(errno));
    return -1;
  }
  if (pid == 0) exec_psd(p, index, argv);
  p->pid = pid;
  p->reaped = 0;
  return wait_port_file(p, index, portf, addr, addrlen, err, errlen);
}

/* ---------------------------------------------------------------------- */
/* Logs */

/* Prints the last `max` bytes of a log file to stderr. */
static void print_log_tail(const char *path, size_t max) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "  (no log at %s)\n", path);
    return;
  }
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  long from = size > (long)max ? size - (long)max : 0;
  fseek(f, from, SEEK_SET);
  fprintf(stderr, "  --- tail of %s%s ---\n", path, from ? " (truncated)" : "");
  char buf[4096];
  size_t n;
  int last = '\n';
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
    fwrite(buf, 1, n, stderr);
    last = buf[n - 1];
  }
  if (size == 0) fputs("  (empty)\n", stderr);
  else if (last != '\n') fputc('\n', stderr);
  fprintf(stderr, "  --- end of %s ---\n", path);
  fclose(f);
}

void print_logs(const proc *ps, int nps, const proc *wk, int nw) {
  for (int i = 0; i < nw; i++)
    if (wk[i].log[0]) print_log_tail(wk[i].log, 2048);
  for (int i = 0; i < nps; i++)
    if (ps[i].log[0]) print_log_tail(ps[i].log, 2048);
}

/* The directory for logs and port files: $TMPDIR (or /tmp)/ps_bench.XXXXXX. */
int make_tmpdir(void) {
  const char *base = getenv("TMPDIR");
  if (base && strlen(base) > 900) base = NULL;
  snprintf(g_tmpdir, sizeof g_tmpdir, "%s/ps_bench.XXXXXX", base && *base ? base : "/tmp");
  if (!mkdtemp(g_tmpdir)) {
    fprintf(stderr, "ps_bench: mkdtemp %s: %s\n", g_tmpdir, strerror(errno));
    return -1;
  }
  return 0;
}

void remove_tmpdir(void) {
  if (!g_tmpdir[0]) return;
  DIR *d = opendir(g_tmpdir);
  if (d) {
    struct dirent *e;
    while ((e = readdir(d))) {
      if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
      char p[PATH_MAX + 256];
      snprintf(p, sizeof p, "%s/%s", g_tmpdir, e->d_name);
      unlink(p);
    }
    closedir(d);
  }
  rmdir(g_tmpdir);
}
