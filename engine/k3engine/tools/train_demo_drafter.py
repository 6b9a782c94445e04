"""`k3 train-demo-drafter`: train the demo model's block drafter (DFlash-style, the format of
/work/drafter_contract.md that the engine's --draft-model reads) on this CPU, and write it
beside the demo model (`k3 demo --drafter-path`).

    pip install -e '.[train]'          # torch==2.13.0, CPU build, from the local wheel
    k3 train-demo-drafter              # --out defaults to k3engine/data/demo_drafter

Teacher data comes from the demo model itself run by OUR engine (no torch): prompts from the
demo corpus (`demo_corpus.make_corpus`, the seed of the demo's own training) -- the last
turn's prompt of training conversations rendered in the chat format, and the first tokens of
plain texts -- are greedy-decoded by the engine (`Model.forward_batch`, resident) with
`capture` at the drafter's target layers, so every fed position's features come from the
decode itself (a position's feature does not depend on how many positions share the pass,
tests/test_capture.py: the same values a separate teacher-forced pass would give).  Labels
are the sequence's own tokens: the generated part is the target's greedy output (what
verification accepts, weight 1); the prompt part gets `PROMPT_WEIGHT` as in the demo's own
training.  Held-out prompts are the corpus's test split (crc32 residue, never a training
prompt); their greedy continuations measure the drafter.

A training sample is an anchor s (the block [token s, mask x B-1] at positions s..s+B-1)
with the context of positions < s; rows 1..B-1 predict tokens s+1..s+B-1 with weights
exp(-(i-1)/GAMMA) (DFlash: acceptance stops at the first miss, so earlier rows count more).
Many anchors of one sequence share one call (drafter_torch's block-sparse mask, exactly
separate samples).

`training.json` records the run (seed, steps, corpus sizes, wall seconds, threads, torch)
and the held-out figures of simulated greedy verification: on each held-out sequence the
engine's walk is replayed (anchor = the first generated token; a pass accepts the drafts
that match the target's greedy continuation up to the first miss, emits them plus the
target's own token, and the next anchor is the last emitted token): mean accepted drafts
per pass and mean tokens per pass (= accepted + 1).  Plain decoding is 1 token per pass.

Exit codes: 0 written; 2 usage (bad option values, an --out folder that cannot be written)
or PyTorch missing (the `[train]` extra).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..atomic import write_atomic
from ..errors import EXIT_OK, EXIT_USAGE
from ..names import LM_HEAD, PREFIX
from .demo import drafter_dir, shipped_dir
from .demo_corpus import Corpus, conversation_ids, make_corpus
from .train_demo import PROMPT_WEIGHT, TRAINING_RECORD, cosine_lr, write_manifest

# The contract's demo drafter ("The demo drafter"): E = the demo's hidden size, the target's
# vocabulary, 2 draft layers reading the demo's layers 1, 3, 5 and 7 (7 = its last).
DEMO_DRAFTER_CONFIG = {
    "model_type": "dflash",
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "vocab_size": 4256,
    "block_size": 8,
    "dflash_config": {"target_layer_ids": [1, 3, 5, 7], "mask_token_id": 4255},
}
GAMMA = 4.0            # DFlash's loss decay for block size 8: row i weighs exp(-(i-1)/GAMMA)
MAX_NEW_CHAT = 160     # a demo reply (reasoning + answer) ends well before; a cap, not a target
PLAIN_PROMPT = 12      # tokens of a plain text given as the prompt
MAX_NEW_PLAIN = 64
GEN_BATCH = 32         # sequences decoded together by the engine (one trunk pass per step)
GENERATED_SHARE = 0.75  # of the training anchors, the share drawn where verification drafts
DEFAULTS = dict(steps=1600, conversations=3000, plain=600, held_out=150, seqs_per_step=16,
                anchors_per_seq=24, lr=3e-3)


# ---- teacher data from the engine -------------------------------------------------------

@dataclass
class TeacherSeq:
    ids: np.ndarray        # int64 [L]: the prompt, then the target's greedy continuation
    n_prompt: int
    feats: np.ndarray      # float32 [L-1, n_feat*E]: features of positions 0..L-2 (the last
                           # token was never fed: nothing after it is drafted)


def chat_prompts(tok, convs) -> list[list[int]]:
    """The prompt of each conversation's last turn (earlier turns included), rendered as the
    engine's chat renders it: the ids before the last reply's first generated id."""
    out = []
    for conv in convs:
        ids, mask = conversation_ids(tok, conv)
        start = max(i for i in range(1, len(mask)) if mask[i] and not mask[i - 1])
        out.append(ids[:start])
    return out


def load_demo():
    """The demo model, resident, through the engine's loader."""
    from ..loading import load_model, read_config
    cfg, _ = read_config(shipped_dir())
    return load_model(shipped_dir(), cfg)


def greedy_with_features(lm, prompts: list[list[int]], max_new: int, stop: set[int],
                         layers: list[int], batch: int = GEN_BATCH, log=None) -> list[TeacherSeq]:
    """Greedy continuations of `prompts` by the engine, with the features of every fed
    position (prompt pass, then one position per step) at `layers`, concatenated in order."""
    from ..model import greedy
    m = lm.model
    out: list[TeacherSeq] = []
    for b0 in range(0, len(prompts), batch):
        group = prompts[b0:b0 + batch]
        states = [m.new_state(len(p) + max_new) for p in group]
        seqs = [list(p) for p in group]
        feats: list[list[np.ndarray]] = [[] for _ in group]
        live = list(range(len(group)))
        fed = [list(p) for p in group]
        while live:
            cap = dict.fromkeys(layers)
            logits = m.forward_batch([(fed[i], states[i]) for i in live], capture=cap)
            f = np.concatenate([cap[L] for L in layers], axis=1)
            row = 0
            for i, lg in zip(live, logits):
                n = len(fed[i])
                feats[i].append(f[row:row + n])
                row += n
                t = greedy(lg)
                seqs[i].append(t)
                fed[i] = [t]
            live = [i for i in live if seqs[i][-1] not in stop and
                    len(seqs[i]) - len(group[i]) < max_new]
        for i, p in enumerate(group):
            out.append(TeacherSeq(np.array(seqs[i], np.int64), len(p),
                                  np.concatenate(feats[i]).astype(np.float32)))
        if log:
            log(f"  teacher: {len(out)}/{len(prompts)} sequences")
    return out


def teacher_data(corpus: Corpus, n_conv: int, n_plain: int, n_held: int, layers, log=print):
    """(training sequences, held-out sequences, the demo's lm_head and embedding [V, E])."""
    from ..tokenizer import Tokenizer, control_ids
    tok = Tokenizer.from_dir(shipped_dir())
    stop = set(control_ids(tok, None).end_ids)
    lm = load_demo()
    try:
        train = greedy_with_features(lm, chat_prompts(tok, corpus.train[:n_conv]), MAX_NEW_CHAT,
                                     stop, layers, log=log)
        plain = [tok.encode(t, False)[:PLAIN_PROMPT] for t in corpus.plain[:n_plain]]
        train += greedy_with_features(lm, plain, MAX_NEW_PLAIN, stop, layers, log=log)
        held = greedy_with_features(lm, chat_prompts(tok, corpus.test[:n_held]), MAX_NEW_CHAT,
                                    stop, layers, log=log)
        head = lm.ck.read_f32(LM_HEAD)
        embed = lm.ck.read_f32(PREFIX + "embed_tokens.weight")
    finally:
        lm.close()
    return train, held, head, embed


# ---- batches ------------------------------------------------------------------------------

def row_weights(B: int) -> np.ndarray:
    """Per block row: 0 for the anchor's row, exp(-(i-1)/GAMMA) for draft row i."""
    return np.array([0.0] + [math.exp(-(i - 1) / GAMMA) for i in range(1, B)])


def make_batch(seqs: list[TeacherSeq], anchors: list[list[int]], B: int):
    """Tensors for DrafterTorch.forward and the loss: feats [N, T, F], anchors [N, A],
    anchor ids [N, A], labels [N, A, B] (-1 where past the end) and weights [N, A, B]."""
    import torch
    N, A = len(seqs), max(len(a) for a in anchors)
    T = max(s.feats.shape[0] for s in seqs)
    feats = torch.zeros(N, T, seqs[0].feats.shape[1])
    anc = torch.ones(N, A, dtype=torch.long)
    aid = torch.zeros(N, A, dtype=torch.long)
    labels = torch.full((N, A, B), -1, dtype=torch.long)
    wts = torch.zeros(N, A, B)
    rw = row_weights(B)
    for n, (s, an) in enumerate(zip(seqs, anchors)):
        feats[n, :s.feats.shape[0]] = torch.from_numpy(s.feats)
        L = len(s.ids)
        for a, p in enumerate(an):
            anc[n, a] = p
            aid[n, a] = int(s.ids[p])
            for i in range(1, B):
                if p + i < L:
                    labels[n, a, i] = int(s.ids[p + i])
                    wts[n, a, i] = rw[i] * (1.0 if p + i >= s.n_prompt else PROMPT_WEIGHT)
    return feats, anc, aid, labels, wts


def sample_anchors(s: TeacherSeq, k: int, rng: random.Random) -> list[int]:
    """Up to k anchors s in [1, L-2] (a context and at least one label), GENERATED_SHARE of
    them where inference drafts (s >= n_prompt: the first generated token onwards)."""
    L = len(s.ids)
    gen = list(range(max(1, s.n_prompt), L - 1))
    pre = list(range(1, min(s.n_prompt, L - 1)))
    n_gen = min(len(gen), round(k * GENERATED_SHARE) if pre else k)
    out = rng.sample(gen, n_gen) + rng.sample(pre, min(len(pre), k - n_gen))
    return sorted(out) or [1]


def groups(seqs: list[TeacherSeq], per: int, rng: random.Random):
    """Endless groups of `per` sequences of similar length (little padding), shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    chunks = [order[i:i + per] for i in range(0, len(order), per)]
    while True:
        rng.shuffle(chunks)
        yield from chunks


# ---- held-out measure ---------------------------------------------------------------------

def accepted(d: list[int], ids: np.ndarray, s: int) -> int:
    """Drafts d (after the anchor at s) equal to the continuation up to the first miss; at
    most up to the sequence's last token (the pass that reaches it ends the decode)."""
    acc = 0
    for x in d[:len(ids) - 2 - s]:
        if x != ids[s + 1 + acc]:
            break
        acc += 1
    return acc


def accepted_walk(drafts: dict[int, list[int]], ids: np.ndarray, n_prompt: int) -> list[int]:
    """Accepted drafts of each verification pass of greedy decoding: the first anchor is the
    first generated token (position n_prompt); a pass emits its accepted drafts plus the
    target's own next token, and the last emitted token is the next anchor."""
    s, out = n_prompt, []
    while s <= len(ids) - 2:
        out.append(accepted(drafts[s], ids, s))
        s += out[-1] + 1
    return out


def evaluate(model, held: list[TeacherSeq]) -> dict:
    """Simulated greedy verification on the held-out sequences (see the module doc), and the
    mean over every anchor of the generated part (not only those the walk visits)."""
    walk, every = [], []
    for s in held:
        anchors = list(range(s.n_prompt, len(s.ids) - 1))
        if not anchors:
            continue
        f, anc, aid, _, _ = make_batch([s], [anchors], model.B)
        drafts = dict(zip(anchors, model.drafts(f, anc, aid)[0].tolist()))
        walk += accepted_walk(drafts, s.ids, s.n_prompt)
        every += [accepted(drafts[p], s.ids, p) for p in anchors]
    return dict(heldout_sequences=len(held), heldout_passes=len(walk),
                heldout_mean_accepted_per_pass=round(float(np.mean(walk)), 4),
                heldout_mean_tokens_per_pass=round(float(np.mean(walk)) + 1, 4),
                heldout_mean_accepted_every_anchor=round(float(np.mean(every)), 4))


# ---- training -----------------------------------------------------------------------------

def train(out_dir: str, seed: int = 0, steps: int = DEFAULTS["steps"], threads: int = 1,
          conversations: int = DEFAULTS["conversations"], plain: int = DEFAULTS["plain"],
          held_out: int = DEFAULTS["held_out"], seqs_per_step: int = DEFAULTS["seqs_per_step"],
          anchors_per_seq: int = DEFAULTS["anchors_per_seq"], lr: float = DEFAULTS["lr"],
          log=print) -> dict:
    import torch
    from .. import kernels as K
    from .drafter_torch import DrafterTorch

    t0 = time.time()
    torch.set_num_threads(threads)
    K.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    cfg = DEMO_DRAFTER_CONFIG
    B = cfg["block_size"]
    corpus = make_corpus(0)            # the demo's own corpus (train-demo's default seed)
    tr, held, head, embed = teacher_data(corpus, conversations, plain, held_out,
                                         cfg["dflash_config"]["target_layer_ids"], log=log)
    if head.shape != (cfg["vocab_size"], cfg["hidden_size"]):
        raise ValueError(f"the demo's lm_head is {head.shape}, the drafter config wants "
                         f"({cfg['vocab_size']}, {cfg['hidden_size']})")
    data_s = time.time() - t0
    log(f"teacher data: {len(tr)} training and {len(held)} held-out sequences, "
        f"{sum(len(s.ids) for s in tr)} training positions, {data_s:.0f} s", flush=True)
    model = DrafterTorch(cfg, torch.from_numpy(embed), torch.from_numpy(head), seed)
    decay = [p for p in model.p.values() if p.dim() >= 2]
    other = [p for p in model.p.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    rng = random.Random(seed)
    it = groups(tr, seqs_per_step, rng)
    history, recent, blocks = [], [], 0
    for step in range(steps):
        group = [tr[i] for i in next(it)]
        anchors = [sample_anchors(s, anchors_per_seq, rng) for s in group]
        feats, anc, aid, labels, wts = make_batch(group, anchors, B)
        logits = model.logits(model.hidden(feats, anc, aid)[:, :, 1:])
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               labels[:, :, 1:].reshape(-1).clamp_min(0),
                                               reduction="none")
        w = wts[:, :, 1:].reshape(-1)
        loss = (ce * w).sum() / w.sum()
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, lr, steps, warm=min(50, steps // 10))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        blocks += sum(len(a) for a in anchors)
        recent = (recent + [float(loss.detach())])[-20:]
        if step % 25 == 0 or step == steps - 1:
            rec = dict(step=step, loss=round(recent[-1], 4), blocks=blocks,
                       seconds=round(time.time() - t0, 1))
            history.append(rec)
            log(json.dumps(rec), flush=True)
    train_s = time.time() - t0 - data_s
    model.eval()
    figures = evaluate(model, held)
    wall = time.time() - t0
    record = dict(seed=seed, steps=steps, threads=threads, torch=torch.__version__,
                  lr=lr, seqs_per_step=seqs_per_step, anchors_per_seq=anchors_per_seq,
                  gamma=GAMMA, prompt_weight=PROMPT_WEIGHT, generated_share=GENERATED_SHARE,
                  corpus_seed=0, train_conversations=conversations, plain_texts=plain,
                  heldout_conversations=len(held),
                  train_sequences=len(tr), train_positions=int(sum(len(s.ids) for s in tr)),
                  train_generated_tokens=int(sum(len(s.ids) - s.n_prompt for s in tr)),
                  blocks_seen=blocks, data_seconds=round(data_s, 1),
                  train_seconds=round(train_s, 1), wall_seconds=round(wall, 1),
                  final_loss=round(float(np.mean(recent)), 4),
                  final_loss_is="mean weighted CE of the last 20 steps",
                  **figures, log=history)
    export(model, cfg, out_dir, record)
    return record


# ---- export -------------------------------------------------------------------------------

def export(model, cfg: dict, out_dir: str, record: dict) -> None:
    """config.json, model.safetensors (F32, the contract's names), training.json, MANIFEST;
    each file written atomically (temp + rename)."""
    from .drafter_torch import param_shapes
    from .st_writer import TensorSpec, write_safetensors
    os.makedirs(out_dir, exist_ok=True)
    state = {n: t.float().numpy() for n, t in model.state().items()}
    specs = [TensorSpec(n, "F32", shape) for n, shape in param_shapes(cfg).items()]
    for s in specs:
        if state[s.name].shape != s.shape:
            raise AssertionError(f"{s.name}: trained {state[s.name].shape}, contract {s.shape}")
    write_safetensors(os.path.join(out_dir, "model.safetensors"), specs,
                      lambda s: np.ascontiguousarray(state[s.name], np.float32),
                      metadata={"format": "pt", "generator": f"k3 train-demo-drafter "
                                                             f"seed={record['seed']}"})
    write_atomic(os.path.join(out_dir, "config.json"), (json.dumps(cfg, indent=1) + "\n").encode())
    write_atomic(os.path.join(out_dir, TRAINING_RECORD),
                 (json.dumps(record, indent=1) + "\n").encode())
    write_manifest(out_dir)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="k3 train-demo-drafter",
        description="Train the demo model's block drafter on this CPU (needs the [train] "
                    "extra: pip install -e '.[train]'). Exit 2 without PyTorch.")
    ap.add_argument("--out", default=None,
                    help="output folder (default: the shipped k3engine/data/demo_drafter)")
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=DEFAULTS["conversations"],
                    help="training conversations decoded for teacher data")
    ap.add_argument("--plain", type=int, default=DEFAULTS["plain"],
                    help="plain texts whose first tokens are continued for teacher data")
    ap.add_argument("--held-out", type=int, default=DEFAULTS["held_out"],
                    help="held-out conversations the figures are measured on")
    a = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("k3 train-demo-drafter: PyTorch is not installed; it comes with the [train] "
              "extra: pip install -e '.[train]' (torch==2.13.0, the CPU build)", file=sys.stderr)
        return EXIT_USAGE
    if a.steps < 1 or a.threads < 1 or a.conversations < 0 or a.plain < 0 or a.held_out < 1 \
            or a.conversations + a.plain < 1:
        print("k3 train-demo-drafter: --steps, --threads and --held-out must be >= 1, and "
              "some training data (--conversations or --plain) is needed", file=sys.stderr)
        return EXIT_USAGE
    out = a.out or drafter_dir()         # beside the demo model: k3 demo --drafter-path
    # refuse an unwritable folder now, not after half an hour of training (an installed,
    # read-only package's data folder is the likely case: pass --out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        print(f"k3 train-demo-drafter: cannot create {out}: {e.strerror}", file=sys.stderr)
        return EXIT_USAGE
    if not os.access(out, os.W_OK | os.X_OK):
        print(f"k3 train-demo-drafter: {out} is not writable; give --out DIR", file=sys.stderr)
        return EXIT_USAGE
    rec = train(out, a.seed, a.steps, a.threads, a.conversations, a.plain, a.held_out)
    print(f"wrote {out}: {rec['steps']} steps, final loss {rec['final_loss']}, "
          f"{rec['wall_seconds']:.0f} s on {rec['threads']} thread(s); held-out mean accepted "
          f"drafts per pass {rec['heldout_mean_accepted_per_pass']} "
          f"({rec['heldout_mean_tokens_per_pass']} tokens per pass, plain decoding 1)")
    return EXIT_OK
