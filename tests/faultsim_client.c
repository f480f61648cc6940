/* faultsim_client - the client scenario of the faultsim suite
 * (test_faultsim.c), against one psd: create a client; as the chief,
 * create two variables and a table, pull, push and pull a step by hand
 * (the table's rows too), then a step through ps_client_step with the
 * table's gradients, and a pull; or, as another worker, a table's pull,
 * step and push only; finish, destroy. Every call must return 0 or a
 * negative PS_E* code with a message; the scenario stops at the first
 * that fails (then finishes and destroys the client all the same).
 *
 *   faultsim_client run ADDR TAG WORKER WORKERS chief|tables
 *     runs it once as worker WORKER of WORKERS (replicas 1; names end in
 *     TAG); exit 0 when every call succeeded, 1 otherwise, naming the
 *     call ("BAD:" when it did not fail cleanly).
 *   faultsim_client sweep PSD_BIN FIRST STRIDE COUNT
 *     with faultsim.so preloaded: a run that only numbers the allocations
 *     (T of them, printed), then for N = FIRST, FIRST + STRIDE, ... <= T
 *     a run (in a child process, against a fresh psd) whose N-th
 *     allocation fails, and the next COUNT - 1 with it. Each must end in
 *     a clean error: no crash or hang, PS_ENOMEM from the call whose
 *     allocation failed (a later call may fail otherwise), a message
 *     set, nothing the scenario allocated still live after destroy.
 *     Exit 0 when all were clean, 1 naming those that were not. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "psclient.h"

#define TABLE_DIM 4
#define NKEYS 4
#define WATCHDOG_S 60 /* a run that takes longer hangs */

typedef void (*arm_fn)(unsigned long, unsigned long);
typedef void (*stats_fn)(unsigned long *, unsigned long *, long *);
typedef void (*disarm_fn)(void);
static arm_fn g_arm;
static stats_fn g_stats;
static disarm_fn g_disarm;

/* Allocations failed so far (0 without the shim). */
static unsigned long failed_now(void) {
  unsigned long counted = 0, failed = 0;
  long live = 0;
  if (g_stats) g_stats(&counted, &failed, &live);
  return failed;
}

/* How a run went: the first call that failed (NULL: none), its code, and
 * whether an allocation failed inside it; a problem the sweep reports. */
typedef struct outcome {
  const char *call;
  int rc, during;
  char msg[512];
  char bad[768];
} outcome;

/* Records call's result; 0 to go on, -1 once something failed. */
static int check(outcome *o, const char *call, int rc, unsigned long before, const char *msg) {
  if (rc == 0) return 0;
  o->call = call;
  o->rc = rc;
  o->during = failed_now() > before;
  snprintf(o->msg, sizeof o->msg, "%s", msg ? msg : "");
  if (rc > 0 || strcmp(ps_err_name(rc), "PS_UNKNOWN") == 0)
    snprintf(o->bad, sizeof o->bad, "%s returned %d, not a PS_E* code", call, rc);
  else if (!o->msg[0])
    snprintf(o->bad, sizeof o->bad, "%s returned %s with no message", call, ps_err_name(rc));
  else if (o->during && rc != PS_ENOMEM)
    snprintf(o->bad, sizeof o->bad, "%s returned %s (not PS_ENOMEM) when an allocation failed: %s",
             call, ps_err_name(rc), o->msg);
  return -1;
}

#define CALL(o, name, expr)                                                                  \
  do {                                                                                       \
    unsigned long before_ = failed_now();                                                    \
    if (check(o, name, (expr), before_, ps_client_errmsg(c)) != 0) return;                   \
  } while (0)

static const ps_table_config *table_config(void) {
  static ps_table_config tc;
  ps_table_config_init(&tc);
  tc.dim = TABLE_DIM;
  tc.capacity = 64;
  tc.opt = PS_TOPT_ADAGRAD;
  tc.lr = 0.1;
  return &tc;
}

/* One synchronous exchange of a request: wait, release. */
static int wait_req(ps_req *r) {
  int rc = ps_req_wait(r, -1, NULL);
  ps_req_destroy(r);
  return rc;
}

/* The variables and a table, as the chief: create, pull, push and pull
 * step 0 by hand, then a step through ps_client_step. */
static void chief_steps(ps_client *c, const char *tag, outcome *o) {
  char wname[64], bname[64], tname[64];
  snprintf(wname, sizeof wname, "w.%s", tag);
  snprintf(bname, sizeof bname, "b.%s", tag);
  snprintf(tname, sizeof tname, "t.%s", tag);
  int64_t ws[2] = {16, 4}, bs[1] = {4};
  ps_init glorot = PS_SIZED(ps_init, .kind = PS_INIT_GLOROT_UNIFORM, .seed = 3);
  ps_optimizer adam, sgd;
  ps_optimizer_default(&adam, 0.01);
  adam.kind = PS_OPT_ADAM;
  ps_optimizer_default(&sgd, 0.1);
  ps_var *w = NULL, *b = NULL;
  ps_table *t = NULL;
  ps_req *r = NULL;
  uint64_t step = 0;
  CALL(o, "ps_client_var_create", ps_client_var_create(c, wname, ws, 2, &glorot, &adam, &w));
  CALL(o, "ps_client_var_create", ps_client_var_create(c, bname, bs, 1, NULL, &sgd, &b));
  CALL(o, "ps_client_table_create", ps_client_table_create(c, tname, table_config(), &t));
  CALL(o, "ps_client_pull", ps_client_pull(c, 0, &step));
  uint64_t keys[NKEYS] = {1, 5, 9, 5};
  float rows[NKEYS * TABLE_DIM], grads[NKEYS * TABLE_DIM];
  for (int i = 0; i < NKEYS * TABLE_DIM; i++) grads[i] = 0.5f;
  CALL(o, "ps_table_pull", ps_table_pull(t, step, keys, NKEYS, rows, 0, NULL));
  for (size_t i = 0; i < ps_var_numel(w); i++) ps_var_grad(w)[i] = 0.01f * (float)i;
  for (size_t i = 0; i < ps_var_numel(b); i++) ps_var_grad(b)[i] = 1.0f;
  CALL(o, "ps_client_push_async", ps_client_push_async(c, step, NULL, 0, &r));
  CALL(o, "ps_req_wait (push)", wait_req(r));
  CALL(o, "ps_table_push_async", ps_table_push_async(t, step, keys, NKEYS, grads, &r));
  CALL(o, "ps_req_wait (table push)", wait_req(r));
  CALL(o, "ps_client_pull_async", ps_client_pull_async(c, step + 1, NULL, 0, &r));
  CALL(o, "ps_req_wait (pull)", wait_req(r));
  step++;
  CALL(o, "ps_table_pull", ps_table_pull(t, step, keys, NKEYS, rows, 0, NULL));
  CALL(o, "ps_table_add_grad", ps_table_add_grad(t, keys, NKEYS, grads));
  CALL(o, "ps_client_step", ps_client_step(c, &step, NULL));
  CALL(o, "ps_client_pull", ps_client_pull(c, 0, &step));
}

/* A table only (any worker): create, pull rows, a step with gradients,
 * a push of the next step by hand. */
static void table_steps(ps_client *c, const char *tag, outcome *o) {
  char tname[64];
  snprintf(tname, sizeof tname, "t.%s", tag);
  ps_table *t = NULL;
  ps_req *r = NULL;
  uint64_t step = 0;
  uint64_t keys[NKEYS] = {2, 7, 7, 11};
  float rows[NKEYS * TABLE_DIM], grads[NKEYS * TABLE_DIM];
  for (int i = 0; i < NKEYS * TABLE_DIM; i++) grads[i] = 0.25f;
  CALL(o, "ps_client_table_create", ps_client_table_create(c, tname, table_config(), &t));
  CALL(o, "ps_table_pull", ps_table_pull(t, 0, keys, NKEYS, rows, 0, &step));
  CALL(o, "ps_table_add_grad", ps_table_add_grad(t, keys, NKEYS, grads));
  CALL(o, "ps_client_step", ps_client_step(c, &step, NULL));
  CALL(o, "ps_table_push_async", ps_table_push_async(t, step, keys, NKEYS, grads, &r));
  CALL(o, "ps_req_wait (table push)", wait_req(r));
}

/* Who runs the scenario: worker `worker` of `workers` (replicas 1: a
 * worker alone completes each step); the chief's scenario (variables
 * and a table) or a table's only. */
typedef struct role {
  const char *addr, *tag;
  int worker, workers, tables_only;
} role;

static void scenario(const role *who, outcome *o) {
  memset(o, 0, sizeof *o);
  const char *hosts[1] = {who->addr};
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hosts;
  cfg.num_ps = 1;
  cfg.worker_index = who->worker;
  cfg.num_workers = who->workers;
  cfg.replicas_to_aggregate = 1;
  cfg.connect_timeout_ms = 5000;
  cfg.request_timeout_ms = 20000;
  ps_client *c = NULL;
  char err[512] = "";
  unsigned long before = failed_now();
  int rc = ps_client_create(&cfg, &c, err, sizeof err);
  if (check(o, "ps_client_create", rc, before, err) != 0) {
    if (c) snprintf(o->bad, sizeof o->bad, "ps_client_create failed but set *out");
    return;
  }
  if (who->tables_only) table_steps(c, who->tag, o);
  else chief_steps(c, who->tag, o);
  before = failed_now();
  rc = ps_client_finish(c);
  /* After an earlier failure finish may fail too (the connection may be
   * gone), but only with a code. */
  if (!o->call) check(o, "ps_client_finish", rc, before, ps_client_errmsg(c));
  else if (rc > 0 || strcmp(ps_err_name(rc), "PS_UNKNOWN") == 0)
    snprintf(o->bad, sizeof o->bad, "ps_client_finish after %s returned %d", o->call, rc);
  ps_client_destroy(c);
}

static int run_once(const role *who) {
  outcome o;
  scenario(who, &o);
  if (!o.call) {
    printf("run %s: every call succeeded\n", who->tag);
    return 0;
  }
  printf("run %s: %s failed: %s: %s%s%s\n", who->tag, o.call, ps_err_name(o.rc), o.msg,
         o.bad[0] ? "; BAD: " : "", o.bad);
  return 1;
}

/* ---- the sweep ------------------------------------------------------------ */

static char g_dir[256]; /* the sweep's psd logs and port files */

/* Removes run n's psd log and port file. */
static void remove_files(unsigned long n) {
  char path[300];
  snprintf(path, sizeof path, "%s/psd.%lu.port", g_dir, n);
  unlink(path);
  snprintf(path, sizeof path, "%s/psd.%lu.log", g_dir, n);
  unlink(path);
}

/* Starts psd (without the shim) for one run: its pid, its address in
 * addr; -1 if it did not start within 10 s. */
static pid_t start_psd(const char *bin, unsigned long n, char *addr, size_t addrlen) {
  char port[300], log[300];
  snprintf(port, sizeof port, "%s/psd.%lu.port", g_dir, n);
  snprintf(log, sizeof log, "%s/psd.%lu.log", g_dir, n);
  unlink(port);
  pid_t pid = fork();
  if (pid == 0) {
    unsetenv("LD_PRELOAD");
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execl(bin, bin, "--host", "127.0.0.1", "--port", "0", "--port-file", port, (char *)NULL);
    _exit(127);
  }
  for (int i = 0; pid > 0 && i < 10000; i++) {
    FILE *f = fopen(port, "r");
    if (f) {
      int ok = fgets(addr, (int)addrlen, f) && strchr(addr, '\n');
      fclose(f);
      if (ok) {
        addr[strcspn(addr, "\n")] = '\0';
        return pid;
      }
    }
    usleep(1000);
  }
  if (pid > 0) kill(pid, SIGKILL);
  return -1;
}

/* A child's run with allocation n (and count - 1 after it) failing: exit 0 when clean, else 1 after one line saying why. */
static void child(const char *addr, unsigned long n, unsigned long count) {
  alarm(WATCHDOG_S);
  char tag[32];
  snprintf(tag, sizeof tag, "n%lu", n);
  role who = {addr, tag, 0, 1, 0};
  outcome o;
  g_arm(n, count);
  scenario(&who, &o);
  unsigned long counted, failed;
  long live;
  g_stats(&counted, &failed, &live);
  if (!o.bad[0] && o.rc == PS_ETIMEDOUT)
    snprintf(o.bad, sizeof o.bad, "%s timed out: %s", o.call, o.msg);
  if (!o.bad[0] && o.call && !failed)
    snprintf(o.bad, sizeof o.bad, "%s failed with no allocation failed: %s: %s", o.call,
             ps_err_name(o.rc), o.msg);
  if (!o.bad[0] && live != 0)
    snprintf(o.bad, sizeof o.bad, "%ld allocation(s) still live after ps_client_destroy%s", live,
             live < 0 ? " (too many to record)" : "");
  if (o.bad[0]) printf("N=%lu: %s\n", n, o.bad);
  fflush(stdout);
  _exit(o.bad[0] ? 1 : 0);
}

/* One run against a fresh psd: the child's exit status, or -1 when psd
 * did not start. */
static int run_child(const char *bin, unsigned long n, unsigned long count, int *st) {
  char addr[128];
  pid_t psd = start_psd(bin, n, addr, sizeof addr);
  if (psd < 0) {
    printf("N=%lu: psd did not start (log in %s)\n", n, g_dir);
    return -1;
  }
  pid_t pid = fork();
  if (pid == 0) child(addr, n, count);
  waitpid(pid, st, 0);
  kill(psd, SIGKILL);
  waitpid(psd, NULL, 0);
  if (WIFEXITED(*st) && WEXITSTATUS(*st) == 0) remove_files(n); /* else kept, named */
  else printf("N=%lu: psd's log is %s/psd.%lu.log\n", n, g_dir, n);
  return 0;
}

static int sweep(const char *bin, unsigned long first, unsigned long stride,
                 unsigned long count) {
  g_arm = (arm_fn)dlsym(RTLD_DEFAULT, "faultsim_arm");
  g_stats = (stats_fn)dlsym(RTLD_DEFAULT, "faultsim_stats");
  g_disarm = (disarm_fn)dlsym(RTLD_DEFAULT, "faultsim_disarm");
  if (!g_arm || !g_stats || !g_disarm) {
    fprintf(stderr, "faultsim_client sweep: faultsim.so is not preloaded\n");
    return 2;
  }
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/faultsim.XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_dir)) return 2;
  /* Warm-up: one-time allocations (the resolver, libsodium) happen here,
   * in the parent, not in the runs measured. Then a run that fails
   * nothing: its count bounds the sweep, and it must leave nothing live
   * itself. */
  unsigned long total = 0, failed;
  long live = 0;
  outcome o = {0};
  for (int pass = 0; pass < 2 && !o.call; pass++) {
    char addr[128];
    pid_t psd = start_psd(bin, pass, addr, sizeof addr);
    if (psd < 0) return 1;
    role who = {addr, pass ? "base" : "warm", 0, 1, 0};
    if (pass) g_arm(0, 0);
    scenario(&who, &o);
    g_disarm();
    g_stats(&total, &failed, &live);
    kill(psd, SIGKILL);
    waitpid(psd, NULL, 0);
    remove_files((unsigned long)pass);
  }
  if (o.call || live != 0) {
    printf("run without failures: %s%s%s; %ld allocation(s) still live\n",
           o.call ? o.call : "clean", o.call ? ": " : "", o.msg, live);
    return 1;
  }
  printf("the scenario makes %lu allocations\n", total);
  printf("failing N = %lu, %lu, ... (%lu at a time)\n", first, first + stride, count);
  unsigned long runs = 0, bad = 0;
  for (unsigned long n = first; n <= total; n += stride) {
    int st = 0;
    if (run_child(bin, n, count, &st) != 0) return 1;
    runs++;
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
    bad++;
    if (WIFSIGNALED(st))
      printf("N=%lu: killed by signal %d (%s)%s\n", n, WTERMSIG(st), strsignal(WTERMSIG(st)),
             WTERMSIG(st) == SIGALRM ? ": hung" : "");
  }
  printf("%lu runs, %lu not clean\n", runs, bad);
  rmdir(g_dir); /* unless a log was kept */
  return bad ? 1 : 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc == 7 && strcmp(argv[1], "run") == 0) {
    role who = {argv[2], argv[3], atoi(argv[4]), atoi(argv[5]), strcmp(argv[6], "tables") == 0};
    return run_once(&who);
  }
  if (argc == 6 && strcmp(argv[1], "sweep") == 0)
    return sweep(argv[2], strtoul(argv[3], NULL, 10), strtoul(argv[4], NULL, 10),
                 strtoul(argv[5], NULL, 10));
  fprintf(stderr, "usage: faultsim_client run ADDR TAG WORKER WORKERS chief|tables | "
                  "sweep PSD_BIN FIRST STRIDE COUNT\n");
  return 2;
}
