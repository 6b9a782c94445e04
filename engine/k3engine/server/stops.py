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
        keep = open_prefix(self.buf, self.stops)
        out = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        """End of generation: what was held back was not a stop string after all."""
        out, self.buf = ("" if self.hit is not None else self.buf), ""
        return out


def open_prefix(buf: str, strings: tuple[str, ...]) -> int:
    """Length of the longest tail of buf that is a proper prefix of one of `strings`."""
    longest = max(len(s) for s in strings) - 1
    for k in range(min(longest, len(buf)), 0, -1):
        tail = buf[-k:]
        if any(s.startswith(tail) for s in strings):
            return k
    return 0


class TextFilter:
    """Removes every occurrence of some strings (the tokenizer's added tokens: control
    text) from a stream of text deltas.  A tail that could begin one is held back until
    the next delta decides it, as StopMatcher does, so a control token split over two
    deltas is removed too.  Text-level on purpose: the routes see text, not ids, and a
    literal "<|sep|>" spelled with ordinary tokens is control text to a client as well."""

    def __init__(self, hidden):
        self.hidden = tuple(h for h in hidden if h)
        self.buf = ""

    def push(self, text: str) -> str:
        if not self.hidden:
            return text
        self.buf += text
        while True:                   # removing one may join the pieces of another
            before = self.buf
            for h in self.hidden:
                self.buf = self.buf.replace(h, "")
            if self.buf == before:
                break
        keep = open_prefix(self.buf, self.hidden)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
