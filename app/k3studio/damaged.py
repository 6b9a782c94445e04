"""The app's own files that cannot be read: moved aside, never deleted, said once.

Issue 47: one damaged file in the data folder (a meta.json of 1,000 `[`, a link to
/dev/zero, a FIFO, a settings file that is not a file) stopped K3 Studio at every start.
Every loader of the app's own files reads through `read_json_object` (a regular file, not a
link, at most LIMIT bytes, strict JSON: no recursion limit reachable from content, no lone
surrogate), and a file it refuses goes to `damaged/` beside it through `move_aside`, which
logs one line and queues one notice naming the file; the window shows each notice once
(ConversationsPanel) and everything else loads.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time
from typing import Callable

from k3engine.atomic import open_dir
from k3engine.inputfile import InputFileError, read_regular_file
from k3engine.strict_json import JSONFormatError, loads_strict

FOLDER = "damaged"
LIMIT = 16 << 20                  # far above any meta, key or settings file of ours

log = logging.getLogger("k3studio")
_pending: list[str] = []
_listeners: list[Callable[[str], bool]] = []


class DamagedFile(ValueError):
    """A file of ours that cannot be used; str() names the file and the problem."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


def check_regular(path: str, limit: int = LIMIT) -> bool:
    """False when `path` is absent; DamagedFile when it is a link, not a regular file or
    bigger than `limit` (checked without opening it: a FIFO never blocks here)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise DamagedFile(path, f"cannot be read ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise DamagedFile(path, "a symbolic link, not a file of ours")
    if not stat.S_ISREG(st.st_mode):
        raise DamagedFile(path, "not a regular file")
    if st.st_size > limit:
        raise DamagedFile(path, f"{st.st_size:,} bytes, more than the {limit:,} accepted")
    return True


def check_regular_dir(path: str) -> None:
    """DamagedFile when `path` exists as anything but a real directory (a link included)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise DamagedFile(path, "a symbolic link, not a folder of ours"
                          if stat.S_ISLNK(st.st_mode) else "not a folder")


def read_json_object(path: str, what: str, limit: int = LIMIT) -> dict | None:
    """The JSON object in `path`; None when the file does not exist; DamagedFile when it is
    anything else (see check_regular; invalid or not-an-object JSON)."""
    if not check_regular(path, limit):
        return None
    try:
        doc = loads_strict(read_regular_file(path, limit, what), path)
    except InputFileError as e:
        if e.missing:
            return None
        raise DamagedFile(path, e.problem) from None
    except JSONFormatError as e:
        raise DamagedFile(path, e.problem) from None
    if not isinstance(doc, dict):
        raise DamagedFile(path, f"{what} is JSON but not an object")
    return doc


def move_aside(path: str, why: str) -> str | None:
    """Move `path` (a link stays a link) into `damaged/` beside it, under a name not yet
    taken; log it and queue one notice.  Returns the new path, or None when it could not
    be moved (then the notice says so and the file stays where it is)."""
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    target = None
    try:
        dfd = open_dir(folder)
        try:
            ffd = open_dir(os.path.join(folder, FOLDER), inside=folder, create=True)
            try:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                for n in range(1000):
                    cand = f"{name}.{stamp}" + (f"-{n}" if n else "")
                    try:
                        os.stat(cand, dir_fd=ffd, follow_symlinks=False)
                    except FileNotFoundError:
                        os.rename(name, cand, src_dir_fd=dfd, dst_dir_fd=ffd)
                        target = os.path.join(folder, FOLDER, cand)
                        break
                else:
                    raise OSError(errno.EEXIST, "no free name", os.path.join(folder, FOLDER))
            finally:
                os.close(ffd)
        finally:
            os.close(dfd)
    except OSError as e:
        note = f"{path} cannot be read ({why}) and could not be moved aside ({e.strerror})"
    else:
        note = f"{path} cannot be read ({why}); moved to {target}, everything else loaded"
    log.warning(note)
    shown = False
    for fn in list(_listeners):
        shown = fn(note) or shown
    if not shown:                    # no window yet: the first one shows it
        _pending.append(note)
    return target


def take_notices() -> list[str]:
    """The notices not shown yet (each is returned once)."""
    out = list(_pending)
    _pending.clear()
    return out


def subscribe(fn: Callable[[str], bool]) -> None:
    """`fn(note)` for each later move_aside; True when it showed the note."""
    _listeners.append(fn)


def unsubscribe(fn: Callable[[str], bool]) -> None:
    if fn in _listeners:
        _listeners.remove(fn)
