"""Continuous batching of wan_i2v: requests at different denoise steps share one forward and still get their solo
frames; the per-step token budget; the scheduler's cost budget and phase order."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from omni_kernel import InvalidParameter, Omni, RequestFailed, RequestFinished, StageProgress
from omni_kernel.core.request import StageInput
from omni_kernel.core.scheduler import PhaseScheduler, StepScheduler

SIZE = {"preset": "smoke", "height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 5}
# different prompts, images, seeds and guidance scales (all with CFG: one batch key)
REQUESTS = {"a": ("a red fox in the snow", "red", 1, 5.0), "b": ("a boat on a calm lake", "noise", 2, 3.0),
            "c": ("a city street at night", "blue", 3, 7.5), "d": ("a kite over a field", "green", 4, 4.0)}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = {}
    for name in ("red", "blue", "green"):
        Image.new("RGB", (120, 80), name).save(folder / f"{name}.png")
        paths[name] = str(folder / f"{name}.png")
    Image.fromarray(rng.integers(0, 256, (80, 120, 3), dtype=np.uint8)).save(folder / "noise.png")
    paths["noise"] = str(folder / "noise.png")
    return paths


def _request(omni, rid, images, tmp_path):
    prompt, image, seed, guidance = REQUESTS[rid]
    return omni.request(prompt, image=images[image], request_id=rid, **SIZE, seed=seed, guidance_scale=guidance,
                        output=str(tmp_path / f"{rid}.mp4"), return_frames=True)


def test_requests_at_different_steps_share_forwards_and_match_their_solo_runs(omni, images, tmp_path):
    runner = omni.graph.stages["wan"].engine.runner
    calls, decodes = [], []
    real = runner.run

    def spy(batch):
        rids = [r.request_id for r in batch.records]
        if batch.phase == "denoise":
            calls.append({rid: step - 1 for rid, step in zip(rids, batch.steps)})  # the scheduler's step 0: prepare
        if batch.phase == "decode":
            decodes.append(sorted(rids))
        return real(batch)

    runner.run = spy
    events = []
    try:
        omni.submit(_request(omni, "a", images, tmp_path))
        omni.submit(_request(omni, "b", images, tmp_path))
        omni.submit(_request(omni, "d", images, tmp_path))

        def progressed(rid, step):
            return any(isinstance(e, StageProgress) and e.request_id == rid and e.step >= step for e in events)

        while not progressed("a", 2):
            events += omni.step()
        omni.submit(_request(omni, "c", images, tmp_path))  # joins while a, b and d are mid-way
        while not progressed("d", 3):
            events += omni.step()
        omni.abort("d")  # aborted mid-way: its neighbours go on
        while omni.has_unfinished():
            events += omni.step()
    finally:
        del runner.run

    assert {"a": 2, "b": 2, "d": 2, "c": 0} in calls  # c's first step rides with the others' third
    assert all(len(batch) > 1 for batch in calls[:5])
    assert decodes == [["a", "b"], ["c"]]  # a and b finish at the same step: one VAE decode
    assert [e.error for e in events if isinstance(e, RequestFailed)] == ["aborted"]
    assert not (tmp_path / "d.mp4").exists() and "d" not in omni.graph.stages["wan"].engine.request_ids()
    finished = {e.request_id: e.result for e in events if isinstance(e, RequestFinished)}
    assert sorted(finished) == ["a", "b", "c"]
    for rid in "abc":
        progress = [e.step for e in events if isinstance(e, StageProgress) and e.request_id == rid]
        assert progress == [0, 1, 2, 3, 4, 5]
        trace = finished[rid].trace
        assert trace["diffusion.batch_size_max"] >= 3 and trace["diffusion.cfg_batched"] is True
        assert 1 <= trace["diffusion.batch_size_mean"] <= trace["diffusion.batch_size_max"]
        assert trace["diffusion.denoise_ms"] > 0

    solo_dir = tmp_path / "solo"
    for rid in "abc":
        solo = omni.generate(_request(omni, rid, images, solo_dir))
        assert solo.trace["diffusion.batch_size_max"] == 1
        ours, alone = finished[rid].output.data["frames"], solo.output.data["frames"]
        assert ours.shape == alone.shape == (9, 64, 96, 3)
        diff = float(np.abs(ours - alone).max())
        assert diff <= 1e-3, (rid, diff)
        print(f"{rid}: max abs diff vs solo {diff:.2e}")


def test_cfg_off_and_on_do_not_share_a_forward_but_both_batch(omni, images, tmp_path):
    runner = omni.graph.stages["wan"].engine.runner
    sizes = []
    real = runner.run
    runner.run = lambda batch: (batch.phase == "denoise" and sizes.append(sorted(r.request_id for r in batch.records))
                                or real(batch))
    try:
        for rid, guidance in (("on1", 5.0), ("off1", 1.0), ("on2", 2.0), ("off2", 1.0)):
            omni.submit(omni.request("waves", image=images["blue"], request_id=rid, **SIZE, seed=5,
                                     guidance_scale=guidance, output=str(tmp_path / f"{rid}.mp4")))
        events = []
        while omni.has_unfinished():
            events += omni.step()
    finally:
        del runner.run
    assert {tuple(s) for s in sizes} == {("on1", "on2"), ("off1", "off2")}
    traces = {e.request_id: e.result.trace for e in events if isinstance(e, RequestFinished)}
    assert traces["off1"]["diffusion.cfg_batched"] is False and traces["on1"]["diffusion.cfg_batched"] is True


def test_two_forward_cfg_equals_one_forward_cfg(omni, images, tmp_path):
    runner = omni.graph.stages["wan"].engine.runner
    one = omni.generate(_request(omni, "a", images, tmp_path / "one"))
    runner.cfg_batched = False
    try:
        two = omni.generate(_request(omni, "a", images, tmp_path / "two"))
    finally:
        runner.cfg_batched = True
    assert two.trace["diffusion.cfg_batched"] is False
    assert float(np.abs(one.output.data["frames"] - two.output.data["frames"]).max()) <= 1e-3


def test_the_token_budget_bounds_the_batch_and_is_logged_once(tiny_model, images, tmp_path, caplog):
    # 9 frames of 64x96 -> 3 latent frames x 2 x 3 tokens = 18, twice with CFG: 36 per request
    omni = Omni("wan_i2v", model=str(tiny_model), device="cpu", wan_max_batch_tokens=72)
    with caplog.at_level(logging.INFO, logger="omni"):
        for rid in "abc":
            omni.submit(_request(omni, rid, images, tmp_path))
        events = []
        while omni.has_unfinished():
            events += omni.step()
    sizes = {e.request_id: e.result.trace["diffusion.batch_size_max"] for e in events
             if isinstance(e, RequestFinished)}
    assert sizes == {"a": 2, "b": 2, "c": 1}
    lines = [r.getMessage() for r in caplog.records if "latent tokens per denoise step" in r.getMessage()]
    assert lines == ["wan: batching up to 16 requests and 72 latent tokens per denoise step (wan_max_batch_tokens)"]


def test_batching_config_is_validated():
    from omni_wan.params import WanConfig

    with pytest.raises(InvalidParameter, match="wan_max_batch"):
        WanConfig(wan_max_batch=0)
    with pytest.raises(InvalidParameter, match="wan_max_batch_tokens"):
        WanConfig(wan_max_batch_tokens=-5)


def test_latent_tokens_and_the_cpu_default_budget():
    from omni_wan.build import CPU_TOKEN_BUDGET, latent_tokens, token_budget
    from omni_wan.device import place
    from omni_wan.layout import ModelLayout
    from omni_wan.params import WanConfig
    from omni_wan.presets import Settings

    layout = ModelLayout(path=None, spatial_multiple=32, temporal_factor=4)
    quality = Settings(preset="quality", height=704, width=1280, num_frames=121, steps=50, guidance_scale=5.0,
                       seed=0, negative_prompt="")
    assert latent_tokens(quality, layout) == 31 * 22 * 40 * 2  # latent frames x (h/32) x (w/32), twice for CFG
    config = WanConfig(device="cpu")
    assert token_budget(config, place(config), layout) == (CPU_TOKEN_BUDGET, "default for cpu")
    config = WanConfig(device="cpu", wan_max_batch_tokens=500)
    assert token_budget(config, place(config), layout) == (500, "wan_max_batch_tokens")


def _item(rid: str, cost: int, steps: int = 1) -> StageInput:
    return StageInput(rid, "s", processed=(cost, steps))


def test_step_scheduler_cost_budget_keeps_arrival_order_and_always_runs_one():
    scheduler = StepScheduler(max_batch=8, num_steps=lambda i: i.processed[1], cost=lambda i: i.processed[0],
                              max_cost=10)
    for rid, cost in [("a", 4), ("b", 4), ("c", 4), ("d", 1), ("big", 30)]:
        scheduler.add(_item(rid, cost))
    ran = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        scheduler.update(batch, dict.fromkeys(batch.request_ids, 0))
        ran.append(batch.request_ids)
    assert ran == [("a", "b"), ("c", "d"), ("big",)]  # d does not overtake c; big runs alone


def test_phase_order_lets_newcomers_prepare_and_join_the_denoise_batch():
    from omni_wan.runner import PHASE_ORDER, phases

    def item(rid: str, steps: int) -> StageInput:  # what phases() reads of a processed request
        return StageInput(rid, "s", processed=SimpleNamespace(settings=SimpleNamespace(steps=steps)))

    scheduler = PhaseScheduler(max_batch=4, phases=phases, phase_order=PHASE_ORDER)
    scheduler.add(item("a", 3))

    def advance():
        batch = scheduler.schedule()
        scheduler.update(batch, dict.fromkeys(batch.request_ids, 0))
        return batch.phase, batch.request_ids, batch.steps

    assert advance() == ("prepare", ("a",), (0,))
    assert advance() == ("denoise", ("a",), (1,))
    scheduler.add(item("b", 3))
    assert advance() == ("prepare", ("b",), (0,))  # the newcomer goes first ...
    assert advance() == ("denoise", ("a", "b"), (2, 1))  # ... and joins a's denoise batch at a's second step
    assert advance() == ("denoise", ("a", "b"), (3, 2))
    assert advance() == ("decode", ("a",), (4,))  # a leaves as soon as it is done
    assert advance() == ("export", ("a",), (5,))
    assert advance() == ("denoise", ("b",), (3,))


def _model(omni):
    runner = omni.graph.stages["wan"].engine.runner
    return runner, runner.model


def _run(omni, requests):
    for request in requests:
        omni.submit(request)
    events = []
    while omni.has_unfinished():
        events += omni.step()
    return events


def test_requests_prepared_together_share_one_text_encode_and_one_image_encode(omni, images, tmp_path):
    runner, model = _model(omni)
    runner.cache.clear()
    calls = []
    real_texts, real_images = model.encode_texts, model.encode_images
    model.encode_texts = lambda texts: calls.append(("texts", len(texts))) or real_texts(texts)
    model.encode_images = lambda imgs, h, w: calls.append(("images", len(imgs))) or real_images(imgs, h, w)
    try:
        events = _run(omni, [_request(omni, rid, images, tmp_path) for rid in "abc"])
    finally:
        del model.encode_texts, model.encode_images
    # three prompts and Wan's default negative prompt (shared by all three); three different images
    assert calls == [("texts", 4), ("images", 3)]
    finished = {e.request_id: e.result for e in events if isinstance(e, RequestFinished)}
    assert {rid: r.trace["diffusion.text_cache"] for rid, r in finished.items()} == dict.fromkeys("abc", "miss")
    runner.cache.clear()
    for rid in "abc":  # each prepared alone, from an empty cache: the same frames
        solo = omni.generate(_request(omni, rid, images, tmp_path / "solo"))
        assert float(np.abs(solo.output.data["frames"] - finished[rid].output.data["frames"]).max()) <= 1e-3


def test_a_request_whose_prepare_fails_fails_alone(omni, images, tmp_path):
    runner, model = _model(omni)
    runner.cache.clear()
    bad = Image.open(images["noise"]).convert("RGB")
    real = model.encode_images

    def encode_images(imgs, h, w):
        if any(np.array_equal(np.asarray(i), np.asarray(bad)) for i in imgs):
            raise RuntimeError("VAE encode failed")
        return real(imgs, h, w)

    model.encode_images = encode_images
    try:
        events = _run(omni, [_request(omni, rid, images, tmp_path) for rid in "abc"])  # b has the noise image
    finally:
        del model.encode_images
    failed = {e.request_id: e.error for e in events if isinstance(e, RequestFailed)}
    assert list(failed) == ["b"] and "VAE encode failed" in failed["b"]
    assert sorted(e.request_id for e in events if isinstance(e, RequestFinished)) == ["a", "c"]
    assert (tmp_path / "a.mp4").is_file() and not (tmp_path / "b.mp4").exists()


# ---- text-to-video and image-to-video rows in one forward ----------------------------------------------------

# (prompt, image or None: text-to-video, seed, guidance): different prompts, seeds and guidance scales, all with CFG
MIXED = {"i1": ("a red fox in the snow", "red", 1, 5.0), "t1": ("a paper boat on a rainy street", None, 2, 3.0),
         "i2": ("a city street at night", "noise", 3, 7.5), "t2": ("a hot air balloon over hills", None, 4, 4.0),
         "t3": ("a lighthouse in a storm", None, 5, 6.0)}


@pytest.fixture(scope="module")
def mixed(omni, tiny_model):
    """A Wan node whose image policy is `optional`: one stage takes text-to-video and image-to-video requests (as
    wan_t2v and wan_i2v do when they share a stage); on the session's host, so the model is the same one."""
    from omni_kernel import NodeSpec, PipelinePlan
    from omni_wan.plugin import NODE_TYPE

    plan = PipelinePlan("wan_mixed", [NodeSpec("wan", NODE_TYPE, final=True, policy={"image": "optional"})])
    return Omni(plan, host=omni.host, model=str(tiny_model), device="cpu")


def _mixed_request(omni, rid, images, tmp_path):
    prompt, image, seed, guidance = MIXED[rid]
    return omni.request(prompt, image=images[image] if image else None, request_id=rid, **SIZE, seed=seed,
                        guidance_scale=guidance, output=str(tmp_path / f"{rid}.mp4"), return_frames=True)


def _step_until(omni, events: list, done) -> None:
    while not done():
        events += omni.step()


def test_text_and_image_requests_share_forwards_and_match_their_solo_runs(mixed, images, tmp_path):
    runner = mixed.graph.stages["wan"].engine.runner
    calls, real = [], runner.run

    def spy(batch):
        if batch.phase == "denoise":
            calls.append({r.request_id: step - 1 for r, step in zip(batch.records, batch.steps)})
        return real(batch)

    runner.run = spy
    events = []

    def progressed(rid, step):
        return any(isinstance(e, StageProgress) and e.request_id == rid and e.step >= step for e in events)

    try:
        for rid in ("i1", "t1", "t3"):
            mixed.submit(_mixed_request(mixed, rid, images, tmp_path))
        _step_until(mixed, events, lambda: progressed("i1", 1))
        mixed.submit(_mixed_request(mixed, "i2", images, tmp_path))  # an image request joins text ones mid-way
        _step_until(mixed, events, lambda: progressed("i1", 2))
        mixed.submit(_mixed_request(mixed, "t2", images, tmp_path))  # and a text request joins later still
        _step_until(mixed, events, lambda: progressed("t3", 3))
        mixed.abort("t3")  # a text request aborted mid-way: its neighbours go on
        _step_until(mixed, events, lambda: not mixed.has_unfinished())
    finally:
        del runner.run

    assert {"i1": 1, "t1": 1, "t3": 1, "i2": 0} in calls and {"i1": 2, "t1": 2, "t3": 2, "i2": 1, "t2": 0} in calls
    assert [e.error for e in events if isinstance(e, RequestFailed)] == ["aborted"]
    assert not (tmp_path / "t3.mp4").exists()
    finished = {e.request_id: e.result for e in events if isinstance(e, RequestFinished)}
    assert sorted(finished) == ["i1", "i2", "t1", "t2"]
    for rid, result in finished.items():
        assert result.trace["diffusion.task"] == ("text_to_video" if rid[0] == "t" else "image_to_video")
        assert result.trace["diffusion.batch_size_max"] >= 4

    for rid in sorted(finished):
        solo = mixed.generate(_mixed_request(mixed, rid, images, tmp_path / "solo"))
        assert solo.trace["diffusion.batch_size_max"] == 1
        ours, alone = finished[rid].output.data["frames"], solo.output.data["frames"]
        assert ours.shape == alone.shape == (9, 64, 96, 3)
        diff = float(np.abs(ours - alone).max())
        print(f"{rid}: max abs diff vs solo {diff:.2e}")
        assert diff <= 1e-4, (rid, diff)


def test_per_token_timesteps_are_per_row(mixed, images, tmp_path):
    """In one forward, an image row's first-frame tokens get timestep 0 and a text row's every token gets t."""
    import torch

    model = mixed.graph.stages["wan"].engine.runner.model
    seen = []
    real = model.pipe.transformer.forward

    def spy(*args, **kwargs):
        seen.append(kwargs["timestep"].clone())
        return real(*args, **kwargs)

    for rid in ("i1", "t1"):
        mixed.submit(_mixed_request(mixed, rid, images, tmp_path))
    model.pipe.transformer.forward = spy
    try:
        while not seen:
            mixed.step()
    finally:
        del model.pipe.transformer.forward
    for rid in ("i1", "t1"):
        mixed.abort(rid)
    while mixed.has_unfinished():
        mixed.step()
    [stamps] = seen  # cond and uncond rows of both requests in one forward: [4, seq]
    tokens_per_frame = (64 // 32) * (96 // 32)
    image_row, text_row = stamps[0], stamps[1]
    assert stamps.shape == (4, 3 * tokens_per_frame)
    assert (image_row[:tokens_per_frame] == 0).all() and (image_row[tokens_per_frame:] > 0).all()
    assert (text_row == text_row[0]).all() and text_row[0] == image_row[-1] > 0  # both at their first step
    assert torch.equal(stamps[2], image_row) and torch.equal(stamps[3], text_row)  # the uncond rows
