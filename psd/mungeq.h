/*
 * mungeq.h - MUNGE off psd's event loop. Checking a Hello's credential and
 * minting psd's own are round trips to munged (~0.7 ms each, far more when
 * munged is slow or busy), and anyone who can reach the port can send a
 * Hello that asks for them. They run on a background thread (bg.h); the
 * connection reads nothing more until its answer is back, and every other
 * connection is served meanwhile. The Hello is kept packed and replayed.
 */
#ifndef PSD_MUNGEQ_H
#define PSD_MUNGEQ_H

#include <stddef.h>
#include <stdint.h>

#include "bg.h"
#include "config.h"
#include "wire.h"

/* Longest MUNGE credential accepted from a peer: a Hello's whole protobuf
 * part is bounded before the handshake anyway (PS__MAX_PREAUTH_META). */
#define PSD_MUNGE_CRED_MAX PS__MAX_PREAUTH_META

typedef struct psd_mungeq psd_mungeq;

/* One Hello's MUNGE work and its outcome. */
typedef struct psd_munge_req {
  psd_bg_job base;            /* the thread's view (first member) */
  const psd_config *cfg;      /* socket, job and step (not owned) */
  uint64_t conn_seq;          /* the connection it is for (it may close meanwhile) */
  uint8_t sn[PS__NONCE_BYTES];  /* our Challenge's nonce: the credential names it */
  uint8_t cn[PS__NONCE_BYTES];  /* the client's nonce: our credential names it */
  uint8_t *hello;             /* the Hello's packed protobuf part (owned) */
  size_t hello_len;           /* its bytes */
  const uint8_t *cred;        /* the credential, inside hello's unpacked copy */
  size_t cred_len;            /* its bytes */
  void *unpacked;             /* the Ps__Hello cred points into (owned) */
  int rc;                     /* out: 0, or the check's PS_E* code */
  char err[512];              /* out: why not */
  char *mine;                 /* out: psd's credential for the reply (owned), or NULL */
  int mint_rc;                /* out: 0, or why psd's credential failed */
  char mint_err[512];         /* out: ... in a sentence */
} psd_munge_req;

/* Starts the thread. 0, or -1 with err. */
int psd_mungeq_create(psd_mungeq **out, const psd_config *cfg, char *err, size_t errlen);
/* Ends the thread (after what is queued) and frees everything. NULL is a no-op. */
void psd_mungeq_destroy(psd_mungeq *q);
/* Readable while answers wait. */
int psd_mungeq_fd(const psd_mungeq *q);
/* Queues the check of the Hello whose packed bytes are meta[0..len) for
 * connection seq, whose Challenge carried sn. 0, or -1 (out of memory, or
 * not a Hello with a credential). */
int psd_mungeq_submit(psd_mungeq *q, uint64_t seq, const uint8_t sn[PS__NONCE_BYTES],
                      const uint8_t *meta, size_t len);
/* The next answer (the caller frees it with psd_mungeq_req_free), or NULL. */
psd_munge_req *psd_mungeq_done(psd_mungeq *q);
void psd_mungeq_req_free(psd_munge_req *r);
/* Requests queued and not yet taken back. */
uint32_t psd_mungeq_pending(const psd_mungeq *q);

#endif
