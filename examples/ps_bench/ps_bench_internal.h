/* ps_bench_internal.h - what the files of ps_bench share (not installed).
 *
 *   ps_bench.c           options, the measurement plan and main
 *   ps_bench_proc.c      child processes: registry, signals, fork, CPU
 *                        pinning, reaping, starting psd, logs, the log dir
 *   ps_bench_pushpull.c  one push-pull measurement: the worker process and
 *                        the parent's stages (servers, workers, reports,
 *                        exits) with one teardown
 *   ps_bench_tcp.c       the raw TCP baselines (stream and round trip)
 *   ps_bench_memcpy.c    the memcpy baseline (one thread)
 *   ps_bench_mpi.c       the MPI_Allreduce baseline: mpirun of
 *                        mpi_allreduce_bench, its lines read back
 *   ps_bench_rounds.c    the interleaved rounds: every figure once a round,
 *                        then medians, ranges and ratios of medians
 *   ps_bench_output.c    numbers and labels, the table and JSON lines
 *   ps_bench_table.c     --table K:D: a worker's sparse-table steps (pull,
 *                        add_grad, ps_client_step) and its run
 *   ps_bench_store.c     --table-store: psd's table store alone on one
 *                        core (find-or-insert, each rule's update, a copy)
 *   mpi_allreduce_bench.c  the MPI program itself (built with Open MPI only)
 */
#ifndef PS_BENCH_INTERNAL_H
#define PS_BENCH_INTERNAL_H

#include <limits.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define MAX_LIST 32          /* entries in one --ps/--workers/--sizes list */
#define MAX_TRANSPORTS 3     /* --transport list: auto, tcp, shm at most once each */
#define MAX_PS 64            /* --ps bound */
#define MAX_WORKERS 64       /* --workers bound */
#define MAX_BYTES (16ULL << 30) /* --sizes bound: 16 GiB */
#define WARMUP_STEPS 2
#define BIG_SIZE (64ULL << 20)  /* sizes from here on run at most BIG_STEPS */
#define BIG_STEPS 10
#define STREAM_CHUNK (4u << 20)
#define STREAM_SOCKBUF (4 << 20)
#define RTT_WARMUP 1000
#define RTT_ITERS 20000
#define GRAD_VALUE 1e-6f
/* --telemetry-cost: off/on pairs; alternating cancels drift of the machine. */
#define TELEM_ROUNDS 5
#define LEARNING_RATE 0.01
/* --rounds: each round takes every figure once (baselines, then psd), so
 * that a baseline and the psd figure it is compared with are minutes apart
 * at most one round; 7 rounds make a median that one slow round cannot
 * move. More than MAX_ROUNDS gains nothing and each round restarts psd. */
#define DEFAULT_ROUNDS 7
#define MAX_ROUNDS 101
/* memcpy baseline: MEMCPY_SAMPLES timed samples a round, each of enough
 * copies to move at least MEMCPY_SAMPLE_BYTES (a 4-byte copy alone is
 * below the clock's resolution); the round's figure is their median. */
#define MEMCPY_SAMPLES 5
#define MEMCPY_SAMPLE_BYTES (64ULL << 20)

/* ---------------------------------------------------------------------- */
/* Options (ps_bench.c) */

/* --psd-arg and --mpi-arg may each be given this many times. */
#define MAX_PSD_ARGS 16

/* One --table entry: keys per step x floats per row. */
typedef struct table_shape {
  uint64_t keys;
  uint32_t dim;
} table_shape;

typedef struct options {
  int ps[MAX_LIST], n_ps;
  int workers[MAX_LIST], n_workers;
  uint64_t sizes[MAX_LIST];
  int n_sizes;
  int sizes_given;     /* --sizes given (with --table, none run otherwise) */
  table_shape tables[MAX_LIST]; /* --table K:D list */
  int n_tables;
  int table_store;     /* --table-store: the store alone, no network */
  int steps;
  int steps_given;
  int tcp_baseline;
  int json;
  int pin;   /* servers on the last CPUs, clients on the first ones */
  int telemetry_cost; /* --telemetry-cost: 4-byte steps, telemetry off vs on */
  char psd[PATH_MAX];
  const char *psd_args[MAX_PSD_ARGS]; /* --psd-arg: extra psd arguments, in order */
  int n_psd_args;
  const char *mpi_args[MAX_PSD_ARGS]; /* --mpi-arg: extra mpirun arguments */
  int n_mpi_args;
  int psd_exit_s; /* --psd-exit-wait: seconds psd may take to exit after the
                     workers (it first writes the checkpoints it accepted) */
  int rounds;          /* --rounds: interleaved rounds of every figure */
  int memcpy_baseline; /* --memcpy-baseline: one-thread memcpy of each size */
  int mpi_baseline;    /* --mpi-baseline: MPI_Allreduce over shm and TCP */
  const char *transports[MAX_TRANSPORTS]; /* --transport list, in order (each
                                             psd run is taken once per entry) */
  int n_transports;    /* 0: none given (psd's and PS_TRANSPORT's default) */
} options;

extern options opt;
/* The run being measured has telemetry switched off (psd and client). */
extern int g_telem_off;

/* ---------------------------------------------------------------------- */
/* Child processes (ps_bench_proc.c). Every process we start is registered
 * so that an error path or a signal can kill it. */

typedef struct proc {
  pid_t pid;
  int status;
  int reaped;
  char log[PATH_MAX];
} proc;

extern volatile sig_atomic_t g_interrupted;
extern char g_tmpdir[1024]; /* shorter than PATH_MAX: log names fit after it */

void install_signals(void);
pid_t fork_child(void);
void reap_all_children(void);
void pin_cpu(int index);
void unpin_cpu(void);
/* 1 once p has exited (or never ran), 0 while it runs (block: wait). */
int proc_reap(proc *p, int block);
void proc_kill(proc *p);
void describe_status(int st, char *buf, size_t len);
/* Starts psd `index` of `nps` for run `run` and waits for its address. */
int start_psd(proc *p, int run, int index, int nps, int nw, char *addr, size_t addrlen,
              char *err, size_t errlen);
void print_logs(const proc *ps, int nps, const proc *wk, int nw);
int make_tmpdir(void);
void remove_tmpdir(void);

double now_s(void);
void sleep_ms(int ms);
int write_all(int fd, const void *buf, size_t len);
/* Reads exactly len bytes; 0, or -1 on error or EOF. */
int read_all(int fd, void *buf, size_t len);

/* ---------------------------------------------------------------------- */
/* Push-pull measurement (ps_bench_pushpull.c) */

typedef struct pp_result {
  uint64_t bytes;
  uint64_t keys;  /* a --table run: keys per step (0: a dense run) */
  uint32_t dim;   /* ... and floats per row */
  int ps, workers, steps;
  double step_ms, gbps, total_gbps;
  double max_step_ms; /* worker 0's slowest timed step (a stall shows here) */
  int ok;  /* 1 measured, -1 measured but the values were wrong, 0 failed */
  const char *transport; /* --transport of this run, or NULL (none given) */
  char error[600];
} pp_result;

/* One run over `transport` (NULL: none given, the defaults): psd's
 * --transport and the workers' PS_TRANSPORT. */
int run_pushpull(int nps, int nw, uint64_t req_bytes, int steps, const char *transport,
                 pp_result *res);
/* The transport of the run being set up (NULL: none given), for start_psd. */
extern const char *g_transport;
/* Servers + workers of the run being set up (0 outside a run), for pin_cpu. */
extern int g_run_procs;

/* Steps of a run of `bytes`: --steps, or at most BIG_STEPS for big sizes. */
int steps_for(uint64_t bytes);

/* ---------------------------------------------------------------------- */
/* Sparse tables (ps_bench_table.c, ps_bench_store.c) */

struct ps_client;
/* The table of the run being set up ({0, 0}: a dense run): what the
 * forked workers do instead of dense steps. */
extern table_shape g_table;
/* Parses --table's "K:D[,K:D...]" (K with suffixes k/M: 1000s) into opt. */
void parse_table_list(const char *flag, const char *val);
/* A worker's table steps on c (WARMUP_STEPS, then `steps` timed ones:
 * pull of g_table.keys rows, add_grad of as many, ps_client_step) into
 * times[] seconds. 0; a ps_* code (msg says which call); or 1 when the
 * rows pulled after the last step are not what SGD makes of the
 * gradients (msg says where). */
int table_worker_steps(struct ps_client *c, int steps, double *times, char *msg, size_t len);
/* One table run: as run_pushpull, with the workers doing table steps. */
int run_table(int nps, int nw, table_shape shape, int steps, const char *transport,
              pp_result *res);
/* --table-store: every --table shape, opt.rounds interleaved rounds;
 * returns the failures. */
int run_table_store(void);

/* ---------------------------------------------------------------------- */
/* Baselines, one round's figure each; they print nothing but progress.
 * TCP (ps_bench_tcp.c): one stream of tcp_stream_bytes() over loopback,
 * gbps (and *ms, its time), NAN on failure (said on stderr); the median
 * of RTT_ITERS 4-byte round trips in ms, NAN on failure. */

uint64_t tcp_stream_bytes(void);
double tcp_stream_round(double *ms);
double tcp_rtt_round(void);

/* memcpy (ps_bench_memcpy.c): ms per copy of `bytes` on one thread, and
 * *gbps = bytes copied per second / 1e9; NAN when there is no memory. */
double memcpy_round(uint64_t bytes, double *gbps);

/* MPI (ps_bench_mpi.c). mpi_built: 1 when ps_bench was built with the MPI
 * baseline and mpi_allreduce_bench is there, 0 "not built", -1 built but
 * missing (why says which). mpi_round: one mpirun of `ranks` ranks over
 * the shared-memory BTL (tcp 0) or TCP over loopback (tcp 1), every size
 * of --sizes; step_ms[s] and max_ms[s] per size, NAN where it failed.
 * 0, or -1 when the run failed (said on stderr, logs kept). */
int mpi_built(char *why, size_t len);
int mpi_round(int ranks, int tcp, double *step_ms, double *max_ms);

/* ---------------------------------------------------------------------- */
/* Rounds (ps_bench_rounds.c) */

/* Which figure a series holds. */
typedef enum {
  FIG_PUSHPULL, FIG_TABLE, FIG_TCP_STREAM, FIG_TCP_RTT, FIG_MEMCPY, FIG_MPI_SHM, FIG_MPI_TCP
} figure;

/* One figure's value in every round. */
typedef struct series {
  figure fig;
  uint64_t bytes;
  int ps;       /* pushpull: servers; 0 otherwise */
  int workers;  /* pushpull: workers; MPI: ranks; 0 otherwise */
  const char *transport; /* pushpull, table: --transport entry, or NULL */
  uint64_t keys;         /* table: keys per step (0 otherwise) */
  uint32_t dim;          /* table: floats per row */
  double step_ms[MAX_ROUNDS]; /* per round (tcp_stream: the stream's time;
                                 tcp_rtt: one round trip); NAN: failed */
  double gbps[MAX_ROUNDS];    /* per round; NAN: failed or not defined */
} series;

/* Runs opt.rounds rounds, then prints the summaries and ratios; returns
 * the failures. */
int run_rounds(void);

/* ---------------------------------------------------------------------- */
/* Output (ps_bench_output.c) */

void progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
double median(const double *v, size_t n);
const char *size_label(uint64_t b, char *buf, size_t len);
/* A JSON number, or null where the value is not finite. */
const char *jnum(double v, char *buf, size_t len);
/* The round being measured (1-based; 0 outside the rounds), in the lines. */
extern int g_round;
const char *figure_name(figure f);
/* A series' name in the text table: the figure's, with "/TRANSPORT" for a
 * pushpull run over a --transport entry. */
const char *series_name(const series *s, char *buf, size_t len);
void print_table_header(void);
void print_pushpull(const pp_result *r);
/* One baseline's figure of round g_round (max_ms: MPI's slowest call). */
void print_baseline(const series *s, double max_ms);
void print_telemetry_cost(double m_on, double m_off);
/* After the rounds: the median and range of every figure ... */
void print_summary_header(void);
void print_summary(const series *s);
/* ... and psd against a baseline: the ratio of the medians of `metric`
 * (step_ms or gbps) and the per-round ratios' range. */
void print_ratio(const series *psd, const series *base, int use_gbps);
void print_note(const char *key, const char *text);

#endif
