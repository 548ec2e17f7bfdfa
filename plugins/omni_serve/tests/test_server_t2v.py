"""The Videos API on wan_t2v (no input_reference) beside wan_i2v in one server: a text-only job renders at the
preset's landscape size or the form's `size`; an image sent to the text-only pipeline, or none to wan_i2v, is a 400
naming the form's field `input_reference` (the request's `image`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving import running, video_done

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

ASSET = Path(__file__).resolve().parents[3] / "examples" / "assets" / "image.png"
SMALL = {"size": "96x64", "num_frames": "9", "num_inference_steps": "2", "seed": "3"}


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-t2v")
    with running(["--pipeline", "wan_t2v", "--pipeline", "wan_i2v", "--output-dir", str(tmp / "videos"),
                  "--shutdown-timeout", "5"], tmp / "server.log") as proc:
        yield proc


def test_a_text_to_video_job_needs_no_input_reference(http):
    r = http.post("/v1/videos", data={"prompt": "a lighthouse at dusk", "model": "wan_t2v", **SMALL})
    assert r.status_code == 200, r.text
    job = video_done(http, r.json()["id"])
    assert job["status"] == "completed" and job["size"] == "96x64", job
    content = http.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.content[4:8] == b"ftyp"


def test_an_image_to_the_text_pipeline_or_none_to_wan_i2v_names_input_reference(http):
    with open(ASSET, "rb") as image:
        r = http.post("/v1/videos", files={"input_reference": ("i.png", image, "image/png")},
                      data={"prompt": "p", "model": "wan_t2v", **SMALL})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input_reference", r.text
    assert error["message"].startswith("invalid input_reference: ") and "--image" not in error["message"]
    r = http.post("/v1/videos", data={"prompt": "p", "model": "wan_i2v", **SMALL})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input_reference", r.text
    assert "needs an input image" in error["message"] and "--image" not in error["message"]


def test_bad_step_cache_fields_are_a_400_naming_the_field(http):
    bad = {"step_cache_threshold": ({"step_cache": "first_block", "step_cache_threshold": "-0.5"}, "json"),
           "step_cache": ({"step_cache": "teacache"}, "form")}
    for field, (values, kind) in bad.items():
        body = {"prompt": "p", "model": "wan_t2v", **SMALL, **values}
        r = http.post("/v1/videos", json=body) if kind == "json" else http.post("/v1/videos", data=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field, r.text
    r = http.post("/v1/videos", data={"prompt": "a kite", "model": "wan_t2v", **SMALL, "step_cache": "first_block",
                                      "step_cache_threshold": "0.1"})
    assert r.status_code == 200, r.text
    assert video_done(http, r.json()["id"])["status"] == "completed"
