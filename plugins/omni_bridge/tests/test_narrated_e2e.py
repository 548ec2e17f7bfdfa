"""narrated_t2v on the real video and voice stages: the tiny demo Wan2.2 checkpoint (real diffusers classes, random
weights), the real Piper voice, the real Whisper to listen. The AR stage is the fake one (bridge_fakes: a narrated
answer per prompt, as the constrained stage writes it; test_narrated_constrained.py runs the real one), so the
narration is known English and the test measures the voice and the mux, not a model's prose."""

from __future__ import annotations

import math
import re

import pytest
from click.testing import CliRunner

from omni_kernel import InvalidParameter, Omni
from omni_kernel.events import AudioDelta, RequestFailed, RequestFinished, StageProgress
from omni_kernel.plugins import PluginHost

from bridge_fakes import NARRATED_REPLIES, FakeModels
from narrated_media import audio_pcm, frames, streams, wav

PROMPT = "a red fox in fresh snow"
NARRATION = "A red fox trots through the fresh snow. The forest is quiet and cold."
MAX_WER = 0.2  # tiny.en on one 13-word sentence: at most two words misheard (the round trip measures 5% over 23)
WHISPER_RATE = 16000


def words(text: str) -> list[str]:
    """Lowercased words, punctuation but the apostrophe dropped (omni_speech's round trip normalizes the same way;
    the narration has no digits)."""
    return [w.strip("'") for w in re.sub(r"[^a-z0-9']+", " ", text.lower()).split() if w.strip("'")]


def word_errors(reference: str, hypothesis: str) -> int:
    """The fewest word substitutions, deletions and insertions that turn the hypothesis into the reference."""
    ref, hyp = words(reference), words(hypothesis)
    previous = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        current = [i]
        for j, h in enumerate(hyp, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


@pytest.fixture(scope="module")
def host(omni_cache):
    from omni_bridge.plugin import BridgePlugin
    from omni_speech.plugin import SpeechPlugin
    from omni_wan.plugin import WanPlugin

    host = PluginHost()
    host.register(BridgePlugin(), "omni_bridge")
    host.register(FakeModels(only=("ar.prompt_bridge",)), "fake_ar")
    host.register(WanPlugin(), "omni_wan")
    host.register(SpeechPlugin(), "omni_speech")
    return host


@pytest.fixture(scope="module")
def narrated(host, voice_dir):
    return Omni("narrated_t2v", host=host, device="cpu", tts_model=str(voice_dir), tts_device="cpu")


@pytest.fixture(scope="module")
def fox(narrated, tmp_path_factory):
    """One narrated request: its events and result."""
    out = tmp_path_factory.mktemp("fox") / "fox.mp4"
    events = list(narrated.generate_stream(PROMPT, seed=0, output=str(out)))
    assert isinstance(events[-1], RequestFinished), events[-1]
    return events, events[-1].result, out


def test_the_narration_is_the_ar_answers(fox):
    assert NARRATED_REPLIES[PROMPT][0].endswith(f'"narration": "{NARRATION}"}}')
    _, result, _ = fox
    assert result.trace["narration.text"] == NARRATION and result.trace["narration.parse_success"] is True


def test_one_video_and_one_audio_stream_and_nothing_else_left(fox):
    _, result, out = fox
    assert result.path == str(out)
    assert streams(out) == [("Video", "h264"), ("Audio", "aac")]
    assert sorted(p.name for p in out.parent.iterdir()) == ["fox.mp4"]  # the Wan stage's own file is gone


def test_its_frames_are_the_wan_stages_alone_on_the_same_request(fox, host, tmp_path):
    """wan_t2v on the same plugin host (the same Wan engine), the prompt the narrated Wan node rendered, the same
    seed: its MP4's frames, bit for bit, once per loop."""
    _, result, out = fox
    wan = Omni("wan_t2v", host=host, device="cpu")
    alone = wan.generate(result.trace["diffusion.prompt"], seed=0, output=str(tmp_path / "alone.mp4"))
    assert alone.trace["diffusion.seed"] == result.trace["diffusion.seed"] == 0
    expected, muxed = frames(alone.path), frames(out)
    loops = result.trace["mux.loops"]
    assert muxed.shape == (loops * len(expected), *expected.shape[1:])
    assert all((muxed[i * len(expected):(i + 1) * len(expected)] == expected).all() for i in range(loops))


def test_the_whole_narration_is_heard_and_whisper_hears_it(fox, whisper_dir):
    """The length policy (loop): the narration is longer than the demo's 9 frames, so the video loops until it has
    ended; the audio track, decoded, is the whole narration, and Whisper (omni's asr pipeline) hears its words."""
    _, result, out = fox
    trace = result.trace
    narration_s = trace["tts.audio_seconds"]
    assert trace["mux.narration_seconds"] == pytest.approx(narration_s, abs=1e-3)
    assert trace["mux.loops"] == math.ceil(narration_s / trace["mux.video_seconds"]) > 1
    assert trace["mux.seconds"] >= narration_s
    pcm = audio_pcm(out, WHISPER_RATE)
    assert len(pcm) / 2 / WHISPER_RATE >= narration_s - 0.01
    with Omni("asr", asr_model=str(whisper_dir), asr_device="cpu") as asr:
        heard = asr.generate(audio=wav(pcm, WHISPER_RATE)).text
    errors = word_errors(NARRATION, heard)
    assert errors / len(words(NARRATION)) <= MAX_WER, f"{errors} word errors: {heard!r}"


def test_the_two_branches_run_at_once(fox):
    """The voice's first audio came while the Wan stage was still denoising (events in between its steps), and the
    trace's per-node times overlap."""
    events, result, _ = fox
    kinds = [(type(e).__name__, e.node_id) for e in events if isinstance(e, (StageProgress, AudioDelta))]
    steps = [i for i, k in enumerate(kinds) if k == ("StageProgress", "video")]
    audio = [i for i, k in enumerate(kinds) if k == ("AudioDelta", "speak")]
    assert steps and audio and steps[0] < audio[0] < steps[-1], kinds
    trace = result.trace
    assert trace["node.video.start_ms"] < trace["node.speak.end_ms"]
    assert trace["node.speak.start_ms"] < trace["node.video.end_ms"]
    assert trace["tts.first_audio_ms"] < trace["node.video.end_ms"]


def test_bad_input_is_refused_before_any_work(narrated, tmp_path):
    for params, field in (({"height": 100}, "height"), ({"voice": "nobody"}, "voice"),
                          ({"output": str(tmp_path / "x.wav")}, "output")):
        with pytest.raises(InvalidParameter) as info:
            narrated.submit(narrated.request(PROMPT, **{"output": str(tmp_path / "x.mp4"), **params}))
        assert info.value.field == field
    assert not narrated.has_unfinished() and list(tmp_path.iterdir()) == []


def test_a_voice_failure_fails_its_request_only_naming_the_voice(narrated, tmp_path):
    """A narration with nothing to say fails at the voice's hand-off: the Wan stage stops, no MP4; the other
    request, in flight at the same time, finishes."""
    bad = narrated.request("nothing to say", seed=1, output=str(tmp_path / "bad.mp4"))
    good = narrated.request("a short clip", seed=1, output=str(tmp_path / "good.mp4"))
    ended = {}
    for event in narrated.run([bad, good]):
        if isinstance(event, (RequestFinished, RequestFailed)):
            ended[event.request_id] = event
    assert isinstance(ended[bad.request_id], RequestFailed) and ended[bad.request_id].node_id == "speak"
    assert isinstance(ended[good.request_id], RequestFinished)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.mp4"]


def test_omni_run_writes_the_narrated_mp4(host, voice_dir, tmp_path):
    from omni_kernel.cli import main

    out = tmp_path / "lake.mp4"
    result = CliRunner().invoke(main, ["run", "--pipeline", "narrated_t2v", "--prompt", "a quiet lake", "--seed", "0",
                                       "--output", str(out), "--tts-model", str(voice_dir)], obj={"host": host})
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {out}\n"
    assert streams(out) == [("Video", "h264"), ("Audio", "aac")]
    assert "mux.loops" in result.stderr and "node.speak.start_ms" in result.stderr


def test_narrated_i2v_renders_the_image_with_its_narration_and_needs_one(host, voice_dir, tmp_path):
    from pathlib import Path

    image = Path(__file__).resolve().parents[3] / "examples" / "assets" / "image.png"
    i2v = Omni("narrated_i2v", host=host, device="cpu", tts_model=str(voice_dir), tts_device="cpu")
    with pytest.raises(InvalidParameter) as info:
        i2v.submit(i2v.request("a short clip", output=str(tmp_path / "none.mp4")))
    assert info.value.field == "image" and not i2v.has_unfinished()
    result = i2v.generate("a short clip", image=str(image), seed=0, output=str(tmp_path / "clip.mp4"))
    assert result.trace["diffusion.task"] == "image_to_video" and result.trace["narration.text"] == "Snow."
    assert streams(result.path) == [("Video", "h264"), ("Audio", "aac")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]
