"""The call chain of one wan_i2v request, from Omni.generate down to the transformer's forward
(docs/architecture.md shows it): it reaches the forward, no function appears twice, no file is re-entered once
the chain has left it (no layer calls back up), and at most 12 of omni's frames lie between the two."""

from __future__ import annotations

import inspect

from diffusers import WanTransformer3DModel

MAX_FRAMES = 12


def test_wan_i2v_reaches_the_forward_plainly(omni, image_path, tmp_path):
    real, chain = WanTransformer3DModel.forward, []

    def spy(self, *args, **kwargs):
        if not chain:  # outermost first; omni's own frames only (torch's, diffusers' and contextlib's left out)
            frames = [f for f in reversed(inspect.stack()[1:]) if f.frame.f_globals["__name__"].startswith("omni_")]
            chain.extend((f.frame.f_globals["__name__"], f.function, f.filename) for f in frames)
        return real(self, *args, **kwargs)

    WanTransformer3DModel.forward = spy
    try:
        omni.generate("a cat", image=str(image_path), preset="smoke", output=str(tmp_path / "cat.mp4"))
    finally:
        WanTransformer3DModel.forward = real
    names = [f"{module}.{function}" for module, function, _ in chain]
    assert "omni_kernel.api.generate" in names, names  # the forward was reached from Omni.generate
    chain = chain[names.index("omni_kernel.api.generate"):]
    names = names[names.index("omni_kernel.api.generate"):]
    assert names[-1] == "omni_wan.model.denoise_batch", names
    assert len(names) == len(set(names)), f"a function appears twice: {names}"
    files = [filename for _, _, filename in chain]
    left = [f for i, f in enumerate(files) if i and files[i - 1] != f and f in files[:i - 1]]
    assert not left, f"{left} re-entered once the chain had left it: {names}"
    assert len(names) <= MAX_FRAMES, names
