"""How omni's torch plugins load models, written once: quiet and pickle-free loads, dtype names, devices, a pool.

Importing this module imports no torch, transformers or diffusers (each function imports what it needs), so a
plugin's torch-free config module can take `DTYPE_NAMES` from here.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import attrs

from omni_kernel.core.errors import InvalidParameter, ModelError

log = logging.getLogger("omni")

# Every dtype name a config may give, and the torch dtype it means (None: the checkpoint's own).
DTYPES = {"auto": None, "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
DTYPE_NAMES = tuple(DTYPES)


def torch_dtype(name: str | None, field: str = "dtype"):
    """The torch dtype a name means; None for None or "auto" (keep the checkpoint's). An unknown name is an
    InvalidParameter of `field`."""
    if name is None:
        return None
    if name not in DTYPES:
        raise InvalidParameter(field, f"{name!r} is not one of {', '.join(DTYPES)}")
    import torch

    return None if DTYPES[name] is None else getattr(torch, DTYPES[name])


def resolve_device(name: str | None, field: str = "device") -> str:
    """The torch device to run on: None or "auto" is CUDA when torch sees it, else the CPU; anything else must
    be a torch device that is there (an InvalidParameter of `field` otherwise). Returns the name as given.
    "cpu" imports no torch: a front that only places a stage in a worker process stays without it."""
    if name == "cpu":
        return name
    import torch

    if name is None or name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise InvalidParameter(field, f"{name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameter(field, f"{name!r} asks for CUDA but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InvalidParameter(field, f"{name!r} asks for a CUDA device that is not there "
                                      f"(torch sees {torch.cuda.device_count()})")
    return name


def refuse_unpickling(*args, **kwargs):
    """What torch.load is inside quiet_hf_load: a checkpoint that needs unpickling is refused in one line."""
    raise ModelError("the checkpoint asks to unpickle a file (torch.load); omni loads safetensors only")


class _ToDebug(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        log.debug("%s: %s", record.name, record.getMessage())


class _Quiet:
    """The process-wide state quiet_hf_load changes, counted: blocks open in several threads at once (two
    stages loading) install it on the first entry and restore it on the last exit, so one block's exit never
    lifts the torch.load ban from under another, nor leaves it on for good."""

    def __init__(self):
        self.lock = threading.Lock()
        self.depth = 0
        self.torch_load: Any = None
        self.warnings: Any = None
        self.caught: list = []
        self.libraries: dict[str, list] = {}  # name -> [depth, bar was on, handlers, level, propagate]

    def enter(self, modules: dict[str, Any]) -> None:
        import torch

        if self.depth == 0:
            self.torch_load, torch.load = torch.load, refuse_unpickling
            self.warnings = warnings.catch_warnings(record=True)
            self.caught = self.warnings.__enter__()
            warnings.simplefilter("always")
        self.depth += 1
        for name, module in modules.items():
            if name in self.libraries:
                self.libraries[name][0] += 1
                continue
            root = module.get_logger()  # configures the library's root logger: its handler is the one to swap
            self.libraries[name] = [1, module.is_progress_bar_enabled(), root.handlers[:], root.level,
                                    root.propagate]
            module.disable_progress_bar()
            root.handlers[:], root.propagate = [_ToDebug()], False
            root.setLevel(logging.WARNING)

    def exit(self, modules: dict[str, Any]) -> None:
        import torch

        for name, module in modules.items():
            saved = self.libraries[name]
            saved[0] -= 1
            if saved[0] == 0:
                del self.libraries[name]
                root = module.get_logger()
                root.handlers[:], root.level, root.propagate = saved[2], saved[3], saved[4]
                if saved[1]:
                    module.enable_progress_bar()
        caught, self.caught[:] = self.caught[:], []
        self.depth -= 1
        if self.depth == 0:
            self.warnings.__exit__(None, None, None)
            torch.load, self.torch_load = self.torch_load, None
        for w in caught:
            log.debug("%s: %s", w.category.__name__, w.message)


_QUIET = _Quiet()


@contextmanager
def quiet_hf_load(libraries: Iterable[str]) -> Iterator[None]:
    """Load models quietly and safely with the named Hugging Face libraries ("transformers", "diffusers").

    The libraries draw a progress bar per load, print load reports and warn; omni's CLI prints its own output
    and one line per problem. Inside this block their progress bars are off, their log records and Python
    warnings go to the "omni" log at debug level, and torch.load refuses to run (omni unpickles nothing: a
    pickled checkpoint is a ModelError). Everything is restored afterwards.
    """
    modules = {name: importlib.import_module(f"{name}.utils.logging") for name in dict.fromkeys(libraries)}
    with _QUIET.lock:
        _QUIET.enter(modules)
    try:
        yield
    finally:
        with _QUIET.lock:
            _QUIET.exit(modules)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@attrs.frozen
class Loaded(Generic[V]):
    model: V
    key: Hashable  # what the model was loaded from; it names the model in other cache keys too
    cold: bool  # this acquire loaded it
    load_ms: float  # 0.0 when warm


class ModelPool(Generic[K, V]):
    """Models loaded once per key and kept: `load(key)` builds one from everything its key names (so the key
    is the whole of what the model depends on). acquire is thread-safe; threads that ask for one key while it
    loads wait for that load and get it warm; other keys load at the same time. A failed load caches nothing.
    A loader must not acquire its own key from its own pool."""

    def __init__(self, load: Callable[[K], V]):
        self._load = load
        self._models: dict[K, V] = {}
        self._loading: dict[K, threading.Lock] = {}
        self._lock = threading.Lock()

    def acquire(self, key: K) -> Loaded[V]:
        with self._lock:
            if key in self._models:
                return Loaded(self._models[key], key, cold=False, load_ms=0.0)
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                if key in self._models:
                    return Loaded(self._models[key], key, cold=False, load_ms=0.0)
            start = time.perf_counter()
            model = self._load(key)
            load_ms = (time.perf_counter() - start) * 1000
            with self._lock:
                self._models[key] = model
                self._loading.pop(key, None)
            return Loaded(model, key, cold=True, load_ms=load_ms)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._models

    def __len__(self) -> int:
        with self._lock:
            return len(self._models)

    def values(self) -> list:
        """The models loaded so far."""
        with self._lock:
            return list(self._models.values())

    def clear(self) -> None:
        with self._lock:
            self._models.clear()
