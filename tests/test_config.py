"""Strict config reader (ARCHITECTURE §1) and layer map (§2)."""
import copy
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from k3engine.config import (ConfigError, load_config, parse_config,
                             to_flat_dict, to_nested_dict)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("K3_SHARED", REPO.parent / "shared"))
PEER = SHARED / "fixtures" / "peer"

# The tiny flat config of §1.3 (the op fixtures' "config"; test_manifest_config checks it).
TINY = {
    "hidden_size": 128, "num_hidden_layers": 13, "vocab_size": 256, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "kda_num_heads": 4, "kda_head_dim": 16,
    "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "num_attention_heads": 4,
    "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "mla_use_output_gate": True, "num_experts": 8,
    "num_experts_per_token": 2, "num_shared_experts": 2, "routed_expert_hidden_size": 64,
    "moe_intermediate_size": 48, "routed_scaling_factor": 1.0, "moe_renormalize": True,
    "latent_moe_use_norm": True, "first_k_dense_replace": 1, "intermediate_size": 96,
    "attn_res_block_size": 3, "situ_beta": 4.0, "situ_linear_beta": 25.0,
    "full_attn_layers": [4, 8, 12, 13],
}

# Keys that move into text_config.linear_attn_config in the nested shape (flat -> nested).
LIN_KEYS = {"kda_num_heads": "num_heads", "kda_head_dim": "head_dim",
            "short_conv_kernel_size": "short_conv_kernel_size",
            "gate_lower_bound": "gate_lower_bound", "full_attn_layers": "full_attn_layers"}
BETA_KEYS = {"situ_beta": "activation_situ_beta",
             "situ_linear_beta": "activation_situ_linear_beta"}

REAL_FULL_ATTN = list(range(4, 93, 4)) + [93]


def peer(*parts):
    path = PEER.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared fixtures not found at {PEER}")
    return path


def nested(flat):
    """Hand-built nested copy of a flat config (independent of to_nested_dict)."""
    text = {BETA_KEYS.get(k, k): v for k, v in flat.items() if k not in LIN_KEYS}
    lin = {LIN_KEYS[k]: v for k, v in flat.items() if k in LIN_KEYS}
    text["linear_attn_config"] = lin
    return {"model_type": "kimi_k3", "text_config": text}


def tiny(**changes):
    d = copy.deepcopy(TINY)
    for k, v in changes.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    return d


def refused(obj, *fragments, source="<dict>"):
    with pytest.raises(ConfigError) as info:
        parse_config(obj, source)
    msg = str(info.value)
    assert msg.startswith(f"{source}: "), msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


# --- the valid tiny config ------------------------------------------------------------

def check_tiny(cfg):
    assert (cfg.hidden, cfg.n_layers, cfg.vocab) == (128, 13, 256)
    assert cfg.rms_eps == float(np.float32(1e-5))
    assert (cfg.kda_heads, cfg.kda_head_dim, cfg.conv_k, cfg.gate_lb) == (4, 16, 4, -5.0)
    assert (cfg.n_heads, cfg.q_lora, cfg.kv_lora) == (4, 64, 32)
    assert (cfg.qk_nope, cfg.qk_rope, cfg.v_head) == (24, 8, 16)
    assert (cfg.n_experts, cfg.topk, cfg.n_shared, cfg.latent, cfg.moe_inter) == (8, 2, 2, 64, 48)
    assert (cfg.routed_scale, cfg.first_dense, cfg.dense_inter, cfg.attn_res_block) == (1.0, 1, 96, 3)
    assert (cfg.situ_b1, cfg.situ_b2) == (4.0, 25.0)
    assert cfg.mla_out_gate and cfg.moe_renorm and cfg.latent_norm
    assert cfg.full_attn == (4, 8, 12, 13)
    assert (cfg.kda_proj, cfg.qk_head, cfg.shared_inter) == (64, 32, 96)


def test_manifest_config():
    manifest = json.loads(peer("ops", "MANIFEST.json").read_text())
    assert manifest["config"] == TINY
    cfg = parse_config(manifest["config"])
    check_tiny(cfg)
    assert cfg.shape == "flat" and cfg.source == "<dict>"


def test_tiny_layer_map():
    cfg = parse_config(TINY)
    assert cfg.layer_map() == "KKKMKKKMKKKMM"
    assert cfg.mla_layers == (3, 7, 11, 12)
    assert cfg.kda_layers == (0, 1, 2, 4, 5, 6, 8, 9, 10)
    assert [L for L in range(13) if cfg.is_boundary(L)] == [0, 3, 6, 9, 12]
    assert [L for L in range(13) if cfg.is_dense(L)] == [0]
    assert cfg.is_kda(0) and cfg.is_mla(12)
    with pytest.raises(IndexError):
        cfg.is_mla(13)


def test_floats_are_float32():
    cfg = parse_config(tiny(rms_norm_eps=1e-5, situ_beta=0.1))
    assert cfg.rms_eps == float(np.float32(1e-5)) != 1e-5
    assert cfg.situ_b1 == float(np.float32(0.1))


# --- the three negative fixtures (§1.4) -----------------------------------------------

@pytest.mark.parametrize("name, fragments", [
    ("no_layermap", ["missing required field", "full_attn_layers"]),
    ("bad_layer_index", ["full_attn_layers entry 999 is outside 1..13 (one-based)"]),
    ("bad_topk", ["num_experts_per_token 128", "64"]),
])
def test_peer_refusals(name, fragments):
    path = peer("cfg", f"{name}.json")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg
    for frag in fragments:
        assert frag in msg, msg


# --- rule 1: missing fields, all at once ----------------------------------------------

def test_only_a_situ_beta_missing():  # trap #1: the betas' defaults would look right
    msg = refused(tiny(situ_linear_beta=None), "activation_situ_linear_beta")
    assert "activation_situ_beta," not in msg and "full_attn_layers" not in msg


def test_all_missing_fields_in_one_message():
    d = tiny(hidden_size=None, situ_beta=None, kda_head_dim=None, full_attn_layers=[],
             num_experts="8", mla_use_output_gate=None)
    msg = refused(d, "missing required field")
    listed = msg.split(": ")[-1].split(", ")
    assert listed == ["hidden_size", "head_dim", "num_experts",
                      "activation_situ_beta", "full_attn_layers"]


def test_empty_config_lists_all_26_required_fields():
    msg = refused({}, "missing required field")
    assert len(msg.split(": ")[-1].split(", ")) == 26


@pytest.mark.parametrize("bad", [True, False, None, "128", [128], {"v": 128}, float("nan")])
def test_non_number_int_field_is_missing(bad):
    refused({**TINY, "hidden_size": bad}, "missing required field", "hidden_size")


def test_ints_given_as_floats_truncate():
    cfg = parse_config(tiny(kda_num_heads=4.9, num_experts=8.99,
                            full_attn_layers=[4.5, 8.0, 12.9, 13.2]))
    assert cfg.kda_heads == 4 and cfg.n_experts == 8
    assert cfg.full_attn == (4, 8, 12, 13)
    assert parse_config(tiny(first_k_dense_replace=-0.5)).first_dense == 0  # not floor


def test_full_attn_layers_shapes():
    refused(tiny(full_attn_layers=4), "missing required field", "full_attn_layers")
    refused(tiny(full_attn_layers=[4, "8"]), "full_attn_layers entry '8' is not a number")
    refused(tiny(full_attn_layers=[4, True]), "full_attn_layers entry True is not a number")
    refused(tiny(num_hidden_layers=200, full_attn_layers=list(range(1, 130))),
            "full_attn_layers has 129 entries", "128")


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), (0, False), (2.5, True), ("false", True), (None, True),
])
def test_optional_booleans(value, expected):
    # None: absent (tiny() deletes the keys)
    d = tiny(mla_use_output_gate=value, moe_renormalize=value, latent_moe_use_norm=value)
    cfg = parse_config(d)
    assert cfg.mla_out_gate is expected and cfg.moe_renorm is expected
    assert cfg.latent_norm is expected


# --- nested shape and lookup order (§1.2) ---------------------------------------------

def test_nested_tiny_parses_equal():  # trap #3
    cfg = parse_config(nested(TINY))
    assert cfg == parse_config(TINY)
    assert cfg.shape == "nested"
    assert cfg.layer_map() == "KKKMKKKMKKKMM"


def test_nested_falls_back_to_root():
    d = nested(TINY)
    d["vocab_size"] = d["text_config"].pop("vocab_size")
    assert parse_config(d).vocab == 256


def test_first_hit_wins_whatever_its_type():
    d = nested(TINY)
    d["hidden_size"] = 128
    d["text_config"]["hidden_size"] = "128"
    refused(d, "missing required field", "hidden_size")


def test_primary_key_before_alias():
    cfg = parse_config(tiny(num_heads=8, kda_num_heads=4))
    assert cfg.kda_heads == 8


def test_text_config_shadowing_head_dim_refused():
    d = nested(TINY)
    d["text_config"]["head_dim"] = 64
    refused(d, "text_config.head_dim = 64", "linear_attn_config.head_dim = 16")


def test_text_config_shadowing_layer_list_refused():
    d = nested(TINY)
    d["text_config"]["full_attn_layers"] = [1, 2, 3]
    refused(d, "text_config.full_attn_layers", "[1, 2, 3]", "[4, 8, 12, 13]")


def test_text_config_repeating_same_value_accepted():
    d = nested(TINY)
    d["text_config"]["head_dim"] = 16.0
    d["text_config"]["num_heads"] = "not a number"  # not numeric: no shadowing claim
    with pytest.raises(ConfigError, match="missing required field.*num_heads"):
        parse_config(d)
    del d["text_config"]["num_heads"]
    assert parse_config(d) == parse_config(TINY)


def test_sub_objects_must_be_objects():
    refused({**TINY, "text_config": [1]}, "text_config is not a JSON object")
    d = nested(TINY)
    d["text_config"]["linear_attn_config"] = None
    refused(d, "linear_attn_config is not a JSON object")
    refused([TINY], "root is not a JSON object")


# --- the real K3 map (trap #2) --------------------------------------------------------

REAL = {
    "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "kda_num_heads": 96, "kda_head_dim": 128,
    "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "num_attention_heads": 96,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "mla_use_output_gate": True, "num_experts": 896,
    "num_experts_per_token": 16, "num_shared_experts": 2, "routed_expert_hidden_size": 3584,
    "moe_intermediate_size": 3072, "routed_scaling_factor": 1.0, "moe_renormalize": True,
    "latent_moe_use_norm": True, "first_k_dense_replace": 1, "intermediate_size": 33792,
    "attn_res_block_size": 12, "situ_beta": 4.0, "situ_linear_beta": 25.0,
    "full_attn_layers": REAL_FULL_ATTN,
}


def test_real_k3_map():
    cfg = parse_config(nested(REAL))
    assert cfg.shape == "nested" and len(cfg.full_attn) == 24
    assert len(cfg.mla_layers) == 24 and len(cfg.kda_layers) == 69
    assert cfg.mla_layers == tuple(range(3, 88, 4)) + (91, 92)
    assert cfg.is_kda(0) and cfg.is_dense(0) and not cfg.is_dense(1)
    assert cfg.is_mla(91) and cfg.is_mla(92)
    assert [L for L in range(93) if cfg.is_boundary(L)] == list(range(0, 85, 12))
    assert sum(not cfg.is_dense(L) for L in range(93)) == 92
    assert (cfg.kda_proj, cfg.qk_head, cfg.shared_inter) == (12288, 192, 6144)


# --- rules 2-8 and the extras ----------------------------------------------------------

@pytest.mark.parametrize("changes, fragment", [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be > 0 (got 0)"),
    ({"hidden_size": -1}, "hidden_size must be > 0 (got -1)"),
    ({"vocab_size": 0}, "vocab_size must be > 0 (got 0)"),
    ({"full_attn_layers": list(range(1, 14))}, "at least one layer must be KDA"),
    ({"full_attn_layers": [4, 8, 12, 13, 13, 13, 13, 13, 13, 13, 13, 13, 13]},
     "at least one layer must be KDA"),
    ({"full_attn_layers": [0, 8, 12, 13]}, "full_attn_layers entry 0 is outside 1..13"),
    ({"full_attn_layers": [4, 8, 12, 14]}, "full_attn_layers entry 14 is outside 1..13"),
    ({"num_experts_per_token": 65, "num_experts": 100},
     "num_experts_per_token 65 exceeds the routing limit 64"),
    ({"num_experts_per_token": 9}, "num_experts_per_token 9 exceeds num_experts 8"),
    ({"attn_res_block_size": 0}, "attn_res_block_size must be > 0 (got 0)"),
    ({"short_conv_kernel_size": 0}, "short_conv_kernel_size must be >= 1 (got 0)"),
    ({"num_experts_per_token": 0}, "num_experts_per_token must be >= 1 (got 0)"),
    ({"qk_rope_head_dim": 0}, "qk_rope_head_dim must be > 0 (got 0)"),
    ({"kda_head_dim": -16}, "head_dim must be > 0 (got -16)"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be > 0 (got 0)"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace must be >= 0 (got -1)"),
    ({"num_experts_per_token": 10**400}, "exceeds the routing limit 64"),
    ({"rms_norm_eps": 1e40}, "rms_norm_eps = 1e+40 is not a finite float32"),
])
def test_validation_rules(changes, fragment):
    refused(tiny(**changes), fragment)


def test_rules_run_in_order():
    # rule 2 before rule 4; rule 5 before rule 6 (bad_topk fails both)
    refused(tiny(num_hidden_layers=0, full_attn_layers=[999]), "num_hidden_layers")
    refused(tiny(num_experts_per_token=128), "routing limit 64")


def test_constructor_revalidates():
    cfg = parse_config(TINY)
    with pytest.raises(ConfigError, match="entry 14 is outside"):
        dataclasses.replace(cfg, full_attn=(4, 14))
    assert dataclasses.replace(cfg, gate_lb=-5.1).gate_lb == float(np.float32(-5.1))


# --- writers and round trips ----------------------------------------------------------

def test_flat_writer_reproduces_fixture_config():
    out = to_flat_dict(parse_config(TINY))
    assert out == TINY and list(out) == list(TINY)
    assert out["rms_norm_eps"] == 1e-05  # shortest float32 decimal, not 9.99999974e-06


def test_nested_writer_shape():
    out = to_nested_dict(parse_config(TINY))
    assert out["model_type"] == "kimi_k3"
    text = out["text_config"]
    lin = text["linear_attn_config"]
    assert text["activation_situ_beta"] == 4.0 and text["activation_situ_linear_beta"] == 25.0
    assert lin["num_heads"] == 4 and lin["head_dim"] == 16 and lin["use_full_rank_gate"] is True
    assert lin["full_attn_layers"] == [4, 8, 12, 13]
    assert lin["kda_layers"] == [1, 2, 3, 5, 6, 7, 9, 10, 11]


@pytest.mark.parametrize("flat", [TINY, REAL, tiny(rms_norm_eps=3e-7, situ_beta=0.1,
                                                     routed_scaling_factor=2.827,
                                                     mla_use_output_gate=False)])
@pytest.mark.parametrize("writer, shape", [(to_flat_dict, "flat"), (to_nested_dict, "nested")])
def test_round_trip(tmp_path, flat, writer, shape):
    cfg = parse_config(flat)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(writer(cfg), indent=2))
    back = load_config(path)
    assert back == cfg
    assert back.shape == shape and back.source == str(path)
    assert all(getattr(back, f.name) == getattr(cfg, f.name) for f in dataclasses.fields(cfg)
               if f.compare)


# --- load_config ----------------------------------------------------------------------

def test_load_valid_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(nested(TINY)))
    cfg = load_config(path)
    check_tiny(cfg)
    assert cfg.source == str(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope" / "config.json"
    with pytest.raises(ConfigError, match="file not found") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_directory_is_unreadable(tmp_path):
    with pytest.raises(ConfigError, match="cannot read file") as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("text, fragment", [
    ('{"hidden_size": 128,', "invalid JSON"),
    ("", "invalid JSON"),
    ('{"hidden_size": NaN}', "non-standard JSON constant NaN"),
    (b'{"a": "\xff"}', "not UTF-8"),
    ('{"hidden_size": 128, "hidden_size": 256}', "duplicate key 'hidden_size'"),
    ('{"text_config": {"linear_attn_config": {"head_dim": 1, "head_dim": 2}}}',
     "duplicate key 'head_dim'"),
    ("[1, 2]", "root is not a JSON object (found list)"),
])
def test_bad_files(tmp_path, text, fragment):
    path = tmp_path / "config.json"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and fragment in msg, msg
