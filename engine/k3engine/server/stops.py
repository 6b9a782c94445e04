"""Stop strings over a stream of text deltas.

OpenAI semantics: generation ends when the output contains a stop string, and the stop
string itself is not returned.  Streaming makes this a trap: a stop string may arrive split
over several tokens ("\\n\\nUs" + "er:"), so text that could still be the start of one is
held back until the next delta decides it.  Text is only ever released once no stop string
can begin inside it, so nothing released is ever taken back (test_stops.py).
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self.buf = ""
        self.hit: str | None = None          # the stop string found, once found

    def push(self, text: str) -> str:
        """The text that is now safe to release (possibly empty)."""
        if self.hit is not None or not text:
            return ""
        if not self.stops:
            return text
        self.buf += text
        found = [(i, s) for s in self.stops if (i := self.buf.find(s)) >= 0]
        if found:
            i, self.hit = min(found)
            out, self.buf = self.buf[:i], ""
            return out
        keep = self._open_prefix()
        out = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return out

    def _open_prefix(self) -> int:
        """Length of the longest tail of buf that is a proper prefix of a stop string."""
        longest = max(len(s) for s in self.stops) - 1
        for k in range(min(longest, len(self.buf)), 0, -1):
            tail = self.buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """End of generation: what was held back was not a stop string after all."""
        out, self.buf = ("" if self.hit is not None else self.buf), ""
        return out
