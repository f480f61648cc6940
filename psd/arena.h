/* arena.h - a bump allocator for protobuf-c unpacking, reset after every
 * frame, so a steady stream of frames allocates nothing. */
#ifndef PSD_ARENA_H
#define PSD_ARENA_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>

typedef struct psd_arena {
  char *buf;          /* main block (the caller allocates the first) */
  size_t cap, used;   /* its size and bytes handed out */
  void **extra;       /* overflow blocks until the next reset */
  size_t n_extra, cap_extra, extra_bytes;
  int failed;         /* an allocation failed since the reset */
} psd_arena;

/* protobuf-c's view of a: allocations come from it until its reset; a
 * failed one sets a->failed. */
ProtobufCAllocator psd_arena_allocator(psd_arena *a);
/* Forgets this frame's allocations; the main block grows to what the
 * frame needed (so a steady stream allocates nothing) up to keep bytes. */
void psd_arena_reset(psd_arena *a, size_t keep);
/* Frees everything it holds. */
void psd_arena_destroy(psd_arena *a);

#endif
