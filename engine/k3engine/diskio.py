"""Positioned, aligned and parallel reads: the I/O primitives the checkpoint reader, the
streamed trunk and the expert cache share (SYSTEM §1.7, §2.5, §3.3-§3.4).

Reads run as `os.preadv` straight into the destination buffer; parallel reads go to the
native reader threads of `kernels._k3io`, which never take the GIL.
"""
from __future__ import annotations

import math
import mmap
import os

import numpy as np

ALIGN = 4096                 # O_DIRECT offset/length/address granularity
ARENA_ALIGN = 2 << 20        # arenas are 2 MiB aligned (any O_DIRECT alignment; see AlignedBuffer)
CHUNK = 64 << 20             # one parallel read request (SYSTEM §2.5)
PREAD_MAX = 1 << 30          # Linux returns at most 0x7ffff000 bytes per call anyway


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill buf from offset; return the byte count actually read (< len(buf) at EOF).
    os.pread may return fewer bytes than asked (signal, EOF): loop, 0 means EOF.  The
    caller must refuse a short count: never a partially filled buffer as if complete."""
    got, want = 0, len(buf)
    while got < want:
        req = min(want - got, PREAD_MAX)
        if hasattr(os, "preadv"):       # straight into the destination, no bytes copy
            r = os.preadv(fd, [buf[got:got + req]], offset + got)
        else:
            chunk = os.pread(fd, req, offset + got)
            r = len(chunk)
            buf[got:got + r] = chunk
        if r <= 0:
            break
        got += r
    return got


class AlignedBuffer:
    """An anonymous mapping whose usable part starts on a 2 MiB boundary (O_DIRECT needs
    page alignment).  `view` is the writable memoryview of exactly `nbytes`.

    Private and advised for huge pages (where the kernel has them): an O_DIRECT read pins
    its destination pages, faulting in every page it has not touched yet, so a cache
    filling 4 KiB shmem pages (mmap's default, shared mapping, ignores MADV_HUGEPAGE) paid
    ~0.9 s of kernel time per GB on its reader threads, CPU a 2-core prefill's kernels then
    lacked (benchmarks/bench_fill.py, 1.5 GB: 1.35 s sys shared 4 KiB, 0.12 s private huge
    pages; docs/benchmarks-engine.md, 2026-12-02).  An earlier measurement of the opposite
    (huge pages slower) was on the same kind of VM, where memory handed back to the host
    costs ~2.5 s/GB on its next first touch and huge pages are the ones that get it."""

    def __init__(self, nbytes: int, align: int = ARENA_ALIGN, huge: bool = True):
        self.nbytes = nbytes
        size = align_up(max(nbytes, 1), ALIGN)
        private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        self._map = mmap.mmap(-1, size + align, flags=private) if private else \
            mmap.mmap(-1, size + align)
        advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
        if private and advice is not None:
            try:
                self._map.madvise(advice)
            except OSError:                       # THP compiled out: 4 KiB pages
                pass
        addr = _address(self._map)
        self.pad = (-addr) % align
        self.view = memoryview(self._map)[self.pad:self.pad + nbytes]

    def close(self) -> None:
        self.view.release()
        self._map.close()


def zeroed_f32(shape: tuple[int, ...], huge: bool = True) -> np.ndarray:
    """A zero-filled float32 array on its own anonymous mapping, its pages touched only
    when written (huge: advised for 2 MiB pages, else 4 KiB ones).  The array keeps the
    mapping alive."""
    n = math.prod(shape)
    return np.frombuffer(AlignedBuffer(4 * n, ALIGN, huge).view, np.float32,
                         count=n).reshape(shape)


def _address(m: mmap.mmap) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def open_for_streaming(path: str) -> tuple[int, bool]:
    """A read descriptor with O_DIRECT when the filesystem accepts it (page cache
    bypassed: streamed bytes are used once), else buffered.  Returns (fd, direct)."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError:
            pass                        # tmpfs and some filesystems refuse O_DIRECT
    return os.open(path, os.O_RDONLY), False


def parallel_read(reads, fd: int, dest: memoryview, offset: int, chunk: int = CHUNK) -> int:
    """Read len(dest) bytes at offset as parallel chunk requests (aligned when offset and
    chunk are) on `reads` (a `kernels._k3io.ReadPool`; one chunk is read right here);
    returns the byte count read contiguously from the start."""
    if len(dest) <= chunk:
        return pread_into(fd, dest, offset)
    return reads.read_all(fd, dest, offset, chunk)


def read_window(fd: int, direct: bool, buf: AlignedBuffer, offset: int, nbytes: int,
                elem: int = 1) -> memoryview:
    """Read [offset, offset + nbytes) into `buf` and return the payload (SYSTEM §1.7).
    O_DIRECT needs offset, length and address on 4096 boundaries, so the read is widened
    to the enclosing aligned window and the payload starts `pad` bytes in; a payload not
    aligned to its element size is moved to the buffer start.  Raises OSError on a short
    read (never a partially filled payload)."""
    lo = offset - offset % ALIGN if direct else offset
    hi = align_up(offset + nbytes) if direct else offset + nbytes
    if hi - lo > buf.nbytes:
        raise ValueError(f"read of {hi - lo} bytes does not fit a {buf.nbytes}-byte buffer")
    got = pread_into(fd, buf.view[:hi - lo], lo)
    pad = offset - lo
    if got < pad + nbytes:
        raise OSError(f"short read: got {max(0, got - pad)} of {nbytes} bytes at {offset}")
    if pad % elem:
        buf.view[:nbytes] = bytes(buf.view[pad:pad + nbytes])
        pad = 0
    return buf.view[pad:pad + nbytes]
