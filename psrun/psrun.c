/* psrun.c - psrun: options (one table, parsed by common/opt.c, drives
 * parsing, --help and defaults),
 * validation, and the choice between --local and Slurm mode. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "psclient.h"
#include "psrun.h"

#define F(f) PS_OPT_FIELD(psr_opts, f)

static const ps__opt OPTS[] = {
    {"ps", 0, PS_OPT_INT, F(ps), "1", 1, 65536, NULL, "number of parameter-server tasks"},
    {"local", 0, PS_OPT_FLAG, F(local), "0", 0, 0, NULL,
     "run all tasks on this machine, without Slurm"},
    {"ntasks", 'n', PS_OPT_INT, F(ntasks), "0", 0, 256, NULL, "--local: tasks in all (ps + workers)"},
    {"role", 0, PS_OPT_CHOICE_STR, F(role), "auto", 0, 0, "auto|ps|worker",
     "auto: roles from --ps; ps/worker: this step holds only that role"},
    {"ps-placement", 0, PS_OPT_CHOICE_STR, F(placement), "pack", 0, 0, "pack|spread",
     "pack: the first tasks are ps; spread: ps tasks on different nodes"},
    {"psd", 0, PS_OPT_STR, F(psd), "", 0, 0, NULL, "psd binary (default: next to psrun)"},
    {"psd-arg", 0, PS_OPT_LIST, F(psd_args), NULL, 0, 0, NULL, "extra option for psd (repeatable)"},
    {"iface", 0, PS_OPT_STR, F(iface), "", 0, 0, NULL, "network interface whose address to use"},
    {"addr", 0, PS_OPT_STR, F(addr), "", 0, 0, NULL, "use the address inside this CIDR"},
    {"rendezvous", 0, PS_OPT_STR, F(rendezvous), "", 0, 0, NULL,
     "directory shared by a ps step and its worker steps"},
    {"rendezvous-port", 0, PS_OPT_INT, F(rdv_port), "0", 0, 65535, NULL,
     "task 0's port (default: reserved ports, PMI-2, or derived from the job)"},
    {"rendezvous-auth", 0, PS_OPT_CHOICE_STR, F(rdv_auth), "auto", 0, 0, "auto|munge|key",
     "how the tasks of a step prove themselves (auto: MUNGE if slurm.conf says so)"},
    {"print-plan", 0, PS_OPT_FLAG, F(print_plan), "0", 0, 0, NULL,
     "print each task's role as JSON and start nothing"},
    {"connect-timeout", 0, PS_OPT_DOUBLE, F(timeout_s), "120", 1, 1e6, NULL,
     "seconds for every task to check in"},
    {"grace", 0, PS_OPT_DOUBLE, F(grace_s), "5", 0, 3600, NULL,
     "seconds between SIGTERM and SIGKILL when stopping tasks"},
    {"checkpoint-dir", 0, PS_OPT_STR, F(ckpt_dir), "", 0, 0, NULL,
     "psd checkpoints here and resumes from it; SIGTERM/SIGUSR1 then stop after a checkpoint "
     "(exit 75)"},
    {"checkpoint-every", 0, PS_OPT_INT, F(ckpt_every), "0", 0, 2147483647, NULL,
     "checkpoint every N steps"},
    {"checkpoint-secs", 0, PS_OPT_DOUBLE, F(ckpt_secs), "0", 0, 1e9, NULL,
     "checkpoint every S seconds"},
    {"backup-workers", 0, PS_OPT_INT, F(backup_workers), "0", 0, 65535, NULL,
     "workers the job may lose and go on: psd averages (workers - K) gradients per step"},
    {"restart-workers", 0, PS_OPT_INT, F(restart_workers), "0", 0, 1000000, NULL,
     "restart a dead worker in place (same rank, same environment), up to N times in all "
     "(--local) or per worker task (Slurm)"},
    {"telemetry", 0, PS_OPT_STR, F(telemetry), "", 0, 0, NULL,
     "per-step telemetry as JSON lines: worker i to FILE.w<i>, ps i to FILE.ps<i> (mode "
     "0600; a symbolic link at one is refused)"},
    {"wire-dtype", 0, PS_OPT_CHOICE_STR, F(wire_dtype), NULL, 0, 0, "f32|bf16|fp16",
     "how workers send gradients and receive parameters (PS_WIRE_DTYPE; servers keep "
     "float32; 16-bit needs psd 2.3) [as PS_WIRE_DTYPE in psrun's environment, else f32]"},
    {"transport", 0, PS_OPT_CHOICE_STR, F(transport), "auto", 0, 0, "auto|tcp|shm",
     "how tensors travel between a worker and a ps of its node (psd --transport and the "
     "workers' PS_TRANSPORT): auto (or $PS_TRANSPORT if set) uses shared memory where it "
     "can, shm insists on it"},
};

static const ps__opt_parser PARSER = {
    OPTS, sizeof OPTS / sizeof OPTS[0],
    "usage: psrun [OPTIONS] [--] COMMAND [ARGS...]\n"
    "  srun --ntasks=N psrun --ps=P ./worker ...   # under Slurm\n"
    "  psrun --local -n N --ps P -- ./worker ...   # on this machine\n\n"
    "The first P tasks (or, with --ps-placement=spread, one per node) run psd;\n"
    "the others run COMMAND with PS_HOSTS, PS_WORKER_INDEX, PS_NUM_WORKERS,\n"
    "PS_ROLE and PS_NUM_PS set for libpsclient.\n\n",
    NULL, PS_OPT_POS_STOP, 0, 34};

/* Parses argv into o. Returns 0, 1 (--help printed) or -1 with err. */
static int parse(psr_opts *o, int argc, char **argv, char *err, size_t errlen) {
  memset(o, 0, sizeof *o);
  ps__opt_args rest;
  int rc = ps__opt_parse(&PARSER, o, argc, argv, &rest, err, errlen);
  if (rc != 0) return rc;
  o->cmd = argv + rest.first;
  o->ncmd = argc - rest.first;
  /* --transport auto (the default) defers to $PS_TRANSPORT, so a test run
   * or a site that forces a transport reaches psrun's tasks too. */
  const char *tr = getenv("PS_TRANSPORT");
  if (!strcmp(o->transport, "auto") && tr &&
      (!strcmp(tr, "tcp") || !strcmp(tr, "shm")))
    snprintf(o->transport, sizeof o->transport, "%s", tr);
  return 0;
}

/* psd next to psrun unless --psd says otherwise; must be executable. */
static int find_psd(psr_opts *o, char *err, size_t errlen) {
  if (!o->psd[0]) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 8);
    if (n <= 0) {
      snprintf(err, errlen, "cannot find psrun's own path; give --psd PATH");
      return -1;
    }
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash) strcpy(slash + 1, "psd");
    snprintf(o->psd, sizeof o->psd, "%s", self);
  }
  if (access(o->psd, X_OK) != 0) {
    snprintf(err, errlen, "psd not found or not executable at %s (give --psd PATH): %s",
             o->psd, strerror(errno));
    return -1;
  }
  return 0;
}

int main(int argc, char **argv) {
  psr_log_ident(-1);
  psr_opts o;
  char err[5000];
  int rc = parse(&o, argc, argv, err, sizeof err);
  if (rc == 1) return 0;
  if (rc < 0) {
    fprintf(stderr, "psrun: %s\n", err);
    return 2;
  }
  int needs_cmd = strcmp(o.role, "ps") != 0 && !o.print_plan;
  if (needs_cmd && o.ncmd == 0) {
    fprintf(stderr, "psrun: no worker command given (psrun [OPTIONS] [--] COMMAND ...)\n");
    return 2;
  }
  int needs_psd = strcmp(o.role, "worker") != 0 && !o.print_plan;
  if (needs_psd && find_psd(&o, err, sizeof err) != 0) {
    fprintf(stderr, "psrun: %s\n", err);
    return 2;
  }
  if (o.local) {
    if (o.ntasks < 2) {
      fprintf(stderr, "psrun: --local needs -n N with N >= 2 (ps tasks + workers)\n");
      return 2;
    }
    if (o.ps >= o.ntasks) {
      fprintf(stderr, "psrun: --ps=%d must be less than the number of tasks (%d)\n", o.ps,
              o.ntasks);
      return 2;
    }
    if (o.backup_workers >= o.ntasks - o.ps) {
      fprintf(stderr, "psrun: --backup-workers %d leaves no worker to train (%d workers)\n",
              o.backup_workers, o.ntasks - o.ps);
      return 2;
    }
    return psr_run_local(&o);
  }
  return psr_run_slurm(&o);
}
