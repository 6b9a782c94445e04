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
           "Run", "BatchSummary", "decode_many", "JOIN_CHUNK"]


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


# A prompt that joins while other runs are decoding is fed this many positions a step, so
# the others' next tokens wait for a chunk, not for the whole prompt; the chunk rides on
# the trunk pass the others' rows need anyway.  Alone, a prompt goes in one pass (a
# streamed trunk would otherwise be read once per chunk).
JOIN_CHUNK = 64

# (TurnSummary field, StepTelemetry field): what a run that shared steps gets its share of
SHARED_FIGURES = (("trunk_bytes", "trunk_bytes"), ("expert_bytes", "expert_bytes"),
                  ("table_bytes", "model_table_bytes"), ("expert_requests", "expert_requests"),
                  ("expert_hits", "expert_hits"), ("lookahead_predicted", "lookahead_predicted"),
                  ("lookahead_useful", "lookahead_useful"),
                  ("lookahead_wasted_bytes", "lookahead_wasted_bytes"))


@dataclass(eq=False)
class Run:
    """One sequence of the decode loop: its Sequence (the prompt pending), GenSpec and
    sampler, and how this turn goes (see `decode`); `summary` is filled in as it runs.
    `leave()` drops it at the next step."""
    seq: object
    spec: GenSpec
    sampler: object
    parser: object = None
    end_ids: tuple = ()
    summary: TurnSummary | None = None
    finished: bool = False
    cancel: object = None               # this run's stop request
    stop_in_pass: bool = False          # ... honoured between the layers of a prompt pass
    fork_at: int = 0                    # a fork point inside the pending prompt
    prior: list | None = None           # an incomplete reply this turn continues
    reused: int = 0
    prompt_positions: int | None = None
    _engine: object = field(default=None, init=False, repr=False)   # set when it joins

    def leave(self) -> None:
        """Out of the loop from the next step on (a stop string, a client gone); its
        figures are closed now, its parser's held-back text dropped."""
        if self.finished:
            return
        if self.summary is not None and self.summary.end_id is None:
            self.summary.interrupted = True
        if self._engine is not None:
            self._finish(self._engine)
        self.finished = True

    # -- the loop's own bookkeeping ---------------------------------------------------
    def _join(self, engine) -> None:
        self._engine = engine
        seq = self.seq
        if self.summary is None:
            n = len(seq.ids) if self.prompt_positions is None else self.prompt_positions
            self.summary = TurnSummary([], n, reused=self.reused)
        self.summary.ids = list(self.prior or ())
        self.summary.continued = len(self.summary.ids)
        self.parser = self.parser or TextStream(engine.tok)
        self._stops = frozenset(self.spec.stop_ids) | frozenset(self.end_ids)
        self._width = SpecWidth(min(self.spec.spec, engine.spec_max, MAX_DRAFT) or 1,
                                self.spec.spec_auto)
        self._speculate = engine.incremental and self.spec.spec > 0 and \
            engine.spec_max > 0 and not self.sampler.sampling
        self._g = 0                     # steps that ended with the prompt taken in
        self._alone = True              # every step so far carried only this run:
        self._window = engine.counters()    # then its figures are its own, exactly

    @property
    def _left(self) -> int:
        return self.spec.gen - self.summary.new_ids

    def _wants_step(self, engine) -> bool:
        return self._left > 0 or (engine.incremental and self._g == 0)

    def _finish(self, engine) -> str:
        """The run is over: its figures (its own window when it ran alone, else the
        shares of the steps it was in); returns its parser's held-back text."""
        if self.finished:                     # it left (leave) during its last step
            return ""
        self.finished = True
        self.summary.layers_completed = engine.lm.model.layers_completed
        engine.close_window(self._window if self._alone else None, self.summary)
        return self.parser.flush()


def decode(engine, seq, spec: GenSpec, sampler, cancel: Cancel | None = None, *,
           parser=None, stop_in_pass: bool = False, fork_at: int = 0, reused: int = 0,
           prompt_positions: int | None = None, prior: list[int] | None = None,
           end_ids=()):
    """Generate on `seq` (whose pending ids are fed first) up to `spec.gen` ids, yielding
    StepDone and TokenOut events; returns the TurnSummary: the one loop (decode_many)
    with one run.  `sampler` picks each id (greedy when it does not sample).  `parser`
    turns ids into (phase, text): a chat reply's ReplyStream, else plain text.  `end_ids`
    end the turn like stop ids.  `fork_at` (a position inside the pending prompt): split
    the prompt pass there and keep a fork snapshot (an edit of the message that starts
    there reuses everything before).  `prior`: ids of an incomplete reply this turn
    continues (counted in the summary's ids).  `stop_in_pass` honours `cancel` between
    the layers of the prompt pass too."""
    run = Run(seq, spec, sampler, parser, tuple(end_ids), cancel=cancel,
              stop_in_pass=stop_in_pass, fork_at=fork_at, prior=prior, reused=reused,
              prompt_positions=prompt_positions)
    yield from decode_many(engine, [run])
    return run.summary


@dataclass
class BatchSummary:
    """The loop's shared figures: every step read the trunk and the experts once for all."""
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


def decode_many(engine, runs: list, cancel: Cancel | None = None, between=None):
    """THE decode loop (SYSTEM §6.4, §9.3): one or several Runs, each step ONE pass for
    every active run's rows (Model.forward_batch: a streamed layer bound once, the union
    of the rows' experts read once), then each run samples its own next id with its own
    sampler, stops and limit.  Each run's ids equal the same run decoded alone
    (tests/test_batch.py); a run alone in a step gets everything a single turn has
    (speculation, a fork point, a stop between the layers of its prompt pass, a kept
    pass's logits, the reference's full recompute).  `runs` may grow and runs may
    `leave()` at step boundaries: `between()` is called at each (the server admits and
    closes requests there); a joining prompt shares steps with the others' decode rows
    JOIN_CHUNK positions at a time.  `cancel` stops every run.  Yields per step StepDone,
    the trunk's notices, then the step's TokenOuts (`row`: the run's index in `runs`; a
    finished run's held-back text as id -1); returns the BatchSummary.  A failed step
    fails the runs in it."""
    lm = engine.lm
    agg = BatchSummary()
    window = engine.turn_window()
    g = 0
    while True:
        if g and between is not None:
            between()
        for r in runs:
            if r._engine is None:
                r._join(engine)
        out: list = []                        # (run, ids emitted, finished now)
        for r in runs:                        # a stop request: every run's, or its own
            if not r.finished and (cancel or r.cancel):
                r.summary.interrupted = True
                out.append((r, [], True))
            elif not r.finished and not r._wants_step(engine):
                out.append((r, [], True))     # nothing left to do (gen reached, gen 0)
        ending = {id(r) for r, _, _ in out}
        active = [r for r in runs if not r.finished and id(r) not in ending]
        if not active:
            yield from _tokens(engine, runs, out)
            break
        alone = len(active) == 1
        if not alone:
            if not engine.incremental:
                raise ValueError("several runs at once need incremental decode")
            for r in active:
                r._alone = False
        lm.experts.reset_step()
        t0 = time.monotonic()
        try:
            results = _step(engine, active, alone)
        except ExpertLoadError as e:          # never emit a token computed without an expert
            for r in active:
                r.summary.expert_drop, r.summary.expert_error = str(e), e
                out.append((r, [], True))
            yield from _tokens(engine, runs, out)
            break
        except Stopped:                       # only a run alone stops inside a pass
            active[0].summary.interrupted = True
            out.append((active[0], [], True))
            yield from _tokens(engine, runs, out)
            break
        seconds = time.monotonic() - t0
        emitted_all: list[int] = []
        first, kept = None, False
        for r, logits in zip(active, results):
            res = r.summary
            res.layers_completed = lm.model.layers_completed
            if r._g == 0 and r.stop_in_pass and r.cancel and logits is not None:
                r.seq.logits = logits         # asked during the pass: keep it for a resend
                res.interrupted = kept = True
                out.append((r, [], True))
                continue
            res.steps += 1
            res.seconds += seconds
            if logits is None:                # a prompt chunk: no token yet
                continue
            if isinstance(logits, tuple):     # a speculative sweep: its ids and logits
                emitted, logits = logits
            else:
                emitted = [r.sampler.sample(logits)] if r._left > 0 else []
            hit = next((n for n, i in enumerate(emitted) if i in r._stops), None)
            if hit is not None:               # a sweep that ran past a stop id is cut there
                emitted = emitted[:hit + 1]
                res.end_id = emitted[-1]
            if r._g == 0:
                res.first_token_seconds, res.first_logits = res.seconds, logits
                first = logits if alone else None
            r._g += 1
            r.seq.ids += emitted
            res.ids += emitted
            emitted_all += emitted
            out.append((r, emitted, hit is not None or r._left <= 0))
        if alone and kept:                    # stopped in its prompt pass: not a step
            yield from _tokens(engine, runs, out)
            break
        agg.steps += 1
        agg.seconds += seconds
        agg.tokens += len(emitted_all)
        agg.sizes.append(len(active))
        tel = engine.measure_step(seconds)
        for r in active:                      # each run's share of the step's reads
            for mine, step in SHARED_FIGURES:
                setattr(r.summary, mine, getattr(r.summary, mine)
                        + getattr(tel, step) // len(active))
        yield E.StepDone(g, tuple(emitted_all), seconds, tel, first, len(active))
        yield from engine.trunk_notices()
        yield from _tokens(engine, runs, out)
        g += 1
    scratch = TurnSummary([], 0)
    engine.close_window(window, scratch)
    agg.trunk_bytes, agg.expert_bytes, agg.table_bytes = (scratch.trunk_bytes,
                                                          scratch.expert_bytes,
                                                          scratch.table_bytes)
    agg.peak_rss_bytes = scratch.peak_rss_bytes
    return agg


def _step(engine, active: list, alone: bool) -> list:
    """One step's passes: per active run, its logits (None: a prompt chunk that is not
    the last), or (ids, logits) of a speculative sweep."""
    from .sequence import feed_together
    lm = engine.lm
    if alone:
        r = active[0]
        seq = r.seq
        if r._speculate and r._g > 0 and r._left > 1 and r._width.ready():
            res = r.summary
            before_d, before_a = res.spec.drafted, res.spec.accepted
            emitted, logits = spec_step(lm.model, seq.ids, seq.state,
                                        min(r._width.n, r._left - 1), res.spec,
                                        engine.proposer(seq), r._stops)
            r._width.update(res.spec.drafted - before_d, res.spec.accepted - before_a)
            res.spec.width = r._width.n
            return [(emitted, logits)]
        if engine.incremental and r._g == 0 and not seq.pending and seq.logits is not None:
            return [seq.logits]               # a pass completed for a requester that left
        stop = _hard(r.cancel) if r.stop_in_pass and r._g == 0 else None
        if not engine.incremental:
            return [seq.recompute(stop)]
        on_layer = engine.prefill_progress(len(seq.pending)) if r._g == 0 else None
        if r._g == 0 and 0 < r.fork_at - seq.position < len(seq.pending):
            seq.feed(r.fork_at - seq.position, stop, on_layer)
            seq.keep_fork()
        return [seq.feed(len(seq.pending), stop, on_layer)]
    # several runs: one pass; a prompt goes JOIN_CHUNK positions a step, cut at its fork
    # point (a stop request waits for the step boundary: the pass carries other states)
    fed, chunks = [], []
    for r in active:
        seq = r.seq
        n = len(seq.pending)
        if n == 0:                            # a kept pass's logits
            continue
        if r._g == 0:
            n = min(n, JOIN_CHUNK)
            if 0 < r.fork_at - seq.position < n:
                n = r.fork_at - seq.position
        fed.append(r)
        chunks.append((seq, n))
    got = dict(zip(map(id, fed), feed_together(chunks))) if chunks else {}
    out = []
    for r in active:
        seq = r.seq
        if id(r) not in got:
            out.append(seq.logits)
            continue
        if r._g == 0 and r.fork_at == seq.position and seq.pending:
            seq.keep_fork()                   # the chunk ended at the fork point
        out.append(got[id(r)] if not seq.pending else None)
    return out


def _tokens(engine, runs: list, out: list):
    """The TokenOuts of a step, and the end of the runs that finished in it."""
    row = {id(r): i for i, r in enumerate(runs)}
    for r, ids, done in out:
        for i in ids:
            phase, text = r.parser.push(i)
            yield E.TokenOut(i, text, phase, row=row[id(r)])
        if done:
            tail = r._finish(engine)
            if tail:
                yield E.TokenOut(-1, tail, r.parser.phase, row=row[id(r)])

