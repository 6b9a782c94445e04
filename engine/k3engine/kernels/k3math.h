/* σ and SiTU (ARCHITECTURE §0.3, §4.3) with libm's own expf and tanhf, 16 (AVX-512) or 8
 * (AVX2) at a time.
 *
 * Why this file: the spec's σ and SiTU use the C library's expf/tanhf (§5.4), and a
 * vectorised exp/tanh from elsewhere (NumPy's, SLEEF's) differs from them in the last bit.
 * glibc's tanhf is the fdlibm code over expm1f, with branches a random sign mispredicts:
 * 31 ns a call here, so SiTU (two tanhf and one expf per element) cost ~66 ns an element,
 * ~10 % of a prefill.  The AVX-512 functions below compute the SAME steps as glibc's
 * float code (expf: the 32-entry 2^(i/32) table and the cubic, in double, in the FMA form
 * of glibc's ifunc for FMA CPUs; tanhf/expm1f: every fdlibm branch as a lane mask, in
 * float, without FMA, as glibc builds them), so they return glibc's bits, not merely
 * correctly rounded ones.
 *
 * Why trusting them is safe: benchmarks/check_libm_replica.c compares them with this
 * machine's libm over all 2^32 inputs (0 mismatches; docs/benchmarks-kernels.md), the
 * tests compare a few million, and at load k3_math_init() compares them with the libm the
 * process actually linked on inputs that reach every branch: any difference (another libm,
 * another glibc) and σ and SiTU stay on the scalar libm calls.  Lanes outside the ranges the
 * vector code covers (NaN, infinities, expf arguments >= 88 in magnitude) are recomputed
 * by the scalar call, so they are exact by construction.
 *
 * Built with -ffp-contract=off (setup.py): every multiply and add below rounds on its own,
 * as in glibc's float code; the only fused operations are expf's explicit FMAs (the
 * reduction and the cubic), exactly where glibc's FMA build fuses them.
 */
#ifndef K3MATH_H
#define K3MATH_H

#include "k3dot.h"

/* ---- scalar: the reference form (and the fallback) ------------------------------------ */

/* σ(x) = 1 / (1 + expf(-x)), a real float32 divide (§0.3) */
static inline float k3_sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

/* SiTU-GLU of one element: true division by β, never * (1/β); σ sees the UNCAPPED gate
 * (trap #28) */
static inline float k3_situ1(float g, float u, float b1, float b2) {
    float a = b1 * tanhf(g / b1);
    a = a * k3_sigm(g);
    float c = b2 * tanhf(u / b2);
    return a * c;
}

#if K3_HAVE_SIMD_PATHS

#define K3_F32(bits) _mm512_castsi512_ps(_mm512_set1_epi32((int)(bits)))

static const uint64_t k3_exp2_32[32] = {   /* 2^(i/32), glibc's table */
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
/* the cubic's coefficients, scaled for r in units of 1/32 */
#define K3_EXPF_C0 (0x1.c6af84b912394p-5 / 32 / 32 / 32)
#define K3_EXPF_C1 (0x1.ebfce50fac4f3p-3 / 32 / 32)
#define K3_EXPF_C2 (0x1.62e42ff0c52d6p-1 / 32)

/* expf of 8 doubles holding floats (glibc e_expf.c: x*32/ln2 = k + r, 2^(k/32) from the
 * table, 2^(r/32) by a cubic in double, in the fused form of glibc's FMA build). */
K3_AVX512_ATTR K3_INLINE __m512d k3_expf8d(__m512d xd) {
    /* z = x * 32/ln2 is never rounded on its own: glibc's FMA build fuses it into both
     * kd = z + shift and r = z - kd (seen in its object code; with z rounded first, 2 of
     * the 2^32 floats come out 1 ulp off, 32.56 and -63.10 among them) */
    const __m512d shift = _mm512_set1_pd(0x1.8p+52);
    const __m512d invln2n = _mm512_set1_pd(0x1.71547652b82fep+0 * 32);
    __m512d kd = _mm512_fmadd_pd(invln2n, xd, shift);    /* round to an integer, ties even */
    __m512i ki = _mm512_castpd_si512(kd);
    kd = _mm512_sub_pd(kd, shift);
    __m512d r = _mm512_fmsub_pd(invln2n, xd, kd);
    __m512i lo = _mm512_permutex2var_epi64(_mm512_loadu_si512(k3_exp2_32), ki,
                                           _mm512_loadu_si512(k3_exp2_32 + 8));
    __m512i hi = _mm512_permutex2var_epi64(_mm512_loadu_si512(k3_exp2_32 + 16), ki,
                                           _mm512_loadu_si512(k3_exp2_32 + 24));
    __mmask8 upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
    __m512i t = _mm512_mask_blend_epi64(upper, lo, hi);     /* tab[ki % 32] */
    t = _mm512_add_epi64(t, _mm512_slli_epi64(ki, 52 - 5));
    __m512d s = _mm512_castsi512_pd(t);
    __m512d c0 = _mm512_set1_pd(K3_EXPF_C0);
    __m512d c1 = _mm512_set1_pd(K3_EXPF_C1);
    __m512d c2 = _mm512_set1_pd(K3_EXPF_C2);
    __m512d p = _mm512_fmadd_pd(c0, r, c1);
    __m512d r2 = _mm512_mul_pd(r, r);
    __m512d y = _mm512_fmadd_pd(c2, r, _mm512_set1_pd(1.0));
    y = _mm512_fmadd_pd(p, r2, y);
    return _mm512_mul_pd(y, s);
}

/* y with the lanes in `odd` replaced by f(x) from libm (the lanes the copies leave out) */
K3_AVX512_ATTR static __m512 k3_libm_lanes(__m512 x, __m512 y, __mmask16 odd,
                                           float (*f)(float)) {
    float xs[16], ys[16];
    _mm512_storeu_ps(xs, x);
    _mm512_storeu_ps(ys, y);
    for (int i = 0; i < 16; i++)
        if (odd >> i & 1) ys[i] = f(xs[i]);
    return _mm512_loadu_ps(ys);
}

/* expf of 16 floats; lanes with |x| >= 88 or NaN (glibc's special-case test) are
 * recomputed by the scalar call. */
K3_AVX512_ATTR K3_INLINE __m512 k3_expf16(__m512 x) {
    __m256 lo = _mm512_cvtpd_ps(k3_expf8d(_mm512_cvtps_pd(_mm512_castps512_ps256(x))));
    __m256 hi = _mm512_cvtpd_ps(k3_expf8d(_mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1))));
    __m512 y = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20),
                                   _mm512_set1_epi32(0x7ff));
    __mmask16 odd = _mm512_cmpge_epu32_mask(top, _mm512_set1_epi32(0x42b00000 >> 20));
    return odd ? k3_libm_lanes(x, y, odd, expf) : y;
}

/* fdlibm expm1f (glibc s_expm1f.c) for the arguments tanhf gives it: a = 2|x| in [2, 44)
 * or a = -2|x| in (-2, -2^-54].  Every reduction and reconstruction branch those reach is
 * computed on all lanes and the lane's own is kept (k = 0, k = -1 and the three k >= 2 /
 * k <= -2 forms); the branches no such argument reaches (|a| >= 27 ln2 with a < 0, k = 1,
 * |a| >= 88.7) are not here. */
K3_AVX512_ATTR K3_INLINE __m512 k3_expm1f16_tanh(__m512 a) {
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    const __m512 ln2_hi = K3_F32(0x3f317180), ln2_lo = K3_F32(0x3717f7d1);
    __m512i hx = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff));
    __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(a));
    __mmask16 red = _mm512_cmpgt_epi32_mask(hx, _mm512_set1_epi32(0x3eb17218));
    __mmask16 near = _mm512_cmplt_epi32_mask(hx, _mm512_set1_epi32(0x3f851592));
    __mmask16 tiny = ~red & _mm512_cmplt_epi32_mask(hx, _mm512_set1_epi32(0x33000000));
    /* |a| in (0.5 ln2, 1.5 ln2): k = -1 for the negative arguments reaching here */
    /* elsewhere: k = (int)(invln2 * a +- 0.5), t = k, hi = a - t*ln2_hi, lo = t*ln2_lo */
    __m512 kf = _mm512_add_ps(_mm512_mul_ps(K3_F32(0x3fb8aa3b), a),
                              _mm512_mask_blend_ps(neg, half, _mm512_set1_ps(-0.5f)));
    __m512i k = _mm512_cvttps_epi32(kf);
    __m512 t = _mm512_cvtepi32_ps(k);
    __m512 hi = _mm512_sub_ps(a, _mm512_mul_ps(t, ln2_hi));
    __m512 lo = _mm512_mul_ps(t, ln2_lo);
    __mmask16 km1 = red & near;               /* a < 0 here (a >= 2 when positive) */
    hi = _mm512_mask_blend_ps(km1, hi, _mm512_add_ps(a, ln2_hi));
    lo = _mm512_mask_blend_ps(km1, lo, _mm512_sub_ps(_mm512_setzero_ps(), ln2_lo));
    k = _mm512_mask_blend_epi32(km1, k, _mm512_set1_epi32(-1));
    k = _mm512_mask_blend_epi32(red, _mm512_setzero_si512(), k);
    __m512 xr = _mm512_sub_ps(hi, lo);
    __m512 c = _mm512_sub_ps(_mm512_sub_ps(hi, xr), lo);
    xr = _mm512_mask_blend_ps(red, a, xr);
    /* primary range */
    __m512 hfx = _mm512_mul_ps(half, xr);
    __m512 hxs = _mm512_mul_ps(xr, hfx);
    __m512 q = _mm512_mul_ps(hxs, K3_F32(0xb457edbb));                 /* Q5 */
    q = _mm512_mul_ps(hxs, _mm512_add_ps(K3_F32(0x36867e54), q));       /* Q4 */
    q = _mm512_mul_ps(hxs, _mm512_add_ps(K3_F32(0xb8a670cd), q));       /* Q3 */
    q = _mm512_mul_ps(hxs, _mm512_add_ps(K3_F32(0x3ad00d01), q));       /* Q2 */
    q = _mm512_mul_ps(hxs, _mm512_add_ps(K3_F32(0xbd088889), q));       /* Q1 */
    __m512 r1 = _mm512_add_ps(one, q);
    t = _mm512_sub_ps(_mm512_set1_ps(3.0f), _mm512_mul_ps(r1, hfx));
    __m512 e = _mm512_mul_ps(hxs, _mm512_div_ps(_mm512_sub_ps(r1, t),
                                                _mm512_sub_ps(_mm512_set1_ps(6.0f),
                                                              _mm512_mul_ps(xr, t))));
    /* k == 0 */
    __m512 res = _mm512_sub_ps(xr, _mm512_sub_ps(_mm512_mul_ps(xr, e), hxs));
    /* k != 0 */
    e = _mm512_sub_ps(_mm512_mul_ps(xr, _mm512_sub_ps(e, c)), c);
    e = _mm512_sub_ps(e, hxs);
    __m512i k23 = _mm512_slli_epi32(k, 23);
    __mmask16 kz = _mm512_cmpeq_epi32_mask(k, _mm512_setzero_si512());
    __mmask16 kn1 = _mm512_cmpeq_epi32_mask(k, _mm512_set1_epi32(-1));
    __mmask16 kfar = _mm512_cmple_epi32_mask(k, _mm512_set1_epi32(-2)) |
                     _mm512_cmpgt_epi32_mask(k, _mm512_set1_epi32(56));
    __mmask16 klow = _mm512_cmplt_epi32_mask(k, _mm512_set1_epi32(23)) & ~kfar & ~kz & ~kn1;
    __mmask16 kmid = ~kfar & ~kz & ~kn1 & ~klow;
    /* k == -1: 0.5 * (x - e) - 0.5 */
    __m512 r_n1 = _mm512_sub_ps(_mm512_mul_ps(half, _mm512_sub_ps(xr, e)), half);
    /* k <= -2 or k > 56: y = 1 - (e - x), exponent + k, minus 1 */
    __m512 y = _mm512_sub_ps(one, _mm512_sub_ps(e, xr));
    __m512 r_far = _mm512_sub_ps(
        _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), k23)), one);
    /* 2 <= k < 23: t = 1 - 2^-k, y = t - (e - x), exponent + k */
    __m512 t_low = _mm512_castsi512_ps(_mm512_sub_epi32(
        _mm512_set1_epi32(0x3f800000), _mm512_srlv_epi32(_mm512_set1_epi32(0x1000000), k)));
    y = _mm512_sub_ps(t_low, _mm512_sub_ps(e, xr));
    __m512 r_low = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), k23));
    /* 23 <= k <= 56: t = 2^-k, y = x - (e + t) + 1, exponent + k */
    __m512 t_mid = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_sub_epi32(_mm512_set1_epi32(0x7f), k), 23));
    y = _mm512_add_ps(_mm512_sub_ps(xr, _mm512_add_ps(e, t_mid)), one);
    __m512 r_mid = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), k23));
    res = _mm512_mask_blend_ps(kn1, res, r_n1);
    res = _mm512_mask_blend_ps(kfar, res, r_far);
    res = _mm512_mask_blend_ps(klow, res, r_low);
    res = _mm512_mask_blend_ps(kmid, res, r_mid);
    return _mm512_mask_blend_ps(tiny, res, a);    /* |a| < 2^-25: a itself */
}

/* glibc s_tanhf.c on 16 floats; NaN and infinite lanes are recomputed by the scalar call */
K3_AVX512_ATTR K3_INLINE __m512 k3_tanhf16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
    __m512i jx = _mm512_castps_si512(x);
    __m512i ix = _mm512_and_si512(jx, _mm512_set1_epi32(0x7fffffff));
    __m512 ax = _mm512_castsi512_ps(ix);
    __mmask16 big = _mm512_cmpge_epi32_mask(ix, _mm512_set1_epi32(0x3f800000));  /* |x|>=1 */
    __m512 a = _mm512_mul_ps(_mm512_mask_blend_ps(big, _mm512_set1_ps(-2.0f), two), ax);
    __m512 t = k3_expm1f16_tanh(a);
    __m512 tp2 = _mm512_add_ps(t, two);
    __m512 z = _mm512_mask_blend_ps(
        big, _mm512_div_ps(_mm512_sub_ps(_mm512_setzero_ps(), t), tp2),   /* -t/(t+2) */
        _mm512_sub_ps(one, _mm512_div_ps(two, tp2)));                     /* 1 - 2/(t+2) */
    /* |x| >= 22: one - tiny, which rounds to 1 */
    __mmask16 sat = _mm512_cmpge_epi32_mask(ix, _mm512_set1_epi32(0x41b00000));
    z = _mm512_mask_blend_ps(sat, z, _mm512_sub_ps(one, _mm512_set1_ps(1.0e-30f)));
    z = _mm512_castsi512_ps(_mm512_xor_si512(                /* (jx >= 0) ? z : -z */
        _mm512_castps_si512(z), _mm512_and_si512(jx, _mm512_set1_epi32((int)0x80000000))));
    /* |x| < 2^-55: x * (1 + x) (zero included: +-0 * 1 = +-0, glibc's own return x) */
    __mmask16 small = _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32(0x24000000));
    z = _mm512_mask_blend_ps(small, z, _mm512_mul_ps(x, _mm512_add_ps(one, x)));
    __mmask16 odd = _mm512_cmpge_epi32_mask(ix, _mm512_set1_epi32(0x7f800000));
    return odd ? k3_libm_lanes(x, z, odd, tanhf) : z;
}

/* σ(g) = 1 / (1 + expf(-g)) on 16 floats, as k3_sigm */
K3_AVX512_ATTR K3_INLINE __m512 k3_sigm16(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, k3_expf16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

K3_AVX512_ATTR K3_INLINE __m512 k3_situ16(__m512 g, __m512 u, __m512 b1, __m512 b2) {
    __m512 a = _mm512_mul_ps(b1, k3_tanhf16(_mm512_div_ps(g, b1)));
    a = _mm512_mul_ps(a, k3_sigm16(g));
    __m512 c = _mm512_mul_ps(b2, k3_tanhf16(_mm512_div_ps(u, b2)));
    return _mm512_mul_ps(a, c);
}

/* y[i] = σ(g[i]) (mul 0) or y[i] * σ(g[i]) (mul 1; g may be y: SiLU) for whole vectors */
K3_AVX512_ATTR static long k3_sigm_avx512(const float *g, long n, float *y, int mul) {
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 s = k3_sigm16(_mm512_loadu_ps(g + i));
        _mm512_storeu_ps(y + i, mul ? _mm512_mul_ps(_mm512_loadu_ps(y + i), s) : s);
    }
    return i;
}

/* y[i] = SiTU(g[i], u[i]) for i < n (f32 out), or widened to double (f64 out) */
K3_AVX512_ATTR static long k3_situ_avx512(const float *g, const float *u, long n, float b1,
                                          float b2, float *yf, double *yd) {
    __m512 vb1 = _mm512_set1_ps(b1), vb2 = _mm512_set1_ps(b2);
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 y = k3_situ16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i), vb1, vb2);
        if (yd) {
            _mm512_storeu_pd(yd + i, _mm512_cvtps_pd(_mm512_castps512_ps256(y)));
            _mm512_storeu_pd(yd + i + 8, _mm512_cvtps_pd(_mm512_extractf32x8_ps(y, 1)));
        } else {
            _mm512_storeu_ps(yf + i, y);
        }
    }
    return i;
}

/* ---- AVX2: the same steps, 8 floats at a time ------------------------------------------ */
/* Line for line the AVX-512 functions above, with lane masks as vectors (all ones where
 * set) and blendv for the masked selects; kept as a parallel copy rather than one body
 * behind an ISA layer because a merged form could not be run on an AVX2-only machine
 * before it replaced the AVX-512 code.  Checked at load like the AVX-512 copies. */
#define K3_F32X8(bits) _mm256_castsi256_ps(_mm256_set1_epi32((int)(bits)))
#define K3_I32X8(v) _mm256_set1_epi32((int)(v))
#define K3_SEL8(m, a, b) _mm256_blendv_ps((a), (b), _mm256_castsi256_ps(m))   /* m ? b : a */
#define K3_GT8(a, b) _mm256_cmpgt_epi32((a), (b))

K3_AVX2_ATTR K3_INLINE __m256d k3_expf4d_avx2(__m256d xd) {
    const __m256d shift = _mm256_set1_pd(0x1.8p+52);
    const __m256d invln2n = _mm256_set1_pd(0x1.71547652b82fep+0 * 32);
    __m256d kd = _mm256_fmadd_pd(invln2n, xd, shift);    /* round to an integer, ties even */
    __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, shift);
    __m256d r = _mm256_fmsub_pd(invln2n, xd, kd);
    __m256i t = _mm256_i64gather_epi64((const long long *)k3_exp2_32,
                                       _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
    t = _mm256_add_epi64(t, _mm256_slli_epi64(ki, 52 - 5));
    __m256d s = _mm256_castsi256_pd(t);
    __m256d p = _mm256_fmadd_pd(_mm256_set1_pd(K3_EXPF_C0), r, _mm256_set1_pd(K3_EXPF_C1));
    __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(_mm256_set1_pd(K3_EXPF_C2), r, _mm256_set1_pd(1.0));
    y = _mm256_fmadd_pd(p, r2, y);
    return _mm256_mul_pd(y, s);
}

K3_AVX2_ATTR static __m256 k3_libm_lanes8(__m256 x, __m256 y, int odd, float (*f)(float)) {
    float xs[8], ys[8];
    _mm256_storeu_ps(xs, x);
    _mm256_storeu_ps(ys, y);
    for (int i = 0; i < 8; i++)
        if (odd >> i & 1) ys[i] = f(xs[i]);
    return _mm256_loadu_ps(ys);
}

K3_AVX2_ATTR K3_INLINE __m256 k3_expf8_avx2(__m256 x) {
    __m128 lo = _mm256_cvtpd_ps(k3_expf4d_avx2(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
    __m128 hi = _mm256_cvtpd_ps(k3_expf4d_avx2(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))));
    __m256 y = _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
    __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20),
                                   K3_I32X8(0x7ff));
    __m256i big = K3_GT8(top, K3_I32X8((0x42b00000 >> 20) - 1));     /* |x| >= 88 or NaN */
    int odd = _mm256_movemask_ps(_mm256_castsi256_ps(big));
    return odd ? k3_libm_lanes8(x, y, odd, expf) : y;
}

K3_AVX2_ATTR K3_INLINE __m256 k3_expm1f8_tanh_avx2(__m256 a) {
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    const __m256 ln2_hi = K3_F32X8(0x3f317180), ln2_lo = K3_F32X8(0x3717f7d1);
    __m256i hx = _mm256_and_si256(_mm256_castps_si256(a), K3_I32X8(0x7fffffff));
    __m256i neg = _mm256_srai_epi32(_mm256_castps_si256(a), 31);
    __m256i red = K3_GT8(hx, K3_I32X8(0x3eb17218));
    __m256i near = K3_GT8(K3_I32X8(0x3f851592), hx);
    __m256i tiny = _mm256_andnot_si256(red, K3_GT8(K3_I32X8(0x33000000), hx));
    __m256 kf = _mm256_add_ps(_mm256_mul_ps(K3_F32X8(0x3fb8aa3b), a),
                              K3_SEL8(neg, half, _mm256_set1_ps(-0.5f)));
    __m256i k = _mm256_cvttps_epi32(kf);
    __m256 t = _mm256_cvtepi32_ps(k);
    __m256 hi = _mm256_sub_ps(a, _mm256_mul_ps(t, ln2_hi));
    __m256 lo = _mm256_mul_ps(t, ln2_lo);
    __m256i km1 = _mm256_and_si256(red, near);
    hi = K3_SEL8(km1, hi, _mm256_add_ps(a, ln2_hi));
    lo = K3_SEL8(km1, lo, _mm256_sub_ps(_mm256_setzero_ps(), ln2_lo));
    k = _mm256_blendv_epi8(k, K3_I32X8(-1), km1);
    k = _mm256_and_si256(k, red);
    __m256 xr = _mm256_sub_ps(hi, lo);
    __m256 c = _mm256_sub_ps(_mm256_sub_ps(hi, xr), lo);
    xr = K3_SEL8(red, a, xr);
    __m256 hfx = _mm256_mul_ps(half, xr);
    __m256 hxs = _mm256_mul_ps(xr, hfx);
    __m256 q = _mm256_mul_ps(hxs, K3_F32X8(0xb457edbb));                 /* Q5 */
    q = _mm256_mul_ps(hxs, _mm256_add_ps(K3_F32X8(0x36867e54), q));       /* Q4 */
    q = _mm256_mul_ps(hxs, _mm256_add_ps(K3_F32X8(0xb8a670cd), q));       /* Q3 */
    q = _mm256_mul_ps(hxs, _mm256_add_ps(K3_F32X8(0x3ad00d01), q));       /* Q2 */
    q = _mm256_mul_ps(hxs, _mm256_add_ps(K3_F32X8(0xbd088889), q));       /* Q1 */
    __m256 r1 = _mm256_add_ps(one, q);
    t = _mm256_sub_ps(_mm256_set1_ps(3.0f), _mm256_mul_ps(r1, hfx));
    __m256 e = _mm256_mul_ps(hxs, _mm256_div_ps(_mm256_sub_ps(r1, t),
                                                _mm256_sub_ps(_mm256_set1_ps(6.0f),
                                                              _mm256_mul_ps(xr, t))));
    __m256 res = _mm256_sub_ps(xr, _mm256_sub_ps(_mm256_mul_ps(xr, e), hxs));
    e = _mm256_sub_ps(_mm256_mul_ps(xr, _mm256_sub_ps(e, c)), c);
    e = _mm256_sub_ps(e, hxs);
    __m256i k23 = _mm256_slli_epi32(k, 23);
    __m256i kz = _mm256_cmpeq_epi32(k, _mm256_setzero_si256());
    __m256i kn1 = _mm256_cmpeq_epi32(k, K3_I32X8(-1));
    __m256i kfar = _mm256_or_si256(K3_GT8(K3_I32X8(-1), k), K3_GT8(k, K3_I32X8(56)));
    __m256i other = _mm256_or_si256(kfar, _mm256_or_si256(kz, kn1));
    __m256i klow = _mm256_andnot_si256(other, K3_GT8(K3_I32X8(23), k));
    __m256i kmid = _mm256_andnot_si256(_mm256_or_si256(other, klow), K3_I32X8(-1));
    __m256 r_n1 = _mm256_sub_ps(_mm256_mul_ps(half, _mm256_sub_ps(xr, e)), half);
    __m256 y = _mm256_sub_ps(one, _mm256_sub_ps(e, xr));
    __m256 r_far = _mm256_sub_ps(
        _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), k23)), one);
    __m256 t_low = _mm256_castsi256_ps(_mm256_sub_epi32(
        K3_I32X8(0x3f800000), _mm256_srlv_epi32(K3_I32X8(0x1000000), k)));
    y = _mm256_sub_ps(t_low, _mm256_sub_ps(e, xr));
    __m256 r_low = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), k23));
    __m256 t_mid = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_sub_epi32(K3_I32X8(0x7f), k), 23));
    y = _mm256_add_ps(_mm256_sub_ps(xr, _mm256_add_ps(e, t_mid)), one);
    __m256 r_mid = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), k23));
    res = K3_SEL8(kn1, res, r_n1);
    res = K3_SEL8(kfar, res, r_far);
    res = K3_SEL8(klow, res, r_low);
    res = K3_SEL8(kmid, res, r_mid);
    return K3_SEL8(tiny, res, a);
}

K3_AVX2_ATTR K3_INLINE __m256 k3_tanhf8_avx2(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    __m256i jx = _mm256_castps_si256(x);
    __m256i ix = _mm256_and_si256(jx, K3_I32X8(0x7fffffff));
    __m256 ax = _mm256_castsi256_ps(ix);
    __m256i big = K3_GT8(ix, K3_I32X8(0x3f800000 - 1));                    /* |x| >= 1 */
    __m256 a = _mm256_mul_ps(K3_SEL8(big, _mm256_set1_ps(-2.0f), two), ax);
    __m256 t = k3_expm1f8_tanh_avx2(a);
    __m256 tp2 = _mm256_add_ps(t, two);
    __m256 z = K3_SEL8(big, _mm256_div_ps(_mm256_sub_ps(_mm256_setzero_ps(), t), tp2),
                       _mm256_sub_ps(one, _mm256_div_ps(two, tp2)));
    __m256i sat = K3_GT8(ix, K3_I32X8(0x41b00000 - 1));
    z = K3_SEL8(sat, z, _mm256_sub_ps(one, _mm256_set1_ps(1.0e-30f)));
    z = _mm256_castsi256_ps(_mm256_xor_si256(
        _mm256_castps_si256(z), _mm256_and_si256(jx, K3_I32X8(0x80000000))));
    __m256i small = K3_GT8(K3_I32X8(0x24000000), ix);
    z = K3_SEL8(small, z, _mm256_mul_ps(x, _mm256_add_ps(one, x)));
    int odd = _mm256_movemask_ps(_mm256_castsi256_ps(K3_GT8(ix, K3_I32X8(0x7f800000 - 1))));
    return odd ? k3_libm_lanes8(x, z, odd, tanhf) : z;
}

K3_AVX2_ATTR K3_INLINE __m256 k3_sigm8_avx2(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 e = k3_expf8_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_div_ps(one, _mm256_add_ps(one, e));
}

K3_AVX2_ATTR K3_INLINE __m256 k3_situ8_avx2(__m256 g, __m256 u, __m256 b1, __m256 b2) {
    __m256 a = _mm256_mul_ps(b1, k3_tanhf8_avx2(_mm256_div_ps(g, b1)));
    a = _mm256_mul_ps(a, k3_sigm8_avx2(g));
    __m256 c = _mm256_mul_ps(b2, k3_tanhf8_avx2(_mm256_div_ps(u, b2)));
    return _mm256_mul_ps(a, c);
}

K3_AVX2_ATTR static long k3_sigm_avx2(const float *g, long n, float *y, int mul) {
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 s = k3_sigm8_avx2(_mm256_loadu_ps(g + i));
        _mm256_storeu_ps(y + i, mul ? _mm256_mul_ps(_mm256_loadu_ps(y + i), s) : s);
    }
    return i;
}

K3_AVX2_ATTR static long k3_situ_avx2(const float *g, const float *u, long n, float b1,
                                      float b2, float *yf, double *yd) {
    __m256 vb1 = _mm256_set1_ps(b1), vb2 = _mm256_set1_ps(b2);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 y = k3_situ8_avx2(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i), vb1, vb2);
        if (yd) {
            _mm256_storeu_pd(yd + i, _mm256_cvtps_pd(_mm256_castps256_ps128(y)));
            _mm256_storeu_pd(yd + i + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)));
        } else {
            _mm256_storeu_ps(yf + i, y);
        }
    }
    return i;
}

K3_AVX2_ATTR static long k3_tanh_exp_avx2(const float *x, long n, float *t, float *e) {
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(t + i, k3_tanhf8_avx2(v));
        _mm256_storeu_ps(e + i, k3_expf8_avx2(v));
    }
    return i;
}

K3_AVX512_ATTR static long k3_tanh_exp_avx512(const float *x, long n, float *t, float *e) {
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        _mm512_storeu_ps(t + i, k3_tanhf16(v));
        _mm512_storeu_ps(e + i, k3_expf16(v));
    }
    return i;
}

/* One ISA's replicas against the linked libm on inputs that reach every branch: a dense
 * sweep of [-30, 30] (every expm1f reduction, k from -3 to 64, the |x| >= 1 switch,
 * saturation at 22), the tiny and zero arguments, expf's whole range and the two
 * arguments that tell glibc's fused expf from an unfused one.  0: some lane differed. */
static int k3_math_check(long (*tanh_exp)(const float *, long, float *, float *)) {
    enum { N = 1 << 15 };
    static float xs[N], t[N], e[N];
    uint32_t s = 12345;
    for (int i = 0; i < N; i++) {
        s = s * 1664525u + 1013904223u;
        float f;
        switch (i & 3) {
        case 0: f = -30.0f + 60.0f * (float)i / (float)N; break;     /* dense, ordered */
        case 1: f = ((float)(s >> 8) / 16777216.0f - 0.5f) * 8.0f; break;
        case 2: { uint32_t b = s & 0x8fffffffu; memcpy(&f, &b, 4); break; } /* tiny..2^32 */
        default: f = ((float)(s >> 8) / 16777216.0f - 0.5f) * 220.0f; break;  /* expf */
        }
        xs[i] = f;
    }
    xs[0] = 0x1.04845ep+5f;     /* the two expf arguments an unfused z gets wrong */
    xs[1] = -0x1.f8cbb2p+5f;
    if (tanh_exp(xs, N, t, e) != N) return 0;
    for (int i = 0; i < N; i++) {
        float tl = tanhf(xs[i]), el = expf(xs[i]);
        if (memcmp(&tl, &t[i], 4) || memcmp(&el, &e[i], 4)) return 0;
    }
    return 1;
}
#endif /* K3_HAVE_SIMD_PATHS */

/* Which paths' replicas passed k3_math_init's check (bit 1 << K3_ISA_AVX2 / _AVX512) */
static int k3_math_ok = 0;

/* Run once at load: a path's replicas are used only if this CPU runs the path and they
 * equal the linked libm on k3_math_check's inputs. */
static void k3_math_init(void) {
#if K3_HAVE_SIMD_PATHS
    int best = k3_isa_best();
    if (best >= K3_ISA_AVX2 && k3_math_check(k3_tanh_exp_avx2)) k3_math_ok |= 1 << K3_ISA_AVX2;
    if (best >= K3_ISA_AVX512 && k3_math_check(k3_tanh_exp_avx512))
        k3_math_ok |= 1 << K3_ISA_AVX512;
#endif
}

/* 1 while σ and SiTU run on the selected path's replicas (set_isa('scalar') runs libm
 * for every element) */
static inline int k3_math_active(void) {
    return k3_math_ok >> k3_isa() & 1;      /* the scalar path's bit is never set */
}

/* tanhf and expf of x[0..n) (the tests' entry): the active replicas where replica is
 * set, libm otherwise.  Returns 1 if the replicas ran. */
static int k3_tanh_exp_rows(const float *x, long n, float *t, float *e, int replica) {
    long i = 0;
#if K3_HAVE_SIMD_PATHS
    if (replica && k3_math_active())
        i = k3_isa() == K3_ISA_AVX512 ? k3_tanh_exp_avx512(x, n, t, e)
                                      : k3_tanh_exp_avx2(x, n, t, e);
#endif
    int ran = i > 0;
    for (; i < n; i++) {
        t[i] = tanhf(x[i]);
        e[i] = expf(x[i]);
    }
    return ran;
}

/* σ over n elements: y[i] = σ(g[i]) (mul 0) or y[i] * σ(g[i]) (mul 1; g may be y) */
static inline void k3_sigm_rows(const float *g, long n, float *y, int mul) {
    long i = 0;
#if K3_HAVE_SIMD_PATHS
    if (k3_math_active())
        i = k3_isa() == K3_ISA_AVX512 ? k3_sigm_avx512(g, n, y, mul) : k3_sigm_avx2(g, n, y, mul);
#endif
    for (; i < n; i++) y[i] = mul ? y[i] * k3_sigm(g[i]) : k3_sigm(g[i]);
}

/* SiTU over n elements, f32 out (yd NULL) or f64 out (yf NULL) */
static inline void k3_situ_rows(const float *g, const float *u, long n, float b1, float b2,
                                float *yf, double *yd) {
    long i = 0;
#if K3_HAVE_SIMD_PATHS
    if (k3_math_active())
        i = k3_isa() == K3_ISA_AVX512 ? k3_situ_avx512(g, u, n, b1, b2, yf, yd)
                                      : k3_situ_avx2(g, u, n, b1, b2, yf, yd);
#endif
    for (; i < n; i++) {
        float y = k3_situ1(g[i], u[i], b1, b2);
        if (yd) yd[i] = (double)y; else yf[i] = y;
    }
}

#endif /* K3MATH_H */
