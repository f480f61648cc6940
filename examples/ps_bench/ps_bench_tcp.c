/* ps_bench_tcp.c - the raw TCP baselines of --tcp-baseline, over loopback,
 * once a round: "tcp_stream" (one connection streaming) and "tcp_rtt"
 * (median round trip of 4-byte messages, client and server pinned where
 * worker 0 and psd 0 run). */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "ps_bench_internal.h"

/* ---------------------------------------------------------------------- */
/* Sockets */

static void set_sock_opts(int fd, int bufsize) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (bufsize > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufsize, sizeof bufsize);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufsize, sizeof bufsize);
  }
}

/* A listening socket on 127.0.0.1, any port. */
static int tcp_listen(int bufsize, struct sockaddr_in *addr, char *err, size_t errlen) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(err, errlen, "socket: %s", strerror(errno));
    return -1;
  }
  set_sock_opts(fd, bufsize); /* inherited by the accepted socket */
  memset(addr, 0, sizeof *addr);
  addr->sin_family = AF_INET;
  addr->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof *addr;
  if (bind(fd, (struct sockaddr *)addr, sizeof *addr) != 0 || listen(fd, 4) != 0 ||
      getsockname(fd, (struct sockaddr *)addr, &len) != 0) {
    snprintf(err, errlen, "bind/listen on 127.0.0.1: %s", strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

static int tcp_connect(const struct sockaddr_in *addr, int bufsize, char *err, size_t errlen) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(err, errlen, "socket: %s", strerror(errno));
    return -1;
  }
  set_sock_opts(fd, bufsize);
  while (connect(fd, (const struct sockaddr *)addr, sizeof *addr) != 0) {
    if (errno == EINTR && !g_interrupted) continue;
    snprintf(err, errlen, "connect to 127.0.0.1:%d: %s", ntohs(addr->sin_port),
             strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

/* ---------------------------------------------------------------------- */
/* Stream */

/* Child side: accept one connection and read `total` bytes, then ack. */
static int stream_receiver(int lfd, uint64_t total) {
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd < 0) return 1;
  close(lfd);
  set_sock_opts(fd, STREAM_SOCKBUF);
  char *buf = malloc(STREAM_CHUNK);
  if (!buf) return 1;
  uint64_t got = 0;
  while (got < total) {
    ssize_t n = read(fd, buf, STREAM_CHUNK);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return 1;
    got += (uint64_t)n;
  }
  char ack = 'A';
  if (write_all(fd, &ack, 1) != 0) return 1;
  close(fd);
  free(buf);
  return 0;
}

/* Sends `total` bytes on fd and waits for the ack; seconds, or < 0. */
static double stream_send(int fd, uint64_t total, char *err, size_t errlen) {
  char *buf = malloc(STREAM_CHUNK);
  if (!buf) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  memset(buf, 0x5a, STREAM_CHUNK);
  double secs = -1;
  double t0 = now_s();
  for (uint64_t sent = 0; sent < total;) {
    size_t n = total - sent < STREAM_CHUNK ? (size_t)(total - sent) : STREAM_CHUNK;
    if (write_all(fd, buf, n) != 0 || g_interrupted) {
      snprintf(err, errlen, "%s", g_interrupted ? "interrupted" : strerror(errno));
      goto out;
    }
    sent += n;
  }
  char ack;
  if (read_all(fd, &ack, 1) != 0) {
    snprintf(err, errlen, "the receiver sent no ack");
    goto out;
  }
  secs = now_s() - t0;
out:
  free(buf);
  return secs;
}

/* One timed stream of `total` bytes; seconds, or < 0 on error. */
static double stream_once(uint64_t total, char *err, size_t errlen) {
  struct sockaddr_in addr;
  int lfd = tcp_listen(STREAM_SOCKBUF, &addr, err, errlen);
  if (lfd < 0) return -1;
  proc rx;
  memset(&rx, 0, sizeof rx);
  pid_t pid = fork_child();
  if (pid < 0) {
    snprintf(err, errlen, "fork: %s", strerror(errno));
    close(lfd);
    return -1;
  }
  if (pid == 0) _exit(stream_receiver(lfd, total));
  rx.pid = pid;
  close(lfd);
  double secs = -1;
  int fd = tcp_connect(&addr, STREAM_SOCKBUF, err, errlen);
  if (fd >= 0) {
    secs = stream_send(fd, total, err, errlen);
    close(fd);
  }
  if (secs < 0) proc_kill(&rx);
  else {
    proc_reap(&rx, 1);
    if (!WIFEXITED(rx.status) || WEXITSTATUS(rx.status) != 0) {
      snprintf(err, errlen, "the receiver failed");
      secs = -1;
    }
  }
  return secs;
}

/* Four times the largest size, at least 256 MiB (a shorter stream is
 * dominated by its start), at most 1 GiB. */
uint64_t tcp_stream_bytes(void) {
  uint64_t largest = 0;
  for (int i = 0; i < opt.n_sizes; i++)
    if (opt.sizes[i] > largest) largest = opt.sizes[i];
  uint64_t total = 256ULL << 20;
  if (largest * 4 > total) total = largest * 4;
  if (total > (1ULL << 30)) total = 1ULL << 30;
  return total;
}

double tcp_stream_round(double *ms) {
  char err[512], label[32];
  uint64_t total = tcp_stream_bytes();
  progress("tcp_stream %s", size_label(total, label, sizeof label));
  double s = stream_once(total, err, sizeof err);
  *ms = NAN;
  if (!(s > 0)) {
    progress("tcp_stream failed: %s", err);
    return NAN;
  }
  *ms = s * 1e3;
  return (double)total / s / 1e9;
}

/* ---------------------------------------------------------------------- */
/* Round trips */

static int echo_server(int lfd) {
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd < 0) return 1;
  close(lfd);
  set_sock_opts(fd, 0);
  char m[4];
  for (;;) {
    ssize_t n = 0;
    size_t got = 0;
    while (got < sizeof m) {
      n = read(fd, m + got, sizeof m - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += (size_t)n;
    }
    if (got == 0 && n == 0) return 0; /* clean close */
    if (got < sizeof m) return 1;
    if (write_all(fd, m, sizeof m) != 0) return 1;
  }
}

/* Times RTT_WARMUP + RTT_ITERS round trips on fd into t (RTT_ITERS). */
static int rtt_loop(int fd, double *t, char *err, size_t errlen) {
  uint32_t msg = 0, back;
  for (int i = 0; i < RTT_WARMUP + RTT_ITERS; i++) {
    msg++;
    double t0 = now_s();
    if (write_all(fd, &msg, sizeof msg) != 0 || read_all(fd, &back, sizeof back) != 0) {
      snprintf(err, errlen, "%s", g_interrupted ? "interrupted" : "echo connection lost");
      return -1;
    }
    double t1 = now_s();
    if (back != msg) {
      snprintf(err, errlen, "echo returned the wrong message");
      return -1;
    }
    if (i >= RTT_WARMUP) t[i - RTT_WARMUP] = t1 - t0;
  }
  return 0;
}

/* Median round trip in seconds, or < 0 on error. */
static double rtt_measure(char *err, size_t errlen) {
  struct sockaddr_in addr;
  int lfd = tcp_listen(0, &addr, err, errlen);
  if (lfd < 0) return -1;
  proc srv;
  memset(&srv, 0, sizeof srv);
  pid_t pid = fork_child();
  if (pid < 0) {
    snprintf(err, errlen, "fork: %s", strerror(errno));
    close(lfd);
    return -1;
  }
  if (pid == 0) {
    pin_cpu(-1); /* where psd 0 runs */
    _exit(echo_server(lfd));
  }
  pin_cpu(0); /* where worker 0 runs */
  srv.pid = pid;
  close(lfd);
  double result = -1;
  double *t = malloc(RTT_ITERS * sizeof *t);
  int fd = tcp_connect(&addr, 0, err, errlen);
  if (!t) snprintf(err, errlen, "out of memory");
  else if (fd >= 0 && rtt_loop(fd, t, err, errlen) == 0) result = median(t, RTT_ITERS);
  unpin_cpu();
  free(t);
  if (fd >= 0) close(fd);
  if (result < 0) proc_kill(&srv);
  else proc_reap(&srv, 1);
  return result;
}

double tcp_rtt_round(void) {
  char err[512];
  progress("tcp_rtt %d round trips", RTT_ITERS);
  double rtt = rtt_measure(err, sizeof err);
  if (!(rtt > 0)) {
    progress("tcp_rtt failed: %s", err);
    return NAN;
  }
  return rtt * 1e3;
}
