/*
 * ckptq.h - checkpoint files written on a thread of their own, so a slow
 * or stalled file system never stops psd from serving.
 *
 * The event loop queues work in order (begin a file, add a slice's record,
 * commit, abort); one writer thread does it: the writes, the CRC and MAC,
 * fsync, rename and pruning. A record is read from the slice's memory in
 * place, in chunks of PSD_CKPTQ_CHUNK bytes copied out under a lock, so no
 * copy of the model is made. Before the loop changes a slice whose record
 * is not yet written, psd_ckptq_release copies the part still to be
 * written: the loop waits at most for one chunk's copy, never for the
 * disk. Finished files come back as results the loop reads when
 * psd_ckptq_fd is readable.
 */
#ifndef PSD_CKPTQ_H
#define PSD_CKPTQ_H

#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"
#include "ckptdir.h"

/* Bytes the writer copies out of a slice per lock hold: small enough that
 * the loop never waits long for it (~0.1 ms), big enough for few writes. */
#define PSD_CKPTQ_CHUNK (1u << 20)
/* A failure's sentence: it names a path under the directory. */
#define PSD_CKPTQ_ERR (1200 + PSD_CKPT_PATH_MAX)

typedef struct psd_ckptq psd_ckptq;
typedef struct psd_ckptq_file psd_ckptq_file; /* one file on its way */
typedef struct psd_ckptq_rec psd_ckptq_rec;   /* a record still reading a slice */

/* What became of a file (psd_ckptq_next). */
typedef struct psd_ckptq_result {
  psd_ckptq_file *file;   /* which one: the handle psd_ckptq_begin gave (now invalid) */
  uint64_t step;          /* its checkpoint step */
  int ok;                 /* 1: committed (durable, renamed into place) */
  int aborted;            /* 1: dropped on request (not an error) */
  uint64_t bytes;         /* file size (ok) */
  double flush_ms;        /* trailer, fsync and rename (ok) */
  int pruned;             /* older files removed after it (ok) */
  uint64_t copy_bytes;    /* table records copied on the loop for it */
  uint64_t copy_cap;      /* ... the buffers they took (now spare) */
  double copy_ms;         /* ... the loop's time to copy them */
  uint64_t copy_faults;   /* ... and the page faults it took meanwhile */
  char path[PSD_CKPT_PATH_MAX + 96]; /* the file (ok) */
  char err[PSD_CKPTQ_ERR]; /* why it failed (!ok && !aborted) */
} psd_ckptq_result;

/* Starts the writer thread for files in d (not owned: it must outlive the
 * queue), pruning to `keep` complete checkpoints after each commit. 0, or
 * -1 with err. */
int psd_ckptq_create(psd_ckptq **out, const psd_ckptdir *d, uint32_t ps_index,
                     uint32_t num_ps, int keep, char *err, size_t errlen);
/* Finishes every queued job (commits commit, aborted files go) and ends
 * the thread; results and releases still work afterwards. Waits for the
 * disk. NULL is a no-op. */
void psd_ckptq_stop(psd_ckptq *q);
/* Stops it, then frees it with the results nobody read. Every hold must
 * have been released first (after psd_ckptq_stop that copies nothing).
 * NULL is a no-op. */
void psd_ckptq_destroy(psd_ckptq *q);
/* Readable while results wait (an eventfd). */
int psd_ckptq_fd(const psd_ckptq *q);

/* Queues a new file; NULL when out of memory. */
psd_ckptq_file *psd_ckptq_begin(psd_ckptq *q, const psd_ckpt_meta *m);
/* Queues r (its param and state are read in place until written). *hold
 * receives the record: the caller must psd_ckptq_release it before the
 * slice's memory changes or goes. 0, or -1 (out of memory: the file will
 * fail). */
int psd_ckptq_add(psd_ckptq *q, psd_ckptq_file *f, const psd_ckpt_rec *r, psd_ckptq_rec **hold);
/* Table records are encoded on the loop (psd_ckpttable_encode) into a
 * buffer the queue then owns, so nothing on the loop waits for the disk.
 * A fresh buffer's pages cost the loop a fault each (a 150 MB buffer can
 * cost more to fault in than to fill), so the loop should find one whose
 * pages are in already: each table (by its id, `tab`) keeps at most one
 * spare buffer. Once the writer has written a table's record into its
 * file (before the MAC and fsync), the buffer becomes that table's spare
 * (a smaller spare it had is freed there, off the loop), and the table's
 * next copy reuses it. Before a table's first checkpoint, or once it has
 * outgrown its spare, psd_ckptq_prepare has the writer map (or grow, by
 * mremap, keeping the pages it had) and fault in a buffer for it.
 * Table buffers are mapped (psd_ckptq_buf_new), never malloc'd.
 *
 * Table tab's spare when it has at least len bytes, taken out of the pool
 * (the caller owns it), with *cap its size; NULL otherwise. One being
 * prepared that will be big enough is handed over at once, mapped whole:
 * the writer stops faulting it in within one 4 MiB chunk (*waited:
 * seconds), and the caller's copy faults in the rest, so the caller never
 * waits on a writer the kernel is not running. */
uint8_t *psd_ckptq_spare(psd_ckptq *q, uint32_t tab, size_t len, size_t *cap,
                         double *waited);
/* The size of table tab's spare, or of the one being prepared for it; 0
 * when it has none. */
size_t psd_ckptq_ready(psd_ckptq *q, uint32_t tab);
/* 1 while the writer is preparing table tab's spare. */
int psd_ckptq_preparing(psd_ckptq *q, uint32_t tab);
/* Queues preparing a buffer of cap bytes for table tab, every page faulted
 * in, off the loop: its spare grown, or a new one. Its bytes count in
 * psd_ckptq_table_bytes from now. Nothing happens when the table's spare
 * is that big already or being prepared. 0, or -1 (out of memory). */
int psd_ckptq_prepare(psd_ckptq *q, uint32_t tab, size_t cap);
/* A table buffer of cap bytes, its pages faulted in (on the caller's
 * thread), or NULL; freed with psd_ckptq_buf_free. */
uint8_t *psd_ckptq_buf_new(size_t cap);
void psd_ckptq_buf_free(uint8_t *buf, size_t cap);
/* Bytes of the table buffers the queue holds now, on their way to the
 * disk, spare and being prepared (for --max-memory). */
uint64_t psd_ckptq_table_bytes(psd_ckptq *q);
/* Frees every spare (not those being prepared). */
void psd_ckptq_drop_spares(psd_ckptq *q);
/* Queues table tab's record: rec (cap bytes, from psd_ckptq_buf_new or
 * psd_ckptq_spare) holds it in its first len bytes. The queue owns rec from
 * now on. copy_ms (the loop's time to encode it), copy_faults (the page
 * faults the loop took meanwhile), len and cap are reported with f's
 * result. 0, or -1 (out of memory: rec is freed, the file will fail). */
int psd_ckptq_add_table(psd_ckptq *q, psd_ckptq_file *f, uint32_t tab, uint8_t *rec,
                        size_t cap, size_t len, double copy_ms, uint64_t copy_faults);
/* The slice behind a hold is about to change: copies what the writer has
 * not read yet and drops the hold. 0, or -1 (out of memory: the file will
 * fail, and the hold is dropped all the same). NULL is a no-op. */
int psd_ckptq_release(psd_ckptq *q, psd_ckptq_rec *hold);
/* Queues the trailer, fsync and rename (then pruning) of f. */
void psd_ckptq_commit(psd_ckptq *q, psd_ckptq_file *f);
/* Queues dropping f (its temporary file is removed). */
void psd_ckptq_abort(psd_ckptq *q, psd_ckptq_file *f);
/* Takes one finished file's result: 1, or 0 when none waits. */
int psd_ckptq_next(psd_ckptq *q, psd_ckptq_result *out);
/* Files begun and not yet finished by the writer. */
uint32_t psd_ckptq_busy(psd_ckptq *q);

#endif
