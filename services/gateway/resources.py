"""Everything but generation: embeddings, the model list, feedback, health and metrics.

Models come from the services themselves (inference's ``model.list``, the
embedding service's ``health``), so the list is what can be served right now;
a model file from the catalog (``shared.catalog``) is described as the catalog
knows it, with whether its template renders tools.
/health is open (a load balancer or compose probe has no key); it answers 503
while inference is not reachable, since nothing useful can be served then.
"""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path
import numpy as np
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from services.gateway.access import Context, Owner, scoped
from services.gateway.errors import ApiError, bad_request, documented
from services.gateway.schemas import (
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    FeedbackReceipt,
    FeedbackRequest,
    Health,
    Model,
    ModelList,
)
from shared import catalog
from shared.codecs import vectors_from_body
from shared.protocol import ErrorCode, ProtocolError

router = APIRouter()

#: Services whose health /health reports; only inference decides the status.
_BEHIND = ("inference", "embedding", "optimizer")
_PROBE_TIMEOUT_S = 1.0


def _model_not_found(name: str, known: list[str]) -> ApiError:
    return ApiError(404, "not_found_error", "model_not_found",
                    f"no model {name[:64]!r} (served: {', '.join(known) or 'none'})", "model")


async def _embedding_model(gw) -> dict | None:
    """The embedding service's model name and dimension, or None when it is not running."""
    try:
        health = await gw.upstreams.request("embedding", "health", deadline=_probe_deadline())
    except ApiError:
        return None
    return {"name": health.get("model"), "dim": health.get("dim")}


def _probe_deadline() -> float:
    return asyncio.get_running_loop().time() + _PROBE_TIMEOUT_S


@router.post("/v1/embeddings", response_model=EmbeddingList, responses=documented(400, 401, 404, 413, 429, 503, 504),
             summary="Embed texts with the embedding service's model")
async def embeddings(req: EmbeddingRequest, gw: Context, _: Owner):
    model = await _embedding_model(gw)
    if model is None:
        raise ApiError(503, "unavailable_error", ErrorCode.UNAVAILABLE, "the embedding service is not running")
    if req.model != model["name"]:
        raise _model_not_found(req.model, [model["name"]])
    if req.dimensions is not None and req.dimensions != model["dim"]:
        raise bad_request(f"{model['name']} makes {model['dim']}-dimensional vectors only", "dimensions")
    body = await gw.upstreams.request("embedding", "embed", {"texts": req.texts()})
    try:
        vectors = vectors_from_body(body)
    except ProtocolError as err:  # a shared-memory handle this process could not read
        raise ApiError(502, "upstream_error", err.code, err.message) from None
    data = [Embedding(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
    tokens = int(body.get("tokens", 0))
    return EmbeddingList(data=data, model=model["name"], usage=EmbeddingUsage(prompt_tokens=tokens,
                                                                              total_tokens=tokens))


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


#: Catalog models by file name: what a configured model file is, when it came from the catalog.
_CATALOG_FILES = {m.file: m for m in catalog.CATALOG.values()}


async def _models(gw) -> list[Model]:
    listed, embedding = await asyncio.gather(gw.upstreams.request("inference", "model.list"), _embedding_model(gw))
    now = int(time.time())
    models = []
    for m in listed.get("models", []):
        known = _CATALOG_FILES.get(Path(str(m.get("path", ""))).name)
        models.append(Model(id=m["name"], created=now, owned_by="magnitude", kind="generation",
                            resident=bool(m.get("resident")), chat_template=known.chat_template if known else None,
                            description=known.family if known else None))
    if embedding is not None:
        models.append(Model(id=embedding["name"], created=now, owned_by="magnitude", kind="embedding",
                            resident=True))
    return models


@router.get("/v1/models", response_model=ModelList, responses=documented(401, 429, 503, 504),
            summary="The models the services can serve now")
async def list_models(gw: Context, _: Owner):
    return ModelList(data=await _models(gw))


@router.get("/v1/models/{model}", response_model=Model, responses=documented(401, 404, 429, 503, 504),
            summary="One model")
async def get_model(model: str, gw: Context, _: Owner):
    models = await _models(gw)
    for m in models:
        if m.id == model:
            return m
    raise _model_not_found(model, [m.id for m in models])


@router.post("/v1/feedback", response_model=FeedbackReceipt, responses=documented(400, 401, 413, 429, 503, 504),
             summary="Report how an agent run went (the optimizer's feedback; without API keys, "
                     "gateway.feedback_per_minute at most)")
async def feedback(req: FeedbackRequest, gw: Context, owner: Owner):
    if not gw.auth_required() and not gw.keyless_feedback.take():
        raise ApiError(429, "rate_limit_error", ErrorCode.BUSY, "feedback without API keys is limited to "
                       f"{gw.config.gateway.feedback_per_minute} a minute (gateway.feedback_per_minute); "
                       "make keys with scripts/ops/keys api-key NAME for more")
    body = {"session_id": scoped(owner, req.session_id), "success": req.success,
            "error_reason": req.error_reason, "details": req.details}
    reply = await gw.upstreams.request("optimizer", "feedback", {k: v for k, v in body.items() if v is not None})
    return FeedbackReceipt(**{k: reply.get(k) for k in FeedbackReceipt.model_fields})


@router.get("/health", response_model=Health, responses={503: {"model": Health, "description": "inference is "
                                                                                                "not reachable"}},
            summary="Whether the gateway can serve: 200 once inference answers health")
async def health(gw: Context):
    async def up(name: str) -> bool:
        try:
            return bool((await gw.upstreams.request(name, "health", deadline=_probe_deadline()))
                        .get("ok"))
        except ApiError:
            return False

    states = dict(zip(_BEHIND, await asyncio.gather(*(up(name) for name in _BEHIND))))
    ok = states["inference"]
    return JSONResponse(Health(status="ok" if ok else "unavailable", services=states).model_dump(),
                        status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"},
    **documented(401)}, summary="The gateway's Prometheus metrics")
async def metrics(gw: Context, _: Owner):
    exposition = gw.metrics.exposition()
    return Response(exposition["text"], media_type=exposition["content_type"])
