"""The routes for operators and clients looking around: GET /v1/models, GET /health, GET /metrics. /health and
/metrics read the engine's latest snapshot, never a scheduler."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from .chat_audio import chat_modalities
from .options import image_input, option_cards
from .protocol import APIError
from .snapshot import placed_of
from .state import ServedDep

router = APIRouter()


@router.get("/v1/models")
async def models(served: ServedDep):
    return {"object": "list", "data": [model_card(served, model) for model in served.names]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, served: ServedDep):
    """One served model (a pipeline or an alias), as in the list, with what a request may send it: its declared
    `options` and (a video pipeline) whether it takes an `input_reference` image; 404 model_not_found otherwise."""
    if model not in served.names:
        raise APIError(404, f"the model {model!r} does not exist; served models: {', '.join(sorted(served.names))}",
                       "model", "model_not_found")
    name = served.names[model]
    graph = served.async_omni.omnis[name].graph
    card = {**model_card(served, model), "options": option_cards(graph)}
    if served.kinds[name] == "video":
        card["input_reference"] = image_input(graph)
    if served.kinds[name] == "text":
        card.update(chat_modalities(graph))
    return card


CAPABILITIES = {"text": ["chat.completions", "completions"], "video": ["videos"], "speech": ["audio.speech"],
                "transcription": ["audio.transcriptions"]}


def model_card(served, model: str) -> dict:
    name = served.names[model]
    return {"id": model, "object": "model", "created": served.created, "owned_by": "omni", "root": name,
            "capabilities": CAPABILITIES[served.kinds[name]]}


@router.get("/health")
async def health(served: ServedDep):
    async_omni = served.async_omni
    snap = async_omni.snapshot
    dead = {n: d for n in async_omni.omnis if (d := snap.pipeline_dead(n))}
    if snap.dead or dead or not async_omni.alive:
        reason = snap.dead or "; ".join(f"{n}: {d}" for n, d in dead.items()) or "the engine thread stopped"
        return JSONResponse({"status": "dead", "error": reason, "dead_models": sorted(dead)}, status_code=503)
    restarting = sorted(f"{s.pipeline}/{s.node}" for s in snap.stages if s.restarting)
    placed = {f"{s.pipeline}/{s.node}": [placed_of(r) for r in s.replicas] or [placed_of(s.stats)]
              for s in snap.stages if s.stats.placed is not None}
    return {"status": "ok", "models": sorted(served.names), "in_flight": snap.in_flight, "restarting": restarting,
            "placed": placed}


@router.get("/metrics")
async def prometheus(served: ServedDep):
    return Response(served.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
