/* tablexfer.c - TABLE_* frames (docs/protocol.md 13c) and what their
 * replies do. Keys go out sorted, de-duplicated and split by the ps that
 * holds them (keysort.c); a pull's rows are read straight into the
 * request's own buffer (reader.c's dst iovecs) and scattered into the
 * caller's order when the last one is in, or straight into the caller's
 * out when that is their order (ascending distinct keys on one ps); a
 * push's gradients of duplicate
 * keys are summed straight into the frame. Keys and gradients are copied
 * into the output queue (ps__outq_frame_inline), so nothing queued points
 * at memory a request or the caller may free; the one exception, a step's
 * single add_grad prepared in the table's own pbuf and sent from there,
 * is never rewritten while a frame still points into it. Nothing here
 * waits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

/* A pull of many keys goes to each ps in about this many frames, and up
 * to PS__TPULL_WINDOW of them in flight at once: psd looks up one while
 * the next is on the wire and the rows of the one before come back (one
 * frame did each in turn). Frames hold at least PS__TPULL_MIN_FRAME keys,
 * so a small pull stays one frame (and over shared memory, one copy). */
#define PS__TPULL_PIECES 8
#define PS__TPULL_WINDOW 4
/* A piece no smaller than psd's threshold for sharing a request with its
 * helper threads (psd/par.h: 2 x PSD_PAR_MIN_PART): 100k x 16 over TCP
 * took 4% less in 3 pieces than in 8, with the threads, the same without. */
#define PS__TPULL_MIN_FRAME 32768

/* Scratch kept between calls (sort pairs, a push's groups, a pull's
 * block): a steady step reuses its memory and faults in no fresh pages.
 * Each is dropped after a call that needed less than a PS__TKEEP_SLACK-th
 * of it, once over PS__TKEEP_MIN bytes: a one-off pull of millions of
 * keys does not pin its size for the rest of the job. */
#define PS__TKEEP_MIN ((size_t)1 << 20)
#define PS__TKEEP_SLACK 4

/* Whether `have` bytes kept are far more than `need` a call used. */
static int too_big(size_t have, size_t need) {
  return have > PS__TKEEP_MIN && have / PS__TKEEP_SLACK > need;
}

/* After a call that used n pairs of t: drops scratch far bigger. */
static void tscratch_trim(ps_table *t, size_t n) {
  ps_client *c = t->c;
  if (too_big(c->kp_cap * sizeof *c->kp_tmp, n * sizeof *c->kp_tmp)) {
    free(c->kp_tmp);
    c->kp_tmp = NULL;
    c->kp_cap = 0;
  }
  if (too_big(t->kp_cap * sizeof *t->kp, n * sizeof *t->kp)) {
    free(t->kp);
    t->kp = NULL;
    t->kp_cap = t->kp_n = 0;
  }
  if (too_big(c->kgrp_cap * sizeof *c->kgrp, n * sizeof *c->kgrp)) {
    free(c->kgrp);
    c->kgrp = NULL;
    c->kgrp_cap = 0;
  }
}

/* Whether t->kp are the sorted pairs of keys[0..n): its positions are a
 * permutation of 0..n-1, so keys[kp[i].pos] == kp[i].key for every i
 * means keys is the very array kp was sorted from (one pass of reads,
 * against the radix sort's passes of reads and writes). */
static int tsorted(const ps_table *t, const uint64_t *keys, size_t n) {
  if (n == 0 || t->kp_n != n) return 0;
  const ps__kp *kp = t->kp;
  for (size_t i = 0; i < n; i++)
    if (keys[kp[i].pos] != kp[i].key) return 0;
  return 1;
}

/* t->kp: keys[0..n) sorted (ps__keysort), reusing the last sort when it
 * was of the same keys (a step's push of the keys it pulled). 0 or
 * PS_ENOMEM (message set). */
static int tsort(ps_table *t, const uint64_t *keys, size_t n) {
  ps_client *c = t->c;
  if (tsorted(t, keys, n)) return 0;
  t->kp_n = 0;
  t->kp_gen++;
  t->kp_pull = 0; /* other keys than the last pull's */
  size_t want = n ? n : 1;
  if (ps__grow((void **)&t->kp, &t->kp_cap, want, sizeof *t->kp) ||
      ps__grow((void **)&c->kp_tmp, &c->kp_cap, want, sizeof *c->kp_tmp))
    return ps__seterr(c, PS_ENOMEM, "out of memory sorting %zu keys", n);
  t->kp_ascending = ps__keysort(keys, n, t->kp, c->kp_tmp);
  t->kp_n = n;
  return 0;
}

/* Whether t's sorted keys (tsort) are laid out in the caller's own order:
 * strictly ascending, on one ps. Then they need no split, grouping or
 * scatter: ps 0 takes keys[0..n) as they are (torch.unique's output). */
static int tin_order(const ps_table *t) { return t->kp_ascending && t->c->num_ps == 1; }

/* ps__key_split of t's n sorted keys into first (nps + 1), in one step
 * for keys in the caller's order. Returns the distinct keys. */
static size_t tsplit(const ps_table *t, size_t n, size_t *first) {
  if (!tin_order(t)) return ps__key_split(t->kp, n, (uint32_t)t->c->num_ps, first);
  first[0] = 0;
  first[1] = n;
  return n;
}

/* ---- registration ---------------------------------------------------------- */

static void spec_of(const ps_table *t, Ps__TableSpec *s) {
  const ps_table_config *g = &t->cfg;
  ps__table_spec__init(s);
  s->name = t->name;
  s->dim = g->dim;
  s->capacity = g->capacity;
  s->init_kind = (uint32_t)g->init.kind;
  s->init_a = g->init.a;
  s->init_b = g->init.b;
  s->init_seed = g->init.seed;
  s->opt = (Ps__TableOptKind)g->opt;
  s->lr = g->lr;
  s->initial_accumulator = g->initial_accumulator;
  s->beta1 = g->beta1;
  s->beta2 = g->beta2;
  s->epsilon = g->epsilon;
  s->l1 = g->l1;
  s->l2 = g->l2;
  s->ftrl_beta = g->ftrl_beta;
  s->admit_count = g->admit_count;
  s->admit_prob = g->admit_prob;
  s->evict_after_steps = g->evict_after_steps;
  s->decay = (Ps__LrDecay)g->decay;
  s->decay_rate = g->decay_rate;
  s->decay_steps = g->decay_steps;
  s->warmup_steps = g->warmup_steps;
  s->total_steps = g->total_steps;
  s->min_lr_factor = g->min_lr_factor;
}

int ps__treg_queue(ps_client *c, ps_table *t, ps_req *r) {
  Ps__TableSpec spec;
  spec_of(t, &spec);
  Ps__TableRegister m = PS__TABLE_REGISTER__INIT;
  m.request_id = r->id;
  m.spec = &spec;
  r->reg_table = t;
  for (int p = 0; p < c->num_ps; p++) {
    int rc = ps__queue_frame(c, &c->conns[p], PS__MSG_TABLE_REGISTER, &m.base, NULL, NULL, 0);
    if (rc) return rc;
    ps__req_expect(r, p, 1);
    ps__conn_flush(c, &c->conns[p]);
  }
  return 0;
}

int ps__on_table_register_reply(ps_client *c, ps__conn *k, const Ps__TableRegisterReply *m) {
  ps_req *r = ps__req_find(c, m->request_id);
  if (!r) return 0;
  if (r->type != PS__REQ_TREGISTER || !r->reg_table)
    return ps__proto_err(c, k, "it answered a table register we never sent");
  r->reg_table->ids[k->index] = m->table_id;
  if (m->step < r->step) r->step = m->step;
  ps__req_answered(c, r, k->index, 1);
  return 0;
}

/* ---- pulls ------------------------------------------------------------------- */

/* Whether ps p answers pulls through the shared-memory segment (2.9). */
static int tpull_shm(const ps_client *c, int p) {
  return c->conns[p].shm.map && c->conns[p].minor >= 9;
}

/* Keys of ps p's oldest frame in flight (0: none): every frame but a
 * ps's last holds per_frame keys, and replies come in order. */
static size_t tpull_oldest(const ps__tpull *tp, int p) {
  size_t open = tp->sent[p] - tp->done[p];
  return open < tp->per_frame ? open : tp->per_frame;
}

/* Queues the next TablePull of r's keys on ps p. */
static int tpull_send(ps_client *c, ps_req *r, int p) {
  ps__tpull *tp = r->tp;
  size_t k = tp->first[p + 1] - tp->first[p] - tp->sent[p];
  if (k > tp->per_frame) k = tp->per_frame;
  Ps__TablePull m = PS__TABLE_PULL__INIT;
  m.request_id = r->id;
  m.table_id = tp->t->ids[p];
  m.min_step = tp->min_step;
  m.count = k;
  m.read_only = tp->read_only;
  m.timeout_ms = (uint32_t)c->request_timeout_ms;
  m.shm_reply = tpull_shm(c, p); /* rows through the segment */
  void *d = ps__outq_frame_inline(&c->conns[p].out, PS__MSG_TABLE_PULL, &m.base,
                                  (uint64_t)k * sizeof(uint64_t));
  if (!d) return ps__seterr(c, PS_ENOMEM, "out of memory queueing a pull of %zu keys", k);
  memcpy(d, tp->keys + tp->first[p] + tp->sent[p], k * sizeof(uint64_t));
  if (!tp->read_only) {
    /* psd's memo (tmemo.h) starts over with a request's first piece; a
     * later piece after another request's holds only the rest */
    ps_table *t = tp->t;
    if (tp->sent[p] && t->memo_req[p] != r->id) tp->kept[p] = 0;
    t->memo_req[p] = r->id;
  }
  tp->sent[p] += k;
  ps__req_expect(r, p, 1);
  ps__telem_bytes(&c->telem, p, 0, (uint64_t)k * sizeof(uint64_t));
  return 0;
}

/* Sends ps p's next frames: one alone until it is answered when it may
 * park for its step (psd parks one pull per connection, and a second
 * would replace it), then up to PS__TPULL_WINDOW in flight, so psd looks
 * up one piece while the next is on the wire and the last one's rows come
 * back. A pull for a step the ps has named already cannot park: its
 * window is open from the start. 0 or PS_ENOMEM. */
static int tpull_fill(ps_client *c, ps_req *r, int p) {
  ps__tpull *tp = r->tp;
  size_t total = tp->first[p + 1] - tp->first[p];
  int open = tp->done[p] || tp->min_step <= tp->t->seen_step[p];
  size_t window = open ? PS__TPULL_WINDOW : 1;
  while (tp->sent[p] < total &&
         (tp->sent[p] - tp->done[p] + tp->per_frame - 1) / tp->per_frame < window) {
    int rc = tpull_send(c, r, p);
    if (rc) return rc;
  }
  ps__conn_flush(c, &c->conns[p]);
  return 0;
}

/* Bytes of a pull's block: the struct, per-ps arrays, inverse map, keys
 * and rows, each part 8-byte aligned. 0 on overflow. */
static size_t tpull_bytes(size_t nps, size_t n, size_t nu, uint32_t dim) {
  uint64_t per_ps = 0, inv = 0, keys = 0, rows = 0, total = sizeof(ps__tpull);
  if (ps__mul_u64(5 * (uint64_t)nps + 1, sizeof(size_t), &per_ps) ||
      ps__mul_u64(n, sizeof(size_t), &inv) || ps__mul_u64(nu, sizeof(uint64_t), &keys) ||
      ps__mul_u64(nu, (uint64_t)dim * sizeof(float), &rows) ||
      ps__add_u64(total, per_ps, &total) || ps__add_u64(total, inv, &total) ||
      ps__add_u64(total, keys, &total) || ps__add_u64(total, rows, &total) ||
      total > SIZE_MAX)
    return 0;
  return (size_t)total;
}

/* Carves r->tp's arrays out of its block (sizes as tpull_bytes). */
static void tpull_carve(ps__tpull *tp, size_t nps) {
  size_t *z = (size_t *)(tp + 1);
  tp->first = z;
  tp->sent = z + nps + 1;
  tp->done = z + 2 * nps + 1;
  tp->kept = z + 4 * nps + 1; /* [3 nps + 1, 4 nps + 1): the layout's scratch */
  tp->inv = z + 5 * nps + 1;
  tp->keys = (uint64_t *)(tp->inv + tp->n);
  tp->rows = (float *)(tp->keys + tp->nu);
}

/* A block of at least `bytes` for a pull: the one the last released pull
 * left (request.c) when it fits and is not far bigger, else a new one. */
static ps__tpull *tpull_alloc(ps_client *c, size_t bytes) {
  ps__tpull *tp = c->tp_keep;
  c->tp_keep = NULL;
  if (tp && tp->bytes >= bytes && !too_big(tp->bytes, bytes)) return tp;
  free(tp);
  tp = malloc(bytes);
  if (tp) tp->bytes = bytes;
  return tp;
}

/* Keys per TablePull frame: a ps's keys in as many even pieces of at
 * least PS__TPULL_MIN_FRAME as they make, at most PS__TPULL_PIECES (of
 * the ps with most), none over what one frame takes (keys, or rows of
 * data). One ps through shared memory gets
 * the pull whole: its rows are then copied once, from the pull ring
 * straight into the caller's order (measured faster than pieces). */
static size_t tpull_per_frame(const ps_client *c, const ps__tpull *tp, size_t nps) {
  uint64_t most = 0, cap = PS__MAX_DATA / ((uint64_t)tp->dim * sizeof(float));
  for (size_t p = 0; p < nps; p++)
    if (tp->first[p + 1] - tp->first[p] > most) most = tp->first[p + 1] - tp->first[p];
  uint64_t pieces = most / PS__TPULL_MIN_FRAME;
  if (pieces > PS__TPULL_PIECES) pieces = PS__TPULL_PIECES;
  if (pieces < 1) pieces = 1;
  uint64_t k = most ? (most + pieces - 1) / pieces : 1; /* never 0: it divides */
  if (nps == 1 && tpull_shm(c, 0) && most > k) k = most;
  if (k > cap) k = cap;
  return k < PS__MAX_TABLE_KEYS ? (size_t)k : PS__MAX_TABLE_KEYS;
}

/* Whether tp's distinct keys are laid out in the caller's own order
 * (sorted distinct keys on one ps, as torch.unique gives them): each row's
 * place in out is then its place in the replies, and the rows are read
 * straight into out, saving a copy of every row. */
static int tpull_in_order(const ps__tpull *tp) {
  if (tp->n != tp->nu) return 0;
  for (size_t i = 0; i < tp->n; i++)
    if (tp->inv[i] != i) return 0;
  return 1;
}

int ps__tpull_start(ps_table *t, uint64_t min_step, const uint64_t *keys, size_t n,
                    float *out, int read_only, ps_req **out_req) {
  ps_client *c = t->c;
  size_t nps = (size_t)c->num_ps;
  if (tsort(t, keys, n)) return PS_ENOMEM;
  const ps__kp *kp = t->kp;
  size_t nu = 0;
  if (tin_order(t))
    nu = n;
  else
    for (size_t i = 0; i < n; i++) nu += i == 0 || kp[i].key != kp[i - 1].key;
  size_t bytes = tpull_bytes(nps, n, nu, t->cfg.dim);
  ps__tpull *tp = bytes ? tpull_alloc(c, bytes) : NULL;
  if (!tp)
    return ps__seterr(c, PS_ENOMEM, "table '%s': out of memory for the rows of %zu keys",
                      t->name, nu);
  *tp = (ps__tpull){.bytes = tp->bytes, .t = t, .out = out, .n = n, .nu = nu,
                    .dim = t->cfg.dim, .min_step = min_step, .read_only = read_only};
  tpull_carve(tp, nps);
  memset(tp->sent, 0, 3 * nps * sizeof *tp->sent);
  for (size_t p = 0; p < nps; p++) tp->kept[p] = 1;
  tp->kp_gen = t->kp_gen;
  if (!read_only) /* the servers' memory of the last pull goes: a push
                   * prepared already (add_grad before the pull) names none */
    t->kp_pull = t->p_pull = 0;
  tsplit(t, n, tp->first);
  if (tin_order(t)) { /* no grouping: the keys as given (inv unused) */
    memcpy(tp->keys, keys, n * sizeof *keys);
    tp->in_order = 1;
  } else {
    ps__key_layout(kp, n, (uint32_t)nps, tp->first, tp->done + nps, tp->keys, tp->inv, NULL);
    tp->in_order = tpull_in_order(tp);
  }
  tp->per_frame = tpull_per_frame(c, tp, nps);
  if (tp->in_order) tp->rows = out;
  tscratch_trim(t, n);
  ps_req *r = ps__req_new(c, PS__REQ_TPULL);
  if (!r) {
    free(tp);
    return ps__seterr(c, PS_ENOMEM, "out of memory");
  }
  r->tp = tp; /* freed with the request */
  for (int p = 0; p < c->num_ps; p++) {
    if (tp->first[p + 1] == tp->first[p]) continue; /* no key of this ps */
    int rc = tpull_fill(c, r, p);
    if (rc) {
      ps__req_release(c, r);
      return rc;
    }
  }
  *out_req = r;
  return 0;
}

int ps__tstep_start(ps_client *c, ps_table *const *tables, size_t n, uint64_t min_step,
                    ps_req **out_req) {
  ps_req *r = ps__req_new(c, PS__REQ_TSTEP);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  for (int p = 0; p < c->num_ps; p++) {
    for (size_t i = 0; i < n; i++) {
      Ps__TablePull m = PS__TABLE_PULL__INIT;
      m.request_id = r->id;
      m.table_id = tables[i]->ids[p];
      m.min_step = min_step;
      m.timeout_ms = (uint32_t)c->request_timeout_ms;
      int rc = ps__queue_frame(c, &c->conns[p], PS__MSG_TABLE_PULL, &m.base, NULL, NULL, 0);
      if (rc) {
        ps__req_release(c, r);
        return rc;
      }
      ps__req_expect(r, p, 1);
    }
    ps__conn_flush(c, &c->conns[p]);
  }
  if (r->pending == 0) ps__req_finish(c, r);
  *out_req = r;
  return 0;
}

/* Row i of the caller's keys into out + i * dim, from rows in key order. */
static void tpull_scatter(const ps__tpull *tp, const float *rows) {
  for (size_t i = 0; i < tp->n; i++)
    ps__copy_row(tp->out + i * tp->dim, rows + tp->inv[i] * tp->dim, tp->dim);
}

/* ps p named step for its table id: remembered as that table's (the
 * largest yet). */
static void seen_step(ps_client *c, int p, uint32_t id, uint64_t step) {
  for (size_t i = 0; i < c->ntables; i++) {
    ps_table *t = c->tables[i];
    if (t->ids[p] == id && t->seen_step[p] < step) t->seen_step[p] = step;
  }
}

int ps__table_pull_reply(ps_client *c, ps__conn *k, ps_req *r, const Ps__TablePullReply *m) {
  int p = k->index;
  if (!r->first_reply_at) r->first_reply_at = ps__now();
  if (r->type == PS__REQ_TSTEP) {
    if (m->count || k->hdr.data_len)
      return ps__proto_err(c, k, "it sent rows for a table pull of no keys");
    if (m->step < r->step) r->step = m->step;
    seen_step(c, p, m->table_id, m->step);
    return 0;
  }
  if (r->type != PS__REQ_TPULL || !r->tp)
    return ps__proto_err(c, k, "it answered a table pull we never sent");
  ps__tpull *tp = r->tp;
  size_t oldest = tpull_oldest(tp, p);
  uint64_t want = (uint64_t)oldest * tp->dim * sizeof(float);
  if (!oldest || m->count != oldest || m->table_id != tp->t->ids[p] ||
      k->hdr.data_len != want) {
    char e[300];
    snprintf(e, sizeof e, "it answered a pull of %zu keys of table '%s' (id %u) with %llu "
             "rows of table id %u in %llu data bytes", oldest, tp->t->name,
             tp->t->ids[p], (unsigned long long)m->count, m->table_id,
             (unsigned long long)k->hdr.data_len);
    return ps__proto_err(c, k, e);
  }
  if (m->step < r->step) r->step = m->step;
  if (tp->t->seen_step[p] < m->step) tp->t->seen_step[p] = m->step;
  if (!m->remembered) tp->kept[p] = 0;
  if (k->shm_src && c->num_ps == 1 && oldest == tp->nu) {
    /* The whole pull in one frame in the pull ring: its rows go straight
     * into the caller's order, one copy. */
    if (tp->in_order)
      memcpy(tp->out, k->shm_src, (size_t)want);
    else
      tpull_scatter(tp, (const float *)(const void *)k->shm_src);
    tp->direct = 1;
    return 1;
  }
  if (ps__grow((void **)&k->dst, &k->capdst, 1, sizeof *k->dst)) {
    ps__conn_break(c, k, PS_ENOMEM, "out of memory");
    return PS_ENOMEM;
  }
  size_t at = tp->first[p] + tp->done[p];
  k->dst[0].iov_base = tp->rows + at * tp->dim;
  k->dst[0].iov_len = (size_t)want;
  k->ndst = 1;
  k->data_own = 1;
  return 0;
}


/* r, a pull, is answered whole: a push of its keys (their sort still the
 * table's) may name it to the servers that remembered them (2.10). */
static void tpull_kept(const ps__tpull *tp, const ps_req *r) {
  ps_table *t = tp->t;
  if (r->status || tp->read_only || tp->kp_gen != t->kp_gen) return;
  t->kp_pull = r->id;
  for (int p = 0; p < t->c->num_ps; p++) t->kept[p] = tp->kept[p] != 0;
}

/* A TablePush of t queued for ps p: psd forgets its memo of t there. */
static void tpush_sent(ps_table *t, int p) { t->memo_req[p] = 0; }

void ps__table_pull_done(ps_client *c, ps__conn *k, ps_req *r) {
  int p = k->index;
  if (r->type == PS__REQ_TPULL) {
    ps__tpull *tp = r->tp;
    tp->done[p] += tpull_oldest(tp, p);
    if (tpull_fill(c, r, p) != 0) {
      char e[sizeof c->errmsg];
      snprintf(e, sizeof e, "%s", c->errmsg);
      ps__req_fail(c, r, PS_ENOMEM, e);
      return;
    }
    if (r->pending == 1 && !tp->direct && !tp->in_order)
      tpull_scatter(tp, tp->rows); /* this was the last reply */
    if (r->pending == 1) tpull_kept(tp, r);
  }
  ps__req_answered(c, r, p, 1);
}

/* ---- pushes ------------------------------------------------------------------ */

/* Distinct keys of the client's sorted pairs per ps into first (nps + 1):
 * 0, or PS_ETOOBIG when one ps's would exceed a TablePush. */
static int push_fits(ps_table *t, size_t n, size_t *first) {
  ps_client *c = t->c;
  tsplit(t, n, first);
  uint64_t per_key = sizeof(uint64_t) + (uint64_t)t->cfg.dim * sizeof(float);
  for (int p = 0; p < c->num_ps; p++) {
    uint64_t cnt = first[p + 1] - first[p];
    if (cnt <= PS__MAX_TABLE_KEYS && cnt * per_key <= PS__MAX_TABLE_PUSH_BYTES) continue;
    return ps__seterr(c, PS_ETOOBIG,
                      "table '%s': the push for ps %d has %llu distinct keys (%llu bytes), "
                      "more than one TablePush takes (%u keys, %llu bytes): push fewer keys "
                      "per step", t->name, p, (unsigned long long)cnt,
                      (unsigned long long)(cnt * per_key), PS__MAX_TABLE_KEYS,
                      (unsigned long long)PS__MAX_TABLE_PUSH_BYTES);
  }
  return 0;
}

int ps__tpush_check(ps_table *t, const uint64_t *keys, size_t n) {
  ps_client *c = t->c;
  uint64_t per_key = sizeof(uint64_t) + (uint64_t)t->cfg.dim * sizeof(float), all;
  if (n <= PS__MAX_TABLE_KEYS && !ps__mul_u64(n, per_key, &all) &&
      all <= PS__MAX_TABLE_PUSH_BYTES)
    return 0; /* even all of them on one ps fit */
  size_t *first = malloc(((size_t)c->num_ps + 1) * sizeof *first);
  int rc = first ? tsort(t, keys, n) : ps__seterr(c, PS_ENOMEM, "out of memory");
  if (!rc) rc = push_fits(t, n, first);
  free(first);
  tscratch_trim(t, n);
  return rc;
}

/* Keys from grp[g] on (before hi) that are distinct and in the caller's
 * order, one after another (ascending keys, as torch.unique gives them):
 * their gradients are one block of the caller's. 0 when g's key has
 * duplicates. */
static size_t in_order_run(const ps__kp *kp, size_t n, const size_t *grp, size_t g, size_t hi) {
  size_t i = grp[g], r = 0;
  while (g + r < hi && grp[g + r] == i + r && kp[i + r].pos == kp[i].pos + r &&
         (i + r + 1 >= n || kp[i + r + 1].key != kp[i + r].key))
    r++;
  return r;
}

/* Writes ps p's keys and summed gradients (first[p]..first[p+1] of the
 * grouped layout, grp: their first pairs; NULL: the keys are in the
 * caller's order, tin_order) into a frame's data d. acc: dim floats of
 * scratch (d need not be aligned). */
static void push_fill(const ps_table *t, const ps__kp *kp, size_t n, const size_t *grp,
                      size_t lo, size_t hi, const float *grads, uint8_t *d, float *acc) {
  uint32_t dim = t->cfg.dim;
  size_t row = (size_t)dim * sizeof(float);
  uint8_t *gd = d + (hi - lo) * sizeof(uint64_t);
  if (!grp) { /* pair g is (key g, position g): one block of gradients */
    for (size_t g = lo; g < hi; g++) memcpy(d + (g - lo) * sizeof(uint64_t), &kp[g].key, 8);
    memcpy(gd, grads + lo * dim, (hi - lo) * row);
    return;
  }
  for (size_t g = lo; g < hi; g++) {
    size_t i = grp[g];
    uint64_t key = kp[i].key;
    memcpy(d + (g - lo) * sizeof(uint64_t), &key, sizeof key);
    const float *first = grads + kp[i].pos * dim;
    size_t run = in_order_run(kp, n, grp, g, hi);
    if (run > 1) { /* distinct keys in the caller's order: their rows at once */
      for (size_t r = 1; r < run; r++)
        memcpy(d + (g + r - lo) * sizeof(uint64_t), &kp[i + r].key, sizeof(uint64_t));
      memcpy(gd + (g - lo) * row, first, run * row);
      g += run - 1;
      continue;
    }
    if (i + 1 >= n || kp[i + 1].key != key) { /* no duplicate: one copy */
      ps__copy_row(gd + (g - lo) * row, first, dim); /* inline: no call per row */
      continue;
    }
    memcpy(acc, first, row);
    /* Duplicates in the caller's order (the sort is stable). */
    for (i++; i < n && kp[i].key == key; i++) {
      const float *src = grads + kp[i].pos * dim;
      for (uint32_t e = 0; e < dim; e++) acc[e] += src[e];
    }
    memcpy(gd + (g - lo) * row, acc, row);
  }
}

/* Where `bytes` of a TablePush's data go in k's push ring (2.9), its
 * position in *pos; NULL: over TCP (no segment, a server older than 2.9,
 * or no room now). */
static uint8_t *push_ring(ps__conn *k, uint64_t bytes, uint64_t *pos) {
  return k->minor < 9 ? NULL : ps__push_reserve(k, bytes, pos);
}

/* The TablePush of cnt keys of t for ps p in step, for r. */
static Ps__TablePush push_msg(const ps_table *t, const ps_req *r, int p, uint64_t step,
                              size_t cnt) {
  Ps__TablePush m = PS__TABLE_PUSH__INIT;
  m.request_id = r->id;
  m.table_id = t->ids[p];
  m.step = step;
  m.count = cnt;
  m.want_stop = t->c->stop_requested != 0;
  return m;
}

/* Where a ps's prepared data is (t->pheld). */
enum {
  PS__HELD_NO = 0, /* in pbuf */
  PS__HELD_RING,   /* held in its push ring (ps__push_hold) */
  PS__HELD_SENT    /* sent from there by a step that failed at a later ps:
                      gone from the ring, so a retry sends that ps no keys
                      (it has them; it answers the same step's second push
                      as a duplicate) */
};

/* Ends the holds t took in its push rings (their data was copied to
 * pbuf, or out of it); a ps sent already stays so. */
static void tpush_drop_holds(ps_table *t) {
  for (int p = 0; p < t->c->num_ps; p++)
    if (t->pheld[p] == PS__HELD_RING) {
      ps__push_hold_drop(&t->c->conns[p]);
      t->pheld[p] = PS__HELD_NO;
    }
}

/* Holds room for each ps's prepared data in its push ring where there is
 * some (2.9; the frame is queued at the step, from there); returns the
 * bytes of the rest, which go to pbuf. */
static size_t tpush_hold(ps_table *t, const size_t *first, uint64_t per_key) {
  size_t staged = 0;
  for (int p = 0; p < t->c->num_ps; p++) {
    ps__conn *k = &t->c->conns[p];
    uint64_t bytes = (first[p + 1] - first[p]) * per_key;
    int held = k->minor >= 9 && bytes && ps__push_hold_take(k, bytes) != NULL;
    t->pheld[p] = held ? PS__HELD_RING : PS__HELD_NO;
    if (!held) staged += (size_t)bytes;
  }
  return staged;
}

int ps__tpush_prepare(ps_table *t, const uint64_t *keys, size_t n, const float *grads) {
  ps_client *c = t->c;
  size_t nps = (size_t)c->num_ps;
  /* A step that failed may have left a frame queued that points into
   * pbuf: it must not change under it. */
  for (int p = 0; p < c->num_ps; p++)
    if (c->conns[p].out.ext_len) return 1;
  if (!t->pfirst && !(t->pfirst = malloc((2 * nps + 1) * sizeof *t->pfirst)))
    return ps__seterr(c, PS_ENOMEM, "out of memory");
  if (!t->pheld && !(t->pheld = calloc(nps, 1))) return ps__seterr(c, PS_ENOMEM, "out of memory");
  const uint64_t gen = t->kp_gen;
  int rc = tsort(t, keys, n);
  if (rc) return rc;
  /* The keys of the table's last pull: the push may name it (once). */
  t->p_pull = t->kp_gen == gen ? t->kp_pull : 0;
  t->kp_pull = 0;
  size_t *first = t->pfirst;
  if (push_fits(t, n, first) != 0) return 1; /* refused at the step, as staged rows are */
  uint64_t per_key = sizeof(uint64_t) + (uint64_t)t->cfg.dim * sizeof(float);
  /* pbuf takes what no ring holds, at the same offsets as if it took all
   * (fits: push_fits bounds each ps's; only the pages written are touched) */
  size_t staged = tpush_hold(t, first, per_key);
  size_t bytes = staged ? (size_t)(first[nps] * per_key) : 0;
  if (too_big(t->pcap, bytes)) {
    free(t->pbuf);
    t->pbuf = NULL;
    t->pcap = 0;
  }
  float *acc = malloc((size_t)t->cfg.dim * sizeof *acc);
  if (!acc || ps__grow((void **)&t->pbuf, &t->pcap, bytes ? bytes : 1, 1) ||
      ps__grow((void **)&c->kgrp, &c->kgrp_cap, first[nps] ? first[nps] : 1, sizeof *c->kgrp)) {
    free(acc);
    tpush_drop_holds(t);
    return ps__seterr(c, PS_ENOMEM, "table '%s': out of memory staging %zu gradients",
                      t->name, n);
  }
  const size_t *grp = tin_order(t) ? NULL : c->kgrp;
  if (grp) ps__key_layout(t->kp, n, (uint32_t)nps, first, first + nps + 1, NULL, NULL, c->kgrp);
  for (size_t p = 0; p < nps; p++)
    push_fill(t, t->kp, n, grp, first[p], first[p + 1], grads,
              t->pheld[p] == PS__HELD_RING ? ps__push_held(&c->conns[p]) : t->pbuf + first[p] * per_key,
              acc);
  free(acc);
  tscratch_trim(t, n);
  t->prepared = 1;
  return 0;
}

int ps__tpush_unprepare(ps_table *t) {
  if (!t->prepared) return 0;
  size_t nps = (size_t)t->c->num_ps, dim = t->cfg.dim, all = t->pfirst[nps];
  if (ps__grow((void **)&t->skeys, &t->skcap, t->sn + all, sizeof *t->skeys) ||
      ps__grow((void **)&t->sgrads, &t->sgcap, (t->sn + all) * dim, sizeof *t->sgrads))
    return ps__seterr(t->c, PS_ENOMEM, "table '%s': out of memory staging %zu gradients",
                      t->name, all);
  uint64_t per_key = sizeof(uint64_t) + (uint64_t)dim * sizeof(float);
  for (size_t p = 0; p < nps; p++) {
    size_t cnt = t->pheld[p] == PS__HELD_SENT ? 0 : t->pfirst[p + 1] - t->pfirst[p];
    if (!cnt) continue; /* pbuf may not reach this ps's offset then */
    const uint8_t *d = t->pheld[p] == PS__HELD_RING ? ps__push_held(&t->c->conns[p])
                                                    : t->pbuf + t->pfirst[p] * per_key;
    memcpy(t->skeys + t->sn, d, cnt * sizeof(uint64_t));
    memcpy(t->sgrads + t->sn * dim, d + cnt * sizeof(uint64_t), cnt * dim * sizeof(float));
    t->sn += cnt;
  }
  tpush_drop_holds(t); /* its bytes stay as a gap the ring's next frame skips */
  memset(t->pheld, PS__HELD_NO, nps);
  t->prepared = 0;
  return 0;
}

int ps__tpush_unhold(ps_table *t) {
  if (!t->prepared) return 0;
  ps_client *c = t->c;
  size_t nps = (size_t)c->num_ps, bytes = 0;
  uint64_t per_key = sizeof(uint64_t) + (uint64_t)t->cfg.dim * sizeof(float);
  for (size_t p = 0; p < nps; p++)
    if (t->pheld[p] == PS__HELD_RING) bytes = (size_t)(t->pfirst[nps] * per_key);
  if (!bytes) return 0;
  if (ps__grow((void **)&t->pbuf, &t->pcap, bytes, 1))
    return ps__seterr(c, PS_ENOMEM, "table '%s': out of memory", t->name);
  for (size_t p = 0; p < nps; p++)
    if (t->pheld[p] == PS__HELD_RING)
      memcpy(t->pbuf + t->pfirst[p] * per_key, ps__push_held(&c->conns[p]),
             (t->pfirst[p + 1] - t->pfirst[p]) * per_key);
  tpush_drop_holds(t);
  return 0;
}

int ps__tpush_queue_prepared(ps_table *t, ps_req *r, uint64_t step) {
  ps_client *c = t->c;
  uint64_t per_key = sizeof(uint64_t) + (uint64_t)t->cfg.dim * sizeof(float);
  /* Only the first try names the pull: the servers forget its keys at
   * the push, and one that has the push answers a retry as a duplicate. */
  const uint64_t pull = t->p_pull;
  t->p_pull = 0;
  for (int p = 0; p < c->num_ps; p++) {
    const int held = t->pheld[p];
    size_t cnt = held == PS__HELD_SENT ? 0 : t->pfirst[p + 1] - t->pfirst[p];
    Ps__TablePush m = push_msg(t, r, p, step, cnt);
    /* By reference: the data is written from pbuf, which nothing changes
     * while a frame is queued (ps__tpush_prepare checks). A ps whose data
     * is held in its ring, or has none, has no part of pbuf. */
    /* 2.10: the server holds these keys from the pull: the gradients
     * alone (in the ring, the keys before them are a gap psd steps over) */
    const int keyless = cnt && pull && t->kept[p] && t->memo_req[p] == pull &&
                        c->conns[p].minor >= 10;
    const uint64_t skip = keyless ? cnt * sizeof(uint64_t) : 0;
    if (keyless) m.pull_id = pull;
    const uint8_t *seg = held || !cnt ? NULL : t->pbuf + t->pfirst[p] * per_key + skip;
    uint64_t bytes = cnt * per_key - skip, pos;
    uint64_t floats = bytes / sizeof(float);
    const float *fseg = (const float *)(const void *)seg;
    uint8_t *ring = held ? NULL : push_ring(&c->conns[p], bytes, &pos);
    if (ring && cnt) memcpy(ring, seg, bytes);
    int rc = held == PS__HELD_RING
                 ? ps__push_hold_queue(&c->conns[p], PS__MSG_TABLE_PUSH, &m.base, skip)
             : ring ? ps__outq_frame_shm(&c->conns[p].out, PS__MSG_TABLE_PUSH, &m.base, bytes,
                                         pos)
                    : ps__outq_frame(&c->conns[p].out, PS__MSG_TABLE_PUSH, &m.base, &fseg,
                                     &floats, NULL, cnt ? 1 : 0);
    if (!rc && held == PS__HELD_RING) t->pheld[p] = PS__HELD_SENT;
    if (rc)
      return ps__seterr(c, rc, "table '%s': %s queueing a push of %zu keys", t->name,
                        rc == PS_ETOOBIG ? "frame limits exceeded" : "out of memory", cnt);
    tpush_sent(t, p);
    ps__req_expect(r, p, 1);
    ps__telem_bytes(&c->telem, p, 0, bytes);
    ps__conn_flush(c, &c->conns[p]);
  }
  memset(t->pheld, PS__HELD_NO, (size_t)c->num_ps);
  t->prepared = 0;
  return 0;
}

int ps__tpush_queue(ps_table *t, ps_req *r, uint64_t step, const uint64_t *keys, size_t n,
                    const float *grads) {
  ps_client *c = t->c;
  size_t nps = (size_t)c->num_ps;
  size_t *first = malloc((2 * nps + 1) * sizeof *first);
  float *acc = malloc((size_t)t->cfg.dim * sizeof *acc);
  int rc = first && acc ? tsort(t, keys, n) : ps__seterr(c, PS_ENOMEM, "out of memory");
  if (!rc) rc = push_fits(t, n, first);
  if (!rc && ps__grow((void **)&c->kgrp, &c->kgrp_cap, first[nps] ? first[nps] : 1,
                      sizeof *c->kgrp))
    rc = ps__seterr(c, PS_ENOMEM, "out of memory");
  const size_t *grp = tin_order(t) ? NULL : c->kgrp;
  if (!rc && grp)
    ps__key_layout(t->kp, n, (uint32_t)nps, first, first + nps + 1, NULL, NULL, c->kgrp);
  uint64_t per_key = sizeof(uint64_t) + (uint64_t)t->cfg.dim * sizeof(float);
  for (int p = 0; p < c->num_ps && !rc; p++) {
    /* Every ps gets one, possibly empty: it counts toward the step. */
    size_t cnt = first[p + 1] - first[p];
    Ps__TablePush m = push_msg(t, r, p, step, cnt);
    uint64_t pos;
    uint8_t *ring = push_ring(&c->conns[p], cnt * per_key, &pos);
    uint8_t *d = ring ? ring : ps__outq_frame_inline(&c->conns[p].out, PS__MSG_TABLE_PUSH,
                                                     &m.base, cnt * per_key);
    if (ring && ps__outq_frame_shm(&c->conns[p].out, PS__MSG_TABLE_PUSH, &m.base, cnt * per_key,
                                   pos) != 0)
      d = NULL;
    if (!d) {
      rc = ps__seterr(c, PS_ENOMEM, "table '%s': out of memory queueing a push of %zu keys",
                      t->name, cnt);
      break;
    }
    push_fill(t, t->kp, n, grp, first[p], first[p + 1], grads, d, acc);
    tpush_sent(t, p);
    ps__req_expect(r, p, 1);
    ps__telem_bytes(&c->telem, p, 0, cnt * per_key);
    ps__conn_flush(c, &c->conns[p]);
  }
  free(first);
  free(acc);
  tscratch_trim(t, n);
  return rc;
}

int ps__on_table_push_reply(ps_client *c, ps__conn *k, const Ps__TablePushReply *m) {
  ps_req *r = ps__req_find(c, m->request_id);
  if (!r) return 0;
  if (r->type != PS__REQ_TPUSH)
    return ps__proto_err(c, k, "it answered a table push we never sent");
  r->dropped += m->dropped;
  int st = m->status;
  char why[400];
  if (m->message && m->message[0]) snprintf(why, sizeof why, "%.399s", m->message);
  else snprintf(why, sizeof why, "%s", ps_strerror(st));
  if (st == PS_ESTALE) {
    r->stale = 1;
  } else if (st == PS_EDUPLICATE) { /* not an error for a step: see ps_req_wait */
    if (!r->duplicate && !r->status)
      snprintf(r->msg, sizeof r->msg, "ps %d at %.80s: %.399s", k->index, k->addr, why);
    r->duplicate = 1;
  } else if (st != 0 && !r->status) {
    r->status = st < 0 ? st : PS_EPROTO;
    snprintf(r->msg, sizeof r->msg, "ps %d at %.80s refused a table gradient: %.380s",
             k->index, k->addr, why);
    snprintf(c->errmsg, sizeof c->errmsg, "%s", r->msg);
  }
  ps__req_answered(c, r, k->index, 1);
  return 0;
}
