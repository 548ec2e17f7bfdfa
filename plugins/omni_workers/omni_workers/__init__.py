"""omni-workers: stage placement `process` (a worker process per stage) and `ray` (a Ray actor per stage)."""

from .plugin import WorkersPlugin

__all__ = ["WorkersPlugin"]
