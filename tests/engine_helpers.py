"""Building and running generated checkpoints in tests (one place for the boilerplate)."""
from __future__ import annotations

import numpy as np

from k3engine import kernels as K
from k3engine.model import greedy
from k3engine.loading import load_model, read_config
from k3engine.tools.make_checkpoint import dims_config, make_checkpoint

GOLDEN_SEED = 1234
PROMPT_SEED = 1235
N_PROMPT, N_GEN = 12, 20


def make_tiny(path, seed: int = GOLDEN_SEED, nested: bool = False) -> str:
    make_checkpoint(str(path), dims_config("tiny"), seed=seed, nested=nested)
    return str(path)


def make_tiny_and_trunk(root, seed: int = GOLDEN_SEED) -> tuple[str, str]:
    """The tiny model in root/tiny and its packed trunk in root/trunk."""
    from k3engine.trunk import pack_trunk
    model = make_tiny(root / "tiny", seed)
    pack_trunk(model, str(root / "trunk"))
    return model, str(root / "trunk")


def golden_prompt(vocab: int = 256) -> list[int]:
    return [int(i) for i in np.random.default_rng(PROMPT_SEED).integers(0, vocab, N_PROMPT)]


def load(model_dir: str, n_layers: int | None = None):
    cfg, _ = read_config(model_dir)
    return load_model(model_dir, cfg, n_layers)


def greedy_full_recompute(lm, prompt: list[int], n: int) -> list[int]:
    """Every step reruns the whole sequence from a fresh state (gate 2)."""
    ids = list(prompt)
    for _ in range(n):
        st = lm.model.new_state(len(ids))
        ids.append(greedy(lm.model.forward(ids, st)))
    return ids[len(prompt):]


def greedy_incremental(lm, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill, then one id per step with carried state (gate 3); also returns the logits
    of every step."""
    st = lm.model.new_state(len(prompt) + n)
    logits = lm.model.forward(prompt, st)
    out, all_logits = [], [logits]
    for _ in range(n):
        out.append(greedy(logits))
        logits = lm.model.forward([out[-1]], st)
        all_logits.append(logits)
    return out, all_logits[:-1]


def teacher_forced_logits(lm, ids: list[int]) -> np.ndarray:
    return lm.model.forward(ids, lm.model.new_state(len(ids)), all_logits=True)


def with_threads(n: int):
    class _Ctx:
        def __enter__(self):
            self.old = K.get_num_threads()
            K.set_num_threads(n)

        def __exit__(self, *a):
            K.set_num_threads(self.old)
    return _Ctx()


def decode(lm, prompt: list[int], gen: int, spec: int = 0, proposer=None,
           spec_auto: bool = False):
    """The engine's one decode loop over a model loaded here (Engine.around): a greedy
    batch run of `gen` ids after `prompt`, its TurnSummary."""
    from k3engine.engine import Engine
    from k3engine.generate import GenSpec, Turn
    turn = Turn(Engine.around(lm, spec=spec, draft=proposer).batch(
        list(prompt), GenSpec(gen=gen, spec=spec, spec_auto=spec_auto)))
    for _ in turn:
        pass
    return turn.summary


def chat_on(lm, tok, history, sampler=None):
    """A Conversation over a model loaded here (Engine.around), with `sampler` in place of
    the one its GenSpec would make (a forced reply, a fixed seed)."""
    from k3engine.conversation import Conversation
    from k3engine.engine import Engine
    return Conversation(Engine.around(lm, tok), history, sampler=sampler)


def run_turn(turn, on_token=None):
    """Drive a Conversation turn (or continue_turn) generator; `on_token(n, id)` per id.
    Returns its TurnSummary."""
    from k3engine.events import TokenOut
    from k3engine.generate import Turn
    events = Turn(turn)
    n = 0
    for ev in events:
        if isinstance(ev, TokenOut) and ev.id >= 0:
            n += 1
            if on_token is not None:
                on_token(n, ev.id)
    return events.summary
