"""The draft model of hybrid decode (SYSTEM §6.10, `--draft-trunk`): a second packed trunk
(typically the int8-derived copy `k3 pack-trunk --draft-bits 8` writes) that proposes
tokens the exact model verifies in one batched sweep.  The emitted ids are the exact model's greedy
ids whatever the draft says; the draft only decides how many positions a sweep covers.

The draft shares the exact model's embedding, lm_head and routed-expert cache, and keeps
its own trunk (pinned within --draft-trunk-gb, the rest streamed) and its own sequence
state, which is snapshotted before it proposes and cut back to the accepted drafts when a
proposal is rejected.
"""
from __future__ import annotations

import time

import numpy as np

from . import kernels as K
from .config import ModelConfig
from .model import Model, greedy
from .state import begin_sweep, end_sweep, grown, keep_prefix
from .weights import MoEWeights

DEFAULT_DRAFT_TOPK = 4


class DraftRouter:
    """Routing of the draft: the top `k` experts by the draft's own router scores.

    cache_only (the reference's rule, `--draft-cache-only`): only experts resident in the
    exact model's cache are candidates, and they are used without touching the cache's
    recency or counters, so a draft step reads no expert bytes and leaves the exact
    model's cache exactly as it was.  Otherwise missing experts are read through the
    cache like the exact model's (they are usually among its own top-k)."""

    def __init__(self, cache, k: int, cache_only: bool):
        self.cache, self.k, self.cache_only = cache, int(k), bool(cache_only)

    def __call__(self, w: MoEWeights, x_E: np.ndarray, cfg: ModelConfig,
                 layer: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(self.k, cfg.topk)
        if not self.cache_only:
            idx, wts = np.empty(k, np.int32), np.empty(k, np.float32)
            K.router(w.router, x_E, w.bias, k, cfg.moe_renorm, cfg.routed_scale, idx, wts)
            return idx, wts
        one_i, one_w = np.empty(1, np.int32), np.empty(1, np.float32)
        scores = K.router(w.router, x_E, w.bias, 1, cfg.moe_renorm, cfg.routed_scale,
                          one_i, one_w)
        resident = np.array([e for e in range(scores.shape[0])
                             if self.cache.resident(layer, e)], dtype=np.int64)
        k = min(k, resident.shape[0])
        if k == 0:                          # nothing resident: the shared experts only
            return np.empty(0, np.int32), np.empty(0, np.float32)
        idx, wts = np.empty(k, np.int32), np.empty(k, np.float32)
        K.route_scores(np.ascontiguousarray(scores[resident]),
                       np.ascontiguousarray(w.bias[resident]), k, cfg.moe_renorm,
                       cfg.routed_scale, idx, wts)
        return resident[idx].astype(np.int32), wts


class ResidentOnly:
    """The draft's expert source under cache_only: views of resident experts, no I/O, no
    counting.  Valid because the draft asks only for experts its router saw resident and
    nothing is loaded between routing and use (one consumer thread)."""

    def __init__(self, cache):
        self.cache = cache

    def batches(self, layer: int, experts: list[int]):
        yield [(e, self.cache.peek(layer, e)) for e in experts]


class DraftModel:
    """Proposes up to `cap` tokens by one-token greedy steps of the draft model, in
    lockstep with the exact model's sequence."""

    def __init__(self, model: Model, capacity: int, trunk=None):
        self.model = model
        self.trunk = trunk              # the draft's StreamedTrunk (closed with it)
        self.state = model.new_state(capacity)
        self.fed: list[int] = []        # the ids the draft's state took in
        self._snap = None
        self._snap_pos = 0
        self.seconds = 0.0              # wall time spent proposing and catching up
        self.steps = 0                  # draft forward calls

    def _forward(self, ids) -> np.ndarray:
        self.steps += 1
        logits = self.model.forward(ids, self.state)
        self.fed += list(ids)
        return logits

    def follow(self, seq: list[int], capacity: int) -> None:
        """Before proposing for `seq`: a draft that followed another sequence (a chat
        whose earlier turn was edited, another request on the server) starts again from
        nothing and catches up on its next proposal; one that is short of room grows.
        Only the drafts change with this, never the ids (the exact model verifies)."""
        if self.fed != seq[:len(self.fed)] or self.state.poisoned:
            self.state = self.model.new_state(max(capacity, self.state.capacity))
            self.fed = []
        elif capacity > self.state.capacity:
            self.state = grown(self.state, capacity)

    def propose(self, seq: list[int], cap: int) -> list[int]:
        """Feed every committed id the draft has not seen (the whole prompt on the first
        call, afterwards the accepted drafts and the exact model's token), then draft."""
        t0 = time.monotonic()
        try:
            logits = self._forward(seq[self.state.n_cached:])
            self._snap, self._snap_pos = begin_sweep(self.state), self.state.n_cached
            d = [greedy(logits)]
            while len(d) < cap:
                d.append(greedy(self._forward([d[-1]])))
            return d
        except BaseException:
            end_sweep(self.state)
            raise
        finally:
            self.seconds += time.monotonic() - t0

    def settle(self, drafted: list[int], accepted: int) -> None:
        """The exact model kept drafted[:accepted].  The draft fed drafted[:-1]; if any of
        those was rejected, keep only the accepted ones (state.keep_prefix); the exact
        model's own token is fed with the next proposal."""
        t0 = time.monotonic()
        if accepted < len(drafted) - 1:
            keep_prefix(self.state, self._snap, self._snap_pos, accepted)
        end_sweep(self.state)
        del self.fed[self.state.n_cached:]
        self.seconds += time.monotonic() - t0

    def close(self) -> None:
        if self.trunk is not None:
            self.trunk.close()
