"""The routed-expert cache (SYSTEM §4, §1.6-§1.7, §12.4) and the trace replay (§10.3, §11.3).

Bytes are checked against an independent reading of the shard (plain json + file bytes)
or against `Binder.expert`; the trace replay must reproduce the reference's published
capacity table line for line.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import re
import struct
import zlib
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from conftest import peer_dir

from k3engine import experts as X
from k3engine.bind import Binder, BindError, CheckpointExperts, ResidentWeights
from k3engine.checkpoint import Checkpoint, CheckpointError
from k3engine.experts import (EMPTY, INFLIGHT, ExpertCache, ExpertCacheError, ExpertLoadError,
                              LRUPolicy, POLICIES, ResidentExperts, S3FIFOPolicy,
                              make_policy, resolve_expert, slot_bytes_for)
from k3engine.kernels._k3io import joined
from k3engine.names import PREFIX
from k3engine.tools import sim_cache
from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
from k3engine.tools.st_writer import TensorSpec, write_safetensors

N_FIX = 24                      # experts in the cache fixture (layer 0)
KEYS = [f"{m}.{k}" for m in ("w1", "w2", "w3") for k in ("weight_packed", "weight_scale")]


def ename(L: int, e: int, key: str) -> str:
    return f"{PREFIX}layers.{L}.block_sparse_moe.experts.{e}.{key}"


# ---------------------------------------------------------------------------------------
# The cache fixture, read independently

def _independent(path: Path) -> dict[str, bytes]:
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    return {name: blob[8 + n + h["data_offsets"][0]:8 + n + h["data_offsets"][1]]
            for name, h in header.items() if name != "__metadata__"}


@pytest.fixture(scope="module")
def fix():
    d = peer_dir() / "cache"
    ck = Checkpoint(d)
    src = _independent(d / "model-00001-of-00001.safetensors")
    yield ck, src
    ck.close()


def fixture_cache(ck, nslot: int, **kw) -> ExpertCache:
    return ExpertCache(ck, None, nslot * slot_bytes_for(1632), n_layers=1, n_experts=N_FIX,
                       topk=2, log=kw.pop("log", lambda m: None), **kw)


class Interposed:
    """The cache's native read pool with a hook on each read's answer: `answer(fd, offset,
    result)` runs when the consumer collects the read (it may wait, or change the result
    to what a failing kernel would say); `ready(fd, offset)` may hold done() at False."""

    def __init__(self, cache, answer=None, ready=None):
        self.pool, self.answer, self.ready = cache._io, answer, ready
        self.asked: dict[int, tuple[int, int]] = {}
        self.lengths: dict[int, int] = {}
        cache._io = self

    def submit(self, fd, buf, offset):
        h = self.pool.submit(fd, buf, offset)
        self.asked[h], self.lengths[h] = (fd, offset), len(buf)
        return h

    def wait_all(self, handles):
        return joined([self.lengths.pop(h) for h in handles], [self.wait(h) for h in handles])

    def done(self, h):
        return self.pool.done(h) and (self.ready is None or self.ready(*self.asked[h]))

    def wait(self, h):
        res = self.pool.wait(h)
        fd, offset = self.asked.pop(h)
        return res if self.answer is None else self.answer(fd, offset, res)

    def close(self):
        self.pool.close()


def read_offsets(cache, e: int) -> tuple[int, int]:
    """The file offsets a read of expert e (layer 0) may start at: buffered, O_DIRECT."""
    run = cache._resolve(0, e)
    return run.offset, run.window()[0]


def ew_bytes(ew) -> dict[str, bytes]:
    return {"w1.weight_packed": ew.w1.packed.tobytes(), "w1.weight_scale": ew.w1.scales.tobytes(),
            "w2.weight_packed": ew.w2.packed.tobytes(), "w2.weight_scale": ew.w2.scales.tobytes(),
            "w3.weight_packed": ew.w3.packed.tobytes(), "w3.weight_scale": ew.w3.scales.tobytes()}


def assert_served(src: dict[str, bytes], L: int, e: int, ew) -> None:
    got = ew_bytes(ew)
    for key in KEYS:
        assert got[key] == src[ename(L, e, key)], f"layer {L} expert {e} {key}: wrong bytes"


def assert_consistent(cache: ExpertCache) -> None:
    """Slot table invariants after any call: nothing in flight, key_of and slot_of agree."""
    p = cache.policy
    assert INFLIGHT not in p.key_of and not p.inflight_of
    live = {k: s for s, k in enumerate(p.key_of) if k >= 0}
    assert live == p.slot_of
    assert cache.step.prefetch_reads <= cache.step.hits
    assert cache.total.prefetch_reads <= cache.total.hits


# ---------------------------------------------------------------------------------------
# §1.6 resolving an expert

def test_resolve_fixture_geometry(fix):
    ck, src = fix
    for e in range(N_FIX):
        r = resolve_expert(ck, None, 0, e)
        assert r.contiguous and r.nbytes == 1632 and r.nbytes % 4096
        assert [t.key for t in r.tensors] == KEYS
        assert [t.offset for t in r.tensors] == [0, 512, 544, 1056, 1088, 1600]
        lo, length, pad = r.window()
        assert lo % 4096 == 0 and length % 4096 == 0 and pad == r.offset - lo
        assert lo + length >= r.offset + r.nbytes and length <= slot_bytes_for(r.nbytes)
    assert slot_bytes_for(1632) == 12288
    assert slot_bytes_for(17_547_264) == 17_555_456          # the real model's slot (§4.1)


def _write(path: Path, specs: list[TensorSpec]) -> None:
    def fill(s: TensorSpec) -> np.ndarray:
        rng = np.random.default_rng(zlib.crc32(s.name.encode()))
        return np.frombuffer(rng.bytes(s.nbytes), np.uint8)

    write_safetensors(str(path), specs, fill)


def _expert_specs(L: int, e: int, rows=8, cols=64, order=KEYS, **over) -> list[TensorSpec]:
    shapes = {k: ((rows, cols) if k.endswith("packed") else (rows, cols // 16)) for k in KEYS}
    shapes.update(over)
    return [TensorSpec(ename(L, e, k), "U8", shapes[k]) for k in order]


@pytest.mark.parametrize("case, problem", [
    ("group", "implies group size 64, not 32"),
    ("rows", "has 4 rows but"),
    ("dtype", "expected U8 of rank 2"),
    ("missing", "missing tensor"),
    ("shard", "not in"),
])
def test_resolve_refuses_bad_geometry(tmp_path, case, problem):
    specs = _expert_specs(0, 0)
    extra = []
    if case == "group":
        specs[3] = TensorSpec(specs[3].name, "U8", (8, 2))
    elif case == "rows":
        specs[5] = TensorSpec(specs[5].name, "U8", (4, 4))
    elif case == "dtype":
        specs[2] = TensorSpec(specs[2].name, "F32", (8, 16))
    elif case == "missing":
        specs.pop(4)
    elif case == "shard":
        extra = [specs.pop(5)]
    _write(tmp_path / "model-00001-of-00002.safetensors", specs)
    if extra:
        _write(tmp_path / "model-00002-of-00002.safetensors", extra)
    ck = Checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as ei:
        resolve_expert(ck, None, 0, 0)
    msg = str(ei.value)
    print(f"[gate] expert geometry '{case}': {msg}")
    assert problem in msg and ei.value.tensor and ei.value.tensor in msg
    if case != "missing":
        assert isinstance(ei.value, BindError)
    # the cache refuses to size itself from it, and a request for it is a drop
    with pytest.raises(CheckpointError):
        ExpertCache(ck, None, 1 << 20, n_layers=1, n_experts=1, topk=2)
    ck.close()


def test_reordered_and_non_contiguous_experts(tmp_path):
    """The engine must not assume the on-disk order (§1.6): expert 0 stored w3, w2, w1
    (contiguous, reordered), expert 1 interleaved with a foreign tensor (non-contiguous:
    six buffered reads into the canonical layout)."""
    rev = [k for m in ("w3", "w2", "w1") for k in (f"{m}.weight_packed", f"{m}.weight_scale")]
    e0 = _expert_specs(0, 0, order=rev)
    e1 = _expert_specs(0, 1)
    e1.insert(3, TensorSpec(f"{PREFIX}norm.weight", "U8", (100,)))
    e2 = _expert_specs(0, 2)
    path = tmp_path / "model.safetensors"
    _write(path, e0 + e1 + e2)
    src = _independent(path)
    ck = Checkpoint(tmp_path)
    r0, r1 = resolve_expert(ck, None, 0, 0), resolve_expert(ck, None, 0, 1)
    assert r0.contiguous and [t.key for t in r0.tensors] == KEYS
    assert r0.tensors[0].offset == r0.nbytes - 544                 # w1 stored last
    assert not r1.contiguous and [t.offset for t in r1.tensors] == [0, 512, 544, 1056, 1088, 1600]
    for direct in (True, False):
        cache = ExpertCache(ck, None, 3 * slot_bytes_for(1632), n_layers=1, n_experts=3,
                            topk=2, direct=direct)
        for group in cache.batches(0, [0, 1, 2]):
            for e, ew in group:
                assert_served(src, 0, e, ew)
        for e in (2, 1, 0):
            assert_served(src, 0, e, cache.expert(0, e))
        assert_consistent(cache)
        cache.close()
    ck.close()


def test_resolve_with_config_checks_shapes(tiny):
    d, cfg = tiny
    ck = Checkpoint(d)
    r = resolve_expert(ck, cfg, 1, 3)
    assert [t.shape for t in r.tensors] == [(64, 32), (64, 2), (64, 32), (64, 2), (64, 32), (64, 2)]
    from dataclasses import replace
    with pytest.raises(BindError, match="the config implies"):
        resolve_expert(ck, replace(cfg, moe_inter=32), 1, 3)
    ck.close()


# ---------------------------------------------------------------------------------------
# LRUPolicy: the slot table alone

def test_policy_victims_states_and_protection():
    p = LRUPolicy(4)
    a, _ = p.reserve(10)
    b, _ = p.reserve(11)
    assert (a, b) == (0, 1)                       # EMPTY first, lowest slot; never the same slot
    assert p.state(a) == INFLIGHT and p.lookup(10) == -1 and p.inflight(10)
    p.release(10, a)                              # failed read: EMPTY, never served
    assert p.state(a) == EMPTY and p.lookup(10) == -1
    p.publish(11, b)
    for k in (12, 13, 14):
        s, old = p.reserve(k)
        p.publish(k, s)
        assert old == EMPTY
    assert sorted(p.slot_of) == [11, 12, 13, 14] and p.resident == 4
    # LRU: 11 oldest; a hit on it makes 12 the victim
    assert p.pick_victim() == p.lookup(11)
    p.touch(p.lookup(11))
    assert p.pick_victim() == p.lookup(12)
    p.protect(p.lookup(12))                       # in use: skipped
    assert p.pick_victim() == p.lookup(13)
    assert p.pin(13) and not p.pin(99)            # pinned: skipped
    assert p.pick_victim() == p.lookup(14)
    s, old = p.reserve(15)
    assert old == 14 and p.lookup(14) == -1
    assert p.pick_victim() == p.lookup(11)        # INFLIGHT 15 is never a victim
    p.protect(p.lookup(11))
    assert p.pick_victim() == -1 and p.reserve(16) == (-1, EMPTY)
    assert p.free_capacity() == 0
    p.unprotect(p.lookup(12))
    assert p.pick_victim() == p.lookup(12)
    with pytest.raises(ValueError):
        p.publish(15, (s + 1) % 4)                # only the reserved slot publishes


def test_policy_access_is_plain_lru():
    rng = random.Random(7)
    keys = [rng.randrange(40) for _ in range(5000)]
    for cap in (1, 3, 17, 39, 40):
        p, ref, hits = LRUPolicy(cap), [], 0
        for k in keys:
            hit = p.access(k)
            assert hit == (k in ref)
            if hit:
                ref.remove(k)
            elif len(ref) == cap:
                ref.pop(0)
            ref.append(k)
            hits += hit
        assert hits == sim_cache.policy_hits(keys, cap)


def _upstream_s3fifo(keys: list[int], cap: int) -> list[bool]:
    """The upstream S3-FIFO rules (SYSTEM §4.10) written out over keys, as an oracle for
    the slot table's form: small FIFO 10 % of cap, ghost FIFO of cap keys evicted from
    small, 2-bit frequency."""
    target = max(1, int(cap * 0.1))
    small, main, ghost, ghosted, freq, out = deque(), deque(), deque(), set(), {}, []
    for k in keys:
        if k in freq:
            freq[k] = min(freq[k] + 1, 3)
            out.append(True)
            continue
        out.append(False)
        while len(freq) >= cap:
            if small and (len(small) >= target or not main):
                v = small.popleft()
                if freq[v]:
                    freq[v] = 0
                    main.append(v)
                    continue
                del freq[v]
                if len(ghost) >= cap:
                    ghosted.discard(ghost.popleft())
                ghost.append(v)
                ghosted.add(v)
            else:
                v = main.popleft()
                if freq[v]:
                    freq[v] -= 1
                    main.append(v)
                    continue
                del freq[v]
        freq[k] = 0
        if k in ghosted:
            ghosted.discard(k)
            main.append(k)
        else:
            small.append(k)
    return out


def test_s3fifo_policy_access_follows_the_upstream_rules():
    """Hit for hit on skewed traces (hot keys come back, cold ones pass once), at capacities
    where the small FIFO is 1 slot, a few, and most of the keys."""
    rng = random.Random(11)
    keys = [rng.randrange(12) if rng.random() < 0.6 else rng.randrange(400)
            for _ in range(6000)]
    for cap in (1, 2, 9, 17, 40, 150, 420):
        p = S3FIFOPolicy(cap)
        got = [p.access(k) for k in keys]
        want = _upstream_s3fifo(keys, cap)
        assert got == want, f"{cap} slots: first difference at request " \
            f"{next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
        assert p.resident == min(cap, len(set(keys)))
        if cap >= 17:       # the point of it: a hot set survives the cold keys' passing
            assert sum(got) > sum(LRUPolicy(cap).access(k) for k in keys)


def test_s3fifo_policy_never_evicts_in_use_or_pinned_slots():
    p = S3FIFOPolicy(10)                  # small FIFO: 1 slot
    for k in range(10):
        s, old = p.reserve(k)
        p.publish(k, s)
        assert old == EMPTY
    for k in (0, 1, 2, 3):
        p.touch(p.lookup(k))              # frequency 1: promoted to main when met
    p.protect(p.lookup(4))
    p.protect(p.lookup(9))
    assert p.pin(5) and p.pin(6)
    held = {p.lookup(k) for k in (4, 5, 6, 9)}
    evicted = []
    for k in range(100, 106):             # 6 evictable slots: 0-3 and 7, 8
        s, old = p.reserve(k)
        assert s >= 0 and s not in held and old not in (4, 5, 6, 9)
        evicted.append(old)
        p.publish(k, s)
        p.protect(s)                      # each newcomer stays in use
    assert sorted(evicted) == [0, 1, 2, 3, 7, 8]
    assert p.reserve(200) == (-1, EMPTY)  # everything pinned or in use: the walk ends
    assert p.free_capacity() == 0
    p.unprotect(p.lookup(9))
    s, old = p.reserve(200)
    assert old == 9
    p.publish(200, s)
    p.protect(s)
    assert p.pin(5, False)                # unpinned: back in the queues, evictable again
    s, old = p.reserve(201)
    assert old == 5
    with pytest.raises(ValueError):
        p.publish(201, (s + 1) % 10)      # only the reserved slot publishes


def test_s3fifo_first_use_after_a_prefetch_is_not_a_reuse():
    """The engine serves a prefetched expert as a hit (touch with first=True): that is the
    request that missed, so the key stays a one-hit wonder and leaves through the small
    FIFO into the ghost; a real second use promotes it."""
    for reuse, survivor in ((False, 1), (True, 0)):
        p = S3FIFOPolicy(2)
        for k in (0, 1):
            s, _ = p.reserve(k)
            p.publish(k, s)
            p.touch(s, first=True)
        if reuse:
            p.touch(p.lookup(0))
        p.access(2)
        assert p.lookup(survivor) >= 0 and p.lookup(1 - survivor) < 0


def test_make_policy_names_and_environment(monkeypatch):
    monkeypatch.delenv("K3_CACHE_POLICY", raising=False)
    assert isinstance(make_policy(None, 4), X.POLICIES[X.DEFAULT_POLICY])
    monkeypatch.setenv("K3_CACHE_POLICY", "s3fifo")
    assert isinstance(make_policy(None, 4), S3FIFOPolicy)
    assert isinstance(make_policy("LRU", 4), LRUPolicy)
    monkeypatch.setenv("K3_CACHE_POLICY", "arc")
    with pytest.raises(ExpertCacheError, match="K3_CACHE_POLICY: unknown cache policy 'arc'"):
        make_policy(None, 4)


# ---------------------------------------------------------------------------------------
# ExpertCache on the fixture

@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_every_byte_served(fix, direct):
    ck, src = fix
    cache = fixture_cache(ck, N_FIX, direct=direct)
    assert cache.nslot == N_FIX and cache.slot_bytes % 4096 == 0
    assert cache.arena.view.nbytes == N_FIX * cache.slot_bytes
    order = list(range(N_FIX))
    random.Random(1).shuffle(order)
    groups = list(cache.batches(0, order))
    assert len(groups) == 1 and [e for e, _ in groups[0]] == order
    for e, ew in groups[0]:
        assert_served(src, 0, e, ew)
        assert not ew.w1.packed.flags.writeable and ew.w1.packed.base is not None
    assert cache.io_mode == {0: "direct" if direct else "buffered"}
    s = cache.step
    assert (s.requests, s.hits, s.misses, s.prefetch_reads) == (N_FIX, N_FIX, 0, N_FIX)
    assert s.bytes_read == N_FIX * 1632 and s.true_hit_rate == 0.0 and s.load_seconds > 0
    cache.reset_step()
    for group in cache.batches(0, order[::-1]):                   # all resident now
        for e, ew in group:
            assert_served(src, 0, e, ew)
    s = cache.step
    assert (s.hits, s.misses, s.prefetch_reads, s.bytes_read) == (N_FIX, 0, 0, 0)
    assert s.true_hit_rate == 100.0
    assert cache.total.requests == 2 * N_FIX and cache.bytes_read == N_FIX * 1632
    assert_consistent(cache)
    print(f"[gate] cache fixture ({'O_DIRECT' if direct else 'buffered'}): {N_FIX} experts of "
          f"1632 B (not a 4096 multiple) in {cache.slot_bytes} B slots, every byte equal")
    cache.close()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_eviction_pressure_mixed_batch_and_serial(fix, direct):
    """24 batches of 1..9 experts (more than the 5 slots) interleaved with serial gets:
    every byte right, every group resident and protected together while yielded."""
    ck, src = fix
    cache = fixture_cache(ck, 5, direct=direct)
    rng = random.Random(3)
    requests = 0
    for b in range(24):
        want = rng.sample(range(N_FIX), rng.randint(1, 9))
        got = []
        for group in cache.batches(0, want):
            assert 1 <= len(group) <= cache.nslot
            slots = [cache.policy.lookup(cache.key(0, e)) for e, _ in group]
            assert min(slots) >= 0 and len(set(slots)) == len(group)      # resident together
            assert all(s in cache.policy._in_use for s in slots)          # and protected
            for e, ew in group:
                assert_served(src, 0, e, ew)
            got += [e for e, _ in group]
        assert got == want
        assert set(cache.policy._in_use) <= set(cache._serial)     # groups released
        for e in rng.sample(range(N_FIX), 2):
            assert_served(src, 0, e, cache.expert(0, e))
        requests += len(want) + 2
        assert_consistent(cache)
    t = cache.total
    assert t.requests == requests == cache.trace.requests
    assert t.evictions > 0 and t.misses > 0 and t.hits > t.prefetch_reads
    assert t.bytes_read == 1632 * (t.prefetch_reads + t.misses)
    print(f"[gate] eviction pressure ({'O_DIRECT' if direct else 'buffered'}): 24 batches + 48 "
          f"serial gets on 5 slots: {t.requests} requests, {t.evictions} evictions, "
          f"prefetch_reads {t.prefetch_reads} <= hits {t.hits}, every byte equal")
    cache.close()


def test_duplicates_and_groups_split_to_free_slots(fix):
    ck, src = fix
    cache = fixture_cache(ck, 3)
    groups = [[e for e, _ in g] for g in cache.batches(0, [5, 5, 6, 7, 8, 9, 10, 11])]
    assert groups == [[5, 5, 6, 7], [8, 9, 10], [11]]
    assert cache.step.requests == 8 and cache.step.hits + cache.step.misses == 8
    assert cache.pin(0, 11) and not cache.pin(0, 1)
    groups = [[e for e, _ in g] for g in cache.batches(0, [11, 1, 2, 3, 4])]
    assert groups == [[11, 1, 2], [3, 4]]                 # pinned 11 needs no free slot
    assert cache.resident(0, 11) and cache.policy.pinned == 1
    assert_consistent(cache)
    cache.close()


def test_in_use_protection(fix):
    """The group being computed on is never evicted, even when it is the LRU choice; once
    the iterator moves on, it is evictable again."""
    ck, src = fix
    cache = fixture_cache(ck, 6)
    it = cache.batches(0, [0, 1])
    group = next(it)
    held = {e: cache.policy.lookup(cache.key(0, e)) for e, _ in group}
    for e in range(2, 14):                        # 0 and 1 are the least recently used
        cache.expert(0, e)
        assert all(cache.policy.lookup(cache.key(0, x)) == s for x, s in held.items())
        for x, ew in group:
            assert_served(src, 0, x, ew)          # the views still hold their bytes
    assert cache.step.evictions >= 8
    with pytest.raises(StopIteration):
        next(it)                                  # iterator finished: protection released
    assert not (set(cache.policy._in_use) - set(cache._serial))
    cache.expert(0, 20)
    assert not cache.resident(0, 0)               # now the LRU victim
    # a group that does not fit is split; each part is protected only while yielded
    it = cache.batches(0, list(range(10, 20)))
    first = next(it)
    assert len(first) == cache.nslot
    second = next(it)
    assert all(cache.policy.lookup(cache.key(0, e)) >= 0 for e, _ in second)
    it.close()
    assert not cache.policy._in_use
    assert_consistent(cache)
    cache.close()


def test_an_expert_is_served_while_the_groups_other_reads_are_in_flight(fix):
    """The forward computes the first expert of a group while a later read has not
    returned: the read of expert 3 does not answer until the consumer holds expert 1.
    Without the overlap it would wait for nothing (the guard's timeout only keeps a
    regression from hanging).  Counters and bytes are what reading the whole group first
    gave."""
    import threading
    ck, src = fix
    got_first = threading.Event()
    waited = {}
    cache = fixture_cache(ck, 8)
    third = read_offsets(cache, 3)

    def slow(fd, offset, res):
        if offset in third:
            waited["overlapped"] = got_first.wait(30)
        return res
    Interposed(cache, answer=slow)
    order = []
    for group in cache.batches(0, [1, 2, 3]):
        for e, ew in group:
            order.append(e)
            assert_served(src, 0, e, ew)
            got_first.set()
    c = cache.total
    print(f"[gate] served {order}; read of expert 3 still in flight when expert 1 was "
          f"served: {waited.get('overlapped')}; hits {c.hits}, misses {c.misses}, "
          f"prefetch reads {c.prefetch_reads}")
    assert order == [1, 2, 3] and waited["overlapped"] is True
    assert (c.hits, c.misses, c.prefetch_reads) == (3, 0, 3)
    assert not cache.policy._in_use
    assert_consistent(cache)
    cache.close()


def test_next_ready_says_whether_serving_would_wait_for_a_read(fix):
    """The MoE runs the experts it was served as one batch as soon as the next one would
    wait (model._routed_aggregate): next_ready() is False while the next expert's read is
    in flight (expert 3's read is held until the check), True once everything is served,
    and True at every step of a group whose experts are all resident."""
    import threading
    ck, src = fix
    release = threading.Event()
    cache = fixture_cache(ck, 8)
    third = read_offsets(cache, 3)
    Interposed(cache, answer=lambda fd, offset, res: (offset not in third or release.wait(30))
               and res, ready=lambda fd, offset: offset not in third or release.is_set())
    seen = []
    for group in cache.batches(0, [1, 2, 3]):
        for e, ew in group:
            if e == 2:
                seen.append(("before 3 lands", group.next_ready()))
                release.set()
        seen.append(("all served", group.next_ready()))
    for group in cache.batches(0, [1, 2, 3]):            # all hits now
        for e, ew in group:
            seen.append((f"resident after {e}", group.next_ready()))
    print(f"[gate] next_ready: {seen}")
    assert seen == [("before 3 lands", False), ("all served", True),
                    ("resident after 1", True), ("resident after 2", True),
                    ("resident after 3", True)]
    assert_consistent(cache)
    cache.close()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_short_read_leaves_slot_empty_then_drop(fix, direct):
    ck, src = fix
    calls: list[tuple[int, int]] = []
    bad = {5}

    def fail(L, e):
        calls.append((L, e))
        return e in bad

    logs: list[str] = []
    cache = fixture_cache(ck, 4, direct=direct, fail_reads=fail, log=logs.append)
    seen = []
    with pytest.raises(ExpertLoadError) as ei:
        for group in cache.batches(0, [4, 5, 6]):
            for e, _ in group:
                seen.append(e)
    # each expert is served as its read lands (the forward computes 4 while 5 and 6 are
    # read); the drop comes at 5, and the token in flight is never emitted (§4.9)
    assert seen == [4]
    err = ei.value
    assert (err.layer, err.expert) == (0, 5) and "layer 0 expert 5 failed to load" in str(err)
    assert "short read" in str(err) and "twice" in str(err)
    assert calls.count((0, 5)) == 2                       # the prefetch read and one retry
    assert not cache.resident(0, 5) and cache.drops == 1
    assert EMPTY in cache.policy.key_of                   # the failed slot is left EMPTY
    assert not cache.policy._in_use                       # nothing stays protected
    assert len([m for m in logs if "expert 5" in m and "left empty" in m]) == 2
    for e in (4, 6):                                      # the rest of the batch is fine
        assert cache.resident(0, e)
    # the request for 6 was never served: its read counts in bytes, not as a prefetch hit
    assert (cache.step.hits, cache.step.prefetch_reads, cache.step.misses) == (1, 1, 1)
    assert cache.step.bytes_read == 2 * 1632
    assert_consistent(cache)
    print(f"[gate] short read ({'O_DIRECT' if direct else 'buffered'}): {err}")

    # the EMPTY slot was never published: the next request reads again, correctly
    bad.clear()
    assert_served(src, 0, 5, cache.expert(0, 5))
    # a serial get also retries once; a read failing only once is not a drop
    bad.add(7)
    calls.clear()
    with pytest.raises(ExpertLoadError):
        cache.expert(0, 7)
    assert calls == [(0, 7), (0, 7)] and not cache.resident(0, 7) and cache.drops == 2
    once = {8}
    cache._fail_reads = lambda L, e: e in once and not once.discard(e)
    assert_served(src, 0, 8, cache.expert(0, 8))
    for group in cache.batches(0, [9, 10]):
        pass
    once.add(11)
    for group in cache.batches(0, [11, 12]):
        for e, ew in group:
            assert_served(src, 0, e, ew)
    assert cache.drops == 2
    assert_consistent(cache)
    cache.close()


def test_o_direct_refused_falls_back_per_shard(fix, monkeypatch):
    ck, src = fix
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    logs: list[str] = []
    monkeypatch.setattr(X.os, "open", no_direct)
    cache = fixture_cache(ck, 4, log=logs.append)
    for group in cache.batches(0, [1, 2, 3]):
        for e, ew in group:
            assert_served(src, 0, e, ew)
    assert cache.io_mode == {0: "buffered"} and any("O_DIRECT refused" in m for m in logs)
    cache.close()
    monkeypatch.undo()

    # accepted at open, refused on read (EINVAL): buffered from then on, remembered.  The
    # native readers' answer for an O_DIRECT descriptor is replaced by the kernel's EINVAL.
    refusals = []

    def refuse(fd, offset, res):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refusals.append(offset)
            return 0, errno.EINVAL, res[2], res[3]
        return res

    logs.clear()
    cache = fixture_cache(ck, 4, log=logs.append, io_threads=1)
    Interposed(cache, answer=refuse)
    for e in (1, 2, 3, 4, 5):
        assert_served(src, 0, e, cache.expert(0, e))
    assert cache.io_mode == {0: "buffered"} and len(refusals) == 1
    assert sum("reads refused" in m for m in logs) == 1
    cache.close()


def test_unreadable_shard_is_a_drop(fix, monkeypatch):
    ck, _ = fix

    def gone(path, flags, *a):
        raise OSError(errno.ENOENT, "No such file or directory")

    cache = fixture_cache(ck, 3)
    monkeypatch.setattr(X.os, "open", gone)
    with pytest.raises(ExpertLoadError, match="read error .No such file"):
        for group in cache.batches(0, [1, 2]):
            pass
    monkeypatch.undo()
    assert cache.drops == 1 and cache.policy.resident == 0
    assert cache.policy.key_of == [EMPTY] * 3
    assert_consistent(cache)
    cache.close()


def test_counters_reports_and_budget(fix):
    ck, src = fix
    cache = fixture_cache(ck, 4)
    assert cache.init_line() == ("expert cache: 4 slots x 0.01 MB = 0.00 GB (16.67% of the "
                                 "0.00 TB expert pool)")
    for group in cache.batches(0, [0, 1, 2]):
        pass
    cache.reset_step()
    for group in cache.batches(0, [0, 1, 3]):
        pass
    c = cache.step
    assert (c.requests, c.hits, c.misses, c.prefetch_reads, c.evictions) == (3, 3, 0, 1, 0)
    assert c.raw_hit_rate == 100.0 and round(c.true_hit_rate, 2) == 66.67
    assert c.retention == 100.0
    lines = cache.report_lines()
    assert lines[0] == "cache [final step]"
    assert lines[1] == "  slots        : 4 of 0.01 MB = 0.00 GB arena (4 resident, 0 pinned)"
    assert lines[2] == "  requests     : 3  hits 3 (100.00%)  misses 0  evictions 0"
    assert lines[3] == "  of those hits : 1 came from the batch prefetch, i.e. read from disk"
    assert lines[4] == "                  this token; TRUE resident hit rate 66.67%"
    assert re.fullmatch(r"  read from disk: 0\.00 GB in \d+\.\d\d s \(\d+ MB/s while loading\)",
                        lines[5])
    t = cache.total
    assert (t.requests, t.hits, t.prefetch_reads, t.bytes_read) == (6, 6, 4, 4 * 1632)
    # no prefetch (K3_NOPREFETCH A/B): misses read serially, same bytes
    serial = fixture_cache(ck, 4, prefetch=False)
    for group in serial.batches(0, [0, 1, 2]):
        for e, ew in group:
            assert_served(src, 0, e, ew)
    assert (serial.step.misses, serial.step.prefetch_reads) == (3, 0)
    assert len(serial.report_lines()) == 4
    # a budget below top-k + 1 slots is refused before allocation (§4.1)
    with pytest.raises(ExpertCacheError, match=r"gives 2 slots of 0\.01 MB, but top-2 needs "
                                               r"at least 3"):
        fixture_cache(ck, 2)
    with pytest.raises(ValueError):
        ExpertCache(ck, None, 1 << 20)
    with pytest.raises(ExpertLoadError, match="out of range"):
        cache.expert(0, N_FIX)
    cache.close()
    serial.close()


def test_trace_and_histogram_dump(fix, tmp_path):
    ck, _ = fix
    cache = fixture_cache(ck, 4)
    want = []
    for b in ([3, 1, 2], [1, 7], [3]):
        for group in cache.batches(0, b):
            pass
        want += b
    cache.expert(0, 9)
    want.append(9)
    with pytest.raises(FileNotFoundError):
        cache.dump_trace(tmp_path / "nope")
    lines = cache.dump_trace(tmp_path)
    raw = (tmp_path / "expert_trace.bin").read_bytes()
    assert len(raw) == 8 * len(want)
    assert np.frombuffer(raw, "<i4").reshape(-1, 2).tolist() == [[0, e] for e in want]
    assert lines[-1] == f"wrote {tmp_path / 'expert_trace.bin'}: {len(want)} requests (0.1 KB)"
    text = (tmp_path / "expert_hist.json").read_text()
    assert text.startswith('{"n_layers":1,"n_experts":24,"counts":{"0,1":2,"0,2":1,"0,3":2,')
    assert json.loads(text)["counts"] == {"0,1": 2, "0,2": 1, "0,3": 2, "0,7": 1, "0,9": 1}
    # the dump replays
    assert sim_cache.main([str(tmp_path / "expert_trace.bin"), "--capacities", "1"]) == 0
    cache.close()


def test_resident_adapter(fix, tmp_path):
    ck, src = fix

    class Source:
        bytes_read = 123

        def expert(self, L, e):
            from k3engine.weights import MXFP4, ExpertWeights
            a = {k: np.frombuffer(src[ename(L, e, k)], np.uint8) for k in KEYS}
            mx = {m: MXFP4(a[f"{m}.weight_packed"].reshape(8, 64),
                           a[f"{m}.weight_scale"].reshape(8, 4)) for m in ("w1", "w2", "w3")}
            return ExpertWeights(w1=mx["w1"], w3=mx["w3"], w2=mx["w2"])

    res = ResidentExperts(Source(), n_layers=1, n_experts=N_FIX)
    groups = list(res.batches(0, list(range(N_FIX))))
    assert len(groups) == 1 and [e for e, _ in groups[0]] == list(range(N_FIX))
    assert_served(src, 0, 4, res.expert(0, 4))
    assert res.bytes_read == 123 and res.trace.requests == N_FIX + 1
    res.dump_trace(tmp_path)
    assert (tmp_path / "expert_trace.bin").stat().st_size == 8 * (N_FIX + 1)


# ---------------------------------------------------------------------------------------
# A generated tiny checkpoint: the cache serves exactly what Binder.expert reads

@pytest.fixture(scope="module", params=[None, 1_000_000], ids=["1-shard", "1MB-shards"])
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "t"
    cfg = dims_config("tiny")
    if request.param is None:
        make_checkpoint(str(d), cfg, seed=1)
    else:
        make_checkpoint(str(d), cfg, seed=1, shard_bytes=request.param)
    return d, cfg


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_tiny_checkpoint_cache_equals_binder(tiny, policy):
    d, cfg = tiny
    ck = Checkpoint(d)
    binder = Binder(ck, cfg)
    probe = resolve_expert(ck, cfg, 1, 0)
    cache = ExpertCache(ck, cfg, 3 * slot_bytes_for(probe.nbytes), policy=policy)
    assert cache.nslot == 3 == cfg.topk + 1
    moe = [L for L in range(cfg.n_layers) if not cfg.is_dense(L)]
    n = 0
    for L in moe:
        want = {e: ew_bytes(binder.expert(L, e)) for e in range(cfg.n_experts)}
        order = list(range(cfg.n_experts))
        random.Random(L).shuffle(order)
        for group in cache.batches(L, order):
            assert len(group) <= 3
            for e, ew in group:
                assert ew_bytes(ew) == want[e]
                assert ew.w1.packed.shape == (cfg.moe_inter, cfg.latent // 2)
                assert ew.w2.scales.shape == (cfg.latent, cfg.moe_inter // 32)
                n += 1
        for e in order[::3]:
            assert ew_bytes(cache.expert(L, e)) == want[e]
            n += 1
    assert_consistent(cache)
    print(f"[gate] tiny checkpoint ({len(ck.shards)} shard(s)): {n} expert requests through 3 "
          f"slots ({policy}), every one byte-identical to Binder.expert; "
          f"{cache.total.evictions} evictions")
    cache.close()
    ck.close()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_tiny_model_same_logits_with_a_3_slot_cache(tiny, policy):
    """Memory decisions only change speed: the forward pass over a 3-slot cache gives the
    logits of the resident experts bit for bit (prefill and chunk union included), under
    either replacement policy."""
    from k3engine.model import Model
    d, cfg = tiny
    ck = Checkpoint(d)
    binder = Binder(ck, cfg)
    weights = ResidentWeights(binder, cfg.n_layers)
    ids = [1, 5, 9, 200, 17, 3, 3, 80]
    out = {}
    for name, src in (("resident", ResidentExperts(CheckpointExperts(binder))),
                      ("cache", ExpertCache(ck, cfg, 3 * slot_bytes_for(
                          resolve_expert(ck, cfg, 1, 0).nbytes), policy=policy))):
        model = Model(cfg, weights, src)
        st = model.new_state(len(ids) + 1)
        out[name] = model.forward(ids, st, all_logits=True)
        out[name + "+1"] = model.forward([7], st)
    assert np.array_equal(out["resident"], out["cache"])
    assert np.array_equal(out["resident+1"], out["cache+1"])
    print(f"[gate] tiny model: logits of {len(ids)} prompt positions + 1 decode step "
          f"identical with a 3-slot expert cache ({policy}) and resident experts")
    ck.close()


# ---------------------------------------------------------------------------------------
# Trace replay (§10.3, §11.3)

def _published() -> list[str]:
    text = (peer_dir() / "measured" / "expert-cache-capacity.txt").read_text().splitlines()
    start = next(i for i, l in enumerate(text) if l.startswith("trace: "))
    end = next(i for i, l in enumerate(text) if l.startswith("holding the whole pool"))
    return text[start:end + 1]


def test_sim_cache_reproduces_published_table(capsys):
    trace = peer_dir() / "expert_trace.bin"
    assert trace.stat().st_size == 800_768
    assert sim_cache.main([str(trace)]) == 0
    got = capsys.readouterr().out.splitlines()
    want = _published()
    rows = [l for l in want if re.match(r"\d+ GB ", l)]
    assert len(rows) == 12
    for line in rows:
        print(f"[gate] sim-cache {line}")
    assert got == want


def test_sim_cache_s3fifo_and_options(tmp_path, capsys):
    """S3-FIFO replay gives §4.10's figures; --capacities; an odd int32 count is refused."""
    keys = sim_cache.trace_keys(sim_cache.read_trace(peer_dir() / "expert_trace.bin"))
    n = len(keys)
    gates = []
    for slots, want in ((455, 35.32), (1823, 42.68), (3647, 49.97), (7294, 73.73),
                        (10941, 90.00)):
        got = round(100.0 * sim_cache.policy_hits(keys, slots, "s3fifo") / n, 2)
        gates.append(f"[gate] sim-cache S3-FIFO {slots} slots: {got:.2f}% "
                     f"(SYSTEM §4.10: {want:.2f}%)")
        assert got == want
    trace = str(peer_dir() / "expert_trace.bin")
    assert sim_cache.main([trace, "--capacities", "0.2,8", "--s3fifo"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = [l for l in out if re.match(r"[\d.]+ GB ", l)]
    assert table == ["8 GB           455    36.24%    35.32%    39.42%    37.82%        16.47"
                     "       13.35"]                               # 0.2 GB: < 17 slots, skipped
    bad = tmp_path / "odd.bin"
    bad.write_bytes(b"\0" * 12)
    assert sim_cache.main([str(bad)]) == 1
    assert "not (layer, expert) pairs" in capsys.readouterr().err
    print("\n".join(gates))
