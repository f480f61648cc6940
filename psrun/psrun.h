/* psrun.h - shared declarations of the launcher's modules. */
#ifndef PSRUN_H
#define PSRUN_H

#include "layout.h"
#include "log.h"
#include "opt.h"
#include "psclient.h"

/* Exit status of a task (psd or worker) that stopped on request after a
 * checkpoint (SIGTERM/SIGUSR1 with --checkpoint-dir): not a failure, the
 * others follow on their own, and psrun exits with it so a requeue can tell. */
#define PSR_EXIT_STOPPED PS_EXIT_STOPPED /* 75: psclient.h */

/* Seconds the ps tasks have to exit after the last worker did (--local and
 * task 0 under Slurm): psd exits by itself once every worker finished, so
 * a psd still up then waits for a worker that left without
 * ps_client_finish (psd's own --grace-period is 60 s). */
#define PSR_PSD_EXIT_S 30.0

/* psrun's options (one table in psrun.c, parsed by common/opt.c, drives
 * parsing and --help). */
typedef struct psr_opts {
  int ps;                  /* --ps: number of ps tasks */
  int local;               /* --local: run without Slurm */
  int ntasks;              /* --local -n: tasks in all */
  char role[16];           /* --role: auto, ps or worker */
  char placement[16];      /* --ps-placement: pack or spread */
  char psd[4096];          /* --psd: psd binary (default: next to psrun) */
  char iface[64];          /* --iface: network interface to use */
  char addr[64];           /* --addr: CIDR the address must be in */
  char rendezvous[4096];   /* --rendezvous: directory shared by the steps */
  int rdv_port;            /* --rendezvous-port: task 0's port (0: derived) */
  char rdv_auth[16];       /* --rendezvous-auth: auto, munge or key */
  int print_plan;          /* --print-plan: print roles, start nothing */
  double timeout_s;        /* --connect-timeout: peers must appear by then */
  double grace_s;          /* --grace: SIGTERM -> SIGKILL on teardown */
  char ckpt_dir[4096];     /* --checkpoint-dir: psd checkpoints here */
  int ckpt_every;          /* --checkpoint-every N steps */
  double ckpt_secs;        /* --checkpoint-secs S */
  int backup_workers;      /* --backup-workers K: worker losses the job survives */
  int restart_workers;     /* --restart-workers N: dead workers restarted, in all */
  char telemetry[4000];    /* --telemetry: per-step records, FILE.w<i> / FILE.ps<i> */
  char wire_dtype[8];      /* --wire-dtype: workers' PS_WIRE_DTYPE ("": as psrun's) */
  char transport[8];       /* --transport: auto, tcp or shm (psd's option and the
                              workers' PS_TRANSPORT) */
  char **cmd;              /* worker command (points into argv) */
  int ncmd;
  ps__opt_list psd_args;   /* extra psd options (--psd-arg, repeatable) */
} psr_opts;

/* Replicas to aggregate per step for W workers: W - --backup-workers, or
 * PS_REPLICAS_TO_AGGREGATE from psrun's own environment when the option is
 * 0 (so the variable docs/psrun.md documents makes psrun tolerate losses too);
 * 0 when every worker's gradient is needed. Sets *backups to W - R. */
int psr_replicas(const psr_opts *o, int num_workers, int *backups);

/* Why a psd exited with code, for psrun's messages ("" when nothing to add). */
const char *psr_psd_status_says(int code);

struct psr_child;
/* A reaped child's status as psrun counts it: a worker that exited with a
 * status of its choosing after its library said the job stopped at a
 * checkpoint (PS_ESTOPPED; the quick start exits 1 on any error) counts as
 * stopped, PSR_EXIT_STOPPED, so that a launcher requeues it; else the
 * code (psr_exit_code). Logs the change once. */
int psr_child_code(struct psr_child *c);

struct ps__auth;
/* For psrun's message when psd outlives the workers by PSR_PSD_EXIT_S: asks
 * each running psd (hosts: "h:p,h:p" in ps order; running[i] set for ps i
 * still up) for Stats, authenticated with auth, and writes into buf
 * ": psd never saw w1 (lost), w2 (absent) call ps_client_finish (...)",
 * with a clause for a psd that could not be asked; "" when every psd asked
 * reports every worker finished. */
void psr_unfinished(const char *hosts, const int *running, int num_workers,
                    const struct ps__auth *auth, char *buf, size_t len);

/* --local mode (local.c). Returns psrun's exit status. */
int psr_run_local(const psr_opts *o);
/* Slurm mode (slurm.c). Returns psrun's exit status. */
int psr_run_slurm(const psr_opts *o);

/* Shared helpers (psrun_util.c). */

/* Fills out (65 bytes) with a fresh random secret, 64 hex digits. 0 or -1. */
int psr_new_secret(char out[65]);

/* --print-plan: one role as a JSON line on stdout: rank, role, index, node,
 * local_rank (among all the node's tasks) and, for a worker,
 * worker_local_rank (among the node's workers: its LOCAL_RANK). */
void psr_print_role(const psr_role *r, const char *node);

/* Sets the name on psrun's log lines: "psrun", or "psrun[rank]" for rank >= 0. */
void psr_log_ident(int rank);

/* Logs "psrun[rank]: ..." to stderr (common/log.c, the plain style). */
#define psr_log(...) ps__log(PS_LOG_INFO, __VA_ARGS__)

#endif
