/* The MXFP4 matvec of one or two tokens (decode, short prefills) on integer dot products,
 * where that is exact.
 *
 * Why: the double form of ARCHITECTURE §5.6 costs a shift, a table permute and an FMA per
 * element of 8 rows, so a T = 1 expert matvec ran at 17-19 % of the memory-read floor on
 * Zen 4, 9-10 G multiply-adds/s a core (docs/benchmarks-kernels.md).  VNNI's vpdpbusd does
 * 64 byte products a uop.
 *
 * Why the bits cannot change: within one 32-group every term is 2*E2M1 (an integer k,
 * |k| <= 12) times x_i, and x_i = X_i * 2^E (E the group's lowest set bit, X_i an integer
 * with |X_i| < 2^span).  When span <= 43 every partial sum of the reference's lane tree is
 * an integer multiple of 2^(E-1) below 32 * 12 * 2^43 < 2^53, so the reference adds without
 * rounding and its group sum IS the exact sum, in any order.  Here that exact sum is
 * formed from X_i's balanced base-256 digits (int8) against the weights k + 12 (uint8),
 * less 12 * sum(X_i), each plane's lane sums exact in int32 and their combination exact
 * in double (below 2^53); then acc = fma(sum, 2^(E - 1 + b - 127), acc), whose product is
 * exact, rounds like the reference's acc += sub * 2^(b-127).  A group whose x has a
 * non-finite value or a wider span takes the double path (k3_mx_group_avx512) for that
 * group only, so every row's group order and acc chain are the reference's.
 * tests/test_kernels.py (test_mxfp4_integer_path_*) compares the bits against the scalar
 * form across spans 1..60, zeros, subnormals, inf/NaN, scales 0/254/255 and ragged rows.
 */
#ifndef K3MXINT_H
#define K3MXINT_H

#include "k3dot.h"

#define K3_MXQ_PMAX 6          /* digit planes at most: spans up to 8 * 6 - 2 = 46 bits */
#define K3_MXQ_SPAN_MAX 43     /* 24 * 32 * 2^43 < 2^53: every partial sum exact (above) */

/* One 32-group of the token, prepared once per call (256 bytes, L1-friendly). */
typedef struct {
    /* plane p, dword d (elements 8d..8d+7), even / odd elements: 4 digits each (the
     * packed byte's low nibble is the even element, its high nibble the odd one) */
    int8_t dig[K3_MXQ_PMAX][4][2][4];
    double corr;               /* 12 * sum(X_i): what the weights' +12 added */
    int32_t ebias;             /* E - 1 - 127 + 1023: turns a scale byte b into 2^(E-1+b-127) */
    int32_t exact;             /* 1: the integer path; 0: this group takes the double path */
    char pad[48];
} k3_mxq_group;

_Static_assert(sizeof(k3_mxq_group) == 256, "k3_mxq_group is four cache lines");

typedef struct {
    int planes;                /* digit planes the call runs (max over its groups); 0: none */
    long ngroups, nexact;      /* groups, and those on the integer path */
    k3_mxq_group *g;           /* ngroups entries */
} k3_mxq;

static int k3_mxq_on = -1;     /* -1: not yet probed; tests and benchmarks switch it */
static int k3_mxq_pmax = K3_MXQ_PMAX;  /* groups needing more planes take the double path */

static int k3_mxq_supported(void) {
#if K3_HAVE_SIMD_PATHS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vbmi");
#else
    return 0;
#endif
}

/* on: 1 uses the integer path where the CPU has it, 0 never; planes: the most digit planes
 * a group may take (1..K3_MXQ_PMAX; <= 0 keeps the setting).  Returns whether the path is
 * now in use. */
static int k3_set_mxq(int on, int planes) {
    k3_mxq_on = (on != 0) && k3_mxq_supported();
    if (planes > 0) k3_mxq_pmax = planes < K3_MXQ_PMAX ? planes : K3_MXQ_PMAX;
    return k3_mxq_on;
}

static inline int k3_mxq_active(void) {
    if (k3_mxq_on < 0) k3_set_mxq(1, 0);
    return k3_mxq_on && k3_isa() == K3_ISA_AVX512;
}

#if K3_HAVE_SIMD_PATHS

#define K3_VNNI_ATTR \
    __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512vnni," \
                          "avx512vbmi")))

/* Prepare x (n doubles, each a float32 value; n a multiple of 32) into q->g (n/32 groups).
 * Sets q->planes to the most digit planes any exact group needs (0 when no group is). */
K3_VNNI_ATTR static void k3_mxq_prepare(const double *x, long n, k3_mxq *q) {
    const __m512i absm = _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFLL);
    const __m512i infb = _mm512_set1_epi64(0x7FF0000000000000LL);
    const __m512i mant = _mm512_set1_epi64(0x000FFFFFFFFFFFFFLL);
    const __m512i one52 = _mm512_set1_epi64(1LL << 52);
    const __m512i c63 = _mm512_set1_epi64(63);
    const __m512i evenodd = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    int planes = 0;
    q->ngroups = n / 32;
    q->nexact = 0;
    for (long g = 0; g < q->ngroups; g++) {
        k3_mxq_group *qg = &q->g[g];
        const double *xg = x + 32 * g;
        __m512i hi = _mm512_setzero_si512(), lo = _mm512_set1_epi64(1 << 20);
        __mmask8 bad = 0, any = 0;
        for (int j = 0; j < 4; j++) {
            __m512i a = _mm512_and_si512(_mm512_loadu_si512((const void *)(xg + 8 * j)), absm);
            __mmask8 nz = _mm512_test_epi64_mask(a, a);
            bad |= _mm512_cmpge_epu64_mask(a, infb);
            any |= nz;
            __m512i e = _mm512_srli_epi64(a, 52);      /* biased exponent (0: subnormal double) */
            __m512i m = _mm512_or_si512(_mm512_and_si512(a, mant), one52);
            __m512i low = _mm512_and_si512(m, _mm512_sub_epi64(_mm512_setzero_si512(), m));
            __m512i tz = _mm512_sub_epi64(c63, _mm512_lzcnt_epi64(low));
            hi = _mm512_mask_max_epi64(hi, nz, hi, e);
            lo = _mm512_mask_min_epi64(lo, nz, lo, _mm512_add_epi64(e, tz));
        }
        qg->exact = 0;
        if (bad) continue;
        long eb = 0, span = 0;
        if (any) {
            long hb = _mm512_reduce_max_epi64(hi), lb = _mm512_reduce_min_epi64(lo);
            /* |x| < 2^(hb - 1022); lowest set bit 2^(lb - 1075); E = lb - 1075.  Only
             * float32-range values (what the engine passes) take this path. */
            span = hb - lb + 53;
            eb = lb - 1075;
            if (hb == 0 || span > K3_MXQ_SPAN_MAX || eb < -149 || eb > 127) continue;
        }
        const int P = any ? (int)((span + 2 + 7) / 8) : 1;
        if (P > k3_mxq_pmax) continue;
        if (P > planes) planes = P;
        /* X_i = x_i * 2^-E: an exact power-of-two scaling to an integer below 2^43 */
        const __m512d unscale = _mm512_castsi512_pd(_mm512_set1_epi64((1023 - eb) << 52));
        __m512i sum = _mm512_setzero_si512();
        memset(qg->dig, 0, sizeof qg->dig);
        for (int j = 0; j < 4; j++) {
            __m512d xv = _mm512_loadu_pd(xg + 8 * j);
            __m512i X = _mm512_cvtpd_epi64(_mm512_mul_pd(xv, unscale));
            X = _mm512_permutexvar_epi64(evenodd, X);  /* even elements, then odd */
            sum = _mm512_add_epi64(sum, X);
            for (int p = 0; p < P; p++) {
                /* balanced digit in [-128, 127]; X - d is a multiple of 256 */
                __m512i d = _mm512_srai_epi64(_mm512_slli_epi64(X, 56), 56);
                _mm_storel_epi64((__m128i *)qg->dig[p][j], _mm512_cvtepi64_epi8(d));
                X = _mm512_srai_epi64(_mm512_sub_epi64(X, d), 8);
            }
        }
        qg->corr = 12.0 * (double)_mm512_reduce_add_epi64(sum);
        qg->ebias = (int32_t)(eb - 1 - 127 + 1023);
        qg->exact = 1;
        q->nexact++;
    }
    q->planes = planes;
}

/* The 16 bytes at pg + ro[L * step] in 128-bit lane L (L < 4): four rows' words of one
 * group side by side. */
K3_VNNI_ATTR K3_INLINE __m512i k3_mxq_lanes4(const uint8_t *pg, const long *ro, int step) {
    __m512i t = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(pg + ro[0])));
    t = _mm512_inserti32x4(t, _mm_loadu_si128((const __m128i *)(pg + ro[step])), 1);
    t = _mm512_inserti32x4(t, _mm_loadu_si128((const __m128i *)(pg + ro[2 * step])), 2);
    return _mm512_inserti32x4(t, _mm_loadu_si128((const __m128i *)(pg + ro[3 * step])), 3);
}

/* Lane r of D[d] (r < 16): packed bytes 4d..4d+3 of group g (elements 8d..8d+7) of the
 * row at pg + rowoff[r] - a 4 x 4 dword transpose inside each 128-bit lane. */
K3_VNNI_ATTR K3_INLINE void k3_mxq_words16(const uint8_t *pg, const long *rowoff, __m512i *D) {
    __m512i v[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) v[k] = k3_mxq_lanes4(pg, rowoff + k, 4);  /* lane L: row 4L+k */
    __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    D[0] = _mm512_unpacklo_epi64(t0, t2);
    D[1] = _mm512_unpackhi_epi64(t0, t2);
    D[2] = _mm512_unpacklo_epi64(t1, t3);
    D[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* For a group left to the double path: lane r of q0 / q1 = packed bytes 0..7 / 8..15 of
 * the group in the row at pg + rowoff[r] (r < 8), as k3_mx_words_avx512 gives them for 4
 * groups at once; here 2 loads, 6 inserts and 2 permutes instead of its 8-row transpose. */
K3_VNNI_ATTR K3_INLINE void k3_mxq_words8(const uint8_t *pg, const long *rowoff, __m512i *q0,
                                          __m512i *q1) {
    const __m512i v0 = k3_mxq_lanes4(pg, rowoff, 1), v1 = k3_mxq_lanes4(pg, rowoff + 4, 1);
    *q0 = _mm512_permutex2var_epi64(v0, _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), v1);
    *q1 = _mm512_permutex2var_epi64(v0, _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15), v1);
}

/* The 16 rows' weights of one group as bytes 2*E2M1 + 12: we[d] / wo[d] hold the even /
 * odd elements of dword d (lane r: row r), the operands of every token's byte products. */
K3_VNNI_ATTR K3_INLINE void k3_mxq_weights16(const uint8_t *pg, const long *rowoff,
                                             __m512i *we, __m512i *wo) {
    /* code c -> 2*E2M1(c) + 12, indexed by a byte's low 6 bits (vpermb ignores the rest),
     * so the nibble needs no mask: the table repeats every 16 entries */
    const __m512i tbl = _mm512_broadcast_i32x4(
        _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    __m512i D[4];
    k3_mxq_words16(pg, rowoff, D);
#pragma GCC unroll 4
    for (int d = 0; d < 4; d++) {
        we[d] = _mm512_permutexvar_epi8(D[d], tbl);
        wo[d] = _mm512_permutexvar_epi8(_mm512_srli_epi32(D[d], 4), tbl);
    }
}

/* One token's exact group over 16 rows: acc[h] (rows 8h..8h+7) += its exact sum times the
 * scale. */
K3_VNNI_ATTR K3_INLINE void k3_mxq_group16(const __m512i *we, const __m512i *wo,
                                           const k3_mxq_group *qg, const __m512i *sc8, int gi,
                                           __m512d *acc, const int P) {
    __m512i s[K3_MXQ_PMAX];
    for (int k = 0; k < P; k++) s[k] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int d = 0; d < 4; d++) {
#pragma GCC unroll 6
        for (int k = 0; k < P; k++) {
            int32_t de, dodd;
            memcpy(&de, qg->dig[k][d][0], 4);
            memcpy(&dodd, qg->dig[k][d][1], 4);
            s[k] = _mm512_dpbusd_epi32(s[k], we[d], _mm512_set1_epi32(de));
            s[k] = _mm512_dpbusd_epi32(s[k], wo[d], _mm512_set1_epi32(dodd));
        }
    }
    /* planes in pairs: |s| <= 32 * 24 * 128 < 2^17, so s[2j] + 256 s[2j+1] fits int32 */
    __m512i c[(K3_MXQ_PMAX + 1) / 2];
    const int Q = (P + 1) / 2;
#pragma GCC unroll 3
    for (int j = 0; j < Q; j++)
        c[j] = 2 * j + 1 < P ? _mm512_add_epi32(s[2 * j], _mm512_slli_epi32(s[2 * j + 1], 8))
                             : s[2 * j];
    const __m512d corr = _mm512_set1_pd(qg->corr), b16 = _mm512_set1_pd(65536.0);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m512d tot = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(c[Q - 1], h));
#pragma GCC unroll 3
        for (int j = Q - 2; j >= 0; j--)   /* Horner: every partial an integer below 2^53 */
            tot = _mm512_fmadd_pd(tot, b16, _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(c[j], h)));
        tot = _mm512_sub_pd(tot, corr);
        __mmask8 live;
        __m512d sc = k3_mx_scale_biased_avx512(sc8[h], gi, qg->ebias, &live);
        acc[h] = _mm512_mask3_fmadd_pd(tot, sc, acc[h], live);
    }
}

/* Rows o .. o+R-1 (R <= 16) of one 16-row block against B tokens (B <= 2; token b's input
 * x + b * ldx, its plan qs[b]): Y[b * ldy + r] = f32(sum).  The weights are transposed and
 * looked up once for the B tokens. */
K3_VNNI_ATTR K3_INLINE void k3_mxq_rows16(const uint8_t *p, long ldp, const uint8_t *s,
                                          long lds, const double *x, long ldx,
                                          k3_mxq *const *qs, float *Y, long ldy, int R,
                                          const int P, const int B) {
    const int R0 = R < 8 ? R : 8, R1 = R - R0;
    const __m512i offs0 = k3_mx_offsets_avx512(lds, R0);
    const __m512i offs1 = k3_mx_offsets_avx512(lds, R1 > 0 ? R1 : 1);
    __m512d acc[2][2];
    for (int b = 0; b < B; b++) acc[b][0] = acc[b][1] = _mm512_setzero_pd();
    const long ngroups = qs[0]->ngroups;
    long rowoff[16];
    for (int r = 0; r < 16; r++) rowoff[r] = (r < R ? r : 0) * ldp;  /* past R: row 0 */
    for (long k = 0; k < 16 * lds; k += 64)  /* the next block's scale bytes */
        _mm_prefetch((const char *)s + 16 * lds + k, _MM_HINT_T0);
    for (long g0 = 0; g0 < ngroups; g0 += 8) {
        const int ng = ngroups - g0 < 8 ? (int)(ngroups - g0) : 8;
        __m512i sc8[2];
        sc8[0] = k3_mx_scales8_avx512(s, lds, offs0, g0, ng, R0);
        sc8[1] = R1 > 0 ? k3_mx_scales8_avx512(s + 8 * lds, lds, offs1, g0, ng, R1) : sc8[0];
        /* the next block's lines this step will want there, into L2: one block (16 rows)
         * ahead in the order they are read.  Measured cold (3072x3584 / 1024x1536, 1
         * thread): 12 / 11 G multiply-adds/s with each row's line 2 KB ahead into L1 (the
         * double path's scheme), 14-15.5 / 13-16 G this way; into L1 instead of L2 12-13 /
         * 11; the next block's bytes in row order 9 / -; none 8 / 7. */
        for (int r = 0; r < 16; r++) {
            const char *pf = (const char *)p + (16 + r) * ldp + g0 * 16;
            _mm_prefetch(pf, _MM_HINT_T1);
            _mm_prefetch(pf + 64, _MM_HINT_T1);
        }
        for (int gi = 0; gi < ng; gi++) {
            const long g = g0 + gi;
            __m512i we[4], wo[4], q[2][2];   /* each form made once for the pair */
            int done = 0, words = 0;
#pragma GCC unroll 2
            for (int b = 0; b < B; b++) {
                const k3_mxq_group *qg = &qs[b]->g[g];
                if (__builtin_expect(qg->exact, 1)) {
                    if (!done) k3_mxq_weights16(p + 16 * g, rowoff, we, wo);
                    done = 1;
                    k3_mxq_group16(we, wo, qg, sc8, gi, acc[b], P);
                    continue;
                }
                if (!words)
                    for (int h = 0; h < 2 && 8 * h < R; h++)
                        k3_mxq_words8(p + 16 * g, rowoff + 8 * h, &q[h][0], &q[h][1]);
                words = 1;
                for (int h = 0; h < 2 && 8 * h < R; h++) {  /* the double path, this group */
                    __mmask8 live;
                    __m512d sc = k3_mx_scale_avx512(sc8[h], gi, &live);
                    k3_mx_group_avx512(q[h][0], q[h][1], NULL, x + b * ldx + 32 * g, 0, sc,
                                       live, &acc[b][h], 1);
                }
            }
        }
    }
    for (int b = 0; b < B; b++) {
        double t[16];
        _mm512_storeu_pd(t, acc[b][0]);
        _mm512_storeu_pd(t + 8, acc[b][1]);
        for (int r = 0; r < R; r++) Y[b * ldy + r] = (float)t[r];
    }
}

#define K3_MXQ_INSTANCE(P, B)                                                               \
    K3_VNNI_ATTR static void k3_mxq_rows16_##P##_##B(                                        \
        const uint8_t *p, long ldp, const uint8_t *s, long lds, const double *x, long ldx,   \
        k3_mxq *const *qs, float *Y, long ldy, int R) {                                \
        k3_mxq_rows16(p, ldp, s, lds, x, ldx, qs, Y, ldy, R, P, B);                           \
    }
#define K3_MXQ_INSTANCES(P) K3_MXQ_INSTANCE(P, 1) K3_MXQ_INSTANCE(P, 2)
K3_MXQ_INSTANCES(1) K3_MXQ_INSTANCES(2) K3_MXQ_INSTANCES(3)
K3_MXQ_INSTANCES(4) K3_MXQ_INSTANCES(5) K3_MXQ_INSTANCES(6)

/* MXFP4 rows [o0, o1) of ntok tokens (token t: x + t * n, plan qs[t], output Y + t * ldy)
 * through the integer path, two tokens at a time. */
static void k3_mxq_rows(const uint8_t *P, const uint8_t *S, long n, long o0, long o1,
                        const double *x, long ntok, k3_mxq *const *qs, float *Y,
                        long ldy) {
    typedef void (*fn)(const uint8_t *, long, const uint8_t *, long, const double *, long,
                       k3_mxq *const *, float *, long, int);
    static const fn by_planes[K3_MXQ_PMAX][2] = {
        {k3_mxq_rows16_1_1, k3_mxq_rows16_1_2}, {k3_mxq_rows16_2_1, k3_mxq_rows16_2_2},
        {k3_mxq_rows16_3_1, k3_mxq_rows16_3_2}, {k3_mxq_rows16_4_1, k3_mxq_rows16_4_2},
        {k3_mxq_rows16_5_1, k3_mxq_rows16_5_2}, {k3_mxq_rows16_6_1, k3_mxq_rows16_6_2}};
    const long ldp = n / 2, lds = n / 32;
    for (long t = 0; t < ntok; t += 2) {
        const int B = ntok - t < 2 ? 1 : 2;
        int planes = qs[t]->planes;
        if (B == 2 && qs[t + 1]->planes > planes) planes = qs[t + 1]->planes;
        const fn f = by_planes[planes - 1][B - 1];
        for (long o = o0; o < o1; o += 16)
            f(P + o * ldp, ldp, S + o * lds, lds, x + t * n, n, qs + t, Y + t * ldy + o, ldy,
              o1 - o < 16 ? (int)(o1 - o) : 16);
    }
}

#endif /* K3_HAVE_SIMD_PATHS */

/* x (n doubles, one token) prepared for the integer path, or NULL where it does not apply
 * (path off or absent, n not whole groups, fewer than 2/3 of the groups exact, no
 * memory): the caller then passes NULL and every row takes the double path.  Why 2/3: a
 * group left to the double path inside this kernel costs ~1.4x an old-path group and an
 * exact one ~0.6x, so with fewer exact groups the old path wins (3072x3584, Zen 4, 1
 * thread, hot: 11 of 112 groups exact 0.73x, 47 0.90x, 93 1.25x, 110 1.46x).  Free with
 * free(). */
static k3_mxq *k3_mxq_make(const double *x, long n) {
#if K3_HAVE_SIMD_PATHS
    if (n <= 0 || n % 32 || !k3_mxq_active()) return NULL;
    const size_t bytes = 64 + (size_t)(n / 32) * sizeof(k3_mxq_group);
    k3_mxq *q = (k3_mxq *)malloc(bytes);   /* the kernel reads it unaligned */
    if (q == NULL) return NULL;
    q->g = (k3_mxq_group *)((char *)q + 64);
    k3_mxq_prepare(x, n, q);
    if (q->planes > 0 && 3 * q->nexact >= 2 * q->ngroups) return q;
    free(q);
#else
    (void)x; (void)n;
#endif
    return NULL;
}

/* k3_mv_rows_mxfp4, through the integer path when qs[t] (k3_mxq_make of token t) is given
 * for each of the ntok tokens; qs NULL (or a NULL entry) keeps the double path.  Up to
 * K3_MXQ_TOKENS_MAX tokens: from 3 on the double path's 4-token tiles (and from 8 its
 * decoded-once groups) ran as fast as pairs of tokens here (Zen 4, from DRAM: T = 1
 * 1.16-1.55x the double path, T = 2 1.14-1.41x, T = 3 0.93-1.12x, T = 4 0.98-1.18x). */
#define K3_MXQ_TOKENS_MAX 2
static void k3_mv_rows_mxfp4q(const uint8_t *P, const uint8_t *S, long n, long o0, long o1,
                              const double *Xd, long ntok, float *Y, long ldy,
                              k3_mxq *const *qs) {
#if K3_HAVE_SIMD_PATHS
    int all = qs != NULL && ntok >= 1 && ntok <= K3_MXQ_TOKENS_MAX && k3_mxq_active();
    for (long t = 0; all && t < ntok; t++) all = qs[t] != NULL;
    if (all) {
        k3_mxq_rows(P, S, n, o0, o1, Xd, ntok, qs, Y, ldy);
        return;
    }
#endif
    k3_mv_rows_mxfp4(P, S, n, o0, o1, Xd, ntok, Y, ldy);
}

#endif
