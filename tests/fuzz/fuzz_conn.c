/*
 * fuzz_conn - psd's connection state machine end to end (psd/conn.c,
 * psd/server.c, psd/shard.c, psd/optimizer.c): the input is the byte
 * stream a client sends on one connection to a live in-process psd
 * (2 workers; see fuzz_server.h). psd must survive every input, close the
 * connection once the input ends, and only ever send well-formed frames.
 */
#include "fuzz_server.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  fuzz_server_configure(NULL, 0); /* no shared secret; state carries over */
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_server_feed(data, size, 0);
  return 0;
}
