"""The companion tools: `k3 doctor` (SYSTEM §10.1), `k3 devbw` (§10.2) and `k3 budget`
(§10.4), run in-process through their `main()` and, for doctor, as a real process.

Nothing here asserts on speed: the storage figures are only checked for shape (three
queue-depth rows, a scratch file that does not outlive the run)."""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from k3engine.checkpoint import Checkpoint, parse_header
from k3engine.config import load_config
from k3engine.memory import MemProbe
from k3engine.names import expert_tensors
from k3engine.tools import budget, devbw, doctor
from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
from k3engine.trunk import pack_trunk

GiB = 1 << 30
PROBE = ["--probe-mb", "8"]          # a small read test keeps every doctor run short
RUN_MAIN = "import sys; from k3engine.tools.{0} import main; sys.exit(main(sys.argv[1:]))"
BROKEN_EXTENSION = ("import sys; sys.modules['k3engine.kernels'] = None; "
                    "from k3engine.tools.doctor import main; sys.exit(main(sys.argv[1:]))")


# --- generated models -------------------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tools")


def _model_and_trunk(root, dims: str) -> tuple[str, str]:
    d, t = str(root / dims), str(root / f"{dims}-trunk")
    make_checkpoint(d, dims_config(dims), seed=1)
    pack_trunk(d, t)
    return d, t


@pytest.fixture(scope="module")
def demo(root):
    """The demo model (carries our tokenizer) and its packed trunk."""
    return _model_and_trunk(root, "demo")


@pytest.fixture(scope="module")
def tiny(root):
    """A single-shard tiny model and its trunk (another model's trunk, for the demo)."""
    return _model_and_trunk(root, "tiny")


@pytest.fixture(scope="module")
def sharded(root):
    """The tiny model over several shards with a model.safetensors.index.json."""
    d = str(root / "sharded")
    paths = make_checkpoint(d, dims_config("tiny"), seed=1, shard_bytes=1_000_000)
    assert len(paths) >= 3
    return d


def shard_name(model_dir: str, k: int) -> str:
    """The k-th (1-based) shard file of a generated multi-shard model."""
    return budget.shard_paths(model_dir)[k - 1].rsplit(os.sep, 1)[1]


def run_doctor(capsys, *args) -> tuple[int, str]:
    rc = doctor.main([*args, *PROBE])
    return rc, capsys.readouterr().out


def section(out: str, title: str) -> str:
    """The lines of one doctor section (its title line starts with `title`)."""
    m = re.search(rf"^{re.escape(title)}.*?$(.*?)(?=^\S|\Z)", out, re.M | re.S)
    assert m, f"no section {title!r} in:\n{out}"
    return m.group(1)


def scratch_files(d) -> list[str]:
    return [n for n in os.listdir(d) if n.startswith(devbw.SCRATCH_PREFIX)]


# --- doctor -----------------------------------------------------------------------------

def test_doctor_healthy_setup(capsys, demo):
    model, trunk = demo
    rc, out = run_doctor(capsys, "--model", model, "--trunk", trunk)
    print(out)
    assert rc == 0
    for title in ("model", "trunk", "tokenizer", "plan"):
        assert "WARN" not in section(out, title), title
    mem = section(out, "memory")
    assert "recommended preset: " in mem or doctor.FLOOR_WARNING in mem
    assert "belongs to" in section(out, "trunk")
    assert "control tokens found" in section(out, "tokenizer")
    assert re.search(r"O_DIRECT random .* QD1 [\d,]+ MB/s, QD16 [\d,]+ MB/s|"
                     r"refuses O_DIRECT", section(out, "storage"))
    preset = re.search(r"--preset (\w+) plans .* admitted", out).group(1)
    q = shlex.quote
    run = f"k3 {q(model)} --trunk {q(trunk)} --tok {q(model)} --preset {preset} --prompt 'Hello'"
    result = section(out, "result")
    assert f"    {run}\n" in result
    assert f"--preset {preset} --chat" in result
    assert "pack-trunk" not in result
    assert scratch_files(model) == []


def test_doctor_names_the_mxfp4_path(capsys):
    """doctor says whether one-token MXFP4 matvecs run on integer byte products, and how to
    turn that off; with the path switched off it says the double path runs."""
    from k3engine import kernels as K
    if not K.mxq_supported():
        rc, out = run_doctor(capsys)
        assert "MXFP4" not in section(out, "engine")
        pytest.skip("NOT RUN (the rest): this CPU lacks AVX-512 VNNI/VBMI")
    rc, out = run_doctor(capsys)
    assert "MXFP4 matvecs: integer byte products" in section(out, "engine")
    K.set_mxq(False)
    try:
        rc, out = run_doctor(capsys)
    finally:
        K.set_mxq(True)
    assert "MXFP4 matvecs: the double path" in section(out, "engine")
    print("[gate] doctor names the one-token MXFP4 path, on and off")


def test_doctor_names_the_wide_matvec_path(capsys):
    """On AVX-512 doctor says which path prefill matvecs wider than 2,730 inputs take, and
    the default is the CPU's: the tiles on AMD (k3dot.h: faster there than the panels), the
    panels elsewhere; forcing either one changes what doctor says."""
    from k3engine import kernels as K
    if K.isa() != "avx512":
        pytest.skip("NOT RUN: the AVX-512 row path is not active on this CPU")
    vendor = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("vendor_id")), None) if os.path.exists("/proc/cpuinfo") else None
    if vendor is not None:
        assert K.panel_wide_tiles() == (vendor == "AuthenticAMD"), vendor
    try:
        for mode, said in ((1, "the 2 x 4 tiles"), (0, "the panels")):
            K.set_panel_wide_tiles(mode)
            rc, out = run_doctor(capsys)
            assert f"wider than {K.PANEL_WIDE_INPUTS:,} inputs: {said}" in section(out, "engine"), out
    finally:
        K.set_panel_wide_tiles(-1)
    print(f"[gate] doctor names the wide-matvec path; CPU vendor {vendor}: tiles "
          f"{K.panel_wide_tiles()}")


@pytest.mark.parametrize("available, preset", [
    (400 * GiB, "server"), (192 * GiB, "server"), (192 * GiB - 1, "workstation"),
    (96 * GiB, "workstation"), (96 * GiB - 1, "desktop"), (32 * GiB, "desktop"),
    (32 * GiB - 1, "laptop"), (10 * GiB, "laptop"), (10 * GiB - 1, None), (0, None)])
def test_doctor_preset_thresholds(available, preset):
    # Whole GB by integer division, as the reference: 10 GB minus one byte is below 10.
    assert doctor.recommend_preset(available)[0] == preset


def test_doctor_recommends_from_available_memory(capsys, monkeypatch, demo):
    probe = MemProbe(100 * GiB, True, host=100 * GiB, total=128 * GiB)
    monkeypatch.setattr(doctor, "available_memory", lambda: (probe.bytes, probe))
    model, trunk = demo
    rc, out = run_doctor(capsys, "--model", model, "--trunk", trunk)
    assert rc == 0
    mem = section(out, "memory")
    assert "MemTotal 128 GB, MemAvailable 100 GB" in mem
    assert "recommended preset: workstation" in mem
    assert "--preset workstation --prompt 'Hello'" in section(out, "result")

    small = MemProbe(6 * GiB, True, host=6 * GiB, total=8 * GiB)
    monkeypatch.setattr(doctor, "available_memory", lambda: (small.bytes, small))
    rc, out = run_doctor(capsys, "--model", model, "--trunk", trunk)
    assert rc == 0                                   # a warning, not a failure
    assert f"WARN  {doctor.FLOOR_WARNING}" in out
    # the demo model is small: the laptop preset still plans within 6 GB
    assert "--preset laptop --prompt 'Hello'" in section(out, "result")


def test_doctor_missing_shard_is_named(capsys, sharded, root):
    broken = str(root / "partial")
    shutil.copytree(sharded, broken)
    n = len(budget.shard_paths(broken))
    gone = os.path.join(broken, shard_name(broken, 2))
    os.unlink(gone)
    rc, out = run_doctor(capsys, "--model", broken)
    print(out)
    assert rc == 0
    warn = [ln for ln in section(out, "model").splitlines() if "WARN" in ln]
    assert any(gone in ln and f"1 of {n} shards missing" in ln for ln in warn), warn
    assert "cannot run yet" in section(out, "result")
    assert "next:" in section(out, "result")


def test_doctor_missing_shard_without_index(capsys, sharded, root):
    """No HF index: the -of-N names still say which file is gone, and the index of the
    shards that are present reports the layers left without tensors."""
    broken = str(root / "partial-noindex")
    shutil.copytree(sharded, broken)
    os.unlink(os.path.join(broken, "model.safetensors.index.json"))
    gone = os.path.join(broken, shard_name(broken, 3))
    os.unlink(gone)
    rc, out = run_doctor(capsys, "--model", broken)
    assert rc == 0
    model = section(out, "model")
    assert gone in model
    assert "layers are missing tensors" in model


def test_doctor_truncated_shard(capsys, tiny, root):
    broken = str(root / "truncated")
    shutil.copytree(tiny[0], broken)
    shard = os.path.join(broken, "model.safetensors")
    os.truncate(shard, os.path.getsize(shard) // 2)
    rc, out = run_doctor(capsys, "--model", broken)
    assert rc == 0
    assert re.search(rf"WARN  {re.escape(shard)}: .*impossible data_offsets",
                     section(out, "model"))


def test_doctor_trunk_of_another_model(capsys, demo, tiny):
    model, _ = demo
    _, foreign = tiny
    rc, out = run_doctor(capsys, "--model", model, "--trunk", foreign)
    print(out)
    assert rc == 0
    trunk = section(out, "trunk")
    assert "WARN" in trunk and "does not belong" in trunk and "another model" in trunk
    result = section(out, "result")
    fresh = doctor.suggested_trunk(model)
    assert f"k3 pack-trunk {shlex.quote(model)} {shlex.quote(fresh)}" in result
    assert f"--trunk {shlex.quote(fresh)} " in result


def test_doctor_flags_a_draft_trunk_given_as_the_trunk(capsys, tiny, tmp_path):
    model, _ = tiny
    draft = str(tmp_path / "draft")
    pack_trunk(model, draft, draft_bits=8)
    rc, out = run_doctor(capsys, "--model", model, "--trunk", draft)
    assert rc == 0
    trunk = section(out, "trunk")
    assert "WARN" in trunk and "8-bit draft trunk (for --draft-trunk)" in trunk
    assert "the trunk given is a draft trunk" in section(out, "result")
    assert f"k3 pack-trunk {shlex.quote(model)} " in section(out, "result")


def test_doctor_without_trunk_or_tokenizer(capsys, tiny):
    model, _ = tiny
    rc, out = run_doctor(capsys, "--model", model)
    assert rc == 0
    assert "no --trunk" in section(out, "trunk")
    assert "--ids works without one" in section(out, "tokenizer")
    q, fresh = shlex.quote, doctor.suggested_trunk(model)
    result = section(out, "result")
    assert f"k3 pack-trunk {q(model)} {q(fresh)}" in result
    assert re.search(rf"k3 {re.escape(q(model))} --trunk {re.escape(q(fresh))} --preset \w+ "
                     rf"--ids 1,2,3", result)


def test_doctor_without_model(capsys, tmp_path):
    rc, out = run_doctor(capsys, "--scratch", str(tmp_path))
    assert rc == 0
    assert "k3 make-checkpoint" in section(out, "result")
    assert scratch_files(tmp_path) == []


def test_doctor_exit_1_when_the_extension_does_not_import(capsys, monkeypatch, demo):
    # None in sys.modules makes `import k3engine.kernels` raise, as a broken build would.
    monkeypatch.setitem(sys.modules, "k3engine.kernels", None)
    model, trunk = demo
    rc, out = run_doctor(capsys, "--model", model, "--trunk", trunk)
    assert rc == 1
    assert "FAIL" in section(out, "engine")
    assert "the engine cannot run" in section(out, "result")
    assert "pip install" in section(out, "result")


def _python(code: str, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_doctor_as_a_process(demo):
    model, trunk = demo
    p = _python(RUN_MAIN.format("doctor"), "--model", model, "--trunk", trunk, *PROBE)
    assert p.returncode == 0, p.stderr
    assert "recommended preset" in p.stdout or doctor.FLOOR_WARNING in p.stdout
    assert f"k3 {shlex.quote(model)} --trunk {shlex.quote(trunk)} --tok" in p.stdout


def test_doctor_as_a_process_with_a_broken_extension(demo):
    model, trunk = demo
    p = _python(BROKEN_EXTENSION, "--model", model, "--trunk", trunk, *PROBE)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL" in p.stdout


def test_released_shard_table():
    assert sum(doctor.released_shard_bytes(k) for k in range(1, 97)) == doctor.RELEASED_TOTAL


def test_released_shard_sizes_checked(tmp_path):
    """Named like the released checkpoint: the count comes from -of-000096 and every size
    from the published table (sparse files, nothing is really written)."""
    good = tmp_path / "model-00001-of-000096.safetensors"
    bad = tmp_path / "model-00002-of-000096.safetensors"
    for p, size in ((good, doctor.released_shard_bytes(1)), (bad, 1000)):
        with open(p, "wb") as f:
            f.truncate(size)
    s = doctor.shard_set(str(tmp_path))
    assert s.released and len(s.expected) == 96 and len(s.missing) == 94
    assert s.wrong_size == [(bad.name, 1000, doctor.released_shard_bytes(2))]


@pytest.mark.parametrize("tool", ["doctor", "devbw", "budget"])
def test_help(tool, capsys):
    mod = {"doctor": doctor, "devbw": devbw, "budget": budget}[tool]
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert f"usage: k3 {tool}" in capsys.readouterr().out


# --- devbw ------------------------------------------------------------------------------

QD_ROW = re.compile(r"^  QD +(\d+): +[\d.]+ MB/s  \((\d+) reads", re.M)
SMALL = ["--block-kb", "256", "--reads", "12"]


def test_devbw_directory(capsys, tmp_path):
    rc = devbw.main([str(tmp_path), "--size-mb", "8", *SMALL])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0
    rows = QD_ROW.findall(out)
    assert [int(qd) for qd, _ in rows] == [1, 4, 16]
    assert all(int(n) > 0 for _, n in rows)
    assert "scratch file" in out
    assert scratch_files(tmp_path) == []


def test_devbw_file_is_never_written(capsys, demo):
    shard = os.path.join(demo[0], "model.safetensors")
    before = (hashlib.sha256(open(shard, "rb").read()).hexdigest(), os.stat(shard).st_mtime_ns)
    rc = devbw.main([shard, *SMALL])
    out = capsys.readouterr().out
    assert rc == 0
    assert [int(qd) for qd, _ in QD_ROW.findall(out)] == [1, 4, 16]
    assert (hashlib.sha256(open(shard, "rb").read()).hexdigest(),
            os.stat(shard).st_mtime_ns) == before
    assert scratch_files(demo[0]) == []


def test_devbw_buffered_fallback_is_flagged(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(devbw, "open_for_streaming", lambda p: (os.open(p, os.O_RDONLY), False))
    rc = devbw.main([str(tmp_path), "--size-mb", "4", *SMALL])
    out = capsys.readouterr().out
    assert rc == 0
    assert "BUFFERED" in out and "refused O_DIRECT" in out
    assert len(QD_ROW.findall(out)) == 3
    assert scratch_files(tmp_path) == []


def test_devbw_reads_stay_inside_the_file(tmp_path):
    f = tmp_path / "odd"
    f.write_bytes(os.urandom(3 * 4096 + 123))
    r = devbw.measure_file(str(f), block=8192, reads=20, seconds=30, seed=5)
    assert r.block == 8192
    assert [q.reads for q in r.results] == [20, 20, 20]    # no short read at EOF


def test_devbw_read_errors_are_reported(tmp_path):
    """A failed or short read from the native readers ends the measurement with a
    DevbwError naming it (not a count that silently includes it)."""
    f = tmp_path / "data"
    f.write_bytes(os.urandom(4 * 8192))
    with pytest.raises(devbw.DevbwError, match="read failed: Bad file descriptor"):
        devbw.measure(-1, [0, 8192], 8192, 2, 30.0)
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(devbw.DevbwError,
                           match="short read: 4096 of 8192 bytes at offset 28672"):
            devbw.measure(fd, [0, 28672], 8192, 1, 30.0)
        assert devbw.measure(fd, [0, 8192, 16384], 8192, 2, 30.0).reads == 3
    finally:
        os.close(fd)


def test_devbw_without_the_native_readers_says_so(monkeypatch):
    """A broken build: devbw (which doctor imports) still imports, and a measurement is
    refused with a message naming the missing extension, not a traceback."""
    monkeypatch.setitem(sys.modules, "k3engine.kernels._k3io", None)
    with pytest.raises(devbw.DevbwError, match="native readers .* do not load"):
        devbw.measure(0, [0], 4096, 1, 1.0)


def test_devbw_errors(capsys, tmp_path):
    tiny_file = tmp_path / "small"
    tiny_file.write_bytes(b"x" * 100)
    assert devbw.main([str(tmp_path / "absent")]) == 1
    assert devbw.main([str(tiny_file)]) == 1
    err = capsys.readouterr().err
    assert "not a file or directory" in err and "smaller than one 4096-byte block" in err


# --- budget -----------------------------------------------------------------------------

def _checkpoint_totals(model_dir: str) -> tuple[int, int, int]:
    """(tensor count, tensor bytes, routed expert bytes) from the engine's own reader and
    the naming table: the figures budget must reproduce from headers alone."""
    cfg = load_config(os.path.join(model_dir, "config.json"))
    with Checkpoint(model_dir) as ck:
        total = sum(ck.info(n).nbytes for n in ck.names())
        routed = sum(ck.info(t.name).nbytes for L in range(cfg.n_layers) if not cfg.is_dense(L)
                     for e in range(cfg.n_experts) for t in expert_tensors(cfg, L, e))
        return len(ck), total, routed


@pytest.mark.parametrize("which", ["demo", "sharded"])
def test_budget_classes_add_up(which, demo, sharded, capsys):
    model_dir = demo[0] if which == "demo" else sharded
    count, total, routed = _checkpoint_totals(model_dir)
    c = budget.census(model_dir)
    assert c.total_bytes == total and c.count == count
    assert sum(b for _, b in c.dtypes.values()) == total
    assert c.classes["routed"][1] == routed
    assert c.residency_bytes(budget.STREAMABLE) == routed
    assert c.residency_bytes(budget.RESIDENT) + routed + c.classes["unused"][1] == total
    assert c.routed_params and c.classes["routed"][1] / c.routed_params == 0.53125
    cfg = load_config(os.path.join(model_dir, "config.json"))
    assert sorted(c.mla_layers) == list(cfg.mla_layers)
    assert sorted(set(range(cfg.n_layers)) - c.routed_layers) == [0]

    assert budget.main([model_dir]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^  total +{count:,} +{total:,}$", out, re.M)
    assert re.search(rf"^  routed experts +\d[\d,]* +{routed:,} ", out, re.M)
    assert "layers without routed experts: [0]" in out


def test_budget_partial_download_and_env(sharded, root, capsys, monkeypatch):
    partial = str(root / "budget-partial")
    shutil.copytree(sharded, partial)
    os.unlink(os.path.join(partial, shard_name(partial, 1)))
    want = sum(e.nbytes for p in budget.shard_paths(partial) for e in parse_header(p)[0])
    assert budget.census(partial).total_bytes == want
    monkeypatch.setenv("K3_MODEL_DIR", partial)
    assert budget.main([]) == 0
    assert f" {want:,}\n" in capsys.readouterr().out


def test_budget_skips_a_damaged_header(sharded, root, capsys):
    damaged = str(root / "budget-damaged")
    shutil.copytree(sharded, damaged)
    n = len(budget.shard_paths(damaged))
    bad = os.path.join(damaged, shard_name(damaged, n))
    with open(bad, "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))        # header length beyond the file
    c = budget.census(damaged)
    assert [p for p, _ in c.skipped] == [bad] and len(c.shards) == n - 1
    assert budget.main([damaged]) == 0
    assert f"WARN  skipped {bad}" in capsys.readouterr().out


def test_budget_no_model(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("K3_MODEL_DIR", raising=False)
    with pytest.raises(SystemExit) as e:
        budget.main([])
    assert e.value.code == 2
    assert budget.main([str(tmp_path)]) == 1
    assert "no .safetensors files" in capsys.readouterr().err


@pytest.mark.parametrize("name, cls", [
    ("language_model.model.layers.5.block_sparse_moe.experts.7.w1.weight_packed", "routed"),
    ("language_model.model.layers.5.block_sparse_moe.shared_experts.up_proj.weight", "shared"),
    ("language_model.model.layers.5.block_sparse_moe.routed_expert_norm.weight", "latent"),
    ("language_model.model.layers.5.block_sparse_moe.gate.e_score_correction_bias", "router"),
    ("language_model.model.layers.5.self_attn.q_a_layernorm.weight", "attention"),
    ("language_model.model.layers.5.self_attn.A_log", "attention"),
    ("language_model.model.layers.5.mlp_res_proj.weight", "attnres"),
    ("language_model.model.output_attn_res_norm.weight", "attnres"),
    ("language_model.model.layers.5.post_attention_layernorm.weight", "norms"),
    ("language_model.model.norm.weight", "norms"),
    ("language_model.model.embed_tokens.weight", "embedding"),
    ("language_model.lm_head.weight", "embedding"),
    ("language_model.model.layers.0.mlp.gate_proj.weight", "text_other"),
    ("vision_tower.encoder.blocks.0.attn.qkv.weight", "unused"),
])
def test_budget_classify(name, cls):
    assert budget.classify(name) == cls
