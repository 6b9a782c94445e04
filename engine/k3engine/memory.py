"""Memory planning (SYSTEM §5, §3.2, §4.1, §7.1): presets, the auto budget, the trunk's
pinned set and ring, and the whole-run plan with its two refusals.

Pure arithmetic on plain numbers: the GUI calls `plan()` live while sliders move, so
nothing here reads a file, the clock or the environment.  What the machine can hand out
comes from memprobe.py (the only I/O behind a plan); figures read as units.py writes them.

The plan is a forecast and overstates on purpose (budgets round down to whole slots); the
authoritative figure is peak RSS measured afterwards (§5.5).  Units are decimal: GB = 1e9.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from .diskio import ALIGN, align_up
from .errors import EngineError
# what the plan's callers also need: the formatter and the probe (units.py, memprobe.py)
from .memprobe import MemProbe, available_memory, probe_memory  # noqa: F401
from .units import human, human_seconds  # noqa: F401

__all__ = [
    "human", "Preset", "PRESETS", "PRESET_NAMES", "AUTO", "list_presets_text",
    "ModelFigures", "reference_layer_scratch", "default_widen_bytes", "kv_check_constant",
    "TrunkPlan", "plan_trunk", "clamp_ring",
    "BudgetError", "AutoBudget", "auto_budget", "Budgets", "resolve_budgets",
    "Refusal", "KvCheck", "kv_check", "Plan", "plan",
    "MemProbe", "available_memory", "probe_memory",
    "ADMIT", "KV_ADMIT", "KV_CHECK_BYTES_K3", "KV_EXACT_BYTES_K3",
    "DEFAULT_TRUNK_GB", "DEFAULT_CACHE_GB", "RING_MAX", "AUTO_SEQUENCES", "most_sequences",
]

# --- constants of the reference (§0 table, §5) ------------------------------------------

ADMIT = 0.95                 # whole plan may use at most this share of available memory
KV_ADMIT = 0.90              # the early KV check refuses above this share
DEFAULT_TRUNK_GB = 16.0      # budgets when no preset/budget flag is given (§5.2)
DEFAULT_CACHE_GB = 64.0
DEFAULT_DRAFT_TRUNK_GB = 6.0  # --draft-trunk-gb
AUTO_SEQUENCES = 4           # DESIGN: k3 serve's default slots are what the plan admits, <= 4
RING_DEFAULT = 2             # --trunk-ring
RING_MAX = 8
PIN_PASSES = 8               # §3.2 fixed-point iteration bound
ULTRA_STREAM_BYTES = (4 << 20) + 2 * ALIGN   # ultra's one widened read buffer (§5.6)
KV_EXACT_BYTES_K3 = 2_365_440     # 24 x (96 x 256 + 64) x 4
KV_CHECK_BYTES_K3 = 2_370_000     # the rounded constant the reference's early check uses

# auto (§5.3), in GB: reserve = fixed + (1 - ADMIT) x available
AUTO_FIXED_RESERVE_GB = 2.0 + 4.70 + 1.70   # buffers/KV slack + embed/lm_head + state/index
AUTO_SLOT_MIN_GB = 2.5       # one ring slot + headroom
AUTO_CACHE_MIN_GB = 0.5      # topk + 1 expert slots is ~0.3 GB
AUTO_TRUNK_FULL_GB = 111.0   # the whole packed trunk + widen headroom
AUTO_PIN_CEILING = 0.55      # of MemTotal: heavy partial pinning measured slower (§5.3)



# --- presets (§5.2) ---------------------------------------------------------------------

@dataclass(frozen=True)
class Preset:
    name: str
    trunk_gb: float
    cache_gb: float
    ultra: bool
    note: str


# A preset sets only the two budgets (and ultra).  Trunk before cache: a GB of trunk removes
# ~1.17 GB/token of certain reads, a GB of cache nothing measurable below ~36 GB (§5.2).
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("ultra", 2.5, 0.31, True,
           "~3 GB planned: streamed model tables, one state slot. Slow."),
    Preset("laptop", 3.0, 1.0, False, "8.2 GB peak RSS. The ordinary-path floor."),
    Preset("desktop", 16.0, 10.0, False, "31.9 GB peak RSS."),
    Preset("workstation", 60.0, 30.0, False,
           "95.5 GB peak RSS; the expert cache starts to matter here."),
    Preset("server", 110.0, 13.0, False,
           "~128 GB peak RSS; 90 of 93 trunk layers pinned. Fastest."),
    Preset("max", 110.0, 109.0, False,
           "~224 GB peak RSS; trunk pinned and a large expert cache."),
)}
AUTO = "auto"
PRESET_NAMES = (AUTO,) + tuple(PRESETS)


def list_presets_text() -> str:
    """What `--list-presets` prints (stdout, exit 0), ending in a newline."""
    out = ["presets (trunk / expert-cache, in GB):"]
    for p in PRESETS.values():
        out.append("  %-12s %6.2f / %-6.2f  %s" % (p.name, p.trunk_gb, p.cache_gb, p.note))
    out.append("  %-12s %6s / %-6s  %s" % (
        AUTO, "fit", "fit", "sizes both from this machine's free RAM, trunk-first. Recommended."))
    out += ["", "All presets stream the trunk, so they need --trunk <packed_dir>.",
            "Run k3 doctor to see which one this machine fits."]
    return "\n".join(out) + "\n"


# --- the session's expert trace ----------------------------------------------------------

TRACE_PAIR_BYTES = 8                   # one request: int32 layer + int32 expert
# What the app's session trace (the What-if tab's replay) may hold: a window of the latest
# requests, so a long session's trace stays bounded.  4 MiB is 524,288 requests: about 350
# tokens of the released K3 (92 MoE layers x top-16), whole sessions of the demo.  The cap
# also bounds the replay, which is Python (LRU + Belady at 14 sizes): ~2 s per 100,000
# requests at 7 sizes on this 2-core machine under load, so ~20 s for a full window, on the
# panel's task thread.
TRACE_WINDOW_BYTES = 4 << 20


def trace_window(nbytes: int | None = None) -> int:
    """Requests a session-trace window of `nbytes` (default TRACE_WINDOW_BYTES) holds."""
    return (TRACE_WINDOW_BYTES if nbytes is None else int(nbytes)) // TRACE_PAIR_BYTES


# --- the model's figures ----------------------------------------------------------------

@dataclass(frozen=True)
class ModelFigures:
    """Every size the plan needs, in bytes (or floats where the engine counts floats).

    `layer_sizes` are the packed runs the trunk reads (trunk.json `nbytes`); for a resident
    trunk pass the bytes the binder keeps per layer instead.  `scratch_base` and
    `scratch_subs` describe the per-layer scratch in floats as (per position, fixed) pairs:
    scratch(T) = base(T) + max(sub(T) for sub in subs) -- the shape of the reference's
    k3_layer_scratch; model.py may substitute its own figures with dataclasses.replace.
    """

    layer_sizes: tuple[int, ...]
    expert_bytes: int                 # one routed expert, from the checkpoint (§4.1 probe)
    n_experts: int                    # routed experts per MoE layer
    n_moe_layers: int
    topk: int
    hidden: int
    vocab: int
    n_layers: int                     # config layers (NL default)
    n_mla: int                        # MLA layers of the config (KV cache)
    table_bytes: int                  # embed + lm_head as stored (BF16: 2 x vocab x E x 2)
    final_norm_bytes: int             # norm + output aggregator pair, widened: 3 x E x 4
    state_floats_per_layer: int       # kper = H d d + 3 H d (conv_k - 1)
    kv_bytes_per_position: int        # exact: n_mla x (H (nope + v) + rope) x 4
    kv_check_bytes_per_position: int  # the early check's rounded figure (kv_check_constant)
    max_blocks: int                   # n_layers // attn_res_block + 2
    widen_bytes: int                  # W of §3.2: per-layer room the binder widens into
    scratch_base: tuple[int, int] = (0, 0)
    scratch_subs: tuple[tuple[int, int], ...] = ()
    sweep_log_floats: int = 0         # per position fed in a speculative sweep: the logged
                                      # recurrent inputs of every KDA layer (7 P + H each)
    stream_scratch_bytes: int = 0     # the compressed trunk's decode scratch, one per trunk
                                      # reader thread (trunk_compress), when it may be read
    moe_chunk_position_bytes: int = 0  # a prefill MoE chunk's temporaries per position
                                       # (moe_chunk_for)

    def trace_bytes(self, positions: int, keep_pairs: bool, window: int = 0) -> int:
        """The expert request trace kept for the whole run (--dump-cache-trace): every
        request as an int32 (layer, expert) pair, topk per MoE layer for every position fed
        (experts.RequestTrace).  With a `window` (the app's session trace, which outlives
        any one run's positions) the ring of the latest `window` requests, allocated whole.
        Without either only the running per-(layer, expert) counts are kept: a fixed
        layers x experts x 8 bytes (437 KB on K3), below what the plan resolves, so the
        reference's printed figures stay as they are."""
        if not keep_pairs:
            return 0
        if window:
            return TRACE_PAIR_BYTES * int(window)
        return TRACE_PAIR_BYTES * self.n_moe_layers * self.topk * positions

    @classmethod
    def for_config(cls, cfg, layer_sizes: Sequence[int], expert_bytes: int,
                   table_bytes: int | None = None, widen_bytes: int | None = None
                   ) -> "ModelFigures":
        """Figures for a `k3engine.config.ModelConfig`.  `table_bytes` is embed + lm_head
        as the checkpoint stores them (None: BF16 arithmetic); `widen_bytes` None takes
        `default_widen_bytes(cfg)`."""
        E = cfg.hidden
        P = cfg.kda_heads * cfg.kda_head_dim
        kv_exact = len(cfg.mla_layers) * (cfg.n_heads * (cfg.qk_nope + cfg.v_head)
                                          + cfg.qk_rope) * 4
        base, subs = reference_layer_scratch(cfg)
        return cls(
            layer_sizes=tuple(int(s) for s in layer_sizes),
            expert_bytes=int(expert_bytes),
            n_experts=cfg.n_experts,
            n_moe_layers=cfg.n_layers - min(cfg.first_dense, cfg.n_layers),
            topk=cfg.topk, hidden=E, vocab=cfg.vocab, n_layers=cfg.n_layers,
            n_mla=len(cfg.mla_layers),
            table_bytes=int(2 * cfg.vocab * E * 2 if table_bytes is None else table_bytes),
            final_norm_bytes=3 * E * 4,
            state_floats_per_layer=P * cfg.kda_head_dim + 3 * P * (cfg.conv_k - 1),
            kv_bytes_per_position=kv_exact,
            kv_check_bytes_per_position=kv_check_constant(kv_exact),
            max_blocks=cfg.n_layers // cfg.attn_res_block + 2,
            widen_bytes=int(default_widen_bytes(cfg) if widen_bytes is None else widen_bytes),
            scratch_base=base, scratch_subs=subs,
            moe_chunk_position_bytes=moe_chunk_position_bytes(cfg),
            sweep_log_floats=(cfg.n_layers - len(cfg.mla_layers)) * (7 * P + cfg.kda_heads))

    # -- derived sizes --------------------------------------------------------------------

    @property
    def expert_slot_bytes(self) -> int:
        """§4.1: room for the widened O_DIRECT window, a multiple of 4096."""
        return align_up(self.expert_bytes + 2 * ALIGN)

    def expert_slots(self, cache_gb: float) -> int:
        """Slots a budget buys; never more than the whole expert pool (a budget larger
        than the pool is not allocated on a small model)."""
        return min(max(0, int(cache_gb * 1e9)) // self.expert_slot_bytes, self.expert_pool)

    @property
    def expert_pool(self) -> int:
        return self.n_moe_layers * self.n_experts

    def trunk_bytes(self, layers: int | None = None) -> int:
        return sum(self.layer_sizes[:self.n_layers if layers is None else layers])

    def model_table_bytes(self, ultra: bool) -> int:
        """Resident embed + lm_head + final norms; ultra streams the tables through one
        4 MiB + 8 KiB buffer and keeps only the norms (§5.5 w_model)."""
        return (ULTRA_STREAM_BYTES if ultra else self.table_bytes) + self.final_norm_bytes

    def state_bytes(self, layers: int, ultra: bool, incremental: bool) -> int:
        """Full recompute in ultra clears and reuses one slot (a layer's state is dead once
        it returns); incremental carries every layer's."""
        slots = 1 if ultra and not incremental else layers
        return self.state_floats_per_layer * slots * 4

    def scratch_floats(self, positions: int) -> int:
        T = positions
        sub = max((a * T + b for a, b in self.scratch_subs), default=0)
        return self.scratch_base[0] * T + self.scratch_base[1] + sub

    def buffer_bytes(self, positions: int) -> int:
        """h, the AttnRes block stack, layer scratch and one logits row (§5.1)."""
        T, E = positions, self.hidden
        return (T * E + T * self.max_blocks * E + self.scratch_floats(T) + self.vocab) * 4

    def kv_bytes(self, positions: int) -> int:
        return positions * self.kv_bytes_per_position

    def speculation_bytes(self, layers: int, sweep: int) -> int:
        """What a speculative sweep of `sweep` positions holds besides the model: the
        recurrent-state snapshot it may restore, the logged recurrent inputs that let it
        keep an accepted prefix, and one logits row per position."""
        return (self.state_bytes(layers, False, True)
                + sweep * (self.sweep_log_floats + self.vocab) * 4)


def moe_chunk_position_bytes(cfg) -> int:
    """What one position of a prefill MoE chunk holds while the chunk runs (model.
    _routed_aggregate and kernels.moe_experts): its latent input zl (float32), and per
    selected expert its output row d_SL (float32), its input widened to double and its
    hidden row as double + gate + up (float32).  ~1.5 MB on K3 (16 x (3584 x 12 + 3072 x
    16) + 3584 x 4 bytes): 94 MB for SYSTEM's 64-position chunk."""
    return cfg.topk * (cfg.latent * 12 + cfg.moe_inter * 16) + cfg.latent * 4


MOE_CHUNKS = (256, 128)       # tried largest first above model.PREFILL_CHUNK
MOE_CHUNK_SLACK_SHARE = 0.5   # of what admission leaves free, at most this for the chunk


def moe_chunk_for(plan: "Plan | None", figures: ModelFigures, base: int) -> int:
    """The prefill's positions per expert union.  `base` is SYSTEM §4.6's 64 (model.
    PREFILL_CHUNK): what the plan's buffers assume (the reference's per-token scratch does
    not count the chunk at all).  A larger chunk reads each expert once for more positions
    (K3's 896 experts get ~1.1 tokens each per 64 positions: a cache too small for the
    prompt's union re-reads ~610 experts per layer every 64 positions) and gives the expert
    tiles more tokens.  It is taken only when its extra temporaries fit in half of what
    admission leaves free (0.95 x available - TOTAL), so the run stays below admission's
    limit with half of that room to spare.  The bits are the same at every chunk
    (tests/test_gates.py).

    Only with a resident trunk: after a 256-chunk prefill on a streamed budget, mid's
    decode steps read the same bytes more slowly (median of 6 pairs 0.938 -> 1.069 s,
    only the chunk differing; docs/benchmarks-engine.md), which costs a chat more than
    the faster prefill saves.  The native reader threads did not change that (3 pairs,
    0.812 -> 1.046 s: not a GIL stall).  Resident decode did not move beyond the noise."""
    if plan is None or plan.streamed or not plan.available_known or not plan.admitted:
        return base
    free = (plan.limit_bytes - plan.total_bytes) * MOE_CHUNK_SLACK_SHARE
    per = figures.moe_chunk_position_bytes
    for chunk in MOE_CHUNKS:
        if chunk > base and 0 < (chunk - base) * per <= free:     # 0: not known, keep base
            return chunk
    return base


def kv_check_constant(kv_exact: int) -> int:
    """The early KV check's per-position figure.  The reference uses 2,370,000 B for K3's
    exact 2,365,440 B (rounded up to the 0.01 MB it prints).  For any other model the
    same ratio is applied and rounded up, so K3 gets exactly 2,370,000 and a small model
    is not overstated by a fixed 10 KB step."""
    return -(-kv_exact * KV_CHECK_BYTES_K3 // KV_EXACT_BYTES_K3)


def default_widen_bytes(cfg) -> int:
    """W for the Python binder: every small vector of the widest layer kind widened to
    float32, plus one page.  An upper bound (F32 tensors may be bound as views); the
    R10 engine's 26 MB came from also widening the router gate, which this binder keeps
    in BF16 (§3.2)."""
    E, P = cfg.hidden, cfg.kda_heads * cfg.kda_head_dim
    D = cfg.kda_head_dim
    common = 6 * E + cfg.n_experts + cfg.latent   # norms + aggregators, router bias, latent norm
    kda = 3 * P * cfg.conv_k + P + D + D          # conv taps, dt_bias, A_log (D on disk), o_norm
    mla = cfg.q_lora + cfg.kv_lora                # q_a / kv_a layernorms
    return (common + max(kda, mla)) * 4 + ALIGN


def reference_layer_scratch(cfg) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
    """The reference's k3_layer_scratch as (per position, fixed) float pairs: a base of
    prefix/tmp/input rows, fold vectors, the AttnRes source stack and the dense gate|up
    row, plus the largest of the MLA, KDA and MoE sub-blocks."""
    E = cfg.hidden
    maxb = cfg.n_layers // cfg.attn_res_block + 2
    base = (3 * E, 2 * E + maxb * E + 2 * cfg.dense_inter)
    H, qh, vh = cfg.n_heads, cfg.qk_nope + cfg.qk_rope, cfg.v_head
    kvd = cfg.qk_nope + vh
    mla = (H * qh + H * kvd + cfg.qk_rope + 1,                    # q, k|v, rope, scores
           cfg.kv_lora + cfg.qk_rope + cfg.q_lora + 2 * H * vh)
    P = cfg.kda_heads * cfg.kda_head_dim
    kda = (6 * P + cfg.kda_heads, 2 * P + cfg.kda_head_dim)
    SI = cfg.moe_inter * cfg.n_shared
    moe = (0, 3 * cfg.latent + 3 * cfg.moe_inter + 3 * SI + E)
    return base, (mla, kda, moe)


# --- the trunk: pinned set and ring (§3.2) ----------------------------------------------

@dataclass(frozen=True)
class TrunkPlan:
    """Which layers stay pinned and how deep the ring is, for one budget."""

    pinned: tuple[int, ...]       # sorted layer indices
    ring_slots: int               # R actually granted
    ring_want: int                # R asked for, after the 1..8 clamp
    slot_bytes: int               # one uniform ring slot
    pinned_bytes: int             # sum of the pinned layers' own allocations
    budget_bytes: int
    widen_bytes: int
    n_layers: int
    prefix: bool                  # K3_PIN_PREFIX rule
    passes: int                   # fixed-point passes taken (<= 8)
    largest_bytes: int            # the biggest layer run
    largest_unpinned_bytes: int   # what the ring slot is sized for (0 if all pinned)
    packed_bytes: int             # all runs together (the packed trunk's size)

    @property
    def n_pinned(self) -> int:
        return len(self.pinned)

    @property
    def ring_bytes(self) -> int:
        return self.ring_slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.ring_bytes + self.pinned_bytes

    @property
    def ring_held(self) -> bool:
        """The budget could not afford the ring depth asked for."""
        return self.ring_slots < self.ring_want

    @property
    def over_budget(self) -> bool:
        """Even one slot exceeds the budget: the ring is the floor, the budget loses."""
        return self.ring_bytes > self.budget_bytes

    @property
    def hit_rate(self) -> float:
        """Deterministic steady-state trunk hit rate: a cyclic scan defeats LRU, so the
        pinned set is the whole story."""
        return self.n_pinned / self.n_layers if self.n_layers else 0.0

    def lines(self, direct: bool = True, chunk_mib: int = 64,
              total_bytes: int | None = None) -> list[str]:
        """The `trunk stream:` block of §3.8 (without the final 'enabled from' line);
        `total_bytes` is the packed trunk's size, which the plan only knows per layer."""
        total = self.packed_bytes if total_bytes is None else total_bytes
        pad = " " * 14
        how = ("nothing" if not self.pinned else
               "as a PREFIX (K3_PIN_PREFIX)" if self.prefix else "LARGEST FIRST")
        out = [
            "trunk stream: %.2f GB packed, %d/%d layers PINNED (%.2f GB), ring %d x %.2f GB"
            % (total / 1e9, self.n_pinned, self.n_layers, self.pinned_bytes / 1e9,
               self.ring_slots, self.slot_bytes / 1e9),
            f"{pad}pinned {how}; the ring slot is sized to the largest UNPINNED layer "
            "(%.2f GB" % (self.largest_unpinned_bytes / 1e9),
            f"{pad}of a %.2f GB maximum)" % (self.largest_bytes / 1e9),
            f"{pad}reads use %s, pread in parallel %d MiB chunks"
            % ("O_DIRECT (page cache bypassed)" if direct else "buffered I/O", chunk_mib),
        ]
        if self.ring_held:
            want = self.ring_want * self.slot_bytes / 1e9
            out.append(f"{pad}ring held at %d slot%s: %d slots need %.2f GB and the trunk "
                       "budget is %.2f GB." % (self.ring_slots,
                                              "" if self.ring_slots == 1 else "s",
                                              self.ring_want, want, self.budget_bytes / 1e9))
            out.append(f"{pad}%s Raise --trunk-gb above %.2f GB for the %d asked for."
                       % ("Reads are NOT overlapped with compute." if self.ring_slots == 1
                          else "Fewer reads stay in flight.", want, self.ring_want))
        out.append(f"{pad}deterministic hit rate %.1f%% (a cyclic scan defeats LRU, so a "
                   "pinned SET is used instead)" % (100.0 * self.hit_rate))
        return out


def clamp_ring(ring_want: int | None) -> int:
    """--trunk-ring: 1..8; 0 or less (or absent) is the default 2, as the reference's
    `ring_want > 0 ? ring_want : 2`."""
    r = RING_DEFAULT if ring_want is None or ring_want <= 0 else int(ring_want)
    return min(r, RING_MAX)


def plan_trunk(layer_sizes: Sequence[int], budget_bytes: int, ring_want: int | None = 2,
               widen_bytes: int = 0, prefix: bool = False) -> TrunkPlan:
    """§3.2: pin layers (largest first, or a prefix with K3_PIN_PREFIX) and size the ring.

    The ring is paid for first, then layers are pinned into what is left; pinning the
    largest layer shrinks the slot (it is sized for the largest layer that still
    streams), which frees budget to pin more, so the two iterate to a fixed point."""
    s = [int(x) for x in layer_sizes]
    n = len(s)
    if n == 0:
        raise ValueError("plan_trunk needs at least one layer size")
    B, W = int(budget_bytes), int(widen_bytes)
    want = clamp_ring(ring_want)
    # largest first, ties by lower index; the prefix rule walks in layer order
    order = list(range(n)) if prefix else sorted(range(n), key=lambda L: (-s[L], L))

    chosen: set[int] = set()
    slot = ring = npin = spent = passes = 0
    for passes in range(1, PIN_PASSES + 1):
        big = max((s[L] for L in range(n) if L not in chosen), default=0)
        if big == 0:
            big = s[n - 1]                                  # all pinned: the last layer
        rs = align_up(align_up(big) + W)
        R = want
        while R > 1 and R * rs > B:                         # the ring must fit first
            R -= 1
        sp = R * rs
        chosen = set()
        for L in order:
            need = align_up(s[L]) + W                       # its own exact allocation
            if sp + need > B:
                if prefix:
                    break                                   # a prefix cannot skip a layer
                continue                                    # keep trying smaller layers
            sp += need
            chosen.add(L)
        done = rs == slot and len(chosen) == npin
        slot, ring, npin, spent = rs, R, len(chosen), sp
        if done:
            break
    unpinned = [s[L] for L in range(n) if L not in chosen]
    return TrunkPlan(pinned=tuple(sorted(chosen)), ring_slots=ring, ring_want=want,
                     slot_bytes=slot, pinned_bytes=spent - ring * slot, budget_bytes=B,
                     widen_bytes=W, n_layers=n, prefix=prefix, passes=passes,
                     largest_bytes=max(s), largest_unpinned_bytes=max(unpinned, default=0),
                     packed_bytes=sum(s))


# --- budgets: presets, flags in argv order, auto (§5.2, §5.3) ----------------------------

class BudgetError(EngineError, ValueError):
    """A budget request that cannot run; `exit_code` is what the CLI exits with."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class AutoBudget:
    available_gb: float
    reserve_gb: float
    trunk_gb: float
    cache_gb: float

    @property
    def line(self) -> str:
        return ("auto budget: %.1f GB available, %.1f GB reserved -> trunk %.1f GB / "
                "expert cache %.1f GB" % (self.available_gb, self.reserve_gb,
                                          self.trunk_gb, self.cache_gb))


def auto_budget(available_bytes: float, total_bytes: float = 0.0,
                detail: str = "") -> AutoBudget:
    """§5.3: size both budgets from available memory, trunk before cache.  Raises
    BudgetError (exit 2) when memory is unknown or below the floor."""
    if available_bytes <= 0:
        raise BudgetError("--preset auto could not read this machine's available memory"
                          + (f" ({detail})" if detail else "")
                          + "; pass explicit --trunk-gb/--cache-gb")
    A = available_bytes / 1e9
    # Fixed costs outside both budgets plus the same headroom admission enforces.
    reserve = AUTO_FIXED_RESERVE_GB + (1.0 - ADMIT) * A
    usable = A - reserve
    floor = AUTO_SLOT_MIN_GB + AUTO_CACHE_MIN_GB
    if usable < floor:
        raise BudgetError("auto: only %.1f GB usable after the %.1f GB reserve; below the "
                          "%.1f GB floor. Pass explicit budgets." % (usable, reserve, floor))
    if usable - AUTO_CACHE_MIN_GB >= AUTO_TRUNK_FULL_GB:
        trunk, cache = AUTO_TRUNK_FULL_GB, usable - AUTO_TRUNK_FULL_GB   # whole trunk resident
    else:
        # Below full residency, pin only while the process stays clear of the RAM
        # ceiling: 51 of 109 GB pinned at ~90 % RAM ran slower than pinning nothing.
        ceiling = AUTO_PIN_CEILING * total_bytes / 1e9 if total_bytes > 0 else usable
        cap = max(ceiling - reserve - AUTO_CACHE_MIN_GB, AUTO_SLOT_MIN_GB)
        trunk, cache = min(usable - AUTO_CACHE_MIN_GB, cap), AUTO_CACHE_MIN_GB
    return AutoBudget(A, reserve, trunk, cache)


@dataclass(frozen=True)
class Budgets:
    """The budget flags after argv-order resolution; `auto` is resolved later, against
    available memory, by `plan()` / `auto_budget()`."""

    preset: str | None = None
    trunk_gb: float = DEFAULT_TRUNK_GB
    cache_gb: float = DEFAULT_CACHE_GB
    ultra: bool = False
    auto: bool = False

    def plan_kwargs(self) -> dict:
        return {"preset": self.preset, "ultra": self.ultra,
                "trunk_gb": AUTO if self.auto else self.trunk_gb, "cache_gb": self.cache_gb}


def _gb(flag: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise BudgetError(f"{flag} {value}: expected a number of GB") from None
    if not math.isfinite(v) or v < 0:
        raise BudgetError(f"{flag} {value}: expected a non-negative number of GB")
    return v


def resolve_budgets(args_in_order: Iterable[tuple[str, object]]) -> Budgets:
    """Apply the memory flags in argv order (§5.2): `[("--preset", "server"),
    ("--cache-gb", "40")]` is the server trunk with a 40 GB cache.

    * `--preset NAME` sets both budgets and ultra (a named preset after auto switches
      auto off: later flags win);
    * `--preset auto` / `--trunk-gb auto` turn auto on (`--preset auto` also clears ultra);
    * a later `--trunk-gb X` switches auto off (the cache keeps its previous value);
    * `--cache-gb` given with auto is overwritten by the auto result;
    * `--ultra-low-memory` (value ignored) turns ultra on; ultra with auto is refused.
    Other flags are ignored, so a caller may pass the whole option list."""
    b = Budgets()
    for flag, value in args_in_order:
        if flag == "--preset":
            name = str(value)
            if name == AUTO:
                b = replace(b, preset=AUTO, auto=True, ultra=False)
            elif name in PRESETS:
                p = PRESETS[name]
                b = replace(b, preset=name, trunk_gb=p.trunk_gb, cache_gb=p.cache_gb,
                            ultra=p.ultra, auto=False)
            else:
                raise BudgetError(f"unknown preset '{name}'\n\n" + list_presets_text())
        elif flag == "--trunk-gb":
            if str(value) == AUTO:
                b = replace(b, auto=True)
            else:
                b = replace(b, trunk_gb=_gb(flag, value), auto=False)
        elif flag == "--cache-gb":
            b = replace(b, cache_gb=_gb(flag, value))
        elif flag == "--ultra-low-memory":
            b = replace(b, ultra=True)
    if b.ultra and b.auto:
        raise BudgetError(ULTRA_AUTO_MESSAGE)
    return b


ULTRA_AUTO_MESSAGE = ("--ultra-low-memory uses explicit bounded budgets; use --preset ultra "
                      "or pass --trunk-gb/--cache-gb")
ULTRA_TRUNK_MESSAGE = ("--ultra-low-memory needs --trunk; resident trunk cannot fit its "
                       "memory contract")


# --- refusals (§5.5) --------------------------------------------------------------------

@dataclass(frozen=True)
class Refusal:
    """One reason the run must not start.  `message` is the stderr text without the one
    leading newline the CLI prints first."""

    kind: str          # "kv", "plan", "unknowable", "auto", "usage"
    exit_code: int
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class KvCheck:
    positions: int
    need_bytes: int          # positions x the rounded per-position constant
    available_bytes: int
    line: str                # "  KV cache : X for N positions (R/position)"
    refusal: Refusal | None


def _kv_refusal_text(positions: int, need: float, avail: float, n_mla: int,
                     per_position: int) -> str:
    return (f"REFUSING: the KV cache for {positions} positions needs {human(need)} but only "
            f"{human(avail)} is\n"
            "available. This is a MEMORY limit, not an engine ceiling: MLA caches\n"
            f"expanded k and v in fp32 across {n_mla} layers, so context costs "
            f"~{human(per_position)} per\n"
            "position regardless of budget. Shorten the request, or use full\n"
            "recompute (drop --incremental), which carries no KV cache at all.")


def kv_check(figures: ModelFigures, positions: int, available: "MemProbe | int | None"
             ) -> KvCheck:
    """§5.5.1, incremental runs only, right after the prompt is parsed.  `positions` is
    prior (resumed) + prompt + gen + 1: unlike the reference, resumed positions count."""
    avail, known, malformed, detail = _availability(available)
    rate = figures.kv_check_bytes_per_position
    need = positions * rate
    line = f"  KV cache : {human(need)} for {positions} positions ({human(rate)}/position)"
    refusal = None
    if malformed:
        refusal = _unknowable(2, detail)
    elif avail > 0 and need > KV_ADMIT * avail:
        refusal = Refusal("kv", 2, _kv_refusal_text(positions, need, avail, figures.n_mla,
                                                    rate))
    return KvCheck(positions, need, avail, line, refusal)


def _unknowable(exit_code: int, detail: str) -> Refusal:
    # A control file that is present but unreadable says the budget is unknowable, not
    # unlimited: a 12 GB cap once printed "available 65.56 GB" and was OOM-killed (§5.4).
    return Refusal("unknowable", exit_code,
                   "REFUSING TO START: available memory cannot be determined: "
                   f"{detail or 'a memory control file is unreadable'}.\n"
                   "A limit that cannot be read is not treated as unlimited. Fix the file "
                   "or run outside that cgroup.")


def _plan_refusal_text(need: float, avail: float) -> str:
    limit = ADMIT * avail
    return (f"REFUSING TO START: this needs {human(need)}. The machine has {human(avail)} "
            f"available and a plan may use at most {human(limit)} of that, so this is "
            f"{human(need - limit)} over the limit.\n"
            "Options: a larger box, a smaller --cache-gb, or fewer --layers.")


# --- the plan (§5.5.2, §7.1, §7.5) ------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """Every term of the `memory plan` block, in bytes, and whether the run may start."""

    preset: str | None
    trunk_gb: float
    cache_gb: float
    ultra: bool
    streamed: bool
    incremental: bool
    positions: int
    layers: int
    trunk_bytes: int
    model_table_bytes: int
    expert_cache_bytes: int
    recurrent_state_bytes: int
    buffer_bytes: int
    kv_cache_bytes: int
    baseline_bytes: int           # measured process baseline (§5.8), 0 when not given
    available_bytes: int
    available_known: bool
    trunk_plan: TrunkPlan | None
    expert_slot_bytes: int
    expert_slots: int
    expert_slots_needed: int      # topk + 1
    auto: AutoBudget | None = None
    kv: KvCheck | None = None
    refusals: tuple[Refusal, ...] = ()
    baseline_label: str = "python baseline"
    draft_bytes: int = 0          # hybrid decode's draft model: its trunk, state and KV
    draft_plan: TrunkPlan | None = None
    spec_bytes: int = 0           # --spec / --draft-trunk: snapshot, sweep log, sweep logits
    drafter_bytes: int = 0        # --draft-model: the block drafter's weights, context, scratch
    drafter_weight_bytes: int = 0
    trace_bytes: int = 0          # the expert request trace (part of buffer_bytes)
    trace_window: int = 0         # its window in requests (0: every request, or none kept)
    sequences: int = 1            # recurrent states counted (a batch, serve --parallel)
    lookahead_bytes: int = 0      # the lookahead reads' side buffer (part of buffer_bytes)

    @property
    def total_bytes(self) -> int:
        return (self.trunk_bytes + self.model_table_bytes + self.expert_cache_bytes
                + self.recurrent_state_bytes + self.buffer_bytes + self.kv_cache_bytes
                + self.baseline_bytes + self.draft_bytes + self.spec_bytes
                + self.drafter_bytes)

    @property
    def limit_bytes(self) -> float:
        """What admission allows: 0.95 x available (0 when available is unknown)."""
        return ADMIT * self.available_bytes

    @property
    def admitted(self) -> bool:
        return not self.refusals

    @property
    def reasons(self) -> list[str]:
        return [r.message for r in self.refusals]

    @property
    def exit_code(self) -> int:
        """The code of the first refusal the CLI meets (the KV check runs first), 0 if
        admitted."""
        return self.refusals[0].exit_code if self.refusals else 0

    @property
    def cache_fits_topk(self) -> bool:
        """Cache init fails (exit 1, §4.1) below topk + 1 slots."""
        return self.expert_slots >= self.expert_slots_needed

    def preset_line(self) -> str | None:
        """`  preset   : NAME (trunk X GB / expert cache Y GB)` when a preset was named."""
        if not self.preset:
            return None
        return "  preset   : %s (trunk %.2f GB / expert cache %.2f GB)" % (
            self.preset, self.trunk_gb, self.cache_gb)

    def lines(self) -> list[str]:
        """The `memory plan` block of §7.1 (the CLI prints a blank line before and after).
        The baseline line appears only when a measured baseline was given (§5.8)."""
        out = [
            "memory plan",
            "  trunk %-10s %s" % ("(STREAMED)" if self.streamed else "(resident)",
                                  human(self.trunk_bytes)),
            "  embed + lm_head  %s %s" % (human(self.model_table_bytes),
                                          "(STREAMED)" if self.ultra else "(resident)"),
            "  expert cache     " + human(self.expert_cache_bytes),
            "  recurrent state  " + human(self.recurrent_state_bytes)
            + (f" ({self.sequences} sequences)" if self.sequences > 1 else ""),
            "  buffers          " + human(self.buffer_bytes),
            "  KV cache         " + human(self.kv_cache_bytes),
        ]
        if self.spec_bytes:
            out.append("  speculation      %s (state snapshot, sweep log and logits)"
                       % human(self.spec_bytes))
        if self.draft_plan is not None:
            out.append("  draft model      %s (trunk %s, state + KV %s)" % (
                human(self.draft_bytes), human(self.draft_plan.total_bytes),
                human(self.draft_bytes - self.draft_plan.total_bytes)))
        if self.drafter_bytes:
            out.append("  block drafter    %s (weights %s, context K/V and scratch %s)" % (
                human(self.drafter_bytes), human(self.drafter_weight_bytes),
                human(self.drafter_bytes - self.drafter_weight_bytes)))
        if self.baseline_bytes:
            out.append("  %-16s %s (measured)" % (self.baseline_label,
                                                  human(self.baseline_bytes)))
        out.append("  TOTAL            " + human(self.total_bytes))
        if self.available_bytes > 0:
            out.append("  available        " + human(self.available_bytes))
        return out

    def as_event(self) -> dict:
        """The §7.5 `plan` event (the session adds "t")."""
        tp = self.trunk_plan
        return {
            "ev": "plan",
            "trunk_bytes": self.trunk_bytes,
            "model_table_bytes": self.model_table_bytes,
            "expert_cache_bytes": self.expert_cache_bytes,
            "recurrent_state_bytes": self.recurrent_state_bytes,
            "buffer_bytes": self.buffer_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "baseline_bytes": self.baseline_bytes,
            "draft_bytes": self.draft_bytes,
            "spec_bytes": self.spec_bytes,
            "total_bytes": self.total_bytes,
            "available": self.available_bytes,
            "admitted": self.admitted,
            "preset": self.preset,
            "trunk_gb": self.trunk_gb,
            "cache_gb": self.cache_gb,
            "ultra": self.ultra,
            "incremental": self.incremental,
            "streamed": self.streamed,
            "positions": self.positions,
            "layers": self.layers,
            "expert_slots": self.expert_slots,
            "n_pinned": tp.n_pinned if tp else None,
            "ring_slots": tp.ring_slots if tp else None,
            "refusals": [{"kind": r.kind, "code": r.exit_code, "message": r.message}
                         for r in self.refusals],
            # an extension key, present only with a block drafter (the golden event stays)
            **({"drafter_bytes": self.drafter_bytes} if self.drafter_bytes else {}),
        }


def _availability(available) -> tuple[int, bool, bool, str]:
    """(bytes, known, malformed, detail) from a probe, a plain byte count or None."""
    if isinstance(available, MemProbe):
        return available.bytes, available.known, available.malformed, available.detail
    b = int(available or 0)
    return max(b, 0), b > 0, False, ""


def plan(figures: ModelFigures, preset: str | None = None,
         trunk_gb: float | str | None = None, cache_gb: float | None = None,
         trunk_ring: int | None = RING_DEFAULT, ultra: bool = False, streamed: bool = True,
         incremental: bool = False, positions: int = 1,
         available_bytes: "MemProbe | int | None" = None, total_memory: int = 0,
         layers: int | None = None, baseline_bytes: int = 0, prefix: bool = False,
         baseline_label: str = "python baseline",
         draft_sizes: Sequence[int] | None = None,
         draft_gb: float = DEFAULT_DRAFT_TRUNK_GB, spec: int = 0,
         keep_trace: bool = False, trace_window: int = 0, sequences: int = 1,
         lookahead: bool = False, drafter_weights: int = 0,
         drafter_per_position: int = 0) -> Plan:
    """The whole-run memory plan.  Pure: no I/O, safe to call on every slider move.

    Budgets: `preset` first, then explicit `trunk_gb`/`cache_gb` as if given after it
    (use `resolve_budgets` for true argv order).  `preset="auto"` or `trunk_gb="auto"`
    sizes both from `available_bytes` and `total_memory` (MemTotal); an explicit numeric
    `trunk_gb` switches auto off, and auto overwrites `cache_gb`.
    `positions` = prior + prompt + gen + 1.  `available_bytes` is a byte count (0 = unknown:
    both refusals off) or the MemProbe itself (so a fail-closed probe refuses).
    `layers` is --layers (NL); `prefix` is K3_PIN_PREFIX (read by the caller).
    `baseline_bytes` is the measured process baseline of §5.8 (interpreter, NumPy, Qt).
    `spec` (the sweep width of --spec / --draft-trunk, incremental only) adds what a
    speculative sweep holds; `draft_sizes` (the draft trunk's layer runs) adds hybrid
    decode's draft model: its trunk within `draft_gb`, its own recurrent state with what
    its proposals hold, and its KV cache.  `keep_trace` (--dump-cache-trace) adds the
    request trace kept for the whole run to the buffers (trace_bytes); with `trace_window`
    requests (the app's session trace) it adds that window's ring instead.  `sequences`
    (incremental: a batch, `k3 serve --parallel`) counts that many recurrent states;
    `positions` is then all of their positions.  `lookahead` adds the side buffer of
    lookahead expert reads (lookahead.py: one layer's top-k of expert slots) to the
    buffers.  `drafter_weights` and `drafter_per_position` (--draft-model,
    drafter.DrafterConfig) add the block drafter: its weights, and its context keys/values
    and scratch at every position."""
    refusals: list[Refusal] = []
    sequences = max(1, int(sequences)) if incremental else 1
    avail, known, malformed, detail = _availability(available_bytes)
    NL = figures.n_layers if layers is None else int(layers)

    is_auto = preset == AUTO or trunk_gb == AUTO
    p = PRESETS.get(preset) if preset and preset != AUTO else None
    if preset and preset != AUTO and p is None:
        refusals.append(Refusal("usage", 2, f"unknown preset '{preset}'\n\n"
                                + list_presets_text()))
    t_gb = p.trunk_gb if p else DEFAULT_TRUNK_GB
    c_gb = p.cache_gb if p else DEFAULT_CACHE_GB
    ultra = bool(ultra or (p.ultra if p else False))
    if trunk_gb is not None and trunk_gb != AUTO:
        t_gb, is_auto = float(trunk_gb), False
    if cache_gb is not None:
        c_gb = float(cache_gb)

    # in the order the CLI meets them: flag conflicts, auto, the KV check, the whole plan
    if ultra and not streamed:
        refusals.append(Refusal("usage", 2, ULTRA_TRUNK_MESSAGE))
    auto = None
    if is_auto and ultra:
        refusals.append(Refusal("usage", 2, ULTRA_AUTO_MESSAGE))
    elif is_auto:
        try:
            auto = auto_budget(avail, total_memory, detail)
            t_gb, c_gb = auto.trunk_gb, auto.cache_gb
        except BudgetError as e:
            refusals.append(Refusal("auto", e.exit_code, str(e)))

    kv = None
    if incremental:
        kv = kv_check(figures, positions, available_bytes)
        if kv.refusal:
            refusals.append(kv.refusal)

    tplan = None
    if streamed:
        tplan, w_trunk = _streamed_trunk(figures.layer_sizes, t_gb, trunk_ring,
                                         figures.widen_bytes, prefix, NL)
    else:
        w_trunk = figures.trunk_bytes(NL)
    dplan, w_draft = None, 0
    if draft_sizes is not None:
        dplan, w_draft = _streamed_trunk(draft_sizes, draft_gb, RING_DEFAULT,
                                         figures.widen_bytes, prefix, NL)
        w_draft += (figures.state_bytes(NL, False, True) + figures.kv_bytes(positions)
                    + figures.speculation_bytes(NL, spec))
    w_spec = figures.speculation_bytes(NL, spec + 1) if spec and incremental else 0
    w_drafter = drafter_weights + drafter_per_position * positions if drafter_weights else 0
    trace = figures.trace_bytes(positions, keep_trace, trace_window)
    ahead = figures.topk * figures.expert_slot_bytes if lookahead else 0

    terms = dict(
        trunk_bytes=w_trunk,
        model_table_bytes=figures.model_table_bytes(ultra),
        expert_cache_bytes=min(int(c_gb * 1e9), figures.expert_pool * figures.expert_slot_bytes),
        recurrent_state_bytes=figures.state_bytes(NL, ultra, incremental) * sequences,
        buffer_bytes=figures.buffer_bytes(positions) + trace + ahead
        + (figures.stream_scratch_bytes if streamed else 0),
        kv_cache_bytes=figures.kv_bytes(positions) if incremental else 0,
        baseline_bytes=int(baseline_bytes),
        draft_bytes=w_draft,
        spec_bytes=w_spec,
        drafter_bytes=w_drafter)
    need = sum(terms.values())
    if malformed:
        if not (kv and kv.refusal):           # the KV check already said it (exit 2)
            refusals.append(_unknowable(1, detail))
    elif avail > 0 and need > ADMIT * avail:
        text = _plan_refusal_text(need, avail)
        if sequences > 1:                     # how many of them would fit
            each = figures.state_bytes(NL, ultra, incremental) + \
                figures.kv_bytes(positions) / sequences
            fit = max(0, int((ADMIT * avail - (need - sequences * each)) // each))
            text += f"\n  {fit} of the {sequences} sequences would fit"
        refusals.append(Refusal("plan", 1, text))

    return Plan(preset=preset, trunk_gb=t_gb, cache_gb=c_gb, ultra=ultra, streamed=streamed,
                incremental=incremental, positions=positions, layers=NL, **terms,
                available_bytes=avail, available_known=known, trunk_plan=tplan,
                expert_slot_bytes=figures.expert_slot_bytes,
                expert_slots=figures.expert_slots(c_gb),
                expert_slots_needed=figures.topk + 1, auto=auto, kv=kv,
                refusals=tuple(refusals), baseline_label=baseline_label, draft_plan=dplan,
                trace_bytes=trace, trace_window=int(trace_window) if keep_trace else 0,
                sequences=sequences, lookahead_bytes=ahead,
                drafter_weight_bytes=int(drafter_weights))


@dataclass(frozen=True)
class PlanRequest:
    """What a run asks of the planner (made by engine.LoadSpec.plan_request)."""
    budgets: Budgets = Budgets()
    trunk_ring: int = RING_DEFAULT
    streamed: bool = False
    incremental: bool = False
    positions: int = 1
    layers: int | None = None
    baseline_bytes: int = 0
    baseline_label: str = "python baseline"
    draft_sizes: Sequence[int] | None = None
    draft_gb: float = DEFAULT_DRAFT_TRUNK_GB
    spec: int = 0
    keep_trace: bool = False
    trace_window: int = 0
    prefix: bool = False
    sequences: int = 1
    lookahead: bool = False
    drafter_weights: int = 0          # the block drafter (drafter.DrafterSetup)
    drafter_per_position: int = 0



def most_sequences(admitted, most: int = AUTO_SEQUENCES) -> int:
    """The most sequence slots, up to `most`, for which `admitted(n)` (a plan of n
    sequences has no refusal) holds; 1 when fewer than two are admitted (one slot's
    refusal, if any, is then the run's own).  k3 serve's and the app's auto slots."""
    return next((n for n in range(most, 1, -1) if admitted(n)), 1)

def plan_for(figures: ModelFigures, req: PlanRequest,
             available_bytes: "MemProbe | int | None" = None, total_memory: int = 0) -> Plan:
    """The whole-run plan for a request: the one call every front end makes."""
    b = req.budgets
    return plan(figures, preset=AUTO if b.auto else b.preset,
                trunk_gb=AUTO if b.auto else b.trunk_gb, cache_gb=b.cache_gb,
                trunk_ring=req.trunk_ring, ultra=b.ultra, streamed=req.streamed,
                incremental=req.incremental, positions=req.positions,
                available_bytes=available_bytes, total_memory=total_memory,
                layers=req.layers, baseline_bytes=req.baseline_bytes, prefix=req.prefix,
                baseline_label=req.baseline_label, draft_sizes=req.draft_sizes,
                draft_gb=req.draft_gb, spec=req.spec, keep_trace=req.keep_trace,
                trace_window=req.trace_window, sequences=req.sequences,
                lookahead=req.lookahead, drafter_weights=req.drafter_weights,
                drafter_per_position=req.drafter_per_position)


def _streamed_trunk(sizes: Sequence[int], gb: float, ring: int | None, widen: int,
                    prefix: bool, n_bound: int) -> tuple[TrunkPlan, int]:
    """A streamed trunk's plan and what it is charged: the budget, as the reference counts
    it -- unless even one ring slot exceeds it (the slot is what gets allocated and the
    plan must not understate), or every layer is pinned (the rest is never allocated)."""
    budget = int(gb * 1e9)
    tp = plan_trunk(sizes, budget, ring, widen, prefix)
    if tp.n_pinned == n_bound:
        return tp, tp.total_bytes
    return tp, max(budget, tp.total_bytes)
