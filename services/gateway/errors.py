"""Every failure the gateway answers, in OpenAI's error shape with the HTTP status a client acts on.

``{"error": {"message", "type", "param", "code"}}``: the openai SDK turns the status
into its exception classes (400 BadRequestError, 401 AuthenticationError, 404
NotFoundError, 429 RateLimitError, 5xx InternalServerError) and retries 429 and
5xx, honouring ``Retry-After``. A typed ``ServiceError`` of the mesh maps to its
status here, in one table, so no route decides statuses on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.routing import Match

from services.gateway.schemas import ErrorResponse
from shared.client import ServiceError
from shared.protocol import ErrorCode, internal_error


@dataclass(frozen=True)
class _Status:
    http: int
    type: str


#: Mesh error code -> HTTP status and OpenAI error type.
_BY_CODE = {
    ErrorCode.BAD_REQUEST: _Status(400, "invalid_request_error"),
    ErrorCode.NOT_FOUND: _Status(404, "not_found_error"),
    ErrorCode.TOO_LARGE: _Status(413, "invalid_request_error"),
    ErrorCode.BUSY: _Status(429, "rate_limit_error"),
    ErrorCode.SHUTTING_DOWN: _Status(503, "unavailable_error"),
    ErrorCode.UNAVAILABLE: _Status(503, "unavailable_error"),
    ErrorCode.TIMEOUT: _Status(504, "timeout_error"),
    ErrorCode.CANCELLED: _Status(499, "client_closed_request"),  # the client went away (nginx's status)
    ErrorCode.UNKNOWN_TYPE: _Status(501, "not_implemented_error"),  # the service behind is older than the gateway
    ErrorCode.UNAUTHORIZED: _Status(502, "upstream_error"),  # the gateway's CURVE key, or the owner it named, refused
    ErrorCode.BAD_FRAME: _Status(502, "upstream_error"),
    ErrorCode.BAD_VERSION: _Status(502, "upstream_error"),
}
_INTERNAL = _Status(500, "server_error")
#: Statuses after which the same request may succeed later: they carry Retry-After.
_RETRY_LATER = {429, 503}


@dataclass
class ApiError(Exception):
    """An error answer: status, OpenAI ``type``, a machine ``code``, a message for people."""

    status: int
    type: str
    code: str
    message: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request_error", ErrorCode.BAD_REQUEST, message, param)


def from_service_error(err: ServiceError) -> ApiError:
    status = _BY_CODE.get(err.code, _INTERNAL)
    code = "model_not_found" if err.code == ErrorCode.NOT_FOUND and "model" in err.message else err.code
    return ApiError(status.http, status.type, code, err.message)


def error_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(err: ApiError, retry_after_s: int) -> JSONResponse:
    headers = dict(err.headers)
    if err.status in _RETRY_LATER:
        headers.setdefault("Retry-After", str(retry_after_s))
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


def from_validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first bad parameter."""
    problems = exc.errors()
    first = problems[0] if problems else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "header", "query", "path")]
    where = ".".join(loc)
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}{more}"
    return bad_request(message, where or None)


def from_http_exception(exc: StarletteHTTPException, request: Request) -> ApiError:
    """Routing errors (unknown path, wrong method) in the same shape as every other error."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = _allowed_methods(request)
    return ApiError(exc.status_code, kind, code, str(exc.detail), headers=headers)


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path. Starlette's 405 names only the first route's, and
    ``/v1/responses/{id}`` has two (GET and DELETE), each a route of its own."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


#: What each error status means, for the OpenAPI document.
_DOCUMENTED = {
    400: "malformed request, or one the model cannot serve (no chat template, prompt over the context)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "body over gateway.max_body_bytes",
    429: "busy: the gateway (gateway.max_concurrent) or the service's queue is full; see Retry-After",
    501: "the service behind does not speak this message yet",
    503: "the service behind is not running; see Retry-After",
    504: "not done within gateway.request_timeout_s",
}


def documented(*statuses: int) -> dict[int | str, dict]:
    """The ``responses`` of a route that can fail with these statuses (OpenAPI: the error shape, Retry-After)."""
    out: dict[int | str, dict] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": _DOCUMENTED[status]}
        if status in _RETRY_LATER:
            out[status]["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
    return out


#: Where an answered error leaves its code for the request metrics (``scope["state"]``).
ERROR_CODE_KEY = "error_code"


def install(app, retry_after_s: int, log) -> None:
    """Answer every exception in the error shape; an unexpected one is logged and costs one 500."""

    def answer(request: Request, err: ApiError) -> JSONResponse:
        setattr(request.state, ERROR_CODE_KEY, err.code)
        return error_response(err, retry_after_s)

    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, from_validation_error(exc))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, from_http_exception(exc, request))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        ref, message = internal_error("gateway", exc)
        log.error("gateway_handler_failed", path=request.url.path, ref=ref,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return answer(request, ApiError(500, _INTERNAL.type, ErrorCode.INTERNAL, message))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
