"""The cyclic garbage collector paused for the length of a forward pass (issue 13).

A forward pass allocates thousands of short-lived containers (arrays, memoryviews, tuples,
a streamed layer's bound weights); every 700 of them start a generation-0 collection and
every hundredth of those a full one that walks every live object, the bound model's
containers included (3.6-4.1 % of a decode step on the mid checkpoint,
docs/benchmarks-engine.md).  Reference counting frees all of them as soon as they are
dropped; the few cycles a pass can leave (an expert group and its read futures) are small
and are collected after it, when the collector is running again.

Nested or concurrent passes (the draft model inside a speculative step, two sessions of
the server) share one count, so the collector resumes only when the last one ends, and only
if it was enabled when the first one began.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_resume = False


@contextmanager
def paused() -> Iterator[None]:
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
