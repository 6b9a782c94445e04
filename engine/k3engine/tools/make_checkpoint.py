"""`k3 make-checkpoint OUT_DIR [--dims tiny|mid] [--seed N]`: a Kimi K3 checkpoint of our
own in the released layout (ARCHITECTURE §3, §7.9): config.json, safetensors with the HF
dotted names, BF16 matrices, F32 small vectors, A_log padded to head_dim, MXFP4 experts.

Deterministic: every tensor draws from its own generator seeded by (seed, crc32(name)),
so the bytes do not depend on write order or sharding.  Tensors are produced and written
one at a time, so any size (a few MB to several GB) needs little memory.

Initialisation is adversarial so the exactness gates mean something (§7.6): gate/up
matrices at std 1.2 drive SiTU into both caps, the router bias (linspace +-0.15) reorders
the top-k, A_log is a per-head ramp, dt_bias and conv taps are random, and every norm
gain is random around 1 (the peer recipe uses ones, which cannot catch a gain applied to
the wrong index, trap #16).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import zlib
from typing import Callable

import numpy as np

from ..atomic import write_atomic
from ..checkpoint import to_bf16
from ..config import ModelConfig, parse_config, to_flat_dict, to_nested_dict
from ..names import PREFIX, TensorDef, expert_tensors, layer_tensors, model_tensors
from ..integrity import DIGEST_SIDECAR
from .st_writer import TensorSpec, write_safetensors

# The peer's 13-layer tiny dims (ARCHITECTURE §0.2) with moe_intermediate_size 64, so
# every expert width divides into MXFP4 groups of 32 (§7.9).
_TINY = dict(
    hidden_size=128, num_hidden_layers=13, vocab_size=256, rms_norm_eps=1e-5,
    kda_num_heads=4, kda_head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
    num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=24,
    qk_rope_head_dim=8, v_head_dim=16, mla_use_output_gate=True, num_experts=8,
    num_experts_per_token=2, num_shared_experts=2, routed_expert_hidden_size=64,
    moe_intermediate_size=64, routed_scaling_factor=1.0, moe_renormalize=True,
    latent_moe_use_norm=True, first_k_dense_replace=1, intermediate_size=96,
    attn_res_block_size=3, situ_beta=4.0, situ_linear_beta=25.0,
    full_attn_layers=[4, 8, 12, 13],
)

# The shape the reference's published figures were measured on (about 6.5 GB).
_MID = dict(
    _TINY, hidden_size=2048, num_hidden_layers=16, vocab_size=32768, kda_num_heads=16,
    kda_head_dim=128, num_attention_heads=16, q_lora_rank=512, kv_lora_rank=256,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=128,
    num_experts_per_token=8, routed_expert_hidden_size=1024, moe_intermediate_size=1536,
    intermediate_size=8192, attn_res_block_size=4, full_attn_layers=[4, 8, 12, 16],
)

# The smallest chat-capable model: our vocabulary (ranks + 256 added tokens), every layer
# kind present, a few tens of MB; the app's out-of-the-box model.
_DEMO = dict(
    _TINY, hidden_size=256, kda_head_dim=32, q_lora_rank=128, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=32,
    num_experts_per_token=4, routed_expert_hidden_size=128, moe_intermediate_size=128,
    intermediate_size=512, vocab_size=None,
)

DIMS = {"tiny": _TINY, "demo": _DEMO, "mid": _MID}
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")
# Above this many parameters per expert matrix, nibbles and scales are drawn at random
# instead of quantising Gaussian weights (same format, far faster at multi-GB sizes).
QUANTISE_LIMIT = 1 << 20
DEFAULT_SHARD_BYTES = 2 * 10**9
PROGRESS_MIN_BYTES = 200 * 10**6


def dims_config(dims: str) -> ModelConfig:
    if dims not in DIMS:
        raise ValueError(f"unknown --dims {dims!r} (choose from {', '.join(DIMS)})")
    d = dict(DIMS[dims])
    if d["vocab_size"] is None:             # sized to hold our shipped vocabulary exactly
        from ..tokenizer import Tokenizer, default_tokenizer_dir
        d["vocab_size"] = Tokenizer.from_dir(default_tokenizer_dir()).vocab_size
    return parse_config(d, f"--dims {dims}")


def write_tokenizer(out_dir: str, vocab: int) -> bool:
    """Copy our vocabulary into a model directory whose embedding can hold it, so the
    directory also serves as --tok.  Returns whether it was written."""
    from ..tokenizer import Tokenizer, default_tokenizer_dir
    src = default_tokenizer_dir()
    if Tokenizer.from_dir(src).vocab_size > vocab:
        return False
    for name in TOKENIZER_FILES:
        data = (src / name).read_bytes()
        write_atomic(os.path.join(out_dir, name), data, mode=0o644)     # model data
    return True


# ---- values ------------------------------------------------------------------------

def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))


def quantise_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """§7.9 rule: per 32-group scale = floor(log2(max|w|)) - 2 + 127; each element the
    nearest E2M1 magnitude (lowest code on ties) with its sign; low nibble = even element."""
    rows, n = w.shape
    g = w.reshape(rows, n // 32, 32).astype(np.float64)
    amax = np.abs(g).max(axis=2)
    if np.any(amax == 0):
        raise ValueError("a weight group quantises entirely to zero")
    e = np.floor(np.log2(amax)).astype(np.int64) - 2
    scales = np.clip(e + 127, 0, 254).astype(np.uint8)
    mag = np.abs(g) / np.exp2(scales.astype(np.int64) - 127)[..., None]
    table = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    code = np.argmin(np.abs(mag[..., None] - table), axis=-1).astype(np.uint8)
    code |= np.where(g < 0, 8, 0).astype(np.uint8)
    code = code.reshape(rows, n)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed, scales


# MLA query/key expansions and output at the op fixtures' scale: at 0.02 the attention
# scores are ~5e-3, softmax is uniform and a wrong score scale (trap #18) or dropped rope
# terms move the logits by less than the oracle's tolerance.
_MLA_STD = {"self_attn.q_b_proj.weight": 0.3, "self_attn.kv_b_proj.weight": 0.3,
            "self_attn.o_proj.weight": 0.1}


def _matrix_std(key: str, mla: bool = False) -> float:
    if key.startswith(("w1", "w3")) or key.endswith(("gate_proj.weight", "up_proj.weight")):
        return 1.2          # SiTU caps engage (dense gate/up, shared and routed w1/w3)
    if "conv1d" in key:
        return 0.4
    if mla and key in _MLA_STD:
        return _MLA_STD[key]
    return 0.02


class Generator:
    """Produces each tensor of the checkpoint from its definition."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self._expert_cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def values(self, t: TensorDef) -> np.ndarray:
        cfg, rng = self.cfg, _rng(self.seed, t.name)
        if t.kind == "mxfp4":
            return self._expert_part(t)
        if t.key.endswith("A_log"):
            H, D = cfg.kda_heads, cfg.kda_head_dim
            out = np.zeros(D, np.float32)                   # zero padding beyond H (#6)
            out[:H] = np.linspace(-0.4, 1.2, H, dtype=np.float32)
            return out
        if t.key.endswith("dt_bias"):
            return (rng.standard_normal(t.shape) * 0.5).astype(np.float32)
        if t.key.endswith("e_score_correction_bias"):
            return np.linspace(-0.15, 0.15, t.shape[0], dtype=np.float32)
        if t.kind == "v" and len(t.shape) == 1:             # norm gains: random around 1
            return (1.0 + 0.1 * rng.standard_normal(t.shape)).astype(np.float32)
        mla = t.name.startswith(PREFIX + "layers.") and \
            cfg.is_mla(int(t.name[len(PREFIX + "layers."):].split(".", 1)[0]))
        w = rng.standard_normal(t.shape, dtype=np.float32) * np.float32(_matrix_std(t.key, mla))
        return w if t.kind == "v" else to_bf16(w)           # conv taps, res_proj stay F32

    def _expert_part(self, t: TensorDef) -> np.ndarray:
        """An expert matrix's packed or scale tensor (both come from one draw)."""
        base = t.name.rsplit(".", 1)[0]                     # ...experts.E.w1
        if base not in self._expert_cache:
            self._expert_cache.clear()
            m = base.rsplit(".", 1)[1]
            rows, width = (self.cfg.latent, self.cfg.moe_inter) if m == "w2" \
                else (self.cfg.moe_inter, self.cfg.latent)
            rng = _rng(self.seed, base)
            if rows * width <= QUANTISE_LIMIT:
                w = rng.standard_normal((rows, width)) * _matrix_std(m)
                self._expert_cache[base] = quantise_mxfp4(w)
            else:
                packed = rng.integers(0, 256, (rows, width // 2), dtype=np.uint8)
                lo, hi = (124, 128) if m != "w2" else (118, 123)
                self._expert_cache[base] = (packed, rng.integers(lo, hi, (rows, width // 32),
                                                                 dtype=np.uint8))
        packed, scales = self._expert_cache[base]
        return packed if t.key.endswith("weight_packed") else scales


# ---- layout ------------------------------------------------------------------------

def tensor_units(cfg: ModelConfig) -> list[list[TensorDef]]:
    """Tensors grouped into units a shard boundary may not split: a layer's whole trunk
    (one contiguous run, so it packs as one read, SYSTEM §2.1) and each expert's six
    tensors (contiguous, in the released order)."""
    model = model_tensors(cfg)
    units = [[model[0]]]                                    # embedding first
    for L in range(cfg.n_layers):
        units.append(layer_tensors(cfg, L))
        if not cfg.is_dense(L):
            units += [expert_tensors(cfg, L, e) for e in range(cfg.n_experts)]
    units += [[t] for t in model[1:]]
    return units


def _spec(t: TensorDef) -> TensorSpec:
    dtype = {"M": "BF16", "router": "BF16", "v": "F32", "mxfp4": "U8"}[t.kind]
    return TensorSpec(t.name, dtype, t.shape)


def plan_shards(cfg: ModelConfig, shard_bytes: int) -> list[list[TensorDef]]:
    shards: list[list[TensorDef]] = [[]]
    size = 0
    for unit in tensor_units(cfg):
        ub = sum(_spec(t).nbytes for t in unit)
        if shards[-1] and size + ub > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += ub
    return shards


def make_checkpoint(out_dir: str, cfg: ModelConfig, seed: int = 0, nested: bool = False,
                    shard_bytes: int = DEFAULT_SHARD_BYTES, progress=None,
                    values: Callable[[TensorDef], np.ndarray] | None = None,
                    generator: str | None = None) -> list[str]:
    """Write the checkpoint; returns the shard paths.  `progress(done, total)` in bytes.
    `values(tensor_def)` supplies each tensor's stored array instead of the random
    generator (`k3 train-demo` exports trained weights through it); `generator` names the
    producer in the shards' metadata."""
    os.makedirs(out_dir, exist_ok=True)
    shards = plan_shards(cfg, shard_bytes)
    total = sum(_spec(t).nbytes for s in shards for t in s)
    done = 0

    def step(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    produce = values or Generator(cfg, seed).values
    generator = generator or f"k3 make-checkpoint seed={seed}"
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else \
        [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    byname = {}
    paths = []
    sums = []
    for fname, tensors in zip(names, shards):
        defs = {t.name: t for t in tensors}
        path = os.path.join(out_dir, fname)
        h = hashlib.sha256()
        write_safetensors(path, [_spec(t) for t in tensors], lambda s: produce(defs[s.name]),
                          metadata={"format": "pt", "generator": generator},
                          progress=step, digest=h)
        paths.append(path)
        sums.append(f"{h.hexdigest()}  {fname}\n")
        byname.update({t.name: fname for t in tensors})
    # what `k3 doctor --verify` checks the shards against (sha256sum format)
    write_atomic(os.path.join(out_dir, DIGEST_SIDECAR), "".join(sums).encode(), mode=0o644)
    if n > 1:
        _write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": byname})
    write_tokenizer(out_dir, cfg.vocab)
    _write_json(os.path.join(out_dir, "config.json"),
                to_nested_dict(cfg) if nested else to_flat_dict(cfg))
    return paths


def _write_json(path: str, obj: dict) -> None:
    write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode(), mode=0o644)  # model data, not private


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="k3 make-checkpoint",
                                 description="Write a deterministic Kimi K3 checkpoint in the "
                                             "released layout (random weights).")
    ap.add_argument("out_dir")
    ap.add_argument("--dims", default="tiny", choices=sorted(DIMS))
    ap.add_argument("--seed", type=int, default=0)
    shape = ap.add_mutually_exclusive_group()
    shape.add_argument("--nested", action="store_true",
                       help="write config.json in the released nested shape (default for mid)")
    shape.add_argument("--flat", action="store_true",
                       help="write config.json in the flat shape (default for tiny)")
    ap.add_argument("--shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 1e9,
                    help="largest shard size in GB (default %(default)s)")
    a = ap.parse_args(argv)
    cfg = dims_config(a.dims)
    nested = a.nested or (a.dims != "tiny" and not a.flat)
    total = sum(_spec(t).nbytes for u in tensor_units(cfg) for t in u)
    free = _free_bytes(a.out_dir)
    if free is not None and free < total * 1.05:
        print(f"k3 make-checkpoint: {a.out_dir} has {free / 1e9:.2f} GB free, "
              f"the checkpoint needs {total / 1e9:.2f} GB", file=sys.stderr)
        return 1
    last = [-1]

    def progress(done: int, tot: int) -> None:
        pct = int(100 * done / tot)
        if tot > PROGRESS_MIN_BYTES and (pct >= last[0] + 10 or done == tot):
            last[0] = pct
            print(f"  {pct:3d}%  {done / 1e9:.2f} of {tot / 1e9:.2f} GB", flush=True)

    paths = make_checkpoint(a.out_dir, cfg, a.seed, nested, int(a.shard_gb * 1e9), progress)
    has_tok = os.path.exists(os.path.join(a.out_dir, TOKENIZER_FILES[0]))
    print(f"wrote {a.out_dir}: {len(paths)} shard(s), {total / 1e9:.3f} GB, "
          f"dims {a.dims}, seed {a.seed}, config {'nested' if nested else 'flat'}, "
          f"{'with our tokenizer (usable as --tok)' if has_tok else 'no tokenizer (vocabulary too small)'}")
    print("random weights: the output is not language (a demo of the machinery)")
    return 0


def _free_bytes(path: str) -> int | None:
    d = os.path.abspath(path)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
