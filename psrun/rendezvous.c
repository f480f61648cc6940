/* rendezvous.c - the control channel's codec, line I/O and sockets (see
 * rendezvous.h for the wire format). */
#define _GNU_SOURCE
#include "rendezvous.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "backoff.h"
#include "util.h"

/* ---- codec ------------------------------------------------------------------- */

/* 1 if w is a non-empty word of at most max bytes of [0-9a-zA-Z+/=_.-]
 * (hex digits, base64, MUNGE's "MUNGE:...:" needs ':'). */
static int proof_word(const char *w, size_t max) {
  size_t n = strlen(w);
  return n > 0 && n <= max && strspn(w, "0123456789abcdefABCDEFGHIJKLMNOPQRSTUVWXYZghijklmnopqrstuvwxyz+/=_.:-") == n;
}

static int is_hex(const char *w) {
  return strlen(w) == PSR_HEX_LEN && strspn(w, "0123456789abcdef") == PSR_HEX_LEN;
}

static int enc_rdv(const psr_msg *m, char *b, size_t cap) {
  if (!m->text || !proof_word(m->text, 15)) return -1;
  return snprintf(b, cap, "RDV %s %s", PSR_HELLO_MAGIC, m->text);
}

static int dec_rdv(const char *rest, psr_msg *m) {
  size_t ml = strlen(PSR_HELLO_MAGIC);
  if (strncmp(rest, PSR_HELLO_MAGIC, ml) != 0 || rest[ml] != ' ') return -1;
  m->text = rest + ml + 1;
  return proof_word(m->text, 15) ? 0 : -1;
}

static int enc_hello(const psr_msg *m, char *b, size_t cap) {
  const psr_hello *h = &m->hello;
  if (!h->node[0] || strpbrk(h->node, " \t\r\n") || !is_hex(h->nonce) ||
      !proof_word(h->proof, PSR_PROOF_MAX - 1))
    return -1;
  return snprintf(b, cap, "HELLO %s %lld %lld %u %d %d %s %d %s %s", PSR_HELLO_MAGIC, h->job_id,
                  h->step_id, h->uid, h->ntasks, h->rank, h->node, h->localid, h->nonce,
                  h->proof);
}

static int dec_hello(const char *rest, psr_msg *m) {
  char magic[16];
  psr_hello *h = &m->hello;
  return sscanf(rest, "%15s %lld %lld %u %d %d %255s %d %64s %2047s", magic, &h->job_id,
                &h->step_id, &h->uid, &h->ntasks, &h->rank, h->node, &h->localid, h->nonce,
                h->proof) == 10 &&
                 strcmp(magic, PSR_HELLO_MAGIC) == 0 && is_hex(h->nonce) &&
                 proof_word(h->proof, PSR_PROOF_MAX - 2)
             ? 0
             : -1;
}

static int enc_role(const psr_msg *m, char *b, size_t cap) {
  const psr_assign *r = &m->role;
  if (!proof_word(r->proof, PSR_PROOF_MAX - 1)) return -1;
  return snprintf(b, cap, "ROLE %s %d %d %d %s", r->is_ps ? "ps" : "worker", r->index, r->num_ps,
                  r->num_workers, r->proof);
}

static int dec_role(const char *rest, psr_msg *m) {
  char kind[16];
  psr_assign *r = &m->role;
  if (sscanf(rest, "%15s %d %d %d %2047s", kind, &r->index, &r->num_ps, &r->num_workers,
             r->proof) != 5 ||
      !proof_word(r->proof, PSR_PROOF_MAX - 2))
    return -1;
  r->is_ps = strcmp(kind, "ps") == 0;
  return r->is_ps || strcmp(kind, "worker") == 0 ? 0 : -1;
}

/* PSADDR, HOSTS: "<mac> <one word>". */
static int enc_mac_word(const psr_msg *m, char *b, size_t cap) {
  const char *t = m->text ? m->text : "";
  if (!is_hex(m->mac) || !*t || strpbrk(t, " \t\r\n")) return -1;
  return snprintf(b, cap, "%s %s %s", psr_msg_name(m->type), m->mac, t);
}

static int dec_mac_word(const char *rest, psr_msg *m) {
  if (strlen(rest) < PSR_HEX_LEN + 2 || rest[PSR_HEX_LEN] != ' ') return -1;
  memcpy(m->mac, rest, PSR_HEX_LEN);
  m->mac[PSR_HEX_LEN] = '\0';
  m->text = rest + PSR_HEX_LEN + 1;
  return is_hex(m->mac) && *m->text && !strpbrk(m->text, " \t\r\n") ? 0 : -1;
}

void psr_world_text(const psr_msg *m, char *buf, size_t cap) {
  snprintf(buf, cap, "%d %d %s", m->local_rank, m->local_workers, m->text ? m->text : "");
}

/* WORLD: "<mac> <local_rank> <local_workers> <host:port>". */
static int enc_world(const psr_msg *m, char *b, size_t cap) {
  const char *t = m->text ? m->text : "";
  if (!is_hex(m->mac) || !*t || strpbrk(t, " \t\r\n") || m->local_rank < 0 ||
      m->local_rank >= m->local_workers)
    return -1;
  return snprintf(b, cap, "WORLD %s %d %d %s", m->mac, m->local_rank, m->local_workers, t);
}

static int dec_world(const char *rest, psr_msg *m) {
  int used = 0;
  if (strlen(rest) < PSR_HEX_LEN + 2 || rest[PSR_HEX_LEN] != ' ') return -1;
  memcpy(m->mac, rest, PSR_HEX_LEN);
  m->mac[PSR_HEX_LEN] = '\0';
  rest += PSR_HEX_LEN + 1;
  if (sscanf(rest, "%d %d %n", &m->local_rank, &m->local_workers, &used) != 2 || !used)
    return -1;
  m->text = rest + used;
  return is_hex(m->mac) && m->local_rank >= 0 && m->local_rank < m->local_workers &&
                 *m->text && !strpbrk(m->text, " \t\r\n")
             ? 0
             : -1;
}

static int enc_exit(const psr_msg *m, char *b, size_t cap) {
  return snprintf(b, cap, "EXIT %d", m->code);
}

static int dec_exit(const char *rest, psr_msg *m) {
  char *end;
  long v = strtol(rest, &end, 10);
  if (end == rest || v < -1000000 || v > 1000000) return -1;
  m->code = (int)v;
  return 0;
}

/* REJECT, ABORT, PSADDR, HOSTS: the keyword and the rest of the line. */
static int enc_text(const psr_msg *m, char *b, size_t cap) {
  const char *t = m->text ? m->text : "";
  if (strpbrk(t, "\r\n")) return -1;
  return snprintf(b, cap, "%s%s%s", psr_msg_name(m->type), *t ? " " : "", t);
}

static int dec_text(const char *rest, psr_msg *m) {
  m->text = rest;
  return 0;
}

typedef struct msg_kind {
  const char *word;
  int (*enc)(const psr_msg *m, char *buf, size_t cap);
  int (*dec)(const char *rest, psr_msg *m);
} msg_kind;

/* One row per psr_msg_type, in its order. */
static const msg_kind KINDS[PSR_MSG_COUNT] = {
    [PSR_MSG_RDV] = {"RDV", enc_rdv, dec_rdv},
    [PSR_MSG_HELLO] = {"HELLO", enc_hello, dec_hello},
    [PSR_MSG_ROLE] = {"ROLE", enc_role, dec_role},
    [PSR_MSG_REJECT] = {"REJECT", enc_text, dec_text},
    [PSR_MSG_PSADDR] = {"PSADDR", enc_mac_word, dec_mac_word},
    [PSR_MSG_HOSTS] = {"HOSTS", enc_mac_word, dec_mac_word},
    [PSR_MSG_EXIT] = {"EXIT", enc_exit, dec_exit},
    [PSR_MSG_ABORT] = {"ABORT", enc_text, dec_text},
    [PSR_MSG_MASTER] = {"MASTER", enc_mac_word, dec_mac_word},
    [PSR_MSG_WORLD] = {"WORLD", enc_world, dec_world},
};

const char *psr_msg_name(psr_msg_type t) {
  return (unsigned)t < PSR_MSG_COUNT ? KINDS[t].word : "?";
}

int psr_msg_encode(const psr_msg *m, char *buf, size_t cap) {
  if ((unsigned)m->type >= PSR_MSG_COUNT) return -1;
  int n = KINDS[m->type].enc(m, buf, cap);
  return n < 0 || (size_t)n >= cap ? -1 : n;
}

int psr_msg_decode(const char *line, psr_msg *m) {
  memset(m, 0, sizeof *m);
  size_t wl = strcspn(line, " ");
  for (int t = 0; t < PSR_MSG_COUNT; t++) {
    if (strlen(KINDS[t].word) != wl || strncmp(KINDS[t].word, line, wl) != 0) continue;
    m->type = (psr_msg_type)t;
    return KINDS[t].dec(line + wl + (line[wl] == ' '), m);
  }
  return -1;
}

int psr_msg_send(int fd, const psr_msg *m) {
  char *line = malloc(PSR_LINE_MAX_BYTES);
  if (!line) return -1;
  int n = psr_msg_encode(m, line, PSR_LINE_MAX_BYTES - 1);
  int rc = n < 0 ? -1 : 0;
  if (n >= 0) line[n++] = '\n';
  for (int off = 0; rc == 0 && off < n;) {
    ssize_t w = send(fd, line + off, (size_t)(n - off), MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) rc = -1;
    else off += (int)w;
  }
  free(line);
  return rc;
}

int psr_send_text(int fd, psr_msg_type t, const char *fmt, ...) {
  char *text = NULL;
  va_list ap;
  va_start(ap, fmt);
  int n = vasprintf(&text, fmt, ap);
  va_end(ap);
  if (n < 0) return -1;
  psr_msg m = {.type = t, .text = text};
  int rc = psr_msg_send(fd, &m);
  free(text);
  return rc;
}

int psr_send_exit(int fd, int code) {
  psr_msg m = {.type = PSR_MSG_EXIT, .code = code};
  return psr_msg_send(fd, &m);
}

/* ---- line I/O ---------------------------------------------------------------- */

/* The first buffered line, malloc'd, or NULL. */
static char *take_line(psr_conn *c) {
  char *nl = c->len ? memchr(c->buf, '\n', c->len) : NULL;
  if (!nl) return NULL;
  size_t l = (size_t)(nl - c->buf);
  char *line = malloc(l + 1);
  if (!line) return NULL;
  memcpy(line, c->buf, l);
  line[l] = '\0';
  memmove(c->buf, nl + 1, c->len - l - 1);
  c->len -= l + 1;
  return line;
}

char *psr_conn_read_line(psr_conn *c, int block, int *eof) {
  *eof = 0;
  for (;;) {
    char *line = take_line(c);
    if (line) return line;
    if (c->len >= PSR_LINE_MAX_BYTES || c->fd < 0) {
      *eof = 1;
      return NULL;
    }
    if (c->cap - c->len < 4096) {
      size_t nc = c->cap ? c->cap * 2 : 8192;
      char *nb = realloc(c->buf, nc);
      if (!nb) {
        *eof = 1;
        return NULL;
      }
      c->buf = nb;
      c->cap = nc;
    }
    ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, block ? 0 : MSG_DONTWAIT);
    if (r > 0) {
      c->len += (size_t)r;
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return NULL;
    *eof = 1;
    return NULL;
  }
}

char *psr_conn_wait_line(psr_conn *c, double deadline, int *eof) {
  for (;;) {
    char *l = psr_conn_read_line(c, 0, eof);
    if (l || *eof) return l;
    double left = deadline - ps__now();
    if (left <= 0) return NULL;
    struct pollfd p = {c->fd, POLLIN, 0};
    poll(&p, 1, (int)(left * 1000) + 1);
  }
}

void psr_conn_close(psr_conn *c) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  free(c->buf);
  c->buf = NULL;
  c->len = c->cap = 0;
}

/* ---- sockets ----------------------------------------------------------------- */

void psr_peer_name(int fd, char *out, size_t len) {
  struct sockaddr_in sa;
  socklen_t sl = sizeof sa;
  char ip[INET_ADDRSTRLEN];
  if (getpeername(fd, (struct sockaddr *)&sa, &sl) != 0 || sa.sin_family != AF_INET ||
      !inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip)) {
    snprintf(out, len, "?");
    return;
  }
  snprintf(out, len, "%s:%d", ip, ntohs(sa.sin_port));
}

int psr_tcp_listen(const char *addr, int port, int *bound, char *err, size_t errlen) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, addr, &sa.sin_addr);
  int one = 1; /* a requeue reuses job and step ids: its TIME-WAIT leftovers must not block */
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 4096) != 0) {
    snprintf(err, errlen, "cannot listen on %s:%d: %s%s", addr, port, strerror(errno),
             errno == EADDRINUSE ? " (another process holds it: another job, or a stranger; "
                                   "the other tasks will not trust it; pass --rendezvous-port, "
                                   "or run srun with --resv-ports or --mpi=pmi2)"
                                 : "");
    if (fd >= 0) close(fd);
    return -1;
  }
  socklen_t sl = sizeof sa;
  getsockname(fd, (struct sockaddr *)&sa, &sl);
  *bound = ntohs(sa.sin_port);
  return fd;
}

/* One connection attempt to addr:port, given up at `until`: fd (blocking,
 * TCP_NODELAY), or -1 with errno (ETIMEDOUT when it took too long). */
static int connect_once(const char *addr, int port, double until) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, addr, &sa.sin_addr);
  int e = 0;
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    e = errno == EINPROGRESS ? ETIMEDOUT : errno;
    for (double left; e == ETIMEDOUT && (left = until - ps__now()) > 0;) {
      struct pollfd p = {fd, POLLOUT, 0};
      if (poll(&p, 1, (int)(left * 1000) + 1) <= 0) continue;
      socklen_t sl = sizeof e;
      if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &sl) != 0) e = errno;
    }
  }
  struct sockaddr_in me = {0}, peer = {0};
  socklen_t ml = sizeof me, pl = sizeof peer;
  if (!e && getsockname(fd, (struct sockaddr *)&me, &ml) == 0 &&
      getpeername(fd, (struct sockaddr *)&peer, &pl) == 0 && me.sin_port == peer.sin_port &&
      me.sin_addr.s_addr == peer.sin_addr.s_addr)
    e = ECONNREFUSED; /* connected to itself (a port in the ephemeral range, nobody there) */
  if (e) {
    close(fd);
    errno = e;
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

int psr_tcp_connect(const char *addr, int port, double deadline, int wait_listen, char *err,
                    size_t errlen) {
  ps__backoff b;
  ps__backoff_init(&b, PSR_CONNECT_RETRY_FIRST_S, PSR_CONNECT_RETRY_MAX_S);
  for (;;) {
    double until = ps__now() + PSR_CONNECT_TRY_S;
    int fd = connect_once(addr, port, until < deadline ? until : deadline);
    if (fd >= 0) return fd;
    int e = errno;
    if ((e == ECONNREFUSED && !wait_listen) || ps__backoff_sleep(&b, deadline) < 0) {
      snprintf(err, errlen, "cannot reach psrun task 0 at %s:%d: %s%s", addr, port, strerror(e),
               e == ECONNREFUSED && !wait_listen ? " (it no longer listens: it stopped)" : "");
      return -1;
    }
  }
}
