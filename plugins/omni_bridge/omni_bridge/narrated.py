"""The narrated_t2v and narrated_i2v pipelines (docs/narrated.md): the AR stage writes the video guidance and a short
narration in one structured answer (the guidance contract with its `narration` field, guidance.NARRATED_SCHEMA);
Wan renders the video from the merged prompt while the voice speaks the narration (two edges out of the AR node:
neither branch waits for the other); the mux joins the two into one MP4 (mux.py).

The other plugins' node types are named by string (omni-qwen's AR node, omni-wan's video node, omni-speech's voice):
omni_bridge imports none of them.

Request parameters are one flat set; the plan routes the two that the nodes declare for different things
(NodeSpec.params): `output` is the narrated MP4's, so the Wan node writes its video to a hidden file beside it (named
as an atomic write's temporary file, util.files.remove_atomic_leftovers: the mux removes it, and a process killed
before leaves what a sweep of the output's folder removes) and the voice writes no file (`output`,
`response_format` withheld: its audio goes to the mux in memory).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import attrs

from omni_kernel import EdgeSpec, NodeSpec, PipelinePlan, Request, StageInput, StageOutput
from omni_kernel.core.request import AUDIO, VIDEO

from .guidance import ANSWER_PREFIX, CONTRACT, NARRATED_MAX_TOKENS, NARRATED_SCHEMA, NARRATION_FIELD, parse_guidance
from .mux import NODE_TYPE as MUX_NODE_TYPE
from .mux import VideoPart
from .pipeline import AR_TO_DIFFUSION

# What the voice is checked with at submit, where the narration does not exist yet (its voice, speed and seed are the
# request's; the narration's own text is checked when the AR stage has written it).
STAND_IN = "A narration."
VOICE_WITHHELD = ("output", "response_format")


@attrs.frozen
class GuidanceToSpeech:
    """The narration of a narrated AR answer into the voice. A narration that cannot be read (a truncated answer, an
    answer of another contract) falls back to the user's prompt, as the video's guidance falls back to the prompt
    alone (docs/bridge.md's reasons); the trace says which."""

    name: str = "guidance_to_speech"
    source_kind: str = "ar"
    target_kind: str = "tts"
    source_contract: str = CONTRACT

    def convert(self, output: StageOutput, request: Request) -> StageInput:
        narration = parse_guidance(output.text, output.stop_reason, output.contract, NARRATION_FIELD)
        text = narration.text if narration.ok else request.prompt
        trace = {"narration.text": text, "narration.parse_success": narration.ok,
                 "narration.fallback_reason": narration.reason}
        return StageInput(request.request_id, text, trace=trace)

    def stand_in(self, item: StageInput) -> StageInput:
        return attrs.evolve(item, prompt=STAND_IN)


@attrs.frozen
class VideoToMux:
    """A video stage's MP4 (its path and VideoInfo) as the mux's `video` input."""

    name: str = "video_to_mux"
    source_kind: str = "diffusion"
    target_kind: str = "mux"

    def convert(self, output: StageOutput, request: Request) -> StageInput:
        return StageInput(request.request_id, "", processed=VideoPart(output.path, output.data[VIDEO]))


@attrs.frozen
class SpeechToMux:
    """A voice's whole Audio as the mux's `audio` input."""

    name: str = "speech_to_mux"
    source_kind: str = "tts"
    target_kind: str = "mux"

    def convert(self, output: StageOutput, request: Request) -> StageInput:
        return StageInput(request.request_id, "", processed=output.data[AUDIO])


GUIDANCE_TO_SPEECH = GuidanceToSpeech()
VIDEO_TO_MUX = VideoToMux()
SPEECH_TO_MUX = SpeechToMux()


def video_file(output: str | None, request_id: str) -> Path:
    """Where the Wan node of a narrated request writes its video: a hidden file beside the narrated MP4, named as
    an atomic write's temporary file of it (".NAME.XXXXXXXX.tmp.mp4"), the same for every call of one request."""
    final = Path(output or f"omni_{request_id}.mp4").expanduser()
    tag = hashlib.sha256(request_id.encode("utf-8")).hexdigest()[:8]
    return final.parent / f".{final.name}.{tag}.tmp.mp4"


def video_params(values: dict[str, Any], request) -> dict[str, Any]:
    """The Wan node's parameters: the request's, its `output` the hidden video file."""
    return {**values, "output": str(video_file(values.get("output"), request.request_id))}


def voice_params(values: dict[str, Any], request) -> dict[str, Any]:
    """The voice's parameters: the request's but its file's (the narrated MP4 is the mux's)."""
    return {k: v for k, v in values.items() if k not in VOICE_WITHHELD}


# The bridge node writes guidance and narration under the contract: the same answer prefix, the narrated schema and
# a budget that both bounded fields always fit.
NARRATED_POLICY = {"json_schema": NARRATED_SCHEMA, "max_tokens": NARRATED_MAX_TOKENS, "answer_prefix": ANSWER_PREFIX,
                   "output_contract": CONTRACT}


def narrated_plan(name: str, image: str, description: str) -> PipelinePlan:
    return PipelinePlan(
        name,
        nodes=[NodeSpec("bridge", "ar.prompt_bridge", policy=NARRATED_POLICY, plugin_hint="omni-qwen"),
               NodeSpec("video", "diffusion.wan22_i2v", policy={"image": image}, plugin_hint="omni-wan",
                        params=video_params),
               NodeSpec("speak", "tts.vits", plugin_hint="omni-speech", params=voice_params),
               NodeSpec("narrated", MUX_NODE_TYPE, final=True, plugin_hint="omni-bridge")],
        edges=[EdgeSpec("bridge", "video", AR_TO_DIFFUSION.name),
               EdgeSpec("bridge", "speak", GUIDANCE_TO_SPEECH.name),
               EdgeSpec("video", "narrated", VIDEO_TO_MUX.name, input="video"),
               EdgeSpec("speak", "narrated", SPEECH_TO_MUX.name, input="audio")],
        description=description)


NARRATED_T2V = narrated_plan("narrated_t2v", "none", "Qwen writes guidance and a narration for the prompt; Wan2.2 "
                             "renders the video while the voice speaks the narration; one MP4 with sound")
NARRATED_I2V = narrated_plan("narrated_i2v", "required", "Qwen writes guidance and a narration for the prompt; "
                             "Wan2.2 renders the image into a video while the voice speaks the narration; one MP4 "
                             "with sound")
