"""`omni serve` on a model-free pipeline (`steady`: 20 ms a word): a stream still open at the end of the
shutdown timeout ends with an error event and [DONE] (no traceback), and the atomic-write leftovers of
--output-dir are swept at start and at shutdown."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from omni_kernel.testing import wait_until

from serving import ServerProcess

pytestmark = [pytest.mark.server]

PLUGINS = ("restart_plugin:RestartPlugin",)


def _leftover(folder, name: str | None = None):
    name = name or f"video_{uuid.uuid4().hex}.mp4"
    path = folder / f".{name}.a1b2c3d4.tmp.mp4"
    path.write_bytes(b"")
    return path


def test_a_stream_open_at_the_shutdown_timeout_ends_with_an_error_event_and_done(tmp_path):
    out = tmp_path / "videos"
    out.mkdir()
    before = _leftover(out)  # what a worker killed mid-export left behind
    mine = out / ".notes.txt.a1b2c3d4.tmp"  # not the server's: left alone
    mine.write_bytes(b"")
    proc = ServerProcess(["--pipeline", "steady", "--shutdown-timeout", "1", "--output-dir", str(out)],
                         tmp_path / "s.log", plugins=PLUGINS).wait_ready()
    assert not before.exists() and mine.exists()
    during = _leftover(out)
    words = " ".join(f"w{i}" for i in range(1000))  # 20 s at 20 ms a word: open at the timeout
    raw: list[str] = []

    def client():
        body = {"model": "steady", "stream": True, "messages": [{"role": "user", "content": words}]}
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=60) as r:
            raw.extend(r.iter_text())

    thread = threading.Thread(target=client)
    thread.start()
    wait_until(lambda: len("".join(raw)) > 200, 30, "the stream to be under way")
    start = time.monotonic()
    assert proc.stop() == 0, proc.output()
    thread.join(30)
    took = time.monotonic() - start
    text = "".join(raw)
    events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", text[-500:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "aborted" and "shut down" in error["message"] and "--shutdown-timeout" in error["message"]
    assert took < 10, took
    log = proc.output()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert not during.exists() and mine.exists()
