/* psrun's control-channel codec (psrun/rendezvous.c): every message
 * round-trips, the wire lines are the documented ones, malformed lines
 * and unsendable fields are refused; lines cross a socket pair intact. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

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

START_TEST(test_round_trips) {
  char buf[512];
  psr_msg m = {.type = PSR_MSG_HELLO}, d;
  m.hello = (psr_hello){4242, 7, 1000, 16, 3, "node-a", 1};
  round_trip(&m, "HELLO PSRUN1 4242 7 1000 16 3 node-a 1", &d, buf, sizeof buf);
  ck_assert(d.hello.job_id == 4242 && d.hello.step_id == 7 && d.hello.uid == 1000);
  ck_assert_int_eq(d.hello.ntasks, 16);
  ck_assert_int_eq(d.hello.rank, 3);
  ck_assert_str_eq(d.hello.node, "node-a");
  ck_assert_int_eq(d.hello.localid, 1);
  m.hello.job_id = 4294967295LL; /* the largest Slurm job id */
  ck_assert_int_gt(psr_msg_encode(&m, buf, sizeof buf), 0);
  ck_assert_int_eq(psr_msg_decode(buf, &d), 0);
  ck_assert(d.hello.job_id == 4294967295LL);

  m = (psr_msg){.type = PSR_MSG_ROLE};
  m.role = (psr_assign){1, 2, 3, 5, ""};
  memcpy(m.role.secret, SECRET, sizeof SECRET);
  char want[200];
  snprintf(want, sizeof want, "ROLE ps 2 3 5 %s", SECRET);
  round_trip(&m, want, &d, buf, sizeof buf);
  ck_assert_int_eq(d.role.is_ps, 1);
  ck_assert_int_eq(d.role.index, 2);
  ck_assert_int_eq(d.role.num_ps, 3);
  ck_assert_int_eq(d.role.num_workers, 5);
  ck_assert_str_eq(d.role.secret, SECRET);
  m.role.is_ps = 0;
  snprintf(want, sizeof want, "ROLE worker 2 3 5 %s", SECRET);
  round_trip(&m, want, &d, buf, sizeof buf);
  ck_assert_int_eq(d.role.is_ps, 0);

  m = (psr_msg){.type = PSR_MSG_EXIT, .code = 75};
  round_trip(&m, "EXIT 75", &d, buf, sizeof buf);
  ck_assert_int_eq(d.code, 75);

  const struct {
    psr_msg_type t;
    const char *text, *line;
  } texts[] = {
      {PSR_MSG_REJECT, "rank 9 is invalid", "REJECT rank 9 is invalid"},
      {PSR_MSG_PSADDR, "10.0.0.1:4000", "PSADDR 10.0.0.1:4000"},
      {PSR_MSG_HOSTS, "a:1,b:2", "HOSTS a:1,b:2"},
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
  const char *bad[] = {
      "", "HELLO", "HELLO PSRUN2 1 2 3 4 5 n 0", "HELLO PSRUN1 1 2 3 4 5 n",
      "HELLO PSRUN1 x 2 3 4 5 n 0", "hello PSRUN1 1 2 3 4 5 n 0", "HELLOX PSRUN1 1 2 3 4 5 n 0",
      "ROLE boss 1 2 3 abc", "ROLE ps 1 2", "EXIT", "EXIT x", "PSADDR", "PSADDR a b",
      "HOSTS", "BOGUS 1", " HELLO PSRUN1 1 2 3 4 5 n 0",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_msg(psr_msg_decode(bad[i], &d) == -1, "'%s' accepted", bad[i]);
  /* Fields that cannot be sent. */
  char buf[256];
  psr_msg m = {.type = PSR_MSG_HELLO};
  m.hello = (psr_hello){1, 2, 3, 4, 1, "two words", 0};
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
  m = (psr_msg){.type = PSR_MSG_ROLE};
  m.role = (psr_assign){1, 0, 1, 1, "short"};
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
  m = (psr_msg){.type = PSR_MSG_ABORT, .text = "two\nlines"};
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
  m = (psr_msg){.type = PSR_MSG_REJECT, .text = "far too long for the buffer"};
  ck_assert_int_eq(psr_msg_encode(&m, buf, 8), -1);
  m = (psr_msg){.type = PSR_MSG_COUNT};
  ck_assert_int_eq(psr_msg_encode(&m, buf, sizeof buf), -1);
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
  suite_add_tcase(s, tc);
  return s;
}
