/* memlimit.c - reads the cgroup memory limit (v2 and v1) of this process
 * and physical RAM, for --max-memory's default. */
#include "memlimit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Limits at or above this mean "none": cgroup v1 writes about 2^63 for
 * unlimited, and no node has an exabyte. */
#define PSD_MEMLIMIT_NONE ((uint64_t)1 << 60)
/* Longest line of /proc/self/cgroup we look at (a path in the hierarchy). */
#define PSD_CGROUP_LINE 4096

/* The number in file path, or UINT64_MAX ("max", missing, unparsable or
 * absurdly large). */
static uint64_t read_limit(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return UINT64_MAX;
  char buf[64] = "";
  char *ok = fgets(buf, sizeof buf, f);
  fclose(f);
  if (!ok || buf[0] < '0' || buf[0] > '9') return UINT64_MAX;
  char *end;
  unsigned long long v = strtoull(buf, &end, 10);
  if (*end != '\0' && *end != '\n') return UINT64_MAX;
  return v >= PSD_MEMLIMIT_NONE ? UINT64_MAX : (uint64_t)v;
}

/* Smallest limit in file `name` of dir/path and each of its ancestors up
 * to dir itself. */
static uint64_t walk_up(const char *dir, const char *path, const char *name, char *where,
                        size_t wherelen) {
  char rel[PSD_CGROUP_LINE];
  snprintf(rel, sizeof rel, "%s", path);
  uint64_t best = UINT64_MAX;
  for (;;) {
    size_t n = strlen(rel);
    while (n > 0 && rel[n - 1] == '/') rel[--n] = '\0';
    char file[2 * PSD_CGROUP_LINE + 64];
    snprintf(file, sizeof file, "%s%s%s/%s", dir, n ? "/" : "", rel[0] == '/' ? rel + 1 : rel,
             name);
    uint64_t v = read_limit(file);
    if (v < best) {
      best = v;
      if (where) snprintf(where, wherelen, "%s", file);
    }
    char *slash = strrchr(rel, '/');
    if (!n) break;
    if (slash) *slash = '\0';
    else rel[0] = '\0';
  }
  return best;
}

uint64_t psd_memlimit_cgroup(const char *root, char *where, size_t wherelen) {
  if (!root) root = "";
  if (where && wherelen) where[0] = '\0';
  char path[1024];
  snprintf(path, sizeof path, "%s/proc/self/cgroup", root);
  FILE *f = fopen(path, "r");
  if (!f) return UINT64_MAX;
  char line[PSD_CGROUP_LINE];
  uint64_t best = UINT64_MAX;
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    /* "ID:CONTROLLERS:PATH": v2 is "0::PATH", v1 lists "memory". */
    char *c1 = strchr(line, ':');
    char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c2) continue;
    *c2 = '\0';
    const char *ctrls = c1 + 1, *cg = c2 + 1;
    char dir[1100], w[2 * PSD_CGROUP_LINE + 64];
    const char *name = NULL;
    if (!ctrls[0] && line[0] == '0' && c1 == line + 1) {
      snprintf(dir, sizeof dir, "%s/sys/fs/cgroup", root);
      name = "memory.max";
    } else {
      char list[PSD_CGROUP_LINE];
      snprintf(list, sizeof list, ",%s,", ctrls);
      if (!strstr(list, ",memory,")) continue;
      snprintf(dir, sizeof dir, "%s/sys/fs/cgroup/memory", root);
      name = "memory.limit_in_bytes";
    }
    uint64_t v = walk_up(dir, cg, name, w, sizeof w);
    if (v < best) {
      best = v;
      if (where) snprintf(where, wherelen, "%s", w);
    }
  }
  fclose(f);
  return best;
}

uint64_t psd_memlimit_phys(void) {
  long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || psize <= 0) return UINT64_MAX;
  return (uint64_t)pages * (uint64_t)psize;
}
