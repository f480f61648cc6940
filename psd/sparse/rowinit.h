/*
 * rowinit.h - the initializer of a sparse table's rows: a pure function of
 * (init kind, a, b, seed, table name, key, element), so every ps and every
 * worker computes the same values and a key never stored needs no storage.
 *
 * Each row is one splitmix64 stream, started from mix(seed ^ fnv1a(name))
 * ^ mix(key); element i takes the stream's next draws. Uniform values use
 * the top 24 bits of a draw (exactly a float), normals Box-Muller in double
 * (both values of a pair used), truncated normals redraw beyond 2 stddev:
 * the conventions of libpsclient's dense initializers (libpsclient/src/
 * init.c), whose code psd may not include, so the few lines of math are
 * written again here. Glorot kinds need fans a row does not have: the
 * spec check refuses them.
 */
#ifndef PSD_ROWINIT_H
#define PSD_ROWINIT_H

#include <stdint.h>

#include "tablespec.h"

/* The part of a row's seed shared by every key of the table:
 * mix(seed ^ fnv1a(name)). A table computes it once. */
uint64_t psd_rowinit_salt(const psd_table_spec *spec);

/* The initializer's values of key into out[spec->dim], given the table's
 * salt (psd_rowinit_row is this with the salt computed). */
void psd_rowinit_fill(const psd_table_spec *spec, uint64_t salt, uint64_t key, float *out);

/* The initializer's values of `key` into out[dim] (what a never-stored
 * key reads as). */
void psd_rowinit_row(const psd_table_spec *spec, uint64_t key, float *out);

#endif
