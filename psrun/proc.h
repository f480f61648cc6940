/*
 * proc.h - psrun's child processes: start them (optionally with their
 * output prefixed line by line, "[w1] ..."), forward signals to them, watch
 * them exit, and tear everything down when one fails. One poll loop, no
 * threads; signals arrive through a self-pipe.
 */
#ifndef PSRUN_PROC_H
#define PSRUN_PROC_H

#include <stddef.h>
#include <sys/types.h>

/* Most children one psrun supervises (--local -n is bounded by this). */
#define PSR_MAX_CHILDREN 256

typedef struct psr_child {
  pid_t pid;            /* 0 once reaped */
  char label[32];       /* "ps0", "w3": for prefixes and messages */
  int is_ps;            /* a psd (else a worker) */
  int out_fd, err_fd;   /* read ends of its stdout/stderr pipes, or -1 */
  char *pend[2];        /* partial output lines not yet printed */
  size_t pend_len[2];
  int status;           /* wait status once reaped */
  int exited;           /* reaped */
  int note_fd;          /* a worker's stop note pipe (read end), or -1 */
  int stopped;          /* its library wrote that the job stopped at a
                           checkpoint (PS_ESTOPPED) before it exited */
} psr_child;

typedef struct psr_procs {
  psr_child kids[PSR_MAX_CHILDREN]; /* started children */
  int n;                            /* how many */
  int prefix;                       /* prefix output lines with [label] */
  int sig_pipe[2];                  /* self-pipe: signal numbers */
  int stopping;                     /* teardown started */
  double stop_deadline;             /* SIGKILL what is left after this */
} psr_procs;

/* Installs signal handlers (SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP,
 * SIGCHLD) that feed the self-pipe. 0 or -1. */
int psr_procs_init(psr_procs *p, int prefix);

/* Starts argv[0] (searched in PATH) with extra environment entries
 * ("NAME=value", NULL-terminated, may be NULL) added. Returns the child's
 * index, or -1 with err. */
int psr_spawn(psr_procs *p, const char *label, int is_ps, char *const *argv,
              char *const *extra_env, char *err, size_t errlen);

/* Events the loop reports. */
typedef enum psr_event {
  PSR_EV_NONE = 0,   /* timeout */
  PSR_EV_EXIT,       /* child *which exited (status in kids[which]) */
  PSR_EV_SIGNAL,     /* a signal *which arrived (already forwarded) */
  PSR_EV_FD          /* the extra fd became readable */
} psr_event;

/* Waits up to timeout_ms (-1: forever) for an event, printing children's
 * output meanwhile. extra_fd (or -1) is watched for readability too. */
psr_event psr_wait(psr_procs *p, int timeout_ms, int extra_fd, int *which);

/* Sends sig to every live child. */
void psr_signal_all(psr_procs *p, int sig);
/* SIGTERM to every live child, then SIGKILL after grace_s; waits for all
 * (printing their remaining output). */
void psr_teardown(psr_procs *p, double grace_s);
/* Exit status for a wait status: the code, or 128 + signal. */
int psr_exit_code(int status);

/* "exited with status 3" / "was killed by SIGKILL" */
void psr_describe(int status, char *buf, size_t len);
/* Live (unreaped) children. */
int psr_alive(const psr_procs *p);

#endif
