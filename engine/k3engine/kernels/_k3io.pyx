# cython: language_level=3
"""Native reader threads (k3io.h): positioned reads that never take the GIL.

`ReadPool(n)` starts n pthreads once.  `submit(fd, dest, offset)` queues a read of
len(dest) bytes into the writable buffer `dest` and returns a handle; `done(h)` asks
without blocking; `wait(h)` blocks with the GIL released and returns (got, errno,
started, finished) -- got is the byte count read contiguously from the start, errno 0
unless a pread failed, the times in time.monotonic() seconds.  Every submitted handle
must be waited for exactly once.  The pool keeps a reference to each destination until
its read is waited for, so the memory cannot be unmapped under a reader.
"""
import os

cdef extern from "k3io.h" nogil:
    ctypedef struct k3io_job:
        long long got
        int err
        double started
        double done
    ctypedef struct k3io_pool:
        int nthreads
    k3io_pool *k3io_create(int nthreads, int cap)
    int k3io_submit(k3io_pool *p, int fd, unsigned char *dst, size_t len, long long off)
    int k3io_is_done(k3io_pool *p, int id)
    void k3io_wait(k3io_pool *p, int id)
    k3io_job k3io_collect(k3io_pool *p, int id)
    void k3io_destroy(k3io_pool *p)
    double k3io_now()


def monotonic() -> float:
    """The clock of the job times (CLOCK_MONOTONIC, as time.monotonic on Linux)."""
    return k3io_now()


def joined(lengths, results) -> tuple:
    """Reads into consecutive destinations of `lengths` bytes judged as one: (bytes read
    contiguously in order, counting the stopping read's own bytes; the errno of the read
    that stopped the run or 0; first start; last finish).  A read stops the run when it
    failed or read less than its destination."""
    total, err = 0, 0
    for n, (got, e, _, _) in zip(lengths, results):
        total += got
        if e or got < n:
            err = e
            break
    return (total, err, min([r[2] for r in results], default=0.0),
            max([r[3] for r in results], default=0.0))


cdef class ReadPool:
    cdef k3io_pool *p
    cdef dict held
    cdef readonly int threads
    cdef readonly int capacity

    def __cinit__(self, int threads, int capacity=1 << 16):
        self.p = k3io_create(max(1, threads), capacity)
        if self.p == NULL:
            raise OSError(f"cannot start {threads} reader threads")
        self.threads = self.p.nthreads
        self.capacity = capacity
        self.held = {}

    def submit(self, int fd, dest, long long offset) -> int:
        cdef unsigned char[::1] v = dest
        cdef unsigned char *dst = &v[0] if v.shape[0] else NULL
        if self.p == NULL:
            raise ValueError("the read pool is closed")
        cdef int h = k3io_submit(self.p, fd, dst, <size_t>v.shape[0], offset)
        if h < 0:
            raise RuntimeError(f"all {self.capacity} read handles are in use")
        self.held[h] = dest
        return h

    def done(self, int h) -> bool:
        if h not in self.held:
            raise ValueError(f"read handle {h} is not outstanding")
        return bool(k3io_is_done(self.p, h))

    def wait(self, int h) -> tuple:
        cdef k3io_job j
        if h not in self.held:
            raise ValueError(f"read handle {h} is not outstanding")
        with nogil:
            k3io_wait(self.p, h)
        j = k3io_collect(self.p, h)
        del self.held[h]
        return j.got, j.err, j.started, j.done

    def submit_spans(self, int fd, dest, long long offset, Py_ssize_t chunk) -> list:
        """Handles of len(dest) bytes at offset as parallel requests of `chunk` bytes."""
        mv = memoryview(dest)
        return [self.submit(fd, mv[o:o + chunk], offset + o) for o in range(0, len(mv), chunk)]

    def wait_all(self, handles) -> tuple:
        """Wait for every handle; `joined` of their destinations' lengths and results."""
        lengths = [len(self.held[h]) if h in self.held else 0 for h in handles]
        return joined(lengths, [self.wait(h) for h in handles])

    def read_all(self, int fd, dest, long long offset, Py_ssize_t chunk) -> int:
        """Read len(dest) bytes at offset as parallel requests of `chunk` bytes; the byte
        count read contiguously from the start (short at EOF).  Raises OSError if the
        request that stopped it failed (after every request has returned)."""
        got, err, _, _ = self.wait_all(self.submit_spans(fd, dest, offset, chunk))
        if err:
            raise OSError(err, os.strerror(err))
        return got

    def close(self) -> None:
        """Finish the queued reads and join the threads (idempotent)."""
        if self.p != NULL:
            with nogil:
                k3io_destroy(self.p)
            self.p = NULL
            self.held.clear()

    def __dealloc__(self):
        if self.p != NULL:
            k3io_destroy(self.p)
            self.p = NULL
