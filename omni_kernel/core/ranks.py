"""Where a parallel stage's other ranks start: the placement that builds a stage in a process of its own may hand
it a rank launcher (`set_rank_launcher`, before the build); the stage asks `rank_launcher()` and, where none is
set, starts its ranks itself as processes of its machine. The kernel names no placement and no stage: a launcher
is a callable that returns a rank group with `launch(target, specs)` (`target` "module:function", called with
each spec in a process of its own), `address` (where the ranks reach the stage's process), `gone()` (the ranks
that ended, in words) and `stop()`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_LAUNCHER: Callable[[], Any] | None = None


def set_rank_launcher(launcher: Callable[[], Any] | None) -> None:
    """The launcher of the stages this process builds from now on (None: their own processes)."""
    global _LAUNCHER
    _LAUNCHER = launcher


def rank_launcher() -> Callable[[], Any] | None:
    return _LAUNCHER
