/* opt.c - the option-table parser (see opt.h). */
#include "opt.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Index of v among the "a|b|c" choices, or -1. */
static int choice_index(const char *choices, const char *v) {
  size_t len = strlen(v);
  int i = 0;
  for (const char *c = choices; *c; i++) {
    size_t cl = strcspn(c, "|");
    if (cl == len && strncmp(c, v, len) == 0) return i;
    c += cl + (c[cl] == '|');
  }
  return -1;
}

static int set_number(const ps__opt *o, char *field, const char *v, char *err, size_t errlen) {
  char *end;
  errno = 0;
  if (o->type == PS_OPT_DOUBLE) {
    double x = strtod(v, &end);
    if (errno || end == v || *end || !isfinite(x) || x < o->min || x > o->max) {
      snprintf(err, errlen, "--%s must be a number from %g to %g, got '%s'", o->name, o->min,
               o->max, v);
      return -1;
    }
    *(double *)field = x;
    return 0;
  }
  long long x = strtoll(v, &end, 10);
  if (errno || end == v || *end || (double)x < o->min || (double)x > o->max) {
    snprintf(err, errlen, "--%s must be an integer from %.0f to %.0f, got '%s'", o->name,
             o->min, o->max, v);
    return -1;
  }
  if (o->type == PS_OPT_INT) *(int *)field = (int)x;
  else *(int64_t *)field = (int64_t)x;
  return 0;
}

int ps__opt_set(const ps__opt *o, void *dst, const char *v, char *err, size_t errlen) {
  char *field = (char *)dst + o->off;
  switch (o->type) {
  case PS_OPT_INT:
  case PS_OPT_INT64:
  case PS_OPT_DOUBLE:
    return set_number(o, field, v, err, errlen);
  case PS_OPT_FLAG:
    *(int *)field = strcmp(v, "0") != 0;
    return 0;
  case PS_OPT_CHOICE:
  case PS_OPT_CHOICE_STR: {
    int i = choice_index(o->choices, v);
    if (i < 0) {
      snprintf(err, errlen, "--%s must be one of %s, got '%s'", o->name, o->choices, v);
      return -1;
    }
    if (o->type == PS_OPT_CHOICE) *(int *)field = i;
    else snprintf(field, o->size, "%s", v); /* a choice is shorter than its field */
    return 0;
  }
  case PS_OPT_STR:
    if (strlen(v) >= o->size) {
      snprintf(err, errlen, "--%s is too long (%zu bytes; at most %zu)", o->name, strlen(v),
               o->size - 1);
      return -1;
    }
    memcpy(field, v, strlen(v) + 1);
    return 0;
  case PS_OPT_LIST: {
    ps__opt_list *l = (ps__opt_list *)field;
    if (l->n >= PS_OPT_LIST_MAX - 1) {
      snprintf(err, errlen, "too many --%s options (at most %d)", o->name, PS_OPT_LIST_MAX - 1);
      return -1;
    }
    l->v[l->n++] = (char *)v;
    l->v[l->n] = NULL;
    return 0;
  }
  }
  snprintf(err, errlen, "--%s has an unknown type", o->name);
  return -1;
}

int ps__opt_defaults(const ps__opt_parser *p, void *dst, char *err, size_t errlen) {
  for (size_t i = 0; i < p->nopts; i++) {
    const ps__opt *o = &p->opts[i];
    if (o->type == PS_OPT_LIST || !o->def) continue;
    if (ps__opt_set(o, dst, o->def, err, errlen) != 0) return -1;
  }
  return 0;
}

void ps__opt_usage(const ps__opt_parser *p, FILE *f) {
  int w = p->help_width > 0 ? p->help_width : 30;
  if (p->usage) fputs(p->usage, f);
  for (size_t i = 0; i < p->nopts; i++) {
    const ps__opt *o = &p->opts[i];
    char alias[8] = "", left[128];
    if (o->shortc) snprintf(alias, sizeof alias, "-%c, ", o->shortc);
    const char *val = o->type == PS_OPT_FLAG ? ""
                      : o->type == PS_OPT_CHOICE || o->type == PS_OPT_CHOICE_STR ? o->choices
                                                                                 : "VALUE";
    snprintf(left, sizeof left, "%s--%s%s%s", alias, o->name, *val ? " " : "", val);
    fprintf(f, "  %-*s %s", w, left, o->help);
    if (o->def && o->def[0] && o->type != PS_OPT_FLAG) fprintf(f, " [%s]", o->def);
    fputc('\n', f);
  }
  fprintf(f, "  %-*s %s\n", w, "--help", "print this and exit");
  if (p->version) fprintf(f, "  %-*s %s\n", w, "--version", "print the version and exit");
}

/* The table row arg names (with its inline value in *val), or NULL with err. */
static const ps__opt *find(const ps__opt_parser *p, const char *arg, const char **val,
                           char *err, size_t errlen) {
  *val = NULL;
  if (arg[1] != '-') { /* -n 4, -n4 */
    for (size_t i = 0; i < p->nopts; i++)
      if (p->opts[i].shortc && p->opts[i].shortc == arg[1]) {
        if (arg[2]) *val = arg + 2;
        return &p->opts[i];
      }
    snprintf(err, errlen, "unknown option '%s' (see --help)", arg);
    return NULL;
  }
  const char *name = arg + 2, *eq = strchr(name, '=');
  size_t nl = eq ? (size_t)(eq - name) : strlen(name);
  for (size_t i = 0; i < p->nopts; i++)
    if (strlen(p->opts[i].name) == nl && strncmp(p->opts[i].name, name, nl) == 0) {
      if (eq) *val = eq + 1;
      return &p->opts[i];
    }
  snprintf(err, errlen, "unknown option '--%.*s' (see --help)", (int)nl, name);
  return NULL;
}

static int has_short(const ps__opt_parser *p) {
  for (size_t i = 0; i < p->nopts; i++)
    if (p->opts[i].shortc) return 1;
  return 0;
}

/* A non-option argument a: 1 to stop, 0 to go on, -1 on error. */
static int positional(const ps__opt_parser *p, const char *a, ps__opt_args *rest, char *err,
                      size_t errlen) {
  if (p->positional == PS_OPT_POS_STOP) return 1;
  if (p->positional == PS_OPT_POS_COLLECT && rest->npos < p->max_pos &&
      rest->npos < PS_OPT_MAX_POS) {
    rest->pos[rest->npos++] = a;
    return 0;
  }
  snprintf(err, errlen, "unexpected argument '%s' (%ssee --help)", a,
           p->positional == PS_OPT_POS_ERROR ? "options start with --; " : "");
  return -1;
}

int ps__opt_parse(const ps__opt_parser *p, void *dst, int argc, char **argv,
                  ps__opt_args *rest, char *err, size_t errlen) {
  ps__opt_args dummy;
  if (!rest) rest = &dummy;
  memset(rest, 0, sizeof *rest);
  if (ps__opt_defaults(p, dst, err, errlen) != 0) return -1;
  int shorts = has_short(p), a = 1;
  for (; a < argc; a++) {
    const char *arg = argv[a];
    if (p->positional == PS_OPT_POS_STOP && strcmp(arg, "--") == 0) {
      a++;
      break;
    }
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      ps__opt_usage(p, stdout);
      return 1;
    }
    if (p->version && strcmp(arg, "--version") == 0) {
      printf("%s\n", p->version);
      return 1;
    }
    int is_opt = arg[0] == '-' && arg[1] && (arg[1] == '-' || shorts);
    if (!is_opt) {
      int r = positional(p, arg, rest, err, errlen);
      if (r < 0) return -1;
      if (r > 0) break;
      continue;
    }
    const char *val;
    const ps__opt *o = find(p, arg, &val, err, errlen);
    if (!o) return -1;
    if (o->type == PS_OPT_FLAG) {
      if (val) {
        snprintf(err, errlen, "option --%s takes no value", o->name);
        return -1;
      }
      val = "1";
    } else if (!val) {
      if (a + 1 >= argc) {
        snprintf(err, errlen, "option --%s needs a value", o->name);
        return -1;
      }
      val = argv[++a];
    }
    if (ps__opt_set(o, dst, val, err, errlen) != 0) return -1;
  }
  rest->first = a;
  return 0;
}
