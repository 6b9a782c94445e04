"""--spec (SYSTEM §6.10): drafts verified in one sweep never change the ids.  Random-weight
models rarely repeat themselves, so the sweep is driven with oracle drafts (the true greedy
continuation, corrupted at chosen places) to exercise full acceptance, partial acceptance
(state restore + replay) and rejection."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_helpers import GOLDEN_SEED, load, make_tiny
from k3engine import speculative
from k3engine.session import generate

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
    res = generate(lm, prompt, len(want), True, spec=4)
    sp = res.spec
    print(f"[gate] --spec 4 with {corrupt!r} corrupted drafts: {sp.rounds} sweeps, "
          f"{sp.drafted} drafted, {sp.accepted} accepted, {len(res.steps)} steps for "
          f"{len(want)} tokens; ids equal greedy: {res.generated_ids == want}")
    assert res.generated_ids == want
    assert sp.rounds > 0
    if corrupt == "none":
        assert sp.accepted == sp.drafted and len(res.steps) < len(want)
    if corrupt == "all":
        assert sp.accepted == 0
