"""Fault injection for the exit-4 tests: K3_FAIL_EXPERT=L,E (E may be *) makes every read
of that expert of layer L fail.  A malformed value is a usage error, never a traceback
(`abc`, `1`, `1,2,3`, `-1,2`, `١,٢`)."""
from __future__ import annotations

import os
import re
from typing import Callable

__all__ = ["FaultSpecError", "parse_fail_expert", "injected_failure"]

_SPEC = re.compile(r"([0-9]{1,6}),([0-9]{1,9}|\*)")


class FaultSpecError(ValueError):
    """A usage error (exit 2)."""


def parse_fail_expert(spec: str) -> Callable[[int, int], bool]:
    m = _SPEC.fullmatch(spec.strip())
    if m is None:
        raise FaultSpecError(f"bad K3_FAIL_EXPERT value {spec[:40]!r}: expected LAYER,EXPERT "
                             "or LAYER,* (ASCII decimal numbers)")
    layer, expert = int(m.group(1)), m.group(2)
    if expert == "*":
        return lambda L, e: L == layer
    ex = int(expert)
    return lambda L, e: L == layer and e == ex


def injected_failure(environ=os.environ) -> Callable[[int, int], bool] | None:
    spec = environ.get("K3_FAIL_EXPERT")
    return parse_fail_expert(spec) if spec else None
