/* client.c - libpsclient's client handle: configuration (from a struct or
 * psrun's environment), connecting to every ps task and the handshake,
 * teardown, accessors. It is the top of the client's files: the rest live
 * by concept below it (see the file map in client_internal.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_internal.h"

static int getenv_int(const char *name, int required, int def, int lo, int hi, int *out,
                      char *err, size_t errlen) {
  const char *v = getenv(name);
  if (!v || !*v) {
    if (required) {
      snprintf(err, errlen, "environment variable %s is not set (psrun sets it)", name);
      return PS_EINVAL;
    }
    *out = def;
    return 0;
  }
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || *end || end == v || x < lo || x > hi) {
    snprintf(err, errlen, "environment variable %s='%s' is not an integer from %d to %d", name,
             v, lo, hi);
    return PS_EINVAL;
  }
  *out = (int)x;
  return 0;
}

/* A wire dtype from the environment ("f32", "bf16", "fp16"; unset: def). */
static int getenv_dtype(const char *name, ps_wire_dtype def, ps_wire_dtype *out, char *err,
                        size_t errlen) {
  static const char *const names[] = {"f32", "bf16", "fp16"}; /* by ps_wire_dtype */
  const char *v = getenv(name);
  *out = def;
  if (!v || !*v) return 0;
  for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
    if (strcmp(v, names[i]) == 0) {
      *out = (ps_wire_dtype)i;
      return 0;
    }
  snprintf(err, errlen, "environment variable %s='%s' is not f32, bf16 or fp16", name, v);
  return PS_EINVAL;
}

/* The wire dtypes of PS_WIRE_DTYPE, then PS_WIRE_PUSH_DTYPE and
 * PS_WIRE_PULL_DTYPE over it. */
static int env_dtypes(ps_config *cfg, char *err, size_t errlen) {
  ps_wire_dtype both = PS_WIRE_F32;
  int rc = getenv_dtype("PS_WIRE_DTYPE", PS_WIRE_F32, &both, err, errlen);
  if (!rc) rc = getenv_dtype("PS_WIRE_PUSH_DTYPE", both, &cfg->push_dtype, err, errlen);
  if (!rc) rc = getenv_dtype("PS_WIRE_PULL_DTYPE", both, &cfg->pull_dtype, err, errlen);
  return rc;
}

int ps_client_create_from_env(ps_client **out, char *errmsg, size_t errlen) {
  char e[512];
  *out = NULL;
  ps_config cfg;
  ps_config_init(&cfg);
  const char *hosts = getenv("PS_HOSTS");
  if (!hosts || !*hosts) {
    if (errmsg) snprintf(errmsg, errlen, "environment variable PS_HOSTS is not set (psrun sets it)");
    return PS_EINVAL;
  }
  int rc = getenv_int("PS_WORKER_INDEX", 1, 0, 0, 1 << 20, &cfg.worker_index, e, sizeof e);
  if (!rc) rc = getenv_int("PS_NUM_WORKERS", 1, 0, 1, 1 << 20, &cfg.num_workers, e, sizeof e);
  if (!rc)
    rc = getenv_int("PS_REPLICAS_TO_AGGREGATE", 0, 0, 0, 1 << 20, &cfg.replicas_to_aggregate,
                    e, sizeof e);
  if (!rc) rc = getenv_int("PS_ASYNC", 0, 0, 0, 1, &cfg.async_mode, e, sizeof e);
  if (!rc)
    rc = getenv_int("PS_CONNECT_TIMEOUT_MS", 0, 0, 0, 1 << 30, &cfg.connect_timeout_ms, e,
                    sizeof e);
  if (!rc)
    rc = getenv_int("PS_REQUEST_TIMEOUT_MS", 0, 0, 0, 1 << 30, &cfg.request_timeout_ms, e,
                    sizeof e);
  /* Placement inputs: every worker of a job must give the same values. */
  int slice = 0, split = 0;
  if (!rc)
    rc = getenv_int("PS_MAX_SLICE_BYTES", 0, 0, 0, (int)PS__MAX_SLICE_BYTES, &slice, e, sizeof e);
  if (!rc) rc = getenv_int("PS_SPLIT_THRESHOLD", 0, 0, 0, 1 << 30, &split, e, sizeof e);
  cfg.max_slice_bytes = (uint64_t)slice;
  cfg.split_threshold = (uint64_t)split;
  if (!rc) rc = env_dtypes(&cfg, e, sizeof e);
  if (rc) {
    if (errmsg) snprintf(errmsg, errlen, "%s", e);
    return rc;
  }
  cfg.telemetry = getenv("PS_TELEMETRY"); /* psrun --telemetry */
  int signals = 1;
  rc = getenv_int("PS_SIGNALS", 0, 1, 0, 1, &signals, e, sizeof e);
  if (rc) {
    if (errmsg) snprintf(errmsg, errlen, "%s", e);
    return rc;
  }
  cfg.no_signal_handlers = !signals; /* PS_SIGNALS=0: the application's choice */
  const char *secret = getenv("PS_SECRET"); /* psrun's per-run secret */
  if (secret && *secret) {
    cfg.credential = secret;
    cfg.credential_len = strlen(secret);
  }
  int munge = 0;
  rc = getenv_int("PS_MUNGE", 0, 0, 0, 1, &munge, e, sizeof e);
  if (!rc && munge) {
    const char *j = getenv("PS_JOB_ID"), *st = getenv("PS_STEP_ID");
    char *end;
    cfg.munge = 1;
    cfg.munge_socket = getenv("PS_MUNGE_SOCKET");
    if (!j || !*j || (cfg.job_id = strtoll(j, &end, 10), *end)) {
      snprintf(e, sizeof e, "PS_MUNGE=1 needs PS_JOB_ID (got '%s')", j ? j : "");
      rc = PS_EINVAL;
    }
    cfg.step_id = st && *st ? strtoll(st, &end, 10) : -1;
  }
  if (rc) {
    if (errmsg) snprintf(errmsg, errlen, "%s", e);
    return rc;
  }
  char *copy = strdup(hosts);
  const char *list[4096];
  int n = 0;
  for (char *save = NULL, *tok = copy ? strtok_r(copy, ",", &save) : NULL; tok;
       tok = strtok_r(NULL, ",", &save)) {
    if (n == 4096) break;
    list[n++] = tok;
  }
  if (n == 0) {
    free(copy);
    if (errmsg) snprintf(errmsg, errlen, "PS_HOSTS='%s' lists no host:port", hosts);
    return PS_EINVAL;
  }
  cfg.hosts = list;
  cfg.num_ps = n;
  rc = ps_client_create(&cfg, out, errmsg, errlen);
  free(copy);
  return rc;
}

/* The configuration is usable: a sentence in errmsg when it is not. */
static int check_config(const ps_config *cfg, char *errmsg, size_t errlen) {
#define FAIL(code, ...)                                  \
  do {                                                   \
    if (errmsg) snprintf(errmsg, errlen, __VA_ARGS__);   \
    return code;                                         \
  } while (0)
  if (!cfg || !cfg->hosts || cfg->num_ps < 1) FAIL(PS_EINVAL, "config needs at least one ps host");
  if (cfg->num_workers < 1 || cfg->worker_index < 0 || cfg->worker_index >= cfg->num_workers)
    FAIL(PS_EINVAL, "worker index %d must be in [0, num_workers %d)", cfg->worker_index,
         cfg->num_workers);
  if (cfg->replicas_to_aggregate < 0 || cfg->replicas_to_aggregate > cfg->num_workers)
    FAIL(PS_EINVAL, "replicas_to_aggregate %d must be in [0, num_workers %d]",
         cfg->replicas_to_aggregate, cfg->num_workers);
  if (!ps__dtype_valid((uint32_t)cfg->push_dtype) ||
      !ps__dtype_valid((uint32_t)cfg->pull_dtype))
    FAIL(PS_EINVAL, "wire dtypes push %d, pull %d: each must be PS_WIRE_F32, PS_WIRE_BF16 or "
         "PS_WIRE_FP16", cfg->push_dtype, cfg->pull_dtype);
  if (cfg->max_slice_bytes > PS__MAX_SLICE_BYTES)
    FAIL(PS_EINVAL, "max_slice_bytes %llu exceeds the server limit %llu",
         (unsigned long long)cfg->max_slice_bytes, (unsigned long long)PS__MAX_SLICE_BYTES);
  for (int i = 0; i < cfg->num_ps; i++) {
    char h[256];
    int p;
    if (!cfg->hosts[i] || ps__parse_hostport(cfg->hosts[i], h, sizeof h, &p))
      FAIL(PS_EINVAL, "ps %d address '%s' is not host:port", i,
           cfg->hosts[i] ? cfg->hosts[i] : "(null)");
  }
#undef FAIL
  return 0;
}

/* Copies the configuration into c and allocates its tables (no I/O). */
static int client_setup(ps_client *c, const ps_config *cfg) {
  c->num_ps = cfg->num_ps;
  c->worker_index = cfg->worker_index;
  c->num_workers = cfg->num_workers;
  c->replicas = cfg->replicas_to_aggregate;
  c->async_mode = cfg->async_mode != 0;
  c->push_dtype = (uint32_t)cfg->push_dtype;
  c->pull_dtype = (uint32_t)cfg->pull_dtype;
  c->transport = cfg->transport;
  if (c->transport == PS_TRANSPORT_DEFAULT) {
    const char *t = getenv("PS_TRANSPORT"); /* psrun --transport, the test suites */
    c->transport = !t || !*t || !strcmp(t, "auto") ? PS_TRANSPORT_AUTO
                   : !strcmp(t, "tcp")             ? PS_TRANSPORT_TCP
                   : !strcmp(t, "shm")             ? PS_TRANSPORT_SHM
                                                   : -1;
    if (c->transport < 0)
      return ps__seterr(c, PS_EINVAL, "PS_TRANSPORT='%.100s' is not auto, tcp or shm", t);
  } else if (c->transport < PS_TRANSPORT_AUTO || c->transport > PS_TRANSPORT_SHM) {
    return ps__seterr(c, PS_EINVAL, "ps_config.transport %d is not a ps_transport",
                      cfg->transport);
  }
  c->connect_timeout_ms = cfg->connect_timeout_ms > 0 ? cfg->connect_timeout_ms : PS__DEFAULT_CONNECT_MS;
  c->request_timeout_ms = cfg->request_timeout_ms > 0 ? cfg->request_timeout_ms : PS__DEFAULT_REQUEST_MS;
  c->conns = calloc((size_t)c->num_ps, sizeof *c->conns);
  c->by_remote = calloc((size_t)c->num_ps, sizeof *c->by_remote);
  if (!c->conns || !c->by_remote) return PS_ENOMEM;
  for (int i = 0; i < c->num_ps; i++) {
    c->conns[i].fd = -1; /* before any failure */
    c->conns[i].out.keep_recent = 1; /* a step's table pushes reuse their buffer */
  }
  if (cfg->credential_len) {
    c->cred = malloc(cfg->credential_len);
    if (!c->cred) return PS_ENOMEM;
    memcpy(c->cred, cfg->credential, cfg->credential_len);
    c->cred_len = cfg->credential_len;
  }
  c->munge = cfg->munge != 0;
  c->job_id = cfg->job_id;
  c->step_id = cfg->step_id;
  if (cfg->munge_socket && !(c->munge_socket = strdup(cfg->munge_socket))) return PS_ENOMEM;
  int rc = ps__placer_init(&c->placer, (uint32_t)c->num_ps, cfg->split_threshold,
                           cfg->max_slice_bytes);
  if (rc) return ps__seterr(c, rc, "bad placement thresholds");
  rc = ps__telem_init(&c->telem, cfg->telemetry, c->worker_index, c->num_ps, c->errmsg,
                      sizeof c->errmsg);
  if (rc) return rc;
  for (int i = 0; i < c->num_ps; i++) {
    ps__conn *k = &c->conns[i];
    k->index = i;
    snprintf(k->addr, sizeof k->addr, "%s", cfg->hosts[i]);
    k->in_cap = PS__IN_INITIAL;
    k->in = malloc(k->in_cap);
    if (!k->in) return ps__seterr(c, PS_ENOMEM, "out of memory");
  }
  return 0;
}

/* The handshake on k (wire/handshake.c, blocking until the deadline): psd's
 * Challenge, our Hello with a proof bound to both nonces, and psd's
 * HelloReply whose proof we check, before the pump takes the connection.
 * *again: psd closed the connection during the handshake without saying
 * why (worth a fresh connection). */
static int conn_hello(ps_client *c, ps__conn *k, double deadline, int *again) {
  Ps__Hello h = PS__HELLO__INIT;
  char cid[128], hn[64] = "", who[400];
  gethostname(hn, sizeof hn - 1);
  snprintf(cid, sizeof cid, "(%s pid %d)", hn, (int)getpid());
  snprintf(who, sizeof who, "ps %d at %s", k->index, k->addr);
  h.protocol_version = PS__PROTOCOL_VERSION;
  h.role = PS__ROLE__ROLE_WORKER;
  h.worker_index = (uint32_t)c->worker_index;
  h.num_workers = (uint32_t)c->num_workers;
  h.num_ps = (uint32_t)c->num_ps;
  h.ps_index = (uint32_t)k->index;
  h.replicas_to_aggregate = (uint32_t)c->replicas;
  h.async_mode = c->async_mode;
  h.client_id = cid;
  h.split_threshold = c->placer.split_threshold;
  h.max_slice_bytes = c->placer.max_slice_bytes;
  ps__auth au = {c->cred, c->cred_len, c->munge, c->munge_socket, c->job_id, c->step_id};
  Ps__HelloReply *r = NULL;
  char err[700];
  int rc = ps__handshake(k->fd, &au, &h, who, deadline, &r, err, sizeof err);
  *again = rc == PS_ECLOSED; /* closed without an Error: shed, not refused */
  if (rc) return ps__seterr(c, rc, "%s", err);
  if (r->checkpoints) c->checkpoints = 1;
  k->minor = r->protocol_minor;
  rc = ps__shm_setup(c, k, r, deadline);
  ps__telem_transport(&c->telem, k->index, k->shm.map != NULL);
  ps__hello_reply__free_unpacked(r, NULL);
  return rc;
}

/* psrun's stop note pipe (PS_STOP_NOTE_FD): written once the job stopped at
 * a checkpoint (trainstep.c), so that psrun counts this worker's exit, whatever
 * its status, as a stop. A private close-on-exec copy; the inherited one
 * becomes close-on-exec too (the worker's own children must not hold it).
 * -1 when absent or not a pipe (the program closed and reused the fd). */
static int note_fd_from_env(void) {
  const char *v = getenv("PS_STOP_NOTE_FD");
  char *end = NULL;
  long fd = v ? strtol(v, &end, 10) : -1;
  struct stat st;
  if (!v || *end || fd < 3 || fd > INT_MAX || fstat((int)fd, &st) != 0 ||
      !S_ISFIFO(st.st_mode))
    return -1;
  fcntl((int)fd, F_SETFD, FD_CLOEXEC);
  return fcntl((int)fd, F_DUPFD_CLOEXEC, 3);
}

/* Connects to ps k and completes the handshake. A handshake psd closed
 * without an Error frame (it shed our connection for a newer one at its
 * connection caps under a flood, or every slot was authenticated) is tried
 * again on a fresh connection, with backoff, until the connect deadline;
 * a line on stderr says so (the first time, then every PS__CONNECT_LOG_S).
 * A refusal psd explains (an Error: wrong secret, another job) is final. */
static int conn_open(ps_client *c, ps__conn *k, double deadline) {
  ps__backoff b;
  ps__backoff_init(&b, PS__HANDSHAKE_RETRY_FIRST_S, PS__HANDSHAKE_RETRY_MAX_S);
  double logged = 0;
  for (;;) {
    int again = 0, rc = ps__conn_connect(c, k, deadline);
    if (rc == 0) rc = conn_hello(c, k, deadline + PS__HANDSHAKE_S, &again);
    if (!again) return rc;
    close(k->fd);
    k->fd = -1;
    double now = ps__now();
    if (now - logged >= PS__CONNECT_LOG_S) {
      fprintf(stderr, "psclient: worker %d: %s; trying again (attempt %d, within the %.0f s "
              "connect timeout)\n", c->worker_index, c->errmsg, b.tries + 2,
              c->connect_timeout_ms / 1000.0);
      logged = now;
    }
    if (ps__backoff_sleep(&b, deadline) < 0) return rc;
  }
}

int ps_client_create(const ps_config *user, ps_client **out, char *errmsg, size_t errlen) {
  *out = NULL;
  /* From here on, the library's own layout with defaults past the
   * caller's struct_size. */
  ps_config full, *cfg = NULL;
  if (user) {
    char e[300];
    ps_config_init(&full);
    int rc = ps__sized_read(&full, sizeof full, user, PS__CONFIG_V1_SIZE, "ps_config", e,
                            sizeof e);
    if (rc) {
      if (errmsg) snprintf(errmsg, errlen, "%s", e);
      return rc;
    }
    cfg = &full;
  }
  int rc = check_config(cfg, errmsg, errlen);
  if (rc) return rc;
  signal(SIGPIPE, SIG_IGN);
  ps_client *c = calloc(1, sizeof *c);
  if (!c) {
    if (errmsg) snprintf(errmsg, errlen, "out of memory for the client");
    return PS_ENOMEM;
  }
  /* Without it ps_client_wake fails and bounded waits simply run out. */
  c->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  c->note_fd = note_fd_from_env();
  if ((rc = client_setup(c, cfg)) != 0) goto fail;
  double deadline = ps__now() + c->connect_timeout_ms / 1000.0;
  for (int i = 0; i < c->num_ps; i++)
    if ((rc = conn_open(c, &c->conns[i], deadline)) != 0) goto fail;
  ps__telem_idle(&c->telem, ps__now());
  /* Only a client that exists holds them: a failed create leaves the
   * signals as they were. */
  if (!cfg->no_signal_handlers) {
    ps__signals_hold();
    c->signals = 1;
  }
  *out = c;
  return 0;
fail:
  if (errmsg) snprintf(errmsg, errlen, "%s", c->errmsg[0] ? c->errmsg : ps_strerror(rc));
  ps_client_destroy(c);
  return rc;
}

void ps_client_close(ps_client *c) {
  if (!c) return;
  for (int i = 0; c->conns && i < c->num_ps; i++)
    ps__conn_break(c, &c->conns[i], PS_ECLOSED, "closed by ps_client_close");
}

int ps_client_wake(ps_client *c) {
  if (!c || c->wake_fd < 0) return PS_EINVAL;
  uint64_t one = 1;
  /* Async-signal-safe and thread-safe: only this write touches c. A full
   * counter (2^64 - 2 wakes unread) already wakes the wait. */
  ssize_t n = write(c->wake_fd, &one, sizeof one);
  (void)n;
  return 0;
}

void ps_client_destroy(ps_client *c) {
  if (!c) return;
  if (c->wake_fd >= 0) close(c->wake_fd);
  if (c->note_fd >= 0) close(c->note_fd);
  if (c->signals) ps__signals_release();
  for (int i = 0; c->conns && i < c->num_ps; i++) ps__conn_free(&c->conns[i]);
  free(c->conns);
  ps__vars_free(c);
  ps__tables_free(c);
  ps__remote_free(c);
  ps__req_free_all(c);
  ps__placer_free(&c->placer);
  free(c->early);
  free(c->rest);
  free(c->ids);
  free(c->items);
  free(c->itemp);
  free(c->segdata);
  free(c->segcount);
  free(c->cred);
  free(c->munge_socket);
  ps__telem_free(&c->telem);
  free(c);
}

int ps_client_worker_index(const ps_client *c) { return c->worker_index; }
int ps_client_num_workers(const ps_client *c) { return c->num_workers; }
int ps_client_num_ps(const ps_client *c) { return c->num_ps; }

const char *ps_client_transport(const ps_client *c, int ps_index) {
  if (!c || ps_index < 0 || ps_index >= c->num_ps) return NULL;
  return c->conns[ps_index].shm.map ? "shm" : "tcp";
}
