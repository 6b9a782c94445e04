/* k3io.h: a pool of native reader threads (issue 13 item 3).
 *
 * Why native: a Python I/O thread releases the GIL inside os.preadv but must take it back
 * to return, hand over its future and pick the next read, so every completion waits for
 * whatever Python the forward pass is running.  Here the readers never touch the GIL:
 * the forward pass submits (fd, destination, length, offset) jobs and waits on them with
 * the GIL released; the pthreads loop pread() straight into the destination.
 *
 * Jobs run in submission order (FIFO), so reads issued in disk-offset order reach the
 * device in that order.  A job is a handle into a fixed table; the submitter must collect
 * every job it submitted (k3io_wait then k3io_collect), which frees the handle.
 * Worker threads block every signal: signals go to the Python main thread, and pread()
 * restarts on EINTR anyway.
 */
#ifndef K3IO_H
#define K3IO_H

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define K3IO_FREE 0
#define K3IO_QUEUED 1
#define K3IO_RUNNING 2
#define K3IO_DONE 3
#define K3IO_PREAD_MAX ((size_t)1 << 30)  /* Linux returns at most 0x7ffff000 per call */

typedef struct {
    int fd;
    unsigned char *dst;
    size_t len;
    long long off;
    long long got;        /* bytes read contiguously from the start */
    int err;              /* errno of the failing pread, 0 if none (EOF is not an error) */
    int state;
    double started, done; /* CLOCK_MONOTONIC seconds (= Python's time.monotonic on Linux) */
} k3io_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, finished;
    k3io_job *jobs;
    int *queue, *free_ids;        /* FIFO ring of queued ids; stack of free ids */
    int cap, qhead, qlen, nfree;
    int nthreads, stop;
    pthread_t *threads;
} k3io_pool;

static double k3io_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Fill j->dst[:len] from j->off: pread may return fewer bytes than asked (signal, EOF),
 * so loop; 0 is EOF.  An error after some bytes stops the job with what it has (an
 * O_DIRECT window's unaligned remainder past EOF fails that way); the caller decides. */
static void k3io_run(k3io_job *j) {
    size_t got = 0;
    j->err = 0;
    j->started = k3io_now();
    while (got < j->len) {
        size_t want = j->len - got;
        if (want > K3IO_PREAD_MAX) want = K3IO_PREAD_MAX;
        ssize_t r = pread(j->fd, j->dst + got, want, (off_t)(j->off + (long long)got));
        if (r < 0) {
            if (errno == EINTR) continue;
            j->err = errno;
            break;
        }
        if (r == 0) break;
        got += (size_t)r;
    }
    j->got = (long long)got;
    j->done = k3io_now();
}

static void *k3io_worker(void *arg) {
    k3io_pool *p = (k3io_pool *)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->qlen == 0 && !p->stop) pthread_cond_wait(&p->work, &p->mu);
        if (p->qlen == 0) break;              /* stop, and nothing left to read */
        int id = p->queue[p->qhead];
        p->qhead = (p->qhead + 1) % p->cap;
        p->qlen--;
        k3io_job *j = &p->jobs[id];
        j->state = K3IO_RUNNING;
        pthread_mutex_unlock(&p->mu);
        k3io_run(j);
        pthread_mutex_lock(&p->mu);
        j->state = K3IO_DONE;
        pthread_cond_broadcast(&p->finished);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void k3io_free(k3io_pool *p) {
    free(p->jobs);
    free(p->queue);
    free(p->free_ids);
    free(p->threads);
    free(p);
}

/* NULL when memory or threads cannot be had (the caller raises). */
static k3io_pool *k3io_create(int nthreads, int cap) {
    k3io_pool *p = (k3io_pool *)calloc(1, sizeof *p);
    if (!p) return NULL;
    p->cap = cap;
    p->jobs = (k3io_job *)calloc((size_t)cap, sizeof *p->jobs);
    p->queue = (int *)calloc((size_t)cap, sizeof(int));
    p->free_ids = (int *)calloc((size_t)cap, sizeof(int));
    p->threads = (pthread_t *)calloc((size_t)nthreads, sizeof(pthread_t));
    if (!p->jobs || !p->queue || !p->free_ids || !p->threads) {
        k3io_free(p);
        return NULL;
    }
    for (int i = 0; i < cap; i++) p->free_ids[i] = cap - 1 - i;
    p->nfree = cap;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->finished, NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);   /* a pread loop needs next to nothing */
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&p->threads[i], &attr, k3io_worker, p) != 0) break;
        p->nthreads++;
    }
    pthread_attr_destroy(&attr);
    if (p->nthreads == 0) {
        k3io_free(p);
        return NULL;
    }
    return p;
}

/* A job handle >= 0, or -1 when all `cap` handles are taken (never collected). */
static int k3io_submit(k3io_pool *p, int fd, unsigned char *dst, size_t len, long long off) {
    pthread_mutex_lock(&p->mu);
    if (p->nfree == 0 || p->stop) {
        pthread_mutex_unlock(&p->mu);
        return -1;
    }
    int id = p->free_ids[--p->nfree];
    k3io_job *j = &p->jobs[id];
    j->fd = fd; j->dst = dst; j->len = len; j->off = off;
    j->got = 0; j->err = 0; j->started = j->done = 0.0;
    j->state = K3IO_QUEUED;
    p->queue[(p->qhead + p->qlen) % p->cap] = id;
    p->qlen++;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
    return id;
}

static int k3io_is_done(k3io_pool *p, int id) {
    pthread_mutex_lock(&p->mu);
    int d = p->jobs[id].state == K3IO_DONE;
    pthread_mutex_unlock(&p->mu);
    return d;
}

static void k3io_wait(k3io_pool *p, int id) {
    pthread_mutex_lock(&p->mu);
    while (p->jobs[id].state != K3IO_DONE) pthread_cond_wait(&p->finished, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* The finished job's figures; frees the handle.  Call only after k3io_wait. */
static k3io_job k3io_collect(k3io_pool *p, int id) {
    pthread_mutex_lock(&p->mu);
    k3io_job j = p->jobs[id];
    p->jobs[id].state = K3IO_FREE;
    p->free_ids[p->nfree++] = id;
    pthread_mutex_unlock(&p->mu);
    return j;
}

/* Finish every queued read, then join the threads. */
static void k3io_destroy(k3io_pool *p) {
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->finished);
    k3io_free(p);
}

#endif
