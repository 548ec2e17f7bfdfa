"""Stage: one graph node. Input processing (once per request), an Engine, output processing."""

from __future__ import annotations

from .engine import Engine
from .events import StageFailed, StageFinished
from .graph import NodeSpec
from .request import StageInput, StageOutput
from .scheduler import RequestOutput


class Stage:
    """Generic stage. Plugins subclass it: `process` turns an input into what the model runner needs,
    `postprocess` turns the engine's RequestOutputs into events."""

    # True when `process` reads no state that a step changes (a Wan input: decode the image, resolve settings), so
    # it may run beside a step: a stage worker then answers it at once instead of after the step running now.
    concurrent_process = False

    def __init__(self, node: NodeSpec, kind: str, engine: Engine):
        self.node = node
        self.kind = kind
        self.engine = engine

    @property
    def node_id(self) -> str:
        return self.node.id

    def check(self, item: StageInput) -> None:
        """Refuse at submit an input this downstream node can never serve (bad sizes, an unreadable image
        header); the connector's real input is processed at hand-off. Cheap: no model, no full decode."""

    def process(self, item: StageInput) -> StageInput:
        """Input processing, once per request (tokenize, decode an image, resolve settings); raise UserError."""
        return item

    def add_request(self, item: StageInput) -> None:
        self.engine.add_request(item)

    def step(self) -> list:
        return self.postprocess(self.engine.step())

    def postprocess(self, outputs: list[RequestOutput]) -> list:
        """Events of one step. By default a finished request's result is its StageOutput."""
        events: list = []
        for out in outputs:
            if out.error is not None:
                events.append(StageFailed.of(out.request_id, self.node_id, out.error))
            elif out.finished is not None:
                result = out.result if isinstance(out.result, StageOutput) else StageOutput(
                    out.request_id, self.node_id, text=None if out.result is None else str(out.result),
                    stop_reason=out.finished)
                events.append(StageFinished(out.request_id, self.node_id, result))
        return events

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def request_ids(self) -> set[str]:
        return self.engine.request_ids()

    def wait(self, timeout: float | None = None) -> bool:
        """In this process stepping is the work, so a stage with work never needs to wait."""
        return self.has_unfinished()
