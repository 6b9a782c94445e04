"""A conversation on one engine (SYSTEM §9.3-§9.4), with no Qt and no terminal in it: the
REPL, K3 Studio and the server's chat route all run their turns through this.

It owns the history, the Sequence that carries the state from turn to turn (the next turn
reuses what its rendered prompt still shares: all of it, or everything before an edited
message through a fork point), the incomplete last reply (a Stop or the limit came before
its end id: `continue_turn` resumes it with the same ids an uninterrupted turn would
have), which earlier replies were answered while incomplete, and the sampler (one PCG32
stream per conversation and settings, reseeded per turn, §9.5).

Each turn is a generator of the engine's events (TurnStarted, StepDone, TokenOut,
TurnEnded) that returns the TurnSummary; a reply that closes is parsed and joins the history.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from . import events as E
from .chat import (ASSISTANT, ChatError, ChatOptions, History, Message, ReplyStream,
                   encode_prompt, parse_reply, render_segments)
from .generate import Cancel, GenSpec, Sampling, Turn, TurnSummary

__all__ = ["Conversation", "PendingReply", "ReplyDraft"]


@dataclass
class PendingReply:
    """A reply that stopped without its end id: every id but the last was fed to the
    state, the last was sampled and not yet fed -- exactly where the uninterrupted turn
    would be before its next step."""
    ids: list[int]
    prompt_positions: int
    reused: int
    content: str
    reasoning: str | None
    why: str                          # "stopped" | "limit"
    continuable: bool = True          # False: the state is gone (another session, a reload)

    def as_dict(self) -> dict:
        return dict(ids=list(self.ids), content=self.content, reasoning=self.reasoning,
                    why=self.why, continuable=self.continuable)


class ReplyDraft:
    """The reply being written, for a crash copy: the ids and the text of each phase as
    they stream, and when the copy is due (as the first tokens come, then about once a
    second) -- what the app's library and the REPL's partial file save, so a kill -9 loses
    at most that much of a reply (issue 47)."""

    EVERY_S = 1.0

    def __init__(self, ids=(), content: str = "", reasoning: str | None = ""):
        self.ids, self.content, self.reasoning = list(ids), content, reasoning
        self._saved = 0.0

    def push(self, tok_id: int, phase: str, text: str) -> None:
        if tok_id >= 0:
            self.ids.append(int(tok_id))
        if phase == "response":
            self.content += text
        elif phase == "thinking" and self.reasoning is not None:
            self.reasoning += text

    def due(self) -> bool:
        """True (and the clock reset) when a copy should be written now."""
        if not self.ids or time.monotonic() - self._saved < self.EVERY_S:
            return False
        self._saved = time.monotonic()
        return True

    def as_dict(self) -> dict:
        return dict(ids=list(self.ids), content=self.content, reasoning=self.reasoning,
                    why="stopped")


class Conversation:
    def __init__(self, engine, history: History | None = None, seq=None,
                 incomplete=(), sampler=None):
        self.engine = engine
        self.history = history if history is not None else History()
        # no engine (no model loaded): the transcript can be edited, not answered
        self.seq = seq if seq is not None or engine is None else engine.sequence()
        self.pending: PendingReply | None = None
        self.incomplete: set[int] = set(incomplete)
        self.turn0 = self.history.assistant_count()
        self.turns_done = 0
        self._fixed = sampler                 # a sampler given by the caller wins (tests)
        self._sampler = None
        self._sampling: Sampling | None = None

    # -- the transcript --------------------------------------------------------------
    def messages(self) -> list[dict]:
        """Plain message dicts; `incomplete` marks replies that were cut short and answered
        anyway."""
        return [{"role": m.role, "content": m.content, "reasoning": m.reasoning_content,
                 "incomplete": i in self.incomplete} for i, m in enumerate(self.history)]

    def replace_history(self, history: History, incomplete=()) -> None:
        """Another transcript on the same sequence: the next turn reuses what still matches,
        the sampler's turn index follows the new history as a fresh conversation's would."""
        self.history = history
        self.incomplete = set(incomplete)
        self.turn0, self.turns_done = history.assistant_count(), 0
        self.pending = None

    def add_user(self, text: str, answer_incomplete: bool = True) -> None:
        """A new user message (ChatError when the history cannot take it, nothing changed).
        An incomplete reply it answers joins the transcript, marked incomplete (the app);
        with `answer_incomplete` False it is dropped with its question, which the new
        message replaces (the REPL).  An unanswered user message (a turn that failed or was
        stopped before its first token) is replaced."""
        msg = Message("user", text)
        if self.history.ends_with_user:
            if self.pending is not None and answer_incomplete:
                self.commit_pending()
            else:
                self.history.remove_last()
        self.pending = None
        self.history.add(msg)

    def commit_pending(self) -> None:
        p = self.pending
        if p is None or not self.history.ends_with_user:
            return
        self.history.add(Message(ASSISTANT, p.content, p.reasoning))
        self.incomplete.add(len(self.history) - 1)
        self.turns_done += 1
        self.pending = None

    def drop_reply(self) -> None:
        """Regenerate: the last reply (complete or not) goes; its user message stays."""
        self.pending = None
        if len(self.history) and self.history[-1].role == ASSISTANT:
            self.history.remove_last()
            self.incomplete.discard(len(self.history))
            self.turns_done = max(0, self.turns_done - 1)

    def take_back(self) -> None:
        """Remove the last exchange (the last user message and any reply after it)."""
        self.pending = None
        if len(self.history) and self.history[-1].role == ASSISTANT:
            self.history.remove_last()
        if len(self.history) and self.history[-1].role == "user":
            self.history.remove_last()
        self.incomplete = {i for i in self.incomplete if i < len(self.history)}

    def edit(self, index: int, text: str) -> None:
        """Replace the user message at `index`: the conversation forks there (what came
        after is dropped); the next turn reuses the state up to it (a fork point)."""
        msgs = list(self.history)
        if not (0 <= index < len(msgs)) or msgs[index].role != "user":
            raise ChatError(f"message {index + 1} is not a user message")
        self.replace_history(History(msgs[:index] + [Message("user", text)]),
                             {i for i in self.incomplete if i < index})

    def set_system(self, text: str) -> None:
        """Replace (or drop) the system message; the rest of the transcript is kept."""
        rest = [m for m in self.history if m.role != "system"]
        shift = (1 if text else 0) - (1 if self.history.system is not None else 0)
        self.replace_history(History(([Message("system", text)] if text else []) + rest),
                             {i + shift for i in self.incomplete})

    def reset(self) -> None:
        """/reset: drop everything but an initial system message (and the state)."""
        self.history.reset()
        self.incomplete, self.pending = set(), None
        if self.seq is not None:
            self.seq.drop()

    # -- rendering -------------------------------------------------------------------
    def render(self, spec: GenSpec) -> list[int]:
        """The prompt of the next turn (refused with ChatError: too long, empty)."""
        return encode_prompt(self.engine.tok, render_segments(self.history, _opts(spec)))

    def _user_boundary(self, prompt: list[int], spec: GenSpec) -> int:
        """Where the last user message starts in `prompt` (the history without it renders
        to a prefix of the full render: segments are encoded independently, §9.2)."""
        msgs = list(self.history)
        if not msgs or msgs[-1].role != "user":
            return 0
        try:
            head = encode_prompt(self.engine.tok, render_segments(
                History(msgs[:-1]), _opts(spec), generation_prompt=False))
        except Exception:              # noqa: BLE001 - no fork point, nothing else changes
            return 0
        return len(head) if prompt[:len(head)] == head else 0

    def sampler_for(self, sampling: Sampling):
        """One sampler per conversation and sampling settings (the stream is seeded per
        turn), rebuilt only when the settings change."""
        if self._fixed is not None:
            return self._fixed
        if self._sampler is None or sampling != self._sampling:
            self._sampler, self._sampling = sampling.sampler(), sampling
        return self._sampler

    # -- turns -----------------------------------------------------------------------
    def begin(self, spec: GenSpec):
        """Prepare the next turn: render, refuse what the engine cannot hold (ChatError,
        LimitError, nothing changed), seed the sampler, and make the sequence hold the
        prompt, reusing what it can.  Returns (prompt length, positions reused, fork
        point, sampler, parser)."""
        engine = self.engine
        prompt = self.render(spec)
        engine.check_limits(len(prompt), spec.gen)
        sampler = self.sampler_for(spec.sampling)
        sampler.new_turn(self.turn0 + self.turns_done + 1)
        self.pending = None
        boundary = self._user_boundary(prompt, spec)
        reuse = self.seq.prepare(prompt, spec.gen + 1)
        return len(prompt), reuse, boundary, sampler, \
            ReplyStream(engine.tok, engine.ctl, spec.thinking)

    def turn(self, spec: GenSpec, cancel: Cancel | None = None):
        """Answer the history (which ends with a user message).  Yields TurnStarted, the
        decode's StepDone/TokenOut and TurnEnded; returns the TurnSummary.  Refusals come
        first (ChatError for a render refusal, LimitError), with nothing changed.  A stop
        is honoured between the prompt pass's layers (no token, the state dropped) and
        between tokens."""
        n_prompt, reuse, boundary, sampler, parser = self.begin(spec)
        yield E.TurnStarted(n_prompt, reuse, spec.gen)
        return (yield from self._run(spec, sampler, cancel, parser, fork_at=boundary,
                                     reused=reuse, prompt_positions=n_prompt))

    def continue_turn(self, spec: GenSpec, cancel: Cancel | None = None):
        """Resume the incomplete reply for up to `spec.gen` more ids, as the uninterrupted
        turn would have gone on.  With the state still held, its last id is fed now and the
        sampler's stream goes on: the same ids.  A reply whose state is gone (reopened after
        a restart or a crash, ids known) is resumed by one pass over the transcript and the
        reply so far: the same ids for greedy decoding (a prefill in one pass or many gives
        the same bits); a sampled one goes on with its stream advanced one draw per id.
        The summary's ids are the whole reply.  Refused (ChatError) when there is nothing
        to continue."""
        p = self.pending
        held = p is not None and self.seq is not None and self.seq.usable and \
            self.seq.pending == p.ids[-1:]
        if p is None or not p.continuable or not p.ids or self.engine is None:
            raise ChatError("there is no incomplete reply to continue")
        sampler = self.sampler_for(spec.sampling)
        if held:
            n_prompt, reused = p.prompt_positions, p.reused
            self.engine.check_limits(n_prompt + len(p.ids), spec.gen)
            self.seq.extend([], spec.gen + 1)
        else:
            prompt = self.render(spec)
            n_prompt = len(prompt)
            self.engine.check_limits(n_prompt + len(p.ids), spec.gen)
            sampler.new_turn(self.turn0 + self.turns_done + 1)
            sampler.skip(len(p.ids))
            reused = self.seq.prepare(prompt + list(p.ids), spec.gen + 1)
        yield E.TurnStarted(n_prompt, reused, spec.gen)
        self.pending = None
        parser = ReplyStream(self.engine.tok, self.engine.ctl, spec.thinking)
        for tok_id in p.ids:                  # the parser picks up the reply's phase
            parser.push(tok_id)
        return (yield from self._run(spec, sampler, cancel, parser, reused=reused,
                                     prompt_positions=n_prompt, prior=p.ids,
                                     texts={"thinking": p.reasoning or "",
                                            "response": p.content}))

    def _run(self, spec, sampler, cancel, parser, texts=None, **how):
        texts = dict(texts or {"thinking": "", "response": ""})
        turn = Turn(self.engine.generate(self.seq, spec, sampler, cancel, parser=parser,
                                         stop_in_pass=True, end_ids=self.engine.ctl.end_ids,
                                         **how))
        try:
            for ev in turn:
                if isinstance(ev, E.TokenOut) and ev.phase in texts:
                    texts[ev.phase] += ev.text
                yield ev
        except BaseException:
            self.seq.drop()                   # a failed pass: the next turn starts afresh
            raise
        res = turn.summary
        self.settle(res, spec, texts)
        yield E.TurnEnded(res)
        return res

    def settle(self, res: TurnSummary, spec: GenSpec, texts: dict) -> None:
        """A turn's end: a closed reply parsed into the history (or `res.malformed`), an
        incomplete one kept as `pending`, a failed one's state dropped (raises the
        expert failure)."""
        if res.expert_drop is not None:       # never keep a reply computed without an expert
            self.seq.drop()
            raise res.expert_error
        if not self.seq.usable:
            self.seq.drop()                   # stopped inside the prompt pass
        if res.end_id is not None:
            try:
                res.reasoning, res.content = parse_reply(self.engine.tok, self.engine.ctl,
                                                         res.ids, spec.thinking)
            except ChatError as e:
                res.malformed = str(e)        # the text streamed stands; the caller says so
                return
            self.history.add(Message(ASSISTANT, res.content, res.reasoning))
            self.turns_done += 1
        elif res.ids:
            self.pending = PendingReply(
                list(res.ids), res.prompt_positions, res.reused, texts["response"],
                texts["thinking"] if spec.thinking else None,
                "stopped" if res.interrupted else "limit", continuable=self.seq.usable)


def _opts(spec: GenSpec) -> ChatOptions:
    return ChatOptions(thinking=spec.thinking, effort=spec.effort)
