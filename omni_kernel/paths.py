"""Where omni keeps what it builds (demo checkpoints and the like)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """OMNI_CACHE_DIR, or omni/ under the user's cache directory."""
    explicit = os.environ.get("OMNI_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "omni"
