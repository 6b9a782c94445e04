"""The packed trunk (SYSTEM §2) and the streamed trunk (SYSTEM §3).

Packing copies each decoder layer's trunk run (every tensor of the layer except the routed
experts; one contiguous run in one shard) verbatim into `trunk.bin`, 4096-aligned, and
describes it in `trunk.json`.  Streaming keeps a planned set of layers pinned after first
use and streams every other layer through a small ring of slots, read ahead in layer order
by a reader thread while the compute thread works on the current layer.

Silent-failure traps handled here (each has a test in tests/test_trunk.py):
* one ring slot must never be read ahead: the next layer would land on the bytes being
  computed on (fluent wrong tokens, no error) -- no reader thread when ring == 1;
* a slot is marked empty BEFORE its read starts and published only AFTER the read
  succeeded, so a failed or short read is never bound;
* an upcoming layer already in a slot is never evicted for a further one (re-read storm);
* a trunk packed from another checkpoint is refused at open (TrunkMismatchError);
* a layer decoded from the compressed trunk (trunk_compress) that fails a block's check is
  never bound: re-read from trunk.bin, compressed reads off (tests/test_trunk_compress.py).
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .atomic import open_nofollow, publish_with_manifest, remove_stale
from .bind import Binder
from .checkpoint import Checkpoint, CheckpointError, TensorInfo, to_bf16, widen_bf16
from .diskio import (ALIGN, CHUNK, AlignedBuffer, align_up, open_for_streaming, parallel_read,
                     pread_into)
from .kernels._k3io import ReadPool
from .inputfile import InputFileError, read_regular_file
from .names import PREFIX
from .strict_json import JSONFormatError, loads_strict
from .weights import I8R, LayerWeights, ModelTables
from . import trunk_compress as K3Z
from .kernels import _k3z as Z

TRUNK_BIN, TRUNK_JSON = "trunk.bin", "trunk.json"
DRAFT_FORMATS = ("i8r", "bf16")
COPY_CHUNK = 64 << 20
ELEM = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4}
NP_DTYPE = {"U8": np.uint8, "BF16": np.uint16, "F16": np.float16, "F32": np.float32}


class TrunkError(CheckpointError):
    """A packed trunk that must not be used; the message names the file and the problem."""


class TrunkMismatchError(TrunkError):
    """trunk.json describes tensors that differ from this checkpoint's."""


class PackCancelled(TrunkError):
    pass


@dataclass(frozen=True)
class TrunkTensor:
    off: int            # relative to the layer run's start
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TrunkLayer:
    file_off: int
    nbytes: int         # run length rounded up to 4096: the bytes read
    tensors: dict[str, TrunkTensor]
    sha256: str | None = None   # of the nbytes read (NEW field; the reference ignores it)


MAX_RANK = 4
MAX_DIM = 1 << 40
MANIFEST_LIMIT = 256 << 20     # the released trunk.json is well under 1 MB


def _is_count(v) -> bool:
    """A JSON integer >= 0 (bool is an int subclass in Python, not a count)."""
    return type(v) is int and 0 <= v < 1 << 62


def _tensor_entry(t) -> "TrunkTensor | None":
    if not isinstance(t, dict):
        return None
    off, nb, dt, shape = t.get("off"), t.get("nbytes"), t.get("dtype"), t.get("shape", [])
    if not (_is_count(off) and _is_count(nb) and isinstance(dt, str) and isinstance(shape, list)
            and len(shape) <= MAX_RANK and all(_is_count(d) and d < MAX_DIM for d in shape)):
        return None
    return TrunkTensor(off, nb, dt, tuple(shape))


def _refuse_overlap(tensors: dict, bad, gaps: bool = False) -> int:
    """The tensors must tile [0, extent) exactly, as pack-trunk copies one contiguous shard
    run (a draft's I8R layout aligns each tensor to 64 bytes: `gaps` allows that padding,
    never an overlap); returns the extent."""
    spans = sorted((t.off, t.off + t.nbytes, n) for n, t in tensors.items() if t.nbytes)
    cursor, prev = 0, None
    for s1, e1, n1 in spans:
        if s1 < cursor:
            s0, e0, n0 = prev
            raise bad(f"tensor {n1} [{s1}, {e1}) overlaps {n0} [{s0}, {e0})")
        if s1 > cursor and not (gaps and s1 - cursor < 64):
            raise bad(f"{s1 - cursor} bytes at offset {cursor} of the run belong to no tensor "
                      f"(gap before {n1})")
        cursor, prev = e1, (s1, e1, n1)
    return cursor


def _is_trunk_tensor(name: str, L: int) -> bool:
    return name.startswith(f"{PREFIX}layers.{L}.") and ".block_sparse_moe.experts." not in name


def _layer_of(name: str) -> int | None:
    head = PREFIX + "layers."
    if not name.startswith(head):
        return None
    num = name[len(head):].split(".", 1)[0]
    return int(num) if num.isdigit() else None


def trunk_runs(ck: Checkpoint, n_layers: int) -> list[tuple[int, int, int, list[TensorInfo]]]:
    """(shard, lo, own, tensors) of each layer's trunk run, with the §2.2 refusals."""
    by_layer: dict[int, list[TensorInfo]] = {L: [] for L in range(n_layers)}
    for name in ck.names():
        L = _layer_of(name)
        if L is not None and L < n_layers and _is_trunk_tensor(name, L):
            by_layer[L].append(ck.info(name))
    runs = []
    for L in range(n_layers):
        mine = by_layer[L]
        if not mine:
            raise TrunkError(f"{ck.model_dir}: layer {L}: NO TENSORS FOUND", ck.model_dir)
        shards = {t.shard for t in mine}
        if len(shards) > 1:
            raise TrunkError(f"{ck.model_dir}: layer {L} spans {len(shards)} shards, cannot "
                             f"pack as one run", ck.model_dir)
        lo = min(t.offset for t in mine)
        hi = max(t.offset + t.nbytes for t in mine)
        own = sum(t.nbytes for t in mine)
        if hi - lo != own:
            raise TrunkError(f"{mine[0].path}: layer {L} trunk is NOT contiguous (span "
                             f"{hi - lo}, own {own})", mine[0].path)
        runs.append((mine[0].shard, lo, own, sorted(mine, key=lambda t: t.name)))
    return runs


def _tensor_map(infos: list[TensorInfo], lo: int) -> dict:
    return {t.name: {"off": t.offset - lo, "nbytes": t.nbytes, "dtype": t.dtype,
                     "shape": list(t.shape)} for t in infos}


def pack_trunk(model_dir: str, trunk_dir: str, n_layers: int | None = None,
               progress: Callable[[int, int, int], None] | None = None,
               cancel: Callable[[], bool] | None = None,
               draft_bits: int | None = None, draft_format: str = "i8r") -> "TrunkManifest":
    """Write trunk.bin + trunk.json.  `progress(layers_done, bytes_done, bytes_total)`;
    `cancel()` returning True stops the pack.  Atomic: files appear under their final
    names only when complete, trunk.json last, so a cancelled or failed pack never leaves
    a pair that looks valid.

    `draft_bits` packs a DRAFT trunk instead (hybrid decode, `--draft-trunk`): every BF16
    matrix but the router is quantised per row to `draft_bits`-bit integers, stored as
    int8 rows + float32 scales (`draft_format` "i8r": dtype I8R, half the bytes) or
    dequantised back to BF16 ("bf16": the same layout as the exact trunk); trunk.json
    says so in its "draft" entry."""
    if draft_format not in DRAFT_FORMATS:
        raise ValueError(f"draft format must be one of {DRAFT_FORMATS}, got {draft_format!r}")
    from .config import load_config
    cfg = load_config(os.path.join(model_dir, "config.json"))
    n = cfg.n_layers if n_layers is None else n_layers
    draft = None if draft_bits is None else {
        "method": "qdq" if draft_format == "bf16" else "int8", "bits": int(draft_bits),
        "format": draft_format, "granularity": "row",
        "source": os.path.basename(os.path.abspath(model_dir))}
    with Checkpoint(model_dir) as ck:
        runs = trunk_runs(ck, n)
        layers = [_tensor_map(infos, lo) for _, lo, _, infos in runs]
        os.makedirs(trunk_dir, exist_ok=True)
        old = _refuse_other_model(trunk_dir, layers, draft is not None)
        notes = [f"removed {n}, left by an interrupted pack-trunk"
                 for n in remove_stale(trunk_dir, PARTIAL_RE)]
        total = sum(own for _, _, own, _ in runs)
        bin_path = os.path.join(trunk_dir, TRUNK_BIN)
        json_path = os.path.join(trunk_dir, TRUNK_JSON)
        tmp_bin = f"{bin_path}.partial-{os.getpid()}"
        tmp_json = f"{json_path}.partial-{os.getpid()}"
        manifest = {"n_layers": n, "align": ALIGN, "layers": []}
        if draft:
            manifest["draft"] = draft
        done = 0
        try:
            # O_EXCL|O_NOFOLLOW: a link planted at the partial name is replaced, never
            # written through (issue 47); 0666 less the umask, as before (model data)
            with os.fdopen(open_nofollow(tmp_bin, os.O_WRONLY, 0o666, exclusive=True),
                           "wb") as out:
                buf = bytearray(COPY_CHUNK)
                for L, (shard, lo, own, infos) in enumerate(runs):
                    out.write(b"\0" * (-out.tell() % ALIGN))
                    file_off = out.tell()
                    digest = hashlib.sha256()      # of exactly the bytes a reader reads
                    run = bytearray(own) if draft else None   # a draft layer is rewritten whole
                    fd = os.open(ck.shards[shard], os.O_RDONLY)
                    try:
                        for o in range(0, own, COPY_CHUNK):
                            if cancel and cancel():
                                raise PackCancelled(f"{trunk_dir}: pack cancelled at layer {L}",
                                                    trunk_dir)
                            m = min(COPY_CHUNK, own - o)
                            dest = memoryview(run)[o:o + m] if draft else memoryview(buf)[:m]
                            if pread_into(fd, dest, lo + o) != m:
                                raise TrunkError(f"{ck.shards[shard]}: short read packing "
                                                 f"layer {L}", ck.shards[shard])
                            if not draft:
                                out.write(dest)
                                digest.update(dest)
                            done += m
                            if progress:
                                progress(L, done, total)
                    finally:
                        os.close(fd)
                    size, tensors = own, layers[L]
                    if draft:
                        run, tensors = _draft_run(run, infos, lo, tensors, draft_bits,
                                                  draft_format)
                        out.write(run)
                        digest.update(run)
                        size = len(run)
                    pad = b"\0" * (-out.tell() % ALIGN)
                    out.write(pad)                 # an O_DIRECT read never passes EOF
                    digest.update(pad)
                    manifest["layers"].append({
                        "layer": L, "shard": os.path.basename(ck.shards[shard]), "run_start": lo,
                        "nbytes": align_up(size), "file_off": file_off, "tensors": tensors,
                        "sha256": digest.hexdigest()})
                    if progress:
                        progress(L + 1, done, total)
                out.flush()
                os.fsync(out.fileno())
            # A kill between the publish's two renames leaves the old trunk.json beside the
            # new trunk.bin: a usable trunk only if the old manifest describes the new bytes
            # exactly (same runs, tensors and per-layer digests: a re-pack of the same
            # model), so only then may it stay; otherwise a kill leaves no trunk, never a
            # wrong one.
            publish_with_manifest(tmp_bin, bin_path, manifest, tmp_json, json_path,
                                  keep_old_manifest=old is None or _describes(old, manifest))
        finally:
            for p in (tmp_bin, tmp_json):
                if os.path.exists(p):
                    os.unlink(p)
    m = TrunkManifest.load(trunk_dir)
    m.notes = notes + _drop_stale_compressed(trunk_dir, m)
    return m


# ---- the compressed copy (trunk_compress's format) --------------------------------------------------------------------------

def compress_trunk(trunk_dir: str, block_bytes: int = K3Z.BLOCK_BYTES,
                   min_coded: int = K3Z.MIN_CODED,
                   progress: Callable[[int, int, int], None] | None = None,
                   cancel: Callable[[], bool] | None = None) -> K3Z.CompressedTrunk:
    """Write trunk.k3z + trunk.k3z.json from the packed trunk in `trunk_dir`, each layer's
    plain bytes checked against trunk.json's digest first.  `progress(layers_done,
    raw_bytes_done, stored_bytes_done)`.  Atomic: both files complete before the renames,
    the manifest last; trunk.bin and trunk.json are only read."""
    m = TrunkManifest.load(trunk_dir)
    if any(layer.sha256 is None for layer in m.layers):
        raise K3Z.K3zError(f"{os.path.join(trunk_dir, 'trunk.json')}: layers without a recorded "
                       f"digest (packed by an older pack-trunk); re-pack before compressing",
                       trunk_dir)
    notes = [f"removed {n}, left by an interrupted pack-trunk --compress"
             for n in remove_stale(trunk_dir, K3Z.PARTIAL_RE)]
    zpath, jpath = os.path.join(trunk_dir, K3Z.K3Z_BIN), os.path.join(trunk_dir, K3Z.K3Z_JSON)
    tmp_z, tmp_j = f"{zpath}.partial-{os.getpid()}", f"{jpath}.partial-{os.getpid()}"
    doc = {"format": K3Z.FORMAT, "version": K3Z.VERSION, "block_bytes": block_bytes,
           "min_coded": min_coded, "layers": []}
    raw_done = stored_done = 0
    try:
        fd = os.open(m.bin_path, os.O_RDONLY)
        try:
            with os.fdopen(open_nofollow(tmp_z, os.O_WRONLY, 0o666, exclusive=True),
                           "wb") as out:             # never through a planted link
                for L, layer in enumerate(m.layers):
                    run = bytearray(layer.nbytes)
                    if pread_into(fd, memoryview(run), layer.file_off) != layer.nbytes:
                        raise K3Z.K3zError(f"{m.bin_path}: short read on layer {L}", m.bin_path)
                    if hashlib.sha256(run).hexdigest() != layer.sha256:
                        raise K3Z.K3zError(f"{m.bin_path}: layer {L} does not match its recorded "
                                       f"SHA-256; re-pack the trunk before compressing it",
                                       m.bin_path)
                    digest = hashlib.sha256()
                    blocks, first = [], out.tell()
                    for raw_off, n, coded in K3Z.block_plan(layer.tensors, layer.nbytes,
                                                        block_bytes, min_coded):
                        if cancel and cancel():
                            raise PackCancelled(f"{trunk_dir}: compression cancelled at "
                                                f"layer {L}", trunk_dir)
                        raw = memoryview(run)[raw_off:raw_off + n]
                        codec, payload = K3Z.encode_block(raw, coded)
                        blocks.append({"raw_off": raw_off, "raw_nbytes": n,
                                       "file_off": out.tell(), "stored_nbytes": len(payload),
                                       "codec": codec, "check": f"{Z.check(raw):016x}"})
                        out.write(payload)
                        digest.update(payload)
                    pad = b"\0" * (-out.tell() % ALIGN)    # an aligned read never passes EOF
                    out.write(pad)
                    digest.update(pad)
                    doc["layers"].append({"layer": L, "nbytes": layer.nbytes,
                                          "raw_sha256": layer.sha256, "file_off": first,
                                          "stored_nbytes": out.tell() - first,
                                          "sha256": digest.hexdigest(), "blocks": blocks})
                    raw_done += layer.nbytes
                    stored_done = out.tell()
                    if progress:
                        progress(L + 1, raw_done, stored_done)
                out.flush()
                os.fsync(out.fileno())
        finally:
            os.close(fd)
        # a kill between the renames leaves a trunk.k3z with no manifest (plain reads)
        publish_with_manifest(tmp_z, zpath, doc, tmp_j, jpath)
    finally:
        for p in (tmp_z, tmp_j):
            if os.path.exists(p):
                os.unlink(p)
    ct = K3Z.CompressedTrunk.load(trunk_dir, m)
    ct.notes = notes
    return ct


def _drop_stale_compressed(trunk_dir: str, m: "TrunkManifest") -> list[str]:
    """A compressed trunk made from the previous pack no longer binds to the new
    trunk.json (runs would ignore it with a warning every time): remove it."""
    from .trunk_compress import K3Z_BIN, K3Z_JSON, CompressedTrunk, K3zError
    if not CompressedTrunk.present(trunk_dir):
        return []
    try:
        CompressedTrunk.load(trunk_dir, m)
        return []
    except K3zError:
        for name in (K3Z_JSON, K3Z_BIN):         # manifest first: never blocks without it
            p = os.path.join(trunk_dir, name)
            if os.path.exists(p):
                os.unlink(p)
        return [f"removed {K3Z_BIN}, compressed from the previous pack (re-run with "
                f"--compress)"]


PARTIAL_RE = re.compile(r"trunk\.(?:bin|json)\.partial-(?P<pid>[0-9]+)")


def _describes(old: "TrunkManifest", new: dict) -> bool:
    """Whether the old manifest, read beside the new trunk.bin, reads exactly the bytes
    it read before (every layer it lists has the same run, tensors and digest)."""
    if old.draft != new.get("draft") or len(old.layers) > len(new["layers"]):
        return False
    for have, want in zip(old.layers, new["layers"]):
        if (have.sha256 is None or have.sha256 != want["sha256"]
                or (have.file_off, have.nbytes) != (want["file_off"], want["nbytes"])
                or _first_mismatch(have.tensors, want["tensors"]) is not None
                or any(have.tensors[k].off != v["off"] for k, v in want["tensors"].items())):
            return False
    return True



def draft_quantised(t) -> bool:
    """Which trunk tensors a draft quantises: the BF16 matrices, except the router (its
    scores decide which experts the draft reads; ~1 % of the trunk)."""
    return (t.dtype == "BF16" and len(t.shape) == 2 and min(t.shape) > 1
            and not t.name.endswith(".block_sparse_moe.gate.weight"))


def quantise_rows(u: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """BF16 bits [rows, n] -> symmetric per-row integers in [-(2^(b-1)-1), 2^(b-1)-1]
    (int8, round half to even) and their float32 scales; an all-zero row gets scale 0."""
    x = widen_bf16(u)
    qmax = float((1 << (bits - 1)) - 1)
    scale = (np.abs(x).max(axis=1) / np.float32(qmax)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))[:, None]
    q = np.clip(np.rint(x / safe), -qmax, qmax).astype(np.int8)
    return q, scale


def qdq_bf16_rows(run: bytearray, off: int, shape: tuple[int, ...], bits: int) -> None:
    """Quantise a BF16 matrix in place per row and dequantise it back to BF16 (round to
    nearest even)."""
    rows, cols = int(shape[0]), int(np.prod(shape[1:]))
    u = np.frombuffer(run, dtype=np.uint16, count=rows * cols, offset=off).reshape(rows, cols)
    q, scale = quantise_rows(u, bits)
    u[...] = to_bf16(q.astype(np.float32) * scale[:, None])


def i8r_nbytes(shape) -> int:
    """I8R tensor bytes: one float32 scale per row, then the int8 rows."""
    rows, cols = int(shape[0]), int(np.prod(shape[1:]))
    return 4 * rows + rows * cols


def tensor_nbytes(dtype: str, shape) -> int:
    if dtype == "I8R":
        return i8r_nbytes(shape) if len(shape) >= 2 else -1
    return int(np.prod(shape, dtype=np.int64)) * ELEM[dtype]


def _draft_run(run: bytearray, infos: list[TensorInfo], lo: int, tensors: dict, bits: int,
               fmt: str) -> tuple[bytearray, dict]:
    """One layer's run and tensor map (`tensors`: the exact trunk's) in a draft trunk."""
    if fmt == "bf16":
        for t in filter(draft_quantised, infos):
            qdq_bf16_rows(run, t.offset - lo, t.shape, bits)
        return run, tensors
    out, tensors = bytearray(), dict(tensors)
    for t in sorted(infos, key=lambda t: t.offset):
        out += b"\0" * (-len(out) % 64)
        src = memoryview(run)[t.offset - lo:t.offset - lo + t.nbytes]
        entry = tensors[t.name] = dict(tensors[t.name], off=len(out))
        if draft_quantised(t):
            q, scale = quantise_rows(np.frombuffer(src, np.uint16).reshape(t.shape), bits)
            out += scale.astype("<f4").tobytes() + q.tobytes()
            entry.update(dtype="I8R", nbytes=i8r_nbytes(t.shape))
        else:
            out += src
    return out, tensors                 # still in name order (_tensor_map)


def _refuse_other_model(trunk_dir: str, layers: list[dict], draft: bool) -> "TrunkManifest | None":
    """The usable trunk already in the directory (None if none), after refusing to
    overwrite another model's trunk or an exact trunk with a draft."""
    json_path = os.path.join(trunk_dir, TRUNK_JSON)
    if not os.path.exists(json_path):
        return None
    try:
        old = TrunkManifest.load(trunk_dir)
    except TrunkError:
        return None                             # damaged: nothing worth protecting
    if old.draft is None and draft:             # would silently degrade the exact model
        raise TrunkError(f"{json_path}: the directory holds an exact packed trunk; a draft "
                         f"trunk must go to another directory", json_path)
    for L, tensors in enumerate(layers[:len(old.layers)]):
        mism = _first_mismatch(old.layers[L].tensors, tensors)
        if mism:
            raise TrunkMismatchError(f"{json_path}: the directory holds the trunk of a different "
                                     f"model (layer {L}: {mism}); remove it or choose another "
                                     f"directory", json_path)
    return old


def _first_mismatch(have: dict[str, TrunkTensor], want: dict[str, dict]) -> str | None:
    for name in sorted(set(have) | set(want)):
        if name not in have:
            return f"{name} is not present in the packed run"
        if name not in want:
            return f"{name} is not in the checkpoint"
        h, w = have[name], want[name]
        if h.dtype == "I8R" and w["dtype"] == "BF16":     # a draft's int8 form of the matrix
            w = dict(w, dtype="I8R", nbytes=i8r_nbytes(w["shape"]))
        if (h.dtype, list(h.shape), h.nbytes) != (w["dtype"], list(w["shape"]), w["nbytes"]):
            return (f"{name} is {h.dtype} {list(h.shape)} in the trunk, {w['dtype']} "
                    f"{list(w['shape'])} in the checkpoint")
        if "abs" in w and "off" in w and h.off != w["off"]:
            return (f"{name} is at offset {h.off} of the packed run, at {w['off']} of the "
                    f"checkpoint's run")
    return None


class TrunkManifest:
    """trunk.json read with the integrity checks of SYSTEM §2.6 (required and NEW)."""

    def __init__(self, trunk_dir: str, layers: list[TrunkLayer], align: int, bin_size: int,
                 draft: dict | None = None):
        self.trunk_dir, self.layers, self.align, self.bin_size = trunk_dir, layers, align, bin_size
        self.draft = draft          # how a draft trunk was derived; None for the exact trunk
        self.notes: list[str] = []  # what pack_trunk cleaned up

    def require_exact(self) -> None:
        """The exact model must never bind a quantised draft trunk (fluent, subtly wrong
        tokens, no error).  The other way round is allowed: any trunk of the model can
        propose, the exact one just proposes at full cost."""
        if self.draft is not None:
            jp = os.path.join(self.trunk_dir, TRUNK_JSON)
            raise TrunkError(f"{jp}: this is a quantised draft trunk "
                             f"({self.draft.get('bits')}-bit); the exact model needs the "
                             f"packed trunk itself (give this one as --draft-trunk)", jp)

    @property
    def bin_path(self) -> str:
        return os.path.join(self.trunk_dir, TRUNK_BIN)

    @classmethod
    def load(cls, trunk_dir: str) -> "TrunkManifest":
        """Silent-failure traps handled here (issue 14, finding 4; tests in
        tests/test_hostile_trunk.py): offsets written `true`, `1e-400` or `"0"` were read as
        1, 0, 0 by int() and ran with other ids, and two tensors overlapping inside a run
        both bound.  Every count is a JSON integer (never a bool, float or string), every
        tensor lies inside its run, and no two tensors of a run overlap."""
        jp = os.path.join(trunk_dir, TRUNK_JSON)
        bp = os.path.join(trunk_dir, TRUNK_BIN)

        def bad(problem: str) -> TrunkError:
            return TrunkError(f"{jp}: {problem}", jp)
        try:
            raw = loads_strict(read_regular_file(jp, MANIFEST_LIMIT, "trunk.json"), jp)
        except InputFileError as e:
            if e.missing:
                raise TrunkError(f"{jp}: no trunk.json (pack one with k3 pack-trunk)", jp) \
                    from None
            raise bad(e.problem) from None
        except JSONFormatError as e:
            raise bad(f"not valid JSON ({e.problem})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("layers"), list):
            raise bad("has no 'layers' array")
        try:
            st = os.stat(bp)
        except OSError:
            raise TrunkError(f"{bp}: missing trunk.bin beside trunk.json", bp) from None
        if not stat.S_ISREG(st.st_mode):
            raise TrunkError(f"{bp}: not a regular file", bp)
        bin_size = st.st_size
        align = raw.get("align", 0)
        if not _is_count(align):
            raise bad(f"'align' is {align!r}, not a non-negative integer")
        draft = raw.get("draft")
        if draft is not None and not (isinstance(draft, dict) and _is_count(draft.get("bits"))):
            raise bad("has a malformed 'draft' entry")
        dtypes = set(ELEM) | ({"I8R"} if draft else set())   # int8 rows: drafts only
        layers, prev_end = [], 0
        for i, e in enumerate(raw["layers"]):
            if not isinstance(e, dict) or not isinstance(e.get("tensors"), dict):
                raise bad(f"layer {i} has no 'tensors' object")
            fo, nb = e.get("file_off"), e.get("nbytes")
            if not (_is_count(fo) and _is_count(nb)):
                raise bad(f"layer {i} has no valid file_off/nbytes (non-negative JSON "
                          f"integers; got {fo!r}, {nb!r})")
            if fo % ALIGN or nb % ALIGN:
                raise bad(f"layer {i}: file_off {fo} or nbytes {nb} is not a multiple of {ALIGN}")
            if fo + nb > bin_size:
                raise TrunkError(f"{bp}: layer {i} run [{fo}, {fo + nb}) passes the end of "
                                 f"trunk.bin ({bin_size} bytes): truncated trunk", bp)
            # SYSTEM §2.3: the runs follow each other in layer order, each padded to the
            # next 4096; a run elsewhere would bind other bytes as this layer's weights.
            if fo != prev_end:
                raise bad(f"layer {i} starts at {fo}, not where the previous run ends "
                          f"({prev_end})" if fo > prev_end or i == 0
                          else f"layer {i} overlaps the previous layer's run")
            prev_end = fo + nb
            digest = e.get("sha256")
            if digest is not None and not (isinstance(digest, str)
                                           and re.fullmatch(r"[0-9a-f]{64}", digest)):
                raise bad(f"layer {i}: 'sha256' is not 64 lower-case hex digits")
            tensors = {}
            for name, t in e["tensors"].items():
                tt = _tensor_entry(t)
                if tt is None:
                    raise bad(f"layer {i}: tensor {name} entry is malformed (off and nbytes "
                              f"non-negative JSON integers, dtype a string, shape a list of "
                              f"at most {MAX_RANK} integers)")
                if tt.dtype not in dtypes:
                    raise bad(f"layer {i}: tensor {name} has dtype {tt.dtype!r}, which this "
                              f"reader does not decode{' outside a draft trunk' if tt.dtype == 'I8R' else ''}")
                if tt.off + tt.nbytes > nb:
                    raise bad(f"layer {i}: tensor {name} lies outside its run")
                if tensor_nbytes(tt.dtype, tt.shape) != tt.nbytes:
                    raise bad(f"layer {i}: tensor {name} is {tt.nbytes} bytes but its shape "
                              f"implies {tensor_nbytes(tt.dtype, tt.shape)}")
                tensors[name] = tt
            extent = _refuse_overlap(tensors, lambda problem: bad(f"layer {i}: {problem}"),
                                     gaps=draft is not None)
            if nb != align_up(extent):
                raise bad(f"layer {i}: nbytes {nb} is not its tensors' extent {extent} rounded "
                          f"up to {ALIGN} ({align_up(extent)})")
            if "blocks" in e:
                raise bad(f"layer {i} uses the compressed block format, which this reader "
                          f"does not implement")
            layers.append(TrunkLayer(fo, nb, tensors, digest))
        if prev_end != bin_size:
            raise TrunkError(f"{bp} has {bin_size - prev_end} bytes after the last layer run "
                             f"that {jp} describes (another pack's trunk.bin?)", bp)
        return cls(trunk_dir, layers, align, bin_size, draft)

    def check_against(self, ck: Checkpoint, n_layers: int) -> None:
        """Refuse a trunk packed from another checkpoint or revision (TrunkMismatchError)."""
        jp = os.path.join(self.trunk_dir, TRUNK_JSON)
        if len(self.layers) < n_layers:
            raise TrunkError(f"{jp}: packed trunk has {len(self.layers)} layers, need "
                             f"{n_layers}", self.trunk_dir)
        want: dict[int, dict] = {L: {} for L in range(n_layers)}
        for n in ck.names():                     # one pass over the index, not one per layer
            L = _layer_of(n)
            if L is not None and L < n_layers and _is_trunk_tensor(n, L):
                i = ck.info(n)
                want[L][n] = {"dtype": i.dtype, "shape": list(i.shape), "nbytes": i.nbytes,
                              "abs": i.offset}
        for L in range(n_layers):
            if self.draft is None and want[L]:
                # An exact trunk copies the layer's shard run verbatim, so each tensor's
                # place in the run is its place in the shard: a moved offset that still
                # tiles would otherwise bind another tensor's bytes without any error.
                lo = min(w["abs"] for w in want[L].values())
                for w in want[L].values():
                    w["off"] = w["abs"] - lo
            mism = _first_mismatch(self.layers[L].tensors, want[L])
            if mism:
                raise TrunkMismatchError(f"{jp}: trunk does not belong to {ck.model_dir} "
                                         f"(layer {L}: {mism})", jp)

    def total_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class TrunkLayerSource:
    """One layer run in memory, read as tensors (zero-copy views for large matrices)."""

    def __init__(self, manifest: TrunkManifest, L: int, buf: memoryview):
        self.layer, self.buf, self.path = manifest.layers[L], buf, manifest.bin_path

    def info(self, name: str):
        t = self.layer.tensors.get(name)
        if t is None:
            raise TrunkError(f"{self.path}: {name} is not present in the packed run", self.path,
                             name)
        return TensorInfo(name, t.dtype, t.shape, 0, self.path, t.off, t.nbytes)

    def read(self, name: str) -> np.ndarray | I8R:
        t = self.info(name)
        if t.dtype == "I8R":
            rows = t.shape[0]
            return I8R(np.frombuffer(self.buf, np.int8, rows * (t.nbytes // rows - 4),
                                     t.offset + 4 * rows).reshape(rows, -1),
                       np.frombuffer(self.buf, np.float32, rows, t.offset))
        dt = NP_DTYPE[t.dtype]
        return np.frombuffer(self.buf, dtype=dt, count=t.nbytes // ELEM[t.dtype],
                             offset=t.offset).reshape(t.shape)

    def read_f32(self, name: str) -> np.ndarray:
        a = self.read(name)
        if a.dtype == np.uint16:
            return widen_bf16(a)
        return a.astype(np.float32)



IO_THREADS = 4                  # reader threads of a layer's parallel chunk reads (§2.5)


class StreamedTrunk:
    """WeightProvider over a packed trunk: pinned layers (read on first touch, kept) and a
    ring of `ring_slots` uniform slots read ahead in layer order (SYSTEM §3.5).

    Plain reads of trunk.bin go to native reader threads (`kernels._k3io`), which never
    take the GIL: the read-ahead is issued from `layer()` as (offset, slot) requests and
    collected when the forward reaches the layer, so no Python thread stands between the
    disk and the kernels.  Only a compressed trunk (trunk_compress) has a Python reader
    thread, because its blocks are decoded on it."""

    def __init__(self, manifest: TrunkManifest, binder: Binder, tables: ModelTables,
                 n_layers: int, pinned: set[int], ring_slots: int, io_threads: int = IO_THREADS,
                 on_read: Callable[[int, int, float], None] | None = None,
                 compressed: str | None = None):
        self.m, self.binder, self.tables, self.n_layers = manifest, binder, tables, n_layers
        self.pinned = set(pinned)
        self.on_read = on_read
        unpinned = [L for L in range(n_layers) if L not in self.pinned]
        self.nslot = max(1, min(ring_slots, len(unpinned))) if unpinned else 0
        self.slot_bytes = max((manifest.layers[L].nbytes for L in unpinned), default=0)
        self.fd, self.direct = open_for_streaming(manifest.bin_path)
        if manifest.align != ALIGN:
            os.close(self.fd)
            self.fd, self.direct = os.open(manifest.bin_path, os.O_RDONLY), False
        self.io = ReadPool(io_threads)
        self.pool: ThreadPoolExecutor | None = None     # trunk.k3z's decoding threads
        # The compressed copy (trunk_compress): read in place of trunk.bin when decoding
        # outruns the device (`compressed`: auto/on/off, default $K3_TRUNK_COMPRESS).
        self.notes: list[tuple[str, bool]] = []     # (message, is a warning), drained by run
        self.reads_line = ""
        self.compress_choice = None
        self.k3z = self._k3z_reader = None
        self._open_compressed(compressed, io_threads)
        self.slots = [AlignedBuffer(self.slot_bytes) for _ in range(self.nslot)]
        self.pinned_buf: dict[int, AlignedBuffer] = {}
        self.pinned_bound: dict[int, LayerWeights] = {}
        # ring state, all under self.cv (§3.5)
        self.cv = threading.Condition()
        self.layer_of = [-1] * self.nslot
        self.slot_of: dict[int, int] = {}
        self.pending = [-1] * self.nslot
        self.held = -1
        self.walk = -1
        self.cursor = 0
        self.queue: list[tuple[int, int]] = []         # for the compressed reader thread
        self.inflight: dict[int, tuple[int, list[int]]] = {}   # slot -> (layer, handles)
        self.stop = False
        # counters (completed binds / reads only)
        self.hits = self.misses = self.binds = 0
        self.bytes_read = 0
        self._k3z_raw_read = 0                  # of bytes_read, decoded from trunk.k3z
        self.read_seconds = 0.0
        self._busy_until = 0.0                  # read_seconds counts overlapping reads once
        self.read_ahead = self.nslot >= 2       # with ONE slot there must be no read-ahead
        self.reader = None
        if self.read_ahead and self.k3z is not None:
            self.reader = threading.Thread(target=self._reader, name="k3-trunk-reader",
                                           daemon=True)
            self.reader.start()

    # -- reads -------------------------------------------------------------------------

    def _open_compressed(self, mode: str | None, io_threads: int) -> None:
        from .trunk_compress import (CompressedReader, CompressedTrunk, K3zError, MODE_ENV,
                                     choose, requested_mode)
        mode = requested_mode(mode)
        if not CompressedTrunk.present(self.m.trunk_dir):
            if mode == "on":
                self.notes.append((f"{MODE_ENV}=on but {self.m.trunk_dir} has no compressed "
                                   f"trunk (k3 pack-trunk --compress); reading trunk.bin",
                                   True))
            return
        try:
            ct = CompressedTrunk.load(self.m.trunk_dir, self.m)
        except K3zError as e:
            self.notes.append((f"{e}; reading the plain trunk.bin instead", True))
            return
        reader = CompressedReader(ct)
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="k3-trunk-decode")
        choice = choose(reader, self.m, self.pool, self.io, self.fd, io_threads, mode)
        self.reads_line, self.compress_choice = choice.line, choice
        self.notes.append((choice.line, False))
        if choice.use:
            self.k3z = self._k3z_reader = reader
        else:
            reader.close()
            self.pool.shutdown()
            self.pool = None

    def drain_notes(self) -> list[tuple[str, bool]]:
        """The notes (message, is a warning) since the last drain: the compressed-read
        choice at open, a damaged compressed file found on the way."""
        with self.cv:
            out, self.notes = self.notes, []
        return out

    @property
    def stored_bytes_read(self) -> int:
        """Bytes read from the disk for the trunk (compressed blocks count as stored)."""
        k = self._k3z_reader
        z = k.stored_bytes_read if k is not None else 0
        return self.bytes_read - (self._k3z_raw_read if k is not None else 0) + z

    def _read_compressed(self, L: int, dest: memoryview) -> bool:
        """Layer L decoded from trunk.k3z into dest; False when compressed reads are off
        or a block failed.  A failed block stops compressed reads for the run (the plain
        bytes are the same bits; the caller re-reads the layer from trunk.bin).  The
        reader is never closed here: another reader thread may be inside it."""
        k = self.k3z
        if k is None:
            return False
        problem = k.read_layer(self.pool, L, dest)
        with self.cv:
            if problem is None:
                self._k3z_raw_read += len(dest)
                return True
            if self.k3z is not None:
                self.k3z = None
                self.notes.append((f"{problem}; the compressed trunk is damaged, reading "
                                   f"trunk.bin from layer {L} on (check it with k3 doctor "
                                   f"--verify --trunk {self.m.trunk_dir})", True))
        return False

    def _read_run(self, L: int, dest: memoryview) -> bool:
        run = self.m.layers[L]
        t0 = time.monotonic()
        if not self._read_compressed(L, dest[:run.nbytes]):
            got = parallel_read(self.io, self.fd, dest[:run.nbytes], run.file_off)
        else:
            got = run.nbytes
        if got != run.nbytes:
            return False
        self._account(L, t0, time.monotonic())
        return True

    def _account(self, L: int, t0: float, t1: float) -> None:
        """Count a finished read of layer L over [t0, t1] (time.monotonic); the part a
        read overlapped with an earlier counted one is not counted twice."""
        nbytes = self.m.layers[L].nbytes
        with self.cv:
            dt = max(0.0, t1 - max(t0, self._busy_until))
            self._busy_until = max(self._busy_until, t1)
            self.bytes_read += nbytes
            self.read_seconds += dt
        if self.on_read:
            self.on_read(L, nbytes, dt)

    def _issue(self, L: int, s: int) -> None:
        """Read-ahead of layer L into claimed slot s on the native readers (§2.5's
        parallel chunk requests).  Caller holds the lock."""
        run = self.m.layers[L]
        self.inflight[s] = (L, self.io.submit_spans(self.fd, self.slots[s].view[:run.nbytes],
                                                    run.file_off, CHUNK))

    def _collect(self, s: int) -> None:
        """Wait for slot s's read-ahead (the GIL and the lock released) and publish it, or
        leave the slot empty on a short read or an error (the consumer then reads the
        layer itself, and reports it if that fails too).  Caller holds the lock."""
        L, handles = self.inflight.pop(s)
        self.cv.release()
        try:
            got, err, t0, t1 = self.io.wait_all(handles)
            ok = not err and got == self.m.layers[L].nbytes
            if ok:
                self._account(L, t0, t1)
        finally:
            self.cv.acquire()
        self._publish(s, L, ok)

    def _collect_landed(self) -> None:
        """Publish every read-ahead that has returned (never waits).  Caller holds the lock."""
        for s in [s for s, (_, hs) in self.inflight.items() if all(map(self.io.done, hs))]:
            self._collect(s)

    def _claim(self, L: int) -> int:
        """A slot that may receive layer L (§3.5 rules), marked empty and pending; -1 if
        every slot is busy.  Caller holds the lock."""
        for i in range(self.nslot):
            s = (self.cursor + i) % self.nslot
            lo = self.layer_of[s]
            if self.pending[s] >= 0 or s == self.held:
                continue
            if lo >= 0 and self.walk < lo <= self.walk + self.nslot:
                continue                        # an upcoming layer: keep it
            if lo >= 0:
                del self.slot_of[lo]
            self.layer_of[s] = -1               # empty BEFORE the read starts
            self.pending[s] = L
            self.cursor = (s + 1) % self.nslot
            return s
        return -1

    def _publish(self, s: int, L: int, ok: bool) -> None:
        """Caller holds the lock."""
        self.pending[s] = -1
        if ok:
            self.layer_of[s] = L
            self.slot_of[L] = s
        self.cv.notify_all()

    def _reader(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.stop:
                    self.cv.wait()
                if self.stop:
                    return
                L, s = self.queue.pop(0)
            ok = self._read_run(L, self.slots[s].view)
            with self.cv:
                self._publish(s, L, ok)

    # -- the WeightProvider interface --------------------------------------------------

    def layer(self, L: int) -> LayerWeights:
        with self.cv:
            self.walk = L
        if L in self.pinned:
            lw = self._pinned(L)
        else:
            s = self._fetch_ring(L)
            lw = self.binder.layer(L, TrunkLayerSource(self.m, L, self.slots[s].view))
            self._prefetch(L + 1)
        self.binds += 1
        return lw

    def release(self, L: int) -> None:
        with self.cv:
            self.held = -1
            self.cv.notify_all()

    def _pinned(self, L: int) -> LayerWeights:
        lw = self.pinned_bound.get(L)
        if lw is not None:
            self.hits += 1
            return lw
        buf = AlignedBuffer(self.m.layers[L].nbytes)
        if not self._read_run(L, buf.view):
            buf.close()
            raise TrunkError(f"{self.m.bin_path}: short read on layer {L}", self.m.bin_path)
        self.misses += 1
        self.pinned_buf[L] = buf
        lw = self.pinned_bound[L] = self.binder.layer(L, TrunkLayerSource(self.m, L, buf.view))
        return lw

    def _fetch_ring(self, L: int) -> int:
        cv = self.cv
        with cv:
            self.held = -1
            cv.notify_all()
            first = True
            while True:
                s = self.slot_of.get(L, -1)
                if s >= 0:
                    if first:
                        self.hits += 1
                    break
                if first:
                    self.misses += 1
                    first = False
                if L in self.pending:
                    s = self.pending.index(L)
                    if s in self.inflight:
                        self._collect(s)        # the native read-ahead: wait for it here
                    else:
                        cv.wait()               # the compressed reader thread is on it
                    continue
                s = self._claim(L)
                if s < 0:
                    cv.wait()                   # every slot busy
                    continue
                cv.release()
                try:
                    ok = self._read_run(L, self.slots[s].view)
                finally:
                    cv.acquire()
                self._publish(s, L, ok)
                if not ok:
                    raise TrunkError(f"{self.m.bin_path}: short read on layer {L}",
                                     self.m.bin_path)
                break
            self.held = self.slot_of[L]
            return self.held

    def _prefetch(self, L: int) -> None:
        if not self.read_ahead:
            return
        with self.cv:
            self._collect_landed()              # their slots become claimable again
            n = L
            while len(self.queue) + len(self.inflight) < self.nslot and n < self.n_layers:
                if n in self.pinned or n in self.slot_of or n in self.pending:
                    n += 1                      # (a queued layer is pending too)
                    continue
                s = self._claim(n)
                if s < 0:
                    break
                if self.reader is not None:
                    self.queue.append((n, s))
                else:
                    self._issue(n, s)
                n += 1
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        if self.reader is not None:
            self.reader.join()
        with self.cv:
            while self.inflight:                # no slot is unmapped under a reader
                self._collect(next(iter(self.inflight)))
        self.io.close()
        if self.pool is not None:
            self.pool.shutdown()
        os.close(self.fd)
        if self._k3z_reader is not None:
            self._k3z_reader.close()
        self.pinned_bound.clear()
        for b in list(self.pinned_buf.values()) + self.slots:
            try:
                b.close()
            except BufferError:
                pass                            # views still referenced: freed with them
