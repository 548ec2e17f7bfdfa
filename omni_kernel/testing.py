"""Pytest fixtures for omni and its plugins' tests; opt in with `pytest_plugins = ["omni_kernel.testing"]` in the
rootdir conftest.py. Nothing is autouse and there is no `pytest11` entry point, so installing omni changes no other
project's tests.

`omni_cache` keeps everything omni builds on first use (demo checkpoints) in a session tmp dir and keeps model
hubs offline; `omni_logger` restores the "omni" logger that the CLI configures, so no test leaks handlers.
"""

import logging

import pytest


@pytest.fixture(scope="session")
def omni_cache(tmp_path_factory):
    """OMNI_CACHE_DIR for the whole session (subprocesses inherit it); HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1."""
    path = tmp_path_factory.mktemp("omni-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("OMNI_CACHE_DIR", str(path))
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("TRANSFORMERS_OFFLINE", "1")
    yield path
    patch.undo()


@pytest.fixture
def omni_logger():
    logger = logging.getLogger("omni")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield logger
    logger.handlers[:] = saved[0]
    logger.propagate, logger.level = saved[1], saved[2]
