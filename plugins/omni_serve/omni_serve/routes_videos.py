"""The Videos API: POST /v1/videos (a multipart form), GET /v1/videos, GET and DELETE /v1/videos/{id}, GET
/v1/videos/{id}/content.

The form's OpenAI fields are read by name (`prompt`, `model`, `input_reference`, `size`); every other field
(`seconds` included) is a request option that the chosen pipeline's node types declare, as `omni run` derives
its flags, converted by the option's type. A field no node declares is refused, naming the valid ones."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.datastructures import FormData, UploadFile  # what request.form() holds (not fastapi's)

from omni_kernel.core.params import OptionInfo, parse

from .handlers import api_error
from .protocol import SERVER_OWNED, APIError, VideoJob
from .state import Served, ServedDep
from .uploads import StoredFile, StreamedForm

router = APIRouter()
OPENAI = ("prompt", "model", "input_reference", "size")
REFERENCE_KEYS = ("input_reference[image_url]", "input_reference[file_id]")
SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")
TEXT = {"type": "string"}
FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["prompt"],
    "properties": {"prompt": TEXT, "model": TEXT, "size": {"type": "string", "description": "WIDTHxHEIGHT"},
                   "seconds": TEXT, "input_reference": {
                       "description": "an image file, or a data:image/...;base64 URL", "anyOf": [
                           {"type": "string", "format": "binary"}, TEXT]}},
    "additionalProperties": {"description": "a request option the model's node types declare "
                                            "(e.g. omni run's flags), as text"}}},
    "application/json": {"schema": {
        "type": "object", "required": ["prompt"],
        "properties": {"prompt": TEXT, "model": TEXT, "size": TEXT, "seconds": TEXT, "input_reference": {
            "type": "object", "properties": {"image_url": {"type": "string", "description": "a data:image URL"}}}},
        "additionalProperties": {"description": "a request option the model's node types declare"}}}}}}


@router.post("/v1/videos", response_model=VideoJob, openapi_extra=FORM)
async def create_video(request: Request, served: ServedDep):
    if is_json(request):  # OpenAI's other body: the same fields, input_reference as {"image_url": ...}
        return await create(json_form(await json_body(request)), served)
    async with StreamedForm(request, served.jobs.uploads.folder) as form:  # a file part goes to disk as it comes
        return await create(form, served)


def is_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


async def json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"null")
    except ValueError as exc:
        raise APIError(400, f"invalid request: the body is not valid JSON ({exc})", None, "invalid_json") from None


def json_form(body: Any) -> FormData:
    """A JSON body as the form it stands for: each value as its text (a list as repeated fields), and
    input_reference {"image_url": ...} as the `input_reference[image_url]` field the official client sends
    in a multipart form."""
    if not isinstance(body, dict):
        raise APIError(400, "invalid request: the body must be a JSON object", None, "invalid_value")
    items: list[tuple[str, str]] = []
    for key, value in body.items():
        if value is None:
            continue
        if key == "input_reference" and isinstance(value, dict):
            items += [(f"input_reference[{k}]", _json_text(f"input_reference.{k}", v)) for k, v in value.items()
                      if v is not None]
        elif isinstance(value, list):
            items += [(key, _json_text(key, v)) for v in value]
        else:
            items.append((key, _json_text(key, value)))
    return FormData(items)


def _json_text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise APIError(400, f"invalid {key}: {type(value).__name__} where a text or a number belongs", key, "invalid_value")


def reference_of(form: FormData) -> str | UploadFile | None:
    """input_reference: a file, a data URL, or (OpenAI's object form) `input_reference[image_url]`."""
    for key in form.keys():
        if key.startswith("input_reference[") and key not in REFERENCE_KEYS:
            raise APIError(400, f"invalid {key}: input_reference takes image_url (or file_id)", "input_reference")
    if form.get("input_reference[file_id]"):
        raise APIError(400, "invalid input_reference: this server has no Files API; send the image itself, as a "
                            "file or as image_url (a data:image/...;base64 URL)", "input_reference")
    reference = form.get("input_reference")
    return form.get("input_reference[image_url]") if reference is None or reference == "" else reference


def image_error(answer: APIError, sent: bool) -> APIError:
    """A failure about the image, in the HTTP API's words: its field is `input_reference`; a missing image is
    asked for by that name (the node's own message names the CLI's --image)."""
    if answer.param == "image":
        answer.param = "input_reference"
        answer.message = (answer.message.replace("invalid image:", "invalid input_reference:", 1)
                          .replace("--image PATH", "input_reference").replace("--image", "input_reference"))
    if not sent and answer.status == 400 and "needs an input image" in answer.message:
        answer.message = ("invalid input_reference: this model needs an input image: send input_reference (an image "
                          "file, or a data:image/...;base64 URL; in a JSON body {\"image_url\": ...})")
        answer.param = "input_reference"
    return answer


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
    reference = reference_of(form)
    if isinstance(reference, str) and reference:
        image = jobs.uploads.save(job_id, jobs.uploads.decode_data_url(reference), None)
    elif isinstance(reference, StoredFile):
        image = jobs.uploads.adopt(job_id, reference)
    elif isinstance(reference, UploadFile):  # a form another parser read (not StreamedForm's)
        image = jobs.uploads.save(job_id, await reference.read(), reference.filename)
    shown = model if model in served.names else name
    try:
        job = await jobs.create(job_id, name, prompt, image, params, size, _text(form, "seconds"), shown)
    except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer
        if image is not None:
            image.unlink(missing_ok=True)
        raise image_error(served.jobs.about_upload(api_error(exc), image), image is not None) from None
    return job.to_json(served.settings.video_ttl)


def declared_fields(form: FormData, options: dict[str, OptionInfo], model: str) -> dict[str, Any]:
    """Every field but OpenAI's as a request parameter, checked against the declared options by name."""
    params: dict[str, Any] = {}
    for key in dict.fromkeys(form.keys()):
        if key in OPENAI or key in REFERENCE_KEYS:
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
async def list_videos(served: ServedDep, after: str | None = None, limit: Annotated[int, Query(ge=0, le=100)] = 20,
                      order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc"):
    page, more = served.jobs.list(after, limit, order)
    data = [j.to_json(served.settings.video_ttl) for j in page]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


@router.get("/v1/videos/{video_id}", response_model=VideoJob)
async def get_video(video_id: str, served: ServedDep):
    return served.jobs.get(video_id).to_json(served.settings.video_ttl)


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, served: ServedDep, variant: str = "video"):
    job = served.jobs.get(video_id)
    if variant != "video":
        raise APIError(400, f"invalid variant: {variant!r} (only 'video')", "variant")
    if job.status != "completed" or job.path is None or not job.path.is_file():
        raise APIError(404, f"video {video_id!r} is {job.status}; its content is not available", "video_id",
                       "not_ready" if job.status in ("queued", "in_progress") else "not_found")
    return FileResponse(job.path, media_type="video/mp4", filename=f"{video_id}.mp4")


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, served: ServedDep):
    await served.jobs.delete(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True}
