/*
 * opt.h - the one command-line parser of psd, psrun and psctl. A program
 * describes its options in a table (name, alias, type, field, default,
 * range, choices, help); ps__opt_parse applies the defaults, then argv,
 * and prints --help from the same table. Errors are one sentence naming
 * the option and the bad value.
 */
#ifndef PS_COMMON_OPT_H
#define PS_COMMON_OPT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef enum ps__opt_type {
  PS_OPT_INT,        /* int, in [min, max] */
  PS_OPT_INT64,      /* int64_t (long long), in [min, max]: e.g. Slurm job ids */
  PS_OPT_DOUBLE,     /* double, finite, in [min, max] */
  PS_OPT_STR,        /* char[size]: the value must fit with its NUL */
  PS_OPT_FLAG,       /* int 0/1; takes no value on the command line */
  PS_OPT_CHOICE,     /* int: index of the value in choices ("a|b|c") */
  PS_OPT_CHOICE_STR, /* char[size]: the value itself, one of choices */
  PS_OPT_LIST        /* ps__opt_list: every occurrence appended (repeatable) */
} ps__opt_type;

/* Most values one PS_OPT_LIST option holds (one slot stays NULL). */
#define PS_OPT_LIST_MAX 64

/* Field of a PS_OPT_LIST option: v[0..n) point into argv, v[n] is NULL. */
typedef struct ps__opt_list {
  char *v[PS_OPT_LIST_MAX];
  int n;
} ps__opt_list;

/* One option. */
typedef struct ps__opt {
  const char *name;    /* long name without "--" */
  char shortc;         /* one-letter alias ("-n 4", "-n4"), or 0 */
  ps__opt_type type;   /* how the value is parsed and stored */
  size_t off, size;    /* field in the destination struct */
  const char *def;     /* default, parsed like a value (NULL or "" for lists) */
  double min, max;     /* numbers: inclusive range */
  const char *choices; /* PS_OPT_CHOICE*: "a|b|c" */
  const char *help;    /* one line for --help */
} ps__opt;

/* Offset and size of field f of struct type T, for a table row. */
#define PS_OPT_FIELD(T, f) offsetof(T, f), sizeof(((T *)0)->f)

/* What to do with an argument that is not an option. */
typedef enum ps__opt_pos {
  PS_OPT_POS_ERROR = 0, /* an error: "unexpected argument" */
  PS_OPT_POS_STOP,      /* it starts the command: parsing stops (also after "--") */
  PS_OPT_POS_COLLECT    /* kept in ps__opt_args.pos, up to max_pos of them */
} ps__opt_pos;

/* Most positional arguments PS_OPT_POS_COLLECT keeps. */
#define PS_OPT_MAX_POS 8

/* A program's command line. */
typedef struct ps__opt_parser {
  const ps__opt *opts;   /* the table */
  size_t nopts;
  const char *usage;     /* printed by --help before the options */
  const char *version;   /* printed by --version (NULL: no --version) */
  ps__opt_pos positional;
  int max_pos;           /* PS_OPT_POS_COLLECT: how many are allowed */
  int help_width;        /* column of the help text (0: 30) */
} ps__opt_parser;

/* The arguments that were not options. */
typedef struct ps__opt_args {
  int first;                       /* PS_OPT_POS_STOP: argv index of the command */
  int npos;                        /* PS_OPT_POS_COLLECT: how many */
  const char *pos[PS_OPT_MAX_POS];
} ps__opt_args;

/* Applies every default to dst. 0, or -1 with err (a bad table). */
int ps__opt_defaults(const ps__opt_parser *p, void *dst, char *err, size_t errlen);

/* Sets one option from a value string. 0, or -1 with err. */
int ps__opt_set(const ps__opt *o, void *dst, const char *val, char *err, size_t errlen);

/* Applies the defaults, then argv[1..argc) (--name VALUE, --name=VALUE,
 * -x VALUE, -xVALUE, flags without a value; the last of a repeated option
 * wins). Returns 0, 1 when --help/-h or --version was printed to stdout
 * (the caller exits 0), or -1 with err. rest (may be NULL) receives the
 * arguments that were not options. The caller clears dst first. */
int ps__opt_parse(const ps__opt_parser *p, void *dst, int argc, char **argv,
                  ps__opt_args *rest, char *err, size_t errlen);

/* --help: usage text, then one line per option. */
void ps__opt_usage(const ps__opt_parser *p, FILE *f);

#endif
