"""The routed-expert cache (SYSTEM §4): fixed slots of packed MXFP4 bytes, LRU or S3-FIFO
replacement, batch prefetch with parallel O_DIRECT reads, and the request trace.

Three layers, each usable alone:

* `resolve_expert` finds one expert's bytes on disk (§1.6): shard, run, the offset of each
  of its six tensors inside the run, with the geometry checks.
* `LRUPolicy` and `S3FIFOPolicy` (§4.2, §4.10; `K3_CACHE_POLICY` picks one) are the slot
  table and the replacement decision with no I/O at all, so `k3 sim-cache` replays a
  trace through exactly the decisions the engine makes.
* `ExpertCache` owns the arena and the reads.  The forward pass calls `batches(layer,
  experts)`; each yielded group is resident at once and stays protected until the next
  group is requested.  A group's missing experts are read in parallel (§4.4) in disk-offset
  order by native reader threads (`kernels._k3io`: they never take the GIL, so a read
  lands while the forward runs Python), into 4096-aligned slots through the widened
  O_DIRECT window of §1.7; each expert is handed to the forward as soon as its own read
  lands, so compute overlaps the group's other reads (`_Group`).

A slot is registered to its key only after its read returned every byte; a failed read
leaves the slot EMPTY and is retried once, a second failure is an `ExpertLoadError` (a drop:
the token in flight is never emitted, the run exits 4, §4.9).

`ResidentExperts` gives any `.expert(L, e)` source the same `batches()` interface.
"""
from __future__ import annotations

import errno
import heapq
import os
import sys
import threading
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .bind import BindError
from .checkpoint import Checkpoint, CheckpointError
from .config import ModelConfig
from .diskio import ALIGN, AlignedBuffer, align_up
from .kernels._k3io import ReadPool, monotonic
from .names import EXPERT_MATRICES, expert_tensors, layer_prefix
from .weights import MXFP4, ExpertWeights
from .errors import EXIT_DROP, EngineError

__all__ = [
    "ExpertLoadError", "ExpertCacheError", "RunTensor", "ExpertRun", "resolve_expert",
    "slot_bytes_for", "EMPTY", "INFLIGHT", "SlotTable", "LRUPolicy", "S3FIFOPolicy",
    "POLICIES", "policy_class", "make_policy", "CacheCounters", "RequestTrace",
    "ExpertCache", "ResidentExperts",
]

GROUP = 32                       # MXFP4: one E8M0 scale per 32 elements
DEFAULT_IO_THREADS = 16          # queue depth 16 is what lets NVMe reach its rated rate
TOKENS_DIVISOR = 1472            # requests per decode token on the real model (92 x 16)

EMPTY, INFLIGHT = -1, -2         # slot states besides "holds key >= 0" (§4.2)
DEFAULT_POLICY = "lru"           # K3_CACHE_POLICY=s3fifo for S3-FIFO (§4.10)


class ExpertLoadError(EngineError, RuntimeError):
    exit_code = EXIT_DROP

    def report(self) -> str:
        return f"RUN INVALID: {self}; the affected token was not emitted"

    """An expert that could not be made resident (missing tensor, geometry, a short read
    twice, no evictable slot): a drop.  The token in flight must not be emitted."""

    def __init__(self, layer: int, expert: int, reason: str):
        super().__init__(f"layer {layer} expert {expert} failed to load; {reason}")
        self.layer, self.expert, self.reason = layer, expert, reason


class ExpertCacheError(EngineError, RuntimeError):
    """The cache cannot be built as asked (budget below top-k + 1 slots, no experts)."""


# ---------------------------------------------------------------------------------------
# One expert's bytes (§1.6)

@dataclass(frozen=True)
class RunTensor:
    key: str                   # "w1.weight_packed", ...
    name: str
    shape: tuple[int, int]
    file_offset: int           # absolute offset in the shard
    nbytes: int
    offset: int                # where the tensor begins inside the run (the slot payload)


@dataclass(frozen=True)
class ExpertRun:
    layer: int
    expert: int
    shard: int
    path: str
    offset: int                # absolute offset of the run's first byte
    nbytes: int                # payload bytes (sum of the six tensors)
    contiguous: bool           # one gap-free run; otherwise six reads in canonical order
    tensors: tuple[RunTensor, ...]   # canonical order: w1.p, w1.s, w2.p, w2.s, w3.p, w3.s

    def window(self) -> tuple[int, int, int]:
        """The O_DIRECT read (§1.7): (aligned file offset, aligned length, payload pad)."""
        lo = self.offset - self.offset % ALIGN
        return lo, align_up(self.offset + self.nbytes) - lo, self.offset - lo


def _canonical(cfg: ModelConfig | None, L: int, e: int) -> list[tuple[str, str, tuple | None]]:
    """(key, name, shape the config implies or None) of the six tensors, in order."""
    if cfg is not None:
        return [(t.key, t.name, t.shape) for t in expert_tensors(cfg, L, e)]
    p = f"{layer_prefix(L)}block_sparse_moe.experts.{e}."
    return [(f"{m}.{k}", f"{p}{m}.{k}", None)
            for m in EXPERT_MATRICES for k in ("weight_packed", "weight_scale")]


def resolve_expert(ck: Checkpoint, cfg: ModelConfig | None, L: int, e: int) -> ExpertRun:
    """Where routed expert e of layer L lives, from the headers (never assumed order).

    Checks (§1.6): all six exist, U8 rank 2, packed and scale rows agree, group size 32,
    all in one shard; with a config, every shape must also be the one it implies (without
    one the geometry comes from the headers alone, as for the synthetic cache fixture).
    Raises CheckpointError (a missing tensor) or BindError (geometry), naming the tensor."""
    want = _canonical(cfg, L, e)
    infos = [ck.info(name) for _, name, _ in want]      # "missing tensor NAME in DIR"
    first = infos[0]
    where = f"layer {L} expert {e}"

    def bad(info, problem: str) -> BindError:
        return BindError(f"{info.path}: {info.name} {problem} ({where})", info.path, info.name)

    for i in range(0, 6, 2):
        p, s = infos[i], infos[i + 1]
        for t in (p, s):
            if t.dtype != "U8" or len(t.shape) != 2:
                raise bad(t, f"is {t.dtype} {list(t.shape)}, expected U8 of rank 2")
        if p.shape[0] != s.shape[0]:
            raise bad(s, f"has {s.shape[0]} rows but {p.name} has {p.shape[0]}")
        if s.shape[1] * GROUP != p.shape[1] * 2:
            g = f"{p.shape[1] * 2 / s.shape[1]:g}" if s.shape[1] else "infinite"
            raise bad(s, f"{list(s.shape)} for {list(p.shape)} packed implies group size "
                         f"{g}, not {GROUP}")
        for t in (p, s):
            if t.shard != first.shard:
                raise bad(t, f"is in {t.path}, not in {first.path} with {first.name}")
    for (_, _, shape), t in zip(want, infos):
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise bad(t, f"is {list(t.shape)}, the config implies {list(shape)}")

    lo = min(t.offset for t in infos)
    hi = max(t.offset + t.nbytes for t in infos)
    own = sum(t.nbytes for t in infos)
    contiguous = hi - lo == own
    tensors, at = [], 0
    for (key, _, _), t in zip(want, infos):
        tensors.append(RunTensor(key, t.name, tuple(t.shape), t.offset, t.nbytes,
                                 t.offset - lo if contiguous else at))
        at += t.nbytes
    return ExpertRun(L, e, first.shard, first.path, lo, own, contiguous, tuple(tensors))


def slot_bytes_for(expert_nbytes: int) -> int:
    """§4.1: room for the widened O_DIRECT window, and a stride that keeps every slot
    4096-aligned whatever the expert size."""
    return align_up(expert_nbytes + 2 * ALIGN)


# ---------------------------------------------------------------------------------------
# The replacement policy (§4.2, §4.10): pure bookkeeping, shared with `k3 sim-cache`

class SlotTable:
    """The slot table every replacement policy shares: an EMPTY slot (the lowest-numbered)
    before any live one; a victim is never INFLIGHT, pinned or in use.  Which live slot
    goes is the subclass's choice (`_take_victim`), told of every use (`touch`) and of
    every publish (`_admit`).

    Keys are any non-negative ints.  No I/O: the caller reserves (the slot becomes
    INFLIGHT), reads, then publishes or releases.
    """

    name = title = ""

    def __init__(self, nslot: int):
        if nslot < 1:
            raise ValueError("a cache needs at least one slot")
        self.nslot = nslot
        self.key_of: list[int] = [EMPTY] * nslot
        self.slot_of: dict[int, int] = {}         # published keys only
        self.inflight_of: dict[int, int] = {}
        self._free = list(range(nslot))           # heap of EMPTY slots
        self._pinned: set[int] = set()
        self._in_use: dict[int, int] = {}         # slot -> holders

    # -- queries --------------------------------------------------------------------
    def lookup(self, key: int) -> int:
        """The slot holding key, or -1 (INFLIGHT keys are not resident)."""
        return self.slot_of.get(key, -1)

    def inflight(self, key: int) -> bool:
        return key in self.inflight_of

    @property
    def resident(self) -> int:
        return len(self.slot_of)

    @property
    def pinned(self) -> int:
        return len(self._pinned)

    def state(self, slot: int) -> int:
        return self.key_of[slot]

    def is_pinned(self, slot: int) -> bool:
        return slot in self._pinned

    def evictable(self, slot: int) -> bool:
        return (self.key_of[slot] >= 0 and slot not in self._pinned
                and slot not in self._in_use)

    def free_capacity(self) -> int:
        """Slots a new group may occupy at once: all but pinned, in-use or INFLIGHT."""
        held = self._pinned | set(self._in_use) | set(self.inflight_of.values())
        return self.nslot - len(held)

    # -- what a policy decides ------------------------------------------------------
    def touch(self, slot: int, first: bool = False) -> None:
        """A hit on slot; first: the key's first use since its read published it (the
        request that missed, served after the batch prefetch read it)."""
        raise NotImplementedError

    def _admit(self, slot: int, key: int) -> None:
        """key was just published in slot."""
        raise NotImplementedError

    def _take_victim(self) -> int:
        """Choose a live evictable slot and forget it (the slot table then evicts its
        key), or -1 when there is none."""
        raise NotImplementedError

    def _pin_changed(self, slot: int, on: bool) -> None:
        pass

    def snapshot(self) -> tuple:
        """The policy's whole replacement state (a read-only peek must leave it equal)."""
        raise NotImplementedError

    # -- transitions ----------------------------------------------------------------
    def reserve(self, key: int) -> tuple[int, int]:
        """Take a slot for key and mark it INFLIGHT.  Returns (slot, evicted key) — the
        evicted key is EMPTY when the slot was free — or (-1, EMPTY) if every slot is
        pinned, in use or in flight."""
        if key in self.slot_of or key in self.inflight_of:
            raise ValueError(f"key {key} is already resident or in flight")
        if self._free:
            slot = heapq.heappop(self._free)
            old = EMPTY
        else:
            slot = self._take_victim()
            if slot < 0:
                return -1, EMPTY
            old = self.key_of[slot]
            del self.slot_of[old]
        self.key_of[slot] = INFLIGHT
        self.inflight_of[key] = slot
        return slot, old

    def publish(self, key: int, slot: int) -> None:
        """The read returned every byte: key is resident in slot."""
        self._check_inflight(key, slot)
        del self.inflight_of[key]
        self.key_of[slot] = key
        self.slot_of[key] = slot
        self._admit(slot, key)

    def release(self, key: int, slot: int) -> None:
        """The read failed: the slot goes back EMPTY and can never be served as a hit."""
        self._check_inflight(key, slot)
        del self.inflight_of[key]
        self.key_of[slot] = EMPTY
        heapq.heappush(self._free, slot)

    def _check_inflight(self, key: int, slot: int) -> None:
        if self.inflight_of.get(key) != slot or self.key_of[slot] != INFLIGHT:
            raise ValueError(f"slot {slot} is not in flight for key {key}")

    def protect(self, slot: int) -> None:
        """In use by the current group: never a victim until unprotected."""
        self._in_use[slot] = self._in_use.get(slot, 0) + 1

    def unprotect(self, slot: int) -> None:
        n = self._in_use.get(slot, 0) - 1
        if n > 0:
            self._in_use[slot] = n
        else:
            self._in_use.pop(slot, None)

    def pin(self, key: int, on: bool = True) -> bool:
        """Pin (or unpin) a resident key's slot; False if key is not resident."""
        slot = self.slot_of.get(key, -1)
        if slot < 0:
            return False
        if on != (slot in self._pinned):
            (self._pinned.add if on else self._pinned.discard)(slot)
            self._pin_changed(slot, on)
        return True

    def access(self, key: int) -> bool:
        """One request with an instantaneous read (trace replay): True on a hit."""
        slot = self.slot_of.get(key, -1)
        if slot >= 0:
            self.touch(slot)
            return True
        slot, _ = self.reserve(key)
        if slot < 0:
            raise RuntimeError("every slot is pinned or in use")
        self.publish(key, slot)
        return False


class LRUPolicy(SlotTable):
    """Exactly the reference's LRU (§4.2): the victim is the least recently used live slot
    that is not pinned or in use.  "Used" means published or hit (each stamps the slot)."""

    name, title = "lru", "LRU"

    def __init__(self, nslot: int):
        super().__init__(nslot)
        self._lru: OrderedDict[int, None] = OrderedDict()   # published slots, oldest first

    def touch(self, slot: int, first: bool = False) -> None:
        self._lru.move_to_end(slot)

    def _admit(self, slot: int, key: int) -> None:
        self._lru[slot] = None

    def snapshot(self) -> tuple:
        return tuple(self._lru)                   # recency order, oldest first

    def pick_victim(self) -> int:
        """The slot the next reserve would take (no change)."""
        if self._free:
            return self._free[0]
        for slot in self._lru:
            if slot not in self._pinned and slot not in self._in_use:
                return slot
        return -1

    def _take_victim(self) -> int:
        slot = self.pick_victim()
        if slot >= 0:
            del self._lru[slot]
        return slot


class S3FIFOPolicy(SlotTable):
    """S3-FIFO (§4.10, the later upstream default): a key read from disk enters a small
    FIFO (10 % of the slots) unless a ghost FIFO of keys recently evicted from it (as many
    as there are slots) remembers it, then it enters the main FIFO.  Each hit raises a
    2-bit frequency.  Eviction takes the small FIFO's head while the small FIFO is at its
    share (or main is empty): with a frequency it moves to main (frequency 0), else it is
    evicted into the ghost; otherwise main's head: with a frequency it goes round again
    one lower, else it is evicted.  Why: a cyclic walk over the layers defeats LRU (every
    expert is used once per token), while experts used again and again stay in main; the
    shipped K3 trace (SYSTEM §4.10) gives 42.7 / 50.0 / 73.7 % hits at 1,823 / 3,647 /
    7,294 slots where LRU gives 36.2 / 36.2 / 49.2.

    Beyond the upstream rules (which `access` replays exactly, tests/test_experts.py): a
    slot in use by the current group is skipped and goes to its queue's tail unchanged; a
    pinned slot leaves the queues until it is unpinned (then main's tail), so neither is
    ever walked again and again.  A key's first use after its prefetch read is the request
    that missed, not a reuse (`touch(first=True)` leaves its frequency at 0)."""

    name, title = "s3fifo", "S3-FIFO"
    SMALL_SHARE = 0.1

    def __init__(self, nslot: int):
        super().__init__(nslot)
        self._small_target = max(1, int(nslot * self.SMALL_SHARE))
        self._small: deque[int] = deque()         # slots, oldest first
        self._main: deque[int] = deque()
        self._freq: dict[int, int] = {}           # published slot -> 0..3
        self._ghost: deque[int] = deque()         # evicted keys, oldest first
        self._ghosted: set[int] = set()

    def touch(self, slot: int, first: bool = False) -> None:
        f = self._freq[slot]
        if not first and f < 3:
            self._freq[slot] = f + 1

    def _admit(self, slot: int, key: int) -> None:
        self._freq[slot] = 0
        if key in self._ghosted:
            self._ghosted.discard(key)
            self._main.append(slot)
        else:
            self._small.append(slot)

    def _pin_changed(self, slot: int, on: bool) -> None:
        if on:
            for q in (self._small, self._main):
                if slot in q:
                    q.remove(slot)
        else:
            self._main.append(slot)

    def snapshot(self) -> tuple:
        return (tuple(self._small), tuple(self._main), tuple(sorted(self._freq.items())),
                tuple(self._ghost))

    def _remember(self, key: int) -> None:
        if len(self._ghost) >= self.nslot:
            self._ghosted.discard(self._ghost.popleft())
        self._ghost.append(key)
        self._ghosted.add(key)

    def _take_victim(self) -> int:
        small, main, freq, in_use = self._small, self._main, self._freq, self._in_use
        # in-use slots met in a row at each head; a queue whose every slot was met so is
        # skipped.  Every other step pops or lowers a frequency, so the walk ends.
        skip_small = skip_main = 0
        while True:
            small_ok = skip_small < len(small)
            main_ok = skip_main < len(main)
            if small_ok and (len(small) >= self._small_target or not main_ok):
                slot = small[0]
                if slot in in_use:
                    small.rotate(-1)
                    skip_small += 1
                    continue
                small.popleft()
                skip_small = 0
                if freq[slot]:
                    freq[slot] = 0
                    main.append(slot)
                    skip_main = 0
                    continue
                del freq[slot]
                self._remember(self.key_of[slot])
                return slot
            if not main_ok:
                return -1
            slot = main[0]
            main.rotate(-1)
            if slot in in_use:
                skip_main += 1
                continue
            skip_main = 0
            if freq[slot]:
                freq[slot] -= 1
                continue
            main.pop()
            del freq[slot]
            return slot


POLICIES = {p.name: p for p in (LRUPolicy, S3FIFOPolicy)}


def policy_class(name: str | None) -> type[SlotTable]:
    """The replacement policy called name ("lru", "s3fifo"); None: $K3_CACHE_POLICY, else
    DEFAULT_POLICY.  Policy choice never changes tokens (routing does not read the cache)."""
    where = ""
    if name is None:
        name = os.environ.get("K3_CACHE_POLICY", "") or DEFAULT_POLICY
        where = "K3_CACHE_POLICY: "
    cls = POLICIES.get(name.lower())
    if cls is None:
        raise ExpertCacheError(f"{where}unknown cache policy {name!r} "
                               f"(one of {', '.join(POLICIES)})")
    return cls


def make_policy(name: str | None, nslot: int) -> SlotTable:
    """A slot table of nslot slots under `policy_class(name)`."""
    return policy_class(name)(nslot)


# ---------------------------------------------------------------------------------------
# Counters (§4.7), histogram and trace (§4.8)

@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetch_reads: int = 0      # hits whose bytes the batch prefetch read this window
    bytes_read: int = 0
    load_seconds: float = 0.0    # time the forward waited for reads (I/O share)
    read_seconds: float = 0.0    # wall time of the reads themselves, overlapped or not
    pipelined: int = 0           # groups whose reads ran behind compute (§4.5)
    next_wait_s: float = 0.0     # of load_seconds: waiting for the next expert's own read
    join_wait_s: float = 0.0     # ... and for the rest of a group at once (the final join)
    # lookahead reads (lookahead.py): reads started for a guess of the next layer's experts
    la_predicted: int = 0        # reads started (guessed experts that were not resident)
    la_useful: int = 0           # ... whose bytes a real miss took instead of reading again
    la_wasted: int = 0           # ... that no request took (or that failed)
    la_bytes: int = 0            # bytes the started reads ask for (= useful + wasted bytes)
    la_wasted_bytes: int = 0
    la_routed: int = 0           # distinct experts the guessed layers actually routed to
    la_recalled: int = 0         # ... of which the guess had named (recall = this / routed)

    @property
    def la_recall(self) -> float:
        """Share of a guessed layer's routed experts the guess named (0-1)."""
        return self.la_recalled / self.la_routed if self.la_routed else 0.0

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    @property
    def raw_hit_rate(self) -> float:
        """hits / requests, in %: flattering, it counts what the prefetch just read."""
        return 100.0 * self.hits / self.requests if self.requests else 0.0

    @property
    def true_hit_rate(self) -> float:
        """Experts served from RAM without touching the disk in this window, in %."""
        n = self.requests
        return 100.0 * max(0, self.hits - self.prefetch_reads) / n if n else 0.0

    @property
    def retention(self) -> float:
        """Share of requests whose expert was not evicted to make room, in %."""
        n = self.requests
        return 100.0 * max(0, n - self.evictions) / n if n else 0.0


class RequestTrace:
    """Every request the model made: running per-(layer, expert) counts (what the heat view
    and expert_hist.json need, O(layers x experts) to read however long the run), plus the
    requests in order when `keep_pairs` (what --dump-cache-trace and sim-cache replay:
    independent of cache contents, so it can be replayed at any capacity).  The plan counts
    both (memory.ModelFigures.trace_bytes).

    `window` > 0 keeps only the most recent `window` requests, in a ring allocated whole at
    the start (8 bytes a request, what the plan counts): the app's session trace, which
    would otherwise grow for as long as the app runs.  0 keeps every request (a CLI run,
    bounded by its positions)."""

    def __init__(self, n_layers: int = 0, n_experts: int = 0, keep_pairs: bool = True,
                 window: int = 0):
        self.n_layers, self.n_experts = n_layers, n_experts
        self.keep_pairs = keep_pairs
        self.window = max(0, int(window)) if keep_pairs else 0
        self.pairs = array("i")                 # layer, expert, ... (window 0: every request)
        # the ring: one allocation of the whole window, so what is held never grows past
        # what the plan counted (an append-grown array over-allocates and copies)
        self._ring = array("i", [0]) * (2 * self.window) if self.window else None
        self._next = 0                          # the ring's write position (int32 index)
        self._rows, self._cols = max(n_layers, 1), max(n_experts, 1)
        self._counts = array("q", bytes(8 * self._rows * self._cols))   # flat, row-major
        self.requests = 0

    def record(self, layer: int, expert: int) -> None:
        if layer >= self._rows or expert >= self._cols:
            self._grow(layer + 1, expert + 1)
        self._counts[layer * self._cols + expert] += 1   # an array item: ~50 ns, no NumPy
        self.requests += 1
        if self._ring is not None:
            i = self._next
            self._ring[i] = layer
            self._ring[i + 1] = expert
            self._next = i + 2 if i + 2 < len(self._ring) else 0
        elif self.keep_pairs:
            self.pairs.append(layer)
            self.pairs.append(expert)

    @property
    def kept(self) -> int:
        """How many requests the ordered trace holds (all of them unless windowed)."""
        if not self.keep_pairs:
            return 0
        return min(self.requests, self.window) if self.window else self.requests

    @property
    def windowed(self) -> bool:
        """True once older requests have left the window (the trace is not the whole run)."""
        return bool(self.window) and self.requests > self.window

    def kept_pairs(self) -> np.ndarray:
        """The kept requests in order, oldest first, as int32 [n, 2] (layer, expert): a copy,
        so no view pins the growing array (array.append refuses while a buffer is out)."""
        if self._ring is None:
            return np.frombuffer(self.pairs, np.int32).reshape(-1, 2).copy()
        ring = np.frombuffer(self._ring, np.int32).reshape(-1, 2)
        if not self.windowed:
            return ring[:self.requests].copy()
        k = self._next // 2                     # the oldest kept request
        return np.concatenate([ring[k:], ring[:k]])

    def _grow(self, rows: int, cols: int) -> None:
        old = self.counts
        self._rows, self._cols = max(rows, self._rows), max(cols, self._cols)
        grown = np.zeros((self._rows, self._cols), np.int64)
        grown[:old.shape[0], :old.shape[1]] = old
        self._counts = array("q", grown.tobytes())

    @property
    def counts(self) -> np.ndarray:
        """Requests per (layer, expert) so far, int64 [layers, experts] (a view)."""
        return np.frombuffer(self._counts, np.int64).reshape(self._rows, self._cols)

    def counts_grid(self) -> np.ndarray:
        """Requests per (layer, expert) so far, as float32 [layers, experts] (a copy)."""
        return self.counts.astype(np.float32)

    def histogram(self) -> dict[tuple[int, int], int]:
        """(layer, expert) -> requests, non-zero only, ordered by layer then expert."""
        c = self.counts
        Ls, es = np.nonzero(c)
        return {(int(L), int(e)): int(c[L, e]) for L, e in zip(Ls, es)}

    def dump(self, directory) -> list[str]:
        """Write DIR/expert_hist.json and DIR/expert_trace.bin (§6.8); the directory must
        exist.  Returns the lines to print."""
        if not self.keep_pairs:
            raise RuntimeError("the request trace was not kept for this run (keep_trace)")
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, "cache trace directory does not exist",
                                    directory)
        hist = self.histogram()
        n_layers = self.n_layers or max((L + 1 for L, _ in hist), default=0)
        n_experts = self.n_experts or max((e + 1 for _, e in hist), default=0)
        counts = ",".join(f'"{L},{e}":{n}' for (L, e), n in hist.items())
        from .atomic import write_atomic          # whole files or none (raises OSError)
        hpath = os.path.join(directory, "expert_hist.json")
        write_atomic(hpath, f'{{"n_layers":{n_layers},"n_experts":{n_experts},"counts":'
                            f'{{{counts}}}}}\n'.encode())
        tpath = os.path.join(directory, "expert_trace.bin")
        data = self.kept_pairs().astype("<i4", copy=False)
        write_atomic(tpath, data.tobytes())
        which = (f"the latest {self.kept} of {self.requests} requests (a window)"
                 if self.windowed else f"{self.requests} requests")
        return [f"wrote {hpath}: {len(hist)} experts",
                f"wrote {tpath}: {which} ({data.nbytes / 1024:.1f} KB)"]


# ---------------------------------------------------------------------------------------
# Reads

@dataclass
class _Read:
    key: int
    run: ExpertRun
    slot: int
    got: int = -1
    pad: int = 0
    error: str = ""
    done: float = 0.0            # time.monotonic() when the read returned
    kind: str = ""               # "direct" | "plain" | "pieces": how the bytes are asked for
    jobs: list = field(default_factory=list)     # native read handles not yet collected
    buf: memoryview | None = None    # where it lands: None = its arena slot; a lookahead
                                     # read's own side slot otherwise (lookahead.py)
    src: "_Read | None" = None       # the lookahead read this real read takes its bytes from

    @property
    def ok(self) -> bool:
        return self.got == self.run.nbytes


class _Group:
    """One group of `ExpertCache.batches`: resident together, served in request order,
    each expert as soon as its own read has landed -- so the forward computes one expert
    while the group's other reads are still in flight (§4.4's parallel reads, overlapped
    with compute).  Iterating it yields (expert, weights); iterating again replays them.

    Same decisions as reading the whole group first (the trap: a served expert must see
    the cache exactly as it would have): every request is still served in order under the
    lock, an expert is served only after its own read is finished, and before any request
    that has to read serially (its group read failed, or found no slot) every outstanding
    read is finished first, as the group's read phase used to finish them all.  The
    counters, the trace and the ids are unchanged (tests/test_experts.py replays both).
    `load_seconds` counts the time spent waiting for reads, not the reads' wall time."""

    def __init__(self, cache: "ExpertCache", layer: int, experts: list[int]):
        self.cache, self.layer, self.experts = cache, layer, experts
        self.held: list[int] = []            # protected slots, released by close()
        self.pairs: list[tuple[int, ExpertWeights]] = []
        self.fresh: set[int] = set()         # keys this group's reads published
        self.failed: set[int] = set()
        self.pending: dict[int, tuple[_Read, object]] = {}
        self.broken = False
        c = cache
        with c._cv:
            for e in experts:                # in-use protection before any victim
                slot = c.policy.lookup(c.key(layer, e))
                if slot >= 0:
                    c.policy.protect(slot)
                    self.held.append(slot)
            reads = c._reserve_group(layer, experts) if c.prefetch else []
        # issued in disk-offset order (_reserve_group sorts them)
        self.issued, self.reads = monotonic(), reads
        for r in reads:
            c._start(r)
            self.pending[r.key] = r
        if not c.overlap:
            self._land_all()
        elif len(reads) > 1:
            with c._cv:
                c._count(pipelined=1)

    def __len__(self) -> int:
        return len(self.experts)

    def __iter__(self):
        i = 0
        while True:
            if i < len(self.pairs):
                yield self.pairs[i]
                i += 1
            elif not self._serve_next():
                return

    def next_ready(self) -> bool:
        """Whether serving the next expert would not wait for a read: it is resident, or
        its read has finished (the MoE runs what it was served so far as one batch before
        it would wait)."""
        c = self.cache
        if len(self.pairs) == len(self.experts) or self.broken:
            return True
        k = c.key(self.layer, self.experts[len(self.pairs)])
        if k in self.pending:
            return c._landed(self.pending[k])
        with c._cv:
            return k not in self.failed and (k in self.fresh or c.policy.lookup(k) >= 0)

    def _land(self, key: int, join: bool = False) -> None:
        """Wait for one pending read and publish it (or release its slot)."""
        c = self.cache
        r = self.pending.pop(key)
        t0 = time.monotonic()
        c._collect(r)                        # never raises: it records errors
        waited = time.monotonic() - t0
        with c._cv:
            c._count(load_seconds=waited,
                     **{"join_wait_s" if join else "next_wait_s": waited})
            if not self.pending:              # the last one: the reads' own wall time (a
                # read a lookahead read served may have landed before the group began)
                c._count(read_seconds=max(0.0, max(x.done for x in self.reads) - self.issued))
            if c._finish(r, "prefetch"):
                self.fresh.add(r.key)
                c.policy.protect(r.slot)
                self.held.append(r.slot)
            else:
                self.failed.add(r.key)

    def _land_all(self) -> None:
        for key in list(self.pending):       # disk-offset order, as they were issued
            self._land(key, join=True)

    def _serve_next(self) -> bool:
        if len(self.pairs) == len(self.experts) or self.broken:
            return False
        c, layer = self.cache, self.layer
        e = self.experts[len(self.pairs)]
        k = c.key(layer, e)
        if k in self.pending:
            self._land(k)
        if (k in self.failed or (k not in self.fresh and c.policy.lookup(k) < 0)) \
                and self.pending:
            self._land_all()                  # a serial read sees every group read done
        with c._cv:
            c.trace.record(layer, e)
            try:
                slot = c._serve(layer, e, 1 if k in self.failed else 2, self.fresh)
            except BaseException:
                self.broken = True            # a drop: close() serves nothing more
                raise
            c.policy.protect(slot)
            self.held.append(slot)
        self.pairs.append((e, c._weights[slot]))
        return True

    def close(self) -> None:
        """Serve what was not iterated (a consumer that stopped early, or list()), finish
        every read, then release the group's protections.  On an error the reads still
        land before their slots can be reused."""
        try:
            if self.pending or len(self.pairs) < len(self.experts):
                try:
                    while self._serve_next():
                        pass
                finally:
                    self._land_all()
        finally:
            c = self.cache
            with c._cv:
                c._unhold_locked(self.held)


# ---------------------------------------------------------------------------------------
# The cache

class ExpertCache:
    """Routed experts in a fixed arena of `cache_bytes // slot_bytes` slots (§4).

    `cfg` supplies the key space (n_layers x n_experts), top-k, the MoE layers and the
    expected shapes; without one (synthetic fixtures) pass n_layers, n_experts, topk and
    optionally moe_layers.  `direct=False` forces buffered reads; `prefetch=False` turns
    the parallel batch reads off (A/B, K3_NOPREFETCH); `fail_reads(layer, expert)`
    returning True makes that read attempt short (tests); `log` receives warnings;
    `policy` names the replacement policy (`make_policy`: None reads K3_CACHE_POLICY).

    One consumer thread calls `batches`/`expert`; counters may be read from any thread.
    """

    def __init__(self, ck: Checkpoint, cfg: ModelConfig | None, cache_bytes: int, *,
                 n_layers: int | None = None, n_experts: int | None = None,
                 topk: int | None = None, moe_layers: list[int] | None = None,
                 io_threads: int = DEFAULT_IO_THREADS, direct: bool = True,
                 prefetch: bool = True,
                 fail_reads: Callable[[int, int], bool] | None = None,
                 log: Callable[[str], None] | None = None, keep_trace: bool = True,
                 trace_window: int = 0, policy: str | None = None):
        self.ck, self.cfg = ck, cfg
        if cfg is not None:
            n_layers = cfg.n_layers if n_layers is None else n_layers
            n_experts = cfg.n_experts if n_experts is None else n_experts
            topk = cfg.topk if topk is None else topk
            if moe_layers is None:
                moe_layers = [L for L in range(n_layers) if not cfg.is_dense(L)]
        if n_layers is None or n_experts is None or topk is None:
            raise ValueError("ExpertCache needs a config or n_layers, n_experts and topk")
        self.n_layers, self.n_experts, self.topk = n_layers, n_experts, topk
        self.moe_layers = list(range(n_layers)) if moe_layers is None else list(moe_layers)
        if not self.moe_layers:
            raise ExpertCacheError("the model has no routed-expert layers")
        self.direct, self.prefetch = direct, prefetch
        # SYSTEM §4.5's switch K3_NO_EXPERT_PIPELINE=1: a group's reads all land before any
        # expert is served (the whole-batch barrier of §4.4; same decisions and ids), for
        # benchmarks/bench_overlap.py
        self.overlap = os.environ.get("K3_NO_EXPERT_PIPELINE", "") != "1"
        self._fail_reads = fail_reads
        self._log = log or (lambda msg: print(f"k3: {msg}", file=sys.stderr, flush=True))

        # §4.1: the slot size comes from the checkpoint, not from arithmetic.
        probe = resolve_expert(ck, cfg, self.moe_layers[0], 0)
        self.expert_bytes = probe.nbytes
        self.slot_bytes = slot_bytes_for(probe.nbytes)
        # never more slots than experts: a large budget on a small model allocates no more
        self.nslot = min(int(cache_bytes // self.slot_bytes), len(self.moe_layers) * n_experts)
        if self.nslot < topk + 1:
            raise ExpertCacheError(
                f"budget {cache_bytes / 1e9:.2f} GB gives {self.nslot} slots of "
                f"{self.slot_bytes / 1e6:.2f} MB, but top-{topk} needs at least {topk + 1}")

        self.policy = make_policy(policy, self.nslot)
        self.arena = AlignedBuffer(self.nslot * self.slot_bytes)
        # the memory behind each slot: the arena's own part, until a lookahead read's side
        # slot is swapped in for a miss it served (lookahead.py: no copy; the slot table,
        # which is all the policy sees, is untouched)
        self._mem: list[memoryview] = [self.arena.view[s * self.slot_bytes:
                                                       (s + 1) * self.slot_bytes]
                                       for s in range(self.nslot)]
        self._weights: list[ExpertWeights | None] = [None] * self.nslot
        self._serial: deque[int] = deque()        # slots handed out by expert(), newest last
        self._cv = threading.Condition()
        self._io_lock = threading.Lock()
        self._direct_fd: dict[int, int] = {}
        self._plain_fd: dict[int, int] = {}
        self.io_mode: dict[int, str] = {}         # shard -> "direct" | "buffered"
        self._io = ReadPool(max(1, io_threads))
        self.io_threads = max(1, io_threads)

        self.step = CacheCounters()               # reset at every decode step
        self.total = CacheCounters()              # the whole run
        self.drops = 0
        self.trace = RequestTrace(n_layers, n_experts, keep_trace, trace_window)
        # resolve_expert remembered per key (the headers do not change during a run):
        # six index look-ups and the geometry checks were ~0.16 ms of the main thread per
        # miss; bounded, so a huge model's key space costs no more than a few slots' worth
        self._runs: OrderedDict[int, ExpertRun] = OrderedDict()
        self._runs_max = max(4 * self.nslot, 4096)
        # lookahead reads (lookahead.LookaheadReads, set by whoever turns them on): bytes a
        # real miss may take instead of reading again; never a decision of this cache
        self.ahead = None

    def _resolve(self, layer: int, expert: int) -> ExpertRun:
        k = self.key(layer, expert)
        run = self._runs.get(k)
        if run is None:
            run = self._runs[k] = resolve_expert(self.ck, self.cfg, layer, expert)
            if len(self._runs) > self._runs_max:
                self._runs.popitem(last=False)
        return run

    # -- public interface -------------------------------------------------------------

    def key(self, layer: int, expert: int) -> int:
        return layer * self.n_experts + expert

    def batches(self, layer: int, experts: list[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Yield `experts` in request order as groups that are resident together: all at
        once when they fit, else groups sized to the slots that can be freed.  A group's
        experts stay protected until the next group is requested or the iterator ends.
        Raises ExpertLoadError on a drop."""
        g = None
        try:
            i = 0
            while i < len(experts):
                if g is not None:
                    g.close()
                g = _Group(self, layer, self._next_group(layer, experts, i))
                yield g
                i += len(g.experts)
        finally:
            if g is not None:
                g.close()
            if self.ahead is not None:          # the layer's guess is judged and let go
                self.ahead.settle(layer, experts)

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        """One request (§4.3).  The result stays protected until top-k more single gets
        or the next batches() group."""
        with self._cv:
            self.trace.record(layer, expert)
            slot = self._serve(layer, expert, attempts=2)
            self.policy.protect(slot)
            self._serial.append(slot)
            while len(self._serial) > min(self.topk, self.nslot - 1):
                self.policy.unprotect(self._serial.popleft())
            return self._weights[slot]

    def pin(self, layer: int, expert: int, on: bool = True) -> bool:
        """Keep a resident expert's slot out of replacement (or release it)."""
        with self._cv:
            return self.policy.pin(self.key(layer, expert), on)

    def resident(self, layer: int, expert: int) -> bool:
        return self.policy.lookup(self.key(layer, expert)) >= 0

    def peek(self, layer: int, expert: int) -> ExpertWeights:
        """A resident expert's weights without counting a request, recording it in the
        trace or refreshing its recency: the draft model's cache-only reads, which must
        leave the exact model's cache as they found it."""
        with self._cv:
            slot = self.policy.lookup(self.key(layer, expert))
            if slot < 0 or self._weights[slot] is None:
                raise KeyError(f"layer {layer} expert {expert} is not resident")
            return self._weights[slot]

    @property
    def bytes_read(self) -> int:
        """Expert bytes read from disk over the whole run."""
        return self.total.bytes_read

    def reset_step(self) -> None:
        """Start a new per-step window (hits and prefetch_reads reset together, §4.7)."""
        self.step = CacheCounters()

    def dump_trace(self, directory) -> list[str]:
        return self.trace.dump(directory)

    # -- reports ---------------------------------------------------------------------

    def init_line(self) -> str:
        pool = len(self.moe_layers) * self.n_experts
        # the reference's line as it is for its LRU; another policy is named
        other = "" if self.policy.name == "lru" else f", {self.policy.title} replacement"
        return (f"expert cache: {self.nslot} slots x {self.slot_bytes / 1e6:.2f} MB = "
                f"{self.nslot * self.slot_bytes / 1e9:.2f} GB ({100.0 * self.nslot / pool:.2f}% "
                f"of the {pool * self.expert_bytes / 1e12:.2f} TB expert pool{other})")

    def report_lines(self, label: str = "final step",
                     counters: CacheCounters | None = None) -> list[str]:
        """The end-of-run cache report (§4.11); by default the last step's counters."""
        c = self.step if counters is None else counters
        lines = [
            f"cache [{label}]",
            f"  slots        : {self.nslot} of {self.slot_bytes / 1e6:.2f} MB = "
            f"{self.nslot * self.slot_bytes / 1e9:.2f} GB arena ({self.policy.resident} "
            f"resident, {self.policy.pinned} pinned)",
            f"  requests     : {c.requests}  hits {c.hits} ({c.raw_hit_rate:.2f}%)  misses "
            f"{c.misses}  evictions {c.evictions}",
        ]
        if c.prefetch_reads:
            lines += [f"  of those hits : {c.prefetch_reads} came from the batch prefetch, "
                      f"i.e. read from disk",
                      f"                  this token; TRUE resident hit rate "
                      f"{c.true_hit_rate:.2f}%"]
        # the reads' own wall time: the device rate, though part of it overlapped compute
        rate = c.bytes_read / 1e6 / c.read_seconds if c.read_seconds > 0 else 0.0
        lines.append(f"  read from disk: {c.bytes_read / 1e9:.2f} GB in {c.read_seconds:.2f} s "
                     f"({rate:.0f} MB/s while loading)")
        for w, x in ((label, c), ("run", self.total)):          # lookahead.py
            if x.la_predicted or x.la_routed:
                lines.append(f"  lookahead    : {w}: {x.la_predicted} reads started from the "
                             f"guess, {x.la_useful} taken by a miss, {x.la_wasted} wasted "
                             f"({x.la_wasted_bytes / 1e6:.1f} of {x.la_bytes / 1e6:.1f} MB); "
                             f"recall {100 * x.la_recall:.1f}%")
        if c.pipelined:                                         # §4.5's report line
            lines.append(f"  async overlap : {c.pipelined} batches, final join wait "
                         f"{c.join_wait_s:.2f} s, next-expert waits {c.next_wait_s:.2f} s "
                         f"(I/O worker threads {self.io_threads})")
        return lines

    # -- groups -----------------------------------------------------------------------

    def _next_group(self, layer: int, experts: list[int], start: int) -> list[int]:
        """The longest run of experts[start:] that fits the slots a group may occupy: a
        pinned resident expert needs none, every other distinct expert one."""
        with self._cv:
            self._release_serial()
            room = self.policy.free_capacity()
            group, need = [], set()
            for e in experts[start:]:
                k = self.key(layer, e)
                if k not in need and not self.policy.is_pinned(self.policy.lookup(k)):
                    if len(need) == room:
                        break
                    need.add(k)
                group.append(e)
            if not group:
                self.drops += 1
                raise ExpertLoadError(layer, experts[start],
                                      f"no evictable slot: all {self.nslot} slots are pinned")
            return group

    def _reserve_group(self, layer: int, group: list[int]) -> list[_Read]:
        """Phase 1 (§4.4), under the lock: a slot for every distinct missing expert, in
        disk-offset order.  An expert that does not resolve is left to the serving path,
        which reports it."""
        reads: list[_Read] = []
        for k, run in self._to_read(layer, group):
            slot = self._reserve(k)
            if slot < 0:
                break
            reads.append(_Read(k, run, slot))
        reads.sort(key=lambda r: (r.run.shard, r.run.offset))
        return reads

    def _to_read(self, layer: int, experts: list[int]) -> Iterator[tuple[int, ExpertRun]]:
        """Under the lock: (key, run) of each distinct expert in `experts` that a read would
        make resident -- in range, neither resident nor in flight, resolvable and fitting a
        slot (the rest is left to the serving path, which reports it)."""
        seen = set()
        for e in experts:
            k = self.key(layer, e)
            if k in seen or not self._in_range(layer, e):
                continue
            seen.add(k)
            if self.policy.lookup(k) >= 0 or self.policy.inflight(k):
                continue
            try:
                run = self._resolve(layer, e)
            except CheckpointError:
                continue
            if run.nbytes + 2 * ALIGN <= self.slot_bytes:
                yield k, run

    def _unhold(self, slots: list[int]) -> None:
        with self._cv:
            self._unhold_locked(slots)

    def _unhold_locked(self, slots: list[int]) -> None:
        for s in slots:
            self.policy.unprotect(s)
        slots.clear()

    def _release_serial(self) -> None:
        while self._serial:
            self.policy.unprotect(self._serial.popleft())

    # -- one request -------------------------------------------------------------------

    def _in_range(self, layer: int, expert: int) -> bool:
        return 0 <= layer < self.n_layers and 0 <= expert < self.n_experts

    def _serve(self, layer: int, expert: int, attempts: int,
               prefetched: set[int] | None = None) -> int:
        """Under the lock: the slot holding the expert, loading it on a miss with up to
        `attempts` reads.  Counts the hit or miss, and as a prefetch read the first hit on
        a key in `prefetched` (read from disk by this group's batch, so prefetch_reads
        never exceeds hits); raises ExpertLoadError on a drop."""
        if not self._in_range(layer, expert):
            self.drops += 1
            raise ExpertLoadError(layer, expert, f"out of range ({self.n_layers} layers, "
                                                 f"{self.n_experts} experts)")
        k = self.key(layer, expert)
        while self.policy.inflight(k):             # another reader has it: wait, re-check
            self._cv.wait()
        slot = self.policy.lookup(k)
        if slot >= 0:
            self._count(hits=1)
            first = bool(prefetched) and k in prefetched
            if first:
                prefetched.discard(k)
                self._count(prefetch_reads=1)
            self.policy.touch(slot, first)
            return slot
        self._count(misses=1)
        try:
            run = self._resolve(layer, expert)
        except CheckpointError as e:
            self.drops += 1
            raise ExpertLoadError(layer, expert, str(e)) from e
        if run.nbytes + 2 * ALIGN > self.slot_bytes:
            self.drops += 1
            raise ExpertLoadError(layer, expert, f"{run.nbytes} bytes do not fit a slot of "
                                                 f"{self.slot_bytes}")
        last = ""
        for _ in range(attempts):
            slot = self._reserve(k)
            if slot < 0:
                self.drops += 1
                raise ExpertLoadError(layer, expert, f"no evictable slot: all {self.nslot} "
                                                     f"slots are pinned or in use")
            r = _Read(k, run, slot)
            self._cv.release()
            try:
                t0 = time.monotonic()
                self._read_one(r)
                dt = time.monotonic() - t0
            finally:
                self._cv.acquire()
            self._count(load_seconds=dt, read_seconds=dt)     # serial: nothing overlaps
            if self._finish(r, "load"):
                return slot
            last = r.error
        self.drops += 1
        raise ExpertLoadError(layer, expert, f"{last}, twice; the slot was left empty")

    def _reserve(self, key: int) -> int:
        slot, old = self.policy.reserve(key)
        if slot < 0:
            return -1
        if old >= 0:
            self._count(evictions=1)
        self._weights[slot] = None
        return slot

    def _finish(self, r: _Read, what: str) -> bool:
        """Phase 3: publish a full read, release anything else to EMPTY (§4.2)."""
        if r.ok:
            self._weights[r.slot] = self._views(r.slot, r.run, r.pad)
            self.policy.publish(r.key, r.slot)
            self._count(bytes_read=r.run.nbytes)
        else:
            if not r.error:
                r.error = f"short read (got {max(r.got, 0)} of {r.run.nbytes} bytes)"
            self.policy.release(r.key, r.slot)
            self._log(f"{what} of layer {r.run.layer} expert {r.run.expert} failed: "
                      f"{r.error}; slot {r.slot} left empty")
        self._cv.notify_all()
        return r.ok

    def _count(self, **delta) -> None:
        for c in (self.step, self.total):
            for name, v in delta.items():
                setattr(c, name, getattr(c, name) + v)

    def _views(self, slot: int, run: ExpertRun, pad: int) -> ExpertWeights:
        """Zero-copy, read-only NumPy views of the slot's six tensors."""
        buf = self._mem[slot]
        arrs = {}
        for t in run.tensors:
            a = np.frombuffer(buf, np.uint8, t.nbytes, pad + t.offset).reshape(t.shape)
            a.flags.writeable = False
            arrs[t.key] = a
        m = {x: MXFP4(arrs[f"{x}.weight_packed"], arrs[f"{x}.weight_scale"])
             for x in EXPERT_MATRICES}
        return ExpertWeights(w1=m["w1"], w3=m["w3"], w2=m["w2"])

    # -- I/O ---------------------------------------------------------------------------

    def _read_one(self, r: _Read) -> None:
        """Read r.run into its slot; sets r.got (payload bytes obtained), r.pad, r.done."""
        self._start(r)
        self._collect(r)

    def _start(self, r: _Read, fail: Callable[[int, int], bool] | None = None,
               asked: bool = False) -> None:
        """Issue r's read on the native readers (r.jobs); a read that cannot even be
        issued (the shard does not open) is finished here with r.error set.  A real read
        (into its slot) whose expert a lookahead read already asked for takes that read
        instead of issuing its own (r.src; _collect copies the bytes into the slot).
        `fail`: the injected short reads of a lookahead read (the real reads' are
        `fail_reads`, asked once per real attempt whatever serves it; `asked`: this attempt
        already asked it, and reads itself)."""
        run = r.run
        real = r.buf is None
        if asked:
            short = False
        elif real:
            short = bool(self._fail_reads and self._fail_reads(run.layer, run.expert))
        else:
            short = bool(fail and fail(run.layer, run.expert))
        if real and not short and not asked and self.ahead is not None:
            r.src = self.ahead.take(r.key)
            if r.src is not None:
                return
        buf = self._mem[r.slot] if real else r.buf
        try:
            if not run.contiguous:              # six buffered reads into the canonical layout
                fd, r.kind, r.pad = self._plain(run.shard), "pieces", 0
                last = len(run.tensors) - 1
                for i, t in enumerate(run.tensors):
                    want = t.nbytes // 2 if short and i == last else t.nbytes
                    r.jobs.append(self._io.submit(fd, buf[t.offset:t.offset + want],
                                                  t.file_offset))
                return
            fd, direct = self._shard_fd(run.shard)
            if direct:
                lo, length, r.pad = run.window()
                if short:
                    length = (length // 2) // ALIGN * ALIGN
                r.kind = "direct"
                r.jobs.append(self._io.submit(fd, buf[:length], lo))
                return
            want = run.nbytes // 2 if short else run.nbytes
            r.kind, r.pad = "plain", 0
            r.jobs.append(self._io.submit(self._plain(run.shard), buf[:want], run.offset))
        except Exception as e:                   # never leave a reservation unanswered
            why = (e.strerror or e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            if r.jobs:                           # pieces already issued: let them return
                self._io.wait_all(r.jobs)
                r.jobs = []
            r.got, r.error, r.done = -1, f"read error ({why})", monotonic()

    def _landed(self, r: _Read) -> bool:
        """Whether r's reads have all returned (collecting it would not wait)."""
        return all(self._io.done(h) for h in (r.src or r).jobs)

    def _collect(self, r: _Read) -> None:
        """Wait for r's reads (GIL released) and judge them: r.got is the payload byte
        count obtained, or -1 with r.error.  Never raises.  A real read that took a
        lookahead read gets its memory swapped in; if that read failed it reads again
        itself, so a failed lookahead read costs time, never the step."""
        if r.src is not None:
            src, r.src = r.src, None
            self._collect(src)
            if not self.ahead.adopt(src, r):
                self._start(r, asked=True)
                self._collect(r)
            return
        if not r.jobs:
            return                              # failed at issue: r.error says why
        got, err, _, r.done = self._io.wait_all(r.jobs)
        r.jobs = []
        run = r.run
        if r.kind == "direct":
            if err and not got:
                if err == errno.EINVAL:         # accepted at open, refused on read
                    self._refuse_direct(run.shard)
                    self._start(r)              # now buffered: the shard's mode says so
                    self._collect(r)
                    return
                r.got, r.error = -1, f"read error ({os.strerror(err)})"
                return
            # an error after some bytes is the unaligned remainder past EOF: a short count
            r.got = run.nbytes if got >= r.pad + run.nbytes else max(0, got - r.pad)
        elif err:
            r.got, r.error = -1, f"read error ({os.strerror(err)})"
        else:
            r.got = got                         # pieces: contiguous up to the first short one

    def _shard_fd(self, shard: int) -> tuple[int, bool]:
        """The shard's read descriptor: O_DIRECT when allowed and accepted, else buffered
        (the choice is remembered per shard)."""
        with self._io_lock:
            mode = self.io_mode.get(shard)
            if mode is None:
                mode = "buffered"
                if self.direct and hasattr(os, "O_DIRECT"):
                    try:
                        self._direct_fd[shard] = os.open(self.ck.shards[shard],
                                                         os.O_RDONLY | os.O_DIRECT)
                        mode = "direct"
                    except OSError as e:
                        self._log(f"{self.ck.shards[shard]}: O_DIRECT refused "
                                  f"({e.strerror}); buffered expert reads")
                self.io_mode[shard] = mode
            if mode == "direct":
                return self._direct_fd[shard], True
        return self._plain(shard), False

    def _plain(self, shard: int) -> int:
        with self._io_lock:
            fd = self._plain_fd.get(shard)
            if fd is None:
                fd = self._plain_fd[shard] = os.open(self.ck.shards[shard], os.O_RDONLY)
            return fd

    def _refuse_direct(self, shard: int) -> None:
        with self._io_lock:
            if self.io_mode.get(shard) == "direct":
                self.io_mode[shard] = "buffered"
                self._log(f"{self.ck.shards[shard]}: O_DIRECT reads refused (EINVAL); "
                          f"buffered expert reads")

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the I/O threads and close descriptors.  The arena is unmapped once no
        expert view refers to it any more."""
        if self.ahead is not None:
            self.ahead.close()                   # its reads land before their buffer goes
        self._io.close()                         # every queued read returns first
        with self._io_lock:
            for fd in list(self._direct_fd.values()) + list(self._plain_fd.values()):
                os.close(fd)
            self._direct_fd.clear()
            self._plain_fd.clear()
        self._weights = [None] * self.nslot
        self._mem = []
        try:
            self.arena.close()
        except BufferError:
            pass                                 # views still alive; freed with them

    def __enter__(self) -> "ExpertCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------

class _NoSlots:
    """The slot figures of a source without slots (ResidentExperts)."""
    resident = pinned = 0


class ResidentExperts:
    """`batches()` for any source with `.expert(L, e)` (e.g. the unbounded resident
    `CheckpointExperts`): one group holding every requested expert.  Requests are
    logged like the cache's, so `--dump-cache-trace` works on this path too."""

    def __init__(self, source, n_layers: int = 0, n_experts: int = 0, keep_trace: bool = True,
                 trace_window: int = 0):
        self.source = source
        self.trace = RequestTrace(n_layers, n_experts, keep_trace, trace_window)
        # the cache's counters, so a step's telemetry reads the same on both paths: every
        # request is served from memory (the source's own reads are its business)
        self.step, self.total = CacheCounters(), CacheCounters()
        self.policy = _NoSlots()
        self.drops = 0

    def reset_step(self) -> None:
        self.step = CacheCounters()

    def _count(self, layer: int, e: int) -> None:
        self.trace.record(layer, e)
        self.step.hits += 1
        self.total.hits += 1

    def batches(self, layer: int, experts: list[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        group = []
        for e in experts:
            self._count(layer, e)
            group.append((e, self.source.expert(layer, e)))
        yield group

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        self._count(layer, expert)
        return self.source.expert(layer, expert)

    def dump_trace(self, directory) -> list[str]:
        return self.trace.dump(directory)

    def __getattr__(self, name):               # bytes_read etc. of the wrapped source
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)
