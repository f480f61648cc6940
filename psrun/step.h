/*
 * step.h - one task of a Slurm step, as the Slurm modes share it (task 0
 * in task0.c, the other tasks and the entry point in slurm.c, separate ps
 * and worker steps in rdvdir.c): its options, environment, address, role,
 * child process and the loop that supervises it.
 */
#ifndef PSRUN_STEP_H
#define PSRUN_STEP_H

#include "proc.h"
#include "psrun.h"
#include "rendezvous.h"

/* Range of ports derived from the job and step ids: 12000-32767, below
 * Linux's default ephemeral range (32768-60999), so no outgoing connection
 * of the node holds the port by chance; task 0 warns when its node's
 * ip_local_port_range overlaps it. A stranger holding the port is
 * detected (bind fails, and the members never trust a listener that
 * cannot prove itself). Every node must agree, hence fixed, not read
 * from each node's /proc. */
#define PSR_PORT_BASE 12000
#define PSR_PORT_SPAN 20768

typedef struct psr_step {
  const psr_opts *o;
  psr_env env;
  psr_procs procs;
  char addr[64];           /* this task's address */
  psr_role role;           /* this task's role */
  int num_ps, num_workers;
  int child;               /* index of our child in procs, -1 */
  char secret[65];         /* shared secret of this step's psd and workers */
  int munge;               /* the cluster authenticates with MUNGE: so do we */
  char munge_socket[1024]; /* munged socket from Slurm's AuthInfo, or "" */
  int local_rank;          /* worker: its index among its node's workers (LOCAL_RANK) */
  int node_workers;        /* worker: workers on its node (LOCAL_WORLD_SIZE) */
  char master_addr[64];    /* worker: worker 0's address (MASTER_ADDR) */
  int master_port;         /* worker: free on worker 0's node (MASTER_PORT) */
  char *hosts;             /* PS_HOSTS our worker got, for a restart (malloc'd) */
  int restarts;            /* restarts of our worker so far (--restart-workers) */
} psr_step;

/* Address of a Slurm node: its NodeAddr from slurmctld when it has one,
 * else its name resolved. 0 or -1 with err. */
int psr_node_address(const char *node, char *out, size_t len, char *err, size_t errlen);
/* This task's address: --iface NAME, --addr CIDR, or its node's address. */
int psr_own_address(const psr_opts *o, const psr_env *e, char *out, size_t len, char *err,
                    size_t errlen);
/* Rendezvous port when nothing publishes one: derived from job and step. */
int psr_derived_port(const psr_env *e);
/* 1 if port lies in this node's ephemeral range (ip_local_port_range). */
int psr_port_ephemeral(int port);

/* Worker 0's task: MASTER_ADDR is this task's address, MASTER_PORT a port
 * free on this node now (psr_free_port). 0 or -1 with err. */
int psr_step_pick_master(psr_step *s, char *err, size_t errlen);
/* Takes MASTER_ADDR and MASTER_PORT from worker 0's "addr:port". 0 or -1. */
int psr_step_set_master(psr_step *s, const char *hostport);

/* Starts psd for this ps task and returns its "host:port" (malloc'd). */
char *psr_step_start_psd(psr_step *s, char *err, size_t errlen);
/* Starts the worker command for this worker task. 0 or -1 with err. */
int psr_step_start_worker(psr_step *s, const char *hosts, char *err, size_t errlen);

/* Called by psr_supervise every 100 ms: > 0 stops everything with that code. */
typedef int (*psr_peer_cb)(psr_step *s, void *ctx);

/* Supervises our child until it exits, watching the control connection
 * ctl (may be NULL) for ABORT or its loss, or, on task 0, every peer via
 * poll_peers. Returns the child's exit code, or a non-zero code (with
 * *aborted set and the children torn down) when told to stop or when the
 * control channel is lost. */
int psr_supervise(psr_step *s, psr_conn *ctl, psr_peer_cb poll_peers, void *ctx, int *aborted);

#endif
