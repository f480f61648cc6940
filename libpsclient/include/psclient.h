/*
 * psclient.h - the public header of libpsclient, the C library that
 * training workers link to talk to psd parameter servers.
 *
 * Conventions (libuv/SQLite style):
 *  - Every handle is opaque and comes from a *_create function; the matching
 *    *_destroy releases it, and *_destroy(NULL) is a no-op.
 *  - Functions return 0 on success or a negative PS_E* code; ps_strerror()
 *    names a code and ps_client_errmsg() gives the details of the last error.
 *    Every failing call on a client sets that message itself (a NULL client
 *    has none to set), and leaves every output it was given untouched:
 *    *step, *stale_out, *out keep what the caller had put there
 *    (ps_client_create and ps_client_create_from_env excepted: on failure
 *    they set *out to NULL, so destroying it is always safe).
 *  - Thread safety: a ps_client and everything created from it (variables,
 *    requests) must be used by one thread at a time. Different clients are
 *    independent. ps_strerror() is thread-safe.
 *  - All tensors are float32, row-major, in host byte order (little endian).
 *  - Configuration structs (ps_config, ps_optimizer, ps_init) can grow
 *    without breaking programs built against an older header: their first
 *    field, struct_size, holds sizeof the struct as the caller compiled it.
 *    Fill it with the struct's init function (ps_config_init(&cfg), then
 *    set fields) or with PS_SIZED(type, fields...) in an initializer. The
 *    library reads only the fields that size covers and defaults the rest;
 *    a struct whose struct_size is 0 (memset, = {0}) is refused with
 *    PS_EINVAL and a message naming the init function, and one from a
 *    newer header that sets fields this library does not know is refused
 *    with PS_EUNSUPPORTED. New fields are only ever added at the end.
 *  - ABI: the shared library's SOVERSION is the major version. It changes
 *    on any ABI break (a removed or changed function, a reordered or
 *    resized field); adding functions, or fields at the end of the sized
 *    structs, is not a break. Every public function is marked PS_EXTERN,
 *    the only symbols the library exports.
 */
#ifndef PSCLIENT_H
#define PSCLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "ps/errno.h"
#include "ps/export.h"
#include "ps/types.h"
#include "ps/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------- */
/* Initializers (ps_init, ps/types.h): only the chief runs them. */

/* Fills out[0..n) for a tensor of the given shape (fans come from the shape:
 * the last dim is fan_out, the rest multiply to fan_in, as TensorFlow does).
 * `name` salts the seed. Returns 0 or PS_EINVAL (bad kind or parameters). */
PS_EXTERN int ps_init_fill(const ps_init *init, const char *name, const int64_t *shape,
                           int ndim, float *out, size_t n);

/* Fills *init (size bytes) with the default a NULL initializer gets:
 * zeros, seed 0. Call it through ps_init_init, which passes the size. */
PS_EXTERN void ps_init_init_sized(ps_init *init, size_t size);
static inline void ps_init_init(ps_init *init) { ps_init_init_sized(init, sizeof *init); }

/* ---------------------------------------------------------------------- */
/* Client */

typedef struct ps_client ps_client; /* connections to every ps task */
typedef struct ps_var ps_var;       /* a variable, owned by its client */
typedef struct ps_req ps_req;       /* an in-flight push or pull */

/* How tensors travel to a ps (ps_config.transport, added in 0.2.4). The
 * frames always go over the TCP connection; with shared memory their
 * tensor data goes through a segment the worker hands to a ps of its own
 * node (docs/protocol.md §1a). */
typedef enum ps_transport {
  PS_TRANSPORT_DEFAULT = 0, /* $PS_TRANSPORT (auto, tcp or shm) if set, else auto */
  PS_TRANSPORT_AUTO = 1,    /* shared memory with every ps of this node that
                               offers it, TCP otherwise (a ps on this node whose
                               segment fails is named on stderr) */
  PS_TRANSPORT_TCP = 2,     /* TCP only */
  PS_TRANSPORT_SHM = 3      /* shared memory with every ps, or ps_client_create
                               fails with PS_EUNSUPPORTED naming the ps and why
                               (another node, another uid, a psd --transport tcp) */
} ps_transport;

typedef struct ps_config {
  size_t struct_size;         /* sizeof(ps_config) as compiled by the caller
                                 (ps_config_init sets it) */
  const char *const *hosts;   /* "host:port" of each ps task, in ps order */
  int num_ps;                 /* entries in hosts, >= 1 */
  int worker_index;           /* 0..num_workers-1; 0 is the chief */
  int num_workers;            /* >= 1 */
  int replicas_to_aggregate;  /* 0: all workers; fewer makes backups */
  int async_mode;             /* nonzero: every push applied at once */
  int connect_timeout_ms;     /* keep retrying connects this long; 0: 60000 */
  int request_timeout_ms;     /* bound on any wait; 0: 600000 */
  uint64_t split_threshold;   /* bytes above which a variable is split over
                                 all ps tasks; 0: 1 MiB */
  uint64_t max_slice_bytes;   /* largest slice; larger parts are chunked so
                                 servers pipeline them; 0: 4 MiB */
  const void *credential;     /* shared secret the servers require (may be NULL) */
  size_t credential_len;      /* bytes in credential */
  int munge;                  /* nonzero: present a fresh MUNGE credential to
                                 every server, bound to job_id/step_id */
  const char *munge_socket;   /* munged socket (NULL: MUNGE's default) */
  long long job_id;           /* Slurm job the credential names */
  long long step_id;          /* Slurm step the credential names */
  const char *telemetry;      /* per-step telemetry: NULL or "" keeps it in
                                 memory only (for the end-of-run summary),
                                 "off" disables it, anything else is a file
                                 the records go to as JSON lines */
  /* Added in 0.2.1 after the first 0.2.1 layout (a program built before it
   * gets 0: the handlers). */
  int no_signal_handlers;     /* nonzero: leave SIGTERM and SIGUSR1 alone.
                                 0 (default): ps_client_create installs a
                                 handler for each of them that is still at
                                 its default action, so that Slurm's
                                 preemption or walltime signal stops the job
                                 after a checkpoint (see ps_client_step and
                                 "Signals" below) instead of killing the
                                 worker; PS_SIGNALS=0 for create_from_env */
  /* Added in 0.2.4 (a program built before them gets float32, and
   * transport 0: $PS_TRANSPORT, else auto). */
  ps_wire_dtype push_dtype;   /* gradients on the wire */
  ps_wire_dtype pull_dtype;   /* parameters on the wire */
  ps_transport transport;     /* how each ps is reached */
} ps_config;

/* Zeroes *cfg (size bytes: every field at its default) and sets
 * struct_size. Call it through ps_config_init, which passes the size. */
PS_EXTERN void ps_config_init_sized(ps_config *cfg, size_t size);
static inline void ps_config_init(ps_config *cfg) { ps_config_init_sized(cfg, sizeof *cfg); }

/* Connects to every ps task (retrying with backoff up to
 * connect_timeout_ms) and performs the handshake. While a ps cannot be
 * reached it prints a line on stderr every 3 s naming it ("psclient:
 * worker W: still trying to reach ps P at HOST:PORT after N s of the T s
 * connect timeout: WHY"), so a wrong address is not silent for the whole
 * timeout. On success *out owns the
 * connections; destroy it with ps_client_destroy(). On failure *out is NULL
 * and the return is negative; errmsg (if not NULL, errmsg_len bytes) gets
 * the reason, naming the host:port that failed. The config is copied. */
PS_EXTERN int ps_client_create(const ps_config *cfg, ps_client **out, char *errmsg,
                               size_t errmsg_len);

/* Same, configured from the environment set by psrun:
 *   PS_HOSTS=h1:p1,h2:p2   PS_WORKER_INDEX   PS_NUM_WORKERS
 *   PS_REPLICAS_TO_AGGREGATE (optional)  PS_ASYNC=1 (optional)
 *   PS_CONNECT_TIMEOUT_MS (optional)     PS_REQUEST_TIMEOUT_MS (optional)
 *   PS_SECRET (optional: the shared secret the servers require)
 *   PS_MUNGE=1 with PS_JOB_ID, PS_STEP_ID, PS_MUNGE_SOCKET (optional: MUNGE)
 *   PS_TELEMETRY (optional: ps_config.telemetry, "off" or a file)
 *   PS_MAX_SLICE_BYTES, PS_SPLIT_THRESHOLD (optional: placement; the same
 *   on every worker of a job)
 *   PS_SIGNALS=0 (optional: ps_config.no_signal_handlers = 1; default 1)
 *   PS_WIRE_DTYPE=f32|bf16|fp16 (optional: push_dtype and pull_dtype;
 *   psrun --wire-dtype), PS_WIRE_PUSH_DTYPE / PS_WIRE_PULL_DTYPE (optional:
 *   either alone, over PS_WIRE_DTYPE)
 * A missing or malformed variable is PS_EINVAL with a message naming it. */
PS_EXTERN int ps_client_create_from_env(ps_client **out, char *errmsg, size_t errmsg_len);

/* Closes the connections (without ps_client_finish: servers see the worker
 * leave) and frees every variable, table and request. The last client holding the
 * library's SIGTERM/SIGUSR1 handlers puts back the actions they replaced
 * (unless the application changed them since). NULL is a no-op. */
PS_EXTERN void ps_client_destroy(ps_client *c);

/* Closes the connections now, as ps_client_destroy would (servers see the
 * worker leave), but keeps the client: variables' buffers stay valid until
 * ps_client_destroy, and every later call that needs a server fails with
 * PS_ECLOSED. For bindings whose arrays over those buffers may outlive the
 * client (the Python package). NULL is a no-op. Added in 0.2.3. */
PS_EXTERN void ps_client_close(ps_client *c);

/* Details of the last error on c; valid until the next call on c. */
PS_EXTERN const char *ps_client_errmsg(const ps_client *c);

PS_EXTERN int ps_client_worker_index(const ps_client *c);
PS_EXTERN int ps_client_num_workers(const ps_client *c);
PS_EXTERN int ps_client_num_ps(const ps_client *c);
/* How tensors travel to ps ps_index: "shm" or "tcp" (NULL for a bad
 * index). Added in 0.2.4. */
PS_EXTERN const char *ps_client_transport(const ps_client *c, int ps_index);

/* Creates variable `name` with the given shape (1..PS_MAX_DIMS dims, all
 * > 0) on the servers, placed deterministically from the order of creation.
 * The chief initializes it with `init`; every other worker blocks until the
 * chief has, then receives the values (after 2 s, and every 10 s after
 * that, it names the variable on stderr as still waiting for the chief: a
 * name only some workers create would otherwise wait unexplained; the
 * wait ends after the request timeout with PS_ETIMEDOUT naming the
 * variable). If the variable already exists on
 * the servers (another worker or a restore created it) with the same shape
 * and optimizer, this attaches to it; a different shape is PS_ESHAPE and a
 * different optimizer PS_EMISMATCH, the message showing both shapes (or the
 * differing optimizer field with both values) and which worker registered
 * the variable first. `opt` may be NULL (SGD, lr 0.01); an optimizer of
 * kind PS_OPT_NONE makes a variable that is not trainable (see
 * ps_client_var_assign). On success *out is owned by c and its data holds
 * the current parameters. Blocking.
 * Creating a name this client already created is idempotent: with the same
 * shape, optimizer and initializer (compared as the servers compare them:
 * only the fields the rule or distribution uses) it returns the existing
 * handle at once, without any I/O; otherwise it fails, PS_ESHAPE or
 * PS_EMISMATCH, naming the property that differs and both values. */
PS_EXTERN int ps_client_var_create(ps_client *c, const char *name, const int64_t *shape,
                                   int ndim, const ps_init *init, const ps_optimizer *opt,
                                   ps_var **out);

/* As ps_client_var_create, but the chief's initial values are
 * values[0..numel) (pretrained weights, or a framework's own
 * initialization: the PyTorch wrapper sends the module's parameters) instead
 * of an initializer's draws; they must be finite, else PS_EINVAL naming the
 * first one that is not. The chief must give values (PS_EINVAL); another
 * worker may pass NULL, and receives the chief's values as with
 * ps_client_var_create. Creating the name again in this client must also
 * use this function. Added in 0.2.3. */
PS_EXTERN int ps_client_var_create_values(ps_client *c, const char *name, const int64_t *shape,
                                          int ndim, const float *values,
                                          const ps_optimizer *opt, ps_var **out);

/* Parameter values (numel floats), owned by the variable. Pulls overwrite
 * them: do not read while a pull is in flight. */
PS_EXTERN float *ps_var_data(ps_var *v);
/* Gradient buffer (numel floats, zero at creation) that push sends. Pushes
 * send straight from it: do not write while a push is in flight. */
PS_EXTERN float *ps_var_grad(ps_var *v);
PS_EXTERN size_t ps_var_numel(const ps_var *v);
PS_EXTERN const char *ps_var_name(const ps_var *v);
PS_EXTERN int ps_var_ndim(const ps_var *v);
PS_EXTERN const int64_t *ps_var_shape(const ps_var *v);
/* Makes pulls land in data[0..numel) and pushes send grad[0..numel), the
 * caller's memory, instead of the variable's own buffers (NULL for either:
 * its own again), from the next push or pull: a framework's tensors move
 * with no copy (the torch.distributed backend's gradient buckets). The
 * caller keeps them valid, and grad unchanged, until every push and pull
 * of the variable that may use them has completed; data and grad may be
 * the same memory (each slice's push is sent before its pull's reply can
 * come, in sync mode with every worker aggregated). ps_var_data and
 * ps_var_grad return the bound buffers. PS_EINVAL for a NULL v. Added in
 * 0.2.5. */
PS_EXTERN int ps_var_bind_buffers(ps_var *v, float *data, float *grad);
/* This variable's wire dtypes (ps_wire_dtype), over the client's
 * ps_config.push_dtype / pull_dtype; -1 keeps the client's. Takes effect
 * from the next push or pull. PS_EINVAL for another value. Added in
 * 0.2.4. */
PS_EXTERN int ps_var_set_wire_dtype(ps_var *v, int push_dtype, int pull_dtype);

/* The chief (worker 0) sets the values of vars[0..n) (all variables when
 * vars is NULL) to what their ps_var_data() holds: the caller writes the
 * values there (pretrained weights, statistics computed outside training),
 * then calls this with `step`, the step its last ps_client_step or
 * ps_client_pull returned (ps_client_step_current(c)), before its next
 * ps_client_step. Blocking: returns once every ps holding a slice has
 * applied it. What every ps does, for every slice of the variables:
 *  - sync mode, trainable variable: the values become the parameters of
 *    step + 1, replacing that step's update (the step's gradients still
 *    count to complete it, then are dropped; optimizer state is kept). So
 *    every worker's pull of step + 1 (its next ps_client_step) receives
 *    exactly these values, on every ps at the same step. To start from
 *    loaded weights, assign right after creating the variables, at step 0
 *    (or the step ps_client_pull returned on a resume).
 *  - not trainable (PS_OPT_NONE): the values replace the parameters at
 *    once and the variable's step becomes step + 1, so a pull of it with
 *    min_step step + 1 (ps_client_pull_async with the variable listed)
 *    waits for this assign; ps_client_step pulls its latest values.
 *  - async mode: the values replace the parameters at once.
 * Returns 0; PS_ESTATE from a worker that is not the chief (nothing is
 * sent); PS_EUNSUPPORTED if a server speaks only protocol 2.0; PS_ESTALE
 * when a slice is already past `step` (with backup workers the others can
 * complete a step without the chief: the other slices did take the
 * values, so assign again at the step ps_client_pull returns), PS_EINVAL
 * for a step a slice has not reached, PS_ESTATE for a variable that is
 * not initialized; the message names the variable and both steps. */
PS_EXTERN int ps_client_var_assign(ps_client *c, ps_var *const *vars, size_t n, uint64_t step);

/* The variable this client created under `name` (owned by c), or NULL
 * (no such variable, or c or name NULL; the error message says which). */
PS_EXTERN ps_var *ps_client_var_find(ps_client *c, const char *name);

/* The step the last successful ps_client_step set *step to, or the last
 * successful ps_client_pull set *step_out to; 0 before either (and for a
 * NULL client). In async mode it is the worker's own count of pushes (see
 * ps_client_step). Never waits, never fails. */
PS_EXTERN uint64_t ps_client_step_current(const ps_client *c);

/* The step of the stop checkpoint once ps_client_step (or ps_client_pull)
 * returned PS_ESTOPPED: the step the next run resumes from, the same in
 * every worker, whichever step each one's last successful call returned
 * (training goes on while the servers write the file, and a worker whose
 * pull of that step raced the stop has the one before). 0 before then (and for a NULL client). A worker that keeps
 * state of its own (a data loader's position) saves it for this step.
 * Never waits, never fails. Added in 0.2.5. */
PS_EXTERN uint64_t ps_client_stop_step(const ps_client *c);

/* Pushes the gradients of vars[0..n) (all trainable variables when vars is
 * NULL), computed from parameters at `step`, to every ps concurrently. *out
 * is a request to wait on. Returns 0 or a negative code (nothing was sent);
 * listing a variable that is not trainable (PS_OPT_NONE) is PS_EINVAL. */
PS_EXTERN int ps_client_push_async(ps_client *c, uint64_t step, ps_var *const *vars,
                                   size_t n, ps_req **out);

/* Asks every ps for the parameters of vars (all when NULL) at a step >=
 * min_step; the values land in ps_var_data() as they arrive. With vars
 * NULL, the variables that are not trainable are asked for at their
 * latest values (min_step 0): their step counts the chief's assigns, not
 * training steps (ps_client_var_assign); list them to wait for a step. */
PS_EXTERN int ps_client_pull_async(ps_client *c, uint64_t min_step, ps_var *const *vars,
                                   size_t n, ps_req **out);

/* Waits for r (up to timeout_ms; < 0: the client's request timeout) while
 * driving all of c's I/O. Returns 0, or the request's error: a push whose
 * gradient came too late returns PS_ESTALE (not fatal: pull and go on);
 * one a server already had from this worker for that step returns
 * PS_EDUPLICATE (not fatal either: the server has the gradient; this takes
 * precedence over PS_ESTALE); a refused push returns the server's code
 * with its sentence in ps_client_errmsg.
 * On success *step_out (may be NULL) gets, for a pull, the smallest step
 * among the slices of trainable variables received (of the others when
 * it named none; for a table pull, among the servers asked). r stays valid
 * until ps_req_destroy(). */
PS_EXTERN int ps_req_wait(ps_req *r, int timeout_ms, uint64_t *step_out);

/* Makes a ps_req_wait with timeout_ms >= 0 that another thread is in on c
 * (or the next one) return PS_ETIMEDOUT at once, its request still in
 * flight: a thread that waits on requests in short polls can block in
 * long ones and still take new work as soon as it comes. The one call
 * that is safe from another thread or a signal handler while c is in use;
 * waits with timeout_ms < 0 and the library's blocking calls are never
 * ended by it. 0, or PS_EINVAL (NULL, or no eventfd could be made). Added
 * in 0.2.5. */
PS_EXTERN int ps_client_wake(ps_client *c);

/* Releases a finished request (waiting first if it is still in flight, so
 * that no buffer is still in use). NULL is a no-op. */
PS_EXTERN void ps_req_destroy(ps_req *r);

/* One synchronous training step for every variable and table: pushes the
 * gradients of the trainable variables computed at *step, and every
 * table's gradients added with ps_table_add_grad (to every ps, possibly
 * none: the push counts toward the table's step), pulls the parameters of
 * the next step (and the latest values of the variables that are not
 * trainable), waits until every table has reached it too (the tables'
 * rows are not pulled: ps_table_pull the keys of the next batch), and
 * sets *step to the smallest step received among variables and tables. A
 * client may have tables and no variables. A stale push is not an error here: the
 * client skips ahead to the servers' step (*stale_out, if not NULL, is set
 * to 1 when it happened, else 0). Nor is a duplicate push (PS_EDUPLICATE
 * from a server: it already has this worker's gradient for that step, as
 * when a restarted worker pushes the step its predecessor pushed before it
 * died): that gradient counts as applied, the pull still happens and *step
 * advances as usual. A push a server refuses (a step it has not reached,
 * an uninitialized variable) fails the call as soon as the refusal comes,
 * without waiting for the pull, with PS_EINVAL or PS_ESTATE and the
 * server's own sentence in ps_client_errmsg (naming the server and the
 * variable). The chief (worker 0) also arranges the
 * checkpoints the servers ask for here. Returns 0, PS_ESTOPPED when the
 * job stops on request (see ps_client_request_stop), or another PS_E*; on
 * any error *step and *stale_out keep their values.
 * Async mode (ps_config.async_mode): each gradient is applied on its own
 * as it arrives, and a slice's step counts the updates from every worker.
 * *step is then this worker's own count of successful ps_client_step
 * calls (the value given plus one), not the servers' step, and the pull
 * returns the latest parameters without waiting. */
PS_EXTERN int ps_client_step(ps_client *c, uint64_t *step, int *stale_out);

/* Sends the gradients of vars[0..n) (trainable variables, each at most
 * once per step) computed at `step` now, as part of the coming
 * ps_client_step(c, &step, ...): that call then pushes only the trainable
 * variables not sent this way, and waits for these pushes with its own. A
 * framework calls it as its backward pass finishes a group of gradients,
 * so the push of the last layers overlaps the backward of the first; the
 * gradients must not change until ps_client_step returns. Does not wait.
 * Returns 0, or PS_EINVAL (a variable listed twice in the step, not
 * trainable or of another client, or a step different from the earlier
 * calls': the message says which) and nothing is sent. If ps_client_step
 * then gets a different step it fails with PS_EINVAL, and the pushes
 * already sent are forgotten (the servers treat them as any push of that
 * step). Added in 0.2.3. */
PS_EXTERN int ps_client_step_push(ps_client *c, uint64_t step, ps_var *const *vars, size_t n);

/* Pulls every variable at step >= min_step (blocking; the variables that
 * are not trainable at their latest values) and waits for every table to
 * reach it; on success *step_out (may be NULL) gets the step received, the
 * smallest among variables and tables. Used to start or resume:
 * ps_client_pull(c, 0, &s). */
PS_EXTERN int ps_client_pull(ps_client *c, uint64_t min_step, uint64_t *step_out);

/* Reads the moving averages the servers keep of vars[0..n) (each created
 * with ps_optimizer.average set) into out[i], numel floats each, for
 * evaluation; the variables' own data (ps_var_data) is not touched, so the
 * next ps_client_step computes on the parameters as before. Blocking: the
 * servers answer at once with the averages as they are now (no step is
 * waited for), in float32 whatever the variables' wire dtype; *step_out
 * (may be NULL) gets the smallest step among the slices, the number of
 * updates the averages include. Nothing else changes: the client's step
 * (ps_client_step_current) stays. Returns 0; PS_EINVAL for a variable
 * without an average, a NULL buffer, or n 0; PS_ESTATE while another
 * request of this client is in flight (its replies would land in out);
 * PS_EUNSUPPORTED if a server speaks a protocol older than 2.7; or a
 * server's refusal (a variable not yet initialized). Added in 0.2.7. */
PS_EXTERN int ps_client_pull_average(ps_client *c, ps_var *const *vars, size_t n,
                                     float *const *out, uint64_t *step_out);

/* Tells every server this worker is done; they exit when all are. */
PS_EXTERN int ps_client_finish(ps_client *c);

/* Signals. Unless ps_config.no_signal_handlers is set (PS_SIGNALS=0),
 * ps_client_create installs a handler for SIGTERM and for SIGUSR1 (each one
 * that is still at its default action: a handler the application installed
 * before, or SIG_IGN, is left as it is), shared by every client of the
 * process. The handler only sets a flag; the next ps_client_step of each
 * client then behaves as if ps_client_request_stop had been called, so a
 * worker with no handler of its own stops after a checkpoint on Slurm's
 * preemption or walltime signal and gets PS_ESTOPPED, instead of being
 * killed with nothing saved. A second such signal while stopping puts the
 * default action back, so the one after it kills the process (a launcher
 * that repeats its signal once does not). The last ps_client_destroy
 * restores the previous actions. With the handlers, a worker that blocks
 * outside ps_client_step for long only notices the signal at its next
 * step.
 *
 * Asks the job to stop after a checkpoint (preemption, walltime). Only sets
 * a flag, so it is safe to call from a signal handler (SIGTERM, SIGUSR1).
 * When the servers keep checkpoints (psd --checkpoint-dir), the chief and
 * the servers agree on a step, every server writes its checkpoint there,
 * and ps_client_step then returns PS_ESTOPPED in every worker once every
 * server has written its file; otherwise ps_client_step returns
 * PS_ESHUTDOWN at once (nothing could be saved). A worker seeing PS_ESTOPPED
 * calls ps_client_finish and exits (the examples use status 75); running
 * the job again resumes from the checkpoint. psd exits 75 only once it has
 * written its file of the stop step, and 69 for a stop that saved nothing
 * (no --checkpoint-dir, the chief gone first, the stop timeout). Servers that get the signal
 * themselves start the same protocol. NULL is a no-op. */
PS_EXTERN void ps_client_request_stop(ps_client *c);

/* ---------------------------------------------------------------------- */
/* Sparse embedding tables (protocol 2.2).
 *
 * A table maps uint64 keys (any value: hashed ids, feature crosses) to rows
 * of `dim` floats. Rows live only on the servers, spread over every ps by a
 * hash of the key (ps__table_shard in docs/protocol.md), and a step moves
 * only the rows a batch touches. A key never stored reads as its
 * initializer's values, drawn from (init.seed, table name, key), so it does
 * not matter which worker touches a key first. The optimizer runs per row
 * on the servers, its state stored beside the row.
 *
 * Sync semantics are the dense ones, per table and ps: a worker's push for
 * step s counts once toward replicas_to_aggregate; when they are in, each
 * row's gradient is the sum over the pushes divided by the number of
 * pushes aggregated (2 workers x b equals 1 worker x 2b), the optimizer
 * runs on every touched row and the table's step becomes s + 1. Stale and
 * duplicate pushes are handled as for variables (PS_ESTALE, PS_EDUPLICATE);
 * async mode applies each push at once.
 *
 * Memory is bounded: `capacity` rows in the whole table (each ps holds at
 * most ceil(capacity / num_ps)), reserved against psd --max-memory when the
 * table is created. A key becomes a stored row when admitted (admit_count,
 * admit_prob); past capacity the least recently used row is evicted, and
 * rows untouched for evict_after_steps steps are evicted too. A gradient
 * for a key with no stored row is dropped (counted, TablePushReply.dropped).
 */

typedef struct ps_table ps_table; /* a table, owned by its client */

typedef struct ps_table_config {
  size_t struct_size;         /* sizeof(ps_table_config) as compiled by the
                                 caller (ps_table_config_init sets it) */
  uint32_t dim;               /* floats per row, 1..65536 */
  uint64_t capacity;          /* most rows the whole table holds, > 0 */
  ps_init init;               /* rows never stored: PS_INIT_ZEROS, CONSTANT,
                                 UNIFORM, NORMAL or TRUNCATED_NORMAL (no
                                 Glorot: a row has no fans); init.seed with
                                 the table name and the key seed each row */
  ps_table_opt opt;           /* update rule */
  double lr;                  /* learning rate, > 0 (the base of the schedule
                                 below, if any) */
  double initial_accumulator; /* PS_TOPT_ADAGRAD: default 0.1 */
  double beta1;               /* PS_TOPT_ADAM: default 0.9 */
  double beta2;               /* PS_TOPT_ADAM: default 0.999 */
  double epsilon;             /* PS_TOPT_ADAM, PS_TOPT_ADAGRAD: > 0; 0 (what
                                 ps_table_config_init sets) takes the rule's
                                 default: 1e-8 Adam, 1e-7 Adagrad */
  double l1;                  /* PS_TOPT_FTRL: L1 strength, >= 0 */
  double l2;                  /* PS_TOPT_FTRL: L2 strength, >= 0 */
  double ftrl_beta;           /* PS_TOPT_FTRL: beta of the per-element rate,
                                 default 1 */
  uint32_t admit_count;       /* a key is stored once it has been seen (pulled
                                 without PS_TABLE_READ_ONLY) this many times,
                                 at most 255; 0 or 1 (the same table): at its
                                 first sighting. Counted in a
                                 count-min sketch, so a key may be admitted a
                                 little early, never late */
  double admit_prob;          /* instead, admit with this probability at each
                                 sighting, in (0, 1]; 0: use admit_count */
  uint64_t evict_after_steps; /* T: a row last touched (pulled, or updated) at
                                 step s is evicted when the table reaches
                                 step s + T + 1; 0: never */
  /* Added in 0.2.8 (protocol 2.8; a program built before it gets 0: a
   * constant lr). The learning-rate schedule of ps_optimizer, over the
   * table's step (the update that completes step s runs at lr_s): the same
   * fields, meanings and checks. Not with PS_TOPT_FTRL, whose rate is per
   * element. A server older than 2.8 refuses a table that sets one
   * (PS_EUNSUPPORTED naming it). */
  ps_lr_decay decay;          /* PS_DECAY_NONE (default), _EXPONENTIAL,
                                 _STEP or _COSINE */
  double decay_rate;          /* _EXPONENTIAL, _STEP: factor per decay_steps */
  uint64_t decay_steps;       /* _EXPONENTIAL, _STEP: > 0 */
  uint64_t warmup_steps;      /* linear warm-up over the first steps; 0: none */
  uint64_t total_steps;       /* _COSINE: where lr * min_lr_factor is reached */
  double min_lr_factor;       /* _COSINE: in [0, 1] */
} ps_table_config;

/* Fills *cfg (size bytes): dim 0 and capacity 0 (the caller must set
 * both), zeros init (init.struct_size set: replace init only by a ps_init
 * made with ps_init_init or PS_SIZED), SGD at lr 0.01 and the other
 * defaults above. Call it through ps_table_config_init, which passes the
 * size. */
PS_EXTERN void ps_table_config_init_sized(ps_table_config *cfg, size_t size);
static inline void ps_table_config_init(ps_table_config *cfg) {
  ps_table_config_init_sized(cfg, sizeof *cfg);
}

/* Creates table `name` on every ps (each holds its share of the rows), or
 * attaches to it if it exists with the same configuration (a different one
 * is PS_EMISMATCH naming the field and both values). Names share no space
 * with variables. Creating a name this client already created returns the
 * same handle when the configuration is the same (compared as the servers
 * compare: only the fields the rule and the initializer use), without any
 * I/O, and is PS_EMISMATCH naming the field and both values otherwise.
 * The configuration is checked before anything is sent: a bad field is
 * PS_EINVAL naming it (dim 1..65536, capacity > 0, lr and epsilon in
 * [FLT_MIN, FLT_MAX], no Glorot init, admit_prob in [0, 1], no NaN).
 * Needs servers of protocol
 * 2.2 (else PS_EUNSUPPORTED naming the server). A capacity the servers'
 * --max-memory cannot hold is PS_ENOMEM with the server's sentence.
 * Servers with --checkpoint-dir keep tables in their checkpoints: a
 * resumed job's servers fill the table from the checkpoint (its rows,
 * admission state and step), and a configuration that differs from the
 * checkpoint's (or a table it does not hold) is PS_EMISMATCH naming the
 * field. Blocking. */
PS_EXTERN int ps_client_table_create(ps_client *c, const char *name,
                                     const ps_table_config *cfg, ps_table **out);

/* The table this client created under `name`, or NULL (the error
 * message says so). */
PS_EXTERN ps_table *ps_client_table_find(ps_client *c, const char *name);
PS_EXTERN const char *ps_table_name(const ps_table *t);
PS_EXTERN uint32_t ps_table_dim(const ps_table *t);

/* Pull flag: keys with no stored row read as their initializer's values
 * and are neither created nor counted as sightings (evaluation, serving). */
#define PS_TABLE_READ_ONLY 1u

/* Asks for the rows of keys[0..n) (any order, duplicates allowed) at a
 * step >= min_step (sync mode: the call waits for the table there; async:
 * the latest rows). out must hold n * dim floats: row i is at
 * out + i * dim when the request completes (ps_req_wait), in the caller's
 * order; until it completes, fails or is released, out may be written at
 * any time the client runs. The library sorts and de-duplicates the keys and sends each ps
 * only its own. Keys with no stored row are created on the way (subject to
 * admission) unless flags has PS_TABLE_READ_ONLY. out and keys must stay
 * valid until the request completes (keys only until this call returns).
 * On success ps_req_wait's step_out gets the smallest table step among the
 * servers asked. The rows arrive in a buffer of the request (distinct keys
 * x dim floats, plus 8 bytes per key and per distinct key), freed with
 * it, or straight into out when the keys are distinct and in the order
 * the servers send them (ascending, on one ps: torch.unique's output);
 * a ps's keys beyond one frame (2^22 keys, or 1 GiB of rows) go out
 * in several frames, each after the previous one's rows.
 * n == 0 (keys and out may be NULL) asks every ps for the
 * table's step only: it waits for min_step there (sync mode).
 * A server keeps one waiting pull per table and connection: a later pull
 * of the same table with a min_step it has not reached replaces one still
 * waiting, which fails at once with PS_EBUSY (ps_client_step's own pull
 * counts, so the pull a failed step left waiting never blocks the next).
 * A server's error (PS_ETIMEDOUT, PS_EBUSY, PS_ENOMEM...) fails the request
 * with the server's sentence in ps_client_errmsg; out is then left as it
 * was, but for the rows that arrived straight into it before the error (a
 * pull that fails or times out may leave some rows there).
 * Releasing the request before it completes is safe: rows still
 * arriving are discarded. */
PS_EXTERN int ps_table_pull_async(ps_table *t, uint64_t min_step, const uint64_t *keys,
                                  size_t n, float *out, unsigned flags, ps_req **req);
/* The same, waiting for it (the client's request timeout); *step_out (may
 * be NULL) gets the step received. */
PS_EXTERN int ps_table_pull(ps_table *t, uint64_t min_step, const uint64_t *keys, size_t n,
                            float *out, unsigned flags, uint64_t *step_out);

/* Adds gradients for the next ps_client_step, which pushes every table's
 * gradients with the dense ones (a table with none added still counts:
 * an empty push, so the step completes). grads holds n * dim floats, row i
 * for keys[i]; duplicate keys (in one call or across calls of one step)
 * are summed (in the order added). Copies what it is given. Returns 0,
 * PS_EINVAL or PS_ENOMEM. A ps_client_step that fails before its push is
 * sent keeps the staged gradients for the next one; once sent, they are
 * cleared. */
PS_EXTERN int ps_table_add_grad(ps_table *t, const uint64_t *keys, size_t n,
                                const float *grads);

/* Pushes gradients for keys[0..n) computed at `step` now, to every ps
 * (each gets its keys, possibly none: the push still counts for the
 * step), without ps_client_step: for training loops of their own. Do not
 * also add gradients of that step with ps_table_add_grad. Duplicates are
 * summed (in the caller's order); keys and grads are copied before the
 * call returns. One ps's distinct keys must fit one frame (at most 2^22
 * keys and 256 MiB of keys and gradients), else PS_ETOOBIG and nothing is
 * sent. ps_req_wait returns as for a variable's push (PS_ESTALE,
 * PS_EDUPLICATE, a refusal with the server's sentence). A gradient that
 * is NaN or infinite makes a server refuse that ps's push whole
 * (PS_EINVAL naming the key): nothing of it is applied. */
PS_EXTERN int ps_table_push_async(ps_table *t, uint64_t step, const uint64_t *keys,
                                  size_t n, const float *grads, ps_req **req);

#ifdef __cplusplus
}
#endif
#endif /* PSCLIENT_H */
