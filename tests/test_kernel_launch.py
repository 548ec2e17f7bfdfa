"""The kernel's launcher (omni_kernel/util/launch.py): a child dies with its parent whatever killed the parent
(SIGKILL included), also when a short-lived thread started it; how a child ended comes back in words, with the
last line of the exception it raised."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from omni_kernel.testing import wait_until
from omni_kernel.util.launch import exit_cause, start

pytestmark = [pytest.mark.process]

# A parent that starts a sleeping child from a thread that then ends, prints the child's pid and waits.
PARENT = textwrap.dedent("""
    import sys, threading
    from omni_kernel.util.launch import start
    children = []
    thread = threading.Thread(target=lambda: children.append(start("time:sleep", 600)))
    thread.start()
    thread.join()
    print(children[0].pid, flush=True)
    sys.stdin.read()
""")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_dies_with_a_parent_killed_by_sigkill_after_the_thread_that_started_it_ended():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)  # the thread that started it has ended: the child lives on
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not alive(child), 30, "the child to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_how_a_child_ended_is_reported_with_its_exception():
    failed = start("json:loads", "{not json")
    failed.proc.wait(60)
    cause = failed.cause()
    assert cause.startswith("exit code 1: json.decoder.JSONDecodeError: Expecting property name") and "\n" not in cause
    ok = start("time:sleep", 0)
    ok.proc.wait(60)
    assert ok.cause() == "exit code 0"
    slept = []
    thread = threading.Thread(target=lambda: slept.append(start("time:sleep", 600)))
    thread.start()
    thread.join()
    slept[0].kill()
    assert slept[0].cause() == "killed by SIGKILL"
    assert exit_cause(None) == "exit code None" and exit_cause(-15) == "killed by SIGTERM"
