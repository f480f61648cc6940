/*
 * nn_cuda_none.c - the CUDA entry points of nn.h in a build without the
 * CUDA toolkit (PS_CUDA off): no devices, and a sentence saying why.
 */
#include <stdio.h>

#include "nn.h"

const cnn_backend *cnn_backend_cuda(int device, char *err, size_t errlen) {
  (void)device;
  if (err && errlen)
    snprintf(err, errlen,
             "this build has no CUDA backend (configured without the CUDA "
             "toolkit or with -DPS_CUDA=OFF)");
  return NULL;
}

int cnn_cuda_device_count(void) { return 0; }

int cnn_cuda_device_name(int device, char *buf, size_t len) {
  (void)device;
  if (buf && len) buf[0] = '\0';
  return -1;
}

int cnn_cuda_built(void) { return 0; }

int cnn_cuda_absent(char *why, size_t len) {
  if (why && len)
    snprintf(why, len,
             "this build has no CUDA backend (configured without the CUDA "
             "toolkit or with -DPS_CUDA=OFF)");
  return 1;
}
