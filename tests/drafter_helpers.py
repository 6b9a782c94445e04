"""Random-weight block drafters in the format of docs/drafter.md, for any target shape
(the tests' and the timing runs'; the demo's trained drafter comes from
`k3 train-demo-drafter`)."""
from __future__ import annotations

import json
import os

import numpy as np

from k3engine.checkpoint import to_bf16
from k3engine.tools.st_writer import TensorSpec, write_safetensors


def drafter_config(target, layers, n_layers=2, heads=4, kv_heads=2, head_dim=32,
                   inter=256, block=8, mask=None, **extra) -> dict:
    """The config.json of a drafter for `target` (a ModelConfig)."""
    cfg = {"model_type": "dflash", "architectures": ["DFlashDraftModel"],
           "hidden_size": target.hidden, "num_hidden_layers": n_layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "intermediate_size": inter, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "vocab_size": target.vocab, "block_size": block,
           "dflash_config": {"target_layer_ids": list(layers),
                             "mask_token_id": target.vocab - 1 if mask is None else mask}}
    cfg.update(extra)
    return cfg


def make_drafter(folder, target, layers, seed: int = 0, dtype: str = "F32",
                 rename=lambda n: n, **dims) -> str:
    """Write config.json and model.safetensors of a random drafter: Linear weights of
    std 1/sqrt(in), norm gains random around 1 (a gain on the wrong index shows)."""
    from k3engine.drafter import read_drafter_config, drafter_tensors
    os.makedirs(folder, exist_ok=True)
    cfg = drafter_config(target, layers, **dims)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    dc = read_drafter_config(str(folder), target)
    shapes = drafter_tensors(dc)
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            arrays[name] = rng.uniform(0.6, 1.4, shape).astype(np.float32)
        else:
            arrays[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    store = {rename(n): (to_bf16(a) if dtype == "BF16" else a) for n, a in arrays.items()}
    specs = [TensorSpec(n, dtype, a.shape) for n, a in store.items()]
    write_safetensors(os.path.join(folder, "model.safetensors"), specs,
                      lambda s: store[s.name])
    return str(folder)
