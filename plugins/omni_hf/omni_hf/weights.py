"""Checkpoint folders as omni reads them: safetensors only (nothing is ever unpickled), their shapes from the JSON
headers before anything loads, index files that may name nothing outside their folder."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from omni_kernel.core.errors import ModelError


def safetensors_shapes(folder: str | Path, label: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over a folder's safetensors files, read from their JSON headers (no tensor data),
    so a checkpoint can be compared with its config before anything loads."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                if size > 100_000_000:
                    raise ValueError("header too large")
                header = json.loads(f.read(size))
            shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise ModelError(f"{label}: {file.name} is not a readable safetensors file "
                             f"({' '.join(str(exc).split())})") from None
    return shapes


def check_safetensors_index(folder: str | Path, label: str) -> None:
    """Refuse (ModelError, one line) a `*.index.json` in `folder` whose weight map names anything but
    `.safetensors` files inside `folder`, or a file that is missing: the loaders follow index files."""
    folder = Path(folder)
    for index in sorted(folder.glob("*.index.json")):
        try:
            body = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelError(f"{label}: {index} is unreadable: {' '.join(str(exc).split())}") from None
        weight_map = body.get("weight_map") if isinstance(body, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{label}: {index} has no weight_map")
        for shard in sorted(set(map(str, weight_map.values()))):
            file = folder / shard
            if not shard.endswith(".safetensors") or Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise ModelError(f"{label}: {index.name} points at {shard!r}, which is not a .safetensors file in "
                                 f"{folder} (omni loads safetensors only and never unpickles weights)")
            if not file.is_file():
                raise ModelError(f"{label}: {index.name} names {shard!r}, which is missing from {folder}")
