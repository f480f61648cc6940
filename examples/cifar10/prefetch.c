/* prefetch.c - next-batch preparation in a background thread (prefetch.h).
 *
 * One job at a time: the thread makes the batch of job_step into buffer
 * pair job_slot. get() waits for a pending job, takes its result if it is
 * the step asked for (else makes that batch itself: the thread is idle
 * then, so the sampler still has one user at a time), and queues step+1
 * into the other pair, which the caller has given back by calling again. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "prefetch.h"

struct cifar_prefetch {
  cifar_sampler *sp;   /* used by one thread at a time (see above) */
  int B;               /* batch size */
  float *img[2];       /* the caller's image buffers */
  uint8_t *lab[2];     /* the caller's label buffers */
  pthread_t th;        /* the background thread */
  pthread_mutex_t mu;  /* guards everything below */
  pthread_cond_t cv;   /* job queued, job done, stop */
  int pending;         /* a job is queued or running */
  int have;            /* the last job finished: pair job_slot holds job_step */
  uint64_t job_step;   /* step of the current job */
  int job_slot;        /* pair it fills */
  double job_epoch;    /* its epoch (cifar_sampler_batch's value) */
  int stop;            /* destroy asked the thread to exit */
  uint64_t hits;       /* gets served from the background */
};

static void *run(void *arg) {
  cifar_prefetch *pf = arg;
  pthread_mutex_lock(&pf->mu);
  for (;;) {
    while (!pf->pending && !pf->stop) pthread_cond_wait(&pf->cv, &pf->mu);
    if (pf->stop) break;
    uint64_t step = pf->job_step;
    int slot = pf->job_slot;
    pthread_mutex_unlock(&pf->mu);
    double e = cifar_sampler_batch(pf->sp, step, pf->B, pf->img[slot], pf->lab[slot]);
    pthread_mutex_lock(&pf->mu);
    pf->job_epoch = e;
    pf->have = 1;
    pf->pending = 0;
    pthread_cond_broadcast(&pf->cv);
  }
  pthread_mutex_unlock(&pf->mu);
  return NULL;
}

cifar_prefetch *cifar_prefetch_create(cifar_sampler *sp, int B, float *images[2],
                                      uint8_t *labels[2]) {
  if (!sp || B < 1 || !images || !labels || !images[0] || !images[1] || !labels[0] ||
      !labels[1]) {
    errno = EINVAL;
    return NULL;
  }
  cifar_prefetch *pf = calloc(1, sizeof *pf);
  if (!pf) return NULL;
  pf->sp = sp;
  pf->B = B;
  for (int i = 0; i < 2; i++) {
    pf->img[i] = images[i];
    pf->lab[i] = labels[i];
  }
  pthread_mutex_init(&pf->mu, NULL);
  pthread_cond_init(&pf->cv, NULL);
  int e = pthread_create(&pf->th, NULL, run, pf);
  if (e != 0) {
    pthread_mutex_destroy(&pf->mu);
    pthread_cond_destroy(&pf->cv);
    free(pf);
    errno = e;
    return NULL;
  }
  return pf;
}

double cifar_prefetch_get(cifar_prefetch *pf, uint64_t step, const float **images,
                          const uint8_t **labels) {
  pthread_mutex_lock(&pf->mu);
  while (pf->pending) pthread_cond_wait(&pf->cv, &pf->mu);
  int slot = pf->job_slot;
  double epoch;
  if (pf->have && pf->job_step == step) {
    epoch = pf->job_epoch;
    pf->hits++;
  } else {
    pthread_mutex_unlock(&pf->mu);
    epoch = cifar_sampler_batch(pf->sp, step, pf->B, pf->img[slot], pf->lab[slot]);
    pthread_mutex_lock(&pf->mu);
  }
  pf->have = 0;
  pf->job_step = step + 1;
  pf->job_slot = 1 - slot;
  pf->pending = 1;
  pthread_cond_broadcast(&pf->cv);
  pthread_mutex_unlock(&pf->mu);
  *images = pf->img[slot];
  *labels = pf->lab[slot];
  return epoch;
}

uint64_t cifar_prefetch_hits(const cifar_prefetch *pf) {
  cifar_prefetch *p = (cifar_prefetch *)pf; /* the lock, not the value, changes */
  pthread_mutex_lock(&p->mu);
  uint64_t h = p->hits;
  pthread_mutex_unlock(&p->mu);
  return h;
}

void cifar_prefetch_destroy(cifar_prefetch *pf) {
  if (!pf) return;
  pthread_mutex_lock(&pf->mu);
  pf->stop = 1;
  pthread_cond_broadcast(&pf->cv);
  pthread_mutex_unlock(&pf->mu);
  pthread_join(pf->th, NULL);
  pthread_mutex_destroy(&pf->mu);
  pthread_cond_destroy(&pf->cv);
  free(pf);
}
