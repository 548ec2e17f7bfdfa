"""Kernel test fixtures. Kernel tests import no torch, transformers, diffusers or plugin packages."""

import logging

import pytest


@pytest.fixture(scope="session", autouse=True)
def omni_cache_dir(tmp_path_factory):
    """Keep every test (and every `omni` subprocess, which inherits os.environ) out of the user's cache."""
    path = tmp_path_factory.mktemp("omni-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("OMNI_CACHE_DIR", str(path))
    patch.setenv("HF_HUB_OFFLINE", "1")
    yield path
    patch.undo()


@pytest.fixture(autouse=True)
def omni_logger():
    """The CLI configures the "omni" logger; restore it so one test's handlers never leak into the next."""
    logger = logging.getLogger("omni")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield logger
    logger.handlers[:] = saved[0]
    logger.propagate, logger.level = saved[1], saved[2]
