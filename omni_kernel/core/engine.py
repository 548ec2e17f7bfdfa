"""Engine: a Scheduler plus a model runner. step() = schedule -> run -> update.

The scheduler owns every request's progress and record and decides when it is finished; the model runner keeps
its per-request state in the record's `state` slot and returns one result per request (a sampled token, denoised
latents) or an exception for a request that failed alone. An exception from the runner fails that step's batch;
one from the scheduler leaves it inconsistent, so the engine is marked dead and fails everything it holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from omni_kernel.core.errors import EngineDead
from omni_kernel.core.protocols import ModelRunner, Scheduler
from omni_kernel.core.request import StageInput, StageStats
from omni_kernel.core.scheduler import RequestOutput

log = logging.getLogger("omni")


class Engine:
    """One model's engine, shared by every stage built on it (`NodeType.engine`; the GraphBuilder keeps one per share
    key). Request ids are unique across its stages: the StageScheduler refuses a duplicate id host-wide."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner
        self.failed: list[RequestOutput] = []  # add-time failures, reported by the next step
        self.dead: EngineDead | None = None
        self.lock = threading.RLock()  # a stage worker may add a request from its reader thread beside a step

    def add_request(self, item: StageInput) -> Any:
        """The scheduler's record of the new request, or None when it failed (reported by the next step)."""
        with self.lock:
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

    def extend(self, request_id: str, extend: Callable[[StageInput], StageInput], last: bool) -> None:
        """Give a request whose input streams in its next chunk: `extend(item)` is its processed input with the chunk
        (the stage's input processor), the scheduler counts its steps again (`Scheduler.extend`). A failure fails
        that request alone (reported by the next step); a request the engine no longer holds takes nothing."""
        with self.lock:
            if self.dead is not None:
                return  # its requests were failed when it died
            try:
                self.scheduler.extend(request_id, extend, last)
            except Exception as exc:  # noqa: BLE001 - a bad chunk fails its request alone
                self._free(self.scheduler.abort(request_id))
                self.failed.append(RequestOutput(request_id, error=exc))

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> update: one step's outputs, the add-time failures first."""
        with self.lock:
            outputs, self.failed = self.failed, []
            if self.dead is not None:
                return outputs
            try:
                done = self.scheduler.collect()
                batch = self.scheduler.schedule()
                if batch:
                    done += self._update(batch, self._run(batch))
            except Exception as exc:  # noqa: BLE001 - the scheduler's state can no longer be trusted
                done = self._die(exc)
            for out in done:
                if out.finished is not None or out.error is not None:
                    self._free(out.record)
            return outputs + done

    def _run(self, batch) -> tuple[dict[str, Any], float]:
        """The runner's result per request and the step's time; a runner that raised fails the whole batch."""
        start = time.perf_counter()
        try:
            results = dict(self.runner.run(batch))
        except Exception as exc:  # noqa: BLE001 - the step failed: fail its requests, keep the engine
            log.debug("engine step failed", exc_info=exc)
            results = {rid: exc for rid in batch.request_ids}
        return results, (time.perf_counter() - start) * 1000

    def _update(self, batch, run: tuple[dict[str, Any], float]) -> list[RequestOutput]:
        """The scheduler's verdicts on the results; a request whose result is an exception failed alone."""
        results, step_ms = run
        failed = [RequestOutput(rid, error=exc, record=self.scheduler.abort(rid))
                  for rid, exc in results.items() if isinstance(exc, BaseException)]
        good = {rid: value for rid, value in results.items() if not isinstance(value, BaseException)}
        return failed + self.scheduler.update(batch, good, step_ms)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.failed = [o for o in self.failed if o.request_id != request_id]
            self._free(self.scheduler.abort(request_id))

    def has_unfinished(self) -> bool:
        return bool(self.failed) or (self.dead is None and self.scheduler.has_unfinished())

    def request_ids(self) -> set[str]:
        ids = {o.request_id for o in self.failed}
        if self.dead is None:
            ids |= self.scheduler.request_ids()
        return ids

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a step would make progress (at once when there is work to schedule)."""
        return bool(self.failed) or (self.dead is None and self.scheduler.wait(timeout))

    def stats(self) -> StageStats:
        return self.scheduler.stats() if self.dead is None else StageStats(dead=str(self.dead))

    def _die(self, exc: Exception) -> list[RequestOutput]:
        log.error("engine failed and was stopped: %s: %s", type(exc).__name__, exc, exc_info=exc)
        reason = " ".join(str(exc).split())
        self.dead = EngineDead(f"the stage's engine failed and takes no more requests ({type(exc).__name__}: {reason})")
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
