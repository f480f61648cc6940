/*
 * ps/export.h - the bottom of the public headers (libuv's uv/ layout):
 * PS_EXTERN, which marks what libpsclient exports, and PS_SIZED, which
 * fills a sized struct. psclient.h and the other ps/ headers include it;
 * psd, psrun and the wire layer include the ps/ headers they need, never
 * psclient.h (tests/structure_test.py checks it).
 */
#ifndef PS_EXPORT_H
#define PS_EXPORT_H


/* Marks the public API: the library is built with -fvisibility=hidden,
 * so only these declarations are exported. */
#if defined(__GNUC__) || defined(__clang__)
#define PS_EXTERN __attribute__((visibility("default")))
#else
#define PS_EXTERN
#endif

/* An initializer for a sized struct: the size, then the fields given
 * (designated, or in order after struct_size). Example:
 *   ps_init init = PS_SIZED(ps_init, .kind = PS_INIT_UNIFORM, .a = -1, .b = 1); */
#define PS_SIZED(type, ...) { .struct_size = sizeof(type), __VA_ARGS__ }

#endif /* PS_EXPORT_H */
