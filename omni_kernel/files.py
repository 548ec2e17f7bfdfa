"""Files: atomic outputs (a reader never sees a half-written file, a failure leaves none behind) and the cache
directory where omni keeps what it builds (demo checkpoints)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path next to `path`; it replaces `path` when the block ends, and is removed on error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes 0600; outputs get the usual file mode
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, body: Any, indent: int | None = 2) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(body, f, ensure_ascii=False, indent=indent)
            f.write("\n")
    return Path(path)


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _read_umask()  # read once at import: os.umask can only be read by setting it, a race under threads


def cache_dir() -> Path:
    """OMNI_CACHE_DIR, or omni/ under the user's cache directory."""
    explicit = os.environ.get("OMNI_CACHE_DIR")
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(explicit).expanduser() if explicit else Path(base) / "omni"
