#define _GNU_SOURCE
#include "testutil.h"

#include "wire.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
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

long tu_vm_kib(pid_t pid, const char *field) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  char *s = tu_read_file(path);
  long v = -1;
  char *q = s ? strstr(s, field) : NULL;
  if (q) v = strtol(q + strlen(field), NULL, 10);
  free(s);
  return v;
}

long long tu_proc_stat(pid_t pid, int n) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  char *s = tu_read_file(path);
  long long v = -1;
  /* Fields 1 and 2 (pid, "(comm)") end at the last ')': comm may hold
   * spaces and parentheses. Then field 3 (the state), and so on. */
  char *q = s ? strrchr(s, ')') : NULL;
  for (int f = 3; q && f <= n; f++) {
    q += strspn(q + 1, " ") + 1;
    if (f == n) v = strtoll(q, NULL, 10);
    else q += strcspn(q, " ");
  }
  free(s);
  return v;
}

const char *tu_psd_preload;
const char *tu_psd_secret;

int tu_psd_start(tu_psd *p, const char *const *args) {
  static int seq;
  const char *bin = getenv("PSD_BIN");
  static char self[1024];
  if (!bin) {
    /* Default: the psd built next to this test runner. */
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 8);
    if (n > 0) {
      self[n] = '\0';
      char *slash = strrchr(self, '/');
      if (slash) strcpy(slash + 1, "psd");
      bin = self;
    } else {
      bin = "psd";
    }
  }
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
  /* $PS_TRANSPORT (the suites rerun over shm or tcp): psd offers shared
   * memory, or not, as the clients of the run will ask; a test's own
   * --transport wins. */
  const char *tr = getenv("PS_TRANSPORT");
  int has_tr = 0;
  for (int i = 0; args && args[i]; i++) has_tr |= strcmp(args[i], "--transport") == 0;
  if (tr && *tr && !has_tr) {
    argv[n++] = "--transport";
    argv[n++] = tr;
  }
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
    if (tu_psd_preload) setenv("LD_PRELOAD", tu_psd_preload, 1);
    if (tu_psd_secret) setenv("PSD_SECRET", tu_psd_secret, 1);
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

int tu_log_contains(const tu_psd *p, const char *needle) { return tu_log_count(p, needle) > 0; }

int tu_log_count(const tu_psd *p, const char *needle) {
  char *s = tu_read_file(p->log_path);
  int n = 0;
  for (char *q = s; q && (q = strstr(q, needle)); q += strlen(needle)) n++;
  free(s);
  return n;
}

int tu_connect(const char *addr) {
  char host[64];
  int port;
  if (ps__parse_hostport(addr, host, sizeof host, &port) != 0) return -1;
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) return -1;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct timeval tv = {3, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv); /* bounds connect() too */
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  for (;;) {
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) return fd;
    if (errno != EINTR) break;
  }
  int e = errno;
  close(fd);
  errno = e;
  return -1;
}

int tu_send_all(int fd, const void *buf, size_t n) {
  const uint8_t *p = buf;
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Removes psd's Challenge from the front of buf once it is whole (it opens
 * every connection; callers look at what psd answered them). */
static void drop_challenge(uint8_t *buf, size_t *n, int *dropped) {
  ps__frame_header h;
  char err[160];
  if (*dropped || *n < PS__HEADER_SIZE) return;
  if (ps__header_decode(buf, 0, &h, err, sizeof err) != 0 || h.type != PS__MSG_CHALLENGE) {
    *dropped = 1; /* something else came first: keep it all */
    return;
  }
  size_t len = PS__HEADER_SIZE + h.meta_len;
  if (*n < len) return;
  memmove(buf, buf + len, *n - len);
  *n -= len;
  *dropped = 1;
}

int tu_read_until_eof(int fd, uint8_t *buf, size_t cap, double timeout_s, size_t *n) {
  double end = ps__now() + timeout_s;
  int dropped = 0;
  *n = 0;
  for (;;) {
    double left = end - ps__now();
    if (left <= 0) return 0;
    struct pollfd pf = {fd, POLLIN, 0};
    int pr = poll(&pf, 1, (int)(left * 1000) + 1);
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return 0;
    uint8_t tmp[4096];
    ssize_t r = recv(fd, tmp, sizeof tmp, 0);
    if (r == 0) return 1;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return 1; /* ECONNRESET */
    }
    size_t keep = (size_t)r < cap - *n ? (size_t)r : cap - *n;
    memcpy(buf + *n, tmp, keep);
    *n += keep;
    drop_challenge(buf, n, &dropped);
  }
}

ps_client *tu_client_try(const char *const *hosts, int nps, int index, int nw, int replicas,
                         int request_ms, char *err, size_t errlen) {
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hosts;
  cfg.num_ps = nps;
  cfg.worker_index = index;
  cfg.num_workers = nw;
  cfg.replicas_to_aggregate = replicas;
  cfg.request_timeout_ms = request_ms;
  cfg.telemetry = "off";
  cfg.no_signal_handlers = 1;
  ps_client *c = NULL;
  if (ps_client_create(&cfg, &c, err, errlen) != 0) return NULL;
  return c;
}

ps_client *tu_client(const char *const *hosts, int nps, int index, int nw, int replicas,
                     int request_ms) {
  char err[512];
  ps_client *c = tu_client_try(hosts, nps, index, nw, replicas, request_ms, err, sizeof err);
  ck_assert_msg(c != NULL, "worker %d: %s", index, err);
  return c;
}

void tu_hosts(const tu_psd *ps, int n, char hosts[][64], const char **ptrs) {
  for (int i = 0; i < n; i++) {
    snprintf(hosts[i], 64, "%s", ps[i].addr);
    ptrs[i] = hosts[i];
  }
}

/* ---- model ---------------------------------------------------------------- */
#include <math.h>

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

void tu_sample(uint64_t i, float x[TU_D], int *y) {
  static const float truth[TU_C][TU_D] = {
      {1, -1, 0.5f, 0, 2, -0.5f, 0, 1},
      {-1, 1, 0, 0.5f, -1, 1, 1, 0},
      {0, 0.5f, -1, -1, 0, 0, -1, -1}};
  for (int d = 0; d < TU_D; d++)
    x[d] = (float)((mix(i * TU_D + (uint64_t)d) >> 11) * (1.0 / 9007199254740992.0)) * 2 - 1;
  int best = 0;
  float bs = -1e30f;
  for (int k = 0; k < TU_C; k++) {
    float s = 0;
    for (int d = 0; d < TU_D; d++) s += truth[k][d] * x[d];
    if (s > bs) {
      bs = s;
      best = k;
    }
  }
  *y = best;
}

float tu_grad(const float *W, const float *b, uint64_t first, uint64_t n, float *gW,
              float *gb) {
  memset(gW, 0, sizeof(float) * TU_D * TU_C);
  memset(gb, 0, sizeof(float) * TU_C);
  double loss = 0;
  for (uint64_t i = first; i < first + n; i++) {
    float x[TU_D], z[TU_C];
    int y;
    tu_sample(i, x, &y);
    float mx = -1e30f;
    for (int k = 0; k < TU_C; k++) {
      z[k] = b[k];
      for (int d = 0; d < TU_D; d++) z[k] += x[d] * W[d * TU_C + k];
      if (z[k] > mx) mx = z[k];
    }
    float sum = 0;
    for (int k = 0; k < TU_C; k++) sum += (z[k] = expf(z[k] - mx));
    for (int k = 0; k < TU_C; k++) {
      float p = z[k] / sum;
      float dz = (p - (k == y ? 1.0f : 0.0f)) / (float)n;
      gb[k] += dz;
      for (int d = 0; d < TU_D; d++) gW[d * TU_C + k] += x[d] * dz;
      if (k == y) loss -= log(p > 1e-30f ? p : 1e-30f);
    }
  }
  return (float)(loss / (double)n);
}

float tu_accuracy(const float *W, const float *b, uint64_t first, uint64_t n) {
  uint64_t right = 0;
  for (uint64_t i = first; i < first + n; i++) {
    float x[TU_D];
    int y, best = 0;
    float bs = -1e30f;
    tu_sample(i, x, &y);
    for (int k = 0; k < TU_C; k++) {
      float s = b[k];
      for (int d = 0; d < TU_D; d++) s += x[d] * W[d * TU_C + k];
      if (s > bs) {
        bs = s;
        best = k;
      }
    }
    right += best == y;
  }
  return (float)right / (float)n;
}

void tu_model_opts(ps_optimizer *ow, ps_optimizer *ob) {
  ps_optimizer_default(ow, 0.5);
  ps_optimizer_default(ob, 0.1);
  ob->kind = PS_OPT_MOMENTUM;
  ob->momentum = 0.9;
}

static const ps_init TU_INIT_W = PS_SIZED(ps_init, PS_INIT_GLOROT_UNIFORM, 0, 0, 42);
static const int64_t TU_SHAPE_W[2] = {TU_D, TU_C};
static const int64_t TU_SHAPE_B[1] = {TU_C};

void tu_model_init(float *W, float *b) {
  ps_init_fill(&TU_INIT_W, "W", TU_SHAPE_W, 2, W, TU_D * TU_C);
  memset(b, 0, sizeof(float) * TU_C);
}

int tu_params_equal(const tu_train *a, const tu_train *b) {
  return memcmp(a->W, b->W, sizeof a->W) == 0 && memcmp(a->b, b->b, sizeof a->b) == 0;
}

void *tu_train_worker(void *arg) {
  tu_train *t = arg;
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = t->hosts;
  cfg.num_ps = t->num_ps;
  cfg.worker_index = t->worker;
  cfg.num_workers = t->num_workers;
  cfg.replicas_to_aggregate = t->replicas;
  cfg.async_mode = t->async_mode;
  cfg.connect_timeout_ms = 10000;
  cfg.request_timeout_ms = 30000;
  cfg.split_threshold = t->split_threshold;
  cfg.max_slice_bytes = t->max_slice_bytes;
  ps_client *c = NULL;
  t->rc = ps_client_create(&cfg, &c, t->err, sizeof t->err);
  if (t->rc) return NULL;
  ps_optimizer ow, ob;
  tu_model_opts(&ow, &ob);
  if (t->opt_w) ow = *t->opt_w;
  if (t->opt_b) ob = *t->opt_b;
  ps_init zero = PS_SIZED(ps_init, PS_INIT_ZEROS, 0, 0, 0);
  ps_var *vw = NULL, *vb = NULL;
  t->rc = ps_client_var_create(c, "W", TU_SHAPE_W, 2, &TU_INIT_W, &ow, &vw);
  if (!t->rc) t->rc = ps_client_var_create(c, "b", TU_SHAPE_B, 1, &zero, &ob, &vb);
  uint64_t step = 0;
  if (!t->rc) t->rc = ps_client_pull(c, 0, &step);
  if (t->gate && t->slow) {
    __atomic_store_n(t->gate, 1, __ATOMIC_RELEASE);
  } else if (t->gate) {
    while (!__atomic_load_n(t->gate, __ATOMIC_ACQUIRE)) {
      struct timespec ts = {0, 1000000};
      nanosleep(&ts, NULL);
    }
  }
  for (int i = 0; !t->rc && (t->until ? step < t->until
                              : t->slow ? step < (uint64_t)t->steps
                                        : i < t->steps); i++) {
    if (t->delay_us) {
      struct timespec ts = {t->delay_us / 1000000, (long)(t->delay_us % 1000000) * 1000};
      nanosleep(&ts, NULL);
    }
    uint64_t first = (step * (uint64_t)t->num_workers + (uint64_t)t->worker) * (uint64_t)t->batch;
    tu_grad(ps_var_data(vw), ps_var_data(vb), first, (uint64_t)t->batch, ps_var_grad(vw),
            ps_var_grad(vb));
    if (t->slow) {
      /* Wait until the others have completed this step: our gradient is
       * then stale by construction. */
      uint64_t s2;
      ps_req *r;
      t->rc = ps_client_pull_async(c, step + 1, NULL, 0, &r);
      if (!t->rc) t->rc = ps_req_wait(r, -1, &s2);
      ps_req_destroy(r);
      if (t->rc) break;
      ps_req *p;
      t->pushes++;
      t->rc = ps_client_push_async(c, step, NULL, 0, &p);
      if (!t->rc) t->rc = ps_req_wait(p, -1, NULL);
      ps_req_destroy(p);
      if (t->rc == PS_ESTALE) {
        t->stale++;
        t->rc = 0;
      }
      step = step + 1; /* one stale push for every step, in order */
      continue;
    }
    int stale = 0;
    t->rc = ps_client_step(c, &step, &stale);
    t->stale += stale;
    if (t->progress) *t->progress = step;
  }
  if (t->rc == PS_ESTOPPED) {
    t->stopped = 1;
    t->rc = 0;
  }
  if (t->rc) snprintf(t->err, sizeof t->err, "%s", ps_client_errmsg(c));
  if (!t->rc) {
    memcpy(t->W, ps_var_data(vw), sizeof t->W);
    memcpy(t->b, ps_var_data(vb), sizeof t->b);
    t->final_step = step;
    if (t->opt_w && t->opt_w->average && t->opt_b && t->opt_b->average) {
      ps_var *both[2] = {vw, vb};
      float *out[2] = {t->avg_W, t->avg_b};
      t->rc = ps_client_pull_average(c, both, 2, out, NULL);
    }
    if (!t->rc && !t->skip_finish) t->rc = ps_client_finish(c);
    if (t->rc) snprintf(t->err, sizeof t->err, "%s", ps_client_errmsg(c));
  }
  ps_client_destroy(c);
  return NULL;
}

unsigned tu_seed(const char *what) {
  const char *env = getenv("PS_TEST_SEED");
  unsigned seed;
  if (env && *env) {
    char *end;
    unsigned long v = strtoul(env, &end, 10);
    ck_assert_msg(*end == '\0', "PS_TEST_SEED must be a decimal number, got '%s'", env);
    seed = (unsigned)v;
  } else {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    seed = (unsigned)(ts.tv_sec ^ ts.tv_nsec ^ getpid());
  }
  fprintf(stderr, "%s: seed %u (PS_TEST_SEED=%u replays it)\n", what, seed, seed);
  return seed;
}

void tu_psd_set_preload(const char *so) {
  tu_psd_preload = so;
  const char *old = getenv("ASAN_OPTIONS");
  if (!so || (old && strstr(old, "verify_asan_link_order=0"))) return;
  char opts[1024];
  snprintf(opts, sizeof opts, "%s%sverify_asan_link_order=0", old ? old : "", old ? ":" : "");
  setenv("ASAN_OPTIONS", opts, 1);
}

/* ---- programs of the build, run for real (the psrun suites) ------------- */

const char *tu_bin(const char *name) {
  static char dir[1024], path[8][1100];
  static int k;
  if (!dir[0]) {
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (n > 0) dir[n] = '\0';
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
  }
  k = (k + 1) % 8;
  snprintf(path[k], sizeof path[k], "%s/%s", dir, name);
  return path[k];
}

pid_t tu_spawn(char *const *argv, char *const *env, char *out, size_t outlen) {
  static int seq;
  snprintf(out, outlen, "%s/run.%d.%d.out", tu_tmpdir(), (int)getpid(), ++seq);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    for (int i = 0; env && env[i]; i++) putenv(env[i]);
    execv(argv[0], argv);
    _exit(127);
  }
  return pid;
}

int tu_wait_pid(pid_t pid, double timeout_s, int *status) {
  double end = ps__now() + timeout_s;
  while (ps__now() < end) {
    if (waitpid(pid, status, WNOHANG) == pid) return 0;
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  kill(pid, SIGKILL);
  waitpid(pid, status, 0);
  return -1;
}

int tu_wait_text(const char *file, const char *needle, double timeout_s) {
  for (double end = ps__now() + timeout_s; ps__now() < end;) {
    char *t = tu_read_file(file);
    int hit = t && strstr(t, needle);
    free(t);
    if (hit) return 0;
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
  }
  return -1;
}

double tu_time_limit(double seconds) {
  static double scale;
  if (scale == 0) {
    const char *v = getenv("PS_TEST_TIME_SCALE");
    char *end = NULL;
    scale = v && *v ? strtod(v, &end) : 1.0;
    if (v && *v && (*end || !(scale >= 1 && scale <= 100))) {
      fprintf(stderr, "PS_TEST_TIME_SCALE must be a number from 1 to 100, got '%s'\n", v);
      abort();
    }
  }
  return seconds * scale;
}

int tu_can_be_another_user(void) {
  return getuid() == 0 && access("/usr/bin/setpriv", X_OK) == 0;
}

static int g_skipped;

void tu_skip_tests(const char *suite, const char *tests, const char *why) {
  printf("SKIP: %s: %s: %s\n", suite, tests, why);
  fflush(stdout);
  g_skipped++;
}

int tu_skipped(void) { return g_skipped; }

/* ---- a private munged ---------------------------------------------------- */

static char g_munge_sock[600]; /* its socket, "" when none runs */
static pid_t g_munged;

const char *tu_munged_start(char *why, size_t whylen) {
  if (g_munge_sock[0]) return g_munge_sock;
  char dir[512], cmd[8192], pidf[600];
  snprintf(dir, sizeof dir, "%s/munge", tu_tmpdir());
  mkdir(dir, 0700);
  snprintf(cmd, sizeof cmd,
           "rm -f %s/key %s/pid && dd if=/dev/urandom of=%s/key bs=1024 count=1 2>/dev/null && "
           "chmod 0400 %s/key && chmod 0711 %s && munged %s --socket=%s/sock --key-file=%s/key "
           "--pid-file=%s/pid --log-file=%s/log --seed-file=%s/seed >%s/out 2>&1",
           dir, dir, dir, dir, dir, getuid() == 0 ? "--force" : "", dir, dir, dir, dir, dir, dir);
  if (system(cmd) != 0) {
    char outf[600];
    snprintf(outf, sizeof outf, "%s/out", dir);
    char *out = tu_read_file(outf);
    snprintf(why, whylen, "munged did not start: %s", out ? out : "(no output)");
    free(out);
    return NULL;
  }
  snprintf(pidf, sizeof pidf, "%s/pid", dir);
  for (int i = 0; i < 100 && !g_munged; i++) {
    char *p = tu_read_file(pidf);
    if (p && atoi(p) > 0) g_munged = atoi(p);
    free(p);
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
  if (!g_munged) {
    snprintf(why, whylen, "munged wrote no pid file %s within 2 s", pidf);
    return NULL;
  }
  snprintf(g_munge_sock, sizeof g_munge_sock, "%s/sock", dir);
  return g_munge_sock;
}

void tu_munged_stop(void) {
  if (g_munged > 0) kill(g_munged, SIGTERM);
  g_munged = 0;
  g_munge_sock[0] = '\0';
}

/* The value of NAME in an `env` dump (text), or "" when it is not set. */
const char *tu_env_of(const char *text, const char *name, char *out, size_t len) {
  char key[64];
  snprintf(key, sizeof key, "\n%s=", name);
  const char *p = strstr(text, key);
  out[0] = '\0';
  if (p) snprintf(out, len, "%.*s", (int)strcspn(p + strlen(key), "\n"), p + strlen(key));
  return out;
}
