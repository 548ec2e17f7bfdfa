"""Engine: a Scheduler plus a model runner. step() = schedule -> run -> update.

The scheduler owns every request's progress and record and decides when it is finished; the model runner keeps
its per-request state in the record's `state` slot and returns one result per request (a sampled token, denoised
latents) or an exception for a request that failed alone. An exception from the runner fails that step's batch;
one from the scheduler leaves it inconsistent, so the engine is marked dead and fails everything it holds.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from omni_kernel.core.errors import EngineDead, InvalidParameter
from omni_kernel.core.protocols import ModelRunner, Scheduler
from omni_kernel.core.request import StageInput, StageStats
from omni_kernel.core.scheduler import RequestOutput

log = logging.getLogger("omni")


class Engine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner
        self.failed: list[RequestOutput] = []  # add-time failures, reported by the next step
        self.dead: EngineDead | None = None
        self.owners: dict[str, EngineView] = {}  # request id -> the EngineView it came through
        self.lock = threading.RLock()

    def add_request(self, item: StageInput) -> Any:
        """The scheduler's record of the new request, or None when it failed (reported by the next step)."""
        if self.dead is not None:
            self.failed.append(RequestOutput(item.request_id, error=self.dead))
            return None
        record = None
        try:
            record = self.scheduler.add(item)
            self.runner.add_request(record)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            if record is not None:
                self.scheduler.abort(item.request_id)
            self.failed.append(RequestOutput(item.request_id, error=exc))
            return None
        return record

    def step(self, view: EngineView | None = None) -> list[RequestOutput]:
        """One step's outputs; for a `view` (its `step`), that view's: the others' go to their views' inboxes,
        and a view with outputs waiting gets them without a step. One frame from the stage to the runner."""
        with self.lock:
            if view is not None and view.inbox:
                return view.deliver([])
            outputs, self.failed = self.failed, []
            if self.dead is None:
                try:
                    done = self.scheduler.collect()
                    batch = self.scheduler.schedule()
                    if batch:
                        start = time.perf_counter()
                        try:
                            results = dict(self.runner.run(batch))
                        except Exception as exc:  # noqa: BLE001 - the step failed: fail its requests, keep the engine
                            log.debug("engine step failed", exc_info=exc)
                            results = {rid: exc for rid in batch.request_ids}
                        step_ms = (time.perf_counter() - start) * 1000
                        for rid, exc in results.items():
                            if isinstance(exc, BaseException):
                                done.append(RequestOutput(rid, error=exc, record=self.scheduler.abort(rid)))
                        done += self.scheduler.update(batch, {k: v for k, v in results.items()
                                                              if not isinstance(v, BaseException)}, step_ms)
                except Exception as exc:  # noqa: BLE001 - the scheduler's state can no longer be trusted
                    done = self._die(exc)
                for out in done:
                    if out.finished is not None or out.error is not None:
                        self._free(out.record)
                outputs += done
            return outputs if view is None else view.deliver(outputs)

    def abort(self, request_id: str) -> None:
        self.failed = [o for o in self.failed if o.request_id != request_id]
        self._free(self.scheduler.abort(request_id))

    def has_unfinished(self) -> bool:
        return bool(self.failed) or (self.dead is None and self.scheduler.has_unfinished())

    def request_ids(self) -> set[str]:
        return (set() if self.dead is not None else self.scheduler.request_ids()) | {o.request_id for o in self.failed}

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a step would make progress (at once when there is work to schedule)."""
        return bool(self.failed) or (self.dead is None and self.scheduler.wait(timeout))

    def stats(self) -> StageStats:
        return self.scheduler.stats() if self.dead is None else StageStats(dead=str(self.dead))

    def _die(self, exc: Exception) -> list[RequestOutput]:
        log.error("engine failed and was stopped: %s: %s", type(exc).__name__, exc, exc_info=exc)
        self.dead = EngineDead(f"the stage's engine failed and takes no more requests "
                               f"({type(exc).__name__}: {' '.join(str(exc).split())})")
        outputs = []
        for rid in sorted(self.scheduler.request_ids()):
            self._free(self.scheduler.abort(rid))
            outputs.append(RequestOutput(rid, error=self.dead))
        return outputs

    def _free(self, record: Any) -> None:
        if record is None:
            return
        try:
            self.runner.free(record)
        except Exception:  # noqa: BLE001 - freeing must not fail the step
            log.exception("freeing request %s failed", record.item.request_id)



class EngineView:
    """One stage's share of an Engine that the stages of several pipelines feed (the same model and engine settings:
    one batch, one KV pool, one copy of the weights). The outputs of its own requests come back to it, whichever
    stage's step ran the engine; request ids are unique across the views; the rest is the Engine's."""

    def __init__(self, engine: Engine):
        # step: no frame of its own between the stage and the engine (the call chain to the model stays short)
        self.engine, self.inbox, self.step = engine, [], functools.partial(engine.step, self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, item: StageInput) -> Any:
        with self.engine.lock:
            if item.request_id in self.engine.owners:
                self.inbox.append(RequestOutput(item.request_id, error=InvalidParameter(
                    "request_id", f"{item.request_id!r} is in flight in another stage that shares this engine")))
                return None
            self.engine.owners[item.request_id] = self
            return self.engine.add_request(item)

    def deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            view = self.engine.owners.get(out.request_id)
            if view is not None:
                view.inbox.append(out)
                if out.finished is not None or out.error is not None:
                    del self.engine.owners[out.request_id]
        outputs, self.inbox = self.inbox, []
        return outputs

    def abort(self, request_id: str) -> None:
        with self.engine.lock:
            self.inbox = [o for o in self.inbox if o.request_id != request_id]
            if self.engine.owners.get(request_id) is self:
                del self.engine.owners[request_id]
                self.engine.abort(request_id)

    def request_ids(self) -> set[str]:  # list(): a copy made at once, as another thread may add to it meanwhile
        return {o.request_id for o in self.inbox} | {r for r, v in list(self.engine.owners.items()) if v is self}

    def has_unfinished(self) -> bool:
        return bool(self.request_ids())

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self.inbox) or (self.has_unfinished() and self.engine.wait(timeout))
