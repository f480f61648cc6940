/* launch.c - psd's command line and the workers' environment. */
#define _GNU_SOURCE
#include "launch.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

/* Seconds psd has to bind its port and write the port file. */
#define PSR_PSD_START_S 30.0

char *psr_start_psd(psr_procs *p, const psr_task *t, char *err, size_t errlen) {
  const psr_opts *o = t->o;
  char dir[] = "/tmp/psrun.XXXXXX";
  if (!mkdtemp(dir)) {
    snprintf(err, errlen, "cannot create a temporary directory: %s", strerror(errno));
    return NULL;
  }
  char portf[64], idx[16], nps[16], nw[16], label[32], jid[32], sid[32], ce[16], cs[32];
  snprintf(portf, sizeof portf, "%s/port", dir);
  snprintf(idx, sizeof idx, "%d", t->index);
  snprintf(nps, sizeof nps, "%d", t->num_ps);
  snprintf(nw, sizeof nw, "%d", t->num_workers);
  snprintf(label, sizeof label, "ps%d", t->index);
  snprintf(jid, sizeof jid, "%lld", t->job_id);
  snprintf(sid, sizeof sid, "%lld", t->step_id);
  char tele[4100], rep[16];
  snprintf(tele, sizeof tele, "%s.ps%d", o->telemetry, t->index);
  int backups, replicas = psr_replicas(o, t->num_workers, &backups);
  snprintf(rep, sizeof rep, "%d", replicas);
  char *argv[96];
  int a = 0;
  char *fixed[] = {(char *)o->psd, "--host", (char *)t->host, "--port", "0", "--port-file",
                   portf, "--ps-index", idx, "--num-ps", nps, "--name", label};
  for (size_t k = 0; k < sizeof fixed / sizeof fixed[0]; k++) argv[a++] = fixed[k];
  if (t->num_workers > 0) {
    argv[a++] = "--workers";
    argv[a++] = nw;
  }
  if (replicas > 0) { /* psd then refuses a worker that disagrees */
    argv[a++] = "--replicas-to-aggregate";
    argv[a++] = rep;
  }
  if (t->munge) {
    argv[a++] = "--munge";
    argv[a++] = "--job-id";
    argv[a++] = jid;
    argv[a++] = "--step-id";
    argv[a++] = sid;
    if (t->munge_socket && t->munge_socket[0]) {
      argv[a++] = "--munge-socket";
      argv[a++] = (char *)t->munge_socket;
    }
  }
  if (o->ckpt_dir[0]) {
    argv[a++] = "--checkpoint-dir";
    argv[a++] = (char *)o->ckpt_dir;
    snprintf(ce, sizeof ce, "%d", o->ckpt_every);
    snprintf(cs, sizeof cs, "%g", o->ckpt_secs);
    argv[a++] = "--checkpoint-every";
    argv[a++] = ce;
    argv[a++] = "--checkpoint-secs";
    argv[a++] = cs;
  }
  if (o->telemetry[0]) {
    argv[a++] = "--telemetry";
    argv[a++] = tele;
  }
  argv[a++] = "--transport";
  argv[a++] = (char *)(o->transport[0] ? o->transport : "auto");
  if (t->index == 0 && t->summary) { /* one table per job: ps0 has every worker */
    argv[a++] = "--summary";
    argv[a++] = (char *)t->summary;
  }
  for (int k = 0; k < o->psd_args.n && a < 90; k++) argv[a++] = o->psd_args.v[k];
  argv[a] = NULL;
  /* The secret travels in the environment (psd removes it from its own),
   * never on a command line other users can read. */
  char e_secret[300];
  snprintf(e_secret, sizeof e_secret, "PSD_SECRET=%s", t->secret ? t->secret : "");
  char *env[] = {e_secret, NULL};
  int child = psr_spawn(p, label, 1, argv, t->secret && t->secret[0] ? env : NULL, err, errlen);
  char *result = NULL;
  double deadline = ps__now() + PSR_PSD_START_S;
  while (child >= 0 && !result) {
    FILE *f = fopen(portf, "r");
    if (f) {
      char line[128] = "";
      char *ok = fgets(line, sizeof line, f);
      fclose(f);
      if (ok && strchr(line, ':')) {
        line[strcspn(line, "\r\n")] = '\0';
        result = strdup(line);
        break;
      }
    }
    int which;
    if (psr_wait(p, 20, -1, &which) == PSR_EV_EXIT && which == child) {
      char d[64];
      psr_describe(p->kids[which].status, d, sizeof d);
      snprintf(err, errlen, "%s %s before it was ready", label, d);
      break;
    }
    if (ps__now() > deadline) {
      snprintf(err, errlen, "%s did not report its port within %.0f s", label, PSR_PSD_START_S);
      break;
    }
  }
  unlink(portf);
  rmdir(dir);
  return result;
}

int psr_start_worker(psr_procs *p, const psr_task *t, const char *hosts, char *err,
                     size_t errlen) {
  size_t hl = strlen(hosts) + 16;
  char *e_hosts = malloc(hl);
  if (!e_hosts) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  snprintf(e_hosts, hl, "PS_HOSTS=%s", hosts);
  char e_idx[64], e_nw[64], e_nps[64], e_local[64], e_lw[64], e_secret[300], e_job[64],
      e_step[64], e_sock[1100], e_rep[64], label[32];
  snprintf(e_idx, sizeof e_idx, "PS_WORKER_INDEX=%d", t->index);
  snprintf(e_nw, sizeof e_nw, "PS_NUM_WORKERS=%d", t->num_workers);
  snprintf(e_nps, sizeof e_nps, "PS_NUM_PS=%d", t->num_ps);
  snprintf(e_local, sizeof e_local, "PS_LOCAL_RANK=%d", t->local_rank);
  snprintf(e_lw, sizeof e_lw, "PS_LOCAL_WORKERS=%d", t->local_workers);
  snprintf(e_secret, sizeof e_secret, "PS_SECRET=%s", t->secret ? t->secret : "");
  snprintf(e_job, sizeof e_job, "PS_JOB_ID=%lld", t->job_id);
  snprintf(e_step, sizeof e_step, "PS_STEP_ID=%lld", t->step_id);
  snprintf(e_sock, sizeof e_sock, "PS_MUNGE_SOCKET=%s", t->munge_socket ? t->munge_socket : "");
  snprintf(label, sizeof label, "w%d", t->index);
  char e_tele[4200], e_wire[32], e_tr[32];
  snprintf(e_tele, sizeof e_tele, "PS_TELEMETRY=%s.w%d", t->o->telemetry, t->index);
  snprintf(e_wire, sizeof e_wire, "PS_WIRE_DTYPE=%s", t->o->wire_dtype);
  snprintf(e_tr, sizeof e_tr, "PS_TRANSPORT=%s", t->o->transport[0] ? t->o->transport : "auto");
  char *env[21] = {e_hosts, e_idx, e_nw, e_nps, e_local, "PS_ROLE=worker", e_tr};
  int ne = 7;
  int backups, replicas = psr_replicas(t->o, t->num_workers, &backups);
  snprintf(e_rep, sizeof e_rep, "PS_REPLICAS_TO_AGGREGATE=%d", replicas);
  if (replicas > 0) env[ne++] = e_rep;
  /* Workers sharing this machine's cores size their thread pools by it. */
  if (t->local_workers > 0) env[ne++] = e_lw;
  if (t->secret && t->secret[0]) env[ne++] = e_secret;
  if (t->o->telemetry[0]) env[ne++] = e_tele;
  if (t->o->wire_dtype[0]) env[ne++] = e_wire;
  if (t->munge) {
    env[ne++] = "PS_MUNGE=1";
    env[ne++] = e_job;
    env[ne++] = e_step;
    if (t->munge_socket && t->munge_socket[0]) env[ne++] = e_sock;
  }
  env[ne] = NULL;
  int child = psr_spawn(p, label, 0, t->o->cmd, env, err, errlen);
  free(e_hosts);
  return child;
}
