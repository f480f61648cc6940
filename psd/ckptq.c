/* ckptq.c - the checkpoint writer thread (see ckptq.h). */
#include "ckptq.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bg.h"
#include "util.h"

typedef enum { JOB_BEGIN, JOB_ADD, JOB_COMMIT, JOB_ABORT } job_kind;

/* One queued piece of work; embedded in the file or record it is for, so
 * queueing allocates nothing beyond those. */
typedef struct job {
  psd_bg_job base;        /* the thread's view (first member) */
  job_kind kind;          /* what to do */
  psd_ckptq *q;           /* the queue */
  psd_ckptq_file *f;      /* the file it is for */
  psd_ckptq_rec *rec;     /* JOB_ADD: the record */
} job;

struct psd_ckptq_file {
  psd_ckpt_writer w;      /* the file (touched by the writer thread only) */
  psd_ckpt_meta m;        /* its header */
  int failed;             /* a step failed: the rest is skipped, commit reports err */
  char err[PSD_CKPTQ_ERR]; /* the first failure */
  psd_ckptq_result res;   /* the outcome, handed back with `end` */
  uint64_t copy_bytes;    /* loop only: table records queued for it */
  uint64_t copy_cap;      /* loop only: their buffers' sizes */
  double copy_ms;         /* loop only: their encoding time */
  job begin, end;         /* JOB_BEGIN, and JOB_COMMIT or JOB_ABORT */
};

struct psd_ckptq_rec {
  psd_ckpt_rec hdr;             /* header fields (hdr.name points at name) */
  char name[PS_MAX_NAME + 1];   /* the variable's name, copied */
  const uint8_t *seg[2];        /* in place: parameters, optimizer state */
  size_t seglen[2];             /* their bytes */
  uint8_t *own;                 /* after a release: the unread tail, copied */
  size_t own_base;              /* data offset own[0] stands for */
  size_t total;                 /* data bytes (both segments) */
  size_t pos;                   /* data bytes the writer has copied out */
  int held;                     /* a slice still points at it (under mu) */
  int done;                     /* the writer is finished with it (under mu) */
  int lost;                     /* a release could not copy: the file fails */
  int table;                    /* own holds a whole table record (no slice) */
  size_t cap;                   /* table: own's size (>= total) */
  psd_ckptq_rec *next_spare;    /* table, once written: the spares' list */
  job j;                        /* its JOB_ADD */
};

struct psd_ckptq {
  psd_bg *bg;                   /* the writer thread */
  pthread_mutex_t mu;           /* guards records' pos, held, done, own, lost */
  uint32_t busy;                /* files begun, result not yet taken (loop only) */
  const psd_ckpt_dir *d;        /* the directory (not owned) */
  uint32_t ps_index, num_ps;    /* whose files, for pruning */
  int keep;                     /* complete checkpoints pruning keeps */
  uint8_t *bounce;              /* PSD_CKPTQ_CHUNK bytes: the writer's copy of a chunk */
  psd_ckptq_rec *spares;        /* table buffers written out, to reuse (under mu) */
  uint64_t spare_bytes;         /* their sizes (under mu) */
  uint64_t table_bytes;         /* every table buffer the queue holds: on
                                   their way and spare (under mu) */
};

static void run_job(psd_bg_job *bj);

static void push_job(psd_ckptq *q, job *j, job_kind kind, psd_ckptq_file *f,
                     psd_ckptq_rec *rec) {
  *j = (job){.base = {.run = run_job, .post = kind == JOB_COMMIT || kind == JOB_ABORT},
             .kind = kind, .q = q, .f = f, .rec = rec};
  psd_bg_push(q->bg, &j->base);
}

/* ---- the loop's side ------------------------------------------------------ */

psd_ckptq_file *psd_ckptq_begin(psd_ckptq *q, const psd_ckpt_meta *m) {
  psd_ckptq_file *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  psd_ckpt_writer_init(&f->w);
  f->m = *m;
  q->busy++;
  push_job(q, &f->begin, JOB_BEGIN, f, NULL);
  return f;
}

int psd_ckptq_add(psd_ckptq *q, psd_ckptq_file *f, const psd_ckpt_rec *r, psd_ckptq_rec **hold) {
  *hold = NULL;
  uint64_t pb, sb;
  if (ps__mul_u64(r->length, sizeof(float), &pb) || ps__mul_u64(pb, r->state_per, &sb) ||
      pb > SIZE_MAX || sb > SIZE_MAX || strlen(r->name) > PS_MAX_NAME)
    return -1;
  psd_ckptq_rec *rec = calloc(1, sizeof *rec);
  if (!rec) return -1;
  rec->hdr = *r;
  snprintf(rec->name, sizeof rec->name, "%s", r->name);
  rec->hdr.name = rec->name;
  rec->seg[0] = r->param;
  rec->seglen[0] = pb;
  rec->seg[1] = r->state;
  rec->seglen[1] = r->state ? sb : 0;
  rec->total = rec->seglen[0] + rec->seglen[1];
  rec->held = 1;
  push_job(q, &rec->j, JOB_ADD, f, rec);
  *hold = rec;
  return 0;
}

/* Copies n data bytes from offset pos of rec (in place or its own tail).
 * Called with q->mu held. */
static void copy_out(const psd_ckptq_rec *rec, size_t pos, uint8_t *dst, size_t n) {
  if (rec->own) {
    memcpy(dst, rec->own + (pos - rec->own_base), n);
    return;
  }
  for (int s = 0; s < 2 && n; s++) {
    if (pos >= rec->seglen[s]) {
      pos -= rec->seglen[s];
      continue;
    }
    size_t k = rec->seglen[s] - pos < n ? rec->seglen[s] - pos : n;
    memcpy(dst, rec->seg[s] + pos, k);
    dst += k;
    n -= k;
    pos = 0;
  }
}

int psd_ckptq_add_table(psd_ckptq *q, psd_ckptq_file *f, uint8_t *buf, size_t cap, size_t len,
                        double copy_ms) {
  psd_ckptq_rec *rec = calloc(1, sizeof *rec);
  if (!rec) {
    free(buf);
    return -1;
  }
  rec->own = buf;
  rec->cap = cap;
  rec->total = len;
  rec->table = 1; /* no slice holds it: the writer makes it a spare */
  f->copy_bytes += len;
  f->copy_cap += cap;
  f->copy_ms += copy_ms;
  pthread_mutex_lock(&q->mu);
  q->table_bytes += cap;
  pthread_mutex_unlock(&q->mu);
  push_job(q, &rec->j, JOB_ADD, f, rec);
  return 0;
}

uint8_t *psd_ckptq_spare(psd_ckptq *q, size_t len, size_t *cap) {
  pthread_mutex_lock(&q->mu);
  psd_ckptq_rec **best = NULL;
  for (psd_ckptq_rec **pp = &q->spares; *pp; pp = &(*pp)->next_spare)
    if ((*pp)->cap >= len && (!best || (*pp)->cap < (*best)->cap)) best = pp;
  psd_ckptq_rec *r = best ? *best : NULL;
  if (r) {
    *best = r->next_spare;
    q->spare_bytes -= r->cap;
    q->table_bytes -= r->cap; /* the loop's now, until it queues it again */
  }
  pthread_mutex_unlock(&q->mu);
  if (!r) return NULL;
  uint8_t *b = r->own;
  *cap = r->cap;
  free(r);
  return b;
}

uint64_t psd_ckptq_table_bytes(psd_ckptq *q) {
  pthread_mutex_lock(&q->mu);
  uint64_t n = q->table_bytes;
  pthread_mutex_unlock(&q->mu);
  return n;
}

/* Frees the smallest spares until at most `keep` bytes are left. */
static void trim_spares(psd_ckptq *q, uint64_t keep) {
  psd_ckptq_rec *gone = NULL;
  pthread_mutex_lock(&q->mu);
  while (q->spare_bytes > keep) {
    psd_ckptq_rec **small = &q->spares;
    for (psd_ckptq_rec **pp = &q->spares; *pp; pp = &(*pp)->next_spare)
      if ((*pp)->cap < (*small)->cap) small = pp;
    psd_ckptq_rec *r = *small;
    *small = r->next_spare;
    q->spare_bytes -= r->cap;
    q->table_bytes -= r->cap;
    r->next_spare = gone;
    gone = r;
  }
  pthread_mutex_unlock(&q->mu);
  for (psd_ckptq_rec *r = gone, *nx; r; r = nx) { /* freed outside the lock */
    nx = r->next_spare;
    free(r->own);
    free(r);
  }
}

void psd_ckptq_drop_spares(psd_ckptq *q) { trim_spares(q, 0); }

int psd_ckptq_release(psd_ckptq *q, psd_ckptq_rec *rec) {
  if (!rec) return 0;
  int rc = 0, free_it = 0;
  pthread_mutex_lock(&q->mu);
  rec->held = 0;
  if (rec->done) {
    free_it = 1;
  } else if (!rec->own && rec->pos < rec->total) {
    size_t tail = rec->total - rec->pos;
    uint8_t *own = malloc(tail);
    if (own) {
      copy_out(rec, rec->pos, own, tail);
      rec->own = own;
      rec->own_base = rec->pos;
    } else {
      rec->lost = 1; /* the writer must not read the slice any more */
      rc = -1;
    }
  }
  pthread_mutex_unlock(&q->mu);
  if (free_it) {
    free(rec->own);
    free(rec);
  }
  return rc;
}

void psd_ckptq_commit(psd_ckptq *q, psd_ckptq_file *f) {
  push_job(q, &f->end, JOB_COMMIT, f, NULL);
}

void psd_ckptq_abort(psd_ckptq *q, psd_ckptq_file *f) {
  push_job(q, &f->end, JOB_ABORT, f, NULL);
}

int psd_ckptq_next(psd_ckptq *q, psd_ckptq_result *out) {
  psd_bg_job *bj = psd_bg_done(q->bg);
  if (!bj) return 0;
  psd_ckptq_file *f = ((job *)bj)->f;
  *out = f->res;
  out->copy_bytes = f->copy_bytes;
  out->copy_cap = f->copy_cap;
  out->copy_ms = f->copy_ms;
  /* Spares beyond one file's worth (this one's) go. */
  trim_spares(q, f->copy_cap);
  free(f);
  q->busy--;
  return 1;
}

uint32_t psd_ckptq_busy(psd_ckptq *q) { return q->busy; }

int psd_ckptq_fd(const psd_ckptq *q) { return psd_bg_fd(q->bg); }

/* ---- the writer thread ---------------------------------------------------- */

static void fail(psd_ckptq_file *f, const char *err) {
  if (f->failed) return;
  f->failed = 1;
  snprintf(f->err, sizeof f->err, "%s", err);
}

/* Marks rec finished by the writer; frees it if no slice holds it. */
static void rec_done(psd_ckptq *q, psd_ckptq_rec *rec) {
  pthread_mutex_lock(&q->mu);
  rec->done = 1;
  int free_it = !rec->held;
  pthread_mutex_unlock(&q->mu);
  if (free_it) {
    free(rec->own);
    free(rec);
  }
}

/* Writes one record: its header, then its data a chunk at a time, each
 * chunk copied out under the lock so a release in between sees exactly
 * what is still unread. */
static void write_rec(psd_ckptq *q, psd_ckptq_file *f, psd_ckptq_rec *rec) {
  char err[PSD_CKPTQ_ERR];
  if (rec->table) { /* owned by the queue: nothing else reads it */
    if (!f->failed && psd_ckpt_add_table(&f->w, rec->own, rec->total, err, sizeof err) != 0)
      fail(f, err);
    /* In the file (the page cache holds it now): a spare from here on,
     * while the MAC and fsync still run. */
    pthread_mutex_lock(&q->mu);
    rec->next_spare = q->spares;
    q->spares = rec;
    q->spare_bytes += rec->cap;
    pthread_mutex_unlock(&q->mu);
    return;
  }
  if (!f->failed && psd_ckpt_add_header(&f->w, &rec->hdr, err, sizeof err) != 0)
    fail(f, err);
  while (!f->failed) {
    pthread_mutex_lock(&q->mu);
    size_t pos = rec->pos, n = rec->total - pos;
    if (n > PSD_CKPTQ_CHUNK) n = PSD_CKPTQ_CHUNK;
    int lost = rec->lost;
    if (!lost && n) copy_out(rec, pos, q->bounce, n);
    rec->pos = pos + n;
    pthread_mutex_unlock(&q->mu);
    if (lost) {
      snprintf(err, sizeof err, "out of memory keeping slice '%s' for checkpoint %.900s",
               PS__ESC(rec->name), f->w.tmp);
      fail(f, err);
    }
    if (f->failed || n == 0) break;
    if (psd_ckpt_append(&f->w, q->bounce, n, err, sizeof err) != 0) fail(f, err);
  }
  rec_done(q, rec);
}

/* Commits or aborts f into f->res (the loop takes it, and frees f). */
static void finish_file(psd_ckptq *q, psd_ckptq_file *f, int commit) {
  psd_ckptq_result *r = &f->res;
  r->file = f;
  r->step = f->m.step;
  if (commit && !f->failed) {
    double t0 = ps__now();
    r->bytes = f->w.bytes + PSD_CKPT_END_BYTES;
    snprintf(r->path, sizeof r->path, "%s", f->w.path);
    if (psd_ckpt_commit(&f->w, r->err, sizeof r->err) == 0) {
      r->ok = 1;
      r->flush_ms = (ps__now() - t0) * 1e3;
      r->pruned = psd_ckpt_prune(q->d, q->ps_index, q->num_ps, q->keep);
    }
  } else {
    psd_ckpt_abort(&f->w);
    r->aborted = !commit;
    if (commit) snprintf(r->err, sizeof r->err, "%s", f->err);
  }
}

static void run_job(psd_bg_job *bj) {
  job *j = (job *)bj;
  psd_ckptq *q = j->q;
  char err[PSD_CKPTQ_ERR];
  switch (j->kind) {
  case JOB_BEGIN:
    if (psd_ckpt_begin(&j->f->w, q->d, &j->f->m, err, sizeof err) != 0) fail(j->f, err);
    break;
  case JOB_ADD:
    write_rec(q, j->f, j->rec); /* may free the record, and j with it */
    break;
  case JOB_COMMIT:
  case JOB_ABORT:
    finish_file(q, j->f, j->kind == JOB_COMMIT);
    break;
  }
}

int psd_ckptq_create(psd_ckptq **out, const psd_ckpt_dir *d, uint32_t ps_index,
                     uint32_t num_ps, int keep, char *err, size_t errlen) {
  *out = NULL;
  psd_ckptq *q = calloc(1, sizeof *q);
  if (!q || !(q->bounce = malloc(PSD_CKPTQ_CHUNK))) {
    free(q);
    snprintf(err, errlen, "out of memory starting the checkpoint writer");
    return -1;
  }
  q->d = d;
  q->ps_index = ps_index;
  q->num_ps = num_ps;
  q->keep = keep;
  int e = psd_bg_create(&q->bg);
  if (e) {
    snprintf(err, errlen, "cannot start the checkpoint writer: %s", strerror(e));
    free(q->bounce);
    free(q);
    return -1;
  }
  pthread_mutex_init(&q->mu, NULL);
  *out = q;
  return 0;
}

void psd_ckptq_stop(psd_ckptq *q) {
  if (q) psd_bg_stop(q->bg);
}

void psd_ckptq_destroy(psd_ckptq *q) {
  if (!q) return;
  psd_bg_stop(q->bg);
  psd_ckptq_result r;
  while (psd_ckptq_next(q, &r)) {
  }
  psd_bg_destroy(q->bg);
  psd_ckptq_drop_spares(q);
  pthread_mutex_destroy(&q->mu);
  free(q->bounce);
  free(q);
}
