/*
 * checkpoint.h - checkpoint files: one per ps task and step, written
 * crash-safely, read back with every length and the checksum checked.
 *
 * Layout on disk (docs/checkpoint.md): DIR/step-<12 digits>/ps-<i>-of-<n>.ckpt,
 * every path relative to the verified directory (ckptdir.h); each file
 * carries the run id and ends with an HMAC-SHA-256 under the directory's key.
 * A step is a complete checkpoint when all n files are there (each appears
 * by an atomic rename), so a job killed while writing leaves the previous
 * complete checkpoint as the newest one. This module knows nothing of the
 * event loop: the server decides when each slice is captured.
 */
#ifndef PSD_CHECKPOINT_H
#define PSD_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "ckpttable.h"
#include "ckptdir.h"
#include "ps/errno.h"
#include "ps/types.h"

/* Format version written in every file. Version 3 added table records
 * (and their count in the header); readers also take version 2 (no
 * tables) and refuse the others (version 1 had no run id and no MAC:
 * refused with a sentence saying so). */
#define PSD_CKPT_VERSION 3
/* Trailer bytes: end magic (8), record count (4), CRC-32C (4), MAC (32). */
#define PSD_CKPT_END_BYTES 48

/* What a file says about the job that wrote it. */
typedef struct psd_ckpt_meta {
  uint32_t ps_index;    /* which ps task wrote it */
  uint32_t num_ps;      /* ps tasks in that job */
  uint32_t num_workers; /* workers in that job */
  uint32_t replicas;    /* gradients averaged per step */
  uint32_t async_mode;  /* 1: async training */
  uint64_t step;        /* global step of the checkpoint */
  uint32_t nslices;     /* slice records in the file */
  uint32_t ntables;     /* table records in the file (version 3) */
} psd_ckpt_meta;

/* One slice, as written or as read back. */
typedef struct psd_ckpt_rec {
  const char *name;            /* variable name (points into the image when read) */
  uint32_t ndim;               /* variable's rank */
  uint64_t shape[PS_MAX_DIMS]; /* variable's shape */
  uint64_t offset;             /* first element of the slice */
  uint64_t length;             /* elements in the slice */
  uint32_t opt_kind;           /* ps_opt_kind: the state layout depends on it */
  uint32_t state_per;          /* optimizer state floats per element (0-4) */
  uint64_t step;               /* the slice's step */
  const void *param;           /* length floats (unaligned when read back) */
  const void *state;           /* length * state_per floats, or NULL */
  int claimed;                 /* read back: matched to a registered slice */
} psd_ckpt_rec;

/* A checkpoint file being written: records go straight to a temporary file
 * as their slices are captured; commit makes it visible atomically. */
typedef struct psd_ckpt_writer {
  int fd;                          /* temporary file, -1 when idle */
  int sfd;                         /* its verified step directory, -1 when idle */
  char name[48];                   /* ps-i-of-n.ckpt (relative to sfd) */
  char tmpname[56];                /* ps-i-of-n.ckpt.tmp */
  const psd_ckptdir *d;            /* the directory: MAC key, run id (not owned) */
  char dir[PSD_CKPT_PATH_MAX + 32];  /* DIR/step-N */
  char path[PSD_CKPT_PATH_MAX + 96]; /* ... /ps-i-of-n.ckpt */
  char tmp[PSD_CKPT_PATH_MAX + 104]; /* ... /ps-i-of-n.ckpt.tmp */
  uint32_t crc;                    /* CRC-32C of everything written so far */
  uint64_t bytes;                  /* bytes written so far */
  uint32_t nslices;                /* slice records promised in the header */
  uint32_t written;                /* slice records written */
  uint32_t ntables;                /* table records promised */
  uint32_t tables_written;         /* table records written */
  uint64_t step;                   /* the checkpoint's step */
} psd_ckpt_writer;

/* A checkpoint file read into memory and checked. */
typedef struct psd_ckpt_image {
  char path[PSD_CKPT_PATH_MAX + 96]; /* the file it came from */
  psd_ckpt_meta meta;                /* its header */
  psd_ckpt_rec *recs;                /* meta.nslices records */
  psd_ckpttable *tables;             /* meta.ntables table records */
  uint8_t *buf;                      /* the whole file; recs point into it */
  size_t len;                        /* bytes in buf */
} psd_ckpt_image;

/* CRC-32C (Castagnoli) of buf, continuing from crc (0 to start). */
uint32_t psd_ckpt_crc32c(uint32_t crc, const void *buf, size_t len);

/* Creates DIR/step-N (0700, verified ours) and its temporary file
 * (O_EXCL|O_NOFOLLOW, after removing a leftover of ours) and writes the
 * header. 0, or -1 with a sentence naming the path in err. */
int psd_ckpt_begin(psd_ckpt_writer *w, const psd_ckptdir *d, const psd_ckpt_meta *m,
                   char *err, size_t errlen);
/* Appends one record. 0 or -1 (err). */
int psd_ckpt_add(psd_ckpt_writer *w, const psd_ckpt_rec *r, char *err, size_t errlen);
/* The same in pieces, for a writer that copies the data out in chunks
 * (ckptq.c): the record's header (r->param and r->state are not read),
 * then exactly length * (1 + state_per) floats through psd_ckpt_append. */
int psd_ckpt_add_header(psd_ckpt_writer *w, const psd_ckpt_rec *r, char *err, size_t errlen);
int psd_ckpt_append(psd_ckpt_writer *w, const void *buf, size_t len, char *err,
                    size_t errlen);
/* Appends one table record, already encoded (psd_ckpttable_encode: len
 * bytes starting with its magic). 0 or -1 (err). */
int psd_ckpt_add_table(psd_ckpt_writer *w, const void *rec, size_t len, char *err,
                       size_t errlen);
/* Writes the trailer (CRC, then the MAC over the whole file), fsyncs,
 * renames into place (renameat in the step directory) and fsyncs it.
 * Every promised record must have been added. 0 or -1 (err; the
 * temporary file is removed). */
int psd_ckpt_commit(psd_ckpt_writer *w, char *err, size_t errlen);
/* Drops an unfinished file. Safe on an idle writer. */
void psd_ckpt_abort(psd_ckpt_writer *w);
/* 1 while a file is open. */
static inline int psd_ckpt_active(const psd_ckpt_writer *w) { return w->fd >= 0; }
/* An idle writer. */
void psd_ckpt_writer_init(psd_ckpt_writer *w);

/* Reads and checks one file (not a symlink, ours; magic, version,
 * checksum, MAC under d's key, d's run id, every length; at most max_bytes
 * of it). 0, or -1 with a sentence naming the file and the problem in err. */
int psd_ckpt_read(const psd_ckptdir *d, const char *path, uint64_t max_bytes,
                  psd_ckpt_image *img, char *err, size_t errlen);
/* Checks and indexes img->buf (img->len bytes, malloc'd; img->path names
 * it in messages) against d's key and run id (d->fd is not used): what
 * psd_ckpt_read does once the file is in memory. 0, or -1 with err (img is
 * then freed, buf included). */
int psd_ckpt_parse(psd_ckpt_image *img, const psd_ckptdir *d, char *err, size_t errlen);
void psd_ckpt_image_free(psd_ckpt_image *img);

/* Finds the checkpoint this ps restores from: the newest step for which all
 * num_ps files exist. Its own file must read back and match (ps index and
 * count); if it does not, that is an error unless `fallback`, which tries
 * older complete steps whose files all read back (so every ps lands on the
 * same step). Returns 1 with *img, 0 when there is none (err then holds a
 * warning if this ps has files but no step is complete: "" otherwise), or
 * -1 with a sentence in err (a damaged or mismatched checkpoint, or a
 * directory that holds only checkpoints of a different ps count). */
int psd_ckpt_find(const psd_ckptdir *d, uint32_t ps_index, uint32_t num_ps, int fallback,
                  uint64_t max_bytes, psd_ckpt_image *img, char *err, size_t errlen);

/* Removes this ps's files (and then empty step directories) of the steps
 * older than the keep-th newest complete checkpoint, plus its leftover
 * temporary files; its part of the newest complete checkpoints always
 * stays. Returns how many files it removed. */
int psd_ckpt_prune(const psd_ckptdir *d, uint32_t ps_index, uint32_t num_ps, int keep);

#endif
