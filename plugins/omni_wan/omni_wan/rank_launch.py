"""How rank 0 of a parallel Wan stage starts its other ranks (ranks.py): as processes on its machine, or, where
rank 0's placement hands it a launcher on its node (`NodeSpec.ranks`, carried by its engine settings; placement
`ray`: Ray actors in one placement group of a bundle per rank).

Each launcher gives `launch(specs)` (one spec per rank 1..N-1, whose "entry" is what the rank runs), `address`
(where the others reach rank 0), `gone()` (the ranks that ended, in words) and `stop()`.
"""

from __future__ import annotations

import os
import sys

from omni_kernel.core.errors import UserError
from omni_kernel.core.ranks import RankLauncher
from omni_kernel.util.launch import Child, start

LOOPBACK = "127.0.0.1"


def launcher(placed: RankLauncher | None):
    """The ranks of one start: the placement's launcher where it handed one (`ray`: each rank an actor with rank
    0's resources), else processes here."""
    return PlacedRanks(placed()) if placed is not None else ProcessRanks()


class ProcessRanks:
    """The ranks as fresh interpreters on this machine, started by the kernel's launcher (omni_kernel/util/
    launch.py): each dies with this process, and says how it ended."""

    address = LOOPBACK

    def __init__(self):
        self.children: list[Child] = []

    def launch(self, specs: list[dict]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.children = [start(spec["entry"], spec, env=env) for spec in specs]

    def gone(self) -> list[str]:
        return [f"rank {i} ({c.cause()})" for i, c in enumerate(self.children, 1) if c.poll() is not None]

    def stop(self) -> None:
        for child in self.children:
            child.kill()
        self.children = []


class PlacedRanks:
    """The ranks where the stage's placement starts them (the `ray` placement: Ray actors in a placement group of
    their own, omni_workers/ray_groups.py), through the launcher it handed the stage (omni_kernel/core/ranks.py)."""

    def __init__(self, group):
        self.group = group
        self.address = group.address

    def launch(self, specs: list[dict]) -> None:
        try:
            self.group.launch(specs[0]["entry"], specs)
        except TimeoutError as exc:
            raise UserError(str(exc)) from None

    def gone(self) -> list[str]:
        return self.group.gone()

    def stop(self) -> None:
        self.group.stop()
