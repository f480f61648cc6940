/*
 * rendezvous.h - the control channel between psrun task 0 and the other
 * tasks of a Slurm step: a typed codec for its messages, line-buffered
 * connections carrying them, and the TCP listen/connect underneath.
 *
 * Wire format: one line per message, words separated by spaces:
 *   RDV PSRUN2 munge|key                                  (0 -> task, first line)
 *   HELLO PSRUN2 <job> <step> <uid> <ntasks> <rank> <node> <localid> <nonce> <proof>
 *                                                         (task -> 0)
 *   ROLE ps|worker <index> <num_ps> <num_workers> <proof> (0 -> task)
 *   REJECT <reason...>                                    (0 -> task)
 *   PSADDR <mac> <host:port>                              (ps task -> 0)
 *   HOSTS <mac> <h1:p1,h2:p2,...>                         (0 -> worker)
 *   MASTER <mac> <host:port>                              (worker 0 -> 0)
 *   WORLD <mac> <local_rank> <local_workers> <host:port>  (0 -> worker)
 *   EXIT <code>                                           (task -> 0)
 *   ABORT <reason...>                                     (0 -> task)
 * RDV carries task 0's choice of authentication to every task; the proofs
 * (a MUNGE credential or an HMAC, rdvauth.h) bind each check-in and each
 * role to the job, step, rank and the member's fresh nonce; the step's
 * secret never appears on the wire in clear; <mac> is an HMAC keyed by
 * that secret, so only a task that verified its role can publish or read
 * addresses. MASTER and WORLD carry torchrun's contract: worker 0's task
 * reports its address and a port free on its node, and every worker gets
 * that MASTER_ADDR:MASTER_PORT with its LOCAL_RANK and LOCAL_WORLD_SIZE
 * (launch.h).
 * A new message is a new psr_msg_type, its fields in psr_msg, and one row
 * of the codec's table in rendezvous.c.
 */
#ifndef PSRUN_RENDEZVOUS_H
#define PSRUN_RENDEZVOUS_H

#include <stddef.h>

#include "layout.h"

/* Control lines are short; a longer one is a protocol error. HOSTS for
 * 4096 ps tasks of ~40 bytes fits. */
#define PSR_LINE_MAX_BYTES (256u * 1024u)
/* Second word of HELLO: the protocol's version. */
#define PSR_HELLO_MAGIC "PSRUN2"
/* A proof word: a MUNGE credential (base64 of a payload of ~200 bytes is
 * under 600) or an HMAC in hex; anything longer is malformed. */
#define PSR_PROOF_MAX 2048
/* Hex digits of a nonce or an HMAC (32 bytes). */
#define PSR_HEX_LEN 64
/* One connection attempt to task 0 may take this long: a SYN into a full
 * listen backlog (a flood) is retried by the kernel for minutes, so the
 * attempt gives up and a fresh one goes on. */
#define PSR_CONNECT_TRY_S 2.0
/* Waits between attempts to reach task 0 (it may not listen yet, or a
 * flood turned us away): from 50 ms, doubling to 1 s, jittered. */
#define PSR_CONNECT_RETRY_FIRST_S 0.05
#define PSR_CONNECT_RETRY_MAX_S 1.0

typedef enum psr_msg_type {
  PSR_MSG_RDV = 0,   /* task 0's greeting: its authentication mode (text) */
  PSR_MSG_HELLO,     /* check-in: who the task is */
  PSR_MSG_ROLE,      /* its role and the step's secret */
  PSR_MSG_REJECT,    /* check-in refused: text says why */
  PSR_MSG_PSADDR,    /* a ps task's psd address: text */
  PSR_MSG_HOSTS,     /* every psd address, in ps order: text */
  PSR_MSG_EXIT,      /* the task's child exited with code */
  PSR_MSG_ABORT,     /* stop now: text says why (may be "") */
  PSR_MSG_MASTER,    /* worker 0's address and MASTER_PORT: text */
  PSR_MSG_WORLD,     /* a worker's local rank, local workers and MASTER: text */
  PSR_MSG_COUNT
} psr_msg_type;

typedef struct psr_hello {
  long long job_id, step_id; /* SLURM_JOB_ID, SLURM_STEP_ID */
  unsigned uid;              /* the task's uid */
  int ntasks;                /* tasks in the step */
  int rank;                  /* SLURM_PROCID */
  char node[PSR_MAX_HOST];   /* SLURMD_NODENAME (one word) */
  int localid;               /* SLURM_LOCALID */
  char nonce[PSR_HEX_LEN + 1]; /* the member's fresh nonce, hex */
  char proof[PSR_PROOF_MAX];   /* MUNGE credential or HMAC over the above */
} psr_hello;

typedef struct psr_assign {
  int is_ps;                  /* ps (else worker) */
  int index;                  /* ps or worker index */
  int num_ps, num_workers;     /* the step's ps and worker counts */
  char proof[PSR_PROOF_MAX];   /* MUNGE credential (carrying the secret) or HMAC */
} psr_assign;

/* One message; only the fields of its type are meaningful. */
typedef struct psr_msg {
  psr_msg_type type;
  psr_hello hello;  /* HELLO */
  psr_assign role;  /* ROLE */
  int code;         /* EXIT */
  int local_rank, local_workers; /* WORLD: among the workers of its node */
  char mac[PSR_HEX_LEN + 1]; /* PSADDR, HOSTS, MASTER, WORLD: HMAC keyed by the secret */
  const char *text; /* RDV (mode), REJECT, ABORT, PSADDR, HOSTS, MASTER, WORLD (not owned) */
} psr_msg;

/* What WORLD's MAC covers: "<local_rank> <local_workers> <host:port>". */
void psr_world_text(const psr_msg *m, char *buf, size_t cap);

/* The message's keyword ("HELLO"...). */
const char *psr_msg_name(psr_msg_type t);
/* Writes m as one line without '\n' into buf. Returns its length, or -1
 * when it does not fit or a field cannot be sent (a word with a space, a
 * text with a newline). */
int psr_msg_encode(const psr_msg *m, char *buf, size_t cap);
/* Parses one line (without '\n') into m; text fields point into line.
 * 0, or -1 for an unknown keyword or malformed fields. */
int psr_msg_decode(const char *line, psr_msg *m);

/* Sends m as one line on fd. 0 or -1. */
int psr_msg_send(int fd, const psr_msg *m);
/* Sends a text message (REJECT, ABORT, PSADDR, HOSTS) with a printf text. */
int psr_send_text(int fd, psr_msg_type t, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Sends EXIT code. */
int psr_send_exit(int fd, int code);

/* A line-buffered control connection. */
typedef struct psr_conn {
  int fd;       /* socket, -1 when closed */
  char *buf;    /* unread input */
  size_t len, cap;
} psr_conn;

/* Returns a malloc'd line (without '\n') if one is buffered or readable
 * now; NULL with *eof set on EOF/error or an oversized line. Non-blocking
 * when `block` is 0. */
char *psr_conn_read_line(psr_conn *c, int block, int *eof);
/* Waits (up to deadline, ps__now() seconds) for one line on c. */
char *psr_conn_wait_line(psr_conn *c, double deadline, int *eof);
/* Closes the socket and frees the buffer (c stays usable as closed). */
void psr_conn_close(psr_conn *c);

/* The peer of socket fd as "ip:port" into out ("?" if unknown). */
void psr_peer_name(int fd, char *out, size_t len);
/* Listens on addr:port (0: any; SO_REUSEADDR); the port in *bound. fd,
 * or -1 with err (a port held by another process says so). */
int psr_tcp_listen(const char *addr, int port, int *bound, char *err, size_t errlen);
/* Connects to psrun task 0 at addr:port, retrying with backoff until
 * deadline; each attempt gives up after PSR_CONNECT_TRY_S. A refused
 * connection is retried only with wait_listen (task 0 may not listen yet;
 * once it greeted us, a refusal means it stopped). fd (blocking) or -1
 * with err. */
int psr_tcp_connect(const char *addr, int port, double deadline, int wait_listen, char *err,
                    size_t errlen);

#endif
