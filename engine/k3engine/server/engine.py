"""One generation at a time: the engine thread, its bounded queue, and the adapter from a
validated request to the run API's events.

The engine owns the machine's memory (the plan was made for one sequence), so requests run
one after another on ONE thread; the event loop only submits jobs and reads what they post.
A job that cannot wait (the queue is full) is refused at once (`QueueFull`, the route's 429).
Each job has its own `Cancel`: a disconnecting client, a stop string or shutdown sets it,
and the engine honours it at the next safe point (between the layers of the prompt pass,
between decode steps).

The state of the last request is kept (one sequence, as the plan counts): the next request
reuses it when its prompt extends what was fed (chat.reuse_positions, all or nothing), which
is how a conversation continued request after request skips re-reading its history.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..chat import ChatError, ChatOptions
from ..errors import describe
from ..session import Cancel, Carried
from .protocol import ApiError, GenRequest, Limits, usage_body
from .stops import StopMatcher


# ---------------------------------------------------------------- what a job posts

@dataclass(frozen=True)
class Started:
    prompt_ids: int


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
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise QueueFull(5)
            if len(self._waiting) >= self.capacity and \
                    (self._running is not None or self._waiting):
                self.counts["refused_busy"] += 1
                raise QueueFull(self._retry_after())
            self._waiting.append(job)
            self._cv.notify()

    def withdraw(self, job: Job) -> None:
        """The client went away: stop the job if it runs, drop it if it waits."""
        job.cancel.set()
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
                    "queue_capacity": self.capacity, **self.counts, "last": dict(self.last)}

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


# ---------------------------------------------------------------- the run API adapter

class Backend:
    """A loaded `Run` and the one kept sequence state.  `execute(job)` posts Started, Deltas
    and Done (or raises ApiError before Started) and returns the job's outcome."""

    def __init__(self, run, model_id: str, limits: Limits, available=None):
        from ..run import chat_controls
        self.run, self.model_id, self.limits = run, model_id, limits
        self.available = available         # memory.available_memory() before the load
        self.tok = run.tok
        self.ctl = chat_controls(run.tok) if run.tok is not None else None
        # the last request's sequence (session.Carried): its state, the exact ids it was
        # fed, and the chat's snapshots where its last user message started (a request
        # that changes what followed, e.g. a reply sent back without its reasoning, still
        # reuses everything before that message).  Taken out while a request runs, so a
        # failed one leaves nothing half advanced behind.
        self.kept = Carried()

    def close(self) -> None:
        self.kept = Carried()
        self.run.close()

    def _take(self) -> Carried:
        kept, self.kept = self.kept, Carried()
        return kept

    def execute(self, job: Job) -> str:
        if job.cancel:
            return "cancelled"
        if job.req.kind == "chat":
            return self._chat(job)
        return self._completion(job)

    # -- shared ----------------------------------------------------------------------
    def _check_length(self, n_prompt: int, gen: int) -> None:
        from ..session import MAX_POSITIONS
        lim = self.limits.max_prompt_ids
        if n_prompt > lim:
            raise ApiError(400, f"the prompt is {n_prompt} tokens; this server's limit is "
                                f"{lim} (refused, never truncated)", param="messages",
                           code="context_length_exceeded")
        if n_prompt + gen + 1 > MAX_POSITIONS:
            raise ApiError(400, f"prompt {n_prompt} + max_tokens {gen} + 1 exceeds the "
                                f"{MAX_POSITIONS}-position ceiling", param="max_tokens",
                           code="context_length_exceeded")
        # the KV cache of this request must fit, as every chat turn's (SYSTEM 5.5.1)
        from ..memory import kv_check
        kv = kv_check(self.run.setup.figures, n_prompt + gen + 1, self.available)
        if kv.refusal is not None:
            raise ApiError(400, kv.refusal.message, param="max_tokens",
                           code="kv_cache_refused")

    # -- chat ------------------------------------------------------------------------
    def _chat(self, job: Job) -> str:
        from ..events import StepDone, TokenOut, TurnEnded
        from ..session import ChatSession
        req = job.req
        if self.ctl is None:
            raise ApiError(400, "this model has no tokenizer with chat control tokens",
                           code="chat_unsupported")
        try:
            opts = ChatOptions(thinking=req.thinking, effort=req.effort)
            chat = ChatSession(self.run.lm, self.tok, self.ctl, req.history, opts,
                               req.sampling.run_sampling().sampler(), incremental=True)
            prompt = chat.render()
        except ChatError as e:
            code = "context_length_exceeded" if "exceeds the limit" in str(e) else None
            raise ApiError(400, f"messages: {e}", param="messages", code=code) from None
        self._check_length(len(prompt), req.gen)
        chat.adopt(self._take())
        job.post(Started(len(prompt)))
        acc = Figures()
        stops = StopMatcher(req.stops)
        result = None
        ids: list[int] = []
        try:
            for ev in self.run.turn(chat, req.gen, job.cancel):
                if isinstance(ev, StepDone):
                    acc.step(ev)
                elif isinstance(ev, TokenOut):
                    if ev.id >= 0:
                        ids.append(ev.id)
                    if ev.phase == "thinking":
                        acc.reasoning += ev.id >= 0
                        if ev.text:
                            job.post(Delta("reasoning", ev.text))
                    elif ev.phase == "response":
                        text = stops.push(ev.text)
                        if text:
                            job.post(Delta("content", text))
                        if stops.hit is not None:
                            job.cancel.set()      # generation ends at the next safe point
                elif isinstance(ev, TurnEnded):
                    result = ev.result
        except ChatError as e:
            # The model closed its turn with an end id, but the reply does not parse
            # strictly (chat.parse_reply: `k3 --chat` exits 1 here).  The text already
            # streamed stands; the request ends as `stop` and says why.
            from ..session import TurnResult
            result = TurnResult(ids, len(prompt), None, acc.seconds, acc.first or 0.0,
                                ids[-1] if ids else None)
            acc.note = f"the reply closed but is not a well-formed turn: {e}"
        finally:
            if not (chat.state is not None and chat.state.poisoned):
                self.kept = chat.carried()
        tail = stops.flush()
        if tail:
            job.post(Delta("content", tail))
        finish = finish_reason(stops.hit, result.end_id, result.interrupted,
                               len(result.ids), req.gen)
        job.post(Done(finish, usage_body(result.prompt_ids, len(result.ids), acc.reasoning),
                      acc.ext(result.first_token_seconds, len(result.ids), result.reused,
                              result.prompt_ids, result.ids)))
        return "cancelled" if finish == "cancelled" else "answered"

    # -- completions (the batch loop on the kept state) -------------------------------
    def _completion(self, job: Job) -> str:
        from ..chat import reuse_positions
        from ..events import Finished, StepDone, TokenOut
        from ..state import grown
        from ..tokenizer import StreamDecoder
        req, run = job.req, self.run
        if isinstance(req.prompt, str):
            if self.tok is None:
                raise ApiError(400, "a text prompt needs the model's tokenizer (--tok); "
                                    "send token ids", param="prompt")
            ids = list(self.tok.encode(req.prompt, True))
        else:
            ids = list(req.prompt)
            bad = next((i for i in ids if i >= run.cfg.vocab), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is outside the vocabulary of "
                                    f"{run.cfg.vocab}", param="prompt")
        self._check_length(len(ids), req.gen)
        kept = self._take()                       # the batch loop keeps no chat forks
        reuse = reuse_positions(kept.record, ids, cached=kept.state.n_cached) \
            if kept.usable else 0
        carried = (grown(kept.state, len(ids) + req.gen + 1), ids[:reuse]) if reuse else None
        job.post(Started(len(ids)))
        ends = tuple(self.ctl.end_ids) if self.ctl is not None else ()
        # the text a client sees leaves the end ids out (Run.generate's own text has them)
        stream = StreamDecoder(self.tok) if self.tok is not None else None
        stops = StopMatcher(req.stops)
        acc = Figures()
        out: list[int] = []
        res = None
        for ev in run.generate(job.cancel, stop_in_pass=True, ids=ids[reuse:], gen=req.gen,
                               sampler=req.sampling.run_sampling().sampler(),
                               stop_ids=ends, carried=carried):
            if isinstance(ev, StepDone):
                acc.step(ev)
            elif isinstance(ev, TokenOut):
                out.append(ev.id)
                if stream is not None and ev.id not in ends:
                    text = stops.push(stream.push(ev.id))
                    if text:
                        job.post(Delta("text", text))
                if stops.hit is not None:
                    job.cancel.set()              # generation ends at the next safe point
            elif isinstance(ev, Finished):
                res = ev.result
        if res.state is not None and not res.state.poisoned:
            self.kept = Carried(res.state, res.full_ids[:res.state.n_cached])
        tail = stops.flush() + (stream.flush() if stream is not None and stops.hit is None
                                else "")
        if tail:
            job.post(Delta("text", tail))
        end = res.stopped_at if res.stopped_at >= 0 else None
        finish = finish_reason(stops.hit, end, res.interrupted, len(out), req.gen)
        job.post(Done(finish, usage_body(len(ids), len(out), 0),
                      acc.ext(acc.first or 0.0, len(out), reuse, len(ids), out)))
        return "cancelled" if finish == "cancelled" else "answered"


def finish_reason(stop_hit, end_id, interrupted: bool, n: int, gen: int) -> str:
    """stop: an end id or a stop string; length: max_tokens reached; cancelled: the
    client left (or shutdown) before either."""
    if stop_hit is not None or end_id is not None:
        return "stop"
    if n >= gen:
        return "length"
    return "cancelled" if interrupted else "length"


class Figures:
    """The `k3` extension figures of one request, summed over its steps."""

    def __init__(self):
        self.seconds = 0.0
        self.bytes_read = 0
        self.peak_rss = 0
        self.reasoning = 0
        self.first: float | None = None      # seconds to the first step's end
        self.note: str | None = None

    def step(self, ev) -> None:
        if self.first is None:
            self.first = self.seconds + ev.seconds
        self.add(ev.seconds, ev.telemetry)

    def add(self, seconds: float, t) -> None:
        self.seconds += seconds
        self.bytes_read += t.trunk_bytes + t.expert_bytes + t.model_table_bytes
        self.peak_rss = max(self.peak_rss, t.peak_rss_bytes)

    def ext(self, ttft: float, n: int, reused: int, prompt: int, ids) -> dict:
        decode = max(self.seconds - ttft, 0.0)
        return {"ttft_s": round(ttft, 6),
                "s_per_token": round(decode / (n - 1), 6) if n > 1 else None,
                "bytes_read": self.bytes_read, "peak_rss_bytes": self.peak_rss,
                "reused_positions": reused, "prompt_positions": prompt,
                "ids": list(int(i) for i in ids), **({"note": self.note} if self.note else {})}
