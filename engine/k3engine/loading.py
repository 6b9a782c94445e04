"""Opening and loading a model: the shard index, the packed trunk's manifest and the
sizes the planner needs (open_model), then the bound weights, the streamed or resident
trunk and the expert cache (load_model), and hybrid decode's draft model (load_draft)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Callable

from .bind import Binder, CheckpointExperts, ResidentWeights, deep_nbytes
from .checkpoint import Checkpoint
from .config import ConfigError, ModelConfig, load_config
from .draft import DraftModel, DraftRouter, ResidentOnly
from .errors import UsageError
from .experts import ExpertCache, ResidentExperts
from .memory import ModelFigures, Plan, moe_chunk_for
from .model import PREFILL_CHUNK, Model
from .names import expert_tensors, layer_tensors, model_tensors
from .trunk import IO_THREADS, StreamedTrunk, TrunkManifest
from .trunk_compress import planned_scratch
from .ultra import StreamedTables


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
               cache_policy: str | None = None, lookahead: bool = False) -> LoadedModel:
    """Bind the model tables and the trunk (resident, or streamed when the setup has a
    packed trunk and `plan` chose its pinned set and ring).  Routed experts come from a
    bounded cache of `cache_bytes`, or are read once and kept when it is None.  `ultra`
    streams the embedding and lm_head too (needs a packed trunk).  `cache_policy` names
    the cache's replacement policy (experts.make_policy); `lookahead` starts a layer's
    expert reads from a guess of its router before its attention (lookahead.py; needs the
    cache, changes no id and no decision of the cache)."""
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
    if lookahead:
        from .lookahead import attach
        attach(model, experts, cfg)
    return LoadedModel(cfg, ck, model, experts,
                       setup.index_seconds, time.monotonic() - t0, trunk_bytes,
                       table_bytes, trunk, ultra)
