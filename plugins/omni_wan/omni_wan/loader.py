"""The model pool: a model loads once and stays loaded across requests and stage rebuilds of its owner
(WanStages, one per plugin host)."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import attrs
from omni_kernel.errors import ModelError

from .device import Placement

log = logging.getLogger("omni")


@attrs.frozen
class Loaded:
    model: object
    key: tuple  # names the loaded model in prepare-cache keys too
    cold: bool
    load_ms: float


class ModelPool:
    def __init__(self):
        self._models: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def acquire(self, path: Path, placement: Placement) -> Loaded:
        key = (str(path), placement)
        with self._lock:
            model = self._models.get(key)
            if model is not None:
                return Loaded(model, key, cold=False, load_ms=0.0)
            start = time.perf_counter()
            model = _load(path, placement)
            self._models[key] = model
            return Loaded(model, key, cold=True, load_ms=(time.perf_counter() - start) * 1000)

    def clear(self) -> None:
        with self._lock:
            self._models.clear()


def _load(path: Path, placement: Placement):
    from .model import Wan22I2VPipeline

    log.info("loading Wan2.2 from %s (%s, VAE %s, offload: %s)", path, placement.device, placement.vae_dtype,
             placement.offload)
    try:
        with quiet_libraries():
            return Wan22I2VPipeline.load(path, placement)
    except Exception as exc:  # noqa: BLE001 - whatever breaks a load, the directory is what the user can fix
        raise ModelError(f"cannot load a Wan2.2 TI2V model from {path}: {' '.join(str(exc).split())}") from None


@contextmanager
def quiet_libraries():
    """Silence diffusers' and transformers' progress bars and import-time notices (the CLI draws its own
    progress and prints one line per problem); restore their settings afterwards."""
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    levels = tlog.get_verbosity(), dlog.get_verbosity()
    bars = tlog.is_progress_bar_enabled(), dlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    dlog.set_verbosity_error()
    tlog.disable_progress_bar()
    dlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(levels[0])
        dlog.set_verbosity(levels[1])
        if bars[0]:
            tlog.enable_progress_bar()
        if bars[1]:
            dlog.enable_progress_bar()

