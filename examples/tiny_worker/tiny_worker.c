/*
 * tiny_worker - the smallest real training worker: multinomial logistic
 * regression on a synthetic, learnable dataset, configured from the
 * environment psrun sets (PS_HOSTS, PS_WORKER_INDEX, PS_NUM_WORKERS).
 * Used by the launcher's tests and as an example of libpsclient.
 *
 *   tiny_worker [--steps N] [--batch B] [--fail-at-step K] [--sleep-ms MS]
 *               [--skip-finish 1]
 *
 * Prints one JSON line at the end: {"worker":i,"steps":N,"loss":...,
 * "accuracy":...}. Exits 0 if training ran (and, with --fail-at-step, 1 at
 * that step: a worker that crashes mid-training). --skip-finish 1 exits 0
 * without ps_client_finish, as a worker that forgets it would.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "psclient.h"

#define D 8 /* features */
#define C 3 /* classes */

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/* Sample i: features uniform in [-1, 1), label from a fixed linear rule. */
static void sample(uint64_t i, float x[D], int *y) {
  static const float truth[C][D] = {{1, -1, 0.5f, 0, 2, -0.5f, 0, 1},
                                    {-1, 1, 0, 0.5f, -1, 1, 1, 0},
                                    {0, 0.5f, -1, -1, 0, 0, -1, -1}};
  for (int d = 0; d < D; d++)
    x[d] = (float)((mix(i * D + (uint64_t)d) >> 11) * (1.0 / 9007199254740992.0)) * 2 - 1;
  int best = 0;
  float bs = -1e30f;
  for (int k = 0; k < C; k++) {
    float s = 0;
    for (int d = 0; d < D; d++) s += truth[k][d] * x[d];
    if (s > bs) bs = s, best = k;
  }
  *y = best;
}

/* Mean cross-entropy gradient over samples [first, first+n). */
static float grad(const float *W, const float *b, uint64_t first, uint64_t n, float *gW,
                  float *gb, int *correct) {
  memset(gW, 0, sizeof(float) * D * C);
  memset(gb, 0, sizeof(float) * C);
  double loss = 0;
  *correct = 0;
  for (uint64_t i = first; i < first + n; i++) {
    float x[D], z[C], mx = -1e30f, sum = 0;
    int y, arg = 0;
    sample(i, x, &y);
    for (int k = 0; k < C; k++) {
      z[k] = b[k];
      for (int d = 0; d < D; d++) z[k] += x[d] * W[d * C + k];
      if (z[k] > mx) mx = z[k], arg = k;
    }
    *correct += arg == y;
    for (int k = 0; k < C; k++) sum += (z[k] = expf(z[k] - mx));
    for (int k = 0; k < C; k++) {
      float p = z[k] / sum, dz = (p - (k == y)) / (float)n;
      gb[k] += dz;
      for (int d = 0; d < D; d++) gW[d * C + k] += x[d] * dz;
      if (k == y) loss -= log(p > 1e-30f ? p : 1e-30f);
    }
  }
  return (float)(loss / (double)n);
}

int main(int argc, char **argv) {
  int steps = 50, batch = 32, fail_at = -1, sleep_ms = 0, skip_finish = 0;
  for (int a = 1; a < argc; a += 2) { /* each option takes a value */
    int *dst = NULL;
    if (!strcmp(argv[a], "--steps")) dst = &steps;
    else if (!strcmp(argv[a], "--batch")) dst = &batch;
    else if (!strcmp(argv[a], "--fail-at-step")) dst = &fail_at;
    else if (!strcmp(argv[a], "--sleep-ms")) dst = &sleep_ms;
    else if (!strcmp(argv[a], "--skip-finish")) dst = &skip_finish;
    char *end = NULL;
    if (!dst || a + 1 >= argc || (*dst = (int)strtol(argv[a + 1], &end, 10), *end)) {
      fprintf(stderr, "tiny_worker: bad argument '%s' (--steps N --batch B --fail-at-step K "
                      "--sleep-ms MS)\n", argv[a]);
      return 2;
    }
  }
  ps_client *c;
  char err[512];
  int rc = ps_client_create_from_env(&c, err, sizeof err);
  if (rc) {
    fprintf(stderr, "tiny_worker: %s\n", err);
    return 1;
  }
  int w = ps_client_worker_index(c), nw = ps_client_num_workers(c);
  int64_t sw[2] = {D, C}, sb[1] = {C};
  ps_init gi = PS_SIZED(ps_init, PS_INIT_GLOROT_UNIFORM, 0, 0, 42), zi = PS_SIZED(ps_init, PS_INIT_ZEROS, 0, 0, 0);
  ps_optimizer opt;
  ps_optimizer_default(&opt, 0.5);
  ps_var *vw, *vb;
  if ((rc = ps_client_var_create(c, "W", sw, 2, &gi, &opt, &vw)) ||
      (rc = ps_client_var_create(c, "b", sb, 1, &zi, &opt, &vb))) {
    fprintf(stderr, "tiny_worker %d: %s\n", w, ps_client_errmsg(c));
    return 1;
  }
  uint64_t step = 0;
  float loss = 0;
  int correct = 0;
  /* Until the job's step reaches --steps, not for --steps steps of its own:
   * a worker restarted in place rejoins at the current step and must end
   * with the others, not wait for steps they will never take. */
  for (int i = 0; i < steps && (i == 0 || step < (uint64_t)steps); i++) {
    if (i == fail_at) {
      fprintf(stderr, "tiny_worker %d: failing at step %d as asked\n", w, i);
      return 1;
    }
    if (sleep_ms) {
      struct timespec ts = {sleep_ms / 1000, (long)(sleep_ms % 1000) * 1000000L};
      nanosleep(&ts, NULL);
    }
    uint64_t first = (step * (uint64_t)nw + (uint64_t)w) * (uint64_t)batch;
    loss = grad(ps_var_data(vw), ps_var_data(vb), first, (uint64_t)batch, ps_var_grad(vw),
                ps_var_grad(vb), &correct);
    if ((rc = ps_client_step(c, &step, NULL)) != 0) {
      fprintf(stderr, "tiny_worker %d: step failed: %s\n", w, ps_client_errmsg(c));
      return 1;
    }
  }
  /* Held-out accuracy of the final parameters. */
  float gW[D * C], gb[C];
  grad(ps_var_data(vw), ps_var_data(vb), 1u << 30, 2000, gW, gb, &correct);
  if (skip_finish) { /* a worker that forgets ps_client_finish, for psrun's tests */
    fprintf(stderr, "tiny_worker %d: exiting without ps_client_finish as asked\n", w);
    return 0;
  }
  if ((rc = ps_client_finish(c)) != 0) {
    fprintf(stderr, "tiny_worker %d: finish failed: %s\n", w, ps_client_errmsg(c));
    return 1;
  }
  printf("{\"worker\":%d,\"steps\":%llu,\"loss\":%.4f,\"accuracy\":%.4f}\n", w,
         (unsigned long long)step, loss, correct / 2000.0);
  ps_client_destroy(c);
  return 0;
}
