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

#include "proc.h"
#include "psrun.h"

/* Seconds psd has to bind its port and write the port file. */
#define PSR_PSD_START_S 30.0
/* Seconds the ps tasks have to exit after the last worker finished. */
#define PSR_PSD_EXIT_S 30.0

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static char *read_line(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  char buf[512];
  char *r = fgets(buf, sizeof buf, f) ? strdup(buf) : NULL;
  fclose(f);
  if (r) r[strcspn(r, "\r\n")] = '\0';
  return r;
}

static void rm_tree(const char *dir, int nps) {
  char path[4200];
  for (int i = 0; i < nps; i++) {
    snprintf(path, sizeof path, "%s/ps%d.port", dir, i);
    unlink(path);
  }
  rmdir(dir);
}

int psr_run_local(const psr_opts *o) {
  int N = o->ntasks, P = o->ps, W = N - P;
  psr_procs procs;
  char err[512];
  if (psr_procs_init(&procs, 1) != 0) {
    psr_log("cannot set up signal handling: %s", strerror(errno));
    return 1;
  }
  char dir[] = "/tmp/psrun.XXXXXX";
  if (!mkdtemp(dir)) {
    psr_log("cannot create a temporary directory: %s", strerror(errno));
    return 1;
  }
  char nps_s[16], nw_s[16];
  snprintf(nps_s, sizeof nps_s, "%d", P);
  snprintf(nw_s, sizeof nw_s, "%d", W);
  int status = 0;
  /* A fresh secret per run, handed to the tasks in their environment only:
   * psd refuses any connection that does not present it. */
  char secret[65], e_psd_secret[80], e_secret[80];
  if (psr_new_secret(secret) != 0) {
    psr_log("cannot draw a random secret: %s", strerror(errno));
    return 1;
  }
  snprintf(e_psd_secret, sizeof e_psd_secret, "PSD_SECRET=%s", secret);
  snprintf(e_secret, sizeof e_secret, "PS_SECRET=%s", secret);
  char *psd_env[] = {e_psd_secret, NULL};
  char hosts[16384] = "";
  size_t hlen = 0;

  /* 1. The ps tasks, each on a free port it reports in a file. */
  for (int i = 0; i < P; i++) {
    char idx[16], portf[4200], label[32];
    snprintf(idx, sizeof idx, "%d", i);
    snprintf(portf, sizeof portf, "%s/ps%d.port", dir, i);
    snprintf(label, sizeof label, "ps%d", i);
    char *argv[64];
    int a = 0;
    argv[a++] = (char *)o->psd;
    argv[a++] = "--host";
    argv[a++] = "127.0.0.1";
    argv[a++] = "--port";
    argv[a++] = "0";
    argv[a++] = "--port-file";
    argv[a++] = portf;
    argv[a++] = "--ps-index";
    argv[a++] = idx;
    argv[a++] = "--num-ps";
    argv[a++] = nps_s;
    argv[a++] = "--workers";
    argv[a++] = nw_s;
    for (int k = 0; k < o->npsd_args && a < 62; k++) argv[a++] = (char *)o->psd_args[k];
    argv[a] = NULL;
    if (psr_spawn(&procs, label, 1, argv, psd_env, err, sizeof err) < 0) {
      psr_log("cannot start %s: %s", label, err);
      status = 1;
      goto teardown;
    }
  }
  double deadline = now_s() + PSR_PSD_START_S;
  for (int i = 0; i < P; i++) {
    char portf[4200];
    snprintf(portf, sizeof portf, "%s/ps%d.port", dir, i);
    char *hp;
    while (!(hp = read_line(portf))) {
      int which;
      psr_event ev = psr_wait(&procs, 20, -1, &which);
      if (ev == PSR_EV_EXIT) {
        char d[64];
        psr_describe(procs.kids[which].status, d, sizeof d);
        psr_log("%s %s before it was ready", procs.kids[which].label, d);
        status = psr_exit_code(procs.kids[which].status);
        if (!status) status = 1;
        goto teardown;
      }
      if (ev == PSR_EV_SIGNAL) {
        psr_log("stopped by SIG%s while starting", sigabbrev_np(which));
        status = 128 + which;
        goto teardown;
      }
      if (now_s() > deadline) {
        psr_log("ps%d did not report its port within %.0f s", i, PSR_PSD_START_S);
        status = 1;
        goto teardown;
      }
    }
    hlen += (size_t)snprintf(hosts + hlen, sizeof hosts - hlen, "%s%s", i ? "," : "", hp);
    free(hp);
  }

  /* 2. The workers, with the environment libpsclient reads. */
  for (int w = 0; w < W; w++) {
    char e_hosts[16400], e_idx[64], e_nw[64], e_nps[64], e_local[64], e_lw[64], label[32];
    snprintf(e_hosts, sizeof e_hosts, "PS_HOSTS=%s", hosts);
    snprintf(e_idx, sizeof e_idx, "PS_WORKER_INDEX=%d", w);
    snprintf(e_nw, sizeof e_nw, "PS_NUM_WORKERS=%d", W);
    snprintf(e_nps, sizeof e_nps, "PS_NUM_PS=%d", P);
    snprintf(e_local, sizeof e_local, "PS_LOCAL_RANK=%d", P + w);
    snprintf(e_lw, sizeof e_lw, "PS_LOCAL_WORKERS=%d", W); /* they share this machine's cores */
    snprintf(label, sizeof label, "w%d", w);
    char *env[] = {e_hosts, e_idx, e_nw, e_nps, e_local, e_lw, e_secret, "PS_ROLE=worker", NULL};
    if (psr_spawn(&procs, label, 0, o->cmd, env, err, sizeof err) < 0) {
      psr_log("cannot start %s: %s", label, err);
      status = 1;
      goto teardown;
    }
  }

  /* 3. Supervise: a failing task stops the job; signals are forwarded. */
  int workers_left = W;
  double ps_deadline = 0;
  while (psr_alive(&procs)) {
    int which;
    int timeout = ps_deadline ? 200 : -1;
    psr_event ev = psr_wait(&procs, timeout, -1, &which);
    if (ev == PSR_EV_SIGNAL) {
      if (which == SIGTERM || which == SIGINT || which == SIGHUP) {
        psr_log("received SIG%s; stopping all tasks", sigabbrev_np(which));
        if (!status) status = 128 + which;
        goto teardown;
      }
      continue; /* SIGUSR1/2: forwarded, tasks decide */
    }
    if (ev == PSR_EV_EXIT) {
      psr_child *c = &procs.kids[which];
      int code = psr_exit_code(c->status);
      if (code != 0) {
        char d[64];
        psr_describe(c->status, d, sizeof d);
        psr_log("%s %s; stopping all tasks", c->label, d);
        if (code > status) status = code;
        goto teardown;
      }
      if (!c->is_ps && --workers_left == 0) ps_deadline = now_s() + PSR_PSD_EXIT_S;
      /* A ps that exits 0 has seen every worker finish: the workers are
       * only tidying up, so nothing to do. */
    }
    if (ps_deadline && now_s() > ps_deadline) {
      psr_log("parameter servers did not exit within %.0f s after the workers finished",
              PSR_PSD_EXIT_S);
      status = 1;
      goto teardown;
    }
  }
  rm_tree(dir, P);
  return status;

teardown:
  psr_teardown(&procs, o->grace_s);
  for (int i = 0; i < procs.n; i++) {
    /* The worst status wins, but the ones we killed don't count. */
    (void)i;
  }
  rm_tree(dir, P);
  return status ? status : 1;
}
