"""Prompt text in the Gemma 3 chat format (the bundled model's).

The inference service completes raw text, so the agent side owns the format;
keeping the whole history as one growing string is what lets a session reuse
its KV cache from one step to the next.
"""

from __future__ import annotations


def gemma_turn(role: str, text: str) -> str:
    """One turn; ``role`` is ``user`` or ``model`` (Gemma has no system role: fold it into the first user turn)."""
    return f"<start_of_turn>{role}\n{text}<end_of_turn>\n"


def gemma_prompt(turns: list[tuple[str, str]]) -> str:
    """The whole conversation, ending with an open model turn for the reply."""
    return "".join(gemma_turn(role, text) for role, text in turns) + "<start_of_turn>model\n"
