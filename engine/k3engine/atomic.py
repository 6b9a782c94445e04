"""Atomic file publication: a file we save appears under its final name only when it is
complete (temp file in the same directory, write, fsync, rename), so a crash or a failed
write never leaves half a file and never damages the previous one.

Everything this writer makes is 0600 (issue 14): --out, --dump-logits, histories and state
files can hold the conversation or what decodes back into it.  A temp file of ours left by
a killed process (`.NAME.tmp-PID`, PID no longer running) is removed by the next save of
the same file, so kill -9 mid-save does not leave litter that grows.

Links (issue 47): a file is never opened through a symlink the project did not create.
Temp files are created O_EXCL|O_NOFOLLOW (a planted `.NAME.tmp-PID` link is never
followed), and a writer working in a folder of its own (`inside=`: DEST/.k3-download, the
app's data folders, caches) opens every directory below that folder and the file itself
with O_NOFOLLOW under a directory descriptor, so a link planted anywhere below it is
refused (OSError ELOOP naming the path) instead of written through.  A path a person names
on the command line (`--out LINK`) still follows the link they made (publish_target).
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat

PRIVATE = 0o600
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC


def _link_error(path: str, inside: str) -> OSError:
    return OSError(errno.ELOOP, f"is a symbolic link (or not a directory) inside {inside}; "
                                "refusing to write through it", path)


def open_dir(directory: str | os.PathLike, inside: str | os.PathLike | None = None,
             create: bool = False, mode: int = 0o700) -> int:
    """A descriptor of `directory`.  With `inside` (a folder at or above it, the writer's
    own), every component below `inside` is opened O_NOFOLLOW (and made with `mode` when
    `create`), so a symlink planted there is refused rather than followed; `inside` itself
    is the caller's choice and may be a link."""
    directory = os.path.abspath(os.fspath(directory))
    if inside is None:
        if create:
            os.makedirs(directory, mode, exist_ok=True)
        return os.open(directory, _DIR)
    inside = os.path.abspath(os.fspath(inside))
    rel = os.path.relpath(directory, inside)
    if rel == os.curdir:
        parts = []
    elif rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise ValueError(f"{directory} is not inside {inside}")
    else:
        parts = rel.split(os.sep)
    if create:
        os.makedirs(inside, mode, exist_ok=True)
    fd = os.open(inside, _DIR)
    here = inside
    try:
        for part in parts:
            here = os.path.join(here, part)
            if create:
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(part, _DIR | NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _link_error(here, inside) from None
                raise OSError(e.errno, e.strerror, here) from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = PRIVATE,
                  inside: str | os.PathLike | None = None, exclusive: bool = False) -> int:
    """os.open(path, flags | O_NOFOLLOW) under open_dir(dirname, inside): a link at the
    name or (with `inside`) in a folder below `inside` is refused with ELOOP naming it.
    Only a regular file is accepted (a FIFO would block, a device would take the bytes).
    `exclusive`: a fresh file (O_CREAT|O_EXCL); a leftover at the name (a temp of a killed
    run with our pid, or a planted link) is unlinked, never followed, and the create
    retried once."""
    path = os.path.abspath(os.fspath(path))
    dfd = open_dir(os.path.dirname(path), inside)
    try:
        return _open_at(dfd, os.path.basename(path), flags, mode, exclusive, path)
    finally:
        os.close(dfd)


def _open_at(dfd: int, base: str, flags: int, mode: int, exclusive: bool, path: str) -> int:
    flags |= NOFOLLOW | CLOEXEC | os.O_NONBLOCK
    if exclusive:
        flags |= os.O_CREAT | os.O_EXCL
    for attempt in (0, 1):
        try:
            fd = os.open(base, flags, mode, dir_fd=dfd)
            break
        except FileExistsError:
            if not exclusive or attempt:
                raise
            os.unlink(base, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "is a symbolic link; refusing to write through it",
                              path) from None
            raise OSError(e.errno, e.strerror, path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EEXIST, "exists and is not a regular file; refusing to write "
                                    "into it", path)
    return fd


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


def stale_temps(directory: str | int, pattern: re.Pattern) -> list[str]:
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


def remove_stale(directory: str | int, pattern: re.Pattern) -> list[str]:
    """Remove stale temps (see stale_temps; `directory` a path or a descriptor); returns the
    names removed."""
    gone = []
    for n in stale_temps(directory, pattern):
        try:
            if isinstance(directory, int):
                os.unlink(n, dir_fd=directory)
            else:
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


def write_atomic(path: str | os.PathLike, data: bytes, mode: int = PRIVATE,
                 inside: str | os.PathLike | None = None) -> None:
    """`inside`: the writer's own folder (see the module docstring): a link at `path` or in
    a folder between `inside` and it is refused, not followed."""
    path = os.path.abspath(os.fspath(path))
    if inside is None:
        path = publish_target(path)
    d, base = os.path.dirname(path), os.path.basename(path)
    dfd = open_dir(d, inside)
    tmp = f".{base}.tmp-{os.getpid()}"
    try:
        if inside is not None:
            _refuse_link(dfd, base, path)
        remove_stale(dfd, _temp_pattern(base))
        fd = _open_at(dfd, tmp, os.O_WRONLY, mode, True, os.path.join(d, tmp))
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode & ~_umask())   # explicit modes still honour the umask
                view = memoryview(data)
                while view:
                    view = view[f.write(view):]
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
        try:
            os.fsync(dfd)            # the rename itself durable (best effort, as fsync_dir)
        except OSError:
            pass
    finally:
        os.close(dfd)


def _refuse_link(dfd: int, base: str, path: str) -> None:
    try:
        st = os.stat(base, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "is a symbolic link; refusing to write through it", path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EEXIST, "exists and is not a regular file; refusing to replace it",
                      path)


def publish_with_manifest(tmp_data: str, data_path: str, manifest: dict, tmp_manifest: str,
                          manifest_path: str, keep_old_manifest: bool = False) -> None:
    """Publish a complete data file (written and fsynced at `tmp_data`) with its JSON
    manifest: the manifest is written and fsynced at `tmp_manifest`, then two renames, data
    first.  A kill between them leaves the old manifest beside the new data, so the old
    manifest is removed first unless `keep_old_manifest` (the caller checked it describes
    the new bytes exactly); then a kill leaves data without a manifest, never an old
    manifest over new data (trunk.pack_trunk, trunk_compress.compress_trunk)."""
    fd = open_nofollow(tmp_manifest, os.O_WRONLY, 0o666, exclusive=True)   # umask applies
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    if not keep_old_manifest and os.path.exists(manifest_path):
        os.unlink(manifest_path)
    os.replace(tmp_data, data_path)
    os.replace(tmp_manifest, manifest_path)
    fsync_dir(os.path.dirname(os.path.abspath(data_path)))
