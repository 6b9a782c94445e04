"""Lookahead expert reads (issue 48, item 3): start reading a layer's routed experts
before its router has run, from a guess of its router input.

Layer L's experts are known only after L's attention, when its router sees
post_norm(AttnRes_mlp(run + attention)).  At the start of layer L the running sum `run`
(what L-1 produced, its MoE included) is already there, and so are L's weights; the guess
leaves L's attention out: `post_norm_L(AttnRes_mlp,L(run))`, routed by L's own router
(`NextLayerGuess`).  Reads for the guessed experts that are not resident then run while
L's attention computes (and L's trunk slot is being used), instead of after it.

Exact by construction, and the cache decides nothing differently (tests/test_lookahead.py
records every request's outcome and every eviction both ways):

* a lookahead read lands in a small side buffer of its own (`LookaheadReads`, one layer's
  top-k of slots by default), never in the cache's arena: it reserves no slot, evicts
  nothing, publishes nothing, and is invisible to the replacement policy;
* when a real request of that layer misses, the cache reserves its slot exactly as it
  would have and, instead of reading the expert again, waits for the lookahead read and
  swaps memory with it: the side slot's bytes become the slot's, the slot's old memory
  (its evicted expert's, which nothing may use any more) becomes the side slot
  (`ExpertCache._start/_collect` ask `take`/`adopt`); if the lookahead read failed, the
  real read is issued as without lookahead, so a failed guess costs time, never the step;
* a lookahead read no request took is wasted: its side slot is reused once it has landed.

Counters (CacheCounters.la_*; per step and whole run): predicted = reads started,
useful = of those the real misses took, wasted = the rest (bytes: la_bytes = useful bytes
+ la_wasted_bytes once a layer is settled); recall = share of a guessed layer's routed
experts that the guess named, resident or not.

Why the side buffer and not the arena: a read into a free or evicted arena slot would
change the cache's later decisions (what is resident, what the LRU evicts), and on the
budgets where lookahead matters (a cache smaller than a few layers' top-k) every slot is
spoken for.  Why a swap and not a copy: copying measured +0.04 s CPU a step on mid (every
useful read is a copy of the expert: 0.25 GB a step of memcpy on 2 cores).

`K3_NOLOOKAHEAD=1`, `--no-lookahead` and LoadSpec.lookahead turn it off (`enabled`).
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import numpy as np

from .diskio import AlignedBuffer
from .experts import ExpertCache, _Read
from .model import AttnResStack, rmsnorm, route_chunk
from .weights import LayerWeights, MoEWeights

__all__ = ["LookaheadReads", "NextLayerGuess", "GUESSES", "enabled", "attach", "ENV"]

ENV = "K3_NOLOOKAHEAD"           # =1: off (the A/B switch, like the reference's K3_NO*)
MAX_ROWS = 8                     # rows a pass may carry and still guess: decode, a batch of
                                 # sequences, a speculative sweep; a prefill chunk's union
                                 # would ask for far more than the side buffer holds


def enabled(asked: bool = True) -> bool:
    """Whether lookahead reads run: asked (LoadSpec.lookahead) and not K3_NOLOOKAHEAD=1."""
    return bool(asked) and os.environ.get(ENV, "") != "1"


class LookaheadReads:
    """The side buffer of lookahead reads for one ExpertCache: `slots` slots of the cache's
    slot size, allocated on first use.  One consumer thread (the forward's) issues; the
    cache's readers take and adopt.  `fail(layer, expert)` makes a lookahead read short
    (tests: a failed lookahead read must not fail the step)."""

    def __init__(self, cache: ExpertCache, slots: int,
                 fail: Callable[[int, int], bool] | None = None):
        self.cache, self.nslot, self.fail = cache, max(1, int(slots)), fail
        self.slot_bytes = cache.slot_bytes
        self._buf: AlignedBuffer | None = None
        self._mem: list[memoryview] = []            # side slot -> its memory (swapped)
        self._free = list(range(self.nslot))
        self._entries: dict[int, _Read] = {}        # key -> read not yet taken
        self._draining: list[_Read] = []            # let go while still in flight
        self._guess: dict[int, set[int]] = {}       # layer -> experts the guess named
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """What the side buffer holds once allocated (the plan's lookahead term)."""
        return self.nslot * self.slot_bytes

    def _view(self, slot: int) -> memoryview:
        if self._buf is None:
            self._buf = AlignedBuffer(self.nbytes)
            self._mem = [self._buf.view[s * self.slot_bytes:(s + 1) * self.slot_bytes]
                         for s in range(self.nslot)]
        return self._mem[slot]

    # -- the forward's side -----------------------------------------------------------
    def issue(self, layer: int, experts: list[int]) -> int:
        """Start reads for the guessed `experts` of `layer` (most confident first) that are
        neither resident nor in flight, as many as free side slots allow.  Returns how many
        were started.  Changes nothing the cache decides."""
        c = self.cache
        with c._cv, self._lock:                     # always the cache's lock first
            self._let_go(lambda k: True)            # an earlier layer's, never settled
            self._reap()
            self._guess = {layer: set(experts)}     # an unsettled one is as stale
        started: list[_Read] = []
        with c._cv:
            for k, run in c._to_read(layer, experts):
                with self._lock:
                    if not self._free:
                        break
                    slot = self._free.pop()
                started.append(_Read(k, run, slot, buf=self._view(slot)))
            c._count(la_predicted=len(started), la_bytes=sum(r.run.nbytes for r in started))
        started.sort(key=lambda r: (r.run.shard, r.run.offset))   # a forward sweep
        for r in started:
            c._start(r, self.fail)
            with self._lock:
                self._entries[r.key] = r
        return len(started)

    def settle(self, layer: int, routed: list[int]) -> None:
        """Layer `layer` has been served: count the guess's recall against the experts it
        routed to, and let go of its reads no request took (wasted)."""
        c = self.cache
        with c._cv, self._lock:
            guess = self._guess.pop(layer, None)
            n = c.n_experts
            self._let_go(lambda k: k // n == layer)
        if guess is not None:
            routed_set = set(routed)
            with c._cv:
                c._count(la_routed=len(routed_set), la_recalled=len(routed_set & guess))

    # -- the cache's side -------------------------------------------------------------
    def take(self, key: int) -> _Read | None:
        """The lookahead read of `key` for a real miss to use instead of its own, if any."""
        with self._lock:
            return self._entries.pop(key, None)

    def adopt(self, src: _Read, r: _Read) -> bool:
        """src (collected) serves the real read r: r's slot takes src's memory, src's side
        slot the slot's old memory (r's slot is INFLIGHT: no view of it is in use), and r
        takes src's outcome.  False if src failed (r must read itself)."""
        c = self.cache
        ok = src.ok
        if ok:
            c._mem[r.slot], self._mem[src.slot] = src.buf, c._mem[r.slot]
            r.got, r.pad, r.kind, r.done, r.error = src.got, src.pad, src.kind, src.done, ""
        with c._cv:
            if ok:
                c._count(la_useful=1)
            else:
                c._count(la_wasted=1, la_wasted_bytes=src.run.nbytes)
        with self._lock:
            self._free.append(src.slot)
        return ok

    # -- side slots -------------------------------------------------------------------
    def _let_go(self, which: Callable[[int], bool]) -> None:
        """Under both locks (the cache's first, as everywhere): the untaken reads of keys `which` picks are wasted; their slots
        come back once their reads have landed (a reader may still be writing)."""
        gone = [k for k in self._entries if which(k)]
        if not gone:
            return
        c = self.cache
        wasted = [self._entries.pop(k) for k in gone]
        with c._cv:
            c._count(la_wasted=len(wasted), la_wasted_bytes=sum(r.run.nbytes for r in wasted))
        self._draining += wasted
        self._reap()

    def _reap(self) -> None:
        """Under the lock: free the slots of let-go reads that have landed (each handle is
        waited for exactly once, so they are collected, which does not wait now)."""
        keep = []
        for r in self._draining:
            if self.cache._landed(r):
                self.cache._collect(r)
                self._free.append(r.slot)
            else:
                keep.append(r)
        self._draining = keep

    def close(self) -> None:
        """Wait for every read still out (their buffer must outlive them), then free it."""
        with self.cache._cv, self._lock:
            self._let_go(lambda k: True)
            for r in self._draining:
                self.cache._collect(r)
                self._free.append(r.slot)
            self._draining = []
        self._mem = []
        if self._buf is not None:
            try:
                self._buf.close()
            except BufferError:
                pass                                # parts serve the arena: freed with it
            self._buf = None


# ---------------------------------------------------------------------------------------
# The guess

def _mlp_aggregate(a, run, stack: AttnResStack, lw: LayerWeights, eps: float) -> np.ndarray:
    """The MoE's own input aggregate over what is known at the layer's start (the running
    sum without this layer's attention): what the router reads, one term short."""
    return stack.aggregate(run, lw.phi_mlp, eps) if stack.n else run


def _attn_input(a, run, stack, lw, eps):
    """The attention's input aggregate (computed anyway), under the MoE's norm."""
    return a


GUESSES = {"mlp": _mlp_aggregate, "attn": _attn_input}
DEFAULT_GUESS = "mlp"            # recalls best (docs/benchmarks-engine.md, lookahead section)


class NextLayerGuess:
    """The hook `decoder_layer` calls at a layer's start (`Model.lookahead`): route the
    guessed MoE input with the layer's own router and start the reads (rank-major over
    the rows, so every row's most confident experts come first)."""

    def __init__(self, cfg, reads: LookaheadReads, guess: str = DEFAULT_GUESS,
                 max_rows: int = MAX_ROWS):
        self.cfg, self.reads, self.max_rows = cfg, reads, max_rows
        self.guess = GUESSES[guess]

    def __call__(self, L: int, a: np.ndarray, run: np.ndarray, stack: AttnResStack,
                 lw: LayerWeights) -> None:
        cfg = self.cfg
        if cfg.is_dense(L) or not isinstance(lw.mlp, MoEWeights) or a.shape[0] > self.max_rows:
            return
        x = rmsnorm(np.ascontiguousarray(self.guess(a, run, stack, lw, cfg.rms_eps)),
                    lw.post_norm, cfg.rms_eps)
        idx, _, count = route_chunk(lw.mlp, x, cfg, L)
        order = [int(idx[t, j]) for j in range(idx.shape[1]) for t in range(idx.shape[0])
                 if j < count[t]]
        self.reads.issue(L, list(dict.fromkeys(order)))


def attach(model, experts, cfg, slots: int | None = None, guess: str = DEFAULT_GUESS,
           fail: Callable[[int, int], bool] | None = None) -> LookaheadReads | None:
    """Turn lookahead on for `model` over `experts` (an ExpertCache; any other source has
    nothing to read ahead).  `slots`: the side buffer's, one layer's top-k by default."""
    if not isinstance(experts, ExpertCache):
        return None
    reads = LookaheadReads(experts, cfg.topk if slots is None else slots, fail)
    experts.ahead = reads
    model.lookahead = NextLayerGuess(cfg, reads, guess)
    return reads
