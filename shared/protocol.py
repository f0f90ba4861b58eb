"""The Magnitude wire protocol: msgpack envelopes over ZeroMQ.

Every message type any service speaks is declared here, in ``MESSAGES``, so the
protocol lives in one module with one version number. ``docs/protocol.md``
describes the same table for people.

A request is one ZeroMQ frame holding a msgpack map::

    {"v": 1, "id": "<request id>", "type": "generate", "session": "<id>|None", "body": {...}}

A reply is one or more frames, each a msgpack map with a ``kind``:

* ``event`` - a partial result of a streaming request (e.g. one token);
* ``ok``    - the final result; no more frames follow for that id;
* ``error`` - the final, typed failure ``{"code": ..., "message": ...}``.

Large payloads never travel inline: the body carries a shared-memory handle
(see ``shared.shm``) and the frame stays small.

Frames hold plain msgpack values only (nil, bool, numbers, str, bin, array,
map): no object of a class ever comes off the wire. msgpack's extension types
are refused and its timestamp extension reads as an integer of nanoseconds; no
module here pickles (ZeroMQ services that did, SGLang's, could be made to run
code by one frame).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar, cast, get_args

import msgpack
import msgspec
from msgspec import Meta

#: 2: generate and chat are typed (``GenerateRequest``, ``ChatRequest``: unknown fields refused), and their
#: results carry the generation's figures as one ``stats`` map.
PROTOCOL_VERSION = 2

#: Default ceiling for one inbound frame; bigger payloads must go through shm.
DEFAULT_MAX_FRAME_BYTES = 1 << 20


class ErrorCode:
    """Machine-readable error codes of ``error`` replies."""

    BAD_FRAME = "bad_frame"  # not msgpack, truncated, or not a map
    BAD_VERSION = "bad_version"  # protocol version this peer does not speak
    UNKNOWN_TYPE = "unknown_type"  # message type the service does not handle
    TOO_LARGE = "too_large"  # frame over the size limit
    BAD_REQUEST = "bad_request"  # missing field, wrong type, value out of range
    BUSY = "busy"  # queue full: back-pressure, retry later
    SHUTTING_DOWN = "shutting_down"  # service is draining and takes no new work
    TIMEOUT = "timeout"  # client gave up waiting (raised locally)
    UNAVAILABLE = "unavailable"  # service not reachable (raised locally)
    UNAUTHORIZED = "unauthorized"  # CURVE handshake refused (raised locally)
    NOT_FOUND = "not_found"  # a named thing (session, shm buffer, model) is unknown
    INTERNAL = "internal"  # the handler failed; the service keeps serving
    TOOL_FAILED = "tool_failed"  # a tool timed out, crashed, ran out of memory or raised; message says which
    CANCELLED = "cancelled"  # the client cancelled the request (``cancel``) or went away


def internal_error(where: str, exc: BaseException) -> tuple[str, str]:
    """A reference and the message a client gets for a bug (``internal``, HTTP 500): the exception's type and
    where its log line is, never its text, which may name files (paths of the data directory, the keys)."""
    ref = uuid.uuid4().hex[:12]
    return ref, f"internal error ({type(exc).__name__}); the {where} log has the details under ref {ref}"


class ProtocolError(Exception):
    """A failure that is answered with a typed ``error`` reply."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


def bad_request(message: str) -> ProtocolError:
    """The error for a body a handler refuses (``bad_request``, with why)."""
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


@dataclass(frozen=True)
class Field:
    """One body field of a message type: its Python type(s), whether it is required, and its bounds."""

    types: type | tuple[type, ...]
    required: bool = False
    max_len: int | None = None  # for str / list / bytes
    min: float | None = None  # for numbers: the least value allowed
    max: float | None = None  # ... and the greatest
    above: bool = False  # ``min`` itself is excluded (top_p > 0)
    choices: tuple[str, ...] | None = None  # for str: the only values allowed
    #: Speaks for someone else (``owner``): only a peer that may send privileged messages may set it.
    privileged: bool = False


@dataclass(frozen=True)
class MessageSpec:
    service: str  # which service answers it ("*" = every service)
    fields: dict[str, Field] = field(default_factory=dict)  # an untyped body's fields
    #: A typed body (its Struct declares the fields and bounds, instead of ``fields``), and its ``ok`` body.
    body: type[Generation] | None = None
    result: type[Result] | None = None
    streams: bool = False  # may answer with ``event`` frames before ``ok``
    doc: str = ""
    #: Changes the box (engines, models, strategy, tools, stored data): on a tcp endpoint only a
    #: CURVE-authenticated client may send it (see shared.security); others get ``unauthorized``.
    privileged: bool = False

    def needs_trusted_peer(self, req: Request) -> bool:
        """Whether only a peer that may send privileged messages may send this request: its type changes the
        box, or its body sets a field that speaks for someone else."""
        if req.message is not None:
            return self.privileged or any(getattr(req.message, name) is not None for name in req.message.privileged)
        return self.privileged or any(spec.privileged and name in req.body for name, spec in self.fields.items())


_NUMBER = (int, float)

# --- the bounds of a generation request: the one place they are written (the gateway imports them) ---
MAX_TOKENS = 32768
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1000
MAX_SEED = 2**32 - 1
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_OWNER_CHARS = 96
#: A generation's scheduling class, most urgent first (``services/inference/scheduler.py``, docs/scheduler.md).
Priority = Literal["interactive", "normal", "background"]
PRIORITIES: tuple[str, ...] = get_args(Priority)
DEFAULT_PRIORITY: Priority = "normal"
MAX_MODEL_NAME_CHARS = 64
MAX_ID_CHARS = 128  # request, session and tool-call ids
MAX_HTTP_SESSION_CHARS = 96  # an X-Session-Id: printable ASCII; the gateway prefixes it with the key's name
MAX_PROMPT_CHARS = 1 << 20  # a raw prompt, a text to tokenize, a tool call's JSON arguments
MAX_GRAMMAR_CHARS = 1 << 18
# ... and of what a chat request carries besides messages
MAX_TOOL_NAME_CHARS = 64
MAX_CALL_NAME_CHARS = 1024  # a tool call's name as a client echoes it back (it may name no tool)
MAX_TOOL_CALLS = 64  # in one assistant message
MAX_DESCRIPTION_CHARS = 4096
MAX_USER_CHARS = 256  # OpenAI's ``user`` field: accepted, not used
MAX_SCHEMA_BYTES = 64 * 1024  # one JSON schema (a tool's parameters, a response format)
MAX_SCHEMA_DEPTH = 32  # nested JSON containers in a schema
#: Nested maps and arrays in a request body (the body's own map is the first), far below Python's recursion
#: limit (1000): msgpack unpacks 1024 levels, and a service's json.dumps of a deeper body raised RecursionError.
MAX_BODY_DEPTH = 128
MAX_TOOLS_BYTES = 256 * 1024  # all the tools' schemas together: they become one grammar

# --- the bounds of memory requests (embedding and retrieval) ---
MAX_EMBED_TEXTS = 4096
MAX_MEMORY_TEXT_CHARS = 1 << 16  # a text to embed or store
MAX_VECTOR_DIMS = 4096
MAX_COLLECTION_CHARS = 128
MAX_MEMORY_ID_CHARS = 256
MAX_UPSERT_ITEMS = 1024

# --- the bounds of the MCP server's tools (magnitude/mcp_server.py) ---
MAX_GOAL_CHARS = 4000
MAX_AGENT_ITERATIONS = 50
MAX_QUERY_CHARS = 2000
MAX_HITS = 20
MAX_NOTE_CHARS = 8000
MAX_EXPRESSION_CHARS = 500

# --- the bounds of a /v1/responses request's metadata (OpenAI's) ---
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# --- the bounds of agent feedback ---
MAX_ERROR_REASON_CHARS = 4096
MAX_FEEDBACK_DETAILS_BYTES = 16 << 10

#: The tenant a relaying peer acts for (the gateway: the API key's name, or one name for all keyless callers):
#: KV is reused only within one, and it is the client that ``runtime.max_generations_per_client`` counts. Only a
#: peer that may send privileged messages may name one, so an ordinary client can neither reach another
#: tenant's KV nor dodge its own limit under made-up names.
_OWNER = {"owner": Field(str, max_len=MAX_OWNER_CHARS, privileged=True)}


# --- the typed messages: generate and chat, their results and stats, tool calls --------------------------
# Each is a msgspec Struct, its one definition: the service decodes a body into it once (``decode_request``), a
# client builds it with typed keywords, and docs/protocol.md is checked against its fields (tests).
class Wire(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """A typed body or a part of one: a field it does not declare is refused, a field left at its default is not
    sent (so a ``type`` every reader needs has none)."""


Text = Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
ShmHandle = dict[str, Any]  # see shared.shm: checked by the taker, which also caps what it reads


class CalledFunction(Wire, kw_only=True):
    name: Annotated[str, Meta(max_length=MAX_CALL_NAME_CHARS)]
    arguments: Text  # a JSON object as a string, as OpenAI sends it; parsed once, where a template needs it


class ToolCall(Wire, kw_only=True):
    """A call an assistant message made; ``error`` (in replies): why it must not be run as written."""

    id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] | None = None
    type: Literal["function"]
    function: CalledFunction
    error: Text | None = None


class TextPart(Wire, kw_only=True):
    type: Literal["text"]
    text: Text


class Message(Wire, kw_only=True):
    """One message of a conversation (OpenAI's shape); content may be a list of text parts, joined as one."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] | None = None
    name: Annotated[str, Meta(max_length=MAX_CALL_NAME_CHARS)] | None = None


#: A conversation: one message at least.
Messages = Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]


class FunctionSpec(Wire, kw_only=True):
    name: Annotated[str, Meta(pattern=rf"^[A-Za-z0-9_.\-]{{1,{MAX_TOOL_NAME_CHARS}}}$")]
    description: Annotated[str, Meta(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (bounded and compiled by inference)
    strict: bool | None = None


class Tool(Wire, kw_only=True):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(Wire, kw_only=True):
    name: Annotated[str, Meta(max_length=MAX_TOOL_NAME_CHARS)]
    #: Magnitude's own: a narrower schema the call's arguments are decoded under (the tool as the prompt shows it
    #: stays the same, and so does the prompt's KV); None: the tool's own.
    parameters: dict[str, Any] | None = None


class NamedToolChoice(Wire, kw_only=True):
    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaSpec(Wire, kw_only=True):
    name: Annotated[str, Meta(max_length=MAX_TOOL_NAME_CHARS)] | None = None
    description: Annotated[str, Meta(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Wire, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class Generation(Wire, kw_only=True):
    """What generate and chat share: sampling, stop sequences, streaming, the model, how urgent it is, and who
    the caller is."""

    #: Fields that speak for someone else: only a peer that may send privileged messages may set them.
    privileged: ClassVar[tuple[str, ...]] = ("owner",)

    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] | None = None  # None: engine.default_max_tokens
    temperature: Annotated[float, Meta(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=MAX_TOP_K)] | None = None
    seed: Annotated[int, Meta(ge=0, le=MAX_SEED)] | None = None
    stop: Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
                    Meta(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    model: Annotated[str, Meta(max_length=MAX_MODEL_NAME_CHARS)] | None = None
    cache_prompt: bool = True
    priority: Priority = DEFAULT_PRIORITY
    owner: Annotated[str, Meta(max_length=MAX_OWNER_CHARS)] | None = None  # as ``_OWNER``'s


class GenerateRequest(Generation, kw_only=True):
    prompt: Text | None = None
    prompt_shm: ShmHandle | None = None  # the prompt as UTF-8, when long (shared.client does this)
    grammar: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] | None = None


class ChatRequest(Generation, kw_only=True):
    messages: Messages | None = None
    messages_shm: ShmHandle | None = None  # the messages list as msgpack, when long (shared.client does this)
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None


class Result(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A typed reply body: every field is sent, so a reader in any language finds each one."""


class Stats(Result, kw_only=True):
    """One generation's figures: written once by the scheduler (with the preparing worker's ``prepare_ms`` and
    the service's ``settings_id``), read as attributes by the gateway, the agent and clients."""

    stop_reason: str | None = None  # eos, stop or length
    prompt_tokens: int = 0
    cached_tokens: int = 0  # KV reused, not computed
    prefill_tokens: int = 0
    completion_tokens: int = 0
    kv_source: str = "cold"  # resident, restored, disk, shared or cold
    kv_switch_ms: float = 0.0
    shared_tokens: int = 0  # of cached_tokens, copied from another sequence
    ttft_s: float = 0.0
    prefill_tps: float | None = None
    decode_tps: float | None = None
    total_s: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0
    peak_batch: int = 0
    priority: Priority = DEFAULT_PRIORITY
    pauses: int = 0
    model: str = ""
    model_load_ms: float = 0.0
    prepare_ms: float = 0.0
    settings_id: str | None = None


class GenerateResult(Result, kw_only=True):
    text: str
    stats: Stats


class AssistantMessage(Result, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = []


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatResult(Result, kw_only=True):
    """A chat turn's reply: the assistant message (content, tool calls), why it ended, and its stats."""

    message: AssistantMessage
    finish_reason: FinishReason
    stats: Stats

    @property
    def content(self) -> str:
        return self.message.content or ""

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.message.tool_calls


MESSAGES: dict[str, MessageSpec] = {
    "health": MessageSpec("*", doc="Liveness and vital figures: ok, uptime, model, memory."),
    "cancel": MessageSpec(
        "*", {"id": Field(str, required=True, max_len=MAX_ID_CHARS)},
        doc="Stop the request with this id (and the envelope's session) that this client sent: queued, it never "
            "runs; running, it ends at the next scheduler step with a 'cancelled' error. Answered by the service "
            "loop at once: 'cancelled' says whether such a request was in flight.",
    ),
    "generate": MessageSpec(
        "inference", body=GenerateRequest, result=GenerateResult, streams=True,
        doc="Complete a prompt. With a session, the KV cache of its earlier steps is reused.",
    ),
    "chat": MessageSpec(
        "inference", body=ChatRequest, result=ChatResult, streams=True,
        doc="A conversation (OpenAI-shaped messages, tools) rendered with the model's own chat template; the reply "
            "is an assistant message with native tool calls. Streams {text} and {tool_call} events.",
    ),
    "session.drop": MessageSpec("inference", _OWNER, doc="Forget the session's cached KV state."),
    "sessions": MessageSpec("inference", _OWNER, doc="List cached sessions and where their KV lives."),
    "tokenize": MessageSpec(
        "inference",
        {"text": Field(str, required=True, max_len=MAX_PROMPT_CHARS)},
        doc="Token ids of a text under the model's tokenizer.",
    ),
    "model.list": MessageSpec("inference", doc="Configured models, which are resident, their memory, the default."),
    "model.load": MessageSpec(
        "inference", {"name": Field(str, required=True, max_len=MAX_MODEL_NAME_CHARS)},
        doc="Make a configured model resident (unloading the least recently used idle one if needed): 'load_ms'.",
        privileged=True,
    ),
    "model.unload": MessageSpec(
        "inference", {"name": Field(str, required=True, max_len=MAX_MODEL_NAME_CHARS)},
        doc="Free a resident model's memory: 'unloaded' bool. Refused (busy) while it generates.",
        privileged=True,
    ),
    "model.switch": MessageSpec(
        "inference", {"name": Field(str, required=True, max_len=MAX_MODEL_NAME_CHARS)},
        doc="Make a model the default for requests that name none, loading it if needed: 'switch_ms'.",
        privileged=True,
    ),
    # --- memory: the embedding and retrieval services -------------------------------------
    "embed": MessageSpec(
        "embedding",
        {"texts": Field(list, required=True, max_len=MAX_EMBED_TEXTS)},
        doc="L2-normalised float32 vectors of texts: inline 'vectors' (raw bytes + 'shape'), or a 'vectors_shm' handle "
            "when the batch is over the inline limit.",
    ),
    "memory.upsert": MessageSpec(
        "retrieval",
        {
            "collection": Field(str, required=True, max_len=MAX_COLLECTION_CHARS),
            "id": Field(str, required=True, max_len=MAX_MEMORY_ID_CHARS),
            "text": Field(str, required=True, max_len=MAX_MEMORY_TEXT_CHARS),
            "metadata": Field(dict),
        },
        doc="Embed a text and store it under (collection, id), replacing any earlier version. "
            "The reply comes after the commit is on disk.",
        privileged=True,
    ),
    "memory.upsert_many": MessageSpec(
        "retrieval",
        {"collection": Field(str, required=True, max_len=MAX_COLLECTION_CHARS), "items": Field(list, required=True, max_len=MAX_UPSERT_ITEMS)},
        doc="Batch upsert: items are maps {id, text, metadata?}; one embed call and one commit for all.",
        privileged=True,
    ),
    "memory.delete": MessageSpec(
        "retrieval",
        {"collection": Field(str, required=True, max_len=MAX_COLLECTION_CHARS), "id": Field(str, required=True, max_len=MAX_MEMORY_ID_CHARS)},
        doc="Remove one stored text; 'deleted' says whether it existed.",
        privileged=True,
    ),
    "memory.query": MessageSpec(
        "retrieval",
        {
            "collection": Field(str, required=True, max_len=MAX_COLLECTION_CHARS),
            "text": Field(str, max_len=MAX_MEMORY_TEXT_CHARS),
            "vector": Field(list, max_len=MAX_VECTOR_DIMS),
            "k": Field(int),
            "filter": Field(dict),
            "hybrid": Field(bool),
        },
        doc="Nearest stored texts to a text or a vector (cosine), optionally blended with FTS5 keyword scores; "
            "'filter' keeps hits whose metadata equals every given key/value.",
    ),
    "memory.stats": MessageSpec(
        "retrieval",
        {"collection": Field(str, max_len=MAX_COLLECTION_CHARS)},
        doc="Document counts per collection, database size and path.",
    ),
    # --- agents: the tool service and the optimizer's feedback intake -------------------
    "tool.list": MessageSpec("tools", doc="The configured tools: name, kind, description, parameters (JSON schema)."),
    "tool.call": MessageSpec(
        "tools",
        {"tool": Field(str, required=True, max_len=MAX_TOOL_NAME_CHARS), "args": Field(dict, required=True)},
        doc="Run one tool on schema-validated args: 'output' (or 'output_shm' when long), 'truncated', "
            "'elapsed_ms'. A tool that hangs, crashes, floods or raises answers tool_failed.",
        privileged=True,
    ),
    "feedback": MessageSpec(
        "optimizer",
        {
            "session_id": Field(str, required=True, max_len=MAX_ID_CHARS),
            "success": Field(bool, required=True),
            "error_reason": Field(str, max_len=MAX_ERROR_REASON_CHARS),
            "details": Field(dict),
        },
        doc="Outcome of one agent run; acknowledged only once it is durable on disk.",
        privileged=True,
    ),
    "feedback.stats": MessageSpec("optimizer", doc="Feedback counts: total, succeeded, failed, top error reasons."),
    # --- self-optimization: telemetry in, settings out -------------------------------------
    "telemetry": MessageSpec(
        "optimizer",
        {
            "service": Field(str, required=True, max_len=64),
            "pid": Field(int),
            "instance": Field(str, max_len=64),
            "samples": Field(list, max_len=4096),
            "system": Field(dict),
        },
        doc="A batch of per-request samples (one map per finished request) and the sender's process figures.",
        privileged=True,
    ),
    "engine.configure": MessageSpec(
        "inference",
        {"settings": Field(dict, required=True)},
        doc="Change the engine's tunable settings. Hot ones apply at once; ones that rebuild the llama.cpp "
            "context apply between requests (a planned reload, no request lost). Reply: the full 'settings', "
            "'reloaded' bool, 'settings_id'.",
        privileged=True,
    ),
    # --- the optimizer: learned strategy, status, advice to agents -------------------------
    "strategy.get": MessageSpec("optimizer", doc="The learned strategy document (as in strategy.json) and its path."),
    "strategy.set": MessageSpec(
        "optimizer",
        {"strategy": Field(dict, required=True)},
        doc="Restore a strategy document (validated like the file); it is persisted and pushed to inference.",
        privileged=True,
    ),
    "optimizer.status": MessageSpec(
        "optimizer",
        doc="Phase, load class, window fill, the trial under test, decisions so far, thermal state.",
    ),
    "optimizer.advice": MessageSpec(
        "optimizer",
        doc="For the session in the envelope: 'compress' true once its decode speed fell below "
            "optimizer.compress_below of its start.",
    ),
    # --- operations: every service's figures, answered by the ZeroMQ router like health ------
    "metrics": MessageSpec("*", doc="The service's Prometheus metrics: 'text' (text exposition format) and "
                                    "'content_type'."),
    # --- the watchdog: supervision of the other services -----------------------------------
    "watchdog.status": MessageSpec(
        "watchdog",
        doc="Per supervised service: state, pid, restarts, last restart reason and time, current backoff.",
    ),
}


# --- what generation replies mean (inference writes them, the gateway and clients read them) -----
#: A generation's stop_reason -> the finish_reason of a chat reply (OpenAI's names).
_FINISH_REASONS: dict[str, FinishReason] = {"eos": "stop", "stop": "stop", "length": "length"}


def finish_reason(stop_reason: str | None, called_tools: bool = False) -> FinishReason:
    """Why a reply ended, in OpenAI's words: ``tool_calls``, ``length`` or ``stop``."""
    return "tool_calls" if called_tools else _FINISH_REASONS.get(stop_reason or "stop", "stop")


def unsent_text(content: str, streamed: str) -> str:
    """What of a reply's content its ``text`` events have not carried yet: the rest after what was streamed
    (nothing when the content no longer starts with it: a call's markup is never streamed, then taken back)."""
    return content[len(streamed):] if content.startswith(streamed) else ""


def new_request_id() -> str:
    return uuid.uuid4().hex


#: Encodes plain values and the typed bodies alike (a Struct as the map of its fields).
_encoder = msgspec.msgpack.Encoder()


def encode_request(
    msg_type: str,
    body: dict[str, Any] | Wire | None = None,
    *,
    session: str | None = None,
    request_id: str | None = None,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    return _encoder.encode({"v": version, "id": request_id or new_request_id(), "type": msg_type,
                            "session": session, "body": {} if body is None else body})


@dataclass
class Request:
    id: str
    type: str
    session: str | None
    body: dict[str, Any]  # an untyped message's body (empty for a typed one)
    #: A typed message's body (``MessageSpec.body``), validated as it was decoded; None for an untyped one.
    message: Generation | None = None
    #: Who sent it, as the receiving service knows it (never from the wire): "local" for a peer of an ipc or
    #: loopback endpoint, "curve:<public key>" for a CURVE-authenticated one.
    peer: str = "local"

    @property
    def key(self) -> tuple[str | None, str]:
        """What identifies the request for retries and ``cancel``: (session, id)."""
        return self.session, self.id

    @property
    def owner(self) -> str | None:
        """The tenant the body names (``owner``), typed or not."""
        return self.message.owner if self.message is not None else self.body.get("owner")


def _no_extensions(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=len(data),
                               ext_hook=_no_extensions, timestamp=2)
    except Exception as exc:  # msgpack raises several types for bad input
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{what} is not valid msgpack ({type(exc).__name__})")


def decode_messages(data: bytes, request_id: str) -> list[Message]:
    """A chat's ``messages`` that came in shared memory (``messages_shm``): msgpack under the frame's rules,
    validated as if they had come inline."""
    value = _unpack(data, "messages_shm")
    _check_depth(value, "field 'messages'", request_id)
    return _typed(Messages, value, "messages", request_id)


def _typed(into: Any, value: Any, name: str | None, request_id: str) -> Any:
    """``value`` validated into the type ``into`` (a typed body, its field ``name``): the one validation of a
    typed message, whose refusal names the field as the field table's do."""
    try:
        return msgspec.convert(value, into, strict=True)
    except msgspec.ValidationError as err:
        raise ProtocolError(ErrorCode.BAD_REQUEST, _refusal(str(err), name), request_id) from None


def _refusal(error: str, name: str | None) -> str:
    """msgspec's "Expected `int` <= 5 - at `$.max_tokens`" as "field 'max_tokens' must be int <= 5"."""
    reason, _, where = error.partition(" - at `$")
    where = ((name or "") + where.rstrip("`")).lstrip(".")
    reason = (reason.replace("Expected ", "must be ").replace("Invalid enum value", "must be one of its values, not")
              .replace("Object contains unknown", "has an unknown").replace("Object missing required", "misses the")
              .replace(" | null", "").replace("`", ""))
    return f"field {where!r} {reason}" if where else f"body {reason}"


def _check_depth(value: Any, what: str, request_id: str | None) -> None:
    """Refuse ``value`` when its maps and arrays nest deeper than ``MAX_BODY_DEPTH``: walked level by level,
    not recursively, before any recursive code (json.dumps, a handler's walk) meets it."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > MAX_BODY_DEPTH:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} nests deeper than {MAX_BODY_DEPTH} levels",
                                request_id)
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]


def _peek_id(frame: bytes) -> str | None:
    """The envelope's ``id`` of a frame too large to decode, so that its error still reaches the caller: walk
    the top-level map, skipping every other value unread. ``None`` when the frame has no readable id."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(frame), ext_hook=_no_extensions)
    unpacker.feed(frame)
    try:
        for _ in range(min(unpacker.read_map_header(), 16)):
            key = unpacker.unpack()
            if key != "id":
                unpacker.skip()
                continue
            value = unpacker.unpack()
            return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None
    except Exception:  # msgpack raises several types for bad input; a frame without an id gets none
        return None
    return None


def _unpack_map(frame: bytes) -> dict:
    obj = _unpack(frame, "frame")
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame must be a msgpack map")
    return obj


def _check_field(name: str, spec: Field, value: Any, request_id: str) -> None:
    if isinstance(value, bool) and spec.types in (int, _NUMBER):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a number, not bool", request_id)
    if not isinstance(value, spec.types):
        expected = spec.types.__name__ if isinstance(spec.types, type) else "number"
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"field {name!r} must be {expected}, got {type(value).__name__}", request_id
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} must be finite", request_id)
    # isinstance() above leaves ``value`` typed as object: MESSAGES declares max_len only on sized fields
    # (str, list, bytes) and min/max only on number fields, which is what ``value`` then is.
    if spec.choices is not None and value not in spec.choices:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} must be one of {', '.join(spec.choices)}",
                            request_id)
    if spec.max_len is not None and len(cast(Sized, value)) > spec.max_len:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} longer than {spec.max_len}", request_id)
    number = cast(float, value)
    low_ok = spec.min is None or (number > spec.min if spec.above else number >= spec.min)
    if not low_ok or (spec.max is not None and number > spec.max):
        low = "" if spec.min is None else f"{spec.min:g} {'<' if spec.above else '<='} "
        high = "" if spec.max is None else f" <= {spec.max:g}"
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} must be {low}{name}{high}", request_id)


def decode_request(frame: bytes, *, max_frame_bytes: int, handled: set[str]) -> Request:
    """Parse and validate one request frame; raise ``ProtocolError`` with the right code."""
    if len(frame) > max_frame_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes exceeds {max_frame_bytes}; send large data via shm",
            _peek_id(frame),
        )
    env = _unpack_map(frame)
    request_id = env.get("id")
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_ID_CHARS:
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"envelope field 'id' must be a non-empty string (<={MAX_ID_CHARS} chars)")
    version = env.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION, f"protocol version {version!r} not supported (speaks {PROTOCOL_VERSION})", request_id
        )
    msg_type = env.get("type")
    if not isinstance(msg_type, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "envelope field 'type' must be a string", request_id)
    if msg_type not in handled:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg_type[:64]!r}", request_id)
    session = env.get("session")
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= MAX_ID_CHARS):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "envelope field 'session' must be null or a string", request_id)
    body = env.get("body", {})
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "envelope field 'body' must be a map", request_id)
    _check_depth(body, "body", request_id)
    spec = MESSAGES.get(msg_type)
    if spec is not None and spec.body is not None:  # null means not given, as for the field table below
        message = _typed(spec.body, {k: v for k, v in body.items() if v is not None}, None, request_id)
        return Request(request_id, msg_type, session, {}, message)
    if spec is not None:
        for name, field_spec in spec.fields.items():
            if name not in body or body[name] is None:
                if field_spec.required:
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"missing required field {name!r}", request_id)
                body.pop(name, None)  # null means not given: a handler asking `name in body` must agree
                continue
            _check_field(name, field_spec, body[name], request_id)
    return Request(request_id, msg_type, session, body)


def encode_reply(request_id: str | None, kind: str, body: dict[str, Any] | Result | None = None) -> bytes:
    return _encoder.encode({"v": PROTOCOL_VERSION, "id": request_id, "kind": kind,
                            "body": {} if body is None else body})


def encode_error(request_id: str | None, code: str, message: str) -> bytes:
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "id": request_id, "kind": "error", "error": {"code": code, "message": message}},
        use_bin_type=True,
    )


@dataclass
class Reply:
    id: str | None
    kind: str  # "event" | "ok" | "error"
    body: dict[str, Any]
    error_code: str | None = None
    error_message: str | None = None

    @property
    def final(self) -> bool:
        return self.kind != "event"

    def result(self, into: type[_R]) -> _R:
        """The ``ok`` body of a typed message (``ChatResult``...), validated: see ``read_result``."""
        return read_result(into, self.body)


_R = TypeVar("_R", bound=Result)


def read_result(into: type[_R], body: dict[str, Any]) -> _R:
    """A typed message's ``ok`` body as its type (``MessageSpec.result``): the reader's one validation of it.
    A body that is not one is a ``bad_frame``: the service broke the protocol."""
    try:
        return msgspec.convert(body, into, strict=True)
    except msgspec.ValidationError as err:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{into.__name__}: {err}") from None


def decode_reply(frame: bytes) -> Reply:
    env = _unpack_map(frame)
    kind = env.get("kind")
    if kind == "error":
        err = env.get("error") or {}
        return Reply(env.get("id"), kind, {}, str(err.get("code")), str(err.get("message")))
    if kind not in ("event", "ok"):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"reply has unknown kind {kind!r}")
    return Reply(env.get("id"), kind, env.get("body") or {})
