"""`k3 devbw PATH_OR_DIR... [--size-mb N] [--block-kb K] [--seconds S]`: storage bandwidth
measured the way the engine reads experts (SYSTEM §10.2).

Each measurement issues random 4096-aligned reads of one routed expert (17,547,264 B) with
O_DIRECT into aligned buffers, at queue depth 1, 4 and 16 (QD reads kept in flight on the
engine's native reader threads).  The gap between QD1 and QD16 is the headroom the batch
prefetch can use; equal figures mean the device does not reward depth.  `dd` is one
sequential stream at QD1 and can mislead by a large factor on network storage.

A FILE is only ever read.  A DIRECTORY gets a scratch file (written, measured, removed),
which the device or host may still hold in a cache: point devbw at a large existing file,
such as a checkpoint shard, for cold figures.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..diskio import ALIGN, AlignedBuffer, align_up, open_for_streaming

EXPERT_BYTES = 17_547_264          # one routed expert of the released checkpoint (§1.6)
READS = 40                         # reads per measurement (§10.2)
QUEUE_DEPTHS = (1, 4, 16)
DEFAULT_SCRATCH_MB = 1024
DEFAULT_SECONDS = 10.0
WRITE_CHUNK = 4 << 20
SCRATCH_PREFIX = ".k3-devbw-"


class DevbwError(Exception):
    pass


@dataclass(frozen=True)
class QdResult:
    qd: int
    reads: int
    nbytes: int
    seconds: float

    @property
    def mbs(self) -> float:
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def read_block(size: int, block: int) -> int:
    """The read length: `block` rounded up to ALIGN (O_DIRECT length granularity), shrunk
    to the largest aligned length the file holds."""
    b = min(align_up(max(block, 1)), size // ALIGN * ALIGN)
    if b <= 0:
        raise DevbwError(f"file of {size} bytes is smaller than one {ALIGN}-byte block")
    return b


def random_offsets(size: int, block: int, n: int, rng: random.Random) -> list[int]:
    """n random ALIGN-aligned offsets whose reads of `block` bytes stay inside the file
    (so no read is short at EOF)."""
    top = (size - block) // ALIGN
    return [rng.randint(0, top) * ALIGN for _ in range(n)]


def measure(fd: int, offsets: list[int], block: int, qd: int, seconds: float) -> QdResult:
    """Read `offsets` in order keeping `qd` reads in flight, one buffer per slot, on the
    engine's own native readers (kernels/_k3io: threads that never take the GIL, as the
    expert cache and the trunk read); no read is issued once `seconds` have passed, so a
    slow device bounds the time, not the count."""
    try:    # here, not at the top: doctor imports this module and must run without the build
        from ..kernels._k3io import ReadPool
    except ImportError as e:
        raise DevbwError(f"the engine's native readers (k3engine.kernels._k3io) do not load: "
                         f"{e}; reinstall the engine (pip install -e .)") from e
    pool, bufs = ReadPool(qd), []
    try:
        bufs = [AlignedBuffer(block) for _ in range(qd)]
        for b in bufs:
            # Touch every page before the clock starts: first-touch faults (and the pins
            # O_DIRECT takes on fresh pages) would otherwise be timed as device time.  The
            # engine's arenas are allocated once and reused, so they do not pay this per read.
            np.frombuffer(b.view, np.uint8)[::ALIGN] = 0
        todo = iter(offsets)
        inflight: deque[tuple[int, int, int]] = deque()     # (handle, slot, offset), oldest first
        reads = 0
        t0 = time.monotonic()
        for slot, off in zip(range(qd), todo):
            inflight.append((pool.submit(fd, bufs[slot].view, off), slot, off))
        while inflight:
            h, slot, off = inflight.popleft()
            got, err, _, _ = pool.wait(h)
            if err:
                raise DevbwError(f"read failed: {os.strerror(err)}")
            if got != block:
                raise DevbwError(f"short read: {got} of {block} bytes at offset {off}")
            reads += 1
            nxt = next(todo, None) if time.monotonic() < t0 + seconds else None
            if nxt is not None:
                inflight.append((pool.submit(fd, bufs[slot].view, nxt), slot, nxt))
        elapsed = time.monotonic() - t0
    finally:
        pool.close()        # the reads in flight finish before their buffers are unmapped
        for b in bufs:
            b.close()
    return QdResult(qd, reads, reads * block, elapsed)


def write_scratch(directory: str, size: int) -> str:
    """A scratch file of `size` bytes of incompressible data, synced to the device and
    dropped from the page cache.  Real data, not a sparse file: holes read as zeros
    without touching the device.  The caller removes it."""
    fd, path = tempfile.mkstemp(prefix=SCRATCH_PREFIX, dir=directory)
    try:
        chunk = os.urandom(WRITE_CHUNK)
        done = 0
        while done < size:
            n = min(WRITE_CHUNK, size - done)
            done += os.write(fd, memoryview(chunk)[:n])
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            # Buffered fallback reads would otherwise come straight from the pages just
            # written; O_DIRECT ignores the page cache anyway.
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class FileResult:
    path: str
    size: int
    block: int
    direct: bool
    scratch: bool
    results: tuple[QdResult, ...]


def measure_file(path: str, block: int = EXPERT_BYTES, depths=QUEUE_DEPTHS,
                 reads: int = READS, seconds: float = DEFAULT_SECONDS, seed: int | None = None,
                 scratch: bool = False) -> FileResult:
    """Measure one existing file at each queue depth (fresh random offsets per depth, so
    one depth's reads do not warm a device cache for the next)."""
    fd, direct = open_for_streaming(path)
    try:
        size = os.fstat(fd).st_size
        b = read_block(size, block)
        rng = random.Random(seed)
        out = tuple(measure(fd, random_offsets(size, b, reads, rng), b, qd, seconds)
                    for qd in depths)
    finally:
        os.close(fd)
    return FileResult(path, size, b, direct, scratch, out)


def measure_dir(directory: str, size: int, **kw) -> FileResult:
    """Write a scratch file in `directory`, measure it, remove it (also on error or
    Ctrl-C)."""
    free = free_bytes(directory)
    if free is not None and free < 2 * size:
        raise DevbwError(f"{directory}: only {free / 1e6:.0f} MB free, the {size / 1e6:.0f} MB "
                         f"scratch file needs twice that (use --size-mb)")
    try:
        path = write_scratch(directory, size)
    except OSError as e:
        raise DevbwError(f"{directory}: cannot write a scratch file ({e.strerror or e})") from e
    try:
        return measure_file(path, scratch=True, **kw)
    finally:
        os.unlink(path)


def report_lines(r: FileResult) -> list[str]:
    what = "scratch file" if r.scratch else "file"
    mode = "O_DIRECT" if r.direct else \
        "BUFFERED: the filesystem refused O_DIRECT, so the page cache may serve these reads"
    expert = " (one routed expert)" if r.block == EXPERT_BYTES else ""
    lines = [f"{r.path}: {what} of {r.size / 1e6:.0f} MB, {mode}",
             f"  block {r.block:,} B{expert} at random {ALIGN}-aligned offsets"]
    for q in r.results:
        lines.append(f"  QD {q.qd:>2}: {q.mbs:9.1f} MB/s  ({q.reads} reads, "
                     f"{q.nbytes / 1e6:.1f} MB in {q.seconds:.2f} s)")
    first, last = r.results[0], r.results[-1]
    if first.mbs > 0 and len(r.results) > 1:
        ratio = last.mbs / first.mbs
        lines.append(f"  QD{last.qd}/QD{first.qd} = {ratio:.2f}x: "
                     + ("headroom the batch prefetch can use" if ratio >= 1.2 else
                        "the device does not reward depth"))
    if r.scratch:
        lines.append("  (a scratch file just written may sit in a device or host cache; "
                     "for cold figures measure a large existing file, e.g. a shard)")
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="k3 devbw", description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog="Exit codes: 0 every path measured, 1 a path could not be measured, "
               "130 interrupted.")
    ap.add_argument("paths", nargs="+", metavar="PATH_OR_DIR",
                    help="a file to read (never written) or a directory for a scratch file")
    ap.add_argument("--size-mb", type=int, default=DEFAULT_SCRATCH_MB,
                    help="scratch file size for a directory (default %(default)s)")
    ap.add_argument("--block-kb", type=int, default=EXPERT_BYTES // 1024,
                    help="bytes per read in KiB (default %(default)s = one routed expert)")
    ap.add_argument("--reads", type=int, default=READS,
                    help="reads per queue depth (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                    help="time cap per queue depth (default %(default)s)")
    a = ap.parse_intermixed_args(argv)
    if a.size_mb < 1 or a.block_kb < 1 or a.reads < 1 or not a.seconds > 0:
        ap.error("--size-mb, --block-kb, --reads and --seconds must be positive")
    kw = dict(block=a.block_kb * 1024, reads=a.reads, seconds=a.seconds)
    status = 0
    for p in a.paths:
        try:
            if os.path.isdir(p):
                r = measure_dir(p, a.size_mb * 1_000_000, **kw)
            elif os.path.isfile(p):
                r = measure_file(p, **kw)
            else:
                raise DevbwError(f"{p}: not a file or directory")
        except (DevbwError, OSError) as e:
            msg = str(e) if isinstance(e, DevbwError) else f"{p}: {e.strerror or e}"
            print(f"k3 devbw: {msg}", file=sys.stderr)
            status = 1
            continue
        except KeyboardInterrupt:       # the scratch file is already removed
            print("k3 devbw: interrupted", file=sys.stderr)
            return 130
        print("\n".join(report_lines(r)), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
