/*
 * nn_pin.c - page-locked host ranges shared by the models of a process
 * (nn_pin.h).
 *
 * A driver locks whole pages and refuses a page that is locked already
 * (CUDA: cudaErrorHostMemoryAlreadyRegistered). One model merges its own
 * buffers' pages before locking them, but two models (an evaluation model
 * beside the training one, a test's GPU model beside another) can hold
 * buffers that share a page, and the second model's lock then failed. The
 * registry keeps every range locked through it with a reference count: a
 * model references the ranges already locked that its pages fall in and
 * locks only the gaps; a range is unlocked when its last user lets go.
 * Ranges are never merged or split once locked (unlocking one that an
 * instantiated graph copies from would break that graph).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn_pin.h"

#define PIN_ENTRIES 512 /* ranges locked at once in a process: 20 per model
                           plus gaps; far more models than one process runs */

typedef struct pin_entry {
  const cnn_backend *be; /* the backend that locked it; NULL: slot free */
  uintptr_t start, end;  /* page-aligned range */
  int refs;              /* sets holding it */
} pin_entry;

static pin_entry reg[PIN_ENTRIES];
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;

static int range_cmp(const void *a, const void *b) {
  uintptr_t x = ((const cnn_pin_range *)a)->start;
  uintptr_t y = ((const cnn_pin_range *)b)->start;
  return x < y ? -1 : x > y;
}

int cnn_pin_merge(cnn_pin_range *r, int n) {
  if (n <= 0) return 0;
  for (int i = 0; i < n; i++) {
    uintptr_t a = r[i].start, e = r[i].end; /* on entry: start, bytes */
    r[i].start = a / CNN_PIN_PAGE * CNN_PIN_PAGE;
    r[i].end = (a + e + CNN_PIN_PAGE - 1) / CNN_PIN_PAGE * CNN_PIN_PAGE;
  }
  qsort(r, (size_t)n, sizeof r[0], range_cmp);
  int k = 0;
  for (int i = 1; i < n; i++) {
    if (r[i].start <= r[k].end) {
      if (r[i].end > r[k].end) r[k].end = r[i].end;
    } else {
      r[++k] = r[i];
    }
  }
  return k + 1;
}

/* The entry of be containing address a, or -1. Caller holds reg_mu. */
static int entry_at(const cnn_backend *be, uintptr_t a) {
  for (int i = 0; i < PIN_ENTRIES; i++)
    if (reg[i].be == be && reg[i].start <= a && a < reg[i].end) return i;
  return -1;
}

/* The lowest start of an entry of be in (a, limit), else limit. */
static uintptr_t next_start(const cnn_backend *be, uintptr_t a, uintptr_t limit) {
  for (int i = 0; i < PIN_ENTRIES; i++)
    if (reg[i].be == be && reg[i].start > a && reg[i].start < limit)
      limit = reg[i].start;
  return limit;
}

static void drop_ref(const cnn_backend *be, int i) {
  if (--reg[i].refs > 0) return;
  be->host_unregister(be, (void *)reg[i].start);
  reg[i] = (pin_entry){NULL, 0, 0, 0};
}

/* Holds one more reference to entry i in set; -1 when the set is full. */
static int hold(cnn_pinset *set, int i, char *err, size_t errlen) {
  if (set->n >= CNN_PIN_HOLD) {
    snprintf(err, errlen, "page-locking: more than %d ranges for one model",
             CNN_PIN_HOLD);
    return -1;
  }
  set->ref[set->n++] = i;
  reg[i].refs++;
  return 0;
}

/* Locks [a, b) as a new entry held by set; -1 with err. */
static int lock_new(const cnn_backend *be, uintptr_t a, uintptr_t b,
                    cnn_pinset *set, char *err, size_t errlen) {
  int slot = -1;
  for (int i = 0; i < PIN_ENTRIES && slot < 0; i++)
    if (!reg[i].be) slot = i;
  if (slot < 0) {
    snprintf(err, errlen, "page-locking: more than %d ranges in this process",
             PIN_ENTRIES);
    return -1;
  }
  if (set->n >= CNN_PIN_HOLD) {
    snprintf(err, errlen, "page-locking: more than %d ranges for one model",
             CNN_PIN_HOLD);
    return -1;
  }
  if (be->host_register(be, (void *)a, b - a) != 0) {
    const char *why = be->soft_error ? be->soft_error(be) : NULL;
    snprintf(err, errlen, "page-locking %zu bytes at %p failed: %s",
             (size_t)(b - a), (void *)a, why ? why : "no reason given");
    return -1;
  }
  reg[slot] = (pin_entry){be, a, b, 0};
  set->own++;
  return hold(set, slot, err, errlen);
}

int cnn_pin_acquire(const cnn_backend *be, const cnn_pin_range *r, int n,
                    cnn_pinset *set, char *err, size_t errlen) {
  char dummy[8];
  if (!err || !errlen) {
    err = dummy;
    errlen = sizeof dummy;
  }
  err[0] = '\0';
  memset(set, 0, sizeof *set);
  if (!be->host_register || !be->host_unregister) {
    snprintf(err, errlen, "the %s backend cannot page-lock memory", be->name);
    return -1;
  }
  pthread_mutex_lock(&reg_mu);
  int rc = 0;
  for (int k = 0; k < n && rc == 0; k++) {
    uintptr_t a = r[k].start;
    while (a < r[k].end && rc == 0) {
      int i = entry_at(be, a);
      if (i >= 0) { /* locked by another model: share it */
        rc = hold(set, i, err, errlen);
        if (rc == 0) set->shared++;
        a = reg[i].end;
      } else {
        uintptr_t b = next_start(be, a, r[k].end);
        rc = lock_new(be, a, b, set, err, errlen);
        a = b;
      }
    }
  }
  pthread_mutex_unlock(&reg_mu);
  if (rc != 0) cnn_pin_release(be, set);
  return rc;
}

int cnn_pin_within_one(const cnn_backend *be, const void *p, size_t bytes) {
  uintptr_t a = (uintptr_t)p;
  pthread_mutex_lock(&reg_mu);
  int i = entry_at(be, a);
  int ok = i >= 0 && bytes <= reg[i].end - a;
  pthread_mutex_unlock(&reg_mu);
  return ok;
}

int cnn_pin_direct(const cnn_backend *be, const void *p, size_t bytes) {
  uintptr_t a = (uintptr_t)p, e = a + bytes;
  int inside = 0, touches = 0;
  pthread_mutex_lock(&reg_mu);
  for (int i = 0; i < PIN_ENTRIES; i++) {
    if (reg[i].be != be || !(reg[i].start < e && a < reg[i].end)) continue;
    touches = 1;
    if (reg[i].start <= a && e <= reg[i].end) inside = 1;
  }
  pthread_mutex_unlock(&reg_mu);
  return inside || !touches;
}

void cnn_pin_release(const cnn_backend *be, cnn_pinset *set) {
  pthread_mutex_lock(&reg_mu);
  for (int k = 0; k < set->n; k++) drop_ref(be, set->ref[k]);
  pthread_mutex_unlock(&reg_mu);
  memset(set, 0, sizeof *set);
}

int cnn_pin_live(const cnn_backend *be) {
  int n = 0;
  pthread_mutex_lock(&reg_mu);
  for (int i = 0; i < PIN_ENTRIES; i++) n += reg[i].be == be;
  pthread_mutex_unlock(&reg_mu);
  return n;
}
