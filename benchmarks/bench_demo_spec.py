"""Speed levers on the trained demo model (docs/benchmarks-engine.md): n-gram `--spec N` and
the 8-bit draft trunk (`--draft-trunk`), on a budget that streams the trunk, ids compared
with plain greedy in every run.

    python benchmarks/bench_demo_spec.py [--model DIR] [--gen 48] [--runs 3] [--json PATH]

The prompts are held-out chat prompts (rendered XTML, thinking on) whose greedy replies are
the model's own; s/token is the median over runs of the report's seconds_per_token.
Measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from k3engine.chat import ChatOptions, History, Message, encode_prompt, render_segments
from k3engine.tokenizer import Tokenizer
from k3engine.tools.demo import ready_dir
from k3engine.tools.demo_corpus import make_corpus


def run(model, ids_file, gen, args, out):
    cmd = [sys.executable, "-m", "k3engine", model, "--ids-file", ids_file, "--gen", str(gen),
           "--incremental", "--out", out, *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {p.returncode}\n{p.stderr[-2000:]}")
    j = json.loads(open(out, "rb").read().decode("utf-8", "replace"))
    return dict(ids=j["generated_ids"], spt=j["seconds_per_token"],
                accepted=j.get("spec_accepted"), drafted=j.get("spec_drafted"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    model = a.model or ready_dir()
    trunk = os.path.join(model, "trunk")
    tok = Tokenizer.from_dir(model)
    trunk_bytes = os.path.getsize(os.path.join(trunk, "trunk.bin"))
    stream_gb = f"{trunk_bytes * 0.4 / 1e9:.6f}"            # 40 % of the trunk pinned: it streams
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        draft = os.path.join(tmp, "draft")
        subprocess.run([sys.executable, "-m", "k3engine", "pack-trunk", model, draft,
                        "--draft-bits", "8"], check=True, capture_output=True)
        base = ["--trunk", trunk, "--trunk-gb", stream_gb, "--cache-gb", "0.0002"]
        settings = [("plain greedy", []), ("--spec 2", ["--spec", "2"]),
                    ("--spec 4", ["--spec", "4"]), ("--spec 8", ["--spec", "8"]),
                    ("8-bit draft trunk (--spec 4)", ["--draft-trunk", draft,
                                                      "--draft-trunk-gb", stream_gb])]
        convs = make_corpus(0).test[:a.prompts]
        for k, conv in enumerate(convs):
            h = History([Message("user", conv.turns[0].user)])
            ids = encode_prompt(tok, render_segments(h, ChatOptions(thinking=True)))
            ids_file = os.path.join(tmp, f"p{k}.txt")
            with open(ids_file, "w") as f:
                f.write(",".join(map(str, ids)))
            ref = None
            for name, args in settings:
                runs = [run(model, ids_file, a.gen, base + args, os.path.join(tmp, "o.json"))
                        for _ in range(a.runs)]
                got = {tuple(r["ids"]) for r in runs}
                if ref is None:
                    ref = runs[0]["ids"]
                row = dict(prompt=conv.turns[0].user, setting=name,
                           s_per_token=statistics.median(r["spt"] for r in runs),
                           accepted=runs[0]["accepted"], drafted=runs[0]["drafted"],
                           ids_equal_plain=got == {tuple(ref)}, n_ids=len(ref))
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"trunk {trunk_bytes / 1e6:.2f} MB, pinned budget {float(stream_gb) * 1e3:.2f} MB; "
          f"ids equal to plain greedy in every run: {all(r['ids_equal_plain'] for r in rows)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(trunk_bytes=trunk_bytes, trunk_gb=stream_gb, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
