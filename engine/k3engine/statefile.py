"""State file version 2 (SYSTEM §6.9): save, peek and load what one sequence carries.

A state file resumes a conversation without re-reading its prompt.  It holds the token
ids, the recurrent state of every bound layer and, for the MLA layers, the KV and rope
rows of the *occupied* positions only, so a resumed run may size its cache differently.
Nothing downstream can tell a good restore from a bad one (the tokens come out fluent
either way), so the reader refuses everything it cannot prove whole, and does so before
it touches the target state.

Layout (all little-endian, no padding):

    header (104 bytes)  magic "K3ST", i32 version = 2, i32 fingerprint[12],
                        i32 n_bound, n_mla, cached, nseq, i64 kper, kvpp, ropepp,
                        u64 payload_hash
    ids                 nseq x i32
    state               n_bound x kper x f32, per layer S || conv_q || conv_k || conv_v
                        (MLA layers carry no recurrent state: their slot is zeros)
    kv                  per MLA layer, cached x kvpp x f32 (position-major)
    rope                per MLA layer, cached x ropepp x f32

The payload hash is FNV-1a folded over 64-bit words, region by region (ids; state; each
KV slice; each rope slice), each region's tail bytes folded one at a time.
"""
from __future__ import annotations

import os
import stat
import struct
import sys
import tempfile
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from . import kernels as K
from .atomic import fsync_dir, publish_target
from .config import ModelConfig
from .state import KDAState, MLAState, SequenceState
from .errors import EngineError

__all__ = ["StateFileError", "StateHeader", "MAGIC", "VERSION", "HEADER_SIZE",
           "HASH_INIT", "model_fingerprint", "state_hash", "save_state", "peek_state",
           "load_state"]

MAGIC = b"K3ST"
VERSION = 2
# magic, version, fingerprint[12], n_bound, n_mla, cached, nseq, kper, kvpp, ropepp, hash
_HEADER = struct.Struct("<4si12i4i3qQ")
HEADER_SIZE = _HEADER.size  # 104
assert HEADER_SIZE == 104

HASH_INIT = 0xCBF29CE484222325  # FNV-1a 64-bit offset basis
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1

# The fingerprint's twelve config fields, in header order (§6.9).
FINGERPRINT_FIELDS = ("hidden", "n_layers", "vocab", "kda_heads", "kda_head_dim", "conv_k",
                      "n_heads", "qk_nope", "qk_rope", "v_head", "n_experts", "topk")

_I32_MAX = 2**31 - 1
# Read size of the verification pass: large enough to amortise the syscalls, small
# enough that verifying a multi-GB file costs no memory worth planning for.
_READ_CHUNK = 8 << 20


class StateFileError(EngineError):
    """A state file that cannot be written, or must not be restored.  The message names
    the file and the problem, in the wording of §6.9."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class StateHeader:
    """The 104-byte header, as read by `peek_state`."""

    fingerprint: tuple[int, ...]
    n_bound: int
    n_mla: int
    cached: int
    nseq: int
    kper: int
    kvpp: int
    ropepp: int
    payload_hash: int
    version: int = VERSION

    def region_sizes(self) -> list[int]:
        """Byte length of each hashed region, in file order (2 + 2*n_mla regions)."""
        return ([4 * self.nseq, 4 * self.kper * self.n_bound]
                + [4 * self.cached * self.kvpp] * self.n_mla
                + [4 * self.cached * self.ropepp] * self.n_mla)

    @property
    def payload_bytes(self) -> int:
        # Arithmetic, not sum(region_sizes()): a hostile header's n_mla of 2**31-1 would
        # build a list of four billion sizes before the size check could refuse it (found
        # by the state-file fuzzer, tests/fuzz).
        return (4 * self.nseq + 4 * self.kper * self.n_bound
                + 4 * self.cached * (self.kvpp + self.ropepp) * self.n_mla)

    @property
    def file_bytes(self) -> int:
        return HEADER_SIZE + self.payload_bytes

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.version, *self.fingerprint, self.n_bound,
                            self.n_mla, self.cached, self.nseq, self.kper, self.kvpp,
                            self.ropepp, self.payload_hash)


# ---------------------------------------------------------------------------------------
# Fingerprint and geometry.

def model_fingerprint(cfg: ModelConfig, n_layers: int | None = None) -> tuple[int, ...]:
    """The twelve config integers of §6.9 (the reference's k3_state_fp), in header order.

    The spec fixes the fingerprint to config fields, so `n_layers` (the bound layer
    count) is deliberately NOT part of it: fp[1] is the config's own layer count, and
    the bound count travels separately in the header's n_bound, which `load_state`
    checks against the target state.  The parameter is accepted only so call sites that
    pass it keep working; it does not change the result.
    """
    del n_layers
    return tuple(int(getattr(cfg, name)) for name in FINGERPRINT_FIELDS)


class _Geometry(NamedTuple):
    n_bound: int
    n_mla: int
    kper: int    # recurrent-state floats per bound layer
    kvpp: int    # KV floats per position per MLA layer
    ropepp: int  # rope floats per position per MLA layer


def _geometry(state: SequenceState) -> _Geometry:
    """The header geometry of `state`, after checking its arrays are exactly what the
    file layout assumes (float32, C-contiguous, the config's shapes): the payload is
    written from and read into their raw memory."""
    if sys.byteorder != "little":
        # The payload is the arrays' native bytes; a big-endian host would need swaps.
        raise RuntimeError("state files are little-endian; this host is big-endian")
    cfg = state.cfg
    H, D, P, K = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_proj, cfg.conv_k
    kper = H * D * D + 3 * P * (K - 1)
    kvpp = cfg.n_heads * (cfg.qk_nope + cfg.v_head)
    ropepp = cfg.qk_rope
    if len(state.layers) != state.n_layers:
        raise ValueError(f"state has {len(state.layers)} layers, n_layers = {state.n_layers}")
    if not 0 <= state.n_cached <= state.capacity:
        raise ValueError(f"state holds {state.n_cached} positions, "
                         f"capacity {state.capacity}")
    n_mla = 0
    for L, st in enumerate(state.layers):
        if cfg.is_mla(L):
            n_mla += 1
            want = MLAState.shapes(cfg.n_heads, cfg.qk_nope, cfg.v_head, ropepp,
                                   state.capacity)
            if not isinstance(st, MLAState):
                raise ValueError(f"layer {L} is MLA but its state is {type(st).__name__}")
        else:
            want = {"S": (H, D, D), "conv_q": (P, K - 1), "conv_k": (P, K - 1),
                    "conv_v": (P, K - 1)}
            if not isinstance(st, KDAState):
                raise ValueError(f"layer {L} is KDA but its state is {type(st).__name__}")
        for name, shape in want.items():
            a = getattr(st, name)
            if (not isinstance(a, np.ndarray) or a.dtype != np.float32
                    or a.shape != shape or not a.flags.c_contiguous):
                raise ValueError(f"layer {L} {name}: expected a C-contiguous float32 "
                                 f"array of shape {shape}")
    return _Geometry(state.n_layers, n_mla, kper, kvpp, ropepp)


def _resolve_fingerprint(state: SequenceState, fingerprint: Sequence[int] | None
                         ) -> tuple[int, ...]:
    own = model_fingerprint(state.cfg)
    if fingerprint is None:
        return own
    fp = tuple(int(v) for v in fingerprint)
    # A fingerprint that disagrees with the arrays' own config is a caller bug, and a
    # file written under it would describe a model its payload was not built by.
    if fp != own:
        raise ValueError(f"fingerprint {fp} does not describe the state's config {own}")
    return fp


# ---------------------------------------------------------------------------------------
# Payload hash.

def _fold_words(h: int, words: np.ndarray) -> int:
    """Fold little-endian uint64 `words` into `h`: h = (h ^ w) * prime mod 2^64 (a
    sequential chain, so it runs in the nogil kernel rather than as Python ints)."""
    return int(K.fnv_fold_words(h, np.ascontiguousarray(words, dtype="<u8")))


def _fold_bytes(h: int, data: bytes) -> int:
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _MASK64
    return h


class _RegionHasher:
    """The running payload hash, fed in pieces of any size.

    A region may arrive split anywhere (per-layer arrays, read chunks), but the spec
    folds each region's bytes as one run of 8-byte words plus a tail, so a partial word
    is carried across pieces and only `end_region` folds leftover bytes singly.
    """

    def __init__(self, h: int = HASH_INIT):
        self.value = h
        self._carry = b""

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        if self._carry:
            need = 8 - len(self._carry)
            if len(mv) < need:
                self._carry += bytes(mv)
                return
            word = int.from_bytes(self._carry + bytes(mv[:need]), "little")
            self.value = ((self.value ^ word) * _FNV_PRIME) & _MASK64
            mv = mv[need:]
        n8 = len(mv) & ~7
        if n8:
            self.value = _fold_words(self.value, np.frombuffer(mv[:n8], dtype="<u8"))
        self._carry = bytes(mv[n8:])

    def end_region(self) -> None:
        self.value = _fold_bytes(self.value, self._carry)
        self._carry = b""


def state_hash(h: int, data) -> int:
    """Fold one region (any bytes-like object) into `h`; the reference's k3_state_hash.
    The payload hash is `HASH_INIT` folded through every region in file order."""
    hasher = _RegionHasher(h)
    hasher.update(data)
    hasher.end_region()
    return hasher.value


# ---------------------------------------------------------------------------------------
# Saving.

def _as_bytes(a: np.ndarray) -> memoryview:
    """The raw bytes of a C-contiguous array, zero-copy (empty slices included, which
    memoryview.cast refuses)."""
    return memoryview(a.reshape(-1).view(np.uint8))


_ROWS_PER_PIECE = 256   # MLA rows staged at a time on save and load (4 MB in mid)


def _payload_regions(state: SequenceState, ids: np.ndarray, geo: _Geometry
                     ) -> Iterator[Iterable[memoryview]]:
    """The payload as regions in file order, each an iterable of pieces: zero-copy, but
    for the MLA cache, whose position-major rows are assembled from its key blocks and
    value planes a few hundred positions at a time (state.MLAState)."""
    yield [_as_bytes(ids)]
    no_state = memoryview(bytes(4 * geo.kper))  # an MLA layer's recurrent slot
    yield [piece for st in state.layers
           for piece in ((_as_bytes(st.S), _as_bytes(st.conv_q), _as_bytes(st.conv_k),
                          _as_bytes(st.conv_v)) if isinstance(st, KDAState) else (no_state,))]
    mla = [st for st in state.layers if isinstance(st, MLAState)]
    n = state.n_cached
    for rows in (MLAState.rows, MLAState.rope_rows):
        for st in mla:
            yield (_as_bytes(rows(st, p, min(p + _ROWS_PER_PIECE, n)))
                   for p in range(0, n, _ROWS_PER_PIECE))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def save_state(path: str | os.PathLike, state: SequenceState, tokens: Iterable[int],
               fingerprint: Sequence[int] | None = None) -> int:
    """Write `state` and the token sequence to `path` (§6.9, version 2); return the
    bytes written (header + payload).

    Published atomically: the file is staged as PATH.tmp.* in the same directory with
    mode 0600 (the file holds the conversation), fsynced, then renamed over PATH, so PATH changes exactly once,
    from the old complete file to the new one.  On any failure the temp file is removed,
    PATH is left untouched and StateFileError("failed writing PATH: reason") is raised.
    `fingerprint` defaults to (and must equal) model_fingerprint(state.cfg).
    """
    path = os.fspath(path)
    try:
        target = publish_target(path)
    except OSError as e:
        raise StateFileError(path, f"failed writing {path}: {e.strerror}") from None
    fp = _resolve_fingerprint(state, fingerprint)
    geo = _geometry(state)
    ids_list = [int(t) for t in tokens]
    for t in ids_list:
        if not 0 <= t <= _I32_MAX:
            raise ValueError(f"token id {t} does not fit the file's int32 ids")
    ids = np.asarray(ids_list, dtype="<i4")
    header = StateHeader(fp, geo.n_bound, geo.n_mla, state.n_cached, len(ids_list),
                         geo.kper, geo.kvpp, geo.ropepp, payload_hash=0)

    directory = os.path.dirname(os.path.abspath(target))
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".tmp.", dir=directory)
    except OSError as e:
        raise StateFileError(path, f"failed writing {path}: cannot create a temp file in "
                                   f"{directory}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp creates 0600 and it stays so: the state holds the conversation's
            # ids and KV rows, which a reader can decode back into its text (issue 14).
            # The hash is known only after the payload has been walked, and walking it
            # twice would double the cost of a save: write the header with hash 0 and
            # rewrite it at the end (nothing can observe the temp file meanwhile).
            f.write(header.pack())
            hasher = _RegionHasher()
            for region in _payload_regions(state, ids, geo):
                for piece in region:
                    f.write(piece)
                    hasher.update(piece)
                hasher.end_region()
            f.seek(0)
            f.write(replace(header, payload_hash=hasher.value).pack())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        _unlink_quietly(tmp)
        if isinstance(e, OSError):
            raise StateFileError(path, f"failed writing {path}: {e.strerror or e}") from e
        raise
    fsync_dir(directory)
    return header.file_bytes


# ---------------------------------------------------------------------------------------
# Loading.

def _read_header(f, path: str) -> StateHeader:
    raw = f.read(HEADER_SIZE)
    if len(raw) != HEADER_SIZE or raw[:4] != MAGIC:
        raise StateFileError(path, f"{path} is not a k3 state file")
    fields = _HEADER.unpack(raw)
    version = fields[1]
    if version != VERSION:
        # Version 1 had no payload hash; it is refused, never read with a guessed layout.
        raise StateFileError(path, f"{path} is state version {version}, "
                                   f"this build writes {VERSION}")
    n_bound, n_mla, cached, nseq, kper, kvpp, ropepp, payload_hash = fields[14:]
    hd = StateHeader(tuple(fields[2:14]), n_bound, n_mla, cached, nseq, kper, kvpp,
                     ropepp, payload_hash)
    # Negative counts would make every size below meaningless; only a damaged header
    # carries them, and sizing buffers from it must not be possible.
    for name in ("n_bound", "n_mla", "cached", "nseq", "kper", "kvpp", "ropepp"):
        if getattr(hd, name) < 0:
            raise StateFileError(path, f"{path} has a damaged header "
                                       f"({name} = {getattr(hd, name)})")
    return hd


def _open_for_reading(path: str):
    # Non-blocking open: a FIFO would block open() itself; only a regular file is read.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise StateFileError(path, f"cannot read {path}: {e.strerror or e}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StateFileError(path, f"cannot read {path}: not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def peek_state(path: str | os.PathLike) -> StateHeader:
    """Read and check only the header (magic, size, version), so the caller can size
    its cache before committing to a load."""
    path = os.fspath(path)
    with _open_for_reading(path) as f:
        hd = _read_header(f, path)
        _check_size(f, path, hd)
        return hd


def _check_size(f, path: str, hd: StateHeader) -> None:
    """The header's counts size what a caller allocates (nseq 2**31-1 made the CLI build a
    17 GB id list before any check, issue 14 finding 3): the sizes it declares must add up
    to the file's own size before anyone trusts one of them.  load_state makes the same
    check after its compatibility refusals (their order is the reference's)."""
    size = os.fstat(f.fileno()).st_size
    if size < hd.file_bytes:
        raise StateFileError(path, f"{path} is truncated: its header declares "
                                   f"{hd.file_bytes:,} bytes ({hd.nseq:,} ids, {hd.cached:,} "
                                   f"positions), the file has {size:,}")
    if size > hd.file_bytes:
        raise StateFileError(path, f"{path} is longer than its header declares "
                                   f"({hd.file_bytes} bytes; the file has {size:,})")


def _check_compatible(path: str, hd: StateHeader, fp: tuple[int, ...], geo: _Geometry,
                      capacity: int) -> None:
    """The §6.9 refusals that need only the header, in the reference's order."""
    if hd.fingerprint != fp:
        diff = ", ".join(f"{name} {theirs} vs {ours}" for name, theirs, ours
                         in zip(FINGERPRINT_FIELDS, hd.fingerprint, fp) if theirs != ours)
        raise StateFileError(path, f"REFUSING: {path} was written by a different model "
                                   f"architecture.\n  Restoring it would produce fluent, "
                                   f"wrong output. (file vs this run: {diff})")
    if hd.n_bound != geo.n_bound or hd.n_mla != geo.n_mla:
        raise StateFileError(path, f"REFUSING: {path} holds {hd.n_bound} bound layers and "
                                   f"{hd.n_mla} MLA layers, this run has {geo.n_bound} "
                                   f"and {geo.n_mla}")
    if hd.cached > capacity:
        raise StateFileError(path, f"REFUSING: {path} holds {hd.cached} positions, this "
                                   f"run's KV cache is {capacity}.\n  Raise --gen or "
                                   f"shorten the prompt.")
    # Implied by the fingerprint in any intact file; checked because a damaged header
    # would otherwise direct reads of the wrong sizes into the state's arrays.
    if (hd.kper, hd.kvpp, hd.ropepp) != (geo.kper, geo.kvpp, geo.ropepp):
        raise StateFileError(path, f"REFUSING: {path} stores {hd.kper} state floats per "
                                   f"layer, {hd.kvpp} KV and {hd.ropepp} rope floats per "
                                   f"position; this run has {geo.kper}, {geo.kvpp} and "
                                   f"{geo.ropepp}")


def _read_full(f, buf: memoryview) -> bool:
    """Fill `buf` from `f`; False on end of file first (readinto may return short)."""
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            return False
        got += n
    return True


def _verify_payload(f, path: str, hd: StateHeader) -> np.ndarray:
    """First pass: read the whole payload, check every read comes back full, then the
    hash; return the ids.  Nothing is written into the target state here, and the
    payload is streamed through one chunk buffer, not held (it is 0.63 GB + KV at full
    scale)."""
    # Sizes come from the header: check them against the file before allocating by
    # them, so a damaged count cannot ask for gigabytes.  The reads still check too.
    _check_size(f, path, hd)
    f.seek(HEADER_SIZE)
    sizes = hd.region_sizes()
    chunk = memoryview(bytearray(max(8, min(_READ_CHUNK, max(sizes[1:])))))
    hasher = _RegionHasher()
    ids_buf = bytearray(sizes[0])
    if not _read_full(f, memoryview(ids_buf)):
        raise StateFileError(path, f"{path} is truncated")
    hasher.update(ids_buf)
    hasher.end_region()
    for size in sizes[1:]:
        left = size
        while left:
            part = chunk[:min(left, len(chunk))]
            if not _read_full(f, part):
                raise StateFileError(path, f"{path} is truncated")
            hasher.update(part)
            left -= len(part)
        hasher.end_region()
    if f.read(1):
        raise StateFileError(path, f"{path} is longer than its header declares "
                                   f"({hd.file_bytes} bytes)")
    # Only now is the file known to have the right shape; this is the check that sees a
    # wrong byte, which would otherwise restore cleanly and decode fluently.
    if hasher.value != hd.payload_hash:
        raise StateFileError(path, f"REFUSING: {path} does not match the hash its header "
                                   f"declares\n  (header {hd.payload_hash:016x}, contents "
                                   f"{hasher.value:016x}). The payload is damaged;\n  "
                                   f"restoring it would produce fluent, wrong output.")
    return np.frombuffer(bytes(ids_buf), dtype="<i4")


def _restore(f, path: str, hd: StateHeader, state: SequenceState) -> None:
    """Second pass: read the verified payload straight into the state's arrays (the MLA
    rows through a staging buffer of a few hundred positions, from which they go to the
    cache's key blocks and value planes).  The file is the same open inode the first pass
    verified, and saves publish by rename, never rewrite in place, so these reads see the
    same bytes."""
    f.seek(HEADER_SIZE + 4 * hd.nseq)

    def read_into(a: np.ndarray) -> None:
        if not _read_full(f, _as_bytes(a)):
            # Only an in-place rewrite during the load gets here; a half-restored state
            # must not be used, so leave it fresh instead.
            state.reset()
            raise StateFileError(path, f"{path} changed while it was being loaded; "
                                       "the state was reset")

    for st in state.layers:
        if isinstance(st, KDAState):
            for a in (st.S, st.conv_q, st.conv_k, st.conv_v):
                read_into(a)
        else:
            f.seek(4 * hd.kper, os.SEEK_CUR)  # an MLA layer's (zero) recurrent slot
    mla = [st for st in state.layers if isinstance(st, MLAState)]
    # Position-major rows land in the first `cached` positions whatever the capacity.
    for put, width in ((MLAState.set_rows, hd.kvpp), (MLAState.set_rope, hd.ropepp)):
        stage = np.empty((min(_ROWS_PER_PIECE, hd.cached), width), np.float32)
        for st in mla:
            for p in range(0, hd.cached, _ROWS_PER_PIECE):
                rows = stage[:min(_ROWS_PER_PIECE, hd.cached - p)]
                read_into(rows)
                put(st, p, rows)
    state.n_cached = hd.cached


def load_state(path: str | os.PathLike, state: SequenceState,
               fingerprint: Sequence[int] | None = None) -> list[int]:
    """Restore `path` into `state` (whose capacity may exceed the saved positions) and
    return the token sequence.

    Every refusal of §6.9 (not a state file, other version, other architecture, other
    layer counts, cache too small, truncated, damaged payload or header hash) raises
    StateFileError before the state is modified: the whole payload is read and hashed
    first, then read again into the state's arrays.  Rows past the restored positions
    are left as they were.  `fingerprint` defaults to (and must equal)
    model_fingerprint(state.cfg).
    """
    path = os.fspath(path)
    fp = _resolve_fingerprint(state, fingerprint)
    geo = _geometry(state)
    with _open_for_reading(path) as f:
        hd = _read_header(f, path)
        _check_compatible(path, hd, fp, geo, state.capacity)
        ids = _verify_payload(f, path, hd)
        _restore(f, path, hd, state)
    return ids.tolist()
