"""`k3 MODEL --batch FILE`: several prompts decoded together, one pass over the trunk per
step for all of them (generate.decode_many), each with the ids it would get alone.

FILE is JSON lines, one object a line: `{"ids": [...]}` or `{"prompt": "..."}` (text, with
--tok; added tokens recognised, as --prompt), optionally "gen", "seed", "temperature",
"top_p", "top_k", "min_p" (the run's flags are the defaults).  --out holds `sequences`, in
input order, each with a single run's --out fields that belong to one sequence, beside the
aggregate figures; the report gives both.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

from .engine import MAX_GEN, MAX_PROMPT, Cancel, GenSpec, Sampling, open_engine
from .errors import EXIT_DROP, EXIT_INTERRUPTED, EXIT_OK, EXIT_OUT, UsageError
from .generate import Run, Turn, decode_many
from .inputfile import InputFileError, read_regular_file
from .memory import human

FILE_LIMIT = 64 << 20
MAX_SEQUENCES = 64
SAMPLING_KEYS = {"seed": int, "temperature": float, "top_p": float, "top_k": int,
                 "min_p": float}


def read_batch(path: str, tok, base: GenSpec) -> list[tuple[list[int], GenSpec]]:
    """The prompts of FILE with each one's GenSpec; refusals name FILE:LINE (exit 2)."""
    try:
        data = read_regular_file(path, FILE_LIMIT, "--batch")
    except InputFileError as e:
        raise UsageError(f"cannot read --batch {e}") from None
    out = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise UsageError(f"{where}: not a JSON object ({type(e).__name__})") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: not a JSON object")
        unknown = set(obj) - {"ids", "prompt", "gen"} - set(SAMPLING_KEYS)
        if unknown:
            raise UsageError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        if ("ids" in obj) == ("prompt" in obj):
            raise UsageError(f"{where}: exactly one of \"ids\" and \"prompt\"")
        if "ids" in obj:
            ids = obj["ids"]
            if not isinstance(ids, list) or not ids or not all(
                    type(i) is int and i >= 0 for i in ids):
                raise UsageError(f"{where}: \"ids\" must be a non-empty list of token ids")
        else:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise UsageError(f"{where}: \"prompt\" must be a non-empty string")
            if tok is None:
                raise UsageError(f"{where}: a text prompt needs --tok DIR")
            ids = list(tok.encode(obj["prompt"], True))
        if len(ids) > MAX_PROMPT:
            raise UsageError(f"{where}: {len(ids)} prompt ids; the limit is {MAX_PROMPT}")
        gen = obj.get("gen", base.gen)
        if type(gen) is not int or not 0 <= gen <= MAX_GEN:
            raise UsageError(f"{where}: \"gen\" must be a whole number in 0..{MAX_GEN}")
        sampling = _sampling(obj, base.sampling, where)
        out.append((ids, replace(base, gen=gen, sampling=sampling)))
        if len(out) > MAX_SEQUENCES:
            raise UsageError(f"{path}: more than {MAX_SEQUENCES} sequences")
    if not out:
        raise UsageError(f"{path}: no prompts")
    return out


def _sampling(obj: dict, base: Sampling, where: str) -> Sampling:
    given = {k: obj[k] for k in SAMPLING_KEYS if k in obj}
    for k, v in given.items():
        ok = type(v) is int if SAMPLING_KEYS[k] is int else \
            type(v) in (int, float) and math.isfinite(v)
        if not ok:
            raise UsageError(f"{where}: \"{k}\" must be a {SAMPLING_KEYS[k].__name__}")
    s = replace(base, **given)
    try:
        s.sampler()                                   # the sampler's own range checks
    except Exception as e:  # noqa: BLE001 - SamplerError: a bad value, named
        raise UsageError(f"{where}: {e}") from None
    return s


def run_batch(o, load, base: GenSpec, printer, events, write_output, interrupts) -> int:
    """The batch run: read FILE, plan for all its positions, decode them together, print
    each sequence and the aggregate figures, write --out.  `interrupts(cancel)`: the CLI's
    Ctrl-C handling around the decode."""
    from .report import RULE
    tok = None
    if o.tok:
        from .tokenizer import Tokenizer
        tok = Tokenizer.from_dir(o.tok)              # failures exit 1 (SYSTEM §6.5)
    items = read_batch(o.batch, tok, base)
    positions = sum(len(ids) + spec.gen + 1 for ids, spec in items)
    eng = open_engine(replace(load, sequences=len(items)), printer, tok=tok,
                      gen=positions - 1)                  # their states and KV caches
    cancel = Cancel()
    unwritten: list[str] = []
    try:
        runs = []
        for ids, spec in items:
            eng.check_limits(len(ids), spec.gen, ids)
            seq = eng.sequence()
            seq.extend(ids, spec.gen + 1)
            sampler = spec.sampling.sampler()
            sampler.new_turn(1)
            runs.append(Run(seq, spec, sampler, end_ids=()))
        print(f"batch: {len(runs)} sequences, {positions} positions planned; one pass over "
              f"the trunk per step for all of them")
        with interrupts(cancel):
            turn = Turn(decode_many(eng, runs, cancel))
            for ev in turn:
                if type(ev).__name__ == "StepDone":
                    printer(ev)
        agg = turn.summary
        print(RULE)
        seqs = []
        for b, (r, (ids, spec)) in enumerate(zip(runs, items)):
            res = r.summary
            text = tok.decode(res.ids) if tok is not None and res.ids else None
            print(f"sequence {b}: {len(ids)} prompt ids, {len(res.ids)} generated "
                  f"(first after {res.first_token_seconds:.2f} s, then "
                  f"{res.decode_tokens_per_s:.2f} tokens/s): {','.join(map(str, res.ids))}")
            seqs.append(dict(prompt_ids=ids, generated_ids=res.ids, full_ids=ids + res.ids,
                             stopped_at=res.end_id if res.end_id is not None else -1,
                             interrupted=res.interrupted, expert_drop=res.expert_drop,
                             wall_seconds=round(res.seconds, 4),
                             first_token_seconds=round(res.first_token_seconds, 4),
                             decode_tokens_per_second=round(res.decode_tokens_per_s, 4),
                             generated_text=None if text is None else
                             text.decode("utf-8", errors="replace")))
        per_tok = agg.bytes_read / agg.tokens if agg.tokens else 0
        print(f"{agg.tokens} tokens in {agg.seconds:.2f} s over {agg.steps} steps: "
              f"{agg.tokens_per_s:.2f} tokens/s in all; batch size per step "
              f"{min(agg.sizes, default=0)}-{max(agg.sizes, default=0)}; read "
              f"{human(agg.bytes_read)} ({human(per_tok)} per generated token)")
        print(f"PEAK RSS for the whole run: {human(agg.peak_rss_bytes)}")
        out = dict(sequences=seqs, sequences_count=len(seqs), generated_tokens=agg.tokens,
                   wall_seconds=round(agg.seconds, 4), steps=agg.steps,
                   tokens_per_second=round(agg.tokens_per_s, 4),
                   batch_size_max=max(agg.sizes, default=0), batch_sizes=agg.sizes,
                   bytes_read=agg.bytes_read, bytes_read_per_token=per_tok,
                   trunk_bytes_read=agg.trunk_bytes, expert_bytes_read=agg.expert_bytes,
                   peak_rss_bytes=agg.peak_rss_bytes)
        if write_output(o.out, (json.dumps(out) + "\n").encode(), unwritten):
            print(f"wrote {o.out}")
        events.emit("summary", **{k: v for k, v in out.items() if k != "sequences"})
    finally:
        eng.close()
    if any(r.summary.expert_drop for r in runs):
        print("RUN INVALID: a routed expert failed to load; the affected tokens were not "
              "emitted", file=sys.stderr)
        return EXIT_DROP
    if unwritten:
        return EXIT_OUT
    return EXIT_INTERRUPTED if cancel else EXIT_OK
