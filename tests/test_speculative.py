"""--spec (SYSTEM §6.10): drafts verified in one sweep never change the ids.  Random-weight
models rarely repeat themselves, so the sweep is driven with oracle drafts (the true greedy
continuation, corrupted at chosen places) to exercise full acceptance, partial acceptance
(state restore + replay) and rejection."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine_helpers import GOLDEN_SEED, decode, load, make_tiny
from k3engine import speculative

GOLDEN = json.loads((Path(__file__).parent / "golden" / "tiny_seed1234.json").read_text())


def test_draft_rule():
    seq = [1, 2, 3, 4, 9, 9, 1, 2, 3, 4, 7, 8, 5, 1, 2, 3, 4]
    # two earlier occurrences of the 4-gram 1 2 3 4 disagree (9 vs 7): no 4-gram draft;
    # the 3-gram 2 3 4 has the same two occurrences: no draft either
    assert speculative.draft(seq, 8) == []
    seq = [1, 2, 3, 4, 7, 8, 5, 0, 1, 2, 3, 4]
    assert speculative.draft(seq, 8) == [7, 8, 5, 0, 1, 2, 3, 4]     # one occurrence: follow it
    assert speculative.draft(seq, 3) == [7, 8, 5]
    assert speculative.draft([1, 2], 8) == []


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load(make_tiny(tmp_path_factory.mktemp("spec") / "tiny", GOLDEN_SEED))


@pytest.mark.parametrize("corrupt", ["none", "every third", "all"])
def test_oracle_drafts_give_greedy_ids(lm, monkeypatch, corrupt):
    prompt, want = GOLDEN["prompt_ids"], GOLDEN["generated_ids"]
    truth = prompt + want

    def oracle(seq, cap):
        T = len(seq)
        d = truth[T:T + cap]
        if corrupt == "all":
            return [(x + 1) % 256 for x in d]
        if corrupt == "every third":
            return [(x + 1) % 256 if (T + i) % 3 == 0 else x for i, x in enumerate(d)]
        return d
    monkeypatch.setattr(speculative, "draft", oracle)
    res = decode(lm, prompt, len(want), spec=4)
    sp = res.spec
    print(f"[gate] --spec 4 with {corrupt!r} corrupted drafts: {sp.rounds} sweeps, "
          f"{sp.drafted} drafted, {sp.accepted} accepted, {res.steps} steps for "
          f"{len(want)} tokens; ids equal greedy: {res.ids == want}")
    assert res.ids == want
    assert sp.rounds > 0
    if corrupt == "none":
        assert sp.accepted == sp.drafted and res.steps < len(want)
    if corrupt == "all":
        assert sp.accepted == 0


def _same_state(a, b) -> int:
    """Bit-compare two sequence states (recurrent state, and the MLA rows in use)."""
    from k3engine.state import KDAState
    assert a.n_cached == b.n_cached
    n = 0
    for x, y in zip(a.layers, b.layers):
        arrays = ((x.S, y.S), (x.conv_q, y.conv_q), (x.conv_k, y.conv_k), (x.conv_v, y.conv_v)) \
            if isinstance(x, KDAState) else ((x.rows(0, a.n_cached), y.rows(0, a.n_cached)),
                                             (x.rope_rows(0, a.n_cached),
                                              y.rope_rows(0, a.n_cached)))
        for p, q in arrays:
            assert np.array_equal(p.view(np.uint32), q.view(np.uint32))
            n += p.size
    return n


@pytest.mark.parametrize("calls", ["one sweep", "one call per token"])
def test_keep_prefix_equals_replay_bitwise(lm, calls):
    """The rejected tail of a sweep is dropped by re-running only the recurrence and the
    conv-history shift on the logged inputs (state.keep_prefix).  For every number of kept
    positions, the state must equal -- bit for bit -- the state of re-feeding exactly the
    kept positions from the snapshot, which is what the reference does."""
    import copy

    from k3engine.state import begin_sweep, end_sweep, keep_prefix
    prompt, want = GOLDEN["prompt_ids"], GOLDEN["generated_ids"]
    base_state = lm.model.new_state(64)
    lm.model.forward(prompt[:-1], base_state)
    tail = [prompt[-1]] + [(x + 3) % 256 for x in want[:5]]     # 6 positions, some wrong
    compared = 0
    for keep in range(0, len(tail) + 1):
        swept, replayed = copy.deepcopy(base_state), copy.deepcopy(base_state)
        base = swept.n_cached
        snap = begin_sweep(swept)
        if calls == "one sweep":
            lm.model.forward(tail, swept, all_logits=True)
        else:
            for t in tail:
                lm.model.forward([t], swept)
        keep_prefix(swept, snap, base, keep)
        end_sweep(swept)
        if keep:
            lm.model.forward(tail[:keep], replayed)
        compared += _same_state(swept, replayed)
        nxt = want[0]
        a = lm.model.forward([nxt], swept)
        b = lm.model.forward([nxt], replayed)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    print(f"[gate] keep_prefix vs replay ({calls}), keep 0..{len(tail)}: {compared} state "
          f"values and the next step's logits bit-identical")
