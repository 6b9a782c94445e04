/* The double-FMA ceiling of one core: what a compute-bound kernel (prefill's panels, MXFP4)
 * can reach at best, the denominator of the "% of FMA peak" figures in docs/.
 *
 *   gcc -O3 -march=native -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 *
 * 12 independent accumulator chains per thread (enough to cover FMA latency x 2 ports on
 * current x86 cores), zmm where the compiler targets AVX-512 and ymm otherwise, run on 1
 * and then on every OpenMP thread; median of 7 passes.  Prints G multiply-adds/s (one FMA
 * on a VL-double vector = VL multiply-adds). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#if defined(__AVX512F__)
typedef __m512d vec;
#define VL 8
#define SET1 _mm512_set1_pd
#define FMA _mm512_fmadd_pd
#define ADD _mm512_add_pd
#define SUM(v) _mm512_reduce_add_pd(v)
#define NAME "zmm (AVX-512)"
#else
typedef __m256d vec;
#define VL 4
#define SET1 _mm256_set1_pd
#define FMA _mm256_fmadd_pd
#define ADD _mm256_add_pd
static double SUM(vec v) { double t[4]; _mm256_storeu_pd(t, v); return t[0] + t[1] + t[2] + t[3]; }
#define NAME "ymm (AVX2)"
#endif

#define CHAINS 12
#define ITERS 50000000L

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* One thread's loop; the result is returned so the chains are not dead code. */
static double chains(double seed) {
    vec a[CHAINS], m = SET1(1.0 - 1e-12), c = SET1(1e-12);
    for (int k = 0; k < CHAINS; k++) a[k] = SET1(seed + k);
    for (long i = 0; i < ITERS; i++)
#pragma GCC unroll 12
        for (int k = 0; k < CHAINS; k++) a[k] = FMA(a[k], m, c);
    vec s = a[0];
    for (int k = 1; k < CHAINS; k++) s = ADD(s, a[k]);
    return SUM(s);
}

static int cmp(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

int main(void) {
    int nmax = omp_get_max_threads();
    for (int nt = 1; nt <= nmax; nt = nt < nmax && 2 * nt > nmax ? nmax : 2 * nt) {
        double rates[7], sink = 0;
        for (int rep = 0; rep < 7; rep++) {
            double t0 = now();
#pragma omp parallel num_threads(nt) reduction(+ : sink)
            sink += chains(omp_get_thread_num());
            double dt = now() - t0;
            rates[rep] = (double)nt * ITERS * CHAINS * VL / dt / 1e9;
        }
        qsort(rates, 7, sizeof(double), cmp);
        printf("%s, %d thread(s): %.1f G multiply-adds/s (median of 7; per core %.1f; "
               "checksum %.3g)\n", NAME, nt, rates[3], rates[3] / nt, sink);
        if (nt == nmax) break;
    }
    return 0;
}
