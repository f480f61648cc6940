/* waiters.c - parked pulls, their deadlines and ready lists (see waiters.h). */
#include "waiters.h"

#include <stdlib.h>
#include <string.h>

#define NO_HEAP UINT32_MAX

void psd_waiters_init(psd_waiters *ws) { memset(ws, 0, sizeof *ws); }

void psd_waiters_free(psd_waiters *ws) {
  free(ws->parked);
  free(ws->heap);
  memset(ws, 0, sizeof *ws);
}

/* ---- deadline heap ------------------------------------------------------ */

/* 1 if a expires before b (ties: parked first). */
static int earlier(const psd_waiter *a, const psd_waiter *b) {
  return a->deadline < b->deadline || (a->deadline == b->deadline && a->seq < b->seq);
}

static void heap_put(psd_waiters *ws, uint32_t i, psd_waiter *w) {
  ws->heap[i] = w;
  w->heap_at = i;
}

static void sift_up(psd_waiters *ws, uint32_t i) {
  psd_waiter *w = ws->heap[i];
  while (i > 0) {
    uint32_t p = (i - 1) / 2;
    if (!earlier(w, ws->heap[p])) break;
    heap_put(ws, i, ws->heap[p]);
    i = p;
  }
  heap_put(ws, i, w);
}

static void sift_down(psd_waiters *ws, uint32_t i) {
  psd_waiter *w = ws->heap[i];
  for (;;) {
    uint32_t l = 2 * i + 1, m = i;
    const psd_waiter *best = w;
    if (l < ws->heap_n && earlier(ws->heap[l], best)) best = ws->heap[m = l];
    if (l + 1 < ws->heap_n && earlier(ws->heap[l + 1], best)) m = l + 1;
    if (m == i) break;
    heap_put(ws, i, ws->heap[m]);
    i = m;
  }
  heap_put(ws, i, w);
}

static int heap_push(psd_waiters *ws, psd_waiter *w) {
  if (ws->heap_n == ws->heap_cap) {
    uint32_t nc = ws->heap_cap ? ws->heap_cap * 2 : 64;
    psd_waiter **nh = realloc(ws->heap, nc * sizeof *nh);
    if (!nh) return -1;
    ws->heap = nh;
    ws->heap_cap = nc;
  }
  w->seq = ++ws->seq;
  heap_put(ws, ws->heap_n++, w);
  sift_up(ws, w->heap_at);
  return 0;
}

static void heap_remove(psd_waiters *ws, psd_waiter *w) {
  uint32_t i = w->heap_at;
  if (i == NO_HEAP) return;
  w->heap_at = NO_HEAP;
  psd_waiter *last = ws->heap[--ws->heap_n];
  if (i == ws->heap_n) return;
  heap_put(ws, i, last);
  /* The moved one may belong above or below its new place. */
  if (i > 0 && earlier(last, ws->heap[(i - 1) / 2])) sift_up(ws, i);
  else sift_down(ws, i);
}

/* ---- parking ------------------------------------------------------------ */

static int park(psd_waiters *ws, psd_waiter *w) {
  if (heap_push(ws, w) != 0) return -1;
  psd_waiter **head = &ws->parked[w->slice_id];
  w->prev = NULL;
  w->next = *head;
  if (*head) (*head)->prev = w;
  *head = w;
  w->parked = 1;
  return 0;
}

static void unpark(psd_waiters *ws, psd_waiter *w) {
  if (!w->parked) return;
  heap_remove(ws, w);
  if (w->prev) w->prev->next = w->next;
  else ws->parked[w->slice_id] = w->next;
  if (w->next) w->next->prev = w->prev;
  w->prev = w->next = NULL;
  w->parked = 0;
}

/* The one wake-up path: w goes to its set's ready list, the set to the
 * dirty list. */
static void make_ready(psd_waiters *ws, psd_waiter *w) {
  unpark(ws, w);
  if (w->ready) return;
  psd_waitset *set = w->set;
  w->ready = 1;
  w->ready_next = NULL;
  if (set->ready_tail) set->ready_tail->ready_next = w;
  else set->ready_head = w;
  set->ready_tail = w;
  if (!set->in_dirty) {
    set->in_dirty = 1;
    set->dirty_next = ws->dirty;
    ws->dirty = set;
  }
}

/* ---- sets ---------------------------------------------------------------- */

int psd_waiters_set_reserve(psd_waiters *ws, psd_waitset *set, uint32_t n) {
  if (n > ws->nslices) {
    psd_waiter **np = realloc(ws->parked, n * sizeof *np);
    if (!np) return -1;
    memset(np + ws->nslices, 0, (n - ws->nslices) * sizeof *np);
    ws->parked = np;
    ws->nslices = n;
  }
  if (n > set->cap) {
    psd_waiter **nw = realloc(set->by_slice, n * sizeof *nw);
    if (!nw) return -1;
    memset(nw + set->cap, 0, (n - set->cap) * sizeof *nw);
    set->by_slice = nw;
    set->cap = n;
  }
  return 0;
}

int psd_waiters_set_busy(const psd_waitset *set, uint32_t slice_id) {
  return slice_id < set->cap && set->by_slice[slice_id] && set->by_slice[slice_id]->ready;
}

int psd_waiters_pull_dtype(psd_waiters *ws, psd_waitset *set, uint32_t slice_id,
                           uint64_t request_id, uint64_t min_step, double deadline, int now,
                           uint32_t dtype) {
  psd_waiter *w = set->by_slice[slice_id];
  if (!w) {
    w = calloc(1, sizeof *w);
    if (!w) return -1;
    w->set = set;
    w->slice_id = slice_id;
    w->heap_at = NO_HEAP;
    set->by_slice[slice_id] = w;
  }
  /* A parked pull of this slice from an earlier request is superseded:
   * its client gave up on it (timed out) or asks again. */
  unpark(ws, w);
  w->request_id = request_id;
  w->min_step = min_step;
  w->dtype = dtype;
  w->deadline = deadline;
  if (now) make_ready(ws, w);
  else if (park(ws, w) != 0) return -1;
  return 0;
}

psd_waiter *psd_waiters_take_ready(psd_waitset *set) {
  psd_waiter *w = set->ready_head;
  set->ready_head = set->ready_tail = NULL;
  return w;
}

void psd_waiters_answered(psd_waiter *w) {
  w->ready = 0;
  w->ready_next = NULL;
}

void psd_waiters_set_free(psd_waiters *ws, psd_waitset *set) {
  for (uint32_t i = 0; i < set->cap; i++) {
    psd_waiter *w = set->by_slice[i];
    if (!w) continue;
    unpark(ws, w);
    free(w);
  }
  free(set->by_slice);
  set->by_slice = NULL;
  set->cap = 0;
  set->ready_head = set->ready_tail = NULL;
  if (set->in_dirty) {
    for (psd_waitset **pp = &ws->dirty; *pp; pp = &(*pp)->dirty_next)
      if (*pp == set) {
        *pp = set->dirty_next;
        break;
      }
    set->in_dirty = 0;
  }
}

/* ---- waking and expiring ------------------------------------------------ */

void psd_waiters_wake(psd_waiters *ws, uint32_t slice_id, uint64_t step) {
  if (slice_id >= ws->nslices) return;
  for (psd_waiter *w = ws->parked[slice_id]; w;) {
    psd_waiter *next = w->next;
    if (step >= w->min_step) make_ready(ws, w);
    w = next;
  }
}

void psd_waiters_wake_all(psd_waiters *ws) {
  for (uint32_t i = 0; i < ws->nslices; i++)
    while (ws->parked[i]) make_ready(ws, ws->parked[i]);
}

psd_waitset *psd_waiters_next_dirty(psd_waiters *ws) {
  psd_waitset *set = ws->dirty;
  if (!set) return NULL;
  ws->dirty = set->dirty_next;
  set->dirty_next = NULL;
  set->in_dirty = 0;
  return set;
}

uint32_t psd_waiters_expire(psd_waiters *ws, double now, psd_waiter_expired_fn *fn, void *ctx) {
  uint32_t n = 0;
  ws->gen++;
  /* A request's waiters share its deadline and were parked together, so
   * they leave the heap one after another: report the first only. */
  while (ws->heap_n && ws->heap[0]->deadline <= now) {
    psd_waiter *w = ws->heap[0];
    psd_waitset *set = w->set;
    unpark(ws, w);
    n++;
    if (set->expired_gen == ws->gen && set->expired_req == w->request_id) continue;
    set->expired_gen = ws->gen;
    set->expired_req = w->request_id;
    if (fn) fn(ctx, set, w);
  }
  return n;
}

double psd_waiters_next_deadline(const psd_waiters *ws) {
  return ws->heap_n ? ws->heap[0]->deadline : 0;
}
