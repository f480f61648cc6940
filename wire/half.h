/*
 * half.h - the 16-bit wire encodings of float32 tensors (protocol 2.3):
 * bfloat16 and IEEE binary16 (fp16). Both sides keep float32 values; a
 * push or pull may carry them as 16-bit (Item.dtype, Pull.dtype), halving
 * the bytes on the wire. Conversion is vectorized (AVX-512F, or AVX2 with
 * F16C) behind a runtime check, with portable code otherwise; every path
 * gives the same bits (tests/test_half.c). Internal (ps__).
 */
#ifndef PS_WIRE_HALF_H
#define PS_WIRE_HALF_H

#include <stddef.h>
#include <stdint.h>

/* Wire dtypes: the values of Item.dtype and Pull.dtype, and of the public
 * ps_wire_dtype (psclient.h). */
enum {
  PS__DT_F32 = 0,  /* float32, 4 bytes (the default: absent field) */
  PS__DT_BF16 = 1, /* bfloat16, 2 bytes: float32's upper half, rounded */
  PS__DT_FP16 = 2, /* IEEE binary16, 2 bytes */
  PS__DT_COUNT_ = 3
};

/* 1 if dt is a wire dtype this side knows. */
static inline int ps__dtype_valid(uint32_t dt) { return dt < PS__DT_COUNT_; }
/* Bytes per element of a valid dtype. */
static inline unsigned ps__dtype_size(uint32_t dt) { return dt == PS__DT_F32 ? 4u : 2u; }
/* "float32", "bfloat16", "fp16" (or "unknown"). */
const char *ps__dtype_name(uint32_t dt);

/* One value, portable code (the reference the vector paths match).
 * float32 -> 16 bits rounds to nearest, ties to even; a NaN stays a NaN of
 * the same sign with its payload's top bits, made quiet (as x86's own
 * conversions do); fp16 overflows to infinity and keeps subnormals. */
uint16_t ps__f32_to_bf16(float f);
float ps__bf16_to_f32(uint16_t h);
uint16_t ps__f32_to_fp16(float f);
float ps__fp16_to_f32(uint16_t h); /* a signalling NaN comes back quiet */

/* n values of src (float32) into dst in dtype dt (PS__DT_F32: a copy). */
void ps__wire_encode(uint32_t dt, void *dst, const float *src, size_t n);
/* n values of src in dtype dt into dst (float32). */
void ps__wire_decode(uint32_t dt, float *dst, const void *src, size_t n);

/* Code paths of the bulk conversions. */
enum {
  PS__HALF_PORTABLE = 0, /* plain C, any CPU */
  PS__HALF_AVX2 = 1,     /* x86-64 AVX2 + F16C: 8 or 16 values an instruction */
  PS__HALF_AVX512 = 2,   /* x86-64 AVX-512F: 16 values an instruction */
  PS__HALF_PATHS_ = 3
};
/* The path in use (the best this CPU has, unless forced). */
int ps__half_path(void);
/* 1 if this CPU (and build) can run path p. */
int ps__half_path_available(int p);
/* Tests: use path p from now on. 0, or -1 if it is not available. */
int ps__half_force_path(int p);
/* "portable", "avx2+f16c", "avx512f". */
const char *ps__half_path_name(int p);

#endif /* PS_WIRE_HALF_H */
