"""How rank 0 of a parallel Wan stage starts its other ranks (ranks.py): as processes on its machine, or, where
rank 0's placement hands it a launcher (placement `ray`: Ray actors in one placement group of a bundle per rank).

Each launcher gives `launch(specs)` (one spec per rank 1..N-1), `address` (where the others reach rank 0),
`gone()` (the ranks that ended, in words) and `stop()`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from omni_kernel.core.errors import UserError
from omni_kernel.core.ranks import rank_launcher

LOOPBACK = "127.0.0.1"


def placed_ranks() -> bool:
    """The stage's placement starts its ranks (on Ray each rank's actor reserves its own device)."""
    return rank_launcher() is not None


def launcher(resources: dict | None):
    """The placement's launcher where it handed one (`ray`: each rank an actor with rank 0's resources), else
    processes here."""
    start = rank_launcher()
    return PlacedRanks(start()) if start is not None else ProcessRanks()


class ProcessRanks:
    """The ranks as fresh interpreters on this machine; each exits when this process is gone."""

    address = LOOPBACK

    def __init__(self):
        self.processes: list[subprocess.Popen] = []

    def launch(self, specs: list[dict]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = "from omni_wan.ranks import rank_main; import sys, json; rank_main(json.loads(sys.argv[1]))"
        self.processes = [subprocess.Popen([sys.executable, "-c", code, json.dumps({**spec, "parent": os.getpid()})],
                                           env=env, stdin=subprocess.DEVNULL, stdout=2) for spec in specs]

    def gone(self) -> list[str]:
        return [f"rank {i} ({_how(p.returncode)})" for i, p in enumerate(self.processes, 1) if p.poll() is not None]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(10)
        self.processes = []


class PlacedRanks:
    """The ranks where the stage's placement starts them (the `ray` placement: Ray actors in a placement group of
    their own, omni_workers/ray_groups.py), through the launcher it handed this process (omni_kernel/core/ranks.py)."""

    def __init__(self, group):
        self.group = group
        self.address = group.address

    def launch(self, specs: list[dict]) -> None:
        try:
            self.group.launch("omni_wan.ranks:rank_main", specs)
        except TimeoutError as exc:
            raise UserError(str(exc)) from None

    def gone(self) -> list[str]:
        return self.group.gone()

    def stop(self) -> None:
        self.group.stop()


def _how(code: int | None) -> str:
    if code is not None and code < 0 and -code in signal.Signals._value2member_map_:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
