"""Independent float64 NumPy reference of the Kimi K3 forward pass (test oracle).

Written from ``/work/shared/spec/ARCHITECTURE.md`` only (§1.1–1.2 config, §2 layer map,
§3 tensor names/shapes, §4 forward pass, §5.5 widening, §5.6 MXFP4, §6 state).  It
deliberately imports nothing from ``k3engine``: its own safetensors reader, its own config
lookup, its own name table, its own kernels.  Everything is computed in float64
(transcendentals included); the numeric *orders* of §5 are not reproduced, only the
semantics, so agreement with the engine is expected at tolerance level, not bitwise.

Usage::

    ref = RefModel("/path/to/model_dir")
    logits = ref.logits_all([3, 7, 11])      # [T, V] float64, fresh state, causal

``perturb`` (negative controls for the oracle test) deliberately breaks one semantic so a
test can prove the comparison is able to fail:

* ``"mla_scale_nope"``        MLA scores scaled by 1/sqrt(d_n) instead of 1/sqrt(d_n+d_r)
* ``"mla_no_rope"``           MLA scores drop the d_r (unrotated) rope terms
* ``"kda_no_qscale"``         KDA query not multiplied by D^-1/2
* ``"kda_gate_before_norm"``  KDA output gated by sigmoid(g_proj x) *before* the head RMSNorm
* ``"no_router_bias"``        router selection ignores ``e_score_correction_bias``
* ``"router_biased_weights"`` combining weights taken from the biased scores
* ``"attnres_no_clear"``      at a boundary the running sum is pushed but NOT cleared
"""
from __future__ import annotations

import glob
import json
import os
import struct

import numpy as np

PERTURBATIONS = ("mla_scale_nope", "mla_no_rope", "kda_no_qscale", "kda_gate_before_norm",
                 "no_router_bias", "router_biased_weights", "attnres_no_clear")

# --------------------------------------------------------------------------------------
# safetensors (§3.1)
# --------------------------------------------------------------------------------------
_ST_DTYPES = {"U8": (np.uint8, 1), "BF16": (np.uint16, 2), "F16": (np.float16, 2),
              "F32": (np.float32, 4), "F64": (np.float64, 8)}


def _read_safetensors_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: truncated safetensors header length")
        n = struct.unpack("<Q", raw)[0]
        hdr = json.loads(f.read(n).decode("utf-8"))
    return hdr, 8 + n


class SafeTensors:
    """Minimal reader: one ``model.safetensors`` or every ``*.safetensors`` in ``model_dir``
    (shards in sorted file-name order).  Duplicate names are refused.  ``get`` returns the
    tensor as stored (BF16 widened to float32 by ``bits << 16``; U8 left as uint8)."""

    def __init__(self, model_dir: str):
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.isfile(single):
            files = [single]
        else:
            files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self.files = files
        self.index: dict[str, tuple[str, str, list[int], int, int]] = {}
        for path in files:
            hdr, data_start = _read_safetensors_header(path)
            fsize = os.path.getsize(path)
            for name, meta in hdr.items():
                if name == "__metadata__":
                    continue
                if name in self.index:
                    raise ValueError(f"duplicate tensor {name} in {path}")
                dt = meta["dtype"]
                if dt not in _ST_DTYPES:
                    raise ValueError(f"{name}: unsupported dtype {dt}")
                shape = [int(s) for s in meta["shape"]]
                b0, b1 = (int(x) for x in meta["data_offsets"])
                numel = int(np.prod(shape)) if shape else 1
                if b1 - b0 != numel * _ST_DTYPES[dt][1]:
                    raise ValueError(f"{name}: byte span {b1 - b0} != numel*size")
                if data_start + b1 > fsize:
                    raise ValueError(f"{name}: data outside {path}")
                self.index[name] = (path, dt, shape, data_start + b0, b1 - b0)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str) -> np.ndarray:
        if name not in self.index:
            raise KeyError(f"tensor {name} not found")
        path, dt, shape, off, nbytes = self.index[name]
        npdt, _ = _ST_DTYPES[dt]
        with open(path, "rb") as f:
            f.seek(off)
            buf = f.read(nbytes)
        a = np.frombuffer(buf, dtype=np.dtype(npdt).newbyteorder("<")).copy()
        if dt == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        return a.reshape(shape)

    def f64(self, name: str) -> np.ndarray:
        a = self.get(name)
        if a.dtype == np.uint8:
            raise TypeError(f"{name} is U8; use the MXFP4 decoder")
        return a.astype(np.float64)


# --------------------------------------------------------------------------------------
# config (§1.1, §1.2)
# --------------------------------------------------------------------------------------
_INT_FIELDS = {  # engine name: (primary, alias)
    "hidden": ("hidden_size", None), "n_layers": ("num_hidden_layers", None),
    "vocab": ("vocab_size", None), "kda_heads": ("num_heads", "kda_num_heads"),
    "kda_head_dim": ("head_dim", "kda_head_dim"), "conv_k": ("short_conv_kernel_size", None),
    "n_heads": ("num_attention_heads", None), "q_lora": ("q_lora_rank", None),
    "kv_lora": ("kv_lora_rank", None), "qk_nope": ("qk_nope_head_dim", None),
    "qk_rope": ("qk_rope_head_dim", None), "v_head": ("v_head_dim", None),
    "n_experts": ("num_experts", None), "topk": ("num_experts_per_token", None),
    "n_shared": ("num_shared_experts", None), "latent": ("routed_expert_hidden_size", None),
    "moe_inter": ("moe_intermediate_size", None), "first_dense": ("first_k_dense_replace", None),
    "dense_inter": ("intermediate_size", None), "attn_res_block": ("attn_res_block_size", None),
}
_FLOAT_FIELDS = {
    "rms_eps": ("rms_norm_eps", None), "gate_lb": ("gate_lower_bound", None),
    "routed_scale": ("routed_scaling_factor", None),
    "situ_b1": ("activation_situ_beta", "situ_beta"),
    "situ_b2": ("activation_situ_linear_beta", "situ_linear_beta"),
}
_BOOL_FIELDS = {"mla_out_gate": "mla_use_output_gate", "moe_renorm": "moe_renormalize",
                "latent_norm": "latent_moe_use_norm"}


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class RefConfig:
    def __init__(self, root: dict):
        txt = root.get("text_config") if isinstance(root.get("text_config"), dict) else None
        base = txt if txt is not None else root
        lin = base.get("linear_attn_config") if isinstance(base.get("linear_attn_config"),
                                                           dict) else None
        self.nested = txt is not None
        objs = [o for o in (txt, lin, root) if o is not None]
        missing = []

        def find(primary, alias):
            for o in objs:
                for n in (primary, alias):
                    if n is not None and n in o:
                        return True, o[n]
            return False, None

        for attr, (p, a) in _INT_FIELDS.items():
            ok, v = find(p, a)
            if not ok or not _is_num(v):
                missing.append(p)
                continue
            setattr(self, attr, int(v))
        for attr, (p, a) in _FLOAT_FIELDS.items():
            ok, v = find(p, a)
            if not ok or not _is_num(v):
                missing.append(p)
                continue
            setattr(self, attr, float(v))
        for attr, p in _BOOL_FIELDS.items():
            ok, v = find(p, None)
            setattr(self, attr, bool(v) if ok and (isinstance(v, bool) or _is_num(v)) else True)
        ok, fal = find("full_attn_layers", None)
        if not ok or not isinstance(fal, list) or not fal:
            missing.append("full_attn_layers")
        else:
            if not all(_is_num(x) for x in fal):
                raise ValueError("full_attn_layers has a non-number")
            self.full_attn = [int(x) for x in fal]
        if missing:
            raise ValueError(f"config missing: {', '.join(missing)}")
        if not all(1 <= x <= self.n_layers for x in self.full_attn):
            raise ValueError("full_attn_layers out of range (one-based)")

    @classmethod
    def from_file(cls, path: str) -> "RefConfig":
        with open(path) as f:
            return cls(json.load(f))

    def is_mla(self, L: int) -> bool:
        return (L + 1) in self.full_attn

    def is_dense(self, L: int) -> bool:
        return L < self.first_dense

    def is_boundary(self, L: int) -> bool:
        return L % self.attn_res_block == 0


# --------------------------------------------------------------------------------------
# MXFP4 (§5.6)
# --------------------------------------------------------------------------------------
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float64)


def mxfp4_dequant(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """packed U8 [rows, n/2], scale U8 [rows, n/32] -> float64 [rows, n]."""
    packed = np.asarray(packed, np.uint8)
    scale = np.asarray(scale, np.uint8)
    rows, half = packed.shape
    n = half * 2
    if scale.shape != (rows, n // 32) or n % 32:
        raise ValueError(f"MXFP4 shapes {packed.shape} / {scale.shape} inconsistent")
    vals = np.empty((rows, n), np.float64)
    vals[:, 0::2] = E2M1[packed & 0x0F]          # low nibble = even element
    vals[:, 1::2] = E2M1[packed >> 4]            # high nibble = odd element
    sc = np.ldexp(1.0, scale.astype(np.int64) - 127)   # 2^(b-127), exact in float64
    sc = np.where(scale == 255, 0.0, sc)          # 255 -> whole group contributes zero
    return vals * np.repeat(sc, 32, axis=1)


# --------------------------------------------------------------------------------------
# primitives (§4.1), all float64; x is [..., n]
# --------------------------------------------------------------------------------------
def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def rmsnorm(x, w, eps):
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * w


def l2norm(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def situ_glu(g, u, b1, b2):
    a = b1 * np.tanh(g / b1) * sigmoid(g)
    c = b2 * np.tanh(u / b2)
    return a * c


def attnres(sources: list, phi: np.ndarray, eps: float) -> np.ndarray:
    """sources: list of [T, E] (oldest snapshot first, current running sum last)."""
    V = np.stack(sources, axis=0)                             # [S, T, E]
    keys = V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + eps)
    sc = keys @ phi                                           # [S, T]
    sc = sc - sc.max(axis=0, keepdims=True)
    e = np.exp(sc)
    p = e / e.sum(axis=0, keepdims=True)
    return np.einsum("st,ste->te", p, V)


# --------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------
PRE = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"


class RefModel:
    def __init__(self, model_dir: str, perturb: str | None = None):
        if perturb is not None and perturb not in PERTURBATIONS:
            raise ValueError(f"unknown perturbation {perturb!r}")
        self.perturb = perturb
        self.cfg = RefConfig.from_file(os.path.join(model_dir, "config.json"))
        self.st = SafeTensors(model_dir)
        self._cache: dict[str, np.ndarray] = {}
        self._check_shapes()

    # ---- weights ---------------------------------------------------------------------
    def w(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = self.st.f64(name)
        return self._cache[name]

    def lw(self, L: int, rest: str) -> np.ndarray:
        return self.w(f"{PRE}layers.{L}.{rest}")

    def expert(self, L: int, X: int, which: str) -> np.ndarray:
        key = f"{PRE}layers.{L}.block_sparse_moe.experts.{X}.{which}"
        if key not in self._cache:
            self._cache[key] = mxfp4_dequant(self.st.get(key + ".weight_packed"),
                                             self.st.get(key + ".weight_scale"))
        return self._cache[key]

    def _check_shapes(self) -> None:
        c = self.cfg
        E, P, D = c.hidden, c.kda_heads * c.kda_head_dim, c.kda_head_dim
        want = {f"{PRE}embed_tokens.weight": [c.vocab, E], LM_HEAD: [c.vocab, E],
                f"{PRE}norm.weight": [E], f"{PRE}output_attn_res_norm.weight": [E],
                f"{PRE}output_attn_res_proj.weight": [1, E]}
        for L in range(c.n_layers):
            p = f"{PRE}layers.{L}."
            for n in ("input_layernorm", "post_attention_layernorm",
                      "self_attention_res_norm", "mlp_res_norm"):
                want[p + n + ".weight"] = [E]
            want[p + "self_attention_res_proj.weight"] = [1, E]
            want[p + "mlp_res_proj.weight"] = [1, E]
            a = p + "self_attn."
            if c.is_mla(L):
                dq = c.qk_nope + c.qk_rope
                want.update({a + "q_a_proj.weight": [c.q_lora, E],
                             a + "q_a_layernorm.weight": [c.q_lora],
                             a + "q_b_proj.weight": [c.n_heads * dq, c.q_lora],
                             a + "kv_a_proj_with_mqa.weight": [c.kv_lora + c.qk_rope, E],
                             a + "kv_a_layernorm.weight": [c.kv_lora],
                             a + "kv_b_proj.weight": [c.n_heads * (c.qk_nope + c.v_head),
                                                      c.kv_lora],
                             a + "o_proj.weight": [E, c.n_heads * c.v_head]})
                if c.mla_out_gate:
                    want[a + "g_proj.weight"] = [c.n_heads * c.v_head, E]
            else:
                for n in ("q", "k", "v"):
                    want[a + f"{n}_proj.weight"] = [P, E]
                    want[a + f"{n}_conv1d.weight"] = [P, 1, c.conv_k]
                want.update({a + "f_a_proj.weight": [D, E], a + "f_b_proj.weight": [P, D],
                             a + "A_log": [D], a + "dt_bias": [P],
                             a + "b_proj.weight": [c.kda_heads, E], a + "g_proj.weight": [P, E],
                             a + "o_norm.weight": [D], a + "o_proj.weight": [E, P]})
            if c.is_dense(L):
                want.update({p + "mlp.gate_proj.weight": [c.dense_inter, E],
                             p + "mlp.up_proj.weight": [c.dense_inter, E],
                             p + "mlp.down_proj.weight": [E, c.dense_inter]})
            else:
                m = p + "block_sparse_moe."
                S = c.moe_inter * c.n_shared
                want.update({m + "gate.weight": [c.n_experts, E],
                             m + "gate.e_score_correction_bias": [c.n_experts],
                             m + "routed_expert_down_proj.weight": [c.latent, E],
                             m + "routed_expert_up_proj.weight": [E, c.latent],
                             m + "routed_expert_norm.weight": [c.latent],
                             m + "shared_experts.gate_proj.weight": [S, E],
                             m + "shared_experts.up_proj.weight": [S, E],
                             m + "shared_experts.down_proj.weight": [E, S]})
                for X in range(c.n_experts):
                    for wn, (o, i) in (("w1", (c.moe_inter, c.latent)),
                                       ("w3", (c.moe_inter, c.latent)),
                                       ("w2", (c.latent, c.moe_inter))):
                        want[f"{m}experts.{X}.{wn}.weight_packed"] = [o, i // 2]
                        want[f"{m}experts.{X}.{wn}.weight_scale"] = [o, i // 32]
        bad = []
        for n, shp in want.items():
            if n not in self.st:
                bad.append(f"{n}: missing")
            elif self.st.index[n][2] != shp:
                bad.append(f"{n}: shape {self.st.index[n][2]} != {shp}")
        if bad:
            raise ValueError("checkpoint mismatch:\n  " + "\n  ".join(bad[:20]))

    # ---- forward ---------------------------------------------------------------------
    def logits_all(self, ids) -> np.ndarray:
        """Full causal pass over ``ids`` from a fresh state; logits [T, V] float64."""
        c = self.cfg
        ids = np.asarray(ids, np.int64)
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= c.vocab:
            raise ValueError("ids must be a non-empty 1-D list of ids in [0, vocab)")
        h = self.w(f"{PRE}embed_tokens.weight")[ids]            # [T, E], widened BF16
        stack: list[np.ndarray] = []
        for L in range(c.n_layers):
            h = self.decoder_layer(L, h, stack)
        phi = (self.w(f"{PRE}output_attn_res_norm.weight")
               * self.w(f"{PRE}output_attn_res_proj.weight")[0])
        o = attnres(stack + [h], phi, c.rms_eps)
        x = rmsnorm(o, self.w(f"{PRE}norm.weight"), c.rms_eps)
        return x @ self.w(LM_HEAD).T

    def decoder_layer(self, L: int, h: np.ndarray, stack: list) -> np.ndarray:
        c = self.cfg
        run = h
        if stack:
            phi_a = (self.lw(L, "self_attention_res_norm.weight")
                     * self.lw(L, "self_attention_res_proj.weight")[0])
            a = attnres(stack + [run], phi_a, c.rms_eps)
        else:
            a = h
        if c.is_boundary(L):
            stack.append(run.copy())
            if self.perturb != "attnres_no_clear":
                run = None
        x = rmsnorm(a, self.lw(L, "input_layernorm.weight"), c.rms_eps)
        y = self.mla(L, x) if c.is_mla(L) else self.kda(L, x)
        run = y if run is None else run + y
        phi_m = self.lw(L, "mlp_res_norm.weight") * self.lw(L, "mlp_res_proj.weight")[0]
        m = attnres(stack + [run], phi_m, c.rms_eps)
        x2 = rmsnorm(m, self.lw(L, "post_attention_layernorm.weight"), c.rms_eps)
        z = self.dense_mlp(L, x2) if c.is_dense(L) else self.moe(L, x2)
        return run + z

    # ---- KDA (§4.4) ------------------------------------------------------------------
    def kda(self, L: int, x: np.ndarray) -> np.ndarray:
        c = self.cfg
        H, D, K = c.kda_heads, c.kda_head_dim, c.conv_k
        T = x.shape[0]
        A = "self_attn."

        def conv(name):
            proj = x @ self.lw(L, A + f"{name}_proj.weight").T        # [T, P]
            wconv = self.lw(L, A + f"{name}_conv1d.weight")[:, 0, :]  # [P, K]
            pad = np.concatenate([np.zeros((K - 1, proj.shape[1])), proj], axis=0)
            out = np.zeros_like(proj)
            for t in range(T):
                # window pad[t .. t+K-1] = inputs t-K+1 .. t; last tap (K-1) = current
                out[t] = np.sum(wconv.T * pad[t:t + K], axis=0)
            return silu(out)

        q = conv("q").reshape(T, H, D)
        k = conv("k").reshape(T, H, D)
        v = conv("v").reshape(T, H, D)
        q = l2norm(q)
        if self.perturb != "kda_no_qscale":
            q = q * (1.0 / np.sqrt(D))
        k = l2norm(k)
        beta = sigmoid(x @ self.lw(L, A + "b_proj.weight").T)        # [T, H]
        z = (x @ self.lw(L, A + "f_a_proj.weight").T) @ self.lw(L, A + "f_b_proj.weight").T
        z = z.reshape(T, H, D)
        a_log = self.lw(L, A + "A_log")[:H]                          # per head
        dt = self.lw(L, A + "dt_bias").reshape(H, D)
        g = c.gate_lb * sigmoid(np.exp(a_log)[None, :, None] * (z + dt[None]))
        alpha = np.exp(g)                                             # [T, H, D]

        S = np.zeros((H, D, D))                                       # [h, key i, value j]
        o = np.zeros((T, H, D))
        for t in range(T):
            for hh in range(H):
                Sh = S[hh] * alpha[t, hh][:, None]                    # decay rows
                u = Sh.T @ k[t, hh]
                Sh = Sh + np.outer(k[t, hh] * beta[t, hh], v[t, hh] - u)
                o[t, hh] = Sh.T @ q[t, hh]
                S[hh] = Sh
        gate = sigmoid(x @ self.lw(L, A + "g_proj.weight").T).reshape(T, H, D)
        onorm = self.lw(L, A + "o_norm.weight")
        if self.perturb == "kda_gate_before_norm":
            o = rmsnorm(o * gate, onorm, c.rms_eps)
        else:
            o = rmsnorm(o, onorm, c.rms_eps) * gate
        return o.reshape(T, H * D) @ self.lw(L, A + "o_proj.weight").T

    # ---- MLA (§4.5) ------------------------------------------------------------------
    def mla(self, L: int, x: np.ndarray) -> np.ndarray:
        c = self.cfg
        H, dn, dr, dv, R = c.n_heads, c.qk_nope, c.qk_rope, c.v_head, c.kv_lora
        T = x.shape[0]
        A = "self_attn."
        ql = rmsnorm(x @ self.lw(L, A + "q_a_proj.weight").T,
                     self.lw(L, A + "q_a_layernorm.weight"), c.rms_eps)
        Q = (ql @ self.lw(L, A + "q_b_proj.weight").T).reshape(T, H, dn + dr)
        ckv = x @ self.lw(L, A + "kv_a_proj_with_mqa.weight").T          # [T, R+dr]
        lat = rmsnorm(ckv[:, :R], self.lw(L, A + "kv_a_layernorm.weight"), c.rms_eps)
        rope = ckv[:, R:]                                                 # [T, dr] shared
        KV = (lat @ self.lw(L, A + "kv_b_proj.weight").T).reshape(T, H, dn + dv)
        Kn, Vv = KV[:, :, :dn], KV[:, :, dn:]
        scale = 1.0 / np.sqrt(dn if self.perturb == "mla_scale_nope" else dn + dr)
        sc = np.einsum("thi,shi->hts", Q[:, :, :dn], Kn)                 # [H, T, S]
        if self.perturb != "mla_no_rope":
            sc = sc + np.einsum("thi,si->hts", Q[:, :, dn:], rope)      # shared rope key
        sc = sc * scale
        mask = np.tril(np.ones((T, T), bool))
        sc = np.where(mask[None], sc, -np.inf)
        sc = sc - sc.max(axis=-1, keepdims=True)
        p = np.exp(sc)
        p = p / p.sum(axis=-1, keepdims=True)
        o = np.einsum("hts,shj->thj", p, Vv).reshape(T, H * dv)
        if c.mla_out_gate:
            o = o * sigmoid(x @ self.lw(L, A + "g_proj.weight").T)
        return o @ self.lw(L, A + "o_proj.weight").T

    # ---- dense MLP (§4.6) ------------------------------------------------------------
    def dense_mlp(self, L: int, x: np.ndarray) -> np.ndarray:
        c = self.cfg
        g = x @ self.lw(L, "mlp.gate_proj.weight").T
        u = x @ self.lw(L, "mlp.up_proj.weight").T
        return situ_glu(g, u, c.situ_b1, c.situ_b2) @ self.lw(L, "mlp.down_proj.weight").T

    # ---- LatentMoE (§4.7) ------------------------------------------------------------
    def route(self, L: int, x_t: np.ndarray) -> tuple[list[int], np.ndarray]:
        c = self.cfg
        M = "block_sparse_moe."
        s = sigmoid(self.lw(L, M + "gate.weight") @ x_t)               # [N_x] unbiased
        bias = self.lw(L, M + "gate.e_score_correction_bias")
        sel = s.copy() if self.perturb == "no_router_bias" else s + bias
        idx: list[int] = []
        for _ in range(c.topk):
            best = -1
            for e in range(c.n_experts):                                # lowest index on ties
                if e in idx:
                    continue
                if best < 0 or sel[e] > sel[best]:
                    best = e
            idx.append(best)
        wts = (sel if self.perturb == "router_biased_weights" else s)[idx]
        if c.moe_renorm and c.topk > 1:
            wts = wts / (wts.sum() + 1e-20)
        return idx, wts * c.routed_scale

    def moe(self, L: int, x: np.ndarray) -> np.ndarray:
        c = self.cfg
        M = "block_sparse_moe."
        T = x.shape[0]
        zl = x @ self.lw(L, M + "routed_expert_down_proj.weight").T      # [T, L_t]
        acc = np.zeros_like(zl)
        for t in range(T):
            idx, wts = self.route(L, x[t])
            for X, wj in zip(idx, wts):
                g = self.expert(L, X, "w1") @ zl[t]
                u = self.expert(L, X, "w3") @ zl[t]
                acc[t] += wj * (self.expert(L, X, "w2") @ situ_glu(g, u, c.situ_b1, c.situ_b2))
        if c.latent_norm:
            acc = rmsnorm(acc, self.lw(L, M + "routed_expert_norm.weight"), c.rms_eps)
        y = acc @ self.lw(L, M + "routed_expert_up_proj.weight").T
        sg = x @ self.lw(L, M + "shared_experts.gate_proj.weight").T
        su = x @ self.lw(L, M + "shared_experts.up_proj.weight").T
        sh = situ_glu(sg, su, c.situ_b1, c.situ_b2) @ \
            self.lw(L, M + "shared_experts.down_proj.weight").T
        return y + sh
