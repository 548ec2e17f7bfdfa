"""The speech-to-text engine: a scheduler that owns each request's record and progress through its windows, and
a runner that steps every request in flight together.

Each engine step runs up to `max_batch` requests (first come, first served). A request whose window is open
decodes its next token: all of them in one decoder forward over the KV pool (asr_model.py). A request between
windows opens its next one: the encoder over every such window at once, then their decoder prompts in one
forward, which gives each its first token. So every request in the step gets one token. The scheduler appends
it, ends the window at EOS or at the window's token limit, cuts the window into segments and moves the seek
(asr_windows.py), and finishes the request when the seek reaches the end of its audio.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import attrs

from omni_kernel.core.request import StageInput, StageStats
from omni_kernel.core.scheduler import RequestOutput, SchedulerOutput

from .asr_inputs import ASRInput, WhisperAssets
from .asr_windows import WINDOW_FRAMES, WindowSegment, split_window


@attrs.frozen
class Decoded:
    """A request's result of one step: its next token, and the decoder prompt of the window it opened this step
    (None: it went on with its open window)."""

    token: int
    opened: tuple[int, ...] | None = None
    step_batch: int = 1  # the requests in this step
    encoder_batch: int = 0  # the windows the encoder ran over this step (when this request opened one)


@attrs.define(eq=False)
class ASRJob:
    """One request's record: where its audio's seek is, its open window's decoder prompt and tokens, the segments
    of its finished windows, the counters its trace reports, and the runner's (`state`) and output processor's
    (`output`) slots."""

    item: StageInput
    seek: int = 0
    open: bool = False
    decoder_prompt: tuple[int, ...] = ()
    tokens: list[int] = attrs.Factory(list)
    segments: list[WindowSegment] = attrs.Factory(list)
    windows: int = 0
    generated: int = 0
    steps: int = 0
    batch_sum: int = 0
    batch_max: int = 0
    encoder_batch_max: int = 0
    added: float = attrs.Factory(time.perf_counter)
    state: Any = None
    output: Any = None

    @property
    def request_id(self) -> str:
        return self.item.request_id

    @property
    def processed(self) -> ASRInput:
        return self.item.processed

    @property
    def window_frames(self) -> int:
        return min(self.processed.num_frames - self.seek, WINDOW_FRAMES)


@attrs.frozen
class WindowLimits:
    """What ends a window: EOS, or its length reaching the generation config's max_length (plus the decoder
    prompt, as transformers' generate adds it) within the decoder's positions."""

    eos: int
    timestamp_begin: int
    max_length: int | None
    max_positions: int

    @classmethod
    def of(cls, assets: WhisperAssets) -> WindowLimits:
        return cls(assets.eos, assets.timestamp_begin, getattr(assets.generation, "max_length", None),
                   assets.max_positions)

    def cap(self, prompt_length: int) -> int:
        """The most tokens a window's sequence holds (its decoder prompt included)."""
        if self.max_length is None:
            return self.max_positions
        return min(self.max_length + min(self.max_positions // 2 - 1, prompt_length), self.max_positions)


@attrs.define
class ASRScheduler:
    limits: WindowLimits
    max_batch: int = 32
    queue: list[ASRJob] = attrs.Factory(list)

    def add(self, item: StageInput) -> ASRJob:
        job = ASRJob(item)
        self.queue.append(job)
        return job

    def schedule(self) -> SchedulerOutput:
        batch = self.queue[: self.max_batch]
        return SchedulerOutput([j.request_id for j in batch], [j.windows for j in batch], records=batch)

    def update(self, batch: SchedulerOutput, results: Mapping[str, Any], step_ms: float = 0.0) -> list[RequestOutput]:
        outputs = []
        for job in batch.records:
            if job not in self.queue or job.request_id not in results:
                continue  # aborted or failed since
            result: Decoded = results[job.request_id]
            self._count(job, result)
            if result.opened is not None:
                job.open, job.decoder_prompt, job.tokens = True, result.opened, []
                job.windows += 1
            job.tokens.append(result.token)
            job.generated += 1
            if self._window_ended(job):
                self._close_window(job)
            if job.seek >= job.processed.num_frames:
                self.queue.remove(job)
                outputs.append(RequestOutput(job.request_id, result, "done", record=job))
            else:
                outputs.append(RequestOutput(job.request_id, result, record=job))
        return outputs

    def _count(self, job: ASRJob, result: Decoded) -> None:
        job.steps += 1
        job.batch_sum += result.step_batch
        job.batch_max = max(job.batch_max, result.step_batch)
        job.encoder_batch_max = max(job.encoder_batch_max, result.encoder_batch)

    def _window_ended(self, job: ASRJob) -> bool:
        length = len(job.decoder_prompt) + len(job.tokens)
        return job.tokens[-1] == self.limits.eos or length >= self.limits.cap(len(job.decoder_prompt))

    def _close_window(self, job: ASRJob) -> None:
        tokens = job.tokens[:-1] if job.tokens[-1] == self.limits.eos else job.tokens
        window = split_window(tokens, self.limits.timestamp_begin, job.seek, job.window_frames)
        job.segments.extend(window.segments)
        job.seek += window.advance
        job.open, job.tokens = False, []

    def collect(self) -> list[RequestOutput]:
        return []

    def abort(self, request_id: str) -> ASRJob | None:
        job = next((j for j in self.queue if j.request_id == request_id), None)
        if job is not None:
            self.queue.remove(job)
        return job

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def request_ids(self) -> set[str]:
        return {j.request_id for j in self.queue}

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self.queue)

    def stats(self) -> StageStats:
        running = min(len(self.queue), self.max_batch)
        return StageStats(running=running, waiting=len(self.queue) - running)


@attrs.define(eq=False)
class RowState:
    """The runner's part of a request: its KV pool slot (from its first step), its sampler, and its open window's
    first generated position and timestamp rule (None: decoded without timestamps)."""

    slot: int | None
    generator: Any = None
    begin: int = 0
    timestamps: Any = None


class ASRRunner:
    """Runs a step's requests: decode steps for open windows, encoder + decoder prompts for windows to open."""

    def __init__(self, forward, assets: WhisperAssets):
        self.forward = forward
        self.assets = assets
        self.suppress, self.begin_suppress = suppression(assets, forward.model.config.vocab_size)

    def add_request(self, record: ASRJob) -> None:
        import torch

        generator = None
        if record.processed.temperature > 0:
            generator = torch.Generator(device="cpu")
            seed = record.processed.seed
            generator.manual_seed(seed if seed is not None else int(torch.seed()))
        record.state = RowState(None, generator)

    def free(self, record: ASRJob) -> None:
        if record.state is not None and record.state.slot is not None:
            self.forward.pool.give(record.state.slot)
        record.state = None

    def run(self, batch: SchedulerOutput) -> dict[str, Decoded]:
        import torch

        going = [job for job in batch.records if job.open]
        opening = [job for job in batch.records if not job.open]
        size = len(batch.records)
        results: dict[str, Decoded] = {}
        if going:  # first: an idle slot's row in this forward writes position 0, which a prefill below overwrites
            logits = self.forward.step([job.tokens[-1] for job in going],
                                       [len(job.decoder_prompt) + len(job.tokens) - 1 for job in going],
                                       [job.state.slot for job in going])
            chosen = self._choose(going, [job.decoder_prompt + tuple(job.tokens) for job in going], logits)
            for job, token in zip(going, chosen):
                results[job.request_id] = Decoded(token, step_batch=size)
        if opening:
            for job in opening:  # a slot from its first step on (the scheduler runs at most the pool's size)
                if job.state.slot is None:
                    job.state.slot = self.forward.pool.take()
            features = torch.stack([torch.from_numpy(self._window(job)) for job in opening])
            slots = [job.state.slot for job in opening]
            self.forward.encode(features, slots)
            prompts = [self._open(job, slots) for job in opening]
            logits = self.forward.prefill(prompts, slots)
            for job, prompt, token in zip(opening, prompts, self._choose(opening, prompts, logits)):
                results[job.request_id] = Decoded(token, prompt, size, len(opening))
        return results

    def _window(self, job: ASRJob):
        import numpy as np

        features = job.processed.features[:, job.seek: job.seek + WINDOW_FRAMES]
        if features.shape[-1] < WINDOW_FRAMES:
            features = np.pad(features, ((0, 0), (0, WINDOW_FRAMES - features.shape[-1])))
        return np.ascontiguousarray(features)

    def _open(self, job: ASRJob, slots: list[int]) -> tuple[int, ...]:
        """The window's decoder prompt (the previous-text prompt, then the init tokens); its logits rules start
        after it."""
        processed = job.processed
        language = processed.language_id
        if language is None and self.assets.multilingual:
            language = self._detect(job)
        prompt = processed.prompt + self.assets.decoder_prompt(language, processed.timestamps)
        job.state.begin = len(prompt)
        job.state.timestamps = timestamp_rule(self.assets, len(prompt)) if processed.timestamps else None
        return prompt

    def _detect(self, job: ASRJob) -> int:
        """The most likely language token after <|startoftranscript|> (transformers' detect_language)."""
        import torch

        ids = torch.tensor(list(self.assets.generation.lang_to_id.values()))
        logits = self.forward.prefill([(self.assets.generation.decoder_start_token_id,)], [job.state.slot])[0]
        return int(ids[logits[ids].argmax()])

    def _choose(self, jobs: list[ASRJob], sequences: list[tuple[int, ...]], logits) -> list[int]:
        """Each row's next token under generate's logits rules, in its order: the begin tokens suppressed at a
        window's first position, the suppressed tokens always, then the timestamp rule; greedy, or sampled with the
        request's own generator."""
        import torch

        with torch.inference_mode():
            scores = logits.float().clone()
            scores[:, self.suppress] = -float("inf")
            for row, (job, sequence) in enumerate(zip(jobs, sequences)):
                if len(sequence) == job.state.begin:
                    scores[row, self.begin_suppress] = -float("inf")
                if job.state.timestamps is not None:
                    scores[row: row + 1] = job.state.timestamps(torch.tensor([sequence]), scores[row: row + 1])
            chosen = scores.argmax(dim=-1).tolist()
            for row, job in enumerate(jobs):
                if job.state.generator is not None:
                    probs = torch.softmax(scores[row] / job.processed.temperature, dim=-1)
                    chosen[row] = int(torch.multinomial(probs, 1, generator=job.state.generator))
        return chosen


def suppression(assets: WhisperAssets, vocab_size: int):
    """The generation config's suppressed tokens and the tokens suppressed at a window's first position, as masks
    over the vocabulary (what transformers' SuppressTokens and SuppressTokensAtBegin processors set to -inf)."""
    import torch

    masks = []
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        ids = [i for i in getattr(assets.generation, name, None) or () if 0 <= i < vocab_size]
        mask[ids] = True
        masks.append(mask)
    return masks[0], masks[1]


def timestamp_rule(assets: WhisperAssets, begin_index: int):
    """transformers' WhisperTimeStampLogitsProcessor for a window whose generated tokens start at begin_index."""
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    return WhisperTimeStampLogitsProcessor(assets.generation, begin_index)
