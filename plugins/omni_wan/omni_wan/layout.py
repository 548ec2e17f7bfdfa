"""What a Wan2.2-TI2V-5B-Diffusers directory must hold, read from its JSON files without torch.

A missing or wrong directory is a ModelError (exit 2) at stage build, before any weight is read.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import attrs
from omni_hf.weights import check_safetensors_index

from omni_kernel.core.errors import ModelError

COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")
# Wan2.2 TI2V-5B renders at 24 fps (the model card exports its examples with fps=24).
FPS = 24
DIFFUSERS_HEADS = 40  # WanTransformer3DModel's default num_attention_heads


@attrs.frozen
class ModelLayout:
    """The facts about a checkpoint that requests are checked against."""

    path: Path
    spatial_multiple: int  # VAE spatial factor x transformer patch size: 16 x 2 = 32 for TI2V-5B
    temporal_factor: int  # frames must be temporal_factor * k + 1
    fps: int = FPS
    # TI2V: the transformer reads the noise latents alone (in_channels == the VAE's z_dim), so it renders from a
    # prompt alone too (diffusers' WanPipeline); an image-only model takes the image's channels beside them.
    text_to_video: bool = True
    in_channels: int | None = None
    z_dim: int | None = None
    num_heads: int | None = None  # the transformer's attention heads: what a sequence-parallel degree divides


def read_layout(path: str | Path) -> ModelLayout:
    """The checkpoint's layout, read from disk once per directory while the files it is read from stay as they are
    (every check of a request and every build asks for it)."""
    root = Path(path).expanduser()
    stamp = _stamp(root)
    if stamp is None:
        return _read_layout(root)  # it raises, naming what is missing
    return _cached_layout(root.resolve(), stamp)


@functools.lru_cache(maxsize=16)
def _cached_layout(root: Path, stamp: tuple) -> ModelLayout:
    return _read_layout(root)


def _stamp(root: Path) -> tuple | None:
    """The modification times and sizes of what _read_layout reads (the index, the configs, the weights' folders
    and their files), or None when one is missing."""
    try:
        stamps: list = [_mark(os.stat(root / name)) for name in ("model_index.json", *COMPONENTS)]
        for name in WEIGHTS:
            stamps += sorted((e.name, _mark(e.stat())) for e in os.scandir(root / name))
    except OSError:
        return None
    return tuple(stamps)


def _mark(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_mtime_ns, stat.st_size


def _read_layout(root: Path) -> ModelLayout:
    if not root.exists():
        raise ModelError(f"model directory {str(root)!r} does not exist")
    if not root.is_dir():
        raise ModelError(f"model path {str(root)!r} is not a directory")
    index = _json(root / "model_index.json", root)
    missing = [c for c in COMPONENTS if not _listed(index, c) or not (root / c).is_dir()]
    if missing:
        raise ModelError(f"{root} is not a Wan2.2-TI2V-5B-Diffusers directory: missing {', '.join(missing)}")
    if not index.get("expand_timesteps") or _listed(index, "transformer_2"):
        raise ModelError(f"{root} is not a Wan2.2 TI2V-5B checkpoint (this stage needs expand_timesteps=true "
                         "and a single transformer)")
    vae = _json(root / "vae" / "config.json", root)
    transformer = _json(root / "transformer" / "config.json", root)
    if not _has_weights(root / "transformer") or not _has_weights(root / "vae") or not _has_weights(
            root / "text_encoder"):
        raise ModelError(f"{root} has no safetensors weights for every model (omni loads safetensors only)")
    for component in WEIGHTS:
        check_safetensors_index(root / component, f"{root} {component}")
    patch = transformer.get("patch_size", [1, 2, 2])
    if not (isinstance(patch, list) and len(patch) == 3 and all(_small_int(p) for p in patch)):
        raise ModelError(f"{root / 'transformer' / 'config.json'}: patch_size {patch!r} is not three integers "
                         "between 1 and 64")
    check_vae_config(vae, root / "vae" / "config.json")
    spatial = vae.get("scale_factor_spatial", 8) * patch[1]
    in_channels, z_dim = transformer.get("in_channels", 16), vae.get("z_dim", 16)
    heads = transformer.get("num_attention_heads", DIFFUSERS_HEADS)
    if not _small_int(heads, 4096):
        raise ModelError(f"{root / 'transformer' / 'config.json'}: num_attention_heads {heads!r} is not an integer "
                         "between 1 and 4096")
    return ModelLayout(root.resolve(), spatial, vae.get("scale_factor_temporal", 4),
                       text_to_video=in_channels == z_dim, in_channels=in_channels, z_dim=z_dim, num_heads=heads)


WEIGHTS = ("transformer", "vae", "text_encoder")


def _small_int(value, limit: int = 64) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= limit


def check_vae_config(vae: dict, file: Path) -> None:
    """The VAE values the stage computes with: scale factors, latent channels and their statistics."""
    for key, default in (("scale_factor_spatial", 8), ("scale_factor_temporal", 4)):
        if not _small_int(vae.get(key, default)):
            raise ModelError(f"{file}: {key} {vae.get(key)!r} is not an integer between 1 and 64")
    z_dim = vae.get("z_dim", 16)
    if not _small_int(z_dim, 4096):
        raise ModelError(f"{file}: z_dim {z_dim!r} is not an integer between 1 and 4096")
    for key in ("latents_mean", "latents_std"):
        values = vae.get(key)
        if values is None:
            continue
        numbers = isinstance(values, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
        if not numbers or len(values) != z_dim or (key == "latents_std" and min(values) <= 0):
            need = "positive " if key == "latents_std" else ""
            raise ModelError(f"{file}: {key} must be {z_dim} (z_dim) finite {need}numbers")


def _json(file: Path, root: Path) -> dict:
    try:
        body = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{root} is not a Wan2.2-TI2V-5B-Diffusers directory: no {file.relative_to(root)}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{file} is unreadable: {exc}") from None
    if not isinstance(body, dict):
        raise ModelError(f"{file} is not a JSON object")
    return body


def _listed(index: dict, name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))
