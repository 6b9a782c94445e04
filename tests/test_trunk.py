"""The packed trunk and the streamed trunk: identical ids in every residency layout, the
ring rules, and damaged or foreign trunks refused naming the file and the mismatch."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from engine_helpers import GOLDEN_SEED, golden_prompt, greedy_incremental, make_tiny
from k3engine.bind import Binder, CheckpointExperts
from k3engine.checkpoint import Checkpoint
from k3engine.config import load_config
from k3engine.experts import ResidentExperts
from k3engine.model import Model
from k3engine.trunk import (TRUNK_BIN, TRUNK_JSON, PackCancelled, StreamedTrunk, TrunkError,
                            TrunkManifest, TrunkMismatchError, pack_trunk)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "tiny_seed1234.json").read_text())
N = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("trunk") / "tiny", GOLDEN_SEED)


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("trunk") / "packed")
    pack_trunk(tiny, d)
    return d


class _LM:
    def __init__(self, model):
        self.model = model


def run_streamed(tiny, trunk_dir, pinned, ring):
    cfg = load_config(os.path.join(tiny, "config.json"))
    ck = Checkpoint(tiny)
    b = Binder(ck, cfg)
    m = TrunkManifest.load(trunk_dir)
    m.check_against(ck, cfg.n_layers)
    st = StreamedTrunk(m, b, b.tables(), cfg.n_layers, pinned, ring)
    try:
        ids, _ = greedy_incremental(_LM(Model(cfg, st, ResidentExperts(CheckpointExperts(b)))),
                                    golden_prompt(), N)
        return ids, st
    finally:
        st.close()
        ck.close()


@pytest.mark.parametrize("pinned, ring", [
    (range(13), 2), ((), 1), ((), 2), ((), 3), ((0, 3, 7), 2), ((0,), 1), ((5,), 8)])
def test_ids_identical_in_every_residency_layout(tiny, packed, pinned, ring):
    ids, st = run_streamed(tiny, packed, set(pinned), ring)
    print(f"[gate] trunk pinned {sorted(pinned)[:4]}{'...' if len(pinned) > 4 else ''} ring "
          f"{ring}: ids {ids} vs resident golden {GOLDEN['generated_ids'][:N]}; binds "
          f"{st.binds}, hits {st.hits}, reads {st.misses}, {st.bytes_read} B, O_DIRECT {st.direct}")
    assert ids == GOLDEN["generated_ids"][:N]
    assert st.read_ahead == (st.nslot >= 2)            # one slot: never a read-ahead
    m = TrunkManifest.load(packed)
    passes = N + 1
    # every pass reads at most the unpinned layers, plus the pinned ones once
    assert st.bytes_read <= passes * m.total_bytes()


def test_pack_layout(packed, tiny):
    m = TrunkManifest.load(packed)
    raw = json.loads(Path(packed, TRUNK_JSON).read_text())
    assert raw["align"] == 4096 and len(raw["layers"]) == 13
    assert all(layer.file_off % 4096 == 0 and layer.nbytes % 4096 == 0 for layer in m.layers)
    assert os.path.getsize(Path(packed, TRUNK_BIN)) % 4096 == 0
    with Checkpoint(tiny) as ck:            # bytes copied verbatim
        name = "language_model.model.layers.4.self_attn.q_proj.weight"
        t = m.layers[4].tensors[name]
        with open(Path(packed, TRUNK_BIN), "rb") as f:
            f.seek(m.layers[4].file_off + t.off)
            assert f.read(t.nbytes) == ck.read(name).tobytes()


def test_truncated_trunk_bin_refused(tmp_path, packed):
    d = tmp_path / "t"
    shutil.copytree(packed, d)
    with open(d / TRUNK_BIN, "r+b") as f:
        f.truncate(os.path.getsize(d / TRUNK_BIN) - 4096)
    with pytest.raises(TrunkError, match=r"trunk\.bin: layer 12 run .* passes the end of trunk\.bin"):
        TrunkManifest.load(str(d))


def test_edited_trunk_json_refused(tmp_path, packed, tiny):
    d = tmp_path / "t"
    shutil.copytree(packed, d)
    raw = json.loads((d / TRUNK_JSON).read_text())
    name = "language_model.model.layers.2.self_attn.q_proj.weight"
    raw["layers"][2]["tensors"][name]["shape"] = [32, 256]    # same bytes, other shape
    (d / TRUNK_JSON).write_text(json.dumps(raw))
    m = TrunkManifest.load(str(d))
    with Checkpoint(tiny) as ck, pytest.raises(TrunkMismatchError, match=r"layer 2: .*q_proj"):
        m.check_against(ck, 13)
    raw["layers"][2]["tensors"][name]["off"] = 10**9
    (d / TRUNK_JSON).write_text(json.dumps(raw))
    with pytest.raises(TrunkError, match="lies outside its run"):
        TrunkManifest.load(str(d))
    (d / TRUNK_JSON).write_text("{not json")
    with pytest.raises(TrunkError, match="trunk.json: not valid JSON"):
        TrunkManifest.load(str(d))


def test_trunk_of_another_model_refused(tmp_path, packed):
    other = make_tiny(tmp_path / "other", GOLDEN_SEED)
    cfg = json.loads(Path(other, "config.json").read_text())
    cfg["intermediate_size"] = 128                              # a different model
    Path(other, "config.json").write_text(json.dumps(cfg))
    from k3engine.tools.make_checkpoint import make_checkpoint
    from k3engine.config import parse_config
    shutil.rmtree(other)
    make_checkpoint(other, parse_config(cfg), seed=1)
    with Checkpoint(other) as ck, pytest.raises(TrunkMismatchError, match="does not belong"):
        TrunkManifest.load(packed).check_against(ck, 13)
    d = tmp_path / "p"
    shutil.copytree(packed, d)
    before = (d / TRUNK_JSON).read_bytes()
    with pytest.raises(TrunkMismatchError, match="trunk of a different model"):
        pack_trunk(other, str(d))
    assert (d / TRUNK_JSON).read_bytes() == before


def test_cancelled_pack_leaves_nothing_that_looks_valid(tmp_path, tiny):
    d = tmp_path / "c"
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) > 5
    with pytest.raises(PackCancelled):
        pack_trunk(tiny, str(d), cancel=cancel)
    assert not (d / TRUNK_JSON).exists() and not (d / TRUNK_BIN).exists()
    assert os.listdir(d) == []


def test_short_read_on_a_ring_layer_fails_loudly(tmp_path, packed, tiny):
    d = tmp_path / "s"
    shutil.copytree(packed, d)
    cfg = load_config(os.path.join(tiny, "config.json"))
    with Checkpoint(tiny) as ck:
        b = Binder(ck, cfg)
        st = StreamedTrunk(TrunkManifest.load(str(d)), b, b.tables(), 13, set(), 1)
        os.truncate(d / TRUNK_BIN, 4096)                        # after open
        with pytest.raises(TrunkError, match="short read on layer 0"):
            st.layer(0)
        assert st.binds == 0 and st.bytes_read == 0             # nothing counted
        st.close()


def test_sharded_checkpoint_packs_and_streams(tmp_path):
    """Shard boundaries never split a layer's trunk run (the generator keeps each run in
    one shard, as the released checkpoint does), so a many-shard checkpoint packs."""
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    d = str(tmp_path / "sharded")
    shards = make_checkpoint(d, dims_config("tiny"), seed=GOLDEN_SEED, shard_bytes=300_000)
    pack_trunk(d, str(tmp_path / "t"))
    ids, _ = run_streamed(d, str(tmp_path / "t"), set(), 2)
    print(f"[gate] {len(shards)}-shard checkpoint packed and streamed: {ids}")
    assert len(shards) > 5 and ids == GOLDEN["generated_ids"][:N]
