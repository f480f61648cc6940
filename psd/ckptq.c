/* ckptq.c - the checkpoint writer thread (see ckptq.h). */
#include "ckptq.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "util.h"

typedef enum { JOB_BEGIN, JOB_ADD, JOB_COMMIT, JOB_ABORT } job_kind;

/* One queued piece of work; embedded in the file or record it is for, so
 * queueing allocates nothing beyond those. */
typedef struct job {
  job_kind kind;          /* what to do */
  psd_ckptq_file *f;      /* the file it is for */
  psd_ckptq_rec *rec;     /* JOB_ADD: the record */
  struct job *next;       /* FIFO link */
} job;

struct psd_ckptq_file {
  psd_ckpt_writer w;      /* the file (touched by the writer thread only) */
  psd_ckpt_meta m;        /* its header */
  int failed;             /* a step failed: the rest is skipped, commit reports err */
  char err[PSD_CKPTQ_ERR];         /* the first failure */
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
  job j;                        /* its JOB_ADD */
};

typedef struct result_node {
  psd_ckptq_result r;           /* what happened */
  struct result_node *next;     /* FIFO link */
} result_node;

struct psd_ckptq {
  pthread_t th;                 /* the writer */
  pthread_mutex_t mu;           /* guards everything below and records' pos/held/done/own */
  pthread_cond_t cv;            /* work queued, or quitting */
  job *head, *tail;             /* queued work, in order */
  result_node *rhead, *rtail;   /* finished files for the loop */
  uint32_t busy;                /* files begun, not yet finished */
  int quit;                     /* finish the queue, then end */
  int efd;                      /* eventfd: readable while results wait */
  const psd_ckpt_dir *d;        /* the directory (not owned) */
  uint32_t ps_index, num_ps;    /* whose files, for pruning */
  int keep;                     /* complete checkpoints pruning keeps */
  uint8_t *bounce;              /* PSD_CKPTQ_CHUNK bytes: the writer's copy of a chunk */
};

/* ---- the loop's side ------------------------------------------------------ */

static void push_job(psd_ckptq *q, job *j) {
  j->next = NULL;
  pthread_mutex_lock(&q->mu);
  if (q->tail) q->tail->next = j;
  else q->head = j;
  q->tail = j;
  pthread_cond_signal(&q->cv);
  pthread_mutex_unlock(&q->mu);
}

psd_ckptq_file *psd_ckptq_begin(psd_ckptq *q, const psd_ckpt_meta *m) {
  psd_ckptq_file *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  psd_ckpt_writer_init(&f->w);
  f->m = *m;
  f->begin = (job){.kind = JOB_BEGIN, .f = f};
  pthread_mutex_lock(&q->mu);
  q->busy++;
  pthread_mutex_unlock(&q->mu);
  push_job(q, &f->begin);
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
  rec->j = (job){.kind = JOB_ADD, .f = f, .rec = rec};
  push_job(q, &rec->j);
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
  f->end = (job){.kind = JOB_COMMIT, .f = f};
  push_job(q, &f->end);
}

void psd_ckptq_abort(psd_ckptq *q, psd_ckptq_file *f) {
  f->end = (job){.kind = JOB_ABORT, .f = f};
  push_job(q, &f->end);
}

int psd_ckptq_next(psd_ckptq *q, psd_ckptq_result *out) {
  for (int tries = 0; tries < 2; tries++) {
    pthread_mutex_lock(&q->mu);
    result_node *n = q->rhead;
    if (n) {
      q->rhead = n->next;
      if (!q->rhead) q->rtail = NULL;
    }
    pthread_mutex_unlock(&q->mu);
    if (n) {
      *out = n->r;
      free(n);
      return 1;
    }
    /* Clear the eventfd, then look again: a result posted before the read
     * is seen now, one posted after it makes the fd readable again. */
    uint64_t v;
    if (tries == 0 && read(q->efd, &v, sizeof v) < 0 && errno != EAGAIN) break;
  }
  return 0;
}

uint32_t psd_ckptq_busy(psd_ckptq *q) {
  pthread_mutex_lock(&q->mu);
  uint32_t b = q->busy;
  pthread_mutex_unlock(&q->mu);
  return b;
}

int psd_ckptq_fd(const psd_ckptq *q) { return q->efd; }

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
      snprintf(err, sizeof err, "out of memory keeping slice '%.200s' for checkpoint %.900s",
               rec->name, f->w.tmp);
      fail(f, err);
    }
    if (f->failed || n == 0) break;
    if (psd_ckpt_append(&f->w, q->bounce, n, err, sizeof err) != 0) fail(f, err);
  }
  rec_done(q, rec);
}

static void post(psd_ckptq *q, result_node *n) {
  pthread_mutex_lock(&q->mu);
  n->next = NULL;
  if (q->rtail) q->rtail->next = n;
  else q->rhead = n;
  q->rtail = n;
  q->busy--;
  pthread_mutex_unlock(&q->mu);
  uint64_t one = 1;
  ssize_t wn = write(q->efd, &one, sizeof one);
  (void)wn; /* an eventfd write fails only on counter overflow */
}

/* Commits or aborts f and posts its result; f is freed. */
static void finish_file(psd_ckptq *q, psd_ckptq_file *f, int commit) {
  result_node *n = calloc(1, sizeof *n);
  psd_ckptq_result *r = n ? &n->r : &(psd_ckptq_result){0};
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
  free(f);
  if (n) {
    post(q, n);
  } else {
    pthread_mutex_lock(&q->mu);
    q->busy--; /* nowhere to report it: the file simply never appears */
    pthread_mutex_unlock(&q->mu);
  }
}

static void run_job(psd_ckptq *q, job *j) {
  char err[PSD_CKPTQ_ERR];
  switch (j->kind) {
  case JOB_BEGIN:
    if (psd_ckpt_begin(&j->f->w, q->d, &j->f->m, err, sizeof err) != 0) fail(j->f, err);
    break;
  case JOB_ADD:
    write_rec(q, j->f, j->rec);
    break;
  case JOB_COMMIT:
  case JOB_ABORT:
    finish_file(q, j->f, j->kind == JOB_COMMIT);
    break;
  }
}

static void *writer_main(void *arg) {
  psd_ckptq *q = arg;
  pthread_mutex_lock(&q->mu);
  for (;;) {
    while (!q->head && !q->quit) pthread_cond_wait(&q->cv, &q->mu);
    job *j = q->head;
    if (!j) break; /* quitting with nothing left */
    q->head = j->next;
    if (!q->head) q->tail = NULL;
    pthread_mutex_unlock(&q->mu);
    run_job(q, j);
    pthread_mutex_lock(&q->mu);
  }
  pthread_mutex_unlock(&q->mu);
  return NULL;
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
  q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  pthread_mutex_init(&q->mu, NULL);
  pthread_cond_init(&q->cv, NULL);
  int e = q->efd < 0 ? errno : pthread_create(&q->th, NULL, writer_main, q);
  if (e) {
    snprintf(err, errlen, "cannot start the checkpoint writer: %s", strerror(e));
    if (q->efd >= 0) close(q->efd);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q->bounce);
    free(q);
    return -1;
  }
  *out = q;
  return 0;
}

void psd_ckptq_stop(psd_ckptq *q) {
  if (!q) return;
  pthread_mutex_lock(&q->mu);
  int running = !q->quit;
  q->quit = 1;
  pthread_cond_signal(&q->cv);
  pthread_mutex_unlock(&q->mu);
  if (running) pthread_join(q->th, NULL);
}

void psd_ckptq_destroy(psd_ckptq *q) {
  if (!q) return;
  psd_ckptq_stop(q);
  for (result_node *n = q->rhead, *next; n; n = next) {
    next = n->next;
    free(n);
  }
  close(q->efd);
  pthread_mutex_destroy(&q->mu);
  pthread_cond_destroy(&q->cv);
  free(q->bounce);
  free(q);
}
