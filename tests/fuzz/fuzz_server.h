/*
 * fuzz_server.h - drives a real, in-process psd server with fuzz input.
 *
 * One psd_server per fuzzing process, made with psd_config_parse and
 * psd_server_init exactly as psd's main does (listening on 127.0.0.1, port
 * 0, never used). Each input becomes one client connection: a socketpair
 * whose server end is handed to psd_conn_new, as on_accept would. The bytes
 * are written in pieces while the harness turns the libevent loop, replies
 * are read and thrown away, the write side is shut, and the loop runs until
 * psd closes its end. The server's state (pin, workers, slices) carries
 * over to the next input unless it would make later inputs meaningless
 * (see fuzz_server_feed).
 */
#ifndef PS_FUZZ_SERVER_H
#define PS_FUZZ_SERVER_H

#include <stddef.h>
#include <stdint.h>

/* Declared here so the targets compile under -Wmissing-prototypes. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* Feeds `size` bytes to psd on a fresh connection and returns once psd has
 * closed it. Aborts (a fuzzer finding) if psd neither reads nor closes the
 * connection for 5 s. `shape` seeds how the bytes are split into writes
 * and how eagerly replies are read (0: derive it from the bytes). */
void fuzz_server_feed(const uint8_t *data, size_t size, uint64_t shape);

/* Bytes of Register slices (parameters, accumulator and optimizer state)
 * an input may make psd allocate; frames past the budget are not sent.
 * psd itself has no such cap (see README). */
#define FUZZ_REGISTER_BUDGET ((uint64_t)64 << 20)

/* The pin every input may rely on: what a fresh server gets from the seed
 * corpus's Hello (2 workers, replicas 2, sync, default placement inputs).
 * Inputs that pin anything else get a fresh server after them. */
#define FUZZ_WORKERS 2u

#endif
