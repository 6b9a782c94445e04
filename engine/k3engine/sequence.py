"""One sequence on a loaded model: its token ids, its KDA/MLA state, how many of the ids the
state has taken in (its position), whether a failed pass poisoned it, and the fork points
it keeps (recurrent snapshots where a user message started, so an edit of that message
reuses everything before it).

Sequences are made by the engine (`Engine.sequence()`, `Engine.resume(path)`) and fed only
by the decode generator (generate.decode); nothing outside the engine touches the state.

    ids[:position]   fed: the state holds them
    ids[position:]   pending: the prompt still to prefill, or the last sampled id (a reply
                     that stopped, a batch run's last token) that the next step feeds
"""
from __future__ import annotations

import numpy as np

from .chat import reuse_positions
from .errors import StateUnusable
from .state import SequenceState, grown, restore, snapshot

__all__ = ["Sequence", "FORK_SNAPSHOT_BYTES", "feed_together"]

# Recurrent-state snapshots kept for forks (an edited earlier message): at most this many
# bytes in all, newest first.  One snapshot is the KDA state (626 MB on the released model,
# so there an edit re-prefills; ~13 MB on `mid`, ~0.1 MB on the demo).
FORK_SNAPSHOT_BYTES = 64 << 20


class Sequence:
    def __init__(self, model, shared_recurrent: bool = False, features=None):
        self._model = model
        self._shared = shared_recurrent     # --ultra-low-memory recompute: one KDA slot
        # a block drafter (drafter.BlockDrafter) takes the features of every position a
        # pass commits, so it can draft from the next one on; None: nothing is captured
        self.features = features
        self.state: SequenceState | None = None
        self.ids: list[int] = []
        # (position, recurrent snapshot): the state after ids[:position]
        self.forks: list[tuple[int, list[np.ndarray]]] = []
        # the logits after the last fed position, kept when a prompt pass completed for a
        # requester that left before its first token (generate.Cancel.leave): the same
        # prompt sent again needs no pass at all
        self.logits: np.ndarray | None = None

    # -- what it holds -------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Ids the state has taken in (0 for a sequence without a usable state)."""
        return self.state.n_cached if self.usable else 0

    @property
    def pending(self) -> list[int]:
        return self.ids[self.position:]

    @property
    def poisoned(self) -> str | None:
        """Why the state may not be reused, saved or resumed (a pass failed or was stopped
        part-way, SYSTEM §4.9), or None."""
        return self.state.poisoned if self.state is not None else None

    @property
    def usable(self) -> bool:
        return self.state is not None and not self.state.poisoned

    def nbytes(self) -> int:
        return (self.state.nbytes() if self.state is not None else 0) + \
            sum(a.nbytes for _, s in self.forks for a in s)

    # -- preparing a request -----------------------------------------------------------
    def extend(self, ids, room: int) -> None:
        """Append `ids` as pending (a batch prompt after a resumed or kept state) with room
        for `room` more positions after them."""
        if not self.usable:
            self.drop()
        self.ids += list(ids)
        self._room(len(self.ids) + room)

    def reusable(self, prompt: list[int]) -> int:
        """The positions of `prompt` this sequence could serve (what `prepare` would
        reuse), without changing anything: all it fed when the prompt extends that (the
        recurrent state cannot be truncated, §9.4), else the newest fork point the prompt
        starts with, else 0."""
        if not self.usable:
            return 0
        n = self.position
        if reuse_positions(self.ids[:n], prompt):
            return n
        if self.logits is not None and n == len(prompt) and prompt == self.ids[:n]:
            return n
        return next((pos for pos, _ in reversed(self.forks)
                     if 0 < pos < len(prompt) and pos <= n and self.ids[:pos] == prompt[:pos]),
                    0)

    def prepare(self, prompt: list[int], room: int) -> int:
        """Make this sequence hold `prompt` (a rendered transcript, a completion prompt),
        reusing what `reusable` finds (restoring a fork point's snapshot when that is it).
        Returns the positions reused; the rest of `prompt` is pending, with room for `room`
        more."""
        reuse = self.reusable(prompt)
        if reuse < len(prompt):
            self.logits = None                 # they belong to the whole prompt only
        if reuse == 0:
            self.drop()
        elif reuse < self.position:
            snap = next(s for pos, s in self.forks if pos == reuse)
            restore(self.state, snap)
            self.state.n_cached = reuse        # later MLA rows are overwritten as it goes
            self.forks = [(p, s) for p, s in self.forks if p <= reuse]
        self.ids = list(prompt)
        self._room(len(prompt) + room)
        return reuse

    def _room(self, capacity: int) -> None:
        if self.state is None:
            self.state = self._model.new_state(capacity, shared_recurrent=self._shared)
        else:
            self.state = grown(self.state, capacity)

    # -- feeding (generate.decode) -------------------------------------------------------
    def feed(self, n: int, cancel=None, on_layer=None):
        """Run the next `n` pending ids through the model; the logits of the last position.
        A pass that fails or is stopped part-way poisons the state (Model.forward), and
        nothing reuses it afterwards."""
        return feed_together([(self, n)], cancel, on_layer)[0]

    def recompute(self, cancel=None):
        """The reference's default decode: the whole sequence from a fresh state."""
        self.state.reset()
        return self._model.forward(self.ids, self.state, cancel=cancel)

    def keep_fork(self) -> None:
        """Snapshot the recurrent state at the current position (a fork point)."""
        pos = self.position
        snap = snapshot(self.state)
        self.forks = [(p, s) for p, s in self.forks if p < pos] + [(pos, snap)]
        while self.forks and sum(a.nbytes for _, s in self.forks for a in s) \
                > FORK_SNAPSHOT_BYTES:
            self.forks.pop(0)                  # the oldest go first

    def drop(self) -> None:
        """Forget the state (the next request prefills from scratch)."""
        self.state, self.ids, self.forks, self.logits = None, [], [], None

    # -- copies and files ----------------------------------------------------------------
    def fork(self) -> "Sequence":
        """An independent copy (state, ids and fork points) that can go its own way."""
        c = Sequence(self._model, self._shared, self.features)
        c.ids, c.forks, c.logits = list(self.ids), list(self.forks), self.logits
        if self.state is not None:
            c.state = grown(self.state, self.state.capacity + 1)    # a copy, rows included
            c.state.poisoned = self.state.poisoned
        return c

    def save(self, path: str) -> int:
        """Write a state file v2 (statefile.save_state); refused for a poisoned state or
        none (SYSTEM §4.9: nothing is saved after exit 4).  Returns the bytes written."""
        from .statefile import save_state
        if not self.usable:
            raise StateUnusable(f"{path}: not written: {self.poisoned or 'no state'}")
        return save_state(path, self.state, self.ids)


def feed_together(items, cancel=None, on_layer=None) -> list:
    """Feed several sequences in ONE pass (Model.forward_batch): `items` is (sequence, n)
    -- the next n pending ids of each.  Each gets the logits of its last fed position, bit
    for bit what it would get alone; a pass that fails poisons every state it carried."""
    model = items[0][0]._model
    fed, starts = [], []
    for seq, n in items:
        p = seq.position
        seq.logits = None
        fed.append((seq.ids[p:p + n], seq.state))
        starts.append(p)
    # a block drafter (the engine's one) takes the features of its sequences' rows; they
    # are captured only when there is one
    f = next((seq.features for seq, _ in items if seq.features is not None), None)
    cap = f.capture() if f is not None else None
    logits = model.forward_batch(fed, cancel=cancel, on_layer=on_layer, capture=cap)
    row = 0
    for (seq, n), p in zip(items, starts):
        if seq.features is not None:
            seq.features.take(seq.ids, p, seq.ids[p:p + n], cap, row)
        row += n
    return logits

