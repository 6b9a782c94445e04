"""The engine's shape: the import graph has no cycle; speculative decoding (n-gram and the
draft model) works in chat turns and in server requests with the ids of plain greedy and
its counts in the turn summary; one turn's figures are the same in the app's stats, the
REPL's report and the server's usage; a per-turn option (min-p) is one GenSpec field."""
from __future__ import annotations

import ast
import io
import os
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from k3engine.chat import History, Message
from k3engine.conversation import Conversation
from k3engine.engine import GenSpec, Sampling, load_spec_from, open_engine
from k3engine.events import TurnEnded

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"k3engine": ROOT / "engine" / "k3engine", "k3studio": ROOT / "app" / "k3studio"}


# ---- the import graph --------------------------------------------------------------------

def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, root in PACKAGES.items():
        for p in root.rglob("*.py"):
            rel = p.relative_to(root).with_suffix("")
            parts = [pkg] + [x for x in rel.parts if x != "__init__"]
            mods[".".join(parts)] = p
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, at the top or inside a function (a lazy
    import is an edge too: deferring one does not remove the dependency)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        base = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                stem = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]) \
                    if node.level else node.module or ""
                stem = stem.rstrip(".")
                names = [stem] + [f"{stem}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    g = import_graph()
    found = cycles(g)
    print(f"[gate] import graph: {len(g)} modules, {sum(map(len, g.values()))} edges "
          f"(lazy imports included), cycles: {found}")
    assert found == []


def test_cycle_detector_finds_a_cycle():
    """The detector itself fails on the kind of cycle this project had (trunk_compress ->
    forecast -> run -> session -> trunk -> trunk_compress)."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]


FRONT_ENDS = [PACKAGES["k3engine"] / f for f in ("cli.py", "chat_repl.py")] + \
    sorted((PACKAGES["k3engine"] / "server").glob("*.py")) + \
    sorted(PACKAGES["k3studio"].glob("*.py"))
# what only the engine does: load a model or build a sequence (opening a checkpoint's index
# to check it, loading.open_model, is the Setup tab's inspection, not a load), touch a
# sequence's or the cache's internals, re-check the engine's limits, sum a turn's bytes
ENGINE_ONLY = {
    "constructs engine objects": r"(?<!def )(?<!self\.)\bload_model\(|\b(ChatSession|"
                                 r"Sequence|Model|SequenceState|ExpertCache)\(|new_state\(",
    "edits sequence state": r"\.(n_cached|forks|poisoned|turns_done)\b|\bseq\.state\b|"
                            r"\.forward\(",
    "re-checks limits": r"\b(kv_check|MAX_POSITIONS)\b",
    "derives turn figures": r"trunk_bytes \+|expert_bytes \+|\.experts\.step\b",
}


def test_front_ends_leave_the_engine_its_work():
    """The counts the engine-shape issue asked to fall to zero, per front-end file."""
    found = {}
    for what, pat in ENGINE_ONLY.items():
        hits = [f"{p.relative_to(ROOT)}:{n}" for p in FRONT_ENDS
                for n, line in enumerate(p.read_text().splitlines(), 1)
                if re.search(pat, line) and not line.lstrip().startswith("#")]
        found[what] = hits
    print("[gate] front ends that " + "; ".join(f"{k}: {len(v)}" for k, v in found.items()))
    assert all(not v for v in found.values()), found


# ---- speculative decoding in chat and in the server ---------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The random demo dims (a chat-capable vocabulary) with an exact and a draft trunk."""
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    from k3engine.trunk import pack_trunk
    d = tmp_path_factory.mktemp("shape") / "demo"
    make_checkpoint(str(d), dims_config("demo"), seed=9)
    pack_trunk(str(d), str(d / "trunk"))
    pack_trunk(str(d), str(d / "draft"), draft_bits=8)
    return str(d)


def _engine(demo, spec=0, draft=False):
    from k3engine.engine import Draft
    return open_engine(load_spec_from(
        demo, [("--trunk-gb", 0.0), ("--cache-gb", 0.02)], tok_dir=demo,
        trunk_dir=os.path.join(demo, "trunk"), incremental=True, spec=spec,
        draft=Draft(os.path.join(demo, "draft"), trunk_gb=0.0) if draft else None), gen=24)


def _two_turns(eng, spec: GenSpec):
    """A two-turn chat (the reply of turn 1 closed by hand: the random demo never closes)."""
    conv = Conversation(eng, History([Message("user", "Tell me about the moon")]))
    out = []
    for follow in ("And the sun?", None):
        res = None
        for ev in conv.turn(spec):
            if isinstance(ev, TurnEnded):
                res = ev.result
        out.append(res)
        if follow:
            conv.commit_pending()
            conv.add_user(follow)
    return out


@pytest.mark.parametrize("draft", [False, True], ids=["ngram", "draft-model"])
def test_speculation_in_a_chat_turn_gives_the_greedy_ids(demo, draft):
    plain_eng = _engine(demo)
    try:
        plain = _two_turns(plain_eng, GenSpec(gen=24, thinking=False))
    finally:
        plain_eng.close()
    eng = _engine(demo, spec=4, draft=draft)
    try:
        spec = _two_turns(eng, GenSpec(gen=24, thinking=False, spec=4))
    finally:
        eng.close()
    for n, (a, b) in enumerate(zip(plain, spec), 1):
        print(f"[gate] chat turn {n} ({'draft model' if draft else 'n-gram'}): {len(b.ids)} "
              f"ids equal plain greedy: {a.ids == b.ids}; {b.spec.rounds} sweeps, "
              f"{b.spec.drafted} drafted, {b.spec.accepted} accepted; {b.steps} steps vs "
              f"{a.steps}; reused {b.reused} vs {a.reused}")
        assert a.ids == b.ids and a.reused == b.reused
        assert a.spec.rounds == 0
    assert sum(r.spec.rounds for r in spec) > 0            # it did verify drafts
    figs = spec[-1].figures()
    assert figs["spec_drafted"] == spec[-1].spec.drafted
    assert figs["spec_accepted"] == spec[-1].spec.accepted


def _serve_one(eng, spec_width: int, history):
    from k3engine.server.engine import Backend, Done, Job
    from k3engine.server.protocol import GenRequest, Limits, SamplingIn
    posted = []
    req = GenRequest(kind="chat", model="demo", gen=24,
                     sampling=SamplingIn(None, None, None, None, True), stops=(),
                     stream=False, include_usage=True, history=history, thinking=False)
    Backend(eng, "demo", Limits(), spec=spec_width).execute(Job(req, posted.append))
    return next(p for p in posted if isinstance(p, Done))


def test_speculation_in_a_server_request_gives_the_greedy_ids(demo):
    h = History([Message("user", "Count to ten")])
    eng = _engine(demo, spec=4, draft=True)
    try:
        plain = _serve_one(eng, 0, History(list(h)))
        spec = _serve_one(eng, 4, History(list(h)))
    finally:
        eng.close()
    print(f"[gate] server request, --spec 4 with the draft model: ids equal plain greedy "
          f"{plain.ext['ids'] == spec.ext['ids']} ({len(spec.ext['ids'])} ids); usage.k3 "
          f"spec_drafted {spec.ext['spec_drafted']}, spec_accepted {spec.ext['spec_accepted']}")
    assert plain.ext["ids"] == spec.ext["ids"] and plain.ext["spec_drafted"] == 0
    assert spec.ext["spec_drafted"] > 0


# ---- one turn's figures, the same in every front end ------------------------------------------

def test_one_turn_shows_the_same_figures_in_the_app_the_repl_and_the_server(demo):
    """The app's stats (worker.turn_info), the REPL's report line and the server's usage
    extension of one real turn, compared figure by figure."""
    from k3engine.chat_repl import _live_end
    from k3engine.server.engine import usage_ext
    from k3studio.runspec import RunSpec
    from k3studio.worker import turn_info
    eng = _engine(demo)
    try:
        res = _two_turns(eng, GenSpec(gen=6))[-1]     # thinking: a fork point to reuse
        app = turn_info(res, RunSpec(model_dir=demo, gen=6), eng)
    finally:
        eng.close()
    server = usage_ext(res)
    buf = io.StringIO()
    with redirect_stdout(buf):
        _live_end(res, 6, None)
    repl = buf.getvalue()
    print(f"[gate] one turn: app {app['n']} tokens, ttft {app['first_token_seconds']:.4f} s, "
          f"{app['tokens_per_s']:.3f} tok/s, read {app['read_bytes']} B, reused "
          f"{app['reused']}; server {server['tokens']} / {server['ttft_s']:.4f} / "
          f"{server['decode_tokens_per_s']:.3f} / {server['bytes_read']} / "
          f"{server['reused_positions']}; REPL {repl.strip()!r}")
    assert app["n"] == server["tokens"] == res.new_ids
    assert round(app["first_token_seconds"], 6) == server["ttft_s"]
    assert round(app["tokens_per_s"], 6) == server["decode_tokens_per_s"]
    assert app["read_bytes"] == server["bytes_read"] == res.bytes_read > 0
    assert app["peak_rss_bytes"] == server["peak_rss_bytes"] == res.peak_rss_bytes > 0
    assert app["reused"] == server["reused_positions"] == res.reused > 0
    assert f"[{res.new_ids} tokens, first after {res.first_token_seconds:.1f} s" in repl
    assert f"{res.decode_tokens_per_s:.2f} tokens/s" in repl
    assert f"{res.reused} of {res.prompt_positions} prompt positions reused" in repl


# ---- a per-turn option: min-p ---------------------------------------------------------------

def test_min_p_is_one_gen_spec_field_from_the_cli_to_the_sampler(demo):
    """--min-p P reaches the sampler through GenSpec alone; P near 1 keeps only the most
    likely id, so a sampled turn equals greedy; 0 (off) leaves the reference's stream."""
    from k3engine.cli import build_gen, parse_args
    o = parse_args([demo, "--chat", "--tok", demo, "--seed", "3", "--min-p", "0.999"])
    spec = build_gen(o).with_(gen=8, thinking=False)
    assert spec.sampling.min_p == 0.999 and spec.sampling.sampler().sampling
    eng = _engine(demo)
    try:
        def reply(s):
            res = None
            for ev in Conversation(eng, History([Message("user", "Hi")])).turn(s):
                if isinstance(ev, TurnEnded):
                    res = ev.result
            return res.ids
        greedy = reply(GenSpec(gen=8, thinking=False))
        narrow = reply(spec)
        wide = reply(spec.with_(sampling=Sampling(seed=3, temperature=5.0)))
    finally:
        eng.close()
    print(f"[gate] min-p 0.999 sampled {narrow} == greedy {greedy}; temperature 5 without "
          f"min-p {wide}")
    assert narrow == greedy and wide != greedy


def test_server_adapter_posts_progress_reuse_and_the_stop_that_matched(demo):
    """What the routes need from the adapter: prefill Progress between the prompt pass's
    layers (positions, rising to the prompt), the reused positions on Started, and which
    of several stop strings ended the answer."""
    from k3engine.server.engine import Backend, Done, Job, Progress, Started
    from k3engine.server.protocol import GenRequest, Limits, SamplingIn
    eng = _engine(demo)
    try:
        backend = Backend(eng, "demo", Limits())

        def ask(history, stops=()):
            posted = []
            req = GenRequest(kind="chat", model="demo", gen=12,
                             sampling=SamplingIn(None, None, None, None, True), stops=stops,
                             stream=True, include_usage=True, history=history,
                             thinking=False)
            backend.execute(Job(req, posted.append))
            return posted
        h = History([Message("system", "Be brief."), Message("user", "Tell me about the moon")])
        first = ask(History(list(h)))
        text = "".join(p.text for p in first if hasattr(p, "text") and p.kind == "content")
        started = next(p for p in first if isinstance(p, Started))
        progress = [(p.done, p.total) for p in first if isinstance(p, Progress)]
        # the same transcript again: everything before its last message is reused
        again = next(p for p in ask(History(list(h))) if isinstance(p, Started))
        word = text.split()[1] if len(text.split()) > 1 else None
        done = next(p for p in ask(History(list(h)), stops=("zzzz", word)) if
                    isinstance(p, Done)) if word else None
    finally:
        eng.close()
    print(f"[gate] adapter: progress {progress}; Started reused {started.reused} then "
          f"{again.reused} of {again.prompt_ids}; stop strings ('zzzz', {word!r}) -> "
          f"ext stop {done.ext.get('stop') if done else None!r}")
    assert started.reused == 0 and progress and progress[-1] == (started.prompt_ids,) * 2
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)
    assert len(progress) >= eng.nl                      # per layer (of each pass)
    assert 0 < again.reused < again.prompt_ids
    if done is not None:
        assert done.finish == "stop" and done.ext["stop"] == word


def test_speculation_that_runs_past_an_end_id_keeps_the_next_turn_s_reuse():
    """On the trained demo (its replies close): a sweep whose accepted drafts reach the end
    id stops there, so the state holds exactly the reply and the next turn reuses it as
    plain decoding does (it used to run past the end id and reuse nothing)."""
    from k3engine.tools.demo import shipped_dir
    model = shipped_dir()
    runs = {}
    for width in (0, 4):
        eng = open_engine(load_spec_from(model, tok_dir=model, incremental=True, spec=width),
                          gen=64)
        try:
            conv = Conversation(eng, History([Message("user", "Hello!")]))
            out = []
            for follow in ("What is 3 plus 4?", None):
                res = None
                for ev in conv.turn(GenSpec(gen=64, thinking=False, spec=width)):
                    if isinstance(ev, TurnEnded):
                        res = ev.result
                out.append(res)
                if follow:
                    conv.add_user(follow)
        finally:
            eng.close()
        runs[width] = out
    (p1, p2), (s1, s2) = runs[0], runs[4]
    print(f"[gate] trained demo, --spec 4: turn 2 reused {s2.reused} vs plain {p2.reused}; "
          f"ids equal {[s1.ids, s2.ids] == [p1.ids, p2.ids]}; sweeps {s1.spec.rounds + s2.spec.rounds}")
    assert p1.end_id is not None and p2.reused > 0
    assert [s1.ids, s2.ids] == [p1.ids, p2.ids] and s2.reused == p2.reused
