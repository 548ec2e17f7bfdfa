"""The real speech weights and recordings for omni_speech's tests. The session cache dir (omni_cache) comes from the
kernel's fixtures (omni_kernel.testing), which the repository's root conftest.py opts into; a test that asks for
voice_dir, whisper_dir or recordings is in the real_model tier (the root conftest.py's TIER_OF_FIXTURE)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_kernel.util.files import cache_dir
from omni_speech.weights import FETCH_COMMAND, VOICE, WHISPER, RegistryWheel, extract, fetched

# Read at import, before the session's omni_cache points OMNI_CACHE_DIR at a temporary directory: `make models`
# converted the default weights into the user's cache.
USER_CACHE = cache_dir()
# `make test` downloads the archives first (make download-speech), then converts them beside pytest (make models).
DOWNLOADS = Path(__file__).resolve().parents[3] / "build" / "downloads"
# Real recorded English speech with its transcripts (MIT), for the tests only: never installed (it pulls unrelated
# packages), opened as a zip. downloads/speech.txt pins it too.
RECORDINGS = RegistryWheel(package="pytest-audioeval", version="0.1.3", wheel="pytest_audioeval-0.1.3-py3-none-any.whl",
                           sha256="8b97369347232d43180dd9860189c547ccc8dedb42b7c21d511ddc5a05ef7ecc", megabytes=4,
                           license="MIT")
RECORDING_NAMES = ("hello_world", "quick_brown_fox", "counting")
RECORDING_DIR = "pytest_audioeval/samples/audio/en"


def user_model(model) -> Path | None:
    """The model in the user's cache, once a conversion under way ends (make test's, or another pytest worker's);
    converted here from make's download where none has started yet."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_CACHE_DIR", str(USER_CACHE))
        return fetched(model, DOWNLOADS / model.archive.wheel)


def _model_dir(model) -> Path:
    path = user_model(model)
    if path is None:
        pytest.skip(f"the real {model.name} is not in omni's cache: `make models` or `{FETCH_COMMAND} {model.name}` "
                    "fetches it (make test does)")
    return path


@pytest.fixture(scope="session")
def voice_dir() -> Path:
    """The converted Piper voice (a VitsModel directory; load it with omni_speech.vits_decoder.load_voice);
    read-only for tests. Skips the test when it was never fetched."""
    return _model_dir(VOICE)


@pytest.fixture(scope="session")
def whisper_dir() -> Path:
    """The converted Whisper tiny.en (a WhisperForConditionalGeneration directory); read-only for tests."""
    return _model_dir(WHISPER)


def registry_files(archive: RegistryWheel, members: tuple[str, ...], dest: Path) -> Path:
    """`members` of a pinned archive that make downloaded, verified and unpacked under `dest`; skips without it."""
    wheel = DOWNLOADS / archive.wheel
    if not wheel.is_file():
        pytest.skip(f"{wheel} is not there: `make download-speech` downloads it (make test does)")
    extract(archive, wheel, members, dest)
    return dest


@pytest.fixture(scope="session")
def recordings(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Real recorded English speech: name -> (the WAV file, what it says). The WAVs are IEEE-float: Python's `wave`
    rejects them; ffmpeg decodes them."""
    members = tuple(f"{RECORDING_DIR}/{name}.{ext}" for name in RECORDING_NAMES for ext in ("wav", "txt"))
    root = registry_files(RECORDINGS, members, tmp_path_factory.mktemp("recordings")) / RECORDING_DIR
    return {name: (root / f"{name}.wav", (root / f"{name}.txt").read_text().strip()) for name in RECORDING_NAMES}


@pytest.fixture(scope="session")
def piper_onnx(voice_dir, tmp_path_factory) -> Path:
    """The voice's .onnx from its verified wheel, for Piper's own runtime (onnxruntime), the voice's oracle."""
    return registry_files(VOICE.archive, VOICE.members, tmp_path_factory.mktemp("piper")) / VOICE.members[0]


@pytest.fixture(scope="session")
def ct2_whisper_dir(whisper_dir, tmp_path_factory) -> Path:
    """Whisper's CTranslate2 directory from its verified wheel, for CTranslate2, the converted Whisper's oracle."""
    vocabulary = f"{Path(WHISPER.members[0]).parent}/vocabulary.txt"  # CTranslate2 reads it; the conversion not
    root = registry_files(WHISPER.archive, (*WHISPER.members, vocabulary), tmp_path_factory.mktemp("ct2"))
    return (root / WHISPER.members[0]).parent


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct (omni_qwen's default AR model), for the spoken answers of `ar_speech`; read-only.
    Looked up in the user's cache as omni_qwen's own tests do; skips the test when it was never fetched."""
    from omni_qwen.registry_model import SMOLLM2

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_CACHE_DIR", str(USER_CACHE))
        from omni_qwen.registry_model import fetched as qwen_fetched

        path = qwen_fetched(SMOLLM2, DOWNLOADS / SMOLLM2.wheel)
    if path is None:
        pytest.skip(f"the real {SMOLLM2.name} is not in omni's cache: `make models` fetches it (make test does)")
    return path
