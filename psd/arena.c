/* arena.c - the bump allocator a connection unpacks protobuf into
 * (arena.h). */
#include "arena.h"

#include <stdlib.h>

static void *arena_alloc(void *ud, size_t size) {
  psd_arena *a = ud;
  size = (size + 15) & ~(size_t)15;
  if (a->used + size <= a->cap) {
    void *p = a->buf + a->used;
    a->used += size;
    return p;
  }
  if (a->n_extra == a->cap_extra) {
    size_t nc = a->cap_extra ? a->cap_extra * 2 : 16;
    void **ne = realloc(a->extra, nc * sizeof *ne);
    if (!ne) {
      a->failed = 1;
      return NULL;
    }
    a->extra = ne;
    a->cap_extra = nc;
  }
  void *p = malloc(size);
  if (!p) {
    a->failed = 1;
    return NULL;
  }
  a->extra[a->n_extra++] = p;
  a->extra_bytes += size;
  return p;
}

static void arena_free(void *ud, void *p) {
  (void)ud;
  (void)p; /* released at reset */
}

void psd_arena_reset(psd_arena *a, size_t keep) {
  if (a->n_extra && a->cap == 0) {
    /* Not set up yet (before the handshake): no main block to grow. */
    for (size_t i = 0; i < a->n_extra; i++) free(a->extra[i]);
    a->n_extra = 0;
    a->extra_bytes = 0;
  } else if (a->n_extra || a->cap > keep) {
    for (size_t i = 0; i < a->n_extra; i++) free(a->extra[i]);
    size_t ncap = (a->cap + a->extra_bytes) * 2;
    if (ncap > keep) ncap = keep;
    char *nb = malloc(ncap);
    if (nb) {
      free(a->buf);
      a->buf = nb;
      a->cap = ncap;
    }
    a->n_extra = 0;
    a->extra_bytes = 0;
  }
  if (a->cap_extra > 16) { /* the overflow list too goes back to small */
    free(a->extra);
    a->extra = NULL;
    a->cap_extra = 0;
  }
  a->used = 0;
  a->failed = 0;
}

void psd_arena_destroy(psd_arena *a) {
  psd_arena_reset(a, 0);
  free(a->buf);
  free(a->extra);
}

ProtobufCAllocator psd_arena_allocator(psd_arena *a) {
  return (ProtobufCAllocator){.alloc = arena_alloc, .free = arena_free, .allocator_data = a};
}
