"""The drafter and lookahead exactness gate on any checkpoint (the mid one is too big for
the suite): greedy ids with a block drafter (`--draft-model`: the given folder, or a
random-weight one made for the model) and with lookahead on and off all equal plain
decoding.  Prints what it compared; exits 1 on a difference.

    python benchmarks/gate_drafter.py MODEL [--trunk DIR] [--budget-args "--trunk-gb 0.5 --cache-gb 0.5"]
                                      [--drafter DIR] [--threads N] [--gen 12]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import numpy as np                                             # noqa: E402

from bench_batch import memory_flags                           # noqa: E402
from k3engine.config import load_config                        # noqa: E402
from k3engine.drafter import default_width                     # noqa: E402
from k3engine.engine import load_spec_from, open_engine        # noqa: E402
from k3engine.generate import GenSpec, Turn                    # noqa: E402


def run(model, trunk, flags, ids, gen, threads, drafter=None, lookahead=True):
    width = default_width(drafter) if drafter else 0
    spec = load_spec_from(model, flags, trunk_dir=trunk, incremental=True, threads=threads,
                          drafter_dir=drafter, lookahead=lookahead, spec=width)
    eng = open_engine(spec, gen=len(ids) + gen + 1)
    try:
        turn = Turn(eng.batch(list(ids), GenSpec(gen=gen, spec=width)))
        for _ in turn:
            pass
        return turn.summary
    finally:
        eng.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--trunk", default=None)
    ap.add_argument("--budget-args", default="")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gen", type=int, default=12)
    a = ap.parse_args(argv)
    cfg = load_config(os.path.join(a.model, "config.json"))
    drafter = a.drafter
    if drafter is None:
        from drafter_helpers import make_drafter
        n = cfg.n_layers
        drafter = make_drafter(tempfile.mkdtemp(prefix="k3drafter-"), cfg,
                               sorted({1, n // 3, 2 * n // 3, n - 1}))
    ids = [int(i) for i in np.random.default_rng(3).integers(0, cfg.vocab, 40)]
    flags = memory_flags(a.budget_args)
    plain = run(a.model, a.trunk, flags, ids, a.gen, a.threads, lookahead=False)
    ok = True
    for label, kw in (("lookahead", dict(lookahead=True)),
                      ("drafter", dict(drafter=drafter, lookahead=False)),
                      ("drafter + lookahead", dict(drafter=drafter, lookahead=True))):
        got = run(a.model, a.trunk, flags, ids, a.gen, a.threads, **kw)
        same = got.ids == plain.ids
        ok &= same
        print(f"[gate] {os.path.basename(a.model.rstrip('/'))} '{a.budget_args or 'resident'}'"
              f", {a.threads} thread(s), {label}: {got.ids} vs plain {plain.ids}: "
              f"{'equal' if same else 'DIFFERENT'}; {got.spec.rounds} passes, "
              f"{got.spec.accepted} of {got.spec.drafted} drafts accepted; lookahead "
              f"{got.lookahead_useful} of {got.lookahead_predicted} reads used", flush=True)
    print("GATE PASSED" if ok else "GATE FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
