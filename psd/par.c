/* par.c - fork-join on helper threads (see par.h).
 *
 * A range is cut into chunks that any thread claims, the caller too: a
 * helper the kernel has not scheduled yet (more busy threads than CPUs,
 * as two ps and two workers on two cores) simply finds nothing left, and
 * the caller waits only for chunks a helper has begun. */
#include "par.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Chunks per thread: a few, so a thread that starts late or runs slower
 * (its CPU shared) leaves its share to the others. */
#define PAR_CHUNKS_PER_THREAD 4u

struct psd_par {
  unsigned threads;          /* in all, the caller's included */
  unsigned started;          /* helpers running */
  pthread_t th[PSD_PAR_MAX_THREADS];
  pthread_mutex_t mu;        /* guards everything below */
  pthread_cond_t go;         /* chunks to claim, or quitting */
  pthread_cond_t done;       /* the round's last chunk finished */
  size_t n;                  /* the round's range */
  size_t chunks, next;       /* its chunks; the next one unclaimed */
  size_t pending;            /* chunks not finished */
  psd_par_fn fn;
  void *ctx;
  int quit;
};

/* Under mu: the next chunk of the round as [lo, hi), or 0 when none is left. */
static int claim(psd_par *p, size_t *lo, size_t *hi) {
  if (p->next >= p->chunks) return 0;
  const size_t c = p->next++, base = p->n / p->chunks, extra = p->n % p->chunks;
  *lo = c * base + (c < extra ? c : extra);
  *hi = *lo + base + (c < extra);
  return 1;
}

/* Under mu: claims and runs chunks (mu released while one runs) until
 * none is left. */
static void run_chunks(psd_par *p) {
  size_t lo, hi;
  while (claim(p, &lo, &hi)) {
    psd_par_fn fn = p->fn;
    void *ctx = p->ctx;
    pthread_mutex_unlock(&p->mu);
    fn(ctx, lo, hi);
    pthread_mutex_lock(&p->mu);
    if (--p->pending == 0) pthread_cond_signal(&p->done);
  }
}

static void *helper(void *arg) {
  psd_par *p = arg;
  pthread_mutex_lock(&p->mu);
  while (!p->quit) {
    run_chunks(p);
    if (!p->quit) pthread_cond_wait(&p->go, &p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int psd_par_create(unsigned threads, psd_par **out) {
  *out = NULL;
  if (threads < 1) threads = 1;
  if (threads > PSD_PAR_MAX_THREADS) threads = PSD_PAR_MAX_THREADS;
  psd_par *p = calloc(1, sizeof *p);
  if (!p) return ENOMEM;
  p->threads = threads;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->go, NULL);
  pthread_cond_init(&p->done, NULL);
  int rc = 0;
  for (unsigned i = 0; i + 1 < threads && rc == 0; i++) {
    rc = pthread_create(&p->th[i], NULL, helper, p);
    if (rc == 0) p->started++;
  }
  p->threads = p->started + 1; /* fewer than asked when a thread could not start */
  *out = p;
  return rc;
}

void psd_par_destroy(psd_par *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->quit = 1;
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  for (unsigned i = 0; i < p->started; i++) pthread_join(p->th[i], NULL);
  pthread_cond_destroy(&p->go);
  pthread_cond_destroy(&p->done);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

unsigned psd_par_threads(const psd_par *p) { return p ? p->threads : 1; }

size_t psd_par_chunks(const psd_par *p, size_t n) {
  size_t most = (size_t)(p ? p->started + 1 : 1) * PAR_CHUNKS_PER_THREAD;
  size_t c = n / PSD_PAR_MIN_PART;
  if (!p || !p->started || c < 2) return n ? 1 : 0;
  return c < most ? c : most;
}

void psd_par_run(psd_par *p, size_t n, psd_par_fn fn, void *ctx) {
  const size_t chunks = psd_par_chunks(p, n);
  if (chunks <= 1) {
    if (n) fn(ctx, 0, n);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->n = n;
  p->fn = fn;
  p->ctx = ctx;
  p->chunks = chunks;
  p->next = 0;
  p->pending = chunks;
  pthread_cond_broadcast(&p->go);
  run_chunks(p);
  while (p->pending) pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

typedef struct finite_ctx {
  const float *v;
  size_t dim;
  int bad; /* set (atomically) by a chunk that saw a NaN or an infinity */
} finite_ctx;

/* A chunk of psd_par_all_finite: rows [lo, hi). Branch-free, vectorized. */
static void finite_chunk(void *arg, size_t lo, size_t hi) {
  finite_ctx *a = arg;
  const float *v = a->v + lo * a->dim;
  const size_t all = (hi - lo) * a->dim;
  uint32_t bad = 0;
  for (size_t i = 0; i < all; i++) {
    uint32_t b;
    memcpy(&b, v + i, sizeof b);
    bad |= (b & 0x7f800000u) == 0x7f800000u;
  }
  if (bad) __atomic_store_n(&a->bad, 1, __ATOMIC_RELAXED);
}

int psd_par_all_finite(psd_par *p, const float *v, size_t rows, size_t dim) {
  finite_ctx a = {v, dim, 0};
  psd_par_run(p, rows, finite_chunk, &a);
  return !a.bad;
}
