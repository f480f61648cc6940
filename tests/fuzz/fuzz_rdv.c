/*
 * fuzz_rdv - psrun's rendezvous codec (psrun/rendezvous.c): what task 0
 * decodes from any connection to its port, and what a member decodes
 * from whatever listens there. The input is one line (cut at the first
 * '\n' or NUL) given to psr_msg_decode.
 *
 * Checked beyond "no crash": an accepted message re-encodes (HELLO, ROLE,
 * RDV, PSADDR, HOSTS, EXIT: every field the decoder accepted is sendable)
 * and decodes again to the same fields; text fields point inside the line.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_server.h" /* LLVMFuzzerTestOneInput prototype */
#include "rendezvous.h"

#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      fprintf(stderr, "fuzz_rdv: check failed: %s: ", #cond); \
      fprintf(stderr, __VA_ARGS__);                             \
      fprintf(stderr, "\n");                                    \
      abort();                                                  \
    }                                                           \
  } while (0)

/* Same fields of the type both carry. */
static int same(const psr_msg *a, const psr_msg *b) {
  if (a->type != b->type) return 0;
  switch (a->type) {
  case PSR_MSG_HELLO:
    return a->hello.job_id == b->hello.job_id && a->hello.step_id == b->hello.step_id &&
           a->hello.uid == b->hello.uid && a->hello.ntasks == b->hello.ntasks &&
           a->hello.rank == b->hello.rank && a->hello.localid == b->hello.localid &&
           strcmp(a->hello.node, b->hello.node) == 0 &&
           strcmp(a->hello.nonce, b->hello.nonce) == 0 &&
           strcmp(a->hello.proof, b->hello.proof) == 0;
  case PSR_MSG_ROLE:
    return a->role.is_ps == b->role.is_ps && a->role.index == b->role.index &&
           a->role.num_ps == b->role.num_ps && a->role.num_workers == b->role.num_workers &&
           strcmp(a->role.proof, b->role.proof) == 0;
  case PSR_MSG_EXIT:
    return a->code == b->code;
  case PSR_MSG_PSADDR:
  case PSR_MSG_HOSTS:
    return strcmp(a->mac, b->mac) == 0 && strcmp(a->text, b->text) == 0;
  default:
    return strcmp(a->text, b->text) == 0;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  size_t n = 0;
  while (n < size && data[n] != '\n' && data[n] != '\0') n++;
  if (n >= PSR_LINE_MAX_BYTES) return 0;
  char *line = malloc(n + 1);
  if (!line) return 0;
  memcpy(line, data, n);
  line[n] = '\0';
  psr_msg m;
  if (psr_msg_decode(line, &m) == 0) {
    CHECK((unsigned)m.type < PSR_MSG_COUNT, "type %d", (int)m.type);
    int texty = m.type != PSR_MSG_HELLO && m.type != PSR_MSG_ROLE && m.type != PSR_MSG_EXIT;
    CHECK(!texty || (m.text >= line && m.text <= line + n), "text outside the line");
    /* Free text (REJECT, ABORT) may hold what the encoder refuses to send
     * (a tab is fine, '\r' is not): only the structured messages must
     * re-encode. */
    int structured = m.type != PSR_MSG_REJECT && m.type != PSR_MSG_ABORT;
    char *buf = malloc(PSR_LINE_MAX_BYTES);
    CHECK(buf != NULL, "out of memory");
    int len = psr_msg_encode(&m, buf, PSR_LINE_MAX_BYTES);
    CHECK(!structured || len >= 0, "accepted '%s' but cannot re-encode it", line);
    if (len >= 0) {
      psr_msg again;
      CHECK(psr_msg_decode(buf, &again) == 0, "re-encoded '%s' does not decode", buf);
      CHECK(same(&m, &again), "'%s' -> '%s' changed fields", line, buf);
    }
    free(buf);
  }
  free(line);
  return 0;
}
