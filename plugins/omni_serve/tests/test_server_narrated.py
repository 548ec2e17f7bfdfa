"""The Videos API on omni_bridge's narrated_t2v: the job's MP4 has its sound (one H.264 and one AAC stream), its
length is the looped video's (docs/narrated.md), and what the voice refuses (an unknown voice) is a 400 naming the
field before any work. The AR stage is the tiny demo model (the test session's default): its narration is noise the
voice still speaks."""

from __future__ import annotations

import re
import subprocess

import pytest

from serving import USER_CACHE, running, speech_weights, video_done

pytestmark = [pytest.mark.server, pytest.mark.real_model,
              pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

SMALL = {"size": "96x64", "num_frames": "9", "num_inference_steps": "2", "seed": "3"}


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    from omni_speech import weights

    voice = speech_weights(weights, weights.VOICE)
    if voice is None:
        pytest.skip(f"the real voice is not in {USER_CACHE}: `make models` fetches it (make test does)")
    tmp = tmp_path_factory.mktemp("serve-narrated")
    with running(["--pipeline", "narrated_t2v", "-c", f"tts_model={voice}", "--output-dir", str(tmp / "videos"),
                  "--shutdown-timeout", "5"], tmp / "server.log") as proc:
        yield proc


def streams(path) -> list[tuple[str, str]]:
    import imageio_ffmpeg

    info = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)], capture_output=True,
                          text=True).stderr
    return re.findall(r"Stream #\d+:\d+.*?: (Video|Audio): (\w+)", info)


def test_a_narrated_job_returns_the_mp4_with_its_sound(server, http, tmp_path):
    r = http.post("/v1/videos", data={"prompt": "a lighthouse at dusk", "model": "narrated_t2v", **SMALL})
    assert r.status_code == 200, r.text
    job = video_done(http, r.json()["id"], timeout=300)
    assert job["status"] == "completed" and job["size"] == "96x64", job
    assert float(job["seconds"]) >= 9 / 24  # the video, looped while the narration speaks
    content = http.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    (tmp_path / "job.mp4").write_bytes(content.content)
    assert streams(tmp_path / "job.mp4") == [("Video", "h264"), ("Audio", "aac")]


def test_an_unknown_voice_is_a_400_naming_the_field(server, http):
    r = http.post("/v1/videos", data={"prompt": "a lighthouse", "model": "narrated_t2v", "voice": "nobody", **SMALL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice", r.text
