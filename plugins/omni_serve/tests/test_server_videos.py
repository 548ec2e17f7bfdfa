"""Video jobs on a served qwen_to_wan_i2v (the Wan node downstream of the AR bridge): an image sent as a data: URL,
a job that fails after it was accepted, the TTL that removes finished jobs and their files, and CORS."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import openai
import pytest
from PIL import Image

from omni_kernel.testing import wait_until

from serving import running, video_done

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

ASSET = Path(__file__).resolve().parents[3] / "examples" / "assets" / "image.png"
TTL_S = 4.0
ORIGIN = "http://app.example"
SMALL = {"model": "qwen_to_wan_i2v", "size": "64x96", "num_frames": "9", "num_inference_steps": "2", "seed": "3"}


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-videos")
    with running(["--pipeline", "qwen_to_wan_i2v", "--output-dir", str(tmp / "videos"), "--video-ttl", str(TTL_S),
                  "--allowed-origins", ORIGIN, "--shutdown-timeout", "5"], tmp / "server.log") as proc:
        proc.videos = tmp / "videos"
        yield proc


def test_a_data_url_image_through_the_bridge_renders_and_expires_after_the_ttl(server, http, tmp_path):
    url = "data:image/png;base64," + base64.b64encode(ASSET.read_bytes()).decode()
    r = http.post("/v1/videos", data={"prompt": "a lighthouse at dusk", "input_reference": url, **SMALL})
    assert r.status_code == 200, r.text
    job = video_done(http, r.json()["id"])
    assert job["status"] == "completed" and job["size"] == "64x96" and job["progress"] == 100
    assert job["expires_at"] == job["completed_at"] + int(TTL_S)
    content = http.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.content[4:8] == b"ftyp"  # an MP4
    files = list(server.videos.glob("*.mp4"))
    assert files, "the video is kept until the TTL"
    assert not (server.videos / ".uploads").exists() or not list((server.videos / ".uploads").iterdir())

    wait_until(lambda: http.get(f"/v1/videos/{job['id']}").status_code == 404, TTL_S + 5,  # the janitor: every TTL/4
               "the janitor to expire the video", interval=0.1)
    assert http.get(f"/v1/videos/{job['id']}/content").status_code == 404
    assert not any(f.exists() for f in files)


def test_an_image_that_breaks_after_its_header_fails_the_accepted_job_alone(server, http):
    buffer = io.BytesIO()
    Image.new("RGB", (96, 64), "red").save(buffer, format="PNG")
    truncated = buffer.getvalue()[:-40]  # the header is fine; the pixel data is cut short
    good = http.post("/v1/videos", files={"input_reference": ("ok.png", ASSET.read_bytes(), "image/png")},
                     data={"prompt": "a boat", **SMALL})
    r = http.post("/v1/videos", files={"input_reference": ("cut.png", truncated, "image/png")},
                  data={"prompt": "a fox", **SMALL})
    assert good.status_code == r.status_code == 200, r.text  # the downstream node checks only the header at submit
    failed = video_done(http, r.json()["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "bad_input", failed
    assert "image" in failed["error"]["message"]
    assert http.get(f"/v1/videos/{failed['id']}/content").status_code == 404
    assert video_done(http, good.json()["id"])["status"] == "completed"  # its neighbour is untouched
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.videos.retrieve(failed["id"]).status == "failed"  # the official client reads it, no raise
    assert http.get("/health").status_code == 200


def test_cors_answers_the_allowed_origin_only(http):
    allowed = http.options("/v1/videos", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = http.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    assert http.get("/v1/models", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN
