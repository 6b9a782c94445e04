/* Row dot products with the exact reduction orders of ARCHITECTURE §5.3 and §5.6.
 *
 * Written in C rather than Cython for one reason: the AVX2 paths need intrinsics and a
 * runtime CPU check, so a portable build still runs at memory speed.  Every path computes
 * the same bits: products of two float32 (or E2M1 x float32) values are exact in double,
 * so only the ORDER of the double additions matters, and every variant below keeps the
 * 16-lane tree (matvec) and the 8-lane-per-group tree (MXFP4) of the reference.
 * Built with -ffp-contract=off; never -ffast-math (that would reassociate the tree).
 */
#ifndef K3DOT_H
#define K3DOT_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define K3_HAVE_AVX2_PATH 1
#include <immintrin.h>
#else
#define K3_HAVE_AVX2_PATH 0
#endif

static inline float k3_bf16_to_f32(uint16_t b) {
    uint32_t u = ((uint32_t)b) << 16;   /* BF16 widening is a shift, never a rounding */
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- 16-lane double matvec row (§5.3) ------------------------------------------------ */

static inline double k3_tree16(const double *a) {
    double b0 = (a[0] + a[4]) + (a[8] + a[12]);
    double b1 = (a[1] + a[5]) + (a[9] + a[13]);
    double b2 = (a[2] + a[6]) + (a[10] + a[14]);
    double b3 = (a[3] + a[7]) + (a[11] + a[15]);
    return (b0 + b1) + (b2 + b3);
}

/* One row's dot product in the 16-lane double order: lane l sums elements l, l+16, ...,
 * the lanes meet in k3_tree16, then the tail is added in ascending order.  x arrives
 * already widened to double (exact): the caller converts each input vector once per call
 * instead of once per output row.  WIDEN turns one stored weight into a float value. */
#define K3_DOT16(NAME, T, WIDEN)                                                        \
    static double NAME(const T *w, const double *x, long n) {                         \
        double a[16] = {0};                                                           \
        long nfull = n & ~15L, i;                                                     \
        for (i = 0; i < nfull; i += 16)                                               \
            for (int l = 0; l < 16; l++) a[l] += (double)WIDEN(w[i + l]) * x[i + l];  \
        double acc = k3_tree16(a);                                                    \
        for (; i < n; i++) acc += (double)WIDEN(w[i]) * x[i];                         \
        return acc;                                                                   \
    }
#define K3_AS_IS(v) (v)

K3_DOT16(k3_dot_f32_scalar, float, K3_AS_IS)
K3_DOT16(k3_dot_bf16_scalar, uint16_t, k3_bf16_to_f32)

/* I8R rows (a draft trunk's int8 container): the same order; the row's scale is applied
 * by the caller after the sum.  A draft only proposes, so this has no hand-written AVX2
 * twin: -O3 vectorises the lanes, and the order (hence the bits) is the same either way. */
K3_DOT16(k3_dot_i8, int8_t, K3_AS_IS)

#if K3_HAVE_AVX2_PATH
/* Lane l of the scalar form lives in vector l/4, element l%4 (v0 = lanes 0-3, v1 = 4-7,
 * v2 = 8-11, v3 = 12-15).  The tree b[l] = (a[l]+a[l+4]) + (a[l+8]+a[l+12]) is then
 * (v0+v1) + (v2+v3) lanewise, followed by (b0+b1) + (b2+b3). */
__attribute__((target("avx2")))
static inline double k3_tree16_avx(__m256d v0, __m256d v1, __m256d v2, __m256d v3) {
    __m256d b = _mm256_add_pd(_mm256_add_pd(v0, v1), _mm256_add_pd(v2, v3));
    double t[4];
    _mm256_storeu_pd(t, b);
    return (t[0] + t[1]) + (t[2] + t[3]);
}

__attribute__((target("avx2")))
static inline void k3_madd16_avx(__m256 w0, __m256 w1, const double *x, __m256d *v) {
    v[0] = _mm256_add_pd(v[0], _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(w0)),
                                             _mm256_loadu_pd(x)));
    v[1] = _mm256_add_pd(v[1], _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(w0, 1)),
                                             _mm256_loadu_pd(x + 4)));
    v[2] = _mm256_add_pd(v[2], _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(w1)),
                                             _mm256_loadu_pd(x + 8)));
    v[3] = _mm256_add_pd(v[3], _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(w1, 1)),
                                             _mm256_loadu_pd(x + 12)));
}

__attribute__((target("avx2")))
static double k3_dot_f32_avx2(const float *w, const double *x, long n) {
    __m256d v[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
    long nfull = n & ~15L, i;
    for (i = 0; i < nfull; i += 16)
        k3_madd16_avx(_mm256_loadu_ps(w + i), _mm256_loadu_ps(w + i + 8), x + i, v);
    double acc = k3_tree16_avx(v[0], v[1], v[2], v[3]);
    for (; i < n; i++) acc += (double)w[i] * x[i];
    return acc;
}

__attribute__((target("avx2")))
static double k3_dot_bf16_avx2(const uint16_t *w, const double *x, long n) {
    __m256d v[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
    long nfull = n & ~15L, i;
    for (i = 0; i < nfull; i += 16) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(w + i));
        /* widen 16 bf16 to 16 f32 by placing each in the top half of a 32-bit lane */
        __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw));
        __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1));
        k3_madd16_avx(_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
                      _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)), x + i, v);
    }
    double acc = k3_tree16_avx(v[0], v[1], v[2], v[3]);
    for (; i < n; i++) acc += (double)k3_bf16_to_f32(w[i]) * x[i];
    return acc;
}
#endif

/* ---- MXFP4 row (§5.6) ------------------------------------------------------------------ */

static const double K3_E2M1[16] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};

/* packed: n/2 bytes, element 2j in the LOW nibble of byte j; scales: n/32 E8M0 bytes.
 * Scale byte 255 (NaN in the OCP spec) makes its whole group contribute zero (trap #36). */
/* 2^(b-127) and 0.5 * 2^(b-127) for every E8M0 byte (255 is skipped before lookup). */
static double K3_E8M0[256], K3_E8M0_HALF[256];
static int k3_e8m0_ready = 0;

static void k3_e8m0_init(void) {
    if (k3_e8m0_ready) return;
    for (int b = 0; b < 256; b++) {
        K3_E8M0[b] = ldexp(1.0, b - 127);
        K3_E8M0_HALF[b] = ldexp(0.5, b - 127);
    }
    k3_e8m0_ready = 1;
}

static double k3_dot_mxfp4_scalar(const uint8_t *packed, const uint8_t *scales,
                                  const double *x, long n) {
    double acc = 0.0;
    long ngroups = n / 32;
    for (long g = 0; g < ngroups; g++) {
        uint8_t sb = scales[g];
        if (sb == 255) continue;
        const uint8_t *p = packed + g * 16;
        const double *xg = x + g * 32;
        double s[8] = {0};
        for (int e = 0; e < 32; e++) {
            uint8_t code = (e & 1) ? (p[e >> 1] >> 4) : (p[e >> 1] & 15);
            s[e & 7] += K3_E2M1[code] * xg[e];
        }
        double b0 = s[0] + s[4], b1 = s[1] + s[5], b2 = s[2] + s[6], b3 = s[3] + s[7];
        acc += ((b0 + b1) + (b2 + b3)) * K3_E8M0[sb];
    }
    return acc;
}

#if K3_HAVE_AVX2_PATH
/* Same order as the scalar form.  Codes are looked up as 2*E2M1 (small integers, so a
 * byte shuffle can decode them) and the group sum is scaled by 0.5*2^(b-127): an exact
 * power-of-two rescaling, so the bits equal the scalar path. */
__attribute__((target("avx2")))
static double k3_dot_mxfp4_avx2(const uint8_t *packed, const uint8_t *scales,
                                const double *x, long n) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i mask = _mm_set1_epi8(15);
    double acc = 0.0;
    long ngroups = n / 32;
    for (long g = 0; g < ngroups; g++) {
        uint8_t sb = scales[g];
        if (sb == 255) continue;
        __m128i bytes = _mm_loadu_si128((const __m128i *)(packed + g * 16));
        __m128i lo = _mm_and_si128(bytes, mask);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        /* interleave back to element order: e0=lo0, e1=hi0, e2=lo1, ... */
        __m128i d0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));   /* elements 0-15 */
        __m128i d1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));   /* elements 16-31 */
        const double *xg = x + g * 32;
        /* element e goes to lane e%8: A holds lanes 0-3, B lanes 4-7; per lane the terms
         * arrive in ascending element order (e, e+8, e+16, e+24) as in the scalar form */
        __m256d A = _mm256_setzero_pd(), B = _mm256_setzero_pd();
        __m128i parts[2] = {d0, d1};
        for (int h = 0; h < 2; h++) {
            __m128i c = parts[h];
            for (int q = 0; q < 2; q++) {         /* 8 codes at a time */
                __m128i c8 = q ? _mm_srli_si128(c, 8) : c;
                __m128i c4a = _mm_cvtepi8_epi32(c8);
                __m128i c4b = _mm_cvtepi8_epi32(_mm_srli_si128(c8, 4));
                const double *xq = xg + 16 * h + 8 * q;
                A = _mm256_add_pd(A, _mm256_mul_pd(_mm256_cvtepi32_pd(c4a), _mm256_loadu_pd(xq)));
                B = _mm256_add_pd(B, _mm256_mul_pd(_mm256_cvtepi32_pd(c4b), _mm256_loadu_pd(xq + 4)));
            }
        }
        __m256d b = _mm256_add_pd(A, B);           /* b[l] = s[l] + s[l+4] */
        __m256d hs = _mm256_hadd_pd(b, b);         /* [b0+b1, b0+b1, b2+b3, b2+b3] */
        __m128d sub = _mm_add_sd(_mm256_castpd256_pd128(hs), _mm256_extractf128_pd(hs, 1));
        acc += _mm_cvtsd_f64(sub) * K3_E8M0_HALF[sb];
    }
    return acc;
}
#endif

/* ---- dispatch ------------------------------------------------------------------------ */

static int k3_use_avx2 = -1;   /* -1 = not yet probed; forced to 0 by k3_force_scalar() */

static inline int k3_avx2(void) {
#if K3_HAVE_AVX2_PATH
    if (k3_use_avx2 < 0) {
        __builtin_cpu_init();
        k3_use_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return k3_use_avx2;
#else
    return 0;
#endif
}

static void k3_set_simd(int on) { k3_use_avx2 = on ? -1 : 0; if (on) (void)k3_avx2(); }

static inline double k3_dot_f32(const float *w, const double *x, long n) {
#if K3_HAVE_AVX2_PATH
    if (k3_avx2()) return k3_dot_f32_avx2(w, x, n);
#endif
    return k3_dot_f32_scalar(w, x, n);
}

static inline double k3_dot_bf16(const uint16_t *w, const double *x, long n) {
#if K3_HAVE_AVX2_PATH
    if (k3_avx2()) return k3_dot_bf16_avx2(w, x, n);
#endif
    return k3_dot_bf16_scalar(w, x, n);
}

static inline double k3_dot_mxfp4(const uint8_t *p, const uint8_t *s, const double *x, long n) {
#if K3_HAVE_AVX2_PATH
    if (k3_avx2()) return k3_dot_mxfp4_avx2(p, s, x, n);
#endif
    return k3_dot_mxfp4_scalar(p, s, x, n);
}

#endif
