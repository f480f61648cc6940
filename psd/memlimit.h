/*
 * memlimit.h - how much memory this process may use: physical RAM, and the
 * memory limit of its cgroup (Slurm's --mem, a container's limit), so that
 * psd's --max-memory default refuses registrations cleanly instead of the
 * OOM killer taking the job.
 */
#ifndef PSD_MEMLIMIT_H
#define PSD_MEMLIMIT_H

#include <stddef.h>
#include <stdint.h>

/* The smallest memory limit among the process's cgroup and its ancestors:
 * cgroup v2 memory.max, or v1 memory.limit_in_bytes of the memory
 * controller. root is prepended to /proc/self/cgroup and /sys/fs/cgroup
 * ("" or NULL: the real ones; tests pass a directory of fake files).
 * Returns the limit in bytes, or UINT64_MAX when none applies ("max", an
 * absurdly large value, no cgroup file); where gets the file that set it. */
uint64_t psd_memlimit_cgroup(const char *root, char *where, size_t wherelen);

/* Physical RAM in bytes (UINT64_MAX if unknown). */
uint64_t psd_memlimit_phys(void);

#endif
