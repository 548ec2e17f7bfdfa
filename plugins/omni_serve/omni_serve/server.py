"""The FastAPI app of `omni serve`: OpenAI-compatible routes over one AsyncOmni.

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, the Videos API (POST/GET /v1/videos,
GET/DELETE /v1/videos/{id}, GET /v1/videos/{id}/content), GET /health, GET /metrics. Errors are OpenAI-style
JSON. Request values go to the pipeline's node types as declared request parameters, so the kernel checks
them (and refuses keys no node declares) exactly as it does for `omni run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_kernel.errors import EngineDead, OmniError, RequestError, StageUnavailable, UserError, classify
from omni_kernel.events import RequestFailed
from omni_kernel.params import options_of

from .engine import AsyncOmni, Overloaded, ShuttingDown
from .guards import OmniASGI, ServeSettings, until_disconnect
from .metrics import Metrics
from .protocol import (NEUTRAL, SERVER_OWNED, APIError, ChatCompletionRequest, CompletionRequest, SamplingFields,
                       VideoJob)
from .text import FINISH, Watch, collect, sse
from .videos import VideoJobs, frames_for, parse_size

log = logging.getLogger("omni")


def pipeline_kind(engine: AsyncOmni, name: str) -> str:
    """"video" when the final node writes a file it is told the path of (`output`), else "text"."""
    graph = engine.omnis[name].graph
    node_type = graph.node_types.get(graph.final)
    declared = options_of(getattr(node_type, "params", None))
    return "video" if "output" in declared and graph.stages[graph.final].kind == "diffusion" else "text"


def declared_params(engine: AsyncOmni, name: str) -> set[str]:
    graph = engine.omnis[name].graph
    return {k for t in graph.node_types.values() for k in options_of(t.params)}


def error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)


def api_error(exc: BaseException) -> APIError:
    """An exception from submit or a handler as the answer it deserves."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), None, "shutting_down")
    if isinstance(exc, Overloaded):
        return APIError(429, str(exc), None, "too_many_requests", retry_after=1)
    kind, message, field = classify(exc)
    if isinstance(exc, StageUnavailable):  # its worker is restarting: the same request will do, a little later
        answer = APIError.of_failure(kind, message, field)
        answer.retry_after = math.ceil(getattr(exc, "retry_after", None) or 1)
        return answer
    if isinstance(exc, UserError) or isinstance(exc, (EngineDead, RequestError)):
        return APIError.of_failure(kind, message, field)
    return APIError(500, f"internal error: {message}", None, "internal_error")


def create_app(engine: AsyncOmni, settings: ServeSettings) -> FastAPI:
    names: dict[str, str] = {**{n: n for n in engine.omnis}, **dict(settings.aliases)}
    kinds = {n: pipeline_kind(engine, n) for n in engine.omnis}
    jobs_box: dict[str, VideoJobs] = {}
    metrics = Metrics(lambda: engine.snapshot, lambda: jobs_box["jobs"].counts())
    jobs = VideoJobs(engine, settings.output_dir, settings.video_ttl, metrics)
    jobs_box["jobs"] = jobs
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        janitor = asyncio.create_task(_expire(jobs, settings.video_ttl))
        try:
            yield
        finally:
            janitor.cancel()
            exit_at = getattr(app.state, "exit_at", None)
            left = settings.shutdown_timeout - (time.monotonic() - exit_at if exit_at else 0)
            aborted = await asyncio.to_thread(engine.shutdown, max(left, 0.0))
            await jobs.close()
            if aborted:
                log.info("shutdown: aborted %d request(s) still in flight after %gs", aborted,
                         settings.shutdown_timeout)

    app = FastAPI(title="omni serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over omni pipelines")
    app.state.engine, app.state.jobs, app.state.metrics = engine, jobs, metrics

    def resolve(model: str, kind: str) -> str:
        name = names.get(model)
        if name is None:
            raise APIError(404, f"the model {model!r} does not exist; served models: {', '.join(sorted(names))}",
                           "model", "model_not_found")
        if kinds[name] != kind:
            route = "/v1/videos" if kinds[name] == "video" else "/v1/chat/completions or /v1/completions"
            raise APIError(400, f"invalid model: {model!r} is a {kinds[name]} pipeline; use {route}", "model")
        return name

    def sampling(body: SamplingFields, name: str) -> dict[str, Any]:
        if body.n is not None and body.n != 1:
            raise APIError(400, f"invalid n: {body.n} choices are not supported (only n=1)", "n")
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, "invalid max_tokens: max_tokens and max_completion_tokens disagree", "max_tokens")
        params = {"max_tokens": body.max_completion_tokens if body.max_tokens is None else body.max_tokens,
                  "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                  "stop": body.stop, "ignore_eos": body.ignore_eos}
        params = {k: v for k, v in params.items() if v is not None}
        for key, value in (body.model_extra or {}).items():
            if key in NEUTRAL:
                neutral = NEUTRAL[key]
                if neutral is not None and value not in neutral:
                    raise APIError(400, f"invalid {key}: {value!r} is not supported", key)
                continue
            if key in SERVER_OWNED:
                raise APIError(400, f"invalid {key}: set by the server, not by a request", key)
            params[key] = value  # the kernel refuses it (naming it) unless a node declares it
        return params

    async def open_stream(name: str, prompt: str, rid: str, params: dict[str, Any], image=None):
        try:
            return await engine.open(name, prompt, image=image, request_id=rid, **params)
        except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer
            raise api_error(exc) from None

    def chat_prompt(body: ChatCompletionRequest, name: str) -> tuple[str, dict[str, Any]]:
        messages = [("system" if m.role == "developer" else m.role,
                     m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or []))
                    for m in body.messages]
        if "messages" in declared_params(engine, name):
            return "", {"messages": messages}
        if len(messages) == 1 and messages[0][0] == "user":
            return messages[0][1], {}
        raise APIError(400, f"invalid messages: model {body.model!r} takes one user message", "messages")

    async def text_route(request: Request, body: SamplingFields, chat: bool):
        arrival = time.perf_counter()
        name = resolve(body.model, "text")
        params = sampling(body, name)
        if chat:
            prompt, extra = chat_prompt(body, name)
            params.update(extra)
        else:
            prompt = body.prompt
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        stream = await open_stream(name, prompt, rid, params)
        final = engine.omnis[name].graph.final
        watch = Watch(metrics, body.model, arrival)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(stream, final, watch, rid, body.model, chat, usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result = await until_disconnect(request, collect(stream, final, watch))
        if result is None:
            return Response(status_code=499)
        text, finished = result
        if isinstance(finished, RequestFailed):
            raise APIError.of_failure(finished.kind, finished.error, finished.field)
        out = finished.result
        watch.done(out, "chat" if chat else "completions")
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH.get(out.output.stop_reason or "eos", "stop"),
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text or ""}
        else:
            choice["text"] = out.text or ""
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": body.model, "choices": [choice], "usage": watch.usage(out)}

    @app.get("/v1/models")
    async def models():
        data = [{"id": served, "object": "model", "created": created, "owned_by": "omni", "root": name,
                 "capabilities": ["chat.completions", "completions"] if kinds[name] == "text" else ["videos"]}
                for served, name in names.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await text_route(request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await text_route(request, body, chat=False)

    @app.post("/v1/videos", response_model=VideoJob)
    async def create_video(
        prompt: Annotated[str, Form()],
        model: Annotated[str | None, Form()] = None,
        input_reference: Annotated[UploadFile | str | None, File()] = None,
        size: Annotated[str | None, Form()] = None,
        seconds: Annotated[str | None, Form()] = None,
        num_frames: Annotated[int | None, Form()] = None,
        num_inference_steps: Annotated[int | None, Form()] = None,
        guidance_scale: Annotated[float | None, Form()] = None,
        seed: Annotated[int | None, Form()] = None,
        negative_prompt: Annotated[str | None, Form()] = None,
        preset: Annotated[str | None, Form()] = None,
    ):
        video_models = [n for n, k in kinds.items() if k == "video"]
        if model is None:
            if not video_models:
                raise APIError(404, "no video pipeline is served", "model", "model_not_found")
            model = video_models[0]
        name = resolve(model, "video")
        wh = parse_size(size)
        params: dict[str, Any] = {"num_inference_steps": num_inference_steps, "guidance_scale": guidance_scale,
                                  "seed": seed, "negative_prompt": negative_prompt, "preset": preset,
                                  "num_frames": num_frames}
        if wh is not None:
            params["width"], params["height"] = wh
        if num_frames is None:
            stage = engine.omnis[name].graph.stages[engine.omnis[name].graph.final]
            params["num_frames"] = frames_for(seconds, getattr(getattr(stage, "layout", None), "fps", 24))
        params = {k: v for k, v in params.items() if v is not None}
        job_id = jobs.new_id()
        image = None
        if isinstance(input_reference, str) and input_reference:
            image = jobs.save_upload(job_id, jobs.decode_data_url(input_reference), None)
        elif input_reference is not None and not isinstance(input_reference, str):
            data = await input_reference.read()
            image = jobs.save_upload(job_id, data, input_reference.filename)
        try:
            job = await jobs.create(job_id, name, prompt, image, params, size, seconds)
        except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer
            if image is not None:
                image.unlink(missing_ok=True)
            raise api_error(exc) from None
        job.model = model if model in names else name
        return job.to_json(settings.video_ttl)

    @app.get("/v1/videos")
    async def list_videos(after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                          order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc"):
        page, more = jobs.list(after, limit, order)
        data = [j.to_json(settings.video_ttl) for j in page]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/videos/{video_id}", response_model=VideoJob)
    async def get_video(video_id: str):
        return jobs.get(video_id).to_json(settings.video_ttl)

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video"):
        job = jobs.get(video_id)
        if variant != "video":
            raise APIError(400, f"invalid variant: {variant!r} (only 'video')", "variant")
        if job.status != "completed" or job.path is None or not job.path.is_file():
            raise APIError(404, f"video {video_id!r} is {job.status}; its content is not available", "video_id",
                           "not_ready" if job.status in ("queued", "in_progress") else "not_found")
        return FileResponse(job.path, media_type="video/mp4", filename=f"{video_id}.mp4")

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str):
        await jobs.delete(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @app.get("/health")
    async def health():
        snap = engine.snapshot
        dead = {n: snap.pipeline_dead(n) for n in engine.omnis}
        dead = {n: d for n, d in dead.items() if d}
        if snap.dead or dead or not engine.alive:
            reason = snap.dead or "; ".join(f"{n}: {d}" for n, d in dead.items()) or "the engine thread stopped"
            return JSONResponse({"status": "dead", "error": reason, "dead_models": sorted(dead)}, status_code=503)
        restarting = sorted(f"{s.pipeline}/{s.node}" for s in snap.stages if s.restarting)
        return {"status": "ok", "models": sorted(names), "in_flight": snap.in_flight, "restarting": restarting}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
        param = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc).lstrip(".") or None
        message = f"invalid {param or 'request'}: {first.get('msg', 'bad value')}"
        return error_response(APIError(400, message, param, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), None, None,
                                       "invalid_request_error" if exc.status_code < 500 else "server_error"))

    @app.exception_handler(OmniError)
    async def on_omni(request: Request, exc: OmniError):
        return error_response(api_error(exc))

    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.state.asgi = OmniASGI(app, settings, metrics)
    return app


async def _expire(jobs: VideoJobs, ttl: float | None) -> None:
    if not ttl:
        return
    while True:
        await asyncio.sleep(min(max(ttl / 4, 0.05), 60))
        jobs.expire()


