"""Where a parallel stage's other ranks start. The placement that builds a stage in a process of its own may hand
it a rank launcher, on the node it builds (`NodeSpec.ranks`); the node type's engine settings carry it to the
engine, and where there is none the stage starts its ranks itself, as processes of its machine. The kernel names no
placement and no stage: a launcher is a callable that returns a rank group with `launch(target, specs)` (`target`
"module:function", called with each spec in a process of its own), `address` (where the ranks reach the stage's
process), `gone()` (the ranks that ended, in words) and `stop()`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RankLauncher = Callable[[], Any]
