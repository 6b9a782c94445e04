"""n-gram speculative decoding (SYSTEM §6.10): exact by construction.

Drafts come from the sequence itself (an evidence-gated suffix match); one forward pass
verifies them all, the longest prefix that equals the model's own argmax is kept plus the
model's next token, and a rejected tail is undone by restoring the recurrent state and
re-feeding the accepted positions.  The emitted ids equal serial greedy decode."""
from __future__ import annotations

from dataclasses import dataclass

from .model import Model, greedy
from .state import SequenceState, restore, snapshot

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


@dataclass
class SpecCounters:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


def spec_step(model: Model, seq: list[int], state: SequenceState, cap: int,
              counters: SpecCounters) -> tuple[list[int], object]:
    """One decode step with drafts; returns (emitted ids, logits of the last fed position).
    seq[state.n_cached:] is the one pending token."""
    d = draft(seq, min(cap, MAX_DRAFT))
    base = state.n_cached
    if not d or base + len(d) + 1 > state.capacity:
        logits = model.forward(seq[base:], state)
        return [greedy(logits)], logits
    counters.rounds += 1
    counters.drafted += len(d)
    snap = snapshot(state)
    logits = model.forward(seq[base:] + d, state, all_logits=True)
    a = [greedy(row) for row in logits]
    m = 0
    while m < len(d) and a[m] == d[m]:
        m += 1
    counters.accepted += m
    if m < len(d):                          # undo the rejected tail, replay what was kept
        restore(state, snap)
        state.n_cached = base
        model.forward(seq[base:] + d[:m], state)
    return d[:m] + [a[m]], logits[m]
