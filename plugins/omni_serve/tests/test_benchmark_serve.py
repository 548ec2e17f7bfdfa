"""benchmarks/serve.py stopped by SIGTERM (a time limit) stops the servers it started: none is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from omni_kernel.testing import wait_until

pytestmark = [pytest.mark.server, pytest.mark.cli_subprocess]

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "serve.py"
# The benchmark's own child handling, with a child that would otherwise outlive it (a sleeping process).
SCRIPT = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("bench_serve", {bench!r})
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
bench.handle_signals()
try:
    child = bench.Process("server", [sys.executable, "-c", "import time; time.sleep(120)"], 0, {log!r})
    print(child.proc.pid, flush=True)
    time.sleep(120)  # the benchmark's rounds
finally:
    bench.stop_children()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_sigterm_stops_the_servers_the_benchmark_started(tmp_path):
    code = SCRIPT.format(bench=str(BENCH), log=str(tmp_path / "child.log"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        child = int(proc.stdout.readline())
        assert _alive(child)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        wait_until(lambda: not _alive(child), 15, "the benchmark's server child to be stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
