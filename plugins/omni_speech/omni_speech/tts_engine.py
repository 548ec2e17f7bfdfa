"""The `tts.vits` stage: input processing (model-free), the engine (a step scheduler and a runner that synthesizes
the next chunk of every request of the step in one forward) and the output processing (one AudioDelta per chunk,
then the whole Audio, the file when one was asked for, the usage and the trace).

A request's steps are its chunks (tts_voice.Voice.chunks: sentences, a short first one). The scheduler
(FewestStepsFirst) keeps one record per request; the runner keeps its batch sizes and step times in the record's
`state`, the output processor its audio so far in `output`.

A streamed input (a streaming edge's target: `ar_speech`'s voice) opens with no text (StageInput.stream); each
StreamChunk's text adds its chunks (TTSInputs.extend), which the scheduler runs as they come; a request whose
whole input had nothing to speak fails at its last chunk, as a text with nothing to speak does at once.

Trace keys: tts.input_chars, tts.sentences (chunks), tts.voice, tts.seed (drawn when the request gave none),
tts.audio_seconds, tts.rtf (the seconds of the steps that synthesized the request over the seconds of audio they
made; a step shared by several requests counts whole for each), tts.ttfa_ms (from the input's processing to its
first chunk's audio), tts.first_audio_ms (from the request's arrival, Request.arrival_time, to its first chunk's
audio: in a pipeline, the stages before the voice included), tts.batch_max and tts.batch_mean (sentences per step
of the steps it was in), and with a file, tts.output and tts.format.
"""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path

import attrs
import numpy as np

from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.events import AudioDelta, StageFailed, StageFinished
from omni_kernel.core.params import MAX_SEED, check_prompt
from omni_kernel.core.request import AUDIO, Audio, StageInput, StageOutput, StreamChunk, Usage
from omni_kernel.core.scheduler import RequestOutput, SchedulerOutput, StepScheduler
from omni_kernel.core.stage import Inputs
from omni_kernel.util.files import check_output_path

from .tts_config import MAX_INPUT_CHARS, TTSParams, output_format
from .tts_voice import Chunk, Voice, nothing_to_say

log = logging.getLogger("omni")
SEED_STRIDE = 1_000_003  # chunk k of a request seeded `seed` draws its noise from seed * SEED_STRIDE + k
MAX_INT16 = 32767.0


@attrs.frozen
class Speech:
    """A request's processed input: its chunks, the scales and seed its rows use, and where its audio goes."""

    chunks: tuple[Chunk, ...] = attrs.field(converter=tuple)
    voice: str
    noise_scale: float
    noise_w: float
    length_scale: float
    seed: int
    output: Path | None
    format: str
    input_chars: int
    started: float  # time.perf_counter() when its input was processed: time to first audio counts from here
    arrival: float | None = None  # the request's arrival (time.time()), where the kernel gave it

    def chunk_seed(self, index: int) -> int:
        return (self.seed * SEED_STRIDE + index) % (MAX_SEED + 1)


@attrs.define
class Progress:
    """What the runner keeps of a request (its record's `state`): its steps' batch sizes and seconds."""

    batch_sizes: list[int] = attrs.Factory(list)
    seconds: float = 0.0


@attrs.frozen
class SpokenChunk:
    """One step's result for a request: chunk `index`'s PCM (s16le mono) and what it speaks."""

    index: int
    pcm: bytes
    text: str


@attrs.define
class Heard:
    """What the output processor keeps of a request (its record's `output`): its PCM so far and when it began."""

    pcm: list[bytes] = attrs.Factory(list)
    first_audio: float | None = None
    first_audio_wall: float | None = None  # time.time() of it, against the request's arrival


class TTSInputs(Inputs):
    """Refuses a bad request before any model work, and splits its text into chunks of phoneme ids; a streamed
    input's text chunk by chunk as it comes (`extend`)."""

    def __init__(self, voice: Voice):
        self.voice = voice

    def check(self, item: StageInput) -> None:
        if not item.stream:  # a stream's text is not there yet: its chunks are checked as they come
            check_text(item.prompt)
        params: TTSParams = item.params or TTSParams()
        if params.voice is not None and params.voice not in self.voice.names:
            raise InvalidParameter("voice", f"{params.voice!r} is not a voice of this model; its voices: "
                                            f"{', '.join(self.voice.names)}")
        output_format(params)
        if params.output is not None:
            if not params.output.strip():
                raise InvalidParameter("output", "is empty; name a file such as out.wav, or leave it out")
            check_output_path(params.output, "output")
        if not item.stream:
            self._chunks(item.prompt)

    def _chunks(self, text: str) -> list[Chunk]:
        """The text's chunks (phonemizing is model-free and takes milliseconds: the check runs it too)."""
        chunks = self.voice.chunks(text)
        if not chunks:
            raise nothing_to_say()
        return chunks

    def process(self, item: StageInput) -> StageInput:
        self.check(item)
        params: TTSParams = item.params or TTSParams()
        chunks = [] if item.stream else self._chunks(item.prompt)
        voice = self.voice
        noise_scale = voice.noise_scale if params.noise_scale is None else params.noise_scale
        noise_w = voice.noise_w if params.noise_w is None else params.noise_w
        seed = secrets.randbelow(MAX_SEED + 1) if params.seed is None else params.seed
        output = None if params.output is None else check_output_path(params.output, "output")
        speech = Speech(chunks, params.voice or voice.name, noise_scale, noise_w, voice.length_scale / params.speed,
                        seed, output, output_format(params), len(item.prompt), time.perf_counter(), item.arrival_time)
        return attrs.evolve(item, processed=speech)

    def extend(self, item: StageInput, chunk: StreamChunk) -> StageInput:
        """The request's speech with the chunk's text added as chunks of its own (the first piece with a short first
        chunk, as a whole text's); after the last, a request with nothing to say fails."""
        speech: Speech = item.processed
        added = self.voice.chunks(chunk.text, first=not speech.chunks) if chunk.text.strip() else []
        if chunk.last and not speech.chunks and not added:
            raise nothing_to_say()
        speech = attrs.evolve(speech, chunks=speech.chunks + tuple(added),
                              input_chars=speech.input_chars + len(chunk.text))
        return attrs.evolve(item, processed=speech)


def check_text(text: str) -> None:
    """The text must say something, within OpenAI's limit."""
    check_prompt(text)
    if len(text) > MAX_INPUT_CHARS:
        raise InvalidParameter("prompt", f"the text has {len(text):,} characters; at most {MAX_INPUT_CHARS:,} are "
                                         "spoken in one request")


class TTSRunner:
    """Synthesizes the next chunk of every request of a step in one forward (tts_model.synthesize)."""

    def __init__(self, model, batch_decoder: bool):
        self.model = model
        self.batch_decoder = batch_decoder

    def add_request(self, record) -> None:
        record.state = Progress()

    def run(self, batch: SchedulerOutput) -> dict[str, SpokenChunk]:
        from .tts_model import Row, synthesize

        rows = []
        for record, step in zip(batch.records, batch.steps):
            speech: Speech = record.item.processed
            rows.append(Row(speech.chunks[step].ids, speech.noise_scale, speech.noise_w, speech.length_scale,
                            speech.chunk_seed(step)))
        start = time.perf_counter()
        waveforms = synthesize(self.model, rows, self.batch_decoder)
        seconds = time.perf_counter() - start
        out = {}
        for record, step, waveform in zip(batch.records, batch.steps, waveforms):
            record.state.batch_sizes.append(len(rows))
            record.state.seconds += seconds
            out[record.request_id] = SpokenChunk(step, to_pcm(waveform.numpy()),
                                                 record.item.processed.chunks[step].text)
        return out

    def free(self, record) -> None:
        pass  # the output processor reads the record's Progress after the engine freed it


def to_pcm(waveform: np.ndarray) -> bytes:
    """16-bit PCM as Piper makes it from a sentence's waveform: scaled to its peak, clipped, truncated."""
    peak = float(np.max(np.abs(waveform))) if waveform.size else 0.0
    audio = np.zeros_like(waveform) if peak < 1e-8 else waveform / peak
    return np.clip(audio * MAX_INT16, -MAX_INT16, MAX_INT16).astype("<i2").tobytes()


class TTSOutputs:
    """Each chunk as an AudioDelta as it comes; when the request is done, its Audio (and file), usage and trace."""

    def __init__(self, node_id: str, sample_rate: int):
        self.node_id = node_id
        self.sample_rate = sample_rate

    def add(self, record) -> None:
        record.output = Heard()

    def process(self, outputs: list[RequestOutput]) -> tuple[list, list[str]]:
        events: list = []
        for out in outputs:
            if out.error is not None:
                events.append(StageFailed.of(out.request_id, self.node_id, out.error))
                continue
            heard: Heard = out.record.output
            chunk: SpokenChunk | None = out.result  # None: a streamed input's last chunk added nothing to say
            if chunk is not None:
                heard.pcm.append(chunk.pcm)
                if heard.first_audio is None:
                    heard.first_audio = time.perf_counter()
                    heard.first_audio_wall = time.time()
                events.append(AudioDelta(out.request_id, self.node_id, chunk.pcm, self.sample_rate, chunk.text))
            if out.finished is not None:
                events.append(self._finished(out))
        return events, []

    def _finished(self, out: RequestOutput) -> StageFinished | StageFailed:
        speech: Speech = out.item.processed
        audio = Audio(b"".join(out.record.output.pcm), self.sample_rate)
        trace = self._trace(out, audio)
        if speech.output is not None:
            from .audio_out import write_audio

            try:
                write_audio(speech.output, audio, speech.format)
            except Exception as exc:  # noqa: BLE001 - this request fails alone, leaving no file
                return StageFailed.of(out.request_id, self.node_id, exc)
        output = StageOutput(out.request_id, self.node_id, path=None if speech.output is None else str(speech.output),
                             data={AUDIO: audio}, stop_reason="done", trace=trace,
                             usage=Usage(audio_seconds=audio.seconds))
        return StageFinished(out.request_id, self.node_id, output)

    def _trace(self, out: RequestOutput, audio: Audio) -> dict:
        speech: Speech = out.item.processed
        progress: Progress = out.record.state
        sizes = progress.batch_sizes
        trace = {"tts.input_chars": speech.input_chars, "tts.sentences": len(speech.chunks), "tts.voice": speech.voice,
                 "tts.seed": speech.seed, "tts.audio_seconds": round(audio.seconds, 3),
                 "tts.rtf": round(progress.seconds / audio.seconds, 4) if audio.seconds else None,
                 "tts.ttfa_ms": round((out.record.output.first_audio - speech.started) * 1000, 1),
                 "tts.first_audio_ms": None if speech.arrival is None else
                 round((out.record.output.first_audio_wall - speech.arrival) * 1000, 1),
                 "tts.batch_max": max(sizes), "tts.batch_mean": round(sum(sizes) / len(sizes), 2)}
        if speech.output is not None:
            trace["tts.output"] = str(speech.output)
            trace["tts.format"] = speech.format
        return trace


@attrs.define
class FewestStepsFirst(StepScheduler):
    """A StepScheduler whose step takes the `max_batch` requests with the fewest chunks spoken so far (the earlier
    arrival first among equals): a request that arrives while others are in flight gets its first chunk in the
    next step, instead of after every request before it has spoken its whole text. A request is passed over only
    by requests behind it in their texts, which then catch up with it."""

    def schedule(self) -> SchedulerOutput:
        ready = self._ready()
        batch = sorted(ready, key=lambda job: job.step)[:self.max_batch]  # a stable sort: arrival order among equals
        return self._output(batch)


@attrs.frozen
class TTSEngineSettings:
    """Everything a TTS engine depends on (its share key): the loaded model's key, the batch size and whether the
    decoder runs over the batch at once."""

    model: tuple  # (path, dtype, device)
    max_batch: int
    batch_decoder: bool


def build_engine(model, settings: TTSEngineSettings) -> Engine:
    scheduler = FewestStepsFirst(max_batch=settings.max_batch, num_steps=lambda item: len(item.processed.chunks))
    return Engine(scheduler, TTSRunner(model, settings.batch_decoder))
