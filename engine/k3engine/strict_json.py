"""One strict JSON loader for every JSON file the engine reads (config.json, the shard
index, trunk.json, tokenizer_config.json, the download manifest).

Python's json module is lenient where a hostile file turns leniency into a traceback or a
silent reading:
* nesting 10^5 deep raises RecursionError (not a ValueError);
* an integer literal over 4,300 digits raises a bare ValueError, and a long one takes
  quadratic time to convert: integer literals are capped at MAX_INT_DIGITS digits, far above
  any count or offset a file of ours can hold, before int() is called;
* NaN / Infinity / -Infinity are accepted by default, and 1e999 parses as infinity;
* duplicate keys keep the last value silently;
* "\\ud800" decodes to a lone surrogate that later fails to encode mid-run;
* bytes are decoded as UTF-16/32 when they contain NULs.
Every one of these ends in JSONFormatError, whose message names the file.
"""
from __future__ import annotations

import json
from typing import Any, Callable

__all__ = ["JSONFormatError", "Refused", "loads_strict", "check_tree", "STRICT_HOOKS",
           "MAX_DEPTH", "MAX_INT_DIGITS"]

MAX_DEPTH = 64            # deepest nesting any of our files needs is 4
MAX_INT_DIGITS = 20       # 2**64 has 20 digits


class JSONFormatError(ValueError):
    def __init__(self, source: str, problem: str):
        super().__init__(f"{source}: {problem}")
        self.source, self.problem = source, problem


class Refused(ValueError):
    """Raised by the parse hooks; loads_strict turns it into JSONFormatError."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise Refused(f"integer literal of {len(text.lstrip('-'))} digits "
                       f"(at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):     # 1e999 is Infinity spelled as a number
        raise Refused(f"number {text[:40]} overflows a float")
    return v


def _constant(name: str):
    raise Refused(f"non-standard JSON constant {name}")


# For a caller that drives json.loads itself (the shard header keeps its own messages).
STRICT_HOOKS = {"parse_int": _int, "parse_float": _float, "parse_constant": _constant}


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise Refused(f"duplicate key {k!r}")
        out[k] = v
    return out


def loads_strict(data: bytes | str, source: str,
                 pairs_hook: Callable[[list], Any] = no_duplicates) -> Any:
    """Parse `data` (UTF-8 bytes or text) strictly; JSONFormatError names `source`."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONFormatError(source, f"invalid JSON: not UTF-8 text (byte {e.start})") \
                from None
    else:
        text = data
    if text.startswith("\ufeff"):
        raise JSONFormatError(source, "invalid JSON: starts with a byte order mark")
    try:
        obj = json.loads(text, object_pairs_hook=pairs_hook, **STRICT_HOOKS)
    except Refused as e:
        raise JSONFormatError(source, f"invalid JSON: {e}") from None
    except json.JSONDecodeError as e:
        raise JSONFormatError(source, f"invalid JSON: {e.msg} at line {e.lineno} column "
                                      f"{e.colno}") from None
    except RecursionError:      # the C scanner's own guard, at the interpreter's limit
        raise JSONFormatError(source, f"invalid JSON: nested deeper than {MAX_DEPTH}") from None
    check_tree(obj, source)
    return obj


def check_tree(obj: Any, source: str) -> None:
    """Depth and string checks in one iterative walk (no recursion on a hostile tree)."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, str):
            _utf8(o, source)
            continue
        if not isinstance(o, (list, dict)):
            continue
        if depth > MAX_DEPTH:
            raise JSONFormatError(source, f"invalid JSON: nested deeper than {MAX_DEPTH}")
        if isinstance(o, dict):
            items = o.items()
        elif o and isinstance(o[0], tuple):          # a pairs list kept by a custom hook
            items = o
        else:
            stack.extend((v, depth + 1) for v in o)
            continue
        for k, v in items:
            _utf8(k, source)
            stack.append((v, depth + 1))


def _utf8(s: str, source: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise JSONFormatError(source, f"invalid JSON: string with a lone surrogate "
                                      f"({s[max(0, e.start - 10):e.start]!r}...)") from None
