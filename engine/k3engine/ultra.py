"""--ultra-low-memory model tables (SYSTEM §5.6): the embedding and the lm_head stay on
disk.  An embedding row is read per position; the lm_head is applied in ~4 MiB chunks of
rows, each read into one aligned buffer and multiplied with the same matvec kernel, so the
logits are the same bits as with the resident tables (each row's dot product is
independent of the chunking)."""
from __future__ import annotations

import os
import time

import numpy as np

from . import kernels as K
from .checkpoint import Checkpoint, CheckpointError, widen_bf16
from .config import ModelConfig
from .diskio import ALIGN, AlignedBuffer, open_for_streaming, read_window
from .names import model_tensors
from .weights import fold_phi

STREAM_BYTES = 4 << 20                  # one read; the buffer adds two alignment pages


class StreamedTables:
    def __init__(self, ck: Checkpoint, cfg: ModelConfig, binder):
        d = {t.key: t for t in model_tensors(cfg)}
        v = lambda key: binder.vector(d[key], ck)                  # noqa: E731
        self.final_norm = v("norm.weight")                         # the resident part
        self.phi_out = fold_phi(v("output_attn_res_norm.weight"),
                                v("output_attn_res_proj.weight"))
        self.embed_info = ck.info(d["embed_tokens.weight"].name)
        self.head_info = ck.info(d["lm_head.weight"].name)
        for info in (self.embed_info, self.head_info):
            if info.dtype != "BF16" or tuple(info.shape) != (cfg.vocab, cfg.hidden):
                raise CheckpointError(f"{info.path}: {info.name} is {info.dtype} "
                                      f"{list(info.shape)}; ultra streams BF16 "
                                      f"[{cfg.vocab}, {cfg.hidden}]", info.path, info.name)
        self.E, self.V = cfg.hidden, cfg.vocab
        self.row_bytes = self.E * 2
        self.rows_per_read = max(1, STREAM_BYTES // self.row_bytes)
        self.buf = AlignedBuffer(STREAM_BYTES + 2 * ALIGN)
        self._fds: dict[str, tuple[int, bool]] = {}
        self.embedding_bytes = self.lm_head_bytes = 0
        self.read_seconds = 0.0

    def _fd(self, path: str) -> tuple[int, bool]:
        if path not in self._fds:
            self._fds[path] = open_for_streaming(path)
        return self._fds[path]

    def _rows(self, info, first: int, n: int) -> np.ndarray:
        fd, direct = self._fd(info.path)
        t0 = time.monotonic()
        try:
            payload = read_window(fd, direct, self.buf, info.offset + first * self.row_bytes,
                                  n * self.row_bytes, elem=2)
        except OSError as e:
            raise CheckpointError(f"{info.path}: {info.name} rows {first}..{first + n - 1}: "
                                  f"{e}", info.path, info.name) from None
        self.read_seconds += time.monotonic() - t0
        return np.frombuffer(payload, dtype=np.uint16).reshape(n, self.E)

    def embed_into(self, ids: np.ndarray, out: np.ndarray) -> None:
        for t, i in enumerate(ids):
            if not 0 <= i < self.V:
                raise ValueError(f"token id {i} is outside the vocabulary of {self.V}")
            out[t] = widen_bf16(self._rows(self.embed_info, int(i), 1)[0])
            self.embedding_bytes += self.row_bytes

    def project(self, x: np.ndarray) -> np.ndarray:
        logits = np.empty((x.shape[0], self.V), dtype=np.float32)
        part = np.empty((x.shape[0], self.rows_per_read), dtype=np.float32)
        for r0 in range(0, self.V, self.rows_per_read):
            n = min(self.rows_per_read, self.V - r0)
            rows = self._rows(self.head_info, r0, n)
            out = part if n == part.shape[1] else np.empty((x.shape[0], n), dtype=np.float32)
            K.matvec(rows, x, out)
            logits[:, r0:r0 + n] = out
            self.lm_head_bytes += n * self.row_bytes
        return logits

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
