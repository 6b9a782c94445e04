"""The engine API (k3engine.engine): one LoadSpec builder for every front end, typed events,
the poisoned state after a failed or stopped pass, stops inside a prefill, the streaming
reply parser against parse_reply, and the layering (errors is a leaf, no import cycle)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_helpers import GOLDEN_SEED, make_tiny
from k3engine import events as E
from k3engine.errors import StateUnusable
from k3engine.memory import PRESETS
from k3engine.conversation import Conversation
from k3engine.engine import Cancel, GenSpec, Prompt, load_spec_from, open_engine
from k3engine.generate import Turn
from test_cli import GOLDEN, k3

ENGINE = Path(__file__).resolve().parents[1] / "engine" / "k3engine"
APP = Path(__file__).resolve().parents[1] / "app" / "k3studio"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("run") / "tiny", GOLDEN_SEED)


@pytest.fixture(scope="module")
def trunk(tiny, tmp_path_factory):
    from k3engine.trunk import pack_trunk
    d = tmp_path_factory.mktemp("run") / "trunk"
    pack_trunk(tiny, str(d))
    return str(d)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    d = tmp_path_factory.mktemp("run") / "demo"
    make_checkpoint(str(d), dims_config("demo"), seed=9)
    return str(d)


def collect(gen):
    """(events, the generator's return value: its TurnSummary)."""
    turn = Turn(gen)
    return list(turn), turn.summary


# ---- one request builder -------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PRESETS) + ["auto"])
def test_cli_flags_and_app_settings_build_the_same_specs(preset, tiny, trunk):
    """`k3 ... --chat --preset P` and the app's preset P give one LoadSpec and GenSpec."""
    from k3engine.cli import build_gen, build_load, parse_args
    from k3studio.runspec import RunSpec
    o = parse_args([tiny, "--chat", "--tok", tiny, "--trunk", trunk, "--preset", preset,
                    "--gen", "256", "--thinking-effort", "low", "--greedy"])
    cli, cli_gen = build_load(o), build_gen(o)
    spec = RunSpec(model_dir=tiny, trunk_dir=trunk, tok_dir=tiny, preset=preset,
                   gen=256, effort="low")
    app, app_gen = spec.load_spec(), spec.gen_spec()
    print(f"[gate] preset {preset}: cli budgets {cli.budgets} == app budgets {app.budgets}")
    assert cli.budgets == app.budgets
    for f in ("model_dir", "trunk_dir", "tok_dir", "trunk_ring", "incremental", "spec",
              "draft"):
        assert getattr(cli, f) == getattr(app, f), f
    for f in ("gen", "thinking", "effort", "spec", "stop_ids"):
        assert getattr(cli_gen, f) == getattr(app_gen, f), f
    assert cli_gen.sampling.sampler().greedy and app_gen.sampling.sampler().greedy


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plan_and_load_agree_for_every_preset(preset, tiny, trunk):
    """What open_engine planned is what it loaded: streamed tables under ultra, the
    planned pinned set and ring, the planned cache slots."""
    spec = load_spec_from(tiny, [("--preset", preset)], trunk_dir=trunk, tok_dir=None,
                          available_override=64 << 30)
    seen = []
    r = open_engine(spec, seen.append, prompt=Prompt(ids=(1, 2, 3)), gen=2)
    try:
        p, lm = r.plan, r.lm
        loaded = next(e for e in seen if isinstance(e, E.Loaded))
        print(f"[gate] preset {preset}: plan ultra={p.ultra} pinned={p.trunk_plan.pinned} "
              f"ring={p.trunk_plan.ring_slots} slots={p.expert_slots}; loaded "
              f"ultra={lm.ultra} pinned={loaded.pinned_layers} ring={loaded.ring_slots} "
              f"slots={loaded.expert_slots}")
        assert lm.ultra == p.ultra == PRESETS[preset].ultra
        assert (lm.table_stream is not None) == p.ultra
        assert loaded.pinned_layers == tuple(p.trunk_plan.pinned)
        all_pinned = len(p.trunk_plan.pinned) == r.nl      # nothing streams: no ring
        assert loaded.ring_slots == (0 if all_pinned else p.trunk_plan.ring_slots)
        assert loaded.expert_slots == p.expert_slots
    finally:
        r.close()


def test_app_worker_streams_the_tables_under_ultra(qtbot, demo, tmp_path):
    """The app's ultra preset loads streamed embedding/lm_head tables (the worker used to
    plan them streamed and keep them resident)."""
    from k3engine.trunk import pack_trunk
    from k3studio.runspec import RunSpec
    from k3studio.worker import EngineHost
    t = tmp_path / "trunk"
    pack_trunk(demo, str(t))
    host = EngineHost()
    try:
        spec = RunSpec(model_dir=demo, trunk_dir=str(t), tok_dir=demo, preset="ultra", gen=4)
        with qtbot.waitSignal(host.loaded, timeout=120000) as blocker:
            host.load(spec, available_override=64 << 30)
        info = blocker.args[0]
        print(f"[gate] app ultra: ultra={info['ultra']} streamed tables "
              f"{info['streamed_tables']}")
        assert info["ultra"] and info["streamed_tables"]
    finally:
        host.shutdown()


# ---- events and figures ------------------------------------------------------------------

def test_generate_yields_typed_events_with_the_golden_ids(tiny):
    seen = []
    r = open_engine(load_spec_from(tiny, incremental=True), seen.append,
                    prompt=Prompt(ids=tuple(GOLDEN["prompt_ids"])), gen=6)
    kinds = [type(e).__name__ for e in seen]          # the set-up, in the reference's order
    try:
        evs, res = collect(r.batch(r.prompt_ids, GenSpec(gen=6)))
    finally:
        r.close()
    assert kinds[:2] == ["ThreadsSet", "ConfigRead"] and "Planned" in kinds and \
        kinds[-1] == "Loaded"
    progress = [e for e in seen[len(kinds):] if isinstance(e, E.LoadProgress)]
    assert [e.layer for e in progress] == list(range(r.nl))    # the prompt pass, per layer
    steps = [e for e in evs if isinstance(e, E.StepDone)]
    tokens = [e.id for e in evs if isinstance(e, E.TokenOut)]
    print(f"[gate] engine API ids {tokens} vs golden {GOLDEN['generated_ids'][:6]}")
    assert tokens == res.ids == GOLDEN["generated_ids"][:6]
    assert [s.step for s in steps] == list(range(6))
    assert steps[0].telemetry.expert_requests > 0 and steps[0].logits is not None


@pytest.mark.parametrize("trunk_gb", [None, 0.0])
def test_overlapped_expert_reads_change_no_id_and_no_counter(demo, trunk_gb, monkeypatch,
                                                             tmp_path):
    """K3_NO_EXPERT_PIPELINE=1 lands a group's reads before serving any (§4.4's whole-batch
    barrier); the default computes each expert as its read lands.  A cache of a third of
    the demo's experts (misses and evictions every step): the ids and every per-step cache
    counter are identical."""
    from k3engine.trunk import pack_trunk
    kw = {}
    if trunk_gb is not None:
        pack_trunk(demo, str(tmp_path / "t"))
        kw = dict(trunk_dir=str(tmp_path / "t"))
    flags = [("--trunk-gb", trunk_gb or 0.0), ("--cache-gb", 0.0012)]
    runs = {}
    for overlap in ("0", "1"):
        monkeypatch.setenv("K3_NO_EXPERT_PIPELINE", "1" if overlap == "0" else "0")
        r = open_engine(load_spec_from(demo, flags, incremental=True, **kw), gen=6)
        try:
            evs, res = collect(r.batch(list(range(40, 56)), GenSpec(gen=6)))
        finally:
            r.close()
        runs[overlap] = (res.ids, [
            tuple(getattr(e.telemetry, k) for k in (
                "expert_requests", "expert_hits", "expert_misses", "expert_evictions",
                "expert_prefetch_reads", "expert_bytes", "trunk_bytes"))
            for e in evs if isinstance(e, E.StepDone)])
    print(f"[gate] overlap off/on: ids {runs['0'][0]} / {runs['1'][0]}; per-step (requests, "
          f"hits, misses, evictions, prefetch reads, expert bytes, trunk bytes) "
          f"{runs['0'][1]} / {runs['1'][1]}")
    assert runs["0"] == runs["1"]
    assert sum(c[2] + c[4] for c in runs["1"][1]) > 0        # it did read experts


# ---- poisoned state (SYSTEM §4.9) -------------------------------------------------------

def test_failed_pass_poisons_the_state_and_nothing_reuses_it(tiny, monkeypatch):
    monkeypatch.setenv("K3_FAIL_EXPERT", "2,*")
    r = open_engine(load_spec_from(tiny, [("--cache-gb", "0.001")], incremental=True), gen=4)
    try:
        seq = r.sequence()
        evs, res = collect(r.batch([96, 45, 40], GenSpec(gen=4), seq=seq))
        assert res.expert_drop is not None and res.ids == []
        assert seq.poisoned, "a pass that failed part-way must mark the state"
        print(f"[gate] poisoned: {seq.poisoned}")
        with pytest.raises(StateUnusable):
            seq.save(os.devnull)
        with pytest.raises(StateUnusable):
            r.lm.model.forward([1], seq.state)
        assert seq.prepare([96, 45, 40, 7], 4) == 0, "a poisoned state is never reused"
    finally:
        r.close()


def test_cli_writes_no_state_after_exit_4_and_resume_refuses(tiny, tmp_path):
    st = tmp_path / "s.k3st"
    p = k3(tiny, "--ids", "96", "--gen", "8", "--incremental", "--save-state", st,
           "--out", tmp_path / "o.json", env={"K3_FAIL_EXPERT": "2,5"})
    print(f"[gate] K3_FAIL_EXPERT=2,5: exit {p.returncode}, state file written {st.exists()}")
    assert p.returncode == 4 and not st.exists()
    assert "not written" in p.stderr and "Traceback" not in p.stderr


def test_chat_turn_after_a_failed_pass_starts_afresh(demo, monkeypatch):
    """A chat whose turn failed part-way never reuses that state: the next turn prefills
    from scratch and gives the ids a fresh session gives."""
    from k3engine.chat import History, Message
    monkeypatch.setenv("K3_FAIL_EXPERT", "2,*")
    r = open_engine(load_spec_from(demo, [("--cache-gb", "0.05")], tok_dir=demo,
                                   incremental=True), gen=3)
    spec = GenSpec(gen=3)
    try:
        chat = Conversation(r, History([Message("user", "Hello")]))
        from k3engine.experts import ExpertLoadError
        with pytest.raises(ExpertLoadError):
            collect(chat.turn(spec))
        assert chat.seq.state is None and chat.seq.ids == []
        r.lm.experts._fail_reads = None
        _, res = collect(chat.turn(spec))
        fresh = Conversation(r, History([Message("user", "Hello")]))
        _, want = collect(fresh.turn(spec))
    finally:
        r.close()
    print(f"[gate] after a failure: {res.ids} (reused {res.reused}) vs fresh {want.ids}")
    assert res.reused == 0 and res.ids == want.ids


# ---- stop inside a prefill ---------------------------------------------------------------

def test_stop_inside_a_long_streamed_prefill(demo, tmp_path):
    """A stop asked during a 300-position prefill on a streamed budget is honoured at the
    next layer boundary; the turn emits nothing, and the next turn is exact."""
    from k3engine.chat import History, Message
    from k3engine.trunk import pack_trunk
    t = tmp_path / "trunk"
    pack_trunk(demo, str(t))
    ls = load_spec_from(demo, [("--trunk-gb", "0"), ("--cache-gb", "0.02")], trunk_dir=str(t),
                        tok_dir=demo, incremental=True)
    spec = GenSpec(gen=2)
    layers = []
    cancel = Cancel()

    def sink(ev):
        if isinstance(ev, E.LoadProgress) and ev.phase == "prefill":
            layers.append(ev.layer)
            if ev.layer == 2:
                cancel.set()                 # asked while layer 3 is about to run
    r = open_engine(ls, sink, gen=2)
    try:
        text = " ".join(f"word{i}" for i in range(150))
        chat = Conversation(r, History([Message("user", text)]))
        _, res = collect(chat.turn(spec, cancel))
        assert res.interrupted and res.ids == [] and res.prompt_positions >= 256
        stopped_after = max(layers)
        layers.clear()
        _, again = collect(chat.turn(spec))
        fresh = Conversation(r, History([Message("user", text)]))
        _, want = collect(fresh.turn(spec))
    finally:
        r.close()
    print(f"[gate] stop in a {res.prompt_positions}-position prefill: honoured after layer "
          f"{stopped_after + 1} of {r.nl}; next turn {again.ids} vs fresh {want.ids}")
    assert stopped_after == 2
    assert again.ids == want.ids and again.reused == 0


# ---- the streaming reply parser ----------------------------------------------------------

def test_reply_stream_equals_parse_reply(demo):
    from k3engine.chat import ReplyStream, parse_reply
    from k3engine.engine import chat_controls
    from k3engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(demo)
    ctl = chat_controls(tok)
    rng = np.random.default_rng(5)
    words = ["hello", " wörld", " 🙂", " think", " response", " message", "\n", " ë", " 42"]

    def enc(s):
        return list(tok.encode(s, False))
    closure = [ctl.close, *enc("response"), ctl.sep, ctl.close, *enc("message"), ctl.sep]
    boundary = [ctl.close, *enc("think"), ctl.sep, ctl.open, *enc("response"), ctl.sep]
    n = 0
    for case in range(200):
        thinking = bool(case % 2)
        reasoning = "".join(rng.choice(words, rng.integers(0, 6)))
        content = "".join(rng.choice(words, rng.integers(1, 6)))
        ids = (enc(reasoning) + boundary if thinking else []) + enc(content) + closure + \
            [ctl.end_ids[case % 2]]
        want = parse_reply(tok, ctl, ids, thinking)
        s = ReplyStream(tok, ctl, thinking)
        got = {"thinking": "", "response": "", "control": ""}
        for i in ids:
            phase, text = s.push(i)
            got[phase] += text
        got[s.phase] += s.flush()
        assert (got["thinking"] if thinking else None) == want[0] or \
            (not thinking and want[0] is None)
        assert got["response"] == want[1], (case, got, want)
        assert got["control"] == ""
        n += 1
    print(f"[gate] ReplyStream == parse_reply on {n} generated turns")


# ---- the heat histogram is O(layers x experts) ----------------------------------------------

def test_request_trace_counts_without_keeping_pairs():
    from k3engine.experts import RequestTrace
    t = RequestTrace(3, 4, keep_pairs=False)
    for L, e in [(0, 1), (2, 3), (0, 1), (1, 0)]:
        t.record(L, e)
    assert t.histogram() == {(0, 1): 2, (1, 0): 1, (2, 3): 1}
    assert t.requests == 4 and len(t.pairs) == 0
    assert t.counts_grid()[0, 1] == 2
    with pytest.raises(RuntimeError):
        t.dump("/tmp")


# ---- SIGINT before loading ---------------------------------------------------------------

def test_sigint_during_load_is_kept_even_if_inherited_ignored(demo, tmp_path):
    """A process started with SIGINT ignored still gets our handler before loading, so a
    Ctrl-C during the load ends the run with exit 5 after it (not lost)."""
    import signal
    code = ("import signal, sys, os, threading\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "import k3engine.engine as R\n"
            "real = R.load_model\n"
            "def slow(*a, **k):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(*a, **k)\n"
            "R.load_model = slow\n"
            "from k3engine.cli import main\n"
            f"sys.exit(main([{demo!r}, '--ids', '1,2,3', '--gen', '4', '--incremental',"
            f" '--out', {str(tmp_path / 'o.json')!r}]))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                     signal.SIG_IGN))
    print(f"[gate] SIGINT during load with SIG_IGN inherited: exit {p.returncode}")
    assert p.returncode == 5, p.stderr[-800:]
    assert "interrupt: the step in flight will complete" in p.stderr


# ---- layering ------------------------------------------------------------------------------

def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                out.add(mod.split(".")[0] if mod else "")
                out.update(a.name for a in node.names if not mod)
            elif mod.startswith("k3engine"):
                parts = mod.split(".")
                out.add(parts[1] if len(parts) > 1 else "")
                if len(parts) == 1:
                    out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("k3engine."):
                    out.add(a.name.split(".")[1])
    return out - {""}


def test_layering():
    """errors is a leaf; the REPL does not import the CLI; the app's worker talks to the
    engine and the conversation, not to the cache's or the trunk's modules."""
    assert _imports(ENGINE / "errors.py") == set()
    assert "cli" not in _imports(ENGINE / "chat_repl.py")
    worker = _imports(APP / "worker.py")
    print(f"[gate] worker imports from k3engine: {sorted(worker)}")
    assert not worker & {"experts", "trunk", "loading", "sequence", "bind", "checkpoint",
                         "model"}
    for front in ("cli.py", "chat_repl.py"):
        assert not _imports(ENGINE / front) & {"trunk", "bind", "checkpoint"}, front


def test_exit_codes_live_only_in_errors():
    import re
    pat = re.compile(r"^\s*EXIT_\w+\s*(,\s*EXIT_\w+\s*)*=", re.M)
    offenders = [str(p) for p in list(ENGINE.rglob("*.py")) + list(APP.rglob("*.py"))
                 if p.name != "errors.py" and pat.search(p.read_text())]
    assert offenders == []


def test_a_forked_sequence_goes_its_own_way(tiny):
    """Sequence.fork: a copy of the state and ids; the original and the copy continue with
    different ids, each equal to that prompt run from scratch, and neither disturbs the
    other."""
    r = open_engine(load_spec_from(tiny, incremental=True), gen=4)
    try:
        base = r.sequence()
        collect(r.batch([5, 17, 99, 123, 7], GenSpec(gen=1), seq=base))
        copy = base.fork()
        a = collect(r.batch([40, 41], GenSpec(gen=4), seq=base))[1].ids
        b = collect(r.batch([90], GenSpec(gen=4), seq=copy))[1].ids
        want_a = collect(r.batch(base.ids[:len(base.ids) - 4], GenSpec(gen=4)))[1].ids
        want_b = collect(r.batch(copy.ids[:len(copy.ids) - 4], GenSpec(gen=4)))[1].ids
    finally:
        r.close()
    print(f"[gate] fork: original {a} vs from scratch {want_a}; copy {b} vs {want_b}")
    assert a == want_a and b == want_b and a != b
