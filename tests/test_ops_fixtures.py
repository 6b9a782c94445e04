"""Tier 1: every op fixture of the reference (../shared/fixtures/peer/ops) through our own
kernels and forward-pass functions, one test per fixture, within the manifest tolerance."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_close, load_fixture, tens
from k3engine import kernels as K
from k3engine.config import parse_config
from k3engine.model import AttnResStack, decoder_layer, kda, latent_moe, mla
from k3engine.state import KDAState, MLAState
from k3engine.weights import (DenseWeights, ExpertWeights, KDAWeights, LayerWeights,
                              MLAWeights, MoEWeights, fold_phi)


def manifest_cfg():
    return parse_config(load_fixture("ops/MANIFEST.json")["config"], "ops/MANIFEST.json")


def test_rmsnorm():
    fx = load_fixture("ops/rmsnorm.json")
    x = tens(fx, "in")
    y = np.empty_like(x)
    K.rmsnorm(x, tens(fx, "weight"), np.float32(fx["eps"]), y)
    check_close("rmsnorm", y, tens(fx, "out"))


def test_situ_glu():
    fx = load_fixture("ops/situ_glu.json")
    x = tens(fx, "in")
    g, u = np.ascontiguousarray(x[:, :8]), np.ascontiguousarray(x[:, 8:])
    y = np.empty_like(g)
    K.situ_glu(g, u, fx["beta"], fx["linear_beta"], y)
    check_close("situ_glu", y, tens(fx, "out"))
    assert np.max(np.abs(y)) <= fx["beta"] * fx["linear_beta"] + 0.01


def test_shortconv_with_carried_history():
    fx = load_fixture("ops/shortconv.json")
    w = tens(fx, "weight").reshape(fx["channels"], fx["kernel"])
    hist = np.zeros((fx["channels"], fx["kernel"] - 1), np.float32)
    x = tens(fx, "in")[0]
    y = np.empty_like(x)
    K.shortconv(x, w, hist, y)
    check_close("shortconv out", y, tens(fx, "out")[0])
    check_close("shortconv state_after", hist, tens(fx, "state_after")[0])
    x2 = tens(fx, "in_next")[0]
    y2 = np.empty_like(x2)
    K.shortconv(x2, w, hist, y2)          # the only check that the history is READ
    check_close("shortconv out_next", y2, tens(fx, "out_next")[0])


def test_kda_decay():
    fx = load_fixture("ops/kda_decay.json")
    z = tens(fx, "z")[0]
    g, a = np.empty_like(z), np.empty_like(z)
    K.kda_decay(z, tens(fx, "A_log"), tens(fx, "dt_bias"), fx["lower_bound"], g, a)
    dg = np.max(np.abs(g.reshape(-1) - tens(fx, "g").reshape(-1)))
    da = np.max(np.abs(a.reshape(-1) - tens(fx, "alpha").reshape(-1)))
    print(f"[fixture] kda_decay: {g.size} g and alpha values, max |dg| {dg:.2e}, "
          f"max |dalpha| {da:.2e} (limit 1e-5)")
    assert dg <= 1e-5 and da <= 1e-5


@pytest.mark.parametrize("name", ["kda_recur1", "kda_recur8"])
def test_kda_recurrence(name):
    fx = load_fixture(f"ops/{name}.json")
    T, H, D = fx["T"], fx["H"], fx["d_k"]
    assert K.kda_q_scale(D) == np.float32(fx["q_scale"])
    flat = lambda key: np.ascontiguousarray(tens(fx, key).reshape(T, H * D))  # noqa: E731
    S = np.zeros((H, D, D), np.float32)
    o = np.empty((T, H * D), np.float32)
    K.kda_recurrence(S, flat("q"), flat("k"), flat("v"), flat("alpha"),
                     np.ascontiguousarray(tens(fx, "beta").reshape(T, H)), fx["q_scale"], o)
    check_close(f"{name} out", o, tens(fx, "out"))
    check_close(f"{name} state_out", S, tens(fx, "state_out"))


def _kda_weights(fx, p="", conv="_conv", w="") -> KDAWeights:
    g = lambda key: tens(fx, p + key + w)  # noqa: E731
    c = lambda key: np.ascontiguousarray(tens(fx, p + key).reshape(tens(fx, p + key).shape[0], -1))  # noqa: E731
    return KDAWeights(
        q_proj=g("q_proj"), k_proj=g("k_proj"), v_proj=g("v_proj"),
        q_conv=c("q" + conv + w), k_conv=c("k" + conv + w), v_conv=c("v" + conv + w),
        f_a=g("f_a" + ("_proj" if p else "")), f_b=g("f_b" + ("_proj" if p else "")),
        b_proj=g("b_proj"), g_proj=g("g_proj"), o_proj=g("o_proj"),
        A_log=tens(fx, p + "A_log"), dt_bias=tens(fx, p + "dt_bias"),
        o_norm=tens(fx, p + "o_norm" + w))


@pytest.mark.parametrize("name", ["kda_layer1", "kda_layer8"])
def test_kda_layer(name):
    fx = load_fixture(f"ops/{name}.json")
    cfg = manifest_cfg()
    st = KDAState.zeros(cfg)
    y = kda(_kda_weights(fx), tens(fx, "in")[0], st, cfg)
    check_close(f"{name} out", y, tens(fx, "out")[0])
    check_close(f"{name} state_out", st.S, tens(fx, "state_out")[0])


def test_router_bias_reorders_selection():
    fx = load_fixture("ops/router.json")
    x = tens(fx, "in")
    want_idx = tens(fx, "topk_idx", np.float64).astype(int)
    want_w = tens(fx, "topk_weight")
    k = fx["top_k"]
    for r in range(x.shape[0]):
        idx, w = np.empty(k, np.int32), np.empty(k, np.float32)
        K.router(tens(fx, "gate_weight"), x[r], tens(fx, "bias"), k, True, 1.0, idx, w)
        assert set(idx) == set(want_idx[r]), f"row {r}: {sorted(idx)} vs {sorted(want_idx[r])}"
        got_by_id = dict(zip(idx.tolist(), w.tolist()))
        check_close(f"router row {r} weights",
                    [got_by_id[e] for e in want_idx[r]], want_w[r])
    print(f"[fixture] router: {x.shape[0]} rows, index sets equal; fixture says the bias "
          f"changed the selection in {fx['rows_where_bias_changed_selection']} rows")


def test_attnres():
    fx = load_fixture("ops/attnres.json")
    br = tens(fx, "block_residual")                    # [token, snapshot, hidden]
    stack = np.ascontiguousarray(br.transpose(1, 0, 2))
    phi = fold_phi(tens(fx, "norm_weight"), tens(fx, "proj_weight"))
    out = np.empty_like(tens(fx, "prefix_sum"))
    K.attnres(stack, stack.shape[0], tens(fx, "prefix_sum"), phi, fx["eps"], out)
    check_close("attnres", out, tens(fx, "out"))


def _mla_weights(fx, p="") -> MLAWeights:
    g = lambda key: tens(fx, p + key + "_weight")  # noqa: E731
    return MLAWeights(q_a_proj=g("q_a_proj"), q_a_norm=g("q_a_layernorm"),
                      q_b_proj=g("q_b_proj"), kv_a_proj=g("kv_a_proj_with_mqa"),
                      kv_a_norm=g("kv_a_layernorm"), kv_b_proj=g("kv_b_proj"),
                      o_proj=g("o_proj"), g_proj=g("g_proj"))


def test_mla_causal_with_intermediates():
    fx = load_fixture("ops/mla.json")
    cfg = manifest_cfg()
    kappa = np.float32(1) / np.sqrt(np.float32(cfg.qk_nope + cfg.qk_rope))
    assert abs(float(kappa) - fx["scale"]) < 1e-7          # 1/sqrt(32), not 1/sqrt(24)
    x = tens(fx, "in")[0]
    st = MLAState.empty(cfg, x.shape[0])
    w = _mla_weights(fx)
    y = mla(w, x, st, 0, cfg)
    check_close("mla out", y, tens(fx, "out")[0])
    check_close("mla k_rope", st.rope_rows(0, x.shape[0]), tens(fx, "k_rope")[0])
    lat = np.empty((x.shape[0], cfg.kv_lora), np.float32)
    c = np.empty((x.shape[0], w.kv_a_proj.shape[0]), np.float32)
    K.matvec(w.kv_a_proj, x, c)
    K.rmsnorm(np.ascontiguousarray(c[:, :cfg.kv_lora]), w.kv_a_norm, cfg.rms_eps, lat)
    check_close("mla kv_latent", lat, tens(fx, "kv_latent")[0])


class DictExperts:
    """Expert source over float32 fixture weights (the same code path as MXFP4 experts)."""

    def __init__(self, fx, prefix):
        self.fx, self.prefix = fx, prefix

    def batches(self, layer, experts):
        g = lambda e, m: tens(self.fx, f"{self.prefix}experts_{e}_{m}_weight")  # noqa: E731
        yield [(e, ExpertWeights(w1=g(e, "w1"), w3=g(e, "w3"), w2=g(e, "w2"))) for e in experts]


def _moe_weights(fx, p) -> MoEWeights:
    g = lambda key: tens(fx, p + key)  # noqa: E731
    return MoEWeights(router=g("gate_weight"), bias=g("e_score_correction_bias"),
                      down_lat=g("down_weight"), up_lat=g("up_weight"),
                      lat_norm=g("norm_weight"),
                      shared=DenseWeights(gate=g("shared_w1_weight"), up=g("shared_w3_weight"),
                                          down=g("shared_w2_weight")))


def test_moe():
    fx = load_fixture("ops/moe.json")
    cfg = manifest_cfg()
    assert (fx["top_k"], fx["moe_inter"], fx["latent"]) == (cfg.topk, cfg.moe_inter, cfg.latent)
    y = latent_moe(_moe_weights(fx, ""), tens(fx, "in")[0], 1, DictExperts(fx, ""), cfg)
    check_close("moe", y, tens(fx, "out")[0])


@pytest.mark.parametrize("name", ["layer_kda", "layer_mla"])
def test_decoder_layer_attnres_wiring(name):
    fx = load_fixture(f"ops/{name}.json")
    cfg = manifest_cfg()
    L = fx["layer_idx"]
    assert cfg.is_mla(L) == fx["is_mla"] and cfg.attn_res_block == fx["attn_res_block_size"]
    p = "self_attn_"
    attn = _mla_weights(fx, p) if fx["is_mla"] else _kda_weights(fx, p, "_conv1d", "_weight")
    g = lambda key: tens(fx, key + "_weight")  # noqa: E731
    lw = LayerWeights(input_norm=g("input_layernorm"), post_norm=g("post_attention_layernorm"),
                      phi_attn=fold_phi(g("self_attention_res_norm"), g("self_attention_res_proj")),
                      phi_mlp=fold_phi(g("mlp_res_norm"), g("mlp_res_proj")),
                      attn=attn, mlp=_moe_weights(fx, "mlp_"))
    h = tens(fx, "in")[0]
    T = h.shape[0]
    br_in = tens(fx, "block_residual_in")              # [token, snapshot, hidden]
    stack = AttnResStack(br_in.shape[1] + 1, T, cfg.hidden)
    for s in range(br_in.shape[1]):
        stack.push(np.ascontiguousarray(br_in[:, s]))
    st = MLAState.empty(cfg, T) if fx["is_mla"] else KDAState.zeros(cfg)
    out = decoder_layer(L, h.copy(), stack, lw, [(slice(0, T), st, 0)], DictExperts(fx, "mlp_"),
                        cfg)
    check_close(f"{name} out", out, tens(fx, "out")[0])
    br_out = tens(fx, "block_residual_out")
    got = stack.buf[:stack.n].transpose(1, 0, 2)
    assert got.shape == br_out.shape, f"{name}: {got.shape} snapshots vs {br_out.shape}"
    assert np.array_equal(got, br_out), f"{name}: block_residual_out is not an exact copy"
    print(f"[fixture] {name} block_residual_out: {br_out.shape[1]} snapshots, exact")
