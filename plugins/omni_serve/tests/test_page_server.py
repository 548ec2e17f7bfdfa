"""What the web page builds on, without a browser: each model card's declared options (the page's form), and
`--no-ui`, which serves no page at all."""

from __future__ import annotations

import pytest

from serving import running

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-no-ui")
    with running(["--pipeline", "wan_i2v", "--pipeline", "wan_t2v", "--pipeline", "echo", "--no-ui",
                  "--output-dir", str(tmp / "videos")], tmp / "server.log") as proc:
        yield proc


def test_no_ui_serves_no_page(http):
    for path in ("/", "/ui/app.js", "/ui/index.html", "/ui/style.css"):
        assert http.get(path).status_code == 404, path
    assert http.get("/v1/models").status_code == 200


def test_a_video_models_card_declares_its_options_with_types_ranges_and_defaults(http):
    card = http.get("/v1/models/wan_i2v").json()
    assert card["id"] == "wan_i2v" and card["capabilities"] == ["videos"] and card["input_reference"] == "required"
    options = {o["name"]: o for o in card["options"]}
    assert {"num_inference_steps", "seed", "negative_prompt", "preset", "guidance_scale", "seconds",
            "step_cache"} <= set(options)
    assert not {"output", "profile", "return_frames"} & set(options)  # the server's own, never a request's
    steps, seed, seconds = options["num_inference_steps"], options["seed"], options["seconds"]
    assert (steps["type"], steps["minimum"], steps["maximum"], steps["default"]) == ("int", 1, None, None)
    assert (seed["type"], seed["minimum"], seed["maximum"]) == ("int", 0, 2**63 - 1)
    assert (seconds["type"], seconds["exclusive_minimum"], seconds["maximum"]) == ("float", 0, 60)
    assert options["step_cache"]["choices"] == ["none", "first_block", "mag"]
    assert options["negative_prompt"]["type"] == "str" and options["negative_prompt"]["help"]
    # what the card declares is what the API takes: a value outside the range is the API's 400, naming the field
    refused = http.post("/v1/videos", data={"model": "wan_t2v", "prompt": "a boat", "num_inference_steps": "0"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "num_inference_steps"


def test_a_text_to_video_card_takes_no_image_and_a_text_card_none_of_the_video_fields(http):
    assert http.get("/v1/models/wan_t2v").json()["input_reference"] == "none"
    echo = http.get("/v1/models/echo").json()
    assert echo["capabilities"] == ["chat.completions", "completions"] and "input_reference" not in echo
    assert "num_inference_steps" not in {o["name"] for o in echo["options"]}
