/* main.c - psrun: options (one table drives parsing, --help and defaults),
 * validation, and the choice between --local and Slurm mode. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "psclient.h"
#include "psrun.h"

char psr_ident[64] = "psrun";

void psr_log(const char *fmt, ...) {
  char line[2048];
  int n = snprintf(line, sizeof line, "%s: ", psr_ident);
  va_list ap;
  va_start(ap, fmt);
  if (n > 0 && (size_t)n < sizeof line) n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof line - 1) n = (int)sizeof line - 2;
  line[n++] = '\n';
  ssize_t w = write(2, line, (size_t)n);
  (void)w;
}

int psr_new_secret(char out[65]) {
  unsigned char b[32];
  if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) return -1;
  for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
  return 0;
}

typedef enum { O_INT, O_DOUBLE, O_STR, O_FLAG, O_CHOICE, O_LIST } otype;

typedef struct psr_option {
  const char *name;     /* long name without "--" */
  char shortc;          /* one-letter alias, or 0 */
  otype type;           /* how the value is parsed */
  size_t off, size;     /* field in psr_opts */
  const char *def;      /* default (parsed like a value) */
  double min, max;      /* numbers: inclusive range */
  const char *choices;  /* O_CHOICE: "a|b|c" */
  const char *help;     /* one line for --help */
} psr_option;

#define F(f) offsetof(psr_opts, f), sizeof(((psr_opts *)0)->f)

static const psr_option OPTS[] = {
    {"ps", 0, O_INT, F(ps), "1", 1, 65536, NULL, "number of parameter-server tasks"},
    {"local", 0, O_FLAG, F(local), "0", 0, 0, NULL,
     "run all tasks on this machine, without Slurm"},
    {"ntasks", 'n', O_INT, F(ntasks), "0", 0, 256, NULL, "--local: tasks in all (ps + workers)"},
    {"role", 0, O_CHOICE, F(role), "auto", 0, 0, "auto|ps|worker",
     "auto: roles from --ps; ps/worker: this step holds only that role"},
    {"ps-placement", 0, O_CHOICE, F(placement), "pack", 0, 0, "pack|spread",
     "pack: the first tasks are ps; spread: ps tasks on different nodes"},
    {"psd", 0, O_STR, F(psd), "", 0, 0, NULL, "psd binary (default: next to psrun)"},
    {"psd-arg", 0, O_LIST, 0, 0, "", 0, 0, NULL, "extra option for psd (repeatable)"},
    {"iface", 0, O_STR, F(iface), "", 0, 0, NULL, "network interface whose address to use"},
    {"addr", 0, O_STR, F(addr), "", 0, 0, NULL, "use the address inside this CIDR"},
    {"rendezvous", 0, O_STR, F(rendezvous), "", 0, 0, NULL,
     "directory shared by a ps step and its worker steps"},
    {"rendezvous-port", 0, O_INT, F(rdv_port), "0", 0, 65535, NULL,
     "task 0's port (default: reserved ports, PMI-2, or derived from the job)"},
    {"print-plan", 0, O_FLAG, F(print_plan), "0", 0, 0, NULL,
     "print each task's role as JSON and start nothing"},
    {"connect-timeout", 0, O_DOUBLE, F(timeout_s), "120", 1, 1e6, NULL,
     "seconds for every task to check in"},
    {"grace", 0, O_DOUBLE, F(grace_s), "5", 0, 3600, NULL,
     "seconds between SIGTERM and SIGKILL when stopping tasks"},
    {"checkpoint-dir", 0, O_STR, F(ckpt_dir), "", 0, 0, NULL,
     "psd checkpoints here and resumes from it; SIGTERM/SIGUSR1 then stop after a checkpoint "
     "(exit 75)"},
    {"checkpoint-every", 0, O_INT, F(ckpt_every), "0", 0, 2147483647, NULL,
     "checkpoint every N steps"},
    {"checkpoint-secs", 0, O_DOUBLE, F(ckpt_secs), "0", 0, 1e9, NULL,
     "checkpoint every S seconds"},
    {"telemetry", 0, O_STR, F(telemetry), "", 0, 0, NULL,
     "per-step telemetry as JSON lines: worker i to FILE.w<i>, ps i to FILE.ps<i>"},
};
#define NOPTS (sizeof OPTS / sizeof OPTS[0])

static char *g_psd_args[64];

static void usage(FILE *f) {
  fprintf(f,
          "usage: psrun [OPTIONS] [--] COMMAND [ARGS...]\n"
          "  srun --ntasks=N psrun --ps=P ./worker ...   # under Slurm\n"
          "  psrun --local -n N --ps P -- ./worker ...   # on this machine\n\n"
          "The first P tasks (or, with --ps-placement=spread, one per node) run psd;\n"
          "the others run COMMAND with PS_HOSTS, PS_WORKER_INDEX, PS_NUM_WORKERS,\n"
          "PS_ROLE and PS_NUM_PS set for libpsclient.\n\n");
  for (size_t i = 0; i < NOPTS; i++) {
    const psr_option *o = &OPTS[i];
    char left[64];
    if (o->type == O_FLAG)
      snprintf(left, sizeof left, "%s%c%s--%s", o->shortc ? "-" : "", o->shortc ? o->shortc : ' ',
               o->shortc ? ", " : "", o->name);
    else
      snprintf(left, sizeof left, "%s%c%s--%s %s", o->shortc ? "-" : "",
               o->shortc ? o->shortc : ' ', o->shortc ? ", " : "", o->name,
               o->type == O_CHOICE ? o->choices : "VALUE");
    fprintf(f, "  %-34s %s", left + (o->shortc ? 0 : 1), o->help);
    if (o->def && o->def[0] && o->type != O_FLAG) fprintf(f, " [%s]", o->def);
    fputc('\n', f);
  }
  fprintf(f, "  %-34s %s\n", "--help", "print this and exit");
}

static int set_opt(psr_opts *op, const psr_option *o, const char *v, char *err, size_t errlen) {
  char *field = (char *)op + o->off;
  char *end;
  switch (o->type) {
  case O_INT: {
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < o->min || x > o->max) {
      snprintf(err, errlen, "--%s must be an integer from %.0f to %.0f, got '%s'", o->name,
               o->min, o->max, v);
      return -1;
    }
    *(int *)field = (int)x;
    return 0;
  }
  case O_DOUBLE: {
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !isfinite(x) || x < o->min || x > o->max) {
      snprintf(err, errlen, "--%s must be a number from %g to %g, got '%s'", o->name, o->min,
               o->max, v);
      return -1;
    }
    *(double *)field = x;
    return 0;
  }
  case O_FLAG:
    *(int *)field = strcmp(v, "0") != 0;
    return 0;
  case O_CHOICE: {
    size_t len = strlen(v);
    const char *c = o->choices;
    while (*c) {
      size_t cl = strcspn(c, "|");
      if (cl == len && strncmp(c, v, len) == 0) {
        memcpy(field, v, len + 1);
        return 0;
      }
      c += cl + (c[cl] == '|');
    }
    snprintf(err, errlen, "--%s must be one of %s, got '%s'", o->name, o->choices, v);
    return -1;
  }
  case O_STR:
    if (strlen(v) >= o->size) {
      snprintf(err, errlen, "--%s is too long", o->name);
      return -1;
    }
    memcpy(field, v, strlen(v) + 1);
    return 0;
  case O_LIST:
    if (op->npsd_args >= 63) {
      snprintf(err, errlen, "too many --%s options", o->name);
      return -1;
    }
    g_psd_args[op->npsd_args++] = (char *)v;
    op->psd_args = g_psd_args;
    return 0;
  }
  return -1;
}

/* Parses argv into o. Returns 0, 1 (--help printed) or -1 with err. */
static int parse(psr_opts *o, int argc, char **argv, char *err, size_t errlen) {
  memset(o, 0, sizeof *o);
  for (size_t i = 0; i < NOPTS; i++)
    if (OPTS[i].type != O_LIST && set_opt(o, &OPTS[i], OPTS[i].def, err, errlen)) return -1;
  int a = 1;
  for (; a < argc; a++) {
    const char *arg = argv[a];
    if (strcmp(arg, "--") == 0) {
      a++;
      break;
    }
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      usage(stdout);
      return 1;
    }
    if (arg[0] != '-' || arg[1] == '\0') break; /* the command starts here */
    const psr_option *opt = NULL;
    const char *val = NULL;
    if (arg[1] != '-') { /* -n 4, -n4 */
      for (size_t i = 0; i < NOPTS; i++)
        if (OPTS[i].shortc && OPTS[i].shortc == arg[1]) opt = &OPTS[i];
      if (!opt) {
        snprintf(err, errlen, "unknown option '%s' (see --help)", arg);
        return -1;
      }
      if (arg[2]) val = arg + 2;
    } else {
      const char *name = arg + 2;
      const char *eq = strchr(name, '=');
      size_t nl = eq ? (size_t)(eq - name) : strlen(name);
      for (size_t i = 0; i < NOPTS; i++)
        if (strlen(OPTS[i].name) == nl && strncmp(OPTS[i].name, name, nl) == 0) opt = &OPTS[i];
      if (!opt) {
        snprintf(err, errlen, "unknown option '--%.*s' (see --help)", (int)nl, name);
        return -1;
      }
      if (eq) val = eq + 1;
    }
    if (opt->type == O_FLAG) {
      if (val) {
        snprintf(err, errlen, "option --%s takes no value", opt->name);
        return -1;
      }
      val = "1";
    } else if (!val) {
      if (a + 1 >= argc) {
        snprintf(err, errlen, "option --%s needs a value", opt->name);
        return -1;
      }
      val = argv[++a];
    }
    if (set_opt(o, opt, val, err, errlen)) return -1;
  }
  o->cmd = argv + a;
  o->ncmd = argc - a;
  return 0;
}

/* psd next to psrun unless --psd says otherwise; must be executable. */
static int find_psd(psr_opts *o, char *err, size_t errlen) {
  if (!o->psd[0]) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 8);
    if (n <= 0) {
      snprintf(err, errlen, "cannot find psrun's own path; give --psd PATH");
      return -1;
    }
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash) strcpy(slash + 1, "psd");
    snprintf(o->psd, sizeof o->psd, "%s", self);
  }
  if (access(o->psd, X_OK) != 0) {
    snprintf(err, errlen, "psd not found or not executable at %s (give --psd PATH): %s",
             o->psd, strerror(errno));
    return -1;
  }
  return 0;
}

int main(int argc, char **argv) {
  psr_opts o;
  char err[5000];
  int rc = parse(&o, argc, argv, err, sizeof err);
  if (rc == 1) return 0;
  if (rc < 0) {
    fprintf(stderr, "psrun: %s\n", err);
    return 2;
  }
  int needs_cmd = strcmp(o.role, "ps") != 0 && !o.print_plan;
  if (needs_cmd && o.ncmd == 0) {
    fprintf(stderr, "psrun: no worker command given (psrun [OPTIONS] [--] COMMAND ...)\n");
    return 2;
  }
  int needs_psd = strcmp(o.role, "worker") != 0 && !o.print_plan;
  if (needs_psd && find_psd(&o, err, sizeof err) != 0) {
    fprintf(stderr, "psrun: %s\n", err);
    return 2;
  }
  if (o.local) {
    if (o.ntasks < 2) {
      fprintf(stderr, "psrun: --local needs -n N with N >= 2 (ps tasks + workers)\n");
      return 2;
    }
    if (o.ps >= o.ntasks) {
      fprintf(stderr, "psrun: --ps=%d must be less than the number of tasks (%d)\n", o.ps,
              o.ntasks);
      return 2;
    }
    snprintf(psr_ident, sizeof psr_ident, "psrun");
    return psr_run_local(&o);
  }
  return psr_run_slurm(&o);
}
