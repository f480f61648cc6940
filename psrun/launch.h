/*
 * launch.h - how psrun starts its two kinds of task, in --local and Slurm
 * mode alike: psd's command line and environment, and the environment a
 * worker's libpsclient reads. One definition, so both modes agree.
 */
#ifndef PSRUN_LAUNCH_H
#define PSRUN_LAUNCH_H

#include "proc.h"
#include "psrun.h"

/* What a ps or worker task of this run needs to know. */
typedef struct psr_task {
  const psr_opts *o;        /* options (psd path, extra psd args, command) */
  const char *host;         /* address psd listens on */
  int index;                /* ps index or worker index */
  int num_ps;               /* ps tasks in the job */
  int num_workers;          /* workers (0: psd learns it from them) */
  int local_rank;           /* worker: its index among its node's workers (ps
                               tasks not counted): PS_LOCAL_RANK, LOCAL_RANK */
  int local_workers;        /* PS_LOCAL_WORKERS: workers sharing this machine's
                               cores (0: not set; Slurm gives each task its CPUs) */
  int node_workers;         /* workers on this worker's node: LOCAL_WORLD_SIZE */
  const char *master_addr;  /* worker 0's address: MASTER_ADDR */
  int master_port;          /* a port free on worker 0's node: MASTER_PORT */
  const char *secret;       /* shared secret ("" : none) */
  int munge;                /* authenticate with MUNGE too */
  const char *munge_socket; /* munged socket ("" : default) */
  long long job_id;         /* what MUNGE credentials name */
  long long step_id;        /* ... (-1 for psd: any step of the job) */
  const char *summary;      /* ps0's end-of-run table: file, "-" stdout, NULL none */
  int restarts;             /* worker: > 0 when this start is a restart
                               (--restart-workers; the restarts made so far,
                               this one included): PS_WORKER_RESTARTS */
} psr_task;

/* Starts psd for task t, waits (bounded) for its port file and returns its
 * "host:port" (malloc'd), or NULL with err (the child is then reaped or
 * left to the caller's teardown). */
char *psr_start_psd(psr_procs *p, const psr_task *t, char *err, size_t errlen);

/* Starts the worker command with the environment libpsclient reads, and
 * torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
 * MASTER_PORT: torch.distributed's env:// init). Returns the child's index,
 * or -1 with err. */
int psr_start_worker(psr_procs *p, const psr_task *t, const char *hosts, char *err,
                     size_t errlen);

/* A TCP port free on every address of this machine now, for MASTER_PORT
 * (worker 0's torch.distributed TCPStore listens on it). 0, or -1 with err. */
int psr_free_port(int *port, char *err, size_t errlen);

#endif
