"""Guidance that cannot give a video: refused at submit (naming guidance_scale); latents that stop being finite
mid-way fail that request alone, with a clear error, while its batch neighbour finishes."""

from __future__ import annotations

import pytest

from omni_kernel import InvalidParameter, RequestFailed, RequestFinished

SMALL = {"preset": "smoke", "height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 3}


@pytest.mark.parametrize("guidance", [1e30, float("inf"), 100.5, -1])
def test_guidance_that_cannot_give_a_video_is_refused_at_submit(omni, image_path, tmp_path, guidance):
    with pytest.raises(InvalidParameter) as error:
        omni.submit(omni.request("a fox", image=str(image_path), guidance_scale=guidance, **SMALL,
                                 output=str(tmp_path / "x.mp4")))
    assert error.value.field == "guidance_scale"
    assert not omni.has_unfinished()


def test_latents_that_stop_being_finite_fail_that_request_alone(omni, image_path, tmp_path):
    model = omni.graph.stages["wan"].engine.runner.model
    real = model.denoise_batch

    def poisoned(states, steps, **kwargs):
        real(states, steps, **kwargs)
        for state, step in zip(states, steps):
            if state.guidance_scale == 7.0 and step == 1:  # request "bad", at its second denoise step
                state.latents = state.latents * float("nan")

    model.denoise_batch = poisoned
    try:
        for rid, guidance in (("good", 5.0), ("bad", 7.0)):
            omni.submit(omni.request("a fox", image=str(image_path), request_id=rid, guidance_scale=guidance,
                                     seed=1, output=str(tmp_path / f"{rid}.mp4"), **SMALL))
        events = []
        while omni.has_unfinished():
            events += omni.step()
    finally:
        del model.denoise_batch
    failed = {e.request_id: e for e in events if isinstance(e, RequestFailed)}
    finished = {e.request_id for e in events if isinstance(e, RequestFinished)}
    assert finished == {"good"} and set(failed) == {"bad"}
    assert "stopped being finite at denoise step 2 of 3" in failed["bad"].error and "guidance_scale 7" in \
        failed["bad"].error
    assert (tmp_path / "good.mp4").is_file() and not (tmp_path / "bad.mp4").exists()
