"""Safetensors reader (SYSTEM §1, §12.4): fixtures read exactly, hostile headers refused."""
from __future__ import annotations

import json
import os
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from k3engine import checkpoint as ckmod
from k3engine.checkpoint import (Checkpoint, CheckpointError, PartialCheckpointError,
                                 TensorInfo, parse_header, require_tensors, widen_bf16)

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("K3_SHARED", REPO.parent / "shared"))
PEER = SHARED / "fixtures" / "peer"
SHARD = "model-00001-of-00001.safetensors"


def _fixture_dir(name: str) -> Path:
    d = PEER / name
    if not d.is_dir():
        pytest.skip(f"shared fixtures not found at {d}")
    return d


# ---------------------------------------------------------------------------------------
# An independent reading: plain json + plain file reads, nothing from the module.

def _independent(path: Path) -> dict[str, tuple[dict, bytes]]:
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    base = 8 + n
    header = json.loads(blob[8:base])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        s, t = e["data_offsets"]
        out[name] = (dict(e, offset=base + s), blob[base + s:base + t])
    return out


_NP = {"F32": "<f4", "BF16": "<u2", "F16": "<f2", "U8": "u1"}


def _expected_f32_bits(dtype: str, raw: bytes) -> np.ndarray:
    if dtype == "F32":
        return np.frombuffer(raw, "<u4")
    if dtype == "BF16":
        return np.frombuffer(raw, "<u2").astype(np.uint32) << 16
    if dtype == "F16":
        return np.frombuffer(raw, "<f2").astype(np.float32).view(np.uint32)
    return np.frombuffer(raw, "u1").astype(np.float32).view(np.uint32)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint32)


def test_st_fixture_index_and_reads_match_independent_reading():
    d = _fixture_dir("st")
    shards = sorted(d.glob("*.safetensors"))
    with Checkpoint(d) as ck:
        assert ck.shards == [str(p) for p in shards]
        assert ck.notes == []
        expected = {}
        for shard, p in enumerate(shards):
            for name, (e, raw) in _independent(p).items():
                expected[name] = (shard, p, e, raw)
        assert sorted(ck.names()) == sorted(expected)
        assert len(ck) == len(expected) == 13
        assert "__metadata__" not in ck
        assert 'weird\\name."with"quotes' in ck
        for name, (shard, p, e, raw) in expected.items():
            info = ck.info(name)
            assert info == TensorInfo(name, e["dtype"], tuple(e["shape"]), shard, str(p),
                                      e["offset"], len(raw))
            a = ck.read(name)
            assert a.dtype == np.dtype(_NP[e["dtype"]]) and a.shape == tuple(e["shape"])
            assert a.tobytes() == raw
            f = ck.read_f32(name)
            assert f.dtype == np.float32 and f.shape == tuple(e["shape"])
            assert np.array_equal(_bits(f), _expected_f32_bits(e["dtype"], raw)), name
            buf = np.empty(len(raw), np.uint8)
            assert ck.read_into(name, buf) is buf and buf.tobytes() == raw


def test_st_fixture_special_tensors():
    with Checkpoint(_fixture_dir("st")) as ck:
        bf = ck.read("plain.bf16.1d")
        assert bf.dtype == np.uint16                     # bit patterns, never converted
        # The fixture's non-finite and edge patterns survive widening bit for bit.
        assert {0x7F80, 0xFF80, 0x7FC0, 0x8000, 0x0080} <= set(bf.tolist())
        wide = ck.read_f32("plain.bf16.1d")
        assert np.array_equal(_bits(wide), (bf.astype(np.uint32) << 16))
        assert np.array_equal(_bits(widen_bf16(bf)), _bits(wide))
        h = ck.read("tricky.f16.1d")
        assert h.dtype == np.float16 and h.size == 64
        assert np.array_equal(_bits(ck.read_f32("tricky.f16.1d")), _bits(h.astype(np.float32)))
        assert np.isinf(h).sum() == 2 and np.isnan(h).sum() == 1
        assert ck.read("scalar.f32").shape == () and ck.read_f32("scalar.f32").shape == ()
        assert ck.read("empty.f32").shape == (0, 8) and ck.read_f32("empty.f32").shape == (0, 8)
        assert ck.info("second.shard.u8").shard == 1
        assert ck.read("second.shard.u8").shape == (300,)
        assert ck.read("rank4.u8").shape == (2, 2, 2, 2)
        with pytest.raises(CheckpointError, match=r"missing tensor nope in .*st"):
            ck.info("nope")


def test_cache_fixture_byte_exact():
    d = _fixture_dir("cache")
    expected = _independent(d / SHARD)
    with Checkpoint(d) as ck:
        assert len(ck) == len(expected) == 144
        for name, (e, raw) in expected.items():
            assert ck.info(name).offset == e["offset"]
            assert ck.read(name).tobytes() == raw


# ---------------------------------------------------------------------------------------
# A small writer for generated checkpoints.

def _st_bytes(header, data: bytes) -> bytes:
    """header: dict (serialised with json), or str / bytes used verbatim (malformed JSON)."""
    raw = header if isinstance(header, bytes) else (
        header if isinstance(header, str) else json.dumps(header)).encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw + data


def _valid() -> tuple[dict, bytes]:
    data = (np.array([1.5, -2.0], "<f4").tobytes()                 # a  [0, 8)
            + np.array([0x3F80, 0x7FC0, 0xFF80], "<u2").tobytes()  # b  [8, 14)
            + bytes([1, 2, 3, 4]))                                   # c  [14, 18)
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "BF16", "shape": [3], "data_offsets": [8, 14]},
        "c": {"dtype": "U8", "shape": [2, 2], "data_offsets": [14, 18]},
    }
    return header, data


def _write(dirpath: Path, blob: bytes, name: str = SHARD) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    p = dirpath / name
    p.write_bytes(blob)
    return p


def _mutant(fn):
    header, data = _valid()
    out = fn(header, data)
    return out if isinstance(out, bytes) else _st_bytes(*out)


def _set(name, **fields):
    def fn(h, d):
        h[name].update(fields)
        return h, d
    return fn


def _header_len(blob: bytes) -> int:
    return struct.unpack("<Q", blob[:8])[0]


_VALID_BLOB = _st_bytes(*_valid())
_C_ALONE = {"dtype": "U8", "shape": [2, 2], "data_offsets": [0, 4]}   # c, in a file of its own
_N = _header_len(_VALID_BLOB)

# id -> (blob, expected problem text, tensor named in the message or None)
HOSTILE = {
    "four_byte_file": (b"\x01\x00\x00\x00", "too short for a header length", None),
    "header_length_all_ones": (b"\xff" * 8 + _VALID_BLOB[8:],
                               f"header length {2**64 - 1} is impossible (file "
                               f"{len(_VALID_BLOB)} bytes)", None),
    "header_length_zero": (b"\0" * 8 + _VALID_BLOB[8:], "header length 0 is impossible", None),
    "brace_to_bracket": (_VALID_BLOB[:8] + b"[" + _VALID_BLOB[9:],
                         "header is not a JSON object", None),
    "truncated_json": (_st_bytes(json.dumps(_valid()[0])[:-7], _valid()[1]),
                       "header is not a JSON object (unexpected end of JSON", None),
    "missing_comma": (_st_bytes('{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
                                ' "b": {}}', b"x"), "expected ','", None),
    "non_utf8_header": (_st_bytes(b'{"a\xff": 1}', b""), "invalid UTF-8 at byte 3", None),
    "deeply_nested_metadata": (
        _st_bytes('{"__metadata__": ' + "[" * 200000 + "]" * 200000 + "}", b""),
        "header is not a JSON object (RecursionError", None),
    "integer_literal_over_digit_limit": (_st_bytes(
        '{"a": {"dtype": "U8", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 1]}}', b"x"),
        "header is not a JSON object (integer literal of 5000 digits", None),
    # found by the differential fuzzer: a JSON object where a list belongs (kept as a
    # pairs list internally) was read as an empty shape, i.e. a scalar
    "shape_is_an_object": (_mutant(lambda h, d: ({**h, "c": {**h["c"], "shape": {}}}, d)),
                           "c has impossible shape", "c"),
    "entry_not_object": (_mutant(lambda h, d: ({**h, "a": [0, 8]}, d)),
                         "entry is not an object", "a"),
    "missing_dtype": (_mutant(lambda h, d: ({**h, "a": {"shape": [2], "data_offsets": [0, 8]}},
                                            d)), "a is missing dtype or data_offsets", "a"),
    "missing_offsets": (_mutant(lambda h, d: ({**h, "a": {"dtype": "F32", "shape": [2]}}, d)),
                        "a is missing dtype or data_offsets", "a"),
    "dtype_i64": (_mutant(_set("a", dtype="I64", shape=[1])), "unsupported dtype 'I64' on a",
                  "a"),
    "missing_shape": (_mutant(lambda h, d: ({**h, "a": {"dtype": "F32", "data_offsets": [0, 8]}},
                                            d)), "a is missing shape", "a"),
    "rank_5": (_mutant(_set("a", shape=[1, 1, 1, 1, 2])), "a has rank > 4", "a"),
    "negative_dim": (_mutant(_set("a", shape=[-2])), "a has impossible shape [-2]", "a"),
    "float_dim": (_mutant(_set("a", shape=[2.0])), "a has impossible shape [2.0]", "a"),
    "bool_offsets": (_mutant(_set("a", data_offsets=[False, 8])),
                     "a has impossible data_offsets", "a"),
    "huge_dims": (_mutant(_set("a", shape=[2**62, 4])), "a shape is impossibly large", "a"),
    "huge_dims_past_2_64": (_mutant(_set("a", shape=[2**64 + 2, 2**63])),
                            "a shape is impossibly large", "a"),
    "end_before_start": (_mutant(_set("a", data_offsets=[8, 0])),
                         "a has impossible data_offsets", "a"),
    "negative_start": (_mutant(_set("a", data_offsets=[-8, 0])),
                       "a has impossible data_offsets", "a"),
    "end_beyond_data": (_mutant(_set("c", data_offsets=[14, 10**6])),
                        "c has impossible data_offsets", "c"),
    "offset_past_int64": (_mutant(_set("c", data_offsets=[14, 2**64 + 14])),
                          "c has impossible data_offsets", "c"),
    "span_shape_mismatch": (_mutant(_set("a", shape=[3])),
                            "a spans 8 bytes but shape implies 12", "a"),
    "overlap": (_mutant(_set("b", shape=[3], data_offsets=[4, 10])),
                "b [4,10) overlaps a [0,8)", "b"),
    "gap_between_spans": (_mutant(lambda h, d: (
        {**h, "b": {**h["b"], "data_offsets": [10, 16]},
         "c": {**h["c"], "data_offsets": [16, 20]}}, d[:8] + b"\0\0" + d[8:])),
        "2 bytes at offset 8 belong to no tensor (gap before b)", "b"),
    "first_span_not_at_0": (_mutant(lambda h, d: (
        {**h, "a": {**h["a"], "data_offsets": [2, 10]}, "b": {**h["b"], "data_offsets": [10, 16]},
         "c": {**h["c"], "data_offsets": [16, 20]}}, b"\0\0" + d)),
        "2 bytes at offset 0 belong to no tensor (gap before a)", "a"),
    "duplicate_name_in_header": (_st_bytes(
        '{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
        '"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', b"xy"),
        "duplicate tensor name a", "a"),
    "name_longer_than_511_bytes": (_mutant(lambda h, d: ({**h, "n" * 512: h.pop("a")}, d)),
                                   "is longer than 511 bytes", "n" * 60),
    "data_truncated_after_header": (_VALID_BLOB[:8 + _N + 5], "has impossible data_offsets",
                                    "a"),
    "data_truncated_to_zero": (_VALID_BLOB[:8 + _N], "a has impossible data_offsets", "a"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_header_refused(tmp_path, case):
    blob, problem, tensor = HOSTILE[case]
    path = _write(tmp_path / "m", blob)
    with pytest.raises(CheckpointError) as exc:
        Checkpoint(tmp_path / "m")
    msg = str(exc.value)
    assert str(path) in msg and problem in msg, msg
    if tensor is not None:
        assert tensor in msg, msg
    with pytest.raises(CheckpointError, match="^" + str(path).replace("\\", "\\\\")):
        parse_header(path)


def test_control_copy_opens(tmp_path):
    header, data = _valid()
    _write(tmp_path / "m", _st_bytes(header, data))
    with Checkpoint(tmp_path / "m") as ck:
        assert ck.names() == ["a", "b", "c"] and ck.notes == []
        assert ck.read("a").tolist() == [1.5, -2.0]
        assert ck.read("b").tolist() == [0x3F80, 0x7FC0, 0xFF80]
        assert ck.read("c").tolist() == [[1, 2], [3, 4]]
    entries, notes = parse_header(tmp_path / "m" / SHARD)
    assert [e.name for e in entries] == ["a", "b", "c"] and notes == []
    assert entries[0].offset == 8 + _N and entries[2].nbytes == 4


def test_header_length_over_cap_refused(tmp_path):
    # Sparse file, so N <= filesize - 8 and only the 256 MiB cap stops it.
    p = tmp_path / "m" / SHARD
    p.parent.mkdir()
    n = ckmod.HEADER_MAX + 1
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", n) + b"{")
        f.truncate(8 + n + 16)
    with pytest.raises(CheckpointError, match=f"header length {n} is impossible.*capped"):
        Checkpoint(p.parent)


def test_zero_length_tensor_in_the_middle_opens(tmp_path):
    header, data = _valid()
    header["z"] = {"dtype": "F32", "shape": [0, 4], "data_offsets": [8, 8]}
    header["z2"] = {"dtype": "BF16", "shape": [0], "data_offsets": [8, 8]}
    header["z_end"] = {"dtype": "U8", "shape": [3, 0], "data_offsets": [18, 18]}
    _write(tmp_path / "m", _st_bytes(header, data))
    with Checkpoint(tmp_path / "m") as ck:
        assert ck.read("z").shape == (0, 4) and ck.read_f32("z2").shape == (0,)
        assert ck.read("z_end").shape == (3, 0)
        assert ck.read("b").tolist() == [0x3F80, 0x7FC0, 0xFF80]


def test_zero_length_tensor_inside_another_span_is_an_overlap(tmp_path):
    header, data = _valid()
    header["z"] = {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}
    p = _write(tmp_path / "m", _st_bytes(header, data))
    with pytest.raises(CheckpointError, match=r"z \[4,4\) overlaps a \[0,8\)") as exc:
        Checkpoint(p.parent)
    assert str(p) in str(exc.value)


def test_trailing_bytes_are_refused(tmp_path):
    # Stricter than SYSTEM §1.4 #14 (a note there), as strict as the safetensors library:
    # trailing bytes are what a header length prefix a few bytes short leaves (issue 14).
    header, data = _valid()
    p = _write(tmp_path / "m", _st_bytes(header, data + b"xyz"))
    with pytest.raises(CheckpointError, match="3 trailing bytes after the last tensor") as exc:
        Checkpoint(tmp_path / "m")
    assert str(p) in str(exc.value)


def test_name_of_511_bytes_is_accepted(tmp_path):
    header, data = _valid()
    header["n" * 511] = header.pop("a")
    _write(tmp_path / "m", _st_bytes(header, data))
    with Checkpoint(tmp_path / "m") as ck:
        assert ck.read("n" * 511).tolist() == [1.5, -2.0]


def test_duplicate_name_across_shards(tmp_path):
    header, data = _valid()
    p1 = _write(tmp_path / "m", _st_bytes(header, data), "model-00001-of-00002.safetensors")
    other = {"c": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    p2 = _write(tmp_path / "m", _st_bytes(other, b"q"), "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="duplicate tensor name c") as exc:
        Checkpoint(tmp_path / "m")
    assert str(p1) in str(exc.value) and str(p2) in str(exc.value)


def test_shards_are_sorted_bytewise(tmp_path):
    header, data = _valid()
    for i, fname in enumerate(["b.safetensors", "B.safetensors", "a.safetensors"]):
        _write(tmp_path / "m", _st_bytes({f"t{i}": _C_ALONE}, data[14:]), fname)
    (tmp_path / "m" / "notes.txt").write_text("ignored")
    with Checkpoint(tmp_path / "m") as ck:
        assert [Path(s).name for s in ck.shards] == ["B.safetensors", "a.safetensors",
                                                     "b.safetensors"]
        assert [ck.info(f"t{i}").shard for i in range(3)] == [2, 0, 1]


def test_read_after_truncation_is_a_short_read(tmp_path):
    header, data = _valid()
    p = _write(tmp_path / "m", _st_bytes(header, data))
    with Checkpoint(tmp_path / "m") as ck:
        assert ck.read("a").tolist() == [1.5, -2.0]
        os.truncate(p, 8 + _N + 16)                       # c is [14, 18): 2 of 4 bytes left
        for call in (ck.read, ck.read_f32, lambda n: ck.read_into(n, np.empty(4, np.uint8))):
            with pytest.raises(CheckpointError) as exc:
                call("c")
            assert str(exc.value) == f"{p}: short read of c: got 2 of 4 bytes"
        os.truncate(p, 8 + _N)
        with pytest.raises(CheckpointError, match="short read of a: got 0 of 8 bytes"):
            ck.read_f32("a")


def test_read_into_checks_the_buffer(tmp_path):
    header, data = _valid()
    _write(tmp_path / "m", _st_bytes(header, data))
    with Checkpoint(tmp_path / "m") as ck:
        out = np.empty(2, np.float32)
        assert ck.read_into("a", out).tolist() == [1.5, -2.0]
        for bad in (np.empty(3, np.float32), np.empty(4, np.float32)[::2],
                    np.frombuffer(bytes(8), np.uint8)):
            with pytest.raises(ValueError, match="read_into a"):
                ck.read_into("a", bad)


def test_closed_checkpoint_refuses_reads(tmp_path):
    _write(tmp_path / "m", _VALID_BLOB)
    ck = Checkpoint(tmp_path / "m")
    ck.close()
    ck.close()
    with pytest.raises(CheckpointError, match="closed"):
        ck.read("a")


# ---------------------------------------------------------------------------------------
# Widening

def test_f16_widening_keeps_subnormals_inf_and_nan_payloads(tmp_path):
    bits = np.array([0x0001, 0x03FF, 0x8001, 0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFE3F, 0x3C00],
                    "<u2")
    hdr = {"h": {"dtype": "F16", "shape": [9], "data_offsets": [0, 18]}}
    _write(tmp_path / "m", _st_bytes(hdr, bits.tobytes()))
    with Checkpoint(tmp_path / "m") as ck:
        got = _bits(ck.read_f32("h")).tolist()
    # IEEE half -> single by hand: subnormals renormalised, NaN payload shifted by 13.
    assert got == [0x33800000, 0x387FC000, 0xB3800000, 0x7F800000, 0xFF800000,
                   0x7F802000, 0x7FC00000, 0xFFC7E000, 0x3F800000]


def test_widen_bf16_is_a_shift():
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    assert np.array_equal(_bits(widen_bf16(bits)), bits.astype(np.uint32) << 16)
    assert widen_bf16(np.uint16(0x3F80)).item() == 1.0
    with pytest.raises(TypeError):
        widen_bf16(np.zeros(2, np.float16))


def test_read_f32_chunks_and_bounded_transient(tmp_path, monkeypatch):
    n = 4 << 20                                           # 8 MiB BF16 -> 16 MiB F32
    rng = np.random.default_rng(7)
    bf = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    f16 = rng.integers(0, 1 << 16, 1001, dtype=np.uint16)
    u8 = rng.integers(0, 256, 777, dtype=np.uint8)
    hdr = {"bf": {"dtype": "BF16", "shape": [1024, n // 1024], "data_offsets": [0, 2 * n]},
           "h": {"dtype": "F16", "shape": [1001], "data_offsets": [2 * n, 2 * n + 2002]},
           "u": {"dtype": "U8", "shape": [777], "data_offsets": [2 * n + 2002, 2 * n + 2779]}}
    _write(tmp_path / "m", _st_bytes(hdr, bf.tobytes() + f16.tobytes() + u8.tobytes()))
    with Checkpoint(tmp_path / "m") as ck:
        tracemalloc.start()
        try:
            wide = ck.read_f32("bf")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert np.array_equal(_bits(wide), bf.astype(np.uint32) << 16)
        assert peak - wide.nbytes <= ckmod.WIDEN_CHUNK + (256 << 10), peak
        monkeypatch.setattr(ckmod, "WIDEN_CHUNK", 50)     # odd chunk: 25 elements of F16
        assert np.array_equal(_bits(ck.read_f32("h")),
                              _bits(f16.view("<f2").astype(np.float32)))
        assert ck.read_f32("u").tolist() == u8.astype(np.float32).tolist()
        assert np.array_equal(_bits(ck.read_f32("bf")), _bits(wide))


# ---------------------------------------------------------------------------------------
# Directories and partial downloads

def _two_shards(d: Path) -> None:
    header, data = _valid()
    _write(d, _st_bytes(header, data), "model-00001-of-00003.safetensors")
    _write(d, _st_bytes({"x": _C_ALONE}, data[14:]), "model-00002-of-00003.safetensors")


def test_index_json_naming_an_absent_shard(tmp_path):
    d = tmp_path / "m"
    _two_shards(d)
    weight_map = {"a": "model-00001-of-00003.safetensors", "x": "model-00002-of-00003.safetensors",
                  "y": "model-00003-of-00003.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                "weight_map": weight_map}))
    with pytest.raises(CheckpointError) as exc:
        Checkpoint(d)
    assert str(d / "model-00003-of-00003.safetensors") in str(exc.value)
    assert "missing" in str(exc.value)
    del weight_map["y"]
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with Checkpoint(d) as ck:
        assert len(ck) == 4


def test_unusable_index_json(tmp_path):
    d = tmp_path / "m"
    _two_shards(d)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="index.json: not a usable shard index"):
        Checkpoint(d)


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"no .safetensors files in {tmp_path}"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="cannot list"):
        Checkpoint(tmp_path / "absent")


def test_require_tensors(tmp_path):
    d = tmp_path / "m"
    _two_shards(d)
    with Checkpoint(d) as ck:
        require_tensors(ck, {0: ["a", "b"], 1: ["c", "x"]}, 2)
        with pytest.raises(PartialCheckpointError) as exc:
            require_tensors(ck, {0: ["a"], 1: ["c", "gone.1"], 2: ["gone.2"], 3: ["x"],
                                 7: ["beyond.n_layers"]}, 4)
    msg = str(exc.value)
    assert msg.startswith("2 of 4 layers are missing tensors in this shard set. A partial "
                          "download cannot run the model.")
    assert "gone.1" in msg and str(d) in msg and "beyond" not in msg
    assert isinstance(exc.value, CheckpointError)
