/*
 * ctr_embed.h - where the CTR example's embedding rows live, three ways
 * behind one interface:
 *
 *  - table: a psd sparse table (ps_client_table_create): a step pulls the
 *    rows its batch touches (ps_table_pull, waiting for the step) and
 *    pushes their gradients with ps_client_step (ps_table_add_grad);
 *  - dense: a psd variable of rows x dim floats, pushed and pulled whole
 *    by every ps_client_step (what a framework without sparse tables
 *    does; the benchmark's baseline); keys must be row numbers < rows;
 *  - local: an in-process hash table with the same update rules (SGD,
 *    Adagrad), no psd (--local: the compute alone, and a reference).
 */
#ifndef CTR_EMBED_H
#define CTR_EMBED_H

#include <stddef.h>
#include <stdint.h>

#include "psclient.h"

typedef enum ctr_emb_kind { CTR_EMB_TABLE, CTR_EMB_DENSE, CTR_EMB_LOCAL } ctr_emb_kind;

typedef struct ctr_emb_opts {
  ctr_emb_kind kind;
  uint32_t dim;
  uint64_t capacity;  /* table: rows the whole table holds */
  uint64_t rows;      /* dense: rows of the variable */
  ps_table_opt opt;   /* table and local (local: SGD or Adagrad); dense: SGD
                         or Adam (PS_TOPT_ADAM) */
  double lr;
  double init_scale;  /* rows start uniform in [-scale, scale) */
  double l1, l2;      /* FTRL */
  uint64_t seed;
} ctr_emb_opts;

typedef struct ctr_emb ctr_emb;

/* Creates the embedding (c: the client; NULL for local). 0, or -1 with a
 * sentence in err. */
int ctr_emb_create(ps_client *c, const ctr_emb_opts *o, ctr_emb **out, char *err,
                   size_t errlen);
void ctr_emb_destroy(ctr_emb *e);

/* Rows of keys[0..n) at `step` (table: waits for the table's step; dense:
 * the values the last ps_client_step pulled) into out (n x dim). read_only:
 * evaluation (no rows created). 0 or a PS_E* code (the client's message). */
int ctr_emb_pull(ctr_emb *e, uint64_t step, const uint64_t *keys, size_t n, float *out,
                 int read_only);
/* Gradients of keys[0..n) (n x dim) for the coming ps_client_step (local:
 * for ctr_emb_local_step). */
int ctr_emb_add_grad(ctr_emb *e, const uint64_t *keys, size_t n, const float *grads);
/* After ps_client_step returned: dense clears the gradient rows it set. */
void ctr_emb_after_step(ctr_emb *e);
/* Local only: applies the added gradients (the update rule), clears them. */
void ctr_emb_local_step(ctr_emb *e);
/* Local only: rows stored. */
uint64_t ctr_emb_local_rows(const ctr_emb *e);

#endif /* CTR_EMBED_H */
