"""The call chain of one wan_i2v request, from Omni.generate down to the transformer's forward
(docs/architecture.md shows it): it reaches the forward, no function appears twice, no file is re-entered once
the chain has left it (no layer calls back up), and at most 12 of omni's frames lie between the two."""

from __future__ import annotations

from diffusers import WanTransformer3DModel

from omni_kernel.testing import assert_chain_goes_down, call_chain

MAX_FRAMES = 12


def test_wan_i2v_reaches_the_forward_plainly(omni, image_path, tmp_path):
    chain = call_chain(WanTransformer3DModel, "forward", lambda: omni.generate(
        "a cat", image=str(image_path), preset="smoke", output=str(tmp_path / "cat.mp4")))
    assert_chain_goes_down(chain, MAX_FRAMES + 1)  # the transformer's forward, diffusers' own, is the last frame
    assert chain[-2].name == "omni_wan.model.denoise_batch", chain  # omni's last frame calls the forward
