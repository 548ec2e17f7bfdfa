"""The call chain of one ar_text request, from Omni.generate down to the paged model's forward: at most 7 frames
(docs/architecture.md shows it), none of them calling back up."""

from __future__ import annotations

import inspect

from omni_kernel import Omni
from omni_qwen.paged.decoder import PagedDecoder


def chain_to(cls, method: str, run) -> list[str]:
    """The frames from the stage scheduler's `generate` to `cls.method`, outermost first (torch's own wrappers
    left out)."""
    real, seen = getattr(cls, method), []

    def spy(self, *args, **kwargs):
        if not seen:
            names = [f"{f.frame.f_globals['__name__']}.{f.function}" for f in inspect.stack()[1:]]
            names = [n for n in names if not n.startswith("torch.")]
            seen.extend(reversed(names[:names.index("omni_kernel.core.stage_scheduler.generate") + 1]))
        return real(self, *args, **kwargs)

    setattr(cls, method, spy)
    try:
        run()
    finally:
        setattr(cls, method, real)
    return seen + [f"{cls.__name__}.{method}"]


def test_ar_text_reaches_the_forward_in_seven_frames(host):
    omni = Omni("ar_text", host=host, ar_device="cpu")
    chain = chain_to(PagedDecoder, "forward", lambda: omni.generate("hi", max_tokens=2))
    assert chain == ["omni_kernel.core.stage_scheduler.generate", "omni_kernel.core.stage_scheduler.step",
                     "omni_kernel.core.stage.step", "omni_kernel.core.engine.step", "omni_qwen.runner.run",
                     "omni_qwen.backends.forward", "PagedDecoder.forward"]
