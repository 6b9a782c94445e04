"""Binding checkpoint tensors to the forward pass's weight containers (ARCHITECTURE §3.6).

Every tensor's element count is checked against the config before use, so a checkpoint
that does not match its config is refused with the tensor's name instead of computing
fluent nonsense.  Large matrices stay in their shipped dtype (BF16 bits as uint16), small
vectors are widened to float32, `A_log` is sliced to its first H_k entries (trap #6).
"""
from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from .checkpoint import Checkpoint, CheckpointError, require_tensors
from .config import ModelConfig
from .names import (TensorDef, expert_tensors, layer_tensors,
                    model_tensors)
from .weights import (MXFP4, DenseWeights, ExpertWeights, KDAWeights, LayerWeights,
                      MLAWeights, ModelTables, MoEWeights, fold_phi)


class BindError(CheckpointError):
    """A tensor exists but does not fit the config (wrong count, dtype or geometry)."""


def _numel(shape) -> int:
    # math.prod, not np.prod: this runs for every tensor of every streamed bind, where
    # NumPy's reduction setup was half the bind's time (and Python ints cannot overflow)
    return math.prod(int(d) for d in shape)


class TensorSource(Protocol):
    """Where a layer's tensors come from: the checkpoint's shards, or one run of the packed
    trunk sitting in a pinned buffer or ring slot (zero-copy views)."""

    def info(self, name: str): ...          # .dtype, .shape, .path

    def read(self, name: str) -> np.ndarray: ...

    def read_f32(self, name: str) -> np.ndarray: ...


class Binder:
    """Reads and checks tensors of one checkpoint for one config."""

    def __init__(self, ck: Checkpoint, cfg: ModelConfig):
        self.ck, self.cfg = ck, cfg
        self._defs: dict[int, dict[str, TensorDef]] = {}    # per layer: the config's names

    def _layer_defs(self, L: int) -> dict[str, TensorDef]:
        """layer_tensors(cfg, L) by key, built once per layer (a streamed layer is bound
        again on every pass)."""
        d = self._defs.get(L)
        if d is None:
            d = self._defs[L] = {t.key: t for t in layer_tensors(self.cfg, L)}
        return d

    def _checked(self, t: TensorDef, src: TensorSource):
        info = src.info(t.name)
        if _numel(info.shape) != _numel(t.shape):
            raise BindError(f"{info.path}: {t.name} has {_numel(info.shape)} elements "
                            f"{list(info.shape)}, the config implies {_numel(t.shape)} "
                            f"{list(t.shape)}", info.path, t.name)
        return info

    def matrix(self, t: TensorDef, src: TensorSource) -> np.ndarray:
        """A large matrix in its shipped form: BF16 bits or float32 (F16 is widened)."""
        info = self._checked(t, src)
        shape = (t.shape[0], _numel(t.shape[1:]))
        if info.dtype == "BF16":
            return src.read(t.name).reshape(shape)
        if info.dtype == "I8R":                          # a draft trunk's int8 rows
            return src.read(t.name)
        if info.dtype in ("F32", "F16"):
            return src.read_f32(t.name).reshape(shape)
        raise BindError(f"{info.path}: {t.name} has dtype {info.dtype}, expected a float "
                        f"matrix", info.path, t.name)

    def vector(self, t: TensorDef, src: TensorSource) -> np.ndarray:
        info = self._checked(t, src)
        if info.dtype == "U8":
            raise BindError(f"{info.path}: {t.name} has dtype U8, expected a float vector",
                            info.path, t.name)
        return src.read_f32(t.name).reshape(t.shape)

    def a_log(self, t: TensorDef, src: TensorSource) -> np.ndarray:
        """A_log ships D values (H real + zero padding); op-fixture formats ship H."""
        info = src.info(t.name)
        H, D = self.cfg.kda_heads, self.cfg.kda_head_dim
        if _numel(info.shape) not in (D, H) or info.dtype == "U8":
            raise BindError(f"{info.path}: {t.name} has {_numel(info.shape)} elements, "
                            f"expected {D} (head_dim, first {H} used)", info.path, t.name)
        return np.ascontiguousarray(src.read_f32(t.name).reshape(-1)[:H])

    # -- per layer -------------------------------------------------------------------

    def layer(self, L: int, src: TensorSource | None = None) -> LayerWeights:
        """Layer L's weights from `src` (default: the checkpoint's shards)."""
        cfg, src = self.cfg, src or self.ck
        defs = self._layer_defs(L)
        M = lambda key: self.matrix(defs[key], src)                # noqa: E731
        v = lambda key: self.vector(defs[key], src)                # noqa: E731
        if cfg.is_kda(L):
            conv = lambda m: v(f"self_attn.{m}_conv1d.weight").reshape(cfg.kda_proj, cfg.conv_k)  # noqa: E731
            attn = KDAWeights(
                q_proj=M("self_attn.q_proj.weight"), k_proj=M("self_attn.k_proj.weight"),
                v_proj=M("self_attn.v_proj.weight"),
                q_conv=conv("q"), k_conv=conv("k"), v_conv=conv("v"),
                f_a=M("self_attn.f_a_proj.weight"), f_b=M("self_attn.f_b_proj.weight"),
                b_proj=M("self_attn.b_proj.weight"), g_proj=M("self_attn.g_proj.weight"),
                o_proj=M("self_attn.o_proj.weight"), A_log=self.a_log(defs["self_attn.A_log"], src),
                dt_bias=v("self_attn.dt_bias"), o_norm=v("self_attn.o_norm.weight"))
        else:
            attn = MLAWeights(
                q_a_proj=M("self_attn.q_a_proj.weight"),
                q_a_norm=v("self_attn.q_a_layernorm.weight"),
                q_b_proj=M("self_attn.q_b_proj.weight"),
                kv_a_proj=M("self_attn.kv_a_proj_with_mqa.weight"),
                kv_a_norm=v("self_attn.kv_a_layernorm.weight"),
                kv_b_proj=M("self_attn.kv_b_proj.weight"), o_proj=M("self_attn.o_proj.weight"),
                g_proj=M("self_attn.g_proj.weight") if cfg.mla_out_gate else None)
        if cfg.is_dense(L):
            mlp = DenseWeights(gate=M("mlp.gate_proj.weight"), up=M("mlp.up_proj.weight"),
                               down=M("mlp.down_proj.weight"))
        else:
            m = "block_sparse_moe."
            mlp = MoEWeights(
                router=M(m + "gate.weight"), bias=v(m + "gate.e_score_correction_bias"),
                down_lat=M(m + "routed_expert_down_proj.weight"),
                up_lat=M(m + "routed_expert_up_proj.weight"),
                lat_norm=v(m + "routed_expert_norm.weight"),
                shared=DenseWeights(gate=M(m + "shared_experts.gate_proj.weight"),
                                    up=M(m + "shared_experts.up_proj.weight"),
                                    down=M(m + "shared_experts.down_proj.weight")))
        return LayerWeights(
            input_norm=v("input_layernorm.weight"), post_norm=v("post_attention_layernorm.weight"),
            phi_attn=fold_phi(v("self_attention_res_norm.weight"), v("self_attention_res_proj.weight")),
            phi_mlp=fold_phi(v("mlp_res_norm.weight"), v("mlp_res_proj.weight")),
            attn=attn, mlp=mlp)

    def tables(self) -> ModelTables:
        d = {t.key: t for t in model_tensors(self.cfg)}
        M = lambda key: self.matrix(d[key], self.ck)               # noqa: E731
        v = lambda key: self.vector(d[key], self.ck)               # noqa: E731
        return ModelTables(
            embed=M("embed_tokens.weight"), lm_head=M("lm_head.weight"),
            final_norm=v("norm.weight"),
            phi_out=fold_phi(v("output_attn_res_norm.weight"), v("output_attn_res_proj.weight")))

    def expert(self, L: int, e: int) -> ExpertWeights:
        """One routed expert's three MXFP4 matrices, with the geometry checks of
        SYSTEM §1.6 (U8, rank 2, same rows, group size 32, one shard)."""
        defs = expert_tensors(self.cfg, L, e)
        infos = [self._checked(t, self.ck) for t in defs]
        shard = infos[0].shard
        for t, info in zip(defs, infos):
            if info.dtype != "U8" or len(info.shape) != 2 or tuple(info.shape) != t.shape:
                raise BindError(f"{info.path}: {t.name} is {info.dtype} {list(info.shape)}, "
                                f"expected U8 {list(t.shape)}", info.path, t.name)
            if info.shard != shard:
                raise BindError(f"{info.path}: {t.name} is not in the same shard as the rest "
                                f"of expert {e} of layer {L}", info.path, t.name)
        arrays = [self.ck.read(t.name) for t in defs]
        mats = {m: MXFP4(arrays[2 * i], arrays[2 * i + 1]) for i, m in enumerate(("w1", "w2", "w3"))}
        return ExpertWeights(w1=mats["w1"], w3=mats["w3"], w2=mats["w2"])

    # -- completeness ----------------------------------------------------------------

    def require_complete(self, n_layers: int) -> None:
        """Refuse a partial download before anything large is allocated (SYSTEM §1.9):
        every trunk tensor of the bound layers, the model tables and every routed expert."""
        cfg = self.cfg
        # Bounded by the file, not by the config: each layer's name list stops at its first
        # missing tensor, so a config's counts (10^12 experts passed once) cannot drive a
        # loop longer than the index plus one name per layer.
        names: dict[int, list[str]] = {}
        by_kind: dict[tuple[str, tuple[int, ...]], list[str]] = {}
        for L in range(n_layers):
            names[L] = mine = []
            defs = [layer_tensors(cfg, L)]
            if not cfg.is_dense(L):
                defs.append(t for e in range(cfg.n_experts) for t in expert_tensors(cfg, L, e))
            for t in (t for group in defs for t in group):
                mine.append(t.name)
                if t.name not in self.ck:
                    break
                if t.kind == "mxfp4":
                    by_kind.setdefault((t.key, t.shape), []).append(t.name)
        require_tensors(self.ck, names, n_layers)
        for (_, shape), group in by_kind.items():     # every expert's geometry, up front
            self.ck.require_shapes(group, "U8", shape)
        for t in model_tensors(cfg):
            self.ck.info(t.name)            # raises "missing tensor NAME in DIR"


class ResidentWeights:
    """The whole trunk (and model tables) read into RAM once; the provider the forward
    pass uses when no packed trunk is given."""

    def __init__(self, binder: Binder, n_layers: int):
        self.tables = binder.tables()
        self._layers = [binder.layer(L) for L in range(n_layers)]

    def layer(self, L: int) -> LayerWeights:
        return self._layers[L]

    def release(self, L: int) -> None:
        pass

    def trunk_nbytes(self) -> int:
        return sum(deep_nbytes(lw) for lw in self._layers)

    def tables_nbytes(self) -> int:
        return deep_nbytes(self.tables)


class CheckpointExperts:
    """Routed experts read from the checkpoint on first use and kept (the unbounded,
    resident case; the bounded cache of SYSTEM §4 replaces this)."""

    def __init__(self, binder: Binder):
        self.binder = binder
        self._resident: dict[tuple[int, int], ExpertWeights] = {}
        self.bytes_read = 0

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        ex = self._resident.get(key)
        if ex is None:
            ex = self.binder.expert(layer, expert)
            self.bytes_read += deep_nbytes(ex)
            self._resident[key] = ex
        return ex


def deep_nbytes(obj) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if obj is None or isinstance(obj, (int, float, str)):
        return 0
    if hasattr(obj, "__dataclass_fields__"):
        return sum(deep_nbytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


__all__ = ["Binder", "BindError", "ResidentWeights", "CheckpointExperts", "deep_nbytes"]
