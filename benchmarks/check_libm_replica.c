/* Compares k3math.h's AVX-512 expf and tanhf with the linked libm over every float bit
 * pattern (or every STRIDE-th with an argument), and times both.  A check, not a test:
 * it prints the mismatches it finds (the tests run k3math's own sample at load).
 *
 *   gcc -O2 -fopenmp -ffp-contract=off -fno-math-errno -I engine/k3engine/kernels \
 *       benchmarks/check_libm_replica.c -o /tmp/check_libm -lm && /tmp/check_libm [STRIDE]
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "k3math.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

K3_AVX512_ATTR static void sweep(const char *name, int which, uint64_t stride) {
    uint64_t bad = 0, seen = 0, shown = 0;
    double t0 = now();
#pragma omp parallel for reduction(+ : bad, seen) schedule(dynamic, 64)
    for (uint64_t blk = 0; blk < (1ull << 32) / (16 * stride); blk++) {
        float xs[16], v[16];
        for (int j = 0; j < 16; j++) {
            uint32_t b = (uint32_t)((blk * 16 + j) * stride);
            memcpy(&xs[j], &b, 4);
        }
        __m512 x = _mm512_loadu_ps(xs);
        _mm512_storeu_ps(v, which ? k3_tanhf16(x) : k3_expf16(x));
        for (int j = 0; j < 16; j++) {
            float l = which ? tanhf(xs[j]) : expf(xs[j]);
            seen++;
            if (memcmp(&l, &v[j], 4) && !(l != l && v[j] != v[j])) {   /* NaN == NaN */
                bad++;
#pragma omp critical
                if (shown++ < 10)
                    printf("  %s(%a) libm %a replica %a\n", name, xs[j], l, v[j]);
            }
        }
    }
    printf("%s: %llu inputs, %llu differ (%.1f s)\n", name, (unsigned long long)seen,
           (unsigned long long)bad, now() - t0);
}

K3_AVX512_ATTR static void timing(void) {
    enum { N = 1 << 22 };
    float *x = malloc(N * 4), *y = malloc(N * 4), *u = malloc(N * 4);
    uint32_t s = 7;
    for (int i = 0; i < N; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 16.0f;
        u[i] = ((float)(s & 0xffff) / 65536.0f - 0.5f) * 60.0f;
    }
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        for (long i = 0; i < N; i++) y[i] = k3_situ1(x[i], u[i], 4.0f, 25.0f);
        double t1 = now();
        k3_situ_avx512(x, u, N, 4.0f, 25.0f, y, NULL);
        double t2 = now();
        printf("SiTU per element, 1 thread: libm %.2f ns, replica %.2f ns\n",
               (t1 - t0) / N * 1e9, (t2 - t1) / N * 1e9);
    }
}

int main(int argc, char **argv) {
    uint64_t stride = argc > 1 ? strtoull(argv[1], 0, 0) : 1;
    if (k3_isa_best() < K3_ISA_AVX512) { printf("NOT RUN: no AVX-512 on this CPU\n"); return 0; }
    printf("load-time check (k3_math_check): %s\n", k3_math_check() ? "equal" : "DIFFERS");
    sweep("expf", 0, stride);
    sweep("tanhf", 1, stride);
    timing();
    return 0;
}
