"""The call chain of one wan_i2v request, from Omni.generate down to the transformer's forward: at most 7 frames
(docs/architecture.md shows it; torch's own wrappers left out), none of them calling back up."""

from __future__ import annotations

import inspect

from diffusers import WanTransformer3DModel


def test_wan_i2v_reaches_the_forward_in_seven_frames(omni, image_path, tmp_path):
    real, seen = WanTransformer3DModel.forward, []

    def spy(self, *args, **kwargs):
        if not seen:
            names = [f"{f.frame.f_globals['__name__']}.{f.function}" for f in inspect.stack()[1:]]
            names = [n for n in names if not n.startswith("torch.")]
            seen.extend(reversed(names[:names.index("omni_kernel.core.stage_scheduler.generate") + 1]))
        return real(self, *args, **kwargs)

    WanTransformer3DModel.forward = spy
    try:
        omni.generate("a cat", image=str(image_path), preset="smoke", output=str(tmp_path / "cat.mp4"))
    finally:
        WanTransformer3DModel.forward = real
    assert seen == ["omni_kernel.core.stage_scheduler.generate", "omni_kernel.core.stage_scheduler.step",
                    "omni_kernel.core.stage.step", "omni_kernel.core.engine.step", "omni_wan.runner.run",
                    "omni_wan.model.denoise_batch"]
