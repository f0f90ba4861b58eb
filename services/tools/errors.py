"""The typed failure every tool raises, so the agent sees why a call failed and the service keeps serving."""

from __future__ import annotations

from shared.protocol import ErrorCode, ProtocolError

#: Why a tool call failed; the first word of a ``tool_failed`` message.
KINDS = ("timeout", "cpu_limit", "memory_limit", "crashed", "raised", "refused", "unavailable")


def tool_failed(kind: str, message: str) -> ProtocolError:
    assert kind in KINDS, kind
    return ProtocolError(ErrorCode.TOOL_FAILED, f"{kind}: {message}")
