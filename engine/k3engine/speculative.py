"""n-gram speculative decoding (SYSTEM §6.10): exact by construction.

Drafts come from the sequence itself (an evidence-gated suffix match); one forward pass
verifies them all, the longest prefix that equals the model's own argmax is kept plus the
model's next token, and a rejected tail is undone.  The reference restores the recurrent
state and re-feeds the accepted positions (a second forward); we restore it and re-run
only the KDA recurrence and conv history on the sweep's logged inputs for the accepted
positions (state.keep_prefix): the same bits without a second pass over the weights.
The emitted ids equal serial greedy decode.
The same sweep verifies a draft model's proposals (draft.DraftModel, `--draft-trunk`) and a
block drafter's (drafter.BlockDrafter, `--draft-model`), which is also handed the target
features of the positions each step commits (its `capture`/`take`)."""
from __future__ import annotations

from dataclasses import dataclass

from .model import Model, greedy
from .state import SequenceState, begin_sweep, end_sweep, keep_prefix

MAX_DRAFT = 8


def draft(seq: list[int], cap: int) -> list[int]:
    """Continue the latest 4-gram (then 3-gram) suffix the way its most recent earlier
    occurrence continued, while the two most recent occurrences agree."""
    T = len(seq)
    for n in (4, 3):
        if T < n + 1:
            continue
        tail = seq[T - n:]
        matches = []
        for j in range(T - n - 1, -1, -1):
            if seq[j:j + n] == tail:
                matches.append(j)
                if len(matches) == 2:
                    break
        if not matches:
            continue
        m1 = matches[0]
        m2 = matches[1] if len(matches) > 1 else None
        d: list[int] = []
        i = 0
        while len(d) < cap and m1 + n + i < T:
            c = seq[m1 + n + i]
            if m2 is not None and (m2 + n + i >= m1 or seq[m2 + n + i] != c):
                break                       # the histories disagree or would overlap
            d.append(c)
            i += 1
        if d:
            return d
    return []


class NgramProposer:
    """Drafts from the sequence itself; stateless, nothing to rewind."""

    def propose(self, seq: list[int], cap: int) -> list[int]:
        return draft(seq, cap)

    def settle(self, drafted: list[int], accepted: int) -> None:
        pass


@dataclass
class SpecCounters:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    width_sum: int = 0          # --spec-auto: the widths offered, for the mean
    width: int = 0              # the sweep width at the end of the run

    @property
    def accepted_pct(self) -> float:
        return 100 * self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_run(self) -> float:
        """Accepted drafts per verify sweep."""
        return self.accepted / self.rounds if self.rounds else 0.0


class SpecWidth:
    """How many tokens a sweep may draft.  Fixed at N, or with --spec-auto adaptive: one
    wider after a sweep that kept every draft (up to the cap of 8), back to what was
    kept plus one after a rejection.  A sweep that kept nothing also pauses drafting for
    a few plain steps (1, 2, 4, ... up to 16 while the drafts keep missing), so a draft
    that never agrees costs an occasional probe instead of a replay on every step.
    Only the sweep size changes, never the ids."""

    MAX_PAUSE = 16

    def __init__(self, n: int, adaptive: bool = False):
        self.n = max(1, min(int(n), MAX_DRAFT))
        self.adaptive = adaptive
        self.pause = 0              # plain steps left before the next draft
        self._backoff = 0

    def ready(self) -> bool:
        """May the step in hand draft?  (A paused step is spent as a plain one.)"""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        self.n = min(self.n + 1, MAX_DRAFT) if accepted == drafted else max(1, accepted + 1)
        if accepted == 0:
            self._backoff = min(max(1, 2 * self._backoff), self.MAX_PAUSE)
            self.pause = self._backoff
        else:
            self._backoff = 0


def spec_step(model: Model, seq: list[int], state: SequenceState, cap: int,
              counters: SpecCounters, proposer=None, stops=frozenset()
              ) -> tuple[list[int], object]:
    """One decode step with drafts; returns (emitted ids, logits of the last fed position).
    seq[state.n_cached:] is the one pending token.  `proposer` drafts (n-gram when None)
    and is told how many of its drafts were kept.  An accepted draft that is a stop id ends
    the sweep there: the state keeps nothing after it (trap: a sweep that ran past an end
    id left the state ahead of the ids, and the next chat turn could reuse nothing --
    test_engine_shape.py::test_speculation_in_a_chat_turn_gives_the_greedy_ids)."""
    proposer = proposer or NgramProposer()
    base = state.n_cached
    cap = min(cap, MAX_DRAFT, state.capacity - base - 1)
    d = proposer.propose(seq, cap) if cap > 0 else []
    features = getattr(proposer, "capture", None)   # a block drafter reads the pass
    capture = features() if features is not None else None
    if not d:
        logits = model.forward(seq[base:], state, capture=capture)
        if capture is not None:
            proposer.take(seq, base, seq[base:], capture)
        return [greedy(logits)], logits
    counters.rounds += 1
    counters.drafted += len(d)
    counters.width_sum += cap
    snap = begin_sweep(state)
    try:
        logits = model.forward(seq[base:] + d, state, all_logits=True, capture=capture)
        a = [greedy(row) for row in logits]
        m = 0
        while m < len(d) and a[m] == d[m] and d[m] not in stops:
            m += 1
        counters.accepted += m
        proposer.settle(d, m)
        if capture is not None:             # the kept rows only: the anchor and accepted
            proposer.take(seq, base, seq[base:] + d[:m], capture)
        if m < len(d):                      # drop the rejected tail, keep what was accepted
            keep_prefix(state, snap, base, m + 1)
    finally:
        end_sweep(state)
    return d[:m] + [a[m]], logits[m]
