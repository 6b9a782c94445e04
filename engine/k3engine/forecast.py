"""Pre-flight forecast: what a run of a model at a plan will cost on this machine, before
it is started -- peak RSS, bytes read per token, seconds per token and time to first token.

Three inputs, each kept apart so every figure can say what it came from:

* the model's shapes (`ModelShape`): a local checkpoint (and its packed trunk) read the way
  the engine opens it, or the released Kimi K3 from its published shapes without having it;
* the machine (`MachineFigures`): the device read rate measured as `k3 devbw` does, and the
  BF16 / MXFP4 matvec throughput from a short calibration of the engine's own kernels,
  cached under the user cache dir keyed by the machine's identity;
* the routing (`HitModel`): an expert-cache hit-rate model, replayed from a recorded trace
  (LRU, as the engine does it) or, without one, the stated assumption of uniform routing.

The time model is per layer, in the order the engine works (SYSTEM §3.6): the streamed
trunk's read of a layer overlaps the compute of the one before when the ring has two slots
or more; a layer's expert misses are read (batch prefetch) before its experts are computed.
The memory model is the planner's (`memory.plan`), corrected for what an arena costs in
RSS: only the pages a run touches.  Everything here is arithmetic except `measure_machine`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

import numpy as np

from . import __version__
from .diskio import align_up
from .kernels import PANEL_MIN_TOKENS   # from here a BF16 matvec runs through the panels
from .memory import ModelFigures, Plan, moe_chunk_for, plan
from .model import PREFILL_CHUNK
from .state import MLAState
from .trunk import IO_THREADS as TRUNK_IO_THREADS   # a layer's reads run on this many threads

__all__ = [
    "MachineFigures", "machine_identity", "machine_figures", "cached_machine_figures",
    "measure_machine",
    "cache_file", "ModelShape", "released_k3", "local_model", "shape_from", "RELEASED_K3_CONFIG",
    "HitModel", "UniformRouting", "TraceRouting", "Forecast", "forecast", "splits",
]

CACHE_NAME = "machine-figures.json"
CALIBRATION_VERSION = 11         # bump when what is measured changes (old entries ignored)
READ_BLOCK = 4 << 20             # device test block: between an expert and a trunk chunk
READ_DEPTHS = (1, 4, 16)
READ_SCRATCH_BYTES = 256 * 10**6
READ_SECONDS = 1.5               # per queue depth
SMALL_BLOCK = 256 << 10          # the latency probe's read size
TRUNK_BLOCK = 32 << 20           # the large-read probe's size (a trunk layer's chunks)
# What a run holds beyond the import baseline and the planner's terms: the shard index,
# reader threads' stacks, per-step temporaries.  Fitted, not derived: peak RSS less the
# planner's terms and the baseline, on the demo model's runs here (docs/forecast.md): 4.5-6.5
# MB (median 6.1) for the retrained 9 MB demo at five plans; 11 MB was the older 26 MB
# demo's, which put the new demo's forecast 9-13 % above its measured peak.
RUN_OVERHEAD_BYTES = 6 * 10**6
KERNEL_SECONDS = 0.6             # per kernel
BF16_WIDTHS = (1024, 2048, 4096)  # BF16 matrix widths measured besides K3's 7168
COLD_ROTATION = 4                # copies x L3: every timed call streams its weights from DRAM
PREFILL_PROBE_TOKENS = 64        # tokens of the prefill BF16 probe
EXPERT_PROBE_TOKENS = 4          # tokens per expert of the prefill expert probe
# The engine's Python-side cost per streamed layer bind (the binder's views of a freshly read
# run) when the calibration could not measure it (glue_probe's bind_s), in units of one tiny
# kernel call: benchmarks/bench_bind.py measured 0.33-0.41 ms per mid layer (0.80-0.96
# before the bind bookkeeping was cached), ~60 calls of ~6 us.
BIND_CALLS = 60


# ---- the machine -----------------------------------------------------------------------

@dataclass(frozen=True)
class MachineFigures:
    identity: dict
    read_bps: dict                 # queue depth -> bytes/s (O_DIRECT random READ_BLOCK reads)
    direct: bool                   # whether the device test used O_DIRECT
    bf16_bps: float                # BF16 matvec, weight bytes/s (cold, engine threads, T = 1)
    bf16_call_s: float             # its fixed cost per call (parallel region start + join)
    mxfp4_bps: float               # routed experts (moe_experts), packed bytes/s (cold, T = 1)
    mxfp4_call_s: float            # its fixed cost per batch of experts (one thread region)
    call_seconds: float            # one tiny single-threaded kernel call from Python
    baseline_bytes: int            # RSS of a fresh interpreter that imported the engine
    threads: int
    measured_at: str
    other_load: float | None = None  # CPU share other processes used while calibrating
    read_latency_s: float = 0.0      # fixed seconds per read (one batch of parallel reads)
    source: str = "measured"       # "measured", "cache <path>", or "given"
    # the layer's small kernels, seconds per element of each SMALL_KINDS kind (measured by
    # calibrate_small), and the engine's Python around each kernel call (measure_glue)
    small_s: dict = field(default_factory=dict)
    glue_call_s: float = 0.0
    # the matvecs with their weights in the last-level cache (its size under "llc_bytes"):
    # what a model small enough to stay there runs at (in_cache)
    hot: dict = field(default_factory=dict)
    trunk_read_bps: float = 0.0      # TRUNK_BLOCK reads on the trunk's reader threads (0: the
                                     # 4 MiB rate at that depth stands in)
    bind_s: float = 0.0              # main-thread seconds streaming adds per layer bound
                                     # (glue_probe; 0: BIND_CALLS tiny calls stand in)
    bf16_width_bps: dict = field(default_factory=dict)  # matrix width -> BF16 bytes/s (cold)
    # a prefill's rates, weight bytes per position per second (0: not measured; the T = 1
    # rates stand in): BF16 at PREFILL_PROBE_TOKENS tokens (the panels), and the experts
    # at EXPERT_PROBE_TOKENS tokens each (what a 64-position chunk gives mid's experts)
    bf16_prefill_bps: float = 0.0
    mxfp4_prefill_bps: float = 0.0

    def at_width(self, width: int) -> "MachineFigures":
        """These figures with the BF16 rate of matrices `width` inputs wide (a model's
        hidden size): shorter rows stream slower (2048-wide ran 13-27 % below 7168-wide
        here, more at 2 threads), interpolated in log2(width) between the measured widths
        and clamped at the ends.  Without measured widths, unchanged."""
        if not self.bf16_width_bps:
            return self
        pts = sorted((int(w), float(r)) for w, r in self.bf16_width_bps.items())
        x = math.log2(max(width, 1))
        if x <= math.log2(pts[0][0]):
            rate = pts[0][1]
        elif x >= math.log2(pts[-1][0]):
            rate = pts[-1][1]
        else:
            for (w0, r0), (w1, r1) in zip(pts, pts[1:]):
                if x <= math.log2(w1):
                    a = (x - math.log2(w0)) / (math.log2(w1) - math.log2(w0))
                    rate = r0 + a * (r1 - r0)
                    break
        return replace(self, bf16_bps=rate)

    def bf16_rate(self, positions: float) -> float:
        """BF16 weight bytes/s per position for a step over `positions` (the panels of a
        prefill run compute-bound, several times the bytes/s of a one-token step)."""
        if positions < PANEL_MIN_TOKENS or not self.bf16_prefill_bps:
            return self.bf16_bps
        return max(self.bf16_bps, self.bf16_prefill_bps)

    def mxfp4_rate(self, tokens_per_run: float) -> float:
        """Expert bytes/s per token when each expert run serves `tokens_per_run` tokens:
        seconds per byte interpolated between 1 token (decode) and EXPERT_PROBE_TOKENS
        (a tile decodes each weight once for up to 4 tokens), constant beyond.  From 8
        tokens an AVX-512 call decodes once for all of them (1.1-1.28x the tiles' rate on
        the Xeon, docs/benchmarks-kernels.md): not credited, since K3's 896 experts see
        ~4.6 tokens each in a 256-position chunk, so the forecast errs slow there."""
        if tokens_per_run <= 1 or not self.mxfp4_prefill_bps:
            return self.mxfp4_bps
        a = min((tokens_per_run - 1) / (EXPERT_PROBE_TOKENS - 1), 1.0)
        return 1.0 / ((1 - a) / self.mxfp4_bps + a / self.mxfp4_prefill_bps)

    def read_rate(self, queue_depth: float) -> float:
        """The rate at the deepest measured depth not above `queue_depth` (reads in flight
        that the engine issues together); at least depth 1."""
        depths = sorted(int(q) for q in self.read_bps)
        best = depths[0]
        for q in depths:
            if q <= max(queue_depth, 1):
                best = q
        return float(self.read_bps[str(best)] if str(best) in self.read_bps
                     else self.read_bps[best])

    def with_overrides(self, read_gbs: float | None = None, bf16_gbs: float | None = None,
                       mxfp4_gbs: float | None = None) -> "MachineFigures":
        """Another machine's published figures in place of measured ones (to recompute a
        published result); the source says so."""
        m = self
        given = []
        if read_gbs is not None:           # (its latency unknown: taken as 0)
            m = replace(m, read_bps={str(q): read_gbs * 1e9 for q in READ_DEPTHS},
                        read_latency_s=0.0, trunk_read_bps=read_gbs * 1e9)
            given.append(f"read {read_gbs:g} GB/s")
        if bf16_gbs is not None:                  # one given rate for every width
            m = replace(m, bf16_bps=bf16_gbs * 1e9, bf16_width_bps={}, bf16_prefill_bps=0.0)
            given.append(f"BF16 {bf16_gbs:g} GB/s")
        if mxfp4_gbs is not None:
            m = replace(m, mxfp4_bps=mxfp4_gbs * 1e9, mxfp4_prefill_bps=0.0)
            given.append(f"MXFP4 {mxfp4_gbs:g} GB/s")
        return replace(m, source=f"given ({', '.join(given)}) over {self.source}") if given else m

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict, source: str) -> "MachineFigures":
        d = dict(d)
        d["read_bps"] = {str(k): float(v) for k, v in d["read_bps"].items()}
        d["source"] = source
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _mem_total() -> int:
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - identity only; unknown is allowed
        return 0


def _device_of(path: str) -> str:
    """A stable name for the block device holding `path` (Linux: its sysfs name, model and
    size; elsewhere the filesystem's device number).  Never a path or a user name."""
    try:
        st = os.stat(path)
    except OSError:
        return "unknown"
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sysdev = f"/sys/dev/block/{major}:{minor}"
    if os.path.exists(sysdev):
        real = os.path.realpath(sysdev)
        name = os.path.basename(real)
        disk = real if os.path.exists(os.path.join(real, "device")) else os.path.dirname(real)
        parts = [name]
        for f in ("device/model", "size"):
            try:
                with open(os.path.join(disk, f)) as fh:
                    parts.append(fh.read().strip())
            except OSError:
                pass
        return " ".join(p for p in parts if p)
    return f"dev {major}:{minor}"


def machine_identity(device_dir: str, threads: int) -> dict:
    """What the figures depend on: CPU model and cores, memory, the device, the engine's
    threads, its SIMD path and version (kernels change between versions)."""
    from . import kernels as K
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return {"cpu": _cpu_model(), "logical_cpus": os.cpu_count() or 1, "usable_cpus": usable,
            "memory_bytes": _mem_total(), "device": _device_of(device_dir),
            "threads": threads, "simd": bool(K.simd_active()), "engine": __version__,
            "calibration": CALIBRATION_VERSION}


def identity_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def cache_file() -> str:
    """<user cache dir>/k3studio/machine-figures.json (XDG on Linux, the platform's
    cache folder on macOS and Windows)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser("~\\AppData\\Local")
    elif sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "k3studio", CACHE_NAME)


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
    from .run import Prompt, open_run, request_from
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

    def decode(req) -> tuple[float, int, int]:
        """(CPU outside the kernels, kernel calls, layers) over the run's decode steps."""
        run = open_run(req)
        try:
            mark = None
            for ev in run.generate():
                if type(ev).__name__ == "TokenOut" and mark is None:   # prefill done
                    mark = (clock(), spent[0], calls[0])
            return ((clock() - mark[0]) - (spent[0] - mark[1]), calls[0] - mark[2],
                    run.cfg.n_layers)
        finally:
            run.close()

    d = model_dir or ready_dir()
    for name in K.KERNEL_ENTRY_POINTS:
        setattr(K, name, timed(getattr(K, name)))
    base = dict(prompt=Prompt(ids=(1, 2, 3, 4, 5)), gen=tokens + 1, threads=1,
                incremental=True)
    glue, n, layers = decode(request_from(d, [("--cache-gb", 1.0)], **base))
    streamed = decode(request_from(d, [("--trunk-gb", 0.0), ("--cache-gb", 1.0)],
                                   trunk_dir=os.path.join(d, "trunk"), **base))[0]
    return {"glue_call_s": max(glue, 0.0) / max(n, 1), "calls_per_token": n / tokens,
            "bind_s": max(streamed - glue, 0.0) / (tokens * layers)}


def measure_glue() -> dict:
    """glue_probe in a fresh interpreter ({} when it cannot run: the forecast then says its
    glue term is missing and prices binds in fitted units)."""
    code = ("import json, k3engine.forecast as f; "
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
    code = ("import k3engine.session, k3engine.kernels, k3engine.telemetry as t; "
            "print(t.rss_bytes())")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        return int(out.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 0


def measure_machine(device_dir: str, threads: int | None = None) -> MachineFigures:
    from . import kernels as K
    from .session import default_threads
    nt = threads or default_threads()
    old = K.get_num_threads()
    K.set_num_threads(nt)
    before, own0 = _cpu_busy(), _own_cpu()
    try:
        kern = calibrate_kernels()
        kern["small_s"] = calibrate_small()
    finally:
        K.set_num_threads(old)
    after, own1 = _cpu_busy(), _own_cpu()
    other = None
    if before and after and after[1] > before[1]:
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = (after[0] - before[0]) - (own1 - own0) * hz
        other = max(0.0, busy / (after[1] - before[1]))
    read, direct, lat, large = measure_read(device_dir)
    return MachineFigures(machine_identity(device_dir, nt), read, direct, read_latency_s=lat,
                          baseline_bytes=measure_baseline(), threads=nt,
                          measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          other_load=other, trunk_read_bps=large, **measure_glue(),
                          **kern)


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            entries = json.load(f)
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_machine_figures(device_dir: str, threads: int | None = None,
                           path: str | None = None) -> MachineFigures | None:
    """The cached figures for this machine's identity, or None (never measures: the app
    calls this on every model change and measures only when asked)."""
    from .session import default_threads
    path = path or cache_file()
    key = identity_key(machine_identity(device_dir, threads or default_threads()))
    entry = _read_cache(path).get(key)
    if entry is None:
        return None
    try:
        return MachineFigures.from_json(entry, f"cache {path}")
    except (KeyError, TypeError, ValueError):
        return None                              # damaged entry: as if absent


def machine_figures(device_dir: str, threads: int | None = None, refresh: bool = False,
                    path: str | None = None) -> MachineFigures:
    """The cached figures for this machine (keyed by `machine_identity`), measured and
    saved when absent, stale (another identity) or `refresh`.  A damaged cache file is
    remeasured and rewritten, never trusted."""
    from .atomic import open_dir, write_atomic
    from .session import default_threads
    nt = threads or default_threads()
    path = path or cache_file()
    if not refresh:
        got = cached_machine_figures(device_dir, nt, path)
        if got is not None:
            return got
    m = measure_machine(device_dir, nt)
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


# ---- the model -------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """What the forecast knows of a model: the planner's figures plus the bytes each layer's
    matvecs stream per token and how many kernel calls it makes."""

    name: str
    shape: dict                      # hidden, layers, experts, topk, vocab (no paths)
    figures: ModelFigures
    matvec_bytes: tuple[int, ...]    # per layer: BF16 matrix bytes read by the matvecs
    matvec_calls: tuple[int, ...]    # per layer: matvec calls (thread regions)
    moe: tuple[bool, ...]            # per layer: has routed experts
    lm_head_bytes: int
    streamed: bool                   # a packed trunk is available (or assumed, for K3)
    source: str                      # where the sizes came from
    work: tuple = ()                 # per layer: LayerWork (the small kernels and calls)
    overlap_bytes: tuple = ()        # per layer: the BF16 matrices a layer computes while its
                                     # expert reads are in flight (latent down, shared expert)


# The released checkpoint's config, from ARCHITECTURE §0.2 / §1.3 (flat shape).
RELEASED_K3_CONFIG = dict(
    hidden_size=7168, num_hidden_layers=93, vocab_size=163840, rms_norm_eps=1e-5,
    kda_num_heads=96, kda_head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
    num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=True, num_experts=896,
    num_experts_per_token=16, num_shared_experts=2, routed_expert_hidden_size=3584,
    moe_intermediate_size=3072, routed_scaling_factor=1.0, moe_renormalize=True,
    latent_moe_use_norm=True, first_k_dense_replace=1, intermediate_size=33792,
    attn_res_block_size=12, situ_beta=4.0, situ_linear_beta=25.0,
    full_attn_layers=list(range(4, 93, 4)) + [93],
)
MATRIX_KINDS = ("M", "router")


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


# what model.latent_moe runs while a layer's expert reads are in flight (SYSTEM §4.5)
WHILE_READING = ("routed_expert_down_proj", "shared_experts")


def _layer_compute(cfg) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...],
                                 tuple[int, ...]]:
    from .names import layer_tensors
    mb, calls, moe, over = [], [], [], []
    for L in range(cfg.n_layers):
        mats = [t for t in layer_tensors(cfg, L) if t.kind in MATRIX_KINDS]
        mb.append(sum(_numel(t.shape) * 2 for t in mats))
        # one call per matrix, except the projections sharing an input (weights.mvs: the
        # attention's of x, the MLP's gate and up)
        calls.append(len(mats) - (5 if cfg.is_kda(L) else 1 + bool(cfg.mla_out_gate)) - 1)
        moe.append(not cfg.is_dense(L))
        over.append(sum(_numel(t.shape) * 2 for t in mats
                        if any(k in t.name for k in WHILE_READING)))
    return tuple(mb), tuple(calls), tuple(moe), tuple(over)


@dataclass(frozen=True)
class LayerWork:
    """What one layer computes besides the trunk and expert matvecs' weight streaming,
    counted from the config the way model.py's forward does it (and checked against the
    forward's own calls by tests/test_forecast.py::test_layer_work_counts_the_forwards_calls):
    SMALL_KINDS elements per position ("mla" per attended position), and its kernel calls,
    each of which costs the engine's Python glue around it."""
    elements: dict
    calls_fixed: int           # once per pass whatever the positions
    calls_per_chunk: int       # per PREFILL_CHUNK positions: the router, the expert grouping,
                               # the latent down-projection, the routed experts (one batch
                               # when they are resident; a step that reads splits it where
                               # a read is still in flight: < topk more calls, not counted)
                               # and the combine


def layer_work(cfg) -> tuple[LayerWork, ...]:
    out, n_snap = [], 0
    for L in range(cfg.n_layers):
        el = dict.fromkeys(SMALL_KINDS, 0)
        # AttnRes before the attention (once a snapshot exists) and before the MLP
        fixed = 4 + (n_snap > 0) + (not cfg.is_boundary(L))   # 2 norms, run += z, += y
        el["attnres"] = (n_snap + 1) * cfg.hidden if n_snap else 0
        n_snap += cfg.is_boundary(L)
        el["attnres"] += (n_snap + 1) * cfg.hidden
        if cfg.is_kda(L):
            P = cfg.kda_heads * cfg.kda_head_dim
            el["kda_state"] = cfg.kda_heads * cfg.kda_head_dim ** 2
            el["conv"], el["decay"], el["gate"] = 3 * P, P, P
            fixed += 3 + 11              # [q k v b f_a g], f_b, o; 3 convs, 2 l2norms,
        else:                            # sigmoid, decay, q scale, recurrence, o norm, gate
            gate = bool(cfg.mla_out_gate)
            el["mla"] = cfg.n_heads * (cfg.qk_nope + cfg.qk_rope + cfg.v_head)
            el["gate"] = cfg.n_heads * cfg.v_head if gate else 0
            fixed += 4 + 3 + gate        # [q_a kv_a (g)], q_b, kv_b, o; 2 norms, attention;
                                         # the gate
        per_chunk = 0
        if cfg.is_dense(L):
            el["situ"] = cfg.dense_inter
            fixed += 3                   # [gate up], down, SiTU
        else:
            el["router"] = cfg.n_experts * cfg.hidden
            el["situ"] = cfg.topk * cfg.moe_inter + cfg.shared_inter
            fixed += 3 + 2 + bool(cfg.latent_norm)   # shared [gate up] down SiTU; up_lat, add
            per_chunk = 5
        out.append(LayerWork(el, fixed, per_chunk))
    return tuple(out)


def _shape_of(cfg) -> dict:
    return {"hidden": cfg.hidden, "layers": cfg.n_layers, "vocab": cfg.vocab,
            "experts": cfg.n_experts, "topk": cfg.topk, "latent": cfg.latent,
            "moe_intermediate": cfg.moe_inter, "mla_layers": len(cfg.mla_layers)}


def released_k3() -> ModelShape:
    """Kimi K3 as released, from its published shapes alone: matrices BF16, small vectors
    F32 (SYSTEM §1.5 leaves their dtype open; they are 0.01 % of a layer), each layer's run
    rounded up to 4096 as pack-trunk writes it (SYSTEM §2.4)."""
    from .config import parse_config
    from .names import expert_tensors, layer_tensors, model_tensors
    cfg = parse_config(RELEASED_K3_CONFIG, "the released Kimi K3 (ARCHITECTURE §0.2)")
    sizes = [align_up(sum(_numel(t.shape) * (2 if t.kind in MATRIX_KINDS else 4)
                          for t in layer_tensors(cfg, L))) for L in range(cfg.n_layers)]
    expert = sum(_numel(t.shape) for t in expert_tensors(cfg, 1, 0))
    tables = sum(_numel(t.shape) * 2 for t in model_tensors(cfg) if t.kind == "M")
    figures = ModelFigures.for_config(cfg, sizes, expert, table_bytes=tables)
    mb, calls, moe, over = _layer_compute(cfg)
    return ModelShape("Kimi K3 (released)", _shape_of(cfg), figures, mb, calls, moe,
                      cfg.vocab * cfg.hidden * 2, True,
                      "published shapes (ARCHITECTURE §0.2, §3; SYSTEM §1.6, §2)",
                      layer_work(cfg), over)


def shape_from(cfg, figures: ModelFigures, streamed: bool, source: str) -> ModelShape:
    """A ModelShape from a config and the planner's figures (what the app's Setup
    inspection already holds), without opening anything."""
    mb, calls, moe, over = _layer_compute(cfg)
    label = f"checkpoint ({cfg.shape} config, hidden {cfg.hidden}, {cfg.n_layers} layers)"
    return ModelShape(label, _shape_of(cfg), figures, mb, calls, moe,
                      cfg.vocab * cfg.hidden * 2, streamed, source, layer_work(cfg), over)


def local_model(model_dir: str, trunk_dir: str | None = None, config: str | None = None
                ) -> ModelShape:
    """A checkpoint on disk, opened as the engine opens it (shard index, partial-download
    refusal, the trunk's manifest cross-checked): its real layer runs and expert size."""
    from .session import open_model, read_config
    cfg, _ = read_config(model_dir, config)
    setup = open_model(model_dir, cfg, None, trunk_dir)
    try:
        figures = setup.figures
    finally:
        setup.ck.close()
    return shape_from(cfg, figures, bool(trunk_dir), "the checkpoint's shard headers"
                      + (" and the packed trunk's manifest" if trunk_dir else ""))


# ---- routing: the expert-cache hit rate ------------------------------------------------

class HitModel:
    """Expected hit rate of the expert cache and the distinct experts a run touches."""

    description = ""

    def decode_hit(self, slots: int, model: ModelShape, positions_seen: int) -> float:
        raise NotImplementedError

    def steady_hit(self, slots: int, model: ModelShape) -> float:
        raise NotImplementedError

    def distinct(self, model: ModelShape, positions: int) -> int:
        """Distinct experts requested over `positions` positions (what the arena holds
        when nothing is evicted): the pages of the arena a run touches."""
        raise NotImplementedError


def _seen_fraction(model: ModelShape, positions: int) -> float:
    n, k = model.figures.n_experts, model.figures.topk
    return 1.0 - (1.0 - k / n) ** max(positions, 0) if n else 0.0


class UniformRouting(HitModel):
    """No trace: every token routes each MoE layer to top-k experts drawn uniformly and
    independently (K3's router is trained for flat expert usage, SYSTEM §5.2).  The cache
    then holds min(slots, experts seen so far) of the pool, and a request hits with that
    share: steady state slots / pool."""

    description = ("uniform independent routing (no trace): hit rate = min(slots, experts "
                   "seen) / pool; steady state slots / pool")

    def decode_hit(self, slots, model, positions_seen):
        pool = model.figures.expert_pool
        held = min(slots, pool * _seen_fraction(model, positions_seen))
        return held / pool if pool else 0.0

    def steady_hit(self, slots, model):
        pool = model.figures.expert_pool
        return min(slots / pool, 1.0) if pool else 0.0

    def distinct(self, model, positions):
        return int(round(model.figures.expert_pool * _seen_fraction(model, positions)))


class TraceRouting(HitModel):
    """A recorded trace (`--dump-cache-trace`'s expert_trace.bin) replayed through the
    engine's own replacement policy (experts.policy_class: `policy`, else the one
    K3_CACHE_POLICY gives a run, resolved once; as `k3 sim-cache` replays them) at the slot
    count.  The
    steady hit rate counts the second half of the trace only, replayed after the first
    (a warm cache): a trace starts with the prompt's compulsory misses, which a long decode
    does not see again."""

    def __init__(self, keys: list[int], label: str = "trace", policy: str | None = None):
        self.keys = keys
        self.uniq = len(set(keys))
        self._memo: dict[int, float] = {}
        from .experts import policy_class
        self._policy = policy_class(policy)
        self.description = (f"{self._policy.title} replay of {label} ({len(keys)} "
                            f"requests, {self.uniq} distinct experts; hits counted over its "
                            f"second half)")

    @classmethod
    def from_file(cls, path: str, policy: str | None = None) -> "TraceRouting":
        from .tools.sim_cache import read_trace, trace_keys
        return cls(trace_keys(read_trace(path)), f"the trace {os.path.basename(path)}", policy)

    def steady_hit(self, slots, model):
        if slots not in self._memo:
            n, half = len(self.keys), len(self.keys) // 2
            hits = 0
            if n and slots > 0:
                access = self._policy(slots).access
                for i, k in enumerate(self.keys):
                    h = access(k)
                    if i >= half:
                        hits += h
            self._memo[slots] = hits / (n - half) if n - half > 0 else 0.0
        return self._memo[slots]

    def decode_hit(self, slots, model, positions_seen):
        return self.steady_hit(slots, model)

    def distinct(self, model, positions):
        return self.uniq


# ---- the forecast ----------------------------------------------------------------------

@dataclass
class Forecast:
    model: str
    plan: Plan
    s_per_token: float              # steady decode, at the hit rate of `steady_hit`
    ttft_s: float                   # prefill of the prompt (the first token comes from it)
    s_per_token_run: float          # what a run of `gen` tokens reports: wall / gen
    peak_rss_bytes: int
    plan_bytes: int                 # the planner's total (it overstates on purpose)
    bytes_read_per_token: int       # steady: trunk streamed + expected expert misses
    trunk_bytes_per_token: int
    expert_bytes_per_token: float
    first_token_bytes: int          # the whole trunk + the prompt's distinct experts
    hit_rate: float
    compute_s: float
    io_s: float
    prompt_len: int
    gen: int
    assumptions: list[str] = field(default_factory=list)
    machine: dict = field(default_factory=dict)
    decode_s_run: float = 0.0       # median decode step of that run (cold cache included)
    decode_compute_s: float = 0.0   # the compute part of one decode step
    decode_io_s: float = 0.0        # the median decode step's reads (before overlap)

    def as_json(self) -> dict:
        p = self.plan
        tp = p.trunk_plan
        return {
            "model": self.model, "s_per_token": round(self.s_per_token, 4),
            "ttft_s": round(self.ttft_s, 4), "s_per_token_run": round(self.s_per_token_run, 4),
            "decode_s_per_token_run": round(self.decode_s_run, 4),
            "decode_io_s_per_token_run": round(self.decode_io_s, 4),
            "peak_rss_bytes": self.peak_rss_bytes, "plan_bytes": self.plan_bytes,
            "bytes_read_per_token": self.bytes_read_per_token,
            "trunk_bytes_per_token": self.trunk_bytes_per_token,
            "expert_bytes_per_token": int(self.expert_bytes_per_token),
            "first_token_bytes": self.first_token_bytes,
            "expert_hit_rate": round(self.hit_rate, 4),
            "compute_s_per_token": round(self.compute_s, 4),
            "io_s_per_token": round(self.io_s, 4),
            "prompt_len": self.prompt_len, "gen": self.gen,
            "plan": {"preset": p.preset, "trunk_gb": p.trunk_gb, "cache_gb": p.cache_gb,
                     "streamed": p.streamed, "pinned_layers": tp.n_pinned if tp else p.layers,
                     "layers": p.layers, "ring_slots": tp.ring_slots if tp else 0,
                     "expert_slots": p.expert_slots, "refused": bool(p.refusals)},
            "machine": self.machine, "assumptions": list(self.assumptions)}


TRUNK_CHUNK = 64 << 20           # the trunk reads a layer in parallel 64 MiB chunks (§2.5)


@dataclass
class _Costs:
    compute: list        # per layer seconds (matvecs + experts + small kernels)
    expert_io: list      # per layer seconds of expert misses (batch read, synchronous)
    sync_read: list      # per layer seconds of a synchronous read (a pinned layer's first touch)
    ring_read: list      # per layer seconds of a read through the ring (prefetchable)
    overlap: list = field(default_factory=list)   # per layer compute that runs while its
                                                  # expert reads are in flight (§4.5)


def _trunk_read_s(machine: MachineFigures, nbytes: int) -> float:
    """A layer's read: chunks of up to TRUNK_CHUNK on the reader threads.  The block layer
    splits each large read into many device requests, so even one chunk keeps the device
    busy: its rate is the large-read probe's (else the deepest 4 MiB figure), never the
    queue-depth-1 rate the chunk count alone would suggest."""
    if nbytes < TRUNK_BLOCK:
        depth = min(TRUNK_IO_THREADS, max(1, -(-nbytes // TRUNK_CHUNK)))
        return machine.read_latency_s + nbytes / machine.read_rate(depth)
    return machine.read_latency_s + nbytes / (machine.trunk_read_bps or machine.read_rate(16))


def _layer_costs(model: ModelShape, machine: MachineFigures, positions: int,
                 misses_per_layer: float, ring_layers: set, expert_tokens: float,
                 first_touch: set = frozenset(), attended: float | None = None,
                 expert_runs: float | None = None, chunk: int = PREFILL_CHUNK) -> _Costs:
    """Seconds per layer for one engine step over `positions` new positions, attending to
    `attended` (query, key) position pairs in all (decode: the context length), with
    `expert_runs` expert invocations per MoE layer (decode: topk; a prefill: the union of
    each chunk's experts, summed over its chunks of `chunk` positions)."""
    f = model.figures
    eb = f.expert_bytes
    attended = positions if attended is None else attended
    runs = min(expert_tokens, f.n_experts) if expert_runs is None else expert_runs
    chunks = -(-positions // chunk)
    bf16_rate = machine.bf16_rate(positions)
    mxfp4_rate = machine.mxfp4_rate(expert_tokens / max(runs, 1))
    comp, eio, sync, ring, over = [], [], [], [], []
    for L in range(f.n_layers):
        # a matvec call costs its fixed part once and its bytes once per position
        c = (model.matvec_calls[L] * machine.bf16_call_s
             + positions * model.matvec_bytes[L] / bf16_rate)
        if model.work:                  # the small kernels, and the Python around each call
            w = model.work[L]
            c += sum(n * machine.small_s.get(kind, 0.0) * (attended if kind == "mla" else positions)
                     for kind, n in w.elements.items())
            c += (w.calls_fixed + chunks * w.calls_per_chunk) * machine.glue_call_s
        e = o = 0.0
        if model.moe[L]:
            # one batch per chunk, cut where a miss is still being read (model.py)
            batches = min(runs, chunks + misses_per_layer)
            experts = batches * machine.mxfp4_call_s + expert_tokens * eb / mxfp4_rate
            c += experts
            # while the misses are read: the latent down-projection, the shared expert
            # and the experts that hit (each served as soon as it is there)
            o = (positions * (model.overlap_bytes[L] if model.overlap_bytes else 0)
                 / bf16_rate + experts * max(runs - misses_per_layer, 0.0) / max(runs, 1))
            if misses_per_layer > 0:
                e = machine.read_latency_s + misses_per_layer * eb / machine.read_rate(
                    misses_per_layer)
        comp.append(c)
        eio.append(e)
        over.append(o)
        read = _trunk_read_s(machine, f.layer_sizes[L])
        sync.append(read if L in first_touch else 0.0)
        ring.append(read if L in ring_layers else 0.0)
        if L in ring_layers or L in first_touch:
            comp[-1] += machine.bind_s or BIND_CALLS * machine.call_seconds
    return _Costs(comp, eio, sync, ring, over)


def _step_seconds(c: _Costs, ring_slots: int) -> tuple[float, float, float]:
    """(seconds, compute, io) of one step, scheduled as trunk.StreamedTrunk does it: a
    pinned layer's first touch is read synchronously; binding a ring layer asks the one
    reader for the next ring_slots - 1 ring layers, which then overlap compute (the first
    ring layer of a step, and every one with a 1-slot ring, is read while compute waits);
    a layer's expert misses are read before its experts compute.

    All of these reads share ONE device.  A read issued while the reader's prefetch is in
    flight shares the device's rate with it (half each while both run), and every
    prefetch still pending finishes that much later: the device does the same work either
    way, so a step never takes less than its bytes / the device rate.  (Scheduling the
    expert reads and the trunk reader as two independent devices forecast a
    t0.5 + c0.5 step of the mid checkpoint below the device floor of its 1.38 GB:
    docs/forecast.md; test_reads_share_one_device.)  `io` is what the engine's read timers
    add up: each read's own start-to-end, slowed where it shared the device."""
    n = len(c.compute)
    order = [L for L in range(n) if c.ring_read[L] > 0]
    ready: dict[int, float] = {}
    t = dev_free = io = 0.0

    def shared_read(t: float, d: float) -> float:
        """A synchronous read of d device-seconds issued at t: its end time.  It shares
        the device with the prefetch in flight; the reader's pending prefetches finish
        later by what they shared."""
        nonlocal dev_free, io
        if d <= 0:
            return t
        pending = sorted((u for u in ready if ready[u] > t), key=ready.get)
        end = t + d + min(d, max(0.0, dev_free - t))
        if pending:                       # the one in flight runs slower by what it shared
            io += min(d, ready[pending[0]] - t)
        for u in pending:                 # ... and each one after it starts later
            ready[u] += min(d, ready[u] - t)
        dev_free = max(dev_free + min(d, max(0.0, dev_free - t)), end)
        io += end - t
        return end

    for L in range(n):
        t = shared_read(t, c.sync_read[L])
        if c.ring_read[L] > 0:
            if L in ready:
                t = max(t, ready[L])
            else:                                   # not prefetched: read while compute waits
                start = max(t, dev_free)
                dev_free = t = start + c.ring_read[L]
                io += c.ring_read[L]
            j = order.index(L)
            for u in order[j + 1:j + ring_slots]:
                if u not in ready:
                    start = max(t, dev_free)
                    dev_free = ready[u] = start + c.ring_read[u]
                    io += c.ring_read[u]
        t += c.compute[L]
        t = shared_read(t, c.expert_io[L])
    return t, sum(c.compute), io


def in_cache(model: ModelShape, machine: MachineFigures) -> MachineFigures:
    """The figures to price `model`'s matvecs with: the hot ones when the whole model (trunk,
    tables, every expert) fits in half the last-level cache, where it stays between steps
    (the demo: 9 MB in a 300 MiB L3; cold figures charged it 23-41 % too much)."""
    f = model.figures
    size = f.trunk_bytes() + f.table_bytes + f.expert_pool * f.expert_bytes
    h = machine.hot
    if not h or size > h.get("llc_bytes", 0) // 2:
        return machine
    return replace(machine, bf16_bps=h["bf16_bps"], bf16_call_s=h["bf16_call_s"],
                   mxfp4_bps=h["mxfp4_bps"], mxfp4_call_s=h["mxfp4_call_s"])


def forecast(model: ModelShape, machine: MachineFigures, *, preset: str | None = None,
             trunk_gb: float | str | None = None, cache_gb: float | None = None,
             trunk_ring: int = 2, streamed: bool | None = None, prompt_len: int = 16,
             gen: int = 8, hits: HitModel | None = None, available_bytes=0,
             ultra: bool = False, expert_overlap: bool = True,
             baseline_bytes: int | None = None, trace_window: int = 0) -> Forecast:
    """The forecast of an incremental run of `gen` tokens after a `prompt_len` prompt.
    `expert_overlap` models the async per-expert pipeline of SYSTEM §4.5 (expert reads
    behind compute), which this engine runs; False models K3_NO_EXPERT_PIPELINE=1.
    `baseline_bytes` replaces the measured interpreter baseline (the app's holds Qt);
    `trace_window` > 0 counts the session trace a run keeps (the app's What-if window)."""
    hits = hits or UniformRouting()
    hot = in_cache(model, machine)
    cached, machine = hot is not machine, hot
    if not cached:
        machine = machine.at_width(model.shape["hidden"])
    streamed = model.streamed if streamed is None else streamed
    f = model.figures
    positions = prompt_len + gen + 1
    p = plan(f, preset=preset, trunk_gb=trunk_gb, cache_gb=cache_gb, trunk_ring=trunk_ring,
             ultra=ultra, streamed=streamed, incremental=True, positions=positions,
             available_bytes=available_bytes, keep_trace=trace_window > 0,
             trace_window=trace_window,
             baseline_bytes=machine.baseline_bytes if baseline_bytes is None else baseline_bytes)
    tp = p.trunk_plan
    NL = f.n_layers
    unpinned = set(range(NL)) - set(tp.pinned) if tp is not None else set()
    overlap = tp is not None and tp.ring_slots >= 2
    ring = tp.ring_slots if tp is not None else 0
    slots = p.expert_slots
    k, n_moe = f.topk, f.n_moe_layers

    # steady decode
    hit = hits.steady_hit(slots, model)
    misses = k * (1.0 - hit)
    def hide(c: _Costs) -> _Costs:
        """With the §4.5 pipeline a layer waits only for the expert reads that the work
        it can do meanwhile (`overlap`) does not cover."""
        if not expert_overlap:
            return c
        return _Costs(c.compute, [max(0.0, e - a) for a, e in zip(c.overlap, c.expert_io)],
                      c.sync_read, c.ring_read, c.overlap)

    c = _layer_costs(model, machine, 1, misses, unpinned, k, attended=prompt_len + gen // 2)
    head = model.lm_head_bytes / machine.bf16_bps + machine.bf16_call_s
    table_read = model.lm_head_bytes if p.ultra else 0
    if p.ultra:       # lm_head streamed in sequential 4 MiB reads for every position (§5.6)
        head += table_read / machine.read_rate(1) + (table_read >> 22) * machine.read_latency_s
    step, comp, _ = _step_seconds(hide(c), ring)
    io = _step_seconds(c, ring)[2]
    s_tok = step + head

    # prefill: every layer read once (pinned ones on first touch, SYSTEM §3.7), the union
    # of the prompt's experts read once per layer (chunk-union prefill, §4.6), every
    # position computed; logits for the last position only.
    prompt_union = f.n_experts * _seen_fraction(model, prompt_len)
    chunk = moe_chunk_for(p, f, PREFILL_CHUNK)                   # what the run will use
    chunk_union = f.n_experts * _seen_fraction(model, min(prompt_len, chunk))
    cp = _layer_costs(model, machine, prompt_len, prompt_union, unpinned, prompt_len * k,
                      set(tp.pinned) if tp is not None else set(),
                      attended=prompt_len * (prompt_len + 1) / 2,
                      expert_runs=-(-prompt_len // chunk) * chunk_union, chunk=chunk)
    cp.expert_io = [machine.read_latency_s
                    + prompt_union * f.expert_bytes / machine.read_rate(prompt_union)
                    if model.moe[L] else 0.0 for L in range(NL)]
    ttft = _step_seconds(hide(cp), ring)[0] + head

    # the steps of a `gen`-token run, each at the hit rate of what it has seen so far
    wall, decode, decode_io = ttft, [], []
    for t in range(1, gen):
        h = hits.decode_hit(slots, model, prompt_len + t - 1)
        ct = _layer_costs(model, machine, 1, k * (1.0 - h), unpinned, k,
                          attended=prompt_len + t)
        dt, dio = _step_seconds(hide(ct), ring)[0], _step_seconds(ct, ring)[2]
        wall += dt + head
        decode.append(dt + head)
        decode_io.append(dio)
    run_s = wall / gen if gen else ttft

    trunk_read = sum(f.layer_sizes[L] for L in unpinned) + table_read
    expert_read = n_moe * misses * f.expert_bytes
    first = (f.trunk_bytes() if tp is not None else 0) + int(n_moe * prompt_union * f.expert_bytes)

    # RSS: the planner's terms, with the arenas counted as the pages a run touches
    touched = min(slots, hits.distinct(model, prompt_len + gen - 1))
    arena = min(p.expert_cache_bytes, touched * f.expert_slot_bytes)
    trunk_rss = tp.total_bytes if tp is not None else p.trunk_bytes
    rss = (p.total_bytes - p.expert_cache_bytes + arena - p.trunk_bytes + trunk_rss
           + RUN_OVERHEAD_BYTES)

    m = machine
    assumptions = [
        f"peak RSS: the planner's terms ({p.total_bytes / 1e9:.2f} GB planned) with the expert "
        f"arena counted as the {touched} of {slots} slots the run touches"
        + (f" and the trunk as its {tp.n_pinned} pinned layers + {tp.ring_slots}-slot ring"
           if tp is not None else "") + f", plus a measured {p.baseline_bytes / 1e6:.0f} MB "
        f"process baseline and {RUN_OVERHEAD_BYTES / 1e6:.0f} MB of run overhead (index, "
        f"threads; fitted on the demo model)",
        f"expert hit rate: {hits.description}",
        f"device read: {m.read_rate(16) / 1e9:.2f} GB/s at 16 in flight, "
        f"{m.read_rate(1) / 1e9:.2f} GB/s at 1, {m.read_latency_s * 1e3:.2f} ms per read "
        f"({'O_DIRECT' if m.direct else 'buffered'}, {READ_BLOCK >> 20} MiB and "
        f"{SMALL_BLOCK >> 10} KiB random reads"
        + (f"; trunk layers at {m.trunk_read_bps / 1e9:.2f} GB/s, {TRUNK_BLOCK >> 20} MiB "
           f"reads {TRUNK_IO_THREADS} in flight" if m.trunk_read_bps else "")
        + f"; {m.source})",
        f"compute: BF16 matvec {m.bf16_bps / 1e9:.2f} GB/s"
        + (f" (rows {model.shape['hidden']} wide)" if m.bf16_width_bps and not cached else "")
        + f" + {m.bf16_call_s * 1e6:.0f} us/call, "
        f"MXFP4 experts {m.mxfp4_bps / 1e9:.2f} GB/s + {m.mxfp4_call_s * 1e6:.0f} us per "
        f"batch at "
        f"{m.threads} thread(s)"
        + (f"; a prefill's BF16 {m.bf16_rate(PREFILL_PROBE_TOKENS) / 1e9:.1f} GB/s and "
           f"experts {m.mxfp4_rate(EXPERT_PROBE_TOKENS) / 1e9:.1f} GB/s per position"
           if m.bf16_prefill_bps or m.mxfp4_prefill_bps else "")
        + (f", weights in the last-level cache (the whole model fits in half its "
           f"{m.hot['llc_bytes'] >> 20} MiB)" if cached else ", weights streamed from memory")
        + (f"; per streamed layer bind {m.bind_s * 1e3:.3f} ms on the main thread (the demo "
           f"model's decode, measured here)" if m.bind_s else
           f"; per streamed bind the cost of {BIND_CALLS} tiny kernel calls "
           f"({m.call_seconds * 1e6:.1f} us each, fitted)") + f" ({m.source}"
        + (f"; other processes used {100 * m.other_load:.0f}% of the CPUs while it was "
           f"measured" if m.other_load is not None else "") + ")",
        _small_assumption(model, m),
        f"trunk: a pinned layer read once on first touch (step 0), ring layers prefetched "
        f"{ring - 1} ahead by one reader in {TRUNK_CHUNK >> 20} MiB chunks, the first ring "
        f"layer of each step waited for" if overlap else
        ("the trunk is resident: nothing streamed" if tp is None else
         "ring of 1 slot: trunk reads do not overlap compute"),
        "a layer's expert reads overlap its latent down-projection, shared expert and the "
        "experts that hit (the §4.5 pipeline)" if expert_overlap else
        "expert misses read before the layer's experts compute (K3_NO_EXPERT_PIPELINE=1)",
        f"prefill: {prompt_len} positions computed, the whole trunk read once, "
        f"{prompt_union:.1f} distinct experts per layer read once (each {chunk}-"
        f"position chunk runs its own union), MLA over the prompt's {prompt_len * (prompt_len + 1) // 2} "
        f"(query, key) pairs",
        "the machine is assumed otherwise idle; other load slows compute and I/O",
    ] + (["ultra: lm_head streamed (read once per token, counted with the trunk's reads)"]
         if p.ultra else [])
    return Forecast(model.name, p, s_tok, ttft, run_s, int(rss), p.total_bytes,
                    int(trunk_read + expert_read), trunk_read, expert_read, first, hit,
                    comp + head, io, prompt_len, gen, assumptions,
                    {"source": m.source, "read_gbs_qd16": round(m.read_rate(16) / 1e9, 3),
                     "bf16_gbs": round(m.bf16_bps / 1e9, 3),
                     "mxfp4_gbs": round(m.mxfp4_bps / 1e9, 3), "threads": m.threads},
                    decode_s_run=float(np.median(decode)) if decode else s_tok,
                    decode_compute_s=comp + head,
                    decode_io_s=float(np.median(decode_io)) if decode_io else io)


def _small_assumption(model: ModelShape, m: MachineFigures) -> str:
    if not model.work:
        return "the layers' small kernels and the engine's Python around them: not counted"
    if not m.small_s or not m.glue_call_s:
        return ("the layers' small kernels and the engine's Python around them: not "
                "measured on this machine (figures from an older calibration; --refresh)")
    calls = sum(w.calls_fixed + w.calls_per_chunk for w in model.work)
    per = ", ".join(f"{k} {v * 1e9:.2g}" for k, v in m.small_s.items())
    return (f"small kernels counted per layer from the config (router, SiTU, KDA state, "
            f"conv, gates, AttnRes, MLA over the context), ns per element measured here: "
            f"{per}; the engine's Python around its {calls} kernel calls per decode token at "
            f"{m.glue_call_s * 1e6:.1f} us per call (the shipped demo model's decode, "
            f"measured here)")


def splits(model: ModelShape, machine: MachineFigures, total_gb: float, steps: int = 12,
           **kw) -> list[tuple[float, float, Forecast]]:
    """(trunk GB, cache GB, forecast) for splits of the same total, from a trunk of one
    ring slot's worth to nearly all of it (the what-if view's table)."""
    f = model.figures
    lo = min(total_gb * 0.9, (max(f.layer_sizes) + f.widen_bytes) * 1e-9 * 1.05)
    min_cache = (f.topk + 1) * f.expert_slot_bytes * 1e-9
    hi = max(lo, total_gb - min_cache)
    out = []
    for i in range(steps):
        t = lo + (hi - lo) * i / max(steps - 1, 1)
        t, cgb = round(t, 3), round(total_gb - t, 3)
        out.append((t, cgb, forecast(model, machine, trunk_gb=t, cache_gb=cgb, **kw)))
    return out
