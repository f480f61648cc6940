/*
 * shmgate.h - where workers hand psd their shared-memory segments
 * (protocol 2.4, docs/protocol.md §1a): an abstract unix socket
 * (SOCK_SEQPACKET) announced in the HelloReply of every worker's TCP
 * connection together with a one-time token. A peer of another uid
 * (SO_PEERCRED) is answered and closed at accept; one of psd's uid sends
 * the token and the ring sizes with the memfd as SCM_RIGHTS; the connection that announced the token gets the segment,
 * checked and mapped by ps__shm_attach, and psd answers with a status and
 * a sentence. Everything is non-blocking, each handover is one message,
 * and at most PSD_SHM_MAX_PENDING peers wait at once, each at most
 * PSD_SHM_HANDOVER_S seconds.
 */
#ifndef PSD_SHMGATE_H
#define PSD_SHMGATE_H

#include <stdint.h>

#include "conn.h"

/* Handover connections open at once: a node's workers hand over one
 * segment per connection, right after their handshake; a peer flooding
 * the socket only evicts its own kind (the oldest waiting handover), and
 * other users' connections never take a slot. */
#define PSD_SHM_MAX_PENDING 32
/* Seconds a handover connection may stay open without its message. */
#define PSD_SHM_HANDOVER_S 5.0

struct event;
struct event_base;
struct psd_shmgate;

/* One accepted handover connection. */
typedef struct psd_shmgate_peer {
  int fd;                     /* -1: free slot */
  struct event *ev;           /* its read readiness */
  double since;               /* when accepted */
  struct psd_shmgate *g;      /* owner */
} psd_shmgate_peer;

typedef struct psd_shmgate {
  int lfd;                    /* listening socket, -1: shm not offered */
  struct event *lev;          /* its accept readiness */
  struct event_base *base;    /* the loop */
  psd_conns *conns;           /* where tokens are looked up */
  char name[64];              /* abstract socket name (no leading NUL) */
  char host_id[PS__SHM_HOST_ID_MAX]; /* this node's boot id */
  psd_shmgate_peer peers[PSD_SHM_MAX_PENDING]; /* handovers in progress */
  uint64_t attached;          /* segments attached so far */
  uint64_t refused;           /* handovers refused */
} psd_shmgate;

/* Opens the socket and registers it with base. 0, or -1 with a sentence
 * in err (g then stays off: lfd -1). */
int psd_shmgate_open(psd_shmgate *g, struct event_base *base, psd_conns *conns, char *err,
                     size_t errlen);
/* A gate that is off (--transport tcp, or open failed). */
void psd_shmgate_off(psd_shmgate *g);
/* Closes handover connections older than PSD_SHM_HANDOVER_S. */
void psd_shmgate_tick(psd_shmgate *g, double now);
/* Closes everything. */
void psd_shmgate_close(psd_shmgate *g);
/* 1 when psd offers shared memory. */
static inline int psd_shmgate_on(const psd_shmgate *g) { return g && g->lfd >= 0; }

#endif
