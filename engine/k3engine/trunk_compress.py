"""The compressed trunk (docs/trunk-compress.md): a lossless copy of trunk.bin with every
large BF16 tensor's exponent byte Huffman-coded (sign + mantissa stored raw), read and
decoded block by block on the trunk's reader threads into the same ring slots and pinned
buffers the plain reads fill -- the same bytes, fewer of them from the disk.

Files, beside an unchanged trunk.bin + trunk.json (the reference reads those):
* `trunk.k3z`: 4096-aligned blocks, each `raw` (the bytes) or `hx8` (kernels/k3z.h);
* `trunk.k3z.json`: which bytes of which layer each block decodes to, a check per block
  and a SHA-256 per layer (its own digest, for `k3 doctor --verify`).  Each layer names
  the SHA-256 trunk.json records for the layer's plain bytes: a compressed file made
  from another pack of trunk.bin is never read in its place.

Silent-failure traps handled here (tests in tests/test_trunk_compress.py):
* a compressed file left from another pack (a re-pack of another model, a kill between
  the two renames): bound to trunk.json's per-layer digests and to its own file size,
  refused at open, and the trunk reads trunk.bin;
* a damaged block (flipped byte, zeros, truncation after open): the decoder's bounds and
  the per-block check refuse it; the layer is re-read from trunk.bin and the run goes on
  with plain reads (warned, naming the file), so a damaged optional file costs speed,
  never a token;
* compression where decoding does not outrun the device (slower than plain reads):
  chosen per machine from a measured decode rate against the device rate.
"""
from __future__ import annotations

import hashlib
import heapq
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .atomic import open_nofollow, publish_with_manifest, remove_stale
from .diskio import ALIGN, AlignedBuffer, align_up, open_for_streaming, parallel_read, pread_into
from .inputfile import InputFileError, read_regular_file
from .kernels import _k3z as Z
from .strict_json import JSONFormatError, loads_strict

K3Z_BIN, K3Z_JSON = "trunk.k3z", "trunk.k3z.json"
FORMAT, VERSION = "k3z", 1
BLOCK_BYTES = 2 << 20          # raw bytes per block: several per layer, so the reader
                               # threads decode one layer in parallel
MIN_CODED = 4096               # smaller BF16 tensors stay raw (a 276-byte header each)
MAX_BLOCK = 64 << 20           # a manifest block larger than this is refused (scratch size)
MANIFEST_LIMIT = 256 << 20
CODECS = {"raw": Z.CODEC_RAW, "hx8": Z.CODEC_HX8}
MODE_ENV = "K3_TRUNK_COMPRESS"
MODES = ("auto", "on", "off")
CALIBRATION_BYTES = 64 << 20   # plain bytes read once at open to measure the device
PARTIAL_RE = re.compile(r"trunk\.k3z(?:\.json)?\.partial-(?P<pid>[0-9]+)")


class K3zError(Exception):
    """A compressed trunk that must not be read; the message names the file."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


# ---- the code -------------------------------------------------------------------------

def code_lengths(hist, maxlen: int = Z.MAXLEN) -> np.ndarray:
    """Huffman code lengths (<= maxlen bits) of the 256 exponent values from their counts.
    Over-long codes are cured by halving the counts (every used value keeps a count >= 1)
    and rebuilding: a few tenths of a percent from optimal on weight exponents."""
    freq = [int(c) for c in hist]
    used = [s for s in range(256) if freq[s]]
    lengths = np.zeros(256, np.uint8)
    if len(used) == 1:
        lengths[used[0]] = 1          # one value: one 1-bit code (the other code unused)
        return lengths
    while True:
        heap = [(freq[s], s, (s,)) for s in used]
        heapq.heapify(heap)
        depth = dict.fromkeys(used, 0)
        tie = 256
        while len(heap) > 1:
            f1, _, a = heapq.heappop(heap)
            f2, _, b = heapq.heappop(heap)
            for s in a + b:
                depth[s] += 1
            heapq.heappush(heap, (f1 + f2, tie, a + b))
            tie += 1
        if max(depth.values()) <= maxlen:
            for s, d in depth.items():
                lengths[s] = d
            return lengths
        freq = [(f + 1) // 2 for f in freq]


def encode_block(raw: bytes | memoryview, coded: bool) -> tuple[str, bytes]:
    """(codec, stored payload) of one block: hx8 when asked and smaller, else raw."""
    if coded and len(raw) >= 2 and len(raw) % 2 == 0:
        u = np.frombuffer(bytes(raw), np.uint16)
        lengths = code_lengths(Z.hist(u))
        out = np.empty(Z.hx8_bound(len(u)), np.uint8)
        n = Z.encode_hx8(u, lengths, out)
        if 0 < n < len(raw):
            return "hx8", out[:n].tobytes()
    return "raw", bytes(raw)


def block_plan(tensors: dict, nbytes: int, block_bytes: int = BLOCK_BYTES,
               min_coded: int = MIN_CODED) -> list[tuple[int, int, bool]]:
    """(raw_off, raw_nbytes, coded) blocks tiling a layer run [0, nbytes): each BF16
    tensor of at least `min_coded` bytes in coded blocks of <= block_bytes, everything
    else (F32/U8 tensors, small BF16, padding) merged into raw blocks."""
    if block_bytes < 2 or block_bytes % 2:
        raise ValueError(f"block size {block_bytes} must be a positive even byte count")
    segs: list[list] = []

    def add(lo: int, hi: int, coded: bool) -> None:
        if hi <= lo:
            return
        if segs and not coded and not segs[-1][2] and segs[-1][1] == lo:
            segs[-1][1] = hi
        else:
            segs.append([lo, hi, coded])
    cursor = 0
    for t in sorted(tensors.values(), key=lambda t: t.off):
        if not t.nbytes:
            continue
        add(cursor, t.off, False)
        add(t.off, t.off + t.nbytes, t.dtype == "BF16" and t.nbytes >= min_coded)
        cursor = max(cursor, t.off + t.nbytes)
    add(cursor, nbytes, False)
    return [(o, min(block_bytes, hi - o), coded)
            for lo, hi, coded in segs for o in range(lo, hi, block_bytes)]


# ---- packing --------------------------------------------------------------------------

def compress_trunk(trunk_dir: str, block_bytes: int = BLOCK_BYTES,
                   min_coded: int = MIN_CODED,
                   progress: Callable[[int, int, int], None] | None = None,
                   cancel: Callable[[], bool] | None = None) -> "CompressedTrunk":
    """Write trunk.k3z + trunk.k3z.json from the packed trunk in `trunk_dir`, each layer's
    plain bytes checked against trunk.json's digest first.  `progress(layers_done,
    raw_bytes_done, stored_bytes_done)`.  Atomic: both files complete before the renames,
    the manifest last; trunk.bin and trunk.json are only read."""
    from .trunk import TrunkManifest, PackCancelled
    m = TrunkManifest.load(trunk_dir)
    if any(layer.sha256 is None for layer in m.layers):
        raise K3zError(f"{os.path.join(trunk_dir, 'trunk.json')}: layers without a recorded "
                       f"digest (packed by an older pack-trunk); re-pack before compressing",
                       trunk_dir)
    notes = [f"removed {n}, left by an interrupted pack-trunk --compress"
             for n in remove_stale(trunk_dir, PARTIAL_RE)]
    zpath, jpath = os.path.join(trunk_dir, K3Z_BIN), os.path.join(trunk_dir, K3Z_JSON)
    tmp_z, tmp_j = f"{zpath}.partial-{os.getpid()}", f"{jpath}.partial-{os.getpid()}"
    doc = {"format": FORMAT, "version": VERSION, "block_bytes": block_bytes,
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
                        raise K3zError(f"{m.bin_path}: short read on layer {L}", m.bin_path)
                    if hashlib.sha256(run).hexdigest() != layer.sha256:
                        raise K3zError(f"{m.bin_path}: layer {L} does not match its recorded "
                                       f"SHA-256; re-pack the trunk before compressing it",
                                       m.bin_path)
                    digest = hashlib.sha256()
                    blocks, first = [], out.tell()
                    for raw_off, n, coded in block_plan(layer.tensors, layer.nbytes,
                                                        block_bytes, min_coded):
                        if cancel and cancel():
                            raise PackCancelled(f"{trunk_dir}: compression cancelled at "
                                                f"layer {L}", trunk_dir)
                        raw = memoryview(run)[raw_off:raw_off + n]
                        codec, payload = encode_block(raw, coded)
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
    ct = CompressedTrunk.load(trunk_dir, m)
    ct.notes = notes
    return ct


# ---- the manifest ---------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    raw_off: int
    raw_nbytes: int
    file_off: int
    stored_nbytes: int
    codec: int
    check: int


@dataclass(frozen=True)
class CompressedLayer:
    nbytes: int
    file_off: int
    stored_nbytes: int
    sha256: str
    blocks: tuple[Block, ...]


def _is_count(v) -> bool:
    return type(v) is int and 0 <= v < 1 << 62


_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_BLOCK_KEYS = {"raw_off", "raw_nbytes", "file_off", "stored_nbytes", "codec", "check"}


class CompressedTrunk:
    """trunk.k3z.json read strictly (hostile input: docs/hostile-input.md) and bound to
    the plain trunk's manifest."""

    def __init__(self, trunk_dir: str, layers: list[CompressedLayer], size: int):
        self.trunk_dir, self.layers, self.size = trunk_dir, layers, size
        self.notes: list[str] = []

    @property
    def path(self) -> str:
        return os.path.join(self.trunk_dir, K3Z_BIN)

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_nbytes for c in self.layers)

    @property
    def raw_bytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

    @property
    def scratch_bytes(self) -> int:
        """Per-thread scratch of the largest block (its stored bytes + exponents)."""
        return max((Z.scratch_bytes(b.stored_nbytes, b.raw_nbytes)
                    for c in self.layers for b in c.blocks), default=0)

    @staticmethod
    def present(trunk_dir: str) -> bool:
        return os.path.exists(os.path.join(trunk_dir, K3Z_JSON))

    @classmethod
    def load(cls, trunk_dir: str, trunk) -> "CompressedTrunk":
        """`trunk` is the plain TrunkManifest; raises K3zError naming the file."""
        jp, zp = os.path.join(trunk_dir, K3Z_JSON), os.path.join(trunk_dir, K3Z_BIN)

        def bad(problem: str) -> K3zError:
            return K3zError(f"{jp}: {problem}", jp)
        try:
            raw = loads_strict(read_regular_file(jp, MANIFEST_LIMIT, "trunk.k3z.json"), jp)
        except InputFileError as e:
            raise bad("missing" if e.missing else e.problem) from None
        except JSONFormatError as e:
            raise bad(f"not valid JSON ({e.problem})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise bad(f"not a {FORMAT} manifest (no \"format\": \"{FORMAT}\")")
        if raw.get("version") != VERSION:
            raise bad(f"version {raw.get('version')!r}; this reader reads version {VERSION}")
        if not isinstance(raw.get("layers"), list):
            raise bad("has no 'layers' array")
        try:
            st = os.stat(zp)
        except OSError:
            raise K3zError(f"{zp}: missing beside trunk.k3z.json", zp) from None
        if not stat.S_ISREG(st.st_mode):
            raise K3zError(f"{zp}: not a regular file", zp)
        if len(raw["layers"]) != len(trunk.layers):
            raise bad(f"describes {len(raw['layers'])} layers, trunk.json {len(trunk.layers)}")
        layers, fcur = [], 0
        for i, (e, plain) in enumerate(zip(raw["layers"], trunk.layers)):
            if not isinstance(e, dict) or not isinstance(e.get("blocks"), list) \
                    or not e["blocks"]:
                raise bad(f"layer {i} has no 'blocks' array")
            if plain.sha256 is None or e.get("raw_sha256") != plain.sha256 \
                    or e.get("nbytes") != plain.nbytes:
                raise bad(f"layer {i} was compressed from other bytes than trunk.json "
                          f"describes (another pack of trunk.bin): re-run k3 pack-trunk "
                          f"--compress")
            fo, sn, dg = e.get("file_off"), e.get("stored_nbytes"), e.get("sha256")
            if not (_is_count(fo) and _is_count(sn) and isinstance(dg, str)
                    and _HEX64.fullmatch(dg)):
                raise bad(f"layer {i}: file_off, stored_nbytes (JSON integers) or sha256 "
                          f"(64 lower-case hex digits) malformed")
            if fo != fcur:
                raise bad(f"layer {i} starts at {fo}, not where the previous layer ends "
                          f"({fcur})")
            blocks, rcur = [], 0
            for j, b in enumerate(e["blocks"]):
                where = f"layer {i} block {j}"
                if not isinstance(b, dict) or set(b) != _BLOCK_KEYS:
                    raise bad(f"{where}: expected exactly the keys {sorted(_BLOCK_KEYS)}")
                ro, rn, bo, bs = (b[k] for k in ("raw_off", "raw_nbytes", "file_off",
                                                 "stored_nbytes"))
                if not all(_is_count(v) for v in (ro, rn, bo, bs)):
                    raise bad(f"{where}: offsets and sizes must be non-negative JSON integers")
                codec = CODECS.get(b["codec"]) if isinstance(b["codec"], str) else None
                if codec is None:
                    raise bad(f"{where}: codec {b['codec']!r} is not one of {sorted(CODECS)}")
                if not (isinstance(b["check"], str) and _HEX16.fullmatch(b["check"])):
                    raise bad(f"{where}: check is not 16 lower-case hex digits")
                if ro != rcur:
                    raise bad(f"{where} decodes to offset {ro}, not {rcur}: the blocks must "
                              f"tile the layer in order")
                if not 0 < rn <= MAX_BLOCK or not 0 < bs <= MAX_BLOCK:
                    raise bad(f"{where}: size {rn} / stored {bs} outside (0, {MAX_BLOCK}]")
                if bo != fcur:
                    raise bad(f"{where}: stored at {bo}, not where the previous block ends "
                              f"({fcur})")
                if codec == Z.CODEC_RAW and bs != rn:
                    raise bad(f"{where}: a raw block of {rn} bytes cannot be stored in {bs}")
                if codec == Z.CODEC_HX8 and (rn % 2 or not Z.HEADER_BYTES + rn // 2 <= bs
                                             or bs > Z.hx8_bound(rn // 2)):
                    raise bad(f"{where}: an hx8 block of {rn} bytes cannot be {bs} bytes")
                blocks.append(Block(ro, rn, bo, bs, codec, int(b["check"], 16)))
                rcur += rn
                fcur += bs
            if rcur != plain.nbytes:
                raise bad(f"layer {i}: blocks cover {rcur} bytes, the layer is {plain.nbytes}")
            fcur = align_up(fcur)                        # the layer's padding
            if fo % ALIGN or sn != fcur - fo:
                raise bad(f"layer {i}: file_off {fo} must be a multiple of {ALIGN} and "
                          f"stored_nbytes {sn} its blocks padded to {ALIGN} ({fcur - fo})")
            layers.append(CompressedLayer(plain.nbytes, fo, sn, dg, tuple(blocks)))
        if fcur != st.st_size:
            raise K3zError(f"{zp} is {st.st_size} bytes, {jp} describes {fcur}: "
                           f"{'truncated' if st.st_size < fcur else 'another pack?'}", zp)
        return cls(trunk_dir, layers, st.st_size)


# ---- reading --------------------------------------------------------------------------

class CompressedReader:
    """Reads layers from trunk.k3z: each block read, decoded and checked by one nogil
    kernel call on a reader thread, blocks of a layer in parallel on the trunk's pool."""

    def __init__(self, ct: CompressedTrunk):
        self.ct = ct
        self.fd, self.direct = open_for_streaming(ct.path)
        self.scratch_bytes = align_up(max(ct.scratch_bytes, ALIGN))
        self._local = threading.local()
        self._scratch: list[AlignedBuffer] = []
        self._lock = threading.Lock()
        self.stored_bytes_read = 0

    def _buf(self) -> AlignedBuffer:
        b = getattr(self._local, "buf", None)
        if b is None:
            b = self._local.buf = AlignedBuffer(self.scratch_bytes)
            with self._lock:
                self._scratch.append(b)
        return b

    def _block(self, b: Block, dest: memoryview) -> int:
        return Z.read_block(self.fd, b.file_off, b.stored_nbytes, self._buf().view,
                            dest[b.raw_off:b.raw_off + b.raw_nbytes], b.codec, b.check)

    def read_layer(self, pool, L: int, dest: memoryview) -> str | None:
        """Fill dest (the layer's nbytes) from the compressed file; None, or the problem
        (naming the file, layer and block) when a block failed."""
        blocks = self.ct.layers[L].blocks
        if pool is None or len(blocks) == 1:
            status = [self._block(b, dest) for b in blocks]
        else:
            status = list(pool.map(lambda b: self._block(b, dest), blocks))
        for j, s in enumerate(status):
            if s != Z.OK:
                b = blocks[j]
                return (f"{self.ct.path}: layer {L} block {j} ({b.stored_nbytes} bytes at "
                        f"{b.file_off}): {Z.PROBLEM.get(s, s)}")
        with self._lock:
            self.stored_bytes_read += self.ct.layers[L].stored_nbytes
        return None

    def close(self) -> None:
        os.close(self.fd)
        for b in self._scratch:
            b.close()
        self._scratch.clear()


# ---- the choice: compressed or plain reads ----------------------------------------------

@dataclass(frozen=True)
class Choice:
    use: bool
    line: str
    ratio: float = 1.0              # stored / raw bytes of the compressed file
    decode_bps: float = 0.0         # raw bytes/s per thread with `threads` decoding at once
    device_bps: float = 0.0
    threads: int = 0


def requested_mode(mode: str | None) -> str:
    """The mode asked for (argument, else $K3_TRUNK_COMPRESS, else auto)."""
    m = mode if mode is not None else (os.environ.get(MODE_ENV) or "auto")
    if m not in MODES:
        from .errors import UsageError
        raise UsageError(f"{MODE_ENV}={m!r}: expected one of {', '.join(MODES)}")
    return m


def planned_scratch(trunk_dir: str, manifest, threads: int, mode: str | None = None) -> int:
    """What the compressed copy's readers will allocate (CompressedReader: one scratch per
    reader thread, even when `auto` then measures plain reads faster): for the planner.  0
    without a usable trunk.k3z or with compression off (a damaged one is reported when the
    trunk opens; the plain reads then need no scratch)."""
    try:
        if requested_mode(mode) == "off" or not CompressedTrunk.present(trunk_dir):
            return 0
        ct = CompressedTrunk.load(trunk_dir, manifest)
    except (K3zError, OSError):
        return 0
    return threads * align_up(max(ct.scratch_bytes, ALIGN))


def measure_decode(reader: CompressedReader, pool, threads: int,
                   seconds: float = 0.05) -> float:
    """Raw bytes/s `threads` reader threads decode at once, wall clock, on the file's
    largest coded block of its first layers (read once, decoded repeatedly into one buffer
    per thread).  Wall time on purpose: decoding competes with the compute threads and
    with whatever else runs on the machine, and a loaded machine should read plain.  0 when
    the file has no coded block."""
    cand = [b for c in reader.ct.layers[:8] for b in c.blocks if b.codec == Z.CODEC_HX8]
    if not cand:
        return 0.0
    b = max(cand, key=lambda b: b.raw_nbytes)
    lo, win, pad = Z.read_window(b.file_off, b.stored_nbytes)
    src = AlignedBuffer(win)
    stored = src.view[pad:pad + b.stored_nbytes]
    dsts = [np.empty(b.raw_nbytes, np.uint8) for _ in range(threads)]
    try:
        if pread_into(reader.fd, src.view, lo) != win:
            return 0.0

        def work(dst) -> int:
            n, t_end = 0, time.perf_counter() + seconds
            while n < 2 or time.perf_counter() < t_end:
                if Z.decode_hx8(stored, dst) != Z.OK:
                    return -1
                n += 1
            return n
        t0 = time.perf_counter()
        counts = list(pool.map(work, dsts)) if threads > 1 else [work(dsts[0])]
        dt = time.perf_counter() - t0
        if min(counts) < 0:
            return 0.0
        return sum(counts) * b.raw_nbytes / dt if dt > 0 else float("inf")
    finally:
        stored.release()
        src.close()


def device_rate(trunk, reads, fd: int, io_threads: int) -> tuple[float, str]:
    """(bytes/s, where it came from) of plain trunk reads: the machine figures `k3 devbw`
    / the forecast cached for this device, else one timed read of up to 64 MiB of
    trunk.bin the way the trunk reads it (parallel chunks on the same descriptor)."""
    try:
        from .forecast import cached_machine_figures
        mf = cached_machine_figures(trunk.trunk_dir)
    except Exception:  # noqa: BLE001 - a damaged cache is as if absent
        mf = None
    if mf is not None:
        return mf.read_rate(io_threads), f"machine figures ({mf.source})"
    L = max(range(len(trunk.layers)), key=lambda i: trunk.layers[i].nbytes)
    n = min(trunk.layers[L].nbytes, CALIBRATION_BYTES)
    buf = AlignedBuffer(n)
    try:
        np.frombuffer(buf.view, np.uint8)[::ALIGN] = 0     # fault pages in before timing
        t0 = time.perf_counter()
        got = parallel_read(reads, fd, buf.view, trunk.layers[L].file_off)
        dt = time.perf_counter() - t0
    finally:
        buf.close()
    return (got / dt if dt > 0 and got else float("inf")), f"a {n / 1e6:.0f} MB read on open"


MARGIN = 1.1      # compressed must win by 10 %: its decode also takes CPU from compute


def compressed_wins(decode_all: float, ratio: float, device: float) -> bool:
    """Per layer of R raw bytes, plain reads cost R / device and compressed reads
    ratio R / device + R / decode_all (the reader threads read one block while decoding
    another), so compressed is faster iff decode_all (1 - ratio) > device."""
    return decode_all * (1 - ratio) > device * MARGIN


def choose(reader: CompressedReader, trunk, pool, reads, fd: int, io_threads: int,
           mode: str) -> Choice:
    """Compressed reads when they deliver layer bytes faster than plain reads
    (compressed_wins on this machine's measured figures); `on` / `off` skip the
    measurement.  `pool` runs the decoding threads, `reads` the plain reads (ReadPool)."""
    ct = reader.ct
    ratio = ct.stored_bytes / max(ct.raw_bytes, 1)
    what = f"{K3Z_BIN} ({ratio:.3f} of the plain bytes)"
    if mode == "off":
        return Choice(False, f"trunk reads: plain trunk.bin ({MODE_ENV}=off; {what} unused)",
                      ratio)
    if mode == "on":
        return Choice(True, f"trunk reads: compressed {what}, decoded on the reader threads "
                            f"({MODE_ENV}=on)", ratio)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    nt = max(1, min(io_threads, cpus))
    dec_all = measure_decode(reader, pool, nt)
    dev, source = device_rate(trunk, reads, fd, io_threads)
    use = compressed_wins(dec_all, ratio, dev)
    eff = 1 / (ratio / dev + 1 / dec_all) if dec_all > 0 and dev > 0 else 0.0
    dec = dec_all / nt
    figures = (f"decode {dec_all / 1e9:.2f} GB/s on {nt} threads, device {dev / 1e9:.2f} GB/s "
               f"({source}): compressed would deliver {eff / 1e9:.2f} GB/s of layer bytes")
    line = (f"trunk reads: compressed {what}, decoded on the reader threads; {figures}"
            if use else
            f"trunk reads: plain trunk.bin, decoding {what} does not outrun the device; "
            f"{figures}")
    return Choice(use, line, ratio, dec, dev, nt)
