"""State file v2 (SYSTEM §6.9, test plan §12.4): exact round trip, the on-disk layout and
hash, every refusal before the target is touched, and atomic publication.

Synthetic arrays throughout: a tiny config bound to 4 layers of which 2 are MLA, a cache
of 16 positions holding 5, and 6 ids.
"""
import errno
import os
import struct

import numpy as np
import pytest

from k3engine import statefile
from k3engine.config import parse_config
from k3engine.kernels import KEY_BLOCK
from k3engine.state import KDAState, MLAState, SequenceState, grown
from k3engine.statefile import (HASH_INIT, HEADER_SIZE, StateFileError, load_state,
                                model_fingerprint, peek_state, save_state, state_hash)

from test_config import TINY  # the op fixtures' tiny flat config (checked there)
# Same dims, layers rearranged so the first four bound layers are K M K M (§12.4: 4 bound
# layers, 2 MLA).
PLAN = dict(TINY, num_hidden_layers=6, full_attn_layers=[2, 4, 6])
# Every region length odd in floats or ids, so each region ends in a 4-byte tail and the
# state region's layer boundaries fall mid-word: kper = 1*3*3 + 3*3*2 = 27, kvpp =
# 1*(3+2) = 5, ropepp = 3.
ODD = dict(PLAN, kda_num_heads=1, kda_head_dim=3, short_conv_kernel_size=3,
           num_attention_heads=1, qk_nope_head_dim=3, v_head_dim=2, qk_rope_head_dim=3)

N_BOUND, CAP, CACHED = 4, 16, 5
TOKENS = [3, 10, 17, 24, 31, 38]  # nseq = cached + 1: the last emitted id is pending


def arrays(state):
    """(name, array) for every array of the state, in layer order; an MLA layer's cache as
    the spec's position-major rows (copies: state.MLAState keeps it in key blocks)."""
    out = []
    for L, st in enumerate(state.layers):
        if isinstance(st, KDAState):
            out += [(f"layer {L} {n}", getattr(st, n)) for n in ("S", "conv_q", "conv_k", "conv_v")]
        else:
            out += [(f"layer {L} kv", st.rows(0, state.capacity)),
                    (f"layer {L} rope", st.rope_rows(0, state.capacity))]
    return out


def make_state(cfg_dict=PLAN, capacity=CAP, n_layers=N_BOUND, seed=0, fill="random"):
    state = SequenceState(parse_config(dict(cfg_dict)), capacity, n_layers)
    rng = np.random.default_rng(seed)
    for st in state.layers:           # every array, an MLA cache's blocks included
        for a in vars(st).values():
            if isinstance(a, np.ndarray):
                a[...] = rng.standard_normal(a.shape) if fill == "random" else fill
    state.n_cached = CACHED if fill == "random" else 0
    return state


def snapshot(state):
    return state.n_cached, [(n, a.copy()) for n, a in arrays(state)]


def assert_unchanged(state, snap):
    n_cached, saved = snap
    assert state.n_cached == n_cached
    for (name, before), (_, now) in zip(saved, arrays(state)):
        assert np.array_equal(before.view(np.uint32), now.view(np.uint32)), name


def bits(a):
    return a.view(np.uint32)


@pytest.fixture
def saved(tmp_path):
    """(path, source state, file bytes) of a good file."""
    src = make_state()
    path = tmp_path / "good.k3st"
    n = save_state(path, src, TOKENS, model_fingerprint(src.cfg))
    data = path.read_bytes()
    assert n == len(data)
    return path, src, data


# ---------------------------------------------------------------------------------------
# Round trip and format.

@pytest.mark.parametrize("capacity", [CAP + 9, CACHED], ids=["larger", "exactly-full"])
def test_round_trip(saved, capacity):
    path, src, _ = saved
    dst = make_state(capacity=capacity, fill=-7.25)
    tokens = load_state(path, dst, model_fingerprint(dst.cfg))
    assert tokens == TOKENS
    assert dst.n_cached == CACHED
    for (name, a), (_, b) in zip(arrays(src), arrays(dst)):
        if name.endswith(("kv", "rope")):
            assert np.array_equal(bits(a[:CACHED]), bits(b[:CACHED])), name
            assert np.all(b[CACHED:] == -7.25), f"{name}: rows past the restored ones"
        else:
            assert np.array_equal(bits(a), bits(b)), name


def test_peek_reports_the_header(saved):
    path, src, data = saved
    hd = peek_state(path)
    assert hd.version == 2
    assert hd.fingerprint == model_fingerprint(src.cfg)
    assert (hd.n_bound, hd.n_mla, hd.cached, hd.nseq) == (4, 2, 5, 6)
    assert (hd.kper, hd.kvpp, hd.ropepp) == (4 * 16 * 16 + 3 * 64 * 3, 4 * 40, 8)
    assert hd.file_bytes == len(data)
    assert hd.payload_hash == struct.unpack_from("<Q", data, 96)[0]


def test_fingerprint_is_the_twelve_config_fields():
    cfg = parse_config(dict(TINY))
    assert model_fingerprint(cfg) == (128, 13, 256, 4, 16, 4, 4, 24, 8, 16, 8, 2)
    # The bound count is the header's n_bound, not part of the fingerprint.
    assert model_fingerprint(cfg, 4) == model_fingerprint(cfg)


def fnv_slow(h, data):
    """§6.9's fold, written from the text: whole 8-byte LE words, then single bytes."""
    P, M = 0x100000001B3, (1 << 64) - 1
    n8 = len(data) // 8 * 8
    for i in range(0, n8, 8):
        h = ((h ^ int.from_bytes(data[i:i + 8], "little")) * P) & M
    for b in data[n8:]:
        h = ((h ^ b) * P) & M
    return h


def test_hash_matches_the_spec_fold():
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 200, dtype=np.uint8).tobytes()
    for n in list(range(0, 20)) + [199, 200]:
        assert state_hash(HASH_INIT, data[:n]) == fnv_slow(HASH_INIT, data[:n]), n
    # Fed in uneven pieces, a region still folds as one run of words plus one tail.
    hasher = statefile._RegionHasher()
    for a, b in [(0, 3), (3, 4), (4, 13), (13, 13), (13, 64), (64, 195)]:
        hasher.update(data[a:b])
    hasher.end_region()
    assert hasher.value == fnv_slow(HASH_INIT, data[:195])
    # A long run of words (the compiled loop) plus a byte tail.
    big = rng.integers(0, 256, 8 * (1 << 16) + 8 * 13 + 5, dtype=np.uint8).tobytes()
    assert state_hash(HASH_INIT, big) == fnv_slow(HASH_INIT, big)


def test_file_layout_and_hash_follow_the_spec(tmp_path):
    """Parse the file from §6.9's text alone and compare with the arrays; region lengths
    are odd so every tail and mid-word layer boundary is exercised."""
    src = make_state(ODD)
    tokens = TOKENS + [45]  # 7 ids: a 4-byte tail
    path = tmp_path / "odd.k3st"
    save_state(path, src, tokens)
    data = path.read_bytes()

    fields = struct.unpack_from("<4si12i4i3qQ", data, 0)
    assert fields[0] == b"K3ST" and fields[1] == 2
    assert fields[2:14] == (128, 6, 256, 1, 3, 3, 1, 3, 3, 2, 8, 2)
    n_bound, n_mla, cached, nseq, kper, kvpp, ropepp, declared = fields[14:]
    assert (n_bound, n_mla, cached, nseq, kper, kvpp, ropepp) == (4, 2, 5, 7, 27, 5, 3)

    regions, off = [], HEADER_SIZE
    for size in [4 * nseq, 4 * kper * n_bound] + [4 * cached * kvpp] * n_mla \
            + [4 * cached * ropepp] * n_mla:
        regions.append(data[off:off + size])
        off += size
    assert off == len(data)

    assert np.frombuffer(regions[0], "<i4").tolist() == tokens
    layers = np.frombuffer(regions[1], "<f4").reshape(n_bound, kper)
    mla = []
    for L, st in enumerate(src.layers):
        if isinstance(st, KDAState):
            want = np.concatenate([st.S.ravel(), st.conv_q.ravel(), st.conv_k.ravel(),
                                   st.conv_v.ravel()])
            assert np.array_equal(bits(layers[L]), bits(want)), L
            # Channel c's history at c*(K-1): row-major [P, K-1].
            assert np.array_equal(layers[L][9:9 + 6], st.conv_q[:3].ravel())
        else:
            assert not layers[L].any(), f"MLA layer {L} carries no recurrent state"
            mla.append(st)
    for i, st in enumerate(mla):
        kv = np.frombuffer(regions[2 + i], "<f4").reshape(cached, kvpp)
        rope = np.frombuffer(regions[2 + n_mla + i], "<f4").reshape(cached, ropepp)
        # the spec's rows: per position, each head's k_nope then v; the state holds k_nope
        # and the rope keys in blocks of KEY_BLOCK positions (lane = position in the block)
        H, _, dn, B = st.k.shape
        k = st.k.transpose(0, 1, 3, 2).reshape(H, -1, dn)[:, :cached]
        want = np.concatenate([k, st.v[:, :cached]], axis=2).transpose(1, 0, 2)
        assert np.array_equal(bits(kv), bits(want.reshape(cached, -1)))
        want = st.rope.transpose(0, 2, 1).reshape(-1, ropepp)[:cached]
        assert np.array_equal(bits(rope), bits(want))

    h = HASH_INIT
    for r in regions:  # region by region: each tail restarts
        h = fnv_slow(h, r)
    assert declared == h
    assert h != fnv_slow(HASH_INIT, b"".join(regions))  # not the payload as one blob

    dst = make_state(ODD, capacity=CACHED, fill=0.0)
    assert load_state(path, dst) == tokens


# ---------------------------------------------------------------------------------------
# Refusals: each names the file and the problem, and leaves the target as it was.

def refused(path, state, *message_parts, fingerprint=None):
    snap = snapshot(state)
    with pytest.raises(StateFileError) as exc:
        load_state(path, state, fingerprint)
    assert_unchanged(state, snap)
    text = str(exc.value)
    assert str(path) in text
    for part in message_parts:
        assert part in text
    return text


def test_truncated_header(saved, tmp_path):
    path, _, data = saved
    for n in (0, 4, HEADER_SIZE - 1):
        mut = tmp_path / "mut.k3st"
        mut.write_bytes(data[:n])
        msg = f"{mut} is not a k3 state file"
        with pytest.raises(StateFileError, match=msg):
            peek_state(mut)
        refused(mut, make_state(fill=1.5), msg)


def test_truncated_payload(saved, tmp_path):
    _, _, data = saved
    for n in (len(data) - 7, len(data) - 1, HEADER_SIZE):
        mut = tmp_path / "mut.k3st"
        mut.write_bytes(data[:n])
        with pytest.raises(StateFileError, match="is truncated"):
            peek_state(mut)  # the header's sizes are checked against the file's (issue 14)
        refused(mut, make_state(fill=1.5), f"{mut} is truncated")


def test_longer_than_declared(saved, tmp_path):
    _, _, data = saved
    mut = tmp_path / "mut.k3st"
    mut.write_bytes(data + b"\0")
    refused(mut, make_state(fill=1.5), f"{mut} is longer than its header declares")


@pytest.mark.parametrize("version", [1, 3])
def test_wrong_version(saved, tmp_path, version):
    _, _, data = saved
    m = bytearray(data)
    struct.pack_into("<i", m, 4, version)
    mut = tmp_path / "mut.k3st"
    mut.write_bytes(bytes(m))
    msg = f"{mut} is state version {version}, this build writes 2"
    with pytest.raises(StateFileError, match=msg):
        peek_state(mut)
    refused(mut, make_state(fill=1.5), msg)


def test_wrong_magic(saved, tmp_path):
    _, _, data = saved
    m = bytearray(data)
    m[1] ^= 0xFF
    mut = tmp_path / "mut.k3st"
    mut.write_bytes(bytes(m))
    with pytest.raises(StateFileError, match=f"{mut} is not a k3 state file"):
        peek_state(mut)
    refused(mut, make_state(fill=1.5), f"{mut} is not a k3 state file")


def test_missing_file(tmp_path):
    path = tmp_path / "absent.k3st"
    with pytest.raises(StateFileError, match=f"cannot read {path}: No such file"):
        peek_state(path)
    refused(path, make_state(fill=1.5), "No such file")


def test_other_fingerprint(saved):
    path, _, _ = saved
    other = dict(PLAN, num_experts_per_token=3)  # same array shapes, other model
    state = make_state(other, fill=1.5)
    text = refused(path, state, f"REFUSING: {path} was written by a different model "
                                "architecture.", "fluent, wrong output", "topk 2 vs 3",
                   fingerprint=model_fingerprint(state.cfg))
    assert "hidden" not in text  # only the fields that differ are listed


@pytest.mark.parametrize("n_layers,n_mla", [(5, 2), (3, 1)])
def test_other_layer_count(saved, n_layers, n_mla):
    path, _, _ = saved
    refused(path, make_state(n_layers=n_layers, fill=1.5),
            f"REFUSING: {path} holds 4 bound layers and 2 MLA layers, "
            f"this run has {n_layers} and {n_mla}")


def test_cache_too_small(saved):
    path, _, _ = saved
    refused(path, make_state(capacity=CACHED - 1, fill=1.5),
            f"REFUSING: {path} holds 5 positions, this run's KV cache is 4.",
            "Raise --gen or shorten the prompt.")


def region_offsets(hd):
    """Start of each region: ids, state, KV slice per MLA layer, rope slice per MLA layer."""
    starts, off = [], HEADER_SIZE
    for size in hd.region_sizes():
        starts.append(off)
        off += size
    return starts


REGIONS = ["ids", "state", "kv[0]", "kv[1]", "rope[0]", "rope[1]", "last byte"]


@pytest.mark.parametrize("region", REGIONS)
def test_flipped_byte_in_each_region(saved, tmp_path, region):
    path, _, data = saved
    hd = peek_state(path)
    starts = region_offsets(hd)
    at = len(data) - 1 if region == "last byte" else starts[REGIONS.index(region)] + 5
    m = bytearray(data)
    m[at] ^= 0x01
    mut = tmp_path / "mut.k3st"
    mut.write_bytes(bytes(m))
    text = refused(mut, make_state(fill=1.5),
                   f"REFUSING: {mut} does not match the hash its header declares",
                   f"(header {hd.payload_hash:016x}, contents ",
                   "The payload is damaged;", "restoring it would produce fluent, wrong")
    contents = text.split("contents ")[1][:16]
    assert len(contents) == 16 and contents != f"{hd.payload_hash:016x}"
    # The untouched file still loads, so the refusal is the flip.
    assert load_state(path, make_state(fill=1.5)) == TOKENS


def test_damaged_header_hash(saved, tmp_path):
    _, _, data = saved
    m = bytearray(data)
    m[HEADER_SIZE - 1] ^= 0x01
    mut = tmp_path / "mut.k3st"
    mut.write_bytes(bytes(m))
    want = struct.unpack_from("<Q", data, 96)[0]
    refused(mut, make_state(fill=1.5),
            f"REFUSING: {mut} does not match the hash its header declares",
            f"(header {want ^ (1 << 56):016x}, contents {want:016x}).")


def test_damaged_header_count(saved, tmp_path):
    _, _, data = saved
    m = bytearray(data)
    struct.pack_into("<i", m, 64, -1)  # cached
    mut = tmp_path / "mut.k3st"
    mut.write_bytes(bytes(m))
    with pytest.raises(StateFileError, match=rf"{mut} has a damaged header \(cached = -1\)"):
        peek_state(mut)


def test_caller_fingerprint_must_describe_the_state(saved):
    path, src, _ = saved
    other = model_fingerprint(parse_config(dict(PLAN, vocab_size=512)))
    with pytest.raises(ValueError, match="does not describe the state's config"):
        load_state(path, make_state(fill=1.5), other)
    with pytest.raises(ValueError, match="does not describe the state's config"):
        save_state(path, src, TOKENS, other)


# ---------------------------------------------------------------------------------------
# Publication.

def no_residue(directory):
    return [n for n in os.listdir(directory) if ".tmp" in n] == []


def test_resave_is_a_new_inode(saved):
    path, src, _ = saved
    before = os.stat(path)
    save_state(path, src, TOKENS)
    after = os.stat(path)
    assert before.st_ino != after.st_ino
    assert no_residue(path.parent)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_mode_is_0600_whatever_the_umask(tmp_path, mask):
    # issue 14: a state file holds the conversation (ids and KV rows), like the history
    old = os.umask(mask)
    try:
        path = tmp_path / "m.k3st"
        save_state(path, make_state(), TOKENS)
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert no_residue(tmp_path)


def test_unwritable_directory_leaves_old_file(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    path = ro / "state.k3st"
    save_state(path, make_state(), TOKENS)
    old = path.read_bytes()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("chmod does not stop this user (root); "
                        "see the injected-failure tests below")
        with pytest.raises(StateFileError, match=f"failed writing {path}: cannot create "
                                                 "a temp file .*Permission denied"):
            save_state(path, make_state(seed=1), TOKENS[::-1])
    finally:
        ro.chmod(0o700)
    assert path.read_bytes() == old
    assert no_residue(ro)


@pytest.mark.parametrize("call", ["mkstemp", "fsync", "replace", "write"])
def test_failed_save_leaves_old_file(tmp_path, monkeypatch, call):
    """The same guarantee with the failure injected, so it is checked as root too;
    "mkstemp" is what an unwritable directory does to the save."""
    path = tmp_path / "state.k3st"
    save_state(path, make_state(), TOKENS)
    old, ino = path.read_bytes(), os.stat(path).st_ino
    code = errno.EACCES if call == "mkstemp" else errno.ENOSPC
    reason = ("cannot create a temp file in .*: " if call == "mkstemp" else "") \
        + os.strerror(code)

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    if call == "mkstemp":
        monkeypatch.setattr(statefile.tempfile, "mkstemp", fail)
    elif call == "write":
        # Fail part-way through the payload, after the header and some data went out.
        calls = []
        real = statefile._RegionHasher.update

        def update(self, data):
            calls.append(1)
            if len(calls) == 3:
                fail()
            real(self, data)
        monkeypatch.setattr(statefile._RegionHasher, "update", update)
    else:
        monkeypatch.setattr(os, call, fail)
    with pytest.raises(StateFileError, match=f"failed writing {path}: {reason}"):
        save_state(path, make_state(seed=1), TOKENS[::-1])
    monkeypatch.undo()
    assert path.read_bytes() == old and os.stat(path).st_ino == ino
    assert no_residue(tmp_path)
    assert load_state(path, make_state(fill=1.5)) == TOKENS


def test_interrupted_save_leaves_no_residue(tmp_path, monkeypatch):
    path = tmp_path / "state.k3st"

    def interrupt(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_state(path, make_state(), TOKENS)
    assert os.listdir(tmp_path) == []


def test_bad_token_id_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="does not fit"):
        save_state(tmp_path / "s.k3st", make_state(), [1, 2**31])
    assert os.listdir(tmp_path) == []


def test_empty_sequence_round_trip(tmp_path):
    """A fresh state (nothing cached, no ids) is a valid file too: empty regions."""
    src = make_state()
    src.n_cached = 0
    path = tmp_path / "empty.k3st"
    assert save_state(path, src, []) == HEADER_SIZE + 4 * peek_state(path).kper * N_BOUND
    dst = make_state(fill=2.0)
    assert load_state(path, dst) == []
    assert dst.n_cached == 0
    for (name, a), (_, b) in zip(arrays(src), arrays(dst)):
        if not name.endswith(("kv", "rope")):
            assert np.array_equal(bits(a), bits(b)), name


@pytest.mark.parametrize("nseq", [2**31 - 1, 300_000_000])
def test_header_counts_are_checked_against_the_file_size_at_peek(saved, tmp_path, nseq):
    """issue 14 finding 3: a header claiming 2**31-1 ids made the CLI allocate ~17 GB
    (MemoryError) before any check; 3e8 took 2.4 GB, then a message without the file."""
    path, _, _ = saved
    raw = bytearray(path.read_bytes())
    struct.pack_into("<i", raw, 4 + 4 + 48 + 12, nseq)      # n_bound, n_mla, cached, nseq
    mut = tmp_path / "big_nseq.k3st"
    mut.write_bytes(bytes(raw))
    with pytest.raises(StateFileError) as e:
        peek_state(mut)
    assert str(mut) in str(e.value) and "is truncated" in str(e.value)


def test_fifo_and_device_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "state.fifo"
    os.mkfifo(fifo)
    for p in (fifo, "/dev/zero"):
        with pytest.raises(StateFileError, match="not a regular file"):
            peek_state(p)


@pytest.mark.parametrize("field_at", [60, 56], ids=["n_mla", "n_bound"])
def test_huge_layer_counts_are_refused_at_peek_without_building_lists(saved, tmp_path, field_at):
    """Found by the state-file fuzzer: n_mla = 2**31-1 made the size check itself build a
    list of four billion region sizes (minutes and gigabytes) before refusing."""
    path, _, _ = saved
    raw = bytearray(path.read_bytes())
    struct.pack_into("<i", raw, field_at, 2**31 - 1)
    mut = tmp_path / "huge.k3st"
    mut.write_bytes(bytes(raw))
    with pytest.raises(StateFileError, match="is truncated"):
        peek_state(mut)


# The MLA cache's own layout (state.MLAState): files hold the spec's rows, memory blocks.

@pytest.mark.parametrize("capacity", [37, 40])
def test_mla_cache_rows_go_through_the_key_blocks_bit_for_bit(capacity):
    """Rows written at any offset (a ragged block at either end, whole blocks between)
    read back bit for bit, land at k[h, p // KEY_BLOCK, :, p % KEY_BLOCK] and v[h, p], and
    leave every other position as it was; the rope keys likewise."""
    H, dn, dv, dr = 3, 5, 4, 6
    rng = np.random.default_rng(7)
    st = MLAState.zeros(H, dn, dv, dr, capacity)
    before = st.rows(0, capacity)
    for p0, n in ((3, 22), (0, 8), (capacity - 5, 5), (9, 1)):
        rows = rng.standard_normal((n, H * (dn + dv))).astype(np.float32)
        rope = rng.standard_normal((n, dr)).astype(np.float32)
        st.set_rows(p0, rows)
        st.set_rope(p0, rope)
        assert np.array_equal(bits(st.rows(p0, p0 + n)), bits(rows)), (p0, n)
        assert np.array_equal(bits(st.rope_rows(p0, p0 + n)), bits(rope)), (p0, n)
        for i in (0, n // 2, n - 1):
            p, B = p0 + i, KEY_BLOCK
            for h in range(H):
                assert np.array_equal(st.k[h, p // B, :, p % B], rows[i, h * 9:h * 9 + dn])
                assert np.array_equal(st.v[h, p], rows[i, h * 9 + dn:(h + 1) * 9])
            assert np.array_equal(st.rope[p // B, :, p % B], rope[i])
        after = st.rows(0, capacity)
        outside = np.ones(capacity, bool)
        outside[p0:p0 + n] = False
        assert np.array_equal(bits(after[outside]), bits(before[outside])), (p0, n)
        before = after


def test_a_grown_state_keeps_its_cached_positions():
    """grown(): a chat turn that outgrows the cache gets a bigger one holding the same
    cached rows and rope keys (a ragged last key block included)."""
    src = make_state()
    big = grown(src, CAP + 21)
    assert big.capacity == CAP + 21 and big.n_cached == CACHED
    for a, b in zip(src.layers, big.layers):
        if isinstance(a, MLAState):
            assert np.array_equal(bits(a.rows(0, CACHED)), bits(b.rows(0, CACHED)))
            assert np.array_equal(bits(a.rope_rows(0, CACHED)), bits(b.rope_rows(0, CACHED)))
        else:
            assert np.array_equal(bits(a.S), bits(b.S))
