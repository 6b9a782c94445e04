"""Measuring this machine for the forecast: the device's read rates (as `k3 devbw` does),
the engine's own kernels cold from DRAM (BF16 and MXFP4 matvecs, a prefill's rates, the
small per-layer kernels) and the Python around them (glue_probe, on the demo model in a
child), the process baseline.  The figures are cached by the machine's identity
(machine.py); `machine_figures` reads the cache and measures only what is missing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from .machine import (EXPERT_PROBE_TOKENS, READ_DEPTHS, MachineFigures, _read_cache,
                      cache_file, cached_machine_figures, identity_key, machine_identity)
from .state import MLAState
from .threads import default_threads
from .trunk import IO_THREADS as TRUNK_IO_THREADS   # a layer's reads run on this many threads

__all__ = ["measure_machine", "machine_figures", "calibrate_kernels", "calibrate_small",
           "glue_probe", "measure_glue", "measure_read", "measure_baseline"]

READ_BLOCK = 4 << 20             # device test block: between an expert and a trunk chunk
READ_SCRATCH_BYTES = 256 * 10**6
READ_SECONDS = 1.5               # per queue depth
SMALL_BLOCK = 256 << 10          # the latency probe's read size
TRUNK_BLOCK = 32 << 20           # the large-read probe's size (a trunk layer's chunks)
KERNEL_SECONDS = 0.6             # per kernel
BF16_WIDTHS = (1024, 2048, 4096)  # BF16 matrix widths measured besides K3's 7168
COLD_ROTATION = 4                # copies x L3: every timed call streams its weights from DRAM
PREFILL_PROBE_TOKENS = 64        # tokens of the prefill BF16 probe
# The engine's Python-side cost per streamed layer bind (the binder's views of a freshly read
# run) when the calibration could not measure it (glue_probe's bind_s), in units of one tiny
# kernel call: benchmarks/bench_bind.py measured 0.33-0.41 ms per mid layer (0.80-0.96
# before the bind bookkeeping was cached), ~60 calls of ~6 us.
BIND_CALLS = 60


def _clock():
    """The calibration's clock: with one compute thread the kernels run in the calling
    thread, and its CPU time is what they cost whatever else shares the cores (wall time
    on a loaded machine measures the other load); with more threads, wall time (a parallel
    region waits for its slowest thread, which is part of the cost)."""
    from . import kernels as K
    return time.thread_time if K.get_num_threads() == 1 else time.perf_counter


def _cold_seconds(fn, copies: list, seconds: float) -> float:
    """Median seconds of one call, rotating over `copies` so none is in cache."""
    clock = _clock()
    fn(copies[0])
    times = []
    t_end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < t_end or len(times) < 5:
        c = copies[i % len(copies)]
        t0 = clock()
        fn(c)
        times.append(clock() - t0)
        i += 1
    return float(np.median(times))


def _l3_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            t = f.read().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1], 1)
        return int(t.rstrip("KMG")) * mult
    except (OSError, ValueError, IndexError):
        return 32 << 20


def _fit(small: tuple[int, float], large: tuple[int, float]) -> tuple[float, float]:
    """(bytes/s, fixed seconds per call) of t = fixed + bytes / rate through two sizes."""
    (b1, t1), (b2, t2) = small, large
    rate = (b2 - b1) / (t2 - t1) if t2 > t1 else b2 / t2
    return rate, max(t1 - b1 / rate, 0.0)


def calibrate_kernels(seconds: float = KERNEL_SECONDS) -> dict:
    """The engine's own matvecs at the threads currently set, one token (T = 1), weights
    streamed from DRAM (rotated copies totalling COLD_ROTATION x L3), each at two sizes so
    a kernel's cost splits into bytes/s and a fixed cost per call (the parallel region's
    start and join, which dominates small matrices and grows when other work shares the
    cores).  Also the cost of a tiny single-threaded call (the layer's small kernels)."""
    from . import kernels as K
    rng = np.random.default_rng(0)
    l3 = _l3_bytes()

    def copies(nbytes: int, hot: bool) -> int:
        return 1 if hot else max(2, -(-COLD_ROTATION * l3 // nbytes))

    def bf16(rows: int, cols: int, hot: bool = False, T: int = 1) -> tuple[int, float]:
        """(weight bytes x T, seconds) of one T-token matvec."""
        nbytes = rows * cols * 2
        base = rng.integers(0x3c00, 0x4000, (rows, cols), dtype=np.uint16)
        ws = [base.copy() for _ in range(copies(nbytes, hot))]
        x = rng.standard_normal((T, cols)).astype(np.float32)
        y = np.empty((T, rows), np.float32)
        return nbytes * T, _cold_seconds(lambda w: K.matvec(w, x, y), ws, seconds)

    def experts(n: int, inter: int, cols: int, hot: bool = False,
                T: int = 1) -> tuple[int, float]:
        """One moe_experts batch of n experts (w1, w3 [inter, cols], w2 [cols, inter]),
        T tokens each (1: what a decode step runs per MoE layer); bytes counted T times."""
        from .weights import MXFP4, ExpertWeights

        def mat(rows, n_in):
            return MXFP4(rng.integers(0, 256, (rows, n_in // 2), dtype=np.uint8),
                         rng.integers(120, 130, (rows, n_in // 32), dtype=np.uint8))
        nbytes = n * 3 * (inter * cols // 2 + inter * cols // 32)
        groups = [[(e, ExpertWeights(mat(inter, cols), mat(inter, cols), mat(cols, inter)))
                   for e in range(n)] for _ in range(copies(nbytes, hot))]
        z = rng.standard_normal((T, cols)).astype(np.float32)
        token = np.tile(np.arange(T, dtype=np.int32), n)
        starts = np.arange(n + 1, dtype=np.int32) * T
        d = np.empty((n * T, cols), np.float32)
        return nbytes * T, _cold_seconds(
            lambda g: K.moe_experts(g, z, token, starts, 4.0, 25.0, d), groups, seconds)

    # Sizes: a small matrix (its time is mostly the fixed cost; one just above the
    # parallel threshold measured too noisily under load) and a released-K3 matrix; and,
    # for a model that lives in the last-level cache (the demo), the same kernels hot.
    small_bf16 = bf16(256, 1024)
    b_rate, b_call = _fit(small_bf16, bf16(7168, 7168))
    # the rate by row length (the prefetch restarts every row): ~28 MB at each width
    widths = {str(w): _fit(small_bf16, bf16((14 << 20) // w, w))[0] for w in BF16_WIDTHS}
    widths["7168"] = b_rate
    m_rate, m_call = _fit(experts(1, 256, 1024), experts(8, 3072, 3584))
    bh_rate, bh_call = _fit(bf16(256, 1024, True), bf16(1024, 2048, True))
    mh_rate, mh_call = _fit(experts(1, 256, 1024, True), experts(2, 512, 2048, True))
    # a prefill: one 4096-wide matrix for PREFILL_PROBE_TOKENS positions, and the experts
    # of a decode batch with EXPERT_PROBE_TOKENS tokens each (per-call costs as above)
    pb_bytes, pb_s = bf16(4096, 4096, T=PREFILL_PROBE_TOKENS)
    bp_rate = pb_bytes / max(pb_s - b_call, 1e-9)
    pm_bytes, pm_s = experts(8, 3072, 3584, T=EXPERT_PROBE_TOKENS)
    mp_rate = pm_bytes / max(pm_s - m_call, 1e-9)
    wt = rng.integers(0x3c00, 0x4000, (16, 64), dtype=np.uint16)
    xt, yt = rng.standard_normal((1, 64)).astype(np.float32), np.empty((1, 16), np.float32)
    small = _cold_seconds(lambda w: K.matvec(w, xt, yt), [wt], seconds / 3)
    return {"bf16_bps": b_rate, "bf16_call_s": b_call, "bf16_width_bps": widths,
            "mxfp4_bps": m_rate, "mxfp4_call_s": m_call, "call_seconds": small,
            "bf16_prefill_bps": bp_rate, "mxfp4_prefill_bps": mp_rate,
            "hot": {"llc_bytes": l3, "bf16_bps": bh_rate, "bf16_call_s": bh_call,
                    "mxfp4_bps": mh_rate, "mxfp4_call_s": mh_call}}


# The kernels of a layer that stream no weights, by what their cost grows with (elements
# per position, counted by `layer_work`): the router's logits (one sequential double chain
# per expert, experts x hidden), SiTU-GLU, the KDA state (heads x D x D), the short conv,
# the KDA decay gate, the output gates' sigmoid, AttnRes (sources x hidden) and MLA
# attention (heads x (dn + dr + dv) per attended position).
SMALL_KINDS = ("router", "situ", "kda_state", "conv", "decay", "gate", "attnres", "mla")


def calibrate_small(seconds: float = KERNEL_SECONDS / 4) -> dict:
    """Seconds per element of each SMALL_KINDS kernel: the engine's own kernels on inputs of
    a middling size (their operands are activations, cache-resident at any model size)."""
    from . import kernels as K
    rng = np.random.default_rng(1)

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    H, D, E, P, S = 4, 128, 2048, 4096, 4
    router_w, bias = f32(64, E), np.zeros(64, np.float32)
    idx, wts = np.empty(8, np.int32), np.empty(8, np.float32)
    x1, g, u, y = f32(E), f32(1, P), f32(1, P), f32(1, P)
    one = np.full((1, P), 20.0, np.float32)
    state = np.zeros((H, D, D), np.float32)
    qkv = [f32(1, H * D) for _ in range(3)]
    for a in qkv[:2]:                    # unit keys and queries per head, as the forward's
        K.l2norm_heads(a, D)             # l2norm leaves them: the state stays bounded
    alpha, beta = np.full((1, H * D), 0.9, np.float32), np.full((1, H), 0.5, np.float32)
    o = np.empty((1, H * D), np.float32)
    convw, hist = f32(P, 4), np.zeros((P, 3), np.float32)
    out_p, out_q = np.empty((1, P), np.float32), np.empty((1, P), np.float32)
    a_log, dt = np.zeros(P // D, np.float32), np.zeros(P, np.float32)
    stack, run, phi = f32(S, 1, E), f32(1, E), f32(E)
    out = np.empty((1, E), np.float32)
    Hm, dn, dr, dv, ctx = 4, 128, 64, 128, 256
    q = f32(1, Hm * (dn + dr))
    kb, vc, rope = (f32(*shape) for shape in MLAState.shapes(Hm, dn, dv, dr, ctx).values())
    om = np.empty((1, Hm * dv), np.float32)
    work = {
        "router": (lambda _: K.router(router_w, x1, bias, 8, True, 1.0, idx, wts), 64 * E),
        "situ": (lambda _: K.situ_glu(g, u, 4.0, 25.0, out_p), P),
        "kda_state": (lambda _: K.kda_recurrence(state, qkv[0], qkv[1], qkv[2], alpha, beta,
                                                  0.1, o), H * D * D),
        "conv": (lambda _: K.shortconv(g, convw, hist, out_p), P),
        "decay": (lambda _: K.kda_decay(g, a_log, dt, -5.0, out_p, out_q), P),
        "gate": (lambda _: K.mul_sigmoid(y, one), P),   # sigma = 1: y stays normal
        "attnres": (lambda _: K.attnres(stack, S, run, phi, 1e-5, out), (S + 1) * E),
        "mla": (lambda _: K.mla_attention(q, kb, vc, rope, ctx - 1, om),
                ctx * Hm * (dn + dr + dv)),
    }
    return {kind: _cold_seconds(fn, [None], seconds) / n for kind, (fn, n) in work.items()}


def glue_probe(model_dir: str | None = None, tokens: int = 6) -> dict:
    """The engine's Python around its kernels, measured on the shipped demo model: two
    incremental greedy runs on one thread with every kernel entry point timed (thread CPU
    time), decode steps only: resident, and streamed with nothing pinned (every layer
    bound every step), every expert cached in both.  `glue_call_s`: the first run's CPU
    time outside the kernels over its kernel calls; `bind_s`: what the second adds per
    layer bound (the bind's views, the ring's bookkeeping; the reads run on the reader
    threads).  Run in a child process (`measure_glue`): it rebinds the kernel module's
    functions."""
    from . import kernels as K
    from .engine import GenSpec, load_spec_from, open_engine
    from .tools.demo import ready_dir
    clock = time.thread_time
    spent, calls = [0.0], [0]

    def timed(fn):
        def call(*a):
            t0 = clock()
            try:
                return fn(*a)
            finally:
                spent[0] += clock() - t0
                calls[0] += 1
        return call

    def decode(spec) -> tuple[float, int, int]:
        """(CPU outside the kernels, kernel calls, layers) over the run's decode steps."""
        eng = open_engine(spec, gen=tokens + 1)
        try:
            mark = None
            for ev in eng.batch([1, 2, 3, 4, 5], GenSpec(gen=tokens + 1)):
                if type(ev).__name__ == "TokenOut" and mark is None:   # prefill done
                    mark = (clock(), spent[0], calls[0])
            return ((clock() - mark[0]) - (spent[0] - mark[1]), calls[0] - mark[2],
                    eng.cfg.n_layers)
        finally:
            eng.close()

    d = model_dir or ready_dir()
    for name in K.KERNEL_ENTRY_POINTS:
        setattr(K, name, timed(getattr(K, name)))
    glue, n, layers = decode(load_spec_from(d, [("--cache-gb", 1.0)], threads=1,
                                            incremental=True))
    streamed = decode(load_spec_from(d, [("--trunk-gb", 0.0), ("--cache-gb", 1.0)],
                                     trunk_dir=os.path.join(d, "trunk"), threads=1,
                                     incremental=True))[0]
    return {"glue_call_s": max(glue, 0.0) / max(n, 1), "calls_per_token": n / tokens,
            "bind_s": max(streamed - glue, 0.0) / (tokens * layers)}


def measure_glue() -> dict:
    """glue_probe in a fresh interpreter ({} when it cannot run: the forecast then says its
    glue term is missing and prices binds in fitted units)."""
    code = ("import json, k3engine.calibrate as f; "
            "print(json.dumps(f.glue_probe()))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300, check=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
        return {k: float(got[k]) for k in ("glue_call_s", "bind_s")}
    except (OSError, ValueError, KeyError, IndexError, TypeError, subprocess.SubprocessError):
        return {}


def _cpu_busy() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs (/proc/stat), None where there is none."""
    try:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0.0)
    return sum(v) - idle, sum(v)


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def measure_read(device_dir: str, seconds: float = READ_SECONDS
                 ) -> tuple[dict, bool, float, float]:
    """(bytes/s per queue depth, O_DIRECT, seconds of latency per read, bytes/s of large
    reads) with `k3 devbw`'s own measuring code on one scratch file in `device_dir`:
    READ_BLOCK reads at each depth, then SMALL_BLOCK reads at depth 1, so a read costs
    latency + bytes / rate (small reads -- a small model's layers and experts -- are
    latency-bound); and TRUNK_BLOCK reads on the trunk's reader count, the shape of a
    layer's chunked reads (the engine's trunk reads ran above the 4 MiB QD16 rate)."""
    from .tools import devbw
    free = devbw.free_bytes(device_dir)
    if free is not None and free < 2 * READ_SCRATCH_BYTES:
        raise devbw.DevbwError(f"{device_dir}: too little free space for the read test")
    path = devbw.write_scratch(device_dir, READ_SCRATCH_BYTES)
    try:
        big = devbw.measure_file(path, block=READ_BLOCK, depths=READ_DEPTHS, reads=40,
                                 seconds=seconds)
        small = devbw.measure_file(path, block=SMALL_BLOCK, depths=(1,), reads=200,
                                   seconds=seconds / 2)
        large = devbw.measure_file(path, block=TRUNK_BLOCK, depths=(TRUNK_IO_THREADS,),
                                   reads=2 * READ_SCRATCH_BYTES // TRUNK_BLOCK,
                                   seconds=seconds).results[0]
    finally:
        os.unlink(path)
    rates = {str(q.qd): q.nbytes / q.seconds for q in big.results if q.seconds > 0}
    q1, s1 = big.results[0], small.results[0]
    t_big = q1.seconds / max(q1.reads, 1)
    t_small = s1.seconds / max(s1.reads, 1)
    rate, lat = _fit((SMALL_BLOCK, t_small), (big.block, t_big))
    return rates, big.direct, lat, (large.nbytes / large.seconds if large.seconds > 0 else 0.0)


def measure_baseline() -> int:
    """RSS of a fresh interpreter that imported the engine and its kernels: what every
    run carries before it allocates anything (SYSTEM §5.8).  Its current RSS, not
    getrusage's peak: Linux carries ru_maxrss across exec, so a child would report this
    process's own high-water mark (a calibration's gigabytes)."""
    code = ("import k3engine.engine, k3engine.kernels, k3engine.telemetry as t; "
            "print(t.rss_bytes())")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        return int(out.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 0


def measure_machine(device_dir: str, threads: int | None = None,
                    progress=None) -> MachineFigures:
    """`progress(phase)` is called as each phase starts (the app shows it live)."""
    from . import kernels as K
    say = progress or (lambda _what: None)
    nt = threads or default_threads()
    old = K.get_num_threads()
    K.set_num_threads(nt)
    before, own0 = _cpu_busy(), _own_cpu()
    try:
        say("timing the engine's matrix kernels")
        kern = calibrate_kernels()
        say("timing the small kernels")
        kern["small_s"] = calibrate_small()
    finally:
        K.set_num_threads(old)
    after, own1 = _cpu_busy(), _own_cpu()
    other = None
    if before and after and after[1] > before[1]:
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = (after[0] - before[0]) - (own1 - own0) * hz
        other = max(0.0, busy / (after[1] - before[1]))
    say("reading a test file on the model's disk")
    read, direct, lat, large = measure_read(device_dir)
    say("measuring the engine's baseline memory")
    return MachineFigures(machine_identity(device_dir, nt), read, direct, read_latency_s=lat,
                          baseline_bytes=measure_baseline(), threads=nt,
                          measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          other_load=other, trunk_read_bps=large, **measure_glue(),
                          **kern)


def machine_figures(device_dir: str, threads: int | None = None, refresh: bool = False,
                    path: str | None = None, progress=None) -> MachineFigures:
    """The cached figures for this machine (keyed by `machine_identity`), measured and
    saved when absent, stale (another identity) or `refresh`.  A damaged cache file is
    remeasured and rewritten, never trusted."""
    from .atomic import open_dir, write_atomic
    nt = threads or default_threads()
    path = path or cache_file()
    if not refresh:
        got = cached_machine_figures(device_dir, nt, path)
        if got is not None:
            return got
    m = measure_machine(device_dir, nt, progress)
    entries = _read_cache(path)
    entries[identity_key(m.identity)] = m.to_json()
    try:
        # the cache folder is ours: a link planted in it (or as it) is refused (issue 47)
        root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        os.close(open_dir(os.path.dirname(os.path.abspath(path)), inside=root, create=True))
        write_atomic(path, (json.dumps(entries, indent=1, sort_keys=True) + "\n").encode(),
                     inside=root)
    except OSError:
        pass                                     # an unwritable cache only costs a re-run
    return m
