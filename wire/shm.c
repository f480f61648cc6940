/* shm.c - the shared-memory segment (see shm.h): creating and sealing it
 * (worker), checking and mapping a handed-over one (psd), the two rings'
 * arithmetic and the handover message. */
#define _GNU_SOURCE
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "ps/errno.h"
#include "ps/types.h"

/* statfs f_type of tmpfs, where memfd_create's files live (linux/magic.h
 * TMPFS_MAGIC); hugetlbfs memfds, whose pages can run out at fault time
 * (SIGBUS), have another. */
#define PS__TMPFS_MAGIC 0x01021994
#define PS__SHM_MAGIC "PSDSEG01"
#define PS__SHM_HELLO_MAGIC "PSDSHM1"

static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

int ps__shm_check_sizes(uint64_t push, uint64_t pull, char *err, size_t errlen) {
  const uint64_t sz[2] = {push, pull};
  const char *name[2] = {"push", "pull"};
  for (int i = 0; i < 2; i++)
    if (sz[i] < PS__SHM_RING_MIN || sz[i] > PS__SHM_RING_MAX || sz[i] % 4096) {
      snprintf(err, errlen,
               "%s ring of %llu bytes (must be a multiple of 4096 from %llu to %llu)",
               name[i], (unsigned long long)sz[i], (unsigned long long)PS__SHM_RING_MIN,
               (unsigned long long)PS__SHM_RING_MAX);
      return PS_EINVAL;
    }
  return 0;
}

/* Points s's rings and done words into its mapping. */
static void layout(ps__shm *s, uint8_t *map, uint64_t push, uint64_t pull) {
  memset(s, 0, sizeof *s);
  s->map = map;
  s->map_len = (size_t)(PS__SHM_HEADER_BYTES + push + pull);
  s->push = (ps__shm_ring){map + PS__SHM_HEADER_BYTES, push, 0, 0};
  s->pull = (ps__shm_ring){map + PS__SHM_HEADER_BYTES + push, pull, 0, 0};
  s->push_done = (uint64_t *)(void *)(map + PS__SHM_PUSH_DONE_OFF);
  s->pull_done = (uint64_t *)(void *)(map + PS__SHM_PULL_DONE_OFF);
}

int ps__shm_create(ps__shm *s, uint64_t push, uint64_t pull, char *err, size_t errlen) {
  memset(s, 0, sizeof *s);
  int rc = ps__shm_check_sizes(push, pull, err, errlen);
  if (rc) return rc;
  uint64_t total = PS__SHM_HEADER_BYTES + push + pull;
  int fd = memfd_create("psd-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    snprintf(err, errlen, "memfd_create: %s", strerror(errno));
    return PS_EUNSUPPORTED;
  }
  const char *what = "ftruncate";
  if (ftruncate(fd, (off_t)total) != 0) goto fail;
  what = "sealing it (F_ADD_SEALS)";
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) goto fail;
  what = "mmap";
  void *map = mmap(NULL, (size_t)total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) goto fail;
  layout(s, map, push, pull);
  memcpy(map, PS__SHM_MAGIC, 8);
  return fd;
fail:
  snprintf(err, errlen, "shared-memory segment of %llu bytes: %s: %s",
           (unsigned long long)total, what, strerror(errno));
  close(fd);
  return PS_ENOMEM;
}

int ps__shm_attach(ps__shm *s, int fd, uint64_t push, uint64_t pull, char *err,
                   size_t errlen) {
  memset(s, 0, sizeof *s);
  int rc = ps__shm_check_sizes(push, pull, err, errlen);
  if (rc) return rc;
  uint64_t total = PS__SHM_HEADER_BYTES + push + pull;
  struct stat st;
  struct statfs sf;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || fstatfs(fd, &sf) != 0 ||
      sf.f_type != PS__TMPFS_MAGIC) {
    snprintf(err, errlen, "the descriptor is not a memfd (a regular file on tmpfs)");
    return PS_EINVAL;
  }
  /* Seals first: once SHRINK and GROW are on (and SEAL, so nothing else
   * comes), the size read next is the size for good. */
  int seals = fcntl(fd, F_GET_SEALS);
  int need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
#ifdef F_SEAL_FUTURE_WRITE
  int refuse = F_SEAL_WRITE | F_SEAL_FUTURE_WRITE;
#else
  int refuse = F_SEAL_WRITE;
#endif
  if (seals < 0 || (seals & need) != need || (seals & refuse)) {
    snprintf(err, errlen,
             "the memfd is not sealed against shrinking, growing and new seals (seals 0x%x; "
             "psd needs 0x%x and not the write seals): its owner could truncate it under psd",
             seals < 0 ? 0 : seals, need);
    return PS_EINVAL;
  }
  if ((uint64_t)st.st_size < total) {
    snprintf(err, errlen, "the memfd has %llu bytes, the rings need %llu",
             (unsigned long long)st.st_size, (unsigned long long)total);
    return PS_EINVAL;
  }
  void *map = mmap(NULL, (size_t)total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    snprintf(err, errlen, "cannot map the memfd: %s", strerror(errno));
    return PS_ENOMEM;
  }
  layout(s, map, push, pull);
  return 0;
}

void ps__shm_unmap(ps__shm *s) {
  if (s->map) munmap(s->map, s->map_len);
  memset(s, 0, sizeof *s);
}

static uint64_t align_up(uint64_t x) {
  return (x + PS__SHM_ALIGN - 1) / PS__SHM_ALIGN * PS__SHM_ALIGN;
}

void *ps__shm_reserve(ps__shm_ring *r, uint64_t done, uint64_t len, uint64_t *pos) {
  if (!r->base || len == 0 || len > r->size) return NULL;
  /* A done word past our head, or more than a ring behind it (below),
   * is not one an honest consumer writes: treat the ring as full. */
  if (done > r->head) return NULL;
  /* The bytes skipped by a restart below count as consumed: without
   * this, a consumer that kept up (every frame done before the next was
   * reserved) left done a lap short of each restart, and the ring
   * refused frames that had room. */
  if (done < r->floor) done = r->floor;
  if (r->head - done > r->size) return NULL;
  int empty = align_up(done) >= r->head;
  uint64_t p = r->head;
  /* An empty ring starts again at its first byte (PS__SHM_RESTART_BYTES
   * says when): a small model keeps touching the same few pages instead
   * of walking the whole ring. */
  uint64_t restart_at = r->size / 2 < PS__SHM_RESTART_BYTES ? r->size / 2 : PS__SHM_RESTART_BYTES;
  if (empty && (p % r->size >= restart_at || p % r->size + len > r->size)) {
    p = (p + r->size - 1) / r->size * r->size;
    r->floor = p;
  }
  uint64_t off = p % r->size;
  if (off + len > r->size) { /* never wrap inside a frame */
    p += r->size - off;
    off = 0;
  }
  /* Not empty: the bytes written must be ones the consumer is done with,
   * i.e. those of the previous lap below done. */
  if (!empty && p + len > done + r->size) return NULL;
  r->head = align_up(p + len);
  *pos = p;
  return r->base + off;
}

const void *ps__shm_locate(const ps__shm_ring *r, uint64_t pos, uint64_t len) {
  if (!r->base || len > r->size) return NULL;
  uint64_t off = pos % r->size;
  if (off > r->size - len) return NULL;
  return r->base + off;
}

uint64_t ps__shm_load(const uint64_t *word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

void ps__shm_store(uint64_t *word, uint64_t v) { __atomic_store_n(word, v, __ATOMIC_RELEASE); }

void ps__shm_hello_encode(uint8_t out[PS__SHM_HELLO_BYTES],
                          const uint8_t token[PS__SHM_TOKEN_BYTES], uint64_t push,
                          uint64_t pull) {
  memcpy(out, PS__SHM_HELLO_MAGIC, 8); /* with its NUL */
  memcpy(out + 8, token, PS__SHM_TOKEN_BYTES);
  put_u64(out + 8 + PS__SHM_TOKEN_BYTES, push);
  put_u64(out + 16 + PS__SHM_TOKEN_BYTES, pull);
}

int ps__shm_hello_decode(const uint8_t *in, size_t n, uint8_t token[PS__SHM_TOKEN_BYTES],
                         uint64_t *push, uint64_t *pull, char *err, size_t errlen) {
  if (n != PS__SHM_HELLO_BYTES || memcmp(in, PS__SHM_HELLO_MAGIC, 8) != 0) {
    snprintf(err, errlen, "not a shared-memory handover (%zu bytes; expected %u starting "
             "\"%s\")", n, PS__SHM_HELLO_BYTES, PS__SHM_HELLO_MAGIC);
    return PS_EPROTO;
  }
  memcpy(token, in + 8, PS__SHM_TOKEN_BYTES);
  *push = get_u64(in + 8 + PS__SHM_TOKEN_BYTES);
  *pull = get_u64(in + 16 + PS__SHM_TOKEN_BYTES);
  return 0;
}

int ps__shm_send_fds(int s, const void *msg, size_t len, const int *fds, int nfds) {
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(sizeof(int) * PS__SHM_MAX_FDS)];
  } cm;
  if (nfds < 0 || nfds > PS__SHM_MAX_FDS) return -EINVAL;
  memset(&cm, 0, sizeof cm);
  struct iovec iov = {(void *)msg, len};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (nfds) {
    mh.msg_control = cm.b;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
    struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(h), fds, sizeof(int) * (size_t)nfds);
  }
  ssize_t n = sendmsg(s, &mh, MSG_NOSIGNAL);
  if (n < 0) return -errno;
  return (size_t)n == len ? 0 : -EMSGSIZE;
}

ssize_t ps__shm_recv_fds(int s, void *buf, size_t len, int *fds, int maxfds, int *nfds,
                         int *ctrunc) {
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(sizeof(int) * PS__SHM_MAX_FDS)];
  } cm;
  struct iovec iov = {buf, len};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cm.b;
  mh.msg_controllen = sizeof cm.b;
  *nfds = 0;
  *ctrunc = 0;
  ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) return n;
  *ctrunc = (mh.msg_flags & MSG_CTRUNC) != 0;
  for (struct cmsghdr *h = CMSG_FIRSTHDR(&mh); h; h = CMSG_NXTHDR(&mh, h)) {
    if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int x;
      memcpy(&x, CMSG_DATA(h) + i * sizeof(int), sizeof x);
      if (*nfds < maxfds) {
        fds[(*nfds)++] = x;
      } else {
        close(x);
        *ctrunc = 1;
      }
    }
  }
  return n;
}

size_t ps__shm_reply_encode(uint8_t out[PS__SHM_REPLY_MAX], int status, const char *why) {
  uint32_t u = (uint32_t)status;
  for (int i = 0; i < 4; i++) out[i] = (uint8_t)(u >> (8 * i));
  size_t len = strlen(why);
  if (len > PS__SHM_REPLY_MAX - 4) len = PS__SHM_REPLY_MAX - 4;
  memcpy(out + 4, why, len);
  return 4 + len;
}

int ps__shm_reply_decode(const uint8_t *in, size_t n, char *why, size_t whylen) {
  if (n < 4) {
    snprintf(why, whylen, "a %zu-byte answer (at least 4 expected)", n);
    return PS_EPROTO;
  }
  int32_t st = (int32_t)((uint32_t)in[0] | (uint32_t)in[1] << 8 | (uint32_t)in[2] << 16 |
                         (uint32_t)in[3] << 24);
  snprintf(why, whylen, "%.*s", (int)(n - 4), (const char *)in + 4);
  return st;
}

int ps__shm_handover(int s, const void *msg, size_t len, const int *fds, int nfds, char *why,
                     size_t whylen) {
  int sent = ps__shm_send_fds(s, msg, len, fds, nfds);
  if (sent && sent != -EPIPE && sent != -ECONNRESET) {
    /* Not sent (a timeout, say): no answer can come either. */
    snprintf(why, whylen, "sending the handover: %s", strerror(-sent));
    return PS_EIO;
  }
  uint8_t ans[PS__SHM_REPLY_MAX];
  ssize_t n = recv(s, ans, sizeof ans, 0);
  int e = errno;
  if (n < 0 && e == ECONNRESET) {
    /* psd answered and closed with our hello unread (it refuses another
     * uid at accept): Linux reports that reset once, before the answer
     * still queued here; the next read has the answer. */
    n = recv(s, ans, sizeof ans, 0);
    e = errno;
  }
  if (n > 0) return ps__shm_reply_decode(ans, (size_t)n, why, whylen);
  if (n < 0 && !sent) {
    /* Sent, and the wait for the answer ran out: psd may have taken the
     * segment. */
    snprintf(why, whylen, "psd gave no answer to the handover (%s)", strerror(e));
    return PS_ETIMEDOUT;
  }
  snprintf(why, whylen, "no answer to the handover: %s",
           sent ? strerror(-sent) : n < 0 ? strerror(e) : "psd closed the socket");
  return PS_EIO;
}

void ps__shm_host_id(char *out, size_t outlen) {
  char buf[PS__SHM_HOST_ID_MAX] = "";
  /* read(2), not stdio: no allocation, so a process short of memory does
   * not take itself for another node (the faultsim suite). */
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t n = read(fd, buf, sizeof buf - 1);
    buf[n > 0 ? n : 0] = '\0';
    close(fd);
    buf[strcspn(buf, "\r\n")] = '\0';
  }
  if (!buf[0]) {
    memcpy(buf, "host:", 5);
    if (gethostname(buf + 5, sizeof buf - 6) != 0) buf[5] = '\0';
    buf[sizeof buf - 1] = '\0';
  }
  snprintf(out, outlen, "%s", buf);
}
