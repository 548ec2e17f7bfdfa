"""wan_t2v: TI2V-5B's text-to-video half on the same node type and checkpoint. Equality with a direct diffusers
WanPipeline call, the preset's landscape size, the trace, the CLI, and the image policy's refusals at submit."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from omni_kernel import InvalidParameter, ModelError, Omni, RequestFinished, StageProgress
from omni_kernel.cli import main
from omni_wan.presets import DEFAULT_NEGATIVE_PROMPT

from wan_mp4 import read_mp4

SMALL = {"preset": "smoke", "height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 3, "seed": 11}


@pytest.fixture(scope="module")
def t2v(omni, tiny_model):
    """wan_t2v on the session's plugin host: the same loaded model as the wan_i2v fixture."""
    return Omni("wan_t2v", host=omni.host, model=str(tiny_model), device="cpu")


def test_t2v_equals_direct_wan_pipeline_call(t2v, tiny_model, tmp_path):
    from diffusers import WanPipeline

    params = {"height": 96, "width": 160, "num_frames": 13, "num_inference_steps": 4, "guidance_scale": 5.0, "seed": 7}
    ours = t2v.generate("a red fox in the snow", **params, output=str(tmp_path / "a.mp4"),
                        return_frames=True).output.data["frames"]
    pipe = WanPipeline.from_pretrained(str(tiny_model), use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config.expand_timesteps
    direct = pipe(prompt="a red fox in the snow", negative_prompt=DEFAULT_NEGATIVE_PROMPT, height=96, width=160,
                  num_frames=13, num_inference_steps=4, guidance_scale=5.0,
                  generator=torch.Generator().manual_seed(7), output_type="np").frames[0]
    assert ours.shape == direct.shape == (13, 96, 160, 3)
    diff = float(np.abs(ours - direct).max())
    print(f"wan_t2v vs WanPipeline: max abs diff {diff:.2e}")
    assert diff <= 1e-5


def test_t2v_mp4_trace_progress_and_the_preset_size(t2v, tmp_path):
    out = tmp_path / "t.mp4"
    events = list(t2v.generate_stream("a kite over a field", preset="smoke", seed=3, num_inference_steps=2,
                                      output=str(out), profile=True))
    assert [e.step for e in events if isinstance(e, StageProgress)] == [0, 1, 2]
    trace = next(e for e in events if isinstance(e, RequestFinished)).result.trace
    assert (trace["diffusion.height"], trace["diffusion.width"]) == (128, 128)  # the smoke preset's size
    assert trace["diffusion.task"] == "text_to_video" and trace["diffusion.image_cache"] == "none"
    assert "diffusion.image_prepare_ms" not in trace  # no image phase
    assert all(trace[f"diffusion.{p}_ms"] > 0 for p in ("text_encode", "latents", "denoise", "vae_decode", "export"))
    assert len(trace["diffusion.denoise_steps_ms"]) == 2 and (tmp_path / "t.trace.json").is_file()
    assert read_mp4(out)[1].shape == (9, 128, 128, 3)
    again = t2v.generate("a kite over a field", preset="smoke", seed=3, num_inference_steps=2,
                         output=str(tmp_path / "again.mp4")).trace
    assert again["diffusion.prepare_cache_hit"] is True and again["diffusion.text_cache"] == "hit"


def test_without_an_image_the_size_is_the_presets_landscape(t2v):
    from omni_kernel import StageInput
    from omni_wan.params import WanParams

    stage = t2v.graph.stages["wan"]
    item = stage.process(StageInput("r1", "a tower", params=WanParams(preset="fast")))
    assert (item.processed.settings.height, item.processed.settings.width) == (352, 640)
    assert item.processed.image is None and item.processed.digest is None


def test_an_image_to_wan_t2v_or_none_to_wan_i2v_is_refused_at_submit(t2v, omni, image_path, tmp_path):
    for pipeline, image, says in ((t2v, str(image_path), "takes no image: drop --image"),
                                  (omni, None, "needs an input image: pass --image PATH")):
        runner = pipeline.graph.stages["wan"].engine.runner
        with pytest.raises(InvalidParameter, match=says) as info:
            pipeline.submit(pipeline.request("a fox", image=image, **SMALL, output=str(tmp_path / "x.mp4")))
        assert info.value.field == "image" and str(info.value).startswith("invalid image: ")
        assert not pipeline.has_unfinished() and runner.num_jobs == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pipeline, with_image, says", [("wan_t2v", True, "takes no image: drop --image"),
                                                        ("wan_i2v", False, "needs an input image")])
def test_cli_bad_image_use_is_one_line_exit_2_before_the_model_loads(pipeline, with_image, says, tiny_model,
                                                                     image_path, tmp_path):
    out = tmp_path / "out" / "v.mp4"
    args = ["run", "--pipeline", pipeline, "--prompt", "a cat", "--model", str(tiny_model), "--output", str(out)]
    result = CliRunner().invoke(main, args + (["--image", str(image_path)] if with_image else []))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()  # refused before the model loads: no load line
    assert len(lines) == 1 and lines[0].startswith("Error: invalid --image: ") and says in lines[0], result.stderr
    assert not out.exists() and not out.parent.exists()


def test_cli_runs_wan_t2v_from_a_prompt(tiny_model, tmp_path):
    out, trace_json = tmp_path / "t2v.mp4", tmp_path / "trace.json"
    result = CliRunner().invoke(main, ["run", "--pipeline", "wan_t2v", "--prompt", "a cat surfing", "--model",
                                       str(tiny_model), "--preset", "smoke", "--steps", "2", "--seed", "4",
                                       "--output", str(out), "--trace-json", str(trace_json)])
    assert result.exit_code == 0, result.output
    trace = json.loads(trace_json.read_text())
    assert trace["diffusion.task"] == "text_to_video" and trace["diffusion.seed"] == 4
    assert read_mp4(out)[1].shape == (9, 128, 128, 3)


def test_a_checkpoint_without_text_to_video_is_refused_in_one_line(tiny_model, tmp_path):
    """An image-only model's transformer takes the image's channels beside the latents (Wan2.1/2.2 I2V: 36 for
    16): wan_t2v refuses it when the stage is built, before any weight is read."""
    model = tmp_path / "i2v_only"
    shutil.copytree(tiny_model, model)
    config = model / "transformer" / "config.json"
    body = json.loads(config.read_text())
    config.write_text(json.dumps({**body, "in_channels": 2 * body["in_channels"]}))
    with pytest.raises(ModelError, match="has no text-to-video path: its transformer takes 96 input channels, "
                                         "the VAE's latents 48"):
        Omni("wan_t2v", model=str(model), device="cpu")
    result = CliRunner().invoke(main, ["run", "--pipeline", "wan_t2v", "--prompt", "x", "--model", str(model),
                                       "--output", str(tmp_path / "x.mp4")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "no text-to-video path" in result.stderr and not (tmp_path / "x.mp4").exists()
