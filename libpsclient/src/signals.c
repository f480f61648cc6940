/* signals.c - SIGTERM and SIGUSR1 start the stop protocol without the
 * application writing a handler. Slurm preempts a job (and ends it at its
 * walltime) with one of these; a worker killed by it leaves the servers
 * with no chief to arrange the stop checkpoint, so the run is lost. With
 * these handlers the next ps_client_step asks for the stop instead, as if
 * ps_client_request_stop had been called.
 *
 * The handlers are process-wide, the clients are not: the first client
 * that wants them installs them (only for a signal still at its default
 * action: an application's own handler, or SIG_IGN, is its choice), the
 * last one destroyed puts back what was there. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "client_internal.h"

#define PS__NSIGS 2

/* The signals a launcher uses to stop a job. */
static const int g_sigs[PS__NSIGS] = {SIGTERM, SIGUSR1};
/* A stop signal arrived (set by the handler, read by ps_client_step). */
static volatile sig_atomic_t g_stop;
/* Guards the fields below: clients may be created on several threads. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
/* Clients that rely on the handlers (installed while > 0). */
static int g_users;
/* g_sigs[i]'s handler is ours (it was at SIG_DFL when we came). */
static int g_ours[PS__NSIGS];
/* What g_sigs[i] had before, restored by the last client's destroy. */
static struct sigaction g_prev[PS__NSIGS];

/* Async-signal-safe: a flag, and for a repeated signal sigaction and
 * write. The first signal asks for a stop, which takes a few steps; a
 * second one gives the signal back its default action so that the next
 * one ends the process (a user who means "now" can still say so, while a
 * launcher repeating its one SIGTERM, as srun does, does not kill a worker
 * in the middle of its checkpoint). */
static void on_stop_signal(int sig) {
  int saved = errno;
  if (!g_stop) {
    g_stop = 1;
  } else {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    static const char msg[] = "psclient: stop signal again while stopping: the next one "
                              "ends the process at once\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
  }
  errno = saved;
}

void ps__signals_hold(void) {
  pthread_mutex_lock(&g_mu);
  if (g_users++ == 0) {
    g_stop = 0; /* a signal of an earlier, destroyed client is not ours */
    for (int i = 0; i < PS__NSIGS; i++) {
      g_ours[i] = 0;
      if (sigaction(g_sigs[i], NULL, &g_prev[i]) != 0) continue;
      int dfl = !(g_prev[i].sa_flags & SA_SIGINFO) && g_prev[i].sa_handler == SIG_DFL;
      if (!dfl) continue; /* the application's own handler (or SIG_IGN) stays */
      struct sigaction sa;
      memset(&sa, 0, sizeof sa);
      sa.sa_handler = on_stop_signal;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_RESTART; /* the application's own reads are not cut short */
      g_ours[i] = sigaction(g_sigs[i], &sa, NULL) == 0;
    }
  }
  pthread_mutex_unlock(&g_mu);
}

void ps__signals_release(void) {
  pthread_mutex_lock(&g_mu);
  if (g_users > 0 && --g_users == 0) {
    for (int i = 0; i < PS__NSIGS; i++) {
      if (!g_ours[i]) continue;
      g_ours[i] = 0;
      /* Only ours (or the default a repeated signal put back) is ours to
       * replace: a handler the application installed since stays. */
      struct sigaction cur;
      if (sigaction(g_sigs[i], NULL, &cur) != 0) continue;
      int mine = !(cur.sa_flags & SA_SIGINFO) &&
                 (cur.sa_handler == on_stop_signal || cur.sa_handler == SIG_DFL);
      if (mine) sigaction(g_sigs[i], &g_prev[i], NULL);
    }
  }
  pthread_mutex_unlock(&g_mu);
}

int ps__signals_stop(void) { return g_stop != 0; }
