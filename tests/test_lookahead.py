"""Lookahead expert reads (k3engine.lookahead, issue 48 item 3): exact by construction.

With and without lookahead, on the tiny model and the shipped demo, at a resident and a
streamed trunk, 1 and 2 threads, in a batch run, a pass of two sequences and a chat turn:
the greedy ids are equal, and the cache makes the same
decisions for the requests actually made -- every request's outcome (hit, or miss with the
slot it reserved and the key it evicted) and every publish, in order.  The counters add up
(useful <= predicted, useful + wasted = predicted, bytes = reads x expert bytes), a failed
lookahead read never fails the step, and a real failure is reported as without lookahead."""
from __future__ import annotations

import pytest

from engine_helpers import make_tiny_and_trunk
from k3engine import events as E
from k3engine import lookahead as LA
from k3engine.engine import GenSpec, load_spec_from, open_engine
from k3engine.generate import Turn
from k3engine.loading import load_model, read_config
from k3engine.model import greedy
from k3engine.tools.demo import ready_dir


@pytest.fixture(scope="module")
def tiny_both(tmp_path_factory):
    return make_tiny_and_trunk(tmp_path_factory.mktemp("la"))


@pytest.fixture(scope="module")
def tiny(tiny_both):
    return tiny_both[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The shipped demo (trained weights: a realistic guess) and its packed trunk."""
    d = ready_dir(cache=str(tmp_path_factory.mktemp("la") / "cache"))
    return d, f"{d}/trunk"


def _record(cache) -> list[tuple]:
    """Log the cache's decisions for the real requests: each hit (slot, first use after
    its read), each reservation (key, slot, evicted key) and each publish (key, slot)."""
    log: list[tuple] = []
    pol = cache.policy
    reserve, touch, publish = pol.reserve, pol.touch, pol.publish

    def rec_reserve(key):
        slot, old = reserve(key)
        log.append(("reserve", key, slot, old))
        return slot, old

    def rec_touch(slot, first=False):
        log.append(("hit", slot, first))
        return touch(slot, first)

    def rec_publish(key, slot):
        log.append(("publish", key, slot))
        return publish(key, slot)

    pol.reserve, pol.touch, pol.publish = rec_reserve, rec_touch, rec_publish
    return log


# tiny: 2 of 8 experts x 12 MoE layers, the demo 4 of 32 x 7: a few slots miss and evict
# at every layer of every step
CACHE_GB = {"tiny": 0.00008, "demo": 0.00013}   # 4 and 7 slots of 16 KB
PROMPT = list(range(40, 52))


def _run(model_dir, trunk, cache_gb, lookahead, threads, gen=6, monkeypatch=None):
    kw = dict(trunk_dir=trunk) if trunk else {}
    flags = [("--trunk-gb", 0.0)] if trunk else []
    eng = open_engine(load_spec_from(model_dir, flags + [("--cache-gb", cache_gb)],
                                     incremental=True, threads=threads, lookahead=lookahead,
                                     **kw), gen=gen)
    try:
        log = _record(eng.lm.experts)
        turn = Turn(eng.batch(PROMPT, GenSpec(gen=gen)))
        steps = [e.telemetry for e in turn if isinstance(e, E.StepDone)]
        return turn.summary, log, steps, eng.lm.experts.total, eng.lm.experts.expert_bytes, \
            eng.lookahead_keys()
    finally:
        eng.close()


def _check_counters(name, steps, total, expert_bytes):
    """useful <= predicted; useful + wasted = predicted; bytes = reads x expert bytes; the
    steps add up to the run; a useful read is a real read it served; recall in [0, 1]."""
    assert total.la_useful <= total.la_predicted
    assert total.la_useful + total.la_wasted == total.la_predicted
    assert total.la_bytes == total.la_predicted * expert_bytes
    assert total.la_wasted_bytes == total.la_wasted * expert_bytes
    assert total.la_bytes == total.la_useful * expert_bytes + total.la_wasted_bytes
    for k in ("predicted", "useful", "wasted", "bytes", "wasted_bytes"):
        assert sum(getattr(s, f"lookahead_{k}") for s in steps) == getattr(total, f"la_{k}"), k
    for s in steps:         # a real read: a serial miss, or a group's prefetch read (§4.7)
        assert s.lookahead_useful <= s.expert_misses + s.expert_prefetch_reads
        assert 0.0 <= s.lookahead_recall <= 1.0
    print(f"[gate] {name}: lookahead predicted {total.la_predicted}, useful "
          f"{total.la_useful}, wasted {total.la_wasted} ({total.la_wasted_bytes} of "
          f"{total.la_bytes} B), recall {total.la_recall:.3f}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_lookahead_changes_no_id_and_no_decision(which, streamed, threads, tiny_both, demo):
    model_dir, trunk = tiny_both if which == "tiny" else demo
    trunk = trunk if streamed else None
    off = _run(model_dir, trunk, CACHE_GB[which], False, threads)
    on = _run(model_dir, trunk, CACHE_GB[which], True, threads)
    name = f"{which} {'streamed' if streamed else 'resident'} trunk, {threads} thread(s)"
    print(f"[gate] {name}: ids off {off[0].ids} / on {on[0].ids}; cache decisions "
          f"{len(off[1])} / {len(on[1])} events, equal {off[1] == on[1]}; expert bytes "
          f"{off[3].bytes_read} / {on[3].bytes_read}")
    assert on[0].ids == off[0].ids
    assert on[1] == off[1]
    assert [(s.expert_hits, s.expert_misses, s.expert_evictions, s.expert_bytes)
            for s in on[2]] == [(s.expert_hits, s.expert_misses, s.expert_evictions,
                                 s.expert_bytes) for s in off[2]]
    assert off[3].la_predicted == 0 and off[5] == {}
    assert sum(1 for e in off[1] if e[0] == "reserve") > len(off[2]), "the cache must miss"
    _check_counters(name, on[2], on[3], on[4])
    assert on[3].la_useful > 0, "the guess served no miss at all"
    assert on[5]["lookahead_useful"] == on[3].la_useful
    assert on[0].figures()["lookahead_useful"] == on[3].la_useful


def test_lookahead_in_a_pass_of_several_sequences(demo):
    """forward_batch (decode_many, serve --parallel): the rows' guesses are read as one
    union; the logits and decisions are those without lookahead."""
    import numpy as np
    model_dir, _ = demo
    cfg, _ = read_config(model_dir)
    res = {}
    for on in (False, True):
        lm = load_model(model_dir, cfg, cache_bytes=int(CACHE_GB["demo"] * 1e9), lookahead=on)
        log = _record(lm.experts)
        a, b = lm.model.new_state(32), lm.model.new_state(32)
        outs = lm.model.forward_batch([([5, 6, 7], a), ([9, 10], b)])
        for _ in range(4):
            outs = lm.model.forward_batch([([greedy(outs[0])], a), ([greedy(outs[1])], b)])
        res[on] = ([o.copy() for o in outs], log, lm.experts.total)
        lm.experts.close()
    print(f"[gate] two sequences: last logits equal {all(np.array_equal(x, y) for x, y in zip(res[0][0], res[1][0]))}"
          f", decisions equal {res[0][1] == res[1][1]}, useful {res[1][2].la_useful} of "
          f"{res[1][2].la_predicted}")
    assert all(np.array_equal(x, y) for x, y in zip(res[False][0], res[True][0]))
    assert res[False][1] == res[True][1]
    assert res[True][2].la_useful > 0


def test_a_failed_lookahead_read_never_fails_the_step(demo):
    """Every lookahead read comes back short: each real miss reads again itself, the ids
    and decisions are unchanged, nothing was useful, everything started was wasted."""
    model_dir, trunk = demo
    cfg, _ = read_config(model_dir)
    res = {}
    for on in (False, True):
        lm = load_model(model_dir, cfg, cache_bytes=int(CACHE_GB["demo"] * 1e9))
        if on:
            LA.attach(lm.model, lm.experts, cfg, fail=lambda L, e: True)
        log = _record(lm.experts)
        st = lm.model.new_state(32)
        ids, x = [], PROMPT
        for _ in range(5):
            ids.append(greedy(lm.model.forward(x, st)))
            x = [ids[-1]]
        res[on] = (ids, log, lm.experts.total, lm.experts.drops)
        lm.experts.close()
    t = res[True][2]
    print(f"[gate] failed lookahead reads: ids {res[False][0]} / {res[True][0]}, drops "
          f"{res[True][3]}, predicted {t.la_predicted} useful {t.la_useful} wasted {t.la_wasted}")
    assert res[True][0] == res[False][0] and res[True][1] == res[False][1]
    assert res[True][3] == 0
    assert t.la_predicted > 0 and t.la_useful == 0 and t.la_wasted == t.la_predicted
    assert t.bytes_read == res[False][2].bytes_read


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_real_failure_is_reported_as_without_lookahead(tiny, monkeypatch, lookahead):
    """K3_FAIL_EXPERT makes the real reads of layer 2's experts short: a drop (exit 4's
    ExpertLoadError), no token emitted -- whether or not a lookahead read had the bytes."""
    monkeypatch.setenv("K3_FAIL_EXPERT", "2,*")
    eng = open_engine(load_spec_from(tiny, [("--cache-gb", "0.001")], incremental=True,
                                     lookahead=lookahead), gen=4)
    try:
        turn = Turn(eng.batch([96, 45, 40], GenSpec(gen=4)))
        list(turn)
        res = turn.summary
        print(f"[gate] lookahead {lookahead}: K3_FAIL_EXPERT=2,* -> {res.expert_drop}; "
              f"ids {res.ids}")
        assert res.expert_drop is not None and "layer 2" in res.expert_drop and res.ids == []
        assert eng.lm.experts.drops > 0
    finally:
        eng.close()


def test_switches_and_the_plan(tiny, monkeypatch):
    """LoadSpec.lookahead and K3_NOLOOKAHEAD=1 turn it off; the plan counts the side buffer
    (top-k expert slots) only when it runs."""
    flags = [("--cache-gb", "0.001")]
    sizes = {}
    for on, env in ((True, ""), (False, ""), (True, "1")):
        monkeypatch.setenv(LA.ENV, env)
        eng = open_engine(load_spec_from(tiny, flags, lookahead=on), gen=2)
        try:
            running = getattr(eng.lm.experts, "ahead", None) is not None
            sizes[(on, env)] = (running, eng.plan.buffer_bytes, eng.plan.lookahead_bytes)
            assert running == (on and env != "1")
            assert eng.plan.lookahead_bytes == (
                eng.lm.cfg.topk * eng.lm.experts.slot_bytes if running else 0)
        finally:
            eng.close()
    print(f"[gate] (asked, K3_NOLOOKAHEAD) -> (running, buffer bytes, lookahead bytes): {sizes}")
    assert sizes[(True, "")][1] - sizes[(False, "")][1] == sizes[(True, "")][2] > 0


def test_cli_reports_lookahead(tiny, tmp_path):
    """`k3 --events` step events and `--out` carry the counters; --no-lookahead zeroes them."""
    import json
    from test_cli import k3
    for flag in ([], ["--no-lookahead"]):
        out, ev = tmp_path / "o.json", tmp_path / "e.jsonl"
        p = k3(tiny, "--ids", "96,45,40", "--gen", "3", "--incremental", "--cache-gb", "0.001",
               "--out", str(out), "--events", str(ev), *flag)
        assert p.returncode == 0, p.stderr
        o = json.loads(out.read_text())
        steps = [json.loads(x) for x in ev.read_text().splitlines()
                 if json.loads(x)["ev"] == "step"]
        keys = ("lookahead_predicted", "lookahead_useful", "lookahead_wasted",
                "lookahead_bytes", "lookahead_wasted_bytes", "lookahead_recall")
        assert all(k in s for s in steps for k in keys)
        print(f"[cli] k3 {' '.join(flag) or '(lookahead on)'}: --out "
              f"{ {k: o.get(k) for k in keys} }; steps useful "
              f"{[s['lookahead_useful'] for s in steps]}")
        if flag:
            assert not any(k in o for k in keys)
            assert all(s["lookahead_predicted"] == 0 for s in steps)
        else:
            assert o["lookahead_predicted"] == sum(s["lookahead_predicted"] for s in steps) > 0
            assert "lookahead    :" in p.stdout


def test_a_chat_turn_with_and_without_lookahead(demo):
    """A chat turn (Conversation: render, the decode loop) on the shipped demo at a streamed
    budget: the ids, and the cache's decisions, are equal."""
    from k3engine.chat import History, Message
    from k3engine.conversation import Conversation
    model_dir, trunk = demo
    runs = {}
    for on in (False, True):
        eng = open_engine(load_spec_from(model_dir, [("--trunk-gb", 0.0), ("--cache-gb",
                                                                           CACHE_GB["demo"])],
                                         trunk_dir=trunk, tok_dir=model_dir, incremental=True,
                                         lookahead=on), gen=8)
        try:
            log = _record(eng.lm.experts)
            chat = Conversation(eng, History([Message("user", "Tell me about the river.")]))
            turn = Turn(chat.turn(GenSpec(gen=8)))
            list(turn)
            runs[on] = (turn.summary.ids, log, eng.lm.experts.total.la_useful)
        finally:
            eng.close()
    print(f"[gate] chat turn: ids off {runs[False][0]} / on {runs[True][0]}; decisions equal "
          f"{runs[False][1] == runs[True][1]}; useful lookahead reads {runs[True][2]}")
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    assert runs[True][2] > 0
