"""The real `k3` process (subprocess) for each exit code, usage error and refusal, with
its message; --out JSON in the reference's key order and formats; --dump-logits."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_helpers import GOLDEN_SEED, make_tiny

GOLDEN = json.loads((Path(__file__).parent / "golden" / "tiny_seed1234.json").read_text())
PROMPT = ",".join(str(i) for i in GOLDEN["prompt_ids"])


def k3(*args, cwd=None, env=None):
    p = subprocess.run([sys.executable, "-m", "k3engine", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    print(f"[cli] k3 {' '.join(map(str, args))[:90]} -> exit {p.returncode}")
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cli") / "tiny", GOLDEN_SEED)


def test_run_prints_ids_and_writes_out_json(tiny, tmp_path):
    out = tmp_path / "run.json"
    logits = tmp_path / "logits.bin"
    p = k3(tiny, "--ids", PROMPT, "--gen", 5, "--incremental", "--out", out,
           "--dump-logits", logits, "--threads", 1)
    assert p.returncode == 0, p.stderr
    want = GOLDEN["generated_ids"][:5]
    assert f"generated ids: {','.join(map(str, want))}" in p.stdout
    assert "threads: 1" in p.stdout and "PEAK RSS for the whole run:" in p.stdout
    assert "STEP   TOKEN      SECONDS      CACHE HIT  READ GB    TOK/S" in p.stdout
    line = out.read_text()
    assert line.endswith("}\n") and " " not in line
    j = json.loads(line)
    # the reference's keys in its order (SYSTEM §6.7), then our extensions (readers ignore
    # unknown keys): the lookahead reads' counters (lookahead.py)
    assert list(j) == ["prompt_ids", "generated_ids", "full_ids", "layers", "layers_requested",
                       "layers_completed", "expert_drops", "peak_rss_bytes", "wall_seconds",
                       "seconds_per_token", "expert_bytes_read", "trunk_bytes_read",
                       "embedding_bytes_read", "lm_head_bytes_read", "ultra_low_memory",
                       "stopped_at", "interrupted", "generated_text", "lookahead_predicted",
                       "lookahead_useful", "lookahead_wasted", "lookahead_bytes",
                       "lookahead_wasted_bytes", "lookahead_recall"]
    assert j["generated_ids"] == want and j["full_ids"] == GOLDEN["prompt_ids"] + want
    assert j["layers"] == j["layers_completed"] == 13 and j["peak_rss_bytes"] > 0
    raw = np.fromfile(logits, dtype="<f4")
    assert raw.shape == (256,) and f"wrote {logits} (256 float32 logits)" in p.stdout


def test_full_recompute_and_incremental_cli_agree(tiny, tmp_path):
    a = k3(tiny, "--ids", PROMPT, "--gen", 4, "--out", tmp_path / "a.json")
    b = k3(tiny, "--ids", PROMPT, "--gen", 4, "--incremental", "--out", tmp_path / "b.json")
    ja, jb = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a.returncode == b.returncode == 0
    assert ja["generated_ids"] == jb["generated_ids"] == GOLDEN["generated_ids"][:4]


def test_cache_policy_is_named_and_changes_no_id(tiny, tmp_path):
    """--cache-policy s3fifo (and K3_CACHE_POLICY) on a 6-slot cache: the init line names
    it, the ids are LRU's; LRU keeps the reference's line."""
    runs = {}
    for name, extra, env in (("lru", (), None), ("flag", ("--cache-policy", "s3fifo"), None),
                             ("env", (), {"K3_CACHE_POLICY": "s3fifo"})):
        p = k3(tiny, "--ids", PROMPT, "--gen", 4, "--incremental", "--cache-gb", 0.0001,
               *extra, "--out", tmp_path / f"{name}.json", env=env)
        assert p.returncode == 0, p.stderr[-800:]
        line = next(l for l in p.stdout.splitlines() if l.startswith("expert cache:"))
        runs[name] = (json.loads((tmp_path / f"{name}.json").read_text())["generated_ids"], line)
        print(f"[gate] --cache-policy {name}: ids {runs[name][0]}; {line}")
    assert runs["lru"][0] == runs["flag"][0] == runs["env"][0] == GOLDEN["generated_ids"][:4]
    assert "replacement" not in runs["lru"][1]
    assert runs["flag"][1].endswith("S3-FIFO replacement)") and runs["env"][1] == runs["flag"][1]


def test_ids_file_and_layers(tiny, tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text(PROMPT.replace(",", "\n"))
    p = k3(tiny, "--ids-file", f, "--gen", 2, "--layers", 5, "--out", tmp_path / "o.json")
    assert p.returncode == 0, p.stderr
    assert "NOTE: binding only the first 5 of 13 layers" in p.stdout
    j = json.loads((tmp_path / "o.json").read_text())
    assert j["layers"] == j["layers_completed"] == 5


def test_gen_zero_incremental_is_prefill_only(tiny, tmp_path):
    p = k3(tiny, "--ids", PROMPT, "--gen", 0, "--incremental", "--out", tmp_path / "o.json")
    assert p.returncode == 0 and "prefill only: 12 positions cached, 0 tokens generated" in p.stdout


@pytest.mark.parametrize("args, message", [
    ((), "usage: k3"),
    (("--ids", "1"), "the first argument must be the model directory, got '--ids'"),
    (("{m}", "--bogus"), "unknown option --bogus"),
    (("{m}", "--ids"), "unknown option --ids"),
    (("{m}",), "one of --ids, --prompt or --prompt-file is required"),
    (("{m}", "--ids", "1,x"), "bad --ids: 'x' is not a non-negative whole number"),
    (("{m}", "--ids", "1", "--ids-file", "f"), "mutually exclusive"),
    (("{m}", "--ids", "1", "--gen", "4097"), "--gen 4097 is out of range (0..4096)"),
    (("{m}", "--ids", "1", "--gen", "2.5"), "bad --gen value '2.5'"),
    (("{m}", "--ids", "1", "--threads", "0"), "--threads 0 is out of range"),
    (("{m}", "--ids", "1", "--cache-policy", "arc"),
     "--cache-policy must be lru or s3fifo, got 'arc'"),
    (("{m}", "--ids", "1", "--layers", "14"), "--layers 14 is out of range (1..13)"),
    (("{m}", "--ids", "1,256"), "token id 256 is outside the vocabulary of 256"),
    (("{m}", "--ids", ",".join(["1"] * 32769)), "the limit is 32768 (refused, never truncated)"),
])
def test_usage_errors_exit_2(tiny, args, message):
    p = k3(*[a.format(m=tiny) for a in args])
    assert p.returncode == 2
    assert message in p.stderr


def test_help_and_version_exit_0():
    h = k3("--help")
    assert h.returncode == 0 and "exit codes" in h.stdout and "make-checkpoint" in h.stdout
    v = k3("somewhere", "--version")
    assert v.returncode == 0 and "reference-compatible with kimi-k3-in-c 1.1.0" in v.stdout


def test_missing_or_bad_config_exit_2(tmp_path, tiny):
    empty = tmp_path / "empty"
    empty.mkdir()
    p = k3(empty, "--ids", "1")
    assert p.returncode == 2 and "no config.json" in p.stderr and "ABORTED" in p.stderr
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["situ_beta"]
    (bad / "config.json").write_text(json.dumps(cfg))
    p = k3(bad, "--ids", "1")
    assert p.returncode == 2 and "situ_beta" in p.stderr or "activation_situ_beta" in p.stderr


def test_damaged_checkpoints_exit_1(tmp_path, tiny):
    trunc = tmp_path / "trunc"
    shutil.copytree(tiny, trunc)
    st = trunc / "model.safetensors"
    with open(st, "r+b") as f:
        f.truncate(st.stat().st_size // 2)
    p = k3(trunc, "--ids", "1")
    assert p.returncode == 1 and "model.safetensors" in p.stderr and "data_offsets" in p.stderr

    nodata = tmp_path / "nodata"
    nodata.mkdir()
    shutil.copy(Path(tiny) / "config.json", nodata / "config.json")
    p = k3(nodata, "--ids", "1")
    assert p.returncode == 1 and "no .safetensors files" in p.stderr


def test_tensor_that_does_not_bind_exit_1(tmp_path, tiny):
    """A config that disagrees with the tensors is refused naming the tensor."""
    d = tmp_path / "mismatch"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    p = k3(d, "--ids", "1")
    assert p.returncode == 1
    assert "language_model.model.layers.0.mlp.gate_proj.weight has 12288 elements" in p.stderr


def test_missing_tensor_is_a_partial_checkpoint_exit_1(tmp_path, tiny):
    from k3engine.tools.st_writer import TensorSpec, write_safetensors
    from k3engine.checkpoint import Checkpoint
    d = tmp_path / "partial"
    d.mkdir()
    shutil.copy(Path(tiny) / "config.json", d / "config.json")
    with Checkpoint(tiny) as ck:
        keep = [n for n in ck.names() if "layers.7.self_attn.o_proj" not in n]
        specs = [TensorSpec(n, ck.info(n).dtype, ck.info(n).shape) for n in keep]
        write_safetensors(str(d / "model.safetensors"), specs, lambda s: ck.read(s.name))
    p = k3(d, "--ids", "1")
    assert p.returncode == 1
    assert "1 of 13 layers are missing tensors in this shard set" in p.stderr
    assert "layers.7.self_attn.o_proj.weight" in p.stderr


def test_unwritable_out_exit_3(tiny, tmp_path):
    p = k3(tiny, "--ids", PROMPT, "--gen", 1, "--out", tmp_path / "no" / "such" / "dir.json")
    assert p.returncode == 3 and "cannot write" in p.stderr
    assert "generated ids:" in p.stdout


def test_make_checkpoint_subcommand(tmp_path):
    p = k3("make-checkpoint", tmp_path / "m", "--dims", "tiny", "--seed", "5", "--nested")
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "kimi_k3"
    assert k3("make-checkpoint", "--help").returncode == 0
