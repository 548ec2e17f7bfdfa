"""The call chain of one ar_text request, from Omni.generate down to the paged model's forward
(docs/architecture.md shows it): it reaches the forward, no function appears twice, no file is re-entered once the
chain has left it (nothing calls back up), and it stays within a sanity bound of project frames."""

from __future__ import annotations

import inspect

from omni_kernel import Omni
from omni_qwen.paged.decoder import PagedDecoder

MAX_FRAMES = 12


def chain_to(cls, method: str, run) -> list[tuple[str, str]]:
    """The (file, function) frames from `Omni.generate` to `cls.method`, outermost first, the project's only (the
    standard library's and torch's own wrappers left out)."""
    real, seen = getattr(cls, method), []

    def spy(self, *args, **kwargs):
        if not seen:
            frames = [(f.filename, f.function, f.frame.f_globals.get("__name__", ""))
                      for f in reversed(inspect.stack()[1:])]
            start = next(i for i, (_, function, module) in enumerate(frames)
                         if module == "omni_kernel.api" and function == "generate")
            seen.extend((filename, function) for filename, function, module in frames[start:]
                        if module.split(".")[0] in ("omni_kernel", "omni_qwen"))
            seen.append((inspect.getsourcefile(cls), f"{cls.__name__}.{method}"))
        return real(self, *args, **kwargs)

    setattr(cls, method, spy)
    try:
        run()
    finally:
        setattr(cls, method, real)
    return seen


def test_ar_text_reaches_the_forward_without_calling_back_up(host):
    omni = Omni("ar_text", host=host, ar_device="cpu")
    chain = chain_to(PagedDecoder, "forward", lambda: omni.generate("hi", max_tokens=2))
    assert chain, "the request never reached the model's forward"
    assert chain[-1][1] == "PagedDecoder.forward"
    assert len(chain) <= MAX_FRAMES, chain
    assert len(set(chain)) == len(chain), f"a function appears twice: {chain}"
    files = [filename for filename, _ in chain]
    left = set()
    for previous, current in zip(files, files[1:]):
        if current != previous:
            assert current not in left, f"{current} is re-entered after the chain left it: {chain}"
            left.add(previous)
