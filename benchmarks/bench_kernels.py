#!/usr/bin/env python
"""Kernel throughput against the machine's own memory bandwidth (a script, not a test).

    python benchmarks/bench_kernels.py [--repeat N] [--threads 1,2] [--isa scalar,avx2,avx512]
                                       [--tokens 1,4] [--shapes KIND:OUTxIN,...] [--callgrind]
                                       [--json PATH]

For each weight-streaming kernel (BF16, MXFP4, float32 and I8R matvec at real Kimi K3
shapes) it reports, per instruction-set path (scalar / AVX2 / AVX-512, forced through
K.set_isa), per thread count and per batch size T (T = 1 is decode; T = 4 is one full
token tile, the prefill case, reported per token), the median time per call, the GB/s of
weight bytes streamed, the bandwidth-floor time (weight bytes / the read bandwidth measured
at the same thread count) and the percentage of that floor achieved.  --callgrind adds instructions per weight
element for every kernel and path from `valgrind --tool=callgrind` (one call of a
256-row slice, 1 thread): a figure other processes on a shared machine cannot disturb.  The memory bandwidth is measured in the same
run: a pure read (sum of a 1 GiB uint64 array) and a copy (np.copyto of 1 GiB: read +
write bytes), at 1 and 2 threads (NumPy releases the GIL inside both loops, so two Python
threads on two halves measure two-core bandwidth).

"cold" timings rotate over enough copies of the weights to exceed the last-level cache
several times, so every call streams its weights from DRAM, as the real model does
(experts are touched once per token).  "hot" timings call the same weights repeatedly
(shown for the small MXFP4 matrices, which fit in L3 and are what a tight C benchmark
loop usually measures).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from k3engine import kernels as K

GIB = 1 << 30


# ---- machine -------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def l3_bytes() -> int:
    p = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    try:
        t = p.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1], 1)
        return int(t.rstrip("KMG")) * mult
    except (OSError, ValueError):
        return 32 << 20


def machine_info() -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "usable_cpus": affinity,
            "l3_bytes": l3_bytes(), "numpy": np.__version__, "python": platform.python_version(),
            "isas": ",".join(K.isas_available()), "default_isa": K.isa()}


def loadavg() -> str:
    """`uptime`'s three load averages (1, 5, 15 min), as text."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


class ForeignLoad:
    """CPU time used by OTHER processes while a block runs, as a fraction of all CPUs
    (from /proc/stat minus this process's own CPU time, and its waited-for children's
    with children=True: a benchmark that runs `k3` in a subprocess).  Timings taken while
    other work shares the cores are unreliable, mainly at 2 threads on a 2-core machine.
    `load` is the load averages at the end of the block."""

    def __init__(self, children: bool = False):
        self.fraction = None
        self.children = children
        self.load = None

    @staticmethod
    def _busy_and_total():
        try:
            f = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        return sum(f[:8]) - idle, sum(f[:8])

    def __enter__(self):
        self._s, self._t = self._busy_and_total(), os.times()
        return self

    def __exit__(self, *exc):
        e, t = self._busy_and_total(), os.times()
        if self._s is None or e is None:
            return
        hz = os.sysconf("SC_CLK_TCK")
        busy = (e[0] - self._s[0]) / hz
        total = (e[1] - self._s[1]) / hz
        own = (t.user - self._t.user) + (t.system - self._t.system)
        if self.children:
            own += (t.children_user - self._t.children_user) + (
                t.children_system - self._t.children_system)
        self.load = loadavg()
        self.fraction = max(0.0, busy - own) / total if total > 0 else None


# ---- bandwidth -----------------------------------------------------------------------------

def _timed_parallel(fn, parts) -> float:
    """Run fn(part) for each part in its own thread (one part: the calling thread)."""
    if len(parts) == 1:
        t0 = time.perf_counter()
        fn(parts[0])
        return time.perf_counter() - t0
    threads = [threading.Thread(target=fn, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0


# A STREAM-like pure read in C (XOR of every 64-bit word: associative, so the compiler
# vectorises it with no reordering concern, and it does one instruction per 64 bytes per
# vector -- far below the memory's rate).  Compiled here at run time with the machine's own
# vector width; it is the benchmark's ruler, not an engine kernel.
STREAM_READ_C = r"""
#include <stddef.h>
#include <stdint.h>
uint64_t k3bench_read(const uint64_t *a, size_t n, int threads) {
    uint64_t x = 0;
    #pragma omp parallel for num_threads(threads) reduction(^:x) schedule(static)
    for (size_t i = 0; i < n; i++) x ^= a[i];
    return x;
}
"""


def stream_read_lib():
    """ctypes handle of STREAM_READ_C compiled with `cc -O3 -march=native -fopenmp`, or None
    when there is no compiler (the NumPy read below is then the only figure)."""
    import ctypes
    import shutil
    import subprocess
    import tempfile
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    d = tempfile.mkdtemp(prefix="k3-stream-")
    src, lib = os.path.join(d, "r.c"), os.path.join(d, "r.so")
    Path(src).write_text(STREAM_READ_C)
    done = subprocess.run([cc, "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp",
                           "-shared", "-fPIC", src, "-o", lib], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"  (no C read test: {done.stderr.strip()[:200]})")
        return None
    f = ctypes.CDLL(lib).k3bench_read
    f.restype = ctypes.c_uint64
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return f


def measure_bandwidth(size: int, repeat: int, thread_counts) -> dict:
    n = size // 8
    src = np.arange(n, dtype=np.uint64)          # touched: pages are really allocated
    dst = np.empty_like(src)
    dst[:] = 0
    out = {"bytes": size}
    for nt in thread_counts:
        cuts = np.linspace(0, n, nt + 1).astype(int)
        srcs = [src[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        pairs = [(dst[a:b], src[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        _timed_parallel(lambda a: a.sum(), srcs)                      # warm-up
        reads = [_timed_parallel(lambda a: a.sum(), srcs) for _ in range(repeat)]
        _timed_parallel(lambda p: np.copyto(p[0], p[1]), pairs)
        copies = [_timed_parallel(lambda p: np.copyto(p[0], p[1]), pairs) for _ in range(repeat)]
        out[f"read_gbs_{nt}t"] = size / statistics.median(reads) / 1e9
        out[f"copy_gbs_{nt}t"] = 2 * size / statistics.median(copies) / 1e9
    c_read = stream_read_lib()
    for nt in thread_counts if c_read is not None else ():
        c_read(src.ctypes.data, n, nt)                                  # warm-up
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            c_read(src.ctypes.data, n, nt)
            times.append(time.perf_counter() - t0)
        out[f"c_read_gbs_{nt}t"] = size / statistics.median(times) / 1e9
        out[f"c_read_gbs_{nt}t_best"] = size / min(times) / 1e9      # the least disturbed pass
    out["read_gbs_best"] = max(v for k, v in out.items() if "read_gbs_" in k and k[-1] == "t")
    del src, dst
    return out


# ---- weights -------------------------------------------------------------------------------

def make_bf16(r, rows, cols) -> np.ndarray:
    """Finite, normal BF16 patterns (|w| in 2^-10 .. 2): no subnormal slow paths."""
    sign = r.integers(0, 2, (rows, cols), dtype=np.uint16) << 15
    expo = r.integers(117, 128, (rows, cols), dtype=np.uint16) << 7
    mant = r.integers(0, 128, (rows, cols), dtype=np.uint16)
    return sign | expo | mant


def make_f32(r, rows, cols) -> np.ndarray:
    return r.standard_normal((rows, cols), dtype=np.float32)


def make_mxfp4(r, rows, cols):
    P = r.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    S = r.integers(118, 125, (rows, cols // 32), dtype=np.uint8)
    return P, S


KERNELS = [
    # name, kind, out, in
    ("BF16 matvec", "bf16", 12288, 7168),
    ("BF16 matvec", "bf16", 7168, 7168),
    ("MXFP4 matvec", "mxfp4", 3072, 3584),
    ("MXFP4 matvec", "mxfp4", 3584, 3072),
    ("F32 matvec", "f32", 7168, 7168),
    ("I8R matvec", "i8r", 7168, 7168),
]


def weight_bytes(kind, rows, cols) -> int:
    return {"bf16": rows * cols * 2, "f32": rows * cols * 4, "i8r": rows * cols + rows * 4,
            "mxfp4": rows * cols // 2 + rows * cols // 32}[kind]


def make_weights(r, kind, rows, cols):
    if kind == "bf16":
        return make_bf16(r, rows, cols)
    if kind == "f32":
        return make_f32(r, rows, cols)
    if kind == "i8r":
        return (r.integers(-127, 128, (rows, cols), dtype=np.int8),
                (r.random(rows, dtype=np.float32) + 0.01).astype(np.float32))
    return make_mxfp4(r, rows, cols)


def call_for(kind, W):
    """One matvec call Y = W X for the weight format."""
    if kind == "mxfp4":
        return lambda X, Y: K.mxfp4_matvec(W[0], W[1], X, Y)
    if kind == "i8r":
        return lambda X, Y: K.i8r_matvec(W[0], W[1], X, Y)
    return lambda X, Y: K.matvec(W, X, Y)


def build(kind, rows, cols, copies, seed):
    r = np.random.default_rng(seed)
    calls = [call_for(kind, make_weights(r, kind, rows, cols)) for _ in range(copies)]
    return calls, r, weight_bytes(kind, rows, cols)


def io_for(r, rows, cols, T):
    return r.standard_normal((T, cols), dtype=np.float32), np.empty((T, rows), np.float32)


def time_calls(calls, X, Y, repeat, warmup=2, cpu=None) -> list[float]:
    """Wall seconds per call; if `cpu` is a list, the process CPU seconds per call (all
    threads) are appended to it: on a time-shared machine wall time includes the slices
    other processes took, CPU time does not (it still includes their cache damage)."""
    for i in range(warmup):
        calls[i % len(calls)](X, Y)
    times = []
    for i in range(warmup, warmup + repeat):    # the rotation goes on: no copy reused early
        f = calls[i % len(calls)]
        c0, t0 = time.process_time(), time.perf_counter()
        f(X, Y)
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
    return times


# ---- instruction counts (load-independent) ----------------------------------------------

CALLGRIND_ROWS = 256


def one_call(kind, rows, cols, isa, T) -> None:
    """The body of a --callgrind child: build a slice and make one call (the kernels' OpenMP
    bodies are the only collected functions, so set-up costs nothing).  Exit status 3: the
    path is not available here (valgrind 3.19 emulates a CPU without AVX-512, so that path
    cannot be counted; the run-time check keeps it off, which is itself worth seeing)."""
    if isa not in K.isas_available():
        sys.exit(3)
    K.set_isa(isa)
    K.set_num_threads(1)
    r = np.random.default_rng(7)
    f = call_for(kind, make_weights(r, kind, rows, cols))
    X, Y = io_for(r, rows, cols, T)
    f(X, Y)


def callgrind_counts(kinds, isas, T) -> dict:
    """{(kind, cols, isa, T): instructions per weight element per token}, one call each."""
    import shutil
    import subprocess
    import tempfile
    if shutil.which("valgrind") is None:
        print("  valgrind not found: no instruction counts")
        return {}
    out = {}
    for kind, cols in kinds:
        for isa in isas:
            with tempfile.TemporaryDirectory() as td:
                cgf = os.path.join(td, "cg.out")
                # collect only inside the OpenMP-outlined kernel bodies
                cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no",
                       "--toggle-collect=*_omp_fn*", f"--callgrind-out-file={cgf}",
                       sys.executable, __file__, "--one-call",
                       f"{kind},{CALLGRIND_ROWS},{cols},{isa},{T}"]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode == 3:
                    print(f"  callgrind {kind} x{cols} T={T} {isa}: not available under "
                          f"valgrind (its emulated CPU lacks it)")
                    continue
                if done.returncode != 0:
                    raise RuntimeError(f"callgrind child failed: {done.stderr[-2000:]}")
                ir = None
                for line in Path(cgf).read_text().splitlines():
                    if line.startswith(("summary:", "totals:")):
                        ir = int(line.split()[1])
                out[(kind, cols, isa, T)] = ir / (CALLGRIND_ROWS * cols * T) if ir else None
            print(f"  callgrind {kind} {CALLGRIND_ROWS}x{cols} T={T} {isa}: "
                  f"{out[(kind, cols, isa, T)]:.3f} instructions per weight element per token",
                  flush=True)
    return out


# ---- main ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=9, help="timed runs per measurement (>= 7)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--isa", default=",".join(K.isas_available()),
                    help="comma-separated kernel paths (default: every one this CPU runs)")
    ap.add_argument("--tokens", default="1,4",
                    help="comma-separated batch sizes T (T > 1 uses the token tiles)")
    ap.add_argument("--kernels", default="", help="only kernels whose kind is listed "
                    "(bf16,mxfp4,f32,i8r); default all")
    ap.add_argument("--shapes", default="", metavar="KIND:OUTxIN,...",
                    help="these matrices instead of K3's (e.g. bf16:2048x2048,bf16:8192x2048: "
                         "mid's trunk, whose 4 KB rows stream differently)")
    ap.add_argument("--bw-gib", type=float, default=1.0, help="size of the bandwidth arrays")
    ap.add_argument("--floor-gbs", type=float, metavar="GB/S",
                    help="read bandwidth for the floor instead of this run's measurement "
                         "(a quiet-machine figure, when other processes share the memory)")
    ap.add_argument("--callgrind", action="store_true",
                    help="also count instructions per weight element with valgrind")
    ap.add_argument("--callgrind-only", action="store_true",
                    help="only the instruction counts (no timings, no bandwidth)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--max-other-load", type=float, default=10.0, metavar="PCT",
                    help="re-measure a cell when other processes used more than PCT%% of the "
                         "CPUs during it (shared machines); default 10")
    ap.add_argument("--retries", type=int, default=3,
                    help="attempts per cell at most; the least disturbed one is kept")
    ap.add_argument("--bandwidth-only", action="store_true",
                    help="only the memory read bandwidth (take it when the machine is quietest)")
    ap.add_argument("--one-call", help=argparse.SUPPRESS)   # a --callgrind child
    a = ap.parse_args(argv)
    if a.one_call:
        kind, rows, cols, isa, T = a.one_call.split(",")
        one_call(kind, int(rows), int(cols), isa, int(T))
        return 0
    if a.repeat < 7:
        ap.error("--repeat must be >= 7 (the median of at least seven runs is reported)")
    thread_counts = [int(t) for t in a.threads.split(",")]
    token_counts = [int(t) for t in a.tokens.split(",")]
    isas = a.isa.split(",")
    for name in isas:
        if name not in K.isas_available():
            ap.error(f"--isa {name}: not available on this CPU ({', '.join(K.isas_available())})")
    table = KERNELS if not a.shapes else [
        (f"{kind.upper()} matvec", kind, *map(int, shape.split("x")))
        for kind, shape in (item.split(":") for item in a.shapes.split(","))]
    kernels = [k for k in table if not a.kernels or k[1] in a.kernels.split(",")]

    info = machine_info()
    print(f"machine: {info['cpu']}, {info['logical_cpus']} logical CPUs "
          f"({info['usable_cpus']} usable), L3 {info['l3_bytes'] >> 20} MiB, "
          f"numpy {info['numpy']}, python {info['python']}, kernel paths {info['isas']}")
    shapes = sorted({(k, c) for _, k, _, c in kernels})
    if a.callgrind_only:
        for T in token_counts:
            callgrind_counts(shapes, isas, T)
        return 0

    print(f"measuring memory bandwidth ({a.bw_gib:g} GiB arrays, median of {a.repeat}) ...",
          flush=True)
    with ForeignLoad() as fl_bw:
        bw = measure_bandwidth(int(a.bw_gib * GIB), a.repeat, thread_counts)
    for nt in thread_counts:
        c = bw.get(f"c_read_gbs_{nt}t")
        print(f"  {nt} thread(s): read (uint64 sum) {bw[f'read_gbs_{nt}t']:6.2f} GB/s, "
              f"copy (np.copyto, read+write) {bw[f'copy_gbs_{nt}t']:6.2f} GB/s"
              + ("" if c is None else f", STREAM-like C read (XOR, -march=native) {c:6.2f} GB/s "
                 f"(best pass {bw[f'c_read_gbs_{nt}t_best']:.2f})"))
    if a.bandwidth_only:
        print(f"  load average {loadavg()}")
        if a.json:
            bw["foreign_cpu"] = fl_bw.fraction
            Path(a.json).write_text(json.dumps({"machine": info, "bandwidth": bw}, indent=2))
        return 0
    def floor_gbs(nt: int) -> float:
        """The read floor for a cell at nt threads: the given figure, else the best read
        measured at nt threads (a 1-thread kernel cannot use the 2-thread bandwidth)."""
        if a.floor_gbs:
            return a.floor_gbs
        return max(bw[f"read_gbs_{nt}t"], bw.get(f"c_read_gbs_{nt}t_best", 0.0))

    print("  floor uses " + ("the given read bandwidth" if a.floor_gbs else
                             "the best read measured at each thread count") + ": "
          + ", ".join(f"{nt}t {floor_gbs(nt):.2f} GB/s" for nt in thread_counts))
    if fl_bw.fraction is not None:
        print(f"  other processes used {100 * fl_bw.fraction:.0f}% of the CPUs meanwhile")

    target = max(4 * info["l3_bytes"], 256 << 20)
    prev_threads, prev_isa = K.get_num_threads(), K.isa()
    results = []
    for name, kind, rows, cols in kernels:
        # enough copies that no call of a cell meets weights a recent call left in L3
        copies = max(a.repeat + 2, -(-target // weight_bytes(kind, rows, cols)))
        calls, r, nbytes = build(kind, rows, cols, copies, seed=rows * 31 + cols)
        for isa in isas:
            K.set_isa(isa)
            for nt in thread_counts:
                K.set_num_threads(nt)
                floor_ms = nbytes / (floor_gbs(nt) * 1e9) * 1e3
                for T in token_counts:
                    X, Y = io_for(r, rows, cols, T)
                    res = measure_cell(a, calls, X, Y, copies)
                    res.update({"kernel": name, "kind": kind, "rows": rows, "cols": cols,
                                "isa": isa, "threads": nt, "tokens": T, "weight_bytes": nbytes,
                                "copies": copies, "floor_ms": floor_ms})
                    res["ms_per_token"] = res["ms_cold"] / T
                    res["gbs_cold"] = nbytes / res["ms_cold"] / 1e6
                    res["pct_of_floor"] = 100.0 * floor_ms / res["ms_cold"]
                    results.append(res)
                    load = ("" if res["foreign_cpu"] is None
                            else f" (other processes: {100 * res['foreign_cpu']:.0f}% CPU)")
                    print(f"  {name} {rows}x{cols} {isa} @{nt}t T={T}: {res['ms_cold']:.2f} ms "
                          f"cold ({res['ms_per_token']:.2f} ms/token), {res['ms_hot']:.2f} ms "
                          f"hot{load}", flush=True)
        del calls
    K.set_num_threads(prev_threads)
    K.set_isa(prev_isa)

    counts = {}
    if a.callgrind:
        print("counting instructions (valgrind --tool=callgrind, 1 thread) ...", flush=True)
        for T in token_counts:
            counts.update(callgrind_counts(shapes, isas, T))

    print_table(results, counts)
    print()
    print(f"machine: {info['cpu']} | cores {info['usable_cpus']} | numpy {info['numpy']} | "
          f"paths {info['isas']} | read floor "
          + ", ".join(f"{nt}t {floor_gbs(nt):.2f}" for nt in thread_counts)
          + f" GB/s | repeat {a.repeat}")
    if a.json:
        bw["foreign_cpu"] = fl_bw.fraction
        Path(a.json).write_text(json.dumps({
            "machine": info, "bandwidth": bw, "repeat": a.repeat, "results": results,
            "callgrind_ir_per_element": {",".join(map(str, k)): v for k, v in counts.items()},
            "argv": sys.argv}, indent=2))
        print(f"wrote {a.json}")
    return 0


def measure_cell(a, calls, X, Y, copies) -> dict:
    """Median cold/hot times of one cell, re-measured while other processes load the CPUs."""
    best = None
    for attempt in range(1, max(1, a.retries) + 1):
        cpu = []
        with ForeignLoad() as fl:
            cold_runs = time_calls(calls, X, Y, a.repeat, cpu=cpu)
            hot_runs = time_calls(calls[:1], X, Y, a.repeat)
        other = fl.fraction if fl.fraction is not None else 0.0
        if best is None or other < best[0]:
            best = (other, cold_runs, hot_runs, fl.fraction, attempt, cpu)
        if other * 100 <= a.max_other_load:
            break
    _, cold_runs, hot_runs, other_frac, attempt, cpu = best
    return {"ms_cold": statistics.median(cold_runs) * 1e3,
            "cpu_ms_cold": statistics.median(cpu) * 1e3, "ms_cold_min": min(cold_runs) * 1e3,
            "ms_hot": statistics.median(hot_runs) * 1e3, "foreign_cpu": other_frac,
            "attempts": attempt}


def print_table(results, counts) -> None:
    print()
    print("| kernel | shape (out x in) | path | threads | T | ms/call (cold) | ms/token | min ms | "
          "CPU ms/call | GB/s | ms/call (hot) | floor ms | % of floor | instr/elem/token | "
          "other load |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r_ in results:
        ir = counts.get((r_["kind"], r_["cols"], r_["isa"], r_["tokens"]))
        print(f"| {r_['kernel']} | {r_['rows']}x{r_['cols']} | {r_['isa']} | {r_['threads']} | "
              f"{r_['tokens']} | {r_['ms_cold']:.2f} | {r_['ms_per_token']:.2f} | "
              f"{r_['ms_cold_min']:.2f} | {r_['cpu_ms_cold']:.2f} | {r_['gbs_cold']:.2f} | "
              f"{r_['ms_hot']:.2f} | "
              f"{r_['floor_ms']:.2f} | {r_['pct_of_floor']:.0f}% | "
              f"{'-' if ir is None else format(ir, '.2f')} | "
              f"{'-' if r_['foreign_cpu'] is None else format(100 * r_['foreign_cpu'], '.0f') + '%'} |")


if __name__ == "__main__":
    sys.exit(main())
