"""Atomic file publication: a file we save appears under its final name only when it is
complete (temp file in the same directory, write, fsync, rename), so a crash or a failed
write never leaves half a file and never damages the previous one."""
from __future__ import annotations

import os


def fsync_dir(directory: str) -> None:
    """Make a rename itself durable.  Best effort: the file is already complete, and some
    filesystems refuse fsync on a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, mode: int = 0o666) -> None:
    """`mode` (before the umask) is the new file's: 0o600 for files holding conversation
    content, set when the temp file is created so the content is never readable by others."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        if os.path.exists(tmp):
            os.unlink(tmp)      # a stale temp of ours keeps its old mode otherwise
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(d)
