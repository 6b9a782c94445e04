"""The server's recent engine steps, for `GET /k3/steps` (K3 Studio's batch plots) and the
per-slot figures in `/health`.

Every step of the engine thread (batched or one request at a time) is recorded once, on
the engine thread: its batch size, seconds, bytes read (trunk, experts), tokens, and for
each request in it the slot it holds, its tokens so far and its decode rate so far.  The
rates are computed here from the steps themselves (tokens after the first, per second of
the steps that made them: the first token pays its prompt pass), so the batched and the
serial engine thread report the same figure the app's stats line shows for a turn
(TurnSummary.decode_tokens_per_s).

A bounded ring (KEEP steps): a poller that falls behind gets what is left and `dropped`
says how many it missed; memory stays flat however long the server runs.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

KEEP = 2048                  # steps kept for pollers (at ~100 bytes each: a few hundred KB)


@dataclass
class _Running:
    slot: int
    tokens: int = 0
    first_s: float = 0.0      # seconds of the step that made its first token
    seconds: float = 0.0      # seconds of every step it took part in

    def figures(self, request: int) -> dict:
        decode = self.seconds - self.first_s
        rate = (self.tokens - 1) / decode if self.tokens > 1 and decode > 0 else 0.0
        return {"slot": self.slot, "request": request, "tokens": self.tokens,
                "tokens_per_s": round(rate, 3)}


class StepLog:
    def __init__(self, keep: int = KEEP):
        self._lock = threading.Lock()
        self._steps: deque[dict] = deque(maxlen=keep)
        self._next = 0                                 # the number the next step gets
        self._running: dict[int, _Running] = {}        # request number -> its figures
        self._t0 = time.monotonic()

    def record(self, seconds: float, telemetry, rows: list[tuple[int, int, int]]) -> None:
        """One engine step: `rows` are (request number, slot, tokens) of every request
        that got tokens in it (one each in a batch; a speculative sweep may give more)."""
        with self._lock:
            slots = []
            for request, slot, tokens in rows:
                r = self._running.setdefault(request, _Running(slot))
                if r.tokens == 0:
                    r.first_s = seconds
                r.tokens += tokens
                r.seconds += seconds
                slots.append(r.figures(request))
            n = sum(t for _, _, t in rows)
            self._steps.append({
                "n": self._next, "t": round(time.monotonic() - self._t0, 4), "batch": len(rows),
                "seconds": round(seconds, 6), "tokens": n,
                "tokens_per_s": round(n / seconds, 3) if seconds > 0 else 0.0,
                "trunk_bytes": int(telemetry.trunk_bytes),
                "expert_bytes": int(telemetry.expert_bytes), "slots": slots})
            self._next += 1

    def leave(self, request: int) -> None:
        """The request ended: its figures are no longer current."""
        with self._lock:
            self._running.pop(request, None)

    def slots(self, held: list[tuple[int, int]]) -> list[dict]:
        """The figures of the requests holding a slot (for /health), by slot: `held` is
        (request number, slot) of each; one still in its prompt pass shows 0 tokens."""
        with self._lock:
            return sorted((self._running.get(q, _Running(slot)).figures(q)
                           for q, slot in held), key=lambda d: d["slot"])

    def since(self, n: int) -> dict:
        """The steps numbered `n` and later that are still kept; `next` is the `since` of
        the following poll; `dropped`: steps since `n` no longer kept."""
        with self._lock:
            if n > self._next:          # ahead of this server (it restarted): from the start
                n = 0
            first = self._steps[0]["n"] if self._steps else self._next
            steps = list(islice(self._steps, max(0, n - first), None))
            return {"next": self._next, "dropped": max(0, first - n), "steps": steps}


__all__ = ["StepLog", "KEEP"]
