/* task0.h - psrun task 0 of a Slurm step: the rendezvous hub. */
#ifndef PSRUN_TASK0_H
#define PSRUN_TASK0_H

#include <stddef.h>

#include "step.h"

/* Listens where the other tasks look, takes their check-ins, assigns the
 * roles, collects the psd addresses and hands them to the workers, then
 * supervises its own child and every task. Returns the step's exit status,
 * or -1 with err (everything it opened is closed). */
int psr_run_task0(psr_step *s, char *err, size_t errlen);

#endif
