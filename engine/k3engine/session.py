"""Loading a model and the batch generation loop (SYSTEM §6.4), independent of how the
results are shown: the CLI prints the reference's report from the same step records a GUI
would plot."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from . import kernels as K
from .bind import Binder, CheckpointExperts, ResidentWeights, deep_nbytes
from .checkpoint import Checkpoint
from .experts import ExpertCache, ExpertLoadError, ResidentExperts
from .config import ConfigError, ModelConfig, load_config
from .draft import DraftModel, DraftRouter, ResidentOnly
from .memory import ModelFigures, Plan, moe_chunk_for
from .errors import UsageError
from .model import PREFILL_CHUNK, Model, Stopped, greedy
from .names import expert_tensors, layer_tensors, model_tensors
from .sampler import Sampler
from .speculative import SpecCounters, SpecWidth, spec_step
from .state import SequenceState
from .trunk import StreamedTrunk, TrunkManifest
from .ultra import StreamedTables

MAX_PROMPT = 32768
MAX_GEN = 4096
MAX_POSITIONS = 36864


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
class ModelSetup:
    """Everything known before the large allocations: config, shard index, the packed
    trunk's manifest and the sizes the memory planner needs."""
    cfg: ModelConfig
    ck: Checkpoint
    binder: Binder
    n_layers: int
    manifest: TrunkManifest | None
    figures: ModelFigures
    index_seconds: float
    draft_manifest: TrunkManifest | None = None     # hybrid decode's draft trunk

    @property
    def draft_sizes(self) -> list[int] | None:
        m = self.draft_manifest
        return None if m is None else [m.layers[L].nbytes for L in range(self.n_layers)]


@dataclass
class LoadedModel:
    cfg: ModelConfig
    ck: Checkpoint
    model: Model
    experts: ExpertCache | ResidentExperts
    index_seconds: float
    bind_seconds: float
    trunk_bytes: int
    table_bytes: int
    trunk: StreamedTrunk | None = None
    ultra: bool = False

    def close(self) -> None:
        if self.trunk is not None:
            self.trunk.close()
        if self.ultra:
            self.model.weights.tables.close()
        self.ck.close()

    @property
    def table_stream(self):
        """The streamed model tables (--ultra-low-memory), or None."""
        return self.model.weights.tables if self.ultra else None


def read_config(model_dir: str, config_path: str | None = None) -> tuple[ModelConfig, str]:
    """The model's config; raises ConfigError (exit 2) naming the file."""
    path = config_path or os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        # The reference falls back to built-in constants here; we refuse (ARCHITECTURE §1.4).
        raise ConfigError(path, "no config.json: refusing to guess the architecture")
    return load_config(path), path


def _resident_layer_bytes(ck: Checkpoint, cfg: ModelConfig, L: int) -> int:
    return sum(ck.info(t.name).nbytes for t in layer_tensors(cfg, L))


def open_trunk(trunk_dir: str, ck: Checkpoint, n_layers: int, draft: bool = False
               ) -> TrunkManifest:
    """A packed trunk's manifest, checked against the checkpoint and for its kind (the
    exact trunk, or a draft trunk for hybrid decode)."""
    manifest = TrunkManifest.load(trunk_dir)
    if not draft:
        manifest.require_exact()
    manifest.check_against(ck, n_layers)
    return manifest


def open_model(model_dir: str, cfg: ModelConfig, n_layers: int | None = None,
               trunk_dir: str | None = None, draft_dir: str | None = None) -> ModelSetup:
    """Index the shards, refuse a partial download, open and cross-check a packed trunk
    (and the draft trunk).  Raises CheckpointError / TrunkError (exit 1) naming the file."""
    nl = cfg.n_layers if n_layers is None else n_layers
    t0 = time.monotonic()
    ck = Checkpoint(model_dir)
    try:
        binder = Binder(ck, cfg)
        binder.require_complete(nl)
        manifest = None
        draft = open_trunk(draft_dir, ck, nl, draft=True) if draft_dir else None
        if trunk_dir:
            manifest = open_trunk(trunk_dir, ck, nl)
            sizes = [manifest.layers[L].nbytes for L in range(cfg.n_layers)
                     if L < len(manifest.layers)]
        else:
            sizes = [_resident_layer_bytes(ck, cfg, L) for L in range(cfg.n_layers)]
        moe = next((L for L in range(cfg.n_layers) if not cfg.is_dense(L)), None)
        expert_bytes = 0 if moe is None else \
            sum(ck.info(t.name).nbytes for t in expert_tensors(cfg, moe, 0))
        tables = sum(ck.info(t.name).nbytes for t in model_tensors(cfg) if t.kind == "M")
        figures = ModelFigures.for_config(cfg, sizes, expert_bytes, table_bytes=tables)
        if trunk_dir:                   # the compressed copy's decode scratch (its readers)
            from dataclasses import replace
            from .trunk import IO_THREADS
            from .trunk_compress import planned_scratch
            figures = replace(figures, stream_scratch_bytes=planned_scratch(
                trunk_dir, manifest, IO_THREADS))
    except BaseException:
        ck.close()
        raise
    return ModelSetup(cfg, ck, binder, nl, manifest, figures, time.monotonic() - t0, draft)


def load_draft(lm: "LoadedModel", setup: ModelSetup, plan: Plan, capacity: int,
               topk: int, cache_only: bool) -> DraftModel:
    """The draft model of hybrid decode: the setup's draft trunk (pinned as `plan`'s
    draft_plan says, the rest streamed), the exact model's tables and expert cache, and
    the draft's routing (draft.DraftRouter)."""
    dp = plan.draft_plan
    trunk = StreamedTrunk(setup.draft_manifest, setup.binder, lm.model.weights.tables,
                          setup.n_layers, set(dp.pinned), dp.ring_slots)
    experts = ResidentOnly(lm.experts) if cache_only else lm.experts
    model = Model(setup.cfg, trunk, experts, setup.n_layers,
                  router=DraftRouter(lm.experts, topk, cache_only))
    return DraftModel(model, capacity, trunk)


def _injected_failure() -> Callable[[int, int], bool] | None:
    """K3_FAIL_EXPERT=L,E (E may be *) makes every read of that expert of layer L fail:
    the fault injection behind the exit-4 tests (a failed expert is never skipped)."""
    spec = os.environ.get("K3_FAIL_EXPERT")
    if not spec:
        return None
    parts = spec.split(",")
    if len(parts) != 2 or not (parts[0].isascii() and parts[0].isdigit()) or \
            not (parts[1] == "*" or (parts[1].isascii() and parts[1].isdigit())):
        raise UsageError(f"K3_FAIL_EXPERT={spec!r}: expected LAYER,EXPERT (EXPERT may be *)")
    layer, expert = int(parts[0]), parts[1]
    return lambda L, e: L == layer and expert in ("*", str(e))


def load_model(model_dir: str | ModelSetup, cfg: ModelConfig | None = None,
               n_layers: int | None = None, plan: Plan | None = None,
               on_trunk_read: Callable[[int, int, float], None] | None = None,
               cache_bytes: int | None = None, ultra: bool = False,
               keep_trace: bool = True, trace_window: int = 0,
               cache_policy: str | None = None) -> LoadedModel:
    """Bind the model tables and the trunk (resident, or streamed when the setup has a
    packed trunk and `plan` chose its pinned set and ring).  Routed experts come from a
    bounded cache of `cache_bytes`, or are read once and kept when it is None.  `ultra`
    streams the embedding and lm_head too (needs a packed trunk).  `cache_policy` names
    the cache's replacement policy (experts.make_policy)."""
    setup = model_dir if isinstance(model_dir, ModelSetup) else \
        open_model(model_dir, cfg, n_layers)
    cfg, ck, binder, nl = setup.cfg, setup.ck, setup.binder, setup.n_layers
    t0 = time.monotonic()
    if ultra and setup.manifest is None:
        raise ValueError("--ultra-low-memory needs a packed trunk")
    tables = StreamedTables(ck, cfg, binder) if ultra else binder.tables()
    trunk = None
    if setup.manifest is not None:
        tp = plan.trunk_plan if plan is not None and plan.trunk_plan is not None else None
        pinned = set(tp.pinned) if tp else set()
        ring = tp.ring_slots if tp else 2
        trunk = weights = StreamedTrunk(setup.manifest, binder, tables, nl, pinned, ring,
                                        on_read=on_trunk_read)
        trunk_bytes = 0
    else:
        weights = ResidentWeights(binder, nl)
        trunk_bytes = weights.trunk_nbytes()
    experts = ExpertCache(ck, cfg, cache_bytes, n_layers=nl, fail_reads=_injected_failure(),
                          keep_trace=keep_trace, trace_window=trace_window,
                          policy=cache_policy) \
        if cache_bytes else ResidentExperts(CheckpointExperts(binder), cfg.n_layers,
                                            cfg.n_experts, keep_trace, trace_window)
    table_bytes = deep_nbytes(tables) if not ultra else \
        tables.final_norm.nbytes + tables.phi_out.nbytes
    model = Model(cfg, weights, experts, nl,
                  moe_chunk=moe_chunk_for(plan, setup.figures, PREFILL_CHUNK))
    return LoadedModel(cfg, ck, model, experts,
                       setup.index_seconds, time.monotonic() - t0, trunk_bytes,
                       table_bytes, trunk, ultra)


class Cancel:
    """A stop request honoured at the next safe point (between decode steps): SIGINT in
    the CLI, the Stop button in the app (SYSTEM §6.6)."""

    def __init__(self):
        self._flag = threading.Event()

    def set(self) -> None:
        self._flag.set()

    def __bool__(self) -> bool:
        return self._flag.is_set()


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
    prior_ids: list[int] = field(default_factory=list)
    generated_ids: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    layers_completed: int = 0
    stopped_at: int = -1
    interrupted: bool = False
    expert_drop: str | None = None     # a routed expert failed: the token was not emitted
    spec: SpecCounters = field(default_factory=SpecCounters)
    state: SequenceState | None = None

    @property
    def wall_seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def expert_bytes(self) -> int:
        return sum(s.expert_bytes for s in self.steps)

    @property
    def full_ids(self) -> list[int]:
        return self.prior_ids + self.prompt_ids + self.generated_ids


def generate(lm: LoadedModel, prompt_ids: list[int], gen: int, incremental: bool,
             on_step: Callable[[Step], None] | None = None, stop_ids: Iterable[int] = (),
             sampler: Sampler | None = None, cancel: Cancel | None = None,
             state: SequenceState | None = None, prior_ids: Iterable[int] = (),
             on_step_start: Callable[[int], None] | None = None, spec: int = 0,
             proposer=None, spec_auto: bool = False) -> RunResult:
    """generate_steps with a callback per step; returns the RunResult."""
    steps = generate_steps(lm, prompt_ids, gen, incremental, stop_ids, sampler, cancel,
                           state, prior_ids, on_step_start, spec, proposer, spec_auto)
    while True:
        try:
            s = next(steps)
        except StopIteration as done:
            return done.value
        if on_step:
            on_step(s)


def generate_steps(lm: LoadedModel, prompt_ids: list[int], gen: int, incremental: bool,
                   stop_ids: Iterable[int] = (), sampler: Sampler | None = None,
                   cancel: Cancel | None = None, state: SequenceState | None = None,
                   prior_ids: Iterable[int] = (),
                   on_step_start: Callable[[int], None] | None = None, spec: int = 0,
                   proposer=None, spec_auto: bool = False, stop_in_pass: bool = False):
    """The decode loop of SYSTEM §6.4, yielding each Step and returning the RunResult.
    Incremental: step 0 feeds everything not yet cached (a resumed state's pending token
    plus the new prompt), later steps one token with the carried state.  Otherwise every
    step recomputes the whole sequence from a fresh state (the reference's default); both
    give the same ids by construction (§4.10).  `cancel` is honoured at the top of each
    step (the step in flight completes, as SIGINT does in the reference, §6.6) and, with
    `stop_in_pass`, also between the layers of a pass over the prompt (the app's and the
    server's Stop: the pass is abandoned, the state poisoned, nothing emitted from it).  `spec` > 0 (incremental, greedy) verifies
    up to `spec` drafts in one sweep: same ids, fewer steps.  Drafts come from `proposer`
    (a draft model) or n-gram lookup; `spec_auto` adapts the sweep width (SpecWidth)."""
    model = lm.model
    res = RunResult(list(prompt_ids), list(prior_ids))
    seq = res.prior_ids + res.prompt_ids
    stops = set(stop_ids)
    if state is None:
        state = model.new_state(len(seq) + gen + 1, shared_recurrent=lm.ultra and not incremental)
    res.state = state
    width = SpecWidth(spec or 1, spec_auto)
    g = 0
    while len(res.generated_ids) < gen or (incremental and g == 0):
        if cancel:
            res.interrupted = True
            break
        if on_step_start:
            on_step_start(g)                  # e.g. open a new per-step counter window
        before = lm.experts.bytes_read
        t0 = time.monotonic()
        left = gen - len(res.generated_ids)
        emitted = []
        try:
            if incremental and spec and g > 0 and left > 1 and \
                    (sampler is None or not sampler.sampling) and width.ready():
                before_d, before_a = res.spec.drafted, res.spec.accepted
                emitted, logits = spec_step(model, seq, state, min(width.n, left - 1),
                                            res.spec, proposer)
                width.update(res.spec.drafted - before_d, res.spec.accepted - before_a)
                res.spec.width = width.n
            elif incremental:
                # a one-token step always completes; a prompt pass may stop between layers
                logits = model.forward(seq[state.n_cached:], state,
                                       cancel=cancel if stop_in_pass and g == 0 else None)
            else:
                state.reset()
                logits = model.forward(seq, state, cancel=cancel if stop_in_pass else None)
        except ExpertLoadError as e:          # never emit a token computed without an expert
            res.expert_drop = str(e)
            res.layers_completed = model.layers_completed
            break
        except Stopped:
            res.interrupted = True
            res.layers_completed = model.layers_completed
            break
        if not emitted and left > 0:
            emitted = [sampler.sample(logits) if sampler else greedy(logits)]
        hit = next((n for n, i in enumerate(emitted) if i in stops), None)
        if hit is not None:                       # a sweep that ran past a stop id is cut there
            emitted = emitted[:hit + 1]
            res.stopped_at = emitted[-1]
        step = Step(g, emitted, time.monotonic() - t0, lm.experts.bytes_read - before,
                    logits if g == 0 else None)
        res.steps.append(step)
        res.layers_completed = model.layers_completed
        seq += emitted
        res.generated_ids += emitted
        yield step
        g += 1
        if hit is not None:
            break
    return res


def set_threads(n: int) -> None:
    K.set_num_threads(n)


# ---- one chat turn (SYSTEM §9.3-§9.4): the API the CLI's REPL and the app both use -----

@dataclass
class TurnResult:
    ids: list[int]                     # generated ids, the end id included when reached
    prompt_ids: int                    # rendered transcript length
    reused: int                        # positions served from the previous turn's state
    seconds: float
    first_token_seconds: float
    end_id: int | None                 # None: the generation limit came first, or a stop
    interrupted: bool = False
    reasoning: str | None = None
    content: str | None = None
    continued: int = 0                 # ids of an incomplete reply this turn resumed


# Recurrent-state snapshots kept for forks (an edited earlier message): at most this many
# bytes in all, newest first.  One snapshot is the KDA state (626 MB on the released model,
# so there an edit re-prefills; ~13 MB on `mid`, ~0.1 MB on the demo).
FORK_SNAPSHOT_BYTES = 64 << 20


@dataclass
class PendingReply:
    """A reply that stopped without its end id (Stop, or the limit): every id but the last
    is fed to the state, the last was sampled and not yet fed -- exactly where an
    uninterrupted turn would be before its next forward, so `continue_steps` resumes with
    the same ids."""
    ids: list[int]
    prompt_ids: int
    reused: int


@dataclass
class Carried:
    """What one sequence leaves for the next request on the same model (k3 serve keeps
    one): the state, the exact ids it was fed, and the chat's fork snapshots (empty for
    the batch loop)."""
    state: SequenceState | None = None
    record: list[int] = field(default_factory=list)
    forks: list = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return self.state is not None and not self.state.poisoned


class ChatSession:
    """A conversation on one loaded model.  Each turn renders the whole history (XTML),
    reuses the previous turn's state when the rendered ids extend what is cached (all or
    nothing), and generates until an end id, the limit or a stop request."""

    def __init__(self, lm: LoadedModel, tok, ctl, history, opts, sampler: Sampler,
                 incremental: bool = True):
        self.lm, self.tok, self.ctl = lm, tok, ctl
        self.history, self.opts, self.sampler = history, opts, sampler
        self.incremental = incremental
        self.turn0 = history.assistant_count()
        self.turns_done = 0
        self.state: SequenceState | None = None
        self.record: list[int] = []    # the exact ids fed so far (the prefix record)
        self.pending: PendingReply | None = None
        # (position, recurrent snapshot): the state after record[:position], taken where a
        # user message starts, so an edit of that message reuses everything before it
        self.forks: list[tuple[int, list[np.ndarray]]] = []

    def render(self) -> list[int]:
        from .chat import encode_prompt, render_segments
        return encode_prompt(self.tok, render_segments(self.history, self.opts))

    def reset(self) -> None:
        self.history.reset()
        self._drop_state()

    def _drop_state(self) -> None:
        self.state, self.record, self.pending, self.forks = None, [], None, []

    def carried(self) -> Carried:
        """This session's sequence, for a later session on the same model (adopt)."""
        return Carried(self.state, self.record, self.forks)

    def adopt(self, c: Carried) -> None:
        """Continue from another session's sequence: the next turn reuses what still
        matches its rendered prompt, like this session's own earlier turns."""
        self.state, self.record, self.forks = c.state, list(c.record), c.forks

    def _user_boundary(self, prompt: list[int]) -> int:
        """Where the last user message starts in `prompt` (the rendered history without it
        is a prefix of the full render: segments are encoded independently, §9.2)."""
        from .chat import History, encode_prompt, render_segments
        msgs = list(self.history)
        if not msgs or msgs[-1].role != "user":
            return 0
        try:
            head = encode_prompt(self.tok, render_segments(History(msgs[:-1]), self.opts,
                                                           generation_prompt=False))
        except Exception:              # noqa: BLE001 - no fork point, nothing else changes
            return 0
        return len(head) if prompt[:len(head)] == head else 0

    def _fork_for(self, prompt: list[int]) -> int:
        """Restore the newest snapshot whose positions `prompt` starts with (an edited or
        regenerated earlier turn): returns the positions it covers, 0 for none."""
        from .state import restore
        for pos, snap in reversed(self.forks):
            if 0 < pos < len(prompt) and pos <= len(self.record) \
                    and self.record[:pos] == prompt[:pos]:
                restore(self.state, snap)
                self.state.n_cached = pos      # later MLA rows are overwritten as it goes
                self.record = self.record[:pos]
                self.forks = [(p, s) for p, s in self.forks if p <= pos]
                return pos
        return 0

    def _keep_fork(self, pos: int) -> None:
        from .state import snapshot
        snap = snapshot(self.state)
        size = sum(a.nbytes for a in snap)
        self.forks = [(p, s) for p, s in self.forks if p < pos] + [(pos, snap)]
        while self.forks and sum(a.nbytes for _, s in self.forks for a in s) \
                > FORK_SNAPSHOT_BYTES:
            self.forks.pop(0)                  # the oldest go first
        if size > FORK_SNAPSHOT_BYTES:
            self.forks = []

    def _prefill(self, prompt: list[int], gen: int, cancel=None, on_layer=None
                 ) -> tuple[np.ndarray, int]:
        from .chat import reuse_positions
        from .state import grown
        model = self.lm.model
        if not self.incremental:
            self.state = model.new_state(len(prompt) + gen + 1)
            return model.forward(prompt, self.state, cancel=cancel, on_layer=on_layer), 0
        usable = self.state is not None and not self.state.poisoned
        cached = self.state.n_cached if usable else 0
        reuse = reuse_positions(self.record, prompt, cached=cached) if usable else 0
        if reuse == 0 and usable:
            reuse = self._fork_for(prompt)
        if reuse == 0:
            self.state, self.record = model.new_state(len(prompt) + gen + 1), []
            self.forks = []
        else:
            self.state = grown(self.state, len(prompt) + gen + 1)
        # Split the pass where the last user message starts and keep a snapshot there:
        # an edit of that message later forks from it.  Chunking a prefill does not change
        # a bit (DESIGN invariant), so the split costs only the copy.
        cut = self._user_boundary(prompt) - reuse
        parts = [prompt[reuse:reuse + cut], prompt[reuse + cut:]] if cut > 0 else \
            [prompt[reuse:]]
        try:
            for i, part in enumerate(parts):
                logits = model.forward(part, self.state, cancel=cancel, on_layer=on_layer)
                self.record += part
                if i == 0 and len(parts) == 2:
                    self._keep_fork(len(self.record))
        except BaseException:
            # a failed or stopped pass poisons the state: the next turn starts afresh
            self._drop_state()
            raise
        return logits, reuse

    def turn(self, gen: int, on_token: Callable[[int, int], None] | None = None,
             cancel: Cancel | None = None) -> TurnResult:
        """turn_steps with a callback per token; returns the TurnResult."""
        steps = self.turn_steps(gen, cancel)
        while True:
            try:
                kind, value = next(steps)
            except StopIteration as done:
                return done.value
            if kind == "token" and on_token:
                on_token(*value)

    def turn_steps(self, gen: int, cancel: Cancel | None = None, on_layer=None):
        """Generate the assistant's reply to the history (which ends with a user message),
        yielding ("prefill", prompt length) and then ("token", (n, id)) per id; returns
        the TurnResult.  A stop is honoured between the prompt pass's layers (no token is
        emitted, the state is dropped) and between tokens.  On a closed turn the parsed
        reply is appended to the history; otherwise the history is left as it was (the
        caller decides what to tell the person)."""
        t0 = time.monotonic()
        prompt = self.render()
        self.pending = None
        self.sampler.new_turn(self.turn0 + self.turns_done + 1)
        yield "prefill", len(prompt)
        try:
            logits, reuse = self._prefill(prompt, gen, cancel, on_layer)
        except Stopped:
            now = time.monotonic() - t0
            return TurnResult([], len(prompt), 0, now, now, None, True)
        return (yield from self._decode(prompt, [], logits, reuse, gen, cancel, t0,
                                        time.monotonic() - t0))

    def continue_steps(self, gen: int, cancel: Cancel | None = None):
        """Resume the incomplete reply (`pending`) for up to `gen` more ids, exactly as the
        uninterrupted turn would have gone on: its last id is fed now, and the sampler's
        stream was not restarted.  Yields like turn_steps; the TurnResult's ids are the whole
        reply.  Refused (ValueError) when there is nothing to continue."""
        p = self.pending
        if p is None or self.state is None or self.state.poisoned or not self.incremental:
            raise ValueError("there is no incomplete reply to continue")
        from .state import grown
        t0 = time.monotonic()
        yield "prefill", p.prompt_ids
        self.pending = None
        self.state = grown(self.state, p.prompt_ids + len(p.ids) + gen + 1)
        try:
            logits = self.lm.model.forward([p.ids[-1]], self.state)
        except BaseException:
            self._drop_state()
            raise
        self.record.append(p.ids[-1])
        return (yield from self._decode(None, list(p.ids), logits, p.reused,
                                        len(p.ids) + gen, cancel, t0,
                                        time.monotonic() - t0, p.prompt_ids))

    def _decode(self, prompt, out: list[int], logits, reuse: int, gen: int, cancel, t0: float,
                first: float, n_prompt: int | None = None):
        """Sample, yield, feed until an end id, `gen` ids in `out`, or a stop."""
        from .chat import Message, parse_reply
        model = self.lm.model
        base = len(out)
        end_ids = set(self.ctl.end_ids)
        interrupted = False
        try:
            while True:
                tok_id = self.sampler.sample(logits)
                out.append(tok_id)
                yield "token", (len(out), tok_id)
                if tok_id in end_ids or len(out) >= gen:
                    break
                if cancel:
                    interrupted = True
                    break
                if self.incremental:
                    logits = model.forward([tok_id], self.state)
                    self.record.append(tok_id)
                else:
                    self.state.reset()
                    logits = model.forward(prompt + out, self.state)
        except BaseException:
            self._drop_state()
            raise
        n_prompt = len(prompt) if n_prompt is None else n_prompt
        res = TurnResult(out, n_prompt, reuse, time.monotonic() - t0, first,
                         out[-1] if out and out[-1] in end_ids else None, interrupted,
                         continued=base)
        if res.end_id is not None:
            res.reasoning, res.content = parse_reply(self.tok, self.ctl, out, self.opts.thinking)
            self.history.add(Message("assistant", res.content, res.reasoning))
            self.turns_done += 1
        elif out and self.incremental:
            self.pending = PendingReply(list(out), n_prompt, reuse)
        return res
