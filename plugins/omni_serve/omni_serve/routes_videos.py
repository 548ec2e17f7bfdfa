"""The Videos API: POST /v1/videos (a multipart form), GET /v1/videos, GET and DELETE /v1/videos/{id}, GET
/v1/videos/{id}/content.

The form's OpenAI fields are read by name (`prompt`, `model`, `input_reference`, `size`); every other field
(`seconds` included) is a request option that the chosen pipeline's node types declare, as `omni run` derives
its flags, converted by the option's type. A field no node declares is refused, naming the valid ones."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.datastructures import FormData, UploadFile  # what request.form() holds (not fastapi's)

from omni_kernel.params import OptionInfo, parse

from .handlers import api_error
from .protocol import SERVER_OWNED, APIError, VideoJob
from .state import Served, State

router = APIRouter()
OPENAI = ("prompt", "model", "input_reference", "size")
SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")
TEXT = {"type": "string"}
FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["prompt"],
    "properties": {"prompt": TEXT, "model": TEXT, "size": {"type": "string", "description": "WIDTHxHEIGHT"},
                   "seconds": TEXT, "input_reference": {
                       "description": "an image file, or a data:image/...;base64 URL", "anyOf": [
                           {"type": "string", "format": "binary"}, TEXT]}},
    "additionalProperties": {"description": "a request option the model's node types declare "
                                            "(e.g. omni run's flags), as text"}}}}}}


@router.post("/v1/videos", response_model=VideoJob, openapi_extra=FORM)
async def create_video(request: Request, served: State):
    async with request.form() as form:
        return await create(form, served)


async def create(form: FormData, served: Served) -> dict[str, Any]:
    prompt = _text(form, "prompt")
    if prompt is None:
        raise APIError(400, "invalid prompt: Field required", "prompt", "invalid_value")
    model = _text(form, "model")
    if model is None:
        video_models = [n for n, k in served.kinds.items() if k == "video"]
        if not video_models:
            raise APIError(404, "no video pipeline is served", "model", "model_not_found")
        model = video_models[0]
    name = served.resolve(model, "video")
    params = declared_fields(form, served.options(name), model)
    size = _text(form, "size")
    if (wh := parse_size(size)) is not None:
        params["width"], params["height"] = wh
    jobs = served.jobs
    job_id = jobs.new_id()
    image = None
    reference = form.get("input_reference")
    if isinstance(reference, str) and reference:
        image = jobs.save_upload(job_id, jobs.decode_data_url(reference), None)
    elif isinstance(reference, UploadFile):
        image = jobs.save_upload(job_id, await reference.read(), reference.filename)
    try:
        job = await jobs.create(job_id, name, prompt, image, params, size, _text(form, "seconds"))
    except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer
        if image is not None:
            image.unlink(missing_ok=True)
        raise jobs.about_upload(api_error(exc), image) from None
    job.model = model if model in served.names else name
    return job.to_json(served.settings.video_ttl)


def declared_fields(form: FormData, options: dict[str, OptionInfo], model: str) -> dict[str, Any]:
    """Every field but OpenAI's as a request parameter, checked against the declared options by name."""
    params: dict[str, Any] = {}
    for key in dict.fromkeys(form.keys()):
        if key in OPENAI:
            continue
        name = key.removesuffix("[]")  # the openai client sends a list as `key[]`
        if name in SERVER_OWNED:
            raise APIError(400, f"invalid {name}: set by the server, not by a request", name)
        info = options.get(name)
        if info is None:
            valid = sorted({*OPENAI, *(options.keys() - SERVER_OWNED)})
            raise APIError(400, f"invalid {name}: model {model!r} has no field {name!r}; valid fields: "
                                f"{', '.join(valid)}", name)
        values = [parse(name, info, _value(name, v)) for v in form.getlist(key) if v != ""]
        if values and info.multiple:
            params[name] = (*params.get(name, ()), *values)
        elif values:
            params[name] = values[-1]
    return params


def parse_size(size: str | None) -> tuple[int, int] | None:
    if size is None:
        return None
    match = SIZE.match(size)
    if not match:
        raise APIError(400, f"invalid size: {size!r} is not WIDTHxHEIGHT, e.g. 1280x704", "size")
    return int(match.group(1)), int(match.group(2))


def _text(form: FormData, key: str) -> str | None:
    value = form.get(key)
    return None if value is None or value == "" else _value(key, value)


def _value(key: str, value: str | UploadFile) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"invalid {key}: a file where a text value belongs", key)
    return value


@router.get("/v1/videos")
async def list_videos(served: State, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                      order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc"):
    page, more = served.jobs.list(after, limit, order)
    data = [j.to_json(served.settings.video_ttl) for j in page]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


@router.get("/v1/videos/{video_id}", response_model=VideoJob)
async def get_video(video_id: str, served: State):
    return served.jobs.get(video_id).to_json(served.settings.video_ttl)


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, served: State, variant: str = "video"):
    job = served.jobs.get(video_id)
    if variant != "video":
        raise APIError(400, f"invalid variant: {variant!r} (only 'video')", "variant")
    if job.status != "completed" or job.path is None or not job.path.is_file():
        raise APIError(404, f"video {video_id!r} is {job.status}; its content is not available", "video_id",
                       "not_ready" if job.status in ("queued", "in_progress") else "not_found")
    return FileResponse(job.path, media_type="video/mp4", filename=f"{video_id}.mp4")


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, served: State):
    await served.jobs.delete(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True}
