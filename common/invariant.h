/*
 * invariant.h - invariants checked in every build. assert() is compiled out
 * under NDEBUG, which the release builds define; PS_ASSERT never is: a
 * broken invariant writes "file:line: invariant broken: COND" on stderr and
 * aborts, so that a daemon never goes on serving a state it knows is
 * corrupt (Redis's serverAssert). Only cheap conditions on hot paths.
 */
#ifndef PS_INVARIANT_H
#define PS_INVARIANT_H

#define PS_ASSERT(cond)                                                                  \
  do {                                                                                   \
    if (__builtin_expect(!(cond), 0)) ps__assert_fail(#cond, __FILE__, __LINE__);        \
  } while (0)

/* Writes the line with one write(2) (async-signal-safe, no allocation) and
 * aborts. */
void ps__assert_fail(const char *cond, const char *file, int line)
    __attribute__((noreturn, cold));

#endif
