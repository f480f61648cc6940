/* wire/mac.c: HMAC-SHA-256 against RFC 4231's vectors (whole and in parts),
 * the constant-time comparison, and nonces. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "testutil.h"
#include "wire.h"

static void hex(const uint8_t *b, size_t n, char *out) {
  for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

START_TEST(test_rfc4231_case2) {
  uint8_t mac[PS__MAC_BYTES];
  char h[2 * PS__MAC_BYTES + 1];
  const char *msg = "what do ya want for nothing?";
  ps__mac_part one = {msg, strlen(msg)};
  ck_assert_int_eq(ps__hmac("Jefe", 4, &one, 1, mac), 0);
  hex(mac, sizeof mac, h);
  ck_assert_str_eq(h, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  /* The same message in three parts (one empty) gives the same MAC. */
  ps__mac_part three[] = {{msg, 4}, {"", 0}, {msg + 4, strlen(msg) - 4}};
  uint8_t mac2[PS__MAC_BYTES];
  ck_assert_int_eq(ps__hmac("Jefe", 4, three, 3, mac2), 0);
  ck_assert(ps__mac_equal(mac, mac2, sizeof mac));
}
END_TEST

START_TEST(test_rfc4231_case6_long_key) {
  /* A 131-byte key (longer than the block) is hashed first. */
  uint8_t key[131];
  memset(key, 0xaa, sizeof key);
  const char *msg = "Test Using Larger Than Block-Size Key - Hash Key First";
  ps__mac_part one = {msg, strlen(msg)};
  uint8_t mac[PS__MAC_BYTES];
  char h[2 * PS__MAC_BYTES + 1];
  ck_assert_int_eq(ps__hmac(key, sizeof key, &one, 1, mac), 0);
  hex(mac, sizeof mac, h);
  ck_assert_str_eq(h, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}
END_TEST

START_TEST(test_equal_and_random) {
  uint8_t a[PS__NONCE_BYTES], b[PS__NONCE_BYTES];
  ck_assert_int_eq(ps__random(a, sizeof a), 0);
  ck_assert_int_eq(ps__random(b, sizeof b), 0);
  ck_assert(!ps__mac_equal(a, b, sizeof a)); /* 2^-256 to fail by chance */
  memcpy(b, a, sizeof a);
  ck_assert(ps__mac_equal(a, b, sizeof a));
  b[sizeof b - 1] ^= 1;
  ck_assert(!ps__mac_equal(a, b, sizeof a));
}
END_TEST

Suite *suite_mac(void) {
  Suite *s = suite_create("mac");
  TCase *tc = tcase_create("hmac");
  tcase_add_test(tc, test_rfc4231_case2);
  tcase_add_test(tc, test_rfc4231_case6_long_key);
  tcase_add_test(tc, test_equal_and_random);
  suite_add_tcase(s, tc);
  return s;
}
