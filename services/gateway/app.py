"""The ASGI application: FastAPI routes, error handlers, the OpenAPI document, and the middlewares.

FastAPI because the OpenAI API is a set of JSON documents with many optional
fields: pydantic models validate them (a bad request is a 400 before it costs
the mesh anything) and FastAPI derives the OpenAPI document from the same
models, which is what schemathesis tests the running gateway against. The
document follows the live configuration: the bearer scheme is required in it
exactly when the gateway requires keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import Histogram
from pydantic import BaseModel
from starlette.types import ASGIApp

from services.gateway import completions, errors, resources, responses
from services.gateway.access import Gateway
from services.gateway.middleware import Admission, Authenticate, BodyLimit, HostCheck, Observe
from shared.protocol import PROTOCOL_VERSION
from shared.security import allowed_host_names

#: The mesh message each API route becomes, for the per-type request metrics every service keeps.
_ROUTE_TYPES = {"/v1/chat/completions": "chat", "/v1/completions": "generate", "/v1/embeddings": "embed",
                "/v1/feedback": "feedback", "/v1/models": "model.list", "/v1/models/{model}": "model.list"}
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def create_app(gw: Gateway, beat: Callable[[], None], on_in_flight: Callable[[int], None]) -> ASGIApp:
    """The gateway's ASGI app; ``beat`` is called about once a second while the event loop runs, ``on_in_flight``
    with the number of requests in flight whenever it changes."""
    cfg = gw.config.gateway

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_heartbeat(beat, min(1.0, cfg.loop_stall_s / 4)))
        try:
            yield
        finally:
            task.cancel()
            gw.upstreams.close()

    app = FastAPI(title="Magnitude gateway", version=f"1.{PROTOCOL_VERSION}",
                  description="OpenAI-compatible HTTP API of Magnitude, an on-device inference stack for agents.",
                  docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gw
    errors.install(app, cfg.retry_after_s, gw.log)
    app.include_router(completions.router)
    app.include_router(resources.router)
    responses.install(app, gw)
    _document(app, gw)
    def respond(err: errors.ApiError) -> ASGIApp:
        return errors.error_response(err, cfg.retry_after_s)

    hosts = allowed_host_names(cfg.host, cfg.allowed_hosts)
    # Outermost first: the metrics see every answer; a foreign Host and a missing key are refused before a
    # request slot is taken; the body is read last, within its size, time and nesting depth.
    body = BodyLimit(app, cfg.max_body_bytes, cfg.max_json_depth, cfg.body_timeout_s, respond)
    admitted = Admission(body, cfg.max_concurrent, cfg.max_concurrent_per_key, respond, on_in_flight)
    return Observe(HostCheck(Authenticate(admitted, gw, respond), hosts, respond), _recorder(gw))


async def _heartbeat(beat: Callable[[], None], every_s: float) -> None:
    """Proves the event loop runs: a loop blocked by anything stops the beats, and health turns unhealthy."""
    while True:
        beat()
        await asyncio.sleep(every_s)


def _recorder(gw: Gateway) -> Callable[[str, str, int, float, str | None], None]:
    metrics = gw.metrics
    requests = metrics.counter("http_requests_total", "HTTP requests answered, by route, method and status.",
                               ["route", "method", "status"])
    latency = Histogram("magnitude_http_request_seconds", "Time from the request to the last byte of its "
                        "response (a stream's whole length), by route.", ["route"], buckets=_LATENCY_BUCKETS,
                        registry=metrics.registry)

    def record(route: str, method: str, status: int, seconds: float, code: str | None) -> None:
        requests.labels(route, method if method in _METHODS else "other", str(status)).inc()
        latency.labels(route).observe(seconds)
        if route in _ROUTE_TYPES:  # also counted like any service's requests, so `magnitude stats` shows them
            metrics.observe_request(_ROUTE_TYPES[route], seconds, code if status >= 400 else None)

    return record


def _document(app: FastAPI, gw: Gateway) -> None:
    """/openapi.json: FastAPI's document, with OpenAI's 400 in place of FastAPI's 422, and bearer auth
    required exactly when the gateway requires a key."""
    base: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not base:
            base.update(get_openapi(title=app.title, version=app.version, description=app.description,
                                    routes=app.routes))
            for path_item in base["paths"].values():
                for operation in path_item.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                base["components"]["schemas"].pop(name, None)
            base["components"]["securitySchemes"] = {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "an API key from scripts/ops/keys api-key NAME; required once keys exist, and always "
                               "when the gateway listens beyond loopback"}}
            base["paths"]["/health"]["get"]["security"] = []
            _document_streams(base, {**completions.STREAM_CHUNKS, **responses.STREAM_EVENTS})
        document = dict(base)
        if gw.auth_required():
            document["security"] = [{"bearer": []}]
        return document

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customize the document


def _document_streams(document: dict[str, Any], chunks: dict[str, type[BaseModel]]) -> None:
    """The text/event-stream answer of each streaming route: an event whose data is one JSON chunk (or an error),
    or [DONE]. Before OpenAPI 3.2 a stream's ``schema`` describes one event, as schemathesis reads it."""
    schemas = document["components"]["schemas"]
    for path, model in chunks.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        for name, definition in schema.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas.setdefault(model.__name__, schema)
        payload = {"anyOf": [{"$ref": f"#/components/schemas/{model.__name__}"},
                             {"$ref": "#/components/schemas/ErrorResponse"}]}
        event = {"type": "object", "required": ["data"], "properties": {
            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
            "data": {"type": "string", "anyOf": [
                {"const": "[DONE]", "description": "the end of the stream"},
                {"contentMediaType": "application/json", "contentSchema": payload}]}}}
        document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"] = {"schema": event}
