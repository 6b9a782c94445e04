"""Checkpoint tensor names and shapes (ARCHITECTURE §3.2-§3.4, SYSTEM §1.5): the one table
both the generator writes from and the binder checks against.

`kind` says how the engine stores a tensor: "M" a large matrix kept in its shipped form
(BF16) and read only through the matvec; "v" a small vector widened to float32; "router"
the MoE gate, read by the router's own sequential kernel; "mxfp4" an expert's packed
nibbles or E8M0 scales (U8).
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
EXPERT_MATRICES = ("w1", "w2", "w3")       # gate, down, up; on-disk order w1, w2, w3


@dataclass(frozen=True)
class TensorDef:
    key: str            # short name within its group, e.g. "q_proj" or "w1.weight_packed"
    name: str           # full checkpoint name
    shape: tuple[int, ...]
    kind: str           # "M", "v", "router", "mxfp4"


def layer_prefix(L: int) -> str:
    return f"{PREFIX}layers.{L}."


def layer_tensors(cfg: ModelConfig, L: int) -> list[TensorDef]:
    """Every trunk tensor of decoder layer L (everything but the routed experts)."""
    E = cfg.hidden
    p = layer_prefix(L)
    out: list[TensorDef] = []

    def add(key: str, shape: tuple[int, ...], kind: str) -> None:
        out.append(TensorDef(key, p + key, shape, kind))

    add("input_layernorm.weight", (E,), "v")
    add("post_attention_layernorm.weight", (E,), "v")
    add("self_attention_res_norm.weight", (E,), "v")
    add("self_attention_res_proj.weight", (1, E), "v")
    add("mlp_res_norm.weight", (E,), "v")
    add("mlp_res_proj.weight", (1, E), "v")
    if cfg.is_kda(L):
        H, D, P, Kc = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_proj, cfg.conv_k
        for m in ("q", "k", "v"):
            add(f"self_attn.{m}_proj.weight", (P, E), "M")
        for m in ("q", "k", "v"):
            add(f"self_attn.{m}_conv1d.weight", (P, 1, Kc), "v")
        add("self_attn.f_a_proj.weight", (D, E), "M")
        add("self_attn.f_b_proj.weight", (P, D), "M")
        add("self_attn.A_log", (D,), "v")          # [D] on disk; the first H are real
        add("self_attn.dt_bias", (P,), "v")
        add("self_attn.b_proj.weight", (H, E), "M")
        add("self_attn.g_proj.weight", (P, E), "M")
        add("self_attn.o_norm.weight", (D,), "v")
        add("self_attn.o_proj.weight", (E, P), "M")
    else:
        Hm, dq, dn, dv = cfg.n_heads, cfg.qk_head, cfg.qk_nope, cfg.v_head
        add("self_attn.q_a_proj.weight", (cfg.q_lora, E), "M")
        add("self_attn.q_a_layernorm.weight", (cfg.q_lora,), "v")
        add("self_attn.q_b_proj.weight", (Hm * dq, cfg.q_lora), "M")
        add("self_attn.kv_a_proj_with_mqa.weight", (cfg.kv_lora + cfg.qk_rope, E), "M")
        add("self_attn.kv_a_layernorm.weight", (cfg.kv_lora,), "v")
        add("self_attn.kv_b_proj.weight", (Hm * (dn + dv), cfg.kv_lora), "M")
        add("self_attn.o_proj.weight", (E, Hm * dv), "M")
        if cfg.mla_out_gate:
            add("self_attn.g_proj.weight", (Hm * dv, E), "M")
    if cfg.is_dense(L):
        add("mlp.gate_proj.weight", (cfg.dense_inter, E), "M")
        add("mlp.up_proj.weight", (cfg.dense_inter, E), "M")
        add("mlp.down_proj.weight", (E, cfg.dense_inter), "M")
    else:
        m = "block_sparse_moe."
        add(m + "gate.weight", (cfg.n_experts, E), "router")
        add(m + "gate.e_score_correction_bias", (cfg.n_experts,), "v")
        add(m + "routed_expert_down_proj.weight", (cfg.latent, E), "M")
        add(m + "routed_expert_up_proj.weight", (E, cfg.latent), "M")
        add(m + "routed_expert_norm.weight", (cfg.latent,), "v")
        add(m + "shared_experts.gate_proj.weight", (cfg.shared_inter, E), "M")
        add(m + "shared_experts.up_proj.weight", (cfg.shared_inter, E), "M")
        add(m + "shared_experts.down_proj.weight", (E, cfg.shared_inter), "M")
    return out


def expert_tensors(cfg: ModelConfig, L: int, e: int) -> list[TensorDef]:
    """The six U8 tensors of routed expert e in layer L, in the released on-disk order
    w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale."""
    p = f"{layer_prefix(L)}block_sparse_moe.experts.{e}."
    out = []
    for m in EXPERT_MATRICES:
        rows, width = (cfg.latent, cfg.moe_inter) if m == "w2" else (cfg.moe_inter, cfg.latent)
        out.append(TensorDef(f"{m}.weight_packed", f"{p}{m}.weight_packed", (rows, width // 2), "mxfp4"))
        out.append(TensorDef(f"{m}.weight_scale", f"{p}{m}.weight_scale", (rows, width // 32), "mxfp4"))
    return out


def model_tensors(cfg: ModelConfig) -> list[TensorDef]:
    E, V = cfg.hidden, cfg.vocab
    return [
        TensorDef("embed_tokens.weight", PREFIX + "embed_tokens.weight", (V, E), "M"),
        TensorDef("norm.weight", PREFIX + "norm.weight", (E,), "v"),
        TensorDef("output_attn_res_norm.weight", PREFIX + "output_attn_res_norm.weight", (E,), "v"),
        TensorDef("output_attn_res_proj.weight", PREFIX + "output_attn_res_proj.weight", (1, E), "v"),
        TensorDef("lm_head.weight", LM_HEAD, (V, E), "M"),
    ]
