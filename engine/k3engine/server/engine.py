"""The engine thread, its bounded queue, and the adapter from a validated request to the
engine's decode loop (a Conversation's turn for chat, a sequence's for completions).

The engine owns the machine's memory (the plan counts its sequence slots), so requests run
on ONE thread: here one at a time (`--parallel 1`), in server/batching.py several per step
through the same adapter (open_slot, decode, close_slot); the event loop only submits jobs
and reads what they post.
A job that cannot wait (the queue is full) is refused at once (`QueueFull`, the route's 429).
Each job has its own `Cancel`: a disconnecting client, a stop string or shutdown sets it,
and the engine honours it at the next safe point (between the layers of the prompt pass,
between decode steps).

The sequences of earlier requests are kept (prompt_cache: one, as the plan counts, or as many
as --prompt-cache-gb holds, and on disk with --prompt-cache-dir): a request continues the one
holding the longest prefix of its prompt (Sequence.prepare: all it fed, or a fork point),
which is how a conversation continued request after request skips re-reading its history.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from ..chat import ChatError
from ..conversation import Conversation
from ..errors import EngineError, LimitError, describe
from ..events import StepDone, TokenOut
from ..generate import Cancel, GenSpec, Run, TextStream, TurnSummary, decode_many
from ..prompt_cache import PromptCache
from .protocol import ApiError, GenRequest, Limits, Progress, usage_body
from .steps import StepLog
from .stops import StopMatcher


# ---------------------------------------------------------------- what a job posts

@dataclass(frozen=True)
class Started:
    prompt_ids: int
    reused: int = 0                # of them, served from the kept sequence


@dataclass(frozen=True)
class Delta:
    kind: str                      # "reasoning" | "content" | "text" (completions)
    text: str


@dataclass(frozen=True)
class Done:
    finish: str                    # "stop" | "length" | "cancelled"
    usage: dict
    ext: dict                      # the `k3` extension: timings, reuse, ids


@dataclass(frozen=True)
class Fail:
    error: ApiError


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the engine is busy and {retry_after} s is a fair retry delay")
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    req: GenRequest
    post: Callable[[object], None]         # thread-safe hand-off to the waiting route
    cancel: Cancel = field(default_factory=Cancel)
    submitted: float = field(default_factory=time.monotonic)
    started: Started | None = None
    no: int = 0                            # its number, in the order submitted (/k3/steps)

    def start(self, item: Started) -> None:
        self.started = item
        self.post(item)


@dataclass(eq=False)
class Slot:
    """One request's part in the engine's work: what it relays and how it ends."""
    job: Job
    spec: object                           # GenSpec
    stops: StopMatcher
    seq: object                            # the Sequence it runs on
    conv: object = None                    # chat: its Conversation; None: a completion
    run: object = None                     # batched: its generate.Run
    index: int = 0                         # the slot it holds (0..parallel-1)
    reasoning: int = 0                     # reasoning ids streamed
    texts: dict = field(default_factory=lambda: {"thinking": "", "response": ""})


# ---------------------------------------------------------------- the engine thread

class EngineThread:
    """Runs jobs one at a time on its own thread; at most `queue` jobs wait."""

    def __init__(self, backend: "Backend", queue: int):
        self.backend, self.capacity = backend, queue
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._closing = False
        self._recent: deque[float] = deque(maxlen=8)   # job seconds, for Retry-After
        self.counts = {"answered": 0, "cancelled": 0, "refused_busy": 0,
                       "refused_invalid": 0, "failed": 0}
        self.last: dict = {}
        self._numbers = itertools.count(1)
        # the backend records each step as it runs it (a backend that records none: empty)
        self.steps: StepLog = getattr(backend, "steps", None) or StepLog()
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise QueueFull(5)
            job.no = next(self._numbers)
            if len(self._waiting) >= self.capacity and \
                    (self._running is not None or self._waiting):
                self.counts["refused_busy"] += 1
                raise QueueFull(self._retry_after())
            self._waiting.append(job)
            self._cv.notify()

    def withdraw(self, job: Job) -> None:
        """The client went away: stop the job if it runs (a prompt pass in flight completes
        and is kept for a resend, Cancel.leave), drop it if it waits."""
        job.cancel.leave()
        with self._cv:
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1

    def _retry_after(self) -> int:
        per_job = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, round(per_job * (len(self._waiting) + 1)))

    def status(self) -> dict:
        with self._cv:
            return {"busy": self._running is not None, "queued": len(self._waiting),
                    "queue_capacity": self.capacity, **self.counts, "last": dict(self.last),
                    "slot_figures": self.steps.slots(
                        [(self._running.no, 0)] if self._running is not None else []),
                    **({"prompt_cache": self.backend.cache.sizes()}
                       if hasattr(self.backend, "cache") else {})}

    def close(self) -> None:
        with self._cv:
            self._closing = True
            for job in self._waiting:
                job.cancel.set()
                job.post(Fail(ApiError(503, "the server is shutting down",
                                       type_="server_error")))
            self._waiting.clear()
            if self._running is not None:
                self._running.cancel.set()
            self._cv.notify()
        self._thread.join()

    def _watched(self, post):
        """Keep the outcome of the last job for /health (the load test and the
        cancellation test read it)."""
        def watch(item) -> None:
            if isinstance(item, Done):
                self.last = {"finish_reason": item.finish,
                             "completion_tokens": item.usage["completion_tokens"],
                             "reused_positions": item.ext["reused_positions"]}
            post(item)
        return watch

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                job = self._running = self._waiting.popleft()
            job.post = self._watched(job.post)
            t0 = time.monotonic()
            outcome = "failed"
            try:
                outcome = self.backend.execute(job)
            except ApiError as e:                 # refused before it started (400)
                outcome = "refused_invalid"
                job.post(Fail(e))
            except BaseException as e:             # an engine failure, or a bug
                job.post(Fail(engine_error(e)))
            finally:
                self.steps.leave(job.no)
                with self._cv:
                    self._running = None
                    self._recent.append(time.monotonic() - t0)
                    self.counts[outcome] += 1


def engine_error(e: BaseException) -> ApiError:
    """An engine failure in the OpenAI error shape, with the message `k3` would print."""
    d = describe(e)
    if d is None:
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error")
    code, kind, message = d
    return ApiError(400 if code == 2 else 500, message,
                    type_="invalid_request_error" if code == 2 else "server_error",
                    code=kind)


# ---------------------------------------------------------------- the engine adapter

# LimitError.kind -> (the request field it concerns, the OpenAI error code)
LIMIT_CODES = {"prompt": ("messages", "context_length_exceeded"),
               "positions": ("max_tokens", "context_length_exceeded"),
               "kv_cache": ("max_tokens", "kv_cache_refused"),
               "vocab": ("prompt", None)}


class Backend:
    """A loaded Engine and the sequences kept for later requests (prompt_cache).
    `execute(job)` posts Started, Deltas and Done (or raises ApiError before Started) and
    returns the job's outcome."""

    def __init__(self, engine, model_id: str, limits: Limits, spec: int = 0, cache=None):
        self.engine, self.model_id, self.limits = engine, model_id, limits
        self.spec = spec                   # speculative width of greedy requests (--spec)
        self.tok = engine.tok
        # kept sequences: their state, the exact ids they were fed, and the fork point
        # where their last user message started (a request that changes what followed,
        # e.g. a reply sent back without its reasoning, still reuses everything before
        # that message).  A request takes the one holding most of its prompt and gives it
        # back when done, so a failed one leaves nothing half advanced behind.
        self.cache = cache or PromptCache(engine)
        self.steps = StepLog()             # recent steps and per-request rates (/k3/steps)

    def close(self) -> None:
        self.cache.kept.clear()
        self.engine.close()

    def execute(self, job: Job) -> str:
        """One request alone: the same open_slot / loop / close_slot as a batch of one."""
        if job.cancel:
            return "cancelled"
        sink = self.engine.sink
        self.engine.sink = self._progress_to(job, sink)
        try:
            slot = self.open_slot(job)
            try:
                self.decode([slot.run], lambda run: slot)
            except BaseException:
                self.cache.give_back(slot.seq)     # a failed pass left it poisoned: dropped
                raise
            return self.close_slot(slot)
        finally:
            self.engine.sink = sink

    def decode(self, runs: list, slot_for, between=None) -> None:
        """The engine's decode loop over `runs` (generate.decode_many): each TokenOut
        relayed to its request (`slot_for(run)`), each step recorded for /k3/steps once
        its tokens are out (at the next step boundary, where `between()` then runs)."""
        step: list = []                # the last StepDone, then a slot per token it gave

        def record() -> None:
            if step:
                self.record_step(step[0], step[1:])
                step.clear()

        def boundary() -> None:
            record()
            if between is not None:
                between()
        for ev in decode_many(self.engine, runs, between=boundary):
            if isinstance(ev, TokenOut):
                run = runs[ev.row]
                slot = slot_for(run)
                if ev.id >= 0:
                    step.append(slot)
                self.relay(slot, ev, run.leave)
            elif isinstance(ev, StepDone):
                step[:] = [ev]
        record()

    def _progress_to(self, job: Job, sink):
        """The prompt pass's per-layer progress as the job's Progress (prompt positions
        read so far, the reused ones included), posted as each layer ends."""
        from ..events import LoadProgress

        def on_event(ev) -> None:
            if isinstance(ev, LoadProgress) and ev.phase == "prefill" and job.started:
                s = job.started
                frac = ev.done_bytes / ev.total_bytes if ev.total_bytes else 1.0
                job.post(Progress(s.reused + round((s.prompt_ids - s.reused) * frac),
                                  s.prompt_ids))
            else:
                sink(ev)
        return on_event

    def _conversation(self, req: GenRequest, spec: GenSpec):
        """A chat request's Conversation on the kept sequence that holds most of its
        rendered prompt, and the chat's end ids; refusals (no chat tokens, a prompt that
        does not render) as ApiError."""
        try:
            ends = tuple(self.engine.ctl.end_ids)
        except EngineError:
            raise ApiError(400, "this model has no tokenizer with chat control tokens",
                           code="chat_unsupported") from None
        conv = Conversation(self.engine, req.history)
        try:
            prompt = conv.render(spec)
        except ChatError as e:
            code = "context_length_exceeded" if "exceeds the limit" in str(e) else None
            raise ApiError(400, f"messages: {e}", param="messages", code=code) from None
        conv.seq = self.cache.take(prompt)
        return conv, ends

    def _gen_spec(self, req: GenRequest) -> GenSpec:
        return GenSpec(gen=req.gen, sampling=req.sampling.to_sampling(),
                       thinking=req.thinking, effort=req.effort, spec=self.spec)

    def _check(self, n_prompt: int, gen: int, ids=()) -> None:
        """The engine's limits (check_limits) as this server's 400s."""
        try:
            self.engine.check_limits(n_prompt, gen, ids, self.limits.max_prompt_ids)
        except LimitError as e:
            raise limit_error(e) from None

    def record_step(self, ev: StepDone, slots: list) -> None:
        """One engine step for /k3/steps: `slots` names a request once per token it got
        in the step (a batch step gives each one; a speculative sweep may give several)."""
        self.steps.record(ev.seconds, ev.telemetry,
                          [(s.job.no, s.index, n) for s, n in Counter(slots).items()])

    def relay(self, slot: Slot, ev, stop) -> None:
        """One TokenOut of a request as its Deltas: reasoning and content apart (chat), the
        text (completions), stop strings held back and trimmed; `stop()` ends generation
        at the next safe point once one matched."""
        job, stops = slot.job, slot.stops
        if slot.conv is None:
            if stops.hit is None:
                text = stops.push(ev.text)
                if text:
                    job.post(Delta("text", text))
                if stops.hit is not None:
                    stop()
            return
        if ev.phase in slot.texts:
            slot.texts[ev.phase] += ev.text
        if ev.phase == "thinking":
            slot.reasoning += ev.id >= 0
            if ev.text:
                job.post(Delta("reasoning", ev.text))
        elif ev.phase == "response":
            text = stops.push(ev.text)
            if text:
                job.post(Delta("content", text))
            if stops.hit is not None:
                stop()

    # -- completions (a batch turn on a kept sequence) ----------------------------------
    def _completion_ids(self, req: GenRequest) -> list[int]:
        """A completion's prompt as ids (text tokenized with added tokens recognised),
        refused (ApiError) beyond the engine's limits."""
        if isinstance(req.prompt, str):
            if self.tok is None:
                raise ApiError(400, "a text prompt needs the model's tokenizer (--tok); "
                                    "send token ids", param="prompt")
            ids = list(self.tok.encode(req.prompt, True))
        else:
            ids = list(req.prompt)
        self._check(len(ids), req.gen, ids)
        return ids

    def _completion_start(self, job: Job, spec: GenSpec, seq, ids: list[int]):
        """A completion's sequence prepared and Started posted: (positions reused, end ids,
        sampler, text parser)."""
        reuse = seq.prepare(ids, job.req.gen + 1)
        job.start(Started(len(ids), reuse))
        ends = tuple(self.engine.ctl.end_ids) if _has_ctl(self.engine) else ()
        sampler = spec.sampling.sampler()
        sampler.new_turn(1)
        # the text a client sees leaves every added (control) id out; the ids stay counted
        hidden = set(getattr(self.tok, "added", None) or ()) | set(ends)
        return reuse, ends, sampler, TextStream(self.tok, hidden)

    # -- a request in the decode loop (alone: execute; several: server/batching.py) -----
    def open_slot(self, job: Job) -> Slot:
        """Start a request for the batch: its refusals (ApiError, before Started), its
        sequence from the prompt cache, prepared; Started posted.  Alone in a step it
        is decoded as a single request is (speculation, a stop inside its prompt pass, the
        pass kept for a resend); beside others, plainly, stopping at step boundaries."""
        req = job.req
        spec = self._gen_spec(req)
        if req.kind == "chat":
            conv, ends = self._conversation(req, spec)
            seq = conv.seq
            try:
                n, reuse, fork_at, sampler, parser = conv.begin(spec)
            except LimitError as e:
                self.cache.give_back(seq)
                raise limit_error(e) from None
            job.start(Started(n, reuse))
        else:
            ids = self._completion_ids(req)
            conv, seq, n, fork_at = None, self.cache.take(ids), len(ids), 0
            reuse, ends, sampler, parser = self._completion_start(job, spec, seq, ids)
        run = Run(seq, spec, sampler, parser, end_ids=ends,
                       summary=TurnSummary([], n, reused=reuse), cancel=job.cancel,
                       stop_in_pass=True, fork_at=fork_at)
        return Slot(job, spec, StopMatcher(req.stops), seq, conv, run)

    def close_slot(self, slot: Slot) -> str:
        """A batched request's end: its reply settled (chat), Done posted, its sequence
        back in the prompt cache.  Returns the outcome."""
        res, job = slot.run.summary, slot.job
        try:
            if res.expert_drop is not None and slot.conv is None:
                raise res.expert_error             # never answer without an expert
            note = None
            if slot.conv is not None:
                slot.conv.settle(res, slot.spec, slot.texts)
                note = f"the reply closed but is not a well-formed turn: {res.malformed}" \
                    if res.malformed else None
            tail = slot.stops.flush()
            if tail:
                job.post(Delta("content" if slot.conv is not None else "text", tail))
            return self._done(job, slot.stops, res, slot.reasoning, note)
        finally:
            self.cache.give_back(slot.seq)

    def _done(self, job: Job, stops, res: TurnSummary, reasoning: int,
              note: str | None = None) -> str:
        finish = finish_reason(stops.hit, res.end_id, res.interrupted, res.new_ids, job.req.gen)
        ext = usage_ext(res, note)
        if stops.hit is not None:
            ext["stop"] = stops.hit               # which stop string matched
        job.post(Done(finish, usage_body(res.prompt_positions, len(res.ids), reasoning), ext))
        return "cancelled" if finish == "cancelled" else "answered"


def finish_reason(stop_hit, end_id, interrupted: bool, n: int, gen: int) -> str:
    """stop: an end id or a stop string; length: max_tokens reached; cancelled: the
    client left (or shutdown) before either."""
    if stop_hit is not None or end_id is not None:
        return "stop"
    if n >= gen:
        return "length"
    return "cancelled" if interrupted else "length"


def _has_ctl(engine) -> bool:
    try:
        engine.ctl
        return True
    except EngineError:
        return False


def limit_error(e: LimitError) -> ApiError:
    param, code = LIMIT_CODES.get(e.kind, (None, None))
    return ApiError(400, str(e), param=param, code=code)


def usage_ext(res: TurnSummary, note: str | None = None) -> dict:
    """The `k3` extension of a response's usage: the turn summary's figures (the same
    the app's stats line and the REPL's report show, rounded for the wire) and the ids."""
    figs = {k: round(v, 6) if isinstance(v, float) else v for k, v in res.figures().items()}
    per = res.decode_s_per_token
    return {**figs, "s_per_token": round(per, 6) if per is not None else None,
            "ids": [int(i) for i in res.ids], **({"note": note} if note else {})}
