/*
 * shm.h - the shared-memory transport's segment (protocol 2.4,
 * docs/protocol.md §1a), shared by libpsclient and psd: a sealed memfd
 * the worker creates and hands to psd over a unix socket; tensor data
 * moves through two rings in it while the frames that describe the data
 * still travel over the TCP connection. Internal (ps__ names).
 *
 * Layout (offsets in bytes from the start of the segment):
 *
 *   [0, 4096)                    header: magic at 0 (the worker writes it;
 *                                psd ignores it), push_done at 64 (psd
 *                                writes), pull_done at 128 (the worker
 *                                writes), each a little-endian uint64
 *   [4096, 4096 + push)          push ring: the worker writes, psd reads
 *   [4096 + push, ... + pull)    pull ring: psd writes, the worker reads
 *
 * A frame whose header has PS__FLAG_SHM carries, after its protobuf part,
 * an 8-byte little-endian position `pos` instead of its data; the data_len
 * bytes are at ring offset pos % ring_size, never wrapping. Positions only
 * grow; the consumer of a ring stores pos + data_len in its done word once
 * it no longer reads them, and the producer never writes over bytes past
 * the last done it has seen.
 */
#ifndef PS_WIRE_SHM_H
#define PS_WIRE_SHM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Frame header flag: the data part is in the connection's segment. */
#define PS__FLAG_SHM 0x1u
/* What such a frame carries on the socket after its protobuf part. */
#define PS__SHM_DESC_BYTES 8u
/* The segment's header page. */
#define PS__SHM_HEADER_BYTES 4096u
#define PS__SHM_PUSH_DONE_OFF 64u  /* separate cache lines: the two sides */
#define PS__SHM_PULL_DONE_OFF 128u /* write them concurrently */
/* Ring sizes a segment may have: a multiple of 4096 in [64 KiB, 256 MiB].
 * The upper bound caps what psd maps and writes per connection (the pull
 * ring's pages are charged to psd as it touches them). */
#define PS__SHM_RING_MIN ((uint64_t)64 << 10)
#define PS__SHM_RING_MAX ((uint64_t)256 << 20)
/* The reference client's rings: a 128 MiB push or pull of one step fits
 * (frames that do not fit go over TCP instead): a 1M x 16 table's push,
 * 72 MB of keys and gradients, went over TCP with 64 MiB rings and took
 * 161 ms a step, 139 ms through the ring. Only the pages a frame uses are
 * touched (an empty ring starts again at its first byte). */
#define PS__SHM_RING_DEFAULT ((uint64_t)128 << 20)
/* An empty ring restarts at its first byte once its head is this far into
 * a lap (or half the ring, if smaller), or when the frame would not fit
 * before the lap's end. So a small model keeps touching the same few
 * pages, while positions, which a restart moves to the next lap, grow at
 * most ring / this times as fast as the data (64x for the reference
 * client's 64 MiB rings: 2^64 positions last 256 PiB of data). */
#define PS__SHM_RESTART_BYTES ((uint64_t)1 << 20)
/* Ring positions advance in multiples of this: data starts cache-line
 * aligned, so floats are aligned and the two sides share no line. */
#define PS__SHM_ALIGN 64u
/* Per-connection token psd announces in the HelloReply; the handover
 * must present it. */
#define PS__SHM_TOKEN_BYTES 32u
/* The handover message on the unix socket: "PSDSHM1\0", the token, the
 * push and pull ring sizes (uint64 LE), with the memfd as SCM_RIGHTS. */
#define PS__SHM_HELLO_BYTES (8u + PS__SHM_TOKEN_BYTES + 16u)
/* psd's answer: int32 LE status (0 or a PS_E* code), then a sentence. */
#define PS__SHM_REPLY_MAX 512u
/* Host identity (boot id) announced in the HelloReply: at most this long. */
#define PS__SHM_HOST_ID_MAX 64u

/* One ring as its producer sees it (the consumer uses base and size). */
typedef struct ps__shm_ring {
  uint8_t *base;   /* first byte of the ring in the mapping */
  uint64_t size;   /* bytes */
  uint64_t head;   /* producer: next free position (a multiple of
                      PS__SHM_ALIGN); grows forever */
  uint64_t floor;  /* producer: where it last restarted an empty ring at
                      a lap's first byte; every byte below was consumed
                      or never written, whatever the done word says */
} ps__shm_ring;

/* A mapped segment. */
typedef struct ps__shm {
  uint8_t *map;          /* the mapping (NULL: none) */
  size_t map_len;        /* its length: header + push + pull */
  ps__shm_ring push;     /* worker -> psd */
  ps__shm_ring pull;     /* psd -> worker */
  uint64_t *push_done;   /* in the header: psd's done word of the push ring */
  uint64_t *pull_done;   /* ... the worker's of the pull ring */
} ps__shm;

/* 0 if push and pull are valid ring sizes, else PS_EINVAL with err. */
int ps__shm_check_sizes(uint64_t push, uint64_t pull, char *err, size_t errlen);
/* Worker: a new sealed memfd (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL) of
 * the two rings, mapped into s. Returns the descriptor (>= 0, kept open
 * for the handover) or a PS_E* code with err. */
int ps__shm_create(ps__shm *s, uint64_t push, uint64_t pull, char *err, size_t errlen);
/* psd: checks a descriptor a peer handed over before touching it — a
 * memfd on tmpfs (not hugetlbfs, not a file another process can truncate)
 * sealed against shrinking, growing and further seals, not against
 * writing, at least header + push + pull bytes long — and maps exactly
 * those bytes. A sealed segment cannot shrink, so no access to the
 * mapping can raise SIGBUS. 0 or a PS_E* code with a sentence in err
 * (nothing mapped). fd stays the caller's. */
int ps__shm_attach(ps__shm *s, int fd, uint64_t push, uint64_t pull, char *err,
                   size_t errlen);
/* Unmaps s (no-op when nothing is mapped). */
void ps__shm_unmap(ps__shm *s);

/* Producer: room for len bytes in r, given the consumer's done word
 * (possibly garbage, when the consumer is hostile: a value past the head
 * or more than a ring behind it counts as a full ring; one below r->floor
 * as r->floor). NULL, with nothing changed, when the ring is full. On
 * success *pos is the position to send and the return value where to
 * write. Never points outside r. */
void *ps__shm_reserve(ps__shm_ring *r, uint64_t done, uint64_t len, uint64_t *pos);
/* Consumer: where a frame's len bytes at pos are, or NULL when they are
 * not inside r (the frame is then a protocol error). */
const void *ps__shm_locate(const ps__shm_ring *r, uint64_t pos, uint64_t len);
/* The done words: loaded with acquire, stored with release ordering. */
uint64_t ps__shm_load(const uint64_t *word);
void ps__shm_store(uint64_t *word, uint64_t v);

/* The position a PS__FLAG_SHM frame carries after its protobuf part. */
static inline uint64_t ps__shm_desc_decode(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

/* The handover message and its parts. decode: 0, or PS_EPROTO with err. */
void ps__shm_hello_encode(uint8_t out[PS__SHM_HELLO_BYTES],
                          const uint8_t token[PS__SHM_TOKEN_BYTES], uint64_t push,
                          uint64_t pull);
int ps__shm_hello_decode(const uint8_t *in, size_t n, uint8_t token[PS__SHM_TOKEN_BYTES],
                         uint64_t *push, uint64_t *pull, char *err, size_t errlen);

/* The handover socket's messages (SOCK_SEQPACKET: one message each). */
/* Descriptors one message may carry that the receiver still takes (and
 * closes): one is the protocol; a few more are read so that none stays
 * queued on the socket, and MSG_CTRUNC tells of the rest, which the
 * kernel closes. */
#define PS__SHM_MAX_FDS 4
/* Sends msg with nfds (0..PS__SHM_MAX_FDS) descriptors as SCM_RIGHTS:
 * 0, or -errno. */
int ps__shm_send_fds(int s, const void *msg, size_t len, const int *fds, int nfds);
/* Receives one message into buf (at most len bytes) without blocking,
 * taking up to maxfds descriptors (close-on-exec) into fds and closing
 * any more; *ctrunc is 1 when some were dropped or closed. Returns
 * recvmsg's result (-1 with errno; *nfds is then 0). */
ssize_t ps__shm_recv_fds(int s, void *buf, size_t len, int *fds, int maxfds, int *nfds,
                         int *ctrunc);
/* psd's answer: an int32 LE status (0 or a PS_E* code), then why without
 * its NUL (cut to fit). Returns the message's length. */
size_t ps__shm_reply_encode(uint8_t out[PS__SHM_REPLY_MAX], int status, const char *why);
/* Reads an answer of n bytes: its status (PS_EPROTO for a message too
 * short to be one, or a positive status) with its sentence in why. */
int ps__shm_reply_decode(const uint8_t *in, size_t n, char *why, size_t whylen);
/* Sends a handover (msg and fds) on the connected socket s and reads the
 * answer (s's receive timeout bounds the wait). The answer is read also
 * when the send finds the socket closed: psd answers a peer it refuses at
 * accept at once and closes. psd's status and sentence; PS_ETIMEDOUT when
 * the message went out and the answer did not come in time (psd may have
 * attached the segment); PS_EIO when nothing was handed over. */
int ps__shm_handover(int s, const void *msg, size_t len, const int *fds, int nfds, char *why,
                     size_t whylen);

/* This node's identity: the kernel's boot id (the host name when it cannot
 * be read), at most PS__SHM_HOST_ID_MAX - 1 characters. */
void ps__shm_host_id(char *out, size_t outlen);

#endif /* PS_WIRE_SHM_H */
