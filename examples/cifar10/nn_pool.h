/*
 * nn_pool.h - the CPU backend's worker threads: runs `nchunks` calls
 * fn(arg, chunk, tid) spread over the caller (tid 0) and threads-1 workers
 * (tid 1..threads-1), returning when all are done.
 *
 * Chunks are handed out one at a time; the job is finished when its chunks
 * are, not when every worker has checked in (unlike an OpenMP barrier), so
 * a worker that the OS has not scheduled (a busy, shared machine) does not
 * hold up an op: the caller runs more chunks itself. Only a chunk already
 * taken is waited for; the caller then sleeps, which lets the kernel move
 * a preempted worker onto its CPU. Idle workers spin ~0.4 ms, then sleep.
 * Calls from several threads are serialized (one job at a time).
 */
#ifndef CIFAR_NN_POOL_H
#define CIFAR_NN_POOL_H

typedef struct nn_pool nn_pool;
typedef void (*nn_pool_fn)(void *arg, int chunk, int tid);

/* threads >= 1 (1: no workers, everything runs in the caller); NULL on
 * failure. */
nn_pool *nn_pool_create(int threads);
void nn_pool_run(nn_pool *p, int nchunks, nn_pool_fn fn, void *arg);
void nn_pool_destroy(nn_pool *p); /* NULL ok */

#endif
