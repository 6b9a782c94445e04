"""The shipped demo model (k3engine/data/demo_model, made by `k3 train-demo`): its files are the
ones the committed manifest names, the engine loads it and it closes its chat turns, `k3 demo
--path` makes a ready-to-run copy, and (with torch) an independent float64 forward pass on
the shipped files agrees with the engine.  No test here needs torch except the last, which
skips without it (CI does not install the [train] extra)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from k3engine.chat import History, Message
from k3engine.sampler import Sampler
from engine_helpers import chat_on, run_turn
from k3engine.generate import GenSpec
from k3engine.loading import load_model, read_config
from k3engine.tokenizer import Tokenizer, control_ids
from k3engine.tools import demo
from k3engine.tools.demo_corpus import is_test_prompt, make_corpus

SHIPPED = demo.shipped_dir()


@pytest.fixture(scope="module")
def shipped():
    cfg, _ = read_config(SHIPPED)
    lm = load_model(SHIPPED, cfg)
    tok = Tokenizer.from_dir(SHIPPED)
    yield lm, tok, control_ids(tok, None)
    lm.close()


def test_shipped_files_are_the_manifest():
    names = demo.manifest_files(SHIPPED)
    on_disk = sorted(f for f in os.listdir(SHIPPED) if os.path.isfile(os.path.join(SHIPPED, f))
                     and f != demo.MANIFEST and not f.endswith((".py", ".pyc")))
    print(f"[gate] manifest lists {names}; directory holds {on_disk}")
    assert sorted(names) == on_disk
    for line in open(os.path.join(SHIPPED, demo.MANIFEST)):
        digest, name = line.rstrip("\n").split("  ")
        with open(os.path.join(SHIPPED, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, name
    size = sum(os.path.getsize(os.path.join(SHIPPED, n)) for n in names)
    print(f"[gate] shipped size {size / 1e6:.2f} MB")
    assert size <= 20e6


def test_shipped_config_is_the_trained_shape():
    from k3engine.tools.train_demo import trained_config
    cfg, _ = read_config(SHIPPED)
    assert cfg == trained_config()
    n_mla = sum(cfg.is_mla(L) for L in range(cfg.n_layers))
    assert cfg.is_dense(0) and cfg.is_kda(0) and n_mla >= 2
    assert cfg.n_experts >= 32 and cfg.topk >= 4 and cfg.n_shared >= 1


def test_the_corpus_is_deterministic_and_holds_out_its_test_prompts():
    a, b = make_corpus(0), make_corpus(0)
    assert [c.turns for c in a.train] == [c.turns for c in b.train] and a.plain == b.plain
    train_prompts = {t.user for c in a.train for t in c.turns}
    test_prompts = {c.turns[0].user for c in a.test}
    assert len(test_prompts) == len(a.test) >= 50
    assert all(is_test_prompt(p) for p in test_prompts)
    assert not train_prompts & test_prompts


def greedy_chat(shipped, first_user: str, thinking: bool, **opts):
    lm, tok, ctl = shipped
    h = History([Message("user", first_user)])
    chat = chat_on(lm, tok, h, Sampler.from_flags(greedy=True))
    return h, lambda gen: run_turn(chat.turn(GenSpec(gen=gen, thinking=thinking, **opts)))


def test_shipped_model_chats_two_turns_each_closed(shipped):
    ctl = shipped[2]
    h, chat = greedy_chat(shipped, "Hello!", thinking=False)
    r1 = chat(128)
    h.add(Message("user", "What is 3 plus 4?"))
    r2 = chat(128)
    print(f"[gate] turn 1: {r1.content!r} end {r1.end_id}; turn 2: {r2.content!r} end "
          f"{r2.end_id}, {r2.reused} positions reused")
    assert r1.end_id == ctl.end_of_msg and r2.end_id == ctl.end_of_msg
    assert r1.content and r2.content and len(h) == 4
    assert r2.reused == r1.prompt_positions + len(r1.ids) - 1


def test_thinking_turn_closes_with_reasoning(shipped):
    _, chat = greedy_chat(shipped, "What day comes after Monday?", thinking=True)
    r = chat(256)
    print(f"[gate] thinking turn: reasoning {r.reasoning!r}, content {r.content!r}")
    assert r.end_id == shipped[2].end_of_msg and r.reasoning and r.content


def test_the_demo_answers_its_example_prompts(shipped):
    """The app's first run offers these (one click sends): each answered right, with the
    app's defaults (greedy, thinking at low effort)."""
    from k3engine.tools.demo_corpus import example_turns
    turns = example_turns()
    assert len(turns) == 4 and not any(is_test_prompt(q) for q, _ in turns)
    for q, answer in turns:
        _, chat = greedy_chat(shipped, q, thinking=True, effort="low")
        r = chat(128)
        print(f"[gate] example {q!r}: {r.content!r} (right answer {answer!r})")
        assert r.end_id == shipped[2].end_of_msg and answer is not None
        assert answer in r.content.replace(",", "")


def test_ready_copy_in_the_cache(tmp_path):
    d = demo.ready_dir(SHIPPED, cache=str(tmp_path), in_place=False)
    assert d.startswith(str(tmp_path)) and demo.is_ready(d)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(d)]      # no temp left behind
    mtime = os.path.getmtime(os.path.join(d, "trunk", "trunk.json"))
    assert demo.ready_dir(SHIPPED, cache=str(tmp_path), in_place=False) == d
    assert os.path.getmtime(os.path.join(d, "trunk", "trunk.json")) == mtime
    out = subprocess.run([sys.executable, "-m", "k3engine", d, "--trunk", os.path.join(d, "trunk"),
                          "--tok", d, "--prompt", "Hello", "--gen", "3", "--incremental",
                          "--out", str(tmp_path / "run.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_half_packed_trunk_is_replaced(tmp_path):
    d = demo.ready_dir(SHIPPED, cache=str(tmp_path), in_place=False)
    os.unlink(os.path.join(d, "trunk", "trunk.json"))        # as a crash mid-pack would leave
    assert not demo.is_ready(d)
    assert demo.ready_dir(SHIPPED, cache=str(tmp_path), in_place=False) == d and demo.is_ready(d)


def test_a_trunk_of_older_weights_is_repacked(tmp_path):
    d = demo.ready_dir(SHIPPED, cache=str(tmp_path), in_place=False)
    stamp = os.path.join(d, "trunk", demo.MANIFEST)
    with open(stamp, "ab") as f:                 # as a trunk packed from earlier weights
        f.write(b"0" * 64 + b"  model.safetensors\n")
    assert not demo.is_ready(d)
    assert demo.ready_dir(d, in_place=True) == d and demo.is_ready(d)
    with open(stamp, "rb") as a, open(os.path.join(d, demo.MANIFEST), "rb") as b:
        assert a.read() == b.read()


def test_k3_demo_path_prints_a_ready_directory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "k3engine", "demo", "--path", "--cache-dir",
                          str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    d = out.stdout.strip()
    assert demo.is_ready(d) and os.path.isfile(os.path.join(d, "config.json"))
    t = subprocess.run([sys.executable, "-m", "k3engine", "demo", "--trunk-path", "--cache-dir",
                        str(tmp_path)], capture_output=True, text=True)
    assert t.stdout.strip() == os.path.join(d, "trunk")


def test_k3_demo_refuses_a_directory_without_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest"):
        demo.ready_dir(str(tmp_path), cache=str(tmp_path / "c"))


def test_float64_torch_forward_on_the_shipped_files_matches_the_engine():
    pytest.importorskip("torch", reason="torch is only in the [train] extra (pip install -e "
                                        "'.[train]'); CI does not install it")
    from demo_check import compare_engine_torch
    tok = Tokenizer.from_dir(SHIPPED)
    r = compare_engine_torch(SHIPPED, tok, make_corpus(0).test[:3])
    print(f"[gate] float64 torch vs engine on {r['positions']} held-out positions: worst "
          f"relative diff {r['worst_rel_diff']:.3g} (tolerance {r['tolerance']:.3g}), same "
          f"argmax at {r['same_argmax']} of {r['positions']}")
    assert r["worst_rel_diff"] <= r["tolerance"]
    assert r["same_argmax"] == r["positions"]
