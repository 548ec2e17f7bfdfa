"""What `omni serve` runs with: its flags, checked, built once by the command's callback (command.py) and read by
the server, the ASGI guard and the routes. Imports neither fastapi nor uvicorn: the command's module imports it
whenever `omni` starts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs


@attrs.frozen
class Timeouts:
    """Slow clients' bounds (seconds; 0: none): a request's headers (from its first byte), its body (from its
    headers), an idle kept-alive connection."""

    header: float = 10.0
    body: float = 60.0
    keep_alive: float = 5.0


@attrs.frozen
class ServeSettings:
    """The server's settings, one value for the whole run (`--output-dir`, `--api-key`, ... as checked and
    defaulted by `serve_settings`); the app keeps it on `Served.settings`."""

    output_dir: Path
    api_key: str | None = None
    video_ttl: float | None = 3600.0
    max_body_mb: float = 20.0
    # Completions and chats: JSON a prompt fills, refused before it is parsed (parsing 18 MB holds the event loop
    # for a quarter of a second; no prompt that long fits a context window anyway).
    max_text_body_mb: float = 4.0
    allowed_origins: tuple[str, ...] = ()
    shutdown_timeout: float = 30.0
    aliases: Mapping[str, str] = attrs.Factory(dict)  # served name -> pipeline key of the engine
    on_restart: str = "fail"  # a video job in progress when the server died: "rerun" or "fail" (restore.py)
    ui: bool = True  # the web page at / (page.py); --no-ui
    timeouts: Timeouts = Timeouts()
    # Where it listens, how many requests it admits, where the job store is: read by the command alone.
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    max_in_flight: int | None = 1024  # None: no limit
    jobs_db: Path = attrs.Factory(lambda self: self.output_dir / "jobs.sqlite", takes_self=True)

    @property
    def body_timeout(self) -> float | None:
        """Seconds a request's whole body may take to arrive (None: no limit)."""
        return self.timeouts.body or None
