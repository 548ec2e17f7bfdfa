"""What a Wan request writes, checked when it is submitted, before any model work: the MP4 (and, with
`profile`, its Chrome trace next to it) must be creatable, and the prompt must say something."""

from __future__ import annotations

import os
from pathlib import Path

from omni_kernel.errors import InputError, InvalidParameter
from omni_kernel.files import check_output_path

from .profiler import profile_path


def check_request(prompt: str, output: str | None, request_id: str, profile: bool = False) -> Path:
    """The request's output path; InputError for an empty prompt, InvalidParameter("output") for a path that
    cannot be written (see omni_kernel.files.check_output_path)."""
    if not prompt.strip():
        raise InputError("the prompt is empty")
    path = Path(output or f"omni_{request_id}.mp4").expanduser()
    if path.suffix.lower() != ".mp4":
        raise InvalidParameter("output", f"{str(path)!r} must end in .mp4 (the stage writes H.264 MP4)")
    if os.path.isdir(path):  # (never raises, e.g. for a name too long)
        raise InvalidParameter("output", f"{str(path)!r} is a directory; name a file such as {path / 'out.mp4'}")
    target = check_output_path(path, "output")
    if profile:
        check_output_path(profile_path(target), "output")
    return target
