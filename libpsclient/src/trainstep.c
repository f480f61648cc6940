/* trainstep.c - the training step (pull and push together), the chief's
 * checkpoint arrangement with the servers, stopping on request, finish,
 * and the blocking pull of moving averages for evaluation. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "client_internal.h"

/* The smaller of a variables' step and a tables' step (UINT64_MAX: that
 * kind was not asked): the step every variable and table has reached. */
static uint64_t min_step_of(uint64_t dense, uint64_t tables) {
  return dense < tables ? dense : tables;
}

int ps_client_pull(ps_client *c, uint64_t min_step, uint64_t *step_out) {
  if (!c) return PS_EINVAL;
  ps_req *r, *tr = NULL;
  int rc = ps_client_pull_async(c, min_step, NULL, 0, &r);
  if (rc) return rc;
  /* Tables too: a worker that resumes learns their step as well. */
  if (c->ntables && (rc = ps__tables_step_pull(c, min_step, &tr)) != 0) {
    ps__req_release(c, r);
    return rc;
  }
  uint64_t got = 0, tgot = UINT64_MAX;
  rc = ps_req_wait(r, -1, &got);
  if (rc == 0 && tr) rc = ps_req_wait(tr, -1, &tgot);
  ps__req_release(c, r);
  if (tr) ps__req_release(c, tr);
  ps__telem_idle(&c->telem, ps__now());
  if (rc) return rc;
  got = min_step_of(c->nvars || !tr ? got : UINT64_MAX, tgot);
  c->cur_step = got;
  if (step_out) *step_out = got;
  return 0;
}

uint64_t ps_client_step_current(const ps_client *c) { return c ? c->cur_step : 0; }

/* Every server has written its stop checkpoint: only then may the worker
 * leave (with backup workers a server can still need its gradients to
 * reach the step). */
static int all_stopped(const ps_client *c) {
  for (int i = 0; i < c->num_ps; i++)
    if (!c->conns[i].stopped) return 0;
  return c->num_ps > 0;
}

uint64_t ps_client_stop_step(const ps_client *c) {
  return c && all_stopped(c) ? c->stop_step : 0;
}

/* The error a worker leaves with once every server has stopped: it names
 * the step the next run resumes from. */
static int stopped_err(ps_client *c) {
  if (c->note_fd >= 0 && !c->noted) { /* psrun: this worker's exit is a stop */
    ssize_t n = write(c->note_fd, "stopped\n", 8);
    (void)n;
    c->noted = 1;
  }
  return ps__seterr(c, PS_ESTOPPED,
                "the job stops on request: the parameter servers checkpointed step %llu; "
                "run it again to resume there",
                (unsigned long long)c->stop_step);
}

/* Sends Checkpoint{step, stop, commit} to every server and waits. 0 (see
 * r->refused and r->max_step in *out, released by the caller) or <0. */
static int checkpoint_round(ps_client *c, uint64_t step, int stop, int commit, ps_req **out) {
  ps_req *r = ps__req_new(c, PS__REQ_CHECKPOINT);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  int rc = 0;
  for (int p = 0; p < c->num_ps && rc == 0; p++) {
    Ps__Checkpoint m = PS__CHECKPOINT__INIT;
    m.request_id = r->id;
    m.step = step;
    m.stop = stop;
    m.commit = commit;
    rc = ps__queue_frame(c, &c->conns[p], PS__MSG_CHECKPOINT, &m.base, NULL, NULL, 0);
    if (rc == 0) {
      ps__req_expect(r, p, 1);
      ps__conn_flush(c, &c->conns[p]);
    }
  }
  if (rc == 0) rc = ps_req_wait(r, -1, NULL);
  if (rc) {
    ps__req_release(c, r);
    return rc;
  }
  *out = r;
  return 0;
}

/* The chief: every server checkpoints at one step. Prepare at `step` (the
 * step whose parameters we just received, so in sync training no server
 * can be past it); a server already past it refuses and says how far it
 * is, and the next round tries that step. */
static int agree_checkpoint(ps_client *c, uint64_t step, int stop) {
  for (int round = 0; round < PS__CKPT_ROUNDS; round++) {
    ps_req *r;
    int rc = checkpoint_round(c, step, stop, 0, &r);
    if (rc) return rc;
    int refused = r->refused;
    uint64_t max = r->max_step;
    ps__req_release(c, r);
    if (!refused) {
      if ((rc = checkpoint_round(c, step, stop, 1, &r)) != 0) return rc;
      refused = r->refused;
      ps__req_release(c, r);
      if (refused) return PS_ESTATE; /* errmsg names the server */
      return 0;
    }
    if (max <= step) return PS_ESTATE; /* refused for another reason: errmsg */
    step = max + 1; /* margin: backup workers may move it on meanwhile */
  }
  return ps__seterr(c, PS_ESTATE, "the servers did not agree on a checkpoint step in %d rounds",
                PS__CKPT_ROUNDS);
}

/* Between steps: arranges checkpoints and stops the servers asked for.
 * A failed timed checkpoint does not end training (the servers log it);
 * a failed stop does. */
static int after_step(ps_client *c, uint64_t step) {
  int stop = (c->want_stop || c->stop_requested) && !c->stop_agreed;
  if (!stop && !c->want_ckpt) return 0;
  if (!c->checkpoints) {
    if (c->stop_requested)
      return ps__seterr(c, PS_ESHUTDOWN,
                    "stop requested, and the parameter servers keep no checkpoints "
                    "(no --checkpoint-dir): nothing was saved");
    return 0;
  }
  if (c->worker_index != 0) return 0; /* the chief arranges it; replies tell us */
  c->want_ckpt = 0;
  c->want_stop = 0;
  int rc = agree_checkpoint(c, step, stop);
  if (rc) return stop ? rc : 0;
  if (stop) c->stop_agreed = 1; /* keep stepping until every server stopped */
  return all_stopped(c) ? stopped_err(c) : 0;
}

void ps_client_request_stop(ps_client *c) {
  if (c) c->stop_requested = 1;
}

/* The requests of one step: the variables' pull and push, and the
 * tables' step pull and push (NULL when there is nothing of that kind). */
typedef struct step_reqs {
  ps_req *pull, *push, *tpull, *tpush;
} step_reqs;

/* Releases what is left of a step's requests (late answers are dropped
 * on arrival). */
static void step_release(ps_client *c, step_reqs *s) {
  ps_req **v[] = {&s->pull, &s->push, &s->tpull, &s->tpush};
  for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
    if (*v[i]) {
      ps__req_release(c, *v[i]);
      *v[i] = NULL;
    }
  for (size_t i = 0; i < c->nearly; i++) ps__req_release(c, c->early[i]);
  c->nearly = 0;
  for (size_t i = 0; i < c->nvars; i++) c->vars[i]->early = 0;
}

/* The trainable variables ps_client_step_push has not sent (c->rest,
 * *n of them); 0 or PS_ENOMEM. */
static int rest_of_push(ps_client *c, size_t *n) {
  const ps__array a[] = {{(void **)&c->rest, sizeof *c->rest}};
  if (ps__grow_all(a, 1, &c->caprest, c->nvars))
    return ps__seterr(c, PS_ENOMEM, "out of memory");
  *n = 0;
  for (size_t i = 0; i < c->nvars; i++)
    if (c->vars[i]->trainable && !c->vars[i]->early) c->rest[(*n)++] = c->vars[i];
  return 0;
}

/* One variable of a ps_client_step_push call: errmsg names what is wrong. */
static int check_early(ps_client *c, const ps_var *v, size_t i) {
  if (!v || v->c != c)
    return ps__seterr(c, PS_EINVAL, "variable %zu does not belong to this client", i);
  if (v->early)
    return ps__seterr(c, PS_EINVAL, "variable '%s' was already pushed for this step", v->name);
  return 0;
}

int ps_client_step_push(ps_client *c, uint64_t step, ps_var *const *vars, size_t n) {
  if (!c) return PS_EINVAL;
  if (!vars || !n) return ps__seterr(c, PS_EINVAL, "ps_client_step_push: no variables listed");
  if (c->nearly && step != c->early_step)
    return ps__seterr(c, PS_EINVAL,
                      "ps_client_step_push: step %llu, but this step's earlier pushes were "
                      "computed at step %llu",
                      (unsigned long long)step, (unsigned long long)c->early_step);
  for (size_t i = 0; i < n; i++) {
    int rc = check_early(c, vars[i], i);
    if (rc) return rc;
  }
  const ps__array a[] = {{(void **)&c->early, sizeof *c->early}};
  if (ps__grow_all(a, 1, &c->capearly, c->nearly + 1))
    return ps__seterr(c, PS_ENOMEM, "out of memory");
  ps_req *r;
  ps__tables_unhold(c); /* a table's gradients held in a ring would send this over TCP */
  int rc = ps_client_push_async(c, step, vars, n, &r);
  if (rc) return rc;
  for (size_t i = 0; i < n; i++) vars[i]->early = 1;
  c->early[c->nearly++] = r;
  c->early_step = step;
  return 0;
}

/* Sends a step's requests. The pulls go first, so the servers answer each
 * slice (and table) the moment its update is applied, while the rest of
 * the push is still arriving. The tables' pushes go before the variables'
 * push: a table's gradients held in a push ring (ps_table_add_grad wrote
 * them there) keep every other frame out of it until they are queued. A
 * table push too big for its frames fails before anything is sent. */
static int step_send(ps_client *c, uint64_t step, step_reqs *s) {
  uint64_t want = c->async_mode ? 0 : step + 1;
  int rc = ps__tables_step_check(c);
  if (!rc) rc = ps_client_pull_async(c, want, NULL, 0, &s->pull);
  /* Async mode waits for nothing: a table's zero-key pull would only say
   * its step, which the worker does not use. */
  if (!rc && c->ntables && !c->async_mode) rc = ps__tables_step_pull(c, want, &s->tpull);
  /* The list of the rest is made before any gradient is sent: running
   * out of memory for it must not leave the tables' gradients gone. */
  size_t n = 0;
  if (!rc && c->nearly) rc = rest_of_push(c, &n);
  if (!rc && c->ntables) rc = ps__tables_step_push(c, step, &s->tpush);
  if (!rc) rc = ps_client_push_async(c, step, c->nearly ? c->rest : NULL, n, &s->push);
  if (rc) step_release(c, s);
  return rc;
}

/* Waits for a push: 0 when applied, stale or a duplicate (the servers
 * moved on, or already have this worker's gradient: either way the pull
 * decides the step), else the refusal or failure. */
static int push_result(ps_req *r, int *stale) {
  if (!r) return 0;
  int rc = ps_req_wait(r, -1, NULL);
  if (r->stale) *stale = 1;
  return rc == PS_ESTALE || rc == PS_EDUPLICATE ? 0 : rc;
}

int ps_client_step(ps_client *c, uint64_t *step, int *stale_out) {
  if (!c) return PS_EINVAL;
  if (!step) return ps__seterr(c, PS_EINVAL, "ps_client_step: step is NULL");
  /* SIGTERM/SIGUSR1 through the library's handlers: as if the
   * application had called ps_client_request_stop (this push tells the
   * servers, and the chief arranges the stop checkpoint after it). */
  if (c->signals && ps__signals_stop()) c->stop_requested = 1;
  step_reqs s = {NULL, NULL, NULL, NULL};
  uint64_t from = *step;
  if (c->nearly && from != c->early_step) {
    step_release(c, &s);
    return ps__seterr(c, PS_EINVAL,
                      "ps_client_step: step %llu, but ps_client_step_push sent gradients "
                      "computed at step %llu",
                      (unsigned long long)from, (unsigned long long)c->early_step);
  }
  ps__telem_step_begin(&c->telem, ps__now());
  int rc = step_send(c, *step, &s);
  if (rc) return rc;
  int stale = 0;
  rc = push_result(s.push, &stale);
  for (size_t i = 0; i < c->nearly && !rc; i++) rc = push_result(c->early[i], &stale);
  if (!rc) rc = push_result(s.tpush, &stale);
  double push_done = ps__now();
  if (rc) {
    /* Refused (errmsg has psd's sentence) or failed: the pulls could only
     * wait out the request timeout for an update that will not come. */
    step_release(c, &s);
    return rc;
  }
  uint64_t got = 0, tgot = UINT64_MAX;
  rc = ps_req_wait(s.pull, -1, &got);
  if (!rc && s.tpull) rc = ps_req_wait(s.tpull, -1, &tgot);
  int tables = s.tpull != NULL;
  double first = s.pull->first_reply_at;
  if (!first && tables) first = s.tpull->first_reply_at;
  ps__telem_step_end(&c->telem, from, push_done, first, stale, ps__now());
  step_release(c, &s);
  if (rc) return rc;
  if (all_stopped(c)) return stopped_err(c);
  /* Tables only: their step (the variables' pull received nothing). */
  got = min_step_of(c->nvars || !tables ? got : UINT64_MAX, tgot);
  uint64_t next = c->async_mode ? *step + 1 : got;
  /* Outputs change only when the whole call succeeds. */
  if ((rc = after_step(c, next)) != 0) return rc;
  *step = next;
  c->cur_step = next;
  if (stale_out) *stale_out = stale;
  return 0;
}

int ps_client_finish(ps_client *c) {
  if (!c) return PS_EINVAL;
  Ps__WorkerSummary summary;
  int have_summary = c->telem.on && ps__telem_summary(&c->telem, &summary) == 0;
  ps_req *r = ps__req_new(c, PS__REQ_FINISH);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  int rc = 0;
  for (int p = 0; p < c->num_ps && rc == 0; p++) {
    if (c->conns[p].fd < 0) {
      rc = ps__seterr(c, PS_ECLOSED, "connection to ps %d at %s is lost", p, c->conns[p].addr);
      break;
    }
    Ps__Finish m = PS__FINISH__INIT;
    m.request_id = r->id;
    m.summary = have_summary ? &summary : NULL; /* for ps0's end-of-run table */
    rc = ps__queue_frame(c, &c->conns[p], PS__MSG_FINISH, &m.base, NULL, NULL, 0);
    if (rc == 0) ps__req_expect(r, p, 1);
  }
  if (rc) {
    ps__req_release(c, r);
    return rc;
  }
  return ps__req_wait_release(c, r);
}

/* The checks of ps_client_pull_average before anything is sent. */
static int check_average_pull(ps_client *c, ps_var *const *vars, size_t n, float *const *out) {
  if (!vars || n == 0 || !out)
    return ps__seterr(c, PS_EINVAL, "ps_client_pull_average: vars and out must list n > 0 "
                                    "variables and buffers");
  int rc = ps__check_vars(c, vars, n, 0);
  if (rc) return rc;
  for (size_t i = 0; i < n; i++) {
    if (!out[i])
      return ps__seterr(c, PS_EINVAL, "ps_client_pull_average: out[%zu] ('%s') is NULL", i,
                        vars[i]->name);
    if (vars[i]->opt.average == PS_AVERAGE_NONE)
      return ps__seterr(c, PS_EINVAL,
                        "variable '%s' keeps no moving average on the servers: create it with "
                        "ps_optimizer.average set to pull one", vars[i]->name);
  }
  /* Its replies land in out through the variables' data pointers: any
   * other pull in flight would land there too. */
  if (c->reqs.n)
    return ps__seterr(c, PS_ESTATE, "ps_client_pull_average: %zu other request%s of this "
                      "client in flight; wait for them first", c->reqs.n,
                      c->reqs.n == 1 ? " is" : "s are");
  return ps__need_minor(c, 7, "pulling moving averages");
}

int ps_client_pull_average(ps_client *c, ps_var *const *vars, size_t n, float *const *out,
                           uint64_t *step_out) {
  if (!c) return PS_EINVAL;
  int rc = check_average_pull(c, vars, n, out);
  if (rc) return rc;
  ps_req *r = ps__req_new(c, PS__REQ_PULL);
  if (!r) return ps__seterr(c, PS_ENOMEM, "out of memory");
  r->average = 1;
  /* The replies land where each variable's data points: out, for this
   * call only, so the parameters the next step computes on stay put. */
  float **saved = malloc(n * sizeof *saved);
  if (!saved) {
    ps__req_release(c, r);
    return ps__seterr(c, PS_ENOMEM, "out of memory");
  }
  for (size_t i = 0; i < n; i++) {
    saved[i] = vars[i]->data;
    vars[i]->data = out[i];
  }
  uint64_t got = 0;
  rc = ps__pull_average_send(c, r, vars, n); /* releases r on error */
  if (rc == 0) {
    if (r->pending == 0) ps__req_finish(c, r);
    rc = ps_req_wait(r, -1, &got);
    ps__req_release(c, r);
  }
  for (size_t i = 0; i < n; i++) vars[i]->data = saved[i];
  free(saved);
  if (rc == 0 && step_out) *step_out = got;
  return rc;
}
