"""wan_i2v through the runtime on the tiny checkpoint: output, equality with diffusers, abort, caches, trace."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omni_kernel import RequestFailed, RequestFinished, StageProgress
from omni_wan.images import open_image
from omni_wan.presets import DEFAULT_NEGATIVE_PROMPT

from wan_mp4 import read_mp4

SMALL = {"preset": "smoke", "height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 3, "seed": 11}


def test_end_to_end_mp4_has_requested_frames_and_size(omni, image_path, tmp_path):
    out = tmp_path / "clip.mp4"
    result = omni.generate("a cat surfing", image=str(image_path), **SMALL, output=str(out))
    assert result.path == str(out) and out.is_file()
    meta, frames = read_mp4(out)
    assert frames.shape == (9, 64, 96, 3)
    assert meta["codec"] == "h264" and meta["fps"] == 24
    assert [p.name for p in tmp_path.iterdir()] == ["clip.mp4"]  # no temp file left beside it


def test_runtime_equals_direct_diffusers_call(omni, tiny_model, image_path, tmp_path):
    from diffusers import WanImageToVideoPipeline

    params = {"height": 96, "width": 160, "num_frames": 13, "num_inference_steps": 4, "guidance_scale": 5.0, "seed": 7}
    ours = omni.generate("a red fox in the snow", image=str(image_path), **params,
                         output=str(tmp_path / "a.mp4"), return_frames=True).output.data["frames"]
    pipe = WanImageToVideoPipeline.from_pretrained(str(tiny_model), use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    direct = pipe(image=open_image(image_path), prompt="a red fox in the snow", negative_prompt=DEFAULT_NEGATIVE_PROMPT,
                  height=96, width=160, num_frames=13, num_inference_steps=4, guidance_scale=5.0,
                  generator=torch.Generator().manual_seed(7), output_type="np").frames[0]
    assert ours.shape == direct.shape == (13, 96, 160, 3)
    np.testing.assert_allclose(ours, direct, atol=1e-5, rtol=0)


def test_same_seed_same_video_other_seed_differs(omni, image_path, tmp_path):
    def frames(seed, name):
        params = {"preset": "smoke", "height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 3}
        return omni.generate("waves", image=str(image_path), **params, seed=seed, output=str(tmp_path / name),
                             return_frames=True).output.data["frames"]

    first, again, other = frames(3, "a.mp4"), frames(3, "b.mp4"), frames(4, "c.mp4")
    assert np.array_equal(first, again)
    assert not np.allclose(first, other)


def test_abort_between_denoise_steps_frees_and_writes_nothing(omni, image_path, tmp_path):
    out = tmp_path / "aborted.mp4"
    request = omni.request("a boat", image=str(image_path), **SMALL, output=str(out))
    omni.submit(request)
    scheduler = omni.graph.stages["wan"].engine.scheduler
    seen = []
    while not any(isinstance(e, StageProgress) and e.step >= 1 for e in seen):
        seen += omni.step()
    [job] = scheduler.queue
    assert job.step - 1 == 1  # after prepare and denoise step 1 of 3
    omni.abort(request.request_id)
    assert not scheduler.queue and omni.graph.stages["wan"].engine.runner.num_jobs == 0
    events = omni.step()
    assert [type(e) for e in events] == [RequestFailed] and events[0].error == "aborted"
    assert not omni.has_unfinished()
    assert list(tmp_path.iterdir()) == []


def test_repeated_request_hits_prepare_cache_and_warm_model(omni, image_path, tmp_path):
    from omni_kernel import Omni

    stages = omni.host.pm.get_plugin("omni_wan").stages  # the plugin owns the loaded models and the cache
    stages.pool.clear()
    stages.cache.clear()
    omni = Omni("wan_i2v", host=omni.host, device="cpu")  # its stage loads the model again, when it is built
    first = omni.generate("a lake", image=str(image_path), **SMALL, output=str(tmp_path / "1.mp4")).trace
    second = omni.generate("a lake", image=str(image_path), **SMALL, output=str(tmp_path / "2.mp4")).trace
    assert first["diffusion.load_was_cold"] is True and first["diffusion.load_ms"] > 0
    assert first["diffusion.prepare_cache_hit"] is False
    assert second["diffusion.load_was_cold"] is False and second["diffusion.load_ms"] == 0
    assert second["diffusion.prepare_cache_hit"] is True
    assert (second["diffusion.text_cache"], second["diffusion.image_cache"]) == ("hit", "hit")
    other = omni.generate("a river", image=str(image_path), **SMALL, output=str(tmp_path / "3.mp4")).trace
    assert (other["diffusion.text_cache"], other["diffusion.image_cache"]) == ("miss", "hit")


def test_trace_fields_and_progress(omni, image_path, tmp_path):
    events = list(omni.generate_stream("a kite", image=str(image_path), **SMALL,
                                       output=str(tmp_path / "k.mp4")))
    steps = [e.step for e in events if isinstance(e, StageProgress)]
    assert steps == [0, 1, 2, 3]
    trace = next(e for e in events if isinstance(e, RequestFinished)).result.trace
    assert not [key for key in trace if key.startswith(("diffusion.bridge", "diffusion.source"))]  # no bridge
    assert trace["diffusion.prompt"] == "a kite"
    assert (trace["diffusion.height"], trace["diffusion.width"], trace["diffusion.num_frames"],
            trace["diffusion.steps"], trace["diffusion.guidance"]) == (64, 96, 9, 3, 5.0)
    # the session pipeline is pinned to device="cpu": these are the CPU placement's values on any machine
    assert (trace["diffusion.device"], trace["diffusion.vae_dtype"], trace["diffusion.offload"]) == (
        "cpu", "fp32", "not applicable (CPU)")
    assert trace["diffusion.seed"] == 11 and trace["diffusion.elapsed_ms"] > 0
    phases = ("text_encode", "image_prepare", "latents", "denoise", "vae_decode", "export")
    assert all(trace[f"diffusion.{phase}_ms"] > 0 for phase in phases)


def test_profile_writes_chrome_trace_next_to_output(omni, image_path, tmp_path, caplog):
    out = tmp_path / "p.mp4"
    with caplog.at_level("INFO", logger="omni"):
        trace = omni.generate("a hill", image=str(image_path), **SMALL, output=str(out), profile=True).trace
    chrome = tmp_path / "p.trace.json"
    assert trace["diffusion.profile_trace"] == str(chrome)
    body = json.loads(chrome.read_text())
    spans = [e for e in body["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans if e["name"].startswith("denoise:")] == ["denoise:0", "denoise:1", "denoise:2"]
    assert {"text_encode", "image_prepare", "vae_decode", "export"} <= {e["name"] for e in spans}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert len(trace["diffusion.denoise_steps_ms"]) == 3
    assert "vae_decode" in caplog.text and "ms/step" in caplog.text


def test_vae_bf16_on_request(tiny_model, image_path, tmp_path):
    from omni_kernel import Omni

    omni = Omni("wan_i2v", model=str(tiny_model), vae_dtype="bf16", device="cpu")
    result = omni.generate("a cat", image=str(image_path), **SMALL, output=str(tmp_path / "bf16.mp4"))
    assert result.trace["diffusion.vae_dtype"] == "bf16" and result.trace["diffusion.vae_dtype_reason"] == "requested"
    assert read_mp4(tmp_path / "bf16.mp4")[1].shape == (9, 64, 96, 3)


def test_failed_export_leaves_no_file(omni, image_path, tmp_path, monkeypatch):
    from omni_wan import video

    def breaks_midway(pixels, out, *args, **kwargs):
        out.write_bytes(b"\0\0\0\x20ftyp")  # ffmpeg leaves a partial file behind ...
        raise KeyboardInterrupt  # ... when Ctrl-C arrives while it writes

    monkeypatch.setattr(video, "_ffmpeg", breaks_midway)
    with pytest.raises(KeyboardInterrupt):
        omni.generate("a storm", image=str(image_path), **SMALL, output=str(tmp_path / "x.mp4"))
    assert not omni.has_unfinished()
    assert omni.graph.stages["wan"].engine.runner.num_jobs == 0
    assert list(tmp_path.iterdir()) == []


def test_the_image_is_decoded_once_per_request(omni, image_path, tmp_path, monkeypatch):
    from PIL import ImageFile

    decodes = []
    real = ImageFile.ImageFile.load

    def counting(self):
        if self.tile:  # pixels still to read: a real decode, not a no-op re-load
            decodes.append(self.filename)
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting)
    for name in ("1.mp4", "2.mp4"):
        omni.generate("a cat", image=str(image_path), **SMALL, output=str(tmp_path / name))
    assert decodes == [str(image_path)] * 2


def test_without_output_the_video_goes_to_the_working_directory(omni, image_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = omni.generate("a dune", image=str(image_path), **SMALL)
    assert result.path == str(tmp_path / f"omni_{result.request_id}.mp4")
    assert [p.name for p in tmp_path.iterdir()] == [f"omni_{result.request_id}.mp4"]


def test_an_output_that_names_a_directory_is_refused_at_submit(omni, image_path, tmp_path):
    from omni_kernel import InvalidParameter

    (tmp_path / "clips.mp4").mkdir()
    with pytest.raises(InvalidParameter, match="is a directory; name a file such as"):
        omni.submit(omni.request("a dune", image=str(image_path), **SMALL, output=str(tmp_path / "clips.mp4")))
    assert not omni.has_unfinished()


def test_a_portrait_image_gets_a_portrait_video(omni, tmp_path):
    from PIL import Image

    from omni_kernel import StageInput
    from omni_wan.params import WanParams

    Image.new("RGB", (90, 160), "teal").save(tmp_path / "tall.png")
    stage = omni.graph.stages["wan"]
    item = stage.process(StageInput("r1", "a tower", image=str(tmp_path / "tall.png"), params=WanParams(preset="fast")))
    settings = item.processed.settings
    assert (settings.height, settings.width) == (640, 352) and item.processed.image.size == (90, 160)


def test_more_steps_than_the_scheduler_can_take_is_refused_before_any_work(omni, image_path, tmp_path):
    from omni_kernel import InvalidParameter
    from omni_wan.presets import max_steps

    runner = omni.graph.stages["wan"].engine.runner
    limit = max_steps(runner.layout.path)
    assert limit == 200  # UniPC with flow_shift 5 repeats a timestep from 201 steps
    with pytest.raises(InvalidParameter, match=f"past {limit} steps"):
        omni.generate("a fox", image=str(image_path), preset="smoke", num_inference_steps=limit + 1,
                      output=str(tmp_path / "x.mp4"))
    assert not (tmp_path / "x.mp4").exists() and runner.num_jobs == 0
