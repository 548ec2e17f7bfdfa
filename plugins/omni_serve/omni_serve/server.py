"""The FastAPI app of `omni serve`: OpenAI-compatible routes over one AsyncOmni.

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, the Videos API (POST/GET /v1/videos,
GET/DELETE /v1/videos/{id}, GET /v1/videos/{id}/content), the audio API (POST /v1/audio/speech, POST
/v1/audio/transcriptions, GET /v1/audio/voices), GET /health, GET /metrics (routes_*.py, over the
`Served` state), and the web page at / (page.py) unless --no-ui. Errors are OpenAI-style JSON (handlers.py).
Request values go to the pipeline's node types as declared request parameters, so the kernel checks them (and
refuses keys no node declares) exactly as it does for `omni run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI

from . import routes_audio, routes_ops, routes_text, routes_videos
from .async_omni import AsyncOmni
from .guards import OmniASGI
from .handlers import HANDLERS
from .page import add_page
from .restore import restore
from .settings import ServeSettings
from .state import Served
from .store import JobStore
from .videos import VideoJobs

log = logging.getLogger("omni")
EXIT_POLL_S = 0.05


def create_app(async_omni: AsyncOmni, settings: ServeSettings, store: JobStore | None = None) -> FastAPI:
    """`store`: the open job store (store.py) the video jobs are kept in; None keeps them in memory only."""
    app = FastAPI(title="omni serve", version="0.1.0", lifespan=lifespan, exception_handlers=HANDLERS,
                  description="OpenAI-compatible API over omni pipelines")
    app.state.served = served = Served.build(async_omni, settings, store)
    for routes in (routes_ops, routes_text, routes_videos, routes_audio):
        app.include_router(routes.router)
    if settings.ui:
        add_page(app)
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.state.asgi = OmniASGI(app, settings, served.metrics)
    return app


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    served: Served = app.state.served
    async_omni, settings = served.async_omni, served.settings
    async_omni.start()
    served.jobs.sweep()  # what a server or worker killed mid-write left in --output-dir
    if served.jobs.store is not None:  # its jobs: listed again, queued ones run; one log line for each change
        await restore(served.jobs, served.jobs.store.rows())
    janitor = asyncio.create_task(_expire(served.jobs, settings.video_ttl))
    drainer = asyncio.create_task(_drain_on_exit(app))
    try:
        yield
    finally:
        janitor.cancel()
        drainer.cancel()
        exit_at = getattr(app.state, "exit_at", None)  # set by the drain when the exit began
        left = settings.shutdown_timeout - (time.monotonic() - exit_at if exit_at else 0)
        aborted = await asyncio.to_thread(async_omni.shutdown, max(left, 0.0))
        await served.jobs.close()
        if aborted:
            log.info("shutdown: aborted %d request(s) still in flight after %gs", aborted, settings.shutdown_timeout)


async def _drain_on_exit(app: FastAPI) -> None:
    """Once uvicorn began to exit: no new requests; those still in flight at --shutdown-timeout fail with an
    error saying so, so each stream ends with an error event and [DONE] (before uvicorn cancels what is left, a
    little later)."""
    await _exit_began(app)
    app.state.exit_at = time.monotonic()
    served: Served = app.state.served
    served.async_omni.stop_admitting()
    served.jobs.stopping = True  # a video job the drain aborts goes back to the queue, to run at the next start
    timeout = served.settings.shutdown_timeout
    log.info("shutting down: no new requests; in-flight ones get up to %gs", timeout)
    failed = await asyncio.to_thread(served.async_omni.drain, timeout,
                                     f"the server shut down before this request finished (--shutdown-timeout "
                                     f"{timeout:g}s)")
    if failed:
        log.info("shutdown: failed %d request(s) still in flight after %gs", failed, timeout)


async def _exit_began(app: FastAPI) -> None:
    """Return once uvicorn's `should_exit` (the command hands it over as `app.state.should_exit`) is set: uvicorn
    sets it on SIGINT or SIGTERM and checks it every 0.1 s itself, and tells the app nothing until its lifespan
    ends, after the connections have closed. An app run some other way (a test client) waits until cancelled."""
    should_exit = getattr(app.state, "should_exit", None)
    if should_exit is None:
        await asyncio.Event().wait()
    while not should_exit():
        await asyncio.sleep(EXIT_POLL_S)


async def _expire(jobs: VideoJobs, ttl: float | None) -> None:
    """Every TTL/4 (at most a minute): expired jobs go; restored jobs the engine had no room for are submitted."""
    every = min(max(ttl / 4, 0.05), 60) if ttl else 1.0
    while True:
        if ttl:
            jobs.expire()
        await jobs.resume_waiting()
        await asyncio.sleep(min(every, 1.0) if jobs.waiting else every)
