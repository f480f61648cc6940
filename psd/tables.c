/* tables.c - TABLE_* frames: registration, pulls (parked until the
 * table's step), pushes, deadlines and counters (docs/protocol.md 13c). */
#include "tables.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "par.h"
#include "psdlog.h"
#include "wire.h"

/* Unpacks a TABLE_* message from the frame's arena; on failure the frame
 * cannot be trusted, so the connection closes. */
#define TUNPACK(T, fn)                                                        \
  T *m = fn(&c->alloc, c->hdr.meta_len, meta);                                \
  if (!m) {                                                                   \
    psd_conn_unpack_failed(c);                                                \
    return -1;                                                                \
  }

void psd_tables_init(psd_tables *ts, const psd_config *cfg, psd_job *job,
                     const psd_shard *shard, psd_persist *persist, psd_telem *telem) {
  memset(ts, 0, sizeof *ts);
  ts->cfg = cfg;
  ts->job = job;
  ts->shard = shard;
  ts->persist = persist;
  ts->telem = telem;
}

unsigned psd_tables_take_actions(psd_tables *ts) {
  unsigned a = ts->actions;
  ts->actions = 0;
  return a;
}

static void tpull_free(psd_tables *ts, psd_tpull *p) {
  ts->parked_bytes -= p->n * sizeof(uint64_t) + sizeof *p;
  free(p->keys);
  free(p);
}

void psd_tables_free(psd_tables *ts) {
  for (uint32_t i = 0; i < ts->n; i++) {
    for (psd_tpull *p = ts->v[i].parked, *nx; p; p = nx) {
      nx = p->next;
      tpull_free(ts, p);
    }
    psd_tmemo_forget(&ts->v[i].memos, NULL, &ts->memo_bytes);
    psd_table_destroy(ts->v[i].t);
  }
  free(ts->v);
  free(ts->kcopy);
  memset(ts, 0, sizeof *ts);
}

int psd_tables_is_table_msg(unsigned type) {
  return type == PS__MSG_TABLE_REGISTER || type == PS__MSG_TABLE_PULL ||
         type == PS__MSG_TABLE_PUSH;
}

/* ---- registration -------------------------------------------------------- */

/* The wire spec as this ps holds it: capacity is the whole table's, a ps
 * holds its share (keys spread evenly by ps__table_shard). */
static int spec_from_msg(const psd_tables *ts, const Ps__TableSpec *w, psd_table_spec *sp,
                         char *err, size_t errlen) {
  memset(sp, 0, sizeof *sp);
  size_t nl = w->name ? strlen(w->name) : 0;
  if (nl == 0 || nl > PS_MAX_NAME) {
    snprintf(err, errlen, "table name must be 1..%d bytes, got %zu", PS_MAX_NAME, nl);
    return PS_EINVAL;
  }
  memcpy(sp->name, w->name, nl + 1);
  uint64_t nps = ts->cfg->num_ps > 0 ? (uint64_t)ts->cfg->num_ps : 1;
  sp->dim = w->dim;
  sp->capacity = w->capacity / nps + (w->capacity % nps != 0);
  sp->init_kind = w->init_kind;
  sp->init_a = w->init_a;
  sp->init_b = w->init_b;
  sp->init_seed = w->init_seed;
  sp->opt = (uint32_t)w->opt;
  sp->lr = w->lr;
  sp->initial_accumulator = w->initial_accumulator;
  sp->beta1 = w->beta1;
  sp->beta2 = w->beta2;
  sp->epsilon = w->epsilon;
  sp->l1 = w->l1;
  sp->l2 = w->l2;
  sp->ftrl_beta = w->ftrl_beta;
  sp->admit_count = w->admit_count;
  sp->admit_prob = w->admit_prob;
  sp->evict_after_steps = w->evict_after_steps;
  sp->decay = (uint32_t)w->decay;
  sp->decay_rate = w->decay_rate;
  sp->decay_steps = w->decay_steps;
  sp->warmup_steps = w->warmup_steps;
  sp->total_steps = w->total_steps;
  sp->min_lr_factor = w->min_lr_factor;
  return psd_tablespec_check(sp, err, errlen);
}

static psd_tentry *find_by_name(psd_tables *ts, const char *name, uint32_t *id) {
  for (uint32_t i = 0; i < ts->n; i++)
    if (strcmp(psd_table_spec_of(ts->v[i].t)->name, name) == 0) {
      *id = i;
      return &ts->v[i];
    }
  return NULL;
}

/* Creates the table, its reservation checked against --max-memory. */
static int create_table(psd_tables *ts, const psd_table_spec *sp, uint32_t *id, char *err,
                        size_t errlen) {
  if (ts->n >= PS__MAX_TABLES) {
    snprintf(err, errlen, "table '%s': this server already holds %u tables, the most it "
             "takes", PS__ESC(sp->name), PS__MAX_TABLES);
    return PS_ETOOBIG;
  }
  uint64_t need = psd_table_bytes(sp);
  uint64_t have = ts->shard->bytes_alloc + ts->reserved + psd_persist_held_bytes(ts->persist);
  if (need == UINT64_MAX || (double)have + (double)need > ts->cfg->max_memory) {
    snprintf(err, errlen,
             "table '%s': %llu rows of %u floats on this ps need %llu bytes at capacity, "
             "which would take this server past --max-memory (%.0f bytes; %llu already "
             "held or reserved, checkpoint copies included): lower the capacity or raise "
             "--max-memory",
             PS__ESC(sp->name), (unsigned long long)sp->capacity, sp->dim,
             (unsigned long long)need, ts->cfg->max_memory, (unsigned long long)have);
    return PS_ENOMEM;
  }
  if (ts->n == ts->cap) {
    size_t cap = ts->cap;
    if (ps__grow((void **)&ts->v, &cap, (size_t)ts->n + 1, sizeof *ts->v)) return PS_ENOMEM;
    ts->cap = (uint32_t)cap;
  }
  psd_table *t = NULL;
  const psd_job *j = ts->job;
  int rc = psd_table_create(sp, j->num_workers, j->replicas, j->async_mode, &t, err, errlen);
  if (rc) return rc;
  psd_table_set_par(t, ts->par);
  ts->v[ts->n] = (psd_tentry){t, NULL, NULL, need};
  ts->reserved += need;
  *id = ts->n++;
  return 0;
}

/* The table just created as id gets its rows from the checkpoint being
 * restored, if any, and joins the checkpoints; on failure it is gone
 * again (err says why). */
static int adopt(psd_tables *ts, uint32_t id, const char *who, char *err, size_t errlen) {
  psd_tentry *e = &ts->v[id];
  int rc = psd_persist_restore_table(ts->persist, e->t, who, err, errlen);
  if (rc == 0 && psd_persist_table_added(ts->persist, e->t) != 0) {
    snprintf(err, errlen, "out of memory registering table '%s'",
             PS__ESC(psd_table_spec_of(e->t)->name));
    rc = PS_ENOMEM;
  }
  if (rc == 0) {
    /* Only now: a table refused here (a checkpoint that lacks it) is not
     * logged once per attempt. */
    const psd_table_spec *sp = psd_table_spec_of(e->t);
    psd_info("table '%s' created: dim %u, up to %llu rows here (%llu bytes reserved)",
             PS__ESC(sp->name), sp->dim, (unsigned long long)sp->capacity,
             (unsigned long long)e->reserved);
    return 0;
  }
  psd_table_destroy(e->t);
  ts->reserved -= e->reserved;
  ts->n--; /* id was the last one */
  return rc;
}

static int handle_register(psd_tables *ts, psd_conn *c, const uint8_t *meta) {
  TUNPACK(Ps__TableRegister, ps__table_register__unpack);
  char err[512] = "";
  psd_table_spec sp;
  int rc = m->spec ? spec_from_msg(ts, m->spec, &sp, err, sizeof err) : PS_EINVAL;
  if (!m->spec) snprintf(err, sizeof err, "TABLE_REGISTER without a spec");
  uint32_t id = 0;
  if (rc == 0) {
    psd_tentry *e = find_by_name(ts, sp.name, &id);
    char who[32], diff[400];
    snprintf(who, sizeof who, "worker %d", c->worker);
    if (e && psd_tablespec_diff(psd_table_spec_of(e->t), "this server's table", &sp, who, diff,
                                sizeof diff)) {
      snprintf(err, sizeof err, "table '%s' exists with another configuration: %s",
               PS__ESC(sp.name), diff);
      rc = PS_EMISMATCH;
    } else if (!e) {
      rc = create_table(ts, &sp, &id, err, sizeof err);
      if (rc == 0) rc = adopt(ts, id, who, err, sizeof err);
    }
  }
  if (rc) {
    psd_conn_error(c, m->request_id, rc, 0, "%s", err);
    return 0;
  }
  Ps__TableRegisterReply r = PS__TABLE_REGISTER_REPLY__INIT;
  r.request_id = m->request_id;
  r.table_id = id;
  r.step = psd_table_step(ts->v[id].t);
  psd_conn_send(c, PS__MSG_TABLE_REGISTER_REPLY, &r.base, NULL, NULL, NULL, 0);
  return 0;
}

/* ---- memory ------------------------------------------------------------ */

/* Bytes psd holds now, as --max-memory counts them: the variables' slices,
 * every table's reservation at capacity, checkpoint copies, parked pulls'
 * keys, the copy of a shared-memory push's keys, the pulls remembered for
 * their pushes, and what the connections hold (replies not yet written,
 * request data staged: psd_conns_held_bytes). *conns gets the last part. */
static uint64_t held_bytes(const psd_tables *ts, const psd_conn *c, uint64_t *conns) {
  *conns = psd_conns_held_bytes(c->reg);
  return ts->shard->bytes_alloc + ts->reserved + psd_persist_held_bytes(ts->persist) +
         ts->parked_bytes + ts->kcopy_cap * sizeof *ts->kcopy + ts->memo_bytes + *conns;
}

/* "table 'NAME'" of id (escaped, and cut to fit a refusal's sentence), or
 * "table id N" for an id no table has. */
static void table_label(const psd_tables *ts, uint32_t id, char *out, size_t len) {
  char name[256];
  if (id < ts->n)
    snprintf(out, len, "table '%s'",
             ps__escape(psd_table_spec_of(ts->v[id].t)->name, name, sizeof name));
  else snprintf(out, len, "table id %u", id);
}

/* 0 if `bytes` more fit under --max-memory; else PS_ENOMEM with the
 * refusal's sentence in err, naming table id, what is asked (fmt: "a reply
 * of 4096 rows (1073741824 bytes)"), the limit and what is held. Nothing
 * is formatted when it fits (every pull and push comes here). */
static int mem_check(const psd_tables *ts, const psd_conn *c, uint32_t id, uint64_t bytes,
                     char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
static int mem_check(const psd_tables *ts, const psd_conn *c, uint32_t id, uint64_t bytes,
                     char *err, size_t errlen, const char *fmt, ...) {
  uint64_t conns, have = held_bytes(ts, c, &conns);
  if ((double)have + (double)bytes <= ts->cfg->max_memory) return 0;
  char label[300], what[200];
  table_label(ts, id, label, sizeof label);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  snprintf(err, errlen,
           "%s: %s would take this server past --max-memory (%.0f bytes; "
           "%llu already held: variables, tables reserved at capacity, checkpoint copies, "
           "%llu of parked pulls, %llu of pulls' rows kept for their pushes, and %llu of "
           "replies not yet read by their connections and requests being received): "
           "refused; pull or push fewer keys at once, read replies as they come, or raise "
           "--max-memory",
           label, what, ts->cfg->max_memory, (unsigned long long)have,
           (unsigned long long)ts->parked_bytes, (unsigned long long)ts->memo_bytes,
           (unsigned long long)conns);
  return PS_ENOMEM;
}

/* Bytes c's output queue adds to held_bytes with a reply of `bytes`
 * (a buffer kept between steps is counted there already). */
static uint64_t out_growth(const psd_conn *c, uint64_t bytes) {
  uint64_t now = ps__outq_held(&c->out);
  uint64_t after = (uint64_t)c->out.len + bytes + PS__HEADER_SIZE + 4096; /* + its meta */
  return after > now ? after - now : 0;
}

/* Bytes c's staging must grow by to take `bytes` of request data. */
static uint64_t stage_growth(const psd_conn *c, uint64_t bytes) {
  uint64_t have = c->stage_cap * sizeof(float);
  return bytes > have ? bytes - have : 0;
}

/* ---- keys -------------------------------------------------------------- */

/* Keys ascending and all this ps's; 0 or PS_EINVAL with err. */
static int check_keys(const psd_tables *ts, const uint64_t *keys, size_t n, char *err,
                      size_t errlen) {
  int rc = psd_tablespec_keys_check(keys, n, err, errlen);
  if (rc) return rc;
  uint32_t nps = ts->cfg->num_ps > 0 ? (uint32_t)ts->cfg->num_ps : 1;
  for (size_t i = 0; i < n; i++) {
    uint32_t owner = ps__table_shard(keys[i], nps);
    if (owner != (uint32_t)ts->cfg->ps_index) {
      snprintf(err, errlen, "key %llu (position %zu) belongs to ps %u, not to this ps %d",
               (unsigned long long)keys[i], i, owner, ts->cfg->ps_index);
      return PS_EINVAL;
    }
  }
  return 0;
}

/* ---- pulls ------------------------------------------------------------- */

/* 1 (and the Error queued) if n rows of e do not fit one reply. */
static int reply_too_big(psd_tentry *e, psd_conn *c, uint64_t req, size_t n) {
  const psd_table_spec *sp = psd_table_spec_of(e->t);
  if ((uint64_t)n * sp->dim * sizeof(float) <= PS__MAX_DATA) return 0;
  psd_conn_error(c, req, PS_ETOOBIG, 0,
                 "table '%s': %zu rows of %u floats do not fit one reply (%llu bytes at "
                 "most): pull fewer keys at once", PS__ESC(sp->name), n, sp->dim,
                 (unsigned long long)PS__MAX_DATA);
  return 1;
}

/* Where the rows of a reply of `bytes` go in c's pull ring (2.9: the
 * client asked with shm_reply), its position in *pos; NULL for TCP (no
 * segment, or no room now: counted as a ring-full fallback). */
static float *ring_rows(psd_tables *ts, psd_conn *c, int shm, uint64_t bytes, uint64_t *pos) {
  if (!shm || !c->shm.map || !bytes || ts->cfg->protocol_minor < 9) return NULL;
  float *dst = ps__shm_reserve(&c->shm.pull, ps__shm_load(c->shm.pull_done), bytes, pos);
  if (!dst) psd_telem_shm_tcp(ts->telem, c->worker);
  return dst;
}

/* Where the rows of c's pull req of keys[0..n) go for its push (tmemo.h),
 * or NULL: not remembered (no keys, or no room under --max-memory beside
 * the reply's `reply` bytes still to come, which a memo is never worth
 * refusing a pull for). A read-only pull is never remembered: no push of
 * its keys follows it (an evaluation's). */
static uint32_t *remember(psd_tables *ts, uint32_t id, psd_conn *c, uint64_t req,
                          const uint64_t *keys, size_t n, uint64_t reply, psd_tmemo **memo) {
  psd_tentry *e = &ts->v[id];
  psd_tmemo *m = *memo = n ? psd_tmemo_get(&e->memos, c, 1, &ts->memo_bytes) : NULL;
  if (!m) return NULL;
  char err[8];
  uint64_t grow = psd_tmemo_growth(m, req, n);
  if (grow && mem_check(ts, c, id, grow + reply, err, sizeof err, "%s", "")) {
    psd_tmemo_skip(m, req, &ts->memo_bytes);
    return NULL;
  }
  return psd_tmemo_add(m, req, psd_table_epoch(e->t), keys, n, &ts->memo_bytes);
}

/* Queues the TablePullReply of keys[0..n) read now: the rows written into
 * c's pull ring when the client asked for that and it has room (shm), else
 * into c's output queue. */
static void answer_pull(psd_tables *ts, uint32_t id, psd_conn *c, uint64_t req,
                        const uint64_t *keys, size_t n, int read_only, int shm) {
  psd_tentry *e = &ts->v[id];
  const psd_table_spec *sp = psd_table_spec_of(e->t);
  uint64_t bytes = (uint64_t)n * sp->dim * sizeof(float), pos = 0;
  if (reply_too_big(e, c, req, n)) return;
  float *ring = ring_rows(ts, c, shm, bytes, &pos);
  /* The reply is built whole in c's output queue and held until c reads
   * it, and the keys are remembered if there is room beside it (the reply
   * says whether): both counted against --max-memory with everything else
   * psd holds. */
  char err[900];
  const uint64_t reply = ring ? 0 : out_growth(c, bytes);
  if (reply && mem_check(ts, c, id, reply, err, sizeof err, "a reply of %zu rows (%llu bytes)",
                         n, (unsigned long long)bytes)) {
    psd_conn_error(c, req, PS_ENOMEM, 0, "%s", err);
    return;
  }
  psd_tmemo *memo = NULL;
  uint32_t *rows = read_only ? NULL : remember(ts, id, c, req, keys, n, reply, &memo);
  Ps__TablePullReply r = PS__TABLE_PULL_REPLY__INIT;
  r.request_id = req;
  r.table_id = id;
  r.step = psd_table_step(e->t);
  r.count = n;
  r.remembered = rows != NULL && ts->cfg->protocol_minor >= 10;
  psd_persist_flags(ts->persist, &r.want_checkpoint, &r.want_stop, &r.stop_step, &r.stopped);
  float *dst = ring ? ring : ps__outq_frame_inline(&c->out, PS__MSG_TABLE_PULL_REPLY, &r.base,
                                                   bytes);
  if (ring && ps__outq_frame_shm(&c->out, PS__MSG_TABLE_PULL_REPLY, &r.base, bytes, pos) != 0)
    dst = NULL; /* the ring's bytes stay unused: the client never hears of them */
  if (!dst) {
    if (rows) psd_tmemo_skip(memo, req, &ts->memo_bytes); /* its rows are never read */
    psd_conn_error(c, req, PS_ENOMEM, 0, "out of memory for a %llu-byte reply of table '%s'",
                   (unsigned long long)bytes, PS__ESC(sp->name));
    return;
  }
  /* Even a read-only pull touches rows (LRU order): a checkpoint of this
   * step can no longer hold its exact state. */
  if (n) psd_persist_table_read(ts->persist, id);
  /* PS_ENOMEM here leaves initializer values in the rows it could not
   * store: the reply is still right for this step. */
  const uint64_t clock = psd_table_lru_clock(e->t);
  psd_table_pull_rows(e->t, keys, n, !read_only, dst, rows);
  if (rows) psd_tmemo_touched(memo, clock, psd_table_lru_clock(e->t), n);
  psd_telem_sent(ts->telem, c->worker, bytes);
}

/* One parked pull per table and connection: a later one replaces it (its
 * client abandoned it, e.g. a step whose push was refused, or asks again),
 * and the earlier request is answered now rather than never. Its keys
 * were not read yet: nothing of the table changes. */
static void replace_parked(psd_tables *ts, psd_tentry *e, psd_conn *c, uint64_t req) {
  for (psd_tpull **pp = &e->parked; *pp; pp = &(*pp)->next) {
    psd_tpull *p = *pp;
    if (p->conn != c) continue;
    *pp = p->next;
    psd_conn_error(c, p->req, PS_EBUSY, 0,
                   "pull of table '%s' for step %llu replaced by a later pull of it on this "
                   "connection (request %llu): a server keeps one waiting pull per table "
                   "and connection", PS__ESC(psd_table_spec_of(e->t)->name),
                   (unsigned long long)p->min_step, (unsigned long long)req);
    tpull_free(ts, p);
    return;
  }
}

static int park_pull(psd_tables *ts, psd_tentry *e, psd_conn *c, const Ps__TablePull *m,
                     const uint64_t *keys) {
  replace_parked(ts, e, c, m->request_id);
  /* Each costs its keys and its record (a pull of no keys is not free). */
  if (ts->parked_bytes + m->count * sizeof(uint64_t) + sizeof(psd_tpull) >
      PSD_TABLES_MAX_PARKED_BYTES) {
    psd_conn_error(c, m->request_id, PS_EBUSY, 0,
                   "pull of table '%s' for step %llu refused: %llu bytes of keys already "
                   "wait for later steps here (at most %llu)",
                   PS__ESC(psd_table_spec_of(e->t)->name),
                   (unsigned long long)m->min_step, (unsigned long long)ts->parked_bytes,
                   (unsigned long long)PSD_TABLES_MAX_PARKED_BYTES);
    return 0;
  }
  /* Its keys are held until its step: counted against --max-memory. */
  char err[900];
  const uint64_t held = m->count * sizeof(uint64_t) + sizeof(psd_tpull);
  if (mem_check(ts, c, m->table_id, held, err, sizeof err,
                "a pull of %llu keys parked until step %llu (%llu bytes held)",
                (unsigned long long)m->count, (unsigned long long)m->min_step,
                (unsigned long long)held)) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 0, "%s", err);
    return 0;
  }
  psd_tpull *p = calloc(1, sizeof *p);
  uint64_t *k = m->count ? malloc(m->count * sizeof *k) : NULL;
  if (!p || (m->count && !k)) {
    free(p);
    free(k);
    psd_conn_error(c, m->request_id, PS_ENOMEM, 0, "out of memory parking a pull");
    return 0;
  }
  if (m->count) memcpy(k, keys, m->count * sizeof *k);
  double wait = m->timeout_ms ? m->timeout_ms / 1000.0 : ts->cfg->pull_timeout_s;
  *p = (psd_tpull){c, m->request_id, m->min_step, ps__now() + wait, m->read_only, k,
                   (size_t)m->count, e->parked, m->shm_reply};
  e->parked = p;
  ts->parked_bytes += m->count * sizeof *k + sizeof *p;
  return 0;
}

/* A TablePull whose keys (if any) are in `keys`. */
static void do_pull(psd_tables *ts, psd_conn *c, const Ps__TablePull *m, const uint64_t *keys) {
  char err[256];
  if (m->table_id >= ts->n) {
    psd_conn_error(c, m->request_id, PS_ENOTFOUND, 0, "TABLE_PULL names unknown table id %u",
                   m->table_id);
    return;
  }
  psd_tentry *e = &ts->v[m->table_id];
  int rc = check_keys(ts, keys, (size_t)m->count, err, sizeof err);
  if (rc) {
    psd_conn_error(c, m->request_id, rc, 0, "TABLE_PULL of '%s': %s",
                   PS__ESC(psd_table_spec_of(e->t)->name), err);
    return;
  }
  /* Once the job stopped, no later step comes: answered at once. */
  if (!ts->job->async_mode && psd_table_step(e->t) < m->min_step && !ts->persist->stopped) {
    /* Refused now, rather than holding its keys until its step. */
    if (!reply_too_big(e, c, m->request_id, (size_t)m->count)) park_pull(ts, e, c, m, keys);
    return;
  }
  answer_pull(ts, m->table_id, c, m->request_id, keys, (size_t)m->count, m->read_only,
              m->shm_reply);
}

static int handle_pull(psd_tables *ts, psd_conn *c, const uint8_t *meta) {
  TUNPACK(Ps__TablePull, ps__table_pull__unpack);
  if (m->count > PS__MAX_TABLE_KEYS) {
    psd_conn_error(c, m->request_id, PS_ETOOBIG, 1, "TABLE_PULL of %llu keys (at most %u)",
                   (unsigned long long)m->count, PS__MAX_TABLE_KEYS);
    return -1;
  }
  if (c->hdr.data_len != m->count * sizeof(uint64_t)) {
    psd_conn_error(c, m->request_id, PS_EPROTO, 1,
                   "TABLE_PULL of %llu keys carries %llu data bytes (expected %llu)",
                   (unsigned long long)m->count, (unsigned long long)c->hdr.data_len,
                   (unsigned long long)(m->count * sizeof(uint64_t)));
    return -1;
  }
  if (m->count == 0) {
    do_pull(ts, c, m, NULL);
    return 0;
  }
  /* Refused before its keys are staged if they and the reply they ask for
   * would take psd past --max-memory (the keys are then read and dropped;
   * the connection stays open). */
  uint64_t reply = m->table_id < ts->n
                       ? m->count * psd_table_spec_of(ts->v[m->table_id].t)->dim * sizeof(float)
                       : 0;
  if (reply > PS__MAX_DATA) reply = 0; /* PS_ETOOBIG once the keys are in */
  char err[900];
  if (mem_check(ts, c, m->table_id, stage_growth(c, c->hdr.data_len) + reply, err, sizeof err,
                "a pull of %llu keys (a reply of %llu bytes, and %llu bytes of keys to "
                "receive)", (unsigned long long)m->count, (unsigned long long)reply,
                (unsigned long long)c->hdr.data_len)) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 0, "%s", err);
    psd_conn_skip_blob(c, c->hdr.data_len);
    return 0;
  }
  if (psd_conn_begin_blob(c, c->hdr.data_len) != 0) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 1, "out of memory for %llu keys",
                   (unsigned long long)m->count);
    return -1;
  }
  c->blob_msg = m;
  return 0;
}

/* Answers the pulls of table id that its new step satisfies (all: every
 * parked pull, when the job stopped). A pull whose connection is
 * backlogged (it does not read its replies) stays parked, due:
 * psd_tables_expire answers it once that output drains, so parked pulls
 * cannot queue one reply each (up to 1 GiB) for a peer that reads
 * nothing. */
static void wake(psd_tables *ts, uint32_t id, int all) {
  psd_tentry *e = &ts->v[id];
  uint64_t step = psd_table_step(e->t);
  psd_tpull *ready = NULL, **pp = &e->parked;
  while (*pp) {
    psd_tpull *p = *pp;
    if ((all || p->min_step <= step) && !psd_conn_backlogged(p->conn)) {
      *pp = p->next;
      p->next = ready;
      ready = p;
    } else {
      pp = &p->next;
    }
  }
  /* Detached first: writing may close a connection, which edits the list. */
  for (psd_tpull *p = ready, *nx; p; p = nx) {
    nx = p->next;
    if (!p->conn->dead) {
      answer_pull(ts, id, p->conn, p->req, p->keys, p->n, p->read_only, p->shm);
      psd_conn_write(p->conn);
    }
    tpull_free(ts, p);
  }
}

/* ---- pushes ------------------------------------------------------------ */

static void push_reply(psd_tables *ts, psd_conn *c, uint64_t req, int status,
                       const char *msg, uint64_t dropped, uint64_t step) {
  Ps__TablePushReply r = PS__TABLE_PUSH_REPLY__INIT;
  r.request_id = req;
  r.status = status;
  r.message = (char *)(msg ? msg : "");
  r.dropped = dropped;
  r.step = step;
  psd_persist_flags(ts->persist, &r.want_checkpoint, &r.want_stop, &r.stop_step, &r.stopped);
  psd_conn_send(c, PS__MSG_TABLE_PUSH_REPLY, &r.base, NULL, NULL, NULL, 0);
}

/* The sentence of a push's refusal (the client's ps_client_errmsg). */
static void push_refusal(const psd_conn *c, const psd_table *t, uint64_t step, int rc,
                         char *err, size_t errlen) {
  const char *name = PS__ESC(psd_table_spec_of(t)->name);
  unsigned long long s = step, at = psd_table_step(t);
  if (rc == PS_EINVAL)
    snprintf(err, errlen, "gradient of table '%s' for step %llu, but the table is only at "
             "step %llu (push the step you last pulled)", name, s, at);
  else if (rc == PS_EDUPLICATE)
    snprintf(err, errlen, "worker %d already pushed its gradient of table '%s' for step "
             "%llu: the server has it", c->worker, name, s);
  else if (rc == PS_ESTALE)
    snprintf(err, errlen, "gradient of table '%s' for step %llu came after the table moved "
             "to step %llu: dropped", name, s, at);
  else
    snprintf(err, errlen, "gradient of table '%s' for step %llu refused: %s", name, s,
             ps_strerror(rc));
}

/* 0 if every one of the n floats at g is finite; else PS_EINVAL with err
 * naming the first that is not (its key and element). The common case is
 * one branch-free pass over the bits (vectorized). */
static int grads_check(const psd_tables *ts, const psd_table *t, const uint64_t *keys,
                       const float *g, size_t n, char *err, size_t errlen) {
  const size_t dim = psd_table_spec_of(t)->dim;
  if (psd_par_all_finite(ts->par, g, n, dim)) return 0;
  /* Found again to name it, within the push: gradients in the push ring
   * may have been rewritten by the peer since the scan. */
  const size_t all = n * dim;
  float v = 0.0f;
  size_t i = 0;
  for (; i < all; i++) {
    v = g[i];
    if (!isfinite(v)) break;
  }
  if (i == all)
    snprintf(err, errlen, "gradients of table '%s' held a NaN or an infinity, then none "
             "(rewritten while psd read them): the push is refused whole; nothing of it "
             "was applied", PS__ESC(psd_table_spec_of(t)->name));
  else
    snprintf(err, errlen, "gradient of table '%s' for key %llu (position %zu), element %zu, "
             "is %s: the push is refused whole (a NaN or infinite gradient would make the "
             "row NaN for every worker); nothing of it was applied",
             PS__ESC(psd_table_spec_of(t)->name),
             (unsigned long long)keys[i / dim], i / dim, i % dim,
             isnan(v) ? "NaN" : v > 0 ? "+Inf" : "-Inf");
  return PS_EINVAL;
}

/* Whether m's data is its gradients alone (2.10: it names its pull; a
 * server announcing an older minor reads the frame as that release did,
 * keys and all). */
static int push_keyless(const psd_tables *ts, const Ps__TablePush *m) {
  return m->pull_id != 0 && ts->cfg->protocol_minor >= 10;
}

/* A TablePush whose data (count keys, then count * dim floats; the
 * floats alone when it names its pull) is at keys and grads (NULL for
 * none). */
static void do_push(psd_tables *ts, psd_conn *c, const Ps__TablePush *m, const uint64_t *keys,
                    const float *grads) {
  char err[600] = "";
  if (m->table_id >= ts->n) {
    snprintf(err, sizeof err, "TABLE_PUSH names unknown table id %u", m->table_id);
    push_reply(ts, c, m->request_id, PS_ENOTFOUND, err, 0, 0);
    return;
  }
  psd_tentry *e = &ts->v[m->table_id];
  /* The frame was sized by the table as it was when its header came; a
   * table registered since (by another connection, while this data was
   * read) must not size it now: its data would be read past the end. */
  uint64_t dim = psd_table_spec_of(e->t)->dim;
  const int keyless = push_keyless(ts, m);
  if (m->count > PS__MAX_TABLE_KEYS ||
      c->hdr.data_len != m->count * ((keyless ? 0 : sizeof(uint64_t)) + dim * sizeof(float))) {
    snprintf(err, sizeof err, "TABLE_PUSH names table id %u, which did not exist when the "
             "push arrived (register the table before pushing to it)", m->table_id);
    push_reply(ts, c, m->request_id, PS_ENOTFOUND, err, 0, 0);
    return;
  }
  size_t n = (size_t)m->count;
  /* The keys of this connection's last pull, checked then: its rows are
   * known (while no row changed hands since: psd_table_push_rows). */
  psd_tmemo *memo = psd_tmemo_get(&e->memos, c, 0, NULL);
  uint64_t epoch = 0;
  const uint32_t *rows = NULL;
  int rc = 0;
  if (keyless) { /* 2.10: the keys of the pull it names, held since */
    rows = memo ? psd_tmemo_of_pull(memo, m->pull_id, n, &epoch) : NULL;
    if (rows)
      keys = memo->keys;
    else
      rc = ps__errf(PS_ENOTFOUND, err, sizeof err, "TABLE_PUSH of table '%s' names pull "
                    "request %llu for its %zu keys, which this server does not hold for this "
                    "connection (held only where its replies said remembered, until the "
                    "table's next pull or push on it): send the keys",
                    PS__ESC(psd_table_spec_of(e->t)->name), (unsigned long long)m->pull_id, n);
  } else {
    rows = memo ? psd_tmemo_match(memo, keys, n, &epoch) : NULL;
    rc = rows ? 0 : check_keys(ts, keys, n, err, sizeof err);
  }
  const uint64_t clock = rows ? memo->clock : 0;
  if (rc == 0) rc = grads_check(ts, e->t, keys, grads, n, err, sizeof err);
  uint64_t dropped = 0;
  double at = ps__now(); /* its data is in: the worker's arrival */
  if (rc == 0)
    rc = psd_table_push_rows(e->t, (uint32_t)c->worker, m->step, keys, n, grads, rows, epoch,
                             clock, &dropped);
  if (memo) psd_tmemo_clear(memo, &ts->memo_bytes);
  /* The table's step is the job's step when it has no variables: its
   * pushes are the step's arrivals, as a Push's (refusals are not). */
  if (rc >= 0 || rc == PS_ESTALE)
    psd_telem_push(ts->telem, c->worker, m->step, at, c->hdr.data_len, ps__now() - at,
                   rc == PS_ESTALE);
  if (rc < 0 && !err[0]) push_refusal(c, e->t, m->step, rc, err, sizeof err);
  if (rc == PS_EINVAL) /* a peer's bad data, as often as it likes: rate-limited */
    ps__ratelog_say(&c->reg->plog[PSD_PLOG_PUSH], ps__now(), "%s: %s", c->name, err);
  push_reply(ts, c, m->request_id, rc > 0 ? 0 : rc, rc < 0 ? err : "", dropped,
             psd_table_step(e->t));
  if (rc != 1) return;
  /* A checkpoint may want this step: captured before any pull of the
   * next step changes a row. */
  ts->actions |= psd_persist_table_advanced(ts->persist, m->table_id);
  wake(ts, m->table_id, 0);
}

/* A TablePush in the push ring: its keys are copied out first, so the
 * peer cannot change them between their checks and their use (rewriting
 * its gradients meanwhile only changes its own gradient). Bounded:
 * PS__MAX_TABLE_KEYS keys (handle_push checked the count). */
static void do_push_shm(psd_tables *ts, psd_conn *c, const Ps__TablePush *m) {
  size_t n = (size_t)m->count;
  if (push_keyless(ts, m)) { /* its gradients alone: no keys to copy out */
    do_push(ts, c, m, NULL, (const float *)c->shm_src);
    return;
  }
  /* An unknown table's frame was checked against no dim: count may claim
   * more keys than its data holds. do_push refuses it before any read. */
  if (m->table_id >= ts->n || (uint64_t)n * sizeof(uint64_t) > c->hdr.data_len) {
    do_push(ts, c, m, NULL, NULL);
    return;
  }
  char err[900];
  uint64_t step = m->table_id < ts->n ? psd_table_step(ts->v[m->table_id].t) : 0;
  uint64_t growth = n > ts->kcopy_cap ? (n - ts->kcopy_cap) * sizeof *ts->kcopy : 0;
  if (mem_check(ts, c, m->table_id, growth, err, sizeof err, "a push of %zu keys (%llu bytes "
                "to copy its keys)", n, (unsigned long long)growth)) {
    push_reply(ts, c, m->request_id, PS_ENOMEM, err, 0, step);
    return;
  }
  if (ps__grow((void **)&ts->kcopy, &ts->kcopy_cap, n ? n : 1, sizeof *ts->kcopy) != 0) {
    snprintf(err, sizeof err, "out of memory copying the %zu keys of a push", n);
    ps__ratelog_say(&c->reg->plog[PSD_PLOG_PUSH], ps__now(), "%s: %s", c->name, err);
    push_reply(ts, c, m->request_id, PS_ENOMEM, err, 0, step);
    return;
  }
  memcpy(ts->kcopy, c->shm_src, n * sizeof(uint64_t));
  do_push(ts, c, m, ts->kcopy,
          (const float *)(const void *)((const uint8_t *)c->shm_src + n * sizeof(uint64_t)));
}

static int handle_push(psd_tables *ts, psd_conn *c, const uint8_t *meta) {
  TUNPACK(Ps__TablePush, ps__table_push__unpack);
  if (c->finished) {
    psd_conn_error(c, m->request_id, PS_ESTATE, 1, "TABLE_PUSH after FINISH");
    return -1;
  }
  if (m->want_stop && ts->cfg->ckpt_dir[0] && ts->job->pinned) {
    char who[32];
    snprintf(who, sizeof who, "worker %d", c->worker);
    psd_persist_stop_wanted(ts->persist, who);
  }
  uint64_t want = c->hdr.data_len; /* an unknown table: read it whole, then refuse */
  if (m->table_id < ts->n) {
    uint64_t dim = psd_table_spec_of(ts->v[m->table_id].t)->dim;
    uint64_t per_key = (push_keyless(ts, m) ? 0 : sizeof(uint64_t)) + dim * sizeof(float);
    want = m->count <= PS__MAX_TABLE_KEYS ? m->count * per_key : UINT64_MAX;
  }
  if (m->count > PS__MAX_TABLE_KEYS || want != c->hdr.data_len ||
      want > PS__MAX_TABLE_PUSH_BYTES) {
    psd_conn_error(c, m->request_id, PS_EPROTO, 1,
                   "TABLE_PUSH of %llu keys carries %llu data bytes (expected %llu, at most "
                   "%u keys and %llu bytes)", (unsigned long long)m->count,
                   (unsigned long long)c->hdr.data_len, (unsigned long long)want,
                   PS__MAX_TABLE_KEYS, (unsigned long long)PS__MAX_TABLE_PUSH_BYTES);
    return -1;
  }
  if (c->hdr.data_len == 0) {
    do_push(ts, c, m, NULL, NULL);
    return 0;
  }
  if (c->shm_src) { /* 2.9: in the push ring, read where it lies: nothing staged */
    psd_conn_begin_shm_blob(c);
    c->blob_msg = m;
    return 0;
  }
  /* Its keys and gradients are staged whole before they are applied:
   * counted against --max-memory, refused (and read and dropped, the
   * connection staying open) if they would pass it. */
  char err[900];
  if (mem_check(ts, c, m->table_id, stage_growth(c, c->hdr.data_len), err, sizeof err,
                "a push of %llu keys (%llu bytes to receive)", (unsigned long long)m->count,
                (unsigned long long)c->hdr.data_len)) {
    push_reply(ts, c, m->request_id, PS_ENOMEM, err, 0,
               m->table_id < ts->n ? psd_table_step(ts->v[m->table_id].t) : 0);
    psd_conn_skip_blob(c, c->hdr.data_len);
    return 0;
  }
  if (psd_conn_begin_blob(c, c->hdr.data_len) != 0) {
    psd_conn_error(c, m->request_id, PS_ENOMEM, 1, "out of memory for a %llu-byte push",
                   (unsigned long long)c->hdr.data_len);
    return -1;
  }
  c->blob_msg = m;
  return 0;
}

/* ---- entry points --------------------------------------------------------- */

int psd_tables_message(psd_tables *ts, psd_conn *c, const uint8_t *meta) {
  if (c->worker < 0) {
    psd_conn_error(c, 0, PS_ESTATE, 1, "%s from a connection that is not a worker",
                   ps__msg_name(c->hdr.type));
    return -1;
  }
  switch (c->hdr.type) {
  case PS__MSG_TABLE_REGISTER: return handle_register(ts, c, meta);
  case PS__MSG_TABLE_PULL: return handle_pull(ts, c, meta);
  case PS__MSG_TABLE_PUSH: return handle_push(ts, c, meta);
  default: return 0;
  }
}

void psd_tables_data(psd_tables *ts, psd_conn *c) {
  if (c->hdr.type == PS__MSG_TABLE_PULL)
    do_pull(ts, c, c->blob_msg, (const uint64_t *)c->stage);
  else if (c->hdr.type == PS__MSG_TABLE_PUSH && c->shm_src)
    do_push_shm(ts, c, c->blob_msg);
  else if (c->hdr.type == PS__MSG_TABLE_PUSH && push_keyless(ts, c->blob_msg))
    do_push(ts, c, c->blob_msg, NULL, (const float *)c->stage);
  else if (c->hdr.type == PS__MSG_TABLE_PUSH)
    do_push(ts, c, c->blob_msg, (const uint64_t *)c->stage,
            (const float *)((const uint8_t *)c->stage +
                            ((const Ps__TablePush *)c->blob_msg)->count * sizeof(uint64_t)));
}

void psd_tables_wake_all(psd_tables *ts) {
  for (uint32_t i = 0; i < ts->n; i++) wake(ts, i, 1);
}

void psd_tables_closed(psd_tables *ts, psd_conn *c) {
  for (uint32_t i = 0; i < ts->n; i++) {
    psd_tmemo_forget(&ts->v[i].memos, c, &ts->memo_bytes);
    for (psd_tpull **pp = &ts->v[i].parked; *pp;) {
      psd_tpull *p = *pp;
      if (p->conn != c) {
        pp = &p->next;
        continue;
      }
      *pp = p->next;
      tpull_free(ts, p);
    }
  }
}

void psd_tables_expire(psd_tables *ts, double now) {
  for (uint32_t i = 0; i < ts->n; i++) {
    psd_tentry *e = &ts->v[i];
    for (psd_tpull **pp = &e->parked; *pp;) {
      psd_tpull *p = *pp;
      /* Its step came, or the job stopped (no later step comes). */
      const int due = p->min_step <= psd_table_step(e->t) || ts->persist->stopped;
      if (due && (p->conn->dead || !psd_conn_backlogged(p->conn))) { /* drained: answer */
        *pp = p->next;
        if (!p->conn->dead) {
          answer_pull(ts, i, p->conn, p->req, p->keys, p->n, p->read_only, p->shm);
          psd_conn_write(p->conn); /* may close it: p is off every list already */
        }
        tpull_free(ts, p);
        continue;
      }
      if (p->deadline > now) {
        pp = &p->next;
        continue;
      }
      *pp = p->next;
      if (due) {
        psd_conn_error(p->conn, p->req, PS_EBUSY, 0,
                       "pull of table '%s' for step %llu: the table is at step %llu, but "
                       "this connection has %llu bytes of replies it has not read",
                       PS__ESC(psd_table_spec_of(e->t)->name),
                       (unsigned long long)p->min_step,
                       (unsigned long long)psd_table_step(e->t),
                       (unsigned long long)ps__outq_bytes(&p->conn->out));
        psd_conn_write(p->conn);
        tpull_free(ts, p);
        continue;
      }
      uint32_t missing[8];
      uint32_t nm = psd_table_missing(e->t, missing, 8);
      char who[128] = "";
      size_t o = 0;
      for (uint32_t k = 0; k < nm && k < 8 && o + 16 < sizeof who; k++)
        o += (size_t)snprintf(who + o, sizeof who - o, "%s%u", k ? ", " : "", missing[k]);
      if (!p->conn->dead) {
        psd_conn_error(p->conn, p->req, PS_ETIMEDOUT, 0,
                       "pull of table '%s' for step %llu timed out at step %llu: waiting "
                       "for the push of worker(s) %s%s",
                       PS__ESC(psd_table_spec_of(e->t)->name),
                       (unsigned long long)p->min_step,
                       (unsigned long long)psd_table_step(e->t), nm ? who : "(none)",
                       nm > 8 ? " and more" : "");
        psd_conn_write(p->conn);
      }
      tpull_free(ts, p);
    }
  }
}
