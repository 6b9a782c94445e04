"""Reading an input file the engine did not write: a regular file, read with a size limit.

Silent-failure traps handled here (tests/test_hostile_files.py):
* a FIFO given as config.json (or any input) blocks open() and read() forever: the file is
  opened non-blocking and refused unless fstat says it is a regular file;
* /dev/zero (or any endless or huge file) would be read until memory runs out: the size is
  checked on the open descriptor before reading, and at most `limit + 1` bytes are read, so
  a file that grows after the check is still refused.
"""
from __future__ import annotations

import os
import stat

__all__ = ["InputFileError", "read_regular_file", "MiB"]

MiB = 1 << 20


class InputFileError(ValueError):
    """An input file that cannot be read as one; `str()` names the file and the problem."""

    def __init__(self, path: str, problem: str, missing: bool = False):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem, self.missing = path, problem, missing


def read_regular_file(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """The bytes of `path`, which must be a regular file of at most `limit` bytes."""
    path = os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InputFileError(path, f"{what} not found", missing=True) from None
    except OSError as e:
        raise InputFileError(path, f"cannot read {what}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError(path, f"cannot read {what}: {_kind(st.st_mode)}, not a "
                                       "regular file")
        if st.st_size > limit:
            raise InputFileError(path, f"{what} is {st.st_size:,} bytes, more than the "
                                       f"{limit:,} this reader accepts")
        chunks, got = [], 0
        while got <= limit:
            b = os.read(fd, min(limit + 1 - got, 16 * MiB))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > limit:
            raise InputFileError(path, f"{what} grew past {limit:,} bytes while being read")
        return b"".join(chunks)
    except OSError as e:
        raise InputFileError(path, f"cannot read {what}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"
