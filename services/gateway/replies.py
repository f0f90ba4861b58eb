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
from typing import Any

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


def usage(stats: dict[str, Any]) -> Usage:
    prompt, completion = int(stats.get("prompt_tokens", 0)), int(stats.get("completion_tokens", 0))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=int(stats.get("cached_tokens", 0))))


def timings(stats: dict[str, Any]) -> Timings:
    ttft_s, total_s = float(stats.get("ttft_s") or 0.0), float(stats.get("total_s") or 0.0)
    return Timings(cache_n=int(stats.get("cached_tokens", 0)), prompt_n=int(stats.get("prefill_tokens", 0)),
                   prompt_ms=round(ttft_s * 1000, 3), prompt_per_second=stats.get("prefill_tps"),
                   predicted_n=int(stats.get("completion_tokens", 0)),
                   predicted_ms=round(max(total_s - ttft_s, 0.0) * 1000, 3),
                   predicted_per_second=stats.get("decode_tps"))


def finish_reason(stats: dict[str, Any]) -> str:
    """A chat reply says it (``finish_reason``); a generate reply's ``stop_reason`` is mapped the same way."""
    return stats.get("finish_reason") or protocol.finish_reason(stats.get("stop_reason"))


class Shape:
    """What every result and chunk of one request shares: its id, creation time, model."""

    id_prefix = ""

    def __init__(self, model: str, include_usage: bool = False):
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _common(self, final: dict[str, Any] | None = None) -> dict[str, Any]:
        final = final or {}
        return {"id": self.id, "created": self.created, "model": final.get("model") or self.model,
                "system_fingerprint": final.get("settings_id")}

    def result(self, final: dict[str, Any]) -> BaseModel:
        """The whole result of a request that does not stream."""
        raise NotImplementedError

    # --- streams -------------------------------------------------------------------------
    def opening(self) -> list[BaseModel]:
        """Chunks sent before the first token."""
        return []

    def on_event(self, event: dict[str, Any]) -> list[BaseModel]:
        """Chunks for one ``event`` frame."""
        raise NotImplementedError

    def closing(self, final: dict[str, Any]) -> list[BaseModel]:
        """The chunk with finish_reason (and usage, unless include_usage asks for a chunk of its own)."""
        last = self._finish_chunk(final, finish_reason(final))
        if not self.include_usage:
            return [*self.reconcile(final), last.model_copy(update={"usage": usage(final),
                                                                     "timings": timings(final)})]
        usage_only = last.model_copy(update={"choices": [], "usage": usage(final), "timings": timings(final)})
        return [*self.reconcile(final), last, usage_only]

    def reconcile(self, final: dict[str, Any]) -> list[BaseModel]:
        """Chunks for what the final result holds but no event carried."""
        return []

    def _finish_chunk(self, final: dict[str, Any], reason: str) -> BaseModel:
        raise NotImplementedError


class ChatShape(Shape):
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, include_usage: bool = False):
        super().__init__(model, include_usage)
        self.streamed_text = ""
        self.streamed_calls: set[int] = set()

    def result(self, final: dict[str, Any]) -> ChatCompletion:
        message = final.get("message") or {}
        calls = [_tool_call(c) for c in message.get("tool_calls") or []]
        return ChatCompletion(**self._common(final), choices=[ChatChoice(
            index=0, message=AssistantMessage(content=message.get("content"), tool_calls=calls or None),
            finish_reason=finish_reason(final))], usage=usage(final), timings=timings(final))

    def _chunk(self, delta: Delta, reason: str | None = None, final: dict | None = None) -> ChatCompletionChunk:
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

    def reconcile(self, final: dict[str, Any]) -> list[BaseModel]:
        message = final.get("message") or {}
        chunks: list[BaseModel] = []
        if unsent := protocol.unsent_text(message.get("content") or "", self.streamed_text):
            chunks.append(self._chunk(Delta(content=unsent)))
        for index, call in enumerate(message.get("tool_calls") or []):
            if index not in self.streamed_calls:
                fn = call.get("function") or {}
                chunks.append(self._call_chunk({"index": index, "id": call.get("id"), "name": fn.get("name"),
                                                "arguments": fn.get("arguments"), "error": call.get("error")}))
        return chunks

    def _finish_chunk(self, final: dict[str, Any], reason: str) -> BaseModel:
        return self._chunk(Delta(), reason, final)


class CompletionShape(Shape):
    id_prefix = "cmpl-"

    def __init__(self, model: str, include_usage: bool = False, echo: str | None = None):
        super().__init__(model, include_usage)
        self.echo = echo  # the prompt, when the client asked for it back

    def result(self, final: dict[str, Any]) -> Completion:
        text = (self.echo or "") + final.get("text", "")
        return Completion(**self._common(final), choices=[CompletionChoice(
            index=0, text=text, finish_reason=finish_reason(final))], usage=usage(final), timings=timings(final))

    def _chunk(self, text: str, reason: str | None = None, final: dict | None = None) -> Completion:
        return Completion(**self._common(final), choices=[CompletionChoice(index=0, text=text, finish_reason=reason)])

    def opening(self) -> list[BaseModel]:
        return [self._chunk(self.echo)] if self.echo else []

    def on_event(self, event: dict[str, Any]) -> list[BaseModel]:
        return [self._chunk(event["text"])] if event.get("text") else []

    def _finish_chunk(self, final: dict[str, Any], reason: str) -> BaseModel:
        return self._chunk("", reason, final)


def _tool_call(call: dict[str, Any]) -> CallMade:
    fn = call.get("function") or {}
    return CallMade(id=call.get("id") or f"call_{uuid.uuid4().hex[:24]}", error=call.get("error"),
                    function=CalledFunction(name=fn.get("name") or "", arguments=fn.get("arguments") or ""))
