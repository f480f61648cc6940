/* persist.c - checkpoint scheduling, the stop protocol and restoring. */
#define _GNU_SOURCE /* RUSAGE_THREAD */
#include "persist.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "ckpttable.h"
#include "job.h"
#include "optimizer.h"
#include "psdlog.h"
#include "wire.h"

/* An optimizer kind's name for a message ("adam"), or "an unknown kind". */
static const char *kind_or_unknown(int kind) {
  const char *n = ps__opt_kind_name(kind);
  return n ? n : "an unknown kind";
}

static int enabled(const psd_persist *p) { return p->cfg->ckpt_dir[0] != '\0'; }

/* Table i served pulls at its step since reaching it (sync mode): its
 * rows are no longer exactly that step's, so the step it can be
 * checkpointed at exactly is the next one. */
static int table_read(const psd_persist *p, uint32_t i) {
  return !p->shard->async_mode && p->tabs[i].read_at == psd_table_step(p->tabs[i].t) + 1;
}

/* The step table i can be checkpointed at exactly from now on. */
static uint64_t table_ckpt_step(const psd_persist *p, uint32_t i) {
  return psd_table_step(p->tabs[i].t) + (uint64_t)table_read(p, i);
}

/* The most advanced slice's step, or table's (its checkpoint step: a table
 * that served pulls at step s counts as s + 1, so the chief, which
 * prepares again at max_step + 1, lands on a step it can hold exactly). */
static uint64_t max_step(const psd_persist *p) {
  uint64_t m = 0;
  for (uint32_t i = 0; i < p->shard->n; i++)
    if (p->shard->slices[i]->step > m) m = p->shard->slices[i]->step;
  for (uint32_t i = 0; i < p->ntabs; i++)
    if (table_ckpt_step(p, i) > m) m = table_ckpt_step(p, i);
  return m;
}

/* Bytes the tables reserve against --max-memory (as tables.c does). */
static uint64_t tables_reserved(const psd_persist *p) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < p->ntabs; i++) {
    uint64_t b = psd_table_bytes(psd_table_spec_of(p->tabs[i].t));
    n = b > UINT64_MAX - n ? UINT64_MAX : n + b;
  }
  return n;
}

/* ---- writing -------------------------------------------------------------- */

/* A checkpoint at step is durable here (2) or on its way to the disk (1). */
static int have_step(const psd_persist *p, uint64_t step) {
  if (p->have_last && p->last_step == step) return 2;
  return p->writing && p->writing_step == step;
}

static void abort_ckpt(psd_persist *p, const char *why) {
  if (!p->cur) return;
  psd_warn("checkpoint at step %" PRIu64 " abandoned: %s", p->cur_step, why);
  psd_ckptq_abort(p->q, p->cur);
  p->cur = NULL;
}

void psd_persist_release(psd_persist *p, psd_slice *sl) {
  if (!sl->ck_hold) return;
  if (psd_ckptq_release(p->q, sl->ck_hold) != 0)
    psd_error("out of memory keeping slice '%s' for the checkpoint being written; that "
              "checkpoint will fail", PS__ESC(sl->name));
  sl->ck_hold = NULL;
}

static void capture(psd_persist *p, psd_slice *sl) {
  if (!p->cur || sl->ck_gen == p->gen || sl->id >= p->cur_nslices) return;
  psd_ckpt_rec r;
  memset(&r, 0, sizeof r);
  r.name = sl->name;
  r.ndim = sl->ndim;
  memcpy(r.shape, sl->shape, sizeof r.shape);
  r.offset = sl->offset;
  r.length = sl->length;
  r.opt_kind = (uint32_t)sl->opt.kind;
  r.state_per = (uint32_t)psd_opt_state_per_elem(&sl->opt);
  r.step = sl->step;
  r.param = sl->param;
  r.state = sl->state;
  /* Still held by an earlier file (async mode captures slices that have
   * not moved): that file takes its own copy of what it has not written. */
  psd_persist_release(p, sl);
  if (psd_ckptq_add(p->q, p->cur, &r, &sl->ck_hold) != 0) {
    psd_error("out of memory queueing slice '%s' for checkpoint step %" PRIu64,
              PS__ESC(sl->name), p->cur_step);
    abort_ckpt(p, "out of memory");
    return;
  }
  sl->ck_gen = p->gen;
  p->cur_written++;
}

/* A table's copy buffer has 1/8 more room than the copy, and ROOM_MIN
 * bytes at least: rows added before its next checkpoint then still fit,
 * and a buffer prepared ahead (prepare_copy) is grown again only every
 * 1/8 of growth, not at each step of a small table. */
#define ROOM_MIN ((size_t)64 << 10)

/* A buffer size for a copy of len bytes of table t, with room to grow
 * (never more than its copy at capacity). */
static size_t with_room(const psd_table *t, size_t len) {
  size_t room = len / 8 > ROOM_MIN ? len / 8 : ROOM_MIN, most = psd_ckpttable_max_size(t);
  size_t cap = len > SIZE_MAX - room ? len : len + room;
  if (most && cap > most) cap = most;
  return cap > len ? cap : len;
}

/* Whether `more` bytes fit under --max-memory with the slices, the
 * tables' reservations and the checkpoint buffers; *have gets those. */
static int fits(const psd_persist *p, uint64_t more, uint64_t *have) {
  *have = p->shard->bytes_alloc + tables_reserved(p) + psd_persist_held_bytes(p);
  return (double)*have + (double)more <= p->cfg->max_memory;
}

/* A buffer of at least len bytes for table id's copy: its spare (no page
 * faults), else a new one with some room to grow, if --max-memory allows
 * it. NULL with a logged error otherwise. */
static uint8_t *copy_buffer(psd_persist *p, uint32_t id, const char *name, size_t len,
                            size_t *cap, int *reused) {
  double waited = 0;
  uint8_t *buf = psd_ckptq_spare(p->q, id, len, cap, &waited);
  if (waited > 0)
    psd_debug("table '%s': waited %.1f ms for its copy's buffer, being faulted in off the loop "
              "(faulting a fresh one in here takes longer)", name, waited * 1e3);
  *reused = buf != NULL;
  if (buf) return buf;
  *cap = with_room(p->tabs[id].t, len);
  uint64_t have;
  if (!fits(p, *cap, &have)) {
    psd_ckptq_drop_spares(p->q); /* too small anyway: make room */
    *cap = len;
  }
  if (!fits(p, *cap, &have)) {
    /* The copy is real memory: past --max-memory it could get psd killed
     * (a cgroup's OOM killer) with every step since the last checkpoint. */
    psd_error("table '%s' needs a %zu-byte copy for checkpoint step %" PRIu64 ", which would "
              "take this server past --max-memory (%.0f bytes; %" PRIu64 " held, reserved or "
              "copied for earlier checkpoints): raise --max-memory or lower the capacity",
              name, len, p->cur_step, p->cfg->max_memory, have);
    return NULL;
  }
  buf = psd_ckptq_buf_new(*cap);
  if (!buf)
    psd_error("out of memory copying table '%s' (%zu bytes) for checkpoint step %" PRIu64,
              name, len, p->cur_step);
  return buf;
}

/* Page faults this thread has taken so far. */
static uint64_t faults_now(void) {
  struct rusage ru;
  return getrusage(RUSAGE_THREAD, &ru) == 0 ? (uint64_t)ru.ru_minflt + (uint64_t)ru.ru_majflt
                                            : 0;
}

/* Copies table id into the current file now: the writer gets the copy
 * (and hands the buffer back once written), so later pulls and pushes
 * never wait for the disk. */
static void capture_table(psd_persist *p, uint32_t id) {
  psd_persist_tab *tb = &p->tabs[id];
  if (!p->cur || tb->ck_gen == p->gen || id >= p->cur_ntables) return;
  const char *name = PS__ESC(psd_table_spec_of(tb->t)->name);
  double t0 = ps__now();
  uint64_t f0 = faults_now();
  size_t len = psd_ckpttable_size(tb->t), cap = 0;
  int reused = 0;
  uint8_t *buf = len ? copy_buffer(p, id, name, len, &cap, &reused) : NULL;
  if (!buf) {
    abort_ckpt(p, "no memory for a table's copy");
    return;
  }
  if (psd_ckpttable_encode(tb->t, buf, len) != 0) {
    psd_ckptq_buf_free(buf, cap);
    psd_error("table '%s': its rows do not match its row count; checkpoint step %" PRIu64
              " cannot hold it", name, p->cur_step);
    abort_ckpt(p, "a table could not be copied");
    return;
  }
  double ms = (ps__now() - t0) * 1e3;
  uint64_t faults = faults_now() - f0;
  if (psd_ckptq_add_table(p->q, p->cur, id, buf, cap, len, ms, faults) != 0) {
    psd_error("out of memory queueing table '%s' for checkpoint step %" PRIu64, name,
              p->cur_step);
    abort_ckpt(p, "out of memory");
    return;
  }
  tb->ck_gen = p->gen;
  p->cur_written++;
  psd_debug("table '%s' copied for checkpoint step %" PRIu64 ": %" PRIu64 " rows, %zu bytes in "
            "%.1f ms, %" PRIu64 " page faults (%s buffer)", name, p->cur_step,
            psd_table_get_stats(tb->t).rows, len, ms, faults,
            reused ? "its spare" : "a new");
}

/* Has the writer prepare a buffer for table id's next copy, off the loop,
 * when the table has outgrown the one it has (or has none: its first
 * checkpoint): a copy into fresh memory takes a page fault per 4 KiB on
 * the loop, which for a big table costs more than the copy. Only while no
 * file is on its way: the buffers of those come back as spares, and
 * preparing another meanwhile would hold two for a table. */
static void prepare_copy(psd_persist *p, uint32_t id) {
  if (!p->q || psd_ckptq_busy(p->q)) return;
  psd_table *t = p->tabs[id].t;
  size_t len = psd_ckpttable_size(t), ready = psd_ckptq_ready(p->q, id);
  if (!len || ready >= len) return;
  size_t cap = with_room(t, len);
  uint64_t have;
  if (!fits(p, cap - ready, &have)) return; /* the copy itself says so, if it comes to that */
  if (psd_ckptq_prepare(p->q, id, cap) != 0)
    psd_warn("out of memory preparing a checkpoint copy buffer for table '%s'",
             PS__ESC(psd_table_spec_of(t)->name));
}

uint64_t psd_persist_held_bytes(const psd_persist *p) {
  return p->q ? psd_ckptq_table_bytes(p->q) : 0;
}

static void do_stop(psd_persist *p, uint64_t step) {
  if (p->stopped) return;
  p->stopped = 1;
  p->stop_step = step;
  psd_info("stopping on request: checkpoint at step %" PRIu64 " is written; waiting for the "
           "workers to finish",
           step);
  /* Parked pulls would wait for steps that will never come. */
  p->actions |= PSD_PERSIST_WAKE_ALL;
}

/* The actions gathered since the last call, for the caller to take. */
static unsigned take_actions(psd_persist *p) {
  unsigned a = p->actions;
  p->actions = 0;
  return a;
}

/* Hands the file to the writer once every slice is in (and the chief
 * agreed): the trailer, fsync and rename happen off the loop, and
 * psd_persist_poll learns the outcome. */
static void maybe_finish(psd_persist *p) {
  if (!p->cur || p->cur_written != p->cur_nslices + p->cur_ntables) return;
  if (p->negotiated && !p->committed) return;
  psd_ckptq_commit(p->q, p->cur);
  p->cur = NULL;
  p->writing++;
  p->writing_step = p->cur_step;
}

/* The writer finished a file. */
static void finished(psd_persist *p, const psd_ckptq_result *r) {
  if (r->aborted) return;
  if (p->writing) p->writing--;
  if (!r->ok) {
    psd_error("checkpoint at step %" PRIu64 " failed: %s", r->step, r->err);
    return;
  }
  char tabs[128] = "";
  if (r->copy_bytes)
    snprintf(tabs, sizeof tabs, "; tables copied on the loop: %.1f MB in %.1f ms, %" PRIu64
             " page faults", r->copy_bytes / 1e6, r->copy_ms, r->copy_faults);
  psd_info("checkpoint at step %" PRIu64 " written to %s (%.1f MB, %.0f ms to flush%s)", r->step,
           r->path, r->bytes / 1e6, r->flush_ms, tabs);
  if (!p->have_last || r->step >= p->last_step) p->last_step = r->step;
  p->have_last = 1;
  p->last_at = ps__now();
  p->want_ckpt = 0;
  if (p->stop_after && p->stop_ready && p->stop_step == r->step) do_stop(p, r->step);
}

unsigned psd_persist_poll(psd_persist *p) {
  psd_ckptq_result r;
  while (p->q && psd_ckptq_next(p->q, &r)) finished(p, &r);
  return take_actions(p);
}

int psd_persist_fd(const psd_persist *p) { return p->q ? psd_ckptq_fd(p->q) : -1; }

/* Whether every slice and table can still be captured at step (sync mode;
 * the final checkpoint takes the tables as they are). 0, or -1 with err. */
static int can_begin(const psd_persist *p, uint64_t step, int final, char *err,
                     size_t errlen) {
  const psd_shard *sh = p->shard;
  if (sh->async_mode) return 0;
  for (uint32_t i = 0; i < sh->n; i++)
    if (sh->slices[i]->step > step) {
      snprintf(err, errlen, "slice '%s' is already at step %" PRIu64,
               PS__ESC(sh->slices[i]->name), sh->slices[i]->step);
      return -1;
    }
  for (uint32_t i = 0; i < p->ntabs; i++) {
    const char *name = PS__ESC(psd_table_spec_of(p->tabs[i].t)->name);
    uint64_t at = psd_table_step(p->tabs[i].t);
    if (at > step) {
      snprintf(err, errlen, "table '%s' is already at step %" PRIu64, name, at);
      return -1;
    }
    if (!final && at == step && table_read(p, i)) {
      snprintf(err, errlen, "table '%s' has served pulls at step %" PRIu64 " since it reached "
               "it, so its rows are no longer that step's (step %" PRIu64 " is the first it "
               "can hold exactly)", name, at, at + 1);
      return -1;
    }
  }
  return 0;
}

/* Starts a checkpoint at step and captures every slice and table already
 * there (final: the checkpoint at the end, which takes the tables as they
 * are). 0, or -1 with err (a slice or table is already past step). */
static int begin(psd_persist *p, uint64_t step, int negotiated, int final, char *err,
                 size_t errlen) {
  psd_shard *sh = p->shard;
  if (can_begin(p, step, final, err, errlen) != 0) return -1;
  psd_ckpt_meta m = {(uint32_t)p->cfg->ps_index, (uint32_t)p->cfg->num_ps,
                     p->shard->num_workers, sh->replicas, (uint32_t)sh->async_mode, step, sh->n,
                     p->ntabs};
  psd_ckptq_file *f = psd_ckptq_begin(p->q, &m);
  if (!f) {
    snprintf(err, errlen, "out of memory starting checkpoint step %" PRIu64, step);
    return -1;
  }
  p->cur = f;
  p->cur_step = step;
  p->cur_nslices = sh->n;
  p->cur_ntables = p->ntabs;
  p->cur_written = 0;
  p->gen++;
  p->negotiated = negotiated;
  p->committed = 0;
  for (uint32_t i = 0; i < sh->n; i++)
    if (sh->async_mode || sh->slices[i]->step == step) capture(p, sh->slices[i]);
  for (uint32_t i = 0; i < p->ntabs && p->cur; i++)
    if (sh->async_mode || psd_table_step(p->tabs[i].t) == step) capture_table(p, i);
  return 0;
}

/* A slice or table reached step: starts the --checkpoint-every checkpoint
 * of that step if one is due. In async mode only the pacer starts one (the
 * first slice, or the first table when this ps holds no slice). */
static void every_due(psd_persist *p, uint64_t step, int pacer) {
  if (p->stopped) return; /* the job is over: no more checkpoints */
  int every = p->cfg->ckpt_every;
  if (!every || step == 0 || step % (uint64_t)every != 0) return;
  if (p->shard->async_mode && !pacer) return;
  if (p->have_last && p->last_step >= step) return;
  if (p->writing && p->writing_step >= step) return;
  if (p->cur) {
    if (p->cur_step > step) return;
    if (p->negotiated && p->committed) return; /* the chief's goes first */
    abort_ckpt(p, "a newer one is due and some slices or tables never reached its step");
  }
  if (p->writing >= PSD_PERSIST_MAX_WRITING) {
    /* Each file on its way may keep a copy of the slices that changed
     * before their turn (and holds its tables' copies): a bound on files
     * bounds that memory. The step stays incomplete here, so it is never
     * restored. */
    psd_warn("checkpoint at step %" PRIu64 " skipped: %u earlier ones are still being written "
             "(the disk is slower than --checkpoint-every)", step, p->writing);
    return;
  }
  char err[1200];
  if (begin(p, step, 0, 0, err, sizeof err) != 0) {
    psd_warn("cannot checkpoint step %" PRIu64 ": %s", step, err);
    return;
  }
  maybe_finish(p);
}

static void slice_advanced(psd_persist *p, psd_slice *sl) {
  if (!enabled(p) || !sl->initialized) return;
  if (p->cur && sl->step == p->cur_step) {
    capture(p, sl);
    maybe_finish(p);
    return;
  }
  every_due(p, sl->step, sl->id == 0);
}

unsigned psd_persist_slice_advanced(psd_persist *p, psd_slice *sl) {
  slice_advanced(p, sl);
  return take_actions(p);
}

unsigned psd_persist_table_advanced(psd_persist *p, uint32_t id) {
  if (!enabled(p) || id >= p->ntabs) return take_actions(p);
  uint64_t step = psd_table_step(p->tabs[id].t);
  if (p->cur && step == p->cur_step) {
    capture_table(p, id);
    maybe_finish(p);
  } else {
    every_due(p, step, p->shard->n == 0 && id == 0);
  }
  prepare_copy(p, id); /* rows came since the last step */
  return take_actions(p);
}

void psd_persist_table_read(psd_persist *p, uint32_t id) {
  if (id < p->ntabs) p->tabs[id].read_at = psd_table_step(p->tabs[id].t) + 1;
}

int psd_persist_table_added(psd_persist *p, psd_table *t) {
  if (p->ntabs == p->tabs_cap) {
    size_t cap = p->tabs_cap;
    if (ps__grow((void **)&p->tabs, &cap, (size_t)p->ntabs + 1, sizeof *p->tabs) != 0)
      return PS_ENOMEM;
    p->tabs_cap = (uint32_t)cap;
  }
  p->tabs[p->ntabs++] = (psd_persist_tab){t, 0, 0};
  prepare_copy(p, p->ntabs - 1); /* a restored table has its rows already */
  return 0;
}

static void request(psd_persist *p, uint64_t step, int stop, int commit,
                    protobuf_c_boolean *ok, uint64_t *max_out, char *msg, size_t msglen) {
  *ok = 0;
  *max_out = max_step(p);
  msg[0] = '\0';
  if (!enabled(p)) {
    snprintf(msg, msglen, "this server has no --checkpoint-dir");
    return;
  }
  if (p->stopped) {
    snprintf(msg, msglen, "the job already stopped after step %" PRIu64, p->stop_step);
    return;
  }
  if (!commit) {
    if (p->cur && p->cur_step != step) abort_ckpt(p, "the chief chose another step");
    if (p->cur) {
      /* A --checkpoint-every one at this step: it now waits for the
       * commit like the others, so no ps stops on a step another refused. */
      p->negotiated = 1;
      p->committed = 0;
    } else if (!have_step(p, step)) {
      if (begin(p, step, 1, 0, msg, msglen) != 0) {
        psd_info("the chief's checkpoint at step %" PRIu64 " refused: %s", step, msg);
        return;
      }
    }
    p->stop_after = stop;
    p->stop_ready = 0;
    p->stop_step = step;
    *ok = 1;
    return;
  }
  if (p->cur && p->cur_step == step) {
    /* Slices still short of the step (backup workers) are captured when
     * they get there; the file then goes to the writer, and the workers
     * learn it is on disk from the `stopped` flag. ok means accepted: a
     * write that fails later is logged, and the stop then times out. */
    p->committed = 1;
    p->stop_ready = 1;
    maybe_finish(p);
    *ok = 1;
  } else if (have_step(p, step)) {
    p->stop_ready = 1;
    if (have_step(p, step) == 2 && p->stop_after && p->stop_step == step) do_stop(p, step);
    *ok = 1;
  } else {
    snprintf(msg, msglen, "no checkpoint at step %" PRIu64 " is prepared here", step);
  }
}

unsigned psd_persist_request(psd_persist *p, uint64_t step, int stop, int commit,
                             protobuf_c_boolean *ok, uint64_t *max_out, char *msg,
                             size_t msglen) {
  request(p, step, stop, commit, ok, max_out, msg, msglen);
  return take_actions(p);
}

void psd_persist_chief_left(psd_persist *p) {
  if (p->cur && p->negotiated && !p->committed)
    abort_ckpt(p, "the chief left before committing it");
}

void psd_persist_stop_wanted(psd_persist *p, const char *who) {
  if (p->stop_wanted) return;
  p->stop_wanted = 1;
  p->stop_wanted_at = ps__now();
  if (psd_persist_stateless(p))
    psd_info("%s asks to stop: this ps holds only mean variables, which keep no state; "
             "exiting once every worker has saved its own and finished (within %.0f s)",
             who, p->cfg->stop_timeout_s);
  else
    psd_info("%s asks to stop: checkpointing at the next step all ps agree on, then exiting "
             "(within %.0f s)",
             who, p->cfg->stop_timeout_s);
}

unsigned psd_persist_tick(psd_persist *p, double now, int pinned) {
  if (!enabled(p)) return 0;
  if (p->cfg->ckpt_secs > 0 && !p->want_ckpt && pinned &&
      now - p->last_at >= p->cfg->ckpt_secs) {
    p->want_ckpt = 1;
    psd_debug("%.0f s since the last checkpoint: asking the chief for one",
              now - p->last_at);
  }
  if (p->stop_wanted && !p->stopped && now - p->stop_wanted_at >= p->cfg->stop_timeout_s) {
    psd_error("no stop checkpoint within %.0f s (is the chief, worker 0, running?)",
              p->cfg->stop_timeout_s);
    abort_ckpt(p, "stop timeout");
    return PSD_PERSIST_EXIT_UNSAVED;
  }
  return 0;
}

int psd_persist_stateless(const psd_persist *p) {
  if (p->ntabs > 0 || p->shard->n == 0) return 0;
  for (uint32_t i = 0; i < p->shard->n; i++)
    if (p->shard->slices[i]->opt.kind != PS_OPT_MEAN) return 0;
  return 1;
}

int psd_persist_stop_status(const psd_persist *p, const char *why) {
  if (p->stopped) return PSD_EXIT_STOPPED;
  /* Exit 75 would tell the launcher to requeue as if this stop had been
   * saved: say what a rerun really resumes from. */
  if (!enabled(p))
    psd_error("stopped without a checkpoint (%s): there is no --checkpoint-dir, so nothing "
              "was saved and the job cannot resume; exiting with status %d",
              why, PSD_EXIT_NO_CHECKPOINT);
  else if (p->have_last)
    psd_error("stopped without a checkpoint (%s): the job cannot resume from this stop; the "
              "newest complete checkpoint of this ps is step %" PRIu64 " in %s; exiting with "
              "status %d",
              why, p->last_step, p->cfg->ckpt_dir, PSD_EXIT_NO_CHECKPOINT);
  else
    psd_error("stopped without a checkpoint (%s): the job cannot resume from this stop; this "
              "ps has no checkpoint in %s (a rerun starts from step 0); exiting with status %d",
              why, p->cfg->ckpt_dir, PSD_EXIT_NO_CHECKPOINT);
  return PSD_EXIT_NO_CHECKPOINT;
}

/* The step every slice and table is at (sync; async: the first slice's,
 * or the first table's): 0 and *s, or -1 when there is none (nothing
 * here, an uninitialized slice, or steps that differ). */
static int common_step(const psd_persist *p, uint64_t *s) {
  const psd_shard *sh = p->shard;
  if (sh->n == 0 && p->ntabs == 0) return -1;
  *s = sh->n ? sh->slices[0]->step : psd_table_step(p->tabs[0].t);
  for (uint32_t i = 0; i < sh->n; i++)
    if (!sh->slices[i]->initialized || (!sh->async_mode && sh->slices[i]->step != *s)) return -1;
  for (uint32_t i = 0; i < p->ntabs && !sh->async_mode; i++)
    if (psd_table_step(p->tabs[i].t) != *s) return -1;
  return 0;
}

unsigned psd_persist_final(psd_persist *p) {
  uint64_t s;
  if (!enabled(p) || p->stopped || common_step(p, &s) != 0) return 0;
  if (have_step(p, s)) return 0;
  abort_ckpt(p, "training ended first");
  char err[1200];
  if (begin(p, s, 0, 1, err, sizeof err) != 0) {
    psd_warn("cannot write the final checkpoint: %s", err);
    return 0;
  }
  maybe_finish(p);
  return take_actions(p);
}

void psd_persist_flags(const psd_persist *p, protobuf_c_boolean *want_ckpt,
                       protobuf_c_boolean *want_stop, uint64_t *stop_step,
                       protobuf_c_boolean *stopped) {
  /* Once the chief committed a checkpoint (or one is on its way to the
   * disk), asking again would only make it start another one. */
  int pending = (p->cur && p->negotiated && p->committed) || p->writing;
  *want_ckpt = p->want_ckpt && !p->stopped && !pending;
  *want_stop = p->stop_wanted && !p->stopped && !(pending && p->stop_after);
  *stopped = p->stopped;
  *stop_step = p->stopped ? p->stop_step : 0;
}

/* ---- restoring ------------------------------------------------------------ */

int psd_persist_init(psd_persist *p, const psd_config *cfg, psd_shard *shard) {
  memset(p, 0, sizeof *p);
  p->cfg = cfg;
  p->shard = shard;
  psd_ckptdir_init(&p->dir);
  p->last_at = ps__now();
  if (!enabled(p)) return 0;
  char err[1600], moved[PSD_CKPT_PATH_MAX + 300];
  psd_ckptdir_holder h = {(long long)cfg->job_id, cfg->ps_index, cfg->num_ps};
  if (psd_ckptdir_open(&p->dir, cfg->ckpt_dir, &h, cfg->restore == PSD_RESTORE_NONE, moved,
                       sizeof moved, err, sizeof err) != 0) {
    psd_error("%s", err);
    return -1;
  }
  if (moved[0]) psd_info("%s", moved);
  if (psd_ckptq_create(&p->q, &p->dir, (uint32_t)cfg->ps_index, (uint32_t)cfg->num_ps,
                       cfg->ckpt_keep, err, sizeof err) != 0) {
    psd_error("%s", err);
    return -1;
  }
  /* Keep the existing complete checkpoints; remove half-written files. */
  psd_ckpt_prune(&p->dir, (uint32_t)cfg->ps_index, (uint32_t)cfg->num_ps, 1 << 30);
  if (cfg->restore == PSD_RESTORE_NONE) {
    psd_info("checkpoints go to %s, run %s (not restoring: --restore=none)", cfg->ckpt_dir,
             p->dir.run_hex);
    return 0;
  }
  int rc = psd_ckpt_find(&p->dir, (uint32_t)cfg->ps_index, (uint32_t)cfg->num_ps,
                         cfg->restore == PSD_RESTORE_FALLBACK, (uint64_t)cfg->max_memory,
                         &p->restore, err, sizeof err);
  if (rc < 0) {
    psd_error("%s", err);
    return -1;
  }
  if (rc == 0) {
    if (err[0]) psd_warn("%s", err);
    psd_info("checkpoints go to %s, run %s (none to restore)", cfg->ckpt_dir, p->dir.run_hex);
    return 0;
  }
  p->restoring = 1;
  p->last_step = p->restore.meta.step;
  p->have_last = 1;
  psd_info("restoring step %" PRIu64 " from %s (%u slices, %u tables, written by a job of %u "
           "workers; run %s, MAC verified)",
           p->restore.meta.step, p->restore.path, p->restore.meta.nslices,
           p->restore.meta.ntables, p->restore.meta.num_workers, p->dir.run_hex);
  return 0;
}

void psd_persist_free(psd_persist *p) {
  if (p->q) {
    if (p->cur) {
      psd_ckptq_abort(p->q, p->cur);
      p->cur = NULL;
    }
    if (p->writing)
      psd_info("waiting for %u checkpoint file(s) to reach the disk", p->writing);
    psd_ckptq_stop(p->q); /* the writer finishes what it was given */
    psd_persist_poll(p);  /* ... and says how it went */
    for (uint32_t i = 0; i < p->shard->n; i++) psd_persist_release(p, p->shard->slices[i]);
    psd_ckptq_destroy(p->q);
    p->q = NULL;
  }
  psd_ckpt_image_free(&p->restore);
  psd_ckptdir_close(&p->dir);
  free(p->tabs);
  p->tabs = NULL;
  p->ntabs = p->tabs_cap = 0;
}

/* One more record of the restored checkpoint went to a slice or table. */
static void claimed_one(psd_persist *p) {
  psd_ckpt_image *img = &p->restore;
  if (++p->claimed < img->meta.nslices + img->meta.ntables) return;
  /* Everything has its values: the file's copy is not needed any more. */
  psd_info("all %u slices and %u tables of %s restored", img->meta.nslices, img->meta.ntables,
           img->path);
  psd_ckpt_image_free(img);
  p->restoring = 0;
}

int psd_persist_restore_slice(psd_persist *p, psd_slice *sl, char *err, size_t errlen) {
  if (!p->restoring || sl->initialized) return 0;
  psd_ckpt_image *img = &p->restore;
  psd_ckpt_rec *r = NULL;
  /* Workers register in the same order every run: try the same index first. */
  if (sl->id < img->meta.nslices && img->recs[sl->id].offset == sl->offset &&
      strcmp(img->recs[sl->id].name, sl->name) == 0)
    r = &img->recs[sl->id];
  for (uint32_t i = 0; !r && i < img->meta.nslices; i++)
    if (img->recs[i].offset == sl->offset && strcmp(img->recs[i].name, sl->name) == 0)
      r = &img->recs[i];
  if (!r) {
    snprintf(err, errlen,
             "variable '%s' (slice at %" PRIu64 ", %" PRIu64 " elements) is not in checkpoint "
             "%s: it was written for a different model or ps layout",
             PS__ESC(sl->name), sl->offset, sl->length, img->path);
    return PS_EMISMATCH;
  }
  int same = r->ndim == sl->ndim && r->length == sl->length;
  for (uint32_t d = 0; same && d < sl->ndim; d++) same = r->shape[d] == sl->shape[d];
  if (!same) {
    snprintf(err, errlen,
             "variable '%s' (slice at %" PRIu64 ") has %" PRIu64 " elements in checkpoint %s "
             "but %" PRIu64 " (or another shape) now",
             PS__ESC(sl->name), sl->offset, r->length, img->path, sl->length);
    return PS_ESHAPE;
  }
  if (r->opt_kind != (uint32_t)sl->opt.kind) {
    snprintf(err, errlen,
             "variable '%s' was trained with optimizer %s in checkpoint %s, now %s",
             PS__ESC(sl->name), kind_or_unknown((int)r->opt_kind), img->path,
             kind_or_unknown((int)sl->opt.kind));
    return PS_EMISMATCH;
  }
  if (r->state_per != psd_opt_state_per_elem(&sl->opt)) {
    /* The same rule with other state: RMSProp's momentum or centered, or a
     * moving average added or dropped (it has no values to resume from). */
    snprintf(err, errlen,
             "variable '%s' was trained with optimizer %s keeping %u state floats per element "
             "in checkpoint %s, now %zu (its momentum, centered or average changed)",
             PS__ESC(sl->name), kind_or_unknown((int)r->opt_kind), r->state_per, img->path,
             psd_opt_state_per_elem(&sl->opt));
    return PS_EMISMATCH;
  }
  memcpy(sl->param, r->param, sl->length * sizeof(float));
  if (r->state_per)
    memcpy(sl->state, r->state, sl->length * r->state_per * sizeof(float));
  sl->step = r->step;
  sl->initialized = 1;
  r->claimed = 1;
  claimed_one(p);
  return 0;
}

int psd_persist_restore_table(psd_persist *p, psd_table *t, const char *who, char *err,
                              size_t errlen) {
  if (!p->restoring) return 0;
  psd_ckpt_image *img = &p->restore;
  const psd_table_spec *sp = psd_table_spec_of(t);
  psd_ckpttable *r = NULL;
  for (uint32_t i = 0; !r && i < img->meta.ntables; i++)
    if (!img->tables[i].claimed && strcmp(img->tables[i].spec.name, sp->name) == 0)
      r = &img->tables[i];
  if (!r) {
    snprintf(err, errlen, "table '%s' is not in checkpoint %s: it was written for a different "
             "model (start with --restore=none to move it aside and start afresh)",
             PS__ESC(sp->name),
             img->path);
    return PS_EMISMATCH;
  }
  char diff[400];
  psd_table_spec kept = r->spec; /* the checkpoint keeps no schedule: the workers' runs */
  psd_tablespec_take_schedule(&kept, sp);
  if (psd_tablespec_diff(&kept, "the checkpoint", sp, who, diff, sizeof diff)) {
    snprintf(err, errlen, "table '%s' differs from the one in checkpoint %s: %s (resume with "
             "the same table configuration, or start afresh with --restore=none)",
             PS__ESC(sp->name),
             img->path, diff);
    return PS_EMISMATCH;
  }
  char e[600];
  int rc = psd_ckpttable_restore(r, t, e, sizeof e);
  if (rc) {
    snprintf(err, errlen, "checkpoint %s: %s", img->path, e);
    return rc;
  }
  r->claimed = 1;
  psd_info("table '%s' restored from %s: %" PRIu64 " rows at step %" PRIu64, PS__ESC(sp->name),
           img->path, r->nrows, r->step);
  claimed_one(p);
  return 0;
}
