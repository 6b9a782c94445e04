"""The independent check of the shipped demo model: the PyTorch forward pass written from the
spec (k3engine.tools.demo_torch, no engine code) in float64 on the values stored in the
shipped files, against the engine's teacher-forced float32 logits on held-out text.

Tolerance: ARCHITECTURE §5.7's yardstick for final logits, max |engine - torch| / max |torch|
<= 1.2e-7 * sqrt(E) * 50 (6.8e-5 at E = 128), and the same argmax at every position."""
from __future__ import annotations

import numpy as np


def tolerance(hidden: int) -> float:
    return 1.2e-7 * hidden ** 0.5 * 50


def compare_engine_torch(model_dir: str, tok, convs) -> dict:
    import torch
    from k3engine.chat import ChatOptions, encode_prompt, render_segments
    from k3engine.loading import load_model, read_config
    from k3engine.tools.demo_torch import load_checkpoint
    torch.set_num_threads(1)
    cfg, _ = read_config(model_dir)
    lm = load_model(model_dir, cfg)
    ref_model = load_checkpoint(model_dir, torch.float64)
    ref_model.chunked = False                    # the spec's step-by-step recurrence
    worst = 0.0
    positions = same = 0
    for conv in convs:
        ids = encode_prompt(tok, render_segments(conv.history(), ChatOptions(thinking=conv.thinking),
                                                 False))
        eng = lm.model.forward(ids, lm.model.new_state(len(ids)), all_logits=True)
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids]))[0].numpy()
        worst = max(worst, float(np.abs(eng.astype(np.float64) - ref).max() / np.abs(ref).max()))
        positions += len(ids)
        same += int((eng.argmax(-1) == ref.argmax(-1)).sum())
    lm.close()
    return dict(sequences=len(convs), positions=positions, same_argmax=same,
                worst_rel_diff=worst, tolerance=tolerance(cfg.hidden))
