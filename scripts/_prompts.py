"""Gemma 3 turn markup for raw ``generate`` prompts (tests and benchmarks of raw completion on the small base model).

Agents and ``magnitude generate --chat`` use the ``chat`` message instead, which renders each model's own
template. Keeping a conversation as one growing string is what lets a session reuse its KV from one step to
the next.
"""

from __future__ import annotations


def gemma_turn(role: str, text: str) -> str:
    """One turn; ``role`` is ``user`` or ``model`` (Gemma has no system role: fold it into the first user turn)."""
    return f"<start_of_turn>{role}\n{text}<end_of_turn>\n"


def gemma_prompt(turns: list[tuple[str, str]]) -> str:
    """The whole conversation, ending with an open model turn for the reply."""
    return "".join(gemma_turn(role, text) for role, text in turns) + "<start_of_turn>model\n"
