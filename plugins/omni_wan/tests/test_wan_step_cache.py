"""The step cache, decided per request inside the continuous batch, against diffusers' own hooks.

The oracle: each cached request of a mixed batch (methods and thresholds apart, an uncached neighbour, text and
image rows, joining at different steps, one aborted) gets the frames and the skipped-forward count of the same
request run alone through a diffusers Wan pipeline with diffusers' FirstBlockCache or MagCache hook at the same
threshold. Each decision keeps a margin to its threshold (logged), so float rounding between a batched and a
solo forward cannot flip one.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from omni_kernel import InvalidParameter, Omni, RequestFailed, RequestFinished, StageProgress
from omni_kernel.cli import main
from omni_wan import calibration
from omni_wan.images import open_image
from omni_wan.presets import DEFAULT_NEGATIVE_PROMPT

SIZE = {"height": 64, "width": 96, "num_frames": 9}
STEPS = 12
TOLERANCE = 1e-4  # fp32, max abs difference of the frames
MIN_MARGIN = 1e-4  # |signal - threshold| of every decision: far above a batched forward's rounding (~1e-6)
# rid: (prompt, image or None, seed, guidance, step_cache, threshold)
REQUESTS = {"fb_text": ("a red fox in the snow", None, 1, 5.0, "first_block", 0.1),
            "fb_image": ("a boat on a calm lake", "noise", 2, 4.0, "first_block", 0.2),
            "plain": ("a city street at night", "blue", 3, 6.0, None, None),
            "mag_image": ("a kite over a field", "blue", 4, 5.0, "mag", 0.1),
            "mag_text": ("a lighthouse in a storm", None, 5, 3.0, "mag", 0.06),
            "aborted": ("a hot air balloon", None, 6, 5.0, "first_block", 0.1)}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    Image.new("RGB", (120, 80), "blue").save(folder / "blue.png")
    Image.fromarray(rng.integers(0, 256, (80, 120, 3), dtype=np.uint8)).save(folder / "noise.png")
    return {"blue": str(folder / "blue.png"), "noise": str(folder / "noise.png")}


@pytest.fixture(scope="module")
def mixed(omni, tiny_model):
    """A Wan node taking text and image requests (image policy `optional`), on the session's host."""
    from omni_kernel import NodeSpec, PipelinePlan
    from omni_wan.plugin import NODE_TYPE

    plan = PipelinePlan("wan_cached", [NodeSpec("wan", NODE_TYPE, final=True, policy={"image": "optional"})])
    return Omni(plan, host=omni.host, model=str(tiny_model), device="cpu")


@pytest.fixture(scope="module")
def ratios(mixed, tiny_model):
    """The tiny checkpoint's MagCache ratios, recorded as `omni wan-calibrate` records them."""
    model = mixed.graph.stages["wan"].engine.runner.model
    values = calibration.calibrate(model, "a calm lake at sunrise", **SIZE, steps=STEPS, guidance_scale=5.0, seed=0)
    calibration.record(tiny_model, values, {"steps": STEPS})
    return values


def _request(omni, rid, images, folder, **overrides):
    prompt, image, seed, guidance, method, threshold = REQUESTS[rid]
    params = {"step_cache": method, "step_cache_threshold": threshold, **overrides}
    return omni.request(prompt, image=images[image] if image else None, request_id=rid, **SIZE,
                        num_inference_steps=STEPS, seed=seed, guidance_scale=guidance,
                        output=str(folder / f"{rid}.mp4"), return_frames=True, **params)


class Counted:
    """Diffusers pipelines of the tiny checkpoint, counting the transformer forwards whose blocks after the first
    did not run (block 1's attention was not called): the forwards the cache hook skipped."""

    def __init__(self, path):
        from diffusers import WanImageToVideoPipeline, WanPipeline

        self.pipes = {"text": WanPipeline.from_pretrained(str(path), use_safetensors=True)}
        self.pipes["image"] = WanImageToVideoPipeline.from_pretrained(str(path), use_safetensors=True)
        self.counts = {"forwards": 0, "blocks": 0}
        for pipe in self.pipes.values():
            pipe.set_progress_bar_config(disable=True)
            pipe.transformer.register_forward_pre_hook(lambda *a: self._count("forwards"))
            pipe.transformer.blocks[1].attn1.register_forward_pre_hook(lambda *a: self._count("blocks"))

    def _count(self, what: str) -> None:
        self.counts[what] += 1

    def run(self, rid: str, images, ratios) -> tuple[np.ndarray, int]:
        from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig

        prompt, image, seed, guidance, method, threshold = REQUESTS[rid]
        pipe = self.pipes["image" if image else "text"]
        if method == "first_block":
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        elif method == "mag":
            pipe.transformer.enable_cache(MagCacheConfig(threshold=threshold, num_inference_steps=STEPS,
                                                         mag_ratios=ratios))
        self.counts.update(forwards=0, blocks=0)
        extra = {"image": open_image(images[image])} if image else {}
        try:
            frames = pipe(prompt=prompt, negative_prompt=DEFAULT_NEGATIVE_PROMPT, **SIZE, num_inference_steps=STEPS,
                          guidance_scale=guidance, generator=torch.Generator().manual_seed(seed), output_type="np",
                          **extra).frames[0]
        finally:
            if method is not None:
                pipe.transformer.disable_cache()
        return frames, self.counts["forwards"] - self.counts["blocks"]


def _step_until(omni, events: list, done) -> None:
    while not done():
        events += omni.step()


def _progressed(events, rid, step) -> bool:
    return any(isinstance(e, StageProgress) and e.request_id == rid and e.step >= step for e in events)


def test_a_mixed_batch_equals_each_request_alone_through_diffusers_hooks(mixed, images, ratios, tiny_model, tmp_path):
    runner = mixed.graph.stages["wan"].engine.runner
    batches, real = [], runner.run
    runner.run = lambda batch: (batch.phase == "denoise" and batches.append(len(batch.records))) or real(batch)
    events, caches = [], {}
    before = mixed.graph.stages["wan"].stats()
    try:
        for rid in ("fb_text", "plain", "aborted", "mag_text"):
            mixed.submit(_request(mixed, rid, images, tmp_path))
        _step_until(mixed, events, lambda: _progressed(events, "fb_text", 2))
        mixed.submit(_request(mixed, "fb_image", images, tmp_path))  # an image row joins at step 2
        _step_until(mixed, events, lambda: _progressed(events, "fb_text", 4))
        mixed.submit(_request(mixed, "mag_image", images, tmp_path))  # and another at step 4
        _step_until(mixed, events, lambda: _progressed(events, "aborted", 6))
        job = next(r for r in runner_records(mixed) if r.request_id == "aborted")
        caches["aborted"] = weakref.ref(job.state.step_cache)
        aborted_skipped = job.state.step_cache.num_skipped
        del job
        mixed.abort("aborted")
        _step_until(mixed, events, lambda: not mixed.has_unfinished())
    finally:
        del runner.run
    gc.collect()
    assert caches["aborted"]() is None  # the aborted request's cache state went with its record
    assert [e.error for e in events if isinstance(e, RequestFailed)] == ["aborted"]
    assert max(batches) == 6  # all six shared forwards before the abort
    finished = {e.request_id: e.result for e in events if isinstance(e, RequestFinished)}
    assert sorted(finished) == ["fb_image", "fb_text", "mag_image", "mag_text", "plain"]

    stats = mixed.graph.stages["wan"].stats()  # what /metrics publishes as omni_step_cache_hits / _misses
    skipped = sum(r.trace["diffusion.step_cache_skipped_forwards"] for r in finished.values()) + aborted_skipped
    assert stats.model["step_cache_hits"] - before.model["step_cache_hits"] == skipped
    assert stats.model["step_cache_misses"] > before.model["step_cache_misses"]

    diffusers = Counted(tiny_model)
    for rid, result in sorted(finished.items()):
        trace = result.trace
        frames, skipped = diffusers.run(rid, images, ratios)
        diff = float(np.abs(result.output.data["frames"] - frames).max())
        print(f"{rid}: {trace['diffusion.step_cache']} at {trace['diffusion.step_cache_threshold']}: skipped "
              f"{trace['diffusion.step_cache_skipped_forwards']} of {2 * STEPS} forwards (diffusers {skipped}), "
              f"margin {trace.get('diffusion.step_cache_margin')}, max abs diff {diff:.2e}")
        assert diff <= TOLERANCE, (rid, diff)
        assert trace["diffusion.step_cache_skipped_forwards"] == skipped, rid
        progress = [e.from_cache for e in events if isinstance(e, StageProgress) and e.request_id == rid]
        if REQUESTS[rid][4] is None:
            assert skipped == 0 and trace["diffusion.step_cache"] == "none" and set(progress) == {None}
            continue
        assert 0 < skipped < 2 * STEPS, rid  # neither silently off nor always on
        assert trace["diffusion.step_cache_margin"] >= MIN_MARGIN, rid
        assert 0 < trace["diffusion.step_cache_skipped_share"] < 1
        assert len(progress) == STEPS + 1 and any(progress[1:]) and progress[0] is None


def runner_records(omni):
    return list(omni.graph.stages["wan"].engine.scheduler.queue)


def test_threshold_zero_is_bit_identical_to_no_cache(mixed, images, ratios, tmp_path):
    """`ratios`: mag needs them recorded; under pytest-xdist this test may run on a worker the others did not."""
    base = mixed.generate(_request(mixed, "fb_image", images, tmp_path / "none", step_cache=None,
                                   step_cache_threshold=None))
    for method in ("first_block", "mag"):
        zero = mixed.generate(_request(mixed, "fb_image", images, tmp_path / method, step_cache=method,
                                       step_cache_threshold=0.0))
        assert zero.trace["diffusion.step_cache"] == method
        assert zero.trace["diffusion.step_cache_skipped_forwards"] == 0
        assert np.array_equal(zero.output.data["frames"], base.output.data["frames"]), method


def test_calibration_records_what_diffusers_calibration_mode_prints(ratios, tiny_model, capsys):
    from diffusers import WanPipeline
    from diffusers.hooks import MagCacheConfig

    pipe = WanPipeline.from_pretrained(str(tiny_model), use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
    capsys.readouterr()
    pipe(prompt="a calm lake at sunrise", negative_prompt=DEFAULT_NEGATIVE_PROMPT, **SIZE, num_inference_steps=STEPS,
         guidance_scale=5.0, generator=torch.Generator().manual_seed(0), output_type="np")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[") and "MagCache" not in line]
    cond = [float(v) for v in printed[0].strip("[]").split(",")]  # the cond context finishes first
    assert len(cond) == len(ratios) == STEPS
    assert np.allclose(cond, ratios, rtol=0, atol=1e-5), (cond, ratios)
    assert calibration.load_ratios(tiny_model) == ratios


def test_bad_step_cache_values_are_refused_naming_the_field(mixed, tiny_model, images, tmp_path, monkeypatch):
    cases = {"step_cache_threshold": [{"step_cache": "first_block", "step_cache_threshold": -0.1},
                                      {"step_cache": "first_block", "step_cache_threshold": float("inf")},
                                      {"step_cache_threshold": 0.1}],
             "step_cache": [{"step_cache": "teacache"}]}
    for field, params in cases.items():
        for values in params:
            with pytest.raises(InvalidParameter) as info:
                mixed.submit(mixed.request("a cat", **SIZE, output=str(tmp_path / "x.mp4"), **values))
            assert info.value.field == field, values
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "empty_cache"))  # no calibration recorded there
    with pytest.raises(InvalidParameter, match="omni wan-calibrate") as info:
        mixed.submit(mixed.request("a cat", **SIZE, output=str(tmp_path / "x.mp4"), step_cache="mag"))
    assert info.value.field == "step_cache"
    assert not mixed.has_unfinished()


def test_the_cli_flags_come_from_the_declared_params(tiny_model, tmp_path):
    out = tmp_path / "v.mp4"
    result = CliRunner().invoke(main, ["run", "--pipeline", "wan_t2v", "--prompt", "a cat", "--model", str(tiny_model),
                                       "--step-cache", "first_block", "--step-cache-threshold", "-1",
                                       "--output", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("omni: loading Wan2.2")]
    assert len(lines) == 1 and "step_cache_threshold" in lines[0], result.stderr
    assert not out.exists()
    help_text = CliRunner().invoke(main, ["run", "--help"]).output
    assert "--step-cache [none|first_block|mag]" in help_text and "--step-cache-threshold" in help_text


def test_wan_calibrate_refuses_a_bad_size_in_one_line(tiny_model):
    result = CliRunner().invoke(main, ["wan-calibrate", "--model", str(tiny_model), "--height", "65"])
    assert result.exit_code == 2 and "height" in result.stderr and "Traceback" not in result.output
