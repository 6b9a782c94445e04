"""The connection bounds uvicorn leaves out: a deadline for a request's headers.

uvicorn (h11) closes a kept-alive connection idle for `timeout_keep_alive` seconds, and
h11 refuses a header block over `h11_max_incomplete_event_size` bytes, but a connection
that sends nothing, or its headers a byte at a time, is held for ever (slowloris; issue
47 held 50 such connections and 3,000 idle ones).  Here every connection must complete
its request line and headers within `header_timeout` seconds of opening, or of the end
of its previous response; otherwise it is closed.  The body has its own deadline in the
app (create_app's body_timeout_s), where the route can answer 408.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 16 * 1024               # h11's own default, set explicitly


class BoundedH11Protocol(H11Protocol):
    header_timeout = 10.0                  # seconds; set per server by bounded_protocol

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _expired(self) -> None:
        self._header_deadline = None
        # only a connection still waiting for a request's headers: never one whose
        # request runs or streams (their_state leaves IDLE once the headers are in)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()                    # the next request's headers have a deadline too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def bounded_protocol(header_timeout: float) -> type[BoundedH11Protocol]:
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"header_timeout": header_timeout})
