"""Safetensors checkpoint reader: hardened header parser, tensor index, exact reads.

The contract is SYSTEM.md §1 (format §1.2, index §1.3, the sixteen header checks of §1.4,
widening §1.8, partial downloads §1.9) and ARCHITECTURE.md §3.1 / §5.5.  Every header of
every shard is validated before anything is read: a damaged or hostile header refuses the
whole checkpoint, because one wrong span silently turns into plausible-looking weights.
Tensor bytes are returned in their storage type (BF16 stays as uint16 bit patterns) and
widened to float32 only by the exact rules of §5.5.  NumPy and the standard library only.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple

import numpy as np

from .diskio import pread_into
from .errors import EngineError
from .inputfile import InputFileError, MiB, read_regular_file
from .strict_json import STRICT_HOOKS, JSONFormatError, Refused, check_tree, loads_strict

__all__ = [
    "CheckpointError", "PartialCheckpointError", "HeaderEntry", "TensorInfo", "Checkpoint",
    "parse_header", "widen_bf16", "require_tensors", "DTYPES",
]

HEADER_MAX = 256 << 20     # real headers are about 1 MB; the JSON is parsed in memory (§1.4)
NAME_MAX_BYTES = 511       # the C reader's name buffer (§1.4 #16)
MAX_RANK = 4
INT64_MAX = 2**63 - 1
WIDEN_CHUNK = 4 << 20      # source bytes per read_f32 step (§1.8); read at call time
INDEX_JSON = "model.safetensors.index.json"
INDEX_LIMIT = 256 * MiB    # the released index is ~40 MB (497,220 names)
SUFFIX = ".safetensors"
_JSON_WS = b" \t\n\r"


class CheckpointError(EngineError):
    """A checkpoint that must not be used.  The message names the file and, where known,
    the tensor; both are also kept as attributes."""

    def __init__(self, message: str, path: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class PartialCheckpointError(CheckpointError):
    """Tensors the model needs are absent from the shard set (a partial download)."""


class _Dtype(NamedTuple):
    code: int              # value stored in the index
    elemsize: int
    storage: np.dtype      # how read() returns the bytes; always little-endian


DTYPES: dict[str, _Dtype] = {
    "U8": _Dtype(0, 1, np.dtype("u1")),
    "BF16": _Dtype(1, 2, np.dtype("<u2")),   # NumPy has no bfloat16: keep the bit patterns
    "F16": _Dtype(2, 2, np.dtype("<f2")),
    "F32": _Dtype(3, 4, np.dtype("<f4")),
}
_DTYPE_BY_CODE = tuple(DTYPES)


class HeaderEntry(NamedTuple):
    """One tensor of one shard header, as validated by parse_header()."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int            # absolute file offset: 8 + N + data_offsets[0]
    nbytes: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str             # 'U8' | 'BF16' | 'F16' | 'F32'
    shape: tuple[int, ...]
    shard: int
    path: str
    offset: int            # absolute file offset
    nbytes: int


# ---------------------------------------------------------------------------------------
# Low-level reads.  os.pread may return fewer bytes than asked (signal, network file
# system, EOF); every caller loops, and 0 means EOF.  A short count is reported to the
# caller, which must refuse it: never a partially filled array (§1.9.3).

def _pread_bytes(fd: int, n: int, offset: int) -> bytes:
    buf = bytearray(n)
    got = pread_into(fd, memoryview(buf), offset)
    return bytes(buf[:got]) if got < n else bytes(buf)


# ---------------------------------------------------------------------------------------
# Header parsing (§1.2, §1.4)

class _Pairs(list):
    """A JSON object kept as its (key, value) list.  json.loads silently keeps the LAST of
    duplicate keys (trap #15); keeping every pair lets the caller refuse duplicates with
    the right message, and tells an object apart from a JSON array."""


def _json_problem(text: str, err: json.JSONDecodeError) -> str:
    at = len(text[:err.pos].encode("utf-8", "surrogatepass"))   # byte, not character
    if not text[err.pos:].strip(" \t\n\r"):     # json calls a cut-off header a missing ','
        return f"header is not a JSON object (unexpected end of JSON at byte {at})"
    if err.msg.startswith("Expecting ',' delimiter"):
        return f"expected ',' near byte {at}"
    if err.msg.startswith("Expecting ':' delimiter"):
        return f"expected ':' near byte {at}"
    if err.msg.startswith("Expecting property name"):
        return f"bad tensor name near byte {at}"
    return f"header is not a JSON object ({err.msg} near byte {at})"


def _is_int(x) -> bool:
    return type(x) is int          # bool is an int subclass: true/false are not sizes


def _parse_entry(path: str, name: str, value, region: int, base: int) -> HeaderEntry:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: {problem}", path, name)

    if not isinstance(value, _Pairs):                                        # 5
        raise bad(f"entry is not an object (tensor {name})")
    fields = dict(value)
    if len(fields) != len(value):
        raise bad(f"{name} has a duplicate key in its entry")
    dtype, offsets = fields.get("dtype"), fields.get("data_offsets")
    if dtype is None or offsets is None:                                     # 6
        raise bad(f"{name} is missing dtype or data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:                    # 7
        raise bad(f"unsupported dtype '{dtype}' on {name}")
    shape = fields.get("shape")
    # Stricter than the C reader, which reads a missing shape as a scalar.
    # type() is list, not isinstance: a JSON object is kept as _Pairs, a list subclass, and
    # "shape": {} read as an empty list was a scalar (found by the differential fuzzer).
    if type(shape) is not list:
        raise bad(f"{name} is missing shape" if shape is None
                  else f"{name} has impossible shape {shape!r}: not a list")
    if len(shape) > MAX_RANK:                                                # 8
        raise bad(f"{name} has rank > 4")
    # 9: Python ints never wrap, so "saturation" is an explicit sign/size check.
    if not all(_is_int(d) for d in shape):
        raise bad(f"{name} has impossible shape {shape}: dimensions must be integers")
    if any(d < 0 for d in shape):
        raise bad(f"{name} has impossible shape {shape}: negative dimension")
    # 10: bounds on the relative offsets, before the base is added.
    if not (type(offsets) is list and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise bad(f"{name} has impossible data_offsets {offsets!r}")
    start, end = offsets
    if start < 0 or end < start or end > region:
        raise bad(f"{name} has impossible data_offsets [{start}, {end}] "
                  f"(data region {region} bytes)")
    want = math.prod(shape) * DTYPES[dtype].elemsize                        # [] -> 1 element
    if want > INT64_MAX:                                                     # 11
        raise bad(f"{name} shape is impossibly large")
    if end - start != want:                                                  # 12
        raise bad(f"{name} spans {end - start} bytes but shape implies {want}")
    return HeaderEntry(name, dtype, tuple(shape), base + start, end - start)


def _check_tiling(path: str, entries: list[HeaderEntry], base: int, region: int) -> list[str]:
    """#13: the spans must tile the data region from 0 with no overlap and no gap.  Each
    entry was checked alone; two tensors claiming one span would otherwise both pass and
    one would read the other's bytes as weights.

    #14, stricter than the reference (which only notes trailing bytes) and equal to the
    safetensors library ("file not fully covered"): the spans must end exactly at the end
    of the file.  A header length prefix a few bytes short, still inside the header's space
    padding, parses as the same JSON and shifts every tensor a few bytes early; only the
    bytes it leaves past the last tensor show it (issue 14, finding 4)."""
    spans = sorted((e.offset - base, e.offset - base + e.nbytes, e.name) for e in entries)
    cursor, owner = 0, None
    for start, end, name in spans:
        if start < cursor:
            o_start, o_end, o_name = owner
            raise CheckpointError(f"{path}: {name} [{start},{end}) overlaps "
                                  f"{o_name} [{o_start},{o_end})", path, name)
        if start > cursor:
            raise CheckpointError(f"{path}: {start - cursor} bytes at offset {cursor} belong "
                                  f"to no tensor (gap before {name})", path, name)
        if end > cursor:       # a zero-length span at the cursor is legal and moves nothing
            cursor, owner = end, (start, end, name)
    if region > cursor:
        raise CheckpointError(f"{path} has {region - cursor} trailing bytes after the last "
                              f"tensor: the tensors must cover the data region exactly (a "
                              f"header length that is off shifts every tensor)", path)
    return []


def _scan_shard(fd: int, path: str) -> tuple[list[HeaderEntry], list[str]]:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: {problem}", path)

    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise bad("not a regular file")
    size = st.st_size
    head = _pread_bytes(fd, 8, 0)
    if len(head) < 8:                                                        # 1
        raise bad("too short for a header length")
    n = int.from_bytes(head, "little")
    # 2: compare by subtraction (in C, 8 + N wraps for N near 2**64).
    if n == 0 or n > size - 8:
        raise bad(f"header length {n} is impossible (file {size} bytes)")
    if n > HEADER_MAX:
        raise bad(f"header length {n} is impossible (file {size} bytes): "
                  f"headers are capped at {HEADER_MAX} bytes")
    raw = _pread_bytes(fd, n, 8)
    if len(raw) != n:                                                        # 3
        raise bad(f"short read of header (got {len(raw)} of {n} bytes)")

    # 4.  Decode explicitly: json.loads(bytes) would guess UTF-16/32 from NUL bytes.
    if not raw.lstrip(_JSON_WS).startswith(b"{"):
        raise bad("header is not a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"header is not a JSON object (invalid UTF-8 at byte {e.start})") from None
    try:
        top = json.loads(text, object_pairs_hook=_Pairs, **STRICT_HOOKS)
        check_tree(top, path)
    except json.JSONDecodeError as e:
        raise bad(_json_problem(text, e)) from None
    except JSONFormatError as e:
        raise bad(f"header is not a JSON object ({e.problem})") from None
    except Refused as e:
        raise bad(f"header is not a JSON object ({e})") from None
    except (ValueError, RecursionError) as e:
        # Not JSONDecodeError: an integer literal over Python's digit limit (ValueError),
        # or __metadata__ nested deeper than the recursion limit.
        raise bad(f"header is not a JSON object ({type(e).__name__}: {e})") from None
    if not isinstance(top, _Pairs):
        raise bad("header is not a JSON object")

    base, region = 8 + n, size - 8 - n
    entries: list[HeaderEntry] = []
    seen: set[str] = set()
    for name, value in top:
        if name == "__metadata__":      # never a tensor
            # The safetensors library refuses anything but an object of strings here.
            if not (isinstance(value, _Pairs) and all(isinstance(v, str) for _, v in value)):
                raise bad("__metadata__ is not an object of string values")
            continue
        if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:     # 16
            raise CheckpointError(f"{path}: tensor name {name[:60]}... is longer than "
                                  f"{NAME_MAX_BYTES} bytes", path, name)
        if name in seen:                                                     # 15
            raise CheckpointError(f"{path}: duplicate tensor name {name}", path, name)
        seen.add(name)
        entries.append(_parse_entry(path, name, value, region, base))
    return entries, _check_tiling(path, entries, base, region)


def _open_ro(path: str) -> int:
    try:
        # O_NONBLOCK: a FIFO named *.safetensors would block open() itself (the scan then
        # refuses anything but a regular file); it changes nothing for a regular file.
        flags = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_BINARY", 0))
        return os.open(path, flags)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})", path) from None


def parse_header(path) -> tuple[list[HeaderEntry], list[str]]:
    """Validate one shard's header (§1.4 #1-#16).  Returns (entries in header order,
    notes); raises CheckpointError naming the file and, where known, the tensor."""
    path = os.fspath(path)
    fd = _open_ro(path)
    try:
        return _scan_shard(fd, path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})", path) from None
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# Widening (ARCHITECTURE §5.5)

def widen_bf16(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32 by ``bits << 16``: exact, and keeps signed
    zeros, subnormals, inf and NaN payloads.  Never go through a float conversion."""
    bits = np.asarray(bits)
    if bits.dtype.kind != "u" or bits.dtype.itemsize != 2:
        raise TypeError(f"widen_bf16 needs uint16 bit patterns, got {bits.dtype}")
    if out is None:
        out = np.empty(bits.shape, np.float32)
    np.left_shift(bits, np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    return out


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns, round to nearest even (inputs are finite): the
    generator's weights and a draft trunk's dequantised matrices."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


# ---------------------------------------------------------------------------------------
# The checkpoint

# One row per tensor, 52 bytes.  §1.3 budgets <= 100 MB for the whole index at 497,220
# tensors.  Measured for a synthetic 497,220-name index: rows 26 MB, name -> row dict
# 29 MB, the name strings themselves 62 MB: 117 MB, over budget.  The dict is the part to
# replace (names in one bytes blob; a dict only for the ~2,628 non-expert names; experts
# addressed by (layer, expert, matrix, kind)) when the 8 GB floor is enforced.
_ROW = np.dtype([("shard", "<u2"), ("dtype", "u1"), ("ndim", "u1"), ("shape", "<i8", (4,)),
                 ("offset", "<i8"), ("nbytes", "<i8")])


def _rows(shard: int, entries: list[HeaderEntry]) -> np.ndarray:
    rows = np.zeros(len(entries), _ROW)
    if not entries:
        return rows
    rows["shard"] = shard
    rows["dtype"] = [DTYPES[e.dtype].code for e in entries]
    rows["ndim"] = [len(e.shape) for e in entries]
    rows["shape"] = [e.shape + (0,) * (MAX_RANK - len(e.shape)) for e in entries]
    rows["offset"] = [e.offset for e in entries]
    rows["nbytes"] = [e.nbytes for e in entries]
    return rows


def _shard_files(model_dir: str) -> list[str]:
    try:
        names = os.listdir(model_dir)
    except OSError as e:
        raise CheckpointError(f"cannot list {model_dir} ({e.strerror})", model_dir) from None
    # Byte-wise order: readdir order differs between runs and machines, and the shard
    # number stored in the index must not.
    return sorted((n for n in names if n.endswith(SUFFIX)), key=os.fsencode)


def _check_index_json(model_dir: str) -> None:
    """The HF index is never used to locate tensors (headers are); it only tells us
    which shard files a complete download has."""
    path = os.path.join(model_dir, INDEX_JSON)
    if not os.path.exists(path):
        return
    try:
        doc = loads_strict(read_regular_file(path, INDEX_LIMIT, "shard index"), path)
        weight_map = doc["weight_map"]
        if not all(isinstance(s, str) for s in weight_map.values()):
            raise TypeError("shard names must be strings")
        files = sorted(set(weight_map.values()))
    except (InputFileError, JSONFormatError) as e:
        raise CheckpointError(f"{path}: not a usable shard index ({e.problem})", path) from None
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a usable shard index ({type(e).__name__}: {e})",
                              path) from None
    for shard in files:
        if not _plain_name(shard):
            raise CheckpointError(f"{path}: shard name {shard[:80]!r} is not a plain file "
                                  f"name in {model_dir}", path)
    for shard in files:
        if not os.path.isfile(os.path.join(model_dir, shard)):
            missing = os.path.join(model_dir, shard)
            raise CheckpointError(f"{missing}: shard named in {INDEX_JSON} is missing "
                                  f"(a partial download cannot run the model)", missing)


def _plain_name(name: str) -> bool:
    return (bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


class Checkpoint:
    """Every ``*.safetensors`` in one directory, indexed from validated headers.

    One read-only descriptor per shard stays open for the life of the object
    (``close()`` or ``with``); all reads are positioned (``pread``), so the object holds
    no file position and concurrent reads do not interfere.
    """

    def __init__(self, model_dir):
        self.model_dir = os.fspath(model_dir)
        files = _shard_files(self.model_dir)
        _check_index_json(self.model_dir)
        if not files:
            raise CheckpointError(f"no .safetensors files in {self.model_dir}", self.model_dir)
        if len(files) > np.iinfo(np.uint16).max:
            raise CheckpointError(f"{self.model_dir}: too many shards ({len(files)})",
                                  self.model_dir)
        self.shards: list[str] = [os.path.join(self.model_dir, f) for f in files]
        self.notes: list[str] = []
        self._fds: list[int] = []
        self._row: dict[str, int] = {}   # name -> row; insertion order is row order
        parts, first_row = [], []   # first_row[s]: row of shard s's first tensor
        try:
            for shard, path in enumerate(self.shards):
                first_row.append(len(self._row))
                fd = _open_ro(path)
                self._fds.append(fd)
                try:
                    entries, notes = _scan_shard(fd, path)
                except OSError as e:
                    raise CheckpointError(f"{path}: cannot read ({e.strerror})", path) from None
                self.notes += notes
                for e in entries:                                            # 15, across shards
                    prev = self._row.get(e.name)
                    if prev is not None:
                        first = self.shards[bisect.bisect_right(first_row, prev) - 1]
                        raise CheckpointError(f"duplicate tensor name {e.name} "
                                              f"(in {first} and {path})", path, e.name)
                    self._row[e.name] = len(self._row)
                parts.append(_rows(shard, entries))
        except BaseException:
            self.close()
            raise
        self._index = np.concatenate(parts)

    # -- lookup ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, name) -> bool:
        return name in self._row

    def names(self) -> list[str]:
        return list(self._row)

    def info(self, name: str) -> TensorInfo:
        row = self._row.get(name)
        if row is None:
            raise CheckpointError(f"missing tensor {name} in {self.model_dir}",
                                  self.model_dir, name)
        r = self._index[row]
        shard, ndim = int(r["shard"]), int(r["ndim"])
        return TensorInfo(name, _DTYPE_BY_CODE[r["dtype"]],
                          tuple(int(d) for d in r["shape"][:ndim]), shard,
                          self.shards[shard], int(r["offset"]), int(r["nbytes"]))

    def require_shapes(self, names: list[str], dtype: str, shape: tuple[int, ...]) -> None:
        """Every present tensor of `names` has this dtype and shape, checked in one pass over
        the index (half a million routed-expert tensors on the released model).  Silent-
        failure trap (issue 14, finding 8): one expert's tensor stored transposed was found
        only when that expert was first loaded, mid-run (exit 4); checked up front it is a
        damaged checkpoint (exit 1) like every other shape error."""
        rows = np.fromiter((self._row[n] for n in names if n in self._row), np.int64)
        if not rows.size:
            return
        want = np.zeros(MAX_RANK, np.int64)
        want[:len(shape)] = shape
        r = self._index[rows]
        bad = np.flatnonzero((r["dtype"] != DTYPES[dtype].code) | (r["ndim"] != len(shape))
                             | np.any(r["shape"] != want, axis=1))
        if bad.size:
            info = self.info(self.names()[rows[bad[0]]])
            raise CheckpointError(f"{info.path}: {info.name} is {info.dtype} "
                                  f"{list(info.shape)}, expected {dtype} {list(shape)}"
                                  + (f" ({bad.size} such tensors)" if bad.size > 1 else ""),
                                  info.path, info.name)

    def index_nbytes(self) -> int:
        """Bytes of the NumPy part of the index (the name map is extra)."""
        return self._index.nbytes

    # -- reading ---------------------------------------------------------------------

    def _read_range(self, info: TensorInfo, dest: np.ndarray, start: int) -> None:
        """Fill uint8 `dest` with the tensor's bytes [start, start + len(dest))."""
        if not self._fds:
            raise CheckpointError(f"{info.path}: checkpoint is closed (reading {info.name})",
                                  info.path, info.name)
        try:
            got = pread_into(self._fds[info.shard], memoryview(dest), info.offset + start)
        except OSError as e:
            raise CheckpointError(f"{info.path}: cannot read {info.name} ({e.strerror})",
                                  info.path, info.name) from None
        if got != len(dest):
            # The file shrank after open, or its data region was cut after the header.
            raise CheckpointError(f"{info.path}: short read of {info.name}: got "
                                  f"{start + got} of {info.nbytes} bytes", info.path, info.name)

    def read(self, name: str) -> np.ndarray:
        """The tensor in its storage type (BF16 as uint16 bit patterns), shaped."""
        info = self.info(name)
        buf = np.empty(info.nbytes, np.uint8)
        self._read_range(info, buf, 0)
        return buf.view(DTYPES[info.dtype].storage).reshape(info.shape)

    def read_into(self, name: str, out: np.ndarray) -> np.ndarray:
        """Raw tensor bytes into a caller's writable C-contiguous buffer of exactly
        nbytes (any dtype).  On error the buffer's contents are undefined."""
        info = self.info(name)
        if not (isinstance(out, np.ndarray) and out.flags.c_contiguous
                and out.flags.writeable and out.nbytes == info.nbytes):
            raise ValueError(f"read_into {name}: need a writable C-contiguous array of "
                             f"{info.nbytes} bytes")
        self._read_range(info, out.reshape(-1).view(np.uint8), 0)
        return out

    def read_f32(self, name: str) -> np.ndarray:
        """The tensor widened exactly to float32 (ARCHITECTURE §5.5), read WIDEN_CHUNK
        source bytes at a time so a 2.35 GB BF16 tensor needs no second full-size
        transient (§1.8)."""
        info = self.info(name)
        out = np.empty(info.shape, np.float32)
        if info.dtype == "F32":
            self._read_range(info, out.reshape(-1).view(np.uint8), 0)
            return out
        dt = DTYPES[info.dtype]
        flat = out.reshape(-1)
        per = max(1, WIDEN_CHUNK // dt.elemsize)      # whole elements per chunk
        scratch = np.empty(min(flat.size, per) * dt.elemsize, np.uint8)
        for done in range(0, flat.size, per):
            take = min(per, flat.size - done)
            raw = scratch[:take * dt.elemsize]
            self._read_range(info, raw, done * dt.elemsize)
            dst = flat[done:done + take]
            if info.dtype == "BF16":
                widen_bf16(raw.view(dt.storage), out=dst)
            else:
                # F16: NumPy's half -> single is IEEE-exact (subnormals renormalised,
                # inf/NaN payloads kept); U8: the byte value.
                np.copyto(dst, raw.view(dt.storage))
        return out

    # -- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Checkpoint({self.model_dir!r}: {len(self)} tensors in {len(self.shards)} shards)"


# ---------------------------------------------------------------------------------------
# Partial downloads (§1.9)

def require_tensors(ck: Checkpoint, names_by_layer: Mapping[int, Iterable[str]],
                    n_layers: int) -> None:
    """Refuse before anything is allocated if any of the first n_layers layers lacks a
    tensor the model will use; otherwise a missing shard surfaces mid-run."""
    first = None
    k = 0
    for layer in range(n_layers):
        missing = [n for n in names_by_layer.get(layer, ()) if n not in ck]
        if missing:
            k += 1
            if first is None:
                first = missing[0]
    if k:
        raise PartialCheckpointError(
            f"{k} of {n_layers} layers are missing tensors in this shard set. A partial "
            f"download cannot run the model. First missing: {first} in {ck.model_dir}",
            ck.model_dir, first)
