"""The Wan node's parts without a model: declared params and config, presets, placement, the prepare cache."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from omni_hf import DTYPE_NAMES

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import ARParams, options_of
from omni_wan.device import place
from omni_wan.layout import ModelLayout
from omni_wan.params import VAE_DTYPES, WanConfig, WanParams, resolve
from omni_wan.prepare_cache import MAX_ENTRIES, PrepareCache
from omni_wan.presets import PRESETS
from omni_wan.video import write_mp4

from wan_mp4 import read_mp4

LAYOUT = ModelLayout(path=None, spatial_multiple=32, temporal_factor=4)


def test_every_flag_of_the_old_cli_is_declared_with_its_type():
    flags = {info.flag: (name, info.type) for cls in (WanConfig, WanParams)
             for name, info in options_of(cls).items() if info.flag}
    assert flags == {"--model": ("model", str), "--vae-dtype": ("vae_dtype", str),
                     "--disable-cpu-offload": ("disable_cpu_offload", bool), "--preset": ("preset", str),
                     "--height": ("height", int), "--width": ("width", int), "--num-frames": ("num_frames", int),
                     "--steps": ("num_inference_steps", int), "--guidance-scale": ("guidance_scale", float),
                     "--seed": ("seed", int), "--output": ("output", str), "--profile": ("profile", bool),
                     "--step-cache": ("step_cache", str), "--step-cache-threshold": ("step_cache_threshold", float)}
    assert options_of(WanConfig)["vae_dtype"].choices == ("fp32", "bf16", "fp16")


def test_seed_is_declared_like_the_ar_seed_so_one_flag_reaches_both():
    wan, ar = options_of(WanParams)["seed"], options_of(ARParams)["seed"]
    assert (wan.flag, wan.type) == (ar.flag, ar.type) == ("--seed", int)


@pytest.mark.parametrize(("values", "message"), [
    ({"preset": "ultra"}, "choose one of quality, balanced, fast, smoke"),
    ({"height": 0}, "invalid height"), ({"num_inference_steps": 2.5}, "invalid num_inference_steps"),
    ({"guidance_scale": -1}, "invalid guidance_scale"), ({"seed": -1}, "invalid seed"),
    ({"profile": "yes"}, "invalid profile"), ({"output": 3}, "invalid output")])
def test_bad_params_name_the_field(values, message):
    with pytest.raises(InvalidParameter, match=message):
        WanParams(**values)


@pytest.mark.parametrize(("values", "message"), [({"vae_dtype": "fp8"}, "is not one of fp32, bf16, fp16"),
                                                 ({"device": "tpu"}, "is not one of auto, cpu, cuda"),
                                                 ({"wan_video_preset": "turbo"}, "is not one of ultrafast, superfast")])
def test_bad_config_names_the_value(values, message):
    with pytest.raises(InvalidParameter, match=message):
        WanConfig(**values)


@pytest.mark.parametrize(("values", "message"), [
    ({"height": 100}, "nearest valid: 96 or 128"), ({"width": 70}, "nearest valid: 64 or 96"),
    ({"num_frames": 10}, "nearest valid: 9 or 13"), ({"width": 8192}, "nearest valid: 4096"),
    ({"num_inference_steps": 1001}, "over the limit of 1000")])
def test_settings_that_the_model_cannot_render_are_refused_with_the_nearest_valid(values, message):
    with pytest.raises(InvalidParameter, match=message):
        resolve(WanParams(**values), LAYOUT, (1280, 720), "smoke")


def test_a_portrait_image_turns_the_preset_size_to_portrait():
    fast = PRESETS["fast"]
    landscape = resolve(WanParams(preset="fast"), LAYOUT, (1280, 720), "smoke")
    portrait = resolve(WanParams(preset="fast"), LAYOUT, (720, 1280), "smoke")
    assert (landscape.height, landscape.width) == (fast.height, fast.width) == (352, 640)
    assert (portrait.height, portrait.width) == (640, 352)
    explicit = resolve(WanParams(preset="fast", height=64, width=96), LAYOUT, (720, 1280), "smoke")
    assert (explicit.height, explicit.width) == (64, 96)  # given sizes are taken as they are


def test_seconds_become_frames_at_the_model_fps_and_num_frames_wins():
    assert resolve(WanParams(seconds=5), LAYOUT, (1280, 720), "smoke").num_frames == 121  # 5 s at 24 fps, 4k+1
    assert resolve(WanParams(seconds=0.01), LAYOUT, (1280, 720), "smoke").num_frames == 5  # at least 4*1+1
    slow = attrs.evolve(LAYOUT, fps=8, temporal_factor=8)
    assert resolve(WanParams(seconds=2), slow, (1280, 720), "smoke").num_frames == 17  # the model's own factors
    assert resolve(WanParams(seconds=5, num_frames=9), LAYOUT, (1280, 720), "smoke").num_frames == 9
    for bad in (0, -1, 61, float("nan")):
        with pytest.raises(InvalidParameter, match="invalid seconds"):
            WanParams(seconds=bad)


def test_prepare_cache_evicts_the_least_recently_used_entry():
    cache = PrepareCache()
    for key in range(MAX_ENTRIES):
        assert cache.get_or_compute(key, lambda k=key: f"v{k}") == (f"v{key}", False)
    assert cache.get_or_compute(0, lambda: "recomputed") == ("v0", True)  # 0 is now the most recently used
    cache.get_or_compute("new", lambda: "n")  # one over the limit: evicts 1, the least recently used
    assert cache.get_or_compute(0, lambda: "recomputed") == ("v0", True)
    assert cache.get_or_compute(1, lambda: "recomputed") == ("recomputed", False)
    assert cache.get_or_compute("new", lambda: "recomputed") == ("n", True)


def test_device_cpu_places_everything_on_the_cpu_in_fp32():
    placement = place(WanConfig(device="cpu", disable_cpu_offload=True))
    assert attrs.astuple(placement) == ("cpu", "fp32", "fp32", "default for cpu", "not applicable (CPU)")
    assert place(WanConfig(device="cpu", vae_dtype="bf16")).vae_dtype_reason == "requested"
    assert set(VAE_DTYPES) <= set(DTYPE_NAMES)  # every VAE dtype offered is one omni_hf.torch_dtype maps


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machines: auto must fall back to the CPU")
def test_device_auto_without_a_gpu_is_the_cpu_and_cuda_is_refused():
    assert place(WanConfig()).device == "cpu"
    with pytest.raises(InvalidParameter, match="no CUDA device"):
        place(WanConfig(device="cuda"))


@pytest.mark.parametrize(("memory_gib", "offload", "expected"), [
    (80, False, ("cuda", "bf16", "fp32", "default for cuda", "model_cpu_offload")),
    (24, False, ("cuda", "bf16", "bf16", "default for cuda", "model_cpu_offload")),
    (24, True, ("cuda", "bf16", "bf16", "default for cuda", "off"))])
def test_gpu_placement_offloads_by_default_and_picks_the_vae_dtype_by_memory(monkeypatch, memory_gib, offload,
                                                                             expected):
    """The GPU branch of place() with torch's view of the GPU faked, so it runs on any machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: type("Props", (), {"total_memory": memory_gib * 2**30})())
    for device in ("auto", "cuda"):
        assert attrs.astuple(place(WanConfig(device=device, disable_cpu_offload=offload))) == expected


@pytest.mark.parametrize(("preset", "subme"), [(None, b"subme=2"), ("ultrafast", b"subme=0"), ("medium", b"subme=7")])
def test_the_x264_preset_reaches_the_encoder(tmp_path, preset, subme):
    """x264 writes its settings into the stream: veryfast (subme=2) unless a preset is given."""
    frames = np.random.default_rng(0).random((5, 32, 48, 3), dtype=np.float32)
    path = write_mp4(frames, tmp_path / "v.mp4", fps=8, **({"preset": preset} if preset else {}))
    meta, back = read_mp4(path)
    assert back.shape == (5, 32, 48, 3) and subme in path.read_bytes()
