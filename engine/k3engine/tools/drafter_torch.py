"""The block drafter's forward pass in PyTorch, written from /work/drafter_contract.md (the
format the engine's NumPy drafter, engine/k3engine/drafter.py, reads): the model
`k3 train-demo-drafter` trains.  tests/test_demo_drafter.py checks it against an independent
float64 NumPy transcription of the contract.

Batched the way training wants it: N sequences (right-padded to T positions), each with A
anchors.  Every block attends to the context keys of ITS anchor's prefix (positions < s) and
to its own B block keys, nothing else: a block-sparse mask over [context ; all blocks], so
one call over N x A blocks computes exactly what N x A separate one-block calls would (a
masked key gets weight exp(-inf) = 0).  The context keys/values depend only on c_p, never on
the anchor, so they are computed once per sequence and shared by all its blocks.

Parameters carry the contract's file names ('.' as '/' inside the ParameterDict), so the
export is a renaming.  The embedding and lm_head are the target's, frozen (buffers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .demo_torch import rmsnorm


def param_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The contract's tensors and shapes, in file order (the engine's one list of them)."""
    from ..drafter import DrafterConfig, drafter_tensors
    dfc = cfg["dflash_config"]
    return drafter_tensors(DrafterConfig(
        "", cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
        cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
        cfg["rms_norm_eps"], cfg["rope_theta"], cfg["vocab_size"], cfg["block_size"],
        tuple(dfc["target_layer_ids"]), dfc["mask_token_id"]))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [..., P, heads, D] at positions pos [..., P]."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
    ang = pos.to(torch.float64)[..., None] * inv                  # [..., P, D/2]
    ang = torch.cat([ang, ang], -1)[..., None, :]                  # over both halves, heads
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + rot * sin


class DrafterTorch(torch.nn.Module):
    def __init__(self, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor, seed: int = 0,
                 dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.eps = float(cfg["rms_norm_eps"])
        self.theta = float(cfg["rope_theta"])
        self.H, self.Hkv, self.D = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                    cfg["head_dim"])
        self.B = cfg["block_size"]
        self.mask_id = cfg["dflash_config"]["mask_token_id"]
        g = torch.Generator().manual_seed(seed)
        params = {}
        for name, shape in param_shapes(cfg).items():
            if len(shape) == 1:
                w = torch.ones(shape, dtype=dtype)                  # norm gains
            else:                                                   # fan-in scaled
                w = torch.randn(shape, generator=g, dtype=torch.float64) / shape[1] ** 0.5
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    w = w / (2 * cfg["num_hidden_layers"]) ** 0.5   # residual branches small
                w = w.to(dtype)
            params[name.replace(".", "/")] = torch.nn.Parameter(w)
        self.p = torch.nn.ParameterDict(params)
        self.register_buffer("embed", embed.to(dtype), persistent=False)
        self.register_buffer("lm_head", lm_head.to(dtype), persistent=False)

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "/")]

    def state(self) -> dict[str, torch.Tensor]:
        """The trained tensors under their file names."""
        return {n.replace("/", "."): p.detach() for n, p in self.p.items()}

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """c_p = rmsnorm(fc @ f_p, hidden_norm) for feats [N, T, n_feat*E]."""
        return rmsnorm(feats @ self.w("fc.weight").T, self.w("hidden_norm.weight"), self.eps)

    def _heads(self, x, n):
        return x.reshape(*x.shape[:-1], n, self.D)

    def hidden(self, feats: torch.Tensor, anchors: torch.Tensor, anchor_ids: torch.Tensor
               ) -> torch.Tensor:
        """The final hidden rows (after `norm`) of every block: [N, A, B, E].
        feats [N, T, n_feat*E] (positions 0..T-1 of each sequence; rows at or after an
        anchor are never read by that anchor's block), anchors [N, A] the positions s,
        anchor_ids [N, A] the tokens at s."""
        N, T = feats.shape[:2]
        A, B, H, Hkv, D = anchors.shape[1], self.B, self.H, self.Hkv, self.D
        c = self.context(feats)                                       # [N, T, E]
        ids = torch.full((N, A, B), self.mask_id, dtype=torch.long)
        ids[:, :, 0] = anchor_ids
        x = self.embed[ids.reshape(N, A * B)]                          # [N, AB, E]
        pos_b = (anchors[:, :, None] + torch.arange(B)).reshape(N, A * B)
        pos_c = torch.arange(T).expand(N, T)
        # [N, AB, T + AB]: context p < s of the row's anchor, and the row's own block
        ctx_ok = pos_c[:, None, :] < anchors.repeat_interleave(B, 1)[:, :, None]
        blk = torch.arange(A).repeat_interleave(B)
        blk_ok = (blk[:, None] == blk[None, :]).expand(N, A * B, A * B)
        allowed = torch.cat([ctx_ok, blk_ok], -1)[:, None]             # over heads
        bias = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill(~allowed, float("-inf"))
        for l in range(self.cfg["num_hidden_layers"]):
            p = f"layers.{l}."
            a = p + "self_attn."
            kn, qn = self.w(a + "k_norm.weight"), self.w(a + "q_norm.weight")
            kc = rope(rmsnorm(self._heads(c @ self.w(a + "k_proj.weight").T, Hkv), kn, self.eps),
                      pos_c, self.theta)
            vc = self._heads(c @ self.w(a + "v_proj.weight").T, Hkv)
            h = rmsnorm(x, self.w(p + "input_layernorm.weight"), self.eps)
            q = rope(rmsnorm(self._heads(h @ self.w(a + "q_proj.weight").T, H), qn, self.eps),
                     pos_b, self.theta)
            kb = rope(rmsnorm(self._heads(h @ self.w(a + "k_proj.weight").T, Hkv), kn, self.eps),
                      pos_b, self.theta)
            vb = self._heads(h @ self.w(a + "v_proj.weight").T, Hkv)
            # [N, heads, keys, D], context first; query head j reads kv head j // (H/Hkv)
            k = torch.cat([kc, kb], 1).transpose(1, 2).repeat_interleave(H // Hkv, 1)
            v = torch.cat([vc, vb], 1).transpose(1, 2).repeat_interleave(H // Hkv, 1)
            att = torch.softmax(q.transpose(1, 2) @ k.transpose(-1, -2) / D ** 0.5 + bias, -1)
            o = (att @ v).transpose(1, 2).reshape(N, A * B, H * D)
            x = x + o @ self.w(a + "o_proj.weight").T
            g = rmsnorm(x, self.w(p + "post_attention_layernorm.weight"), self.eps)
            m = p + "mlp."
            x = x + (F.silu(g @ self.w(m + "gate_proj.weight").T) *
                     (g @ self.w(m + "up_proj.weight").T)) @ self.w(m + "down_proj.weight").T
        return rmsnorm(x, self.w("norm.weight"), self.eps).reshape(N, A, B, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's lm_head over hidden rows [..., E] -> [..., V]."""
        return hidden @ self.lm_head.T

    def forward(self, feats, anchors, anchor_ids) -> torch.Tensor:
        """Logits of every block row: [N, A, B, V] (row 0, the anchor's, is never a draft)."""
        return self.logits(self.hidden(feats, anchors, anchor_ids))

    @torch.no_grad()
    def drafts(self, feats, anchors, anchor_ids) -> torch.Tensor:
        """d_1..d_{B-1} of every block [N, A, B-1]: argmax, lowest index on ties (torch's
        argmax returns the first maximal index)."""
        return self.logits(self.hidden(feats, anchors, anchor_ids)[:, :, 1:]).argmax(-1)
