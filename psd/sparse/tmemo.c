/* tmemo.c - a connection's last pull of a table, for its push (tmemo.h). */
#include "tmemo.h"

#include <stdlib.h>
#include <string.h>

/* Buffers of more than this are dropped after a step that used less than
 * a TMEMO_SLACK-th of them: a one-off big pull does not pin its size. */
#define TMEMO_KEEP_MIN ((size_t)1 << 16) /* keys: 768 KiB */
#define TMEMO_SLACK 4

psd_tmemo *psd_tmemo_get(psd_tmemo **list, const void *owner, int create, uint64_t *held) {
  for (psd_tmemo *m = *list; m; m = m->next)
    if (m->owner == owner) return m;
  psd_tmemo *m = create ? calloc(1, sizeof *m) : NULL;
  if (!m) return NULL;
  m->owner = owner;
  m->next = *list;
  *list = m;
  *held += sizeof *m;
  return m;
}

/* Keys the memo holds once n more of req are in (0: too many). */
static size_t want_keys(const psd_tmemo *m, uint64_t req, size_t n) {
  size_t have = m->req == req && !m->bad ? m->n : 0;
  return n > PSD_TMEMO_MAX_KEYS - have ? 0 : have + n;
}

/* The room reserve gives for want keys (doubling, from 1024). */
static size_t cap_for(size_t cap, size_t want) {
  if (want <= cap) return cap;
  cap = cap ? cap : 1024;
  while (cap < want) cap = cap > PSD_TMEMO_MAX_KEYS / 2 ? PSD_TMEMO_MAX_KEYS : cap * 2;
  return cap;
}

uint64_t psd_tmemo_growth(const psd_tmemo *m, uint64_t req, size_t n) {
  return (uint64_t)(cap_for(m->cap, want_keys(m, req, n)) - m->cap) * PSD_TMEMO_KEY_BYTES;
}

static void release(psd_tmemo *m, uint64_t *held) {
  *held -= (uint64_t)m->cap * PSD_TMEMO_KEY_BYTES;
  free(m->keys);
  free(m->rows);
  m->keys = NULL;
  m->rows = NULL;
  m->cap = m->n = 0;
}

/* Room for want keys, the first m->n kept. 0, or -1 (m released). */
static int reserve(psd_tmemo *m, size_t want, uint64_t *held) {
  if (want <= m->cap) return 0;
  size_t cap = cap_for(m->cap, want);
  uint64_t *k = realloc(m->keys, cap * sizeof *k);
  if (k) m->keys = k;
  uint32_t *r = k ? realloc(m->rows, cap * sizeof *r) : NULL;
  if (r) m->rows = r;
  if (!k || !r) {
    /* what realloc kept is still m's: counted at m->cap, released whole */
    release(m, held);
    return -1;
  }
  *held += (uint64_t)(cap - m->cap) * PSD_TMEMO_KEY_BYTES;
  m->cap = cap;
  return 0;
}

uint32_t *psd_tmemo_add(psd_tmemo *m, uint64_t req, uint64_t epoch, const uint64_t *keys,
                        size_t n, uint64_t *held) {
  if (m->req != req) { /* a new pull: the last one's rows are of no use now */
    m->req = req;
    m->n = 0;
    m->epoch = epoch;
    m->bad = 0;
    m->clock = 0;
  }
  if (m->bad) return NULL;
  /* Each piece's keys were checked ascending; across pieces they must be
   * too, or the memo could hold a key twice (a push never does). */
  size_t want = want_keys(m, req, n);
  if (!want || (m->n && keys[0] <= m->keys[m->n - 1]) || reserve(m, want, held) != 0) {
    m->bad = 1;
    m->n = 0;
    return NULL;
  }
  memcpy(m->keys + m->n, keys, n * sizeof *keys);
  uint32_t *rows = m->rows + m->n;
  m->n = want;
  return rows;
}

void psd_tmemo_skip(psd_tmemo *m, uint64_t req, uint64_t *held) {
  release(m, held); /* refused for want of room: the room it held goes too */
  m->req = req;
  m->bad = 1;
}

const uint32_t *psd_tmemo_match(const psd_tmemo *m, const uint64_t *keys, size_t n,
                                uint64_t *epoch) {
  if (m->bad || m->n != n || n == 0 || memcmp(m->keys, keys, n * sizeof *keys) != 0)
    return NULL;
  *epoch = m->epoch;
  return m->rows;
}

const uint32_t *psd_tmemo_of_pull(const psd_tmemo *m, uint64_t req, size_t n, uint64_t *epoch) {
  if (m->bad || m->req != req || m->n != n || n == 0) return NULL;
  *epoch = m->epoch;
  return m->rows;
}

void psd_tmemo_touched(psd_tmemo *m, uint64_t before, uint64_t after, size_t n) {
  const int first = m->n == n; /* its first piece */
  m->clock = !m->bad && after - before == n && (first || before == m->clock) ? after : 0;
}

void psd_tmemo_clear(psd_tmemo *m, uint64_t *held) {
  if (m->cap > TMEMO_KEEP_MIN && m->cap / TMEMO_SLACK > m->n) release(m, held);
  m->n = 0;
  m->req = 0;
  m->clock = 0;
  m->bad = 1; /* until the next pull's first keys */
}

void psd_tmemo_forget(psd_tmemo **list, const void *owner, uint64_t *held) {
  for (psd_tmemo **pp = list; *pp;) {
    psd_tmemo *m = *pp;
    if (owner && m->owner != owner) {
      pp = &m->next;
      continue;
    }
    *pp = m->next;
    release(m, held);
    *held -= sizeof *m;
    free(m);
  }
}
