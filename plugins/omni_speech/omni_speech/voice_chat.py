"""`voice_chat`: speech in, a spoken answer out. Whisper hears the request's audio, its transcript is the AR
stage's prompt, and the voice speaks the AR stage's answer piece by piece while it is written (as `ar_speech`).

The transcript goes to the AR stage whole, when Whisper has finished (`transcript_to_prompt`): the AR stage's
prompt is rendered with the chat template and prefilled at once, so it cannot start on part of it. The answer
streams into the voice (`text_to_speech`, text_stream.py). Its outputs are the answer's text and the audio; the
transcript is the `hear` node's output.

At submit the AR node is checked with a stand-in for the transcript (`TranscriptToPrompt.stand_in`): its parameters
are refused before any work, as everywhere; a request with no audio is refused by Whisper's own check."""

from __future__ import annotations

import attrs

from omni_kernel import EdgeSpec, NodeSpec, PipelinePlan
from omni_kernel.core.errors import InputError
from omni_kernel.core.request import Request, StageInput, StageOutput

from .text_stream import TEXT_TO_SPEECH

STAND_IN = "(what the speech says)"  # the AR node's prompt at submit, before Whisper has heard the audio


@attrs.frozen
class TranscriptToPrompt:
    """A transcript (an `asr` stage's output) as an AR stage's prompt."""

    name: str = "transcript_to_prompt"
    source_kind: str = "asr"
    target_kind: str = "ar"

    def convert(self, output: StageOutput, request: Request) -> StageInput:
        heard = (output.text or "").strip()
        if not heard:
            raise InputError("invalid audio: no speech was heard in it (the transcript is empty)")
        return StageInput(request.request_id, heard, trace={"voice_chat.heard_chars": len(heard)})

    def stand_in(self, item: StageInput) -> StageInput:
        """What the AR node is checked with at submit: the request's parameters, a prompt that stands for the
        transcript, no audio (the AR stage never reads the request's audio)."""
        return attrs.evolve(item, prompt=STAND_IN, audio=None)


TRANSCRIPT_TO_PROMPT = TranscriptToPrompt()

VOICE_CHAT = PipelinePlan(
    "voice_chat", [NodeSpec("hear", "asr.whisper", plugin_hint="omni-speech"),
                   NodeSpec("answer", "ar.text_generation", final=True, plugin_hint="omni-qwen"),
                   NodeSpec("speak", "tts.vits", final=True, plugin_hint="omni-speech")],
    [EdgeSpec("hear", "answer", TRANSCRIPT_TO_PROMPT.name),
     EdgeSpec("answer", "speak", TEXT_TO_SPEECH.name, stream=True)],
    description="a voice chat: Whisper hears the audio, the AR stage answers the transcript and the voice speaks "
                "the answer sentence by sentence while it is written; outputs: the text and the audio")
