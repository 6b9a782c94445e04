"""Strict reader and writer for the model's ``config.json`` (ARCHITECTURE §1 and §2).

Two shapes are accepted: the released *nested* one (``text_config`` holding
``linear_attn_config``) and the *flat* one of the fixtures and the tiny checkpoint.  The
lookup mirrors the reference exactly (§1.2), because a different search order reads a
different model without any error.  Nothing required is ever defaulted: every missing field
is reported in one refusal, then the eight validation rules of §1.4 run in order.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from .errors import EXIT_USAGE, EngineError

from .inputfile import InputFileError, MiB, read_regular_file
from .strict_json import JSONFormatError, loads_strict

__all__ = ["ConfigError", "ModelConfig", "parse_config", "load_config",
           "to_flat_dict", "to_nested_dict"]

# Fixed-size routing arrays in the reference (rule 5).
MAX_TOPK = 64
# Size of the layer-list buffer of every reference caller.
MAX_FULL_ATTN = 128
CONFIG_LIMIT = 16 * MiB    # the released config.json is a few KB


class ConfigError(EngineError, ValueError):
    exit_code = EXIT_USAGE

    def report(self) -> str:
        return f"k3: {self}\nABORTED: the model config could not be read with confidence."

    """A config that must not be run; the message names the source and the problem."""

    def __init__(self, source: str, problem: str):
        super().__init__(source, problem)
        self.source = source
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.source}: {self.problem}"


# ---------------------------------------------------------------------------------------
# Field table (§1.3): the single description both the reader and the writers use.

INT, F32, BOOL, LAYERS = "int", "f32", "bool", "layers"


class _Field(NamedTuple):
    name: str          # ModelConfig attribute
    key: str           # primary JSON key (nested shape; used in messages)
    alias: str | None  # second spelling (flat shape)
    kind: str
    in_lin: bool = False  # lives in text_config.linear_attn_config in the nested shape


_FIELDS: tuple[_Field, ...] = (
    _Field("hidden", "hidden_size", None, INT),
    _Field("n_layers", "num_hidden_layers", None, INT),
    _Field("vocab", "vocab_size", None, INT),
    _Field("rms_eps", "rms_norm_eps", None, F32),
    _Field("kda_heads", "num_heads", "kda_num_heads", INT, True),
    _Field("kda_head_dim", "head_dim", "kda_head_dim", INT, True),
    _Field("conv_k", "short_conv_kernel_size", None, INT, True),
    _Field("gate_lb", "gate_lower_bound", None, F32, True),
    _Field("n_heads", "num_attention_heads", None, INT),
    _Field("q_lora", "q_lora_rank", None, INT),
    _Field("kv_lora", "kv_lora_rank", None, INT),
    _Field("qk_nope", "qk_nope_head_dim", None, INT),
    _Field("qk_rope", "qk_rope_head_dim", None, INT),
    _Field("v_head", "v_head_dim", None, INT),
    _Field("mla_out_gate", "mla_use_output_gate", None, BOOL),
    _Field("n_experts", "num_experts", None, INT),
    _Field("topk", "num_experts_per_token", None, INT),
    _Field("n_shared", "num_shared_experts", None, INT),
    _Field("latent", "routed_expert_hidden_size", None, INT),
    _Field("moe_inter", "moe_intermediate_size", None, INT),
    _Field("routed_scale", "routed_scaling_factor", None, F32),
    _Field("moe_renorm", "moe_renormalize", None, BOOL),
    _Field("latent_norm", "latent_moe_use_norm", None, BOOL),
    _Field("first_dense", "first_k_dense_replace", None, INT),
    _Field("dense_inter", "intermediate_size", None, INT),
    _Field("attn_res_block", "attn_res_block_size", None, INT),
    _Field("situ_b1", "activation_situ_beta", "situ_beta", F32),
    _Field("situ_b2", "activation_situ_linear_beta", "situ_linear_beta", F32),
    _Field("full_attn", "full_attn_layers", None, LAYERS, True),
)
_BY_NAME = {f.name: f for f in _FIELDS}

# Sizes that are positive in every K3 config; the reference checks only hidden/layers/vocab
# (rule 2), so these run after the eight rules and never pre-empt them.
_POSITIVE_EXTRA = ("kda_heads", "kda_head_dim", "n_heads", "q_lora", "kv_lora", "qk_nope",
                   "qk_rope", "v_head", "n_experts", "n_shared", "latent", "moe_inter",
                   "dense_inter")


# Meaningful ranges (inclusive) of every field, checked after the eight rules and the
# positivity extras.  Every K3 config (real: ARCHITECTURE §1.3; tiny, demo, mid) lies far
# inside them.  Without them a count of 10^12 experts or 2^63 layers passed, and the
# completeness check then built one name per expert: unbounded time and memory, no
# message (issue 14, finding 2).  A value outside its range is refused naming the field.
_K, _M = 1 << 10, 1 << 20
_RANGES: dict[str, tuple[float, float]] = {
    "hidden": (1, 64 * _K), "n_layers": (1, _K), "vocab": (1, _M),
    "kda_heads": (1, _K), "kda_head_dim": (1, _K), "conv_k": (1, 64),
    "n_heads": (1, _K), "q_lora": (1, 64 * _K), "kv_lora": (1, 64 * _K),
    "qk_nope": (1, 4 * _K), "qk_rope": (1, 4 * _K), "v_head": (1, 4 * _K),
    "n_experts": (1, 64 * _K), "topk": (1, MAX_TOPK), "n_shared": (1, 64),
    "latent": (1, 64 * _K), "moe_inter": (1, 64 * _K), "dense_inter": (1, _M),
    # float ranges: open at 0 where the value is a divisor or a scale that must not vanish
    "rms_eps": (0.0, 1.0), "gate_lb": (-1e4, 0.0), "routed_scale": (0.0, 1e4),
    "situ_b1": (0.0, 1e4), "situ_b2": (0.0, 1e4),
}
# Floats whose lower bound is exclusive (0 would divide by zero or silence the term).
_OPEN_LOW = ("rms_eps", "routed_scale", "situ_b1", "situ_b2")


# ---------------------------------------------------------------------------------------
# The parsed config.

@dataclass(frozen=True)
class ModelConfig:
    """A validated model config; engine names of §1.3.  Construction re-validates."""

    hidden: int
    n_layers: int
    vocab: int
    rms_eps: float
    kda_heads: int
    kda_head_dim: int
    conv_k: int
    gate_lb: float
    n_heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    mla_out_gate: bool
    n_experts: int
    topk: int
    n_shared: int
    latent: int
    moe_inter: int
    routed_scale: float
    moe_renorm: bool
    latent_norm: bool
    first_dense: int
    dense_inter: int
    attn_res_block: int
    situ_b1: float
    situ_b2: float
    full_attn: tuple[int, ...]  # one-based, as written in the file
    # Where the config came from: not part of the model, so not part of equality.
    shape: str = field(default="flat", compare=False)
    source: str = field(default="<dict>", compare=False)

    def __post_init__(self) -> None:
        # Floats always hold float32 values (every later use widens that float32, §5),
        # whoever builds the config.
        for f in _FIELDS:
            if f.kind == F32:
                with np.errstate(over="ignore"):
                    v = float(np.float32(getattr(self, f.name)))
                if not math.isfinite(v):
                    raise ConfigError(self.source, f"{f.key} = {getattr(self, f.name)!r} "
                                                   "is not a finite float32")
                object.__setattr__(self, f.name, v)
        object.__setattr__(self, "full_attn", tuple(int(a) for a in self.full_attn))
        _validate(self)

    # -- layer map (§2); L is zero-based, full_attn one-based --------------------------

    def _layer(self, L: int) -> int:
        if not 0 <= L < self.n_layers:
            raise IndexError(f"layer {L} outside 0..{self.n_layers - 1}")
        return L

    def is_mla(self, L: int) -> bool:
        return self._layer(L) + 1 in self.full_attn

    def is_kda(self, L: int) -> bool:
        return not self.is_mla(L)

    def is_dense(self, L: int) -> bool:
        return self._layer(L) < self.first_dense

    def is_boundary(self, L: int) -> bool:
        return self._layer(L) % self.attn_res_block == 0

    def layer_map(self) -> str:
        """One letter per layer: M (MLA) or K (KDA), e.g. ``KKKMKKKMKKKMM``."""
        return "".join("M" if self.is_mla(L) else "K" for L in range(self.n_layers))

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(L for L in range(self.n_layers) if self.is_mla(L))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(L for L in range(self.n_layers) if not self.is_mla(L))

    # -- derived dimensions ------------------------------------------------------------

    @property
    def kda_proj(self) -> int:
        """P: width of the KDA q/k/v projections."""
        return self.kda_heads * self.kda_head_dim

    @property
    def qk_head(self) -> int:
        """MLA query/key head width (nope + rope slots)."""
        return self.qk_nope + self.qk_rope

    @property
    def shared_inter(self) -> int:
        """Width of the fused shared-expert MLP."""
        return self.moe_inter * self.n_shared


def _validate(cfg: ModelConfig) -> None:
    """Rules 2-8 of §1.4 in order (rule 1 is the reader's), then the K3-safe extras."""

    def refuse(problem: str) -> None:
        raise ConfigError(cfg.source, problem)

    def positive(name: str) -> None:
        if getattr(cfg, name) <= 0:
            refuse(f"{_BY_NAME[name].key} must be > 0 (got {getattr(cfg, name)})")

    for name in ("n_layers", "hidden", "vocab"):                                # rule 2
        positive(name)
    n = cfg.n_layers
    if len(cfg.full_attn) >= n:                                                 # rule 3
        refuse(f"full_attn_layers has {len(cfg.full_attn)} entries for {n} layers: "
               "at least one layer must be KDA")
    for a in cfg.full_attn:                                                     # rule 4
        if not 1 <= a <= n:
            refuse(f"full_attn_layers entry {a} is outside 1..{n} (one-based)")
    if cfg.topk > MAX_TOPK:                                                     # rule 5
        refuse(f"num_experts_per_token {cfg.topk} exceeds the routing limit {MAX_TOPK}")
    if cfg.topk > cfg.n_experts:                                                # rule 6
        refuse(f"num_experts_per_token {cfg.topk} exceeds num_experts {cfg.n_experts}")
    positive("attn_res_block")                                                  # rule 7
    if cfg.conv_k < 1:                                                          # rule 8
        refuse(f"short_conv_kernel_size must be >= 1 (got {cfg.conv_k})")

    if cfg.topk < 1:
        refuse(f"num_experts_per_token must be >= 1 (got {cfg.topk})")
    for name in _POSITIVE_EXTRA:
        positive(name)
    if cfg.first_dense < 0:
        refuse(f"first_k_dense_replace must be >= 0 (got {cfg.first_dense})")
    for name, (lo, hi) in _RANGES.items():
        v = getattr(cfg, name)
        low_ok = v > lo if name in _OPEN_LOW else v >= lo
        if not (low_ok and v <= hi):
            left = "(" if name in _OPEN_LOW else "["
            refuse(f"{_BY_NAME[name].key} = {v!r} is outside its meaningful range "
                   f"{left}{lo:g}, {hi:g}]")
    if cfg.first_dense > n:
        refuse(f"first_k_dense_replace = {cfg.first_dense} is outside its meaningful range "
               f"[0, num_hidden_layers = {n}]")
    if cfg.attn_res_block > n:
        refuse(f"attn_res_block_size = {cfg.attn_res_block} is outside its meaningful range "
               f"[1, num_hidden_layers = {n}]")


# ---------------------------------------------------------------------------------------
# Reading (§1.2).

_MISSING = object()


class _BadValue(Exception):
    """A present value that refuses the load at once (not merely 'missing')."""


def _is_number(v: Any) -> bool:
    # JSON numbers only: bool is an int subclass in Python but a distinct JSON type.
    # Integers skip isfinite: a huge JSON integer would overflow the float conversion.
    return (isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
            and (isinstance(v, numbers.Integral) or math.isfinite(v)))


def _convert(kind: str, v: Any) -> Any:
    """The stored value of a required field, or _MISSING when the JSON type is wrong."""
    if kind == LAYERS:
        if not isinstance(v, list) or not v:
            return _MISSING
        for a in v:
            if not _is_number(a):
                raise _BadValue(f"full_attn_layers entry {a!r} is not a number")
        if len(v) > MAX_FULL_ATTN:
            raise _BadValue(f"full_attn_layers has {len(v)} entries "
                            f"(at most {MAX_FULL_ATTN})")
        return tuple(int(a) for a in v)
    if not _is_number(v):
        return _MISSING
    return int(v) if kind == INT else float(v)  # int() truncates toward zero


def _scopes(obj: Any, source: str) -> tuple[dict | None, dict | None, dict]:
    """(text_config, linear_attn_config, root), absent ones as None."""
    if not isinstance(obj, dict):
        raise ConfigError(source, f"root is not a JSON object (found {type(obj).__name__})")
    txt = _sub_object(obj, "text_config", source)
    lin = _sub_object(txt if txt is not None else obj, "linear_attn_config", source)
    return txt, lin, obj


def _sub_object(parent: dict, key: str, source: str) -> dict | None:
    # No valid K3 config has a non-object here: refuse rather than guess how to read it.
    if key not in parent:
        return None
    if not isinstance(parent[key], dict):
        raise ConfigError(source, f"{key} is not a JSON object")
    return parent[key]


def _lookup(f: _Field, scopes: tuple[dict | None, ...]) -> Any:
    """First hit over scopes, then primary before alias; whatever its type."""
    for scope in scopes:
        if scope is None:
            continue
        for key in (f.key, f.alias):
            if key is not None and key in scope:
                return scope[key]
    return _MISSING


def _check_shadowing(txt: dict | None, lin: dict | None, source: str) -> None:
    """Refuse a text_config value that silently hides a different KDA value (§1.2 trap)."""
    if txt is None or lin is None:
        return
    for f in _FIELDS:
        if not f.in_lin:
            continue
        try:
            outer = _convert(f.kind, _lookup(f, (txt,)))
            inner = _convert(f.kind, _lookup(f, (lin,)))
        except _BadValue:
            continue  # not both numeric: nothing is shadowed
        if outer is not _MISSING and inner is not _MISSING and outer != inner:
            raise ConfigError(source, f"text_config.{f.key} = {_show(outer)} shadows "
                                      f"linear_attn_config.{f.key} = {_show(inner)}")


def _show(v: Any) -> str:
    return str(list(v)) if isinstance(v, tuple) else repr(v)


def parse_config(obj: dict, source: str = "<dict>") -> ModelConfig:
    """Read a parsed config.json object (flat or nested) into a validated ModelConfig."""
    txt, lin, root = _scopes(obj, source)
    scopes = (txt, lin, root)  # THIS ORDER (§1.2)
    values: dict[str, Any] = {}
    missing: list[str] = []
    for f in _FIELDS:
        raw = _lookup(f, scopes)
        if f.kind == BOOL:
            # Optional: true/false or a number; absent or any other type -> true.
            values[f.name] = (raw if isinstance(raw, bool)
                              else raw != 0 if _is_number(raw) else True)
            continue
        try:
            v = _MISSING if raw is _MISSING else _convert(f.kind, raw)
        except _BadValue as e:
            raise ConfigError(source, str(e)) from None
        if v is _MISSING:
            missing.append(f.key)
        values[f.name] = v
    if missing:                                                                 # rule 1
        raise ConfigError(source, "missing required field(s) (absent or not of the right "
                                  "JSON type): " + ", ".join(missing))
    _check_shadowing(txt, lin, source)
    return ModelConfig(**values, shape="flat" if txt is None else "nested", source=source)


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read and validate ``config.json`` at *path*; every failure is a ConfigError."""
    source = os.fspath(path)
    try:
        data = read_regular_file(source, CONFIG_LIMIT, "file")
    except InputFileError as e:
        raise ConfigError(source, "file not found" if e.missing else e.problem) from None
    try:
        obj = loads_strict(data, source)
    except JSONFormatError as e:
        raise ConfigError(source, e.problem) from None
    return parse_config(obj, source)


# ---------------------------------------------------------------------------------------
# Writing.

def _out(f: _Field, cfg: ModelConfig) -> Any:
    v = getattr(cfg, f.name)
    if f.kind == LAYERS:
        return list(v)
    if f.kind == F32:
        # Shortest decimal of the float32 (1e-05, not 9.999999747378752e-06); fall back to
        # the exact value if that decimal would not come back to the same float32.
        short = float(str(np.float32(v)))
        return short if np.float32(short) == np.float32(v) else v
    return v


def to_flat_dict(cfg: ModelConfig) -> dict:
    """The flat shape, keys and order as in the op fixtures' ``config``."""
    out: dict[str, Any] = {}
    for f in _FIELDS:
        out[f.alias or f.key] = _out(f, cfg)
        if f.key == "rms_norm_eps":  # the fixtures carry it here
            out["tie_word_embeddings"] = False
    return out


def to_nested_dict(cfg: ModelConfig) -> dict:
    """The released nested shape (§1.1), fields this engine reads plus the fixed flags."""
    text: dict[str, Any] = {}
    lin: dict[str, Any] = {}
    for f in _FIELDS:
        (lin if f.in_lin else text)[f.key] = _out(f, cfg)
    lin["kda_layers"] = [L + 1 for L in cfg.kda_layers]  # one-based, like full_attn_layers
    lin["use_full_rank_gate"] = True
    text["mla_use_nope"] = True
    text["tie_word_embeddings"] = False
    text["linear_attn_config"] = lin
    return {"model_type": "kimi_k3", "tie_word_embeddings": False, "text_config": text}
