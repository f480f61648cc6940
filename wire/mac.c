/* mac.c - HMAC-SHA-256, constant-time comparison and nonces (libsodium). */
#include "mac.h"

#include <sodium.h>

#include "ps/errno.h"
#include "ps/types.h"

int ps__mac_init(void) { return sodium_init() < 0 ? PS_EINTERNAL : 0; }

int ps__hmac(const void *key, size_t keylen, const ps__mac_part *parts, size_t n,
             uint8_t out[PS__MAC_BYTES]) {
  if (ps__mac_init()) return PS_EINTERNAL;
  crypto_auth_hmacsha256_state st;
  if (crypto_auth_hmacsha256_init(&st, key, keylen) != 0) return PS_EINTERNAL;
  for (size_t i = 0; i < n; i++)
    if (parts[i].len && crypto_auth_hmacsha256_update(&st, parts[i].p, parts[i].len) != 0)
      return PS_EINTERNAL;
  if (crypto_auth_hmacsha256_final(&st, out) != 0) return PS_EINTERNAL;
  sodium_memzero(&st, sizeof st);
  return 0;
}

int ps__mac_equal(const uint8_t *a, const uint8_t *b, size_t len) {
  return sodium_memcmp(a, b, len) == 0;
}

int ps__random(void *out, size_t len) {
  if (ps__mac_init()) return PS_EINTERNAL;
  randombytes_buf(out, len);
  return 0;
}
