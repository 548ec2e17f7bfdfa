"""A served wan_i2v refusing bad input images: every error names `input_reference` and never the server's own
path of the upload."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from serving import running

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG signature and IHDR that claim a huge image, and nothing after."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("video-errors")
    with running(["--pipeline", "wan_i2v", "--output-dir", str(tmp / "videos")], tmp / "server.log") as proc:
        proc.videos = tmp / "videos"
        yield proc


BAD_FILES = {"a text file": ("notes.txt", b"just some text\n"), "a truncated PNG": ("t.png", _png()[:60]),
             "a 0-byte PNG": ("empty.png", b""), "a header claiming 900 MP": ("huge.png", _png_claiming(30000, 30000))}


@pytest.mark.parametrize("what", BAD_FILES)
def test_a_bad_uploaded_image_names_input_reference_not_the_servers_path(server, http, what):
    name, data = BAD_FILES[what]
    r = http.post("/v1/videos", files={"input_reference": (name, data, "application/octet-stream")},
                  data={"prompt": "p", "model": "wan_i2v", "size": "64x64", "num_frames": "5",
                        "num_inference_steps": "1"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input_reference", error
    assert str(server.videos) not in error["message"] and ".uploads" not in error["message"], error
    assert "input_reference" in error["message"], error
    assert not list((server.videos / ".uploads").glob("*")) if (server.videos / ".uploads").exists() else True


@pytest.mark.parametrize("url", ["data:image/png;base64,", "data:image/png;base64," +
                                 base64.b64encode(b"not an image at all").decode(),
                                 "data:text/plain;base64,aGVsbG8="])
def test_a_bad_data_url_names_input_reference_not_the_servers_path(server, http, url):
    r = http.post("/v1/videos", data={"prompt": "p", "model": "wan_i2v", "input_reference": url})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input_reference" and str(server.videos) not in error["message"], error


def test_a_good_image_still_renders(server, http):
    r = http.post("/v1/videos", files={"input_reference": ("ok.png", _png(), "image/png")},
                  data={"prompt": "a red square", "model": "wan_i2v", "size": "64x64", "num_frames": "5",
                        "num_inference_steps": "1"})
    assert r.status_code == 200, r.text
    assert Path  # the job itself is covered by test_server.py
