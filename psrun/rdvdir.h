/* rdvdir.h - separate ps and worker steps meeting in a rendezvous
 * directory (--role=ps / --role=worker, --rendezvous DIR). */
#ifndef PSRUN_RDVDIR_H
#define PSRUN_RDVDIR_H

#include <stddef.h>

#include "step.h"

/* `srun -n P psrun --role=ps`: every task is a ps; addresses go to files.
 * Returns the exit status, or -1 with err. */
int psr_run_ps_step(psr_step *s, char *err, size_t errlen);
/* `srun -n W psrun --role=worker CMD`: every task is a worker of a ps step
 * started earlier in the job. Returns the exit status, or -1 with err. */
int psr_run_worker_step(psr_step *s, char *err, size_t errlen);

#endif
