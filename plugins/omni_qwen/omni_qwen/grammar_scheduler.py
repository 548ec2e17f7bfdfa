"""GrammarScheduler: the kernel's ARScheduler, plus what constrained requests need from the one owner of progress.

- A request whose grammar is still compiling stays in the waiting queue, unscheduled, while the others run (so
  a compile never stalls their steps); `wait` blocks on the compiles when nothing else can run.
- A constrained request finishes with stop reason `grammar` when its grammar is complete (only a stop token
  could follow), after EOS and before the token budget and the context window.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque

from omni_kernel.core.ar_scheduler import ARScheduler, ARSchedulerOutput, ARSequence
from omni_kernel.core.request import StageInput

from .grammar import Grammars


class GrammarScheduler(ARScheduler):
    def __init__(self, *args, grammars: Grammars, **kwargs):
        super().__init__(*args, **kwargs)
        self.grammars = grammars

    def add(self, item: StageInput) -> ARSequence:
        seq = super().add(item)
        self.grammars.add(item)
        return seq

    def schedule(self) -> ARSchedulerOutput:
        held = [s for s in self.waiting if not self.grammars.ready(s.request_id)]
        if not held:
            return super().schedule()
        held_ids = {id(s) for s in held}
        self.waiting = deque(s for s in self.waiting if id(s) not in held_ids)
        try:
            return super().schedule()
        finally:
            self.waiting.extend(held)  # behind the others: they were ready first

    def wait(self, timeout: float | None = None) -> bool:
        if self.running or any(self.grammars.ready(s.request_id) for s in self.waiting):
            return True
        pending = self.grammars.pending()
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return self.has_unfinished()

    def abort(self, request_id: str) -> ARSequence | None:
        self.grammars.free(request_id)
        return super().abort(request_id)

    def _stop_reason(self, seq: ARSequence, token: int) -> str | None:
        reason = super()._stop_reason(seq, token)
        if reason != "eos" and self.grammars.complete(seq.request_id):
            return "grammar"
        return reason
