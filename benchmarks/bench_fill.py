"""What filling a fresh buffer with O_DIRECT reads costs, per kind of mapping (a script, not
a test; figures are reported, never asserted).

    python benchmarks/bench_fill.py FILE [--mb 1536] [--piece-kb 2560] [--reps 3]

An expert cache or a trunk ring fills memory it has never touched: each O_DIRECT read pins
its destination pages, faulting in every page not there yet, on the reader thread.  This
alternates, in one process, the engine's buffer (`diskio.AlignedBuffer`: a private mapping
advised for huge pages) with mmap's default shared 4 KiB mapping, reading --mb of FILE in
--piece-kb pieces (an expert's size) into a fresh buffer of each, and reports wall, kernel
CPU and page faults.  Before each fill it touches and frees 2x the buffer, so both kinds
get memory the machine has backed: on a VM with free page reporting (the kernel command
line says page_reporting) freed blocks go back to the host and the next first touch of
them costs ~2.5 s/GB there, whichever kind takes them.
"""
from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import sys
import time

import numpy as np

from k3engine.diskio import AlignedBuffer


class _Shared:
    def __init__(self, n: int):
        self._map = mmap.mmap(-1, n)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.view.release()
        self._map.close()


KINDS = {"engine (private, huge pages)": AlignedBuffer, "shared 4 KiB (mmap default)": _Shared}


def fill(fd: int, buf, nbytes: int, piece: int) -> tuple[float, float, int]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for off in range(0, nbytes - piece + 1, piece):
        os.preadv(fd, [buf.view[off:off + piece]], off)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return wall, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--mb", type=int, default=1536)
    ap.add_argument("--piece-kb", type=int, default=2560)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    nbytes, piece = a.mb << 20, a.piece_kb << 10
    if os.path.getsize(a.file) < nbytes:
        sys.exit(f"{a.file}: smaller than --mb {a.mb}")
    fd = os.open(a.file, os.O_RDONLY | os.O_DIRECT)
    res: dict[str, list] = {k: [] for k in KINDS}
    for rep in range(a.reps):
        for kind, make in KINDS.items():
            warm = np.ones(2 * nbytes, np.uint8)   # backed now, free again below
            del warm
            buf = make(nbytes)
            r = fill(fd, buf, nbytes, piece)
            buf.close()
            res[kind].append(r)
            print(f"  rep {rep} {kind:30s} {r[0]:.2f} s wall, {r[1]:.2f} s sys, "
                  f"{r[2]} faults")
    for kind, rs in res.items():
        w, s, f = (statistics.median(x[i] for x in rs) for i in range(3))
        print(f"{kind:30s} median {w:.2f} s wall ({a.mb / 1024 / w:.2f} GB/s), "
              f"{s:.2f} s sys, {f:.0f} faults for {a.mb} MB")
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
