/* job.c - admission and the workers' lifecycle (see job.h). */
#include "job.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "psdlog.h"
#include "wire.h"

void psd_job_init(psd_job *j, const psd_config *cfg, double now) {
  memset(j, 0, sizeof *j);
  j->cfg = cfg;
  j->started_at = now;
}

void psd_job_free(psd_job *j) {
  free(j->workers);
  j->workers = NULL;
  j->num_workers = 0;
  j->pinned = 0;
}

/* ---- admission ------------------------------------------------------------ */

/* Protocol version, then the client's MUNGE credential (bound to our nonce
 * sn) and its proof by the shared secret over both nonces and its terms:
 * the secret itself never travels. */
static int check_auth(const psd_config *cfg, const Ps__Hello *h, const uint8_t *sn,
                      int munge_rc, const char *munge_err, char *err, size_t errlen) {
  if (h->protocol_version != PS__PROTOCOL_VERSION) {
    snprintf(err, errlen, "protocol version %u, this server speaks %u", h->protocol_version,
             PS__PROTOCOL_VERSION);
    return PS_EVERSION;
  }
  if ((cfg->munge || cfg->secret_len) && h->nonce.len != PS__NONCE_BYTES) {
    snprintf(err, errlen, "authentication failed: no credential (the HELLO carries no "
             "%u-byte nonce)", PS__NONCE_BYTES);
    return PS_EAUTH;
  }
  if (cfg->munge) {
    if (!h->munge) {
      snprintf(err, errlen, "authentication failed: this server requires a MUNGE credential");
      return PS_EAUTH;
    }
    /* munge_decode asks munged (~0.7 ms, more when munged is slow): it ran
     * on mungeq's thread, not here. */
    if (munge_rc == PSD_MUNGE_UNCHECKED) {
      snprintf(err, errlen, "authentication failed: the MUNGE credential was not checked");
      return PS_EINTERNAL;
    }
    if (munge_rc) {
      snprintf(err, errlen, "%s", munge_err);
      return munge_rc;
    }
  }
  if (cfg->secret_len) {
    uint8_t want[PS__MAC_BYTES];
    if (ps__auth_proof(cfg->secret, cfg->secret_len, PS__AUTH_CLIENT, sn, h->nonce.data, h,
                       want) != 0) {
      snprintf(err, errlen, "cannot compute HMAC-SHA-256 (libsodium)");
      return PS_EINTERNAL;
    }
    if (h->proof.len != PS__MAC_BYTES || !ps__mac_equal(h->proof.data, want, PS__MAC_BYTES)) {
      snprintf(err, errlen, "authentication failed: %s credential",
               h->proof.len ? "wrong" : "no");
      return PS_EAUTH;
    }
  }
  return 0;
}

/* A worker's terms on their own and against the command line; fills t. */
static int check_terms(const psd_config *cfg, const Ps__Hello *h, psd_job_terms *t, char *err,
                       size_t errlen) {
  if (h->num_ps != (uint32_t)cfg->num_ps || h->ps_index != (uint32_t)cfg->ps_index) {
    snprintf(err, errlen,
             "client expects ps %u of %u, this is ps %d of %d (check the order of PS_HOSTS)",
             h->ps_index, h->num_ps, cfg->ps_index, cfg->num_ps);
    return PS_EMISMATCH;
  }
  if (h->num_workers > PS__MAX_WORKERS) {
    snprintf(err, errlen, "%u workers is more than the limit of %u", h->num_workers,
             PS__MAX_WORKERS);
    return PS_ETOOBIG;
  }
  if (h->num_workers == 0 || h->worker_index >= h->num_workers) {
    snprintf(err, errlen, "worker index %u is not below the number of workers %u",
             h->worker_index, h->num_workers);
    return PS_EINVAL;
  }
  if (cfg->workers && h->num_workers != (uint32_t)cfg->workers) {
    snprintf(err, errlen, "client says %u workers, this server was started with --workers %d",
             h->num_workers, cfg->workers);
    return PS_EMISMATCH;
  }
  uint32_t want_r = h->replicas_to_aggregate ? h->replicas_to_aggregate
                    : cfg->replicas        ? (uint32_t)cfg->replicas
                                           : h->num_workers;
  if (want_r > h->num_workers) {
    snprintf(err, errlen, "replicas_to_aggregate %u exceeds the number of workers %u", want_r,
             h->num_workers);
    return PS_EINVAL;
  }
  if (cfg->replicas && h->replicas_to_aggregate &&
      h->replicas_to_aggregate != (uint32_t)cfg->replicas) {
    snprintf(err, errlen, "client asks replicas_to_aggregate %u, server has %d",
             h->replicas_to_aggregate, cfg->replicas);
    return PS_EMISMATCH;
  }
  if ((cfg->mode == PSD_MODE_SYNC && h->async_mode) ||
      (cfg->mode == PSD_MODE_ASYNC && !h->async_mode)) {
    snprintf(err, errlen, "client asks %s mode, this server runs %s",
             h->async_mode ? "async" : "sync", h->async_mode ? "sync" : "async");
    return PS_EMISMATCH;
  }
  uint64_t split = h->split_threshold ? h->split_threshold : PS__DEFAULT_SPLIT_THRESHOLD;
  /* Normalized as the placer does (whole floats), so equal placements
   * compare equal. */
  uint64_t maxs = h->max_slice_bytes ? h->max_slice_bytes & ~(uint64_t)3
                                     : PS__DEFAULT_MAX_SLICE_BYTES;
  if (maxs > PS__MAX_SLICE_BYTES || maxs < 4) {
    snprintf(err, errlen, "max_slice_bytes %llu is outside [4, %llu]",
             (unsigned long long)maxs, (unsigned long long)PS__MAX_SLICE_BYTES);
    return PS_EINVAL;
  }
  t->worker = h->worker_index;
  t->num_workers = h->num_workers;
  t->replicas = want_r;
  t->async_mode = h->async_mode != 0;
  t->split_threshold = split;
  t->max_slice_bytes = maxs;
  return 0;
}

/* A pinned job: the terms must be the job's, the worker free to join. */
static int check_pinned(const psd_job *j, const psd_job_terms *t, char *err, size_t errlen) {
  if (t->num_workers != j->num_workers || t->replicas != j->replicas ||
      !t->async_mode != !j->async_mode || t->split_threshold != j->split_threshold ||
      t->max_slice_bytes != j->max_slice_bytes) {
    snprintf(err, errlen,
             "worker %u disagrees with the job: it says %u workers, replicas %u, %s, "
             "split %llu, slices %llu; the job has %u, %u, %s, %llu, %llu",
             t->worker, t->num_workers, t->replicas, t->async_mode ? "async" : "sync",
             (unsigned long long)t->split_threshold, (unsigned long long)t->max_slice_bytes,
             j->num_workers, j->replicas, j->async_mode ? "async" : "sync",
             (unsigned long long)j->split_threshold, (unsigned long long)j->max_slice_bytes);
    return PS_EMISMATCH;
  }
  const psd_job_worker *wk = &j->workers[t->worker];
  if (wk->connected) {
    snprintf(err, errlen, "worker %u is already connected from %s", t->worker, wk->peer);
    return PS_EBUSY;
  }
  if (wk->finished) {
    snprintf(err, errlen, "worker %u has already finished", t->worker);
    return PS_ESTATE;
  }
  return 0;
}

int psd_job_wants_munge(const psd_job *j, const Ps__Hello *h) {
  return j->cfg->munge && h->protocol_version == PS__PROTOCOL_VERSION &&
         h->nonce.len == PS__NONCE_BYTES && h->munge;
}

int psd_job_hello(const psd_job *j, const Ps__Hello *h, const uint8_t *sn, int munge_rc,
                  const char *munge_err, psd_job_terms *t, char *err, size_t errlen) {
  memset(t, 0, sizeof *t);
  int rc = check_auth(j->cfg, h, sn, munge_rc, munge_err, err, errlen);
  if (rc) return rc;
  if (h->role == PS__ROLE__ROLE_ADMIN) {
    t->admin = 1; /* psctl: authenticated, may ask for Stats and nothing else */
    return 0;
  }
  if (h->role != PS__ROLE__ROLE_WORKER) {
    snprintf(err, errlen, "role %d is not supported (only workers and admin tools)",
             (int)h->role);
    return PS_EUNSUPPORTED;
  }
  rc = check_terms(j->cfg, h, t, err, errlen);
  if (rc) return rc;
  if (!j->pinned) {
    t->pin = 1;
    return 0;
  }
  return check_pinned(j, t, err, errlen);
}

int psd_job_pin(psd_job *j, const psd_job_terms *t) {
  j->workers = calloc(t->num_workers, sizeof *j->workers);
  if (!j->workers) return PS_ENOMEM;
  j->num_workers = t->num_workers;
  j->replicas = t->replicas;
  j->async_mode = t->async_mode;
  j->split_threshold = t->split_threshold;
  j->max_slice_bytes = t->max_slice_bytes;
  j->pinned = 1;
  psd_info("training with %u workers, %s, placement split at %llu bytes in %llu-byte slices",
           j->num_workers, j->async_mode ? "async" : "sync",
           (unsigned long long)j->split_threshold, (unsigned long long)j->max_slice_bytes);
  if (!j->async_mode)
    psd_info("sync: averaging %u gradients per step (%u backup workers)", j->replicas,
             j->num_workers - j->replicas);
  return 0;
}

void psd_job_unpin(psd_job *j) { psd_job_free(j); }

/* ---- workers' lifecycle ------------------------------------------------- */

int psd_job_join(psd_job *j, uint32_t w, const char *peer) {
  psd_job_worker *wk = &j->workers[w];
  int rejoin = wk->lost;
  wk->connected = 1;
  wk->joined = 1;
  wk->lost = 0;
  wk->active_at = ps__now();
  snprintf(wk->peer, sizeof wk->peer, "%s", peer);
  return rejoin;
}

void psd_job_active(psd_job *j, uint32_t w, double now) { j->workers[w].active_at = now; }

void psd_job_finished(psd_job *j, uint32_t w) {
  j->workers[w].finished = 1;
  psd_info("worker %u finished", w);
}

void psd_job_left(psd_job *j, uint32_t w, int finished, uint64_t step) {
  psd_job_worker *wk = &j->workers[w];
  wk->connected = 0;
  if (finished) return;
  wk->lost = 1;
  psd_warn("worker %u (%s) left at step %llu without finishing (connection lost)", w,
           wk->peer, (unsigned long long)step);
}

static uint32_t count_lost(const psd_job *j) {
  uint32_t n = 0;
  for (uint32_t w = 0; w < j->num_workers; w++) n += j->workers[w].lost;
  return n;
}

/* Losses tolerated: backup workers in sync mode; all but one in async. */
static uint32_t tolerated(const psd_job *j) {
  if (j->async_mode) return j->num_workers - 1;
  return j->num_workers - j->replicas;
}

static void format_workers(const psd_job *j, int lost, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (uint32_t w = 0; w < j->num_workers && o + 16 < len; w++) {
    const psd_job_worker *k = &j->workers[w];
    int pick = lost ? k->lost : !k->joined;
    if (pick) o += (size_t)snprintf(buf + o, len - o, "%s%u", o ? "," : "", w);
  }
}

int psd_job_check(psd_job *j, const psd_job_stop *st) {
  if (!j->pinned) return PSD_JOB_GO_ON;
  uint32_t done = 0, lost = count_lost(j);
  for (uint32_t w = 0; w < j->num_workers; w++)
    done += j->workers[w].finished || j->workers[w].lost;
  if (st->stopped) {
    /* After the stop checkpoint, a worker that vanished (the launcher
     * killed it) is as good as finished: no grace period to wait out. */
    if (done < j->num_workers) return PSD_JOB_GO_ON;
    psd_info("all workers done after the stop checkpoint (step %llu); exiting with status "
             "%d so the job can be resumed",
             (unsigned long long)st->step, PSD_EXIT_STOPPED);
    return PSD_EXIT_STOPPED;
  }
  if (st->wanted && st->stateless && done == j->num_workers) {
    /* Each step's mean starts afresh: the job's state is on its workers
     * (psd.torch.Checkpoint saved it before they finished). */
    psd_info("all workers done after the stop request; this ps holds only mean variables, "
             "which keep no state, so there is nothing to checkpoint here: exiting with status "
             "%d so the job can be resumed from the workers' own checkpoint",
             PSD_EXIT_STOPPED);
    return PSD_EXIT_STOPPED;
  }
  if (st->wanted && !j->workers[0].connected && !(st->stateless && j->workers[0].finished)) {
    /* Only the chief arranges the stop checkpoint: nothing to wait for,
     * and nothing was saved (the caller logs the newest checkpoint). */
    psd_warn("the chief (worker 0) left before the stop checkpoint; exiting now");
    return PSD_EXIT_NO_CHECKPOINT;
  }
  if (lost > tolerated(j)) {
    if (j->lost_since == 0) {
      char names[256];
      format_workers(j, 1, names, sizeof names);
      j->lost_since = ps__now();
      psd_warn("worker(s) %s lost and training cannot go on without them "
               "(%u lost, %u tolerated); exiting in %.0f s unless they rejoin",
               names, lost, tolerated(j), j->cfg->grace_s);
    }
    return PSD_JOB_GO_ON;
  }
  j->lost_since = 0;
  return done == j->num_workers ? PSD_EXIT_OK : PSD_JOB_GO_ON;
}

void psd_job_say_done(const psd_job *j) {
  uint32_t lost = count_lost(j);
  if (lost)
    psd_warn("all workers done (%u lost, tolerated as backups); exiting", lost);
  else
    psd_info("all %u workers finished; exiting", j->num_workers);
}

/* A worker the job still waits for: connected, not finished. */
static int owes_finish(const psd_job_worker *k) {
  return k->connected && !k->finished && !k->lost;
}

/* How long worker k has been silent since the others were done: from the
 * later of done_at and its last message. */
static double owed_for(const psd_job *j, const psd_job_worker *k, double now) {
  return now - (k->active_at > j->done_at ? k->active_at : j->done_at);
}

/* Tracks done_at (a worker finished, and every other one is finished,
 * lost or connected: none still to join). Returns the shortest owed_for
 * of the workers that owe their finish, or -1 when there are none or the
 * job is not that far: someone still speaking keeps this short, so the
 * wait is named only while all of them are silent. */
static double owed_silence(psd_job *j, double now) {
  uint32_t finished = 0, owing = 0, absent = 0;
  for (uint32_t w = 0; j->pinned && w < j->num_workers; w++) {
    const psd_job_worker *k = &j->workers[w];
    finished += k->finished;
    owing += owes_finish(k);
    absent += !k->finished && !k->lost && !k->connected;
  }
  if (!finished || !owing || absent) {
    j->done_at = 0;
    return -1;
  }
  if (!j->done_at) j->done_at = now;
  double least = -1;
  for (uint32_t w = 0; w < j->num_workers; w++) {
    const psd_job_worker *k = &j->workers[w];
    double owed = owed_for(j, k, now);
    if (owes_finish(k) && (least < 0 || owed < least)) least = owed;
  }
  return least;
}

/* One line per worker the job waits for: which, and that this is normal
 * (evaluating or saving after training), at most every PSD_JOB_WAIT_LOG_S
 * per worker so a long evaluation costs a few lines; or, exiting under
 * --finish-timeout, why. */
static void say_waiting(psd_job *j, double now, int exiting) {
  double bound = j->cfg->finish_timeout_s;
  for (uint32_t w = 0; w < j->num_workers; w++) {
    psd_job_worker *k = &j->workers[w];
    if (!owes_finish(k)) continue;
    double owed = owed_for(j, k, now);
    if (exiting) {
      psd_error("worker %u (from %s) is still connected but has sent nothing for %.0f s "
                "since the other workers finished, past --finish-timeout %g s; exiting with "
                "status %d (did it skip ps_client_finish?)",
                w, k->peer, owed, bound, PSD_EXIT_WORKER_SILENT);
      continue;
    }
    if (k->wait_logged_at && now - k->wait_logged_at < PSD_JOB_WAIT_LOG_S) continue;
    k->wait_logged_at = now;
    char limit[160] = "";
    double left = owed < bound ? bound - owed : 0;
    if (bound > 0)
      snprintf(limit, sizeof limit, " (or, under --finish-timeout %g s, when psd exits %d after "
               "%.0f s more of silence)", bound, PSD_EXIT_WORKER_SILENT, left);
    psd_info("waiting for worker %u (from %s): it is still connected and has been silent for "
             "%.0f s since its last step or request, after the other workers finished; this "
             "is normal while it evaluates or saves after training, and the job ends when it "
             "calls ps_client_finish (Python: client.finish() or leaving the `with` block) or "
             "exits%s",
             w, k->peer, now - k->active_at, limit);
  }
}

/* The wait for workers still connected after the others finished: named
 * once they have been silent --stall-timeout, and as long as they stay
 * connected never an exit (a worker that dies closes its connection and
 * is lost), unless the user bounded it with --finish-timeout. */
static int check_waiting(psd_job *j, double now) {
  double owed = owed_silence(j, now);
  if (owed < 0) return PSD_JOB_GO_ON;
  double bound = j->cfg->finish_timeout_s;
  if (bound > 0 && owed >= bound) {
    say_waiting(j, now, 1);
    return PSD_EXIT_WORKER_SILENT;
  }
  if (owed >= j->cfg->stall_s) say_waiting(j, now, 0);
  return PSD_JOB_GO_ON;
}

int psd_job_tick(psd_job *j, double now, uint64_t step) {
  int waited = check_waiting(j, now);
  if (waited != PSD_JOB_GO_ON) return waited;
  if (j->lost_since && now - j->lost_since >= j->cfg->grace_s) {
    char names[256];
    format_workers(j, 1, names, sizeof names);
    psd_error("worker(s) %s did not come back within the %.0f s grace period; exiting "
              "at step %llu",
              names, j->cfg->grace_s, (unsigned long long)step);
    return PSD_EXIT_WORKER_LOST;
  }
  double t = j->cfg->startup_timeout_s;
  if (t > 0 && now - j->started_at > t) {
    int all = j->pinned;
    for (uint32_t w = 0; all && w < j->num_workers; w++) all = j->workers[w].joined;
    if (!all) {
      char names[256] = "all";
      if (j->pinned) format_workers(j, 0, names, sizeof names);
      psd_error("worker(s) %s never connected within the %.0f s startup timeout; exiting",
                names, t);
      return PSD_EXIT_NO_WORKERS;
    }
  }
  return PSD_JOB_GO_ON;
}

const char *psd_job_worker_state(const psd_job *j, uint32_t w) {
  const psd_job_worker *k = &j->workers[w];
  /* Finished first: a worker that finished may keep its connection open a
   * while (an interpreter exiting), and it owes nothing more. */
  return k->finished ? "finished" : k->connected ? "connected" : k->lost ? "lost" : "absent";
}

uint32_t psd_job_live(const psd_job *j) {
  uint32_t n = 0;
  for (uint32_t w = 0; w < j->num_workers; w++) n += j->workers[w].connected;
  return n;
}
