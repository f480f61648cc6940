/* rdvdir.h - separate ps and worker steps meeting in a rendezvous
 * directory (--role=ps / --role=worker, --rendezvous DIR). */
#ifndef PSRUN_RDVDIR_H
#define PSRUN_RDVDIR_H

#include <stddef.h>

#include <stdint.h>

#include "rdvauth.h"
#include "step.h"

/* The job's rendezvous directory, BASE/.psrun-JOB.RESTART (BASE:
 * --rendezvous, else SLURM_SUBMIT_DIR), created 0700; refused when
 * another user owns it or can write it, or when others can write BASE
 * without its sticky bit. 0 or -1 with a sentence in err. */
int psr_rdv_dir(const psr_opts *o, const psr_env *e, char *out, size_t len, char *err,
                size_t errlen);
/* The key mode's key, in DIR/key.STEP (mode 0600, written atomically). */
int psr_rdv_key_write(const char *dir, long long step, const uint8_t key[PSR_KEY_BYTES],
                      char *err, size_t errlen);
/* Waits (until deadline) for that file, from our uid and private. 0 or -1. */
int psr_rdv_key_read(const char *dir, long long step, uint8_t key[PSR_KEY_BYTES],
                     double deadline, char *err, size_t errlen);
void psr_rdv_key_remove(const char *dir, long long step);

/* psrun --local: the job's secret for psctl, in a 0600 file in a 0700
 * directory of ours ($XDG_RUNTIME_DIR or /tmp, then psrun-UID); its path to
 * path. The caller removes it when the job ends. 0 or -1 with err. */
int psr_admin_cred_write(const char *secret, char *path, size_t len, char *err, size_t errlen);

/* `srun -n P psrun --role=ps`: every task is a ps; addresses go to files.
 * Returns the exit status, or -1 with err. */
int psr_run_ps_step(psr_step *s, char *err, size_t errlen);
/* `srun -n W psrun --role=worker CMD`: every task is a worker of a ps step
 * started earlier in the job. Returns the exit status, or -1 with err. */
int psr_run_worker_step(psr_step *s, char *err, size_t errlen);

#endif
