"""The typed events of a run (SYSTEM §7.5): what the engine tells its front ends.

`open_engine` reports its set-up (threads, config, tokenizer, index, plan, load progress,
what was loaded); the decode generator yields steps and tokens, a Conversation's turn
starts with TurnStarted and ends with TurnEnded (its TurnSummary).  The CLI
prints them (its report is a rendering of these events), the app's worker posts them to its
mailboxes, the server streams them.  Each event that belongs to the `--events` JSON stream
says so in `json()`: one (name, fields) pair per JSON line, in the order of §7.5.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


class Event:
    def json(self) -> list[tuple[str, dict]]:
        """The --events lines this event produces (most set-up events produce none)."""
        return []


Sink = Callable[[Event], None]


# ---- set-up (open_engine) -------------------------------------------------------------

@dataclass(frozen=True)
class ThreadsSet(Event):
    threads: int


@dataclass(frozen=True)
class ConfigRead(Event):
    cfg: Any                     # config.ModelConfig
    path: str
    layers: int                  # bound layers (--layers), <= cfg.n_layers


@dataclass(frozen=True)
class TokenizerLoaded(Event):
    report: str                  # tokenizer.Tokenizer.report_line()


@dataclass(frozen=True)
class PromptRead(Event):
    nbytes: int                  # a text prompt's UTF-8 bytes
    n_ids: int


@dataclass(frozen=True)
class RunHeader(Event):
    model_dir: str
    n_prompt: int | None         # None in chat (the prompt is the transcript)
    gen: int


@dataclass(frozen=True)
class Indexed(Event):
    n_tensors: int
    n_shards: int
    seconds: float
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Planned(Event):
    plan: Any                    # memory.Plan
    trunk_dir: str | None
    trunk_total_bytes: int       # the packed trunk on disk (0: resident)

    def json(self):
        return [("plan", self.plan.as_event())]


@dataclass(frozen=True)
class LoadProgress(Event):
    """Bytes of a load phase done so far: 'pinned_first_touch' (token 0 reads every pinned
    layer once, SYSTEM §3.7) or 'prefill' (layers of a prompt pass, for the app's ETA)."""
    phase: str
    layer: int
    done_bytes: int
    total_bytes: int
    elapsed_s: float = 0.0
    eta_s: float | None = None

    def json(self):
        if self.phase != "pinned_first_touch":
            return []
        return [("load", dict(phase=self.phase, layer=self.layer, done_bytes=self.done_bytes,
                              total_bytes=self.total_bytes))]


@dataclass(frozen=True)
class Loaded(Event):
    """What was loaded and how; every figure the CLI's load report and the app's setup view
    show."""
    streamed: bool
    trunk_dir: str | None
    direct: bool                 # trunk reads bypass the page cache
    pinned_layers: tuple[int, ...]
    ring_slots: int
    slot_bytes: int
    seconds: float               # streamed trunk open time
    resident_trunk_bytes: int
    table_bytes: int
    bind_seconds: float
    ultra: bool
    peak_rss_bytes: int
    cache_line: str
    expert_slots: int
    expert_slot_bytes: int
    state_bytes: int
    one_recurrent_slot: bool
    n_layers: int

    def json(self):
        out = []
        if self.streamed:
            out.append(("trunk_open", dict(n_pinned=len(self.pinned_layers),
                                           pinned_layers=list(self.pinned_layers),
                                           ring_slots=self.ring_slots,
                                           slot_bytes=self.slot_bytes, direct=self.direct,
                                           split_first=False)))
        out.append(("cache_open", dict(nslot=self.expert_slots,
                                       slot_bytes=self.expert_slot_bytes)))
        return out


@dataclass(frozen=True)
class TrunkNotice(Event):
    """Which file the streamed trunk reads (trunk.bin or the compressed trunk.k3z, and
    why), or a warning: a compressed trunk refused or found damaged, plain reads instead."""
    message: str
    warning: bool = False


@dataclass(frozen=True)
class DraftLoaded(Event):
    total_bytes: int
    bits: int | None             # None: the draft holds exact weights
    pinned: int
    n_layers: int
    ring_slots: int


@dataclass(frozen=True)
class DrafterLoaded(Event):
    """A block drafter (--draft-model) was read."""
    folder: str
    n_layers: int
    block_size: int
    target_layers: tuple[int, ...]
    weight_bytes: int
    seconds: float


# ---- generation (generate.decode, Conversation) -------------------------------------------

@dataclass(frozen=True)
class Resumed(Event):
    path: str
    n_prior: int
    n_new: int
    seconds: float


@dataclass(frozen=True)
class DecodeStarted(Event):
    incremental: bool
    kv_bytes: int
    n_mla: int
    positions: int
    resumed: Resumed | None
    spec: int                    # sweep width (0: plain decode)
    spec_auto: bool
    draft: dict | None           # hybrid decode: trunk, gb, topk, cache_only
    drafter: dict | None = None  # a block drafter: folder, block, layers


@dataclass(frozen=True)
class StepTelemetry:
    """One point of every per-token plot: computed once per step (Engine.measure_step)."""
    rss_bytes: int
    peak_rss_bytes: int
    trunk_bytes: int
    trunk_read_s: float
    trunk_hits: int
    trunk_binds: int
    expert_requests: int
    expert_hits: int
    expert_misses: int
    expert_evictions: int
    expert_prefetch_reads: int
    expert_bytes: int
    expert_read_s: float
    model_table_bytes: int
    true_resident_hit: float
    io_share_step: float
    resident_experts: int
    pinned_experts: int
    # beyond the CLI's step event (the app's plots)
    raw_hit_rate: float = 0.0        # percent, as the cache reports them
    retention_rate: float = 0.0
    io_trunk_share: float = 0.0
    io_expert_share: float = 0.0
    # lookahead expert reads this step (lookahead.py; 0 when off): started, taken by a
    # real miss, wasted, their bytes, and the guess's recall of the routed experts (0-1)
    lookahead_predicted: int = 0
    lookahead_useful: int = 0
    lookahead_wasted: int = 0
    lookahead_bytes: int = 0
    lookahead_wasted_bytes: int = 0
    lookahead_recall: float = 0.0

    EVENT_KEYS = ("rss_bytes", "peak_rss_bytes", "trunk_bytes", "trunk_read_s", "trunk_hits",
                  "trunk_binds", "expert_requests", "expert_hits", "expert_misses",
                  "expert_evictions", "expert_prefetch_reads", "expert_bytes", "expert_read_s",
                  "model_table_bytes", "true_resident_hit", "io_share_step",
                  "resident_experts", "pinned_experts", "lookahead_predicted",
                  "lookahead_useful", "lookahead_wasted", "lookahead_bytes",
                  "lookahead_wasted_bytes", "lookahead_recall")


@dataclass(frozen=True)
class StepDone(Event):
    step: int
    ids: tuple[int, ...]
    seconds: float
    telemetry: StepTelemetry
    logits: Any = field(default=None, compare=False)   # step 0 only (--dump-logits)
    sequences: int = 1                 # the sequences the step's pass carried (a batch)

    def json(self):
        t = self.telemetry
        batch = {"sequences": self.sequences} if self.sequences > 1 else {}  # beyond §7.5
        return [("step", dict(step=self.step, ids=list(self.ids), seconds=self.seconds,
                              **{k: getattr(t, k) for k in t.EVENT_KEYS}, **batch))]


@dataclass(frozen=True)
class TokenOut(Event):
    """One committed id with the visible text it adds and its phase ('thinking' or
    'response' in chat; 'text' outside chat; 'control' for markup the reader hides)."""
    id: int
    text: str
    phase: str
    row: int | None = None           # a batch's sequence (generate.decode_many)

    def json(self):
        return [("token", dict(id=self.id, text_delta=self.text, phase=self.phase))]


@dataclass(frozen=True)
class TurnStarted(Event):
    prompt_ids: int
    reused: int                  # positions served from the sequence's state
    gen: int


@dataclass(frozen=True)
class TurnEnded(Event):
    result: Any                  # generate.TurnSummary

    def json(self):
        r = self.result
        return [("chat", dict(phase="turn_end", reused_positions=r.reused, end_id=r.end_id))]


@dataclass(frozen=True)
class Failed(Event):
    code: int
    kind: str
    message: str

    def json(self):
        return [("error", dict(code=self.code, kind=self.kind, message=self.message))]
