"""`omni run --pipeline wan_i2v` from the command line: bad input is one line, exit 2, and no file."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from omni_kernel.cli import main


def _run(tmp_path: Path, *args: str):
    out = tmp_path / "out" / "video.mp4"
    result = CliRunner().invoke(main, ["run", "--pipeline", "wan_i2v", "--prompt", "a cat surfing",
                                       "--output", str(out), *args])
    return result, out


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims a huge size: the decompression-bomb case, without the memory."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def bad_inputs(tiny_model, image_path, tmp_path_factory) -> dict:
    """Every bad-input case's arguments and expected message; the files are written once for the module."""
    files = tmp_path_factory.mktemp("bad-inputs")
    (files / "notes.txt").write_text("not an image")
    (files / "empty.png").write_bytes(b"")
    (files / "bomb.png").write_bytes(_png_claiming(60_000, 60_000))
    (files / "truncated.png").write_bytes(image_path.read_bytes()[:200])
    (files / "wrong_model").mkdir()
    (files / "wrong_model" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    m, i = ["--model", str(tiny_model)], ["--image", str(image_path)]
    return {
        "missing image flag": (m, "needs an input image"),
        "image does not exist": (m + ["--image", str(files / "nope.png")], "does not exist"),
        "image is a directory": (m + ["--image", str(files)], "is not a file"),
        "not an image": (m + ["--image", str(files / "notes.txt")], "is not an image"),
        "zero-size image": (m + ["--image", str(files / "empty.png")], "empty (0 bytes)"),
        "decompression bomb": (m + ["--image", str(files / "bomb.png")], "MP limit"),
        "truncated image": (m + ["--image", str(files / "truncated.png")], "cannot be read"),
        "height not a multiple of 32": (m + i + ["--height", "100"], "nearest valid: 96 or 128"),
        "width not a multiple of 32": (m + i + ["--width", "70"], "nearest valid: 64 or 96"),
        "frames not 4k+1": (m + i + ["--num-frames", "10"], "nearest valid: 9 or 13"),
        "size too large": (m + i + ["--width", "8192"], "nearest valid: 4096"),
        "unknown preset": (m + i + ["--preset", "ultra"], "choose one of quality, balanced, fast, smoke"),
        "missing model dir": (["--model", str(files / "no_model")] + i, "does not exist"),
        "wrong model dir": (["--model", str(files / "wrong_model")] + i, "not a Wan2.2-TI2V-5B-Diffusers"),
        "model path is a file": (["--model", str(files / "notes.txt")] + i, "is not a directory"),
    }


CASES = ["missing image flag", "image does not exist", "image is a directory", "not an image", "zero-size image",
         "decompression bomb", "truncated image", "height not a multiple of 32", "width not a multiple of 32",
         "frames not 4k+1", "size too large", "unknown preset", "missing model dir", "wrong model dir",
         "model path is a file"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_no_file(case, bad_inputs, tmp_path):
    args, expected = bad_inputs[case]
    result, out = _run(tmp_path, *args)
    assert result.exit_code == 2, result.output
    # The model loads when the stage is built, before the request's inputs are processed: its log line may come first.
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("omni: loading Wan2.2 from")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.output
    assert not out.exists() and not out.parent.exists()


def test_output_that_is_not_mp4_is_refused(tiny_model, image_path, tmp_path):
    result = CliRunner().invoke(main, ["run", "--pipeline", "wan_i2v", "--prompt", "x", "--model", str(tiny_model),
                                       "--image", str(image_path), "--output", str(tmp_path / "v.gif")])
    assert result.exit_code == 2 and "must end in .mp4" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_output_that_is_a_directory_is_refused(tiny_model, image_path, tmp_path):
    (tmp_path / "clips.mp4").mkdir()
    result = CliRunner().invoke(main, ["run", "--pipeline", "wan_i2v", "--prompt", "x", "--model", str(tiny_model),
                                       "--image", str(image_path), "--output", str(tmp_path / "clips.mp4")])
    assert result.exit_code == 2 and "is a directory; name a file such as" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["clips.mp4"] and not any((tmp_path / "clips.mp4").iterdir())


def test_cli_run_writes_mp4_and_trace(tiny_model, image_path, tmp_path):
    trace_json = tmp_path / "trace.json"
    result, out = _run(tmp_path, "--model", str(tiny_model), "--image", str(image_path), "--preset", "smoke",
                       "--seed", "5", "--trace-json", str(trace_json), "-c", "wan_video_preset=ultrafast")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"wrote {out}"
    trace = json.loads(trace_json.read_text())
    assert trace["diffusion.preset"] == "smoke" and trace["diffusion.seed"] == 5
    assert b"subme=0" in out.read_bytes()  # x264's settings, in the stream: the ultrafast preset


@pytest.mark.cli_subprocess
def test_installed_omni_script_smoke_with_profile(image_path, tmp_path, omni_cache):
    """The command of the issue's "done when", on the demo model, in a subprocess."""
    omni = Path(sys.executable).with_name("omni")
    out = tmp_path / "out.mp4"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMNI_CACHE_DIR=str(omni_cache))
    proc = subprocess.run([str(omni), "run", "--pipeline", "wan_i2v", "--image", str(image_path), "--prompt",
                           "a cat surfing", "--preset", "smoke", "--output", str(out), "--profile"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("using a random-weight demo model") == 1 and "pass --model DIR" in proc.stderr
    assert "vae_decode" in proc.stderr and "diffusion.load_was_cold" in proc.stderr
    assert out.is_file() and (tmp_path / "out.trace.json").is_file()
