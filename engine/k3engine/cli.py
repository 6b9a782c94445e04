"""`k3`: the command line, flag- and exit-code-compatible with the reference (SYSTEM §6).

`k3 <model_dir> [options]` runs the model; a first argument that names a subcommand
(`make-checkpoint`, ...) selects that tool instead (a model directory with such a name is
given as ./name).  Exit codes: 0 success, 1 runtime failure (damaged checkpoint, bind or
forward failure), 2 usage or configuration error, 3 --out could not be written.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from . import REFERENCE_VERSION, __version__
from .checkpoint import CheckpointError
from .config import ConfigError, ModelConfig
from .session import (MAX_GEN, MAX_POSITIONS, MAX_PROMPT, RunResult, Step, default_threads,
                      generate, load_model, peak_rss_bytes, read_config, set_threads)

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_OUT = 0, 1, 2, 3

SUBCOMMANDS = {
    "make-checkpoint": "k3engine.tools.make_checkpoint",
}

USAGE = """\
usage: k3 <model_dir> --ids 1,2,3 [--gen N] [--incremental] [--layers N] [--threads N]
          [--out FILE] [--dump-logits PATH] [--config PATH]
       k3 make-checkpoint OUT_DIR [--dims tiny|mid] [--seed N]
       k3 --help | --version
"""

HELP = USAGE + """
Runs Kimi K3 on one CPU from a checkpoint directory in the released layout and prints
the generated ids with the reference engine's report.

prompt
  --ids LIST          prompt token ids, comma or space separated (required)
  --ids-file PATH     prompt token ids read from a file (comma/space/newline separated)
generation
  --gen N             tokens to generate, 0..4096 (default 8)
  --incremental       carry KV cache and recurrent state between steps (same ids, faster);
                      without it every step recomputes the whole sequence
  --layers N          bind only the first N layers (partial stack; NOT the full model)
  --threads N         compute threads (default: OMP_NUM_THREADS, else physical cores)
  --config PATH       config file (default <model_dir>/config.json)
diagnostics
  --out FILE          one-line JSON result (default k3_run.json)
  --dump-logits PATH  first step's logits as raw little-endian float32

subcommands (each has --help)
  make-checkpoint     write a deterministic random-weight checkpoint (tiny, mid)

exit codes
  0  success
  1  runtime failure: damaged or partial checkpoint, a tensor that does not bind,
     forward pass failure
  2  usage or configuration error: bad or conflicting options, untrusted config.json,
     --layers or a token id out of range, prompt or generation limits
  3  the run completed but --out could not be written (results were printed)
"""


class UsageError(Exception):
    pass


# flag -> (attribute, takes a value)
FLAGS = {
    "--ids": ("ids", True), "--ids-file": ("ids_file", True), "--gen": ("gen", True),
    "--incremental": ("incremental", False), "--layers": ("layers", True),
    "--threads": ("threads", True), "--out": ("out", True),
    "--dump-logits": ("dump_logits", True), "--config": ("config", True),
}


@dataclass
class Options:
    model_dir: str = ""
    ids: str | None = None
    ids_file: str | None = None
    gen: str = "8"
    incremental: bool = False
    layers: str | None = None
    threads: str | None = None
    out: str = "k3_run.json"
    dump_logits: str | None = None
    config: str | None = None
    prompt_ids: list[int] = field(default_factory=list)


def strict_int(flag: str, text: str, lo: int, hi: int | None = None) -> int:
    t = text.strip()
    if not (t.isdigit() or (t[:1] == "-" and t[1:].isdigit())):
        raise UsageError(f"bad {flag} value '{text}': expected a whole number")
    v = int(t)
    if v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise UsageError(f"{flag} {v} is out of range ({rng})")
    return v


def parse_ids(text: str, what: str) -> list[int]:
    pieces = text.replace(",", " ").split()
    if not pieces:
        raise UsageError(f"bad {what}: no ids")
    out = []
    for p in pieces:
        if not p.isdigit():
            raise UsageError(f"bad {what}: '{p}' is not a non-negative whole number")
        out.append(int(p))
    return out


def parse_args(argv: list[str]) -> Options:
    if not argv:
        raise UsageError("")
    if argv[0].startswith("-"):
        raise UsageError(f"the first argument must be the model directory, got '{argv[0]}'")
    o = Options(model_dir=argv[0])
    i = 1
    while i < len(argv):
        a = argv[i]
        spec = FLAGS.get(a)
        if spec is None or (spec[1] and i + 1 >= len(argv)):
            raise UsageError(f"unknown option {a}")
        attr, takes = spec
        if takes:
            setattr(o, attr, argv[i + 1])
            i += 2
        else:
            setattr(o, attr, True)
            i += 1
    if o.ids is not None and o.ids_file is not None:
        raise UsageError("--ids and --ids-file are mutually exclusive")
    if o.ids is None and o.ids_file is None:
        raise UsageError("one of --ids or --ids-file is required")
    if o.ids is not None:
        o.prompt_ids = parse_ids(o.ids, "--ids")
    else:
        try:
            with open(o.ids_file) as f:
                o.prompt_ids = parse_ids(f.read(), f"--ids-file {o.ids_file}")
        except OSError as e:
            raise UsageError(f"cannot read --ids-file {o.ids_file}: {e.strerror}") from None
    if len(o.prompt_ids) > MAX_PROMPT:
        raise UsageError(f"prompt has {len(o.prompt_ids)} ids; the limit is {MAX_PROMPT} "
                         f"(refused, never truncated)")
    gen = strict_int("--gen", o.gen, 0, MAX_GEN)
    if len(o.prompt_ids) + gen + 1 > MAX_POSITIONS:
        raise UsageError(f"prompt {len(o.prompt_ids)} + gen {gen} + 1 exceeds the "
                         f"{MAX_POSITIONS}-position ceiling")
    if o.threads is not None:
        strict_int("--threads", o.threads, 1)
    return o


def human(b: float) -> str:
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.2f} B"


def config_line(cfg: ModelConfig, path: str) -> str:
    n_mla = len(cfg.mla_layers)
    return (f"config: {os.path.basename(path)} ({cfg.shape} shape) | hidden={cfg.hidden} "
            f"layers={cfg.n_layers} vocab={cfg.vocab} | {n_mla} MLA + {cfg.n_layers - n_mla} KDA"
            f" | experts {cfg.n_experts} top{cfg.topk} shared{cfg.n_shared} | latent={cfg.latent}")


def out_json(o: Options, res: RunResult, n_layers: int, peak: int) -> str:
    """The §6.7 line: keys in the reference's order, no spaces, its number formats."""
    spt = res.wall_seconds / len(res.generated_ids) if res.generated_ids else 0.0
    ids = lambda v: "[" + ",".join(str(i) for i in v) + "]"  # noqa: E731
    parts = [
        f'"prompt_ids":{ids(res.prompt_ids)}', f'"generated_ids":{ids(res.generated_ids)}',
        f'"full_ids":{ids(res.prompt_ids + res.generated_ids)}',
        f'"layers":{n_layers}', f'"layers_requested":{n_layers}',
        f'"layers_completed":{res.layers_completed}', '"expert_drops":0',
        f'"peak_rss_bytes":{peak:.0f}', f'"wall_seconds":{res.wall_seconds:.4f}',
        f'"seconds_per_token":{spt:.4f}', f'"expert_bytes_read":{res.expert_bytes}',
        '"trunk_bytes_read":0', '"embedding_bytes_read":0', '"lm_head_bytes_read":0',
        '"ultra_low_memory":false', '"stopped_at":-1', '"interrupted":false',
        '"generated_text":null',
    ]
    return "{" + ",".join(parts) + "}\n"


def write_atomic(path: str, data: bytes) -> None:
    """Temp file + rename: a crash never leaves half a file under the final name."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def kv_bytes_per_position(cfg: ModelConfig, n_layers: int) -> int:
    n_mla = sum(cfg.is_mla(L) for L in range(n_layers))
    return n_mla * 4 * (cfg.n_heads * (cfg.qk_nope + cfg.v_head) + cfg.qk_rope)


def run(o: Options) -> int:
    threads = int(o.threads) if o.threads is not None else default_threads()
    set_threads(threads)
    print(f"threads: {threads}")
    cfg, cfg_path = read_config(o.model_dir, o.config)
    print(config_line(cfg, cfg_path))
    nl = cfg.n_layers if o.layers is None else strict_int("--layers", o.layers, 1, cfg.n_layers)
    if nl < cfg.n_layers:
        print(f"NOTE: binding only the first {nl} of {cfg.n_layers} layers. Output is NOT the "
              f"full model; use it to test the machinery, not the answers.")
    for i in o.prompt_ids:
        if i >= cfg.vocab:
            raise UsageError(f"token id {i} is outside the vocabulary of {cfg.vocab}")
    gen = int(o.gen)
    print("K3 Studio engine (Python + Cython), released checkpoint layout")
    print(f"  model    : {o.model_dir}")
    print(f"  prompt   : {len(o.prompt_ids)} tokens, generating {gen}")
    print()

    lm = load_model(o.model_dir, cfg, nl)
    print(f"indexed {len(lm.ck)} tensors from {len(lm.ck.shards)} shards in {lm.index_seconds:.2f} s")
    for note in lm.ck.notes:
        print(f"note: {note}")
    print(f"resident trunk: {human(lm.trunk_bytes)} in RAM (large matrices kept in the "
          f"checkpoint's bf16, widened inside the matvec)")
    print(f"embedding, final norm and lm_head: {human(lm.table_bytes)} in {lm.bind_seconds:.1f} s")
    print(f"peak RSS after loading weights: {human(peak_rss_bytes())}  "
          f"(measured by the OS)")
    print("routed experts: read from the checkpoint on first use and kept resident")
    print(f"recurrent state for {nl} layers: {human(lm.model.new_state(0).nbytes())}")
    if o.incremental:
        positions = len(o.prompt_ids) + gen + 1
        n_mla = sum(cfg.is_mla(L) for L in range(nl))
        print(f"incremental decode: KV cache {human(kv_bytes_per_position(cfg, nl) * positions)}"
              f" for {n_mla} MLA layers at {positions} positions")
    print()
    print(f"{'STEP':<6} {'TOKEN':<10} {'SECONDS':<12} {'CACHE HIT':<10} {'READ GB':<10} TOK/S")
    print("-" * 68)

    def on_step(s: Step) -> None:
        tok = s.ids[-1] if s.ids else -1
        print(f"{s.step:<6d} {tok:<10d} {s.seconds:<12.2f} {0.0:<10.1f} "
              f"{s.expert_bytes / 1e9:<10.2f} {1 / s.seconds if s.seconds > 0 else 0:.3f}",
              flush=True)
        if s.logits is not None and o.dump_logits:
            write_atomic(o.dump_logits, s.logits.astype("<f4").tobytes())
            print(f"wrote {o.dump_logits} ({s.logits.shape[0]} float32 logits)")

    res = generate(lm, o.prompt_ids, gen, o.incremental, on_step)
    print("-" * 68)
    n = len(res.generated_ids)
    if n:
        print(f"{n} tokens in {res.wall_seconds:.1f} s, {res.wall_seconds / n:.2f} s/token average")
    else:
        print(f"prefill only: {len(o.prompt_ids)} positions cached, "
              f"0 tokens generated")
    print(f"generated ids: {','.join(str(i) for i in res.generated_ids)}")
    print()
    peak = peak_rss_bytes()
    print(f"PEAK RSS for the whole run: {human(peak)}   <- quote this, not the plan")
    print(f"layers completed: {res.layers_completed}/{nl}; routed expert drops: 0")
    try:
        write_atomic(o.out, out_json(o, res, nl, peak).encode())
        print(f"wrote {o.out}")
    except OSError as e:
        print(f"cannot write {o.out}: {e.strerror}", file=sys.stderr)
        return EXIT_OUT
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("--help", "-h") for a in argv) and not (argv and argv[0] in SUBCOMMANDS):
        print(HELP, end="")
        return EXIT_OK
    if "--version" in argv and not (argv and argv[0] in SUBCOMMANDS):
        print(f"k3 {__version__} (Kimi K3 engine, reference-compatible with kimi-k3-in-c "
              f"{REFERENCE_VERSION})")
        return EXIT_OK
    if argv and argv[0] in SUBCOMMANDS:
        import importlib
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    try:
        o = parse_args(argv)
        return run(o)
    except UsageError as e:
        msg = str(e)
        if msg:
            print(f"k3: {msg}", file=sys.stderr)
        if not msg or msg.startswith("unknown option"):
            print(USAGE, end="", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as e:
        print(f"k3: {e}\nABORTED: the model config could not be read with confidence.",
              file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as e:
        print(f"k3: {e}", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
