/* ps_bench_rounds.c - the interleaved rounds. Each of --rounds rounds takes
 * every figure once, baselines first and then every psd configuration:
 *
 *   round 1: tcp_stream, tcp_rtt, memcpy per size, MPI per workers x
 *            transport, pushpull per ps x workers x size, then per
 *            --table shape a table run and the dense pushpull of its bytes
 *   round 2: the same, ...
 *
 * so that a baseline and the psd figure compared with it are taken in the
 * same machine state, never minutes apart (taken once each, the 64 MiB
 * ratio to TCP ranged 0.64-1.22 over seven runs). Then, per figure, the
 * median over the rounds and the range (min-max), and psd against each
 * baseline as the ratio of the medians, with the range of the per-round
 * ratios. A failed round leaves a NAN that the statistics skip. */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_bench_internal.h"

/* Every series of the run, in the order a round takes them. */
typedef struct plan {
  series *s;
  int n, cap;
} plan;

static series *plan_add(plan *p, figure fig, uint64_t bytes, int ps, int workers,
                        const char *transport) {
  if (p->n == p->cap) return NULL; /* sized by plan_size: never */
  series *s = &p->s[p->n++];
  memset(s, 0, sizeof *s);
  s->fig = fig;
  s->bytes = bytes;
  s->ps = ps;
  s->workers = workers;
  s->transport = transport;
  for (int r = 0; r < MAX_ROUNDS; r++) s->step_ms[r] = s->gbps[r] = NAN;
  return s;
}

/* Transports each psd configuration runs over (1: none given). */
static int n_tr(void) { return opt.n_transports ? opt.n_transports : 1; }
static const char *tr(int i) { return opt.n_transports ? opt.transports[i] : NULL; }

static int plan_size(void) {
  return 2 + opt.n_sizes * (1 + 2 * opt.n_workers + opt.n_ps * opt.n_workers * n_tr()) +
         2 * opt.n_tables * opt.n_ps * opt.n_workers * n_tr();
}

/* The bytes a pushpull of `req` bytes moves (whole float32 elements). */
static uint64_t pp_bytes(uint64_t req) {
  return req / 4 ? req / 4 * 4 : 4;
}

static series *plan_find(plan *p, figure fig, uint64_t bytes, int ps, int workers,
                         const char *transport);

/* A table run and, right after it, the dense pushpull of its row bytes
 * (once, however many shapes share those bytes). */
static void plan_table(plan *p, table_shape sh, int ps, int workers, const char *transport) {
  series *x = plan_add(p, FIG_TABLE, sh.keys * sh.dim * sizeof(float), ps, workers, transport);
  if (!x) return;
  x->keys = sh.keys;
  x->dim = sh.dim;
  if (!plan_find(p, FIG_PUSHPULL, x->bytes, ps, workers, transport))
    plan_add(p, FIG_PUSHPULL, x->bytes, ps, workers, transport);
}

static int plan_build(plan *p, int with_mpi) {
  p->cap = plan_size();
  p->n = 0;
  p->s = calloc((size_t)p->cap, sizeof *p->s);
  if (!p->s) return -1;
  if (opt.tcp_baseline) {
    plan_add(p, FIG_TCP_STREAM, tcp_stream_bytes(), 0, 0, NULL);
    plan_add(p, FIG_TCP_RTT, 4, 0, 0, NULL);
  }
  if (opt.memcpy_baseline)
    for (int s = 0; s < opt.n_sizes; s++) plan_add(p, FIG_MEMCPY, opt.sizes[s], 0, 0, NULL);
  if (with_mpi)
    for (int w = 0; w < opt.n_workers; w++)
      for (int t = 0; t < 2; t++)
        for (int s = 0; s < opt.n_sizes; s++)
          plan_add(p, t ? FIG_MPI_TCP : FIG_MPI_SHM, pp_bytes(opt.sizes[s]), 0, opt.workers[w],
                   NULL);
  /* Transports innermost: the runs compared with each other are taken
   * back to back. */
  for (int i = 0; i < opt.n_ps; i++)
    for (int j = 0; j < opt.n_workers; j++) {
      for (int s = 0; s < opt.n_sizes; s++)
        for (int t = 0; t < n_tr(); t++)
          plan_add(p, FIG_PUSHPULL, pp_bytes(opt.sizes[s]), opt.ps[i], opt.workers[j], tr(t));
      for (int k = 0; k < opt.n_tables; k++)
        for (int t = 0; t < n_tr(); t++)
          plan_table(p, opt.tables[k], opt.ps[i], opt.workers[j], tr(t));
    }
  return 0;
}

static series *plan_find(plan *p, figure fig, uint64_t bytes, int ps, int workers,
                         const char *transport) {
  for (int i = 0; i < p->n; i++) {
    const series *s = &p->s[i];
    if (s->fig == fig && s->bytes == bytes && s->ps == ps && s->workers == workers &&
        s->keys == 0 &&
        (s->transport == transport ||
         (s->transport && transport && !strcmp(s->transport, transport))))
      return &p->s[i];
  }
  return NULL;
}

/* ---------------------------------------------------------------------- */
/* One round */

/* One mpirun: every size of `ranks` ranks over one transport; failures. */
static int round_mpi(plan *p, int r, int ranks, int tcp) {
  double step_ms[MAX_LIST], max_ms[MAX_LIST];
  int failed = mpi_round(ranks, tcp, step_ms, max_ms) != 0;
  for (int s = 0; s < opt.n_sizes && !g_interrupted; s++) {
    series *x = plan_find(p, tcp ? FIG_MPI_TCP : FIG_MPI_SHM, pp_bytes(opt.sizes[s]), 0, ranks,
                          NULL);
    if (!x) continue;
    x->step_ms[r] = step_ms[s];
    /* As pushpull's gbps: a worker's gradient out and parameters back. */
    x->gbps[r] = step_ms[s] > 0 ? 2.0 * (double)x->bytes / (step_ms[s] * 1e-3) / 1e9 : NAN;
    if (isfinite(step_ms[s])) print_baseline(x, max_ms[s]);
  }
  return failed;
}

/* Every baseline of round r (0-based); returns the failures. */
static int round_baselines(plan *p, int r, int with_mpi) {
  int failures = 0;
  for (int i = 0; i < p->n && !g_interrupted; i++) {
    series *x = &p->s[i];
    if (x->fig == FIG_TCP_STREAM) {
      x->gbps[r] = tcp_stream_round(&x->step_ms[r]);
    } else if (x->fig == FIG_TCP_RTT) {
      x->step_ms[r] = tcp_rtt_round();
    } else if (x->fig == FIG_MEMCPY) {
      x->step_ms[r] = memcpy_round(x->bytes, &x->gbps[r]);
    } else {
      continue;
    }
    if (isfinite(x->step_ms[r])) print_baseline(x, NAN);
    else failures++;
  }
  for (int w = 0; with_mpi && w < opt.n_workers && !g_interrupted; w++)
    for (int t = 0; t < 2 && !g_interrupted; t++) failures += round_mpi(p, r, opt.workers[w], t);
  return failures;
}

/* Every psd configuration of round r; returns the failures. */
static int round_pushpull(plan *p, int r) {
  int failures = 0;
  for (int i = 0; i < p->n && !g_interrupted; i++) {
    series *x = &p->s[i];
    if (x->fig != FIG_PUSHPULL && x->fig != FIG_TABLE) continue;
    pp_result res;
    int rc = x->fig == FIG_TABLE
                 ? run_table(x->ps, x->workers, (table_shape){x->keys, x->dim},
                             steps_for(x->bytes), x->transport, &res)
                 : run_pushpull(x->ps, x->workers, x->bytes, steps_for(x->bytes),
                                x->transport, &res);
    if (rc != 0) failures++;
    if (g_interrupted) break;
    print_pushpull(&res);
    if (res.ok != 0) {
      x->step_ms[r] = res.step_ms;
      x->gbps[r] = res.gbps;
    }
  }
  return failures;
}

/* ---------------------------------------------------------------------- */
/* After the rounds */

/* psd (ps=1) against every baseline it has a counterpart in:
 *   sizes >= 1 MiB, 1 worker: gbps against tcp_stream and memcpy;
 *   4 bytes, 1 worker: step time against the TCP round trip;
 *   every size and worker count: step time against MPI_Allreduce of as
 *   many ranks, over shared memory and over TCP;
 *   over a --transport other than tcp, with tcp in the list too: step
 *   time against the same configuration over tcp. */
static void print_ratios(plan *p) {
  for (int i = 0; i < p->n; i++) {
    series *x = &p->s[i];
    series *b;
    /* A table run against the dense push+pull of its bytes, any ps. */
    if (x->fig == FIG_TABLE &&
        (b = plan_find(p, FIG_PUSHPULL, x->bytes, x->ps, x->workers, x->transport)))
      print_ratio(x, b, 0);
    if (x->fig != FIG_PUSHPULL || x->ps != 1) continue;
    if (x->workers == 1 && x->bytes >= (1ULL << 20)) {
      if ((b = plan_find(p, FIG_TCP_STREAM, tcp_stream_bytes(), 0, 0, NULL)))
        print_ratio(x, b, 1);
      if ((b = plan_find(p, FIG_MEMCPY, x->bytes, 0, 0, NULL))) print_ratio(x, b, 1);
    }
    if (x->workers == 1 && x->bytes == 4 && (b = plan_find(p, FIG_TCP_RTT, 4, 0, 0, NULL)))
      print_ratio(x, b, 0);
    if ((b = plan_find(p, FIG_MPI_SHM, x->bytes, 0, x->workers, NULL))) print_ratio(x, b, 0);
    if ((b = plan_find(p, FIG_MPI_TCP, x->bytes, 0, x->workers, NULL))) print_ratio(x, b, 0);
    if (x->transport && strcmp(x->transport, "tcp") &&
        (b = plan_find(p, FIG_PUSHPULL, x->bytes, x->ps, x->workers, "tcp")))
      print_ratio(x, b, 0);
  }
}

/* Whether to run the MPI baseline: 1 yes; 0 not built (said); -1 broken. */
static int mpi_wanted(void) {
  if (!opt.mpi_baseline) return 0;
  char why[PATH_MAX + 128];
  int b = mpi_built(why, sizeof why);
  if (b == 1) {
    if (opt.n_mpi_args) { /* the JSON says which MPI configuration it compared with */
      char args[1024] = "";
      size_t k = 0;
      for (int i = 0; i < opt.n_mpi_args && k < sizeof args; i++)
        k += (size_t)snprintf(args + k, sizeof args - k, "%s%s", i ? " " : "", opt.mpi_args[i]);
      print_note("mpi_args", args);
    }
    return 1;
  }
  progress("%s", why);
  print_note("mpi_baseline", b == 0 ? "not built" : why);
  return b;
}

int run_rounds(void) {
  int with_mpi = mpi_wanted();
  int failures = with_mpi < 0;
  if (with_mpi < 0) with_mpi = 0;
  plan p;
  if (plan_build(&p, with_mpi) != 0) {
    progress("out of memory");
    return failures + 1;
  }
  if (!opt.json) print_table_header();
  for (int r = 0; r < opt.rounds && !g_interrupted; r++) {
    g_round = r + 1;
    progress("round %d of %d", g_round, opt.rounds);
    failures += round_baselines(&p, r, with_mpi);
    if (!g_interrupted) failures += round_pushpull(&p, r);
  }
  g_round = 0;
  if (!g_interrupted) {
    if (!opt.json) print_summary_header();
    for (int i = 0; i < p.n; i++) print_summary(&p.s[i]);
    print_ratios(&p);
  }
  fflush(stdout);
  free(p.s);
  return failures;
}
