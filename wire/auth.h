/*
 * auth.h - the credentials a peer puts in its Hello. Internal.
 */
#ifndef PS_WIRE_AUTH_H
#define PS_WIRE_AUTH_H

#include <stddef.h>

/* How a peer proves it belongs to the job. */
typedef struct ps__auth {
  const void *secret;       /* shared secret (may be NULL) */
  size_t secret_len;        /* its bytes */
  int munge;                /* also present a fresh MUNGE credential */
  const char *munge_socket; /* munged socket, NULL: MUNGE's default */
  long long job_id;         /* what the MUNGE payload names */
  long long step_id;        /* ... and the step it names */
} ps__auth;

struct Ps__Hello;
/* Fills the credential fields of h. *mcred gets a MUNGE credential the
 * caller frees once h is packed. 0, PS_ENOMEM or PS_EAUTH with err. */
int ps__hello_auth(struct Ps__Hello *h, const ps__auth *a, char **mcred, char *err,
                   size_t errlen);

#endif /* PS_WIRE_AUTH_H */
