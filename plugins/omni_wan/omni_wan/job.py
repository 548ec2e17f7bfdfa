"""WanJob, a Wan request's state in the runner (its scheduler record's `state`), and what the runner's steps
return for it: the results the output processor turns into events, and the measurements it turns into the trace."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs

from omni_kernel.core.request import StageInput

from .inputs import WanInput
from .profiler import Profiler


@attrs.frozen
class Progress:
    """A prepare or denoise step's result: `step` of `total` denoise steps are done; `from_cache`: every
    transformer forward of this denoise step skipped its blocks (None: the request has no step cache)."""

    step: int
    total: int
    from_cache: bool | None = None


# What a step gives each request (the engine's result for it): Progress after prepare and each denoise step, None
# after decode, the MP4's path after export or the Future of the export thread writing it, and an exception for a
# request that failed alone (its batch goes on).
StepResult = Progress | str | Future | Exception | None


@attrs.define
class WanJob:
    """What the runner keeps of one request (`StepJob.state`): its model state and frames, and what it measured
    (the output processor's trace)."""

    item: StageInput
    profiler: Profiler
    start: float = attrs.Factory(time.perf_counter)
    denoise: Any = None  # the model's DenoiseState, from prepare to decode
    frames: Any = None
    load_ms: float | None = None  # the model load it waited for: the first prepare's requests (None: none)
    text_hit: bool = False  # the prepare cache held its text (and with CFG its negative prompt)
    image_hit: bool | None = None  # ... and its image's latent (None: text-to-video)
    cfg_batched: bool = False  # its cond and uncond rows ran in one forward
    batch_sizes: list[int] = attrs.Factory(list)  # requests in each of its denoise forwards
    profile_trace: Path | None = None  # the Chrome trace written beside its MP4
    step_cache: Any = None  # its step cache (step_cache.RequestCache), kept past decode for the trace
    num_blocks: int = 0  # the transformer's blocks: what the skipped share counts in

    @property
    def input(self) -> WanInput:
        return self.item.processed
