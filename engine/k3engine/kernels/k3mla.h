/* MLA attention of one head for up to 8 blocks of 8 consecutive tokens, or for a decode
 * step's lone token, AVX-512 (§4.5).
 *
 * Why blocks: in a prefill every token of a head reads the same cached keys, so each key
 * block is read (and widened to double) once per item instead of once per token, and a block's
 * eight tokens fill the eight double lanes of a score vector: lane b holds token b's one
 * sequential double accumulator, which runs over the nope dims then the rope dims exactly
 * as the scalar form (fma(q, k, d) rounds like d + q*k: the float x float product is
 * exact in double).  Eight positions are scored at once so eight independent FMA chains
 * hide the FMA latency.  Softmax: the scalar form's max, libm's expf (or its checked
 * replica, k3math.h) and a double normaliser, lane by lane; the value sum keeps one
 * float32 accumulator per (token, channel), terms in ascending position order from +0.0,
 * each product rounded before its add (separate mul and add: this file is built with
 * -ffp-contract=off, like every other).  A lone token has the positions in the lanes
 * instead (k3_mla_one_avx512), with the same orders.
 *
 * Only compiled into a target("avx512...") function and only called when the run-time
 * check selected the AVX-512 path (k3dot.h); tests compare it with the scalar kernel.
 */
#ifndef K3MLA_H
#define K3MLA_H

#include "k3dot.h"
#include "k3math.h"

/* Positions per key block of the cache (state.MLAState): k_nope and the rope keys are held
 * dimension-major within blocks of 8 positions, so a block's dimension i is 8 floats side
 * by side, the 8 double lanes of a score vector (and the scalar kernel's 4-position steps
 * stay inside one block). */
#define K3_KEY_BLOCK 8

#if K3_HAVE_SIMD_PATHS

/* Token blocks per work item of a prefill: they share each widened key row and each value
 * row (copied once per chunk, k3_mla_values).  Why: items of one block re-read every cached
 * row of their head per 8 tokens, so a long prompt's attention waited on memory (perf: ~70 %
 * of a 2,048-position prefill's MLA samples on the key and value row loads; rows are a
 * position's heads apart, a new page each). */
#define K3_MLA_G 8

/* Positions per chunk of a prefill item's value pass.  Why chunks: the pass used to walk
 * all of a head's positions per 16 channels and block, reading one line of a row 16 KB
 * from the last (mid) and, with 8 blocks' lane counts to honour, storing its 8
 * accumulators to the stack at every position (GCC kept them there); perf put ~45 % of a
 * 512-token call over 8,192 positions in that loop, a quarter of it on the row loads.  Now
 * a chunk's value rows are copied side by side into scratch once, every channel pass and
 * block reads them from L1 with its accumulators in registers, and the accumulators wait
 * in memory between chunks (exact: a float stored and loaded is the same float).  Software
 * prefetch of the next chunk's rows measured no different (1 thread, alternated three
 * times), so there is none. */
#define K3_MLA_VCHUNK 32

/* For each block g < G of nb[g] tokens at positions p0[g] .. p0[g] + nb[g] - 1 (weights sc
 * + g * ldsc, [position][8]; p0 ascending): O[8g + b] = sum over positions s <= p0[g] + b
 * of f32(weight * v[s]), ascending from +0.0; lanes b >= nb[g] compute unused values.
 * acc: (G * 8 + K3_MLA_VCHUNK) * k3_mla_dv16(dv) floats of scratch. */
static inline long k3_mla_dv16(long dv) { return (dv + 15) & ~15L; }
/* The lanes of a 16-float vector that hold channels when `left` channels remain. */
static inline __mmask16 k3_mla_mask16(long left) {
    return left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
}
K3_AVX512_ATTR K3_INLINE void k3_mla_values(const float *v, long ldv, long dv, int G,
                                           const long *p0, const float *sc, long ldsc,
                                           float *O, long ldo, const int *nb, float *acc) {
    const long dvp = k3_mla_dv16(dv), last = p0[G - 1];
    float *vc = acc + G * 8 * dvp;     /* a chunk's value rows, dvp floats apart */
    for (long i = 0; i < G * 8 * dvp; i++) acc[i] = 0.0f;
    /* every token's positions 0 .. p0[g]: chunk by chunk, each chunk channels then blocks */
    for (long c0 = 0; c0 <= last; c0 += K3_MLA_VCHUNK) {
        const long c1 = last + 1 - c0 < K3_MLA_VCHUNK ? last + 1 : c0 + K3_MLA_VCHUNK;
        for (long s = c0; s < c1; s++)
            for (long j0 = 0; j0 < dvp; j0 += 16)
                _mm512_storeu_ps(vc + (s - c0) * dvp + j0,
                                 _mm512_maskz_loadu_ps(k3_mla_mask16(dv - j0), v + s * ldv + j0));
        for (long j0 = 0; j0 < dvp; j0 += 16)
            for (int g = 0; g < G; g++) {
                const long e = c1 < p0[g] + 1 ? c1 : p0[g] + 1;
                if (c0 >= e) continue;
                const float *w = sc + g * ldsc;
                float *ag = acc + g * 8 * dvp + j0;
                __m512 a[8];
                for (int b = 0; b < 8; b++) a[b] = _mm512_loadu_ps(ag + b * dvp);
                for (long s = c0; s < e; s++) {
                    __m512 vv = _mm512_loadu_ps(vc + (s - c0) * dvp + j0);
                    for (int b = 0; b < 8; b++)
                        a[b] = _mm512_add_ps(a[b], _mm512_mul_ps(_mm512_set1_ps(w[s * 8 + b]), vv));
                }
                for (int b = 0; b < 8; b++) _mm512_storeu_ps(ag + b * dvp, a[b]);
            }
    }
    /* then each block's own causal tail: token b stops at position p0[g] + b */
    for (long j0 = 0; j0 < dv; j0 += 16) {
        const __mmask16 m = k3_mla_mask16(dv - j0);
        for (int g = 0; g < G; g++) {
            const float *w = sc + g * ldsc;
            const float *ag = acc + g * 8 * dvp + j0;
            const long q0 = p0[g];
            __m512 a[8];
            for (int b = 0; b < 8; b++) a[b] = _mm512_loadu_ps(ag + b * dvp);
            for (long s = q0 + 1; s < q0 + nb[g]; s++) {
                __m512 vv = _mm512_maskz_loadu_ps(m, v + s * ldv + j0);
                for (int b = 0; b < 8; b++)
                    if (s <= q0 + b)
                        a[b] = _mm512_add_ps(a[b], _mm512_mul_ps(_mm512_set1_ps(w[s * 8 + b]), vv));
            }
            for (int b = 0; b < nb[g]; b++) _mm512_mask_storeu_ps(O + (8 * g + b) * ldo + j0, m, a[b]);
        }
    }
}

/* Softmax of a block's nb tokens side by side (sc: [position][8] scores, position p0 + b
 * is token b's own): lane b over positions 0 .. p0 + b, with its scalar form's max (>
 * ignores NaN), expf (the checked replica where active), ascending double normaliser and
 * divides; other lanes keep their values. */
K3_AVX512_ATTR static void k3_mla_softmax8(float *sc, long p0, int nb) {
    const long npos = p0 + nb;
    const __mmask8 toks = (__mmask8)((1u << nb) - 1);
#define K3_MLA_LIVE(s) ((s) <= p0 ? toks : (__mmask8)(toks & (0xFFu << ((s) - p0))))
    __m256 mx = _mm256_loadu_ps(sc);
    for (long s = 1; s < npos; s++) {
        __m256 v = _mm256_loadu_ps(sc + s * 8);
        mx = _mm256_mask_blend_ps(_mm256_mask_cmp_ps_mask(K3_MLA_LIVE(s), v, mx, _CMP_GT_OQ),
                                  mx, v);
    }
    const int vexp = k3_math_active();
    const __m512 mx2 = _mm512_insertf32x8(_mm512_castps256_ps512(mx), mx, 1);
    __m512d zv = _mm512_setzero_pd();
    for (long s = 0; s < npos; s += 2) {
        const int two = s + 1 < npos;
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(two ? 0xFFFF : 0xFF, sc + s * 8), mx2);
        __m512 e;
        if (vexp) {
            e = k3_expf16(x);
        } else {
            float xs[16];
            _mm512_storeu_ps(xs, x);
            for (int i = 0; i < 16; i++) xs[i] = expf(xs[i]);
            e = _mm512_loadu_ps(xs);
        }
        for (int k = 0; k <= two; k++) {
            const __mmask8 live = K3_MLA_LIVE(s + k);
            __m256 ek = k ? _mm512_extractf32x8_ps(e, 1) : _mm512_castps512_ps256(e);
            _mm256_mask_storeu_ps(sc + (s + k) * 8, live, ek);
            zv = _mm512_mask_add_pd(zv, live, zv, _mm512_cvtps_pd(ek));
        }
    }
    for (long s = 0; s < npos; s++)
        _mm256_mask_storeu_ps(sc + s * 8, K3_MLA_LIVE(s), _mm512_cvtpd_ps(_mm512_div_pd(
                                  _mm512_cvtps_pd(_mm256_loadu_ps(sc + s * 8)), zv)));
#undef K3_MLA_LIVE
}

/* d[b] lane j += q[i] * blk[b][KB * i + j] for i = 0 .. n-1 in order, b < 4: four key
 * blocks, each lane one position's sequential double chain (fma rounds like d + q*k: the
 * float x float product is exact in double).  A block holds dimension i of its positions
 * side by side, so a dimension is one load, one convert and one FMA. */
K3_AVX512_ATTR K3_INLINE void k3_mla_dots32(const float *const *blk, long n, const double *q,
                                           __m512d *d) {
    for (long i = 0; i < n; i++) {
        const __m512d qi = _mm512_set1_pd(q[i]);
        for (int b = 0; b < 4; b++)
            d[b] = _mm512_fmadd_pd(qi, _mm512_cvtps_pd(_mm256_loadu_ps(blk[b] + K3_KEY_BLOCK * i)), d[b]);
    }
}

/* Doubles of scratch k3_mla_block_avx512 needs for up to 8 * K3_MLA_G tokens over npos
 * positions (a lone token takes k3_mla_one_avx512). */
static inline long k3_mla_block_work(long dq, long dv, long npos) {
    const long blk = (K3_MLA_G + 1) * 8 * dq + K3_MLA_G * 4 * (npos + 8) +
                     (K3_MLA_G * 8 + K3_MLA_VCHUNK) * k3_mla_dv16(dv) / 2 + 1;
    const long one = dq + (npos + 32 + 1) / 2;
    return blk > one ? blk : one;
}

/* One token at position p0 (a decode step) over positions 0 .. p0, the same per-output
 * orders as a block of 1 (and the scalar kernel).  Why its own path: in a block the
 * tokens fill the double lanes, so a lone token would use one lane of eight; here the
 * lanes are positions (4 key blocks, 32 positions, at a time: four chains), the softmax's
 * expf runs on the checked replica (k3math.h) where it is active, and the value sum walks
 * each value row once. */
K3_AVX512_ATTR static void k3_mla_one_avx512(const float *Q, const float *Kh, const float *Vh,
                                            long ldv, const float *R, long dn, long dr, long dv,
                                            long p0, float kappa, float *O, double *work) {
    const long dq = dn + dr, npos = p0 + 1;
    double *qd = work;
    float *sc = (float *)(work + dq);  /* npos + 32 floats: the last block's spare lanes */
    for (long i = 0; i < dq; i++) qd[i] = (double)Q[i];
    const __m256 vkappa = _mm256_set1_ps(kappa);
    const long last = p0 / K3_KEY_BLOCK;
    for (long s0 = 0; s0 < npos; s0 += 4 * K3_KEY_BLOCK) {
        const float *kb[4], *rb[4];
        for (int b = 0; b < 4; b++) {   /* past the last block: it again, its lanes unused */
            long blk = s0 / K3_KEY_BLOCK + b < last ? s0 / K3_KEY_BLOCK + b : last;
            kb[b] = Kh + blk * K3_KEY_BLOCK * dn, rb[b] = R + blk * K3_KEY_BLOCK * dr;
        }
        __m512d d[4];
        for (int b = 0; b < 4; b++) d[b] = _mm512_setzero_pd();
        k3_mla_dots32(kb, dn, qd, d);
        k3_mla_dots32(rb, dr, qd + dn, d);
        for (int b = 0; b < 4; b++)    /* f32(f32(d) * kappa) */
            _mm256_storeu_ps(sc + s0 + 8 * b, _mm256_mul_ps(_mm512_cvtpd_ps(d[b]), vkappa));
    }
    float mx = sc[0];
    for (long s = 1; s < npos; s++)
        if (sc[s] > mx) mx = sc[s];
    long s = 0;
    if (k3_math_active()) {            /* the replica's bits are libm's (checked at load) */
        const __m512 vmx = _mm512_set1_ps(mx);
        for (; s + 16 <= npos; s += 16)
            _mm512_storeu_ps(sc + s, k3_expf16(_mm512_sub_ps(_mm512_loadu_ps(sc + s), vmx)));
    }
    for (; s < npos; s++) sc[s] = expf(sc[s] - mx);
    double Z = 0.0;
    for (s = 0; s < npos; s++) Z = Z + (double)sc[s];   /* ascending, one chain */
    const __m512d vz = _mm512_set1_pd(Z);
    for (s = 0; s + 8 <= npos; s += 8)  /* f32(e / Z): a correctly rounded divide either way */
        _mm256_storeu_ps(sc + s, _mm512_cvtpd_ps(_mm512_div_pd(
                                     _mm512_cvtps_pd(_mm256_loadu_ps(sc + s)), vz)));
    for (; s < npos; s++) sc[s] = (float)((double)sc[s] / Z);
    /* value sum: up to 128 channels' float32 accumulators at once, each adding its terms
     * in ascending position order from +0.0, each product rounded before its add */
    for (long j0 = 0; j0 < dv; j0 += 128) {
        const int nc = (int)((dv - j0 + 15) / 16 < 8 ? (dv - j0 + 15) / 16 : 8);
        __mmask16 m[8];
        __m512 acc[8];
        for (int c = 0; c < 8; c++) {
            m[c] = k3_mla_mask16(dv - j0 - 16 * c);
            acc[c] = _mm512_setzero_ps();
        }
        const float *v = Vh + j0;
        for (s = 0; s < npos; s++) {
            const __m512 w = _mm512_set1_ps(sc[s]);
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                if (c < nc)
                    acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(
                                 w, _mm512_maskz_loadu_ps(m[c], v + s * ldv + 16 * c)));
        }
        for (int c = 0; c < nc; c++) _mm512_mask_storeu_ps(O + j0 + 16 * c, m[c], acc[c]);
    }
}

/* Q: token t0's row at head h (stride ldq between tokens); Kh: head h's key blocks; Vh:
 * its value rows, ldv apart; R: the shared rope key blocks; token t (t < ntok <= 8 *
 * K3_MLA_G) sits at position p0 + t and attends to positions 0 .. p0 + t.  O: token t0's
 * output at head h.  Tokens run in blocks of 8 (block g: tokens 8g .. 8g+7 in the double lanes), the
 * blocks sharing each widened key row. */
K3_AVX512_ATTR static void k3_mla_block_avx512(const float *Q, long ldq, const float *Kh,
                                              const float *Vh, long ldv, const float *R,
                                              long dn, long dr, long dv, long p0, int ntok,
                                              float kappa, float *O, long ldo, double *work) {
    if (ntok == 1) {
        k3_mla_one_avx512(Q, Kh, Vh, ldv, R, dn, dr, dv, p0, kappa, O, work);
        return;
    }
    const long dq = dn + dr, npos = p0 + ntok, ldsc = (npos + 8) * 8;
    const int G = (ntok + 7) / 8;
    int nb[K3_MLA_G];
    long p0g[K3_MLA_G];
    for (int g = 0; g < G; g++) nb[g] = ntok - 8 * g < 8 ? ntok - 8 * g : 8, p0g[g] = p0 + 8 * g;
    double *qt = work;                    /* [G][dq][8]: block g's token b's query in lane b */
    double *kd = qt + G * 8 * dq;         /* [dq][8]: a key block widened */
    float *sc = (float *)(kd + 8 * dq);   /* [G][npos + 8][8]: scores, then weights */
    float *acc = sc + G * ldsc;           /* value sums and rows (k3_mla_values) */
    for (int g = 0; g < G; g++)
        for (long i = 0; i < dq; i++)
            for (int b = 0; b < 8; b++)
                qt[(g * dq + i) * 8 + b] = b < nb[g] ? (double)Q[(8 * g + b) * ldq + i] : 0.0;
    const __m256 vkappa = _mm256_set1_ps(kappa);
    for (long s0 = 0; s0 < npos; s0 += 8) {
        const int ns = npos - s0 < 8 ? (int)(npos - s0) : 8;
        const __mmask8 live = (__mmask8)((1u << ns) - 1);   /* lanes past npos: zeros */
        const float *kb = Kh + s0 * dn, *rb = R + s0 * dr;  /* s0: a block's first position */
        for (long i = 0; i < dn; i++)
            _mm512_storeu_pd(kd + i * 8, _mm512_cvtps_pd(_mm256_maskz_loadu_ps(
                                             live, kb + K3_KEY_BLOCK * i)));
        for (long i = 0; i < dr; i++)
            _mm512_storeu_pd(kd + (dn + i) * 8, _mm512_cvtps_pd(_mm256_maskz_loadu_ps(
                                                    live, rb + K3_KEY_BLOCK * i)));
        for (int g = 0; g < G; g++) {
            const long npg = p0g[g] + nb[g];  /* block g's positions: 0 .. npg - 1 */
            if (s0 >= npg) continue;
            const double *qg = qt + g * dq * 8;
            __m512d d[8];
            for (int j = 0; j < 8; j++) d[j] = _mm512_setzero_pd();
            for (long i = 0; i < dq; i++) {
                __m512d q = _mm512_loadu_pd(qg + i * 8);
                for (int j = 0; j < 8; j++)
                    d[j] = _mm512_fmadd_pd(q, _mm512_set1_pd(kd[i * 8 + j]), d[j]);
            }
            float *scg = sc + g * ldsc;
            for (int j = 0; j < 8 && s0 + j < npg; j++)   /* f32(f32(d) * kappa) per lane */
                _mm256_storeu_ps(scg + (s0 + j) * 8, _mm256_mul_ps(_mm512_cvtpd_ps(d[j]), vkappa));
        }
    }
    for (int g = 0; g < G; g++) {
        float *scg = sc + g * ldsc;
        for (long s = 0; s < p0g[g] + nb[g]; s++)   /* lanes of absent tokens: defined zeros */
            for (int b = nb[g]; b < 8; b++) scg[s * 8 + b] = 0.0f;
        k3_mla_softmax8(scg, p0g[g], nb[g]);
    }
    /* value sum, 16 channels at a time; positions beyond p0g[g] are seen by some tokens only */
    k3_mla_values(Vh, ldv, dv, G, p0g, sc, ldsc, O, ldo, nb, acc);
}

#endif /* K3_HAVE_SIMD_PATHS */
#endif
