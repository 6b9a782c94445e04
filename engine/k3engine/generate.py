"""The one decode loop (SYSTEM §6.4, §9.3) under every front end: batch runs, chat turns,
the REPL and the server.

    GenSpec        what one turn asks: gen, sampling, stop ids, thinking, effort, spec width
    decode(...)    a generator: feeds a Sequence's pending ids, samples (or verifies drafts),
                   yields StepDone and TokenOut events, returns the TurnSummary
    TurnSummary    every figure of a turn, computed once here: front ends show them

A step: feed what is pending (the prompt, or the last sampled id), sample one id from the
logits -- or, with a speculative width, verify several drafted ids in one sweep (the same
ids as serial greedy by construction) -- and stop at an end/stop id, the generation limit,
a stop request (honoured at the top of a step, and with `stop_in_pass` between the layers
of a prompt pass) or a routed expert that failed to load (the token is never emitted).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

from . import events as E
from .experts import ExpertLoadError
from .model import Stopped
from .speculative import MAX_DRAFT, SpecCounters, SpecWidth, spec_step

__all__ = ["Cancel", "Sampling", "GenSpec", "TurnSummary", "decode", "TextStream", "Turn",
           "BatchRun", "BatchSummary", "decode_many"]


class Cancel:
    """A stop request honoured at the next safe point: between decode steps, and between
    the layers of a prompt pass where the caller allows it -- SIGINT in the CLI, the Stop
    button in the app (SYSTEM §6.6).  `leave()` is the softer request of a requester that
    went away (a server client that disconnected): the prompt pass in flight completes and
    its work is kept (the sequence and the last logits, Sequence.logits), so the same
    request sent again continues from there instead of starting over; decoding then stops
    as for set()."""

    def __init__(self):
        self._flag = threading.Event()
        self._left = threading.Event()
        self.hard = _Hard(self._flag)         # what the layers of a prompt pass check

    def set(self) -> None:
        self._flag.set()

    def leave(self) -> None:
        self._left.set()

    def __bool__(self) -> bool:
        return self._flag.is_set() or self._left.is_set()


class _Hard:
    def __init__(self, flag):
        self._flag = flag

    def __bool__(self) -> bool:
        return self._flag.is_set()


@dataclass(frozen=True)
class Sampling:
    """None = the §9.5 default; any of temperature/top-p/top-k/min-p/seed switches sampling
    on (`greedy` wins)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    greedy: bool = False
    min_p: float | None = None

    def sampler(self):
        from .sampler import Sampler
        return Sampler.from_flags(temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, seed=self.seed, greedy=self.greedy,
                                  min_p=self.min_p)


@dataclass(frozen=True)
class GenSpec:
    """One turn's options (the model, budgets and threads are the engine's, LoadSpec)."""
    gen: int = 8
    sampling: Sampling = Sampling()
    stop_ids: tuple[int, ...] = ()
    thinking: bool = True               # chat rendering: the think channel
    effort: str = "max"                 # chat rendering: thinking_effort
    spec: int = 0                       # speculative sweep width (greedy only; 0: plain)
    spec_auto: bool = False             # adapt the width to what is accepted

    def with_(self, **changes) -> "GenSpec":
        return replace(self, **changes)


@dataclass
class TurnSummary:
    """Everything a front end shows about one turn (or one batch run), computed once."""
    ids: list[int]                    # generated ids (a continuation: the whole reply)
    prompt_positions: int             # the prompt this turn answered (a transcript: all of it)
    reused: int = 0                   # positions served from the sequence's state
    continued: int = 0                # ids of an incomplete reply this turn resumed
    end_id: int | None = None         # the end or stop id that ended it (None: limit or stop)
    interrupted: bool = False         # a stop request ended it
    expert_drop: str | None = None    # a routed expert failed: the token was not emitted
    expert_error: Exception | None = field(default=None, repr=False, compare=False)
    layers_completed: int = 0
    steps: int = 0
    seconds: float = 0.0              # the turn's steps, prefill included
    first_token_seconds: float = 0.0  # to the first token (the prefill step)
    trunk_bytes: int = 0              # read from disk this turn (a compressed trunk: stored)
    expert_bytes: int = 0
    table_bytes: int = 0              # streamed embedding rows and lm_head (ultra)
    expert_requests: int = 0
    expert_hits: int = 0
    lookahead_predicted: int = 0      # expert reads started from a guess (lookahead.py)
    lookahead_useful: int = 0         # ... whose bytes a real miss took
    lookahead_wasted_bytes: int = 0   # ... read for nothing
    peak_rss_bytes: int = 0           # the OS's figure (per turn where the engine resets it)
    spec: SpecCounters = field(default_factory=SpecCounters)
    reasoning: str | None = None      # a closed chat turn, parsed
    content: str | None = None
    malformed: str | None = None      # a chat turn that closed but does not parse (why)
    first_logits: object = field(default=None, repr=False, compare=False)  # step 0's
    end_name: str | None = None       # the end id's token name

    @property
    def new_ids(self) -> int:
        """Ids this run generated (a continuation's new ones)."""
        return len(self.ids) - self.continued

    @property
    def bytes_read(self) -> int:
        return self.trunk_bytes + self.expert_bytes + self.table_bytes

    @property
    def decode_seconds(self) -> float:
        return max(self.seconds - self.first_token_seconds, 0.0)

    @property
    def decode_s_per_token(self) -> float | None:
        """Seconds per token after the first (None with fewer than two)."""
        n = self.new_ids
        return self.decode_seconds / (n - 1) if n > 1 else None

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of their steps (the first pays the prefill)."""
        n = self.new_ids
        return (n - 1) / self.decode_seconds if n > 1 and self.decode_seconds > 0 else 0.0

    @property
    def prefill_positions_per_s(self) -> float:
        fresh = self.prompt_positions - self.reused
        return fresh / self.first_token_seconds if fresh > 0 and \
            self.first_token_seconds > 0 and not self.continued else 0.0

    @property
    def hit_rate(self) -> float:
        return self.expert_hits / self.expert_requests if self.expert_requests else 0.0

    def figures(self) -> dict:
        """The plain values every front end shows (the app's stats line, the REPL's
        report, the server's `k3` usage extension): one source, so they agree."""
        return dict(tokens=self.new_ids, prompt_positions=self.prompt_positions,
                    reused_positions=self.reused, ttft_s=self.first_token_seconds,
                    prefill_positions_per_s=self.prefill_positions_per_s,
                    decode_tokens_per_s=self.decode_tokens_per_s, seconds=self.seconds,
                    bytes_read=self.bytes_read, trunk_bytes=self.trunk_bytes,
                    expert_bytes=self.expert_bytes, table_bytes=self.table_bytes,
                    peak_rss_bytes=self.peak_rss_bytes, hit_rate=self.hit_rate,
                    spec_drafted=self.spec.drafted, spec_accepted=self.spec.accepted,
                    spec_rounds=self.spec.rounds, lookahead_predicted=self.lookahead_predicted,
                    lookahead_useful=self.lookahead_useful,
                    lookahead_wasted_bytes=self.lookahead_wasted_bytes)


class Turn:
    """A turn's events to iterate (`for ev in Turn(engine.generate(...))`); `summary` holds
    the generator's TurnSummary once the iteration has ended."""

    def __init__(self, events):
        self._events = events
        self.summary: TurnSummary | None = None

    def __iter__(self):
        self.summary = yield from self._events


class TextStream:
    """The text of a batch run's ids (phase 'text'), for the same TokenOut shape as chat's
    reply parser (chat.ReplyStream)."""

    def __init__(self, tok, hidden=()):
        from .tokenizer import StreamDecoder
        self._d = StreamDecoder(tok) if tok is not None else None
        self._hidden = frozenset(hidden)
        self.phase = "text"

    def push(self, tok_id: int) -> tuple[str, str]:
        if self._d is None or tok_id in self._hidden:
            return "text", ""
        return "text", self._d.push(tok_id)

    def flush(self) -> str:
        return self._d.flush() if self._d is not None else ""


def _hard(cancel):
    """What a prompt pass's layers check: only a hard stop ends a pass part-way."""
    return getattr(cancel, "hard", cancel)


def decode(engine, seq, spec: GenSpec, sampler, cancel: Cancel | None = None, *,
           parser=None, stop_in_pass: bool = False, fork_at: int = 0, reused: int = 0,
           prompt_positions: int | None = None, prior: list[int] | None = None,
           end_ids=()):
    """Generate on `seq` (whose pending ids are fed first) up to `spec.gen` ids, yielding
    StepDone and TokenOut events; returns the TurnSummary.  `sampler` picks each id
    (greedy when it does not sample).  `parser` turns ids into (phase, text): a chat
    reply's ReplyStream, else plain text.  `end_ids` end the turn like stop ids.
    `fork_at` (a position inside the pending prompt): split the prompt pass there and keep
    a fork snapshot (an edit of the message that starts there reuses everything before).
    `prior`: ids of an incomplete reply this turn continues (counted in the summary's ids).
    `stop_in_pass` honours `cancel` between the layers of the prompt pass too."""
    lm = engine.lm
    gen = spec.gen
    parser = parser or TextStream(engine.tok)
    out = list(prior or ())
    base = len(out)
    stops = set(spec.stop_ids) | set(end_ids)
    res = TurnSummary([], len(seq.ids) if prompt_positions is None else prompt_positions,
                      reused=reused, continued=base)
    width = SpecWidth(min(spec.spec, engine.spec_max, MAX_DRAFT) or 1, spec.spec_auto)
    speculate = engine.incremental and spec.spec > 0 and engine.spec_max > 0 and \
        not sampler.sampling
    window = engine.turn_window()
    progress = engine.prefill_progress(len(seq.pending))
    g = 0
    hit = None
    while len(out) - base < gen or (engine.incremental and g == 0):
        if cancel:
            res.interrupted = True
            break
        lm.experts.reset_step()
        t0 = time.monotonic()
        left = gen - (len(out) - base)
        emitted: list[int] = []
        try:
            if speculate and g > 0 and left > 1 and width.ready():
                before_d, before_a = res.spec.drafted, res.spec.accepted
                emitted, logits = spec_step(lm.model, seq.ids, seq.state, min(width.n, left - 1),
                                            res.spec, engine.proposer(seq), stops)
                width.update(res.spec.drafted - before_d, res.spec.accepted - before_a)
                res.spec.width = width.n
            elif engine.incremental and g == 0 and not seq.pending and seq.logits is not None:
                logits = seq.logits           # a pass completed for a requester that left
            elif engine.incremental:
                stop = _hard(cancel) if stop_in_pass and g == 0 else None
                on_layer = progress if g == 0 else None
                if g == 0 and 0 < fork_at - seq.position < len(seq.pending):
                    seq.feed(fork_at - seq.position, stop, on_layer)
                    seq.keep_fork()
                logits = seq.feed(len(seq.pending), stop, on_layer)
                if g == 0 and stop_in_pass and cancel:   # asked during the pass: keep it
                    seq.logits = logits
                    res.interrupted = True
                    res.layers_completed = lm.model.layers_completed
                    break
            else:
                logits = seq.recompute(_hard(cancel) if stop_in_pass else None)
        except ExpertLoadError as e:          # never emit a token computed without an expert
            res.expert_drop, res.expert_error = str(e), e
            res.layers_completed = lm.model.layers_completed
            break
        except Stopped:
            res.interrupted = True
            res.layers_completed = lm.model.layers_completed
            break
        if not emitted and left > 0:
            emitted = [sampler.sample(logits)]
        hit = next((n for n, i in enumerate(emitted) if i in stops), None)
        if hit is not None:                   # a sweep that ran past a stop id is cut there
            emitted = emitted[:hit + 1]
            res.end_id = emitted[-1]
        seconds = time.monotonic() - t0
        res.steps += 1
        res.seconds += seconds
        if g == 0:
            res.first_token_seconds = seconds
        res.layers_completed = lm.model.layers_completed
        seq.ids += emitted
        out += emitted
        if g == 0:
            res.first_logits = logits
        yield E.StepDone(g, tuple(emitted), seconds, engine.measure_step(seconds),
                         logits if g == 0 else None)
        yield from engine.trunk_notices()
        for i in emitted:
            phase, text = parser.push(i)
            yield E.TokenOut(i, text, phase)
        g += 1
        if hit is not None:
            break
    tail = parser.flush()
    if tail:
        yield E.TokenOut(-1, tail, parser.phase)
    res.ids = out
    engine.close_window(window, res)
    return res


# ---- several sequences per pass ---------------------------------------------------------

@dataclass(eq=False)
class BatchRun:
    """One sequence of a batch (decode_many): its Sequence (the prompt pending), GenSpec and
    sampler; `summary` is filled in as it runs.  `leave()` drops it at the next step."""
    seq: object
    spec: GenSpec
    sampler: object
    parser: object = None
    end_ids: tuple = ()
    summary: TurnSummary | None = None
    finished: bool = False

    def leave(self) -> None:
        """Out of the batch from the next step on (a stop string, a client gone)."""
        self.finished = True
        if self.summary is not None and self.summary.end_id is None:
            self.summary.interrupted = True


@dataclass
class BatchSummary:
    """A batch's shared figures: every step read the trunk and the experts once for all."""
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    sizes: list[int] = field(default_factory=list)     # sequences in each step
    trunk_bytes: int = 0
    expert_bytes: int = 0
    table_bytes: int = 0
    peak_rss_bytes: int = 0

    @property
    def bytes_read(self) -> int:
        return self.trunk_bytes + self.expert_bytes + self.table_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def decode_many(engine, runs: list, cancel: Cancel | None = None):
    """Decode several sequences together: each step feeds every active run's pending ids
    (a joining run's whole prompt, the others' last token) in ONE pass
    (Model.forward_batch: a streamed layer bound once, the union of the rows' experts read
    once), then each run samples its own next id with its own sampler.  `runs` may grow
    between steps (a run joins at the next step; a finished one may be taken out) and a run
    may `leave()`.  Each run's ids
    equal the same prompt decoded alone (tests/test_batch.py).  Yields per step a TokenOut
    per run (`row`: its index in `runs`), then StepDone; returns the BatchSummary.  A run's
    summary counts its share of each step's reads.
    Greedy and sampled runs alike; speculation is not batched."""
    lm = engine.lm
    agg = BatchSummary()
    window = engine.turn_window()
    stops: dict[int, frozenset] = {}          # per run, made when it joins
    g = 0
    while True:
        for r in runs:
            if r.summary is None:                              # joins now
                r.summary = TurnSummary([], len(r.seq.pending))
                r.parser = r.parser or TextStream(engine.tok)
            if id(r) not in stops:
                stops[id(r)] = frozenset(r.spec.stop_ids) | frozenset(r.end_ids)
        active = [r for r in runs if not r.finished and r.spec.gen > 0]
        if not active:
            break
        if cancel:
            for r in active:
                r.summary.interrupted = r.finished = True
            break
        lm.experts.reset_step()
        t0 = time.monotonic()
        fed = [r for r in active if r.seq.pending]   # the rest: a pass kept for a resend
        try:
            got = lm.model.forward_batch([(r.seq.pending, r.seq.state) for r in fed]) \
                if fed else []
        except ExpertLoadError as e:          # never emit a token computed without an expert
            for r in active:
                r.summary.expert_drop, r.summary.expert_error = str(e), e
                r.finished = True
            break
        by_run = dict(zip(map(id, fed), got))
        logits = [by_run.get(id(r), r.seq.logits) for r in active]
        seconds = time.monotonic() - t0
        emitted = []
        for r, lg in zip(active, logits):
            res = r.summary
            tok = r.sampler.sample(lg)
            if res.steps == 0:
                res.first_token_seconds, res.first_logits = seconds, lg
            res.steps += 1
            res.seconds += seconds
            res.ids.append(tok)
            r.seq.ids.append(tok)
            emitted.append(tok)
            if tok in stops[id(r)]:
                res.end_id, r.finished = tok, True
            elif len(res.ids) >= r.spec.gen:
                r.finished = True
        agg.steps += 1
        agg.seconds += seconds
        agg.tokens += len(emitted)
        agg.sizes.append(len(active))
        tel = engine.measure_step(seconds)
        for r in active:                      # each run's share of the step's reads
            r.summary.trunk_bytes += tel.trunk_bytes // len(active)
            r.summary.expert_bytes += tel.expert_bytes // len(active)
            r.summary.table_bytes += tel.model_table_bytes // len(active)
        row = {id(r): i for i, r in enumerate(runs)}
        for r, tok in zip(active, emitted):   # the step's tokens, then the step is done
            phase, text = r.parser.push(tok)
            yield E.TokenOut(tok, text, phase, row=row[id(r)])
        yield E.StepDone(g, tuple(emitted), seconds, tel)
        yield from engine.trunk_notices()
        g += 1
    scratch = TurnSummary([], 0)
    engine.close_window(window, scratch)
    for r in runs:
        if r.summary is not None:
            r.summary.layers_completed = lm.model.layers_completed
            r.summary.peak_rss_bytes = scratch.peak_rss_bytes
    agg.trunk_bytes, agg.expert_bytes, agg.table_bytes = (scratch.trunk_bytes,
                                                          scratch.expert_bytes,
                                                          scratch.table_bytes)
    agg.peak_rss_bytes = scratch.peak_rss_bytes
    return agg
