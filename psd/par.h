/*
 * par.h - fork-join over a range of a table's keys on psd's helper
 * threads: the loop thread works on the range with them and returns once
 * it is done, so nothing else of psd runs meanwhile and the chunks may
 * read anything the loop owns. Chunks must write disjoint memory.
 *
 * Why: a table step of 100k-1M keys is bound by the latency of random
 * index probes and row reads, one core's worth of misses in flight; a
 * second core (the worker waits for the reply meanwhile) doubles them.
 * Requests too small to pay for waking a thread run inline.
 */
#ifndef PSD_PAR_H
#define PSD_PAR_H

#include <stddef.h>

/* Most threads psd uses for one request (the loop thread included). */
#define PSD_PAR_MAX_THREADS 8u
/* Fewest items a chunk gets: below 2 of these a range runs inline (waking
 * a thread costs ~10-50 us, what ~4k keys take). */
#define PSD_PAR_MIN_PART 16384u

typedef struct psd_par psd_par;

/* One part: items [lo, hi) of the range. */
typedef void (*psd_par_fn)(void *ctx, size_t lo, size_t hi);

/* threads in all (the caller's included; 1: every range runs inline, no
 * thread started). 0, or an errno value: ENOMEM with *out NULL (ranges
 * then run inline), or pthread_create's with *out a pool of the threads
 * that did start (psd_par_threads says how many). */
int psd_par_create(unsigned threads, psd_par **out);
/* Ends and joins the helpers. NULL is a no-op. */
void psd_par_destroy(psd_par *p);
/* Threads in all (1 for NULL). */
unsigned psd_par_threads(const psd_par *p);
/* The chunks psd_par_run cuts n items into: n / PSD_PAR_MIN_PART, at most
 * a few per thread; 1 (0 for no items) when it runs them inline. */
size_t psd_par_chunks(const psd_par *p, size_t n);
/* Runs fn over [0, n) in psd_par_chunks(p, n) chunks, which the caller
 * and the helpers claim in turn, and returns when all are done: a helper
 * that is not running yet leaves its chunks to the others. NULL p:
 * inline. */
void psd_par_run(psd_par *p, size_t n, psd_par_fn fn, void *ctx);
/* 1 when v[0 .. rows * dim) holds no NaN and no infinity, scanned in
 * chunks of rows (a push's gradients: psd refuses it whole otherwise). */
int psd_par_all_finite(psd_par *p, const float *v, size_t rows, size_t dim);

#endif
