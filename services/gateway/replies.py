"""OpenAI result objects from what the inference service answers: whole results and stream chunks.

A ``Shape`` knows one endpoint's objects: ``ChatShape`` (``chat`` results:
message, tool calls, finish_reason) and ``CompletionShape`` (``generate``
results: text, stop_reason). Both report the same ``usage`` (with
``prompt_tokens_details.cached_tokens``, the prompt tokens the session's KV
already held) and llama-server's ``timings``.

In a stream, usage travels on the chunk that carries finish_reason, as
llama-server sends it; a client that asked ``stream_options.include_usage``
gets OpenAI's form instead, one more chunk with no choices and the usage, so a
client that adds up usage over chunks never counts it twice.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from services.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Completion,
    CompletionChoice,
    Delta,
    CalledFunction,
    CallMade,
    FunctionCallDelta,
    PromptTokensDetails,
    Timings,
    ToolCallDelta,
    Usage,
)
from shared import protocol
from shared.protocol import ChatResult, GenerateResult, Stats, ToolCall


def usage(stats: Stats) -> Usage:
    return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
                 total_tokens=stats.prompt_tokens + stats.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens))


def timings(stats: Stats) -> Timings:
    return Timings(cache_n=stats.cached_tokens, prompt_n=stats.prefill_tokens,
                   prompt_ms=round(stats.ttft_s * 1000, 3), prompt_per_second=stats.prefill_tps,
                   predicted_n=stats.completion_tokens,
                   predicted_ms=round(max(stats.total_s - stats.ttft_s, 0.0) * 1000, 3),
                   predicted_per_second=stats.decode_tps)


_R = TypeVar("_R", GenerateResult, ChatResult)


class Shape(Generic[_R]):
    """What every result and chunk of one request shares: its id, creation time, model."""

    id_prefix = ""
    result_type: type[_R]

    def __init__(self, model: str, include_usage: bool = False):
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def read(self, body: dict[str, Any]) -> _R:
        """The final ``ok`` body, validated as its type (the gateway's one reading of it)."""
        return protocol.read_result(self.result_type, body)

    def _common(self, final: _R | None = None) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": (final and final.stats.model) or self.model,
                "system_fingerprint": final and final.stats.settings_id}

    def result(self, final: _R) -> BaseModel:
        """The whole result of a request that does not stream."""
        raise NotImplementedError

    def finish_reason(self, final: _R) -> str:
        raise NotImplementedError

    # --- streams -------------------------------------------------------------------------
    def opening(self) -> list[BaseModel]:
        """Chunks sent before the first token."""
        return []

    def on_event(self, event: dict[str, Any]) -> list[BaseModel]:
        """Chunks for one ``event`` frame."""
        raise NotImplementedError

    def closing(self, final: _R) -> list[BaseModel]:
        """The chunk with finish_reason (and usage, unless include_usage asks for a chunk of its own)."""
        last = self._finish_chunk(final, self.finish_reason(final))
        figures = {"usage": usage(final.stats), "timings": timings(final.stats)}
        if not self.include_usage:
            return [*self.reconcile(final), last.model_copy(update=figures)]
        return [*self.reconcile(final), last, last.model_copy(update={"choices": [], **figures})]

    def reconcile(self, final: _R) -> list[BaseModel]:
        """Chunks for what the final result holds but no event carried."""
        return []

    def _finish_chunk(self, final: _R, reason: str) -> BaseModel:
        raise NotImplementedError


class ChatShape(Shape[ChatResult]):
    id_prefix = "chatcmpl-"
    result_type = ChatResult

    def __init__(self, model: str, include_usage: bool = False):
        super().__init__(model, include_usage)
        self.streamed_text = ""
        self.streamed_calls: set[int] = set()

    def finish_reason(self, final: ChatResult) -> str:
        return final.finish_reason

    def result(self, final: ChatResult) -> ChatCompletion:
        calls = [_tool_call(c) for c in final.message.tool_calls]
        return ChatCompletion(**self._common(final), choices=[ChatChoice(
            index=0, message=AssistantMessage(content=final.message.content, tool_calls=calls or None),
            finish_reason=final.finish_reason)], usage=usage(final.stats), timings=timings(final.stats))

    def _chunk(self, delta: Delta, reason: str | None = None, final: ChatResult | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._common(final),
                                   choices=[ChunkChoice(index=0, delta=delta, finish_reason=reason)])

    def opening(self) -> list[BaseModel]:
        return [self._chunk(Delta(role="assistant", content=""))]

    def on_event(self, event: dict[str, Any]) -> list[BaseModel]:
        if event.get("text"):
            self.streamed_text += event["text"]
            return [self._chunk(Delta(content=event["text"]))]
        if event.get("tool_call"):
            return [self._call_chunk(event["tool_call"])]
        return []

    def _call_chunk(self, call: dict[str, Any]) -> ChatCompletionChunk:
        index = int(call.get("index", len(self.streamed_calls)))
        self.streamed_calls.add(index)
        return self._chunk(Delta(tool_calls=[ToolCallDelta(
            index=index, id=call.get("id"), type="function", error=call.get("error"),
            function=FunctionCallDelta(name=call.get("name"), arguments=call.get("arguments")))]))

    def reconcile(self, final: ChatResult) -> list[BaseModel]:
        chunks: list[BaseModel] = []
        if unsent := protocol.unsent_text(final.content, self.streamed_text):
            chunks.append(self._chunk(Delta(content=unsent)))
        for index, call in enumerate(final.message.tool_calls):
            if index not in self.streamed_calls:
                chunks.append(self._call_chunk({"index": index, "id": call.id, "name": call.function.name,
                                                "arguments": call.function.arguments, "error": call.error}))
        return chunks

    def _finish_chunk(self, final: ChatResult, reason: str) -> BaseModel:
        return self._chunk(Delta(), reason, final)


class CompletionShape(Shape[GenerateResult]):
    id_prefix = "cmpl-"
    result_type = GenerateResult

    def __init__(self, model: str, include_usage: bool = False, echo: str | None = None):
        super().__init__(model, include_usage)
        self.echo = echo  # the prompt, when the client asked for it back

    def finish_reason(self, final: GenerateResult) -> str:
        return protocol.finish_reason(final.stats.stop_reason)

    def result(self, final: GenerateResult) -> Completion:
        return Completion(**self._common(final), choices=[CompletionChoice(
            index=0, text=(self.echo or "") + final.text, finish_reason=self.finish_reason(final))],
            usage=usage(final.stats), timings=timings(final.stats))

    def _chunk(self, text: str, reason: str | None = None, final: GenerateResult | None = None) -> Completion:
        return Completion(**self._common(final), choices=[CompletionChoice(index=0, text=text, finish_reason=reason)])

    def opening(self) -> list[BaseModel]:
        return [self._chunk(self.echo)] if self.echo else []

    def on_event(self, event: dict[str, Any]) -> list[BaseModel]:
        return [self._chunk(event["text"])] if event.get("text") else []

    def _finish_chunk(self, final: GenerateResult, reason: str) -> BaseModel:
        return self._chunk("", reason, final)


def _tool_call(call: ToolCall) -> CallMade:
    return CallMade(id=call.id or f"call_{uuid.uuid4().hex[:24]}", error=call.error,
                    function=CalledFunction(name=call.function.name, arguments=call.function.arguments))
