/* Integration: connection churn against a psd serving a training run.
 *
 * Thousands of short-lived connections (connect and close, abortive close,
 * HELLOs psd must refuse, HELLOs claiming a real worker's index, half a
 * frame, garbage) hit a psd while two real workers train through it. psd's
 * resident memory and open descriptors must stay flat (no per-connection
 * leak), no churn client may ever be accepted as a worker, and the run must
 * end with parameters bit-for-bit equal to a clean run's.
 *
 * psd exits as soon as every worker has finished, so the final resource
 * sample has to be taken while the run is still going: the churn run's
 * workers are paced (paced_worker below, the same arithmetic as
 * tu_train_worker) so their steps are spread over the churn, the last step
 * held until the final sample is taken. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ps.pb-c.h"
#include "wire.h"
#include "testutil.h"

enum {
  NW = 2,          /* real workers */
  STEPS = 200,     /* training steps */
  BATCH = 16,      /* samples per worker per step */
  NCHURN = 2,      /* churn threads */
  TOTAL = 3000,    /* churn connections in all */
  WARM = 300,      /* ... of which warm-up, before the baseline sample */
  MAX_SAMPLES = 96,
  FD_SLACK = 2,    /* descriptors the final count may exceed the baseline by */
};
#define CHURN_MAX_S 15.0              /* churn stops after this even if short of TOTAL */
/* Allowed growth of psd's RSS and of its data segment (VmData, which also
 * counts leaked memory never touched) from after warm-up to the end. Honest
 * runs stay within ~100 KiB (ASan builds included); 4 MiB over ~2700
 * connections catches any leak of ~1.5 KiB per connection or more. */
#define MEM_SLACK_KIB (4L * 1024)
#define IO_TIMEOUT_S 3.0              /* every socket read/write/connect */
#define SETTLE_S 1.0                  /* for psd to close what churn left */

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ---- psd's resources ------------------------------------------------------ */

/* A "Vm...:" field of /proc/PID/status in KiB, or -1. */
static int fd_count(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

typedef struct sample {
  double t;       /* seconds since the churn run's psd started */
  int conns;      /* churn connections made so far */
  int allowed;    /* training steps released so far */
  long rss;       /* KiB resident */
  long data;      /* KiB of data segment and anonymous mappings (VmData):
                     also counts leaked memory never touched */
  int fds;
  const char *what;
} sample;

typedef struct samples {
  sample s[MAX_SAMPLES];
  int n;
  double t0;
} samples;

static sample *take(samples *ss, pid_t pid, int conns, int allowed, const char *what) {
  sample *x = &ss->s[ss->n < MAX_SAMPLES ? ss->n++ : MAX_SAMPLES - 1];
  x->t = ps__now() - ss->t0;
  x->conns = conns;
  x->allowed = allowed;
  x->rss = tu_vm_kib(pid, "VmRSS:");
  x->data = tu_vm_kib(pid, "VmData:");
  x->fds = fd_count(pid);
  x->what = what;
  return x;
}

/* The samples, one per line, for failure messages (Check keeps at most 4 KiB
 * of a message: the first 5 and the last 15 when there are more). */
static const char *format_samples(const samples *ss) {
  static char buf[2400];
  size_t o = 0;
  buf[0] = '\0';
  for (int i = 0; i < ss->n && o + 128 < sizeof buf; i++) {
    if (ss->n > 20 && i == 5) {
      o += (size_t)snprintf(buf + o, sizeof buf - o, "\n  ...");
      i = ss->n - 15;
    }
    o += (size_t)snprintf(buf + o, sizeof buf - o,
                          "\n  %6.2f s  %-9s conns %4d  steps %3d  RSS %6ld KiB  data %6ld KiB"
                          "  fds %d",
                          ss->s[i].t, ss->s[i].what, ss->s[i].conns, ss->s[i].allowed,
                          ss->s[i].rss, ss->s[i].data, ss->s[i].fds);
  }
  return buf;
}

/* ---- raw sockets ---------------------------------------------------------- */

/* Closes with a RST instead of a FIN. */
static void close_abort(int fd) {
  struct linger lg = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  close(fd);
}

/* The first ERROR among whole frames in b[0..n): 1 if found (fields set),
 * 0 if none, -1 if the bytes are not whole valid frames. *accepted is set
 * if a HELLO_REPLY is among them. */
static int parse_error(const uint8_t *b, size_t n, int *code, int *fatal, char *msg,
                       size_t msglen, int *accepted) {
  size_t off = 0;
  int found = 0;
  msg[0] = '\0';
  *accepted = 0;
  while (off < n) {
    ps__frame_header h;
    char err[256];
    if (n - off < PS__HEADER_SIZE || ps__header_decode(b + off, 1, &h, err, sizeof err) != 0 ||
        n - off - PS__HEADER_SIZE < (uint64_t)h.meta_len + h.data_len)
      return -1;
    if (h.type == PS__MSG_HELLO_REPLY) *accepted = 1;
    if (h.type == PS__MSG_ERROR && !found) {
      Ps__Error *m = ps__error__unpack(NULL, h.meta_len, b + off + PS__HEADER_SIZE);
      if (!m) return -1;
      found = 1;
      *code = m->code;
      *fatal = m->fatal;
      snprintf(msg, msglen, "%s", m->message ? m->message : "");
      ps__error__free_unpacked(m, NULL);
    }
    off += PS__HEADER_SIZE + h.meta_len + (size_t)h.data_len;
  }
  return found;
}

/* ---- frames --------------------------------------------------------------- */

/* A valid HELLO frame into out (at most cap bytes); its length. */
static size_t hello_frame(uint8_t *out, size_t cap, uint32_t worker, uint32_t nworkers,
                          uint32_t ps_index) {
  Ps__Hello m = PS__HELLO__INIT;
  m.protocol_version = PS__PROTOCOL_VERSION;
  m.role = PS__ROLE__ROLE_WORKER;
  m.worker_index = worker;
  m.num_workers = nworkers;
  m.num_ps = 1;
  m.ps_index = ps_index;
  m.client_id = (char *)"test_churn";
  size_t ml = ps__hello__get_packed_size(&m);
  if (PS__HEADER_SIZE + ml > cap) return 0;
  ps__header_encode(out, PS__MSG_HELLO, (uint32_t)ml, 0);
  ps__hello__pack(&m, out + PS__HEADER_SIZE);
  return PS__HEADER_SIZE + ml;
}

static void put_le(uint8_t *p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- churn ---------------------------------------------------------------- */

typedef enum kind {
  K_CLOSE,       /* connect, close at once */
  K_RESET,       /* connect, close with a RST */
  K_HELLO_NW,    /* HELLO for a job of 3 workers: psd runs --workers 2 */
  K_HELLO_RANGE, /* HELLO for worker 2..4 of 2 */
  K_HELLO_PS,    /* HELLO for ps 1 of 1 */
  K_CLAIM,       /* HELLO as worker 0 or 1 of the real job: already connected */
  K_NOREAD,      /* a refused HELLO, then gone before the ERROR arrives */
  K_HALF,        /* part of a HELLO frame, then close */
  K_GARBAGE,     /* random bytes, an unknown type, or a PUSH before HELLO */
  K_N
} kind;

static const char *const KIND_NAMES[K_N] = {"close", "reset", "hello_nw", "hello_range",
                                            "hello_ps", "claim", "noread", "half",
                                            "garbage"};
/* Relative frequencies. */
static const int KIND_WEIGHT[K_N] = {2, 1, 2, 1, 1, 3, 1, 2, 2};

typedef struct shared {
  const char *addr;
  int total;       /* churn connections made, all threads */
  int stop;        /* churn threads leave */
  int pause;       /* churn threads idle (after their current connection) */
  int claims;      /* both real workers are in: K_CLAIM allowed */
  int limit;       /* connections to make in all */
  double deadline; /* ps__now() after which churn stops */
} shared;

typedef struct churn {
  shared *sh;
  int id;
  int idle;        /* acknowledges shared.pause */
  int done;        /* the thread has left its loop */
  /* results */
  int conns, by_kind[K_N], errors, claims_refused, silent;
  int failures;
  char first_failure[320];
} churn;

static void cfail(churn *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void cfail(churn *c, const char *fmt, ...) {
  if (c->failures++ == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->first_failure, sizeof c->first_failure, fmt, ap);
    va_end(ap);
  }
}

/* The churn threads' first failures, for failure messages. */
static const char *churn_failures(const churn *ch, int n) {
  static char buf[1024];
  size_t o = 0;
  buf[0] = '\0';
  for (int i = 0; i < n && o + 64 < sizeof buf; i++)
    if (ch[i].failures)
      o += (size_t)snprintf(buf + o, sizeof buf - o, "\n  churn thread %d: %d failures; first: %s",
                            i, ch[i].failures, ch[i].first_failure);
  return buf;
}

static uint64_t rnd(uint64_t *x) {
  *x = *x * 6364136223846793005ULL + 1442695040888963407ULL;
  return *x >> 33;
}

/* Reads psd's answer to a refused request: a fatal ERROR with code (and
 * word in its message), then the close. */
static void expect_refusal(churn *c, int fd, kind k, int code, const char *word) {
  uint8_t rb[8192];
  size_t n;
  int eof = tu_read_until_eof(fd, rb, sizeof rb, IO_TIMEOUT_S, &n);
  if (!eof) {
    int ecode = 0, fatal = 0, accepted = 0;
    char msg[1024];
    parse_error(rb, n, &ecode, &fatal, msg, sizeof msg, &accepted);
    cfail(c, "%s: psd did not close the connection within %.0f s (%zu bytes back%s%s%s)",
          KIND_NAMES[k], IO_TIMEOUT_S, n,
          accepted ? ": a HELLO_REPLY, so psd ACCEPTED a churn client as a worker" : "",
          msg[0] ? "; error: " : "", msg);
    return;
  }
  int ecode = 0, fatal = 0, accepted = 0;
  char msg[1024];
  int found = parse_error(rb, n, &ecode, &fatal, msg, sizeof msg, &accepted);
  if (accepted) {
    cfail(c, "%s: psd ACCEPTED the handshake of a churn client (HELLO_REPLY)%s%s",
          KIND_NAMES[k], found == 1 ? ", then: " : "", found == 1 ? msg : "");
    return;
  }
  if (found != 1 || !fatal || ecode != code || !strstr(msg, word)) {
    cfail(c, "%s: expected a fatal %s error mentioning '%s', got %zu bytes: %s, %s %s '%s'",
          KIND_NAMES[k], ps_err_name(code), word, n,
          found < 0 ? "not whole frames" : found ? "an ERROR" : "no ERROR",
          fatal ? "fatal" : "non-fatal", ps_err_name(ecode), msg);
    return;
  }
  c->errors++;
  if (k == K_CLAIM) c->claims_refused++;
}

static void churn_one(churn *c, kind k, uint64_t *x) {
  int fd = tu_connect(c->sh->addr);
  if (fd < 0) {
    cfail(c, "%s: cannot connect to psd: %s", KIND_NAMES[k], strerror(errno));
    return;
  }
  __atomic_fetch_add(&c->sh->total, 1, __ATOMIC_SEQ_CST);
  c->conns++;
  c->by_kind[k]++;
  uint8_t b[1024];
  size_t n = 0;
  switch (k) {
  case K_CLOSE:
    close(fd);
    return;
  case K_RESET:
    close_abort(fd);
    return;
  case K_HELLO_NW:
    n = hello_frame(b, sizeof b, (uint32_t)(rnd(x) % 3), 3, 0);
    if (tu_send_all(fd, b, n) == 0) expect_refusal(c, fd, k, PS_EMISMATCH, "--workers 2");
    else cfail(c, "%s: send failed: %s", KIND_NAMES[k], strerror(errno));
    break;
  case K_HELLO_RANGE:
    n = hello_frame(b, sizeof b, 2 + (uint32_t)(rnd(x) % 3), 2, 0);
    if (tu_send_all(fd, b, n) == 0)
      expect_refusal(c, fd, k, PS_EINVAL, "not below the number of workers");
    else cfail(c, "%s: send failed: %s", KIND_NAMES[k], strerror(errno));
    break;
  case K_HELLO_PS:
    n = hello_frame(b, sizeof b, (uint32_t)(rnd(x) % 2), 2, 1);
    if (tu_send_all(fd, b, n) == 0) expect_refusal(c, fd, k, PS_EMISMATCH, "expects ps 1");
    else cfail(c, "%s: send failed: %s", KIND_NAMES[k], strerror(errno));
    break;
  case K_CLAIM:
    /* Only once both real workers hold their connections (churn_main
     * checks), so that psd must refuse it; it must never take over. */
    n = hello_frame(b, sizeof b, (uint32_t)(rnd(x) % 2), 2, 0);
    if (tu_send_all(fd, b, n) == 0) expect_refusal(c, fd, k, PS_EBUSY, "already connected");
    else cfail(c, "%s: send failed: %s", KIND_NAMES[k], strerror(errno));
    break;
  case K_NOREAD:
    n = hello_frame(b, sizeof b, 0, 3, 0);
    tu_send_all(fd, b, n);
    if (rnd(x) % 2) close_abort(fd);
    else close(fd);
    return;
  case K_HALF: {
    n = hello_frame(b, sizeof b, 0, 3, 0);
    size_t cut = 1 + (size_t)(rnd(x) % (n - 1)); /* 1..n-1 bytes: never whole */
    if (tu_send_all(fd, b, cut) != 0) {
      cfail(c, "%s: send failed: %s", KIND_NAMES[k], strerror(errno));
      break;
    }
    if (rnd(x) % 2) {
      close(fd);
      return;
    }
    /* Hang up our side and check psd closes without a word. */
    shutdown(fd, SHUT_WR);
    uint8_t rb[1024];
    size_t got;
    int eof = tu_read_until_eof(fd, rb, sizeof rb, IO_TIMEOUT_S, &got);
    if (!eof || got != 0)
      cfail(c, "%s: %zu of %zu bytes sent, then FIN: psd %s (%zu bytes back)",
            KIND_NAMES[k], cut, n, eof ? "closed" : "did not close within 3 s", got);
    else c->silent++;
    break;
  }
  case K_GARBAGE: {
    unsigned v = (unsigned)(rnd(x) % 3);
    const char *word;
    if (v == 0) {
      n = 64 + (size_t)(rnd(x) % 448);
      for (size_t i = 0; i < n; i++) b[i] = (uint8_t)rnd(x);
      if (b[0] == 'P') b[0] = 'X'; /* never the magic by accident */
      word = "magic";
    } else if (v == 1) {
      put_le(b, PS__MAGIC, 4);
      put_le(b + 4, PS__PROTOCOL_VERSION, 2);
      put_le(b + 6, 99, 2); /* no such type */
      put_le(b + 8, 0, 4);
      put_le(b + 12, 0, 4);
      put_le(b + 16, 0, 8);
      n = PS__HEADER_SIZE;
      word = "unknown message type";
    } else {
      ps__header_encode(b, PS__MSG_PUSH, 0, 16); /* legal later, not before HELLO */
      memset(b + PS__HEADER_SIZE, 0, 16);
      n = PS__HEADER_SIZE + 16;
      word = "before the handshake";
    }
    if (tu_send_all(fd, b, n) == 0) expect_refusal(c, fd, k, PS_EPROTO, word);
    else cfail(c, "%s: send failed: %s", KIND_NAMES[k], strerror(errno));
    break;
  }
  case K_N:
    break;
  }
  close(fd);
}

static void *churn_main(void *arg) {
  churn *c = arg;
  shared *sh = c->sh;
  int wsum = 0;
  for (int k = 0; k < K_N; k++) wsum += KIND_WEIGHT[k];
  uint64_t x = 0x9e3779b97f4a7c15ULL * (uint64_t)(c->id + 1);
  while (!__atomic_load_n(&sh->stop, __ATOMIC_SEQ_CST)) {
    if (__atomic_load_n(&sh->pause, __ATOMIC_SEQ_CST)) {
      __atomic_store_n(&c->idle, 1, __ATOMIC_SEQ_CST);
      sleep_ms(1);
      continue;
    }
    __atomic_store_n(&c->idle, 0, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sh->total, __ATOMIC_SEQ_CST) >= sh->limit ||
        ps__now() > sh->deadline || c->failures > 20)
      break;
    int r = (int)(rnd(&x) % (uint64_t)wsum);
    kind k = K_CLOSE;
    while (r >= KIND_WEIGHT[k]) r -= KIND_WEIGHT[k++];
    if (k == K_CLAIM && !__atomic_load_n(&sh->claims, __ATOMIC_SEQ_CST)) k = K_HELLO_NW;
    churn_one(c, k, &x);
  }
  __atomic_store_n(&c->done, 1, __ATOMIC_SEQ_CST);
  return NULL;
}

/* ---- training ------------------------------------------------------------- */

/* Steps the paced workers may start, and how many are ready to train. */
typedef struct pacer {
  int allow;
  int ready;
  int abort;
} pacer;

typedef struct paced {
  tu_train t;
  pacer *pc;
} paced;

/* tu_train_worker's plain (not slow, not gated) path, except that step i
 * starts only once pc->allow > i. Sync training is deterministic, so when
 * it runs makes no difference to the result. */
static void *paced_worker(void *arg) {
  paced *w = arg;
  tu_train *t = &w->t;
  static const ps_init init_w = PS_SIZED(ps_init, PS_INIT_GLOROT_UNIFORM, 0, 0, 42);
  static const int64_t shape_w[2] = {TU_D, TU_C};
  static const int64_t shape_b[1] = {TU_C};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = t->hosts;
  cfg.num_ps = t->num_ps;
  cfg.worker_index = t->worker;
  cfg.num_workers = t->num_workers;
  cfg.connect_timeout_ms = 10000;
  cfg.request_timeout_ms = 30000;
  ps_client *c = NULL;
  t->rc = ps_client_create(&cfg, &c, t->err, sizeof t->err);
  if (t->rc) {
    __atomic_fetch_add(&w->pc->ready, 1, __ATOMIC_SEQ_CST); /* nobody waits for it */
    return NULL;
  }
  ps_optimizer ow, ob;
  tu_model_opts(&ow, &ob);
  ps_init zero = PS_SIZED(ps_init, PS_INIT_ZEROS, 0, 0, 0);
  ps_var *vw = NULL, *vb = NULL;
  t->rc = ps_client_var_create(c, "W", shape_w, 2, &init_w, &ow, &vw);
  if (!t->rc) t->rc = ps_client_var_create(c, "b", shape_b, 1, &zero, &ob, &vb);
  uint64_t step = 0;
  if (!t->rc) t->rc = ps_client_pull(c, 0, &step);
  __atomic_fetch_add(&w->pc->ready, 1, __ATOMIC_SEQ_CST);
  for (int i = 0; !t->rc && i < t->steps; i++) {
    double give_up = ps__now() + 60;
    while (__atomic_load_n(&w->pc->allow, __ATOMIC_SEQ_CST) <= i) {
      if (__atomic_load_n(&w->pc->abort, __ATOMIC_SEQ_CST) || ps__now() > give_up) {
        t->rc = PS_ETIMEDOUT;
        snprintf(t->err, sizeof t->err, "the test never released step %d", i);
        break;
      }
      sleep_ms(1);
    }
    if (t->rc) break;
    uint64_t first = (step * (uint64_t)t->num_workers + (uint64_t)t->worker) * (uint64_t)t->batch;
    tu_grad(ps_var_data(vw), ps_var_data(vb), first, (uint64_t)t->batch, ps_var_grad(vw),
            ps_var_grad(vb));
    int stale = 0;
    t->rc = ps_client_step(c, &step, &stale);
    if (t->rc) snprintf(t->err, sizeof t->err, "%s", ps_client_errmsg(c));
    t->stale += stale;
  }
  if (!t->rc) {
    memcpy(t->W, ps_var_data(vw), sizeof t->W);
    memcpy(t->b, ps_var_data(vb), sizeof t->b);
    t->final_step = step;
    t->rc = ps_client_finish(c);
    if (t->rc) snprintf(t->err, sizeof t->err, "%s", ps_client_errmsg(c));
  } else if (!t->err[0]) {
    snprintf(t->err, sizeof t->err, "%s", ps_client_errmsg(c));
  }
  ps_client_destroy(c);
  return NULL;
}

static void start_psd(tu_psd *p) {
  /* --workers 2: a HELLO for another job size is refused before it could
   * pin the job. Short timeouts: a psd left behind by a failure goes away. */
  const char *args[] = {"--num-ps", "1", "--ps-index", "0", "--workers", "2",
                        "--startup-timeout", "30", "--grace-period", "5",
                        "--log-every", "10", NULL};
  ck_assert_msg(tu_psd_start(p, args) == 0, "psd did not start (log %s)", p->log_path);
}

#if defined(__SANITIZE_ADDRESS__)
#define CHURN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CHURN_ASAN 1
#endif
#endif

/* Starts the psd whose memory is measured. Under AddressSanitizer (psd is
 * built like this runner) freed blocks sit in a quarantine of up to 256 MiB
 * before reuse, so RSS would climb with every connection without any leak:
 * give that psd a small quarantine. */
static void start_measured_psd(tu_psd *p) {
#ifdef CHURN_ASAN
  const char *old = getenv("ASAN_OPTIONS");
  char *saved = old ? strdup(old) : NULL;
  static char opts[4096];
  snprintf(opts, sizeof opts, "%s%squarantine_size_mb=1", old ? old : "",
           old && old[0] ? ":" : "");
  setenv("ASAN_OPTIONS", opts, 1);
  start_psd(p);
  if (saved) setenv("ASAN_OPTIONS", saved, 1);
  else unsetenv("ASAN_OPTIONS");
  free(saved);
#else
  start_psd(p);
#endif
}

static void fill_train(tu_train *t, int worker, const char *const *hosts) {
  memset(t, 0, sizeof *t);
  t->hosts = hosts;
  t->num_ps = 1;
  t->num_workers = NW;
  t->worker = worker;
  t->steps = STEPS;
  t->batch = BATCH;
}

/* "" if the training in t[0..NW) succeeded and psd p exited 0, or why not
 * (p is killed then). */
static const char *check_run(tu_train *const t[NW], tu_psd *p, const char *run) {
  static char why[2048];
  why[0] = '\0';
  for (int i = 0; i < NW && !why[0]; i++) {
    if (t[i]->rc)
      snprintf(why, sizeof why, "%s: worker %d failed: %s (%s) (log %s)", run, i,
               ps_strerror(t[i]->rc), t[i]->err, p->log_path);
    else if (t[i]->final_step != STEPS)
      snprintf(why, sizeof why, "%s: worker %d ended at step %llu, not %d", run, i,
               (unsigned long long)t[i]->final_step, STEPS);
  }
  if (!why[0] && tu_psd_wait(p, 10) != 0)
    snprintf(why, sizeof why, "%s: psd did not exit within 10 s of the end (log %s)", run,
             p->log_path);
  if (!why[0] && !(WIFEXITED(p->status) && WEXITSTATUS(p->status) == 0))
    snprintf(why, sizeof why, "%s: psd exit status %d, signal %d (log %s)", run,
             WIFEXITED(p->status) ? WEXITSTATUS(p->status) : -1,
             WIFSIGNALED(p->status) ? WTERMSIG(p->status) : 0, p->log_path);
  if (why[0]) tu_psd_kill(p);
  return why;
}

static int same_params(const tu_train *a, const tu_train *b) {
  return memcmp(a->W, b->W, sizeof a->W) == 0 && memcmp(a->b, b->b, sizeof a->b) == 0;
}

/* Occurrences of needle in psd's log. */
static int log_count(const tu_psd *p, const char *needle) {
  char *s = tu_read_file(p->log_path);
  int n = 0;
  for (const char *q = s; q && (q = strstr(q, needle)) != NULL; q += strlen(needle)) n++;
  free(s);
  return n;
}

/* Clean reference: the same training with nothing else going on. */
static void clean_run(tu_train ct[NW], void *(*fn)(void *), paced *pw, pacer *pc) {
  tu_psd p;
  start_psd(&p);
  static char hosts[1][64];
  static const char *hp[1];
  tu_hosts(&p, 1, hosts, hp);
  pthread_t th[NW];
  for (int i = 0; i < NW; i++) {
    fill_train(pw ? &pw[i].t : &ct[i], i, hp);
    if (pw) pw[i].pc = pc;
    pthread_create(&th[i], NULL, fn, pw ? (void *)&pw[i] : (void *)&ct[i]);
  }
  for (int i = 0; i < NW; i++) pthread_join(th[i], NULL);
  if (pw)
    for (int i = 0; i < NW; i++) ct[i] = pw[i].t;
  tu_train *tp[NW] = {&ct[0], &ct[1]};
  const char *why = check_run(tp, &p, "clean run");
  ck_assert_msg(!why[0], "%s", why);
  ck_assert_msg(same_params(&ct[0], &ct[1]),
                "clean run: the two workers ended with different parameters");
}

START_TEST(test_connection_churn) {
  /* 1. Clean reference, with the shared training worker. */
  tu_train ct[NW];
  clean_run(ct, tu_train_worker, NULL, NULL);

  /* 2. The same training on a fresh psd, under churn. */
  static tu_psd p;
  start_measured_psd(&p);
  static samples ss;
  memset(&ss, 0, sizeof ss);
  ss.t0 = ps__now();
  static char hosts[1][64];
  static const char *hp[1];
  tu_hosts(&p, 1, hosts, hp);
  sample *s_start = take(&ss, p.pid, 0, 0, "start");

  static shared sh;
  memset(&sh, 0, sizeof sh);
  sh.addr = p.addr;
  sh.limit = TOTAL;
  sh.deadline = ps__now() + CHURN_MAX_S;
  static churn ch[NCHURN];
  memset(ch, 0, sizeof ch);
  pthread_t cth[NCHURN];
  for (int i = 0; i < NCHURN; i++) {
    ch[i].sh = &sh;
    ch[i].id = i;
    pthread_create(&cth[i], NULL, churn_main, &ch[i]);
  }
  /* The workers connect, register and initialize amid the churn, then wait
   * for their steps to be released. */
  static pacer pc;
  memset(&pc, 0, sizeof pc);
  static paced pw[NW];
  pthread_t wth[NW];
  for (int i = 0; i < NW; i++) {
    fill_train(&pw[i].t, i, hp);
    pw[i].pc = &pc;
    pthread_create(&wth[i], NULL, paced_worker, &pw[i]);
  }

  char why[700] = "";
  /* Warm-up: both workers ready and WARM churn connections made. */
  for (double end = ps__now() + 20; !why[0];) {
    if (__atomic_load_n(&pc.ready, __ATOMIC_SEQ_CST) == NW &&
        __atomic_load_n(&sh.total, __ATOMIC_SEQ_CST) >= WARM)
      break;
    if (ps__now() > end || ps__now() > sh.deadline)
      snprintf(why, sizeof why, "warm-up did not finish: %d of %d workers ready, %d churn "
               "connections", pc.ready, NW, sh.total);
    sleep_ms(2);
  }
  for (int i = 0; i < NW && !why[0]; i++)
    if (pw[i].t.rc)
      snprintf(why, sizeof why, "worker %d failed to start: %s (%s)", i,
               ps_strerror(pw[i].t.rc), pw[i].t.err);
  take(&ss, p.pid, sh.total, 0, "warm");

  /* Baseline: churn paused, its connections closed by psd. */
  __atomic_store_n(&sh.pause, 1, __ATOMIC_SEQ_CST);
  for (int i = 0; i < NCHURN; i++)
    for (double end = ps__now() + 2 * IO_TIMEOUT_S + 1;
         !__atomic_load_n(&ch[i].idle, __ATOMIC_SEQ_CST) &&
         !__atomic_load_n(&ch[i].done, __ATOMIC_SEQ_CST) && ps__now() < end;)
      sleep_ms(1);
  int fd_expect = s_start->fds + NW; /* the listener and friends, plus the workers */
  for (double end = ps__now() + SETTLE_S; fd_count(p.pid) > fd_expect && ps__now() < end;)
    sleep_ms(10);
  sample base = *take(&ss, p.pid, sh.total, 0, "baseline");
  int base_total = base.conns;
  __atomic_store_n(&sh.claims, 1, __ATOMIC_SEQ_CST);
  __atomic_store_n(&sh.pause, 0, __ATOMIC_SEQ_CST);

  /* Churn, with the training's steps released as it goes; the last step
   * waits for the final sample. */
  double next_sample = ps__now() + 0.25;
  int next_conns = base_total + 300;
  while (!why[0]) {
    int tot = __atomic_load_n(&sh.total, __ATOMIC_SEQ_CST);
    int span = TOTAL - base_total > 0 ? TOTAL - base_total : 1;
    long a = 1 + (long)(tot - base_total) * (STEPS - 1) / span;
    if (a > STEPS - 1) a = STEPS - 1;
    if (a > pc.allow) __atomic_store_n(&pc.allow, (int)a, __ATOMIC_SEQ_CST);
    int done = 1;
    for (int i = 0; i < NCHURN; i++) done &= __atomic_load_n(&ch[i].done, __ATOMIC_SEQ_CST);
    if (done) break;
    if (ps__now() >= next_sample || tot >= next_conns) {
      take(&ss, p.pid, tot, pc.allow, "churn");
      next_sample = ps__now() + 0.25;
      while (next_conns <= tot) next_conns += 300;
    }
    int st;
    if (waitpid(p.pid, &st, WNOHANG) == p.pid) {
      p.pid = 0;
      p.status = st;
      snprintf(why, sizeof why, "psd died during the churn: status %d, signal %d",
               WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    }
    sleep_ms(2);
  }
  __atomic_store_n(&sh.stop, 1, __ATOMIC_SEQ_CST);
  for (int i = 0; i < NCHURN; i++) pthread_join(cth[i], NULL);
  int total = sh.total;
  take(&ss, p.pid, total, pc.allow, "churn end");

  /* psd closes what the churn left within SETTLE_S. */
  for (double end = ps__now() + SETTLE_S;
       p.pid && fd_count(p.pid) > base.fds && ps__now() < end;)
    sleep_ms(10);
  sample fin = *take(&ss, p.pid, total, pc.allow, "final");
  /* The training made progress while the churn ran, and was not over.
   * (Steps are released in proportion to the churn's connections, so on
   * a slow machine whose churn stops at CHURN_MAX_S fewer are released:
   * any progress counts, not a fixed half.) */
  int overlapped = tu_log_contains(&p, "step 10 applied") &&
                   !tu_log_contains(&p, "step 200 applied");

  /* Let the training finish (or, after a failure, end it: a psd that
   * misbehaved is killed first, so the workers fail fast). */
  for (int i = 0; i < NCHURN; i++)
    if (ch[i].failures && !why[0]) snprintf(why, sizeof why, "churn failed");
  if (why[0]) {
    tu_psd_kill(&p);
    __atomic_store_n(&pc.abort, 1, __ATOMIC_SEQ_CST);
  }
  __atomic_store_n(&pc.allow, STEPS, __ATOMIC_SEQ_CST);
  for (int i = 0; i < NW; i++) pthread_join(wth[i], NULL);
  ck_assert_msg(!why[0], "%s (log %s)%s\nsamples:%s", why, p.log_path,
                churn_failures(ch, NCHURN), format_samples(&ss));

  int conns = 0, errors = 0, refused = 0, silent = 0, by_kind[K_N] = {0};
  for (int i = 0; i < NCHURN; i++) {
    conns += ch[i].conns;
    errors += ch[i].errors;
    refused += ch[i].claims_refused;
    silent += ch[i].silent;
    for (int k = 0; k < K_N; k++) by_kind[k] += ch[i].by_kind[k];
  }
  tu_train *tp[NW] = {&pw[0].t, &pw[1].t};
  const char *bad = check_run(tp, &p, "run under churn");
  ck_assert_msg(!bad[0], "%s", bad);

  if (getenv("PS_TEST_VERBOSE")) {
    fprintf(stderr, "churn: %d connections (%d before the baseline), %d refused with an "
            "ERROR (%d claims of a real worker), %d silent closes; by kind:",
            conns, base_total, errors, refused, silent);
    for (int k = 0; k < K_N; k++) fprintf(stderr, " %s %d", KIND_NAMES[k], by_kind[k]);
    fprintf(stderr, "\nRSS %+ld KiB, data %+ld KiB, %+d fds from the baseline to the end "
            "(%.1f RSS bytes per connection)\nsamples:%s\n",
            fin.rss - base.rss, fin.data - base.data, fin.fds - base.fds,
            (double)(fin.rss - base.rss) * 1024.0 / (conns - base_total), format_samples(&ss));
  }

  ck_assert_msg(conns == total && conns >= TOTAL / 2,
                "too little churn: %d connections in %.0f s (wanted %d); samples:%s", conns,
                CHURN_MAX_S, TOTAL, format_samples(&ss));
  ck_assert_msg(refused >= 10 && silent >= 10 && by_kind[K_CLOSE] >= 10,
                "too little churn of some kinds: %d claims refused, %d silent closes, %d "
                "plain closes",
                refused, silent, by_kind[K_CLOSE]);
  ck_assert_msg(overlapped, "the training was not under way while the churn ran (log %s)",
                p.log_path);
  ck_assert_msg(base.rss > 0 && base.data > 0 && base.fds > 0 && fin.rss > 0 &&
                    fin.data > 0 && fin.fds > 0,
                "could not read psd's /proc entries; samples:%s", format_samples(&ss));
  ck_assert_msg(fin.fds <= base.fds + FD_SLACK,
                "psd's open descriptors went from %d (after warm-up) to %d, %.1f s after %d "
                "churn connections stopped: leaked descriptors; samples:%s",
                base.fds, fin.fds, SETTLE_S, conns - base_total, format_samples(&ss));
  ck_assert_msg(fin.rss - base.rss < MEM_SLACK_KIB && fin.data - base.data < MEM_SLACK_KIB,
                "psd's memory grew by %ld KiB resident, %ld KiB data segment over %d churn "
                "connections after warm-up (limit %ld KiB): a per-connection leak; samples:%s",
                fin.rss - base.rss, fin.data - base.data, conns - base_total, MEM_SLACK_KIB,
                format_samples(&ss));
  ck_assert_msg(log_count(&p, " joined from ") == NW && log_count(&p, " rejoined from ") == 0,
                "psd accepted %d handshakes as a worker (only the %d real ones should be) "
                "(log %s)",
                log_count(&p, " joined from ") + log_count(&p, " rejoined from "), NW,
                p.log_path);

  if (!same_params(&pw[0].t, &ct[0]) || !same_params(&pw[1].t, &ct[0])) {
    /* Tell a psd bug from a harness mismatch: the paced worker on a clean
     * psd must reproduce the reference. */
    tu_train pt[NW];
    static paced pw2[NW];
    static pacer all;
    all.allow = STEPS;
    clean_run(pt, paced_worker, pw2, &all);
    ck_assert_msg(same_params(&pt[0], &ct[0]),
                  "harness: paced_worker no longer matches tu_train_worker on a clean psd "
                  "(W[0] %.9g vs %.9g)",
                  pt[0].W[0], ct[0].W[0]);
    ck_assert_msg(0,
                  "final parameters under churn differ from the clean run's (W[0] %.9g / "
                  "%.9g vs %.9g, b[0] %.9g vs %.9g) (log %s)",
                  pw[0].t.W[0], pw[1].t.W[0], ct[0].W[0], pw[0].t.b[0], ct[0].b[0],
                  p.log_path);
  }
}
END_TEST

Suite *suite_churn(void) {
  Suite *s = suite_create("churn");
  TCase *tc = tcase_create("churn");
  tcase_set_timeout(tc, 90);
  tcase_add_test(tc, test_connection_churn);
  suite_add_tcase(s, tc);
  return s;
}
