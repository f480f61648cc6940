/*
 * fuzz_ckpt - a checkpoint file from disk (psd/checkpoint.c): psd reads
 * these at start, and a damaged or hostile file must be refused with a
 * sentence naming it, never crash psd or make it read out of bounds.
 *
 * The input is the whole file. Inputs that begin with "FIX" get the rest
 * wrapped into a valid header and trailer (magic, version, the record
 * count from the first byte, a correct CRC-32C) so the fuzzer reaches the
 * record parser instead of stopping at the checksum. Checked beyond "no
 * crash": a parse either fails with a message naming the file, or yields
 * records whose every byte lies inside the buffer and whose lengths agree
 * with the file size.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "fuzz_server.h" /* LLVMFuzzerTestOneInput prototype */

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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  psd_ckpt_image img;
  memset(&img, 0, sizeof img);
  snprintf(img.path, sizeof img.path, "fuzz.ckpt");
  if (size >= 4 && memcmp(data, "FIX", 3) == 0) {
    /* header (64) + body + trailer (16) */
    size_t body = size - 4;
    img.len = 64 + body + 16;
    img.buf = calloc(1, img.len);
    if (!img.buf) return 0;
    memcpy(img.buf, "PSDCKPT", 8);
    put32(img.buf + 8, PSD_CKPT_VERSION);
    put32(img.buf + 16, 1);
    put32(img.buf + 48, data[3]);
    memcpy(img.buf + 64, data + 4, body);
    uint8_t *t = img.buf + 64 + body;
    memcpy(t, "PSDCKEND", 8);
    put32(t + 8, data[3]);
    put32(t + 12, psd_crc32c(0, img.buf, img.len - 4));
  } else {
    img.len = size;
    img.buf = malloc(size ? size : 1);
    if (!img.buf) return 0;
    memcpy(img.buf, data, size);
  }
  const uint8_t *lo = img.buf, *hi = img.buf + img.len;
  char err[1600];
  err[0] = '\0';
  if (psd_ckpt_parse(&img, err, sizeof err) != 0) {
    CHECK(strstr(err, "fuzz.ckpt") != NULL, "error does not name the file: %s", err);
    CHECK(img.buf == NULL && img.recs == NULL, "a failed parse keeps memory");
    return 0;
  }
  uint64_t floats = 0;
  for (uint32_t i = 0; i < img.meta.nslices; i++) {
    const psd_ckpt_rec *r = &img.recs[i];
    const uint8_t *p = r->param;
    CHECK(p >= lo && p + r->length * 4 <= hi, "record %u's parameters leave the file", i);
    CHECK(r->state_per <= 2 && r->ndim >= 1 && r->ndim <= PS_MAX_DIMS, "record %u", i);
    CHECK((const uint8_t *)r->name >= lo && (const uint8_t *)r->name < hi &&
              strlen(r->name) <= PS_MAX_NAME,
          "record %u's name", i);
    if (r->state_per) {
      const uint8_t *s = r->state;
      CHECK(s >= lo && s + r->length * r->state_per * 4 <= hi, "record %u's state", i);
    }
    floats += r->length * (1 + r->state_per);
  }
  CHECK(floats * 4 <= img.len, "more floats than bytes");
  psd_ckpt_image_free(&img);
  return 0;
}
