"""The speech-to-text stage's events: the transcript's text as it decodes (TokenDelta, whole UTF-8 characters), then
StageFinished with the text, its segments with times (data[SEGMENTS]), usage.audio_seconds and the asr.* trace.

The streamed text is exactly the final text: a window decoded without timestamps streams token by token; with
timestamps, text streams up to its last complete segment (a timestamp pair), since the words after it may be
decoded again from the next window (asr_windows.py). Leading and trailing whitespace is not part of the text.
"""

from __future__ import annotations

import time

import attrs

from omni_kernel.core.events import StageFailed, StageFinished, TokenDelta
from omni_kernel.core.request import SEGMENTS, Segment, StageOutput, Usage
from omni_kernel.core.scheduler import RequestOutput

from .asr_engine import ASRJob
from .asr_windows import WindowSegment


@attrs.define
class TextState:
    """The output processor's part of a request: the text sent so far, and the text of its finished segments."""

    sent: str = ""
    committed: str = ""
    segments_done: int = 0


class ASROutputs:
    def __init__(self, node_id: str, tokenizer, eos: int, timestamp_begin: int):
        self.node_id = node_id
        self.tokenizer = tokenizer
        self.eos = eos
        self.timestamp_begin = timestamp_begin

    def add(self, record: ASRJob) -> None:
        record.output = TextState()

    def process(self, outputs: list[RequestOutput]) -> tuple[list, list[str]]:
        events: list = []
        for out in outputs:
            if out.error is not None:
                events.append(StageFailed.of(out.request_id, self.node_id, out.error))
                continue
            job: ASRJob = out.record
            delta = self._delta(job, final=out.finished is not None)
            if delta:
                events.append(TokenDelta(out.request_id, self.node_id, delta))
            if out.finished is not None:
                events.append(StageFinished(out.request_id, self.node_id, self._output(job)))
        return events, []

    def text_of(self, tokens) -> str:
        return self.tokenizer.decode([t for t in tokens if t < self.eos])

    def _delta(self, job: ASRJob, final: bool) -> str:
        state: TextState = job.output
        for segment in job.segments[state.segments_done:]:
            state.committed += self.text_of(segment.tokens)
        state.segments_done = len(job.segments)
        text = state.committed + self.text_of(self._stable(job))
        if text.endswith("\ufffd") and not final:
            return ""  # a character cut between tokens: it comes whole with the next one
        text = text.strip()
        if not text.startswith(state.sent):
            return ""  # cannot happen with byte-level BPE; never send text that the final text contradicts
        delta, state.sent = text[len(state.sent):], text
        return delta

    def _stable(self, job: ASRJob) -> list[int]:
        """The open window's tokens that its final segments will hold whatever comes next."""
        if not job.open:
            return []
        if not job.processed.timestamps:
            return job.tokens
        stamps = [t >= self.timestamp_begin for t in job.tokens]
        pairs = [i for i in range(len(stamps) - 1) if stamps[i] and stamps[i + 1]]
        return job.tokens[: pairs[-1] + 1] if pairs else []

    def _output(self, job: ASRJob) -> StageOutput:
        processed = job.processed
        text = "".join(self.text_of(s.tokens) for s in job.segments).strip()
        seconds = processed.audio_seconds
        elapsed = time.perf_counter() - job.added
        trace = {"asr.audio_seconds": round(seconds, 3), "asr.rtf": round(elapsed / seconds, 4) if seconds else None,
                 "asr.windows": job.windows, "asr.tokens": job.generated, "asr.timestamps": processed.timestamps,
                 "asr.batch_max": job.batch_max,
                 "asr.batch_mean": round(job.batch_sum / job.steps, 2) if job.steps else 0,
                 "asr.encoder_batch_max": job.encoder_batch_max}
        segments = tuple(self._segment(s, seconds) for s in job.segments if self.text_of(s.tokens).strip())
        return StageOutput(job.request_id, self.node_id, text=text, data={SEGMENTS: segments}, stop_reason="done",
                           trace=trace, usage=Usage(output_tokens=job.generated, audio_seconds=round(seconds, 3)))

    def _segment(self, segment: WindowSegment, seconds: float) -> Segment:
        end = min(segment.end, seconds)
        return Segment(round(min(segment.start, end), 2), round(end, 2), self.text_of(segment.tokens).strip())
