/* local.c - `psrun --local -n N --ps P -- CMD`: the same roles as under
 * Slurm, as N processes on this machine, output prefixed by role. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "launch.h"
#include "proc.h"
#include "psrun.h"
#include "rdvdir.h"
#include "util.h"
#include "wire.h"

/* After a stop request: psd waits up to its --stop-timeout (60 s) for the
 * stop checkpoint, so allow that and the exits before giving up. */
#define PSR_STOP_S 90.0

/* Prints (to stderr, never into the workers' output on stdout) and
 * removes ps0's telemetry table, if it wrote one. */
static void print_summary(const char *path) {
  if (!path) return;
  FILE *f = fopen(path, "r");
  if (f) {
    char buf[4096];
    size_t n;
    fflush(stderr);
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) fwrite(buf, 1, n, stderr);
    fflush(stderr);
    fclose(f);
  }
  unlink(path);
}


/* Settle time for report_other_failures: a task that died first (a ps) may
 * be reaped after the workers its death made fail. */
#define PSR_SETTLE_MS 100

/* After a first failure: names the tasks that have already failed too, so
 * that the root cause (a killed ps) is in the log even when a worker it took
 * down was reaped first. */
static void report_other_failures(psr_procs *procs) {
  int which;
  for (int i = 0; i < procs->n; i++) {
    psr_event ev = psr_wait(procs, PSR_SETTLE_MS, -1, &which);
    if (ev == PSR_EV_NONE) break;
    if (ev != PSR_EV_EXIT) continue;
    psr_child *c = &procs->kids[which];
    int code = psr_exit_code(c->status);
    if (code != 0 && code != PSR_EXIT_STOPPED) {
      char d[64];
      psr_describe(c->status, d, sizeof d);
      psr_log("%s %s", c->label, d);
    }
  }
}

/* 1. The ps tasks, each on a free port of its choosing; 2. the workers,
 * with the environment libpsclient reads. 0, or -1 after logging why. */
static int start_tasks(psr_procs *procs, psr_task *t, char *hosts, size_t hostslen, char *cred,
                       size_t credlen) {
  char err[512];
  size_t hlen = 0;
  /* The secret exists only in the tasks' environment: psctl gets it from
   * a file only this user can read, removed when the job ends. */
  /* A squatted directory costs psctl, not the job. */
  if (psr_admin_cred_write(t->secret, cred, credlen, err, sizeof err) != 0) {
    psr_log("no credential for psctl: %s", err);
    cred[0] = '\0';
  }
  for (int i = 0; i < t->num_ps; i++) {
    t->index = i;
    char *hp = psr_start_psd(procs, t, err, sizeof err);
    if (!hp) {
      psr_log("%s", err);
      return -1;
    }
    if (cred[0]) psr_log("ps%d's counters: psctl stats %s --secret-file %s", i, hp, cred);
    hlen += (size_t)snprintf(hosts + hlen, hostslen - hlen, "%s%s", i ? "," : "", hp);
    free(hp);
  }
  /* psrun is worker 0's task here: it picks MASTER_PORT, after the psds
   * have bound theirs. */
  if (psr_free_port(&t->master_port, err, sizeof err) != 0) {
    psr_log("%s", err);
    return -1;
  }
  for (int w = 0; w < t->num_workers; w++) {
    t->index = w;
    t->local_rank = w; /* every worker is on this node; the ps tasks are not counted */
    if (psr_start_worker(procs, t, hosts, err, sizeof err) < 0) {
      psr_log("cannot start w%d: %s", w, err);
      return -1;
    }
  }
  return 0;
}

/* What supervise knows besides the children: how to start a worker again,
 * and how many losses and restarts are left. */
typedef struct psr_sup {
  const psr_opts *o;
  psr_task *t;         /* the workers' settings, for a restart */
  const char *hosts;   /* PS_HOSTS of this run */
  int backups;         /* losses the job survives (psd averages W - backups) */
  int lost;            /* workers lost so far */
  int restarts_left;   /* --restart-workers still unused */
  int workers_left;    /* workers still running (restarted ones count once) */
} psr_sup;

/* A worker died (c, not a stop on request): restart it in place while
 * --restart-workers allows, else go on without it while the backups allow.
 * 1: the job goes on; 0: it must stop. */
static int worker_lost(psr_sup *s, psr_procs *procs, psr_child *c) {
  char d[64], label[32], err[512];
  psr_describe(c->status, d, sizeof d);
  snprintf(label, sizeof label, "%s", c->label);
  if (s->restarts_left > 0) {
    /* Same rank and environment: psd takes it back at the current step. */
    int w = atoi(label + 1);
    s->t->index = w;
    s->t->local_rank = w;
    s->restarts_left--;
    s->t->restarts = s->o->restart_workers - s->restarts_left;
    int started = psr_start_worker(procs, s->t, s->hosts, err, sizeof err);
    s->t->restarts = 0;
    if (started >= 0) {
      psr_log("%s %s; restarted it (%d restart(s) left)", label, d, s->restarts_left);
      return 1;
    }
    psr_log("cannot restart %s: %s", label, err);
  }
  if (s->lost >= s->backups) return 0;
  s->lost++;
  s->workers_left--;
  psr_log("%s %s; going on without it (%d of %d backup worker(s) lost, %d more may be lost)",
          label, d, s->lost, s->backups, s->backups - s->lost);
  return 1;
}

/* For psrun's message when psd outlives the workers: the workers the ps
 * tasks still up never saw finish, as they tell it (psr_unfinished). */
static void unfinished(const psr_procs *procs, const psr_sup *s, char *buf, size_t len) {
  int running[PSR_MAX_CHILDREN] = {0};
  for (int i = 0; i < procs->n; i++) {
    const psr_child *c = &procs->kids[i];
    int ps = atoi(c->label + 2); /* "ps3" */
    if (c->is_ps && ps >= 0 && ps < PSR_MAX_CHILDREN) running[ps] = !c->exited;
  }
  ps__auth auth = {s->t->secret, strlen(s->t->secret), 0, NULL, 0, -1};
  psr_unfinished(s->hosts, running, s->t->num_workers, &auth, buf, len);
}

/* 3. Supervise: a failing task stops the job (unless a worker can be
 * restarted or spared); signals are forwarded. Returns 0 when every task is
 * done (status in *status), -1 when the rest must be torn down. */
static int supervise(psr_procs *procs, psr_sup *s, int *status) {
  const psr_opts *o = s->o;
  double ps_deadline = 0, stop_deadline = 0;
  int stopped = 0; /* a task exited PSR_EXIT_STOPPED: the job stops on purpose */
  while (psr_alive(procs)) {
    int which;
    int timeout = ps_deadline || stop_deadline ? 200 : -1;
    psr_event ev = psr_wait(procs, timeout, -1, &which);
    if (ev == PSR_EV_SIGNAL) {
      if (which == SIGTERM && o->ckpt_dir[0] && !stop_deadline) {
        /* Forwarded: the tasks checkpoint, then exit PSR_EXIT_STOPPED. */
        psr_log("received SIGTERM; the job checkpoints and stops (SIGTERM again to stop now)");
        stop_deadline = ps__now() + PSR_STOP_S;
        continue;
      }
      if (which == SIGTERM || which == SIGINT || which == SIGHUP) {
        psr_log("received SIG%s; stopping all tasks", sigabbrev_np(which));
        if (!*status) *status = 128 + which;
        return -1;
      }
      continue; /* SIGUSR1/2: forwarded, tasks decide */
    }
    if (ev == PSR_EV_EXIT) {
      psr_child *c = &procs->kids[which];
      int code = psr_child_code(c);
      if (code == PSR_EXIT_STOPPED) {
        /* Stopped after a checkpoint: the others are stopping too. */
        if (!stopped) psr_log("%s stopped on request; waiting for the others", c->label);
        stopped = 1;
        if (!stop_deadline) stop_deadline = ps__now() + PSR_STOP_S;
        code = 0;
      }
      if (code != 0 && !c->is_ps && !stopped && !stop_deadline && worker_lost(s, procs, c)) {
        if (s->workers_left == 0) ps_deadline = ps__now() + PSR_PSD_EXIT_S;
        continue;
      }
      if (code != 0) {
        char d[64];
        psr_describe(c->status, d, sizeof d);
        psr_log("%s %s%s; stopping all tasks", c->label, d,
                c->is_ps ? psr_psd_status_says(code) : "");
        if (code > *status) *status = code;
        report_other_failures(procs);
        return -1;
      }
      if (!c->is_ps && --s->workers_left == 0) ps_deadline = ps__now() + PSR_PSD_EXIT_S;
      /* A ps that exits 0 has seen every worker finish: the workers are
       * only tidying up, so nothing to do. */
    }
    if (stop_deadline && ps__now() > stop_deadline) {
      psr_log("tasks did not stop within %.0f s of the stop request", PSR_STOP_S);
      *status = PSR_EXIT_STOPPED;
      return -1;
    }
    if (ps_deadline && ps__now() > ps_deadline) {
      char names[1200];
      unfinished(procs, s, names, sizeof names);
      psr_log("parameter servers did not exit within %.0f s after the workers finished%s",
              PSR_PSD_EXIT_S, names);
      *status = 1;
      return -1;
    }
  }
  if (!*status && stopped) {
    psr_log("job stopped on request (exit %d); run it again to resume from the newest "
            "complete checkpoint",
            PSR_EXIT_STOPPED);
    *status = PSR_EXIT_STOPPED;
  }
  return 0;
}

/* --print-plan: the roles psr_run_local would give, as psrun prints them
 * under Slurm, every task on the one node "localhost". Starts nothing. */
static int print_plan(const psr_opts *o) {
  int n = o->ntasks, rc = 0;
  int *node_of = calloc((size_t)n, sizeof *node_of);
  psr_role *roles = calloc((size_t)n, sizeof *roles);
  char err[256];
  if (!node_of || !roles) {
    psr_log("out of memory");
    rc = 1;
  } else if (psr_plan(n, o->ps, PSR_PLACE_PACK, node_of, roles, err, sizeof err) != 0) {
    psr_log("%s", err);
    rc = 2;
  } else {
    for (int r = 0; r < n; r++) psr_print_role(&roles[r], "localhost");
    fflush(stdout);
  }
  free(node_of);
  free(roles);
  return rc;
}

int psr_run_local(const psr_opts *o) {
  if (o->print_plan) return print_plan(o);
  psr_procs procs;
  if (psr_procs_init(&procs, 1) != 0) {
    psr_log("cannot set up signal handling: %s", strerror(errno));
    return 1;
  }
  /* A fresh secret per run, handed to the tasks in their environment only:
   * psd refuses any connection that does not present it. */
  char secret[65];
  if (psr_new_secret(secret) != 0) {
    psr_log("cannot draw a random secret: %s", strerror(errno));
    return 1;
  }
  psr_task t;
  memset(&t, 0, sizeof t);
  t.o = o;
  t.host = "127.0.0.1";
  t.num_ps = o->ps;
  t.num_workers = o->ntasks - o->ps;
  t.local_workers = t.num_workers; /* they share this machine's cores */
  t.node_workers = t.num_workers;
  t.master_addr = "127.0.0.1";
  t.secret = secret;
  /* ps0 writes the telemetry table here; printed once the job is over. */
  char summary[] = "/tmp/psrun-summary.XXXXXX";
  int sfd = mkstemp(summary);
  if (sfd >= 0) {
    close(sfd);
    t.summary = summary;
  }
  int status = 0;
  char cred[4300] = "";
  static char hosts[16384]; /* kept for restarts */
  psr_sup sup = {o, &t, hosts, 0, 0, o->restart_workers, t.num_workers};
  if (psr_replicas(o, t.num_workers, &sup.backups) > 0)
    psr_log("psd averages %d of %d workers' gradients per step: the job goes on after losing "
            "up to %d worker(s)",
            t.num_workers - sup.backups, t.num_workers, sup.backups);
  if (start_tasks(&procs, &t, hosts, sizeof hosts, cred, sizeof cred) != 0) status = 1;
  else if (supervise(&procs, &sup, &status) == 0) {
    unlink(cred);
    print_summary(t.summary);
    return status;
  }
  psr_teardown(&procs, o->grace_s);
  if (cred[0]) unlink(cred);
  print_summary(t.summary);
  return status ? status : 1;
}
