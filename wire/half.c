/* half.c - float32 <-> bfloat16 / fp16 conversion for the wire (half.h).
 *
 * The vector paths use integer arithmetic for bfloat16 and the CPU's own
 * conversions for fp16 (F16C, AVX-512F), all rounding to nearest even.
 * AVX512_BF16's VCVTNEPS2BF16 is deliberately not used: it flushes
 * subnormal inputs to zero, so it would not give the portable code's bits
 * (the integer rounding it would replace already runs at memory speed).
 * Tails shorter than a vector go through the portable code, which defines
 * the results. */
#include "half.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define PS__HALF_X86 1
#else
#define PS__HALF_X86 0
#endif

const char *ps__dtype_name(uint32_t dt) {
  switch (dt) {
  case PS__DT_F32: return "float32";
  case PS__DT_BF16: return "bfloat16";
  case PS__DT_FP16: return "fp16";
  default: return "unknown";
  }
}

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* ---- portable, one value ------------------------------------------------ */

uint16_t ps__f32_to_bf16(float f) {
  uint32_t x = f2u(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
  /* Round to nearest even on the dropped 16 bits; a carry moves into the
   * exponent (the largest finite values round up to infinity). */
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

float ps__bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* float32 exponent bias minus fp16's (127 - 15), in place. */
#define PS__REBIAS (112u << 23)
/* |f| from which fp16 rounds to infinity: 65504 + half its ulp (65520). */
#define PS__FP16_INF_FROM 0x477ff000u
/* Smallest normal fp16, 2^-14, as float32 bits. */
#define PS__FP16_MIN_NORMAL 0x38800000u
/* 2^-25, half the smallest fp16 subnormal: at or below it rounds to 0. */
#define PS__FP16_HALF_TINY 0x33000000u

uint16_t ps__f32_to_fp16(float f) {
  uint32_t x = f2u(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN */
  if (a >= PS__FP16_INF_FROM) return (uint16_t)(sign | 0x7c00u);
  if (a >= PS__FP16_MIN_NORMAL) {
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u); /* nearest even on 13 bits */
    return (uint16_t)(sign | ((r - PS__REBIAS) >> 13));
  }
  if (a <= PS__FP16_HALF_TINY) return sign;
  /* Subnormal: the value in units of 2^-24, rounded to nearest even (a
   * carry into 0x400 is the smallest normal's encoding). */
  uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - e; /* 14..24 */
  uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return (uint16_t)(sign | q);
}

float ps__fp16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return u2f(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e == 0) {
    if (!m) return u2f(sign);
    uint32_t p = 31u - (uint32_t)__builtin_clz(m); /* leading one: value 1.x * 2^(p-24) */
    return u2f(sign | ((p + 103u) << 23) | ((m << (23u - p)) & 0x7fffffu));
  }
  return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

static void enc_bf16_portable(uint16_t *d, const float *s, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = ps__f32_to_bf16(s[i]);
}
static void dec_bf16_portable(float *d, const uint16_t *s, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = ps__bf16_to_f32(s[i]);
}
static void enc_fp16_portable(uint16_t *d, const float *s, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = ps__f32_to_fp16(s[i]);
}
static void dec_fp16_portable(float *d, const uint16_t *s, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = ps__fp16_to_f32(s[i]);
}

/* ---- x86-64 vector paths ------------------------------------------------- */

#if PS__HALF_X86
#define PS__RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

__attribute__((target("avx2,f16c"))) static __m256i bf16_round8(__m256i x) {
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, absmask), inf);
  __m256i q = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, q, nan);
}

__attribute__((target("avx2,f16c"))) static void enc_bf16_avx2(uint16_t *d, const float *s,
                                                               size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i a = bf16_round8(_mm256_loadu_si256((const __m256i *)(s + i)));
    __m256i b = bf16_round8(_mm256_loadu_si256((const __m256i *)(s + i + 8)));
    /* packus works per 128-bit lane: put the quarters back in order. */
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_storeu_si256((__m256i *)(d + i), p);
  }
  enc_bf16_portable(d + i, s + i, n - i);
}

__attribute__((target("avx2,f16c"))) static void dec_bf16_avx2(float *d, const uint16_t *s,
                                                               size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
    _mm256_storeu_si256((__m256i *)(d + i), _mm256_slli_epi32(w, 16));
  }
  dec_bf16_portable(d + i, s + i, n - i);
}

__attribute__((target("avx2,f16c"))) static void enc_fp16_avx2(uint16_t *d, const float *s,
                                                               size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), PS__RNE));
  enc_fp16_portable(d + i, s + i, n - i);
}

__attribute__((target("avx2,f16c"))) static void dec_fp16_avx2(float *d, const uint16_t *s,
                                                               size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
  dec_fp16_portable(d + i, s + i, n - i);
}

__attribute__((target("avx512f"))) static void enc_bf16_avx512(uint16_t *d, const float *s,
                                                                size_t n) {
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i x = _mm512_loadu_si512((const void *)(s + i));
    __m512i hi = _mm512_srli_epi32(x, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(x, bias), _mm512_and_si512(hi, one)), 16);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(x, absmask), inf);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(hi, quiet));
    _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtepi32_epi16(r));
  }
  enc_bf16_portable(d + i, s + i, n - i);
}

__attribute__((target("avx512f"))) static void dec_bf16_avx512(float *d, const uint16_t *s,
                                                                size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i)));
    _mm512_storeu_si512((void *)(d + i), _mm512_slli_epi32(w, 16));
  }
  dec_bf16_portable(d + i, s + i, n - i);
}

__attribute__((target("avx512f"))) static void enc_fp16_avx512(uint16_t *d, const float *s,
                                                                size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(_mm512_loadu_ps(s + i), PS__RNE));
  enc_fp16_portable(d + i, s + i, n - i);
}

__attribute__((target("avx512f"))) static void dec_fp16_avx512(float *d, const uint16_t *s,
                                                                size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
  dec_fp16_portable(d + i, s + i, n - i);
}
#endif

/* ---- dispatch ------------------------------------------------------------ */

typedef void (*enc_fn)(uint16_t *, const float *, size_t);
typedef void (*dec_fn)(float *, const uint16_t *, size_t);

/* Per path: encode and decode for bf16 and fp16. */
static const struct {
  enc_fn enc[2];
  dec_fn dec[2];
} paths[PS__HALF_PATHS_] = {
    {{enc_bf16_portable, enc_fp16_portable}, {dec_bf16_portable, dec_fp16_portable}},
#if PS__HALF_X86
    {{enc_bf16_avx2, enc_fp16_avx2}, {dec_bf16_avx2, dec_fp16_avx2}},
    {{enc_bf16_avx512, enc_fp16_avx512}, {dec_bf16_avx512, dec_fp16_avx512}},
#endif
};

/* The path in use, +1 (0: not chosen yet). Chosen once; a race only
 * chooses the same path twice. */
static int chosen;

int ps__half_path_available(int p) {
  if (p == PS__HALF_PORTABLE) return 1;
#if PS__HALF_X86
  __builtin_cpu_init();
  if (p == PS__HALF_AVX2) {
    /* F16C from CPUID leaf 1 (ECX bit 29): clang 14's
     * __builtin_cpu_supports does not know "f16c". AVX2 implies the OS
     * saves the YMM state F16C uses. */
    unsigned a, b, c, d;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) &&
           (c & bit_F16C) != 0;
  }
  if (p == PS__HALF_AVX512) return __builtin_cpu_supports("avx512f");
#endif
  return 0;
}

int ps__half_path(void) {
  int c = __atomic_load_n(&chosen, __ATOMIC_RELAXED);
  if (c) return c - 1;
  int best = PS__HALF_PORTABLE;
  for (int p = PS__HALF_PATHS_ - 1; p > 0; p--)
    if (ps__half_path_available(p)) {
      best = p;
      break;
    }
  __atomic_store_n(&chosen, best + 1, __ATOMIC_RELAXED);
  return best;
}

int ps__half_force_path(int p) {
  if (p < 0 || p >= PS__HALF_PATHS_ || !ps__half_path_available(p)) return -1;
  __atomic_store_n(&chosen, p + 1, __ATOMIC_RELAXED);
  return 0;
}

const char *ps__half_path_name(int p) {
  static const char *const names[PS__HALF_PATHS_] = {"portable", "avx2+f16c", "avx512f"};
  return p >= 0 && p < PS__HALF_PATHS_ ? names[p] : "unknown";
}

void ps__wire_encode(uint32_t dt, void *dst, const float *src, size_t n) {
  if (dt == PS__DT_F32) {
    memcpy(dst, src, n * sizeof(float));
    return;
  }
  paths[ps__half_path()].enc[dt == PS__DT_FP16](dst, src, n);
}

void ps__wire_decode(uint32_t dt, float *dst, const void *src, size_t n) {
  if (dt == PS__DT_F32) {
    memcpy(dst, src, n * sizeof(float));
    return;
  }
  paths[ps__half_path()].dec[dt == PS__DT_FP16](dst, src, n);
}
