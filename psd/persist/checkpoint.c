/* checkpoint.c - writing, reading, finding and pruning checkpoint files. */
#define _GNU_SOURCE
#include "checkpoint.h"
#include "optimizer.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "mac.h"
#include "wire.h"

/* File magics: the header's first 8 bytes, each record's first 4 and the
 * trailer's first 8, so a truncated or shifted file fails loudly. */
static const char HDR_MAGIC[8] = {'P', 'S', 'D', 'C', 'K', 'P', 'T', 0};
static const char REC_MAGIC[4] = {'S', 'L', 'I', 'C'};
static const char END_MAGIC[8] = {'P', 'S', 'D', 'C', 'K', 'E', 'N', 'D'};
/* Fixed header size: room for fields added by later versions. */
#define HDR_SIZE 80
/* Where the header holds the run id (PSD_CKPT_RUN_BYTES). */
#define HDR_RUN_AT 56
/* Trailer: magic, record count, CRC-32C of every byte before the CRC,
 * HMAC-SHA-256 of every byte before the MAC. */
#define END_SIZE PSD_CKPT_END_BYTES
/* Most step directories one scan considers; more is certainly a mistake. */
#define CKPT_MAX_STEPS 100000

/* ---- CRC-32C ------------------------------------------------------------ */

static uint32_t crc_table[8][256];

static void crc_init_table(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
    crc_table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

/* Slicing-by-8 in software: about 1 GB/s, enough next to disk writes. */
static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
  static int ready;
  if (!ready) {
    crc_init_table();
    ready = 1;
  }
  while (n && ((uintptr_t)p & 7)) {
    crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
    n--;
  }
  while (n >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    v ^= crc;
    crc = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
          crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
          crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
          crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
  return crc;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* SSE 4.2 has a CRC-32C instruction: ~10x the table. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p,
                                                         size_t n) {
  uint64_t c = crc;
  while (n && ((uintptr_t)p & 7)) {
    c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    n--;
  }
  while (n >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  while (n--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
  return (uint32_t)c;
}
#endif

uint32_t psd_ckpt_crc32c(uint32_t crc, const void *buf, size_t len) {
  crc = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("sse4.2")) return ~crc_hw(crc, buf, len);
#endif
  return ~crc_sw(crc, buf, len);
}

/* ---- little-endian encoding ---------------------------------------------- */

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* ---- writing ------------------------------------------------------------ */

void psd_ckpt_writer_init(psd_ckpt_writer *w) {
  memset(w, 0, sizeof *w);
  w->fd = -1;
  w->sfd = -1;
}

static int wr(psd_ckpt_writer *w, const void *buf, size_t len, char *err, size_t errlen) {
  const uint8_t *p = buf;
  w->crc = psd_ckpt_crc32c(w->crc, buf, len);
  w->bytes += len;
  while (len) {
    ssize_t n = write(w->fd, p, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      snprintf(err, errlen, "cannot write checkpoint %s: %s", w->tmp,
               n < 0 ? strerror(errno) : "short write");
      return -1;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* Names the files of a step and opens (creating it) the verified step
 * directory. 0 or -1 with err. */
static int open_step(psd_ckpt_writer *w, const psd_ckptdir *d, const psd_ckpt_meta *m,
                     char *err, size_t errlen) {
  char step[28]; /* "step-" and at most 20 digits */
  snprintf(step, sizeof step, "step-%012" PRIu64, m->step);
  snprintf(w->dir, sizeof w->dir, "%s/%s", d->path, step);
  snprintf(w->name, sizeof w->name, "ps-%u-of-%u.ckpt", m->ps_index, m->num_ps);
  snprintf(w->tmpname, sizeof w->tmpname, "%s.tmp", w->name);
  snprintf(w->path, sizeof w->path, "%s/%s", w->dir, w->name);
  snprintf(w->tmp, sizeof w->tmp, "%s/%s", w->dir, w->tmpname);
  w->sfd = psd_ckptdir_subdir(d, step, 1, err, errlen);
  if (w->sfd < 0) {
    w->sfd = -1;
    return -1;
  }
  /* The new directory entry must survive a crash too. */
  fsync(d->fd);
  return 0;
}

int psd_ckpt_begin(psd_ckpt_writer *w, const psd_ckptdir *d, const psd_ckpt_meta *m,
                   char *err, size_t errlen) {
  psd_ckpt_writer_init(w);
  w->d = d;
  if (open_step(w, d, m, err, errlen) != 0) return -1;
  /* A leftover temporary of ours goes first; anything else there (another
   * user's file or symlink) is refused, and O_EXCL|O_NOFOLLOW never writes
   * through a name that reappeared in between. */
  if (psd_ckptdir_unlink_own(w->sfd, w->tmpname, w->tmp, err, errlen) != 0) {
    psd_ckpt_abort(w);
    return -1;
  }
  w->fd = openat(w->sfd, w->tmpname, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (w->fd < 0) {
    snprintf(err, errlen, "cannot create checkpoint %s: %s", w->tmp, strerror(errno));
    psd_ckpt_abort(w);
    return -1;
  }
  uint8_t h[HDR_SIZE] = {0};
  memcpy(h, HDR_MAGIC, 8);
  put32(h + 8, PSD_CKPT_VERSION);
  put32(h + 12, m->ps_index);
  put32(h + 16, m->num_ps);
  put32(h + 20, m->num_workers);
  put32(h + 24, m->replicas);
  put32(h + 28, m->async_mode);
  put64(h + 32, m->step);
  put64(h + 40, (uint64_t)time(NULL));
  put32(h + 48, m->nslices);
  put32(h + 52, m->ntables);
  memcpy(h + HDR_RUN_AT, d->run_id, PSD_CKPT_RUN_BYTES);
  w->nslices = m->nslices;
  w->ntables = m->ntables;
  w->step = m->step;
  if (wr(w, h, sizeof h, err, errlen) != 0) {
    psd_ckpt_abort(w);
    return -1;
  }
  return 0;
}

int psd_ckpt_add_header(psd_ckpt_writer *w, const psd_ckpt_rec *r, char *err, size_t errlen) {
  if (w->written >= w->nslices) {
    snprintf(err, errlen, "checkpoint %s: more slices than the %u promised", w->tmp,
             w->nslices);
    return -1;
  }
  size_t nlen = strlen(r->name);
  uint8_t h[4 + 4 + PS_MAX_NAME + 4 + 8 * PS_MAX_DIMS + 8 + 8 + 4 + 4 + 8];
  if (nlen > PS_MAX_NAME || r->ndim > PS_MAX_DIMS || r->state_per > PSD_OPT_MAX_STATE) {
    snprintf(err, errlen, "checkpoint %s: slice '%s' cannot be recorded", w->tmp,
             PS__ESC(r->name));
    return -1;
  }
  size_t o = 0;
  memcpy(h, REC_MAGIC, 4);
  o += 4;
  put32(h + o, (uint32_t)nlen);
  o += 4;
  memcpy(h + o, r->name, nlen);
  o += nlen;
  put32(h + o, r->ndim);
  o += 4;
  for (uint32_t d = 0; d < r->ndim; d++, o += 8) put64(h + o, r->shape[d]);
  put64(h + o, r->offset);
  o += 8;
  put64(h + o, r->length);
  o += 8;
  put32(h + o, r->opt_kind);
  o += 4;
  put32(h + o, r->state_per);
  o += 4;
  put64(h + o, r->step);
  o += 8;
  if (wr(w, h, o, err, errlen) != 0) return -1;
  w->written++;
  return 0;
}

int psd_ckpt_append(psd_ckpt_writer *w, const void *buf, size_t len, char *err,
                    size_t errlen) {
  return wr(w, buf, len, err, errlen);
}

int psd_ckpt_add_table(psd_ckpt_writer *w, const void *rec, size_t len, char *err,
                       size_t errlen) {
  if (w->tables_written >= w->ntables || len < PSD_CKPTTABLE_MIN_BYTES ||
      memcmp(rec, PSD_CKPTTABLE_MAGIC, 4) != 0) {
    snprintf(err, errlen, "checkpoint %s: a table record past the %u promised, or not one",
             w->tmp, w->ntables);
    return -1;
  }
  if (wr(w, rec, len, err, errlen) != 0) return -1;
  w->tables_written++;
  return 0;
}

int psd_ckpt_add(psd_ckpt_writer *w, const psd_ckpt_rec *r, char *err, size_t errlen) {
  if (psd_ckpt_add_header(w, r, err, errlen) != 0 ||
      wr(w, r->param, r->length * sizeof(float), err, errlen) != 0 ||
      (r->state_per &&
       wr(w, r->state, r->length * r->state_per * sizeof(float), err, errlen) != 0))
    return -1;
  return 0;
}

/* The MAC of everything written so far (read back through a mapping of
 * the file: the records were streamed out, never held in memory). */
static int file_mac(psd_ckpt_writer *w, uint8_t mac[PS__MAC_BYTES], char *err, size_t errlen) {
  void *map = mmap(NULL, (size_t)w->bytes, PROT_READ, MAP_SHARED, w->fd, 0);
  if (map == MAP_FAILED) {
    snprintf(err, errlen, "cannot map checkpoint %s to sign it: %s", w->tmp, strerror(errno));
    return -1;
  }
  ps__mac_part part = {map, (size_t)w->bytes};
  int rc = ps__hmac(w->d->key, sizeof w->d->key, &part, 1, mac);
  munmap(map, (size_t)w->bytes);
  if (rc != 0) snprintf(err, errlen, "cannot sign checkpoint %s", w->tmp);
  return rc ? -1 : 0;
}

/* Trailer: magic, count, CRC, MAC. 0 or -1 with err. */
static int write_trailer(psd_ckpt_writer *w, char *err, size_t errlen) {
  uint8_t t[END_SIZE];
  memcpy(t, END_MAGIC, 8);
  put32(t + 8, w->nslices + w->ntables);
  if (wr(w, t, 12, err, errlen) != 0) return -1;
  put32(t + 12, w->crc);
  if (wr(w, t + 12, 4, err, errlen) != 0 || file_mac(w, t + 16, err, errlen) != 0)
    return -1;
  return wr(w, t + 16, PS__MAC_BYTES, err, errlen);
}

int psd_ckpt_commit(psd_ckpt_writer *w, char *err, size_t errlen) {
  if (w->written != w->nslices || w->tables_written != w->ntables) {
    snprintf(err, errlen, "checkpoint %s: %u of %u slices and %u of %u tables written", w->tmp,
             w->written, w->nslices, w->tables_written, w->ntables);
    psd_ckpt_abort(w);
    return -1;
  }
  if (write_trailer(w, err, errlen) != 0) {
    psd_ckpt_abort(w);
    return -1;
  }
  if (fsync(w->fd) != 0) {
    snprintf(err, errlen, "cannot flush checkpoint %s to disk: %s", w->tmp, strerror(errno));
    psd_ckpt_abort(w);
    return -1;
  }
  close(w->fd);
  w->fd = -1;
  int rc = 0;
  if (renameat(w->sfd, w->tmpname, w->sfd, w->name) != 0) {
    snprintf(err, errlen, "cannot rename checkpoint %s into place: %s", w->tmp,
             strerror(errno));
    unlinkat(w->sfd, w->tmpname, 0);
    rc = -1;
  } else if (fsync(w->sfd) != 0) {
    snprintf(err, errlen, "cannot flush checkpoint directory %s: %s", w->dir, strerror(errno));
    rc = -1;
  }
  close(w->sfd);
  w->sfd = -1;
  return rc;
}

void psd_ckpt_abort(psd_ckpt_writer *w) {
  if (w->fd >= 0) {
    close(w->fd);
    unlinkat(w->sfd, w->tmpname, 0);
  }
  if (w->sfd >= 0) close(w->sfd);
  w->fd = -1;
  w->sfd = -1;
}

/* ---- reading ------------------------------------------------------------ */

__attribute__((format(printf, 4, 5))) static int bad(psd_ckpt_image *img, char *err,
                                                     size_t errlen, const char *fmt, ...) {
  char msg[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  snprintf(err, errlen, "checkpoint %s is unusable: %s", img->path, msg);
  psd_ckpt_image_free(img);
  return -1;
}

/* Reads an open file into img and checks it (fd is closed). */
static int read_fd(int fd, const psd_ckptdir *d, uint64_t max_bytes, psd_ckpt_image *img,
                   char *err, size_t errlen) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return bad(img, err, errlen, "not a regular file");
  }
  if (st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH))) {
    close(fd);
    return bad(img, err, errlen, "owned by uid %u with mode %04o, not a file only this user "
               "(uid %u) can write: refusing it (planted?)", (unsigned)st.st_uid,
               (unsigned)(st.st_mode & 07777), (unsigned)geteuid());
  }
  if (st.st_size < HDR_SIZE + END_SIZE) {
    close(fd);
    return bad(img, err, errlen, "only %lld bytes (truncated)", (long long)st.st_size);
  }
  if ((uint64_t)st.st_size > max_bytes) {
    close(fd);
    return bad(img, err, errlen, "%lld bytes is more than this server may hold (%" PRIu64 ")",
               (long long)st.st_size, max_bytes);
  }
  img->len = (size_t)st.st_size;
  img->buf = malloc(img->len);
  if (!img->buf) {
    close(fd);
    return bad(img, err, errlen, "out of memory for %zu bytes", img->len);
  }
  size_t got = 0;
  while (got < img->len) {
    ssize_t n = read(fd, img->buf + got, img->len - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close(fd);
      return bad(img, err, errlen, "read failed: %s", n < 0 ? strerror(errno) : "short file");
    }
    got += (size_t)n;
  }
  close(fd);
  return psd_ckpt_parse(img, d, err, errlen);
}

/* Reads dfd/name (label names it in messages), never through a symlink. */
static int read_at(const psd_ckptdir *d, int dfd, const char *name, const char *label,
                   uint64_t max_bytes, psd_ckpt_image *img, char *err, size_t errlen) {
  memset(img, 0, sizeof *img);
  snprintf(img->path, sizeof img->path, "%s", label);
  int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return bad(img, err, errlen, "cannot open it: %s%s", strerror(errno),
               errno == ELOOP ? " (a symlink: refusing it)" : "");
  return read_fd(fd, d, max_bytes, img, err, errlen);
}

int psd_ckpt_read(const psd_ckptdir *d, const char *path, uint64_t max_bytes,
                  psd_ckpt_image *img, char *err, size_t errlen) {
  return read_at(d, AT_FDCWD, path, path, max_bytes, img, err, errlen);
}

static void hex(const uint8_t *b, size_t n, char *out) {
  static const char digits[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = digits[b[i] >> 4];
    out[2 * i + 1] = digits[b[i] & 15];
  }
  out[2 * n] = '\0';
}

/* Magic, version, end marker, CRC, MAC and run id: whether the file is
 * whole, ours and of this run. 0 or -1 (bad() was called). */
static int check_envelope(psd_ckpt_image *img, const psd_ckptdir *d, char *err,
                          size_t errlen) {
  const uint8_t *b = img->buf;
  if (img->len < HDR_SIZE + END_SIZE)
    return bad(img, err, errlen, "only %zu bytes (truncated)", img->len);
  if (memcmp(b, HDR_MAGIC, 8) != 0) return bad(img, err, errlen, "not a psd checkpoint");
  if (get32(b + 8) == 1)
    return bad(img, err, errlen, "format version 1, written by an older psd without a run id "
               "and a MAC; this psd reads versions 2 and %d only (start with --restore=none to "
               "move it aside and start afresh)", PSD_CKPT_VERSION);
  if (get32(b + 8) != 2 && get32(b + 8) != PSD_CKPT_VERSION)
    return bad(img, err, errlen, "format version %u, this psd reads versions 2 and %d",
               get32(b + 8), PSD_CKPT_VERSION);
  const uint8_t *t = b + img->len - END_SIZE;
  if (memcmp(t, END_MAGIC, 8) != 0)
    return bad(img, err, errlen, "no end marker (truncated or not finished)");
  uint32_t crc = psd_ckpt_crc32c(0, b, img->len - END_SIZE + 12);
  if (crc != get32(t + 12))
    return bad(img, err, errlen, "checksum mismatch (stored %08x, computed %08x): damaged",
               get32(t + 12), crc);
  uint8_t mac[PS__MAC_BYTES];
  ps__mac_part part = {b, img->len - PS__MAC_BYTES};
  if (ps__hmac(d->key, sizeof d->key, &part, 1, mac) != 0)
    return bad(img, err, errlen, "cannot compute its MAC");
  if (!ps__mac_equal(mac, t + 16, PS__MAC_BYTES))
    return bad(img, err, errlen, "MAC mismatch: not written with this directory's key "
               "(planted, or copied from another checkpoint directory)");
  if (memcmp(b + HDR_RUN_AT, d->run_id, PSD_CKPT_RUN_BYTES) != 0) {
    char other[2 * PSD_CKPT_RUN_BYTES + 1];
    hex(b + HDR_RUN_AT, PSD_CKPT_RUN_BYTES, other);
    return bad(img, err, errlen, "it belongs to run %s, this directory's run is %s", other,
               d->run_hex);
  }
  return 0;
}

/* Slice record i at *o (its magic checked): fills img->recs[i] and moves
 * *o past it. 0, or -1 (bad() was called). */
static int parse_slice(psd_ckpt_image *img, size_t *at, size_t end, uint32_t i, char *err,
                       size_t errlen) {
  const uint8_t *b = img->buf;
  psd_ckpt_rec *r = &img->recs[i];
  size_t o = *at;
  if (end - o < 8) return bad(img, err, errlen, "slice record %u is missing or malformed", i);
  uint32_t nlen = get32(b + o + 4);
  o += 8;
  if (nlen == 0 || nlen > PS_MAX_NAME || end - o < nlen + 4)
    return bad(img, err, errlen, "slice record %u has a bad name length %u", i, nlen);
  /* Names are stored without a NUL: move each 4 bytes back, over its
   * (already read) length field, to make room for one. */
  memmove(img->buf + o - 4, b + o, nlen);
  img->buf[o - 4 + nlen] = '\0';
  r->name = (const char *)img->buf + o - 4;
  o += nlen;
  r->ndim = get32(b + o);
  o += 4;
  if (r->ndim < 1 || r->ndim > PS_MAX_DIMS || end - o < 8ull * r->ndim + 36)
    return bad(img, err, errlen, "slice '%s' has %u dimensions", PS__ESC(r->name),
               r->ndim);
  uint64_t numel = 1;
  for (uint32_t k = 0; k < r->ndim; k++, o += 8) {
    r->shape[k] = get64(b + o);
    if (r->shape[k] == 0 || ps__mul_u64(numel, r->shape[k], &numel))
      return bad(img, err, errlen, "slice '%s' has a bad shape", PS__ESC(r->name));
  }
  r->offset = get64(b + o);
  r->length = get64(b + o + 8);
  r->opt_kind = get32(b + o + 16);
  r->state_per = get32(b + o + 20);
  r->step = get64(b + o + 24);
  o += 32;
  if (r->length == 0 || r->offset > numel || r->length > numel - r->offset)
    return bad(img, err, errlen, "slice '%s' [%" PRIu64 ", +%" PRIu64
               ") lies outside its %" PRIu64 " elements", PS__ESC(r->name), r->offset,
               r->length, numel);
  if (r->state_per > PSD_OPT_MAX_STATE)
    return bad(img, err, errlen, "slice '%s' has %u optimizer state floats per element",
               PS__ESC(r->name), r->state_per);
  uint64_t need = r->length * (1 + r->state_per) * sizeof(float);
  if (r->length > (uint64_t)1 << 40 || end - o < need)
    return bad(img, err, errlen, "slice '%s' needs %" PRIu64 " bytes, %zu are left",
               PS__ESC(r->name), need, end - o);
  r->param = b + o;
  o += r->length * sizeof(float);
  r->state = r->state_per ? b + o : NULL;
  o += r->length * r->state_per * sizeof(float);
  *at = o;
  return 0;
}

/* The header's counts, checked against the trailer and the file size, and
 * the record arrays sized by them. 0, or -1 (bad() was called). */
static int parse_counts(psd_ckpt_image *img, char *err, size_t errlen) {
  const uint8_t *b = img->buf, *t = b + img->len - END_SIZE;
  psd_ckpt_meta *m = &img->meta;
  m->nslices = get32(b + 48);
  m->ntables = get32(b + 8) >= 3 ? get32(b + 52) : 0; /* version 2: no tables */
  if (get32(t + 8) != (uint64_t)m->nslices + m->ntables)
    return bad(img, err, errlen, "header says %u slices and %u tables, trailer %u records",
               m->nslices, m->ntables, get32(t + 8));
  /* Each record takes at least its fixed fields: bounds the counts. */
  uint64_t room = img->len - HDR_SIZE - END_SIZE;
  if ((uint64_t)m->nslices * 40 + (uint64_t)m->ntables * PSD_CKPTTABLE_MIN_BYTES > room)
    return bad(img, err, errlen, "%u slices and %u tables cannot fit in %zu bytes", m->nslices,
               m->ntables, img->len);
  img->recs = calloc(m->nslices ? m->nslices : 1, sizeof *img->recs);
  img->tables = calloc(m->ntables ? m->ntables : 1, sizeof *img->tables);
  if (!img->recs || !img->tables) return bad(img, err, errlen, "out of memory");
  return 0;
}

int psd_ckpt_parse(psd_ckpt_image *img, const psd_ckptdir *d, char *err, size_t errlen) {
  const uint8_t *b = img->buf;
  img->recs = NULL;
  img->tables = NULL;
  if (check_envelope(img, d, err, errlen) != 0) return -1;
  psd_ckpt_meta *m = &img->meta;
  m->ps_index = get32(b + 12);
  m->num_ps = get32(b + 16);
  m->num_workers = get32(b + 20);
  m->replicas = get32(b + 24);
  m->async_mode = get32(b + 28);
  m->step = get64(b + 32);
  if (parse_counts(img, err, errlen) != 0) return -1;
  /* Slices and tables in the order they were captured. */
  size_t o = HDR_SIZE, end = img->len - END_SIZE;
  uint32_t ns = 0, nt = 0;
  while (o < end) {
    if (end - o >= 4 && memcmp(b + o, REC_MAGIC, 4) == 0 && ns < m->nslices) {
      if (parse_slice(img, &o, end, ns++, err, errlen) != 0) return -1;
    } else if (end - o >= 4 && memcmp(b + o, PSD_CKPTTABLE_MAGIC, 4) == 0 && nt < m->ntables) {
      char msg[400];
      size_t used;
      if (psd_ckpttable_parse(b + o, end - o, &img->tables[nt++], &used, msg, sizeof msg))
        return bad(img, err, errlen, "%s", msg);
      o += used;
    } else {
      return bad(img, err, errlen, "record %u is not a slice or table the header promised",
                 ns + nt);
    }
  }
  if (ns != m->nslices || nt != m->ntables)
    return bad(img, err, errlen, "%u of %u slice records and %u of %u table records are there",
               ns, m->nslices, nt, m->ntables);
  return 0;
}

void psd_ckpt_image_free(psd_ckpt_image *img) {
  if (!img) return;
  free(img->recs);
  free(img->tables);
  free(img->buf);
  img->recs = NULL;
  img->tables = NULL;
  img->buf = NULL;
  img->len = 0;
}

/* ---- finding and pruning ------------------------------------------------- */

static int parse_step_dir(const char *name, uint64_t *step) {
  /* step-%012: 12 digits, more for steps past 10^12 (at most 20). */
  size_t len = strlen(name);
  if (strncmp(name, "step-", 5) != 0 || len < 17 || len > 25) return 0;
  uint64_t v = 0;
  for (const char *p = name + 5; *p; p++) {
    if (*p < '0' || *p > '9') return 0;
    v = v * 10 + (uint64_t)(*p - '0');
  }
  *step = v;
  return 1;
}

static int cmp_desc(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* A fresh directory stream over dfd (its own file offset). NULL on error. */
static DIR *open_stream(int dfd) {
  int fd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (!d && fd >= 0) close(fd);
  return d;
}

/* Steps that have a step-N directory, newest first (malloc'd; *n). */
static uint64_t *list_steps(const psd_ckptdir *dir, size_t *n) {
  *n = 0;
  DIR *d = open_stream(dir->fd);
  if (!d) return NULL;
  size_t cap = 16;
  uint64_t *v = malloc(cap * sizeof *v);
  struct dirent *e;
  while (v && (e = readdir(d)) != NULL && *n < CKPT_MAX_STEPS) {
    uint64_t s;
    if (!parse_step_dir(e->d_name, &s)) continue;
    if (*n == cap) {
      uint64_t *nv = realloc(v, 2 * cap * sizeof *v);
      if (!nv) break;
      v = nv;
      cap *= 2;
    }
    v[(*n)++] = s;
  }
  closedir(d);
  if (v) qsort(v, *n, sizeof *v, cmp_desc);
  return v;
}

static int file_exists(int dfd, const char *name) {
  struct stat st;
  return fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
}

/* Another ps count that wrote checkpoint files in a step directory (0: none). */
static uint32_t other_count(int sfd, uint32_t num_ps) {
  DIR *d = open_stream(sfd);
  if (!d) return 0;
  struct dirent *e;
  uint32_t found = 0;
  while ((e = readdir(d)) != NULL) {
    unsigned i, n;
    char tail[8];
    if (sscanf(e->d_name, "ps-%u-of-%u.ckp%1s", &i, &n, tail) == 3 && n != num_ps &&
        strcmp(e->d_name + strlen(e->d_name) - 5, ".ckpt") == 0) {
      found = n;
      break;
    }
  }
  closedir(d);
  return found;
}

/* ps-i-of-n.ckpt and step-N: one place that spells the layout. */
static void ps_name(char *out, size_t len, uint32_t ps, uint32_t num_ps) {
  snprintf(out, len, "ps-%u-of-%u.ckpt", ps, num_ps);
}
static void step_name(char *out, size_t len, uint64_t step) {
  snprintf(out, len, "step-%012" PRIu64, step);
}

/* All num_ps files exist in the step directory sfd. */
static int step_complete(int sfd, uint32_t num_ps) {
  char f[48];
  for (uint32_t i = 0; i < num_ps; i++) {
    ps_name(f, sizeof f, i, num_ps);
    if (!file_exists(sfd, f)) return 0;
  }
  return 1;
}

/* --restore=fallback: the other ps's files of a step read back too, so
 * every ps, deciding alone, falls back to the same step. */
static int others_usable(const psd_ckptdir *d, int sfd, const char *sd, uint32_t ps_index,
                         uint32_t num_ps, uint64_t max_bytes, char *err, size_t errlen) {
  for (uint32_t i = 0; i < num_ps; i++) {
    if (i == ps_index) continue;
    char f[48], label[PSD_CKPT_PATH_MAX + 96];
    ps_name(f, sizeof f, i, num_ps);
    snprintf(label, sizeof label, "%s/%s", sd, f);
    psd_ckpt_image o;
    if (read_at(d, sfd, f, label, max_bytes, &o, err, errlen) != 0) return 0;
    psd_ckpt_image_free(&o);
  }
  return 1;
}

/* What psd_ckpt_find learns while scanning the steps. */
typedef struct find_state {
  uint32_t foreign;      /* another ps count's files were seen */
  uint64_t own;          /* a step with only some files, ours among them */
  char first_err[1200];  /* the first step that could not be used */
} find_state;

/* Tries one step: 1 (img filled), 0 (not complete: skipped), -1 (e says
 * why it cannot be used). */
static int try_step(const psd_ckptdir *d, uint64_t step, uint32_t ps_index, uint32_t num_ps,
                    int fallback, uint64_t max_bytes, psd_ckpt_image *img, find_state *fs,
                    char *e, size_t elen) {
  char sn[28], sd[PSD_CKPT_PATH_MAX + 32], f[48], label[PSD_CKPT_PATH_MAX + 96];
  step_name(sn, sizeof sn, step);
  snprintf(sd, sizeof sd, "%s/%s", d->path, sn);
  ps_name(f, sizeof f, ps_index, num_ps);
  snprintf(label, sizeof label, "%s/%s", sd, f);
  int sfd = psd_ckptdir_subdir(d, sn, 0, e, elen);
  if (sfd == -2) return 0;
  if (sfd < 0) return -1; /* not ours, or a symlink: never read from it */
  int rc = 0;
  if (!step_complete(sfd, num_ps)) {
    if (file_exists(sfd, f)) fs->own = step;
    if (!fs->foreign) fs->foreign = other_count(sfd, num_ps);
  } else if (read_at(d, sfd, f, label, max_bytes, img, e, elen) == 0) {
    rc = -1;
    if (img->meta.ps_index != ps_index || img->meta.num_ps != num_ps)
      snprintf(e, elen, "checkpoint %s was written by ps %u of %u, this is ps %u of %u", label,
               img->meta.ps_index, img->meta.num_ps, ps_index, num_ps);
    else if (img->meta.step != step)
      snprintf(e, elen, "checkpoint %s holds step %" PRIu64 " but lies in %s", label,
               img->meta.step, sn);
    else if (!fallback || others_usable(d, sfd, sd, ps_index, num_ps, max_bytes, e, elen))
      rc = 1; /* with fallback, every ps must fall back to the same step */
    if (rc != 1) psd_ckpt_image_free(img);
  } else {
    rc = -1;
  }
  close(sfd);
  return rc;
}

int psd_ckpt_find(const psd_ckptdir *d, uint32_t ps_index, uint32_t num_ps, int fallback,
                  uint64_t max_bytes, psd_ckpt_image *img, char *err, size_t errlen) {
  memset(img, 0, sizeof *img);
  if (errlen) err[0] = '\0';
  size_t n;
  uint64_t *steps = list_steps(d, &n);
  int rc = 0;
  find_state fs = {0, UINT64_MAX, ""};
  for (size_t k = 0; k < n; k++) {
    char e[1200];
    int r = try_step(d, steps[k], ps_index, num_ps, fallback, max_bytes, img, &fs, e, sizeof e);
    if (r == 0) continue; /* an interrupted checkpoint, or another job shape */
    if (r == 1) {
      rc = 1;
      break;
    }
    if (!fs.first_err[0]) snprintf(fs.first_err, sizeof fs.first_err, "%s", e);
    if (!fallback) {
      rc = -1;
      break;
    }
  }
  free(steps);
  if (rc == 0 && fs.first_err[0]) {
    snprintf(err, errlen, "%s; no older complete checkpoint is usable", fs.first_err);
    return -1;
  }
  if (rc == -1) {
    snprintf(err, errlen, "%s (start with --restore=fallback to use an older complete "
             "checkpoint, or --restore=none to move them aside and start afresh)", fs.first_err);
    return -1;
  }
  if (rc == 0 && fs.own != UINT64_MAX && !fs.foreign) {
    /* Not an error (a job can die before its first checkpoint is
     * complete), but also what a directory each node sees separately
     * looks like: say so. */
    snprintf(err, errlen,
             "checkpoint directory %s has this ps's file of step %" PRIu64 " but no step with "
             "the files of all %u ps (a checkpoint interrupted before any completed, or a "
             "directory the ps tasks do not share)",
             d->path, fs.own, num_ps);
    return 0;
  }
  if (rc == 0 && fs.foreign) {
    snprintf(err, errlen,
             "checkpoint directory %s holds checkpoints of %u ps tasks but none of this job's "
             "%u (start with --restore=none to move them aside and start afresh)",
             d->path, fs.foreign, num_ps);
    return -1;
  }
  return rc;
}

/* Removes this ps's leftover temporary (if ours) and, unless keep_file,
 * its checkpoint file of one step, then the step directory if empty. */
static int prune_step(const psd_ckptdir *d, uint64_t step, uint32_t ps_index, uint32_t num_ps,
                      int keep_file) {
  char sn[28], f[48], t[56], label[PSD_CKPT_PATH_MAX + 96], e[600];
  step_name(sn, sizeof sn, step);
  int sfd = psd_ckptdir_subdir(d, sn, 0, e, sizeof e);
  if (sfd < 0) return 0;
  ps_name(f, sizeof f, ps_index, num_ps);
  snprintf(t, sizeof t, "%s.tmp", f);
  snprintf(label, sizeof label, "%s/%s/%s", d->path, sn, t);
  int removed = 0;
  if (file_exists(sfd, t) && psd_ckptdir_unlink_own(sfd, t, label, e, sizeof e) == 0) removed++;
  if (!keep_file && file_exists(sfd, f) && unlinkat(sfd, f, 0) == 0) removed++;
  close(sfd);
  if (!keep_file) unlinkat(d->fd, sn, AT_REMOVEDIR); /* fails while other ps's files are there */
  return removed;
}

int psd_ckpt_prune(const psd_ckptdir *d, uint32_t ps_index, uint32_t num_ps, int keep) {
  size_t n;
  uint64_t *steps = list_steps(d, &n);
  /* Only steps older than the keep-th newest *complete* one go: a ps must
   * never delete its part of the newest complete checkpoint because it has
   * written newer files that the other ps never finished. */
  int complete = 0, removed = 0;
  size_t cut = n;
  for (size_t k = 0; k < n && cut == n; k++) {
    char sn[28], e[600];
    step_name(sn, sizeof sn, steps[k]);
    int sfd = psd_ckptdir_subdir(d, sn, 0, e, sizeof e);
    if (sfd < 0) continue;
    if (step_complete(sfd, num_ps) && ++complete == keep) cut = k + 1;
    close(sfd);
  }
  for (size_t k = 0; k < n; k++)
    removed += prune_step(d, steps[k], ps_index, num_ps, k < cut);
  free(steps);
  if (removed) fsync(d->fd);
  return removed;
}
