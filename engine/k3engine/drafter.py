"""The block drafter (DFlash-style, issue 48; the format is docs/drafter.md): a few small
non-causal attention layers that read the target's own features at some of its layers and
propose a whole block of tokens in one pass; the target verifies the block in one sweep
(speculative.spec_step), so the emitted ids are the target's greedy ids whatever it says.

    open_drafter(dir, cfg, nl)   config.json and the safetensors header, checked against the
                                 target before the plan (ConfigError exit 2 / CheckpointError
                                 exit 1, naming the file and the problem)
    load_drafter(setup, tables)  the weights -> a BlockDrafter over the target's embedding
                                 and lm_head
    BlockDrafter                 the proposer: propose/settle (spec_step's interface) and
                                 capture/take, through which every target pass on the
                                 sequence it follows hands it the features of the positions
                                 it committed (Sequence.feed, spec_step)

The drafter keeps, per draft layer, the keys and values of every committed position (its
context).  Only committed positions are ever appended, so a rejected draft needs no
rollback here; a pass that starts where the context does not end (another sequence, an
edited turn) truncates it to the shared prefix or starts it over.  A sequence whose
earlier positions were fed without it (a resumed state file, a prompt-cache hit taken
over from another sequence) gets no drafts until it is fed from position 0 again: slower,
never different.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from .checkpoint import Checkpoint, CheckpointError
from .config import ConfigError, ModelConfig
from .inputfile import InputFileError, MiB, read_regular_file
from .model import greedy, rmsnorm
from .strict_json import JSONFormatError, loads_strict
from .weights import mv, mvs

__all__ = ["DrafterConfig", "DrafterSetup", "DrafterSize", "BlockDrafter", "read_drafter_config",
           "size_of", "default_width", "open_drafter", "load_drafter", "drafter_tensors"]

CONFIG_LIMIT = 1 * MiB
ARCHITECTURE = "DFlashDraftModel"
# Public checkpoints may prefix every name with "model." (SGLang's loader strips it).
ALIAS_PREFIX = "model."


@dataclass(frozen=True)
class DrafterConfig:
    path: str                          # the config.json it came from (for messages)
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    inter: int
    eps: float
    theta: float
    vocab: int
    block_size: int
    target_layers: tuple[int, ...]
    mask_id: int
    embed_scale: float = 1.0           # z-lab's optional input_embedding_scale

    @property
    def kv_bytes_per_position(self) -> int:
        """The context keys and values one committed position adds (float32)."""
        return 4 * 2 * self.n_layers * self.n_kv_heads * self.head_dim

    @property
    def scratch_bytes_per_position(self) -> int:
        """Per position, what is held only for a while (float32): a proposal's attention
        scores, and a pass's captured features until the drafter has taken them (a
        prompt pass holds them for every prompt position)."""
        return 4 * (self.n_heads * self.block_size + len(self.target_layers) * self.hidden)


def _int(v) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def read_drafter_config(folder: str, target: ModelConfig | None, n_bound: int | None = None
                        ) -> DrafterConfig:
    """The drafter's config.json, checked against the target (`n_bound`: the layers bound,
    --layers; no target: on its own).  Every problem is a ConfigError naming the file."""
    path = os.path.join(folder, "config.json")
    try:
        obj = loads_strict(read_regular_file(path, CONFIG_LIMIT, "file"), path)
    except InputFileError as e:
        raise ConfigError(path, "file not found (a block drafter folder holds config.json "
                                "and model.safetensors)" if e.missing else e.problem) from None
    except JSONFormatError as e:
        raise ConfigError(path, e.problem) from None
    if not isinstance(obj, dict):
        raise ConfigError(path, "root is not a JSON object")

    def refuse(problem: str):
        raise ConfigError(path, problem)
    dfc = obj.get("dflash_config", {})
    if not isinstance(dfc, dict):
        refuse("dflash_config is not a JSON object")

    def both(key):
        """dflash_config first, the top level as the public alias; both must agree."""
        a, b = dfc.get(key), obj.get(key)
        if a is not None and b is not None and a != b:
            refuse(f"dflash_config.{key} = {a!r} but {key} = {b!r}")
        return a if a is not None else b

    arch = obj.get("architectures")
    if not (isinstance(arch, list) and ARCHITECTURE in arch):
        extra = " (DFlash2: its convolutions and candidate selector are not supported)" \
            if isinstance(arch, list) and "DFlash2DraftModel" in arch else ""
        refuse(f"architectures must list {ARCHITECTURE}, found {arch!r}{extra}")
    ints = {k: _int(obj.get(k)) for k in ("hidden_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads",
                                          "head_dim", "intermediate_size", "vocab_size")}
    ints["block_size"] = _int(both("block_size"))
    floats = {k: _num(obj.get(k)) for k in ("rms_norm_eps", "rope_theta")}
    missing = [k for k, v in {**ints, **floats}.items() if v is None]
    layers, mask = both("target_layer_ids"), both("mask_token_id")
    if layers is None:
        missing.append("dflash_config.target_layer_ids")
    if mask is None:
        missing.append("dflash_config.mask_token_id")
    if missing:
        refuse("missing required field(s) (absent or not of the right JSON type): "
               + ", ".join(missing))
    for k, v in ints.items():
        if v <= 0:
            refuse(f"{k} = {v} must be positive")
    if ints["block_size"] < 2:
        refuse(f"block_size = {ints['block_size']}: a block is the anchor and at least one "
               f"mask (>= 2)")
    if not floats["rms_norm_eps"] > 0 or not floats["rope_theta"] > 0:
        refuse("rms_norm_eps and rope_theta must be positive")
    H, Hkv, D = ints["num_attention_heads"], ints["num_key_value_heads"], ints["head_dim"]
    if H % Hkv:
        refuse(f"num_attention_heads {H} is not a multiple of num_key_value_heads {Hkv}")
    if D % 2:
        refuse(f"head_dim {D} is odd (RoPE rotates halves)")
    if not (isinstance(layers, list) and layers and all(_int(x) is not None for x in layers)):
        refuse(f"target_layer_ids must be a non-empty list of layer numbers, found {layers!r}")
    if _int(mask) is None or mask < 0:
        refuse(f"mask_token_id {mask!r} is not a token id")
    if target is not None:
        _against(refuse, ints, layers, mask, target, n_bound)
    _unsupported(refuse, obj)
    scale = obj.get("input_embedding_scale", dfc.get("input_embedding_scale", 1.0))
    if _num(scale) is None or not np.isfinite(scale):
        refuse(f"input_embedding_scale {scale!r} is not a number")
    return DrafterConfig(path, ints["hidden_size"], ints["num_hidden_layers"], H, Hkv, D,
                         ints["intermediate_size"], floats["rms_norm_eps"],
                         floats["rope_theta"], ints["vocab_size"], ints["block_size"],
                         tuple(int(x) for x in layers), int(mask), float(scale))


def default_width(folder: str) -> int:
    """The sweep width when none is given: the drafts of one block (its size less the
    anchor), within the widest sweep (speculative.MAX_DRAFT)."""
    from .speculative import MAX_DRAFT
    return min(read_drafter_config(folder, None).block_size - 1, MAX_DRAFT)


def _against(refuse, ints: dict, layers, mask, target: ModelConfig, n_bound) -> None:
    """What the drafter must share with the target it drafts for."""
    if ints["hidden_size"] != target.hidden:
        refuse(f"hidden_size {ints['hidden_size']} does not match the model's "
               f"{target.hidden}")
    if ints["vocab_size"] != target.vocab:
        refuse(f"vocab_size {ints['vocab_size']} does not match the model's {target.vocab}")
    for x in layers:
        if not 0 <= x < target.n_layers:
            refuse(f"target layer {x} is out of range (the model has {target.n_layers} "
                   f"layers, 0-based)")
    nb = target.n_layers if n_bound is None else n_bound
    if nb < target.n_layers and max(layers) >= nb - 1:
        # the last bound layer's capture is the partial stack's final aggregate, not the
        # feature the drafter was trained on
        refuse(f"reads target layer {max(layers)}, but --layers binds only {nb}")
    if mask >= target.vocab:
        refuse(f"mask_token_id {mask!r} is not an id of the model's vocabulary "
               f"(0..{target.vocab - 1})")


def _unsupported(refuse, obj: dict) -> None:
    # what the public configs can say that this engine does not compute: refuse, never
    # silently draft with different math
    if obj.get("attention_bias") not in (None, False):
        refuse("attention_bias is not supported (the format has no biases)")
    if obj.get("rope_scaling") is not None:
        refuse("rope_scaling is not supported (plain RoPE only)")
    if obj.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {obj.get('hidden_act')!r} is not supported (silu only)")
    lt = obj.get("layer_types")
    if lt is not None and (not isinstance(lt, list) or any(t != "full_attention" for t in lt)):
        refuse(f"layer_types {lt!r}: only full_attention layers are supported")
    dfc = obj.get("dflash_config", {})
    if obj.get("is_causal") not in (None, False) or dfc.get("causal") not in (None, False):
        refuse("causal draft layers are not supported (the block attends to all of itself)")
    for key in ("use_swa", "attention_sink_bias"):        # vLLM's sliding-window variants
        if dfc.get(key) not in (None, False):
            refuse(f"dflash_config.{key} is not supported (full attention only)")


def drafter_tensors(dc: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the format and its shape ([out, in] for a Linear weight), in the
    order the trainer writes them (tools/drafter_torch.py)."""
    E, H, Hkv, D, inter = dc.hidden, dc.n_heads, dc.n_kv_heads, dc.head_dim, dc.inter
    t = {"fc.weight": (E, len(dc.target_layers) * E), "hidden_norm.weight": (E,)}
    for lyr in range(dc.n_layers):
        p = f"layers.{lyr}."
        t.update({p + "input_layernorm.weight": (E,),
                  p + "self_attn.q_proj.weight": (H * D, E),
                  p + "self_attn.k_proj.weight": (Hkv * D, E),
                  p + "self_attn.v_proj.weight": (Hkv * D, E),
                  p + "self_attn.o_proj.weight": (E, H * D),
                  p + "self_attn.q_norm.weight": (D,),
                  p + "self_attn.k_norm.weight": (D,),
                  p + "post_attention_layernorm.weight": (E,),
                  p + "mlp.gate_proj.weight": (inter, E),
                  p + "mlp.up_proj.weight": (inter, E),
                  p + "mlp.down_proj.weight": (E, inter)})
    t["norm.weight"] = (E,)
    return t


@dataclass(frozen=True)
class DrafterSize:
    """What the plan counts for a drafter (memory.plan's drafter terms)."""
    weight_bytes: int                  # in memory: BF16 and F32 as stored, F16 widened
    per_position: int                  # context K/V and scratch per planned position


def _size(dc: DrafterConfig, ck: Checkpoint, names) -> DrafterSize:
    w = sum(ck.info(n).nbytes * (2 if ck.info(n).dtype == "F16" else 1) for n in names)
    return DrafterSize(w, dc.kv_bytes_per_position + dc.scratch_bytes_per_position)


def size_of(folder: str) -> DrafterSize:
    """The plan's figures for a drafter folder, without a model to check it against
    (the app's memory panel, on every change); open_drafter checks it at load."""
    dc = read_drafter_config(folder, None)
    with Checkpoint(folder) as ck:
        wanted = set(drafter_tensors(dc))
        return _size(dc, ck, [n for n in ck.names()
                              if n in wanted or n.removeprefix(ALIAS_PREFIX) in wanted])


@dataclass
class DrafterSetup:
    """A drafter folder opened and checked, before anything large is read."""
    folder: str
    config: DrafterConfig
    ck: Checkpoint
    names: dict[str, str]              # format name -> the name stored in the file

    @property
    def size(self) -> DrafterSize:
        return _size(self.config, self.ck, self.names.values())

    def close(self) -> None:
        self.ck.close()


def open_drafter(folder: str, target: ModelConfig, n_bound: int | None = None) -> DrafterSetup:
    """Read and check the drafter's config and its tensors' names, dtypes and shapes."""
    dc = read_drafter_config(folder, target, n_bound)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a folder", folder)
    ck = Checkpoint(folder)
    try:
        stored = set(ck.names())
        for n in stored:                  # tensors that would change the math we compute
            if n.endswith(".bias") or "candidate_selector" in n or "_conv." in n:
                info = ck.info(n)
                raise CheckpointError(f"{info.path}: {n} is not part of the block drafter "
                                      f"format (biases, DFlash2 convolutions and candidate "
                                      f"selectors are not supported)", info.path, n)
        names = {}
        for name, shape in drafter_tensors(dc).items():
            have = name if name in stored else ALIAS_PREFIX + name \
                if ALIAS_PREFIX + name in stored else None
            if have is None:
                raise CheckpointError(f"missing tensor {name} in {folder} (the drafter's "
                                      f"config asks for it)", folder, name)
            info = ck.info(have)
            if info.dtype not in ("F32", "BF16", "F16") or info.shape != shape:
                raise CheckpointError(f"{info.path}: {have} is {info.dtype} "
                                      f"{list(info.shape)}, expected F32 or BF16 "
                                      f"{list(shape)}", info.path, have)
            names[name] = have
    except BaseException:
        ck.close()
        raise
    return DrafterSetup(folder, dc, ck, names)


# ---- the weights --------------------------------------------------------------------------

@dataclass
class _Layer:
    in_norm: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_norm: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


def _matrix(ck: Checkpoint, name: str) -> np.ndarray:
    """A Linear weight as mv reads it: F32 as stored, BF16 as its bit patterns (mv widens
    them exactly), F16 widened."""
    return ck.read(name) if ck.info(name).dtype in ("F32", "BF16") else ck.read_f32(name)


def load_drafter(setup: DrafterSetup, tables) -> "BlockDrafter":
    """The weights of an opened drafter (the file is closed after), proposing through the
    target's embedding and lm_head (`tables`: weights.ModelTables)."""
    ck, n = setup.ck, setup.names
    try:
        layers = []
        for lyr in range(setup.config.n_layers):
            p = f"layers.{lyr}."
            layers.append(_Layer(
                ck.read_f32(n[p + "input_layernorm.weight"]),
                *(_matrix(ck, n[p + f"self_attn.{m}_proj.weight"]) for m in "qkvo"),
                ck.read_f32(n[p + "self_attn.q_norm.weight"]),
                ck.read_f32(n[p + "self_attn.k_norm.weight"]),
                ck.read_f32(n[p + "post_attention_layernorm.weight"]),
                *(_matrix(ck, n[p + f"mlp.{m}_proj.weight"]) for m in ("gate", "up", "down"))))
        fc = _matrix(ck, n["fc.weight"])
        hidden_norm, norm = ck.read_f32(n["hidden_norm.weight"]), ck.read_f32(n["norm.weight"])
    finally:
        setup.close()
    return BlockDrafter(setup.config, tables, fc, hidden_norm, layers, norm, setup.folder)


# ---- the computation (float32; docs/drafter.md) --------------------------------------------

def _rmsnorm_rows(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return rmsnorm(np.ascontiguousarray(x, dtype=np.float32), w, eps)  # the kernel wants
                                                                       # contiguous rows


def rope_tables(positions: np.ndarray, D: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, D] (the half-angles repeated over both halves), the angles in float32
    as the usual float32 implementations form them (inv_freq, then position x inv_freq)."""
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, D, 2, dtype=np.float32) / np.float32(D))
                  )).astype(np.float32)
    ang = np.asarray(positions, dtype=np.float32)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=1).astype(np.float64)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _heads(x: np.ndarray, w: np.ndarray, eps: float, D: int, cos, sin) -> np.ndarray:
    """[T, n*D] -> [T, n, D]: rmsnorm of each head with the [D] weight, then RoPE."""
    T = x.shape[0]
    h = _rmsnorm_rows(x.reshape(-1, D), w, eps).reshape(T, -1, D)
    half = D // 2
    rot = np.concatenate([-h[..., half:], h[..., :half]], axis=-1)
    return h * cos[:, None, :] + rot * sin[:, None, :]


def _silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return g / (np.float32(1) + np.exp(-g)) * u


class BlockDrafter:
    """Proposes a block for the sequence it follows, from that sequence's committed
    features.  `seconds` counts its own work (context and proposals)."""

    def __init__(self, dc: DrafterConfig, tables, fc, hidden_norm, layers: list[_Layer],
                 norm, folder: str = ""):
        self.config, self.tables, self.folder = dc, tables, folder
        self.fc, self.hidden_norm, self.layers, self.norm = fc, hidden_norm, layers, norm
        self.fed: list[int] = []         # the ids whose features the context holds
        self._k = self._v = None         # [layers, capacity, Hkv, D] each
        self.seconds = 0.0
        self.passes = 0                  # proposals made
        self.restarts = 0                # times the context started over

    @property
    def width(self) -> int:
        """Drafts one pass proposes (the block less its anchor)."""
        return self.config.block_size - 1

    @property
    def context(self) -> int:
        return len(self.fed)

    def reset(self) -> None:
        if self.fed:
            self.restarts += 1
        self.fed = []

    # -- features in: every target pass on the sequence ------------------------------------
    def capture(self) -> dict:
        """The `capture` argument of the target pass whose features this drafter takes."""
        return dict.fromkeys(self.config.target_layers)

    def take(self, ids: list[int], start: int, new: list[int], capture: dict,
             row: int = 0) -> None:
        """The features of positions start.. (ids `new`: rows row.. of `capture`), which a
        target pass just committed after ids[:start].  A pass over several sequences
        (sequence.feed_together) hands each its own rows; the drafter follows one."""
        t0 = time.monotonic()
        try:
            n = len(self.fed)
            if n < start or self.fed[:start] != list(ids[:start]):
                self.reset()                 # another sequence, or one we have not seen
                if start > 0:
                    return                   # its start is missing: no drafts (exact anyway)
            del self.fed[start:]             # an edited turn: keep the shared prefix
            T = len(new)
            f = np.concatenate([capture[L][row:row + T] for L in self.config.target_layers],
                               axis=1)
            self._append(start, f)
            self.fed += list(new)
        finally:
            self.seconds += time.monotonic() - t0

    def context_kv(self, f: np.ndarray, positions: np.ndarray):
        """Per draft layer, the context keys and values [T, Hkv, D] of features f
        [T, n_feat * E] at `positions` (the contract's step 1)."""
        dc = self.config
        c = _rmsnorm_rows(mv(self.fc, np.ascontiguousarray(f, dtype=np.float32)),
                          self.hidden_norm, dc.eps)
        cos, sin = rope_tables(positions, dc.head_dim, dc.theta)
        out = []
        for lw in self.layers:
            k, v = mvs((lw.k, lw.v), c)
            out.append((_heads(k, lw.k_norm, dc.eps, dc.head_dim, cos, sin),
                        v.reshape(len(positions), dc.n_kv_heads, dc.head_dim)))
        return out

    def _append(self, start: int, f: np.ndarray) -> None:
        dc = self.config
        T = f.shape[0]
        need = start + T
        if self._k is None or self._k.shape[1] < need:
            cap = max(need, 2 * (self._k.shape[1] if self._k is not None else 0), 64)
            shape = (dc.n_layers, cap, dc.n_kv_heads, dc.head_dim)
            k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
            if self._k is not None:
                k[:, :start], v[:, :start] = self._k[:, :start], self._v[:, :start]
            self._k, self._v = k, v
        for lyr, (kc, vc) in enumerate(self.context_kv(f, np.arange(start, need))):
            self._k[lyr, start:need], self._v[lyr, start:need] = kc, vc

    # -- proposals out (speculative.spec_step) ---------------------------------------------
    def propose(self, seq: list[int], cap: int) -> list[int]:
        """Up to `cap` drafts after seq[-1] (the anchor, the pending token); none when the
        context is not exactly seq[:-1] (a pass it did not see)."""
        s = len(seq) - 1
        if cap <= 0 or len(self.fed) != s or self.fed != list(seq[:s]):
            return []
        t0 = time.monotonic()
        try:
            self.passes += 1
            return self.block(seq[-1], s, cap)
        finally:
            self.seconds += time.monotonic() - t0

    def settle(self, drafted: list[int], accepted: int) -> None:
        """Nothing to undo: the kept positions' features arrive through take()."""

    def block(self, anchor: int, s: int, n: int | None = None) -> list[int]:
        """The first `n` drafts (all B-1 by default) of one block: the anchor at position
        s, masks after it, over the context of positions < s (the contract's steps 2-4)."""
        return [greedy(row) for row in self.block_logits(anchor, s, n)]

    def block_logits(self, anchor: int, s: int, n: int | None = None) -> np.ndarray:
        """The logits [n, V] of block rows 1..n.  The whole block is computed whatever n
        is (its rows attend to each other); only the lm_head projection is limited to the
        rows asked for."""
        dc = self.config
        B, H, Hkv, D = dc.block_size, dc.n_heads, dc.n_kv_heads, dc.head_dim
        g = H // Hkv
        ids = np.full(B, dc.mask_id, dtype=np.int64)
        ids[0] = anchor
        x = np.empty((B, dc.hidden), np.float32)
        self.tables.embed_into(ids, x)
        if dc.embed_scale != 1.0:
            x *= np.float32(dc.embed_scale)
        cos, sin = rope_tables(np.arange(s, s + B), D, dc.theta)
        scale = np.float32(1.0 / np.sqrt(D))
        for lyr, lw in enumerate(self.layers):
            h = _rmsnorm_rows(x, lw.in_norm, dc.eps)
            q, k, v = mvs((lw.q, lw.k, lw.v), h)
            q = _heads(q, lw.q_norm, dc.eps, D, cos, sin)                  # [B, H, D]
            kb = _heads(k, lw.k_norm, dc.eps, D, cos, sin)                 # [B, Hkv, D]
            keys = np.concatenate([self._k[lyr, :s], kb]) if s else kb     # context first
            vals = np.concatenate([self._v[lyr, :s], v.reshape(B, Hkv, D)]) if s else \
                v.reshape(B, Hkv, D)
            # query head j reads kv head j // g: group the queries by their kv head
            qg = q.transpose(1, 0, 2).reshape(Hkv, g * B, D)
            sc = np.matmul(qg, keys.transpose(1, 2, 0)) * scale            # [Hkv, gB, n]
            sc -= sc.max(axis=-1, keepdims=True)
            np.exp(sc, out=sc)
            sc /= sc.sum(axis=-1, keepdims=True)
            o = np.matmul(sc, vals.transpose(1, 0, 2))                     # [Hkv, gB, D]
            o = np.ascontiguousarray(o.reshape(H, B, D).transpose(1, 0, 2).reshape(B, H * D))
            x = x + mv(lw.o, o)
            gt, up = mvs((lw.gate, lw.up), _rmsnorm_rows(x, lw.post_norm, dc.eps))
            x = x + mv(lw.down, np.ascontiguousarray(_silu_mul(gt, up)))
        n = B - 1 if n is None else min(n, B - 1)
        return self.tables.project(_rmsnorm_rows(x[1:1 + n], self.norm, dc.eps))
