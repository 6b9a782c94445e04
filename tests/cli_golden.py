"""Golden runs of the real `k3` process: stdout, stderr, --out and --events of a fixed set
of runs, with what varies from machine to machine masked (times, RSS, rates, temporary
paths).  `python tests/cli_golden.py --write` records them (on purpose, with the reason in
the commit); test_cli_golden.py replays every run and compares byte for byte after masking,
so a refactor of the front ends cannot change what a script reading `k3` sees.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN_DIR = HERE / "golden" / "cli"
sys.path.insert(0, str(HERE))

PROMPT = "96,45,40,46,120,109,153,214,145,211,39,75"     # golden/tiny_seed1234.json

# name -> (model, args, stdin, env); {d} is the scratch directory, {m} the model,
# {t} its packed trunk.  Every output file goes into {d}.
RUNS = {
    "recompute": ("tiny", ["--ids", PROMPT, "--gen", "4"], None, {}),
    "incremental_events": ("tiny", ["--ids", PROMPT, "--gen", "6", "--incremental",
                                    "--stream-tokens", "--events", "{d}/ev.jsonl"], None, {}),
    "streamed_small_cache": ("tiny", ["--ids", PROMPT, "--gen", "4", "--incremental",
                                      "--trunk", "{t}", "--trunk-gb", "0.0012",
                                      "--cache-gb", "0.000062"], None, {}),
    "ultra": ("tiny", ["--ids", PROMPT, "--gen", "3", "--trunk", "{t}", "--preset", "ultra"],
              None, {}),
    "spec": ("tiny", ["--ids", PROMPT + "," + PROMPT, "--gen", "6", "--incremental",
                      "--spec", "4"], None, {}),
    "save_state": ("tiny", ["--ids", PROMPT, "--gen", "3", "--incremental",
                            "--save-state", "{d}/s.k3st"], None, {}),
    "stop_id": ("tiny", ["--ids", PROMPT, "--gen", "8", "--stop-id", "230"], None, {}),
    "text_prompt": ("demo", ["--prompt", "Hello there", "--tok", "{m}", "--gen", "3",
                             "--incremental"], None, {}),
    "expert_failure": ("tiny", ["--ids", PROMPT, "--gen", "3", "--incremental"], None,
                       {"K3_FAIL_EXPERT": "2,*"}),
    "plan_refused": ("tiny", ["--ids", PROMPT, "--gen", "3", "--preset", "ultra"], None, {}),
    "chat": ("demo", ["--chat", "--tok", "{m}", "--gen", "3", "--system", "Be brief.",
                      "--history", "{d}/h.jsonl"], "/help\nHello there\n", {}),
}
# Files a run writes, compared too (events masked like the text).
FILES = ("out.json", "ev.jsonl", "h.jsonl")

_MASKS = [
    (re.compile(r'"(t|seconds|wall_seconds|seconds_per_token|trunk_read_s|expert_read_s|'
                r'io_share|io_share_step|draft_seconds|rss_bytes|peak_rss_bytes|'
                r'index_seconds|bind_seconds|eta_s|elapsed_s|available|available_bytes)":\s?[-0-9.e]+'), r'"\1":#'),
    # the trunk's read-ahead races the compute: how many binds found the layer already
    # read is timing, not output
    (re.compile(r'"(trunk_hits|trunk_bytes|trunk_bytes_read)":\d+'), r'"\1":#'),
    (re.compile(r"hits \d+ \((\d+\.\d+)%\), reads \d+"), "hits # (#.#%), reads #"),
    (re.compile(r"\d+\.\d+"), "#.#"),
    (re.compile(r"\(\d+ s\)"), "(# s)"),
    (re.compile(r"\b\d+ (B|KB|MB|GB|KiB|MiB|GiB|MB/s)\b"), r"# \1"),
]


def mask(text: str, scratch: Path, root: str) -> str:
    text = text.replace(str(scratch), "{s}").replace(root, "{d}")
    for pat, rep in _MASKS:
        text = pat.sub(rep, text)
    return text


def models(root: Path) -> dict[str, str]:
    """The tiny golden model with its packed trunk, and the random demo model."""
    from engine_helpers import GOLDEN_SEED, make_tiny
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    from k3engine.trunk import pack_trunk
    tiny = make_tiny(root / "tiny", GOLDEN_SEED)
    pack_trunk(tiny, str(root / "trunk"))
    make_checkpoint(str(root / "demo"), dims_config("demo"), seed=9)
    return {"tiny": tiny, "demo": str(root / "demo"), "trunk": str(root / "trunk")}


def run_one(name: str, paths: dict[str, str], scratch: Path) -> dict[str, str]:
    """Run one golden case in `scratch` (cwd, so --out lands there); the masked outputs."""
    model, args, stdin, env = RUNS[name]
    fill = {"d": str(scratch), "m": paths[model], "t": paths["trunk"]}
    argv = [a.format(**fill) for a in args]
    if not any(a == "--chat" for a in argv):
        argv += ["--out", str(scratch / "out.json")]
    p = subprocess.run([sys.executable, "-m", "k3engine", paths[model], *argv],
                       input=stdin or "", capture_output=True, text=True, timeout=300,
                       cwd=scratch, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    root = str(Path(paths["tiny"]).parent)
    got = {"exit": str(p.returncode), "stdout": mask(p.stdout, scratch, root),
           "stderr": mask(p.stderr, scratch, root)}
    for f in FILES:
        if (scratch / f).exists():
            got[f] = mask((scratch / f).read_text(), scratch, root)
    return got


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def main() -> int:
    if "--write" not in sys.argv:
        print("usage: python tests/cli_golden.py --write   (records every golden run)")
        return 2
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = models(root)
        for name in RUNS:
            scratch = root / name
            scratch.mkdir()
            got = run_one(name, paths, scratch)
            golden_path(name).write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
            print(f"{name}: exit {got['exit']}, {len(got['stdout'].splitlines())} stdout lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
