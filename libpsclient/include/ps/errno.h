/*
 * ps/errno.h - the error codes every layer returns (0 or a negative
 * PS_E*, one X-macro table), their names, and the exit status of a job
 * stopped on request. The same numbers travel on the wire.
 */
#ifndef PS_ERRNO_H
#define PS_ERRNO_H

#include "ps/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The exit status of a process of a job that stopped on request after its
 * checkpoint (PS_ESTOPPED): psd, psrun and the examples exit with it, and
 * a launcher that sees it may requeue the job, which then resumes. The one
 * definition of 75 (sysexits' EX_TEMPFAIL). */
#define PS_EXIT_STOPPED 75

/* Error codes: one table generates the enum and ps_strerror(). The same
 * numbers travel on the wire in Error messages. */
#define PS_ERRNO_MAP(X)                                                        \
  X(EINVAL, -1, "invalid argument")                                            \
  X(ENOMEM, -2, "out of memory")                                               \
  X(ECONNECT, -3, "could not connect to parameter server")                     \
  X(ECLOSED, -4, "connection to parameter server lost")                        \
  X(EPROTO, -5, "protocol error")                                              \
  X(EVERSION, -6, "protocol version mismatch")                                 \
  X(EMISMATCH, -7, "configuration mismatch between peers")                     \
  X(ESTALE, -8, "stale gradient dropped")                                      \
  X(EDUPLICATE, -9, "duplicate gradient for this step")                        \
  X(ETIMEDOUT, -10, "timed out")                                               \
  X(ENOTFOUND, -11, "unknown variable or slice")                               \
  X(ESHAPE, -12, "conflicting shape or size")                                  \
  X(ETOOBIG, -13, "message or tensor too large")                               \
  X(EAUTH, -14, "authentication failed")                                       \
  X(EUNSUPPORTED, -15, "not supported")                                        \
  X(ESTATE, -16, "operation not valid in the current state")                   \
  X(EBUSY, -17, "resource busy")                                               \
  X(EIO, -18, "input/output error")                                            \
  X(ESHUTDOWN, -19, "server is shutting down")                                 \
  X(EINTERNAL, -20, "internal error")                                          \
  X(ESTOPPED, -21, "job stopped on request (checkpoint written)")

typedef enum ps_errno {
  PS_OK = 0,
#define PS__ERR_ENUM(name, val, msg) PS_##name = (val),
  PS_ERRNO_MAP(PS__ERR_ENUM)
#undef PS__ERR_ENUM
} ps_errno;

/* Static description of an error code; never NULL (unknown codes give
 * "unknown error"). */
PS_EXTERN const char *ps_strerror(int code);
/* Symbolic name of an error code ("PS_ESTALE"), or "PS_UNKNOWN". */
PS_EXTERN const char *ps_err_name(int code);

#ifdef __cplusplus
}
#endif

#endif /* PS_ERRNO_H */
