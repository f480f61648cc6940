/* step.c - the training step (pull and push together), the chief's
 * checkpoint arrangement with the servers, stopping on request, finish. */
#include <stdio.h>

#include "client_internal.h"

int ps_client_pull(ps_client *c, uint64_t min_step, uint64_t *step_out) {
  if (!c) return PS_EINVAL;
  ps_req *r;
  int rc = ps_client_pull_async(c, min_step, NULL, 0, &r);
  if (rc) return rc;
  uint64_t got = 0;
  rc = ps_req_wait(r, -1, &got);
  ps__req_release(c, r);
  ps__telem_idle(&c->telem, ps__now());
  if (rc) return rc;
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

/* The error a worker leaves with once every server has stopped: it names
 * the step the next run resumes from. */
static int stopped_err(ps_client *c) {
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

int ps_client_step(ps_client *c, uint64_t *step, int *stale_out) {
  if (!c) return PS_EINVAL;
  if (!step) return ps__seterr(c, PS_EINVAL, "ps_client_step: step is NULL");
  /* SIGTERM/SIGUSR1 through the library's handlers: as if the
   * application had called ps_client_request_stop (this push tells the
   * servers, and the chief arranges the stop checkpoint after it). */
  if (c->signals && ps__signals_stop()) c->stop_requested = 1;
  /* The pull goes first, so the servers answer each slice the moment its
   * update is applied, while the rest of the push is still arriving. */
  ps_req *pull = NULL, *push = NULL;
  uint64_t from = *step;
  ps__telem_step_begin(&c->telem, ps__now());
  uint64_t want = c->async_mode ? 0 : *step + 1;
  int rc = ps_client_pull_async(c, want, NULL, 0, &pull);
  if (rc) return rc;
  rc = ps_client_push_async(c, *step, NULL, 0, &push);
  if (rc) {
    ps__req_release(c, pull); /* its answers, if any, are dropped on arrival */
    return rc;
  }
  int prc = ps_req_wait(push, -1, NULL);
  double push_done = ps__now();
  int stale = push->stale;
  ps__req_release(c, push);
  /* Stale: the servers moved on. Duplicate: they already have this
   * worker's gradient for the step (a restarted worker pushing its
   * predecessor's step again): as good as applied. Either way the pull
   * decides the step. */
  if (prc == PS_ESTALE || prc == PS_EDUPLICATE) prc = 0;
  if (prc) {
    /* Refused (errmsg has psd's sentence) or failed: the pull could only
     * wait out the request timeout for an update that will not come. */
    ps__req_release(c, pull); /* its answers, if any, are dropped on arrival */
    return prc;
  }
  uint64_t got = 0;
  int lrc = ps_req_wait(pull, -1, &got);
  ps__telem_step_end(&c->telem, from, push_done, pull->first_reply_at, stale, ps__now());
  ps__req_release(c, pull);
  if (lrc) return lrc;
  if (all_stopped(c)) return stopped_err(c);
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
