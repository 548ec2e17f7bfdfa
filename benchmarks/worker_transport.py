"""A request's latents and frames from a worker process to the front: the old `.npy` spill files (the transport of
`--old-rev`, loaded from git) against shared memory (omni_workers/shared.py), alternating, medians.

    python benchmarks/worker_transport.py --rounds 11

A worker started by omni's launcher holds the arrays of one 256x256x17 Wan2.2 TI2V-5B request: latents
(1, 48, 5, 16, 16) bf16 and frames (17, 256, 256, 3) float32. Each transfer, the front asks for them; the worker
packs a StageFinished event as its engine loop does (old: spill to files in a temp directory, then pickle; new:
shared.dumps into memory files, then send with their descriptors); the front reads and loads it as its pump does
and sums every array (a consumer reads the data: page faults of a fresh mapping count). Timed in the front, from
the request to the sum. `bytes_copied`: the bytes each side's code copies (a bf16 tensor crosses the old way as
float32, converted both ways), counted from the sizes; `syscall_bytes`: /proc/PID/io rchar + wchar of both
processes per transfer (files and the socket; a write into a mapping is not a syscall). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.connection
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD = "plugins/omni_workers/omni_workers/transport.py"
LATENTS, FRAMES = (1, 48, 5, 16, 16), (17, 256, 256, 3)


def old_transport(rev: str) -> types.ModuleType:
    """transport.py as it was at `rev` (spill / unspill), as a module."""
    source = subprocess.run(["git", "show", f"{rev}:{OLD}"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType("old_transport")
    exec(compile(source, f"{rev}:{OLD}", "exec"), module.__dict__)  # noqa: S102 - this repository's own code
    sys.modules[module.__name__] = module  # its Spilled pickles by name
    return module


def io_bytes() -> int:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


def worker(arg: list) -> None:
    """The worker's side: answer each request with the event, packed the old or the new way."""
    import numpy as np
    import torch

    from omni_kernel.core.request import StageOutput
    from omni_kernel.events import StageFinished
    from omni_workers import shared
    from omni_workers.transport import pack

    fd, rev = arg
    old = old_transport(rev)
    conn = multiprocessing.connection.Connection(fd)
    data = {"latents": torch.randn(LATENTS).to(torch.bfloat16),
            "frames": np.random.default_rng(0).random(FRAMES, dtype=np.float32)}
    event = StageFinished("r", "wan", StageOutput("r", "wan", data=data))
    with tempfile.TemporaryDirectory(prefix="omni-bench-") as spill_dir:
        while (mode := conn.recv()) is not None:
            before = io_bytes()
            if mode == "old":
                message = old.pack(("events", 0, old.spill([event], spill_dir), None), "wan")
                conn.send_bytes(pickle.dumps(message))
            else:
                fds: list = []
                shared.send(conn, pickle.dumps(pack(("events", 0, [event], None), "wan", fds)), fds)
            conn.send(io_bytes() - before)


def receive(conn, mode: str, old) -> tuple[float, int]:
    """The front's side of one transfer: the event loaded, every array summed; (seconds, syscall bytes)."""
    from omni_workers import shared

    before = io_bytes()
    start = time.perf_counter()
    conn.send(mode)
    message = pickle.loads(conn.recv_bytes())
    tokens: list = []
    if message[0] == "fds":
        tokens = message[1]
        shared.take_fds(conn, tokens)
        message = pickle.loads(conn.recv_bytes())
    ((_, data),) = message[2]
    event = pickle.loads(data)
    if mode == "old":
        event = old.unspill(event)
    shared.forget(tokens)
    assert hasattr(event, "output"), event
    arrays = event.output.data
    total = float(arrays["latents"].float().sum()) + float(arrays["frames"].sum())
    seconds = time.perf_counter() - start
    assert total == total  # noqa: PLR0124 - not NaN: every value was read
    return seconds, io_bytes() - before + conn.recv()


def copied(mode: str) -> int:
    """Bytes the transport's code copies for one event (see the module docstring)."""
    latents = 2 * 48 * 5 * 16 * 16  # bf16
    frames = 4 * 17 * 256 * 256 * 3
    if mode == "old":  # bf16 -> fp32 (2x), file write and read (each fp32), fp32 -> bf16; frames written and read
        return (2 * latents + 2 * latents + 2 * latents + latents) + 2 * frames
    return latents + frames  # into the memory file once; the front maps it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--old-rev", default="b515c11", help="a commit whose transport.py spills to files")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "plugins" / "omni_workers"))
    from omni_kernel.util.launch import start

    old = old_transport(args.old_rev)
    front, back = socket.socketpair()
    child = start("worker_transport:worker", [back.fileno(), args.old_rev], pass_fds=(back.fileno(),),
                  env=dict(os.environ, PYTHONPATH=str(ROOT / "benchmarks")))
    back.close()
    conn = multiprocessing.connection.Connection(front.detach())
    runs: dict[str, list] = {"old": [], "new": []}
    for mode in ("old", "new"):
        receive(conn, mode, old)  # warm-up: imports, first mappings
    for i in range(args.rounds):
        for mode in ("old", "new") if i % 2 == 0 else ("new", "old"):
            runs[mode].append(receive(conn, mode, old))
    conn.send(None)
    child.proc.wait(30)
    figures = {mode: {"ms": round(statistics.median(s for s, _ in r) * 1000, 2),
                      "syscall_bytes": int(statistics.median(b for _, b in r)), "bytes_copied": copied(mode)}
               for mode, r in runs.items()}
    figures["ratio_ms_new_over_old"] = round(figures["new"]["ms"] / figures["old"]["ms"], 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
