"""Per-sequence state (ARCHITECTURE §6): what one sequence carries between forward calls.

KDA layers carry the recurrent matrix S [H, D, D] (row = key channel) and the raw
ShortConv history of q, k and v [P, K-1] (oldest first).  MLA layers carry the expanded
cache (the spec's rows KV [capacity, H*(d_n+d_v)]) and one shared rope key per position
(R [capacity, d_r]), both held in the attention kernels' layout (MLAState).
Nothing else crosses tokens: the AttnRes stack is rebuilt on every call (trap #32).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .diskio import zeroed_f32
from .kernels import KEY_BLOCK  # positions per key block: the kernels' double lanes


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


def _n_blocks(n: int) -> int:
    """Key blocks holding positions 0 .. n-1."""
    return -(-n // KEY_BLOCK)


def _key_blocks(blocks: np.ndarray, p0: int, rows: np.ndarray, put: bool) -> None:
    """Copy positions p0 .. p0+n-1 between rows [n, G, d] and key blocks [G, n_blocks, d,
    KEY_BLOCK] (position p: block p // KEY_BLOCK, lane p % KEY_BLOCK): into the blocks
    when `put`, else out of them into `rows`."""
    B, n = KEY_BLOCK, rows.shape[0]
    i = 0
    while i < n:
        p = p0 + i
        m = (n - i) // B if p % B == 0 else 0
        if m:                                   # whole blocks at once
            full = rows[i:i + B * m].reshape(m, B, *rows.shape[1:])
            if put:
                blocks[:, p // B:p // B + m] = full.transpose(2, 0, 3, 1)
            else:
                full[...] = blocks[:, p // B:p // B + m].transpose(1, 3, 0, 2)
            i += B * m
        else:                                   # a ragged block's positions one by one
            if put:
                blocks[:, p // B, :, p % B] = rows[i]
            else:
                rows[i] = blocks[:, p // B, :, p % B]
            i += 1


@dataclass
class MLAState:
    """The expanded cache, laid out for the attention kernels: `k` [H, n_blocks, d_n, 8]
    holds head h's k_nope in blocks of 8 positions, dimension-major within a block (8
    consecutive positions' values of one dimension side by side); `v` [H, capacity, d_v]
    head h's value rows side by side; `rope` [n_blocks, d_r, 8] the shared rope keys in the
    same blocks as `k`.  Files and the spec use position-major rows; `rows`, `set_rows`,
    `rope_rows` and `set_rope` convert.

    Why not the spec's rows [capacity, H*(d_n+d_v)]: attention reads one head's keys, then
    its values, over every cached position.  In rows, a head's 512 B of keys sat a whole
    row (16 KB in mid) from the next position's, which this machine read at 6-8 GB/s a core
    against 26 GB/s for the same bytes side by side (a /tmp C loop; docs/benchmarks-
    kernels.md); and a lone decode token, whose scores put 8 positions in the 8 double
    lanes, had to transpose every 8 x 8 piece of 8 rows first (~50 ns a position and head
    even in cache).  In blocks, a block's keys are one contiguous read and one load, one
    convert and one FMA per dimension.  The prefill kernel reads the same blocks.

    The arrays are on 4 KiB pages: 2 MiB ones would fault in 2 x H huge pages per layer at
    the first position (64 MB a layer in mid), where the rows grew with the context."""
    k: np.ndarray
    v: np.ndarray
    rope: np.ndarray

    @staticmethod
    def shapes(n_heads: int, d_n: int, d_v: int, d_r: int, capacity: int
               ) -> dict[str, tuple[int, ...]]:
        """The arrays' shapes by field name (what zeros() makes, what statefile checks)."""
        nb = _n_blocks(capacity)
        return {"k": (n_heads, nb, d_n, KEY_BLOCK), "v": (n_heads, capacity, d_v),
                "rope": (nb, d_r, KEY_BLOCK)}

    @classmethod
    def zeros(cls, n_heads: int, d_n: int, d_v: int, d_r: int, capacity: int) -> "MLAState":
        return cls(**{name: zeroed_f32(shape, huge=False) for name, shape in
                      cls.shapes(n_heads, d_n, d_v, d_r, capacity).items()})

    @classmethod
    def empty(cls, cfg: ModelConfig, capacity: int) -> "MLAState":
        return cls.zeros(cfg.n_heads, cfg.qk_nope, cfg.v_head, cfg.qk_rope, capacity)

    @property
    def width(self) -> int:
        """Floats in a spec row: H*(d_n+d_v)."""
        return self.k.shape[0] * (self.k.shape[2] + self.v.shape[2])

    def _move_rows(self, p0: int, rows: np.ndarray, put: bool) -> None:
        H, dn = self.k.shape[0], self.k.shape[2]
        per_head = rows.reshape(rows.shape[0], H, -1)        # [n, H, d_n + d_v], a view
        _key_blocks(self.k, p0, per_head[:, :, :dn], put)
        v = self.v[:, p0:p0 + rows.shape[0]]
        if put:
            v[...] = per_head[:, :, dn:].transpose(1, 0, 2)
        else:
            per_head[:, :, dn:] = v.transpose(1, 0, 2)

    def set_rows(self, p0: int, rows: np.ndarray) -> None:
        """Positions p0 .. p0+n-1 from spec rows [n, H*(d_n+d_v)]."""
        self._move_rows(p0, rows, put=True)

    def rows(self, p0: int, p1: int) -> np.ndarray:
        """Positions p0 .. p1-1 as spec rows [n, H*(d_n+d_v)] (a copy)."""
        out = np.empty((p1 - p0, self.width), np.float32)
        self._move_rows(p0, out, put=False)
        return out

    def set_rope(self, p0: int, rows: np.ndarray) -> None:
        """Positions p0 .. p0+n-1 of the rope keys from rows [n, d_r]."""
        _key_blocks(self.rope[None], p0, rows[:, None, :], put=True)

    def rope_rows(self, p0: int, p1: int) -> np.ndarray:
        """Positions p0 .. p1-1 of the rope keys as rows [n, d_r] (a copy)."""
        out = np.empty((p1 - p0, self.rope.shape[1]), np.float32)
        _key_blocks(self.rope[None], p0, out[:, None, :], put=False)
        return out

    def copy_prefix(self, src: "MLAState", n: int) -> None:
        """Positions 0 .. n-1 from another state of the same dimensions."""
        nb = _n_blocks(n)
        self.k[:, :nb] = src.k[:, :nb]
        self.v[:, :n] = src.v[:, :n]
        self.rope[:nb] = src.rope[:nb]

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.k, self.v, self.rope


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
                else st.arrays()
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
            dst.copy_prefix(old, n)
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
