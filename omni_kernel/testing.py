"""Helpers for omni's and its plugins' tests.

Pytest fixtures; opt in with `pytest_plugins = ["omni_kernel.testing"]` in the rootdir conftest.py. Nothing is
autouse and there is no `pytest11` entry point, so installing omni changes no other project's tests.
`omni_cache` keeps everything omni builds on first use (demo checkpoints) in a session tmp dir and keeps model
hubs offline; `omni_logger` restores the "omni" logger that the CLI configures, so no test leaks handlers.

Plain functions, which need neither pytest nor torch (a benchmark or a stage worker may import them):
`drain` steps anything with `has_unfinished()` and `step()` until it is done, and `wait_until` polls an
observable condition up to a deadline. A test that needs something to have happened waits on it with
`wait_until` instead of sleeping; both fail with a message that says what they waited for instead of hanging.
`call_chain` records omni's frames from `Omni.generate` down to a method (a model's forward), and
`assert_chain_goes_down` checks that such a chain never calls back up (docs/architecture.md shows the chains).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs

try:
    import pytest

    fixture = pytest.fixture
except ImportError:  # drain and wait_until work without pytest

    def fixture(*args, **kwargs):
        return lambda fn: fn


T = TypeVar("T")


class Steppable(Protocol):
    """What `drain` steps: an Omni, a StageScheduler or an Engine."""

    def has_unfinished(self) -> bool: ...
    def step(self) -> list: ...


def drain(stepper: Steppable, limit: int | None = 10_000, *, until: Callable[[], bool] | None = None,
          on_step: Callable[[list], Any] | None = None) -> list:
    """Step `stepper` until nothing is unfinished (or, given `until`, until `until()` is true); return everything
    its steps returned, in order (events from an Omni or a StageScheduler, RequestOutputs from an Engine).

    `on_step(items)` runs after each step with what that step returned (to look at the scheduler between steps,
    or to submit a late arrival). More than `limit` steps (None: no limit) fails with an AssertionError instead
    of hanging. Unlike `Omni.run`, it submits nothing, takes any steppable and has a bound.
    """
    if until is None:
        def until() -> bool:
            return not stepper.has_unfinished()

    items: list = []
    steps = 0
    while not until():
        if limit is not None and steps >= limit:
            raise AssertionError(f"{type(stepper).__name__} still unfinished after {limit} steps")
        got = stepper.step()
        items.extend(got)
        steps += 1
        if on_step is not None:
            on_step(got)
    return items


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, what: str = "the condition", *,
               interval: float = 0.01) -> T:
    """Poll `predicate` until it returns something true and return that, or fail after `timeout` seconds with
    an AssertionError that says what was waited for (`what`, e.g. "the stream's first delta"). The last look is
    taken after the deadline, so a slow poll fails only if the condition really did not come in time."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    if not value:
        value = predicate()  # the last look, after the deadline
    if value:
        return value
    raise AssertionError(f"waited {timeout:g}s for {what}, in vain")


@attrs.frozen
class Frame:
    """One frame of a call chain: its module, its function's name and its file."""

    module: str
    function: str
    filename: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.function}"


def call_chain(owner: type, method: str, run: Callable[[], Any], *,
               start: str = "omni_kernel.api.generate") -> list[Frame]:
    """The frames from `start` down to the first call of `owner.method` while `run()` runs, outermost first: omni's
    own (modules named omni_*; the standard library's, torch's and other libraries' wrappers left out), then that
    call itself. [] when `run()` never called it; an AssertionError when the call did not come from `start`."""
    saved, stack = vars(owner).get(method), []
    real = getattr(owner, method)

    def spy(self, *args, **kwargs):
        if not stack:
            stack.extend(reversed(inspect.stack(context=0)[1:]))
        return real(self, *args, **kwargs)

    setattr(owner, method, spy)
    try:
        run()
    finally:
        if saved is None:
            delattr(owner, method)
        else:
            setattr(owner, method, saved)
    if not stack:
        return []
    frames = [Frame(f.frame.f_globals.get("__name__", ""), f.function, f.filename) for f in stack]
    frames = [frame for frame in frames if frame.module.startswith("omni_")]
    names = [frame.name for frame in frames]
    if start not in names:
        raise AssertionError(f"{owner.__qualname__}.{method} was called, but not from {start}: {names}")
    call = Frame(owner.__module__, f"{owner.__qualname__}.{method}", inspect.getsourcefile(owner) or "")
    return [*frames[names.index(start):], call]


def assert_chain_goes_down(chain: list[Frame], max_frames: int) -> None:
    """A call chain (from `call_chain`) that reached its call, with no function twice, no file entered again once
    the chain has left it (nothing calls back up a layer), and at most `max_frames` frames, the call included."""
    names = [frame.name for frame in chain]
    if not chain:
        raise AssertionError("the call was never reached")
    if len(set(names)) != len(names):
        raise AssertionError(f"a function appears twice: {names}")
    files = [frame.filename for frame in chain]
    left = [file for i, file in enumerate(files) if i and file != files[i - 1] and file in files[:i - 1]]
    if left:
        raise AssertionError(f"{left} entered again once the chain had left it: {names}")
    if len(chain) > max_frames:
        raise AssertionError(f"{len(chain)} frames, more than {max_frames}: {names}")


@fixture(scope="session")
def omni_cache(tmp_path_factory):
    """OMNI_CACHE_DIR for the whole session (subprocesses inherit it); HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1."""
    path = tmp_path_factory.mktemp("omni-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("OMNI_CACHE_DIR", str(path))
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("TRANSFORMERS_OFFLINE", "1")
    yield path
    patch.undo()


@fixture
def omni_logger():
    logger = logging.getLogger("omni")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield logger
    logger.handlers[:] = saved[0]
    logger.propagate, logger.level = saved[1], saved[2]
