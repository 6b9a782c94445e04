"""The batch exactness gate of tests/test_batch.py on any checkpoint (the mid one is too
big for the suite): eight sequences, prompts of 1 to 2,000 positions, joins and leaves at
random steps, greedy and seeded; every sequence's ids and first-step logits must equal it
run alone.  Prints what it compared; exits 1 on a difference.

    python benchmarks/gate_batch.py MODEL [--trunk DIR] [--budget-args "--trunk-gb 0.5 --cache-gb 0.5"]
                                    [--threads N] [--seed S]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from bench_batch import memory_flags                 # noqa: E402
from k3engine import kernels as K                    # noqa: E402
from k3engine.engine import load_spec_from, open_engine   # noqa: E402
from test_batch import check_scenario, random_scenario    # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--trunk", default=None)
    ap.add_argument("--budget-args", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    eng = open_engine(load_spec_from(a.model, memory_flags(a.budget_args), trunk_dir=a.trunk,
                                     incremental=True, threads=a.threads), gen=16)
    K.set_num_threads(a.threads)
    try:
        check_scenario(eng.lm, f"{os.path.basename(a.model.rstrip('/'))} "
                       f"'{a.budget_args or 'resident'}', {a.threads} thread(s)",
                       random_scenario(a.seed, eng.cfg.vocab))
    except AssertionError as e:
        print(f"GATE FAILED: {e}")
        return 1
    finally:
        eng.close()
    print("GATE PASSED: every sequence equal to it run alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
