"""diffusers' own Ulysses (`ContextParallelConfig(ulysses_degree=2)`, the model's `_cp_plan`) tried on the batch
omni's Wan stage runs, on 2 gloo ranks of the CPU, against one process: the trial behind
docs/distributed-measurements.md's "Why omni's own Ulysses".

The batch is test_wan_parallel.py's: a text-only row one step ahead of two image rows (three timesteps, per-row
TI2V timesteps), one row unguided, omni's cross-attention processor (the text K/V cached per request) on every
block, at 27 latent tokens (96x96, 9 frames: odd) and 18 (64x96). Each case prints each rank's largest
difference from one process, or the error diffusers raised:

- `as-is`: diffusers' call on a CPU;
- `past-device-count`: with `torch.accelerator.device_count` made 1 in the ranks (diffusers computes
  `rank % device_count()` to pick a device, which is 0 without an accelerator);
- `uneven`: as above with `ulysses_anything=True`, diffusers' mode for token counts the degree does not divide;
- `step-cache`: 18 tokens with omni's per-row step cache on (each rank decides on its own shard; the ranks wait
  in mismatched collectives until gloo's 60 s timeout).

    .venv/bin/python benchmarks/wan_context_parallel_trial.py [CASE ...]    (about 1 min a case on 2 cores)
"""

from __future__ import annotations

import argparse
import copy
import sys
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "plugins" / "omni_wan" / "tests"
sys.path.insert(0, str(TESTS))

import test_wan_parallel as parallel  # noqa: E402 - the tests' batch, model and comparison

from wan_ranks import Ranks  # noqa: E402

CASES = ("as-is", "past-device-count", "uneven", "step-cache")
IMAGE = Path(__file__).resolve().parents[1] / "examples" / "assets" / "image.png"


def _try(rank: int, context: dict, case: str, path: str) -> dict:
    import torch
    from diffusers import ContextParallelConfig

    model = parallel._model(context, path)
    if case != "as-is":
        torch.accelerator.device_count = lambda: 1
    config = ContextParallelConfig(ulysses_degree=2, ulysses_anything=case == "uneven")
    sizes = parallel.SIZES[1:] if case == "step-cache" else parallel.SIZES
    try:
        batches = {size: _batch(model, case, size) for size in sizes}
        expected = {size: _denoise(model, case, copy.deepcopy(batch)) for size, batch in batches.items()}
        model.pipe.transformer.enable_parallelism(config=config)
    except Exception as exc:  # noqa: BLE001 - the trial reports what diffusers raised
        return {"all": _error(exc)}
    results = {}
    for (height, width), batch in batches.items():
        try:
            got = _denoise(model, case, batch)
            results[f"{height}x{width}"] = max(parallel._max_difference(a, b) for a, b in
                                               zip(expected[(height, width)], got))
        except Exception as exc:  # noqa: BLE001 - as above
            results[f"{height}x{width}"] = _error(exc)
    return results


def _error(exc: Exception) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {str(exc)[:160]} ({Path(frame.filename).name}:{frame.lineno})"


def _batch(model, case: str, size: tuple[int, int]) -> list:
    if case == "step-cache":
        return parallel._cached_batch(model, str(IMAGE), *size)
    return parallel._batch(model, str(IMAGE), *size)


def _denoise(model, case: str, states: list) -> list:
    """The latents after the stage's steps (and, without the step cache, every prediction before them)."""
    if case != "step-cache":
        predictions, latents = parallel._denoise(model, states)
        return [*predictions, *latents]
    for step in range(parallel.CACHED_STEPS):
        model.denoise_batch(states, [step] * len(states))
    return [state.latents for state in states]


def main() -> None:
    from omni_wan.demo import ensure_demo_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", choices=[*CASES, []], help="of " + ", ".join(CASES) + " (default: all)")
    args = parser.parse_args()
    path = str(ensure_demo_model())
    for case in args.cases or CASES:
        ranks = Ranks(2)  # a fresh pair each time: enable_parallelism cannot be undone on a model
        try:
            for rank, result in enumerate(ranks.run(_try, case, path)):
                print(f"{case:18} rank {rank}: {result}", flush=True)
        finally:
            ranks.close()


if __name__ == "__main__":
    main()
