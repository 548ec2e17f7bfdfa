"""A test plugin for spoken chats without a speech model: the AR stage is omni_qwen's (the demo checkpoint in the
tests' cache), the voice a sine tone per sentence (speech_plugin.py's tone), taking its text streamed.

Pipelines: `fake_ar_speech` (AR -> the tone voice, streamed through omni_speech's `text_to_speech` connector: one
piece per sentence) and `fake_voice_chat` (speech_plugin's listener, whose transcript says how long the audio is
-> omni_speech's `transcript_to_prompt` -> AR -> the tone voice). The voice speaks each piece of its input as one
AudioDelta whose text is the piece; voices "ana" and "bob" as speech_plugin's."""

from __future__ import annotations

import attrs
from speech_plugin import (
    MODEL_VOICES,
    PITCH,
    RATE,
    FakeASRParams,
    FakeSettings,
    asr_engine,
    asr_stage,
    check_asr,
    settings,
    tone,
)

from omni_kernel import EdgeSpec, NodeSpec, NodeType, PipelinePlan, hookimpl
from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InputError, InvalidParameter
from omni_kernel.core.events import AudioDelta, StageFinished
from omni_kernel.core.params import check_prompt, number, option, text
from omni_kernel.core.request import AUDIO, Audio, StageInput, StageOutput, StreamChunk, Usage
from omni_kernel.core.scheduler import StepScheduler
from omni_kernel.core.stage import Inputs, Outputs, Stage


@attrs.frozen
class StreamTTSParams:
    voice: str | None = option(None, help="the voice (default: the model's first)", validator=text)
    speed: float = option(1.0, help="speed, 0.25-4", type=float, validator=number(0.25, 4))


class StreamTTSInputs(Inputs):
    """A text's pieces, or a streamed input's pieces as they come; each piece is one step."""

    def check(self, item: StageInput) -> None:
        if not item.stream:
            check_prompt(item.prompt)
        voice = item.params.voice
        if voice is not None and voice not in MODEL_VOICES:
            raise InvalidParameter("voice", f"{voice!r} is not a voice of this model; its voices: "
                                            f"{', '.join(MODEL_VOICES)}")

    def process(self, item: StageInput) -> StageInput:
        self.check(item)
        return attrs.evolve(item, processed=() if item.stream else (item.prompt,))

    def extend(self, item: StageInput, chunk: StreamChunk) -> StageInput:
        pieces = item.processed + ((chunk.text,) if chunk.text.strip() else ())
        if chunk.last and not pieces:
            raise InputError("there is nothing to say")
        return attrs.evolve(item, processed=pieces)


class StreamTTSRunner:
    def add_request(self, record) -> None:
        pass

    def run(self, batch) -> dict[str, tuple[str, bytes]]:
        out = {}
        for job, step in zip(batch.records, batch.steps):
            piece, params = job.item.processed[step], job.item.params
            out[job.request_id] = (piece, tone(len(piece), PITCH[params.voice or MODEL_VOICES[0]], params.speed))
        return out

    def free(self, record) -> None:
        pass


class StreamTTSOutputs(Outputs):
    def __init__(self, node_id: str):
        super().__init__(node_id)
        self.spoken: dict[str, list[bytes]] = {}

    def process(self, outputs) -> tuple[list, list[str]]:
        events, _ = super().process([o for o in outputs if o.error is not None])
        for out in outputs:
            if out.error is not None:
                continue
            if out.result is not None:  # None: a streamed input's last chunk added no piece
                piece, pcm = out.result
                self.spoken.setdefault(out.request_id, []).append(pcm)
                events.append(AudioDelta(out.request_id, self.node_id, pcm, RATE, piece))
            if out.finished:
                audio = Audio(b"".join(self.spoken.pop(out.request_id, [])), RATE)
                events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                    out.request_id, self.node_id, data={AUDIO: audio}, usage=Usage(audio_seconds=audio.seconds))))
        return events, []


def tts_engine(settings: FakeSettings) -> Engine:
    return Engine(StepScheduler(max_batch=8, num_steps=lambda i: len(i.processed)), StreamTTSRunner())


def tts_stage(node, config, policy, settings, engine: Engine) -> Stage:
    return Stage(node, "tts", StreamTTSInputs(), engine, StreamTTSOutputs(node.id))


def check_tts(node, config, policy, settings, item: StageInput) -> None:
    StreamTTSInputs().check(item)


def tts_choices(node, config, policy, settings) -> dict[str, tuple[str, ...]]:
    return {"voice": MODEL_VOICES}


class ChatSpeechPlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("fakechat.tts", "tts", engine_settings=settings, engine=tts_engine, stage=tts_stage,
                          check=check_tts, choices=tts_choices, params=StreamTTSParams, stream_input=True,
                          description="a sine tone per piece of its (streamed) text"))
        register(NodeType("fakechat.asr", "asr", engine_settings=settings, engine=asr_engine, stage=asr_stage,
                          check=check_asr, params=FakeASRParams, inputs=("audio",),
                          description="says how long the audio is"))

    @hookimpl
    def omni_register_pipelines(self, register):
        answer = NodeSpec("answer", "ar.text_generation", final=True)
        speak = NodeSpec("speak", "fakechat.tts", final=True)
        register(PipelinePlan("fake_ar_speech", [answer, speak],
                              [EdgeSpec("answer", "speak", "text_to_speech", stream=True)]))
        register(PipelinePlan("fake_voice_chat", [NodeSpec("hear", "fakechat.asr"), answer, speak],
                              [EdgeSpec("hear", "answer", "transcript_to_prompt"),
                               EdgeSpec("answer", "speak", "text_to_speech", stream=True)]))
