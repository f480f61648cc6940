/* auth.c - the credential part of a Hello, shared by the client library
 * and admin tools (psctl): the shared secret, or a fresh MUNGE credential
 * bound to the job and step with the secret beside it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <munge.h>

#include "ps.pb-c.h"
#include "wire.h"

int ps__hello_auth(Ps__Hello *h, const ps__auth *a, char **mcred, char *err, size_t errlen) {
  *mcred = NULL;
  h->credential.data = (uint8_t *)a->secret;
  h->credential.len = a->secret_len;
  if (!a->munge) return 0;
  /* A fresh credential per connection: munged refuses replays, and the
   * payload binds it to this job and step. */
  munge_ctx_t ctx = munge_ctx_create();
  if (!ctx) {
    snprintf(err, errlen, "out of memory");
    return PS_ENOMEM;
  }
  if (a->munge_socket) munge_ctx_set(ctx, MUNGE_OPT_SOCKET, a->munge_socket);
  char payload[128];
  snprintf(payload, sizeof payload, "psd1 job=%lld step=%lld", a->job_id, a->step_id);
  munge_err_t me = munge_encode(mcred, ctx, payload, (int)strlen(payload));
  munge_ctx_destroy(ctx);
  if (me != EMUNGE_SUCCESS) {
    free(*mcred);
    *mcred = NULL;
    snprintf(err, errlen, "cannot get a MUNGE credential%s%s: %s",
             a->munge_socket ? " from " : "", a->munge_socket ? a->munge_socket : "",
             munge_strerror(me));
    return PS_EAUTH;
  }
  h->credential.data = (uint8_t *)*mcred;
  h->credential.len = strlen(*mcred);
  h->munge = 1;
  h->secret.data = (uint8_t *)a->secret;
  h->secret.len = a->secret_len;
  return 0;
}
