/*
 * bg.h - a background thread for work that must not run on psd's event
 * loop (disk writes and fsyncs, MUNGE's round trips to munged). Jobs run
 * one at a time in the order queued; a job that asks for it is handed back
 * to the loop when done, which learns of it through an eventfd. The loop
 * never waits for a job, except at psd_bg_stop.
 */
#ifndef PSD_BG_H
#define PSD_BG_H

typedef struct psd_bg psd_bg;

/* One piece of work, embedded in the caller's own struct (nothing is
 * allocated to queue it). */
typedef struct psd_bg_job {
  void (*run)(struct psd_bg_job *j); /* on the thread */
  int post;                          /* hand it back to the loop once run */
  struct psd_bg_job *next;           /* queue link (owned by bg) */
} psd_bg_job;

/* Starts the thread. 0, or an errno value. */
int psd_bg_create(psd_bg **out);
/* Runs every queued job, then ends the thread; psd_bg_done still works
 * afterwards. Waits for the work. NULL is a no-op. */
void psd_bg_stop(psd_bg *b);
/* Stops it and frees it. Jobs handed back and not taken are not touched
 * (their owner frees them). NULL is a no-op. */
void psd_bg_destroy(psd_bg *b);
/* Queues j (j->run and j->post set by the caller). */
void psd_bg_push(psd_bg *b, psd_bg_job *j);
/* The next job handed back, or NULL. Clears the eventfd when none is
 * left, so it becomes readable again only for jobs done after that. */
psd_bg_job *psd_bg_done(psd_bg *b);
/* Readable while jobs handed back wait (an eventfd). */
int psd_bg_fd(const psd_bg *b);

#endif
