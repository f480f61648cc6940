/* malloc_count.so: LD_PRELOAD shim for psd that counts allocation calls and
 * prints "ALLOCS <n>" on stderr at exit. The allocation test runs the same
 * training for few and for many steps: the counts must not grow with the
 * number of steps (psd's hot path allocates nothing per step). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static unsigned long g_count;           /* malloc/calloc/realloc calls */
static char g_boot[1 << 16];            /* calloc before dlsym is ready */
static size_t g_boot_used;

void *malloc(size_t size);
void *calloc(size_t n, size_t size);
void *realloc(void *p, size_t size);
void free(void *p);

void *malloc(size_t size) {
  static void *(*real)(size_t);
  if (!real) real = (void *(*)(size_t))dlsym(RTLD_NEXT, "malloc");
  __atomic_fetch_add(&g_count, 1, __ATOMIC_RELAXED);
  return real(size);
}

void *calloc(size_t n, size_t size) {
  static void *(*real)(size_t, size_t);
  static int resolving;
  if (!real) {
    if (resolving) { /* dlsym itself calls calloc */
      void *p = g_boot + g_boot_used;
      g_boot_used += (n * size + 15) & ~(size_t)15;
      memset(p, 0, n * size);
      return p;
    }
    resolving = 1;
    real = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "calloc");
  }
  __atomic_fetch_add(&g_count, 1, __ATOMIC_RELAXED);
  return real(n, size);
}

void *realloc(void *p, size_t size) {
  static void *(*real)(void *, size_t);
  if (!real) real = (void *(*)(void *, size_t))dlsym(RTLD_NEXT, "realloc");
  __atomic_fetch_add(&g_count, 1, __ATOMIC_RELAXED);
  return real(p, size);
}

void free(void *p) {
  static void (*real)(void *);
  if ((char *)p >= g_boot && (char *)p < g_boot + sizeof g_boot) return;
  if (!real) real = (void (*)(void *))dlsym(RTLD_NEXT, "free");
  real(p);
}

__attribute__((destructor)) static void report(void) {
  char line[64];
  int n = snprintf(line, sizeof line, "ALLOCS %lu\n", g_count);
  ssize_t w = write(2, line, (size_t)n);
  (void)w;
}
