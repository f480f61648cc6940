/* config.h - psd's command-line options. One table (config.c, parsed by
 * common/opt.c) drives parsing, --help and the defaults. */
#ifndef PSD_CONFIG_H
#define PSD_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum { PSD_MODE_AUTO = 0, PSD_MODE_SYNC = 1, PSD_MODE_ASYNC = 2 };
/* --restore: what a psd finding checkpoints at start does with them. */
enum { PSD_RESTORE_LATEST = 0, PSD_RESTORE_FALLBACK = 1, PSD_RESTORE_NONE = 2 };
/* --transport: whether workers on this node get a shared-memory segment. */
enum { PSD_TRANSPORT_AUTO = 0, PSD_TRANSPORT_TCP = 1, PSD_TRANSPORT_SHM = 2 };

typedef struct psd_config {
  char host[256];          /* address to listen on */
  int port;                /* TCP port; 0 picks a free one */
  char port_file[1024];    /* if set, "host:port" is written here atomically */
  int ps_index;            /* this task's index among the ps tasks */
  int num_ps;              /* number of ps tasks in the job */
  int workers;             /* expected workers; 0: learn from the first */
  int replicas;            /* replicas_to_aggregate; 0: all workers/learn */
  int mode;                /* PSD_MODE_*: auto takes the workers' choice */
  double grace_s;          /* how long a lost worker may take to come back */
  double finish_timeout_s; /* after the others finished, how long a connected
                              worker may stay silent before exit 68 (0: as
                              long as it stays connected) */
  double stall_s;          /* a step waiting longer than this is logged */
  double startup_timeout_s;/* all workers must have joined by then; 0: never */
  double pull_timeout_s;   /* default deadline of a parked pull */
  int table_threads;       /* threads for a big table pull or push (0: auto) */
  int log_every;           /* log every Nth applied step */
  int log_level;           /* PSD_LOG_* */
  char name[64];           /* identity in log lines; default "ps<index>" */
  int sock_buf;            /* SO_SNDBUF bytes for connections (0: autotuned) */
  int recv_buf;            /* SO_RCVBUF of paced workers' connections (0: autotuned) */
  int pace_loopback;       /* pace loopback peers too (tests) */
  int pace_ahead;          /* bytes a Push may run ahead of the slowest (0: off) */
  int protocol_minor;      /* the 2.x minor announced to clients: an older one
                              (compatibility tests) also refuses what came later */
  double max_memory;       /* bytes slices may take (0: 90% of RAM or cgroup limit) */
  char max_memory_from[700]; /* where max_memory came from, for the log */
  char secret_file[1024];  /* file (mode 0600) holding the shared secret */
  char secret[256];        /* the secret: from secret_file or $PSD_SECRET */
  size_t secret_len;       /* 0: no authentication (logged as a warning) */
  int munge;               /* require a MUNGE credential from every peer */
  char munge_socket[1024]; /* munged's socket ("" : MUNGE's default) */
  int64_t job_id;          /* --job-id the credentials must name */
  int64_t step_id;         /* --step-id they must name (-1: any step) */
  char ckpt_dir[901];      /* checkpoints go here ("" : none) */
  int ckpt_every;          /* checkpoint every N steps (0: not by steps) */
  double ckpt_secs;        /* ... and/or every S seconds (0: not by time) */
  int ckpt_keep;           /* complete checkpoints kept */
  int restore;             /* PSD_RESTORE_* */
  double stop_timeout_s;   /* after a stop request: wait this long for the
                              stop checkpoint, then exit anyway */
  char telemetry[1024];    /* per-step records as JSON lines ("" : none) */
  char summary[1024];      /* end-of-run table: a file, "-" stderr, "" none */
  int max_conns;           /* open connections (also capped by the descriptor limit) */
  int max_unauth;          /* connections still before their handshake */
  int max_admin;           /* authenticated admin tools (psctl) at once */
  int keepalive_s;         /* a silent dead peer is dropped after about this (0: off) */
  int transport;           /* PSD_TRANSPORT_*: shared memory offered or not */
} psd_config;

/* Fills cfg from argv (defaults first). Returns 0, 1 when --help or
 * --version was printed (exit 0), or -1 with a sentence naming the bad
 * option and value in err. */
int psd_config_parse(psd_config *cfg, int argc, char **argv, char *err,
                     size_t errlen);
void psd_config_usage(FILE *f);

/* Loads the shared secret: --secret-file (must be a regular file of ours
 * with mode 0600: anyone who can read it can join the job) or the
 * environment variable PSD_SECRET, which is then removed from the
 * environment. Returns 0 or -1 with a sentence in err. */
int psd_config_load_secret(psd_config *cfg, char *err, size_t errlen);

#endif
