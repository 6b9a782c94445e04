/* Row dot products with the exact reduction orders of ARCHITECTURE §5.3 and §5.6.
 *
 * Written in C rather than Cython for one reason: the SIMD paths need intrinsics and a
 * runtime CPU check, so a portable build still runs at memory speed.  Every path computes
 * the same bits: products of two float32 (or bf16 / int8 / E2M1 x float32) values are exact
 * in double, so fma(w, x, a) rounds exactly like a + w*x, and only the ORDER of the double
 * additions matters; every variant below keeps the 16-lane tree (matvec) and the
 * 8-lane-per-group tree (MXFP4) of the reference.
 * Built with -ffp-contract=off; never -ffast-math (that would reassociate the tree).
 *
 * Three instruction sets, chosen AT RUN TIME (the portable build emits all three; a path
 * runs only when __builtin_cpu_supports says the CPU has it): scalar (the reference form,
 * multiply then add), avx2 (AVX2 + FMA, 4 doubles per vector) and avx512 (F/BW/VL/DQ,
 * 8 doubles per vector).  K3_KERNEL_ISA or k3_set_isa() forces one, so tests compare them.
 *
 * Tiles: a SIMD kernel computes R rows x B tokens at once (matvec R <= 4, B <= 2 on
 * AVX-512; MXFP4 on AVX-512 8 rows in lanes x B <= 4, on AVX2 4 rows or 4 tokens whose
 * group sums share a vector): each weight block is widened (or its
 * nibbles decoded) once and applied to every token of the tile while it is in registers,
 * and each x block is loaded once for all rows of the tile.  Every (row, token) pair keeps
 * its own accumulators in its own order, so the tile shape never changes a bit
 * (tests/test_kernels.py proves it for T = 1..9 at 1 and 2 threads, and for every row
 * remainder at T = 1).  From 5 tokens on, AVX-512 runs BF16, F32 and I8R through panels
 * instead (below the tiles): a row block widened once for up to 48 tokens.  MXFP4 has no
 * panel: there every FMA already waits on its own broadcast of x, and a panel adds a load
 * of the decoded weights to each (measured 0.67-0.95x the tiles).  An MXFP4 call of 1-2 tokens
 * runs on integer byte products instead where a CPU has AVX-512 VNNI (k3mxint.h).
 */
#ifndef K3DOT_H
#define K3DOT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define K3_HAVE_SIMD_PATHS 1
#include <immintrin.h>
#else
#define K3_HAVE_SIMD_PATHS 0
#endif

enum { K3_ISA_SCALAR = 0, K3_ISA_AVX2 = 1, K3_ISA_AVX512 = 2 };

static inline float k3_bf16_to_f32(uint16_t b) {
    uint32_t u = ((uint32_t)b) << 16;   /* BF16 widening is a shift, never a rounding */
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Y[t, o] = f32(sum), times the row's scale (I8R) first when there is one. */
static inline void k3_put(float *Y, long ldy, long t, long o, const float *scale, double d) {
    if (scale) d = (double)scale[o] * d;
    Y[t * ldy + o] = (float)d;
}

/* ---- scalar reference: 16-lane double matvec row (§5.3) ------------------------------ */

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
 * by the caller after the sum. */
K3_DOT16(k3_dot_i8_scalar, int8_t, K3_AS_IS)

/* ---- scalar reference: MXFP4 row (§5.6) ---------------------------------------------- */

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

/* ---- tile drivers ---------------------------------------------------------------------- */

/* A tile computes rows w, w+ldw (R of them) against tokens x, x+ldx, ... (B of them) and
 * writes the double sums to out[r * B + b].  KERNEL_RB(R, B) names the instantiation. */
#define K3_TILE_CASES(PREFIX, ARGS)                                                         \
    case 8 + 1: PREFIX##_1_1 ARGS; break;  case 8 + 2: PREFIX##_1_2 ARGS; break;            \
    case 8 + 3: PREFIX##_1_3 ARGS; break;  case 8 + 4: PREFIX##_1_4 ARGS; break;            \
    case 16 + 1: PREFIX##_2_1 ARGS; break; case 16 + 2: PREFIX##_2_2 ARGS; break;           \
    case 16 + 3: PREFIX##_2_3 ARGS; break; case 16 + 4: PREFIX##_2_4 ARGS; break;
/* the tiles also come 3 x 1 and 4 x 1 (T = 1: 4 rows per pass) */
#define K3_TILE_SWITCH(PREFIX, R, B, ARGS)                                                  \
    switch ((R) * 8 + (B)) {                                                                \
    K3_TILE_CASES(PREFIX, ARGS)                                                             \
    case 24 + 1: PREFIX##_3_1 ARGS; break; case 32 + 1: PREFIX##_4_1 ARGS; break;           \
    default: abort();                                                                       \
    }
#define K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, R, B)                                      \
    ATTR static void PREFIX##_##R##_##B(const T *w, long ldw, const double *x, long ldx,    \
                                        long n, double *out) {                              \
        BODY(w, ldw, x, ldx, n, out, R, B);                                                 \
    }
#define K3_TILE_INSTANCES(PREFIX, ATTR, BODY, T)                                            \
    K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 1, 1) K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 1, 2) \
    K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 1, 3) K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 1, 4) \
    K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 2, 1) K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 2, 2) \
    K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 2, 3) K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 2, 4) \
    K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 3, 1) K3_TILE_INSTANCE(PREFIX, ATTR, BODY, T, 4, 1)

#if K3_HAVE_SIMD_PATHS

#define K3_AVX2_ATTR __attribute__((target("avx2,fma")))
#define K3_AVX512_ATTR __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")))
#define K3_INLINE static inline __attribute__((always_inline))
/* Software prefetch of the weight rows K3_PF_BYTES ahead of the loads.  Why: with only
 * the hardware prefetchers a core streamed BF16 rows at ~55 % of its plain read rate
 * (the widening work and the loads then alternate instead of overlapping); prefetching
 * ahead in every row of the tile keeps enough lines in flight.  Near the end of a row the
 * address moves on to the same row of the NEXT tile (R rows further), so a new tile does
 * not start cold.  A prefetch never faults: past the matrix it is dropped.
 * Into L2 (T1), 4 KB ahead: prefetches into L1 hold the core's few L1 miss buffers, so
 * fewer lines were in flight; on Zen 4 a 2048-wide BF16 matvec from DRAM went from 13-14
 * to 19-21 GB/s at 1 thread and 21-25 to 29-32 at 2, and mid's resident decode step from
 * 107-115 to 87-88 ms (L1 / 2 KB before; docs/benchmarks-kernels.md). */
#ifndef K3_PF_BYTES
#define K3_PF_BYTES 4096
#endif
/* The MXFP4 double path's own distance (one line per row of its 8-row blocks, into L1) */
#ifndef K3_MX_PF_BYTES
#define K3_MX_PF_BYTES 2048
#endif
#define K3_PREFETCH_SETUP(T, w, ldw, n, R)                                                  \
    const long pf_ahead = K3_PF_BYTES / (long)sizeof(T);                                    \
    const long pf_wrap = (long)(R) * (ldw) - (n);  /* row r -> row r + R, same offset */    \
    const long pf_split = (n) - pf_ahead;
#define K3_PREFETCH_ROWS(w, ldw, i, R)                                                      \
    {                                                                                       \
        const char *pf_p =                                                                  \
            (const char *)((w) + (i) + pf_ahead + ((i) >= pf_split ? pf_wrap : 0));         \
        for (int r = 0; r < (R); r++)                                                       \
            _mm_prefetch(pf_p + r * (ldw) * (long)sizeof(*(w)), _MM_HINT_T1);              \
    }

/* ---- AVX2: 16 weights -> four 4-double vectors ---------------------------------------- */
/* Lane l of the scalar form lives in vector l/4, element l%4 (v0 = lanes 0-3, v1 = 4-7,
 * v2 = 8-11, v3 = 12-15).  The tree b[l] = (a[l]+a[l+4]) + (a[l+8]+a[l+12]) is then
 * (v0+v1) + (v2+v3) lanewise, followed by (b0+b1) + (b2+b3). */
K3_AVX2_ATTR K3_INLINE void k3_w16_f32_avx2(const float *w, __m256d *v) {
    v[0] = _mm256_cvtps_pd(_mm_loadu_ps(w));
    v[1] = _mm256_cvtps_pd(_mm_loadu_ps(w + 4));
    v[2] = _mm256_cvtps_pd(_mm_loadu_ps(w + 8));
    v[3] = _mm256_cvtps_pd(_mm_loadu_ps(w + 12));
}
/* bf16 -> f32 is the bf16 in the top half of a 32-bit lane: interleaving zero words below
 * the raw words within each 128-bit half gives elements 0-3 | 8-11 and 4-7 | 12-15 as
 * float32.  Why: the zero-extend + shift form spent 2 lane-crossing extends and 2 shifts
 * per 16 weights where 2 in-lane unpacks do. */
K3_AVX2_ATTR K3_INLINE void k3_w16_bf16_avx2(const uint16_t *w, __m256d *v) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)w), z = _mm256_setzero_si256();
    __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, raw));   /* 0-3 | 8-11 */
    __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, raw));   /* 4-7 | 12-15 */
    v[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(lo));
    v[1] = _mm256_cvtps_pd(_mm256_castps256_ps128(hi));
    v[2] = _mm256_cvtps_pd(_mm256_extractf128_ps(lo, 1));
    v[3] = _mm256_cvtps_pd(_mm256_extractf128_ps(hi, 1));
}
K3_AVX2_ATTR K3_INLINE void k3_w16_i8_avx2(const int8_t *w, __m256d *v) {
    __m128i raw = _mm_loadu_si128((const __m128i *)w);
    __m256i lo = _mm256_cvtepi8_epi32(raw), hi = _mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8));
    v[0] = _mm256_cvtepi32_pd(_mm256_castsi256_si128(lo));
    v[1] = _mm256_cvtepi32_pd(_mm256_extracti128_si256(lo, 1));
    v[2] = _mm256_cvtepi32_pd(_mm256_castsi256_si128(hi));
    v[3] = _mm256_cvtepi32_pd(_mm256_extracti128_si256(hi, 1));
}

K3_AVX2_ATTR K3_INLINE double k3_tree16_avx2(const __m256d *v) {
    __m256d b = _mm256_add_pd(_mm256_add_pd(v[0], v[1]), _mm256_add_pd(v[2], v[3]));
    double t[4];
    _mm256_storeu_pd(t, b);
    return (t[0] + t[1]) + (t[2] + t[3]);
}

/* R x B tile of the 16-lane matvec for one ISA: VEC holds VL doubles, NV = 16 / VL
 * vectors hold one block of 16 lanes; WIDEN16 widens 16 stored weights into NV vectors,
 * XLOAD16 loads the 16 matching inputs into NV vectors in the same lane order, WIDEN is
 * the scalar widening for the tail, TREE the lanes' fixed reduction tree. */
#define K3_MV_TILE(NAME, ATTR, T, VEC, NV, VL, ZERO, XLOAD16, FMADD, WIDEN16, WIDEN, TREE)    \
    ATTR K3_INLINE void NAME(const T *w, long ldw, const double *x, long ldx, long n,       \
                             double *out, const int R, const int B)                         \
    {                                                                                       \
        VEC acc[4][4][NV], wv[4][NV];                                                       \
        for (int r = 0; r < R; r++)                                                         \
            for (int b = 0; b < B; b++)                                                     \
                for (int k = 0; k < NV; k++) acc[r][b][k] = ZERO();                         \
        long nfull = n & ~15L, i;                                                           \
        K3_PREFETCH_SETUP(T, w, ldw, n, R)                                                  \
        for (i = 0; i < nfull; i += 16) {                                                   \
            K3_PREFETCH_ROWS(w, ldw, i, R)                                                  \
            for (int r = 0; r < R; r++) WIDEN16(w + r * ldw + i, wv[r]);                    \
            for (int b = 0; b < B; b++) {                                                   \
                VEC xv[NV];                                                                 \
                XLOAD16(x + b * ldx + i, xv);                                               \
                for (int k = 0; k < NV; k++)                                                \
                    for (int r = 0; r < R; r++)                                             \
                        acc[r][b][k] = FMADD(wv[r][k], xv[k], acc[r][b][k]);                \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < R; r++)                                                         \
            for (int b = 0; b < B; b++) {                                                   \
                double d = TREE(acc[r][b]);                                                 \
                for (long j = i; j < n; j++)                                                \
                    d += (double)WIDEN(w[r * ldw + j]) * x[b * ldx + j];                    \
                out[r * B + b] = d;                                                         \
            }                                                                               \
    }
K3_AVX2_ATTR K3_INLINE void k3_x16_avx2(const double *x, __m256d *v) {
    for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_pd(x + 4 * k);
}
#define K3_MV_TILE_AVX2(WIDEN16, WIDEN, T)                                                  \
    K3_MV_TILE(k3_mv_tile_avx2_##WIDEN16, K3_AVX2_ATTR, T, __m256d, 4, 4, _mm256_setzero_pd, \
               k3_x16_avx2, _mm256_fmadd_pd, WIDEN16, WIDEN, k3_tree16_avx2)

/* ---- AVX-512: 16 weights -> two 8-double vectors -------------------------------------- */
/* v0 holds lanes 0-7, v1 lanes 8-15.  The tree: (lo4(v0) + hi4(v0)) = a[l] + a[l+4] and
 * (lo4(v1) + hi4(v1)) = a[l+8] + a[l+12]; their sum is b[l]; then (b0+b1) + (b2+b3). */
K3_AVX512_ATTR K3_INLINE void k3_w16_f32_avx512(const float *w, __m512d *v) {
    v[0] = _mm512_cvtps_pd(_mm256_loadu_ps(w));
    v[1] = _mm512_cvtps_pd(_mm256_loadu_ps(w + 8));
}
K3_AVX512_ATTR K3_INLINE void k3_w16_bf16_avx512(const uint16_t *w, __m512d *v) {
    __m512i wide = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16);
    v[0] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_castsi512_si256(wide)));
    v[1] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(wide, 1)));
}
/* int8 -> int64 -> double (AVX512DQ): 2 uops per 8 weights instead of 3 through int32 (the
 * int32 -> double convert crosses 128-bit lanes, the int64 one does not); exact, |q| <= 128 */
K3_AVX512_ATTR K3_INLINE void k3_w16_i8_avx512(const int8_t *w, __m512d *v) {
    v[0] = _mm512_cvtepi64_pd(_mm512_cvtepi8_epi64(_mm_loadl_epi64((const __m128i *)w)));
    v[1] = _mm512_cvtepi64_pd(_mm512_cvtepi8_epi64(_mm_loadl_epi64((const __m128i *)(w + 8))));
}

K3_AVX512_ATTR K3_INLINE double k3_tree16_avx512(const __m512d *v) {
    __m256d p = _mm256_add_pd(_mm512_castpd512_pd256(v[0]), _mm512_extractf64x4_pd(v[0], 1));
    __m256d q = _mm256_add_pd(_mm512_castpd512_pd256(v[1]), _mm512_extractf64x4_pd(v[1], 1));
    __m256d b = _mm256_add_pd(p, q);
    double t[4];
    _mm256_storeu_pd(t, b);
    return (t[0] + t[1]) + (t[2] + t[3]);
}

K3_AVX512_ATTR K3_INLINE void k3_x16_avx512(const double *x, __m512d *v) {
    v[0] = _mm512_loadu_pd(x);
    v[1] = _mm512_loadu_pd(x + 8);
}

/* BF16 in the tiles (decode): even lanes in v0, odd lanes in v1.  16 bf16 as 8 dwords hold
 * element 2j in the low half and 2j+1 in the high half of dword j, so a shift gives the
 * evens as float32 and a mask the odds, in 256-bit registers: no lane-crossing zero-extend
 * and no extract.  Why: on Zen 4 those two 512-bit shuffles shared the vector ports with
 * the converts (1 a cycle each); a core ran 6.2-9.3 G weights/s from L2/L3, this 8.0-12.1
 * (benchmarks/bench_cached_kernels.py alternated with the old build, docs/benchmarks-
 * kernels.md, Zen 4).  The inputs are permuted the same way (two permutes per block,
 * shared by the tile's rows) and the sums un-permuted before the tree: each lane still sums
 * the same elements in the same order, so the bits are the plain tile's
 * (tests/test_kernels.py compares every path with the scalar reference). */
K3_AVX512_ATTR K3_INLINE void k3_w16_bf16_eo_avx512(const uint16_t *w, __m512d *v) {
    __m256i d = _mm256_loadu_si256((const __m256i *)w);
    v[0] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(d, 16)));
    v[1] = _mm512_cvtps_pd(_mm256_castsi256_ps(
        _mm256_and_si256(d, _mm256_set1_epi32((int)0xFFFF0000u))));
}
K3_AVX512_ATTR K3_INLINE void k3_x16_eo_avx512(const double *x, __m512d *v) {
    __m512d lo = _mm512_loadu_pd(x), hi = _mm512_loadu_pd(x + 8);
    v[0] = _mm512_permutex2var_pd(lo, _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), hi);
    v[1] = _mm512_permutex2var_pd(lo, _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15), hi);
}
K3_AVX512_ATTR K3_INLINE double k3_tree16_eo_avx512(const __m512d *v) {
    __m512d nat[2];   /* back to lanes 0-7 | 8-15 */
    nat[0] = _mm512_permutex2var_pd(v[0], _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), v[1]);
    nat[1] = _mm512_permutex2var_pd(v[0], _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15), v[1]);
    return k3_tree16_avx512(nat);
}

#define K3_MV_TILE_AVX512(WIDEN16, WIDEN, T, XLOAD16, TREE)                                 \
    K3_MV_TILE(k3_mv_tile_avx512_##WIDEN16, K3_AVX512_ATTR, T, __m512d, 2, 8,                 \
               _mm512_setzero_pd, XLOAD16, _mm512_fmadd_pd, WIDEN16, WIDEN, TREE)

K3_MV_TILE_AVX2(k3_w16_f32_avx2, K3_AS_IS, float)
K3_MV_TILE_AVX2(k3_w16_bf16_avx2, k3_bf16_to_f32, uint16_t)
K3_MV_TILE_AVX2(k3_w16_i8_avx2, K3_AS_IS, int8_t)
K3_MV_TILE_AVX512(k3_w16_f32_avx512, K3_AS_IS, float, k3_x16_avx512, k3_tree16_avx512)
K3_MV_TILE_AVX512(k3_w16_bf16_avx512, k3_bf16_to_f32, uint16_t, k3_x16_avx512, k3_tree16_avx512)
K3_MV_TILE_AVX512(k3_w16_bf16_eo_avx512, k3_bf16_to_f32, uint16_t, k3_x16_eo_avx512,
                  k3_tree16_eo_avx512)
K3_MV_TILE_AVX512(k3_w16_i8_avx512, K3_AS_IS, int8_t, k3_x16_avx512, k3_tree16_avx512)
/* even/odd at T = 1 only: with B tokens a block's inputs take 2B permutes for R rows (B = 4,
 * R = 2: 8 permutes per 16 FMAs), and the 2 x 4 tile measured ~15 % slower from L3 */
K3_AVX512_ATTR K3_INLINE void k3_mv_tile_avx512_bf16(const uint16_t *w, long ldw,
                                                     const double *x, long ldx, long n,
                                                     double *out, const int R, const int B) {
    if (B == 1) k3_mv_tile_avx512_k3_w16_bf16_eo_avx512(w, ldw, x, ldx, n, out, R, 1);
    else k3_mv_tile_avx512_k3_w16_bf16_avx512(w, ldw, x, ldx, n, out, R, B);
}

K3_TILE_INSTANCES(k3_mv_f32_avx2, K3_AVX2_ATTR, k3_mv_tile_avx2_k3_w16_f32_avx2, float)
K3_TILE_INSTANCES(k3_mv_bf16_avx2, K3_AVX2_ATTR, k3_mv_tile_avx2_k3_w16_bf16_avx2, uint16_t)
K3_TILE_INSTANCES(k3_mv_i8_avx2, K3_AVX2_ATTR, k3_mv_tile_avx2_k3_w16_i8_avx2, int8_t)
K3_TILE_INSTANCES(k3_mv_f32_avx512, K3_AVX512_ATTR, k3_mv_tile_avx512_k3_w16_f32_avx512, float)
K3_TILE_INSTANCES(k3_mv_bf16_avx512, K3_AVX512_ATTR, k3_mv_tile_avx512_bf16, uint16_t)
K3_TILE_INSTANCES(k3_mv_i8_avx512, K3_AVX512_ATTR, k3_mv_tile_avx512_k3_w16_i8_avx512, int8_t)

/* ---- panels: prefill's matvecs (T >= k3_panel_min_tokens) ---------------------------- */
/* The tiles above widen a weight block for a few tokens only (2 x 4 on AVX-512, 1 x 2 on
 * AVX2), and each FMA waits on the widening uops of its block on the same vector ports
 * (BF16 prefill ran at ~40 % of the double-FMA peak on AVX-512, 6.6 G multiply-adds/s per
 * Zen 3 core on AVX2).  A panel widens 4 rows x K3_PANEL_K weights ONCE into an L1 buffer
 * of doubles and runs every token of a block over it, 4 rows x PB tokens at a time (the
 * widened rows loaded once per PB tokens); between k-blocks each (row, token)'s 16 lane
 * sums wait in a small buffer.  Each pass over the k-block sums one vector of the 16
 * lanes (AVX-512: 2 passes of 8 lanes, 4 x 6 = 24 accumulators, 6 inputs, 1 weight
 * vector; AVX2, 16 registers: 4 passes of 4 lanes, 4 x 3 = 12 accumulators), reading the
 * block again from L1.  Why 4 x 6 on AVX-512, not all 16 lanes of 4 x 3: that loaded 7
 * vectors per 12 FMAs, this 10 per 24, and the loop in L1 ran 38.5 -> 44.5 G
 * multiply-adds/s (a /tmp harness; 4 x 5, 5 x 5 and 6 x 4 measured the same as 4 x 6).
 * Each lane still sums its elements in ascending order from +0.0 and meets the others in
 * the same tree, then the tail: the same bits as the tile (tests/test_kernels.py,
 * T = 1..50 against one-token calls, a ragged k-block, ragged row and token tiles, every
 * ISA at 1 and 2 threads). */
#define K3_PANEL_MIN_TOKENS 5      /* below: the tiles (T = 2..4 measured as fast or faster) */
static long k3_panel_min_tokens = K3_PANEL_MIN_TOKENS;    /* benchmarks A/B it */
static void k3_set_panel_min_tokens(long t) {
    k3_panel_min_tokens = t > 0 ? t : K3_PANEL_MIN_TOKENS;
}
/* Tokens whose widened inputs (n doubles each) fit in `bytes`, a multiple of `mult` and
 * at least one multiple: the token blocks of the panels and of the row drivers. */
static inline long k3_tokens_fitting(long bytes, long n, long mult) {
    long tb = bytes / (n * (long)sizeof(double) + 1);
    return tb < mult ? mult : tb / mult * mult;
}
#define K3_PANEL_R 4
#define K3_PANEL_K 256            /* 4 widened rows: 8 KB */
#define K3_PANEL_MAX_TOKENS 48    /* per token block: 4 x 48 lane sums, 24 KB */
#define K3_PANEL_X_BYTES (1L << 20)  /* a block's widened inputs stay in L2 across rows */
/* Inputs wider than K3_PANEL_X_BYTES / 48 doubles (2,730) cut a panel's token block short
 * of K3_PANEL_MAX_TOKENS, so each widened k-block serves fewer tokens (18 at 7,168).  On
 * AMD's AVX-512 cores the 2 x 4 tiles then run faster: Zen 4, T = 64, 1 and 2 threads,
 * panel / tiles 0.74-0.82 for BF16 at 7168 x 7168, 1536 x 7168 and 2048 x 7168, 0.77-0.78
 * for F32 and I8R at 2048 x 7168, against 0.91-1.18 at 512-3,072 inputs; a 4 MiB block
 * (48 tokens) brought the panel to 0.89-0.91 (docs/benchmarks-kernels.md, 2026-12-03
 * 20:17).  Elsewhere the panels measured ahead at these widths (the 2026-12-01 table,
 * against that day's tiles), so other CPUs keep them.  -1: decide by the CPU; 0: panels;
 * 1: tiles.  No bit depends on it (tests/test_kernels.py runs both). */
#define K3_PANEL_WIDE_INPUTS (K3_PANEL_X_BYTES / ((long)sizeof(double) * K3_PANEL_MAX_TOKENS))
static int k3_panel_wide_tiles = 0;   /* the CPU's choice is set at module load */
static void k3_set_panel_wide_tiles(int mode) {
    if (mode < 0) {
#if K3_HAVE_SIMD_PATHS
        __builtin_cpu_init();
        mode = __builtin_cpu_is("amd");
#else
        mode = 0;
#endif
    }
    k3_panel_wide_tiles = mode != 0;
}
static int k3_panel_wide_tiles_on(void) { return k3_panel_wide_tiles; }
static inline int k3_panel_takes(long n) {
    return n <= K3_PANEL_WIDE_INPUTS || !k3_panel_wide_tiles;
}

/* One ISA's panel tile, 4 rows x B <= PB tokens: VEC holds VL doubles, NV = 16 / VL
 * vectors hold a 16-lane block, one of them summed per pass over the k-block. */
#define K3_PANEL_TILE(ISA, ATTR, VEC, VL, NV, PB, ZERO, LOAD, LOADA, STORE, FMADD)      \
    ATTR K3_INLINE void k3_panel_tile_##ISA(const double *wb, const double *x, long ldx,    \
                                            double *sums, int first, long kb, const int B) { \
        for (int k = 0; k < NV; k++) {                                                      \
            VEC acc[K3_PANEL_R][PB];                                                        \
            for (int r = 0; r < K3_PANEL_R; r++)                                            \
                for (int b = 0; b < B; b++)                                                 \
                    acc[r][b] = first ? ZERO() : LOAD(sums + (r * PB + b) * 16 + VL * k);   \
            for (long i = 0; i < kb; i += 16) {                                             \
                VEC xv[PB];                                                                 \
                for (int b = 0; b < B; b++) xv[b] = LOAD(x + b * ldx + i + VL * k);         \
                for (int r = 0; r < K3_PANEL_R; r++) {                                      \
                    VEC wv = LOADA(wb + r * K3_PANEL_K + i + VL * k);                       \
                    /* keep wv in a register: folded into B FMAs as memory operands, the   \
                     * panel became load-bound (AVX2, 3 tokens: 30 loads per 24 FMAs,       \
                     * ~1.6x slower) */                                                     \
                    __asm__("" : "+v"(wv));                                                 \
                    for (int b = 0; b < B; b++) acc[r][b] = FMADD(wv, xv[b], acc[r][b]);    \
                }                                                                           \
            }                                                                               \
            for (int r = 0; r < K3_PANEL_R; r++)                                            \
                for (int b = 0; b < B; b++)                                                 \
                    STORE(sums + (r * PB + b) * 16 + VL * k, acc[r][b]);                    \
        }                                                                                   \
    }                                                                                       \
    K3_PANEL_TILE_INSTANCE(ISA, ATTR, 1) K3_PANEL_TILE_INSTANCE(ISA, ATTR, 2)                \
    K3_PANEL_TILE_INSTANCE(ISA, ATTR, 3)
#define K3_PANEL_TILE_INSTANCE(ISA, ATTR, B)                                                \
    ATTR static void k3_panel_tile_##ISA##_##B(const double *wb, const double *x, long ldx, \
                                               double *sums, int first, long kb) {          \
        k3_panel_tile_##ISA(wb, x, ldx, sums, first, kb, B);                                \
    }
K3_PANEL_TILE(avx512, K3_AVX512_ATTR, __m512d, 8, 2, 6, _mm512_setzero_pd,
              _mm512_loadu_pd, _mm512_load_pd, _mm512_storeu_pd, _mm512_fmadd_pd)
K3_PANEL_TILE_INSTANCE(avx512, K3_AVX512_ATTR, 4) K3_PANEL_TILE_INSTANCE(avx512, K3_AVX512_ATTR, 5)
K3_PANEL_TILE_INSTANCE(avx512, K3_AVX512_ATTR, 6)
K3_PANEL_TILE(avx2, K3_AVX2_ATTR, __m256d, 4, 4, 3, _mm256_setzero_pd,
              _mm256_loadu_pd, _mm256_load_pd, _mm256_storeu_pd, _mm256_fmadd_pd)
/* tiles of B = 1 .. PB tokens, entry B - 1 */
typedef void (*k3_panel_tile_fn)(const double *, const double *, long, double *, int, long);
static const k3_panel_tile_fn k3_panel_tiles_avx512[6] = {
    k3_panel_tile_avx512_1, k3_panel_tile_avx512_2, k3_panel_tile_avx512_3,
    k3_panel_tile_avx512_4, k3_panel_tile_avx512_5, k3_panel_tile_avx512_6};
static const k3_panel_tile_fn k3_panel_tiles_avx2[3] = {
    k3_panel_tile_avx2_1, k3_panel_tile_avx2_2, k3_panel_tile_avx2_3};

/* Rows [o0, o1) x tokens [0, ntok), as K3_MV_ROWS below (which calls it). */
#define K3_MV_PANEL(NAME, ISA, ATTR, VEC, VL, NV, PB, LOAD, STORE, ZERO, TREE, T, WIDEN16,    \
                    WIDEN)                                                                  \
    ATTR static void NAME(const T *W, long ldw, long n, long o0, long o1,                   \
                          const double *Xd, long ntok, const float *scale,                  \
                          float *Y, long ldy) {                                             \
        double wb[K3_PANEL_R * K3_PANEL_K] __attribute__((aligned(64)));                    \
        double sums[K3_PANEL_MAX_TOKENS * K3_PANEL_R * 16];                                 \
        const long nfull = n & ~15L, per_tile = K3_PANEL_R * PB * 16;                       \
        long tb = k3_tokens_fitting(K3_PANEL_X_BYTES, n, PB);                              \
        if (tb > K3_PANEL_MAX_TOKENS) tb = K3_PANEL_MAX_TOKENS;                             \
        if (tb < 2 * PB) tb = 2 * PB;                                                       \
        for (long t0 = 0; t0 < ntok; t0 += tb) {                                            \
            long t1 = ntok - t0 < tb ? ntok : t0 + tb;                                      \
            for (long o = o0; o < o1; o += K3_PANEL_R) {                                    \
                int R = (o1 - o) < K3_PANEL_R ? (int)(o1 - o) : K3_PANEL_R;                 \
                for (long k0 = 0; k0 < nfull; k0 += K3_PANEL_K) {                           \
                    long kb = nfull - k0 < K3_PANEL_K ? nfull - k0 : K3_PANEL_K;            \
                    for (int r = 0; r < K3_PANEL_R; r++) {   /* rows past R: row 0 again */ \
                        const T *w = W + (o + (r < R ? r : 0)) * ldw + k0;                  \
                        for (long i = 0; i < kb; i += 16) {                                 \
                            VEC v[NV];                                                      \
                            WIDEN16(w + i, v);                                              \
                            for (int k = 0; k < NV; k++)                                    \
                                STORE(wb + r * K3_PANEL_K + i + VL * k, v[k]);              \
                        }                                                                   \
                    }                                                                       \
                    double *s = sums;                                                       \
                    for (long t = t0; t < t1; t += PB, s += per_tile) {                     \
                        const long B = t1 - t < PB ? t1 - t : PB;                           \
                        k3_panel_tiles_##ISA[B - 1](wb, Xd + t * n + k0, n, s, k0 == 0, kb); \
                    }                                                                       \
                }                                                                           \
                const double *s = sums;                                                     \
                for (long t = t0; t < t1; t += PB, s += per_tile) {                         \
                    int B = t1 - t < PB ? (int)(t1 - t) : PB;                               \
                    for (int r = 0; r < R; r++)                                             \
                        for (int b = 0; b < B; b++) {                                       \
                            const double *a = s + (r * PB + b) * 16;                        \
                            VEC v[NV];                                                      \
                            for (int k = 0; k < NV; k++) v[k] = nfull ? LOAD(a + VL * k) : ZERO(); \
                            double d = TREE(v);                                             \
                            const T *w = W + (o + r) * ldw;                                 \
                            const double *x = Xd + (t + b) * n;                             \
                            for (long j = nfull; j < n; j++) d += (double)WIDEN(w[j]) * x[j]; \
                            k3_put(Y, ldy, t + b, o + r, scale, d);                         \
                        }                                                                   \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }
#define K3_MV_PANEL_AVX512(KIND, T, WIDEN)                                                  \
    K3_MV_PANEL(k3_mv_panel_##KIND##_avx512, avx512, K3_AVX512_ATTR, __m512d, 8, 2, 6,      \
                _mm512_loadu_pd, _mm512_store_pd, _mm512_setzero_pd, k3_tree16_avx512, T,   \
                k3_w16_##KIND##_avx512, WIDEN)
#define K3_MV_PANEL_AVX2(KIND, T, WIDEN)                                                    \
    K3_MV_PANEL(k3_mv_panel_##KIND##_avx2, avx2, K3_AVX2_ATTR, __m256d, 4, 4, 3,            \
                _mm256_loadu_pd, _mm256_store_pd, _mm256_setzero_pd, k3_tree16_avx2, T,     \
                k3_w16_##KIND##_avx2, WIDEN)
/* the three matvec kinds: name, stored type, scalar widening */
#define K3_MV_KINDS(M) \
    M(f32, float, K3_AS_IS) M(bf16, uint16_t, k3_bf16_to_f32) M(i8, int8_t, K3_AS_IS)
K3_MV_KINDS(K3_MV_PANEL_AVX512)
K3_MV_KINDS(K3_MV_PANEL_AVX2)

/* ---- MXFP4 tiles -------------------------------------------------------------------- */
/* Element e of a group goes to lane e%8; vector k of a group holds elements 8k..8k+7, so
 * lane l receives e = l, l+8, l+16, l+24 in ascending order, as in the scalar form.  The
 * codes are decoded by table straight to the exact E2M1 doubles, once per tile, and every
 * (row, token) accumulator starts at +0.0 like the scalar s[l] (so a -0.0 product cannot
 * leave a -0.0 behind). */

/* AVX2 decode.  Each value 2*E2M1 (a small integer) is a double whose low six bytes are
 * zero, so two byte tables give its top two bytes and byte shuffles drop them into place:
 * no int -> double conversion (int8 -> int32 -> double took 3 uops per 4 values).
 * The group sum is then scaled by 0.5*2^(b-127) instead of 2^(b-127).  Every product and
 * partial sum is exactly twice the scalar one (no double overflow or underflow is
 * reachable from float32 x), so the scaled result rounds identically.  Code 8 (-0.0)
 * decodes to +0: harmless, because every accumulator starts at +0.0 and +0 + -0 = +0. */

/* 16 packed bytes per 128-bit lane -> w[m] holds, per lane, elements 8m..8m+7 as 16-bit
 * words (the top two bytes of each 2*E2M1 double). */
K3_AVX2_ATTR K3_INLINE void k3_e2m1_words_avx2(__m256i bytes, __m256i *w) {
    const __m256i t7 = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
        0x00, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0));
    const __m256i t6 = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        0x00, (char)0xF0, 0x00, 0x08, 0x10, 0x18, 0x20, 0x28,
        0x00, (char)0xF0, 0x00, 0x08, 0x10, 0x18, 0x20, 0x28));
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256i lo = _mm256_and_si256(bytes, m15);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m15);
    /* codes in element order: the low nibble of byte j is element 2j */
    __m256i codes[2] = {_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)};
    for (int h = 0; h < 2; h++) {
        __m256i b6 = _mm256_shuffle_epi8(t6, codes[h]);
        __m256i b7 = _mm256_shuffle_epi8(t7, codes[h]);
        w[2 * h] = _mm256_unpacklo_epi8(b6, b7);
        w[2 * h + 1] = _mm256_unpackhi_epi8(b6, b7);
    }
}

/* A byte-shuffle index putting words A..A+1 of the low lane and B..B+1 of the high lane
 * into bytes 6-7 of the lanes' two doubles (the other bytes zero). */
#define K3_Z ((char)0x80)
#define K3_WORDS_TO_PD(A, B)                                                                \
    _mm256_setr_epi8(K3_Z, K3_Z, K3_Z, K3_Z, K3_Z, K3_Z, 2 * (A), 2 * (A) + 1,              \
                     K3_Z, K3_Z, K3_Z, K3_Z, K3_Z, K3_Z, 2 * (A) + 2, 2 * (A) + 3,          \
                     K3_Z, K3_Z, K3_Z, K3_Z, K3_Z, K3_Z, 2 * (B), 2 * (B) + 1,              \
                     K3_Z, K3_Z, K3_Z, K3_Z, K3_Z, K3_Z, 2 * (B) + 2, 2 * (B) + 3)

/* One group's 32 codes -> eight 4-double vectors: element 8k+j in v[2k + j/4], lane j%4. */
K3_AVX2_ATTR K3_INLINE void k3_e2m1_group_avx2(const uint8_t *p, __m256d *v) {
    const __m256i r0 = K3_WORDS_TO_PD(0, 2), r1 = K3_WORDS_TO_PD(4, 6);
    __m256i w[4];
    k3_e2m1_words_avx2(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)), w);
    for (int m = 0; m < 4; m++) {
        v[2 * m] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w[m], r0));
        v[2 * m + 1] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w[m], r1));
    }
}

/* Four group sums at once: bb[q] holds b0..b3 (b[l] = s[l] + s[l+4]) of pair q; the
 * result's lane q is (b0+b1) + (b2+b3) of pair q, the scalar tree's order. */
K3_AVX2_ATTR K3_INLINE __m256d k3_tree4x4_avx2(const __m256d *bb) {
    __m256d h01 = _mm256_hadd_pd(bb[0], bb[1]);   /* [b0+b1 of 0, of 1, b2+b3 of 0, of 1] */
    __m256d h23 = _mm256_hadd_pd(bb[2], bb[3]);
    return _mm256_add_pd(_mm256_permute2f128_pd(h01, h23, 0x20),
                         _mm256_permute2f128_pd(h01, h23, 0x31));
}

/* R rows x B tokens (R * B <= 8; at T = 1 only a single row: more go to
 * k3_mxfp4_rows_avx2 below): (row r, token b) is pair q = r * B + b, lane q % 4 of
 * accumulator q / 4.  Each row's group is decoded once for its B tokens; the group trees
 * of 4 pairs, the scaling and the group-ordered accumulation are one vector op each
 * (mul, then add: never fused).  Why: one horizontal tree and a scalar multiply-add per
 * (row, token, group) cost as much as the products (AVX2 MXFP4 ran at ~4 G multiply-adds
 * per second per Zen 3 core).  A dead group (scale byte 255) adds +0.0 to its lane, which
 * leaves the sum's bits as the scalar's skip does: a sum that starts at +0.0 is never
 * -0.0 under round-to-nearest, and x + 0.0 = x for every other x, NaN and inf included. */
K3_AVX2_ATTR K3_INLINE void k3_mxfp4_tile_avx2(const uint8_t *p, long ldp, const uint8_t *s,
                                               long lds, const double *x, long ldx, long n,
                                               double *out, const int R, const int B) {
    const int Q = R * B, NA = (Q + 3) / 4;
    __m256d acc[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    long ngroups = n / 32;
    for (long g = 0; g < ngroups; g++) {
        __m256d bb[8];
        double sc[8];
        for (int r = 0; r < R; r++) {
            uint8_t sb = s[r * lds + g];
            if (sb == 255) {                  /* dead group: +0.0 for each of its pairs */
                for (int b = 0; b < B; b++) {
                    bb[r * B + b] = _mm256_setzero_pd();
                    sc[r * B + b] = 0.0;
                }
                continue;
            }
            __m256d dv[8];
            k3_e2m1_group_avx2(p + r * ldp + g * 16, dv);
            for (int b = 0; b < B; b++) {
                const double *xg = x + b * ldx + g * 32;
                /* A = lanes 0-3, C = lanes 4-7; x read in place (16 registers are few) */
                __m256d A = _mm256_setzero_pd(), C = _mm256_setzero_pd();
                for (int k = 0; k < 4; k++) {
                    A = _mm256_fmadd_pd(dv[2 * k], _mm256_loadu_pd(xg + 8 * k), A);
                    C = _mm256_fmadd_pd(dv[2 * k + 1], _mm256_loadu_pd(xg + 8 * k + 4), C);
                }
                bb[r * B + b] = _mm256_add_pd(A, C);
                sc[r * B + b] = K3_E8M0_HALF[sb];
            }
        }
        for (int q = Q; q < 4 * NA; q++) { bb[q] = _mm256_setzero_pd(); sc[q] = 0.0; }
        for (int a = 0; a < NA; a++) {
            __m256d scale = _mm256_setr_pd(sc[4 * a], sc[4 * a + 1], sc[4 * a + 2], sc[4 * a + 3]);
            acc[a] = _mm256_add_pd(acc[a], _mm256_mul_pd(k3_tree4x4_avx2(bb + 4 * a), scale));
        }
    }
    double t[8];
    for (int a = 0; a < NA; a++) _mm256_storeu_pd(t + 4 * a, acc[a]);
    for (int q = 0; q < Q; q++) out[q] = t[q];
}

/* T = 1, R <= 4 rows: two rows per register, row 2i in the low lane and row 2i+1 in the
 * high lane of pair i, so a group decodes in one pass per row pair and no token repeats
 * the decode.  a[k] holds scalar lanes 2k, 2k+1 (elements 8m+2k, 8m+2k+1, m = 0..3 in
 * order) of both rows; b[l] = s[l] + s[l+4] is a[0] + a[2] and a[1] + a[3], and two
 * horizontal adds give each row's (b0+b1) + (b2+b3), rows 0, 2, 1, 3 in the lanes (pair 1
 * repeated when R <= 2).  Missing rows repeat row R-1 (read, never stored).  A dead group
 * masks its lane to +0.0, the tile's argument above.  Why: with one row per vector the
 * decode and the tree were paid per row; with this and the table decode MXFP4 3072x3584
 * at T = 1 went 2.72 -> 1.94 ms per call from DRAM on a Zen 3 core (docs/benchmarks-
 * kernels.md, 2026-12-03). */
K3_AVX2_ATTR K3_INLINE void k3_mxfp4_rows_avx2(const uint8_t *p, long ldp, const uint8_t *s,
                                               long lds, const double *x, long n,
                                               double *out, const int R) {
    const int NP = R > 2 ? 2 : 1;
    const int lane_row[4] = {0, NP == 2 ? 2 : 0, 1, NP == 2 ? 3 : 1};
    const uint8_t *pr[4], *sl[4];
    for (int i = 0; i < 4; i++) {
        pr[i] = p + (i < R ? i : R - 1) * ldp;
        sl[i] = s + (lane_row[i] < R ? lane_row[i] : R - 1) * lds;
    }
    const __m256i rk[4] = {K3_WORDS_TO_PD(0, 0), K3_WORDS_TO_PD(2, 2), K3_WORDS_TO_PD(4, 4),
                           K3_WORDS_TO_PD(6, 6)};
    __m256d acc = _mm256_setzero_pd();
    long ngroups = n / 32;
    for (long g = 0; g < ngroups; g++) {
        const double *xg = x + g * 32;
        __m256d H[2];
        for (int i = 0; i < NP; i++) {
            __m256i bytes = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(pr[2 * i] + g * 16))),
                _mm_loadu_si128((const __m128i *)(pr[2 * i + 1] + g * 16)), 1);
            __m256i w[4];
            k3_e2m1_words_avx2(bytes, w);
            __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                            _mm256_setzero_pd()};
            for (int m = 0; m < 4; m++)
                for (int k = 0; k < 4; k++)
                    a[k] = _mm256_fmadd_pd(
                        _mm256_castsi256_pd(_mm256_shuffle_epi8(w[m], rk[k])),
                        _mm256_broadcast_pd((const __m128d *)(xg + 8 * m + 2 * k)), a[k]);
            H[i] = _mm256_hadd_pd(_mm256_add_pd(a[0], a[2]), _mm256_add_pd(a[1], a[3]));
        }
        __m256d G = _mm256_hadd_pd(H[0], H[NP - 1]);
        uint8_t b0 = sl[0][g], b1 = sl[1][g], b2 = sl[2][g], b3 = sl[3][g];
        __m256d prod = _mm256_mul_pd(G, _mm256_setr_pd(K3_E8M0_HALF[b0], K3_E8M0_HALF[b1],
                                                       K3_E8M0_HALF[b2], K3_E8M0_HALF[b3]));
        if (b0 == 255 || b1 == 255 || b2 == 255 || b3 == 255)
            prod = _mm256_and_pd(prod, _mm256_castsi256_pd(_mm256_setr_epi64x(
                b0 == 255 ? 0 : -1, b1 == 255 ? 0 : -1, b2 == 255 ? 0 : -1,
                b3 == 255 ? 0 : -1)));
        acc = _mm256_add_pd(acc, prod);           /* mul, then add: never fused */
    }
    double t[4];
    _mm256_storeu_pd(t, acc);
    const int lane_of_row[4] = {0, 2, 1, 3};
    for (int r = 0; r < R; r++) out[r] = t[lane_of_row[r]];
}

/* AVX-512: rows in lanes.  Lane p of every vector belongs to row p of an 8-row block, so
 * the per-group tree of §5.6 is made of VERTICAL adds (no shuffles, no horizontal sums)
 * and the group-ordered accumulation acc += sub * 2^(b-127) is one vector add per group
 * for 8 rows (a serial chain per row, but 8 rows share it).  Why: the row-major form spent
 * more uops on the per-group horizontal tree and the scalar acc chain than on the
 * products (1.75 ms for 3072x3584, 25 % of the read floor).
 * Decode: Q0/Q1 hold, per lane, the row's first/second 8 packed bytes of the group as a
 * 64-bit integer (a gather), so element e (e < 16) of the group is bits 4e..4e+3 of Q0;
 * shifted down, the two-table permute reads the low 4 bits as the index (bit 3 = the
 * negative half): exact E2M1 doubles, -0.0 included.  Each decoded vector serves every
 * token of the tile.  s[l] runs over elements l, l+8, l+16, l+24 in that order from +0.0
 * (fma(w, x, +0.0) rounds -0.0 to +0.0 exactly as the scalar 0 + w*x does). */
/* Lane r of out[m] = in[r][m] (an 8x8 transpose of 64-bit words in 24 two-source
 * permutes).  Why not a gather: two 8-lane gathers per group cost more than the whole
 * 32-element decode on this core. */
K3_AVX512_ATTR K3_INLINE void k3_transpose8_epi64(const __m512i *in, __m512i *out) {
    const __m512i i1a = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
    const __m512i i1b = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    const __m512i i2a = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i i2b = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    const __m512i i3a = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11);
    const __m512i i3b = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
    __m512i a[8], c[8];
    for (int k = 0; k < 4; k++) {   /* a[2k]: rows 2k, 2k+1 interleaved, words 0-3; a[2k+1]: 4-7 */
        a[2 * k] = _mm512_permutex2var_epi64(in[2 * k], i1a, in[2 * k + 1]);
        a[2 * k + 1] = _mm512_permutex2var_epi64(in[2 * k], i1b, in[2 * k + 1]);
    }
    for (int h = 0; h < 2; h++)     /* rows 4h..4h+3 */
        for (int j = 0; j < 2; j++) {
            c[4 * h + 2 * j] = _mm512_permutex2var_epi64(a[4 * h + j], i2a, a[4 * h + 2 + j]);
            c[4 * h + 2 * j + 1] = _mm512_permutex2var_epi64(a[4 * h + j], i2b, a[4 * h + 2 + j]);
        }
    /* c[m] (rows 0-3) and c[4 + m] (rows 4-7): words 2m in lanes 0-3, 2m+1 in lanes 4-7 */
    for (int m = 0; m < 4; m++) {
        out[2 * m] = _mm512_permutex2var_epi64(c[m], i3a, c[4 + m]);
        out[2 * m + 1] = _mm512_permutex2var_epi64(c[m], i3b, c[4 + m]);
    }
}

K3_AVX512_ATTR K3_INLINE __m512d k3_e2m1_lanes_avx512(__m512i q0, __m512i q1, const int e) {
    const __m512d t_lo = _mm512_setr_pd(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
    const __m512d t_hi = _mm512_setr_pd(-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0);
    __m512i q = e < 16 ? q0 : q1;
    if (e % 16) q = _mm512_srli_epi64(q, 4 * (e % 16));
    return _mm512_permutex2var_pd(t_lo, q, t_hi);
}

/* Lane r of sc (r < R): the scale bytes of groups g0 .. g0+ng-1 (ng <= 8) of row r, padded
 * with 255 (= skipped) past the row's end; offs[r] = r * lds for r < R, else 0. */
K3_AVX512_ATTR K3_INLINE __m512i k3_mx_scales8_avx512(const uint8_t *s, long lds, __m512i offs,
                                                      long g0, int ng, const int R) {
    if (ng == 8) return _mm512_i64gather_epi64(offs, (const void *)(s + g0), 1);
    uint64_t buf[8];
    for (int r = 0; r < 8; r++) {
        uint8_t bytes[8];
        memset(bytes, 255, 8);
        if (r < R) memcpy(bytes, s + r * lds + g0, (size_t)ng);
        memcpy(&buf[r], bytes, 8);
    }
    return _mm512_loadu_si512((const void *)buf);
}

/* Group gi of an 8-group scale vector: 2^(b + bias - 1023) per lane for its scale byte b,
 * and the lanes it is live in (b != 255).  bias 1023 - 127 gives the E8M0 scale 2^(b-127)
 * (always normal); k3mxint.h folds its inputs' exponent into the bias. */
K3_AVX512_ATTR K3_INLINE __m512d k3_mx_scale_biased_avx512(__m512i sc8, int gi, long bias,
                                                          __mmask8 *live) {
    __m512i sb = _mm512_and_si512(_mm512_srl_epi64(sc8, _mm_cvtsi32_si128(8 * gi)),
                                  _mm512_set1_epi64(255));
    *live = _mm512_cmpneq_epi64_mask(sb, _mm512_set1_epi64(255));
    return _mm512_castsi512_pd(
        _mm512_slli_epi64(_mm512_add_epi64(sb, _mm512_set1_epi64(bias)), 52));
}

K3_AVX512_ATTR K3_INLINE __m512d k3_mx_scale_avx512(__m512i sc8, int gi, __mmask8 *live) {
    return k3_mx_scale_biased_avx512(sc8, gi, 1023 - 127, live);
}

/* Groups g4 .. g4+ng4-1 (ng4 <= 4) of 8 rows (lanes past R re-read row 0), transposed so
 * lane r of qv[2i + j] is row r's j-th 8 packed bytes of group g4 + i; and a prefetch of
 * one line per row 2 KB ahead (past a row's end: the next block's row). */
K3_AVX512_ATTR K3_INLINE void k3_mx_words_avx512(const uint8_t *p, long ldp, long g4, int ng4,
                                                 const int R, __m512i *qv) {
    __m512i rowv[8];
    const __mmask8 words = (__mmask8)((1u << (2 * ng4)) - 1);
    for (int r = 0; r < 8; r++)
        rowv[r] = _mm512_maskz_loadu_epi64(words, p + (r < R ? r : 0) * ldp + g4 * 16);
    k3_transpose8_epi64(rowv, qv);
    long off = g4 * 16 + K3_MX_PF_BYTES;
    const char *pf = (const char *)p + off + (off >= ldp ? 8 * ldp - ldp : 0);
    for (int r = 0; r < 8; r++) _mm_prefetch(pf + r * ldp, _MM_HINT_T0);
}

/* One group of 8 rows against B tokens (xg: the group's first input of token 0, ldx
 * between tokens): acc[b] += (the §5.6 tree of s[l]) * scale in the live lanes.  Element
 * e's 8 row values come from dec[e] when dec is given (decoded once for many tokens),
 * else from the words q0, q1 (both forms give the same doubles, so the same bits).
 * Per token: b[l] = s[l] + s[l+4]; c[0] = b0 + b1 is formed before l = 2, 3 are computed
 * (fewer live registers), c[1] = b2 + b3, sub = c[0] + c[1]. */
K3_AVX512_ATTR K3_INLINE void k3_mx_group_avx512(__m512i q0, __m512i q1, const __m512d *dec,
                                                 const double *xg, long ldx, __m512d scale,
                                                 __mmask8 live, __m512d *acc, const int B) {
    const __m512d zero = _mm512_setzero_pd();
    __m512d c[2][4];
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m512d bl[2][4];
#pragma GCC unroll 2
        for (int l2 = 0; l2 < 2; l2++) {
            const int l = 2 * h + l2;
            __m512d sl[4], sh[4];   /* s[l], s[l+4] of each token */
#pragma GCC unroll 4
            for (int b = 0; b < B; b++) sl[b] = sh[b] = zero;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {   /* elements l + 8j and l + 4 + 8j */
                __m512d dl = dec ? dec[l + 8 * j] : k3_e2m1_lanes_avx512(q0, q1, l + 8 * j);
                __m512d dh = dec ? dec[l + 4 + 8 * j]
                                 : k3_e2m1_lanes_avx512(q0, q1, l + 4 + 8 * j);
#pragma GCC unroll 4
                for (int b = 0; b < B; b++) {
                    const double *xb = xg + b * ldx;
                    sl[b] = _mm512_fmadd_pd(dl, _mm512_set1_pd(xb[l + 8 * j]), sl[b]);
                    sh[b] = _mm512_fmadd_pd(dh, _mm512_set1_pd(xb[l + 4 + 8 * j]), sh[b]);
                }
            }
#pragma GCC unroll 4
            for (int b = 0; b < B; b++) bl[l2][b] = _mm512_add_pd(sl[b], sh[b]);
        }
#pragma GCC unroll 4
        for (int b = 0; b < B; b++) c[h][b] = _mm512_add_pd(bl[0][b], bl[1][b]);
    }
#pragma GCC unroll 4
    for (int b = 0; b < B; b++) {
        __m512d sub = _mm512_add_pd(c[0][b], c[1][b]);
        /* a skipped group adds +0.0: acc starts at +0.0 and so is never -0.0,
         * hence acc + 0 = acc exactly like not adding */
        acc[b] = _mm512_add_pd(acc[b], _mm512_maskz_mul_pd(live, sub, scale));
    }
}

K3_AVX512_ATTR K3_INLINE __m512i k3_mx_offsets_avx512(long lds, const int R) {
    const __m512i lane = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    /* lanes past R re-read row 0 (in bounds); their sums are never stored */
    return _mm512_maskz_mullo_epi64((__mmask8)((1u << R) - 1), lane, _mm512_set1_epi64(lds));
}

/* Rows o .. o+R-1 (R <= 8) of one 8-row block against B tokens; out[r * B + b]. */
K3_AVX512_ATTR K3_INLINE void k3_mxfp4_rows8_avx512(const uint8_t *p, long ldp,
                                                    const uint8_t *s, long lds,
                                                    const double *x, long ldx, long n,
                                                    double *out, const int R, const int B) {
    const __m512i offs = k3_mx_offsets_avx512(lds, R);
    __m512d acc[4];
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_pd();
    long ngroups = n / 32;
    for (long k = 0; k < 8 * lds; k += 64)  /* the next block's scale bytes */
        _mm_prefetch((const char *)s + 8 * lds + k, _MM_HINT_T0);
    for (long g0 = 0; g0 < ngroups; g0 += 8) {
        const int ng = ngroups - g0 < 8 ? (int)(ngroups - g0) : 8;
        __m512i sc8 = k3_mx_scales8_avx512(s, lds, offs, g0, ng, R);
        for (long g4 = g0; g4 < g0 + ng; g4 += 4) {
            const int ng4 = g0 + ng - g4 < 4 ? (int)(g0 + ng - g4) : 4;
            __m512i qv[8];
            k3_mx_words_avx512(p, ldp, g4, ng4, R, qv);
#pragma GCC unroll 1
            for (int gi4 = 0; gi4 < ng4; gi4++) {
                __mmask8 live;
                __m512d scale = k3_mx_scale_avx512(sc8, (int)(g4 - g0) + gi4, &live);
                k3_mx_group_avx512(qv[2 * gi4], qv[2 * gi4 + 1], NULL,
                                   x + (g4 + gi4) * 32, ldx, scale, live, acc, B);
            }
        }
    }
    for (int b = 0; b < B; b++) {
        double t[8];
        _mm512_storeu_pd(t, acc[b]);
        for (int r = 0; r < R; r++) out[r * B + b] = t[r];
    }
}

/* B tokens over ng decoded groups; their 8 row sums each (acc8) in memory between calls. */
K3_AVX512_ATTR K3_INLINE void k3_mx_tile_decoded_avx512(const double (*dec)[32][8],
                                                        const __m512d *scale,
                                                        const __mmask8 *live, int ng,
                                                        const double *xt, long ldx,
                                                        double (*acc8)[8], const int B) {
    const __m512i none = _mm512_setzero_si512();
    __m512d acc[4];
    for (int b = 0; b < B; b++) acc[b] = _mm512_load_pd(acc8[b]);
#pragma GCC unroll 1
    for (int gi = 0; gi < ng; gi++)
        k3_mx_group_avx512(none, none, (const __m512d *)dec[gi], xt + gi * 32, ldx,
                           scale[gi], live[gi], acc, B);
    for (int b = 0; b < B; b++) _mm512_store_pd(acc8[b], acc[b]);
}

/* Rows o .. o+R-1 (R <= 8) against ntok tokens at once, Y[t * ldy + r] = f32(sum): each
 * chunk of 8 groups is decoded once into dec (16 KB, in L1) and every token runs over it,
 * 4 at a time, its 8 row sums kept in accb between chunks.  Why: with a group decoded per
 * 4-token tile (k3_mxfp4_rows8_avx512) the shift and permute of each element took a third
 * of a prefill tile's uops; here they are paid once per K3_MX_TOKENS tokens.  Each token's
 * order is the tile's (k3_mx_group_avx512 is the same code), whatever the chunking. */
#define K3_MX_TOKENS 64
K3_AVX512_ATTR static void k3_mxfp4_rows8_tokens_avx512(const uint8_t *p, long ldp,
                                                        const uint8_t *s, long lds,
                                                        const double *x, long ldx, long n,
                                                        long ntok, float *Y, long ldy,
                                                        const int R) {
    _Alignas(64) double dec[8][32][8];
    _Alignas(64) double accb[K3_MX_TOKENS][8];
    const __m512i offs = k3_mx_offsets_avx512(lds, R);
    long ngroups = n / 32;
    for (long t0 = 0; t0 < ntok; t0 += K3_MX_TOKENS) {
        const long nt = ntok - t0 < K3_MX_TOKENS ? ntok - t0 : K3_MX_TOKENS;
        memset(accb, 0, sizeof accb);
        for (long g0 = 0; g0 < ngroups; g0 += 8) {
            const int ng = ngroups - g0 < 8 ? (int)(ngroups - g0) : 8;
            __m512i sc8 = k3_mx_scales8_avx512(s, lds, offs, g0, ng, R);
            __m512d scale[8];
            __mmask8 live[8];
            for (int gi = 0; gi < ng; gi++) scale[gi] = k3_mx_scale_avx512(sc8, gi, &live[gi]);
            for (int g4 = 0; g4 < ng; g4 += 4) {
                const int ng4 = ng - g4 < 4 ? ng - g4 : 4;
                __m512i qv[8];
                k3_mx_words_avx512(p, ldp, g0 + g4, ng4, R, qv);
                for (int gi4 = 0; gi4 < ng4; gi4++)
#pragma GCC unroll 32
                    for (int e = 0; e < 32; e++)
                        _mm512_store_pd(dec[g4 + gi4][e],
                                        k3_e2m1_lanes_avx512(qv[2 * gi4], qv[2 * gi4 + 1], e));
            }
            for (long t = 0; t < nt; t += 4) {
                const double *xt = x + (t0 + t) * ldx + g0 * 32;
                double (*a8)[8] = accb + t;
                switch (nt - t < 4 ? (int)(nt - t) : 4) {  /* B a constant in each call */
                case 4: k3_mx_tile_decoded_avx512(dec, scale, live, ng, xt, ldx, a8, 4); break;
                case 3: k3_mx_tile_decoded_avx512(dec, scale, live, ng, xt, ldx, a8, 3); break;
                case 2: k3_mx_tile_decoded_avx512(dec, scale, live, ng, xt, ldx, a8, 2); break;
                default: k3_mx_tile_decoded_avx512(dec, scale, live, ng, xt, ldx, a8, 1);
                }
            }
        }
        for (long t = 0; t < nt; t++)
            for (int r = 0; r < R; r++) Y[(t0 + t) * ldy + r] = (float)accb[t][r];
    }
}

#define K3_MXFP4_ROWS8_INSTANCE(B)                                                          \
    K3_AVX512_ATTR static void k3_mxfp4_avx512_##B(const uint8_t *p, long ldp,              \
                                                   const uint8_t *s, long lds,              \
                                                   const double *x, long ldx, long n,       \
                                                   double *out, int R) {                    \
        k3_mxfp4_rows8_avx512(p, ldp, s, lds, x, ldx, n, out, R, B);                        \
    }
K3_MXFP4_ROWS8_INSTANCE(1) K3_MXFP4_ROWS8_INSTANCE(2) K3_MXFP4_ROWS8_INSTANCE(3)
K3_MXFP4_ROWS8_INSTANCE(4)

#define K3_MXFP4_INSTANCE(ISA, ATTR, R, B)                                                  \
    ATTR static void k3_mxfp4_##ISA##_##R##_##B(const uint8_t *p, long ldp,                 \
                                                const uint8_t *s, long lds,                 \
                                                const double *x, long ldx, long n,          \
                                                double *out) {                              \
        if (B == 1 && R > 1) k3_mxfp4_rows_##ISA(p, ldp, s, lds, x, n, out, R);              \
        else k3_mxfp4_tile_##ISA(p, ldp, s, lds, x, ldx, n, out, R, B);                     \
    }
#define K3_MXFP4_INSTANCES(ISA, ATTR)                                                       \
    K3_MXFP4_INSTANCE(ISA, ATTR, 1, 1) K3_MXFP4_INSTANCE(ISA, ATTR, 1, 2)                   \
    K3_MXFP4_INSTANCE(ISA, ATTR, 1, 3) K3_MXFP4_INSTANCE(ISA, ATTR, 1, 4)                   \
    K3_MXFP4_INSTANCE(ISA, ATTR, 2, 1) K3_MXFP4_INSTANCE(ISA, ATTR, 2, 2)                   \
    K3_MXFP4_INSTANCE(ISA, ATTR, 2, 3) K3_MXFP4_INSTANCE(ISA, ATTR, 2, 4)                   \
    K3_MXFP4_INSTANCE(ISA, ATTR, 3, 1) K3_MXFP4_INSTANCE(ISA, ATTR, 4, 1)
K3_MXFP4_INSTANCES(avx2, K3_AVX2_ATTR)

#endif /* K3_HAVE_SIMD_PATHS */

/* ---- dispatch ------------------------------------------------------------------------ */

static int k3_isa_best_cached = -1;
static int k3_isa_active = -1;      /* set by k3_set_isa; -1 = not yet chosen */

/* The best path this CPU (and OS: libgcc checks XCR0 for the AVX-512 state) can run. */
static int k3_isa_best(void) {
    if (k3_isa_best_cached < 0) {
        int best = K3_ISA_SCALAR;
#if K3_HAVE_SIMD_PATHS
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
            best = K3_ISA_AVX2;
            if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
                best = K3_ISA_AVX512;
        }
#endif
        k3_isa_best_cached = best;
    }
    return k3_isa_best_cached;
}

/* Select a path; a request above what the CPU has is clamped (never executed).  Returns
 * the path now active.  -1 selects the best. */
static int k3_set_isa(int isa) {
    int best = k3_isa_best();
    k3_isa_active = (isa < 0 || isa > best) ? best : isa;
    return k3_isa_active;
}

static inline int k3_isa(void) {
    if (k3_isa_active < 0) k3_set_isa(-1);
    return k3_isa_active;
}

/* Tile shape per path and batch.  AVX-512: 4 rows per pass at T = 1 (8 independent FMA
 * chains and 4 rows' prefetch streams), 2 rows x 4 tokens at T > 1 (16 accumulators + the
 * widened weights in 32 registers).  A 4 x 2 tile measured ~20 % faster at T = 4 under
 * load but, quiet (2026-12-01 13:37, bench_kernels.py), BF16 12288x7168 T = 4 took 43.4 ms
 * at 1 thread as 4 x 2 and 32.3 ms as 2 x 4 (17.9 / 17.1 at 2 threads).  AVX2: 2 rows at
 * T = 1 (8 chains in 16 registers; 3 and 4 rows measured slower), 1 row x 4 tokens
 * otherwise (from cache 1.1-1.5x the 1 x 2 tile at T = 3 and 4 for BF16, F32 and I8R,
 * bench_cached_kernels.py on Zen 3, 2026-12-03).  BF16 12288x7168 at 1 thread, T = 1,
 * with the prefetch: 24.4 -> ~15 ms (AVX-512), 31.6 -> ~21 ms (AVX2). */
static inline void k3_tile_shape(int isa, long ntok, int *rmax, int *bmax) {
    if (isa == K3_ISA_AVX512) { *rmax = ntok == 1 ? 4 : 2; *bmax = ntok == 1 ? 1 : 4; }
    else if (isa == K3_ISA_AVX2) { *rmax = ntok == 1 ? 2 : 1; *bmax = ntok == 1 ? 1 : 4; }
    else { *rmax = 1; *bmax = 1; }
}

/* MXFP4 tiles keep their own shape (their registers hold decoded groups, not rows). */
static inline void k3_mxfp4_shape(int isa, long ntok, int *rmax, int *bmax) {
    if (isa == K3_ISA_AVX512) { *rmax = 8; *bmax = 4; }
    else if (isa == K3_ISA_AVX2) {
        *rmax = ntok == 1 ? 4 : 1;     /* 4 rows, two per register; or 1 row x 4 tokens */
        *bmax = ntok == 1 ? 1 : 4;
    }
    else { *rmax = 1; *bmax = 1; }
}

/* Tokens per block of the row drivers: the widened inputs of one block stay in L2 while
 * every row of the caller's chunk runs over them.  Why: a 256-token prefill's inputs are
 * 4 MB at 2048 wide; walking all tokens per row pair re-read them from L3 for every
 * pair, and BF16 prefill ran at 6.5 G multiply-adds/s per core.  A tile sees the same
 * tokens one at a time whatever the block, so no bit depends on it. */
#ifndef K3_TOKEN_BLOCK_BYTES
#define K3_TOKEN_BLOCK_BYTES (256 * 1024)
#endif
static long k3_token_block_bytes = K3_TOKEN_BLOCK_BYTES;   /* benchmarks A/B it */
static void k3_set_token_block_bytes(long b) {
    k3_token_block_bytes = b > 0 ? b : K3_TOKEN_BLOCK_BYTES;
}
static inline long k3_token_block(long n, int bmax) {
    return k3_tokens_fitting(k3_token_block_bytes, n, bmax);
}

/* Rows [o0, o1) of W (row stride ldw elements, n inputs) against T tokens of Xd (row
 * stride n doubles); Y[t * ldy + o] = f32(sum), times scale[o] (double) when given. */
#define K3_MV_ROWS(NAME, T, KIND)                                                           \
    static void NAME(const T *W, long ldw, long n, long o0, long o1, const double *Xd,      \
                     long ntok, const float *scale, float *Y, long ldy) {                   \
        int isa = k3_isa(), rmax, bmax;                                                     \
        K3_MV_PANEL_GENERIC(KIND, isa, W, ldw, n, o0, o1, Xd, ntok, scale, Y, ldy)         \
        k3_tile_shape(isa, ntok, &rmax, &bmax);                                             \
        double out[16];                                                                      \
        long tb = k3_token_block(n, bmax);                                                  \
        for (long t0 = 0; t0 < ntok; t0 += tb) {                                            \
        long t1 = ntok - t0 < tb ? ntok : t0 + tb;                                          \
        for (long o = o0; o < o1; o += rmax) {                                              \
            int R = (o1 - o) < rmax ? (int)(o1 - o) : rmax;                                 \
            for (long t = t0; t < t1; t += bmax) {                                          \
                int B = (t1 - t) < bmax ? (int)(t1 - t) : bmax;                             \
                const T *w = W + o * ldw;                                                   \
                const double *x = Xd + t * n;                                               \
                if (isa == K3_ISA_SCALAR) out[0] = k3_dot_##KIND##_scalar(w, x, n);         \
                K3_MV_SIMD_##KIND(isa, R, B, w, ldw, x, n, out)                             \
                for (int r = 0; r < R; r++)                                                 \
                    for (int b = 0; b < B; b++)                                             \
                        k3_put(Y, ldy, t + b, o + r, scale, out[r * B + b]);                \
            }                                                                               \
        }                                                                                   \
        }                                                                                   \
    }

#if K3_HAVE_SIMD_PATHS
#define K3_MV_SIMD_GENERIC(KIND, isa, R, B, w, ldw, x, n, out)                              \
    if (isa == K3_ISA_AVX2) {                                                               \
        K3_TILE_SWITCH(k3_mv_##KIND##_avx2, R, B, (w, ldw, x, n, n, out)) }              \
    else if (isa == K3_ISA_AVX512) {                                                        \
        K3_TILE_SWITCH(k3_mv_##KIND##_avx512, R, B, (w, ldw, x, n, n, out)) }
#define K3_MV_PANEL_GENERIC(KIND, isa, W, ldw, n, o0, o1, Xd, ntok, scale, Y, ldy)       \
    if (ntok >= k3_panel_min_tokens && isa == K3_ISA_AVX512 && k3_panel_takes(n)) {         \
        k3_mv_panel_##KIND##_avx512(W, ldw, n, o0, o1, Xd, ntok, scale, Y, ldy);            \
        return;                                                                             \
    }                                                                                       \
    if (ntok >= k3_panel_min_tokens && isa == K3_ISA_AVX2) {                                \
        k3_mv_panel_##KIND##_avx2(W, ldw, n, o0, o1, Xd, ntok, scale, Y, ldy);              \
        return;                                                                             \
    }
#else
#define K3_MV_SIMD_GENERIC(KIND, isa, R, B, w, ldw, x, n, out)
#define K3_MV_PANEL_GENERIC(KIND, ...)
#endif
#define K3_MV_SIMD_f32(...) K3_MV_SIMD_GENERIC(f32, __VA_ARGS__)
#define K3_MV_SIMD_bf16(...) K3_MV_SIMD_GENERIC(bf16, __VA_ARGS__)
#define K3_MV_SIMD_i8(...) K3_MV_SIMD_GENERIC(i8, __VA_ARGS__)

K3_MV_ROWS(k3_mv_rows_f32, float, f32)
K3_MV_ROWS(k3_mv_rows_bf16, uint16_t, bf16)
K3_MV_ROWS(k3_mv_rows_i8, int8_t, i8)

/* Tokens from which an AVX-512 MXFP4 call decodes each group once (benchmarks and tests
 * A/B it; 0 = the default) */
#ifndef K3_MX_TOKENS_MIN
#define K3_MX_TOKENS_MIN 8
#endif
static long k3_mx_tokens_min = K3_MX_TOKENS_MIN;
static void k3_set_mx_tokens_min(long t) { k3_mx_tokens_min = t > 0 ? t : K3_MX_TOKENS_MIN; }

/* MXFP4 rows [o0, o1): P row stride n/2 bytes, S row stride n/32 bytes. */
static void k3_mv_rows_mxfp4(const uint8_t *P, const uint8_t *S, long n, long o0, long o1,
                             const double *Xd, long ntok, float *Y, long ldy) {
    int isa = k3_isa(), rmax, bmax;
    k3_mxfp4_shape(isa, ntok, &rmax, &bmax);
    long ldp = n / 2, lds = n / 32;
#if K3_HAVE_SIMD_PATHS
    if (isa == K3_ISA_AVX512 && ntok >= k3_mx_tokens_min) {
        for (long o = o0; o < o1; o += 8)
            k3_mxfp4_rows8_tokens_avx512(P + o * ldp, ldp, S + o * lds, lds, Xd, n, n, ntok,
                                         Y + o, ldy, o1 - o < 8 ? (int)(o1 - o) : 8);
        return;
    }
#endif
    double out[32];
    long tb = k3_token_block(n, bmax);
    for (long t0 = 0; t0 < ntok; t0 += tb) {
    long t1 = ntok - t0 < tb ? ntok : t0 + tb;
    for (long o = o0; o < o1; o += rmax) {
        int R = (o1 - o) < rmax ? (int)(o1 - o) : rmax;
        for (long t = t0; t < t1; t += bmax) {
            int B = (t1 - t) < bmax ? (int)(t1 - t) : bmax;
            const uint8_t *p = P + o * ldp, *s = S + o * lds;
            const double *x = Xd + t * n;
            if (isa == K3_ISA_SCALAR) out[0] = k3_dot_mxfp4_scalar(p, s, x, n);
#if K3_HAVE_SIMD_PATHS
            else if (isa == K3_ISA_AVX2) {
                K3_TILE_SWITCH(k3_mxfp4_avx2, R, B, (p, ldp, s, lds, x, n, n, out))
            } else {
                switch (B) {
                case 1: k3_mxfp4_avx512_1(p, ldp, s, lds, x, n, n, out, R); break;
                case 2: k3_mxfp4_avx512_2(p, ldp, s, lds, x, n, n, out, R); break;
                case 3: k3_mxfp4_avx512_3(p, ldp, s, lds, x, n, n, out, R); break;
                case 4: k3_mxfp4_avx512_4(p, ldp, s, lds, x, n, n, out, R); break;
                default: abort();
                }
            }
#endif
            for (int r = 0; r < R; r++)
                for (int b = 0; b < B; b++) Y[(t + b) * ldy + o + r] = (float)out[r * B + b];
        }
    }
    }
}

#endif
