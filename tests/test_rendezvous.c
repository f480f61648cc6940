/* psrun's control channel: the codec (psrun/rendezvous.c): every message
 * round-trips, the wire lines are the documented ones, malformed lines
 * and unsendable fields are refused, lines cross a socket pair intact;
 * and its proofs (psrun/rdvauth.c), by the job's key and by MUNGE. */
#include <check.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "rdvauth.h"
#include "rendezvous.h"
#include "testutil.h"

static const char SECRET[] = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/* Encodes m, checks the line, decodes it back into *out. */
static void round_trip(const psr_msg *m, const char *want, psr_msg *out, char *buf, size_t cap) {
  int n = psr_msg_encode(m, buf, cap);
  ck_assert_int_eq(n, (int)strlen(want));
  ck_assert_str_eq(buf, want);
  ck_assert_int_eq(psr_msg_decode(buf, out), 0);
  ck_assert_int_eq(out->type, m->type);
}

static const char NONCE[] = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

START_TEST(test_round_trips) {
  char buf[4096], want[3000];
  psr_msg m = {.type = PSR_MSG_HELLO}, d;
  m.hello = (psr_hello){4242, 7, 1000, 16, 3, "node-a", 1, "", ""};
  memcpy(m.hello.nonce, NONCE, sizeof NONCE);
  snprintf(m.hello.proof, sizeof m.hello.proof, "MUNGE:AwQDAAB+x/=:");
  snprintf(want, sizeof want, "HELLO PSRUN2 4242 7 1000 16 3 node-a 1 %s MUNGE:AwQDAAB+x/=:",
           NONCE);
  round_trip(&m, want, &d, buf, sizeof buf);
  ck_assert(d.hello.job_id == 4242 && d.hello.step_id == 7 && d.hello.uid == 1000);
  ck_assert_int_eq(d.hello.ntasks, 16);
  ck_assert_int_eq(d.hello.rank, 3);
  ck_assert_str_eq(d.hello.node, "node-a");
  ck_assert_int_eq(d.hello.localid, 1);
  ck_assert_str_eq(d.hello.nonce, NONCE);
  ck_assert_str_eq(d.hello.proof, "MUNGE:AwQDAAB+x/=:");
  m.hello.job_id = 4294967295LL; /* the largest Slurm job id */
  memset(m.hello.proof, 'A', PSR_PROOF_MAX - 2); /* the longest proof */
  m.hello.proof[PSR_PROOF_MAX - 2] = '\0';
  ck_assert_int_gt(psr_msg_encode(&m, buf, sizeof buf), 0);
  ck_assert_int_eq(psr_msg_decode(buf, &d), 0);
  ck_assert(d.hello.job_id == 4294967295LL);
  ck_assert_str_eq(d.hello.proof, m.hello.proof);

  m = (psr_msg){.type = PSR_MSG_ROLE};
  m.role = (psr_assign){1, 2, 3, 5, ""};
  memcpy(m.role.proof, SECRET, sizeof SECRET);
  snprintf(want, sizeof want, "ROLE ps 2 3 5 %s", SECRET);
  round_trip(&m, want, &d, buf, sizeof buf);
  ck_assert_int_eq(d.role.is_ps, 1);
  ck_assert_int_eq(d.role.index, 2);
  ck_assert_int_eq(d.role.num_ps, 3);
  ck_assert_int_eq(d.role.num_workers, 5);
  ck_assert_str_eq(d.role.proof, SECRET);
  m.role.is_ps = 0;
  snprintf(want, sizeof want, "ROLE worker 2 3 5 %s", SECRET);
  round_trip(&m, want, &d, buf, sizeof buf);
  ck_assert_int_eq(d.role.is_ps, 0);

  m = (psr_msg){.type = PSR_MSG_RDV, .text = "munge"};
  round_trip(&m, "RDV PSRUN2 munge", &d, buf, sizeof buf);
  ck_assert_str_eq(d.text, "munge");

  m = (psr_msg){.type = PSR_MSG_PSADDR, .text = "10.0.0.1:4000"};
  memcpy(m.mac, SECRET, sizeof SECRET);
  snprintf(want, sizeof want, "PSADDR %s 10.0.0.1:4000", SECRET);
  round_trip(&m, want, &d, buf, sizeof buf);
  ck_assert_str_eq(d.text, "10.0.0.1:4000");
  ck_assert_str_eq(d.mac, SECRET);
  m = (psr_msg){.type = PSR_MSG_HOSTS, .text = "a:1,b:2"};
  memcpy(m.mac, SECRET, sizeof SECRET);
  snprintf(want, sizeof want, "HOSTS %s a:1,b:2", SECRET);
  round_trip(&m, want, &d, buf, sizeof buf);
  ck_assert_str_eq(d.text, "a:1,b:2");

  m = (psr_msg){.type = PSR_MSG_EXIT, .code = 75};
  round_trip(&m, "EXIT 75", &d, buf, sizeof buf);
  ck_assert_int_eq(d.code, 75);

  const struct {
    psr_msg_type t;
    const char *text, *line;
  } texts[] = {
      {PSR_MSG_REJECT, "rank 9 is invalid", "REJECT rank 9 is invalid"},
      {PSR_MSG_ABORT, "task 3 on n1 exited with status 1", "ABORT task 3 on n1 exited with status 1"},
      {PSR_MSG_ABORT, "", "ABORT"},
  };
  for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
    m = (psr_msg){.type = texts[i].t, .text = texts[i].text};
    round_trip(&m, texts[i].line, &d, buf, sizeof buf);
    ck_assert_str_eq(d.text, texts[i].text);
  }
  ck_assert_str_eq(psr_msg_name(PSR_MSG_PSADDR), "PSADDR");
}
END_TEST

START_TEST(test_malformed) {
  psr_msg d;
  char h1[300], h2[300], h3[300], p1[300], longp[PSR_PROOF_MAX + 100];
  snprintf(h1, sizeof h1, "HELLO PSRUN1 1 2 3 4 5 n 0 %s abc", NONCE); /* old version */
  snprintf(h2, sizeof h2, "HELLO PSRUN2 1 2 3 4 5 n 0 %.63s abc", NONCE); /* short nonce */
  snprintf(h3, sizeof h3, "HELLO PSRUN2 1 2 3 4 5 n 0 %s a\"b", NONCE);  /* odd proof */
  snprintf(p1, sizeof p1, "PSADDR %.63sX 10.0.0.1:1", NONCE);           /* mac not hex */
  char p2[300]; /* a carriage return the encoder would refuse (found by fuzz_rdv) */
  snprintf(p2, sizeof p2, "PSADDR %s AB\r11", NONCE);
  memset(longp, 'A', sizeof longp - 1);
  longp[sizeof longp - 1] = '\0';
  memcpy(longp, "ROLE ps 1 2 3 ", 14);
  const char *bad[] = {
      "", "HELLO", "HELLO PSRUN2 1 2 3 4 5 n 0", "HELLO PSRUN1 1 2 3 4 5 n 0", h1, h2, h3,
      "hello PSRUN2 1 2 3 4 5 n 0", "ROLE boss 1 2 3 abc", "ROLE ps 1 2", "ROLE ps 1 2 3",
      longp, "EXIT", "EXIT x", "PSADDR", "PSADDR a b", "PSADDR 10.0.0.1:1", p1, p2, "HOSTS",
      "RDV", "RDV PSRUN1 key", "RDV PSRUN2", "BOGUS 1", " HELLO PSRUN2 1 2 3 4 5 n 0",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_msg(psr_msg_decode(bad[i], &d) == -1, "'%s' accepted", bad[i]);
  /* Fields that cannot be sent. */
  char buf[512];
  psr_msg m = {.type = PSR_MSG_HELLO};
  m.hello = (psr_hello){1, 2, 3, 4, 1, "two words", 0, "", "abc"};
  memcpy(m.hello.nonce, NONCE, sizeof NONCE);
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
  snprintf(m.hello.node, sizeof m.hello.node, "n1");
  ck_assert_int_gt(psr_msg_encode(&m, buf, sizeof buf), 0);
  m.hello.nonce[3] = 'X'; /* not hex */
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
  m = (psr_msg){.type = PSR_MSG_ROLE};
  m.role = (psr_assign){1, 0, 1, 1, "two words"};
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
  m = (psr_msg){.type = PSR_MSG_PSADDR, .text = "a:1", .mac = "short"};
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
  m = (psr_msg){.type = PSR_MSG_ABORT, .text = "two\nlines"};
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
  m = (psr_msg){.type = PSR_MSG_REJECT, .text = "far too long for the buffer"};
  ck_assert_int_eq(psr_msg_encode(&m, buf, 8), -1);
  m = (psr_msg){.type = PSR_MSG_COUNT};
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
}
END_TEST

/* A check-in and its answer, proven by `a` and checked by `b`. */
static int prove(const psr_auth *a, const psr_auth *b, psr_hello *h, char *why, size_t wl) {
  long long uid;
  h->rank = 1;
  ck_assert_int_eq(psr_auth_nonce(h->nonce), 0);
  if (psr_auth_hello_proof(a, h, why, wl) != 0) return -1;
  return psr_auth_check_hello(b, h, &uid, why, wl);
}

/* The key mode: a check-in proven with the job's key is accepted; another
 * key, job, step, rank or nonce is refused; the role's answer is bound to
 * the member's nonce and both sides derive the same secret. */
START_TEST(test_key_proofs) {
  psr_auth a = {PSR_AUTH_KEY, {0}, 42, 3, ""}, other = a;
  for (int i = 0; i < PSR_KEY_BYTES; i++) a.key[i] = (uint8_t)i, other.key[i] = (uint8_t)(i + 1);
  psr_hello h = {0};
  char why[512];
  ck_assert_int_eq(prove(&a, &a, &h, why, sizeof why), 0);
  ck_assert_int_eq(prove(&other, &a, &h, why, sizeof why), -1);
  ck_assert_str_eq(why, "its proof does not match the job's key");
  psr_hello t = h; /* a valid check-in, altered */
  ck_assert_int_eq(prove(&a, &a, &t, why, sizeof why), 0);
  long long uid;
  t.rank = 2;
  ck_assert_int_eq(psr_auth_check_hello(&a, &t, &uid, why, sizeof why), -1);
  t.rank = 1;
  t.nonce[0] = t.nonce[0] == 'a' ? 'b' : 'a';
  ck_assert_int_eq(psr_auth_check_hello(&a, &t, &uid, why, sizeof why), -1);
  psr_auth job2 = a;
  job2.job_id = 43;
  ck_assert_int_eq(prove(&a, &job2, &h, why, sizeof why), -1);
  job2 = a;
  job2.step_id = 4;
  ck_assert_int_eq(prove(&a, &job2, &h, why, sizeof why), -1);

  ck_assert_int_eq(prove(&a, &a, &h, why, sizeof why), 0);
  psr_assign r = {0, 1, 1, 1, ""};
  char secret0[65], secret1[65], sock[64];
  ck_assert_int_eq(psr_auth_key_secret(&a, secret0), 0);
  ck_assert_int_eq(psr_auth_role_proof(&a, &h, &r, secret0, why, sizeof why), 0);
  ck_assert_int_eq(psr_auth_check_role(&a, &h, &r, secret1, sock, sizeof sock, why, sizeof why), 0);
  ck_assert_str_eq(secret0, secret1);
  ck_assert(strstr(r.proof, secret0) == NULL); /* the secret is not sent */
  psr_assign forged = r;
  forged.is_ps = 1; /* another role under the same proof */
  ck_assert_int_eq(psr_auth_check_role(&a, &h, &forged, secret1, sock, sizeof sock, why, sizeof why), -1);
  psr_hello h2 = h;
  h2.nonce[5] = h2.nonce[5] == '0' ? '1' : '0'; /* an answer to another check-in */
  ck_assert_int_eq(psr_auth_check_role(&a, &h2, &r, secret1, sock, sizeof sock, why, sizeof why), -1);
  ck_assert_int_eq(psr_auth_check_role(&other, &h, &r, secret1, sock, sizeof sock, why, sizeof why), -1);

  char mac[PSR_HEX_LEN + 1];
  ck_assert_int_eq(psr_auth_text_mac(secret0, "PSADDR", 1, h.nonce, "10.0.0.1:5", mac), 0);
  ck_assert(psr_auth_text_ok(secret0, "PSADDR", 1, h.nonce, "10.0.0.1:5", mac));
  ck_assert(!psr_auth_text_ok(secret0, "PSADDR", 1, h.nonce, "10.6.6.6:5", mac));
  ck_assert(!psr_auth_text_ok(secret0, "HOSTS", 1, h.nonce, "10.0.0.1:5", mac));
  ck_assert(!psr_auth_text_ok(secret0, "PSADDR", 2, h.nonce, "10.0.0.1:5", mac));
  uint8_t k2[PSR_KEY_BYTES];
  char hex[PSR_HEX_LEN + 1];
  psr_auth_key_hex(a.key, hex);
  ck_assert_int_eq(psr_auth_key_unhex(hex, k2), 0);
  ck_assert_int_eq(memcmp(k2, a.key, sizeof k2), 0);
  ck_assert_int_eq(psr_auth_key_unhex("00", k2), -1);
  ck_assert_int_eq(psr_auth_mode_parse("munge"), PSR_AUTH_MUNGE);
  ck_assert_int_eq(psr_auth_mode_parse("none"), -1);
}
END_TEST

/* A private munged (tu_munged_start); munged is a declared dependency, so
 * failing to start it fails the test. */
static char g_sock[600];

static void start_munged(void) {
  char why[4096];
  const char *sock = tu_munged_start(why, sizeof why);
  ck_assert_msg(sock, "%s", why);
  snprintf(g_sock, sizeof g_sock, "%s", sock);
}

static void stop_munged(void) {
  tu_munged_stop();
  g_sock[0] = '\0';
}

/* The MUNGE mode: the check-in's credential binds job, step, rank and
 * nonce; a replayed one is refused by munged; the answer carries the
 * secret (only inside the credential) and the munged socket. */
START_TEST(test_munge_proofs) {
  start_munged();
  psr_auth a = {PSR_AUTH_MUNGE, {0}, 42, 3, g_sock};
  psr_hello h = {0};
  char why[512];
  ck_assert_msg(prove(&a, &a, &h, why, sizeof why) == 0, "%s", why);
  ck_assert_msg(strncmp(h.proof, "MUNGE:", 6) == 0, "%s", h.proof);
  long long uid;
  ck_assert_int_eq(psr_auth_check_hello(&a, &h, &uid, why, sizeof why), -1); /* replayed */
  ck_assert_msg(strstr(why, "MUNGE credential is not valid"), "%s", why);
  ck_assert_int_eq(prove(&a, &a, &h, why, sizeof why), 0);
  psr_hello t = h;
  ck_assert_int_eq(prove(&a, &a, &t, why, sizeof why), 0);
  t.rank = 2; /* a fresh credential, claimed for another rank */
  psr_hello u = t;
  u.rank = 1;
  ck_assert_int_eq(psr_auth_hello_proof(&a, &u, why, sizeof why), 0);
  u.rank = 2;
  ck_assert_int_eq(psr_auth_check_hello(&a, &u, &uid, why, sizeof why), -1);
  ck_assert_msg(strstr(why, "names another job, step, rank or nonce"), "%s", why);
  psr_auth job2 = a;
  job2.job_id = 43;
  ck_assert_int_eq(prove(&a, &job2, &h, why, sizeof why), -1);

  ck_assert_int_eq(prove(&a, &a, &h, why, sizeof why), 0);
  psr_assign r = {1, 0, 1, 1, ""};
  char secret[65], sock[700];
  ck_assert_int_eq(psr_auth_role_proof(&a, &h, &r, SECRET, why, sizeof why), 0);
  ck_assert(strstr(r.proof, SECRET) == NULL); /* never in clear */
  ck_assert_msg(psr_auth_check_role(&a, &h, &r, secret, sock, sizeof sock, why, sizeof why) == 0,
                "%s", why);
  ck_assert_str_eq(secret, SECRET);
  ck_assert_str_eq(sock, g_sock);
  ck_assert_int_eq(psr_auth_role_proof(&a, &h, &r, SECRET, why, sizeof why), 0);
  psr_hello h2 = h;
  h2.nonce[7] = h2.nonce[7] == '0' ? '1' : '0';
  ck_assert_int_eq(psr_auth_check_role(&a, &h2, &r, secret, sock, sizeof sock, why, sizeof why), -1);
  stop_munged();
}
END_TEST

START_TEST(test_over_a_socket) {
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ck_assert_int_eq(psr_send_text(sv[0], PSR_MSG_REJECT, "job %d step %d", 5, 6), 0);
  ck_assert_int_eq(psr_send_exit(sv[0], 3), 0);
  psr_conn c = {sv[1], NULL, 0, 0};
  int eof;
  char *l = psr_conn_read_line(&c, 1, &eof);
  ck_assert_str_eq(l, "REJECT job 5 step 6");
  free(l);
  l = psr_conn_read_line(&c, 1, &eof);
  psr_msg m;
  ck_assert_int_eq(psr_msg_decode(l, &m), 0);
  ck_assert_int_eq(m.type, PSR_MSG_EXIT);
  ck_assert_int_eq(m.code, 3);
  free(l);
  ck_assert_ptr_null(psr_conn_read_line(&c, 0, &eof)); /* nothing more, not EOF */
  ck_assert_int_eq(eof, 0);
  close(sv[0]);
  ck_assert_ptr_null(psr_conn_read_line(&c, 1, &eof));
  ck_assert_int_eq(eof, 1);
  psr_conn_close(&c);
  ck_assert_int_eq(c.fd, -1);
}
END_TEST

Suite *suite_rendezvous(void) {
  Suite *s = suite_create("rendezvous");
  TCase *tc = tcase_create("codec");
  tcase_add_test(tc, test_round_trips);
  tcase_add_test(tc, test_malformed);
  tcase_add_test(tc, test_over_a_socket);
  tcase_add_test(tc, test_key_proofs);
  tcase_add_test(tc, test_munge_proofs);
  suite_add_tcase(s, tc);
  return s;
}
