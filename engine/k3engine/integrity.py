"""Integrity the user can check (`k3 doctor --verify`): the packed trunk against the per-layer
SHA-256 digests pack-trunk records in trunk.json, and the checkpoint's shards against the
digests recorded when they were fetched (`k3 download`'s manifest) or generated
(`k3 make-checkpoint`'s sidecar).  Never on the hot path: it re-reads every byte.

A bit flipped inside tensor data is invisible to every format check (the header, sizes and
shapes stay valid, the run goes on with other ids); only these digests can see it.
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from typing import Callable

from .inputfile import InputFileError, MiB, read_regular_file
from .strict_json import JSONFormatError, loads_strict

__all__ = ["verify_trunk", "verify_shards", "recorded_shard_digests", "stale_files",
           "DIGEST_SIDECAR", "sha256_range"]

CHUNK = 8 * MiB
DIGEST_SIDECAR = "model.sha256"         # `sha256sum` format: "<hex>  <name>" per line
DOWNLOAD_MANIFEST = os.path.join(".k3-download", "manifest.json")
_LINE = re.compile(r"([0-9a-f]{64}) [ *]([^/\x00]+)")

Progress = Callable[[str], None]


def sha256_range(fd: int, offset: int, nbytes: int, buf: bytearray) -> str:
    h = hashlib.sha256()
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[:min(len(buf), nbytes - done)]], offset + done)
        if n <= 0:
            break                         # short file: the digest will not match
        h.update(view[:n])
        done += n
    return h.hexdigest()


def verify_trunk(trunk_dir: str, say: Progress) -> list[str]:
    """Problems found (empty: every layer matches its digest).  A trunk packed before
    digests were recorded is reported as such, not as damaged."""
    from .trunk import TRUNK_BIN, TrunkError, TrunkManifest
    try:
        m = TrunkManifest.load(trunk_dir)
    except TrunkError as e:
        return [str(e)]
    bp = os.path.join(trunk_dir, TRUNK_BIN)
    missing = [L for L, layer in enumerate(m.layers) if layer.sha256 is None]
    if missing:
        return [f"{os.path.join(trunk_dir, 'trunk.json')}: {len(missing)} of {len(m.layers)} "
                f"layers have no recorded digest (packed before digests were recorded): "
                f"re-pack with k3 pack-trunk to make it verifiable"]
    problems = []
    buf = bytearray(CHUNK)
    t0, total = time.monotonic(), 0
    fd = os.open(bp, os.O_RDONLY)
    try:
        for L, layer in enumerate(m.layers):
            got = sha256_range(fd, layer.file_off, layer.nbytes, buf)
            total += layer.nbytes
            ok = got == layer.sha256
            say(f"  {'OK  ' if ok else 'BAD '} layer {L} ({L + 1} of {len(m.layers)}, "
                f"{layer.nbytes:,} bytes at {layer.file_off:,})"
                + ("" if ok else f": sha256 {got}, recorded {layer.sha256}"))
            if not ok:
                problems.append(f"{bp}: layer {L} (bytes {layer.file_off:,}..."
                                f"{layer.file_off + layer.nbytes:,}) does not match its "
                                f"recorded SHA-256: the trunk is damaged; re-pack it")
    finally:
        os.close(fd)
    secs = time.monotonic() - t0
    say(f"  trunk: {len(m.layers) - len(problems)} of {len(m.layers)} layers verified, "
        f"{total / 1e9:.2f} GB in {secs:.1f} s")
    return problems + verify_compressed(trunk_dir, m, say)


def verify_compressed(trunk_dir: str, m, say: Progress) -> list[str]:
    """The compressed trunk (pack-trunk --compress), when there is one: its manifest, bound
    to trunk.json, and every layer's stored bytes against its recorded SHA-256."""
    from .trunk_compress import K3zError, CompressedTrunk
    if not CompressedTrunk.present(trunk_dir):
        return []
    try:
        ct = CompressedTrunk.load(trunk_dir, m)
    except K3zError as e:
        return [f"{e} (runs read trunk.bin instead; re-run k3 pack-trunk --compress)"]
    problems = []
    buf = bytearray(CHUNK)
    fd = os.open(ct.path, os.O_RDONLY)
    try:
        for L, c in enumerate(ct.layers):
            ok = sha256_range(fd, c.file_off, c.stored_nbytes, buf) == c.sha256
            say(f"  {'OK  ' if ok else 'BAD '} compressed layer {L} ({c.stored_nbytes:,} "
                f"bytes at {c.file_off:,})")
            if not ok:
                problems.append(f"{ct.path}: layer {L} does not match its recorded SHA-256: "
                                f"the compressed trunk is damaged (runs fall back to "
                                f"trunk.bin); re-run k3 pack-trunk --compress")
    finally:
        os.close(fd)
    say(f"  compressed trunk: {len(ct.layers) - len(problems)} of {len(ct.layers)} layers "
        f"verified, {ct.stored_bytes / 1e9:.2f} GB")
    return problems


def recorded_shard_digests(model_dir: str) -> tuple[dict[str, str], str | None]:
    """({shard name: sha256}, where they came from) from the download manifest, else the
    make-checkpoint sidecar; ({}, None) when neither exists."""
    man = os.path.join(model_dir, DOWNLOAD_MANIFEST)
    if os.path.exists(man):
        try:
            doc = loads_strict(read_regular_file(man, 64 * MiB, "download manifest"), man)
            return ({f["name"]: f["sha256"].lower() for f in doc["files"]
                     if isinstance(f, dict) and isinstance(f.get("sha256"), str)
                     and isinstance(f.get("name"), str)}, man)
        except (InputFileError, JSONFormatError, KeyError, TypeError, AttributeError):
            pass
    side = os.path.join(model_dir, DIGEST_SIDECAR)
    if os.path.exists(side):
        try:
            text = read_regular_file(side, 16 * MiB, "digest file").decode("utf-8")
        except (InputFileError, UnicodeDecodeError):
            return {}, None
        out = {}
        for line in text.splitlines():
            mt = _LINE.fullmatch(line.strip())
            if mt:
                out[mt.group(2)] = mt.group(1)
        return out, side
    return {}, None


def verify_shards(model_dir: str, say: Progress) -> tuple[list[str], str]:
    """(problems, what was checked).  Without recorded digests only the headers are
    checked (by the caller's Checkpoint), and the answer says so."""
    digests, source = recorded_shard_digests(model_dir)
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not digests:
        return [], (f"no recorded shard digests in {model_dir} (neither {DOWNLOAD_MANIFEST} "
                    f"nor {DIGEST_SIDECAR}): shard contents not verified")
    problems = []
    buf = bytearray(CHUNK)
    t0, total = time.monotonic(), 0
    for i, n in enumerate(names, 1):
        path = os.path.join(model_dir, n)
        want = digests.get(n)
        if want is None:
            problems.append(f"{path}: no recorded digest in {source}")
            say(f"  ??   shard {n} ({i} of {len(names)}): no recorded digest")
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            got = sha256_range(fd, 0, size, buf)
        finally:
            os.close(fd)
        total += size
        ok = got == want
        say(f"  {'OK  ' if ok else 'BAD '} shard {n} ({i} of {len(names)}, {size:,} bytes)"
            + ("" if ok else f": sha256 {got}, recorded {want}"))
        if not ok:
            problems.append(f"{path} does not match its recorded SHA-256 ({source}): the "
                            f"shard is damaged; fetch it again")
    missing = sorted(set(digests) - set(names))
    missing = [n for n in missing if n.endswith(".safetensors")]
    problems += [f"{os.path.join(model_dir, n)}: recorded in {source} but missing"
                 for n in missing]
    say(f"  shards: {len(names) - len(problems)} of {len(names)} verified against {source}, "
        f"{total / 1e9:.2f} GB in {time.monotonic() - t0:.1f} s")
    return problems, f"{len(names)} shards against {source}"


# Temp and partial files our writers leave when killed: write_atomic's `.NAME.tmp-PID`,
# mkstemp's `NAME.tmp.XXXXXX` (older saves), pack-trunk's `trunk.*.partial-PID`, the
# safetensors writer's `NAME.tmp-PID`, and a download's `.k3-download/*.incomplete`
# (pack-trunk --compress leaves `trunk.k3z.partial-PID` and `trunk.k3z.json.partial-PID`).
_STALE = re.compile(r"(?:\..+\.tmp-[0-9]+|.+\.tmp\.[A-Za-z0-9_]{6,}"
                    r"|trunk\.(?:bin|json|k3z|k3z\.json)\.partial-[0-9]+"
                    r"|.+\.safetensors\.tmp-[0-9]+)")


def stale_files(directory: str) -> list[tuple[str, int]]:
    """(path, bytes) of our temp/partial files in `directory` (and its .k3-download/)."""
    out = []
    for d, pat in ((directory, _STALE), (os.path.join(directory, ".k3-download"),
                                         re.compile(r".+\.incomplete"))):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in sorted(names):
            if pat.fullmatch(n):
                p = os.path.join(d, n)
                try:
                    out.append((p, os.lstat(p).st_size))
                except OSError:
                    pass
    return out
