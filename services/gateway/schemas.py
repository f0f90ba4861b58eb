"""The HTTP API's shapes: OpenAI's request and response objects, as pydantic models.

They validate requests (a bad one is a 400 before anything reaches the mesh)
and they are the OpenAPI document (``/openapi.json``) that schemathesis checks
the gateway against. Bounds are the ones the services enforce, imported from
``shared.protocol`` (``max_tokens``, stop strings, names, ids), so the document
says what is accepted. Parameters Magnitude cannot honour (``n`` > 1, penalties,
logprobs) accept only their neutral value: clients that send the default keep
working, one that asks for more gets a 400 instead of a silent ignore. Unknown
fields are ignored, as OpenAI-compatible servers do.

Extensions beyond OpenAI: ``top_k``; ``timings`` in results (llama-server's
names: ``cache_n`` is the prompt tokens reused from the session's KV); the
``X-Session-Id`` header (see the routes); ``priority`` (and the ``X-Priority`` header).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from shared.protocol import (MAX_CALL_NAME_CHARS, MAX_DESCRIPTION_CHARS, MAX_EMBED_TEXTS, MAX_ERROR_REASON_CHARS,
                             MAX_FEEDBACK_DETAILS_BYTES, MAX_GOAL_CHARS, MAX_HTTP_SESSION_CHARS, MAX_ID_CHARS,
                             MAX_MEMORY_TEXT_CHARS, MAX_MESSAGES, MAX_METADATA_KEY_CHARS, MAX_METADATA_PAIRS,
                             MAX_METADATA_VALUE_CHARS, MAX_MODEL_NAME_CHARS, MAX_PROMPT_CHARS, MAX_SEED,
                             MAX_STOP_CHARS, MAX_STOPS, MAX_TEMPERATURE, MAX_TOKENS, MAX_TOOL_CALLS,
                             MAX_TOOL_NAME_CHARS, MAX_TOOLS, MAX_TOP_K, MAX_USER_CHARS, MAX_VECTOR_DIMS)

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


def _mesh_numbers(value: Any) -> Any:
    """Integers beyond 64 bits become floats: msgpack carries no bigger ones, and a JSON reader in most languages
    holds such a number as a double anyway. A copy, made without recursion: nesting depth is no limit here."""
    root = [value]
    places: list[tuple[Any, Any]] = [(root, 0)]  # (container, key) of each value still to convert, its copy put in place
    while places:
        container, key = places.pop()
        item = container[key]
        if isinstance(item, dict):
            container[key] = item = dict(item)
            places.extend((item, k) for k in item)
        elif isinstance(item, list):
            container[key] = item = list(item)
            places.extend((item, i) for i in range(len(item)))
        elif isinstance(item, int) and not isinstance(item, bool) and not _INT64_MIN <= item <= _UINT64_MAX:
            container[key] = float(item)
    return root[0]


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: Integers in a range; as in JSON Schema, 2.0 is an integer (strict mode alone would refuse it).
_WHOLE = BeforeValidator(_whole)
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS), _WHOLE]
TopK = Annotated[int, Field(ge=0, le=MAX_TOP_K), _WHOLE]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED), _WHOLE]
VectorDims = Annotated[int, Field(ge=1, le=MAX_VECTOR_DIMS), _WHOLE]
OnlyOne = Annotated[int, Field(ge=1, le=1), _WHOLE]  # n, best_of: one choice per request


#: A free-form JSON object (a JSON schema, feedback details) as the mesh can carry it.
JsonObject = Annotated[dict[str, Any], AfterValidator(_mesh_numbers)]
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS, description="a name from GET /v1/models")]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
PromptText = Annotated[str, Field(min_length=1)]
#: A generation's scheduling class: shared.protocol.PRIORITIES, most urgent first (default normal).
Priority = Literal["interactive", "normal", "background"]
PRIORITY_DOC = ("extension (vLLM has one): interactive, normal (default) or background; a free slot goes to the "
                "most urgent request waiting, which may pause a less urgent generation (the X-Priority header "
                "says the same for clients that cannot add a field; this field wins)")
#: An X-Session-Id (and feedback's session_id): printable ASCII.
SESSION_PATTERN = rf"^[\x21-\x7e]{{1,{MAX_HTTP_SESSION_CHARS}}}$"


class _Request(BaseModel):
    """Strict types (no "1" for 1, no 0 for false), so what the document calls invalid is refused."""

    model_config = ConfigDict(extra="ignore", strict=True)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- requests ---------------------------------------------------------------------------------
class SamplingParams(_Request):
    """What chat and text completions share."""

    model: ModelName
    max_tokens: MaxTokens | None = Field(None, description="default: engine.default_max_tokens")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = Field(None, description="extension (as llama-server)")
    seed: Seed | None = Field(None, description="default: a random seed per request")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    n: OnlyOne | None = Field(None, description="one choice per request")
    frequency_penalty: float | None = Field(None, ge=0, le=0, description="not supported: only 0")
    presence_penalty: float | None = Field(None, ge=0, le=0, description="not supported: only 0")
    user: str | None = Field(None, max_length=MAX_USER_CHARS, description="accepted, not used")
    priority: Priority | None = Field(None, description=PRIORITY_DOC)

    def stop_list(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class StreamOptions(_Request):
    include_usage: bool = False


class FunctionCall(_Request):
    """A call in an earlier assistant message: sent back as it came, so one cut off by max_tokens passes too."""

    name: str = Field(max_length=MAX_CALL_NAME_CHARS)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS, description="a JSON object, as a string")


class ToolCall(_Request):
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer is read as system")
    content: str | list[TextPart] | None = Field(None, description="text, or a list of text parts (joined as one)")
    name: str | None = Field(None, max_length=MAX_TOOL_NAME_CHARS)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(None, max_length=MAX_ID_CHARS)


class FunctionDefinition(_Request):
    name: str = Field(pattern=rf"^[A-Za-z0-9_-]{{1,{MAX_TOOL_NAME_CHARS}}}$")
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: JsonObject | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ToolName(_Request):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolName


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    json_schema: JsonObject = Field(alias="schema", description="the JSON schema the reply must validate against")
    strict: bool | None = None


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class ChatCompletionRequest(SamplingParams):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="accepted; the model decides how many calls")
    response_format: ResponseFormat | None = None
    max_completion_tokens: MaxTokens | None = Field(None, description="overrides max_tokens")
    stream_options: StreamOptions | None = None
    logprobs: Literal[False] | None = Field(None, description="not supported: only false")


class CompletionRequest(SamplingParams):
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=1)] = Field(
        description="one prompt (a list holding one string is accepted too); not empty: a model without a BOS "
                    "token would have nothing to continue")
    echo: bool = False
    logprobs: None = Field(None, description="not supported")
    suffix: None = Field(None, description="not supported")
    best_of: OnlyOne | None = None
    stream_options: StreamOptions | None = None

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class EmbeddingRequest(_Request):
    model: ModelName
    input: Annotated[str, Field(min_length=1, max_length=MAX_MEMORY_TEXT_CHARS)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_MEMORY_TEXT_CHARS)]],
        Field(min_length=1, max_length=MAX_EMBED_TEXTS)] = Field(
        description="a text or a list of texts (token arrays are not supported)")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: VectorDims | None = Field(None, description="must equal the model's dimension")
    user: str | None = Field(None, max_length=MAX_USER_CHARS)

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


def _small_details(details: dict[str, Any] | None) -> dict[str, Any] | None:
    if details is not None and len(json.dumps(details, default=str)) > MAX_FEEDBACK_DETAILS_BYTES:
        raise ValueError(f"over {MAX_FEEDBACK_DETAILS_BYTES} bytes as JSON")
    return details


class FeedbackRequest(_Request):
    session_id: str = Field(pattern=SESSION_PATTERN, description="the X-Session-Id of the run")
    success: bool
    error_reason: str | None = Field(None, max_length=MAX_ERROR_REASON_CHARS)
    details: Annotated[JsonObject | None, AfterValidator(_small_details)] = Field(
        None, description=f"at most {MAX_FEEDBACK_DETAILS_BYTES} bytes as JSON")


# --- replies ----------------------------------------------------------------------------------
class PromptTokensDetails(_Reply):
    cached_tokens: int = Field(description="prompt tokens reused from the session's KV cache")


class Usage(_Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Timings(_Reply):
    """llama-server's timings object, so clients written for it read the same fields."""

    cache_n: int = Field(description="prompt tokens reused from the session's KV (= cached_tokens)")
    prompt_n: int = Field(description="prompt tokens evaluated (prefilled)")
    prompt_ms: float
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float | None


class CalledFunction(_Reply):
    name: str
    arguments: str = Field(description="a JSON object, as a string")


class CallMade(_Reply):
    """A tool call in a reply: as the model wrote it, so a call it could not finish is shown, not hidden."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
    error: str | None = Field(None, description="extension: why the call is not valid (cut off by max_tokens, "
                                                "not the tool's shape); absent when it is")


class AssistantMessage(_Reply):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[CallMade] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(_Reply):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class _Result(_Reply):
    """What every result and stream chunk carries."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = Field(None, description="the engine settings id (settings_id)")


class ChatCompletion(_Result):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings


class FunctionCallDelta(_Reply):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Reply):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta
    error: str | None = Field(None, description="extension, as in a whole reply's tool call")


class Delta(_Reply):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Reply):
    index: int
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class _Piece(_Result):
    """A result that may be one piece of a stream: usage and timings come with the last piece."""

    usage: Usage | None = None
    timings: Timings | None = None


class ChatCompletionChunk(_Piece):
    """One SSE ``data:`` event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class CompletionChoice(_Reply):
    index: int
    text: str
    finish_reason: FinishReason | None = Field(None, description="set in a result and a stream's last chunk")
    logprobs: None = None


class Completion(_Piece):
    """A text completion, or one streamed chunk of one (a piece of its text)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class Embedding(_Reply):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class EmbeddingUsage(_Reply):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Reply):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Model(_Reply):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    kind: Literal["generation", "embedding"] = Field(description="extension: what the model serves")
    resident: bool | None = Field(None, description="extension: loaded in memory now")
    chat_template: Literal["tools", "chat", "none"] | None = Field(
        None, description="extension, for catalog models: its template renders tools, chat only, or none (a base "
                          "model: completions only)")
    description: str | None = Field(None, description="extension: what the model is (catalog models)")


class ModelList(_Reply):
    object: Literal["list"] = "list"
    data: list[Model]


class FeedbackReceipt(_Reply):
    id: int | str
    durable: bool
    queued_for: str | None = None
    settings_id: str | None = None


class Health(_Reply):
    status: Literal["ok", "unavailable"]
    services: dict[str, bool] = Field(description="whether each service behind the gateway answers health")


class ErrorDetail(_Reply):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Reply):
    error: ErrorDetail


# --- the agent over HTTP: /v1/responses (OpenAI's Responses API, the parts an agent run needs) ---------------
class FunctionTool(FunctionDefinition):
    """A tool the caller runs itself: the Responses API's flat function tool (chat's definition, with its type)."""

    type: Literal["function"]


class InputText(_Request):
    """A text part of a message's content (a re-sent assistant message carries ``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str, Field(min_length=1, max_length=MAX_GOAL_CHARS)] | Annotated[
        list[InputText], Field(min_length=1, max_length=MAX_TOOLS)]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallInput(_Request):
    """A ``function_call`` item of an earlier response, re-sent with the history."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(max_length=MAX_CALL_NAME_CHARS)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS)


class ToolCallInput(_Request):
    """A ``tool_call`` item of an earlier response (a configured tool the gateway ran), re-sent with the history
    as stateless clients re-send every output item: read as the call and its result."""

    type: Literal["tool_call"]
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(max_length=MAX_CALL_NAME_CHARS)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS)
    output: str = Field(max_length=MAX_PROMPT_CHARS)
    content: list = Field(default_factory=list, max_length=0)  # as the output item carries it: always empty


class FunctionCallOutput(_Request):
    """What the caller's tool gave back for a ``function_call`` item of the previous response."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: str = Field(max_length=MAX_PROMPT_CHARS)


class FunctionToolChoice(ToolName):
    """The Responses API's named tool choice: the run's first step calls this function."""

    type: Literal["function"]


class ResponseRequest(_Request):
    """Every field is honoured or refused: a field OpenAI defines that this server cannot honour (text,
    reasoning, truncation, max_tool_calls, ...), or one nobody defines, is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: ModelName | None = Field(None, description="default: agent.model, else the engine's default model")
    input: Annotated[str, Field(min_length=1, max_length=MAX_GOAL_CHARS)] | Annotated[
        list[InputMessage | FunctionCallInput | FunctionCallOutput | ToolCallInput],
        Field(min_length=1, max_length=MAX_MESSAGES)] = Field(
        description="a new turn: a string, or items (messages of every role, function_call, "
                    "function_call_output, the tool_call items of earlier responses): a whole conversation re-sent, or its new items after "
                    "previous_response_id; its last user message is the question. A run waiting for a caller's "
                    "call is resumed by that call's function_call_output, alone or last in the re-sent history")
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS,
                                             description="tools the caller runs (besides agent.tools, run here; "
                                                         "one of them shadows a configured tool of its name)")
    previous_response_id: str | None = Field(None, max_length=MAX_ID_CHARS,
                                             description="resume the run that response left waiting for a call, "
                                                         "or go on with the conversation a finished one ends")
    stream: bool = False
    instructions: str | None = Field(None, max_length=MAX_GOAL_CHARS,
                                     description="the caller's system text, added to the agent's own system prompt")
    metadata: dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                   Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]] | None = Field(
        None, max_length=MAX_METADATA_PAIRS, description="echoed on the response")
    include: Annotated[list[str], Field(max_length=0)] | None = Field(
        None, description="only empty: no extra output (reasoning, logprobs) is produced")
    tool_choice: Literal["auto", "required", "none"] | FunctionToolChoice | None = Field(
        None, description="auto (default: the agent's step policy chooses); required: the first step calls a tool; "
                          "a named function: the first step calls it; none: no tools are offered")
    parallel_tool_calls: bool | None = Field(None, description="default true; false: at most one call per step")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="default: agent.temperature")
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: MaxTokens | None = Field(None, description="the run's generated tokens in all (every "
                                                                  "step's); reached: status incomplete, reason "
                                                                  "max_output_tokens")
    priority: Priority | None = Field(None, description=PRIORITY_DOC + "; every model step of the run has it")
    store: bool | None = Field(None, description="default true: the finished response is kept for GET and "
                                                 "previous_response_id (gateway.agent_wait_s); false: not kept (a "
                                                 "run waiting for a caller's call is still held for its output)")


class OutputText(_Reply):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)


class MessageItem(_Reply):
    """The model's text at one step; the run's last one is its answer."""

    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed"] = "completed"
    content: list[OutputText]
    step: int = Field(description="extension: the model turn it came from")


class FunctionCallItem(_Reply):
    """A call of a caller's tool: run it, and post its output with previous_response_id to resume the run."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="a JSON object, as a string")
    status: Literal["in_progress", "completed"] = "completed"
    step: int


class ToolCallItem(_Reply):
    """Extension: a call of a configured tool, run by the gateway, with its result (as OpenAI's server-side
    tools report theirs), so a caller never runs it."""

    type: Literal["tool_call"] = "tool_call"
    id: str
    name: str
    arguments: str
    output: str
    error: str | None = None
    status: Literal["in_progress", "completed", "failed"]
    #: Always empty: an SDK that reads an item type it does not know as a message (the openai SDK's union falls
    #: back to one) then finds a message with nothing in it, not ``content: null`` (pydantic-ai fails on that).
    content: list = Field(default_factory=list)
    step: int


OutputItem = Annotated[MessageItem | FunctionCallItem | ToolCallItem, Field(discriminator="type")]


class ResponseError(_Reply):
    code: str
    message: str


class IncompleteDetails(_Reply):
    reason: Literal["max_iterations", "max_output_tokens"]


class InputTokensDetails(_Reply):
    cached_tokens: int = Field(description="prompt tokens reused from the session's KV cache")


class OutputTokensDetails(_Reply):
    reasoning_tokens: int = 0


class ResponseUsage(_Reply):
    """The tokens of the model turns this response's part of the run took (all its steps)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class Response(_Reply):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "requires_action", "incomplete", "failed"] = Field(
        description="requires_action (extension, as OpenAI's Assistants name it): the last output item is a "
                    "function_call waiting for its output")
    output: list[OutputItem]
    previous_response_id: str | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None


class ResponseDeleted(_Reply):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True


class ResponseEvent(_Reply):
    """One SSE event of a streamed run (its ``event:`` is its ``type``), in the sequence OpenAI's SDKs read: each
    item added, its text or arguments as a delta then done, the item done; the response's lifecycle around them."""

    type: Literal["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.function_call_arguments.delta",
                  "response.function_call_arguments.done", "response.output_item.done", "response.completed",
                  "response.incomplete", "response.failed"]
    sequence_number: int
    response: Response | None = Field(None, description="in the lifecycle events (created, in_progress, the last)")
    output_index: int | None = Field(None, description="in an item's events")
    item: OutputItem | None = Field(None, description="in output_item.added (empty, in progress) and .done")
    item_id: str | None = Field(None, description="in a content part's, text's and arguments' events")
    content_index: int | None = None
    part: OutputText | None = Field(None, description="in content_part.added (no text yet) and .done")
    delta: str | None = Field(None, description="in output_text.delta and function_call_arguments.delta")
    text: str | None = Field(None, description="in output_text.done")
    arguments: str | None = Field(None, description="in function_call_arguments.done")
    logprobs: list[Any] | None = Field(None, description="in output_text.delta and .done: always empty")
