/* handshake.c - the client's side of the handshake on a connected socket,
 * blocking until a deadline (docs/protocol.md, "Handshake"): Challenge in,
 * Hello with proof out, HelloReply in and psd's proof checked. Used by the
 * client library before its pump takes over the connection, and by psctl. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "ps.pb-c.h"
#include "wire.h"

static int io_all(int fd, void *buf, size_t len, int wr, double deadline) {
  size_t done = 0;
  while (done < len) {
    double left = deadline - ps__now();
    if (left <= 0) return PS_ETIMEDOUT;
    struct pollfd p = {fd, wr ? POLLOUT : POLLIN, 0};
    int n = poll(&p, 1, (int)(left * 1000) + 1);
    if (n < 0 && errno != EINTR) return PS_EIO;
    if (n <= 0) continue;
    ssize_t k = wr ? send(fd, (char *)buf + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                   : recv(fd, (char *)buf + done, len - done, MSG_DONTWAIT);
    if (k > 0) done += (size_t)k;
    else if (k == 0 || (errno != EAGAIN && errno != EINTR)) return PS_ECLOSED;
  }
  return 0;
}

/* One pre-handshake frame (header rules of ps__header_decode: small, no
 * data), its protobuf part into meta (PS__MAX_PREAUTH_META bytes). */
static int recv_frame(int fd, const char *who, double deadline, ps__frame_header *fh,
                      uint8_t *meta, char *err, size_t errlen) {
  uint8_t hb[PS__HEADER_SIZE];
  int rc = io_all(fd, hb, sizeof hb, 0, deadline);
  char e[256];
  if (!rc && (rc = ps__header_decode(hb, 0, fh, e, sizeof e)) != 0) {
    snprintf(err, errlen, "%s: %s", who, e);
    return rc;
  }
  if (!rc) rc = io_all(fd, meta, fh->meta_len, 0, deadline);
  if (rc == PS_ETIMEDOUT)
    snprintf(err, errlen, "%s accepted the connection but did not answer the handshake", who);
  else if (rc)
    snprintf(err, errlen, "%s closed the connection during the handshake (not a psd of "
             "this protocol version, or it refused us)", who);
  if (!rc && fh->type == PS__MSG_ERROR) {
    ps__pb_alloc pa;
    ps__pb_alloc_init(&pa);
    Ps__Error *m = ps__error__unpack(&pa.a, fh->meta_len, meta);
    rc = m && m->code < 0 ? m->code : pa.failed ? PS_ENOMEM : PS_EPROTO;
    snprintf(err, errlen, "%s: %s", who,
             m && m->message ? m->message
             : pa.failed     ? "out of memory unpacking its ERROR"
                             : "malformed error");
    if (m) ps__error__free_unpacked(m, &pa.a);
  }
  return rc;
}

/* After a handshake frame did not unpack: PS_ENOMEM naming it when an
 * allocation failed, else 0 (it is malformed: the caller says so). */
static int unpack_nomem(const ps__pb_alloc *pa, const char *who, const ps__frame_header *fh,
                        char *err, size_t errlen) {
  if (!pa->failed) return 0;
  snprintf(err, errlen, "out of memory unpacking the %s of %s", ps__msg_name(fh->type), who);
  return PS_ENOMEM;
}

static int send_hello(int fd, const Ps__Hello *h, double deadline) {
  uint8_t buf[PS__HEADER_SIZE + PS__MAX_PREAUTH_META];
  size_t n = ps__hello__get_packed_size(h);
  if (n > PS__MAX_PREAUTH_META) return PS_ETOOBIG;
  ps__header_encode(buf, PS__MSG_HELLO, (uint32_t)n, 0);
  ps__hello__pack(h, buf + PS__HEADER_SIZE);
  return io_all(fd, buf, PS__HEADER_SIZE + n, 1, deadline);
}

/* psd's Challenge: its nonce into sn. */
static int read_challenge(int fd, const char *who, double deadline, uint8_t *sn, char *err,
                          size_t errlen) {
  ps__frame_header fh;
  uint8_t meta[PS__MAX_PREAUTH_META];
  int rc = recv_frame(fd, who, deadline, &fh, meta, err, errlen);
  if (rc) return rc;
  ps__pb_alloc pa;
  ps__pb_alloc_init(&pa);
  Ps__Challenge *m = fh.type == PS__MSG_CHALLENGE
                         ? ps__challenge__unpack(&pa.a, fh.meta_len, meta) : NULL;
  if (!m && (rc = unpack_nomem(&pa, who, &fh, err, errlen)) != 0) return rc;
  if (!m || m->nonce.len != PS__NONCE_BYTES) {
    snprintf(err, errlen, "%s opened the handshake with a malformed %s, not a CHALLENGE", who,
             ps__msg_name(fh.type));
    if (m) ps__challenge__free_unpacked(m, &pa.a);
    return PS_EPROTO;
  }
  memcpy(sn, m->nonce.data, PS__NONCE_BYTES);
  ps__challenge__free_unpacked(m, &pa.a);
  return 0;
}

/* psd's proof by the secret and its MUNGE credential, as a asks. */
static int check_server(const ps__auth *a, const Ps__Hello *h, const uint8_t *sn,
                        const Ps__HelloReply *r, const char *who, char *err, size_t errlen) {
  if (a->secret_len) {
    uint8_t want[PS__MAC_BYTES];
    if (ps__auth_proof(a->secret, a->secret_len, PS__AUTH_SERVER, sn, h->nonce.data, h,
                       want) != 0) {
      snprintf(err, errlen, "cannot compute HMAC-SHA-256 (libsodium)");
      return PS_EINTERNAL;
    }
    if (r->proof.len != PS__MAC_BYTES || !ps__mac_equal(r->proof.data, want, PS__MAC_BYTES)) {
      snprintf(err, errlen,
               "%s did not prove that it knows the job's secret (%s): it is not this job's "
               "psd, or it was started with another secret; refusing to talk to it",
               who, r->proof.len ? "wrong proof" : "no proof");
      return PS_EAUTH;
    }
  }
  if (a->munge) {
    char e[400];
    int rc = ps__munge_check(a->munge_socket, PS__AUTH_SERVER, r->credential.data,
                             r->credential.len, a->job_id, a->step_id, h->nonce.data, e,
                             sizeof e);
    if (rc) {
      snprintf(err, errlen, "%s is not this job's psd: %s", who, e);
      return rc;
    }
  }
  return 0;
}

int ps__handshake(int fd, const ps__auth *a, Ps__Hello *h, const char *who, double deadline,
                  Ps__HelloReply **reply, char *err, size_t errlen) {
  *reply = NULL;
  uint8_t sn[PS__NONCE_BYTES], cn[PS__NONCE_BYTES], proof[PS__MAC_BYTES];
  int rc = read_challenge(fd, who, deadline, sn, err, errlen);
  if (rc) return rc;
  if (ps__random(cn, sizeof cn) != 0) {
    snprintf(err, errlen, "no random bytes for a nonce (libsodium)");
    return PS_EINTERNAL;
  }
  h->nonce.data = cn;
  h->nonce.len = sizeof cn;
  h->munge = a->munge != 0;
  if (a->secret_len) {
    if (ps__auth_proof(a->secret, a->secret_len, PS__AUTH_CLIENT, sn, cn, h, proof) != 0) {
      snprintf(err, errlen, "cannot compute HMAC-SHA-256 (libsodium)");
      return PS_EINTERNAL;
    }
    h->proof.data = proof;
    h->proof.len = sizeof proof;
  }
  char *mcred = NULL;
  if (a->munge) {
    rc = ps__munge_mint(a->munge_socket, PS__AUTH_CLIENT, a->job_id, a->step_id, sn, &mcred,
                        err, errlen);
    if (rc) return rc;
    h->credential.data = (uint8_t *)mcred;
    h->credential.len = strlen(mcred);
  }
  rc = send_hello(fd, h, deadline);
  free(mcred);
  h->credential.data = NULL;
  h->credential.len = 0;
  h->proof.len = 0; /* the caller's Hello keeps no pointer to our stack */
  if (rc) {
    snprintf(err, errlen, "%s: cannot send the HELLO (%s)", who, ps_strerror(rc));
    return rc;
  }
  ps__frame_header fh;
  uint8_t meta[PS__MAX_PREAUTH_META];
  rc = recv_frame(fd, who, deadline, &fh, meta, err, errlen);
  if (rc) return rc;
  ps__pb_alloc pa; /* *reply is freed with the default allocator: the same free() */
  ps__pb_alloc_init(&pa);
  Ps__HelloReply *r = fh.type == PS__MSG_HELLO_REPLY
                          ? ps__hello_reply__unpack(&pa.a, fh.meta_len, meta) : NULL;
  if (!r && (rc = unpack_nomem(&pa, who, &fh, err, errlen)) != 0) return rc;
  if (!r) {
    snprintf(err, errlen, "%s answered the HELLO with a malformed %s", who,
             ps__msg_name(fh.type));
    return PS_EPROTO;
  }
  rc = check_server(a, h, sn, r, who, err, errlen);
  h->nonce.len = 0;
  if (rc) {
    ps__hello_reply__free_unpacked(r, NULL);
    return rc;
  }
  *reply = r;
  return 0;
}
