"""Atomic file publication: a file we save appears under its final name only when it is
complete (temp file in the same directory, write, fsync, rename), so a crash or a failed
write never leaves half a file and never damages the previous one.

Everything this writer makes is 0600 (issue 14): --out, --dump-logits, histories and state
files can hold the conversation or what decodes back into it.  A temp file of ours left by
a killed process (`.NAME.tmp-PID`, PID no longer running) is removed by the next save of
the same file, so kill -9 mid-save does not leave litter that grows.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat

PRIVATE = 0o600


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


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def stale_temps(directory: str, pattern: re.Pattern) -> list[str]:
    """Names in `directory` matching `pattern` (whose group 'pid' is the writer's pid) left
    by a process that no longer runs."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for n in names:
        m = pattern.fullmatch(n)
        if m and int(m.group("pid")) != os.getpid() and not pid_alive(int(m.group("pid"))):
            out.append(n)
    return sorted(out)


def remove_stale(directory: str, pattern: re.Pattern) -> list[str]:
    """Remove stale temps (see stale_temps); returns the names removed."""
    gone = []
    for n in stale_temps(directory, pattern):
        try:
            os.unlink(os.path.join(directory, n))
            gone.append(n)
        except OSError:
            pass
    return gone


def _temp_pattern(base: str) -> re.Pattern:
    return re.compile(re.escape(f".{base}.tmp-") + r"(?P<pid>[0-9]+)")


def open_private(path: str, mode: str = "w", **kw):
    """open() for a file that may hold conversation content: created 0600, and an existing
    file is narrowed to 0600 before anything is written into it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                 PRIVATE)
    try:
        os.fchmod(fd, PRIVATE)
    except OSError:
        pass                    # not ours to change (e.g. /dev/null): the data goes anyway
    return os.fdopen(fd, mode, **kw)


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask can only
    read by writing, which races with any thread creating files meanwhile)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_target(path: str) -> str:
    """Where a save of `path` may rename its complete temp file to: a symlink is followed (the
    link stays a link to the saved file), and an existing non-regular file is refused.
    Silent-failure trap: rename replaces whatever has the name, so `--save-state /dev/full`
    run as root replaced the device node with a regular file and exited 0."""
    path = os.fspath(path)
    if os.path.islink(path):
        path = os.path.realpath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EEXIST, "exists and is not a regular file; refusing to replace it",
                      path)
    return path


def write_atomic(path: str, data: bytes, mode: int = PRIVATE) -> None:
    path = publish_target(path)
    d = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    remove_stale(d, _temp_pattern(base))
    tmp = os.path.join(d, f".{base}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                     mode)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode & ~_umask())   # explicit modes still honour the umask
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    fsync_dir(d)


def publish_with_manifest(tmp_data: str, data_path: str, manifest: dict, tmp_manifest: str,
                          manifest_path: str, keep_old_manifest: bool = False) -> None:
    """Publish a complete data file (written and fsynced at `tmp_data`) with its JSON
    manifest: the manifest is written and fsynced at `tmp_manifest`, then two renames, data
    first.  A kill between them leaves the old manifest beside the new data, so the old
    manifest is removed first unless `keep_old_manifest` (the caller checked it describes
    the new bytes exactly); then a kill leaves data without a manifest, never an old
    manifest over new data (trunk.pack_trunk, trunk_compress.compress_trunk)."""
    with open(tmp_manifest, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    if not keep_old_manifest and os.path.exists(manifest_path):
        os.unlink(manifest_path)
    os.replace(tmp_data, data_path)
    os.replace(tmp_manifest, manifest_path)
    fsync_dir(os.path.dirname(os.path.abspath(data_path)))
