/* mungeq.c - MUNGE off the event loop (see mungeq.h). */
#include "mungeq.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth.h"

struct psd_mungeq {
  psd_bg *bg;                 /* the thread */
  const psd_config *cfg;      /* options (not owned) */
  uint32_t pending;           /* submitted, not yet taken back (loop only) */
};

/* On the thread: the peer's credential, then (if it passed) ours. */
static void run(psd_bg_job *j) {
  psd_munge_req *r = (psd_munge_req *)j;
  const psd_config *cfg = r->cfg;
  r->rc = ps__munge_check(cfg->munge_socket, PS__AUTH_CLIENT, r->cred, r->cred_len,
                          (long long)cfg->job_id, (long long)cfg->step_id, r->sn, r->err,
                          sizeof r->err);
  if (r->rc) return;
  r->mint_rc = ps__munge_mint(cfg->munge_socket, PS__AUTH_SERVER, (long long)cfg->job_id,
                              (long long)cfg->step_id, r->cn, &r->mine, r->mint_err,
                              sizeof r->mint_err);
}

int psd_mungeq_submit(psd_mungeq *q, uint64_t seq, const uint8_t sn[PS__NONCE_BYTES],
                      const uint8_t *meta, size_t len) {
  psd_munge_req *r = calloc(1, sizeof *r);
  if (!r || len == 0 || len > PSD_MUNGE_CRED_MAX || !(r->hello = malloc(len))) {
    free(r);
    return -1;
  }
  memcpy(r->hello, meta, len);
  r->hello_len = len;
  Ps__Hello *h = ps__hello__unpack(NULL, len, r->hello);
  if (!h || !h->munge || h->nonce.len != PS__NONCE_BYTES) {
    if (h) ps__hello__free_unpacked(h, NULL);
    free(r->hello);
    free(r);
    return -1;
  }
  r->unpacked = h;
  r->cred = h->credential.data;
  r->cred_len = h->credential.len;
  memcpy(r->cn, h->nonce.data, PS__NONCE_BYTES);
  memcpy(r->sn, sn, PS__NONCE_BYTES);
  r->cfg = q->cfg;
  r->conn_seq = seq;
  r->base = (psd_bg_job){.run = run, .post = 1};
  q->pending++;
  psd_bg_push(q->bg, &r->base);
  return 0;
}

psd_munge_req *psd_mungeq_done(psd_mungeq *q) {
  psd_bg_job *j = psd_bg_done(q->bg);
  if (!j) return NULL;
  q->pending--;
  return (psd_munge_req *)j;
}

void psd_mungeq_req_free(psd_munge_req *r) {
  if (!r) return;
  if (r->unpacked) ps__hello__free_unpacked(r->unpacked, NULL);
  free(r->hello);
  free(r->mine);
  free(r);
}

uint32_t psd_mungeq_pending(const psd_mungeq *q) { return q->pending; }

int psd_mungeq_fd(const psd_mungeq *q) { return psd_bg_fd(q->bg); }

int psd_mungeq_create(psd_mungeq **out, const psd_config *cfg, char *err, size_t errlen) {
  *out = NULL;
  psd_mungeq *q = calloc(1, sizeof *q);
  if (!q) {
    snprintf(err, errlen, "out of memory starting the MUNGE thread");
    return -1;
  }
  int e = psd_bg_create(&q->bg);
  if (e) {
    snprintf(err, errlen, "cannot start the MUNGE thread: %s", strerror(e));
    free(q);
    return -1;
  }
  q->cfg = cfg;
  *out = q;
  return 0;
}

void psd_mungeq_destroy(psd_mungeq *q) {
  if (!q) return;
  psd_bg_stop(q->bg);
  for (psd_munge_req *r; (r = psd_mungeq_done(q));) psd_mungeq_req_free(r);
  psd_bg_destroy(q->bg);
  free(q);
}
