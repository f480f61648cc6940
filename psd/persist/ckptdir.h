/*
 * ckptdir.h - the checkpoint directory as a trusted place: opened once
 * (O_DIRECTORY|O_NOFOLLOW) and checked to be ours and writable by nobody
 * else, locked by the job using it, holding the MAC key and the run id.
 * Every later file operation is relative to the verified fd (*at() calls),
 * so a path component swapped after the check cannot redirect a write.
 * docs/checkpoint.md "Directory rules" explains the threat model.
 */
#ifndef PSD_CKPTDIR_H
#define PSD_CKPTDIR_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

/* Longest checkpoint directory path accepted (the file names go under it). */
#define PSD_CKPT_PATH_MAX 900
/* MAC key bytes in DIR/.psd-key: HMAC-SHA-256's block-size-safe 256 bits. */
#define PSD_CKPT_KEY_BYTES 32
/* Run id bytes: 128 random bits, so two runs never share one by chance. */
#define PSD_CKPT_RUN_BYTES 16

/* Who uses the directory: written into the lock file so a second job's
 * error can name the holder. */
typedef struct psd_ckptdir_holder {
  long long job_id; /* --job-id (-1: none given) */
  int ps_index;     /* this ps task's index */
  int num_ps;       /* ps tasks in the job */
} psd_ckptdir_holder;

/* An open, verified (and, once psd_ckptdir_open returned, locked)
 * checkpoint directory. */
typedef struct psd_ckptdir {
  int fd;                                 /* the directory (-1: closed) */
  int lock_fd;                            /* .lock-ps-<i>, flock'd for psd's life (-1: none) */
  char path[PSD_CKPT_PATH_MAX + 1];       /* as given: for messages only */
  uint8_t key[PSD_CKPT_KEY_BYTES];        /* MAC key (from .psd-key) */
  uint8_t run_id[PSD_CKPT_RUN_BYTES];     /* this run's id (from run-id) */
  char run_hex[2 * PSD_CKPT_RUN_BYTES + 1]; /* run_id in hex */
} psd_ckptdir;

/* 0 if st (of `path`, `what` e.g. "checkpoint directory") is a directory
 * owned by this user that neither its group nor others can write; else -1
 * with a sentence naming the path, its owner and mode. */
int psd_ckptdir_check(const struct stat *st, const char *what, const char *path, char *err,
                      size_t errlen);

/* Opens (creating it 0700 if missing) and verifies the directory, takes
 * this ps's lock, loads or creates the MAC key and the run id. With
 * `fresh` (--restore=none), checkpoints of an earlier run are moved into
 * previous-<run id>/ and a new run id is drawn; `moved` then gets a
 * sentence saying where ("" if nothing moved). 0, or -1 with a sentence in
 * err (d is then closed). */
int psd_ckptdir_open(psd_ckptdir *d, const char *path, const psd_ckptdir_holder *h, int fresh,
                     char *moved, size_t movedlen, char *err, size_t errlen);
/* Releases the lock and closes. Safe on a closed or zeroed-then-closed d. */
void psd_ckptdir_close(psd_ckptdir *d);
/* A closed directory (fd and lock_fd -1). */
void psd_ckptdir_init(psd_ckptdir *d);

/* Opens DIR/name as a verified subdirectory, creating it 0700 first when
 * `create`. Its fd, -2 when it does not exist (and !create), or -1 with err. */
int psd_ckptdir_subdir(const psd_ckptdir *d, const char *name, int create, char *err,
                       size_t errlen);

/* Removes dfd/name if it is a leftover of ours (any type but a directory:
 * a symlink is removed itself, never followed). 0 when it is gone or never
 * was, -1 with err when it belongs to someone else (then it is left). */
int psd_ckptdir_unlink_own(int dfd, const char *name, const char *label, char *err,
                           size_t errlen);

#endif
