/*
 * wfile.h - every file psd, psrun, psctl and libpsclient write is created
 * through here, so a link or file planted by another local user (in /tmp,
 * say) is refused with a sentence, never written through.
 *
 * The rules (docs/security.md, "Output files"):
 *  - the target itself must not be a symbolic link, and if it exists it
 *    must be a regular file of ours with one link (a hard link to a victim
 *    would be truncated through it);
 *  - its directory must be ours or root's; writable by everyone only with
 *    the sticky bit (like /tmp, where others cannot rename our files);
 *  - a symbolic link on the way to that directory is followed only when it
 *    is ours or root's, has one name and sits in a directory of ours or
 *    root's (so nobody else can have planted or hard-linked it there);
 *  - files are created with the mode asked for (0600 unless the docs say
 *    otherwise), whatever the umask.
 * Two ways to write: a whole file (ps__wfile_begin/commit: an O_EXCL
 * temporary with a random name in the same directory, renamed over the
 * target, which replaces a link planted meanwhile instead of following
 * it), and a stream written as it goes (ps__wfile_stream: the target
 * opened O_NOFOLLOW, checked with fstat, then truncated).
 *
 * Errors are sentences "WHAT PATH: what was found; refusing ..." where
 * WHAT is the option or variable that named the file ("--summary",
 * "PS_TELEMETRY"), or "" to start with the path. Internal (ps__ names).
 */
#ifndef PS_WFILE_H
#define PS_WFILE_H

#include <stddef.h>
#include <stdio.h>
#include <sys/types.h>

/* A whole file being written: write to fp, then commit or abort. */
typedef struct ps__wfile {
  FILE *fp;          /* the temporary, open for writing; NULL when closed */
  int dfd;           /* the target's directory (O_PATH) */
  char name[256];    /* the target's name in it */
  char tmp[256];     /* the temporary's name in it */
  char label[1100];  /* "WHAT PATH", for errors */
} ps__wfile;

/* The checks of ps__wfile_begin (directory, links, the target) without
 * writing anything: for an output written only at exit (psd --summary),
 * so a planted link stops the program at start-up. 0, or -1 with err. */
int ps__wfile_check(const char *path, const char *what, char *err, size_t errlen);

/* Creates the temporary for path (mode exactly `mode`). 0, or -1 with err
 * (nothing is left behind). */
int ps__wfile_begin(ps__wfile *w, const char *path, mode_t mode, const char *what, char *err,
                    size_t errlen);
/* The same in an open directory the caller has already checked (dfd is
 * duplicated; name has no '/'): label names the target in errors. */
int ps__wfile_begin_at(ps__wfile *w, int dfd, const char *name, mode_t mode, const char *label,
                       char *err, size_t errlen);
/* Flushes (and with durable, fsyncs the file and then its directory) and
 * renames the temporary over the target. 0, or -1 with err (the
 * temporary removed, the target as it was). */
int ps__wfile_commit(ps__wfile *w, int durable, char *err, size_t errlen);
/* Closes and removes the temporary (nothing when already closed). */
void ps__wfile_abort(ps__wfile *w);

/* begin, one write of len bytes, commit (durable). 0 or -1 with err. */
int ps__wfile_write(const char *path, const void *buf, size_t len, mode_t mode,
                    const char *what, char *err, size_t errlen);
/* The same with begin_at. */
int ps__wfile_write_at(int dfd, const char *name, const void *buf, size_t len, mode_t mode,
                       const char *label, char *err, size_t errlen);

/* Opens path for writing as it goes (telemetry), created or truncated, of
 * mode exactly `mode`. The stream, or NULL with err. */
FILE *ps__wfile_stream(const char *path, mode_t mode, const char *what, char *err,
                       size_t errlen);

#endif /* PS_WFILE_H */
