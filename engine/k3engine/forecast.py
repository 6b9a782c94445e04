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
RSS: only the pages a run touches.  Everything here is arithmetic; measuring the machine is calibrate.py's.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from .diskio import align_up
from .memory import ModelFigures, Plan, moe_chunk_for, plan
from .units import human
from .model import PREFILL_CHUNK
from .trunk import IO_THREADS as TRUNK_IO_THREADS   # a layer's reads run on this many threads
from .machine import (EXPERT_PROBE_TOKENS, MachineFigures, cache_file,  # noqa: F401
                      cached_machine_figures, identity_key, machine_identity)
# the machine's measurement (calibrate.py); the forecast re-exports what its callers use
from .calibrate import (BIND_CALLS, PREFILL_PROBE_TOKENS, READ_BLOCK, SMALL_BLOCK,  # noqa: F401
                        SMALL_KINDS, TRUNK_BLOCK, _cpu_busy, machine_figures, measure_machine)

__all__ = [
    "MachineFigures", "machine_identity", "machine_figures", "cached_machine_figures",
    "measure_machine",
    "cache_file", "ModelShape", "released_k3", "local_model", "shape_from", "RELEASED_K3_CONFIG",
    "HitModel", "UniformRouting", "TraceRouting", "Forecast", "forecast", "splits",
]

# What a run holds beyond the import baseline and the planner's terms: the shard index,
# reader threads' stacks, per-step temporaries.  Fitted, not derived: peak RSS less the
# planner's terms and the baseline, on the demo model's runs here (docs/forecast.md): 4.5-6.5
# MB (median 6.1) for the retrained 9 MB demo at five plans; 11 MB was the older 26 MB
# demo's, which put the new demo's forecast 9-13 % above its measured peak.
RUN_OVERHEAD_BYTES = 6 * 10**6

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
    from .loading import open_model, read_config
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
    batch: int = 1                  # sequences decoded together (forecast(batch=...))
    batch_step_s: float = 0.0       # one step of them all
    batch_tokens_per_s: float = 0.0  # generated tokens per second, all sequences
    batch_bytes_per_token: float = 0.0
    lookahead: dict = field(default_factory=dict)   # forecast(lookahead_recall=...)
    block: dict = field(default_factory=dict)       # forecast(accept=...): block drafting

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
            **({"batch": self.batch, "batch_step_s": round(self.batch_step_s, 4),
                "batch_tokens_per_s": round(self.batch_tokens_per_s, 4),
                "batch_bytes_per_token": int(self.batch_bytes_per_token)}
               if self.batch > 1 else {}),
            **({"lookahead": self.lookahead} if self.lookahead else {}),
            **({"block_drafting": self.block} if self.block else {}),
            "plan": {"preset": p.preset, "trunk_gb": p.trunk_gb, "cache_gb": p.cache_gb,
                     "streamed": p.streamed, "pinned_layers": tp.n_pinned if tp else p.layers,
                     "layers": p.layers, "ring_slots": tp.ring_slots if tp else 0,
                     "expert_slots": p.expert_slots, "refused": bool(p.refusals)},
            "machine": self.machine, "assumptions": list(self.assumptions)}


TRUNK_CHUNK = 64 << 20           # the trunk reads a layer in parallel 64 MiB chunks (§2.5)
DRAFT_BLOCK = 16                 # positions a block drafter's pass proposes and the target
                                 # verifies (DFlash's published drafters: "-b16")
PUBLISHED_ACCEPTANCE = (2.5, 6.5)   # drafts accepted a pass by the published DFlash
                                    # drafters: Kimi K2.7 on code, Kimi K3 (issue 48)
ASSUMED_RECALL = 0.75            # lookahead's guess on K3: colibri measured 74-77 % recall
                                 # (issue 48); mid measures 0.99, the demo 0.76-0.83


@dataclass
class _Costs:
    compute: list        # per layer seconds (matvecs + experts + small kernels)
    expert_io: list      # per layer seconds of expert misses (batch read, synchronous)
    sync_read: list      # per layer seconds of a synchronous read (a pinned layer's first touch)
    ring_read: list      # per layer seconds of a read through the ring (prefetchable)
    overlap: list = field(default_factory=list)   # per layer compute that runs while its
                                                  # expert reads are in flight (§4.5)
    early: list = field(default_factory=list)     # per layer lookahead reads issued at its
                                                  # start (device seconds; lookahead.py)


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
                 expert_runs: float | None = None, chunk: int = PREFILL_CHUNK,
                 recall: float | None = None) -> _Costs:
    """Seconds per layer for one engine step over `positions` new positions, attending to
    `attended` (query, key) position pairs in all (decode: the context length), with
    `expert_runs` expert invocations per MoE layer (decode: topk; a prefill: the union of
    each chunk's experts, summed over its chunks of `chunk` positions).  `recall`: lookahead
    reads (lookahead.py) with a guess naming that share of the routed experts: the guess's
    misses (as many as the real ones) are read at the layer's start, and only the real
    misses it did not name are read after the router."""
    f = model.figures
    eb = f.expert_bytes
    attended = positions if attended is None else attended
    runs = min(expert_tokens, f.n_experts) if expert_runs is None else expert_runs
    chunks = -(-positions // chunk)
    bf16_rate = machine.bf16_rate(positions)
    mxfp4_rate = machine.mxfp4_rate(expert_tokens / max(runs, 1))
    comp, eio, sync, ring, over, early = [], [], [], [], [], []

    def read_s(n: float) -> float:
        return machine.read_latency_s + n * eb / machine.read_rate(n) if n > 0 else 0.0

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
            late = misses_per_layer if recall is None else misses_per_layer * (1.0 - recall)
            e = read_s(late)
            early.append(read_s(misses_per_layer) if recall is not None else 0.0)
        else:
            early.append(0.0)
        comp.append(c)
        eio.append(e)
        over.append(o)
        read = _trunk_read_s(machine, f.layer_sizes[L])
        sync.append(read if L in first_touch else 0.0)
        ring.append(read if L in ring_layers else 0.0)
        if L in ring_layers or L in first_touch:
            comp[-1] += machine.bind_s or BIND_CALLS * machine.call_seconds
    return _Costs(comp, eio, sync, ring, over, early)


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

    early = c.early or [0.0] * n
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
        # lookahead reads start with the layer and share the device with everything after;
        # the layer ends when its compute, its late reads and its early reads are done
        landed = shared_read(t, early[L])
        t += c.compute[L]
        t = max(shared_read(t, c.expert_io[L]), landed)
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
             baseline_bytes: int | None = None, trace_window: int = 0,
             batch: int = 1, lookahead_recall: float | None = None,
             accept: float | None = None, block: int = DRAFT_BLOCK) -> Forecast:
    """The forecast of an incremental run of `gen` tokens after a `prompt_len` prompt.
    `batch` > 1 also prices a step of `batch` sequences decoded together
    (generate.decode_many): the trunk read once, the union of their experts read once.
    `lookahead_recall` also prices lookahead expert reads (lookahead.py) whose guess names
    that share of a layer's routed experts: bytes read early (overlapped) and wasted.
    `accept` also prices block drafting: a verification pass over `block` positions (the
    trunk once, the union of their experts) yields `accept` accepted drafts + 1 tokens.
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
    positions = batch * (prompt_len + gen + 1)              # every sequence's KV cache
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
                      c.sync_read, c.ring_read, c.overlap, c.early)

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
    def rows_step(rows: int) -> tuple[float, float, float]:
        """(expert union per MoE layer, seconds, bytes read) of one step over `rows`
        positions (a batch's sequences, or a block verified in one pass): the trunk bound
        once, each layer's union of rows x topk routes read once at the steady hit rate,
        lm_head over every row."""
        union = f.n_experts * _seen_fraction(model, rows)
        cb = _layer_costs(model, machine, rows, union * (1.0 - hit), unpinned, k * rows,
                          attended=rows * (prompt_len + gen // 2), expert_runs=union)
        head_b = rows * model.lm_head_bytes / machine.bf16_rate(rows) + \
            machine.bf16_call_s + (head - model.lm_head_bytes / machine.bf16_bps
                                   - machine.bf16_call_s)
        return (union, _step_seconds(hide(cb), ring)[0] + head_b,
                trunk_read + n_moe * union * (1.0 - hit) * f.expert_bytes)

    if batch > 1:
        union, step_b, read_b = rows_step(batch)
        batched = dict(batch=batch, batch_step_s=step_b, batch_tokens_per_s=batch / step_b,
                       batch_bytes_per_token=read_b / batch)
        assumptions.append(
            f"batch of {batch}: one step reads the trunk once for all, and per MoE layer the "
            f"union of their experts ({union:.1f} distinct of {f.n_experts} for "
            f"{batch} x top-{k} routes, as the prefill's union) at the steady hit rate")
    else:
        batched = {}
    ahead = {}
    if lookahead_recall is not None:
        # the guess names recall x the routed experts; its misses (as many as the real
        # ones) are read at the layer's start, so recall x misses are read early and used,
        # the rest of the guess's reads are wasted, and the real misses it did not name are
        # read after the router as before
        r = min(max(float(lookahead_recall), 0.0), 1.0)
        cl = _layer_costs(model, machine, 1, misses, unpinned, k,
                          attended=prompt_len + gen // 2, recall=r)
        per = n_moe * misses * f.expert_bytes
        ahead = dict(recall=r, s_per_token=round(_step_seconds(hide(cl), ring)[0] + head, 4),
                     s_per_token_without=round(s_tok, 4),
                     overlapped_bytes_per_token=int(r * per),
                     wasted_bytes_per_token=int((1.0 - r) * per),
                     bytes_read_per_token=int(trunk_read + expert_read + (1.0 - r) * per))
        assumptions.append(
            f"lookahead: a guess naming {100 * r:.0f}% of each layer's routed experts, its "
            f"{misses:.1f} misses a layer read from the layer's start; "
            f"{human(r * per)} a token read early and used, {human((1 - r) * per)} "
            f"wasted (read for a wrong guess, on the same device)")
    drafting = {}
    if accept is not None:
        union, pass_s, read_p = rows_step(block)
        per_pass = float(accept) + 1.0          # the accepted drafts and the target's own
        drafting = dict(accept=float(accept), block=block, tokens_per_pass=per_pass,
                        pass_s=round(pass_s, 4), s_per_token=round(pass_s / per_pass, 4),
                        bytes_per_token=int(read_p / per_pass),
                        trunk_bytes_per_token=int(trunk_read / per_pass),
                        expert_union=round(union, 1))
        assumptions.append(
            f"block drafting: a verification pass over {block} positions reads the trunk "
            f"once and per MoE layer the union of their experts ({union:.1f} distinct of "
            f"{f.n_experts}, as a batch's union) at the steady hit rate, and yields "
            f"{accept:g} accepted drafts + 1 = {per_pass:g} tokens; the drafter's own pass "
            f"is not counted (a few resident layers)")
    return Forecast(model.name, p, s_tok, ttft, run_s, int(rss), p.total_bytes,
                    int(trunk_read + expert_read), trunk_read, expert_read, first, hit,
                    comp + head, io, prompt_len, gen, assumptions,
                    {"source": m.source, "read_gbs_qd16": round(m.read_rate(16) / 1e9, 3),
                     "bf16_gbs": round(m.bf16_bps / 1e9, 3),
                     "mxfp4_gbs": round(m.mxfp4_bps / 1e9, 3), "threads": m.threads},
                    decode_s_run=float(np.median(decode)) if decode else s_tok,
                    decode_compute_s=comp + head,
                    decode_io_s=float(np.median(decode_io)) if decode_io else io,
                    lookahead=ahead, block=drafting, **batched)


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
