/* faultsim.so: LD_PRELOAD shim that makes allocations fail on purpose
 * (SQLite's faultsim is the model), for the faultsim suite
 * (test_faultsim.c). It interposes malloc, calloc, realloc,
 * posix_memalign, aligned_alloc and free. While armed it numbers the
 * allocation calls from 1 and fails (NULL, or ENOMEM from posix_memalign,
 * errno ENOMEM) those numbered FAULTSIM_FAIL .. FAULTSIM_FAIL +
 * FAULTSIM_COUNT - 1 (count default 1; 0 fails none); every allocation
 * made while armed is recorded until freed, so what is still live
 * afterwards is a leak. Arming:
 *  - FAULTSIM_ARM=accept:K arms at the K-th TCP connection the process
 *    accepts (accept/accept4 of an AF_INET socket: psd's clients, not its
 *    shared-memory gate) and disarms at the next one, so psd's start-up
 *    and the clients after the window run unharmed;
 *  - otherwise the program arms itself through faultsim_arm() (dlsym;
 *    the client scenario of the suite).
 * FAULTSIM_TRACE=1 prints a backtrace of each failed allocation on stderr.
 * At exit it prints "faultsim: armed A allocations, failed F, live L" on
 * stderr (psd's log), and the first live allocations' sizes and callers
 * (object+offset: addr2line -e OBJECT OFFSET names the line). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define SLOTS (1u << 20) /* live allocations recorded at most */
#define TOMB ((void *)1)

typedef struct {
  void *p;
  size_t size;
  void *caller; /* where it was allocated (the report names it) */
} rec;

static rec g_live[SLOTS];      /* open addressing; TOMB marks a removed entry */
static size_t g_used;          /* entries plus tombstones */
static size_t g_nlive;
static int g_overflow;         /* a live allocation was not recorded */
static int g_lock;             /* spinlock over the table and counters */
static int g_armed;
static unsigned long g_count;  /* allocations numbered since arming */
static unsigned long g_fail_at, g_fail_n = 1, g_failed;
static long g_arm_accept;      /* FAULTSIM_ARM=accept:K: K; 0 otherwise */
static long g_accepts;         /* TCP connections accepted */
static int g_trace;            /* FAULTSIM_TRACE=1: a backtrace per failure */
static char g_boot[1 << 16];   /* allocations before dlsym is ready */
static size_t g_boot_used;

static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_memalign)(void **, size_t, size_t);
static void *(*real_aligned)(size_t, size_t);
static void (*real_free)(void *);

static void lock(void) {
  while (__atomic_exchange_n(&g_lock, 1, __ATOMIC_ACQUIRE)) {
  }
}
static void unlock(void) { __atomic_store_n(&g_lock, 0, __ATOMIC_RELEASE); }

static size_t slot_of(const void *p) {
  uint64_t h = (uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ull;
  return (size_t)(h >> 44) & (SLOTS - 1);
}

/* Under the lock. */
static void record(void *p, size_t size, void *caller) {
  if (g_used >= SLOTS / 4 * 3) {
    g_overflow = 1;
    return;
  }
  size_t i = slot_of(p);
  while (g_live[i].p && g_live[i].p != TOMB) i = (i + 1) & (SLOTS - 1);
  if (!g_live[i].p) g_used++;
  g_live[i] = (rec){p, size, caller};
  g_nlive++;
}

/* Under the lock: 1 if p was recorded (and is no longer). */
static int forget(const void *p) {
  if (!g_nlive) return 0;
  for (size_t i = slot_of(p); g_live[i].p; i = (i + 1) & (SLOTS - 1)) {
    if (g_live[i].p == p) {
      g_live[i].p = TOMB;
      g_nlive--;
      return 1;
    }
  }
  return 0;
}

/* Numbers one allocation call: 1 if it must fail. */
static int should_fail(void) {
  if (!__atomic_load_n(&g_armed, __ATOMIC_RELAXED)) return 0;
  lock();
  unsigned long n = ++g_count;
  int fail = g_armed && g_fail_at && n >= g_fail_at && n - g_fail_at < g_fail_n;
  g_failed += (unsigned long)fail;
  unlock();
  static __thread int tracing; /* backtrace() may allocate the first time */
  if (fail && g_trace && !tracing) {
    void *frames[32];
    tracing = 1;
    char line[64];
    int len = snprintf(line, sizeof line, "faultsim: failing allocation %lu at\n", n);
    ssize_t w = write(2, line, (size_t)len);
    (void)w;
    backtrace_symbols_fd(frames, backtrace(frames, 32), 2);
    tracing = 0;
  }
  return fail;
}

static void track(void *p, size_t size, void *caller) {
  if (!p || !__atomic_load_n(&g_armed, __ATOMIC_RELAXED)) return;
  lock();
  if (g_armed) record(p, size, caller);
  unlock();
}

/* ---- control (dlsym(RTLD_DEFAULT, "faultsim_arm") from the program) ----- */

/* Starts numbering allocations from 1, failing fail_at .. fail_at + n - 1
 * (fail_at 0: none), and forgets earlier records. */
void faultsim_arm(unsigned long fail_at, unsigned long n);
void faultsim_arm(unsigned long fail_at, unsigned long n) {
  lock();
  memset(g_live, 0, sizeof g_live);
  g_used = g_nlive = 0;
  g_overflow = 0;
  g_count = g_failed = 0;
  g_fail_at = fail_at;
  g_fail_n = n;
  __atomic_store_n(&g_armed, 1, __ATOMIC_RELEASE);
  unlock();
}

/* Stops numbering and failing; frees of recorded allocations still count. */
void faultsim_disarm(void);
void faultsim_disarm(void) { __atomic_store_n(&g_armed, 0, __ATOMIC_RELEASE); }

/* Allocations numbered, failed, recorded and still live (-1: too many to
 * record) since the last faultsim_arm. */
void faultsim_stats(unsigned long *counted, unsigned long *failed, long *live);
void faultsim_stats(unsigned long *counted, unsigned long *failed, long *live) {
  lock();
  *counted = g_count;
  *failed = g_failed;
  *live = g_overflow ? -1 : (long)g_nlive;
  unlock();
}

/* ---- the interposed functions ------------------------------------------- */

void *malloc(size_t size);
void *calloc(size_t n, size_t size);
void *realloc(void *p, size_t size);
int posix_memalign(void **out, size_t align, size_t size);
void *aligned_alloc(size_t align, size_t size);
void free(void *p);

/* dlsym may allocate and free (its error string), and under ASan a
 * free can come first: while the real functions are being looked up,
 * allocations come from g_boot and frees of anything else are dropped. */
static int g_resolving;

static void resolve(void) {
  if (real_free || g_resolving) return;
  g_resolving = 1;
  real_malloc = (void *(*)(size_t))dlsym(RTLD_NEXT, "malloc");
  real_calloc = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "calloc");
  real_realloc = (void *(*)(void *, size_t))dlsym(RTLD_NEXT, "realloc");
  real_memalign = (int (*)(void **, size_t, size_t))dlsym(RTLD_NEXT, "posix_memalign");
  real_aligned = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "aligned_alloc");
  real_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
  g_resolving = 0;
}

static void *boot_alloc(size_t size) {
  size = (size + 15) & ~(size_t)15;
  if (g_boot_used + size > sizeof g_boot) return NULL;
  void *p = g_boot + g_boot_used;
  g_boot_used += size;
  return p; /* static memory: zeroed */
}

void *malloc(size_t size) {
  resolve();
  if (!real_malloc) return boot_alloc(size);
  if (should_fail()) {
    errno = ENOMEM;
    return NULL;
  }
  void *p = real_malloc(size);
  track(p, size, __builtin_return_address(0));
  return p;
}

void *calloc(size_t n, size_t size) {
  resolve();
  if (!real_calloc) return n && size > SIZE_MAX / n ? NULL : boot_alloc(n * size);
  if (should_fail()) {
    errno = ENOMEM;
    return NULL;
  }
  void *p = real_calloc(n, size);
  track(p, n * size, __builtin_return_address(0));
  return p;
}

void *realloc(void *p, size_t size) {
  resolve();
  if (!real_realloc) return NULL;
  if (size && should_fail()) {
    errno = ENOMEM;
    return NULL; /* p stays valid, as after a real failure */
  }
  void *q = real_realloc(p, size);
  if (!q && size) return NULL;
  /* The new block is recorded if the old one was, or is new itself. */
  lock();
  int was = p && forget(p);
  if (q && (was || (!p && g_armed))) record(q, size, __builtin_return_address(0));
  unlock();
  return q;
}

int posix_memalign(void **out, size_t align, size_t size) {
  resolve();
  if (!real_memalign || should_fail()) return ENOMEM;
  int rc = real_memalign(out, align, size);
  if (rc == 0) track(*out, size, __builtin_return_address(0));
  return rc;
}

void *aligned_alloc(size_t align, size_t size) {
  resolve();
  if (!real_aligned || should_fail()) {
    errno = ENOMEM;
    return NULL;
  }
  void *p = real_aligned(align, size);
  track(p, size, __builtin_return_address(0));
  return p;
}

void free(void *p) {
  if (!p || ((char *)p >= g_boot && (char *)p < g_boot + sizeof g_boot)) return;
  resolve();
  if (!real_free) return; /* looking it up: dropped */
  if (__atomic_load_n(&g_nlive, __ATOMIC_RELAXED)) {
    lock();
    forget(p);
    unlock();
  }
  real_free(p);
}

/* ---- arming at an accepted TCP connection -------------------------------- */

static void accepted(int fd) {
  if (fd < 0 || !g_arm_accept) return;
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0 ||
      (ss.ss_family != AF_INET && ss.ss_family != AF_INET6))
    return;
  long k = __atomic_add_fetch(&g_accepts, 1, __ATOMIC_RELAXED);
  if (k == g_arm_accept) faultsim_arm(g_fail_at, g_fail_n);
  else if (k == g_arm_accept + 1) faultsim_disarm();
}

int accept(int fd, struct sockaddr *addr, socklen_t *len);
int accept(int fd, struct sockaddr *addr, socklen_t *len) {
  static int (*real)(int, struct sockaddr *, socklen_t *);
  if (!real) real = (int (*)(int, struct sockaddr *, socklen_t *))dlsym(RTLD_NEXT, "accept");
  int c = real(fd, addr, len);
  accepted(c);
  return c;
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags);
int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
  static int (*real)(int, struct sockaddr *, socklen_t *, int);
  if (!real)
    real = (int (*)(int, struct sockaddr *, socklen_t *, int))dlsym(RTLD_NEXT, "accept4");
  int c = real(fd, addr, len, flags);
  accepted(c);
  return c;
}

static unsigned long env_ul(const char *name, unsigned long dflt) {
  const char *s = getenv(name);
  return s && *s ? strtoul(s, NULL, 10) : dflt;
}

__attribute__((constructor)) static void setup(void) {
  resolve();
  g_fail_at = env_ul("FAULTSIM_FAIL", 0);
  g_fail_n = env_ul("FAULTSIM_COUNT", 1);
  g_trace = env_ul("FAULTSIM_TRACE", 0) != 0;
  void *frame;
  if (g_trace) backtrace(&frame, 1); /* loads libgcc_s now, not while armed */
  const char *arm = getenv("FAULTSIM_ARM");
  if (arm && strncmp(arm, "accept:", 7) == 0) g_arm_accept = strtol(arm + 7, NULL, 10);
}

__attribute__((destructor)) static void report(void) {
  if (!g_arm_accept) return; /* faultsim_stats tells a program that arms itself */
  unsigned long counted, failed;
  long live;
  faultsim_stats(&counted, &failed, &live);
  char line[1024];
  int n = snprintf(line, sizeof line, "faultsim: armed %lu allocations, failed %lu, live %ld",
                   counted, failed, live);
  lock();
  for (size_t i = 0, shown = 0; i < SLOTS && shown < 8 && !g_overflow; i++) {
    if (!g_live[i].p || g_live[i].p == TOMB) continue;
    Dl_info di;
    const char *obj = "?";
    uintptr_t off = (uintptr_t)g_live[i].caller;
    if (dladdr(g_live[i].caller, &di) && di.dli_fname) {
      obj = strrchr(di.dli_fname, '/') ? strrchr(di.dli_fname, '/') + 1 : di.dli_fname;
      off -= (uintptr_t)di.dli_fbase;
    }
    n += snprintf(line + n, sizeof line - (size_t)n, "%s%zu bytes from %s+0x%lx",
                  shown++ ? ", " : " (", g_live[i].size, obj, (unsigned long)off);
  }
  unlock();
  n += snprintf(line + n, sizeof line - (size_t)n, "%s\n", live > 0 ? ")" : "");
  ssize_t w = write(2, line, (size_t)n);
  (void)w;
}
