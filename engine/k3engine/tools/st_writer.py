"""Streaming safetensors writer: the header is computed from the tensor list first, then
tensors are produced and written one at a time, so a multi-GB checkpoint never sits in
memory.  Files appear under their final name only when complete (write + fsync + rename)."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from ..atomic import open_nofollow, remove_stale

DTYPE_SIZE = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPE_SIZE[self.dtype]


def header_bytes(specs: Iterable[TensorSpec], metadata: dict | None = None) -> bytes:
    """JSON header for the tensors laid back to back in the given order, padded with
    spaces to a multiple of 8 bytes (as the Hugging Face writer does)."""
    hdr: dict = {}
    if metadata:
        hdr["__metadata__"] = metadata
    off = 0
    for s in specs:
        hdr[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(path: str, specs: list[TensorSpec],
                      produce: Callable[[TensorSpec], np.ndarray],
                      metadata: dict | None = None,
                      progress: Callable[[int], None] | None = None,
                      digest=None) -> int:
    """Write `specs` in order, asking `produce(spec)` for each tensor's array.  Returns
    the file size; `digest` (a hashlib object) is fed every byte written."""
    hdr = header_bytes(specs, metadata)
    # a killed earlier write of this file left its temp (a shard can be GBs): remove it
    remove_stale(os.path.dirname(os.path.abspath(path)),
                 re.compile(re.escape(os.path.basename(path)) + r"\.tmp-(?P<pid>[0-9]+)"))
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        # O_EXCL|O_NOFOLLOW: a link planted at the guessable temp name is not written through
        with os.fdopen(open_nofollow(tmp, os.O_WRONLY, 0o666, exclusive=True), "wb") as f:
            def put(b) -> None:
                f.write(b)
                if digest is not None:
                    digest.update(b)
            put(len(hdr).to_bytes(8, "little"))
            put(hdr)
            for s in specs:
                arr = np.ascontiguousarray(produce(s))
                if arr.nbytes != s.nbytes:
                    raise ValueError(f"{s.name}: produced {arr.nbytes} bytes, header says {s.nbytes}")
                put(arr.tobytes() if arr.dtype.byteorder == ">" else memoryview(arr).cast("B"))
                if progress:
                    progress(s.nbytes)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
        return size
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
