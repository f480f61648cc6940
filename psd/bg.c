/* bg.c - the background thread (see bg.h). */
#include "bg.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

struct psd_bg {
  pthread_t th;                 /* the thread */
  pthread_mutex_t mu;           /* guards the two queues and quit */
  pthread_cond_t cv;            /* work queued, or quitting */
  psd_bg_job *head, *tail;      /* queued, in order */
  psd_bg_job *dhead, *dtail;    /* run and handed back, in order */
  int quit;                     /* run what is queued, then end */
  int joined;                   /* the thread has ended */
  int efd;                      /* eventfd: readable while dhead waits */
};

static void append(psd_bg_job **head, psd_bg_job **tail, psd_bg_job *j) {
  j->next = NULL;
  if (*tail) (*tail)->next = j;
  else *head = j;
  *tail = j;
}

static psd_bg_job *take(psd_bg_job **head, psd_bg_job **tail) {
  psd_bg_job *j = *head;
  if (j) {
    *head = j->next;
    if (!*head) *tail = NULL;
  }
  return j;
}

void psd_bg_push(psd_bg *b, psd_bg_job *j) {
  pthread_mutex_lock(&b->mu);
  append(&b->head, &b->tail, j);
  pthread_cond_signal(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

psd_bg_job *psd_bg_done(psd_bg *b) {
  for (int tries = 0; tries < 2; tries++) {
    pthread_mutex_lock(&b->mu);
    psd_bg_job *j = take(&b->dhead, &b->dtail);
    pthread_mutex_unlock(&b->mu);
    if (j) return j;
    /* Clear the eventfd, then look again: a job handed back before the
     * read is seen now, one handed back after it makes the fd readable. */
    uint64_t v;
    if (tries == 0 && read(b->efd, &v, sizeof v) < 0 && errno != EAGAIN) break;
  }
  return NULL;
}

int psd_bg_fd(const psd_bg *b) { return b->efd; }

static void *bg_main(void *arg) {
  psd_bg *b = arg;
  pthread_mutex_lock(&b->mu);
  for (;;) {
    while (!b->head && !b->quit) pthread_cond_wait(&b->cv, &b->mu);
    psd_bg_job *j = take(&b->head, &b->tail);
    if (!j) break; /* quitting with nothing left */
    pthread_mutex_unlock(&b->mu);
    int post = j->post; /* j may be freed by its run once it is not posted */
    j->run(j);
    pthread_mutex_lock(&b->mu);
    if (post) {
      append(&b->dhead, &b->dtail, j);
      uint64_t one = 1;
      ssize_t n = write(b->efd, &one, sizeof one);
      (void)n; /* an eventfd write fails only on counter overflow */
    }
  }
  pthread_mutex_unlock(&b->mu);
  return NULL;
}

int psd_bg_create(psd_bg **out) {
  *out = NULL;
  psd_bg *b = calloc(1, sizeof *b);
  if (!b) return ENOMEM;
  b->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (b->efd < 0) {
    int e = errno;
    free(b);
    return e;
  }
  pthread_mutex_init(&b->mu, NULL);
  pthread_cond_init(&b->cv, NULL);
  int e = pthread_create(&b->th, NULL, bg_main, b);
  if (e) {
    close(b->efd);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
    return e;
  }
  *out = b;
  return 0;
}

void psd_bg_stop(psd_bg *b) {
  if (!b || b->joined) return;
  pthread_mutex_lock(&b->mu);
  b->quit = 1;
  pthread_cond_signal(&b->cv);
  pthread_mutex_unlock(&b->mu);
  pthread_join(b->th, NULL);
  b->joined = 1;
}

void psd_bg_destroy(psd_bg *b) {
  if (!b) return;
  psd_bg_stop(b);
  close(b->efd);
  pthread_mutex_destroy(&b->mu);
  pthread_cond_destroy(&b->cv);
  free(b);
}
