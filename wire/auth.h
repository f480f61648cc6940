/*
 * auth.h - how the two ends of a connection prove to each other that they
 * belong to the job, with no secret on the wire (docs/protocol.md,
 * "Handshake"): HMAC-SHA-256 proofs keyed by the shared secret over both
 * nonces and the Hello's terms, and MUNGE credentials restricted to our uid
 * and bound to the peer's nonce. Internal.
 */
#ifndef PS_WIRE_AUTH_H
#define PS_WIRE_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "mac.h"

/* How a peer proves it belongs to the job. */
typedef struct ps__auth {
  const void *secret;       /* shared secret (may be NULL) */
  size_t secret_len;        /* its bytes */
  int munge;                /* also present a fresh MUNGE credential */
  const char *munge_socket; /* munged socket, NULL: MUNGE's default */
  long long job_id;         /* what the MUNGE payload names */
  long long step_id;        /* ... and the step it names (-1: none) */
} ps__auth;

/* Which side a proof or credential comes from: different labels, so a
 * proof of one direction is never accepted for the other (reflection). */
enum { PS__AUTH_CLIENT = 0, PS__AUTH_SERVER = 1 };

struct Ps__Hello;
struct Ps__HelloReply;

/* out = HMAC-SHA-256(secret, label(side) | sn | cn | the Hello's role,
 * worker index and terms). sn: psd's nonce, cn: the client's. 0 or
 * PS_EINTERNAL. */
int ps__auth_proof(const void *secret, size_t secret_len, int side,
                   const uint8_t sn[PS__NONCE_BYTES], const uint8_t cn[PS__NONCE_BYTES],
                   const struct Ps__Hello *h, uint8_t out[PS__MAC_BYTES]);

/* A fresh MUNGE credential restricted to our uid (MUNGE_OPT_UID_RESTRICTION)
 * whose payload names side, job, step and the peer's nonce. *cred is freed
 * by the caller. 0, PS_ENOMEM or PS_EAUTH with err. */
int ps__munge_mint(const char *socket, int side, long long job, long long step,
                   const uint8_t nonce[PS__NONCE_BYTES], char **cred, char *err,
                   size_t errlen);

/* Decodes a peer's credential (munged refuses expired and replayed ones)
 * and checks: our uid, the side, job, step (when step >= 0) and that it is
 * bound to our nonce. 0, PS_ENOMEM or PS_EAUTH with err. */
int ps__munge_check(const char *socket, int side, const void *cred, size_t len,
                    long long job, long long step, const uint8_t nonce[PS__NONCE_BYTES],
                    char *err, size_t errlen);

/* The client's side of the handshake on a connected socket (blocking, with
 * poll, until deadline): reads psd's Challenge, sends *h with a fresh
 * nonce, proof and credential from a, reads the HelloReply and checks
 * psd's proof and credential. who names the server in sentences ("ps 0 at
 * host:port"). *reply (freed with ps__hello_reply__free_unpacked) on
 * success. 0 or a PS_E* code with err. */
int ps__handshake(int fd, const ps__auth *a, struct Ps__Hello *h, const char *who,
                  double deadline, struct Ps__HelloReply **reply, char *err, size_t errlen);

#endif /* PS_WIRE_AUTH_H */
