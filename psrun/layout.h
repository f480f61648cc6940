/*
 * layout.h - what psrun reads from a Slurm task's environment, and the
 * plan derived from it: which rank runs on which node, and which ranks are
 * parameter servers. Pure functions over explicit inputs (no getenv inside
 * the parsers), so every format is unit-tested.
 */
#ifndef PSRUN_LAYOUT_H
#define PSRUN_LAYOUT_H

#include <stddef.h>

/* Longest host name we keep (Slurm's own limit is 64; be generous). */
#define PSR_MAX_HOST 256

typedef enum psr_dist {
  PSR_DIST_BLOCK = 0,   /* consecutive ranks fill a node, then the next */
  PSR_DIST_CYCLIC,      /* rank r on the next node with room, round robin */
  PSR_DIST_PLANE,       /* blocks of plane_size ranks, round robin */
  PSR_DIST_ARBITRARY,   /* from a hostfile: cannot be derived here */
  PSR_DIST_UNKNOWN      /* anything else: cannot be derived here */
} psr_dist;

/* The task's Slurm environment, as read by psr_env_read(). */
typedef struct psr_env {
  int procid;                 /* SLURM_PROCID: global rank */
  int ntasks;                 /* SLURM_NTASKS (SLURM_STEP_NUM_TASKS) */
  int localid;                /* SLURM_LOCALID */
  int nodeid;                 /* SLURM_NODEID */
  char nodename[PSR_MAX_HOST];/* SLURMD_NODENAME */
  char *nodelist;             /* SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST (owned) */
  const char *nodelist_var;   /* which of the two it came from */
  int num_nodes;              /* SLURM_STEP_NUM_NODES (else SLURM_JOB_NUM_NODES) */
  char *tasks_per_node;       /* SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE) (owned) */
  psr_dist dist;              /* from SLURM_DISTRIBUTION (node level) */
  int plane_size;             /* PSR_DIST_PLANE: ranks per block */
  char *dist_raw;             /* SLURM_DISTRIBUTION as given, or NULL (owned) */
  long long job_id;           /* SLURM_JOB_ID */
  long long step_id;          /* SLURM_STEP_ID */
  int resv_port_lo, resv_port_hi; /* SLURM_STEP_RESV_PORTS (0 if unset) */
  int cpus_per_task;          /* SLURM_CPUS_PER_TASK (0 if unset) */
  char *gpus;                 /* CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS (owned, may be NULL) */
  int het_size;               /* SLURM_HET_SIZE (0: not a heterogeneous step) */
  int pmi2;                   /* PMI_FD set: the step runs with --mpi=pmi2 */
} psr_env;

/* Reads the environment through `get` (getenv in real runs; tests pass
 * their own table). Returns 0, or -1 with a sentence naming the variable
 * and its value in err. On success free with psr_env_free(). */
int psr_env_read(psr_env *e, const char *(*get)(const char *name), char *err,
                 size_t errlen);
void psr_env_free(psr_env *e);

/* Expands a Slurm nodelist ("n[1-4]", "node[01-03,7],gpu-a[1-2]", "a,b,c")
 * with libslurm into *hosts (n entries, each malloc'd; free with
 * psr_hosts_free). `expect` (> 0) is the count Slurm said the list holds:
 * libslurm silently accepts malformed lists (`bad[1-` gives one host), so
 * a different count is an error naming `var` and the value. */
int psr_expand_nodelist(const char *var, const char *list, int expect, char ***hosts,
                        int *n, char *err, size_t errlen);
void psr_hosts_free(char **hosts, int n);

/* Parses a tasks-per-node string ("4,2,1(x2)", "2(x3)", "8") into counts
 * per node: *counts (malloc'd) of *n entries. `var` names it in errors. */
int psr_parse_tasks_per_node(const char *var, const char *s, int **counts, int *n,
                             char *err, size_t errlen);

/* Node index of every rank (node_of[0..ntasks)) for a derivable
 * distribution, from the per-node task counts. -1 with err otherwise
 * (arbitrary/unknown, or counts that do not add up to ntasks). */
int psr_layout(psr_dist dist, int plane_size, const int *counts, int nnodes, int ntasks,
               int *node_of, char *err, size_t errlen);

typedef enum psr_placement {
  PSR_PLACE_PACK = 0,  /* ranks 0..P-1 are the ps tasks */
  PSR_PLACE_SPREAD     /* the first rank of each of the first P nodes */
} psr_placement;

/* One task's role in the plan. */
typedef struct psr_role {
  int rank;         /* global rank */
  int is_ps;        /* parameter server (else worker) */
  int index;        /* ps index or worker index */
  int node;         /* node index (into the expanded nodelist) */
  int local_rank;   /* rank among the tasks of its node */
  int worker_local_rank; /* a worker's index among its node's workers (LOCAL_RANK);
                            -1 for a ps */
  int node_workers; /* workers on its node (a worker's LOCAL_WORLD_SIZE) */
} psr_role;

/* Assigns roles given node_of[] for every rank. spread needs at least P
 * distinct nodes. Returns 0 (roles[0..ntasks) filled) or -1 with err. */
int psr_plan(int ntasks, int num_ps, psr_placement place, const int *node_of,
             psr_role *roles, char *err, size_t errlen);

#endif
