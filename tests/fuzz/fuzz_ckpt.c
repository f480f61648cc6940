/*
 * fuzz_ckpt - a checkpoint file from disk (psd/persist/checkpoint.c): psd reads
 * these at start, and a damaged or hostile file must be refused with a
 * sentence naming it, never crash psd or make it read out of bounds.
 *
 * The input is the whole file, checked against a fixed directory key and
 * run id (fuzz_dir below). Inputs that begin with "FIX" get the rest
 * wrapped into a valid header and trailer of the current format (magic,
 * version, the run id, the record counts from the fourth byte: slices in
 * its low 4 bits, tables in its high 4, a correct CRC-32C and HMAC-SHA-256
 * under the fixed key) so the fuzzer reaches the record parsers (slices
 * and tables) instead of stopping at the checksum or the MAC. Checked
 * beyond "no crash": a parse either fails with a message naming the file,
 * or yields records whose every byte lies inside the buffer and whose
 * lengths agree with the file size.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "persist/checkpoint.h"
#include "fuzz_server.h" /* LLVMFuzzerTestOneInput prototype */
#include "mac.h"
#include "optimizer.h"

#define CHECK(cond, ...)                                         \
  do {                                                           \
    if (!(cond)) {                                               \
      fprintf(stderr, "fuzz_ckpt: check failed: %s: ", #cond);   \
      fprintf(stderr, __VA_ARGS__);                              \
      fprintf(stderr, "\n");                                     \
      abort();                                                   \
    }                                                            \
  } while (0)

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* The directory every input is checked against: key bytes 0x5a, run id
 * bytes 0x11 (the corpus files were written with the same). */
static psd_ckptdir fuzz_dir(void) {
  psd_ckptdir d;
  psd_ckptdir_init(&d);
  memset(d.key, 0x5a, sizeof d.key);
  memset(d.run_id, 0x11, sizeof d.run_id);
  memset(d.run_hex, '1', 2 * PSD_CKPT_RUN_BYTES);
  return d;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  psd_ckptdir dir = fuzz_dir();
  psd_ckpt_image img;
  memset(&img, 0, sizeof img);
  snprintf(img.path, sizeof img.path, "fuzz.ckpt");
  if (size >= 4 && memcmp(data, "FIX", 3) == 0) {
    /* header (80) + body + trailer (48: magic, count, CRC, MAC) */
    size_t body = size - 4;
    img.len = 80 + body + PSD_CKPT_END_BYTES;
    img.buf = calloc(1, img.len);
    if (!img.buf) return 0;
    memcpy(img.buf, "PSDCKPT", 8);
    put32(img.buf + 8, PSD_CKPT_VERSION);
    put32(img.buf + 16, 1);
    put32(img.buf + 48, data[3] & 15u);
    put32(img.buf + 52, data[3] >> 4);
    memcpy(img.buf + 56, dir.run_id, PSD_CKPT_RUN_BYTES);
    memcpy(img.buf + 80, data + 4, body);
    uint8_t *t = img.buf + 80 + body;
    memcpy(t, "PSDCKEND", 8);
    put32(t + 8, (data[3] & 15u) + (data[3] >> 4));
    put32(t + 12, psd_ckpt_crc32c(0, img.buf, img.len - 36));
    ps__mac_part part = {img.buf, img.len - 32};
    if (ps__hmac(dir.key, sizeof dir.key, &part, 1, t + 16) != 0) abort();
  } else {
    img.len = size;
    img.buf = malloc(size ? size : 1);
    if (!img.buf) return 0;
    memcpy(img.buf, data, size);
  }
  const uint8_t *lo = img.buf, *hi = img.buf + img.len;
  char err[1600];
  err[0] = '\0';
  if (psd_ckpt_parse(&img, &dir, err, sizeof err) != 0) {
    CHECK(strstr(err, "fuzz.ckpt") != NULL, "error does not name the file: %s", err);
    CHECK(img.buf == NULL && img.recs == NULL, "a failed parse keeps memory");
    return 0;
  }
  uint64_t floats = 0;
  for (uint32_t i = 0; i < img.meta.nslices; i++) {
    const psd_ckpt_rec *r = &img.recs[i];
    const uint8_t *p = r->param;
    CHECK(p >= lo && p + r->length * 4 <= hi, "record %u's parameters leave the file", i);
    CHECK(r->state_per <= PSD_OPT_MAX_STATE && r->ndim >= 1 && r->ndim <= PS_MAX_DIMS,
          "record %u", i);
    CHECK((const uint8_t *)r->name >= lo && (const uint8_t *)r->name < hi &&
              strlen(r->name) <= PS_MAX_NAME,
          "record %u's name", i);
    if (r->state_per) {
      const uint8_t *s = r->state;
      CHECK(s >= lo && s + r->length * r->state_per * 4 <= hi, "record %u's state", i);
    }
    floats += r->length * (1 + r->state_per);
  }
  for (uint32_t i = 0; i < img.meta.ntables; i++) {
    const psd_ckpttable *t = &img.tables[i];
    uint64_t row = 16 + 4 * ((uint64_t)t->spec.dim + t->state_floats);
    CHECK(t->spec.dim >= 1 && t->nrows <= t->spec.capacity, "table %u", i);
    CHECK(t->aux >= lo && t->aux_len <= (uint64_t)(hi - t->aux), "table %u's aux", i);
    CHECK(t->rows >= lo && t->nrows * row <= (uint64_t)(hi - t->rows), "table %u's rows", i);
    CHECK(strlen(t->spec.name) >= 1 && strlen(t->spec.name) <= PS_MAX_NAME, "table %u", i);
    floats += t->nrows * row / 4;
  }
  CHECK(floats * 4 <= img.len, "more floats than bytes");
  psd_ckpt_image_free(&img);
  return 0;
}
