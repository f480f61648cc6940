/* stop_worker - the README's quick-start worker, for the stop suite: it
 * installs no signal handler and treats every error of ps_client_step,
 * PS_ESTOPPED included, by printing ps_client_errmsg and exiting 1, as
 * the quick start does. Configured from psrun's environment.
 *
 *   stop_worker STEPS [--own-sigterm]
 *
 * Prints "first step N" after its first step (a resumed run starts at the
 * checkpoint's step) and "done step N" after finishing. --own-sigterm: the
 * application installs its own SIGTERM handler before ps_client_create
 * (it counts the signals and prints "own SIGTERM handler ran" at its next
 * step, then trains on), and the program checks after the create that the
 * handler is still its own. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "psclient.h"

/* SIGTERMs the application's own handler saw. */
static volatile sig_atomic_t g_own;

static void own_handler(int sig) {
  (void)sig;
  g_own++;
}

/* The model: gradient w - 1 (the parameters move towards 1). */
static void compute_gradient(const float *w, float *g, size_t n) {
  for (size_t i = 0; i < n; i++) g[i] = w[i] - 1.0f;
  struct timespec ts = {0, 5 * 1000000}; /* compute time: signals land mid-run */
  nanosleep(&ts, NULL);
}

int main(int argc, char **argv) {
  int steps = argc > 1 ? atoi(argv[1]) : 1000;
  int own = argc > 2 && !strcmp(argv[2], "--own-sigterm");
  if (own) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = own_handler;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  ps_client *c;
  char err[256];
  if (ps_client_create_from_env(&c, err, sizeof err) != 0) {
    fprintf(stderr, "%s\n", err);
    exit(1);
  }
  if (own) {
    struct sigaction now;
    sigaction(SIGTERM, NULL, &now);
    printf("SIGTERM handler %s\n", now.sa_handler == own_handler ? "kept" : "replaced");
  }
  int64_t shape[2] = {16, 4};
  ps_init init = PS_SIZED(ps_init, .kind = PS_INIT_GLOROT_UNIFORM, .seed = 1);
  ps_optimizer opt;
  ps_optimizer_default(&opt, 0.1);
  ps_var *w;
  if (ps_client_var_create(c, "w", shape, 2, &init, &opt, &w) != 0) {
    fprintf(stderr, "%s\n", ps_client_errmsg(c));
    exit(1);
  }
  uint64_t step = 0;
  int told = 0;
  for (int i = 0; i < steps; i++) {
    compute_gradient(ps_var_data(w), ps_var_grad(w), ps_var_numel(w));
    if (ps_client_step(c, &step, NULL) != 0) {
      fprintf(stderr, "%s\n", ps_client_errmsg(c));
      /* 0 unless the job stopped: then the step every worker resumes at. */
      fprintf(stderr, "stop step %llu\n", (unsigned long long)ps_client_stop_step(c));
      exit(1);
    }
    if (i == 0) printf("first step %llu\n", (unsigned long long)step);
    if (g_own && !told) {
      printf("own SIGTERM handler ran\n");
      told = 1;
    }
  }
  ps_client_finish(c);
  printf("done step %llu\n", (unsigned long long)step);
  ps_client_destroy(c);
  return 0;
}
