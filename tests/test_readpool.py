"""The native reader threads (kernels/_k3io.pyx, k3io.h) the expert cache and the streamed
trunk read through: the bytes land exactly, short counts and errors come back as figures,
handles are freed, and a read finishes while the Python main thread never lets go of the
GIL (the property they exist for)."""
from __future__ import annotations

import errno
import os
import random
import sys
import time

import numpy as np
import pytest

from k3engine.diskio import AlignedBuffer, parallel_read
from k3engine.kernels._k3io import ReadPool, joined, monotonic


@pytest.fixture()
def data_file(tmp_path):
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 3 * 1024 * 1024 + 123, dtype=np.uint8).tobytes()
    p = tmp_path / "data.bin"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def test_many_concurrent_reads_land_exactly(data_file):
    fd, data = data_file
    pool = ReadPool(4)
    buf = AlignedBuffer(8 * 40000)
    rng = random.Random(3)
    jobs = []
    for _ in range(200):                          # overlapping offsets, some past EOF
        off = rng.randrange(0, len(data) + 100)
        n = rng.randrange(0, 40000)
        dst = len(jobs) * 40000 + rng.randrange(0, 40000 - n + 1)   # the batch's own region
        jobs.append((pool.submit(fd, buf.view[dst:dst + n], off), off, n, dst))
        if len(jobs) % 8 == 0:                    # collect in batches: each lands alone
            for h, off, n, dst in jobs:
                got, err, t0, t1 = pool.wait(h)
                want = data[off:off + n]
                assert err == 0 and got == len(want) and t0 <= t1
                assert bytes(buf.view[dst:dst + got]) == want
            jobs.clear()
    print("[gate] 200 native reads at random offsets (some past EOF): every byte equal")
    pool.close()
    buf.close()


def test_errors_and_handles(data_file, tmp_path):
    fd, data = data_file
    pool = ReadPool(2, capacity=4)
    buf = bytearray(64)
    h = pool.submit(10_000, memoryview(buf), 0)   # not a descriptor
    got, err, _, _ = pool.wait(h)
    assert (got, err) == (0, errno.EBADF)
    with pytest.raises(ValueError, match="not outstanding"):
        pool.wait(h)                              # a handle is waited for once
    hs = [pool.submit(fd, memoryview(buf)[i:i + 1], i) for i in range(4)]
    with pytest.raises(RuntimeError, match="all 4 read handles"):
        pool.submit(fd, memoryview(buf), 0)
    for h in hs:
        assert pool.wait(h)[:2] == (1, 0)
    for _ in range(20):                           # collected handles are reused
        assert pool.wait(pool.submit(fd, memoryview(buf), 5))[:2] == (64, 0)
    assert bytes(buf) == data[5:69]
    with pytest.raises(BufferError):
        pool.submit(fd, b"read-only", 0)          # a destination must be writable
    pool.close()
    pool.close()                                  # idempotent
    with pytest.raises(ValueError, match="closed"):
        pool.submit(fd, memoryview(buf), 0)


def test_parallel_read_splits_and_stops_at_eof(data_file):
    fd, data = data_file
    pool = ReadPool(3)
    for off, n, chunk in ((0, len(data), 1 << 20), (4096, 2_000_000, 300_000),
                          (len(data) - 1000, 50_000, 4096), (17, 0, 4096)):
        buf = bytearray(n)
        got = parallel_read(pool, fd, memoryview(buf), off, chunk)
        want = data[off:off + n]
        assert got == len(want) and bytes(buf[:got]) == want, (off, n, chunk)
    with pytest.raises(OSError):
        parallel_read(pool, 10_000, memoryview(bytearray(10000)), 0, 4096)
    pool.close()


def test_a_read_lands_while_python_holds_the_gil(data_file):
    """The main thread keeps the GIL (switch interval 30 s, a pure-Python spin) and the
    read still finishes: the reader thread never needs the GIL.  A Python I/O thread
    could not return from os.preadv until the spin let go."""
    fd, data = data_file
    pool = ReadPool(1)
    buf = bytearray(len(data))
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        h = pool.submit(fd, memoryview(buf), 0)
        t0, spins, landed = time.monotonic(), 0, False
        while time.monotonic() - t0 < 10.0:
            spins += 1
            if pool.done(h):
                landed = True
                break
    finally:
        sys.setswitchinterval(old)
    got, err, t_start, t_done = pool.wait(h)
    print(f"[gate] read of {got} bytes landed during a {spins}-iteration GIL-holding spin: "
          f"{landed} ({(t_done - t_start) * 1e3:.1f} ms)")
    assert landed and got == len(data) and bytes(buf) == data
    assert abs(monotonic() - time.monotonic()) < 0.05     # the same clock as the engine's
    pool.close()


def test_joined_stops_at_the_first_short_or_failed_read():
    """How the expert cache and the trunk judge several reads as one."""
    r = lambda got, err=0: (got, err, 1.0 + got, 2.0 + got)     # noqa: E731
    assert joined([4, 4, 4], [r(4), r(4), r(4)]) == (12, 0, 1.0 + 4, 2.0 + 4)
    assert joined([4, 4, 4], [r(4), r(2), r(4)])[:2] == (6, 0)       # EOF: a short count
    assert joined([4, 4], [r(3, errno.EINVAL), r(4)])[:2] == (3, errno.EINVAL)
    assert joined([4, 4], [r(4), r(0, errno.EIO)])[:2] == (4, errno.EIO)
    assert joined([], []) == (0, 0, 0.0, 0.0)
