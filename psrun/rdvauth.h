/*
 * rdvauth.h - how psrun task 0 and the other tasks of a Slurm step prove
 * themselves to each other on the rendezvous channel (rendezvous.h):
 *   munge  each check-in carries a MUNGE credential restricted to our uid
 *          whose payload binds job, step, rank and the member's nonce;
 *          task 0 answers with its own credential bound to that nonce,
 *          carrying the step's secret (the only place it travels).
 *   key    a 32-byte key only the job's tasks can read (the PMI-2 KVS
 *          under --mpi=pmi2, else a 0600 file in the rendezvous directory,
 *          rdvdir.h) keys HMACs over the same fields; the secret is
 *          derived from the key, never sent.
 * Task 0 picks the mode once (psr_auth_decide) and announces it in RDV.
 */
#ifndef PSRUN_RDVAUTH_H
#define PSRUN_RDVAUTH_H

#include <stddef.h>
#include <stdint.h>

#include "rendezvous.h"
#include "step.h"

/* The key of the key mode: 32 random bytes (as HMAC-SHA-256's block). */
#define PSR_KEY_BYTES 32

typedef enum psr_auth_mode { PSR_AUTH_MUNGE = 0, PSR_AUTH_KEY } psr_auth_mode;

typedef struct psr_auth {
  psr_auth_mode mode;           /* how proofs are made */
  uint8_t key[PSR_KEY_BYTES];   /* the key mode's shared key */
  long long job_id, step_id;    /* what every proof is bound to */
  const char *munge_socket;     /* munged socket, "" for MUNGE's default */
} psr_auth;

/* Task 0's decision, made once: --rendezvous-auth, else MUNGE when
 * slurm.conf's AuthType names it (confirmed by encoding a credential),
 * else the key mode. Sets s->munge and s->munge_socket. A slurm.conf that
 * cannot be read, or MUNGE that slurm.conf names but that does not work,
 * is an error. 0 or -1 with err. */
int psr_auth_decide(psr_step *s, psr_auth_mode *mode, char *err, size_t errlen);
/* "munge" / "key", and back (-1 for anything else). */
const char *psr_auth_mode_name(psr_auth_mode m);
int psr_auth_mode_parse(const char *name);

/* A fresh nonce in hex. 0 or -1. */
int psr_auth_nonce(char out[PSR_HEX_LEN + 1]);
/* Fills h->proof for the check-in h (its nonce already set). 0 or -1. */
int psr_auth_hello_proof(const psr_auth *a, psr_hello *h, char *err, size_t errlen);
/* Task 0: 0 if h's proof is valid for h's job, step, rank and nonce and
 * made by our uid; *uid gets the prover's uid (MUNGE), else -1. -1 with
 * err otherwise. */
int psr_auth_check_hello(const psr_auth *a, const psr_hello *h, long long *uid, char *err,
                         size_t errlen);
/* Task 0: fills r->proof for the member whose check-in is h; secret and
 * munge_socket travel inside it (MUNGE). 0 or -1. */
int psr_auth_role_proof(const psr_auth *a, const psr_hello *h, psr_assign *r, const char *secret,
                        char *err, size_t errlen);
/* Member: 0 if r is task 0's answer to our check-in h; the step's secret
 * into secret (65 bytes) and task 0's munged socket into sock. */
int psr_auth_check_role(const psr_auth *a, const psr_hello *h, const psr_assign *r,
                        char *secret, char *sock, size_t socklen, char *err, size_t errlen);
/* The key mode's secret: derived from the key and the step. 0 or -1. */
int psr_auth_key_secret(const psr_auth *a, char secret[65]);
/* mac = HMAC(secret, kind, rank, nonce, text) in hex: PSADDR and HOSTS. */
int psr_auth_text_mac(const char *secret, const char *kind, int rank, const char *nonce,
                      const char *text, char mac[PSR_HEX_LEN + 1]);
/* 1 if mac is the text's. */
int psr_auth_text_ok(const char *secret, const char *kind, int rank, const char *nonce,
                     const char *text, const char *mac);

/* Key <-> hex (64 digits). */
void psr_auth_key_hex(const uint8_t key[PSR_KEY_BYTES], char out[PSR_HEX_LEN + 1]);
int psr_auth_key_unhex(const char *hex, uint8_t key[PSR_KEY_BYTES]);

#endif
