"""What `omni serve --pipeline ar_text --pipeline wan_i2v --pipeline wan_t2v --pipeline qwen_to_wan_i2v` builds
(AsyncOmni.build on one plugin host): one AR engine and one diffusion engine under all four pipelines, one copy of
each model's weights, and requests of different pipelines in one forward."""

from __future__ import annotations

import asyncio
from pathlib import Path

from omni_kernel import RequestFinished
from omni_kernel.plugins import load_host
from omni_serve.async_omni import AsyncOmni

ASSET = Path(__file__).resolve().parents[3] / "examples" / "assets" / "image.png"
SMALL = {"height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 3}


def test_four_pipelines_share_one_ar_engine_one_wan_engine_and_their_batches(omni_cache, tmp_path):
    names = ("ar_text", "wan_i2v", "wan_t2v", "qwen_to_wan_i2v")
    config = {"ar_text": {"ar_device": "cpu"}, "wan_i2v": {"device": "cpu"}, "wan_t2v": {"device": "cpu"},
              "qwen_to_wan_i2v": {"ar_device": "cpu", "device": "cpu"}}  # as `omni serve` splits its -c pairs
    async_omni = AsyncOmni.build({n: (n, config[n]) for n in names}, load_host())
    stages = {n: omni.graph.stages for n, omni in async_omni.omnis.items()}
    ar = [stages["ar_text"]["generate"], stages["qwen_to_wan_i2v"]["bridge"]]
    wan = [stages["wan_i2v"]["wan"], stages["wan_t2v"]["wan"], stages["qwen_to_wan_i2v"]["video"]]
    assert len({id(s.engine) for s in ar}) == 1 and len({id(s.engine) for s in wan}) == 1  # the kernel's share keys
    pipes = {id(s.engine.runner.model.pipe.transformer) for s in wan}
    lms = {id(s.engine.runner.backend.model) for s in ar}  # the paged decoder over the one loaded model
    assert len(pipes) == 1 and len(lms) == 1
    assert len({s.stats().kv_blocks_total for s in ar}) == 1  # one KV pool, reported under both pipelines

    async def run(name, prompt, **params):
        async for event in async_omni.generate(name, prompt, **params):
            if isinstance(event, RequestFinished):
                return event.result
        raise AssertionError(f"{name}: no RequestFinished")

    async def both():
        return await asyncio.gather(
            run("wan_i2v", "a red fox", image=str(ASSET), seed=1, output=str(tmp_path / "i.mp4"), **SMALL),
            run("wan_t2v", "a kite", seed=2, output=str(tmp_path / "t.mp4"), **SMALL))

    with async_omni:
        i2v, t2v = asyncio.run(both())
    assert i2v.trace["diffusion.batch_size_max"] == t2v.trace["diffusion.batch_size_max"] == 2, (i2v.trace, t2v.trace)
