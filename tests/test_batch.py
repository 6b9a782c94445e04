"""Several sequences in one pass (Model.forward_batch, generate.decode_many, `k3 --batch`):
every sequence's ids and first-step logits are bit-identical to the same prompt run alone,
at every batch size, with mixed prompt lengths, joins and leaves, resident and streamed,
1 and 2 threads, greedy and seeded sampling."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine_helpers import GOLDEN_SEED, decode, load, make_tiny
from k3engine import kernels as K
from k3engine.engine import Engine
from k3engine.generate import Run, GenSpec, Sampling, Turn, decode_many
from test_cli import k3

RNG = np.random.default_rng(44)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("batch") / "tiny", GOLDEN_SEED)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    from k3engine.trunk import pack_trunk
    d = tmp_path_factory.mktemp("batch") / "demo"
    make_checkpoint(str(d), dims_config("demo"), seed=9)
    pack_trunk(str(d), str(d / "trunk"))
    return str(d)


def prompts(vocab: int, lengths) -> list[list[int]]:
    return [[int(i) for i in RNG.integers(0, vocab, n)] for n in lengths]


def alone(lm, prompt, gen, sampling=Sampling()):
    """The sequence run by itself: its ids and first-step logits."""
    first = []
    turn = Turn(Engine.around(lm).batch(list(prompt), GenSpec(gen=gen, sampling=sampling)))
    for ev in turn:
        if getattr(ev, "logits", None) is not None:
            first.append(ev.logits.copy())
    return turn.summary.ids, first[0]


def together(lm, ps, gens, samplings=None, join_at=None, leave_at=None):
    """All of `ps` in one batch; `join_at[b]`: the step the sequence joins at; `leave_at[b]`:
    the step after which it is dropped (its ids up to then)."""
    eng = Engine.around(lm)
    samplings = samplings or [Sampling()] * len(ps)
    runs = []
    for p, g, s in zip(ps, gens, samplings):
        seq = eng.sequence()
        seq.extend(p, g + 1)
        sampler = s.sampler()
        sampler.new_turn(1)
        runs.append(Run(seq, GenSpec(gen=g, sampling=s), sampler))
    join_at = join_at or [0] * len(ps)
    active = [r for r, j in zip(runs, join_at) if j == 0]
    step = 0
    turn = Turn(decode_many(eng, active))
    for ev in turn:
        if type(ev).__name__ == "StepDone" and ev.step >= 0:
            step += 1
            for r, j in zip(runs, join_at):
                if j == step:
                    active.append(r)                     # joins at this step boundary
            for b, r in enumerate(runs):
                if leave_at and leave_at[b] == step and r in active:
                    r.leave()
    return [r.summary for r in runs]


@pytest.mark.parametrize("threads", [1, 2])
def test_batch_of_one_to_eight_equals_each_alone(tiny, threads):
    K.set_num_threads(threads)
    lm = load(tiny)
    try:
        ps = prompts(256, [1, 3, 17, 5, 40, 2, 9, 64])
        want = [alone(lm, p, 6) for p in ps]
        for B in (1, 2, 3, 8):
            got = together(lm, ps[:B], [6] * B)
            for b in range(B):
                assert got[b].ids == want[b][0], (B, b)
                assert np.array_equal(got[b].first_logits.view(np.uint32),
                                      want[b][1].view(np.uint32)), (B, b)
            print(f"[gate] tiny, {threads} thread(s), B={B}: ids and first-step logits of "
                  f"{B} sequences (prompt lengths {[len(p) for p in ps[:B]]}) equal each run "
                  f"alone")
    finally:
        lm.close()
        K.set_num_threads(1)


def test_joins_leaves_and_sampling_on_a_streamed_demo(demo):
    """Streamed trunk, a small expert cache; sequences join at later steps and one leaves;
    half sample with their own seeds."""
    from k3engine.engine import load_spec_from, open_engine
    import os
    eng = open_engine(load_spec_from(demo, [("--trunk-gb", 0.0), ("--cache-gb", 0.002)],
                                     trunk_dir=os.path.join(demo, "trunk"), incremental=True),
                      gen=12)
    try:
        lm = eng.lm
        ps = prompts(4000, [12, 1, 30, 7, 200])
        samplings = [Sampling(), Sampling(seed=5, temperature=0.9), Sampling(),
                     Sampling(seed=11), Sampling()]
        gens = [10, 8, 10, 6, 9]
        want = [alone(lm, p, g, s) for p, g, s in zip(ps, gens, samplings)]
        got = together(lm, ps, gens, samplings, join_at=[0, 0, 2, 3, 5],
                       leave_at=[None, 4, None, None, None])
    finally:
        eng.close()
    for b in range(len(ps)):
        w = want[b][0][:len(got[b].ids)] if b == 1 else want[b][0]
        print(f"[gate] demo streamed, sequence {b} (prompt {len(ps[b])}, "
              f"{'sampled' if samplings[b].seed else 'greedy'}): {got[b].ids} vs alone "
              f"{want[b][0]}")
        assert got[b].ids == w
    assert len(got[1].ids) < gens[1]                    # it left early


def test_cli_batch_file(tiny, tmp_path):
    """`k3 MODEL --batch FILE`: --out holds every sequence's figures in input order, each
    equal to a single run's ids."""
    ps = prompts(256, [4, 11, 2])
    f = tmp_path / "batch.jsonl"
    f.write_text("".join(json.dumps({"ids": p, "gen": 5}) + "\n" for p in ps))
    out, ev = tmp_path / "out.json", tmp_path / "events.jsonl"
    p = k3(tiny, "--batch", f, "--out", out, "--events", ev)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    steps = [json.loads(line) for line in ev.read_text().splitlines()]
    sizes = [e.get("sequences", 1) for e in steps if e["ev"] == "step"]
    assert sizes and sizes[0] == 3 and sizes == got["batch_sizes"], (sizes, got["batch_sizes"])
    assert all(s["decode_tokens_per_second"] > 0 for s in got["sequences"])
    singles = []
    for q in ps:
        o1 = tmp_path / "one.json"
        r = k3(tiny, "--ids", ",".join(map(str, q)), "--gen", "5", "--incremental",
               "--out", o1)
        assert r.returncode == 0, r.stderr
        singles.append(json.loads(o1.read_text())["generated_ids"])
    print(f"[cli] --batch of {len(ps)}: {[s['generated_ids'] for s in got['sequences']]} vs "
          f"single runs {singles}; aggregate {got['generated_tokens']} tokens, "
          f"{got['bytes_read_per_token']:.0f} B read per token")
    assert [s["generated_ids"] for s in got["sequences"]] == singles
    assert got["batch_size_max"] == 3 and got["generated_tokens"] == 15


def _demo_engine(demo, where: str, gen: int):
    import os
    from k3engine.engine import load_spec_from, open_engine
    flags = [("--trunk-gb", 0.0), ("--cache-gb", 0.002)] if where == "streamed" else []
    return open_engine(load_spec_from(demo, flags, incremental=True,
                                      trunk_dir=os.path.join(demo, "trunk")
                                      if where == "streamed" else None), gen=gen)


def random_scenario(seed: int, vocab: int, lengths=(1, 2000, 37, 700, 5, 1200, 64, 300)):
    """Eight prompts of the given lengths in a random order, random gens, every third run
    seeded-sampled, joins at random steps, two random leavers (tests and
    benchmarks/gate_batch.py)."""
    rng = np.random.default_rng(seed)
    lengths = list(lengths)
    rng.shuffle(lengths)
    ps = [[int(i) for i in rng.integers(0, vocab, n)] for n in lengths]
    gens = [int(g) for g in rng.integers(3, 9, len(ps))]
    samplings = [Sampling(seed=int(rng.integers(1, 99)), temperature=0.8) if b % 3 == 1
                 else Sampling() for b in range(len(ps))]
    join_at = [0, 0] + [int(j) for j in rng.integers(1, 7, len(ps) - 2)]
    leavers = rng.choice(len(ps), 2, replace=False)
    leave_at = [int(rng.integers(join_at[b] + 2, join_at[b] + 5)) if b in leavers else None
                for b in range(len(ps))]
    return ps, gens, samplings, join_at, leave_at


def check_scenario(lm, label: str, scenario) -> None:
    """Every sequence's ids and first-step logits in the batch equal it run alone."""
    from k3engine.generate import JOIN_CHUNK
    ps, gens, samplings, join_at, leave_at = scenario
    want = [alone(lm, p, g, s) for p, g, s in zip(ps, gens, samplings)]
    got = together(lm, ps, gens, samplings, join_at=join_at, leave_at=leave_at)
    for b in range(len(ps)):
        w = want[b][0]
        n = len(got[b].ids)
        print(f"[gate] {label}, sequence {b}: prompt {len(ps[b])}, joins at step "
              f"{join_at[b]}, leaves {leave_at[b]}, "
              f"{'sampled' if samplings[b].seed else 'greedy'}, {got[b].steps} steps: "
              f"{got[b].ids} vs alone {w[:n]}", flush=True)
        assert got[b].ids == (w[:n] if leave_at[b] is not None else w), b
        if n:
            assert np.array_equal(got[b].first_logits.view(np.uint32),
                                  want[b][1].view(np.uint32)), b
        if join_at[b] > 0 and len(ps[b]) > JOIN_CHUNK and leave_at[b] is None:
            # alone it takes one step a token; joining running decodes, its prompt took
            # several chunk steps (until the others ended and the rest went in one pass)
            assert got[b].steps > len(w), "a long joining prompt is fed a chunk a step"


@pytest.mark.parametrize("where,threads", [("resident", 1), ("streamed", 1),
                                           ("resident", 2), ("streamed", 2)])
def test_random_joins_and_leaves_with_prompts_up_to_two_thousand(demo, where, threads):
    """Eight sequences, prompts of 1 to 2,000 positions, joining at random steps (a long
    prompt that joins running decodes is fed JOIN_CHUNK positions a step beside their
    rows), two leaving at random steps, greedy and seeded: every sequence's ids and
    first-step logits equal the same prompt run alone."""
    scenario = random_scenario({"resident": 1, "streamed": 2}[where] * 10 + threads, 4000)
    K.set_num_threads(threads)
    eng = _demo_engine(demo, where, max(scenario[1]))
    try:
        check_scenario(eng.lm, f"demo {where}, {threads} thread(s)", scenario)
    finally:
        eng.close()
        K.set_num_threads(1)
