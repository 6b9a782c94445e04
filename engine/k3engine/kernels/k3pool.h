/* k3pool.h: the compute threads' pool, for the kernels' parallel loops over independent
 * work items (rows, experts' row chunks): k3_pool_run(fn, ctx, n, threads) calls fn(ctx, i)
 * once for each i in [0, n), the caller taking items too, and returns when all are done.
 *
 * Why not OpenMP's regions: a decode step runs hundreds of them with Python in between, and
 * libgomp gives two bad choices.  Passive waits (what the engine set) put the worker to
 * sleep after every region, and waking it costs this VM ~0.1 ms, so each T = 1 matvec ran
 * as if on one thread (BF16 2048 x 2048: 9.6 G multiply-adds/s at 1 thread, 9.9 at 2).
 * Spinning waits keep it awake but take the core from anything else that wants it: with
 * another process busy, a step took 3.2-3.5 s instead of 0.3-0.5 (docs/benchmarks-engine.md,
 * "Threads").  Here an idle worker spins for K3_POOL_SPIN_US calling sched_yield, so it is
 * awake when the next item comes yet gives its CPU to any runnable thread, then sleeps.
 *
 * The caller never waits for a worker to wake: items are claimed through one 64-bit
 * ticket (task sequence << 32 | next item) by compare-and-swap, so a late worker finds the
 * task gone or its items taken and claims nothing; the caller returns once every CLAIMED
 * item is done.  A claim succeeds only while the ticket still names the task, and a task
 * ends only after its claimed items are done, so a claimer always reads its own task's
 * slot (two slots: the next task is written into the other one).  Which thread runs an
 * item never changes a bit: items write disjoint outputs. */
#ifndef K3POOL_H
#define K3POOL_H

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* Warm resident mid step at 2 threads, spinning 50 / 300 / 2000 us: 129-144 / 121-135 /
 * 119-123 ms quiet, 196-215 ms either way with another process busy on one CPU (the gaps
 * between a step's kernels are mostly short, but the few long ones cost a wake-up each) */
#ifndef K3_POOL_SPIN_US
#define K3_POOL_SPIN_US 2000
#endif
#define K3_POOL_MAX 256

typedef void (*k3_task_fn)(void *ctx, long item);

typedef struct {
    k3_task_fn fn;
    void *ctx;
    long n;
    int nworkers;            /* workers 0 .. nworkers-1 take part */
} k3_task;

static struct {
    _Atomic uint64_t ticket;         /* seq << 32 | next item of task seq */
    _Atomic long done;               /* items of the current task finished */
    _Atomic int nsleeping;
    _Atomic int started;             /* workers created */
    k3_task slot[2];                 /* task seq lives in slot[seq & 1] */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_mutex_t caller;          /* held by the one thread running a task */
    int atfork;
} k3_pool = {0, 0, 0, 0, {{0}}, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
             PTHREAD_MUTEX_INITIALIZER, 0};
static long k3_pool_spin_us = K3_POOL_SPIN_US;
static _Atomic long k3_pool_worker_items;   /* items the workers ran: tests see them work */

static inline double k3_pool_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

/* Claim and run items of task seq until none is left; returns how many ran. */
static long k3_pool_work(uint32_t seq) {
    const k3_task *t = &k3_pool.slot[seq & 1];
    long ran = 0;
    uint64_t tk = atomic_load(&k3_pool.ticket);
    for (;;) {
        if ((uint32_t)(tk >> 32) != seq || (long)(tk & 0xffffffffu) >= t->n) break;
        if (!atomic_compare_exchange_weak(&k3_pool.ticket, &tk, tk + 1)) continue;
        t->fn(t->ctx, (long)(tk & 0xffffffffu));
        ran++;
        tk = atomic_load(&k3_pool.ticket);
    }
    if (ran) atomic_fetch_add(&k3_pool.done, ran);
    return ran;
}

static void *k3_pool_worker(void *arg) {
    const int me = (int)(intptr_t)arg;
    sigset_t all;                        /* signals (Ctrl-C, alarms) go to Python's threads */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    uint32_t seen = (uint32_t)(atomic_load(&k3_pool.ticket) >> 32);
    for (;;) {
        uint32_t seq;
        double t0 = k3_pool_now_us();
        for (unsigned k = 1;; k++) {    /* spin, yielding, then sleep */
            seq = (uint32_t)(atomic_load(&k3_pool.ticket) >> 32);
            if (seq != seen) break;
            sched_yield();
            if ((k & 15) == 0 && k3_pool_now_us() - t0 > k3_pool_spin_us) {
                pthread_mutex_lock(&k3_pool.mu);
                atomic_fetch_add(&k3_pool.nsleeping, 1);
                while ((seq = (uint32_t)(atomic_load(&k3_pool.ticket) >> 32)) == seen)
                    pthread_cond_wait(&k3_pool.cv, &k3_pool.mu);
                atomic_fetch_sub(&k3_pool.nsleeping, 1);
                pthread_mutex_unlock(&k3_pool.mu);
                break;
            }
        }
        seen = seq;
        /* a task published while this worker was not looking is skipped whole: its items
         * are claimed by the ticket, so reading an old slot can only fail to claim */
        if (me < k3_pool.slot[seq & 1].nworkers) {
            long ran = k3_pool_work(seq);
            if (ran) atomic_fetch_add(&k3_pool_worker_items, ran);
        }
    }
    return NULL;
}

static void k3_pool_after_fork(void) {   /* the child has no workers */
    atomic_store(&k3_pool.started, 0);
    atomic_store(&k3_pool.nsleeping, 0);
    atomic_store(&k3_pool_worker_items, 0);
    pthread_mutex_init(&k3_pool.mu, NULL);
    pthread_cond_init(&k3_pool.cv, NULL);
    pthread_mutex_init(&k3_pool.caller, NULL);
}

static int k3_pool_started(void) { return atomic_load(&k3_pool.started); }
static long k3_pool_items_by_workers(void) { return atomic_load(&k3_pool_worker_items); }

/* Workers 0 .. want-1 exist (the caller is the extra thread); returns how many do. */
static int k3_pool_grow(int want) {
    if (want > K3_POOL_MAX) want = K3_POOL_MAX;
    int have = atomic_load(&k3_pool.started);
    if (have >= want) return want;
    pthread_mutex_lock(&k3_pool.mu);
    if (!k3_pool.atfork) k3_pool.atfork = !pthread_atfork(NULL, NULL, k3_pool_after_fork);
    for (have = atomic_load(&k3_pool.started); have < want; have++) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &at, k3_pool_worker, (void *)(intptr_t)have);
        pthread_attr_destroy(&at);
        if (rc) break;
        atomic_store(&k3_pool.started, have + 1);
    }
    pthread_mutex_unlock(&k3_pool.mu);
    return have;
}

/* fn(ctx, i) for i in [0, n) on `threads` threads (the caller one of them).  A second
 * thread calling while a task runs (two Python threads in kernels at once: the kernels
 * release the GIL) runs its items alone, with the same bits. */
static void k3_pool_run(k3_task_fn fn, void *ctx, long n, int threads) {
    int nw = threads - 1;
    if (nw > 0 && n > 1) nw = k3_pool_grow(nw < n - 1 ? nw : (int)(n - 1));
    if (nw <= 0 || n <= 1 || n > 0xffffffffL || pthread_mutex_trylock(&k3_pool.caller)) {
        for (long i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    uint32_t seq = (uint32_t)(atomic_load(&k3_pool.ticket) >> 32) + 1;
    k3_task *t = &k3_pool.slot[seq & 1];
    t->fn = fn, t->ctx = ctx, t->n = n, t->nworkers = nw;
    atomic_store(&k3_pool.done, 0);
    atomic_store(&k3_pool.ticket, (uint64_t)seq << 32);        /* publish */
    if (atomic_load(&k3_pool.nsleeping) > 0) {
        pthread_mutex_lock(&k3_pool.mu);
        pthread_cond_broadcast(&k3_pool.cv);
        pthread_mutex_unlock(&k3_pool.mu);
    }
    k3_pool_work(seq);
    while (atomic_load(&k3_pool.done) < n) sched_yield();   /* items others still run */
    pthread_mutex_unlock(&k3_pool.caller);
}

/* Scratch space of the calling thread's own (pool workers and callers alike), grown as
 * needed and kept: for items that need a buffer (MLA's scores, KDA's row sums).  NULL
 * when it cannot grow; its contents do not carry from one use to the next.  Freed when
 * its thread ends (a key's destructor: a Python thread per request or per chat would
 * otherwise leave its buffer behind, MBs at long contexts). */
static __thread void *k3_tls_scratch;
static __thread size_t k3_tls_cap;
static pthread_key_t k3_scratch_key;
static pthread_once_t k3_scratch_once = PTHREAD_ONCE_INIT;
static void k3_scratch_key_make(void) { pthread_key_create(&k3_scratch_key, free); }
static void *k3_scratch(size_t bytes) {
    if (bytes > k3_tls_cap) {
        void *p = realloc(k3_tls_scratch, bytes);
        if (p == NULL) return NULL;
        pthread_once(&k3_scratch_once, k3_scratch_key_make);
        pthread_setspecific(k3_scratch_key, p);
        k3_tls_scratch = p, k3_tls_cap = bytes;
    }
    return k3_tls_scratch;
}

#endif
