"""Per-sequence state (ARCHITECTURE §6): what one sequence carries between forward calls.

KDA layers carry the recurrent matrix S [H, D, D] (row = key channel) and the raw
ShortConv history of q, k and v [P, K-1] (oldest first).  MLA layers carry the expanded
cache KV [capacity, H*(d_n+d_v)] and one shared rope key per position R [capacity, d_r].
Nothing else crosses tokens: the AttnRes stack is rebuilt on every call (trap #32).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig


class CacheOverflowError(RuntimeError):
    """Writing past the MLA cache capacity aborts the run (trap #44)."""


@dataclass
class KDAState:
    S: np.ndarray
    conv_q: np.ndarray
    conv_k: np.ndarray
    conv_v: np.ndarray
    # While a speculative sweep is logged: per forward call, the raw q/k/v projections
    # (the conv history's inputs) and the recurrence's inputs q, k, v, alpha, beta.
    log: list | None = None

    @classmethod
    def zeros(cls, cfg: ModelConfig) -> "KDAState":
        H, D, P, K = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_proj, cfg.conv_k
        z = lambda *shape: np.zeros(shape, dtype=np.float32)  # noqa: E731
        return cls(z(H, D, D), z(P, K - 1), z(P, K - 1), z(P, K - 1))

    def reset(self) -> None:
        for a in (self.S, self.conv_q, self.conv_k, self.conv_v):
            a.fill(0.0)


@dataclass
class MLAState:
    kv: np.ndarray
    rope: np.ndarray

    @classmethod
    def empty(cls, cfg: ModelConfig, capacity: int) -> "MLAState":
        width = cfg.n_heads * (cfg.qk_nope + cfg.v_head)
        return cls(np.zeros((capacity, width), dtype=np.float32),
                   np.zeros((capacity, cfg.qk_rope), dtype=np.float32))


class SequenceState:
    """State of one sequence over the first `n_layers` layers, with room for `capacity`
    positions in every MLA cache."""

    def __init__(self, cfg: ModelConfig, capacity: int, n_layers: int | None = None,
                 shared_recurrent: bool = False):
        self.cfg = cfg
        self.capacity = int(capacity)
        self.n_layers = cfg.n_layers if n_layers is None else int(n_layers)
        self.n_cached = 0
        # Why the state is unusable, or None.  A forward pass that fails or is stopped
        # part-way has advanced some layers' recurrent state and not others (trap: the
        # half-advanced state, SYSTEM §4.9); it must never be saved, resumed or reused.
        # Set by Model.forward, cleared only by reset(); test_run_api.py springs it.
        self.poisoned: str | None = None
        # Full recompute under --ultra-low-memory keeps ONE recurrent slot for every KDA
        # layer: a layer's state is dead once it returns, so it is cleared and reused.
        self.shared_recurrent = shared_recurrent
        one = KDAState.zeros(cfg) if shared_recurrent else None
        self.layers: list[KDAState | MLAState] = [
            MLAState.empty(cfg, self.capacity) if cfg.is_mla(L) else (one or KDAState.zeros(cfg))
            for L in range(self.n_layers)
        ]

    def reset(self) -> None:
        """Fresh sequence: zero recurrent state, empty caches (full recompute, §6.2)."""
        self.n_cached = 0
        self.poisoned = None
        for st in self.layers:
            if isinstance(st, KDAState):
                st.reset()

    def reserve(self, n_new: int) -> int:
        """Positions n_cached .. n_cached+n_new-1 are about to be written; refuse overflow
        before anything is written, so no token is ever computed from unwritten rows."""
        if self.shared_recurrent and self.n_cached:
            raise RuntimeError("a shared recurrent slot cannot carry state between calls "
                               "(full recompute only)")
        if self.n_cached + n_new > self.capacity:
            raise CacheOverflowError(
                f"MLA cache overflow: {self.n_cached} cached + {n_new} new positions "
                f"exceed the capacity of {self.capacity}")
        return self.n_cached

    def nbytes(self) -> int:
        total = 0
        for st in {id(st): st for st in self.layers}.values():
            arrays = (st.S, st.conv_q, st.conv_k, st.conv_v) if isinstance(st, KDAState) \
                else (st.kv, st.rope)
            total += sum(a.nbytes for a in arrays)
        return total


def grown(state: SequenceState, capacity: int) -> SequenceState:
    """A copy of `state` with room for `capacity` positions (cached KV rows copied), for a
    chat turn that outgrows the cache it was allocated with."""
    if capacity <= state.capacity:
        return state
    new = SequenceState(state.cfg, capacity, state.n_layers)
    new.n_cached = state.n_cached
    n = state.n_cached
    for old, dst in zip(state.layers, new.layers):
        if isinstance(old, MLAState):
            dst.kv[:n] = old.kv[:n]
            dst.rope[:n] = old.rope[:n]
        else:
            for a, b in ((old.S, dst.S), (old.conv_q, dst.conv_q), (old.conv_k, dst.conv_k),
                         (old.conv_v, dst.conv_v)):
                b[...] = a
    return new


def snapshot(state: SequenceState) -> list[np.ndarray]:
    """Copies of the recurrent state (KDA matrices and conv histories): all a rejected
    speculative draft needs restored.  MLA rows of rejected positions are simply
    overwritten by the replay."""
    return [a.copy() for st in state.layers if isinstance(st, KDAState)
            for a in (st.S, st.conv_q, st.conv_k, st.conv_v)]


def restore(state: SequenceState, snap: list[np.ndarray]) -> None:
    it = iter(snap)
    for st in state.layers:
        if isinstance(st, KDAState):
            for a in (st.S, st.conv_q, st.conv_k, st.conv_v):
                a[...] = next(it)


def _kda_layers(state: SequenceState) -> list[KDAState]:
    return list({id(st): st for st in state.layers if isinstance(st, KDAState)}.values())


def begin_sweep(state: SequenceState) -> list[np.ndarray]:
    """Snapshot the recurrent state and log the recurrent inputs of the forwards that
    follow, so a sweep whose tail is rejected can keep its prefix without a replay."""
    snap = snapshot(state)
    for st in _kda_layers(state):
        st.log = []
    return snap


def end_sweep(state: SequenceState) -> None:
    for st in _kda_layers(state):
        st.log = None


def keep_prefix(state: SequenceState, snap: list[np.ndarray], base: int, keep: int) -> None:
    """Of the positions fed since begin_sweep (which found `base` cached), keep the first
    `keep`: restore the snapshot, then run the KDA recurrence and the conv-history shift
    again on those positions' logged inputs -- no weights, no second forward.  The result
    is bit-identical to re-feeding the kept positions (the recurrence takes tokens one at
    a time in order, §4.10; tested against the replay).  MLA rows of the kept positions
    are already right; later rows are overwritten when decoding moves on."""
    from . import kernels as K
    restore(state, snap)
    for st in _kda_layers(state):
        left = keep
        for raw_q, raw_k, raw_v, q, k, v, alpha, beta in st.log:
            n = min(left, q.shape[0])
            if n == 0:
                break
            out = np.empty((n, q.shape[1]), dtype=np.float32)
            K.kda_recurrence(st.S, q[:n], k[:n], v[:n], alpha[:n], beta[:n],
                             K.kda_q_scale(st.S.shape[1]), out)
            for hist, raw in ((st.conv_q, raw_q), (st.conv_k, raw_k), (st.conv_v, raw_v)):
                if hist.shape[1]:           # history = the newest K-1 raw inputs
                    hist[...] = np.concatenate([hist, raw[:n].T], axis=1)[:, -hist.shape[1]:]
            left -= n
        st.log = None
    state.n_cached = base + keep
