"""C source of the Squinch v1 CPU kernel (built and loaded by cpu_kernels.py).

Two code paths with the same bytes: a portable one (GCC vector extensions, one 8-element block per
8-lane vector) and, where the compiler targets AVX-512 (F/BW/VL), an intrinsics path that handles
two blocks per 16-lane register, finds q from a 14-bit reciprocal-sqrt estimate fixed up by one exact
threshold comparison (stochastic mode: a 4-step binary search over L with lane permutes), and packs
nibbles with vpmov*; with AVX-512 VBMI it takes 16 blocks per step, finds
their q_max with vector arithmetic and writes the 96 payload bytes with two byte permutes.
``-DSQUINCH_GENERIC`` forces the portable path. Tables come from format.py as exact hex float literals.
"""
from __future__ import annotations

import math

from . import format as fmt

_C_TEMPLATE = r"""
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static const uint16_t QTAB[4096] = {@QTAB@};
static const uint32_t SBITS[257] = {@SBITS@};
static const float S_F[256] = {@S@};
static const float B_F[16] = {@B@};
static const float L_F[16] = {@L@};

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define BCASTF(x) ((v8f){x, x, x, x, x, x, x, x})
#define BCASTU(x) ((v8u){x, x, x, x, x, x, x, x})

ALWAYS_INLINE v8u sel(v8i m, v8u a, v8u b) { return ((v8u)m & a) | (~(v8u)m & b); }

ALWAYS_INLINE uint32_t hmax_u(v8u v) {
    v8u t = __builtin_shuffle(v, (v8u){4, 5, 6, 7, 0, 1, 2, 3}); v = sel((v8i)(t > v), t, v);
    t = __builtin_shuffle(v, (v8u){2, 3, 0, 1, 6, 7, 4, 5}); v = sel((v8i)(t > v), t, v);
    t = __builtin_shuffle(v, (v8u){1, 0, 3, 2, 5, 4, 7, 6}); v = sel((v8i)(t > v), t, v);
    return v[0];
}

ALWAYS_INLINE uint32_t hor_u(v8u v) {
    v |= __builtin_shuffle(v, (v8u){4, 5, 6, 7, 0, 1, 2, 3});
    v |= __builtin_shuffle(v, (v8u){2, 3, 0, 1, 6, 7, 4, 5});
    v |= __builtin_shuffle(v, (v8u){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
}

ALWAYS_INLINE v8f half_to_float(v8u h) {  /* exact IEEE binary16 -> binary32 */
    v8u sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    v8u normal = sign | ((e + 112u) << 23) | (mant << 13);
    v8u infnan = sign | 0x7f800000u | (mant << 13);
    v8f subf = __builtin_convertvector((v8i)mant, v8f) * BCASTF(0x1p-24f);
    v8u sub = sign | (v8u)subf;
    return (v8f)sel((v8i)(e == 0u), sub, sel((v8i)(e == 31u), infnan, normal));
}

ALWAYS_INLINE v8f load8(const void *src, const int dt, int64_t e0, int cnt) {
    if (dt == 0) {
        float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(t, (const float *)src + e0, (size_t)cnt * 4);
        v8f v; memcpy(&v, t, 32); return v;
    }
    uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(h, (const uint16_t *)src + e0, (size_t)cnt * 2);
    v8h hv; memcpy(&hv, h, 16);
    v8u w = __builtin_convertvector(hv, v8u);
    if (dt == 1) return (v8f)(w << 16);
    return half_to_float(w);
}

ALWAYS_INLINE void store8(void *dst, const int dt, int64_t e0, int cnt, v8f v) {
    if (dt == 0) {
        float t[8]; memcpy(t, &v, 32);
        memcpy((float *)dst + e0, t, (size_t)cnt * 4);
        return;
    }
    /* bf16, round to nearest even; NaN stays a (quiet) NaN with its sign */
    v8u b = (v8u)v;
    v8u r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    r = sel((v8i)((b & 0x7fffffffu) > 0x7f800000u), (b >> 16) | 0x40u, r);
    v8h h = __builtin_convertvector(r, v8h);
    uint16_t t[8]; memcpy(t, &h, 16);
    memcpy((uint16_t *)dst + e0, t, (size_t)cnt * 2);
}

ALWAYS_INLINE v8u mix32(v8u x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16; return x;
}

ALWAYS_INLINE v8f uniform8(uint64_t seed, int64_t e0) {  /* counter-based uniforms in [0, 1) */
    v8u idx = BCASTU((uint32_t)e0) + (v8u){0, 1, 2, 3, 4, 5, 6, 7};
    uint32_t hi = (uint32_t)((uint64_t)e0 >> 32) * 0x9e3779b9u;
    v8u h = mix32(idx ^ BCASTU((uint32_t)seed));
    h = mix32(h + BCASTU(((uint32_t)(seed >> 32)) ^ hi));
    return __builtin_convertvector((v8i)(h >> 8), v8f) * BCASTF(0x1p-24f);
}

/* Encode one block y (fp32, padded). Writes 6 bytes to out; returns the decoded block in *dec
   (when want_dec) and the max |y| bit pattern. */
ALWAYS_INLINE uint32_t enc_block(v8f y, uint8_t *out, const int stoch, uint64_t seed, int64_t e0,
                                 const int want_dec, v8f *dec) {
    const v8f LLO = {L_F[0], L_F[1], L_F[2], L_F[3], L_F[4], L_F[5], L_F[6], L_F[7]};
    const v8f LHI = {L_F[8], L_F[9], L_F[10], L_F[11], L_F[12], L_F[13], L_F[14], L_F[15]};
    v8u bits = (v8u)y & 0x7fffffffu;
    uint32_t mb = hmax_u(bits);
    uint32_t qm = QTAB[mb >> 19];
    qm += SBITS[qm] <= mb;
    if (qm > 255) qm = 255;
    float M = S_F[qm];
    v8f u = (v8f)bits / BCASTF(M);
    v8i q = {0, 0, 0, 0, 0, 0, 0, 0};
    if (!stoch) {
        for (int k = 1; k < 16; k++) q -= (v8i)(u >= BCASTF(B_F[k]));
    } else {
        v8i a = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 1; k < 16; k++) a -= (v8i)(u >= BCASTF(L_F[k]));
        v8i a1 = a + 1;
        a1 = (v8i)sel(a1 > 15, BCASTU(15u), (v8u)a1);
        v8f lo = __builtin_shuffle(LLO, LHI, a), hi = __builtin_shuffle(LLO, LHI, a1);
        v8f p = (u - lo) / (hi - lo);
        v8f r = uniform8(seed, e0);
        q = a - ((v8i)(r < p) & (v8i)(a < 15));
    }
    v8u neg = (v8u)(v8i)(y < BCASTF(0.0f));
    uint32_t sb = hor_u(neg & (v8u){1, 2, 4, 8, 16, 32, 64, 128});
    uint32_t word = hor_u((v8u)q << (v8u){0, 4, 8, 12, 16, 20, 24, 28});
    out[0] = (uint8_t)qm; out[1] = (uint8_t)sb;
    out[2] = (uint8_t)word; out[3] = (uint8_t)(word >> 8);
    out[4] = (uint8_t)(word >> 16); out[5] = (uint8_t)(word >> 24);
    if (want_dec) {
        v8f mag = BCASTF(M) * __builtin_shuffle(LLO, LHI, q);
        *dec = (v8f)((v8u)mag | (neg & BCASTU(0x80000000u)));
    }
    return mb;
}

ALWAYS_INLINE v8f dec_block(const uint8_t *p) {
    const v8f LLO = {L_F[0], L_F[1], L_F[2], L_F[3], L_F[4], L_F[5], L_F[6], L_F[7]};
    const v8f LHI = {L_F[8], L_F[9], L_F[10], L_F[11], L_F[12], L_F[13], L_F[14], L_F[15]};
    float M = S_F[p[0]];
    uint32_t sb = p[1];
    uint32_t word = (uint32_t)p[2] | ((uint32_t)p[3] << 8) | ((uint32_t)p[4] << 16) | ((uint32_t)p[5] << 24);
    v8i q = (v8i)((BCASTU(word) >> (v8u){0, 4, 8, 12, 16, 20, 24, 28}) & 15u);
    v8f mag = BCASTF(M) * __builtin_shuffle(LLO, LHI, q);
    v8u sgn = ((BCASTU(sb) >> (v8u){0, 1, 2, 3, 4, 5, 6, 7}) & 1u) << 31;
    return (v8f)((v8u)mag | sgn);
}

/* ---- AVX-512 path: two blocks per 16-lane register (x86 only, little-endian) -------------------- */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(SQUINCH_GENERIC)
#define SQ_AVX512 1
#include <immintrin.h>

ALWAYS_INLINE __m512 ld16(const void *src, const int dt, int64_t e0) {
    if (dt == 0) return _mm512_loadu_ps((const float *)src + e0);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + e0));
    if (dt == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);  /* exact, subnormals included */
}

ALWAYS_INLINE void st16(void *dst, const int dt, int64_t e0, __m512 v) {
    if (dt == 0) { _mm512_storeu_ps((float *)dst + e0, v); return; }
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)((uint16_t *)dst + e0), _mm512_cvtepi32_epi16(r));
}

/* number of k in 1..15 with u >= T[k] (T monotone in 1..15), by binary search with lane permutes */
ALWAYS_INLINE __m512i search16(__m512 u, __m512 T) {
    __m512i q = _mm512_maskz_mov_epi32(
        _mm512_cmp_ps_mask(u, _mm512_permutexvar_ps(_mm512_set1_epi32(8), T), _CMP_GE_OQ),
        _mm512_set1_epi32(8));
    for (int step = 4; step >= 1; step >>= 1) {
        __m512i idx = _mm512_add_epi32(q, _mm512_set1_epi32(step));
        __mmask16 k = _mm512_cmp_ps_mask(u, _mm512_permutexvar_ps(idx, T), _CMP_GE_OQ);
        q = _mm512_mask_mov_epi32(q, k, idx);
    }
    return q;
}

ALWAYS_INLINE __m512i mix16(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x7feb352du));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

ALWAYS_INLINE __m512 uniform16(uint64_t seed, int64_t e0) {  /* same stream as uniform8, two blocks */
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)e0),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    uint32_t hi0 = (uint32_t)((uint64_t)e0 >> 32) * 0x9e3779b9u;
    uint32_t hi1 = (uint32_t)((uint64_t)(e0 + 8) >> 32) * 0x9e3779b9u;
    __m512i s1 = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32((int)(((uint32_t)(seed >> 32)) ^ hi0)),
                                         _mm512_set1_epi32((int)(((uint32_t)(seed >> 32)) ^ hi1)));
    __m512i h = mix16(_mm512_xor_si512(idx, _mm512_set1_epi32((int)(uint32_t)seed)));
    h = mix16(_mm512_add_epi32(h, s1));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), _mm512_set1_ps(0x1p-24f));
}

ALWAYS_INLINE uint32_t qmax_of(uint32_t mb) {
    uint32_t q = QTAB[mb >> 19];
    q += SBITS[q] <= mb;
    return q > 255 ? 255 : q;
}

/* max of the |y| bit patterns within each 8-lane half, broadcast to that half */
ALWAYS_INLINE __m512i halfmax(__m512i bits) {
    __m512i t = _mm512_max_epu32(bits, _mm512_shuffle_epi32(bits, _MM_PERM_BADC));
    t = _mm512_max_epu32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
    return _mm512_max_epu32(t, _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
}

/* q for 16 values u (two blocks starting at element e0) */
ALWAYS_INLINE __m512i quantize16(__m512 u, const int stoch, uint64_t seed, int64_t e0) {
    const __m512 BT = _mm512_loadu_ps(B_F), LT = _mm512_loadu_ps(L_F);
    if (!stoch) {
        /* v ~ 15 sqrt(u) + 0.5 to within 0.002 (14-bit rsqrt); threshold B[j] sits at v = j, so with
           k = round(v) clamped to 1..15 only B[k] is in doubt: q = k - 1 + (u >= B[k]). min(4, u) keeps
           Inf finite (-> 15) and passes NaN through (-> k = 1 -> q = 0); u = 0 gives NaN -> q = 0. */
        __m512 uc = _mm512_min_ps(_mm512_set1_ps(4.0f), u);
        __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(uc, _mm512_rsqrt14_ps(uc)), _mm512_set1_ps(15.0f),
                                   _mm512_set1_ps(0.5f));
        __m512i k = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        k = _mm512_min_epi32(_mm512_max_epi32(k, _mm512_set1_epi32(1)), _mm512_set1_epi32(15));
        __mmask16 ge = _mm512_cmp_ps_mask(u, _mm512_permutexvar_ps(k, BT), _CMP_GE_OQ);
        return _mm512_mask_mov_epi32(_mm512_sub_epi32(k, _mm512_set1_epi32(1)), ge, k);
    }
    const __m512i fifteen = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
    __m512i a = search16(u, LT);
    __m512i a1 = _mm512_min_epi32(_mm512_add_epi32(a, one), fifteen);
    __m512 lo = _mm512_permutexvar_ps(a, LT), hi = _mm512_permutexvar_ps(a1, LT);
    __m512 p = _mm512_div_ps(_mm512_sub_ps(u, lo), _mm512_sub_ps(hi, lo));
    __mmask16 up = _mm512_cmp_ps_mask(uniform16(seed, e0), p, _CMP_LT_OQ) & _mm512_cmplt_epi32_mask(a, fifteen);
    return _mm512_mask_add_epi32(a, up, a, one);
}

/* the 8 nibble bytes of two blocks (low 64 bits): byte k = q_2k | q_2k+1 << 4 */
ALWAYS_INLINE __m128i nibbles16(__m512i q) {
    __m128i qb = _mm512_cvtepi32_epi8(q);  /* byte l = q_l; as 16-bit lanes: q_2k | q_2k+1 << 8 */
    __m128i nib = _mm_or_si128(_mm_and_si128(qb, _mm_set1_epi16(0x000f)),
                               _mm_and_si128(_mm_srli_epi16(qb, 4), _mm_set1_epi16(0x00f0)));
    return _mm_cvtepi16_epi8(nib);
}

ALWAYS_INLINE __m512 dequant16(__m512 Mv, __m512i q, __mmask16 neg) {
    __m512i mag = _mm512_castps_si512(_mm512_mul_ps(Mv, _mm512_permutexvar_ps(q, _mm512_loadu_ps(L_F))));
    return _mm512_castsi512_ps(_mm512_mask_or_epi32(mag, neg, mag, _mm512_set1_epi32((int)0x80000000u)));
}

/* Encode blocks b and b+1 (16 values of y) into out[0..11]; same bytes as two enc_block calls. */
ALWAYS_INLINE uint32_t enc_pair(__m512 y, uint8_t *out, const int stoch, uint64_t seed, int64_t e0,
                                const int want_dec, __m512 *dec) {
    __m512i bits = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7fffffff));
    __m512i t = halfmax(bits);
    uint32_t mb0 = (uint32_t)_mm512_cvtsi512_si32(t);
    uint32_t mb1 = (uint32_t)_mm_cvtsi128_si32(_mm512_extracti32x4_epi32(t, 2));
    uint32_t q0 = qmax_of(mb0), q1 = qmax_of(mb1);
    __m512 Mv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(S_F[q0]), _mm512_set1_ps(S_F[q1]));
    __m512i q = quantize16(_mm512_div_ps(_mm512_castsi512_ps(bits), Mv), stoch, seed, e0);
    __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
    uint64_t nb8 = (uint64_t)_mm_cvtsi128_si64(nibbles16(q));
    uint64_t w0 = (uint64_t)q0 | ((uint64_t)(neg & 0xffu) << 8) | ((nb8 & 0xffffffffu) << 16) |
                  ((uint64_t)q1 << 48) | ((uint64_t)(neg >> 8) << 56);
    uint32_t w1 = (uint32_t)(nb8 >> 32);
    memcpy(out, &w0, 8);
    memcpy(out + 8, &w1, 4);
    if (want_dec) *dec = dequant16(Mv, q, neg);
    return mb0 > mb1 ? mb0 : mb1;
}

#ifdef __AVX512VBMI__
#define SQ_ENC16 1
static const uint8_t OUT_IDX[128] = {@OUTIDX@};

ALWAYS_INLINE __m512 lookup256(__m512i idx) {  /* S_F[idx] for idx in 0..255: 8 two-table permutes + blends */
    __m512 r[8];
    for (int j = 0; j < 8; j++)
        r[j] = _mm512_permutex2var_ps(_mm512_loadu_ps(S_F + 32 * j), idx, _mm512_loadu_ps(S_F + 32 * j + 16));
    __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    for (int j = 0; j < 4; j++) r[j] = _mm512_mask_blend_ps(b5, r[2 * j], r[2 * j + 1]);
    for (int j = 0; j < 2; j++) r[j] = _mm512_mask_blend_ps(b6, r[2 * j], r[2 * j + 1]);
    return _mm512_mask_blend_ps(b7, r[0], r[1]);
}

/* Encode 16 blocks (y[0..7], two blocks each) into out[0..95]: q_max of all 16 blocks at once, the 96
   payload bytes assembled with two byte permutes. Returns the per-block max |y| bits. */
ALWAYS_INLINE __m512i enc16(const __m512 *y, uint8_t *out, const int stoch, uint64_t seed, int64_t e0,
                            const int want_dec, __m512 *dec) {
    __m512i bits[8], t[8];
    for (int i = 0; i < 8; i++) {
        bits[i] = _mm512_and_si512(_mm512_castps_si512(y[i]), _mm512_set1_epi32(0x7fffffff));
        t[i] = halfmax(bits[i]);
    }
    /* lane k of mb = max |y| bits of block k (lane 0 / 8 of t[k / 2]) */
    const __m512i I1 = _mm512_setr_epi32(0, 8, 16, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i I2 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i I3 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    __m512i a0 = _mm512_permutex2var_epi32(t[0], I1, t[1]), a1 = _mm512_permutex2var_epi32(t[2], I1, t[3]);
    __m512i a2 = _mm512_permutex2var_epi32(t[4], I1, t[5]), a3 = _mm512_permutex2var_epi32(t[6], I1, t[7]);
    __m512i mb = _mm512_permutex2var_epi32(_mm512_permutex2var_epi32(a0, I2, a1), I3,
                                           _mm512_permutex2var_epi32(a2, I2, a3));
    /* q_max = (k - 1) + (S[k - 1] <= m), k = round(6 ln m + 129) estimated from the bits of m read as a
       linear log2 (error < 0.36 < 0.5, so only the boundary between k - 1 and k is in doubt; NaN/Inf bits
       lie above every S and give 255); S lookups by lane permutes, not gathers (slow on some CPUs) */
    __m512 est = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepu32_ps(mb), _mm512_set1_ps(@LOGC1@)),
                               _mm512_set1_ps(@LOGC0@));
    __m512i k = _mm512_cvt_roundps_epi32(est, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    k = _mm512_min_epi32(_mm512_max_epi32(k, _mm512_set1_epi32(1)), _mm512_set1_epi32(255));
    __m512i km1 = _mm512_sub_epi32(k, _mm512_set1_epi32(1));
    __m512 s_lo = lookup256(km1), s_hi = lookup256(k);
    __mmask16 up = _mm512_cmple_epu32_mask(_mm512_castps_si512(s_lo), mb);
    __m512i qm = _mm512_mask_add_epi32(km1, up, km1, _mm512_set1_epi32(1));
    __m512 M = _mm512_mask_blend_ps(up, s_lo, s_hi);
    const __m512i EXP = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m128i nib[8];
    uint64_t sg[2] = {0, 0};
    for (int i = 0; i < 8; i++) {
        __m512 Mv = _mm512_permutexvar_ps(_mm512_add_epi32(EXP, _mm512_set1_epi32(2 * i)), M);
        __m512i q = quantize16(_mm512_div_ps(_mm512_castsi512_ps(bits[i]), Mv), stoch, seed, e0 + 16 * i);
        __mmask16 neg = _mm512_cmp_ps_mask(y[i], _mm512_setzero_ps(), _CMP_LT_OQ);
        sg[i >> 2] |= (uint64_t)neg << (16 * (i & 3));
        nib[i] = nibbles16(q);
        if (want_dec) dec[i] = dequant16(Mv, q, neg);
    }
    __m512i NIB = _mm512_castsi128_si512(_mm_unpacklo_epi64(nib[0], nib[1]));
    NIB = _mm512_inserti32x4(NIB, _mm_unpacklo_epi64(nib[2], nib[3]), 1);
    NIB = _mm512_inserti32x4(NIB, _mm_unpacklo_epi64(nib[4], nib[5]), 2);
    NIB = _mm512_inserti32x4(NIB, _mm_unpacklo_epi64(nib[6], nib[7]), 3);
    /* bytes 0..15: q_max of blocks 0..15, bytes 16..31: their sign bytes */
    __m512i QS = _mm512_inserti32x4(_mm512_castsi128_si512(_mm512_cvtepi32_epi8(qm)),
                                    _mm_set_epi64x((long long)sg[1], (long long)sg[0]), 1);
    __m512i o0 = _mm512_permutex2var_epi8(NIB, _mm512_loadu_si512((const void *)OUT_IDX), QS);
    __m512i o1 = _mm512_permutex2var_epi8(NIB, _mm512_loadu_si512((const void *)(OUT_IDX + 64)), QS);
    _mm512_storeu_si512((void *)out, o0);
    _mm256_storeu_si256((__m256i *)(out + 64), _mm512_castsi512_si256(o1));
    return mb;
}
#endif

ALWAYS_INLINE __m512 dec_pair(const uint8_t *p) {  /* blocks at p[0..5] and p[6..11] */
    const __m512 LT = _mm512_loadu_ps(L_F);
    uint32_t n0, n1;
    memcpy(&n0, p + 2, 4);
    memcpy(&n1, p + 8, 4);
    __m128i w = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)((uint64_t)n0 | ((uint64_t)n1 << 32))));
    __m128i qb = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(0x0f)), _mm_slli_epi16(_mm_srli_epi16(w, 4), 8));
    __m512i q = _mm512_cvtepu8_epi32(qb);
    __m512 Mv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(S_F[p[0]]), _mm512_set1_ps(S_F[p[6]]));
    __mmask16 neg = (__mmask16)((uint32_t)p[1] | ((uint32_t)p[7] << 8));
    __m512i mag = _mm512_castps_si512(_mm512_mul_ps(Mv, _mm512_permutexvar_ps(q, LT)));
    return _mm512_castsi512_ps(_mm512_mask_or_epi32(mag, neg, mag, _mm512_set1_epi32((int)0x80000000u)));
}
#endif

ALWAYS_INLINE uint32_t encode_impl(const void *g, const int gdt, void *res, const int rdt, int64_t n,
                                   int64_t b0, int64_t b1, uint8_t *out, const int stoch, uint64_t seed) {
    uint32_t mbmax = 0;
    int64_t full = n / 8 < b1 ? n / 8 : b1;  /* blocks [b0, full) hold 8 elements */
    int64_t b = b0;
#ifdef SQ_ENC16
    __m512i vmax = _mm512_setzero_si512();
    for (; b + 15 < full; b += 16) {
        int64_t e0 = b * 8;
        __m512 y[8], dec[8];
        for (int i = 0; i < 8; i++) {
            y[i] = ld16(g, gdt, e0 + 16 * i);
            if (rdt >= 0) y[i] = _mm512_add_ps(y[i], ld16(res, rdt, e0 + 16 * i));
        }
        vmax = _mm512_max_epu32(vmax, enc16(y, out + 6 * b, stoch, seed, e0, rdt >= 0, dec));
        if (rdt >= 0)
            for (int i = 0; i < 8; i++) st16(res, rdt, e0 + 16 * i, _mm512_sub_ps(y[i], dec[i]));
    }
    mbmax = _mm512_reduce_max_epu32(vmax);
#endif
#ifdef SQ_AVX512
    for (; b + 1 < full; b += 2) {
        int64_t e0 = b * 8;
        __m512 y = ld16(g, gdt, e0);
        if (rdt >= 0) y = _mm512_add_ps(y, ld16(res, rdt, e0));
        __m512 dec;
        uint32_t mb = enc_pair(y, out + 6 * b, stoch, seed, e0, rdt >= 0, &dec);
        mbmax = mb > mbmax ? mb : mbmax;
        if (rdt >= 0) st16(res, rdt, e0, _mm512_sub_ps(y, dec));
    }
#endif
    for (; b < full; b++) {
        int64_t e0 = b * 8;
        v8f y = load8(g, gdt, e0, 8);
        if (rdt >= 0) y = y + load8(res, rdt, e0, 8);
        v8f dec;
        uint32_t mb = enc_block(y, out + 6 * b, stoch, seed, e0, rdt >= 0, &dec);
        mbmax = mb > mbmax ? mb : mbmax;
        if (rdt >= 0) store8(res, rdt, e0, 8, y - dec);
    }
    for (b = full > b0 ? full : b0; b < b1; b++) {  /* the zero-padded tail block */
        int64_t e0 = b * 8;
        int cnt = (int)(n - e0);
        v8f y = load8(g, gdt, e0, cnt);
        if (rdt >= 0) y = y + load8(res, rdt, e0, cnt);
        v8f dec;
        uint32_t mb = enc_block(y, out + 6 * b, stoch, seed, e0, rdt >= 0, &dec);
        mbmax = mb > mbmax ? mb : mbmax;
        if (rdt >= 0) store8(res, rdt, e0, cnt, y - dec);
    }
    return mbmax;
}

#define ENC_CASE(G, R, ST) \
    if (gdt == G && rdt == R && stoch == ST) return encode_impl(g, G, res, R, n, b0, b1, out, ST, seed);
#define ENC_CASES_R(G, R) ENC_CASE(G, R, 0) ENC_CASE(G, R, 1)
#define ENC_CASES_G(G) ENC_CASES_R(G, -1) ENC_CASES_R(G, 0) ENC_CASES_R(G, 1)

int sq_variant(void) {  /* 0 portable, 1 AVX-512 pairs, 2 AVX-512 pairs + 16-block VBMI path */
#if defined(SQ_ENC16)
    return 2;
#elif defined(SQ_AVX512)
    return 1;
#else
    return 0;
#endif
}

/* Returns the max |y| bit pattern over the range (>= 0x7f800000 means NaN/Inf),
   0xffffffff for an unsupported dtype combination. */
uint32_t sq_encode(const void *g, int gdt, void *res, int rdt, int64_t n, int64_t b0, int64_t b1,
                   uint8_t *out, int stoch, uint64_t seed) {
    ENC_CASES_G(0) ENC_CASES_G(1) ENC_CASES_G(2)
    return 0xffffffffu;
}

ALWAYS_INLINE void decode_impl(const uint8_t *p, int64_t W, int64_t stride, int64_t n, int64_t b0,
                               int64_t b1, float *out, const int acc_out, const int single) {
    int64_t full = n / 8 < b1 ? n / 8 : b1;
    int64_t b = b0;
#ifdef SQ_AVX512
    for (; b + 1 < full; b += 2) {
        int64_t e0 = b * 8;
        __m512 s;
        if (single) {
            s = dec_pair(p + 6 * b);
        } else {
            s = _mm512_set1_ps(-0.0f);
            for (int64_t w = 0; w < W; w++) s = _mm512_add_ps(s, dec_pair(p + w * stride + 6 * b));
        }
        if (acc_out) s = _mm512_add_ps(_mm512_loadu_ps(out + e0), s);
        _mm512_storeu_ps(out + e0, s);
    }
#endif
    for (; b < b1; b++) {
        int64_t e0 = b * 8;
        v8f s;
        if (single) {
            s = dec_block(p + 6 * b);
        } else {
            s = BCASTF(-0.0f);  /* -0.0 is the exact additive identity: s = ((d0 + d1) + ...) */
            for (int64_t w = 0; w < W; w++) s = s + dec_block(p + w * stride + 6 * b);
        }
        if (b < full) {
            if (acc_out) s = load8(out, 0, e0, 8) + s;
            store8(out, 0, e0, 8, s);
        } else {
            int cnt = (int)(n - e0);
            if (acc_out) s = load8(out, 0, e0, cnt) + s;
            store8(out, 0, e0, cnt, s);
        }
    }
}

void sq_decode(const uint8_t *p, int64_t W, int64_t stride, int64_t n, int64_t b0, int64_t b1,
               float *out, int accumulate) {
    if (W == 1 && !accumulate) decode_impl(p, 1, stride, n, b0, b1, out, 0, 1);
    else if (W == 1) decode_impl(p, 1, stride, n, b0, b1, out, 1, 1);
    else if (accumulate) decode_impl(p, W, stride, n, b0, b1, out, 1, 0);
    else decode_impl(p, W, stride, n, b0, b1, out, 0, 0);
}
"""


def _out_index() -> list[int]:
    """vpermt2b indices assembling 16 blocks' 96 payload bytes from NIB (64 nibble bytes, block k at
    4k..4k+3) and QS (q_max of block k at byte k, its sign byte at 16 + k; second source, +64)."""
    idx = []
    for o in range(128):
        k, pos = divmod(min(o, 95), 6)
        idx.append(64 + k if pos == 0 else 80 + k if pos == 1 else 4 * k + pos - 2)
    return idx


def c_source() -> str:
    """The C source with the format tables filled in (hex float literals, exact)."""

    def floats(vals: tuple[float, ...]) -> str:
        return ", ".join(float(v).hex() + "f" for v in vals)

    return (
        _C_TEMPLATE.replace("@QTAB@", ", ".join(str(v) for v in fmt.QMAX_BUCKET))
        .replace("@OUTIDX@", ", ".join(str(v) for v in _out_index()))
        .replace("@LOGC1@", (6 * math.log(2) / 2**23).hex() + "f")  # 6 ln(m) ~ 6 ln2 (bits(m) / 2^23 - 127)
        .replace("@LOGC0@", (129 - 127 * 6 * math.log(2)).hex() + "f")
        .replace("@SBITS@", ", ".join(f"0x{v:08x}u" for v in fmt.S_BITS_EXT))
        .replace("@S@", floats(fmt.S))
        .replace("@B@", floats(fmt.B))
        .replace("@L@", floats(fmt.L))
    )
