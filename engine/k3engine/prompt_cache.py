"""Kept sequences that later requests continue (the server's prompt cache).

In memory: the most recently used sequences within a byte budget (at least one, the plan's
sequence); a request takes the one holding the longest prefix of its prompt (all of what it
fed, or a fork point), and gives it back when done.  On disk (optional): each sequence given
back is also written as a state file v2 (statefile: checksummed, 0600, atomic), named by a
digest of the model's identity, the engine's format version and the ids it fed, so a
restarted server -- or the app reopening a conversation -- finds the longest saved prefix of
a new prompt by hashing the prompt's prefixes, one pass.  The folder is capped in bytes
(oldest files go first); a file that is stale or damaged is refused by load_state and
deleted.  A state loaded from disk continues bit for bit as the full prefill would
(`tests/test_prompt_cache.py`).
"""
from __future__ import annotations

import hashlib
import os
import struct

from . import __version__
from .errors import EngineError
from .sequence import Sequence

__all__ = ["PromptCache", "SUFFIX"]

SUFFIX = ".k3st"
ID = struct.Struct("<I")


class PromptCache:
    def __init__(self, engine, max_bytes: int = 0, directory: str | None = None,
                 disk_bytes: int = 8 << 30):
        self.engine = engine
        self.max_bytes = max_bytes            # 0: one sequence, as the plan counts
        self.directory = directory
        self.disk_bytes = disk_bytes
        self.kept: list[Sequence] = []        # most recently used first
        self.loads = self.saves = 0           # disk traffic, for /health and the tests
        self._identity = _identity(engine) if directory else b""
        if directory:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            os.chmod(directory, 0o700)

    # -- choosing -------------------------------------------------------------------------
    def take(self, prompt: list[int]) -> Sequence:
        """The kept sequence that reuses the most of `prompt` (removed from the cache until
        `give_back`), a sequence loaded from disk when that holds more, else a new one."""
        best, reuse = None, 0
        for seq in self.kept:
            n = seq.reusable(prompt)
            if n > reuse:
                best, reuse = seq, n
        if self.directory:
            loaded = self._load_longest(prompt, reuse)
            if loaded is not None:
                return loaded
        if best is None:
            return self.engine.sequence()
        self.kept.remove(best)
        return best

    def give_back(self, seq: Sequence) -> None:
        """Keep `seq` (newest first) if its state is usable; evict past the budget."""
        if not seq.usable:
            return
        self.kept.insert(0, seq)
        while len(self.kept) > 1 and (self.max_bytes <= 0 or
                                      sum(s.nbytes() for s in self.kept) > self.max_bytes):
            self.kept.pop()
        if self.directory:
            self._save(seq)

    def sizes(self) -> dict:
        return dict(kept=len(self.kept), kept_bytes=sum(s.nbytes() for s in self.kept),
                    disk_loads=self.loads, disk_saves=self.saves)

    # -- disk -----------------------------------------------------------------------------
    def _prefix_keys(self, ids: list[int]):
        """(length, key) of every prefix of `ids`, longest last: one running hash (the
        key of ids[:n] is the digest of the identity and those n ids, however reached)."""
        h = hashlib.sha256(self._identity)
        for n, i in enumerate(ids, 1):
            h.update(ID.pack(i))
            yield n, h.copy().hexdigest()[:40]

    def _key_of(self, ids: list[int]) -> str:
        h = hashlib.sha256(self._identity)
        h.update(b"".join(ID.pack(i) for i in ids))
        return h.hexdigest()[:40]

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + SUFFIX)

    def _save(self, seq: Sequence) -> None:
        fed = seq.ids[:seq.position]
        if not fed:
            return
        path = self._path(self._key_of(fed))
        if os.path.exists(path):
            os.utime(path)                    # recently used: the cap keeps it longer
            return
        try:
            seq.save(path)
            self.saves += 1
        except (EngineError, OSError):
            return                            # a full disk costs the cache, not the answer
        self._cap()

    def _load_longest(self, prompt: list[int], better_than: int) -> Sequence | None:
        try:
            names = set(os.listdir(self.directory))
        except OSError:
            return None
        found = None
        for n, key in self._prefix_keys(prompt[:-1]):   # a prompt never reuses all of itself
            if n > better_than and key + SUFFIX in names:
                found = (n, key)
        if found is None:
            return None
        n, key = found
        path = self._path(key)
        try:
            seq, _ = self.engine.resume(path, len(prompt) - n + 1)
        except (EngineError, OSError):
            _remove(path)                     # stale (another model) or damaged: never trusted
            return None
        if seq.ids[:seq.position] != prompt[:n]:
            _remove(path)                     # a digest collision or a renamed file
            return None
        self.loads += 1
        os.utime(path)
        return seq

    def _cap(self) -> None:
        """Oldest files go first until the folder is within its byte cap."""
        try:
            entries = [(e.stat().st_mtime_ns, e.stat().st_size, e.path)
                       for e in os.scandir(self.directory)
                       if e.name.endswith(SUFFIX) and e.is_file(follow_symlinks=False)]
        except OSError:
            return
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.disk_bytes:
                break
            _remove(path)
            total -= size


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _identity(engine) -> bytes:
    """What a saved state belongs to: the model's fingerprint and bound layers, its shards
    (names, sizes, modification times) and the engine's version (the state's layout)."""
    from .statefile import VERSION, model_fingerprint
    parts = [f"k3 {__version__} state v{VERSION} layers {engine.nl}",
             ",".join(map(str, model_fingerprint(engine.cfg)))]
    for path in sorted(engine.setup.ck.shards):
        st = os.stat(path)
        parts.append(f"{os.path.basename(path)} {st.st_size} {st.st_mtime_ns}")
    return "\n".join(parts).encode()
