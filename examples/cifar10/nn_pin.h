/*
 * nn_pin.h - page-locked host ranges shared by the models of a process
 * (nn_pin.c), so that two models whose bound buffers share a page can both
 * be page-locked: a driver refuses to lock a page twice.
 */
#ifndef CIFAR_NN_PIN_H
#define CIFAR_NN_PIN_H

#include <stddef.h>
#include <stdint.h>

#include "nn_backend.h"

#define CNN_PIN_PAGE 4096u /* the granule of page-locking (x86-64, arm64 4K) */
#define CNN_PIN_HOLD 64    /* ranges one model can hold: each of its 20
                              merged ranges can run through an entry of
                              another model and the gaps between them */

/* A page-aligned host range [start, end). */
typedef struct cnn_pin_range {
  uintptr_t start, end;
} cnn_pin_range;

/* The registry entries one model holds a reference to. */
typedef struct cnn_pinset {
  int ref[CNN_PIN_HOLD]; /* registry entry indices, one per reference */
  int n;                 /* entries of ref */
  long own;              /* ranges registered for this set */
  long shared;           /* references to ranges registered before */
} cnn_pinset;

/* Rounds buffers (start, bytes) out to pages, sorts and merges them into
 * r (room for n entries); returns the number of merged ranges. */
int cnn_pin_merge(cnn_pin_range *r, int n);

/* Page-locks the n disjoint, sorted, page-aligned ranges r through
 * be->host_register, reusing (and counting a reference to) what another
 * set of the same backend has locked already, registering only the gaps.
 * 0, or -1 with a sentence in err (nothing held then). */
int cnn_pin_acquire(const cnn_backend *be, const cnn_pin_range *r, int n,
                    cnn_pinset *set, char *err, size_t errlen);

/* 1 if [p, p+bytes) lies inside one registered range of be (so a copy
 * from it is one DMA from page-locked memory). */
int cnn_pin_within_one(const cnn_backend *be, const void *p, size_t bytes);

/* 1 if a copy between [p, p+bytes) and the device may use the buffer
 * directly: it lies inside one registered range of be, or touches none.
 * A buffer partly in a registered range (the rest in another range or in
 * none) is refused by the driver (CUDA: cudaErrorInvalidValue, "memory
 * regions must be either entirely registered or not registered at all"):
 * such a copy must go through a page-locked stand-in. */
int cnn_pin_direct(const cnn_backend *be, const void *p, size_t bytes);

/* Drops the set's references; a range nobody references any more is
 * unregistered. */
void cnn_pin_release(const cnn_backend *be, cnn_pinset *set);

/* Ranges registered through this registry for be (for tests). */
int cnn_pin_live(const cnn_backend *be);

#endif
