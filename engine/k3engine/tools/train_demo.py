"""`k3 train-demo OUT_DIR`: train the shipped demo model, a tiny model in the exact Kimi K3
architecture, on the project's own corpus (`demo_corpus`), and export it in the released
layout.

    pip install -e '.[train]'          # torch==2.13.0, CPU build, from the local wheel
    k3 train-demo engine/k3engine/data/demo_model --seed 0

What it builds (`TRAINED_DIMS`): 8 layers (KDA at 0-2 and 4-6 with short convolutions, gated
MLA at 3 and 7), a dense SiTU MLP in layer 0, LatentMoE in layers 1-7 with 32 MXFP4 routed
experts (top 4) plus the fused shared expert, Block Attention Residuals with blocks of 3, our
vocabulary (4,000 ranks + 256 added tokens with the K3 control tokens).

How: `demo_torch.K3Torch`, a PyTorch forward pass written from ARCHITECTURE §4 (no engine
code), in float32 on ONE thread (`torch.set_num_threads(1)`, deterministic algorithms, a fixed
seed for weights, corpus and batch order: the same seed on the same machine gives the same
weights).  AdamW with warm-up and cosine decay; the loss counts every token the model generates
in a chat turn (the reply through its `<|end_of_msg|>`) at 1, those holding a digit (the
operands restated from the question, the result) at `NUMBER_WEIGHT` = 4, and the prompt
tokens at `PROMPT_WEIGHT` = 0.1.
Routing is kept alive the K3 way, by the selection bias `e_score_correction_bias` nudged
towards under-used experts after every step (it only selects, never weights, §4.7.1), plus a
small switch-style load-balance loss.  The last `--qat-steps` run quantisation-aware: the
forward sees every BF16 matrix rounded to BF16 and every routed expert rounded by the MXFP4
§7.9 rule (straight-through gradients), so the exported files hold the very values trained
last.  Export goes through `make_checkpoint` (its shard plan, safetensors writer, `to_bf16`
and `quantise_mxfp4`); `MANIFEST.sha256` lists every shipped file.

Measured for the shipped model (`--seed 0`, the defaults): docs/demo-model.md gives its
steps, tokens, wall and CPU time and the machine's load while it ran.  `training.json` in the
output directory records each run's wall time, steps, tokens and loss log.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time

import numpy as np

from ..atomic import write_atomic
from ..checkpoint import to_bf16
from ..config import ModelConfig, parse_config
from ..names import LM_HEAD, PREFIX, TensorDef
from .demo_corpus import Corpus, conversation_ids, make_corpus
from .make_checkpoint import _TINY, make_checkpoint, quantise_mxfp4

# Small enough to train in well under an hour on one core, every layer kind present.
TRAINED_DIMS = dict(
    _TINY, hidden_size=128, num_hidden_layers=8, kda_num_heads=4, kda_head_dim=32,
    num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, num_experts=32, num_experts_per_token=4,
    routed_expert_hidden_size=64, moe_intermediate_size=64, intermediate_size=256,
    attn_res_block_size=3, full_attn_layers=[4, 8], vocab_size=None,
)
MANIFEST = "MANIFEST.sha256"
TRAINING_RECORD = "training.json"
PROMPT_WEIGHT = 0.1            # loss weight of tokens the model reads but never generates
# Generated tokens that hold a digit (operands restated from the question, results): a few
# per reply among ~20 generated ones, yet the whole point of a one-answer question.
NUMBER_WEIGHT = 4.0
AUX_WEIGHT = 0.01
BIAS_STEP = 1e-3


def trained_config() -> ModelConfig:
    from ..tokenizer import Tokenizer, default_tokenizer_dir
    d = dict(TRAINED_DIMS, vocab_size=Tokenizer.from_dir(default_tokenizer_dir()).vocab_size)
    return parse_config(d, "train-demo dims")


# ---- data -------------------------------------------------------------------------------

def digit_ids(tok) -> set[int]:
    """The ids whose text holds a digit (numbers split into runs of up to three digits)."""
    return {i for i in range(tok.vocab_size) if any(48 <= b <= 57 for b in tok.decode([i]))}


def training_sequences(tok, corpus: Corpus, prompt_weight: float = PROMPT_WEIGHT,
                       number_weight: float = NUMBER_WEIGHT) -> list[tuple[list[int], list[float]]]:
    """(ids, per-token loss weight): prompt tokens `prompt_weight`, generated tokens 1, generated
    tokens with a digit `number_weight`; plain text counts as generated."""
    digits = digit_ids(tok)

    def weights(ids, mask):
        return [(number_weight if i in digits else 1.0) if m else prompt_weight
                for i, m in zip(ids, mask)]
    out = []
    for conv in corpus.train:
        ids, mask = conversation_ids(tok, conv)
        out.append((ids, weights(ids, mask)))
    for text in corpus.plain:
        ids = tok.encode(text, False)
        out.append((ids, weights(ids, [1] * len(ids))))
    return out


def batches(seqs, batch_tokens: int, rng: random.Random):
    """Endless batches: shuffle, then sort windows of 64 by length so rows pad little."""
    while True:
        order = list(range(len(seqs)))
        rng.shuffle(order)
        for w in range(0, len(order), 64):
            window = sorted(order[w:w + 64], key=lambda i: len(seqs[i][0]))
            batch: list[int] = []
            for i in window:
                longest = max([len(seqs[j][0]) for j in batch] + [len(seqs[i][0])])
                if batch and longest * (len(batch) + 1) > batch_tokens:
                    yield batch
                    batch = []
                batch.append(i)
            if batch:
                yield batch


def collate(seqs, batch):
    import torch
    T = max(len(seqs[i][0]) for i in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    wts = torch.zeros(len(batch), T)
    for r, i in enumerate(batch):
        s, w = seqs[i]
        ids[r, :len(s)] = torch.tensor(s)
        wts[r, :len(w)] = torch.tensor(w)
    return ids, wts


# ---- training ---------------------------------------------------------------------------

def cosine_lr(step: int, lr: float, steps: int, warm: int) -> float:
    """Linear warm-up over `warm` steps, then cosine decay to 5 % of `lr` at `steps`."""
    if step < warm:
        return lr * (step + 1) / warm
    f = (step - warm) / max(1, steps - warm)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, f))))


def train(out_dir: str, seed: int = 0, steps: int = 900, qat_steps: int = 90,
          batch_tokens: int = 2048, lr: float = 6e-3, prompt_weight: float = PROMPT_WEIGHT,
          number_weight: float = NUMBER_WEIGHT, log=print) -> dict:
    import torch
    from .demo_torch import K3Torch
    from ..config import to_flat_dict
    from ..tokenizer import Tokenizer, default_tokenizer_dir

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    t0 = time.time()
    cfg = trained_config()
    tok = Tokenizer.from_dir(default_tokenizer_dir())
    corpus = make_corpus(seed)
    seqs = training_sequences(tok, corpus, prompt_weight, number_weight)
    model = K3Torch(to_flat_dict(cfg), seed)    # the flat field names of the spec
    decay = [p for n, p in model.p.items() if p.dim() >= 2]
    other = [p for n, p in model.p.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    rng = random.Random(seed)
    it = batches(seqs, batch_tokens, rng)
    moe_layers = [L for L in range(cfg.n_layers) if not cfg.is_dense(L)]
    history = []
    tokens = 0
    for step in range(steps):
        model.quant = step >= steps - qat_steps
        ids, wts = collate(seqs, next(it))
        model.valid = (wts[:, :-1] > 0).reshape(-1)
        logits = model(ids[:, :-1])
        model.valid = None
        w = wts[:, 1:]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               ids[:, 1:].reshape(-1), reduction="none")
        loss_lm = (ce * w.reshape(-1)).sum() / w.sum()
        aux = torch.stack(model.aux_losses).mean()
        loss = loss_lm + AUX_WEIGHT * aux
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, lr, steps, warm=30)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():                       # aux-loss-free balancing of the selection
            for L in moe_layers:
                cnt = model.expert_counts[L]
                b = model.p[f"layers/{L}/block_sparse_moe/gate/e_score_correction_bias"]
                b += BIAS_STEP * torch.sign(cnt.mean() - cnt).to(b.dtype)
        tokens += int((wts[:, 1:] > 0).sum())
        if step % 10 == 0 or step == steps - 1:
            used = min(int((model.expert_counts[L] > 0).sum()) for L in moe_layers)
            rec = dict(step=step, loss=round(float(loss_lm.detach()), 4), aux=round(float(aux.detach()), 4),
                       min_experts_used=used, tokens=tokens, seconds=round(time.time() - t0, 1),
                       qat=model.quant)
            history.append(rec)
            log(json.dumps(rec), flush=True)
    wall = time.time() - t0
    record = dict(seed=seed, steps=steps, qat_steps=qat_steps, batch_tokens=batch_tokens, lr=lr,
                  prompt_weight=prompt_weight, number_weight=number_weight,
                  train_conversations=len(corpus.train), plain_texts=len(corpus.plain),
                  tokens_seen=tokens, wall_seconds=round(wall, 1), threads=1,
                  torch=torch.__version__, final_loss=history[-1]["loss"], log=history)
    export(model, cfg, out_dir, record)
    return record


# ---- export -----------------------------------------------------------------------------

def _torch_name(t: TensorDef) -> tuple[str, str | None]:
    """(demo_torch parameter name, expert part) for a checkpoint tensor."""
    if t.name == LM_HEAD:
        return "lm_head.weight", None
    rest = t.name[len(PREFIX):]
    if ".experts." in rest:
        head, e, m, part = rest.rsplit(".", 3)       # ...experts, E, w1, weight_packed
        return f"{head}.{m}", f"{e}.{part}"
    return rest, None


def tensor_values(model, cfg: ModelConfig):
    """`values(tensor_def)` for make_checkpoint: trained float32 weights in the stored dtypes."""
    params = {n.replace("/", "."): p.detach().to("cpu").float().numpy() for n, p in model.p.items()}
    cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def values(t: TensorDef) -> np.ndarray:
        name, part = _torch_name(t)
        w = params[name]
        if part is not None:
            e, which = part.split(".")
            key = f"{name}.{e}"
            if key not in cache:
                cache.clear()
                cache[key] = quantise_mxfp4(w[int(e)])
            packed, scales = cache[key]
            return packed if which == "weight_packed" else scales
        w = w.reshape(t.shape)
        return to_bf16(w) if t.kind in ("M", "router") else np.ascontiguousarray(w, np.float32)
    return values


def check_quantisers_agree(model) -> None:
    """The QAT forward's MXFP4 rounding (torch) and the exporter's (make_checkpoint's numpy
    quantise_mxfp4) must give the same values, else the model that shipped is not the one
    trained last.  Checked on every routed expert matrix."""
    import torch
    from .demo_torch import mxfp4_round
    table = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0,
                      -3.0, -4.0, -6.0])
    for n, p in model.p.items():
        if "/experts/w" not in n:
            continue
        q = mxfp4_round(p.detach().double()).numpy()
        w = p.detach().float().numpy()
        for e in range(w.shape[0]):
            packed, scales = quantise_mxfp4(w[e])
            codes = np.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
            deq = table[codes] * np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=1)
            if not np.array_equal(deq, q[e]):
                raise AssertionError(f"{n}[{e}]: torch and numpy MXFP4 rounding differ")


def export(model, cfg: ModelConfig, out_dir: str, record: dict) -> None:
    check_quantisers_agree(model)
    make_checkpoint(out_dir, cfg, nested=True, values=tensor_values(model, cfg),
                    generator=f"k3 train-demo seed={record['seed']}")
    write_atomic(os.path.join(out_dir, TRAINING_RECORD),
                 (json.dumps(record, indent=1) + "\n").encode())
    write_manifest(out_dir)


def shipped_files(model_dir: str) -> list[str]:
    return sorted(f for f in os.listdir(model_dir)
                  if f != MANIFEST and not f.startswith((".", "__")) and
                  os.path.isfile(os.path.join(model_dir, f)) and not f.endswith(".py"))


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(model_dir: str) -> None:
    lines = [f"{sha256_file(os.path.join(model_dir, f))}  {f}\n" for f in shipped_files(model_dir)]
    write_atomic(os.path.join(model_dir, MANIFEST), "".join(lines).encode())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="k3 train-demo",
                                 description="Train the demo model (needs the [train] extra: "
                                             "pip install -e '.[train]').")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--qat-steps", type=int, default=90)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=6e-3)
    a = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("k3 train-demo: PyTorch is not installed; pip install -e '.[train]' "
              "(torch==2.13.0, the CPU build)", file=sys.stderr)
        return 2
    if a.qat_steps > a.steps:
        print("k3 train-demo: --qat-steps exceeds --steps", file=sys.stderr)
        return 2
    rec = train(a.out_dir, a.seed, a.steps, a.qat_steps, a.batch_tokens, a.lr)
    print(f"wrote {a.out_dir}: {rec['steps']} steps, {rec['tokens_seen']} tokens, "
          f"final loss {rec['final_loss']}, {rec['wall_seconds']:.0f} s on 1 thread")
    return 0
