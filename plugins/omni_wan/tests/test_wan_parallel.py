"""Wan across ranks on the CPU (gloo, rank processes): the communication layer exactly, the guidance-parallel and
Ulysses forwards of the tiny checkpoint against one process on the same batch, and the refusal of bad degrees.

The batch is the stage's: a text-only row one step ahead of two image rows (so three timesteps), one of them
without guidance, 27 latent tokens (3 frames of 3 x 3: they divide neither 2 nor 4 ranks, so they are padded).
"""

from __future__ import annotations

import copy

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from omni_kernel import InvalidParameter, Omni, UserError
from omni_kernel.cli import main
from omni_kernel.core.request import StageInput
from omni_wan import comm
from omni_wan.comm import Mesh
from omni_wan.device import WanDevice
from omni_wan.inputs import WanInputProcessor
from omni_wan.layout import read_layout
from omni_wan.model import TextEmbeds, Wan22I2VPipeline
from omni_wan.parallel import WanParallel, check_degrees
from omni_wan.params import WanParams

from wan_ranks import Ranks

NUM_RANKS = 4  # one world for the module; a 2-rank mesh runs as two replicas side by side
EXACT = 1e-6
FORWARD_TOLERANCE = 1e-4  # fp32, max abs difference against one process
SIZES = ((96, 96), (64, 96))  # 27 and 18 latent tokens at 9 frames: padded, and not
NUM_FRAMES, STEPS, GUIDANCE = 9, 4, 5.0
CPU = WanDevice("cpu", "fp32", "fp32", "test", "not applicable (CPU)")


@pytest.fixture(scope="module")
def ranks():
    group = Ranks(NUM_RANKS)
    yield group
    group.close()


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float("inf") if a.shape != b.shape else float((a - b).abs().max())


def _communicate(rank: int, context: dict, cfg: int, ulysses: int) -> dict[str, float]:
    """Each primitive's largest error against the tensors every rank can build alone (the same seeds)."""
    mesh = Mesh.build(cfg, ulysses)
    errors = {}
    n, heads = mesh.ulysses, 4
    for length in (7, 8):
        x = torch.randn(3, length, heads, 5, generator=torch.Generator().manual_seed(length))
        full = comm.pad(x, 1, comm.padded_length(length, n))
        part = comm.shard(x, 1, mesh)
        errors[f"shard {length}"] = _max_difference(part, full.chunk(n, dim=1)[mesh.seq_rank])
        errors[f"gather {length}"] = _max_difference(comm.gather_sequence(part, 1, length, mesh), x)
        by_heads = comm.sequence_to_heads(part, mesh)
        mine = slice(mesh.seq_rank * heads // n, (mesh.seq_rank + 1) * heads // n)
        errors[f"to heads {length}"] = _max_difference(by_heads, full[:, :, mine])
        errors[f"round trip {length}"] = _max_difference(comm.heads_to_sequence(by_heads, mesh), part)
    num_rows = [3, 1][:cfg]
    branches = [torch.randn(rows, 2, 6, generator=torch.Generator().manual_seed(b)) for b, rows in
                enumerate(num_rows)]
    gathered = comm.gather_branches(branches[mesh.cfg_rank], num_rows, mesh)
    errors["branches"] = max(_max_difference(g, b) for g, b in zip(gathered, branches))
    return errors


@pytest.mark.process
@pytest.mark.parametrize("cfg,ulysses", [(1, 4), (1, 2), (2, 2), (2, 1)])
def test_communication_is_exact(ranks, cfg, ulysses):
    for rank, errors in enumerate(ranks.run(_communicate, cfg, ulysses)):
        assert errors and max(errors.values()) <= EXACT, (rank, errors)


def _model(context: dict, path: str) -> Wan22I2VPipeline:
    if "model" not in context:
        context["model"] = Wan22I2VPipeline.load(path, CPU)
    return context["model"]


def _batch(model: Wan22I2VPipeline, image_path: str, height: int, width: int) -> list:
    """A text-only row stepped once, then two image rows (the last unguided), at their own steps."""
    prompts = model.encode_texts(["a cat surfing", "a red fox in the snow", "a boat", "blurred, low quality"])
    negative = prompts[-1]
    condition = model.encode_image(Image.open(image_path).convert("RGB"), height, width)
    rows = [(None, GUIDANCE), (condition, GUIDANCE), (condition, 1.0)]
    states = [model.prepare(TextEmbeds(text, negative if scale > 1 else None), image, height, width, NUM_FRAMES,
                            STEPS, scale, torch.Generator().manual_seed(seed))
              for seed, (text, (image, scale)) in enumerate(zip(prompts, rows))]
    model.denoise_batch(states[:1], [0])
    return states


def _denoise(model: Wan22I2VPipeline, states: list) -> tuple[list, list]:
    """Two steps of the batch: every prediction the schedulers were given, and the latents after."""
    predictions = []
    for state in states:
        step = state.scheduler.step

        def recording(pred, *args, _step=step, **kwargs):
            predictions.append(pred.clone())
            return _step(pred, *args, **kwargs)

        state.scheduler.step = recording
    for steps in ([1, 0, 0], [2, 1, 1]):
        model.denoise_batch(states, steps)
    return predictions, [s.latents for s in states]


def _compare(rank: int, context: dict, cfg: int, ulysses: int, path: str, image_path: str) -> dict[str, float]:
    model = _model(context, path)
    mesh = Mesh.build(cfg, ulysses)
    errors = {}
    for height, width in SIZES:
        states = _batch(model, image_path, height, width)
        alone, again = copy.deepcopy(states), copy.deepcopy(states)
        expected = _denoise(model, alone)
        parallel = WanParallel.install(model, mesh)
        try:
            got = _denoise(model, states)
        finally:
            parallel.uninstall(model)
        for what, want, have in zip(("prediction", "latents"), expected, got):
            errors[f"{what} {height}x{width}"] = max(_max_difference(a, b) for a, b in zip(want, have))
        errors[f"uninstalled {height}x{width}"] = max(_max_difference(a, b) for a, b in
                                                      zip(expected[1], _denoise(model, again)[1]))
    return errors


@pytest.mark.process
@pytest.mark.parametrize("cfg,ulysses", [(2, 1), (1, 2), (2, 2)], ids=["cfg2", "ulysses2", "cfg2-ulysses2"])
def test_parallel_forward_matches_one_process(ranks, tiny_model, image_path, cfg, ulysses):
    results = ranks.run(_compare, cfg, ulysses, str(tiny_model), str(image_path))
    for rank, errors in enumerate(results):
        assert len(errors) == 3 * len(SIZES), errors
        assert max(errors.values()) <= FORWARD_TOLERANCE, (rank, errors)
        assert all(v == 0 for k, v in errors.items() if k.startswith("uninstalled")), (rank, errors)


def _wrong_rank(rank: int, context: dict, swap: str, path: str, image_path: str) -> float:
    """The comparison can fail: a rank that computes the other branch, or the other shard, predicts otherwise."""
    model = _model(context, path)
    mesh = Mesh.build(2, 1) if swap == "branch" else Mesh.build(1, 2)
    if swap == "branch":
        wrong = Mesh(2, 1, 1 - mesh.cfg_rank, 0, None, mesh.cfg_group)
    else:
        wrong = Mesh(1, 2, 0, 1 - mesh.seq_rank, mesh.seq_group, None)
    states = _batch(model, image_path, *SIZES[0])
    expected, _ = _denoise(model, copy.deepcopy(states))
    parallel = WanParallel.install(model, wrong)
    try:
        got, _ = _denoise(model, states)
    finally:
        parallel.uninstall(model)
    return max(_max_difference(a, b) for a, b in zip(expected, got))


@pytest.mark.process
@pytest.mark.parametrize("swap", ["branch", "shard"])
def test_a_wrong_rank_is_caught(ranks, tiny_model, image_path, swap):
    differences = ranks.run(_wrong_rank, swap, str(tiny_model), str(image_path))
    assert min(differences) > 100 * FORWARD_TOLERANCE, differences


def test_ulysses_degree_must_divide_the_heads(tiny_model, tmp_path):
    with pytest.raises(InvalidParameter, match="wan_ulysses: 3 does not divide the transformer's 2 attention heads"):
        Omni("wan_t2v", model=str(tiny_model), device="cpu", wan_ulysses=3)
    result = CliRunner().invoke(main, ["run", "--pipeline", "wan_t2v", "--prompt", "x", "--model", str(tiny_model),
                                       "-c", "wan_ulysses=3", "--output", str(tmp_path / "x.mp4")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "does not divide" in result.stderr and not (tmp_path / "x.mp4").exists()


def test_cfg_parallel_is_one_or_two(tiny_model):
    with pytest.raises(InvalidParameter, match="wan_cfg_parallel"):
        Omni("wan_t2v", model=str(tiny_model), device="cpu", wan_cfg_parallel=3)


def test_cfg_parallel_refuses_guidance_off(tiny_model):
    with pytest.raises(InvalidParameter, match="guidance_scale: 1 turns classifier-free guidance off"):
        check_degrees(2, 1, 2, "cpu", 1.0)
    check_degrees(1, 2, 2, "cpu", 1.0)  # without guidance-parallel, no guidance is fine
    processor = WanInputProcessor(read_layout(tiny_model), "smoke", "none", cfg_parallel=2)
    with pytest.raises(InvalidParameter, match="wan_cfg_parallel=2 runs the uncond branch"):
        processor.process(StageInput("r1", "a cat", params=WanParams(guidance_scale=1.0)))
    assert processor.process(StageInput("r2", "a cat", params=WanParams(guidance_scale=5.0))).processed


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_degrees(2, 1, 2, "cuda", GUIDANCE)
    with pytest.raises(UserError, match="= 4 ranks, one GPU each, but 2 CUDA device"):
        check_degrees(2, 2, 2, "cuda", GUIDANCE)
    check_degrees(2, 2, 2, "cpu", GUIDANCE)  # CPU ranks share the machine


def test_one_process_is_rank_0_of_one_parallel_stage_at_most(tiny_model, monkeypatch):
    """torch.distributed's default group is the process's: a second parallel engine in one process is refused in
    one line that says where to run it (test_wan_parallel_stage.py runs them in workers)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(UserError, match="rank 0 of another parallel stage already; .*--placement process"):
        Omni("wan_t2v", model=str(tiny_model), device="cpu", wan_ulysses=2)


# ---- the step cache over ranks ----------------------------------------------------------------------------------

CACHED_STEPS = 12
RATIOS = [1.0, 1.015, 1.013, 0.981, 1.019, 0.992, 0.999, 0.981, 1.026, 0.999, 1.017, 0.981]  # a calibration's shape


def _cached_batch(model: Wan22I2VPipeline, image_path: str, height: int, width: int) -> list:
    """A text row (first_block), an image row (mag) and an unguided image row (first_block, a higher threshold)."""
    from omni_wan.step_cache import CachePolicy, interpolate

    prompts = model.encode_texts(["a cat surfing", "a red fox in the snow", "a boat", "blurred, low quality"])
    condition = model.encode_image(Image.open(image_path).convert("RGB"), height, width)
    policies = [CachePolicy("first_block", 0.1, CACHED_STEPS),
                CachePolicy("mag", 0.06, CACHED_STEPS, interpolate(RATIOS, CACHED_STEPS)),
                CachePolicy("first_block", 0.2, CACHED_STEPS)]
    rows = [(None, GUIDANCE), (condition, GUIDANCE), (condition, 1.0)]
    return [model.prepare(TextEmbeds(text, prompts[-1] if scale > 1 else None), image, height, width, NUM_FRAMES,
                          CACHED_STEPS, scale, torch.Generator().manual_seed(seed), policy)
            for seed, (text, (image, scale), policy) in enumerate(zip(prompts, rows, policies))]


def _cached_compare(rank: int, context: dict, cfg: int, ulysses: int, path: str, image_path: str) -> dict:
    model = _model(context, path)
    mesh = Mesh.build(cfg, ulysses)
    states = _cached_batch(model, image_path, *SIZES[0])
    alone = copy.deepcopy(states)
    for step in range(CACHED_STEPS):
        model.denoise_batch(alone, [step] * len(alone))
    parallel = WanParallel.install(model, mesh)
    try:
        for step in range(CACHED_STEPS):
            model.denoise_batch(states, [step] * len(states))
    finally:
        parallel.uninstall(model)
    return {"latents": max(_max_difference(a.latents, b.latents) for a, b in zip(alone, states)),
            "skipped alone": [s.step_cache.num_skipped for s in alone],
            "skipped": [s.step_cache.num_skipped for s in states],
            "forwards": [s.step_cache.num_forwards for s in states],
            "margin": min(s.step_cache.margin for s in alone)}


@pytest.mark.process
@pytest.mark.parametrize("cfg,ulysses", [(2, 1), (1, 2)], ids=["cfg2", "ulysses2"])
def test_cached_parallel_denoise_matches_one_process(ranks, tiny_model, image_path, cfg, ulysses):
    """Each rank takes the one-process decisions (Ulysses: the signal reduced over the ranks; guidance-parallel:
    each branch on its rank, the other's decisions counted in), so the latents and the skipped forwards agree."""
    results = ranks.run(_cached_compare, cfg, ulysses, str(tiny_model), str(image_path))
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result}")
        assert result["latents"] <= FORWARD_TOLERANCE, (rank, result)
        assert result["skipped"] == result["skipped alone"], (rank, result)
        assert result["forwards"] == [2 * CACHED_STEPS, 2 * CACHED_STEPS, CACHED_STEPS], (rank, result)
        assert all(0 < n < 2 * CACHED_STEPS for n in result["skipped"][:2]), (rank, result)
        assert result["margin"] >= 1e-4, (rank, result)
