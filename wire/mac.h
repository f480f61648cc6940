/*
 * mac.h - the message authentication both sides use, from libsodium (never
 * hand-written crypto): HMAC-SHA-256 keyed by the job's secret, a
 * constant-time comparison, and random nonces. Internal (ps__ names).
 */
#ifndef PS_WIRE_MAC_H
#define PS_WIRE_MAC_H

#include <stddef.h>
#include <stdint.h>

#define PS__MAC_BYTES 32u   /* HMAC-SHA-256 output */
#define PS__NONCE_BYTES 32u /* challenge nonces: 256 bits, never reused */

/* Initializes libsodium once (thread-safe, idempotent). 0, or PS_EINTERNAL
 * when the library cannot start (no entropy source). Every function below
 * calls it, so callers need not. */
int ps__mac_init(void);

/* out = HMAC-SHA-256(key, the concatenation of the n parts). 0 or
 * PS_EINTERNAL. */
typedef struct ps__mac_part {
  const void *p; /* bytes */
  size_t len;    /* their count */
} ps__mac_part;
int ps__hmac(const void *key, size_t keylen, const ps__mac_part *parts, size_t n,
             uint8_t out[PS__MAC_BYTES]);

/* 1 if a and b (len bytes) are equal, in time independent of their content. */
int ps__mac_equal(const uint8_t *a, const uint8_t *b, size_t len);

/* Fills out with len unpredictable bytes. 0 or PS_EINTERNAL. */
int ps__random(void *out, size_t len);

#endif /* PS_WIRE_MAC_H */
