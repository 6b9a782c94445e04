"""Loading a model and the batch generation loop (SYSTEM §6.4), independent of how the
results are shown: the CLI prints the reference's report from the same step records a GUI
would plot."""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import kernels as K
from .bind import Binder, CheckpointExperts, ResidentWeights
from .checkpoint import Checkpoint
from .config import ConfigError, ModelConfig, load_config
from .model import Model, greedy

MAX_PROMPT = 32768
MAX_GEN = 4096
MAX_POSITIONS = 36864


def peak_rss_bytes() -> int:
    """Peak resident set from the OS (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def physical_cores() -> int:
    """Physical cores (SYSTEM §5.7): CPUs that are the first of their sibling list."""
    logical = os.cpu_count() or 1
    try:
        base = "/sys/devices/system/cpu"
        firsts = set()
        for name in os.listdir(base):
            if name.startswith("cpu") and name[3:].isdigit():
                with open(f"{base}/{name}/topology/thread_siblings_list") as f:
                    firsts.add(f.read().strip().replace("-", ",").split(",")[0])
        if firsts:
            return min(len(firsts), logical)
    except OSError:
        pass
    return logical


def default_threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) >= 1:
        return int(env)
    return physical_cores()


@dataclass
class LoadedModel:
    cfg: ModelConfig
    ck: Checkpoint
    model: Model
    experts: CheckpointExperts
    index_seconds: float
    bind_seconds: float
    trunk_bytes: int
    table_bytes: int


def read_config(model_dir: str, config_path: str | None = None) -> tuple[ModelConfig, str]:
    """The model's config; raises ConfigError (exit 2) naming the file."""
    path = config_path or os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        # The reference falls back to built-in constants here; we refuse (ARCHITECTURE §1.4).
        raise ConfigError(path, "no config.json: refusing to guess the architecture")
    return load_config(path), path


def load_model(model_dir: str, cfg: ModelConfig, n_layers: int | None = None) -> LoadedModel:
    """Shard index, completeness check, then the resident trunk.  Raises CheckpointError
    (exit 1) with a message naming the file and tensor."""
    nl = cfg.n_layers if n_layers is None else n_layers
    t0 = time.monotonic()
    ck = Checkpoint(model_dir)
    t1 = time.monotonic()
    binder = Binder(ck, cfg)
    binder.require_complete(nl)
    weights = ResidentWeights(binder, nl)
    t2 = time.monotonic()
    experts = CheckpointExperts(binder)
    return LoadedModel(cfg, ck, Model(cfg, weights, experts, nl), experts, t1 - t0, t2 - t1,
                       weights.trunk_nbytes(), weights.tables_nbytes())


@dataclass
class Step:
    step: int
    ids: list[int]
    seconds: float
    expert_bytes: int
    logits: np.ndarray | None = None     # the first step's logits (for --dump-logits)


@dataclass
class RunResult:
    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    layers_completed: int = 0

    @property
    def wall_seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def expert_bytes(self) -> int:
        return sum(s.expert_bytes for s in self.steps)


def generate(lm: LoadedModel, prompt_ids: list[int], gen: int, incremental: bool,
             on_step: Callable[[Step], None] | None = None) -> RunResult:
    """Greedy decode.  Incremental: step 0 prefills the prompt, later steps feed one token
    with carried state.  Otherwise every step recomputes the whole sequence from a fresh
    state (the reference's default); both give the same ids by construction (§4.10)."""
    model = lm.model
    res = RunResult(list(prompt_ids))
    seq = list(prompt_ids)
    state = model.new_state(len(seq) + gen + 1)
    g = 0
    while len(res.generated_ids) < gen or (incremental and g == 0):
        before = lm.experts.bytes_read
        t0 = time.monotonic()
        if incremental:
            logits = model.forward(seq[state.n_cached:], state)
        else:
            state.reset()
            logits = model.forward(seq, state)
        emitted = [greedy(logits)] if len(res.generated_ids) < gen else []
        step = Step(g, emitted, time.monotonic() - t0, lm.experts.bytes_read - before,
                    logits if g == 0 else None)
        res.steps.append(step)
        res.layers_completed = model.layers_completed
        for i in emitted:
            seq.append(i)
            res.generated_ids.append(i)
        if on_step:
            on_step(step)
        g += 1
    return res


def set_threads(n: int) -> None:
    K.set_num_threads(n)
