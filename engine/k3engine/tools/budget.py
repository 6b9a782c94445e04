"""`k3 budget [MODEL_DIR]` (or K3_MODEL_DIR): classify every tensor of a checkpoint from
its shard headers alone and print where the bytes are (SYSTEM §10.4).

Only headers are read, so it runs in seconds on the 1.56 TB checkpoint and works on a
partial download (the totals then cover the shards present).  The trap it exists for: the
shared experts look like experts but are dense and run on every token, so they belong to
the resident class, not the streamable one.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field

from ..checkpoint import SUFFIX, CheckpointError, parse_header
from ..memory import human
from ..names import PREFIX

MXFP4_BYTES_PER_PARAM = 0.53125     # 4-bit nibble + one E8M0 byte per 32 values
FIT_GB = (32, 64, 96, 128, 192, 256)
STREAMABLE, RESIDENT, UNUSED = "streamable", "resident", "unused"
LAYERS = PREFIX + "layers."
ROUTED = ".block_sparse_moe.experts."

# (key, label, residency); classify() returns the first key whose rule matches (§10.4).
CLASSES = (
    ("routed", "routed experts", STREAMABLE),
    ("shared", "shared experts (dense)", RESIDENT),
    ("latent", "MoE latent up/down/norm", RESIDENT),
    ("router", "router", RESIDENT),
    ("attention", "attention", RESIDENT),
    ("attnres", "attn-res aggregators", RESIDENT),
    ("norms", "layer norms", RESIDENT),
    ("embedding", "embedding + lm_head", RESIDENT),
    ("text_other", "other text tower", RESIDENT),
    ("unused", "vision/other (unused)", UNUSED),
)
RESIDENCY = {k: r for k, _, r in CLASSES}


def classify(name: str) -> str:
    if ROUTED in name:
        return "routed"
    if ".block_sparse_moe.shared_experts." in name:
        return "shared"
    if ".block_sparse_moe.routed_expert_" in name:
        return "latent"
    if ".block_sparse_moe.gate" in name:
        return "router"
    if ".self_attn." in name:
        return "attention"
    if "_res_norm" in name or "_res_proj" in name:
        return "attnres"
    if "layernorm" in name or name.endswith(".norm.weight"):
        return "norms"
    if "embed_tokens" in name or "lm_head" in name:
        return "embedding"
    if name.startswith("language_model."):
        return "text_other"
    return "unused"


def _layer(name: str) -> int | None:
    if not name.startswith(LAYERS):
        return None
    num = name[len(LAYERS):].split(".", 1)[0]
    return int(num) if num.isdigit() else None


def _expert_key(name: str) -> tuple[int, int] | None:
    L = _layer(name)
    rest = name.split(ROUTED, 1)[1].split(".", 1)[0] if ROUTED in name else ""
    return (L, int(rest)) if L is not None and rest.isdigit() else None


@dataclass
class Census:
    model_dir: str
    shards: list[str] = field(default_factory=list)             # read
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    notes: list[str] = field(default_factory=list)
    file_bytes: int = 0                                           # shards read, on disk
    classes: dict[str, list[int]] = field(
        default_factory=lambda: {k: [0, 0] for k, _, _ in CLASSES})  # key -> [count, bytes]
    dtypes: dict[str, list[int]] = field(default_factory=dict)
    routed_params: int = 0
    expert_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    kda_layers: set[int] = field(default_factory=set)
    mla_layers: set[int] = field(default_factory=set)
    layers: set[int] = field(default_factory=set)
    routed_layers: set[int] = field(default_factory=set)
    model_table_bytes: int = 0       # resident tensors outside the layers (embed, lm_head, norms)

    @property
    def count(self) -> int:
        return sum(c for c, _ in self.classes.values())

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.classes.values())

    def residency_bytes(self, residency: str) -> int:
        return sum(b for k, (_, b) in self.classes.items() if RESIDENCY[k] == residency)

    def shared_note(self) -> str:
        n, b = self.classes["shared"]
        if not n:
            return ""
        return (f"shared experts: {human(b)} in {n} tensors are dense and run on every "
                f"token: resident, never streamed")

    def add(self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
        key = classify(name)
        self.classes[key][0] += 1
        self.classes[key][1] += nbytes
        d = self.dtypes.setdefault(dtype, [0, 0])
        d[0] += 1
        d[1] += nbytes
        L = _layer(name)
        if L is not None:
            self.layers.add(L)
            if name.endswith(".self_attn.A_log"):
                self.kda_layers.add(L)
            elif ".self_attn.kv_a" in name or ".self_attn.kv_b" in name:
                self.mla_layers.add(L)
        elif RESIDENCY[key] == RESIDENT:
            self.model_table_bytes += nbytes
        if key == "routed":
            if name.endswith(".weight_packed"):
                self.routed_params += 2 * math.prod(shape)   # two 4-bit values per byte
            ek = _expert_key(name)
            if ek is not None:
                self.expert_bytes[ek] = self.expert_bytes.get(ek, 0) + nbytes
                self.routed_layers.add(ek[0])


def shard_paths(model_dir: str) -> list[str]:
    names = sorted((n for n in os.listdir(model_dir) if n.endswith(SUFFIX)), key=os.fsencode)
    return [os.path.join(model_dir, n) for n in names]


def census(model_dir: str) -> Census:
    """Every header of every shard present, each validated by the checkpoint reader's
    parser (§1.4); a shard whose header is refused is skipped and reported, not fatal."""
    c = Census(model_dir)
    seen: dict[str, str] = {}
    for path in shard_paths(model_dir):
        try:
            entries, notes = parse_header(path)
        except CheckpointError as e:
            c.skipped.append((path, str(e)))
            continue
        c.shards.append(path)
        c.notes += notes
        c.file_bytes += os.path.getsize(path)
        for e in entries:
            if e.name in seen:
                # Counting it twice would overstate every total; the engine refuses this.
                c.notes.append(f"duplicate tensor name {e.name} in {seen[e.name]} and {path} "
                               f"(counted once; the engine refuses this checkpoint)")
                continue
            seen[e.name] = path
            c.add(e.name, e.dtype, e.shape, e.nbytes)
    return c


def _ranges(xs) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    xs = sorted(xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out) if out else "none"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:5.1f} %" if whole else "    - "


def report_lines(c: Census) -> list[str]:
    total = c.total_bytes
    out = [f"k3 budget: {c.model_dir}",
           f"  {len(c.shards)} shard(s) read (headers only), {c.count:,} tensors, "
           f"{total:,} tensor bytes ({human(total)}); shard files {human(c.file_bytes)}"]
    for path, why in c.skipped:
        out.append(f"  WARN  skipped {path}: {why}")
    if c.skipped:
        out.append("  (totals cover the shards that were read)")
    out += ["", f"  {'class':<26} {'tensors':>9} {'bytes':>19} {'share':>7}  residency"]
    for key, label, residency in CLASSES:
        n, b = c.classes[key]
        if n:
            out.append(f"  {label:<26} {n:>9,} {b:>19,} {_pct(b, total)}  {residency}")
    out.append(f"  {'total':<26} {c.count:>9,} {total:>19,}")
    out += ["", f"  {'dtype':<26} {'tensors':>9} {'bytes':>19} {'share':>7}"]
    for dt, (n, b) in sorted(c.dtypes.items(), key=lambda kv: -kv[1][1]):
        out.append(f"  {dt:<26} {n:>9,} {b:>19,} {_pct(b, total)}")

    resident = c.residency_bytes(RESIDENT)
    routed = c.classes["routed"][1]
    out += ["",
            f"  resident floor: {human(resident)} ({resident:,} B): every tensor but the routed "
            f"experts and the unused ones, in RAM when the trunk is not streamed",
            f"    with --trunk the layers stream and only the model tables stay: "
            f"{human(c.model_table_bytes)} plus the trunk budget",
            f"  streamable: {human(routed)} ({routed:,} B) of routed experts"]
    if c.shared_note():
        out.append(f"  {c.shared_note()}")
    sizes = set(c.expert_bytes.values())
    if c.expert_bytes:
        each = (f"{next(iter(sizes)):,} B each" if len(sizes) == 1 else
                f"{min(sizes):,} to {max(sizes):,} B (NOT uniform)")
        out.append(f"  routed experts: {len(c.expert_bytes):,} in {len(c.routed_layers)} layers, "
                   f"{each}")
    if c.routed_params:
        bpp = routed / c.routed_params
        out.append(f"  routed params (from packed shapes): {c.routed_params:,}; "
                   f"{bpp:.5f} bytes/param (MXFP4 predicts {MXFP4_BYTES_PER_PARAM})")
    if c.layers:
        n = max(c.layers) + 1
        lmap = "".join("K" if L in c.kda_layers else "M" if L in c.mla_layers else "?"
                       for L in range(n))
        out += [f"  layer map (from headers; K = KDA by A_log, M = MLA by kv_a/kv_b): {lmap}",
                f"    MLA layers: {_ranges(c.mla_layers)}",
                f"    layers without routed experts: "
                f"{sorted(set(range(n)) - c.routed_layers)}"]
    if sizes:
        eb = max(sizes)
        pool = len(c.expert_bytes)
        out += ["", "  routed experts that fit in RAM beside the resident floor:"]
        for gb in FIT_GB:
            k = max(0, int(gb * 1e9) - resident) // eb
            k = min(k, pool)
            out.append(f"    {gb:>4} GB: {k:>8,} experts ({_pct(k, pool).strip()} of the pool)")
    for note in c.notes:
        out.append(f"  note: {note}")
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="k3 budget", description=__doc__.split("\n\n")[0],
                                 epilog="Exit codes: 0 census printed, 1 no shard could be "
                                        "read, 2 usage.")
    ap.add_argument("model_dir", nargs="?", default=os.environ.get("K3_MODEL_DIR"),
                    help="checkpoint directory (default: $K3_MODEL_DIR)")
    a = ap.parse_args(argv)
    if not a.model_dir:
        ap.error("give MODEL_DIR or set K3_MODEL_DIR")
    if not os.path.isdir(a.model_dir):
        print(f"k3 budget: {a.model_dir}: not a directory", file=sys.stderr)
        return 1
    c = census(a.model_dir)
    print("\n".join(report_lines(c)))
    if not c.shards:
        why = "no .safetensors files" if not c.skipped else "no shard header could be read"
        print(f"k3 budget: {a.model_dir}: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
