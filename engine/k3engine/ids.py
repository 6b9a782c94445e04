"""Token-id lists given by a person (`--ids`, `--ids-file`): ASCII decimal only.

Silent-failure trap handled here (tests/test_hostile_inputs.py): str.isdigit() and int()
accept every Unicode digit, so `١,٢` (Arabic-Indic) was read as the ids 1,2, and `²` or
`①` passed isdigit() and then crashed int().  Only the ten ASCII digits are a digit here.
"""
from __future__ import annotations

import os
import re

from .errors import UsageError
from .inputfile import MiB, InputFileError, read_regular_file

__all__ = ["IdsError", "parse_ids", "read_ids_file", "MAX_IDS", "IDS_FILE_LIMIT"]

MAX_IDS = 1 << 20              # far beyond any prompt the KV cache can hold
MAX_ID_DIGITS = 10             # ids are int32
IDS_FILE_LIMIT = 64 * MiB
_SEP = re.compile(r"[ \t\r\n,]+")
_ASCII_INT = re.compile(r"[0-9]+")


class IdsError(UsageError):
    """A usage error (exit 2); the message names the flag or file and the bad piece."""


def parse_ids(text: str, what: str) -> list[int]:
    pieces = [p for p in _SEP.split(text) if p]
    if not pieces:
        raise IdsError(f"bad {what}: no ids")
    if len(pieces) > MAX_IDS:
        raise IdsError(f"bad {what}: {len(pieces):,} ids (at most {MAX_IDS:,})")
    out = []
    for p in pieces:
        if not _ASCII_INT.fullmatch(p):
            raise IdsError(f"bad {what}: {p[:40]!r} is not a non-negative whole number "
                           "(ASCII digits 0-9)")
        if len(p.lstrip("0")) > MAX_ID_DIGITS or int(p) > 2**31 - 1:
            raise IdsError(f"bad {what}: {p[:40]} does not fit a token id (int32)")
        out.append(int(p))
    return out


def read_ids_file(path: str | os.PathLike, flag: str = "--ids-file") -> list[int]:
    path = os.fspath(path)
    try:
        data = read_regular_file(path, IDS_FILE_LIMIT, "ids file")
    except InputFileError as e:
        raise IdsError(f"cannot read {flag} {e}") from None
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise IdsError(f"bad {flag} {path}: byte 0x{data[e.start]:02x} at offset {e.start} "
                       "is not ASCII (ids are ASCII decimal numbers)") from None
    return parse_ids(text, f"{flag} {path}")
