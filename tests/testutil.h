/* Shared helpers for the test suites: start real psd processes on
 * 127.0.0.1, wait for them, read their logs. */
#ifndef PS_TESTUTIL_H
#define PS_TESTUTIL_H

#include <check.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "psclient.h"

/* Suite constructors (test_<name>.c). A constructor returns NULL when the
 * suite cannot run here (a dependency is not installed), after printing
 * "SKIP: <suite>: <why>"; the runner then exits 77, which ctest reports as
 * skipped. */
Suite *suite_frame(void);
Suite *suite_half(void);
Suite *suite_util(void);
Suite *suite_wfile(void);
Suite *suite_mac(void);
Suite *suite_placement(void);
Suite *suite_init(void);
Suite *suite_api(void);
Suite *suite_wiredtype(void);
Suite *suite_tables(void);
Suite *suite_tables_hostile(void);
Suite *suite_waits(void);
Suite *suite_stop(void);
Suite *suite_optimizer(void);
Suite *suite_average(void);
Suite *suite_config(void);
Suite *suite_opt(void);
Suite *suite_rendezvous(void);
Suite *suite_sync(void);
Suite *suite_lifecycle(void);
Suite *suite_hostile(void);
Suite *suite_layout(void);
Suite *suite_psrun(void);
Suite *suite_psrun_slurm(void);
Suite *suite_psrun_flood(void);
Suite *suite_cnn(void);
Suite *suite_cnn_dev(void);
Suite *suite_cifar_data(void);
Suite *suite_cifar(void);
Suite *suite_churn(void);
Suite *suite_auth(void);
Suite *suite_checkpoint(void);
Suite *suite_checkpoint_users(void);
Suite *suite_table_ckpt(void);
Suite *suite_persist(void);
Suite *suite_persist_users(void);
Suite *suite_soak(void);
Suite *suite_telemetry(void);
Suite *suite_pace(void);
Suite *suite_waiters(void);
Suite *suite_shard(void);
Suite *suite_table(void);
Suite *suite_tmemo(void);
Suite *suite_par(void);
Suite *suite_memlimit(void);
Suite *suite_bounds(void);
Suite *suite_admission(void);
Suite *suite_cuda_ops(void);
Suite *suite_prefetch(void);
Suite *suite_ctr(void);
Suite *suite_shm(void);
Suite *suite_shm_hostile(void);
Suite *suite_shm_users(void);
Suite *suite_faultsim(void);

/* A psd child process. */
typedef struct tu_psd {
  pid_t pid;            /* 0 once reaped */
  int status;           /* wait status once reaped */
  char addr[64];        /* "127.0.0.1:PORT" read from its port file */
  char log_path[512];   /* its stdout+stderr */
  char port_file[512];  /* where it wrote addr */
} tu_psd;

/* If set, psd processes started afterwards get it as LD_PRELOAD. */
extern const char *tu_psd_preload;
/* Sets tu_psd_preload to a shim (NULL: none), telling a sanitized psd that
 * the shim may come before ASan's runtime (verify_asan_link_order=0 in
 * ASAN_OPTIONS, which other builds ignore). */
void tu_psd_set_preload(const char *so);
/* If set, psd processes started afterwards get it as PSD_SECRET. */
extern const char *tu_psd_secret;
/* Starts $PSD_BIN --host 127.0.0.1 --port 0 --port-file F [--transport
 * $PS_TRANSPORT, unless args give one] plus args
 * (NULL-terminated) and waits (10 s) for the port file. 0 or -1. */
int tu_psd_start(tu_psd *p, const char *const *args);
/* Waits up to timeout_s for exit; 0 and p->status set, or -1 on timeout. */
int tu_psd_wait(tu_psd *p, double timeout_s);
/* SIGKILLs and reaps if still running. */
void tu_psd_kill(tu_psd *p);
/* 1 if the psd's log contains needle. */
int tu_log_contains(const tu_psd *p, const char *needle);
/* How often needle occurs in the psd's log ("\n": its lines). */
int tu_log_count(const tu_psd *p, const char *needle);
/* Whole file, NUL-terminated, malloc'd (NULL if unreadable). */
char *tu_read_file(const char *path);
/* A "Field:  N kB" line of /proc/PID/status ("VmRSS:", "VmHWM:"...): N,
 * or -1 if unreadable. */
long tu_vm_kib(pid_t pid, const char *field);
/* Field n of /proc/PID/stat as proc(5) numbers them (n >= 3: 10 minflt,
 * 14 utime, 15 stime, in clock ticks), or -1 if unreadable. */
long long tu_proc_stat(pid_t pid, int n);
/* A fresh private directory for this test process. */
const char *tu_tmpdir(void);
/* Raw sockets for hostile-peer tests. tu_connect: TCP to "host:port" with
 * 3 s send/receive (and connect) timeouts and TCP_NODELAY; fd, or -1 with
 * errno set. */
int tu_connect(const char *addr);
/* tu_send_all: 0, or -1 if the peer is gone or the
 * send failed (never raises SIGPIPE). */
int tu_send_all(int fd, const void *buf, size_t n);
/* Reads (keeping the first cap bytes) until the peer closes or timeout_s
 * passes. 1 on EOF (a reset counts: the server closed with our bytes
 * unread), 0 on timeout; *n gets the bytes kept, less psd's Challenge at
 * the front (the first frame of every connection). */
int tu_read_until_eof(int fd, uint8_t *buf, size_t cap, double timeout_s, size_t *n);
/* Fills hosts[i] (each of 64 bytes) with the addresses of ps[0..n). */
void tu_hosts(const tu_psd *ps, int n, char hosts[][64], const char **ptrs);

/* A client for worker `index` of `nw` over hosts[0..nps) (replicas 0: all
 * workers; request_ms 0: the default), telemetry off, no signal handlers;
 * NULL with the reason in err when it cannot be created. */
ps_client *tu_client_try(const char *const *hosts, int nps, int index, int nw, int replicas,
                         int request_ms, char *err, size_t errlen);
/* The same, failing the test when it cannot be created. */
ps_client *tu_client(const char *const *hosts, int nps, int index, int nw, int replicas,
                     int request_ms);

/* Seed of a random test: $PS_TEST_SEED when set (to replay a run), else
 * drawn from the clock; printed as "<what>: seed N (PS_TEST_SEED=N replays
 * it)" so every run can be repeated. */
unsigned tu_seed(const char *what);

/* ---- programs of the build, run for real (the psrun suites) ------------- */

/* Path of program name in the directory of the running test executable
 * (build/bin); the last 8 results stay valid. */
const char *tu_bin(const char *name);
/* Runs argv with env entries ("NAME=value", NULL-terminated, may be NULL)
 * added, stdout and stderr into a fresh file whose path goes to out.
 * Returns the pid. */
pid_t tu_spawn(char *const *argv, char *const *env, char *out, size_t outlen);
/* Waits up to timeout_s for pid: 0 with *status, or -1 after killing it. */
int tu_wait_pid(pid_t pid, double timeout_s, int *status);
/* Waits up to timeout_s until file holds needle: 0, or -1. */
int tu_wait_text(const char *file, const char *needle, double timeout_s);
/* The uid and gid of the other user the tests act as (nobody). */
#define TU_NOBODY 65534
/* An upper bound on elapsed time, `seconds` as measured on an idle
 * machine, times PS_TEST_TIME_SCALE (default 1; a number from 1 to 100)
 * for a loaded machine or a sanitized build. Lower bounds (a wait that
 * must last at least its timeout) are not scaled. */
double tu_time_limit(double seconds);

/* Whether this process may act as another user (nobody): root with
 * setpriv. The suites add the tests that need it only then, else they
 * report them with tu_skip_tests. */
int tu_can_be_another_user(void);
/* Tests a suite leaves out because something they need is missing: prints
 * "SKIP: SUITE: TESTS: WHY" and counts them; the runner then exits 77
 * (skipped) once the rest passed, never 0 (a failure still exits 1). A
 * test never exits 77 itself: Check counts that as an error in fork mode
 * and, without fork, it would end the suite and hide earlier results. */
void tu_skip_tests(const char *suite, const char *tests, const char *why);
/* How many tu_skip_tests calls this process made. */
int tu_skipped(void);

/* Worker scripts (sh -c, tiny_worker in $TW) the psrun suites share.
 * Worker 1 trains 20 steps, then is killed by SIGABRT; the others train 200. */
#define TU_ABORT_W1                                                                             \
  "ulimit -c 0; if [ \"$PS_WORKER_INDEX\" = 1 ]; then \"$TW\" --steps 200 --sleep-ms 5 "       \
  "--fail-at-step 20; kill -ABRT $$; fi; exec \"$TW\" --steps 200 --sleep-ms 5"
/* Worker 1 fails at step 20 the first time only ($MARKER); every worker
 * trains to step 200 of the job. */
#define TU_FAIL_W1_ONCE                                                                         \
  "if [ \"$PS_WORKER_INDEX\" = 1 ] && ! [ -e \"$MARKER\" ]; then touch \"$MARKER\"; "          \
  "exec \"$TW\" --steps 200 --sleep-ms 5 --fail-at-step 20; fi; "                              \
  "exec \"$TW\" --steps 200 --sleep-ms 5"
/* Workers 1 and 2 exit 0 without ps_client_finish (worker 1 at step 20,
 * worker 2 after its 200 steps); worker 0 finishes. */
#define TU_TWO_SKIP_FINISH                                                                      \
  "case $PS_WORKER_INDEX in 1) \"$TW\" --steps 200 --sleep-ms 5 --fail-at-step 20; exit 0;; "  \
  "2) exec \"$TW\" --steps 200 --sleep-ms 5 --skip-finish 1;; esac; exec \"$TW\" --steps 200"

/* A private munged (own key and socket under tu_tmpdir()): its socket, or
 * NULL with the reason in why. Started once per test process. */
const char *tu_munged_start(char *why, size_t whylen);
void tu_munged_stop(void);

/* ---- a small real model: multinomial logistic regression ---------------- */
#define TU_D 8 /* features */
#define TU_C 3 /* classes */

/* Sample i of a fixed synthetic, learnable dataset. */
void tu_sample(uint64_t i, float x[TU_D], int *y);
/* Mean softmax cross-entropy gradient over samples [first, first+n), at
 * parameters W (D x C, row-major) and b; returns the mean loss. */
float tu_grad(const float *W, const float *b, uint64_t first, uint64_t n, float *gW,
              float *gb);
/* Fraction of samples [first, first+n) classified right. */
float tu_accuracy(const float *W, const float *b, uint64_t first, uint64_t n);

/* One worker of a training run (a thread entry: tu_train_worker(arg)). */
typedef struct tu_train {
  const char *const *hosts; /* ps addresses */
  int num_ps, num_workers, worker, replicas, async_mode;
  int steps;                /* ps_client_step calls */
  int batch;                /* samples per worker per step */
  int slow;                 /* push only after the others finished the step,
                               until they reach `steps` */
  uint64_t split_threshold, max_slice_bytes; /* 0: defaults */
  volatile int *gate;       /* if set: slow workers open it once ready,
                               the others wait for it before training */
  uint64_t until;           /* if set: train until the step reaches it
                               (instead of `steps` calls; resumes count) */
  int delay_us;             /* sleep this long per step (compute time) */
  volatile uint64_t *progress; /* if set: the step after each ps_client_step
                                  (memory shared with the test's process) */
  int skip_finish;          /* leave without ps_client_finish, as a killed
                               worker does (psd counts it lost until a new
                               client of its index rejoins) */
  int stopped;              /* result: the job stopped on request
                               (PS_ESTOPPED; finish was still called) */
  const ps_optimizer *opt_w, *opt_b; /* W's and b's rules; NULL: tu_model_opts */
  /* results */
  float W[TU_D * TU_C], b[TU_C];
  float avg_W[TU_D * TU_C], avg_b[TU_C]; /* the servers' moving averages after
                                            the last step, when opt_w and
                                            opt_b both keep one; else 0 */
  int stale;                /* stale pushes seen */
  int pushes;               /* pushes made (slow mode) */
  int rc;                   /* first error (0 if none) */
  char err[512];
  uint64_t final_step;
} tu_train;
void *tu_train_worker(void *arg);
/* Exact float32 comparison of two workers' final parameters. */
int tu_params_equal(const tu_train *a, const tu_train *b);
/* The optimizers the test model uses (server side), and a local reference
 * applying the same rules: W plain SGD lr 0.5, b momentum 0.9 lr 0.1. */
void tu_model_opts(ps_optimizer *ow, ps_optimizer *ob);
void tu_model_init(float *W, float *b);

/* The value of NAME in an `env` dump (text, each line NAME=VALUE after a
 * newline), or "" when it is not set; written to out. */
const char *tu_env_of(const char *text, const char *name, char *out, size_t len);

#endif /* PS_TESTUTIL_H */
