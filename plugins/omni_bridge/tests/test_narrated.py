"""The narrated pipelines without the models: the contract's narration field, the mux's length policy on real MP4s
(ffmpeg), the plan's parameter routes, and the graph through the kernel with fake video and voice stages (the real
mux): both branches at once, a failure in either named and leaving no file, an abort at the join."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from omni_bridge.guidance import (
    ANSWER_PREFIX,
    CONTRACT,
    GUIDANCE_MAX_CHARS,
    NARRATED_MAX_TOKENS,
    NARRATED_SCHEMA,
    NARRATION_MAX_CHARS,
    parse_guidance,
)
from omni_bridge.mux import Sources, VideoPart, loops_for, write_mp4
from omni_bridge.narrated import (
    GUIDANCE_TO_SPEECH,
    NARRATED_I2V,
    NARRATED_POLICY,
    NARRATED_T2V,
    STAND_IN,
    video_file,
    video_params,
    voice_params,
)
from omni_bridge.plugin import BridgePlugin
from omni_kernel import InvalidParameter, Omni, Request, StageInput, StageOutput
from omni_kernel.core.request import Audio, VideoInfo
from omni_kernel.events import RequestFailed, RequestFinished
from omni_kernel.plugins import PluginHost

from narrated_fakes import VIDEO_INFO, WORD_SECONDS, narrated_host, tone, write_test_video
from narrated_media import audio_pcm, frames, streams


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---- the contract ----------------------------------------------------------------------------------------------

def test_the_narrated_answer_is_the_guidance_contract_with_a_narration():
    answer = ANSWER_PREFIX + 'a slow pan", "narration": "A fox runs."}'
    assert json.loads(answer) == {"guidance": "a slow pan", "narration": "A fox runs."}
    assert NARRATED_SCHEMA["required"] == ["guidance", "narration"]
    assert parse_guidance(answer, "stop", CONTRACT).text == "a slow pan"
    assert parse_guidance(answer, "stop", CONTRACT, "narration").text == "A fox runs."
    separator = len('", "narration": "')
    assert NARRATED_MAX_TOKENS >= GUIDANCE_MAX_CHARS + separator + NARRATION_MAX_CHARS + len('"}')
    assert NARRATED_POLICY == {"json_schema": NARRATED_SCHEMA, "max_tokens": NARRATED_MAX_TOKENS,
                               "answer_prefix": ANSWER_PREFIX, "output_contract": CONTRACT}


@pytest.mark.parametrize(("text", "stop", "spoken", "reason"), [
    ('{"guidance": "pan", "narration": "  The  fox\nruns. "}', "stop", "The fox runs.", None),
    ('{"guidance": "pan", "narration": "The fox ru', "max_tokens", "a fox", "truncated"),
    ('{"guidance": "pan"}', "stop", "a fox", "missing_fields"),
])
def test_the_voice_speaks_the_narration_or_else_the_prompt(text, stop, spoken, reason):
    request = Request("narrated_t2v", "a fox")
    output = StageOutput(request.request_id, "bridge", text=text, stop_reason=stop, contract=CONTRACT)
    item = GUIDANCE_TO_SPEECH.convert(output, request)
    assert item.prompt == spoken
    assert item.trace == {"narration.text": spoken, "narration.parse_success": reason is None,
                          "narration.fallback_reason": reason}
    assert GUIDANCE_TO_SPEECH.stand_in(StageInput("r", "a fox")).prompt == STAND_IN


# ---- the plans and their parameter routes ---------------------------------------------------------------------

def test_the_plugin_registers_the_mux_and_the_narrated_pipelines():
    host = PluginHost()
    host.register(BridgePlugin(), "omni_bridge")
    assert host.registry.by_plugin("omni_bridge") == {
        "node types": ["mux.av_mp4"],
        "connectors": ["ar_to_diffusion", "guidance_to_speech", "speech_to_mux", "video_to_mux"],
        "pipelines": ["narrated_i2v", "narrated_t2v", "qwen_to_wan_i2v", "qwen_to_wan_t2v"], "commands": []}
    for plan, image in ((NARRATED_T2V, "none"), (NARRATED_I2V, "required")):
        assert [(n.id, n.type, n.final) for n in plan.nodes] == [
            ("bridge", "ar.prompt_bridge", False), ("video", "diffusion.wan22_i2v", False),
            ("speak", "tts.vits", False), ("narrated", "mux.av_mp4", True)]
        assert plan.nodes[0].policy == NARRATED_POLICY and plan.nodes[1].policy == {"image": image}
        # two edges out of the AR node, neither streaming; the mux joins the branches by name
        assert [(e.source, e.target, e.connector, e.stream, e.input) for e in plan.edges] == [
            ("bridge", "video", "ar_to_diffusion", False, None),
            ("bridge", "speak", "guidance_to_speech", False, None),
            ("video", "narrated", "video_to_mux", False, "video"),
            ("speak", "narrated", "speech_to_mux", False, "audio")]


def test_the_output_is_the_muxs_the_video_goes_beside_it_the_voice_writes_none(tmp_path):
    request = Request("narrated_t2v", "a fox")
    values = {"output": str(tmp_path / "fox.mp4"), "seed": 3, "voice": "anna", "response_format": "wav"}
    hidden = video_file(values["output"], request.request_id)
    assert hidden.parent == tmp_path and hidden.name.startswith(".fox.mp4.") and hidden.name.endswith(".tmp.mp4")
    assert hidden == video_file(values["output"], request.request_id)  # the same at check and at submit
    assert video_params(values, request) == {**values, "output": str(hidden)}
    assert voice_params(values, request) == {"seed": 3, "voice": "anna"}
    assert video_file(None, request.request_id).name == f".omni_{request.request_id}.mp4.{hidden.name[-16:]}"


# ---- the mux and its length policy ----------------------------------------------------------------------------

@pytest.mark.parametrize(("video_s", "audio_s", "loops"), [(0.375, 0.1, 1), (0.375, 0.375, 1), (0.375, 0.376, 2),
                                                           (0.375, 5.271, 15), (2.0, 0.5, 1)])
def test_the_video_loops_whole_until_the_narration_has_ended(video_s, audio_s, loops):
    video = VideoInfo(64, 64, round(video_s * 24), 24.0)
    audio = Audio(b"\0\0" * round(audio_s * 16000), 16000)
    assert loops_for(video, audio) == loops
    assert loops * video.seconds >= audio.seconds > (loops - 1) * video.seconds or loops == 1


@pytest.mark.parametrize("narration_s", [2.0, 0.2])
def test_the_mp4_has_the_videos_frames_looped_and_the_whole_narration(tmp_path, narration_s):
    """Longer narration: the video's frames, bit for bit, as often as it needs; shorter: the video once, the
    narration ends before it. One H.264 and one AAC stream."""
    video = tmp_path / "video.mp4"
    write_test_video(video)
    alone = frames(video)
    audio = tone(narration_s)
    out = tmp_path / "out" / "narrated.mp4"
    loops = write_mp4(Sources(VideoPart(str(video), VIDEO_INFO), audio), out)
    assert loops == math.ceil(narration_s / VIDEO_INFO.seconds)
    assert streams(out) == [("Video", "h264"), ("Audio", "aac")]
    muxed = frames(out)
    assert muxed.shape == (loops * len(alone), *alone.shape[1:])
    assert all((muxed[i * len(alone):(i + 1) * len(alone)] == alone).all() for i in range(loops))
    heard = len(audio_pcm(out, audio.sample_rate)) / 2 / audio.sample_rate
    assert heard >= narration_s - 0.01  # the whole narration (AAC may pad a frame's worth of silence)
    assert leftovers(out.parent) == ["narrated.mp4"]


def test_a_failed_mux_leaves_no_mp4(tmp_path):
    video = tmp_path / "video.mp4"
    video.write_bytes(b"not a video")
    out = tmp_path / "narrated.mp4"
    with pytest.raises(Exception, match="ffmpeg failed"):
        write_mp4(Sources(VideoPart(str(video), VIDEO_INFO), tone(0.5)), out)
    assert leftovers(tmp_path) == ["video.mp4"]


# ---- the graph, with fake video and voice stages ----------------------------------------------------------------

@pytest.fixture
def fake():
    host, av = narrated_host()
    return Omni("narrated_t2v", host=host), av


def run_all(omni, requests) -> dict:
    ended = {}
    for request in requests:
        omni.submit(request)
    while omni.has_unfinished():
        ended |= {e.request_id: e for e in omni.step() if isinstance(e, (RequestFinished, RequestFailed))}
    return ended


def test_both_branches_run_at_once_and_the_mux_joins_them(fake, tmp_path):
    omni, av = fake
    out = tmp_path / "fox.mp4"
    request = omni.request("a red fox in fresh snow", output=str(out), voice="ben", seed=1)
    result = run_all(omni, [request])[request.request_id].result
    narration = "A red fox trots through the fresh snow. The forest is quiet and cold."
    assert av.voice.said == {request.request_id: narration}
    assert result.path == str(out) and leftovers(tmp_path) == ["fox.mp4"]  # the video's own file is gone
    assert streams(out) == [("Video", "h264"), ("Audio", "aac")]
    trace = result.trace
    words = len(narration.split())
    assert trace["mux.narration_seconds"] == pytest.approx(words * WORD_SECONDS)
    assert trace["mux.loops"] == math.ceil(words * WORD_SECONDS / VIDEO_INFO.seconds)
    assert trace["narration.text"] == narration and trace["mux.length_policy"] == "loop"
    guidance = "slow dolly-in, soft morning light"
    assert trace["diffusion.prompt"] == f"a red fox in fresh snow\n\nSupplemental guidance: {guidance}"
    # the video and the voice both start when the AR stage ends, and each starts before the other ends
    times = {k: v for k, v in trace.items() if k.startswith("node.")}
    assert times["node.bridge.end_ms"] <= times["node.video.start_ms"] < times["node.speak.end_ms"]
    assert times["node.bridge.end_ms"] <= times["node.speak.start_ms"] < times["node.video.end_ms"]
    assert max(times["node.video.end_ms"], times["node.speak.end_ms"]) <= times["node.narrated.start_ms"]


def test_a_voice_failing_after_the_video_names_it_and_leaves_no_file(fake, tmp_path):
    """The video stage finished first (its file written, waiting at the join): the voice fails, the request fails
    naming the voice's node, the join releases the video's file; the other request is untouched."""
    omni, _ = fake
    bad = omni.request("a long story", output=str(tmp_path / "bad.mp4"))
    good = omni.request("a quiet lake", output=str(tmp_path / "good.mp4"))
    ended = run_all(omni, [bad, good])
    failed = ended[bad.request_id]
    assert isinstance(failed, RequestFailed) and failed.node_id == "speak" and "stumbled" in str(failed.error)
    assert isinstance(ended[good.request_id], RequestFinished)
    assert leftovers(tmp_path) == ["good.mp4"]


def test_a_video_failure_names_the_video_node_and_stops_the_voice(fake, tmp_path):
    omni, av = fake
    bad = omni.request("a BREAK scene", output=str(tmp_path / "bad.mp4"))
    good = omni.request("a quiet lake", output=str(tmp_path / "good.mp4"))
    ended = run_all(omni, [bad, good])
    assert isinstance(ended[bad.request_id], RequestFailed) and ended[bad.request_id].node_id == "video"
    assert isinstance(ended[good.request_id], RequestFinished)
    assert bad.request_id not in omni.graph.stages["speak"].engine.request_ids()
    assert leftovers(tmp_path) == ["good.mp4"]


def test_an_abort_while_the_mux_waits_removes_the_videos_file(fake, tmp_path):
    omni, _ = fake
    rid = omni.submit(omni.request("a long story", output=str(tmp_path / "x.mp4")))
    while not any(p.name.endswith(".tmp.mp4") for p in tmp_path.iterdir()):
        omni.step()
    omni.abort(rid)
    events = []
    while omni.has_unfinished():
        events += omni.step()
    assert [e.kind for e in events if isinstance(e, RequestFailed)] == ["aborted"]
    assert leftovers(tmp_path) == []


def test_bad_input_is_refused_before_any_work(fake, tmp_path):
    omni, av = fake
    with pytest.raises(InvalidParameter, match="not a voice") as info:
        omni.submit(omni.request("a quiet lake", voice="nobody", output=str(tmp_path / "x.mp4")))
    assert info.value.field == "voice"
    with pytest.raises(InvalidParameter, match="must end in .mp4") as info:
        omni.submit(omni.request("a quiet lake", output=str(tmp_path / "x.wav")))
    assert info.value.field == "output"
    assert not omni.has_unfinished() and av.voice.said == {} and leftovers(tmp_path) == []
