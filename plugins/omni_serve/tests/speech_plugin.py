"""A test plugin that speaks and listens without a model, for the audio API's tests.

Pipeline `fake_tts` (node kind "tts"): each sentence of the text becomes one AudioDelta, a sine tone 20 ms a
character (divided by `speed`) at 22,050 Hz, the pitch set by the voice ("ana" or "bob": the voices its node type
names for the built "model", NodeType.choices); a sentence holding "slowly" takes 0.3 s to make. Pipeline
`fake_asr` (node kind "asr", reads the request's audio): the file is decoded with ffmpeg (refused when it is not
audio, is empty or is silent) and the transcript says how long it is, one word a step, in two segments."""

from __future__ import annotations

import math
import re
import struct
import subprocess
import time

import attrs

from omni_kernel import NodeSpec, NodeType, PipelinePlan, hookimpl
from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InputError, InvalidParameter
from omni_kernel.core.events import AudioDelta, StageFinished, TokenDelta
from omni_kernel.core.params import check_prompt, number, option, text
from omni_kernel.core.request import AUDIO, SEGMENTS, Audio, Segment, StageInput, StageOutput, Usage
from omni_kernel.core.scheduler import StepScheduler
from omni_kernel.core.stage import Inputs, Outputs, Stage

RATE = 22050
PITCH = {"ana": 440.0, "bob": 220.0}
MODEL_VOICES = ("ana", "bob")  # what the "model" has (NodeType.choices); the param declares no choices
MAX_CHARS = 4096
SENTENCE = re.compile(r"[^.!?]+[.!?]*")


@attrs.frozen
class FakeTTSParams:
    voice: str | None = option(None, help="the voice (default: the model's first)", validator=text)
    speed: float = option(1.0, help="speed, 0.25-4", type=float, validator=number(0.25, 4))
    response_format: str = option("wav", help="the output file's format",
                                  choices=("mp3", "opus", "aac", "flac", "wav", "pcm"))


@attrs.frozen
class FakeASRParams:
    language: str | None = option(None, help="the spoken language", choices=("en",))
    temperature: float = option(0.0, help="sampling temperature", type=float, validator=number(0, 1))
    prompt: str | None = option(None, help="text the transcript continues", validator=text)


def tone(chars: int, pitch: float, speed: float) -> bytes:
    samples = int(RATE * 0.02 * chars / speed)
    return b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * pitch * i / RATE))) for i in range(samples))


class TTSInputs(Inputs):
    def check(self, item: StageInput) -> None:
        check_prompt(item.prompt)
        voice = item.params.voice
        if voice is not None and voice not in MODEL_VOICES:
            raise InvalidParameter("voice", f"{voice!r} is not a voice of this model; its voices: "
                                            f"{', '.join(MODEL_VOICES)}")
        if len(item.prompt) > MAX_CHARS:
            raise InputError(f"the text has {len(item.prompt)} characters, more than {MAX_CHARS}")

    def process(self, item: StageInput) -> StageInput:
        self.check(item)
        sentences = tuple(s for s in SENTENCE.findall(item.prompt) if s.strip())
        return attrs.evolve(item, processed=sentences)


class TTSRunner:
    def add_request(self, record) -> None:
        record.state = record.item.processed

    def run(self, batch) -> dict[str, tuple[str, bytes]]:
        out = {}
        for job, step in zip(batch.records, batch.steps):
            sentence, params = job.state[step], job.item.params
            if "slowly" in sentence:
                time.sleep(0.3)
            pitch = PITCH[params.voice or MODEL_VOICES[0]]
            out[job.request_id] = (sentence, tone(len(sentence), pitch, params.speed))
        return out

    def free(self, record) -> None:
        pass


class TTSOutputs(Outputs):
    def __init__(self, node_id: str):
        super().__init__(node_id)
        self.spoken: dict[str, list[bytes]] = {}

    def process(self, outputs) -> tuple[list, list[str]]:
        failed = [o for o in outputs if o.error is not None]
        events, _ = super().process(failed)
        for out in outputs:
            if out.error is not None:
                continue
            sentence, pcm = out.result
            self.spoken.setdefault(out.request_id, []).append(pcm)
            events.append(AudioDelta(out.request_id, self.node_id, pcm, RATE, sentence))
            if out.finished:
                audio = Audio(b"".join(self.spoken.pop(out.request_id)), RATE)
                events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                    out.request_id, self.node_id, data={AUDIO: audio}, usage=Usage(audio_seconds=audio.seconds),
                    trace={"tts.audio_seconds": audio.seconds})))
        return events, []


def decode(audio: str | bytes) -> bytes:
    """The file as 16 kHz mono s16le, through ffmpeg; InputError when it is not audio, empty or silent."""
    import imageio_ffmpeg

    args = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", "pipe:0" if isinstance(audio, bytes) else audio,
            "-f", "s16le", "-ac", "1", "-ar", "16000", "pipe:1"]
    done = subprocess.run(args, input=audio if isinstance(audio, bytes) else None, capture_output=True, check=False)
    if done.returncode != 0:
        raise InputError("invalid audio: the file is not audio ffmpeg can decode")
    if not done.stdout:
        raise InputError("invalid audio: the file holds no sound")
    if max(abs(v) for (v,) in struct.iter_unpack("<h", done.stdout[: len(done.stdout) // 2 * 2])) < 30:
        raise InputError("invalid audio: the file is silent")
    return done.stdout


class ASRInputs(Inputs):
    def check(self, item: StageInput) -> None:
        if item.audio is None:
            raise InputError("invalid audio: this pipeline needs an audio input")

    def process(self, item: StageInput) -> StageInput:
        self.check(item)
        seconds = len(decode(item.audio)) / 2 / 16000
        words = re.findall(r"\s*\S+", f"I heard {seconds:.1f} seconds of sound.")
        return attrs.evolve(item, processed=(seconds, tuple(words)))


class ASRRunner:
    def add_request(self, record) -> None:
        record.state = record.item.processed[1]

    def run(self, batch) -> dict[str, str]:
        return {job.request_id: job.state[step] for job, step in zip(batch.records, batch.steps)}

    def free(self, record) -> None:
        pass


class ASROutputs(Outputs):
    def process(self, outputs) -> tuple[list, list[str]]:
        failed = [o for o in outputs if o.error is not None]
        events, _ = super().process(failed)
        for out in outputs:
            if out.error is not None:
                continue
            events.append(TokenDelta(out.request_id, self.node_id, out.result))
            if out.finished:
                seconds, words = out.item.processed
                half = len(words) // 2
                segments = (Segment(0.0, seconds / 2, "".join(words[:half])),
                            Segment(seconds / 2, seconds, "".join(words[half:])))
                events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                    out.request_id, self.node_id, text="".join(words), data={SEGMENTS: segments},
                    usage=Usage(output_tokens=len(words), audio_seconds=seconds))))
        return events, []


@attrs.frozen
class FakeSettings:
    node_id: str


def settings(node, config, policy) -> FakeSettings:
    return FakeSettings(node.id)


def tts_engine(settings: FakeSettings) -> Engine:
    return Engine(StepScheduler(max_batch=8, num_steps=lambda i: len(i.processed)), TTSRunner())


def asr_engine(settings: FakeSettings) -> Engine:
    return Engine(StepScheduler(max_batch=8, num_steps=lambda i: len(i.processed[1])), ASRRunner())


def tts_stage(node, config, policy, settings, engine: Engine) -> Stage:
    return Stage(node, "tts", TTSInputs(), engine, TTSOutputs(node.id))


def asr_stage(node, config, policy, settings, engine: Engine) -> Stage:
    return Stage(node, "asr", ASRInputs(), engine, ASROutputs(node.id))


def check_tts(node, config, policy, settings, item: StageInput) -> None:
    TTSInputs().check(item)


def tts_choices(node, config, policy, settings) -> dict[str, tuple[str, ...]]:
    return {"voice": MODEL_VOICES}


def check_asr(node, config, policy, settings, item: StageInput) -> None:
    ASRInputs().check(item)


class SpeechPlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("fakespeech.tts", "tts", engine_settings=settings, engine=tts_engine, stage=tts_stage,
                          check=check_tts, choices=tts_choices, params=FakeTTSParams,
                          description="a sine tone per sentence"))
        register(NodeType("fakespeech.asr", "asr", engine_settings=settings, engine=asr_engine, stage=asr_stage,
                          check=check_asr, params=FakeASRParams, inputs=("audio",),
                          description="says how long the audio is"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(PipelinePlan("fake_tts", [NodeSpec("speak", "fakespeech.tts", final=True)]))
        register(PipelinePlan("fake_asr", [NodeSpec("transcribe", "fakespeech.asr", final=True)]))
