/* handlers.c - what psd does with each message (see handlers.h). */
#include "handlers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optimizer.h"
#include "psdlog.h"
#include "replies.h"

/* ---- the job's lifecycle ------------------------------------------------- */

void psd_handlers_act(psd_handlers *h, unsigned actions) {
  /* Parked pulls would wait for steps that will never come. */
  if (actions & PSD_PERSIST_WAKE_ALL) {
    psd_waiters_wake_all(h->waiters);
    psd_tables_wake_all(h->tables);
  }
  if (actions & PSD_PERSIST_EXIT_UNSAVED)
    h->finish(h->loop, psd_persist_stop_status(h->persist, "the stop timeout passed"));
}

/* Acts on the exit decision after a worker's state changed. */
static void check_done(psd_handlers *h) {
  if (h->exiting) return;
  const psd_persist *p = h->persist;
  psd_job_stop st = {p->stop_wanted, p->stopped, p->stop_step,
                     p->stop_wanted && psd_persist_stateless(p)};
  int code = psd_job_check(h->job, &st);
  if (code == PSD_JOB_GO_ON) return;
  if (code == PSD_EXIT_NO_CHECKPOINT)
    code = psd_persist_stop_status(h->persist, "the chief left before the stop checkpoint");
  if (code == PSD_EXIT_OK) {
    psd_handlers_act(h, psd_persist_final(h->persist));
    psd_job_say_done(h->job);
  }
  h->finish(h->loop, code);
}

/* Shard hook: queued replies or the checkpoint writer still read sl's
 * parameters in place, and an update is about to change them: give them
 * their own copy. */
static void detach_slice(void *ctx, psd_slice *sl) {
  psd_handlers *h = ctx;
  psd_persist_release(h->persist, sl);
  for (psd_conn *c = h->conns->head; c && sl->readers > 0; c = c->next)
    if (ps__outq_detach(&c->out, sl) < 0)
      psd_conn_error(c, 0, PS_ENOMEM, 1, "out of memory copying a reply");
}

/* The first worker's Hello pins the job: size everything per worker. */
static int pin(psd_handlers *h, const psd_job_terms *t) {
  if (psd_job_pin(h->job, t) != 0) return PS_ENOMEM;
  if (psd_telem_pin(h->telem, t->num_workers) != 0) {
    psd_job_unpin(h->job);
    return PS_ENOMEM;
  }
  psd_shard_init(h->shard, t->num_workers, t->replicas, t->async_mode);
  h->shard->detach = detach_slice;
  h->shard->detach_ctx = h;
  psd_pace_pin(h->pace, t->async_mode, t->replicas, t->num_workers);
  return 0;
}

/* Admits a Hello (job.c decides) and binds c to its worker. 0 or a PS_E*
 * code with err. */
static int hello(psd_handlers *h, psd_conn *c, const Ps__Hello *m, int munge_rc,
                 const char *munge_err, char *err, size_t errlen) {
  psd_job_terms t;
  int rc = psd_job_hello(h->job, m, c->nonce, munge_rc, munge_err, &t, err, errlen);
  if (rc) return rc;
  if (t.admin) {
    c->admin = 1; /* psctl: authenticated, may ask for Stats and nothing else */
    return 0;
  }
  if (t.pin && pin(h, &t) != 0) {
    snprintf(err, errlen, "out of memory for the job's per-worker state");
    return PS_ENOMEM;
  }
  int rejoin = psd_job_join(h->job, t.worker, c->peer);
  c->worker = (int)t.worker;
  snprintf(c->name, sizeof c->name, "w%u", t.worker);
  psd_pace_joined(h->pace, &c->pace, c->fd, c->name);
  psd_info("worker %u %s from %s%s%s", t.worker, rejoin ? "rejoined" : "joined", c->peer,
           m->client_id && m->client_id[0] ? " " : "", PS__ESC(m->client_id));
  if (rejoin) check_done(h);
  return 0;
}

static void worker_finished(psd_handlers *h, psd_conn *c) {
  psd_job_finished(h->job, (uint32_t)c->worker);
  check_done(h);
}

uint64_t psd_handlers_step(const psd_handlers *h) {
  uint64_t s = psd_tables_min_step(h->tables);
  for (uint32_t i = 0; i < h->shard->n; i++)
    if (h->shard->slices[i]->step < s) s = h->shard->slices[i]->step;
  return s == UINT64_MAX ? 0 : s;
}

/* conn.c hook: c is closing. */
static void conn_closed(void *ctx, psd_conn *c) {
  psd_handlers *h = ctx;
  psd_waiters_set_free(h->waiters, &c->waits);
  psd_tables_closed(h->tables, c);
  psd_pace_left(h->pace, &c->pace);
  if (c->worker < 0 || !h->job->pinned || !h->job->workers[c->worker].connected) return;
  if (c->worker == 0) psd_persist_chief_left(h->persist);
  psd_job_left(h->job, (uint32_t)c->worker, c->finished, psd_handlers_step(h));
  if (!c->finished) check_done(h);
}

/* A slice advanced: persistence may capture it, its waiters wake, every
 * Nth step is logged. */
static void slice_advanced(psd_handlers *h, psd_slice *sl) {
  psd_handlers_act(h, psd_persist_slice_advanced(h->persist, sl));
  psd_waiters_wake(h->waiters, sl->id, sl->step);
  if (sl->id == 0 && sl->step > 0 && sl->step % (uint64_t)h->cfg->log_every == 0 &&
      sl->step != h->logged_step) {
    h->logged_step = sl->step;
    psd_info("step %llu applied (%u of %u workers connected, %llu stale gradients dropped)",
             (unsigned long long)sl->step, psd_job_live(h->job), h->job->num_workers,
             (unsigned long long)h->shard->stale_dropped);
  }
}

/* What a failed reserve() says. */
#define NOMEM_TABLES "out of memory for the connection's per-slice tables"

/* Ensures c's per-slice tables cover every slice the shard has. */
static int reserve(psd_handlers *h, psd_conn *c) {
  uint32_t n = h->shard->n;
  if (psd_waiters_set_reserve(h->waiters, &c->waits, n) != 0) return -1;
  return psd_conn_reserve(c, n);
}

/* Bytes one more slice costs beyond its tensors: the shard's slice record,
 * its per-worker push marks, slot and hash bucket, the waiters' parked
 * list head, and in every connection the per-slice tables (reply building,
 * duplicate check, its waitset). --max-memory counts these too, so many
 * tiny slices or many connections cannot exceed it. Tables grow by
 * doubling, hence twice the entry sizes. */
static uint64_t slice_overhead(const psd_handlers *h) {
  uint64_t nconns = 0;
  for (const psd_conn *c = h->conns->head; c; c = c->next) nconns++;
  const psd_conn *c = NULL;
  uint64_t conn = sizeof *c->reply_items + sizeof *c->reply_ptrs + sizeof *c->status +
                  sizeof *c->reply_data + sizeof *c->reply_count + sizeof *c->reply_refs +
                  sizeof *c->seen + sizeof *c->waits.by_slice;
  uint64_t shard = sizeof(psd_slice) + (uint64_t)h->shard->num_workers * sizeof(uint64_t) +
                   4 * sizeof(void *);
  return 2 * (shard + nconns * conn);
}

/* ---- messages ------------------------------------------------------------ */

#define UNPACK(T, fn)                                                         \
  T *m = fn(&c->alloc, c->hdr.meta_len, meta);                                \
  if (!m) {                                                                   \
    psd_conn_unpack_failed(c);                                                \
    return -1;                                                                \
  }

/* Our proof and MUNGE credential (minted off the loop, in mr) into r,
 * bound to the client's nonce: the worker refuses a server that cannot
 * give them. */
static int prove_server(psd_handlers *h, psd_conn *c, const Ps__Hello *m, Ps__HelloReply *r,
                        uint8_t *proof, const psd_munge_req *mr, char *err, size_t errlen) {
  const psd_config *cfg = h->cfg;
  if (cfg->secret_len) {
    if (ps__auth_proof(cfg->secret, cfg->secret_len, PS__AUTH_SERVER, c->nonce, m->nonce.data,
                       m, proof) != 0) {
      snprintf(err, errlen, "cannot compute HMAC-SHA-256 (libsodium)");
      return PS_EINTERNAL;
    }
    r->proof.data = proof;
    r->proof.len = PS__MAC_BYTES;
  }
  if (cfg->munge) {
    if (!mr || mr->mint_rc || !mr->mine) {
      snprintf(err, errlen, "%s", mr && mr->mint_rc ? mr->mint_err : "no MUNGE credential minted");
      return mr && mr->mint_rc ? mr->mint_rc : PS_EINTERNAL;
    }
    r->credential.data = (uint8_t *)mr->mine;
    r->credential.len = strlen(mr->mine);
  }
  return 0;
}

/* Admits or refuses a Hello, with the MUNGE verdict if one was reached
 * (mr; else PSD_MUNGE_UNCHECKED), and answers it. 0 or -1 (CLOSING). */
static int finish_hello(psd_handlers *h, psd_conn *c, const Ps__Hello *m,
                        const psd_munge_req *mr) {
  char err[512];
  Ps__HelloReply r = PS__HELLO_REPLY__INIT;
  uint8_t proof[PS__MAC_BYTES];
  int rc = hello(h, c, m, mr ? mr->rc : PSD_MUNGE_UNCHECKED, mr ? mr->err : "", err,
                 sizeof err);
  if (rc == 0) rc = prove_server(h, c, m, &r, proof, mr, err, sizeof err);
  if (rc != 0) {
    /* A worker admitted by hello() but not proven to stays bound to c and
     * is released when c closes, as any worker that leaves. */
    psd_conn_error(c, 0, rc, 1, "%s", err);
    return -1;
  }
  c->handshaken = 1;
  r.protocol_version = PS__PROTOCOL_VERSION;
  r.protocol_minor = (uint32_t)h->cfg->protocol_minor;
  r.ps_index = (uint32_t)h->cfg->ps_index;
  r.num_ps = (uint32_t)h->cfg->num_ps;
  r.num_workers = h->job->num_workers;
  r.replicas_to_aggregate = h->shard->replicas;
  r.async_mode = h->shard->async_mode;
  r.server_id = (char *)h->cfg->name;
  r.checkpoints = h->cfg->ckpt_dir[0] != '\0';
  if (c->worker >= 0 && h->cfg->protocol_minor >= 4 && psd_shmgate_on(h->shmgate) &&
      ps__random(c->shm_token, sizeof c->shm_token) == 0) {
    /* 2.4 (not with an older --protocol-minor): a worker may hand over a segment */
    c->shm_offered = 1;
    r.shm_socket = h->shmgate->name;
    r.shm_token.data = c->shm_token;
    r.shm_token.len = sizeof c->shm_token;
    r.host_id = h->shmgate->host_id;
  }
  psd_conn_send(c, PS__MSG_HELLO_REPLY, &r.base, NULL, NULL, NULL, 0);
  return 0;
}

static int handle_hello(psd_handlers *h, psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Hello, ps__hello__unpack);
  if (!psd_job_wants_munge(h->job, m)) return finish_hello(h, c, m, NULL);
  /* munged's round trips run on mungeq's thread; c reads nothing more
   * until psd_handlers_munge_done replays this Hello with the verdict. */
  if (psd_mungeq_submit(h->mungeq, c->seq, c->nonce, meta, c->hdr.meta_len) != 0) {
    psd_conn_error(c, 0, PS_ENOMEM, 1, "out of memory checking a MUNGE credential");
    return -1;
  }
  c->auth_wait = 1;
  return 0;
}

void psd_handlers_munge_done(psd_handlers *h) {
  for (psd_munge_req *r; (r = psd_mungeq_done(h->mungeq)); psd_mungeq_req_free(r)) {
    psd_conn *c = psd_conns_find(h->conns, r->conn_seq);
    if (!c || !c->auth_wait) continue; /* it closed (or was evicted) meanwhile */
    finish_hello(h, c, r->unpacked, r);
    psd_conn_auth_done(c);
  }
  psd_conns_reap(h->conns);
}

/* conn.c hook: a connection was accepted. The Challenge goes first, so the
 * client's proof and credential can be bound to our fresh nonce. */
static int on_opened(void *ctx, psd_conn *c) {
  psd_handlers *h = ctx;
  if (ps__random(c->nonce, sizeof c->nonce) != 0) {
    psd_conn_error(c, 0, PS_EINTERNAL, 1, "no random bytes for a nonce (libsodium)");
    return -1;
  }
  Ps__Challenge ch = PS__CHALLENGE__INIT;
  ch.protocol_version = PS__PROTOCOL_VERSION;
  ch.nonce.data = c->nonce;
  ch.nonce.len = sizeof c->nonce;
  ch.secret = h->cfg->secret_len > 0;
  ch.munge = h->cfg->munge != 0;
  psd_conn_send(c, PS__MSG_CHALLENGE, &ch.base, NULL, NULL, NULL, 0);
  psd_conn_write(c);
  return 0;
}

/* PS_ETOOBIG (err set) if one more slice of length elements would take the
 * server past --max-memory: its tensors plus every slice's tables. */
static int check_memory(const psd_handlers *h, const char *name, uint64_t length,
                        const ps_optimizer *opt, uint64_t per_slice, char *err,
                        size_t errlen) {
  uint64_t need = length * sizeof(float) * (2 + psd_opt_state_per_elem(opt));
  uint64_t tables = ((uint64_t)h->shard->n + 1) * per_slice;
  uint64_t sparse = psd_tables_reserved(h->tables) + psd_persist_held_bytes(h->persist);
  if ((double)(h->shard->bytes_alloc + need + tables + sparse) <= h->cfg->max_memory) return 0;
  snprintf(err, errlen,
           "variable '%s': %llu more bytes would take this server past --max-memory "
           "(%.0f bytes; slices hold %llu, per-slice tables %llu, sparse tables reserve %llu "
           "with their checkpoint copies)",
           PS__ESC(name), (unsigned long long)need, h->cfg->max_memory,
           (unsigned long long)h->shard->bytes_alloc, (unsigned long long)tables,
           (unsigned long long)sparse);
  return PS_ETOOBIG;
}

static int handle_register(psd_handlers *h, psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Register, ps__register__unpack);
  Ps__SliceState *states = NULL;
  Ps__SliceState **sptrs = NULL;
  if (m->n_slices) {
    states = calloc(m->n_slices, sizeof *states);
    sptrs = calloc(m->n_slices, sizeof *sptrs);
    if (!states || !sptrs) {
      free(states);
      free(sptrs);
      psd_conn_error(c, m->request_id, PS_ENOMEM, 0, "out of memory for a register reply");
      return 0;
    }
  }
  char err[512];
  int rc = 0;
  uint64_t per_slice = slice_overhead(h);
  for (size_t i = 0; i < m->n_slices && rc == 0; i++) {
    const Ps__SliceSpec *sp = m->slices[i];
    const char *name = sp->name ? sp->name : "";
    uint64_t numel = 1;
    rc = PS_EINVAL;
    if (!name[0] || strlen(name) > PS_MAX_NAME)
      snprintf(err, sizeof err, "variable name must be 1 to %d bytes", PS_MAX_NAME);
    else if (sp->dtype != 1)
      snprintf(err, sizeof err, "variable '%s': dtype %u is not supported (only 1 = float32)",
               PS__ESC(name), sp->dtype);
    else if (sp->n_shape < 1 || sp->n_shape > PS_MAX_DIMS)
      snprintf(err, sizeof err, "variable '%s': %zu dimensions (must be 1 to %d)",
               PS__ESC(name), sp->n_shape, PS_MAX_DIMS);
    else
      rc = 0;
    for (size_t d = 0; rc == 0 && d < sp->n_shape; d++)
      if (sp->shape[d] == 0 || ps__mul_u64(numel, sp->shape[d], &numel)) {
        snprintf(err, sizeof err, "variable '%s': dimension %zu is zero or the size overflows",
                 PS__ESC(name), d);
        rc = PS_ESHAPE;
      }
    if (rc == 0 && sp->length > PS__MAX_SLICE_BYTES / sizeof(float)) {
      snprintf(err, sizeof err,
               "variable '%s': slice of %llu elements exceeds the %llu-byte slice limit",
               PS__ESC(name), (unsigned long long)sp->length,
               (unsigned long long)PS__MAX_SLICE_BYTES);
      rc = PS_ETOOBIG;
    }
    if (rc == 0)
      rc = ps__placement_check((uint32_t)h->cfg->num_ps, (uint32_t)h->cfg->ps_index,
                               h->job->split_threshold, h->job->max_slice_bytes, numel,
                               sp->offset, sp->length, err, sizeof err);
    ps_optimizer opt;
    ps__opt_from_msg(sp->optimizer, &opt);
    if (rc == 0) {
      char e2[400];
      rc = psd_opt_validate(&opt, e2, sizeof e2);
      if (rc) snprintf(err, sizeof err, "variable '%s': %s", PS__ESC(name), e2);
      else if (ps__opt_min_minor(&opt) > h->cfg->protocol_minor) {
        /* psd --protocol-minor below the newest (a test of older servers) refuses
         * what it does not announce, as an older psd would. */
        snprintf(err, sizeof err, "variable '%s': %s needs protocol 2.%d; this psd speaks 2.%d",
                 PS__ESC(name), ps__opt_min_minor_what(&opt), ps__opt_min_minor(&opt),
                 h->cfg->protocol_minor);
        rc = PS_EUNSUPPORTED;
      }
    }
    if (rc == 0) rc = check_memory(h, name, sp->length, &opt, per_slice, err, sizeof err);
    if (rc == 0 && h->shard->n >= PS__MAX_SLICES) {
      snprintf(err, sizeof err, "this server already holds %u slices (the limit)",
               PS__MAX_SLICES);
      rc = PS_ETOOBIG;
    }
    psd_slice *sl = NULL;
    if (rc == 0)
      rc = psd_shard_register(h->shard, name, (uint32_t)sp->n_shape, sp->shape,
                              sp->offset, sp->length, &opt, c->worker, &sl, err, sizeof err);
    if (rc == 0) rc = psd_persist_restore_slice(h->persist, sl, err, sizeof err);
    if (rc == 0) {
      ps__slice_state__init(&states[i]);
      states[i].slice_id = sl->id;
      states[i].initialized = sl->initialized;
      states[i].step = sl->step;
      sptrs[i] = &states[i];
    }
  }
  if (rc == 0 && reserve(h, c) != 0) {
    rc = PS_ENOMEM;
    snprintf(err, sizeof err, NOMEM_TABLES);
  }
  if (rc != 0) {
    psd_conn_error(c, m->request_id, rc, 0, "%s", err);
  } else {
    Ps__RegisterReply r = PS__REGISTER_REPLY__INIT;
    r.request_id = m->request_id;
    r.n_slices = m->n_slices;
    r.slices = sptrs;
    psd_conn_send(c, PS__MSG_REGISTER_REPLY, &r.base, NULL, NULL, NULL, 0);
  }
  free(states);
  free(sptrs);
  return 0;
}

/* A wire dtype a peer named (what: "PUSH item of 'w'"): known, and
 * announced by this server (16-bit needs minor 3). 0, or -1 (CLOSING). */
static int check_dtype(psd_handlers *h, psd_conn *c, uint64_t req, uint32_t dt,
                       const char *what) {
  if (!ps__dtype_valid(dt)) {
    psd_conn_error(c, req, PS_EPROTO, 1,
                   "%s names wire dtype %u (known: 0 float32, 1 bfloat16, 2 fp16)", what, dt);
    return -1;
  }
  if (dt != PS__DT_F32 && h->cfg->protocol_minor < 3) {
    psd_conn_error(c, req, PS_EUNSUPPORTED, 1,
                   "%s asks for %s data, which needs protocol 2.3; this server announced 2.%d",
                   what, ps__dtype_name(dt), h->cfg->protocol_minor);
    return -1;
  }
  return 0;
}

/* Makes c's 16-bit staging hold n values (a 16-bit item lands there and
 * is widened into c->stage). 0 or -1 (memory). */
static int stage16_reserve(psd_conn *c, uint64_t n) {
  if (n <= c->stage16_cap) return 0;
  uint16_t *ns = NULL;
  if (posix_memalign((void **)&ns, 64, n * sizeof *ns) != 0) return -1;
  free(c->stage16);
  c->stage16 = ns;
  c->stage16_cap = n;
  return 0;
}

/* Checks the items of a Push/Init against the shard and the data length
 * (each item count x its dtype's size), then enters DATA. */
static int begin_data(psd_handlers *h, psd_conn *c, uint64_t req, uint64_t step,
                      Ps__Item **items, size_t n) {
  psd_shard *sh = h->shard;
  uint64_t total = 0, maxlen = 0, max16 = 0;
  if (n > sh->n) {
    psd_conn_error(c, req, PS_EPROTO, 1, "%s with %zu items but only %u slices exist",
                   ps__msg_name(c->hdr.type), n, sh->n);
    return -1;
  }
  if (reserve(h, c) != 0) {
    psd_conn_error(c, req, PS_ENOMEM, 1, NOMEM_TABLES);
    return -1;
  }
  psd_conn_seen_begin(c);
  for (size_t i = 0; i < n; i++) {
    const Ps__Item *it = items[i];
    if (it->slice_id >= sh->n) {
      psd_conn_error(c, req, PS_ENOTFOUND, 1, "%s names unknown slice id %u",
                     ps__msg_name(c->hdr.type), it->slice_id);
      return -1;
    }
    psd_slice *sl = sh->slices[it->slice_id];
    if (psd_conn_seen_twice(c, it->slice_id)) {
      psd_conn_error(c, req, PS_EPROTO, 1, "%s lists slice %u of '%s' twice",
                     ps__msg_name(c->hdr.type), it->slice_id, PS__ESC(sl->name));
      return -1;
    }
    if (it->n_rows || it->row_width) {
      psd_conn_error(c, req, PS_EUNSUPPORTED, 1,
                     "row-sparse update of '%s' is not supported by this server",
                     PS__ESC(sl->name));
      return -1;
    }
    if (it->count != sl->length) {
      psd_conn_error(c, req, PS_ESHAPE, 1,
                     "%s of '%s' (slice at %llu) carries %llu values, the slice has %llu",
                     ps__msg_name(c->hdr.type), PS__ESC(sl->name), (unsigned long long)sl->offset,
                     (unsigned long long)it->count, (unsigned long long)sl->length);
      return -1;
    }
    char what[PS__ESC_BYTES + 40];
    snprintf(what, sizeof what, "%s item of '%s'", ps__msg_name(c->hdr.type),
             PS__ESC(sl->name));
    if (check_dtype(h, c, req, it->dtype, what) != 0) return -1;
    total += it->count * ps__dtype_size(it->dtype); /* each <= 64M, n <= 1M: no overflow */
    if (it->count > maxlen) maxlen = it->count;
    if (it->dtype != PS__DT_F32 && it->count > max16) max16 = it->count;
  }
  if (total != c->hdr.data_len) {
    psd_conn_error(c, req, PS_EPROTO, 1,
                   "%s items add up to %llu bytes (count x 4 for float32, x 2 for bfloat16 "
                   "and fp16) but the frame carries %llu",
                   ps__msg_name(c->hdr.type), (unsigned long long)total,
                   (unsigned long long)c->hdr.data_len);
    return -1;
  }
  if (stage16_reserve(c, max16) != 0) {
    psd_conn_error(c, req, PS_ENOMEM, 1, "out of memory for a %llu-value slice",
                   (unsigned long long)max16);
    return -1;
  }
  if (maxlen > c->stage_cap) {
    float *ns = NULL;
    if (posix_memalign((void **)&ns, 64, maxlen * sizeof(float)) != 0) {
      psd_conn_error(c, req, PS_ENOMEM, 1, "out of memory for a %llu-value slice",
                     (unsigned long long)maxlen);
      return -1;
    }
    free(c->stage);
    c->stage = ns;
    c->stage_cap = maxlen;
  }
  /* Data over TCP from a worker with a segment: its push ring was full. */
  if (c->shm.map && !c->shm_src && c->hdr.data_len) psd_telem_shm_tcp(h->telem, c->worker);
  c->items = items;
  c->n_items = n;
  c->item = 0;
  c->item_got = 0;
  if (step != c->data_step || c->hdr.type != PS__MSG_PUSH) c->pace_done = 0;
  c->data_step = step;
  c->data_req = req;
  psd_conn_set_state(c, PSD_CONN_DATA);
  return 0;
}

static int handle_push(psd_handlers *h, psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Push, ps__push__unpack);
  if (c->worker < 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1, "PUSH from a connection that is not a worker");
    return -1;
  }
  if (c->finished) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1, "PUSH after FINISH");
    return -1;
  }
  if (reserve(h, c) != 0) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 1, NOMEM_TABLES);
    return -1;
  }
  if (m->want_stop && h->cfg->ckpt_dir[0] && h->job->pinned) {
    char who[32];
    snprintf(who, sizeof who, "worker %d", c->worker);
    psd_persist_stop_wanted(h->persist, who);
  }
  c->data_rc = 0;
  c->data_err[0] = '\0';
  return begin_data(h, c, m->request_id, m->step, m->items, m->n_items);
}

static int handle_init(psd_handlers *h, psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Init, ps__init__unpack);
  if (c->worker != 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1,
                   m->assign ? "INIT with assign from %s: only the chief (worker 0) assigns "
                               "variables"
                             : "INIT from %s: only the chief (worker 0) initializes variables",
                   c->worker < 0 ? "a connection that is not a worker" : c->name);
    return -1;
  }
  /* Items and lengths are checked by begin_data before anything is read;
   * each item's step rule when its values are in (item_done). */
  c->data_assign = m->assign;
  c->data_rc = 0;
  c->data_err[0] = '\0';
  return begin_data(h, c, m->request_id, m->assign ? m->step : 0, m->items, m->n_items);
}

static int handle_pull(psd_handlers *h, psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Pull, ps__pull__unpack);
  psd_shard *sh = h->shard;
  if (c->worker < 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1, "PULL from a connection that is not a worker");
    return -1;
  }
  if (reserve(h, c) != 0) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 1, NOMEM_TABLES);
    return -1;
  }
  if (check_dtype(h, c, m->request_id, m->dtype, "PULL") != 0) return -1;
  psd_conn_seen_begin(c);
  for (size_t i = 0; i < m->n_slice_ids; i++) {
    uint32_t id = m->slice_ids[i];
    if (id >= sh->n) {
      psd_conn_error(c, m->request_id, PS_ENOTFOUND, 1, "PULL names unknown slice id %u", id);
      return -1;
    }
    if (psd_conn_seen_twice(c, id)) {
      psd_conn_error(c, m->request_id, PS_EPROTO, 1, "PULL lists slice %u of '%s' twice", id,
                     PS__ESC(sh->slices[id]->name));
      return -1;
    }
    if (psd_waiters_set_busy(&c->waits, id)) {
      psd_conn_error(c, m->request_id, PS_EBUSY, 0,
                     "a pull of '%s' is already being answered on this connection",
                     PS__ESC(sh->slices[id]->name));
      return 0;
    }
  }
  if (m->average) return psd_replies_pull_average(h, c, m);
  double now = ps__now();
  double timeout = m->timeout_ms ? m->timeout_ms / 1000.0 : h->cfg->pull_timeout_s;
  for (size_t i = 0; i < m->n_slice_ids; i++) {
    uint32_t id = m->slice_ids[i];
    psd_slice *sl = sh->slices[id];
    /* Once the job stops, every pull is answered at once (flagged). */
    int now_ok = sl->initialized && (sl->step >= m->min_step || h->persist->stopped);
    if (psd_waiters_pull_dtype(h->waiters, &c->waits, id, m->request_id, m->min_step,
                               now + timeout, now_ok, m->dtype) != 0) {
      psd_conn_error(c, m->request_id, PS_ENOMEM, 1, "out of memory parking a pull of '%s'",
                     PS__ESC(sl->name));
      return -1;
    }
  }
  if (m->n_slice_ids == 0) {
    Ps__PullReply r = PS__PULL_REPLY__INIT;
    r.request_id = m->request_id;
    psd_persist_flags(h->persist, &r.want_checkpoint, &r.want_stop, &r.stop_step, &r.stopped);
    psd_conn_send(c, PS__MSG_PULL_REPLY, &r.base, NULL, NULL, NULL, 0);
  }
  return 0;
}

static int handle_finish(psd_handlers *h, psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Finish, ps__finish__unpack);
  if (c->worker < 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1, "FINISH from a connection that is not a worker");
    return -1;
  }
  Ps__Ack a = PS__ACK__INIT;
  a.request_id = m->request_id;
  psd_conn_send(c, PS__MSG_ACK, &a.base, NULL, NULL, NULL, 0);
  psd_telem_finish(h->telem, c->worker, m->summary);
  if (!c->finished) {
    c->finished = 1;
    worker_finished(h, c);
  }
  return 0;
}

static int handle_checkpoint(psd_handlers *h, psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Checkpoint, ps__checkpoint__unpack);
  if (c->worker != 0) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 0,
                   "CHECKPOINT from %s: only the chief (worker 0) arranges checkpoints",
                   c->worker < 0 ? "a connection that is not a worker" : c->name);
    return 0;
  }
  char msg[1200];
  Ps__CheckpointReply r = PS__CHECKPOINT_REPLY__INIT;
  r.request_id = m->request_id;
  unsigned acts = psd_persist_request(h->persist, m->step, m->stop, m->commit, &r.ok,
                                      &r.max_step, msg, sizeof msg);
  psd_handlers_act(h, acts);
  r.message = msg;
  r.stopped = h->persist->stopped;
  r.stop_step = h->persist->stopped ? h->persist->stop_step : 0;
  psd_conn_send(c, PS__MSG_CHECKPOINT_REPLY, &r.base, NULL, NULL, NULL, 0);
  return 0;
}

/* Counters for psctl (any authenticated peer may ask). */
static int handle_stats(psd_handlers *h, psd_conn *c, const uint8_t *meta) {
  UNPACK(Ps__Stats, ps__stats__unpack);
  Ps__StatsReply r;
  psd_telem_view v = {h->cfg->name, ps__now() - h->job->started_at, h->job, h->shard};
  if (psd_telem_stats(h->telem, &v, &r) != 0) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 0, "out of memory for the stats");
    return 0;
  }
  r.request_id = m->request_id;
  for (const psd_conn *k = h->conns->head; k; k = k->next)
    if (k->worker >= 0 && (size_t)k->worker < r.n_workers && !k->dead)
      r.workers[k->worker]->transport = k->shm.map ? (char *)"shm" : (char *)"tcp";
  if (psd_tables_stats(h->tables, &r.tables, &r.n_tables) != 0) {
    psd_telem_stats_free(&r);
    psd_conn_error(c, m->request_id, PS_ENOMEM, 0, "out of memory for the tables' stats");
    return 0;
  }
  if (psd_conn_send(c, PS__MSG_STATS_REPLY, &r.base, NULL, NULL, NULL, 0) != 0)
    psd_conn_error(c, m->request_id, PS_ETOOBIG, 0, "the stats do not fit in one frame");
  psd_tables_stats_free(r.tables, r.n_tables);
  r.tables = NULL;
  r.n_tables = 0;
  psd_telem_stats_free(&r);
  return 0;
}

/* A Push item the slice refused (rc < 0, not stale): the first refusal's
 * sentence goes back in PushReply.message, so the worker's call fails with
 * what psd saw instead of a bare code; a future step is also logged here. */
static void push_refused(psd_conn *c, const psd_slice *sl, int rc) {
  char e[sizeof c->data_err];
  const char *name = PS__ESC(sl->name);
  unsigned long long s = c->data_step, at = sl->step;
  if (rc == PS_EINVAL)
    snprintf(e, sizeof e, "gradient of '%s' for step %llu, but the slice is only at step "
             "%llu (push the step you last pulled)", name, s, at);
  else if (rc == PS_EDUPLICATE)
    snprintf(e, sizeof e, "worker %d already pushed its gradient of '%s' for step %llu: "
             "the server has it", c->worker, name, s);
  else if (rc == PS_ESTATE)
    snprintf(e, sizeof e, "'%s' is not initialized yet", name);
  else if (rc == PS_EUNSUPPORTED)
    snprintf(e, sizeof e, "'%s' is not trainable: it takes no gradients", name);
  else
    snprintf(e, sizeof e, "gradient of '%s' for step %llu refused: %s", name, s,
             ps_strerror(rc));
  if (rc == PS_EINVAL)
    ps__ratelog_say(&c->reg->plog[PSD_PLOG_PUSH], ps__now(), "%s: %s", c->name, e);
  if (c->data_rc) return; /* the first refusal is the one reported */
  c->data_rc = rc;
  snprintf(c->data_err, sizeof c->data_err, "%s", e);
}

/* One Push/Init item has fully arrived in c->stage. */
static void item_done(void *ctx, psd_conn *c) {
  psd_handlers *h = ctx;
  if (c->blob_len) { /* a TABLE_* frame's keys (and gradients) */
    psd_tables_data(h->tables, c);
    psd_handlers_act(h, psd_tables_take_actions(h->tables));
    return;
  }
  const Ps__Item *it = c->items[c->item];
  psd_slice *sl = h->shard->slices[it->slice_id];
  if (c->hdr.type == PS__MSG_INIT && c->data_assign) {
    char err[sizeof c->data_err];
    int rc = psd_shard_assign(h->shard, sl, c->data_step, c->item_data, err, sizeof err);
    if (rc == 1) slice_advanced(h, sl);
    if (rc < 0 && !c->data_rc) { /* the first refusal is the one reported */
      c->data_rc = rc;
      snprintf(c->data_err, sizeof c->data_err, "%s", err);
      ps__ratelog_say(&c->reg->plog[PSD_PLOG_PUSH], ps__now(), "%s: %s", c->name, err);
    }
    return;
  }
  if (c->hdr.type == PS__MSG_INIT) {
    int was = sl->initialized;
    psd_shard_init_values(h->shard, sl, c->item_data);
    if (!was) slice_advanced(h, sl);
    return;
  }
  c->pace_done += it->count * ps__dtype_size(it->dtype); /* wire bytes, as item_got */
  double t0 = ps__now();
  int rc = psd_shard_push(h->shard, sl, (uint32_t)c->worker, c->data_step, c->item_data, t0);
  c->data_at = t0;
  c->agg_s += ps__now() - t0; /* accumulation and, for the last gradient, the optimizer */
  if (rc == 1) slice_advanced(h, sl);
  if (rc < 0 && rc != PS_ESTALE) push_refused(c, sl, rc);
  c->status[c->item] = rc > 0 ? 0 : rc;
}

/* The last item of a Push/Init is in: reply and go back to HEADER. */
static void frame_done(void *ctx, psd_conn *c) {
  psd_handlers *h = ctx;
  if (c->blob_len) return; /* TABLE_* frames reply in item_done */
  if (c->hdr.type == PS__MSG_INIT && c->data_rc) {
    /* An assign some slice refused: the items before and after it are
     * applied (each on its own, as a Push's). */
    psd_conn_error(c, c->data_req, c->data_rc, 0, "%s", c->data_err);
  } else if (c->hdr.type == PS__MSG_INIT) {
    Ps__Ack a = PS__ACK__INIT;
    a.request_id = c->data_req;
    psd_conn_send(c, PS__MSG_ACK, &a.base, NULL, NULL, NULL, 0);
  } else {
    uint32_t stale = 0;
    for (size_t i = 0; i < c->n_items; i++) {
      Ps__Item *it = &c->reply_items[i];
      ps__item__init(it);
      it->slice_id = c->items[i]->slice_id;
      it->status = c->status[i];
      c->reply_ptrs[i] = it;
      stale += it->status == PS_ESTALE;
    }
    psd_telem_push(h->telem, c->worker, c->data_step,
                   c->n_items ? c->data_at : ps__now(), c->hdr.data_len, c->agg_s, stale);
    c->agg_s = 0;
    Ps__PushReply r = PS__PUSH_REPLY__INIT;
    r.request_id = c->data_req;
    r.n_items = c->n_items;
    r.items = c->reply_ptrs;
    r.message = c->data_rc ? c->data_err : (char *)"";
    psd_persist_flags(h->persist, &r.want_checkpoint, &r.want_stop, &r.stop_step, &r.stopped);
    psd_conn_send(c, PS__MSG_PUSH_REPLY, &r.base, NULL, NULL, NULL, 0);
  }
}


/* conn.c hook: a whole protobuf part is in (generic checks done). */
static int on_message(void *ctx, psd_conn *c, const uint8_t *meta) {
  psd_handlers *h = ctx;
  unsigned t = c->hdr.type;
  if (c->worker >= 0) psd_job_active(h->job, (uint32_t)c->worker, ps__now());
  if (psd_tables_is_table_msg(t)) {
    int rc = psd_tables_message(h->tables, c, meta);
    psd_handlers_act(h, psd_tables_take_actions(h->tables));
    return rc;
  }
  switch (t) {
  case PS__MSG_HELLO:
    return handle_hello(h, c, meta);
  case PS__MSG_REGISTER:
    return handle_register(h, c, meta);
  case PS__MSG_INIT:
    return handle_init(h, c, meta);
  case PS__MSG_PUSH:
    return handle_push(h, c, meta);
  case PS__MSG_PULL:
    return handle_pull(h, c, meta);
  case PS__MSG_FINISH:
    return handle_finish(h, c, meta);
  case PS__MSG_CHECKPOINT:
    return handle_checkpoint(h, c, meta);
  case PS__MSG_STATS:
    return handle_stats(h, c, meta);
  default:
    psd_conn_error(c, 0, PS_EPROTO, 1, "unexpected %s frame from a client", ps__msg_name(t));
    return -1;
  }
}

static void flush_hook(void *ctx) { psd_replies_flush(ctx); }

void psd_handlers_hooks(psd_handlers *h, psd_conn_hooks *hooks) {
  hooks->message = on_message;
  hooks->item = item_done;
  hooks->frame = frame_done;
  hooks->closed = conn_closed;
  hooks->flush = flush_hook;
  hooks->opened = on_opened;
  hooks->ctx = h;
}
