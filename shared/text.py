"""Bounding text that grows without a limit of its own: a tool's output, from a sandboxed tool, an MCP server or
a caller of /v1/responses, is kept up to a cap, and the model is told what was cut."""

from __future__ import annotations


def cap_text(text: str, cap: int) -> tuple[str, bool]:
    """At most ``cap`` bytes of ``text``, with a note saying it was cut; and whether it was."""
    data = text.encode()
    if len(data) <= cap:
        return text, False
    kept = data[:cap].decode("utf-8", errors="ignore")
    return f"{kept}\n[output truncated: {len(data)} bytes, kept the first {cap}]", True
