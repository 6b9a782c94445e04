"""Batched decode measured (never asserted): B sequences decoded together share each step's
pass over the trunk and the union of their experts.  For B = 1, 2, 4, 8 (alternated, `--reps`
times, a fresh engine each), the aggregate generated tokens/s, the bytes read per generated
token and the step time, on a budget given as `k3` memory flags.

    python benchmarks/bench_batch.py MODEL [--trunk DIR] [--budget-args "--trunk-gb 0 --cache-gb 0.002"]
                                     [--sizes 1,2,4,8] [--gen 16] [--prompt 32] [--reps 3]
                                     [--drop-caches]
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import numpy as np

from bench_engine import drop_caches            # benchmarks/ is the script's folder
from k3engine.engine import load_spec_from, open_engine
from k3engine.generate import Run, GenSpec, Turn, decode_many


def memory_flags(text: str) -> list[tuple[str, object]]:
    a = shlex.split(text)
    return [(a[i], a[i + 1]) for i in range(0, len(a), 2)]


def one(model, trunk, flags, B, gen, plen, seed) -> tuple[float, float, float]:
    """(aggregate tokens/s, bytes read per generated token, mean step seconds) of one run,
    decode steps only (the first step, which prefills, left out of the rates)."""
    rng = np.random.default_rng(seed)
    eng = open_engine(load_spec_from(model, flags, trunk_dir=trunk, incremental=True),
                      gen=B * (plen + gen + 1))
    try:
        runs = []
        for _ in range(B):
            seq = eng.sequence()
            seq.extend([int(i) for i in rng.integers(0, eng.cfg.vocab, plen)], gen + 1)
            s = GenSpec(gen=gen).sampling.sampler()
            s.new_turn(1)
            runs.append(Run(seq, GenSpec(gen=gen), s))
        steps = []
        for ev in Turn(decode_many(eng, runs)):
            if type(ev).__name__ == "StepDone":
                t = ev.telemetry
                steps.append((ev.seconds, len(ev.ids), t.trunk_bytes + t.expert_bytes +
                              t.model_table_bytes))
    finally:
        eng.close()
    dec = steps[1:]
    secs, toks, byts = (sum(x[i] for x in dec) for i in range(3))
    return toks / secs, byts / toks, secs / len(dec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--trunk", default=None)
    ap.add_argument("--budget-args", default="")
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before each run (root)")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    flags = memory_flags(a.budget_args)
    got = {B: [] for B in sizes}
    dropped = True
    for rep in range(a.reps):
        for B in (sizes if rep % 2 == 0 else sizes[::-1]):     # alternated
            if a.drop_caches:
                dropped &= drop_caches()
            got[B].append(one(a.model, a.trunk, flags, B, a.gen, a.prompt, rep))
    base = statistics.median(r[0] for r in got[sizes[0]])
    print(f"model {a.model}, trunk {a.trunk or 'resident'}, budget '{a.budget_args}', "
          f"{a.prompt}-id prompts, {a.gen} tokens each, median of {a.reps}"
          + ("" if not a.drop_caches else
             f", page cache {'dropped' if dropped else 'NOT dropped (no permission)'}"))
    for B in sizes:
        rate = statistics.median(r[0] for r in got[B])
        per = statistics.median(r[1] for r in got[B])
        step = statistics.median(r[2] for r in got[B])
        print(f"  B={B}: {rate:8.2f} tokens/s in all ({rate / base:.2f}x B={sizes[0]}), "
              f"{per / 1e6:8.3f} MB read per generated token, step {step * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
