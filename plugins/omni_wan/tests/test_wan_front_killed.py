"""kill -9 of the front at each moment of a Wan request (prepare, denoise, decode, export), with the stage in a
worker process alone and with `wan_ulysses=2` (a rank beside it): within 30 s no process the front started is
left, no shared-memory segment, nothing in the temp directory and no partial output; the next run works.

The worker (and its rank) is frozen (SIGSTOP) at the first sign of the phase that the test can see: right after
the submit (prepare), after the first denoise step (denoise), after the last one (decode), and once the worker
has started ffmpeg (export); then the front is killed. So the kill finds the request in that phase however fast
or slow the machine is. A tiny video's ffmpeg can run and end between two looks at the process table, so the
first run's ffmpeg (IMAGEIO_FFMPEG_EXE) is a gate that marks its start and waits for the test to freeze the
worker, then becomes the real ffmpeg, which is left running: it ends when its input closes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import imageio_ffmpeg
import pytest

from omni_kernel.testing import wait_until

pytestmark = [pytest.mark.process]

FRONT = """
import json, sys
from omni_kernel import Omni, RequestFinished, StageProgress
config = json.loads(sys.argv[3])
o = Omni("wan_t2v", model=sys.argv[1], device="cpu", placement="process", **config)
o.submit(o.request(prompt="a red fox", seed=1, output=sys.argv[2], preset="smoke", height=64, width=96,
                   num_frames=9, num_inference_steps=6))
print(json.dumps({"submitted": o.graph.stages["wan"].proc.pid}), flush=True)
while o.has_unfinished():
    for event in o.step():
        if isinstance(event, StageProgress):
            print(json.dumps({"step": event.step, "total": event.total}), flush=True)
        if isinstance(event, RequestFinished):
            print(json.dumps({"finished": event.result.output.path}), flush=True)
"""


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if entry.name.isdigit():
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shm() -> set[str]:
    """The /dev/shm segments that shared memory from Python or torch would leave (other programs' aside)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {name for name in names if name.startswith(("psm_", "torch_", "omni", "pymp"))}


def run_front(tiny_model, out: Path, config: dict, env: dict, script: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), str(tiny_model), str(out), json.dumps(config)],
                            stdout=subprocess.PIPE, text=True, env=env)


def command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def ffmpeg_gate(tmp_path: Path) -> tuple[Path, Path]:
    """An ffmpeg that writes `started` and waits until that file is gone (or its worker is), then runs the real one;
    (exe, started)."""
    started, gate = tmp_path / "ffmpeg-started", tmp_path / "ffmpeg-gate"
    gate.write_text(f"#!/bin/sh\necho $$ > {started}\n"
                    f"while [ -e {started} ] && kill -0 $PPID 2>/dev/null; do sleep 0.02; done\n"
                    f'exec {imageio_ffmpeg.get_ffmpeg_exe()} "$@"\n')
    gate.chmod(0o755)
    return gate, started


def reached(phase: str, line: dict, started: Path) -> bool:
    """The front's line (or the ffmpeg gate) shows the request in `phase`."""
    if phase == "prepare":
        return "submitted" in line
    if phase == "denoise":
        return line.get("step") == 1
    if phase == "decode":
        return "step" in line and line["step"] == line["total"]
    if "step" in line and line["step"] == line["total"]:  # ffmpeg starts after the last step's line
        wait_until(started.exists, 60, "the worker to start ffmpeg", interval=0.01)
    return started.exists()


def freeze_at(front: subprocess.Popen, phase: str, started: Path) -> list[int]:
    """Read the front's lines until the request is in `phase`; then SIGSTOP the processes omni's launcher started
    (the worker, the rank), open the ffmpeg gate, and return every process under the front."""
    for raw in front.stdout:
        line = json.loads(raw)
        assert "finished" not in line, f"the request finished before its {phase} was seen"
        if reached(phase, line, started):
            procs = descendants(front.pid)
            for pid in procs:
                if b"omni_kernel.util.launch" in command(pid):  # not ffmpeg, which may be between fork and exec
                    os.kill(pid, signal.SIGSTOP)
            started.unlink(missing_ok=True)
            return procs
    raise AssertionError(f"the front ended before the request reached {phase}")


PLACEMENTS = {"process": {}, "ulysses2": {"wan_ulysses": 2}}
# `make test` kills one phase per placement: the worker alone while its ffmpeg runs, and the rank group mid-denoise
# (between collectives); the other six cases (39-53 s each with a rank, 13-21 s without) are `full`, for
# `make test-full` (README, "Tests").
IN_MAKE_TEST = {("export", "process"), ("denoise", "ulysses2")}
CASES = [pytest.param(phase, config, id=f"{phase}-{placement}",
                      marks=() if (phase, placement) in IN_MAKE_TEST else pytest.mark.full)
         for phase in ("prepare", "denoise", "decode", "export") for placement, config in PLACEMENTS.items()]


@pytest.mark.parametrize(("phase", "config"), CASES)
def test_a_front_killed_at_any_moment_leaves_nothing_and_the_next_run_works(phase, config, tiny_model, tmp_path):
    script = tmp_path / "front.py"
    script.write_text(FRONT)
    temp, outputs = tmp_path / "tmp", tmp_path / "out"
    temp.mkdir()
    outputs.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "OMP_NUM_THREADS": "1"}
    gate, started = ffmpeg_gate(tmp_path)
    before = shm()
    front = run_front(tiny_model, outputs / "v.mp4", config, {**env, "IMAGEIO_FFMPEG_EXE": str(gate)}, script)
    try:
        procs = freeze_at(front, phase, started)
        assert procs, "the front started no process"
        front.kill()
        front.wait(10)
        wait_until(lambda: not any(alive(p) for p in procs), 30, "the front's processes to die with it")
    finally:
        if front.poll() is None:
            front.kill()
    assert shm() - before == set()
    assert list(temp.iterdir()) == []
    assert list(outputs.iterdir()) == []
    again = run_front(tiny_model, outputs / "v.mp4", config, env, script)
    lines = [json.loads(raw) for raw in again.stdout]
    assert again.wait(60) == 0 and lines[-1] == {"finished": str(outputs / "v.mp4")}, lines
    assert (outputs / "v.mp4").stat().st_size > 0 and [p.name for p in outputs.iterdir()] == ["v.mp4"]
