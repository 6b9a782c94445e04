"""Issue 14: the original hostile inputs, each reproduced, each refused with the documented
exit code and a message naming the file -- through the real `k3` process where the fix is
in a format module the CLI already calls, at library level where the CLI call site is the
run API's to wire (parse_ids, read_ids_file, parse_fail_expert, History.load).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from engine_helpers import GOLDEN_SEED, make_tiny
from k3engine.chat import MAX_LINE_BYTES, ChatError, History, HistoryLock, Message
from k3engine.checkpoint import Checkpoint, CheckpointError
from k3engine.config import ConfigError, load_config
from k3engine.ids import IdsError, parse_ids, read_ids_file
from k3engine.strict_json import JSONFormatError, loads_strict
from k3engine.tokenizer import Tokenizer, TokenizerError, default_tokenizer_dir
from k3engine.statefile import StateFileError
from k3engine.trunk import TRUNK_JSON, TrunkError, TrunkManifest, pack_trunk

DEEP = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DIGITS = b'{"a": ' + b"9" * 5000 + b"}"


def k3(*args, env=None, timeout=300):
    p = subprocess.run([sys.executable, "-m", "k3engine", *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **(env or {})})
    print(f"[cli] k3 {' '.join(map(str, args))[:90]} -> exit {p.returncode}")
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Path(make_tiny(tmp_path_factory.mktemp("hostile") / "tiny", GOLDEN_SEED))


def copy_model(tiny: Path, dest: Path) -> Path:
    shutil.copytree(tiny, dest)
    return dest


def config_of(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def write_config(model: Path, doc: dict) -> None:
    (model / "config.json").write_text(json.dumps(doc))


def read_shard(path: Path) -> tuple[dict, bytes, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8:8 + n], raw[8 + n:]


def write_shard(path: Path, header: dict, data: bytes, pad_at_least: int = 0) -> None:
    hb = json.dumps(header, separators=(",", ":")).encode()
    pad = -len(hb) % 8
    while pad < pad_at_least:
        pad += 8
    hb += b" " * pad
    path.write_bytes(len(hb).to_bytes(8, "little") + hb + data)


# --- finding 2: absurd counts, FIFO and /dev/zero as config.json ---------------------------

@pytest.mark.parametrize("field,value", [("num_experts", 10**12),
                                         ("num_hidden_layers", 2**63)])
def test_absurd_counts_are_refused_up_front(tiny, tmp_path, field, value):
    m = copy_model(tiny, tmp_path / "m")
    doc = config_of(m)
    doc[field] = value
    write_config(m, doc)
    p = k3(m, "--ids", "1,2", "--gen", 1)
    assert p.returncode == 2, p.stderr
    assert str(m / "config.json") in p.stderr and field in p.stderr
    assert "meaningful range" in p.stderr


def test_absurd_count_through_config_flag(tiny, tmp_path):
    doc = config_of(tiny)
    doc["num_experts"] = 10**12
    cfg = tmp_path / "other.json"
    cfg.write_text(json.dumps(doc))
    p = k3(tiny, "--config", cfg, "--ids", "1", "--gen", 1)
    assert p.returncode == 2 and str(cfg) in p.stderr and "num_experts" in p.stderr


def test_fifo_as_config_does_not_block(tiny, tmp_path):
    m = copy_model(tiny, tmp_path / "m")
    (m / "config.json").unlink()
    os.mkfifo(m / "config.json")
    p = k3(m, "--ids", "1", "--gen", 1, timeout=120)     # a hang fails as a timeout
    assert p.returncode == 2 and "a FIFO, not a regular file" in p.stderr
    assert str(m / "config.json") in p.stderr


def test_dev_zero_as_config_is_refused(tiny, tmp_path):
    m = copy_model(tiny, tmp_path / "m")
    (m / "config.json").unlink()
    (m / "config.json").symlink_to("/dev/zero")
    p = k3(m, "--ids", "1", "--gen", 1, timeout=120)
    assert p.returncode == 2 and "a character device, not a regular file" in p.stderr


def test_dev_zero_as_tokenizer_files_ids_file_and_history(tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(default_tokenizer_dir(), tok)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        d = tmp_path / name
        shutil.copytree(tok, d)
        (d / name).unlink()
        (d / name).symlink_to("/dev/zero")
        with pytest.raises(TokenizerError, match="not a regular file"):
            Tokenizer.from_dir(d)
    with pytest.raises(IdsError, match="not a regular file"):
        read_ids_file("/dev/zero")
    with pytest.raises(ChatError, match="not a regular file"):
        History.load("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ChatError, match="a FIFO"):
        History.load(fifo)
    with pytest.raises(IdsError, match="a FIFO"):
        read_ids_file(fifo)


# --- finding 3: a state file header with absurd counts --------------------------------------

@pytest.mark.parametrize("nseq", [2**31 - 1, 300_000_000])
def test_state_header_counts_refused_before_allocation(tiny, tmp_path, nseq):
    st = tmp_path / "s.k3st"
    p = k3(tiny, "--ids", "1,2,3", "--gen", 2, "--incremental", "--save-state", st,
           "--out", tmp_path / "o.json")
    assert p.returncode == 0, p.stderr
    raw = bytearray(st.read_bytes())
    struct.pack_into("<i", raw, 4 + 4 + 48 + 12, nseq)           # the nseq field
    st.write_bytes(bytes(raw))
    p = k3(tiny, "--ids", "4", "--gen", 1, "--incremental", "--load-state", st,
           "--out", tmp_path / "o.json")
    assert p.returncode == 1 and str(st) in p.stderr and "truncated" in p.stderr


# --- finding 4: silent wrong answers -------------------------------------------------------

def test_shard_length_prefix_six_short_is_refused(tiny, tmp_path):
    m = copy_model(tiny, tmp_path / "m")
    shard = m / "model.safetensors"
    header, _, data = read_shard(shard)
    write_shard(shard, header, data, pad_at_least=6)
    assert Checkpoint(m).close() is None                    # well-formed with the padding
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[:8] = (n - 6).to_bytes(8, "little")                  # still inside the padding
    shard.write_bytes(bytes(raw))
    p = k3(m, "--ids", "1,2", "--gen", 1)
    assert p.returncode == 1 and str(shard) in p.stderr and "6 trailing bytes" in p.stderr


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("trunk") / "t"
    pack_trunk(str(tiny), str(d))
    return d


def _trunk_copy(packed: Path, dest: Path, edit) -> Path:
    shutil.copytree(packed, dest)
    doc = json.loads((dest / TRUNK_JSON).read_text())
    edit(doc)
    (dest / TRUNK_JSON).write_text(json.dumps(doc))
    return dest


def _first_tensor(doc: dict) -> dict:
    return next(iter(doc["layers"][0]["tensors"].values()))


@pytest.mark.parametrize("value", ["true", "1e-400", '"0"', "0.0", "-4096"])
def test_trunk_offsets_must_be_json_integers(packed, tmp_path, value):
    d = tmp_path / "t"
    shutil.copytree(packed, d)
    text = (d / TRUNK_JSON).read_text().replace('"file_off": 0,', f'"file_off": {value},', 1)
    assert text != (d / TRUNK_JSON).read_text()
    (d / TRUNK_JSON).write_text(text)
    with pytest.raises(TrunkError, match="file_off/nbytes") as e:
        TrunkManifest.load(str(d))
    assert str(d / TRUNK_JSON) in str(e.value)


@pytest.mark.parametrize("value", [True, 1e-400, "0", 0.0])
def test_tensor_offsets_must_be_json_integers(packed, tmp_path, value):
    def edit(doc):
        _first_tensor(doc)["off"] = value
    d = _trunk_copy(packed, tmp_path / "t", edit)
    with pytest.raises(TrunkError, match="entry is malformed"):
        TrunkManifest.load(str(d))


def test_overlapping_tensors_in_a_run_are_refused(tiny, packed, tmp_path):
    def edit(doc):
        ts = list(doc["layers"][1]["tensors"].values())
        a, b = sorted(ts, key=lambda t: t["off"])[:2]
        b["off"] = a["off"]                               # b now reads a's bytes
        if b["nbytes"] > doc["layers"][1]["nbytes"]:
            pytest.skip("layout too small")
    d = _trunk_copy(packed, tmp_path / "t", edit)
    with pytest.raises(TrunkError, match="overlaps"):
        TrunkManifest.load(str(d))
    p = k3(tiny, "--trunk", d, "--ids", "1,2", "--gen", 1)
    assert p.returncode == 1 and "overlaps" in p.stderr and str(d / TRUNK_JSON) in p.stderr


@pytest.mark.parametrize("shape", ["Infinity", str(2**64), "[1]", "-1", "true"])
def test_hostile_trunk_shapes_are_refused(packed, tmp_path, shape):
    d = tmp_path / "t"
    shutil.copytree(packed, d)
    doc = json.loads((d / TRUNK_JSON).read_text())
    first = _first_tensor(doc)
    old = json.dumps(first)
    first_shape = json.dumps(first["shape"])
    text = (d / TRUNK_JSON).read_text().replace(
        old, old.replace(f'"shape": {first_shape}', f'"shape": [{shape}, 1]'), 1)
    (d / TRUNK_JSON).write_text(text)
    with pytest.raises(TrunkError) as e:
        TrunkManifest.load(str(d))
    assert str(d / TRUNK_JSON) in str(e.value)


def test_tiktoken_model_cut_at_a_line_boundary_is_refused(tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(default_tokenizer_dir(), d)
    lines = (d / "tiktoken.model").read_bytes().splitlines(keepends=True)
    (d / "tiktoken.model").write_bytes(b"".join(lines[:-100]))     # a clean cut
    with pytest.raises(TokenizerError, match="cut or belongs to another vocabulary") as e:
        Tokenizer.from_dir(d)
    assert str(d / "tiktoken.model") in str(e.value)


@pytest.mark.parametrize("text", ["\u0661,\u0662", "\u00b2", "\u2460", "1,\uff12", "1\u00a02",
                                  "9" * 11, "-1", "0x10", "1e3", ""])
def test_ids_are_ascii_decimal(text):
    with pytest.raises(IdsError):
        parse_ids(text, "--ids")


def test_ids_file_non_utf8_and_unicode_digits(tmp_path):
    f = tmp_path / "ids.txt"
    for data in (b"1,2,\xff", "\u0661,\u0662".encode(), b"1,2\x00"):
        f.write_bytes(data)
        with pytest.raises(IdsError) as e:
            read_ids_file(f)
        assert str(f) in str(e.value)
    f.write_bytes(b" 1, 2\n3\r\n")
    assert read_ids_file(f) == [1, 2, 3]


@pytest.mark.parametrize("field,value", [
    ("rms_norm_eps", -1.0), ("rms_norm_eps", 0.0), ("rms_norm_eps", 9.2e18),
    ("routed_scaling_factor", 0.0), ("attn_res_block_size", 2**31),
    ("gate_lower_bound", 5.0), ("situ_beta", -4.0), ("first_k_dense_replace", 99),
    ("num_shared_experts", 10**6), ("vocab_size", 2**40)])
def test_config_values_outside_their_range(tiny, tmp_path, field, value):
    doc = config_of(tiny)
    doc[field] = value
    p = tmp_path / "config.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and field.replace("situ_beta", "activation_situ_beta") in msg
    assert "range" in msg or "must be" in msg


# --- finding 5: tracebacks instead of refusals ---------------------------------------------

@pytest.mark.parametrize("blob", [DEEP, DIGITS, b'{"a": NaN}', b'{"a": "\\ud800"}',
                                  b'{"a": 1, "a": 2}', b'\xef\xbb\xbf{}', b'{"a": 1e999999}',
                                  b'{"a": -1e400}', b'{"a": "\xff"}'])
def test_strict_json_refuses(blob):
    with pytest.raises(JSONFormatError) as e:
        loads_strict(blob, "/some/file.json")
    assert "/some/file.json" in str(e.value)


@pytest.mark.parametrize("blob", [DEEP, DIGITS], ids=["nested_1e5", "digits_5000"])
def test_every_json_file_refuses_deep_nesting_and_huge_integers(tiny, packed, tmp_path, blob):
    m = copy_model(tiny, tmp_path / "m")
    (m / "config.json").write_bytes(blob)
    with pytest.raises(ConfigError):
        load_config(m / "config.json")
    m2 = copy_model(tiny, tmp_path / "m2")
    (m2 / "model.safetensors.index.json").write_bytes(blob)
    with pytest.raises(CheckpointError, match="not a usable shard index"):
        Checkpoint(m2)
    t = tmp_path / "t"
    shutil.copytree(packed, t)
    (t / TRUNK_JSON).write_bytes(blob)
    with pytest.raises(TrunkError, match="not valid JSON"):
        TrunkManifest.load(str(t))
    tok = tmp_path / "tok"
    shutil.copytree(default_tokenizer_dir(), tok)
    (tok / "tokenizer_config.json").write_bytes(blob)
    with pytest.raises(TokenizerError, match="invalid JSON"):
        Tokenizer.from_dir(tok)


def test_lone_surrogate_in_an_added_token(tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(default_tokenizer_dir(), tok)
    p = tok / "tokenizer_config.json"
    text = p.read_text()
    doc = json.loads(text)
    key = sorted(doc["added_tokens_decoder"], key=int)[-1]
    content = doc["added_tokens_decoder"][key]["content"]
    p.write_text(text.replace(json.dumps(content), '"<|x\\udc80|>"', 1))
    with pytest.raises(TokenizerError, match="lone surrogate"):
        Tokenizer.from_dir(tok)


@pytest.mark.parametrize("spec", ["abc", "1", "1,2,3", "-1,2", "\u0661,\u0662", "\u00b2,1"])
def test_fail_expert_spec_is_a_usage_error(tiny, spec):
    p = k3(tiny, "--ids", "1,2", "--gen", 1, env={"K3_FAIL_EXPERT": spec})
    assert p.returncode == 2 and "K3_FAIL_EXPERT" in p.stderr


def test_pack_trunk_unwritable_targets(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = subprocess.run([sys.executable, "-m", "k3engine", "pack-trunk", str(tiny),
                        str(blocker / "sub")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "cannot write" in p.stderr and "Traceback" not in p.stderr
    # a full disk: the partial file is /dev/full (ENOSPC on the first write).  A link planted
    # at the partial name is no longer followed (issue 47), so the opener is swapped instead.
    code = ("import os, sys; from k3engine.tools import pack_trunk as t;"
            "from k3engine import trunk;"
            "trunk.open_nofollow = lambda *a, **k: os.open('/dev/full', os.O_WRONLY);"
            "sys.exit(t.main(sys.argv[1:]))")
    full = tmp_path / "full"
    p = subprocess.run([sys.executable, "-c", code, str(tiny), str(full)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    assert "No space left on device" in p.stderr and "Traceback" not in p.stderr
    assert not (full / "trunk.json").exists()


# --- finding 7: user data ------------------------------------------------------------------

def test_a_17_mib_line_is_never_added_or_saved(tmp_path):
    p = tmp_path / "h.jsonl"
    h = History([Message("user", "hello")])
    h.save(p)
    with pytest.raises(ChatError, match="at most 16 MiB"):
        h.add(Message("assistant", "x" * (17 << 20)))
    assert History.load(p) == h
    # a history built around add() (e.g. by a caller's own list) is still refused at save
    big = History()
    big._messages.append(Message("user", "x" * MAX_LINE_BYTES))
    with pytest.raises(ChatError, match=f"^{p}: cannot save history: record 1"):
        big.save(p)
    assert History.load(p) == h                           # untouched, still loads


def test_history_lock_refuses_a_second_writer(tmp_path):
    p = tmp_path / "h.jsonl"
    code = ("import sys, time; from k3engine.chat import HistoryLock;"
            "l = HistoryLock(sys.argv[1]); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(p)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ChatError, match=rf"in use by another k3 chat \(process {holder.pid}\)"):
            HistoryLock(p)
    finally:
        holder.kill()
        holder.wait()
    with HistoryLock(p):                                   # a dead holder leaves no lock
        with pytest.raises(ChatError, match="in use"):
            HistoryLock(p)                                 # one process, two lockers too
    HistoryLock(p).release()


def test_private_modes(tmp_path):
    from k3engine.atomic import open_private, write_atomic
    old = os.umask(0o022)
    try:
        write_atomic(str(tmp_path / "out.json"), b"{}\n")
        History([Message("user", "secret")]).save(tmp_path / "h.jsonl")
        with open_private(str(tmp_path / "events.jsonl")) as f:
            f.write("{}\n")
        (tmp_path / "pre.jsonl").write_text("")
        (tmp_path / "pre.jsonl").chmod(0o644)
        with open_private(str(tmp_path / "pre.jsonl")) as f:
            f.write("{}\n")
    finally:
        os.umask(old)
    for n in ("out.json", "h.jsonl", "events.jsonl", "pre.jsonl"):
        assert stat.S_IMODE((tmp_path / n).stat().st_mode) == 0o600, n


def test_stale_atomic_temp_is_removed_by_the_next_save(tmp_path):
    from k3engine.atomic import write_atomic
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".out.json.tmp-{dead}"
    stale.write_bytes(b"half")
    write_atomic(str(tmp_path / "out.json"), b"{}\n")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.json"]


def test_stale_pack_partials_are_removed_and_reported(tiny, tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (d / f"trunk.bin.partial-{dead}").write_bytes(b"\0" * 4096)
    p = subprocess.run([sys.executable, "-m", "k3engine", "pack-trunk", str(tiny), str(d)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"removed trunk.bin.partial-{dead}, left by an interrupted pack-trunk" in p.stdout
    assert sorted(x.name for x in d.iterdir()) == ["trunk.bin", "trunk.json"]


# kill -9 at each point of a re-pack: os._exit() from inside the packer skips every
# cleanup, as SIGKILL does.  After each, the directory must hold a usable trunk whose
# bytes are those its trunk.json describes (checked by the per-layer digests).
KILL_POINTS = ["mid_bin", "bin_complete", "json_written", "bin_renamed", "json_renamed"]


def _repack_killed_at(model: Path, trunk: Path, point: str) -> subprocess.CompletedProcess:
    code = f"""
import os, sys
from k3engine import atomic as A, trunk as T
point = {point!r}
real_replace, real_dump = os.replace, A.json.dump     # the publish (atomic.publish_with_manifest)
def replace(a, b):
    real_replace(a, b)
    if point == "bin_renamed" and b.endswith("trunk.bin"): os._exit(9)
    if point == "json_renamed" and b.endswith("trunk.json"): os._exit(9)
def dump(obj, f):
    if point == "bin_complete": os._exit(9)
    real_dump(obj, f); f.flush()
    if point == "json_written": os._exit(9)
def progress(L, done, total):
    if point == "mid_bin" and L == 3: os._exit(9)
A.os.replace = replace
A.json.dump = dump
T.pack_trunk(sys.argv[1], sys.argv[2], progress=progress)
"""
    return subprocess.run([sys.executable, "-c", code, str(model), str(trunk)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_during_repack_keeps_a_usable_trunk(tiny, packed, tmp_path, point):
    from k3engine.integrity import verify_trunk
    d = tmp_path / "t"
    shutil.copytree(packed, d)
    p = _repack_killed_at(tiny, d, point)
    assert p.returncode == 9, p.stderr
    m = TrunkManifest.load(str(d))                          # usable: loads ...
    assert len(m.layers) == len(TrunkManifest.load(str(packed)).layers)
    assert verify_trunk(str(d), lambda *a: None) == []      # ... and reads the bytes it describes
    p = k3(tiny, "--trunk", d, "--ids", "1,2", "--gen", 1)
    assert p.returncode == 0, p.stderr


# --- finding 8: one expert's tensor transposed ---------------------------------------------

def test_transposed_expert_tensor_is_found_up_front(tiny, tmp_path):
    m = copy_model(tiny, tmp_path / "m")
    shard = m / "model.safetensors"
    header, _, data = read_shard(shard)
    name = next(n for n in header if ".experts.5.w1.weight_packed" in n and ".layers.7." in n)
    header[name]["shape"] = header[name]["shape"][::-1]
    write_shard(shard, header, data)
    p = k3(m, "--ids", "1,2,3", "--gen", 3)
    assert p.returncode == 1, p.stdout + p.stderr
    assert name in p.stderr and str(shard) in p.stderr
    assert "generated ids" not in p.stdout                   # refused before the first step


# --- integrity: k3 doctor --verify finds a flipped bit, naming the layer or shard ----------

def _doctor_verify(*args):
    p = subprocess.run([sys.executable, "-m", "k3engine", "doctor", "--probe-mb", "0",
                        "--verify", *map(str, args)], capture_output=True, text=True, timeout=300)
    print(f"[cli] k3 doctor --verify {' '.join(map(str, args))[:70]} -> exit {p.returncode}")
    assert "Traceback" not in p.stdout + p.stderr
    return p


def test_doctor_verify_clean_trunk_and_shards(tiny, packed):
    p = _doctor_verify("--model", tiny, "--trunk", packed)
    assert p.returncode == 0, p.stdout
    n = len(TrunkManifest.load(str(packed)).layers)
    assert f"trunk: {n} of {n} layers verified" in p.stdout
    assert "shards: 1 of 1 verified against" in p.stdout and "model.sha256" in p.stdout


def test_doctor_verify_names_a_flipped_bit_in_trunk_bin(tiny, packed, tmp_path):
    d = tmp_path / "t"
    shutil.copytree(packed, d)
    m = TrunkManifest.load(str(d))
    L = 7
    at = m.layers[L].file_off + m.layers[L].nbytes // 3
    raw = bytearray((d / "trunk.bin").read_bytes())
    raw[at] ^= 0x10
    (d / "trunk.bin").write_bytes(bytes(raw))
    TrunkManifest.load(str(d))                      # the format cannot tell
    p = _doctor_verify("--trunk", d)
    assert p.returncode == 1
    assert f"BAD  layer {L} ({L + 1} of {len(m.layers)}," in p.stdout
    assert f"{d / 'trunk.bin'}: layer {L} (bytes" in p.stdout
    assert p.stdout.count("BAD ") == 1


def test_doctor_verify_names_a_flipped_bit_in_a_shard(tiny, tmp_path):
    m = copy_model(tiny, tmp_path / "m")
    shard = m / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    Checkpoint(m).close()                           # the format cannot tell
    p = _doctor_verify("--model", m)
    assert p.returncode == 1
    assert f"{shard} does not match its recorded SHA-256" in p.stdout
    assert "BAD  shard model.safetensors (1 of 1," in p.stdout


def test_doctor_verify_uses_the_download_manifest(tiny, tmp_path):
    import hashlib
    m = copy_model(tiny, tmp_path / "m")
    (m / "model.sha256").unlink()
    shard = m / "model.safetensors"
    (m / ".k3-download").mkdir()
    (m / ".k3-download" / "manifest.json").write_text(json.dumps({
        "repo": "x/y", "commit": "0" * 40, "endpoint": "http://127.0.0.1",
        "files": [{"name": shard.name, "size": shard.stat().st_size,
                   "sha256": hashlib.sha256(b"other bytes").hexdigest(), "git_oid": None}]}))
    p = _doctor_verify("--model", m)
    assert p.returncode == 1 and "manifest.json" in p.stdout and str(shard) in p.stdout


def test_doctor_reports_leftovers(tiny, packed, tmp_path):
    d = tmp_path / "t"
    shutil.copytree(packed, d)
    (d / "trunk.bin.partial-999999").write_bytes(b"\0" * 8192)
    p = subprocess.run([sys.executable, "-m", "k3engine", "doctor", "--probe-mb", "0",
                        "--trunk", str(d)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0
    assert f"{d / 'trunk.bin.partial-999999'}: 8.0 KiB" in p.stdout or \
        f"{d / 'trunk.bin.partial-999999'}:" in p.stdout


def test_stale_shard_temp_is_removed_by_the_next_write(tmp_path):
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    tmp_path.joinpath("m").mkdir()
    stale = tmp_path / "m" / f"model.safetensors.tmp-{dead}"
    stale.write_bytes(b"\0" * 4096)                      # what a killed generator leaves
    make_checkpoint(str(tmp_path / "m"), dims_config("tiny"), seed=1)
    assert not stale.exists()


def test_saves_never_replace_a_device_or_follow_a_link_away(tmp_path):
    """Run as root, `--save-state /dev/full` replaced the device node with a regular file and
    exited 0; every atomic save refuses a non-regular target and writes through a link."""
    from k3engine.atomic import write_atomic
    from k3engine.statefile import save_state
    from k3engine.state import SequenceState
    from k3engine.tools.make_checkpoint import dims_config
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (fifo, tmp_path):                 # a FIFO, a directory
        with pytest.raises(OSError, match="not a regular file"):
            write_atomic(str(target), b"x")
        with pytest.raises(ChatError, match="not a regular file"):
            History([Message("user", "x")]).save(target)
        with pytest.raises(StateFileError, match="not a regular file"):
            save_state(target, SequenceState(dims_config("tiny"), 4, 2), [1])
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    real = tmp_path / "real.jsonl"
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    History([Message("user", "x")]).save(link)
    assert link.is_symlink() and History.load(real) == History([Message("user", "x")])
