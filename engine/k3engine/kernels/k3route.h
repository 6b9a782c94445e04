/* Router logits (ARCHITECTURE §4.7.1): l[e] = sum_i f64(W[e, i]) * f64(x[i]), ONE
 * sequential double accumulator per expert, i ascending (not the 16-lane matvec order).
 *
 * The scalar form is a chain of dependent adds per expert: latency-bound at ~4 cycles per
 * weight (K3: 896 x 7168 per MoE layer, ~10 ms of a token's 92 layers each).  The AVX-512
 * form keeps that order exactly but runs 8 experts per vector, one expert per lane: an
 * 8 x 8 block of weights (8 experts' rows, 8 consecutive inputs) is loaded row-wise,
 * transposed, and its 8 columns are FMA'd into the lanes in input order.  The product of a
 * float (or bf16) weight and a float input is exact in double, so fma(w, x, l) rounds
 * exactly like l + w*x.  The AVX2 form runs the same block as two 4-lane halves.
 * Experts past the last full block of 8, and inputs past the last full block of 8, are
 * finished by the scalar chain, continuing each expert's own accumulator in order. */
#ifndef K3ROUTE_H
#define K3ROUTE_H

#include "k3dot.h"

#define K3_ROUTE_SCALAR(NAME, T, WIDEN)                                                   \
    static void NAME(const T *w, long ldw, const double *x, long n, long e0, long e1,     \
                     long i0, double *out) {                                              \
        for (long e = e0; e < e1; e++) {                                                  \
            double l = i0 ? out[e] : 0.0;                                                 \
            const T *row = w + e * ldw;                                                   \
            for (long i = i0; i < n; i++) l = l + (double)WIDEN(row[i]) * x[i];           \
            out[e] = l;                                                                   \
        }                                                                                 \
    }
K3_ROUTE_SCALAR(k3_route_f32_scalar, float, K3_AS_IS)
K3_ROUTE_SCALAR(k3_route_bf16_scalar, uint16_t, k3_bf16_to_f32)

#if K3_HAVE_SIMD_PATHS

K3_AVX512_ATTR K3_INLINE __m256 k3_route_load8_f32(const float *w) {
    return _mm256_loadu_ps(w);
}
K3_AVX512_ATTR K3_INLINE __m256 k3_route_load8_bf16(const uint16_t *w) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* r[k] holds row k (8 inputs); afterwards r[j] holds input j of the 8 rows */
K3_AVX512_ATTR K3_INLINE void k3_transpose8(__m256 *r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* One block of 8 experts at a time, over all its inputs.  Why not several blocks side by
 * side (their chains would overlap): the rows are a power-of-two stride apart in the
 * models (2048 or 7168 inputs), so 4 blocks' 32 rows fell into one or two L1 sets of 8
 * ways and each line was evicted before its next 8 inputs were read: mid's 128 x 2048
 * router, hot, 1 thread, 117 us a call with f32 weights and 93 with bf16, against 41-42
 * one block at a time.  Nor 4 blocks at different quarters of the inputs (their rows in
 * different sets): 41 / 63-73 us; one block is bound by its shuffles and converts here
 * (~35 cycles a block of 64 weights), not by its chain's FMA latency. */
#define K3_ROUTE_AVX512(NAME, T, LOAD8)                                                   \
    K3_AVX512_ATTR static void NAME(const T *w, long ldw, const double *x, long n,        \
                                    long e0, long nb, double *out) {                      \
        /* nb blocks of 8 experts from e0; inputs 0 .. n & ~7 */                          \
        long n8 = n & ~7L;                                                                \
        for (long b = 0; b < nb; b++) {                                                   \
            __m512d acc = _mm512_setzero_pd();                                            \
            const T *blk = w + (e0 + 8 * b) * ldw;                                        \
            for (long i = 0; i < n8; i += 8) {                                            \
                __m256 r[8];                                                              \
                for (int k = 0; k < 8; k++) r[k] = LOAD8(blk + k * ldw + i);              \
                k3_transpose8(r);                                                         \
                for (int j = 0; j < 8; j++)                                               \
                    acc = _mm512_fmadd_pd(_mm512_cvtps_pd(r[j]), _mm512_set1_pd(x[i + j]), \
                                          acc);                                           \
            }                                                                             \
            _mm512_storeu_pd(out + e0 + 8 * b, acc);                                      \
        }                                                                                 \
    }
K3_ROUTE_AVX512(k3_route_f32_avx512, float, k3_route_load8_f32)
K3_ROUTE_AVX512(k3_route_bf16_avx512, uint16_t, k3_route_load8_bf16)

/* AVX2: a block of 8 experts as two 4-lane halves (two chains), 4 inputs a step through
 * two 4 x 4 transposes.  Same order per expert, same bits; ~4x the scalar chain's speed,
 * whose dependent adds wait ~3-4 cycles a weight (mid's router, 1 thread: 217 us). */
K3_AVX2_ATTR K3_INLINE __m128 k3_route_load4_f32(const float *w) { return _mm_loadu_ps(w); }
K3_AVX2_ATTR K3_INLINE __m128 k3_route_load4_bf16(const uint16_t *w) {
    __m128i v = _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)w));
    return _mm_castsi128_ps(_mm_slli_epi32(v, 16));
}
#define K3_ROUTE_AVX2(NAME, T, LOAD4)                                                     \
    K3_AVX2_ATTR static void NAME(const T *w, long ldw, const double *x, long n, long e0, \
                                  long nb, double *out) {                                 \
        /* nb blocks of 8 experts from e0; inputs 0 .. n & ~7 */                          \
        long n8 = n & ~7L;                                                                \
        for (long b = 0; b < nb; b++) {                                                   \
            __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();                   \
            const T *blk = w + (e0 + 8 * b) * ldw;                                        \
            for (long i = 0; i < n8; i += 4) {                                            \
                __m128 r[8];                                                              \
                for (int k = 0; k < 8; k++) r[k] = LOAD4(blk + k * ldw + i);              \
                _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);   /* r[j]: input j, rows 0-3 */ \
                _MM_TRANSPOSE4_PS(r[4], r[5], r[6], r[7]);   /* r[4+j]: rows 4-7 */        \
                for (int j = 0; j < 4; j++) {                                             \
                    const __m256d xj = _mm256_set1_pd(x[i + j]);                          \
                    lo = _mm256_fmadd_pd(_mm256_cvtps_pd(r[j]), xj, lo);                  \
                    hi = _mm256_fmadd_pd(_mm256_cvtps_pd(r[4 + j]), xj, hi);              \
                }                                                                         \
            }                                                                             \
            _mm256_storeu_pd(out + e0 + 8 * b, lo);                                       \
            _mm256_storeu_pd(out + e0 + 8 * b + 4, hi);                                   \
        }                                                                                 \
    }
K3_ROUTE_AVX2(k3_route_f32_avx2, float, k3_route_load4_f32)
K3_ROUTE_AVX2(k3_route_bf16_avx2, uint16_t, k3_route_load4_bf16)

#endif /* K3_HAVE_SIMD_PATHS */

/* out[e] = the router logit of expert e (before the sigmoid), for e in [e0, e1) of N (e0 a
 * multiple of 8): a range is one work item, so a token's experts may be split between
 * threads (each expert's chain stays whole). */
#define K3_ROUTE_LOGITS(NAME, T, SCALAR, AVX512, AVX2)                                    \
    static void NAME(const T *w, long N, long n, const double *x, double *out, long e0,   \
                     long e1) {                                                           \
        long done = e0;                                                                   \
        int isa = k3_isa();                                                               \
        if (K3_HAVE_SIMD_PATHS && isa != K3_ISA_SCALAR && n >= 8) {                      \
            long full = (N & ~7L) < e1 ? (N & ~7L) : e1;                                  \
            if (full > e0) {                                                              \
                if (isa == K3_ISA_AVX512) AVX512(w, n, x, n, e0, (full - e0) / 8, out);   \
                else AVX2(w, n, x, n, e0, (full - e0) / 8, out);                          \
                SCALAR(w, n, x, n, e0, full, n & ~7L, out);  /* inputs past the blocks */ \
                done = full;                                                              \
            }                                                                             \
        }                                                                                 \
        SCALAR(w, n, x, n, done, e1, 0, out);            /* the experts past them */      \
    }

#if !K3_HAVE_SIMD_PATHS
#define k3_route_f32_avx512(...) ((void)0)
#define k3_route_bf16_avx512(...) ((void)0)
#define k3_route_f32_avx2(...) ((void)0)
#define k3_route_bf16_avx2(...) ((void)0)
#endif
K3_ROUTE_LOGITS(k3_route_logits_f32, float, k3_route_f32_scalar, k3_route_f32_avx512,
                k3_route_f32_avx2)
K3_ROUTE_LOGITS(k3_route_logits_bf16, uint16_t, k3_route_bf16_scalar, k3_route_bf16_avx512,
                k3_route_bf16_avx2)

#endif /* K3ROUTE_H */
