/*
 * ckpttable.h - a sparse table's record in a checkpoint file
 * (docs/checkpoint.md, "Table records"): its spec, step, counters, the
 * admission state (table.h's aux bytes) and every stored row in LRU order,
 * oldest first.
 *
 * Writing: psd_ckpttable_encode serializes a table into one buffer on the
 * event loop, at the moment the table holds the checkpoint's step (rows
 * change on pulls too, so the table cannot be read in place later); the
 * checkpoint writer thread (ckptq.c) writes the buffer and keeps it for
 * the table's next copy.
 * Reading: psd_ckpttable_parse checks every length against the bytes
 * that are left before anything points into them; psd_ckpttable_restore
 * fills a table just created with the same spec.
 */
#ifndef PSD_CKPTTABLE_H
#define PSD_CKPTTABLE_H

#include <stddef.h>
#include <stdint.h>

#include "sparse/table.h"

/* A table record's first 4 bytes. */
#define PSD_CKPTTABLE_MAGIC "TABL"
/* Fewest bytes a table record takes (a one-byte name, no aux, no rows). */
#define PSD_CKPTTABLE_MIN_BYTES 245u

/* One table record, as read back (pointers into the file's buffer). */
typedef struct psd_ckpttable {
  psd_table_spec spec;      /* as this ps held it (capacity: this ps's) */
  uint64_t step;            /* the table's step */
  psd_table_stats counters; /* its counters when captured */
  uint32_t state_floats;    /* optimizer state floats per row */
  const uint8_t *aux;       /* aux_len bytes of admission state */
  uint64_t aux_len;
  const uint8_t *rows;      /* nrows rows, oldest first: key (8), last-touch
                               step (8), dim floats, state_floats floats */
  uint64_t nrows;
  int claimed;              /* restored into a registered table */
} psd_ckpttable;

/* Bytes t's record takes (what psd_ckpttable_encode writes); 0 if it
 * would not fit in a size_t. */
size_t psd_ckpttable_size(const psd_table *t);
/* ... and when it holds as many rows as its capacity allows: the most it
 * can take (the admission state's size is fixed by the spec). */
size_t psd_ckpttable_max_size(const psd_table *t);
/* Writes t's record into buf (size: psd_ckpttable_size(t) bytes). Rows
 * must not change meanwhile (the event loop's thread). 0, or -1 if the
 * rows walked do not match the table's row count (nothing is written past
 * buf + size). */
int psd_ckpttable_encode(const psd_table *t, uint8_t *buf, size_t size);

/* Parses the record at b (avail bytes left, starting at its magic): 0 with
 * *out and *used (the record's bytes), or -1 with a sentence in msg. No
 * pointer in *out leaves b[0..avail). */
int psd_ckpttable_parse(const uint8_t *b, size_t avail, psd_ckpttable *out, size_t *used,
                        char *msg, size_t msglen);

/* Fills t (just created, empty, at step 0, from a spec psd_tablespec_diff
 * finds equal to rec's) with rec's admission state, rows (in their order,
 * which rebuilds the LRU order), step and counters. 0, or a PS_E* code
 * with a sentence in err (t is then half filled: the caller destroys it). */
int psd_ckpttable_restore(const psd_ckpttable *rec, psd_table *t, char *err, size_t errlen);

#endif
