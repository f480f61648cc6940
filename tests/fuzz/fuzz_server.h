/*
 * fuzz_server.h - drives a real, in-process psd server with fuzz input.
 *
 * One psd_server per fuzzing process, made with psd_config_parse and
 * psd_server_init as psd's main does (listening on 127.0.0.1, port 0, never
 * used). Each input opens one or more client connections: socketpairs
 * whose server ends are handed to psd_conn_new, as on_accept would. The
 * bytes are written in pieces while the harness turns the libevent loop,
 * replies are read and checked, the write sides are shut, and the loop
 * runs until psd has closed every connection. The server's state (pin,
 * workers, slices) carries over to the next input unless the caller asked
 * for a fresh server per input, or it would make later inputs meaningless
 * (see server_spent and hello_conflicts_with_pin in fuzz_server.c).
 */
#ifndef PS_FUZZ_SERVER_H
#define PS_FUZZ_SERVER_H

#include <stddef.h>
#include <stdint.h>

/* Declared here so the targets compile under -Wmissing-prototypes. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* Every nonce psd draws is this byte repeated (fuzz_server_configure
 * makes libsodium's random bytes constant). */
#define FUZZ_NONCE_BYTE 0x5a

/* Call before the first input. secret: the shared secret psd requires in
 * every Hello (set as PSD_SECRET, as for psd), or NULL for none. fresh: a
 * new server for every input instead of carrying state over (the
 * environment variable FUZZ_FRESH=1 asks for that too). */
void fuzz_server_configure(const char *secret, int fresh);

/* Connections one input may open. */
#define FUZZ_MAX_CONNS 4u

/* The next len bytes of connection conn's stream. */
typedef struct fuzz_segment {
  unsigned conn;
  size_t len;
} fuzz_segment;

/* Opens nconns connections to psd (in index order) and sends stream i on
 * connection i: segment by segment in the order given, turning psd's loop
 * in between, so frames of different connections arrive in that order;
 * then what the segments left of each stream. Then shuts every write side
 * and returns once psd has closed every connection. Aborts (a fuzzer
 * finding) if psd neither reads, writes nor closes for 5 s, or sends a
 * malformed frame. shape seeds how bytes are split into writes and how
 * eagerly replies are read (0: derived from the bytes). */
void fuzz_server_run(const uint8_t *const *streams, const size_t *sizes, unsigned nconns,
                     const fuzz_segment *segs, size_t nsegs, uint64_t shape);

/* fuzz_server_run with one connection and one stream. */
void fuzz_server_feed(const uint8_t *data, size_t size, uint64_t shape);

/* Bytes of Register slices (parameters, accumulator and optimizer state)
 * an input may make psd allocate; frames past the budget are not sent.
 * psd itself has no such cap (see docs/psd.md). */
#define FUZZ_REGISTER_BUDGET ((uint64_t)64 << 20)

/* The pin every input may rely on: what a fresh server gets from the seed
 * corpus's Hello (2 workers, replicas 2, sync, default placement inputs).
 * Inputs that pin anything else get a fresh server after them. */
#define FUZZ_WORKERS 2u

#endif
