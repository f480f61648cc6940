/*
 * pending.h - psrun task 0's connections that have not checked in yet
 * (Slurm mode's rendezvous). Each is accepted, greeted with RDV and given
 * PSR_CHECKIN_LINE_S to send its check-in line; all are served at once
 * (poll). At most PSR_PENDING_MAX wait: a new connection beyond that sheds
 * the oldest silent one, so a flood of silent connections can delay a
 * member only by what its own line takes, never lock it out (and a member
 * whose connection was shed checks in again: slurm.c). A verified member
 * leaves this set for task 0's peers, which nothing sheds. The lines
 * strangers can cause (dropped, shed, refused) are rate-limited per kind.
 */
#ifndef PSRUN_PENDING_H
#define PSRUN_PENDING_H

#include <stdint.h>

#include "ratelog.h"
#include "rendezvous.h"

/* A connection has this long to send its check-in line after it is
 * accepted; a silent one is dropped then, without delaying the others. */
#define PSR_CHECKIN_LINE_S 10.0
/* Connections waiting for their check-in line at once: a flood cannot
 * grow task 0 without bound, and a member's line (one round trip after
 * RDV) comes long before this many newer connections push it out. */
#define PSR_PENDING_MAX 1024
/* Connections accepted per pass of the check-in loop: a flood waiting in
 * the listen backlog drains fast, and lines already sent are read between
 * batches, before the next batch could shed their connections. */
#define PSR_ACCEPT_BATCH 64
/* Lines of each kind strangers can cause, per window: the first shows an
 * address, then one "suppressed K similar messages" line per window. */
#define PSR_PLOG_BURST 1u
#define PSR_PLOG_WINDOW_S 5.0

typedef struct psr_pending_conn {
  psr_conn c;          /* its connection (fd -1 once handed on) */
  char addr[64];       /* "ip:port", for sentences */
  double opened;       /* ps__now() seconds when it was accepted */
  double deadline;     /* ... and when it is dropped if still silent */
  uint64_t seq;        /* accept order: the smallest is shed first */
  short ready;         /* poll's revents for it, from the last psr_pending_poll */
} psr_pending_conn;

/* What strangers can make task 0 log, each rate-limited. */
enum { PSR_PLOG_SILENT, PSR_PLOG_SHED, PSR_PLOG_REFUSED, PSR_PLOG_KINDS_ };

typedef struct psr_pending {
  psr_pending_conn *v;     /* PSR_PENDING_MAX slots, the first n in use */
  int n;
  uint64_t seq;            /* connections accepted so far */
  struct pollfd *pf;       /* poll set: the listener, then v[0..n) */
  ps__ratelog log[PSR_PLOG_KINDS_];
} psr_pending;

/* 0, or -1 (out of memory). */
int psr_pending_init(psr_pending *p);
/* Closes every connection still pending and prints the pending summaries. */
void psr_pending_free(psr_pending *p);
/* Waits until lfd or a pending connection is readable, a connection's
 * deadline passes, or until (ps__now() seconds). Sets each connection's
 * `ready`; returns 1 when lfd has connections to accept. */
int psr_pending_poll(psr_pending *p, int lfd, double until);
/* 1 when connection i has input, or its deadline has passed. */
int psr_pending_due(const psr_pending *p, int i, double now);
/* Accepts up to PSR_ACCEPT_BATCH connections from lfd (a non-blocking
 * listener; the connections are blocking), each greeted with `greeting`,
 * shedding the oldest when PSR_PENDING_MAX wait. */
void psr_pending_accept(psr_pending *p, int lfd, const psr_msg *greeting);
/* Connection i's line if one is buffered or readable now (malloc'd); NULL
 * with *eof on EOF or error, NULL without when nothing came yet. */
char *psr_pending_line(psr_pending *p, int i, int *eof);
/* Connection i sent nothing within its deadline: logged (rate-limited). */
void psr_pending_silent(psr_pending *p, int i, double now);
/* Refuses connection i's check-in: REJECT why, logged with its address
 * (rate-limited). */
void psr_pending_refuse(psr_pending *p, int i, const char *why);
/* Removes connection i (closed unless it was handed on: c.fd -1); the last
 * one takes its place. */
void psr_pending_drop(psr_pending *p, int i);

#endif
