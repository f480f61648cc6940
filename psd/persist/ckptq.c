/* ckptq.c - the checkpoint writer thread (see ckptq.h). */
#define _GNU_SOURCE /* mremap */
#include "ckptq.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bg.h"
#include "log.h"
#include "util.h"
#include "wire.h"

/* Bytes of a table buffer faulted in per call while preparing it: the
 * kernel holds the process's memory map for the call, and the loop's own
 * mmap or munmap (a big malloc or free) waits for it meanwhile; 4 MiB
 * takes about a millisecond. */
#define POPULATE_CHUNK ((size_t)4 << 20)

typedef enum { JOB_BEGIN, JOB_ADD, JOB_COMMIT, JOB_ABORT, JOB_PREPARE } job_kind;

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
  uint64_t copy_faults;   /* loop only: its page faults meanwhile */
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
  uint32_t tab;                 /* table: whose (its id) */
  size_t cap;                   /* table: own's size (>= total), mapped */
  int preparing;                /* table spare: the writer is mapping or
                                   growing it to `want` bytes (under mu) */
  size_t want;
  size_t unfaulted;             /* table spare: bytes at its end the writer
                                   left for the loop to fault in (hurried) */
  psd_ckptq_rec *next_gone;     /* a list of spares to free */
  job j;                        /* its JOB_ADD or JOB_PREPARE */
};

struct psd_ckptq {
  psd_bg *bg;                   /* the writer thread */
  pthread_mutex_t mu;           /* guards records' pos, held, done, own, lost */
  pthread_cond_t prepared;      /* a spare's preparing went to 0 (under mu) */
  int hurry;                    /* the loop waits for a spare: any prepare
                                   hands its buffer over as it is (atomic) */
  uint32_t busy;                /* files begun, result not yet taken (loop only) */
  const psd_ckptdir *d;         /* the directory (not owned) */
  uint32_t ps_index, num_ps;    /* whose files, for pruning */
  int keep;                     /* complete checkpoints pruning keeps */
  uint8_t *bounce;              /* PSD_CKPTQ_CHUNK bytes: the writer's copy of a chunk */
  psd_ckptq_rec *spare[PS__MAX_TABLES]; /* each table's spare buffer, by
                                   table id (under mu) */
  uint64_t table_bytes;         /* every table buffer the queue holds: on
                                   their way, spare and being prepared
                                   (under mu) */
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

/* ---- table buffers -------------------------------------------------------- */

/* Writes a byte of every page of b[0, len): a hypervisor that backs a
 * guest's memory only when the guest first writes it (a Firecracker VM
 * here) leaves a page MADV_POPULATE_WRITE mapped as slow to write as an
 * unmapped one (151 MB: 388 ms for the first copy into it, 11 ms for the
 * next); after this the copy takes 11 ms. On bare metal the pages are
 * there already: a write per page, about a millisecond for 151 MB. */
static void touch_pages(uint8_t *b, size_t len, size_t pg) {
  for (size_t o = 0; o < len; o += pg) ((volatile uint8_t *)b)[o] = 0;
}

/* Faults in every page of b[0, len) (page-aligned b) on this thread, 4 MiB
 * at a time, and stops early once *hurry is set (the loop wants the buffer
 * now: it faults in the rest itself, rather than wait for a writer the
 * kernel may not be running). Out of memory, it stops too. The bytes
 * faulted in (a multiple of 4 MiB, or of a page, short of len). What the
 * buffer holds does not matter: it is the writer's alone. */
static size_t populate(uint8_t *b, size_t len, const int *hurry) {
  size_t o = 0;
  const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
#ifdef MADV_POPULATE_WRITE
  for (; o < len; o += POPULATE_CHUNK) {
    if (hurry && __atomic_load_n(hurry, __ATOMIC_RELAXED)) return o;
    const size_t n = len - o < POPULATE_CHUNK ? len - o : POPULATE_CHUNK;
    if (madvise(b + o, n, MADV_POPULATE_WRITE) != 0) break;
    touch_pages(b + o, n, pg);
  }
  if (o >= len) return len;
  if (errno != EINVAL) return o;
#endif
  /* A kernel before 5.14: a write per page faults it in all the same. */
  for (; o < len; o += pg) {
    if (o % POPULATE_CHUNK == 0 && hurry && __atomic_load_n(hurry, __ATOMIC_RELAXED)) return o;
    ((volatile uint8_t *)b)[o] = 0;
  }
  return len;
}

/* Mapped rather than malloc'd, so a spare can grow by mremap: the pages it
 * has stay, and only the new ones are faulted in. */
static uint8_t *map_buf(size_t cap) {
  void *b = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return b == MAP_FAILED ? NULL : b;
}

uint8_t *psd_ckptq_buf_new(size_t cap) {
  uint8_t *b = map_buf(cap);
  if (b) populate(b, cap, NULL); /* faster than a fault per page as it is written */
  return b;
}

void psd_ckptq_buf_free(uint8_t *buf, size_t cap) {
  if (buf) munmap(buf, cap);
}

/* Frees a list of spare records (linked by next_gone), outside the lock. */
static void free_gone(psd_ckptq_rec *gone) {
  for (psd_ckptq_rec *r = gone, *nx; r; r = nx) {
    nx = r->next_gone;
    psd_ckptq_buf_free(r->own, r->cap);
    free(r);
  }
}

int psd_ckptq_add_table(psd_ckptq *q, psd_ckptq_file *f, uint32_t tab, uint8_t *buf,
                        size_t cap, size_t len, double copy_ms, uint64_t copy_faults) {
  psd_ckptq_rec *rec = tab < PS__MAX_TABLES ? calloc(1, sizeof *rec) : NULL;
  if (!rec) {
    psd_ckptq_buf_free(buf, cap);
    return -1;
  }
  rec->own = buf;
  rec->cap = cap;
  rec->total = len;
  rec->table = 1; /* no slice holds it: the writer makes it a spare */
  rec->tab = tab;
  f->copy_bytes += len;
  f->copy_cap += cap;
  f->copy_ms += copy_ms;
  f->copy_faults += copy_faults;
  pthread_mutex_lock(&q->mu);
  q->table_bytes += cap;
  pthread_mutex_unlock(&q->mu);
  push_job(q, &rec->j, JOB_ADD, f, rec);
  return 0;
}

uint8_t *psd_ckptq_spare(psd_ckptq *q, uint32_t tab, size_t len, size_t *cap,
                         double *waited) {
  *waited = 0;
  if (tab >= PS__MAX_TABLES) return NULL;
  double t0 = ps__now();
  pthread_mutex_lock(&q->mu);
  psd_ckptq_rec *r = q->spare[tab];
  /* Being faulted in by the writer, big enough: the writer stops within
   * one chunk (this prepare, or another table's ahead of it: prepares are
   * queued only while no file is on its way) and hands it over, mapped
   * whole. */
  while (r && r->preparing && r->want >= len) {
    __atomic_store_n(&q->hurry, 1, __ATOMIC_RELAXED);
    pthread_cond_wait(&q->prepared, &q->mu);
    r = q->spare[tab];
    *waited = ps__now() - t0;
  }
  __atomic_store_n(&q->hurry, 0, __ATOMIC_RELAXED);
  if (r && !r->preparing && r->cap >= len) {
    q->spare[tab] = NULL;
    q->table_bytes -= r->cap; /* the loop's now, until it queues it again */
  } else {
    r = NULL;
  }
  pthread_mutex_unlock(&q->mu);
  if (!r) return NULL;
  uint8_t *b = r->own;
  *cap = r->cap;
  /* What the writer left, faulted in here as it would have been, a call
   * per 4 MiB (not a fault per page as the copy writes it). */
  if (r->unfaulted) populate(b + r->cap - r->unfaulted, r->unfaulted, NULL);
  free(r);
  return b;
}

size_t psd_ckptq_ready(psd_ckptq *q, uint32_t tab) {
  if (tab >= PS__MAX_TABLES) return 0;
  pthread_mutex_lock(&q->mu);
  const psd_ckptq_rec *r = q->spare[tab];
  size_t n = !r ? 0 : r->preparing ? r->want : r->cap;
  pthread_mutex_unlock(&q->mu);
  return n;
}

int psd_ckptq_preparing(psd_ckptq *q, uint32_t tab) {
  if (tab >= PS__MAX_TABLES) return 0;
  pthread_mutex_lock(&q->mu);
  int n = q->spare[tab] && q->spare[tab]->preparing;
  pthread_mutex_unlock(&q->mu);
  return n;
}

int psd_ckptq_prepare(psd_ckptq *q, uint32_t tab, size_t cap) {
  if (tab >= PS__MAX_TABLES) return -1;
  psd_ckptq_rec *fresh = calloc(1, sizeof *fresh);
  if (!fresh) return -1;
  pthread_mutex_lock(&q->mu);
  psd_ckptq_rec *r = q->spare[tab];
  int queue = !r || (!r->preparing && r->cap < cap);
  if (queue) {
    if (!r) {
      r = fresh;
      fresh = NULL;
      r->table = 1;
      r->tab = tab;
      q->spare[tab] = r;
    }
    r->preparing = 1; /* the writer's alone until it is ready */
    r->want = cap;
    q->table_bytes += cap - r->cap;
  }
  pthread_mutex_unlock(&q->mu);
  free(fresh);
  if (queue) push_job(q, &r->j, JOB_PREPARE, NULL, r);
  return 0;
}

uint64_t psd_ckptq_table_bytes(psd_ckptq *q) {
  pthread_mutex_lock(&q->mu);
  uint64_t n = q->table_bytes;
  pthread_mutex_unlock(&q->mu);
  return n;
}

void psd_ckptq_drop_spares(psd_ckptq *q) {
  psd_ckptq_rec *gone = NULL;
  pthread_mutex_lock(&q->mu);
  for (uint32_t i = 0; i < PS__MAX_TABLES; i++) {
    psd_ckptq_rec *r = q->spare[i];
    if (!r || r->preparing) continue;
    q->spare[i] = NULL;
    q->table_bytes -= r->cap;
    r->next_gone = gone;
    gone = r;
  }
  pthread_mutex_unlock(&q->mu);
  free_gone(gone);
}

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
  out->copy_faults = f->copy_faults;
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

/* A table's record is in the file (the page cache holds it now): its
 * buffer becomes the table's spare from here on, while the MAC and fsync
 * still run. One spare a table: the smaller of two is freed here. */
static void spare_back(psd_ckptq *q, psd_ckptq_rec *rec) {
  psd_ckptq_rec *gone = rec;
  pthread_mutex_lock(&q->mu);
  psd_ckptq_rec **s = &q->spare[rec->tab];
  if (!*s || (!(*s)->preparing && (*s)->cap < rec->cap)) {
    gone = *s;
    *s = rec;
  }
  if (gone) {
    q->table_bytes -= gone->cap;
    gone->next_gone = NULL;
  }
  pthread_mutex_unlock(&q->mu);
  free_gone(gone);
}

/* Maps (or grows) a table's spare to r->want bytes and faults its pages
 * in, unless the loop hurries it. r is the writer's alone meanwhile
 * (preparing): the loop neither takes nor frees it. */
static void prepare_spare(psd_ckptq *q, psd_ckptq_rec *r) {
  double t0 = ps__now();
  uint8_t *b = NULL;
  if (!r->own) {
    b = map_buf(r->want);
  } else {
    void *m = mremap(r->own, r->cap, r->want, MREMAP_MAYMOVE);
    b = m == MAP_FAILED ? NULL : m; /* the old mapping stays then */
  }
  /* The old pages are in already: cheap. */
  size_t in = b ? populate(b, r->want, &q->hurry) : 0;
  const int hurried = in < r->want && __atomic_load_n(&q->hurry, __ATOMIC_RELAXED);
  psd_ckptq_rec *gone = NULL;
  pthread_mutex_lock(&q->mu);
  if (b) {
    r->own = b;
    r->cap = r->want;
    r->unfaulted = hurried ? r->want - in : 0; /* out of memory: the copy's faults */
  } else {
    q->table_bytes -= r->want - r->cap;
    if (!r->own) { /* nothing to keep */
      q->spare[r->tab] = NULL;
      gone = r;
    }
  }
  uint32_t tab = r->tab; /* r may be the loop's (or freed) once unlocked */
  size_t want = r->want;
  r->preparing = 0;
  pthread_cond_broadcast(&q->prepared);
  pthread_mutex_unlock(&q->mu);
  free(gone);
  if (b)
    ps__log(PS_LOG_DEBUG, "checkpoint writer: table #%u's copy buffer ready, %.1f of %.1f MB "
            "faulted in off the loop in %.1f ms%s", tab, in / 1e6, want / 1e6,
            (ps__now() - t0) * 1e3,
            hurried ? " (the loop wanted it now: it faults in the rest)"
            : in < want ? " (out of memory: the copy's writes fault in the rest)" : "");
}

/* Writes one record: its header, then its data a chunk at a time, each
 * chunk copied out under the lock so a release in between sees exactly
 * what is still unread. */
static void write_rec(psd_ckptq *q, psd_ckptq_file *f, psd_ckptq_rec *rec) {
  char err[PSD_CKPTQ_ERR];
  if (rec->table) { /* owned by the queue: nothing else reads it */
    if (!f->failed && psd_ckpt_add_table(&f->w, rec->own, rec->total, err, sizeof err) != 0)
      fail(f, err);
    spare_back(q, rec);
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
  case JOB_PREPARE:
    prepare_spare(q, j->rec);
    break;
  }
}

int psd_ckptq_create(psd_ckptq **out, const psd_ckptdir *d, uint32_t ps_index,
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
  pthread_cond_init(&q->prepared, NULL);
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
  pthread_cond_destroy(&q->prepared);
  pthread_mutex_destroy(&q->mu);
  free(q->bounce);
  free(q);
}
