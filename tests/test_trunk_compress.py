"""The compressed trunk (trunk_compress, kernels/k3z.h): the codec round-trips every BF16
bit pattern exactly, streamed runs give the golden ids whether they read trunk.bin or
trunk.k3z, a damaged or foreign compressed file never changes a token (plain reads,
warned, naming the file), trunk.k3z.json is validated field by field, and trunk.bin /
trunk.json stay byte for byte as without --compress."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine_helpers import GOLDEN_SEED, make_tiny
from test_cli import k3
from test_trunk import GOLDEN, N, run_streamed
from k3engine.diskio import ALIGN, align_up
from k3engine.kernels import _k3z as Z
from k3engine.trunk import TRUNK_BIN, TRUNK_JSON, TrunkManifest, compress_trunk, pack_trunk
from k3engine.trunk_compress import (K3Z_BIN, K3Z_JSON, MODE_ENV, CompressedTrunk, K3zError,
                                     block_plan, code_lengths, compressed_wins,
                                     encode_block)

WANT = GOLDEN["generated_ids"][:N]
SMALL_BLOCK = 8192          # several blocks per tiny layer: the parallel per-block path


# ---- the codec ------------------------------------------------------------------------

def _hx8(u: np.ndarray) -> np.ndarray:
    """Force an hx8 block (encode_block would keep an incompressible one raw)."""
    out = np.empty(Z.hx8_bound(len(u)), np.uint8)
    n = Z.encode_hx8(u, code_lengths(Z.hist(u)), out)
    assert n > 0
    return out[:n].copy()


def _roundtrip(u: np.ndarray) -> None:
    block = _hx8(u)
    dst = np.empty(2 * len(u), np.uint8)
    assert Z.decode_hx8(block, dst) == Z.OK
    assert np.array_equal(dst.view(np.uint16), u)


def _special_values(rng, n: int) -> np.ndarray:
    """Gaussian weights with +-inf, NaNs (several payloads), +-0, denormals, max/min."""
    x = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16
    u = x.astype(np.uint16)
    special = np.array([0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0000, 0x8000, 0x0001,
                        0x807F, 0x0040, 0x7F7F, 0xFF7F, 0x0080, 0x8080], np.uint16)
    idx = rng.choice(n, size=min(n, 400), replace=False)
    u[idx] = special[np.arange(len(idx)) % len(special)]
    return u


def test_every_bf16_bit_pattern_round_trips():
    u = np.arange(65536, dtype=np.uint16)      # every exponent, sign, mantissa, NaN payload
    np.random.default_rng(0).shuffle(u)
    _roundtrip(u)
    print(f"[gate] all 65536 BF16 patterns: decode(encode(x)) == x, {len(_hx8(u))} bytes")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 19, 20, 21, 79, 80, 81, 1000, 4097, 1 << 18])
def test_gaussian_weights_with_inf_nan_denormals_round_trip(n):
    _roundtrip(_special_values(np.random.default_rng(n), n))


def test_skewed_exponents_need_the_length_limit_and_still_round_trip():
    # counts 2^k: plain Huffman would give codes of up to 26 bits
    u = np.concatenate([np.full(1 << k, (k + 100) << 7, np.uint16) for k in range(26)])
    lengths = code_lengths(Z.hist(u))
    assert lengths.max() <= Z.MAXLEN
    _roundtrip(u)
    _roundtrip(np.zeros(5000, np.uint16))      # one exponent only: a 1-bit code


def test_weights_compress_and_small_or_flat_data_stays_raw():
    u = _special_values(np.random.default_rng(7), 1 << 16)
    codec, payload = encode_block(u.tobytes(), True)
    assert codec == "hx8" and len(payload) < 0.7 * u.nbytes
    flat = np.random.default_rng(1).integers(0, 65536, 4096, dtype=np.uint16)
    assert encode_block(flat.tobytes(), True)[0] == "raw"     # not smaller: kept raw
    assert encode_block(u.tobytes(), False) == ("raw", u.tobytes())


def test_decoder_refuses_malformed_headers():
    u = _special_values(np.random.default_rng(3), 5000)
    block = _hx8(u)
    dst = np.empty(2 * len(u), np.uint8)
    for what, edit in [("count", lambda b: b.__setitem__(slice(0, 4), [1, 0, 0, 0])),
                       ("code length 12", lambda b: b.__setitem__(4 + 3, 12)),
                       ("over-full code", lambda b: b.__setitem__(slice(4, 260), 1)),
                       ("stream length", lambda b: b.__setitem__(slice(260, 264),
                                                                 [255, 255, 255, 127]))]:
        b = block.copy()
        edit(b)
        assert Z.decode_hx8(b, dst) == Z.E_HEADER, what
    assert Z.decode_hx8(block[:200], dst) == Z.E_HEADER            # truncated header
    # every truncation of the streams is refused, never read past the buffer
    for cut in range(Z.HEADER_BYTES + len(u), len(block), max(1, (len(block) - 5276) // 40)):
        assert Z.decode_hx8(block[:cut], dst) != Z.OK, cut


def test_a_flipped_byte_anywhere_fails_the_block(tmp_path):
    """read_block (the reader threads' call): every single-byte change of a stored block is
    refused by the decoder or by the check of the decoded bytes."""
    u = _special_values(np.random.default_rng(5), 3000)
    block = _hx8(u)
    f = tmp_path / "b.k3z"
    scratch = np.zeros(Z.scratch_bytes(len(block), u.nbytes), np.uint8)
    dst = np.empty(u.nbytes, np.uint8)
    expect = Z.check(u.view(np.uint8))
    f.write_bytes(block.tobytes() + b"\0" * (-len(block) % 4096))
    fd = os.open(f, os.O_RDONLY)
    try:
        assert Z.read_block(fd, 0, len(block), scratch, dst, Z.CODEC_HX8, expect) == Z.OK
        assert np.array_equal(dst.view(np.uint16), u)
        rng = np.random.default_rng(6)
        positions = sorted(set(rng.integers(0, len(block), 150).tolist()) | {0, 4, 260, 276})
        for pos in positions:
            bad = block.copy()
            bad[pos] ^= 1 << int(rng.integers(0, 8))
            f.write_bytes(bad.tobytes() + b"\0" * (-len(bad) % 4096))
            got = Z.read_block(fd, 0, len(block), scratch, dst, Z.CODEC_HX8, expect)
            assert got != Z.OK, pos
        assert Z.read_block(fd, 0, len(block), scratch, dst, 7, expect) == Z.E_HEADER
    finally:
        os.close(fd)
    print(f"[gate] {len(positions)} single-bit flips of one hx8 block: every one refused")


# ---- packing ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3z") / "tiny", GOLDEN_SEED)


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("k3z") / "packed")
    pack_trunk(tiny, d)
    compress_trunk(d, block_bytes=SMALL_BLOCK)
    return d


def _copy(packed: str, tmp_path: Path) -> str:
    d = tmp_path / "t"
    shutil.copytree(packed, d)
    return str(d)


def test_blocks_tile_every_layer_and_code_the_bf16_matrices(packed):
    m = TrunkManifest.load(packed)
    ct = CompressedTrunk.load(packed, m)
    coded = sum(b.codec == Z.CODEC_HX8 for c in ct.layers for b in c.blocks)
    assert coded > 13 and ct.stored_bytes < 0.8 * ct.raw_bytes
    for layer, c in zip(m.layers, ct.layers):
        assert sum(b.raw_nbytes for b in c.blocks) == layer.nbytes
    plan = block_plan(m.layers[4].tensors, m.layers[4].nbytes, SMALL_BLOCK)
    assert all(n <= SMALL_BLOCK for _, n, _ in plan)
    print(f"[gate] tiny trunk: {ct.stored_bytes} of {ct.raw_bytes} bytes "
          f"({100 * (1 - ct.stored_bytes / ct.raw_bytes):.1f} % fewer), {coded} hx8 blocks")


def test_plain_trunk_is_byte_for_byte_unchanged(tiny, packed, tmp_path):
    plain = tmp_path / "plain"
    pack_trunk(tiny, str(plain))
    for name in (TRUNK_BIN, TRUNK_JSON):
        assert (plain / name).read_bytes() == Path(packed, name).read_bytes(), name
    assert not (plain / K3Z_BIN).exists()


# ---- streamed runs: same ids --------------------------------------------------------------

@pytest.mark.parametrize("pinned, ring", [((), 1), ((), 2), ((), 3), ((0, 3, 7), 2),
                                          (range(13), 2)])
def test_ids_identical_compressed_plain_resident(tiny, packed, pinned, ring, monkeypatch):
    got = {}
    for mode in ("on", "off"):
        monkeypatch.setenv(MODE_ENV, mode)
        ids, st = run_streamed(tiny, packed, set(pinned), ring)
        got[mode] = (ids, st)
    on, off = got["on"][1], got["off"][1]
    print(f"[gate] pinned {sorted(pinned)[:4]} ring {ring}: compressed {got['on'][0]} vs plain "
          f"{got['off'][0]} vs resident golden {WANT}; compressed read {on.stored_bytes_read} "
          f"B from trunk.k3z for {on.bytes_read} B of layers")
    assert got["on"][0] == got["off"][0] == WANT
    assert on._k3z_reader is not None and on.k3z is not None      # never fell back
    assert off._k3z_reader is None
    assert on.stored_bytes_read < on.bytes_read == off.bytes_read == off.stored_bytes_read


def test_auto_measures_both_and_says_which(tiny, packed, monkeypatch):
    monkeypatch.setenv(MODE_ENV, "auto")
    ids, st = run_streamed(tiny, packed, set(), 2)
    c = st.compress_choice
    print(f"[gate] auto: {st.reads_line}")
    assert ids == WANT
    assert c.decode_bps > 0 and c.device_bps > 0
    assert c.use == compressed_wins(c.decode_bps * c.threads, c.ratio, c.device_bps)
    assert (st._k3z_reader is not None) == c.use
    assert st.reads_line.startswith("trunk reads: ")


def test_the_rule_picks_compressed_only_when_decoding_outruns_the_device():
    # 2/3 of the bytes: compressed needs decode x threads > 3 x device (x the margin)
    assert compressed_wins(4e9, 2 / 3, 1e9)
    assert not compressed_wins(3e9, 2 / 3, 1e9)
    assert not compressed_wins(0.0, 0.5, 1e9)


def test_bad_mode_is_a_usage_error(tiny, packed, monkeypatch):
    from k3engine.errors import UsageError
    monkeypatch.setenv(MODE_ENV, "yes")
    with pytest.raises(UsageError, match=MODE_ENV):
        run_streamed(tiny, packed, set(), 2)


# ---- damage: plain reads, same ids, a warning naming the file ------------------------------

def _flip_in_block(d: str, L: int) -> None:
    ct = CompressedTrunk.load(d, TrunkManifest.load(d))
    b = next(b for b in ct.layers[L].blocks if b.codec == Z.CODEC_HX8)
    with open(os.path.join(d, K3Z_BIN), "r+b") as f:
        f.seek(b.file_off + b.stored_nbytes - 3)
        x = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([x[0] ^ 0x10]))


def test_a_damaged_block_falls_back_to_plain_reads(tiny, packed, tmp_path, monkeypatch):
    d = _copy(packed, tmp_path)
    _flip_in_block(d, 6)
    monkeypatch.setenv(MODE_ENV, "on")
    ids, st = run_streamed(tiny, d, set(), 2)
    warnings = [m for m, w in st.notes if w]
    print(f"[gate] damaged block in layer 6: ids {ids} vs golden {WANT}; {warnings}")
    assert ids == WANT
    assert st.k3z is None and len(warnings) == 1
    assert os.path.join(d, K3Z_BIN) in warnings[0] and "layer 6" in warnings[0]


def test_a_truncated_compressed_file_is_refused_at_open(tiny, packed, tmp_path, monkeypatch):
    d = _copy(packed, tmp_path)
    z = os.path.join(d, K3Z_BIN)
    os.truncate(z, os.path.getsize(z) - 4096)
    monkeypatch.setenv(MODE_ENV, "on")
    ids, st = run_streamed(tiny, d, set(), 2)
    assert ids == WANT and st._k3z_reader is None
    (msg, warn), = st.notes
    assert warn and z in msg and "truncated" in msg


def test_a_compressed_file_of_another_pack_is_not_read(tiny, packed, tmp_path, monkeypatch):
    other = make_tiny(tmp_path / "other", GOLDEN_SEED + 1)
    d = tmp_path / "t"
    pack_trunk(other, str(d))
    for name in (K3Z_BIN, K3Z_JSON):                 # the golden model's compressed file
        shutil.copy(os.path.join(packed, name), d / name)
    with pytest.raises(K3zError, match="another pack of trunk.bin"):
        CompressedTrunk.load(str(d), TrunkManifest.load(str(d)))


def test_a_repack_removes_a_compressed_file_that_no_longer_binds(tiny, packed, tmp_path):
    d = _copy(packed, tmp_path)
    m = pack_trunk(tiny, d, n_layers=12)            # another trunk.json: 12 layers, not 13
    assert any(K3Z_BIN in note for note in m.notes)
    assert not os.path.exists(os.path.join(d, K3Z_BIN))
    assert not os.path.exists(os.path.join(d, K3Z_JSON))


def _mutations(doc: dict):
    """(what, edit) pairs, each of which must be refused naming trunk.k3z.json."""
    def blk(key, value, L=2, j=1):
        def f(d):
            d["layers"][L]["blocks"][j][key] = value
        return f

    def lay(key, value, L=3):
        def f(d):
            d["layers"][L][key] = value
        return f
    b = doc["layers"][2]["blocks"][1]
    yield "format", lambda d: d.update(format="k3zz")
    yield "version", lambda d: d.update(version=2)
    yield "layers not a list", lambda d: d.update(layers={})
    yield "a layer missing", lambda d: d["layers"].pop()
    yield "raw_off shifted", blk("raw_off", b["raw_off"] + 2)
    yield "raw_off a bool", blk("raw_off", True, L=0, j=0)
    yield "raw_nbytes a float", blk("raw_nbytes", float(b["raw_nbytes"]))
    yield "raw_nbytes 0", blk("raw_nbytes", 0)
    yield "file_off moved", blk("file_off", b["file_off"] + 1)
    yield "stored_nbytes grown", blk("stored_nbytes", b["stored_nbytes"] + 1)
    yield "codec unknown", blk("codec", "lz4")
    yield "codec not a string", blk("codec", 1)
    yield "check upper case", blk("check", b["check"].upper())
    yield "check short", blk("check", b["check"][:15])
    yield "extra key", blk("extra", 1)
    yield "missing key", lambda d: d["layers"][2]["blocks"][1].pop("check")
    yield "raw_sha256 of other bytes", lay("raw_sha256", "0" * 64)
    yield "nbytes", lay("nbytes", doc["layers"][3]["nbytes"] + 4096)
    yield "sha256 malformed", lay("sha256", "xyz")
    yield "stored_nbytes of a layer", lay("stored_nbytes", doc["layers"][3]["stored_nbytes"] + 4096)
    yield "no blocks", lay("blocks", [])


def test_every_manifest_field_is_validated(packed, tmp_path):
    d = _copy(packed, tmp_path)
    jp = os.path.join(d, K3Z_JSON)
    good = json.loads(Path(jp).read_text())
    m = TrunkManifest.load(d)
    CompressedTrunk.load(d, m)
    n = 0
    for what, edit in _mutations(good):
        doc = json.loads(json.dumps(good))
        edit(doc)
        Path(jp).write_text(json.dumps(doc))
        with pytest.raises(K3zError) as e:
            CompressedTrunk.load(d, m)
        assert jp in str(e.value), what
        n += 1
    for raw in (b"", b"{", b'{"format": "k3z", "version": 1, "layers": [], "layers": []}'):
        Path(jp).write_bytes(raw)
        with pytest.raises(K3zError, match="trunk.k3z.json"):
            CompressedTrunk.load(d, m)
    print(f"[gate] trunk.k3z.json: {n} field mutations + 3 malformed files refused, each "
          f"naming the file")


# ---- the CLI --------------------------------------------------------------------------------

def test_cli_pack_compress_and_run(tiny, tmp_path):
    t = tmp_path / "trunk"
    p = k3("pack-trunk", tiny, t, "--compress", "--compress-block-kb", "8")
    assert p.returncode == 0, p.stderr
    assert "wrote trunk.bin" in p.stdout and "wrote trunk.k3z" in p.stdout
    ids, read = {}, {}
    for mode in ("on", "off"):
        out = tmp_path / f"{mode}.json"
        r = k3(tiny, "--ids", ",".join(map(str, GOLDEN["prompt_ids"])), "--gen", N,
               "--incremental", "--trunk", t, "--trunk-gb", "0", "--out", out,
               env={MODE_ENV: mode})
        assert r.returncode == 0, r.stderr[-2000:]
        assert ("trunk reads: compressed" if mode == "on" else "trunk reads: plain") in r.stdout
        report = json.loads(out.read_bytes())
        ids[mode], read[mode] = report["generated_ids"], report["trunk_bytes_read"]
    print(f"[gate] k3 --trunk: compressed {ids['on']} vs plain {ids['off']} vs golden {WANT}; "
          f"trunk bytes read from the disk {read['on']} compressed, {read['off']} plain")
    assert ids["on"] == ids["off"] == WANT
    # the report counts what came off the disk: the compressed run read fewer bytes
    assert 0 < read["on"] < 0.9 * read["off"]
    _flip_in_block(str(t), 2)
    r = k3(tiny, "--ids", ",".join(map(str, GOLDEN["prompt_ids"])), "--gen", N,
           "--incremental", "--trunk", t, "--trunk-gb", "0", "--out", tmp_path / "d.json",
           env={MODE_ENV: "on"})
    assert r.returncode == 0 and "k3: warning:" in r.stderr and K3Z_BIN in r.stderr
    assert json.loads((tmp_path / "d.json").read_bytes())["generated_ids"] == WANT
    bad = k3("pack-trunk", tiny, t, "--compress-block-kb", "8")
    assert bad.returncode == 2 and "--compress" in bad.stderr


def test_doctor_verify_checks_the_compressed_digests(packed, tmp_path):
    d = _copy(packed, tmp_path)
    ok = k3("doctor", "--verify", "--trunk", d)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "compressed trunk: 13 of 13 layers verified" in ok.stdout
    _flip_in_block(d, 9)
    bad = k3("doctor", "--verify", "--trunk", d)
    print(f"[gate] doctor --verify on a flipped compressed byte: exit {bad.returncode}")
    assert bad.returncode == 1
    assert f"{os.path.join(d, K3Z_BIN)}: layer 9 does not match" in bad.stdout + bad.stderr


def test_stale_partials_are_removed_and_listed(packed, tmp_path):
    from k3engine.integrity import stale_files
    d = _copy(packed, tmp_path)
    dead = 2 ** 22 + 17                        # above pid_max's default: never running
    for name in (f"trunk.k3z.partial-{dead}", f"trunk.k3z.json.partial-{dead}"):
        Path(d, name).write_bytes(b"x")
    assert len(stale_files(d)) == 2
    ct = compress_trunk(d, block_bytes=SMALL_BLOCK)
    assert len(ct.notes) == 2 and stale_files(d) == []


def test_the_plan_counts_the_compressed_readers_scratch(tiny, packed, monkeypatch):
    """With a trunk.k3z that may be read, each trunk reader thread holds a decode scratch
    of the largest block: the planner counts it (session.open_model -> figures), and with
    compression off or without a k3z it counts nothing."""
    from k3engine.memory import plan
    from k3engine.loading import open_model, read_config
    from k3engine.trunk import IO_THREADS
    got = {}
    cfg, _ = read_config(tiny)
    for mode in ("auto", "off"):
        monkeypatch.setenv(MODE_ENV, mode)
        setup = open_model(tiny, cfg, None, packed)
        try:
            f = setup.figures
        finally:
            setup.ck.close()
        got[mode] = (f.stream_scratch_bytes, plan(f, trunk_gb=0.0, cache_gb=0.01).buffer_bytes)
    m = TrunkManifest.load(packed)
    want = IO_THREADS * align_up(max(CompressedTrunk.load(packed, m).scratch_bytes, ALIGN))
    print(f"[gate] planned decode scratch: auto {got['auto'][0]:,} B (want {want:,}), "
          f"off {got['off'][0]} B; buffers {got['auto'][1]:,} vs {got['off'][1]:,} B")
    assert got["auto"][0] == want > 0 and got["off"][0] == 0
    assert got["auto"][1] - got["off"][1] == want
