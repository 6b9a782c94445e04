"""The machine's measured figures (read rates, kernel rates, the process baseline) and their
cache file, keyed by the machine's identity.  Measured by calibrate.measure_machine; read
here by whoever prices a read or a step (the forecast, the compressed trunk's choice), so
reading them needs nothing above the formats."""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field, replace

from . import __version__
from .kernels import PANEL_MIN_TOKENS   # from here a BF16 matvec runs through the panels
from .threads import default_threads

CACHE_NAME = "machine-figures.json"
CALIBRATION_VERSION = 11         # bump when what is measured changes (old entries ignored)
READ_DEPTHS = (1, 4, 16)
EXPERT_PROBE_TOKENS = 4          # tokens per expert of the prefill expert probe


# ---- the figures -----------------------------------------------------------------------

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
    path = path or cache_file()
    key = identity_key(machine_identity(device_dir, threads or default_threads()))
    entry = _read_cache(path).get(key)
    if entry is None:
        return None
    try:
        return MachineFigures.from_json(entry, f"cache {path}")
    except (KeyError, TypeError, ValueError):
        return None                              # damaged entry: as if absent
