/* rdvauth.c - proofs on the rendezvous channel: MUNGE credentials or HMACs
 * under a shared key (see rdvauth.h). Crypto comes from wire/mac.h. */
#define _GNU_SOURCE
#include "rdvauth.h"

#include <munge.h>
#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mac.h"

/* The longest payload: the ROLE fields, a secret and a socket path. */
#define PAYLOAD_MAX 1400

const char *psr_auth_mode_name(psr_auth_mode m) { return m == PSR_AUTH_MUNGE ? "munge" : "key"; }

int psr_auth_mode_parse(const char *name) {
  if (strcmp(name, "munge") == 0) return PSR_AUTH_MUNGE;
  if (strcmp(name, "key") == 0) return PSR_AUTH_KEY;
  return -1;
}

static void to_hex(const uint8_t *b, size_t n, char *out) {
  for (size_t i = 0; i < n; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
}

void psr_auth_key_hex(const uint8_t key[PSR_KEY_BYTES], char out[PSR_HEX_LEN + 1]) {
  to_hex(key, PSR_KEY_BYTES, out);
}

int psr_auth_key_unhex(const char *hex, uint8_t key[PSR_KEY_BYTES]) {
  if (strlen(hex) != PSR_HEX_LEN || strspn(hex, "0123456789abcdef") != PSR_HEX_LEN) return -1;
  for (int i = 0; i < PSR_KEY_BYTES; i++) {
    unsigned v;
    if (sscanf(hex + 2 * i, "%2x", &v) != 1) return -1;
    key[i] = (uint8_t)v;
  }
  return 0;
}

int psr_auth_nonce(char out[PSR_HEX_LEN + 1]) {
  uint8_t b[PS__NONCE_BYTES];
  if (ps__random(b, sizeof b) != 0) return -1;
  to_hex(b, sizeof b, out);
  return 0;
}

/* hex(HMAC(key, text)) into out. */
static int hmac_hex(const void *key, size_t keylen, const char *text, char out[PSR_HEX_LEN + 1]) {
  uint8_t mac[PS__MAC_BYTES];
  ps__mac_part part = {text, strlen(text)};
  if (ps__hmac(key, keylen, &part, 1, mac) != 0) return -1;
  to_hex(mac, sizeof mac, out);
  return 0;
}

static int hex_equal(const char *a, const char *b) {
  return strlen(a) == PSR_HEX_LEN && strlen(b) == PSR_HEX_LEN &&
         ps__mac_equal((const uint8_t *)a, (const uint8_t *)b, PSR_HEX_LEN);
}

/* ---- MUNGE ------------------------------------------------------------------- */

static munge_ctx_t munge_ctx(const char *sock) {
  munge_ctx_t ctx = munge_ctx_create();
  if (ctx && sock && *sock) munge_ctx_set(ctx, MUNGE_OPT_SOCKET, sock);
  if (ctx) munge_ctx_set(ctx, MUNGE_OPT_UID_RESTRICTION, getuid());
  return ctx;
}

/* A credential for payload that only our uid can decode. */
static int munge_make(const char *sock, const char *payload, char *out, size_t cap, char *err,
                      size_t errlen) {
  munge_ctx_t ctx = munge_ctx(sock);
  char *cred = NULL;
  munge_err_t me = ctx ? munge_encode(&cred, ctx, payload, (int)strlen(payload)) : EMUNGE_NO_MEMORY;
  if (me != EMUNGE_SUCCESS || !cred || strlen(cred) >= cap) {
    snprintf(err, errlen, "MUNGE cannot make a credential (munged socket %s): %s",
             sock && *sock ? sock : "default", me != EMUNGE_SUCCESS ? munge_strerror(me) : "too long");
    free(cred);
    if (ctx) munge_ctx_destroy(ctx);
    return -1;
  }
  snprintf(out, cap, "%s", cred);
  free(cred);
  munge_ctx_destroy(ctx);
  return 0;
}

/* Decodes cred: its payload (malloc'd, NUL-terminated) and the uid that
 * made it, which must be ours. */
static char *munge_open(const char *sock, const char *cred, long long *uid, char *err,
                        size_t errlen) {
  munge_ctx_t ctx = munge_ctx(sock);
  void *p = NULL;
  int len = 0;
  uid_t u = (uid_t)-1;
  gid_t g;
  munge_err_t me = ctx ? munge_decode(cred, ctx, &p, &len, &u, &g) : EMUNGE_NO_MEMORY;
  if (ctx) munge_ctx_destroy(ctx);
  *uid = me == EMUNGE_SUCCESS || me == EMUNGE_CRED_REPLAYED ? (long long)u : -1;
  char *s = NULL;
  if (me == EMUNGE_SUCCESS && u == getuid() && len > 0 && len < PAYLOAD_MAX) s = strndup(p, (size_t)len);
  if (!s)
    snprintf(err, errlen, "its MUNGE credential is not valid: %s",
             me != EMUNGE_SUCCESS ? munge_strerror(me)
             : u != getuid()      ? "made by another user"
                                  : "bad payload");
  free(p);
  return s;
}

/* Slurm's munged socket (AuthInfo=socket=...) into sock; 1 if slurm.conf
 * says MUNGE, 0 if not, -1 if it cannot be read. */
static int slurm_munge(char *sock, size_t socklen, char *err, size_t errlen) {
  slurm_conf_t *conf = NULL;
  if (slurm_load_ctl_conf((time_t)0, &conf) != 0 || !conf) {
    snprintf(err, errlen, "cannot read Slurm's configuration from slurmctld (%s), so cannot "
                          "tell whether this cluster uses MUNGE; pass --rendezvous-auth=munge "
                          "or --rendezvous-auth=key",
             slurm_strerror(slurm_get_errno()));
    return -1;
  }
  int munge = conf->authtype && strstr(conf->authtype, "munge") != NULL;
  const char *s = conf->authinfo ? strstr(conf->authinfo, "socket=") : NULL;
  if (s) snprintf(sock, socklen, "%.*s", (int)strcspn(s + 7, ","), s + 7);
  slurm_free_ctl_conf(conf);
  return munge;
}

int psr_auth_decide(psr_step *s, psr_auth_mode *mode, char *err, size_t errlen) {
  const char *want = s->o->rdv_auth;
  s->munge_socket[0] = '\0';
  int munge = strcmp(want, "auto") == 0
                  ? slurm_munge(s->munge_socket, sizeof s->munge_socket, err, errlen)
                  : strcmp(want, "munge") == 0;
  if (munge < 0) return -1;
  if (munge && strcmp(want, "munge") == 0) {
    char e2[256]; /* the socket only: the decision is the option's */
    slurm_munge(s->munge_socket, sizeof s->munge_socket, e2, sizeof e2);
  }
  if (munge) { /* confirmed, or an error: never a silent downgrade */
    char cred[PSR_PROOF_MAX], e2[512];
    if (munge_make(s->munge_socket, "PSRUN2 PROBE", cred, sizeof cred, e2, sizeof e2) != 0) {
      snprintf(err, errlen, "%s says MUNGE but %s; start munged or pass --rendezvous-auth=key",
               strcmp(want, "munge") == 0 ? "--rendezvous-auth" : "slurm.conf", e2);
      return -1;
    }
  }
  s->munge = munge;
  *mode = munge ? PSR_AUTH_MUNGE : PSR_AUTH_KEY;
  return 0;
}

/* ---- the proofs -------------------------------------------------------------- */

static void hello_text(const psr_auth *a, const psr_hello *h, char *out, size_t cap) {
  snprintf(out, cap, "PSRUN2 HELLO %lld %lld %d %s", a->job_id, a->step_id, h->rank, h->nonce);
}

/* The ROLE fields every proof covers (the secret and socket are added to
 * MUNGE's payload only). */
static void role_text(const psr_auth *a, const psr_hello *h, const psr_assign *r, char *out,
                      size_t cap) {
  snprintf(out, cap, "PSRUN2 ROLE %lld %lld %d %s %s %d %d %d", a->job_id, a->step_id, h->rank,
           h->nonce, r->is_ps ? "ps" : "worker", r->index, r->num_ps, r->num_workers);
}

int psr_auth_hello_proof(const psr_auth *a, psr_hello *h, char *err, size_t errlen) {
  char text[256];
  hello_text(a, h, text, sizeof text);
  if (a->mode == PSR_AUTH_MUNGE)
    return munge_make(a->munge_socket, text, h->proof, sizeof h->proof, err, errlen);
  if (hmac_hex(a->key, sizeof a->key, text, h->proof) == 0) return 0;
  snprintf(err, errlen, "cannot compute an HMAC");
  return -1;
}

int psr_auth_check_hello(const psr_auth *a, const psr_hello *h, long long *uid, char *err,
                         size_t errlen) {
  char text[256];
  hello_text(a, h, text, sizeof text);
  *uid = -1;
  if (a->mode == PSR_AUTH_KEY) {
    char want[PSR_HEX_LEN + 1];
    if (hmac_hex(a->key, sizeof a->key, text, want) == 0 && hex_equal(want, h->proof)) return 0;
    snprintf(err, errlen, "its proof does not match the job's key");
    return -1;
  }
  char *payload = munge_open(a->munge_socket, h->proof, uid, err, errlen);
  if (!payload) return -1;
  int ok = strcmp(payload, text) == 0;
  free(payload);
  if (!ok) snprintf(err, errlen, "its MUNGE credential names another job, step, rank or nonce");
  return ok ? 0 : -1;
}

int psr_auth_role_proof(const psr_auth *a, const psr_hello *h, psr_assign *r, const char *secret,
                        char *err, size_t errlen) {
  char text[PAYLOAD_MAX];
  role_text(a, h, r, text, sizeof text);
  if (a->mode == PSR_AUTH_KEY) return hmac_hex(a->key, sizeof a->key, text, r->proof);
  size_t n = strlen(text);
  snprintf(text + n, sizeof text - n, " %s %s", secret,
           a->munge_socket && *a->munge_socket ? a->munge_socket : "-");
  return munge_make(a->munge_socket, text, r->proof, sizeof r->proof, err, errlen);
}

int psr_auth_check_role(const psr_auth *a, const psr_hello *h, const psr_assign *r,
                        char *secret, char *sock, size_t socklen, char *err, size_t errlen) {
  char text[PAYLOAD_MAX];
  role_text(a, h, r, text, sizeof text);
  if (a->mode == PSR_AUTH_KEY) {
    char want[PSR_HEX_LEN + 1];
    if (hmac_hex(a->key, sizeof a->key, text, want) != 0 || !hex_equal(want, r->proof)) {
      snprintf(err, errlen, "its answer does not match the job's key");
      return -1;
    }
    snprintf(sock, socklen, "%s", "");
    return psr_auth_key_secret(a, secret);
  }
  long long uid;
  char *payload = munge_open(a->munge_socket, r->proof, &uid, err, errlen);
  if (!payload) return -1;
  size_t n = strlen(text);
  char sec[80], so[1100];
  int ok = strncmp(payload, text, n) == 0 && payload[n] == ' ' &&
           sscanf(payload + n + 1, "%79s %1099s", sec, so) == 2 && strlen(sec) == 64;
  free(payload);
  if (!ok) {
    snprintf(err, errlen, "its MUNGE credential names another job, step, rank, nonce or role");
    return -1;
  }
  memcpy(secret, sec, 65);
  snprintf(sock, socklen, "%s", strcmp(so, "-") == 0 ? "" : so);
  return 0;
}

int psr_auth_key_secret(const psr_auth *a, char secret[65]) {
  char text[128];
  snprintf(text, sizeof text, "PSRUN2 SECRET %lld %lld", a->job_id, a->step_id);
  return hmac_hex(a->key, sizeof a->key, text, secret);
}

static void mac_text(const char *kind, int rank, const char *nonce, const char *text, char **out) {
  if (asprintf(out, "PSRUN2 %s %d %s %s", kind, rank, nonce, text) < 0) *out = NULL;
}

int psr_auth_text_mac(const char *secret, const char *kind, int rank, const char *nonce,
                      const char *text, char mac[PSR_HEX_LEN + 1]) {
  char *t;
  mac_text(kind, rank, nonce, text, &t);
  int rc = t ? hmac_hex(secret, strlen(secret), t, mac) : -1;
  free(t);
  return rc;
}

int psr_auth_text_ok(const char *secret, const char *kind, int rank, const char *nonce,
                     const char *text, const char *mac) {
  char want[PSR_HEX_LEN + 1];
  return psr_auth_text_mac(secret, kind, rank, nonce, text, want) == 0 && hex_equal(want, mac);
}
