"""The tiny Wan2.2 checkpoint, built once per session in a tmp cache dir (never a hub)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

ASSET = Path(__file__).resolve().parents[3] / "examples" / "assets" / "image.png"


@pytest.fixture(scope="session")
def tiny_model(omni_cache) -> Path:
    """The demo checkpoint (the real classes and layout, random weights), built under OMNI_CACHE_DIR."""
    from omni_wan.demo import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="session")
def image_path() -> Path:
    assert ASSET.is_file(), "examples/assets/image.png ships with the repository"
    return ASSET


@pytest.fixture(scope="session")
def omni(tiny_model):
    """One wan_i2v pipeline for the session: the model stays loaded across tests, like in one process. Pinned to
    the CPU, so the fp32 fidelity and the CPU trace values hold on a GPU machine too."""
    from omni_kernel import Omni

    return Omni("wan_i2v", model=str(tiny_model), device="cpu")
