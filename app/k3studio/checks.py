"""Live validation of the setup pickers, through the engine's own readers.

Each check calls the public function the engine would call at load time (read_config,
open_model, TrunkManifest via open_model, Tokenizer.from_dir + control_ids), so a
directory the pickers accept is one the engine accepts, and a refusal carries the
engine's message (which names the file).  Pure Python, no Qt: the setup panel runs
`inspect` on a background thread and only renders the result.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

OK, WARN, ERROR, EMPTY = "ok", "warn", "error", "empty"


@dataclass(frozen=True)
class Check:
    level: str          # OK, WARN, ERROR or EMPTY (nothing chosen)
    message: str

    @property
    def ok(self) -> bool:
        return self.level in (OK, WARN)


@dataclass
class Inspection:
    """Everything the setup and memory panels need to know about the chosen directories."""
    model: Check
    trunk: Check
    tok: Check
    summary: str = ""                 # one line: layers, experts, sizes
    figures: object | None = None     # memory.ModelFigures for the plan (streamed if trunk ok)
    trunk_bytes: int = 0              # what a packed trunk of this model occupies
    n_layers: int = 0
    n_experts: int = 0
    moe_layers: tuple[int, ...] = ()
    layer_kinds: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    download: object | None = None    # download.DownloadState of an unfinished download

    @property
    def runnable(self) -> bool:
        return self.model.ok and self.trunk.ok and self.tok.ok


def _describe(cfg, ck, figures) -> str:
    n_mla = len(cfg.mla_layers)
    from k3engine.memory import human
    return (f"{cfg.n_layers} layers ({n_mla} MLA + {cfg.n_layers - n_mla} KDA), hidden "
            f"{cfg.hidden}, vocab {cfg.vocab}, {cfg.n_experts} experts top-{cfg.topk}; "
            f"{len(ck)} tensors in {len(ck.shards)} shard(s); trunk "
            f"{human(sum(figures.layer_sizes))}, one expert {human(figures.expert_bytes)}")


def inspect(model_dir: str, trunk_dir: str = "", tok_dir: str = "") -> Inspection:
    """Validate the three directories in the order the engine meets them."""
    from k3engine.checkpoint import CheckpointError
    from k3engine.config import ConfigError
    from k3engine.loading import open_model, read_config

    none = Check(EMPTY, "")
    model_dir, trunk_dir, tok_dir = (os.path.expanduser(p.strip()) for p in
                                     (model_dir, trunk_dir, tok_dir))
    if not model_dir:
        return Inspection(Check(EMPTY, "Choose the checkpoint directory (config.json + "
                                       "*.safetensors)."), none, none)
    if not os.path.isdir(model_dir):
        return Inspection(Check(ERROR, f"{model_dir}: not a directory"), none, none)
    # An unfinished download of ours (its manifest and partial files): said as such, with
    # the way on, before the engine's reader refuses it as a missing shard.
    from k3engine.tools.download import download_state
    state = download_state(model_dir)
    if state is not None and not state.complete:
        return Inspection(Check(ERROR, f"{state.line()}; resume it in Download"), none, none,
                          download=state)
    try:
        cfg, _ = read_config(model_dir)
    except ConfigError as e:
        return Inspection(Check(ERROR, f"config.json: {e}"), none, none)
    try:
        setup = open_model(model_dir, cfg)      # shard census, partial-download check
    except CheckpointError as e:
        return Inspection(Check(ERROR, f"checkpoint: {e}"), none, none)
    except (OSError, ValueError) as e:
        return Inspection(Check(ERROR, f"checkpoint: {e}"), none, none)
    try:
        figures = setup.figures
        summary = _describe(cfg, setup.ck, figures)
        notes = list(setup.ck.notes)
        n_shards = len(setup.ck.shards)
    finally:
        setup.ck.close()
    model = Check(OK, f"config readable, shard census complete ({n_shards} shard"
                      f"{'s' if n_shards != 1 else ''}).")
    insp = Inspection(model, none, none, summary=summary, figures=figures,
                      trunk_bytes=sum(figures.layer_sizes), n_layers=cfg.n_layers,
                      n_experts=cfg.n_experts,
                      moe_layers=tuple(L for L in range(cfg.n_layers) if not cfg.is_dense(L)),
                      layer_kinds=tuple("MLA" if cfg.is_mla(L) else "KDA"
                                        for L in range(cfg.n_layers)),
                      notes=notes)

    # -- the packed trunk: belongs to this model (open_model cross-checks it) -------------
    if not trunk_dir:
        insp.trunk = Check(WARN, "No packed trunk: the trunk will be held in RAM (resident). "
                                 "Pack one to stream it within a memory budget.")
    else:
        try:
            st = open_model(model_dir, cfg, trunk_dir=trunk_dir)
        except CheckpointError as e:              # TrunkError, TrunkMismatchError included
            insp.trunk = Check(ERROR, f"trunk: {e}")
        except (OSError, ValueError) as e:
            insp.trunk = Check(ERROR, f"trunk: {e}")
        else:
            insp.figures = st.figures             # streamed sizes: the packed runs
            n = len(st.manifest.layers)
            st.ck.close()
            insp.trunk = Check(OK, f"packed trunk of this model ({n} layers).")

    # -- the tokenizer: files present, control tokens declared, ids inside the vocabulary --
    tdir = tok_dir or model_dir
    from k3engine.tokenizer import Tokenizer, TokenizerError, control_ids
    missing = [f for f in ("tiktoken.model", "tokenizer_config.json")
               if not os.path.isfile(os.path.join(tdir, f))]
    if missing:
        insp.tok = Check(ERROR, f"tokenizer: {os.path.join(tdir, missing[0])} is missing"
                         + (" (choose the directory with tiktoken.model and "
                            "tokenizer_config.json)"))
        return insp
    try:
        tok = Tokenizer.from_dir(tdir)
        control_ids(tok, None)
    except TokenizerError as e:
        insp.tok = Check(ERROR, f"tokenizer: {e}")
        return insp
    if tok.vocab_size > cfg.vocab:
        insp.tok = Check(ERROR, f"tokenizer: {tdir} has ids up to {tok.vocab_size - 1} but the "
                                f"model's vocabulary is {cfg.vocab}: not this model's tokenizer")
        return insp
    where = "in the model directory" if not tok_dir else "found"
    insp.tok = Check(OK, f"tokenizer files {where}: {tok.n_ranks} ranks + "
                         f"{len(tok.added)} added tokens, chat control tokens present.")
    return insp


# -- the doctor's recommendation (SYSTEM §10.1): keyed on MemAvailable --------------------

DOCTOR_STEPS = ((192, "server", "~6 s/token"), (96, "workstation", "~6-20 s/token"),
                (32, "desktop", "~24 s/token"), (10, "laptop", "~27 s/token"))


def recommend_preset(avail_bytes: int) -> tuple[str | None, str]:
    """(preset, why) for the real Kimi K3 from available memory, as `k3 doctor` decides."""
    from k3engine.memory import human
    # the floors are k3 doctor's, in GiB; the figure is shown like every other byte count
    # (human: decimal units), so "Available memory" and this line agree (24.04 GB was
    # also called "22 GB available" here)
    gib = avail_bytes / (1024 ** 3)
    have = human(avail_bytes)
    for floor, name, speed in DOCTOR_STEPS:
        if gib >= floor:
            return name, (f"{have} available (at least {floor} GiB): '{name}' for the full "
                          f"Kimi K3 checkpoint ({speed} on the reference hardware)")
    return None, (f"{have} available, under 10 GiB: below the floor for running the full "
                  f"checkpoint (~8.2 GB peak RSS). Small models such as the demo still run.")
