/* Compares k3math.h's expf and tanhf replicas (AVX2 and, where the CPU has it, AVX-512)
 * with the linked libm over every float bit pattern (or every STRIDE-th with an
 * argument), and times SiTU on both.  A check, not a test: it prints the mismatches it
 * finds (the tests run k3math's own sample at load).
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

typedef long (*k3_tanh_exp_fn)(const float *, long, float *, float *);
typedef long (*k3_situ_fn)(const float *, const float *, long, float, float, float *, double *);

static void sweep(const char *isa, k3_tanh_exp_fn tanh_exp, uint64_t stride) {
    uint64_t bad[2] = {0, 0}, seen = 0, shown = 0;
    double t0 = now();
#pragma omp parallel for reduction(+ : seen) schedule(dynamic, 64)
    for (uint64_t blk = 0; blk < (1ull << 32) / (16 * stride); blk++) {
        float xs[16], t[16], e[16];
        for (int j = 0; j < 16; j++) {
            uint32_t b = (uint32_t)((blk * 16 + j) * stride);
            memcpy(&xs[j], &b, 4);
        }
        tanh_exp(xs, 16, t, e);
        for (int j = 0; j < 16; j++) {
            float l[2] = {expf(xs[j]), tanhf(xs[j])}, v[2] = {e[j], t[j]};
            seen++;
            for (int w = 0; w < 2; w++)
                if (memcmp(&l[w], &v[w], 4) && !(l[w] != l[w] && v[w] != v[w])) { /* NaN == NaN */
#pragma omp critical
                    {
                        bad[w]++;
                        if (shown++ < 10)
                            printf("  %s %s(%a) libm %a replica %a\n", isa, w ? "tanhf" : "expf",
                                   xs[j], l[w], v[w]);
                    }
                }
        }
    }
    printf("%s: %llu inputs, expf differs in %llu, tanhf in %llu (%.1f s)\n", isa,
           (unsigned long long)seen, (unsigned long long)bad[0], (unsigned long long)bad[1],
           now() - t0);
}

static void timing(const char *isa, k3_situ_fn situ) {
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
        situ(x, u, N, 4.0f, 25.0f, y, NULL);
        double t2 = now();
        printf("%s SiTU per element, 1 thread: libm %.2f ns, replica %.2f ns\n", isa,
               (t1 - t0) / N * 1e9, (t2 - t1) / N * 1e9);
    }
    free(x), free(y), free(u);
}

int main(int argc, char **argv) {
    uint64_t stride = argc > 1 ? strtoull(argv[1], 0, 0) : 1;
    struct { const char *name; int isa; k3_tanh_exp_fn tanh_exp; k3_situ_fn situ; } paths[] = {
        {"avx2", K3_ISA_AVX2, k3_tanh_exp_avx2, k3_situ_avx2},
        {"avx512", K3_ISA_AVX512, k3_tanh_exp_avx512, k3_situ_avx512}};
    for (int p = 0; p < 2; p++) {
        if (k3_isa_best() < paths[p].isa) {
            printf("%s: NOT RUN: this CPU lacks it\n", paths[p].name);
            continue;
        }
        printf("%s load-time check (k3_math_check): %s\n", paths[p].name,
               k3_math_check(paths[p].tanh_exp) ? "equal" : "DIFFERS");
        sweep(paths[p].name, paths[p].tanh_exp, stride);
        timing(paths[p].name, paths[p].situ);
    }
    return 0;
}
