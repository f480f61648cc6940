/* psrun's layout (psrun/layout.c): the Slurm environment through a fake
 * table, nodelist expansion with libslurm, tasks-per-node strings, the
 * block/cyclic/plane rank -> node layouts and the ps/worker plan. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"

Suite *suite_layout(void);

#define ERRLEN 512

/* The message must contain needle. */
#define ASSERT_HAS(msg, needle)                                                \
  ck_assert_msg(strstr((msg), (needle)) != NULL,                               \
                "message '%s' does not mention '%s'", (msg), (needle))

/* ---- fake environment ----------------------------------------------------- */

#define ENV_MAX 64
static const char *env_names[ENV_MAX];
static const char *env_values[ENV_MAX];
static int env_n;

static const char *env_get(const char *name) {
  for (int i = 0; i < env_n; i++)
    if (strcmp(env_names[i], name) == 0) return env_values[i];
  return NULL;
}

/* Sets (value non-NULL) or unsets (NULL) name. */
static void env_set(const char *name, const char *value) {
  for (int i = 0; i < env_n; i++) {
    if (strcmp(env_names[i], name) == 0) {
      if (value) {
        env_values[i] = value;
      } else {
        env_n--;
        env_names[i] = env_names[env_n];
        env_values[i] = env_values[env_n];
      }
      return;
    }
  }
  if (!value) return;
  ck_assert_int_lt(env_n, ENV_MAX);
  env_names[env_n] = name;
  env_values[env_n] = value;
  env_n++;
}

static const char *const GOOD_ENV[][2] = {
    {"SLURM_PROCID", "3"},
    {"SLURM_NTASKS", "4"},
    {"SLURM_LOCALID", "1"},
    {"SLURM_NODEID", "1"},
    {"SLURMD_NODENAME", "n2"},
    {"SLURM_STEP_NODELIST", "n[1-2]"},
    {"SLURM_STEP_NUM_NODES", "2"},
    {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
    {"SLURM_JOB_ID", "4242"},
    {"SLURM_STEP_ID", "7"},
    {"SLURM_CPUS_PER_TASK", "8"},
    {"SLURM_STEP_RESV_PORTS", "12000-12015"},
    {"CUDA_VISIBLE_DEVICES", "0,1"},
    {"SLURM_DISTRIBUTION", "cyclic"},
};

/* Only what psr_env_read requires. */
static const char *const MINIMAL_ENV[][2] = {
    {"SLURM_PROCID", "0"},
    {"SLURM_NTASKS", "2"},
    {"SLURM_STEP_NODELIST", "a,b"},
    {"SLURM_STEP_NUM_NODES", "2"},
    {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
    {"SLURM_JOB_ID", "1"},
};

static void env_load(const char *const tab[][2], size_t n) {
  env_n = 0;
  for (size_t i = 0; i < n; i++) env_set(tab[i][0], tab[i][1]);
}

static void env_good(void) { env_load(GOOD_ENV, sizeof GOOD_ENV / sizeof GOOD_ENV[0]); }
static void env_minimal(void) {
  env_load(MINIMAL_ENV, sizeof MINIMAL_ENV / sizeof MINIMAL_ENV[0]);
}

/* Reads the current table; must succeed. */
static void read_ok(psr_env *e) {
  char err[ERRLEN] = "";
  int rc = psr_env_read(e, env_get, err, sizeof err);
  ck_assert_msg(rc == 0, "psr_env_read failed: %s", err);
}

/* Reads the current table; must fail with a message holding both needles. */
static void read_fails(const char *needle1, const char *needle2) {
  psr_env e;
  char err[ERRLEN] = "";
  int rc = psr_env_read(&e, env_get, err, sizeof err);
  ck_assert_msg(rc == -1, "expected failure (%s), got %d", needle1, rc);
  ck_assert_msg(err[0] != '\0', "failure without a message");
  ASSERT_HAS(err, needle1);
  if (needle2) ASSERT_HAS(err, needle2);
  /* Nothing is left owned after a failure. */
  ck_assert_ptr_null(e.nodelist);
  ck_assert_ptr_null(e.tasks_per_node);
  ck_assert_ptr_null(e.dist_raw);
  ck_assert_ptr_null(e.gpus);
}

/* Reads the current table; must fail with exactly `want`. */
static void read_fails_exact(const char *want) {
  psr_env e;
  char err[ERRLEN] = "";
  ck_assert_int_eq(psr_env_read(&e, env_get, err, sizeof err), -1);
  ck_assert_str_eq(err, want);
}

START_TEST(env_good_fields) {
  env_good();
  psr_env e;
  read_ok(&e);
  ck_assert_int_eq(e.procid, 3);
  ck_assert_int_eq(e.ntasks, 4);
  ck_assert_int_eq(e.localid, 1);
  ck_assert_int_eq(e.nodeid, 1);
  ck_assert_str_eq(e.nodename, "n2");
  ck_assert_str_eq(e.nodelist, "n[1-2]");
  ck_assert_str_eq(e.nodelist_var, "SLURM_STEP_NODELIST");
  ck_assert_int_eq(e.num_nodes, 2);
  ck_assert_str_eq(e.tasks_per_node, "2(x2)");
  ck_assert_int_eq(e.dist, PSR_DIST_CYCLIC);
  ck_assert_str_eq(e.dist_raw, "cyclic");
  ck_assert(e.job_id == 4242);
  ck_assert(e.step_id == 7);
  ck_assert_int_eq(e.resv_port_lo, 12000);
  ck_assert_int_eq(e.resv_port_hi, 12015);
  ck_assert_int_eq(e.cpus_per_task, 8);
  ck_assert_str_eq(e.gpus, "0,1");
  ck_assert_int_eq(e.het_size, 0);
  ck_assert_int_eq(e.pmi2, 0);
  /* The strings are copies, not the table's. */
  ck_assert_ptr_ne(e.nodelist, env_get("SLURM_STEP_NODELIST"));
  psr_env_free(&e);
}
END_TEST

START_TEST(env_minimal_defaults) {
  env_minimal();
  psr_env e;
  read_ok(&e);
  ck_assert_int_eq(e.procid, 0);
  ck_assert_int_eq(e.ntasks, 2);
  ck_assert_int_eq(e.localid, 0);
  ck_assert_int_eq(e.nodeid, 0);
  ck_assert_str_eq(e.nodename, "");
  ck_assert(e.step_id == 0);
  ck_assert(e.job_id == 1);
  ck_assert_int_eq(e.dist, PSR_DIST_BLOCK); /* Slurm's default */
  ck_assert_ptr_null(e.dist_raw);
  ck_assert_int_eq(e.resv_port_lo, 0);
  ck_assert_int_eq(e.resv_port_hi, 0);
  ck_assert_int_eq(e.cpus_per_task, 0);
  ck_assert_ptr_null(e.gpus);
  ck_assert_int_eq(e.het_size, 0);
  ck_assert_int_eq(e.pmi2, 0);
  psr_env_free(&e);
}
END_TEST

START_TEST(env_missing_required) {
  env_good();
  env_set("SLURM_NTASKS", NULL);
  read_fails("SLURM_NTASKS", "psrun --local");
  read_fails_exact("SLURM_NTASKS is not set: run psrun under srun, or use psrun --local");

  env_good();
  env_set("SLURM_PROCID", NULL);
  read_fails("SLURM_PROCID", "psrun --local");

  env_good();
  env_set("SLURM_JOB_ID", NULL);
  read_fails("SLURM_JOB_ID", "not set");

  env_good();
  env_set("SLURM_STEP_NODELIST", NULL);
  read_fails("NODELIST", "not set");

  env_good();
  env_set("SLURM_STEP_NUM_NODES", NULL);
  read_fails("NUM_NODES", "not set");

  env_good();
  env_set("SLURM_STEP_TASKS_PER_NODE", NULL);
  read_fails("TASKS_PER_NODE", "not set");

  env_good();
  env_set("SLURM_STEP_NODELIST", "");
  read_fails("SLURM_STEP_NODELIST", "empty");
}
END_TEST

START_TEST(env_fallbacks) {
  psr_env e;
  /* Job-level variables when the step ones are missing. */
  env_minimal();
  env_set("SLURM_STEP_NODELIST", NULL);
  env_set("SLURM_STEP_NUM_NODES", NULL);
  env_set("SLURM_STEP_TASKS_PER_NODE", NULL);
  env_set("SLURM_JOB_NODELIST", "c[1-3]");
  env_set("SLURM_JOB_NUM_NODES", "3");
  env_set("SLURM_TASKS_PER_NODE", "1,1,1");
  env_set("SLURM_NTASKS", "3");
  read_ok(&e);
  ck_assert_str_eq(e.nodelist, "c[1-3]");
  ck_assert_str_eq(e.nodelist_var, "SLURM_JOB_NODELIST");
  ck_assert_int_eq(e.num_nodes, 3);
  ck_assert_str_eq(e.tasks_per_node, "1,1,1");
  psr_env_free(&e);

  /* The step variables win over the job ones. */
  env_set("SLURM_STEP_NODELIST", "d1");
  env_set("SLURM_STEP_NUM_NODES", "1");
  env_set("SLURM_STEP_TASKS_PER_NODE", "3");
  read_ok(&e);
  ck_assert_str_eq(e.nodelist, "d1");
  ck_assert_str_eq(e.nodelist_var, "SLURM_STEP_NODELIST");
  ck_assert_int_eq(e.num_nodes, 1);
  ck_assert_str_eq(e.tasks_per_node, "3");
  psr_env_free(&e);

  /* SLURM_NNODES last; SLURM_STEP_NUM_TASKS for SLURM_NTASKS. */
  env_minimal();
  env_set("SLURM_STEP_NUM_NODES", NULL);
  env_set("SLURM_NNODES", "2");
  env_set("SLURM_NTASKS", NULL);
  env_set("SLURM_STEP_NUM_TASKS", "2");
  read_ok(&e);
  ck_assert_int_eq(e.num_nodes, 2);
  ck_assert_int_eq(e.ntasks, 2);
  psr_env_free(&e);
}
END_TEST

START_TEST(env_bad_procid) {
  env_good();
  env_set("SLURM_PROCID", "x");
  read_fails_exact("SLURM_PROCID='x' is not an integer");
  env_set("SLURM_PROCID", "4");
  read_fails_exact("SLURM_PROCID=4 is not below SLURM_NTASKS=4");
  env_set("SLURM_PROCID", "5");
  read_fails_exact("SLURM_PROCID=5 is not below SLURM_NTASKS=4");
  const char *bad[] = {"1x", " 1", "1 ", "", "+1", "0x1", "1.0", "-", "-1",
                       "99999999999999999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    env_set("SLURM_PROCID", bad[i]);
    read_fails("SLURM_PROCID", bad[i]);
  }
  /* The task count named in the message is the variable actually read. */
  env_set("SLURM_PROCID", "9");
  env_set("SLURM_NTASKS", NULL);
  env_set("SLURM_STEP_NUM_TASKS", "4");
  read_fails_exact("SLURM_PROCID=9 is not below SLURM_STEP_NUM_TASKS=4");
}
END_TEST

START_TEST(env_bad_values) {
  static const struct {
    const char *var, *value;
  } cases[] = {
      {"SLURM_NTASKS", "0"},           {"SLURM_NTASKS", "-2"},
      {"SLURM_NTASKS", "four"},        {"SLURM_NTASKS", "4k"},
      {"SLURM_NTASKS", "3000000000"},  {"SLURM_LOCALID", "x"},
      {"SLURM_LOCALID", "-1"},         {"SLURM_LOCALID", "4"},
      {"SLURM_NODEID", "2"},           {"SLURM_NODEID", "a"},
      {"SLURM_STEP_NUM_NODES", "0"},   {"SLURM_STEP_NUM_NODES", "2x"},
      {"SLURM_JOB_ID", "0"},           {"SLURM_JOB_ID", "12.3"},
      {"SLURM_JOB_ID", "-5"},          {"SLURM_STEP_ID", "x"},
      {"SLURM_STEP_ID", "-1"},         {"SLURM_CPUS_PER_TASK", "0"},
      {"SLURM_CPUS_PER_TASK", "2c"},   {"SLURM_STEP_RESV_PORTS", "abc"},
      {"SLURM_STEP_RESV_PORTS", "12015-12000"},
      {"SLURM_STEP_RESV_PORTS", "70000"},
      {"SLURM_STEP_RESV_PORTS", "12000-"},
      {"SLURM_STEP_RESV_PORTS", "-5"}, {"SLURM_STEP_RESV_PORTS", ""},
      {"SLURM_STEP_RESV_PORTS", "0-10"},
      {"SLURM_HET_SIZE", "0"},         {"SLURM_HET_SIZE", "two"},
      {"SLURM_DISTRIBUTION", "plane=x"},
      {"SLURM_DISTRIBUTION", "plane=0"},
      {"SLURM_DISTRIBUTION", "plane=4x"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    env_good();
    env_set(cases[i].var, cases[i].value);
    read_fails(cases[i].var, cases[i].value);
  }
  env_good();
  env_set("SLURM_DISTRIBUTION", "plane");
  env_set("SLURM_DIST_PLANESIZE", "many");
  read_fails("SLURM_DIST_PLANESIZE", "many");
}
END_TEST

START_TEST(env_distribution) {
  static const struct {
    const char *raw;  /* NULL: unset */
    const char *size; /* SLURM_DIST_PLANESIZE, or NULL */
    psr_dist dist;
    int plane;
  } cases[] = {
      {NULL, NULL, PSR_DIST_BLOCK, 0},
      {"block", NULL, PSR_DIST_BLOCK, 0},
      {"cyclic", NULL, PSR_DIST_CYCLIC, 0},
      {"Cyclic", NULL, PSR_DIST_CYCLIC, 0},
      {"cyclic:block", NULL, PSR_DIST_CYCLIC, 0},
      {"cyclic:cyclic:fcyclic", NULL, PSR_DIST_CYCLIC, 0},
      {"block:cyclic", NULL, PSR_DIST_BLOCK, 0},
      {"block,Pack", NULL, PSR_DIST_BLOCK, 0},
      {"*:cyclic", NULL, PSR_DIST_BLOCK, 0},
      {"plane=4", NULL, PSR_DIST_PLANE, 4},
      {"plane=4", "9", PSR_DIST_PLANE, 4}, /* the explicit size wins */
      {"plane", "3", PSR_DIST_PLANE, 3},
      {"plane", NULL, PSR_DIST_UNKNOWN, 0}, /* no size: cannot derive */
      {"arbitrary", NULL, PSR_DIST_ARBITRARY, 0},
      {"hostfile", NULL, PSR_DIST_ARBITRARY, 0},
      {"spiral", NULL, PSR_DIST_UNKNOWN, 0},
      {"", NULL, PSR_DIST_UNKNOWN, 0},
      {"cyclic=2", NULL, PSR_DIST_UNKNOWN, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    env_good();
    env_set("SLURM_DISTRIBUTION", cases[i].raw);
    env_set("SLURM_DIST_PLANESIZE", cases[i].size);
    psr_env e;
    read_ok(&e);
    ck_assert_msg(e.dist == cases[i].dist, "'%s': dist %d, want %d",
                  cases[i].raw ? cases[i].raw : "(unset)", (int)e.dist,
                  (int)cases[i].dist);
    if (cases[i].dist == PSR_DIST_PLANE)
      ck_assert_int_eq(e.plane_size, cases[i].plane);
    if (cases[i].raw)
      ck_assert_str_eq(e.dist_raw, cases[i].raw);
    else
      ck_assert_ptr_null(e.dist_raw);
    psr_env_free(&e);
  }
}
END_TEST

START_TEST(env_ports) {
  static const struct {
    const char *raw;
    int lo, hi;
  } cases[] = {
      {"12000-12015", 12000, 12015},
      {"12000", 12000, 12000},
      {"12000-12003,13000-13003", 12000, 12003},
      {"1-65535", 1, 65535},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    env_good();
    env_set("SLURM_STEP_RESV_PORTS", cases[i].raw);
    psr_env e;
    read_ok(&e);
    ck_assert_int_eq(e.resv_port_lo, cases[i].lo);
    ck_assert_int_eq(e.resv_port_hi, cases[i].hi);
    psr_env_free(&e);
  }
}
END_TEST

START_TEST(env_gpus_het_pmi) {
  psr_env e;
  env_good();
  env_set("SLURM_STEP_GPUS", "2,3");
  env_set("SLURM_JOB_GPUS", "4");
  read_ok(&e);
  ck_assert_str_eq(e.gpus, "0,1"); /* CUDA_VISIBLE_DEVICES first */
  psr_env_free(&e);

  env_set("CUDA_VISIBLE_DEVICES", NULL);
  read_ok(&e);
  ck_assert_str_eq(e.gpus, "2,3");
  psr_env_free(&e);

  env_set("SLURM_STEP_GPUS", NULL);
  read_ok(&e);
  ck_assert_str_eq(e.gpus, "4");
  psr_env_free(&e);

  /* Set but empty: every GPU hidden, no fallback. */
  env_set("CUDA_VISIBLE_DEVICES", "");
  read_ok(&e);
  ck_assert_ptr_null(e.gpus);
  psr_env_free(&e);

  env_good();
  env_set("SLURM_HET_SIZE", "2");
  env_set("PMI_FD", "5");
  read_ok(&e);
  ck_assert_int_eq(e.het_size, 2);
  ck_assert_int_eq(e.pmi2, 1);
  psr_env_free(&e);
}
END_TEST

START_TEST(env_long_nodename) {
  static char name[PSR_MAX_HOST + 10];
  memset(name, 'h', sizeof name - 1);
  name[sizeof name - 1] = '\0';
  env_good();
  env_set("SLURMD_NODENAME", name);
  read_fails("SLURMD_NODENAME", "longer");
  name[PSR_MAX_HOST - 1] = '\0'; /* the longest that fits */
  psr_env e;
  read_ok(&e);
  ck_assert_str_eq(e.nodename, name);
  psr_env_free(&e);
}
END_TEST

/* ---- nodelists ------------------------------------------------------------ */

/* Expands list (expecting exactly the NULL-terminated hosts). */
static void expand_ok(const char *list, const char *const *want) {
  int nwant = 0;
  while (want[nwant]) nwant++;
  char **hosts = NULL;
  int n = -1;
  char err[ERRLEN] = "";
  int rc = psr_expand_nodelist("SLURM_STEP_NODELIST", list, nwant, &hosts, &n, err,
                               sizeof err);
  ck_assert_msg(rc == 0, "'%s': %s", list, err);
  ck_assert_int_eq(n, nwant);
  for (int i = 0; i < n; i++) ck_assert_str_eq(hosts[i], want[i]);
  psr_hosts_free(hosts, n);
}

/* Expansion must fail with a message holding both needles. */
static void expand_fails(const char *var, const char *list, int expect,
                         const char *needle1, const char *needle2) {
  char **hosts = (char **)&hosts; /* must be reset */
  int n = -1;
  char err[ERRLEN] = "";
  int rc = psr_expand_nodelist(var, list, expect, &hosts, &n, err, sizeof err);
  ck_assert_msg(rc == -1, "'%s' expanded", list ? list : "(null)");
  ck_assert_ptr_null(hosts);
  ck_assert_int_eq(n, 0);
  ASSERT_HAS(err, needle1);
  if (needle2) ASSERT_HAS(err, needle2);
}

START_TEST(nodelist_good) {
  expand_ok("n[1-4]", (const char *const[]){"n1", "n2", "n3", "n4", NULL});
  expand_ok("node[01-03,7],gpu-a[1-2]",
            (const char *const[]){"node01", "node02", "node03", "node7", "gpu-a1",
                                  "gpu-a2", NULL});
  expand_ok("linux[1,2]", (const char *const[]){"linux1", "linux2", NULL});
  expand_ok("a,b,c", (const char *const[]){"a", "b", "c", NULL});
  expand_ok("single", (const char *const[]){"single", NULL});
  expand_ok("n[09-11]", (const char *const[]){"n09", "n10", "n11", NULL});
  expand_ok("c1.example.org", (const char *const[]){"c1.example.org", NULL});
}
END_TEST

START_TEST(nodelist_bad) {
  char err[ERRLEN] = "";
  char **hosts = NULL;
  int n = 0;
  /* libslurm reads "bad[1-" as one host "bad]": the count catches it... */
  ck_assert_int_eq(psr_expand_nodelist("SLURM_STEP_NODELIST", "bad[1-", 2, &hosts, &n,
                                       err, sizeof err),
                   -1);
  ck_assert_str_eq(err,
                   "SLURM_STEP_NODELIST='bad[1-' expands to 1 host(s) but "
                   "SLURM_STEP_NUM_NODES says 2");
  /* ...and so does the bracket in the host when the count happens to fit. */
  expand_fails("SLURM_STEP_NODELIST", "bad[1-", 1, "SLURM_STEP_NODELIST='bad[1-'",
               "bad]");
  expand_fails("SLURM_STEP_NODELIST", "n[1-2", 1, "SLURM_STEP_NODELIST", "n[1-2");
  expand_fails("SLURM_STEP_NODELIST", "n1-2]", 1, "SLURM_STEP_NODELIST", "n1-2]");
  /* Rejected by libslurm itself. */
  expand_fails("SLURM_STEP_NODELIST", "n[3-1]", 3, "SLURM_STEP_NODELIST", "n[3-1]");
  expand_fails("SLURM_STEP_NODELIST", "n[a-b]", 2, "SLURM_STEP_NODELIST", "n[a-b]");
  expand_fails("SLURM_STEP_NODELIST", "x[]", 1, "SLURM_STEP_NODELIST", "x[]");
  /* Empty or missing. */
  expand_fails("SLURM_STEP_NODELIST", "", 1, "SLURM_STEP_NODELIST", "empty");
  expand_fails("SLURM_STEP_NODELIST", NULL, 1, "SLURM_STEP_NODELIST", "not set");
  expand_fails("SLURM_STEP_NODELIST", ",", 1, "SLURM_STEP_NODELIST", "0 host(s)");
  /* Count mismatch names the count variable that goes with the list. */
  expand_fails("SLURM_STEP_NODELIST", "n[1-4]", 3, "SLURM_STEP_NODELIST='n[1-4]'",
               "4 host(s) but SLURM_STEP_NUM_NODES says 3");
  expand_fails("SLURM_JOB_NODELIST", "n[1-4]", 5, "SLURM_JOB_NODELIST='n[1-4]'",
               "SLURM_JOB_NUM_NODES says 5");
  /* The same host twice. */
  expand_fails("SLURM_STEP_NODELIST", "n[1-2],n1", 3, "SLURM_STEP_NODELIST", "'n1'");
  /* A count we cannot check against. */
  expand_fails("SLURM_STEP_NODELIST", "n1", 0, "SLURM_STEP_NODELIST", "n1");
}
END_TEST

/* ---- tasks per node ------------------------------------------------------- */

static void tpn_ok(const char *s, const int *want, int nwant) {
  int *counts = NULL, n = -1;
  char err[ERRLEN] = "";
  int rc = psr_parse_tasks_per_node("SLURM_STEP_TASKS_PER_NODE", s, &counts, &n, err,
                                    sizeof err);
  ck_assert_msg(rc == 0, "'%s': %s", s, err);
  ck_assert_int_eq(n, nwant);
  for (int i = 0; i < n; i++)
    ck_assert_msg(counts[i] == want[i], "'%s'[%d] = %d, want %d", s, i, counts[i],
                  want[i]);
  free(counts);
}

static void tpn_fails(const char *s, const char *needle) {
  int *counts = (int *)&counts, n = -1;
  char err[ERRLEN] = "";
  int rc = psr_parse_tasks_per_node("SLURM_STEP_TASKS_PER_NODE", s, &counts, &n, err,
                                    sizeof err);
  ck_assert_msg(rc == -1, "'%s' parsed", s ? s : "(null)");
  ck_assert_ptr_null(counts);
  ck_assert_int_eq(n, 0);
  ASSERT_HAS(err, "SLURM_STEP_TASKS_PER_NODE");
  if (s && *s && strlen(s) < 60) {
    char quoted[128];
    snprintf(quoted, sizeof quoted, "'%s'", s);
    ASSERT_HAS(err, quoted);
  }
  if (needle) ASSERT_HAS(err, needle);
}

START_TEST(tpn_good) {
  tpn_ok("4,2,1(x2)", (const int[]){4, 2, 1, 1}, 4);
  tpn_ok("2(x3)", (const int[]){2, 2, 2}, 3);
  tpn_ok("8", (const int[]){8}, 1);
  tpn_ok("1(x1)", (const int[]){1}, 1);
  tpn_ok("3(x2),1,2(x2)", (const int[]){3, 3, 1, 2, 2}, 5);
  tpn_ok("1000000", (const int[]){1000000}, 1);
  /* A million nodes is the limit, not beyond. */
  int *counts = NULL, n = 0;
  char err[ERRLEN];
  ck_assert_int_eq(psr_parse_tasks_per_node("V", "1(x999999),2", &counts, &n, err,
                                            sizeof err),
                   0);
  ck_assert_int_eq(n, 1000000);
  ck_assert_int_eq(counts[999998], 1);
  ck_assert_int_eq(counts[999999], 2);
  free(counts);
}
END_TEST

START_TEST(tpn_bad) {
  tpn_fails("2(x", "'2(x'");
  tpn_fails("x", "'x'");
  tpn_fails("0", "'0'");
  tpn_fails("2(x0)", "'2(x0)'");
  tpn_fails("1,,2", "empty item");
  tpn_fails("-1", "'-1'");
  tpn_fails("3(x2)junk", "item '3(x2)junk'");
  tpn_fails("1,2x,3", "item '2x'");
  tpn_fails("4,2(x", "item '2(x'");
  tpn_fails("4,x,2", "item 'x'");
  tpn_fails("1,", "empty item");
  tpn_fails(",1", NULL);
  tpn_fails("", "empty");
  tpn_fails(NULL, "not set");
  tpn_fails("2(3)", "'2(3)'");
  tpn_fails("2(x3", "'2(x3'");
  tpn_fails("2(X3)", "'2(X3)'");
  tpn_fails(" 2", NULL);
  tpn_fails("2 ", NULL);
  tpn_fails("+2", NULL);
  tpn_fails("1000001", "'1000001'");
  tpn_fails("1(x1000001)", "'1(x1000001)'");
  tpn_fails("99999999999999999999999", NULL);
  tpn_fails("1(x99999999999999999999)", NULL);
  tpn_fails("1(x600000),1(x500000)", "more than 1000000 nodes");
}
END_TEST

/* ---- layouts -------------------------------------------------------------- */

static void layout_ok(psr_dist dist, int plane, const int *counts, int nnodes,
                      int ntasks, const int *want) {
  int *node_of = malloc((size_t)ntasks * sizeof *node_of);
  ck_assert_ptr_nonnull(node_of);
  char err[ERRLEN] = "";
  int rc = psr_layout(dist, plane, counts, nnodes, ntasks, node_of, err, sizeof err);
  ck_assert_msg(rc == 0, "layout failed: %s", err);
  for (int r = 0; r < ntasks; r++)
    ck_assert_msg(node_of[r] == want[r], "dist %d plane %d: rank %d on node %d, want %d",
                  (int)dist, plane, r, node_of[r], want[r]);
  free(node_of);
}

START_TEST(layout_block) {
  layout_ok(PSR_DIST_BLOCK, 0, (const int[]){2, 2}, 2, 4, (const int[]){0, 0, 1, 1});
  layout_ok(PSR_DIST_BLOCK, 0, (const int[]){4, 2, 1, 1}, 4, 8,
            (const int[]){0, 0, 0, 0, 1, 1, 2, 3});
  layout_ok(PSR_DIST_BLOCK, 0, (const int[]){1, 3}, 2, 4, (const int[]){0, 1, 1, 1});
  layout_ok(PSR_DIST_BLOCK, 0, (const int[]){5}, 1, 5, (const int[]){0, 0, 0, 0, 0});
}
END_TEST

START_TEST(layout_cyclic) {
  layout_ok(PSR_DIST_CYCLIC, 0, (const int[]){2, 2}, 2, 4, (const int[]){0, 1, 0, 1});
  layout_ok(PSR_DIST_CYCLIC, 0, (const int[]){3, 3, 3}, 3, 9,
            (const int[]){0, 1, 2, 0, 1, 2, 0, 1, 2});
  layout_ok(PSR_DIST_CYCLIC, 0, (const int[]){2, 1, 1}, 3, 4, (const int[]){0, 1, 2, 0});
  layout_ok(PSR_DIST_CYCLIC, 0, (const int[]){4, 2, 1, 1}, 4, 8,
            (const int[]){0, 1, 2, 3, 0, 1, 0, 0});
  layout_ok(PSR_DIST_CYCLIC, 0, (const int[]){1, 3, 2}, 3, 6,
            (const int[]){0, 1, 2, 1, 2, 1});
  /* plane size is ignored for cyclic */
  layout_ok(PSR_DIST_CYCLIC, 7, (const int[]){2, 2}, 2, 4, (const int[]){0, 1, 0, 1});
}
END_TEST

START_TEST(layout_plane) {
  layout_ok(PSR_DIST_PLANE, 2, (const int[]){4, 4}, 2, 8,
            (const int[]){0, 0, 1, 1, 0, 0, 1, 1});
  /* uneven: a node takes min(P, room) per round */
  layout_ok(PSR_DIST_PLANE, 2, (const int[]){3, 4, 1}, 3, 8,
            (const int[]){0, 0, 1, 1, 2, 0, 1, 1});
  layout_ok(PSR_DIST_PLANE, 3, (const int[]){4, 2, 5}, 3, 11,
            (const int[]){0, 0, 0, 1, 1, 2, 2, 2, 0, 2, 2});
  /* P >= every count is block; P = 1 is cyclic */
  layout_ok(PSR_DIST_PLANE, 4, (const int[]){2, 3}, 2, 5, (const int[]){0, 0, 1, 1, 1});
  layout_ok(PSR_DIST_PLANE, 1, (const int[]){4, 2, 1, 1}, 4, 8,
            (const int[]){0, 1, 2, 3, 0, 1, 0, 0});
}
END_TEST

/* Many nodes, skewed counts: every node gets exactly its count, ranks are
 * dealt in rounds, and it stays fast (linear, not rounds x nodes). */
START_TEST(layout_large) {
  enum { NN = 100001 };
  int *counts = malloc(NN * sizeof *counts);
  ck_assert_ptr_nonnull(counts);
  counts[0] = 200000;
  for (int i = 1; i < NN; i++) counts[i] = 1 + (i % 3 == 0);
  long long total = 0;
  for (int i = 0; i < NN; i++) total += counts[i];
  int ntasks = (int)total;
  int *node_of = malloc((size_t)ntasks * sizeof *node_of);
  int *got = calloc(NN, sizeof *got);
  ck_assert_ptr_nonnull(node_of);
  ck_assert_ptr_nonnull(got);
  psr_dist dists[] = {PSR_DIST_BLOCK, PSR_DIST_CYCLIC, PSR_DIST_PLANE};
  for (int d = 0; d < 3; d++) {
    char err[ERRLEN] = "";
    ck_assert_msg(psr_layout(dists[d], 5, counts, NN, ntasks, node_of, err, sizeof err) ==
                      0,
                  "%s", err);
    memset(got, 0, NN * sizeof *got);
    for (int r = 0; r < ntasks; r++) {
      ck_assert(node_of[r] >= 0 && node_of[r] < NN);
      got[node_of[r]]++;
    }
    for (int i = 0; i < NN; i++) ck_assert_int_eq(got[i], counts[i]);
  }
  /* cyclic: the first NN ranks go one to each node in order */
  ck_assert_int_eq(psr_layout(PSR_DIST_CYCLIC, 0, counts, NN, ntasks, node_of, NULL, 0),
                   0);
  for (int r = 0; r < NN; r++) ck_assert_int_eq(node_of[r], r);
  ck_assert_int_eq(node_of[ntasks - 1], 0);
  free(counts);
  free(node_of);
  free(got);
}
END_TEST

START_TEST(layout_errors) {
  int node_of[8];
  char err[ERRLEN] = "";
  const int counts[] = {2, 2};
  ck_assert_int_eq(
      psr_layout(PSR_DIST_ARBITRARY, 0, counts, 2, 4, node_of, err, sizeof err), -1);
  ck_assert_str_eq(err,
                   "SLURM_DISTRIBUTION=arbitrary: the task layout cannot be derived "
                   "from the environment");
  err[0] = '\0';
  ck_assert_int_eq(psr_layout(PSR_DIST_UNKNOWN, 0, counts, 2, 4, node_of, err, sizeof err),
                   -1);
  ASSERT_HAS(err, "cannot be derived");
  /* counts that do not add up */
  ck_assert_int_eq(psr_layout(PSR_DIST_BLOCK, 0, counts, 2, 5, node_of, err, sizeof err),
                   -1);
  ASSERT_HAS(err, "4");
  ASSERT_HAS(err, "5");
  ck_assert_int_eq(psr_layout(PSR_DIST_CYCLIC, 0, counts, 2, 3, node_of, err, sizeof err),
                   -1);
  /* a node without tasks, a bad plane size, nothing to lay out */
  ck_assert_int_eq(psr_layout(PSR_DIST_BLOCK, 0, (const int[]){2, 0}, 2, 2, node_of, err,
                              sizeof err),
                   -1);
  ck_assert_int_eq(psr_layout(PSR_DIST_PLANE, 0, counts, 2, 4, node_of, err, sizeof err),
                   -1);
  ck_assert_int_eq(psr_layout(PSR_DIST_BLOCK, 0, counts, 0, 4, node_of, err, sizeof err),
                   -1);
  ck_assert_int_eq(psr_layout(PSR_DIST_BLOCK, 0, counts, 2, 0, node_of, err, sizeof err),
                   -1);
}
END_TEST

/* ---- plans ---------------------------------------------------------------- */

/* Expected role of one rank: is_ps, index, node, local_rank. */
typedef struct {
  int is_ps, index, node, local_rank;
} want_role;

static void plan_ok(int ntasks, int num_ps, psr_placement place, const int *node_of,
                    const want_role *want) {
  psr_role *roles = calloc((size_t)ntasks, sizeof *roles);
  ck_assert_ptr_nonnull(roles);
  char err[ERRLEN] = "";
  int rc = psr_plan(ntasks, num_ps, place, node_of, roles, err, sizeof err);
  ck_assert_msg(rc == 0, "plan failed: %s", err);
  for (int r = 0; r < ntasks; r++) {
    ck_assert_int_eq(roles[r].rank, r);
    ck_assert_msg(roles[r].is_ps == want[r].is_ps && roles[r].index == want[r].index &&
                      roles[r].node == want[r].node &&
                      roles[r].local_rank == want[r].local_rank,
                  "rank %d: ps %d index %d node %d local %d, want %d %d %d %d", r,
                  roles[r].is_ps, roles[r].index, roles[r].node, roles[r].local_rank,
                  want[r].is_ps, want[r].index, want[r].node, want[r].local_rank);
  }
  free(roles);
}

static void plan_fails(int ntasks, int num_ps, psr_placement place, const int *node_of,
                       const char *want) {
  psr_role roles[16];
  char err[ERRLEN] = "";
  ck_assert_int_eq(psr_plan(ntasks, num_ps, place, node_of, roles, err, sizeof err), -1);
  ck_assert_str_eq(err, want);
}

START_TEST(plan_pack) {
  /* 2 nodes x 4 tasks, block */
  plan_ok(8, 2, PSR_PLACE_PACK, (const int[]){0, 0, 0, 0, 1, 1, 1, 1},
          (const want_role[]){{1, 0, 0, 0},
                              {1, 1, 0, 1},
                              {0, 0, 0, 2},
                              {0, 1, 0, 3},
                              {0, 2, 1, 0},
                              {0, 3, 1, 1},
                              {0, 4, 1, 2},
                              {0, 5, 1, 3}});
  /* uneven cyclic 2,1,1 */
  plan_ok(4, 2, PSR_PLACE_PACK, (const int[]){0, 1, 2, 0},
          (const want_role[]){{1, 0, 0, 0}, {1, 1, 1, 0}, {0, 0, 2, 0}, {0, 1, 0, 1}});
  /* one task per node */
  plan_ok(3, 1, PSR_PLACE_PACK, (const int[]){0, 1, 2},
          (const want_role[]){{1, 0, 0, 0}, {0, 0, 1, 0}, {0, 1, 2, 0}});
}
END_TEST

START_TEST(plan_spread) {
  /* 2 nodes x 4 tasks, block: ranks 0 and 4 */
  plan_ok(8, 2, PSR_PLACE_SPREAD, (const int[]){0, 0, 0, 0, 1, 1, 1, 1},
          (const want_role[]){{1, 0, 0, 0},
                              {0, 0, 0, 1},
                              {0, 1, 0, 2},
                              {0, 2, 0, 3},
                              {1, 1, 1, 0},
                              {0, 3, 1, 1},
                              {0, 4, 1, 2},
                              {0, 5, 1, 3}});
  /* 3 nodes x 2 tasks, block, one ps: only rank 0 */
  plan_ok(6, 1, PSR_PLACE_SPREAD, (const int[]){0, 0, 1, 1, 2, 2},
          (const want_role[]){{1, 0, 0, 0},
                              {0, 0, 0, 1},
                              {0, 1, 1, 0},
                              {0, 2, 1, 1},
                              {0, 3, 2, 0},
                              {0, 4, 2, 1}});
  /* uneven cyclic 4,2,1,1: ranks 0,1,2 */
  plan_ok(8, 3, PSR_PLACE_SPREAD, (const int[]){0, 1, 2, 3, 0, 1, 0, 0},
          (const want_role[]){{1, 0, 0, 0},
                              {1, 1, 1, 0},
                              {1, 2, 2, 0},
                              {0, 0, 3, 0},
                              {0, 1, 0, 1},
                              {0, 2, 1, 1},
                              {0, 3, 0, 2},
                              {0, 4, 0, 3}});
  /* uneven block 3,1,2: the first rank of each node, in order of first rank */
  plan_ok(6, 3, PSR_PLACE_SPREAD, (const int[]){0, 0, 0, 1, 2, 2},
          (const want_role[]){{1, 0, 0, 0},
                              {0, 0, 0, 1},
                              {0, 1, 0, 2},
                              {1, 1, 1, 0},
                              {1, 2, 2, 0},
                              {0, 2, 2, 1}});
  /* nodes ordered by first rank, not by node index */
  plan_ok(4, 2, PSR_PLACE_SPREAD, (const int[]){1, 1, 0, 0},
          (const want_role[]){{1, 0, 1, 0}, {0, 0, 1, 1}, {1, 1, 0, 0}, {0, 1, 0, 1}});
}
END_TEST

START_TEST(plan_errors) {
  const int two_nodes[] = {0, 0, 1, 1};
  plan_fails(4, 3, PSR_PLACE_SPREAD, two_nodes,
             "--ps-placement=spread needs 3 nodes but the step has 2");
  plan_fails(4, 4, PSR_PLACE_PACK, two_nodes,
             "--ps=4 must be at least 1 and less than the number of tasks (4)");
  plan_fails(4, 5, PSR_PLACE_SPREAD, two_nodes,
             "--ps=5 must be at least 1 and less than the number of tasks (4)");
  plan_fails(4, 0, PSR_PLACE_PACK, two_nodes,
             "--ps=0 must be at least 1 and less than the number of tasks (4)");
  plan_fails(1, 1, PSR_PLACE_PACK, (const int[]){0},
             "--ps=1 must be at least 1 and less than the number of tasks (1)");
  psr_role roles[4];
  char err[ERRLEN] = "";
  ck_assert_int_eq(psr_plan(4, 1, PSR_PLACE_PACK, (const int[]){0, -1, 0, 0}, roles, err,
                            sizeof err),
                   -1);
  ASSERT_HAS(err, "rank 1");
}
END_TEST

/* The whole path from the environment to the roles. */
START_TEST(env_to_plan) {
  env_minimal();
  env_set("SLURM_NTASKS", "8");
  env_set("SLURM_STEP_NODELIST", "gpu[01-04]");
  env_set("SLURM_STEP_NUM_NODES", "4");
  env_set("SLURM_STEP_TASKS_PER_NODE", "4,2,1(x2)");
  env_set("SLURM_DISTRIBUTION", "cyclic:block");
  psr_env e;
  read_ok(&e);
  char err[ERRLEN] = "";
  char **hosts = NULL;
  int nhosts = 0, *counts = NULL, ncounts = 0;
  ck_assert_msg(psr_expand_nodelist(e.nodelist_var, e.nodelist, e.num_nodes, &hosts,
                                    &nhosts, err, sizeof err) == 0,
                "%s", err);
  ck_assert_msg(psr_parse_tasks_per_node("SLURM_STEP_TASKS_PER_NODE", e.tasks_per_node,
                                         &counts, &ncounts, err, sizeof err) == 0,
                "%s", err);
  ck_assert_int_eq(ncounts, nhosts);
  int node_of[8];
  ck_assert_msg(psr_layout(e.dist, e.plane_size, counts, ncounts, e.ntasks, node_of, err,
                           sizeof err) == 0,
                "%s", err);
  psr_role roles[8];
  ck_assert_msg(
      psr_plan(e.ntasks, 2, PSR_PLACE_SPREAD, node_of, roles, err, sizeof err) == 0,
      "%s", err);
  ck_assert(roles[0].is_ps && roles[1].is_ps);
  ck_assert_str_eq(hosts[roles[1].node], "gpu02");
  ck_assert(!roles[4].is_ps);
  ck_assert_str_eq(hosts[roles[4].node], "gpu01");
  ck_assert_int_eq(roles[7].local_rank, 3);
  ck_assert_int_eq(roles[7].index, 5);
  psr_hosts_free(hosts, nhosts);
  free(counts);
  psr_env_free(&e);
}
END_TEST

Suite *suite_layout(void) {
  Suite *s = suite_create("layout");
  TCase *env = tcase_create("env");
  tcase_add_test(env, env_good_fields);
  tcase_add_test(env, env_minimal_defaults);
  tcase_add_test(env, env_missing_required);
  tcase_add_test(env, env_fallbacks);
  tcase_add_test(env, env_bad_procid);
  tcase_add_test(env, env_bad_values);
  tcase_add_test(env, env_distribution);
  tcase_add_test(env, env_ports);
  tcase_add_test(env, env_gpus_het_pmi);
  tcase_add_test(env, env_long_nodename);
  suite_add_tcase(s, env);

  TCase *nl = tcase_create("nodelist");
  tcase_add_test(nl, nodelist_good);
  tcase_add_test(nl, nodelist_bad);
  tcase_add_test(nl, tpn_good);
  tcase_add_test(nl, tpn_bad);
  suite_add_tcase(s, nl);

  TCase *lay = tcase_create("layout");
  tcase_add_test(lay, layout_block);
  tcase_add_test(lay, layout_cyclic);
  tcase_add_test(lay, layout_plane);
  tcase_add_test(lay, layout_large);
  tcase_add_test(lay, layout_errors);
  suite_add_tcase(s, lay);

  TCase *plan = tcase_create("plan");
  tcase_add_test(plan, plan_pack);
  tcase_add_test(plan, plan_spread);
  tcase_add_test(plan, plan_errors);
  tcase_add_test(plan, env_to_plan);
  suite_add_tcase(s, plan);
  return s;
}
