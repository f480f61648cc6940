/* auth.c - the proofs and credentials of the handshake (see auth.h and
 * docs/protocol.md, "Handshake"), shared by psd, the client library and
 * psctl. The secret itself never leaves the process. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <munge.h>

#include "ps.pb-c.h"
#include "wire.h"

/* Labels of the two directions: a proof made for one is useless for the
 * other, so a peer cannot reflect our own proof back at us. */
static const char *const proof_label[2] = {"psd2 client proof", "psd2 server proof"};
static const char *const side_name[2] = {"client", "server"};

static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (56 - 8 * i));
}

int ps__auth_proof(const void *secret, size_t secret_len, int side,
                   const uint8_t sn[PS__NONCE_BYTES], const uint8_t cn[PS__NONCE_BYTES],
                   const Ps__Hello *h, uint8_t out[PS__MAC_BYTES]) {
  /* The Hello's role, worker and terms, fixed-width: a proof for one
   * worker or one set of terms does not verify for another. */
  const uint64_t terms[] = {(uint64_t)h->role,        h->worker_index,    h->num_workers,
                            h->num_ps,                h->ps_index,        h->replicas_to_aggregate,
                            (uint64_t)h->async_mode,  h->split_threshold, h->max_slice_bytes,
                            (uint64_t)h->munge};
  uint8_t tb[sizeof terms];
  for (size_t i = 0; i < sizeof terms / sizeof terms[0]; i++) put_u64(tb + 8 * i, terms[i]);
  const char *label = proof_label[side != 0];
  ps__mac_part parts[] = {{label, strlen(label) + 1},
                          {sn, PS__NONCE_BYTES},
                          {cn, PS__NONCE_BYTES},
                          {tb, sizeof tb}};
  return ps__hmac(secret, secret_len, parts, sizeof parts / sizeof parts[0], out);
}

/* "psd2 <side> job=J step=S nonce=HEX": S is -1 when no step is set. */
static void munge_payload(char *out, size_t len, int side, long long job, long long step,
                          const uint8_t nonce[PS__NONCE_BYTES]) {
  char hex[2 * PS__NONCE_BYTES + 1];
  for (size_t i = 0; i < PS__NONCE_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", nonce[i]);
  snprintf(out, len, "psd2 %s job=%lld step=%lld nonce=%s", side_name[side != 0], job,
           step, hex);
}

int ps__munge_mint(const char *socket, int side, long long job, long long step,
                   const uint8_t nonce[PS__NONCE_BYTES], char **cred, char *err,
                   size_t errlen) {
  *cred = NULL;
  munge_ctx_t ctx = munge_ctx_create();
  if (!ctx) {
    snprintf(err, errlen, "out of memory");
    return PS_ENOMEM;
  }
  if (socket && socket[0]) munge_ctx_set(ctx, MUNGE_OPT_SOCKET, socket);
  /* Only a process of our own uid may decode it: another user's daemon
   * (a fake psd) learns nothing it could present elsewhere. */
  munge_err_t me = munge_ctx_set(ctx, MUNGE_OPT_UID_RESTRICTION, (uid_t)getuid());
  char payload[200];
  munge_payload(payload, sizeof payload, side, job, step < 0 ? -1 : step, nonce);
  if (me == EMUNGE_SUCCESS) me = munge_encode(cred, ctx, payload, (int)strlen(payload));
  munge_ctx_destroy(ctx);
  if (me != EMUNGE_SUCCESS) {
    free(*cred);
    *cred = NULL;
    snprintf(err, errlen, "cannot get a MUNGE credential%s%s: %s",
             socket && socket[0] ? " from " : "", socket && socket[0] ? socket : "",
             munge_strerror(me));
    return PS_EAUTH;
  }
  return 0;
}

/* Payload against what we expect: side, job and nonce always; the step
 * only when we have one (any step is accepted otherwise). */
static int payload_ok(const char *got, int plen, int side, long long job, long long step,
                      const uint8_t nonce[PS__NONCE_BYTES], char *err, size_t errlen) {
  char gs[200];
  snprintf(gs, sizeof gs, "%.*s", plen > 0 && plen < 199 ? plen : 0, got ? got : "");
  long long gstep = -1;
  const char *sp = strstr(gs, " step=");
  if (sp) gstep = strtoll(sp + 6, NULL, 10);
  /* psd started without --step-id names none (-1) and takes any step. */
  int any = step < 0 || (side == PS__AUTH_SERVER && gstep == -1);
  char want[200];
  munge_payload(want, sizeof want, side, job, any ? gstep : step, nonce);
  if (strcmp(gs, want) == 0) return 0;
  char st[32] = "any";
  if (step >= 0) snprintf(st, sizeof st, "%lld", step);
  snprintf(err, errlen,
           "authentication failed: credential for '%.100s', this is %s job=%lld step=%s "
           "with this connection's nonce",
           gs, side_name[side != 0], job, st);
  return PS_EAUTH;
}

int ps__munge_check(const char *socket, int side, const void *cred, size_t len,
                    long long job, long long step, const uint8_t nonce[PS__NONCE_BYTES],
                    char *err, size_t errlen) {
  if (len == 0 || len > PS__MAX_PREAUTH_META) {
    if (side == PS__AUTH_SERVER)
      snprintf(err, errlen, "authentication failed: the server presented no MUNGE credential");
    else
      snprintf(err, errlen, "authentication failed: this server requires a MUNGE credential");
    return PS_EAUTH;
  }
  char buf[PS__MAX_PREAUTH_META + 1];
  memcpy(buf, cred, len);
  buf[len] = '\0';
  munge_ctx_t ctx = munge_ctx_create();
  if (!ctx) {
    snprintf(err, errlen, "out of memory");
    return PS_ENOMEM;
  }
  if (socket && socket[0]) munge_ctx_set(ctx, MUNGE_OPT_SOCKET, socket);
  void *payload = NULL;
  int plen = 0;
  uid_t uid;
  gid_t gid;
  munge_err_t me = munge_decode(buf, ctx, &payload, &plen, &uid, &gid);
  munge_ctx_destroy(ctx);
  int rc = 0;
  if (me != EMUNGE_SUCCESS) {
    snprintf(err, errlen, "authentication failed: MUNGE credential refused (%s)",
             munge_strerror(me));
    rc = PS_EAUTH;
  } else if (uid != getuid()) {
    snprintf(err, errlen, "authentication failed: credential of uid %u, this job runs as uid %u",
             (unsigned)uid, (unsigned)getuid());
    rc = PS_EAUTH;
  } else {
    rc = payload_ok(payload, plen, side, job, step, nonce, err, errlen);
  }
  free(payload);
  return rc;
}
