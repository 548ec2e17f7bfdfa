"""Stage: one graph node, an Engine plus the node's policy."""

from __future__ import annotations

from typing import Any

from .errors import UserError
from .events import StageFailed
from .graph import NodeSpec
from .request import Request, StageInput


class Stage:
    """Generic stage. Plugins subclass it to apply node policy in `prepare` and to `check` requests early."""

    def __init__(self, node: NodeSpec, kind: str, engine: Any):
        self.node = node
        self.kind = kind
        self.engine = engine

    @property
    def node_id(self) -> str:
        return self.node.id

    def check(self, request: Request) -> None:
        """Refuse a request this stage can never serve (bad sizes, unreadable image) before anything runs."""

    def prepare(self, item: StageInput) -> StageInput:
        """Apply the node's policy (prompt mode, token budget) to an incoming request."""
        return item

    def add_request(self, item: StageInput) -> None:
        try:
            prepared = self.prepare(item)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            message = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
            self.engine.pending.append(StageFailed(item.request_id, self.node_id, message,
                                                   user_error=isinstance(exc, UserError)))
            return
        self.engine.add_request(prepared)

    def step(self) -> list:
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()
