/*
 * replies.h - answering parked pulls: the PullReply of each connection's
 * ready waiters (float32 through the worker's pull ring when it has room,
 * else from the slices in place over TCP; 16-bit encoded into the output
 * queue), a pull of moving averages (2.7), and a waiter's timeout. It works
 * on the message layer's pieces (handlers.h) and never calls into
 * handlers.c: handlers.c and the event loop (server.c) call in here.
 */
#ifndef PSD_REPLIES_H
#define PSD_REPLIES_H

#include "handlers.h"

/* Builds and queues the replies of every connection with ready pulls. */
void psd_replies_flush(psd_handlers *h);
/* Answers a Pull with `average` set (2.7), whose slice ids handle_pull
 * checked: each slice's moving average, at once and whatever min_step, or
 * a non-fatal Error (no average, not initialized, --protocol-minor < 7).
 * 0, or -1 when c failed (out of memory). */
int psd_replies_pull_average(psd_handlers *h, psd_conn *c, const Ps__Pull *m);
/* psd_waiters_expire callback (ctx: the psd_handlers): tells the owner of
 * set that w's request timed out. */
void psd_replies_pull_expired(void *ctx, psd_waitset *set, const psd_waiter *w);

#endif
