/* MLA attention for a block of up to 8 consecutive tokens of one head, AVX-512 (§4.5).
 *
 * Why a block: in a prefill every token of a head reads the same cache rows, so the rows
 * are read (and widened to double) once per block instead of once per token, and the
 * eight tokens fill the eight double lanes of a score vector: lane b holds token b's one
 * sequential double accumulator, which runs over the nope dims then the rope dims exactly
 * as the scalar form (fma(q, k, d) rounds like d + q*k: the float x float product is
 * exact in double).  Eight positions are scored at once so eight independent FMA chains
 * hide the FMA latency.  Softmax is the scalar code (libm expf, double normaliser); the
 * value sum keeps one float32 accumulator per (token, channel), terms in ascending
 * position order from +0.0, each product rounded before its add (separate mul and add:
 * this file is built with -ffp-contract=off, like every other).
 *
 * Only compiled into a target("avx512...") function and only called when the run-time
 * check selected the AVX-512 path (k3dot.h); tests compare it with the scalar kernel.
 */
#ifndef K3MLA_H
#define K3MLA_H

#include "k3dot.h"

#if K3_HAVE_SIMD_PATHS

/* Doubles and floats of scratch one block needs (the caller allocates per thread). */
static inline long k3_mla_block_work(long dq, long npos) { return 16 * dq + 8 * (npos + 8); }

/* O[b] = sum over positions s <= p0 + b of f32(weight * v[s]), ascending from +0.0, for
 * tokens b < nb; NB (8, or 1 for a lone token) accumulators, lanes b >= nb compute unused
 * zeros. */
K3_AVX512_ATTR K3_INLINE void k3_mla_values(const float *KV, long ldkv, long dn, long dv,
                                           long p0, long npos, const float *sc, float *O,
                                           long ldo, int nb, const int NB) {
    for (long j0 = 0; j0 < dv; j0 += 16) {
        __mmask16 m = dv - j0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dv - j0)) - 1);
        __m512 acc[8];
        for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
        const float *v = KV + dn + j0;
        for (long s = 0; s <= p0; s++) {
            __m512 vv = _mm512_maskz_loadu_ps(m, v + s * ldkv);
            for (int b = 0; b < NB; b++)
                acc[b] = _mm512_add_ps(acc[b], _mm512_mul_ps(_mm512_set1_ps(sc[s * 8 + b]), vv));
        }
        for (long s = p0 + 1; s < npos; s++) {
            __m512 vv = _mm512_maskz_loadu_ps(m, v + s * ldkv);
            for (int b = 0; b < NB; b++)    /* causal: token b stops at position p0 + b */
                if (s <= p0 + b)
                    acc[b] = _mm512_add_ps(acc[b], _mm512_mul_ps(_mm512_set1_ps(sc[s * 8 + b]), vv));
        }
        for (int b = 0; b < nb; b++) _mm512_mask_storeu_ps(O + b * ldo + j0, m, acc[b]);
    }
}

/* Q: token t0's row at head h (stride ldq between tokens); KV, R: the cache at head h's
 * k_nope (v follows at +dn), rows ldkv / ldr apart; token b (b < nb <= 8) sits at position
 * p0 + b and attends to positions 0 .. p0 + b.  O: token t0's output at head h. */
K3_AVX512_ATTR static void k3_mla_block_avx512(const float *Q, long ldq, const float *KV,
                                              long ldkv, const float *R, long ldr, long dn,
                                              long dr, long dv, long p0, int nb, float kappa,
                                              float *O, long ldo, double *work) {
    const long dq = dn + dr, npos = p0 + nb;
    double *qt = work;                 /* [dq][8]: token b's query in lane b */
    double *kd = qt + 8 * dq;          /* [8][dq]: eight cache rows widened */
    float *sc = (float *)(kd + 8 * dq);   /* [npos + 8][8]: scores, then weights */
    for (long i = 0; i < dq; i++)
        for (int b = 0; b < 8; b++) qt[i * 8 + b] = b < nb ? (double)Q[b * ldq + i] : 0.0;
    const __m256 vkappa = _mm256_set1_ps(kappa);
    for (long s0 = 0; s0 < npos; s0 += 8) {
        int ns = npos - s0 < 8 ? (int)(npos - s0) : 8;
        for (int j = 0; j < 8; j++) {
            double *row = kd + j * dq;
            if (j < ns) {
                const float *k = KV + (s0 + j) * ldkv, *rk = R + (s0 + j) * ldr;
                for (long i = 0; i < dn; i++) row[i] = (double)k[i];
                for (long i = 0; i < dr; i++) row[dn + i] = (double)rk[i];
            } else {
                for (long i = 0; i < dq; i++) row[i] = 0.0;
            }
        }
        __m512d d[8];
        for (int j = 0; j < 8; j++) d[j] = _mm512_setzero_pd();
        for (long i = 0; i < dq; i++) {
            __m512d q = _mm512_loadu_pd(qt + i * 8);
            for (int j = 0; j < 8; j++)
                d[j] = _mm512_fmadd_pd(q, _mm512_set1_pd(kd[j * dq + i]), d[j]);
        }
        for (int j = 0; j < ns; j++)   /* f32(f32(d) * kappa) per lane */
            _mm256_storeu_ps(sc + (s0 + j) * 8, _mm256_mul_ps(_mm512_cvtpd_ps(d[j]), vkappa));
    }
    for (long s = 0; s < npos; s++)    /* lanes of absent tokens: defined zeros */
        for (int b = nb; b < 8; b++) sc[s * 8 + b] = 0.0f;
    for (int b = 0; b < nb; b++) {     /* softmax of token b over positions 0 .. p0 + b */
        long p = p0 + b;
        float mx = sc[b];
        for (long s = 1; s <= p; s++)
            if (sc[s * 8 + b] > mx) mx = sc[s * 8 + b];
        double Z = 0.0;
        for (long s = 0; s <= p; s++) {
            float e = expf(sc[s * 8 + b] - mx);
            sc[s * 8 + b] = e;
            Z = Z + (double)e;
        }
        for (long s = 0; s <= p; s++) sc[s * 8 + b] = (float)((double)sc[s * 8 + b] / Z);
    }
    /* value sum, 16 channels at a time; positions beyond p0 are seen by some tokens only
     * (a decode step's single token: the same loop with one accumulator) */
    if (nb == 1) k3_mla_values(KV, ldkv, dn, dv, p0, npos, sc, O, ldo, 1, 1);
    else k3_mla_values(KV, ldkv, dn, dv, p0, npos, sc, O, ldo, nb, 8);
}

#endif /* K3_HAVE_SIMD_PATHS */
#endif
