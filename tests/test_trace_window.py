"""The session trace kept bounded: a RequestTrace with a window holds only the latest N
requests in a ring allocated once, the plan counts that ring (so the planner's total stays
honest for a session of any length), and a real run with a window keeps what it planned."""
from __future__ import annotations

import random

import numpy as np
import pytest

from k3engine import memory as M
from k3engine.experts import RequestTrace
from k3engine.engine import GenSpec, Prompt, load_spec_from, open_engine
from k3engine.tools import sim_cache

from engine_helpers import make_tiny


def synthetic(n: int, seed: int = 7) -> list[tuple[int, int]]:
    rnd = random.Random(seed)
    return [(rnd.randrange(12), rnd.randrange(64)) for _ in range(n)]


def test_a_long_trace_stays_within_its_window():
    window, reqs = 1000, synthetic(50_000)
    t = RequestTrace(12, 64, keep_pairs=True, window=window)
    ring_bytes = t._ring.buffer_info()[1] * t._ring.itemsize
    for L, e in reqs[:10]:
        t.record(L, e)
    assert t.kept == 10 and not t.windowed                  # not full yet: all of them
    assert t.kept_pairs().tolist() == [list(p) for p in reqs[:10]]
    for i, (L, e) in enumerate(reqs[10:], 10):
        t.record(L, e)
        if i % 9973 == 0:                                   # never a byte more than the ring
            assert t._ring.buffer_info()[1] * t._ring.itemsize == ring_bytes
    assert ring_bytes == M.TRACE_PAIR_BYTES * window
    assert t.requests == 50_000 and t.kept == window and t.windowed
    assert t.kept_pairs().tolist() == [list(p) for p in reqs[-window:]]   # latest, in order
    assert t.counts.sum() == 50_000                        # the heat counts cover everything
    assert len(t.pairs) == 0                               # the unbounded list is unused
    print(f"[trace] 50,000 requests through a {window}-request window: {ring_bytes} bytes held")


def test_a_window_that_wraps_exactly():
    t = RequestTrace(2, 2, keep_pairs=True, window=3)
    for L, e in [(0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (0, 1)]:
        t.record(L, e)
    assert t.kept_pairs().tolist() == [[1, 1], [0, 0], [0, 1]]


def test_the_dump_of_a_window_is_what_sim_cache_reads(tmp_path):
    reqs = synthetic(5000)
    t = RequestTrace(12, 64, keep_pairs=True, window=700)
    for L, e in reqs:
        t.record(L, e)
    lines = t.dump(tmp_path)
    assert "latest 700 of 5000" in lines[1]
    got = sim_cache.read_trace(tmp_path / "expert_trace.bin")
    assert got.tolist() == [list(p) for p in reqs[-700:]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tw") / "tiny")


def test_the_plan_counts_the_window(tiny):
    window = 4096
    base = dict(trunk_gb=0, cache_gb=0.01, streamed=False, incremental=True)
    run = open_engine(load_spec_from(tiny, [("--cache-gb", 0.01)], keep_trace=True,
                                     trace_window=window), prompt=Prompt(ids=(5, 17)), gen=2)
    try:
        fig = run.setup.figures
        positions = 40
        none = M.plan(fig, keep_trace=False, positions=positions, **base)
        kept = M.plan(fig, keep_trace=True, positions=positions, **base)
        windowed = M.plan(fig, keep_trace=True, trace_window=window, positions=positions,
                          **base)
        # the window is counted whole, whatever the positions (a session outlives them)
        assert windowed.buffer_bytes - none.buffer_bytes == M.TRACE_PAIR_BYTES * window
        assert windowed.trace_bytes == M.TRACE_PAIR_BYTES * window
        assert windowed.trace_window == window
        assert windowed.total_bytes - none.total_bytes == M.TRACE_PAIR_BYTES * window
        # without a window, every request of the run's positions (as before)
        assert kept.trace_bytes == fig.trace_bytes(positions, True) > 0
        assert kept.trace_window == 0 and none.trace_bytes == 0
        # the engine carries the window to the planner and to the trace it builds
        assert M.plan_for(fig, run.spec.plan_request(positions)).trace_bytes == \
            windowed.trace_bytes
        trace = run.lm.experts.trace
        assert trace.window == window
        assert trace._ring.buffer_info()[1] * trace._ring.itemsize == windowed.trace_bytes
        print(f"[plan] trace window {window}: {windowed.trace_bytes} bytes counted in buffers "
              f"({M.human(windowed.buffer_bytes)})")
    finally:
        run.close()


def test_a_real_run_keeps_only_its_window(tiny):
    """A real generation that makes more requests than its window: what is kept is the
    tail of the full trace of the same run (routing does not depend on the cache)."""
    runs = {}
    for name, window in (("full", 0), ("window", 150)):
        run = open_engine(load_spec_from(tiny, [("--cache-gb", 0.01)], keep_trace=True,
                                         trace_window=window, incremental=True), gen=6)
        try:
            for _ in run.batch([5, 17, 99, 123], GenSpec(gen=6)):
                pass
            tr = run.lm.experts.trace
            runs[name] = (tr.kept_pairs(), tr.requests)
        finally:
            run.close()
    full, n = runs["full"]
    kept, n2 = runs["window"]
    assert n == n2 > 150 and len(full) == n
    assert np.array_equal(kept, full[-150:])
