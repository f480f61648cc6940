/*
 * layout.c - psrun's reading of a Slurm task's environment, nodelist and
 * tasks-per-node expansion, the rank -> node layout of the derivable
 * distributions, and the ps/worker plan. See layout.h for the contract.
 *
 * Every parser is strict: a value Slurm would never produce is an error
 * naming the variable and the value, never a silent default.
 */
#include "layout.h"

#include "util.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <slurm/slurm.h>

/* Bounds on what we accept from the environment (far above real clusters,
 * low enough that nothing overflows an int or allocates absurdly). */
#define PSR_MAX_NODES 1000000
#define PSR_MAX_COUNT 1000000

/* "run psrun under srun" hint appended to a missing required variable. */
#define PSR_HINT "run psrun under srun, or use psrun --local"


/* ---- integers ------------------------------------------------------------ */

/* Strict decimal: optional '-', then digits only, nothing else. 0 and *out,
 * -1 if not an integer, -2 if it does not fit a long long. */
static int strict_ll(const char *s, long long *out) {
  const char *p = s;
  if (*p == '-') p++;
  if (*p < '0' || *p > '9') return -1;
  for (const char *q = p; *q; q++)
    if (*q < '0' || *q > '9') return -1;
  errno = 0;
  char *end = NULL;
  long long v = strtoll(s, &end, 10);
  if (errno == ERANGE) return -2;
  if (!end || *end != '\0') return -1;
  *out = v;
  return 0;
}

/* Parses variable `var` with value `val` (non-NULL) into [lo, hi]. */
static int parse_ll_var(const char *var, const char *val, long long lo, long long hi,
                        long long *out, char *err, size_t errlen) {
  long long v = 0;
  int rc = strict_ll(val, &v);
  if (rc == -1) {
    ps__errf(-1, err, errlen, "%s='%s' is not an integer", var, val);
    return -1;
  }
  if (rc == -2) {
    ps__errf(-1, err, errlen, "%s=%s is out of range", var, val);
    return -1;
  }
  if (v < lo) {
    ps__errf(-1, err, errlen, "%s=%s must be at least %lld", var, val, lo);
    return -1;
  }
  if (v > hi) {
    ps__errf(-1, err, errlen, "%s=%s must be at most %lld", var, val, hi);
    return -1;
  }
  *out = v;
  return 0;
}

static int parse_int_var(const char *var, const char *val, int lo, int hi, int *out,
                         char *err, size_t errlen) {
  long long v = 0;
  if (parse_ll_var(var, val, lo, hi, &v, err, errlen) != 0) return -1;
  *out = (int)v;
  return 0;
}

/* ---- environment --------------------------------------------------------- */

/* First of the NULL-terminated names that is set; its name in *which. */
static const char *get_first(const char *(*get)(const char *), const char **which,
                             ...) {
  va_list ap;
  va_start(ap, which);
  const char *name;
  const char *val = NULL;
  *which = NULL;
  while ((name = va_arg(ap, const char *)) != NULL) {
    val = get(name);
    if (val) {
      *which = name;
      break;
    }
  }
  va_end(ap);
  return val;
}

static int dup_str(char **dst, const char *src, char *err, size_t errlen) {
  *dst = strdup(src);
  if (!*dst) {
    ps__errf(-1, err, errlen, "out of memory");
    return -1;
  }
  return 0;
}

/* SLURM_DISTRIBUTION: node level is the first ','-token up to ':'. */
static int parse_dist(psr_env *e, const char *raw, const char *(*get)(const char *),
                      char *err, size_t errlen) {
  e->dist = PSR_DIST_BLOCK; /* Slurm's default when unset */
  e->plane_size = 0;
  if (!raw) return 0;
  size_t n = strcspn(raw, ":,");
  char node[32];
  if (n >= sizeof node) {
    if (strncasecmp(raw, "plane=", 6) == 0) {
      ps__errf(-1, err, errlen,
             "SLURM_DISTRIBUTION='%s' has a plane size that is not an integer "
             "between 1 and %d",
             raw, PSR_MAX_COUNT);
      return -1;
    }
    e->dist = PSR_DIST_UNKNOWN;
    return 0;
  }
  memcpy(node, raw, n);
  node[n] = '\0';
  char *eq = strchr(node, '=');
  if (eq) *eq = '\0';
  if (strcasecmp(node, "block") == 0 || strcmp(node, "*") == 0) {
    e->dist = PSR_DIST_BLOCK;
  } else if (strcasecmp(node, "cyclic") == 0) {
    e->dist = PSR_DIST_CYCLIC;
  } else if (strcasecmp(node, "arbitrary") == 0 || strcasecmp(node, "hostfile") == 0) {
    e->dist = PSR_DIST_ARBITRARY;
  } else if (strcasecmp(node, "plane") == 0) {
    const char *var, *val;
    if (eq) {
      /* "plane=N" */
      long long v = 0;
      if (strict_ll(eq + 1, &v) != 0 || v < 1 || v > PSR_MAX_COUNT) {
        ps__errf(-1, err, errlen,
               "SLURM_DISTRIBUTION='%s' has a plane size that is not an integer "
               "between 1 and %d",
               raw, PSR_MAX_COUNT);
        return -1;
      }
      e->plane_size = (int)v;
    } else if ((val = get(var = "SLURM_DIST_PLANESIZE")) != NULL) {
      if (parse_int_var(var, val, 1, PSR_MAX_COUNT, &e->plane_size, err, errlen) != 0)
        return -1;
    } else {
      /* No size anywhere: the layout cannot be derived, let the caller
       * discover it rather than guess. */
      e->dist = PSR_DIST_UNKNOWN;
      return 0;
    }
    e->dist = PSR_DIST_PLANE;
  } else {
    e->dist = PSR_DIST_UNKNOWN;
  }
  if (eq && e->dist != PSR_DIST_PLANE) e->dist = PSR_DIST_UNKNOWN; /* "cyclic=3" */
  return 0;
}

/* SLURM_STEP_RESV_PORTS: "lo-hi" or "lo"; of a comma list the first. */
static int parse_ports(psr_env *e, const char *val, char *err, size_t errlen) {
  const char *var = "SLURM_STEP_RESV_PORTS";
  char first[32];
  size_t n = strcspn(val, ",");
  if (n == 0 || n >= sizeof first) {
    ps__errf(-1, err, errlen, "%s='%s' is not a port or a port range", var, val);
    return -1;
  }
  memcpy(first, val, n);
  first[n] = '\0';
  char *dash = strchr(first, '-');
  long long lo = 0, hi = 0;
  if (dash) *dash = '\0';
  if (first[0] == '-' || strict_ll(first, &lo) != 0 ||
      (dash && (dash[1] == '-' || strict_ll(dash + 1, &hi) != 0))) {
    ps__errf(-1, err, errlen, "%s='%s' is not a port or a port range", var, val);
    return -1;
  }
  if (!dash) hi = lo;
  if (lo < 1 || lo > 65535 || hi < 1 || hi > 65535) {
    ps__errf(-1, err, errlen, "%s='%s' has a port outside 1..65535", var, val);
    return -1;
  }
  if (hi < lo) {
    ps__errf(-1, err, errlen, "%s='%s' is a port range that ends below its start", var, val);
    return -1;
  }
  e->resv_port_lo = (int)lo;
  e->resv_port_hi = (int)hi;
  return 0;
}

void psr_env_free(psr_env *e) {
  if (!e) return;
  free(e->nodelist);
  free(e->tasks_per_node);
  free(e->dist_raw);
  free(e->gpus);
  e->nodelist = NULL;
  e->tasks_per_node = NULL;
  e->dist_raw = NULL;
  e->gpus = NULL;
}

/* Task count, rank, job and step ids. */
static int env_ids(psr_env *e, const char *(*get)(const char *), char *err, size_t errlen) {
  const char *var, *val;

  /* Task count first: the rank is checked against it. */
  const char *ntasks_var;
  val = get_first(get, &ntasks_var, "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
                  (const char *)NULL);
  if (!val) {
    ps__errf(-1, err, errlen, "SLURM_NTASKS is not set: " PSR_HINT);
    return -1;
  }
  if (parse_int_var(ntasks_var, val, 1, INT_MAX, &e->ntasks, err, errlen) != 0)
    return -1;

  var = "SLURM_PROCID";
  val = get(var);
  if (!val) {
    ps__errf(-1, err, errlen, "%s is not set: " PSR_HINT, var);
    return -1;
  }
  if (parse_int_var(var, val, 0, INT_MAX, &e->procid, err, errlen) != 0) return -1;
  if (e->procid >= e->ntasks) {
    ps__errf(-1, err, errlen, "%s=%s is not below %s=%d", var, val, ntasks_var, e->ntasks);
    return -1;
  }

  var = "SLURM_JOB_ID";
  val = get(var);
  if (!val) {
    ps__errf(-1, err, errlen, "%s is not set: " PSR_HINT, var);
    return -1;
  }
  if (parse_ll_var(var, val, 1, 4294967295LL, &e->job_id, err, errlen) != 0) return -1;

  var = "SLURM_STEP_ID";
  if ((val = get(var)) != NULL &&
      parse_ll_var(var, val, 0, 4294967295LL, &e->step_id, err, errlen) != 0)
    return -1;
  return 0;
}

/* Nodes: how many, which, tasks on each, and this task's. */
static int env_nodes(psr_env *e, const char *(*get)(const char *), char *err, size_t errlen) {
  const char *var, *val;
  const char *nn_var;
  val = get_first(get, &nn_var, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES",
                  "SLURM_NNODES", (const char *)NULL);
  if (!val) {
    ps__errf(-1, err, errlen, "SLURM_STEP_NUM_NODES is not set: " PSR_HINT);
    return -1;
  }
  if (parse_int_var(nn_var, val, 1, PSR_MAX_NODES, &e->num_nodes, err, errlen) != 0)
    return -1;

  val = get_first(get, &e->nodelist_var, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                  (const char *)NULL);
  if (!val) {
    ps__errf(-1, err, errlen, "SLURM_STEP_NODELIST is not set: " PSR_HINT);
    return -1;
  }
  if (!*val) {
    ps__errf(-1, err, errlen, "%s is set but empty", e->nodelist_var);
    return -1;
  }
  if (dup_str(&e->nodelist, val, err, errlen) != 0) return -1;

  const char *tpn_var;
  val = get_first(get, &tpn_var, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                  (const char *)NULL);
  if (!val) {
    ps__errf(-1, err, errlen, "SLURM_STEP_TASKS_PER_NODE is not set: " PSR_HINT);
    return -1;
  }
  if (!*val) {
    ps__errf(-1, err, errlen, "%s is set but empty", tpn_var);
    return -1;
  }
  if (dup_str(&e->tasks_per_node, val, err, errlen) != 0) return -1;

  var = "SLURM_LOCALID";
  if ((val = get(var)) != NULL &&
      parse_int_var(var, val, 0, e->ntasks - 1, &e->localid, err, errlen) != 0)
    return -1;

  var = "SLURM_NODEID";
  if ((val = get(var)) != NULL) {
    if (parse_int_var(var, val, 0, INT_MAX, &e->nodeid, err, errlen) != 0) return -1;
    if (e->nodeid >= e->num_nodes) {
      ps__errf(-1, err, errlen, "%s=%s is not below %s=%d", var, val, nn_var, e->num_nodes);
      return -1;
    }
  }

  var = "SLURMD_NODENAME";
  if ((val = get(var)) != NULL) {
    if (strlen(val) >= sizeof e->nodename) {
      ps__errf(-1, err, errlen, "%s='%.40s...' is longer than %d characters", var, val,
             PSR_MAX_HOST - 1);
      return -1;
    }
    strcpy(e->nodename, val);
  }
  return 0;
}

/* Distribution, ports, CPUs, GPUs, heterogeneous steps, PMI-2. */
static int env_extras(psr_env *e, const char *(*get)(const char *), char *err, size_t errlen) {
  const char *var, *val;
  val = get("SLURM_DISTRIBUTION");
  if (val && dup_str(&e->dist_raw, val, err, errlen) != 0) return -1;
  if (parse_dist(e, val, get, err, errlen) != 0) return -1;

  if ((val = get("SLURM_STEP_RESV_PORTS")) != NULL &&
      parse_ports(e, val, err, errlen) != 0)
    return -1;

  var = "SLURM_CPUS_PER_TASK";
  if ((val = get(var)) != NULL &&
      parse_int_var(var, val, 1, PSR_MAX_COUNT, &e->cpus_per_task, err, errlen) != 0)
    return -1;

  /* GPUs: CUDA_VISIBLE_DEVICES is what the task actually sees; set but
   * empty means every GPU is hidden (no fallback to Slurm's list). */
  const char *gpu_var;
  val = get_first(get, &gpu_var, "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS",
                  "SLURM_JOB_GPUS", (const char *)NULL);
  if (val && *val && dup_str(&e->gpus, val, err, errlen) != 0) return -1;

  var = "SLURM_HET_SIZE";
  if ((val = get(var)) != NULL &&
      parse_int_var(var, val, 1, PSR_MAX_COUNT, &e->het_size, err, errlen) != 0)
    return -1;

  e->pmi2 = get("PMI_FD") != NULL;
  return 0;
}

static int env_read(psr_env *e, const char *(*get)(const char *), char *err,
                    size_t errlen) {
  if (env_ids(e, get, err, errlen) != 0 || env_nodes(e, get, err, errlen) != 0) return -1;
  return env_extras(e, get, err, errlen);
}

int psr_env_read(psr_env *e, const char *(*get)(const char *name), char *err,
                 size_t errlen) {
  if (err && errlen) err[0] = '\0';
  if (!e || !get) {
    ps__errf(-1, err, errlen, "psr_env_read: no environment to read");
    return -1;
  }
  memset(e, 0, sizeof *e);
  e->dist = PSR_DIST_BLOCK;
  if (env_read(e, get, err, errlen) != 0) {
    psr_env_free(e);
    memset(e, 0, sizeof *e);
    return -1;
  }
  return 0;
}

/* ---- nodelist ------------------------------------------------------------ */

void psr_hosts_free(char **hosts, int n) {
  if (!hosts) return;
  for (int i = 0; i < n; i++) free(hosts[i]);
  free(hosts);
}

/* The variable that holds the count for nodelist variable `var`:
 * SLURM_STEP_NODELIST -> SLURM_STEP_NUM_NODES, SLURM_JOB_NODELIST ->
 * SLURM_JOB_NUM_NODES. 0, or -1 when there is no such counterpart. */
static int count_var_of(const char *var, char *out, size_t outlen) {
  static const char suffix[] = "NODELIST";
  size_t n = strlen(var), s = sizeof suffix - 1;
  if (n < s || strcmp(var + n - s, suffix) != 0) return -1;
  if (n - s + sizeof "NUM_NODES" > outlen) return -1;
  memcpy(out, var, n - s);
  strcpy(out + n - s, "NUM_NODES");
  return 0;
}

static int cmp_str_ptr(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

int psr_expand_nodelist(const char *var, const char *list, int expect, char ***hosts,
                        int *n, char *err, size_t errlen) {
  if (err && errlen) err[0] = '\0';
  if (!var) var = "nodelist";
  if (!hosts || !n) {
    ps__errf(-1, err, errlen, "psr_expand_nodelist: nowhere to put the hosts of %s", var);
    return -1;
  }
  *hosts = NULL;
  *n = 0;
  if (!list) {
    ps__errf(-1, err, errlen, "%s is not set", var);
    return -1;
  }
  if (!*list) {
    ps__errf(-1, err, errlen, "%s is set but empty", var);
    return -1;
  }
  if (expect < 1 || expect > PSR_MAX_NODES) {
    ps__errf(-1, err, errlen, "%s='%s' cannot be checked: expected host count %d is not in 1..%d",
           var, list, expect, PSR_MAX_NODES);
    return -1;
  }

  /* struct hostlist * is hostlist_t in Slurm <= 23.02 and hostlist_t * after. */
  struct hostlist *hl = slurm_hostlist_create(list);
  if (!hl) {
    ps__errf(-1, err, errlen, "%s='%s' is not a valid Slurm nodelist", var, list);
    return -1;
  }
  int count = slurm_hostlist_count(hl);
  if (count != expect) {
    char cvar[128];
    if (count_var_of(var, cvar, sizeof cvar) == 0)
      ps__errf(-1, err, errlen, "%s='%s' expands to %d host(s) but %s says %d", var, list,
             count, cvar, expect);
    else
      ps__errf(-1, err, errlen, "%s='%s' expands to %d host(s) but %d were expected", var, list,
             count, expect);
    slurm_hostlist_destroy(hl);
    return -1;
  }

  char **h = calloc((size_t)count, sizeof *h);
  if (!h) {
    slurm_hostlist_destroy(hl);
    ps__errf(-1, err, errlen, "out of memory expanding %s", var);
    return -1;
  }
  int got = 0;
  int rc = 0;
  char *s;
  while (got < count && (s = slurm_hostlist_shift(hl)) != NULL) {
    /* libslurm's strings are malloc'd: ours to keep or free(). */
    h[got++] = s;
    if (rc) continue;
    if (strpbrk(s, "[],") != NULL || s[0] == '\0') {
      ps__errf(-1, err, errlen, "%s='%s' is malformed: it expands to host '%s'", var, list, s);
      rc = -1;
    } else if (strlen(s) >= PSR_MAX_HOST) {
      ps__errf(-1, err, errlen, "%s='%s' names a host longer than %d characters", var, list,
             PSR_MAX_HOST - 1);
      rc = -1;
    }
  }
  slurm_hostlist_destroy(hl);
  if (!rc && got != count) {
    ps__errf(-1, err, errlen, "%s='%s' expands to %d host(s) but only %d could be read", var,
           list, count, got);
    rc = -1;
  }
  if (!rc && count > 1) {
    /* A host named twice would make node indices ambiguous. */
    char **sorted = malloc((size_t)count * sizeof *sorted);
    if (!sorted) {
      ps__errf(-1, err, errlen, "out of memory expanding %s", var);
      rc = -1;
    } else {
      memcpy(sorted, h, (size_t)count * sizeof *sorted);
      qsort(sorted, (size_t)count, sizeof *sorted, cmp_str_ptr);
      for (int i = 1; i < count; i++) {
        if (strcmp(sorted[i - 1], sorted[i]) == 0) {
          ps__errf(-1, err, errlen, "%s='%s' names host '%s' more than once", var, list,
                 sorted[i]);
          rc = -1;
          break;
        }
      }
      free(sorted);
    }
  }
  if (rc) {
    psr_hosts_free(h, got);
    return -1;
  }
  *hosts = h;
  *n = count;
  return 0;
}

/* ---- tasks per node ------------------------------------------------------ */

/* Reads digits at *p into [1, PSR_MAX_COUNT]. 0 ok, -1 no digits, -2 zero
 * or too large. Advances *p past the digits. */
static int read_count(const char **p, long long *out) {
  const char *s = *p;
  long long v = 0;
  int digits = 0, big = 0;
  while (*s >= '0' && *s <= '9') {
    if (!big) {
      v = v * 10 + (*s - '0');
      if (v > PSR_MAX_COUNT) big = 1;
    }
    s++;
    digits++;
  }
  *p = s;
  if (!digits) return -1;
  if (big || v < 1) return -2;
  *out = v;
  return 0;
}

int psr_parse_tasks_per_node(const char *var, const char *s, int **counts, int *n,
                             char *err, size_t errlen) {
  if (err && errlen) err[0] = '\0';
  if (!var) var = "tasks per node";
  if (!counts || !n) {
    ps__errf(-1, err, errlen, "psr_parse_tasks_per_node: nowhere to put the counts of %s", var);
    return -1;
  }
  *counts = NULL;
  *n = 0;
  if (!s) {
    ps__errf(-1, err, errlen, "%s is not set", var);
    return -1;
  }
  if (!*s) {
    ps__errf(-1, err, errlen, "%s is set but empty", var);
    return -1;
  }

  /* Pass 1 validates and totals; pass 2 fills. */
  long long total = 0;
  for (int pass = 0; pass < 2; pass++) {
    const char *p = s;
    int at = 0;
    for (;;) {
      const char *item = p;
      size_t ilen = strcspn(item, ",");
      long long c = 0, rep = 1;
      int rc = read_count(&p, &c);
      if (rc == 0 && *p == '(') {
        if (p[1] != 'x') {
          rc = -1;
        } else {
          p += 2;
          rc = read_count(&p, &rep);
          if (rc == 0 && *p++ != ')') rc = -1;
        }
      }
      if (rc == 0 && *p != ',' && *p != '\0') rc = -1;
      if (rc != 0) {
        int w = ilen > 64 ? 64 : (int)ilen;
        if (rc == -2)
          ps__errf(-1, err, errlen, "%s='%s' has item '%.*s' with a count outside 1..%d", var,
                 s, w, item, PSR_MAX_COUNT);
        else
          ps__errf(-1, err, errlen, "%s='%s' has malformed item '%.*s' (want N or N(xM))", var,
                 s, w, item);
        return -1;
      }
      if (pass == 0) {
        total += rep;
        if (total > PSR_MAX_NODES) {
          ps__errf(-1, err, errlen, "%s='%.64s%s' describes more than %d nodes", var, s,
                 strlen(s) > 64 ? "..." : "", PSR_MAX_NODES);
          return -1;
        }
      } else {
        for (long long k = 0; k < rep; k++) (*counts)[at++] = (int)c;
      }
      if (*p == '\0') break;
      p++; /* ',' */
      if (*p == '\0' || *p == ',') {
        ps__errf(-1, err, errlen, "%s='%s' has an empty item", var, s);
        return -1;
      }
    }
    if (pass == 0) {
      *counts = malloc((size_t)total * sizeof **counts);
      if (!*counts) {
        ps__errf(-1, err, errlen, "out of memory parsing %s", var);
        return -1;
      }
    }
  }
  *n = (int)total;
  return 0;
}

/* ---- layout -------------------------------------------------------------- */

int psr_layout(psr_dist dist, int plane_size, const int *counts, int nnodes, int ntasks,
               int *node_of, char *err, size_t errlen) {
  if (err && errlen) err[0] = '\0';
  if (dist == PSR_DIST_ARBITRARY || dist == PSR_DIST_UNKNOWN) {
    if (dist == PSR_DIST_ARBITRARY)
      ps__errf(-1, err, errlen,
             "SLURM_DISTRIBUTION=arbitrary: the task layout cannot be derived from the "
             "environment");
    else
      ps__errf(-1, err, errlen,
             "SLURM_DISTRIBUTION names a distribution psrun does not know: the task "
             "layout cannot be derived from the environment");
    return -1;
  }
  if (dist != PSR_DIST_BLOCK && dist != PSR_DIST_CYCLIC && dist != PSR_DIST_PLANE) {
    ps__errf(-1, err, errlen, "task distribution %d is not one psrun knows", (int)dist);
    return -1;
  }
  if (!counts || !node_of || nnodes < 1 || ntasks < 1) {
    ps__errf(-1, err, errlen, "cannot lay out %d task(s) on %d node(s)", ntasks, nnodes);
    return -1;
  }
  if (dist == PSR_DIST_PLANE && plane_size < 1) {
    ps__errf(-1, err, errlen, "plane distribution with plane size %d: it must be at least 1",
           plane_size);
    return -1;
  }
  long long sum = 0;
  for (int i = 0; i < nnodes; i++) {
    if (counts[i] < 1) {
      ps__errf(-1, err, errlen, "node %d has %d task(s) in the tasks-per-node list", i,
             counts[i]);
      return -1;
    }
    sum += counts[i];
  }
  if (sum != ntasks) {
    ps__errf(-1, err, errlen,
           "the tasks-per-node counts add up to %lld task(s) but the step has %d", sum,
           ntasks);
    return -1;
  }

  if (dist == PSR_DIST_BLOCK) {
    int r = 0;
    for (int i = 0; i < nnodes; i++)
      for (int k = 0; k < counts[i]; k++) node_of[r++] = i;
    return 0;
  }

  /* cyclic is plane with blocks of one. Each round deals a block of
   * min(P, room) ranks to every node that still has room, in node order;
   * nodes that fill up leave the active list, so the work is
   * O(ntasks + nnodes) whatever the counts. */
  int p = dist == PSR_DIST_CYCLIC ? 1 : plane_size;
  int *active = malloc((size_t)nnodes * sizeof *active);
  int *room = malloc((size_t)nnodes * sizeof *room);
  if (!active || !room) {
    free(active);
    free(room);
    ps__errf(-1, err, errlen, "out of memory laying out %d tasks", ntasks);
    return -1;
  }
  int nact = nnodes;
  for (int i = 0; i < nnodes; i++) {
    active[i] = i;
    room[i] = counts[i];
  }
  int r = 0;
  while (r < ntasks && nact > 0) {
    int keep = 0;
    for (int a = 0; a < nact; a++) {
      int i = active[a];
      int take = room[i] < p ? room[i] : p;
      for (int k = 0; k < take; k++) node_of[r++] = i;
      room[i] -= take;
      if (room[i] > 0) active[keep++] = i;
    }
    nact = keep;
  }
  free(active);
  free(room);
  return 0;
}

/* ---- plan ---------------------------------------------------------------- */

/* Each worker's index among the workers of its node and every role's count
 * of them: torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE, which count workers
 * only (a script picks its GPU by LOCAL_RANK; a ps uses none). 0 or -1. */
static int count_node_workers(int ntasks, int maxnode, psr_role *roles) {
  int *seen = calloc((size_t)maxnode + 1, sizeof *seen);
  if (!seen) return -1;
  for (int r = 0; r < ntasks; r++)
    roles[r].worker_local_rank = roles[r].is_ps ? -1 : seen[roles[r].node]++;
  for (int r = 0; r < ntasks; r++) roles[r].node_workers = seen[roles[r].node];
  free(seen);
  return 0;
}

int psr_plan(int ntasks, int num_ps, psr_placement place, const int *node_of,
             psr_role *roles, char *err, size_t errlen) {
  if (err && errlen) err[0] = '\0';
  if (ntasks < 1 || !node_of || !roles) {
    ps__errf(-1, err, errlen, "cannot plan a step of %d task(s)", ntasks);
    return -1;
  }
  if (num_ps < 1 || num_ps >= ntasks) {
    ps__errf(-1, err, errlen,
           "--ps=%d must be at least 1 and less than the number of tasks (%d)", num_ps,
           ntasks);
    return -1;
  }
  if (place != PSR_PLACE_PACK && place != PSR_PLACE_SPREAD) {
    ps__errf(-1, err, errlen, "unknown ps placement %d", (int)place);
    return -1;
  }
  int maxnode = 0;
  for (int r = 0; r < ntasks; r++) {
    if (node_of[r] < 0 || node_of[r] >= PSR_MAX_NODES) {
      ps__errf(-1, err, errlen, "rank %d is on node %d, outside 0..%d", r, node_of[r],
             PSR_MAX_NODES - 1);
      return -1;
    }
    if (node_of[r] > maxnode) maxnode = node_of[r];
  }
  int *seen = calloc((size_t)maxnode + 1, sizeof *seen);
  if (!seen) {
    ps__errf(-1, err, errlen, "out of memory planning %d tasks", ntasks);
    return -1;
  }
  int distinct = 0;
  for (int r = 0; r < ntasks; r++) {
    roles[r].rank = r;
    roles[r].node = node_of[r];
    roles[r].local_rank = seen[node_of[r]]++;
    if (roles[r].local_rank == 0) distinct++;
  }
  free(seen);
  if (place == PSR_PLACE_SPREAD && distinct < num_ps) {
    ps__errf(-1, err, errlen, "--ps-placement=spread needs %d nodes but the step has %d",
           num_ps, distinct);
    return -1;
  }

  int nps = 0, nworkers = 0;
  for (int r = 0; r < ntasks; r++) {
    int ps;
    if (place == PSR_PLACE_PACK)
      ps = r < num_ps;
    else /* the first rank on a node not seen before, while ps are wanted */
      ps = roles[r].local_rank == 0 && nps < num_ps;
    roles[r].is_ps = ps;
    roles[r].index = ps ? nps++ : nworkers++;
  }
  if (count_node_workers(ntasks, maxnode, roles) != 0) {
    ps__errf(-1, err, errlen, "out of memory planning %d tasks", ntasks);
    return -1;
  }
  return 0;
}
