"""GrammarScheduler: the kernel's ARScheduler, plus what constrained requests need from the one owner of progress.

A request's grammar state is in its record (`ARSequence.state.constrained`, which the runner sets when the engine
takes the request: runner.py); the engine's Grammars (its compile cache) is shared.

- A request whose grammar is still compiling stays in its place in the waiting queue, not admitted, while the
  others run (so a compile never stalls their steps); `wait` blocks on the compiles when nothing else can run.
- A constrained request finishes with stop reason `stop` (as at a stop string: what OpenAI's API reports) when its
  grammar is complete (only a stop token could follow), after EOS and before the token budget and the context
  window.
"""

from __future__ import annotations

import concurrent.futures

from omni_kernel.core.ar_scheduler import ARScheduler, ARSequence

from .grammar import Grammars


def ready(seq: ARSequence) -> bool:
    """Whether the request can be scheduled: unconstrained, or its grammar is compiled (or failed)."""
    constrained = seq.state.constrained
    return constrained is None or constrained.ready


class GrammarScheduler(ARScheduler):
    def __init__(self, *args, grammars: Grammars, **kwargs):
        super().__init__(*args, **kwargs)
        self.grammars = grammars

    def admissible(self, seq: ARSequence) -> bool:
        return ready(seq)

    def wait(self, timeout: float | None = None) -> bool:
        if self.running or any(ready(s) for s in self.waiting):
            return True
        pending = self.grammars.pending()
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return self.has_unfinished()

    def _stop_reason(self, seq: ARSequence, token: int) -> str | None:
        reason = super()._stop_reason(seq, token)
        constrained = seq.state.constrained
        if reason != "eos" and constrained is not None and constrained.done:
            return "stop"
        return reason
