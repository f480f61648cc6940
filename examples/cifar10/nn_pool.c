/* nn_pool.c - see nn_pool.h.
 *
 * One job at a time. `next` packs the job's generation (bits 32..63), its
 * chunk count (16..31) and its next chunk index (0..15): a worker takes
 * chunk i of generation g by a CAS from (g, n, i) to (g, n, i + 1), so a
 * worker that wakes up late, holding an older generation, takes nothing.
 * fn and arg are written before `next` is released with the new
 * generation; a worker reads them after an acquire load of `next` and
 * uses them only if its CAS on that same generation then succeeds, which
 * proves the job was still unfinished (fn and arg are replaced only after
 * all of a job's chunks have been taken). */
#include "nn_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define WORKER_SPIN 20000 /* polls (~0.4 ms) before an idle worker sleeps */
#define CALLER_SPIN 2000  /* polls (~40 us) before the caller sleeps */

struct nn_pool {
  int threads;
  pthread_t *tid;
  int started;
  pthread_mutex_t run_mu; /* one job at a time */
  pthread_mutex_t mu;     /* sleeping workers, sleeping caller */
  pthread_cond_t cv;      /* workers: a new job */
  pthread_cond_t done_cv; /* caller: the job's last chunk is done */
  int sleepers, stop, caller_waits;
  _Atomic uint64_t next;
  _Atomic(nn_pool_fn) fn;
  _Atomic(void *) arg;
  _Atomic int done;
  uint32_t gen; /* caller side */
};

typedef struct {
  nn_pool *p;
  int id;
} worker_arg;

#define MAX_CHUNKS 0xffff
static uint64_t pack(uint32_t g, int n) { return (uint64_t)g << 32 | (uint64_t)n << 16; }

/* Takes the next chunk of generation g; -1 when none is left or the
 * generation is over. */
static int grab(nn_pool *p, uint32_t g) {
  uint64_t v = atomic_load_explicit(&p->next, memory_order_acquire);
  for (;;) {
    int n = (int)((v >> 16) & 0xffff), i = (int)(v & 0xffff);
    if ((uint32_t)(v >> 32) != g || i >= n) return -1;
    if (atomic_compare_exchange_weak_explicit(&p->next, &v, v + 1,
                                              memory_order_acq_rel,
                                              memory_order_acquire))
      return i;
  }
}

static void work(nn_pool *p, uint32_t g, int id) {
  nn_pool_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
  void *arg = atomic_load_explicit(&p->arg, memory_order_relaxed);
  int c;
  while ((c = grab(p, g)) >= 0) {
    fn(arg, c, id);
    uint64_t v = atomic_load_explicit(&p->next, memory_order_relaxed);
    int n = (int)((v >> 16) & 0xffff); /* g is still current: c not done */
    if (atomic_fetch_add_explicit(&p->done, 1, memory_order_acq_rel) + 1 == n &&
        id != 0) { /* the last chunk: wake the caller if it sleeps */
      pthread_mutex_lock(&p->mu);
      if (p->caller_waits) pthread_cond_signal(&p->done_cv);
      pthread_mutex_unlock(&p->mu);
    }
  }
}

static void *worker(void *va) {
  worker_arg *wa = va;
  nn_pool *p = wa->p;
  int id = wa->id;
  free(wa);
  uint32_t seen = (uint32_t)(atomic_load(&p->next) >> 32);
  int spin = 0;
  for (;;) {
    uint32_t g = (uint32_t)(atomic_load_explicit(&p->next,
                                                 memory_order_acquire) >> 32);
    if (g != seen) {
      seen = g;
      work(p, g, id);
      spin = 0;
      continue;
    }
    if (++spin < WORKER_SPIN) {
      cpu_relax();
      continue;
    }
    pthread_mutex_lock(&p->mu);
    p->sleepers++;
    while (!p->stop && (uint32_t)(atomic_load(&p->next) >> 32) == seen)
      pthread_cond_wait(&p->cv, &p->mu);
    p->sleepers--;
    int stop = p->stop;
    pthread_mutex_unlock(&p->mu);
    if (stop) return NULL;
    spin = 0;
  }
}

nn_pool *nn_pool_create(int threads) {
  if (threads < 1) return NULL;
  nn_pool *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->threads = threads;
  pthread_mutex_init(&p->run_mu, NULL);
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  pthread_cond_init(&p->done_cv, NULL);
  atomic_init(&p->next, 0);
  atomic_init(&p->fn, NULL);
  atomic_init(&p->arg, NULL);
  atomic_init(&p->done, 0);
  if (threads > 1) {
    p->tid = calloc((size_t)threads, sizeof(pthread_t));
    if (!p->tid) {
      nn_pool_destroy(p);
      return NULL;
    }
  }
  for (int i = 1; i < threads; i++) {
    worker_arg *wa = malloc(sizeof *wa);
    if (!wa) break;
    wa->p = p;
    wa->id = i;
    if (pthread_create(&p->tid[p->started], NULL, worker, wa) != 0) {
      free(wa);
      break;
    }
    p->started++;
  }
  /* fewer workers than asked still works: the caller takes their chunks */
  return p;
}

void nn_pool_run(nn_pool *p, int nchunks, nn_pool_fn fn, void *arg) {
  if (nchunks <= 0) return;
  if (!p || p->started == 0 || nchunks == 1 || nchunks > MAX_CHUNKS) {
    if (p) pthread_mutex_lock(&p->run_mu);
    for (int c = 0; c < nchunks; c++) fn(arg, c, 0);
    if (p) pthread_mutex_unlock(&p->run_mu);
    return;
  }
  pthread_mutex_lock(&p->run_mu);
  uint32_t g = ++p->gen;
  atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
  atomic_store_explicit(&p->arg, arg, memory_order_relaxed);
  atomic_store_explicit(&p->done, 0, memory_order_relaxed);
  atomic_store_explicit(&p->next, pack(g, nchunks), memory_order_release);
  pthread_mutex_lock(&p->mu);
  if (p->sleepers) pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  work(p, g, 0);
  /* Workers still run chunks: poll a little, then sleep. Sleeping (not
   * yielding) matters on a busy machine: a worker that waits for a CPU is
   * then moved by the kernel onto the one this thread leaves idle. */
  for (int spin = 0; spin < CALLER_SPIN; spin++) {
    if (atomic_load_explicit(&p->done, memory_order_acquire) >= nchunks)
      goto out;
    cpu_relax();
  }
  pthread_mutex_lock(&p->mu);
  p->caller_waits = 1;
  while (atomic_load_explicit(&p->done, memory_order_acquire) < nchunks)
    pthread_cond_wait(&p->done_cv, &p->mu);
  p->caller_waits = 0;
  pthread_mutex_unlock(&p->mu);
out:
  pthread_mutex_unlock(&p->run_mu);
}

void nn_pool_destroy(nn_pool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  /* a spinning worker sees stop when it goes to sleep, in ~0.1 ms */
  for (int i = 0; i < p->started; i++) pthread_join(p->tid[i], NULL);
  free(p->tid);
  pthread_cond_destroy(&p->cv);
  pthread_cond_destroy(&p->done_cv);
  pthread_mutex_destroy(&p->mu);
  pthread_mutex_destroy(&p->run_mu);
  free(p);
}
