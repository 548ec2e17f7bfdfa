"""`omni run --pipeline wan_i2v`: an empty --output is refused, a profile trace that cannot be written leaves no
MP4, failures read as plain words, and a progress bar cut short ends its line before the error."""

from __future__ import annotations

import io
import sys

import pytest
from click.testing import CliRunner

from omni_kernel.cli import main
from omni_kernel.core.errors import classify


def test_an_empty_output_is_refused_before_anything_runs(tiny_model, image_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["run", "--pipeline", "wan_i2v", "--prompt", "a cat", "--image",
                                       str(image_path), "--model", str(tiny_model), "--output", "", "--steps", "1"])
    assert result.exit_code == 2, result.output
    assert "invalid output: is empty" in result.output
    assert not list(tmp_path.glob("*.mp4"))


def test_a_profile_trace_that_cannot_be_written_fails_and_keeps_no_mp4(tiny_model, image_path, tmp_path,
                                                                       monkeypatch):
    from omni_wan.profiler import Profiler

    def read_only(self, path, request_id):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(Profiler, "write_chrome_trace", read_only)
    out = tmp_path / "video.mp4"
    result = CliRunner().invoke(main, ["run", "--pipeline", "wan_i2v", "--prompt", "a cat", "--image",
                                       str(image_path), "--model", str(tiny_model), "--output", str(out),
                                       "--steps", "1", "--num-frames", "5", "--height", "64", "--width", "64",
                                       "--profile"])
    assert result.exit_code == 1, result.output
    assert not out.exists() and not list(tmp_path.glob(".*tmp*"))
    line = result.output.strip().splitlines()[-1]
    assert "read-only file system" in line.lower() and "profile trace" in line, line
    assert "OSError" not in line and "RequestError" not in line and "Errno" not in line, line


def test_runtime_failures_are_plain_words():
    from omni_kernel.core.errors import RequestError

    assert classify(RequestError("the latents are NaN")) == ("runtime", "the latents are NaN", None)
    assert classify(OSError(30, "Read-only file system", "/ro/out.mp4"))[1] == "read-only file system: /ro/out.mp4"
    assert classify(RuntimeError("kaput"))[1] == "RuntimeError: kaput"  # unexpected: its type says where


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_bar_cut_short_ends_its_line_before_the_error(monkeypatch):
    from omni_kernel.cli import run as cli_run
    from omni_kernel.core.errors import RequestError
    from omni_kernel.events import RequestFailed, StageProgress

    class Fake:
        class graph:
            final = "wan"
            finals = ("wan",)

        @staticmethod
        def generate_stream(request):
            yield StageProgress("r", "wan", 1, 4, "denoise")
            yield RequestFailed("r", "wan", "the disk is full", "runtime")

    err = _TTY()
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(RequestError):
        cli_run._drive(Fake, None, stream=False)
    line = err.getvalue().split("\r")[-1]  # the bar as last drawn, when the failure closed it
    assert "wan denoise" in line and " 1/4 [" in line and line.endswith("]\n"), repr(err.getvalue())
