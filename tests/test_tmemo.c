/* test_tmemo.c - a connection's last pull of a table, remembered for its
 * push (psd/sparse/tmemo.c): pieces of one request join, a new request
 * starts over, keys that do not follow the last piece's or too many keys
 * are not remembered, the match is exact, and every byte is accounted. */
#include <check.h>
#include <stdlib.h>

#include "sparse/tmemo.h"
#include "testutil.h"

/* Keys base, base + 2, ... (n of them). */
static void keys_from(uint64_t *k, size_t n, uint64_t base) {
  for (size_t i = 0; i < n; i++) k[i] = base + 2 * i;
}

START_TEST(pieces_join_and_match_exactly) {
  uint64_t held = 0, k[6], ep = 0;
  psd_tmemo *list = NULL;
  static int owner_a, owner_b; /* two connections: only their addresses count */
  ck_assert_ptr_null(psd_tmemo_get(&list, &owner_a, 0, &held));
  psd_tmemo *m = psd_tmemo_get(&list, &owner_a, 1, &held);
  ck_assert_ptr_nonnull(m);
  ck_assert_ptr_eq(psd_tmemo_get(&list, &owner_a, 0, &held), m);
  keys_from(k, 6, 10);
  ck_assert_uint_eq(psd_tmemo_growth(m, 7, 4), 1024 * PSD_TMEMO_KEY_BYTES);
  uint32_t *r = psd_tmemo_add(m, 7, 42, k, 4, &held); /* two pieces of request 7 */
  for (int i = 0; i < 4; i++) r[i] = (uint32_t)(100 + i);
  r = psd_tmemo_add(m, 7, 99, k + 4, 2, &held);
  r[0] = 104, r[1] = 105;
  const uint32_t *rows = psd_tmemo_match(m, k, 6, &ep);
  ck_assert_ptr_nonnull(rows);
  ck_assert_uint_eq(ep, 42); /* the epoch of its first piece */
  for (int i = 0; i < 6; i++) ck_assert_uint_eq(rows[i], 100 + i);
  ck_assert_ptr_null(psd_tmemo_match(m, k, 5, &ep)); /* fewer keys */
  uint64_t other[6];
  keys_from(other, 6, 10);
  other[5]++;
  ck_assert_ptr_null(psd_tmemo_match(m, other, 6, &ep)); /* one key differs */
  /* a later piece whose keys do not follow: the request is not remembered */
  ck_assert_ptr_null(psd_tmemo_add(m, 7, 42, k, 1, &held));
  ck_assert_ptr_null(psd_tmemo_match(m, k, 6, &ep));
  ck_assert_ptr_null(psd_tmemo_add(m, 7, 42, k + 5, 1, &held)); /* nor later */
  /* a new request starts over */
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 8, 43, k, 2, &held));
  ck_assert_ptr_nonnull(psd_tmemo_match(m, k, 2, &ep));
  ck_assert_uint_eq(ep, 43);
  /* cleared after its push: nothing matches until the next pull */
  psd_tmemo_clear(m, &held);
  ck_assert_ptr_null(psd_tmemo_match(m, k, 2, &ep));
  /* skipped (no room under --max-memory): its pieces are not taken, and
   * the buffers the last step kept are given back */
  const uint64_t empty = held - 1024 * PSD_TMEMO_KEY_BYTES;
  psd_tmemo_skip(m, 9, &held);
  ck_assert_uint_eq(held, empty);
  ck_assert_ptr_null(psd_tmemo_add(m, 9, 43, k, 2, &held));
  ck_assert_uint_eq(held, empty);
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 10, 44, k, 2, &held)); /* the next request is */
  ck_assert_ptr_nonnull(psd_tmemo_match(m, k, 2, &ep));
  ck_assert_ptr_nonnull(psd_tmemo_get(&list, &owner_b, 1, &held));
  ck_assert_uint_gt(held, 0);
  psd_tmemo_forget(&list, &owner_a, &held);
  ck_assert_ptr_null(psd_tmemo_get(&list, &owner_a, 0, &held));
  ck_assert_ptr_nonnull(psd_tmemo_get(&list, &owner_b, 0, &held));
  psd_tmemo_forget(&list, NULL, &held);
  ck_assert_ptr_null(list);
  ck_assert_uint_eq(held, 0); /* every byte given back */
}
END_TEST

/* The table's LRU clock after a request's pieces is kept only while each
 * piece moved it by exactly its keys, each starting where the last ended
 * (nothing else touched the table between them); a new request, a clear
 * or a piece that breaks the run forgets it. */
START_TEST(clock_kept_only_for_an_unbroken_run) {
  uint64_t held = 0, k[6];
  psd_tmemo *list = NULL;
  static int owner;
  psd_tmemo *m = psd_tmemo_get(&list, &owner, 1, &held);
  keys_from(k, 6, 10);
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 1, 0, k, 4, &held));
  psd_tmemo_touched(m, 100, 104, 4);
  ck_assert_uint_eq(m->clock, 104);
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 1, 0, k + 4, 2, &held));
  psd_tmemo_touched(m, 104, 106, 2);
  ck_assert_uint_eq(m->clock, 106); /* two pieces, back to back */
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 2, 0, k, 4, &held));
  ck_assert_uint_eq(m->clock, 0); /* a new request */
  psd_tmemo_touched(m, 200, 204, 4);
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 2, 0, k + 4, 2, &held));
  psd_tmemo_touched(m, 205, 207, 2); /* a touch came between the pieces */
  ck_assert_uint_eq(m->clock, 0);
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 3, 0, k, 4, &held));
  psd_tmemo_touched(m, 300, 306, 4); /* stored rows: moved by more */
  ck_assert_uint_eq(m->clock, 0);
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 3, 0, k + 4, 2, &held));
  psd_tmemo_touched(m, 306, 308, 2); /* a broken run stays broken */
  ck_assert_uint_eq(m->clock, 0);
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 4, 0, k, 4, &held));
  psd_tmemo_touched(m, 400, 404, 4);
  psd_tmemo_clear(m, &held);
  ck_assert_uint_eq(m->clock, 0);
  psd_tmemo_forget(&list, NULL, &held);
}
END_TEST

/* More keys than one TablePush carries are never remembered, and a big
 * buffer goes after a step that used a small part of it. */
START_TEST(bounded_and_shrinks) {
  uint64_t held = 0, ep;
  psd_tmemo *list = NULL;
  static int owner;
  psd_tmemo *m = psd_tmemo_get(&list, &owner, 1, &held);
  const uint64_t base = held;
  size_t big = (size_t)1 << 20;
  uint64_t *k = malloc(big * sizeof *k);
  ck_assert_ptr_nonnull(k);
  keys_from(k, big, 1);
  ck_assert_uint_eq(psd_tmemo_growth(m, 1, PSD_TMEMO_MAX_KEYS + 1), 0);
  /* one request in pieces up to the limit, then one key more */
  for (size_t done = 0; done < PSD_TMEMO_MAX_KEYS; done += big) {
    keys_from(k, big, 1 + 2 * done);
    ck_assert_ptr_nonnull(psd_tmemo_add(m, 2, 0, k, big, &held));
  }
  ck_assert_uint_eq(held - base, (uint64_t)PSD_TMEMO_MAX_KEYS * PSD_TMEMO_KEY_BYTES);
  uint64_t next = 1 + 2 * (uint64_t)PSD_TMEMO_MAX_KEYS;
  ck_assert_ptr_null(psd_tmemo_add(m, 2, 0, &next, 1, &held));
  ck_assert_ptr_null(psd_tmemo_match(m, k, big, &ep));
  psd_tmemo_clear(m, &held); /* it held nothing: its buffers go */
  ck_assert_uint_eq(held, base);
  /* a big step keeps its buffers for the next; a small one after it
   * gives them back */
  keys_from(k, big, 1);
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 3, 0, k, big, &held));
  psd_tmemo_clear(m, &held);
  ck_assert_uint_eq(held - base, (uint64_t)big * PSD_TMEMO_KEY_BYTES);
  ck_assert_ptr_nonnull(psd_tmemo_add(m, 4, 0, k, 10, &held));
  psd_tmemo_clear(m, &held);
  ck_assert_uint_eq(held, base);
  psd_tmemo_forget(&list, NULL, &held);
  ck_assert_uint_eq(held, 0);
  free(k);
}
END_TEST

Suite *suite_tmemo(void) {
  Suite *s = suite_create("tmemo");
  TCase *tc = tcase_create("tmemo");
  tcase_add_test(tc, pieces_join_and_match_exactly);
  tcase_add_test(tc, clock_kept_only_for_an_unbroken_run);
  tcase_add_test(tc, bounded_and_shrinks);
  suite_add_tcase(s, tc);
  return s;
}
