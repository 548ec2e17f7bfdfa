"""The header timeout (omni_serve/timeouts.py) subclasses uvicorn's private h11 protocol: these drive it in
process, on the pinned uvicorn, so an upgrade that changes what it overrides or reads fails here (and the
trickling client of test_server_limits.py checks it end to end on a real server)."""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.server import ServerState

from omni_serve.timeouts import UVICORN_VERSION, TimedH11Protocol


async def _app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


class _Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.closed = False
        self.written = b""

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data):
        self.written += data

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


def _connect(loop, header_timeout: float) -> tuple[TimedH11Protocol, _Transport]:
    config = uvicorn.Config(_app, lifespan="off", log_level="warning")
    protocol = TimedH11Protocol(config, ServerState(), {}, loop, header_timeout=header_timeout)
    transport = _Transport()
    protocol.connection_made(transport)
    return protocol, transport


def test_the_protocol_is_written_for_the_pinned_uvicorn():
    assert uvicorn.__version__ == UVICORN_VERSION, "re-check timeouts.py against this uvicorn, then move the pin"


def test_headers_not_complete_within_the_timeout_close_the_connection():
    loop = asyncio.new_event_loop()
    try:
        protocol, transport = _connect(loop, header_timeout=0.05)
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n")  # no blank line: the headers are not complete
        loop.run_until_complete(asyncio.sleep(0.3))
        assert transport.closed
        assert transport.written == b""
    finally:
        loop.close()


def test_headers_complete_in_time_are_answered_and_disarm_the_timer():
    loop = asyncio.new_event_loop()
    try:
        protocol, transport = _connect(loop, header_timeout=0.05)
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        loop.run_until_complete(asyncio.sleep(0.3))
        assert transport.written.startswith(b"HTTP/1.1 204"), transport.written
        assert protocol.header_timer is None
        assert not transport.closed  # kept alive, and idle: uvicorn's keep-alive timeout (5 s) is not yet due
    finally:
        loop.close()
