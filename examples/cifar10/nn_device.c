/*
 * nn_device.c - which visible GPU a worker takes (nn.h:
 * cnn_cuda_pick_device). Plain environment logic, no CUDA, so it is built
 * and tested everywhere.
 */
#include <stdlib.h>

#include "nn.h"

/* A local rank from the environment: psrun's PS_LOCAL_RANK, else Slurm's
 * SLURM_LOCALID; -1 if neither holds a number >= 0. */
static int env_rank(const char *name) {
  const char *v = getenv(name);
  if (!v || !*v) return -1;
  char *end;
  long r = strtol(v, &end, 10);
  return *end || r < 0 || r > 1000000 ? -1 : (int)r;
}

int cnn_cuda_pick_device(int count, const char **why) {
  const char *w;
  int dev;
  if (count < 1) {
    w = "no device";
    dev = -1;
  } else if (count == 1) {
    w = "the only visible device";
    dev = 0;
  } else if (env_rank("PS_LOCAL_RANK") >= 0) {
    w = "PS_LOCAL_RANK modulo the visible devices";
    dev = env_rank("PS_LOCAL_RANK") % count;
  } else if (env_rank("SLURM_LOCALID") >= 0) {
    w = "SLURM_LOCALID modulo the visible devices";
    dev = env_rank("SLURM_LOCALID") % count;
  } else {
    w = "no local rank in the environment: device 0";
    dev = 0;
  }
  if (why) *why = w;
  return dev;
}
