"""Model.forward's `capture`: the features a block drafter reads (each layer's output as the
next layer reads it, the final aggregate after the last layer).  Capturing changes no
logit, and a position's feature does not depend on how many positions share the pass."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import GOLDEN_SEED, golden_prompt, load, make_tiny


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load(make_tiny(tmp_path_factory.mktemp("capture") / "tiny", GOLDEN_SEED))


def test_capture_changes_no_logit_and_is_the_same_one_position_at_a_time(lm):
    m = lm.model
    ids = golden_prompt(m.cfg.vocab)[:12]
    layers = list(range(m.n_layers))
    plain = m.forward(ids, m.new_state(32), all_logits=True)
    cap = dict.fromkeys(layers)
    whole = m.forward(ids, m.new_state(32), all_logits=True, capture=cap)
    assert np.array_equal(plain, whole)
    st = m.new_state(32)
    rows = {L: [] for L in layers}
    for t in ids:                                      # incremental, one position a pass
        one = dict.fromkeys(layers)
        m.forward([t], st, capture=one)
        for L in layers:
            rows[L].append(one[L])
    for L in layers:
        assert cap[L].shape == (len(ids), m.cfg.hidden)
        assert np.array_equal(cap[L], np.concatenate(rows[L])), L
    print(f"capture: {len(layers)} layers x {len(ids)} positions, whole pass == one at a "
          f"time bit for bit; logits unchanged")
    # the last layer's feature is what the final norm reads: its norm projects to the logits
    t = lm.model.weights.tables
    from k3engine.model import rmsnorm
    last = t.project(rmsnorm(cap[m.n_layers - 1], t.final_norm, m.cfg.rms_eps))
    assert np.array_equal(last, plain)
