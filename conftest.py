"""Every suite in this repository (tests/, plugins/*/tests, examples/plugin_example/tests) runs under these
fixtures. pytest reads `pytest_plugins` only in the rootdir conftest, so the opt-in lives here; no torch."""

import pytest

pytest_plugins = ["omni_kernel.testing"]


@pytest.fixture(scope="session", autouse=True)
def _omni_cache(omni_cache):
    return omni_cache


@pytest.fixture(autouse=True)
def _omni_logger(omni_logger):
    return omni_logger
