"""The rule of one stepping round, shared by every host of stages: the StageScheduler in the front, and a stage
worker (omni_workers) for the stages it hosts.

`step_engine` steps one engine once and hands each output to the stage that runs its request on that engine (the
host's `owner`); each stage turns its own outputs into events. A failure stays with the requests it concerns: an
engine whose step raises fails every request it runs (`running`), and a stage whose output processor raises fails
the requests of those outputs; each is logged once. What a host does with the events (route them through its
graph, send them to the front) is its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from omni_kernel.core.events import StageFailed

log = logging.getLogger("omni")


def step_engine(engine, owner: Callable[[str], Any], running: Callable[[], Iterable[tuple[str, Any]]]) -> list:
    """Step `engine` once: (stage, event) pairs, in the order the stages made them.

    `owner(request_id)`: the stage that runs the request on this engine, or None (aborted, or failed, while the
    engine worked on it: its output is dropped). `running()`: (request id, stage) of every request the host runs on
    this engine, each failed when the step raises."""
    try:
        outputs = engine.step()
    except Exception as exc:  # noqa: BLE001 - a broken engine fails its own requests, not the loop
        log.error("stage engine failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return [(stage, StageFailed.of(request_id, stage.node_id, exc)) for request_id, stage in running()]
    by_stage: dict[int, tuple[Any, list]] = {}
    for out in outputs:
        stage = owner(out.request_id)
        if stage is not None:
            by_stage.setdefault(id(stage), (stage, []))[1].append(out)
    pairs = []
    for stage, outs in by_stage.values():
        pairs.extend((stage, event) for event in events_of(stage, outs))
    return pairs


def events_of(stage, outputs: list) -> list:
    """The stage's events of its requests' outputs; a stage that cannot make them fails those requests only."""
    try:
        return stage.events_for(outputs)
    except Exception as exc:  # noqa: BLE001 - a broken output processor fails its own requests
        log.error("stage %s failed: %s: %s", stage.node_id, type(exc).__name__, exc, exc_info=exc)
        return [StageFailed.of(rid, stage.node_id, exc) for rid in dict.fromkeys(out.request_id for out in outputs)]
