"""Loading a Wan2.2 pipeline for an omni_hf.ModelPool (the plugin's, one per plugin host): a model loads once and
stays loaded across requests and the engines built on it. A pool's key is `model_key(path, device)`."""

from __future__ import annotations

import logging
from pathlib import Path

import omni_hf
from omni_hf.weights import safetensors_shapes

from omni_kernel.core.errors import ModelError

from .demo import demo_dir
from .device import WanDevice
from .layout import WEIGHTS

log = logging.getLogger("omni")

ModelKey = tuple[str, WanDevice]


def model_key(path: Path, device: WanDevice) -> ModelKey:
    """What a loaded model depends on; it names the model in prepare-cache keys too."""
    return str(path), device


def load(key: ModelKey):
    """The Wan22I2VPipeline a pool's key names, its tensors checked first."""
    from .model import Wan22I2VPipeline

    path, device = Path(key[0]), key[1]
    demo = ": using a random-weight demo model; pass --model DIR for real weights" if path == demo_dir() else ""
    log.info("loading Wan2.2 from %s (%s, VAE %s, offload: %s)%s", path, device.device, device.vae_dtype,
             device.offload, demo)
    try:
        with omni_hf.quiet_hf_load(("transformers", "diffusers")):
            check_tensors(path)
            return Wan22I2VPipeline.load(path, device)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever breaks a load, the directory is what the user can fix
        raise ModelError(f"cannot load a Wan2.2 TI2V model from {path}: {' '.join(str(exc).split())}") from None


def check_tensors(path: Path) -> None:
    """Each weighted component's safetensors headers (read without loading a tensor) against the model its
    config describes, built on the meta device: a missing, unexpected or misshapen tensor is one line naming the
    component, before any weight is read."""
    import importlib
    import json

    import torch

    index = json.loads((path / "model_index.json").read_text(encoding="utf-8"))
    for component in WEIGHTS:
        library, name = index[component]
        folder = path / component
        try:
            cls = getattr(importlib.import_module(library), name)
            with torch.device("meta"):
                if library == "diffusers":
                    model = cls.from_config(cls.load_config(folder))
                else:
                    from transformers import AutoConfig

                    model = cls(AutoConfig.from_pretrained(folder))
        except Exception as exc:  # noqa: BLE001 - a config that no model can be built from
            raise ModelError(f"{folder}: config.json describes no {name}: "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
        problem = tensor_problem(model, safetensors_shapes(folder, str(folder)))
        if problem:
            raise ModelError(f"{folder} does not match its config.json: {problem}")


def tensor_problem(model, shapes: dict[str, tuple[int, ...]]) -> str | None:
    import re

    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    aliases: dict[int, list[str]] = {}  # tied weights: one tensor under several names; any one of them will do
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    tied = {n: names for names in aliases.values() for n in names}
    missing = sorted(k for k in expected if not any(a in shapes for a in tied.get(k, [k])))
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = sorted(k for k in shapes if k not in expected and not any(p.search(k) for p in ignored))
    shaped = sorted(k for k in shapes if k in expected and shapes[k] != expected[k])
    for what, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            return f"{what} tensor(s) {', '.join(keys[:3])}{more}"
    if shaped:
        k = shaped[0]
        return f"tensor {k} has shape {list(shapes[k])}, the config needs {list(expected[k])}"
    return None
