"""The block drafter (--draft-model, drafter.py, docs/drafter.md): its forward against an
independent float64 transcription of the format; features from one pass equal features
fed position by position; greedy ids with a drafter equal plain greedy on the tiny model
and the demo at a resident and a streamed budget, 1 and 2 threads, through a plain run, a
chat turn and a server request; a sampled turn decodes as without it; hostile drafter
folders are refused naming the file; the plan counts it.

The drafters here have random weights (drafter_helpers.make_drafter): they are accepted
rarely, so one test forces its proposals to be the target's own continuation (with a
wrong token where chosen) to exercise the kept rows of accepted drafts."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from drafter_helpers import drafter_config, make_drafter
from engine_helpers import GOLDEN_SEED, golden_prompt, load, make_tiny, with_threads
from k3engine.checkpoint import CheckpointError
from k3engine.config import ConfigError
from k3engine.drafter import BlockDrafter, load_drafter, open_drafter, rope_tables
from k3engine.engine import Engine
from k3engine.errors import describe
from k3engine.generate import GenSpec, Sampling, Turn


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load(make_tiny(tmp_path_factory.mktemp("drafter") / "tiny", GOLDEN_SEED))


@pytest.fixture(scope="module")
def tiny(lm):
    return lm.ck.model_dir


@pytest.fixture(scope="module")
def tiny_drafter(tiny, lm, tmp_path_factory):
    return make_drafter(tmp_path_factory.mktemp("drafter") / "d", lm.cfg, [1, 5, 12],
                        inter=96, block=5, seed=3)


def _drafter(folder, lm) -> BlockDrafter:
    return load_drafter(open_drafter(str(folder), lm.cfg), lm.model.weights.tables)


def _run(lm, prompt, gen, width=0, drafter=None, sampling=Sampling()):
    turn = Turn(Engine.around(lm, spec=width, drafter=drafter).batch(
        list(prompt), GenSpec(gen=gen, spec=width, sampling=sampling)))
    for _ in turn:
        pass
    return turn.summary


# ---- the computation against an independent float64 transcription -------------------------

def _widen(a: np.ndarray) -> np.ndarray:
    """A stored matrix as float64 (BF16 bit patterns widened by hand)."""
    if a.dtype == np.uint16:
        a = (a.astype(np.uint32) << 16).view(np.float32)
    assert a.dtype == np.float32, a.dtype
    return a.astype(np.float64)


def _reference_logits(folder, tables, feats: np.ndarray, anchor: int, mask: int) -> np.ndarray:
    """docs/drafter.md transcribed in float64 from the files themselves: context of the
    positions 0..s-1 from their features [s, n_feat*E], the block at s..s+B-1."""
    from k3engine.checkpoint import Checkpoint
    cfg = json.load(open(os.path.join(folder, "config.json")))
    E, nl, H, Hkv, D = (cfg[k] for k in ("hidden_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads",
                                         "head_dim"))
    B, eps, theta = cfg["block_size"], cfg["rms_norm_eps"], cfg["rope_theta"]
    with Checkpoint(folder) as ck:
        w = {n: ck.read_f32(n).astype(np.float64) for n in ck.names()}

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def rope(x, pos):                                   # x [T, n, D]
        inv = theta ** (-np.arange(0, D, 2) / D)
        ang = np.asarray(pos, np.float64)[:, None] * inv[None]
        cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))
        rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    s = feats.shape[0]
    c = rms(feats.astype(np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"])
    emb = _widen(tables.embed)
    x = emb[[anchor] + [mask] * (B - 1)]
    bpos = np.arange(s, s + B)
    for i in range(nl):
        p = f"layers.{i}."
        W = {k[len(p):]: v for k, v in w.items() if k.startswith(p)}
        heads = lambda y, n, g: rms(y.reshape(len(y), n, D), g)   # noqa: E731
        kc = rope(heads(c @ W["self_attn.k_proj.weight"].T, Hkv, W["self_attn.k_norm.weight"]),
                  np.arange(s))
        vc = (c @ W["self_attn.v_proj.weight"].T).reshape(s, Hkv, D)
        h = rms(x, W["input_layernorm.weight"])
        q = rope(heads(h @ W["self_attn.q_proj.weight"].T, H, W["self_attn.q_norm.weight"]), bpos)
        kb = rope(heads(h @ W["self_attn.k_proj.weight"].T, Hkv, W["self_attn.k_norm.weight"]),
                  bpos)
        vb = (h @ W["self_attn.v_proj.weight"].T).reshape(B, Hkv, D)
        Kall, Vall = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        out = np.empty((B, H, D))
        for j in range(H):                               # no mask: all of the context + block
            kv = j // (H // Hkv)
            sc = q[:, j] @ Kall[:, kv].T / np.sqrt(D)
            pr = np.exp(sc - sc.max(1, keepdims=True))
            out[:, j] = (pr / pr.sum(1, keepdims=True)) @ Vall[:, kv]
        x = x + out.reshape(B, H * D) @ W["self_attn.o_proj.weight"].T
        g = rms(x, W["post_attention_layernorm.weight"])
        gt, up = g @ W["mlp.gate_proj.weight"].T, g @ W["mlp.up_proj.weight"].T
        x = x + (gt / (1 + np.exp(-gt)) * up) @ W["mlp.down_proj.weight"].T
    return rms(x[1:], w["norm.weight"]) @ _widen(tables.lm_head).T


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_drafter_forward_equals_a_float64_transcription_of_the_format(lm, tmp_path, dtype):
    folder = make_drafter(tmp_path / dtype, lm.cfg, [1, 5, 12], inter=96, block=5, seed=4,
                          dtype=dtype)
    dr = _drafter(folder, lm)
    m = lm.model
    ids = golden_prompt(lm.cfg.vocab)
    cap = dr.capture()
    m.forward(ids, m.new_state(len(ids)), capture=cap)
    dr.take(ids, 0, ids, cap)
    feats = np.concatenate([cap[L] for L in (1, 5, 12)], axis=1)
    got = dr.block_logits(ids[-1], len(ids))
    want = _reference_logits(folder, lm.model.weights.tables, feats, ids[-1], lm.cfg.vocab - 1)
    err = np.abs(got - want).max() / np.abs(want).max()
    drafts, want_drafts = dr.block(ids[-1], len(ids)), [int(np.argmax(r)) for r in want]
    print(f"[gate] drafter forward ({dtype} weights) vs float64 transcription: {got.shape} "
          f"logits, worst error {err:.2e} of the largest; drafts {drafts} vs {want_drafts}")
    assert got.shape == (4, lm.cfg.vocab) and err < 1e-5
    assert drafts == want_drafts
    assert dr.block(ids[-1], len(ids), 2) == drafts[:2]       # fewer: the first ones


def test_rope_tables_are_the_rotate_half_convention():
    cos, sin = rope_tables(np.array([0, 3]), 8, 10000.0)
    want = 3 * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    print(f"[gate] rope angles at position 3: {np.arccos(cos[1, :4])} vs {want}")
    assert np.allclose(cos[1], np.cos(np.concatenate([want, want])), atol=1e-6)
    assert np.allclose(sin[1], np.sin(np.concatenate([want, want])), atol=1e-6)
    assert np.array_equal(cos[0], np.ones(8, np.float32)) and not sin[0].any()


def test_features_of_one_pass_equal_features_fed_position_by_position(lm, tiny_drafter):
    m = lm.model
    ids = golden_prompt(lm.cfg.vocab)
    whole, steps = _drafter(tiny_drafter, lm), _drafter(tiny_drafter, lm)
    cap = whole.capture()
    m.forward(ids, m.new_state(len(ids)), capture=cap)
    whole.take(ids, 0, ids, cap)
    st = m.new_state(len(ids))
    for p in range(len(ids)):
        cap = steps.capture()
        m.forward(ids[p:p + 1], st, capture=cap)
        steps.take(ids, p, ids[p:p + 1], cap)
    n = len(ids)
    same = np.array_equal(whole._k[:, :n], steps._k[:, :n]) and \
        np.array_equal(whole._v[:, :n], steps._v[:, :n])
    a, b = whole.block(ids[-1], n - 1), steps.block(ids[-1], n - 1)
    print(f"[gate] drafter context from one {n}-position pass == fed one position at a time: "
          f"{same}; drafts {a} == {b}")
    assert same and a == b and whole.fed == steps.fed == ids


# ---- greedy ids never change -------------------------------------------------------------

class _Oracle(BlockDrafter):
    """Proposes the target's own continuation (`truth`), wrong at every `wrong`-th draft:
    sweeps that keep some drafts and reject the rest."""
    truth: list[int] = []
    wrong = 3

    def block(self, anchor, s, n=None):
        out = []
        for i in range(n or self.width):
            t = self.truth[s + 1 + i] if s + 1 + i < len(self.truth) else 0
            out.append(t if (s + i) % self.wrong else (t + 1) % self.config.vocab)
        return out


def test_accepted_drafts_keep_exactly_the_features_of_the_committed_positions(lm,
                                                                              tiny_drafter):
    """A drafter whose drafts are partly right: the ids are plain greedy's, and after the
    run its context equals a drafter's that read one pass over the final ids (the kept
    rows of each sweep, never a rejected one)."""
    prompt = golden_prompt(lm.cfg.vocab)
    plain = _run(lm, prompt, 24)
    oracle = _drafter(tiny_drafter, lm)
    oracle.__class__ = _Oracle
    oracle.truth = list(prompt) + plain.ids
    got = _run(lm, prompt, 24, 4, oracle)
    ref = _drafter(tiny_drafter, lm)
    fed = (prompt + got.ids)[:oracle.context]
    cap = ref.capture()
    lm.model.forward(fed, lm.model.new_state(len(fed)), capture=cap)
    ref.take(fed, 0, fed, cap)
    n = len(fed)
    same = np.array_equal(ref._k[:, :n], oracle._k[:, :n]) and \
        np.array_equal(ref._v[:, :n], oracle._v[:, :n])
    print(f"[gate] partly right drafts: ids equal plain {got.ids == plain.ids}; {got.spec.rounds}"
          f" passes, {got.spec.drafted} drafted, {got.spec.accepted} accepted; context of "
          f"{n} positions equals one pass over the final ids: {same}")
    assert got.ids == plain.ids and 0 < got.spec.accepted < got.spec.drafted
    assert oracle.fed == fed and n == len(prompt) + len(got.ids) - 1 and same


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_ids_with_a_random_drafter_equal_plain_greedy_on_tiny(lm, tiny_drafter,
                                                                     threads):
    prompt = golden_prompt(lm.cfg.vocab)
    with with_threads(threads):
        plain = _run(lm, prompt, 20)
        dr = _drafter(tiny_drafter, lm)
        got = _run(lm, prompt, 20, 4, dr)
    print(f"[gate] tiny, {threads} thread(s): ids with the drafter equal plain greedy "
          f"{got.ids == plain.ids} ({len(got.ids)} ids); {got.spec.rounds} passes, "
          f"{got.spec.drafted} drafted, {got.spec.accepted} accepted; drafter {dr.seconds:.3f} s")
    assert got.ids == plain.ids and got.spec.rounds > 0 and dr.passes == got.spec.rounds


def test_a_sampled_turn_decodes_as_without_the_drafter(lm, tiny_drafter):
    prompt = golden_prompt(lm.cfg.vocab)
    s = Sampling(temperature=0.9, seed=5)
    plain = _run(lm, prompt, 16, sampling=s)
    dr = _drafter(tiny_drafter, lm)
    got = _run(lm, prompt, 16, 4, dr, sampling=s)
    print(f"[gate] sampled turn (seed 5): ids with the drafter loaded {got.ids} == without "
          f"{plain.ids}; {got.spec.rounds} passes")
    assert got.ids == plain.ids and got.spec.rounds == 0 and dr.passes == 0


def _cli(args, tmp_path, name):
    from k3engine.cli import main
    out = str(tmp_path / f"{name}.json")
    code = main(args + ["--out", out])
    return code, (json.load(open(out)) if code == 0 else None)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_cli_run_with_a_drafter_gives_the_plain_ids_resident_and_streamed(tiny, tiny_drafter,
                                                                          tmp_path, threads):
    from k3engine.trunk import pack_trunk
    trunk = str(tmp_path / "trunk")
    pack_trunk(tiny, trunk)
    ids = ",".join(map(str, golden_prompt()))
    base = [tiny, "--ids", ids, "--gen", "16", "--incremental", "--threads", threads]
    budgets = {"resident": [], "streamed": ["--trunk", trunk, "--trunk-gb", "0",
                                            "--cache-gb", "0.001"]}
    for name, mem in budgets.items():
        code, plain = _cli(base + mem, tmp_path, f"plain-{name}")
        code2, got = _cli(base + mem + ["--draft-model", tiny_drafter], tmp_path, name)
        print(f"[gate] k3 --draft-model, {name}, {threads} thread(s): exit {code2}, ids equal "
              f"plain {got['generated_ids'] == plain['generated_ids']}; spec_rounds "
              f"{got['spec_rounds']}, drafted {got['spec_drafted']}, accepted "
              f"{got['spec_accepted']}, mean accepted {got['spec_mean_accepted']}; width "
              f"defaulted to block 5 - 1")
        assert code == code2 == 0 and got["generated_ids"] == plain["generated_ids"]
        assert got["spec_rounds"] > 0 and got["spec_drafted"] <= 4 * got["spec_rounds"]
        assert got["draft_model"] == tiny_drafter and "spec_rounds" not in plain


# ---- the demo: a chat turn and a server request ----------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The shipped demo model, a packed trunk of it, and a random drafter in the contract's
    demo shape (E 128, layers [1, 3, 5, 7], block 8, mask 4255)."""
    from k3engine.config import load_config
    from k3engine.tools.demo import shipped_dir
    from k3engine.trunk import pack_trunk
    model = shipped_dir()
    base = tmp_path_factory.mktemp("demo-drafter")
    pack_trunk(model, str(base / "trunk"))
    cfg = load_config(os.path.join(model, "config.json"))
    d = make_drafter(base / "drafter", cfg, [1, 3, 5, 7], block=8, mask=4255, seed=1)
    return model, str(base / "trunk"), d


def _demo_engine(demo, streamed: bool, drafter: bool, threads: int = 1):
    from k3engine.engine import load_spec_from, open_engine
    model, trunk, d = demo
    mem = [("--trunk-gb", 0.0), ("--cache-gb", 0.002)] if streamed else []
    return open_engine(load_spec_from(
        model, mem, tok_dir=model, trunk_dir=trunk if streamed else None, incremental=True,
        spec=7 if drafter else 0, drafter_dir=d if drafter else None, threads=threads), gen=24)


def _chat(eng, spec: GenSpec):
    from k3engine.chat import History, Message
    from k3engine.conversation import Conversation
    from k3engine.events import TurnEnded
    conv = Conversation(eng, History([Message("user", "Tell me about the moon")]))
    out = []
    for follow in ("And the sun?", None):
        for ev in conv.turn(spec):
            if isinstance(ev, TurnEnded):
                out.append(ev.result)
        if follow:
            conv.commit_pending()
            conv.add_user(follow)
    return out


@pytest.mark.parametrize("streamed,threads", [(False, 1), (True, 1), (True, 2)],
                         ids=["resident-1t", "streamed-1t", "streamed-2t"])
def test_demo_chat_turns_with_a_drafter_give_the_plain_ids(demo, streamed, threads):
    runs = {}
    for drafter in (False, True):
        eng = _demo_engine(demo, streamed, drafter, threads)
        try:
            runs[drafter] = _chat(eng, GenSpec(gen=24, thinking=False, spec=7 if drafter else 0))
            if drafter:
                passes, restarts = eng.drafter.passes, eng.drafter.restarts
        finally:
            eng.close()
    for n, (a, b) in enumerate(zip(runs[False], runs[True]), 1):
        print(f"[gate] demo chat turn {n} ({'streamed' if streamed else 'resident'}, {threads}"
              f" thread(s)): {len(b.ids)} ids equal plain {a.ids == b.ids}; {b.spec.rounds} "
              f"passes, {b.spec.drafted} drafted, {b.spec.accepted} accepted; reused "
              f"{b.reused} vs {a.reused}")
        assert a.ids == b.ids and a.reused == b.reused
    assert runs[True][1].spec.rounds > 0 and restarts == 0     # turn 2 drafted from turn 1's context
    assert passes == sum(r.spec.rounds for r in runs[True])


def test_demo_server_request_with_a_drafter_gives_the_plain_ids(demo):
    from k3engine.chat import History, Message
    from k3engine.server.engine import Backend, Done, Job
    from k3engine.server.protocol import GenRequest, Limits, SamplingIn

    def serve(eng, width):
        posted = []
        req = GenRequest(kind="chat", model="demo", gen=24,
                         sampling=SamplingIn(None, None, None, None, True), stops=(),
                         stream=False, include_usage=True,
                         history=History([Message("user", "Count to ten")]), thinking=False)
        Backend(eng, "demo", Limits(), spec=width).execute(Job(req, posted.append))
        return next(p for p in posted if isinstance(p, Done))
    eng = _demo_engine(demo, True, True)
    try:
        plain, got = serve(eng, 0), serve(eng, 7)
    finally:
        eng.close()
    print(f"[gate] demo server request with the drafter: ids equal plain "
          f"{plain.ext['ids'] == got.ext['ids']} ({len(got.ext['ids'])} ids); usage.k3 "
          f"spec_drafted {got.ext['spec_drafted']}, spec_accepted {got.ext['spec_accepted']}")
    assert plain.ext["ids"] == got.ext["ids"] and got.ext["spec_drafted"] > 0


def test_demo_plan_counts_the_drafter_and_the_report_names_it(demo, capsys, tmp_path):
    from k3engine.cli import main
    model, trunk, d = demo
    code = main([model, "--prompt", "Hello", "--tok", model, "--gen", "8", "--incremental",
                 "--draft-model", d, "--out", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  block drafter"))
    print(f"[gate] plan line: {line.strip()!r}; run exit {code}")
    assert code == 0 and "weights" in line and "context K/V" in line
    assert "block drafter: proposes up to 7 tokens per pass" in out
    assert "tokens per verification pass" in out or "block drafter: no pass drafted" in out


# ---- options ----------------------------------------------------------------------------

def test_cli_options_for_the_drafter(tiny, tiny_drafter, capsys):
    from k3engine.cli import main, parse_args
    o = parse_args([tiny, "--ids", "1,2", "--incremental", "--draft-model", tiny_drafter])
    o3 = parse_args([tiny, "--ids", "1,2", "--incremental", "--draft-model", tiny_drafter,
                     "--spec", "2"])
    both = main([tiny, "--ids", "1,2", "--incremental", "--draft-model", tiny_drafter,
                 "--draft-trunk", tiny, "--trunk", tiny])
    err = capsys.readouterr().err
    batch = main([tiny, "--batch", "x.jsonl", "--draft-model", tiny_drafter])
    err2 = capsys.readouterr().err
    print(f"[gate] --draft-model: default width {o.spec} (block 5 - 1), --spec 2 -> {o3.spec}; "
          f"with --draft-trunk exit {both}: {err.strip()!r}; with --batch exit {batch}")
    assert o.spec == "4" and o3.spec == "2"
    assert both == 2 and "mutually exclusive" in err
    assert batch == 2 and "--draft-model" in err2


# ---- hostile drafter folders ------------------------------------------------------------

def _edit_config(folder, edit):
    p = os.path.join(folder, "config.json")
    cfg = json.load(open(p))
    edit(cfg)
    with open(p, "w") as f:
        json.dump(cfg, f)


CONFIG_CASES = {
    "no config": (lambda f: os.unlink(os.path.join(f, "config.json")), "file not found"),
    "not JSON": (lambda f: open(os.path.join(f, "config.json"), "w").write("{"), "invalid JSON"),
    "missing head_dim": (lambda f: _edit_config(f, lambda c: c.pop("head_dim")), "head_dim"),
    "string layers": (lambda f: _edit_config(f, lambda c: c.update(num_hidden_layers="2")),
                      "num_hidden_layers"),
    "hidden size": (lambda f: _edit_config(f, lambda c: c.update(hidden_size=64)),
                    "does not match the model's 128"),
    "vocab": (lambda f: _edit_config(f, lambda c: c.update(vocab_size=300)),
              "does not match the model's 256"),
    "layer out of range": (lambda f: _edit_config(
        f, lambda c: c["dflash_config"].update(target_layer_ids=[1, 13])), "out of range"),
    "block 1": (lambda f: _edit_config(f, lambda c: c.update(block_size=1)), ">= 2"),
    "mask id": (lambda f: _edit_config(
        f, lambda c: c["dflash_config"].update(mask_token_id=256)), "mask_token_id 256"),
    "no mask id": (lambda f: _edit_config(f, lambda c: c["dflash_config"].pop("mask_token_id")),
                   "mask_token_id"),
    "DFlash2": (lambda f: _edit_config(f, lambda c: c.update(architectures=["DFlash2DraftModel"])),
                "DFlash2"),
    "rope scaling": (lambda f: _edit_config(f, lambda c: c.update(rope_scaling={"type": "yarn"})),
                     "rope_scaling"),
    "heads": (lambda f: _edit_config(f, lambda c: c.update(num_key_value_heads=3)),
              "multiple of"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_bad_drafter_config_is_refused_naming_the_file(lm, tmp_path, case):
    folder = make_drafter(tmp_path / "d", lm.cfg, [1, 5, 12], inter=96, block=5)
    breaks, problem = CONFIG_CASES[case]
    breaks(folder)
    with pytest.raises(ConfigError) as e:
        open_drafter(folder, lm.cfg)
    code, _, msg = describe(e.value)
    print(f"[gate] {case}: exit {code}: {msg.splitlines()[0]}")
    assert code == 2 and os.path.join(folder, "config.json") in msg and problem in msg


def _store(folder, lm, dtype="F32", rename=lambda n: n, drop=(), extra=None, reshape=None):
    from k3engine.checkpoint import Checkpoint
    from k3engine.tools.st_writer import TensorSpec, write_safetensors
    p = os.path.join(folder, "model.safetensors")
    with Checkpoint(folder) as ck:
        arrays = {n: ck.read(n) for n in ck.names() if n not in drop}
    if reshape:
        arrays[reshape] = np.ascontiguousarray(arrays[reshape].T)
    if extra:
        arrays[extra] = np.zeros(4, np.float32)
    arrays = {rename(n): a for n, a in arrays.items()}
    os.unlink(p)
    write_safetensors(p, [TensorSpec(n, {np.float32: "F32", np.uint8: "U8"}[a.dtype.type],
                                     a.shape) for n, a in arrays.items()], lambda s: arrays[s.name])


TENSOR_CASES = {
    "missing tensor": (dict(drop=("layers.1.mlp.up_proj.weight",)), "missing tensor "
                       "layers.1.mlp.up_proj.weight"),
    "transposed": (dict(reshape="fc.weight"), "fc.weight is F32 [384, 128], expected F32 or "
                   "BF16 [128, 384]"),
    "bias": (dict(extra="layers.0.self_attn.q_proj.bias"), "q_proj.bias is not part"),
    "no weights": (dict(drop=None), "no .safetensors"),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_bad_drafter_tensors_are_refused_naming_the_file(lm, tmp_path, case):
    folder = make_drafter(tmp_path / "d", lm.cfg, [1, 5, 12], inter=96, block=5)
    how, problem = TENSOR_CASES[case]
    if how.get("drop", ()) is None:
        os.unlink(os.path.join(folder, "model.safetensors"))
    else:
        _store(folder, lm, **how)
    with pytest.raises(CheckpointError) as e:
        open_drafter(folder, lm.cfg)
    code, _, msg = describe(e.value)
    print(f"[gate] {case}: exit {code}: {msg}")
    assert code == 1 and folder in msg and problem in msg


def test_public_names_are_accepted_as_aliases(lm, tmp_path):
    """SGLang's loader takes names with a "model." prefix, and z-lab's reads block_size
    and the dflash values at the top level too: the same drafter either way."""
    a = make_drafter(tmp_path / "a", lm.cfg, [1, 5, 12], inter=96, block=5, seed=7)
    b = make_drafter(tmp_path / "b", lm.cfg, [1, 5, 12], inter=96, block=5, seed=7,
                     rename=lambda n: "model." + n)
    _edit_config(b, lambda c: c.update(target_layer_ids=c["dflash_config"].pop(
        "target_layer_ids")))
    da, db = _drafter(a, lm), _drafter(b, lm)
    ids = golden_prompt(lm.cfg.vocab)
    for d in (da, db):
        cap = d.capture()
        lm.model.forward(ids, lm.model.new_state(len(ids)), capture=cap)
        d.take(ids, 0, ids, cap)
    print(f"[gate] 'model.'-prefixed names and top-level target_layer_ids: drafts "
          f"{db.block(ids[-1], len(ids))} == {da.block(ids[-1], len(ids))}")
    assert np.array_equal(da.block_logits(ids[-1], len(ids)), db.block_logits(ids[-1], len(ids)))
    _edit_config(b, lambda c: c.update(block_size=4))          # both places must agree
    _edit_config(b, lambda c: c["dflash_config"].update(block_size=5))
    with pytest.raises(ConfigError, match="block_size"):
        open_drafter(b, lm.cfg)


def test_the_drafter_follows_one_sequence_and_starts_over_for_another(lm, tiny_drafter):
    """An edited turn keeps the shared prefix; another sequence starts over; a pass whose
    start the drafter never saw leaves it without drafts (never with wrong ones)."""
    m = lm.model
    dr = _drafter(tiny_drafter, lm)
    ids = golden_prompt(lm.cfg.vocab)

    def feed(seq, start):
        st = m.new_state(len(seq))
        if start:
            m.forward(seq[:start], st)
        cap = dr.capture()
        m.forward(seq[start:], st, capture=cap)
        dr.take(seq, start, seq[start:], cap)
    feed(ids, 0)
    edited = ids[:8] + [(i + 1) % 256 for i in ids[8:]]
    feed(edited, 8)
    kept = (dr.context, dr.restarts, len(dr.propose(edited + [7], 3)))
    feed(ids[::-1], 5)                                   # another sequence, its start unseen
    unseen = (dr.context, len(dr.propose(ids[::-1] + [7], 3)))
    print(f"[gate] edited at 8: context {kept[0]}, restarts {kept[1]}, {kept[2]} drafts; "
          f"another sequence fed from 5: context {unseen[0]}, {unseen[1]} drafts")
    assert kept == (len(ids), 0, 3) and unseen == (0, 0) and dr.restarts == 1


def test_demo_repl_and_k3_serve_with_a_drafter_give_the_plain_ids(demo, tmp_path):
    """The real front ends: `k3 --chat` (the REPL answering a history) and a `k3 serve`
    process, each with and without --draft-model."""
    import subprocess
    import sys
    import urllib.request
    from serve_helpers import serve
    model, _, d = demo

    def repl(*flags):
        hist, ev = tmp_path / f"h{len(flags)}.jsonl", tmp_path / f"ev{len(flags)}.jsonl"
        # a fresh history each time: the REPL appends its reply to the file
        hist.write_text(json.dumps({"role": "user", "content": "Hello!"}) + "\n")
        r = subprocess.run([sys.executable, "-m", "k3engine", model, "--chat", "--tok", model,
                            "--history", str(hist), "--gen", "64", "--no-think", "--events",
                            str(ev), *flags], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=600)
        recs = [json.loads(x) for x in ev.read_text().splitlines()]
        return r.returncode, [x["id"] for x in recs if x["ev"] == "token" and x["id"] >= 0]

    def ask(*flags):
        with serve(model, *flags) as s:
            body = json.dumps({"model": "demo_model", "max_tokens": 20, "temperature": 0,
                               "messages": [{"role": "user", "content": "Count to ten"}],
                               "chat_template_kwargs": {"thinking": False}}).encode()
            req = urllib.request.Request(s.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())["k3"]
    (c0, plain), (c1, got) = repl(), repl("--draft-model", d)
    s0, s1 = ask(), ask("--draft-model", d)
    print(f"[gate] k3 --chat --draft-model: exit {c1}, {len(got)} ids equal plain {got == plain}; "
          f"k3 serve --draft-model: ids equal plain {s1['ids'] == s0['ids']} "
          f"({len(s1['ids'])} ids), spec_drafted {s1['spec_drafted']} vs {s0['spec_drafted']}")
    assert c0 == c1 == 0 and got == plain and len(got) > 0
    assert s1["ids"] == s0["ids"] and s1["spec_drafted"] > 0 == s0["spec_drafted"]


def test_a_pass_over_several_sequences_hands_the_drafter_its_own_rows(lm, tiny_drafter):
    """sequence.feed_together (a batch step): the sequence the drafter follows may share
    the pass with others; its context is what a pass over it alone gives."""
    from k3engine.sequence import Sequence, feed_together
    dr, alone = _drafter(tiny_drafter, lm), _drafter(tiny_drafter, lm)
    ids = golden_prompt(lm.cfg.vocab)
    other, mine = Sequence(lm.model), Sequence(lm.model, features=dr)
    other.extend(ids[::-1][:7], 4)
    mine.extend(ids, 4)
    feed_together([(other, 7), (mine, len(ids))])
    solo = Sequence(lm.model, features=alone)
    solo.extend(ids, 4)
    solo.feed(len(ids))
    n = len(ids)
    same = np.array_equal(dr._k[:, :n], alone._k[:, :n]) and \
        np.array_equal(dr._v[:, :n], alone._v[:, :n])
    print(f"[gate] drafter context from a pass shared with another sequence (7 + {n} rows) "
          f"== from a pass alone: {same}")
    assert same and dr.fed == alone.fed == ids


def test_the_plan_figures_of_a_folder_alone_equal_the_checked_ones(lm, tmp_path):
    """The app plans from the folder alone (drafter.size_of, before a model is loaded);
    the engine from the folder checked against the model: the same figures.  --layers
    binding fewer layers than the drafter reads is refused."""
    from k3engine.drafter import read_drafter_config, size_of
    folder = make_drafter(tmp_path / "d", lm.cfg, [1, 5, 12], inter=96, block=5, dtype="BF16")
    setup = open_drafter(folder, lm.cfg)
    try:
        checked = setup.size
    finally:
        setup.close()
    alone = size_of(folder)
    with pytest.raises(ConfigError, match="--layers binds only 6"):
        read_drafter_config(folder, lm.cfg, n_bound=6)
    print(f"[gate] drafter plan figures: folder alone {alone} == checked {checked}")
    assert alone == checked and checked.weight_bytes > 0 and checked.per_position > 0


def test_the_shipped_demo_drafter_is_accepted_and_changes_no_id():
    """With the demo's trained drafter (k3 train-demo-drafter's output, package data beside
    the demo model; `k3 demo --drafter-path`): greedy chat turns keep their ids and more
    than one draft a pass is accepted."""
    from k3engine.chat import History, Message
    from k3engine.conversation import Conversation
    from k3engine.engine import load_spec_from, open_engine
    from k3engine.events import TurnEnded
    from k3engine.tools.demo import drafter_dir, shipped_dir
    model, folder = shipped_dir(), drafter_dir()
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        pytest.skip(f"NOT RUN: no trained demo drafter at {folder}")
    runs = {}
    for width in (0, 7):
        eng = open_engine(load_spec_from(model, tok_dir=model, incremental=True, spec=width,
                                         drafter_dir=folder if width else None), gen=96)
        try:
            out = []
            for q in ("What is 12 plus 30?", "Tell me about the moon."):
                for ev in Conversation(eng, History([Message("user", q)])).turn(
                        GenSpec(gen=96, thinking=False, spec=width)):
                    if isinstance(ev, TurnEnded):
                        out.append(ev.result)
        finally:
            eng.close()
        runs[width] = out
    rounds = sum(r.spec.rounds for r in runs[7])
    mean = sum(r.spec.accepted for r in runs[7]) / max(rounds, 1)
    print(f"[gate] trained demo drafter: ids equal plain "
          f"{[r.ids for r in runs[7]] == [r.ids for r in runs[0]]}; {rounds} passes, mean "
          f"accepted per pass {mean:.2f} (a random drafter: 0)")
    assert [r.ids for r in runs[7]] == [r.ids for r in runs[0]] and mean > 1
