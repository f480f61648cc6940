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
  int local_rank;           /* rank among this node's tasks */
  int local_workers;        /* workers sharing this machine (0: unknown) */
  const char *secret;       /* shared secret ("" : none) */
  int munge;                /* authenticate with MUNGE too */
  const char *munge_socket; /* munged socket ("" : default) */
  long long job_id;         /* what MUNGE credentials name */
  long long step_id;        /* ... (-1 for psd: any step of the job) */
  const char *summary;      /* ps0's end-of-run table: file, "-" stdout, NULL none */
} psr_task;

/* Starts psd for task t, waits (bounded) for its port file and returns its
 * "host:port" (malloc'd), or NULL with err (the child is then reaped or
 * left to the caller's teardown). */
char *psr_start_psd(psr_procs *p, const psr_task *t, char *err, size_t errlen);

/* Starts the worker command with the environment libpsclient reads.
 * Returns the child's index, or -1 with err. */
int psr_start_worker(psr_procs *p, const psr_task *t, const char *hosts, char *err,
                     size_t errlen);

#endif
