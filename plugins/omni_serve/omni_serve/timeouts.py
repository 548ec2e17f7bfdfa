"""Slow clients: uvicorn's h11 protocol with a header timeout.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) and h11 bounds the size of a request's
headers (16 KiB), but a client that sends its headers a byte at a time is held for as long as it likes. Here a
request's headers must be complete within `header_timeout` seconds of its first byte (of the connection, for
its first request); else the connection is closed. The body's own bound is in the ASGI guard (guards.py,
`--body-timeout`: 408). The command hands uvicorn `partial(TimedH11Protocol, header_timeout=...)` as its
protocol; imported only when the server starts, so the entry module imports no uvicorn.

uvicorn has no public hook for this: TimedH11Protocol overrides and reads private parts of its h11 protocol
(`data_received`, `handle_events`, `cycle`), so it is written for one uvicorn, UVICORN_VERSION, the version the
project pins; tests/test_header_timeout_protocol.py fails on any other. Behind a proxy (nginx's
`client_header_timeout`) the proxy's own bound does the same.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import Timeouts

log = logging.getLogger("omni")
UVICORN_VERSION = "0.54.0"  # constraints.txt


class TimedH11Protocol(H11Protocol):
    """H11Protocol whose connections must deliver each request's headers within `header_timeout` seconds."""

    def __init__(self, config, *args, header_timeout: float = Timeouts().header, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.header_timeout = header_timeout
        self.header_timer: asyncio.TimerHandle | None = None
        self.seen_cycle = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self.seen_cycle:  # a request's headers are complete
            self.seen_cycle = self.cycle
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.header_timeout and self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _too_slow(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing():
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.info("closed the connection of %s: its request headers took more than %gs (--header-timeout)",
                     client, self.header_timeout)
            self.transport.close()
